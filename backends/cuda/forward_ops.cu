// Kernels and host launchers for the forward-pass operations of the CUDA backend
// (cuda.cu): embedding lookup, bias rows, RMSNorm, rotary embedding, causal attention over
// packed sequences, the SiLU-gated product and the per-row negative log-likelihood.
//
// Each computes what the CPU backend's cpu_forward.c computes, operation for operation: this
// file is compiled with --fmad=false (no a*b+c contracted into an FMA), without fast-math, and
// the sums the CPU adds in a fixed order are added here in the same order where that decides
// the float32 result (RMSNorm's row sum through seq_sum.cuh, attention's dot products as the
// CPU's dot8). What can still differ is the last bit of the transcendental functions: CUDA's
// expf, sin, cos and log are within 1 or 2 units in the last place, as glibc's are, but not
// always the same units; the results then agree to float32 rounding. gather_rows, add_rows and
// RMSNorm use none (RMSNorm's double sqrt and division round correctly on both) and are the
// CPU's bit for bit.
//
// Each result element is computed by one thread or one block by a fixed sequence of operations
// that depends only on the shapes, never on the grid or on the other rows of the batch, so a
// packed batch gives each sequence the values it gets alone. The launchers only enqueue work on
// the stream they are given, check every launch, and refuse the shapes a kernel cannot take with
// a status naming the operation; nothing here allocates, synchronises or copies.
#include <cuda_runtime.h>

#include <math.h>
#include <stdint.h>

#include "cuda_check.h"
#include "kernels.h"
#include "seq_sum.cuh"

#define ROW_THREADS 256   // threads per block of the row-wise kernels (a block walks a row)
#define ELEM_THREADS 256  // threads per block of the element-wise kernels
#define ATTN_THREADS 128  // threads per block of attention
#define NLL_WARPS (ROW_THREADS / 32)

// Blocks for a loop over `rows` rows, one block per row at a time.
static unsigned grid_rows(int64_t rows)
{
    return lm_cuda_grid(rows, 1);
}

// ==== rows ====================================================================================

// out[i, :] = table[ids[i], :], zeros for an id outside the table (nothing outside it is read).
// A copy moves the bits, as the CPU's memcpy does.
__global__ void k_gather_rows(float *out, const float *table, int64_t table_rows, int64_t cols, const int32_t *ids,
                              int64_t n)
{
    for (int64_t r = blockIdx.x; r < n; r += gridDim.x) {
        int64_t id = ids[r];
        float *o = out + r * cols;
        if (id >= 0 && id < table_rows) {
            const float *src = table + id * cols;
            for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)
                o[c] = src[c];
        } else {
            for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)
                o[c] = 0.0f;
        }
    }
}

// y[r, :] += b.
__global__ void k_add_rows(float *y, const float *b, int64_t rows, int64_t cols)
{
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        float *yr = y + r * cols;
        for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)
            yr[c] += b[c];
    }
}

// cpu_forward.c's rmsnorm_task, one warp per row: Σ x² in double in column order (the CPU's
// sequential sum, so g is its float to the bit), g = float32 of 1/sqrt(mean + eps), then
// out = w ⊙ (x · g) in float32. out may equal x: every lane has read all its columns of the row
// (the last addition of the sum waits for every lane) before any lane writes, and each lane
// writes only the columns it reads.
__global__ void k_rmsnorm(float *out, const float *x, const float *w, int64_t rows, int64_t cols, float eps)
{
    const int lane = threadIdx.x & 31;
    const int64_t warp = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) >> 5;
    const int64_t warps = ((int64_t)gridDim.x * blockDim.x) >> 5;
    for (int64_t r = warp; r < rows; r += warps) {  // uniform across the warp
        const float *xr = x + r * cols;
        float *o = out + r * cols;
        float next[SEQ_TILES];
        load_tiles(next, xr, 0, cols, lane);
        double ss = 0.0;
        for (int64_t g = 0; g < cols; g += 32 * SEQ_TILES) {
            float cur[SEQ_TILES];
#pragma unroll
            for (int j = 0; j < SEQ_TILES; j++)
                cur[j] = next[j];
            load_tiles(next, xr, g + 32 * SEQ_TILES, cols, lane);
#pragma unroll
            for (int j = 0; j < SEQ_TILES; j++) {
                int64_t t0 = g + 32 * j;
                if (t0 < cols)
                    ss = add_lanes_in_order(ss, (double)cur[j] * cur[j], cols - t0 < 32 ? (int)(cols - t0) : 32);
            }
        }
        float gain = (float)(1.0 / sqrt(ss / (double)cols + (double)eps));
        for (int64_t c = lane; c < cols; c += 32)
            o[c] = w[c] * (xr[c] * gain);
    }
}

