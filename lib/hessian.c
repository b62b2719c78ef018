// Hessians of the linear layers' inputs from activation capture, and the importance that
// SparseGPT-style sparsification derives from them (hessian.h).
#include "hessian.h"

#include <inttypes.h>
#include <stdio.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "signals.h"
#include "util.h"

// ==== accumulators ============================================================================

static size_t acc_bytes(const lm_hess *h, lm_fwd_point p)
{
    return (size_t)h->dim[p] * (size_t)h->dim[p] * sizeof(float);
}

void lm_hess_free(lm_hess *h)
{
    int64_t n = h->n_layers * LM_FWD_N_POINTS;
    for (int64_t i = 0; i < n; i++) {
        if (h->on_dev && h->on_dev[i])
            lm_dev_buf_free(h->dev, h->on_dev[i]);
        if (h->on_host)
            free(h->on_host[i]);
    }
    free(h->on_dev);
    free(h->on_host);
    free(h->dev_upper);
    free(h->host_upper);
    free(h->dev_fresh);
    free(h->stage);
    memset(h, 0, sizeof *h);
}

// Allocates the (layer, point) accumulator on h->dev, not zeroed: the first batch that reaches
// it overwrites it (beta 0), and lm_hess_capture_end zeroes one no batch reached. Zeroing every
// accumulator here cost a pass over all of them (5 GB for a 1B model) on one thread, on top of
// the page faults that the first batch now takes on every thread. LM_ERR_DEVICE_OOM when it
// does not fit (with reserve kept free).
static lm_status place_on_dev(lm_hess *h, int64_t i, lm_fwd_point p, size_t reserve, lm_err *err)
{
    size_t need = acc_bytes(h, p), free_b = 0, total_b = 0;
    lm_dev_mem_info(h->dev, &free_b, &total_b);
    if (!lm_dev_host_memory(h->dev) && (free_b < need || free_b - need < reserve))
        return lm_err_set(err, LM_ERR_DEVICE_OOM, "%s: %zu bytes free, %zu needed and %zu kept for activations",
                          lm_dev_name(h->dev), free_b, need, reserve);
    void *ptr = NULL;
    lm_status s = lm_dev_alloc(h->dev, need, &ptr, err);
    if (s != LM_OK)
        return s;
    h->on_dev[i] = ptr;
    h->dev_fresh[i] = true;
    h->dev_bytes += need;
    return LM_OK;
}

lm_status lm_hess_init(lm_hess *h, const lm_model *m, lm_dev *dev, bool on_device, size_t reserve, lm_err *err)
{
    memset(h, 0, sizeof *h);
    const lm_config *cfg = &m->config;
    lm_status s;
    h->n_layers = cfg->num_hidden_layers;
    h->dim[LM_FWD_ATTN_IN] = cfg->hidden_size;
    h->dim[LM_FWD_O_IN] = cfg->num_attention_heads * cfg->head_dim;
    h->dim[LM_FWD_MLP_IN] = cfg->hidden_size;
    h->dim[LM_FWD_DOWN_IN] = cfg->intermediate_size;
    int64_t n = h->n_layers * LM_FWD_N_POINTS;
    for (int p = 0; p < LM_FWD_N_POINTS; p++)
        if (h->dim[p] <= 0 || h->dim[p] > (1 << 20))
            return lm_err_set(err, LM_ERR_UNSUPPORTED, "a linear input of width %" PRId64 " is out of range",
                              h->dim[p]);
    if ((s = lm_dev_cpu_companion(dev, &h->cpu, err)) != LM_OK)
        return s;
    if (!(h->on_dev = calloc((size_t)n, sizeof *h->on_dev)) || !(h->on_host = calloc((size_t)n, sizeof *h->on_host)) ||
        !(h->dev_upper = calloc((size_t)n, sizeof *h->dev_upper)) ||
        !(h->host_upper = calloc((size_t)n, sizeof *h->host_upper)) ||
        !(h->dev_fresh = calloc((size_t)n, sizeof *h->dev_fresh))) {
        lm_hess_free(h);
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory for %" PRId64 " Hessian accumulators", n);
    }
    h->dev = on_device ? dev : NULL;
    bool dev_full = !on_device;
    for (int64_t l = 0; l < h->n_layers; l++)
        for (int p = 0; p < LM_FWD_N_POINTS; p++) {
            int64_t i = lm_hess_index(l, (lm_fwd_point)p);
            if (!dev_full) {
                lm_err why = {0};
                s = place_on_dev(h, i, (lm_fwd_point)p, reserve, &why);
                if (s == LM_OK)
                    continue;
                if (s != LM_ERR_DEVICE_OOM) {
                    *err = why;
                    lm_hess_free(h);
                    return lm_err_prefix(err, "Hessian accumulator of layer %" PRId64, l);
                }
                // one that does not fit ends the device's share: the rest go to the host, in order
                dev_full = true;
            }
            if (!(h->on_host[i] = calloc(1, acc_bytes(h, (lm_fwd_point)p)))) {
                lm_hess_free(h);
                return lm_err_set(err, LM_ERR_NOMEM, "out of memory for a Hessian accumulator (%zu bytes)",
                                  acc_bytes(h, (lm_fwd_point)p));
            }
            h->n_host++;
        }
    return LM_OK;
}

