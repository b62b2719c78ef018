// Merging: task vectors of several fine-tuned inputs (full models or LoRA adapters) against one
// base, sparsified and combined per docs/merging.md, streamed tensor by tensor into a safetensors
// writer. The engine never holds a whole model: each base tensor is processed on its own, and a
// tensor larger than the slab limit is processed in slabs of whole rows (magnitude thresholds
// then come from exact histogram selection over all slabs, so the result is the same as for
// one slab). LoRA adapters are never expanded into models: a tensor's delta is s·B@A computed
// when that tensor (or slab) is merged. Every random draw is a pure function of (seed, model
// index, xxh64(tensor name), element index), so outputs are identical for any thread count,
// slab size or tensor order. All arithmetic runs through the device interface (device.h).
#ifndef LM_MERGE_H
#define LM_MERGE_H

#include <stdbool.h>
#include <stdint.h>

#include "adapter.h"
#include "device.h"
#include "fallback.h"
#include "model.h"
#include "st_writer.h"

typedef enum lm_merge_method {
    LM_MERGE_TIES,             // magnitude trim, sign election, disjoint mean
    LM_MERGE_DARE,             // random drop and rescale, summed
    LM_MERGE_DARE_TIES,        // DARE masks with TIES sign election
    LM_MERGE_TASK_ARITHMETIC,  // weighted sum of task vectors
    LM_MERGE_SPARSEGPT,        // TIES with entries kept by Hessian importance (docs/merging.md)
    LM_MERGE_LINEAR,           // weighted average of the models, the base one of them
    LM_MERGE_SLERP,            // spherical interpolation between the base and one FT
    LM_MERGE_NUSLERP,          // spherical interpolation of two FTs (task vectors) or two models
    LM_MERGE_MULTISLERP,       // spherical barycentre of several FTs or models
    LM_MERGE_KARCHER,          // Riemannian (Karcher) mean of the models on the sphere
    LM_MERGE_MODEL_STOCK,      // the FTs' mean, interpolated from the base by their angles
    LM_MERGE_NEARSWAP,         // the FT's values where they are within t of the base's
    LM_MERGE_BREADCRUMBS,      // the largest and the smallest magnitudes dropped, summed
    LM_MERGE_BREADCRUMBS_TIES, // breadcrumbs' trim with TIES sign election
    LM_MERGE_DELLA,            // drop by per-row magnitude rank, TIES sign election
    LM_MERGE_DELLA_LINEAR,     // della's drop, summed
    LM_MERGE_SCE,              // a mask where the FTs vary most, weights by mean square, elected mean
    LM_MERGE_RAM,              // the mean of the task vectors' entries above epsilon in magnitude
    LM_MERGE_RAMPLUS,          // ram, each FT's unique entries scaled by its shared/unique ratio
} lm_merge_method;

typedef enum lm_sign_rule {
    LM_SIGN_SUM,    // s = sign of Σ W_i
    LM_SIGN_COUNT,  // s = sign of Σ sign(W_i)
} lm_sign_rule;

typedef enum lm_rescale {
    LM_RESCALE_INV,  // kept entries times 1/d (DARE paper, PEFT)
    LM_RESCALE_L1,   // kept entries times ‖τ‖₁ / ‖τ ⊙ m‖₁ (mergekit)
    LM_RESCALE_NONE, // kept entries as they are (mergekit's rescale: false)
} lm_rescale;

// The name of a rescale rule on the command line: "inv", "l1" or "none".
const char *lm_rescale_name(lm_rescale r);

// The method's name on the command line ("ties", "dare", "dare-ties", "task-arithmetic",
// "sparsegpt").
const char *lm_merge_method_name(lm_merge_method m);

// Whether the method divides by the sum of weights unless told otherwise (docs/merging.md
// "Defaults"): on for ties and sparsegpt, off for dare, dare-ties and task-arithmetic.
bool lm_merge_default_normalize(lm_merge_method m);

// One tensor's parameters, where they vary from tensor to tensor (lm_merge_opts' tensor_params):
// the engine fills them from the options, then lets the caller change them.
typedef struct lm_tensor_params {
    double *weights;      // (n_ft) w_i
    double *densities;    // (n_ft) d_i in (0, 1]
    double *gammas;       // (n_ft) breadcrumbs' γ_i in [0, 1]
    double *epsilons;     // (n_ft) della's ε_i
    double base_weight;   // the base's weight, for the methods whose base is one of the models
    double lambda;
    double t;             // slerp's and nearswap's t
    double select_topk;   // sce's fraction of the nonzero variances kept
} lm_tensor_params;

