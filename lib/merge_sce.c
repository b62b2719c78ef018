// The merge pass of sce (docs/merging.md "sce"): the entries where the task vectors vary most
// kept in every one of them (the top select_topk of the nonzero variances across the FTs, one
// mask for all), each FT weighted by the mean square of its masked task vector, a sign elected
// per entry from the sum of the task vectors, and the agreeing entries averaged with those
// weights. Passes over the tensor, each a loop over its slabs on the device: the variances'
// histograms (their zeros counted too), the exact threshold's, the weights', the merge. See
// merge_int.h for the engine's files.
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "merge_int.h"
#include "signals.h"

typedef struct sce_pass {
    engine *e;
    wset *ws;
    const lm_st_tensor *bt;
    part *parts;
    int k;
    int64_t slab_rows;
    float *key;            // a slab of variances (device)
    const float **taus;    // (k) the parts' buffers
    bool masked;           // a mask applies (select_topk < 1)
    lm_topk t;             // the mask's threshold over the variances
} sce_pass;

// Rows [r0, r0 + nr): the base, every part's τ and, where a mask applies, the variances of the
// slab's entries (without one nothing reads them).
static lm_status slab_key(sce_pass *p, int64_t r0, int64_t nr)
{
    engine *e = p->e;
    int64_t cnt = nr * (p->bt->numel / tensor_rows(p->bt));
    lm_status s = lm_eng_load_base(e, p->ws, p->bt, r0, nr);
    for (int i = 0; s == LM_OK && i < p->k; i++)
        s = lm_eng_tau_for(e, p->ws, &p->parts[i], p->bt, r0, nr, p->ws->base_buf);
    if (s == LM_OK && p->masked)
        s = lm_dev_tau_var(p->ws->dev, p->key, p->taus, p->k, e->o->n_ft, cnt, e->err);
    return s;
}

// The two histogram passes of the variances: level 0 and the zeros (level 1 of bin 0), then
// level 1 of the threshold's bin; the threshold keeps floor(select_topk · the nonzero count).
static lm_status select_mask(sce_pass *p, double topk, bool one_slab)
{
    engine *e = p->e;
    const lm_st_tensor *bt = p->bt;
    int64_t rows = tensor_rows(bt), cols = bt->numel / rows;
    uint64_t *h0 = calloc(LM_HIST_BINS, sizeof *h0), *hz = calloc(LM_HIST_BINS, sizeof *hz);
    lm_status s = h0 && hz ? LM_OK : lm_err_set(e->err, LM_ERR_NOMEM, "out of memory");
    for (int64_t r0 = 0; r0 < rows && s == LM_OK; r0 += p->slab_rows) {
        int64_t nr = rows - r0 < p->slab_rows ? rows - r0 : p->slab_rows, cnt = nr * cols;
        if ((s = slab_key(p, r0, nr)) != LM_OK ||
            (s = lm_dev_hist_abs(p->ws->dev, h0, p->key, cnt, 0, 0, e->err)) != LM_OK ||
            (s = lm_dev_hist_abs(p->ws->dev, hz, p->key, cnt, 1, 0, e->err)) != LM_OK)
            break;
        if (!one_slab)
            lm_eng_release_slab(e, bt, p->parts, p->k, r0, nr);
    }
    if (s == LM_OK) {
        // a variance is never negative: its magnitude bits are its order, and only +0 has bits 0
        int64_t nonzero = bt->numel - (int64_t)hz[0];
        lm_topk_init(&p->t, (int64_t)floor((double)nonzero * topk), bt->numel);
        lm_topk_level0(&p->t, h0);
        memset(hz, 0, LM_HIST_BINS * sizeof *hz);
    }
    for (int64_t r0 = 0; r0 < rows && s == LM_OK && !p->t.none; r0 += p->slab_rows) {
        int64_t nr = rows - r0 < p->slab_rows ? rows - r0 : p->slab_rows, cnt = nr * cols;
        if ((!one_slab && (s = slab_key(p, r0, nr)) != LM_OK) ||
            (s = lm_dev_hist_abs(p->ws->dev, hz, p->key, cnt, 1, p->t.hi_bin, e->err)) != LM_OK)
            break;
        if (!one_slab)
            lm_eng_release_slab(e, bt, p->parts, p->k, r0, nr);
    }
    if (s == LM_OK && !p->t.none)
        lm_topk_level1(&p->t, hz);
    free(h0);
    free(hz);
    return s;
}

