// Model directories: see model.h. Opening reads config.json, then either the single
// model.safetensors or the index and each shard it names (once), cross-checks index and
// shards, and builds the tensor list and the name map.
#include "model.h"

#include <cJSON.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "json.h"

#define INDEX_MAX_BYTES (256u << 20)  // an index of a huge model is a few MiB

static const char *const SINGLE_NAME = "model.safetensors";
static const char *const INDEX_NAME = "model.safetensors.index.json";

// ==== opening the weights =====================================================================

// Appends one shard (file name and path copied) and opens it. When an index named it
// (`listed_by`, holding `example` tensor) a file that is missing, or is not a regular file (a
// directory, a FIFO: named as what it is, and never opened), is LM_ERR_FORMAT, as the index is
// then wrong.
static lm_status add_shard(lm_model *m, const char *file, const char *listed_by,
                           const char *example, lm_err *err)
{
    lm_model_shard *sh = &m->shards[m->n_shards];
    memset(sh, 0, sizeof *sh);
    sh->file = lm_strdup(file);
    sh->path = lm_path_join(m->dir, file);
    m->n_shards++;
    if (!sh->file || !sh->path)
        return lm_err_set(err, LM_ERR_NOMEM, "%s: out of memory", m->dir);
    struct stat st;
    if (listed_by) {
        if (stat(sh->path, &st) != 0) {
            if (errno == ENOENT)
                return lm_err_set(err, LM_ERR_FORMAT,
                                  "%s: shard '%s' (holding tensor '%s') is missing: %s does not exist",
                                  listed_by, file, example, sh->path);
        } else if (S_ISDIR(st.st_mode)) {
            return lm_err_set(err, LM_ERR_FORMAT, "%s: shard '%s' (holding tensor '%s') is a directory: %s",
                              listed_by, file, example, sh->path);
        } else if (!S_ISREG(st.st_mode)) {
            return lm_err_set(err, LM_ERR_FORMAT,
                              "%s: shard '%s' (holding tensor '%s') is not a regular file (%s): %s", listed_by,
                              file, example, lm_file_kind(st.st_mode), sh->path);
        }
    }
    return lm_st_open(&sh->st, sh->path, err);
}

