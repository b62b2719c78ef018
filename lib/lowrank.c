// Truncated SVD of one matrix to LoRA factors: see lowrank.h.
#include "lowrank.h"

#include <cblas.h>
#include <lapacke.h>
#include <malloc.h>
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "dtype.h"
#include "parallel.h"
#include "sparsify.h"
#include "util.h"

// Elements of M's residual made at once (in the last-level cache). Each chunk is three device
// operations; with 2^18 (1 MiB) an extraction at rank 16 of the 1B-shape benchmark took 5.05 s
// against 3.82 s with 2^20 (medians of six alternating runs), mostly in system time.
#define RESIDUAL_ROWS_ELEMS ((int64_t)1 << 20)
// Below this fraction of ‖M‖², the error is measured from the residual itself (see the error's
// pass in lm_lowrank_factor): a relative error under 0.1. Above it, the sum's rounding (the
// narrow product's float32 sums, about 1e-6 of ⟨M, B·A⟩) moves the error by 1e-4 of itself at
// most.
#define RESIDUAL_EXACT 1e-2

// Entries 2j and 2j + 1 of the stream, from one pair of uniform draws in (0, 1) (the 32-bit
// draws of 2j and 2j + 1 offset by a half): the one function that makes them, so that a single
// entry and a run of them are the same bits.
static void normal_pair(uint64_t key, int64_t j, double *even, double *odd)
{
    double u1 = ((double)lm_rng_draw(key, 2 * j) + 0.5) / 4294967296.0;
    double u2 = ((double)lm_rng_draw(key, 2 * j + 1) + 0.5) / 4294967296.0;
    double radius = sqrt(-2.0 * log(u1)), angle = 6.283185307179586 * u2;
    *even = radius * cos(angle);
    *odd = radius * sin(angle);
}

double lm_lowrank_normal(uint64_t key, int64_t i)
{
    double even, odd;
    normal_pair(key, i >> 1, &even, &odd);
    return i & 1 ? odd : even;
}

#define NORMAL_PAIRS 8192  // pairs of draws per task

typedef struct normal_job {
    uint64_t key;
    int64_t n;
    float *out;
} normal_job;

// out[i] = lm_lowrank_normal(key, i) for the task's i, each pair of draws taken once.
static void normal_task(void *ctx, int64_t t)
{
    const normal_job *j = ctx;
    for (int64_t p = t * NORMAL_PAIRS; p < (t + 1) * NORMAL_PAIRS && 2 * p < j->n; p++) {
        double even, odd;
        normal_pair(j->key, p, &even, &odd);
        j->out[2 * p] = (float)even;
        if (2 * p + 1 < j->n)
            j->out[2 * p + 1] = (float)odd;
    }
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
    float *omega;  // (cols × l) Ω, then Z = Mᵀ·Q, then X = Mᵀ·Q of the last Q
    float *y;      // (rows × l) Y = M·Ω, then Q
    float *fb;     // (rows × r) B, for the residual
    float *fa;     // (r × cols) A
    float *res;    // (chunk rows × cols) the residual's rows
} lr_bufs;

static void free_bufs(lm_dev *dev, lr_bufs *b)
{
    lm_dev_buf_free(dev, b->omega);
    lm_dev_buf_free(dev, b->y);
    lm_dev_buf_free(dev, b->fb);
    lm_dev_buf_free(dev, b->fa);
    lm_dev_buf_free(dev, b->res);
}

// ---- orthonormal bases ---------------------------------------------------------------------
// A tall matrix's QR by blocks of rows (TSQR): each block of QR_ROWS or more rows gets its own
// Householder QR (LAPACK, double, in the caches, the blocks on the pool's threads), the blocks'
// triangles stacked get another, and the basis is each block's Q times its part of the stack's.
// It spans what one Householder QR of the whole matrix spans (the same Q, column signs aside,
// where the matrix has full rank), at a fraction of the time: one QR of an embedding's 128,256 x
// 74 matrix walks it from memory once per column. The blocks depend on the shape alone, so the
// basis is the same bits on any thread count.
#define QR_ROWS 512  // rows of a block at least (and at least twice the columns): see blocks()

