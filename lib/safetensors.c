// The safetensors reader: see safetensors.h. The header is parsed by a small strict JSON
// parser that knows the one schema safetensors uses (an object of tensor infos plus an optional
// string-to-string __metadata__), so it never recurses into arbitrary values and can keep every
// integer exact in 64 bits.
#include "safetensors.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "signals.h"

// ==== errors ==================================================================================

static lm_status st_fail(lm_err *err, const char *label, const char *defect, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

static lm_status st_fail(lm_err *err, const char *label, const char *defect, const char *fmt, ...)
{
    char detail[LM_ERR_MSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(detail, sizeof detail, fmt, ap);
    va_end(ap);
    return lm_err_set(err, LM_ERR_FORMAT, "%s: %s: %s", label, defect, detail);
}

// ==== the header parser ======================================================================

typedef struct st_parser {
    const char *p, *end, *start;  // header JSON [start, end), cursor p
    const char *label;
    char *arena;                  // decoded strings are appended here
    size_t arena_used;
    lm_err *err;
    const char *defect;           // set with the message by parse_fail
} st_parser;

static lm_status parse_fail(st_parser *ps, const char *defect, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static lm_status parse_fail(st_parser *ps, const char *defect, const char *fmt, ...)
{
    char detail[LM_ERR_MSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(detail, sizeof detail, fmt, ap);
    va_end(ap);
    return lm_err_set(ps->err, LM_ERR_FORMAT, "%s: %s: %s (header byte %td)", ps->label, defect,
                      detail, ps->p - ps->start);
}

static void skip_ws(st_parser *ps)
{
    while (ps->p < ps->end && (*ps->p == ' ' || *ps->p == '\t' || *ps->p == '\n' || *ps->p == '\r'))
        ps->p++;
}

// Consumes `c` after optional whitespace, or fails with what was expected.
static lm_status expect(st_parser *ps, char c, const char *what)
{
    skip_ws(ps);
    if (ps->p >= ps->end)
        return parse_fail(ps, "InvalidHeaderJson", "header ends where %s was expected", what);
    if (*ps->p != c)
        return parse_fail(ps, "InvalidHeaderJson", "expected %s, found '%c'", what, *ps->p);
    ps->p++;
    return LM_OK;
}

static int hexval(char c)
{
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

static lm_status read_hex4(st_parser *ps, uint32_t *out)
{
    if (ps->end - ps->p < 4)
        return parse_fail(ps, "InvalidHeaderJson", "truncated \\u escape");
    uint32_t v = 0;
    for (int i = 0; i < 4; i++) {
        int h = hexval(ps->p[i]);
        if (h < 0)
            return parse_fail(ps, "InvalidHeaderJson", "bad \\u escape");
        v = (v << 4) | (uint32_t)h;
    }
    ps->p += 4;
    *out = v;
    return LM_OK;
}

// Parses a JSON string at the cursor into the arena; *out points at its NUL-terminated copy.
// Strings holding U+0000 are refused: names and metadata are C strings here.
static lm_status parse_string(st_parser *ps, const char **out)
{
    lm_status s = expect(ps, '"', "a string");
    if (s != LM_OK)
        return s;
    char *dst = ps->arena + ps->arena_used, *w = dst;
    for (;;) {
        if (ps->p >= ps->end)
            return parse_fail(ps, "InvalidHeaderJson", "unterminated string");
        unsigned char c = (unsigned char)*ps->p++;
        if (c == '"')
            break;
        if (c < 0x20)
            return parse_fail(ps, "InvalidHeaderJson", "control character 0x%02x in a string", c);
        if (c != '\\') {
            *w++ = (char)c;
            continue;
        }
        if (ps->p >= ps->end)
            return parse_fail(ps, "InvalidHeaderJson", "unterminated escape");
        char e = *ps->p++;
        switch (e) {
        case '"': *w++ = '"'; break;
        case '\\': *w++ = '\\'; break;
        case '/': *w++ = '/'; break;
        case 'b': *w++ = '\b'; break;
        case 'f': *w++ = '\f'; break;
        case 'n': *w++ = '\n'; break;
        case 'r': *w++ = '\r'; break;
        case 't': *w++ = '\t'; break;
        case 'u': {
            uint32_t cp;
            if ((s = read_hex4(ps, &cp)) != LM_OK)
                return s;
            if (cp >= 0xDC00 && cp <= 0xDFFF)
                return parse_fail(ps, "InvalidHeaderJson", "lone low surrogate in \\u escape");
            if (cp >= 0xD800 && cp <= 0xDBFF) {
                uint32_t lo;
                if (ps->end - ps->p < 2 || ps->p[0] != '\\' || ps->p[1] != 'u')
                    return parse_fail(ps, "InvalidHeaderJson", "lone high surrogate in \\u escape");
                ps->p += 2;
                if ((s = read_hex4(ps, &lo)) != LM_OK)
                    return s;
                if (lo < 0xDC00 || lo > 0xDFFF)
                    return parse_fail(ps, "InvalidHeaderJson", "bad surrogate pair in \\u escape");
                cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
            }
            if (cp == 0)
                return parse_fail(ps, "InvalidHeaderSchema", "string contains U+0000");
            // UTF-8 encoding is never longer than the 6 or 12 escape bytes it replaces.
            if (cp < 0x80) {
                *w++ = (char)cp;
            } else if (cp < 0x800) {
                *w++ = (char)(0xC0 | (cp >> 6));
                *w++ = (char)(0x80 | (cp & 0x3F));
            } else if (cp < 0x10000) {
                *w++ = (char)(0xE0 | (cp >> 12));
                *w++ = (char)(0x80 | ((cp >> 6) & 0x3F));
                *w++ = (char)(0x80 | (cp & 0x3F));
            } else {
                *w++ = (char)(0xF0 | (cp >> 18));
                *w++ = (char)(0x80 | ((cp >> 12) & 0x3F));
                *w++ = (char)(0x80 | ((cp >> 6) & 0x3F));
                *w++ = (char)(0x80 | (cp & 0x3F));
            }
            break;
        }
        default:
            return parse_fail(ps, "InvalidHeaderJson", "bad escape '\\%c'", e);
        }
    }
    *w++ = '\0';
    ps->arena_used += (size_t)(w - dst);
    *out = dst;
    return LM_OK;
}

// Parses a JSON number that must be a non-negative integer fitting in 64 bits. Anything else
// that is valid JSON (negative, fraction, exponent, too large) is InvalidInteger; what is not
// JSON at all is InvalidHeaderJson.
static lm_status parse_u64(st_parser *ps, const char *what, uint64_t *out)
{
    skip_ws(ps);
    const char *q = ps->p;
    bool neg = false;
    if (q < ps->end && *q == '-') {
        neg = true;
        q++;
    }
    if (q >= ps->end || *q < '0' || *q > '9')
        return parse_fail(ps, "InvalidHeaderJson", "expected a number for %s", what);
    const char *digits = q;
    while (q < ps->end && *q >= '0' && *q <= '9')
        q++;
    if (*digits == '0' && q - digits > 1)
        return parse_fail(ps, "InvalidHeaderJson", "number with a leading zero for %s", what);
    bool frac = false;
    if (q < ps->end && *q == '.') {
        frac = true;
        q++;
        if (q >= ps->end || *q < '0' || *q > '9')
            return parse_fail(ps, "InvalidHeaderJson", "malformed number for %s", what);
        while (q < ps->end && *q >= '0' && *q <= '9')
            q++;
    }
    if (q < ps->end && (*q == 'e' || *q == 'E')) {
        frac = true;
        q++;
        if (q < ps->end && (*q == '+' || *q == '-'))
            q++;
        if (q >= ps->end || *q < '0' || *q > '9')
            return parse_fail(ps, "InvalidHeaderJson", "malformed number for %s", what);
        while (q < ps->end && *q >= '0' && *q <= '9')
            q++;
    }
    if (neg || frac)
        return parse_fail(ps, "InvalidInteger", "%s is %.*s, not a non-negative integer", what,
                          (int)(q - ps->p > 40 ? 40 : q - ps->p), ps->p);
    uint64_t v = 0;
    for (const char *d = digits; d < q; d++) {
        if (!lm_mul_u64(v, 10, &v) || !lm_add_u64(v, (uint64_t)(*d - '0'), &v))
            return parse_fail(ps, "InvalidInteger", "%s %.*s does not fit in 64 bits", what,
                              (int)(q - digits > 40 ? 40 : q - digits), digits);
    }
    ps->p = q;
    *out = v;
    return LM_OK;
}

// Peeks past whitespace: true when the next byte is `c` (consumed).
static bool accept(st_parser *ps, char c)
{
    skip_ws(ps);
    if (ps->p < ps->end && *ps->p == c) {
        ps->p++;
        return true;
    }
    return false;
}

static bool accept_word(st_parser *ps, const char *word)
{
    skip_ws(ps);
    size_t n = strlen(word);
    if ((size_t)(ps->end - ps->p) >= n && memcmp(ps->p, word, n) == 0) {
        ps->p += n;
        return true;
    }
    return false;
}

// Describes the JSON value type at the cursor for schema messages.
static const char *peek_kind(st_parser *ps)
{
    skip_ws(ps);
    if (ps->p >= ps->end) return "nothing";
    switch (*ps->p) {
    case '{': return "an object";
    case '[': return "an array";
    case '"': return "a string";
    case 't': case 'f': return "a boolean";
    case 'n': return "null";
    default: return (*ps->p == '-' || (*ps->p >= '0' && *ps->p <= '9')) ? "a number" : "not JSON";
    }
}

static lm_status schema_or_json(st_parser *ps, const char *want, const char *what)
{
    const char *kind = peek_kind(ps);
    if (strcmp(kind, "not JSON") == 0 || strcmp(kind, "nothing") == 0)
        return parse_fail(ps, "InvalidHeaderJson", "expected %s for %s", want, what);
    return parse_fail(ps, "InvalidHeaderSchema", "%s must be %s, found %s", what, want, kind);
}

typedef struct st_build {
    lm_st_tensor *tensors;
    int64_t n, cap;
    const char **mkeys, **mvals;
    int64_t n_meta, cap_meta;
} st_build;

static lm_status parse_metadata(st_parser *ps, st_build *b)
{
    if (accept_word(ps, "null"))
        return LM_OK;
    skip_ws(ps);
    if (ps->p >= ps->end || *ps->p != '{')
        return schema_or_json(ps, "an object of strings", "__metadata__");
    ps->p++;
    if (accept(ps, '}'))
        return LM_OK;
    for (;;) {
        const char *key, *val;
        lm_status s = parse_string(ps, &key);
        if (s != LM_OK)
            return s;
        if ((s = expect(ps, ':', "':'")) != LM_OK)
            return s;
        skip_ws(ps);
        if (ps->p >= ps->end || *ps->p != '"')
            return schema_or_json(ps, "a string", "a __metadata__ value");
        if ((s = parse_string(ps, &val)) != LM_OK)
            return s;
        for (int64_t i = 0; i < b->n_meta; i++)
            if (strcmp(b->mkeys[i], key) == 0)
                return parse_fail(ps, "DuplicateKey", "__metadata__ key '%s' appears twice", key);
        if (b->n_meta == b->cap_meta) {
            int64_t cap = b->cap_meta ? b->cap_meta * 2 : 8;
            const char **k = realloc(b->mkeys, (size_t)cap * sizeof *k);
            if (k) b->mkeys = k;
            const char **v = k ? realloc(b->mvals, (size_t)cap * sizeof *v) : NULL;
            if (v) b->mvals = v;
            if (!k || !v)
                return lm_err_set(ps->err, LM_ERR_NOMEM, "%s: out of memory", ps->label);
            b->cap_meta = cap;
        }
        b->mkeys[b->n_meta] = key;
        b->mvals[b->n_meta] = val;
        b->n_meta++;
        if (accept(ps, '}'))
            return LM_OK;
        if ((s = expect(ps, ',', "',' or '}' in __metadata__")) != LM_OK)
            return s;
    }
}

static lm_status parse_tensor_info(st_parser *ps, lm_st_tensor *t)
{
    skip_ws(ps);
    if (ps->p >= ps->end || *ps->p != '{')
        return schema_or_json(ps, "an object", t->name);
    ps->p++;
    bool have_dtype = false, have_shape = false, have_offsets = false;
    if (!accept(ps, '}')) {
        for (;;) {
            const char *field;
            lm_status s = parse_string(ps, &field);
            if (s != LM_OK)
                return s;
            if ((s = expect(ps, ':', "':'")) != LM_OK)
                return s;
            if (strcmp(field, "dtype") == 0) {
                if (have_dtype)
                    return parse_fail(ps, "DuplicateKey", "tensor '%s' has two \"dtype\" fields", t->name);
                have_dtype = true;
                skip_ws(ps);
                if (ps->p >= ps->end || *ps->p != '"')
                    return schema_or_json(ps, "a string", "dtype");
                const char *name;
                if ((s = parse_string(ps, &name)) != LM_OK)
                    return s;
                if (!lm_dtype_from_name(name, strlen(name), &t->dtype))
                    return parse_fail(ps, "UnknownDtype", "tensor '%s' has unknown dtype \"%s\"", t->name, name);
            } else if (strcmp(field, "shape") == 0) {
                if (have_shape)
                    return parse_fail(ps, "DuplicateKey", "tensor '%s' has two \"shape\" fields", t->name);
                have_shape = true;
                skip_ws(ps);
                if (ps->p >= ps->end || *ps->p != '[')
                    return schema_or_json(ps, "an array of integers", "shape");
                ps->p++;
                t->ndim = 0;
                if (!accept(ps, ']')) {
                    for (;;) {
                        uint64_t d;
                        if (t->ndim == LM_ST_MAX_DIMS)
                            return parse_fail(ps, "TooManyDims", "tensor '%s' has more than %d dimensions",
                                              t->name, LM_ST_MAX_DIMS);
                        if ((s = parse_u64(ps, "a shape dimension", &d)) != LM_OK)
                            return s;
                        if (d > (uint64_t)INT64_MAX)
                            return parse_fail(ps, "ValidationOverflow", "tensor '%s' dimension %" PRIu64 " is too large",
                                              t->name, d);
                        t->shape[t->ndim++] = (int64_t)d;
                        if (accept(ps, ']'))
                            break;
                        if ((s = expect(ps, ',', "',' or ']' in shape")) != LM_OK)
                            return s;
                    }
                }
            } else if (strcmp(field, "data_offsets") == 0) {
                if (have_offsets)
                    return parse_fail(ps, "DuplicateKey", "tensor '%s' has two \"data_offsets\" fields", t->name);
                have_offsets = true;
                skip_ws(ps);
                if (ps->p >= ps->end || *ps->p != '[')
                    return schema_or_json(ps, "an array of two integers", "data_offsets");
                ps->p++;
                if ((s = parse_u64(ps, "data_offsets[0]", &t->begin)) != LM_OK)
                    return s;
                if ((s = expect(ps, ',', "',' in data_offsets")) != LM_OK)
                    return s;
                if ((s = parse_u64(ps, "data_offsets[1]", &t->end)) != LM_OK)
                    return s;
                skip_ws(ps);
                if (ps->p < ps->end && *ps->p == ',')
                    return parse_fail(ps, "InvalidHeaderSchema", "tensor '%s': data_offsets must have two entries",
                                      t->name);
                if ((s = expect(ps, ']', "']' after data_offsets")) != LM_OK)
                    return s;
            } else {
                return parse_fail(ps, "InvalidHeaderSchema", "tensor '%s' has unknown field \"%s\"", t->name, field);
            }
            if (accept(ps, '}'))
                break;
            if ((s = expect(ps, ',', "',' or '}' in a tensor entry")) != LM_OK)
                return s;
        }
    }
    if (!have_dtype || !have_shape || !have_offsets)
        return parse_fail(ps, "InvalidHeaderSchema", "tensor '%s' lacks \"%s\"", t->name,
                          !have_dtype ? "dtype" : !have_shape ? "shape" : "data_offsets");
    return LM_OK;
}

static lm_status parse_header(st_parser *ps, st_build *b, lm_strmap *seen)
{
    lm_status s;
    skip_ws(ps);
    if (ps->p >= ps->end || *ps->p != '{')
        return parse_fail(ps, "InvalidHeaderJson", "the header is not a JSON object");
    ps->p++;
    bool have_meta = false;
    if (!accept(ps, '}')) {
        for (;;) {
            const char *key;
            if ((s = parse_string(ps, &key)) != LM_OK)
                return s;
            if ((s = expect(ps, ':', "':'")) != LM_OK)
                return s;
            if (strcmp(key, "__metadata__") == 0) {
                if (have_meta)
                    return parse_fail(ps, "DuplicateKey", "\"__metadata__\" appears twice");
                have_meta = true;
                if ((s = parse_metadata(ps, b)) != LM_OK)
                    return s;
            } else {
                if (b->n == b->cap) {
                    int64_t cap = b->cap ? b->cap * 2 : 64;
                    lm_st_tensor *t = realloc(b->tensors, (size_t)cap * sizeof *t);
                    if (!t)
                        return lm_err_set(ps->err, LM_ERR_NOMEM, "%s: out of memory", ps->label);
                    b->tensors = t;
                    b->cap = cap;
                }
                lm_st_tensor *t = &b->tensors[b->n];
                memset(t, 0, sizeof *t);
                t->name = key;
                if ((s = parse_tensor_info(ps, t)) != LM_OK)
                    return s;
                int put = lm_strmap_put(seen, key, b->n);
                if (put < 0)
                    return lm_err_set(ps->err, LM_ERR_NOMEM, "%s: out of memory", ps->label);
                if (put == 0)
                    return parse_fail(ps, "DuplicateKey", "tensor '%s' appears twice", key);
                b->n++;
            }
            if (accept(ps, '}'))
                break;
            if ((s = expect(ps, ',', "',' or '}' after an entry")) != LM_OK)
                return s;
        }
    }
    skip_ws(ps);
    if (ps->p != ps->end)
        return parse_fail(ps, "InvalidHeaderJson", "trailing characters after the header object");
    return LM_OK;
}

// ==== validation ==============================================================================

static int cmp_offsets(const void *a, const void *b)
{
    const lm_st_tensor *x = a, *y = b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end) return x->end < y->end ? -1 : 1;
    return strcmp(x->name, y->name);
}

// The reference's validation, in its order, over tensors sorted by offsets.
static lm_status validate(lm_st_file *f, lm_err *err)
{
    if (f->n_tensors > 1)
        qsort(f->tensors, (size_t)f->n_tensors, sizeof *f->tensors, cmp_offsets);
    uint64_t start = 0;
    for (int64_t i = 0; i < f->n_tensors; i++) {
        lm_st_tensor *t = &f->tensors[i];
        if (t->begin != start || t->end < t->begin)
            return st_fail(err, f->path, "InvalidOffset",
                           "tensor '%s' has data_offsets [%" PRIu64 ", %" PRIu64 "], expected it to start at %" PRIu64,
                           t->name, t->begin, t->end, start);
        start = t->end;
        uint64_t numel = 1, bits;
        for (int d = 0; d < t->ndim; d++)
            if (!lm_mul_u64(numel, (uint64_t)t->shape[d], &numel))
                return st_fail(err, f->path, "ValidationOverflow", "tensor '%s': the shape's element count overflows",
                               t->name);
        if (numel > (uint64_t)INT64_MAX || !lm_mul_u64(numel, lm_dtype_bits(t->dtype), &bits))
            return st_fail(err, f->path, "ValidationOverflow", "tensor '%s': the byte size overflows", t->name);
        if (bits % 8 != 0)
            return st_fail(err, f->path, "MisalignedSlice", "tensor '%s': %" PRIu64 " elements of %s do not fill whole bytes",
                           t->name, numel, lm_dtype_name(t->dtype));
        t->numel = (int64_t)numel;
        t->nbytes = t->end - t->begin;
        if (t->nbytes != bits / 8) {
            char shape[256];
            return st_fail(err, f->path, "TensorInvalidInfo",
                           "tensor '%s' (%s %s) needs %" PRIu64 " bytes but data_offsets span %" PRIu64,
                           t->name, lm_dtype_name(t->dtype), lm_st_shape_str(t->shape, t->ndim, shape, sizeof shape),
                           bits / 8, t->nbytes);
        }
    }
    // The data must end exactly at the end of the file: no holes, no trailing bytes.
    if (start != f->data_size)
        return st_fail(err, f->path, "MetadataIncompleteBuffer",
                       "tensors cover %" PRIu64 " bytes of data but the file holds %" PRIu64, start, f->data_size);
    for (int64_t i = 0; i < f->n_tensors; i++)
        f->tensors[i].data = f->data + f->tensors[i].begin;
    return LM_OK;
}

// ==== opening =================================================================================

static lm_status st_load(lm_st_file *f, lm_err *err)
{
    if (f->size < 8)
        return st_fail(err, f->path, "HeaderTooSmall", "the file has %" PRIu64 " bytes, fewer than the 8-byte length",
                       f->size);
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--)
        n = (n << 8) | f->bytes[i];
    if (n > LM_ST_MAX_HEADER)
        return st_fail(err, f->path, "HeaderTooLarge", "header length %" PRIu64 " is over the %llu limit", n,
                       LM_ST_MAX_HEADER);
    uint64_t header_end;
    if (!lm_add_u64(8, n, &header_end) || header_end > f->size)
        return st_fail(err, f->path, "InvalidHeaderLength", "header length %" PRIu64 " runs past the end of the %" PRIu64 "-byte file",
                       n, f->size);
    f->header_len = n;
    f->data = f->bytes + header_end;
    f->data_size = f->size - header_end;
    const char *json = (const char *)f->bytes + 8;
    if (!lm_utf8_valid(json, n))
        return st_fail(err, f->path, "InvalidHeaderUtf8", "the header is not valid UTF-8");

    // Every decoded string is at most as long as its encoding plus a NUL, so one arena of the
    // header's size holds them all and never moves (names point into it).
    f->strings = malloc(n + 1);
    if (!f->strings)
        return lm_err_set(err, LM_ERR_NOMEM, "%s: out of memory for a %" PRIu64 "-byte header", f->path, n);
    st_parser ps = {.p = json, .start = json, .end = json + n, .label = f->path, .arena = f->strings, .err = err};
    st_build b = {0};
    lm_status s = lm_strmap_init(&f->index, 64);
    if (s != LM_OK) {
        lm_err_set(err, LM_ERR_NOMEM, "%s: out of memory", f->path);
        goto fail;
    }
    s = parse_header(&ps, &b, &f->index);
    f->tensors = b.tensors;
    f->n_tensors = b.n;
    f->meta_keys = b.mkeys;
    f->meta_vals = b.mvals;
    f->n_meta = b.n_meta;
    if (s != LM_OK)
        goto fail;
    if ((s = validate(f, err)) != LM_OK)
        goto fail;
    // Sorting moved the tensors: index them again by their final positions.
    lm_strmap_free(&f->index);
    if (lm_strmap_init(&f->index, (size_t)f->n_tensors) != LM_OK) {
        s = lm_err_set(err, LM_ERR_NOMEM, "%s: out of memory", f->path);
        goto fail;
    }
    for (int64_t i = 0; i < f->n_tensors; i++) {
        if (lm_strmap_put(&f->index, f->tensors[i].name, i) < 0) {
            s = lm_err_set(err, LM_ERR_NOMEM, "%s: out of memory", f->path);
            goto fail;
        }
    }
    return LM_OK;
fail:
    return s;
}

static lm_st_file *st_new(const char *label)
{
    lm_st_file *f = calloc(1, sizeof *f);
    if (!f)
        return NULL;
    f->path = lm_strdup(label);
    if (!f->path) {
        free(f);
        return NULL;
    }
    return f;
}

lm_status lm_st_open(lm_st_file **out, const char *path, lm_err *err)
{
    *out = NULL;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return lm_err_set(err, errno == ENOENT ? LM_ERR_NOT_FOUND : LM_ERR_IO, "%s: %s", path, strerror(errno));
    lm_status s = lm_st_open_fd(out, fd, path, err);
    close(fd);
    return s;
}

lm_status lm_st_open_fd(lm_st_file **out, int fd, const char *label, lm_err *err)
{
    *out = NULL;
    lm_st_file *f = st_new(label);
    if (!f)
        return lm_err_set(err, LM_ERR_NOMEM, "%s: out of memory", label);
    lm_status s;
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        s = lm_err_set(err, LM_ERR_IO, "%s: %s", label, S_ISREG(st.st_mode) ? strerror(errno) : "not a regular file");
        goto fail;
    }
    f->size = (uint64_t)st.st_size;
    if (f->size > 0) {
        f->map = mmap(NULL, (size_t)f->size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (f->map == MAP_FAILED) {
            f->map = NULL;
            s = lm_err_set(err, LM_ERR_IO, "%s: mmap: %s", label, strerror(errno));
            goto fail;
        }
        f->map_size = (size_t)f->size;
        f->bytes = f->map;
        // A file truncated under the mapping raises SIGBUS on reading what is gone: the
        // handler names the file from this.
        f->map_id = lm_signals_map_add(f->map, f->map_size, f->path);
    }
    if ((s = st_load(f, err)) != LM_OK)
        goto fail;
    *out = f;
    return LM_OK;
fail:
    lm_st_close(f);
    return s;
}

lm_status lm_st_parse(lm_st_file **out, const void *buf, size_t size, const char *label, lm_err *err)
{
    *out = NULL;
    lm_st_file *f = st_new(label);
    if (!f)
        return lm_err_set(err, LM_ERR_NOMEM, "%s: out of memory", label);
    f->bytes = buf;
    f->size = size;
    lm_status s = st_load(f, err);
    if (s != LM_OK) {
        lm_st_close(f);
        return s;
    }
    *out = f;
    return LM_OK;
}

void lm_st_close(lm_st_file *f)
{
    if (!f)
        return;
    if (f->map) {
        lm_signals_map_remove(f->map_id);
        munmap(f->map, f->map_size);
    }
    lm_strmap_free(&f->index);
    free(f->tensors);
    free(f->meta_keys);
    free(f->meta_vals);
    free(f->strings);
    free(f->path);
    free(f);
}

// ==== lookups =================================================================================

const lm_st_tensor *lm_st_find(const lm_st_file *f, const char *name)
{
    int64_t i = lm_strmap_get(&f->index, name);
    return i < 0 ? NULL : &f->tensors[i];
}

const char *lm_st_meta(const lm_st_file *f, const char *key)
{
    for (int64_t i = 0; i < f->n_meta; i++)
        if (strcmp(f->meta_keys[i], key) == 0)
            return f->meta_vals[i];
    return NULL;
}

lm_status lm_st_read_f32(const lm_st_tensor *t, float *dst, lm_err *err)
{
    lm_status s = lm_convert_to_f32(dst, t->data, t->dtype, t->numel, err);
    if (s != LM_OK)
        lm_err_prefix(err, "tensor '%s'", t->name);
    return s;
}

char *lm_st_shape_str(const int64_t *shape, int ndim, char *buf, size_t cap)
{
    size_t n = 0;
    n += (size_t)snprintf(buf + n, cap - n, "[");
    for (int d = 0; d < ndim && n < cap; d++)
        n += (size_t)snprintf(buf + n, cap - n, d ? ", %lld" : "%lld", (long long)shape[d]);
    if (n < cap)
        snprintf(buf + n, cap - n, "]");
    return buf;
}
