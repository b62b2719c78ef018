// Loading cuBLAS and cuSOLVER when a device opens (cuda_libs.h).
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "cuda_libs.h"
#include "kernels.h"

#define STR2(x) #x
#define STR(x) STR2(x)

static pthread_mutex_t load_lock = PTHREAD_MUTEX_INITIALIZER;
static lm_cublas_fns cublas_fns;
static bool cublas_loaded;
static lm_cusolver_fns cusolver_fns;
static bool cusolver_loaded;

// Opens `soname` where the dynamic linker looks, then in the build's toolkit directory.
static void *open_lib(const char *soname, char *why, size_t why_size)
{
    void *h = dlopen(soname, RTLD_NOW | RTLD_LOCAL);
    if (h)
        return h;
    snprintf(why, why_size, "%s", dlerror());
#ifdef LLMERGE_CUDA_LIBDIR
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", LLMERGE_CUDA_LIBDIR, soname);
    if ((h = dlopen(path, RTLD_NOW | RTLD_LOCAL)))
        return h;
#endif
    return NULL;
}

// Each entry of `syms` (a NULL-terminated list of names) into the function pointer at the same
// index of `slots`. The name of the first one missing, or NULL when all were found.
static const char *find_all(void *h, const char *const *syms, void **slots)
{
    for (int i = 0; syms[i]; i++)
        if (!(slots[i] = dlsym(h, syms[i])))
            return syms[i];
    return NULL;
}

// Loads `soname` and its `syms` into `slots` once; *loaded says it is done. Once it is, no lock
// is taken: the GEMM asks on every call.
static lm_status load(const char *soname, const char *const *syms, void **slots, bool *loaded, lm_err *err)
{
    if (__atomic_load_n(loaded, __ATOMIC_ACQUIRE))
        return LM_OK;
    lm_status s = LM_OK;
    pthread_mutex_lock(&load_lock);
    if (!*loaded) {
        char why[512] = "";
        void *h = open_lib(soname, why, sizeof why);
        const char *missing = h ? find_all(h, syms, slots) : NULL;
        if (!h) {
            s = lm_err_set(err, LM_ERR_DEVICE, "cannot load %s (%s)", soname, why);
        } else if (missing) {
            s = lm_err_set(err, LM_ERR_DEVICE, "%s has no %s", soname, missing);
            dlclose(h);
        } else {
            __atomic_store_n(loaded, true, __ATOMIC_RELEASE);  // the handle stays open for good
        }
    }
    pthread_mutex_unlock(&load_lock);
    return s;
}

lm_status lm_cuda_load_cublas(const lm_cublas_fns **fns, lm_err *err)
{
    static const char *const syms[] = {"cublasCreate_v2", "cublasDestroy_v2", "cublasSetStream_v2",
                                       "cublasSetMathMode", "cublasSetWorkspace_v2", "cublasGetStatusString",
                                       "cublasSgemm_v2", "cublasSsyrk_v2", NULL};
    static_assert(sizeof cublas_fns == 8 * sizeof(void *), "one name per function of lm_cublas_fns");
    lm_status s = load("libcublas.so." STR(CUBLAS_VER_MAJOR), syms, (void **)&cublas_fns, &cublas_loaded, err);
    *fns = s == LM_OK ? &cublas_fns : NULL;
    return s;
}

lm_status lm_cuda_load_cusolver(const lm_cusolver_fns **fns, lm_err *err)
{
    static const char *const syms[] = {"cusolverDnCreate", "cusolverDnDestroy", "cusolverDnSetStream",
                                       "cusolverDnCreateParams", "cusolverDnDestroyParams",
                                       "cusolverDnXpotrf_bufferSize", "cusolverDnXpotrf", NULL};
    static_assert(sizeof cusolver_fns == 7 * sizeof(void *), "one name per function of lm_cusolver_fns");
    lm_status s = load("libcusolver.so." STR(CUSOLVER_VER_MAJOR), syms, (void **)&cusolver_fns, &cusolver_loaded,
                       err);
    *fns = s == LM_OK ? &cusolver_fns : NULL;
    return s;
}

extern "C" lm_status lm_cuda_load_libs(lm_err *err)
{
    const lm_cublas_fns *b;
    const lm_cusolver_fns *s;
    lm_status st = lm_cuda_load_cublas(&b, err);
    return st != LM_OK ? st : lm_cuda_load_cusolver(&s, err);
}