// The blocks of rows of an n x l matrix, by its shape alone (so the same bits on any thread
// count), for the QR by blocks and Cholesky QR's Gram matrices and solves: QR_ROWS rows at least
// and twice the columns (a block's l x l triangle or Gram matrix then stays within half of the
// block), the last block taking the rest; *nb of them. 512 rows: every core of a large host takes
// a block of a 1B model's matrices (an MLP's 8,192 rows are 16 blocks at rank 64). With 4,096
// for the Gram matrices and solves, an MLP matrix was two tasks and an attention matrix one, and
// the host's work of an extraction at rank 64 on a 16-core machine beside a GPU took 3.9 s of its
// 5.1 s of factoring. Blocks of 512 x 74 doubles sit in a core's L2; one thread is no slower
// with them (27 ms against 28 to 33 ms for an 8,192 x 2,048 matrix at rank 64).
static int64_t blocks(int64_t n, int l, int64_t *nb)
{
    int64_t rows = QR_ROWS > 2 * (int64_t)l ? QR_ROWS : 2 * (int64_t)l;
    *nb = n / rows < 1 ? 1 : n / rows;
    return rows;
}

// Block b's rows of n in blocks of `rows`, nb of them.
static int64_t block_len(int64_t n, int64_t rows, int64_t nb, int64_t b)
{
    return b == nb - 1 ? n - b * rows : rows;  // the last block takes the rest
}

typedef struct qr_job {
    float *x;        // [n, l] row-major: the matrix, then its basis
    double *h;       // the blocks, each column-major (block b at h + start(b)·l)
    double *s;       // [nb·l, l] column-major: the blocks' triangles, then their Q
    int64_t n, rows, nb;
    int l;
    atomic_bool failed;  // a block's LAPACK call failed
    atomic_bool nomem;   // a block found no memory
} qr_job;

static int64_t qr_start(const qr_job *j, int64_t b)
{
    return b * j->rows;
}

static int64_t qr_len(const qr_job *j, int64_t b)
{
    return block_len(j->n, j->rows, j->nb, b);
}

// Block b: its QR, its triangle into the stack, its Q in place.
static void qr_block_task(void *ctx, int64_t b)
{
    qr_job *j = ctx;
    int64_t r0 = qr_start(j, b), nr = qr_len(j, b), ns = j->nb * j->l;
    int l = j->l;
    double *h = j->h + r0 * l, tau[l];
    for (int64_t i = 0; i < nr; i++)
        for (int c = 0; c < l; c++)
            h[c * nr + i] = j->x[(r0 + i) * l + c];
    lapack_int info = LAPACKE_dgeqrf(LAPACK_COL_MAJOR, (lapack_int)nr, l, h, (lapack_int)nr, tau);
    for (int c = 0; c < l; c++)
        for (int i = 0; i < l; i++)
            j->s[c * ns + b * l + i] = i <= c ? h[c * nr + i] : 0.0;
    if (info == 0)
        info = LAPACKE_dorgqr(LAPACK_COL_MAJOR, (lapack_int)nr, l, l, h, (lapack_int)nr, tau);
    if (info != 0)
        atomic_store(&j->failed, true);
}

// Block b's rows of the basis: its Q times its l rows of the stack's Q, into x as float32.
static void qr_product_task(void *ctx, int64_t b)
{
    qr_job *j = ctx;
    int64_t r0 = qr_start(j, b), nr = qr_len(j, b), ns = j->nb * j->l;
    int l = j->l;
    double *q = malloc((size_t)(nr * l) * sizeof *q);
    if (!q) {
        atomic_store(&j->nomem, true);
        return;
    }
    cblas_dgemm(CblasColMajor, CblasNoTrans, CblasNoTrans, (int)nr, l, l, 1.0, j->h + r0 * l, (int)nr,
                j->s + b * l, (int)ns, 0.0, q, (int)nr);
    for (int64_t i = 0; i < nr; i++)
        for (int c = 0; c < l; c++)
            j->x[(r0 + i) * l + c] = (float)q[c * nr + i];
    free(q);
}

