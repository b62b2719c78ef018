// Tests of the safetensors writer (lib/st_writer.c) and atomic output directories
// (lib/outdir.c): files read back bit-exact with the reader for every dtype, the header bytes
// of a small case against a literal, the huggingface_hub shard rule at its boundaries (sizes
// worked out by hand here, not by the writer), the index JSON against a literal, refused and
// incomplete writes, tensors of several MB written in random parts from several threads with
// direct I/O and without (the same bytes either way), the fallback from direct I/O and a failed
// direct write, and output directories that refuse, commit, abort and replace. Each test works
// in a fresh directory under /tmp and removes it.
#define _GNU_SOURCE  // O_DIRECT
#include <dirent.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "check.h"
#include "testfs.h"
#include "outdir.h"
#include "safetensors.h"
#include "st_writer.h"
#include "util.h"

// ==== helpers =================================================================================

static uint64_t rng_next(uint64_t *s)
{
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static void fill_bytes(void *buf, size_t n, uint64_t seed)
{
    unsigned char *p = buf;
    for (size_t i = 0; i < n; i++)
        p[i] = (unsigned char)(rng_next(&seed) >> 56);
}

// Number of entries in `dir` other than . and .., and whether one has `needle` in its name.
static int count_entries(const char *dir, const char *needle, bool *found)
{
    DIR *d = opendir(dir);
    int n = 0;
    if (found)
        *found = false;
    if (!d)
        return -1;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0)
            continue;
        n++;
        if (needle && found && strstr(e->d_name, needle))
            *found = true;
    }
    closedir(d);
    return n;
}

static char *path_in(const char *dir, const char *name)
{
    char *p = lm_path_join(dir, name);
    if (!p)
        exit(1);
    return p;
}

static lm_st_desc desc(const char *name, lm_dtype dt, int ndim, int64_t d0, int64_t d1)
{
    lm_st_desc t = {.name = name, .dtype = dt, .ndim = ndim};
    t.shape[0] = d0;
    t.shape[1] = d1;
    return t;
}

// ==== round trips =============================================================================

typedef struct expect_order {
    const char *name;
    lm_dtype dt;
} expect_order;

static int cmp_expect(const void *pa, const void *pb)
{
    const expect_order *a = pa, *b = pb;
    if (a->dt != b->dt)
        return a->dt > b->dt ? -1 : 1;
    return strcmp(a->name, b->name);
}

// Every dtype, a scalar and zero-size tensors, written by the writer and by lm_st_write_file,
// read back with lm_st_open.
static void test_round_trip(void)
{
    lm_err err;
    char *dir = make_tmpdir();
    enum { NT = LM_DTYPE_COUNT + 3 };
    lm_st_desc t[NT];
    char names[NT][32];
    void *data[NT];
    uint64_t sizes[NT];
    for (int i = 0; i < LM_DTYPE_COUNT; i++) {
        // [2, 4]: 8 elements, whole bytes for F4 (4 bytes) and F6 (6 bytes) as well
        snprintf(names[i], sizeof names[i], "w.%s", lm_dtype_name((lm_dtype)i));
        t[i] = desc(names[i], (lm_dtype)i, 2, 2, 4);
        sizes[i] = lm_dtype_bits((lm_dtype)i);  // 8 elements * bits / 8
    }
    snprintf(names[LM_DTYPE_COUNT], 32, "scalar");
    t[LM_DTYPE_COUNT] = desc(names[LM_DTYPE_COUNT], LM_DTYPE_F32, 0, 0, 0);
    sizes[LM_DTYPE_COUNT] = 4;
    snprintf(names[LM_DTYPE_COUNT + 1], 32, "empty.rows");
    t[LM_DTYPE_COUNT + 1] = desc(names[LM_DTYPE_COUNT + 1], LM_DTYPE_BF16, 2, 0, 3);
    sizes[LM_DTYPE_COUNT + 1] = 0;
    snprintf(names[LM_DTYPE_COUNT + 2], 32, "empty.cols");
    t[LM_DTYPE_COUNT + 2] = desc(names[LM_DTYPE_COUNT + 2], LM_DTYPE_F16, 2, 3, 0);
    sizes[LM_DTYPE_COUNT + 2] = 0;
    for (int i = 0; i < NT; i++) {
        data[i] = malloc(sizes[i] + 1);
        fill_bytes(data[i], sizes[i], 1000 + (uint64_t)i);
    }
    const char *meta[] = {"producer", "test_writer", "quote", "\"a\\b\"\n", NULL};

    for (int via_file = 0; via_file < 2; via_file++) {
        char *path = path_in(dir, via_file ? "one.safetensors" : "model.safetensors");
        if (via_file) {
            CHECK_OK(lm_st_write_file(path, t, (const void *const *)data, NT, meta, &err), &err);
            CHECK(count_entries(dir, ".tmp", NULL) == 2);  // model.safetensors and this one
        } else {
            lm_st_writer *w = NULL;
            CHECK_OK(lm_st_writer_open(&w, dir, t, NT, 5000000000ull, meta, &err), &err);
            CHECK(w && lm_st_writer_plan(w)->n_shards == 1);
            // reverse order: the writer takes tensors in any order
            for (int i = NT - 1; w && i >= 0; i--)
                CHECK_OK(lm_st_writer_put(w, i, data[i], sizes[i], &err), &err);
            CHECK_OK(lm_st_writer_finish(w, &err), &err);
            lm_st_writer_free(w);
            char *idx = path_in(dir, "model.safetensors.index.json");
            CHECK(!lm_is_file(idx));
            free(idx);
        }

        lm_st_file *f = NULL;
        CHECK_OK(lm_st_open(&f, path, &err), &err);
        if (f) {
            CHECK(f->n_tensors == NT);
            for (int i = 0; i < NT; i++) {
                const lm_st_tensor *r = lm_st_find(f, names[i]);
                CHECK_MSG(r != NULL, "%s missing", names[i]);
                if (!r)
                    continue;
                CHECK(r->dtype == t[i].dtype);
                CHECK(r->ndim == t[i].ndim);
                for (int d = 0; d < t[i].ndim; d++)
                    CHECK(r->shape[d] == t[i].shape[d]);
                CHECK_MSG(r->nbytes == sizes[i], "%s: %llu bytes", names[i],
                          (unsigned long long)r->nbytes);
                CHECK_MSG(sizes[i] == 0 || memcmp(r->data, data[i], sizes[i]) == 0,
                          "%s: data differs", names[i]);
            }
            // data order = dtype descending, then name
            expect_order ord[NT];
            for (int i = 0; i < NT; i++)
                ord[i] = (expect_order){names[i], t[i].dtype};
            qsort(ord, NT, sizeof *ord, cmp_expect);
            for (int i = 0; i < NT && i < f->n_tensors; i++)
                CHECK_MSG(strcmp(f->tensors[i].name, ord[i].name) == 0, "position %d: %s, want %s",
                          i, f->tensors[i].name, ord[i].name);
            CHECK(f->n_meta == 3);
            CHECK(f->n_meta == 3 && strcmp(f->meta_keys[0], "format") == 0 &&
                  strcmp(f->meta_keys[1], "producer") == 0 && strcmp(f->meta_keys[2], "quote") == 0);
            const char *q = lm_st_meta(f, "quote");
            CHECK(q && strcmp(q, "\"a\\b\"\n") == 0);
            const char *fmt = lm_st_meta(f, "format");
            CHECK(fmt && strcmp(fmt, "pt") == 0);
            CHECK((8 + f->header_len) % 8 == 0);
        }
        lm_st_close(f);
        free(path);
    }

    // a given "format" is kept, not doubled
    {
        const char *m2[] = {"format", "mlx", NULL};
        char *path = path_in(dir, "fmt.safetensors");
        CHECK_OK(lm_st_write_file(path, t, (const void *const *)data, 1, m2, &err), &err);
        lm_st_file *f = NULL;
        CHECK_OK(lm_st_open(&f, path, &err), &err);
        CHECK(f && f->n_meta == 1 && strcmp(lm_st_meta(f, "format"), "mlx") == 0);
        lm_st_close(f);
        free(path);
    }

    // zero tensors: one model.safetensors holding only __metadata__
    {
        char *sub = path_in(dir, "empty");
        CHECK_OK(lm_mkdir_p(sub, &err), &err);
        lm_st_writer *w = NULL;
        CHECK_OK(lm_st_writer_open(&w, sub, NULL, 0, 100, NULL, &err), &err);
        CHECK(w && lm_st_writer_plan(w)->n_shards == 1);
        CHECK_OK(lm_st_writer_finish(w, &err), &err);
        lm_st_writer_free(w);
        char *path = path_in(sub, "model.safetensors");
        char *buf = NULL;
        size_t len = 0;
        CHECK_OK(lm_read_file(path, 1 << 20, &buf, &len, &err), &err);
        const char want[] = "\x20\0\0\0\0\0\0\0{\"__metadata__\":{\"format\":\"pt\"}}";
        CHECK(buf && len == 40 && memcmp(buf, want, 40) == 0);
        free(buf);
        lm_st_file *f = NULL;
        CHECK_OK(lm_st_open(&f, path, &err), &err);
        CHECK(f && f->n_tensors == 0);
        lm_st_close(f);
        free(path);
        free(sub);
    }

    for (int i = 0; i < NT; i++)
        free(data[i]);
    remove_tmpdir(dir);
}

