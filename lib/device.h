// The device interface: one vtable, many devices, in the manner of ggml's backends. A device
// reports its name and memory, allocates buffers, copies between host and device, and runs
// the operations merging needs on float32 data (conversion, GEMM for LoRA deltas, radix
// histograms for exact top-k selection, top-k and random masks, L1 reductions, sign election
// with disjoint merge). Merge code calls only these functions, never OpenBLAS or cuBLAS, so
// one code path runs on every device. Pointers passed to operations point into device
// memory obtained from lm_dev_alloc (on the CPU backend that is host memory).
//
// Out of memory on a device is LM_ERR_DEVICE_OOM, distinct from every other failure and never
// an abort: it is the status that makes a caller fall back to the CPU for that unit.
//
// Every operation is deterministic: the result does not depend on the thread count or on how
// work is split (reductions sum fixed blocks in a fixed order), and the random masks are a pure
// function of their key and element index, so devices agree bit for bit on masks.
#ifndef LM_DEVICE_H
#define LM_DEVICE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "dtype.h"
#include "status.h"

// A device: opaque here. The backends fill in its vtable (device_impl.h, for backends only);
// callers ask what it can do with lm_dev_supports and call the lm_dev_* functions below.
typedef struct lm_dev lm_dev;

// The operations a device may lack, for lm_dev_supports. Every other lm_dev_* operation runs
// on every device (some through a default the dispatcher supplies).
typedef enum lm_op {
    LM_OP_SYRK,        // lm_dev_syrk (where it is missing callers use lm_dev_gemm)
    LM_OP_POTRF,       // lm_dev_potrf
    LM_OP_IMPORTANCE,  // lm_dev_importance and lm_dev_topk_apply_by: selection by importance
    LM_OP_DENSE,       // the fused dense operations (lm_dev_dense_hist, _merge, _gram)
    LM_OP_COUNTS,      // the counting conversions (lm_dev_to_f32_count, ...)
    LM_OP_FORWARD,     // the forward pass's operations: lm_dev_gemm, lm_dev_gather_rows, ...
} lm_op;

// Whether d runs operation (or group) op.
bool lm_dev_supports(const lm_dev *d, lm_op op);

// LM_OK when d runs op, else LM_ERR_UNSUPPORTED with a message naming the device and the first
// operation of the group it lacks ("cpu: the operation rope is not implemented on this
// device").
lm_status lm_dev_require(lm_dev *d, lm_op op, lm_err *err);

// The CPU threads d uses for host-side work (the pool of the CPU backend, the sim's, CUDA's
// host loops).
int lm_dev_threads(const lm_dev *d);

// Whether d's pointers are host pointers: operations may then read host memory (an mmapped
// input) directly, with no upload. True of the CPU backend only.
bool lm_dev_host_memory(const lm_dev *d);

// What lm_dev_combine and the fused dense operations compute (which parts, how each is
// sparsified and rescaled, the combination rule) is the merge's to say: it is described by
// merge_desc.h, which callers and backends include. Here the types are only named.
typedef struct lm_dense_part lm_dense_part;
typedef struct lm_combine_how lm_combine_how;

// The caller's own work, done on the calling thread while an operation that takes it runs (on
// the CPU the other threads start on the operation's tasks meanwhile): fn(ctx) is called
// exactly once before the operation returns, whatever it returns.
typedef struct lm_dev_side {
    void (*fn)(void *ctx);
    void *ctx;
} lm_dev_side;

// The CPU backend (OpenBLAS for GEMM, a thread pool for the element-wise work).
lm_status lm_dev_cpu_create(lm_dev **out, int threads, lm_err *err);

// The CPU device that d's units fall back to, and that does d's host-side work: d itself when
// d is the CPU; otherwise a CPU device of lm_dev_threads(d) threads, created on the first call
// and the same one on every later call, owned by d and destroyed with it (lm_dev_destroy), so
// the caller never frees *cpu. Creating it can fail as lm_dev_cpu_create does.
lm_status lm_dev_cpu_companion(lm_dev *d, lm_dev **cpu, lm_err *err);

