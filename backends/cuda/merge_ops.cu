// Kernels and host launchers for the merge operations of the CUDA backend (cuda.cu):
// GEMM through cuBLAS, low-rank products (LoRA's B @ A) in the CPU's order, element-wise
// arithmetic (dense task vectors, Hessian importance), symmetric rank-k updates through cuBLAS
// (and their mirroring), DoRA row norms, magnitude histograms (whole, or a window of level-1
// bins), top-k masks by value or by key, random masks, stored masks packed and applied, L1
// partial sums and the sign-elected combination.
//
// Every per-element computation is the CPU backend's, written out in the same order, so that the
// results agree with the CPU backend bit for bit: this file is compiled with --fmad=false (no
// a*b+c contracted into an FMA, as GCC does not contract in ISO C mode), without fast-math, and
// double sums the CPU computes sequentially are computed sequentially here too (one warp per
// sum, lane 0's value added first: seq_sum.cuh). The low-rank products (LoRA's B @ A) are a kernel
// of their own in the CPU's order (k_lowrank); only the other GEMMs differ: cuBLAS and OpenBLAS
// block their dot products differently, so C agrees to float32 rounding there.
//
// The launchers only enqueue work on the stream they are given; nothing here synchronises,
// allocates or copies to the host (cuda.cu does that). Index arithmetic is int64_t
// throughout, loops are grid-stride with grids within every architecture's limits, and every
// launch is checked.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cuda_check.h"
#include "cuda_libs.h"
#include "kernels.h"
#include "seq_sum.cuh"

extern "C" {
#include "device.h"  // LM_DEV_LOWRANK_MAX
#include "sparsify.h"
}

#define THREADS 256   // threads per block of the element-wise kernels

static_assert(sizeof(unsigned long long) == sizeof(uint64_t), "atomicAdd on the histogram's uint64_t");

// ==== element-wise ============================================================================

__global__ void k_axpby(float *y, float a, const float *x, float b, int64_t n)
{
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        y[i] = a * y[i] + b * x[i];
}

// y[r, c] = a[r]·y[r, c] + b[r]·x[r, c] (a, b device arrays of rows floats): k_axpby per row.
__global__ void k_row_axpby(float *y, const float *a, const float *x, const float *b, int64_t rows, int64_t cols)
{
    int64_t n = rows * cols;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        int64_t r = i / cols;
        y[i] = a[r] * y[i] + b[r] * x[i];
    }
}

// acc[c] += Σ_r x[r, c]·y[r, c] in row order: one thread per column.
__global__ void k_col_dot(double *acc, const float *x, const float *y, int64_t rows, int64_t cols)
{
    for (int64_t c = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; c < cols; c += (int64_t)gridDim.x * blockDim.x) {
        double s = acc[c];
        for (int64_t r = 0; r < rows; r++)
            s += (double)x[r * cols + c] * (double)y[r * cols + c];
        acc[c] = s;
    }
}

// y[r, c] = a[c]·y[r, c] + b[c]·x[r, c] (a, b device arrays of cols floats).
__global__ void k_col_axpby(float *y, const float *a, const float *x, const float *b, int64_t rows, int64_t cols)
{
    int64_t n = rows * cols;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        int64_t c = i % cols;
        y[i] = a[c] * y[i] + b[c] * x[i];
    }
}

extern "C" lm_status lm_cuda_col_dot(double *d_acc, const float *d_x, const float *d_y, int64_t rows, int64_t cols,
                                     void *stream, lm_err *err)
{
    lm_status status = LM_OK;
    if (rows <= 0 || cols <= 0)
        return LM_OK;
    k_col_dot<<<lm_cuda_grid(cols, THREADS), THREADS, 0, (cudaStream_t)stream>>>(d_acc, d_x, d_y, rows, cols);
    CUDA_LAUNCHED("k_col_dot");
fail:
    return status;
}

extern "C" lm_status lm_cuda_col_axpby(float *d_y, const float *d_a, const float *d_x, const float *d_b, int64_t rows,
                                       int64_t cols, void *stream, lm_err *err)
{
    lm_status status = LM_OK;
    if (rows <= 0 || cols <= 0)
        return LM_OK;
    k_col_axpby<<<lm_cuda_grid(rows * cols, THREADS), THREADS, 0, (cudaStream_t)stream>>>(d_y, d_a, d_x, d_b, rows,
                                                                                          cols);
    CUDA_LAUNCHED("k_col_axpby");
fail:
    return status;
}

extern "C" lm_status lm_cuda_row_axpby(float *d_y, const float *d_a, const float *d_x, const float *d_b, int64_t rows,
                                       int64_t cols, void *stream, lm_err *err)
{
    lm_status status = LM_OK;
    if (rows <= 0 || cols <= 0)
        return LM_OK;
    k_row_axpby<<<lm_cuda_grid(rows * cols, THREADS), THREADS, 0, (cudaStream_t)stream>>>(d_y, d_a, d_x, d_b, rows,
                                                                                          cols);
    CUDA_LAUNCHED("k_row_axpby");
fail:
    return status;
}

__global__ void k_nearswap(float *x, int64_t n, float t)
{
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        x[i] *= lm_nearswap_weight(x[i], t);
}

__global__ void k_random_drop(float *x, int64_t n, uint64_t key, int64_t first, uint64_t keep_below)
{
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        if (!lm_rng_keep(key, first + i, keep_below))
            x[i] = 0.0f;
}

// tau = float32 of src (dtype DT) - base, in one pass: convert.cu's conversion of each element
// (dtype.h's, as the CPU's) and cpu_arith.c's subtraction, so the bits are the CPU's.
template <int DT>
__global__ void k_delta(float *tau, const void *src, const float *base, int64_t n)
{
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        float v;
        if (DT == LM_DTYPE_BF16)
            v = lm_bf16_to_f32(((const uint16_t *)src)[i]);
        else if (DT == LM_DTYPE_F16)
            v = lm_f16_to_f32(((const uint16_t *)src)[i]);
        else if (DT == LM_DTYPE_F64)
            v = __double2float_rn(((const double *)src)[i]);
        else
            v = ((const float *)src)[i];
        tau[i] = v - base[i];
    }
}

// key[r, c] = float32 of tau[r, c]² / ucc2[c] in double, for the rows × cols row-major tau:
// cpu_select.c's importance_task. Double multiplication and division round correctly on both,
// so the keys, and the masks selected from them, are the CPU's bit for bit.
__global__ void k_importance(float *key, const float *tau, const double *ucc2, int64_t rows, int64_t cols)
{
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        const float *t = tau + r * cols;
        float *k = key + r * cols;
        for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
            double v = t[c];
            k[c] = (float)(v * v / ucc2[c]);
        }
    }
}

// C = beta * C for an m x n row-major C with row stride ldc: a GEMM with k == 0, by BLAS's rule
// (beta == 0 stores zeros rather than multiplying whatever C held).
__global__ void k_scale_rows(float *c, int64_t m, int64_t n, int64_t ldc, float beta)
{
    int64_t total = m * n;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
        int64_t r = i / n, j = i - r * n;
        float *p = c + r * ldc + j;
        *p = beta == 0.0f ? 0.0f : beta * *p;
    }
}

