// A stand-in for the CUDA runtime's header, for compiling the CUDA backend (backends/cuda/*.cu)
// with the host C++ compiler onto the emulated device cuda-emu (backends/cuda-emu/). It
// declares what those files use, with the CUDA runtime's names and error codes: the function
// qualifiers, dim3 and the built-in indices, shared memory, the warp operations, atomics and
// math intrinsics the kernels call, and the runtime API (memory, copies, streams, events,
// errors, the device's properties). Kernels are launched by lm_emu::launch_kernel, which the
// build's launch rewriter (rewrite_launch.c) puts where the source has `k<<<g, b, s, st>>>(...)`.
//
// Everything is in namespace lm_emu (brought into scope by a using-directive), so that a build
// that links the real CUDA runtime too has no clashing symbols. Only C++ includes this header;
// the real CUDA headers must stay off the include path of the code that does.
#ifndef LM_EMU_CUDA_RUNTIME_H
#define LM_EMU_CUDA_RUNTIME_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <tuple>
#include <type_traits>
#include <utility>

// ---- qualifiers ----------------------------------------------------------------------------
// A kernel is a host function private to its file (it is launched only there); device functions
// are plain host functions; shared memory is one copy per OS thread, and blocks run one at a
// time on an OS thread, so it is per block.
#define __global__ static
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __shared__ static thread_local
#define __constant__ static
#define __restrict__ __restrict
#define __launch_bounds__(...)

#define CUDART_VERSION 12080

namespace lm_emu {

struct dim3 {
    unsigned x, y, z;
    constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct uint3 {
    unsigned x, y, z;
};

// The calling fiber's indices and its launch's shape (set at every switch into a fiber).
extern thread_local uint3 threadIdx, blockIdx;
extern thread_local dim3 blockDim, gridDim;
static const int warpSize = 32;

// ---- errors and handles --------------------------------------------------------------------
enum cudaError_t {
    cudaSuccess = 0,
    cudaErrorInvalidValue = 1,
    cudaErrorMemoryAllocation = 2,
    cudaErrorInitializationError = 3,
    cudaErrorInvalidConfiguration = 9,
    cudaErrorInvalidDevicePointer = 17,
    cudaErrorInvalidMemcpyDirection = 21,
    cudaErrorInsufficientDriver = 35,
    cudaErrorNoDevice = 100,
    cudaErrorInvalidDevice = 101,
    cudaErrorInvalidResourceHandle = 400,
    cudaErrorNotReady = 600,
    cudaErrorIllegalAddress = 700,
    cudaErrorLaunchFailure = 719,
};
typedef enum cudaError_t cudaError;

enum cudaMemcpyKind {
    cudaMemcpyHostToHost = 0,
    cudaMemcpyHostToDevice = 1,
    cudaMemcpyDeviceToHost = 2,
    cudaMemcpyDeviceToDevice = 3,
    cudaMemcpyDefault = 4,
};

struct stream_s;
struct event_s;
typedef stream_s *cudaStream_t;
typedef event_s *cudaEvent_t;

#define cudaStreamDefault 0x0u
#define cudaStreamNonBlocking 0x1u
#define cudaEventDefault 0x0u
#define cudaEventBlockingSync 0x1u
#define cudaEventDisableTiming 0x2u
#define cudaHostAllocDefault 0x0u
#define cudaHostAllocPortable 0x1u
#define cudaHostRegisterDefault 0x0u
#define cudaHostRegisterPortable 0x1u
#define cudaHostRegisterReadOnly 0x8u

struct cudaDeviceProp {
    char name[256];
    size_t totalGlobalMem;
    size_t sharedMemPerBlock;
    int regsPerBlock;
    int warpSize;
    int maxThreadsPerBlock;
    int maxThreadsDim[3];
    int maxGridSize[3];
    int major;
    int minor;
    int multiProcessorCount;
};

enum cudaDeviceAttr {
    cudaDevAttrMaxThreadsPerBlock = 1,
    cudaDevAttrMaxGridDimX = 5,
    cudaDevAttrMaxSharedMemoryPerBlock = 8,
    cudaDevAttrWarpSize = 10,
    cudaDevAttrMultiProcessorCount = 16,
    cudaDevAttrComputeCapabilityMajor = 75,
    cudaDevAttrComputeCapabilityMinor = 76,
};

struct cudaFuncAttributes {
    size_t sharedSizeBytes;
    size_t constSizeBytes;
    size_t localSizeBytes;
    int maxThreadsPerBlock;
    int numRegs;
    int ptxVersion;
    int binaryVersion;
};

// ---- the runtime API (runtime.cpp) ----------------------------------------------------------
// The device's sticky error (a fault that poisons it), cudaSuccess while there is none.
cudaError_t sticky_error(void);
const char *cudaGetErrorString(cudaError_t e);
const char *cudaGetErrorName(cudaError_t e);
cudaError_t cudaGetLastError(void);
cudaError_t cudaPeekAtLastError(void);
cudaError_t cudaDriverGetVersion(int *v);
cudaError_t cudaRuntimeGetVersion(int *v);
cudaError_t cudaGetDeviceCount(int *count);
cudaError_t cudaSetDevice(int device);
cudaError_t cudaGetDevice(int *device);
cudaError_t cudaGetDeviceProperties(cudaDeviceProp *prop, int device);
cudaError_t cudaDeviceGetAttribute(int *value, cudaDeviceAttr attr, int device);
cudaError_t cudaDeviceSynchronize(void);
cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total_bytes);
cudaError_t cudaMalloc(void **p, size_t size);
cudaError_t cudaFree(void *p);
// Stream-ordered allocation: in order, as everything here.
cudaError_t cudaMallocAsync(void **p, size_t size, cudaStream_t s);
cudaError_t cudaFreeAsync(void *p, cudaStream_t s);
cudaError_t cudaHostRegister(void *p, size_t size, unsigned flags);
cudaError_t cudaHostUnregister(void *p);
cudaError_t cudaHostAlloc(void **p, size_t size, unsigned flags);
cudaError_t cudaMallocHost(void **p, size_t size);
cudaError_t cudaFreeHost(void *p);
cudaError_t cudaMemcpy(void *dst, const void *src, size_t n, cudaMemcpyKind kind);
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t n, cudaMemcpyKind kind, cudaStream_t s = 0);
cudaError_t cudaMemcpy2DAsync(void *dst, size_t dpitch, const void *src, size_t spitch, size_t width, size_t height,
                              cudaMemcpyKind kind, cudaStream_t s = 0);
