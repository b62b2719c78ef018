// sparsegpt's side of the merge command: see sparsegpt.h.
#include "sparsegpt.h"

#include <cJSON.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "args.h"
#include "device.h"
#include "hessian.h"
#include "util.h"
#include "xlock.h"

static void cache_free(sgpt_cache *c)
{
    for (int i = 0; i < c->n_ft; i++) {
        if (c->masks)
            lm_cache_masks_free(&c->masks[i]);
        if (c->mask_out)
            lm_cache_close(c->mask_out[i]);  // a merge that failed keeps nothing
    }
    free(c->dir);
    free(c->hess_key);
    free(c->ucc2_key);
    free(c->mask_key);
    free(c->masks);
    free(c->mask_hit);
    free(c->mask_out);
    free(c->mask_failed);
    memset(c, 0, sizeof *c);
}

// An event for --log-json: what happened to a cache entry ("hit", "miss", "damaged", "stored",
// "not stored").
static void cache_event(lm_cmd_sgpt *g, lm_cache_kind kind, const char *path, const char *result, const char *why)
{
    if (g->cache.polling && strcmp(result, "miss") == 0)
        return;
    cJSON *f = cJSON_CreateObject();
    cJSON_AddStringToObject(f, "kind", lm_cache_kind_name(kind));
    cJSON_AddStringToObject(f, "path", path ? path : "");
    cJSON_AddStringToObject(f, "result", result);
    if (why && *why)
        cJSON_AddStringToObject(f, "reason", why);
    lm_progress_event(g->in.progress, "cache", f);
}

// Says that an entry was damaged (it has been removed) and is computed again.
static void cache_damaged(lm_cmd_sgpt *g, lm_cache_kind kind, uint64_t key, const char *why)
{
    lm_progress_note(g->in.progress, "cache: %s: computing it again", why);
    char *path = lm_cache_entry_path(g->cache.dir, kind, key);
    cache_event(g, kind, path, "damaged", why);
    free(path);
}

// The widths of the model's layer inputs, by point.
static void input_dims(const lm_config *cfg, int64_t dims[LM_FWD_N_POINTS])
{
    dims[LM_FWD_ATTN_IN] = cfg->hidden_size;
    dims[LM_FWD_O_IN] = cfg->num_attention_heads * cfg->head_dim;
    dims[LM_FWD_MLP_IN] = cfg->hidden_size;
    dims[LM_FWD_DOWN_IN] = cfg->intermediate_size;
}

// The Hessian set (and so the U_cc² set) FT j is selected by.
static int set_of(const lm_cmd_sgpt *g, int j)
{
    return g->n_sets == 1 ? 0 : j;
}

// The keys of every entry this merge may read or write, from digests of its inputs (each
// file hashed once).
static lm_status cache_keys(lm_cmd_sgpt *g, lm_err *err)
{
    sgpt_cache *c = &g->cache;
    uint64_t base_d, ft_d[g->in.n_ft], calib_d[g->in.n_calib];
    lm_status s = lm_cache_digest_model(g->in.base, &base_d, err);
    for (int j = 0; s == LM_OK && j < g->in.n_ft; j++)
        s = g->in.fts[j]->model ? lm_cache_digest_model(g->in.fts[j]->model, &ft_d[j], err)
                                : lm_cache_digest_adapter(g->in.fts[j]->adapter, &ft_d[j], err);
    for (int i = 0; s == LM_OK && i < g->in.n_calib; i++)
        s = lm_cache_digest_file(g->in.calib[i].path, &calib_d[i], err);
    if (s != LM_OK)
        return lm_err_prefix(err, "the cache keys");
    const lm_config *cfg = &g->in.base->config;
    int64_t seq_len = g->in.seq_len ? g->in.seq_len : cfg->max_position_embeddings > 1 ? cfg->max_position_embeddings : 0;
    for (int i = 0; i < g->n_sets; i++) {
        const lm_ft *ft = g->in.from_base ? NULL : g->in.fts[i];
        lm_cache_hess_src src = {
            .model = ft && ft->model ? ft_d[i] : base_d,
            .has_adapter = ft && ft->adapter,
            .adapter = ft && ft->adapter ? ft_d[i] : 0,
            .calib = calib_d[g->in.n_calib == 1 ? 0 : i],
            .max_samples = g->in.calib_samples,
            .max_len = seq_len,
        };
        c->hess_key[i] = lm_cache_key_hess(&src);
        c->ucc2_key[i] = lm_cache_key_ucc2(&src, SGPT_DAMP);
    }
    for (int j = 0; j < g->in.n_ft; j++) {
        lm_cache_mask_src src = {c->ucc2_key[set_of(g, j)], base_d, ft_d[j], g->in.densities[j], g->in.topk_global};
        c->mask_key[j] = lm_cache_key_mask(&src);
    }
    return LM_OK;
}