char *lm_hess_name(char *buf, size_t cap, int64_t layer, lm_fwd_point p)
{
    snprintf(buf, cap, "model.layers.%" PRId64 ".%s", layer, lm_fwd_point_module(p));
    return buf;
}

// ==== capture =================================================================================

// A failure inside the hook, as a status that never makes a runner redo the batch.
static lm_status hook_error(lm_status s, int layer, lm_fwd_point p, lm_err *err)
{
    if (s == LM_ERR_DEVICE_OOM)
        err->status = s = LM_ERR_DEVICE;
    char name[128];
    return lm_err_prefix(err, "Hessian of %s", lm_hess_name(name, sizeof name, layer, p));
}

// acc (cols × cols, on d) += Xᵀ X for the rows × cols batch x (on d), or acc = Xᵀ X when *fresh
// (acc not yet written: what it holds is not read): by syrk where d has it, its upper triangle
// only (*upper then set), else by GEMM, all of it.
static lm_status add_xtx(lm_dev *d, float *acc, bool *upper, bool *fresh, const float *x, int64_t rows, int64_t cols,
                         lm_err *err)
{
    float beta = *fresh ? 0.0f : 1.0f;
    lm_status s;
    if (lm_dev_supports(d, LM_OP_SYRK)) {
        *upper = true;
        s = lm_dev_syrk(d, cols, rows, 1.0f, x, cols, beta, false, acc, cols, err);
    } else {  // op(A) = Xᵀ is [cols, rows]
        s = lm_dev_gemm(d, true, false, cols, cols, rows, 1.0f, x, cols, x, cols, beta, acc, cols, err);
    }
    if (s == LM_OK)
        *fresh = false;
    return s;
}

lm_status lm_hess_hook(void *ctx, lm_dev *dev, int layer, lm_fwd_point point, const float *x, int64_t rows,
                       int64_t cols, lm_err *err)
{
    lm_hess *h = ctx;
    if (layer < 0 || layer >= h->n_layers || point < 0 || point >= LM_FWD_N_POINTS || cols != h->dim[point])
        return lm_err_set(err, LM_ERR_MISMATCH, "capture of layer %d point %d with %" PRId64 " columns does not fit "
                          "the Hessians", layer, (int)point, cols);
    int64_t i = lm_hess_index(layer, point);
    lm_status s;
    if (rows == 0)
        return LM_OK;
    if (dev == h->dev && h->on_dev[i]) {
        // H += Xᵀ X on the device that ran the batch
        if ((s = add_xtx(dev, h->on_dev[i], &h->dev_upper[i], &h->dev_fresh[i], x, rows, cols, err)) != LM_OK)
            return hook_error(s, layer, point, err);
    } else {
        const float *hx = x;
        if (!lm_dev_host_memory(dev)) {
            // the accumulator is in host memory: bring the batch there
            int64_t need = rows * cols;
            if (need > h->stage_len) {
                float *p = realloc(h->stage, (size_t)need * sizeof *p);
                if (!p)
                    return hook_error(lm_err_set(err, LM_ERR_NOMEM, "out of memory (%" PRId64 " floats)", need), layer,
                                      point, err);
                h->stage = p;
                h->stage_len = need;
            }
            if ((s = lm_dev_download(dev, h->stage, x, (size_t)need * sizeof(float), err)) != LM_OK)
                return hook_error(s, layer, point, err);
            hx = h->stage;
        }
        if (!h->on_host[i] && !(h->on_host[i] = calloc(1, acc_bytes(h, point))))
            return hook_error(lm_err_set(err, LM_ERR_NOMEM, "out of memory (%zu bytes)", acc_bytes(h, point)), layer,
                              point, err);
        bool zeroed = false;  // calloc's
        if ((s = add_xtx(h->cpu, h->on_host[i], &h->host_upper[i], &zeroed, hx, rows, cols, err)) != LM_OK)
            return hook_error(s, layer, point, err);
    }
    if (layer == 0 && point == 0)
        h->n_tokens += rows;
    return LM_OK;
}

