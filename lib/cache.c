// The U_cc² cache: see cache.h. The file: the magic "LMUCC2v1", n (int64), dims[n] (int64),
// the arrays one after another (doubles), then xxHash64 of all of that (uint64); little-endian,
// as the machine writes it.
#include "cache.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <xxhash.h>

#include "util.h"

#define MAGIC "LMUCC2v1"
#define MAX_ENTRY_BYTES (64ull << 30)

char *lm_cache_dir(const char *given)
{
    if (given && *given)
        return lm_strdup(given);
    const char *xdg = getenv("XDG_CACHE_HOME");
    if (xdg && *xdg)
        return lm_path_join(xdg, "llmerge");
    const char *home = getenv("HOME");
    if (!home || !*home)
        return NULL;
    return lm_strfmt("%s/.cache/llmerge", home);
}

// Adds the xxHash64 of the file at path to st (the path's bytes themselves do not count: the
// same bytes elsewhere are the same input).
static lm_status add_file(XXH64_state_t *st, const char *path, lm_err *err)
{
    uint64_t h;
    lm_status s = lm_xxh64_file(path, &h, err);
    if (s == LM_OK)
        XXH64_update(st, &h, sizeof h);
    return s;
}

lm_status lm_cache_key_ucc2(const lm_model *m, const lm_adapter *a, const char *calib, int64_t max_samples,
                            int64_t max_len, double damp, uint64_t *key, lm_err *err)
{
    XXH64_state_t *st = XXH64_createState();
    if (!st)
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    XXH64_reset(st, 0);
    XXH64_update(st, MAGIC, sizeof MAGIC);
    lm_status s = add_file(st, m->config.path, err);
    if (s == LM_OK && m->index_path)
        s = add_file(st, m->index_path, err);
    for (int i = 0; s == LM_OK && i < m->n_shards; i++)
        s = add_file(st, m->shards[i].path, err);
    if (s == LM_OK && a)
        s = add_file(st, a->config.path, err);
    if (s == LM_OK && a)
        s = add_file(st, a->weights_path, err);
    if (s == LM_OK)
        s = add_file(st, calib, err);
    int64_t caps[2] = {max_samples, max_len};
    XXH64_update(st, caps, sizeof caps);
    XXH64_update(st, &damp, sizeof damp);
    *key = XXH64_digest(st);
    XXH64_freeState(st);
    return s;
}

static char *entry_path(const char *dir, uint64_t key)
{
    return lm_strfmt("%s/ucc2-%016" PRIx64 ".bin", dir, key);
}

lm_status lm_cache_load_ucc2(const char *dir, uint64_t key, double ***out, int64_t *n, int64_t **dims, bool *hit,
                             char *why, size_t why_size, lm_err *err)
{
    *out = NULL;
    *n = 0;
    *dims = NULL;
    *hit = false;
    char *path = entry_path(dir, key);
    if (!path)
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    if (access(path, F_OK) != 0) {
        free(path);
        return LM_OK;
    }
    char *data = NULL;
    size_t len = 0;
    lm_err rerr = {0};
    const char *bad = NULL;
    if (lm_read_file(path, MAX_ENTRY_BYTES, &data, &len, &rerr) != LM_OK)
        bad = rerr.msg;
    int64_t count = 0;
    size_t need = 0;
    if (!bad && (len < sizeof MAGIC - 1 + 16 || memcmp(data, MAGIC, sizeof MAGIC - 1) != 0))
        bad = "not a cache entry of this version";
    if (!bad) {
        memcpy(&count, data + 8, 8);
        need = 16;
        if (count < 0 || count > 1 << 24 || len < 16 + (size_t)count * 8)
            bad = "a wrong count of arrays";
    }
    int64_t *dd = NULL;
    if (!bad) {
        dd = malloc((size_t)(count ? count : 1) * sizeof *dd);
        if (!dd) {
            free(data);
            free(path);
            return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
        }
        memcpy(dd, data + 16, (size_t)count * 8);
        need = 16 + (size_t)count * 8;
        for (int64_t i = 0; !bad && i < count; i++) {
            if (dd[i] < 0 || dd[i] > 1 << 24)
                bad = "a wrong array size";
            else
                need += (size_t)dd[i] * 8;
        }
        if (!bad && len != need + 8)
            bad = "the wrong size (truncated or extended)";
    }
    if (!bad) {
        uint64_t sum;
        memcpy(&sum, data + need, 8);
        if (sum != XXH64(data, need, 0))
            bad = "a checksum that does not match its contents";
    }
    if (bad) {
        if (why && why_size)
            snprintf(why, why_size, "%s has %s", path, bad);
        unlink(path);
        free(dd);
        free(data);
        free(path);
        return LM_OK;
    }
    double **arr = calloc((size_t)(count ? count : 1), sizeof *arr);
    size_t off = 16 + (size_t)count * 8;
    for (int64_t i = 0; arr && i < count; i++) {
        if (!(arr[i] = malloc((size_t)(dd[i] ? dd[i] : 1) * sizeof(double)))) {
            for (int64_t j = 0; j < i; j++)
                free(arr[j]);
            free(arr);
            arr = NULL;
            break;
        }
        memcpy(arr[i], data + off, (size_t)dd[i] * 8);
        off += (size_t)dd[i] * 8;
    }
    free(data);
    free(path);
    if (!arr) {
        free(dd);
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    }
    *out = arr;
    *n = count;
    *dims = dd;
    *hit = true;
    return LM_OK;
}

lm_status lm_cache_store_ucc2(const char *dir, uint64_t key, double *const *ucc2, int64_t n, const int64_t *dims,
                              lm_err *err)
{
    lm_status s = lm_mkdir_p(dir, err);
    if (s != LM_OK)
        return s;
    size_t len = 16 + (size_t)n * 8 + 8;
    for (int64_t i = 0; i < n; i++)
        len += (size_t)dims[i] * 8;
    char *buf = malloc(len), *path = entry_path(dir, key);
    char *tmp = path ? lm_strfmt("%s.tmp-%ld", path, (long)getpid()) : NULL;
    if (!buf || !path || !tmp) {
        free(buf);
        free(path);
        free(tmp);
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    }
    memcpy(buf, MAGIC, 8);
    memcpy(buf + 8, &n, 8);
    memcpy(buf + 16, dims, (size_t)n * 8);
    size_t off = 16 + (size_t)n * 8;
    for (int64_t i = 0; i < n; i++) {
        memcpy(buf + off, ucc2[i], (size_t)dims[i] * 8);
        off += (size_t)dims[i] * 8;
    }
    uint64_t sum = XXH64(buf, off, 0);
    memcpy(buf + off, &sum, 8);
    s = lm_write_file(tmp, buf, len, err);
    if (s == LM_OK && rename(tmp, path) != 0)
        s = lm_err_set(err, LM_ERR_IO, "%s: %s", path, strerror(errno));
    if (s != LM_OK)
        unlink(tmp);
    free(buf);
    free(path);
    free(tmp);
    return s;
}