// ==== the header, byte for byte ===============================================================

static void test_header_bytes(void)
{
    lm_err err;
    char *dir = make_tmpdir();
    const char *odd = "e\"\\\n\x01\xc3\xa9";  // quote, backslash, newline, U+0001, é
    lm_st_desc t[] = {
        desc("b", LM_DTYPE_BF16, 2, 2, 3),  // 12 bytes
        desc("a", LM_DTYPE_F32, 1, 2, 0),   // 8 bytes
        desc("c", LM_DTYPE_BF16, 0, 0, 0),  // 2 bytes
        desc(odd, LM_DTYPE_U8, 2, 0, 4),    // 0 bytes
    };
    unsigned char db[12], da[8], dc[2];
    fill_bytes(db, 12, 1);
    fill_bytes(da, 8, 2);
    fill_bytes(dc, 2, 3);
    const void *data[] = {db, da, dc, ""};
    const char *meta[] = {"zz", "1", "note", "tab\there", NULL};
    char *path = path_in(dir, "h.safetensors");
    CHECK_OK(lm_st_write_file(path, t, data, 4, meta, &err), &err);

    // 295 bytes of JSON, one space of padding
    static const char want_json[] =
        "{\"__metadata__\":{\"format\":\"pt\",\"note\":\"tab\\there\",\"zz\":\"1\"},"
        "\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
        "\"b\":{\"dtype\":\"BF16\",\"shape\":[2,3],\"data_offsets\":[8,20]},"
        "\"c\":{\"dtype\":\"BF16\",\"shape\":[],\"data_offsets\":[20,22]},"
        "\"e\\\"\\\\\\n\\u0001\xc3\xa9\":{\"dtype\":\"U8\",\"shape\":[0,4],\"data_offsets\":[22,22]}}"
        " ";
    size_t hlen = sizeof want_json - 1;
    CHECK(hlen == 296);
    char *buf = NULL;
    size_t len = 0;
    CHECK_OK(lm_read_file(path, 1 << 20, &buf, &len, &err), &err);
    CHECK_MSG(len == 8 + hlen + 22, "file is %zu bytes", len);
    if (buf && len == 8 + hlen + 22) {
        unsigned char n8[8] = {(unsigned char)(hlen & 0xFF), (unsigned char)(hlen >> 8)};
        CHECK(memcmp(buf, n8, 8) == 0);
        CHECK_MSG(memcmp(buf + 8, want_json, hlen) == 0, "header is\n%.*s\nwanted\n%s",
                  (int)hlen, buf + 8, want_json);
        CHECK(memcmp(buf + 8 + hlen, da, 8) == 0);
        CHECK(memcmp(buf + 8 + hlen + 8, db, 12) == 0);
        CHECK(memcmp(buf + 8 + hlen + 20, dc, 2) == 0);
    }
    free(buf);
    lm_st_file *f = NULL;
    CHECK_OK(lm_st_open(&f, path, &err), &err);
    CHECK(f && lm_st_find(f, odd) != NULL);
    lm_st_close(f);
    free(path);
    remove_tmpdir(dir);
}

// ==== the shard rule ==========================================================================

// Plans U8 tensors of the given byte sizes and compares shard_of and shard_bytes.
static void check_plan(const char *what, const int64_t *sizes, int n, uint64_t max,
                       const int *want_of, int want_shards, const uint64_t *want_bytes)
{
    lm_err err;
    lm_st_desc t[16];
    char names[16][8];
    for (int i = 0; i < n; i++) {
        snprintf(names[i], sizeof names[i], "t%d", i);
        t[i] = desc(names[i], LM_DTYPE_U8, 1, sizes[i], 0);
    }
    lm_shard_plan p;
    CHECK_OK(lm_shard_plan_make(&p, t, n, max, &err), &err);
    CHECK_MSG(p.n_shards == want_shards, "%s: %d shards, want %d", what, p.n_shards, want_shards);
    uint64_t total = 0;
    for (int i = 0; i < n; i++) {
        total += (uint64_t)sizes[i];
        CHECK_MSG(p.shard_of[i] == want_of[i], "%s: tensor %d in shard %d, want %d", what, i,
                  p.shard_of[i], want_of[i]);
    }
    for (int s = 0; s < want_shards && s < p.n_shards; s++)
        CHECK_MSG(p.shard_bytes[s] == want_bytes[s], "%s: shard %d has %llu bytes, want %llu",
                  what, s, (unsigned long long)p.shard_bytes[s], (unsigned long long)want_bytes[s]);
    CHECK(p.total_size == total);
    CHECK(p.n_tensors == n);
    lm_shard_plan_free(&p);
}