// Whether the masks m hold exactly one of the right size for every tensor FT j changes (the
// tensors the engine selects: lm_eng_find_parts' rule), so that a hit never mixes stored and
// selected masks of one FT (which --topk global cannot).
static bool masks_cover(const lm_cmd_sgpt *g, int j, const lm_cache_masks *m)
{
    const lm_ft *ft = g->in.fts[j];
    int64_t touched = 0;
    for (int64_t t = 0; t < g->in.base->n_tensors; t++) {
        const lm_st_tensor *bt = g->in.base->tensors[t];
        if (!lm_dtype_readable(bt->dtype) || bt->numel == 0)
            continue;
        bool touches;
        if (ft->model) {
            const lm_st_tensor *f = lm_model_find(ft->model, bt->name);
            touches = f && lm_dtype_readable(f->dtype);
        } else {
            int64_t idx;
            touches = lm_adapter_lookup(ft->adapter, bt->name, &idx) != LM_TOUCH_NONE;
        }
        if (!touches)
            continue;
        touched++;
        if (!lm_cache_masks_find(m, bt->name, bt->numel))
            return false;
    }
    return touched == m->n;
}

// FT j's masks from the cache, when it has a sound entry that covers the FT.
static lm_status masks_from_cache(lm_cmd_sgpt *g, int j, lm_err *err)
{
    sgpt_cache *c = &g->cache;
    char why[LM_ERR_MSG_MAX] = "";
    bool hit = false;
    lm_status s = lm_cache_load_masks(c->dir, c->mask_key[j], &c->masks[j], &hit, why, sizeof why, err);
    if (s != LM_OK)
        return s;
    char *path = lm_cache_entry_path(c->dir, LM_CACHE_MASK, c->mask_key[j]);
    if (!path)
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    if (why[0])
        cache_damaged(g, LM_CACHE_MASK, c->mask_key[j], why);
    if (hit && !masks_cover(g, j, &c->masks[j])) {
        snprintf(why, sizeof why, "%s does not hold a mask for every tensor FT %d changes", path, j + 1);
        unlink(path);
        cache_damaged(g, LM_CACHE_MASK, c->mask_key[j], why);
        lm_cache_masks_free(&c->masks[j]);
        hit = false;
    }
    c->mask_hit[j] = hit;
    if (hit)
        lm_progress_note(g->in.progress, "top-k masks of FT %d (%s): from the cache (%s)", j + 1, g->in.fts[j]->path, path);
    cache_event(g, LM_CACHE_MASK, path, hit ? "hit" : "miss", NULL);
    free(path);
    return LM_OK;
}

// Keeps U_cc² set i in the cache (a failure is said, not fatal).
static void store_ucc2(lm_cmd_sgpt *g, int i, const char *label)
{
    sgpt_cache *c = &g->cache;
    const lm_config *cfg = &g->in.base->config;
    int64_t n = g->n_ucc2, d[LM_FWD_N_POINTS];
    input_dims(cfg, d);
    int64_t *dims = malloc((size_t)(n ? n : 1) * sizeof *dims);
    char **names = calloc((size_t)(n ? n : 1), sizeof *names);
    lm_err cerr = {0};
    lm_status s = dims && names ? LM_OK : lm_err_set(&cerr, LM_ERR_NOMEM, "out of memory");
    for (int64_t q = 0; s == LM_OK && q < n; q++) {
        char name[128];
        dims[q] = d[q % LM_FWD_N_POINTS];
        if (!(names[q] = lm_strdup(lm_hess_name(name, sizeof name, q / LM_FWD_N_POINTS,
                                                (lm_fwd_point)(q % LM_FWD_N_POINTS)))))
            s = lm_err_set(&cerr, LM_ERR_NOMEM, "out of memory");
    }
    if (s == LM_OK)
        s = lm_cache_store_ucc2(c->dir, c->ucc2_key[i], g->ucc2[i], n, dims, (const char *const *)names, &cerr);
    char *path = lm_cache_entry_path(c->dir, LM_CACHE_UCC2, c->ucc2_key[i]);
    if (s != LM_OK)
        lm_progress_note(g->in.progress, "warning: the U_cc² of %s are not kept in the cache: %s", label, cerr.msg);
    cache_event(g, LM_CACHE_UCC2, path, s == LM_OK ? "stored" : "not stored", s == LM_OK ? NULL : cerr.msg);
    free(path);
    for (int64_t q = 0; names && q < n; q++)
        free(names[q]);
    free(names);
    free(dims);
}

