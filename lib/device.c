// The device dispatcher: lm_dev_* forward to the backend's vtable and supply defaults for
// optional entries. It knows no backend: opening one by name is device_registry.c's. See
// device.h.
#include "device_impl.h"

#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sparsify.h"
#include "util.h"

// ==== the profile (LLMERGE_PROFILE) ===========================================================
// With LLMERGE_PROFILE set to anything but "" or "0", every operation below is waited for (the
// backend's sync) and counted: its calls and seconds, per device and operation, printed on
// standard error when the process exits. Waiting puts each operation's device work in its own
// seconds, and the rest of the run's time is the host's; it also takes away the overlap of the
// two, so the sums say where an unprofiled run spends its time, not how long it takes. An
// operation that calls others (a backend's own uploads, a default made of other operations)
// counts as one: the inner ones are neither waited for nor counted. Releases are timed but not
// waited for: a failed release is the next operation's to report, as without the profile.

#define PROF_ROWS 128  // (device, operation) rows: the last one counts whatever finds no row

typedef struct prof_row {
    char dev[32];
    const char *op;  // a string literal: compared by address
    uint64_t calls;
    double s;
} prof_row;

static pthread_once_t prof_once = PTHREAD_ONCE_INIT;
static bool prof_on;
static double prof_start;
static pthread_mutex_t prof_mu = PTHREAD_MUTEX_INITIALIZER;
static prof_row prof_rows[PROF_ROWS];
static int prof_n;                    // rows in use, the last one (others) included once used
static _Thread_local int prof_depth;  // operations of this thread under way

static int prof_by_seconds(const void *a, const void *b)
{
    double x = ((const prof_row *)a)->s, y = ((const prof_row *)b)->s;
    return (x < y) - (x > y);
}

static void prof_print(void)
{
    pthread_mutex_lock(&prof_mu);
    qsort(prof_rows, (size_t)prof_n, sizeof *prof_rows, prof_by_seconds);
    double total = 0;
    int w = 12;  // the device column's width
    for (int i = 0; i < prof_n; i++) {
        total += prof_rows[i].s;
        w = (int)strlen(prof_rows[i].dev) > w ? (int)strlen(prof_rows[i].dev) : w;
    }
    fprintf(stderr, "llmerge: profile (LLMERGE_PROFILE): %.3f s since the first device operation, %.3f s of them "
            "in the operations, each waited for:\n", lm_now() - prof_start, total);
    fprintf(stderr, "  %-*s %-16s %10s %10s\n", w, "device", "operation", "calls", "seconds");
    for (int i = 0; i < prof_n; i++)
        fprintf(stderr, "  %-*s %-16s %10" PRIu64 " %10.3f\n", w, prof_rows[i].dev, prof_rows[i].op,
                prof_rows[i].calls, prof_rows[i].s);
    pthread_mutex_unlock(&prof_mu);
}

static void prof_init(void)
{
    const char *v = getenv("LLMERGE_PROFILE");
    prof_on = v && *v && strcmp(v, "0") != 0;
    prof_start = lm_now();
    if (prof_on && atexit(prof_print) != 0)
        prof_on = false;
}

// The start of an operation's time: 0 where nothing is profiled, -1 inside another operation
// (not counted). Every call is followed by prof_end's.
static double prof_begin(void)
{
    pthread_once(&prof_once, prof_init);
    if (!prof_on)
        return 0;
    return prof_depth++ > 0 ? -1 : lm_now();
}

// The row of (dev, op), made where there is none; the caller holds prof_mu.
static prof_row *prof_row_of(const char *dev, const char *op)
{
    int i = 0;
    while (i < prof_n && (prof_rows[i].op != op || strcmp(prof_rows[i].dev, dev) != 0))
        i++;
    if (i < prof_n)
        return &prof_rows[i];
    if (prof_n == PROF_ROWS)  // full: the last row, (others), takes it
        return &prof_rows[PROF_ROWS - 1];
    prof_row *r = &prof_rows[prof_n++];
    snprintf(r->dev, sizeof r->dev, "%s", prof_n == PROF_ROWS ? "*" : dev);
    r->op = prof_n == PROF_ROWS ? "(others)" : op;
    return r;
}

