// The merge engine's selection (see merge_int.h for the engine's files): each part's exact
// top-k threshold over a whole tensor from one pass that counts the values beyond a window of
// histogram bins guessed from a sample and the window's fine histogram (two full
// radix-histogram passes when the guess misses, or on an accelerator), the fused LoRA parts'
// kept candidates, and --topk global's thresholds over whole models, one unit per tensor.
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "merge_int.h"
#include "util.h"

// The sample of a slab of cnt elements: n_runs runs of `run` elements, the r-th from r·stride.
// SAMPLE_PIECES runs spread evenly over the slab: rows differ (a LoRA product's rows scale with
// B's), so one run from the start would not do.
void lm_eng_sample_runs(int64_t cnt, int64_t *n_runs, int64_t *run, int64_t *stride)
{
    int64_t ns = cnt < SAMPLE_ELEMS ? cnt : SAMPLE_ELEMS;
    bool whole = ns == cnt || ns / SAMPLE_PIECES == 0;
    *n_runs = whole ? 1 : SAMPLE_PIECES;
    *run = whole ? ns : ns / SAMPLE_PIECES;
    *stride = whole ? 0 : cnt / SAMPLE_PIECES;
}

// Places window w from the sample x: n_runs runs of `run` values, the r-th from x + r·stride.
static lm_status guess_window(engine *e, wset *ws, const float *x, int64_t n_runs, int64_t run, int64_t stride,
                              int64_t numel, const lm_topk *t, window *w)
{
    uint64_t *h = w->guess;
    memset(h, 0, LM_HIST_BINS * sizeof *h);
    lm_status s = LM_OK;
    int64_t ns = n_runs * run;
    if (lm_dev_host_memory(ws->dev)) {
        for (int64_t r = 0; s == LM_OK && r < n_runs; r++)
            s = lm_dev_hist_abs(ws->dev, h, x + r * stride, run, 0, 0, e->err);
    } else {
        // An accelerator's histogram comes home whole, 65,536 counts, each time it is made: one
        // per run was 32 waits and 16 MiB of copies per part and tensor, more than the rest of
        // its selection. The runs come home instead (at most SAMPLE_ELEMS values) and are counted
        // once on the CPU: the same counts.
        if (ns > e->sample_cap) {
            free(e->sample);
            e->sample_cap = 0;
            if (!(e->sample = malloc((size_t)ns * sizeof *e->sample)))
                return lm_err_set(e->err, LM_ERR_NOMEM, "out of memory");
            e->sample_cap = ns;
        }
        for (int64_t r = 0; s == LM_OK && r < n_runs; r++)
            s = lm_dev_download(ws->dev, e->sample + r * run, x + r * stride, (size_t)run * sizeof *x, e->err);
        if (s == LM_OK)
            s = lm_dev_hist_abs(e->cpu, h, e->sample, ns, 0, 0, e->err);
    }
    lm_topk g;
    lm_topk_init(&g, (int64_t)((double)t->k * (double)ns / (double)numel + 0.5), ns);
    lm_topk_level0(&g, h);
    uint32_t centre = g.none ? 0 : g.hi_bin, below = (uint32_t)(w->n / 2 - 1);
    w->lo = centre > below ? centre - below : 0;
    return s;
}

#define SAMPLE_RUN 32

// dst[t] = scale · Σ_q brow[q] · a[q·cols + t] for t < SAMPLE_RUN.
LM_VECTOR_CLONES static void sample_run(float *dst, const float *brow, const float *a, int64_t cols, int64_t r,
                                        float scale)
{
    float acc[SAMPLE_RUN] = {0};
    for (int64_t q = 0; q < r; q++)
        for (int t = 0; t < SAMPLE_RUN; t++)  // a constant count: held in vector registers
            acc[t] += brow[q] * a[q * cols + t];
    for (int t = 0; t < SAMPLE_RUN; t++)
        dst[t] = scale * acc[t];
}

