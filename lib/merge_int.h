// The merge engine's internals, shared by the files that implement merge.h: the engine's state
// (the run-wide `engine`, the per-unit working set `wset` that names the device a function
// computes on, the parts of a tensor, a unit of work) and the functions the files call across.
// A reader looks for a behaviour here first, then in its file:
//   merge.c         - the engine core: options, inputs, NaN and Inf counts, loading and staging,
//                     LoRA factors placed, the parts of a tensor, working sets, units tried on the
//                     device and redone on the CPU, and lm_merge_run;
//   merge_pass.c    - task vectors and the passes that merge a tensor: the fused dense pass, the
//                     pieces pass over τ in buffers, the linear pass, the separate operations,
//                     the copy of an untouched tensor;
//   merge_select.c  - selection: sampled windows, histograms, exact top-k, --topk global;
//   merge_sce.c     - sce: the variances' mask, the weights, the election by Σ τ;
//   merge_coef.c    - the methods with coefficients (linear, slerp, ...): the Gram pass, the
//                     coefficients, then the linear pass; and nearswap's;
//   merge_plan.c    - the sizing functions (slabs, working sets, staging, mapped pages, the
//                     selection's block) that the run allocates by and `llmerge plan` reports;
//   methods/*.c     - one descriptor per method (method.h), read by all of the above.
// Nothing here is public API: merge.h is.
#ifndef LM_MERGE_INT_H
#define LM_MERGE_INT_H

#include <stdbool.h>
#include <stdint.h>
#include <xxhash.h>

#include "merge.h"
#include "merge_desc.h"
#include "method.h"
#include "sparsify.h"

// Slabs. Large ones hold the whole of all but the largest tensors, so τ is computed once and
// kept across the passes; that suits LoRA parts (a GEMM each time) and accelerators (few
// transfers and launches). On the CPU a tensor of dense parts only goes in smaller slabs whose
// buffers stay in the processor's cache from one operation to the next: each pass computes τ
// again from the 16-bit inputs, which moves fewer bytes than keeping float32 τ in memory.
#define LARGE_SLAB_ELEMS (16ll << 20)   // 64 MiB of float32 per buffer
#define DENSE_SLAB_ELEMS (4ll << 20)    // 16 MiB
#define KEEP_MAPPED_BYTES (256ull << 20)  // inputs of one tensor kept mapped across its passes
#define OUT_PIECE (1u << 20)              // bytes of output converted, hashed and written at once

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
    lm_topk topk_hi;              // breadcrumbs: the outliers' threshold (the entries dropped)
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

// A working set: one device's buffers for the unit being run, each `cap` elements of float32.
// Every function that computes takes the working set it computes with: its dev is the device
// the function runs on (the engine's cpu_ws on the CPU, dev_ws on an accelerator).
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
    float *var_buf;       // sce: a slab of the variances across the FTs (cap), kept with the rest
                          // (on the CPU for the whole run: a buffer made per tensor among the
                          // run's smaller allocations left the heap in pieces, 1.3 GB of them)
} wset;

typedef struct engine {
    const lm_merge_opts *o;
    const lm_method *m;   // o->method's descriptor
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
    unsigned char *out_host;  // 2 × OUT_PIECE bytes
    unsigned char *out_slab;  // a slab's output from an accelerator (slab_max float32), or NULL
    resident *res_cpu;    // (n_ft) every adapter's factors in host memory
    resident *res_dev;    // (n_ft) on an accelerator, data NULL where they did not fit
    // --topk global: per FT thresholds and the ties budget left
    lm_topk *global;      // (n_ft) or NULL
    uint64_t *sel_block;  // lm_eng_select_tensor's histograms, reused from tensor to tensor
    float *sample;        // (sample_cap) an accelerator's sample of τ, brought home for its window
    int64_t sample_cap;
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
    // NaN and Inf of the tensor being merged (see lm_eng_first_read): in the base's values (in[0]),
    // in each FT's tensor (in[1 + ft]: a full model's, or an adapter's saved one) and in the
    // output. Off while --topk global selects, whose passes precede the tensors' own.
    bool counting;
    int64_t *counted;     // (1 + n_ft) elements of each input counted so far
    lm_nonfinite *in;     // (1 + n_ft)
    lm_nonfinite out;
    // the tensor being merged: its parameters (the options', changed by o->tensor_params), and
    // the linear pass's coefficients θ = base_coef·θ_b + Σ coef[ft]·τ_ft
    lm_tensor_params tp;  // its arrays (n_ft) owned here
    float *coef;          // (n_ft)
    float base_coef;
} engine;

// The bytes of one element of dtype dt.
static inline size_t esize(lm_dtype dt)
{
    return lm_dtype_bits(dt) / 8;
}

// A tensor's rows: its first dimension (1 for a scalar). Slabs are whole rows.
static inline int64_t tensor_rows(const lm_st_tensor *t)
{
    return t->ndim >= 1 ? t->shape[0] : 1;
}

