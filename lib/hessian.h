// Hessians of the linear layers' inputs, from activation capture (docs/hessian.md). For every
// distinct linear input of a model (per layer the input of self_attn.q_proj, shared with k/v;
// of self_attn.o_proj; of mlp.gate_proj, shared with up; of mlp.down_proj)
// H = (2 / n_tokens) Σ x xᵀ over every real token of the calibration data (the
// forward pass packs sequences without padding, so no padding token ever enters a sum).
//
// An lm_hess holds one accumulator Σ x xᵀ per (layer, point) and fills it from the hook of the
// forward pass (forward.h): each batch adds Xᵀ X with one GEMM on the device the batch ran on,
// so the same code accumulates on the CPU, the simulated device and any accelerator. The
// accumulators live on the device where they fit (leaving room for the forward pass's
// activations) and in host memory where they do not; a batch that fell back to the CPU adds
// into a host-side accumulator of its own, and the two are summed in double when the result is
// read. Accumulation is float32 (the GEMM's), the final sum, scaling and symmetrisation double.
//
// The second half is sparsegpt's importance (docs/merging.md "The methods"): from H, damped,
// the upper Cholesky factor U of H⁻¹, and τ_jc² / U_cc² per weight entry (LAPACKE, CPU).
#ifndef LM_HESSIAN_H
#define LM_HESSIAN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "device.h"
#include "fallback.h"
#include "forward.h"
#include "model.h"
#include "status.h"

typedef struct lm_hess {
    int64_t n_layers;
    int64_t dim[LM_FWD_N_POINTS];  // the input width of each point: hidden, heads·head_dim, hidden, intermediate
    lm_dev *dev;                   // the device holding on_dev accumulators (not owned; NULL: none)
    lm_dev *cpu;                   // the CPU device for host-side GEMMs: dev's companion
    float **on_dev;                // (n_layers · N_POINTS) device [dim, dim] Σ x xᵀ, NULL where not on dev
    float **on_host;               // (n_layers · N_POINTS) host [dim, dim] Σ x xᵀ, NULL until a batch needs it
    float *stage;                  // host copy of a device batch for a host accumulator (rows, dim)
    int64_t stage_len;             // floats stage holds
    int64_t n_tokens;              // tokens seen (counted at layer 0's first point)
    int64_t n_host;                // accumulators that did not fit dev and live in host memory
    size_t dev_bytes;              // device bytes the accumulators take
    bool *dev_upper;               // (n_layers · N_POINTS) on_dev[i] was updated by syrk: only its upper
                                   // triangle is current until lm_hess_capture mirrors it
    bool *host_upper;              // the same for on_host[i]
    bool *dev_fresh;               // on_dev[i] has not been written yet: it holds nothing defined
} lm_hess;

// The index of (layer, point) in on_dev / on_host.
static inline int64_t lm_hess_index(int64_t layer, lm_fwd_point p)
{
    return layer * LM_FWD_N_POINTS + (int64_t)p;
}

// Prepares *h (overwritten) for model m (its config gives the shapes), whose forward pass was
// given dev. When on_device (the weights run on dev), each accumulator, in layer order, is
// allocated on dev while dev's free memory stays at least `reserve` bytes afterwards (room for
// the forward pass's activations), left for the first batch to overwrite (and for
// lm_hess_capture_end to zero if none does); the rest, and all of them when not on_device, are
// allocated zeroed in host memory, where dev's CPU companion (lm_dev_cpu_companion) adds to
// them. dev must outlive h. A host allocation failure is LM_ERR_NOMEM, a device failure other
// than out-of-memory LM_ERR_DEVICE; nothing is left allocated then. Free with lm_hess_free.
lm_status lm_hess_init(lm_hess *h, const lm_model *m, lm_dev *dev, bool on_device, size_t reserve, lm_err *err);

// Releases every accumulator and the CPU device; safe on a zeroed lm_hess and twice.
void lm_hess_free(lm_hess *h);

// The forward-pass hook (lm_fwd_hook) that adds Xᵀ X of the batch to the (layer, point)
// accumulator; ctx is the lm_hess. Where the device has lm_dev_syrk only the upper triangle is
// added (half the work), the lower one being filled in by lm_hess_capture at the end; a caller
// that runs the hook itself calls lm_hess_capture_end before reading the Hessians. It never
// fails with LM_ERR_DEVICE_OOM (which would make a runner redo a batch already partly added): a
// device failure is LM_ERR_DEVICE, a host one LM_ERR_NOMEM, naming the layer and the point.
lm_status lm_hess_hook(void *ctx, lm_dev *dev, int layer, lm_fwd_point point, const float *x, int64_t rows,
                       int64_t cols, lm_err *err);