// Rotary embedding, half-split, cpu_forward.c's rope_task: one thread per (row, frequency i),
// which computes a = float32(pos) · inv_freq[i], cos a and sin a in double rounded to float,
// once, and rotates the pair (i, i + half) of every head of the row.
__global__ void k_rope(float *x, int64_t rows, int64_t heads, int64_t head_dim, const int32_t *pos,
                       const float *inv_freq)
{
    const int64_t half = head_dim / 2, width = heads * head_dim, items = rows * half;
    for (int64_t t = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; t < items; t += (int64_t)gridDim.x * blockDim.x) {
        int64_t r = t / half, i = t - r * half;
        float a = (float)pos[r] * inv_freq[i];  // rounded to float32, as Hugging Face's
        float cs = (float)cos((double)a), sn = (float)sin((double)a);
        float *row = x + r * width;
        for (int64_t h = 0; h < heads; h++) {
            float *lo = row + h * head_dim + i, *hi = lo + half;
            float p = *lo, q = *hi;
            *lo = p * cs - q * sn;
            *hi = q * cs + p * sn;
        }
    }
}

// g[i] = silu(g[i]) · u[i], silu(x) = x / (1 + e^−x), as cpu_forward.c's silu_task.
__global__ void k_silu_mul(float *g, const float *u, int64_t n)
{
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        float x = g[i];
        g[i] = x / (1.0f + expf(-x)) * u[i];
    }
}

// ==== attention ===============================================================================

// cpu_forward.c's dot8: the dot product in eight interleaved partial sums added in a fixed
// order, so a score is the CPU's to the bit.
__device__ __forceinline__ float dot8(const float *a, const float *b, int64_t n)
{
    float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
#pragma unroll
        for (int l = 0; l < 8; l++)
            s[l] += a[i + l] * b[i + l];
    }
    float tail = 0;
    for (; i < n; i++)
        tail += a[i] * b[i];
    return (((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]))) + tail;
}

#define ATTN_QT 8          // query rows of one head a block of k_attention takes at once
#define ATTN_KT 32         // keys per tile of k_attention (one per lane when scoring)
#define ATTN_ROW_THREADS (ATTN_THREADS / ATTN_QT)  // threads that share one query row: 16
#define ATTN_TILE_MAX_HD 128  // the largest head_dim k_attention takes: its tiles fill ~38 KiB
#define ATTN_ACC ((ATTN_TILE_MAX_HD + ATTN_ROW_THREADS - 1) / ATTN_ROW_THREADS)  // dims per thread

