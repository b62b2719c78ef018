// cuBLAS and cuSOLVER, opened with dlopen when a CUDA device is opened instead of being linked.
// Loading them costs some 200 MB (cuBLAS) and 250 MB (cuSOLVER) of resident memory and a few
// tenths of a second, which every command would otherwise pay, including those that run on the
// CPU; the CUDA runtime, which stays linked, costs about 1 MB. A device needs cuBLAS (its GEMMs):
// without it the device does not open. cuSOLVER serves only the Cholesky factorisations of
// sparsegpt: a device opens without it and factors on the CPU.
//
// The libraries are found by their sonames (the major versions of the headers this build saw),
// in the dynamic linker's usual places and then in the toolkit's library directory of the build.
// Once loaded they stay loaded. CUDA code only.
#ifndef LM_CUDA_LIBS_H
#define LM_CUDA_LIBS_H

#include <cublas_v2.h>
#include <cusolverDn.h>

#include "status.h"

// The cuBLAS functions llmerge calls (the _v2 entry points that cublas_v2.h's names stand for).
typedef struct lm_cublas_fns {
    cublasStatus_t (*create)(cublasHandle_t *handle);
    cublasStatus_t (*destroy)(cublasHandle_t handle);
    cublasStatus_t (*set_stream)(cublasHandle_t handle, cudaStream_t stream);
    cublasStatus_t (*set_math_mode)(cublasHandle_t handle, cublasMath_t mode);
    cublasStatus_t (*set_workspace)(cublasHandle_t handle, void *workspace, size_t bytes);
    const char *(*status_string)(cublasStatus_t status);
    cublasStatus_t (*sgemm)(cublasHandle_t handle, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                            const float *alpha, const float *a, int lda, const float *b, int ldb, const float *beta,
                            float *c, int ldc);
    cublasStatus_t (*ssyrk)(cublasHandle_t handle, cublasFillMode_t uplo, cublasOperation_t trans, int n, int k,
                            const float *alpha, const float *a, int lda, const float *beta, float *c, int ldc);
} lm_cublas_fns;

// The cuSOLVER functions llmerge calls: the 64-bit API (Xpotrf), whose sizes and offsets are
// int64_t, so that a matrix of n >= 46,341 (n² > 2³¹) is factored.
typedef struct lm_cusolver_fns {
    cusolverStatus_t (*create)(cusolverDnHandle_t *handle);
    cusolverStatus_t (*destroy)(cusolverDnHandle_t handle);
    cusolverStatus_t (*set_stream)(cusolverDnHandle_t handle, cudaStream_t stream);
    cusolverStatus_t (*create_params)(cusolverDnParams_t *params);
    cusolverStatus_t (*destroy_params)(cusolverDnParams_t params);
    cusolverStatus_t (*xpotrf_buffer_size)(cusolverDnHandle_t handle, cusolverDnParams_t params,
                                           cublasFillMode_t uplo, int64_t n, cudaDataType type_a, const void *a,
                                           int64_t lda, cudaDataType compute_type, size_t *device_bytes,
                                           size_t *host_bytes);
    cusolverStatus_t (*xpotrf)(cusolverDnHandle_t handle, cusolverDnParams_t params, cublasFillMode_t uplo,
                               int64_t n, cudaDataType type_a, void *a, int64_t lda, cudaDataType compute_type,
                               void *device_work, size_t device_bytes, void *host_work, size_t host_bytes,
                               int *info);
} lm_cusolver_fns;

// Fills *fns with cuBLAS's functions, loading the library the first time (thread-safe). A
// library that cannot be opened, or lacks a function, is LM_ERR_DEVICE naming the library and
// saying why; the next call tries again.
lm_status lm_cuda_load_cublas(const lm_cublas_fns **fns, lm_err *err);

// The same for cuSOLVER.
lm_status lm_cuda_load_cusolver(const lm_cusolver_fns **fns, lm_err *err);

#endif
