// The CPU backend of the device interface: host memory, OpenBLAS for GEMM, and a thread pool
// for the element-wise operations. Work is split into fixed blocks of BLOCK elements, each
// written by one task, and reductions add per-block partial sums in block order, so every
// result is independent of the thread count. Device pointers are host pointers, so callers may
// hand mmapped inputs straight to the operations.
#include "device_impl.h"

#include <cblas.h>
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_AVX512_PATH 1  // kernels with AVX-512 or AVX2 and FMA, chosen when the processor has them
#define HAVE_FMA_PATH 1
#endif
#include <inttypes.h>
#include <lapacke.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "parallel.h"
#include "sparsify.h"
#include "util.h"

#define BLOCK 65536  // elements per task

typedef struct cpu_ctx {
    lm_pool *pool;
    uint32_t *hist_local;     // histogram tables of cpu_hist_abs, zero between calls
    size_t hist_cells;
    pthread_mutex_t hist_mu;  // guards the caller's histogram while tasks add to it
    float *lora_tau;          // the fused dense operations' LoRA τ, a span per part per task
    size_t lora_cells;
} cpu_ctx;

static lm_pool *pool_of(lm_dev *d)
{
    return ((cpu_ctx *)d->ctx)->pool;
}

static int64_t n_blocks(int64_t n)
{
    return (n + BLOCK - 1) / BLOCK;
}

// ==== memory ==================================================================================

static const char *cpu_name(lm_dev *d)
{
    (void)d;
    return "cpu";
}

static void cpu_mem_info(lm_dev *d, size_t *free_bytes, size_t *total_bytes)
{
    (void)d;
    long pages = sysconf(_SC_PHYS_PAGES), avail = sysconf(_SC_AVPHYS_PAGES), size = sysconf(_SC_PAGE_SIZE);
    *total_bytes = pages > 0 && size > 0 ? (size_t)pages * (size_t)size : 0;
    *free_bytes = avail > 0 && size > 0 ? (size_t)avail * (size_t)size : 0;
}

static lm_status cpu_alloc(lm_dev *d, size_t size, void **ptr, lm_err *err)
{
    (void)d;
    // 64-byte alignment for vector loads; the size is rounded up as aligned_alloc wants.
    size_t rounded = (size + 63) & ~(size_t)63;
    *ptr = rounded >= size ? aligned_alloc(64, rounded) : NULL;
    if (!*ptr) {
        char b[32];
        return lm_err_set(err, LM_ERR_NOMEM, "cpu: out of memory allocating %s", lm_format_bytes(b, sizeof b, size));
    }
    return LM_OK;
}

static void cpu_free(lm_dev *d, void *ptr)
{
    (void)d;
    free(ptr);
}

static lm_status cpu_copy(lm_dev *d, void *dst, const void *src, size_t n, lm_err *err)
{
    (void)d;
    (void)err;
    memcpy(dst, src, n);
    return LM_OK;
}

static void cpu_destroy(lm_dev *d)
{
    cpu_ctx *c = d->ctx;
    if (c) {
        lm_pool_free(c->pool);
        free(c->hist_local);
        free(c->lora_tau);
        pthread_mutex_destroy(&c->hist_mu);
    }
    free(c);
    free(d);
}

// ==== conversion ==============================================================================

typedef struct conv_job {
    void *dst;
    const void *src;
    lm_dtype dt;
    int64_t n;
    bool to_f32;
    lm_nonfinite *nf;  // the counting conversions' sums, or NULL
} conv_job;

// Adds one task's counts to an operation's sums, from any thread (integer sums: the order the
// tasks finish in does not matter).
static void nf_add(lm_nonfinite *to, const lm_nonfinite *c)
{
    if (c->nan)
        __atomic_fetch_add(&to->nan, c->nan, __ATOMIC_RELAXED);
    if (c->inf)
        __atomic_fetch_add(&to->inf, c->inf, __ATOMIC_RELAXED);
}

static void conv_task(void *ctx, int64_t b)
{
    conv_job *j = ctx;
    int64_t lo = b * BLOCK, cnt = j->n - lo < BLOCK ? j->n - lo : BLOCK;
    size_t esz = lm_dtype_bits(j->dt) / 8;
    void *wide = (float *)(j->to_f32 ? j->dst : (void *)j->src) + lo;
    void *narrow = (char *)(j->to_f32 ? (void *)j->src : j->dst) + (size_t)lo * esz;
    lm_nonfinite c = {0, 0};
    if (j->to_f32 && j->nf)
        lm_convert_to_f32_nf(wide, narrow, j->dt, cnt, &c, NULL);
    else if (j->to_f32)
        lm_convert_to_f32(wide, narrow, j->dt, cnt, NULL);
    else if (j->nf)
        lm_convert_from_f32_nf(narrow, j->dt, wide, cnt, &c, NULL);
    else
        lm_convert_from_f32(narrow, j->dt, wide, cnt, NULL);
    if (j->nf)
        nf_add(j->nf, &c);
}

static lm_status cpu_to_f32_count(lm_dev *d, float *dst, const void *src, lm_dtype dt, int64_t n, lm_nonfinite *nf,
                                  lm_err *err)
{
    if (!lm_dtype_readable(dt))
        return lm_convert_to_f32(dst, src, dt, 0, err);
    conv_job j = {dst, src, dt, n, true, nf};
    lm_pool_run(pool_of(d), n_blocks(n), conv_task, &j);
    return LM_OK;
}

static lm_status cpu_to_f32(lm_dev *d, float *dst, const void *src, lm_dtype dt, int64_t n, lm_err *err)
{
    return cpu_to_f32_count(d, dst, src, dt, n, NULL, err);
}

static lm_status cpu_from_f32_count(lm_dev *d, void *dst, lm_dtype dt, const float *src, int64_t n, lm_nonfinite *nf,
                                    lm_err *err)
{
    if (!lm_dtype_writable(dt))
        return lm_convert_from_f32(dst, dt, src, 0, err);
    conv_job j = {dst, src, dt, n, false, nf};
    lm_pool_run(pool_of(d), n_blocks(n), conv_task, &j);
    return LM_OK;
}

static lm_status cpu_from_f32(lm_dev *d, void *dst, lm_dtype dt, const float *src, int64_t n, lm_err *err)
{
    return cpu_from_f32_count(d, dst, dt, src, n, NULL, err);
}

// ==== GEMM and element-wise arithmetic ========================================================

typedef struct gemm_job {
    bool ta, tb;
    int64_t m, n, k;
    int64_t tile_rows, tile_cols, n_tile_cols;
    float alpha, beta;
    const float *a, *b;
    float *c;
    int64_t lda, ldb, ldc;
} gemm_job;

// One task computes one tile of C with single-threaded BLAS. Every element of C is the same
// dot product whichever tile holds it, so the result does not depend on the split.
static void gemm_task(void *ctx, int64_t t)
{
    gemm_job *j = ctx;
    int64_t r0 = t / j->n_tile_cols * j->tile_rows, c0 = t % j->n_tile_cols * j->tile_cols;
    int64_t rows = j->m - r0 < j->tile_rows ? j->m - r0 : j->tile_rows;
    int64_t cols = j->n - c0 < j->tile_cols ? j->n - c0 : j->tile_cols;
    // Row r of op(A) starts at a + r·lda, or (transposed) at column r: a + r. Column c of op(B)
    // starts at b + c, or (transposed) at row c: b + c·ldb.
    const float *a = j->a + (j->ta ? r0 : r0 * j->lda);
    const float *b = j->b + (j->tb ? c0 * j->ldb : c0);
    cblas_sgemm(CblasRowMajor, j->ta ? CblasTrans : CblasNoTrans, j->tb ? CblasTrans : CblasNoTrans, (int)rows,
                (int)cols, (int)j->k, j->alpha, a, (int)j->lda, b, (int)j->ldb, j->beta, j->c + r0 * j->ldc + c0,
                (int)j->ldc);
}

static int64_t ceil_div(int64_t a, int64_t b)
{
    return (a + b - 1) / b;
}

// The tile of C a GEMM task computes: at most GEMM_TILE_ROWS × GEMM_TILE_COLS, halved until
// there are GEMM_TASKS tiles or they reach GEMM_MIN_ROWS × GEMM_MIN_COLS. Each task packs its
// rows of op(A) and its columns of op(B) anew, so tiles are kept large: a task that computes
// only a few rows of C against all of B spends most of its time packing B (the forward pass's
// 32-row blocks of an 8192-wide layer ran at a third of the rate of these tiles).
#define GEMM_TILE_ROWS 512
#define GEMM_TILE_COLS 1024
#define GEMM_MIN_ROWS 128
#define GEMM_MIN_COLS 256
#define GEMM_TASKS 8

static void gemm_tiles(int64_t m, int64_t n, int64_t *tile_rows, int64_t *tile_cols)
{
    int64_t tr = m < GEMM_TILE_ROWS ? m : GEMM_TILE_ROWS, tc = n < GEMM_TILE_COLS ? n : GEMM_TILE_COLS;
    while (ceil_div(m, tr) * ceil_div(n, tc) < GEMM_TASKS) {
        if (tc > GEMM_MIN_COLS && tc >= 2 * tr)
            tc = ceil_div(tc, 32) * 16;
        else if (tr > GEMM_MIN_ROWS)
            tr = ceil_div(tr, 2);
        else if (tc > GEMM_MIN_COLS)
            tc = ceil_div(tc, 32) * 16;
        else
            break;
    }
    *tile_rows = tr;
    *tile_cols = tc;
}

// ---- low-rank products -----------------------------------------------------------------------
// A product of rank k <= LM_DEV_LOWRANK_MAX without transposes (a LoRA pair's B @ A) is made
// here rather than by BLAS: each element is one fused multiply-add chain over k in order, from
// zero, then scaled, so its value depends on its own inputs alone. The fused dense operations
// make a LoRA τ a span at a time with the same code and get the GEMM's bits; BLAS picks its
// kernel by the shape it is given, and a span is not the shape of the whole product. The work
// is k multiply-adds per element. With AVX-512 four rows go at a time, which took about a tenth
// off the kernel's time in the benchmark's TIES merge of LoRA adapters (about 1.2 cycles per
// element at rank 16, near one 16-wide multiply-add per cycle).

// c[i·ldc + j] = alpha · Σ_q x[i·ldx + q] · y[q·ldy + j] (+ beta · c[i·ldc + j] unless beta is 0,
// c then not read) for i < m, j < n, k <= LM_DEV_LOWRANK_MAX. A block of LOWRANK_COLS columns of
// y at a time for every row: the block is first copied together (k × LOWRANK_COLS values, in
// the first-level cache while the rows pass; y's rows as they are lie a power of two apart and
// would fall into the same few cache sets).
#define LOWRANK_COLS 64

// The plain loop, for columns [j0, n): the vector kernels' results, element for element.
static void lowrank_plain(float *c, int64_t ldc, const float *x, int64_t ldx, const float *y, int64_t ldy, int64_t m,
                          int64_t k, int64_t j0, int64_t n, float alpha, float beta)
{
    for (int64_t i = 0; i < m; i++)
        for (int64_t j = j0; j < n; j++) {
            float acc = 0.0f;
            for (int64_t q = 0; q < k; q++)
                acc = fmaf(x[i * ldx + q], y[q * ldy + j], acc);
            float *ci = c + i * ldc + j;
            *ci = beta != 0.0f ? alpha * acc + beta * *ci : alpha * acc;
        }
}

#ifdef HAVE_AVX512_PATH
// Row i's LOWRANK_COLS results at ci: alpha · acc (+ beta · ci), the columns of mk only.
__attribute__((target("avx512f"))) static inline void lowrank_put_avx512(float *ci, const __m512 acc[4],
                                                                        const __mmask16 mk[4], float alpha,
                                                                        float beta)
{
    for (int v = 0; v < 4 && mk[v]; v++) {
        __m512 o = _mm512_mul_ps(_mm512_set1_ps(alpha), acc[v]);
        if (beta != 0.0f)
            o = _mm512_add_ps(o, _mm512_mul_ps(_mm512_set1_ps(beta), _mm512_maskz_loadu_ps(mk[v], ci + 16 * v)));
        _mm512_mask_storeu_ps(ci + 16 * v, mk[v], o);
    }
}

