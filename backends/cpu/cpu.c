// The CPU backend of the device interface: host memory, OpenBLAS for GEMM, and a thread pool
// for the element-wise operations. Work is split into fixed blocks of BLOCK elements, each
// written by one task, and reductions add per-block partial sums in block order, so every
// result is independent of the thread count. Device pointers are host pointers, so callers may
// hand mmapped inputs straight to the operations.
//
// This file holds the vtable, memory, the conversions and the device's creation; the
// operations are in the files cpu_impl.h lists.
#include "cpu_impl.h"

#include <unistd.h>

// ==== memory ==================================================================================

static const char *cpu_name(lm_dev *d)
{
    (void)d;
    return "cpu";
}

static void cpu_mem_info(lm_dev *d, size_t *free_bytes, size_t *total_bytes)
{
    (void)d;
    long pages = sysconf(_SC_PHYS_PAGES), avail = sysconf(_SC_AVPHYS_PAGES), size = sysconf(_SC_PAGE_SIZE);
    *total_bytes = pages > 0 && size > 0 ? (size_t)pages * (size_t)size : 0;
    *free_bytes = avail > 0 && size > 0 ? (size_t)avail * (size_t)size : 0;
}

static lm_status cpu_alloc(lm_dev *d, size_t size, void **ptr, lm_err *err)
{
    (void)d;
    // 64-byte alignment for vector loads; the size is rounded up as aligned_alloc wants.
    size_t rounded = (size + 63) & ~(size_t)63;
    *ptr = rounded >= size ? aligned_alloc(64, rounded) : NULL;
    if (!*ptr) {
        char b[32];
        return lm_err_set(err, LM_ERR_NOMEM, "cpu: out of memory allocating %s", lm_format_bytes(b, sizeof b, size));
    }
    return LM_OK;
}

static void cpu_free(lm_dev *d, void *ptr)
{
    (void)d;
    free(ptr);
}

static lm_status cpu_copy(lm_dev *d, void *dst, const void *src, size_t n, lm_err *err)
{
    (void)d;
    (void)err;
    memcpy(dst, src, n);
    return LM_OK;
}

static void cpu_destroy(lm_dev *d)
{
    cpu_ctx *c = d->ctx;
    if (c) {
        lm_pool_free(c->pool);
        free(c->hist_local);
        free(c->lora_tau);
        pthread_mutex_destroy(&c->hist_mu);
    }
    free(c);
    free(d);
}

// ==== conversion ==============================================================================

typedef struct conv_job {
    void *dst;
    const void *src;
    lm_dtype dt;
    int64_t n;
    bool to_f32;
    lm_nonfinite *nf;  // the counting conversions' sums, or NULL
} conv_job;

// Adds one task's counts to an operation's sums, from any thread (integer sums: the order the
// tasks finish in does not matter).
void cpu_nf_add(lm_nonfinite *to, const lm_nonfinite *c)
{
    if (c->nan)
        __atomic_fetch_add(&to->nan, c->nan, __ATOMIC_RELAXED);
    if (c->inf)
        __atomic_fetch_add(&to->inf, c->inf, __ATOMIC_RELAXED);
}

static void conv_task(void *ctx, int64_t b)
{
    conv_job *j = ctx;
    int64_t lo = b * BLOCK, cnt = j->n - lo < BLOCK ? j->n - lo : BLOCK;
    size_t esz = lm_dtype_bits(j->dt) / 8;
    void *wide = (float *)(j->to_f32 ? j->dst : (void *)j->src) + lo;
    void *narrow = (char *)(j->to_f32 ? (void *)j->src : j->dst) + (size_t)lo * esz;
    lm_nonfinite c = {0, 0};
    if (j->to_f32 && j->nf)
        lm_convert_to_f32_nf(wide, narrow, j->dt, cnt, &c, NULL);
    else if (j->to_f32)
        lm_convert_to_f32(wide, narrow, j->dt, cnt, NULL);
    else if (j->nf)
        lm_convert_from_f32_nf(narrow, j->dt, wide, cnt, &c, NULL);
    else
        lm_convert_from_f32(narrow, j->dt, wide, cnt, NULL);
    if (j->nf)
        cpu_nf_add(j->nf, &c);
}

