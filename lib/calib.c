// The token data reader. See calib.h.
#include "calib.h"

#include "tokenizer.h"

#include <cJSON.h>
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <unistd.h>

#include "json.h"
#include "util.h"

typedef struct reader {
    lm_calib *c;
    const lm_calib_opts *o;
    int64_t line;        // the line being read (1-based)
    int64_t cap_ids;     // capacity of c->ids
    int64_t cap_seqs;    // capacity of c->offsets (n_seqs + 1 entries used) and c->lines
    int64_t seq_start;   // where the sequence being read starts in c->ids
    lm_err *err;
    lm_tokenizer *tok;   // o->tokenizer, loaded at the first "text" line
    lm_tok_cache *cache;
} reader;

static lm_status oom(reader *r)
{
    return lm_err_set(r->err, LM_ERR_NOMEM, "%s:%" PRId64 ": out of memory", r->c->path, r->line);
}

// Appends token `id` (already range-checked against 2^31) found at `where` of the line.
static lm_status push_id(reader *r, int64_t id, const char *where)
{
    lm_calib *c = r->c;
    if (r->o->vocab_size > 0 && id >= r->o->vocab_size)
        return lm_err_set(r->err, LM_ERR_FORMAT, "%s:%" PRId64 ": %s: token id %" PRId64 " is outside the "
                          "vocabulary (vocab_size %" PRId64 ")", c->path, r->line, where, id, r->o->vocab_size);
    // a cut sequence keeps only its first max_len ids, but every id is checked
    if (r->o->max_len > 0 && c->n_tokens - r->seq_start >= r->o->max_len)
        return LM_OK;
    if (c->n_tokens == r->cap_ids) {
        int64_t cap = r->cap_ids ? 2 * r->cap_ids : 4096;
        int32_t *p = cap < INT64_MAX / 8 ? realloc(c->ids, (size_t)cap * sizeof *p) : NULL;
        if (!p)
            return oom(r);
        c->ids = p;
        r->cap_ids = cap;
    }
    c->ids[c->n_tokens++] = (int32_t)id;
    return LM_OK;
}

// Ends the sequence begun at r->seq_start, `n_read` ids long as the line wrote it.
static lm_status end_seq(reader *r, int64_t n_read)
{
    lm_calib *c = r->c;
    if (n_read == 0)
        return lm_err_set(r->err, LM_ERR_FORMAT, "%s:%" PRId64 ": empty sequence (no token ids)", c->path, r->line);
    if (c->n_seqs + 2 > r->cap_seqs) {
        int64_t cap = r->cap_seqs ? 2 * r->cap_seqs : 256;
        int64_t *o = realloc(c->offsets, (size_t)cap * sizeof *o);
        if (!o)
            return oom(r);
        c->offsets = o;
        int64_t *l = realloc(c->lines, (size_t)cap * sizeof *l);
        if (!l)
            return oom(r);
        c->lines = l;
        r->cap_seqs = cap;
    }
    if (n_read > c->n_tokens - r->seq_start)
        c->n_cut++;
    c->lines[c->n_seqs] = r->line;
    c->offsets[c->n_seqs] = r->seq_start;
    c->offsets[++c->n_seqs] = c->n_tokens;
    return LM_OK;
}

// ---- .txt ---------------------------------------------------------------------------------

static lm_status parse_txt(reader *r, const char *s, size_t len)
{
    int64_t n = 0;
    size_t i = 0;
    for (;;) {
        while (i < len && (s[i] == ' ' || s[i] == '\t'))
            i++;
        if (i == len)
            break;
        size_t j = i;
        int64_t v = 0;
        bool big = false;
        while (j < len && s[j] >= '0' && s[j] <= '9') {
            v = v * 10 + (s[j] - '0');
            big |= v > INT32_MAX;
            if (big)
                v = INT32_MAX;  // keep it from overflowing; the id is refused below
            j++;
        }
        if (j == i || (j < len && s[j] != ' ' && s[j] != '\t')) {
            size_t e = j;
            while (e < len && s[e] != ' ' && s[e] != '\t')
                e++;
            int shown = (int)(e - i > 40 ? 40 : e - i);
            return lm_err_set(r->err, LM_ERR_FORMAT, "%s:%" PRId64 ": column %zu: '%.*s%s' is not a token id "
                              "(expected whole numbers separated by spaces)", r->c->path, r->line, i + 1, shown,
                              s + i, e - i > 40 ? "..." : "");
        }
        char where[48];
        snprintf(where, sizeof where, "token %" PRId64, n + 1);
        if (big)
            return lm_err_set(r->err, LM_ERR_FORMAT, "%s:%" PRId64 ": %s: '%.*s' is too large for a token id",
                              r->c->path, r->line, where, (int)(j - i > 40 ? 40 : j - i), s + i);
        lm_status st = push_id(r, v, where);
        if (st != LM_OK)
            return st;
        n++;
        i = j;
    }
    return end_seq(r, n);
}

