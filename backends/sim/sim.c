// The simulated accelerator, sim:SIZE: the device interface as CUDA presents it, on a machine
// without a GPU. Its buffers are host memory of its own, reachable only through upload and
// download (host_memory is false), and their sizes add up against a hard budget: an allocation
// that would go over is LM_ERR_DEVICE_OOM, so every fallback path runs in tests. Each operation
// first checks that every device pointer it was given lies, with its whole extent, inside one
// live buffer, and then runs the CPU backend's operation, so results are bit-identical to
// --device cpu while a caller that hands host memory to an accelerator fails here with a
// message instead of crashing on CUDA. A fault switch ("alloc:N", "launch:N") makes the Nth
// allocation or operation fail with LM_ERR_DEVICE, for the paths that must not fall back.
//
// The device's name is "sim:" and the budget in the largest binary unit that divides it
// ("sim:1GiB", "sim:1536MiB", "sim:1000"), which lm_parse_size reads back.
//
// An operation added to lm_dev_i needs an entry here too: test_sim checks that no entry of
// sim_iface is NULL.
#include "device_impl.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "util.h"

typedef struct sim_buf {
    char *p;
    size_t size;  // bytes asked for (the block behind p is rounded up to 64)
} sim_buf;

typedef struct sim_ctx {
    lm_dev *cpu;            // runs every operation
    uint64_t budget, used;  // bytes
    sim_buf *bufs;          // (n_bufs) live allocations, in no order
    size_t n_bufs, cap_bufs;
    enum { FAIL_NONE, FAIL_ALLOC, FAIL_LAUNCH } fail;  // the fault switch
    uint64_t fail_at;       // its N
    uint64_t allocs, ops;   // calls so far, for the fault switch
    const void *bad_free;   // a pointer lm_dev_buf_free was given that is no sim buffer
    const char *op;         // the operation being checked, for messages
    char name[32];
} sim_ctx;

static lm_dev *cpu_of(lm_dev *d)
{
    return ((sim_ctx *)d->ctx)->cpu;
}

// ==== memory ==================================================================================

static const char *sim_name(lm_dev *d)
{
    return ((sim_ctx *)d->ctx)->name;
}

static void sim_mem_info(lm_dev *d, size_t *free_bytes, size_t *total_bytes)
{
    sim_ctx *c = d->ctx;
    *free_bytes = (size_t)(c->budget - c->used);
    *total_bytes = (size_t)c->budget;
}

static lm_status sim_alloc(lm_dev *d, size_t size, void **ptr, lm_err *err)
{
    sim_ctx *c = d->ctx;
    *ptr = NULL;
    c->allocs++;
    if (c->fail == FAIL_ALLOC && c->allocs == c->fail_at)
        return lm_err_set(err, LM_ERR_DEVICE, "sim: injected failure of allocation %llu "
                          "(LLMERGE_SIM_FAIL=alloc:%llu)", (unsigned long long)c->allocs,
                          (unsigned long long)c->fail_at);
    char want[32], used[32], total[32];
    if (size > c->budget - c->used)
        return lm_err_set(err, LM_ERR_DEVICE_OOM, "%s: out of memory allocating %s (%s of %s in use)", c->name,
                          lm_format_bytes(want, sizeof want, size), lm_format_bytes(used, sizeof used, c->used),
                          lm_format_bytes(total, sizeof total, c->budget));
    if (c->n_bufs == c->cap_bufs) {
        size_t cap = c->cap_bufs ? 2 * c->cap_bufs : 16;
        sim_buf *b = realloc(c->bufs, cap * sizeof *b);
        if (!b)
            return lm_err_set(err, LM_ERR_NOMEM, "%s: out of memory for its buffer table", c->name);
        c->bufs = b;
        c->cap_bufs = cap;
    }
    // The simulated memory is the host's: when the host cannot give it, the device is full.
    size_t rounded = (size + 63) & ~(size_t)63;
    char *p = rounded >= size ? aligned_alloc(64, rounded) : NULL;
    if (!p)
        return lm_err_set(err, LM_ERR_DEVICE_OOM, "%s: out of memory allocating %s (the host has no room for it)",
                          c->name, lm_format_bytes(want, sizeof want, size));
    c->bufs[c->n_bufs++] = (sim_buf){p, size};
    c->used += size;
    *ptr = p;
    return LM_OK;
}

