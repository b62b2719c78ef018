// The device interface as the backends see it: the vtable lm_dev_i a backend fills in and the
// body of struct lm_dev. Only the backends (backends/cpu, backends/sim, backends/cuda) and the
// dispatcher (device.c) include this header; every other caller holds an opaque lm_dev and asks
// it through device.h (lm_dev_supports for the optional entries, lm_dev_threads and
// lm_dev_host_memory for the fields).
#ifndef LM_DEVICE_IMPL_H
#define LM_DEVICE_IMPL_H

#include "device.h"
#include "merge_desc.h"  // what the fused operations and combine compute

// The operations a device provides. Entries marked optional may be NULL; the dispatcher
// supplies the default.
typedef struct lm_dev_i {
    const char *(*name)(lm_dev *d);
    void (*mem_info)(lm_dev *d, size_t *free_bytes, size_t *total_bytes);
    lm_status (*alloc)(lm_dev *d, size_t size, void **ptr, lm_err *err);
    void (*buf_free)(lm_dev *d, void *ptr);
    lm_status (*upload)(lm_dev *d, void *dst, const void *src, size_t n, lm_err *err);
    lm_status (*download)(lm_dev *d, void *dst, const void *src, size_t n, lm_err *err);
    lm_status (*sync)(lm_dev *d, lm_err *err);  // optional: no-op
    lm_status (*check)(lm_dev *d, lm_err *err);  // optional: LM_OK (lm_dev_check)
    void (*destroy)(lm_dev *d);

    lm_status (*to_f32)(lm_dev *d, float *dst, const void *src, lm_dtype dt, int64_t n, lm_err *err);
    lm_status (*from_f32)(lm_dev *d, void *dst, lm_dtype dt, const float *src, int64_t n, lm_err *err);
    lm_status (*gemm)(lm_dev *d, bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha,
                      const float *a, int64_t lda, const float *b, int64_t ldb, float beta,
                      float *c, int64_t ldc, lm_err *err);
    lm_status (*syrk)(lm_dev *d, int64_t n, int64_t k, float alpha, const float *a, int64_t lda, float beta,
                      bool mirror, float *c, int64_t ldc, lm_err *err);  // optional: callers use gemm
    lm_status (*axpby)(lm_dev *d, float *y, float a, const float *x, float b, int64_t n, lm_err *err);
    lm_status (*delta)(lm_dev *d, float *tau, const void *src, lm_dtype dt, const float *base, int64_t n,
                       lm_err *err);  // optional: to_f32, then axpby
    lm_status (*dora_rows)(lm_dev *d, float *tau, const float *base, const float *magnitude,
                           int64_t rows, int64_t cols, lm_err *err);
    lm_status (*hist_abs)(lm_dev *d, uint64_t *hist, const float *x, int64_t n, int level,
                          uint32_t hi_bin, lm_err *err);
    lm_status (*hist_window)(lm_dev *d, uint64_t *above, uint64_t *win, int n_win, uint32_t lo_bin,
                             const float *x, int64_t n, lm_err *err);  // optional: n_win + 1 hist_abs
    lm_status (*topk_apply)(lm_dev *d, float *x, int64_t n, uint32_t thr_bits, int64_t ties_allowed,
                            int64_t *ties_used, lm_err *err);
    lm_status (*topk_drop)(lm_dev *d, float *x, int64_t n, uint32_t thr_bits, int64_t ties_allowed,
                            int64_t *ties_used, lm_err *err);
    lm_status (*topk_apply_by)(lm_dev *d, float *x, const float *key, int64_t n, uint32_t thr_bits,
                               int64_t ties_allowed, int64_t *ties_used, lm_err *err);  // optional
    lm_status (*importance)(lm_dev *d, float *key, const float *tau, const double *ucc2, int64_t rows,
                            int64_t cols, lm_err *err);  // optional
    lm_status (*potrf)(lm_dev *d, double *a, int64_t n, double *diag, lm_err *err);  // optional
    lm_status (*mask_get)(lm_dev *d, uint8_t *bits, int64_t first, const float *x, int64_t n,
                          lm_err *err);  // optional: x brought to the host in pieces
    lm_status (*mask_apply)(lm_dev *d, float *x, const uint8_t *bits, int64_t first, int64_t n,
                            lm_err *err);  // optional: x brought to the host and back
    lm_status (*random_drop)(lm_dev *d, float *x, int64_t n, uint64_t key, int64_t first,
                             uint64_t keep_below, lm_err *err);
    lm_status (*l1)(lm_dev *d, const float *x, int64_t n, double *out, lm_err *err);
    lm_status (*row_dot)(lm_dev *d, const float *x, const float *y, int64_t rows, int64_t cols, double *out,
                         lm_err *err);
    lm_status (*nearswap)(lm_dev *d, float *x, int64_t n, float t, lm_err *err);
    lm_status (*col_dot)(lm_dev *d, const float *x, const float *y, int64_t rows, int64_t cols, double *acc,
                         lm_err *err);
    lm_status (*col_axpby)(lm_dev *d, float *y, const float *a, const float *x, const float *b, int64_t rows,
                           int64_t cols, lm_err *err);
    lm_status (*tau_var)(lm_dev *d, float *key, const float *const *taus, int k, int n_models, int64_t n,
                         lm_err *err);
    lm_status (*row_axpby)(lm_dev *d, float *y, const float *a, const float *x, const float *b, int64_t rows,
                           int64_t cols, lm_err *err);
    lm_status (*della_drop)(lm_dev *d, float *x, int64_t rows, int64_t cols, uint64_t key, int64_t first, double p_lo,
                            double p_hi, bool inv, lm_err *err);
    lm_status (*combine)(lm_dev *d, float *out, const float *base, const float *const *w_tau,
                         const float *weights, int k, int64_t n, lm_combine_sign sign, bool normalize,
                         float lambda, lm_err *err);
    // Fused dense operations, on devices with host memory only (optional: the engine runs the
    // separate operations when they are NULL).
    lm_status (*dense_gram)(lm_dev *d, const void *base, lm_dtype base_dt, lm_dense_part *parts, int k, int64_t rows,
                            int64_t cols, double *out, lm_err *err);  // optional
    lm_status (*dense_hist)(lm_dev *d, const void *base, lm_dtype base_dt, lm_dense_part *parts, int k, int64_t n,
                            lm_err *err);
    lm_status (*dense_merge)(lm_dev *d, void *out, lm_dtype out_dt, const void *base, lm_dtype base_dt,
                             lm_dense_part *parts, int k, int64_t n, lm_combine_how how, const lm_dev_side *side, lm_err *err);
    // Conversions that also count NaN and Inf, on devices with host memory only (optional: the
    // merge counts on the host, from what it copies to and from the device, where they are
    // NULL).
    lm_status (*to_f32_count)(lm_dev *d, float *dst, const void *src, lm_dtype dt, int64_t n, lm_nonfinite *nf,
                              lm_err *err);
    lm_status (*delta_count)(lm_dev *d, float *tau, const void *src, lm_dtype dt, const float *base, int64_t n,
                             lm_nonfinite *nf, lm_err *err);
    lm_status (*from_f32_count)(lm_dev *d, void *dst, lm_dtype dt, const float *src, int64_t n, lm_nonfinite *nf,
                                lm_err *err);

    // The forward pass (forward.h). Optional: a device without them answers
    // LM_ERR_UNSUPPORTED naming the operation, and lm_dev_supports(d, LM_OP_FORWARD) tells beforehand.
    lm_status (*gather_rows)(lm_dev *d, float *out, const float *table, int64_t table_rows, int64_t cols,
                             const int32_t *ids, int64_t n, lm_err *err);
    lm_status (*add_rows)(lm_dev *d, float *y, const float *b, int64_t rows, int64_t cols, lm_err *err);
    lm_status (*rmsnorm)(lm_dev *d, float *out, const float *x, const float *w, int64_t rows, int64_t cols,
                         float eps, lm_err *err);
    lm_status (*rope)(lm_dev *d, float *x, int64_t rows, int64_t heads, int64_t head_dim, const int32_t *pos,
                      const float *inv_freq, lm_err *err);
    lm_status (*attention)(lm_dev *d, float *out, const float *q, const float *k, const float *v,
                           const int32_t *start, int64_t rows, int64_t heads, int64_t kv_heads,
                           int64_t head_dim, float scale, lm_err *err);
    lm_status (*silu_mul)(lm_dev *d, float *gate, const float *up, int64_t n, lm_err *err);
    lm_status (*nll_rows)(lm_dev *d, float *nll, const float *logits, const int32_t *targets, int64_t rows,
                          int64_t cols, lm_err *err);
} lm_dev_i;

struct lm_dev {
    const lm_dev_i *iface;
    void *ctx;         // the backend's own state
    int threads;       // CPU threads the backend uses
    bool host_memory;  // device pointers are host pointers: operations may read host memory
                       // (an mmapped input) directly, with no upload
    lm_dev *companion; // the CPU device d's units fall back to (lm_dev_cpu_companion), made on
                       // first use and destroyed with d; NULL until then, and on the CPU itself
};

#endif