static void test_shard_plan(void)
{
    {   // exactly filling a shard keeps it one shard
        int64_t s[] = {4, 6};
        int of[] = {0, 0};
        uint64_t b[] = {10};
        check_plan("exact fill", s, 2, 10, of, 1, b);
    }
    {   // one byte over starts a new one
        int64_t s[] = {4, 7};
        int of[] = {0, 1};
        uint64_t b[] = {4, 7};
        check_plan("one over", s, 2, 10, of, 2, b);
    }
    {   // a tensor of exactly max is not "larger": it fills a shard of its own normally
        int64_t s[] = {10, 10, 0};
        int of[] = {0, 1, 1};
        uint64_t b[] = {10, 10};
        check_plan("exact max", s, 3, 10, of, 2, b);
    }
    {   // larger than max: own shard, numbered before the shard being filled
        int64_t s[] = {4, 11, 3, 5};
        int of[] = {1, 0, 1, 2};
        uint64_t b[] = {11, 7, 5};
        check_plan("oversized", s, 4, 10, of, 3, b);
    }
    {   // huggingface_hub's own test: sizes 6, 10, 30, 2, 2 with max 10
        int64_t s[] = {6, 10, 30, 2, 2};
        int of[] = {0, 2, 1, 3, 3};
        uint64_t b[] = {6, 30, 10, 4};
        check_plan("hub test", s, 5, 10, of, 4, b);
    }
    {   // the first tensor oversized
        int64_t s[] = {20, 1};
        int of[] = {0, 1};
        uint64_t b[] = {20, 1};
        check_plan("oversized first", s, 2, 10, of, 2, b);
    }
    {   // zero tensors: one empty shard
        uint64_t b[] = {0};
        check_plan("none", NULL, 0, 10, NULL, 1, b);
    }

    lm_err err;
    lm_shard_plan p;
    lm_st_desc bad = desc("f4.odd", LM_DTYPE_F4, 1, 3, 0);  // 12 bits
    CHECK_FAILS(lm_shard_plan_make(&p, &bad, 1, 10, &err), LM_ERR_USAGE, "f4.odd", &err);
    lm_st_desc neg = desc("neg", LM_DTYPE_F32, 2, 3, -1);
    CHECK_FAILS(lm_shard_plan_make(&p, &neg, 1, 10, &err), LM_ERR_USAGE, "neg", &err);
    lm_st_desc huge = desc("huge", LM_DTYPE_F64, 2, INT64_MAX, 4);
    CHECK_FAILS(lm_shard_plan_make(&p, &huge, 1, 10, &err), LM_ERR_USAGE, "overflow", &err);
    lm_st_desc dims = desc("dims", LM_DTYPE_F32, LM_ST_MAX_DIMS + 1, 1, 1);
    CHECK_FAILS(lm_shard_plan_make(&p, &dims, 1, 10, &err), LM_ERR_USAGE, "dims", &err);

    char name[64];
    CHECK(strcmp(lm_shard_name(name, sizeof name, 0, 1), "model.safetensors") == 0);
    CHECK(strcmp(lm_shard_name(name, sizeof name, 1, 3), "model-00002-of-00003.safetensors") == 0);
}

// ==== sharded files and the index =============================================================

static void test_sharded_write(void)
{
    lm_err err;
    char *dir = make_tmpdir();
    // F32, max 100 bytes: "bigé" (200) is oversized, shard 1; "layer.b" (40) + "a\"q" (60)
    // fill shard 2 exactly; "emoji😀" (4) would pass it, so it and the empty "z.zero" make
    // shard 3
    lm_st_desc t[] = {
        desc("layer.b", LM_DTYPE_F32, 1, 10, 0),
        desc("big\xc3\xa9", LM_DTYPE_F32, 2, 5, 10),
        desc("a\"q", LM_DTYPE_F32, 2, 3, 5),
        desc("emoji\xf0\x9f\x98\x80", LM_DTYPE_F32, 0, 0, 0),
        desc("z.zero", LM_DTYPE_F32, 2, 0, 7),
    };
    const uint64_t sizes[] = {40, 200, 60, 4, 0};
    const int want_shard[] = {1, 0, 1, 2, 2};
    unsigned char *data[5];
    for (int i = 0; i < 5; i++) {
        data[i] = malloc(sizes[i] + 1);
        fill_bytes(data[i], sizes[i], 50 + (uint64_t)i);
    }
    lm_st_writer *w = NULL;
    CHECK_OK(lm_st_writer_open(&w, dir, t, 5, 100, NULL, &err), &err);
    if (!w) {
        remove_tmpdir(dir);
        return;
    }
    const lm_shard_plan *p = lm_st_writer_plan(w);
    CHECK(p->n_shards == 3 && p->total_size == 304);
    for (int i = 0; i < 5; i++)
        CHECK(p->shard_of[i] == want_shard[i]);

    // every shard file already has its final size before any data
    static const char *files[] = {"model-00001-of-00003.safetensors",
                                  "model-00002-of-00003.safetensors",
                                  "model-00003-of-00003.safetensors"};
    for (int s = 0; s < 3; s++) {
        char *path = path_in(dir, files[s]);
        struct stat st;
        CHECK(stat(path, &st) == 0 && st.st_size > 8);
        free(path);
    }

    // tensor 1 in three parts, out of order
    CHECK_OK(lm_st_writer_put_part(w, 1, 120, data[1] + 120, 80, &err), &err);
    CHECK_OK(lm_st_writer_put_part(w, 1, 0, data[1], 50, &err), &err);
    CHECK_FAILS(lm_st_writer_put_part(w, 1, 40, data[1] + 40, 20, &err), LM_ERR_MISMATCH,
                "overlap", &err);
    CHECK_FAILS(lm_st_writer_put_part(w, 1, 190, data[1] + 190, 20, &err), LM_ERR_MISMATCH,
                "outside", &err);
    CHECK_OK(lm_st_writer_put_part(w, 1, 50, data[1] + 50, 70, &err), &err);
    CHECK_FAILS(lm_st_writer_put(w, 0, data[0], 39, &err), LM_ERR_MISMATCH, "layer.b", &err);
    for (int i = 0; i < 5; i++) {
        if (i != 1)
            CHECK_OK(lm_st_writer_put(w, i, data[i], sizes[i], &err), &err);
    }
    CHECK_FAILS(lm_st_writer_put(w, 0, data[0], 40, &err), LM_ERR_MISMATCH, "overlap", &err);
    CHECK_FAILS(lm_st_writer_put(w, 5, data[0], 40, &err), LM_ERR_USAGE, "index", &err);
    CHECK_OK(lm_st_writer_finish(w, &err), &err);
    lm_st_writer_free(w);

    for (int s = 0; s < 3; s++) {
        char *path = path_in(dir, files[s]);
        lm_st_file *f = NULL;
        CHECK_OK(lm_st_open(&f, path, &err), &err);
        int count = 0;
        for (int i = 0; f && i < 5; i++) {
            if (want_shard[i] != s)
                continue;
            count++;
            const lm_st_tensor *r = lm_st_find(f, t[i].name);
            CHECK_MSG(r && r->nbytes == sizes[i] &&
                      (sizes[i] == 0 || memcmp(r->data, data[i], sizes[i]) == 0),
                      "%s in %s", t[i].name, files[s]);
        }
        CHECK(f && f->n_tensors == count);
        lm_st_close(f);
        free(path);
    }
    char *single = path_in(dir, "model.safetensors");
    CHECK(!lm_is_file(single));
    free(single);

    static const char want_index[] =
        "{\n"
        "  \"metadata\": {\n"
        "    \"total_size\": 304\n"
        "  },\n"
        "  \"weight_map\": {\n"
        "    \"a\\\"q\": \"model-00002-of-00003.safetensors\",\n"
        "    \"big\\u00e9\": \"model-00001-of-00003.safetensors\",\n"
        "    \"emoji\\ud83d\\ude00\": \"model-00003-of-00003.safetensors\",\n"
        "    \"layer.b\": \"model-00002-of-00003.safetensors\",\n"
        "    \"z.zero\": \"model-00003-of-00003.safetensors\"\n"
        "  }\n"
        "}\n";
    char *ipath = path_in(dir, "model.safetensors.index.json");
    char *buf = NULL;
    CHECK_OK(lm_read_file(ipath, 1 << 20, &buf, NULL, &err), &err);
    CHECK_MSG(buf && strcmp(buf, want_index) == 0, "index is\n%s\nwanted\n%s", buf ? buf : "",
              want_index);
    free(buf);
    free(ipath);
    for (int i = 0; i < 5; i++)
        free(data[i]);
    remove_tmpdir(dir);
}