static void sim_free(lm_dev *d, void *ptr)
{
    sim_ctx *c = d->ctx;
    for (size_t i = 0; i < c->n_bufs; i++) {
        if (c->bufs[i].p == ptr) {
            c->used -= c->bufs[i].size;
            free(ptr);
            c->bufs[i] = c->bufs[--c->n_bufs];
            return;
        }
    }
    // Not ours (a host pointer, or freed twice): free cannot fail, so the next operation does,
    // as a CUDA error would surface at the next call.
    c->bad_free = ptr;
}

static void sim_destroy(lm_dev *d)
{
    sim_ctx *c = d->ctx;
    if (c) {
        for (size_t i = 0; i < c->n_bufs; i++)
            free(c->bufs[i].p);
        free(c->bufs);
        lm_dev_destroy(c->cpu);
    }
    free(c);
    free(d);
}

// ==== checks ==================================================================================

// Starts operation `op`: counts it for the fault switch and reports a bad free seen earlier.
static lm_status begin(lm_dev *d, const char *op, lm_err *err)
{
    sim_ctx *c = d->ctx;
    c->op = op;
    c->ops++;
    if (c->fail == FAIL_LAUNCH && c->ops == c->fail_at)
        return lm_err_set(err, LM_ERR_DEVICE, "sim: injected failure of operation %llu, %s "
                          "(LLMERGE_SIM_FAIL=launch:%llu)", (unsigned long long)c->ops, op,
                          (unsigned long long)c->fail_at);
    if (c->bad_free) {
        const void *p = c->bad_free;
        c->bad_free = NULL;
        return lm_err_set(err, LM_ERR_DEVICE, "sim: %s: an earlier release was given %p, which is not a live sim "
                          "buffer", op, p);
    }
    return LM_OK;
}

// Checks that [p, p + bytes) lies inside one live buffer; an empty extent too needs a pointer
// the device gave out. Addresses are compared as integers: p may point anywhere, and that is
// what is being found out.
static lm_status need(lm_dev *d, const char *arg, const void *p, uint64_t bytes, lm_err *err)
{
    sim_ctx *c = d->ctx;
    uintptr_t a = (uintptr_t)p;
    const sim_buf *near = NULL;
    for (size_t i = 0; i < c->n_bufs; i++) {
        uintptr_t lo = (uintptr_t)c->bufs[i].p;
        if (a < lo || a - lo > c->bufs[i].size)
            continue;
        if (bytes <= c->bufs[i].size - (a - lo))
            return LM_OK;
        near = &c->bufs[i];
    }
    if (!near)
        return lm_err_set(err, LM_ERR_DEVICE, "sim: %s was given memory that is not a sim buffer (%s: %p is in no "
                          "live allocation)", c->op, arg, p);
    return lm_err_set(err, LM_ERR_DEVICE, "sim: %s was given memory that is not a sim buffer (%s: %llu bytes at "
                      "offset %llu run past the end of a buffer of %llu bytes)", c->op, arg,
                      (unsigned long long)bytes, (unsigned long long)(a - (uintptr_t)near->p),
                      (unsigned long long)near->size);
}

// Checks that p, which the operation reads or writes on the host, is not in a sim buffer: the
// opposite mistake, which crashes on CUDA just the same.
static lm_status host(lm_dev *d, const char *arg, const void *p, lm_err *err)
{
    sim_ctx *c = d->ctx;
    for (size_t i = 0; i < c->n_bufs; i++)
        if ((uintptr_t)p - (uintptr_t)c->bufs[i].p < c->bufs[i].size)
            return lm_err_set(err, LM_ERR_DEVICE, "sim: %s was given a sim buffer where host memory belongs "
                              "(%s: %p)", c->op, arg, p);
    return LM_OK;
}

// need() for n elements of `bits` bits each.
static lm_status need_n(lm_dev *d, const char *arg, const void *p, int64_t n, unsigned bits, lm_err *err)
{
    uint64_t b;
    if (n < 0 || !lm_mul_u64((uint64_t)n, bits, &b))
        return lm_err_set(err, LM_ERR_DEVICE, "sim: %s was given an invalid count %lld for %s",
                          ((sim_ctx *)d->ctx)->op, (long long)n, arg);
    return need(d, arg, p, b / 8 + (b % 8 != 0), err);
}

// The elements a row-major rows × cols matrix with row stride ld spans; -1 when the shape is
// invalid or the stride shorter than a row.
static int64_t mat_extent(int64_t rows, int64_t cols, int64_t ld)
{
    int64_t e;
    if (rows < 0 || cols < 0)
        return -1;
    if (rows == 0 || cols == 0)
        return 0;
    if (ld < cols || __builtin_mul_overflow(rows - 1, ld, &e) || __builtin_add_overflow(e, cols, &e))
        return -1;
    return e;
}

