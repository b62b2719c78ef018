// Error checking and launch geometry shared by the .cu files of backends/cuda/ (CUDA code only,
// never included from C). A failing CUDA call is recorded into the caller's lm_err with the
// statement, function, file and line, and control jumps to the function's `fail:` label; nothing
// aborts. Functions using these macros declare `lm_status status = LM_OK;`, take `lm_err *err` and
// end with `fail: ... return status;`.
#ifndef LM_CUDA_CHECK_H
#define LM_CUDA_CHECK_H

#include <cuda_runtime.h>

#include <stdint.h>

#include "status.h"

// Records the failing statement into err and jumps to fail. An allocation that fails for lack
// of memory becomes LM_ERR_DEVICE_OOM, the one status that falls back; every other failure is
// LM_ERR_DEVICE. The error is then read back once with cudaGetLastError, so that a
// non-sticky one (an allocation failure) does not resurface at the next launch check.
#define CUDA_TRY(stmt)                                                                        \
    do {                                                                                      \
        cudaError_t e_ = (stmt);                                                              \
        if (e_ != cudaSuccess) {                                                              \
            status = lm_err_set(err, e_ == cudaErrorMemoryAllocation ? LM_ERR_DEVICE_OOM      \
                                                                    : LM_ERR_DEVICE,          \
                                "cuda: %s: %s (%s, %s:%d)", #stmt, cudaGetErrorString(e_),    \
                                __func__, __FILE__, __LINE__);                                \
            cudaGetLastError(); /* clear a sticky-free error so the next call is clean */     \
            goto fail;                                                                        \
        }                                                                                     \
    } while (0)

// Follows every kernel launch: a launch that was refused is named with the kernel. One refused
// for want of memory (a kernel whose code or local memory could not be loaded on a full device)
// is LM_ERR_DEVICE_OOM, so the unit falls back, and is cleared like a failed allocation; any
// other refusal (bad configuration, no kernel image for this GPU, a device already in error) is
// LM_ERR_DEVICE. Faults while the kernel runs surface later, at the next synchronising call (a
// download, lm_dev_sync, lm_dev_check).
#define CUDA_LAUNCHED(kernel)                                                                 \
    do {                                                                                      \
        cudaError_t e_ = cudaGetLastError();                                                  \
        if (e_ != cudaSuccess) {                                                              \
            status = lm_err_set(err, e_ == cudaErrorMemoryAllocation ? LM_ERR_DEVICE_OOM      \
                                                                    : LM_ERR_DEVICE,          \
                                "cuda: launching %s: %s (%s, %s:%d)", kernel,                 \
                                cudaGetErrorString(e_), __func__, __FILE__, __LINE__);        \
            goto fail;                                                                        \
        }                                                                                     \
    } while (0)

// Kernels are loaded when a device opens, not at their first launch (the runtime loads them
// lazily from CUDA 12.2 on, and a load on a full device fails for memory in the middle of a
// run). Each .cu file lists its kernels with LM_CUDA_PRELOAD(kernel), at file scope after their
// definitions; lm_dev_cuda_create loads every kernel listed (cudaFuncGetAttributes loads one).
// lm_cuda_preload_add records one kernel for that, before main; it returns its index.
int lm_cuda_preload_add(const void *kernel, const char *name);
#define LM_CUDA_PRELOAD(kernel)                                                               \
    static const int LM_CUDA_CAT(lm_preload_, __LINE__) __attribute__((unused)) =             \
        lm_cuda_preload_add(reinterpret_cast<const void *>(&kernel), #kernel)
#define LM_CUDA_CAT(a, b) LM_CUDA_CAT2(a, b)
#define LM_CUDA_CAT2(a, b) a##b

// Blocks for a grid-stride loop over n items with `threads` threads per block: enough to fill
// any current GPU, at least 1 (a launch of 0 blocks is an error) and within gridDim.x's limit
// for every architecture.
static inline unsigned lm_cuda_grid(int64_t n, int threads)
{
    int64_t blocks = (n + threads - 1) / threads;
    return (unsigned)(blocks > 65535 ? 65535 : (blocks < 1 ? 1 : blocks));
}

#endif