// Counts operation op of d from t0, once the device has done it (the wait's failure becomes the
// operation's; err NULL: not waited for); returns s.
static lm_status prof_end(lm_dev *d, const char *op, double t0, lm_status s, lm_err *err)
{
    if (!prof_on)
        return s;
    prof_depth--;
    if (t0 < 0)
        return s;
    if (s == LM_OK && err)
        s = lm_dev_sync(d, err);
    double dt = lm_now() - t0;
    const char *dev = lm_dev_name(d);
    pthread_mutex_lock(&prof_mu);
    prof_row *r = prof_row_of(dev, op);
    r->calls++;
    r->s += dt;
    pthread_mutex_unlock(&prof_mu);
    return s;
}

void lm_dev_destroy(lm_dev *d)
{
    if (!d)
        return;
    lm_dev *companion = d->companion;
    d->iface->destroy(d);
    lm_dev_destroy(companion);
}

// ==== what a device can do =====================================================================

// The first vtable entry of group op that d lacks (its name), or NULL when d has them all. The
// fused dense operations and the counting conversions read host memory: they also need a
// device with host memory.
static const char *missing(const lm_dev *d, lm_op op)
{
    const lm_dev_i *i = d->iface;
    switch (op) {
    case LM_OP_SYRK:
        return i->syrk ? NULL : "syrk";
    case LM_OP_POTRF:
        return i->potrf ? NULL : "potrf";
    case LM_OP_IMPORTANCE:
        return !i->importance ? "importance" : !i->topk_apply_by ? "topk_apply_by" : NULL;
    case LM_OP_DENSE:
        return !d->host_memory ? "dense_hist (it needs host memory)" : !i->dense_hist ? "dense_hist"
               : !i->dense_merge ? "dense_merge" : NULL;
    case LM_OP_COUNTS:
        return !d->host_memory ? "to_f32_count (it needs host memory)" : !i->to_f32_count ? "to_f32_count"
               : !i->delta_count ? "delta_count" : !i->from_f32_count ? "from_f32_count" : NULL;
    case LM_OP_FORWARD: {
        struct { bool have; const char *name; } ops[] = {
            {i->gemm != NULL, "gemm"},           {i->gather_rows != NULL, "gather_rows"},
            {i->add_rows != NULL, "add_rows"},   {i->rmsnorm != NULL, "rmsnorm"},
            {i->rope != NULL, "rope"},           {i->attention != NULL, "attention"},
            {i->silu_mul != NULL, "silu_mul"},   {i->nll_rows != NULL, "nll_rows"},
        };
        for (size_t k = 0; k < sizeof ops / sizeof ops[0]; k++)
            if (!ops[k].have)
                return ops[k].name;
        return NULL;
    }
    }
    return "an unknown operation";
}

bool lm_dev_supports(const lm_dev *d, lm_op op)
{
    return missing(d, op) == NULL;
}

lm_status lm_dev_require(lm_dev *d, lm_op op, lm_err *err)
{
    const char *lacking = missing(d, op);
    if (!lacking)
        return LM_OK;
    return lm_err_set(err, LM_ERR_UNSUPPORTED, "%s: the operation %s is not implemented on this device",
                      lm_dev_name(d), lacking);
}

int lm_dev_threads(const lm_dev *d)
{
    return d->threads;
}

bool lm_dev_host_memory(const lm_dev *d)
{
    return d->host_memory;
}

// ==== memory and copies =======================================================================

const char *lm_dev_name(lm_dev *d)
{
    return d->iface->name(d);
}