// Runs the n_seqs sequences through runner r with the hook above (r's progress and notes as set
// by the caller), then completes the accumulators (lm_hess_capture_end). Returns r's status, or
// the completion's.
lm_status lm_hess_capture(lm_hess *h, lm_fwd_runner *r, const lm_fwd_seq *seqs, int64_t n_seqs, lm_err *err);

// Completes the accumulators for reading: copies the upper triangle of every one the hook
// updated by syrk onto its lower one, on the device that holds it, and zeroes those on the
// device that no batch reached, so that each holds all of Σ x xᵀ. The Hessians are read
// (lm_hess_get) only after this, or lm_hess_capture, has succeeded. Safe to call more than
// once. LM_ERR_DEVICE for a device failure, naming the Hessian.
lm_status lm_hess_capture_end(lm_hess *h, lm_err *err);

// Writes into the host array out[dim · dim] (dim = h->dim[p]) the Hessian of (layer, point):
// (2 / n_tokens) times the sum of its accumulators, symmetrised ((a + aᵀ) / 2), computed in
// double and rounded to float32 (exactly symmetric). The result is finished in out itself, with
// 64 KiB of scratch (no copy of the matrix). LM_ERR_USAGE when no token was captured or the accumulators were released,
// LM_ERR_DEVICE for a failed copy. The accumulators are unchanged.
lm_status lm_hess_get(const lm_hess *h, int64_t layer, lm_fwd_point p, float *out, lm_err *err);

// Frees the accumulators of (layer, point) once its Hessian has been read, so that writing the
// Hessians one at a time never holds them all twice; lm_hess_get of it is an error afterwards.
void lm_hess_release(lm_hess *h, int64_t layer, lm_fwd_point p);

// The tensor name of (layer, point): "model.layers.L." followed by the first module the point
// feeds (lm_fwd_point_module). Writes into buf; returns buf.
char *lm_hess_name(char *buf, size_t cap, int64_t layer, lm_fwd_point p);

// ==== importance (docs/merging.md "The methods", sparsegpt) ===================================

// For a linear weight's task vector tau (rows × cols, row-major; cols = the input width) and
// its input Hessian H (cols × cols, symmetric): a copy of H has its zero diagonal entries set
// to 1 and damp · mean(diag H) added to its diagonal (sparsegpt: damp = 0.01); U is the upper
// Cholesky factor of its inverse (H⁻¹ = Uᵀ U), and imp[j, c] = tau[j, c]² / U[c, c]², in float32
// (computed in double). Allocates only scratch. LM_ERR_FORMAT when the damped H is not positive
// definite (its Cholesky factorisation fails), LM_ERR_NOMEM when scratch cannot be allocated.
lm_status lm_hess_importance(float *imp, const float *tau, int64_t rows, int64_t cols, const float *H, double damp,
                             lm_err *err);

// The part of the importance that depends on H alone: ucc2[c] = U[c, c]² (cols values, in
// double), U as above. imp[j, c] is then float32 of tau[j, c]² / ucc2[c], which is what the
// merge engine computes on the device (lm_dev_importance).
lm_status lm_hess_ucc2(double *ucc2, const float *H, int64_t cols, double damp, lm_err *err);

// lm_hess_ucc2 with the factorisation run on dev (lm_dev_potrf: cuSOLVER on CUDA) when dev is
// an accelerator; on the host (LAPACKE) when dev is NULL or has host memory. The damped
// matrix is made in host memory either way and copied over; LM_ERR_DEVICE_OOM when it, or the
// factorisation's workspace, does not fit on dev. U_cc² agrees between devices to rounding.
lm_status lm_hess_ucc2_on(lm_dev *dev, double *ucc2, const float *H, int64_t cols, double damp, lm_err *err);

// lm_hess_ucc2_on with the damping raised tenfold (up to 10⁶ times `damp`) while the damped H
// is not positive definite, each raise said through note (may be NULL) naming the Hessian
// `name`. The factorisation is a unit of docs/design.md "Devices and the fallback contract":
// when it does not fit on dev it runs on the CPU, said through note as
// "fallback: hessian factor of NAME on cpu (REASON)".
// The error, when even the largest damping fails, is prefixed with name.
lm_status lm_hess_ucc2_raised(lm_dev *dev, double *ucc2, const float *H, int64_t cols, double damp, const char *name,
                              lm_fallback_fn note, void *note_ctx, lm_err *err);

// Called by lm_hess_ucc2_model with each finished Hessian H ([dim, dim], host memory, valid
// during the call only), in lm_hess_index order, and the tokens it was captured over (to keep
// them: the sparsegpt cache). A status other than LM_OK stops the work and is returned.
typedef lm_status (*lm_hess_each_fn)(void *ctx, int64_t layer, lm_fwd_point p, const float *H, int64_t dim,
                                     int64_t n_tokens, lm_err *err);

