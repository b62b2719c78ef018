// Embedding matrices rebuilt to the output's vocabulary: see embed_perm.h.
#include "embed_perm.h"

#include <cJSON.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "dtype.h"
#include "util.h"

#define WRITE_CHUNK ((size_t)4 << 20)  // bytes of rows gathered before each write

void lm_embed_perm_free(lm_embed_perm *p)
{
    if (!p)
        return;
    for (int m = 0; p->row && m < p->n_models; m++)
        free(p->row[m]);
    free(p->row);
    free(p->fill);
    free(p->n_own);
    free(p->n_moved);
    free(p);
}

lm_status lm_embed_perm_make(lm_embed_perm **out, const lm_vocab *vocab, const lm_vocab *const *vocabs,
                             const int64_t *rows, int n_models, bool prefer_base, lm_err *err)
{
    *out = NULL;
    lm_embed_perm *p = calloc(1, sizeof *p);
    lm_strmap *maps = calloc((size_t)n_models, sizeof *maps);
    lm_status s = LM_OK;
    if (!p || !maps)
        goto nomem;
    p->n_models = n_models;
    p->n_rows = vocab->n_ids;
    size_t n = (size_t)(p->n_rows > 0 ? p->n_rows : 1);
    if (!(p->row = calloc((size_t)n_models, sizeof *p->row)) || !(p->fill = malloc(n * sizeof *p->fill)) ||
        !(p->n_own = calloc((size_t)n_models, sizeof *p->n_own)) ||
        !(p->n_moved = calloc((size_t)n_models, sizeof *p->n_moved)))
        goto nomem;
    // each model's token -> id
    for (int m = 0; m < n_models; m++) {
        const lm_vocab *v = vocabs[m] ? vocabs[m] : vocabs[0];
        if (!(p->row[m] = malloc(n * sizeof *p->row[m])) || lm_strmap_init(&maps[m], (size_t)v->n_tokens) != LM_OK)
            goto nomem;
        for (int64_t id = 0; id < v->n_ids && id < rows[m]; id++)
            if (v->token[id] && lm_strmap_put(&maps[m], v->token[id], id) < 0)
                goto nomem;
    }
    for (int64_t id = 0; id < p->n_rows; id++) {
        const char *tok = vocab->token[id];
        int present = 0, first = -1;
        for (int m = 0; m < n_models; m++) {
            int64_t r = tok ? lm_strmap_get(&maps[m], tok) : -1;
            p->row[m][id] = (int32_t)r;
            if (r >= 0) {
                present++;
                first = first < 0 ? m : first;
                p->n_own[m]++;
                p->n_moved[m] += r != id;
            }
        }
        p->n_tokens += tok != NULL;
        if (present == 1) {
            p->fill[id] = first;
            p->n_single++;
        } else if (present == 0) {
            p->fill[id] = LM_EMBED_ZERO;
            p->n_none += tok != NULL;
        } else if (prefer_base && p->row[0][id] >= 0) {
            p->fill[id] = 0;
            p->n_base += present < n_models;
        } else {
            p->fill[id] = LM_EMBED_AVERAGE;
            p->n_average += present < n_models;
        }
    }
    goto done;
nomem:
    s = lm_err_set(err, LM_ERR_NOMEM, "out of memory");
done:
    for (int m = 0; maps && m < n_models; m++)
        lm_strmap_free(&maps[m]);
    free(maps);
    if (s != LM_OK)
        lm_embed_perm_free(p);
    else
        *out = p;
    return s;
}

// Writes `len` bytes at `off` of fd, whole.
static lm_status write_at(int fd, const void *buf, size_t len, uint64_t off, const char *label, lm_err *err)
{
    const char *b = buf;
    while (len > 0) {
        ssize_t w = pwrite(fd, b, len, (off_t)off);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return lm_err_set(err, LM_ERR_IO, "%s: %s", label, w < 0 ? strerror(errno) : "short write");
        b += w;
        len -= (size_t)w;
        off += (uint64_t)w;
    }
    return LM_OK;
}

// Row `id` of model m's rebuilt tensor k into dst (H values in the dtype of model m's tensor);
// f32 is scratch for H floats, acc for H more.
static lm_status rebuilt_row(const lm_embed_perm *p, int m, const lm_st_tensor *const *t, int64_t id, void *dst,
                             float *f32, float *acc, lm_err *err)
{
    const lm_st_tensor *mine = t[m];
    int64_t h = mine->shape[1];
    size_t rb = (size_t)h * lm_dtype_bits(mine->dtype) / 8;
    int src = p->row[m][id] >= 0 ? m : p->fill[id];
    if (src == LM_EMBED_ZERO) {
        memset(dst, 0, rb);
        return LM_OK;
    }
    if (src >= 0) {
        const lm_st_tensor *from = t[src];
        size_t fb = (size_t)h * lm_dtype_bits(from->dtype) / 8;
        const uint8_t *row = (const uint8_t *)from->data + (size_t)p->row[src][id] * fb;
        if (from->dtype == mine->dtype) {
            memcpy(dst, row, rb);
            return LM_OK;
        }
        lm_status s = lm_convert_to_f32(f32, row, from->dtype, h, err);
        return s != LM_OK ? s : lm_convert_from_f32(dst, mine->dtype, f32, h, err);
    }
    // the mean of the rows of the models that have the token
    int count = 0;
    memset(acc, 0, (size_t)h * sizeof *acc);
    for (int j = 0; j < p->n_models; j++) {
        if (p->row[j][id] < 0)
            continue;
        const lm_st_tensor *from = t[j];
        size_t fb = (size_t)h * lm_dtype_bits(from->dtype) / 8;
        lm_status s = lm_convert_to_f32(f32, (const uint8_t *)from->data + (size_t)p->row[j][id] * fb, from->dtype,
                                        h, err);
        if (s != LM_OK)
            return s;
        for (int64_t c = 0; c < h; c++)
            acc[c] += f32[c];
        count++;
    }
    for (int64_t c = 0; c < h; c++)
        acc[c] /= (float)count;
    return lm_convert_from_f32(dst, mine->dtype, acc, h, err);
}