// The CPU backend's factorisation (lm_dev_potrf's on the CPU) of host memory, for callers that
// have no CPU device at hand: LAPACKE's dpotrf in place, U's diagonal to diag. LM_ERR_FORMAT
// with *info the order of the leading minor that is not positive definite; err is not touched.
lm_status lm_cpu_potrf(double *a, int64_t n, double *diag, int *info);

// The simulated accelerator (backends/sim/sim.c): buffers of its own in host memory, reachable
// only through upload and download (host_memory is false), a hard budget of `budget` bytes of
// live allocations beyond which lm_dev_alloc is LM_ERR_DEVICE_OOM, and the operations of the
// CPU backend run on its buffers. `fail` is the fault switch: "alloc:N" makes the Nth allocation
// and "launch:N" the Nth operation (copies included) fail with LM_ERR_DEVICE, to test the
// paths that must not fall back; NULL or "" for none, anything else LM_ERR_USAGE.
lm_status lm_dev_sim_create(lm_dev **out, uint64_t budget, const char *fail, int threads, lm_err *err);

// The CUDA backend (backends/cuda/cuda.cu), in builds with CUDA only (LLMERGE_HAVE_CUDA):
// device `ordinal`, taking at most mem_cap bytes of its memory (0: no cap). A missing device
// or driver is LM_ERR_USAGE naming it.
lm_status lm_dev_cuda_create(lm_dev **out, int ordinal, uint64_t mem_cap, int threads, lm_err *err);

// Destroys the device and everything it holds, its CPU companion included; safe on NULL.
void lm_dev_destroy(lm_dev *d);

const char *lm_dev_name(lm_dev *d);
void lm_dev_mem_info(lm_dev *d, size_t *free_bytes, size_t *total_bytes);

// Allocates `size` bytes of device memory into *ptr. LM_ERR_DEVICE_OOM when it does not fit
// (the message names the size and the device), never an abort. Free with lm_dev_buf_free.
lm_status lm_dev_alloc(lm_dev *d, size_t size, void **ptr, lm_err *err);
// Frees a buffer lm_dev_alloc gave (d keeps running); safe on NULL.
void lm_dev_buf_free(lm_dev *d, void *ptr);

// Copies n bytes host → device (upload) or device → host (download).
lm_status lm_dev_upload(lm_dev *d, void *dst, const void *src, size_t n, lm_err *err);
lm_status lm_dev_download(lm_dev *d, void *dst, const void *src, size_t n, lm_err *err);
lm_status lm_dev_sync(lm_dev *d, lm_err *err);
// The device's error state: a failure kept from a call that could not report it (a release,
// mem_info) or a fault of work still in flight (waited for), as LM_ERR_DEVICE with the
// device's message; LM_OK when there is none. Starts no work and is not an operation (the sim
// device's fault switch does not count it). The callers run it at the end of every unit that
// can fall back (lm_fallback_run) and of every merge, so that a fault is never left unreported.
lm_status lm_dev_check(lm_dev *d, lm_err *err);

// ---- operations (all pointers are device memory) ---------------------------------------------

// dst[0..n) = float32 of src (dtype dt); LM_ERR_UNSUPPORTED for a dtype llmerge cannot read.
lm_status lm_dev_to_f32(lm_dev *d, float *dst, const void *src, lm_dtype dt, int64_t n, lm_err *err);
// dst (dtype dt) = src rounded to nearest even, every NaN written as the dtype's canonical quiet
// NaN (dtype.h) whatever its sign and payload in src, so every device writes the same bits.
lm_status lm_dev_from_f32(lm_dev *d, void *dst, lm_dtype dt, const float *src, int64_t n, lm_err *err);

// Row-major C[m,n] = alpha · op(A) op(B) + beta · C, op transposing when ta / tb is set
// (op(A) is [m,k], op(B) is [k,n]); lda, ldb, ldc are row strides of A, B, C as stored. A
// product without transposes of rank k <= LM_DEV_LOWRANK_MAX (a LoRA pair's B @ A) gives each
// element as the fused multiply-add chain Σ A[i,q]·B[q,j] in q order, then times alpha, whatever
// the shape, on every device (the same bits on the CPU and CUDA): the fused dense operations
// make LoRA products the same way. Other products agree across devices to float32 rounding.
#define LM_DEV_LOWRANK_MAX 64
lm_status lm_dev_gemm(lm_dev *d, bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha,
                      const float *a, int64_t lda, const float *b, int64_t ldb, float beta,
                      float *c, int64_t ldc, lm_err *err);

