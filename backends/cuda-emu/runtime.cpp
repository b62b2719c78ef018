// The emulated device's runtime (the CUDA runtime API of cuda_runtime.h): device memory as host
// memory within a byte budget, pinned memory, copies that check which side of the bus each
// pointer is on, the last error and the sticky one, and the injected failures of
// LLMERGE_EMU_FAIL (below).
//
// Work is deferred as on a GPU: kernels, asynchronous copies that touch device or pinned memory
// and memsets are queued, in the order they were issued (one order every stream's work may run
// in), and run only when the host waits: a stream, event or device synchronisation, a
// synchronous copy, cudaFree, cudaFreeHost, a library call (cuBLAS, cuSOLVER). So a host that
// reads a pinned buffer before waiting for the copy into it, or refills a staging buffer a queued
// copy has yet to read, sees what it would see on a GPU that had not got there yet. An
// asynchronous copy from pageable memory reads its source at once, one to pageable memory waits
// for the queue, as CUDA's do. A kernel's fault, or a deadlock, is seen by the call that ran it
// and every call after.
//
// The failures:
//
//   alloc-oom:N    the Nth cudaMalloc since the device opened fails with cudaErrorMemoryAllocation
//   launch-oom:N   the Nth kernel launch is refused with cudaErrorMemoryAllocation (as a lazily
//                  loaded kernel is when the device is full)
//   launch-fault:N the Nth kernel launch faults: the device is poisoned with the sticky
//                  cudaErrorLaunchFailure, which every later call returns
//   driver-old     the driver is older than the runtime: cudaGetDeviceCount fails with
//                  cudaErrorInsufficientDriver
//   no-cublas, no-cusolver  the library cannot be loaded (dlopen fails as for a missing file)
//
// Several switches may be given, separated by '|' or ','. LLMERGE_EMU_BLOCKS caps the blocks a
// launch runs (64; the kernels are grid-stride loops), and LLMERGE_EMU_SEED, when set to a
// number other than 0, runs each block's threads in a random order drawn from it. With
// LLMERGE_EMU_STATS set, closing the device prints how many allocations and launches it saw (so
// a test can inject a failure at each), and on a second line how many times the host waited for
// a whole stream or the device (cudaStreamSynchronize, cudaDeviceSynchronize, cudaFree) and how
// many cudaFree calls it made; stats() gives the same counts to a test.
#include "emu_impl.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

#include <deque>
#include <map>

