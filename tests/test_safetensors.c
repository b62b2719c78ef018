// Tests of the safetensors reader. Valid files of every kind are accepted; then each defect of
// docs/formats.md "safetensors files" is made by editing one valid seed file (its header text
// or its byte counts), and
// each broken file must fail with LM_ERR_FORMAT and a message naming the defect, both from
// memory and from a file on disk. `test_safetensors --write-corpus DIR` writes the broken
// files out instead, as the fuzzer's seed corpus.
#include "check.h"
#include "safetensors.h"

#include <stdint.h>
#include <sys/stat.h>
#include <unistd.h>

// Builds a file: 8-byte length, header text, then data_len bytes (0, 1, 2, ...). Caller frees.
static unsigned char *build(const char *header, uint64_t claimed_len, size_t data_len, size_t *size)
{
    size_t hl = strlen(header);
    *size = 8 + hl + data_len;
    unsigned char *b = malloc(*size ? *size : 1);
    for (int i = 0; i < 8; i++)
        b[i] = (unsigned char)(claimed_len >> (8 * i));
    memcpy(b + 8, header, hl);
    for (size_t i = 0; i < data_len; i++)
        b[8 + hl + i] = (unsigned char)i;
    return b;
}

// The seed every broken case is edited from: two tensors, metadata, 28 data bytes.
#define SEED_HEADER                                                                           \
    "{\"__metadata__\":{\"format\":\"pt\"},"                                                  \
    "\"w\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[0,24]},"                      \
    "\"b\":{\"dtype\":\"BF16\",\"shape\":[2],\"data_offsets\":[24,28]}}"

typedef struct bad_case {
    const char *name;      // corpus file name
    const char *header;    // NULL: the seed header
    int64_t len_delta;     // added to the true header length in the 8-byte prefix
    int64_t claimed;       // when non-zero, the prefix holds exactly this
    size_t data_len;       // bytes after the header
    size_t total_override; // when non-zero, the file is cut to this many bytes
    const char *defect;    // must appear in the message
} bad_case;

