// Tests of the token data reader (lib/calib.c): random sequences written by the test from a
// seed in both formats read back exactly (also with CRLF line ends, a byte-order mark, tabs,
// extra JSON keys and no final newline); the sample cap, the length cut and the vocabulary
// check; and a table of broken files, each of which must fail with LM_ERR_FORMAT (or the
// status for a missing file, a directory, a FIFO or a device, refused without blocking) and a
// message naming the file and the line, also when the defect is put on a random line of an
// otherwise good file.
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "calib.h"
#include "check.h"
#include "testfs.h"
#include "util.h"

static uint64_t rng = 12345;
static uint64_t next_u64(void)
{
    uint64_t z = (rng += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

enum { N_SEQ = 40, MAX_LEN = 70 };

typedef struct data {
    int32_t ids[N_SEQ][MAX_LEN];
    int64_t len[N_SEQ];
} data;

static void make_data(data *d)
{
    for (int i = 0; i < N_SEQ; i++) {
        d->len[i] = 1 + (int64_t)(next_u64() % MAX_LEN);
        for (int64_t p = 0; p < d->len[i]; p++)
            d->ids[i][p] = (int32_t)(next_u64() % 1000);
    }
}

// The data as text; `style` varies the spelling: 0 plain, 1 CRLF + BOM + no final newline,
// 2 tabs and extra spaces (txt) or extra keys and spaces (jsonl).
static char *write_data(const data *d, bool jsonl, int style)
{
    lm_buf b = {0};
    if (style == 1)
        lm_buf_str(&b, "\xEF\xBB\xBF");
    for (int i = 0; i < N_SEQ; i++) {
        if (jsonl)
            lm_buf_str(&b, style == 2 ? "  {\"text\": \"a, b]\", \"input_ids\" : [" : "{\"input_ids\": [");
        else if (style == 2)
            lm_buf_str(&b, " \t");
        for (int64_t p = 0; p < d->len[i]; p++)
            lm_buf_fmt(&b, "%s%d", p == 0 ? "" : jsonl ? ", " : style == 2 ? " \t " : " ", (int)d->ids[i][p]);
        if (jsonl)
            lm_buf_str(&b, style == 2 ? "], \"attention_mask\": [1]} " : "]}");
        else if (style == 2)
            lm_buf_str(&b, "  ");
        if (i + 1 < N_SEQ || style != 1)
            lm_buf_str(&b, style == 1 ? "\r\n" : "\n");
    }
    return b.p;
}

// Checks that c holds d, cut to max_len and capped at max_samples.
static void check_same(const lm_calib *c, const data *d, int64_t max_samples, int64_t max_len, const char *what)
{
    int64_t n = max_samples ? max_samples : N_SEQ, cut = 0, tokens = 0;
    CHECK_MSG(c->n_seqs == n, "%s: %lld sequences", what, (long long)c->n_seqs);
    if (c->n_seqs != n)
        return;
    int bad = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t want = max_len && d->len[i] > max_len ? max_len : d->len[i];
        cut += want < d->len[i];
        tokens += want;
        bad += c->offsets[i + 1] - c->offsets[i] != want || c->lines[i] != i + 1 ||
               memcmp(c->ids + c->offsets[i], d->ids[i], (size_t)want * sizeof(int32_t)) != 0;
    }
    CHECK_MSG(bad == 0, "%s: %d sequences differ", what, bad);
    CHECK_MSG(c->n_cut == cut && c->n_tokens == tokens, "%s: cut %lld, tokens %lld", what, (long long)c->n_cut,
              (long long)c->n_tokens);
    CHECK(c->capped == (n < N_SEQ));
}

static void test_round_trip(const char *dir)
{
    data d;
    make_data(&d);
    lm_err err;
    for (int jsonl = 0; jsonl < 2; jsonl++)
        for (int style = 0; style < 3; style++) {
            char name[32], what[64];
            snprintf(name, sizeof name, "rt%d.%s", style, jsonl ? "jsonl" : "txt");
            char *text = write_data(&d, jsonl, style), *path = lm_path_join(dir, name);
            write_text(dir, name, text);
            snprintf(what, sizeof what, "%s", name);
            lm_calib c;
            lm_calib_opts all = {.vocab_size = 1000};
            CHECK_OK(lm_calib_load(&c, path, &all, &err), &err);
            check_same(&c, &d, 0, 0, what);
            CHECK(strcmp(c.path, path) == 0);
            lm_calib_free(&c);
            lm_calib_free(&c);  // twice is safe
            lm_calib_opts capped = {.max_samples = 7, .max_len = 9};
            CHECK_OK(lm_calib_load(&c, path, &capped, &err), &err);
            check_same(&c, &d, 7, 9, what);
            lm_calib_free(&c);
            lm_calib_opts exact = {.max_samples = N_SEQ};
            CHECK_OK(lm_calib_load(&c, path, &exact, &err), &err);
            check_same(&c, &d, 0, 0, what);
            CHECK(!c.capped);
            lm_calib_free(&c);
            // the vocabulary: every id below 1000, and some at or above 500
            lm_calib_opts small = {.vocab_size = 500};
            CHECK_FAILS(lm_calib_load(&c, path, &small, &err), LM_ERR_FORMAT, "is outside the vocabulary "
                        "(vocab_size 500)", &err);
            CHECK(c.n_seqs == 0 && c.ids == NULL);
            free(text);
            free(path);
        }
}

typedef struct bad_case {
    const char *name;
    const char *text;
    int64_t vocab;
    lm_status want;
    const char *needle;  // after "PATH"
} bad_case;

static const bad_case bad_cases[] = {
    {"vocab.jsonl", "{\"input_ids\": [1, 2]}\n{\"input_ids\": [1, 2, 300]}\n", 256, LM_ERR_FORMAT,
     ":2: input_ids[2]: token id 300 is outside the vocabulary (vocab_size 256)"},
    {"empty_seq.jsonl", "{\"input_ids\": [1, 2]}\n{\"input_ids\": []}\n", 0, LM_ERR_FORMAT, ":2: empty sequence"},
    {"json.jsonl", "{\"input_ids\": [1, 2}\n", 0, LM_ERR_FORMAT, ":1: invalid JSON near column"},
    {"array.jsonl", "[1, 2, 3]\n", 0, LM_ERR_FORMAT, ":1: not a JSON object"},
    {"nokey.jsonl", "{\"input_ids\": [5]}\n{\"ids\": [1]}\n", 0, LM_ERR_FORMAT, ":2: no \"input_ids\" key"},
    {"string.jsonl", "{\"input_ids\": \"1 2\"}\n", 0, LM_ERR_FORMAT, ":1: \"input_ids\" is not an array"},
    {"frac.jsonl", "{\"input_ids\": [1, 2.5]}\n", 0, LM_ERR_FORMAT, ":1: input_ids[1] is 2.5, not a token id"},
    {"neg.jsonl", "{\"input_ids\": [1, -3]}\n", 0, LM_ERR_FORMAT, ":1: input_ids[1] is -3, not a token id"},
    {"nested.jsonl", "{\"input_ids\": [[1, 2]]}\n", 0, LM_ERR_FORMAT, ":1: input_ids[0] is an array"},
    {"big.jsonl", "{\"input_ids\": [1, 3000000000]}\n", 0, LM_ERR_FORMAT, ":1: input_ids[1] is 3000000000"},
    {"two.jsonl", "{\"input_ids\": [1]} {\"input_ids\": [2]}\n", 0, LM_ERR_FORMAT,
     ":1: text after the JSON value at column 20"},
    {"blank.jsonl", "{\"input_ids\": [1]}\n\n{\"input_ids\": [2]}\n", 0, LM_ERR_FORMAT, ":2: empty line"},
    {"spaces.jsonl", "{\"input_ids\": [1]}\n  \r\n", 0, LM_ERR_FORMAT, ":2: empty line"},
    {"nul.jsonl", "{\"input_ids\": [1]}\n{\"input_ids\": [1]}\n\0\n", 0, LM_ERR_FORMAT, ":3: a NUL byte"},
    {"empty.jsonl", "", 0, LM_ERR_FORMAT, ": no sequences"},
    {"word.txt", "1 2 3\n4 x 5\n", 0, LM_ERR_FORMAT, ":2: column 3: 'x' is not a token id"},
    {"blank.txt", "1 2\n\n3\n", 0, LM_ERR_FORMAT, ":2: empty line"},
    {"vocab.txt", "1 2 300\n", 256, LM_ERR_FORMAT, ":1: token 3: token id 300 is outside the vocabulary"},
    {"neg.txt", "7\n1 -2\n", 0, LM_ERR_FORMAT, ":2: column 3: '-2' is not a token id"},
    {"frac.txt", "1 2.0\n", 0, LM_ERR_FORMAT, ":1: column 3: '2.0' is not a token id"},
    {"big.txt", "99999999999\n", 0, LM_ERR_FORMAT, ":1: token 1: '99999999999' is too large for a token id"},
    {"commas.txt", "1,2,3\n", 0, LM_ERR_FORMAT, ":1: column 1: '1,2,3' is not a token id"},
    {"json.txt", "{\"input_ids\": [1]}\n", 0, LM_ERR_FORMAT, ":1: column 1:"},
    {"empty.txt", "", 0, LM_ERR_FORMAT, ": no sequences"},
    {"data.csv", "1,2\n", 0, LM_ERR_FORMAT, ": unknown data format"},
    // each line goes through the one JSON reader: duplicate keys, bad UTF-8, huge numbers
    {"dup.jsonl", "{\"input_ids\": [1, 2], \"input_ids\": [3]}\n", 0, LM_ERR_FORMAT,
     ":1: column 23: key 'input_ids' appears twice"},
    {"utf8.jsonl", "{\"input_ids\": [1], \"text\": \"caf\xE9\"}\n", 0, LM_ERR_FORMAT,
     ":1: column 32: a string is not valid UTF-8 (byte 0xE9)"},
    {"huge.jsonl", "{\"input_ids\": [1, 1e400]}\n", 0, LM_ERR_FORMAT,
     ":1: column 19: input_ids[1]: 1e400 is out of range"},
};

// Writes n bytes (the table's texts may hold a NUL) to dir/name.
static char *write_bytes(const char *dir, const char *name, const char *text, size_t n)
{
    char *p = lm_path_join(dir, name);
    lm_err err;
    CHECK_OK(lm_write_file(p, text, n, &err), &err);
    return p;
}

static void test_broken(const char *dir)
{
    lm_err err;
    for (size_t i = 0; i < sizeof bad_cases / sizeof bad_cases[0]; i++) {
        const bad_case *b = &bad_cases[i];
        size_t n = strlen(b->text);
        if (strcmp(b->name, "nul.jsonl") == 0)
            n += 2;  // the NUL and the newline after it
        char *path = write_bytes(dir, b->name, b->text, n);
        char needle[512];
        snprintf(needle, sizeof needle, "%s%s", path, b->needle);
        lm_calib c;
        lm_calib_opts o = {.vocab_size = b->vocab};
        CHECK_FAILS(lm_calib_load(&c, path, &o, &err), b->want, needle, &err);
        CHECK(c.n_seqs == 0 && c.path == NULL);
        free(path);
    }
    // a defect after the sample cap is not read
    char *path = write_bytes(dir, "late.txt", "1 2\n3 4\nx\n", 10);
    lm_calib c;
    lm_calib_opts two = {.max_samples = 2};
    CHECK_OK(lm_calib_load(&c, path, &two, &err), &err);
    CHECK(c.n_seqs == 2 && c.capped);
    lm_calib_free(&c);
    lm_calib_opts all = {0};
    CHECK_FAILS(lm_calib_load(&c, path, &all, &err), LM_ERR_FORMAT, ":3: column 1: 'x'", &err);
    free(path);
    // a missing file, a directory
    path = lm_path_join(dir, "missing.jsonl");
    CHECK_FAILS(lm_calib_load(&c, path, &all, &err), LM_ERR_NOT_FOUND, path, &err);
    free(path);
    path = subdir(dir, "dir.jsonl");
    CHECK_FAILS(lm_calib_load(&c, path, &all, &err), LM_ERR_USAGE, "is a directory", &err);
    free(path);
    // A FIFO would block a plain open until a writer came: it is refused without waiting (the
    // alarm turns a hang into a failure of this test), as is a device.
    path = lm_path_join(dir, "fifo.jsonl");
    CHECK(mkfifo(path, 0644) == 0);
    alarm(60);
    CHECK_FAILS(lm_calib_load(&c, path, &all, &err), LM_ERR_USAGE, "is a FIFO, not a regular file", &err);
    alarm(0);
    CHECK(strstr(err.msg, path) != NULL && c.path == NULL);
    free(path);
    path = lm_path_join(dir, "null.txt");
    CHECK(symlink("/dev/null", path) == 0);
    CHECK_FAILS(lm_calib_load(&c, path, &all, &err), LM_ERR_USAGE, "is a character device, not a regular file",
                &err);
    free(path);
}

// Defects put on a random line of a good file: the message names that line.
static void test_random_defects(const char *dir)
{
    static const char *const defects_jsonl[] = {"{\"input_ids\": [1, 2", "{\"input_ids\": []}", "{}",
                                                "{\"input_ids\": [1, 1e3]}", ""};
    static const char *const defects_txt[] = {"1 2 three", "", "1 2 -4", "1 2 99999"};
    data d;
    make_data(&d);
    lm_err err;
    for (int round = 0; round < 24; round++) {
        bool jsonl = round % 2;
        int line = 1 + (int)(next_u64() % N_SEQ);
        const char *defect = jsonl ? defects_jsonl[next_u64() % 5] : defects_txt[next_u64() % 4];
        lm_buf b = {0};
        for (int i = 0; i < N_SEQ; i++) {
            if (i + 1 == line) {
                lm_buf_str(&b, defect);
            } else {
                lm_buf_str(&b, jsonl ? "{\"input_ids\": [" : "");
                for (int64_t p = 0; p < d.len[i]; p++)
                    lm_buf_fmt(&b, "%s%d", p ? (jsonl ? ", " : " ") : "", (int)d.ids[i][p]);
                lm_buf_str(&b, jsonl ? "]}" : "");
            }
            lm_buf_str(&b, "\n");
        }
        char name[32];
        snprintf(name, sizeof name, "defect%d.%s", round, jsonl ? "jsonl" : "txt");
        write_text(dir, name, b.p);
        free(b.p);
        char *path = lm_path_join(dir, name), needle[512];
        snprintf(needle, sizeof needle, "%s:%d: ", path, line);
        lm_calib c;
        lm_calib_opts o = {.vocab_size = 1000};
        CHECK_FAILS(lm_calib_load(&c, path, &o, &err), LM_ERR_FORMAT, needle, &err);
        free(path);
    }
}

int main(void)
{
    char *dir = make_tmpdir();
    test_round_trip(dir);
    test_broken(dir);
    test_random_defects(dir);
    remove_tmpdir(dir);
    return check_report("test_calib");
}