// τ of LoRA part p (a lm_eng_dense_part) at a sample spread over the whole of tensor bt, into
// p->tau[0..*got), at most `want` values: runs of SAMPLE_RUN columns, the runs' rows evenly
// spaced over the tensor and their columns sweeping it (a product's rows scale with B's rows and
// its columns with A's columns, so a stretch of either would not do). Only a guess is made
// from it, so it is computed here, plainly: the fused operations, which run on the CPU alone
// (where the factors are host memory), count the exact values.
static void lora_sample(engine *e, wset *ws, part *p, const lm_st_tensor *bt, int64_t want, int64_t *got)
{
    const lm_lora_module *m = p->mod;
    const resident *rs = lm_eng_resident_for(e, ws, p->ft);
    int64_t rows = tensor_rows(bt), cols = bt->numel / rows, r = m->r;
    const float *a = rs->data + rs->a_off[p->mod_index], *b = rs->data + rs->b_off[p->mod_index];
    if (cols < SAMPLE_RUN) {  // narrow tensors: whole rows, evenly spaced
        int64_t n_rows = want / cols < rows ? want / cols : rows;
        for (int64_t s = 0; s < n_rows; s++) {
            int64_t i = (int64_t)((double)s * (double)rows / (double)n_rows);
            for (int64_t j = 0; j < cols; j++) {
                float acc = 0.0f;
                for (int64_t q = 0; q < r; q++)
                    acc += b[i * r + q] * a[q * cols + j];
                p->tau[s * cols + j] = (float)m->scale * acc;
            }
        }
        *got = n_rows * cols;
        return;
    }
    int64_t n_runs = want / SAMPLE_RUN;
    float scale = (float)m->scale;
    for (int64_t s = 0; s < n_runs; s++) {
        int64_t i = (int64_t)((double)s * (double)rows / (double)n_runs);
        // the runs sweep the columns in order (A read as it lies) while the rows advance
        int64_t j0 = s * SAMPLE_RUN % (cols - SAMPLE_RUN + 1);
        sample_run(p->tau + s * SAMPLE_RUN, b + i * r, a + j0, cols, r, scale);
    }
    *got = n_runs * SAMPLE_RUN;
}

// guess_window from the sample runs of a slab of cnt elements whose τ (or importance) is in
// part p's buffer.
static lm_status guess_at(engine *e, wset *ws, const part *p, int64_t cnt, int64_t numel, const lm_topk *t, window *w)
{
    int64_t n_runs, run, stride;
    lm_eng_sample_runs(cnt, &n_runs, &run, &stride);
    return guess_window(e, ws, rank_buf(p), n_runs, run, stride, numel, t, w);
}

// hist_tensor's level 2 for one slab (cnt elements from row r0) with the fused operation: on
// the first slab τ is computed at the sample's elements only, for guess_window (a full model's
// from the slab, a LoRA pair's from the whole tensor).
static lm_status hist_dense(engine *e, wset *ws, const lm_st_tensor *bt, part *parts, int k, uint64_t **hists,
                            const lm_topk *const *sel, int64_t r0, int64_t cnt, window *wins)
{
    int64_t first = r0 * (bt->numel / tensor_rows(bt));
    const char *base = (const char *)bt->data + (size_t)first * esize(bt->dtype);
    lm_status s = LM_OK;
    if (r0 == 0) {
        int64_t n_runs, run, stride;
        lm_eng_sample_runs(cnt, &n_runs, &run, &stride);
        bool full = false;
        for (int i = 0; i < k; i++)
            full = full || (parts[i].src == SRC_FULL && !sel[i]->none);
        for (int64_t r = 0; s == LM_OK && full && r < n_runs; r++) {
            int64_t at = r * stride;
            s = lm_eng_load_f32(e, ws, ws->base_buf + at, base + (size_t)at * esize(bt->dtype), bt->dtype, run);
            for (int i = 0; s == LM_OK && i < k; i++) {
                const lm_st_tensor *t = parts[i].full;
                if (parts[i].src == SRC_FULL && !sel[i]->none)
                    s = lm_dev_delta(ws->dev, parts[i].tau + at,
                                     (const char *)t->data + (size_t)(first + at) * esize(t->dtype), t->dtype,
                                     ws->base_buf + at, run, e->err);
            }
        }
        for (int i = 0; s == LM_OK && i < k; i++) {
            if (sel[i]->none)
                continue;
            int64_t got;
            if (parts[i].src == SRC_FULL)
                s = guess_window(e, ws, parts[i].tau, n_runs, run, stride, bt->numel, sel[i], &wins[i]);
            else {
                lora_sample(e, ws, &parts[i], bt, n_runs * run, &got);
                s = guess_window(e, ws, parts[i].tau, 1, got, 0, bt->numel, sel[i], &wins[i]);
            }
        }
        if (s != LM_OK)
            return s;
    }
    lm_dense_part d[k];
    uint64_t in_bytes = (uint64_t)cnt * esize(bt->dtype);
    for (int i = 0; i < k; i++) {
        d[i] = (lm_dense_part){0};
        size_t per = lm_eng_dense_source(e, ws, &parts[i], bt, first, &d[i]);
        if (!sel[i]->none) {
            d[i].above = hists[i];
            d[i].win = wins[i].win;
            d[i].lo_bin = wins[i].lo;
            d[i].n_win = wins[i].n;
            in_bytes += (uint64_t)cnt * per;
        }
    }
    e->bytes_in += in_bytes;
    return lm_dev_dense_hist(ws->dev, base, bt->dtype, d, k, cnt, e->err);
}

