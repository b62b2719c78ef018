// cuBLAS and cuSOLVER on the emulated device: the functions the backend's loader (cuda_libs.cu)
// looks up, with their signatures and status codes, over OpenBLAS (column-major cblas_sgemm) and
// LAPACKE (dpotrf, whose info cuSOLVER returns in device memory), reached through a stand-in
// dlopen/dlsym (include/dlfcn.h) that knows the two libraries' sonames. Each call checks that
// its matrices are device memory (a host pointer faults the device, as it would on a GPU) and
// answers a poisoned device with CUBLAS_STATUS_EXECUTION_FAILED / CUSOLVER_STATUS_EXECUTION_FAILED.
#include "emu_impl.h"

#include <cublas_v2.h>
#include <cusolverDn.h>
#include <dlfcn.h>

#include <stdio.h>
#include <stdlib.h>

#include <cblas.h>
#include <lapacke.h>

struct lm_emu_cublas {
    cudaStream_t stream;
    void *workspace;
    size_t workspace_size;
};
struct lm_emu_cusolver {
    cudaStream_t stream;
};
struct lm_emu_cusolver_params {
    int unused;
};

namespace lm_emu {

// Whether an operation may run: the device is not poisoned and each of the n pointers in ptrs
// (with its byte size) is device memory; a host pointer poisons the device.
static bool can_run(const void *const *ptrs, const size_t *sizes, int n)
{
    // the queued work before it, then this, at once; a fault on the way poisons the device
    if (cudaDeviceSynchronize() != cudaSuccess && sticky_error() != cudaSuccess)
        return false;
    for (int i = 0; i < n; i++) {
        if (sizes[i] && !is_device(ptrs[i], sizes[i])) {
            fprintf(stderr, "cuda-emu: a library call was given %p (%zu bytes), which is not device memory\n",
                    ptrs[i], sizes[i]);
            set_sticky(cudaErrorIllegalAddress);
            return false;
        }
    }
    return true;
}

// The bytes a column-major rows x cols matrix with leading dimension ld spans.
static size_t span(int64_t rows, int64_t cols, int64_t ld, size_t elem)
{
    return rows <= 0 || cols <= 0 ? 0 : (size_t)((cols - 1) * ld + rows) * elem;
}

// ---- cuBLAS ------------------------------------------------------------------------------------

static cublasStatus_t blas_create(cublasHandle_t *h)
{
    *h = NULL;
    if (sticky_error() != cudaSuccess)
        return CUBLAS_STATUS_NOT_INITIALIZED;
    size_t fr, tot;
    if (cudaMemGetInfo(&fr, &tot) != cudaSuccess || fr == 0)
        return CUBLAS_STATUS_ALLOC_FAILED;  // cuBLAS allocates as it starts up
    *h = (cublasHandle_t)calloc(1, sizeof **h);
    return *h ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_ALLOC_FAILED;
}

static cublasStatus_t blas_destroy(cublasHandle_t h)
{
    if (!h)
        return CUBLAS_STATUS_NOT_INITIALIZED;
    free(h);
    return CUBLAS_STATUS_SUCCESS;
}

static cublasStatus_t blas_set_stream(cublasHandle_t h, cudaStream_t s)
{
    if (!h)
        return CUBLAS_STATUS_NOT_INITIALIZED;
    h->stream = s;
    return CUBLAS_STATUS_SUCCESS;
}

static cublasStatus_t blas_set_math_mode(cublasHandle_t h, cublasMath_t mode)
{
    if (!h)
        return CUBLAS_STATUS_NOT_INITIALIZED;
    return mode == CUBLAS_DEFAULT_MATH || mode == CUBLAS_PEDANTIC_MATH || mode == CUBLAS_TENSOR_OP_MATH ||
                   mode == CUBLAS_TF32_TENSOR_OP_MATH
               ? CUBLAS_STATUS_SUCCESS
               : CUBLAS_STATUS_INVALID_VALUE;
}

static cublasStatus_t blas_set_workspace(cublasHandle_t h, void *p, size_t size)
{
    if (!h)
        return CUBLAS_STATUS_NOT_INITIALIZED;
    if (size && !is_device(p, size))
        return CUBLAS_STATUS_INVALID_VALUE;
    h->workspace = p;
    h->workspace_size = size;
    return CUBLAS_STATUS_SUCCESS;
}

static const char *blas_status_string(cublasStatus_t s)
{
    switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "the operation completed successfully";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "the library was not initialized";
    case CUBLAS_STATUS_ALLOC_FAILED: return "the resource allocation failed";
    case CUBLAS_STATUS_INVALID_VALUE: return "an invalid numeric value was used as an argument";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "the GPU program failed to execute";
    default: return "an internal operation failed";
    }
}