static int cmp_str(const void *a, const void *b)
{
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

// Adds shard `si`'s tensors to the model's list, in data order. `wmap` (may be NULL for a
// single file) maps tensor names to positions in `wfiles`, the index's shard name per entry.
static lm_status collect_shard(lm_model *m, int si, const lm_strmap *wmap, const char **wfiles,
                               lm_err *err)
{
    lm_model_shard *sh = &m->shards[si];
    for (int64_t i = 0; i < sh->st->n_tensors; i++) {
        const lm_st_tensor *t = &sh->st->tensors[i];
        if (wmap) {
            int64_t w = lm_strmap_get(wmap, t->name);
            if (w < 0)
                return lm_err_set(err, LM_ERR_FORMAT,
                                  "%s: tensor '%s' is in shard %s but not in the index's weight_map",
                                  m->index_path, t->name, sh->file);
            if (strcmp(wfiles[w], sh->file) != 0)
                return lm_err_set(err, LM_ERR_FORMAT,
                                  "%s: tensor '%s' is in two shards, %s and %s (the index names %s)",
                                  m->index_path, t->name, sh->file, wfiles[w], wfiles[w]);
        }
        int put = lm_strmap_put(&m->index, t->name, m->n_tensors);
        if (put < 0)
            return lm_err_set(err, LM_ERR_NOMEM, "%s: out of memory", m->dir);
        if (put == 0) {
            int other = m->tensor_shard[lm_strmap_get(&m->index, t->name)];
            return lm_err_set(err, LM_ERR_FORMAT, "%s: tensor '%s' is in two shards, %s and %s",
                              m->dir, t->name, m->shards[other].file, sh->file);
        }
        m->tensors[m->n_tensors] = t;
        m->tensor_shard[m->n_tensors] = si;
        m->n_tensors++;
        sh->n_tensors++;
        sh->nbytes += t->nbytes;
    }
    return LM_OK;
}

static lm_status alloc_tensor_list(lm_model *m, int64_t n, lm_err *err)
{
    m->tensors = calloc((size_t)n + 1, sizeof *m->tensors);
    m->tensor_shard = calloc((size_t)n + 1, sizeof *m->tensor_shard);
    if (!m->tensors || !m->tensor_shard || lm_strmap_init(&m->index, (size_t)n) != LM_OK)
        return lm_err_set(err, LM_ERR_NOMEM, "%s: out of memory for %lld tensors", m->dir,
                          (long long)n);
    return LM_OK;
}

static lm_status open_single(lm_model *m, lm_err *err)
{
    m->shards = calloc(1, sizeof *m->shards);
    if (!m->shards)
        return lm_err_set(err, LM_ERR_NOMEM, "%s: out of memory", m->dir);
    lm_status s = add_shard(m, SINGLE_NAME, NULL, NULL, err);
    if (s == LM_OK)
        s = alloc_tensor_list(m, m->shards[0].st->n_tensors, err);
    if (s == LM_OK)
        s = collect_shard(m, 0, NULL, NULL, err);
    return s;
}

lm_status lm_model_index_parse(cJSON **out, const cJSON **weight_map, const char *text, size_t len,
                               const char *label, lm_err *err)
{
    *out = NULL;
    *weight_map = NULL;
    cJSON *root = NULL;
    lm_status s = lm_json_parse(&root, text, len, label, err);
    if (s != LM_OK)
        return s;
    const cJSON *map = cJSON_GetObjectItemCaseSensitive(root, "weight_map");
    if (!cJSON_IsObject(root))
        s = lm_err_set(err, LM_ERR_FORMAT, "%s: not a JSON object (found %s)", label, lm_json_kind(root));
    else if (!map)
        s = lm_err_set(err, LM_ERR_FORMAT, "%s: key 'weight_map' is missing", label);
    else if (!cJSON_IsObject(map))
        s = lm_err_set(err, LM_ERR_FORMAT, "%s: key 'weight_map' must be an object", label);
    // each value a plain file name in the model directory (each key is there once: the reader
    // refuses a key given twice)
    for (const cJSON *e = s == LM_OK ? map->child : NULL; e && s == LM_OK; e = e->next) {
        const char *f = cJSON_IsString(e) ? e->valuestring : NULL;
        if (!f)
            s = lm_err_set(err, LM_ERR_FORMAT, "%s: weight_map['%s'] must be a file name string", label,
                           e->string);
        else if (!*f || strchr(f, '/') || strcmp(f, ".") == 0 || strcmp(f, "..") == 0)
            s = lm_err_set(err, LM_ERR_FORMAT,
                           "%s: weight_map['%s'] = '%s' is not a file name in the model directory", label,
                           e->string, f);
    }
    if (s != LM_OK) {
        cJSON_Delete(root);
        return s;
    }
    *out = root;
    *weight_map = map;
    return LM_OK;
}

static lm_status open_sharded(lm_model *m, lm_err *err)
{
    const char *ip = m->index_path;
    char *text = NULL;
    size_t len = 0;
    cJSON *root = NULL;
    const cJSON *map = NULL;
    lm_strmap wmap = {0}, files = {0};
    const char **wfiles = NULL, **wnames = NULL, **unique = NULL;
    int64_t n_entries = 0, n_unique = 0;

    lm_status s = lm_read_file(ip, INDEX_MAX_BYTES, &text, &len, err);
    if (s != LM_OK || (s = lm_model_index_parse(&root, &map, text, len, ip, err)) != LM_OK)
        goto fail;
    n_entries = cJSON_GetArraySize(map);
    wfiles = calloc((size_t)n_entries + 1, sizeof *wfiles);
    wnames = calloc((size_t)n_entries + 1, sizeof *wnames);
    unique = calloc((size_t)n_entries + 1, sizeof *unique);
    if (!wfiles || !wnames || !unique || lm_strmap_init(&wmap, (size_t)n_entries) != LM_OK ||
        lm_strmap_init(&files, 8) != LM_OK) {
        s = lm_err_set(err, LM_ERR_NOMEM, "%s: out of memory", ip);
        goto fail;
    }

    // Entries: each tensor once, each value a file name (lm_model_index_parse checked both).
    int64_t k = 0;
    for (const cJSON *e = map->child; e; e = e->next, k++) {
        const char *f = e->valuestring;
        int put = lm_strmap_put(&wmap, e->string, k);
        if (put == 0) {
            s = lm_err_set(err, LM_ERR_FORMAT, "%s: tensor '%s' is listed twice in weight_map "
                           "(%s and %s)", ip, e->string, wfiles[lm_strmap_get(&wmap, e->string)], f);
            goto fail;
        }
        int putf = put < 0 ? -1 : lm_strmap_put(&files, f, n_unique);
        if (put < 0 || putf < 0) {
            s = lm_err_set(err, LM_ERR_NOMEM, "%s: out of memory", ip);
            goto fail;
        }
        if (putf == 1)
            unique[n_unique++] = f;
        wfiles[k] = f;
        wnames[k] = e->string;
    }

    // Shards in file-name order (model-00001-of-... sorts numerically), each opened once.
    qsort(unique, (size_t)n_unique, sizeof *unique, cmp_str);
    lm_strmap_free(&files);  // renumber: file name -> position in sorted order
    if (lm_strmap_init(&files, (size_t)n_unique) != LM_OK) {
        s = lm_err_set(err, LM_ERR_NOMEM, "%s: out of memory", ip);
        goto fail;
    }
    for (int64_t i = 0; i < n_unique; i++)
        lm_strmap_put(&files, unique[i], i);  // cannot grow: sized for n_unique
    m->shards = calloc((size_t)n_unique + 1, sizeof *m->shards);
    if (!m->shards) {
        s = lm_err_set(err, LM_ERR_NOMEM, "%s: out of memory", ip);
        goto fail;
    }
    for (int64_t i = 0; i < n_unique; i++) {
        const char *example = "?";
        for (int64_t j = 0; j < n_entries; j++) {
            if (strcmp(wfiles[j], unique[i]) == 0) {
                example = wnames[j];
                break;
            }
        }
        if ((s = add_shard(m, unique[i], ip, example, err)) != LM_OK)
            goto fail;
    }

    // Every listed tensor must be in the shard the index names.
    int64_t total = 0;
    for (int i = 0; i < m->n_shards; i++)
        total += m->shards[i].st->n_tensors;
    for (int64_t j = 0; j < n_entries; j++) {
        const lm_model_shard *sh = &m->shards[lm_strmap_get(&files, wfiles[j])];
        if (!lm_st_find(sh->st, wnames[j])) {
            s = lm_err_set(err, LM_ERR_FORMAT,
                           "%s: tensor '%s' is listed in the index but not in its shard %s",
                           ip, wnames[j], sh->path);
            goto fail;
        }
    }

    if ((s = alloc_tensor_list(m, total, err)) != LM_OK)
        goto fail;
    for (int i = 0; i < m->n_shards; i++)
        if ((s = collect_shard(m, i, &wmap, wfiles, err)) != LM_OK)
            goto fail;
    s = LM_OK;

fail:
    lm_strmap_free(&wmap);
    lm_strmap_free(&files);
    free(wfiles);
    free(wnames);
    free(unique);
    cJSON_Delete(root);
    free(text);
    return s;
}

// ==== the model ===============================================================================

lm_status lm_model_open(lm_model **out, const char *dir, lm_err *err)
{
    *out = NULL;
    lm_model *m = calloc(1, sizeof *m);
    char *config_path = NULL, *single = NULL, *bin = NULL, *bin_index = NULL;
    lm_status s;
    if (!m || !(m->dir = lm_strdup(dir)) || !(config_path = lm_path_join(dir, "config.json")) ||
        !(single = lm_path_join(dir, SINGLE_NAME)) ||
        !(m->index_path = lm_path_join(dir, INDEX_NAME)) ||
        !(bin = lm_path_join(dir, "pytorch_model.bin")) ||
        !(bin_index = lm_path_join(dir, "pytorch_model.bin.index.json"))) {
        s = lm_err_set(err, LM_ERR_NOMEM, "%s: out of memory", dir);
        goto fail;
    }
    if (!lm_is_dir(dir)) {
        s = lm_err_set(err, LM_ERR_NOT_FOUND, "%s: not a directory", dir);
        goto fail;
    }
    if (!lm_is_file(config_path)) {
        s = lm_err_set(err, LM_ERR_NOT_FOUND, "%s: no config.json in the model directory", dir);
        goto fail;
    }
    if ((s = lm_config_load(&m->config, config_path, err)) != LM_OK)
        goto fail;

    // transformers looks for the single file first, then the index.
    if (lm_is_file(single)) {
        free(m->index_path);
        m->index_path = NULL;
        s = open_single(m, err);
    } else if (lm_is_file(m->index_path)) {
        s = open_sharded(m, err);
    } else if (lm_is_file(bin) || lm_is_file(bin_index)) {
        s = lm_err_set(err, LM_ERR_UNSUPPORTED,
                       "%s: the weights are in pytorch_model.bin (a torch pickle); llmerge reads "
                       "only safetensors: convert them first (save_pretrained(..., "
                       "safe_serialization=True))", dir);
    } else {
        s = lm_err_set(err, LM_ERR_NOT_FOUND,
                       "%s: no model.safetensors or model.safetensors.index.json", dir);
    }
    if (s != LM_OK)
        goto fail;

    free(config_path);
    free(single);
    free(bin);
    free(bin_index);
    *out = m;
    return LM_OK;

fail:
    free(config_path);
    free(single);
    free(bin);
    free(bin_index);
    lm_model_free(m);
    return s;
}

void lm_model_free(lm_model *m)
{
    if (!m)
        return;
    for (int i = 0; i < m->n_shards; i++) {
        lm_st_close(m->shards[i].st);
        free(m->shards[i].file);
        free(m->shards[i].path);
    }
    free(m->shards);
    for (int i = 0; i < m->n_overlays; i++)
        lm_st_close(m->overlays[i]);
    free(m->overlays);
    free(m->tensors);
    free(m->tensor_shard);
    lm_strmap_free(&m->index);
    lm_config_free(&m->config);
    free(m->index_path);
    free(m->dir);
    free(m);
}

lm_status lm_model_overlay(lm_model *m, lm_st_file *f, int64_t vocab_size, lm_err *err)
{
    for (int64_t i = 0; i < f->n_tensors; i++)
        if (lm_strmap_get(&m->index, f->tensors[i].name) < 0) {
            lm_status s = lm_err_set(err, LM_ERR_MISMATCH, "%s: tensor '%s' is not one of %s's", f->path,
                                     f->tensors[i].name, m->dir);
            lm_st_close(f);
            return s;
        }
    lm_st_file **grown = realloc(m->overlays, (size_t)(m->n_overlays + 1) * sizeof *grown);
    if (!grown) {
        lm_st_close(f);
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    }
    m->overlays = grown;
    m->overlays[m->n_overlays++] = f;
    for (int64_t i = 0; i < f->n_tensors; i++)
        m->tensors[lm_strmap_get(&m->index, f->tensors[i].name)] = &f->tensors[i];
    m->config.vocab_size = vocab_size;
    return LM_OK;
}

const lm_st_tensor *lm_model_find(const lm_model *m, const char *name)
{
    int64_t i = lm_strmap_get(&m->index, name);
    return i < 0 ? NULL : m->tensors[i];
}

int64_t lm_model_find_index(const lm_model *m, const char *name)
{
    return lm_strmap_get(&m->index, name);
}

// ==== checks and summaries ====================================================================

static bool same_shape(const lm_st_tensor *t, const lm_arch_tensor *a)
{
    if (t->ndim != a->ndim)
        return false;
    for (int d = 0; d < a->ndim; d++)
        if (t->shape[d] != a->shape[d])
            return false;
    return true;
}

lm_status lm_model_check_desc(const lm_model *m, const lm_arch_desc *d, int64_t *n_extra,
                              lm_err *err)
{
    int64_t problems = 0, found = 0;
    char first[LM_ERR_MSG_MAX] = "";
    const char *cfg = m->config.path ? m->config.path : "config.json";
    for (int64_t i = 0; i < d->n_tensors; i++) {
        const lm_arch_tensor *a = &d->tensors[i];
        int64_t ti = lm_model_find_index(m, a->name);
        char want[64], got[64];
        lm_st_shape_str(a->shape, a->ndim, want, sizeof want);
        if (ti < 0) {
            if (problems++ == 0)
                snprintf(first, sizeof first, "%s: tensor '%s' %s (from %s) is missing", m->dir,
                         a->name, want, cfg);
            continue;
        }
        found++;
        const lm_st_tensor *t = m->tensors[ti];
        if (!same_shape(t, a) && problems++ == 0) {
            lm_st_shape_str(t->shape, t->ndim, got, sizeof got);
            snprintf(first, sizeof first, "%s: tensor '%s' has shape %s, but %s gives %s",
                     m->shards[m->tensor_shard[ti]].path, a->name, got, cfg, want);
        }
    }
    if (n_extra)
        *n_extra = m->n_tensors - found;
    if (problems == 0)
        return LM_OK;
    if (problems == 1)
        return lm_err_set(err, LM_ERR_MISMATCH, "%s", first);
    return lm_err_set(err, LM_ERR_MISMATCH, "%s (and %lld more problems)", first,
                      (long long)(problems - 1));
}

lm_status lm_model_check(const lm_model *m, int64_t *n_extra, lm_err *err)
{
    lm_arch_desc d;
    lm_status s = lm_arch_describe(&d, &m->config, err);
    if (s != LM_OK)
        return s;
    s = lm_model_check_desc(m, &d, n_extra, err);
    lm_arch_desc_free(&d);
    return s;
}

lm_status lm_model_compare(const lm_model *ft, const lm_model *base, int64_t *n_extra,
                           lm_err *err)
{
    int64_t problems = 0, found = 0;
    char first[LM_ERR_MSG_MAX] = "";
    for (int64_t i = 0; i < base->n_tensors; i++) {
        const lm_st_tensor *b = base->tensors[i], *t = lm_model_find(ft, b->name);
        char sb[64], st[64];
        lm_st_shape_str(b->shape, b->ndim, sb, sizeof sb);
        if (!t) {
            if (problems++ == 0)
                snprintf(first, sizeof first, "%s: tensor '%s' %s of the base %s is missing",
                         ft->dir, b->name, sb, base->dir);
            continue;
        }
        found++;
        bool same = t->ndim == b->ndim;
        for (int d = 0; same && d < b->ndim; d++)
            same = t->shape[d] == b->shape[d];
        if (!same && problems++ == 0) {
            lm_st_shape_str(t->shape, t->ndim, st, sizeof st);
            snprintf(first, sizeof first, "%s: tensor '%s' has shape %s, but %s in the base %s",
                     ft->dir, b->name, st, sb, base->dir);
        }
    }
    if (n_extra)
        *n_extra = ft->n_tensors - found;
    if (problems == 0)
        return LM_OK;
    if (problems == 1)
        return lm_err_set(err, LM_ERR_MISMATCH, "%s", first);
    return lm_err_set(err, LM_ERR_MISMATCH, "%s (and %lld more problems)", first,
                      (long long)(problems - 1));
}

int64_t lm_model_param_count(const lm_model *m)
{
    int64_t n = 0;
    for (int64_t i = 0; i < m->n_tensors; i++)
        n += m->tensors[i]->numel;
    return n;
}

uint64_t lm_model_nbytes(const lm_model *m)
{
    uint64_t n = 0;
    for (int i = 0; i < m->n_shards; i++)
        n += m->shards[i].nbytes;
    return n;
}

void lm_model_dtype_counts(const lm_model *m, int64_t counts[LM_DTYPE_COUNT])
{
    memset(counts, 0, sizeof(int64_t) * LM_DTYPE_COUNT);
    for (int64_t i = 0; i < m->n_tensors; i++)
        if ((unsigned)m->tensors[i]->dtype < LM_DTYPE_COUNT)
            counts[m->tensors[i]->dtype]++;
}

lm_dtype lm_model_out_dtype(const lm_model *m)
{
    const lm_config *c = &m->config;
    if (c->has_dtype && lm_dtype_writable(c->dtype))
        return c->dtype;
    int64_t counts[LM_DTYPE_COUNT];
    lm_model_dtype_counts(m, counts);
    static const lm_dtype order[] = {LM_DTYPE_BF16, LM_DTYPE_F16, LM_DTYPE_F32};
    lm_dtype best = LM_DTYPE_F32;
    int64_t best_n = counts[LM_DTYPE_F64];
    for (size_t i = 0; i < sizeof order / sizeof order[0]; i++)
        if (counts[order[i]] > best_n) {
            best_n = counts[order[i]];
            best = order[i];
        }
    return best;
}