void lm_dev_mem_info(lm_dev *d, size_t *free_bytes, size_t *total_bytes)
{
    d->iface->mem_info(d, free_bytes, total_bytes);
}

lm_status lm_dev_alloc(lm_dev *d, size_t size, void **ptr, lm_err *err)
{
    *ptr = NULL;
    if (size == 0)
        size = 1;  // a distinct non-NULL pointer for empty tensors
    double t0 = prof_begin();
    return prof_end(d, "alloc", t0, d->iface->alloc(d, size, ptr, err), err);
}

void lm_dev_buf_free(lm_dev *d, void *ptr)
{
    if (!ptr)
        return;
    double t0 = prof_begin();
    d->iface->buf_free(d, ptr);
    prof_end(d, "buf_free", t0, LM_OK, NULL);
}

lm_status lm_dev_upload(lm_dev *d, void *dst, const void *src, size_t n, lm_err *err)
{
    if (n == 0)
        return LM_OK;
    double t0 = prof_begin();
    return prof_end(d, "upload", t0, d->iface->upload(d, dst, src, n, err), err);
}

lm_status lm_dev_download(lm_dev *d, void *dst, const void *src, size_t n, lm_err *err)
{
    if (n == 0)
        return LM_OK;
    double t0 = prof_begin();
    return prof_end(d, "download", t0, d->iface->download(d, dst, src, n, err), err);
}

lm_status lm_dev_sync(lm_dev *d, lm_err *err)
{
    return d->iface->sync ? d->iface->sync(d, err) : LM_OK;
}

lm_status lm_dev_check(lm_dev *d, lm_err *err)
{
    return d->iface->check ? d->iface->check(d, err) : LM_OK;
}

lm_status lm_dev_to_f32(lm_dev *d, float *dst, const void *src, lm_dtype dt, int64_t n, lm_err *err)
{
    double t0 = prof_begin();
    return prof_end(d, "to_f32", t0, d->iface->to_f32(d, dst, src, dt, n, err), err);
}

lm_status lm_dev_from_f32(lm_dev *d, void *dst, lm_dtype dt, const float *src, int64_t n, lm_err *err)
{
    double t0 = prof_begin();
    return prof_end(d, "from_f32", t0, d->iface->from_f32(d, dst, dt, src, n, err), err);
}

lm_status lm_dev_gemm(lm_dev *d, bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha,
                      const float *a, int64_t lda, const float *b, int64_t ldb, float beta,
                      float *c, int64_t ldc, lm_err *err)
{
    double t0 = prof_begin();
    return prof_end(d, "gemm", t0, d->iface->gemm(d, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, err), err);
}

lm_status lm_dev_syrk(lm_dev *d, int64_t n, int64_t k, float alpha, const float *a, int64_t lda, float beta,
                      bool mirror, float *c, int64_t ldc, lm_err *err)
{
    if (!d->iface->syrk)
        return lm_err_set(err, LM_ERR_UNSUPPORTED, "%s: the operation syrk is not implemented on this device",
                          lm_dev_name(d));
    if (n < 0 || k < 0 || ldc < n || (k > 0 && lda < n))
        return lm_err_set(err, LM_ERR_USAGE, "syrk of n %lld, k %lld with lda %lld, ldc %lld", (long long)n,
                          (long long)k, (long long)lda, (long long)ldc);
    double t0 = prof_begin();
    return prof_end(d, "syrk", t0, d->iface->syrk(d, n, k, alpha, a, lda, beta, mirror, c, ldc, err), err);
}

lm_status lm_dev_axpby(lm_dev *d, float *y, float a, const float *x, float b, int64_t n, lm_err *err)
{
    double t0 = prof_begin();
    return prof_end(d, "axpby", t0, d->iface->axpby(d, y, a, x, b, n, err), err);
}