static cublasStatus_t blas_sgemm(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                                 const float *alpha, const float *a, int lda, const float *b, int ldb,
                                 const float *beta, float *c, int ldc)
{
    if (!h)
        return CUBLAS_STATUS_NOT_INITIALIZED;
    if (m < 0 || n < 0 || k < 0 || (ta != CUBLAS_OP_N && ta != CUBLAS_OP_T) || (tb != CUBLAS_OP_N && tb != CUBLAS_OP_T))
        return CUBLAS_STATUS_INVALID_VALUE;
    int64_t ar = ta == CUBLAS_OP_N ? m : k, ac = ta == CUBLAS_OP_N ? k : m;
    int64_t br = tb == CUBLAS_OP_N ? k : n, bc = tb == CUBLAS_OP_N ? n : k;
    if (lda < (ar > 1 ? ar : 1) || ldb < (br > 1 ? br : 1) || ldc < (m > 1 ? m : 1))
        return CUBLAS_STATUS_INVALID_VALUE;
    if (m == 0 || n == 0)
        return CUBLAS_STATUS_SUCCESS;
    const void *ptrs[3] = {a, b, c};
    size_t sizes[3] = {k ? span(ar, ac, lda, 4) : 0, k ? span(br, bc, ldb, 4) : 0, span(m, n, ldc, 4)};
    if (!can_run(ptrs, sizes, 3))
        return CUBLAS_STATUS_EXECUTION_FAILED;
    cblas_sgemm(CblasColMajor, ta == CUBLAS_OP_N ? CblasNoTrans : CblasTrans, tb == CUBLAS_OP_N ? CblasNoTrans : CblasTrans,
                m, n, k, *alpha, a, lda, b, ldb, *beta, c, ldc);
    return CUBLAS_STATUS_SUCCESS;
}

static cublasStatus_t blas_ssyrk(cublasHandle_t h, cublasFillMode_t uplo, cublasOperation_t trans, int n, int k,
                                 const float *alpha, const float *a, int lda, const float *beta, float *c, int ldc)
{
    if (!h)
        return CUBLAS_STATUS_NOT_INITIALIZED;
    if (n < 0 || k < 0 || (uplo != CUBLAS_FILL_MODE_UPPER && uplo != CUBLAS_FILL_MODE_LOWER) ||
        (trans != CUBLAS_OP_N && trans != CUBLAS_OP_T))
        return CUBLAS_STATUS_INVALID_VALUE;
    int64_t ar = trans == CUBLAS_OP_N ? n : k, ac = trans == CUBLAS_OP_N ? k : n;
    if (lda < (ar > 1 ? ar : 1) || ldc < (n > 1 ? n : 1))
        return CUBLAS_STATUS_INVALID_VALUE;
    if (n == 0)
        return CUBLAS_STATUS_SUCCESS;
    const void *ptrs[2] = {a, c};
    size_t sizes[2] = {k ? span(ar, ac, lda, 4) : 0, span(n, n, ldc, 4)};
    if (!can_run(ptrs, sizes, 2))
        return CUBLAS_STATUS_EXECUTION_FAILED;
    cblas_ssyrk(CblasColMajor, uplo == CUBLAS_FILL_MODE_UPPER ? CblasUpper : CblasLower,
                trans == CUBLAS_OP_N ? CblasNoTrans : CblasTrans, n, k, *alpha, a, lda, *beta, c, ldc);
    return CUBLAS_STATUS_SUCCESS;
}

// ---- cuSOLVER ----------------------------------------------------------------------------------

// Doubles of device workspace a factorisation of order n asks for (as cuSOLVER, some per row).
static int64_t potrf_lwork(int64_t n)
{
    return (n > 1 ? n : 1) * 32;
}