// ==== copies ==================================================================================

static lm_status sim_upload(lm_dev *d, void *dst, const void *src, size_t n, lm_err *err)
{
    lm_status s;
    if ((s = begin(d, "upload", err)) || (s = need(d, "dst", dst, n, err)) || (s = host(d, "src", src, err)))
        return s;
    return cpu_of(d)->iface->upload(cpu_of(d), dst, src, n, err);
}

static lm_status sim_download(lm_dev *d, void *dst, const void *src, size_t n, lm_err *err)
{
    lm_status s;
    if ((s = begin(d, "download", err)) || (s = need(d, "src", src, n, err)) || (s = host(d, "dst", dst, err)))
        return s;
    return cpu_of(d)->iface->download(cpu_of(d), dst, src, n, err);
}

static lm_status sim_sync(lm_dev *d, lm_err *err)
{
    return begin(d, "sync", err);
}

// lm_dev_check: a bad release seen earlier, as begin reports it. Not an operation: the fault
// switch does not count it.
static lm_status sim_check(lm_dev *d, lm_err *err)
{
    sim_ctx *c = d->ctx;
    if (!c->bad_free)
        return LM_OK;
    const void *p = c->bad_free;
    c->bad_free = NULL;
    return lm_err_set(err, LM_ERR_DEVICE, "sim: check: an earlier release was given %p, which is not a live sim buffer",
                      p);
}

// ==== operations ==============================================================================

static lm_status sim_to_f32(lm_dev *d, float *dst, const void *src, lm_dtype dt, int64_t n, lm_err *err)
{
    lm_status s;
    if ((s = begin(d, "to_f32", err)) || (s = need_n(d, "dst", dst, n, 32, err)) ||
        (s = need_n(d, "src", src, n, lm_dtype_bits(dt), err)))
        return s;
    return cpu_of(d)->iface->to_f32(cpu_of(d), dst, src, dt, n, err);
}

static lm_status sim_from_f32(lm_dev *d, void *dst, lm_dtype dt, const float *src, int64_t n, lm_err *err)
{
    lm_status s;
    if ((s = begin(d, "from_f32", err)) || (s = need_n(d, "dst", dst, n, lm_dtype_bits(dt), err)) ||
        (s = need_n(d, "src", src, n, 32, err)))
        return s;
    return cpu_of(d)->iface->from_f32(cpu_of(d), dst, dt, src, n, err);
}

static lm_status sim_gemm(lm_dev *d, bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha,
                          const float *a, int64_t lda, const float *b, int64_t ldb, float beta,
                          float *c, int64_t ldc, lm_err *err)
{
    lm_status s;
    if ((s = begin(d, "gemm", err)))
        return s;
    // A is stored [m,k] or, transposed, [k,m]; B [k,n] or [n,k]; C [m,n].
    int64_t ea = ta ? mat_extent(k, m, lda) : mat_extent(m, k, lda);
    int64_t eb = tb ? mat_extent(n, k, ldb) : mat_extent(k, n, ldb);
    int64_t ec = mat_extent(m, n, ldc);
    if (ea < 0 || eb < 0 || ec < 0)
        return lm_err_set(err, LM_ERR_DEVICE, "sim: gemm was given an invalid shape (m %lld, n %lld, k %lld, "
                          "lda %lld, ldb %lld, ldc %lld)", (long long)m, (long long)n, (long long)k,
                          (long long)lda, (long long)ldb, (long long)ldc);
    if ((s = need_n(d, "a", a, ea, 32, err)) || (s = need_n(d, "b", b, eb, 32, err)) ||
        (s = need_n(d, "c", c, ec, 32, err)))
        return s;
    return cpu_of(d)->iface->gemm(cpu_of(d), ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, err);
}

static lm_status sim_syrk(lm_dev *d, int64_t n, int64_t k, float alpha, const float *a, int64_t lda, float beta,
                          bool mirror, float *c, int64_t ldc, lm_err *err)
{
    lm_status s;
    if ((s = begin(d, "syrk", err)))
        return s;
    // A is stored [k,n] (not read when k is 0), C [n,n].
    int64_t ea = k > 0 ? mat_extent(k, n, lda) : 0, ec = mat_extent(n, n, ldc);
    if (ea < 0 || ec < 0)
        return lm_err_set(err, LM_ERR_DEVICE, "sim: syrk was given an invalid shape (n %lld, k %lld, lda %lld, "
                          "ldc %lld)", (long long)n, (long long)k, (long long)lda, (long long)ldc);
    if ((k > 0 && (s = need_n(d, "a", a, ea, 32, err))) || (s = need_n(d, "c", c, ec, 32, err)))
        return s;
    return cpu_of(d)->iface->syrk(cpu_of(d), n, k, alpha, a, lda, beta, mirror, c, ldc, err);
}

