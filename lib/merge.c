// The merge engine: see merge.h for what it does; docs/merging.md for the exact semantics.
//
// Per output tensor the engine finds the FTs that touch it (its "parts"), then works in slabs
// of whole rows through up to three phases:
//   select  - magnitude trimming: each part's exact k-th largest |τ| and how many ties at it
//             to keep, in one pass that counts the values beyond a window of histogram bins
//             guessed from a sample and the window's fine histogram (two full radix-histogram
//             passes when the guess misses; for --topk global, those two passes over whole
//             models before the first tensor);
//   l1      - DARE with --rescale l1: ‖τ‖₁ and ‖τ ⊙ m‖₁ per part;
//   merge   - τ per part, trimmed or dropped, rescaled, combined with the base, converted to
//             the output dtype, hashed and written at its offset.
// With one slab τ is computed once and kept across the phases; with several it is computed
// again for each pass, which costs reads but keeps memory at a few slabs per FT.
//
// Where a unit runs: on an accelerator each tensor (and each adapter's factors) tries the
// device with buffers of its own and, when the device is out of memory, is redone on the CPU
// (lm_eng_run_unit: tried, undone, redone); the CPU's buffers are the engine's for the whole run.
//
// This file is the engine's core; merge_int.h says which file holds each of the other parts
// (the passes, selection, sizing) and lib/methods/ the methods.
#include "merge_int.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
#include <xxhash.h>

#include "merge_desc.h"
#include "signals.h"
#include "util.h"

// ==== names and options =======================================================================

const char *lm_rescale_name(lm_rescale r)
{
    return r == LM_RESCALE_L1 ? "l1" : r == LM_RESCALE_NONE ? "none" : "inv";
}

const char *lm_merge_method_name(lm_merge_method m)
{
    const lm_method *d = lm_method_of(m);
    return d->id == m ? d->name : "?";
}

bool lm_merge_default_normalize(lm_merge_method m)
{
    return lm_method_of(m)->normalize;
}

// How messages name FT i: o->ft_names', else "input i+1" (written into buf, cap bytes).
static const char *ft_label(const lm_merge_opts *o, int i, char *buf, size_t cap)
{
    if (o->ft_names)
        return o->ft_names[i];
    snprintf(buf, cap, "input %d", i + 1);
    return buf;
}

lm_status lm_merge_check_opts(const lm_merge_opts *o, lm_err *err)
{
    if (o->n_ft < 1)
        return lm_err_set(err, LM_ERR_USAGE, "at least one fine-tuned model or adapter is needed");
    if (!o->weights)
        return lm_err_set(err, LM_ERR_USAGE, "--weights: %d weights are needed, one per fine-tuned input", o->n_ft);
    bool density = lm_method_of(o->method)->density;
    if (!o->densities && density)
        return lm_err_set(err, LM_ERR_USAGE, "--density: %d densities are needed, one per fine-tuned input",
                          o->n_ft);
    for (int i = 0; i < o->n_ft; i++) {
        if (!isfinite(o->weights[i]))
            return lm_err_set(err, LM_ERR_USAGE, "--weights: weight %d is %g, not a finite number", i + 1,
                              o->weights[i]);
        if (density && !(o->densities[i] > 0 && o->densities[i] <= 1))
            return lm_err_set(err, LM_ERR_USAGE, "--density: density %d is %g, not in (0, 1]", i + 1,
                              o->densities[i]);
    }
    if (!isfinite(o->lambda))
        return lm_err_set(err, LM_ERR_USAGE, "--lambda %g is not a finite number", o->lambda);
    const lm_method *m = lm_method_of(o->method);
    bool models = m->input == LM_METHOD_MODELS || (m->input == LM_METHOD_EITHER && o->models_only);
    int inputs = o->n_ft + (models ? 1 : 0);
    if (inputs < m->min_inputs || (m->max_inputs > 0 && inputs > m->max_inputs)) {
        int want = inputs < m->min_inputs ? m->min_inputs : m->max_inputs;
        const char *what = models ? (want == 1 ? "model" : "models")
                                  : (want == 1 ? "fine-tuned input besides the base" : "fine-tuned inputs besides the base");
        return lm_err_set(err, LM_ERR_USAGE, "%s takes %s%d %s, not %d", m->name,
                          m->min_inputs == m->max_inputs ? "" : inputs < m->min_inputs ? "at least " : "at most ", want,
                          what, inputs);
    }
    if (models && !isfinite(o->base_weight))
        return lm_err_set(err, LM_ERR_USAGE, "--weights: the first model's weight %g is not a finite number",
                          o->base_weight);
    if (o->per_row && !m->rows_ok)
        return lm_err_set(err, LM_ERR_USAGE, "--per-row: %s takes each tensor as one vector", m->name);
    if (o->per_col && !m->cols_ok)
        return lm_err_set(err, LM_ERR_USAGE, "--per-column: %s takes each tensor as one vector", m->name);
    if (o->per_col && o->per_row)
        return lm_err_set(err, LM_ERR_USAGE, "--per-row and --per-column: one or the other");
    if (m->sce && !isfinite(o->select_topk))
        return lm_err_set(err, LM_ERR_USAGE, "--select-topk %g is not a finite number", o->select_topk);
    if (m->reads_t && !isfinite(o->t))
        return lm_err_set(err, LM_ERR_USAGE, "--t %g is not a finite number", o->t);
    if (m->reads_iter && (o->max_iter < 0 || !(o->tol >= 0)))
        return lm_err_set(err, LM_ERR_USAGE, "--max-iter %d and --tol %g must not be negative", o->max_iter, o->tol);
    for (int i = 0; m->outliers && o->gammas && i < o->n_ft; i++)
        if (!(o->gammas[i] >= 0 && o->gammas[i] <= 1))
            return lm_err_set(err, LM_ERR_USAGE, "--gamma: gamma %d is %g, not in [0, 1]", i + 1, o->gammas[i]);
    if (m->ramplus && !(isfinite(o->ram_r) && isfinite(o->ram_alpha)))
        return lm_err_set(err, LM_ERR_USAGE, "--r %g and --alpha %g must be finite numbers", o->ram_r, o->ram_alpha);
    for (int i = 0; m->threshold && o->epsilons && i < o->n_ft; i++)
        if (!(o->epsilons[i] >= 0 && isfinite(o->epsilons[i])))
            return lm_err_set(err, LM_ERR_USAGE, "--epsilon: epsilon %d is %g, not a finite number of 0 or more", i + 1,
                              o->epsilons[i]);
    for (int i = 0; m->della && i < o->n_ft; i++) {
        double d = o->densities ? o->densities[i] : 1, eps = o->epsilons ? o->epsilons[i] : lm_method_epsilon(m);
        char ft[32];
        if (d < 1 && !(eps >= 0 && d - eps > 0 && d + eps < 1))
            return lm_err_set(err, LM_ERR_USAGE,
                              "epsilon: %s has density %g and epsilon %g: density - epsilon and density + "
                              "epsilon must lie in (0, 1)",
                              ft_label(o, i, ft, sizeof ft), d, eps);
    }
    if (m->outliers && o->topk_global)
        return lm_err_set(err, LM_ERR_USAGE, "--topk global: %s trims each tensor on its own", m->name);
    if (o->tensor_params && o->topk_global)
        return lm_err_set(err, LM_ERR_USAGE,
                          "--topk global takes one density per FT for the whole model: it cannot be combined "
                          "with parameters that vary by tensor");
    if (!lm_dtype_writable(o->out_dtype))
        return lm_err_set(err, LM_ERR_USAGE, "--dtype %s: llmerge writes f32, f16 or bf16",
                          lm_dtype_name(o->out_dtype));
    if (o->slab_elems < 0 || o->threads < 0)
        return lm_err_set(err, LM_ERR_USAGE, "negative slab size or thread count");
    return LM_OK;
}