// Adds the level-`level` histograms of τ over every slab of tensor bt to hists[i], one
// 65536-bin array per part (level 2: the count beyond wins[i]'s window into hists[i][0], and
// the window's level-1 histograms, the window placed from a sample of the first slab). `have_tau` says the parts' buffers already hold τ of the tensor's
// only slab (from the level-0 pass), so it is not computed again.
static lm_status hist_tensor(engine *e, wset *ws, const lm_st_tensor *bt, part *parts, int k, uint64_t **hists,
                             const lm_topk *const *sel, int level, bool have_tau, window *wins)
{
    int64_t rows = tensor_rows(bt), cols = rows ? bt->numel / rows : 0;
    int64_t slab_rows = lm_eng_slab_rows(e, ws->dev, bt, parts, k);
    bool fuse = level == 2 && lm_eng_fused(e, ws->dev, bt, parts, k);
    for (int64_t r0 = 0; r0 < rows; r0 += slab_rows) {
        int64_t nr = rows - r0 < slab_rows ? rows - r0 : slab_rows, cnt = nr * cols;
        lm_status s = LM_OK;
        if (fuse) {
            if ((s = hist_dense(e, ws, bt, parts, k, hists, sel, r0, cnt, wins)) != LM_OK)
                return s;
            if (nr < rows)
                lm_eng_release_slab(e, bt, parts, k, r0, nr);
            continue;
        }
        if (!have_tau && lm_eng_needs_base(parts, k))
            s = lm_eng_load_base(e, ws, bt, r0, nr);
        for (int i = 0; s == LM_OK && i < k; i++) {
            if (!have_tau && (s = lm_eng_tau_for(e, ws, &parts[i], bt, r0, nr, ws->base_buf)) != LM_OK)
                break;
            if (sel[i]->none)
                continue;
            if (level < 2)
                s = lm_dev_hist_abs(ws->dev, hists[i], rank_buf(&parts[i]), cnt, level, sel[i]->hi_bin, e->err);
            else if (r0 > 0 || (s = guess_at(e, ws, &parts[i], cnt, bt->numel, sel[i], &wins[i])) == LM_OK)
                s = lm_dev_hist_window(ws->dev, hists[i], wins[i].win, wins[i].n, wins[i].lo, rank_buf(&parts[i]),
                                       cnt, e->err);
        }
        if (s != LM_OK)
            return s;
        if (nr < rows)
            lm_eng_release_slab(e, bt, parts, k, r0, nr);
    }
    return LM_OK;
}

// Makes room in FT ft's candidate store for a tensor of numel elements. False when memory runs
// out: the part then makes its product again in the merge pass, as without a store.
static bool keep_store(engine *e, int ft, int64_t numel)
{
    if (!e->keep_bits) {
        e->keep_bits = calloc((size_t)e->o->n_ft, sizeof *e->keep_bits);
        e->keep_off = calloc((size_t)e->o->n_ft, sizeof *e->keep_off);
        e->keep_vals = calloc((size_t)e->o->n_ft, sizeof *e->keep_vals);
        e->keep_caps = calloc((size_t)e->o->n_ft, sizeof *e->keep_caps);
        if (!e->keep_bits || !e->keep_off || !e->keep_vals || !e->keep_caps) {
            free(e->keep_bits);
            free(e->keep_off);
            free(e->keep_vals);
            free(e->keep_caps);
            e->keep_bits = NULL;
            e->keep_off = NULL;
            e->keep_vals = NULL;
            e->keep_caps = NULL;
            return false;
        }
    }
    if (numel <= e->keep_caps[ft])
        return true;
    free(e->keep_bits[ft]);
    free(e->keep_off[ft]);
    free(e->keep_vals[ft]);
    keep_size z;
    lm_eng_keep_size(numel, &z);
    e->keep_bits[ft] = malloc(z.bits_bytes);
    e->keep_off[ft] = malloc(z.off_bytes);
    e->keep_vals[ft] = malloc(z.vals_bytes);
    bool ok = e->keep_bits[ft] && e->keep_off[ft] && e->keep_vals[ft];
    e->keep_caps[ft] = ok ? z.cap : 0;
    return ok;
}

