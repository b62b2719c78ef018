// Hessians of the linear layers' inputs from activation capture, and the importance that
// SparseGPT-style sparsification derives from them (hessian.h).
#include "hessian.h"

#include <inttypes.h>
#include <lapacke.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
            lm_dev_release(h->dev, h->on_dev[i]);
        if (h->on_host)
            free(h->on_host[i]);
    }
    free(h->on_dev);
    free(h->on_host);
    free(h->stage);
    lm_dev_free(h->cpu);
    memset(h, 0, sizeof *h);
}

// Allocates the (layer, point) accumulator on h->dev and zeroes it from `zeros` (host, at least
// the accumulator's size). LM_ERR_DEVICE_OOM when it does not fit (with reserve kept free).
static lm_status place_on_dev(lm_hess *h, int64_t i, lm_fwd_point p, size_t reserve, const float *zeros, lm_err *err)
{
    size_t need = acc_bytes(h, p), free_b = 0, total_b = 0;
    lm_dev_mem_info(h->dev, &free_b, &total_b);
    if (!h->dev->host_memory && (free_b < need || free_b - need < reserve))
        return lm_err_set(err, LM_ERR_DEVICE_OOM, "%s: %zu bytes free, %zu needed and %zu kept for activations",
                          lm_dev_name(h->dev), free_b, need, reserve);
    void *ptr = NULL;
    lm_status s = lm_dev_alloc(h->dev, need, &ptr, err);
    if (s != LM_OK)
        return s;
    if ((s = lm_dev_upload(h->dev, ptr, zeros, need, err)) != LM_OK) {
        lm_dev_release(h->dev, ptr);
        return s;
    }
    h->on_dev[i] = ptr;
    h->dev_bytes += need;
    return LM_OK;
}

lm_status lm_hess_init(lm_hess *h, const lm_model *m, lm_dev *dev, size_t reserve, int threads, lm_err *err)
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
    size_t biggest = 0;
    for (int p = 0; p < LM_FWD_N_POINTS; p++) {
        if (h->dim[p] <= 0 || h->dim[p] > (1 << 20))
            return lm_err_set(err, LM_ERR_UNSUPPORTED, "a linear input of width %" PRId64 " is out of range",
                              h->dim[p]);
        biggest = acc_bytes(h, p) > biggest ? acc_bytes(h, p) : biggest;
    }
    if ((s = lm_dev_cpu_create(&h->cpu, threads, err)) != LM_OK)
        return s;
    if (!(h->on_dev = calloc((size_t)n, sizeof *h->on_dev)) || !(h->on_host = calloc((size_t)n, sizeof *h->on_host))) {
        lm_hess_free(h);
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory for %" PRId64 " Hessian accumulators", n);
    }
    h->dev = dev;
    float *zeros = dev ? calloc(1, biggest) : NULL;
    if (dev && !zeros) {
        lm_hess_free(h);
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory (%zu bytes)", biggest);
    }
    bool dev_full = !dev;
    for (int64_t l = 0; l < h->n_layers; l++)
        for (int p = 0; p < LM_FWD_N_POINTS; p++) {
            int64_t i = lm_hess_index(l, (lm_fwd_point)p);
            if (!dev_full) {
                lm_err why = {0};
                s = place_on_dev(h, i, (lm_fwd_point)p, reserve, zeros, &why);
                if (s == LM_OK)
                    continue;
                if (s != LM_ERR_DEVICE_OOM) {
                    *err = why;
                    free(zeros);
                    lm_hess_free(h);
                    return lm_err_prefix(err, "Hessian accumulator of layer %" PRId64, l);
                }
                // one that does not fit ends the device's share: the rest go to the host, in order
                dev_full = true;
            }
            if (!(h->on_host[i] = calloc(1, acc_bytes(h, (lm_fwd_point)p)))) {
                free(zeros);
                lm_hess_free(h);
                return lm_err_set(err, LM_ERR_NOMEM, "out of memory for a Hessian accumulator (%zu bytes)",
                                  acc_bytes(h, (lm_fwd_point)p));
            }
            h->n_host++;
        }
    free(zeros);
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
        // H += Xᵀ X on the device that ran the batch: op(A) = Xᵀ is [cols, rows]
        s = lm_dev_gemm(dev, true, false, cols, cols, rows, 1.0f, x, cols, x, cols, 1.0f, h->on_dev[i], cols, err);
        if (s != LM_OK)
            return hook_error(s, layer, point, err);
    } else {
        const float *hx = x;
        if (!dev->host_memory) {
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
        s = lm_dev_gemm(h->cpu, true, false, cols, cols, rows, 1.0f, hx, cols, hx, cols, 1.0f, h->on_host[i], cols,
                        err);
        if (s != LM_OK)
            return hook_error(s, layer, point, err);
    }
    if (layer == 0 && point == 0)
        h->n_tokens += rows;
    return LM_OK;
}

lm_status lm_hess_capture(lm_hess *h, lm_fwd_runner *r, const lm_fwd_seq *seqs, int64_t n_seqs, lm_err *err)
{
    lm_fwd_req req = {.hook = lm_hess_hook, .hook_ctx = h};
    return lm_fwd_runner_run(r, seqs, n_seqs, &req, err);
}