// C = beta * C on the upper triangle (row <= col) of the n x n row-major C: syrk with k == 0,
// by the same rule as k_scale_rows.
__global__ void k_scale_upper(float *c, int64_t n, int64_t ldc, float beta)
{
    int64_t total = n * n;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
        int64_t r = i / n, j = i - r * n;
        if (j >= r) {
            float *p = c + r * ldc + j;
            *p = beta == 0.0f ? 0.0f : beta * *p;
        }
    }
}

#define MIRROR_TILE 32  // side of the square tiles k_mirror_upper transposes through shared memory

// The strictly lower triangle of the n x n row-major C from its upper one, one MIRROR_TILE-square
// tile below the diagonal per block at a time: the tile's mirror image above the diagonal is read
// row by row into shared memory (coalesced), then written out transposed (coalesced). The tiles
// are numbered over the whole square and those above the diagonal skipped (grid-stride; a block
// of THREADS threads is 8 rows of 32).
__global__ void k_mirror_upper(float *c, int64_t n, int64_t ldc)
{
    __shared__ float tile[MIRROR_TILE][MIRROR_TILE + 1];  // + 1: no bank conflicts on the transpose
    const int64_t nt = (n + MIRROR_TILE - 1) / MIRROR_TILE;
    const int tx = threadIdx.x % MIRROR_TILE, ty = threadIdx.x / MIRROR_TILE, rows = blockDim.x / MIRROR_TILE;
    for (int64_t t = blockIdx.x; t < nt * nt; t += gridDim.x) {
        int64_t tr = t / nt, tc = t - tr * nt;  // the tile written: rows tr, columns tc
        if (tc > tr)
            continue;  // uniform over the block
        int64_t r0 = tr * MIRROR_TILE, c0 = tc * MIRROR_TILE;
        // read C[c0 + y][r0 + x], above the diagonal where c0 + y < r0 + x
        for (int y = ty; y < MIRROR_TILE; y += rows) {
            int64_t r = c0 + y, col = r0 + tx;
            if (r < n && col < n && r < col)
                tile[y][tx] = c[r * ldc + col];
        }
        __syncthreads();
        // write C[r0 + y][c0 + x] = C[c0 + x][r0 + y] below the diagonal
        for (int y = ty; y < MIRROR_TILE; y += rows) {
            int64_t r = r0 + y, col = c0 + tx;
            if (r < n && col < n && col < r)
                c[r * ldc + col] = tile[tx][y];
        }
        __syncthreads();
    }
}

// ==== low-rank products ======================================================================

// c[i·ldc + j] = alpha · Σ_q a[i·lda + q] · b[q·ldb + j] (+ beta · c[i·ldc + j] unless beta is 0,
// c then not read), for i < m, j < n: cpu_arith.c's low-rank kernel (lowrank_plain, whose
// results its vector versions repeat), one thread per element. The sum is one fused
// multiply-add chain from zero in q order, then the scaling with a separate multiply and add
// (this file is built with --fmad=false), so each element is the CPU's bit for bit whatever the
// shape. Threads of a warp take neighbouring columns of a row: they read b's rows coalesced and
// a's row as one broadcast. Rows are grid-stride over blockIdx.y, columns over blockIdx.x.
__global__ void k_lowrank(float *c, int64_t ldc, const float *a, int64_t lda, const float *b, int64_t ldb, int64_t m,
                          int64_t n, int k, float alpha, float beta)
{
    for (int64_t i = blockIdx.y; i < m; i += gridDim.y) {
        const float *ai = a + i * lda;
        for (int64_t j = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; j < n; j += (int64_t)gridDim.x * blockDim.x) {
            float acc = 0.0f;
            for (int q = 0; q < k; q++)
                acc = __fmaf_rn(ai[q], b[q * ldb + j], acc);
            float *ci = c + i * ldc + j;
            *ci = beta != 0.0f ? alpha * acc + beta * *ci : alpha * acc;
        }
    }
}

// ==== masks ===================================================================================

// Packs x's non-zeros into bits: bit s + j (byte (s + j) / 8, bit (s + j) % 8) of bytes is set
// where x[j] != 0 and clear where it is zero, for j < n; the bits below s and from s + n to the
// end of the last byte are clear. Bytes cover (s + n + 7) / 8. A warp takes 32 consecutive bits
// (4 bytes): its lanes read 32 neighbouring elements and four lanes store the ballot's bytes. The
// loop runs whole warps (base is the warp's first bit), so every lane reaches __ballot_sync.
__global__ void k_mask_get(uint8_t *bytes, const float *x, int64_t n, int s)
{
    const int lane = threadIdx.x & 31;
    const int64_t nbits = s + n, nbytes = (nbits + 7) / 8;
    for (int64_t base = blockIdx.x * (int64_t)blockDim.x + (threadIdx.x & ~31u); base < nbits;
         base += (int64_t)gridDim.x * blockDim.x) {
        int64_t j = base + lane - s;
        unsigned word = __ballot_sync(FULL_MASK, j >= 0 && j < n && x[j] != 0.0f);
        int64_t o = base / 8 + lane;
        if (lane < 4 && o < nbytes)
            bytes[o] = (uint8_t)(word >> (8 * lane));
    }
}

// Zeroes x[j] (to +0.0) where bit s + j of bytes is clear, for j < n.
__global__ void k_mask_apply(float *x, const uint8_t *bytes, int64_t n, int s)
{
    for (int64_t j = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; j < n; j += (int64_t)gridDim.x * blockDim.x) {
        int64_t b = j + s;
        if (!(bytes[b >> 3] >> (b & 7) & 1))
            x[j] = 0.0f;
    }
}

// ==== sequential double sums (seq_sum.cuh) ====================================================

// partial[b] = Σ |x[i]| over block b of LM_CUDA_L1_BLOCK elements, in double, in index order:
// cpu_select.c's l1_task. One warp per block.
__global__ void k_l1_blocks(double *partial, const float *x, int64_t n, int64_t nb)
{
    const int lane = threadIdx.x & 31;
    const int64_t warp = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) >> 5;
    const int64_t warps = ((int64_t)gridDim.x * blockDim.x) >> 5;
    for (int64_t b = warp; b < nb; b += warps) {  // uniform across the warp
        int64_t lo = b * LM_CUDA_L1_BLOCK, hi = n - lo < LM_CUDA_L1_BLOCK ? n : lo + LM_CUDA_L1_BLOCK;
        float next[SEQ_TILES];
        load_tiles(next, x, lo, hi, lane);
        double s = 0.0;
        for (int64_t g = lo; g < hi; g += 32 * SEQ_TILES) {
            float cur[SEQ_TILES];
#pragma unroll
            for (int j = 0; j < SEQ_TILES; j++)
                cur[j] = next[j];
            load_tiles(next, x, g + 32 * SEQ_TILES, hi, lane);
#pragma unroll
            for (int j = 0; j < SEQ_TILES; j++) {
                int64_t t0 = g + 32 * j;
                if (t0 < hi)
                    s = add_lanes_in_order(s, fabs((double)cur[j]), hi - t0 < 32 ? (int)(hi - t0) : 32);
            }
        }
        if (lane == 0)
            partial[b] = s;
    }
}