// Copies the upper triangle of the column-major l × l matrix at s (leading dimension ld) into r,
// row-major, zeros below.
static void copy_triangle(const double *s, int64_t ld, int l, double *r)
{
    for (int i = 0; i < l; i++)
        for (int c = 0; c < l; c++)
            r[i * l + c] = i <= c ? s[c * ld + i] : 0.0;
}

// The QR by blocks above of f [n, l] (row-major, float), its basis back into f, its R [l, l]
// (row-major) into r where r is not NULL; h: n × l doubles.
static lm_status tsqr(lm_pool *pool, float *f, int64_t n, int l, double *h, double *r, lm_err *err)
{
    qr_job j = {.x = f, .h = h, .n = n, .l = l};
    j.rows = blocks(n, l, &j.nb);
    if (!(j.s = malloc((size_t)(j.nb * l * l) * sizeof *j.s)))
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    lm_pool_run(pool, j.nb, qr_block_task, &j);
    if (j.nb > 1 && !j.failed) {
        int64_t ns = j.nb * l;
        double tau[l];
        lapack_int info = LAPACKE_dgeqrf(LAPACK_COL_MAJOR, (lapack_int)ns, l, j.s, (lapack_int)ns, tau);
        if (info == 0 && r)
            copy_triangle(j.s, ns, l, r);
        if (info == 0)
            info = LAPACKE_dorgqr(LAPACK_COL_MAJOR, (lapack_int)ns, l, l, j.s, (lapack_int)ns, tau);
        if (info != 0)
            j.failed = true;
        else
            lm_pool_run(pool, j.nb, qr_product_task, &j);
    } else if (!j.failed) {
        for (int64_t i = 0; i < n; i++)  // one block: its Q is the basis, its triangle R
            for (int c = 0; c < l; c++)
                f[i * l + c] = (float)h[c * n + i];
        if (r)
            copy_triangle(j.s, l, l, r);
    }
    free(j.s);
    if (j.nomem)
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    if (j.failed)
        return lm_err_set(err, LM_ERR_FORMAT, "the QR of a %lld x %d matrix failed (LAPACK)", (long long)n, l);
    return LM_OK;
}

// ---- Cholesky QR ------------------------------------------------------------------------------
// Where the matrix is well conditioned (a Gaussian sketch of a matrix whose spectrum is not steep:
// a full fine-tune's random change), its basis is made twice by Cholesky QR (CholeskyQR2):
// G = XᵀX, R = chol(G), X = X·R⁻¹, then once more on the result, which makes it orthonormal to
// double rounding. It is level-3 work (the Gram matrices and the solves, by blocks of rows on the
// pool's threads, the blocks' Gram matrices added in block order), a quarter of the QR by blocks'
// time at 74 columns. A matrix whose R is not well conditioned (a low-rank change, a steep
// spectrum after the power iteration) takes the QR by blocks. The test: LAPACK's estimate of
// κ₁(R), times three (the estimate's slack) and times l (κ₂ <= l·κ₁), at most CHOL_COND, which
// admits κ₁(R) up to about 4,500 at 74 columns, the order of CholeskyQR2's proven sufficient
// bound (Yamamoto et al., 2015: 8·κ₂·√(n·l·u + l(l+1)·u) <= 1, about 4,000 for a 128,256 x 74
// matrix) and far below where its Cholesky factor in double fails (κ₂ near 1e8).
#define CHOL_COND 1e6
// One pass is enough where the same bound on κ₂ (three times l over LAPACK's reciprocal estimate)
// is at most CHOL_ONE: one Cholesky QR loses orthogonality of about κ₂²·u (u = 1.1e-16 in double),
// 1e-8 here, under the float32 rounding (6e-8) of the basis as it is stored. A Gaussian sketch of
// a change with a flat spectrum (a full fine-tune's random change) takes one pass; a steep one
// after the power iteration, two.
#define CHOL_ONE 1e4