lm_status lm_hess_get(const lm_hess *h, int64_t layer, lm_fwd_point p, float *out, lm_err *err)
{
    if (h->n_tokens <= 0)
        return lm_err_set(err, LM_ERR_USAGE, "no tokens were captured");
    int64_t i = lm_hess_index(layer, p), d = h->dim[p];
    size_t bytes = acc_bytes(h, p);
    double *sum = calloc((size_t)(d * d), sizeof *sum);
    if (!sum)
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory (%zu bytes)", (size_t)(d * d) * sizeof(double));
    if (h->on_dev[i]) {
        lm_status s = lm_dev_download(h->dev, out, h->on_dev[i], bytes, err);
        if (s != LM_OK) {
            free(sum);
            char name[128];
            return lm_err_prefix(err, "Hessian of %s", lm_hess_name(name, sizeof name, layer, p));
        }
        for (int64_t k = 0; k < d * d; k++)
            sum[k] = out[k];
    }
    if (h->on_host[i])
        for (int64_t k = 0; k < d * d; k++)
            sum[k] += h->on_host[i][k];
    double scale = 2.0 / (double)h->n_tokens;
    for (int64_t r = 0; r < d; r++)
        for (int64_t c = 0; c < d; c++)
            out[r * d + c] = (float)(0.5 * (sum[r * d + c] + sum[c * d + r]) * scale);
    free(sum);
    return LM_OK;
}

// ==== importance ==============================================================================

lm_status lm_hess_ucc2(double *ucc2, const float *H, int64_t cols, double damp, lm_err *err)
{
    if (cols <= 0 || cols > INT32_MAX)
        return lm_err_set(err, LM_ERR_USAGE, "importance of a weight with %" PRId64 " inputs", cols);
    size_t n = (size_t)cols;
    double *A = malloc(n * n * sizeof *A);
    if (!A)
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory (%zu bytes)", n * n * sizeof(double));
    double mean = 0;
    for (size_t i = 0; i < n * n; i++)
        A[i] = H[i];
    for (size_t c = 0; c < n; c++) {
        if (A[c * n + c] == 0)
            A[c * n + c] = 1;  // a dead input: its weights are free to drop
        mean += A[c * n + c];
    }
    mean /= (double)n;
    for (size_t c = 0; c < n; c++)
        A[c * n + c] += damp * mean;
    lapack_int N = (lapack_int)cols, info;
    // H = L Lᵀ, H⁻¹ from L (lower triangle), mirrored, then H⁻¹ = Uᵀ U
    if ((info = LAPACKE_dpotrf(LAPACK_ROW_MAJOR, 'L', N, A, N)) != 0 ||
        (info = LAPACKE_dpotri(LAPACK_ROW_MAJOR, 'L', N, A, N)) != 0) {
        free(A);
        return lm_err_set(err, LM_ERR_FORMAT, "the damped Hessian (%" PRId64 " x %" PRId64 ") is not positive "
                          "definite (LAPACK info %d)", cols, cols, (int)info);
    }
    for (size_t r = 0; r < n; r++)
        for (size_t c = r + 1; c < n; c++)
            A[r * n + c] = A[c * n + r];
    if ((info = LAPACKE_dpotrf(LAPACK_ROW_MAJOR, 'U', N, A, N)) != 0) {
        free(A);
        return lm_err_set(err, LM_ERR_FORMAT, "the inverse of the damped Hessian (%" PRId64 " x %" PRId64 ") is not "
                          "positive definite (LAPACK info %d)", cols, cols, (int)info);
    }
    for (size_t c = 0; c < n; c++) {
        double u = A[c * n + c];
        ucc2[c] = u * u;
    }
    free(A);
    return LM_OK;
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

lm_status lm_hess_ucc2_model(const lm_model *m, const lm_adapter *a, lm_dev *dev, const char *label,
                             const lm_fwd_seq *seqs, int64_t n_seqs, int threads, double damp, bool sticky,
                             lm_fwd_note_fn note, void *note_ctx, double ***out, int64_t *n_out, lm_err *err)
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
        s = lm_hess_init(&h, m, runner.on_dev ? dev : NULL, reserve, threads, err);
    }
    if (s == LM_OK)
        s = lm_hess_capture(&h, &runner, seqs, n_seqs, err);
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
        double d = damp;
        for (int tries = 0; (s = lm_hess_ucc2(ucc2[i], H, dim, d, err)) == LM_ERR_FORMAT && tries < 6; tries++) {
            char name[128], line[256];
            snprintf(line, sizeof line, "the Hessian of %s is not positive definite with damping %g: trying %g",
                     lm_hess_name(name, sizeof name, layer, pt), d, d * 10);
            if (note)
                note(note_ctx, line);
            d *= 10;
        }
        if (s != LM_OK) {
            char name[128];
            lm_err_prefix(err, "%s", lm_hess_name(name, sizeof name, layer, pt));
        }
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