static lm_status sim_axpby(lm_dev *d, float *y, float a, const float *x, float b, int64_t n, lm_err *err)
{
    lm_status s;
    if ((s = begin(d, "axpby", err)) || (s = need_n(d, "y", y, n, 32, err)) || (s = need_n(d, "x", x, n, 32, err)))
        return s;
    return cpu_of(d)->iface->axpby(cpu_of(d), y, a, x, b, n, err);
}

static lm_status sim_delta(lm_dev *d, float *tau, const void *src, lm_dtype dt, const float *base, int64_t n,
                           lm_err *err)
{
    lm_status s;
    if ((s = begin(d, "delta", err)) || (s = need_n(d, "tau", tau, n, 32, err)) ||
        (s = need_n(d, "src", src, n, lm_dtype_bits(dt), err)) || (s = need_n(d, "base", base, n, 32, err)))
        return s;
    return cpu_of(d)->iface->delta(cpu_of(d), tau, src, dt, base, n, err);
}

static lm_status sim_dora_rows(lm_dev *d, float *tau, const float *base, const float *magnitude,
                               int64_t rows, int64_t cols, lm_err *err)
{
    lm_status s;
    int64_t n = mat_extent(rows, cols, cols);
    if ((s = begin(d, "dora_rows", err)) || (s = need_n(d, "tau", tau, n, 32, err)) ||
        (s = need_n(d, "base", base, n, 32, err)) || (s = need_n(d, "magnitude", magnitude, rows, 32, err)))
        return s;
    return cpu_of(d)->iface->dora_rows(cpu_of(d), tau, base, magnitude, rows, cols, err);
}

// hist is a host array, x device memory.
static lm_status sim_hist_abs(lm_dev *d, uint64_t *hist, const float *x, int64_t n, int level,
                              uint32_t hi_bin, lm_err *err)
{
    lm_status s;
    if ((s = begin(d, "hist_abs", err)) || (s = need_n(d, "x", x, n, 32, err)) || (s = host(d, "hist", hist, err)))
        return s;
    return cpu_of(d)->iface->hist_abs(cpu_of(d), hist, x, n, level, hi_bin, err);
}

static lm_status sim_hist_window(lm_dev *d, uint64_t *above, uint64_t *win, int n_win, uint32_t lo_bin,
                                 const float *x, int64_t n, lm_err *err)
{
    lm_status s;
    if ((s = begin(d, "hist_window", err)) || (s = need_n(d, "x", x, n, 32, err)) ||
        (s = host(d, "above", above, err)) || (s = host(d, "win", win, err)))
        return s;
    return cpu_of(d)->iface->hist_window(cpu_of(d), above, win, n_win, lo_bin, x, n, err);
}

static lm_status sim_topk_apply_by(lm_dev *d, float *x, const float *key, int64_t n, uint32_t thr_bits,
                                   int64_t ties_allowed, int64_t *ties_used, lm_err *err)
{
    lm_status s;
    if ((s = begin(d, "topk_apply_by", err)) || (s = need_n(d, "x", x, n, 32, err)) ||
        (s = need_n(d, "key", key, n, 32, err)) || (s = host(d, "ties_used", ties_used, err)))
        return s;
    return cpu_of(d)->iface->topk_apply_by(cpu_of(d), x, key, n, thr_bits, ties_allowed, ties_used, err);
}

static lm_status sim_importance(lm_dev *d, float *key, const float *tau, const double *ucc2, int64_t rows,
                                int64_t cols, lm_err *err)
{
    lm_status s;
    if ((s = begin(d, "importance", err)) || (s = need_n(d, "key", key, rows * cols, 32, err)) ||
        (s = need_n(d, "tau", tau, rows * cols, 32, err)) || (s = need_n(d, "ucc2", ucc2, cols, 64, err)))
        return s;
    return cpu_of(d)->iface->importance(cpu_of(d), key, tau, ucc2, rows, cols, err);
}