lm_status lm_merge_outputs(const lm_merge_opts *o, const lm_model *base, lm_st_desc **out,
                           int64_t *n, lm_err *err)
{
    lm_st_desc *d = calloc((size_t)(base->n_tensors ? base->n_tensors : 1), sizeof *d);
    if (!d)
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    for (int64_t i = 0; i < base->n_tensors; i++) {
        const lm_st_tensor *t = base->tensors[i];
        d[i].name = t->name;
        d[i].dtype = lm_dtype_readable(t->dtype) ? o->out_dtype : t->dtype;
        d[i].ndim = t->ndim;
        memcpy(d[i].shape, t->shape, sizeof d[i].shape);
    }
    *out = d;
    *n = base->n_tensors;
    return LM_OK;
}

void lm_merge_result_free(lm_merge_result *res)
{
    if (res) {
        free(res->tensor_xxh64);
        for (int64_t i = 0; i < res->n_nonfinite; i++)
            free(res->nonfinite[i].tensor);
        free(res->nonfinite);
        free(res->empty_trim_tensor);
        memset(res, 0, sizeof *res);
    }
}

// ==== fine-tuned inputs =======================================================================

void lm_ft_free(lm_ft *ft)
{
    if (!ft)
        return;
    lm_model_free(ft->model);
    lm_adapter_free(ft->adapter);
    free(ft->path);
    free(ft);
}

// A full fine-tune's tensors in a dtype llmerge cannot compute with (integers, FP8): one equal
// to the base's (same dtype, same bytes) is copied with the base, one that differs cannot be
// merged and is refused (it would otherwise be dropped, the base's value taking its place).
static lm_status check_dtypes(const lm_ft *ft, const lm_model *base, lm_err *err)
{
    for (int64_t i = 0; i < base->n_tensors; i++) {
        const lm_st_tensor *b = base->tensors[i], *t = lm_model_find(ft->model, b->name);
        if (!t || (lm_dtype_readable(b->dtype) && lm_dtype_readable(t->dtype)))
            continue;
        if (t->dtype == b->dtype && t->nbytes == b->nbytes && memcmp(t->data, b->data, (size_t)b->nbytes) == 0)
            continue;
        lm_dtype odd = lm_dtype_readable(t->dtype) ? b->dtype : t->dtype;
        return lm_err_set(err, LM_ERR_UNSUPPORTED,
                          "%s: tensor '%s' is %s here and %s in the base %s, and the two differ: llmerge cannot "
                          "compute with %s (it reads F32, F16, BF16 and F64; a tensor equal in both is copied)",
                          ft->path, b->name, lm_dtype_name(t->dtype), lm_dtype_name(b->dtype), base->dir,
                          lm_dtype_name(odd));
    }
    return LM_OK;
}

lm_status lm_ft_of_model(lm_ft **out, lm_model *m, const lm_model *base, lm_err *err)
{
    *out = NULL;
    lm_ft *ft = calloc(1, sizeof *ft);
    if (!ft || !(ft->path = lm_strdup(m->dir))) {
        free(ft);
        lm_model_free(m);
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    }
    ft->kind = LM_INPUT_MODEL;
    ft->model = m;
    lm_status s;
    if ((s = lm_model_compare(ft->model, base, NULL, err)) != LM_OK || (s = check_dtypes(ft, base, err)) != LM_OK) {
        lm_ft_free(ft);
        return s;
    }
    *out = ft;
    return LM_OK;
}

lm_status lm_ft_open(lm_ft **out, const char *path, const lm_model *base, lm_err *err)
{
    *out = NULL;
    lm_ft *ft = calloc(1, sizeof *ft);
    if (!ft)
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    lm_status s = lm_input_detect(path, &ft->kind, &ft->path, err);
    if (s != LM_OK)
        goto fail;
    if (ft->kind == LM_INPUT_MODEL) {
        lm_model *m = NULL;
        if ((s = lm_model_open(&m, ft->path, err)) != LM_OK)
            goto fail;
        lm_ft_free(ft);
        return lm_ft_of_model(out, m, base, err);
    } else if (ft->kind == LM_INPUT_ADAPTER) {
        if ((s = lm_adapter_open(&ft->adapter, ft->path, err)) != LM_OK)
            goto fail;
        if ((s = lm_adapter_select(ft->adapter, base, err)) != LM_OK)
            goto fail;
        if ((s = lm_adapter_validate(ft->adapter, base, err)) != LM_OK)
            goto fail;
        for (int64_t m = 0; m < ft->adapter->n_modules; m++) {
            const lm_lora_module *mod = &ft->adapter->modules[m];
            if (mod->magnitude && (mod->kind == LM_LORA_EMBEDDING || ft->adapter->config.fan_in_fan_out)) {
                s = lm_err_set(err, LM_ERR_UNSUPPORTED,
                               "%s: DoRA on %s module '%s' is not supported (only on linear layers stored "
                               "[out, in])", ft->path, mod->kind == LM_LORA_EMBEDDING ? "the embedding" : "a fan_in_fan_out",
                               mod->path);
                goto fail;
            }
        }
    } else {
        s = lm_err_set(err, LM_ERR_USAGE, "%s: a fine-tuned input must be a model directory or a LoRA adapter "
                       "directory, not a single safetensors file", path);
        goto fail;
    }
    *out = ft;
    return LM_OK;
fail:
    lm_ft_free(ft);
    return s;
}

// Tells the kernel the pages of `t` may leave this process's memory: they stay in the page
// cache, and a later read faults them back in. Keeps RSS at the working set while whole models
// stream through.
void lm_eng_release_pages(const engine *e, const lm_st_tensor *t)
{
    if (t)
        lm_eng_release_bytes(e, t->data, t->nbytes);
}

// The same for `nbytes` bytes from `data`, whole pages around them.
void lm_eng_release_bytes(const engine *e, const void *data, uint64_t nbytes)
{
    if (!nbytes)
        return;
    uintptr_t lo = (uintptr_t)data & ~(uintptr_t)(e->page - 1);
    uintptr_t hi = ((uintptr_t)data + nbytes + (uintptr_t)e->page - 1) & ~(uintptr_t)(e->page - 1);
    madvise((void *)lo, hi - lo, MADV_DONTNEED);
}

// ==== counting NaN and Inf ====================================================================
// Each input of a tensor is counted in the first pass that reads it whole, the pass being
// whatever the tensor's method and device make first (a selection, the L1 norms, the merge):
// a read of elements [first, first + n) counts them when it continues that input's count from
// where it stands (counted[who] == first), and a later pass, which starts again from 0, counts
// nothing. The samples that place a selection's window are not counted. The CPU counts in the
// loops that convert (lm_dev_to_f32_count, lm_dev_delta_count, lm_dev_from_f32_count and the
// fused operations); an accelerator's inputs are counted on the host as they are copied to it,
// its output as it comes back, so every device gives the same counts.

