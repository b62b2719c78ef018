// The CPU backend's selection: radix histograms of magnitudes (whole, and a window near an
// expected threshold), top-k trims by value or by importance, sparsegpt's importance and the
// Cholesky factorisation it needs (LAPACKE), stored masks, random drops and L1 sums. See
// cpu_impl.h.
#include "cpu_impl.h"
#include "sparsify.h"

#include <lapacke.h>

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

void cpu_win_flush(win_list *l)
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
// cpu_hist_win with AVX-512: sixteen magnitudes at a time are compared with the window, those
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
            cpu_win_flush(l);
    }
    for (; i < n; i++) {
        uint32_t bits = lm_abs_bits(x[i]), top = bits >> 16, w = top - lo_bin;
        above += top >= lo_bin + n_win;
        if (w < n_win)
            l->keys[l->m++] = off + ((w << 16) | (bits & 0xFFFFu));
    }
    if (l->m >= WIN_LIST)
        cpu_win_flush(l);
    return above;
}
#endif

// The window's counts of n values into the tables from `off` (cells): values at or beyond the
// window are counted and returned, the indices of those in it, (w << 16 | low bits), gathered
// into l without a branch (as for hist_low). The caller flushes l when its run ends.
LM_VECTOR_CLONES uint64_t cpu_hist_win(win_list *l, uint32_t off, const float *x, int64_t n, uint32_t lo_bin,
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
            cpu_win_flush(l);
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
        above = cpu_hist_win(&l, 0, x + lo, hi - lo, j->hi_bin, (uint32_t)j->n_win);
        cpu_win_flush(&l);
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

lm_status cpu_hist_window(lm_dev *d, uint64_t *above, uint64_t *win, int n_win, uint32_t lo_bin,
                          const float *x, int64_t n, lm_err *err)
{
    hist_job j = {.x = x, .n = n, .level = 2, .hi_bin = lo_bin, .hist = above, .win = win, .n_win = n_win};
    return run_hist(d, &j, err);
}

lm_status cpu_hist_abs(lm_dev *d, uint64_t *hist, const float *x, int64_t n, int level,
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
    bool drop;        // zero what top-k keeps, keep the rest (lm_dev_topk_drop)
} topk_job;

LM_VECTOR_CLONES int64_t cpu_count_ties(const float *x, int64_t lo, int64_t hi, uint32_t thr)
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
    j->ties[blk] = cpu_count_ties(j->key, lo, hi, j->thr);
}

// Keeps x[i] for i in [lo, hi) when its magnitude bits exceed thr, or equal it and keep_ties.
LM_VECTOR_CLONES void cpu_topk_keep(float *x, int64_t lo, int64_t hi, uint32_t thr, bool keep_ties)
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

// Zeroes x[i] for i in [lo, hi) when its magnitude bits exceed thr, or equal it and drop_ties.
static void topk_zero(float *x, int64_t lo, int64_t hi, uint32_t thr, bool drop_ties)
{
    uint32_t floor = drop_ties ? thr : thr + 1;
    for (int64_t i = lo; i < hi; i++)
        x[i] = lm_abs_bits(x[i]) >= floor ? 0.0f : x[i];
}

static void keep_range(const topk_job *j, int64_t lo, int64_t hi, bool keep_ties)
{
    if (j->drop)
        topk_zero(j->x, lo, hi, j->thr, keep_ties);
    else if (j->key == j->x)
        cpu_topk_keep(j->x, lo, hi, j->thr, keep_ties);
    else
        topk_keep_by(j->x, j->key, lo, hi, j->thr, keep_ties);
}

static void topk_all_task(void *ctx, int64_t blk)
{
    topk_job *j = ctx;
    int64_t lo = blk * BLOCK, hi = lo + BLOCK < j->n ? lo + BLOCK : j->n;
    keep_range(j, lo, hi, true);
}