namespace lm_emu {

#define STREAM_MAGIC 0x5354524du
#define EVENT_MAGIC 0x45564e54u
#define MAX_SHARED ((size_t)48 << 10)
#define DEFAULT_MAX_BLOCKS 64

struct stream_s {
    unsigned magic;
    uint64_t last;  // the queue position of the last work issued to it
};
struct event_s {
    unsigned magic;
    uint64_t at;  // the queue position it was recorded at (0: never)
};

// Queued work.
enum op_kind { OP_LAUNCH, OP_COPY, OP_SET };
struct op {
    op_kind kind;
    uint64_t seq;
    // OP_LAUNCH
    const char *name;
    dim3 grid, block;
    size_t shmem;
    void (*body)(void *);
    void *arg;
    void (*drop)(void *);
    uint64_t nth;
    // OP_COPY (height rows of width bytes) and OP_SET (value over width bytes)
    void *dst;
    const void *src;
    size_t dpitch, spitch, width, height;
    void *owned;  // a snapshot of a pageable source, freed once copied
    int value;
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static bool opened;
static uint64_t budget = (uint64_t)1 << 30, used;
static std::map<uintptr_t, size_t> *device_bufs;  // base -> size of every live cudaMalloc
static std::map<uintptr_t, size_t> *host_bufs;    // base -> size of pinned and registered host memory
static std::deque<op> *queue;                      // work not run yet, in issue order
static uint64_t issued;                            // the queue position of the last work issued
static pthread_mutex_t qlock = PTHREAD_MUTEX_INITIALIZER;  // the queue, while work runs
static uint64_t allocs, launches;
static uint64_t syncs, frees;  // host waits for a whole stream or the device; cudaFree calls
static uint64_t alloc_oom_at, launch_oom_at, launch_fault_at;
static bool driver_old, no_cublas, no_cusolver;
static unsigned max_blocks = DEFAULT_MAX_BLOCKS;
static uint64_t seed;  // LLMERGE_EMU_SEED: 0 runs a block's threads in order
static cudaError_t last_error = cudaSuccess, sticky = cudaSuccess, pending = cudaSuccess;

static void tables(void)
{
    if (!device_bufs) {
        device_bufs = new std::map<uintptr_t, size_t>;
        host_bufs = new std::map<uintptr_t, size_t>;
        queue = new std::deque<op>;
    }
}

cudaError_t set_error(cudaError_t e)
{
    if (e != cudaSuccess && last_error == cudaSuccess)
        last_error = e;
    return e;
}

void set_sticky(cudaError_t e)
{
    if (sticky == cudaSuccess)
        sticky = e;
    set_error(e);
}

cudaError_t sticky_error(void)
{
    return sticky;
}

// Starts every call but the error queries: a fault since the last call now poisons the device,
// and a poisoned device answers every call with its fault.
static cudaError_t enter(void)
{
    if (pending != cudaSuccess) {
        set_sticky(pending);
        pending = cudaSuccess;
    }
    return sticky != cudaSuccess ? set_error(sticky) : cudaSuccess;
}

#define ENTER()                          \
    do {                                 \
        cudaError_t e_ = enter();        \
        if (e_ != cudaSuccess)           \
            return e_;                   \
    } while (0)

// ---- the queue -------------------------------------------------------------------------------

// Whether [p, p + n) lies inside one entry of `m` (base -> size).
static bool inside(const std::map<uintptr_t, size_t> *m, const void *p, size_t n)
{
    auto it = m->upper_bound((uintptr_t)p);
    if (it == m->begin())
        return false;
    --it;
    uintptr_t base = it->first, q = (uintptr_t)p;
    return q >= base && q - base <= it->second && n <= it->second - (q - base);
}

static bool is_pinned(const void *p, size_t n)
{
    pthread_mutex_lock(&lock);
    tables();
    bool ok = inside(host_bufs, p, n);
    pthread_mutex_unlock(&lock);
    return ok;
}

static void run_op(op &o)
{
    if (o.kind == OP_LAUNCH) {
        // a device that has faulted runs nothing more
        if (sticky == cudaSuccess && pending == cudaSuccess) {
            char why[512];
            // each launch its own order, the same in every run with the same seed
            uint64_t order = seed ? (seed ^ 0x9E3779B97F4A7C15ull) * (o.nth | 1) | 1 : 0;
            if (o.nth == launch_fault_at) {
                pending = cudaErrorLaunchFailure;
            } else if (!run_grid(o.name, o.grid, o.block, o.shmem, max_blocks, order, o.body, o.arg, why,
                                 sizeof why)) {
                fprintf(stderr, "cuda-emu: %s\n", why);
                pending = cudaErrorLaunchFailure;
            }
        }
        o.drop(o.arg);
    } else if (o.kind == OP_COPY) {
        if (sticky == cudaSuccess && pending == cudaSuccess)
            for (size_t r = 0; r < o.height; r++)
                memmove((char *)o.dst + r * o.dpitch, (const char *)o.src + r * o.spitch, o.width);
        free(o.owned);
    } else if (sticky == cudaSuccess && pending == cudaSuccess) {
        memset(o.dst, o.value, o.width);
    }
}

// Runs the queued work up to and including position `upto`.
static void drain(uint64_t upto)
{
    pthread_mutex_lock(&qlock);
    tables();
    while (!queue->empty() && queue->front().seq <= upto) {
        op o = queue->front();
        queue->pop_front();
        run_op(o);
    }
    pthread_mutex_unlock(&qlock);
}

static void drain_all(void)
{
    drain(UINT64_MAX);
}

// Queues o on stream s.
static void enqueue(op o, cudaStream_t s)
{
    pthread_mutex_lock(&qlock);
    tables();
    o.seq = ++issued;
    if (s)
        s->last = o.seq;
    queue->push_back(o);
    pthread_mutex_unlock(&qlock);
}

// Waits for the queue up to `upto`; the device's error, a fault found on the way included.
static cudaError_t wait_for(uint64_t upto)
{
    drain(upto);
    return enter();
}

static bool parse_n(const char *s, const char *prefix, const char *end, uint64_t *n)
{
    size_t len = strlen(prefix);
    if ((size_t)(end - s) <= len || strncmp(s, prefix, len) != 0)
        return false;
    uint64_t v = 0;
    for (const char *p = s + len; p < end; p++) {
        if (*p < '0' || *p > '9' || v > 1000000000000ull)
            return false;
        v = v * 10 + (uint64_t)(*p - '0');
    }
    *n = v;
    return v > 0;
}

bool open_device(uint64_t bytes, const char *fail, char *why, size_t why_size)
{
    uint64_t a = 0, lo = 0, lf = 0;
    bool dold = false, nb = false, ns = false;
    for (const char *s = fail ? fail : ""; *s;) {
        const char *end = s + strcspn(s, "|,");
        size_t len = (size_t)(end - s);
        if (len == 10 && strncmp(s, "driver-old", len) == 0) {
            dold = true;
        } else if (len == 9 && strncmp(s, "no-cublas", len) == 0) {
            nb = true;
        } else if (len == 11 && strncmp(s, "no-cusolver", len) == 0) {
            ns = true;
        } else if (!parse_n(s, "alloc-oom:", end, &a) && !parse_n(s, "launch-oom:", end, &lo) &&
                   !parse_n(s, "launch-fault:", end, &lf)) {
            snprintf(why, why_size, "LLMERGE_EMU_FAIL=%s: expected alloc-oom:N, launch-oom:N or launch-fault:N "
                     "with N >= 1, driver-old, no-cublas or no-cusolver, separated by '|'", fail);
            return false;
        }
        s = *end ? end + 1 : end;
    }
    const char *mb = getenv("LLMERGE_EMU_BLOCKS"), *sd = getenv("LLMERGE_EMU_SEED");
    pthread_mutex_lock(&lock);
    tables();
    if (opened) {
        pthread_mutex_unlock(&lock);
        snprintf(why, why_size, "the emulated device is open already (one at a time)");
        return false;
    }
    opened = true;
    budget = bytes;
    allocs = launches = syncs = frees = 0;
    alloc_oom_at = a;
    launch_oom_at = lo;
    launch_fault_at = lf;
    driver_old = dold;
    no_cublas = nb;
    no_cusolver = ns;
    max_blocks = mb && atoi(mb) > 0 ? (unsigned)atoi(mb) : DEFAULT_MAX_BLOCKS;
    seed = sd ? strtoull(sd, NULL, 10) : 0;
    last_error = sticky = pending = cudaSuccess;
    pthread_mutex_unlock(&lock);
    return true;
}

// Counts a host wait for the whole device or a stream (and a cudaFree, which is one).
static void count_sync(bool is_free)
{
    pthread_mutex_lock(&lock);
    syncs++;
    frees += is_free;
    pthread_mutex_unlock(&lock);
}

void stats(uint64_t counts[4])
{
    pthread_mutex_lock(&lock);
    counts[0] = allocs;
    counts[1] = launches;
    counts[2] = syncs;
    counts[3] = frees;
    pthread_mutex_unlock(&lock);
}

void close_device(void)
{
    drain_all();
    pthread_mutex_lock(&lock);
    if (getenv("LLMERGE_EMU_STATS")) {
        fprintf(stderr, "cuda-emu: %llu allocations, %llu launches\n", (unsigned long long)allocs,
                (unsigned long long)launches);
        fprintf(stderr, "cuda-emu: %llu synchronisations, %llu frees\n", (unsigned long long)syncs,
                (unsigned long long)frees);
    }
    opened = false;
    pthread_mutex_unlock(&lock);
}

bool is_device(const void *p, size_t n)
{
    pthread_mutex_lock(&lock);
    tables();
    bool ok = inside(device_bufs, p, n);
    pthread_mutex_unlock(&lock);
    return ok;
}

bool take_bytes(size_t n)
{
    pthread_mutex_lock(&lock);
    bool ok = n <= budget - used;
    if (ok)
        used += n;
    pthread_mutex_unlock(&lock);
    return ok;
}

void give_bytes(size_t n)
{
    pthread_mutex_lock(&lock);
    used -= n;
    pthread_mutex_unlock(&lock);
}

// ---- errors ----------------------------------------------------------------------------------

const char *cudaGetErrorString(cudaError_t e)
{
    switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInitializationError: return "initialization error";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInvalidDevicePointer: return "invalid device pointer";
    case cudaErrorInvalidMemcpyDirection: return "invalid copy direction for memcpy";
    case cudaErrorInsufficientDriver: return "CUDA driver version is insufficient for CUDA runtime version";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorNotReady: return "device not ready";
    case cudaErrorIllegalAddress: return "an illegal memory access was encountered";
    case cudaErrorLaunchFailure: return "unspecified launch failure";
    }
    return "unrecognized error code";
}

const char *cudaGetErrorName(cudaError_t e)
{
    switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorLaunchFailure: return "cudaErrorLaunchFailure";
    default: return "cudaError";
    }
}

