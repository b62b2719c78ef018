// The CPU backend's own header, shared by its files and included by no one else: the backend's
// state, the fixed blocks its work is split into, the operations each file provides for the
// vtable in cpu.c (their contracts are the lm_dev_* ones of device.h), and the chunk kernels the
// fused dense passes (cpu_dense.c) share with the separate operations, so that both compute
// alike bit for bit. The files:
//
//   cpu.c          the vtable, memory, conversions, creating the device and its companion
//   cpu_arith.c    GEMM (and its low-rank and narrow products), syrk, axpby, delta, DoRA, the
//                  combination
//   cpu_select.c   histograms, top-k, importance, Cholesky, stored masks, random drop, L1
//   cpu_dense.c    the fused dense passes (lm_dev_dense_hist, lm_dev_dense_merge)
//   cpu_forward.c  the forward pass's row-wise operations
//
// Names here are the backend's (cpu_), not the library's API.
#ifndef LM_CPU_IMPL_H
#define LM_CPU_IMPL_H

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_AVX512_PATH 1  // kernels with AVX-512 or AVX2 and FMA, chosen when the processor has them
#define HAVE_FMA_PATH 1
#endif
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "device_impl.h"
#include "parallel.h"
#include "sparsify.h"
#include "util.h"

#define BLOCK 65536  // elements per task
#define CHUNK 512    // elements per inner chunk of the combination and of the fused passes

typedef struct cpu_ctx {
    lm_pool *pool;
    uint32_t *hist_local;     // histogram tables of cpu_hist_abs, zero between calls
    size_t hist_cells;
    pthread_mutex_t hist_mu;  // guards the caller's histogram while tasks add to it
    float *lora_tau;          // the fused dense operations' LoRA τ, a span per part per task
    size_t lora_cells;
} cpu_ctx;

static inline lm_pool *pool_of(lm_dev *d)
{
    return ((cpu_ctx *)d->ctx)->pool;
}

static inline int64_t n_blocks(int64_t n)
{
    return (n + BLOCK - 1) / BLOCK;
}

// The window's counts gather the window tables' indices of the values in the window in a list
// and make the increments a list at a time. The tables are megabytes (LM_HIST_BINS per bin of
// the window, per part): an increment is a cache miss, and made a few at a time between the
// comparisons each waited for its memory (a third of a fused LoRA pass went there); a long run
// of them overlaps.
#define WIN_LIST 16384

typedef struct win_list {
    uint32_t *tables;                // the task's tables, which the keys index; or, when NULL,
    const lm_dense_part *parts;      // the parts' window histograms: key (i << 20 | index) is
    pthread_mutex_t *mu;             // part i's, added to under mu
    int64_t m;                       // keys gathered
    uint32_t keys[WIN_LIST + 16];    // the slack takes a whole compressing store
} win_list;

#define WIN_PART_SHIFT 20  // a window's cells below it
#define WIN_MAX_PARTS 4096
_Static_assert((uint64_t)LM_HIST_WINDOW * LM_HIST_BINS <= 1u << WIN_PART_SHIFT,
               "a window's cells fit below the part's bits");

// ---- cpu.c -----------------------------------------------------------------------------------

// *to += *c, count by count.
void cpu_nf_add(lm_nonfinite *to, const lm_nonfinite *c);

// ---- cpu_arith.c -----------------------------------------------------------------------------

lm_status cpu_gemm(lm_dev *d, bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float *a,
                   int64_t lda, const float *b, int64_t ldb, float beta, float *c, int64_t ldc, lm_err *err);
lm_status cpu_syrk(lm_dev *d, int64_t n, int64_t k, float alpha, const float *a, int64_t lda, float beta,
                   bool mirror, float *c, int64_t ldc, lm_err *err);
lm_status cpu_axpby(lm_dev *d, float *y, float a, const float *x, float b, int64_t n, lm_err *err);
lm_status cpu_delta(lm_dev *d, float *tau, const void *src, lm_dtype dt, const float *base, int64_t n, lm_err *err);
lm_status cpu_delta_count(lm_dev *d, float *tau, const void *src, lm_dtype dt, const float *base, int64_t n,
                          lm_nonfinite *nf, lm_err *err);
