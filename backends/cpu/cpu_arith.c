// The CPU backend's arithmetic: GEMM through OpenBLAS (with its own kernels for the low-rank
// products of LoRA pairs and for products of a large matrix with a few columns), the symmetric
// rank-k update, axpby, task vectors (delta, DoRA), and the combination of task vectors (sign
// election, disjoint mean). See cpu_impl.h.
#include "cpu_impl.h"

#include <cblas.h>

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

void cpu_lowrank_tile(float *c, int64_t ldc, const float *x, int64_t ldx, const float *y, int64_t ldy, int64_t m,
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
    cpu_lowrank_tile(j->c + r0 * j->ldc, j->ldc, j->a + r0 * j->lda, j->lda, j->b, j->ldb, r1 - r0, j->k, j->n,
                     j->alpha, j->beta);
}

// ---- narrow products --------------------------------------------------------------------------
// C = A·W and C = Aᵀ·W where C has at most NARROW_MAX_N columns and A is large: the randomised
// SVD's products of a matrix with its test matrix and with its bases (lowrank.c). OpenBLAS
// packs A for every such product, a copy of the whole matrix for a few columns of work (a third
// of the products' time in an extraction); these kernels read A once, as it lies, against W's
// rows held in vector registers. Each element of C is summed over k in order, in blocks of
// NARROW_KB terms each summed from zero and added to C in block order: its value depends on its
// own inputs alone, whichever task makes it, and the float32 sums are blocked as BLAS blocks
// them (a single chain over test_device's sum of 131,072 terms lost a digit). AVX-512 only;
// other processors, and other shapes, go to OpenBLAS.
#define NARROW_MAX_N 80   // five 16-wide vectors
#define NARROW_KB 256     // terms summed from zero before they are added to C
#define NARROW_ROWS 256   // rows of C per task
#define NARROW_MIN_WORK (1 << 20)  // m·k below this: OpenBLAS (the packed copy costs little there)

typedef struct narrow_job {
    int64_t m, n, k;
    const float *a, *w;  // C = A·W: w is W packed, k rows of 16·V floats; C = Aᵀ·W: W itself
    int64_t lda, ldw, ldc;
    float *c;
    int v;               // 16-wide vectors per row of C
    uint16_t last;       // the lanes of C in the last vector
} narrow_job;

#ifdef HAVE_AVX512_PATH
// The mask of vector v of V: every lane but in the last.
#define NARROW_MASK(j, vv) ((__mmask16)((vv) == (j)->v - 1 ? (j)->last : 0xFFFF))