// Where the read of elements [first, first + n) of input `who` (0 the base, 1 + ft an FT's
// tensor) is to add its NaN and Inf, or NULL when it is not to count them.
lm_nonfinite *lm_eng_first_read(engine *e, int who, int64_t first, int64_t n)
{
    if (!e->counting || e->counted[who] != first)
        return NULL;
    e->counted[who] = first + n;
    return &e->in[who];
}

// Where the output's NaN and Inf go, or NULL while nothing is counted.
lm_nonfinite *lm_eng_out_count(engine *e)
{
    return e->counting ? &e->out : NULL;
}

// Starts the counts of a tensor afresh (also when a unit is redone on the CPU).
static void count_reset(engine *e)
{
    memset(e->counted, 0, (size_t)(1 + e->o->n_ft) * sizeof *e->counted);
    memset(e->in, 0, (size_t)(1 + e->o->n_ft) * sizeof *e->in);
    e->out = (lm_nonfinite){0, 0};
}

// Whether ws's device counts while it converts (the CPU); elsewhere the
// engine counts on the host.
bool lm_eng_dev_counts(const wset *ws)
{
    return lm_dev_supports(ws->dev, LM_OP_COUNTS);
}

// Appends input `input`'s tensor `name` to res->nonfinite when it holds NaN or Inf.
static lm_status note_nonfinite(engine *e, int input, const char *name, const lm_nonfinite *c)
{
    if (!c->nan && !c->inf)
        return LM_OK;
    lm_merge_result *r = e->res;
    lm_merge_nonfinite *n = realloc(r->nonfinite, (size_t)(r->n_nonfinite + 1) * sizeof *n);
    if (!n)
        return lm_err_set(e->err, LM_ERR_NOMEM, "out of memory");
    r->nonfinite = n;
    n[r->n_nonfinite] = (lm_merge_nonfinite){input, lm_strdup(name), c->nan, c->inf};
    if (!n[r->n_nonfinite].tensor)
        return lm_err_set(e->err, LM_ERR_NOMEM, "out of memory");
    r->n_nonfinite++;
    return LM_OK;
}

// Makes n elements of host input src (dtype dt) readable by the device: src itself on a
// host-memory device, else a copy in the staging buffer. With nf (not NULL) on a device that
// does not count, their NaN and Inf are counted here, as they are copied.
lm_status lm_eng_stage(engine *e, wset *ws, const void *src, lm_dtype dt, int64_t n, lm_nonfinite *nf,
                       const void **on_dev)
{
    e->bytes_in += (uint64_t)n * esize(dt);
    if (nf && !lm_eng_dev_counts(ws))
        lm_count_nonfinite(src, dt, n, nf);
    if (lm_dev_host_memory(ws->dev)) {
        *on_dev = src;
        return LM_OK;
    }
    *on_dev = ws->stage_dev;
    e->res->bytes_to_device += (uint64_t)n * esize(dt);
    return lm_dev_upload(ws->dev, ws->stage_dev, src, (size_t)n * esize(dt), e->err);
}

// dst[0..n) = float32 of host data src (dtype dt), their NaN and Inf added to *nf when nf is not
// NULL.
lm_status lm_eng_load_f32_nf(engine *e, wset *ws, float *dst, const void *src, lm_dtype dt, int64_t n, lm_nonfinite *nf)
{
    const void *in;
    lm_status s = lm_eng_stage(e, ws, src, dt, n, nf, &in);
    if (s != LM_OK)
        return s;
    return nf && lm_eng_dev_counts(ws) ? lm_dev_to_f32_count(ws->dev, dst, in, dt, n, nf, e->err)
                               : lm_dev_to_f32(ws->dev, dst, in, dt, n, e->err);
}

lm_status lm_eng_load_f32(engine *e, wset *ws, float *dst, const void *src, lm_dtype dt, int64_t n)
{
    return lm_eng_load_f32_nf(e, ws, dst, src, dt, n, NULL);
}

// lm_eng_load_f32 of rows [r0, r0 + rows) of base tensor bt into base_buf, counted as the base's
// read.
lm_status lm_eng_load_base(engine *e, wset *ws, const lm_st_tensor *bt, int64_t r0, int64_t rows)
{
    int64_t cols = bt->numel / tensor_rows(bt), first = r0 * cols, cnt = rows * cols;
    return lm_eng_load_f32_nf(e, ws, ws->base_buf, (const char *)bt->data + (size_t)first * esize(bt->dtype),
                              bt->dtype, cnt, lm_eng_first_read(e, 0, first, cnt));
}

// Tells the caller a unit went to the CPU because the device was out of memory.
static void fell_back(engine *e, const char *phase, const char *unit, double seconds)
{
    if (e->hooks)
        lm_fallback_say(e->hooks->fallback, e->hooks->ctx,
                        &(lm_fallback){phase, unit, lm_dev_name(e->dev), lm_dev_name(e->cpu), e->err->msg});
    e->res->fallback_s += seconds;
    lm_err_clear(e->err);
}

// Converts every adapter's factors to float32 in host memory, once for the whole merge, and
// copies them to an accelerator: an FT whose factors do not fit there keeps them on the CPU
// alone (its deltas are made there), the others still try the device.
static lm_status place_residents(engine *e)
{
    for (int i = 0; i < e->o->n_ft; i++) {
        const lm_adapter *a = e->fts[i]->adapter;
        if (!a)
            continue;
        resident *rs = &e->res_cpu[i];
        rs->a_off = calloc((size_t)(a->n_modules ? a->n_modules : 1), sizeof *rs->a_off);
        rs->b_off = calloc((size_t)(a->n_modules ? a->n_modules : 1), sizeof *rs->b_off);
        if (!rs->a_off || !rs->b_off)
            return lm_err_set(e->err, LM_ERR_NOMEM, "out of memory");
        int64_t total = 0;
        for (int64_t m = 0; m < a->n_modules; m++) {
            rs->a_off[m] = total;
            total += a->modules[m].a ? a->modules[m].a->numel : 0;
            rs->b_off[m] = total;
            total += a->modules[m].b ? a->modules[m].b->numel : 0;
        }
        wset *ws = &e->cpu_ws;  // the factors are converted on the CPU
        lm_status s = lm_dev_alloc(e->cpu, (size_t)total * sizeof(float), (void **)&rs->data, e->err);
        if (s != LM_OK)
            return lm_err_prefix(e->err, "%s: the LoRA factors", e->fts[i]->path);
        for (int64_t m = 0; m < a->n_modules; m++) {
            const lm_lora_module *mod = &a->modules[m];
            if (mod->a && (s = lm_eng_load_f32(e, ws, rs->data + rs->a_off[m], mod->a->data, mod->a->dtype,
                                               mod->a->numel)) != LM_OK)
                return lm_err_prefix(e->err, "%s", mod->a->name);
            if (mod->b && (s = lm_eng_load_f32(e, ws, rs->data + rs->b_off[m], mod->b->data, mod->b->dtype,
                                               mod->b->numel)) != LM_OK)
                return lm_err_prefix(e->err, "%s", mod->b->name);
            // the adapter's own tensors are small: counted here, once, from the host's copy
            const lm_st_tensor *own[] = {mod->a, mod->b, mod->bias, mod->magnitude};
            for (size_t t = 0; t < sizeof own / sizeof own[0]; t++) {
                lm_nonfinite c = {0, 0};
                if (!own[t])
                    continue;
                if (t < 2)  // the factors as float32, as the merge uses them
                    lm_count_nonfinite(rs->data + (t ? rs->b_off[m] : rs->a_off[m]), LM_DTYPE_F32, own[t]->numel, &c);
                else
                    lm_count_nonfinite(own[t]->data, own[t]->dtype, own[t]->numel, &c);
                if ((s = note_nonfinite(e, 1 + i, own[t]->name, &c)) != LM_OK)
                    return s;
            }
        }
        if (e->dev == e->cpu)
            continue;
        double t0 = lm_now();
        resident *rd = &e->res_dev[i];
        size_t bytes = (size_t)total * sizeof(float);
        s = lm_dev_alloc(e->dev, bytes, (void **)&rd->data, e->err);
        if (s == LM_OK) {
            s = lm_dev_upload(e->dev, rd->data, rs->data, bytes, e->err);
            e->res->bytes_to_device += bytes;
        }
        if (s != LM_OK) {
            lm_dev_buf_free(e->dev, rd->data);
            rd->data = NULL;
        }
        if (s == LM_ERR_DEVICE_OOM) {
            e->res->fallback_place++;
            fell_back(e, "place", e->fts[i]->path, lm_now() - t0);
            s = LM_OK;
        } else if (s == LM_OK) {
            e->res->ft_on_device++;
            rd->a_off = rs->a_off;  // the same layout; owned by res_cpu
            rd->b_off = rs->b_off;
        }
        // the unit's end: a fault of the upload, or a failed release, is this unit's failure
        if (s == LM_OK)
            s = lm_dev_check(e->dev, e->err);
        if (s != LM_OK)
            return lm_err_prefix(e->err, "%s: placing the LoRA factors on %s", e->fts[i]->path, lm_dev_name(e->dev));
    }
    return LM_OK;
}