// ==== refusals ================================================================================

static void test_refusals(void)
{
    lm_err err;
    char *dir = make_tmpdir();
    lm_st_writer *w = NULL;
    unsigned char zeros[64] = {0};

    // finish names the incomplete tensor
    lm_st_desc t[] = {desc("done", LM_DTYPE_F32, 1, 4, 0), desc("half.written", LM_DTYPE_F32, 2, 4, 4)};
    CHECK_OK(lm_st_writer_open(&w, dir, t, 2, 1000, NULL, &err), &err);
    CHECK_OK(lm_st_writer_put(w, 0, zeros, 16, &err), &err);
    CHECK_OK(lm_st_writer_put_part(w, 1, 0, zeros, 32, &err), &err);
    CHECK_OK(lm_st_writer_put_part(w, 1, 32, zeros, 0, &err), &err);  // empty part: no-op
    CHECK_FAILS(lm_st_writer_finish(w, &err), LM_ERR_MISMATCH, "half.written", &err);
    CHECK(strstr(err.msg, "32 of 64") != NULL);
    CHECK_FAILS(lm_st_writer_put_part(w, 1, 32, zeros, 32, &err), LM_ERR_USAGE, "finish", &err);
    lm_st_writer_free(w);
    w = NULL;

    // duplicate names, the reserved name, invalid UTF-8, odd metadata, a missing directory
    lm_st_desc dup[] = {desc("x", LM_DTYPE_F32, 1, 1, 0), desc("x", LM_DTYPE_F16, 1, 1, 0)};
    CHECK_FAILS(lm_st_writer_open(&w, dir, dup, 2, 1000, NULL, &err), LM_ERR_USAGE, "'x'", &err);
    CHECK(w == NULL);
    lm_st_desc meta_name = desc("__metadata__", LM_DTYPE_F32, 1, 1, 0);
    CHECK_FAILS(lm_st_writer_open(&w, dir, &meta_name, 1, 1000, NULL, &err), LM_ERR_USAGE,
                "__metadata__", &err);
    lm_st_desc bad_utf8 = desc("bad\xff", LM_DTYPE_F32, 1, 1, 0);
    CHECK_FAILS(lm_st_writer_open(&w, dir, &bad_utf8, 1, 1000, NULL, &err), LM_ERR_USAGE, "UTF-8",
                &err);
    const char *meta_dup[] = {"k", "1", "k", "2", NULL};
    CHECK_FAILS(lm_st_writer_open(&w, dir, t, 1, 1000, meta_dup, &err), LM_ERR_USAGE, "'k'", &err);
    const char *meta_odd[] = {"k", NULL};
    CHECK_FAILS(lm_st_writer_open(&w, dir, t, 1, 1000, meta_odd, &err), LM_ERR_USAGE, "'k'", &err);
    char *missing = path_in(dir, "no/such/dir");
    CHECK_FAILS(lm_st_writer_open(&w, missing, t, 1, 1000, NULL, &err), LM_ERR_NOT_FOUND,
                "no/such/dir", &err);
    free(missing);

    // a failed lm_st_write_file leaves nothing behind
    char *path = path_in(dir, "never.safetensors");
    const void *data[] = {zeros, zeros};
    CHECK_FAILS(lm_st_write_file(path, dup, data, 2, NULL, &err), LM_ERR_USAGE, "'x'", &err);
    CHECK(!lm_is_file(path));
    bool tmp_left;
    count_entries(dir, ".tmp", &tmp_left);
    CHECK(!tmp_left);
    // nor does a successful one, beyond the file itself
    CHECK_OK(lm_st_write_file(path, t, data, 2, NULL, &err), &err);
    CHECK(lm_is_file(path));
    count_entries(dir, ".tmp", &tmp_left);
    CHECK(!tmp_left);
    free(path);
    remove_tmpdir(dir);
}

// ==== several threads writing one file ========================================================