// Four rows at a time: 16 independent chains in flight, enough to cover the multiply-add's
// latency on both of its ports, with each column vector loaded once for the four rows.
__attribute__((target("avx512f"))) static void lowrank_tile_avx512(float *c, int64_t ldc, const float *x, int64_t ldx,
                                                                  const float *y, int64_t ldy, int64_t m, int64_t k,
                                                                  int64_t n, float alpha, float beta)
{
    _Alignas(64) float pack[LM_DEV_LOWRANK_MAX * LOWRANK_COLS];
    for (int64_t j = 0; j < n; j += LOWRANK_COLS) {
        __mmask16 mk[4];
        for (int v = 0; v < 4; v++) {
            int64_t left = n - j - 16 * v;
            mk[v] = left >= 16 ? (__mmask16)0xFFFF : left > 0 ? (__mmask16)((1u << left) - 1) : 0;
        }
        for (int64_t q = 0; q < k; q++)
            for (int v = 0; v < 4; v++)
                _mm512_store_ps(pack + q * LOWRANK_COLS + 16 * v,
                                _mm512_maskz_loadu_ps(mk[v], y + q * ldy + j + 16 * v));
        int64_t i = 0;
        for (; i + 4 <= m; i += 4) {
            const float *xi = x + i * ldx;
            __m512 acc[4][4];
            for (int rr = 0; rr < 4; rr++)
                for (int v = 0; v < 4; v++)
                    acc[rr][v] = _mm512_setzero_ps();
            for (int64_t q = 0; q < k; q++) {
                const float *yq = pack + q * LOWRANK_COLS;
                __m512 y0 = _mm512_load_ps(yq), y1 = _mm512_load_ps(yq + 16), y2 = _mm512_load_ps(yq + 32),
                       y3 = _mm512_load_ps(yq + 48);
                for (int rr = 0; rr < 4; rr++) {
                    __m512 xq = _mm512_set1_ps(xi[rr * ldx + q]);
                    acc[rr][0] = _mm512_fmadd_ps(xq, y0, acc[rr][0]);
                    acc[rr][1] = _mm512_fmadd_ps(xq, y1, acc[rr][1]);
                    acc[rr][2] = _mm512_fmadd_ps(xq, y2, acc[rr][2]);
                    acc[rr][3] = _mm512_fmadd_ps(xq, y3, acc[rr][3]);
                }
            }
            for (int rr = 0; rr < 4; rr++)
                lowrank_put_avx512(c + (i + rr) * ldc + j, acc[rr], mk, alpha, beta);
        }
        for (; i < m; i++) {
            const float *xi = x + i * ldx;
            __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
            for (int64_t q = 0; q < k; q++) {
                const float *yq = pack + q * LOWRANK_COLS;
                __m512 xq = _mm512_set1_ps(xi[q]);
                for (int v = 0; v < 4; v++)
                    acc[v] = _mm512_fmadd_ps(xq, _mm512_load_ps(yq + 16 * v), acc[v]);
            }
            lowrank_put_avx512(c + i * ldc + j, acc, mk, alpha, beta);
        }
    }
}
#endif

#ifdef HAVE_FMA_PATH
__attribute__((target("avx2,fma"))) static void lowrank_tile_fma(float *c, int64_t ldc, const float *x, int64_t ldx,
                                                                const float *y, int64_t ldy, int64_t m, int64_t k,
                                                                int64_t n, float alpha, float beta)
{
    const __m256 al = _mm256_set1_ps(alpha), be = _mm256_set1_ps(beta);
    _Alignas(32) float pack[LM_DEV_LOWRANK_MAX * 32];
    int64_t j = 0;
    for (; j + 32 <= n; j += 32) {
        for (int64_t q = 0; q < k; q++)
            memcpy(pack + q * 32, y + q * ldy + j, 32 * sizeof *pack);
        for (int64_t i = 0; i < m; i++) {
            const float *xi = x + i * ldx;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int64_t q = 0; q < k; q++) {
                const float *yq = pack + q * 32;
                __m256 xq = _mm256_set1_ps(xi[q]);
                a0 = _mm256_fmadd_ps(xq, _mm256_loadu_ps(yq), a0);
                a1 = _mm256_fmadd_ps(xq, _mm256_loadu_ps(yq + 8), a1);
                a2 = _mm256_fmadd_ps(xq, _mm256_loadu_ps(yq + 16), a2);
                a3 = _mm256_fmadd_ps(xq, _mm256_loadu_ps(yq + 24), a3);
            }
            __m256 r[4] = {a0, a1, a2, a3};
            float *ci = c + i * ldc + j;
            for (int v = 0; v < 4; v++) {
                __m256 o = _mm256_mul_ps(al, r[v]);
                if (beta != 0.0f)
                    o = _mm256_add_ps(o, _mm256_mul_ps(be, _mm256_loadu_ps(ci + 8 * v)));
                _mm256_storeu_ps(ci + 8 * v, o);
            }
        }
    }
    lowrank_plain(c, ldc, x, ldx, y, ldy, m, k, j, n, alpha, beta);
}
#endif

static void lowrank_tile(float *c, int64_t ldc, const float *x, int64_t ldx, const float *y, int64_t ldy, int64_t m,
                         int64_t k, int64_t n, float alpha, float beta)
{
#ifdef HAVE_AVX512_PATH
    if (__builtin_cpu_supports("avx512f")) {
        lowrank_tile_avx512(c, ldc, x, ldx, y, ldy, m, k, n, alpha, beta);
        return;
    }
#endif
#ifdef HAVE_FMA_PATH
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
        lowrank_tile_fma(c, ldc, x, ldx, y, ldy, m, k, n, alpha, beta);
        return;
    }
#endif
    lowrank_plain(c, ldc, x, ldx, y, ldy, m, k, 0, n, alpha, beta);
}

// A gemm_job's rows [t · tile_rows, (t + 1) · tile_rows), every column.
static void lowrank_task(void *ctx, int64_t t)
{
    gemm_job *j = ctx;
    int64_t r0 = t * j->tile_rows, r1 = r0 + j->tile_rows < j->m ? r0 + j->tile_rows : j->m;
    lowrank_tile(j->c + r0 * j->ldc, j->ldc, j->a + r0 * j->lda, j->lda, j->b, j->ldb, r1 - r0, j->k, j->n, j->alpha,
                 j->beta);
}

static lm_status cpu_gemm(lm_dev *d, bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha,
                          const float *a, int64_t lda, const float *b, int64_t ldb, float beta,
                          float *c, int64_t ldc, lm_err *err)
{
    if (m > INT32_MAX || n > INT32_MAX || k > INT32_MAX || lda > INT32_MAX || ldb > INT32_MAX || ldc > INT32_MAX)
        return lm_err_set(err, LM_ERR_UNSUPPORTED, "cpu: GEMM of %lld x %lld x %lld is too large for BLAS",
                          (long long)m, (long long)n, (long long)k);
    if (m == 0 || n == 0)
        return LM_OK;
    if (!ta && !tb && k <= LM_DEV_LOWRANK_MAX) {
        gemm_job j = {.m = m, .n = n, .k = k, .tile_rows = BLOCK / n > 0 ? BLOCK / n : 1, .alpha = alpha,
                      .beta = beta, .a = a, .b = b, .c = c, .lda = lda, .ldb = ldb, .ldc = ldc};
        lm_pool_run(pool_of(d), ceil_div(m, j.tile_rows), lowrank_task, &j);
        return LM_OK;
    }
    // OpenBLAS runs single-threaded (its spinning workers would compete with the pool); the
    // pool splits C into tiles. The split depends on the shape alone, never on the thread
    // count: OpenBLAS picks its kernel by the shape it is given, and at small shapes a row's
    // result can depend on how many rows are beside it.
    gemm_job j = {.ta = ta, .tb = tb, .m = m, .n = n, .k = k, .alpha = alpha, .beta = beta, .a = a, .b = b,
                  .c = c, .lda = lda, .ldb = ldb, .ldc = ldc};
    gemm_tiles(m, n, &j.tile_rows, &j.tile_cols);
    j.n_tile_cols = ceil_div(n, j.tile_cols);
    lm_pool_run(pool_of(d), ceil_div(m, j.tile_rows) * j.n_tile_cols, gemm_task, &j);
    return LM_OK;
}

// ---- symmetric rank-k update ------------------------------------------------------------------

typedef struct syrk_job {
    int64_t n, k, tile, n_tiles;  // n_tiles: tiles per side of C
    float alpha, beta;
    const float *a;
    float *c;
    int64_t lda, ldc;
} syrk_job;

// Side of the square tiles of C a syrk task computes: a quarter of n, from SYRK_TILE_MIN to
// SYRK_TILE_MAX, so that packing stays small beside the arithmetic and the upper triangle
// still has several tiles to share out.
#define SYRK_TILE_MIN 256
#define SYRK_TILE_MAX 1024
#define MIRROR_TILE 64  // rows and columns of the tiles the mirror copies (a 16 KiB buffer)

// Tile t of the upper triangle, numbered along its rows: (bi, bj) with bi <= bj.
static void upper_tile(int64_t t, int64_t n_tiles, int64_t *bi, int64_t *bj)
{
    int64_t i = 0;
    while (t >= n_tiles - i) {
        t -= n_tiles - i;
        i++;
    }
    *bi = i;
    *bj = i + t;
}

// One tile of the upper triangle: ssyrk on the diagonal, sgemm above it. With beta 0 the
// diagonal tile's triangle is cleared here and the update added to it, so that whatever C held
// (NaN included) never reaches the result through BLAS's scaling by zero.
static void syrk_task(void *ctx, int64_t t)
{
    syrk_job *j = ctx;
    int64_t bi, bj;
    upper_tile(t, j->n_tiles, &bi, &bj);
    int64_t r0 = bi * j->tile, c0 = bj * j->tile;
    int64_t rows = j->n - r0 < j->tile ? j->n - r0 : j->tile, cols = j->n - c0 < j->tile ? j->n - c0 : j->tile;
    float *c = j->c + r0 * j->ldc + c0;
    if (bi == bj) {
        float beta = j->beta;
        if (beta == 0.0f) {
            for (int64_t r = 0; r < rows; r++)
                memset(c + r * j->ldc + r, 0, (size_t)(cols - r) * sizeof *c);
            beta = 1.0f;
        }
        cblas_ssyrk(CblasRowMajor, CblasUpper, CblasTrans, (int)rows, (int)j->k, j->alpha, j->a + r0, (int)j->lda,
                    beta, c, (int)j->ldc);
    } else {
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)rows, (int)cols, (int)j->k, j->alpha, j->a + r0,
                    (int)j->lda, j->a + c0, (int)j->lda, j->beta, c, (int)j->ldc);
    }
}

// C = beta·C on the upper triangle of rows [MIRROR_TILE·t, +MIRROR_TILE) (for k = 0).
static void syrk_scale_task(void *ctx, int64_t t)
{
    syrk_job *j = ctx;
    int64_t r1 = (t + 1) * MIRROR_TILE < j->n ? (t + 1) * MIRROR_TILE : j->n;
    for (int64_t r = t * MIRROR_TILE; r < r1; r++) {
        float *row = j->c + r * j->ldc;
        for (int64_t c = r; c < j->n; c++)
            row[c] = j->beta == 0.0f ? 0.0f : j->beta * row[c];
    }
}

// The strictly lower triangle of rows [MIRROR_TILE·t, +MIRROR_TILE) from the upper one, a
// MIRROR_TILE-square tile at a time: the tile above the diagonal is read row by row into a
// buffer and written out transposed (twice as fast as reading it down its columns in place).
static void mirror_task(void *ctx, int64_t t)
{
    syrk_job *j = ctx;
    float buf[MIRROR_TILE][MIRROR_TILE];
    int64_t r0 = t * MIRROR_TILE, r1 = r0 + MIRROR_TILE < j->n ? r0 + MIRROR_TILE : j->n;
    for (int64_t c0 = 0; c0 < r1; c0 += MIRROR_TILE) {
        int64_t c1 = c0 + MIRROR_TILE < r1 ? c0 + MIRROR_TILE : r1;
        for (int64_t c = c0; c < c1; c++)
            memcpy(buf[c - c0], j->c + c * j->ldc + r0, (size_t)(r1 - r0) * sizeof(float));
        for (int64_t r = r0; r < r1; r++) {
            float *row = j->c + r * j->ldc;
            int64_t end = c1 < r ? c1 : r;
            for (int64_t c = c0; c < end; c++)
                row[c] = buf[c - c0][r - r0];
        }
    }
}