// The parts of tensor `name`: every FT that changes it, in FT order.
int lm_eng_find_parts(engine *e, const char *name, part *parts)
{
    int k = 0;
    for (int i = 0; i < e->o->n_ft; i++) {
        const lm_ft *ft = e->fts[i];
        part p = {.ft = i, .rescale = 1.0};  // its buffers: bind
        if (ft->model) {
            p.src = SRC_FULL;
            p.full = lm_model_find(ft->model, name);
            if (!p.full || !lm_dtype_readable(p.full->dtype))
                continue;
        } else {
            int64_t idx;
            switch (lm_adapter_lookup(ft->adapter, name, &idx)) {
            case LM_TOUCH_NONE: continue;
            case LM_TOUCH_LORA:
                p.src = SRC_LORA;
                p.mod = &ft->adapter->modules[idx];
                p.mod_index = idx;
                break;
            case LM_TOUCH_BIAS:
                p.src = SRC_LORA_BIAS;
                p.mod = &ft->adapter->modules[idx];
                p.mod_index = idx;
                break;
            case LM_TOUCH_SAVED:
                p.src = SRC_FULL;
                p.full = ft->adapter->saved[idx].t;
                break;
            }
        }
        // a stored mask replaces the importance and the selection
        if (e->m->rank != LM_RANK_NONE && e->o->mask_load) {
            const lm_st_tensor *bt = lm_model_find(e->base, name);
            p.mask = bt ? e->o->mask_load(e->o->mask_ctx, i, name, bt->numel) : NULL;
        }
        if (e->m->rank == LM_RANK_IMPORTANCE && e->o->ucc2 && p.src != SRC_LORA_BIAS && !p.mask) {
            const lm_st_tensor *bt = lm_model_find(e->base, name);
            int64_t rows = bt ? tensor_rows(bt) : 0;
            if (bt && rows > 0 && bt->ndim == 2)
                p.ucc2 = e->o->ucc2(e->o->ucc2_ctx, i, name, bt->numel / rows);
        }
        parts[k++] = p;
    }
    return k;
}

// ==== where each unit runs ====================================================================

// Frees a working set's buffers (it stays tied to its device).
static void ws_release(engine *e, wset *w)
{
    if (!w->dev)
        return;
    lm_dev_buf_free(w->dev, w->base_buf);
    for (int i = 0; w->tau_buf && i < e->o->n_ft; i++)
        lm_dev_buf_free(w->dev, w->tau_buf[i]);
    lm_dev_buf_free(w->dev, w->stage_dev);
    lm_dev_buf_free(w->dev, w->out_dev);
    lm_dev_buf_free(w->dev, w->mag_buf);
    lm_dev_buf_free(w->dev, w->var_buf);
    for (int i = 0; w->key_buf && i < e->o->n_ft; i++) {
        lm_dev_buf_free(w->dev, w->key_buf[i]);
        lm_dev_buf_free(w->dev, w->ucc2_buf[i]);
    }
    float **keep = w->tau_buf, **keys = w->key_buf;
    double **ucc2 = w->ucc2_buf;
    lm_dev *dev = w->dev;
    if (keep)
        memset(keep, 0, (size_t)e->o->n_ft * sizeof *keep);
    if (keys) {
        memset(keys, 0, (size_t)e->o->n_ft * sizeof *keys);
        memset(ucc2, 0, (size_t)e->o->n_ft * sizeof *ucc2);
    }
    memset(w, 0, sizeof *w);
    w->tau_buf = keep;
    w->key_buf = keys;
    w->ucc2_buf = ucc2;
    w->dev = dev;
}

// Allocates w's buffers on dev as z sizes them (lm_eng_ws_size), for the FTs among `parts`
// (every FT when parts is NULL). Device memory running out is LM_ERR_DEVICE_OOM, with what is
// already taken still in w for ws_release.
static lm_status ws_alloc(engine *e, wset *w, lm_dev *dev, const ws_size *z, const part *parts, int k)
{
    w->dev = dev;
    w->cap = z->cap;
    w->cap_cols = z->ucc2_cols;
    size_t bytes = (size_t)z->cap * sizeof(float);
    lm_status s = lm_dev_alloc(dev, bytes, (void **)&w->base_buf, e->err);
    for (int i = 0; s == LM_OK && i < (parts ? k : e->o->n_ft); i++)
        s = lm_dev_alloc(dev, bytes, (void **)&w->tau_buf[parts ? parts[i].ft : i], e->err);
    // sparsegpt: an importance buffer for each part with a Hessian (each FT on the CPU), and on
    // an accelerator a copy of its U_cc²
    for (int i = 0; s == LM_OK && w->key_buf && i < (parts ? k : e->o->n_ft); i++) {
        int ft = parts ? parts[i].ft : i;
        if (parts && !parts[i].ucc2)
            continue;
        s = lm_dev_alloc(dev, bytes, (void **)&w->key_buf[ft], e->err);
        if (s == LM_OK && parts && !lm_dev_host_memory(dev))
            s = lm_dev_alloc(dev, (size_t)w->cap_cols * sizeof(double), (void **)&w->ucc2_buf[ft], e->err);
    }
    // sce's variances where a mask reads them (select_topk < 1): the tensor's, as lm_eng_ws_size's
    // extra_bytes; the CPU's set, kept for the whole run, for any tensor (untouched pages in host
    // memory where none is masked)
    if (s == LM_OK && e->m->sce && (!parts || e->tp.select_topk < 1))
        s = lm_dev_alloc(dev, bytes, (void **)&w->var_buf, e->err);
    if (s == LM_OK && !lm_dev_host_memory(dev))
        s = lm_dev_alloc(dev, z->stage_bytes, &w->stage_dev, e->err);
    if (s == LM_OK && !lm_dev_host_memory(dev))
        s = lm_dev_alloc(dev, z->out_bytes, &w->out_dev, e->err);
    w->stage_bytes = z->stage_bytes;
    return s;
}