// C's rows [i, i + R) of C = A·W over the terms [k0, k0 + NARROW_KB): summed from zero, then
// added to C (written where k0 is 0). R and V are constants where it is inlined.
__attribute__((target("avx512f"), always_inline)) static inline void narrow_ab_rows(const narrow_job *j, int64_t i,
                                                                                 int64_t k0, const int R,
                                                                                 const int V)
{
    int64_t k1 = j->k - k0 < NARROW_KB ? j->k : k0 + NARROW_KB;
    __m512 s[8][5];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 5
        for (int v = 0; v < V; v++)
            s[r][v] = _mm512_setzero_ps();
    const float *a = j->a + i * j->lda;
    for (int64_t q = k0; q < k1; q++) {
        const float *w = j->w + q * 16 * V;
        __m512 wv[5];
#pragma GCC unroll 5
        for (int v = 0; v < V; v++)
            wv[v] = _mm512_load_ps(w + 16 * v);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            __m512 x = _mm512_set1_ps(a[r * j->lda + q]);
#pragma GCC unroll 5
            for (int v = 0; v < V; v++)
                s[r][v] = _mm512_fmadd_ps(x, wv[v], s[r][v]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 5
        for (int v = 0; v < V; v++) {
            float *cr = j->c + (i + r) * j->ldc + 16 * v;
            __mmask16 mk = NARROW_MASK(j, v);
            __m512 o = k0 == 0 ? s[r][v] : _mm512_add_ps(_mm512_maskz_loadu_ps(mk, cr), s[r][v]);
            _mm512_mask_storeu_ps(cr, mk, o);
        }
}

// Rows [r0, r1) of C = A·W, a block of terms at a time (its rows of W stay in the caches while
// the task's rows pass): R rows at a time, then one.
__attribute__((target("avx512f"), always_inline)) static inline void narrow_ab_task(const narrow_job *j, int64_t r0,
                                                                                 int64_t r1, const int R, const int V)
{
    for (int64_t k0 = 0; k0 < j->k; k0 += NARROW_KB) {
        int64_t i = r0;
        for (; i + R <= r1; i += R)
            narrow_ab_rows(j, i, k0, R, V);
        for (; i < r1; i++)
            narrow_ab_rows(j, i, k0, 1, V);
    }
}

// p[c − c0] += Σ over A's rows [i, i + R) of A[row, c] · W[row] for C's rows c in [c0, c1)
// (A's columns), p holding 16·V floats a row; U of C's rows at a time, then one. W's R rows are
// held in registers across the sweep.
__attribute__((target("avx512f"), always_inline)) static inline void narrow_atb_rows(const narrow_job *j, float *p,
                                                                                  int64_t i, int64_t c0, int64_t c1,
                                                                                  const int R, const int V, const int U)
{
    __m512 w[8][5];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 5
        for (int v = 0; v < V; v++)
            w[r][v] = _mm512_maskz_loadu_ps(NARROW_MASK(j, v), j->w + (i + r) * j->ldw + 16 * v);
    const float *a = j->a + i * j->lda;
    int64_t c = c0;
    for (; c + U <= c1; c += U) {
        float *pc = p + (c - c0) * 16 * V;
        __m512 s[8][5];
#pragma GCC unroll 8
        for (int u = 0; u < U; u++)
#pragma GCC unroll 5
            for (int v = 0; v < V; v++)
                s[u][v] = _mm512_load_ps(pc + (u * V + v) * 16);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++)
#pragma GCC unroll 8
            for (int u = 0; u < U; u++) {
                __m512 x = _mm512_set1_ps(a[r * j->lda + c + u]);
#pragma GCC unroll 5
                for (int v = 0; v < V; v++)
                    s[u][v] = _mm512_fmadd_ps(x, w[r][v], s[u][v]);
            }
#pragma GCC unroll 8
        for (int u = 0; u < U; u++)
#pragma GCC unroll 5
            for (int v = 0; v < V; v++)
                _mm512_store_ps(pc + (u * V + v) * 16, s[u][v]);
    }
    for (; c < c1; c++) {
        float *pc = p + (c - c0) * 16 * V;
        __m512 s[5];
#pragma GCC unroll 5
        for (int v = 0; v < V; v++)
            s[v] = _mm512_load_ps(pc + v * 16);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            __m512 x = _mm512_set1_ps(a[r * j->lda + c]);
#pragma GCC unroll 5
            for (int v = 0; v < V; v++)
                s[v] = _mm512_fmadd_ps(x, w[r][v], s[v]);
        }
#pragma GCC unroll 5
        for (int v = 0; v < V; v++)
            _mm512_store_ps(pc + v * 16, s[v]);
    }
}

// C's rows [c0, c1) of C = Aᵀ·W (A's columns), A's rows a block of NARROW_KB at a time: each
// block's sums made from zero in p, then added to C.
__attribute__((target("avx512f"), always_inline)) static inline void narrow_atb_task(const narrow_job *j, int64_t c0,
                                                                                  int64_t c1, const int R,
                                                                                  const int V, const int U)
{
    _Alignas(64) float p[NARROW_ROWS * NARROW_MAX_N];
    for (int64_t i0 = 0; i0 < j->k; i0 += NARROW_KB) {
        int64_t i1 = j->k - i0 < NARROW_KB ? j->k : i0 + NARROW_KB, i = i0;
        memset(p, 0, (size_t)((c1 - c0) * 16 * V) * sizeof *p);
        for (; i + R <= i1; i += R)
            narrow_atb_rows(j, p, i, c0, c1, R, V, U);
        for (; i < i1; i++)
            narrow_atb_rows(j, p, i, c0, c1, 1, V, U);
        for (int64_t c = c0; c < c1; c++)
#pragma GCC unroll 5
            for (int v = 0; v < V; v++) {
                float *cr = j->c + c * j->ldc + 16 * v;
                __mmask16 mk = NARROW_MASK(j, v);
                __m512 s = _mm512_load_ps(p + ((c - c0) * V + v) * 16);
                _mm512_mask_storeu_ps(cr, mk, i0 == 0 ? s : _mm512_add_ps(_mm512_maskz_loadu_ps(mk, cr), s));
            }
    }
}

