// Truncated SVD of one matrix to LoRA factors: see lowrank.h.
#include "lowrank.h"

#include <cblas.h>
#include <lapacke.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "dtype.h"
#include "sparsify.h"

#define RESIDUAL_ROWS_ELEMS ((int64_t)1 << 18)  // elements of M's residual made at once (in cache)

double lm_lowrank_normal(uint64_t key, int64_t i)
{
    // two uniform draws in (0, 1): the 32-bit draws of 2i and 2i + 1, offset by a half
    double u1 = ((double)lm_rng_draw(key, 2 * i) + 0.5) / 4294967296.0;
    double u2 = ((double)lm_rng_draw(key, 2 * i + 1) + 0.5) / 4294967296.0;
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

void lm_lowrank_free(lm_lowrank *lr)
{
    if (!lr)
        return;
    free(lr->a);
    free(lr->b);
    free(lr->sigma);
    memset(lr, 0, sizeof *lr);
}

// The device buffers of one factorisation.
typedef struct lr_bufs {
    float *omega;  // (cols × l) Ω, then Z = Mᵀ·Q
    float *y;      // (rows × l) Y = M·Ω, then Q
    float *bt;     // (l × cols) Q'·M
    float *fb;     // (rows × r) B, for the residual
    float *fa;     // (r × cols) A
    float *res;    // (chunk rows × cols) the residual's rows
} lr_bufs;

static void free_bufs(lm_dev *dev, lr_bufs *b)
{
    lm_dev_buf_free(dev, b->omega);
    lm_dev_buf_free(dev, b->y);
    lm_dev_buf_free(dev, b->bt);
    lm_dev_buf_free(dev, b->fb);
    lm_dev_buf_free(dev, b->fa);
    lm_dev_buf_free(dev, b->res);
}

// Replaces the device matrix x [n, l] (row-major) by an orthonormal basis of its columns: a
// Householder QR in double on the host (h: n × l doubles, f: n × l floats of scratch).
static lm_status orthonormalise(lm_dev *dev, float *x, int64_t n, int l, double *h, float *f, lm_err *err)
{
    lm_status s = lm_dev_download(dev, f, x, (size_t)(n * l) * sizeof *f, err);
    if (s != LM_OK)
        return s;
    for (int64_t i = 0; i < n * l; i++)
        h[i] = f[i];
    double tau[l];
    lapack_int info = LAPACKE_dgeqrf(LAPACK_ROW_MAJOR, (lapack_int)n, l, h, l, tau);
    if (info == 0)
        info = LAPACKE_dorgqr(LAPACK_ROW_MAJOR, (lapack_int)n, l, l, h, l, tau);
    if (info != 0)
        return lm_err_set(err, LM_ERR_FORMAT, "the QR of a %lld x %d matrix failed (LAPACK info %d)", (long long)n, l,
                          (int)info);
    for (int64_t i = 0; i < n * l; i++)
        f[i] = (float)h[i];
    return lm_dev_upload(dev, x, f, (size_t)(n * l) * sizeof *f, err);
}

// Σ of the row sums of squares of x [rows, cols] (device memory), in row order.
static lm_status sum_squares(lm_dev *dev, const float *x, int64_t rows, int64_t cols, double *out, lm_err *err)
{
    double *rs = malloc((size_t)(rows > 0 ? rows : 1) * sizeof *rs);
    if (!rs)
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    lm_status s = lm_dev_row_dot(dev, x, x, rows, cols, rs, err);
    double sum = 0;
    for (int64_t r = 0; s == LM_OK && r < rows; r++)
        sum += rs[r];
    free(rs);
    *out = sum;
    return s;
}

lm_status lm_lowrank_factor(lm_dev *dev, const float *m, int64_t rows, int64_t cols, const lm_lowrank_opts *o,
                            lm_lowrank *out, lm_err *err)
{
    memset(out, 0, sizeof *out);
    int64_t kmax = rows < cols ? rows : cols;
    if (o->rank < 1 || o->rank > kmax)
        return lm_err_set(err, LM_ERR_USAGE, "rank %d of a %lld x %lld matrix: it must be from 1 to %lld", o->rank,
                          (long long)rows, (long long)cols, (long long)kmax);
    int l = (int)(o->rank + (int64_t)(o->oversample > 0 ? o->oversample : 0) < kmax
                      ? o->rank + (o->oversample > 0 ? o->oversample : 0)
                      : kmax);
    int64_t big = rows > cols ? rows : cols;
    lr_bufs b = {0};
    double *h = malloc((size_t)(big * l) * sizeof *h), *bt = malloc((size_t)(l * cols) * sizeof *bt);
    double *u = malloc((size_t)l * l * sizeof *u), *sig = malloc((size_t)l * sizeof *sig);
    double *vt = malloc((size_t)(l * cols) * sizeof *vt), *sup = malloc((size_t)l * sizeof *sup);
    float *f = malloc((size_t)(big * l > l * cols ? big * l : l * cols) * sizeof *f);
    lm_status s = LM_OK;
    double norm2 = 0;
    if (!h || !bt || !u || !sig || !vt || !sup || !f) {
        s = lm_err_set(err, LM_ERR_NOMEM, "out of memory");
        goto done;
    }
    if ((s = sum_squares(dev, m, rows, cols, &norm2, err)) != LM_OK)
        goto done;
    if (!isfinite(norm2)) {
        s = lm_err_set(err, LM_ERR_FORMAT, "the %lld x %lld matrix holds NaN or Inf: it has no SVD", (long long)rows,
                       (long long)cols);
        goto done;
    }
    out->norm = sqrt(norm2);
    if (norm2 == 0)
        goto done;  // nothing to factor: rank 0

    // Y = M·Ω, then power iterations Y = M·(Mᵀ·Q), each product's result orthonormalised
    if ((s = lm_dev_alloc(dev, (size_t)(cols * l) * sizeof(float), (void **)&b.omega, err)) != LM_OK ||
        (s = lm_dev_alloc(dev, (size_t)(rows * l) * sizeof(float), (void **)&b.y, err)) != LM_OK ||
        (s = lm_dev_alloc(dev, (size_t)(l * cols) * sizeof(float), (void **)&b.bt, err)) != LM_OK)
        goto done;
    for (int64_t i = 0; i < cols * l; i++)
        f[i] = (float)lm_lowrank_normal(o->key, i);
    if ((s = lm_dev_upload(dev, b.omega, f, (size_t)(cols * l) * sizeof *f, err)) != LM_OK ||
        (s = lm_dev_gemm(dev, false, false, rows, l, cols, 1.0f, m, cols, b.omega, l, 0.0f, b.y, l, err)) != LM_OK ||
        (s = orthonormalise(dev, b.y, rows, l, h, f, err)) != LM_OK)
        goto done;
    for (int it = 0; it < o->power_iters; it++) {
        if ((s = lm_dev_gemm(dev, true, false, cols, l, rows, 1.0f, m, cols, b.y, l, 0.0f, b.omega, l, err)) !=
                LM_OK ||
            (s = orthonormalise(dev, b.omega, cols, l, h, f, err)) != LM_OK ||
            (s = lm_dev_gemm(dev, false, false, rows, l, cols, 1.0f, m, cols, b.omega, l, 0.0f, b.y, l, err)) !=
                LM_OK ||
            (s = orthonormalise(dev, b.y, rows, l, h, f, err)) != LM_OK)
            goto done;
    }
    // Q'·M [l, cols], and its SVD U·Σ·Vᵀ in double on the host
    if ((s = lm_dev_gemm(dev, true, false, l, cols, rows, 1.0f, b.y, l, m, cols, 0.0f, b.bt, cols, err)) != LM_OK ||
        (s = lm_dev_download(dev, f, b.bt, (size_t)(l * cols) * sizeof *f, err)) != LM_OK)
        goto done;
    for (int64_t i = 0; i < l * cols; i++)
        bt[i] = f[i];
    lapack_int info = LAPACKE_dgesvd(LAPACK_ROW_MAJOR, 'S', 'S', l, (lapack_int)cols, bt, (lapack_int)cols, sig, u, l,
                                     vt, (lapack_int)cols, sup);
    if (info != 0) {
        s = lm_err_set(err, LM_ERR_FORMAT, "the SVD of a %d x %lld matrix did not converge (LAPACK info %d)", l,
                       (long long)cols, (int)info);
        goto done;
    }
    if (!(out->sigma = malloc((size_t)l * sizeof *out->sigma))) {
        s = lm_err_set(err, LM_ERR_NOMEM, "out of memory");
        goto done;
    }
    memcpy(out->sigma, sig, (size_t)l * sizeof *sig);
    out->n_sigma = l;

    // the rank: o->rank, or the fewest values that keep o->energy of ‖M‖²; none of zero
    int r = o->rank < l ? o->rank : l;
    if (o->energy > 0) {
        double kept = 0;
        int k = 0;
        while (k < r && kept < o->energy * norm2)
            kept += sig[k] * sig[k], k++;
        r = k;
    }
    while (r > 0 && sig[r - 1] == 0)
        r--;
    out->rank = r;
    if (r == 0)
        goto done;

    // B = Q·U_r·√Σ_r [rows, r], A = √Σ_r·V_rᵀ [r, cols]
    out->b = malloc((size_t)(rows * r) * sizeof *out->b);
    out->a = malloc((size_t)(r * cols) * sizeof *out->a);
    if (!out->b || !out->a) {
        s = lm_err_set(err, LM_ERR_NOMEM, "out of memory");
        goto done;
    }
    for (int q = 0; q < r; q++) {
        double w = sqrt(sig[q]);
        for (int64_t c = 0; c < cols; c++)
            out->a[q * cols + c] = (float)(w * vt[q * cols + c]);
    }
    // Q (rows × l) to the host in double, then Q·U_r
    if ((s = lm_dev_download(dev, f, b.y, (size_t)(rows * l) * sizeof *f, err)) != LM_OK)
        goto done;
    for (int64_t i = 0; i < rows * l; i++)
        h[i] = f[i];
    double *qu = bt;  // l × cols doubles are free again; rows × r fit where rows <= cols, else reuse h's tail
    double *qu_buf = NULL;
    if ((int64_t)r * rows > l * cols) {
        if (!(qu_buf = malloc((size_t)(rows * r) * sizeof *qu_buf))) {
            s = lm_err_set(err, LM_ERR_NOMEM, "out of memory");
            goto done;
        }
        qu = qu_buf;
    }
    cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)rows, r, l, 1.0, h, l, u, l, 0.0, qu, r);
    for (int64_t i = 0; i < rows; i++)
        for (int q = 0; q < r; q++)
            out->b[i * r + q] = (float)(qu[i * r + q] * sqrt(sig[q]));
    free(qu_buf);

    // the factors as they will be stored
    if (o->round_bf16 || o->round_f16) {
        lm_dtype dt = o->round_bf16 ? LM_DTYPE_BF16 : LM_DTYPE_F16;
        float *fs[2] = {out->b, out->a};
        int64_t ns[2] = {rows * r, (int64_t)r * cols};
        for (int i = 0; i < 2; i++)
            for (int64_t e = 0; e < ns[i]; e++)
                fs[i][e] = dt == LM_DTYPE_BF16 ? lm_bf16_to_f32(lm_f32_to_bf16(fs[i][e]))
                                               : lm_f16_to_f32(lm_f32_to_f16(fs[i][e]));
    }
    // the error, from the residual M − B·A made a chunk of rows at a time
    int64_t chunk = RESIDUAL_ROWS_ELEMS / cols > 0 ? RESIDUAL_ROWS_ELEMS / cols : 1;
    chunk = chunk < rows ? chunk : rows;
    if ((s = lm_dev_alloc(dev, (size_t)(rows * r) * sizeof(float), (void **)&b.fb, err)) != LM_OK ||
        (s = lm_dev_alloc(dev, (size_t)(r * cols) * sizeof(float), (void **)&b.fa, err)) != LM_OK ||
        (s = lm_dev_alloc(dev, (size_t)(chunk * cols) * sizeof(float), (void **)&b.res, err)) != LM_OK ||
        (s = lm_dev_upload(dev, b.fb, out->b, (size_t)(rows * r) * sizeof(float), err)) != LM_OK ||
        (s = lm_dev_upload(dev, b.fa, out->a, (size_t)(r * cols) * sizeof(float), err)) != LM_OK)
        goto done;
    double res2 = 0;
    for (int64_t r0 = 0; r0 < rows && s == LM_OK; r0 += chunk) {
        int64_t nr = rows - r0 < chunk ? rows - r0 : chunk;
        double part = 0;
        // res = B·A over the chunk's rows, then res = M − res
        if ((s = lm_dev_gemm(dev, false, false, nr, cols, r, 1.0f, b.fb + r0 * r, r, b.fa, cols, 0.0f, b.res, cols,
                             err)) == LM_OK &&
            (s = lm_dev_axpby(dev, b.res, -1.0f, m + r0 * cols, 1.0f, nr * cols, err)) == LM_OK &&
            (s = sum_squares(dev, b.res, nr, cols, &part, err)) == LM_OK)
            res2 += part;
    }
    if (s == LM_OK)
        out->err = sqrt(res2 / norm2);

done:
    free_bufs(dev, &b);
    free(h);
    free(bt);
    free(u);
    free(sig);
    free(vt);
    free(sup);
    free(f);
    if (s != LM_OK)
        lm_lowrank_free(out);
    return s;
}