typedef struct lm_merge_opts {
    lm_merge_method method;
    int n_ft;
    const double *weights;    // (n_ft) w_i
    const double *densities;  // (n_ft) d_i in (0, 1]; unused by task-arithmetic
    const double *gammas;     // (n_ft) breadcrumbs: the fraction γ_i of largest magnitudes removed
                              // (NULL: mergekit's 0.01 each)
    const double *epsilons;   // (n_ft) della: keep probabilities d_i ± ε_i across each row's ranks;
                              // ram, ramplus_tl: the threshold (NULL: lm_method_epsilon's each)
    double lambda;            // scale of the merged task vector
    // The methods whose base is one of the models averaged (linear, karcher, and nuslerp and
    // multislerp where `models_only`): the base's weight (linear's w_0; unused by karcher).
    double base_weight;
    // nuslerp and multislerp: the base is the first of the models, not a base the task vectors
    // are taken against (mergekit's configurations without base_model).
    bool models_only;
    double t;                 // slerp: the position from the base (0) to the FT (1); nearswap: the threshold
    // nuslerp and model-stock: each row of a matrix is its own vector, with its own coefficients
    // (mergekit's nuslerp_flatten: false, model_stock's filter_wise: true), rather than the
    // whole tensor; a vector is one row either way
    bool per_row;
    // nuslerp: each column of a matrix is its own vector (mergekit's nuslerp_flatten: false with
    // nuslerp_row_wise: true); a vector is one either way
    bool per_col;
    double select_topk;       // sce: the fraction of the entries of nonzero variance kept (1: all)
    int max_iter;             // karcher: most iterations (mergekit's default 10)
    double tol;               // karcher: convergence tolerance (1e-5)
    double ram_r, ram_alpha;  // ramplus_tl: λ_i = 1 + r·clamp(ρ_i, 0, alpha) (mergekit's 0.1 and 0.2;
                              // no defaults here: a caller of ramplus_tl sets them)
    // When not NULL, called before each tensor is merged with tp filled from the options above;
    // it may change any value for `tensor` (mergekit's gradients and filters). A status other
    // than LM_OK stops the merge (err names the tensor and the parameter). Not with --topk
    // global, whose densities are the whole model's.
    lm_status (*tensor_params)(void *ctx, const char *tensor, lm_tensor_params *tp, lm_err *err);
    void *params_ctx;
    const char *const *ft_names; // (n_ft) how messages name each FT ("FT 2", "model 'NAME'"), or NULL
    bool normalize;           // resolved: the caller applies lm_merge_default_normalize
    lm_sign_rule sign;
    bool topk_global;         // magnitude threshold per model over all its tensors
    lm_rescale rescale;
    uint64_t seed;
    lm_dtype out_dtype;       // F32, F16 or BF16 for floating tensors
    int threads;              // CPU threads; 0 = all cores
    int64_t slab_elems;       // most elements of one tensor processed at once; 0 = default
    // sparsegpt: U_cc² (cols values) of the Hessian feeding base tensor `tensor` [rows, cols]
    // for FT ft (lm_hess_ucc2), or NULL where the tensor has no Hessian (its entries are then
    // kept by magnitude). The array must live until lm_merge_run returns.
    const double *(*ucc2)(void *ctx, int ft, const char *tensor, int64_t cols);
    void *ucc2_ctx;
    // Stored top-k masks, for the methods with a top-k trim (ties, sparsegpt; the command keeps
    // sparsegpt's under --cache-dir). A mask is a host bitmap of numel bits, bit j in byte j / 8
    // at bit j % 8, set where entry j of τ is kept (lm_dev_mask_get). mask_load (may be NULL)
    // answers FT ft's mask of base tensor `tensor`, or NULL to select it as usual; a part with
    // a mask computes no importance and takes no part in the selection: τ keeps the entries its
    // bits say, which gives the same output as the selection that recorded them. With
    // --topk global it must answer for every tensor of an FT or for none (the threshold is the
    // whole model's). The bitmap must live until lm_merge_run returns. mask_store (may be NULL)
    // receives each mask the merge selected, once per (FT, tensor), after the tensor is
    // written; `bits` is valid during the call only. A status other than LM_OK stops the merge.
    const uint8_t *(*mask_load)(void *ctx, int ft, const char *tensor, int64_t numel);
    lm_status (*mask_store)(void *ctx, int ft, const char *tensor, const uint8_t *bits, int64_t numel, lm_err *err);
    void *mask_ctx;
} lm_merge_opts;