// Causal attention, tiled: cpu_forward.c's attn_task for ATTN_QT consecutive query rows of one
// head per block at a time. The block loads the rows' queries, then the keys and values of
// their windows [start[r], r] ATTN_KT at a time, into shared memory with coalesced reads (a key's
// head_dim floats are contiguous; every stored row is padded by one float, so the lanes that
// read different keys hit different banks), shared by the ATTN_QT rows. Each tile's scores
// (scale · q·k with the CPU's dot8, a warp scoring one row against the tile's 32 keys) go to
// shared memory; then the ATTN_ROW_THREADS threads of each row walk them in key order with the
// CPU's online softmax (the running maximum m and sum l, the accumulator rescaled whenever m
// grows), all computing the same m and l, each updating the accumulator dimensions it owns
// (d ≡ its index mod ATTN_ROW_THREADS), kept in registers. Keys outside a row's window (the
// block's rows may lie in different packed sequences, or have a sliding window) are skipped by
// that row. The order of operations is the CPU's for every element, so only expf's last bit
// can differ. Dynamic shared memory: ATTN_QT + 2 · ATTN_KT rows of head_dim + 1 floats and
// ATTN_QT · ATTN_KT scores; head_dim at most ATTN_TILE_MAX_HD.
__global__ void k_attention(float *out, const float *q, const float *k, const float *v, const int32_t *start,
                            int64_t rows, int64_t heads, int64_t group, int64_t head_dim, float scale)
{
    extern __shared__ float sh[];
    const int64_t hd = head_dim, ld = head_dim + 1, qw = heads * hd, kw = (heads / group) * hd;
    float *qs = sh;                    // (ATTN_QT x ld) the queries
    float *ks = qs + ATTN_QT * ld;     // (ATTN_KT x ld) the tile's keys
    float *vs = ks + ATTN_KT * ld;     // (ATTN_KT x ld) the tile's values
    float *score = vs + ATTN_KT * ld;  // (ATTN_QT x ATTN_KT) the tile's scores
    const int tid = threadIdx.x, qi = tid / ATTN_ROW_THREADS, own = tid % ATTN_ROW_THREADS;
    const int64_t row_tiles = (rows + ATTN_QT - 1) / ATTN_QT;
    for (int64_t t = blockIdx.x; t < row_tiles * heads; t += gridDim.x) {  // uniform across the block
        int64_t r0 = t / heads * ATTN_QT, h = t % heads, g = h / group;
        int64_t nq = rows - r0 < ATTN_QT ? rows - r0 : ATTN_QT;
        // the keys any of the rows needs: from the least start to the last row
        int64_t lo = r0 + nq - 1;
        for (int i = 0; i < nq; i++) {
            int64_t s0 = start[r0 + i];
            s0 = s0 < 0 ? 0 : s0 > r0 + i ? r0 + i : s0;
            lo = s0 < lo ? s0 : lo;
        }
        for (int64_t e = tid; e < nq * hd; e += blockDim.x) {
            int64_t i = e / hd, d = e - i * hd;
            qs[i * ld + d] = q[(r0 + i) * qw + h * hd + d];
        }
        // this thread's row
        const int64_t r = r0 + qi;
        int64_t s0 = r < rows ? start[r] : 0;
        if (r < rows && (s0 < 0 || s0 > r))
            s0 = s0 < 0 ? 0 : r;
        float m = -INFINITY, l = 0.0f, acc[ATTN_ACC];
#pragma unroll
        for (int a = 0; a < ATTN_ACC; a++)
            acc[a] = 0.0f;
        for (int64_t c0 = lo; c0 < r0 + nq; c0 += ATTN_KT) {
            int64_t cnt = r0 + nq - c0 < ATTN_KT ? r0 + nq - c0 : ATTN_KT;
            __syncthreads();  // the last tile's keys, values and scores have been used
            for (int64_t e = tid; e < cnt * hd; e += blockDim.x) {
                int64_t j = e / hd, d = e - j * hd, at = (c0 + j) * kw + g * hd + d;
                ks[j * ld + d] = k[at];
                vs[j * ld + d] = v[at];
            }
            __syncthreads();  // the tile (and, the first time, the queries) are in
            for (int e = tid; e < ATTN_QT * ATTN_KT; e += blockDim.x) {
                int i = e / ATTN_KT, j = e % ATTN_KT;
                if (i < nq && j < cnt)
                    score[e] = dot8(qs + i * ld, ks + j * ld, hd) * scale;
            }
            __syncthreads();  // the scores are in
            if (r < rows) {
                for (int64_t j = 0; j < cnt; j++) {
                    int64_t c = c0 + j;
                    if (c < s0 || c > r)
                        continue;
                    float s = score[qi * ATTN_KT + j];
                    const float *vc = vs + j * ld;
                    if (s > m) {
                        float f = expf(m - s);  // 0 for the first key (m = -inf)
                        l *= f;
#pragma unroll
                        for (int a = 0; a < ATTN_ACC; a++)
                            acc[a] *= f;
                        m = s;
                    }
                    float p = expf(s - m);
                    l += p;
#pragma unroll
                    for (int a = 0; a < ATTN_ACC; a++) {
                        int64_t d = own + (int64_t)a * ATTN_ROW_THREADS;
                        if (d < hd)
                            acc[a] += p * vc[d];
                    }
                }
            }
        }
        if (r < rows) {
            float *o = out + r * qw + h * hd;
#pragma unroll
            for (int a = 0; a < ATTN_ACC; a++) {
                int64_t d = own + (int64_t)a * ATTN_ROW_THREADS;
                if (d < hd)
                    o[d] = acc[a] / l;
            }
        }
        __syncthreads();  // qs is written again for the next rows
    }
}