// cpu_arith.c's dora_task, one warp per row: the squared norm of W' = base + ΔW summed in
// double in column order, then tau = f · W' − base with f = magnitude / ‖W'‖ rounded to float
// (0 for a row that is all zeros).
__global__ void k_dora_rows(float *tau, const float *base, const float *mag, int64_t rows, int64_t cols)
{
    const int lane = threadIdx.x & 31;
    const int64_t warp = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) >> 5;
    const int64_t warps = ((int64_t)gridDim.x * blockDim.x) >> 5;
    for (int64_t r = warp; r < rows; r += warps) {  // uniform across the warp
        float *t = tau + r * cols;
        const float *b = base + r * cols;
        float nb[SEQ_TILES], nt[SEQ_TILES];
        load_tiles(nb, b, 0, cols, lane);
        load_tiles(nt, t, 0, cols, lane);
        double ss = 0.0;
        for (int64_t g = 0; g < cols; g += 32 * SEQ_TILES) {
            float cb[SEQ_TILES], ct[SEQ_TILES];
#pragma unroll
            for (int j = 0; j < SEQ_TILES; j++) {
                cb[j] = nb[j];
                ct[j] = nt[j];
            }
            load_tiles(nb, b, g + 32 * SEQ_TILES, cols, lane);
            load_tiles(nt, t, g + 32 * SEQ_TILES, cols, lane);
#pragma unroll
            for (int j = 0; j < SEQ_TILES; j++) {
                int64_t t0 = g + 32 * j;
                if (t0 < cols) {
                    float w = cb[j] + ct[j];
                    ss = add_lanes_in_order(ss, (double)w * w, cols - t0 < 32 ? (int)(cols - t0) : 32);
                }
            }
        }
        // Every lane read its own columns above and writes only those below.
        float f = ss > 0 ? (float)(mag[r] / sqrt(ss)) : 0.0f;
        for (int64_t c = lane; c < cols; c += 32)
            t[c] = f * (b[c] + t[c]) - b[c];
    }
}

// ==== selection ===============================================================================

#define NO_BIN 0xFFFFFFFFu

// The level-0 bins each block counts in shared memory: the top 16 bits of magnitudes from 2⁻⁶³
// to 2 (biased exponents 64 to 127, 128 bins each), where weights and task vectors lie. 32-bit
// counts, 32 KiB, within the 48 KiB every GPU gives a block.
#define HIST_HOT_LO 8192u
#define HIST_HOT_BINS 8192u
// Elements per block at least, so that zeroing and flushing its shared bins stays a small part
// of its work.
#define HIST_BLOCK_MIN 32768

// Adds the level-0 (top 16 magnitude bits) or level-1 (low 16 bits of the magnitudes whose top
// 16 bits are hi_bin) histogram of x to hist, for n <= UINT32_MAX (the shared counts are 32 bits
// wide). Level 0 counts the bins from HIST_HOT_LO in the block's shared memory and adds them to
// hist once at the end; the rest of level 0 and level 1 (whose values all lie in one level-0
// bin, a narrow band, and whose 65536 bins do not fit in shared memory) go to hist directly.
// Either way the lanes of a warp that fall into the same bin add their count with one atomic.
// The loop runs whole warps (base is the warp's first element), so every lane reaches
// __match_any_sync. Exact: every element is counted once, in integers.
__global__ void k_hist_abs(unsigned long long *hist, const float *x, int64_t n, int level, uint32_t hi_bin)
{
    __shared__ unsigned hot[HIST_HOT_BINS];
    const int lane = threadIdx.x & 31;
    const bool privatise = level == 0;  // uniform: a kernel argument
    if (privatise) {
        for (unsigned b = threadIdx.x; b < HIST_HOT_BINS; b += blockDim.x)
            hot[b] = 0;
        __syncthreads();
    }
    for (int64_t base = blockIdx.x * (int64_t)blockDim.x + (threadIdx.x & ~31u); base < n;
         base += (int64_t)gridDim.x * blockDim.x) {
        int64_t i = base + lane;
        uint32_t bin = NO_BIN;
        if (i < n) {
            uint32_t bits = lm_abs_bits(x[i]);
            if (level == 0)
                bin = bits >> 16;
            else if ((bits >> 16) == hi_bin)
                bin = bits & 0xFFFFu;
        }
        unsigned peers = __match_any_sync(FULL_MASK, bin);
        if (bin != NO_BIN && lane == __ffs(peers) - 1) {
            if (privatise && bin - HIST_HOT_LO < HIST_HOT_BINS)  // unsigned: also false below
                atomicAdd(&hot[bin - HIST_HOT_LO], (unsigned)__popc(peers));
            else
                atomicAdd(&hist[bin], (unsigned long long)__popc(peers));
        }
    }
    if (privatise) {
        __syncthreads();
        for (unsigned b = threadIdx.x; b < HIST_HOT_BINS; b += blockDim.x)
            if (hot[b])
                atomicAdd(&hist[HIST_HOT_LO + b], (unsigned long long)hot[b]);
    }
}

// lm_dev_hist_window's counts for n <= UINT32_MAX elements (32-bit counts cannot overflow), a
// group of the window's bins at a time: win[w << 16 | low 16 bits] += one for each magnitude
// whose top 16 bits are lo_bin + w, w < n_win, and, when above is not NULL, *above += how many
// have their top 16 bits at or beyond above_from. The comparisons are cpu_select.c's cpu_hist_win's
// in uint32 arithmetic. The lanes of a warp that fall into the same bin add their count with
// one atomic, as in k_hist_abs; the counts beyond the window are summed per block and added
// with one atomic.
__global__ void k_hist_window(unsigned *above, uint32_t above_from, unsigned *win, const float *x, int64_t n,
                              uint32_t lo_bin, uint32_t n_win)
{
    __shared__ unsigned block_above;
    const int lane = threadIdx.x & 31;
    unsigned up = 0;  // the warp's values beyond the window so far
    if (threadIdx.x == 0)
        block_above = 0;
    __syncthreads();
    for (int64_t base = blockIdx.x * (int64_t)blockDim.x + (threadIdx.x & ~31u); base < n;
         base += (int64_t)gridDim.x * blockDim.x) {
        int64_t i = base + lane;
        uint32_t bin = NO_BIN;
        bool beyond = false;
        if (i < n) {
            uint32_t bits = lm_abs_bits(x[i]), top = bits >> 16, w = top - lo_bin;
            beyond = top >= above_from;
            if (w < n_win)  // unsigned: also false below lo_bin
                bin = w << 16 | (bits & 0xFFFFu);
        }
        unsigned peers = __match_any_sync(FULL_MASK, bin);
        if (bin != NO_BIN && lane == __ffs(peers) - 1)
            atomicAdd(&win[bin], (unsigned)__popc(peers));
        up += (unsigned)__popc(__ballot_sync(FULL_MASK, beyond));
    }
    if (above) {  // uniform: a kernel argument
        if (lane == 0 && up)
            atomicAdd(&block_above, up);
        __syncthreads();
        if (threadIdx.x == 0 && block_above)
            atomicAdd(above, block_above);
    }
}