lm_status lm_dev_delta(lm_dev *d, float *tau, const void *src, lm_dtype dt, const float *base, int64_t n,
                       lm_err *err)
{
    double t0 = prof_begin();
    lm_status s;
    if (d->iface->delta)
        s = d->iface->delta(d, tau, src, dt, base, n, err);
    else if ((s = d->iface->to_f32(d, tau, src, dt, n, err)) == LM_OK)
        s = d->iface->axpby(d, tau, 1.0f, base, -1.0f, n, err);
    return prof_end(d, "delta", t0, s, err);
}

lm_status lm_dev_dora_rows(lm_dev *d, float *tau, const float *base, const float *magnitude,
                           int64_t rows, int64_t cols, lm_err *err)
{
    double t0 = prof_begin();
    return prof_end(d, "dora_rows", t0, d->iface->dora_rows(d, tau, base, magnitude, rows, cols, err), err);
}

lm_status lm_dev_hist_abs(lm_dev *d, uint64_t *hist, const float *x, int64_t n, int level,
                          uint32_t hi_bin, lm_err *err)
{
    double t0 = prof_begin();
    return prof_end(d, "hist_abs", t0, d->iface->hist_abs(d, hist, x, n, level, hi_bin, err), err);
}

// lm_dev_hist_window for a device without it: the level-0 histogram, then a level-1 one per bin.
static lm_status hist_window_by_levels(lm_dev *d, uint64_t *above, uint64_t *win, int n_win, uint32_t lo_bin,
                                       const float *x, int64_t n, lm_err *err)
{
    uint64_t *h = calloc(65536, sizeof *h);
    if (!h)
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory for a histogram");
    lm_status s = d->iface->hist_abs(d, h, x, n, 0, 0, err);
    for (uint64_t b = (uint64_t)lo_bin + (uint64_t)n_win; s == LM_OK && b < 65536; b++)
        *above += h[b];
    free(h);
    for (int w = 0; s == LM_OK && w < n_win; w++)
        s = d->iface->hist_abs(d, win + (size_t)w * 65536, x, n, 1, lo_bin + (uint32_t)w, err);
    return s;
}

lm_status lm_dev_hist_window(lm_dev *d, uint64_t *above, uint64_t *win, int n_win, uint32_t lo_bin, const float *x,
                             int64_t n, lm_err *err)
{
    if (n_win < 0 || n_win > LM_HIST_WINDOW)
        return lm_err_set(err, LM_ERR_USAGE, "hist_window: %d bins in the window, at most %d", n_win, LM_HIST_WINDOW);
    double t0 = prof_begin();
    lm_status s = d->iface->hist_window ? d->iface->hist_window(d, above, win, n_win, lo_bin, x, n, err)
                                        : hist_window_by_levels(d, above, win, n_win, lo_bin, x, n, err);
    return prof_end(d, "hist_window", t0, s, err);
}

lm_status lm_dev_topk_apply(lm_dev *d, float *x, int64_t n, uint32_t thr_bits, int64_t ties_allowed,
                            int64_t *ties_used, lm_err *err)
{
    double t0 = prof_begin();
    return prof_end(d, "topk_apply", t0, d->iface->topk_apply(d, x, n, thr_bits, ties_allowed, ties_used, err), err);
}

lm_status lm_dev_topk_drop(lm_dev *d, float *x, int64_t n, uint32_t thr_bits, int64_t ties_allowed,
                           int64_t *ties_used, lm_err *err)
{
    double t0 = prof_begin();
    return prof_end(d, "topk_drop", t0, d->iface->topk_drop(d, x, n, thr_bits, ties_allowed, ties_used, err), err);
}

lm_status lm_dev_topk_apply_by(lm_dev *d, float *x, const float *key, int64_t n, uint32_t thr_bits,
                               int64_t ties_allowed, int64_t *ties_used, lm_err *err)
{
    if (!d->iface->topk_apply_by)
        return lm_err_set(err, LM_ERR_UNSUPPORTED, "%s: no topk_apply_by (selection by importance)", lm_dev_name(d));
    double t0 = prof_begin();
    return prof_end(d, "topk_apply_by", t0,
                    d->iface->topk_apply_by(d, x, key, n, thr_bits, ties_allowed, ties_used, err), err);
}