cudaError_t cudaGetLastError(void)
{
    if (pending != cudaSuccess)
        return sticky == cudaSuccess ? cudaSuccess : sticky;
    cudaError_t e = last_error;
    last_error = sticky;
    return e != cudaSuccess ? e : sticky;
}

cudaError_t cudaPeekAtLastError(void)
{
    return last_error != cudaSuccess ? last_error : sticky;
}

// ---- the device ------------------------------------------------------------------------------

cudaError_t cudaDriverGetVersion(int *v)
{
    *v = driver_old ? CUDART_VERSION - 60 : CUDART_VERSION;
    return cudaSuccess;
}

cudaError_t cudaRuntimeGetVersion(int *v)
{
    *v = CUDART_VERSION;
    return cudaSuccess;
}

cudaError_t cudaGetDeviceCount(int *count)
{
    *count = driver_old ? 0 : 1;
    return driver_old ? set_error(cudaErrorInsufficientDriver) : cudaSuccess;
}

bool lib_missing(const char *soname)
{
    return (no_cublas && strncmp(soname, "libcublas.", 10) == 0) ||
           (no_cusolver && strncmp(soname, "libcusolver.", 12) == 0);
}

cudaError_t cudaSetDevice(int device)
{
    ENTER();
    return device == 0 ? cudaSuccess : set_error(cudaErrorInvalidDevice);
}

