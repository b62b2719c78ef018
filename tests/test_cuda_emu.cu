// Tests of the emulated CUDA device itself (backends/cuda-emu/): this file is CUDA source,
// rewritten by rewrite_launch and compiled by the host C++ compiler as the backend is. Barriers
// (exited threads stop counting), shared memory per block (static and dynamic), the warp
// operations over 32 lanes, atomics, grid-stride launches with a capped grid, the deadlocks the
// runner reports, and the runtime: the budget, copies checked for their direction, work queued
// until the host waits, the last and the sticky error, the injected failures, and the cuBLAS/cuSOLVER wrappers behind the loader.
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "cuda_libs.h"
#include "emu_impl.h"

#define FULL 0xFFFFFFFFu

// ---- kernels ---------------------------------------------------------------------------------

// out[i] = the sum of in over the block, through shared memory and a barrier.
__global__ void k_block_sum(int *out, const int *in)
{
    __shared__ int part[256];
    part[threadIdx.x] = in[blockIdx.x * blockDim.x + threadIdx.x];
    __syncthreads();
    int s = 0;
    for (unsigned i = 0; i < blockDim.x; i++)
        s += part[i];
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}

// The same without the barrier: a thread reads its neighbours before they have written.
__global__ void k_block_sum_racy(int *out, const int *in)
{
    __shared__ int part[256];
    part[threadIdx.x] = in[blockIdx.x * blockDim.x + threadIdx.x];
    int s = 0;
    for (unsigned i = 0; i < blockDim.x; i++)
        s += part[i];
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
    __syncthreads();
}

// Threads of odd index leave early; the others meet at a barrier twice.
__global__ void k_early_exit(int *out)
{
    __shared__ int seen;
    if (threadIdx.x & 1)
        return;
    if (threadIdx.x == 0)
        seen = 0;
    __syncthreads();
    atomicAdd((unsigned *)&seen, 1u);
    __syncthreads();
    out[threadIdx.x] = seen;
}

// Each lane's results of the warp operations, 8 per lane.
__global__ void k_warp(unsigned *out, const float *x)
{
    unsigned lane = threadIdx.x & 31, *o = out + threadIdx.x * 8;
    float v = x[threadIdx.x];
    float down = __shfl_down_sync(FULL, v, 3);
    double from7 = __shfl_sync(FULL, (double)v * 2.0, 7);
    unsigned up = __shfl_up_sync(FULL, lane, 1);
    unsigned ballot = __ballot_sync(FULL, v > 0.0f);
    unsigned match = __match_any_sync(FULL, lane % 3);
    memcpy(&o[0], &down, 4);
    float f7 = (float)from7;
    memcpy(&o[1], &f7, 4);
    o[2] = up;
    o[3] = ballot;
    o[4] = match;
    o[5] = (unsigned)__popc(match);
    o[6] = (unsigned)__ffs((int)match);
    o[7] = __shfl_xor_sync(FULL, lane, 1);
}

// __activemask once the odd lanes have left.
__global__ void k_active(unsigned *out)
{
    if (threadIdx.x & 1)
        return;
    out[threadIdx.x] = __activemask();
}

// A full-mask shuffle after some lanes have left: a deadlock.
__global__ void k_warp_deadlock(int *out)
{
    if (threadIdx.x >= 16)
        return;
    out[threadIdx.x] = __shfl_sync(FULL, (int)threadIdx.x, 0);
}

// Half the warp at a barrier, half at a shuffle: a deadlock.
__global__ void k_barrier_deadlock(int *out)
{
    if (threadIdx.x < 16)
        out[threadIdx.x] = __shfl_sync(FULL, (int)threadIdx.x, 0);
    else
        __syncthreads();
}

// A grid-stride fill: out[i] = i, and how many blocks ran.
__global__ void k_fill(int64_t *out, int64_t n, unsigned *grid_seen)
{
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        out[i] = i;
    if (threadIdx.x == 0 && blockIdx.x == 0)
        *grid_seen = gridDim.x;
}

// Dynamic shared memory: a reversal within the block.
__global__ void k_reverse(float *out, const float *in)
{
    extern __shared__ float sh[];
    sh[threadIdx.x] = in[threadIdx.x];
    __syncthreads();
    out[threadIdx.x] = sh[blockDim.x - 1 - threadIdx.x];
}

