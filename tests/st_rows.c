// st_rows: row edits and row checks of safetensors files for the end-to-end tests of embeddings
// rebuilt to another vocabulary, written apart from the code that rebuilds them.
//   st_rows swap IN OUT ROWS I J    OUT is IN with rows I and J swapped in every 2-D tensor of ROWS
//                                   rows (the header unchanged)
//   st_rows append IN OUT ROWS K    OUT is IN with a copy of row K added after the last row of
//                                   every 2-D tensor of ROWS rows (the header rewritten to match)
//   st_rows hash FILE NAME FROM TO  prints the xxHash64 of rows [FROM, TO) of tensor NAME
//   st_rows zero FILE NAME FROM TO  exit status 0 when those rows are all zero bytes, else 1
// Exit status 2 for bad usage or a file that cannot be read or written.
#include <cJSON.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "dtype.h"
#include "safetensors.h"

static int fail(const char *what, const char *detail)
{
    fprintf(stderr, "st_rows: %s: %s\n", what, detail);
    return 2;
}

static size_t row_bytes(const lm_st_tensor *t)
{
    return (size_t)t->shape[1] * lm_dtype_bits(t->dtype) / 8;
}

static bool edited(const lm_st_tensor *t, int64_t rows)
{
    return t->ndim == 2 && t->shape[0] == rows;
}

static int write_file(const char *path, const void *a, size_t na, const void *b, size_t nb)
{
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(a, 1, na, f) != na || (nb && fwrite(b, 1, nb, f) != nb) || fclose(f) != 0)
        return fail(path, "cannot write");
    return 0;
}

static int swap(const lm_st_file *in, const char *out, int64_t rows, int64_t i, int64_t j)
{
    uint8_t *copy = malloc(in->size);
    if (!copy)
        return fail(out, "out of memory");
    memcpy(copy, in->bytes, in->size);
    for (int64_t k = 0; k < in->n_tensors; k++) {
        const lm_st_tensor *t = &in->tensors[k];
        if (!edited(t, rows))
            continue;
        size_t rb = row_bytes(t);
        uint8_t *d = copy + (in->data - in->bytes) + t->begin, tmp[rb];
        memcpy(tmp, d + (size_t)i * rb, rb);
        memcpy(d + (size_t)i * rb, d + (size_t)j * rb, rb);
        memcpy(d + (size_t)j * rb, tmp, rb);
    }
    int rc = write_file(out, copy, in->size, NULL, 0);
    free(copy);
    return rc;
}

static int append(const lm_st_file *in, const char *out, int64_t rows, int64_t row)
{
    cJSON *hdr = cJSON_CreateObject(), *meta = cJSON_AddObjectToObject(hdr, "__metadata__");
    cJSON_AddStringToObject(meta, "format", "pt");
    uint64_t size = 0;
    for (int64_t k = 0; k < in->n_tensors; k++) {
        const lm_st_tensor *t = &in->tensors[k];
        uint64_t nb = t->nbytes + (edited(t, rows) ? row_bytes(t) : 0);
        cJSON *e = cJSON_AddObjectToObject(hdr, t->name), *shape = cJSON_AddArrayToObject(e, "shape"),
              *offs = cJSON_AddArrayToObject(e, "data_offsets");
        cJSON_AddStringToObject(e, "dtype", lm_dtype_name(t->dtype));
        for (int d = 0; d < t->ndim; d++)
            cJSON_AddItemToArray(shape, cJSON_CreateNumber((double)(t->shape[d] + (d == 0 && edited(t, rows)))));
        cJSON_AddItemToArray(offs, cJSON_CreateNumber((double)size));
        cJSON_AddItemToArray(offs, cJSON_CreateNumber((double)(size + nb)));
        size += nb;
    }
    char *json = cJSON_PrintUnformatted(hdr);
    size_t jl = strlen(json), padded = (jl + 7) / 8 * 8;
    uint8_t *buf = calloc(1, 8 + padded + size);
    if (!buf)
        return fail(out, "out of memory");
    for (int b = 0; b < 8; b++)
        buf[b] = (uint8_t)((uint64_t)padded >> (8 * b));
    memcpy(buf + 8, json, jl);
    memset(buf + 8 + jl, ' ', padded - jl);
    uint8_t *d = buf + 8 + padded;
    for (int64_t k = 0; k < in->n_tensors; k++) {
        const lm_st_tensor *t = &in->tensors[k];
        memcpy(d, t->data, t->nbytes);
        d += t->nbytes;
        if (edited(t, rows)) {
            memcpy(d, (const uint8_t *)t->data + (size_t)row * row_bytes(t), row_bytes(t));
            d += row_bytes(t);
        }
    }
    int rc = write_file(out, buf, 8 + padded + size, NULL, 0);
    free(buf);
    free(json);
    cJSON_Delete(hdr);
    return rc;
}

int main(int argc, char **argv)
{
    if (argc < 6 || (strcmp(argv[1], "swap") == 0 && argc != 7) || (strcmp(argv[1], "append") == 0 && argc != 6) ||
        ((strcmp(argv[1], "hash") == 0 || strcmp(argv[1], "zero") == 0) && argc != 6)) {
        fprintf(stderr, "usage: st_rows swap IN OUT ROWS I J | append IN OUT ROWS K | hash FILE NAME FROM TO | "
                        "zero FILE NAME FROM TO\n");
        return 2;
    }
    lm_st_file *f = NULL;
    lm_err err = {0};
    if (lm_st_open(&f, argv[2], &err) != LM_OK)
        return fail(argv[2], err.msg);
    int rc;
    if (strcmp(argv[1], "swap") == 0) {
        rc = swap(f, argv[3], atoll(argv[4]), atoll(argv[5]), atoll(argv[6]));
    } else if (strcmp(argv[1], "append") == 0) {
        rc = append(f, argv[3], atoll(argv[4]), atoll(argv[5]));
    } else {
        const lm_st_tensor *t = lm_st_find(f, argv[3]);
        int64_t from = atoll(argv[4]), to = atoll(argv[5]);
        if (!t || t->ndim != 2 || from < 0 || to < from || to > t->shape[0]) {
            lm_st_close(f);
            return fail(argv[3], "no such 2-D tensor, or rows outside it");
        }
        const uint8_t *d = (const uint8_t *)t->data + (size_t)from * row_bytes(t);
        size_t n = (size_t)(to - from) * row_bytes(t);
        if (strcmp(argv[1], "hash") == 0) {
            printf("%016" PRIx64 "\n", (uint64_t)XXH64(d, n, 0));
            rc = 0;
        } else {
            rc = 0;
            for (size_t b = 0; b < n; b++)
                rc |= d[b] != 0;
        }
    }
    lm_st_close(f);
    return rc;
}