// ---- .jsonl -------------------------------------------------------------------------------

#define JSONL_SHAPE "expected {\"input_ids\": [...]} or {\"text\": \"...\"}"

// The tokenizer at o->tokenizer, whose vocabulary and special tokens must all be the model's (an
// added token past the model's rows, a multimodal tokenizer's image token under a text model, is
// refused only where a text holds it: every id is checked as it is read).
static lm_status load_tokenizer(lm_tokenizer **tok, const lm_calib_opts *o, lm_err *err)
{
    lm_status s = lm_tok_load(tok, o->tokenizer, err);
    const char *name;
    int64_t max = s == LM_OK ? lm_tok_max_id(*tok, &name, false) : 0;
    if (s == LM_OK && o->vocab_size > 0 && max >= o->vocab_size) {
        s = lm_err_set(err, LM_ERR_FORMAT, "%s: token '%s' has id %" PRId64 ", past the model's vocab_size %" PRId64
                       ": the tokenizer does not fit the model", o->tokenizer, name, max, o->vocab_size);
        lm_tok_free(*tok);
        *tok = NULL;
    }
    return s;
}

// A line's "text": its ids by the tokenizer (loaded at the first such line), as llmerge
// tokenize writes them.
static lm_status parse_text(reader *r, const char *text)
{
    const char *path = r->c->path;
    if (!r->o->tokenizer)
        return lm_err_set(r->err, LM_ERR_FORMAT, "%s:%" PRId64 ": \"text\" needs a tokenizer, and there is none "
                          "here (%s)", path, r->line, r->o->no_tokenizer ? r->o->no_tokenizer : "give token ids");
    lm_status st = LM_OK;
    if (!r->tok) {
        if ((st = load_tokenizer(&r->tok, r->o, r->err)) != LM_OK)
            return lm_err_prefix(r->err, "%s:%" PRId64 ": \"text\" needs the tokenizer", path, r->line);
        r->cache = lm_tok_cache_new();
    }
    int32_t *ids = NULL;
    int64_t n = 0, cap = 0;
    if ((st = lm_tok_encode(r->tok, r->cache, text, strlen(text), 1, &ids, &n, &cap, r->err)) != LM_OK) {
        free(ids);
        return lm_err_prefix(r->err, "%s:%" PRId64 ": \"text\"", path, r->line);
    }
    for (int64_t i = 0; st == LM_OK && i < n; i++) {
        char where[48];
        snprintf(where, sizeof where, "token %" PRId64 " of the text", i + 1);
        st = push_id(r, ids[i], where);
    }
    free(ids);
    return st == LM_OK ? end_seq(r, n) : st;
}