template <int K>
__global__ void k_scale(float *x, int n)
{
    for (int i = (int)(blockIdx.x * blockDim.x + threadIdx.x); i < n; i += (int)(gridDim.x * blockDim.x))
        x[i] *= (float)K;
}

// ---- helpers ---------------------------------------------------------------------------------

static void reopen(uint64_t budget, const char *fail)
{
    char why[256];
    lm_emu::close_device();
    CHECK_MSG(lm_emu::open_device(budget, fail, why, sizeof why), "open_device: %s", why);
}

template <class T>
static T *dev_alloc(size_t n)
{
    T *p = NULL;
    CHECK(cudaMalloc(&p, n * sizeof(T)) == cudaSuccess);
    return p;
}

// ---- tests -----------------------------------------------------------------------------------

static void test_barriers(void)
{
    enum { B = 256, G = 3 };
    int in[B * G], out[B * G], want[G] = {0};
    for (int i = 0; i < B * G; i++) {
        in[i] = (i * 7919) % 1000 - 500;
        want[i / B] += in[i];
    }
    int *d_in = dev_alloc<int>(B * G), *d_out = dev_alloc<int>(B * G);
    cudaMemcpy(d_in, in, sizeof in, cudaMemcpyHostToDevice);
    k_block_sum<<<G, B>>>(d_out, d_in);
    CHECK(cudaGetLastError() == cudaSuccess);
    cudaMemcpy(out, d_out, sizeof out, cudaMemcpyDeviceToHost);
    int good = 0;
    for (int i = 0; i < B * G; i++)
        good += out[i] == want[i / B];
    CHECK_MSG(good == B * G, "block sums: %d of %d right", good, B * G);
    // without the barrier the sums are wrong: the emulation catches a missing __syncthreads
    k_block_sum_racy<<<G, B, 0, 0>>>(d_out, d_in);
    cudaMemcpy(out, d_out, sizeof out, cudaMemcpyDeviceToHost);
    good = 0;
    for (int i = 0; i < B * G; i++)
        good += out[i] == want[i / B];
    CHECK_MSG(good < B * G, "the racy block sums came out right (%d of %d)", good, B * G);
    // threads that have left stop counting at a barrier
    k_early_exit<<<1, 64>>>(d_out);
    CHECK(cudaGetLastError() == cudaSuccess);
    cudaMemcpy(out, d_out, 64 * sizeof(int), cudaMemcpyDeviceToHost);
    good = 0;
    for (int i = 0; i < 64; i += 2)
        good += out[i] == 32;
    CHECK_MSG(good == 32, "early exit: %d of 32 threads saw 32 arrivals", good);
    cudaFree(d_in);
    cudaFree(d_out);
}

static void test_warps(void)
{
    enum { B = 64 };
    float x[B];
    for (int i = 0; i < B; i++)
        x[i] = (i % 5 == 0 ? -1.0f : 1.0f) * (float)(i + 1);
    float *d_x = dev_alloc<float>(B);
    unsigned *d_out = dev_alloc<unsigned>(B * 8), out[B * 8];
    cudaMemcpy(d_x, x, sizeof x, cudaMemcpyHostToDevice);
    k_warp<<<1, B>>>(d_out, d_x);
    CHECK(cudaGetLastError() == cudaSuccess);
    cudaMemcpy(out, d_out, sizeof out, cudaMemcpyDeviceToHost);
    int bad = 0;
    for (int t = 0; t < B; t++) {
        int lane = t & 31, w0 = t - lane;
        unsigned *o = out + t * 8;
        float down, f7;
        memcpy(&down, &o[0], 4);
        memcpy(&f7, &o[1], 4);
        unsigned ballot = 0, match = 0;
        for (int l = 0; l < 32; l++) {
            ballot |= (unsigned)(x[w0 + l] > 0.0f) << l;
            match |= (unsigned)(l % 3 == lane % 3) << l;
        }
        bad += down != (lane + 3 < 32 ? x[t + 3] : x[t]);  // beyond the warp: the lane's own value
        bad += f7 != x[w0 + 7] * 2.0f;
        bad += o[2] != (unsigned)(lane ? lane - 1 : 0);
        bad += o[3] != ballot;
        bad += o[4] != match;
        bad += o[5] != (unsigned)__builtin_popcount(match);
        bad += o[6] != (unsigned)__builtin_ffs((int)match);
        bad += o[7] != (unsigned)(lane ^ 1);
    }
    CHECK_MSG(bad == 0, "warp operations: %d wrong results", bad);
    k_active<<<1, 32>>>(d_out);
    cudaMemcpy(out, d_out, 32 * sizeof(unsigned), cudaMemcpyDeviceToHost);
    CHECK_MSG(out[0] == 0x55555555u, "__activemask with the odd lanes gone: %08x", out[0]);
    cudaFree(d_x);
    cudaFree(d_out);
}

