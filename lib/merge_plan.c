// The merge engine's sizing (see merge_int.h for the engine's files): how many rows a slab
// holds, what a unit's working set and staging take, and the lm_merge_plan_* answers to
// `llmerge plan`. The run allocates by these same functions, so a plan cannot drift from it.
// They read headers only, never tensor data.
#include <stdlib.h>
#include <string.h>

#include "merge_int.h"

// Rows per slab of tensor bt (whole rows, at least one) when its parts run on dev.
int64_t lm_eng_slab_rows(const engine *e, const lm_dev *dev, const lm_st_tensor *bt, const part *parts, int k)
{
    int64_t elems = e->slab_elems;
    bool dense = true;
    for (int i = 0; i < k; i++)
        dense = dense && lm_eng_dense_part(e, &parts[i]);
    // On the CPU small slabs: the separate operations' buffers stay in cache from one to the
    // next, and the fused ones let the inputs' pages go in small steps.
    if (dense && lm_dev_host_memory(dev))
        elems = e->slab_dense;
    int64_t rows = tensor_rows(bt), cols = rows ? bt->numel / rows : 0;
    if (cols == 0)
        return rows > 0 ? rows : 1;
    return elems / cols > 0 ? elems / cols : 1;
}

// The bytes the staging buffer needs for a tensor's slab of cnt elements: its largest input
// element (the base, full FTs' tensors, LoRA biases and DoRA magnitudes, which have a row's
// worth) times the larger of cnt and the rows.
size_t lm_eng_stage_need(const lm_st_tensor *bt, const part *parts, int k, int64_t cnt)
{
    size_t es = esize(bt->dtype);
    for (int i = 0; i < k; i++) {
        const lm_st_tensor *t = parts[i].src == SRC_FULL ? parts[i].full
                                : parts[i].src == SRC_LORA_BIAS ? parts[i].mod->bias : parts[i].mod->magnitude;
        if (t && esize(t->dtype) > es)
            es = esize(t->dtype);
    }
    int64_t rows = tensor_rows(bt);
    return (size_t)(cnt > rows ? cnt : rows) * es;
}

// The elements of one slab of tensor bt on dev.
int64_t lm_eng_slab_cnt(const engine *e, const lm_dev *dev, const lm_st_tensor *bt, const part *parts, int k)
{
    int64_t rows = tensor_rows(bt), cols = rows ? bt->numel / rows : 0;
    if (cols == 0)
        return 1;
    int64_t slab_rows = lm_eng_slab_rows(e, dev, bt, parts, k);
    return (slab_rows < rows ? slab_rows : rows) * cols;
}

// What a unit's working set on dev holds for tensor bt and its parts: the base's slab and a τ
// slab per part, sparsegpt's importance slab (and, without host memory, a copy of U_cc²) per
// part with a Hessian, without host memory the input and output staging, and what sce's and
// della's passes take beside them.
void lm_eng_ws_size(const engine *e, const lm_dev *dev, const lm_st_tensor *bt, const part *parts, int k, ws_size *z)
{
    int64_t cnt = lm_eng_slab_cnt(e, dev, bt, parts, k);
    int64_t cols = bt->numel / (tensor_rows(bt) > 0 ? tensor_rows(bt) : 1);
    *z = (ws_size){.cap = cnt, .n_tau = k};
    for (int i = 0; i < k; i++)
        z->n_key += parts[i].ucc2 != NULL;
    if (e->m->sce && e->tp.select_topk < 1)  // the slab of variances (ws_alloc's var_buf) for a mask
        z->extra_bytes += (size_t)cnt * sizeof(float);
    if (e->m->della && !lm_dev_host_memory(dev)) {  // della_drop's sorted rows in device scratch, a group at once
        int64_t rows = cols > 0 ? cnt / cols : 0;
        z->extra_bytes += (size_t)lm_della_sort_bytes(lm_della_sort_rows(rows, cols), cols);
    }
    if (!lm_dev_host_memory(dev)) {
        z->ucc2_cols = cols;
        z->stage_bytes = lm_eng_stage_need(bt, parts, k, cnt);
        z->out_bytes = (size_t)cnt * sizeof(float);
    }
}