typedef struct part_job {
    lm_st_writer *w;
    const unsigned char *data;
    int first, step, parts;  // this thread writes parts first, first + step, ...
    uint64_t part_bytes;
    int failures;
} part_job;

static void *part_worker(void *arg)
{
    part_job *j = arg;
    lm_err err;
    for (int k = j->first; k < j->parts; k += j->step) {
        uint64_t off = (uint64_t)k * j->part_bytes;
        if (lm_st_writer_put_part(j->w, 0, off, j->data + off, j->part_bytes, &err) != LM_OK)
            j->failures++;
    }
    return NULL;
}

static void test_threads(void)
{
    lm_err err;
    char *dir = make_tmpdir();
    enum { ROWS = 256, COLS = 64, THREADS = 4 };
    lm_st_desc t = desc("rows", LM_DTYPE_F32, 2, ROWS, COLS);
    uint64_t bytes = (uint64_t)ROWS * COLS * 4;
    unsigned char *data = malloc(bytes);
    fill_bytes(data, bytes, 7);
    lm_st_writer *w = NULL;
    CHECK_OK(lm_st_writer_open(&w, dir, &t, 1, bytes, NULL, &err), &err);
    part_job jobs[THREADS];
    pthread_t th[THREADS];
    for (int i = 0; w && i < THREADS; i++) {
        jobs[i] = (part_job){w, data, i, THREADS, ROWS, COLS * 4, 0};
        pthread_create(&th[i], NULL, part_worker, &jobs[i]);
    }
    for (int i = 0; w && i < THREADS; i++) {
        pthread_join(th[i], NULL);
        CHECK(jobs[i].failures == 0);
    }
    CHECK_OK(lm_st_writer_finish(w, &err), &err);
    lm_st_writer_free(w);
    char *path = path_in(dir, "model.safetensors");
    lm_st_file *f = NULL;
    CHECK_OK(lm_st_open(&f, path, &err), &err);
    const lm_st_tensor *r = f ? lm_st_find(f, "rows") : NULL;
    CHECK(r && r->nbytes == bytes && memcmp(r->data, data, bytes) == 0);
    lm_st_close(f);
    free(path);
    free(data);
    remove_tmpdir(dir);
}

// ==== direct I/O ==============================================================================

// Tensors of several MB whose sizes are not whole pages, one of 10 bytes between two of them
// (sharing a page with each), and one of whole pages; a shard size of 12 MiB makes two shards,
// b.small, b.tiny and c.mid in the first, a.big and e.pages in the second.
enum { DIO_NT = 5, DIO_THREADS = 4 };
static const char *const dio_names[DIO_NT] = {"b.small", "c.mid", "b.tiny", "a.big", "e.pages"};
static const uint64_t dio_sizes[DIO_NT] = {(3u << 20) + 13, (5u << 20) + 4095, 10,
                                           (7u << 20) + 1001, 4096 * 600};
#define DIO_SHARD_SIZE (12ull << 20)

typedef struct dio_part {
    int64_t idx;
    uint64_t off, len;
} dio_part;

typedef struct dio_job {
    lm_st_writer *w;
    unsigned char *const *data;  // (DIO_NT) each tensor's bytes
    const dio_part *parts;       // (n_parts) this job writes parts first, first + step, ...
    int first, step, n_parts;
    lm_status fail;              // the first put's failure, or LM_OK
    lm_err err;                  // its message
} dio_job;

static void *dio_worker(void *arg)
{
    dio_job *j = arg;
    for (int k = j->first; k < j->n_parts; k += j->step) {
        const dio_part *p = &j->parts[k];
        lm_err err;
        lm_status s = lm_st_writer_put_part(j->w, p->idx, p->off, j->data[p->idx] + p->off,
                                            p->len, &err);
        if (s != LM_OK && j->fail == LM_OK) {
            j->fail = s;
            j->err = err;
        }
    }
    return NULL;
}

// The number of this process's descriptors open with O_DIRECT (from /proc/self/fdinfo).
static int count_direct_fds(void)
{
    DIR *d = opendir("/proc/self/fdinfo");
    int n = 0;
    struct dirent *e;
    while (d && (e = readdir(d)) != NULL) {
        if (e->d_name[0] == '.')
            continue;
        char path[300], line[128];
        snprintf(path, sizeof path, "/proc/self/fdinfo/%s", e->d_name);
        FILE *f = fopen(path, "r");
        while (f && fgets(line, sizeof line, f)) {
            if (strncmp(line, "flags:", 6) == 0 && (strtol(line + 6, NULL, 8) & O_DIRECT))
                n++;
        }
        if (f)
            fclose(f);
    }
    if (d)
        closedir(d);
    return n;
}

// Whether a file in `dir` opens with O_DIRECT (not on every filesystem: tmpfs before Linux
// 6.6 refuses it, for one).
static bool direct_io_works(const char *dir)
{
    char *p = path_in(dir, "probe");
    int fd = open(p, O_WRONLY | O_CREAT | O_DIRECT | O_CLOEXEC, 0644);
    if (fd >= 0)
        close(fd);
    unlink(p);
    free(p);
    return fd >= 0;
}

// Writes the DIO tensors (data[i] holds tensor i) into `dir`, a value of `pad` spaces under
// __metadata__ "pad", cut into parts of random sizes (from seed) written in random order from
// DIO_THREADS threads. Returns finish's status (its message in *err), sets *put_fail to the
// first failed put's status (LM_OK if none; its message in *put_err) and *n_direct to the
// descriptors open with O_DIRECT while the writer was open.
static lm_status dio_write(const char *dir, size_t pad, uint64_t seed, unsigned char *const *data,
                           lm_status *put_fail, lm_err *put_err, int *n_direct, lm_err *err)
{
    lm_st_desc t[DIO_NT];
    int n_parts = 0, cap = 64;
    for (int i = 0; i < DIO_NT; i++) {
        t[i] = desc(dio_names[i], LM_DTYPE_U8, 1, (int64_t)dio_sizes[i], 0);
        cap += (int)(dio_sizes[i] / 4096);
    }
    dio_part *parts = malloc((size_t)cap * sizeof *parts);
    for (int i = 0; i < DIO_NT; i++) {
        // a quarter of the parts of at most 5000 bytes, the rest up to 1.5 MiB
        for (uint64_t off = 0; off < dio_sizes[i] && n_parts < cap;) {
            uint64_t r = rng_next(&seed);
            uint64_t len = 1 + (r % 4 == 0 ? (r >> 8) % 5000 : (r >> 8) % (3u << 19));
            if (len > dio_sizes[i] - off)
                len = dio_sizes[i] - off;
            parts[n_parts++] = (dio_part){i, off, len};
            off += len;
        }
    }
    for (int k = n_parts - 1; k > 0; k--) {
        int m = (int)(rng_next(&seed) % (uint64_t)(k + 1));
        dio_part tmp = parts[k];
        parts[k] = parts[m];
        parts[m] = tmp;
    }

    char *padding = malloc(pad + 1);
    memset(padding, ' ', pad);
    padding[pad] = '\0';
    const char *meta[] = {"pad", padding, NULL};
    lm_st_writer *w = NULL;
    *put_fail = LM_OK;
    *n_direct = 0;
    lm_status s = lm_st_writer_open(&w, dir, t, DIO_NT, DIO_SHARD_SIZE, meta, err);
    if (s == LM_OK) {
        *n_direct = count_direct_fds();
        dio_job jobs[DIO_THREADS];
        pthread_t th[DIO_THREADS];
        for (int i = 0; i < DIO_THREADS; i++) {
            jobs[i] = (dio_job){.w = w, .data = data, .parts = parts, .first = i,
                                .step = DIO_THREADS, .n_parts = n_parts, .fail = LM_OK};
            pthread_create(&th[i], NULL, dio_worker, &jobs[i]);
        }
        for (int i = 0; i < DIO_THREADS; i++) {
            pthread_join(th[i], NULL);
            if (jobs[i].fail != LM_OK && *put_fail == LM_OK) {
                *put_fail = jobs[i].fail;
                *put_err = jobs[i].err;
            }
        }
        s = lm_st_writer_finish(w, err);
    }
    lm_st_writer_free(w);
    free(padding);
    free(parts);
    return s;
}