static void test_launches(void)
{
    enum { N = 100000 };
    int64_t *d = dev_alloc<int64_t>(N);
    unsigned *d_grid = dev_alloc<unsigned>(1), grid = 0;
    k_fill<<<(N + 255) / 256, 256, 0, 0>>>(d, N, d_grid);
    CHECK(cudaGetLastError() == cudaSuccess);
    int64_t *h = (int64_t *)malloc(N * sizeof *h);
    cudaMemcpy(h, d, N * sizeof *h, cudaMemcpyDeviceToHost);
    cudaMemcpy(&grid, d_grid, sizeof grid, cudaMemcpyDeviceToHost);
    int64_t good = 0;
    for (int64_t i = 0; i < N; i++)
        good += h[i] == i;
    CHECK_MSG(good == N, "grid-stride fill: %lld of %d", (long long)good, N);
    CHECK_MSG(grid >= 1 && grid <= (N + 255) / 256, "gridDim.x %u", grid);
    free(h);
    // dynamic shared memory, a template kernel, a stream
    float in[128], out[128];
    for (int i = 0; i < 128; i++)
        in[i] = (float)i;
    float *d_in = dev_alloc<float>(128), *d_out = dev_alloc<float>(128);
    cudaStream_t s;
    CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess);
    cudaMemcpyAsync(d_in, in, sizeof in, cudaMemcpyHostToDevice, s);
    k_reverse<<<1, 128, 128 * sizeof(float), s>>>(d_out, d_in);
    k_scale<3><<<2, 32, 0, s>>>(d_out, 128);
    CHECK(cudaStreamSynchronize(s) == cudaSuccess);
    cudaMemcpy(out, d_out, sizeof out, cudaMemcpyDeviceToHost);
    int good2 = 0;
    for (int i = 0; i < 128; i++)
        good2 += out[i] == 3.0f * (float)(127 - i);
    CHECK_MSG(good2 == 128, "reverse and scale: %d of 128", good2);
    // a bad configuration is refused, and is not sticky
    k_scale<2><<<1, 2048>>>(d_out, 128);
    CHECK(cudaGetLastError() == cudaErrorInvalidConfiguration);
    CHECK(cudaGetLastError() == cudaSuccess);
    cudaStreamDestroy(s);
    cudaFree(d);
    cudaFree(d_grid);
    cudaFree(d_in);
    cudaFree(d_out);
}