static const bad_case bad_cases[] = {
    {"too_small", NULL, 0, 0, 28, 5, "HeaderTooSmall"},
    {"empty", NULL, 0, 0, 28, 0, "HeaderTooSmall"},  // total 0 handled below
    {"header_too_large", NULL, 0, 100000001, 28, 0, "HeaderTooLarge"},
    {"header_len_max", NULL, 0, -1, 28, 0, "HeaderTooLarge"},
    {"header_past_end", NULL, 1000, 0, 28, 0, "InvalidHeaderLength"},
    {"bad_utf8", "{\"w\xff\":{\"dtype\":\"F32\",\"shape\":[7],\"data_offsets\":[0,28]}}", 0, 0, 28, 0, "InvalidHeaderUtf8"},
    {"overlong_utf8", "{\"w\xc0\xaf\":{\"dtype\":\"F32\",\"shape\":[7],\"data_offsets\":[0,28]}}", 0, 0, 28, 0, "InvalidHeaderUtf8"},
    {"not_json", "{\"w\":{\"dtype\":\"F32\",\"shape\":[7],\"data_offsets\":[0,28]}", 0, 0, 28, 0, "InvalidHeaderJson"},
    {"array_header", "[1,2,3]", 0, 0, 0, 0, "InvalidHeaderJson"},
    {"trailing_garbage", "{\"w\":{\"dtype\":\"F32\",\"shape\":[7],\"data_offsets\":[0,28]}}x", 0, 0, 28, 0, "InvalidHeaderJson"},
    {"trailing_comma", "{\"w\":{\"dtype\":\"F32\",\"shape\":[7],\"data_offsets\":[0,28]},}", 0, 0, 28, 0, "InvalidHeaderJson"},
    {"control_char", "{\"w\x01\":{\"dtype\":\"F32\",\"shape\":[7],\"data_offsets\":[0,28]}}", 0, 0, 28, 0, "InvalidHeaderJson"},
    {"lone_surrogate", "{\"w\\ud800\":{\"dtype\":\"F32\",\"shape\":[7],\"data_offsets\":[0,28]}}", 0, 0, 28, 0, "InvalidHeaderJson"},
    {"leading_zero", "{\"w\":{\"dtype\":\"F32\",\"shape\":[07],\"data_offsets\":[0,28]}}", 0, 0, 28, 0, "InvalidHeaderJson"},
    {"nul_in_name", "{\"w\\u0000\":{\"dtype\":\"F32\",\"shape\":[7],\"data_offsets\":[0,28]}}", 0, 0, 28, 0, "InvalidHeaderSchema"},
    {"dtype_not_string", "{\"w\":{\"dtype\":32,\"shape\":[7],\"data_offsets\":[0,28]}}", 0, 0, 28, 0, "InvalidHeaderSchema"},
    {"missing_shape", "{\"w\":{\"dtype\":\"F32\",\"data_offsets\":[0,28]}}", 0, 0, 28, 0, "InvalidHeaderSchema"},
    {"unknown_field", "{\"w\":{\"dtype\":\"F32\",\"shape\":[7],\"data_offsets\":[0,28],\"x\":1}}", 0, 0, 28, 0, "InvalidHeaderSchema"},
    {"three_offsets", "{\"w\":{\"dtype\":\"F32\",\"shape\":[7],\"data_offsets\":[0,28,28]}}", 0, 0, 28, 0, "InvalidHeaderSchema"},
    {"tensor_not_object", "{\"w\":[1]}", 0, 0, 0, 0, "InvalidHeaderSchema"},
    {"metadata_number", "{\"__metadata__\":{\"format\":1},\"w\":{\"dtype\":\"F32\",\"shape\":[7],\"data_offsets\":[0,28]}}", 0, 0, 28, 0, "InvalidHeaderSchema"},
    {"metadata_array", "{\"__metadata__\":[\"pt\"]}", 0, 0, 0, 0, "InvalidHeaderSchema"},
    {"duplicate_tensor", "{\"w\":{\"dtype\":\"F32\",\"shape\":[7],\"data_offsets\":[0,28]},\"w\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[28,28]}}", 0, 0, 28, 0, "DuplicateKey"},
    {"duplicate_metadata", "{\"__metadata__\":{\"a\":\"1\",\"a\":\"2\"}}", 0, 0, 0, 0, "DuplicateKey"},
    {"duplicate_field", "{\"w\":{\"dtype\":\"F32\",\"dtype\":\"F32\",\"shape\":[7],\"data_offsets\":[0,28]}}", 0, 0, 28, 0, "DuplicateKey"},
    {"negative_dim", "{\"w\":{\"dtype\":\"F32\",\"shape\":[-7],\"data_offsets\":[0,28]}}", 0, 0, 28, 0, "InvalidInteger"},
    {"fraction_offset", "{\"w\":{\"dtype\":\"F32\",\"shape\":[7],\"data_offsets\":[0,28.0]}}", 0, 0, 28, 0, "InvalidInteger"},
    {"exponent_offset", "{\"w\":{\"dtype\":\"F32\",\"shape\":[7],\"data_offsets\":[0,2.8e1]}}", 0, 0, 28, 0, "InvalidInteger"},
    {"offset_over_u64", "{\"w\":{\"dtype\":\"F32\",\"shape\":[7],\"data_offsets\":[0,18446744073709551616]}}", 0, 0, 28, 0, "InvalidInteger"},
    {"unknown_dtype", "{\"w\":{\"dtype\":\"F128\",\"shape\":[7],\"data_offsets\":[0,28]}}", 0, 0, 28, 0, "UnknownDtype"},
    {"too_many_dims", "{\"w\":{\"dtype\":\"U8\",\"shape\":[1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1],\"data_offsets\":[0,1]}}", 0, 0, 1, 0, "TooManyDims"},
    {"offset_not_zero", "{\"w\":{\"dtype\":\"F32\",\"shape\":[6],\"data_offsets\":[4,28]}}", 0, 0, 28, 0, "InvalidOffset"},
    {"offset_gap", "{\"w\":{\"dtype\":\"F32\",\"shape\":[5],\"data_offsets\":[0,20]},\"b\":{\"dtype\":\"BF16\",\"shape\":[2],\"data_offsets\":[24,28]}}", 0, 0, 28, 0, "InvalidOffset"},
    {"offset_overlap", "{\"w\":{\"dtype\":\"F32\",\"shape\":[6],\"data_offsets\":[0,24]},\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[20,28]}}", 0, 0, 28, 0, "InvalidOffset"},
    {"offset_reversed", "{\"w\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[0,0]},\"b\":{\"dtype\":\"F32\",\"shape\":[7],\"data_offsets\":[28,0]}}", 0, 0, 28, 0, "InvalidOffset"},
    {"shape_overflow", "{\"w\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296],\"data_offsets\":[0,28]}}", 0, 0, 28, 0, "ValidationOverflow"},
    {"bytes_overflow", "{\"w\":{\"dtype\":\"F64\",\"shape\":[4611686018427387904],\"data_offsets\":[0,28]}}", 0, 0, 28, 0, "ValidationOverflow"},
    {"size_mismatch", "{\"w\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[0,28]}}", 0, 0, 28, 0, "TensorInvalidInfo"},
    {"misaligned_f4", "{\"w\":{\"dtype\":\"F4\",\"shape\":[3],\"data_offsets\":[0,2]}}", 0, 0, 2, 0, "MisalignedSlice"},
    {"trailing_bytes", NULL, 0, 0, 29, 0, "MetadataIncompleteBuffer"},
    {"truncated_data", NULL, 0, 0, 27, 0, "MetadataIncompleteBuffer"},
};
#define N_BAD ((int)(sizeof bad_cases / sizeof bad_cases[0]))