cudaError_t cudaGetDevice(int *device)
{
    ENTER();
    *device = 0;
    return cudaSuccess;
}

cudaError_t cudaGetDeviceProperties(cudaDeviceProp *prop, int device)
{
    ENTER();
    if (device != 0)
        return set_error(cudaErrorInvalidDevice);
    memset(prop, 0, sizeof *prop);
    snprintf(prop->name, sizeof prop->name, "cuda-emu");
    prop->totalGlobalMem = (size_t)budget;
    prop->sharedMemPerBlock = MAX_SHARED;
    prop->regsPerBlock = 65536;
    prop->warpSize = 32;
    prop->maxThreadsPerBlock = 1024;
    prop->maxThreadsDim[0] = prop->maxThreadsDim[1] = 1024;
    prop->maxThreadsDim[2] = 64;
    prop->maxGridSize[0] = 0x7FFFFFFF;
    prop->maxGridSize[1] = prop->maxGridSize[2] = 65535;
    prop->major = 8;
    prop->minor = 0;
    prop->multiProcessorCount = 1;
    return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int *value, cudaDeviceAttr attr, int device)
{
    cudaDeviceProp p;
    cudaError_t e = cudaGetDeviceProperties(&p, device);
    if (e != cudaSuccess)
        return e;
    switch (attr) {
    case cudaDevAttrMaxThreadsPerBlock: *value = p.maxThreadsPerBlock; break;
    case cudaDevAttrMaxGridDimX: *value = p.maxGridSize[0]; break;
    case cudaDevAttrMaxSharedMemoryPerBlock: *value = (int)p.sharedMemPerBlock; break;
    case cudaDevAttrWarpSize: *value = p.warpSize; break;
    case cudaDevAttrMultiProcessorCount: *value = p.multiProcessorCount; break;
    case cudaDevAttrComputeCapabilityMajor: *value = p.major; break;
    case cudaDevAttrComputeCapabilityMinor: *value = p.minor; break;
    default: return set_error(cudaErrorInvalidValue);
    }
    return cudaSuccess;
}

cudaError_t cudaDeviceSynchronize(void)
{
    ENTER();
    count_sync(false);
    return wait_for(UINT64_MAX);
}