static cusolverStatus_t solver_create(cusolverDnHandle_t *h)
{
    *h = NULL;
    if (sticky_error() != cudaSuccess)
        return CUSOLVER_STATUS_NOT_INITIALIZED;
    size_t fr, tot;
    if (cudaMemGetInfo(&fr, &tot) != cudaSuccess || fr == 0)
        return CUSOLVER_STATUS_ALLOC_FAILED;
    *h = (cusolverDnHandle_t)calloc(1, sizeof **h);
    return *h ? CUSOLVER_STATUS_SUCCESS : CUSOLVER_STATUS_ALLOC_FAILED;
}

static cusolverStatus_t solver_destroy(cusolverDnHandle_t h)
{
    if (!h)
        return CUSOLVER_STATUS_NOT_INITIALIZED;
    free(h);
    return CUSOLVER_STATUS_SUCCESS;
}

static cusolverStatus_t solver_set_stream(cusolverDnHandle_t h, cudaStream_t s)
{
    if (!h)
        return CUSOLVER_STATUS_NOT_INITIALIZED;
    h->stream = s;
    return CUSOLVER_STATUS_SUCCESS;
}

static cusolverStatus_t create_params(cusolverDnParams_t *p)
{
    *p = (cusolverDnParams_t)calloc(1, sizeof **p);
    return *p ? CUSOLVER_STATUS_SUCCESS : CUSOLVER_STATUS_ALLOC_FAILED;
}

static cusolverStatus_t destroy_params(cusolverDnParams_t p)
{
    free(p);
    return CUSOLVER_STATUS_SUCCESS;
}

// The factorisation both APIs share: the Cholesky factor of a (column-major, order n) in its
// `uplo` triangle, LAPACK's info in *d_info (device memory).
static cusolverStatus_t potrf(cusolverDnHandle_t h, cublasFillMode_t uplo, int64_t n, double *a, int64_t lda,
                              const void *work, size_t work_bytes, size_t need_bytes, int *d_info)
{
    if (!h)
        return CUSOLVER_STATUS_NOT_INITIALIZED;
    if (n < 0 || lda < (n > 1 ? n : 1) || (uplo != CUBLAS_FILL_MODE_UPPER && uplo != CUBLAS_FILL_MODE_LOWER) ||
        work_bytes < need_bytes)
        return CUSOLVER_STATUS_INVALID_VALUE;
    const void *ptrs[3] = {a, work, d_info};
    size_t sizes[3] = {span(n, n, lda, 8), need_bytes, sizeof(int)};
    if (!can_run(ptrs, sizes, 3))
        return CUSOLVER_STATUS_EXECUTION_FAILED;
    lapack_int info = n ? LAPACKE_dpotrf(LAPACK_COL_MAJOR, uplo == CUBLAS_FILL_MODE_UPPER ? 'U' : 'L',
                                         (lapack_int)n, a, (lapack_int)lda)
                        : 0;
    *d_info = (int)info;
    return CUSOLVER_STATUS_SUCCESS;
}

static cusolverStatus_t dpotrf_buffer_size(cusolverDnHandle_t h, cublasFillMode_t uplo, int n, double *a, int lda,
                                           int *lwork)
{
    (void)uplo, (void)a, (void)lda;
    if (!h)
        return CUSOLVER_STATUS_NOT_INITIALIZED;
    if (n < 0)
        return CUSOLVER_STATUS_INVALID_VALUE;
    *lwork = (int)potrf_lwork(n);
    return CUSOLVER_STATUS_SUCCESS;
}

static cusolverStatus_t dpotrf(cusolverDnHandle_t h, cublasFillMode_t uplo, int n, double *a, int lda, double *work,
                               int lwork, int *info)
{
    return potrf(h, uplo, n, a, lda, work, lwork < 0 ? 0 : (size_t)lwork * 8, (size_t)potrf_lwork(n) * 8, info);
}