// counts[c] = the ties (magnitude bits == thr) in chunk c of LM_CUDA_TIE_CHUNK elements of x
// (the values, or the keys that decide for them); one block per chunk at a time.
__global__ void k_tie_counts(uint32_t *counts, const float *x, int64_t n, uint32_t thr, int64_t chunks)
{
    __shared__ uint32_t warp_sum[32];
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    for (int64_t ch = blockIdx.x; ch < chunks; ch += gridDim.x) {  // uniform across the block
        int64_t lo = ch * LM_CUDA_TIE_CHUNK, hi = n - lo < LM_CUDA_TIE_CHUNK ? n : lo + LM_CUDA_TIE_CHUNK;
        uint32_t c = 0;
        for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x)
            c += lm_abs_bits(x[i]) == thr;
        for (int o = 16; o > 0; o >>= 1)
            c += __shfl_down_sync(FULL_MASK, c, o);
        if (lane == 0)
            warp_sum[wid] = c;
        __syncthreads();
        if (threadIdx.x == 0) {
            uint32_t total = 0;
            for (int w = 0; w < nwarps; w++)
                total += warp_sum[w];
            counts[ch] = total;
        }
        __syncthreads();  // warp_sum is written again for the next chunk
    }
}

// *index = the index of the tie of rank `rank` in x[lo, hi) (hi when there are not that many,
// which the caller rules out). One block; tiles of blockDim elements in order, each tie's rank
// from the warps' ballots.
__global__ void k_tie_find(int64_t *index, const float *x, int64_t lo, int64_t hi, uint32_t thr, int64_t rank)
{
    __shared__ uint32_t warp_cnt[32];
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    if (threadIdx.x == 0)
        *index = hi;  // ordered before the finder's store by the __syncthreads below
    int64_t seen = 0;  // ties before this tile: the same in every thread
    for (int64_t base = lo; base < hi; base += blockDim.x) {  // uniform across the block
        int64_t i = base + threadIdx.x;
        bool tie = i < hi && lm_abs_bits(x[i]) == thr;
        uint32_t ballot = __ballot_sync(FULL_MASK, tie);
        if (lane == 0)
            warp_cnt[wid] = (uint32_t)__popc(ballot);
        __syncthreads();
        int64_t before = seen, total = seen;
        for (int w = 0; w < nwarps; w++) {
            before += w < wid ? warp_cnt[w] : 0;
            total += warp_cnt[w];
        }
        if (tie && before + __popc(ballot & ((1u << lane) - 1u)) == rank)
            *index = i;
        seen = total;
        __syncthreads();  // warp_cnt is written again for the next tile
        if (seen > rank)
            return;
    }
}

// Zeroes x[i] unless the magnitude bits of key[i] are > thr, or == thr with i below the tie end
// (with drop: zeroes exactly those instead). key is x itself for plain top-k (each element is
// read before its own thread writes it).
__global__ void k_topk_mask(float *x, const float *key, int64_t n, uint32_t thr, int64_t tie_end,
                            const int64_t *d_tie_end, bool drop)
{
    const int64_t end = d_tie_end ? *d_tie_end : tie_end;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        uint32_t bits = lm_abs_bits(key[i]);
        bool keep = bits > thr || (bits == thr && i < end);
        if (keep == drop)
            x[i] = 0.0f;
    }
}

// ==== combination =============================================================================

// The task vectors of one combination, passed by value as kernel arguments (3 KiB, within the
// 4 KiB every architecture and toolkit allows).
typedef struct combine_args {
    const float *tau[LM_CUDA_COMBINE_MAX];  // (k) device pointers, n elements each
    float w[LM_CUDA_COMBINE_MAX];           // (k) weights
    int k;
} combine_args;

// cpu_arith.c's cpu_combine_values for one element per iteration: the same sums over i in the same
// order, the same agreement test and the same final expression.
__global__ void k_combine(float *out, const float *base, const combine_args a, int64_t n, bool elect,
                          bool count_signs, bool unweighted, bool nonzero, bool ramplus, bool normalize, float lambda)
{
    for (int64_t e = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; e < n; e += (int64_t)gridDim.x * blockDim.x) {
        float vote = 0.0f, delta = 0.0f, div = 0.0f;
        if (ramplus) {  // the weighted sum where one part is not zero, the plain mean where several are
            for (int i = 0; i < a.k; i++) {
                float w = a.w[i], t = a.tau[i][e];
                delta += w * t;
                vote += t;
                div += t != 0.0f ? 1.0f : 0.0f;
            }
            delta = div == 1.0f ? delta : div > 1.0f ? vote / div : 0.0f;
            div = 0.0f;
        } else if (!elect) {
            for (int i = 0; i < a.k; i++) {
                float w = a.w[i], t = a.tau[i][e];
                delta += w * t;
                div += !nonzero || t != 0.0f ? w : 0.0f;
            }
        } else {
            for (int i = 0; i < a.k; i++) {
                float w = a.w[i];
                if (unweighted) {
                    vote += 1.0f * a.tau[i][e];
                } else if (!count_signs) {
                    vote += w * a.tau[i][e];
                } else {
                    float wt = w * a.tau[i][e];
                    vote += (float)((wt > 0) - (wt < 0));
                }
            }
            // Entries agree with the elected sign when they have that sign; zeros never agree.
            // A disagreeing entry adds +0.0f, as on the CPU (which turns a -0.0f sum into +0.0f).
            for (int i = 0; i < a.k; i++) {
                float w = a.w[i];
                float wt = w * a.tau[i][e], s = vote >= 0.0f ? 1.0f : -1.0f;
                bool agree = wt * s > 0.0f;
                delta += agree ? wt : 0.0f;
                div += agree ? w : 0.0f;
            }
        }
        float d = normalize && div != 0.0f ? delta / div : delta;
        out[e] = base[e] + lambda * d;
    }
}

// key[e] = the variance of the k task vectors' entries and n_models − k zeros (lm_tau_var).
__global__ void k_tau_var(float *key, const combine_args a, int n_models, int64_t n)
{
    for (int64_t e = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; e < n; e += (int64_t)gridDim.x * blockDim.x) {
        // lm_tau_var's arithmetic without the array: the sum, then the squares about the mean
        double sum = 0, sq = 0;
        for (int i = 0; i < a.k; i++)
            sum += a.tau[i][e];
        double mean = sum / n_models;
        for (int i = 0; i < a.k; i++)
            sq += ((double)a.tau[i][e] - mean) * ((double)a.tau[i][e] - mean);
        sq += (double)(n_models - a.k) * (mean * mean);
        key[e] = (float)(sq / n_models);
    }
}

extern "C" lm_status lm_cuda_tau_var(float *d_key, const float *const *d_tau, int k, int n_models, int64_t n,
                                     void *stream, lm_err *err)
{
    lm_status status = LM_OK;
    combine_args a;
    if (k > LM_CUDA_COMBINE_MAX)
        return lm_err_set(err, LM_ERR_UNSUPPORTED, "cuda: the variance of %d task vectors at once is not supported "
                          "(at most %d)", k, LM_CUDA_COMBINE_MAX);
    if (n <= 0)
        return LM_OK;
    memset(&a, 0, sizeof a);
    a.k = k > 0 ? k : 0;
    for (int i = 0; i < a.k; i++)
        a.tau[i] = d_tau[i];
    k_tau_var<<<lm_cuda_grid(n, THREADS), THREADS, 0, (cudaStream_t)stream>>>(d_key, a, n_models, n);
    CUDA_LAUNCHED("k_tau_var");
fail:
    return status;
}

