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
// (run_unit); the CPU's buffers are the engine's for the whole run.
#include "merge.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>
#include <xxhash.h>

#include "merge_desc.h"
#include "signals.h"
#include "sparsify.h"
#include "util.h"

// Slabs. Large ones hold the whole of all but the largest tensors, so τ is computed once and
// kept across the passes; that suits LoRA parts (a GEMM each time) and accelerators (few
// transfers and launches). On the CPU a tensor of dense parts only goes in smaller slabs whose
// buffers stay in the processor's cache from one operation to the next: each pass computes τ
// again from the 16-bit inputs, which moves fewer bytes than keeping float32 τ in memory.
#define LARGE_SLAB_ELEMS (16ll << 20)   // 64 MiB of float32 per buffer
#define DENSE_SLAB_ELEMS (4ll << 20)    // 16 MiB
#define KEEP_MAPPED_BYTES (256ull << 20)  // inputs of one tensor kept mapped across its passes
#define OUT_PIECE (1u << 20)              // bytes of output converted, hashed and written at once

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

// ==== names and options =======================================================================

const char *lm_merge_method_name(lm_merge_method m)
{
    switch (m) {
    case LM_MERGE_TIES: return "ties";
    case LM_MERGE_DARE: return "dare";
    case LM_MERGE_DARE_TIES: return "dare-ties";
    case LM_MERGE_TASK_ARITHMETIC: return "task-arithmetic";
    case LM_MERGE_SPARSEGPT: return "sparsegpt";
    }
    return "?";
}

bool lm_merge_default_normalize(lm_merge_method m)
{
    return m == LM_MERGE_TIES || m == LM_MERGE_SPARSEGPT;
}

static bool uses_density(lm_merge_method m)
{
    return m != LM_MERGE_TASK_ARITHMETIC;
}

// Top-k selection: by magnitude (ties), or by importance where there is a Hessian (sparsegpt).
static bool uses_magnitude(lm_merge_method m)
{
    return m == LM_MERGE_TIES || m == LM_MERGE_SPARSEGPT;
}

static bool uses_random(lm_merge_method m)
{
    return m == LM_MERGE_DARE || m == LM_MERGE_DARE_TIES;
}

static bool uses_election(lm_merge_method m)
{
    return m == LM_MERGE_TIES || m == LM_MERGE_DARE_TIES || m == LM_MERGE_SPARSEGPT;
}

