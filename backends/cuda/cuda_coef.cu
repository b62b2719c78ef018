// The CUDA backend's operations for the methods that interpolate whole tensors (per-row and
// per-column dot products and row or column scaling), della's drop, sce's variances and
// nearswap's step: each on the backend's stream, as cuda.cu's operations are (cuda_int.h).
#include <cuda_runtime.h>

#include <stdbool.h>
#include <stdint.h>

#include "status.h"

extern "C" {
#include "device_impl.h"
}

#include "cuda_int.h"
#include "kernels.h"
#include "sparsify.h"  // lm_della_sort_bytes, lm_della_sort_rows

// Per-row sums on the device, copied home.
lm_status lm_cuda_op_row_dot(lm_dev *d, const float *x, const float *y, int64_t rows, int64_t cols, double *out,
                             lm_err *err)
{
    cuda_ctx *c = ctx_of(d);
    lm_status s = lm_cuda_begin(d, err);
    if (s != LM_OK || rows <= 0)
        return s;
    size_t bytes = (size_t)rows * sizeof(double);
    if ((s = lm_cuda_scratch_reserve(d, bytes, err)) != LM_OK ||
        (s = lm_cuda_row_dot((double *)c->scratch, x, y, rows, cols, c->stream, err)) != LM_OK ||
        (s = lm_cuda_copy_home(c, out, c->scratch, bytes, err)) != LM_OK)
        return s;
    return LM_OK;
}

// The rows' sorted keys go through device scratch (lm_della_sort_bytes: 8 bytes an element, and
// the padding of a row's last chunk), given back to the cache after. The rows go in groups of
// lm_della_sort_rows; where the room left is less than a group's keys, in groups half as large,
// down to one row or to the scratch every device keeps (SCRATCH_MIN, which a smaller group
// would ask for again): where that finds no room, LM_ERR_DEVICE_OOM, and the unit falls back.
// The groups are the slab's rows in order with their indices, so the bits are the same.
lm_status lm_cuda_op_della_drop(lm_dev *d, float *x, int64_t rows, int64_t cols, uint64_t key, int64_t first,
                                double p_lo, double p_hi, bool inv, lm_err *err)
{
    cuda_ctx *c = ctx_of(d);
    lm_status s = lm_cuda_begin(d, err);
    if (s != LM_OK || rows <= 0 || cols <= 0)
        return s;
    if (cols > INT32_MAX)
        return lm_err_set(err, LM_ERR_UNSUPPORTED, "%s: della_drop of rows of %lld entries", lm_dev_name(d),
                          (long long)cols);
    int64_t group = lm_della_sort_rows(rows, cols);
    for (;;) {
        size_t keys = (size_t)lm_della_sort_bytes(group, cols);
        s = lm_cuda_scratch_reserve(d, keys, err);
        if (s != LM_ERR_DEVICE_OOM || group == 1 || keys <= SCRATCH_MIN)
            break;
        group = (group + 1) / 2;
        lm_err_clear(err);  // the larger group's refusal is no failure where a smaller one fits
    }
    for (int64_t r0 = 0; s == LM_OK && r0 < rows; r0 += group) {
        int64_t n = rows - r0 < group ? rows - r0 : group;
        s = lm_cuda_della_drop(x + r0 * cols, (uint64_t *)c->scratch, n, cols, key, first + r0 * cols, p_lo, p_hi,
                               inv, c->stream, err);
    }
    lm_cuda_scratch_trim(d);
    return s;
}

lm_status lm_cuda_op_tau_var(lm_dev *d, float *key, const float *const *taus, int k, int n_models, int64_t n,
                             lm_err *err)
{
    lm_status s = lm_cuda_begin(d, err);
    if (s != LM_OK)
        return s;
    if (k < 0 || n_models < 1 || k > n_models)
        return lm_err_set(err, LM_ERR_USAGE, "%s: tau_var of %d of %d models", lm_dev_name(d), k, n_models);
    return lm_cuda_tau_var(key, taus, k, n_models, n, ctx_of(d)->stream, err);
}

// The running sums go to device scratch, are added to there and come home.
lm_status lm_cuda_op_col_dot(lm_dev *d, const float *x, const float *y, int64_t rows, int64_t cols, double *acc,
                             lm_err *err)
{
    cuda_ctx *c = ctx_of(d);
    lm_status s = lm_cuda_begin(d, err);
    if (s != LM_OK || rows <= 0 || cols <= 0)
        return s;
    size_t bytes = (size_t)cols * sizeof(double);
    if ((s = lm_cuda_scratch_reserve(d, bytes, err)) != LM_OK || (s = lm_dev_upload(d, c->scratch, acc, bytes, err)) != LM_OK ||
        (s = lm_cuda_col_dot((double *)c->scratch, x, y, rows, cols, c->stream, err)) != LM_OK)
        return s;
    return lm_cuda_copy_home(c, acc, c->scratch, bytes, err);
}

// y = a·y + b·x with a factor pair per row (by_row) or per column: the factors (n = rows or cols
// floats each) go to device scratch first, 2·n floats.
static lm_status axpby_by(lm_dev *d, float *y, const float *a, const float *x, const float *b, int64_t rows,
                          int64_t cols, bool by_row, lm_err *err)
{
    cuda_ctx *c = ctx_of(d);
    lm_status s = lm_cuda_begin(d, err);
    if (s != LM_OK || rows <= 0 || cols <= 0)
        return s;
    int64_t n = by_row ? rows : cols;
    size_t bytes = (size_t)n * sizeof(float);
    if ((s = lm_cuda_scratch_reserve(d, 2 * bytes, err)) != LM_OK)
        return s;
    float *da = (float *)c->scratch, *db = da + n;
    if ((s = lm_dev_upload(d, da, a, bytes, err)) != LM_OK || (s = lm_dev_upload(d, db, b, bytes, err)) != LM_OK)
        return s;
    return by_row ? lm_cuda_row_axpby(y, da, x, db, rows, cols, c->stream, err)
                  : lm_cuda_col_axpby(y, da, x, db, rows, cols, c->stream, err);
}

lm_status lm_cuda_op_col_axpby(lm_dev *d, float *y, const float *a, const float *x, const float *b, int64_t rows,
                               int64_t cols, lm_err *err)
{
    return axpby_by(d, y, a, x, b, rows, cols, false, err);
}

lm_status lm_cuda_op_row_axpby(lm_dev *d, float *y, const float *a, const float *x, const float *b, int64_t rows,
                               int64_t cols, lm_err *err)
{
    return axpby_by(d, y, a, x, b, rows, cols, true, err);
}

lm_status lm_cuda_op_nearswap(lm_dev *d, float *x, int64_t n, float t, lm_err *err)
{
    lm_status s = lm_cuda_begin(d, err);
    return s != LM_OK ? s : lm_cuda_nearswap(x, n, t, ctx_of(d)->stream, err);
}