// ==== fine-tuned inputs =======================================================================

typedef struct lm_ft {
    char *path;           // the resolved directory
    lm_input_kind kind;   // LM_INPUT_MODEL or LM_INPUT_ADAPTER
    lm_model *model;      // a full fine-tuned model, or NULL
    lm_adapter *adapter;  // a LoRA adapter, or NULL
} lm_ft;

// Opens FT `path` (a full model directory or an adapter directory, nested layout included) and
// checks it against `base`: a full model must hold every base tensor with the base's shape, and
// a tensor that is not F32, F16, BF16 or F64 in it or in the base must be equal in both (same
// dtype and bytes: it is copied); an adapter must fit (lm_adapter_validate). On failure *out is
// NULL and err names the file, key and both shapes (LM_ERR_MISMATCH), or the tensor and both
// dtypes (LM_ERR_UNSUPPORTED), exit status 2. Free with lm_ft_free.
lm_status lm_ft_open(lm_ft **out, const char *path, const lm_model *base, lm_err *err);

// The FT of the full model `m`, which it then owns (m is freed on failure too), checked against
// `base` as lm_ft_open checks a model directory. The merge of a vocabulary rebuild opens its
// models itself.
lm_status lm_ft_of_model(lm_ft **out, lm_model *m, const lm_model *base, lm_err *err);

// Frees the FT and what it opened; safe on NULL.
void lm_ft_free(lm_ft *ft);

// ==== the merge ===============================================================================

// Checks the options against each other and against n_ft (weights and densities counts,
// densities in (0, 1], finite weights and lambda, a writable dtype). LM_ERR_USAGE naming the
// option.
lm_status lm_merge_check_opts(const lm_merge_opts *o, lm_err *err);

// Checks every tensor's parameters as o->tensor_params gives them (settings that vary by layer
// or module) as the merge checks each tensor's, so that a value out of range anywhere is an
// error before any work: LM_ERR_USAGE naming the parameter, the input and the tensor. With the
// FTs (fts not NULL), a tensor none of them changes is left out where the merge copies it
// without reading its parameters (every method but those that may scale it: linear, and the
// interpolations of the models themselves). LM_OK at once without tensor_params.
lm_status lm_merge_check_params(const lm_merge_opts *o, const lm_model *base, lm_ft *const *fts, lm_err *err);

// Task arithmetic's and linear's merge of tensor `name` as θ = a·θ_b + Σ c_i τ_i (c: n_ft values),
// the coefficients the engine uses (its per-tensor parameters, normalize over the FTs that change
// the tensor, linear's own; task arithmetic's rounded to float32 as the engine rounds them).
// LM_ERR_UNSUPPORTED for another method; a parameter out of range as lm_merge_check_params.
lm_status lm_merge_linear_coefs(const lm_merge_opts *o, lm_ft *const *fts, const char *name, double *a, double *c,
                                lm_err *err);

// The output tensors, in the base's order: every base tensor, floating ones in o->out_dtype and
// others unchanged. *out is a new array (names point into the base) the caller frees.
lm_status lm_merge_outputs(const lm_merge_opts *o, const lm_model *base, lm_st_desc **out,
                           int64_t *n, lm_err *err);