// The CPU's buffers, made when first needed: at the start on the CPU, at the first fallback
// (or LoRA product made on the CPU) on an accelerator.
lm_status lm_eng_cpu_ready(engine *e)
{
    if (e->cpu_ws.base_buf)
        return LM_OK;
    ws_size z = {.cap = e->slab_max};  // every FT's buffers, for any tensor's slab
    lm_status s = ws_alloc(e, &e->cpu_ws, e->cpu, &z, NULL, 0);
    if (s != LM_OK)
        ws_release(e, &e->cpu_ws);
    return s;
}

static void mark(const engine *e, unit_mark *m)
{
    m->bytes_in = e->bytes_in;
    m->bytes_out = e->bytes_out;
    for (int i = 0; e->global && i < e->o->n_ft; i++)
        m->ties[i] = e->global[i].ties_allowed;
}

static void rewind_to(engine *e, const unit_mark *m)
{
    e->bytes_in = m->bytes_in;
    e->bytes_out = m->bytes_out;
    for (int i = 0; e->global && i < e->o->n_ft; i++)
        e->global[i].ties_allowed = m->ties[i];
}

// Points the parts' buffers at ws's, and on an accelerator copies each
// part's U_cc² there (sparsegpt).
static lm_status bind(engine *e, wset *ws, part *parts, int k)
{
    lm_status s = LM_OK;
    for (int i = 0; i < k; i++) {
        part *p = &parts[i];
        p->tau = ws->tau_buf[p->ft];
        p->key = p->ucc2 ? ws->key_buf[p->ft] : NULL;
        p->ucc2_dev = lm_dev_host_memory(ws->dev) ? p->ucc2 : p->ucc2 ? ws->ucc2_buf[p->ft] : NULL;
        if (p->ucc2 && !lm_dev_host_memory(ws->dev) && s == LM_OK) {
            size_t bytes = (size_t)ws->cap_cols * sizeof(double);
            e->res->bytes_to_device += bytes;
            s = lm_dev_upload(ws->dev, (void *)p->ucc2_dev, p->ucc2, bytes, e->err);
        }
    }
    return s;
}

// Tries unit u on the accelerator with a working set of its own (e->dev_ws, that tensor's
// slab), freed when the try ends.
static lm_status unit_try(engine *e, unit *u)
{
    const lm_st_tensor *bt = e->base->tensors[u->idx];
    wset *ws = &e->dev_ws;
    ws_size z;
    lm_eng_ws_size(e, e->dev, bt, u->parts, u->k, &z);
    lm_status s = ws_alloc(e, ws, e->dev, &z, u->parts, u->k);
    if (s == LM_OK)
        s = bind(e, ws, u->parts, u->k);
    if (s == LM_OK)
        s = u->work(e, u, ws);
    ws_release(e, ws);
    return s;
}

// Runs unit u on the CPU with the CPU's working set (e->cpu_ws, kept for the whole run).
static lm_status unit_redo(engine *e, unit *u)
{
    lm_status s = lm_eng_cpu_ready(e);
    if (s == LM_OK)
        s = bind(e, &e->cpu_ws, u->parts, u->k);
    return s != LM_OK ? s : u->work(e, u, &e->cpu_ws);
}

// A unit as lm_fallback_run drives it: the engine, the unit and the engine's counts as they
// were before the try.
typedef struct unit_run {
    engine *e;
    unit *u;
    unit_mark *m;
} unit_run;

static lm_status unit_work(void *ctx, lm_dev *dev, lm_err *err)
{
    (void)err;  // the engine's own, e->err
    unit_run *r = ctx;
    return dev == r->e->cpu ? unit_redo(r->e, r->u) : unit_try(r->e, r->u);
}

// Undoes a try that ran out of device memory: the engine's counts back to the mark, the unit's
// own state through u->undo, and the fallback counted.
static void unit_undo(void *ctx)
{
    unit_run *r = ctx;
    rewind_to(r->e, r->m);
    if (r->u->undo)
        r->u->undo(r->u);
    if (strcmp(r->u->phase, "merge") == 0)
        r->e->res->fallback_merge++;
    else
        r->e->res->fallback_select++;
}

// Runs unit u through lm_fallback_run: on an accelerator, tried there first and, when the
// device runs out of memory, undone and redone from the start on the CPU; on the CPU device,
// there. Any other failure stops. *on_device says whether it ran on the accelerator.
lm_status lm_eng_run_unit(engine *e, unit *u, bool *on_device)
{
    *on_device = false;
    if (e->dev == e->cpu)
        return unit_redo(e, u);
    unit_mark *m = malloc(sizeof *m + (size_t)e->o->n_ft * sizeof(int64_t));
    if (!m)
        return lm_err_set(e->err, LM_ERR_NOMEM, "out of memory");
    mark(e, m);
    unit_run r = {e, u, m};
    lm_fallback_unit fu = {.phase = u->phase, .unit = e->base->tensors[u->idx]->name, .work = unit_work,
                           .undo = unit_undo, .ctx = &r, .say = e->hooks ? e->hooks->fallback : NULL,
                           .say_ctx = e->hooks ? e->hooks->ctx : NULL};
    lm_status s = lm_fallback_run(&fu, e->dev, e->cpu, e->err);
    free(m);
    *on_device = s == LM_OK && !fu.fell_back;
    e->res->fallback_s += fu.seconds;
    return s;
}

typedef struct merge_ctx {
    const lm_st_desc *desc;
    XXH64_state_t *hash;
} merge_ctx;

static lm_status merge_work(engine *e, unit *u, wset *ws)
{
    merge_ctx *c = u->ctx;
    count_reset(e);  // a redo on the CPU counts from the start
    return lm_eng_merge_tensor(e, ws, u->idx, c->desc, c->hash, u->parts, u->k);
}

// Records the NaN and Inf counted in tensor bt's inputs and output (res->nonfinite).
static lm_status note_counts(engine *e, const lm_st_tensor *bt, const part *parts, int k)
{
    lm_status s = note_nonfinite(e, 0, bt->name, &e->in[0]);
    for (int i = 0; s == LM_OK && i < k; i++)
        if (parts[i].src == SRC_FULL)
            s = note_nonfinite(e, 1 + parts[i].ft, parts[i].full->name, &e->in[1 + parts[i].ft]);
    return s != LM_OK ? s : note_nonfinite(e, -1, bt->name, &e->out);
}

static void merge_undo(unit *u)
{
    XXH64_reset(((merge_ctx *)u->ctx)->hash, 0);
}