// Whether a fused tensor's LoRA parts may keep their candidates on dev: the kept values are
// laid out by segments, so every slab must start on one.
bool lm_eng_keeps_fit(const engine *e, const lm_dev *dev, const lm_st_tensor *bt, const part *parts, int k,
                      bool one_slab)
{
    int64_t cols = bt->numel / tensor_rows(bt);
    return one_slab || lm_eng_slab_rows(e, dev, bt, parts, k) * cols % LM_DENSE_KEEP_SEGMENT == 0;
}

// Breadcrumbs' band for a part of n entries with density d and γ: the k_lo largest magnitudes
// but the k_hi largest are kept (mergekit's magnitude_outliers: target = floor(d·n), n_top =
// floor(γ·n), cut to n − target when the two exceed n; d >= 1 keeps everything). mergekit keeps
// nothing where n_top is 0 (its slice [n_bot:-0] is empty); here the band is then the top target.
void lm_eng_band(double density, double gamma, int64_t n, int64_t *k_lo, int64_t *k_hi)
{
    if (density >= 1) {
        *k_lo = n;
        *k_hi = 0;
        return;
    }
    int64_t target = (int64_t)floor(density * (double)n), top = (int64_t)floor(gamma * (double)n);
    if (target + top > n)
        top = n - target;
    *k_lo = target + top;
    *k_hi = top;
}