// What the engine tells its caller while it works, from the merging thread.
typedef struct lm_merge_hooks {
    // After each output tensor is written.
    void (*progress)(void *ctx, int64_t done, int64_t total, const char *name, uint64_t bytes_done,
                     uint64_t bytes_total);
    // A unit went from the device to the CPU because the device was out of memory (fallback.h):
    // fb's phase is "place" (an FT's LoRA factors; unit is the FT's path), "select" (a tensor's
    // histograms for --topk global) or "merge" (a tensor); from and to are device names, reason
    // the device's message. The engine says nothing but fallbacks (fb is never NULL).
    lm_fallback_fn fallback;
    // When not NULL, the output's bytes go here rather than to the writer (which may then be
    // NULL): bytes [offset, offset + nbytes) of output tensor idx, from the merging thread. A
    // status other than LM_OK stops the merge (err says why). The merged tensors are then not
    // hashed (lm_merge_result's tensor_xxh64 are not those of their data), and a tensor no FT
    // changes is not put at all (nor its values read).
    lm_status (*put)(void *ctx, int64_t idx, uint64_t offset, const void *data, uint64_t nbytes, lm_err *err);
    // When not NULL, called once output tensor idx is complete (every byte put) and its input
    // pages are let go, before progress; a status other than LM_OK stops the merge.
    lm_status (*tensor_done)(void *ctx, int64_t idx, lm_err *err);
    void *ctx;
} lm_merge_hooks;

// NaN and Inf in one tensor of an input or of the output (lm_merge_result's nonfinite).
typedef struct lm_merge_nonfinite {
    int input;     // 0 the base, i + 1 FT i, -1 the output
    char *tensor;  // the tensor's name in that input (an adapter's own key for its factors)
    uint64_t nan, inf;
} lm_merge_nonfinite;

typedef struct lm_merge_result {
    int64_t n_tensors;
    uint64_t *tensor_xxh64;   // (n_tensors) xxh64 of each output tensor's data, output order
    uint64_t bytes_in;        // input tensor bytes read (base and every FT's data used)
    uint64_t bytes_out;       // output tensor bytes written
    double seconds;           // wall time of the merge
    int64_t n_merged;         // tensors some FT changed
    int64_t n_copied;         // tensors no FT touched (the base's values, converted on the CPU)
    int64_t tensors_on_device;  // merged tensors that ran on an accelerator
    int64_t tensors_on_cpu;     // merged tensors that ran on the CPU (all of them on the CPU device)
    int64_t ft_on_device;       // adapters whose factors were placed on an accelerator
    int64_t fallback_place;     // adapters whose factors did not fit there
    int64_t fallback_select;    // tensors whose --topk global histograms were redone on the CPU
    int64_t fallback_merge;     // tensors redone on the CPU
    double fallback_s;          // time spent on units that fell back: the failed try and the redo
    uint64_t bytes_to_device;   // bytes copied host → accelerator (inputs, factors, products)
    uint64_t bytes_from_device; // bytes copied back (results)
    int64_t windows;            // exact top-k selections made from one windowed pass (a part of a tensor)
    int64_t window_misses;      // of those, the ones whose k-th value fell outside the guessed window
                                // and took two more passes over the tensor
    // Every tensor that holds NaN or Inf, among those the merge read (the base's, whether merged
    // or copied; each full FT's tensors that take part; each adapter's factors, bias deltas, DoRA
    // magnitudes and saved tensors) and those it wrote, in the order met: an adapter's at the
    // start, then per output tensor the base's, the FTs' and the output's. Values are counted as
    // float32 when read, in the output dtype when written, each once.
    lm_merge_nonfinite *nonfinite;  // (n_nonfinite)
    int64_t n_nonfinite;
    // Tensors where a magnitude trim keeps nothing of some FT's task vector, floor(d_i · numel)
    // being 0 (a small tensor at a low density; not counted with --topk global), and the first
    // of them: its name (freed by lm_merge_result_free) and that FT (from 0).
    int64_t empty_trims;
    char *empty_trim_tensor;
    int empty_trim_ft;
} lm_merge_result;

// Merges `fts` into `base` on `dev` and writes every output tensor (lm_merge_outputs' order
// and indices) to `w`, which the caller opened over those descriptors. On an accelerator each
// unit (an FT's LoRA factors, a tensor) tries the device first: when the device is out of
// memory the unit is freed there and done on the CPU instead (reported through hooks), the
// next unit trying the device again; any other device error stops the merge. The output is
// the same wherever units run. On success fills *res (free its array with
// lm_merge_result_free). On failure the writer holds a partial output that the caller
// removes; err names the tensor. After SIGINT or SIGTERM (lm_interrupted, signals.h) it stops
// before the next tensor or slab with LM_ERR_INTERRUPTED. hooks may be NULL. The NaN and Inf
// counts (res->nonfinite) are the same on every device: the CPU counts in the loops that convert
// the values, an accelerator's merge on the host, in the bytes it copies to and from the device.
lm_status lm_merge_run(const lm_merge_opts *o, lm_dev *dev, const lm_model *base,
                       lm_ft *const *fts, lm_st_writer *w, const lm_merge_hooks *hooks,
                       lm_merge_result *res, lm_err *err);