// Fills tp with tensor `name`'s parameters: the options', then o->tensor_params' changes,
// checked as lm_merge_check_opts checks the options.
static lm_status params_of(const lm_merge_opts *o, const lm_method *m, const char *name, lm_tensor_params *tp,
                           lm_err *err)
{
    for (int i = 0; i < o->n_ft; i++) {
        tp->weights[i] = o->weights[i];
        tp->densities[i] = o->densities ? o->densities[i] : 1.0;
        tp->gammas[i] = o->gammas ? o->gammas[i] : 0.01;
        tp->epsilons[i] = o->epsilons ? o->epsilons[i] : lm_method_epsilon(m);
    }
    tp->base_weight = o->base_weight;
    tp->lambda = o->lambda;
    tp->t = o->t;
    tp->select_topk = o->select_topk;
    if (!o->tensor_params)
        return LM_OK;
    lm_status s = o->tensor_params(o->params_ctx, name, tp, err);
    if (s != LM_OK)
        return s;
    for (int i = 0; i < o->n_ft; i++) {
        char ft[32];  // (the FT's name, made only for a message)
        if (!isfinite(tp->weights[i]))
            return lm_err_set(err, LM_ERR_USAGE, "weight of %s is %g in tensor '%s', not a finite number",
                              ft_label(o, i, ft, sizeof ft), tp->weights[i], name);
        if (m->density && !(tp->densities[i] > 0 && tp->densities[i] <= 1))
            return lm_err_set(err, LM_ERR_USAGE, "density of %s is %g in tensor '%s', not in (0, 1]",
                              ft_label(o, i, ft, sizeof ft), tp->densities[i], name);
        double d = tp->densities[i], eps = tp->epsilons[i];
        if (m->della && d < 1 && !(eps >= 0 && d - eps > 0 && d + eps < 1))
            return lm_err_set(err, LM_ERR_USAGE,
                              "epsilon of %s is %g in tensor '%s' with density %g: density - epsilon and "
                              "density + epsilon must lie in (0, 1)",
                              ft_label(o, i, ft, sizeof ft), eps, name, d);
        if (m->threshold && !(eps >= 0 && isfinite(eps)))
            return lm_err_set(err, LM_ERR_USAGE, "epsilon of %s is %g in tensor '%s', not a finite number of 0 "
                              "or more", ft_label(o, i, ft, sizeof ft), eps, name);
        if (m->outliers && !(tp->gammas[i] >= 0 && tp->gammas[i] <= 1))
            return lm_err_set(err, LM_ERR_USAGE, "gamma of %s is %g in tensor '%s', not in [0, 1]",
                              ft_label(o, i, ft, sizeof ft), tp->gammas[i], name);
    }
    if (!isfinite(tp->base_weight) || !isfinite(tp->lambda) || !isfinite(tp->t) || !isfinite(tp->select_topk))
        return lm_err_set(err, LM_ERR_USAGE, "a weight, lambda or t of tensor '%s' is not a finite number", name);
    return LM_OK;
}

double lm_eng_tensor_select_topk(const lm_merge_opts *o, const char *name)
{
    if (!o->tensor_params)
        return o->select_topk;
    int n = o->n_ft > 0 ? o->n_ft : 1;
    double v[4 * n];
    lm_tensor_params tp = {.weights = v, .densities = v + n, .gammas = v + 2 * n, .epsilons = v + 3 * n};
    lm_err err;
    return params_of(o, lm_method_of(o->method), name, &tp, &err) == LM_OK ? tp.select_topk : o->select_topk;
}

static lm_status tensor_params(engine *e, const char *name)
{
    return params_of(e->o, e->m, name, &e->tp, e->err);
}

lm_status lm_merge_linear_coefs(const lm_merge_opts *o, lm_ft *const *fts, const char *name, double *a, double *c,
                                lm_err *err)
{
    const lm_method *m = lm_method_of(o->method);
    if (o->method != LM_MERGE_TASK_ARITHMETIC && o->method != LM_MERGE_LINEAR)
        return lm_err_set(err, LM_ERR_UNSUPPORTED, "%s has no fixed coefficients per tensor", m->name);
    size_t n = (size_t)(o->n_ft > 0 ? o->n_ft : 1);
    double *v = calloc(4 * n, sizeof *v);
    bool *touch = calloc(n, sizeof *touch);
    lm_status s = v && touch ? LM_OK : lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    lm_tensor_params tp = {.weights = v, .densities = v + n, .gammas = v + 2 * n, .epsilons = v + 3 * n};
    if (s == LM_OK)
        s = params_of(o, m, name, &tp, err);
    for (int i = 0; s == LM_OK && i < o->n_ft; i++)
        touch[i] = fts[i]->adapter ? lm_adapter_lookup(fts[i]->adapter, name, NULL) != LM_TOUCH_NONE
                                   : fts[i]->model && lm_model_find(fts[i]->model, name);
    if (s == LM_OK && o->method == LM_MERGE_TASK_ARITHMETIC) {
        // the engine's task_arithmetic_coef, over the FTs that change the tensor
        double div = 0;
        for (int i = 0; i < o->n_ft; i++)
            div += touch[i] ? tp.weights[i] : 0;
        if (!o->normalize || div == 0)
            div = 1;
        *a = 1;
        for (int i = 0; i < o->n_ft; i++)
            c[i] = touch[i] ? (double)(float)(tp.lambda * tp.weights[i] / div) : 0;
    } else if (s == LM_OK) {
        // linear's own: an adapter holds every tensor, a full model the ones it has
        for (int i = 0; i < o->n_ft; i++)
            touch[i] = fts[i]->adapter || touch[i];
        lm_coef_in in = {.o = o, .tp = &tp, .tensor = name, .n = o->n_ft, .present = touch};
        s = m->coeffs(&in, a, c, err);
    }
    free(v);
    free(touch);
    return s;
}

// Whether the method may scale a tensor no FT changes (merge_unit asks its coefficients then):
// the methods with coefficients, but the interpolations of task vectors against a base, whose
// vectors are all zero there.
static bool scales_untouched(const lm_merge_opts *o, const lm_method *m)
{
    return m->coeffs && !(m->input == LM_METHOD_EITHER && !o->models_only);
}

// Whether any FT changes tensor `name` (a full model holding it readable, an adapter touching it).
static bool touched(const lm_merge_opts *o, lm_ft *const *fts, const char *name)
{
    for (int i = 0; i < o->n_ft; i++) {
        const lm_st_tensor *t = fts[i]->model ? lm_model_find(fts[i]->model, name) : NULL;
        if ((t && lm_dtype_readable(t->dtype)) ||
            (fts[i]->adapter && lm_adapter_lookup(fts[i]->adapter, name, NULL) != LM_TOUCH_NONE))
            return true;
    }
    return false;
}

lm_status lm_merge_check_params(const lm_merge_opts *o, const lm_model *base, lm_ft *const *fts, lm_err *err)
{
    // linear's normalised weights must not sum to 0 in any tensor (the models that hold it):
    // found here rather than at that tensor's turn
    bool linear = o->method == LM_MERGE_LINEAR && o->normalize && fts;
    if (!o->tensor_params && !linear)
        return LM_OK;
    const lm_method *m = lm_method_of(o->method);
    size_t n = (size_t)(o->n_ft > 0 ? o->n_ft : 1);
    double *v = calloc(5 * n, sizeof *v), a;
    if (!v)
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    lm_tensor_params tp = {.weights = v, .densities = v + n, .gammas = v + 2 * n, .epsilons = v + 3 * n};
    lm_status s = LM_OK;
    for (int64_t i = 0; s == LM_OK && i < base->n_tensors; i++) {
        const char *name = base->tensors[i]->name;
        // a tensor copied as it is reads no parameter (merge_unit)
        if (fts && !scales_untouched(o, m) && !touched(o, fts, name))
            continue;
        s = params_of(o, m, name, &tp, err);
        if (s == LM_OK && linear && lm_dtype_readable(base->tensors[i]->dtype) && base->tensors[i]->numel > 0)
            s = lm_merge_linear_coefs(o, fts, name, &a, v + 4 * n, err);
    }
    free(v);
    return s;
}