static lm_status cpu_to_f32_count(lm_dev *d, float *dst, const void *src, lm_dtype dt, int64_t n, lm_nonfinite *nf,
                                  lm_err *err)
{
    if (!lm_dtype_readable(dt))
        return lm_convert_to_f32(dst, src, dt, 0, err);
    conv_job j = {dst, src, dt, n, true, nf};
    lm_pool_run(pool_of(d), n_blocks(n), conv_task, &j);
    return LM_OK;
}

static lm_status cpu_to_f32(lm_dev *d, float *dst, const void *src, lm_dtype dt, int64_t n, lm_err *err)
{
    return cpu_to_f32_count(d, dst, src, dt, n, NULL, err);
}

static lm_status cpu_from_f32_count(lm_dev *d, void *dst, lm_dtype dt, const float *src, int64_t n, lm_nonfinite *nf,
                                    lm_err *err)
{
    if (!lm_dtype_writable(dt))
        return lm_convert_from_f32(dst, dt, src, 0, err);
    conv_job j = {dst, src, dt, n, false, nf};
    lm_pool_run(pool_of(d), n_blocks(n), conv_task, &j);
    return LM_OK;
}

static lm_status cpu_from_f32(lm_dev *d, void *dst, lm_dtype dt, const float *src, int64_t n, lm_err *err)
{
    return cpu_from_f32_count(d, dst, dt, src, n, NULL, err);
}

// ==== the backend =============================================================================

static const lm_dev_i cpu_iface = {
    .name = cpu_name,
    .mem_info = cpu_mem_info,
    .alloc = cpu_alloc,
    .buf_free = cpu_free,
    .upload = cpu_copy,
    .download = cpu_copy,
    .destroy = cpu_destroy,
    .to_f32 = cpu_to_f32,
    .from_f32 = cpu_from_f32,
    .gemm = cpu_gemm,
    .syrk = cpu_syrk,
    .axpby = cpu_axpby,
    .delta = cpu_delta,
    .dora_rows = cpu_dora_rows,
    .hist_abs = cpu_hist_abs,
    .hist_window = cpu_hist_window,
    .topk_apply = cpu_topk_apply,
    .topk_drop = cpu_topk_drop,
    .topk_apply_by = cpu_topk_apply_by,
    .importance = cpu_importance,
    .potrf = cpu_potrf,
    .mask_get = cpu_mask_get,
    .mask_apply = cpu_mask_apply,
    .random_drop = cpu_random_drop,
    .l1 = cpu_l1,
    .row_dot = cpu_row_dot,
    .nearswap = cpu_nearswap,
    .row_axpby = cpu_row_axpby,
    .dense_gram = cpu_dense_gram,
    .col_dot = cpu_col_dot,
    .col_axpby = cpu_col_axpby,
    .tau_var = cpu_tau_var,
    .della_drop = cpu_della_drop,
    .combine = cpu_combine,
    .dense_hist = cpu_dense_hist,
    .dense_merge = cpu_dense_merge,
    .to_f32_count = cpu_to_f32_count,
    .delta_count = cpu_delta_count,
    .from_f32_count = cpu_from_f32_count,
    .gather_rows = cpu_gather_rows,
    .add_rows = cpu_add_rows,
    .rmsnorm = cpu_rmsnorm,
    .rope = cpu_rope,
    .attention = cpu_attention,
    .silu_mul = cpu_silu_mul,
    .nll_rows = cpu_nll_rows,
};

extern void openblas_set_num_threads(int num_threads);

lm_status lm_dev_cpu_create(lm_dev **out, int threads, lm_err *err)
{
    *out = NULL;
    lm_dev *d = calloc(1, sizeof *d);
    cpu_ctx *c = calloc(1, sizeof *c);
    if (!d || !c) {
        free(d);
        free(c);
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    }
    pthread_mutex_init(&c->hist_mu, NULL);
    d->iface = &cpu_iface;
    d->ctx = c;
    d->host_memory = true;
    lm_status s = lm_pool_create(&c->pool, threads, err);
    if (s != LM_OK) {
        cpu_destroy(d);
        return s;
    }
    d->threads = lm_pool_threads(c->pool);
    openblas_set_num_threads(1);
    *out = d;
    return LM_OK;
}

lm_status lm_dev_cpu_companion(lm_dev *d, lm_dev **cpu, lm_err *err)
{
    if (d->iface == &cpu_iface) {
        *cpu = d;
        return LM_OK;
    }
    if (!d->companion) {
        lm_status s = lm_dev_cpu_create(&d->companion, d->threads, err);
        if (s != LM_OK)
            return s;
    }
    *cpu = d->companion;
    return LM_OK;
}