lm_status lm_dev_potrf(lm_dev *d, double *a, int64_t n, double *diag, lm_err *err)
{
    if (!d->iface->potrf)
        return lm_err_set(err, LM_ERR_UNSUPPORTED, "%s: no Cholesky factorisation", lm_dev_name(d));
    if (n < 0 || n > INT32_MAX)
        return lm_err_set(err, LM_ERR_UNSUPPORTED, "%s: a Cholesky factorisation of order %" PRId64, lm_dev_name(d), n);
    if (n == 0)
        return LM_OK;
    double t0 = prof_begin();
    return prof_end(d, "potrf", t0, d->iface->potrf(d, a, n, diag, err), err);
}

lm_status lm_dev_importance(lm_dev *d, float *key, const float *tau, const double *ucc2, int64_t rows, int64_t cols,
                            lm_err *err)
{
    if (!d->iface->importance)
        return lm_err_set(err, LM_ERR_UNSUPPORTED, "%s: no importance operation", lm_dev_name(d));
    double t0 = prof_begin();
    return prof_end(d, "importance", t0, d->iface->importance(d, key, tau, ucc2, rows, cols, err), err);
}

// The default mask operations for a device without them: x comes to the host in pieces of
// MASK_PIECE elements (and, for apply, goes back).
#define MASK_PIECE (1 << 20)

static void mask_get_host(uint8_t *bits, int64_t first, const float *x, int64_t n)
{
    for (int64_t j = 0; j < n; j++) {
        int64_t b = first + j;
        uint8_t m = (uint8_t)(1u << (b & 7));
        bits[b >> 3] = x[j] != 0.0f ? (uint8_t)(bits[b >> 3] | m) : (uint8_t)(bits[b >> 3] & ~m);
    }
}

static void mask_apply_host(float *x, const uint8_t *bits, int64_t first, int64_t n)
{
    for (int64_t j = 0; j < n; j++) {
        int64_t b = first + j;
        if (!(bits[b >> 3] >> (b & 7) & 1))
            x[j] = 0.0f;
    }
}

static lm_status mask_by_pieces(lm_dev *d, float *x, uint8_t *get_bits, const uint8_t *apply_bits, int64_t first,
                                int64_t n, lm_err *err)
{
    if (n < 0 || first < 0)
        return lm_err_set(err, LM_ERR_USAGE, "mask of %lld elements from %lld", (long long)n, (long long)first);
    if (d->host_memory) {
        if (get_bits)
            mask_get_host(get_bits, first, x, n);
        else
            mask_apply_host(x, apply_bits, first, n);
        return LM_OK;
    }
    float *piece = malloc((size_t)(n < MASK_PIECE ? (n ? n : 1) : MASK_PIECE) * sizeof *piece);
    if (!piece)
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory for a mask piece");
    lm_status s = LM_OK;
    for (int64_t off = 0; s == LM_OK && off < n; off += MASK_PIECE) {
        int64_t cnt = n - off < MASK_PIECE ? n - off : MASK_PIECE;
        size_t bytes = (size_t)cnt * sizeof *piece;
        if ((s = lm_dev_download(d, piece, x + off, bytes, err)) != LM_OK)
            break;
        if (get_bits) {
            mask_get_host(get_bits, first + off, piece, cnt);
        } else {
            mask_apply_host(piece, apply_bits, first + off, cnt);
            s = lm_dev_upload(d, x + off, piece, bytes, err);
        }
    }
    free(piece);
    return s;
}