// ---- memory ----------------------------------------------------------------------------------

static bool stream_ok(cudaStream_t s)
{
    return !s || s->magic == STREAM_MAGIC;
}

cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total_bytes)
{
    ENTER();
    pthread_mutex_lock(&lock);
    *free_bytes = (size_t)(budget - used);
    *total_bytes = (size_t)budget;
    pthread_mutex_unlock(&lock);
    return cudaSuccess;
}

cudaError_t cudaMalloc(void **p, size_t size)
{
    *p = NULL;
    ENTER();
    pthread_mutex_lock(&lock);
    tables();
    allocs++;
    bool refuse = allocs == alloc_oom_at || size > budget - used;
    if (!refuse && size) {
        // Fresh device memory holds no zeroes to rely on: all ones, NaN as floats.
        if (posix_memalign(p, 256, size) != 0) {
            *p = NULL;
            refuse = true;
        } else {
            memset(*p, 0xFF, size);
            used += size;
            (*device_bufs)[(uintptr_t)*p] = size;
        }
    }
    pthread_mutex_unlock(&lock);
    return refuse ? set_error(cudaErrorMemoryAllocation) : cudaSuccess;
}

cudaError_t cudaFree(void *p)
{
    ENTER();
    if (!p)
        return cudaSuccess;
    count_sync(true);
    // cudaFree waits for the device's work
    if (wait_for(UINT64_MAX) != cudaSuccess)
        return sticky;
    pthread_mutex_lock(&lock);
    tables();
    auto it = device_bufs->find((uintptr_t)p);
    bool ok = it != device_bufs->end();
    if (ok) {
        used -= it->second;
        device_bufs->erase(it);
        free(p);
    }
    pthread_mutex_unlock(&lock);
    return ok ? cudaSuccess : set_error(cudaErrorInvalidDevicePointer);
}

cudaError_t cudaMallocAsync(void **p, size_t size, cudaStream_t s)
{
    if (!stream_ok(s)) {
        *p = NULL;
        return set_error(cudaErrorInvalidResourceHandle);
    }
    return cudaMalloc(p, size);
}

cudaError_t cudaFreeAsync(void *p, cudaStream_t s)
{
    if (!stream_ok(s))
        return set_error(cudaErrorInvalidResourceHandle);
    return cudaFree(p);
}

// Registered host memory is pinned for the copies: they read and write it when they run.
cudaError_t cudaHostRegister(void *p, size_t size, unsigned flags)
{
    (void)flags;
    ENTER();
    if (!p || !size || is_device(p, 1) || is_pinned(p, 1))
        return set_error(cudaErrorInvalidValue);
    pthread_mutex_lock(&lock);
    (*host_bufs)[(uintptr_t)p] = size;
    pthread_mutex_unlock(&lock);
    return cudaSuccess;
}

cudaError_t cudaHostUnregister(void *p)
{
    ENTER();
    if (wait_for(UINT64_MAX) != cudaSuccess)
        return sticky;
    pthread_mutex_lock(&lock);
    tables();
    bool ok = host_bufs->erase((uintptr_t)p) == 1;
    pthread_mutex_unlock(&lock);
    return ok ? cudaSuccess : set_error(cudaErrorInvalidValue);
}

cudaError_t cudaHostAlloc(void **p, size_t size, unsigned flags)
{
    (void)flags;
    *p = NULL;
    ENTER();
    if (posix_memalign(p, 4096, size ? size : 1) != 0) {
        *p = NULL;
        return set_error(cudaErrorMemoryAllocation);
    }
    pthread_mutex_lock(&lock);
    tables();
    (*host_bufs)[(uintptr_t)*p] = size ? size : 1;
    pthread_mutex_unlock(&lock);
    return cudaSuccess;
}

cudaError_t cudaMallocHost(void **p, size_t size)
{
    return cudaHostAlloc(p, size, cudaHostAllocDefault);
}

cudaError_t cudaFreeHost(void *p)
{
    ENTER();
    if (!p)
        return cudaSuccess;
    if (wait_for(UINT64_MAX) != cudaSuccess)  // as cudaFreeHost does
        return sticky;
    pthread_mutex_lock(&lock);
    tables();
    bool ok = host_bufs->erase((uintptr_t)p) == 1;
    pthread_mutex_unlock(&lock);
    if (!ok)
        return set_error(cudaErrorInvalidValue);
    free(p);
    return cudaSuccess;
}