// Symmetric rank-k update of the row-major C[n,n]: C = alpha · Aᵀ A + beta · C with A stored
// [k,n] (row stride lda), computed on the upper triangle only (row <= col), half the work of
// lm_dev_gemm(d, true, false, n, n, k, ...). The strictly lower triangle is left as it was, or,
// with `mirror`, overwritten afterwards with the transpose of the upper one; k = 0 with
// beta = 1 and mirror (a may then be NULL) only completes C. Optional: a device without it
// (lm_dev_supports(d, LM_OP_SYRK) false) answers LM_ERR_UNSUPPORTED, and callers use lm_dev_gemm
// instead.
lm_status lm_dev_syrk(lm_dev *d, int64_t n, int64_t k, float alpha, const float *a, int64_t lda, float beta,
                      bool mirror, float *c, int64_t ldc, lm_err *err);

// y = a·y + b·x over n elements.
lm_status lm_dev_axpby(lm_dev *d, float *y, float a, const float *x, float b, int64_t n, lm_err *err);

// tau = float32 of src (dtype dt) − base: a dense task vector in one pass. The same values as
// lm_dev_to_f32 followed by lm_dev_axpby(tau, 1, base, −1).
lm_status lm_dev_delta(lm_dev *d, float *tau, const void *src, lm_dtype dt, const float *base, int64_t n,
                       lm_err *err);

// DoRA task vector per output row (rows × cols, row-major): with ΔW in `tau` on entry,
// W' = base + ΔW and tau = magnitude[r] / ‖W'[r,:]‖ · W'[r,:] − base[r,:].
lm_status lm_dev_dora_rows(lm_dev *d, float *tau, const float *base, const float *magnitude,
                           int64_t rows, int64_t cols, lm_err *err);

// Adds to the host array hist[65536] a histogram of |x| by float bits: level 0 counts the top
// 16 bits of each |x|; level 1 counts the low 16 bits of those whose top 16 bits are hi_bin.
// Two levels find the exact k-th largest magnitude (lm_topk_* in sparsify.h).
lm_status lm_dev_hist_abs(lm_dev *d, uint64_t *hist, const float *x, int64_t n, int level,
                          uint32_t hi_bin, lm_err *err);

// The counts near an expected threshold, in one pass: adds to *above how many |x| have their
// top 16 bits at or beyond lo_bin + n_win, and to win[w·65536 .. (w+1)·65536) what
// lm_dev_hist_abs level 1 with hi_bin = lo_bin + w adds, for w < n_win (LM_HIST_WINDOW at
// most). When the k-th largest magnitude lies in the window, these counts find it exactly
// (lm_topk_window in sparsify.h) without the full histograms' two passes.
lm_status lm_dev_hist_window(lm_dev *d, uint64_t *above, uint64_t *win, int n_win, uint32_t lo_bin, const float *x,
                             int64_t n, lm_err *err);

// Zeroes every x[j] not kept: kept are |x| bits > thr_bits, and those == thr_bits among the
// first ties_allowed of them in index order. *ties_used gets how many ties were kept; with
// ties_allowed == LM_TIES_ALL (sparsify.h) every tie is kept without counting, *ties_used 0.
lm_status lm_dev_topk_apply(lm_dev *d, float *x, int64_t n, uint32_t thr_bits, int64_t ties_allowed,
                            int64_t *ties_used, lm_err *err);

// The complement of lm_dev_topk_apply: zeroes every x[j] that it would keep (|x| bits >
// thr_bits, and the first ties_allowed of those == thr_bits in index order) and keeps the others.
// *ties_used gets how many ties were zeroed. For the outliers breadcrumbs removes.
lm_status lm_dev_topk_drop(lm_dev *d, float *x, int64_t n, uint32_t thr_bits, int64_t ties_allowed,
                           int64_t *ties_used, lm_err *err);