lm_status lm_embed_perm_write(const lm_embed_perm *p, int m, const lm_st_tensor *const *t, const char *const *names,
                              int n_names, int fd, bool data, const char *label, lm_err *err)
{
    lm_status s = LM_OK;
    cJSON *hdr = cJSON_CreateObject(), *meta = cJSON_AddObjectToObject(hdr, "__metadata__");
    char *json = NULL;
    uint8_t *buf = NULL, *head = NULL;
    float *f32 = NULL, *acc = NULL;
    uint64_t off = 0;
    if (!hdr || !meta || !cJSON_AddStringToObject(meta, "format", "pt"))
        goto nomem;
    for (int k = 0; k < n_names; k++) {
        const lm_st_tensor *mine = t[k * p->n_models + m];
        if (!lm_dtype_writable(mine->dtype)) {
            s = lm_err_set(err, LM_ERR_UNSUPPORTED, "%s: tensor '%s' is %s: its rows can be rebuilt only from F32, "
                           "F16 or BF16", label, names[k], lm_dtype_name(mine->dtype));
            goto done;
        }
        for (int j = 0; j < p->n_models; j++)
            if (!lm_dtype_readable(t[k * p->n_models + j]->dtype)) {
                s = lm_err_set(err, LM_ERR_UNSUPPORTED, "%s: tensor '%s' of model %d is %s, not a floating type",
                               label, names[k], j, lm_dtype_name(t[k * p->n_models + j]->dtype));
                goto done;
            }
        uint64_t nb = (uint64_t)p->n_rows * (uint64_t)mine->shape[1] * lm_dtype_bits(mine->dtype) / 8;
        cJSON *e = cJSON_AddObjectToObject(hdr, names[k]);
        cJSON *shape = e ? cJSON_AddArrayToObject(e, "shape") : NULL;
        cJSON *offs = e ? cJSON_AddArrayToObject(e, "data_offsets") : NULL;
        if (!offs || !cJSON_AddStringToObject(e, "dtype", lm_dtype_name(mine->dtype)) ||
            !cJSON_AddItemToArray(shape, cJSON_CreateNumber((double)p->n_rows)) ||
            !cJSON_AddItemToArray(shape, cJSON_CreateNumber((double)mine->shape[1])) ||
            !cJSON_AddItemToArray(offs, cJSON_CreateNumber((double)off)) ||
            !cJSON_AddItemToArray(offs, cJSON_CreateNumber((double)(off + nb))))
            goto nomem;
        off += nb;
    }
    if (!(json = cJSON_PrintUnformatted(hdr)))
        goto nomem;
    size_t jl = strlen(json), padded = (jl + 7) / 8 * 8;
    if (!(head = malloc(8 + padded)))
        goto nomem;
    for (int i = 0; i < 8; i++)
        head[i] = (uint8_t)((uint64_t)padded >> (8 * i));
    memcpy(head + 8, json, jl);
    memset(head + 8 + jl, ' ', padded - jl);
    if ((s = write_at(fd, head, 8 + padded, 0, label, err)) != LM_OK)
        goto done;
    uint64_t base = 8 + padded;
    if (!data) {
        if (ftruncate(fd, (off_t)(base + off)) != 0)
            s = lm_err_set(err, LM_ERR_IO, "%s: %s", label, strerror(errno));
        goto done;
    }
    // the rows, a chunk at a time
    off = base;
    for (int k = 0; k < n_names && s == LM_OK; k++) {
        const lm_st_tensor *const *tk = t + k * p->n_models;
        int64_t h = tk[m]->shape[1];
        size_t rb = (size_t)h * lm_dtype_bits(tk[m]->dtype) / 8;
        size_t per = rb >= WRITE_CHUNK ? 1 : WRITE_CHUNK / rb;
        free(buf);
        free(f32);
        free(acc);
        buf = malloc(per * rb);
        f32 = malloc((size_t)h * sizeof *f32);
        acc = malloc((size_t)h * sizeof *acc);
        if (!buf || !f32 || !acc)
            goto nomem;
        for (int64_t id = 0; id < p->n_rows && s == LM_OK; id += (int64_t)per) {
            int64_t end = id + (int64_t)per < p->n_rows ? id + (int64_t)per : p->n_rows;
            for (int64_t r = id; r < end && s == LM_OK; r++)
                s = rebuilt_row(p, m, tk, r, buf + (size_t)(r - id) * rb, f32, acc, err);
            if (s == LM_OK)
                s = write_at(fd, buf, (size_t)(end - id) * rb, off, label, err);
            off += (uint64_t)(end - id) * rb;
        }
    }
    goto done;
nomem:
    s = lm_err_set(err, LM_ERR_NOMEM, "out of memory");
done:
    cJSON_Delete(hdr);
    free(json);
    free(head);
    free(buf);
    free(f32);
    free(acc);
    return s;
}