// ==== launchers ===============================================================================

// Warps (one per sum) of 128-thread blocks for `items` sums.
static unsigned grid_warps(int64_t items)
{
    return lm_cuda_grid(items, 128 / 32);
}

// GEMM, row-major to cuBLAS's column-major. A row-major matrix X stored [R, C] with row stride
// ld is, read column-major with leading dimension ld, the matrix Xᵀ [C, R]. So cuBLAS sees
//   C (row-major [m, n], ldc)   as  Cᵀ [n, m], ldc;
//   a: when !ta it stores op(A) [m, k], seen as op(A)ᵀ [k, m]: op N gives op(A)ᵀ;
//      when  ta it stores A = op(A)ᵀ [k, m], seen as op(A) [m, k]: op T gives op(A)ᵀ;
//   b: likewise, op N (!tb) or T (tb) gives op(B)ᵀ [n, k].
// Row-major C = α op(A) op(B) + β C is column-major Cᵀ = α op(B)ᵀ op(A)ᵀ + β Cᵀ, that is
//   cublasSgemm(opB, opA, n, m, k, α, b, ldb, a, lda, β, c, ldc)
// with opB = tb ? T : N and opA = ta ? T : N. cuBLAS's leading-dimension rules then read
//   ldb >= n when !tb (b is [k, n]) or >= k when tb (b is [n, k]),
//   lda >= k when !ta (a is [m, k]) or >= m when ta (a is [k, m]),  ldc >= n,
// which are exactly "each stride at least its stored row's length". Checked on all four
// (ta, tb) cases: e.g. ta = tb = 1: cuBLAS's first operand is b read as [k, n] (ld ldb) with op
// T, i.e. [n, k] = op(B)ᵀ since op(B) = bᵀ; its second is a read as [m, k] with op T, i.e.
// [k, m] = op(A)ᵀ since op(A) = aᵀ; their product [n, m] is (op(A) op(B))ᵀ.
extern "C" lm_status lm_cuda_sgemm(void *blas, bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha,
                                   const float *d_a, int64_t lda, const float *d_b, int64_t ldb, float beta,
                                   float *d_c, int64_t ldc, void *stream, lm_err *err)
{
    lm_status status = LM_OK;
    cublasStatus_t bs;
    if (m > INT32_MAX || n > INT32_MAX || k > INT32_MAX || lda > INT32_MAX || ldb > INT32_MAX || ldc > INT32_MAX)
        return lm_err_set(err, LM_ERR_UNSUPPORTED, "cuda: GEMM of %lld x %lld x %lld is too large for cuBLAS",
                          (long long)m, (long long)n, (long long)k);
    if (m < 0 || n < 0 || k < 0)
        return lm_err_set(err, LM_ERR_DEVICE, "cuda: GEMM of invalid shape %lld x %lld x %lld", (long long)m,
                          (long long)n, (long long)k);
    if (m == 0 || n == 0)
        return LM_OK;
    if (k == 0) {
        // An empty sum: cuBLAS's handling of k == 0 is not documented, BLAS's is C = β·C.
        if (beta != 1.0f) {
            k_scale_rows<<<lm_cuda_grid(m * n, THREADS), THREADS, 0, (cudaStream_t)stream>>>(d_c, m, n, ldc, beta);
            CUDA_LAUNCHED("k_scale_rows");
        }
        return LM_OK;
    }
    const lm_cublas_fns *f;
    if ((status = lm_cuda_load_cublas(&f, err)) != LM_OK)  // loaded already: the handle came from it
        return status;
    bs = f->sgemm((cublasHandle_t)blas, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, (int)n,
                     (int)m, (int)k, &alpha, d_b, (int)ldb, d_a, (int)lda, &beta, d_c, (int)ldc);
    if (bs != CUBLAS_STATUS_SUCCESS) {
        // A workspace cuBLAS could not allocate is the device being full, like any allocation.
        status = lm_err_set(err, bs == CUBLAS_STATUS_ALLOC_FAILED ? LM_ERR_DEVICE_OOM : LM_ERR_DEVICE,
                            "cuda: cublasSgemm (ta %d, tb %d, m %lld, n %lld, k %lld, lda %lld, ldb %lld, "
                            "ldc %lld): %s",
                            (int)ta, (int)tb, (long long)m, (long long)n, (long long)k, (long long)lda,
                            (long long)ldb, (long long)ldc, f->status_string(bs));
        cudaGetLastError();  // whatever CUDA error lay behind it must not fail the next launch check
    }
    return status;
fail:
    return status;
}

extern "C" lm_status lm_cuda_syrk(void *blas, int64_t n, int64_t k, float alpha, const float *d_a, int64_t lda,
                                  float beta, bool mirror, float *d_c, int64_t ldc, void *stream, lm_err *err)
{
    lm_status status = LM_OK;
    cublasStatus_t bs = CUBLAS_STATUS_SUCCESS;
    if (n > INT32_MAX || k > INT32_MAX || lda > INT32_MAX || ldc > INT32_MAX)
        return lm_err_set(err, LM_ERR_UNSUPPORTED, "cuda: syrk of %lld x %lld is too large for cuBLAS", (long long)n,
                          (long long)k);
    if (n < 0 || k < 0)
        return lm_err_set(err, LM_ERR_DEVICE, "cuda: syrk of invalid shape %lld x %lld", (long long)n, (long long)k);
    if (n == 0)
        return LM_OK;
    if (k == 0) {
        // An empty sum, as in lm_cuda_sgemm: C = beta * C by BLAS's rule, on the upper triangle.
        if (beta != 1.0f) {
            k_scale_upper<<<lm_cuda_grid(n * n, THREADS), THREADS, 0, (cudaStream_t)stream>>>(d_c, n, ldc, beta);
            CUDA_LAUNCHED("k_scale_upper");
        }
    } else {
        const lm_cublas_fns *f;
        if ((status = lm_cuda_load_cublas(&f, err)) != LM_OK)  // loaded already: the handle came from it
            return status;
        // The row-major C and A are the column-major C' = Cᵀ (ld ldc) and A' = Aᵀ, n x k (ld lda):
        // C' = alpha A' A'ᵀ + beta C', and C's upper triangle is C''s lower one.
        bs = f->ssyrk((cublasHandle_t)blas, CUBLAS_FILL_MODE_LOWER, CUBLAS_OP_N, (int)n, (int)k, &alpha, d_a, (int)lda,
                      &beta, d_c, (int)ldc);
        if (bs != CUBLAS_STATUS_SUCCESS) {
            status = lm_err_set(err, bs == CUBLAS_STATUS_ALLOC_FAILED ? LM_ERR_DEVICE_OOM : LM_ERR_DEVICE,
                                "cuda: cublasSsyrk (n %lld, k %lld, lda %lld, ldc %lld): %s", (long long)n,
                                (long long)k, (long long)lda, (long long)ldc, f->status_string(bs));
            cudaGetLastError();
            return status;
        }
    }
    if (mirror) {
        int64_t nt = (n + MIRROR_TILE - 1) / MIRROR_TILE;
        k_mirror_upper<<<lm_cuda_grid(nt * nt, 1), THREADS, 0, (cudaStream_t)stream>>>(d_c, n, ldc);
        CUDA_LAUNCHED("k_mirror_upper");
    }
    return LM_OK;
fail:
    return status;
}