static lm_status sim_potrf(lm_dev *d, double *a, int64_t n, double *diag, lm_err *err)
{
    lm_status s;
    if ((s = begin(d, "potrf", err)) || (s = need_n(d, "a", a, n * n, 64, err)) ||
        (s = need_n(d, "diag", diag, n, 64, err)))
        return s;
    return cpu_of(d)->iface->potrf(cpu_of(d), a, n, diag, err);
}

// bits are host memory, x device memory.
static lm_status sim_mask_get(lm_dev *d, uint8_t *bits, int64_t first, const float *x, int64_t n, lm_err *err)
{
    lm_status s;
    if ((s = begin(d, "mask_get", err)) || (s = need_n(d, "x", x, n, 32, err)) || (s = host(d, "bits", bits, err)))
        return s;
    return cpu_of(d)->iface->mask_get(cpu_of(d), bits, first, x, n, err);
}

static lm_status sim_mask_apply(lm_dev *d, float *x, const uint8_t *bits, int64_t first, int64_t n, lm_err *err)
{
    lm_status s;
    if ((s = begin(d, "mask_apply", err)) || (s = need_n(d, "x", x, n, 32, err)) || (s = host(d, "bits", bits, err)))
        return s;
    return cpu_of(d)->iface->mask_apply(cpu_of(d), x, bits, first, n, err);
}

static lm_status sim_topk_apply(lm_dev *d, float *x, int64_t n, uint32_t thr_bits, int64_t ties_allowed,
                                int64_t *ties_used, lm_err *err)
{
    lm_status s;
    if ((s = begin(d, "topk_apply", err)) || (s = need_n(d, "x", x, n, 32, err)) ||
        (s = host(d, "ties_used", ties_used, err)))
        return s;
    return cpu_of(d)->iface->topk_apply(cpu_of(d), x, n, thr_bits, ties_allowed, ties_used, err);
}

static lm_status sim_topk_drop(lm_dev *d, float *x, int64_t n, uint32_t thr_bits, int64_t ties_allowed,
                                int64_t *ties_used, lm_err *err)
{
    lm_status s;
    if ((s = begin(d, "topk_drop", err)) || (s = need_n(d, "x", x, n, 32, err)) ||
        (s = host(d, "ties_used", ties_used, err)))
        return s;
    return cpu_of(d)->iface->topk_drop(cpu_of(d), x, n, thr_bits, ties_allowed, ties_used, err);
}

static lm_status sim_random_drop(lm_dev *d, float *x, int64_t n, uint64_t key, int64_t first,
                                 uint64_t keep_below, lm_err *err)
{
    lm_status s;
    if ((s = begin(d, "random_drop", err)) || (s = need_n(d, "x", x, n, 32, err)))
        return s;
    return cpu_of(d)->iface->random_drop(cpu_of(d), x, n, key, first, keep_below, err);
}

static lm_status sim_l1(lm_dev *d, const float *x, int64_t n, double *out, lm_err *err)
{
    lm_status s;
    if ((s = begin(d, "l1", err)) || (s = need_n(d, "x", x, n, 32, err)) || (s = host(d, "out", out, err)))
        return s;
    return cpu_of(d)->iface->l1(cpu_of(d), x, n, out, err);
}

static lm_status sim_row_dot(lm_dev *d, const float *x, const float *y, int64_t rows, int64_t cols, double *out,
                             lm_err *err)
{
    lm_status s;
    if ((s = begin(d, "row_dot", err)) || (s = need_n(d, "x", x, rows * cols, 32, err)) ||
        (s = need_n(d, "y", y, rows * cols, 32, err)) || (s = host(d, "out", out, err)))
        return s;
    return cpu_of(d)->iface->row_dot(cpu_of(d), x, y, rows, cols, out, err);
}

static lm_status sim_della_drop(lm_dev *d, float *x, int64_t rows, int64_t cols, uint64_t key, int64_t first,
                                double p_lo, double p_hi, bool inv, lm_err *err)
{
    lm_status s;
    if ((s = begin(d, "della_drop", err)) || (s = need_n(d, "x", x, rows * cols, 32, err)))
        return s;
    return cpu_of(d)->iface->della_drop(cpu_of(d), x, rows, cols, key, first, p_lo, p_hi, inv, err);
}

static lm_status sim_tau_var(lm_dev *d, float *key, const float *const *taus, int k, int n_models, int64_t n,
                             lm_err *err)
{
    lm_status s;
    if ((s = begin(d, "tau_var", err)) || (s = need_n(d, "key", key, n, 32, err)) || (s = host(d, "taus", taus, err)))
        return s;
    for (int i = 0; i < k; i++)
        if ((s = need_n(d, "taus[i]", taus[i], n, 32, err)))
            return s;
    return cpu_of(d)->iface->tau_var(cpu_of(d), key, taus, k, n_models, n, err);
}

