// CUDA kernels and their host entry points, built only when the CUDA toolkit is found
// (LLMERGE_CUDA). Every entry point returns an lm_status: a failed device allocation is
// LM_ERR_DEVICE_OOM and any other CUDA failure LM_ERR_DEVICE with the failing statement, file
// and line in the message; nothing here aborts. Pointers named d_* are device memory.
#ifndef LM_KERNELS_H
#define LM_KERNELS_H

#include <stdbool.h>
#include <stdint.h>

#include "dtype.h"
#include "status.h"

#ifdef __cplusplus
extern "C" {
#endif

// Sets *count to the number of CUDA devices (0 when the driver finds none: that is not an
// error). A driver that cannot serve this build's runtime is LM_ERR_DEVICE saying why: no
// driver installed, or one older than the runtime (with both CUDA versions), or the runtime's
// own error. Defined in cuda.cu.
lm_status lm_cuda_device_count(int *count, lm_err *err);

struct lm_dev;
// What CUDA device d, opened, does without, as one line for the user ("Cholesky factorisations
// on the CPU: cannot load libcusolver.so.12 (...)"), or NULL: it lacks nothing, or it is not a
// CUDA device. The text is d's, valid until d is destroyed.
const char *lm_cuda_device_note(struct lm_dev *d);

// Converts n elements of d_src (F32, F16, BF16 or F64) to float32 in d_dst on `stream`
// (a cudaStream_t, NULL for the default stream), with the same rounding as the CPU loops.
lm_status lm_cuda_convert_to_f32(float *d_dst, const void *d_src, lm_dtype dt, int64_t n,
                                 void *stream, lm_err *err);

// Converts n float32 values to F32, F16 or BF16, rounding to nearest even as the CPU does, every
// NaN written as the dtype's canonical NaN (dtype.h), F32 included (there d_dst may equal d_src).
lm_status lm_cuda_convert_from_f32(void *d_dst, lm_dtype dt, const float *d_src, int64_t n,
                                   void *stream, lm_err *err);

// The test operation run before a device is trusted: allocates on `device`, converts a block
// of edge-case values (NaN, Inf, subnormals, ties) to BF16 and F16 and back on the device,
// copies the results home and compares them bit for bit with the CPU conversions.
lm_status lm_cuda_selftest(int device, lm_err *err);

// Loads cuBLAS and cuSOLVER as a CUDA device does when it opens (cuda_libs.h), without a
// device: LM_ERR_DEVICE naming the library that cannot be opened or the function it lacks.
lm_status lm_cuda_load_libs(lm_err *err);

// ---- merge operations (merge_ops.cu) --------------------------------------------------------
// The arithmetic of the CPU backend per element, in the same order, so results match the CPU
// backend bit for bit wherever it can (everything but the GEMMs cuBLAS makes). Each function only enqueues
// work on `stream` (a cudaStream_t): results are ready once the stream has reached them, and
// faults during a kernel surface at the next synchronising call. n == 0 launches nothing.

// Elements per partial sum of lm_cuda_l1_blocks: the CPU backend's BLOCK, which the CPU's L1 sum
// is split by. The two must stay equal for the sums to agree bit for bit.
#define LM_CUDA_L1_BLOCK 65536
// Elements per count of lm_cuda_tie_counts.
#define LM_CUDA_TIE_CHUNK 16384
// The most task vectors lm_cuda_combine takes in one call (they travel as kernel arguments).
#define LM_CUDA_COMBINE_MAX 256

// Row-major d_c[m,n] = alpha * op(A) op(B) + beta * d_c with cuBLAS (`blas`, a cublasHandle_t
// bound to the stream the caller wants): lm_dev_gemm's contract to float32 rounding (cuda.cu
// makes the low-rank products with lm_cuda_lowrank instead, bit for bit). LM_ERR_UNSUPPORTED
// when a dimension or stride does not fit in an int, as on the CPU.
lm_status lm_cuda_sgemm(void *blas, bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha,
                        const float *d_a, int64_t lda, const float *d_b, int64_t ldb, float beta, float *d_c,
                        int64_t ldc, void *stream, lm_err *err);

// lm_dev_syrk on row-major device matrices with cuBLAS (cublasSsyrk on the transposes, which are
// column-major): the upper triangle of d_c[n,n] = alpha * AᵀA + beta * d_c for A = d_a[k,n], to
// float32 rounding; the strictly lower triangle untouched, or with `mirror` overwritten with the
// transpose of the upper one. k == 0 scales the upper triangle by beta (beta 0 stores zeros).
// LM_ERR_UNSUPPORTED when a dimension or stride does not fit in an int, LM_ERR_DEVICE_OOM when
// cuBLAS lacks workspace.
lm_status lm_cuda_syrk(void *blas, int64_t n, int64_t k, float alpha, const float *d_a, int64_t lda, float beta,
                       bool mirror, float *d_c, int64_t ldc, void *stream, lm_err *err);

// The low-rank product of lm_dev_gemm's contract (no transposes, rank k <= LM_DEV_LOWRANK_MAX):
// row-major d_c[i, j] = alpha * (the fused multiply-add chain over q = 0 .. k-1, in order, of
// d_a[i, q] * d_b[q, j]) (+ beta * d_c[i, j] unless beta is 0, d_c then not read), for i < m,
// j < n, with row strides lda, ldb, ldc: the CPU backend's low-rank kernel bit for bit. k == 0
// gives alpha * 0 (+ beta * d_c), as on the CPU. LM_ERR_UNSUPPORTED when a dimension or stride
// does not fit in an int (as lm_cuda_sgemm and the CPU), LM_ERR_DEVICE for a negative size or k
// above LM_DEV_LOWRANK_MAX.
lm_status lm_cuda_lowrank(float *d_c, int64_t ldc, const float *d_a, int64_t lda, const float *d_b, int64_t ldb,
                          int64_t m, int64_t n, int64_t k, float alpha, float beta, void *stream, lm_err *err);

// d_y = a * d_y + b * d_x over n elements (d_x may equal d_y).
lm_status lm_cuda_axpby(float *d_y, float a, const float *d_x, float b, int64_t n, void *stream, lm_err *err);

// lm_dev_delta: d_tau = float32 of d_src (F32, F16, BF16 or F64) - d_base over n elements, in
// one pass. LM_ERR_UNSUPPORTED for any other dtype.
lm_status lm_cuda_delta(float *d_tau, const void *d_src, lm_dtype dt, const float *d_base, int64_t n, void *stream,
                        lm_err *err);

// lm_dev_importance: d_key[r, c] = float32 of d_tau[r, c]² / d_ucc2[c] in double, for rows x cols
// row-major d_tau and d_key, d_ucc2 (cols doubles).
lm_status lm_cuda_importance(float *d_key, const float *d_tau, const double *d_ucc2, int64_t rows, int64_t cols,
                             void *stream, lm_err *err);

// lm_dev_dora_rows on rows x cols row-major d_tau and d_base, d_mag (rows).
lm_status lm_cuda_dora_rows(float *d_tau, const float *d_base, const float *d_mag, int64_t rows, int64_t cols,
                            void *stream, lm_err *err);

// Adds to the device histogram d_hist[65536] (which the caller zeroes) the level-0 or level-1
// histogram of lm_dev_hist_abs.
lm_status lm_cuda_hist_abs(uint64_t *d_hist, const float *d_x, int64_t n, int level, uint32_t hi_bin,
                           void *stream, lm_err *err);

// Part of lm_dev_hist_window for n <= UINT32_MAX elements (the counts are 32 bits wide; the
// caller splits longer arrays), in device counts the caller zeroes: adds to the n_win x 65536
// counts d_win the level-1 histograms of bins lo_bin .. lo_bin + n_win - 1 and, when d_above
// is not NULL, to *d_above how many magnitudes have their top 16 bits at or beyond above_from.
// So a window can be counted a group of bins at a time (above_from: the whole window's end).
// LM_ERR_DEVICE for n or n_win out of range.
lm_status lm_cuda_hist_window(uint32_t *d_above, uint32_t above_from, uint32_t *d_win, int n_win, uint32_t lo_bin,
                              const float *d_x, int64_t n, void *stream, lm_err *err);

// d_counts[c] = how many of d_x[c * LM_CUDA_TIE_CHUNK, ...) (the last chunk ragged) have
// magnitude bits == thr_bits, for every chunk c of the n elements. d_x holds the values that
// decide: the keys of lm_dev_topk_apply_by.
lm_status lm_cuda_tie_counts(uint32_t *d_counts, const float *d_x, int64_t n, uint32_t thr_bits, void *stream,
                             lm_err *err);

// *d_index = the index of the tie (magnitude bits == thr_bits) of rank `rank` (0 is the first)
// among d_x[lo, hi), which the caller knows to hold more than `rank` ties.
lm_status lm_cuda_tie_find(int64_t *d_index, const float *d_x, int64_t lo, int64_t hi, uint32_t thr_bits,
                           int64_t rank, void *stream, lm_err *err);

// Zeroes every d_x[i] except those whose d_key[i] has magnitude bits > thr_bits and the ties
// (bits == thr_bits) at indices below tie_end, read from *d_tie_end when that is not NULL (with
// drop: zeroes exactly those and keeps the others). d_key is d_x itself for plain top-k.
lm_status lm_cuda_topk_mask(float *d_x, const float *d_key, int64_t n, uint32_t thr_bits, int64_t tie_end,
                            const int64_t *d_tie_end, bool drop, void *stream, lm_err *err);

// The packing half of lm_dev_mask_get on one byte-aligned run of bits: bit s + j of d_bytes
// (byte (s + j) / 8, bit (s + j) % 8) set where d_x[j] != 0, clear where it is zero, for j < n,
// 0 <= s < 8; the other bits of the (s + n + 7) / 8 bytes are clear (the caller merges them
// into its mask keeping its own bits there).
lm_status lm_cuda_mask_get(uint8_t *d_bytes, const float *d_x, int64_t n, int s, void *stream, lm_err *err);

// lm_dev_mask_apply on one byte-aligned run of bits: zeroes d_x[j] where bit s + j of d_bytes
// is clear, for j < n, 0 <= s < 8.
lm_status lm_cuda_mask_apply(float *d_x, const uint8_t *d_bytes, int64_t n, int s, void *stream, lm_err *err);

// lm_dev_random_drop.
lm_status lm_cuda_random_drop(float *d_x, int64_t n, uint64_t key, int64_t first, uint64_t keep_below,
                              void *stream, lm_err *err);

// d_partial[b] = sum of |d_x[i]| in double over block b of LM_CUDA_L1_BLOCK elements, added in
// index order, for each of the ceil(n / LM_CUDA_L1_BLOCK) blocks: the CPU's partial sums.
lm_status lm_cuda_l1_blocks(double *d_partial, const float *d_x, int64_t n, void *stream, lm_err *err);

// d_out[r] = sum of d_x[r, c]·d_y[r, c] in double over the columns, in order (lm_dev_row_dot).
lm_status lm_cuda_row_dot(double *d_out, const float *d_x, const float *d_y, int64_t rows, int64_t cols, void *stream,
                          lm_err *err);

// lm_dev_della_drop, d_sorted device scratch of lm_della_sort_bytes(rows, cols) (overwritten).
lm_status lm_cuda_della_drop(float *d_x, uint64_t *d_sorted, int64_t rows, int64_t cols, uint64_t key,
                             int64_t first, double p_lo, double p_hi, bool inv, void *stream, lm_err *err);

// lm_dev_tau_var for k <= LM_CUDA_COMBINE_MAX task vectors (d_tau a HOST array of device pointers).
lm_status lm_cuda_tau_var(float *d_key, const float *const *d_tau, int k, int n_models, int64_t n, void *stream,
                          lm_err *err);

// lm_dev_col_dot with the sums (cols doubles) in device memory, added to in place.
lm_status lm_cuda_col_dot(double *d_acc, const float *d_x, const float *d_y, int64_t rows, int64_t cols, void *stream,
                          lm_err *err);

// lm_dev_col_axpby with the column factors in device memory.
lm_status lm_cuda_col_axpby(float *d_y, const float *d_a, const float *d_x, const float *d_b, int64_t rows,
                            int64_t cols, void *stream, lm_err *err);

// lm_dev_row_axpby with the row factors in device memory.
lm_status lm_cuda_row_axpby(float *d_y, const float *d_a, const float *d_x, const float *d_b, int64_t rows,
                            int64_t cols, void *stream, lm_err *err);

// lm_dev_nearswap.
lm_status lm_cuda_nearswap(float *d_x, int64_t n, float t, void *stream, lm_err *err);

// lm_dev_combine for k <= LM_CUDA_COMBINE_MAX task vectors: d_tau is a HOST array of k device
// pointers and weights a host array of k floats (both copied into the kernel's arguments).
// elect: with sign election; count_signs: the elected sign is that of the sum of signs
// (LM_COMBINE_SIGN_COUNT), unweighted: of the sum of the task vectors (LM_COMBINE_SIGN_TAU),
// rather than of the weighted sum (LM_COMBINE_SIGN_SUM); nonzero (without elect): the weights
// summed for normalize are those of the parts not zero (LM_COMBINE_SIGN_NONZERO); ramplus: the
// rule of LM_COMBINE_SIGN_RAMPLUS (elect and normalize not read). d_out may equal d_base.
// LM_ERR_UNSUPPORTED above LM_CUDA_COMBINE_MAX.
lm_status lm_cuda_combine(float *d_out, const float *d_base, const float *const *d_tau, const float *weights, int k,
                          int64_t n, bool elect, bool count_signs, bool unweighted, bool nonzero, bool ramplus,
                          bool normalize, float lambda, void *stream, lm_err *err);

// ---- forward-pass operations (forward_ops.cu) -----------------------------------------------
// device.h's lm_dev_gather_rows ... lm_dev_nll_rows on device memory (the int32 arrays too),
// with the CPU backend's arithmetic: gather_rows, add_rows and rmsnorm agree with the CPU bit for
// bit, the others to float32 rounding (CUDA's expf, sin, cos and log may differ from glibc's in
// the last bit). Like the merge operations, each only enqueues work on `stream`.

// The largest head_dim lm_cuda_attention takes. Up to 128 a block takes 8 query rows of a head
// and tiles of 32 keys and values in shared memory; above, one row at a time, keeping the query
// and its accumulator in shared memory, 2 x head_dim floats with a tile of 128 scores, within
// the 48 KiB every GPU gives a block without opting in. Sequences are not limited: keys are
// taken in tiles.
#define LM_CUDA_ATTN_MAX_HEAD_DIM 4096

lm_status lm_cuda_gather_rows(float *d_out, const float *d_table, int64_t table_rows, int64_t cols,
                              const int32_t *d_ids, int64_t n, void *stream, lm_err *err);
lm_status lm_cuda_add_rows(float *d_y, const float *d_b, int64_t rows, int64_t cols, void *stream, lm_err *err);
lm_status lm_cuda_rmsnorm(float *d_out, const float *d_x, const float *d_w, int64_t rows, int64_t cols, float eps,
                          void *stream, lm_err *err);
lm_status lm_cuda_rope(float *d_x, int64_t rows, int64_t heads, int64_t head_dim, const int32_t *d_pos,
                       const float *d_inv_freq, void *stream, lm_err *err);
// LM_ERR_USAGE when heads is not a multiple of kv_heads (as on the CPU), LM_ERR_UNSUPPORTED
// for a head_dim above LM_CUDA_ATTN_MAX_HEAD_DIM.
lm_status lm_cuda_attention(float *d_out, const float *d_q, const float *d_k, const float *d_v,
                            const int32_t *d_start, int64_t rows, int64_t heads, int64_t kv_heads, int64_t head_dim,
                            float scale, void *stream, lm_err *err);
lm_status lm_cuda_silu_mul(float *d_gate, const float *d_up, int64_t n, void *stream, lm_err *err);
lm_status lm_cuda_nll_rows(float *d_nll, const float *d_logits, const int32_t *d_targets, int64_t rows,
                           int64_t cols, void *stream, lm_err *err);

// ---- the copy benchmark (bandwidth.cu) ------------------------------------------------------

// Measures cudaMemcpy between `bytes` of pinned host memory and device memory on `device`,
// reps times each way after a warm-up, in bytes per second (bench_merge's reference).
lm_status lm_cuda_memcpy_bandwidth(int device, size_t bytes, int reps, double *h2d, double *d2h, lm_err *err);

#ifdef __cplusplus
}
#endif

#endif