// U_cc² set i from the Hessians in the cache: *hit says whether there was a sound entry.
static lm_status ucc2_from_hessians(lm_cmd_sgpt *g, int i, const char *label, bool *hit, lm_err *err)
{
    sgpt_cache *c = &g->cache;
    *hit = false;
    char why[LM_ERR_MSG_MAX] = "";
    lm_cache_entry *e = NULL;
    int64_t n_tokens = 0;
    lm_status s = lm_cache_open(&e, c->dir, LM_CACHE_HESS, c->hess_key[i], &n_tokens, why, sizeof why, err);
    if (s != LM_OK)
        return s;
    if (!e) {
        char *path = lm_cache_entry_path(c->dir, LM_CACHE_HESS, c->hess_key[i]);
        if (why[0])
            cache_damaged(g, LM_CACHE_HESS, c->hess_key[i], why);
        else
            cache_event(g, LM_CACHE_HESS, path, "miss", NULL);
        free(path);
        return LM_OK;
    }
    const lm_config *cfg = &g->in.base->config;
    int64_t n = cfg->num_hidden_layers * LM_FWD_N_POINTS, d[LM_FWD_N_POINTS], most = 0;
    input_dims(cfg, d);
    for (int p = 0; p < LM_FWD_N_POINTS; p++)
        most = d[p] > most ? d[p] : most;
    double **set = calloc((size_t)(n ? n : 1), sizeof *set);
    float *H = malloc((size_t)(most * most) * sizeof *H);
    lm_err rerr = {0};
    s = set && H ? LM_OK : lm_err_set(&rerr, LM_ERR_NOMEM, "out of memory for a Hessian of %" PRId64 " x %" PRId64,
                                       most, most);
    char name[LM_CACHE_NAME_MAX + 1], want[128];
    int64_t count;
    size_t bytes;
    bool end = false, bad_h = false;  // bad_h: a sound Hessian U_cc² cannot be computed from
    for (int64_t q = 0; s == LM_OK && q < n; q++) {
        int64_t dim = d[q % LM_FWD_N_POINTS];
        lm_hess_name(want, sizeof want, q / LM_FWD_N_POINTS, (lm_fwd_point)(q % LM_FWD_N_POINTS));
        if ((s = lm_cache_next(e, name, sizeof name, &count, &bytes, &end, &rerr)) != LM_OK)
            break;
        if (end || strcmp(name, want) != 0 || count != dim || bytes != (size_t)(dim * dim) * sizeof(float)) {
            s = lm_cache_reject(e, "Hessians that do not fit this model", &rerr);
            break;
        }
        if (!(set[q] = malloc((size_t)dim * sizeof(double)))) {
            s = lm_err_set(&rerr, LM_ERR_NOMEM, "out of memory");
            break;
        }
        if ((s = lm_cache_read(e, H, &rerr)) == LM_OK)
            bad_h = (s = lm_hess_ucc2_raised(g->in.dev, set[q], H, dim, SGPT_DAMP, want, lm_cmd_note, g->in.progress,
                                             &rerr)) != LM_OK;
    }
    if (s == LM_OK && (s = lm_cache_next(e, name, sizeof name, &count, &bytes, &end, &rerr)) == LM_OK && !end)
        s = lm_cache_reject(e, "more Hessians than this model has", &rerr);
    char *path = lm_strdup(lm_cache_path(e));
    lm_cache_close(e);  // removes it when damaged
    free(H);
    if (!bad_h && (s == LM_ERR_FORMAT || s == LM_ERR_IO)) {
        // a damaged entry (or one that cannot be read): the Hessians are captured again
        cache_damaged(g, LM_CACHE_HESS, c->hess_key[i], rerr.msg);
        lm_hess_ucc2_free(set, n);
        free(path);
        return LM_OK;
    }
    if (s != LM_OK) {
        lm_hess_ucc2_free(set, n);
        free(path);
        *err = rerr;
        return lm_err_prefix(err, "Hessians of %s", label);
    }
    lm_progress_note(g->in.progress, "Hessians of %s on %s: from the cache (%s), their U_cc² computed", label,
                     g->in.calib[g->in.n_calib == 1 ? 0 : i].path, path);
    cache_event(g, LM_CACHE_HESS, path, "hit", NULL);
    free(path);
    g->ucc2[i] = set;
    g->n_ucc2 = n;
    *hit = true;
    return LM_OK;
}