typedef struct chol_job {
    const float *x;  // [n, l] row-major: the matrix
    double *h;       // [n, l] row-major: x in double, then x·R⁻¹, then x·R⁻¹·R₂⁻¹
    double *g;       // [nb, l, l]: each block's Gram matrix (upper triangle, row-major)
    const double *r; // [l, l] row-major: the triangle the solves divide by
    float *out;      // where the last solve writes the basis as float32 (NULL: not yet)
    int64_t n, rows, nb;  // the matrix's rows, a block's, the blocks (blocks())
    int l;
} chol_job;

// The job over x [n, l] (h its scratch).
static chol_job chol_job_for(const float *x, double *h, int64_t n, int l)
{
    chol_job j = {.x = x, .h = h, .n = n, .l = l};
    j.rows = blocks(n, l, &j.nb);
    return j;
}

static int64_t chol_len(const chol_job *j, int64_t b)
{
    return block_len(j->n, j->rows, j->nb, b);
}

// Block b's Gram matrix (x converted first on the first pass).
static void chol_gram_task(void *ctx, int64_t b)
{
    chol_job *j = ctx;
    int64_t r0 = b * j->rows, nr = chol_len(j, b);
    double *h = j->h + r0 * j->l;
    if (j->x)
        for (int64_t i = 0; i < nr * j->l; i++)
            h[i] = j->x[r0 * j->l + i];
    cblas_dsyrk(CblasRowMajor, CblasUpper, CblasTrans, j->l, (int)nr, 1.0, h, j->l, 0.0, j->g + b * j->l * j->l,
                j->l);
}

// Block b divided by r (on the last pass also written to out as float32).
static void chol_solve_task(void *ctx, int64_t b)
{
    chol_job *j = ctx;
    int64_t r0 = b * j->rows, nr = chol_len(j, b);
    double *h = j->h + r0 * j->l;
    cblas_dtrsm(CblasRowMajor, CblasRight, CblasUpper, CblasNoTrans, CblasNonUnit, (int)nr, j->l, 1.0, j->r, j->l,
                h, j->l);
    if (j->out)
        for (int64_t i = 0; i < nr * j->l; i++)
            j->out[r0 * j->l + i] = (float)h[i];
}

// The blocks' Gram matrices (x converted first where j->x is set, which then is not), their sum
// in block order into the upper triangle of g [l, l] (row-major; the rest zero).
static void gram_sum(lm_pool *pool, chol_job *j, double *g)
{
    int l = j->l;
    lm_pool_run(pool, j->nb, chol_gram_task, j);
    j->x = NULL;
    memset(g, 0, (size_t)l * l * sizeof *g);
    for (int64_t b = 0; b < j->nb; b++)
        for (int p = 0; p < l; p++)
            for (int q = p; q < l; q++)
                g[p * l + q] += j->g[(b * l + p) * l + q];
}

// One pass: the blocks' Gram matrices, their sum's Cholesky factor R (upper, row-major, into r),
// and (where check is set) whether R is well conditioned, and whether well enough for this pass
// to be the only one (CHOL_ONE: j->out set to one_out, where one_out is not NULL); then the
// solves. False where the factor fails or is not well conditioned (nothing divided).
static bool chol_pass(lm_pool *pool, chol_job *j, double *r, bool check, float *one_out)
{
    int l = j->l;
    gram_sum(pool, j, r);
    // the upper triangle row-major is the lower one column-major: LAPACK's 'L' factor there is
    // Rᵀ column-major, which is R row-major
    if (LAPACKE_dpotrf(LAPACK_COL_MAJOR, 'L', l, r, l) != 0)
        return false;
    for (int p = 0; p < l; p++)
        for (int q = 0; q < p; q++)
            r[p * l + q] = 0.0;
    if (check) {
        double rcond = 0;
        if (LAPACKE_dtrcon(LAPACK_ROW_MAJOR, '1', 'U', 'N', l, r, l, &rcond) != 0 ||
            !(rcond * CHOL_COND >= 3.0 * l))
            return false;
        if (one_out && rcond * CHOL_ONE >= 3.0 * l)
            j->out = one_out;  // this pass is the last: its solves write the basis
    }
    j->r = r;
    lm_pool_run(pool, j->nb, chol_solve_task, j);
    return true;
}