static lm_status cpu_syrk(lm_dev *d, int64_t n, int64_t k, float alpha, const float *a, int64_t lda, float beta,
                          bool mirror, float *c, int64_t ldc, lm_err *err)
{
    if (n > INT32_MAX || k > INT32_MAX || lda > INT32_MAX || ldc > INT32_MAX)
        return lm_err_set(err, LM_ERR_UNSUPPORTED, "cpu: syrk of %lld x %lld is too large for BLAS", (long long)n,
                          (long long)k);
    if (n == 0)
        return LM_OK;
    syrk_job j = {.n = n, .k = k, .alpha = alpha, .beta = beta, .a = a, .c = c, .lda = lda, .ldc = ldc};
    // tiles of the upper triangle, or, with nothing to add, only beta (the split is the shape's)
    j.tile = ceil_div(n, 4 * 64) * 64;
    j.tile = j.tile < SYRK_TILE_MIN ? SYRK_TILE_MIN : j.tile > SYRK_TILE_MAX ? SYRK_TILE_MAX : j.tile;
    j.n_tiles = ceil_div(n, j.tile);
    if (k > 0)
        lm_pool_run(pool_of(d), j.n_tiles * (j.n_tiles + 1) / 2, syrk_task, &j);
    else if (beta != 1.0f)
        lm_pool_run(pool_of(d), ceil_div(n, MIRROR_TILE), syrk_scale_task, &j);
    if (mirror)
        lm_pool_run(pool_of(d), ceil_div(n, MIRROR_TILE), mirror_task, &j);
    return LM_OK;
}

typedef struct axpby_job {
    float *y;
    const float *x;
    float a, b;
    int64_t n;
} axpby_job;

static void axpby_task(void *ctx, int64_t blk)
{
    axpby_job *j = ctx;
    int64_t lo = blk * BLOCK, hi = lo + BLOCK < j->n ? lo + BLOCK : j->n;
    for (int64_t i = lo; i < hi; i++)
        j->y[i] = j->a * j->y[i] + j->b * j->x[i];
}

static lm_status cpu_axpby(lm_dev *d, float *y, float a, const float *x, float b, int64_t n, lm_err *err)
{
    (void)err;
    axpby_job j = {y, x, a, b, n};
    lm_pool_run(pool_of(d), n_blocks(n), axpby_task, &j);
    return LM_OK;
}

typedef struct delta_job {
    float *tau;
    const void *src;
    lm_dtype dt;
    const float *base;
    int64_t n;
    lm_nonfinite *nf;  // the NaN and Inf of src, or NULL
} delta_job;

LM_VECTOR_CLONES static void subtract(float *restrict t, const float *restrict b, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        t[i] = t[i] - b[i];
}

// Converts a block, then subtracts while it is still in cache. y + (−1)·x is y − x exactly,
// so the values are axpby's.
static void delta_task(void *ctx, int64_t blk)
{
    delta_job *j = ctx;
    int64_t lo = blk * BLOCK, cnt = j->n - lo < BLOCK ? j->n - lo : BLOCK;
    float *t = j->tau + lo;
    const float *b = j->base + lo;
    const char *src = (const char *)j->src + (size_t)lo * (lm_dtype_bits(j->dt) / 8);
    lm_nonfinite c = {0, 0};
    if (j->nf)
        lm_convert_to_f32_nf(t, src, j->dt, cnt, &c, NULL);
    else
        lm_convert_to_f32(t, src, j->dt, cnt, NULL);
    subtract(t, b, cnt);
    if (j->nf)
        nf_add(j->nf, &c);
}

static lm_status cpu_delta_count(lm_dev *d, float *tau, const void *src, lm_dtype dt, const float *base, int64_t n,
                                 lm_nonfinite *nf, lm_err *err)
{
    if (!lm_dtype_readable(dt))
        return lm_convert_to_f32(tau, src, dt, 0, err);
    delta_job j = {tau, src, dt, base, n, nf};
    lm_pool_run(pool_of(d), n_blocks(n), delta_task, &j);
    return LM_OK;
}

static lm_status cpu_delta(lm_dev *d, float *tau, const void *src, lm_dtype dt, const float *base, int64_t n,
                           lm_err *err)
{
    return cpu_delta_count(d, tau, src, dt, base, n, NULL, err);
}

typedef struct dora_job {
    float *tau;
    const float *base, *mag;
    int64_t cols;
} dora_job;

static void dora_task(void *ctx, int64_t r)
{
    dora_job *j = ctx;
    float *t = j->tau + r * j->cols;
    const float *b = j->base + r * j->cols;
    double ss = 0;
    for (int64_t c = 0; c < j->cols; c++) {
        float w = b[c] + t[c];
        ss += (double)w * w;
    }
    // A row whose adapted weight is all zeros has no direction to scale: it stays zero.
    float f = ss > 0 ? (float)(j->mag[r] / sqrt(ss)) : 0.0f;
    for (int64_t c = 0; c < j->cols; c++)
        t[c] = f * (b[c] + t[c]) - b[c];
}

static lm_status cpu_dora_rows(lm_dev *d, float *tau, const float *base, const float *magnitude,
                               int64_t rows, int64_t cols, lm_err *err)
{
    (void)err;
    dora_job j = {tau, base, magnitude, cols};
    lm_pool_run(pool_of(d), rows, dora_task, &j);
    return LM_OK;
}

// ==== selection ===============================================================================

typedef struct hist_job {
    uint32_t *local;  // (tasks × TABLES × LM_HIST_BINS), zero on entry and on return
    const float *x;
    int64_t n, per_task;
    int level;        // 0, 1, or 2 for level 0 with a window of level 1
    uint32_t hi_bin;  // level 1: the bin; level 2: the window's first bin
    uint64_t *hist;   // the caller's histogram (level 2: its count above the window)
    uint64_t *win;    // level 2: the caller's window histograms
    int n_win;
    pthread_mutex_t *mu;
} hist_job;

// Level 0 counts element i into way i % HIST_WAYS of the task's tables: runs of equal values
// (common in task vectors of 16-bit models) then increment different counters instead of
// waiting on one. 32-bit counts suffice: a task sees at most per_task elements, and
// cpu_hist_abs keeps that below 2^32.
#define HIST_WAYS 2
#define TABLES (HIST_WAYS > LM_HIST_WINDOW ? HIST_WAYS : LM_HIST_WINDOW)  // tables per task
#define LOW_GROUP 256  // level 1: elements whose bin is tested before the matches are counted

// Level 1: the low 16 bits of the magnitudes whose top 16 bits are hi_bin, a few percent of
// them where the threshold lies. A group's matches are first gathered without a branch, then
// counted, since a branch per element or per group mispredicts at that rate.
LM_VECTOR_CLONES static void hist_low(uint32_t *h, const float *x, int64_t n, uint32_t hi_bin)
{
    uint32_t found[LOW_GROUP];
    for (int64_t g = 0; g < n; g += LOW_GROUP) {
        int64_t cnt = n - g < LOW_GROUP ? n - g : LOW_GROUP, m = 0;
        for (int64_t e = 0; e < cnt; e++) {
            uint32_t bits = lm_abs_bits(x[g + e]);
            found[m] = bits;
            m += (bits >> 16) == hi_bin;
        }
        for (int64_t f = 0; f < m; f++)
            h[found[f] & 0xFFFFu]++;
    }
}

// The window's counts gather the window tables' indices of the values in the window in a list
// and make the increments a list at a time. The tables are megabytes (LM_HIST_BINS per bin of
// the window, per part): an increment is a cache miss, and made a few at a time between the
// comparisons each waited for its memory (a third of a fused LoRA pass went there); a long run
// of them overlaps.
#define WIN_LIST 16384

typedef struct win_list {
    uint32_t *tables;                // the task's tables, which the keys index; or, when NULL,
    const lm_dense_part *parts;       // the parts' window histograms: key (i << 20 | index) is
    pthread_mutex_t *mu;             // part i's, added to under mu
    int64_t m;                       // keys gathered
    uint32_t keys[WIN_LIST + 16];    // the slack takes a whole compressing store
} win_list;

#define WIN_PART_SHIFT 20  // a window's cells below it
#define WIN_MAX_PARTS 4096
_Static_assert((uint64_t)LM_HIST_WINDOW * LM_HIST_BINS <= 1u << WIN_PART_SHIFT,
               "a window's cells fit below the part's bits");

static void win_flush(win_list *l)
{
    if (l->tables) {
        for (int64_t f = 0; f < l->m; f++)
            l->tables[l->keys[f]]++;
    } else if (l->m) {
        pthread_mutex_lock(l->mu);
        for (int64_t f = 0; f < l->m; f++) {
            uint32_t key = l->keys[f];
            l->parts[key >> WIN_PART_SHIFT].win[key & ((1u << WIN_PART_SHIFT) - 1)]++;
        }
        pthread_mutex_unlock(l->mu);
    }
    l->m = 0;
}

#ifdef HAVE_AVX512_PATH
// hist_win with AVX-512: sixteen magnitudes at a time are compared with the window, those
// beyond it counted and those in it compressed into the list. The same integer counts as the
// plain loop's.
__attribute__((target("avx512f"))) static uint64_t hist_win_avx512(win_list *l, uint32_t off, const float *x,
                                                                  int64_t n, uint32_t lo_bin, uint32_t n_win)
{
    const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF), low_mask = _mm512_set1_epi32(0xFFFF);
    const __m512i lo = _mm512_set1_epi32((int)lo_bin), width = _mm512_set1_epi32((int)n_win);
    const __m512i limit = _mm512_set1_epi32((int)(lo_bin + n_win)), base = _mm512_set1_epi32((int)off);
    uint64_t above = 0;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512i bits = _mm512_and_si512(_mm512_loadu_si512((const void *)(x + i)), abs_mask);
        __m512i top = _mm512_srli_epi32(bits, 16), w = _mm512_sub_epi32(top, lo);
        __mmask16 in = _mm512_cmplt_epu32_mask(w, width), up = _mm512_cmpge_epu32_mask(top, limit);
        __m512i key = _mm512_add_epi32(base,
                                       _mm512_or_si512(_mm512_slli_epi32(w, 16), _mm512_and_si512(bits, low_mask)));
        // compressed in a register and stored whole (the slack after keys takes the rest): a
        // compressing store to memory is microcoded and slow on some processors
        _mm512_storeu_si512((void *)(l->keys + l->m), _mm512_maskz_compress_epi32(in, key));
        l->m += __builtin_popcount(in);
        above += (uint64_t)__builtin_popcount(up);
        if (l->m >= WIN_LIST)
            win_flush(l);
    }
    for (; i < n; i++) {
        uint32_t bits = lm_abs_bits(x[i]), top = bits >> 16, w = top - lo_bin;
        above += top >= lo_bin + n_win;
        if (w < n_win)
            l->keys[l->m++] = off + ((w << 16) | (bits & 0xFFFFu));
    }
    if (l->m >= WIN_LIST)
        win_flush(l);
    return above;
}
#endif