static lm_status parse_jsonl(reader *r, const char *s, size_t len)
{
    const char *path = r->c->path;
    cJSON *root = NULL;
    lm_json_error e;
    lm_status st = lm_json_parse_detail(&root, s, len, &e);
    if (st == LM_ERR_NOMEM)
        return oom(r);
    if (st != LM_OK) {
        // the line is one JSON text: its column is the file's
        if (e.defect == LM_JSON_SYNTAX)
            return lm_err_set(r->err, st, "%s:%" PRId64 ": invalid JSON near column %" PRId64 ": %s (" JSONL_SHAPE ")",
                              path, r->line, e.column, e.what);
        if (e.defect == LM_JSON_TRAILING)
            return lm_err_set(r->err, st, "%s:%" PRId64 ": text after the JSON value at column %" PRId64 " (one object "
                              "per line)", path, r->line, e.column);
        char first[48] = "";
        if (e.first_column)
            snprintf(first, sizeof first, " (first at column %" PRId64 ")", e.first_column);
        return lm_err_set(r->err, st, "%s:%" PRId64 ": column %" PRId64 ": %s%s", path, r->line, e.column, e.what,
                          first);
    }
    const cJSON *ids = cJSON_GetObjectItemCaseSensitive(root, "input_ids");
    const cJSON *text = cJSON_GetObjectItemCaseSensitive(root, "text");
    if (cJSON_IsObject(root) && !ids && cJSON_IsString(text)) {
        st = parse_text(r, text->valuestring);
        cJSON_Delete(root);
        return st;
    }
    if (!cJSON_IsObject(root)) {
        st = lm_err_set(r->err, LM_ERR_FORMAT, "%s:%" PRId64 ": not a JSON object (" JSONL_SHAPE ")", path, r->line);
    } else if (!ids && cJSON_GetObjectItemCaseSensitive(root, "messages")) {
        st = lm_err_set(r->err, LM_ERR_FORMAT, "%s:%" PRId64 ": chat data (\"messages\") is not read: render each "
                        "conversation with the model's chat template into \"text\" first", path, r->line);
    } else if (!ids) {
        st = lm_err_set(r->err, LM_ERR_FORMAT, "%s:%" PRId64 ": no \"input_ids\" key (" JSONL_SHAPE ")", path,
                        r->line);
    } else if (!cJSON_IsArray(ids)) {
        st = lm_err_set(r->err, LM_ERR_FORMAT, "%s:%" PRId64 ": \"input_ids\" is not an array of token ids", path,
                        r->line);
    } else {
        int64_t n = 0;
        const cJSON *e;
        cJSON_ArrayForEach(e, ids) {
            double v = cJSON_IsNumber(e) ? e->valuedouble : -1;
            char where[48];
            snprintf(where, sizeof where, "input_ids[%" PRId64 "]", n);
            if (!cJSON_IsNumber(e) || !(v >= 0 && v <= INT32_MAX) || v != (double)(int64_t)v) {
                char shown[64];
                if (cJSON_IsNumber(e))
                    snprintf(shown, sizeof shown, "%.17g", v);
                else
                    snprintf(shown, sizeof shown, "%s", cJSON_IsArray(e) ? "an array" : cJSON_IsString(e) ? "a string"
                             : cJSON_IsObject(e) ? "an object" : "not a number");
                st = lm_err_set(r->err, LM_ERR_FORMAT, "%s:%" PRId64 ": %s is %s, not a token id (a whole number "
                                "from 0 to 2^31 - 1)", path, r->line, where, shown);
                break;
            }
            if ((st = push_id(r, (int64_t)v, where)) != LM_OK)
                break;
            n++;
        }
        if (st == LM_OK)
            st = end_seq(r, n);
    }
    cJSON_Delete(root);
    return st;
}

// ---- a text document ------------------------------------------------------------------------

static lm_status load_text(lm_calib *c, const char *path, const lm_calib_opts *o, lm_err *err)
{
    if (!o->tokenizer)
        return lm_err_set(err, LM_ERR_FORMAT, "%s: text needs a tokenizer, and there is none here (%s)", path,
                          o->no_tokenizer ? o->no_tokenizer : "give token ids");
    char *text = NULL;
    size_t len = 0;
    lm_status s = lm_read_file(path, (size_t)1 << 34, &text, &len, err);  // a FIFO or device refused unread
    if (s != LM_OK)
        return s;
    int64_t bad = lm_utf8_bad_line(text ? text : "", len);
    if (bad) {
        free(text);
        return lm_err_set(err, LM_ERR_FORMAT, "%s:%" PRId64 ": not valid UTF-8", path, bad);
    }
    lm_tokenizer *tok = NULL;
    int32_t *ids = NULL;
    int64_t n = 0, cap = 0;
    if ((s = load_tokenizer(&tok, o, err)) == LM_OK &&
        (s = lm_tok_encode(tok, NULL, text ? text : "", len, 1, &ids, &n, &cap, err)) != LM_OK)
        lm_err_prefix(err, "%s", path);
    lm_tok_free(tok);
    free(text);
    if (s == LM_OK && !(c->path = lm_strdup(path)))
        s = lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    reader r = {.c = c, .o = o, .err = err, .line = 1};
    int64_t w = o->max_len > 0 ? o->max_len : (n > 0 ? n : 1);
    for (int64_t first = 0; s == LM_OK && first < n; first += w) {
        if (o->max_samples > 0 && c->n_seqs == o->max_samples) {
            c->capped = true;
            break;
        }
        r.seq_start = c->n_tokens;
        int64_t m = n - first < w ? n - first : w;
        for (int64_t i = 0; s == LM_OK && i < m; i++) {
            char where[48];
            snprintf(where, sizeof where, "token %" PRId64 " of the text", first + i + 1);
            s = push_id(&r, ids[first + i], where);
        }
        if (s == LM_OK)
            s = end_seq(&r, m);
    }
    free(ids);
    if (s == LM_OK && c->n_seqs == 0)
        s = lm_err_set(err, LM_ERR_FORMAT, "%s: no tokens (the text is empty)", path);
    if (s != LM_OK)
        lm_calib_free(c);
    return s;
}