// The basis of f [n, l] by CholeskyQR2 into f (by one pass where that is enough, CHOL_ONE: *passes
// says how many), and R = R₂·R₁ (or R₁) [l, l] (row-major) into r where r is not NULL, *done
// set; *done false (f untouched: only the last pass's solves write it, after its factor) where
// the matrix is not well conditioned.
static lm_status cholqr2(lm_pool *pool, float *f, int64_t n, int l, double *h, double *r, bool *done, int *passes,
                         lm_err *err)
{
    chol_job j = chol_job_for(f, h, n, l);
    double *r1 = malloc((size_t)l * l * sizeof *r1), *r2 = malloc((size_t)l * l * sizeof *r2);
    if (!r1 || !r2 || !(j.g = malloc((size_t)(j.nb * l * l) * sizeof *j.g))) {
        free(r1);
        free(r2);
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    }
    *done = chol_pass(pool, &j, r1, true, f);
    bool one = j.out != NULL;
    if (*done && !one) {
        j.out = f;
        *done = chol_pass(pool, &j, r2, false, NULL);
    }
    *passes = one ? 1 : 2;
    if (*done && r && one)
        memcpy(r, r1, (size_t)l * l * sizeof *r);
    else if (*done && r)  // both upper triangular: R's row i from column i on
        for (int i = 0; i < l; i++)
            for (int c = 0; c < l; c++) {
                double x = 0;
                for (int q = i; q <= c; q++)
                    x += r2[i * l + q] * r1[q * l + c];
                r[i * l + c] = x;
            }
    free(r1);
    free(r2);
    free(j.g);
    return LM_OK;
}

// The upper triangle of xᵀ·x [l, l] (row-major, double) into g, x [n, l] row-major float, as
// CholeskyQR's first pass makes it (h: n × l doubles of scratch).
static lm_status host_gram(lm_pool *pool, const float *x, int64_t n, int l, double *h, double *g, lm_err *err)
{
    chol_job j = chol_job_for(x, h, n, l);
    if (!(j.g = malloc((size_t)(j.nb * l * l) * sizeof *j.g)))
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    gram_sum(pool, &j, g);
    free(j.g);
    return LM_OK;
}

// The QR of the host matrix f [n, l] (row-major, float): its orthonormal basis Q back into f, R
// [l, l] (row-major, upper) into r where r is not NULL; by Cholesky QR where the matrix is well
// conditioned (*n_cholesky counts it, and *n_one where n_one is not NULL if one pass made it),
// else by the QR by blocks. h: n × l doubles of scratch.
static lm_status host_qr(lm_pool *pool, float *f, int64_t n, int l, double *h, double *r, int *n_cholesky,
                         int *n_one, lm_err *err)
{
    bool done = false;
    int passes = 0;
    lm_status s = cholqr2(pool, f, n, l, h, r, &done, &passes, err);
    *n_cholesky += done;
    if (n_one)
        *n_one += done && passes == 1;
    if (s == LM_OK && !done)
        s = tsqr(pool, f, n, l, h, r, err);
    return s;
}

// Replaces the device matrix x [n, l] (row-major) by an orthonormal basis of its columns, made
// in double on the host (host_qr; f: n × l floats of scratch).
static lm_status orthonormalise(lm_dev *dev, lm_pool *pool, float *x, int64_t n, int l, double *h, float *f,
                                lm_lowrank *out, lm_err *err)
{
    double t = lm_now();
    lm_status s = lm_dev_download(dev, f, x, (size_t)(n * l) * sizeof *f, err);
    double t1 = lm_now();
    out->device_s += t1 - t;
    if (s == LM_OK)
        s = host_qr(pool, f, n, l, h, NULL, &out->bases_cholesky, &out->bases_one_pass, err);
    out->host_s += lm_now() - t1;
    if (s != LM_OK)
        return s;
    t = lm_now();
    s = lm_dev_upload(dev, x, f, (size_t)(n * l) * sizeof *f, err);
    out->device_s += lm_now() - t;
    return s;
}