// Zeroes the device accumulator i, which no batch reached (all ran on the CPU, or none ran).
static lm_status zero_on_dev(lm_hess *h, int64_t i, size_t bytes, lm_err *err)
{
    if (lm_dev_host_memory(h->dev)) {
        memset(h->on_dev[i], 0, bytes);
        return LM_OK;
    }
    float *zeros = malloc(bytes);
    if (!zeros)
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory (%zu bytes)", bytes);
    memset(zeros, 0, bytes);
    lm_status s = lm_dev_upload(h->dev, h->on_dev[i], zeros, bytes, err);
    free(zeros);
    return s;
}

lm_status lm_hess_capture_end(lm_hess *h, lm_err *err)
{
    int64_t n = h->n_layers * LM_FWD_N_POINTS;
    for (int64_t i = 0; i < n; i++) {
        lm_fwd_point p = (lm_fwd_point)(i % LM_FWD_N_POINTS);
        int64_t d = h->dim[p];
        lm_status s = LM_OK;
        if (h->on_dev[i] && h->dev_fresh[i] && (s = zero_on_dev(h, i, acc_bytes(h, p), err)) == LM_OK)
            h->dev_fresh[i] = false;
        if (s == LM_OK && h->dev_upper[i] && h->on_dev[i] &&
            (s = lm_dev_syrk(h->dev, d, 0, 0.0f, NULL, d, 1.0f, true, h->on_dev[i], d, err)) == LM_OK)
            h->dev_upper[i] = false;
        if (s == LM_OK && h->host_upper[i] && h->on_host[i] &&
            (s = lm_dev_syrk(h->cpu, d, 0, 0.0f, NULL, d, 1.0f, true, h->on_host[i], d, err)) == LM_OK)
            h->host_upper[i] = false;
        if (s != LM_OK) {
            char name[128];
            return lm_err_prefix(err, "Hessian of %s", lm_hess_name(name, sizeof name, i / LM_FWD_N_POINTS, p));
        }
    }
    return LM_OK;
}

lm_status lm_hess_capture(lm_hess *h, lm_fwd_runner *r, const lm_fwd_seq *seqs, int64_t n_seqs, lm_err *err)
{
    lm_fwd_req req = {.hook = lm_hess_hook, .hook_ctx = h};
    lm_status s = lm_fwd_runner_run(r, seqs, n_seqs, &req, err);
    return s == LM_OK ? lm_hess_capture_end(h, err) : s;
}

// ==== finished Hessians =======================================================================

// Rows and columns of one tile of the symmetrising pass: a tile and its mirror image, both
// read into small buffers (the mirror transposed), fit in the processor's cache, so that each
// element of the matrix is read once and written once and the arithmetic runs on contiguous
// rows the compiler vectorises.
#define SYM_TILE 64

typedef struct sym_tile {
    float u[SYM_TILE][SYM_TILE];   // out[r0 + i, c0 + j]
    float lt[SYM_TILE][SYM_TILE];  // out[c0 + j, r0 + i]: the mirror, transposed
    float hu[SYM_TILE][SYM_TILE];  // the host accumulator, likewise
    float hlt[SYM_TILE][SYM_TILE];
} sym_tile;

// Reads the n_r × n_c tile of m at (r0, c0) into t and its mirror at (c0, r0) transposed into tm.
static void tile_read(float t[SYM_TILE][SYM_TILE], float tm[SYM_TILE][SYM_TILE], const float *m, int64_t d,
                      int64_t r0, int64_t c0, int64_t n_r, int64_t n_c)
{
    for (int64_t i = 0; i < n_r; i++)
        memcpy(t[i], m + (r0 + i) * d + c0, (size_t)n_c * sizeof(float));
    for (int64_t j = 0; j < n_c; j++) {
        const float *row = m + (c0 + j) * d + r0;
        for (int64_t i = 0; i < n_r; i++)
            tm[i][j] = row[i];
    }
}