// One function per number of vectors, with its tile: R rows of A (and U rows of C for Aᵀ·W) at
// a time, as many as keep the sums and W's rows in the 32 vector registers with enough
// independent chains of multiply-adds to cover their latency.
#define NARROW_FNS(V, RAB, RATB, U)                                                                                   \
    __attribute__((target("avx512f"))) static void narrow_ab_v##V(void *ctx, int64_t t)                               \
    {                                                                                                                 \
        const narrow_job *j = ctx;                                                                                    \
        int64_t r0 = t * NARROW_ROWS, r1 = j->m - r0 < NARROW_ROWS ? j->m : r0 + NARROW_ROWS;                         \
        narrow_ab_task(j, r0, r1, RAB, V);                                                                            \
    }                                                                                                                 \
    __attribute__((target("avx512f"))) static void narrow_atb_v##V(void *ctx, int64_t t)                              \
    {                                                                                                                 \
        const narrow_job *j = ctx;                                                                                    \
        int64_t c0 = t * NARROW_ROWS, c1 = j->m - c0 < NARROW_ROWS ? j->m : c0 + NARROW_ROWS;                         \
        narrow_atb_task(j, c0, c1, RATB, V, U);                                                                       \
    }
NARROW_FNS(1, 8, 8, 8)
NARROW_FNS(2, 8, 8, 4)
NARROW_FNS(3, 6, 6, 2)
NARROW_FNS(4, 4, 4, 2)
NARROW_FNS(5, 4, 4, 2)

static void (*const narrow_ab_fns[6])(void *, int64_t) = {NULL, narrow_ab_v1, narrow_ab_v2, narrow_ab_v3,
                                                          narrow_ab_v4, narrow_ab_v5};
static void (*const narrow_atb_fns[6])(void *, int64_t) = {NULL, narrow_atb_v1, narrow_atb_v2, narrow_atb_v3,
                                                           narrow_atb_v4, narrow_atb_v5};
#endif

// C = A·W (ta false) or Aᵀ·W (ta true) by the kernels above, where they apply: true when done,
// false for OpenBLAS (another shape, alpha not 1, beta not 0, a processor without AVX-512, or no
// memory for W's packed copy).
static bool narrow_gemm(lm_pool *pool, bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha,
                        const float *a, int64_t lda, const float *b, int64_t ldb, float beta, float *c, int64_t ldc)
{
#ifdef HAVE_AVX512_PATH
    if (tb || alpha != 1.0f || beta != 0.0f || n < 1 || n > NARROW_MAX_N || k < 1 || m * k < NARROW_MIN_WORK ||
        !__builtin_cpu_supports("avx512f"))
        return false;
    int v = (int)((n + 15) / 16);
    narrow_job j = {.m = m, .n = n, .k = k, .a = a, .w = b, .lda = lda, .ldw = ldb, .ldc = ldc, .c = c, .v = v,
                    .last = (uint16_t)(0xFFFFu >> (16 * v - n))};
    float *packed = NULL;
    if (!ta) {
        // W's rows padded with zeros to 16·V floats, aligned: k rows, in the caches block by block
        size_t size = (size_t)(k * 16 * v) * sizeof *packed;
        if (!(packed = aligned_alloc(64, (size + 63) / 64 * 64)))
            return false;
        for (int64_t q = 0; q < k; q++) {
            memcpy(packed + q * 16 * v, b + q * ldb, (size_t)n * sizeof *packed);
            memset(packed + q * 16 * v + n, 0, (size_t)(16 * v - n) * sizeof *packed);
        }
        j.w = packed;
    }
    lm_pool_run(pool, ceil_div(m, NARROW_ROWS), ta ? narrow_atb_fns[v] : narrow_ab_fns[v], &j);
    free(packed);
    return true;
#else
    (void)pool, (void)ta, (void)tb, (void)m, (void)n, (void)k, (void)alpha, (void)a, (void)lda, (void)b, (void)ldb,
        (void)beta, (void)c, (void)ldc;
    return false;
#endif
}