// Where a capture's Hessians go as they are finished (lm_hess_each_fn): an entry of the cache,
// opened at the first one (which brings n_tokens).
typedef struct hess_sink {
    lm_cmd_sgpt *g;
    uint64_t key;
    const char *label;
    lm_cache_entry *e;
    bool failed;   // said once; the rest are not kept
} hess_sink;

static lm_status keep_hessian(void *ctx, int64_t layer, lm_fwd_point p, const float *H, int64_t dim, int64_t n_tokens,
                              lm_err *err)
{
    (void)err;  // the cache never fails the merge
    hess_sink *k = ctx;
    if (k->failed)
        return LM_OK;
    lm_err cerr = {0};
    lm_status s = LM_OK;
    if (!k->e)
        s = lm_cache_create(&k->e, k->g->cache.dir, LM_CACHE_HESS, k->key, n_tokens, &cerr);
    char name[128];
    if (s == LM_OK)
        s = lm_cache_put(k->e, lm_hess_name(name, sizeof name, layer, p), dim, H, (size_t)(dim * dim) * sizeof(float),
                         &cerr);
    if (s != LM_OK) {
        lm_progress_note(k->g->in.progress, "warning: the Hessians of %s are not kept in the cache: %s", k->label,
                         cerr.msg);
        char *path = lm_cache_entry_path(k->g->cache.dir, LM_CACHE_HESS, k->key);
        cache_event(k->g, LM_CACHE_HESS, path, "not stored", cerr.msg);
        free(path);
        lm_cache_close(k->e);
        k->e = NULL;
        k->failed = true;
    }
    return LM_OK;
}

// U_cc² set i from the cache: its own entry, or computed from its Hessians' entry; *hit says
// whether either was there.
static lm_status ucc2_cached(lm_cmd_sgpt *g, int i, bool *hit, lm_err *err)
{
    sgpt_cache *c = &g->cache;
    const lm_ft *ft = g->in.from_base ? NULL : g->in.fts[i];
    const lm_calib *cal = &g->in.calib[g->in.n_calib == 1 ? 0 : i];
    const char *label = ft ? ft->path : g->in.base->dir;
    const lm_config *cfg = &g->in.base->config;
    int64_t n = cfg->num_hidden_layers * LM_FWD_N_POINTS, d[LM_FWD_N_POINTS];
    input_dims(cfg, d);
    int64_t *dims = malloc((size_t)(n ? n : 1) * sizeof *dims);
    if (!dims)
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    for (int64_t q = 0; q < n; q++)
        dims[q] = d[q % LM_FWD_N_POINTS];
    char why[LM_ERR_MSG_MAX] = "";
    *hit = false;
    lm_status s = lm_cache_load_ucc2(c->dir, c->ucc2_key[i], n, dims, &g->ucc2[i], hit, why, sizeof why, err);
    free(dims);
    if (s != LM_OK)
        return s;
    char *path = lm_cache_entry_path(c->dir, LM_CACHE_UCC2, c->ucc2_key[i]);
    if (why[0])
        cache_damaged(g, LM_CACHE_UCC2, c->ucc2_key[i], why);
    cache_event(g, LM_CACHE_UCC2, path, *hit ? "hit" : "miss", NULL);
    if (*hit) {
        g->n_ucc2 = n;
        lm_progress_note(g->in.progress, "Hessians of %s on %s: from the cache (%s)", label, cal->path, path);
    }
    free(path);
    if (*hit)
        return LM_OK;
    if ((s = ucc2_from_hessians(g, i, label, hit, err)) == LM_OK && *hit)
        store_ucc2(g, i, label);
    return s;
}