// Finds each part's exact top-k threshold over the whole tensor into its topk: k = keep[i] for
// part i, or floor(d_i · numel) where keep is NULL. have_tau: every part's τ of the whole tensor
// (one slab) is in its buffer already, from an earlier selection that was not fused.
// One pass counts the values beyond a window of bins guessed from a sample and the window's
// level-1 histograms; the parts whose threshold fell outside their window (rare) take the two
// full histogram passes, and so does every part on an accelerator that holds the tensor whole.
lm_status lm_eng_select_tensor(engine *e, wset *ws, const lm_st_tensor *bt, part *parts, int k, bool one_slab,
                               const int64_t *keep_k, bool have_tau)
{
    uint64_t *hists[k];
    const lm_topk *sel[k];
    window wins[k];
    lm_topk missed[k];  // the parts for the two passes; the others marked none
    uint64_t above[k];
    // The histograms live in one block kept by the engine from tensor to tensor (a fresh one
    // each time would cost page faults and zeroing of tens of megabytes per tensor).
    size_t cells = lm_eng_sel_cells(k);
    if (cells > e->sel_cells) {
        free(e->sel_block);
        e->sel_cells = 0;
        if (!(e->sel_block = malloc(cells * sizeof(uint64_t))))
            return lm_err_set(e->err, LM_ERR_NOMEM, "out of memory");
        e->sel_cells = cells;
    }
    uint64_t *block = e->sel_block;
    memset(hists, 0, sizeof hists);
    memset(sel, 0, sizeof sel);
    memset(wins, 0, sizeof wins);
    memset(above, 0, sizeof above);
    // A dense task vector's values are alike from row to row, and a fused pass samples a LoRA
    // product over the whole tensor: a narrow window then suffices (see guess_window).
    bool fuse = lm_eng_fused(e, ws->dev, bt, parts, k);
    bool aligned = lm_eng_keeps_fit(e, ws->dev, bt, parts, k, one_slab), selects = false;
    for (int i = 0; i < k; i++) {
        // (breadcrumbs counts each part twice in one pass: one store per FT would not do)
        parts[i].keeps = fuse && aligned && !e->m->outliers && parts[i].src == SRC_LORA && !parts[i].mask &&
                         keep_store(e, parts[i].ft, bt->numel);
        // a part with a stored mask selects nothing (k = 0 makes every pass skip it)
        int64_t keep = keep_k ? keep_k[i] : (int64_t)floor(e->tp.densities[parts[i].ft] * (double)bt->numel);
        lm_topk_init(&parts[i].topk, parts[i].mask ? 0 : keep, bt->numel);
        hists[i] = &above[i];
        uint64_t *region = block + (size_t)i * (1 + LM_HIST_WINDOW) * LM_HIST_BINS;
        wins[i] = (window){region, region + (size_t)LM_HIST_WINDOW * LM_HIST_BINS, 0,
                           lm_eng_window_bins(&parts[i], fuse)};
        sel[i] = &parts[i].topk;
        selects = selects || !parts[i].topk.none;
    }
    // On an accelerator that holds the whole tensor's τ, a pass over it is cheap and what costs is
    // each wait and each histogram fetched home: the window's sample, then a pass for every few
    // of its bins, each group's counts (65,536 a bin) fetched and added up here, against one
    // fetch of 65,536 counts for each of the two full passes. The window is for the CPU, and for
    // slabs whose τ would be made again. (With no part selecting, the pass still makes τ, which
    // the caller may count on.)
    bool windowed = lm_dev_host_memory(ws->dev) || !one_slab || !selects;
    for (int i = 0; windowed && i < k; i++)
        memset(wins[i].win, 0, (size_t)wins[i].n * LM_HIST_BINS * sizeof(uint64_t));
    lm_status s = windowed ? hist_tensor(e, ws, bt, parts, k, hists, sel, 2, one_slab && have_tau, wins) : LM_OK;
    bool again = false;
    for (int i = 0; s == LM_OK && i < k; i++) {
        missed[i] = parts[i].topk;
        if (!windowed) {  // each part that selects takes the two passes (none keeps: not fused)
            again = again || !missed[i].none;
            continue;
        }
        e->res->windows += !parts[i].topk.none;
        missed[i].none = lm_topk_window(&parts[i].topk, above[i], wins[i].win, wins[i].n, wins[i].lo);
        // the candidates hold every value the merge keeps when the threshold is in the window
        parts[i].keeps = parts[i].keeps && !parts[i].topk.none && missed[i].none;
        again = again || !missed[i].none;
        e->res->window_misses += !missed[i].none;
    }
    for (int level = 0; s == LM_OK && again && level < 2; level++) {
        for (int i = 0; i < k; i++) {
            hists[i] = block + (size_t)i * (1 + LM_HIST_WINDOW) * LM_HIST_BINS;
            memset(hists[i], 0, LM_HIST_BINS * sizeof(uint64_t));
            sel[i] = &missed[i];
        }
        // τ is in the buffers after a pass over a single slab, unless that pass was fused (or
        // there was none: then the caller's)
        bool made = windowed ? !fuse : have_tau;
        s = hist_tensor(e, ws, bt, parts, k, hists, sel, level, one_slab && (level > 0 || made), NULL);
        for (int i = 0; s == LM_OK && i < k; i++) {
            if (missed[i].none)
                continue;
            if (level == 0) {
                lm_topk_level0(&missed[i], hists[i]);
            } else {
                lm_topk_level1(&missed[i], hists[i]);
                parts[i].topk = missed[i];
            }
        }
    }
    return s;
}

// ==== --topk global ===========================================================================

typedef struct select_ctx {
    uint64_t *block;     // (n_ft × LM_HIST_BINS) the model-wide histograms
    uint64_t *tensor;    // (n_ft × LM_HIST_BINS) this tensor's, added to block when it is done
    size_t cells;
    int level;
} select_ctx;