// One tile pair of lm_hess_get's pass: t->u becomes float32(0.5 · (a + b) · scale), a and b the
// double sums at [r, c] and [c, r], which are written to both places. The sums are those of a
// pass over a double copy of the matrix (the device's value, or 0.0 without one, plus the
// host's), so the bits are the same.
static void tile_finish(sym_tile *t, float *out, const float *host, bool dev, int64_t d, int64_t r0, int64_t c0,
                        int64_t n_r, int64_t n_c, double scale)
{
    if (dev)
        tile_read(t->u, t->lt, out, d, r0, c0, n_r, n_c);
    if (host)
        tile_read(t->hu, t->hlt, host, d, r0, c0, n_r, n_c);
    for (int64_t i = 0; i < n_r; i++) {
        float *u = t->u[i];
        const float *lt = t->lt[i], *hu = t->hu[i], *hlt = t->hlt[i];
        if (dev && host)
            for (int64_t j = 0; j < n_c; j++)
                u[j] = (float)(0.5 * (((double)u[j] + (double)hu[j]) + ((double)lt[j] + (double)hlt[j])) * scale);
        else if (dev)
            for (int64_t j = 0; j < n_c; j++)
                u[j] = (float)(0.5 * ((double)u[j] + (double)lt[j]) * scale);
        else
            for (int64_t j = 0; j < n_c; j++)
                u[j] = (float)(0.5 * ((0.0 + (double)hu[j]) + (0.0 + (double)hlt[j])) * scale);
    }
    for (int64_t i = 0; i < n_r; i++)
        memcpy(out + (r0 + i) * d + c0, t->u[i], (size_t)n_c * sizeof(float));
    for (int64_t j = 0; j < n_c; j++) {
        float *row = out + (c0 + j) * d + r0;
        for (int64_t i = 0; i < n_r; i++)
            row[i] = t->u[i][j];
    }
}

lm_status lm_hess_get(const lm_hess *h, int64_t layer, lm_fwd_point p, float *out, lm_err *err)
{
    char name[128];
    if (h->n_tokens <= 0)
        return lm_err_set(err, LM_ERR_USAGE, "no tokens were captured");
    int64_t i = lm_hess_index(layer, p), d = h->dim[p];
    if (!h->on_dev[i] && !h->on_host[i])
        return lm_err_set(err, LM_ERR_USAGE, "the Hessian of %s was already released",
                          lm_hess_name(name, sizeof name, layer, p));
    const float *host = h->on_host[i];
    bool dev = h->on_dev[i] != NULL;
    if (dev) {
        lm_status s = lm_dev_download(h->dev, out, h->on_dev[i], acc_bytes(h, p), err);
        if (s != LM_OK)
            return lm_err_prefix(err, "Hessian of %s", lm_hess_name(name, sizeof name, layer, p));
    }
    // In place over out, tile pair by tile pair: each unordered pair {r, c} is read and written
    // once, so no double copy of the matrix is needed, and the result is exactly symmetric.
    sym_tile *t = malloc(sizeof *t);
    if (!t)
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory (%zu bytes)", sizeof *t);
    double scale = 2.0 / (double)h->n_tokens;
    for (int64_t r0 = 0; r0 < d; r0 += SYM_TILE)
        for (int64_t c0 = r0; c0 < d; c0 += SYM_TILE)
            tile_finish(t, out, host, dev, d, r0, c0, d - r0 < SYM_TILE ? d - r0 : SYM_TILE,
                        d - c0 < SYM_TILE ? d - c0 : SYM_TILE, scale);
    free(t);
    return LM_OK;
}

void lm_hess_release(lm_hess *h, int64_t layer, lm_fwd_point p)
{
    int64_t i = lm_hess_index(layer, p);
    if (!h->on_dev || !h->on_host || layer < 0 || layer >= h->n_layers)
        return;
    if (h->on_dev[i]) {
        lm_dev_buf_free(h->dev, h->on_dev[i]);
        h->on_dev[i] = NULL;
        h->dev_bytes -= acc_bytes(h, p);
    }
    free(h->on_host[i]);
    h->on_host[i] = NULL;
}

// ==== importance ==============================================================================