lm_status cpu_dora_rows(lm_dev *d, float *tau, const float *base, const float *magnitude, int64_t rows,
                        int64_t cols, lm_err *err);
lm_status cpu_combine(lm_dev *d, float *out, const float *base, const float *const *w_tau, const float *weights,
                      int k, int64_t n, lm_combine_sign sign, bool normalize, float lambda, lm_err *err);

// lm_dev_gemm's low-rank product: c[i·ldc + j] = alpha · Σ_q x[i·ldx + q] · y[q·ldy + j]
// (+ beta · c[i·ldc + j] unless beta is 0) for i < m, j < n, k <= LM_DEV_LOWRANK_MAX, each sum
// the multiply-add chain in q order.
void cpu_lowrank_tile(float *c, int64_t ldc, const float *x, int64_t ldx, const float *y, int64_t ldy, int64_t m,
                      int64_t k, int64_t n, float alpha, float beta);
// t[i] = t[i] − b[i] for i < n: a task vector from converted values.
LM_VECTOR_CLONES void cpu_subtract(float *restrict t, const float *restrict b, int64_t n);
// out[0..cnt) = base + lambda·Δ of the k values tau[i][0..cnt) (cnt <= CHUNK), as lm_dev_combine.
void cpu_combine_values(float *out, const float *base, const float *const *tau, const float *w, int k, int64_t cnt,
                        lm_combine_sign sign, bool normalize, float lambda);

// ---- cpu_select.c ----------------------------------------------------------------------------

lm_status cpu_hist_abs(lm_dev *d, uint64_t *hist, const float *x, int64_t n, int level, uint32_t hi_bin, lm_err *err);
lm_status cpu_hist_window(lm_dev *d, uint64_t *above, uint64_t *win, int n_win, uint32_t lo_bin, const float *x,
                          int64_t n, lm_err *err);
lm_status cpu_topk_apply(lm_dev *d, float *x, int64_t n, uint32_t thr_bits, int64_t ties_allowed,
                         int64_t *ties_used, lm_err *err);
lm_status cpu_topk_drop(lm_dev *d, float *x, int64_t n, uint32_t thr_bits, int64_t ties_allowed, int64_t *ties_used,
                        lm_err *err);
lm_status cpu_topk_apply_by(lm_dev *d, float *x, const float *key, int64_t n, uint32_t thr_bits,
                            int64_t ties_allowed, int64_t *ties_used, lm_err *err);
lm_status cpu_importance(lm_dev *d, float *key, const float *tau, const double *ucc2, int64_t rows, int64_t cols,
                         lm_err *err);
lm_status cpu_potrf(lm_dev *d, double *a, int64_t n, double *diag, lm_err *err);
lm_status cpu_mask_get(lm_dev *d, uint8_t *bits, int64_t first, const float *x, int64_t n, lm_err *err);
lm_status cpu_mask_apply(lm_dev *d, float *x, const uint8_t *bits, int64_t first, int64_t n, lm_err *err);
lm_status cpu_random_drop(lm_dev *d, float *x, int64_t n, uint64_t key, int64_t first, uint64_t keep_below,
                          lm_err *err);
lm_status cpu_l1(lm_dev *d, const float *x, int64_t n, double *out, lm_err *err);
// lanes[c mod LM_DOT_LANES] += x[i]·y[i] for i in [0, n), c = col + i (the column of x[i] in
// its row): a stretch of a row's dot product in lm_dev_row_dot's lanes (device.h).
void cpu_dot_lanes(double lanes[LM_DOT_LANES], const float *x, const float *y, int64_t n, int64_t col);

// The row's dot product from its lanes, in device.h's order (the lanes are overwritten).
static inline double cpu_dot_lanes_sum(double l[LM_DOT_LANES])
{
    for (int w = 1; w < LM_DOT_LANES; w *= 2)
        for (int q = 0; q < LM_DOT_LANES; q += 2 * w)
            l[q] += l[q + w];
    return l[0];
}