static void topk_none_task(void *ctx, int64_t blk)
{
    topk_job *j = ctx;
    int64_t lo = blk * BLOCK, hi = lo + BLOCK < j->n ? lo + BLOCK : j->n;
    keep_range(j, lo, hi, false);
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
                          bool drop, int64_t *ties_used, lm_err *err)
{
    int64_t nb = n_blocks(n);
    if (ties_allowed == LM_TIES_ALL || ties_allowed <= 0) {
        // Every tie kept, or none: one pass, no counting. A threshold above every magnitude's
        // bits (none is kept) has no ties, and thr + 1 would wrap: the first rule then.
        topk_job all = {x, key, n, thr_bits, NULL, nb, drop};
        bool all_ties = ties_allowed == LM_TIES_ALL || thr_bits > 0x7FFFFFFFu;
        lm_pool_run(pool_of(d), nb, all_ties ? topk_all_task : topk_none_task, &all);
        *ties_used = 0;
        return LM_OK;
    }
    topk_job j = {x, key, n, thr_bits, calloc((size_t)(nb ? 2 * nb : 1), sizeof(int64_t)), nb, drop};
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

lm_status cpu_topk_apply(lm_dev *d, float *x, int64_t n, uint32_t thr_bits, int64_t ties_allowed,
                         int64_t *ties_used, lm_err *err)
{
    return topk_run(d, x, x, n, thr_bits, ties_allowed, false, ties_used, err);
}

lm_status cpu_topk_drop(lm_dev *d, float *x, int64_t n, uint32_t thr_bits, int64_t ties_allowed, int64_t *ties_used,
                        lm_err *err)
{
    return topk_run(d, x, x, n, thr_bits, ties_allowed, true, ties_used, err);
}

lm_status cpu_topk_apply_by(lm_dev *d, float *x, const float *key, int64_t n, uint32_t thr_bits,
                            int64_t ties_allowed, int64_t *ties_used, lm_err *err)
{
    return topk_run(d, x, key, n, thr_bits, ties_allowed, false, ties_used, err);
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

lm_status cpu_potrf(lm_dev *d, double *a, int64_t n, double *diag, lm_err *err)
{
    int info;
    if (lm_cpu_potrf(a, n, diag, &info) != LM_OK)
        return lm_err_set(err, LM_ERR_FORMAT, "%s: the %" PRId64 " x %" PRId64 " matrix is not positive definite "
                          "(LAPACK dpotrf info %d)", lm_dev_name(d), n, n, info);
    return LM_OK;
}

lm_status cpu_importance(lm_dev *d, float *key, const float *tau, const double *ucc2, int64_t rows,
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

lm_status cpu_mask_get(lm_dev *d, uint8_t *bits, int64_t first, const float *x, int64_t n, lm_err *err)
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

lm_status cpu_mask_apply(lm_dev *d, float *x, const uint8_t *bits, int64_t first, int64_t n, lm_err *err)
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

lm_status cpu_random_drop(lm_dev *d, float *x, int64_t n, uint64_t key, int64_t first,
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

lm_status cpu_l1(lm_dev *d, const float *x, int64_t n, double *out, lm_err *err)
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

typedef struct row_dot_job {
    const float *x, *y;
    int64_t rows, cols, per_task;
    double *out;  // (rows)
} row_dot_job;

typedef double v8d __attribute__((vector_size(8 * sizeof(double))));
typedef float v8f __attribute__((vector_size(8 * sizeof(float))));

LM_VECTOR_CLONES void cpu_dot_lanes(double lanes[LM_DOT_LANES], const float *x, const float *y, int64_t n, int64_t col)
{
    int64_t i = 0;
    for (; i < n && (col + i) % LM_DOT_LANES; i++)  // up to the next lane 0
        lanes[(col + i) % LM_DOT_LANES] += (double)x[i] * (double)y[i];
    // then the lanes in two vectors, in registers: element q of lo is lane q's chain, of hi
    // lane 8 + q's
    _Static_assert(LM_DOT_LANES == 16, "two vectors of eight lanes");
    v8d lo, hi;
    memcpy(&lo, lanes, sizeof lo);
    memcpy(&hi, lanes + 8, sizeof hi);
    for (; i + LM_DOT_LANES <= n; i += LM_DOT_LANES) {
        v8f x0, y0, x1, y1;
        memcpy(&x0, x + i, sizeof x0);
        memcpy(&y0, y + i, sizeof y0);
        memcpy(&x1, x + i + 8, sizeof x1);
        memcpy(&y1, y + i + 8, sizeof y1);
        lo += __builtin_convertvector(x0, v8d) * __builtin_convertvector(y0, v8d);  // exact products
        hi += __builtin_convertvector(x1, v8d) * __builtin_convertvector(y1, v8d);
    }
    memcpy(lanes, &lo, sizeof lo);
    memcpy(lanes + 8, &hi, sizeof hi);
    for (int q = 0; i < n; i++, q++)
        lanes[q] += (double)x[i] * (double)y[i];
}

static void row_dot_task(void *ctx, int64_t t)
{
    row_dot_job *j = ctx;
    int64_t r1 = (t + 1) * j->per_task < j->rows ? (t + 1) * j->per_task : j->rows;
    for (int64_t r = t * j->per_task; r < r1; r++) {
        double l[LM_DOT_LANES] = {0};
        cpu_dot_lanes(l, j->x + r * j->cols, j->y + r * j->cols, j->cols, 0);
        j->out[r] = cpu_dot_lanes_sum(l);
    }
}

lm_status cpu_row_dot(lm_dev *d, const float *x, const float *y, int64_t rows, int64_t cols, double *out,
                      lm_err *err)
{
    (void)err;
    int64_t per = cols > 0 ? (BLOCK + cols - 1) / cols : rows;  // about a block of elements per task
    row_dot_job j = {x, y, rows, cols, per > 0 ? per : 1, out};
    lm_pool_run(pool_of(d), rows > 0 ? (rows + j.per_task - 1) / j.per_task : 0, row_dot_task, &j);
    return LM_OK;
}

typedef struct var_job {
    float *key;
    const float *const *taus;
    int k, n_models;
    int64_t n;
} var_job;

#define VAR_RUN 256  // entries whose variances are made together, each step over all of them

// lm_tau_var of each entry, the same operations in the same order (so the same bits), made a run
// of entries at a time so that each step is a vector loop over the run.
LM_VECTOR_CLONES static void var_run(float *key, const float *const *taus, int k, int n, int64_t lo, int64_t cnt)
{
    double sum[VAR_RUN], mean[VAR_RUN], sq[VAR_RUN];
    for (int64_t e = 0; e < cnt; e++)
        sum[e] = 0;
    for (int i = 0; i < k; i++)
        for (int64_t e = 0; e < cnt; e++)
            sum[e] += taus[i][lo + e];
    for (int64_t e = 0; e < cnt; e++) {
        mean[e] = sum[e] / n;
        sq[e] = 0;
    }
    for (int i = 0; i < k; i++)
        for (int64_t e = 0; e < cnt; e++) {
            double d = taus[i][lo + e] - mean[e];
            sq[e] += d * d;
        }
    for (int64_t e = 0; e < cnt; e++)
        key[lo + e] = (float)((sq[e] + (double)(n - k) * (mean[e] * mean[e])) / n);
}

static void var_task(void *ctx, int64_t blk)
{
    var_job *j = ctx;
    int64_t lo = blk * BLOCK, hi = lo + BLOCK < j->n ? lo + BLOCK : j->n;
    for (int64_t e = lo; e < hi; e += VAR_RUN)
        var_run(j->key, j->taus, j->k, j->n_models, e, hi - e < VAR_RUN ? hi - e : VAR_RUN);
}

lm_status cpu_tau_var(lm_dev *d, float *key, const float *const *taus, int k, int n_models, int64_t n, lm_err *err)
{
    if (k < 0 || n_models < 1 || k > n_models)
        return lm_err_set(err, LM_ERR_USAGE, "cpu: tau_var of %d of %d models", k, n_models);
    var_job j = {key, taus, k, n_models, n};
    lm_pool_run(pool_of(d), n_blocks(n), var_task, &j);
    return LM_OK;
}

typedef struct della_job {
    float *x;
    int64_t rows, cols;
    uint64_t key;
    int64_t first;
    double p_lo, p_hi;
    bool inv;
    const double *p;        // (cols) lm_della_p of each rank, or NULL (made per entry)
    const uint64_t *below;  // (cols) lm_rng_threshold of each rank's p
    bool nomem;             // a task's scratch could not be allocated
} della_job;

#define RADIX_BITS 11
#define RADIX (1 << RADIX_BITS)
#define RADIX_PASSES 3  // 31 magnitude bits in digits of 11, 11 and 9

// Sorts n entries (magnitude bits << 32 | index) by their magnitude bits, stably (equal
// magnitudes keep their order), least significant digit first: the three digits' counts in
// one pass, and a pass skipped where every entry has the same digit. The sorted entries end in
// *out (v or tmp).
static void radix_sort(uint64_t *v, uint64_t *tmp, int64_t n, uint64_t **out)
{
    uint32_t count[RADIX_PASSES][RADIX];
    memset(count, 0, sizeof count);
    for (int64_t c = 0; c < n; c++)
        for (int q = 0; q < RADIX_PASSES; q++)
            count[q][(v[c] >> (32 + RADIX_BITS * q)) & (RADIX - 1)]++;
    for (int q = 0; q < RADIX_PASSES; q++) {
        int shift = 32 + RADIX_BITS * q;
        uint32_t *cnt = count[q];
        if (cnt[(v[0] >> shift) & (RADIX - 1)] == (uint32_t)n)
            continue;  // one digit for all: the order stands
        uint32_t sum = 0;
        for (int d = 0; d < RADIX; d++) {
            uint32_t t = cnt[d];
            cnt[d] = sum;
            sum += t;
        }
        for (int64_t c = 0; c < n; c++)
            tmp[cnt[(v[c] >> shift) & (RADIX - 1)]++] = v[c];
        uint64_t *t = v;
        v = tmp, tmp = t;
    }
    *out = v;
}

// u[c] = the draw of entry first + c (lm_rng_draw), for a row at once in index order, where the
// loop vectorises.
LM_VECTOR_CLONES static void della_draws(uint32_t *u, uint64_t key, int64_t first, int64_t n)
{
    for (int64_t c = 0; c < n; c++)
        u[c] = lm_rng_draw(key, first + c);
}

// Rows [r0, r1): each entry's rank from a stable sort of the row's magnitude bits (equal
// magnitudes in index order), then its keep test in rank order (lm_della_keep's: the entries
// dropped at once, the kept ones listed and scaled by 1/p after, so that the division is taken
// only where it is needed and the keep test has no branch).
static void della_task(void *ctx, int64_t t)
{
    della_job *j = ctx;
    int64_t per = (BLOCK + j->cols - 1) / j->cols;
    int64_t r1 = (t + 1) * per < j->rows ? (t + 1) * per : j->rows;
    uint64_t *buf = malloc((size_t)j->cols * 3 * sizeof *buf);
    uint32_t *u = malloc((size_t)j->cols * sizeof *u);
    if (!buf || !u) {
        free(buf);
        free(u);
        j->nomem = true;
        return;
    }
    for (int64_t r = t * per; r < r1; r++) {
        float *x = j->x + r * j->cols;
        uint64_t *v = buf, *kept = buf + 2 * j->cols, *sorted;
        int64_t first = j->first + r * j->cols, n_kept = 0;
        for (int64_t c = 0; c < j->cols; c++)
            v[c] = (uint64_t)lm_abs_bits(x[c]) << 32 | (uint64_t)c;
        radix_sort(v, buf + j->cols, j->cols, &sorted);
        della_draws(u, j->key, first, j->cols);
        for (int64_t rank = 0; rank < j->cols; rank++) {
            uint32_t c = (uint32_t)sorted[rank];
            uint64_t below = j->below ? j->below[rank] : lm_rng_threshold(lm_della_p(rank, j->cols, j->p_lo, j->p_hi));
            uint32_t keep = u[c] < below;  // lm_rng_keep's test; no branch, which would go either way
            x[c] = lm_bits_f32(lm_f32_bits(x[c]) & (0u - keep));
            kept[n_kept] = (uint64_t)rank << 32 | c;
            n_kept += keep;
        }
        for (int64_t q = 0; j->inv && q < n_kept; q++) {
            uint32_t c = (uint32_t)kept[q];
            int64_t rank = (int64_t)(kept[q] >> 32);
            double p = j->p ? j->p[rank] : lm_della_p(rank, j->cols, j->p_lo, j->p_hi);
            x[c] = (float)((double)x[c] / p);
        }
    }
    free(buf);
    free(u);
}

#define DELLA_TABLE_MAX (1 << 20)  // the longest rows whose p and thresholds are tabled

lm_status cpu_della_drop(lm_dev *d, float *x, int64_t rows, int64_t cols, uint64_t key, int64_t first, double p_lo,
                         double p_hi, bool inv, lm_err *err)
{
    if (cols > 0xFFFFFFFFll)
        return lm_err_set(err, LM_ERR_UNSUPPORTED, "cpu: della_drop of rows of %lld entries", (long long)cols);
    if (rows <= 0 || cols <= 0)
        return LM_OK;
    // Every row has the same p per rank: lm_della_p and its threshold once per call.
    double *p = cols <= DELLA_TABLE_MAX ? malloc((size_t)cols * sizeof *p) : NULL;
    uint64_t *below = p ? malloc((size_t)cols * sizeof *below) : NULL;
    if (!below) {
        free(p);
        p = NULL;
    }
    for (int64_t r = 0; below && r < cols; r++) {
        p[r] = lm_della_p(r, cols, p_lo, p_hi);
        below[r] = lm_rng_threshold(p[r]);
    }
    della_job j = {x, rows, cols, key, first, p_lo, p_hi, inv, p, below, false};
    int64_t per = (BLOCK + cols - 1) / cols;  // rows of about a block of entries per task
    lm_pool_run(pool_of(d), (rows + per - 1) / per, della_task, &j);
    free(p);
    free(below);
    return j.nomem ? lm_err_set(err, LM_ERR_NOMEM, "cpu: out of memory") : LM_OK;
}

typedef struct near_job {
    float *x;
    int64_t n;
    float t;
} near_job;

static void near_task(void *ctx, int64_t blk)
{
    near_job *j = ctx;
    int64_t lo = blk * BLOCK, hi = lo + BLOCK < j->n ? lo + BLOCK : j->n;
    for (int64_t i = lo; i < hi; i++)
        j->x[i] *= lm_nearswap_weight(j->x[i], j->t);
}

lm_status cpu_nearswap(lm_dev *d, float *x, int64_t n, float t, lm_err *err)
{
    (void)err;
    near_job j = {x, n, t};
    lm_pool_run(pool_of(d), n_blocks(n), near_task, &j);
    return LM_OK;
}