// The input bytes tensor bt's unit maps: the base's tensor and each full part's.
uint64_t lm_eng_mapped_bytes(const lm_st_tensor *bt, const part *parts, int k)
{
    uint64_t mapped = bt->nbytes;
    for (int i = 0; i < k; i++)
        mapped += parts[i].src == SRC_FULL ? parts[i].full->nbytes : 0;
    return mapped;
}

// Whether a unit that maps `mapped` input bytes keeps them mapped until its tensor is done
// (lm_eng_release_slab lets a larger one's slabs go as its passes leave them).
bool lm_eng_keeps_mapped(uint64_t mapped)
{
    return mapped <= KEEP_MAPPED_BYTES;
}

bool lm_eng_per_col(const engine *e, const lm_st_tensor *bt)
{
    return e->o->per_col && e->m->cols_ok && bt->ndim == 2;
}

// The cells (uint64_t) of lm_eng_select_tensor's histogram block for k parts: each part's window
// and the level arrays of the two passes a missed window takes.
size_t lm_eng_sel_cells(int k)
{
    return (size_t)k * (1 + LM_HIST_WINDOW) * LM_HIST_BINS;
}

// The bins of part p's window: DENSE_WINDOW for a full model's τ, FUSED_LORA_WINDOW for a fused
// pass's LoRA product (sampled over the whole tensor), else LM_HIST_WINDOW (see DENSE_WINDOW).
int lm_eng_window_bins(const part *p, bool fuse)
{
    return p->src == SRC_FULL ? DENSE_WINDOW : fuse ? FUSED_LORA_WINDOW : LM_HIST_WINDOW;
}

// Fills *z for a candidate store of a tensor of numel elements.
void lm_eng_keep_size(int64_t numel, keep_size *z)
{
    int64_t segs = (numel + LM_DENSE_KEEP_SEGMENT - 1) / LM_DENSE_KEEP_SEGMENT;
    z->cap = segs * LM_DENSE_KEEP_SEGMENT;
    z->bits_bytes = (size_t)(segs * (LM_DENSE_KEEP_SEGMENT / 16)) * sizeof(uint16_t);
    z->off_bytes = (size_t)segs * sizeof(int64_t);
    z->vals_bytes = (size_t)(segs * LM_DENSE_KEEP_SEGMENT + 16) * sizeof(float);
}

// The bytes of that store a part of density d writes: the bitmap, the segments' offsets, and
// the values at or above the window, about the density's share.
uint64_t lm_eng_keep_touched(int64_t numel, double density)
{
    double share = density + 0.02 < 1.0 ? density + 0.02 : 1.0;
    return (uint64_t)numel / 8 + (uint64_t)numel / LM_DENSE_KEEP_SEGMENT * 8 +
           (uint64_t)((double)numel * share) * sizeof(float);
}

// The host buffer the CPU converts, hashes and writes output through: two pieces, one filled
// while the other is written (merge_pieces).
size_t lm_eng_out_host_bytes(void)
{
    return 2 * (size_t)OUT_PIECE;
}

// The largest slab any tensor needs: a slab is whole rows, at most slab_elems elements unless
// one row is longer.
int64_t lm_eng_largest_slab(const lm_model *base, int64_t slab_elems)
{
    int64_t best = 1;
    for (int64_t i = 0; i < base->n_tensors; i++) {
        const lm_st_tensor *t = base->tensors[i];
        int64_t rows = tensor_rows(t), cols = rows ? t->numel / rows : 0;
        if (cols == 0)
            continue;
        int64_t slab_rows = slab_elems / cols > 0 ? slab_elems / cols : 1;
        int64_t cnt = (slab_rows < rows ? slab_rows : rows) * cols;
        if (cnt > best)
            best = cnt;
    }
    return best;
}

// ==== what the engine will allocate (llmerge plan) ============================================

// These answer from the same sizing functions the engine allocates by (lm_eng_find_parts, ws_size,
// slab_rows, mapped_bytes, sel_cells, window_bins, keep_touched), over an engine that holds only
// what those read and on a real device of the kind the unit runs on, so a plan cannot drift
// from the run.