// Work is queued until the host waits, as on a GPU: a copy into pinned memory is not there
// before the wait, a copy out of pinned memory reads it when it runs, one out of pageable memory
// when it is issued.
static void test_deferred(void)
{
    enum { N = 64 };
    float *pin = NULL, *d = dev_alloc<float>(N), page[N];
    CHECK(cudaHostAlloc(&pin, N * sizeof(float), cudaHostAllocDefault) == cudaSuccess);
    cudaStream_t s;
    cudaEvent_t ev;
    CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess);
    CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming) == cudaSuccess);
    for (int i = 0; i < N; i++)
        pin[i] = page[i] = 1.0f;
    cudaMemcpyAsync(d, pin, sizeof page, cudaMemcpyHostToDevice, s);  // reads pin when it runs
    for (int i = 0; i < N; i++)
        pin[i] = 2.0f;  // a staging buffer refilled before its copy ran
    k_scale<3><<<1, 32, 0, s>>>(d, N);
    cudaMemcpyAsync(pin, d, sizeof page, cudaMemcpyDeviceToHost, s);
    cudaEventRecord(ev, s);
    CHECK_MSG(pin[0] == 2.0f, "a copy home was there before the wait: %g", pin[0]);
    CHECK(cudaEventSynchronize(ev) == cudaSuccess);
    CHECK_MSG(pin[0] == 6.0f && pin[N - 1] == 6.0f, "after the wait: %g %g", pin[0], pin[N - 1]);
    cudaMemcpyAsync(d, page, sizeof page, cudaMemcpyHostToDevice, s);  // pageable: read now
    for (int i = 0; i < N; i++)
        page[i] = 5.0f;
    cudaMemcpyAsync(page, d, sizeof page, cudaMemcpyDeviceToHost, s);  // pageable: waits
    CHECK_MSG(page[0] == 1.0f && page[N - 1] == 1.0f, "pageable copies: %g %g", page[0], page[N - 1]);
    cudaEventDestroy(ev);
    cudaStreamDestroy(s);
    cudaFreeHost(pin);
    cudaFree(d);
}

// A kernel that deadlocks poisons the device: the launch itself returns, the next call sees a
// sticky cudaErrorLaunchFailure.
static void deadlock(void (*launch)(int *), const char *what)
{
    reopen(1 << 20, NULL);
    int *d = dev_alloc<int>(64);
    launch(d);
    CHECK_MSG(cudaDeviceSynchronize() == cudaErrorLaunchFailure, "%s: no launch failure", what);
    CHECK_MSG(cudaGetLastError() == cudaErrorLaunchFailure && cudaGetLastError() == cudaErrorLaunchFailure,
              "%s: the failure is not sticky", what);
    void *p = NULL;
    CHECK_MSG(cudaMalloc(&p, 16) == cudaErrorLaunchFailure, "%s: a poisoned device allocates", what);
}

static void launch_warp_deadlock(int *d)
{
    k_warp_deadlock<<<1, 32>>>(d);
}

static void launch_barrier_deadlock(int *d)
{
    k_barrier_deadlock<<<1, 64>>>(d);
}

static void test_runtime(void)
{
    reopen(4096, NULL);
    size_t fr = 0, tot = 0;
    CHECK(cudaMemGetInfo(&fr, &tot) == cudaSuccess && fr == 4096 && tot == 4096);
    void *a = NULL, *b = NULL;
    CHECK(cudaMalloc(&a, 3000) == cudaSuccess && a);
    CHECK(cudaMalloc(&b, 2000) == cudaErrorMemoryAllocation && !b);
    CHECK(cudaGetLastError() == cudaErrorMemoryAllocation);
    CHECK(cudaGetLastError() == cudaSuccess);  // not sticky
    CHECK(cudaMemGetInfo(&fr, &tot) == cudaSuccess && fr == 1096);
    // copies go the way they say
    char host[16] = "abc";
    CHECK(cudaMemcpy(a, host, 16, cudaMemcpyHostToDevice) == cudaSuccess);
    CHECK(cudaMemcpy(host, a, 16, cudaMemcpyHostToDevice) == cudaErrorInvalidValue);
    CHECK(cudaMemcpy(a, host, 16, cudaMemcpyDeviceToHost) == cudaErrorInvalidValue);
    CHECK(cudaMemcpy((char *)a + 2990, host, 16, cudaMemcpyHostToDevice) == cudaErrorInvalidValue);  // past the end
    cudaGetLastError();
    CHECK(cudaFree(host) == cudaErrorInvalidDevicePointer);
    cudaGetLastError();
    CHECK(cudaFree(a) == cudaSuccess);
    CHECK(cudaMallocAsync(&a, 4096, 0) == cudaSuccess && cudaFreeAsync(a, 0) == cudaSuccess);
    // the injected failures
    reopen(1 << 20, "alloc-oom:2|launch-oom:1|launch-fault:3");
    void *p[3] = {NULL, NULL, NULL};
    CHECK(cudaMalloc(&p[0], 64) == cudaSuccess);
    CHECK(cudaMalloc(&p[1], 64) == cudaErrorMemoryAllocation);
    CHECK(cudaMalloc(&p[2], 64) == cudaSuccess);
    cudaGetLastError();
    float *d = (float *)p[0];
    k_scale<2><<<1, 16>>>(d, 16);
    CHECK(cudaGetLastError() == cudaErrorMemoryAllocation);
    k_scale<2><<<1, 16>>>(d, 16);
    CHECK(cudaGetLastError() == cudaSuccess);
    k_scale<2><<<1, 16>>>(d, 16);  // the fault: seen from the next call on
    CHECK(cudaStreamSynchronize(0) == cudaErrorLaunchFailure);
    CHECK(cudaMemcpy(p[2], p[0], 4, cudaMemcpyDeviceToDevice) == cudaErrorLaunchFailure);
    // an old driver, a missing library
    reopen(1 << 20, "driver-old|no-cusolver");
    int count = -1, drv = 0, rt = 0;
    CHECK(cudaGetDeviceCount(&count) == cudaErrorInsufficientDriver && count == 0);
    CHECK(cudaDriverGetVersion(&drv) == cudaSuccess && cudaRuntimeGetVersion(&rt) == cudaSuccess && drv < rt);
    CHECK(dlopen("libcublas.so.12", RTLD_NOW) && !dlopen("libcusolver.so.11", RTLD_NOW));
    CHECK(strstr(dlerror(), "libcusolver.so.11: cannot open shared object file") != NULL);
    char why[256];
    lm_emu::close_device();
    CHECK(!lm_emu::open_device(1, "launch-fault:0", why, sizeof why) && strstr(why, "LLMERGE_EMU_FAIL=launch-fault:0"));
    CHECK(!lm_emu::open_device(1, "alloc:3", why, sizeof why));
    reopen(1 << 20, NULL);
    cudaFree(p[0]);
    cudaFree(p[2]);
}