// One output tensor: merged where its FTs change it, else the base's values converted (on the
// CPU: a copy gains nothing from an accelerator). A method with coefficients may scale even a
// tensor no FT changes, which then runs as a merge: linear with unnormalised weights, and
// multislerp of the models themselves without normalize_weights ((Σ w_j)·θ_b, every x_j being
// θ_b). A method with a Gram matrix is asked about such a tensor with θ_b·θ_b = 1 (every τ zero):
// for equal vectors its coefficients follow from the weights, whatever their norm (but for norms
// below the methods' guards, 1e-8 to --tol, where the base is kept); the merge then computes them
// from the tensor's own Gram matrix. Task vectors against a base (nuslerp, multislerp with a
// base) are all zero here and leave θ_b's coefficient at 1 (lm_coef_from_vectors): not asked,
// since multislerp would call three zero vectors antipodal.
static lm_status merge_unit(engine *e, int64_t idx, const lm_st_desc *desc, XXH64_state_t *hash, bool *merged)
{
    const lm_st_tensor *bt = e->base->tensors[idx];
    part parts[e->o->n_ft > 0 ? e->o->n_ft : 1];
    int k = lm_dtype_readable(bt->dtype) ? lm_eng_find_parts(e, bt->name, parts) : 0;
    *merged = k > 0;
    lm_status s;
    count_reset(e);
    // a tensor no FT changes reads its parameters only where the method may scale it
    if ((k > 0 || scales_untouched(e->o, e->m)) && (s = tensor_params(e, bt->name)) != LM_OK)
        return s;
    // A magnitude trim that keeps nothing of a part (floor(d_i · numel) = 0) leaves its task
    // vector out of this tensor where mergekit's magnitude trim stops: counted, for the caller to
    // say. (--topk global picks each FT's k over its tensors as a whole.)
    int empty_ft = -1;
    for (int i = 0; i < k && e->m->rank != LM_RANK_NONE && !e->o->topk_global && bt->numel > 0 && empty_ft < 0; i++)
        if (floor(e->tp.densities[parts[i].ft] * (double)bt->numel) == 0)
            empty_ft = parts[i].ft;
    if (empty_ft >= 0 && e->res->empty_trims++ == 0) {
        if (!(e->res->empty_trim_tensor = lm_strdup(bt->name)))
            return lm_err_set(e->err, LM_ERR_NOMEM, "out of memory");
        e->res->empty_trim_ft = empty_ft;
    }
    bool scaled = false;
    if (k == 0 && scales_untouched(e->o, e->m) && lm_dtype_readable(bt->dtype) && bt->numel > 0) {
        size_t s1 = (size_t)e->o->n_ft + 1;
        double a = 1.0, *c = calloc((size_t)e->o->n_ft, sizeof *c);
        double *g = e->m->gram ? calloc(s1 * s1, sizeof *g) : NULL;
        bool *present = calloc((size_t)e->o->n_ft, sizeof *present);
        if (!c || !present || (e->m->gram && !g)) {
            free(c);
            free(g);
            free(present);
            return lm_err_set(e->err, LM_ERR_NOMEM, "out of memory");
        }
        if (g)
            g[0] = 1.0;
        for (int i = 0; i < e->o->n_ft; i++)
            present[i] = e->fts[i]->adapter || lm_model_find(e->fts[i]->model, bt->name);
        lm_coef_in in = {.o = e->o, .tp = &e->tp, .tensor = bt->name, .numel = bt->numel, .n = e->o->n_ft,
                         .present = present, .gram = g};
        s = e->m->coeffs(&in, &a, c, e->err);
        free(c);
        free(g);
        free(present);
        if (s != LM_OK)
            return s;
        scaled = (float)a != 1.0f;
    }
    if ((k == 0 && !scaled) || bt->numel == 0) {
        if (e->hooks && e->hooks->put)  // the caller's output has nothing of a tensor that does not change
            return note_counts(e, bt, parts, 0);
        if ((s = lm_eng_cpu_ready(e)) != LM_OK || (s = lm_eng_copy_tensor(e, &e->cpu_ws, idx, bt, desc->dtype,
                                                                          hash)) != LM_OK)
            return s;
        return note_counts(e, bt, parts, 0);
    }
    // the masks the trim selects, recorded for o->mask_store (a redo on the CPU rewrites them)
    s = LM_OK;
    for (int i = 0; i < k && e->m->rank != LM_RANK_NONE && e->o->mask_store; i++)
        if (!parts[i].mask && !(parts[i].bits = malloc(lm_dev_mask_bytes(bt->numel)))) {
            s = lm_err_set(e->err, LM_ERR_NOMEM, "out of memory for the mask of '%s'", bt->name);
            break;
        }
    merge_ctx c = {desc, hash};
    unit u = {"merge", idx, parts, k, merge_work, merge_undo, &c};
    *merged = true;
    bool on_device = false;
    if (s == LM_OK)
        s = lm_eng_run_unit(e, &u, &on_device);
    for (int i = 0; s == LM_OK && i < k; i++)
        if (parts[i].bits)
            s = e->o->mask_store(e->o->mask_ctx, parts[i].ft, bt->name, parts[i].bits, bt->numel, e->err);
    for (int i = 0; i < k; i++)
        free(parts[i].bits);
    if (s == LM_OK)
        s = note_counts(e, bt, parts, k);
    if (s == LM_OK && on_device)
        e->res->tensors_on_device++;
    else if (s == LM_OK)
        e->res->tensors_on_cpu++;
    return s;
}

// ==== the run =================================================================================

static void engine_free(engine *e)
{
    ws_release(e, &e->dev_ws);
    ws_release(e, &e->cpu_ws);
    free(e->dev_ws.tau_buf);
    free(e->cpu_ws.tau_buf);
    free(e->dev_ws.key_buf);
    free(e->cpu_ws.key_buf);
    free(e->dev_ws.ucc2_buf);
    free(e->cpu_ws.ucc2_buf);
    free(e->out_host);
    free(e->out_slab);
    for (int i = 0; e->keep_bits && i < e->o->n_ft; i++) {
        free(e->keep_bits[i]);
        free(e->keep_off[i]);
        free(e->keep_vals[i]);
    }
    free(e->keep_bits);
    free(e->keep_off);
    free(e->keep_vals);
    free(e->keep_caps);
    for (int i = 0; e->res_dev && i < e->o->n_ft; i++)
        lm_dev_buf_free(e->dev, e->res_dev[i].data);
    for (int i = 0; e->res_cpu && i < e->o->n_ft; i++) {
        lm_dev_buf_free(e->cpu, e->res_cpu[i].data);
        free(e->res_cpu[i].a_off);
        free(e->res_cpu[i].b_off);
    }
    free(e->res_dev);
    free(e->res_cpu);
    free(e->global);
    free(e->sel_block);
    free(e->sample);
    free(e->counted);
    free(e->in);
    free(e->tp.weights);
    free(e->tp.densities);
    free(e->tp.gammas);
    free(e->tp.epsilons);
    free(e->coef);
}