lm_status cpu_gemm(lm_dev *d, bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha,
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
    if (narrow_gemm(pool_of(d), ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc))
        return LM_OK;
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

lm_status cpu_syrk(lm_dev *d, int64_t n, int64_t k, float alpha, const float *a, int64_t lda, float beta,
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

typedef struct row_axpby_job {
    float *y;
    const float *a, *x, *b;
    int64_t rows, cols, per_task;
} row_axpby_job;

static void row_axpby_task(void *ctx, int64_t t)
{
    row_axpby_job *j = ctx;
    int64_t r1 = (t + 1) * j->per_task < j->rows ? (t + 1) * j->per_task : j->rows;
    for (int64_t r = t * j->per_task; r < r1; r++) {
        float a = j->a[r], b = j->b[r];
        float *y = j->y + r * j->cols;
        const float *x = j->x + r * j->cols;
        for (int64_t c = 0; c < j->cols; c++)
            y[c] = a * y[c] + b * x[c];
    }
}

lm_status cpu_row_axpby(lm_dev *d, float *y, const float *a, const float *x, const float *b, int64_t rows,
                        int64_t cols, lm_err *err)
{
    (void)err;
    int64_t per = cols > 0 ? (BLOCK + cols - 1) / cols : rows;  // about a block of elements per task
    row_axpby_job j = {y, a, x, b, rows, cols, per > 0 ? per : 1};
    lm_pool_run(pool_of(d), rows > 0 ? (rows + j.per_task - 1) / j.per_task : 0, row_axpby_task, &j);
    return LM_OK;
}

// Columns in tasks of COL_TASK; each column's sum goes down its rows in order.
#define COL_TASK 256

typedef struct col_job {
    float *y;
    const float *a, *x, *b, *xd, *yd;
    double *acc;
    int64_t rows, cols;
} col_job;

static void col_dot_task(void *ctx, int64_t t)
{
    col_job *j = ctx;
    int64_t c0 = t * COL_TASK, c1 = c0 + COL_TASK < j->cols ? c0 + COL_TASK : j->cols;
    for (int64_t r = 0; r < j->rows; r++) {
        const float *x = j->xd + r * j->cols, *y = j->yd + r * j->cols;
        for (int64_t c = c0; c < c1; c++)
            j->acc[c] += (double)x[c] * (double)y[c];
    }
}

lm_status cpu_col_dot(lm_dev *d, const float *x, const float *y, int64_t rows, int64_t cols, double *acc,
                      lm_err *err)
{
    (void)err;
    col_job j = {.xd = x, .yd = y, .acc = acc, .rows = rows, .cols = cols};
    lm_pool_run(pool_of(d), (cols + COL_TASK - 1) / COL_TASK, col_dot_task, &j);
    return LM_OK;
}

static void col_axpby_task(void *ctx, int64_t t)
{
    col_job *j = ctx;
    int64_t per = (BLOCK + j->cols - 1) / j->cols;
    int64_t r1 = (t + 1) * per < j->rows ? (t + 1) * per : j->rows;
    for (int64_t r = t * per; r < r1; r++) {
        float *y = j->y + r * j->cols;
        const float *x = j->x + r * j->cols;
        for (int64_t c = 0; c < j->cols; c++)
            y[c] = j->a[c] * y[c] + j->b[c] * x[c];
    }
}

lm_status cpu_col_axpby(lm_dev *d, float *y, const float *a, const float *x, const float *b, int64_t rows,
                        int64_t cols, lm_err *err)
{
    (void)err;
    if (rows <= 0 || cols <= 0)
        return LM_OK;
    int64_t per = (BLOCK + cols - 1) / cols;
    col_job j = {.y = y, .a = a, .x = x, .b = b, .rows = rows, .cols = cols};
    lm_pool_run(pool_of(d), (rows + per - 1) / per, col_axpby_task, &j);
    return LM_OK;
}

lm_status cpu_axpby(lm_dev *d, float *y, float a, const float *x, float b, int64_t n, lm_err *err)
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

LM_VECTOR_CLONES void cpu_subtract(float *restrict t, const float *restrict b, int64_t n)
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
    cpu_subtract(t, b, cnt);
    if (j->nf)
        cpu_nf_add(j->nf, &c);
}

lm_status cpu_delta_count(lm_dev *d, float *tau, const void *src, lm_dtype dt, const float *base, int64_t n,
                          lm_nonfinite *nf, lm_err *err)
{
    if (!lm_dtype_readable(dt))
        return lm_convert_to_f32(tau, src, dt, 0, err);
    delta_job j = {tau, src, dt, base, n, nf};
    lm_pool_run(pool_of(d), n_blocks(n), delta_task, &j);
    return LM_OK;
}

lm_status cpu_delta(lm_dev *d, float *tau, const void *src, lm_dtype dt, const float *base, int64_t n,
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

lm_status cpu_dora_rows(lm_dev *d, float *tau, const float *base, const float *magnitude,
                        int64_t rows, int64_t cols, lm_err *err)
{
    (void)err;
    dora_job j = {tau, base, magnitude, cols};
    lm_pool_run(pool_of(d), rows, dora_task, &j);
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

// The combination's loops, over a CHUNK (cpu_impl.h) of elements: the per-element sums live in
// small arrays, and each model's contribution is one loop over contiguous elements (restrict,
// branch-free) that the compiler vectorises. The loops are kept out of line: inlined into the
// loop over models, GCC's unroll-and-jam fuses two models into one scalar loop with branches,
// several times slower than the vector loop.
#define VECTOR_LOOP LM_VECTOR_CLONES __attribute__((noinline))

VECTOR_LOOP static void add_weighted(float *restrict delta, float *restrict div, const float *restrict t, float w,
                         int64_t cnt)
{
    for (int64_t e = 0; e < cnt; e++) {
        delta[e] += w * t[e];
        div[e] += w;
    }
}

VECTOR_LOOP static void add_weighted_nonzero(float *restrict delta, float *restrict div, const float *restrict t,
                                             float w, int64_t cnt)
{
    for (int64_t e = 0; e < cnt; e++) {
        delta[e] += w * t[e];
        div[e] += t[e] != 0.0f ? w : 0.0f;
    }
}

// ramplus_tl's sums: delta the weighted, vote the unweighted, div the count of parts not zero.
VECTOR_LOOP static void add_ramplus(float *restrict delta, float *restrict vote, float *restrict div,
                                    const float *restrict t, float w, int64_t cnt)
{
    for (int64_t e = 0; e < cnt; e++) {
        delta[e] += w * t[e];
        vote[e] += t[e];
        div[e] += t[e] != 0.0f ? 1.0f : 0.0f;
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
void cpu_combine_values(float *out, const float *base, const float *const *tau, const float *w, int k,
                        int64_t cnt, lm_combine_sign sign, bool normalize, float lambda)
{
    float vote[CHUNK], delta[CHUNK], div[CHUNK];
    for (int64_t e = 0; e < cnt; e++)
        vote[e] = delta[e] = div[e] = 0.0f;
    if (sign == LM_COMBINE_SIGN_NONE) {
        for (int i = 0; i < k; i++)
            add_weighted(delta, div, tau[i], w[i], cnt);
    } else if (sign == LM_COMBINE_SIGN_NONZERO) {
        for (int i = 0; i < k; i++)
            add_weighted_nonzero(delta, div, tau[i], w[i], cnt);
    } else if (sign == LM_COMBINE_SIGN_RAMPLUS) {
        for (int i = 0; i < k; i++)
            add_ramplus(delta, vote, div, tau[i], w[i], cnt);
        for (int64_t e = 0; e < cnt; e++) {
            delta[e] = div[e] == 1.0f ? delta[e] : div[e] > 1.0f ? vote[e] / div[e] : 0.0f;
            div[e] = 0.0f;  // nothing left to divide
        }
    } else {
        for (int i = 0; i < k; i++) {
            if (sign == LM_COMBINE_SIGN_SUM || sign == LM_COMBINE_SIGN_TAU)
                add_vote_sum(vote, tau[i], sign == LM_COMBINE_SIGN_TAU ? 1.0f : w[i], cnt);
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
        cpu_combine_values(j->out + c, j->base + c, tau, j->w, j->k, hi - c < CHUNK ? hi - c : CHUNK, j->sign,
                           j->normalize, j->lambda);
    }
}

lm_status cpu_combine(lm_dev *d, float *out, const float *base, const float *const *w_tau,
                      const float *weights, int k, int64_t n, lm_combine_sign sign, bool normalize,
                      float lambda, lm_err *err)
{
    (void)err;
    combine_job j = {out, base, w_tau, weights, k, n, sign, normalize, lambda};
    lm_pool_run(pool_of(d), n_blocks(n), combine_task, &j);
    return LM_OK;
}