// lm_dev_topk_apply with the decision taken on key[j] instead of x[j]: zeroes every x[j] whose
// key is not kept (key is not changed). For selection by importance (sparsegpt).
lm_status lm_dev_topk_apply_by(lm_dev *d, float *x, const float *key, int64_t n, uint32_t thr_bits,
                               int64_t ties_allowed, int64_t *ties_used, lm_err *err);

// sparsegpt's Hessian importance (docs/merging.md "The methods") for a rows × cols task vector:
// key[r, c] = float32 of τ[r, c]² / ucc2[c] computed in double, ucc2 (cols doubles, device
// memory) being U_cc² of the Cholesky factor U of the damped H⁻¹ (lm_hess_ucc2).
lm_status lm_dev_importance(lm_dev *d, float *key, const float *tau, const double *ucc2, int64_t rows, int64_t cols,
                            lm_err *err);

// The Cholesky factorisation of an n × n symmetric positive definite matrix of doubles, in
// place, as LAPACK's dpotrf with uplo 'U' (LAPACKE on the CPU, cuSOLVER on CUDA): `a` is read
// column-major, its upper triangle only, and that triangle becomes U with a = Uᵀ U (the strict
// lower triangle is undefined afterwards); diag (n doubles, device memory) gets U's diagonal. A
// matrix that is not positive definite is LM_ERR_FORMAT; LM_ERR_UNSUPPORTED on a device without
// the operation, and when n does not fit in an int. Devices block their factorisations
// differently: U agrees between them to rounding, not bit for bit.
lm_status lm_dev_potrf(lm_dev *d, double *a, int64_t n, double *diag, lm_err *err);

// Stored top-k masks (the sparsegpt cache): bitmaps in host memory, bit b of a tensor in byte
// b / 8 at bit b % 8, set where the entry is kept. A slab starting at element `first` of its
// tensor reads and writes bits first .. first + n − 1.

// The bytes of the bitmap of a tensor of numel elements.
static inline size_t lm_dev_mask_bytes(int64_t numel)
{
    return numel > 0 ? (size_t)((numel + 7) / 8) : 0;
}

// Sets bit first + j of bits where x[j] != 0 and clears it where x[j] is zero, for j < n; the
// other bits are unchanged. After a top-k trim these are the entries it kept (a kept zero is
// recorded as dropped: zeros take no part in an election, so the output is the same).
lm_status lm_dev_mask_get(lm_dev *d, uint8_t *bits, int64_t first, const float *x, int64_t n, lm_err *err);

// Zeroes x[j] (to +0.0) where bit first + j of bits is clear, for j < n: the trim a stored mask
// records, in place of selecting it again.
lm_status lm_dev_mask_apply(lm_dev *d, float *x, const uint8_t *bits, int64_t first, int64_t n, lm_err *err);

// Zeroes x[j] unless lm_rng_keep(key, first + j, keep_below) (sparsify.h): a random mask that
// is a pure function of the key and the element's index in its whole tensor.
lm_status lm_dev_random_drop(lm_dev *d, float *x, int64_t n, uint64_t key, int64_t first,
                             uint64_t keep_below, lm_err *err);

// *out = Σ |x[j]| in double, summed in fixed blocks in a fixed order.
lm_status lm_dev_l1(lm_dev *d, const float *x, int64_t n, double *out, lm_err *err);

// A row's dot product is added in LM_DOT_LANES lanes, on every device: the product of column
// c (in double, exact for float32 factors) goes to lane c mod 16, each lane adds its products
// in column order, and the row's sum is the lanes added in pairs, a tree: lane l += lane l + 1
// for even l, then lane l += lane l + 2 for l a multiple of 4, then by 4, then by 8, lane 0
// holding the sum. Sixteen independent chains of additions instead of one, so the sum is bound
// by memory rather than by the latency of an addition, in an order fixed by the column alone.
#define LM_DOT_LANES 16