// The window's counts of n values into the tables from `off` (cells): values at or beyond the
// window are counted and returned, the indices of those in it, (w << 16 | low bits), gathered
// into l without a branch (as for hist_low). The caller flushes l when its run ends.
LM_VECTOR_CLONES static uint64_t hist_win(win_list *l, uint32_t off, const float *x, int64_t n, uint32_t lo_bin,
                                          uint32_t n_win)
{
#ifdef HAVE_AVX512_PATH
    if (__builtin_cpu_supports("avx512f"))
        return hist_win_avx512(l, off, x, n, lo_bin, n_win);
#endif
    uint64_t above = 0;
    uint32_t limit = lo_bin + n_win;
    for (int64_t g = 0; g < n; g += LOW_GROUP) {
        int64_t cnt = n - g < LOW_GROUP ? n - g : LOW_GROUP, m = l->m;
        uint32_t up = 0;
        for (int64_t e = 0; e < cnt; e++) {
            uint32_t bits = lm_abs_bits(x[g + e]), top = bits >> 16, w = top - lo_bin;
            up += top >= limit;
            l->keys[m] = off + ((w << 16) | (bits & 0xFFFFu));
            m += w < n_win;
        }
        above += up;
        l->m = m;
        if (l->m >= WIN_LIST - LOW_GROUP)
            win_flush(l);
    }
    return above;
}

static void hist_task(void *ctx, int64_t t)
{
    hist_job *j = ctx;
    uint32_t *h = j->local + t * TABLES * LM_HIST_BINS;
    int64_t lo = t * j->per_task, hi = lo + j->per_task < j->n ? lo + j->per_task : j->n, i = lo;
    const float *x = j->x;
    uint64_t above = 0;
    if (j->level == 0) {
        for (; i + HIST_WAYS <= hi; i += HIST_WAYS)
            for (int w = 0; w < HIST_WAYS; w++)
                h[w * LM_HIST_BINS + (lm_abs_bits(x[i + w]) >> 16)]++;
        for (; i < hi; i++)
            h[lm_abs_bits(x[i]) >> 16]++;
    } else if (j->level == 1) {
        hist_low(h, x + lo, hi - lo, j->hi_bin);
    } else {
        win_list l;
        l.tables = h;
        l.m = 0;
        above = hist_win(&l, 0, x + lo, hi - lo, j->hi_bin, (uint32_t)j->n_win);
        win_flush(&l);
    }
    // Add the task's counts to the caller's histograms (integer sums: the order does not
    // matter) and leave the tables zero for the next call.
    int used = j->level == 0 ? HIST_WAYS : j->level == 1 ? 1 : j->n_win;
    uint64_t *dst = j->level == 2 ? j->win : j->hist;
    pthread_mutex_lock(j->mu);
    if (j->level == 2)
        *j->hist += above;
    for (int w = 0; w < used; w++) {
        uint64_t *out = dst + (j->level == 2 ? (size_t)w * LM_HIST_BINS : 0);
        for (int64_t b = 0; b < LM_HIST_BINS; b++)
            out[b] += h[w * LM_HIST_BINS + b];
    }
    pthread_mutex_unlock(j->mu);
    memset(h, 0, (size_t)used * LM_HIST_BINS * sizeof *h);
}

// Makes c->hist_local at least `cells` counters. The tables stay allocated (and zero) between
// calls: a histogram of a small slab costs its elements, not a fresh megabyte.
static lm_status hist_tables(cpu_ctx *c, size_t cells, lm_err *err)
{
    if (cells <= c->hist_cells)
        return LM_OK;
    free(c->hist_local);
    c->hist_cells = 0;
    if (!(c->hist_local = calloc(cells, sizeof(uint32_t))))
        return lm_err_set(err, LM_ERR_NOMEM, "cpu: out of memory for a histogram");
    c->hist_cells = cells;
    return LM_OK;
}

static lm_status run_hist(lm_dev *d, hist_job *j, lm_err *err)
{
    cpu_ctx *c = d->ctx;
    int64_t tasks = lm_pool_threads(c->pool);
    if (tasks > n_blocks(j->n))
        tasks = n_blocks(j->n);
    if (tasks < 1)
        return LM_OK;
    while ((j->n + tasks - 1) / tasks > (int64_t)UINT32_MAX)
        tasks++;
    lm_status s = hist_tables(c, (size_t)tasks * TABLES * LM_HIST_BINS, err);
    if (s != LM_OK)
        return s;
    j->local = c->hist_local;
    j->per_task = (j->n + tasks - 1) / tasks;
    j->mu = &c->hist_mu;
    lm_pool_run(c->pool, tasks, hist_task, j);
    return LM_OK;
}

static lm_status cpu_hist_window(lm_dev *d, uint64_t *above, uint64_t *win, int n_win, uint32_t lo_bin,
                                 const float *x, int64_t n, lm_err *err)
{
    hist_job j = {.x = x, .n = n, .level = 2, .hi_bin = lo_bin, .hist = above, .win = win, .n_win = n_win};
    return run_hist(d, &j, err);
}

static lm_status cpu_hist_abs(lm_dev *d, uint64_t *hist, const float *x, int64_t n, int level,
                              uint32_t hi_bin, lm_err *err)
{
    hist_job j = {.x = x, .n = n, .level = level, .hi_bin = hi_bin, .hist = hist};
    return run_hist(d, &j, err);
}

typedef struct topk_job {
    float *x;
    const float *key;  // whose magnitudes decide (x itself for plain top-k)
    int64_t n;
    uint32_t thr;
    int64_t *ties;    // (2 nb) ties in each block, then the ties each block may keep
    int64_t nb;       // blocks
} topk_job;

LM_VECTOR_CLONES static int64_t count_ties(const float *x, int64_t lo, int64_t hi, uint32_t thr)
{
    int64_t c = 0;
    for (int64_t i = lo; i < hi; i++)
        c += lm_abs_bits(x[i]) == thr;
    return c;
}

static void topk_count_task(void *ctx, int64_t blk)
{
    topk_job *j = ctx;
    int64_t lo = blk * BLOCK, hi = lo + BLOCK < j->n ? lo + BLOCK : j->n;
    j->ties[blk] = count_ties(j->key, lo, hi, j->thr);
}

// Keeps x[i] for i in [lo, hi) when its magnitude bits exceed thr, or equal it and keep_ties.
LM_VECTOR_CLONES static void topk_keep(float *x, int64_t lo, int64_t hi, uint32_t thr, bool keep_ties)
{
    uint32_t floor = keep_ties ? thr : thr + 1;  // thr < 0x7FFFFFFF+1, so no overflow
    for (int64_t i = lo; i < hi; i++)
        x[i] = lm_abs_bits(x[i]) >= floor ? x[i] : 0.0f;
}

// The same decided by key[i] (a separate buffer: the two loops keep their pointers distinct).
LM_VECTOR_CLONES static void topk_keep_by(float *restrict x, const float *restrict key, int64_t lo, int64_t hi,
                                          uint32_t thr, bool keep_ties)
{
    uint32_t floor = keep_ties ? thr : thr + 1;
    for (int64_t i = lo; i < hi; i++)
        x[i] = lm_abs_bits(key[i]) >= floor ? x[i] : 0.0f;
}

static void keep_range(const topk_job *j, int64_t lo, int64_t hi, bool keep_ties)
{
    if (j->key == j->x)
        topk_keep(j->x, lo, hi, j->thr, keep_ties);
    else
        topk_keep_by(j->x, j->key, lo, hi, j->thr, keep_ties);
}

static void topk_all_task(void *ctx, int64_t blk)
{
    topk_job *j = ctx;
    int64_t lo = blk * BLOCK, hi = lo + BLOCK < j->n ? lo + BLOCK : j->n;
    keep_range(j, lo, hi, true);
}

// j->ties holds each block's count of ties, then (from nb on) its share of the ties budget:
// all of them, none, or (in one block at most) some, kept up to the tie where the share runs
// out.
static void topk_apply_task(void *ctx, int64_t blk)
{
    topk_job *j = ctx;
    int64_t lo = blk * BLOCK, hi = lo + BLOCK < j->n ? lo + BLOCK : j->n, cut = lo;
    int64_t count = j->ties[blk], allowed = j->ties[j->nb + blk];
    if (allowed == count) {
        cut = hi;
    } else {
        for (; allowed > 0; cut++)
            allowed -= lm_abs_bits(j->key[cut]) == j->thr;
    }
    keep_range(j, lo, cut, true);
    keep_range(j, cut, hi, false);
}

static lm_status topk_run(lm_dev *d, float *x, const float *key, int64_t n, uint32_t thr_bits, int64_t ties_allowed,
                          int64_t *ties_used, lm_err *err)
{
    int64_t nb = n_blocks(n);
    if (ties_allowed == LM_TIES_ALL) {
        // Every tie is kept: one pass, no counting.
        topk_job all = {x, key, n, thr_bits, NULL, nb};
        lm_pool_run(pool_of(d), nb, topk_all_task, &all);
        *ties_used = 0;
        return LM_OK;
    }
    topk_job j = {x, key, n, thr_bits, calloc((size_t)(nb ? 2 * nb : 1), sizeof(int64_t)), nb};
    if (!j.ties)
        return lm_err_set(err, LM_ERR_NOMEM, "cpu: out of memory");
    lm_pool_run(pool_of(d), nb, topk_count_task, &j);
    // The ties each block may keep: the budget goes to the lowest indices first.
    int64_t left = ties_allowed, used = 0;
    for (int64_t b = 0; b < nb; b++) {
        int64_t take = j.ties[b] < left ? j.ties[b] : left;
        j.ties[nb + b] = take;
        left -= take;
        used += take;
    }
    lm_pool_run(pool_of(d), nb, topk_apply_task, &j);
    free(j.ties);
    *ties_used = used;
    return LM_OK;
}

static lm_status cpu_topk_apply(lm_dev *d, float *x, int64_t n, uint32_t thr_bits, int64_t ties_allowed,
                                int64_t *ties_used, lm_err *err)
{
    return topk_run(d, x, x, n, thr_bits, ties_allowed, ties_used, err);
}

static lm_status cpu_topk_apply_by(lm_dev *d, float *x, const float *key, int64_t n, uint32_t thr_bits,
                                   int64_t ties_allowed, int64_t *ties_used, lm_err *err)
{
    return topk_run(d, x, key, n, thr_bits, ties_allowed, ties_used, err);
}

typedef struct imp_job {
    float *key;
    const float *tau;
    const double *ucc2;
    int64_t rows, cols;
} imp_job;

static void importance_task(void *ctx, int64_t r)
{
    imp_job *j = ctx;
    const float *t = j->tau + r * j->cols;
    float *k = j->key + r * j->cols;
    for (int64_t c = 0; c < j->cols; c++) {
        double v = t[c];
        k[c] = (float)(v * v / j->ucc2[c]);
    }
}

lm_status lm_cpu_potrf(double *a, int64_t n, double *diag, int *info)
{
    lapack_int N = (lapack_int)n;
    *info = (int)LAPACKE_dpotrf(LAPACK_COL_MAJOR, 'U', N, a, N);
    // a negative info is an argument LAPACK refused: n and the leading dimension are the only
    // ones that vary, and lm_dev_potrf has checked them
    if (*info != 0)
        return LM_ERR_FORMAT;
    for (int64_t c = 0; c < n; c++)
        diag[c] = a[c * n + c];
    return LM_OK;
}

static lm_status cpu_potrf(lm_dev *d, double *a, int64_t n, double *diag, lm_err *err)
{
    int info;
    if (lm_cpu_potrf(a, n, diag, &info) != LM_OK)
        return lm_err_set(err, LM_ERR_FORMAT, "%s: the %" PRId64 " x %" PRId64 " matrix is not positive definite "
                          "(LAPACK dpotrf info %d)", lm_dev_name(d), n, n, info);
    return LM_OK;
}

static lm_status cpu_importance(lm_dev *d, float *key, const float *tau, const double *ucc2, int64_t rows,
                                int64_t cols, lm_err *err)
{
    (void)err;
    imp_job j = {key, tau, ucc2, rows, cols};
    lm_pool_run(pool_of(d), rows, importance_task, &j);
    return LM_OK;
}

// ==== stored masks ============================================================================

typedef struct mask_job {
    float *x;         // mask_apply
    const float *cx;  // mask_get
    uint8_t *bits;
    const uint8_t *cbits;
    int64_t first, n;
    int64_t b0;  // mask_get: first rounded down to a byte, where block 0 starts
} mask_job;