// Reads the two shards in `dir` back and compares every tensor's bytes with data; `what`
// names the case in messages.
static void dio_check(const char *what, const char *dir, unsigned char *const *data)
{
    lm_err err;
    int found = 0;
    for (int sh = 0; sh < 2; sh++) {
        char name[64];
        char *path = path_in(dir, lm_shard_name(name, sizeof name, sh, 2));
        lm_st_file *f = NULL;
        CHECK_OK(lm_st_open(&f, path, &err), &err);
        for (int i = 0; f && i < DIO_NT; i++) {
            const lm_st_tensor *r = lm_st_find(f, dio_names[i]);
            if (!r)
                continue;
            found++;
            CHECK_MSG(r->nbytes == dio_sizes[i] && memcmp(r->data, data[i], dio_sizes[i]) == 0,
                      "%s: %s differs", what, dio_names[i]);
        }
        lm_st_close(f);
        free(path);
    }
    CHECK_MSG(found == DIO_NT, "%s: %d tensors found", what, found);
}

// Whether the files of directories a and b (the two shards and the index) are byte-identical.
static bool dio_same(const char *a, const char *b)
{
    static const char *const files[] = {"model-00001-of-00002.safetensors",
                                        "model-00002-of-00002.safetensors",
                                        "model.safetensors.index.json"};
    bool same = true;
    for (int k = 0; k < 3; k++) {
        lm_err err;
        char *pa = path_in(a, files[k]), *pb = path_in(b, files[k]), *ba = NULL, *bb = NULL;
        size_t la = 0, lb = 0;
        CHECK_OK(lm_read_file(pa, 64u << 20, &ba, &la, &err), &err);
        CHECK_OK(lm_read_file(pb, 64u << 20, &bb, &lb, &err), &err);
        same = same && ba && bb && la == lb && memcmp(ba, bb, la) == 0;
        free(ba);
        free(bb);
        free(pa);
        free(pb);
    }
    return same;
}

// With direct I/O and without, tensor data starting off a page and at one: every byte reads
// back and the files are the same.
static void test_direct_io(void)
{
    lm_err err, put_err;
    lm_status put_fail;
    int n_direct;
    char *dir = make_tmpdir();
    bool works = direct_io_works(dir);
    if (!works)
        printf("test_writer: no O_DIRECT in %s: only the buffered path is tested\n", dir);
    unsigned char *data[DIO_NT];
    for (int i = 0; i < DIO_NT; i++) {
        data[i] = malloc(dio_sizes[i]);
        fill_bytes(data[i], dio_sizes[i], 300 + (uint64_t)i);
    }
    unsetenv("LLMERGE_TEST_DIRECT_IO_FAIL");

    // the header's length with no padding, to pad the first shard's data to a page boundary
    size_t pad_aligned = 0;
    {
        char *d = subdir(dir, "probe.hdr");
        setenv("LLMERGE_DIRECT_IO", "0", 1);
        CHECK_OK(dio_write(d, 0, 1, data, &put_fail, &put_err, &n_direct, &err), &err);
        char *path = path_in(d, "model-00001-of-00002.safetensors");
        lm_st_file *f = NULL;
        CHECK_OK(lm_st_open(&f, path, &err), &err);
        if (f)
            pad_aligned = 4096 - 8 - (size_t)f->header_len;  // header_len is a multiple of 8
        lm_st_close(f);
        free(path);
        free(d);
    }

    for (int aligned = 0; aligned < 2; aligned++) {
        size_t pad = aligned ? pad_aligned : 0;
        char *on = subdir(dir, aligned ? "on.aligned" : "on"),
             *off = subdir(dir, aligned ? "off.aligned" : "off");
        const char *what = aligned ? "direct, data on a page boundary" : "direct";
        unsetenv("LLMERGE_DIRECT_IO");
        CHECK_OK(dio_write(on, pad, 11 + (uint64_t)aligned, data, &put_fail, &put_err, &n_direct,
                           &err), &err);
        CHECK(put_fail == LM_OK);
        CHECK_MSG(!works || n_direct == 2, "%s: %d descriptors with O_DIRECT", what, n_direct);
        dio_check(what, on, data);
        if (aligned) {
            char *path = path_in(on, "model-00001-of-00002.safetensors");
            lm_st_file *f = NULL;
            CHECK_OK(lm_st_open(&f, path, &err), &err);
            CHECK(f && 8 + f->header_len == 4096);
            lm_st_close(f);
            free(path);
        }

        setenv("LLMERGE_DIRECT_IO", "0", 1);
        CHECK_OK(dio_write(off, pad, 23 + (uint64_t)aligned, data, &put_fail, &put_err,
                           &n_direct, &err), &err);
        CHECK(put_fail == LM_OK);
        CHECK_MSG(n_direct == 0, "LLMERGE_DIRECT_IO=0: %d descriptors with O_DIRECT", n_direct);
        dio_check(aligned ? "buffered, data on a page boundary" : "buffered", off, data);
        CHECK_MSG(dio_same(on, off), "%s: the files differ from the buffered writer's", what);
        free(on);
        free(off);
    }
    unsetenv("LLMERGE_DIRECT_IO");
    for (int i = 0; i < DIO_NT; i++)
        free(data[i]);
    remove_tmpdir(dir);
}