// out[r] = Σ_c x[r, c]·y[r, c] for each row r of two rows × cols matrices, in double, in the
// lanes above, so the same bits on every device and thread count (and a caller that adds the
// rows in order gets a whole-tensor sum that does not depend on how the rows were split). out
// is host memory (rows values); x may equal y (squared norms).
lm_status lm_dev_row_dot(lm_dev *d, const float *x, const float *y, int64_t rows, int64_t cols, double *out,
                         lm_err *err);

// acc[c] += Σ_r x[r, c]·y[r, c] for each column c of two rows × cols matrices: each product in
// double added to acc[c] row after row, in row order, so a caller that goes through a tensor's
// rows in order gets the same bits however they were split. acc is host memory (cols values).
lm_status lm_dev_col_dot(lm_dev *d, const float *x, const float *y, int64_t rows, int64_t cols, double *acc,
                         lm_err *err);

// y[r, c] = a[c]·y[r, c] + b[c]·x[r, c] for each column c (a, b host arrays of cols values), in
// float32 as lm_dev_axpby computes each element (x may equal y).
lm_status lm_dev_col_axpby(lm_dev *d, float *y, const float *a, const float *x, const float *b, int64_t rows,
                           int64_t cols, lm_err *err);

// key[j] = the variance of the n_models values τ_0[j], ..., τ_{k-1}[j] and n_models − k zeros
// (the models that do not change the tensor): Σ (x − mean)² / n_models, mean = Σ x / n_models,
// in double, rounded to float32 (sce's selection key). taus is a host array of k device pointers.
lm_status lm_dev_tau_var(lm_dev *d, float *key, const float *const *taus, int k, int n_models, int64_t n,
                         lm_err *err);

// y[r, c] = a[r]·y[r, c] + b[r]·x[r, c] for each row r of two rows × cols matrices, in float32 as
// lm_dev_axpby computes each element (x may equal y). a and b are host arrays (rows values each).
lm_status lm_dev_row_axpby(lm_dev *d, float *y, const float *a, const float *x, const float *b, int64_t rows,
                           int64_t cols, lm_err *err);

// DELLA's random drop of a rows × cols slab whose first element is element `first` of its
// tensor: in each row the entries are ranked by magnitude (r = 0 the smallest; equal magnitudes
// by index, the lower first) and entry j of rank r is kept with probability
// p = lm_della_p(r, cols, p_lo, p_hi), decided by lm_rng_keep(key, first + j, ...) and, with
// inv, multiplied by 1/p (lm_della_keep: the same bits on every device).
lm_status lm_dev_della_drop(lm_dev *d, float *x, int64_t rows, int64_t cols, uint64_t key, int64_t first, double p_lo,
                            double p_hi, bool inv, lm_err *err);

// NearSwap's step per element: x[j] = w·x[j] with w = min(1, max(0, t / max(|x[j]|, 1e-6))),
// in float32: entries of τ within t of zero are kept whole, larger ones pulled to ±t.
lm_status lm_dev_nearswap(lm_dev *d, float *x, int64_t n, float t, lm_err *err);

// The combination of docs/merging.md "The methods" for k task vectors w_tau[i] (each already
// sparsified and rescaled, not yet weighted) with weights[i]: W_i = weights[i]·w_tau[i]; with an
// election, Δ = Σ_i [sign(W_i) = s] W_i and the divisor Σ_i weights[i]·[sign(W_i) = s]; without,
// Δ = Σ_i W_i and the divisor Σ_i weights[i] (LM_COMBINE_SIGN_NONZERO: of the parts whose
// w_tau[i] is not zero there); with normalize Δ /= divisor where it is not 0.
// LM_COMBINE_SIGN_RAMPLUS instead: Δ = W_i where w_tau[i] is the only part not zero, the
// unweighted mean of the parts not zero where there are several, 0 where there are none.
// out = base + lambda·Δ. out may equal base. The election (s from Σ W_i, Σ sign(W_i), or for
// LM_COMBINE_SIGN_TAU the unweighted Σ w_tau[i]), normalize and lambda are how's
// (merge_desc.h); its other fields are lm_dev_dense_merge's and not read here.
lm_status lm_dev_combine(lm_dev *d, float *out, const float *base, const float *const *w_tau,
                         const float *weights, int k, int64_t n, lm_combine_how how, lm_err *err);