static unsigned char *build_case(const bad_case *c, size_t *size)
{
    const char *h = c->header ? c->header : SEED_HEADER;
    uint64_t claimed = c->claimed ? (uint64_t)c->claimed : (uint64_t)((int64_t)strlen(h) + c->len_delta);
    unsigned char *b = build(h, claimed, c->data_len, size);
    if (c->total_override || strcmp(c->name, "empty") == 0)
        *size = c->total_override;
    return b;
}

static char tmpdir[64];

static char *tmp_path(const char *name)
{
    return lm_strfmt("%s/%s.safetensors", tmpdir, name);
}

static void test_valid(void)
{
    lm_err err = {0};
    lm_st_file *f = NULL;
    size_t size;
    unsigned char *b = build(SEED_HEADER, strlen(SEED_HEADER), 28, &size);
    CHECK_OK(lm_st_parse(&f, b, size, "seed", &err), &err);
    if (f) {
        CHECK(f->n_tensors == 2 && f->n_meta == 1);
        CHECK(lm_st_meta(f, "format") && strcmp(lm_st_meta(f, "format"), "pt") == 0);
        const lm_st_tensor *w = lm_st_find(f, "w"), *bt = lm_st_find(f, "b");
        CHECK(w && w->dtype == LM_DTYPE_F32 && w->ndim == 2 && w->shape[0] == 2 && w->shape[1] == 3 &&
              w->numel == 6 && w->nbytes == 24);
        // Views point into the buffer, no copy.
        CHECK(w && (const unsigned char *)w->data == b + 8 + strlen(SEED_HEADER));
        CHECK(bt && (const unsigned char *)bt->data == b + 8 + strlen(SEED_HEADER) + 24 && bt->numel == 2);
        CHECK(f->tensors[0].begin == 0 && f->tensors[1].begin == 24);  // data order
        CHECK(lm_st_find(f, "missing") == NULL);
        float v[2];
        CHECK_OK(lm_st_read_f32(bt, v, &err), &err);
        uint16_t raw0 = (uint16_t)(24 | (25 << 8));
        CHECK(v[0] == lm_bf16_to_f32(raw0));
    }
    lm_st_close(f);
    free(b);

    // Every dtype, a scalar, zero-size dims (empty span), header padded with spaces, null
    // metadata, escaped names, and tensors listed out of offset order.
    char header[4096];
    int n = 0;
    uint64_t off = 0;
    n += snprintf(header + n, sizeof header - n, "{\"__metadata__\":null");
    for (int i = 0; i < LM_DTYPE_COUNT; i++) {
        // Four elements of each: 2 bytes of F4, 3 of F6, 4 x size otherwise.
        const int64_t elems = 4;
        uint64_t bytes = (uint64_t)elems * lm_dtype_bits((lm_dtype)i) / 8;
        n += snprintf(header + n, sizeof header - n, ",\"t%02d\":{\"dtype\":\"%s\",\"shape\":[%lld],\"data_offsets\":[%llu,%llu]}",
                      i, lm_dtype_name((lm_dtype)i), (long long)elems, (unsigned long long)off,
                      (unsigned long long)(off + bytes));
        off += bytes;
    }
    n += snprintf(header + n, sizeof header - n,
                  ",\"scalar\":{\"dtype\":\"F64\",\"shape\":[],\"data_offsets\":[%llu,%llu]}"
                  ",\"empty\":{\"shape\":[0,3],\"dtype\":\"F32\",\"data_offsets\":[%llu,%llu]}"
                  ",\"caf\\u00e9 \\\"q\\\" \\ud83d\\ude00\":{\"data_offsets\":[%llu,%llu],\"dtype\":\"U8\",\"shape\":[1]}}     ",
                  (unsigned long long)off, (unsigned long long)off + 8, (unsigned long long)off + 8,
                  (unsigned long long)off + 8, (unsigned long long)off + 8, (unsigned long long)off + 9);
    off += 9;
    b = build(header, strlen(header), off, &size);
    f = NULL;
    CHECK_OK(lm_st_parse(&f, b, size, "all-dtypes", &err), &err);
    if (f) {
        CHECK(f->n_tensors == LM_DTYPE_COUNT + 3 && f->n_meta == 0);
        const lm_st_tensor *s = lm_st_find(f, "scalar"), *e = lm_st_find(f, "empty");
        CHECK(s && s->ndim == 0 && s->numel == 1 && s->nbytes == 8);
        CHECK(e && e->ndim == 2 && e->numel == 0 && e->nbytes == 0);
        CHECK(lm_st_find(f, "caf\xc3\xa9 \"q\" \xf0\x9f\x98\x80") != NULL);
        const lm_st_tensor *f4 = lm_st_find(f, "t01");
        CHECK(f4 && f4->dtype == LM_DTYPE_F4 && f4->nbytes == 2);
        float v;
        CHECK_FAILS(lm_st_read_f32(lm_st_find(f, "t20"), &v, &err), LM_ERR_UNSUPPORTED, "t20", &err);
    }
    lm_st_close(f);

    // The same file through the mmap path.
    char *path = tmp_path("all_dtypes");
    CHECK_OK(lm_write_file(path, b, size, &err), &err);
    f = NULL;
    CHECK_OK(lm_st_open(&f, path, &err), &err);
    CHECK(f && f->n_tensors == LM_DTYPE_COUNT + 3 && lm_st_find(f, "empty") != NULL);
    lm_st_close(f);
    free(path);
    free(b);

    // An empty header object with no data is a valid (empty) file.
    b = build("{}      ", 8, 0, &size);
    f = NULL;
    CHECK_OK(lm_st_parse(&f, b, size, "empty-object", &err), &err);
    CHECK(f && f->n_tensors == 0);
    lm_st_close(f);
    free(b);

    f = (lm_st_file *)1;
    CHECK_FAILS(lm_st_open(&f, "/nonexistent/x.safetensors", &err), LM_ERR_NOT_FOUND, "/nonexistent/x.safetensors", &err);
    CHECK(f == NULL);
}