void lm_merge_result_free(lm_merge_result *res);


// ==== what a merge will allocate (for llmerge plan) ============================================

// What the engine allocates for one output tensor (lm_merge_plan_tensor), from headers only.
typedef struct lm_merge_need {
    int parts;              // FTs that change it; 0: the base's values are copied on the CPU
    uint64_t part_mask;     // bit i: FT i is a part (FTs past 63 share bit 63)
    int64_t slab_elems;     // elements of one slab where it runs (lm_eng_run_unit's lm_eng_slab_cnt)
    int64_t touched_elems;  // elements of each buffer it writes: slab_elems, or on the CPU with
                            // fused passes only the selection's sample (0 without one)
    int64_t var_elems;      // sce where a mask applies: elements of the variances' slab it writes
    bool one_slab;          // the whole tensor in one slab
    uint64_t ws_bytes;      // the unit's working set: base and one τ per part as float32, on a
                            // device without host memory the staging and output buffers, and
                            // sce's variances and della's ranks
    uint64_t mag_bytes;     // DoRA magnitude buffer (the largest part's), or 0
    uint64_t mapped_bytes;  // input pages mapped at once while it runs (the KEEP_MAPPED rule)
    uint64_t hist_alloc;    // lm_eng_select_tensor's histogram block (ties, --topk tensor), allocated
    uint64_t hist_touched;  // ... and the part of it written
    int64_t copy_elems;     // a copied tensor: elements of base_buf used converting it, or 0
} lm_merge_need;

// The elements of the largest slab of any tensor: the CPU's buffers hold this many float32
// each ((1 + n_ft) of them), and so does an accelerator's output slab on the host.
int64_t lm_merge_plan_slab_max(const lm_merge_opts *o, const lm_model *base);

// The bytes of float32 LoRA factors (every module's A and B) place_residents puts in host
// memory for FT ft and tries to place on an accelerator; 0 for a full model.
uint64_t lm_merge_plan_resident_bytes(const lm_ft *ft);

// The bytes of the host buffer the CPU converts, hashes and writes output through.
uint64_t lm_merge_plan_out_piece(void);

// Fills *need for output tensor idx when its unit runs on `dev` (the CPU device, or one of
// the accelerator's kind: lm_dev_sim_create stands in for any accelerator, whose units size
// alike), from the sizing functions lm_merge_run allocates by. Allocates nothing on dev and
// reads no tensor data. LM_OK.
lm_status lm_merge_plan_tensor(const lm_merge_opts *o, const lm_model *base, lm_ft *const *fts, int64_t idx,
                               const lm_dev *dev, lm_merge_need *need);

// Whether the merge has the --topk global selection phase (a unit per tensor, sized as the
// tensor's merge unit).
bool lm_merge_plan_selects(const lm_merge_opts *o);

// What sparsegpt's importance adds to a tensor's unit (lm_merge_plan_importance).
typedef struct lm_merge_imp_need {
    int parts;              // the parts with a Hessian (o->ucc2 answers for them)
    uint64_t part_mask;     // bit i: FT i is one of them (FTs past 63 share bit 63)
    int64_t slab_elems;     // elements of one slab where it runs
    uint64_t key_bytes;     // an importance buffer (a slab of float32) for each of them
    uint64_t ucc2_bytes;    // on a device without host memory: each one's U_cc² (cols doubles)
} lm_merge_imp_need;

// Fills *need for output tensor idx of a sparsegpt merge whose o->ucc2 says which (FT, tensor)
// have a Hessian (the plan's answer need only be non-NULL where the run's would be; it is
// never read), on `dev` as for lm_merge_plan_tensor, as ws_alloc allocates. All zero for
// other methods. Reads no tensor data. LM_OK.
lm_status lm_merge_plan_importance(const lm_merge_opts *o, const lm_model *base, lm_ft *const *fts, int64_t idx,
                                   const lm_dev *dev, lm_merge_imp_need *need);

#endif