// Whether a copy of rows from src to dst goes the way `kind` says: device pointers inside one
// allocation, host pointers outside every one. dspan and sspan are the bytes each side spans.
static bool check_sides(void *dst, size_t dspan, const void *src, size_t sspan, cudaMemcpyKind kind)
{
    if (dspan == 0)
        return true;
    bool dd = is_device(dst, dspan), sd = is_device(src, sspan);
    switch (kind) {
    case cudaMemcpyHostToHost: return !dd && !sd;
    case cudaMemcpyHostToDevice: return dd && !sd;
    case cudaMemcpyDeviceToHost: return !dd && sd;
    case cudaMemcpyDeviceToDevice: return dd && sd;
    case cudaMemcpyDefault: return true;
    }
    return false;
}

// A copy of height rows of width bytes on stream s; run at once and waited for when sync, else
// queued (a pageable source read now, a pageable destination waited for).
static cudaError_t copy(void *dst, size_t dpitch, const void *src, size_t spitch, size_t width, size_t height,
                        cudaMemcpyKind kind, cudaStream_t s, bool sync)
{
    ENTER();
    if (!stream_ok(s))
        return set_error(cudaErrorInvalidResourceHandle);
    if (width > dpitch || width > spitch)
        return set_error(cudaErrorInvalidValue);
    if (height == 0 || width == 0)
        return cudaSuccess;
    size_t dspan = (height - 1) * dpitch + width, sspan = (height - 1) * spitch + width;
    if (!check_sides(dst, dspan, src, sspan, kind))
        return set_error(cudaErrorInvalidValue);
    bool dst_host = !is_device(dst, dspan), src_host = !is_device(src, sspan);
    if (sync || (dst_host && !is_pinned(dst, dspan)) || (src_host && dst_host)) {
        cudaError_t e = wait_for(sync || !s ? UINT64_MAX : s->last);
        if (e != cudaSuccess)
            return e;
        for (size_t r = 0; r < height; r++)
            memmove((char *)dst + r * dpitch, (const char *)src + r * spitch, width);
        return cudaSuccess;
    }
    op o = {};
    o.kind = OP_COPY;
    o.dst = dst;
    o.src = src;
    o.dpitch = dpitch;
    o.spitch = spitch;
    o.width = width;
    o.height = height;
    if (src_host && !is_pinned(src, sspan)) {
        o.owned = malloc(sspan);
        if (!o.owned)
            return set_error(cudaErrorMemoryAllocation);
        memcpy(o.owned, src, sspan);
        o.src = o.owned;
    }
    enqueue(o, s);
    return cudaSuccess;
}

cudaError_t cudaMemcpy(void *dst, const void *src, size_t n, cudaMemcpyKind kind)
{
    return copy(dst, n, src, n, n, 1, kind, NULL, true);
}

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t n, cudaMemcpyKind kind, cudaStream_t s)
{
    return copy(dst, n, src, n, n, 1, kind, s, false);
}

cudaError_t cudaMemcpy2DAsync(void *dst, size_t dpitch, const void *src, size_t spitch, size_t width, size_t height,
                              cudaMemcpyKind kind, cudaStream_t s)
{
    return copy(dst, dpitch, src, spitch, width, height, kind, s, false);
}

cudaError_t cudaMemset(void *p, int value, size_t n)
{
    ENTER();
    if (n && !is_device(p, n))
        return set_error(cudaErrorInvalidValue);
    cudaError_t e = wait_for(UINT64_MAX);
    if (e != cudaSuccess)
        return e;
    memset(p, value, n);
    return cudaSuccess;
}

cudaError_t cudaMemsetAsync(void *p, int value, size_t n, cudaStream_t s)
{
    ENTER();
    if (!stream_ok(s))
        return set_error(cudaErrorInvalidResourceHandle);
    if (n && !is_device(p, n))
        return set_error(cudaErrorInvalidValue);
    if (!n)
        return cudaSuccess;
    op o = {};
    o.kind = OP_SET;
    o.dst = p;
    o.width = n;
    o.value = value;
    enqueue(o, s);
    return cudaSuccess;
}

// ---- streams and events: everything has run by the time a call returns ------------------------

cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned flags)
{
    (void)flags;
    *s = NULL;
    ENTER();
    *s = new stream_s{STREAM_MAGIC, 0};
    return cudaSuccess;
}

cudaError_t cudaStreamCreate(cudaStream_t *s)
{
    return cudaStreamCreateWithFlags(s, cudaStreamDefault);
}

cudaError_t cudaStreamDestroy(cudaStream_t s)
{
    if (!s || s->magic != STREAM_MAGIC)
        return set_error(cudaErrorInvalidResourceHandle);
    drain(s->last);  // its work still runs
    s->magic = 0;
    delete s;
    return enter();
}

cudaError_t cudaStreamSynchronize(cudaStream_t s)
{
    ENTER();
    if (!stream_ok(s))
        return set_error(cudaErrorInvalidResourceHandle);
    count_sync(false);
    return wait_for(s ? s->last : UINT64_MAX);
}

cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned flags)
{
    (void)flags;
    ENTER();
    return stream_ok(s) && e && e->magic == EVENT_MAGIC ? cudaSuccess : set_error(cudaErrorInvalidResourceHandle);
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned flags)
{
    (void)flags;
    *e = NULL;
    ENTER();
    *e = new event_s{EVENT_MAGIC, 0};
    return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t *e)
{
    return cudaEventCreateWithFlags(e, cudaEventDefault);
}

cudaError_t cudaEventDestroy(cudaEvent_t e)
{
    if (!e || e->magic != EVENT_MAGIC)
        return set_error(cudaErrorInvalidResourceHandle);
    e->magic = 0;
    delete e;
    return enter();
}

// An event marks the queue position of its stream's last work (everything issued before it, on
// any stream, in this emulation's one order).
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s)
{
    ENTER();
    if (!e || e->magic != EVENT_MAGIC || !stream_ok(s))
        return set_error(cudaErrorInvalidResourceHandle);
    pthread_mutex_lock(&qlock);
    e->at = s ? s->last : issued;
    pthread_mutex_unlock(&qlock);
    return cudaSuccess;
}

cudaError_t cudaEventSynchronize(cudaEvent_t e)
{
    ENTER();
    if (!e || e->magic != EVENT_MAGIC)
        return set_error(cudaErrorInvalidResourceHandle);
    return wait_for(e->at);
}

cudaError_t cudaEventQuery(cudaEvent_t e)
{
    return cudaEventSynchronize(e);
}

cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t start, cudaEvent_t end)
{
    ENTER();
    if (!start || !end || start->magic != EVENT_MAGIC || end->magic != EVENT_MAGIC)
        return set_error(cudaErrorInvalidResourceHandle);
    *ms = 0.0f;
    return cudaSuccess;
}

// ---- kernels ---------------------------------------------------------------------------------

void launch(const char *name, dim3 grid, dim3 block, size_t shmem, cudaStream_t stream, void (*body)(void *),
            void *arg, void (*drop)(void *))
{
    uint64_t threads = (uint64_t)block.x * block.y * block.z;
    if (enter() != cudaSuccess) {
        drop(arg);
        return;
    }
    if (!stream_ok(stream)) {
        set_error(cudaErrorInvalidResourceHandle);
        drop(arg);
        return;
    }
    if (threads == 0 || threads > 1024 || block.z > 64 || grid.x == 0 || grid.y == 0 || grid.z == 0 ||
        grid.x > 0x7FFFFFFFu || grid.y > 65535 || grid.z > 65535 || shmem > MAX_SHARED) {
        set_error(cudaErrorInvalidConfiguration);
        drop(arg);
        return;
    }
    pthread_mutex_lock(&lock);
    uint64_t nth = ++launches;
    pthread_mutex_unlock(&lock);
    if (nth == launch_oom_at) {  // refused at the launch, as a kernel that cannot be loaded
        set_error(cudaErrorMemoryAllocation);
        drop(arg);
        return;
    }
    op o = {};
    o.kind = OP_LAUNCH;
    o.name = name;
    o.grid = grid;
    o.block = block;
    o.shmem = shmem;
    o.body = body;
    o.arg = arg;
    o.drop = drop;
    o.nth = nth;
    enqueue(o, stream);
}

void wait_idle(void)
{
    drain_all();
}

}  // namespace lm_emu
