// The CUDA backend's own state and helpers, shared by its host files (cuda.cu, the backend and
// its memory and copies; cuda_coef.cu, the operations of the methods that interpolate and of
// the per-entry drops): the context behind an lm_dev, and the calls every operation starts
// with. Private to backends/cuda/.
#ifndef LM_CUDA_INT_H
#define LM_CUDA_INT_H

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cusolverDn.h>

#include <stddef.h>
#include <stdint.h>

extern "C" {
#include "device_impl.h"
#include "parallel.h"
}

#include "cuda_libs.h"

#define N_STAGE 4  // pinned staging buffers, used in turn

typedef struct cuda_buf {
    void *p;
    size_t size;  // bytes asked for
} cuda_buf;

typedef struct cuda_ctx {
    int ordinal;
    char name[24];            // "cuda:N"
    uint64_t mem_cap;         // the most bytes llmerge may hold on the device (0: no cap)
    uint64_t used;            // bytes it holds: buffers and scratch
    uint64_t lib_bytes;       // of used: what the cuBLAS and cuSOLVER handles took when made
    cuda_buf *bufs;           // (n_bufs) live buffers from alloc, in no order
    size_t n_bufs, cap_bufs;
    cuda_buf *cache;          // (n_cache) released buffers kept for reuse, in no order
    size_t n_cache, cap_cache;
    uint64_t cached;          // of used: what the cache holds, at charge()
    uint64_t cached_asked;    // what the cache holds in bytes asked for (what the driver gives
                              // back at least when the cache is freed)
    cudaStream_t stream;      // everything runs on it (non-blocking: no implicit sync with stream 0)
    const lm_cublas_fns *cublas;  // cuBLAS, loaded when the device was opened
    cublasHandle_t blas;      // bound to stream
    void *blas_ws;            // (blas_ws_size bytes) cuBLAS's workspace, counted in used
    size_t blas_ws_size;
    const lm_cusolver_fns *cusolver;  // cuSOLVER, loaded when the device was opened; NULL when it
                                      // could not be, and potrf factors on the CPU
    cusolverDnHandle_t solver;  // bound to stream
    cusolverDnParams_t solver_params;  // Xpotrf's (the defaults)
    char note[LM_ERR_MSG_MAX + 64];  // what the device does without (lm_cuda_device_note), or ""
    size_t last_free, last_total;  // the last answer of cudaMemGetInfo
    void *pinned[N_STAGE];    // (STAGE_BYTES each) staging buffers, n_stage of them (at least 2);
    int n_stage;              // 0 when pinned memory could not be had, and copies go straight
                              // from pageable memory
    cudaEvent_t staged[N_STAGE];  // recorded after the last copy into or out of pinned[i]
    int next_stage;           // the staging buffer the next copy starts with
    lm_pool *pool;            // the host threads that fill and empty the staging buffers
    void *scratch;            // (scratch_size bytes) device scratch of the reductions
    size_t scratch_size;
    void *host_scratch;       // (host_scratch_size bytes) their results, fetched home
    size_t host_scratch_size;
    lm_status deferred;       // a failure of a call that could not report it (free), for the next
    char deferred_msg[LM_ERR_MSG_MAX];
} cuda_ctx;

// The context behind a CUDA device.
static inline cuda_ctx *ctx_of(lm_dev *d)
{
    return (cuda_ctx *)d->ctx;
}

// Starts every entry point that returns a status: reports a deferred failure, and makes this
// device current for the calling thread.
lm_status lm_cuda_begin(lm_dev *d, lm_err *err);

// Makes the device scratch (ctx_of(d)->scratch) at least `bytes` long, and never shorter than
// SCRATCH_MIN, the scratch every device keeps (enough for any slab's reductions); its contents
// are not kept.
#define SCRATCH_MIN ((size_t)1 << 20)
lm_status lm_cuda_scratch_reserve(lm_dev *d, size_t bytes, lm_err *err);
void lm_cuda_scratch_trim(lm_dev *d);

// Copies n bytes of device memory to the host through the staging buffers, and waits for them.
lm_status lm_cuda_copy_home(cuda_ctx *c, void *dst, const void *src, size_t n, lm_err *err);

// The operations of cuda_coef.cu, as the vtable takes them (device.h says what each does).
lm_status lm_cuda_op_row_dot(lm_dev *d, const float *x, const float *y, int64_t rows, int64_t cols, double *out,
                             lm_err *err);
lm_status lm_cuda_op_col_dot(lm_dev *d, const float *x, const float *y, int64_t rows, int64_t cols, double *acc,
                             lm_err *err);
lm_status lm_cuda_op_row_axpby(lm_dev *d, float *y, const float *a, const float *x, const float *b, int64_t rows,
                               int64_t cols, lm_err *err);
lm_status lm_cuda_op_col_axpby(lm_dev *d, float *y, const float *a, const float *x, const float *b, int64_t rows,
                               int64_t cols, lm_err *err);
lm_status lm_cuda_op_della_drop(lm_dev *d, float *x, int64_t rows, int64_t cols, uint64_t key, int64_t first,
                                double p_lo, double p_hi, bool inv, lm_err *err);
lm_status lm_cuda_op_tau_var(lm_dev *d, float *key, const float *const *taus, int k, int n_models, int64_t n,
                             lm_err *err);
lm_status lm_cuda_op_nearswap(lm_dev *d, float *x, int64_t n, float t, lm_err *err);

#endif