typedef struct ucc2_wait {
    lm_cmd_sgpt *g;
    int i;
    const char *label;  // the model whose Hessians these are
} ucc2_wait;

// lm_xlock_ready_fn: whether the job holding the lock has put the set into the cache.
static lm_status ucc2_ready(void *ctx, bool *done, lm_err *err)
{
    ucc2_wait *w = ctx;
    w->g->cache.polling = true;
    lm_status s = ucc2_cached(w->g, w->i, done, err);
    w->g->cache.polling = false;
    return s;
}

// lm_xlock_waiting_fn: says who captures the Hessians meanwhile, or that a dead holder's lock
// was taken over.
static void ucc2_waiting(void *ctx, const char *holder, bool gone, const char *path)
{
    ucc2_wait *w = ctx;
    if (gone)
        lm_progress_note(w->g->in.progress, "Hessians of %s: the lock %s of %s, which is gone, is taken over",
                         w->label, path, holder);
    else
        lm_progress_note(w->g->in.progress, "Hessians of %s: waiting for %s, which holds %s (capturing them for the "
                         "cache)", w->label, holder, path);
}

// U_cc² set i: from the cache when it has it (or the Hessians), else captured (sparsegpt.h),
// under a lock in the cache (lib/xlock.h) so that of the jobs that need the same Hessians at
// once one captures them and the others read them.
static lm_status ucc2_set(lm_cmd_sgpt *g, int i, lm_err *err)
{
    sgpt_cache *c = &g->cache;
    const lm_ft *ft = g->in.from_base ? NULL : g->in.fts[i];
    const lm_model *m = ft && ft->model ? ft->model : g->in.base;
    const lm_adapter *ad = ft ? ft->adapter : NULL;
    const lm_calib *cal = &g->in.calib[g->in.n_calib == 1 ? 0 : i];
    const char *label = ft ? ft->path : g->in.base->dir;
    bool needed = !c->dir;
    for (int j = 0; j < g->in.n_ft; j++)
        needed = needed || (set_of(g, j) == i && !c->mask_hit[j]);
    if (!needed) {
        lm_progress_note(g->in.progress, "Hessians of %s on %s: not needed (the masks they select are cached)", label,
                         cal->path);
        return LM_OK;
    }
    lm_status s;
    lm_xlock *lock = NULL;
    if (c->dir) {
        bool hit = false;
        if ((s = ucc2_cached(g, i, &hit, err)) != LM_OK || hit)
            return s;
        char name[64];
        snprintf(name, sizeof name, "%s-%016" PRIx64 ".lock", lm_cache_kind_name(LM_CACHE_HESS), c->hess_key[i]);
        char *path = lm_path_join(c->dir, name);
        ucc2_wait w = {g, i, label};
        lm_err lerr = {0};
        if (!path)
            return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
        s = lm_mkdir_p(c->dir, &lerr);
        if (s == LM_OK)
            s = lm_xlock_acquire(&lock, path, ucc2_ready, ucc2_waiting, &w, &lerr);
        free(path);
        if (s == LM_ERR_IO) {  // the cache's own failure: said, not an error
            lm_progress_note(g->in.progress, "warning: no lock on the Hessians of %s in the cache (another job may "
                             "capture them too): %s", label, lerr.msg);
            s = LM_OK;
        } else if (s != LM_OK) {
            *err = lerr;
            return s;
        } else if (!lock) {  // another job's Hessians, read
            return LM_OK;
        }
    }
    lm_fwd_seq *seqs = calloc((size_t)(cal->n_seqs ? cal->n_seqs : 1), sizeof *seqs);
    if (!seqs) {
        lm_xlock_release(lock);
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    }
    for (int64_t q = 0; q < cal->n_seqs; q++)
        seqs[q] = (lm_fwd_seq){cal->ids + cal->offsets[q], cal->offsets[q + 1] - cal->offsets[q]};
    lm_progress_note(g->in.progress, "Hessians of %s on %s: %" PRId64 " sequences, %" PRId64 " tokens", label, cal->path,
                     cal->n_seqs, cal->n_tokens);
    hess_sink sink = {.g = g, .key = c->dir ? c->hess_key[i] : 0, .label = label};
    bool keep = c->dir && lm_cache_keeps_hessians();
    // The count goes to g->n_ucc2 only on success: lm_hess_ucc2_model zeroes it on entry, and the
    // sets already made are freed with it (lm_cmd_sgpt_free), also when this capture fails.
    int64_t n_ucc2 = 0;
    s = lm_hess_ucc2_model(m, ad, g->in.dev, label, seqs, cal->n_seqs, SGPT_DAMP, g->in.sticky,
                           lm_cmd_note, g->in.progress, keep ? keep_hessian : NULL, &sink, &g->ucc2[i], &n_ucc2, err);
    free(seqs);
    if (s != LM_OK) {
        lm_cache_close(sink.e);
        lm_xlock_release(lock);
        return lm_err_prefix(err, "Hessians of %s", label);
    }
    g->n_ucc2 = n_ucc2;
    if (sink.e) {
        char *path = lm_strdup(lm_cache_path(sink.e));
        lm_err cerr = {0};
        lm_status cs = lm_cache_commit(sink.e, &cerr);
        if (cs != LM_OK)
            lm_progress_note(g->in.progress, "warning: the Hessians of %s are not kept in the cache: %s", label,
                             cerr.msg);
        cache_event(g, LM_CACHE_HESS, path, cs == LM_OK ? "stored" : "not stored", cs == LM_OK ? NULL : cerr.msg);
        free(path);
    }
    if (c->dir)
        store_ucc2(g, i, label);
    lm_xlock_release(lock);
    return LM_OK;
}