// A direct write refused with EINVAL: that block and all after it are written buffered, and
// the output is whole. Any other failure (ENOSPC here) comes back from a later put or from
// finish, naming the shard and the reason.
static void test_direct_io_failures(void)
{
    lm_err err, put_err;
    lm_status put_fail;
    int n_direct;
    char *dir = make_tmpdir();
    bool works = direct_io_works(dir);
    unsigned char *data[DIO_NT];
    for (int i = 0; i < DIO_NT; i++) {
        data[i] = malloc(dio_sizes[i]);
        fill_bytes(data[i], dio_sizes[i], 400 + (uint64_t)i);
    }
    unsetenv("LLMERGE_DIRECT_IO");

    char *fallback = subdir(dir, "einval"), *ref = subdir(dir, "ref");
    setenv("LLMERGE_TEST_DIRECT_IO_FAIL", "EINVAL", 1);
    CHECK_OK(dio_write(fallback, 0, 5, data, &put_fail, &put_err, &n_direct, &err), &err);
    CHECK(put_fail == LM_OK);
    dio_check("EINVAL", fallback, data);
    unsetenv("LLMERGE_TEST_DIRECT_IO_FAIL");
    setenv("LLMERGE_DIRECT_IO", "0", 1);
    CHECK_OK(dio_write(ref, 0, 6, data, &put_fail, &put_err, &n_direct, &err), &err);
    unsetenv("LLMERGE_DIRECT_IO");
    CHECK_MSG(dio_same(fallback, ref), "EINVAL: the files differ from the buffered writer's");

    char *nospace = subdir(dir, "enospc");
    setenv("LLMERGE_TEST_DIRECT_IO_FAIL", "ENOSPC", 1);
    lm_status s = dio_write(nospace, 0, 7, data, &put_fail, &put_err, &n_direct, &err);
    unsetenv("LLMERGE_TEST_DIRECT_IO_FAIL");
    if (works) {
        CHECK_MSG(s == LM_ERR_IO && strstr(err.msg, nospace) && strstr(err.msg, ".safetensors: ")
                  && strstr(err.msg, "No space left on device"),
                  "ENOSPC: finish -> %s \"%s\"", lm_status_name(s), err.msg);
        CHECK(strstr(err.msg, "writing tensor data at byte ") != NULL);
        // a put after the failure reports it the same way
        CHECK_MSG(put_fail == LM_OK || (put_fail == LM_ERR_IO && strcmp(put_err.msg, err.msg) == 0),
                  "ENOSPC: a put -> %s \"%s\"", lm_status_name(put_fail), put_err.msg);
    }

    // a real failure: a file size limit (SIGXFSZ ignored, so writes fail with EFBIG) set once
    // the shards have their size, on a page boundary inside a direct block, so the writer
    // thread's write stops short at the limit and then fails
    struct rlimit old_limit;
    if (getrlimit(RLIMIT_FSIZE, &old_limit) == 0 && old_limit.rlim_max == RLIM_INFINITY) {
        char *limited = subdir(dir, "efbig");
        lm_st_desc t = desc("big", LM_DTYPE_U8, 1, (int64_t)dio_sizes[1], 0);
        lm_st_writer *w = NULL;
        void (*old_handler)(int) = signal(SIGXFSZ, SIG_IGN);
        CHECK_OK(lm_st_writer_open(&w, limited, &t, 1, DIO_SHARD_SIZE, NULL, &err), &err);
        struct rlimit lim = {3u << 20, old_limit.rlim_max};
        CHECK(setrlimit(RLIMIT_FSIZE, &lim) == 0);
        lm_status first = LM_OK;
        lm_err first_err;
        for (uint64_t off = 0; w && off < dio_sizes[1]; off += 1u << 20) {
            uint64_t len = dio_sizes[1] - off < (1u << 20) ? dio_sizes[1] - off : 1u << 20;
            lm_status s = lm_st_writer_put_part(w, 0, off, data[1] + off, len, &err);
            if (s != LM_OK && first == LM_OK) {
                first = s;
                first_err = err;
            }
        }
        CHECK_MSG(first == LM_OK || (first == LM_ERR_IO && strstr(first_err.msg, "File too large")),
                  "EFBIG: a put -> %s \"%s\"", lm_status_name(first), first_err.msg);
        if (w)
            CHECK_FAILS(lm_st_writer_finish(w, &err), LM_ERR_IO, "File too large", &err);
        CHECK(strstr(err.msg, limited) != NULL);
        lm_st_writer_free(w);
        CHECK(setrlimit(RLIMIT_FSIZE, &old_limit) == 0);
        signal(SIGXFSZ, old_handler);
        free(limited);
    }

    // freed before finish, with blocks open, queued and being written: nothing leaks
    {
        char *early = subdir(dir, "early");
        lm_st_desc t = desc("big", LM_DTYPE_U8, 1, (int64_t)dio_sizes[1], 0);
        lm_st_writer *w = NULL;
        CHECK_OK(lm_st_writer_open(&w, early, &t, 1, DIO_SHARD_SIZE, NULL, &err), &err);
        for (uint64_t off = 0; w && off + 12345 < dio_sizes[1]; off += 2 * 12345)
            CHECK_OK(lm_st_writer_put_part(w, 0, off, data[1] + off, 12345, &err), &err);
        lm_st_writer_free(w);
        free(early);
    }

    for (int i = 0; i < DIO_NT; i++)
        free(data[i]);
    free(fallback);
    free(ref);
    free(nospace);
    remove_tmpdir(dir);
}

// ==== output directories ======================================================================

static void put_marker(const char *dir, const char *name, const char *text)
{
    lm_err err;
    char *p = path_in(dir, name);
    CHECK_OK(lm_write_file(p, text, strlen(text), &err), &err);
    free(p);
}

static bool has_marker(const char *dir, const char *name, const char *text)
{
    lm_err err;
    char *p = path_in(dir, name), *buf = NULL;
    bool ok = lm_read_file(p, 4096, &buf, NULL, &err) == LM_OK && strcmp(buf, text) == 0;
    free(buf);
    free(p);
    return ok;
}