static void test_broken(void)
{
    for (int i = 0; i < N_BAD; i++) {
        const bad_case *c = &bad_cases[i];
        size_t size;
        unsigned char *b = build_case(c, &size);
        lm_err err = {0};
        lm_st_file *f = NULL;
        lm_status s = lm_st_parse(&f, b, size, c->name, &err);
        CHECK_MSG(s == LM_ERR_FORMAT && strstr(err.msg, c->defect) && strstr(err.msg, c->name) && !f,
                  "case %s: got %s \"%s\", wanted %s", c->name, lm_status_name(s), err.msg, c->defect);
        lm_st_close(f);
        char *path = tmp_path(c->name);
        lm_write_file(path, b, size, &err);
        f = NULL;
        s = lm_st_open(&f, path, &err);
        CHECK_MSG(s == LM_ERR_FORMAT && strstr(err.msg, c->defect) && strstr(err.msg, path) && !f,
                  "file %s: got %s \"%s\", wanted %s", path, lm_status_name(s), err.msg, c->defect);
        lm_st_close(f);
        unlink(path);
        free(path);
        free(b);
    }
    // The seed itself is valid: each case really is the edit that breaks it.
    size_t size;
    unsigned char *b = build(SEED_HEADER, strlen(SEED_HEADER), 28, &size);
    lm_err err = {0};
    lm_st_file *f = NULL;
    CHECK_OK(lm_st_parse(&f, b, size, "seed", &err), &err);
    lm_st_close(f);
    free(b);
}

static int write_corpus(const char *dir)
{
    lm_err err = {0};
    if (lm_mkdir_p(dir, &err) != LM_OK) {
        fprintf(stderr, "%s\n", err.msg);
        return 1;
    }
    for (int i = 0; i <= N_BAD; i++) {
        size_t size;
        unsigned char *b = i < N_BAD ? build_case(&bad_cases[i], &size)
                                     : build(SEED_HEADER, strlen(SEED_HEADER), 28, &size);
        char *path = lm_strfmt("%s/%s", dir, i < N_BAD ? bad_cases[i].name : "seed_valid");
        lm_status s = lm_write_file(path, b, size, &err);
        free(path);
        free(b);
        if (s != LM_OK) {
            fprintf(stderr, "%s\n", err.msg);
            return 1;
        }
    }
    printf("wrote %d files to %s\n", N_BAD + 1, dir);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc == 3 && strcmp(argv[1], "--write-corpus") == 0)
        return write_corpus(argv[2]);
    snprintf(tmpdir, sizeof tmpdir, "/tmp/lm_test_st_XXXXXX");
    if (!mkdtemp(tmpdir)) {
        perror("mkdtemp");
        return 1;
    }
    test_valid();
    test_broken();
    lm_err err = {0};
    lm_rm_rf(tmpdir, &err);
    return check_report("test_safetensors");
}