cudaError_t cudaMemset(void *p, int value, size_t n);
cudaError_t cudaMemsetAsync(void *p, int value, size_t n, cudaStream_t s = 0);
cudaError_t cudaStreamCreate(cudaStream_t *s);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned flags);
cudaError_t cudaStreamDestroy(cudaStream_t s);
cudaError_t cudaStreamSynchronize(cudaStream_t s);
cudaError_t cudaEventCreate(cudaEvent_t *e);
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned flags);
cudaError_t cudaEventDestroy(cudaEvent_t e);
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s = 0);
cudaError_t cudaEventSynchronize(cudaEvent_t e);
cudaError_t cudaEventQuery(cudaEvent_t e);
cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t start, cudaEvent_t end);
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned flags = 0);

template <class T>
inline cudaError_t cudaMalloc(T **p, size_t size)
{
    return cudaMalloc((void **)p, size);
}
template <class T>
inline cudaError_t cudaMallocAsync(T **p, size_t size, cudaStream_t s)
{
    return cudaMallocAsync((void **)p, size, s);
}
template <class T>
inline cudaError_t cudaHostAlloc(T **p, size_t size, unsigned flags)
{
    return cudaHostAlloc((void **)p, size, flags);
}
template <class T>
inline cudaError_t cudaMallocHost(T **p, size_t size)
{
    return cudaMallocHost((void **)p, size);
}

// Kernels are functions of this file's translation unit, so a kernel's attributes are known
// without loading anything: every kernel can run 1024 threads a block.
template <class... P>
inline cudaError_t cudaFuncGetAttributes(cudaFuncAttributes *a, void (*)(P...))
{
    memset(a, 0, sizeof *a);
    a->maxThreadsPerBlock = 1024;
    a->ptxVersion = a->binaryVersion = 80;
    return sticky_error();
}
// The runtime API's form, the kernel given by its address.
inline cudaError_t cudaFuncGetAttributes(cudaFuncAttributes *a, const void *func)
{
    return cudaFuncGetAttributes(a, reinterpret_cast<void (*)()>(const_cast<void *>(func)));
}