static lm_status sim_col_dot(lm_dev *d, const float *x, const float *y, int64_t rows, int64_t cols, double *acc,
                             lm_err *err)
{
    lm_status s;
    if ((s = begin(d, "col_dot", err)) || (s = need_n(d, "x", x, rows * cols, 32, err)) ||
        (s = need_n(d, "y", y, rows * cols, 32, err)) || (s = host(d, "acc", acc, err)))
        return s;
    return cpu_of(d)->iface->col_dot(cpu_of(d), x, y, rows, cols, acc, err);
}

static lm_status sim_col_axpby(lm_dev *d, float *y, const float *a, const float *x, const float *b, int64_t rows,
                               int64_t cols, lm_err *err)
{
    lm_status s;
    if ((s = begin(d, "col_axpby", err)) || (s = need_n(d, "y", y, rows * cols, 32, err)) ||
        (s = need_n(d, "x", x, rows * cols, 32, err)) || (s = host(d, "a", a, err)) || (s = host(d, "b", b, err)))
        return s;
    return cpu_of(d)->iface->col_axpby(cpu_of(d), y, a, x, b, rows, cols, err);
}

static lm_status sim_row_axpby(lm_dev *d, float *y, const float *a, const float *x, const float *b, int64_t rows,
                               int64_t cols, lm_err *err)
{
    lm_status s;
    if ((s = begin(d, "row_axpby", err)) || (s = need_n(d, "y", y, rows * cols, 32, err)) ||
        (s = need_n(d, "x", x, rows * cols, 32, err)) || (s = host(d, "a", a, err)) || (s = host(d, "b", b, err)))
        return s;
    return cpu_of(d)->iface->row_axpby(cpu_of(d), y, a, x, b, rows, cols, err);
}

static lm_status sim_nearswap(lm_dev *d, float *x, int64_t n, float t, lm_err *err)
{
    lm_status s;
    if ((s = begin(d, "nearswap", err)) || (s = need_n(d, "x", x, n, 32, err)))
        return s;
    return cpu_of(d)->iface->nearswap(cpu_of(d), x, n, t, err);
}

// w_tau and weights are host arrays; the vectors w_tau points at are device memory.
static lm_status sim_combine(lm_dev *d, float *out, const float *base, const float *const *w_tau,
                             const float *weights, int k, int64_t n, lm_combine_sign sign, bool normalize,
                             float lambda, lm_err *err)
{
    lm_status s;
    if ((s = begin(d, "combine", err)) || (s = need_n(d, "out", out, n, 32, err)) ||
        (s = need_n(d, "base", base, n, 32, err)) || (s = host(d, "w_tau", w_tau, err)) ||
        (s = host(d, "weights", weights, err)))
        return s;
    for (int i = 0; i < k; i++) {
        char arg[32];
        snprintf(arg, sizeof arg, "w_tau[%d]", i);
        if ((s = need_n(d, arg, w_tau[i], n, 32, err)))
            return s;
    }
    return cpu_of(d)->iface->combine(cpu_of(d), out, base, w_tau, weights, k, n, sign, normalize, lambda, err);
}

// ==== the backend =============================================================================

// The forward-pass operations, defined at the end of the file.
static lm_status sim_gather_rows(lm_dev *d, float *out, const float *table, int64_t table_rows, int64_t cols,
                                 const int32_t *ids, int64_t n, lm_err *err);
static lm_status sim_add_rows(lm_dev *d, float *y, const float *b, int64_t rows, int64_t cols, lm_err *err);
static lm_status sim_rmsnorm(lm_dev *d, float *out, const float *x, const float *w, int64_t rows, int64_t cols,
                             float eps, lm_err *err);
static lm_status sim_rope(lm_dev *d, float *x, int64_t rows, int64_t heads, int64_t head_dim, const int32_t *pos,
                          const float *inv_freq, lm_err *err);
static lm_status sim_attention(lm_dev *d, float *out, const float *q, const float *k, const float *v,
                               const int32_t *start, int64_t rows, int64_t heads, int64_t kv_heads,
                               int64_t head_dim, float scale, lm_err *err);