// Everything sparsegpt needs before the merge: each FT's masks, or the U_cc² of its Hessians.
static lm_status inputs(lm_cmd_sgpt *g, lm_err *err)
{
    sgpt_cache *c = &g->cache;
    int sets = g->in.from_base ? 1 : g->in.n_ft;
    g->n_sets = sets;
    c->n_ft = g->in.n_ft;
    if (!(g->ucc2 = calloc((size_t)sets, sizeof *g->ucc2)) || !(c->hess_key = calloc((size_t)sets, sizeof(uint64_t))) ||
        !(c->ucc2_key = calloc((size_t)sets, sizeof(uint64_t))) ||
        !(c->mask_key = calloc((size_t)g->in.n_ft, sizeof(uint64_t))) ||
        !(c->masks = calloc((size_t)g->in.n_ft, sizeof *c->masks)) ||
        !(c->mask_hit = calloc((size_t)g->in.n_ft, sizeof *c->mask_hit)) ||
        !(c->mask_out = calloc((size_t)g->in.n_ft, sizeof *c->mask_out)) ||
        !(c->mask_failed = calloc((size_t)g->in.n_ft, sizeof *c->mask_failed)))
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    if (!(c->dir = lm_cache_dir(g->in.cache_dir)))
        lm_progress_note(g->in.progress, "note: no cache directory (give --cache-dir, or set XDG_CACHE_HOME or HOME): "
                         "the Hessians and masks are not kept");
    lm_status s = c->dir ? cache_keys(g, err) : LM_OK;
    for (int j = 0; s == LM_OK && c->dir && j < g->in.n_ft; j++)
        s = masks_from_cache(g, j, err);
    for (int i = 0; s == LM_OK && i < sets; i++)
        s = ucc2_set(g, i, err);
    return s;
}

// The engine's questions about stored masks (lm_merge_opts.mask_load, mask_store).
static const uint8_t *mask_of(void *ctx, int ft, const char *tensor, int64_t numel)
{
    const sgpt_cache *c = &((const lm_cmd_sgpt *)ctx)->cache;
    return c->mask_hit[ft] ? lm_cache_masks_find(&c->masks[ft], tensor, numel) : NULL;
}