// ---- fused dense operations -------------------------------------------------------------------
// For full fine-tuned models and LoRA pairs on a device whose memory is the host's (the CPU): the
// inputs are read where they are mapped (a LoRA τ is made from its factors), and each τ lives in
// a few hundred elements of cache instead of a float32 buffer in memory, so a pass over a
// tensor moves its 16-bit inputs and nothing else.
// Their results are exactly those of the separate operations they replace.
// lm_dev_supports(d, LM_OP_DENSE) says whether d has them; they are LM_ERR_UNSUPPORTED where it
// does not.

// For each part whose win is not NULL: the window counts of |τ_i| over n elements, added as
// lm_dev_hist_window(above, win, n_win, lo_bin, τ_i, n) adds them. base and every src are read
// as dtype (readable dtypes only).
lm_status lm_dev_dense_hist(lm_dev *d, const void *base, lm_dtype base_dt, lm_dense_part *parts, int k, int64_t n,
                            lm_err *err);

// The dot products of the base and the parts' τ over each row of a rows × cols slab, read and
// made as lm_dev_dense_merge reads and makes them: out (host memory, rows × (1 + k +
// k(k+1)/2) doubles, row-major) holds per row base·base, then base·τ_i for each part, then
// τ_i·τ_j for each i and j <= i in that order; each the bits lm_dev_row_dot gives for the
// same vectors.
lm_status lm_dev_dense_gram(lm_dev *d, const void *base, lm_dtype base_dt, lm_dense_part *parts, int k, int64_t rows,
                            int64_t cols, double *out, lm_err *err);

// out (n elements of out_dt, host memory) = the combination of the k parts' τ, each trimmed or
// dropped and rescaled as its fields say, with `base`: bit for bit what lm_dev_to_f32 of base,
// lm_dev_delta, lm_dev_topk_apply (then lm_dev_topk_drop for a band) or lm_dev_random_drop,
// lm_dev_axpby, then lm_dev_combine (or the axpby sequence of how.linear) and lm_dev_from_f32
// give. The NaN and Inf among the values read and written are counted where how.base_nf,
// how.out_nf and each part's nf ask.
lm_status lm_dev_dense_merge(lm_dev *d, void *out, lm_dtype out_dt, const void *base, lm_dtype base_dt,
                             lm_dense_part *parts, int k, int64_t n, lm_combine_how how, lm_err *err);
// lm_dev_dense_merge, with the caller's work `side` (NULL: none) done meanwhile.
lm_status lm_dev_dense_merge_side(lm_dev *d, void *out, lm_dtype out_dt, const void *base, lm_dtype base_dt,
                                  lm_dense_part *parts, int k, int64_t n, lm_combine_how how,
                                  const lm_dev_side *side, lm_err *err);

// ---- counting conversions ---------------------------------------------------------------------
// lm_dev_to_f32, lm_dev_delta and lm_dev_from_f32 that also add to *nf the NaN and Inf among the
// values they convert (as lm_convert_to_f32_nf and lm_convert_from_f32_nf count them: the src
// values read, the dst values written), counted in the loops that convert. On devices whose
// memory is the host's (the CPU); lm_dev_supports(d, LM_OP_COUNTS) says whether d has them, and
// they are LM_ERR_UNSUPPORTED where it does not.

lm_status lm_dev_to_f32_count(lm_dev *d, float *dst, const void *src, lm_dtype dt, int64_t n, lm_nonfinite *nf,
                              lm_err *err);
lm_status lm_dev_delta_count(lm_dev *d, float *tau, const void *src, lm_dtype dt, const float *base, int64_t n,
                             lm_nonfinite *nf, lm_err *err);
lm_status lm_dev_from_f32_count(lm_dev *d, void *dst, lm_dtype dt, const float *src, int64_t n, lm_nonfinite *nf,
                                lm_err *err);