// Causal attention for a head_dim above ATTN_TILE_MAX_HD (k_attention's tiles would not fit in
// shared memory), one block per (query row r, head h) at a time: cpu_forward.c's attn_task.
// The keys of r's window [start[r], r] are taken in tiles of blockDim: each thread scores one
// key of the tile (scale · q·k with dot8) into shared memory; then every thread walks the tile's
// scores in key order with the CPU's online softmax (the running maximum m and sum l, the
// accumulator rescaled whenever m grows), all threads computing the same m and l, and each
// updating the accumulator of the head dimensions it owns (d ≡ threadIdx.x mod blockDim). The
// order of operations is the CPU's for every element, so only expf's last bit can differ.
// Dynamic shared memory: q (head_dim floats), the accumulator (head_dim) and a tile of scores
// (blockDim); the launcher bounds head_dim so that it fits. Keys are tiled, so the length of a
// sequence is not bounded.
__global__ void k_attention_wide(float *out, const float *q, const float *k, const float *v, const int32_t *start,
                                 int64_t rows, int64_t heads, int64_t group, int64_t head_dim, float scale)
{
    extern __shared__ float sh[];
    float *qs = sh;                   // (head_dim) the query vector
    float *acc = sh + head_dim;       // (head_dim) Σ p · v so far, each entry its owner's
    float *score = acc + head_dim;    // (blockDim) the tile's scores
    const int64_t hd = head_dim, qw = heads * hd, kw = (heads / group) * hd, tile = blockDim.x;
    for (int64_t t = blockIdx.x; t < rows * heads; t += gridDim.x) {  // uniform across the block
        int64_t r = t / heads, h = t - r * heads, g = h / group;
        const float *qr = q + r * qw + h * hd;
        for (int64_t d = threadIdx.x; d < hd; d += tile) {
            qs[d] = qr[d];
            acc[d] = 0.0f;
        }
        int64_t s0 = start[r];
        if (s0 < 0 || s0 > r)
            s0 = s0 < 0 ? 0 : r;
        float m = -INFINITY, l = 0.0f;
        __syncthreads();  // qs is read by every thread
        for (int64_t c0 = s0; c0 <= r; c0 += tile) {
            int64_t c = c0 + threadIdx.x, cnt = r - c0 + 1 < tile ? r - c0 + 1 : tile;
            if (c <= r)
                score[threadIdx.x] = dot8(qs, k + c * kw + g * hd, hd) * scale;
            __syncthreads();  // the tile's scores are in
            for (int64_t j = 0; j < cnt; j++) {
                float s = score[j];
                const float *vc = v + (c0 + j) * kw + g * hd;
                if (s > m) {
                    float f = expf(m - s);  // 0 for the first key (m = -inf)
                    l *= f;
                    for (int64_t d = threadIdx.x; d < hd; d += tile)
                        acc[d] *= f;
                    m = s;
                }
                float p = expf(s - m);
                l += p;
                for (int64_t d = threadIdx.x; d < hd; d += tile)
                    acc[d] += p * vc[d];
            }
            __syncthreads();  // score is written again for the next tile
        }
        float *o = out + r * qw + h * hd;
        for (int64_t d = threadIdx.x; d < hd; d += tile)
            o[d] = acc[d] / l;
        __syncthreads();  // qs and acc are written again for the next (row, head)
    }
}

// ==== negative log-likelihood =================================================================