// Bits [b0 + blk·BLOCK, b0 + (blk + 1)·BLOCK) ∩ [first, first + n): whole bytes per task (BLOCK
// is a multiple of 8), so no two tasks write one byte.
static void mask_get_task(void *ctx, int64_t blk)
{
    mask_job *j = ctx;
    int64_t end = j->first + j->n, lo = j->b0 + blk * BLOCK, hi = lo + BLOCK < end ? lo + BLOCK : end;
    lo = lo > j->first ? lo : j->first;
    int64_t b = lo;
    for (; b < hi && (b & 7); b++) {  // a partial first byte, bit by bit
        uint8_t m = (uint8_t)(1u << (b & 7));
        j->bits[b >> 3] = j->cx[b - j->first] != 0.0f ? (uint8_t)(j->bits[b >> 3] | m) : (uint8_t)(j->bits[b >> 3] & ~m);
    }
    for (; b + 8 <= hi; b += 8) {
        const float *x = j->cx + (b - j->first);
        unsigned v = 0;
        for (int k = 0; k < 8; k++)
            v |= (unsigned)(x[k] != 0.0f) << k;
        j->bits[b >> 3] = (uint8_t)v;
    }
    for (; b < hi; b++) {  // a partial last byte
        uint8_t m = (uint8_t)(1u << (b & 7));
        j->bits[b >> 3] = j->cx[b - j->first] != 0.0f ? (uint8_t)(j->bits[b >> 3] | m) : (uint8_t)(j->bits[b >> 3] & ~m);
    }
}

static lm_status cpu_mask_get(lm_dev *d, uint8_t *bits, int64_t first, const float *x, int64_t n, lm_err *err)
{
    if (n < 0 || first < 0)
        return lm_err_set(err, LM_ERR_USAGE, "mask_get of %lld elements from %lld", (long long)n, (long long)first);
    mask_job j = {.cx = x, .bits = bits, .first = first, .n = n, .b0 = first & ~(int64_t)7};
    int64_t span = first + n - j.b0;
    lm_pool_run(pool_of(d), n ? (span + BLOCK - 1) / BLOCK : 0, mask_get_task, &j);
    return LM_OK;
}

static void mask_apply_task(void *ctx, int64_t blk)
{
    mask_job *j = ctx;
    int64_t lo = blk * BLOCK, hi = lo + BLOCK < j->n ? lo + BLOCK : j->n;
    for (int64_t e = lo; e < hi; e++) {
        int64_t b = j->first + e;
        j->x[e] = j->cbits[b >> 3] >> (b & 7) & 1 ? j->x[e] : 0.0f;
    }
}

static lm_status cpu_mask_apply(lm_dev *d, float *x, const uint8_t *bits, int64_t first, int64_t n, lm_err *err)
{
    if (n < 0 || first < 0)
        return lm_err_set(err, LM_ERR_USAGE, "mask_apply of %lld elements from %lld", (long long)n,
                          (long long)first);
    mask_job j = {.x = x, .cbits = bits, .first = first, .n = n};
    lm_pool_run(pool_of(d), n_blocks(n), mask_apply_task, &j);
    return LM_OK;
}

typedef struct drop_job {
    float *x;
    int64_t n, first;
    uint64_t key, below;
} drop_job;

static void drop_task(void *ctx, int64_t blk)
{
    drop_job *j = ctx;
    int64_t lo = blk * BLOCK, hi = lo + BLOCK < j->n ? lo + BLOCK : j->n;
    for (int64_t i = lo; i < hi; i++)
        if (!lm_rng_keep(j->key, j->first + i, j->below))
            j->x[i] = 0.0f;
}

static lm_status cpu_random_drop(lm_dev *d, float *x, int64_t n, uint64_t key, int64_t first,
                                 uint64_t keep_below, lm_err *err)
{
    (void)err;
    drop_job j = {x, n, first, key, keep_below};
    lm_pool_run(pool_of(d), n_blocks(n), drop_task, &j);
    return LM_OK;
}

typedef struct l1_job {
    const float *x;
    int64_t n;
    double *partial;  // (blocks)
} l1_job;

static void l1_task(void *ctx, int64_t blk)
{
    l1_job *j = ctx;
    int64_t lo = blk * BLOCK, hi = lo + BLOCK < j->n ? lo + BLOCK : j->n;
    double s = 0;
    for (int64_t i = lo; i < hi; i++)
        s += fabs((double)j->x[i]);
    j->partial[blk] = s;
}

static lm_status cpu_l1(lm_dev *d, const float *x, int64_t n, double *out, lm_err *err)
{
    int64_t nb = n_blocks(n);
    l1_job j = {x, n, calloc((size_t)(nb ? nb : 1), sizeof(double))};
    if (!j.partial)
        return lm_err_set(err, LM_ERR_NOMEM, "cpu: out of memory");
    lm_pool_run(pool_of(d), nb, l1_task, &j);
    double s = 0;
    for (int64_t b = 0; b < nb; b++)
        s += j.partial[b];
    free(j.partial);
    *out = s;
    return LM_OK;
}

// ==== combination =============================================================================

typedef struct combine_job {
    float *out;
    const float *base;
    const float *const *tau;
    const float *w;
    int k;
    int64_t n;
    lm_combine_sign sign;
    bool normalize;
    float lambda;
} combine_job;

// Elements per inner chunk of the combination: the per-element sums live in small arrays, and
// each model's contribution is one loop over contiguous elements (restrict, branch-free) that
// the compiler vectorises. The loops are kept out of line: inlined into the loop over models,
// GCC's unroll-and-jam fuses two models into one scalar loop with branches, several times
// slower than the vector loop.
#define CHUNK 512
#define VECTOR_LOOP LM_VECTOR_CLONES __attribute__((noinline))

VECTOR_LOOP static void add_weighted(float *restrict delta, float *restrict div, const float *restrict t, float w,
                         int64_t cnt)
{
    for (int64_t e = 0; e < cnt; e++) {
        delta[e] += w * t[e];
        div[e] += w;
    }
}

VECTOR_LOOP static void add_vote_sum(float *restrict vote, const float *restrict t, float w, int64_t cnt)
{
    for (int64_t e = 0; e < cnt; e++)
        vote[e] += w * t[e];
}

VECTOR_LOOP static void add_vote_count(float *restrict vote, const float *restrict t, float w, int64_t cnt)
{
    for (int64_t e = 0; e < cnt; e++) {
        float wt = w * t[e];
        vote[e] += (wt > 0.0f ? 1.0f : 0.0f) - (wt < 0.0f ? 1.0f : 0.0f);
    }
}

// Entries agree with the elected sign when they have that sign; zeros never agree.
VECTOR_LOOP static void add_agreeing(float *restrict delta, float *restrict div, const float *restrict vote,
                         const float *restrict t, float w, int64_t cnt)
{
    for (int64_t e = 0; e < cnt; e++) {
        float wt = w * t[e], s = vote[e] >= 0.0f ? 1.0f : -1.0f;
        bool agree = wt * s > 0.0f;
        delta[e] += agree ? wt : 0.0f;
        div[e] += agree ? w : 0.0f;
    }
}

// o = b + lambda·Δ (Δ divided where asked); o may be b, so there are two loops, each with its
// pointers distinct.
VECTOR_LOOP static void finish_into(float *restrict o, const float *restrict b, const float *restrict delta,
                        const float *restrict div, bool normalize, float lambda, int64_t cnt)
{
    for (int64_t e = 0; e < cnt; e++) {
        float d = normalize && div[e] != 0.0f ? delta[e] / div[e] : delta[e];
        o[e] = b[e] + lambda * d;
    }
}

VECTOR_LOOP static void finish_in_place(float *restrict o, const float *restrict delta, const float *restrict div,
                            bool normalize, float lambda, int64_t cnt)
{
    for (int64_t e = 0; e < cnt; e++) {
        float d = normalize && div[e] != 0.0f ? delta[e] / div[e] : delta[e];
        o[e] = o[e] + lambda * d;
    }
}

// out[0..cnt) = base + lambda·Δ of the k values tau[i][0..cnt) (cnt <= CHUNK); out may be base.
static void combine_values(float *out, const float *base, const float *const *tau, const float *w, int k,
                           int64_t cnt, lm_combine_sign sign, bool normalize, float lambda)
{
    float vote[CHUNK], delta[CHUNK], div[CHUNK];
    for (int64_t e = 0; e < cnt; e++)
        vote[e] = delta[e] = div[e] = 0.0f;
    if (sign == LM_COMBINE_SIGN_NONE) {
        for (int i = 0; i < k; i++)
            add_weighted(delta, div, tau[i], w[i], cnt);
    } else {
        for (int i = 0; i < k; i++) {
            if (sign == LM_COMBINE_SIGN_SUM)
                add_vote_sum(vote, tau[i], w[i], cnt);
            else
                add_vote_count(vote, tau[i], w[i], cnt);
        }
        for (int i = 0; i < k; i++)
            add_agreeing(delta, div, vote, tau[i], w[i], cnt);
    }
    if (out == base)
        finish_in_place(out, delta, div, normalize, lambda, cnt);
    else
        finish_into(out, base, delta, div, normalize, lambda, cnt);
}

static void combine_task(void *ctx, int64_t blk)
{
    combine_job *j = ctx;
    int64_t lo = blk * BLOCK, hi = lo + BLOCK < j->n ? lo + BLOCK : j->n;
    const float *tau[j->k];
    for (int64_t c = lo; c < hi; c += CHUNK) {
        for (int i = 0; i < j->k; i++)
            tau[i] = j->tau[i] + c;
        combine_values(j->out + c, j->base + c, tau, j->w, j->k, hi - c < CHUNK ? hi - c : CHUNK, j->sign,
                       j->normalize, j->lambda);
    }
}

static lm_status cpu_combine(lm_dev *d, float *out, const float *base, const float *const *w_tau,
                             const float *weights, int k, int64_t n, lm_combine_sign sign, bool normalize,
                             float lambda, lm_err *err)
{
    (void)err;
    combine_job j = {out, base, w_tau, weights, k, n, sign, normalize, lambda};
    lm_pool_run(pool_of(d), n_blocks(n), combine_task, &j);
    return LM_OK;
}


// ==== fused dense operations ==================================================================
// A full model's τ is computed again from the mapped 16-bit inputs a CHUNK at a time and used
// at once (device.h). Each step is the separate operation's own code on the chunk (conversion,
// subtract, hist_win, the top-k rule, the random mask, combine_values, conversion back), so the
// results are theirs bit for bit.

typedef struct dense_job {
    const void *base;
    lm_dtype base_dt;
    lm_dense_part *parts;
    int k;
    int64_t n;
    // dense_hist: the elements per task, and the lock on the caller's histograms
    int64_t per_task;
    pthread_mutex_t *mu;
    // dense_merge
    void *out;
    lm_dtype out_dt;
    lm_combine_how how;
    int64_t nb;      // blocks
    int64_t *ties;   // (k × 2 nb) per part: each block's ties, then the ties it may keep
    bool *counted;   // (k) parts whose ties are counted per block
    bool first;      // the first run over every block (see cpu_dense_merge)
    bool *redo;      // (nb) blocks the first run left to the second
    int64_t *redo_list;  // the second run's blocks, by task
    float *scratch;  // (nb × k × CHUNK) each block's τ of its parts, a chunk at a time
    // LoRA parts: τ made a span of rows at a time (lora_span's tile keeps A's columns in cache
    // across the rows), each task's in its own k × span values of lora
    float *lora;
    int64_t span;
    bool read_kept;  // dense_merge: parts with keep_bits are read from there, not made
} dense_job;

// dst = float32 of elements [lo, lo + cnt) of src, their NaN and Inf added to *nf when it is
// not NULL.
static void dense_load(float *dst, const void *src, lm_dtype dt, int64_t lo, int64_t cnt, lm_nonfinite *nf)
{
    const char *at = (const char *)src + (size_t)lo * (lm_dtype_bits(dt) / 8);
    if (nf)
        lm_convert_to_f32_nf(dst, at, dt, cnt, nf, NULL);
    else
        lm_convert_to_f32(dst, at, dt, cnt, NULL);
}