// A = J H J damped, for the factorisation: its lower triangle, row-major (see lm_hess_ucc2_on).
static void damped_reversed(double *A, const float *H, size_t n, double damp)
{
    // The damping: a dead input's zero diagonal becomes 1 (its weights are free to drop), then
    // every diagonal entry gets damp × the diagonal's mean.
    double mean = 0;
    for (size_t c = 0; c < n; c++)
        mean += H[c * n + c] != 0 ? (double)H[c * n + c] : 1.0;
    mean /= (double)n;
    for (size_t r = 0; r < n; r++) {
        const float *h = H + (n - 1 - r) * n + (n - 1);  // H's row n − 1 − r, read backwards
        for (size_t c = 0; c <= r; c++)
            A[r * n + c] = h[-(ptrdiff_t)c];
        double d = A[r * n + r];
        A[r * n + r] = (d != 0 ? d : 1.0) + damp * mean;
    }
}

// The factorisation of A (n × n) on dev, which does not have host memory: copied there and its
// factor's diagonal copied back into diag. LM_ERR_DEVICE_OOM when the matrix, or the
// factorisation's workspace, does not fit.
static lm_status potrf_on(lm_dev *dev, double *A, size_t n, double *diag, lm_err *err)
{
    double *dA = NULL, *dd = NULL;
    lm_status s = lm_dev_alloc(dev, n * n * sizeof *dA, (void **)&dA, err);
    if (s == LM_OK)
        s = lm_dev_alloc(dev, n * sizeof *dd, (void **)&dd, err);
    if (s == LM_OK)
        s = lm_dev_upload(dev, dA, A, n * n * sizeof *dA, err);
    if (s == LM_OK)
        s = lm_dev_potrf(dev, dA, (int64_t)n, dd, err);
    if (s == LM_OK)
        s = lm_dev_download(dev, diag, dd, n * sizeof *dd, err);
    lm_dev_buf_free(dev, dA);
    lm_dev_buf_free(dev, dd);
    return s;
}

lm_status lm_hess_ucc2_on(lm_dev *dev, double *ucc2, const float *H, int64_t cols, double damp, lm_err *err)
{
    if (cols <= 0 || cols > INT32_MAX)
        return lm_err_set(err, LM_ERR_USAGE, "importance of a weight with %" PRId64 " inputs", cols);
    size_t n = (size_t)cols;
    double *A = malloc(n * n * sizeof *A), *diag = malloc(n * sizeof *diag);
    if (!A || !diag) {
        free(A);
        free(diag);
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory (%zu bytes)", n * n * sizeof(double));
    }
    // U, the upper Cholesky factor of H⁻¹, without H⁻¹: with J the reversal of the inputs'
    // order and J H J = L Lᵀ, H⁻¹ = J L⁻ᵀ L⁻¹ J = Mᵀ M for M = J L⁻¹ J, which is upper
    // triangular with a positive diagonal, so U = M and U_cc = 1 / L_jj, j = n − 1 − c. One
    // factorisation, where inverting H and factoring the inverse took three times the work.
    // A holds J H J, damped: its lower triangle, row-major, which is the upper triangle of the
    // same matrix column-major, so dpotrf factors it in place as Uᵀ U with U = Lᵀ (the same
    // diagonal), without the transposed copy LAPACKE's row-major interface would make.
    damped_reversed(A, H, n, damp);
    lm_status s = LM_OK;
    if (dev && !lm_dev_host_memory(dev)) {
        s = potrf_on(dev, A, n, diag, err);
    } else {
        int info;
        if (lm_cpu_potrf(A, cols, diag, &info) != LM_OK)
            s = lm_err_set(err, LM_ERR_FORMAT, "LAPACK dpotrf info %d", info);
    }
    if (s == LM_ERR_FORMAT) {
        char why[LM_ERR_MSG_MAX];
        snprintf(why, sizeof why, "%s", err->msg);
        lm_err_set(err, s, "the damped Hessian (%" PRId64 " x %" PRId64 ") is not positive definite (%s)", cols, cols,
                   why);
    }
    for (size_t c = 0; s == LM_OK && c < n; c++) {
        double l = diag[n - 1 - c];
        ucc2[c] = 1.0 / (l * l);
    }
    free(A);
    free(diag);
    return s;
}