static lm_status select_work(engine *e, unit *u, wset *ws)
{
    select_ctx *c = u->ctx;
    const lm_st_tensor *bt = e->base->tensors[u->idx];
    part *parts = u->parts;
    int k = u->k;
    uint64_t *hists[k > 0 ? k : 1];
    const lm_topk *sel[k > 0 ? k : 1];
    memset(hists, 0, sizeof hists);
    memset(sel, 0, sizeof sel);
    for (int i = 0; i < k; i++) {
        hists[i] = c->tensor + (size_t)parts[i].ft * LM_HIST_BINS;
        sel[i] = &e->global[parts[i].ft];
    }
    lm_status s = hist_tensor(e, ws, bt, parts, k, hists, sel, c->level, false, NULL);
    if (s != LM_OK)
        return s;
    for (int i = 0; i < k; i++)
        for (size_t b = 0; b < LM_HIST_BINS; b++)
            c->block[(size_t)parts[i].ft * LM_HIST_BINS + b] += hists[i][b];
    return LM_OK;
}

// The model's histograms only change once a tensor is done: a redo starts from zero counts.
static void select_undo(unit *u)
{
    select_ctx *c = u->ctx;
    memset(c->tensor, 0, c->cells * sizeof(uint64_t));
}

// Finds each FT's threshold over all the tensors it changes (two histogram passes over the
// model), with k = floor(d · the number of those elements). Ties at the threshold are kept in
// output order, then by index within a tensor. Each tensor's histograms are a unit: on the
// device, or on the CPU when the device is out of memory.
lm_status lm_eng_select_global(engine *e, int64_t n_out)
{
    const lm_merge_opts *o = e->o;
    size_t cells = (size_t)o->n_ft * LM_HIST_BINS;
    select_ctx c = {calloc(cells, sizeof(uint64_t)), calloc(cells, sizeof(uint64_t)), cells, 0};
    int64_t *count = calloc((size_t)o->n_ft, sizeof(int64_t));
    lm_status s = LM_OK;
    if (!c.block || !c.tensor || !count) {
        s = lm_err_set(e->err, LM_ERR_NOMEM, "out of memory");
        goto done;
    }
    // An FT whose every tensor has a stored mask (mask_load) needs no threshold: k = 0 makes
    // the passes skip it, and when no FT needs one the passes are not run at all.
    int64_t *unmasked = calloc((size_t)o->n_ft, sizeof(int64_t));
    if (!unmasked) {
        s = lm_err_set(e->err, LM_ERR_NOMEM, "out of memory");
        goto done;
    }
    for (int64_t t = 0; t < n_out; t++) {
        const lm_st_tensor *bt = e->base->tensors[t];
        if (!lm_dtype_readable(bt->dtype))
            continue;
        part parts[o->n_ft];
        int k = lm_eng_find_parts(e, bt->name, parts);
        for (int i = 0; i < k; i++) {
            count[parts[i].ft] += bt->numel;
            unmasked[parts[i].ft] += !parts[i].mask && bt->numel > 0;
        }
    }
    bool any = false;
    for (int i = 0; i < o->n_ft; i++) {
        lm_topk_init(&e->global[i], unmasked[i] ? (int64_t)floor(o->densities[i] * (double)count[i]) : 0, count[i]);
        any = any || !e->global[i].none;
    }
    free(unmasked);
    for (c.level = 0; any && c.level < 2 && s == LM_OK; c.level++) {
        memset(c.block, 0, cells * sizeof(uint64_t));
        for (int64_t t = 0; t < n_out && s == LM_OK; t++) {
            const lm_st_tensor *bt = e->base->tensors[t];
            if (!lm_dtype_readable(bt->dtype) || bt->numel == 0)
                continue;
            part parts[o->n_ft];
            int k = lm_eng_find_parts(e, bt->name, parts);
            if (k == 0)
                continue;
            memset(c.tensor, 0, cells * sizeof(uint64_t));
            unit u = {"select", t, parts, k, select_work, select_undo, &c};
            bool on_device;
            s = lm_eng_run_unit(e, &u, &on_device);
            if (s != LM_OK)
                lm_err_prefix(e->err, "selecting the --topk global thresholds, tensor '%s'", bt->name);
            lm_eng_release_pages(e, bt);
            for (int i = 0; i < k; i++)
                lm_eng_release_pages(e, parts[i].full);
        }
        for (int i = 0; s == LM_OK && i < o->n_ft; i++) {
            if (c.level == 0)
                lm_topk_level0(&e->global[i], c.block + (size_t)i * LM_HIST_BINS);
            else
                lm_topk_level1(&e->global[i], c.block + (size_t)i * LM_HIST_BINS);
        }
    }
done:
    free(c.block);
    free(c.tensor);
    free(count);
    return s;
}