lm_status lm_dev_mask_get(lm_dev *d, uint8_t *bits, int64_t first, const float *x, int64_t n, lm_err *err)
{
    double t0 = prof_begin();
    lm_status s = d->iface->mask_get ? d->iface->mask_get(d, bits, first, x, n, err)
                                     : mask_by_pieces(d, (float *)x, bits, NULL, first, n, err);
    return prof_end(d, "mask_get", t0, s, err);
}

lm_status lm_dev_mask_apply(lm_dev *d, float *x, const uint8_t *bits, int64_t first, int64_t n, lm_err *err)
{
    double t0 = prof_begin();
    lm_status s = d->iface->mask_apply ? d->iface->mask_apply(d, x, bits, first, n, err)
                                       : mask_by_pieces(d, x, NULL, bits, first, n, err);
    return prof_end(d, "mask_apply", t0, s, err);
}

lm_status lm_dev_random_drop(lm_dev *d, float *x, int64_t n, uint64_t key, int64_t first,
                             uint64_t keep_below, lm_err *err)
{
    double t0 = prof_begin();
    return prof_end(d, "random_drop", t0, d->iface->random_drop(d, x, n, key, first, keep_below, err), err);
}

lm_status lm_dev_l1(lm_dev *d, const float *x, int64_t n, double *out, lm_err *err)
{
    double t0 = prof_begin();
    return prof_end(d, "l1", t0, d->iface->l1(d, x, n, out, err), err);
}

lm_status lm_dev_row_dot(lm_dev *d, const float *x, const float *y, int64_t rows, int64_t cols, double *out,
                         lm_err *err)
{
    double t0 = prof_begin();
    return prof_end(d, "row_dot", t0, d->iface->row_dot(d, x, y, rows, cols, out, err), err);
}

lm_status lm_dev_col_dot(lm_dev *d, const float *x, const float *y, int64_t rows, int64_t cols, double *acc,
                         lm_err *err)
{
    double t0 = prof_begin();
    return prof_end(d, "col_dot", t0, d->iface->col_dot(d, x, y, rows, cols, acc, err), err);
}

lm_status lm_dev_col_axpby(lm_dev *d, float *y, const float *a, const float *x, const float *b, int64_t rows,
                           int64_t cols, lm_err *err)
{
    double t0 = prof_begin();
    return prof_end(d, "col_axpby", t0, d->iface->col_axpby(d, y, a, x, b, rows, cols, err), err);
}

lm_status lm_dev_tau_var(lm_dev *d, float *key, const float *const *taus, int k, int n_models, int64_t n,
                         lm_err *err)
{
    double t0 = prof_begin();
    return prof_end(d, "tau_var", t0, d->iface->tau_var(d, key, taus, k, n_models, n, err), err);
}

lm_status lm_dev_row_axpby(lm_dev *d, float *y, const float *a, const float *x, const float *b, int64_t rows,
                           int64_t cols, lm_err *err)
{
    double t0 = prof_begin();
    return prof_end(d, "row_axpby", t0, d->iface->row_axpby(d, y, a, x, b, rows, cols, err), err);
}

lm_status lm_dev_della_drop(lm_dev *d, float *x, int64_t rows, int64_t cols, uint64_t key, int64_t first, double p_lo,
                            double p_hi, bool inv, lm_err *err)
{
    double t0 = prof_begin();
    return prof_end(d, "della_drop", t0, d->iface->della_drop(d, x, rows, cols, key, first, p_lo, p_hi, inv, err), err);
}

lm_status lm_dev_nearswap(lm_dev *d, float *x, int64_t n, float t, lm_err *err)
{
    double t0 = prof_begin();
    return prof_end(d, "nearswap", t0, d->iface->nearswap(d, x, n, t, err), err);
}

lm_status lm_dev_combine(lm_dev *d, float *out, const float *base, const float *const *w_tau,
                         const float *weights, int k, int64_t n, lm_combine_how how, lm_err *err)
{
    double t0 = prof_begin();
    return prof_end(d, "combine", t0,
                    d->iface->combine(d, out, base, w_tau, weights, k, n, how.sign, how.normalize, how.lambda, err),
                    err);
}