static lm_status keep_mask(void *ctx, int ft, const char *tensor, const uint8_t *bits, int64_t numel, lm_err *err)
{
    (void)err;  // the cache never fails the merge
    lm_cmd_sgpt *g = ctx;
    sgpt_cache *c = &g->cache;
    if (!c->dir || c->mask_hit[ft] || c->mask_failed[ft])
        return LM_OK;
    lm_err cerr = {0};
    lm_status s = LM_OK;
    if (!c->mask_out[ft])
        s = lm_cache_create(&c->mask_out[ft], c->dir, LM_CACHE_MASK, c->mask_key[ft], 0, &cerr);
    if (s == LM_OK)
        s = lm_cache_put(c->mask_out[ft], tensor, numel, bits, lm_dev_mask_bytes(numel), &cerr);
    if (s != LM_OK) {
        lm_progress_note(g->in.progress, "warning: the top-k masks of FT %d are not kept in the cache: %s", ft + 1,
                         cerr.msg);
        lm_cache_close(c->mask_out[ft]);
        c->mask_out[ft] = NULL;
        c->mask_failed[ft] = true;
    }
    return LM_OK;
}

// After a merge that succeeded: the masks it selected go into place.
void lm_cmd_sgpt_commit(lm_cmd_sgpt *g)
{
    sgpt_cache *c = &g->cache;
    int kept = 0;
    for (int j = 0; j < c->n_ft; j++) {
        if (!c->mask_out[j])
            continue;
        char *path = lm_strdup(lm_cache_path(c->mask_out[j]));
        lm_err cerr = {0};
        lm_status s = lm_cache_commit(c->mask_out[j], &cerr);
        c->mask_out[j] = NULL;
        if (s != LM_OK)
            lm_progress_note(g->in.progress, "warning: the top-k masks of FT %d are not kept in the cache: %s", j + 1,
                             cerr.msg);
        kept += s == LM_OK;
        cache_event(g, LM_CACHE_MASK, path, s == LM_OK ? "stored" : "not stored", s == LM_OK ? NULL : cerr.msg);
        free(path);
    }
    if (kept)
        lm_progress_note(g->in.progress, "cache: the top-k masks of %d FT%s kept in %s", kept, kept == 1 ? "" : "s",
                         c->dir);
}

// The engine's question: U_cc² of the Hessian feeding base tensor `tensor` for FT ft, found
// from its name (model.layers.L.self_attn.{q,k,v}_proj, o_proj, mlp.{gate,up}_proj, down_proj).
static const double *ucc2_of(void *ctx, int ft, const char *tensor, int64_t cols)
{
    const lm_cmd_sgpt *g = ctx;
    int64_t layer, dims[LM_FWD_N_POINTS];
    lm_fwd_point point;
    // the same rule as llmerge plan's (lm_hess_point_of: which input each linear weight reads)
    if (!lm_hess_point_of(tensor, &layer, &point))
        return NULL;
    double **set = g->ucc2[g->n_sets == 1 ? 0 : ft];
    if (!set)  // not needed: every mask of this FT is stored
        return NULL;
    int64_t idx = lm_hess_index(layer, point);
    if (idx >= g->n_ucc2)
        return NULL;
    lm_hess_dims(&g->in.base->config, dims);
    return dims[point] == cols ? set[idx] : NULL;
}

lm_status lm_cmd_sgpt_prepare(lm_cmd_sgpt *g, const lm_cmd_sgpt_in *in, lm_err *err)
{
    memset(g, 0, sizeof *g);
    g->in = *in;
    return inputs(g, err);
}

void lm_cmd_sgpt_attach(lm_cmd_sgpt *g, lm_merge_opts *o)
{
    o->ucc2 = ucc2_of;
    o->ucc2_ctx = g;
    o->mask_load = mask_of;
    o->mask_store = keep_mask;
    o->mask_ctx = g;
}

void lm_cmd_sgpt_free(lm_cmd_sgpt *g)
{
    for (int i = 0; g->ucc2 && i < g->n_sets; i++)
        lm_hess_ucc2_free(g->ucc2[i], g->n_ucc2);
    free(g->ucc2);
    cache_free(&g->cache);
    memset(g, 0, sizeof *g);
}