static lm_status sim_silu_mul(lm_dev *d, float *gate, const float *up, int64_t n, lm_err *err);
static lm_status sim_nll_rows(lm_dev *d, float *nll, const float *logits, const int32_t *targets, int64_t rows,
                              int64_t cols, lm_err *err);

static const lm_dev_i sim_iface = {
    .name = sim_name,
    .mem_info = sim_mem_info,
    .alloc = sim_alloc,
    .buf_free = sim_free,
    .upload = sim_upload,
    .download = sim_download,
    .sync = sim_sync,
    .check = sim_check,
    .destroy = sim_destroy,
    .to_f32 = sim_to_f32,
    .from_f32 = sim_from_f32,
    .gemm = sim_gemm,
    .syrk = sim_syrk,
    .axpby = sim_axpby,
    .delta = sim_delta,
    .dora_rows = sim_dora_rows,
    .hist_abs = sim_hist_abs,
    .hist_window = sim_hist_window,
    .topk_apply = sim_topk_apply,
    .topk_drop = sim_topk_drop,
    .topk_apply_by = sim_topk_apply_by,
    .importance = sim_importance,
    .potrf = sim_potrf,
    .mask_get = sim_mask_get,
    .mask_apply = sim_mask_apply,
    .random_drop = sim_random_drop,
    .l1 = sim_l1,
    .row_dot = sim_row_dot,
    .nearswap = sim_nearswap,
    .row_axpby = sim_row_axpby,
    .col_dot = sim_col_dot,
    .col_axpby = sim_col_axpby,
    .tau_var = sim_tau_var,
    .della_drop = sim_della_drop,
    .combine = sim_combine,
    .gather_rows = sim_gather_rows,
    .add_rows = sim_add_rows,
    .rmsnorm = sim_rmsnorm,
    .rope = sim_rope,
    .attention = sim_attention,
    .silu_mul = sim_silu_mul,
    .nll_rows = sim_nll_rows,
};

// Reads the fault switch into c; false when it is malformed.
static bool parse_fail(sim_ctx *c, const char *fail)
{
    const char *p;
    if (strncmp(fail, "alloc:", 6) == 0) {
        c->fail = FAIL_ALLOC;
        p = fail + 6;
    } else if (strncmp(fail, "launch:", 7) == 0) {
        c->fail = FAIL_LAUNCH;
        p = fail + 7;
    } else {
        return false;
    }
    uint64_t n = 0;
    for (; *p >= '0' && *p <= '9'; p++)
        if (!lm_mul_u64(n, 10, &n) || !lm_add_u64(n, (uint64_t)(*p - '0'), &n))
            return false;
    c->fail_at = n;
    return n > 0 && *p == 0;
}

// "sim:" and the budget in the largest binary unit that divides it exactly.
static void format_name(char *buf, size_t cap, uint64_t budget)
{
    static const char *units[] = {"", "KiB", "MiB", "GiB", "TiB"};
    int u = 0;
    while (u < 4 && budget % 1024 == 0) {
        budget /= 1024;
        u++;
    }
    snprintf(buf, cap, "sim:%llu%s", (unsigned long long)budget, units[u]);
}

lm_status lm_dev_sim_create(lm_dev **out, uint64_t budget, const char *fail, int threads, lm_err *err)
{
    *out = NULL;
    if (budget == 0 || budget > SIZE_MAX)
        return lm_err_set(err, LM_ERR_USAGE, "sim: a budget of %llu bytes is out of range",
                          (unsigned long long)budget);
    lm_dev *d = calloc(1, sizeof *d);
    sim_ctx *c = calloc(1, sizeof *c);
    if (!d || !c) {
        free(d);
        free(c);
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    }
    d->iface = &sim_iface;
    d->ctx = c;
    d->host_memory = false;
    c->budget = budget;
    format_name(c->name, sizeof c->name, budget);
    if (fail && *fail && !parse_fail(c, fail)) {
        sim_destroy(d);
        return lm_err_set(err, LM_ERR_USAGE, "LLMERGE_SIM_FAIL=%s: expected alloc:N or launch:N with N >= 1", fail);
    }
    lm_status s = lm_dev_cpu_create(&c->cpu, threads, err);
    if (s != LM_OK) {
        sim_destroy(d);
        return s;
    }
    d->threads = c->cpu->threads;
    *out = d;
    return LM_OK;
}

// ==== the forward pass ========================================================================

// a · b, or -1 when either is negative or the product overflows (need_n then refuses it).
static int64_t elems(int64_t a, int64_t b)
{
    int64_t e;
    if (a < 0 || b < 0 || __builtin_mul_overflow(a, b, &e))
        return -1;
    return e;
}