// t = τ of LoRA part p at elements [lo, lo + cnt): the first row's stretch, the whole rows
// after it as one tile, the last row's stretch.
static void lora_span(float *t, const lm_dense_part *p, int64_t lo, int64_t cnt)
{
    int64_t at = p->col0 + lo, row = at / p->cols, col = at % p->cols, r = p->lora_r, cols = p->cols;
    while (cnt > 0) {
        int64_t rows = col == 0 ? cnt / cols : 0, len = rows ? rows * cols : cols - col < cnt ? cols - col : cnt;
        lowrank_tile(t, cols, p->lora_b + row * r, r, p->lora_a + col, cols, rows ? rows : 1, r, rows ? cols : len,
                     p->scale, 0.0f);
        t += len;
        cnt -= len;
        row += rows ? rows : 1;
        col = 0;
    }
}

// t = τ of part p at elements [lo, lo + cnt), b holding the base's values there; the NaN and Inf
// among the src values read go to *nf (when not NULL).
static void dense_tau(float *t, const lm_dense_part *p, const float *b, int64_t lo, int64_t cnt, lm_nonfinite *nf)
{
    if (p->tau) {
        memcpy(t, p->tau + lo, (size_t)cnt * sizeof *t);
        return;
    }
    dense_load(t, p->src, p->dt, lo, cnt, nf);
    subtract(t, b, cnt);
}

// The values of a LoRA span: whole rows where the rows are short, so that A's columns are
// loaded once for several rows, and a bound on the scratch per part and task.
#define LORA_SPAN_ROWS 8
#define LORA_SPAN_MIN 8192
#define LORA_SPAN_MAX 65536

static int64_t lora_span_elems(const lm_dense_part *parts, int k)
{
    int64_t span = 0;
    for (int i = 0; i < k; i++) {
        if (!parts[i].lora_a)
            continue;
        int64_t want = LORA_SPAN_ROWS * parts[i].cols;
        want = want < LORA_SPAN_MIN ? LORA_SPAN_MIN : want > LORA_SPAN_MAX ? LORA_SPAN_MAX : want;
        want = (want + CHUNK - 1) / CHUNK * CHUNK;  // chunks then never cross a kept-value segment
        span = want > span ? want : span;
    }
    return span;
}

// Sets up j->lora for `tasks` tasks when some part is a LoRA pair (j->span 0 when none is).
static lm_status lora_scratch(lm_dev *d, dense_job *j, int64_t tasks, lm_err *err)
{
    cpu_ctx *c = d->ctx;
    j->span = lora_span_elems(j->parts, j->k);
    if (!j->span)
        return LM_OK;
    size_t cells = (size_t)tasks * (size_t)j->k * (size_t)j->span;
    if (cells > c->lora_cells) {
        free(c->lora_tau);
        c->lora_cells = 0;
        if (!(c->lora_tau = malloc(cells * sizeof(float))))
            return lm_err_set(err, LM_ERR_NOMEM, "cpu: out of memory for %zu LoRA products", cells);
        c->lora_cells = cells;
    }
    j->lora = c->lora_tau;
    return LM_OK;
}

// Task t's span of part i in j->lora.
static float *span_of(const dense_job *j, int64_t t, int i)
{
    return j->lora + ((size_t)t * (size_t)j->k + (size_t)i) * (size_t)j->span;
}

// Makes the LoRA parts' τ of elements [s0, s0 + len) in task t's spans (for the parts `use`
// selects, all when NULL).
static void lora_fill(const dense_job *j, int64_t t, int64_t s0, int64_t len, const bool *use)
{
    for (int i = 0; j->span && i < j->k; i++)
        if (j->parts[i].lora_a && (!use || use[i]) && !(j->read_kept && j->parts[i].keep_bits))
            lora_span(span_of(j, t, i), &j->parts[i], s0, len);
}

// ---- kept LoRA candidates (lm_dense_part's keep_bits, keep_off and keep_vals) ---------------
// Chunks never cross a segment (they start on multiples of CHUNK from a segment's start). *pos
// is the index in keep_vals of the next value; the element indices here are the tensor's.

// Keeps chunk x's values (elements [e0, e0 + cnt) of the tensor) whose magnitude bits are at
// least lo; end bounds what the task may write (its own elements' room).
#ifdef HAVE_AVX512_PATH
__attribute__((target("avx512f"))) static void keep_chunk_avx512(const lm_dense_part *p, const float *x, int64_t e0,
                                                                int64_t cnt, uint32_t lo, int64_t *pos, int64_t end)
{
    const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF), low = _mm512_set1_epi32((int)lo);
    for (int64_t e = 0; e < cnt; e += 16) {
        __mmask16 valid = cnt - e >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (cnt - e)) - 1);
        __m512 v = _mm512_maskz_loadu_ps(valid, x + e);
        __mmask16 m = _mm512_mask_cmpge_epu32_mask(valid, _mm512_and_si512(_mm512_castps_si512(v), abs_mask), low);
        if (*pos + 16 <= end) {  // stored whole (a compressing store to memory is slow)
            _mm512_storeu_ps(p->keep_vals + *pos, _mm512_maskz_compress_ps(m, v));
        } else {
            float tmp[16];
            _mm512_storeu_ps(tmp, _mm512_maskz_compress_ps(m, v));
            memcpy(p->keep_vals + *pos, tmp, (size_t)__builtin_popcount(m) * sizeof *tmp);
        }
        p->keep_bits[(e0 + e) / 16] = (uint16_t)m;
        *pos += __builtin_popcount(m);
    }
}

// The kept values back in place: τ at elements [e0, e0 + cnt), zero where none was kept.
__attribute__((target("avx512f"))) static void kept_chunk_avx512(float *t, const lm_dense_part *p, int64_t e0,
                                                                int64_t cnt, int64_t *pos)
{
    for (int64_t e = 0; e < cnt; e += 16) {
        __mmask16 valid = cnt - e >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (cnt - e)) - 1);
        __mmask16 m = p->keep_bits[(e0 + e) / 16];
        // (keep_vals has 16 values of room past its end for this load)
        _mm512_mask_storeu_ps(t + e, valid, _mm512_maskz_expand_ps(m, _mm512_loadu_ps(p->keep_vals + *pos)));
        *pos += __builtin_popcount(m);
    }
}
#endif

static void keep_chunk(const lm_dense_part *p, const float *x, int64_t e0, int64_t cnt, uint32_t lo, int64_t *pos,
                       int64_t end)
{
    if (e0 % LM_DENSE_KEEP_SEGMENT == 0)
        p->keep_off[e0 / LM_DENSE_KEEP_SEGMENT] = *pos;
#ifdef HAVE_AVX512_PATH
    if (__builtin_cpu_supports("avx512f")) {
        keep_chunk_avx512(p, x, e0, cnt, lo, pos, end);
        return;
    }
#endif
    for (int64_t e = 0; e < cnt; e += 16) {
        unsigned m = 0;
        for (int64_t u = 0; u < 16 && e + u < cnt; u++)
            if (lm_abs_bits(x[e + u]) >= lo) {
                m |= 1u << u;
                p->keep_vals[(*pos)++] = x[e + u];
            }
        p->keep_bits[(e0 + e) / 16] = (uint16_t)m;
    }
}

static void kept_chunk(float *t, const lm_dense_part *p, int64_t e0, int64_t cnt, int64_t *pos)
{
    if (e0 % LM_DENSE_KEEP_SEGMENT == 0)
        *pos = p->keep_off[e0 / LM_DENSE_KEEP_SEGMENT];
#ifdef HAVE_AVX512_PATH
    if (__builtin_cpu_supports("avx512f")) {
        kept_chunk_avx512(t, p, e0, cnt, pos);
        return;
    }
#endif
    for (int64_t e = 0; e < cnt; e += 16) {
        unsigned m = p->keep_bits[(e0 + e) / 16];
        for (int64_t u = 0; u < 16 && e + u < cnt; u++)
            t[e + u] = m >> u & 1 ? p->keep_vals[(*pos)++] : 0.0f;
    }
}

// Part i's τ at chunk [c, c + cnt) of the span from s0 that task t is in: a LoRA part's where
// lora_fill made it (changed in place by whoever trims it), any other's made into buf.
static float *chunk_tau(const dense_job *j, int64_t t, int i, float *buf, const float *b, int64_t s0, int64_t c,
                        int64_t cnt, int64_t *kpos, lm_nonfinite *nf)
{
    const lm_dense_part *p = &j->parts[i];
    if (j->read_kept && p->keep_bits) {
        kept_chunk(buf, p, p->first + c, cnt, &kpos[i]);
        return buf;
    }
    if (p->lora_a)
        return span_of(j, t, i) + (c - s0);
    dense_tau(buf, p, b, c, cnt, nf);
    return buf;
}

static void dense_hist_task(void *ctx, int64_t t)
{
    dense_job *j = ctx;
    int64_t lo = t * j->per_task, hi = lo + j->per_task < j->n ? lo + j->per_task : j->n;
    // the keys go to the caller's histograms a list at a time: no tables of the task's own to
    // add up and clear at the end of every call (megabytes per part)
    win_list l;
    l.tables = NULL;
    l.parts = j->parts;
    l.mu = j->mu;
    l.m = 0;
    uint64_t above[j->k];
    int64_t kpos[j->k];  // each part's kept values go from the index of the task's first element
    float b[CHUNK], tau[CHUNK];
    bool use[j->k], base = false;
    memset(above, 0, sizeof above);
    for (int i = 0; i < j->k; i++) {
        use[i] = j->parts[i].win != NULL;
        base = base || (use[i] && !j->parts[i].lora_a);
        kpos[i] = j->parts[i].first + lo;
    }
    int64_t span = j->span ? j->span : hi - lo;
    for (int64_t s0 = lo; s0 < hi; s0 += span) {
        int64_t s1 = hi - s0 < span ? hi : s0 + span;
        lora_fill(j, t, s0, s1 - s0, use);
        for (int64_t c = s0; c < s1; c += CHUNK) {
            int64_t cnt = s1 - c < CHUNK ? s1 - c : CHUNK;
            if (base)
                dense_load(b, j->base, j->base_dt, c, cnt, NULL);
            for (int i = 0; i < j->k; i++) {
                const lm_dense_part *p = &j->parts[i];
                if (!use[i])
                    continue;
                const float *x = chunk_tau(j, t, i, tau, b, s0, c, cnt, kpos, NULL);
                above[i] += hist_win(&l, (uint32_t)i << WIN_PART_SHIFT, x, cnt, p->lo_bin, (uint32_t)p->n_win);
                if (p->keep_bits)
                    keep_chunk(p, x, p->first + c, cnt, p->lo_bin << 16, &kpos[i], p->first + hi);
            }
        }
    }
    win_flush(&l);
    pthread_mutex_lock(j->mu);  // integer sums: the order does not matter
    for (int i = 0; i < j->k; i++)
        if (use[i])
            *j->parts[i].above += above[i];
    pthread_mutex_unlock(j->mu);
}

#define HIST_TASKS_PER_THREAD 4

static lm_status cpu_dense_hist(lm_dev *d, const void *base, lm_dtype base_dt, lm_dense_part *parts, int k, int64_t n,
                                lm_err *err)
{
    cpu_ctx *c = d->ctx;
    if (k > WIN_MAX_PARTS)
        return lm_err_set(err, LM_ERR_UNSUPPORTED, "dense_hist: %d parts, at most %d at once", k, WIN_MAX_PARTS);
    bool any = false;
    for (int i = 0; i < k; i++)
        any = any || parts[i].win;
    // A few tasks per thread: a thread slowed by other work (the input hasher shares the
    // cores) leaves the others something to take instead of waiting for it at the end.
    int64_t tasks = (int64_t)lm_pool_threads(c->pool) * HIST_TASKS_PER_THREAD;
    if (tasks > n_blocks(n))
        tasks = n_blocks(n);
    if (tasks < 1 || !any)
        return LM_OK;
    // tasks start on a segment of the kept values
    int64_t per_task = ((n + tasks - 1) / tasks + LM_DENSE_KEEP_SEGMENT - 1) / LM_DENSE_KEEP_SEGMENT * LM_DENSE_KEEP_SEGMENT;
    tasks = (n + per_task - 1) / per_task;
    dense_job j = {.base = base, .base_dt = base_dt, .parts = parts, .k = k, .n = n, .per_task = per_task,
                   .mu = &c->hist_mu};
    lm_status s = lora_scratch(d, &j, tasks, err);
    if (s != LM_OK)
        return s;
    lm_pool_run(c->pool, tasks, dense_hist_task, &j);
    return LM_OK;
}

