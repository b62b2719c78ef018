// cuBLAS and cuSOLVER, opened with dlopen when a CUDA device first needs them instead of being
// linked. Loading them costs some 200 MB (cuBLAS) and 250 MB (cuSOLVER) of resident memory and
// a few tenths of a second, which every command would otherwise pay, including those that run
// on the CPU; the CUDA runtime, which stays linked, costs about 1 MB. cuSOLVER is loaded only
// by the first Cholesky factorisation, so merges never load it.
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
    const char *(*status_string)(cublasStatus_t status);
    cublasStatus_t (*sgemm)(cublasHandle_t handle, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                            const float *alpha, const float *a, int lda, const float *b, int ldb, const float *beta,
                            float *c, int ldc);
} lm_cublas_fns;

// The cuSOLVER functions llmerge calls.
typedef struct lm_cusolver_fns {
    cusolverStatus_t (*create)(cusolverDnHandle_t *handle);
    cusolverStatus_t (*destroy)(cusolverDnHandle_t handle);
    cusolverStatus_t (*set_stream)(cusolverDnHandle_t handle, cudaStream_t stream);
    cusolverStatus_t (*dpotrf_buffer_size)(cusolverDnHandle_t handle, cublasFillMode_t uplo, int n, double *a,
                                           int lda, int *lwork);
    cusolverStatus_t (*dpotrf)(cusolverDnHandle_t handle, cublasFillMode_t uplo, int n, double *a, int lda,
                               double *work, int lwork, int *info);
} lm_cusolver_fns;

// Fills *fns with cuBLAS's functions, loading the library the first time (thread-safe). A
// library that cannot be opened, or lacks a function, is LM_ERR_DEVICE naming the library and
// saying why; the next call tries again.
lm_status lm_cuda_load_cublas(const lm_cublas_fns **fns, lm_err *err);

// The same for cuSOLVER.
lm_status lm_cuda_load_cusolver(const lm_cusolver_fns **fns, lm_err *err);

#endif