static void test_outdir(void)
{
    lm_err err;
    char *dir = make_tmpdir();
    char *out = path_in(dir, "out");
    lm_outdir od;

    // begin and commit: the temporary directory sits beside OUT and becomes it
    CHECK_OK(lm_outdir_begin(&od, out, false, &err), &err);
    CHECK(od.tmp && strncmp(od.tmp, out, strlen(out)) == 0 && strstr(od.tmp, ".tmp-"));
    CHECK(od.tmp && lm_is_dir(od.tmp) && !lm_is_dir(out));
    struct stat st;
    CHECK(od.tmp && stat(od.tmp, &st) == 0 && (st.st_mode & 0777) == 0755);  // umask 022
    if (od.tmp)
        put_marker(od.tmp, "a.txt", "first");
    char *tmp = lm_strdup(od.tmp);
    CHECK_OK(lm_outdir_commit(&od, &err), &err);
    CHECK(od.tmp == NULL && od.final == NULL);
    CHECK(lm_is_dir(out) && has_marker(out, "a.txt", "first"));
    CHECK(tmp && !lm_is_dir(tmp));
    free(tmp);
    lm_outdir_abort(&od);  // harmless after a commit
    CHECK(lm_is_dir(out));

    // an existing OUT without force: refused, nothing created
    CHECK_FAILS(lm_outdir_begin(&od, out, false, &err), LM_ERR_USAGE, "--force", &err);
    CHECK(strstr(err.msg, out) != NULL);
    CHECK(od.tmp == NULL);
    CHECK(count_entries(dir, NULL, NULL) == 1);
    lm_outdir_abort(&od);

    // a missing parent
    char *orphan = path_in(dir, "no/parent/out");
    CHECK_FAILS(lm_outdir_begin(&od, orphan, false, &err), LM_ERR_NOT_FOUND, "no/parent", &err);
    free(orphan);

    // abort removes the temporary directory and all in it
    CHECK_OK(lm_outdir_begin(&od, out, true, &err), &err);
    if (od.tmp) {
        char *sub = path_in(od.tmp, "sub");
        CHECK_OK(lm_mkdir_p(sub, &err), &err);
        put_marker(sub, "b.txt", "x");
        free(sub);
    }
    lm_outdir_abort(&od);
    lm_outdir_abort(&od);  // twice is fine
    CHECK(count_entries(dir, NULL, NULL) == 1);
    CHECK(has_marker(out, "a.txt", "first"));

    // force replaces the old OUT entirely and leaves nothing else beside it
    char *slashed = lm_strfmt("%s//", out);  // a trailing slash names the same directory
    CHECK_OK(lm_outdir_begin(&od, slashed, true, &err), &err);
    if (od.tmp)
        put_marker(od.tmp, "c.txt", "second");
    CHECK_OK(lm_outdir_commit(&od, &err), &err);
    CHECK(has_marker(out, "c.txt", "second"));
    char *old = path_in(out, "a.txt");
    CHECK(!lm_is_file(old));
    free(old);
    CHECK(count_entries(dir, NULL, NULL) == 1);
    free(slashed);

    // force over a plain file
    char *file_out = path_in(dir, "was_a_file");
    CHECK_OK(lm_write_file(file_out, "x", 1, &err), &err);
    CHECK_OK(lm_outdir_begin(&od, file_out, true, &err), &err);
    CHECK_OK(lm_outdir_commit(&od, &err), &err);
    CHECK(lm_is_dir(file_out));
    free(file_out);

    // a zeroed object aborts harmlessly; "." is not an output
    lm_outdir zero = {0};
    lm_outdir_abort(&zero);
    CHECK_FAILS(lm_outdir_begin(&od, ".", true, &err), LM_ERR_USAGE, ".", &err);
    CHECK_FAILS(lm_outdir_begin(&od, "", true, &err), LM_ERR_USAGE, "output", &err);

    free(out);
    remove_tmpdir(dir);
}

// Two writers of one OUT: the second is refused while the first holds OUT.lock (flock locks
// conflict between two open files of one process too), and no lock file outlives either.
static void test_outdir_lock(void)
{
    lm_err err;
    char *dir = make_tmpdir();
    char *out = path_in(dir, "out");
    char *lock = lm_strfmt("%s.lock", out);
    lm_outdir a, b;

    CHECK_OK(lm_outdir_begin(&a, out, false, &err), &err);
    char *text = NULL;
    CHECK(lm_read_file(lock, 64, &text, NULL, &err) == LM_OK && text && atol(text) == (long)getpid());
    free(text);
    char want[96];
    snprintf(want, sizeof want, "another llmerge (pid %ld) is writing it", (long)getpid());
    CHECK_FAILS(lm_outdir_begin(&b, out, false, &err), LM_ERR_BUSY, want, &err);
    CHECK(strstr(err.msg, out) != NULL);
    CHECK(lm_status_exit_code(LM_ERR_BUSY) == 2);
    CHECK_FAILS(lm_outdir_begin(&b, out, true, &err), LM_ERR_BUSY, want, &err);  // --force too
    CHECK(b.tmp == NULL && b.lock == NULL);
    CHECK(count_entries(dir, NULL, NULL) == 2);  // a's temporary directory and its lock
    lm_outdir_abort(&b);
    CHECK(lm_is_file(lock));  // b's abort does not touch a's lock
    CHECK_OK(lm_outdir_commit(&a, &err), &err);
    CHECK(!lm_is_file(lock) && lm_is_dir(out));
    CHECK(count_entries(dir, NULL, NULL) == 1);

    // once a is done the lock is free: b may replace OUT with force, and its abort removes
    // the lock file as well as the temporary directory
    CHECK_OK(lm_outdir_begin(&b, out, true, &err), &err);
    CHECK(lm_is_file(lock));
    lm_outdir_abort(&b);
    CHECK(!lm_is_file(lock));
    CHECK(count_entries(dir, NULL, NULL) == 1);

    // a lock file nobody holds (its run was killed) is taken over and removed at the end
    char *other = path_in(dir, "other");
    char *other_lock = lm_strfmt("%s.lock", other);
    CHECK_OK(lm_write_file(other_lock, "12345\n", 6, &err), &err);
    CHECK_OK(lm_outdir_begin(&a, other, false, &err), &err);
    CHECK_OK(lm_outdir_commit(&a, &err), &err);
    CHECK(lm_is_dir(other) && !lm_is_file(other_lock));
    CHECK(count_entries(dir, NULL, NULL) == 2);

    // a failed begin (OUT exists, no force) leaves no lock file behind
    CHECK_FAILS(lm_outdir_begin(&a, other, false, &err), LM_ERR_USAGE, "--force", &err);
    CHECK(!lm_is_file(other_lock) && count_entries(dir, NULL, NULL) == 2);

    free(other);
    free(other_lock);
    free(lock);
    free(out);
    remove_tmpdir(dir);
}

int main(void)
{
    umask(022);
    test_round_trip();
    test_header_bytes();
    test_shard_plan();
    test_sharded_write();
    test_refusals();
    test_threads();
    test_direct_io();
    test_direct_io_failures();
    test_outdir();
    test_outdir_lock();
    return check_report("test_writer");
}