// An engine for sizing: the options, the method, the inputs and the slab sizes.
static engine sizing_engine(const lm_merge_opts *o, const lm_model *base, lm_ft *const *fts)
{
    engine e = {.o = o, .m = lm_method_of(o->method), .base = base, .fts = fts};
    e.tp.select_topk = o->select_topk;
    e.slab_elems = o->slab_elems > 0 ? o->slab_elems : LARGE_SLAB_ELEMS;
    e.slab_dense = o->slab_elems > 0 ? o->slab_elems : DENSE_SLAB_ELEMS;
    e.slab_max = lm_eng_largest_slab(base, e.slab_elems);
    return e;
}

int64_t lm_merge_plan_slab_max(const lm_merge_opts *o, const lm_model *base)
{
    return lm_eng_largest_slab(base, o->slab_elems > 0 ? o->slab_elems : LARGE_SLAB_ELEMS);
}

uint64_t lm_merge_plan_resident_bytes(const lm_ft *ft)
{
    uint64_t n = 0;
    for (int64_t m = 0; ft->adapter && m < ft->adapter->n_modules; m++) {
        const lm_lora_module *mod = &ft->adapter->modules[m];
        n += (uint64_t)(mod->a ? mod->a->numel : 0) + (uint64_t)(mod->b ? mod->b->numel : 0);
    }
    return n * sizeof(float);
}

uint64_t lm_merge_plan_out_piece(void)
{
    return lm_eng_out_host_bytes();
}

lm_status lm_merge_plan_tensor(const lm_merge_opts *o, const lm_model *base, lm_ft *const *fts, int64_t idx,
                               const lm_dev *dev, lm_merge_need *need)
{
    memset(need, 0, sizeof *need);
    const lm_st_tensor *bt = base->tensors[idx];
    engine e = sizing_engine(o, base, fts);
    part parts[o->n_ft > 0 ? o->n_ft : 1];
    int k = lm_dtype_readable(bt->dtype) ? lm_eng_find_parts(&e, bt->name, parts) : 0;
    need->parts = k;
    if (k == 0 || bt->numel == 0) {
        // lm_eng_copy_tensor: base_buf holds slabs of slab_max elements when the dtype changes
        need->copy_elems = lm_dtype_readable(bt->dtype) && bt->dtype != o->out_dtype
                           ? (bt->numel < e.slab_max ? bt->numel : e.slab_max) : 0;
        return LM_OK;
    }
    int64_t rows = tensor_rows(bt);
    if (e.m->sce)  // a mask, and with it the variances' slab, as this tensor's select_topk says
        e.tp.select_topk = lm_eng_tensor_select_topk(o, bt->name);
    ws_size z;
    lm_eng_ws_size(&e, dev, bt, parts, k, &z);
    int64_t cnt = z.cap;
    need->slab_elems = cnt;
    need->one_slab = lm_eng_slab_rows(&e, dev, bt, parts, k) >= rows;
    for (int i = 0; i < k; i++)
        need->part_mask |= 1ull << (parts[i].ft < 63 ? parts[i].ft : 63);
    // the base's and the parts' slabs, and the staging (sparsegpt's buffers: plan_importance)
    need->ws_bytes =
        (uint64_t)cnt * sizeof(float) * (uint64_t)(1 + z.n_tau) + z.stage_bytes + z.out_bytes + z.extra_bytes;
    // The fused passes write the buffers only at the first slab's sample (hist_dense), and
    // the whole slab only when the sample's window misses the threshold; --topk global's
    // selection runs the separate operations, and sce, nearswap and ramplus_tl's weights make
    // every τ in the buffers in passes of their own (lm_eng_merge_tensor), as does a Gram pass
    // per column (lm_eng_merge_coef).
    need->touched_elems = cnt;
    need->var_elems = e.m->sce && e.tp.select_topk < 1 ? cnt : 0;
    bool fuse = lm_eng_fused(&e, dev, bt, parts, k);
    bool per_col = e.m->gram && lm_eng_per_col(&e, bt);
    if (fuse && !o->topk_global && !e.m->sce && !e.m->nearswap && !e.m->ramplus && !per_col) {
        int64_t n_runs, run, stride;
        lm_eng_sample_runs(cnt, &n_runs, &run, &stride);
        need->touched_elems = e.m->rank != LM_RANK_NONE ? n_runs * run : 0;
    }
    for (int i = 0; i < k; i++)
        if (parts[i].src == SRC_LORA && parts[i].mod->magnitude &&
            (uint64_t)parts[i].mod->magnitude->numel * sizeof(float) > need->mag_bytes)
            need->mag_bytes = (uint64_t)parts[i].mod->magnitude->numel * sizeof(float);
    // lm_eng_release_slab's rule: a tensor whose inputs are small stays mapped until it is done
    uint64_t mapped = lm_eng_mapped_bytes(bt, parts, k), per_row = bt->nbytes / (uint64_t)rows;
    for (int i = 0; i < k; i++)
        per_row += parts[i].src == SRC_FULL ? parts[i].full->nbytes / (uint64_t)rows : 0;
    int64_t slab_rows = cnt / (bt->numel / rows);
    need->mapped_bytes = lm_eng_keeps_mapped(mapped) || need->one_slab ? mapped : per_row * (uint64_t)slab_rows;
    // lm_eng_select_tensor's block: allocated for every part's window and level arrays, touched for
    // the window each part uses (the level arrays start where the window does) and the sample's
    // histogram after the widest window
    if (e.m->rank != LM_RANK_NONE && !o->topk_global) {
        // breadcrumbs' fused selection counts each part twice (lm_eng_merge_tensor)
        int copies = e.m->outliers && fuse ? 2 : 1;
        need->hist_alloc = (uint64_t)lm_eng_sel_cells(copies * k) * sizeof(uint64_t);
        for (int i = 0; i < k; i++)
            need->hist_touched += (uint64_t)copies * (1 + lm_eng_window_bins(&parts[i], fuse)) * LM_HIST_BINS *
                                  sizeof(uint64_t);
        // a fused LoRA part's kept candidates (lm_eng_select_tensor, keep_store)
        bool aligned = lm_eng_keeps_fit(&e, dev, bt, parts, k, need->one_slab);
        for (int i = 0; fuse && aligned && !e.m->outliers && i < k; i++)
            if (parts[i].src == SRC_LORA)
                need->hist_touched += lm_eng_keep_touched(bt->numel, o->densities[parts[i].ft]);
    }
    return LM_OK;
}