// ---- kernels --------------------------------------------------------------------------------
// The launch: queues body(arg) to run as every thread of every block of the grid (fewer blocks
// than asked where the grid exceeds the emulator's block limit: the kernels are grid-stride
// loops) when the host next waits, then drop(arg); or records why it could not (a bad
// configuration, an injected out-of-memory) as the error cudaGetLastError returns, and drops arg.
void launch(const char *name, dim3 grid, dim3 block, size_t shmem, cudaStream_t stream, void (*body)(void *),
            void *arg, void (*drop)(void *));

// The calling block's dynamic shared memory (the launch's shmem bytes).
void *dynamic_shared(void);

template <class T>
inline T pass_as(T v)
{
    return v;
}

// What `name<<<grid, block, shmem, stream>>>(args...)` becomes: the arguments converted to the
// kernel's parameter types and copied, as CUDA copies them at the launch, then the kernel queued
// to run by every thread.
template <class... P, class... A>
inline void launch_kernel(const char *name, void (*kernel)(P...), dim3 grid, dim3 block, size_t shmem,
                          cudaStream_t stream, A &&...args)
{
    static_assert(sizeof...(P) == sizeof...(A), "a kernel launched with the wrong number of arguments");
    struct call {
        void (*kernel)(P...);
        std::tuple<typename std::decay<P>::type...> args;
        static void run(void *p)
        {
            call *c = (call *)p;
            std::apply(c->kernel, c->args);
        }
        static void drop(void *p)
        {
            delete (call *)p;
        }
    };
    call *c =
        new call{kernel, std::tuple<typename std::decay<P>::type...>(pass_as<typename std::decay<P>::type>(args)...)};
    launch(name, grid, block, shmem, stream, call::run, c, call::drop);
}

// ---- synchronisation and warp operations (fiber.cpp) ----------------------------------------
// A barrier of the block's threads; threads that have exited no longer count.
void __syncthreads(void);

enum warp_op { WARP_SHFL, WARP_SHFL_DOWN, WARP_SHFL_UP, WARP_SHFL_XOR, WARP_BALLOT, WARP_MATCH_ANY, WARP_SYNC, WARP_ACTIVE };

// Every lane of `mask` in the calling warp meets here with its value v (the bits of a value of at
// most 8 bytes) and argument arg; each gets its result once all have arrived. A lane of mask
// that has exited, or lanes that meet at different operations, are a deadlock the launch reports.
uint64_t warp_exchange(warp_op op, unsigned mask, uint64_t v, int arg, int width);

// The lanes of the calling warp that reach it: those that have not exited, once every lane has
// either come here or exited.
inline unsigned __activemask(void)
{
    return (unsigned)warp_exchange(WARP_ACTIVE, 0xFFFFFFFFu, 0, 0, 32);
}

template <class T>
inline uint64_t to_bits(T v)
{
    static_assert(sizeof(T) <= 8, "a warp operation on a value of at most 8 bytes");
    uint64_t b = 0;
    memcpy(&b, &v, sizeof v);
    return b;
}
template <class T>
inline T from_bits(uint64_t b)
{
    T v;
    memcpy(&v, &b, sizeof v);
    return v;
}

template <class T>
inline T __shfl_sync(unsigned mask, T v, int src, int width = 32)
{
    return from_bits<T>(warp_exchange(WARP_SHFL, mask, to_bits(v), src, width));
}
template <class T>
inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32)
{
    return from_bits<T>(warp_exchange(WARP_SHFL_DOWN, mask, to_bits(v), (int)delta, width));
}
template <class T>
inline T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32)
{
    return from_bits<T>(warp_exchange(WARP_SHFL_UP, mask, to_bits(v), (int)delta, width));
}
template <class T>
inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32)
{
    return from_bits<T>(warp_exchange(WARP_SHFL_XOR, mask, to_bits(v), lane_mask, width));
}
inline unsigned __ballot_sync(unsigned mask, int pred)
{
    return (unsigned)warp_exchange(WARP_BALLOT, mask, pred != 0, 0, 32);
}
template <class T>
inline unsigned __match_any_sync(unsigned mask, T v)
{
    return (unsigned)warp_exchange(WARP_MATCH_ANY, mask, to_bits(v), 0, 32);
}
inline void __syncwarp(unsigned mask = 0xFFFFFFFFu)
{
    warp_exchange(WARP_SYNC, mask, 0, 0, 32);
}