static lm_status sim_gather_rows(lm_dev *d, float *out, const float *table, int64_t table_rows, int64_t cols,
                                 const int32_t *ids, int64_t n, lm_err *err)
{
    lm_status s;
    if ((s = begin(d, "gather_rows", err)) || (s = need_n(d, "out", out, elems(n, cols), 32, err)) ||
        (s = need_n(d, "table", table, elems(table_rows, cols), 32, err)) ||
        (s = need_n(d, "ids", ids, n, 32, err)))
        return s;
    return cpu_of(d)->iface->gather_rows(cpu_of(d), out, table, table_rows, cols, ids, n, err);
}

static lm_status sim_add_rows(lm_dev *d, float *y, const float *b, int64_t rows, int64_t cols, lm_err *err)
{
    lm_status s;
    if ((s = begin(d, "add_rows", err)) || (s = need_n(d, "y", y, elems(rows, cols), 32, err)) ||
        (s = need_n(d, "b", b, cols, 32, err)))
        return s;
    return cpu_of(d)->iface->add_rows(cpu_of(d), y, b, rows, cols, err);
}

static lm_status sim_rmsnorm(lm_dev *d, float *out, const float *x, const float *w, int64_t rows, int64_t cols,
                             float eps, lm_err *err)
{
    lm_status s;
    if ((s = begin(d, "rmsnorm", err)) || (s = need_n(d, "out", out, elems(rows, cols), 32, err)) ||
        (s = need_n(d, "x", x, elems(rows, cols), 32, err)) || (s = need_n(d, "w", w, cols, 32, err)))
        return s;
    return cpu_of(d)->iface->rmsnorm(cpu_of(d), out, x, w, rows, cols, eps, err);
}

static lm_status sim_rope(lm_dev *d, float *x, int64_t rows, int64_t heads, int64_t head_dim, const int32_t *pos,
                          const float *inv_freq, lm_err *err)
{
    lm_status s;
    if ((s = begin(d, "rope", err)) || (s = need_n(d, "x", x, elems(rows, elems(heads, head_dim)), 32, err)) ||
        (s = need_n(d, "pos", pos, rows, 32, err)) ||
        (s = need_n(d, "inv_freq", inv_freq, head_dim < 0 ? -1 : head_dim / 2, 32, err)))
        return s;
    return cpu_of(d)->iface->rope(cpu_of(d), x, rows, heads, head_dim, pos, inv_freq, err);
}

static lm_status sim_attention(lm_dev *d, float *out, const float *q, const float *k, const float *v,
                               const int32_t *start, int64_t rows, int64_t heads, int64_t kv_heads,
                               int64_t head_dim, float scale, lm_err *err)
{
    lm_status s;
    int64_t nq = elems(rows, elems(heads, head_dim)), nkv = elems(rows, elems(kv_heads, head_dim));
    if ((s = begin(d, "attention", err)) || (s = need_n(d, "out", out, nq, 32, err)) ||
        (s = need_n(d, "q", q, nq, 32, err)) || (s = need_n(d, "k", k, nkv, 32, err)) ||
        (s = need_n(d, "v", v, nkv, 32, err)) || (s = need_n(d, "start", start, rows, 32, err)))
        return s;
    return cpu_of(d)->iface->attention(cpu_of(d), out, q, k, v, start, rows, heads, kv_heads, head_dim, scale,
                                       err);
}

static lm_status sim_silu_mul(lm_dev *d, float *gate, const float *up, int64_t n, lm_err *err)
{
    lm_status s;
    if ((s = begin(d, "silu_mul", err)) || (s = need_n(d, "gate", gate, n, 32, err)) ||
        (s = need_n(d, "up", up, n, 32, err)))
        return s;
    return cpu_of(d)->iface->silu_mul(cpu_of(d), gate, up, n, err);
}

static lm_status sim_nll_rows(lm_dev *d, float *nll, const float *logits, const int32_t *targets, int64_t rows,
                              int64_t cols, lm_err *err)
{
    lm_status s;
    if ((s = begin(d, "nll_rows", err)) || (s = need_n(d, "nll", nll, rows, 32, err)) ||
        (s = need_n(d, "logits", logits, elems(rows, cols), 32, err)) ||
        (s = need_n(d, "targets", targets, rows, 32, err)))
        return s;
    return cpu_of(d)->iface->nll_rows(cpu_of(d), nll, logits, targets, rows, cols, err);
}