// ---- the file -------------------------------------------------------------------------------

lm_status lm_calib_load(lm_calib *c, const char *path, const lm_calib_opts *o, lm_err *err)
{
    memset(c, 0, sizeof *c);
    if (lm_is_dir(path))
        return lm_err_set(err, LM_ERR_USAGE, "%s is a directory, not a data file", path);
    if (o->text)
        return load_text(c, path, o, err);
    bool jsonl = lm_str_ends_with(path, ".jsonl"), txt = lm_str_ends_with(path, ".txt");
    if (!jsonl && !txt)
        return lm_err_set(err, LM_ERR_FORMAT, "%s: unknown data format: expected a .jsonl file (one "
                          "{\"input_ids\": [...]} or {\"text\": \"...\"} per line) or a .txt file (one sequence of "
                          "token ids per line; for text, llmerge tokenize --data-format text makes a .jsonl)", path);
    // a FIFO, socket or device is refused before anything is read (a FIFO would block an open)
    int fd;
    lm_status os = lm_open_regular(path, &fd, err);
    if (os != LM_OK)
        return os;
    FILE *fp = fdopen(fd, "rb");
    if (!fp) {
        lm_status fs = lm_err_set(err, LM_ERR_IO, "%s: %s", path, strerror(errno));
        close(fd);
        return fs;
    }
    if (!(c->path = lm_strdup(path))) {
        fclose(fp);
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    }
    reader r = {.c = c, .o = o, .err = err};
    char *line = NULL;
    size_t cap = 0;
    ssize_t got;
    lm_status s = LM_OK;
    errno = 0;
    while ((got = getline(&line, &cap, fp)) >= 0) {
        r.line++;
        if (o->max_samples > 0 && c->n_seqs == o->max_samples) {
            c->capped = true;
            break;
        }
        size_t len = (size_t)got, skip = 0;
        if (len && line[len - 1] == '\n')
            len--;
        if (len && line[len - 1] == '\r')
            len--;
        if (r.line == 1 && len >= 3 && memcmp(line, "\xEF\xBB\xBF", 3) == 0)
            skip = 3;
        if (memchr(line, '\0', len)) {
            s = lm_err_set(err, LM_ERR_FORMAT, "%s:%" PRId64 ": a NUL byte (not a text file?)", path, r.line);
            break;
        }
        bool blank = true;
        for (size_t i = skip; i < len && blank; i++)
            blank = line[i] == ' ' || line[i] == '\t';
        if (blank) {
            s = lm_err_set(err, LM_ERR_FORMAT, "%s:%" PRId64 ": empty line (every line is one sequence%s)", path,
                           r.line, jsonl ? ", " JSONL_SHAPE : " of token ids");
            break;
        }
        r.seq_start = c->n_tokens;
        s = jsonl ? parse_jsonl(&r, line + skip, len - skip) : parse_txt(&r, line + skip, len - skip);
        if (s != LM_OK)
            break;
        errno = 0;
    }
    if (s == LM_OK && got < 0 && ferror(fp))
        s = lm_err_set(err, LM_ERR_IO, "%s: read failed after line %" PRId64 ": %s", path, r.line,
                       strerror(errno ? errno : EIO));
    if (s == LM_OK && c->n_seqs == 0)
        s = lm_err_set(err, LM_ERR_FORMAT, "%s: no sequences (the file is empty)", path);
    free(line);
    fclose(fp);
    lm_tok_free(r.tok);
    lm_tok_cache_free(r.cache);
    if (s != LM_OK)
        lm_calib_free(c);
    return s;
}

void lm_calib_free(lm_calib *c)
{
    free(c->path);
    free(c->ids);
    free(c->offsets);
    free(c->lines);
    memset(c, 0, sizeof *c);
}