// ---- forward-pass operations (forward.h) -----------------------------------------------------
// Activations are row-major float32 matrices in device memory, one row per token of a packed
// batch; int32 arrays (ids, positions, targets) are device memory too. Each output element is
// computed by one fixed sequence of float operations, so results do not depend on the thread
// count or on which other rows share the batch. A device that lacks one of these answers
// LM_ERR_UNSUPPORTED naming the operation (lm_dev_require(d, LM_OP_FORWARD) checks them all
// beforehand).

// out[i, :] = table[ids[i], :] for i < n (table is [table_rows, cols]): embedding lookup. An id
// outside [0, table_rows) is the caller's error; the row written for it is zeros, and nothing
// outside the table is read.
lm_status lm_dev_gather_rows(lm_dev *d, float *out, const float *table, int64_t table_rows, int64_t cols,
                             const int32_t *ids, int64_t n, lm_err *err);

// y[r, c] += b[c] for every row r of the rows × cols matrix y: a bias added to each token.
lm_status lm_dev_add_rows(lm_dev *d, float *y, const float *b, int64_t rows, int64_t cols, lm_err *err);

// RMSNorm of each row: out[r, :] = w ⊙ (x[r, :] · g) with g = 1/sqrt(mean(x[r, :]²) + eps), the
// mean and g computed in double and g rounded to float32, the products in float32 (Hugging
// Face's LlamaRMSNorm on float32 input, its reduction more precise). out may equal x.
lm_status lm_dev_rmsnorm(lm_dev *d, float *out, const float *x, const float *w, int64_t rows, int64_t cols,
                         float eps, lm_err *err);

// Rotary embedding in place, half-split (not interleaved): x is rows × (heads·head_dim), each
// head's vector x_h of head_dim (even) values rotated by position pos[r]: with
// a_i = float32(float32(pos[r]) · inv_freq[i]) for i < head_dim/2 (inv_freq a device array of
// head_dim/2 floats), c_i = cos a_i, s_i = sin a_i (rounded to float32),
// x_h[i] ← x_h[i]·c_i − x_h[i + half]·s_i and x_h[i + half] ← x_h[i + half]·c_i + x_h[i]·s_i
// (q·cos + rotate_half(q)·sin of docs/formats.md "The forward pass").
lm_status lm_dev_rope(lm_dev *d, float *x, int64_t rows, int64_t heads, int64_t head_dim, const int32_t *pos,
                      const float *inv_freq, lm_err *err);

// Causal self-attention over a packed batch. q and out are rows × (heads·head_dim), k and v
// rows × (kv_heads·head_dim); heads is a multiple of kv_heads and query head h reads kv head
// h / (heads / kv_heads) (GQA). Row r attends to the rows j with start[r] <= j <= r (start[r]:
// the first row of r's sequence, so sequences packed back to back never see each other):
// out_h[r] = Σ_j softmax_j(scale · q_h[r]·k_g[j]) v_g[j], the softmax in float32 with its
// running maximum subtracted. A start[r] outside [0, r] is the caller's error; it is clamped.
lm_status lm_dev_attention(lm_dev *d, float *out, const float *q, const float *k, const float *v,
                           const int32_t *start, int64_t rows, int64_t heads, int64_t kv_heads,
                           int64_t head_dim, float scale, lm_err *err);

// gate[i] = silu(gate[i]) · up[i] over n elements, silu(x) = x / (1 + e^−x): the SiLU-gated
// MLP's product, in place.
lm_status lm_dev_silu_mul(lm_dev *d, float *gate, const float *up, int64_t n, lm_err *err);

// Negative log-likelihood per row of the rows × cols logits: with m the row's maximum,
// nll[r] = m + log Σ_c e^(logits[r, c] − m) − logits[r, targets[r]] (a stable log-softmax; the
// exponentials in float32, their sum and the logarithm in double, the result rounded to
// float32). Rows whose target is outside [0, cols) (−1: no next token) get nll 0.
lm_status lm_dev_nll_rows(lm_dev *d, float *nll, const float *logits, const int32_t *targets, int64_t rows,
                          int64_t cols, lm_err *err);

#endif