// What selection ranks: the importance where there is one (sparsegpt), else τ itself.
static inline const float *rank_buf(const part *p)
{
    return p->key ? p->key : p->tau;
}

// The window of level-1 bins the selection pass counts (hist_tensor's level 2): guessed from a
// sample, n bins around the bin where the sample's share of k falls. When the guess holds, no
// second pass over the tensor is needed. A dense task vector's values are alike from row to
// row and 8 bins around a sample of the first slab suffice (in the 1B benchmark 4 bins missed
// 19 times in 438 for TIES's top 10% and in 876 for breadcrumbs' top 21%, where the fine-tunes'
// τ take few distinct values, each a large share of a bin; 8 missed none at densities 0.1, 0.2
// and 0.5; each bin costs its 65536 counts, cleared and read once per part and tensor). A LoRA
// product's rows scale with B's rows and its columns with A's: sampled from its buffer (the
// first slab's rows) the guess needs LM_HIST_WINDOW bins; sampled over the whole tensor
// (lora_sample, the fused passes) 4 are enough (in the 1B benchmark no window missed, where 2
// bins missed 4 times in 336), and a wider window would keep more candidates.
#define DENSE_WINDOW 8
#define FUSED_LORA_WINDOW 4
#define SAMPLE_ELEMS (1 << 18)
#define SAMPLE_PIECES 32

typedef struct window {
    uint64_t *win;   // (LM_HIST_WINDOW × LM_HIST_BINS) per part
    uint64_t *guess; // (LM_HIST_BINS) guess_window's histogram of the sample
    uint32_t lo;     // the window's first bin
    int n;           // its bins
} window;

// What a unit changes in the engine, kept so that a unit redone on the CPU starts over.
typedef struct unit_mark {
    uint64_t bytes_in, bytes_out;
    int64_t ties[];  // (n_ft) --topk global ties budgets
} unit_mark;

// A unit: the work on one tensor (its merge, or its --topk global histograms) that runs on
// one device as a whole. Its work is a function of the engine, the unit and the working set it
// is given, whose device is where it runs.
typedef struct unit {
    const char *phase;   // "merge" or "select": what a fallback reports
    int64_t idx;         // the base tensor
    part *parts;         // (k) the FTs that change it
    int k;
    lm_status (*work)(engine *e, struct unit *u, wset *ws);
    void (*undo)(struct unit *u);  // forgets what a failed try left in ctx, or NULL
    void *ctx;
} unit;

// What a unit's working set holds (lm_eng_ws_size): ws_alloc allocates exactly this, and
// lm_merge_plan_tensor and lm_merge_plan_importance report it.
typedef struct ws_size {
    int64_t cap;          // elements of each float32 buffer: the base's and each τ (the slab)
    int n_tau;            // τ buffers: one per part
    int n_key;            // sparsegpt's importance buffers: one per part with a Hessian
    int64_t ucc2_cols;    // U_cc² values copied for each of those (no host memory), else 0
    size_t stage_bytes;   // the input staging buffer (no host memory), else 0
    size_t out_bytes;     // the output staging buffer (no host memory), else 0
    size_t extra_bytes;   // what a method's passes take beside the buffers, on the device: sce's
                          // slab of variances; della's sorted rows (device scratch, no host memory)
} ws_size;

// What lm_eng_select_tensor's store of a fused LoRA part's kept candidates takes for a tensor of
// numel elements (lm_eng_keep_size): keep_store allocates exactly this.
typedef struct keep_size {
    int64_t cap;          // elements it holds: whole segments of LM_DENSE_KEEP_SEGMENT
    size_t bits_bytes;    // the candidates' bitmap
    size_t off_bytes;     // each segment's first value
    size_t vals_bytes;    // the values, room for every element
} keep_size;

// The functions the engine's files call across, by the file that defines them; each is
// commented where it is defined.

// ==== merge.c: the engine core (counting, loading, parts, working sets, units, the run) =======

void lm_eng_release_pages(const engine *e, const lm_st_tensor *t);
void lm_eng_release_bytes(const engine *e, const void *data, uint64_t nbytes);
lm_nonfinite *lm_eng_first_read(engine *e, int who, int64_t first, int64_t n);
lm_nonfinite *lm_eng_out_count(engine *e);
bool lm_eng_dev_counts(const wset *ws);
lm_status lm_eng_stage(engine *e, wset *ws, const void *src, lm_dtype dt, int64_t n, lm_nonfinite *nf,
                       const void **on_dev);
lm_status lm_eng_load_f32_nf(engine *e, wset *ws, float *dst, const void *src, lm_dtype dt, int64_t n,
                             lm_nonfinite *nf);
lm_status lm_eng_load_f32(engine *e, wset *ws, float *dst, const void *src, lm_dtype dt, int64_t n);
lm_status lm_eng_load_base(engine *e, wset *ws, const lm_st_tensor *bt, int64_t r0, int64_t rows);
int lm_eng_find_parts(engine *e, const char *name, part *parts);
lm_status lm_eng_cpu_ready(engine *e);
lm_status lm_eng_run_unit(engine *e, unit *u, bool *on_device);