lm_status lm_hess_ucc2(double *ucc2, const float *H, int64_t cols, double damp, lm_err *err)
{
    return lm_hess_ucc2_on(NULL, ucc2, H, cols, damp, err);
}

lm_status lm_hess_importance(float *imp, const float *tau, int64_t rows, int64_t cols, const float *H, double damp,
                             lm_err *err)
{
    if (cols <= 0 || rows < 0 || cols > INT32_MAX)
        return lm_err_set(err, LM_ERR_USAGE, "importance of a %" PRId64 " x %" PRId64 " weight", rows, cols);
    double *ucc2 = malloc((size_t)cols * sizeof *ucc2);
    if (!ucc2)
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    lm_status s = lm_hess_ucc2(ucc2, H, cols, damp, err);
    for (int64_t j = 0; s == LM_OK && j < rows; j++)
        for (int64_t c = 0; c < cols; c++) {
            double t = tau[j * cols + c];
            imp[j * cols + c] = (float)(t * t / ucc2[c]);
        }
    free(ucc2);
    return s;
}

// ==== U_cc² of every Hessian of a model =======================================================

void lm_hess_ucc2_free(double **ucc2, int64_t n)
{
    for (int64_t i = 0; ucc2 && i < n; i++)
        free(ucc2[i]);
    free(ucc2);
}

// One factorisation, a unit of lm_fallback_run: lm_hess_ucc2_on with the damping d.
typedef struct factor {
    double *ucc2;
    const float *H;
    int64_t cols;
    double d;
} factor;

static lm_status factor_work(void *ctx, lm_dev *dev, lm_err *err)
{
    factor *f = ctx;
    return lm_hess_ucc2_on(dev, f->ucc2, f->H, f->cols, f->d, err);
}

lm_status lm_hess_ucc2_raised(lm_dev *dev, double *ucc2, const float *H, int64_t cols, double damp, const char *name,
                              lm_fallback_fn note, void *note_ctx, lm_err *err)
{
    factor f = {ucc2, H, cols, damp};
    char unit[512];
    snprintf(unit, sizeof unit, "factor of %s", name);
    lm_status s;
    for (int tries = 0;; tries++) {
        // the factorisation is the unit that falls back: one that does not fit runs on the CPU
        // (NULL), and so do the later tries with more damping
        lm_fallback_unit u = {.phase = "hessian", .unit = unit, .work = factor_work, .ctx = &f, .say = note,
                              .say_ctx = note_ctx};
        s = lm_fallback_run(&u, dev, NULL, err);
        if (u.fell_back)
            dev = NULL;
        if (s != LM_ERR_FORMAT || tries == 6)
            break;
        char line[256];
        snprintf(line, sizeof line, "the Hessian of %s is not positive definite with damping %g: trying %g", name, f.d,
                 f.d * 10);
        if (note)
            note(note_ctx, line, NULL);
        f.d *= 10;
    }
    return s != LM_OK ? lm_err_prefix(err, "%s", name) : LM_OK;
}