// ==== fused dense operations ==================================================================

lm_status lm_dev_dense_gram(lm_dev *d, const void *base, lm_dtype base_dt, lm_dense_part *parts, int k, int64_t rows,
                            int64_t cols, double *out, lm_err *err)
{
    if (!lm_dev_supports(d, LM_OP_DENSE) || !d->iface->dense_gram)
        return lm_err_set(err, LM_ERR_UNSUPPORTED, "%s: no fused dense Gram pass", lm_dev_name(d));
    double t0 = prof_begin();
    return prof_end(d, "dense_gram", t0, d->iface->dense_gram(d, base, base_dt, parts, k, rows, cols, out, err), err);
}

lm_status lm_dev_dense_hist(lm_dev *d, const void *base, lm_dtype base_dt, lm_dense_part *parts, int k, int64_t n,
                            lm_err *err)
{
    if (!lm_dev_supports(d, LM_OP_DENSE))
        return lm_err_set(err, LM_ERR_UNSUPPORTED, "%s: no fused dense operations", lm_dev_name(d));
    for (int i = 0; i < k; i++)
        if (parts[i].win && (parts[i].n_win < 1 || parts[i].n_win > LM_HIST_WINDOW))
            return lm_err_set(err, LM_ERR_USAGE, "dense_hist: %d bins in the window, 1 to %d", parts[i].n_win,
                              LM_HIST_WINDOW);
    double t0 = prof_begin();
    return prof_end(d, "dense_hist", t0, d->iface->dense_hist(d, base, base_dt, parts, k, n, err), err);
}

lm_status lm_dev_dense_merge(lm_dev *d, void *out, lm_dtype out_dt, const void *base, lm_dtype base_dt,
                             lm_dense_part *parts, int k, int64_t n, lm_combine_how how, lm_err *err)
{
    return lm_dev_dense_merge_side(d, out, out_dt, base, base_dt, parts, k, n, how, NULL, err);
}

lm_status lm_dev_dense_merge_side(lm_dev *d, void *out, lm_dtype out_dt, const void *base, lm_dtype base_dt,
                                  lm_dense_part *parts, int k, int64_t n, lm_combine_how how,
                                  const lm_dev_side *side, lm_err *err)
{
    if (!lm_dev_supports(d, LM_OP_DENSE)) {
        if (side)
            side->fn(side->ctx);
        return lm_err_set(err, LM_ERR_UNSUPPORTED, "%s: no fused dense operations", lm_dev_name(d));
    }
    double t0 = prof_begin();
    return prof_end(d, "dense_merge", t0,
                    d->iface->dense_merge(d, out, out_dt, base, base_dt, parts, k, n, how, side, err), err);
}

// ==== counting conversions ====================================================================

static lm_status no_counts(lm_dev *d, lm_err *err)
{
    return lm_err_set(err, LM_ERR_UNSUPPORTED, "%s: no counting conversions", lm_dev_name(d));
}

lm_status lm_dev_to_f32_count(lm_dev *d, float *dst, const void *src, lm_dtype dt, int64_t n, lm_nonfinite *nf,
                              lm_err *err)
{
    if (!lm_dev_supports(d, LM_OP_COUNTS))
        return no_counts(d, err);
    double t0 = prof_begin();
    return prof_end(d, "to_f32_count", t0, d->iface->to_f32_count(d, dst, src, dt, n, nf, err), err);
}

lm_status lm_dev_delta_count(lm_dev *d, float *tau, const void *src, lm_dtype dt, const float *base, int64_t n,
                             lm_nonfinite *nf, lm_err *err)
{
    if (!lm_dev_supports(d, LM_OP_COUNTS))
        return no_counts(d, err);
    double t0 = prof_begin();
    return prof_end(d, "delta_count", t0, d->iface->delta_count(d, tau, src, dt, base, n, nf, err), err);
}