// ---- products on the host ---------------------------------------------------------------------
#define PRODUCT_ROWS 512  // rows per task (as QR_ROWS, for as many cores)

typedef struct product_job {
    const float *q;    // [n, l] row-major
    const double *u;   // [l, l] row-major: its first r columns
    double *out;       // [n, r] row-major
    int64_t n;
    int l, r;
    atomic_bool nomem;
} product_job;

static void product_task(void *ctx, int64_t t)
{
    product_job *j = ctx;
    int64_t r0 = t * PRODUCT_ROWS, nr = j->n - r0 < PRODUCT_ROWS ? j->n - r0 : PRODUCT_ROWS;
    double *q = malloc((size_t)(nr * j->l) * sizeof *q);
    if (!q) {
        atomic_store(&j->nomem, true);
        return;
    }
    for (int64_t i = 0; i < nr * j->l; i++)
        q[i] = j->q[r0 * j->l + i];
    cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)nr, j->r, j->l, 1.0, q, j->l, j->u, j->l, 0.0,
                j->out + r0 * j->r, j->r);
    free(q);
}

// out [n, r] = q [n, l] (float, row-major) · u[:, :r] (u [l, l] row-major), in double, by blocks of
// rows on the pool's threads (the blocks by the shape alone, so the bits do not depend on them).
static lm_status host_product(lm_pool *pool, const float *q, int64_t n, int l, const double *u, int r, double *out,
                              lm_err *err)
{
    product_job j = {.q = q, .u = u, .out = out, .n = n, .l = l, .r = r};
    lm_pool_run(pool, (n + PRODUCT_ROWS - 1) / PRODUCT_ROWS, product_task, &j);
    return atomic_load(&j.nomem) ? lm_err_set(err, LM_ERR_NOMEM, "out of memory") : LM_OK;
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
    double *h = malloc((size_t)(big * l) * sizeof *h), *rx = malloc((size_t)l * l * sizeof *rx);
    double *ur = malloc((size_t)l * l * sizeof *ur), *vrt = malloc((size_t)l * l * sizeof *vrt);
    double *sig = malloc((size_t)l * sizeof *sig), *sup = malloc((size_t)l * sizeof *sup);
    float *f = malloc((size_t)(big * l) * sizeof *f);
    lm_status s = LM_OK;
    double norm2 = 0;
    lm_pool *pool = NULL;  // the host's work (Ω, the QRs, the products) on the device's host threads
    if (!h || !rx || !ur || !vrt || !sig || !sup || !f) {
        s = lm_err_set(err, LM_ERR_NOMEM, "out of memory");
        goto done;
    }
    if ((s = lm_pool_create(&pool, lm_dev_threads(dev), err)) != LM_OK)
        goto done;
    double t_dev = lm_now();
    s = sum_squares(dev, m, rows, cols, &norm2, err);
    out->device_s += lm_now() - t_dev;
    if (s != LM_OK)
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
        (s = lm_dev_alloc(dev, (size_t)(rows * l) * sizeof(float), (void **)&b.y, err)) != LM_OK)
        goto done;
    normal_job nj = {.key = o->key, .n = cols * l, .out = f};
    double t_host = lm_now();
    lm_pool_run(pool, (nj.n + 2 * NORMAL_PAIRS - 1) / (2 * NORMAL_PAIRS), normal_task, &nj);
    out->host_s += lm_now() - t_host;
    // (the products' time is the device's: where they run asynchronously, the download after
    // each waits for it)
    t_dev = lm_now();
    s = lm_dev_upload(dev, b.omega, f, (size_t)(cols * l) * sizeof *f, err);
    if (s == LM_OK)
        s = lm_dev_gemm(dev, false, false, rows, l, cols, 1.0f, m, cols, b.omega, l, 0.0f, b.y, l, err);
    out->device_s += lm_now() - t_dev;
    if (s != LM_OK || (s = orthonormalise(dev, pool, b.y, rows, l, h, f, out, err)) != LM_OK)
        goto done;
    for (int it = 0; it < o->power_iters; it++) {
        t_dev = lm_now();
        s = lm_dev_gemm(dev, true, false, cols, l, rows, 1.0f, m, cols, b.y, l, 0.0f, b.omega, l, err);
        out->device_s += lm_now() - t_dev;
        if (s != LM_OK || (s = orthonormalise(dev, pool, b.omega, cols, l, h, f, out, err)) != LM_OK)
            goto done;
        t_dev = lm_now();
        s = lm_dev_gemm(dev, false, false, rows, l, cols, 1.0f, m, cols, b.omega, l, 0.0f, b.y, l, err);
        out->device_s += lm_now() - t_dev;
        if (s != LM_OK || (s = orthonormalise(dev, pool, b.y, rows, l, h, f, out, err)) != LM_OK)
            goto done;
    }
    // X = Mᵀ·Q [cols, l] (the narrow product, as above; in Ω's buffer, free now), the transpose
    // of Q'·M, and its SVD in double on the host: X = Q_X·R (host_qr), R = U_R·Σ·V_Rᵀ, so that
    // X = (Q_X·U_R)·Σ·V_Rᵀ and Q'·M = V_R·Σ·(Q_X·U_R)ᵀ: its left singular vectors V_R, its right
    // ones Q_X·U_R
    int x_cholesky = 0;
    t_dev = lm_now();
    s = lm_dev_gemm(dev, true, false, cols, l, rows, 1.0f, m, cols, b.y, l, 0.0f, b.omega, l, err);
    if (s == LM_OK)
        s = lm_dev_download(dev, f, b.omega, (size_t)(l * cols) * sizeof *f, err);
    out->device_s += lm_now() - t_dev;
    if (s != LM_OK)
        goto done;
    t_host = lm_now();  // from here to the download of Q, and from that to the residual: the host's
    if ((s = host_qr(pool, f, cols, l, h, rx, &x_cholesky, NULL, err)) != LM_OK)
        goto done;
    lapack_int info = LAPACKE_dgesvd(LAPACK_ROW_MAJOR, 'A', 'A', l, l, rx, l, sig, ur, l, vrt, l, sup);
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
    if (r == 0) {
        out->host_s += lm_now() - t_host;
        goto done;
    }

    // A = √Σ_r·(Q_X·U_R)_rᵀ [r, cols], then B = Q·V_R,r·√Σ_r [rows, r] (h holds each product)
    out->b = malloc((size_t)(rows * r) * sizeof *out->b);
    out->a = malloc((size_t)(r * cols) * sizeof *out->a);
    if (!out->b || !out->a) {
        s = lm_err_set(err, LM_ERR_NOMEM, "out of memory");
        goto done;
    }
    if ((s = host_product(pool, f, cols, l, ur, r, h, err)) != LM_OK)
        goto done;
    for (int q = 0; q < r; q++) {
        double w = sqrt(sig[q]);
        for (int64_t c = 0; c < cols; c++)
            out->a[q * cols + c] = (float)(w * h[c * r + q]);
    }
    for (int i = 0; i < l; i++)  // V_R row-major, into rx (free again)
        for (int q = 0; q < l; q++)
            rx[i * l + q] = vrt[q * l + i];
    out->host_s += lm_now() - t_host;
    t_dev = lm_now();
    s = lm_dev_download(dev, f, b.y, (size_t)(rows * l) * sizeof *f, err);
    out->device_s += lm_now() - t_dev;
    if (s != LM_OK)
        goto done;
    t_host = lm_now();
    if ((s = host_product(pool, f, rows, l, rx, r, h, err)) != LM_OK)
        goto done;
    for (int64_t i = 0; i < rows; i++)
        for (int q = 0; q < r; q++)
            out->b[i * r + q] = (float)(h[i * r + q] * sqrt(sig[q]));

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
    out->host_s += lm_now() - t_host;
    // the error. ‖M − B·A‖² = ‖M‖² − 2⟨M, B·A⟩ + ‖B·A‖², with ⟨M, B·A⟩ = Σ B ∘ (M·Aᵀ), one narrow
    // product on the device (the range's shape), and ‖B·A‖² = ⟨BᵀB, A·Aᵀ⟩ from two r × r Gram
    // matrices: one pass over M, against the residual's product of M's size and its three passes.
    // The sum cancels: where it leaves less than RESIDUAL_EXACT of ‖M‖² (a change of about rank r
    // or less), rounding would be too large a part of it, and the residual M − B·A itself is made
    // and summed, a chunk of rows at a time.
    double t_res = lm_now(), gb_ga = 0, m_ba = 0;
    float *at = f, *g = f;  // Aᵀ [cols, r], then M·Aᵀ [rows, r]
    for (int q = 0; q < r; q++)
        for (int64_t c = 0; c < cols; c++)
            at[c * r + q] = out->a[q * cols + c];
    if ((s = host_gram(pool, at, cols, r, h, ur, err)) != LM_OK ||
        (s = host_gram(pool, out->b, rows, r, h, rx, err)) != LM_OK ||
        (s = lm_dev_alloc(dev, (size_t)(r * cols) * sizeof(float), (void **)&b.fa, err)) != LM_OK ||
        (s = lm_dev_alloc(dev, (size_t)(rows * r) * sizeof(float), (void **)&b.fb, err)) != LM_OK ||
        (s = lm_dev_upload(dev, b.fa, at, (size_t)(r * cols) * sizeof(float), err)) != LM_OK ||
        (s = lm_dev_gemm(dev, false, false, rows, r, cols, 1.0f, m, cols, b.fa, r, 0.0f, b.fb, r, err)) != LM_OK ||
        (s = lm_dev_download(dev, g, b.fb, (size_t)(rows * r) * sizeof(float), err)) != LM_OK) {
        out->residual_s = lm_now() - t_res;  // kept for the caller's account of a redo
        goto done;
    }
    for (int p = 0; p < r; p++)  // the upper triangles: the diagonal once, the rest twice
        for (int q = p; q < r; q++)
            gb_ga += (p == q ? 1.0 : 2.0) * rx[p * r + q] * ur[p * r + q];
    for (int64_t i = 0; i < rows * r; i++)
        m_ba += (double)out->b[i] * g[i];
    double res2 = norm2 - 2.0 * m_ba + gb_ga;
    if (res2 >= RESIDUAL_EXACT * norm2) {
        out->err = sqrt(res2 / norm2);
        out->residual_s = lm_now() - t_res;
        goto done;
    }
    int64_t chunk = RESIDUAL_ROWS_ELEMS / cols > 0 ? RESIDUAL_ROWS_ELEMS / cols : 1;
    chunk = chunk < rows ? chunk : rows;
    if ((s = lm_dev_alloc(dev, (size_t)(chunk * cols) * sizeof(float), (void **)&b.res, err)) != LM_OK ||
        (s = lm_dev_upload(dev, b.fb, out->b, (size_t)(rows * r) * sizeof(float), err)) != LM_OK ||
        (s = lm_dev_upload(dev, b.fa, out->a, (size_t)(r * cols) * sizeof(float), err)) != LM_OK)
        goto done;
    out->err_residual = true;
    res2 = 0;
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
    out->residual_s = lm_now() - t_res;

done:
    lm_pool_free(pool);
    free_bufs(dev, &b);
    free(h);
    free(rx);
    free(ur);
    free(vrt);
    free(sig);
    free(sup);
    free(f);
#ifdef __GLIBC__
    // what was freed may stay in the allocator's heaps (glibc keeps up to twice its adaptive mmap
    // threshold, as much as 64 MiB, at a heap's top): given back, so that the peak of the merge
    // around does not carry it (63 MB at rank 64 on the 1B-shape benchmark)
    malloc_trim(0);
#endif
    if (s != LM_OK) {  // the factors go; the times stay, for the caller's account of a redo
        double host_s = out->host_s, residual_s = out->residual_s, device_s = out->device_s;
        lm_lowrank_free(out);
        out->host_s = host_s;
        out->residual_s = residual_s;
        out->device_s = device_s;
    }
    return s;
}