// ---- atomics (blocks may run on several OS threads) ------------------------------------------
inline unsigned atomicAdd(unsigned *p, unsigned v)
{
    return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
}
inline int atomicAdd(int *p, int v)
{
    return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
}
inline unsigned long long atomicAdd(unsigned long long *p, unsigned long long v)
{
    return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
}
inline float atomicAdd(float *p, float v)
{
    float old, want;
    __atomic_load(p, &old, __ATOMIC_RELAXED);
    do
        want = old + v;
    while (!__atomic_compare_exchange(p, &old, &want, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED));
    return old;
}
inline double atomicAdd(double *p, double v)
{
    double old, want;
    __atomic_load(p, &old, __ATOMIC_RELAXED);
    do
        want = old + v;
    while (!__atomic_compare_exchange(p, &old, &want, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED));
    return old;
}
inline unsigned atomicMax(unsigned *p, unsigned v)
{
    unsigned old = __atomic_load_n(p, __ATOMIC_RELAXED);
    while (old < v && !__atomic_compare_exchange_n(p, &old, v, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
    }
    return old;
}
inline unsigned atomicCAS(unsigned *p, unsigned cmp, unsigned v)
{
    __atomic_compare_exchange_n(p, &cmp, v, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
    return cmp;
}

// ---- integer and float intrinsics, with CUDA's semantics --------------------------------------
inline int __popc(unsigned x)
{
    return __builtin_popcount(x);
}
inline int __popcll(unsigned long long x)
{
    return __builtin_popcountll(x);
}
inline int __ffs(int x)
{
    return __builtin_ffs(x);
}
inline int __ffsll(long long x)
{
    return __builtin_ffsll(x);
}
inline int __clz(int x)
{
    return x ? __builtin_clz((unsigned)x) : 32;
}
inline unsigned __brev(unsigned x)
{
    x = ((x >> 1) & 0x55555555u) | ((x & 0x55555555u) << 1);
    x = ((x >> 2) & 0x33333333u) | ((x & 0x33333333u) << 2);
    x = ((x >> 4) & 0x0F0F0F0Fu) | ((x & 0x0F0F0F0Fu) << 4);
    x = ((x >> 8) & 0x00FF00FFu) | ((x & 0x00FF00FFu) << 8);
    return (x >> 16) | (x << 16);
}
// Round-to-nearest-even arithmetic never contracted (the build uses -ffp-contract=off), as
// nvcc's _rn intrinsics and --fmad=false.
inline float __fadd_rn(float a, float b)
{
    return a + b;
}
inline float __fmul_rn(float a, float b)
{
    return a * b;
}
inline float __fmaf_rn(float a, float b, float c)
{
    return fmaf(a, b, c);
}
inline double __dadd_rn(double a, double b)
{
    return a + b;
}
inline double __dmul_rn(double a, double b)
{
    return a * b;
}
inline double __fma_rn(double a, double b, double c)
{
    return fma(a, b, c);
}
inline float __double2float_rn(double d)
{
    return (float)d;
}
inline float __int_as_float(int i)
{
    return from_bits<float>((uint32_t)i);
}
inline int __float_as_int(float f)
{
    return (int)(uint32_t)to_bits(f);
}
inline unsigned __float_as_uint(float f)
{
    return (uint32_t)to_bits(f);
}
inline float __uint_as_float(unsigned u)
{
    return from_bits<float>(u);
}
inline long long __double_as_longlong(double d)
{
    return (long long)to_bits(d);
}
inline double __longlong_as_double(long long l)
{
    return from_bits<double>((uint64_t)l);
}

}  // namespace lm_emu

using namespace lm_emu;

#endif