lm_status lm_dev_from_f32_count(lm_dev *d, void *dst, lm_dtype dt, const float *src, int64_t n, lm_nonfinite *nf,
                                lm_err *err)
{
    if (!lm_dev_supports(d, LM_OP_COUNTS))
        return no_counts(d, err);
    double t0 = prof_begin();
    return prof_end(d, "from_f32_count", t0, d->iface->from_f32_count(d, dst, dt, src, n, nf, err), err);
}

// ==== forward-pass operations =================================================================
// Optional entries: a device without one says which operation it lacks.

static lm_status lacks(lm_dev *d, const char *op, lm_err *err)
{
    return lm_err_set(err, LM_ERR_UNSUPPORTED, "%s: the operation %s is not implemented on this device",
                      lm_dev_name(d), op);
}

lm_status lm_dev_gather_rows(lm_dev *d, float *out, const float *table, int64_t table_rows, int64_t cols,
                             const int32_t *ids, int64_t n, lm_err *err)
{
    if (!d->iface->gather_rows)
        return lacks(d, "gather_rows", err);
    double t0 = prof_begin();
    return prof_end(d, "gather_rows", t0, d->iface->gather_rows(d, out, table, table_rows, cols, ids, n, err), err);
}

lm_status lm_dev_add_rows(lm_dev *d, float *y, const float *b, int64_t rows, int64_t cols, lm_err *err)
{
    if (!d->iface->add_rows)
        return lacks(d, "add_rows", err);
    double t0 = prof_begin();
    return prof_end(d, "add_rows", t0, d->iface->add_rows(d, y, b, rows, cols, err), err);
}

lm_status lm_dev_rmsnorm(lm_dev *d, float *out, const float *x, const float *w, int64_t rows, int64_t cols,
                         float eps, lm_err *err)
{
    if (!d->iface->rmsnorm)
        return lacks(d, "rmsnorm", err);
    double t0 = prof_begin();
    return prof_end(d, "rmsnorm", t0, d->iface->rmsnorm(d, out, x, w, rows, cols, eps, err), err);
}

lm_status lm_dev_rope(lm_dev *d, float *x, int64_t rows, int64_t heads, int64_t head_dim, const int32_t *pos,
                      const float *inv_freq, lm_err *err)
{
    if (!d->iface->rope)
        return lacks(d, "rope", err);
    double t0 = prof_begin();
    return prof_end(d, "rope", t0, d->iface->rope(d, x, rows, heads, head_dim, pos, inv_freq, err), err);
}

lm_status lm_dev_attention(lm_dev *d, float *out, const float *q, const float *k, const float *v,
                           const int32_t *start, int64_t rows, int64_t heads, int64_t kv_heads,
                           int64_t head_dim, float scale, lm_err *err)
{
    if (!d->iface->attention)
        return lacks(d, "attention", err);
    double t0 = prof_begin();
    return prof_end(d, "attention", t0,
                    d->iface->attention(d, out, q, k, v, start, rows, heads, kv_heads, head_dim, scale, err), err);
}

lm_status lm_dev_silu_mul(lm_dev *d, float *gate, const float *up, int64_t n, lm_err *err)
{
    if (!d->iface->silu_mul)
        return lacks(d, "silu_mul", err);
    double t0 = prof_begin();
    return prof_end(d, "silu_mul", t0, d->iface->silu_mul(d, gate, up, n, err), err);
}

lm_status lm_dev_nll_rows(lm_dev *d, float *nll, const float *logits, const int32_t *targets, int64_t rows,
                          int64_t cols, lm_err *err)
{
    if (!d->iface->nll_rows)
        return lacks(d, "nll_rows", err);
    double t0 = prof_begin();
    return prof_end(d, "nll_rows", t0, d->iface->nll_rows(d, nll, logits, targets, rows, cols, err), err);
}