// The top-k rule on a chunk whose ties are kept one by one while *left lasts (the block where
// a part's budget runs out).
static void keep_counted(float *t, int64_t cnt, uint32_t thr, int64_t *left)
{
    for (int64_t e = 0; e < cnt; e++) {
        uint32_t bits = lm_abs_bits(t[e]);
        bool keep = bits > thr;
        if (bits == thr && *left > 0) {
            keep = true;
            --*left;
        }
        t[e] = keep ? t[e] : 0.0f;
    }
}

// keep: 1 every tie kept, 0 none, -1 counted (left says how many).
static void dense_sparsify(float *t, const lm_dense_part *p, int keep, int64_t *left, int64_t first, int64_t cnt)
{
    if (p->trim) {
        if (keep < 0)
            keep_counted(t, cnt, p->thr_bits, left);
        else if (keep == 0 && p->thr_bits == 0xFFFFFFFFu)  // no magnitude exceeds it
            memset(t, 0, (size_t)cnt * sizeof *t);
        else
            topk_keep(t, 0, cnt, keep ? p->thr_bits : p->thr_bits + 1, true);
    } else if (p->drop) {
        for (int64_t e = 0; e < cnt; e++)
            if (!lm_rng_keep(p->key, first + e, p->keep_below))
                t[e] = 0.0f;
    }
    if (p->rescale != 1.0f)
        for (int64_t e = 0; e < cnt; e++)
            t[e] = p->rescale * t[e] + 0.0f * t[e];
}

static void dense_merge_task(void *ctx, int64_t task)
{
    dense_job *j = ctx;
    int k = j->k;
    int64_t blk = j->first ? task : j->redo_list[task];
    bool deferred = false;  // the first run found a tie of a counted part here
    int64_t lo = blk * BLOCK, hi = lo + BLOCK < j->n ? lo + BLOCK : j->n;
    size_t es = lm_dtype_bits(j->out_dt) / 8;
    float b[CHUNK], o[CHUNK], w[k];
    float (*t)[CHUNK] = (float (*)[CHUNK])(j->scratch + (size_t)blk * (size_t)k * CHUNK);
    float *tp[k];
    int keep[k];
    int64_t left[k], kpos[k];
    // The block's NaN and Inf: added to the operation's sums by the run that merges the whole
    // block (a block the first run defers is counted again from the start in the second).
    lm_nonfinite nb_base = {0, 0}, nb_out = {0, 0}, nb_src[k];
    lm_nonfinite *c_base = j->how.base_nf ? &nb_base : NULL, *c_out = j->how.out_nf ? &nb_out : NULL, *c_src[k];
    for (int i = 0; i < k; i++) {
        nb_src[i] = (lm_nonfinite){0, 0};
        c_src[i] = j->parts[i].nf ? &nb_src[i] : NULL;
    }
    for (int i = 0; i < k; i++) {
        const lm_dense_part *p = &j->parts[i];
        const int64_t *ties = j->counted[i] ? j->ties + (size_t)i * 2 * j->nb : NULL;  // NULL: none counted
        w[i] = p->weight;
        left[i] = 0;
        if (!p->trim || p->ties_allowed == LM_TIES_ALL || (j->first && j->counted[i]))
            keep[i] = 1;  // (in the first run, blocks where a counted part has a tie are redone)
        else if (!j->counted[i])
            keep[i] = 0;
        else if (ties[j->nb + blk] == ties[blk])
            keep[i] = 1;
        else if (ties[j->nb + blk] == 0)
            keep[i] = 0;
        else
            keep[i] = -1, left[i] = ties[j->nb + blk];
    }
    int64_t span = j->span ? j->span : hi - lo;
    for (int64_t s0 = lo; s0 < hi; s0 += span) {
        int64_t s1 = hi - s0 < span ? hi : s0 + span;
        lora_fill(j, blk, s0, s1 - s0, deferred ? j->counted : NULL);
        for (int64_t c = s0; c < s1; c += CHUNK) {
            int64_t cnt = s1 - c < CHUNK ? s1 - c : CHUNK;
            dense_load(b, j->base, j->base_dt, c, cnt, c_base);
            for (int i = 0; j->first && j->ties && i < k; i++) {
                if (!j->counted[i])
                    continue;
                tp[i] = chunk_tau(j, blk, i, t[i], b, s0, c, cnt, kpos, c_src[i]);
                int64_t n = count_ties(tp[i], 0, cnt, j->parts[i].thr_bits);
                j->ties[(size_t)i * 2 * j->nb + blk] += n;
                deferred = deferred || n > 0;
            }
            if (deferred)  // only the counts matter in this run now
                continue;
            for (int i = 0; i < k; i++) {
                const lm_dense_part *p = &j->parts[i];
                if (!(j->first && j->ties && j->counted[i]))
                    tp[i] = chunk_tau(j, blk, i, t[i], b, s0, c, cnt, kpos, c_src[i]);
                dense_sparsify(tp[i], p, keep[i], &left[i], p->first + c, cnt);
            }
            if (j->how.linear) {
                memcpy(o, b, (size_t)cnt * sizeof *o);
                for (int i = 0; i < k; i++)
                    for (int64_t e = 0; e < cnt; e++)
                        o[e] = 1.0f * o[e] + w[i] * tp[i][e];
            } else {
                combine_values(o, b, (const float *const *)tp, w, k, cnt, j->how.sign, j->how.normalize,
                               j->how.lambda);
            }
            if (c_out)
                lm_convert_from_f32_nf((char *)j->out + (size_t)c * es, j->out_dt, o, cnt, c_out, NULL);
            else
                lm_convert_from_f32((char *)j->out + (size_t)c * es, j->out_dt, o, cnt, NULL);
        }
    }
    if (deferred) {
        j->redo[blk] = true;
        return;
    }
    if (c_base)
        nf_add(j->how.base_nf, c_base);
    if (c_out)
        nf_add(j->how.out_nf, c_out);
    for (int i = 0; i < k; i++)
        if (c_src[i])
            nf_add(j->parts[i].nf, c_src[i]);
}

// Parts whose ties are counted keep the first ties_allowed of them in index order, so a block's
// share depends on the ties in the blocks before it. Ties are rare (they are values equal to
// the threshold), so every block runs first as if it kept all of its ties, counting them; a
// block that finds one stops merging and only counts. The budgets are then shared out in block
// order, and those few blocks run again.
static lm_status cpu_dense_merge(lm_dev *d, void *out, lm_dtype out_dt, const void *base, lm_dtype base_dt,
                                 lm_dense_part *parts, int k, int64_t n, lm_combine_how how,
                                 const lm_dev_side *side, lm_err *err)
{
    int64_t nb = n_blocks(n);
    dense_job j = {.base = base, .base_dt = base_dt, .parts = parts, .k = k, .n = n, .out = out, .out_dt = out_dt,
                   .how = how, .nb = nb, .first = true, .read_kept = true};
    bool counted[k > 0 ? k : 1], any = false;
    for (int i = 0; i < k; i++) {
        // Counting is needed only where some ties are kept and some not; a budget of 0 keeps
        // none of them, LM_TIES_ALL all.
        counted[i] = parts[i].trim && parts[i].ties_allowed != LM_TIES_ALL && parts[i].ties_allowed > 0;
        any = any || counted[i];
        parts[i].ties_used = 0;
    }
    j.counted = counted;
    lm_err own = {0};
    lm_status s = lora_scratch(d, &j, nb, &own);
    size_t nb1 = (size_t)(nb ? nb : 1);
    j.scratch = malloc(nb1 * (size_t)(k > 0 ? k : 1) * CHUNK * sizeof(float));
    if (any) {
        j.ties = calloc((size_t)k * 2 * nb1, sizeof(int64_t));
        j.redo = calloc(nb1, sizeof(bool));
        j.redo_list = malloc(nb1 * sizeof(int64_t));
    }
    if (s != LM_OK || !j.scratch || (any && (!j.ties || !j.redo || !j.redo_list))) {
        if (side)  // (its errors are the caller's; this one is set after it, and wins)
            side->fn(side->ctx);
        s = s != LM_OK ? lm_err_set(err, s, "%s", own.msg) : lm_err_set(err, LM_ERR_NOMEM, "cpu: out of memory");
        goto done;
    }
    lm_pool_run_side(pool_of(d), nb, dense_merge_task, &j, side ? side->fn : NULL, side ? side->ctx : NULL);
    if (any) {
        // The ties each block may keep: the budget goes to the lowest indices first.
        for (int i = 0; i < k; i++) {
            int64_t *ties = j.ties + (size_t)i * 2 * nb, left = parts[i].ties_allowed;
            for (int64_t b = 0; counted[i] && b < nb; b++) {
                int64_t take = ties[b] < left ? ties[b] : left;
                ties[nb + b] = take;
                left -= take;
                parts[i].ties_used += take;
            }
        }
        int64_t n_redo = 0;
        for (int64_t b = 0; b < nb; b++)
            if (j.redo[b])
                j.redo_list[n_redo++] = b;
        j.first = false;
        lm_pool_run(pool_of(d), n_redo, dense_merge_task, &j);
    }
done:
    free(j.redo_list);
    free(j.redo);
    free(j.ties);
    free(j.scratch);
    return s;
}

// ==== the backend =============================================================================

// The forward-pass operations, defined at the end of the file.
static lm_status cpu_gather_rows(lm_dev *d, float *out, const float *table, int64_t table_rows, int64_t cols,
                                 const int32_t *ids, int64_t n, lm_err *err);
static lm_status cpu_add_rows(lm_dev *d, float *y, const float *b, int64_t rows, int64_t cols, lm_err *err);
static lm_status cpu_rmsnorm(lm_dev *d, float *out, const float *x, const float *w, int64_t rows, int64_t cols,
                             float eps, lm_err *err);
static lm_status cpu_rope(lm_dev *d, float *x, int64_t rows, int64_t heads, int64_t head_dim, const int32_t *pos,
                          const float *inv_freq, lm_err *err);
static lm_status cpu_attention(lm_dev *d, float *out, const float *q, const float *k, const float *v,
                               const int32_t *start, int64_t rows, int64_t heads, int64_t kv_heads,
                               int64_t head_dim, float scale, lm_err *err);
static lm_status cpu_silu_mul(lm_dev *d, float *gate, const float *up, int64_t n, lm_err *err);
static lm_status cpu_nll_rows(lm_dev *d, float *nll, const float *logits, const int32_t *targets, int64_t rows,
                              int64_t cols, lm_err *err);

static const lm_dev_i cpu_iface = {
    .name = cpu_name,
    .mem_info = cpu_mem_info,
    .alloc = cpu_alloc,
    .buf_free = cpu_free,
    .upload = cpu_copy,
    .download = cpu_copy,
    .destroy = cpu_destroy,
    .to_f32 = cpu_to_f32,
    .from_f32 = cpu_from_f32,
    .gemm = cpu_gemm,
    .syrk = cpu_syrk,
    .axpby = cpu_axpby,
    .delta = cpu_delta,
    .dora_rows = cpu_dora_rows,
    .hist_abs = cpu_hist_abs,
    .hist_window = cpu_hist_window,
    .topk_apply = cpu_topk_apply,
    .topk_apply_by = cpu_topk_apply_by,
    .importance = cpu_importance,
    .potrf = cpu_potrf,
    .mask_get = cpu_mask_get,
    .mask_apply = cpu_mask_apply,
    .random_drop = cpu_random_drop,
    .l1 = cpu_l1,
    .combine = cpu_combine,
    .dense_hist = cpu_dense_hist,
    .dense_merge = cpu_dense_merge,
    .to_f32_count = cpu_to_f32_count,
    .delta_count = cpu_delta_count,
    .from_f32_count = cpu_from_f32_count,
    .gather_rows = cpu_gather_rows,
    .add_rows = cpu_add_rows,
    .rmsnorm = cpu_rmsnorm,
    .rope = cpu_rope,
    .attention = cpu_attention,
    .silu_mul = cpu_silu_mul,
    .nll_rows = cpu_nll_rows,
};