lm_status lm_hess_ucc2_model(const lm_model *m, const lm_adapter *a, lm_dev *dev, const char *label,
                             const lm_fwd_seq *seqs, int64_t n_seqs, double damp, bool sticky,
                             lm_fallback_fn note, void *note_ctx, lm_hess_each_fn each, void *each_ctx,
                             double ***out, int64_t *n_out, lm_err *err)
{
    *out = NULL;
    *n_out = 0;
    lm_fwd_runner runner;
    lm_hess h;
    memset(&runner, 0, sizeof runner);
    memset(&h, 0, sizeof h);
    double **ucc2 = NULL;
    float *H = NULL;
    int64_t n = 0;
    lm_status s = lm_fwd_runner_init(&runner, m, a, dev, "hessian", label, 0, note, note_ctx, err);
    runner.sticky = sticky;
    if (s == LM_OK) {
        // accumulators on the device the weights run on, with room for a batch's activations
        size_t reserve = 0;
        if (runner.on_dev) {
            int64_t longest = 0, tokens = 0;
            for (int64_t i = 0; i < n_seqs; i++) {
                longest = seqs[i].len > longest ? seqs[i].len : longest;
                tokens += seqs[i].len;
            }
            int64_t batch = tokens < runner.max_tokens ? tokens : runner.max_tokens;
            reserve = lm_fwd_arena_bytes(runner.on_dev, batch > longest ? batch : longest);
            reserve = reserve == SIZE_MAX ? 0 : reserve;
        }
        s = lm_hess_init(&h, m, dev, runner.on_dev != NULL, reserve, err);
    }
    if (s == LM_OK)
        s = lm_hess_capture(&h, &runner, seqs, n_seqs, err);
    lm_test_delay();  // LLMERGE_TEST_DELAY_MS: a capture that lasts, for the tests of the cache's lock
    lm_fwd_runner_free(&runner);
    n = h.n_layers * LM_FWD_N_POINTS;
    if (s == LM_OK && !(ucc2 = calloc((size_t)(n > 0 ? n : 1), sizeof *ucc2)))
        s = lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    int64_t most = 0;
    for (int p = 0; p < LM_FWD_N_POINTS; p++)
        most = h.dim[p] > most ? h.dim[p] : most;
    if (s == LM_OK && !(H = malloc((size_t)(most * most) * sizeof *H)))
        s = lm_err_set(err, LM_ERR_NOMEM, "out of memory for a Hessian of %" PRId64 " x %" PRId64, most, most);
    for (int64_t i = 0; s == LM_OK && i < n; i++) {
        int64_t layer = i / LM_FWD_N_POINTS, dim = h.dim[i % LM_FWD_N_POINTS];
        lm_fwd_point pt = (lm_fwd_point)(i % LM_FWD_N_POINTS);
        if (!(ucc2[i] = malloc((size_t)dim * sizeof(double)))) {
            s = lm_err_set(err, LM_ERR_NOMEM, "out of memory");
            break;
        }
        if ((s = lm_hess_get(&h, layer, pt, H, err)) != LM_OK)
            break;
        // one Hessian at a time: its accumulators go before the next is finished
        lm_hess_release(&h, layer, pt);
        if (each && (s = each(each_ctx, layer, pt, H, dim, h.n_tokens, err)) != LM_OK)
            break;
        char name[128];
        s = lm_hess_ucc2_raised(dev, ucc2[i], H, dim, damp, lm_hess_name(name, sizeof name, layer, pt), note,
                                note_ctx, err);
    }
    free(H);
    lm_hess_free(&h);
    if (s != LM_OK) {
        lm_hess_ucc2_free(ucc2, n);
        return s;
    }
    *out = ucc2;
    *n_out = n;
    return LM_OK;
}

// ==== sizes for llmerge plan, and which Hessian a weight reads ================================

void lm_hess_dims(const lm_config *cfg, int64_t dim[LM_FWD_N_POINTS])
{
    // as lm_hess_init sets h->dim
    dim[LM_FWD_ATTN_IN] = cfg->hidden_size;
    dim[LM_FWD_O_IN] = cfg->num_attention_heads * cfg->head_dim;
    dim[LM_FWD_MLP_IN] = cfg->hidden_size;
    dim[LM_FWD_DOWN_IN] = cfg->intermediate_size;
}

bool lm_hess_point_of(const char *tensor, int64_t *layer, lm_fwd_point *point)
{
    // the linear layers each point feeds (run_layer's hooks)
    static const struct { const char *suffix; lm_fwd_point point; } map[] = {
        {"self_attn.q_proj.weight", LM_FWD_ATTN_IN}, {"self_attn.k_proj.weight", LM_FWD_ATTN_IN},
        {"self_attn.v_proj.weight", LM_FWD_ATTN_IN}, {"self_attn.o_proj.weight", LM_FWD_O_IN},
        {"mlp.gate_proj.weight", LM_FWD_MLP_IN},     {"mlp.up_proj.weight", LM_FWD_MLP_IN},
        {"mlp.down_proj.weight", LM_FWD_DOWN_IN},
    };
    const char *prefix = "model.layers.";
    size_t np = strlen(prefix);
    if (strncmp(tensor, prefix, np) != 0 || tensor[np] < '0' || tensor[np] > '9')
        return false;
    char *end;
    long long l = strtoll(tensor + np, &end, 10);
    if (*end != '.' || l < 0)
        return false;
    for (size_t i = 0; i < sizeof map / sizeof map[0]; i++)
        if (strcmp(end + 1, map[i].suffix) == 0) {
            *layer = (int64_t)l;
            *point = map[i].point;
            return true;
        }
    return false;
}