static void test_libs(void)
{
    reopen(1 << 20, NULL);
    lm_err err;
    memset(&err, 0, sizeof err);
    const lm_cublas_fns *blas = NULL;
    const lm_cusolver_fns *solver = NULL;
    CHECK_OK(lm_cuda_load_cublas(&blas, &err), &err);
    CHECK_OK(lm_cuda_load_cusolver(&solver, &err), &err);
    if (!blas || !solver)
        return;
    cublasHandle_t h;
    CHECK(blas->create(&h) == CUBLAS_STATUS_SUCCESS);
    // column-major C (2 x 2) = A (2 x 3) B (3 x 2): A = [1 3 5; 2 4 6], B = [1 1; 0 0; 2 1]
    float A[6] = {1, 2, 3, 4, 5, 6}, Bm[6] = {1, 0, 2, 1, 0, 1}, C[4], one = 1, zero = 0;
    float *dA = dev_alloc<float>(6), *dB = dev_alloc<float>(6), *dC = dev_alloc<float>(4);
    cudaMemcpy(dA, A, sizeof A, cudaMemcpyHostToDevice);
    cudaMemcpy(dB, Bm, sizeof Bm, cudaMemcpyHostToDevice);
    CHECK(blas->sgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, 2, 2, 3, &one, dA, 2, dB, 3, &zero, dC, 2) == CUBLAS_STATUS_SUCCESS);
    cudaMemcpy(C, dC, sizeof C, cudaMemcpyDeviceToHost);
    CHECK_MSG(C[0] == 11 && C[1] == 14 && C[2] == 6 && C[3] == 8, "sgemm %g %g %g %g", C[0],
              C[1], C[2], C[3]);
    CHECK(blas->sgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, 2, 2, 3, &one, dA, 1, dB, 3, &zero, dC, 2) ==
          CUBLAS_STATUS_INVALID_VALUE);
    // syrk, looked up as a loader would: the upper triangle of A Aᵀ (2 x 2)
    typedef cublasStatus_t (*syrk_fn)(cublasHandle_t, cublasFillMode_t, cublasOperation_t, int, int, const float *,
                                      const float *, int, const float *, float *, int);
    void *lib = dlopen("libcublas.so.12", RTLD_NOW);
    syrk_fn syrk = lib ? (syrk_fn)dlsym(lib, "cublasSsyrk_v2") : NULL;
    CHECK(syrk && !dlsym(lib, "cublasNoSuchFunction") && dlerror() && !dlopen("libcufft.so.11", RTLD_NOW));
    if (syrk) {
        CHECK(syrk(h, CUBLAS_FILL_MODE_UPPER, CUBLAS_OP_N, 2, 3, &one, dA, 2, &zero, dC, 2) == CUBLAS_STATUS_SUCCESS);
        cudaMemcpy(C, dC, sizeof C, cudaMemcpyDeviceToHost);
        CHECK_MSG(C[0] == 1 + 9 + 25 && C[2] == 2 + 12 + 30 && C[3] == 4 + 16 + 36, "ssyrk %g %g %g", C[0], C[2], C[3]);
    }
    blas->destroy(h);
    // a 2 x 2 factorisation, then one that is not positive definite: LAPACK's info
    cusolverDnHandle_t sh;
    CHECK(solver->create(&sh) == CUSOLVER_STATUS_SUCCESS);
    double M[4] = {4, 2, 2, 3}, U[4];
    double *dM = dev_alloc<double>(4);
    int info = -1, *d_info = dev_alloc<int>(1);
    cusolverDnParams_t params;
    CHECK(solver->create_params(&params) == CUSOLVER_STATUS_SUCCESS);
    cudaMemcpy(dM, M, sizeof M, cudaMemcpyHostToDevice);
    size_t dev_bytes = 0, host_bytes = 0;
    CHECK(solver->xpotrf_buffer_size(sh, params, CUBLAS_FILL_MODE_UPPER, 2, CUDA_R_64F, dM, 2, CUDA_R_64F, &dev_bytes,
                                     &host_bytes) == CUSOLVER_STATUS_SUCCESS);
    void *work = dev_alloc<char>(dev_bytes ? dev_bytes : 1);
    char host_work[64];
    CHECK(host_bytes <= sizeof host_work);
    CHECK(solver->xpotrf(sh, params, CUBLAS_FILL_MODE_UPPER, 2, CUDA_R_64F, dM, 2, CUDA_R_64F, work, dev_bytes,
                         host_work, host_bytes, d_info) == CUSOLVER_STATUS_SUCCESS);
    cudaMemcpy(U, dM, sizeof U, cudaMemcpyDeviceToHost);
    cudaMemcpy(&info, d_info, sizeof info, cudaMemcpyDeviceToHost);
    CHECK_MSG(info == 0 && U[0] == 2 && U[2] == 1 && U[3] == sqrt(2.0), "potrf: info %d, U %g %g %g", info, U[0], U[2],
              U[3]);
    double N2[4] = {1, 2, 2, 1};
    cudaMemcpy(dM, N2, sizeof N2, cudaMemcpyHostToDevice);
    CHECK(solver->xpotrf(sh, params, CUBLAS_FILL_MODE_UPPER, 2, CUDA_R_64F, dM, 2, CUDA_R_64F, work, dev_bytes,
                         host_work, host_bytes, d_info) == CUSOLVER_STATUS_SUCCESS);
    cudaMemcpy(&info, d_info, sizeof info, cudaMemcpyDeviceToHost);
    CHECK_MSG(info == 2, "potrf of an indefinite matrix: info %d", info);
    // a host pointer faults the device
    CHECK(solver->xpotrf(sh, params, CUBLAS_FILL_MODE_UPPER, 2, CUDA_R_64F, N2, 2, CUDA_R_64F, work, dev_bytes,
                         host_work, host_bytes, d_info) == CUSOLVER_STATUS_EXECUTION_FAILED);
    CHECK(cudaDeviceSynchronize() == cudaErrorIllegalAddress);
    solver->destroy_params(params);
    solver->destroy(sh);
    reopen(1 << 20, NULL);
}

int main(void)
{
    char why[256];
    CHECK_MSG(lm_emu::open_device(1 << 24, NULL, why, sizeof why), "open_device: %s", why);
    test_barriers();
    test_warps();
    test_launches();
    test_deferred();
    test_runtime();
    deadlock(launch_warp_deadlock, "a shuffle after lanes left");
    deadlock(launch_barrier_deadlock, "a barrier and a shuffle");
    test_libs();
    lm_emu::close_device();
    return check_report("test_cuda_emu");
}