// nll[r] = m + log Σ_c e^(x[r, c] − m) − x[r, targets[r]], one block per row at a time, 0 where
// the target is outside [0, cols): cpu_forward.c's nll_task, the exponentials in float32, their
// sum and the logarithm in double. The maximum and the sum are reduced in a fixed tree (each
// thread's columns in order, then the warp, then the warps in order), so the result depends on
// nothing but the row; the sum's order differs from the CPU's only in double rounding, far below
// the float32 result's. Where the row holds a NaN, both give NaN: a NaN the maximum skips comes
// back through its exponential.
__global__ void k_nll_rows(float *nll, const float *logits, const int32_t *targets, int64_t rows, int64_t cols)
{
    __shared__ float warp_max[NLL_WARPS];
    __shared__ double warp_sum[NLL_WARPS];
    __shared__ float row_max;
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {  // uniform across the block
        const float *x = logits + r * cols;
        int64_t t = targets[r];
        if (t < 0 || t >= cols) {  // uniform: every thread read the same target
            if (threadIdx.x == 0)
                nll[r] = 0.0f;
            continue;
        }
        float m = -INFINITY;
        for (int64_t c = threadIdx.x; c < cols; c += ROW_THREADS)
            m = x[c] > m ? x[c] : m;
        for (int o = 16; o > 0; o >>= 1) {
            float other = __shfl_down_sync(FULL_MASK, m, o);
            m = other > m ? other : m;
        }
        if (lane == 0)
            warp_max[wid] = m;
        __syncthreads();
        if (threadIdx.x == 0) {
            float bm = warp_max[0];
            for (int w = 1; w < NLL_WARPS; w++)
                bm = warp_max[w] > bm ? warp_max[w] : bm;
            row_max = bm;
        }
        __syncthreads();
        m = row_max;
        double sum = 0;
        for (int64_t c = threadIdx.x; c < cols; c += ROW_THREADS)
            sum += (double)expf(x[c] - m);
        for (int o = 16; o > 0; o >>= 1)
            sum += __shfl_down_sync(FULL_MASK, sum, o);
        if (lane == 0)
            warp_sum[wid] = sum;
        __syncthreads();
        if (threadIdx.x == 0) {
            double total = 0;
            for (int w = 0; w < NLL_WARPS; w++)
                total += warp_sum[w];
            nll[r] = (float)((double)m + log(total) - (double)x[t]);
        }
        __syncthreads();  // warp_max, warp_sum and row_max are written again for the next row
    }
}

// ==== launchers ===============================================================================

extern "C" lm_status lm_cuda_gather_rows(float *d_out, const float *d_table, int64_t table_rows, int64_t cols,
                                         const int32_t *d_ids, int64_t n, void *stream, lm_err *err)
{
    lm_status status = LM_OK;
    if (n <= 0 || cols <= 0)
        return LM_OK;
    k_gather_rows<<<grid_rows(n), ROW_THREADS, 0, (cudaStream_t)stream>>>(d_out, d_table, table_rows, cols, d_ids,
                                                                          n);
    CUDA_LAUNCHED("k_gather_rows");
fail:
    return status;
}

extern "C" lm_status lm_cuda_add_rows(float *d_y, const float *d_b, int64_t rows, int64_t cols, void *stream,
                                      lm_err *err)
{
    lm_status status = LM_OK;
    if (rows <= 0 || cols <= 0)
        return LM_OK;
    k_add_rows<<<grid_rows(rows), ROW_THREADS, 0, (cudaStream_t)stream>>>(d_y, d_b, rows, cols);
    CUDA_LAUNCHED("k_add_rows");
fail:
    return status;
}

extern "C" lm_status lm_cuda_rmsnorm(float *d_out, const float *d_x, const float *d_w, int64_t rows, int64_t cols,
                                     float eps, void *stream, lm_err *err)
{
    lm_status status = LM_OK;
    if (rows <= 0 || cols <= 0)
        return LM_OK;
    // one warp per row, four to a block
    k_rmsnorm<<<lm_cuda_grid(rows, 4), 128, 0, (cudaStream_t)stream>>>(d_out, d_x, d_w, rows, cols, eps);
    CUDA_LAUNCHED("k_rmsnorm");
fail:
    return status;
}