int64_t lm_hess_reserve_tokens(int64_t n_tokens, int64_t longest, int64_t max_tokens)
{
    // lm_hess_ucc2_model's reserve: the runner's first batch is at most this large
    int64_t batch = n_tokens < max_tokens ? n_tokens : max_tokens;
    return batch > longest ? batch : longest;
}

lm_status lm_hess_plan_make(lm_hess_plan *p, const lm_model *m, bool on_device, bool host_memory, uint64_t dev_free,
                            uint64_t reserve, lm_err *err)
{
    memset(p, 0, sizeof *p);
    int64_t dim[LM_FWD_N_POINTS];
    lm_hess_dims(&m->config, dim);
    for (int k = 0; k < LM_FWD_N_POINTS; k++) {
        if (dim[k] <= 0 || dim[k] > (1 << 20))
            return lm_err_set(err, LM_ERR_UNSUPPORTED, "a linear input of width %" PRId64 " is out of range", dim[k]);
        p->max_dim = dim[k] > p->max_dim ? dim[k] : p->max_dim;
    }
    p->n_acc = m->config.num_hidden_layers * LM_FWD_N_POINTS;
    // lm_hess_init: in layer order on the device while dev_free stays at least `reserve`
    // afterwards (a device with host memory takes them all), the first one that does not fit
    // sending it and the rest to host memory
    bool dev_full = !on_device;
    for (int64_t i = 0; i < p->n_acc; i++) {
        uint64_t need = (uint64_t)dim[i % LM_FWD_N_POINTS] * (uint64_t)dim[i % LM_FWD_N_POINTS] * sizeof(float);
        if (!dev_full && (host_memory || (dev_free >= need && dev_free - need >= reserve))) {
            p->n_dev++;
            p->dev_bytes += need;
            if (!host_memory)
                dev_free -= need;
            continue;
        }
        dev_full = true;
        p->host_bytes += need;
    }
    return LM_OK;
}

uint64_t lm_hess_plan_finish(const lm_hess_plan *p, const lm_model *m, bool count_dev, bool host_copies,
                             lm_hess_plan_factor *f)
{
    // no accumulators (n_acc 0): the Hessians come one at a time, only the scratch counts
    int64_t dim[LM_FWD_N_POINTS];
    lm_hess_dims(&m->config, dim);
    int64_t n = m->config.num_hidden_layers * LM_FWD_N_POINTS;
    uint64_t left = 0, most = 0, h = (uint64_t)p->max_dim * (uint64_t)p->max_dim * sizeof(float);
    for (int64_t i = 0; i < p->n_acc; i++) {
        uint64_t d = (uint64_t)dim[i % LM_FWD_N_POINTS], acc = d * d * sizeof(float);
        bool on_dev = i < p->n_dev;
        left += (on_dev ? (count_dev ? acc : 0) + (host_copies ? acc : 0) : acc);
    }
    uint64_t dev_left = 0;  // the accumulators on an accelerator
    for (int64_t i = 0; f && f->budget && i < p->n_dev && i < p->n_acc; i++)
        dev_left += (uint64_t)dim[i % LM_FWD_N_POINTS] * (uint64_t)dim[i % LM_FWD_N_POINTS] * sizeof(float);
    if (f) {
        f->dev_peak = 0;
        f->fallbacks = 0;
    }
    // lm_hess_ucc2_model, per Hessian in index order: it is read into H (the widest, float32),
    // its accumulators are released, then lm_hess_ucc2_raised factors a double copy (with its
    // diagonal) in place, or on the accelerator when it fits there
    for (int64_t i = 0; i < n; i++) {
        uint64_t d = (uint64_t)dim[i % LM_FWD_N_POINTS], acc = d * d * sizeof(float);
        bool on_dev = i < p->n_dev;
        if (i < p->n_acc) {
            left -= (on_dev ? (count_dev ? acc : 0) + (host_copies ? acc : 0) : acc);
            dev_left -= f && f->budget && on_dev ? acc : 0;
        }
        uint64_t now = left + h + d * d * sizeof(double) + d * sizeof(double), factor = (d * d + d) * sizeof(double);
        if (f && f->budget) {
            if (dev_left + factor <= f->budget) {
                f->dev_peak = dev_left + factor > f->dev_peak ? dev_left + factor : f->dev_peak;
                now += f->host_copy ? factor : 0;
            } else {
                f->fallbacks++;
            }
        }
        most = now > most ? now : most;
    }
    return most;
}