bool lm_merge_plan_selects(const lm_merge_opts *o)
{
    return o->topk_global && lm_method_of(o->method)->rank != LM_RANK_NONE;
}

lm_status lm_merge_plan_importance(const lm_merge_opts *o, const lm_model *base, lm_ft *const *fts, int64_t idx,
                                   const lm_dev *dev, lm_merge_imp_need *need)
{
    memset(need, 0, sizeof *need);
    const lm_st_tensor *bt = base->tensors[idx];
    if (lm_method_of(o->method)->rank != LM_RANK_IMPORTANCE || !o->ucc2 || !lm_dtype_readable(bt->dtype) ||
        bt->numel == 0)
        return LM_OK;
    engine e = sizing_engine(o, base, fts);
    part parts[o->n_ft > 0 ? o->n_ft : 1];
    int k = lm_eng_find_parts(&e, bt->name, parts);
    if (k == 0)
        return LM_OK;
    // ws_alloc: a slab for each part with a Hessian and, without host memory, its U_cc²
    ws_size z;
    lm_eng_ws_size(&e, dev, bt, parts, k, &z);
    need->slab_elems = z.cap;
    for (int i = 0; i < k; i++)
        if (parts[i].ucc2)
            need->part_mask |= 1ull << (parts[i].ft < 63 ? parts[i].ft : 63);
    need->parts = z.n_key;
    need->key_bytes = (uint64_t)z.n_key * (uint64_t)z.cap * sizeof(float);
    need->ucc2_bytes = (uint64_t)z.n_key * (uint64_t)z.ucc2_cols * sizeof(double);
    return LM_OK;
}