// Everything sparsegpt needs from a model's Hessians: runs the n_seqs sequences through model
// m (with adapter a, or NULL) on dev, with the accumulators placed as `llmerge hessian` places
// them (sticky: lm_fwd_runner's sticky fallback), then finishes one Hessian at a time (its
// accumulators freed before the next), hands it to `each` when that is not NULL, and computes
// its U_cc² (lm_hess_ucc2_raised from `damp`). (*out)[lm_hess_index(layer, point)] is a new
// array of dim[point] doubles; free the set with lm_hess_ucc2_free.
lm_status lm_hess_ucc2_model(const lm_model *m, const lm_adapter *a, lm_dev *dev, const char *label,
                             const lm_fwd_seq *seqs, int64_t n_seqs, double damp, bool sticky,
                             lm_fallback_fn note, void *note_ctx, lm_hess_each_fn each, void *each_ctx,
                             double ***out, int64_t *n_out, lm_err *err);
void lm_hess_ucc2_free(double **ucc2, int64_t n);

// ==== sizes for llmerge plan, and which Hessian a weight reads ================================

// The input width of each point for a model of config cfg (lm_hess's dim).
void lm_hess_dims(const lm_config *cfg, int64_t dim[LM_FWD_N_POINTS]);

// The (layer, point) whose Hessian base tensor `tensor` reads: the q, k and v projections
// read LM_FWD_ATTN_IN, o_proj LM_FWD_O_IN, gate and up LM_FWD_MLP_IN, down_proj LM_FWD_DOWN_IN
// ("model.layers.L.<module>.weight"). False for any other tensor; the caller checks the layer
// against the model and the width against lm_hess_dims.
bool lm_hess_point_of(const char *tensor, int64_t *layer, lm_fwd_point *point);

// The batch, in tokens, whose activations lm_hess_ucc2_model keeps room for on the device when
// placing the accumulators: the first batch the runner can form from n_tokens tokens whose
// longest sequence has `longest` (max_tokens per batch).
int64_t lm_hess_reserve_tokens(int64_t n_tokens, int64_t longest, int64_t max_tokens);

// What lm_hess_init and lm_hess_ucc2_model allocate for a model, from its config.
typedef struct lm_hess_plan {
    int64_t n_acc;           // accumulators: layers × LM_FWD_N_POINTS
    int64_t n_dev;           // the first ones in layer order, on the device
    uint64_t dev_bytes;      // their bytes (host memory on a device with host memory)
    uint64_t host_bytes;     // the rest, in host memory
    int64_t max_dim;         // the widest input
} lm_hess_plan;

// Fills *p for model m's accumulators placed as lm_hess_init places them: on_device false means
// its weights run on the CPU (every accumulator in host memory); else on the device they run on,
// with host_memory saying what it is, dev_free its free bytes after the weights and `reserve`
// the bytes kept for activations. LM_ERR_UNSUPPORTED for a width lm_hess_init refuses.
lm_status lm_hess_plan_make(lm_hess_plan *p, const lm_model *m, bool on_device, bool host_memory, uint64_t dev_free,
                            uint64_t reserve, lm_err *err);

// Where the factorisations of the finishing pass run (lm_hess_ucc2_raised): on an accelerator
// with `budget` bytes (the forward pass's weights and activations freed by then), each beside
// the accumulators still held there, or on the CPU when it does not fit.
typedef struct lm_hess_plan_factor {
    uint64_t budget;     // in: the accelerator's bytes (0: no accelerator, they run on the host)
    bool host_copy;      // in: the accelerator's memory is the process's (the sim device)
    uint64_t dev_peak;   // out: the most device memory in use while factoring (cuSOLVER's
                         // workspace, a small fraction of the matrix, is not counted)
    int64_t fallbacks;   // out: the factorisations that do not fit and run on the CPU
} lm_hess_plan_factor;

// The most memory lm_hess_ucc2_model's finishing pass holds at once for the accumulators of p
// (those on the device counted when count_dev; host_copies: the host-side accumulators that
// batches run on the CPU add beside those on the device) and its scratch: each Hessian is read
// into a float32 matrix of the widest size, its accumulators released, and its U_cc² computed
// from a double copy, factored in place there or, on an accelerator (f not NULL, with a
// budget), copied to it when it fits; f's outputs are filled. With p->n_acc 0 (Hessians read
// one at a time from elsewhere) only the scratch counts.
uint64_t lm_hess_plan_finish(const lm_hess_plan *p, const lm_model *m, bool count_dev, bool host_copies,
                             lm_hess_plan_factor *f);

#endif