// ==== merge_pass.c: task vectors and the passes (dense, pieces, linear, copy) =================

const resident *lm_eng_resident_for(const engine *e, wset *ws, int ft);
lm_status lm_eng_tau_for(engine *e, wset *ws, part *p, const lm_st_tensor *bt, int64_t r0, int64_t rows,
                         const float *base_slab);
void lm_eng_release_slab(const engine *e, const lm_st_tensor *bt, const part *parts, int k, int64_t r0,
                         int64_t rows);
bool lm_eng_needs_base(const part *parts, int k);
bool lm_eng_dense_part(const engine *e, const part *p);
bool lm_eng_fused(const engine *e, const lm_dev *dev, const lm_st_tensor *bt, const part *parts, int k);
size_t lm_eng_dense_source(const engine *e, wset *ws, const part *p, const lm_st_tensor *bt, int64_t first,
                           lm_dense_part *d);
lm_status lm_eng_copy_tensor(engine *e, wset *ws, int64_t idx, const lm_st_tensor *bt, lm_dtype out_dt,
                             XXH64_state_t *hash);
lm_status lm_eng_put(engine *e, int64_t idx, uint64_t offset, const void *data, size_t nbytes);
lm_status lm_eng_merge_tensor(engine *e, wset *ws, int64_t idx, const lm_st_desc *desc, XXH64_state_t *hash,
                              part *parts, int k);
lm_status lm_eng_write_slab(engine *e, wset *ws, int64_t idx, lm_dtype out_dt, const float *out_f32, int64_t cnt,
                            uint64_t offset, XXH64_state_t *hash);
lm_status lm_eng_merge_linear(engine *e, wset *ws, int64_t idx, const lm_st_desc *desc, const lm_st_tensor *bt,
                              part *parts, int k, int64_t slab_rows, bool have_slab, XXH64_state_t *hash);
lm_status lm_eng_merge_dense(engine *e, wset *ws, int64_t idx, const lm_st_desc *desc, const lm_st_tensor *bt,
                             part *parts, int k, int64_t slab_rows, int64_t *ties_left, int64_t *ties_hi,
                             XXH64_state_t *hash);

// ==== merge_sce.c: sce's passes ================================================================

lm_status lm_eng_merge_sce(engine *e, wset *ws, int64_t idx, const lm_st_desc *desc, XXH64_state_t *hash,
                           part *parts, int k, int64_t slab_rows);

// ==== merge_coef.c: the methods with coefficients, and nearswap =================================

lm_status lm_eng_merge_coef(engine *e, wset *ws, int64_t idx, const lm_st_desc *desc, XXH64_state_t *hash,
                            part *parts, int k, int64_t slab_rows);

// ==== merge_select.c: selection (histograms, top-k windows, --topk global) ====================

void lm_eng_sample_runs(int64_t cnt, int64_t *n_runs, int64_t *run, int64_t *stride);
bool lm_eng_keeps_fit(const engine *e, const lm_dev *dev, const lm_st_tensor *bt, const part *parts, int k,
                      bool one_slab);
lm_status lm_eng_select_tensor(engine *e, wset *ws, const lm_st_tensor *bt, part *parts, int k, bool one_slab,
                               const int64_t *keep, bool have_tau);
void lm_eng_band(double density, double gamma, int64_t n, int64_t *k_lo, int64_t *k_hi);
lm_status lm_eng_select_global(engine *e, int64_t n_out);

// ==== merge_plan.c: the sizing functions the run and the plan share ===========================

int64_t lm_eng_slab_rows(const engine *e, const lm_dev *dev, const lm_st_tensor *bt, const part *parts, int k);
size_t lm_eng_stage_need(const lm_st_tensor *bt, const part *parts, int k, int64_t cnt);
int64_t lm_eng_slab_cnt(const engine *e, const lm_dev *dev, const lm_st_tensor *bt, const part *parts, int k);
// select_topk of tensor `name`: the option's, or its per-tensor setting (where that setting is
// refused, the option's: the merge refuses it before any work). For sizing sce's working set.
double lm_eng_tensor_select_topk(const lm_merge_opts *o, const char *name);

void lm_eng_ws_size(const engine *e, const lm_dev *dev, const lm_st_tensor *bt, const part *parts, int k,
                    ws_size *z);
uint64_t lm_eng_mapped_bytes(const lm_st_tensor *bt, const part *parts, int k);
bool lm_eng_keeps_mapped(uint64_t mapped);
size_t lm_eng_sel_cells(int k);
// Whether the coefficient pass takes a Gram matrix per column of tensor bt (--per-column).
bool lm_eng_per_col(const engine *e, const lm_st_tensor *bt);
int lm_eng_window_bins(const part *p, bool fuse);
void lm_eng_keep_size(int64_t numel, keep_size *z);
uint64_t lm_eng_keep_touched(int64_t numel, double density);
size_t lm_eng_out_host_bytes(void);
int64_t lm_eng_largest_slab(const lm_model *base, int64_t slab_elems);

#endif