static cusolverStatus_t xpotrf_buffer_size(cusolverDnHandle_t h, cusolverDnParams_t params, cublasFillMode_t uplo,
                                           int64_t n, cudaDataType type_a, const void *a, int64_t lda,
                                           cudaDataType compute, size_t *device_bytes, size_t *host_bytes)
{
    (void)params, (void)uplo, (void)a, (void)lda;
    if (!h)
        return CUSOLVER_STATUS_NOT_INITIALIZED;
    if (n < 0 || type_a != CUDA_R_64F || compute != CUDA_R_64F)
        return CUSOLVER_STATUS_INVALID_VALUE;
    *device_bytes = (size_t)potrf_lwork(n) * 8;
    *host_bytes = 0;
    return CUSOLVER_STATUS_SUCCESS;
}

static cusolverStatus_t xpotrf(cusolverDnHandle_t h, cusolverDnParams_t params, cublasFillMode_t uplo, int64_t n,
                               cudaDataType type_a, void *a, int64_t lda, cudaDataType compute, void *device_work,
                               size_t device_bytes, void *host_work, size_t host_bytes, int *info)
{
    (void)params, (void)host_work, (void)host_bytes;
    if (type_a != CUDA_R_64F || compute != CUDA_R_64F)
        return CUSOLVER_STATUS_INVALID_VALUE;
    return potrf(h, uplo, n, (double *)a, lda, device_work, device_bytes, (size_t)potrf_lwork(n) * 8, info);
}

// ---- the loader's view -------------------------------------------------------------------------

struct sym {
    const char *name;
    void *fn;
};
struct lib {
    const char *prefix;  // the soname without its version
    const sym *syms;
};

#define SYM(name, fn) {name, (void *)(fn)}
static const sym cublas_syms[] = {
    SYM("cublasCreate_v2", blas_create),           SYM("cublasDestroy_v2", blas_destroy),
    SYM("cublasSetStream_v2", blas_set_stream),    SYM("cublasSetMathMode", blas_set_math_mode),
    SYM("cublasGetStatusString", blas_status_string), SYM("cublasSgemm_v2", blas_sgemm),
    SYM("cublasSetWorkspace_v2", blas_set_workspace), SYM("cublasSetWorkspace", blas_set_workspace),
    SYM("cublasSsyrk_v2", blas_ssyrk),             {NULL, NULL}};
static const sym cusolver_syms[] = {
    SYM("cusolverDnCreate", solver_create),       SYM("cusolverDnDestroy", solver_destroy),
    SYM("cusolverDnSetStream", solver_set_stream), SYM("cusolverDnDpotrf_bufferSize", dpotrf_buffer_size),
    SYM("cusolverDnDpotrf", dpotrf),              SYM("cusolverDnCreateParams", create_params),
    SYM("cusolverDnDestroyParams", destroy_params), SYM("cusolverDnXpotrf_bufferSize", xpotrf_buffer_size),
    SYM("cusolverDnXpotrf", xpotrf),              {NULL, NULL}};
static const lib libs[] = {{"libcublas.so", cublas_syms}, {"libcusolver.so", cusolver_syms}};

static thread_local char dl_msg[256];
static thread_local bool dl_failed;

static void *fail_dl(const char *fmt, const char *what)
{
    snprintf(dl_msg, sizeof dl_msg, fmt, what);
    dl_failed = true;
    return NULL;
}

void *emu_dlopen(const char *file, int mode)
{
    (void)mode;
    const char *base = file ? strrchr(file, '/') : NULL;
    base = base ? base + 1 : file;
    if (base && lib_missing(base))
        return fail_dl("%s: cannot open shared object file: No such file or directory", base);
    for (const lib &l : libs)
        if (base && strncmp(base, l.prefix, strlen(l.prefix)) == 0)
            return (void *)&l;
    return fail_dl("%s: not a library the emulated device provides", file ? file : "(null)");
}

void *emu_dlsym(void *handle, const char *name)
{
    for (const lib &l : libs) {
        if (handle != (const void *)&l)
            continue;
        for (const sym *s = l.syms; s->name; s++)
            if (strcmp(s->name, name) == 0)
                return s->fn;
        return fail_dl("undefined symbol: %s", name);
    }
    return fail_dl("%s: not a handle of the emulated device's libraries", name);
}

int emu_dlclose(void *handle)
{
    (void)handle;
    return 0;
}

char *emu_dlerror(void)
{
    if (!dl_failed)
        return NULL;
    dl_failed = false;
    return dl_msg;
}

}  // namespace lm_emu