lm_status lm_merge_run(const lm_merge_opts *o, lm_dev *dev, const lm_model *base,
                       lm_ft *const *fts, lm_st_writer *w, const lm_merge_hooks *hooks,
                       lm_merge_result *res, lm_err *err)
{
    memset(res, 0, sizeof *res);
    lm_status s = lm_merge_check_opts(o, err);
    if (s == LM_OK)
        s = lm_merge_check_params(o, base, fts, err);
    if (s != LM_OK)
        return s;
    double t0 = lm_now();
    engine e = {.o = o, .m = lm_method_of(o->method), .dev = dev, .cpu = dev, .base = base, .fts = fts, .w = w,
                .hooks = hooks, .err = err, .res = res};
    e.page = sysconf(_SC_PAGESIZE) > 0 ? sysconf(_SC_PAGESIZE) : 4096;
    e.slab_elems = o->slab_elems > 0 ? o->slab_elems : LARGE_SLAB_ELEMS;
    e.slab_dense = o->slab_elems > 0 ? o->slab_elems : DENSE_SLAB_ELEMS;
    e.slab_max = lm_eng_largest_slab(base, e.slab_elems);
    // An accelerator has a CPU beside it for the units that do not fit (the CPU's is itself).
    if ((s = lm_dev_cpu_companion(dev, &e.cpu, err)) != LM_OK) {
        e.cpu = dev;
        return s;
    }
    e.cpu_ws.dev = e.cpu;
    e.dev_ws.dev = e.dev;

    res->n_tensors = base->n_tensors;
    res->tensor_xxh64 = calloc((size_t)(base->n_tensors ? base->n_tensors : 1), sizeof *res->tensor_xxh64);
    e.cpu_ws.tau_buf = calloc((size_t)o->n_ft, sizeof(float *));
    e.dev_ws.tau_buf = calloc((size_t)o->n_ft, sizeof(float *));
    bool sparsegpt = e.m->rank == LM_RANK_IMPORTANCE;
    if (sparsegpt) {
        e.cpu_ws.key_buf = calloc((size_t)o->n_ft, sizeof(float *));
        e.dev_ws.key_buf = calloc((size_t)o->n_ft, sizeof(float *));
        e.cpu_ws.ucc2_buf = calloc((size_t)o->n_ft, sizeof(double *));
        e.dev_ws.ucc2_buf = calloc((size_t)o->n_ft, sizeof(double *));
    }
    e.res_cpu = calloc((size_t)o->n_ft, sizeof *e.res_cpu);
    e.res_dev = calloc((size_t)o->n_ft, sizeof *e.res_dev);
    e.counted = calloc((size_t)o->n_ft + 1, sizeof *e.counted);
    e.in = calloc((size_t)o->n_ft + 1, sizeof *e.in);
    e.out_host = malloc(lm_eng_out_host_bytes());  // merge_pieces fills one half while the other is written
    e.tp.weights = calloc((size_t)o->n_ft, sizeof *e.tp.weights);
    e.tp.densities = calloc((size_t)o->n_ft, sizeof *e.tp.densities);
    e.tp.gammas = calloc((size_t)o->n_ft, sizeof *e.tp.gammas);
    e.tp.epsilons = calloc((size_t)o->n_ft, sizeof *e.tp.epsilons);
    e.coef = calloc((size_t)o->n_ft, sizeof *e.coef);
    if (o->topk_global && e.m->rank != LM_RANK_NONE)
        e.global = calloc((size_t)o->n_ft, sizeof *e.global);
    XXH64_state_t *hash = XXH64_createState();
    if (!res->tensor_xxh64 || !e.cpu_ws.tau_buf || !e.dev_ws.tau_buf || !e.res_cpu || !e.res_dev || !e.out_host ||
        !e.counted || !e.in || !e.tp.weights || !e.tp.densities || !e.tp.gammas || !e.tp.epsilons || !e.coef ||
        !hash || (o->topk_global && e.m->rank != LM_RANK_NONE && !e.global) ||
        (sparsegpt && (!e.cpu_ws.key_buf || !e.dev_ws.key_buf || !e.cpu_ws.ucc2_buf || !e.dev_ws.ucc2_buf))) {
        s = lm_err_set(err, LM_ERR_NOMEM, "out of memory");
        goto fail;
    }
    if (lm_dev_host_memory(dev) && (s = lm_eng_cpu_ready(&e)) != LM_OK)
        goto fail;
    if ((s = place_residents(&e)) != LM_OK)
        goto fail;
    if (e.global && (s = lm_eng_select_global(&e, base->n_tensors)) != LM_OK)
        goto fail;
    e.counting = true;  // from here each tensor's own passes

    lm_st_desc *descs = NULL;
    int64_t n_out = 0;
    if ((s = lm_merge_outputs(o, base, &descs, &n_out, err)) != LM_OK)
        goto fail;
    uint64_t bytes_total = 0;
    for (int64_t i = 0; i < n_out; i++)
        bytes_total += (uint64_t)base->tensors[i]->numel * esize(descs[i].dtype);
    for (int64_t i = 0; i < n_out; i++) {
        const lm_st_tensor *bt = base->tensors[i];
        bool merged = false;
        // SIGINT/SIGTERM (signals.h): stop between tensors; the caller removes the output.
        if (lm_interrupted()) {
            s = lm_interrupted_err(err);
            break;
        }
        XXH64_reset(hash, 0);
        s = merge_unit(&e, i, &descs[i], hash, &merged);
        if (s != LM_OK) {
            lm_err_prefix(err, "merging tensor '%s'", bt->name);
            break;
        }
        res->tensor_xxh64[i] = XXH64_digest(hash);
        if (merged)
            res->n_merged++;
        else
            res->n_copied++;
        // Done with this tensor's input pages: let them go from our memory.
        lm_eng_release_pages(&e, bt);
        for (int f = 0; f < o->n_ft; f++)
            if (fts[f]->model)
                lm_eng_release_pages(&e, lm_model_find(fts[f]->model, bt->name));
        if (hooks && hooks->tensor_done && (s = hooks->tensor_done(hooks->ctx, i, err)) != LM_OK) {
            lm_err_prefix(err, "tensor '%s'", bt->name);
            break;
        }
        if (hooks && hooks->progress)
            hooks->progress(hooks->ctx, i + 1, n_out, bt->name, e.bytes_out, bytes_total);
    }
    free(descs);
    if (s != LM_OK)
        goto fail;
    res->bytes_in = e.bytes_in;
    res->bytes_out = e.bytes_out;
    res->seconds = lm_now() - t0;
    XXH64_freeState(hash);
    engine_free(&e);
    // The run's end: a failure of the releases just made, or one the device kept, fails the run.
    if ((s = lm_dev_check(dev, err)) != LM_OK) {
        lm_err_prefix(err, "ending the merge on %s", lm_dev_name(dev));
        lm_merge_result_free(res);
        return s;
    }
    return LM_OK;
fail:
    if (hash)
        XXH64_freeState(hash);
    engine_free(&e);
    lm_merge_result_free(res);
    return s;
}