extern "C" lm_status lm_cuda_lowrank(float *d_c, int64_t ldc, const float *d_a, int64_t lda, const float *d_b,
                                     int64_t ldb, int64_t m, int64_t n, int64_t k, float alpha, float beta,
                                     void *stream, lm_err *err)
{
    lm_status status = LM_OK;
    if (m > INT32_MAX || n > INT32_MAX || lda > INT32_MAX || ldb > INT32_MAX || ldc > INT32_MAX)
        return lm_err_set(err, LM_ERR_UNSUPPORTED, "cuda: GEMM of %lld x %lld x %lld is too large", (long long)m,
                          (long long)n, (long long)k);
    if (m < 0 || n < 0 || k < 0 || k > LM_DEV_LOWRANK_MAX)
        return lm_err_set(err, LM_ERR_DEVICE, "cuda: low-rank product of invalid shape %lld x %lld x %lld (rank at "
                          "most %d)", (long long)m, (long long)n, (long long)k, LM_DEV_LOWRANK_MAX);
    if (m == 0 || n == 0)
        return LM_OK;
    dim3 grid(lm_cuda_grid(n, THREADS), lm_cuda_grid(m, 1));
    k_lowrank<<<grid, THREADS, 0, (cudaStream_t)stream>>>(d_c, ldc, d_a, lda, d_b, ldb, m, n, (int)k, alpha, beta);
    CUDA_LAUNCHED("k_lowrank");
fail:
    return status;
}

extern "C" lm_status lm_cuda_axpby(float *d_y, float a, const float *d_x, float b, int64_t n, void *stream, lm_err *err)
{
    lm_status status = LM_OK;
    if (n <= 0)
        return LM_OK;
    k_axpby<<<lm_cuda_grid(n, THREADS), THREADS, 0, (cudaStream_t)stream>>>(d_y, a, d_x, b, n);
    CUDA_LAUNCHED("k_axpby");
fail:
    return status;
}

extern "C" lm_status lm_cuda_delta(float *d_tau, const void *d_src, lm_dtype dt, const float *d_base, int64_t n,
                                   void *stream, lm_err *err)
{
    lm_status status = LM_OK;
    const unsigned grid = lm_cuda_grid(n, THREADS);
    cudaStream_t s = (cudaStream_t)stream;
    if (n <= 0)
        return LM_OK;
    switch (dt) {
    case LM_DTYPE_F32:
        k_delta<LM_DTYPE_F32><<<grid, THREADS, 0, s>>>(d_tau, d_src, d_base, n);
        break;
    case LM_DTYPE_BF16:
        k_delta<LM_DTYPE_BF16><<<grid, THREADS, 0, s>>>(d_tau, d_src, d_base, n);
        break;
    case LM_DTYPE_F16:
        k_delta<LM_DTYPE_F16><<<grid, THREADS, 0, s>>>(d_tau, d_src, d_base, n);
        break;
    case LM_DTYPE_F64:
        k_delta<LM_DTYPE_F64><<<grid, THREADS, 0, s>>>(d_tau, d_src, d_base, n);
        break;
    default:
        return lm_err_set(err, LM_ERR_UNSUPPORTED, "cuda: delta: dtype %s cannot be computed with",
                          lm_dtype_name(dt));
    }
    CUDA_LAUNCHED("k_delta");
fail:
    return status;
}

extern "C" lm_status lm_cuda_importance(float *d_key, const float *d_tau, const double *d_ucc2, int64_t rows,
                                        int64_t cols, void *stream, lm_err *err)
{
    lm_status status = LM_OK;
    if (rows <= 0 || cols <= 0)
        return LM_OK;
    k_importance<<<lm_cuda_grid(rows, 1), THREADS, 0, (cudaStream_t)stream>>>(d_key, d_tau, d_ucc2, rows, cols);
    CUDA_LAUNCHED("k_importance");
fail:
    return status;
}

extern "C" lm_status lm_cuda_dora_rows(float *d_tau, const float *d_base, const float *d_mag, int64_t rows,
                                       int64_t cols, void *stream, lm_err *err)
{
    lm_status status = LM_OK;
    if (rows <= 0 || cols <= 0)
        return LM_OK;
    k_dora_rows<<<grid_warps(rows), 128, 0, (cudaStream_t)stream>>>(d_tau, d_base, d_mag, rows, cols);
    CUDA_LAUNCHED("k_dora_rows");
fail:
    return status;
}

extern "C" lm_status lm_cuda_hist_abs(uint64_t *d_hist, const float *d_x, int64_t n, int level, uint32_t hi_bin,
                                      void *stream, lm_err *err)
{
    lm_status status = LM_OK;
    // a piece of at most UINT32_MAX elements per launch, so that no block's shared count can
    // overflow; level 0 with fewer blocks, each worth its shared bins
    for (int64_t off = 0; off < n;) {
        int64_t cnt = n - off < (int64_t)UINT32_MAX ? n - off : (int64_t)UINT32_MAX;
        unsigned blocks = lm_cuda_grid(cnt, THREADS);
        if (level == 0 && (int64_t)blocks > cnt / HIST_BLOCK_MIN)
            blocks = cnt / HIST_BLOCK_MIN > 1 ? (unsigned)(cnt / HIST_BLOCK_MIN) : 1u;
        k_hist_abs<<<blocks, THREADS, 0, (cudaStream_t)stream>>>((unsigned long long *)d_hist, d_x + off, cnt, level,
                                                                 hi_bin);
        CUDA_LAUNCHED("k_hist_abs");
        off += cnt;
    }
    return LM_OK;
fail:
    return status;
}

extern "C" lm_status lm_cuda_hist_window(uint32_t *d_above, uint32_t above_from, uint32_t *d_win, int n_win,
                                         uint32_t lo_bin, const float *d_x, int64_t n, void *stream, lm_err *err)
{
    lm_status status = LM_OK;
    if (n <= 0)
        return LM_OK;
    if (n > (int64_t)UINT32_MAX || n_win < 0 || n_win > LM_HIST_WINDOW)
        return lm_err_set(err, LM_ERR_DEVICE, "cuda: hist_window of %lld elements in %d bins: out of range (at "
                          "most %u elements, %d bins)", (long long)n, n_win, UINT32_MAX, LM_HIST_WINDOW);
    k_hist_window<<<lm_cuda_grid(n, THREADS), THREADS, 0, (cudaStream_t)stream>>>(d_above, above_from, d_win, d_x, n,
                                                                                 lo_bin, (uint32_t)n_win);
    CUDA_LAUNCHED("k_hist_window");
fail:
    return status;
}

extern "C" lm_status lm_cuda_mask_get(uint8_t *d_bytes, const float *d_x, int64_t n, int s, void *stream,
                                      lm_err *err)
{
    lm_status status = LM_OK;
    if (n <= 0)
        return LM_OK;
    if (s < 0 || s > 7)
        return lm_err_set(err, LM_ERR_DEVICE, "cuda: mask_get from bit %d of its first byte", s);
    k_mask_get<<<lm_cuda_grid(s + n, THREADS), THREADS, 0, (cudaStream_t)stream>>>(d_bytes, d_x, n, s);
    CUDA_LAUNCHED("k_mask_get");
fail:
    return status;
}