lm_status cpu_row_dot(lm_dev *d, const float *x, const float *y, int64_t rows, int64_t cols, double *out,
                      lm_err *err);
lm_status cpu_nearswap(lm_dev *d, float *x, int64_t n, float t, lm_err *err);
lm_status cpu_tau_var(lm_dev *d, float *key, const float *const *taus, int k, int n_models, int64_t n, lm_err *err);
lm_status cpu_col_dot(lm_dev *d, const float *x, const float *y, int64_t rows, int64_t cols, double *acc,
                      lm_err *err);
lm_status cpu_col_axpby(lm_dev *d, float *y, const float *a, const float *x, const float *b, int64_t rows,
                        int64_t cols, lm_err *err);
lm_status cpu_dense_gram(lm_dev *d, const void *base, lm_dtype base_dt, lm_dense_part *parts, int k, int64_t rows,
                         int64_t cols, double *out, lm_err *err);
lm_status cpu_row_axpby(lm_dev *d, float *y, const float *a, const float *x, const float *b, int64_t rows,
                        int64_t cols, lm_err *err);
lm_status cpu_della_drop(lm_dev *d, float *x, int64_t rows, int64_t cols, uint64_t key, int64_t first, double p_lo,
                         double p_hi, bool inv, lm_err *err);

// The window's counts of n values into l (cpu_select.c says how); returns those beyond it.
LM_VECTOR_CLONES uint64_t cpu_hist_win(win_list *l, uint32_t off, const float *x, int64_t n, uint32_t lo_bin,
                                       uint32_t n_win);
// Makes the increments gathered in l, and empties it.
void cpu_win_flush(win_list *l);
// How many of x[lo..hi) have magnitude bits equal to thr (the ties at a threshold).
LM_VECTOR_CLONES int64_t cpu_count_ties(const float *x, int64_t lo, int64_t hi, uint32_t thr);
// Keeps x[i], i in [lo, hi), whose magnitude bits exceed thr, or equal it when keep_ties; zeroes
// the others.
LM_VECTOR_CLONES void cpu_topk_keep(float *x, int64_t lo, int64_t hi, uint32_t thr, bool keep_ties);

// ---- cpu_dense.c -----------------------------------------------------------------------------

lm_status cpu_dense_hist(lm_dev *d, const void *base, lm_dtype base_dt, lm_dense_part *parts, int k, int64_t n,
                         lm_err *err);
lm_status cpu_dense_merge(lm_dev *d, void *out, lm_dtype out_dt, const void *base, lm_dtype base_dt,
                          lm_dense_part *parts, int k, int64_t n, lm_combine_how how, const lm_dev_side *side,
                          lm_err *err);

// ---- cpu_forward.c ---------------------------------------------------------------------------

lm_status cpu_gather_rows(lm_dev *d, float *out, const float *table, int64_t table_rows, int64_t cols,
                          const int32_t *ids, int64_t n, lm_err *err);
lm_status cpu_add_rows(lm_dev *d, float *y, const float *b, int64_t rows, int64_t cols, lm_err *err);
lm_status cpu_rmsnorm(lm_dev *d, float *out, const float *x, const float *w, int64_t rows, int64_t cols, float eps,
                      lm_err *err);
lm_status cpu_rope(lm_dev *d, float *x, int64_t rows, int64_t heads, int64_t head_dim, const int32_t *pos,
                   const float *inv_freq, lm_err *err);
lm_status cpu_attention(lm_dev *d, float *out, const float *q, const float *k, const float *v, const int32_t *start,
                        int64_t rows, int64_t heads, int64_t kv_heads, int64_t head_dim, float scale, lm_err *err);
lm_status cpu_silu_mul(lm_dev *d, float *gate, const float *up, int64_t n, lm_err *err);
lm_status cpu_nll_rows(lm_dev *d, float *nll, const float *logits, const int32_t *targets, int64_t rows,
                       int64_t cols, lm_err *err);

#endif