// The mask applied to every part's τ in the slab: the same entries kept in each, the ties at
// the threshold the first of the tensor's in index order (*ties the budget left).
static lm_status apply_mask(sce_pass *p, int64_t cnt, int64_t *ties)
{
    int64_t used = 0;
    lm_status s = LM_OK;
    for (int i = 0; s == LM_OK && i < p->k; i++)
        s = lm_dev_topk_apply_by(p->ws->dev, p->parts[i].tau, p->key, cnt, p->t.thr_bits, *ties, &used, p->e->err);
    if (s == LM_OK && p->k > 0)
        *ties -= used;
    return s;
}

lm_status lm_eng_merge_sce(engine *e, wset *ws, int64_t idx, const lm_st_desc *desc, XXH64_state_t *hash,
                           part *parts, int k, int64_t slab_rows)
{
    const lm_st_tensor *bt = e->base->tensors[idx];
    int n = e->o->n_ft;
    int64_t rows = tensor_rows(bt), cols = bt->numel / rows;
    bool one_slab = slab_rows >= rows;
    double topk = e->tp.select_topk;
    const float *taus[k > 0 ? k : 1];
    for (int i = 0; i < k; i++)
        taus[i] = parts[i].tau;
    sce_pass p = {e, ws, bt, parts, k, slab_rows, NULL, taus, topk < 1, {0}};
    p.key = ws->var_buf;
    lm_status s = LM_OK;
    if (p.masked && !p.key)  // ws_alloc makes it for sce
        s = lm_err_set(e->err, LM_ERR_FORMAT, "sce: no buffer for the variances (a defect)");
    double sq[k > 0 ? k : 1], *row = malloc((size_t)(slab_rows < rows ? slab_rows : rows) * sizeof *row);
    memset(sq, 0, sizeof sq);
    if (s == LM_OK && !row)
        s = lm_err_set(e->err, LM_ERR_NOMEM, "out of memory");
    // select: mergekit keeps everything at select_topk >= 1, nothing when it keeps no entry
    if (s == LM_OK && p.masked)
        s = select_mask(&p, topk, one_slab);

    // weights: the mean square of each masked τ; with one slab τ stays masked in the buffers
    int64_t ties = p.t.ties_allowed;
    for (int64_t r0 = 0; r0 < rows && s == LM_OK; r0 += slab_rows) {
        int64_t nr = rows - r0 < slab_rows ? rows - r0 : slab_rows, cnt = nr * cols;
        if ((!p.masked || !one_slab) && (s = slab_key(&p, r0, nr)) != LM_OK)
            break;
        if (p.masked && (s = apply_mask(&p, cnt, &ties)) != LM_OK)
            break;
        for (int i = 0; s == LM_OK && i < k; i++) {
            s = lm_dev_row_dot(ws->dev, parts[i].tau, parts[i].tau, nr, cols, row, e->err);
            for (int64_t r = 0; s == LM_OK && r < nr; r++)
                sq[i] += row[r];
        }
        if (!one_slab)
            lm_eng_release_slab(e, bt, parts, k, r0, nr);
    }
    float w[k > 0 ? k : 1];
    double sum = 0;
    for (int i = 0; i < k; i++)
        sum += sq[i] / (double)bt->numel;
    for (int i = 0; i < k; i++)  // mergekit's rule: all alike where the mean squares sum below 1e-6
        w[i] = (float)(fabs(sum) < 1e-6 ? 1.0 / n : sq[i] / (double)bt->numel / sum);

    // merge: the sign of Σ τ per entry, the agreeing entries' weighted mean
    ties = p.t.ties_allowed;
    lm_combine_how how = {.sign = LM_COMBINE_SIGN_TAU, .normalize = true, .lambda = 1.0f};
    for (int64_t r0 = 0; r0 < rows && s == LM_OK; r0 += slab_rows) {
        int64_t nr = rows - r0 < slab_rows ? rows - r0 : slab_rows, cnt = nr * cols;
        if (r0 > 0 && lm_interrupted()) {
            s = lm_interrupted_err(e->err);
            break;
        }
        if (!one_slab && ((s = slab_key(&p, r0, nr)) != LM_OK || (p.masked && (s = apply_mask(&p, cnt, &ties)) != LM_OK)))
            break;
        if ((s = lm_dev_combine(ws->dev, ws->base_buf, ws->base_buf, taus, w, k, cnt, how, e->err)) != LM_OK ||
            (s = lm_eng_write_slab(e, ws, idx, desc->dtype, ws->base_buf, cnt, (uint64_t)(r0 * cols) * esize(desc->dtype),
                                   hash)) != LM_OK)
            break;
        if (!one_slab)
            lm_eng_release_slab(e, bt, parts, k, r0, nr);
    }
    free(row);
    return s;
}