extern "C" lm_status lm_cuda_mask_apply(float *d_x, const uint8_t *d_bytes, int64_t n, int s, void *stream,
                                        lm_err *err)
{
    lm_status status = LM_OK;
    if (n <= 0)
        return LM_OK;
    if (s < 0 || s > 7)
        return lm_err_set(err, LM_ERR_DEVICE, "cuda: mask_apply from bit %d of its first byte", s);
    k_mask_apply<<<lm_cuda_grid(n, THREADS), THREADS, 0, (cudaStream_t)stream>>>(d_x, d_bytes, n, s);
    CUDA_LAUNCHED("k_mask_apply");
fail:
    return status;
}

extern "C" lm_status lm_cuda_tie_counts(uint32_t *d_counts, const float *d_x, int64_t n, uint32_t thr_bits,
                                        void *stream, lm_err *err)
{
    lm_status status = LM_OK;
    int64_t chunks = (n + LM_CUDA_TIE_CHUNK - 1) / LM_CUDA_TIE_CHUNK;
    if (n <= 0)
        return LM_OK;
    k_tie_counts<<<lm_cuda_grid(chunks, 1), THREADS, 0, (cudaStream_t)stream>>>(d_counts, d_x, n, thr_bits, chunks);
    CUDA_LAUNCHED("k_tie_counts");
fail:
    return status;
}

extern "C" lm_status lm_cuda_tie_find(int64_t *d_index, const float *d_x, int64_t lo, int64_t hi, uint32_t thr_bits,
                                      int64_t rank, void *stream, lm_err *err)
{
    lm_status status = LM_OK;
    k_tie_find<<<1, 1024, 0, (cudaStream_t)stream>>>(d_index, d_x, lo, hi, thr_bits, rank);
    CUDA_LAUNCHED("k_tie_find");
fail:
    return status;
}

extern "C" lm_status lm_cuda_topk_mask(float *d_x, const float *d_key, int64_t n, uint32_t thr_bits, int64_t tie_end,
                                       const int64_t *d_tie_end, bool drop, void *stream, lm_err *err)
{
    lm_status status = LM_OK;
    if (n <= 0)
        return LM_OK;
    k_topk_mask<<<lm_cuda_grid(n, THREADS), THREADS, 0, (cudaStream_t)stream>>>(d_x, d_key, n, thr_bits, tie_end,
                                                                                d_tie_end, drop);
    CUDA_LAUNCHED("k_topk_mask");
fail:
    return status;
}

extern "C" lm_status lm_cuda_random_drop(float *d_x, int64_t n, uint64_t key, int64_t first, uint64_t keep_below,
                                         void *stream, lm_err *err)
{
    lm_status status = LM_OK;
    if (n <= 0)
        return LM_OK;
    k_random_drop<<<lm_cuda_grid(n, THREADS), THREADS, 0, (cudaStream_t)stream>>>(d_x, n, key, first, keep_below);
    CUDA_LAUNCHED("k_random_drop");
fail:
    return status;
}

// out[r] = Σ_c x[r, c]·y[r, c] in lm_dev_row_dot's lanes (device.h), as cpu_dot_lanes adds
// them. One warp per row: a tile of 32 columns starts at a multiple of 32, so lane c mod 16 of
// the row is held by threads c mod 16 and the one 16 above it; thread t < 16 adds its own
// product, then that one's, in column order. Past the row's end the products are zeros, which
// leave a sum that started at +0 unchanged. The lanes are then added in device.h's tree
// (shuffles down by 1, 2, 4, 8).
__global__ void k_row_dot(double *out, const float *x, const float *y, int64_t rows, int64_t cols)
{
    const int lane = threadIdx.x & 31;
    const int64_t warp = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) >> 5;
    const int64_t warps = ((int64_t)gridDim.x * blockDim.x) >> 5;
    for (int64_t r = warp; r < rows; r += warps) {  // uniform across the warp
        int64_t lo = r * cols, hi = lo + cols;
        float nx[SEQ_TILES], ny[SEQ_TILES];
        load_tiles(nx, x, lo, hi, lane);
        load_tiles(ny, y, lo, hi, lane);
        double s = 0.0;  // lane `thread`'s sum, in threads 0 to 15
        for (int64_t g = lo; g < hi; g += 32 * SEQ_TILES) {
            float cx[SEQ_TILES], cy[SEQ_TILES];
#pragma unroll
            for (int j = 0; j < SEQ_TILES; j++) {
                cx[j] = nx[j];
                cy[j] = ny[j];
            }
            load_tiles(nx, x, g + 32 * SEQ_TILES, hi, lane);
            load_tiles(ny, y, g + 32 * SEQ_TILES, hi, lane);
#pragma unroll
            for (int j = 0; j < SEQ_TILES; j++) {
                double v = (double)cx[j] * (double)cy[j];
                double v16 = __shfl_down_sync(FULL_MASK, v, 16);
                s = s + v;
                s = s + v16;
            }
        }
        for (int w = 1; w < 16; w *= 2)
            s = s + __shfl_down_sync(FULL_MASK, s, w);
        if (lane == 0)
            out[r] = s;
    }
}

extern "C" lm_status lm_cuda_row_dot(double *d_out, const float *d_x, const float *d_y, int64_t rows, int64_t cols,
                                     void *stream, lm_err *err)
{
    lm_status status = LM_OK;
    if (rows <= 0)
        return LM_OK;
    k_row_dot<<<grid_warps(rows), 128, 0, (cudaStream_t)stream>>>(d_out, d_x, d_y, rows, cols);
    CUDA_LAUNCHED("k_row_dot");
fail:
    return status;
}

// DELLA's ranks (the CPU's order: by magnitude bits, equal ones by index) from each row sorted
// in chunks of len = lm_della_chunk(cols) keys (magnitude bits << 32 | column, all distinct):
// block t sorts chunk t % chunks of row t / chunks in shared memory (a bitonic sort, padded with
// UINT64_MAX) into sorted[t·len ...]. An entry's rank is then its place in its chunk plus, for
// each other chunk of its row, how many of that chunk's keys are below it (a binary search):
// O(cols·log cols) a row, where counting every entry against the whole row was O(cols²), 1.4e11
// comparisons for one 2,048 x 8,192 down projection of a 1B model.
__global__ void k_della_sort(uint64_t *sorted, const float *x, int64_t rows, int64_t cols, int64_t len)
{
    __shared__ uint64_t s[LM_DELLA_CHUNK];
    int64_t chunks = (cols + len - 1) / len;
    for (int64_t t = blockIdx.x; t < rows * chunks; t += gridDim.x) {  // uniform across the block
        int64_t r = t / chunks, c0 = (t % chunks) * len;
        for (int64_t i = threadIdx.x; i < len; i += blockDim.x)
            s[i] = c0 + i < cols ? (uint64_t)lm_abs_bits(x[r * cols + c0 + i]) << 32 | (uint64_t)(c0 + i) : ~0ull;
        __syncthreads();
        for (int64_t k = 2; k <= len; k *= 2)
            for (int64_t h = k / 2; h > 0; h /= 2) {
                for (int64_t i = threadIdx.x; i < len; i += blockDim.x) {
                    int64_t o = i ^ h;
                    if (o > i) {
                        uint64_t a = s[i], b = s[o];
                        if ((a > b) == ((i & k) == 0)) {  // ascending where bit k of i is clear
                            s[i] = b;
                            s[o] = a;
                        }
                    }
                }
                __syncthreads();
            }
        for (int64_t i = threadIdx.x; i < len; i += blockDim.x)
            sorted[t * len + i] = s[i];
        __syncthreads();
    }
}