extern void openblas_set_num_threads(int num_threads);

lm_status lm_dev_cpu_create(lm_dev **out, int threads, lm_err *err)
{
    *out = NULL;
    lm_dev *d = calloc(1, sizeof *d);
    cpu_ctx *c = calloc(1, sizeof *c);
    if (!d || !c) {
        free(d);
        free(c);
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    }
    pthread_mutex_init(&c->hist_mu, NULL);
    d->iface = &cpu_iface;
    d->ctx = c;
    d->host_memory = true;
    lm_status s = lm_pool_create(&c->pool, threads, err);
    if (s != LM_OK) {
        cpu_destroy(d);
        return s;
    }
    d->threads = lm_pool_threads(c->pool);
    openblas_set_num_threads(1);
    *out = d;
    return LM_OK;
}

lm_status lm_dev_cpu_companion(lm_dev *d, lm_dev **cpu, lm_err *err)
{
    if (d->iface == &cpu_iface) {
        *cpu = d;
        return LM_OK;
    }
    if (!d->companion) {
        lm_status s = lm_dev_cpu_create(&d->companion, d->threads, err);
        if (s != LM_OK)
            return s;
    }
    *cpu = d->companion;
    return LM_OK;
}

// ==== the forward pass ========================================================================
// Row-wise operations: each row (or (row, head) pair for attention) is one task's, computed
// by the same fixed sequence of float operations wherever it lies in a batch, so a packed
// batch gives every sequence the values it gets alone, on any thread count.

// Rows per task for row-wise work on rows of `cols` elements: about BLOCK elements a task.
static int64_t rows_per_task(int64_t cols)
{
    return cols >= BLOCK ? 1 : BLOCK / (cols > 0 ? cols : 1);
}

typedef struct rows_job {
    float *out;
    const float *x, *w;
    const int32_t *ids;
    int64_t rows, cols, table_rows, per;
    float eps;
} rows_job;

static void gather_task(void *ctx, int64_t t)
{
    rows_job *j = ctx;
    int64_t r0 = t * j->per, r1 = r0 + j->per < j->rows ? r0 + j->per : j->rows;
    for (int64_t r = r0; r < r1; r++) {
        float *o = j->out + r * j->cols;
        int64_t id = j->ids[r];
        if (id >= 0 && id < j->table_rows)
            memcpy(o, j->x + id * j->cols, (size_t)j->cols * sizeof *o);
        else
            memset(o, 0, (size_t)j->cols * sizeof *o);
    }
}

static lm_status cpu_gather_rows(lm_dev *d, float *out, const float *table, int64_t table_rows, int64_t cols,
                                 const int32_t *ids, int64_t n, lm_err *err)
{
    (void)err;
    rows_job j = {.out = out, .x = table, .ids = ids, .rows = n, .cols = cols, .table_rows = table_rows,
                  .per = rows_per_task(cols)};
    lm_pool_run(pool_of(d), (n + j.per - 1) / j.per, gather_task, &j);
    return LM_OK;
}

static void add_rows_task(void *ctx, int64_t t)
{
    rows_job *j = ctx;
    int64_t r0 = t * j->per, r1 = r0 + j->per < j->rows ? r0 + j->per : j->rows;
    for (int64_t r = r0; r < r1; r++) {
        float *restrict y = j->out + r * j->cols;
        const float *restrict b = j->w;
        for (int64_t c = 0; c < j->cols; c++)
            y[c] += b[c];
    }
}

static lm_status cpu_add_rows(lm_dev *d, float *y, const float *b, int64_t rows, int64_t cols, lm_err *err)
{
    (void)err;
    rows_job j = {.out = y, .w = b, .rows = rows, .cols = cols, .per = rows_per_task(cols)};
    lm_pool_run(pool_of(d), (rows + j.per - 1) / j.per, add_rows_task, &j);
    return LM_OK;
}

static void rmsnorm_task(void *ctx, int64_t t)
{
    rows_job *j = ctx;
    int64_t r0 = t * j->per, r1 = r0 + j->per < j->rows ? r0 + j->per : j->rows;
    for (int64_t r = r0; r < r1; r++) {
        const float *x = j->x + r * j->cols;
        float *o = j->out + r * j->cols;
        double ss = 0;
        for (int64_t c = 0; c < j->cols; c++)
            ss += (double)x[c] * x[c];
        float g = (float)(1.0 / sqrt(ss / (double)j->cols + (double)j->eps));
        for (int64_t c = 0; c < j->cols; c++)
            o[c] = j->w[c] * (x[c] * g);
    }
}

static lm_status cpu_rmsnorm(lm_dev *d, float *out, const float *x, const float *w, int64_t rows, int64_t cols,
                             float eps, lm_err *err)
{
    (void)err;
    if (cols <= 0)
        return LM_OK;
    rows_job j = {.out = out, .x = x, .w = w, .rows = rows, .cols = cols, .per = rows_per_task(cols), .eps = eps};
    lm_pool_run(pool_of(d), (rows + j.per - 1) / j.per, rmsnorm_task, &j);
    return LM_OK;
}

typedef struct rope_job {
    float *x;
    const int32_t *pos;
    const float *inv_freq;
    int64_t heads, head_dim;
} rope_job;

#define ROPE_CHUNK 256  // cos and sin of this many frequencies are computed once per row

static void rope_task(void *ctx, int64_t r)
{
    rope_job *j = ctx;
    int64_t half = j->head_dim / 2, width = j->heads * j->head_dim;
    float *row = j->x + r * width, fpos = (float)j->pos[r];
    float cs[ROPE_CHUNK], sn[ROPE_CHUNK];
    for (int64_t i0 = 0; i0 < half; i0 += ROPE_CHUNK) {
        int64_t cnt = half - i0 < ROPE_CHUNK ? half - i0 : ROPE_CHUNK;
        for (int64_t i = 0; i < cnt; i++) {
            float a = fpos * j->inv_freq[i0 + i];  // rounded to float32, as Hugging Face's
            cs[i] = (float)cos((double)a);
            sn[i] = (float)sin((double)a);
        }
        for (int64_t h = 0; h < j->heads; h++) {
            float *lo = row + h * j->head_dim + i0, *hi = lo + half;
            for (int64_t i = 0; i < cnt; i++) {
                float a = lo[i], b = hi[i];
                lo[i] = a * cs[i] - b * sn[i];
                hi[i] = b * cs[i] + a * sn[i];
            }
        }
    }
}

static lm_status cpu_rope(lm_dev *d, float *x, int64_t rows, int64_t heads, int64_t head_dim, const int32_t *pos,
                          const float *inv_freq, lm_err *err)
{
    (void)err;
    rope_job j = {x, pos, inv_freq, heads, head_dim};
    lm_pool_run(pool_of(d), rows, rope_task, &j);
    return LM_OK;
}

typedef struct attn_job {
    float *out;
    const float *q, *k, *v;
    const int32_t *start;
    int64_t heads, group, head_dim;  // group: query heads per kv head
    float scale;
    int failed;                      // a task could not get its scratch memory
} attn_job;

// The dot product in eight interleaved partial sums, added in a fixed order: the compiler
// can vectorise it, and the result is the same wherever it runs.
static float dot8(const float *restrict a, const float *restrict b, int64_t n)
{
    float s[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int l = 0; l < 8; l++)
            s[l] += a[i + l] * b[i + l];
    float tail = 0;
    for (; i < n; i++)
        tail += a[i] * b[i];
    return (((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]))) + tail;
}

#define ATTN_STACK 512  // head_dim up to this keeps its accumulator on the stack

// One query row and head: an online softmax over the keys of its sequence up to itself (the
// running maximum m and sum l rescale the accumulator whenever m grows).
static void attn_task(void *ctx, int64_t t)
{
    attn_job *j = ctx;
    int64_t r = t / j->heads, h = t % j->heads, g = h / j->group, hd = j->head_dim;
    int64_t qw = j->heads * hd, kw = (j->heads / j->group) * hd;
    const float *q = j->q + r * qw + h * hd;
    float stack[ATTN_STACK], *acc = hd <= ATTN_STACK ? stack : malloc((size_t)hd * sizeof *acc);
    if (!acc) {
        __atomic_store_n(&j->failed, 1, __ATOMIC_RELAXED);
        return;
    }
    int64_t s0 = j->start[r];
    if (s0 < 0 || s0 > r)
        s0 = s0 < 0 ? 0 : r;
    float m = -INFINITY, l = 0.0f;
    for (int64_t i = 0; i < hd; i++)
        acc[i] = 0.0f;
    for (int64_t c = s0; c <= r; c++) {
        const float *kc = j->k + c * kw + g * hd, *vc = j->v + c * kw + g * hd;
        float s = dot8(q, kc, hd) * j->scale;
        if (s > m) {
            float f = expf(m - s);  // 0 for the first key (m = -inf)
            l *= f;
            for (int64_t i = 0; i < hd; i++)
                acc[i] *= f;
            m = s;
        }
        float p = expf(s - m);
        l += p;
        for (int64_t i = 0; i < hd; i++)
            acc[i] += p * vc[i];
    }
    float *o = j->out + r * qw + h * hd;
    for (int64_t i = 0; i < hd; i++)
        o[i] = acc[i] / l;
    if (acc != stack)
        free(acc);
}

static lm_status cpu_attention(lm_dev *d, float *out, const float *q, const float *k, const float *v,
                               const int32_t *start, int64_t rows, int64_t heads, int64_t kv_heads,
                               int64_t head_dim, float scale, lm_err *err)
{
    if (heads <= 0 || kv_heads <= 0 || heads % kv_heads != 0)
        return lm_err_set(err, LM_ERR_USAGE, "cpu: attention with %lld heads and %lld kv heads (heads must be a "
                          "multiple of kv heads)", (long long)heads, (long long)kv_heads);
    attn_job j = {out, q, k, v, start, heads, heads / kv_heads, head_dim, scale, 0};
    lm_pool_run(pool_of(d), rows * heads, attn_task, &j);
    if (j.failed)
        return lm_err_set(err, LM_ERR_NOMEM, "cpu: out of memory for attention scratch (head_dim %lld)",
                          (long long)head_dim);
    return LM_OK;
}

typedef struct silu_job {
    float *g;
    const float *u;
    int64_t n;
} silu_job;

static void silu_task(void *ctx, int64_t blk)
{
    silu_job *j = ctx;
    int64_t lo = blk * BLOCK, hi = lo + BLOCK < j->n ? lo + BLOCK : j->n;
    for (int64_t i = lo; i < hi; i++) {
        float x = j->g[i];
        j->g[i] = x / (1.0f + expf(-x)) * j->u[i];
    }
}

static lm_status cpu_silu_mul(lm_dev *d, float *gate, const float *up, int64_t n, lm_err *err)
{
    (void)err;
    silu_job j = {gate, up, n};
    lm_pool_run(pool_of(d), n_blocks(n), silu_task, &j);
    return LM_OK;
}

typedef struct nll_job {
    float *nll;
    const float *logits;
    const int32_t *targets;
    int64_t cols;
} nll_job;

static void nll_task(void *ctx, int64_t r)
{
    nll_job *j = ctx;
    const float *x = j->logits + r * j->cols;
    int64_t t = j->targets[r];
    if (t < 0 || t >= j->cols) {
        j->nll[r] = 0.0f;
        return;
    }
    float m = x[0];
    for (int64_t c = 1; c < j->cols; c++)
        m = x[c] > m ? x[c] : m;
    double sum = 0;
    for (int64_t c = 0; c < j->cols; c++)
        sum += (double)expf(x[c] - m);
    j->nll[r] = (float)((double)m + log(sum) - (double)x[t]);
}

static lm_status cpu_nll_rows(lm_dev *d, float *nll, const float *logits, const int32_t *targets, int64_t rows,
                              int64_t cols, lm_err *err)
{
    (void)err;
    nll_job j = {nll, logits, targets, cols};
    lm_pool_run(pool_of(d), rows, nll_task, &j);
    return LM_OK;
}