extern "C" lm_status lm_cuda_rope(float *d_x, int64_t rows, int64_t heads, int64_t head_dim, const int32_t *d_pos,
                                  const float *d_inv_freq, void *stream, lm_err *err)
{
    lm_status status = LM_OK;
    if (rows <= 0 || heads <= 0 || head_dim / 2 <= 0)
        return LM_OK;
    k_rope<<<lm_cuda_grid(rows * (head_dim / 2), ELEM_THREADS), ELEM_THREADS, 0, (cudaStream_t)stream>>>(
        d_x, rows, heads, head_dim, d_pos, d_inv_freq);
    CUDA_LAUNCHED("k_rope");
fail:
    return status;
}

extern "C" lm_status lm_cuda_attention(float *d_out, const float *d_q, const float *d_k, const float *d_v,
                                       const int32_t *d_start, int64_t rows, int64_t heads, int64_t kv_heads,
                                       int64_t head_dim, float scale, void *stream, lm_err *err)
{
    lm_status status = LM_OK;
    if (heads <= 0 || kv_heads <= 0 || heads % kv_heads != 0)
        return lm_err_set(err, LM_ERR_USAGE, "cuda: attention with %lld heads and %lld kv heads (heads must be a "
                          "multiple of kv heads)", (long long)heads, (long long)kv_heads);
    if (head_dim < 0 || head_dim > LM_CUDA_ATTN_MAX_HEAD_DIM)
        return lm_err_set(err, LM_ERR_UNSUPPORTED, "cuda: attention with head_dim %lld is not supported (at most %d: "
                          "the query and its accumulator live in shared memory)", (long long)head_dim,
                          LM_CUDA_ATTN_MAX_HEAD_DIM);
    if (rows <= 0 || head_dim == 0)
        return LM_OK;
    if (head_dim <= ATTN_TILE_MAX_HD) {
        size_t shared =
            ((size_t)(ATTN_QT + 2 * ATTN_KT) * (size_t)(head_dim + 1) + ATTN_QT * ATTN_KT) * sizeof(float);
        int64_t row_tiles = (rows + ATTN_QT - 1) / ATTN_QT;
        k_attention<<<lm_cuda_grid(row_tiles * heads, 1), ATTN_THREADS, shared, (cudaStream_t)stream>>>(
            d_out, d_q, d_k, d_v, d_start, rows, heads, heads / kv_heads, head_dim, scale);
        CUDA_LAUNCHED("k_attention");
    } else {
        size_t shared = ((size_t)2 * (size_t)head_dim + ATTN_THREADS) * sizeof(float);
        k_attention_wide<<<lm_cuda_grid(rows * heads, 1), ATTN_THREADS, shared, (cudaStream_t)stream>>>(
            d_out, d_q, d_k, d_v, d_start, rows, heads, heads / kv_heads, head_dim, scale);
        CUDA_LAUNCHED("k_attention_wide");
    }
fail:
    return status;
}

extern "C" lm_status lm_cuda_silu_mul(float *d_gate, const float *d_up, int64_t n, void *stream, lm_err *err)
{
    lm_status status = LM_OK;
    if (n <= 0)
        return LM_OK;
    k_silu_mul<<<lm_cuda_grid(n, ELEM_THREADS), ELEM_THREADS, 0, (cudaStream_t)stream>>>(d_gate, d_up, n);
    CUDA_LAUNCHED("k_silu_mul");
fail:
    return status;
}

extern "C" lm_status lm_cuda_nll_rows(float *d_nll, const float *d_logits, const int32_t *d_targets, int64_t rows,
                                      int64_t cols, void *stream, lm_err *err)
{
    lm_status status = LM_OK;
    if (rows <= 0)
        return LM_OK;
    k_nll_rows<<<grid_rows(rows), ROW_THREADS, 0, (cudaStream_t)stream>>>(d_nll, d_logits, d_targets, rows, cols);
    CUDA_LAUNCHED("k_nll_rows");
fail:
    return status;
}

// Loaded when a device opens (cuda_check.h).
LM_CUDA_PRELOAD(k_gather_rows);
LM_CUDA_PRELOAD(k_add_rows);
LM_CUDA_PRELOAD(k_rmsnorm);
LM_CUDA_PRELOAD(k_rope);
LM_CUDA_PRELOAD(k_silu_mul);
LM_CUDA_PRELOAD(k_attention);
LM_CUDA_PRELOAD(k_attention_wide);
LM_CUDA_PRELOAD(k_nll_rows);