// Each sorted key's entry: its rank, then DELLA's decision.
__global__ void k_della_apply(float *x, const uint64_t *sorted, int64_t rows, int64_t cols, int64_t len,
                              uint64_t key, int64_t first, double p_lo, double p_hi, bool inv)
{
    int64_t chunks = (cols + len - 1) / len, n = rows * chunks * len;
    for (int64_t q = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; q < n; q += (int64_t)gridDim.x * blockDim.x) {
        uint64_t e = sorted[q];
        if (e == ~0ull)
            continue;  // padding
        int64_t r = q / (chunks * len), c = q / len % chunks, rank = q % len;
        const uint64_t *row = sorted + r * chunks * len;
        for (int64_t c2 = 0; c2 < chunks; c2++) {
            if (c2 == c)
                continue;
            const uint64_t *b = row + c2 * len;
            int64_t lo = 0, left = len;  // the keys of chunk c2 below e: b[0, lo)
            while (left > 0) {
                int64_t half = left / 2;
                if (b[lo + half] < e) {
                    lo += half + 1;
                    left -= half + 1;
                } else {
                    left = half;
                }
            }
            rank += lo;
        }
        int64_t i = r * cols + (int64_t)(uint32_t)e;
        x[i] = lm_della_keep(x[i], key, first + i, lm_della_p(rank, cols, p_lo, p_hi), inv);
    }
}

extern "C" lm_status lm_cuda_della_drop(float *d_x, uint64_t *d_sorted, int64_t rows, int64_t cols, uint64_t key,
                                        int64_t first, double p_lo, double p_hi, bool inv, void *stream, lm_err *err)
{
    lm_status status = LM_OK;
    if (rows <= 0 || cols <= 0)
        return LM_OK;
    int64_t len = lm_della_chunk(cols), units = rows * ((cols + len - 1) / len);
    unsigned blocks = (unsigned)(units > 65535 ? 65535 : units);
    k_della_sort<<<blocks, 256, 0, (cudaStream_t)stream>>>(d_sorted, d_x, rows, cols, len);
    CUDA_LAUNCHED("k_della_sort");
    k_della_apply<<<lm_cuda_grid(units * len, THREADS), THREADS, 0, (cudaStream_t)stream>>>(
        d_x, d_sorted, rows, cols, len, key, first, p_lo, p_hi, inv);
    CUDA_LAUNCHED("k_della_apply");
fail:
    return status;
}

extern "C" lm_status lm_cuda_nearswap(float *d_x, int64_t n, float t, void *stream, lm_err *err)
{
    lm_status status = LM_OK;
    if (n <= 0)
        return LM_OK;
    k_nearswap<<<lm_cuda_grid(n, THREADS), THREADS, 0, (cudaStream_t)stream>>>(d_x, n, t);
    CUDA_LAUNCHED("k_nearswap");
fail:
    return status;
}

extern "C" lm_status lm_cuda_l1_blocks(double *d_partial, const float *d_x, int64_t n, void *stream, lm_err *err)
{
    lm_status status = LM_OK;
    int64_t nb = (n + LM_CUDA_L1_BLOCK - 1) / LM_CUDA_L1_BLOCK;
    if (n <= 0)
        return LM_OK;
    k_l1_blocks<<<grid_warps(nb), 128, 0, (cudaStream_t)stream>>>(d_partial, d_x, n, nb);
    CUDA_LAUNCHED("k_l1_blocks");
fail:
    return status;
}

extern "C" lm_status lm_cuda_combine(float *d_out, const float *d_base, const float *const *d_tau,
                                     const float *weights, int k, int64_t n, bool elect, bool count_signs,
                                     bool unweighted, bool nonzero, bool ramplus, bool normalize, float lambda,
                                     void *stream, lm_err *err)
{
    lm_status status = LM_OK;
    combine_args a;
    if (k > LM_CUDA_COMBINE_MAX)
        return lm_err_set(err, LM_ERR_UNSUPPORTED, "cuda: combining %d task vectors at once is not supported "
                          "(at most %d)", k, LM_CUDA_COMBINE_MAX);
    if (n <= 0)
        return LM_OK;
    memset(&a, 0, sizeof a);
    a.k = k > 0 ? k : 0;
    for (int i = 0; i < a.k; i++) {
        a.tau[i] = d_tau[i];
        a.w[i] = weights[i];
    }
    k_combine<<<lm_cuda_grid(n, THREADS), THREADS, 0, (cudaStream_t)stream>>>(d_out, d_base, a, n, elect, count_signs,
                                                                             unweighted, nonzero, ramplus, normalize,
                                                                             lambda);
    CUDA_LAUNCHED("k_combine");
fail:
    return status;
}

// Loaded when a device opens (cuda_check.h).
LM_CUDA_PRELOAD(k_axpby);
LM_CUDA_PRELOAD(k_random_drop);
LM_CUDA_PRELOAD(k_delta<LM_DTYPE_F32>);
LM_CUDA_PRELOAD(k_delta<LM_DTYPE_BF16>);
LM_CUDA_PRELOAD(k_delta<LM_DTYPE_F16>);
LM_CUDA_PRELOAD(k_delta<LM_DTYPE_F64>);
LM_CUDA_PRELOAD(k_importance);
LM_CUDA_PRELOAD(k_scale_rows);
LM_CUDA_PRELOAD(k_scale_upper);
LM_CUDA_PRELOAD(k_mirror_upper);
LM_CUDA_PRELOAD(k_lowrank);
LM_CUDA_PRELOAD(k_l1_blocks);
LM_CUDA_PRELOAD(k_row_dot);
LM_CUDA_PRELOAD(k_nearswap);
LM_CUDA_PRELOAD(k_row_axpby);
LM_CUDA_PRELOAD(k_col_dot);
LM_CUDA_PRELOAD(k_col_axpby);
LM_CUDA_PRELOAD(k_tau_var);
LM_CUDA_PRELOAD(k_della_sort);
LM_CUDA_PRELOAD(k_della_apply);
LM_CUDA_PRELOAD(k_dora_rows);
LM_CUDA_PRELOAD(k_hist_abs);
LM_CUDA_PRELOAD(k_hist_window);
LM_CUDA_PRELOAD(k_tie_counts);
LM_CUDA_PRELOAD(k_tie_find);
LM_CUDA_PRELOAD(k_topk_mask);
LM_CUDA_PRELOAD(k_mask_get);
LM_CUDA_PRELOAD(k_mask_apply);
LM_CUDA_PRELOAD(k_combine);
