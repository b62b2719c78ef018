// The device dispatcher: lm_dev_* forward to the backend's vtable, supply defaults for
// optional entries, and open a device from a --device value. See device.h.
#include "device.h"

#include <stdio.h>
#include <string.h>

#include "util.h"

lm_status lm_dev_open(lm_dev **out, const char *spec, int threads, lm_err *err)
{
    *out = NULL;
    if (strcmp(spec, "cpu") == 0 || strcmp(spec, "auto") == 0)
        return lm_dev_cpu_create(out, threads, err);
    if (strncmp(spec, "cuda", 4) == 0 || strncmp(spec, "sim:", 4) == 0)
        return lm_err_set(err, LM_ERR_USAGE,
                          "--device %s: this version of llmerge merges on the CPU only "
                          "(use --device cpu or auto)", spec);
    return lm_err_set(err, LM_ERR_USAGE, "--device %s: unknown device (use auto, cpu, cuda[:N] or sim:SIZE)",
                      spec);
}

void lm_dev_free(lm_dev *d)
{
    if (d)
        d->iface->destroy(d);
}

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
    return d->iface->alloc(d, size, ptr, err);
}

void lm_dev_release(lm_dev *d, void *ptr)
{
    if (ptr)
        d->iface->free(d, ptr);
}

lm_status lm_dev_upload(lm_dev *d, void *dst, const void *src, size_t n, lm_err *err)
{
    return n ? d->iface->upload(d, dst, src, n, err) : LM_OK;
}

lm_status lm_dev_download(lm_dev *d, void *dst, const void *src, size_t n, lm_err *err)
{
    return n ? d->iface->download(d, dst, src, n, err) : LM_OK;
}

lm_status lm_dev_sync(lm_dev *d, lm_err *err)
{
    return d->iface->sync ? d->iface->sync(d, err) : LM_OK;
}

lm_status lm_dev_to_f32(lm_dev *d, float *dst, const void *src, lm_dtype dt, int64_t n, lm_err *err)
{
    return d->iface->to_f32(d, dst, src, dt, n, err);
}

lm_status lm_dev_from_f32(lm_dev *d, void *dst, lm_dtype dt, const float *src, int64_t n, lm_err *err)
{
    return d->iface->from_f32(d, dst, dt, src, n, err);
}

lm_status lm_dev_gemm(lm_dev *d, bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha,
                      const float *a, int64_t lda, const float *b, int64_t ldb, float beta,
                      float *c, int64_t ldc, lm_err *err)
{
    return d->iface->gemm(d, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, err);
}

lm_status lm_dev_axpby(lm_dev *d, float *y, float a, const float *x, float b, int64_t n, lm_err *err)
{
    return d->iface->axpby(d, y, a, x, b, n, err);
}

lm_status lm_dev_dora_rows(lm_dev *d, float *tau, const float *base, const float *magnitude,
                           int64_t rows, int64_t cols, lm_err *err)
{
    return d->iface->dora_rows(d, tau, base, magnitude, rows, cols, err);
}

lm_status lm_dev_hist_abs(lm_dev *d, uint64_t *hist, const float *x, int64_t n, int level,
                          uint32_t hi_bin, lm_err *err)
{
    return d->iface->hist_abs(d, hist, x, n, level, hi_bin, err);
}

lm_status lm_dev_topk_apply(lm_dev *d, float *x, int64_t n, uint32_t thr_bits, int64_t ties_allowed,
                            int64_t *ties_used, lm_err *err)
{
    return d->iface->topk_apply(d, x, n, thr_bits, ties_allowed, ties_used, err);
}

lm_status lm_dev_random_drop(lm_dev *d, float *x, int64_t n, uint64_t key, int64_t first,
                             uint64_t keep_below, lm_err *err)
{
    return d->iface->random_drop(d, x, n, key, first, keep_below, err);
}

lm_status lm_dev_l1(lm_dev *d, const float *x, int64_t n, double *out, lm_err *err)
{
    return d->iface->l1(d, x, n, out, err);
}

lm_status lm_dev_combine(lm_dev *d, float *out, const float *base, const float *const *w_tau,
                         const float *weights, int k, int64_t n, lm_dev_sign sign, bool normalize,
                         float lambda, lm_err *err)
{
    return d->iface->combine(d, out, base, w_tau, weights, k, n, sign, normalize, lambda, err);
}