lm_status lm_merge_check_opts(const lm_merge_opts *o, lm_err *err)
{
    if (o->n_ft < 1)
        return lm_err_set(err, LM_ERR_USAGE, "at least one fine-tuned model or adapter is needed");
    if (!o->weights)
        return lm_err_set(err, LM_ERR_USAGE, "--weights: %d weights are needed, one per fine-tuned input", o->n_ft);
    if (!o->densities && uses_density(o->method))
        return lm_err_set(err, LM_ERR_USAGE, "--density: %d densities are needed, one per fine-tuned input",
                          o->n_ft);
    for (int i = 0; i < o->n_ft; i++) {
        if (!isfinite(o->weights[i]))
            return lm_err_set(err, LM_ERR_USAGE, "--weights: weight %d is %g, not a finite number", i + 1,
                              o->weights[i]);
        if (uses_density(o->method) && !(o->densities[i] > 0 && o->densities[i] <= 1))
            return lm_err_set(err, LM_ERR_USAGE, "--density: density %d is %g, not in (0, 1]", i + 1,
                              o->densities[i]);
    }
    if (!isfinite(o->lambda))
        return lm_err_set(err, LM_ERR_USAGE, "--lambda %g is not a finite number", o->lambda);
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
        if ((s = lm_model_open(&ft->model, ft->path, err)) != LM_OK)
            goto fail;
        if ((s = lm_model_compare(ft->model, base, NULL, err)) != LM_OK ||
            (s = check_dtypes(ft, base, err)) != LM_OK)
            goto fail;
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

// ==== the engine's state ======================================================================

typedef enum src_kind { SRC_FULL, SRC_LORA, SRC_LORA_BIAS } src_kind;

// One FT's share of one tensor.
typedef struct part {
    int ft;                       // index among the FTs (and weights, densities)
    src_kind src;
    const lm_st_tensor *full;     // SRC_FULL: the FT's tensor (a full model's, or a saved one)
    const lm_lora_module *mod;    // SRC_LORA, SRC_LORA_BIAS
    int64_t mod_index;
    float *tau;                   // device slab buffer
    float *key;                   // sparsegpt: the importance of tau's entries (device), or NULL
    const double *ucc2;           // sparsegpt: U_cc² of the tensor's Hessian (host), or NULL
    const double *ucc2_dev;       // the same where the unit runs
    lm_topk topk;                 // per-tensor threshold (magnitude, --topk tensor)
    double rescale;               // factor applied to kept entries
    bool dropped;                 // tau (kept whole) already has its random mask applied
    bool keeps;                   // a fused LoRA part whose selection pass keeps its candidates for
                                  // the merge (after selection: and they hold all it keeps)
    const uint8_t *mask;          // a stored top-k mask (o->mask_load, host bitmap), or NULL
    uint8_t *bits;                // the top-k mask being recorded for o->mask_store, or NULL
} part;

// An adapter's factors placed on a device once, as float32.
typedef struct resident {
    float *data;          // device buffer holding every module's A then B; NULL when not placed
    int64_t *a_off;       // (n_modules) element offsets of A in data
    int64_t *b_off;       // (n_modules) of B
} resident;

// One device's buffers for the tensor being merged, each `cap` elements of float32.
typedef struct wset {
    lm_dev *dev;
    int64_t cap;
    float *base_buf;
    float **tau_buf;      // (n_ft), NULL for FTs the tensor does not use (on an accelerator)
    void *stage_dev;      // raw input staging when the device cannot read host memory
    size_t stage_bytes;
    void *out_dev;        // output dtype staging on the device
    float *mag_buf;       // DoRA magnitude of the current tensor, [rows]
    int64_t mag_cap;
    float **key_buf;      // (n_ft) sparsegpt: importance buffers, like tau_buf
    double **ucc2_buf;    // (n_ft) on an accelerator: the parts' U_cc², cap_cols values
    int64_t cap_cols;
} wset;

typedef struct engine {
    const lm_merge_opts *o;
    lm_dev *dev;          // where units go first
    lm_dev *cpu;          // where they go when the device is out of memory (dev itself if the CPU)
    const lm_model *base;
    lm_ft *const *fts;
    lm_st_writer *w;
    const lm_merge_hooks *hooks;
    lm_err *err;
    int64_t slab_elems;   // elements per slab (LARGE_SLAB_ELEMS unless the options say)
    int64_t slab_dense;   // on the CPU, for tensors of dense parts only
    int64_t slab_max;
    wset cpu_ws;          // the CPU's buffers, kept for the whole run (slab_max elements)
    wset dev_ws;          // an accelerator's, allocated per tensor (that tensor's slab)
    wset *ws;             // the buffers of the unit now running
    unsigned char *out_host;  // 2 × OUT_PIECE bytes
    unsigned char *out_slab;  // a slab's output from an accelerator (slab_max float32), or NULL
    resident *res_cpu;    // (n_ft) every adapter's factors in host memory
    resident *res_dev;    // (n_ft) on an accelerator, data NULL where they did not fit
    // --topk global: per FT thresholds and the ties budget left
    lm_topk *global;      // (n_ft) or NULL
    uint64_t *sel_block;  // select_tensor's histograms, reused from tensor to tensor
    // fused LoRA parts' candidates from the selection pass (lm_dense_part's keep_bits and
    // keep_vals), per FT, for tensors of up to keep_caps elements
    uint16_t **keep_bits;
    int64_t **keep_off;
    float **keep_vals;
    int64_t *keep_caps;
    size_t sel_cells;
    uint64_t bytes_in, bytes_out;
    lm_merge_result *res;
    long page;
    // NaN and Inf of the tensor being merged (see first_read): in the base's values (in[0]), in
    // each FT's tensor (in[1 + ft]: a full model's, or an adapter's saved one) and in the output.
    // Off while --topk global selects, whose passes precede the tensors' own.
    bool counting;
    int64_t *counted;     // (1 + n_ft) elements of each input counted so far
    lm_nonfinite *in;     // (1 + n_ft)
    lm_nonfinite out;
} engine;

// Tells the kernel the pages of `t` may leave this process's memory: they stay in the page
// cache, and a later read faults them back in. Keeps RSS at the working set while whole models
// stream through.
static void release_bytes(const engine *e, const void *data, uint64_t nbytes);

static void release_pages(const engine *e, const lm_st_tensor *t)
{
    if (t)
        release_bytes(e, t->data, t->nbytes);
}

static void release_bytes(const engine *e, const void *data, uint64_t nbytes)
{
    if (!nbytes)
        return;
    uintptr_t lo = (uintptr_t)data & ~(uintptr_t)(e->page - 1);
    uintptr_t hi = ((uintptr_t)data + nbytes + (uintptr_t)e->page - 1) & ~(uintptr_t)(e->page - 1);
    madvise((void *)lo, hi - lo, MADV_DONTNEED);
}

static size_t esize(lm_dtype dt)
{
    return lm_dtype_bits(dt) / 8;
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
static lm_nonfinite *first_read(engine *e, int who, int64_t first, int64_t n)
{
    if (!e->counting || e->counted[who] != first)
        return NULL;
    e->counted[who] = first + n;
    return &e->in[who];
}

// Where the output's NaN and Inf go, or NULL while nothing is counted.
static lm_nonfinite *out_count(engine *e)
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

// Whether the device of the current unit counts while it converts (the CPU); elsewhere the
// engine counts on the host.
static bool dev_counts(const engine *e)
{
    return lm_dev_supports(e->ws->dev, LM_OP_COUNTS);
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
static lm_status stage(engine *e, const void *src, lm_dtype dt, int64_t n, lm_nonfinite *nf, const void **on_dev)
{
    e->bytes_in += (uint64_t)n * esize(dt);
    if (nf && !dev_counts(e))
        lm_count_nonfinite(src, dt, n, nf);
    if (lm_dev_host_memory(e->ws->dev)) {
        *on_dev = src;
        return LM_OK;
    }
    *on_dev = e->ws->stage_dev;
    e->res->bytes_to_device += (uint64_t)n * esize(dt);
    return lm_dev_upload(e->ws->dev, e->ws->stage_dev, src, (size_t)n * esize(dt), e->err);
}

// dst[0..n) = float32 of host data src (dtype dt), their NaN and Inf added to *nf when nf is not
// NULL.
static lm_status load_f32_nf(engine *e, float *dst, const void *src, lm_dtype dt, int64_t n, lm_nonfinite *nf)
{
    const void *in;
    lm_status s = stage(e, src, dt, n, nf, &in);
    if (s != LM_OK)
        return s;
    return nf && dev_counts(e) ? lm_dev_to_f32_count(e->ws->dev, dst, in, dt, n, nf, e->err)
                               : lm_dev_to_f32(e->ws->dev, dst, in, dt, n, e->err);
}

static lm_status load_f32(engine *e, float *dst, const void *src, lm_dtype dt, int64_t n)
{
    return load_f32_nf(e, dst, src, dt, n, NULL);
}

// ==== task vectors ============================================================================

static int64_t tensor_rows(const lm_st_tensor *t)
{
    return t->ndim >= 1 ? t->shape[0] : 1;
}

// load_f32 of rows [r0, r0 + rows) of base tensor bt into base_buf, counted as the base's read.
static lm_status load_base(engine *e, const lm_st_tensor *bt, int64_t r0, int64_t rows)
{
    int64_t cols = bt->numel / tensor_rows(bt), first = r0 * cols, cnt = rows * cols;
    return load_f32_nf(e, e->ws->base_buf, (const char *)bt->data + (size_t)first * esize(bt->dtype), bt->dtype, cnt,
                       first_read(e, 0, first, cnt));
}

static lm_status cpu_ready(engine *e);

// The factors of FT ft where the current unit runs: the CPU's copy on the CPU, the device's
// on the device, NULL when they did not fit there.
static const resident *resident_for(const engine *e, int ft)
{
    if (e->ws->dev == e->cpu)
        return &e->res_cpu[ft];
    return e->res_dev[ft].data ? &e->res_dev[ft] : NULL;
}

static lm_status gemm_factors(engine *e, lm_dev *dev, const resident *rs, const part *p, const lm_st_tensor *bt,
                              int64_t r0, int64_t rows, float alpha, float beta, float *dst)
{
    const lm_lora_module *m = p->mod;
    const float *a = rs->data + rs->a_off[p->mod_index];  // [r, in] or [r, vocab]
    const float *b = rs->data + rs->b_off[p->mod_index];  // [out, r] or [hidden, r]
    int64_t r = m->r, cols = bt->numel / tensor_rows(bt);
    if (!(m->kind == LM_LORA_EMBEDDING || e->fts[p->ft]->adapter->config.fan_in_fan_out))
        // base [out, in]: rows r0: of B @ A are B[r0:, :] @ A
        return lm_dev_gemm(dev, false, false, rows, cols, r, alpha, b + r0 * r, r, a, cols, beta, dst, cols, e->err);
    // base [in, out] (or [vocab, hidden]): (B @ A)ᵀ = Aᵀ Bᵀ, rows r0: of Aᵀ being columns r0: of A
    return lm_dev_gemm(dev, true, true, rows, cols, r, alpha, a + r0, tensor_rows(bt), b, r, beta, dst, cols, e->err);
}

// dst = alpha · (B @ A) + beta · dst for rows [r0, r0 + rows) of base tensor bt, from the
// factors of LoRA part p (transposed for embeddings and fan_in_fan_out). When they stayed on
// the CPU (they did not fit on the device), the product is made there, from the same values
// with the same GEMM as a CPU run, and the result copied to the device.
static lm_status lora_gemm(engine *e, const part *p, const lm_st_tensor *bt, int64_t r0, int64_t rows, float alpha,
                           float beta, float *dst)
{
    const resident *rs = resident_for(e, p->ft);
    if (rs)
        return gemm_factors(e, e->ws->dev, rs, p, bt, r0, rows, alpha, beta, dst);
    size_t bytes = (size_t)(rows * (bt->numel / tensor_rows(bt))) * sizeof(float);
    lm_status s = cpu_ready(e);
    if (s != LM_OK)
        return s;
    float *host = e->cpu_ws.tau_buf[p->ft];
    if (beta != 0.0f) {
        s = lm_dev_download(e->ws->dev, host, dst, bytes, e->err);
        e->res->bytes_from_device += bytes;
    }
    if (s == LM_OK)
        s = gemm_factors(e, e->cpu, &e->res_cpu[p->ft], p, bt, r0, rows, alpha, beta, host);
    e->res->bytes_to_device += bytes;
    return s != LM_OK ? s : lm_dev_upload(e->ws->dev, dst, host, bytes, e->err);
}

// Computes τ of part p for rows [r0, r0 + rows) of base tensor bt into p->tau; base_slab holds
// the base's float32 values of those rows.
static lm_status compute_tau(engine *e, part *p, const lm_st_tensor *bt, int64_t r0, int64_t rows,
                             const float *base_slab)
{
    int64_t cols = bt->numel / tensor_rows(bt), cnt = rows * cols;
    lm_status s;
    if (p->src == SRC_FULL) {
        const lm_st_tensor *t = p->full;
        const void *in;
        lm_nonfinite *nf = first_read(e, 1 + p->ft, r0 * cols, cnt);
        s = stage(e, (const char *)t->data + (size_t)(r0 * cols) * esize(t->dtype), t->dtype, cnt, nf, &in);
        if (s != LM_OK)
            return s;
        return nf && dev_counts(e) ? lm_dev_delta_count(e->ws->dev, p->tau, in, t->dtype, base_slab, cnt, nf, e->err)
                                   : lm_dev_delta(e->ws->dev, p->tau, in, t->dtype, base_slab, cnt, e->err);
    }
    const lm_lora_module *m = p->mod;
    float scale = (float)m->scale;
    if (p->src == SRC_LORA_BIAS) {
        s = load_f32(e, p->tau, (const char *)m->bias->data + (size_t)r0 * esize(m->bias->dtype), m->bias->dtype, cnt);
        return s != LM_OK ? s : lm_dev_axpby(e->ws->dev, p->tau, scale, p->tau, 0.0f, cnt, e->err);
    }
    s = lora_gemm(e, p, bt, r0, rows, scale, 0.0f, p->tau);
    if (s != LM_OK || !m->magnitude)
        return s;
    return lm_dev_dora_rows(e->ws->dev, p->tau, base_slab, e->ws->mag_buf + r0, rows, cols, e->err);
}

// Tells the caller a unit went to the CPU because the device was out of memory.
static void fell_back(engine *e, const char *phase, const char *unit, double seconds)
{
    if (e->hooks && e->hooks->fallback)
        e->hooks->fallback(e->hooks->ctx, phase, unit, lm_dev_name(e->dev), lm_dev_name(e->cpu), e->err->msg);
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
        e->ws = &e->cpu_ws;
        lm_status s = lm_dev_alloc(e->cpu, (size_t)total * sizeof(float), (void **)&rs->data, e->err);
        if (s != LM_OK)
            return lm_err_prefix(e->err, "%s: the LoRA factors", e->fts[i]->path);
        for (int64_t m = 0; m < a->n_modules; m++) {
            const lm_lora_module *mod = &a->modules[m];
            if (mod->a && (s = load_f32(e, rs->data + rs->a_off[m], mod->a->data, mod->a->dtype, mod->a->numel)) != LM_OK)
                return lm_err_prefix(e->err, "%s", mod->a->name);
            if (mod->b && (s = load_f32(e, rs->data + rs->b_off[m], mod->b->data, mod->b->dtype, mod->b->numel)) != LM_OK)
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
        double t0 = now();
        resident *rd = &e->res_dev[i];
        size_t bytes = (size_t)total * sizeof(float);
        s = lm_dev_alloc(e->dev, bytes, (void **)&rd->data, e->err);
        if (s == LM_OK) {
            s = lm_dev_upload(e->dev, rd->data, rs->data, bytes, e->err);
            e->res->bytes_to_device += bytes;
        }
        if (s == LM_OK) {
            e->res->ft_on_device++;
            rd->a_off = rs->a_off;  // the same layout; owned by res_cpu
            rd->b_off = rs->b_off;
            continue;
        }
        lm_dev_buf_free(e->dev, rd->data);
        rd->data = NULL;
        if (s != LM_ERR_DEVICE_OOM)
            return lm_err_prefix(e->err, "%s: placing the LoRA factors on %s", e->fts[i]->path, lm_dev_name(e->dev));
        e->res->fallback_place++;
        fell_back(e, "place", e->fts[i]->path, now() - t0);
    }
    return LM_OK;
}

// The parts of tensor `name`: every FT that changes it, in FT order.
static int find_parts(engine *e, const char *name, part *parts)
{
    int k = 0;
    for (int i = 0; i < e->o->n_ft; i++) {
        const lm_ft *ft = e->fts[i];
        part p = {.ft = i, .rescale = 1.0, .tau = e->ws->tau_buf[i]};
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
        if (uses_magnitude(e->o->method) && e->o->mask_load) {
            const lm_st_tensor *bt = lm_model_find(e->base, name);
            p.mask = bt ? e->o->mask_load(e->o->mask_ctx, i, name, bt->numel) : NULL;
        }
        if (e->o->method == LM_MERGE_SPARSEGPT && e->o->ucc2 && p.src != SRC_LORA_BIAS && !p.mask) {
            const lm_st_tensor *bt = lm_model_find(e->base, name);
            int64_t rows = bt ? tensor_rows(bt) : 0;
            if (bt && rows > 0 && bt->ndim == 2)
                p.ucc2 = e->o->ucc2(e->o->ucc2_ctx, i, name, bt->numel / rows);
        }
        parts[k++] = p;
    }
    return k;
}

// Loads the DoRA magnitudes any part of this tensor needs into mag_buf (one adapter at a time
// is enough: parts are computed one after another, so each loads its own before use).
static lm_status load_magnitude(engine *e, const part *p)
{
    if (p->src != SRC_LORA || !p->mod->magnitude)
        return LM_OK;
    const lm_st_tensor *mt = p->mod->magnitude;
    if (mt->numel > e->ws->mag_cap) {
        lm_dev_buf_free(e->ws->dev, e->ws->mag_buf);
        e->ws->mag_buf = NULL;
        e->ws->mag_cap = 0;
        lm_status s = lm_dev_alloc(e->ws->dev, (size_t)mt->numel * sizeof(float), (void **)&e->ws->mag_buf, e->err);
        if (s != LM_OK)
            return s;
        e->ws->mag_cap = mt->numel;
    }
    return load_f32(e, e->ws->mag_buf, mt->data, mt->dtype, mt->numel);
}

static lm_status tau_for(engine *e, part *p, const lm_st_tensor *bt, int64_t r0, int64_t rows, const float *base_slab)
{
    lm_status s = load_magnitude(e, p);
    if (s == LM_OK)
        s = compute_tau(e, p, bt, r0, rows, base_slab);
    if (s == LM_OK && p->key)
        s = lm_dev_importance(e->ws->dev, p->key, p->tau, p->ucc2_dev, rows, bt->numel / tensor_rows(bt), e->err);
    return s;
}

// What selection ranks: the importance where there is one (sparsegpt), else τ itself.
static const float *rank_buf(const part *p)
{
    return p->key ? p->key : p->tau;
}

// After a pass over one slab of a tensor that has several, lets the slab's input pages go, so
// memory holds a slab per input rather than the whole tensor (a later pass reads them again
// from the page cache).
static void release_slab(const engine *e, const lm_st_tensor *bt, const part *parts, int k, int64_t r0,
                         int64_t rows)
{
    // A tensor whose inputs are small stays mapped until it is done (the loop in lm_merge_run
    // releases it): each pass over it would otherwise fault every page in again.
    uint64_t mapped = bt->nbytes;
    for (int i = 0; i < k; i++)
        mapped += parts[i].src == SRC_FULL ? parts[i].full->nbytes : 0;
    if (mapped <= KEEP_MAPPED_BYTES)
        return;
    int64_t cols = bt->numel / tensor_rows(bt);
    release_bytes(e, (const char *)bt->data + (size_t)(r0 * cols) * esize(bt->dtype),
                  (uint64_t)(rows * cols) * esize(bt->dtype));
    for (int i = 0; i < k; i++)
        if (parts[i].src == SRC_FULL)
            release_bytes(e, (const char *)parts[i].full->data + (size_t)(r0 * cols) * esize(parts[i].full->dtype),
                          (uint64_t)(rows * cols) * esize(parts[i].full->dtype));
}

// ==== selection passes ========================================================================

// Whether computing any part's τ reads the base's values (full models and saved tensors
// subtract them, DoRA normalises with them; a plain LoRA delta does not).
static bool needs_base(const part *parts, int k)
{
    for (int i = 0; i < k; i++)
        if (parts[i].src == SRC_FULL || (parts[i].src == SRC_LORA && parts[i].mod->magnitude))
            return true;
    return false;
}

// Whether the fused dense operations can make part p's τ themselves: a full model's tensor (or
// an adapter's saved one), or a plain LoRA pair of low rank on a base [out, in] (not DoRA,
// whose scale needs the rows' norms first, nor the transposed products of embeddings and
// fan_in_fan_out).
static bool dense_part(const engine *e, const part *p)
{
    if (p->src == SRC_FULL)
        return true;
    if (p->src != SRC_LORA)
        return false;
    const lm_lora_module *m = p->mod;
    return !m->magnitude && m->kind != LM_LORA_EMBEDDING && !e->fts[p->ft]->adapter->config.fan_in_fan_out &&
           m->r <= LM_DEV_LOWRANK_MAX;
}

// Whether tensor bt's passes run as the device's fused dense operations (device.h): every part
// one they make (dense_part), ranked by magnitude, on a device that has them, and no DARE L1
// rescale (whose norms need τ before the merge).
static bool fused(const engine *e, const lm_dev *dev, const lm_st_tensor *bt, const part *parts, int k)
{
    if (!lm_dev_supports(dev, LM_OP_DENSE) || !lm_dtype_readable(bt->dtype) ||
        (uses_random(e->o->method) && e->o->rescale == LM_RESCALE_L1))
        return false;
    for (int i = 0; i < k; i++)
        if (!dense_part(e, &parts[i]) || parts[i].key || parts[i].mask || parts[i].bits)
            return false;
    return k > 0;
}

// Rows per slab of tensor bt (whole rows, at least one) when its parts run on dev.
static int64_t slab_rows_of(const engine *e, const lm_dev *dev, const lm_st_tensor *bt, const part *parts, int k)
{
    int64_t elems = e->slab_elems;
    bool dense = true;
    for (int i = 0; i < k; i++)
        dense = dense && dense_part(e, &parts[i]);
    // On the CPU small slabs: the separate operations' buffers stay in cache from one to the
    // next, and the fused ones let the inputs' pages go in small steps.
    if (dense && lm_dev_host_memory(dev))
        elems = e->slab_dense;
    int64_t rows = tensor_rows(bt), cols = rows ? bt->numel / rows : 0;
    if (cols == 0)
        return rows > 0 ? rows : 1;
    return elems / cols > 0 ? elems / cols : 1;
}

// The window of level-1 bins the selection pass counts (hist_tensor's level 2): guessed from a
// sample, n bins around the bin where the sample's share of k falls. When the guess holds, no
// second pass over the tensor is needed. A dense task vector's values are alike from row to
// row and 4 bins around a sample of the first slab suffice. A LoRA product's rows scale with
// B's rows and its columns with A's: sampled from its buffer (the first slab's rows) the guess
// needs LM_HIST_WINDOW bins; sampled over the whole tensor (lora_sample, the fused passes) 4
// are enough (in the 1B benchmark no window missed, where 2 bins missed 4 times in 336).
#define DENSE_WINDOW 4
#define SAMPLE_ELEMS (1 << 18)
#define SAMPLE_PIECES 32

typedef struct window {
    uint64_t *win;   // (LM_HIST_WINDOW × LM_HIST_BINS) per part
    uint64_t *guess; // (LM_HIST_BINS) guess_window's histogram of the sample
    uint32_t lo;     // the window's first bin
    int n;           // its bins
} window;

// The sample of a slab of cnt elements: n_runs runs of `run` elements, the r-th from r·stride.
// SAMPLE_PIECES runs spread evenly over the slab: rows differ (a LoRA product's rows scale with
// B's), so one run from the start would not do.
static void sample_runs(int64_t cnt, int64_t *n_runs, int64_t *run, int64_t *stride)
{
    int64_t ns = cnt < SAMPLE_ELEMS ? cnt : SAMPLE_ELEMS;
    bool whole = ns == cnt || ns / SAMPLE_PIECES == 0;
    *n_runs = whole ? 1 : SAMPLE_PIECES;
    *run = whole ? ns : ns / SAMPLE_PIECES;
    *stride = whole ? 0 : cnt / SAMPLE_PIECES;
}

// Places window w from the sample x: n_runs runs of `run` values, the r-th from x + r·stride.
static lm_status guess_window(engine *e, const float *x, int64_t n_runs, int64_t run, int64_t stride, int64_t numel,
                              const lm_topk *t, window *w)
{
    uint64_t *h = w->guess;
    memset(h, 0, LM_HIST_BINS * sizeof *h);
    lm_status s = LM_OK;
    for (int64_t r = 0; s == LM_OK && r < n_runs; r++)
        s = lm_dev_hist_abs(e->ws->dev, h, x + r * stride, run, 0, 0, e->err);
    int64_t ns = n_runs * run;
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

// τ of LoRA part p (a dense_part) at a sample spread over the whole of tensor bt, into
// p->tau[0..*got), at most `want` values: runs of SAMPLE_RUN columns, the runs' rows evenly
// spaced over the tensor and their columns sweeping it (a product's rows scale with B's rows and
// its columns with A's columns, so a stretch of either would not do). Only a guess is made
// from it, so it is computed here, plainly: the fused operations, which run on the CPU alone
// (where the factors are host memory), count the exact values.
static void lora_sample(engine *e, part *p, const lm_st_tensor *bt, int64_t want, int64_t *got)
{
    const lm_lora_module *m = p->mod;
    const resident *rs = resident_for(e, p->ft);
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

// Tells the fused operations where part p's τ comes from for the elements of tensor bt from
// `first` on: its mapped input, or (a LoRA pair) its factors. Returns the input bytes read per
// element (none for a LoRA pair, whose factors are in memory already).
static size_t dense_source(const engine *e, const part *p, const lm_st_tensor *bt, int64_t first, lm_dense_part *d)
{
    if (p->src == SRC_FULL) {
        d->src = (const char *)p->full->data + (size_t)first * esize(p->full->dtype);
        d->dt = p->full->dtype;
        return esize(p->full->dtype);
    }
    const resident *rs = resident_for(e, p->ft);
    int64_t cols = bt->numel / tensor_rows(bt), r = p->mod->r;
    if (p->keeps) {  // the whole tensor's; `first`, the call's first element, is on a segment
        d->keep_bits = e->keep_bits[p->ft];
        d->keep_off = e->keep_off[p->ft];
        d->keep_vals = e->keep_vals[p->ft];
    }
    d->first = first;
    d->lora_a = rs->data + rs->a_off[p->mod_index];
    d->lora_b = rs->data + rs->b_off[p->mod_index] + first / cols * r;
    d->lora_r = r;
    d->cols = cols;
    d->col0 = first % cols;
    d->scale = (float)p->mod->scale;
    d->dt = LM_DTYPE_F32;
    return 0;
}

// guess_window from the sample runs of a slab of cnt elements whose τ (or importance) is in
// part p's buffer.
static lm_status guess_at(engine *e, const part *p, int64_t cnt, int64_t numel, const lm_topk *t, window *w)
{
    int64_t n_runs, run, stride;
    sample_runs(cnt, &n_runs, &run, &stride);
    return guess_window(e, rank_buf(p), n_runs, run, stride, numel, t, w);
}

// hist_tensor's level 2 for one slab (cnt elements from row r0) with the fused operation: on
// the first slab τ is computed at the sample's elements only, for guess_window (a full model's
// from the slab, a LoRA pair's from the whole tensor).
static lm_status hist_dense(engine *e, const lm_st_tensor *bt, part *parts, int k, uint64_t **hists,
                            const lm_topk *const *sel, int64_t r0, int64_t cnt, window *wins)
{
    int64_t first = r0 * (bt->numel / tensor_rows(bt));
    const char *base = (const char *)bt->data + (size_t)first * esize(bt->dtype);
    lm_status s = LM_OK;
    if (r0 == 0) {
        int64_t n_runs, run, stride;
        sample_runs(cnt, &n_runs, &run, &stride);
        bool full = false;
        for (int i = 0; i < k; i++)
            full = full || (parts[i].src == SRC_FULL && !sel[i]->none);
        for (int64_t r = 0; s == LM_OK && full && r < n_runs; r++) {
            int64_t at = r * stride;
            s = load_f32(e, e->ws->base_buf + at, base + (size_t)at * esize(bt->dtype), bt->dtype, run);
            for (int i = 0; s == LM_OK && i < k; i++) {
                const lm_st_tensor *t = parts[i].full;
                if (parts[i].src == SRC_FULL && !sel[i]->none)
                    s = lm_dev_delta(e->ws->dev, parts[i].tau + at,
                                     (const char *)t->data + (size_t)(first + at) * esize(t->dtype), t->dtype,
                                     e->ws->base_buf + at, run, e->err);
            }
        }
        for (int i = 0; s == LM_OK && i < k; i++) {
            if (sel[i]->none)
                continue;
            int64_t got;
            if (parts[i].src == SRC_FULL)
                s = guess_window(e, parts[i].tau, n_runs, run, stride, bt->numel, sel[i], &wins[i]);
            else {
                lora_sample(e, &parts[i], bt, n_runs * run, &got);
                s = guess_window(e, parts[i].tau, 1, got, 0, bt->numel, sel[i], &wins[i]);
            }
        }
        if (s != LM_OK)
            return s;
    }
    lm_dense_part d[k];
    uint64_t in_bytes = (uint64_t)cnt * esize(bt->dtype);
    for (int i = 0; i < k; i++) {
        d[i] = (lm_dense_part){0};
        size_t per = dense_source(e, &parts[i], bt, first, &d[i]);
        if (!sel[i]->none) {
            d[i].above = hists[i];
            d[i].win = wins[i].win;
            d[i].lo_bin = wins[i].lo;
            d[i].n_win = wins[i].n;
            in_bytes += (uint64_t)cnt * per;
        }
    }
    e->bytes_in += in_bytes;
    return lm_dev_dense_hist(e->ws->dev, base, bt->dtype, d, k, cnt, e->err);
}

// Adds the level-`level` histograms of τ over every slab of tensor bt to hists[i], one
// 65536-bin array per part (level 2: the count beyond wins[i]'s window into hists[i][0], and
// the window's level-1 histograms, the window placed from a sample of the first slab). `have_tau` says the parts' buffers already hold τ of the tensor's
// only slab (from the level-0 pass), so it is not computed again.
static lm_status hist_tensor(engine *e, const lm_st_tensor *bt, part *parts, int k, uint64_t **hists,
                             const lm_topk *const *sel, int level, bool have_tau, window *wins)
{
    int64_t rows = tensor_rows(bt), cols = rows ? bt->numel / rows : 0;
    int64_t slab_rows = slab_rows_of(e, e->ws->dev, bt, parts, k);
    bool fuse = level == 2 && fused(e, e->ws->dev, bt, parts, k);
    for (int64_t r0 = 0; r0 < rows; r0 += slab_rows) {
        int64_t nr = rows - r0 < slab_rows ? rows - r0 : slab_rows, cnt = nr * cols;
        lm_status s = LM_OK;
        if (fuse) {
            if ((s = hist_dense(e, bt, parts, k, hists, sel, r0, cnt, wins)) != LM_OK)
                return s;
            if (nr < rows)
                release_slab(e, bt, parts, k, r0, nr);
            continue;
        }
        if (!have_tau && needs_base(parts, k))
            s = load_base(e, bt, r0, nr);
        for (int i = 0; s == LM_OK && i < k; i++) {
            if (!have_tau && (s = tau_for(e, &parts[i], bt, r0, nr, e->ws->base_buf)) != LM_OK)
                break;
            if (sel[i]->none)
                continue;
            if (level < 2)
                s = lm_dev_hist_abs(e->ws->dev, hists[i], rank_buf(&parts[i]), cnt, level, sel[i]->hi_bin, e->err);
            else if (r0 > 0 || (s = guess_at(e, &parts[i], cnt, bt->numel, sel[i], &wins[i])) == LM_OK)
                s = lm_dev_hist_window(e->ws->dev, hists[i], wins[i].win, wins[i].n, wins[i].lo, rank_buf(&parts[i]),
                                       cnt, e->err);
        }
        if (s != LM_OK)
            return s;
        if (nr < rows)
            release_slab(e, bt, parts, k, r0, nr);
    }
    return LM_OK;
}

// Exact top-k of each part over the whole tensor: one pass counting the values beyond a window
// of bins guessed from a sample, and the window's level-1 histograms; for the
// parts whose threshold fell outside their window (rare), the two full histogram passes.
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
    int64_t segs = (numel + LM_DENSE_KEEP_SEGMENT - 1) / LM_DENSE_KEEP_SEGMENT;
    e->keep_bits[ft] = malloc((size_t)(segs * (LM_DENSE_KEEP_SEGMENT / 16)) * sizeof(uint16_t));
    e->keep_off[ft] = malloc((size_t)segs * sizeof(int64_t));
    e->keep_vals[ft] = malloc((size_t)(segs * LM_DENSE_KEEP_SEGMENT + 16) * sizeof(float));
    bool ok = e->keep_bits[ft] && e->keep_off[ft] && e->keep_vals[ft];
    e->keep_caps[ft] = ok ? segs * LM_DENSE_KEEP_SEGMENT : 0;
    return ok;
}

// Whether a fused tensor's LoRA parts may keep their candidates on dev: the kept values are
// laid out by segments, so every slab must start on one.
static bool keeps_fit(const engine *e, const lm_dev *dev, const lm_st_tensor *bt, const part *parts, int k,
                      bool one_slab)
{
    int64_t cols = bt->numel / tensor_rows(bt);
    return one_slab || slab_rows_of(e, dev, bt, parts, k) * cols % LM_DENSE_KEEP_SEGMENT == 0;
}

static lm_status select_tensor(engine *e, const lm_st_tensor *bt, part *parts, int k, bool one_slab)
{
    const lm_merge_opts *o = e->o;
    uint64_t *hists[k];
    const lm_topk *sel[k];
    window wins[k];
    lm_topk missed[k];  // the parts for the two passes; the others marked none
    uint64_t above[k];
    // The histograms live in one block kept by the engine from tensor to tensor (a fresh one
    // each time would cost page faults and zeroing of tens of megabytes per tensor).
    size_t cells = (size_t)k * (1 + LM_HIST_WINDOW) * LM_HIST_BINS;
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
    bool fuse = fused(e, e->ws->dev, bt, parts, k);
    bool aligned = keeps_fit(e, e->ws->dev, bt, parts, k, one_slab);
    for (int i = 0; i < k; i++) {
        parts[i].keeps = fuse && aligned && parts[i].src == SRC_LORA && !parts[i].mask &&
                         keep_store(e, parts[i].ft, bt->numel);
        // a part with a stored mask selects nothing (k = 0 makes every pass skip it)
        lm_topk_init(&parts[i].topk, parts[i].mask ? 0 : (int64_t)floor(o->densities[parts[i].ft] * (double)bt->numel),
                     bt->numel);
        hists[i] = &above[i];
        uint64_t *region = block + (size_t)i * (1 + LM_HIST_WINDOW) * LM_HIST_BINS;
        wins[i] = (window){region, region + (size_t)LM_HIST_WINDOW * LM_HIST_BINS, 0,
                           parts[i].src == SRC_FULL || fuse ? DENSE_WINDOW : LM_HIST_WINDOW};
        memset(wins[i].win, 0, (size_t)wins[i].n * LM_HIST_BINS * sizeof(uint64_t));
        sel[i] = &parts[i].topk;
    }
    lm_status s = hist_tensor(e, bt, parts, k, hists, sel, 2, false, wins);
    bool again = false;
    for (int i = 0; s == LM_OK && i < k; i++) {
        missed[i] = parts[i].topk;
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
        // τ is in the buffers after a pass over a single slab, unless that pass was fused
        s = hist_tensor(e, bt, parts, k, hists, sel, level,
                        one_slab && (level > 0 || !fused(e, e->ws->dev, bt, parts, k)), NULL);
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

// ==== one tensor ==============================================================================

// Hashes and writes nbytes of tensor idx's output at its byte offset.
static lm_status put_piece(engine *e, int64_t idx, const void *piece, size_t nbytes, uint64_t offset,
                           XXH64_state_t *hash)
{
    XXH64_update(hash, piece, nbytes);
    e->bytes_out += nbytes;
    return lm_st_writer_put_part(e->w, idx, offset, piece, nbytes, e->err);
}

// Converts a slab of float32 results to the output dtype, hashes it and writes it at its offset.
// On the CPU this goes in pieces of OUT_PIECE bytes: the converted piece is still in cache when
// the hash and the writer's copy read it (one large write from a buffer that no longer fits in
// cache copies several times slower). From an accelerator the slab comes home in one download
// (whose copies overlap) and is then hashed and written by pieces. The output's NaN and Inf are
// counted as it is converted, or (where the device does not count) in each piece before the
// hash reads it.
static lm_status write_slab(engine *e, int64_t idx, lm_dtype out_dt, const float *out_f32, int64_t cnt,
                            uint64_t offset, XXH64_state_t *hash)
{
    size_t es = esize(out_dt), total = (size_t)cnt * es;
    int64_t per_piece = (int64_t)(OUT_PIECE / es);
    bool host = lm_dev_host_memory(e->ws->dev);
    lm_nonfinite *nf = out_count(e);
    lm_status s = LM_OK;
    if (!host) {
        if (!e->out_slab && !(e->out_slab = malloc((size_t)e->slab_max * sizeof(float))))
            return lm_err_set(e->err, LM_ERR_NOMEM, "out of memory");
        s = lm_dev_from_f32(e->ws->dev, e->ws->out_dev, out_dt, out_f32, cnt, e->err);
        if (s == LM_OK)
            s = lm_dev_download(e->ws->dev, e->out_slab, e->ws->out_dev, total, e->err);
        e->res->bytes_from_device += total;
    }
    for (int64_t off = 0; s == LM_OK && off < cnt; off += per_piece) {
        int64_t n = cnt - off < per_piece ? cnt - off : per_piece;
        size_t nbytes = (size_t)n * es;
        const unsigned char *piece = host ? e->out_host : e->out_slab + (size_t)off * es;
        if (host && (s = nf && dev_counts(e) ? lm_dev_from_f32_count(e->ws->dev, e->out_host, out_dt, out_f32 + off, n,
                                                                     nf, e->err)
                                             : lm_dev_from_f32(e->ws->dev, e->out_host, out_dt, out_f32 + off, n,
                                                               e->err)) != LM_OK)
            break;
        if (nf && !dev_counts(e))
            lm_count_nonfinite(piece, out_dt, n, nf);
        s = put_piece(e, idx, piece, nbytes, offset + (uint64_t)off * es, hash);
    }
    return s;
}

// A tensor no FT changes: the base's values in the output dtype.
static lm_status copy_tensor(engine *e, int64_t idx, const lm_st_tensor *bt, lm_dtype out_dt, XXH64_state_t *hash)
{
    // In pieces of a slab's bytes, each let go once written, so memory stays bounded.
    if (bt->dtype == out_dt || !lm_dtype_readable(bt->dtype)) {
        uint64_t piece = OUT_PIECE;
        for (uint64_t off = 0; off < bt->nbytes; off += piece) {
            uint64_t len = bt->nbytes - off < piece ? bt->nbytes - off : piece;
            const char *src = (const char *)bt->data + off;
            // the base's values are the output's: counted once for both, before the hash reads
            // them (an integer or FP8 tensor is not counted)
            if (e->counting && lm_dtype_readable(bt->dtype)) {
                lm_nonfinite c = {0, 0};
                lm_count_nonfinite(src, bt->dtype, (int64_t)(len / esize(bt->dtype)), &c);
                e->in[0].nan += c.nan;
                e->in[0].inf += c.inf;
                e->out.nan += c.nan;
                e->out.inf += c.inf;
            }
            XXH64_update(hash, src, len);
            lm_status s = lm_st_writer_put_part(e->w, idx, off, src, len, e->err);
            if (s != LM_OK)
                return s;
            release_bytes(e, src, len);
        }
        e->bytes_in += bt->nbytes;
        e->bytes_out += bt->nbytes;
        return LM_OK;
    }
    for (int64_t off = 0; off < bt->numel; off += e->slab_max) {
        int64_t cnt = bt->numel - off < e->slab_max ? bt->numel - off : e->slab_max;
        const char *src = (const char *)bt->data + (size_t)off * esize(bt->dtype);
        lm_status s = load_f32_nf(e, e->ws->base_buf, src, bt->dtype, cnt, first_read(e, 0, off, cnt));
        if (s == LM_OK)
            s = write_slab(e, idx, out_dt, e->ws->base_buf, cnt, (uint64_t)off * esize(out_dt), hash);
        if (s != LM_OK)
            return s;
        release_bytes(e, src, (uint64_t)cnt * esize(bt->dtype));
    }
    return LM_OK;
}

// Task arithmetic is linear: θ = θ_b + Σ_i c_i τ_i with c_i = λ w_i / (Σ w_i when normalizing),
// so each τ is added into the result as soon as it exists, and a plain LoRA τ is never
// materialised at all: one GEMM adds c_i s B@A to the result in place.
static lm_status merge_linear(engine *e, int64_t idx, const lm_st_desc *desc, const lm_st_tensor *bt, part *parts,
                              int k, int64_t slab_rows, XXH64_state_t *hash)
{
    const lm_merge_opts *o = e->o;
    int64_t rows = tensor_rows(bt), cols = bt->numel / rows;
    double div = 0;
    for (int i = 0; i < k; i++)
        div += o->weights[parts[i].ft];
    if (!o->normalize || div == 0)
        div = 1;
    lm_status s = LM_OK;
    for (int64_t r0 = 0; r0 < rows && s == LM_OK; r0 += slab_rows) {
        int64_t nr = rows - r0 < slab_rows ? rows - r0 : slab_rows, cnt = nr * cols;
        if (r0 > 0 && lm_interrupted())  // a large tensor stops between its slabs too
            return lm_interrupted_err(e->err);
        s = load_base(e, bt, r0, nr);
        // Task vectors that need the base's values (full models, DoRA, biases) first, while
        // base_buf still holds them; then everything is added in.
        for (int i = 0; s == LM_OK && i < k; i++)
            if (parts[i].src != SRC_LORA || parts[i].mod->magnitude)
                s = tau_for(e, &parts[i], bt, r0, nr, e->ws->base_buf);
        for (int i = 0; s == LM_OK && i < k; i++) {
            part *p = &parts[i];
            float c = (float)(o->lambda * o->weights[p->ft] / div);
            if (p->src == SRC_LORA && !p->mod->magnitude)
                s = lora_gemm(e, p, bt, r0, nr, c * (float)p->mod->scale, 1.0f, e->ws->base_buf);
            else
                s = lm_dev_axpby(e->ws->dev, e->ws->base_buf, 1.0f, p->tau, c, cnt, e->err);
        }
        if (s == LM_OK)
            s = write_slab(e, idx, desc->dtype, e->ws->base_buf, cnt, (uint64_t)(r0 * cols) * esize(desc->dtype), hash);
        if (rows > slab_rows)
            release_slab(e, bt, parts, k, r0, nr);
    }
    return s;
}

// What lm_dev_dense_merge is told of tensor bt's parts and their combination (each part's src or
// tau, first and ties_allowed are set per piece by merge_pieces).
static lm_combine_how dense_parts(const engine *e, const lm_st_tensor *bt, const part *parts, int k,
                                      lm_dense_part *d)
{
    const lm_merge_opts *o = e->o;
    bool linear = o->method == LM_MERGE_TASK_ARITHMETIC;
    double div = 0;  // task arithmetic's normalization, as merge_linear's
    for (int i = 0; i < k; i++)
        div += o->weights[parts[i].ft];
    if (!o->normalize || div == 0)
        div = 1;
    uint64_t name_hash = lm_xxh64(bt->name, strlen(bt->name));
    for (int i = 0; i < k; i++) {
        const part *p = &parts[i];
        const lm_topk *t = o->topk_global && e->global ? &e->global[p->ft] : &p->topk;
        d[i] = (lm_dense_part){
            .dt = p->src == SRC_FULL ? p->full->dtype : LM_DTYPE_F32,
            .trim = uses_magnitude(o->method),
            .thr_bits = t->thr_bits,
            .drop = uses_random(o->method) && !p->dropped,
            .key = lm_rng_key(o->seed, p->ft, name_hash),
            .keep_below = lm_rng_threshold(o->densities[p->ft]),
            .rescale = (float)p->rescale,
            .weight = linear ? (float)(o->lambda * o->weights[p->ft] / div) : (float)o->weights[p->ft],
        };
    }
    return (lm_combine_how){.sign = !uses_election(o->method) ? LM_COMBINE_SIGN_NONE
                                        : o->sign == LM_SIGN_COUNT ? LM_COMBINE_SIGN_COUNT : LM_COMBINE_SIGN_SUM,
                                .normalize = o->normalize, .lambda = (float)o->lambda, .linear = linear};
}

// Merges elements [first0, first0 + cnt) of tensor idx with lm_dev_dense_merge, an OUT_PIECE of
// output at a time: τ, trimmed or dropped, rescaled, combined with the base read where it is
// mapped, converted, hashed and written in one pass. With from_buf each part's τ is in its
// buffer (the slab from first0), else it is computed from the part's mapped input.
// A piece of output waiting to be hashed and written: put_pending does it on the merge's thread
// while the device merges the next piece into the other half of out_host.
typedef struct pending_piece {
    engine *e;
    int64_t idx;
    XXH64_state_t *hash;
    const void *data;  // NULL: nothing waiting
    size_t nbytes;
    uint64_t offset;
    lm_status s;
} pending_piece;

static void put_pending(void *ctx)
{
    pending_piece *pp = ctx;
    if (pp->data && pp->s == LM_OK)
        pp->s = put_piece(pp->e, pp->idx, pp->data, pp->nbytes, pp->offset, pp->hash);
    pp->data = NULL;
}

static lm_status merge_pieces(engine *e, int64_t idx, const lm_st_desc *desc, const lm_st_tensor *bt, part *parts,
                              int k, lm_dense_part *d, lm_combine_how how, int64_t first0, int64_t cnt,
                              bool from_buf, int64_t *ties_left, XXH64_state_t *hash)
{
    const lm_merge_opts *o = e->o;
    size_t es = esize(desc->dtype);
    int64_t per_piece = (int64_t)(OUT_PIECE / es);
    lm_status s = LM_OK;
    pending_piece pp = {.e = e, .idx = idx, .hash = hash};
    lm_dev_side side = {put_pending, &pp};
    for (int64_t off = 0; off < cnt && s == LM_OK; off += per_piece) {
        unsigned char *out = e->out_host + (off / per_piece % 2) * OUT_PIECE;
        int64_t n = cnt - off < per_piece ? cnt - off : per_piece, first = first0 + off;
        e->bytes_in += (uint64_t)n * esize(bt->dtype);
        how.base_nf = first_read(e, 0, first, n);
        how.out_nf = out_count(e);
        for (int i = 0; i < k; i++) {
            if (from_buf)
                d[i].tau = parts[i].tau + off;
            else
                e->bytes_in += (uint64_t)n * dense_source(e, &parts[i], bt, first, &d[i]);
            d[i].first = first;
            d[i].ties_allowed = ties_left[i];
            // a full model's values are read here unless τ is in its buffer already
            d[i].nf = !from_buf && parts[i].src == SRC_FULL ? first_read(e, 1 + parts[i].ft, first, n) : NULL;
        }
        s = lm_dev_dense_merge_side(e->ws->dev, out, desc->dtype,
                                    (const char *)bt->data + (size_t)first * esize(bt->dtype), bt->dtype, d, k, n, how,
                                    &side, e->err);
        if (s == LM_OK)
            s = pp.s;
        for (int i = 0; s == LM_OK && i < k; i++) {
            ties_left[i] -= d[i].ties_used;
            if (o->topk_global && e->global)
                e->global[parts[i].ft].ties_allowed -= d[i].ties_used;
        }
        if (s == LM_OK) {
            pp.data = out;
            pp.nbytes = (size_t)n * es;
            pp.offset = (uint64_t)first * es;
        }
    }
    if (s != LM_OK)
        return s;
    put_pending(&pp);
    return pp.s;
}

// The merge pass of a tensor whose passes are fused (full models and plain LoRA pairs): τ is made
// (or read back from the kept candidates) as each piece is merged, slab by slab.
static lm_status merge_dense(engine *e, int64_t idx, const lm_st_desc *desc, const lm_st_tensor *bt, part *parts,
                             int k, int64_t slab_rows, int64_t *ties_left, XXH64_state_t *hash)
{
    int64_t rows = tensor_rows(bt), cols = bt->numel / rows;
    lm_dense_part d[k];
    lm_combine_how how = dense_parts(e, bt, parts, k, d);
    lm_status s = LM_OK;
    for (int64_t r0 = 0; r0 < rows && s == LM_OK; r0 += slab_rows) {
        int64_t nr = rows - r0 < slab_rows ? rows - r0 : slab_rows;
        if (r0 > 0 && lm_interrupted())  // a large tensor stops between its slabs too
            return lm_interrupted_err(e->err);
        s = merge_pieces(e, idx, desc, bt, parts, k, d, how, r0 * cols, nr * cols, false, ties_left, hash);
        if (rows > slab_rows)
            release_slab(e, bt, parts, k, r0, nr);
    }
    return s;
}

// Whether the merge pass of a tensor whose τ are in buffers runs as lm_dev_dense_merge: on a
// device that has it, unless a part is ranked by importance or by a stored mask, or records one.
static bool pieces_from_buf(const engine *e, const lm_st_tensor *bt, const part *parts, int k)
{
    if (!lm_dev_supports(e->ws->dev, LM_OP_DENSE) || !lm_dtype_readable(bt->dtype))
        return false;
    for (int i = 0; i < k; i++)
        if (parts[i].key || parts[i].mask || parts[i].bits)
            return false;
    return true;
}

// Merges tensor idx from its k parts (their tau buffers those of e->ws) and writes it.
static lm_status merge_tensor(engine *e, int64_t idx, const lm_st_desc *desc, XXH64_state_t *hash, part *parts,
                              int k)
{
    const lm_merge_opts *o = e->o;
    const lm_st_tensor *bt = e->base->tensors[idx];
    int64_t rows = tensor_rows(bt), cols = bt->numel / rows;
    int64_t slab_rows = slab_rows_of(e, e->ws->dev, bt, parts, k);
    bool one_slab = slab_rows >= rows;
    lm_status s = LM_OK;

    // select: exact top-k per part over the whole tensor (none when every part has a stored mask).
    int n_masked = 0;
    for (int i = 0; i < k; i++)
        n_masked += parts[i].mask != NULL;
    bool select = uses_magnitude(o->method) && !o->topk_global && n_masked < k;
    if (select && (s = select_tensor(e, bt, parts, k, one_slab)) != LM_OK)
        return s;

    // The ties budget each part may still spend in this tensor.
    int64_t ties_left[k];
    for (int i = 0; i < k; i++)
        ties_left[i] = e->global ? e->global[parts[i].ft].ties_allowed : parts[i].topk.ties_allowed;

    // l1: DARE's L1-matching rescale needs both norms over the whole tensor first.
    bool random = uses_random(o->method);
    if (random && o->rescale == LM_RESCALE_L1) {
        double l1_all[k], l1_kept[k];
        memset(l1_all, 0, sizeof l1_all);
        memset(l1_kept, 0, sizeof l1_kept);
        uint64_t name_hash = lm_xxh64(bt->name, strlen(bt->name));
        for (int64_t r0 = 0; r0 < rows && s == LM_OK; r0 += slab_rows) {
            int64_t nr = rows - r0 < slab_rows ? rows - r0 : slab_rows, cnt = nr * cols;
            s = load_base(e, bt, r0, nr);
            for (int i = 0; s == LM_OK && i < k; i++) {
                double a, b;
                part *p = &parts[i];
                if ((s = tau_for(e, p, bt, r0, nr, e->ws->base_buf)) != LM_OK ||
                    (s = lm_dev_l1(e->ws->dev, p->tau, cnt, &a, e->err)) != LM_OK)
                    break;
                uint64_t key = lm_rng_key(o->seed, p->ft, name_hash);
                if ((s = lm_dev_random_drop(e->ws->dev, p->tau, cnt, key, r0 * cols,
                                            lm_rng_threshold(o->densities[p->ft]), e->err)) != LM_OK ||
                    (s = lm_dev_l1(e->ws->dev, p->tau, cnt, &b, e->err)) != LM_OK)
                    break;
                l1_all[i] += a;
                l1_kept[i] += b;
                p->dropped = one_slab;
            }
            if (!one_slab)
                release_slab(e, bt, parts, k, r0, nr);
        }
        if (s != LM_OK)
            return s;
        for (int i = 0; i < k; i++)
            parts[i].rescale = l1_all[i] >= 1e-7 && l1_kept[i] >= 1e-7 ? l1_all[i] / l1_kept[i] : 1.0;
    } else if (random) {
        for (int i = 0; i < k; i++)
            parts[i].rescale = 1.0 / o->densities[parts[i].ft];
    }

    // merge: τ, sparsify, rescale, combine, convert, write.
    const float *taus[k];
    float weights[k];
    for (int i = 0; i < k; i++) {
        taus[i] = parts[i].tau;
        weights[i] = (float)o->weights[parts[i].ft];
    }
    // τ is still in the buffers after the passes above only when they ran over a single slab
    // and the last thing each did to it is what the merge needs next.
    bool have_tau = one_slab && (select || (random && o->rescale == LM_RESCALE_L1));
    // The base slab is still in base_buf too when those passes loaded it (the l1 pass always
    // does; the histogram pass when some τ needed it).
    bool have_base = have_tau && (random || needs_base(parts, k));
    uint64_t name_hash = lm_xxh64(bt->name, strlen(bt->name));
    lm_combine_sign sign = !uses_election(o->method) ? LM_COMBINE_SIGN_NONE
                       : o->sign == LM_SIGN_COUNT ? LM_COMBINE_SIGN_COUNT : LM_COMBINE_SIGN_SUM;
    if (fused(e, e->ws->dev, bt, parts, k))
        return merge_dense(e, idx, desc, bt, parts, k, slab_rows, ties_left, hash);
    if (o->method == LM_MERGE_TASK_ARITHMETIC)
        return merge_linear(e, idx, desc, bt, parts, k, slab_rows, hash);
    // With τ in the buffers, the rest of the pass in one operation where the device has it.
    bool pieces = pieces_from_buf(e, bt, parts, k);
    lm_dense_part d[k];
    lm_combine_how how = dense_parts(e, bt, parts, k, d);
    for (int64_t r0 = 0; r0 < rows && s == LM_OK; r0 += slab_rows) {
        int64_t nr = rows - r0 < slab_rows ? rows - r0 : slab_rows, cnt = nr * cols;
        if (r0 > 0 && lm_interrupted())  // a large tensor stops between its slabs too
            return lm_interrupted_err(e->err);
        if (!have_base && (!pieces || needs_base(parts, k)))
            s = load_base(e, bt, r0, nr);
        for (int i = 0; s == LM_OK && pieces && !have_tau && i < k; i++)
            s = tau_for(e, &parts[i], bt, r0, nr, e->ws->base_buf);
        if (pieces) {
            if (s == LM_OK)
                s = merge_pieces(e, idx, desc, bt, parts, k, d, how, r0 * cols, cnt, true, ties_left, hash);
            if (!one_slab)
                release_slab(e, bt, parts, k, r0, nr);
            continue;
        }
        for (int i = 0; s == LM_OK && i < k; i++) {
            part *p = &parts[i];
            if (!have_tau && (s = tau_for(e, p, bt, r0, nr, e->ws->base_buf)) != LM_OK)
                break;
            if (uses_magnitude(o->method)) {
                const lm_topk *t = o->topk_global ? &e->global[p->ft] : &p->topk;
                int64_t used = 0;
                s = p->mask  ? lm_dev_mask_apply(e->ws->dev, p->tau, p->mask, r0 * cols, cnt, e->err)
                    : p->key ? lm_dev_topk_apply_by(e->ws->dev, p->tau, p->key, cnt, t->thr_bits, ties_left[i], &used, e->err)
                             : lm_dev_topk_apply(e->ws->dev, p->tau, cnt, t->thr_bits, ties_left[i], &used, e->err);
                if (s == LM_OK && p->bits)  // recorded for the cache: what the trim kept
                    s = lm_dev_mask_get(e->ws->dev, p->bits, r0 * cols, p->tau, cnt, e->err);
                if (s != LM_OK)
                    break;
                ties_left[i] -= used;
                if (o->topk_global)
                    e->global[p->ft].ties_allowed -= used;
            } else if (random && !p->dropped) {
                uint64_t key = lm_rng_key(o->seed, p->ft, name_hash);
                if ((s = lm_dev_random_drop(e->ws->dev, p->tau, cnt, key, r0 * cols, lm_rng_threshold(o->densities[p->ft]),
                                            e->err)) != LM_OK)
                    break;
            }
            if (p->rescale != 1.0 &&
                (s = lm_dev_axpby(e->ws->dev, p->tau, (float)p->rescale, p->tau, 0.0f, cnt, e->err)) != LM_OK)
                break;
        }
        if (s == LM_OK)
            s = lm_dev_combine(e->ws->dev, e->ws->base_buf, e->ws->base_buf, taus, weights, k, cnt,
                               (lm_combine_how){.sign = sign, .normalize = o->normalize, .lambda = (float)o->lambda},
                               e->err);
        if (s == LM_OK)
            s = write_slab(e, idx, desc->dtype, e->ws->base_buf, cnt, (uint64_t)(r0 * cols) * esize(desc->dtype), hash);
        if (!one_slab)
            release_slab(e, bt, parts, k, r0, nr);
    }
    return s;
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

// Allocates w's buffers on dev for `cap` elements and the FTs among `parts` (every FT when
// parts is NULL). Device memory running out is LM_ERR_DEVICE_OOM, with what is already taken
// still in w for ws_release.
static lm_status ws_alloc(engine *e, wset *w, lm_dev *dev, int64_t cap, const part *parts, int k, size_t stage_bytes,
                          size_t out_bytes)
{
    w->dev = dev;
    w->cap = cap;
    size_t bytes = (size_t)cap * sizeof(float);
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
    if (s == LM_OK && !lm_dev_host_memory(dev))
        s = lm_dev_alloc(dev, stage_bytes, &w->stage_dev, e->err);
    if (s == LM_OK && !lm_dev_host_memory(dev))
        s = lm_dev_alloc(dev, out_bytes, &w->out_dev, e->err);
    w->stage_bytes = stage_bytes;
    return s;
}

// The CPU's buffers, made when first needed: at the start on the CPU, at the first fallback
// (or LoRA product made on the CPU) on an accelerator.
static lm_status cpu_ready(engine *e)
{
    if (e->cpu_ws.base_buf)
        return LM_OK;
    lm_status s = ws_alloc(e, &e->cpu_ws, e->cpu, e->slab_max, NULL, 0, 0, 0);
    if (s != LM_OK)
        ws_release(e, &e->cpu_ws);
    return s;
}

// The bytes the staging buffer needs for a tensor's slab of cnt elements: its largest input
// element (the base, full FTs' tensors, LoRA biases and DoRA magnitudes, which have a row's
// worth) times the larger of cnt and the rows.
static size_t stage_need(const lm_st_tensor *bt, const part *parts, int k, int64_t cnt)
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

// What a unit changes in the engine, kept so that a unit redone on the CPU starts over.
typedef struct unit_mark {
    uint64_t bytes_in, bytes_out;
    int64_t ties[];  // (n_ft) --topk global ties budgets
} unit_mark;

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

// Points the parts' buffers at the current working set's, and on an accelerator copies each
// part's U_cc² there (sparsegpt).
static lm_status bind(engine *e, part *parts, int k)
{
    lm_status s = LM_OK;
    for (int i = 0; i < k; i++) {
        part *p = &parts[i];
        p->tau = e->ws->tau_buf[p->ft];
        p->key = p->ucc2 ? e->ws->key_buf[p->ft] : NULL;
        p->ucc2_dev = lm_dev_host_memory(e->ws->dev) ? p->ucc2 : p->ucc2 ? e->ws->ucc2_buf[p->ft] : NULL;
        if (p->ucc2 && !lm_dev_host_memory(e->ws->dev) && s == LM_OK) {
            size_t bytes = (size_t)e->ws->cap_cols * sizeof(double);
            e->res->bytes_to_device += bytes;
            s = lm_dev_upload(e->ws->dev, (void *)p->ucc2_dev, p->ucc2, bytes, e->err);
        }
    }
    return s;
}

// The elements of one slab of tensor bt on dev.
static int64_t slab_cnt(const engine *e, lm_dev *dev, const lm_st_tensor *bt, const part *parts, int k)
{
    int64_t rows = tensor_rows(bt), cols = rows ? bt->numel / rows : 0;
    if (cols == 0)
        return 1;
    int64_t slab_rows = slab_rows_of(e, dev, bt, parts, k);
    return (slab_rows < rows ? slab_rows : rows) * cols;
}

// Unit work: `fn` over tensor bt with its parts, on the device first and, when the device runs
// out of memory, again from the start on the CPU (after `restart`, which undoes what the failed
// try left in ctx). Any other failure stops.
typedef lm_status (*unit_fn)(engine *e, int64_t idx, part *parts, int k, void *ctx);

static lm_status run_unit(engine *e, const char *phase, int64_t idx, part *parts, int k, unit_fn fn,
                          void (*restart)(void *ctx), void *ctx, bool *on_device)
{
    const lm_st_tensor *bt = e->base->tensors[idx];
    *on_device = false;
    lm_status s;
    double t0 = now();
    if (e->dev != e->cpu) {
        unit_mark *m = malloc(sizeof *m + (size_t)e->o->n_ft * sizeof(int64_t));
        if (!m)
            return lm_err_set(e->err, LM_ERR_NOMEM, "out of memory");
        mark(e, m);
        int64_t cnt = slab_cnt(e, e->dev, bt, parts, k);
        e->dev_ws.cap_cols = bt->numel / (tensor_rows(bt) > 0 ? tensor_rows(bt) : 1);
        s = ws_alloc(e, &e->dev_ws, e->dev, cnt, parts, k, stage_need(bt, parts, k, cnt),
                     (size_t)cnt * sizeof(float));
        if (s == LM_OK) {
            e->ws = &e->dev_ws;
            s = bind(e, parts, k);
        }
        if (s == LM_OK)
            s = fn(e, idx, parts, k, ctx);
        ws_release(e, &e->dev_ws);
        if (s != LM_ERR_DEVICE_OOM) {
            free(m);
            *on_device = s == LM_OK;
            return s;
        }
        rewind_to(e, m);
        free(m);
        if (restart)
            restart(ctx);
        if (strcmp(phase, "merge") == 0)
            e->res->fallback_merge++;
        else
            e->res->fallback_select++;
        fell_back(e, phase, bt->name, 0);
    }
    if ((s = cpu_ready(e)) != LM_OK)
        return s;
    e->ws = &e->cpu_ws;
    if ((s = bind(e, parts, k)) == LM_OK)
        s = fn(e, idx, parts, k, ctx);
    if (e->dev != e->cpu)
        e->res->fallback_s += now() - t0;
    return s;
}

typedef struct merge_ctx {
    const lm_st_desc *desc;
    XXH64_state_t *hash;
} merge_ctx;

static lm_status merge_fn(engine *e, int64_t idx, part *parts, int k, void *ctx)
{
    merge_ctx *c = ctx;
    count_reset(e);  // a redo on the CPU counts from the start
    return merge_tensor(e, idx, c->desc, c->hash, parts, k);
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

static void merge_restart(void *ctx)
{
    XXH64_reset(((merge_ctx *)ctx)->hash, 0);
}

// One output tensor: merged where its FTs change it, else the base's values converted (on the
// CPU: a copy gains nothing from an accelerator).
static lm_status merge_unit(engine *e, int64_t idx, const lm_st_desc *desc, XXH64_state_t *hash, bool *merged)
{
    const lm_st_tensor *bt = e->base->tensors[idx];
    part parts[e->o->n_ft > 0 ? e->o->n_ft : 1];
    e->ws = &e->cpu_ws;
    int k = lm_dtype_readable(bt->dtype) ? find_parts(e, bt->name, parts) : 0;
    *merged = k > 0;
    lm_status s;
    count_reset(e);
    if (k == 0 || bt->numel == 0) {
        if ((s = cpu_ready(e)) != LM_OK || (s = copy_tensor(e, idx, bt, desc->dtype, hash)) != LM_OK)
            return s;
        return note_counts(e, bt, parts, 0);
    }
    // the masks the trim selects, recorded for o->mask_store (a redo on the CPU rewrites them)
    s = LM_OK;
    for (int i = 0; i < k && uses_magnitude(e->o->method) && e->o->mask_store; i++)
        if (!parts[i].mask && !(parts[i].bits = malloc(lm_dev_mask_bytes(bt->numel)))) {
            s = lm_err_set(e->err, LM_ERR_NOMEM, "out of memory for the mask of '%s'", bt->name);
            break;
        }
    merge_ctx c = {desc, hash};
    bool on_device = false;
    if (s == LM_OK)
        s = run_unit(e, "merge", idx, parts, k, merge_fn, merge_restart, &c, &on_device);
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

// ==== --topk global ===========================================================================

typedef struct select_ctx {
    uint64_t *block;     // (n_ft × LM_HIST_BINS) the model-wide histograms
    uint64_t *tensor;    // (n_ft × LM_HIST_BINS) this tensor's, added to block when it is done
    size_t cells;
    int level;
} select_ctx;

static lm_status select_fn(engine *e, int64_t idx, part *parts, int k, void *ctx)
{
    select_ctx *c = ctx;
    const lm_st_tensor *bt = e->base->tensors[idx];
    uint64_t *hists[k > 0 ? k : 1];
    const lm_topk *sel[k > 0 ? k : 1];
    memset(hists, 0, sizeof hists);
    memset(sel, 0, sizeof sel);
    for (int i = 0; i < k; i++) {
        hists[i] = c->tensor + (size_t)parts[i].ft * LM_HIST_BINS;
        sel[i] = &e->global[parts[i].ft];
    }
    lm_status s = hist_tensor(e, bt, parts, k, hists, sel, c->level, false, NULL);
    if (s != LM_OK)
        return s;
    for (int i = 0; i < k; i++)
        for (size_t b = 0; b < LM_HIST_BINS; b++)
            c->block[(size_t)parts[i].ft * LM_HIST_BINS + b] += hists[i][b];
    return LM_OK;
}

// The model's histograms only change once a tensor is done: a redo starts from zero counts.
static void select_restart(void *ctx)
{
    select_ctx *c = ctx;
    memset(c->tensor, 0, c->cells * sizeof(uint64_t));
}

// Finds each FT's threshold over all the tensors it changes (two histogram passes over the
// model), with k = floor(d · the number of those elements). Ties at the threshold are kept in
// output order, then by index within a tensor. Each tensor's histograms are a unit: on the
// device, or on the CPU when the device is out of memory.
static lm_status select_global(engine *e, int64_t n_out)
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
    e->ws = &e->cpu_ws;
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
        int k = find_parts(e, bt->name, parts);
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
            e->ws = &e->cpu_ws;
            int k = find_parts(e, bt->name, parts);
            if (k == 0)
                continue;
            memset(c.tensor, 0, cells * sizeof(uint64_t));
            bool on_device;
            s = run_unit(e, "select", t, parts, k, select_fn, select_restart, &c, &on_device);
            if (s != LM_OK)
                lm_err_prefix(e->err, "selecting the --topk global thresholds, tensor '%s'", bt->name);
            release_pages(e, bt);
            for (int i = 0; i < k; i++)
                release_pages(e, parts[i].full);
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
    free(e->counted);
    free(e->in);
}

// The largest slab any tensor needs: a slab is whole rows, at most slab_elems elements unless
// one row is longer.
static int64_t largest_slab(const lm_model *base, int64_t slab_elems)
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

lm_status lm_merge_run(const lm_merge_opts *o, lm_dev *dev, const lm_model *base,
                       lm_ft *const *fts, lm_st_writer *w, const lm_merge_hooks *hooks,
                       lm_merge_result *res, lm_err *err)
{
    memset(res, 0, sizeof *res);
    lm_status s = lm_merge_check_opts(o, err);
    if (s != LM_OK)
        return s;
    double t0 = now();
    engine e = {.o = o, .dev = dev, .cpu = dev, .base = base, .fts = fts, .w = w, .hooks = hooks, .err = err,
                .res = res};
    e.page = sysconf(_SC_PAGESIZE) > 0 ? sysconf(_SC_PAGESIZE) : 4096;
    e.slab_elems = o->slab_elems > 0 ? o->slab_elems : LARGE_SLAB_ELEMS;
    e.slab_dense = o->slab_elems > 0 ? o->slab_elems : DENSE_SLAB_ELEMS;
    e.slab_max = largest_slab(base, e.slab_elems);
    e.ws = &e.cpu_ws;
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
    bool sparsegpt = o->method == LM_MERGE_SPARSEGPT;
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
    e.out_host = malloc(2 * OUT_PIECE);  // merge_pieces fills one half while the other is written
    if (o->topk_global && uses_magnitude(o->method))
        e.global = calloc((size_t)o->n_ft, sizeof *e.global);
    XXH64_state_t *hash = XXH64_createState();
    if (!res->tensor_xxh64 || !e.cpu_ws.tau_buf || !e.dev_ws.tau_buf || !e.res_cpu || !e.res_dev || !e.out_host ||
        !e.counted || !e.in ||
        !hash || (o->topk_global && uses_magnitude(o->method) && !e.global) ||
        (sparsegpt && (!e.cpu_ws.key_buf || !e.dev_ws.key_buf || !e.cpu_ws.ucc2_buf || !e.dev_ws.ucc2_buf))) {
        s = lm_err_set(err, LM_ERR_NOMEM, "out of memory");
        goto fail;
    }
    if (lm_dev_host_memory(dev) && (s = cpu_ready(&e)) != LM_OK)
        goto fail;
    if ((s = place_residents(&e)) != LM_OK)
        goto fail;
    if (e.global && (s = select_global(&e, base->n_tensors)) != LM_OK)
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
        release_pages(&e, bt);
        for (int f = 0; f < o->n_ft; f++)
            if (fts[f]->model)
                release_pages(&e, lm_model_find(fts[f]->model, bt->name));
        if (hooks && hooks->progress)
            hooks->progress(hooks->ctx, i + 1, n_out, bt->name, e.bytes_out, bytes_total);
    }
    free(descs);
    if (s != LM_OK)
        goto fail;
    res->bytes_in = e.bytes_in;
    res->bytes_out = e.bytes_out;
    res->seconds = now() - t0;
    XXH64_freeState(hash);
    engine_free(&e);
    return LM_OK;
fail:
    if (hash)
        XXH64_freeState(hash);
    engine_free(&e);
    lm_merge_result_free(res);
    return s;
}

// ==== what the engine will allocate (llmerge plan) ============================================

// These answer from the same helpers the engine uses (find_parts, slab_rows_of, slab_cnt,
// stage_need), over an engine that holds only what those read, so a plan cannot drift from
// the run. They read headers only, never tensor data.

int64_t lm_merge_plan_slab_max(const lm_merge_opts *o, const lm_model *base)
{
    return largest_slab(base, o->slab_elems > 0 ? o->slab_elems : LARGE_SLAB_ELEMS);
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
    return 2 * OUT_PIECE;
}

lm_status lm_merge_plan_tensor(const lm_merge_opts *o, const lm_model *base, lm_ft *const *fts, int64_t idx,
                               bool host_memory, lm_merge_need *need)
{
    memset(need, 0, sizeof *need);
    const lm_st_tensor *bt = base->tensors[idx];
    float **no_bufs = calloc((size_t)(o->n_ft > 0 ? o->n_ft : 1), sizeof *no_bufs);
    if (!no_bufs)
        return LM_ERR_NOMEM;
    engine e = {.o = o, .base = base, .fts = fts};
    e.slab_elems = o->slab_elems > 0 ? o->slab_elems : LARGE_SLAB_ELEMS;
    e.slab_dense = o->slab_elems > 0 ? o->slab_elems : DENSE_SLAB_ELEMS;
    e.slab_max = largest_slab(base, e.slab_elems);
    e.cpu_ws.tau_buf = no_bufs;
    e.ws = &e.cpu_ws;
    part parts[o->n_ft > 0 ? o->n_ft : 1];
    int k = lm_dtype_readable(bt->dtype) ? find_parts(&e, bt->name, parts) : 0;
    free(no_bufs);
    need->parts = k;
    if (k == 0 || bt->numel == 0) {
        // copy_tensor: base_buf holds slabs of slab_max elements when the dtype changes
        need->copy_elems = lm_dtype_readable(bt->dtype) && bt->dtype != o->out_dtype
                           ? (bt->numel < e.slab_max ? bt->numel : e.slab_max) : 0;
        return LM_OK;
    }
    // the device the engine would run on, for what slab_cnt, fused and keeps_fit ask of it: the
    // CPU, or an accelerator (a sim device answers as every one does)
    lm_dev *dev = NULL;
    lm_err dev_err = {0};
    lm_status s = host_memory ? lm_dev_cpu_create(&dev, 1, &dev_err) : lm_dev_sim_create(&dev, 1, NULL, 1, &dev_err);
    if (s != LM_OK)
        return s;
    int64_t rows = tensor_rows(bt);
    int64_t cnt = slab_cnt(&e, dev, bt, parts, k);
    need->slab_elems = cnt;
    need->one_slab = slab_rows_of(&e, dev, bt, parts, k) >= rows;
    for (int i = 0; i < k; i++)
        need->part_mask |= 1ull << (parts[i].ft < 63 ? parts[i].ft : 63);
    size_t bytes = (size_t)cnt * sizeof(float);
    need->ws_bytes = (uint64_t)bytes * (uint64_t)(1 + k);
    // The fused passes write the buffers only at the first slab's sample (hist_dense), and
    // the whole slab only when the sample's window misses the threshold; --topk global's
    // selection runs the separate operations.
    need->touched_elems = cnt;
    bool fuse = fused(&e, dev, bt, parts, k);
    if (fuse && !o->topk_global) {
        int64_t n_runs, run, stride;
        sample_runs(cnt, &n_runs, &run, &stride);
        need->touched_elems = uses_magnitude(o->method) ? n_runs * run : 0;
    }
    if (!host_memory)
        need->ws_bytes += stage_need(bt, parts, k, cnt) + bytes;
    for (int i = 0; i < k; i++)
        if (parts[i].src == SRC_LORA && parts[i].mod->magnitude &&
            (uint64_t)parts[i].mod->magnitude->numel * sizeof(float) > need->mag_bytes)
            need->mag_bytes = (uint64_t)parts[i].mod->magnitude->numel * sizeof(float);
    // release_slab's rule: a tensor whose inputs are small stays mapped until it is done
    uint64_t mapped = bt->nbytes, per_row = bt->nbytes / (uint64_t)rows;
    for (int i = 0; i < k; i++)
        if (parts[i].src == SRC_FULL) {
            mapped += parts[i].full->nbytes;
            per_row += parts[i].full->nbytes / (uint64_t)rows;
        }
    int64_t slab_rows = cnt / (bt->numel / rows);
    need->mapped_bytes = mapped <= KEEP_MAPPED_BYTES || need->one_slab ? mapped : per_row * (uint64_t)slab_rows;
    // select_tensor's block: allocated for every part's window and level arrays, touched for
    // the window each part uses (the level arrays start where the window does) and the sample's
    // histogram after the widest window
    if (uses_magnitude(o->method) && !o->topk_global) {
        need->hist_alloc = (uint64_t)k * (1 + LM_HIST_WINDOW) * LM_HIST_BINS * sizeof(uint64_t);
        for (int i = 0; i < k; i++) {
            int bins = 1 + (parts[i].src == SRC_FULL || fuse ? DENSE_WINDOW : LM_HIST_WINDOW);
            need->hist_touched += (uint64_t)bins * LM_HIST_BINS * sizeof(uint64_t);
        }
        // a fused LoRA part's kept candidates (select_tensor, keep_store): the bitmap, the
        // segments' offsets, and the values at or above the window, about the density's share
        bool aligned = keeps_fit(&e, dev, bt, parts, k, need->one_slab);
        for (int i = 0; fuse && aligned && i < k; i++)
            if (parts[i].src == SRC_LORA) {
                double share = o->densities[parts[i].ft] + 0.02 < 1.0 ? o->densities[parts[i].ft] + 0.02 : 1.0;
                need->hist_touched += (uint64_t)bt->numel / 8 + (uint64_t)bt->numel / LM_DENSE_KEEP_SEGMENT * 8 +
                                      (uint64_t)((double)bt->numel * share) * sizeof(float);
            }
    }
    lm_dev_destroy(dev);
    return LM_OK;
}

bool lm_merge_plan_selects(const lm_merge_opts *o)
{
    return o->topk_global && uses_magnitude(o->method);
}

lm_status lm_merge_plan_importance(const lm_merge_opts *o, const lm_model *base, lm_ft *const *fts, int64_t idx,
                                   bool host_memory, lm_merge_imp_need *need)
{
    memset(need, 0, sizeof *need);
    const lm_st_tensor *bt = base->tensors[idx];
    if (o->method != LM_MERGE_SPARSEGPT || !o->ucc2 || !lm_dtype_readable(bt->dtype) || bt->numel == 0)
        return LM_OK;
    // the slab is the unit's own (ws_alloc gives every buffer the same count)
    lm_merge_need unit;
    lm_status s = lm_merge_plan_tensor(o, base, fts, idx, host_memory, &unit);
    if (s != LM_OK || unit.parts == 0)
        return s;
    float **no_bufs = calloc((size_t)(o->n_ft > 0 ? o->n_ft : 1), sizeof *no_bufs);
    if (!no_bufs)
        return LM_ERR_NOMEM;
    engine e = {.o = o, .base = base, .fts = fts};
    e.cpu_ws.tau_buf = no_bufs;
    e.ws = &e.cpu_ws;
    part parts[o->n_ft > 0 ? o->n_ft : 1];
    int k = find_parts(&e, bt->name, parts);
    free(no_bufs);
    // ws_alloc: a slab for each part with a Hessian and, without host memory, its U_cc²
    int64_t cols = bt->numel / (tensor_rows(bt) > 0 ? tensor_rows(bt) : 1);
    need->slab_elems = unit.slab_elems;
    for (int i = 0; i < k; i++) {
        if (!parts[i].ucc2)
            continue;
        need->parts++;
        need->part_mask |= 1ull << (parts[i].ft < 63 ? parts[i].ft : 63);
        need->key_bytes += (uint64_t)unit.slab_elems * sizeof(float);
        if (!host_memory)
            need->ucc2_bytes += (uint64_t)cols * sizeof(double);
    }
    return LM_OK;
}
