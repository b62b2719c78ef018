// The CUDA backend of the device interface (device.h): buffers in GPU memory, copies through
// pinned staging buffers, the merge operations as kernels (merge_ops.cu, convert.cu) and
// cuBLAS, the forward-pass operations as kernels (forward_ops.cu), all on one stream of the
// backend's own.
//
// Ordering. Every copy and kernel goes on the one stream, so each operation sees the results
// of the ones before it without any host-side waiting. Uploads return once the data has been
// copied out of the caller's memory (which may be released then) while the last DMAs may still
// run; kernels run while the host stages the next input. The host waits only where a result
// must reach it: downloads, the reductions whose result is a host value (hist_abs,
// hist_window, l1, the tie counts of topk_apply and topk_apply_by), lm_dev_sync, and before
// giving memory back to the driver (only when the cache below must make room, at the end of a
// factorisation and when the device closes).
//
// Errors. A failed allocation, and a kernel launch refused for want of memory, are
// LM_ERR_DEVICE_OOM and leave the device usable; any other CUDA failure is LM_ERR_DEVICE naming
// the call. A fault inside a kernel is reported by the next call that waits on the stream.
// Freeing and mem_info cannot return a status: a failure there is kept and returned by the next
// call that can (as the sim device does), and lm_dev_check, which the callers run at the end of
// every unit and of every run, returns it at the latest. A refusal by --gpu-mem's cap asks the
// device first, so that a device in error is never mistaken for a full one.
//
// Memory. --gpu-mem caps what the device shows as taken (nvidia-smi): every buffer is counted
// as the driver rounds it (charge()), and so are cuBLAS's workspace and what the cuBLAS and
// cuSOLVER handles took when they were made, and cuSOLVER's workspace of each factorisation.
// A released buffer is not given back to the driver but kept in a cache, stream-ordered as
// cudaFreeAsync's pools are: every later use of the memory is on the same stream, after the
// work that used it before, so the release neither waits nor frees, and the next allocation
// of the same rounded size takes it back without a cudaMalloc. The cache counts as taken
// against the cap and as free in mem_info; when an allocation would pass the cap, or the
// driver refuses it, the cache is given back (one wait for the stream, then cudaFree) and the
// allocation tried again, so out of memory is still out of memory only when the live buffers
// leave no room.
// Every kernel, and cuBLAS's first GEMM kernel, is loaded when the device opens, so that no
// launch later has to find memory for code.
//
// One caller at a time: like the other backends, a device is not shared between threads
// without a lock. Every entry point makes the device current for the calling thread.
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cusolverDn.h>

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dtype.h"
#include "status.h"

extern "C" {
#include "device_impl.h"
#include "parallel.h"
#include "sparsify.h"
#include "util.h"
}

#include "cuda_check.h"
#include "cuda_libs.h"
#include "kernels.h"
#include "cuda_int.h"

#define STAGE_BYTES ((size_t)16 << 20)  // each of the N_STAGE staging buffers (cuda_int.h)
#define SLICE_BYTES ((size_t)1 << 20)   // what one host thread copies into or out of one at a time
#define PAGE_BYTES ((size_t)2 << 20)    // the driver's page: buffers above SMALL_BYTES take whole ones
#define SMALL_BYTES ((size_t)1 << 20)   // buffers up to this share pages, in steps of SMALL_ALIGN
#define SMALL_ALIGN ((size_t)512)
#define BLAS_WS_MIN ((size_t)16 << 10)  // the least cuBLAS workspace with which no GEMM fails for want
                                        // of one; the recommended one is 4 MiB (32 MiB from Hopper on)
#define PRELOAD_MAX 128                 // kernels LM_CUDA_PRELOAD can list
#define TIE_COUNTS_OFF 256              // topk_apply's scratch: the tie end at 0, counts here
#define HIST_WIN_OFF 256                // hist_window's scratch: the count above at 0, the bins here
#define HIST_WIN_GROUP 3                // window bins hist_window counts per pass: they fill SCRATCH_MIN
static_assert(HIST_WIN_OFF + HIST_WIN_GROUP * LM_HIST_BINS * sizeof(uint32_t) <= SCRATCH_MIN,
              "hist_window's counts must fit the scratch every device keeps");

// Keeps the first failure of a call that returns nothing, for the next call that can report it.
static void defer(cuda_ctx *c, const char *what, cudaError_t e)
{
    if (c->deferred == LM_OK) {
        c->deferred = LM_ERR_DEVICE;
        snprintf(c->deferred_msg, sizeof c->deferred_msg, "%s: %s: %s", c->name, what, cudaGetErrorString(e));
    }
}

// Starts every entry point that returns a status: reports a deferred failure, and makes this
// device current for the calling thread (the runtime's current device is per thread).
static lm_status begin(lm_dev *d, lm_err *err)
{
    cuda_ctx *c = ctx_of(d);
    if (c->deferred != LM_OK) {
        lm_status s = c->deferred;
        c->deferred = LM_OK;
        return lm_err_set(err, s, "%s", c->deferred_msg);
    }
    cudaError_t e = cudaSetDevice(c->ordinal);
    if (e != cudaSuccess) {
        cudaGetLastError();
        return lm_err_set(err, LM_ERR_DEVICE, "%s: cudaSetDevice: %s", c->name, cudaGetErrorString(e));
    }
    return LM_OK;
}

lm_status lm_cuda_begin(lm_dev *d, lm_err *err)
{
    return begin(d, err);
}

// ==== memory ==================================================================================

static const char *cuda_name(lm_dev *d)
{
    return ctx_of(d)->name;
}

// What a buffer of `size` bytes takes on the device: the driver hands out 2 MiB pages, a
// buffer above 1 MiB takes whole pages of its own and smaller ones share pages in steps of
// 512 bytes. (An approximation of the driver's allocator, which documents no rule: what it
// leaves out is a fraction of a page per page of small buffers.)
static uint64_t charge(size_t size)
{
    size_t step = size > SMALL_BYTES ? PAGE_BYTES : SMALL_ALIGN;
    return ((uint64_t)size + step - 1) / step * step;
}

// Waits for the stream and reads the device's error state: a fault of earlier work (sticky:
// the context is lost) or an error no call has reported yet. LM_ERR_DEVICE naming it, or LM_OK.
// The caller has made the device current.
static lm_status device_state(cuda_ctx *c, lm_err *err)
{
    cudaError_t e = cudaStreamSynchronize(c->stream);
    if (e == cudaSuccess)
        e = cudaPeekAtLastError();
    if (e == cudaSuccess)
        return LM_OK;
    cudaGetLastError();
    return lm_err_set(err, LM_ERR_DEVICE, "%s: an operation failed on the device: %s", c->name,
                      cudaGetErrorString(e));
}

// Free: what the driver reports, but no more than the cap leaves; total: the device's, or the
// cap when that is smaller. Should the driver fail to answer (a device in error), the failure
// is kept for the next call that can report it and the last answer stands in: a device in
// error must stop the run, not look full and send the work to the CPU.
static void cuda_mem_info(lm_dev *d, size_t *free_bytes, size_t *total_bytes)
{
    cuda_ctx *c = ctx_of(d);
    size_t fr = 0, tot = 0;
    cudaError_t e = cudaSetDevice(c->ordinal);
    if (e == cudaSuccess)
        e = cudaMemGetInfo(&fr, &tot);
    if (e == cudaSuccess) {
        fr += (size_t)c->cached_asked;  // the cache's buffers are free for the next allocations
        if (fr > tot)
            fr = tot;
        c->last_free = fr;
        c->last_total = tot;
    } else {
        cudaGetLastError();
        defer(c, "cudaMemGetInfo", e);
        fr = c->last_free;
        tot = c->last_total;
    }
    if (c->mem_cap) {
        uint64_t live = c->used - c->cached;
        uint64_t room = c->mem_cap > live ? c->mem_cap - live : 0;
        if (fr > room)
            fr = (size_t)room;
        if (tot == 0 || tot > c->mem_cap)
            tot = (size_t)c->mem_cap;
    }
    *free_bytes = fr;
    *total_bytes = tot;
}

static lm_status out_of_memory(lm_dev *d, size_t size, lm_err *err)
{
    size_t fr, tot;
    char need[32], have[32];
    cuda_mem_info(d, &fr, &tot);
    return lm_err_set(err, LM_ERR_DEVICE_OOM, "%s out of memory: needed %s, %s free", ctx_of(d)->name,
                      lm_format_bytes(need, sizeof need, size), lm_format_bytes(have, sizeof have, fr));
}

static void cache_trim(cuda_ctx *c);

static bool over_cap(const cuda_ctx *c, size_t size)
{
    return c->mem_cap && (c->used > c->mem_cap || charge(size) > c->mem_cap - c->used);
}

// cudaMalloc within the cap, counted in c->used at charge(size). When the cap or the driver
// refuses and the cache holds memory, the cache is given back and the allocation tried once
// more. Out of memory, from the cap or the driver, is LM_ERR_DEVICE_OOM, and the failure is
// cleared so the device stays usable. The cap refuses only once the device has said it is not
// in error.
static lm_status dev_malloc(lm_dev *d, size_t size, void **ptr, lm_err *err)
{
    cuda_ctx *c = ctx_of(d);
    *ptr = NULL;
    if (over_cap(c, size) && c->n_cache)
        cache_trim(c);
    if (over_cap(c, size)) {
        lm_status s = device_state(c, err);
        return s != LM_OK ? s : out_of_memory(d, size, err);
    }
    cudaError_t e = cudaMalloc(ptr, size);
    if (e == cudaErrorMemoryAllocation && c->n_cache) {
        cudaGetLastError();
        cache_trim(c);
        e = cudaMalloc(ptr, size);
    }
    if (e != cudaSuccess) {
        cudaGetLastError();
        *ptr = NULL;
        if (e == cudaErrorMemoryAllocation)
            return out_of_memory(d, size, err);
        char b[32];
        return lm_err_set(err, LM_ERR_DEVICE, "%s: cudaMalloc of %s: %s", c->name, lm_format_bytes(b, sizeof b, size),
                          cudaGetErrorString(e));
    }
    c->used += charge(size);
    return LM_OK;
}

// cudaFree of `size` bytes from dev_malloc. cudaFree is not documented to wait for work still
// queued that uses the memory, so the stream is drained first. Failures are deferred.
static void dev_free(cuda_ctx *c, void *p, size_t size)
{
    if (!p)
        return;
    cudaError_t e = cudaStreamSynchronize(c->stream);
    if (e != cudaSuccess) {
        cudaGetLastError();
        defer(c, "an operation failed on the device", e);
    }
    e = cudaFree(p);
    if (e != cudaSuccess) {
        cudaGetLastError();
        defer(c, "cudaFree", e);
    }
    c->used -= charge(size);
}

// Gives every cached buffer back to the driver: one wait for the stream (the buffers' last
// work), then a cudaFree each. Failures are deferred.
static void cache_trim(cuda_ctx *c)
{
    cudaError_t e = cudaStreamSynchronize(c->stream);
    if (e != cudaSuccess) {
        cudaGetLastError();
        defer(c, "an operation failed on the device", e);
    }
    for (size_t i = 0; i < c->n_cache; i++) {
        e = cudaFree(c->cache[i].p);
        if (e != cudaSuccess) {
            cudaGetLastError();
            defer(c, "cudaFree", e);
        }
        c->used -= charge(c->cache[i].size);
    }
    c->n_cache = 0;
    c->cached = c->cached_asked = 0;
}

// Takes a cached buffer of size's rounding (charge()) that holds at least `size` bytes, the
// smallest such, out of the cache into *ptr and its size into *got; false when there is none.
// No wait is needed: the buffer's earlier work is on the stream every later use goes on.
static bool cache_take(cuda_ctx *c, size_t size, void **ptr, size_t *got)
{
    size_t best = c->n_cache;
    uint64_t want = charge(size);
    for (size_t i = 0; i < c->n_cache; i++) {
        size_t have = c->cache[i].size;
        if (have >= size && charge(have) == want && (best == c->n_cache || have < c->cache[best].size))
            best = i;
    }
    if (best == c->n_cache)
        return false;
    *ptr = c->cache[best].p;
    *got = c->cache[best].size;
    c->cache[best] = c->cache[--c->n_cache];
    c->cached -= want;
    c->cached_asked -= *got;
    return true;
}

// Keeps buffer p of `size` bytes (from dev_malloc) for reuse; gives it back to the driver
// (dev_free) when the cache's table cannot grow.
static void cache_put(cuda_ctx *c, void *p, size_t size)
{
    if (c->n_cache == c->cap_cache) {
        size_t cap = c->cap_cache ? 2 * c->cap_cache : 16;
        cuda_buf *b = (cuda_buf *)realloc(c->cache, cap * sizeof *b);
        if (!b) {
            dev_free(c, p, size);
            return;
        }
        c->cache = b;
        c->cap_cache = cap;
    }
    c->cache[c->n_cache].p = p;
    c->cache[c->n_cache].size = size;
    c->n_cache++;
    c->cached += charge(size);
    c->cached_asked += size;
}

// A buffer of at least `size` bytes: from the cache when it has one of that rounding, else from
// dev_malloc. Its size, to release it with, in *got.
static lm_status take(lm_dev *d, size_t size, void **ptr, size_t *got, lm_err *err)
{
    *got = size;
    if (cache_take(ctx_of(d), size, ptr, got))
        return LM_OK;
    return dev_malloc(d, size, ptr, err);
}

static lm_status cuda_alloc(lm_dev *d, size_t size, void **ptr, lm_err *err)
{
    cuda_ctx *c = ctx_of(d);
    *ptr = NULL;
    lm_status s = begin(d, err);
    if (s != LM_OK)
        return s;
    // Room in the table first, so that nothing can fail once the memory is taken.
    if (c->n_bufs == c->cap_bufs) {
        size_t cap = c->cap_bufs ? 2 * c->cap_bufs : 16;
        cuda_buf *b = (cuda_buf *)realloc(c->bufs, cap * sizeof *b);
        if (!b)
            return lm_err_set(err, LM_ERR_NOMEM, "%s: out of memory for its buffer table", c->name);
        c->bufs = b;
        c->cap_bufs = cap;
    }
    size_t got;
    if ((s = take(d, size, ptr, &got, err)) != LM_OK)
        return s;
    c->bufs[c->n_bufs].p = *ptr;
    c->bufs[c->n_bufs].size = got;
    c->n_bufs++;
    return LM_OK;
}

static void cuda_free(lm_dev *d, void *ptr)
{
    cuda_ctx *c = ctx_of(d);
    if (cudaSetDevice(c->ordinal) != cudaSuccess)
        cudaGetLastError();  // dev_free's calls then fail and say so
    for (size_t i = 0; i < c->n_bufs; i++) {
        if (c->bufs[i].p == ptr) {
            size_t size = c->bufs[i].size;
            c->bufs[i] = c->bufs[--c->n_bufs];
            cache_put(c, ptr, size);
            return;
        }
    }
    // Not a live buffer of this device (a host pointer, or freed twice): never handed to
    // cudaFree; the next call reports it.
    if (c->deferred == LM_OK) {
        c->deferred = LM_ERR_DEVICE;
        snprintf(c->deferred_msg, sizeof c->deferred_msg, "%s: a release was given %p, which is not a live %s buffer",
                 c->name, ptr, c->name);
    }
}

// Makes the device scratch at least `bytes` long. The old one goes to the cache, where the
// stream orders its reuse after the work still queued on it.
static lm_status scratch_reserve(lm_dev *d, size_t bytes, lm_err *err)
{
    cuda_ctx *c = ctx_of(d);
    if (bytes <= c->scratch_size)
        return LM_OK;
    size_t want = bytes < SCRATCH_MIN ? SCRATCH_MIN : bytes, got;
    if (c->scratch) {
        cache_put(c, c->scratch, c->scratch_size);
        c->scratch = NULL;
        c->scratch_size = 0;
    }
    lm_status s = take(d, want, &c->scratch, &got, err);
    if (s == LM_OK)
        c->scratch_size = got;
    return s;
}

lm_status lm_cuda_scratch_reserve(lm_dev *d, size_t bytes, lm_err *err)
{
    return scratch_reserve(d, bytes, err);
}

// Gives a scratch that one operation grew past SCRATCH_MIN (della's sorted keys of a group of rows) to
// the cache, once that operation is queued: there it counts as free (a live scratch of a slab's
// size would shrink every later unit's room for the rest of the run), and the next operation of
// that size takes it back without a cudaMalloc. The scratch every device keeps, which the
// growth put in the cache, is taken back (where the cache was given to the driver since, the
// next operation that needs scratch reserves it).
void lm_cuda_scratch_trim(lm_dev *d)
{
    cuda_ctx *c = ctx_of(d);
    if (c->scratch && c->scratch_size > SCRATCH_MIN) {
        cache_put(c, c->scratch, c->scratch_size);
        c->scratch = NULL;
        c->scratch_size = 0;
        size_t got;
        if (cache_take(c, SCRATCH_MIN, &c->scratch, &got))
            c->scratch_size = got;
    }
}

static lm_status host_reserve(cuda_ctx *c, size_t bytes, lm_err *err)
{
    if (bytes <= c->host_scratch_size)
        return LM_OK;
    void *p = realloc(c->host_scratch, bytes);
    if (!p)
        return lm_err_set(err, LM_ERR_NOMEM, "%s: out of host memory for a reduction's result", c->name);
    c->host_scratch = p;
    c->host_scratch_size = bytes;
    return LM_OK;
}

// ==== copies ==================================================================================

// Records staging buffer b's event after the copy just enqueued. Should the record fail, the
// event does not cover that copy, so the stream is drained before the buffer can be reused.
static cudaError_t record_staged(cuda_ctx *c, int b)
{
    cudaError_t e = cudaEventRecord(c->staged[b], c->stream);
    if (e != cudaSuccess)
        cudaStreamSynchronize(c->stream);
    return e;
}

// A host-side copy between a staging buffer and the caller's memory, in SLICE_BYTES slices
// shared among the pool's threads.
typedef struct stage_copy {
    char *dst;
    const char *src;
    size_t n;
} stage_copy;

static void stage_copy_task(void *ctx, int64_t i)
{
    const stage_copy *j = (const stage_copy *)ctx;
    size_t off = (size_t)i * SLICE_BYTES, len = j->n - off < SLICE_BYTES ? j->n - off : SLICE_BYTES;
    memcpy(j->dst + off, j->src + off, len);
}

static void copy_host(cuda_ctx *c, void *dst, const void *src, size_t n)
{
    if (n <= SLICE_BYTES || !c->pool || lm_pool_threads(c->pool) < 2) {
        memcpy(dst, src, n);
        return;
    }
    stage_copy j = {(char *)dst, (const char *)src, n};
    lm_pool_run(c->pool, (int64_t)((n + SLICE_BYTES - 1) / SLICE_BYTES), stage_copy_task, &j);
}

// Host → device through the pinned buffers in turn: chunk i is copied into one by the host
// threads while the DMAs of the chunks before it run from the others. A buffer is refilled
// only after its event says the DMA that read it is done. Returns when every chunk is in
// pinned memory and its DMA enqueued: src is no longer needed, and the DMAs still in flight
// are ordered before every later operation by the stream.
static lm_status cuda_upload(lm_dev *d, void *dst, const void *src, size_t n, lm_err *err)
{
    cuda_ctx *c = ctx_of(d);
    lm_status status = begin(d, err);
    if (status != LM_OK)
        return status;
    if (!c->n_stage) {
        // No pinned memory: the driver stages pageable memory itself; waiting for the copy
        // keeps src free to be released on return whatever the driver does.
        CUDA_TRY(cudaMemcpyAsync(dst, src, n, cudaMemcpyHostToDevice, c->stream));
        CUDA_TRY(cudaStreamSynchronize(c->stream));
        return LM_OK;
    }
    for (size_t off = 0; off < n;) {
        size_t len = n - off < STAGE_BYTES ? n - off : STAGE_BYTES;
        int b = c->next_stage;
        CUDA_TRY(cudaEventSynchronize(c->staged[b]));
        copy_host(c, c->pinned[b], (const char *)src + off, len);
        CUDA_TRY(cudaMemcpyAsync((char *)dst + off, c->pinned[b], len, cudaMemcpyHostToDevice, c->stream));
        CUDA_TRY(record_staged(c, b));
        c->next_stage = (b + 1) % c->n_stage;
        off += len;
    }
    return LM_OK;
fail:
    return status;
}

// Enqueues the DMA of chunk i of the n bytes at src into staging buffer b.
static cudaError_t stage_home(cuda_ctx *c, const void *src, size_t n, size_t i, int b)
{
    size_t off = i * STAGE_BYTES, len = n - off < STAGE_BYTES ? n - off : STAGE_BYTES;
    cudaError_t e = cudaMemcpyAsync(c->pinned[b], (const char *)src + off, len, cudaMemcpyDeviceToHost, c->stream);
    return e != cudaSuccess ? e : record_staged(c, b);
}

// Device → host through the pinned buffers: the DMAs of the chunks up to i + n_stage - 1 are
// enqueued before chunk i is copied out by the host threads, so they overlap. Returns when dst holds all n bytes. A fault of an earlier
// kernel on the stream surfaces here.
static lm_status copy_home(cuda_ctx *c, void *dst, const void *src, size_t n, lm_err *err)
{
    lm_status status = LM_OK;
    size_t chunks = (n + STAGE_BYTES - 1) / STAGE_BYTES;
    size_t ahead = 0;  // the chunks whose DMA is enqueued
    int first = c->next_stage;
    if (n == 0)
        return LM_OK;
    if (!c->n_stage) {
        CUDA_TRY(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToHost, c->stream));
        CUDA_TRY(cudaStreamSynchronize(c->stream));
        return LM_OK;
    }
    // Chunk i uses buffer (first + i) % n_stage. The DMA into a buffer is ordered by the stream
    // after any earlier DMA out of it, and the host has finished reading it (chunk i - n_stage)
    // before.
    for (size_t i = 0; i < chunks; i++) {
        for (; ahead < chunks && ahead < i + (size_t)c->n_stage; ahead++)
            CUDA_TRY(stage_home(c, src, n, ahead, (int)((first + ahead) % (size_t)c->n_stage)));
        int b = (int)((first + i) % (size_t)c->n_stage);
        size_t off = i * STAGE_BYTES, len = n - off < STAGE_BYTES ? n - off : STAGE_BYTES;
        CUDA_TRY(cudaEventSynchronize(c->staged[b]));
        copy_host(c, (char *)dst + off, c->pinned[b], len);
    }
    c->next_stage = (int)((first + chunks) % (size_t)c->n_stage);
    return LM_OK;
fail:
    return status;
}

lm_status lm_cuda_copy_home(cuda_ctx *c, void *dst, const void *src, size_t n, lm_err *err)
{
    return copy_home(c, dst, src, n, err);
}

static lm_status cuda_download(lm_dev *d, void *dst, const void *src, size_t n, lm_err *err)
{
    lm_status s = begin(d, err);
    return s != LM_OK ? s : copy_home(ctx_of(d), dst, src, n, err);
}

// Waits for everything enqueued; a fault of any earlier operation is LM_ERR_DEVICE here.
static lm_status cuda_sync(lm_dev *d, lm_err *err)
{
    cuda_ctx *c = ctx_of(d);
    lm_status s = begin(d, err);
    if (s != LM_OK)
        return s;
    cudaError_t e = cudaStreamSynchronize(c->stream);
    if (e != cudaSuccess) {
        cudaGetLastError();
        return lm_err_set(err, LM_ERR_DEVICE, "%s: an operation failed on the device: %s", c->name,
                          cudaGetErrorString(e));
    }
    return LM_OK;
}

// The device's error state, for lm_dev_check: a failure kept from a call that could not report
// it, then a fault of any work enqueued (the stream is drained).
static lm_status cuda_check(lm_dev *d, lm_err *err)
{
    lm_status s = begin(d, err);
    return s != LM_OK ? s : device_state(ctx_of(d), err);
}

// Releases everything, also after a device error (each call's failure is ignored: there is
// nobody left to report it to; the callers ran lm_dev_check before) and on a half-built device
// from lm_dev_cuda_create.
static void cuda_destroy(lm_dev *d)
{
    cuda_ctx *c = ctx_of(d);
    if (c) {
        cudaSetDevice(c->ordinal);
        if (c->stream)
            cudaStreamSynchronize(c->stream);
        for (size_t i = 0; i < c->n_bufs; i++)
            cudaFree(c->bufs[i].p);
        for (size_t i = 0; i < c->n_cache; i++)
            cudaFree(c->cache[i].p);
        if (c->scratch)
            cudaFree(c->scratch);
        if (c->blas_ws)
            cudaFree(c->blas_ws);
        for (int b = 0; b < N_STAGE; b++) {
            if (c->pinned[b])
                cudaFreeHost(c->pinned[b]);
            if (c->staged[b])
                cudaEventDestroy(c->staged[b]);
        }
        lm_pool_free(c->pool);
        if (c->blas)
            c->cublas->destroy(c->blas);
        if (c->solver_params)
            c->cusolver->destroy_params(c->solver_params);
        if (c->solver)
            c->cusolver->destroy(c->solver);
        if (c->stream)
            cudaStreamDestroy(c->stream);
        cudaGetLastError();
        free(c->bufs);
        free(c->cache);
        free(c->host_scratch);
        free(c);
    }
    free(d);
}

// ==== operations ==============================================================================

static lm_status cuda_to_f32(lm_dev *d, float *dst, const void *src, lm_dtype dt, int64_t n, lm_err *err)
{
    lm_status s = begin(d, err);
    if (s != LM_OK)
        return s;
    if (!lm_dtype_readable(dt))
        return lm_convert_to_f32(dst, src, dt, 0, err);  // the CPU's message, touching nothing
    return lm_cuda_convert_to_f32(dst, src, dt, n, ctx_of(d)->stream, err);
}

static lm_status cuda_from_f32(lm_dev *d, void *dst, lm_dtype dt, const float *src, int64_t n, lm_err *err)
{
    lm_status s = begin(d, err);
    if (s != LM_OK)
        return s;
    if (!lm_dtype_writable(dt))
        return lm_convert_from_f32(dst, dt, src, 0, err);
    return lm_cuda_convert_from_f32(dst, dt, src, n, ctx_of(d)->stream, err);
}

static lm_status cuda_gemm(lm_dev *d, bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha,
                           const float *a, int64_t lda, const float *b, int64_t ldb, float beta,
                           float *c, int64_t ldc, lm_err *err)
{
    lm_status s = begin(d, err);
    if (s != LM_OK)
        return s;
    // LoRA's B @ A in the CPU's order (lm_dev_gemm's contract), so that τ and the masks taken
    // from it are the CPU's bit for bit; cuBLAS for every other product.
    if (!ta && !tb && k <= LM_DEV_LOWRANK_MAX)
        return lm_cuda_lowrank(c, ldc, a, lda, b, ldb, m, n, k, alpha, beta, ctx_of(d)->stream, err);
    return lm_cuda_sgemm(ctx_of(d)->blas, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, ctx_of(d)->stream,
                         err);
}

static lm_status cuda_syrk(lm_dev *d, int64_t n, int64_t k, float alpha, const float *a, int64_t lda, float beta,
                           bool mirror, float *c, int64_t ldc, lm_err *err)
{
    lm_status s = begin(d, err);
    return s != LM_OK ? s
                      : lm_cuda_syrk(ctx_of(d)->blas, n, k, alpha, a, lda, beta, mirror, c, ldc, ctx_of(d)->stream,
                                     err);
}

static lm_status cuda_axpby(lm_dev *d, float *y, float a, const float *x, float b, int64_t n, lm_err *err)
{
    lm_status s = begin(d, err);
    return s != LM_OK ? s : lm_cuda_axpby(y, a, x, b, n, ctx_of(d)->stream, err);
}

static lm_status cuda_dora_rows(lm_dev *d, float *tau, const float *base, const float *magnitude,
                                int64_t rows, int64_t cols, lm_err *err)
{
    lm_status s = begin(d, err);
    return s != LM_OK ? s : lm_cuda_dora_rows(tau, base, magnitude, rows, cols, ctx_of(d)->stream, err);
}

static lm_status cuda_delta(lm_dev *d, float *tau, const void *src, lm_dtype dt, const float *base, int64_t n,
                           lm_err *err)
{
    lm_status s = begin(d, err);
    if (s != LM_OK)
        return s;
    if (!lm_dtype_readable(dt))
        return lm_convert_to_f32(tau, src, dt, 0, err);  // the CPU's message, touching nothing
    return lm_cuda_delta(tau, src, dt, base, n, ctx_of(d)->stream, err);
}

static lm_status cuda_importance(lm_dev *d, float *key, const float *tau, const double *ucc2, int64_t rows,
                                 int64_t cols, lm_err *err)
{
    lm_status s = begin(d, err);
    return s != LM_OK ? s : lm_cuda_importance(key, tau, ucc2, rows, cols, ctx_of(d)->stream, err);
}

// The factorisation on the CPU, for a device without cuSOLVER: a copied home, factored by
// LAPACKE (lm_cpu_potrf), the factor and its diagonal copied back. As the CPU backend's potrf:
// LM_ERR_FORMAT when a is not positive definite.
static lm_status potrf_on_cpu(lm_dev *d, double *a, int64_t n, double *diag, lm_err *err)
{
    cuda_ctx *c = ctx_of(d);
    lm_status status = LM_OK;
    size_t bytes = (size_t)n * (size_t)n * sizeof(double);
    int info = 0;
    double *h = (double *)malloc(bytes + (size_t)n * sizeof(double));
    if (!h)
        return lm_err_set(err, LM_ERR_NOMEM, "%s: out of host memory for a %lld x %lld factorisation", c->name,
                          (long long)n, (long long)n);
    double *h_diag = h + (size_t)n * (size_t)n;
    if ((status = copy_home(c, h, a, bytes, err)) != LM_OK)
        goto fail;
    if (lm_cpu_potrf(h, n, h_diag, &info) != LM_OK) {
        status = lm_err_set(err, LM_ERR_FORMAT, "%s: the %lld x %lld matrix is not positive definite (LAPACK dpotrf "
                            "info %d, factored on the CPU without cuSOLVER)", c->name, (long long)n, (long long)n,
                            info);
        goto fail;
    }
    if ((status = cuda_upload(d, a, h, bytes, err)) == LM_OK)
        status = cuda_upload(d, diag, h_diag, (size_t)n * sizeof(double), err);
fail:
    free(h);
    return status;
}

// cuSOLVER's 64-bit Cholesky factorisation (Xpotrf, in double) on the stream, with a device
// workspace allocated for the call (which is where the factorisation runs out of memory, and
// falls back, when the matrix itself fits), a host workspace when it asks for one, and the
// factor's info in the device scratch; the diagonal is gathered by one strided copy. The host
// waits for the info, to tell a matrix that is not positive definite. Without cuSOLVER, on the
// CPU (potrf_on_cpu).
static lm_status cuda_potrf(lm_dev *d, double *a, int64_t n, double *diag, lm_err *err)
{
    cuda_ctx *c = ctx_of(d);
    lm_status status = begin(d, err);
    cusolverStatus_t ss;
    int info = 0;
    void *work = NULL, *host_work = NULL;
    size_t work_bytes = 0, host_bytes = 0;
    if (status != LM_OK)
        return status;
    if (!c->solver)
        return potrf_on_cpu(d, a, n, diag, err);
    if ((status = scratch_reserve(d, sizeof(int), err)) != LM_OK || (status = host_reserve(c, sizeof(int), err)) != LM_OK)
        return status;
    ss = c->cusolver->xpotrf_buffer_size(c->solver, c->solver_params, CUBLAS_FILL_MODE_UPPER, n, CUDA_R_64F, a, n,
                                         CUDA_R_64F, &work_bytes, &host_bytes);
    if (ss != CUSOLVER_STATUS_SUCCESS) {
        cudaGetLastError();
        return lm_err_set(err, LM_ERR_DEVICE, "%s: cusolverDnXpotrf_bufferSize (n %lld): cuSOLVER status %d", c->name,
                          (long long)n, (int)ss);
    }
    if (work_bytes == 0)
        work_bytes = 1;
    if ((status = dev_malloc(d, work_bytes, &work, err)) != LM_OK)
        return status;
    if (host_bytes && !(host_work = malloc(host_bytes))) {
        status = lm_err_set(err, LM_ERR_NOMEM, "%s: out of host memory for cuSOLVER's workspace", c->name);
        goto fail;
    }
    ss = c->cusolver->xpotrf(c->solver, c->solver_params, CUBLAS_FILL_MODE_UPPER, n, CUDA_R_64F, a, n, CUDA_R_64F,
                             work, work_bytes, host_work, host_bytes, (int *)c->scratch);
    if (ss != CUSOLVER_STATUS_SUCCESS) {
        cudaGetLastError();
        status = lm_err_set(err, ss == CUSOLVER_STATUS_ALLOC_FAILED ? LM_ERR_DEVICE_OOM : LM_ERR_DEVICE,
                            "%s: cusolverDnXpotrf (n %lld): cuSOLVER status %d", c->name, (long long)n, (int)ss);
        goto fail;
    }
    CUDA_TRY(cudaMemcpy2DAsync(diag, sizeof(double), a, (size_t)(n + 1) * sizeof(double), sizeof(double), (size_t)n,
                               cudaMemcpyDeviceToDevice, c->stream));
    if ((status = copy_home(c, c->host_scratch, c->scratch, sizeof(int), err)) != LM_OK)
        goto fail;
    memcpy(&info, c->host_scratch, sizeof info);
    if (info > 0)
        status = lm_err_set(err, LM_ERR_FORMAT, "%s: the %lld x %lld matrix is not positive definite (cuSOLVER "
                            "Xpotrf info %d)", c->name, (long long)n, (long long)n, info);
    else if (info < 0)
        status = lm_err_set(err, LM_ERR_DEVICE, "%s: cusolverDnXpotrf refused argument %d", c->name, -info);
fail:
    dev_free(c, work, work_bytes);  // drains the stream first: the host workspace is free then
    free(host_work);
    return status;
}

// The histogram is built in device scratch, fetched home and added to the host's.
static lm_status cuda_hist_abs(lm_dev *d, uint64_t *hist, const float *x, int64_t n, int level,
                               uint32_t hi_bin, lm_err *err)
{
    cuda_ctx *c = ctx_of(d);
    const size_t bytes = (size_t)LM_HIST_BINS * sizeof(uint64_t);
    lm_status status = begin(d, err);
    const uint64_t *h;
    if (status != LM_OK || n <= 0)
        return status;
    if ((status = scratch_reserve(d, bytes, err)) != LM_OK || (status = host_reserve(c, bytes, err)) != LM_OK)
        return status;
    CUDA_TRY(cudaMemsetAsync(c->scratch, 0, bytes, c->stream));
    if ((status = lm_cuda_hist_abs((uint64_t *)c->scratch, x, n, level, hi_bin, c->stream, err)) != LM_OK ||
        (status = copy_home(c, c->host_scratch, c->scratch, bytes, err)) != LM_OK)
        return status;
    h = (const uint64_t *)c->host_scratch;
    for (size_t b = 0; b < LM_HIST_BINS; b++)
        hist[b] += h[b];
    return LM_OK;
fail:
    return status;
}

// The window's counts are built in device scratch as 32-bit counts (the count beyond the window
// first, then the histograms of a group of HIST_WIN_GROUP of the window's bins from
// HIST_WIN_OFF), fetched home and added to the host's: a group of bins per pass over x, so that
// the counts fit the scratch every device has, and a piece of at most UINT32_MAX elements at a
// time, so that no count can overflow. A pass reads x once; a window of LM_HIST_WINDOW bins
// takes a few passes, still fewer than the two full histograms it saves.
static lm_status cuda_hist_window(lm_dev *d, uint64_t *above, uint64_t *win, int n_win, uint32_t lo_bin,
                                  const float *x, int64_t n, lm_err *err)
{
    cuda_ctx *c = ctx_of(d);
    const size_t group_bytes = (size_t)LM_HIST_BINS * sizeof(uint32_t);
    lm_status status = begin(d, err);
    if (status != LM_OK || n <= 0)
        return status;
    if ((status = scratch_reserve(d, HIST_WIN_OFF + HIST_WIN_GROUP * group_bytes, err)) != LM_OK ||
        (status = host_reserve(c, HIST_WIN_OFF + HIST_WIN_GROUP * group_bytes, err)) != LM_OK)
        return status;
    uint32_t *d_above = (uint32_t *)c->scratch, *d_win = (uint32_t *)((char *)c->scratch + HIST_WIN_OFF);
    const uint32_t *h_above = (const uint32_t *)c->host_scratch;
    const uint32_t *h_win = (const uint32_t *)((const char *)c->host_scratch + HIST_WIN_OFF);
    for (int64_t off = 0; off < n;) {
        int64_t cnt = n - off < (int64_t)UINT32_MAX ? n - off : (int64_t)UINT32_MAX;
        // the first group counts the values beyond the whole window too (the only pass when
        // n_win is 0)
        int g = 0;
        do {
            int gn = n_win - g < HIST_WIN_GROUP ? n_win - g : HIST_WIN_GROUP;
            size_t bytes = HIST_WIN_OFF + (size_t)gn * group_bytes;
            CUDA_TRY(cudaMemsetAsync(c->scratch, 0, bytes, c->stream));
            if ((status = lm_cuda_hist_window(g == 0 ? d_above : NULL, lo_bin + (uint32_t)n_win, d_win, gn,
                                              lo_bin + (uint32_t)g, x + off, cnt, c->stream, err)) != LM_OK ||
                (status = copy_home(c, c->host_scratch, c->scratch, bytes, err)) != LM_OK)
                return status;
            if (g == 0)
                *above += h_above[0];
            uint64_t *dst = win + (size_t)g * LM_HIST_BINS;
            for (size_t b = 0; b < (size_t)gn * LM_HIST_BINS; b++)
                dst[b] += h_win[b];
            g += HIST_WIN_GROUP;
        } while (g < n_win);
        off += cnt;
    }
    return LM_OK;
fail:
    return status;
}

// Ties (magnitude bits == thr_bits) are kept in index order up to ties_allowed. With every tie
// kept, or none, one pass decides. Otherwise the ties of each chunk are counted and fetched
// home; when there are no more than allowed all are kept, else the host finds the chunk where
// the allowance runs out, a one-block kernel finds the index of the first tie beyond it there
// (into scratch), and the mask keeps the ties below that index, all without another wait.
// The decision is taken on key (x itself for plain top-k), x is what is zeroed.
static lm_status topk_run(lm_dev *d, float *x, const float *key, int64_t n, uint32_t thr_bits, int64_t ties_allowed,
                          bool drop, int64_t *ties_used, lm_err *err)
{
    cuda_ctx *c = ctx_of(d);
    lm_status s = begin(d, err);
    if (s != LM_OK)
        return s;
    if (n <= 0) {
        *ties_used = 0;
        return LM_OK;
    }
    if (ties_allowed == LM_TIES_ALL || ties_allowed <= 0) {
        int64_t tie_end = ties_allowed == LM_TIES_ALL ? n : 0;
        if ((s = lm_cuda_topk_mask(x, key, n, thr_bits, tie_end, NULL, drop, c->stream, err)) != LM_OK)
            return s;
        // LM_TIES_ALL is not counted; a negative allowance keeps no tie and is reported back
        // as the CPU backend reports it.
        *ties_used = ties_allowed == LM_TIES_ALL ? 0 : ties_allowed;
        return LM_OK;
    }
    int64_t chunks = (n + LM_CUDA_TIE_CHUNK - 1) / LM_CUDA_TIE_CHUNK;
    size_t count_bytes = (size_t)chunks * sizeof(uint32_t);
    if ((s = scratch_reserve(d, TIE_COUNTS_OFF + count_bytes, err)) != LM_OK ||
        (s = host_reserve(c, count_bytes, err)) != LM_OK)
        return s;
    int64_t *d_tie_end = (int64_t *)c->scratch;
    uint32_t *d_counts = (uint32_t *)((char *)c->scratch + TIE_COUNTS_OFF);
    const uint32_t *counts = (const uint32_t *)c->host_scratch;
    if ((s = lm_cuda_tie_counts(d_counts, key, n, thr_bits, c->stream, err)) != LM_OK ||
        (s = copy_home(c, c->host_scratch, d_counts, count_bytes, err)) != LM_OK)
        return s;
    int64_t total = 0, cut_chunk = -1, before = 0;
    for (int64_t i = 0; i < chunks; i++) {
        if (cut_chunk < 0 && total + counts[i] > ties_allowed) {
            cut_chunk = i;
            before = total;
        }
        total += counts[i];
    }
    if (cut_chunk < 0) {
        if ((s = lm_cuda_topk_mask(x, key, n, thr_bits, n, NULL, drop, c->stream, err)) != LM_OK)
            return s;
        *ties_used = total;
        return LM_OK;
    }
    // The tie of rank ties_allowed - before in cut_chunk is the first not kept.
    int64_t lo = cut_chunk * LM_CUDA_TIE_CHUNK, hi = n - lo < LM_CUDA_TIE_CHUNK ? n : lo + LM_CUDA_TIE_CHUNK;
    if ((s = lm_cuda_tie_find(d_tie_end, key, lo, hi, thr_bits, ties_allowed - before, c->stream, err)) != LM_OK ||
        (s = lm_cuda_topk_mask(x, key, n, thr_bits, 0, d_tie_end, drop, c->stream, err)) != LM_OK)
        return s;
    *ties_used = ties_allowed;
    return LM_OK;
}

static lm_status cuda_topk_apply(lm_dev *d, float *x, int64_t n, uint32_t thr_bits, int64_t ties_allowed,
                                 int64_t *ties_used, lm_err *err)
{
    return topk_run(d, x, x, n, thr_bits, ties_allowed, false, ties_used, err);
}

static lm_status cuda_topk_drop(lm_dev *d, float *x, int64_t n, uint32_t thr_bits, int64_t ties_allowed,
                                int64_t *ties_used, lm_err *err)
{
    return topk_run(d, x, x, n, thr_bits, ties_allowed, true, ties_used, err);
}

static lm_status cuda_topk_apply_by(lm_dev *d, float *x, const float *key, int64_t n, uint32_t thr_bits,
                                    int64_t ties_allowed, int64_t *ties_used, lm_err *err)
{
    return topk_run(d, x, key, n, thr_bits, ties_allowed, false, ties_used, err);
}

// Elements per piece of the mask operations: a piece's bits (and the first byte's others) fill
// at most the scratch every device keeps.
#define MASK_PIECE ((int64_t)(SCRATCH_MIN - 1) * 8)

// What both mask operations do first: the device's state checked, the range checked, and room
// for a piece's bytes in device scratch (and, when `home`, in host scratch). LM_OK with *work
// false when there is nothing to do (n is 0).
static lm_status mask_begin(lm_dev *d, int64_t first, int64_t n, bool home, bool *work, lm_err *err)
{
    cuda_ctx *c = ctx_of(d);
    lm_status status = begin(d, err);
    *work = false;
    if (status != LM_OK)
        return status;
    if (n < 0 || first < 0)
        return lm_err_set(err, LM_ERR_USAGE, "mask of %lld elements from %lld", (long long)n, (long long)first);
    if (n == 0)
        return LM_OK;
    size_t bytes = (size_t)((n < MASK_PIECE ? n : MASK_PIECE) + 7) / 8 + 1;
    if ((status = scratch_reserve(d, bytes, err)) != LM_OK || (home && (status = host_reserve(c, bytes, err)) != LM_OK))
        return status;
    *work = true;
    return LM_OK;
}

// Packs x's non-zeros into device scratch a piece at a time (lm_cuda_mask_get), fetches the
// bytes home and merges them into the caller's, keeping the bits of the first and last bytes
// that lie outside the piece: n/8 bytes cross the bus instead of n floats.
static lm_status cuda_mask_get(lm_dev *d, uint8_t *bits, int64_t first, const float *x, int64_t n, lm_err *err)
{
    cuda_ctx *c = ctx_of(d);
    bool work;
    lm_status status = mask_begin(d, first, n, true, &work, err);
    if (status != LM_OK || !work)
        return status;
    for (int64_t off = 0; off < n; off += MASK_PIECE) {
        int64_t cnt = n - off < MASK_PIECE ? n - off : MASK_PIECE, b0 = (first + off) >> 3;
        int sh = (int)((first + off) & 7);
        size_t nbytes = (size_t)((sh + cnt + 7) / 8);
        if ((status = lm_cuda_mask_get((uint8_t *)c->scratch, x + off, cnt, sh, c->stream, err)) != LM_OK ||
            (status = copy_home(c, c->host_scratch, c->scratch, nbytes, err)) != LM_OK)
            return status;
        const uint8_t *h = (const uint8_t *)c->host_scratch;
        for (size_t o = 0; o < nbytes; o++) {
            // the bits of byte o that belong to this piece: bit q is bit sh + j for j in [0, cnt)
            int64_t lo = (int64_t)o * 8 - sh, hi = lo + 8;  // j of bits 0 and 8
            unsigned keep = 0xFFu;
            if (lo < 0)
                keep &= 0xFFu << -lo;
            if (hi > cnt)
                keep &= 0xFFu >> (hi - cnt);
            bits[b0 + (int64_t)o] = (uint8_t)((bits[b0 + (int64_t)o] & ~keep) | (h[o] & keep));
        }
    }
    return LM_OK;
}

// Sends the piece's bytes of the caller's mask to device scratch and zeroes what they clear
// there (lm_cuda_mask_apply): n/8 bytes cross the bus instead of n floats both ways.
static lm_status cuda_mask_apply(lm_dev *d, float *x, const uint8_t *bits, int64_t first, int64_t n, lm_err *err)
{
    cuda_ctx *c = ctx_of(d);
    bool work;
    lm_status status = mask_begin(d, first, n, false, &work, err);
    if (status != LM_OK || !work)
        return status;
    for (int64_t off = 0; off < n; off += MASK_PIECE) {
        int64_t cnt = n - off < MASK_PIECE ? n - off : MASK_PIECE, b0 = (first + off) >> 3;
        int sh = (int)((first + off) & 7);
        size_t nbytes = (size_t)((sh + cnt + 7) / 8);
        if ((status = cuda_upload(d, c->scratch, bits + b0, nbytes, err)) != LM_OK ||
            (status = lm_cuda_mask_apply(x + off, (const uint8_t *)c->scratch, cnt, sh, c->stream, err)) != LM_OK)
            return status;
    }
    return LM_OK;
}

static lm_status cuda_random_drop(lm_dev *d, float *x, int64_t n, uint64_t key, int64_t first,
                                  uint64_t keep_below, lm_err *err)
{
    lm_status s = begin(d, err);
    return s != LM_OK ? s : lm_cuda_random_drop(x, n, key, first, keep_below, ctx_of(d)->stream, err);
}

// Per-block partial sums on the device, added on the host in block order: the CPU backend's
// blocks and order, so the sum is the CPU's to the bit.
static lm_status cuda_l1(lm_dev *d, const float *x, int64_t n, double *out, lm_err *err)
{
    cuda_ctx *c = ctx_of(d);
    lm_status s = begin(d, err);
    if (s != LM_OK)
        return s;
    if (n <= 0) {
        *out = 0.0;
        return LM_OK;
    }
    int64_t nb = (n + LM_CUDA_L1_BLOCK - 1) / LM_CUDA_L1_BLOCK;
    size_t bytes = (size_t)nb * sizeof(double);
    if ((s = scratch_reserve(d, bytes, err)) != LM_OK || (s = host_reserve(c, bytes, err)) != LM_OK ||
        (s = lm_cuda_l1_blocks((double *)c->scratch, x, n, c->stream, err)) != LM_OK ||
        (s = copy_home(c, c->host_scratch, c->scratch, bytes, err)) != LM_OK)
        return s;
    const double *partial = (const double *)c->host_scratch;
    double sum = 0;
    for (int64_t b = 0; b < nb; b++)
        sum += partial[b];
    *out = sum;
    return LM_OK;
}

static lm_status cuda_combine(lm_dev *d, float *out, const float *base, const float *const *w_tau,
                              const float *weights, int k, int64_t n, lm_combine_sign sign, bool normalize,
                              float lambda, lm_err *err)
{
    lm_status s = begin(d, err);
    if (s != LM_OK)
        return s;
    bool elect = sign != LM_COMBINE_SIGN_NONE && sign != LM_COMBINE_SIGN_NONZERO && sign != LM_COMBINE_SIGN_RAMPLUS;
    return lm_cuda_combine(out, base, w_tau, weights, k, n, elect, sign == LM_COMBINE_SIGN_COUNT,
                           sign == LM_COMBINE_SIGN_TAU, sign == LM_COMBINE_SIGN_NONZERO,
                           sign == LM_COMBINE_SIGN_RAMPLUS, normalize, lambda, ctx_of(d)->stream, err);
}

// ==== the forward pass ========================================================================
// The kernels of forward_ops.cu on the backend's stream. The int32 arrays (ids, positions,
// sequence starts, targets) are device memory, as on every device.

static lm_status cuda_gather_rows(lm_dev *d, float *out, const float *table, int64_t table_rows, int64_t cols,
                                  const int32_t *ids, int64_t n, lm_err *err)
{
    lm_status s = begin(d, err);
    return s != LM_OK ? s : lm_cuda_gather_rows(out, table, table_rows, cols, ids, n, ctx_of(d)->stream, err);
}

static lm_status cuda_add_rows(lm_dev *d, float *y, const float *b, int64_t rows, int64_t cols, lm_err *err)
{
    lm_status s = begin(d, err);
    return s != LM_OK ? s : lm_cuda_add_rows(y, b, rows, cols, ctx_of(d)->stream, err);
}

static lm_status cuda_rmsnorm(lm_dev *d, float *out, const float *x, const float *w, int64_t rows, int64_t cols,
                              float eps, lm_err *err)
{
    lm_status s = begin(d, err);
    return s != LM_OK ? s : lm_cuda_rmsnorm(out, x, w, rows, cols, eps, ctx_of(d)->stream, err);
}

static lm_status cuda_rope(lm_dev *d, float *x, int64_t rows, int64_t heads, int64_t head_dim, const int32_t *pos,
                           const float *inv_freq, lm_err *err)
{
    lm_status s = begin(d, err);
    return s != LM_OK ? s : lm_cuda_rope(x, rows, heads, head_dim, pos, inv_freq, ctx_of(d)->stream, err);
}

static lm_status cuda_attention(lm_dev *d, float *out, const float *q, const float *k, const float *v,
                                const int32_t *start, int64_t rows, int64_t heads, int64_t kv_heads, int64_t head_dim,
                                float scale, lm_err *err)
{
    lm_status s = begin(d, err);
    if (s != LM_OK)
        return s;
    return lm_cuda_attention(out, q, k, v, start, rows, heads, kv_heads, head_dim, scale, ctx_of(d)->stream, err);
}

static lm_status cuda_silu_mul(lm_dev *d, float *gate, const float *up, int64_t n, lm_err *err)
{
    lm_status s = begin(d, err);
    return s != LM_OK ? s : lm_cuda_silu_mul(gate, up, n, ctx_of(d)->stream, err);
}

static lm_status cuda_nll_rows(lm_dev *d, float *nll, const float *logits, const int32_t *targets, int64_t rows,
                               int64_t cols, lm_err *err)
{
    lm_status s = begin(d, err);
    return s != LM_OK ? s : lm_cuda_nll_rows(nll, logits, targets, rows, cols, ctx_of(d)->stream, err);
}

// ==== the backend =============================================================================

// Filled by name (C++ before C++20 has no designated initialisers), once, before main.
static lm_dev_i make_iface(void)
{
    lm_dev_i i;
    memset(&i, 0, sizeof i);
    i.name = cuda_name;
    i.mem_info = cuda_mem_info;
    i.alloc = cuda_alloc;
    i.buf_free = cuda_free;
    i.upload = cuda_upload;
    i.download = cuda_download;
    i.sync = cuda_sync;
    i.check = cuda_check;
    i.destroy = cuda_destroy;
    i.to_f32 = cuda_to_f32;
    i.from_f32 = cuda_from_f32;
    i.gemm = cuda_gemm;
    i.syrk = cuda_syrk;
    i.axpby = cuda_axpby;
    i.delta = cuda_delta;
    i.dora_rows = cuda_dora_rows;
    i.hist_abs = cuda_hist_abs;
    i.hist_window = cuda_hist_window;
    i.topk_apply = cuda_topk_apply;
    i.topk_drop = cuda_topk_drop;
    i.topk_apply_by = cuda_topk_apply_by;
    i.importance = cuda_importance;
    i.potrf = cuda_potrf;
    i.mask_get = cuda_mask_get;
    i.mask_apply = cuda_mask_apply;
    i.random_drop = cuda_random_drop;
    i.l1 = cuda_l1;
    i.row_dot = lm_cuda_op_row_dot;
    i.nearswap = lm_cuda_op_nearswap;
    i.row_axpby = lm_cuda_op_row_axpby;
    i.col_dot = lm_cuda_op_col_dot;
    i.col_axpby = lm_cuda_op_col_axpby;
    i.tau_var = lm_cuda_op_tau_var;
    i.della_drop = lm_cuda_op_della_drop;
    i.combine = cuda_combine;
    i.gather_rows = cuda_gather_rows;
    i.add_rows = cuda_add_rows;
    i.rmsnorm = cuda_rmsnorm;
    i.rope = cuda_rope;
    i.attention = cuda_attention;
    i.silu_mul = cuda_silu_mul;
    i.nll_rows = cuda_nll_rows;
    return i;
}

static const lm_dev_i cuda_iface = make_iface();

// ==== opening =================================================================================

// The kernels LM_CUDA_PRELOAD lists (cuda_check.h), filled before main.
static struct {
    const void *kernel;
    const char *name;
} preload[PRELOAD_MAX];
static int n_preload, preload_dropped;

int lm_cuda_preload_add(const void *kernel, const char *name)
{
    if (n_preload == PRELOAD_MAX) {
        preload_dropped++;
        return -1;
    }
    preload[n_preload].kernel = kernel;
    preload[n_preload].name = name;
    return n_preload++;
}

// Loads every listed kernel on the current device. Out of memory is LM_ERR_DEVICE_OOM.
static lm_status load_kernels(cuda_ctx *c, lm_err *err)
{
    if (preload_dropped)
        return lm_err_set(err, LM_ERR_DEVICE, "%s: %d kernels beyond the %d LM_CUDA_PRELOAD can list", c->name,
                          preload_dropped, PRELOAD_MAX);
    for (int i = 0; i < n_preload; i++) {
        cudaFuncAttributes attr;
        cudaError_t e = cudaFuncGetAttributes(&attr, preload[i].kernel);
        if (e != cudaSuccess) {
            cudaGetLastError();
            return lm_err_set(err, e == cudaErrorMemoryAllocation ? LM_ERR_DEVICE_OOM : LM_ERR_DEVICE,
                              "%s: loading kernel %s: %s", c->name, preload[i].name, cudaGetErrorString(e));
        }
    }
    return LM_OK;
}

// "13.0" from the CUDA version number 13000.
static const char *cuda_version(char *buf, size_t size, int v)
{
    snprintf(buf, size, "%d.%d", v / 1000, v % 1000 / 10);
    return buf;
}

extern "C" lm_status lm_cuda_device_count(int *count, lm_err *err)
{
    int n = 0, driver = 0, runtime = 0;
    char dv[16], rv[16];
    *count = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e == cudaSuccess) {
        *count = n;
        return LM_OK;
    }
    cudaGetLastError();
    if (e == cudaErrorNoDevice)
        return LM_OK;
    // cudaDriverGetVersion answers 0 when there is no driver; the runtime's is this build's
    if (cudaDriverGetVersion(&driver) != cudaSuccess)
        driver = 0;
    if (cudaRuntimeGetVersion(&runtime) != cudaSuccess)
        runtime = CUDART_VERSION;
    cudaGetLastError();
    cuda_version(rv, sizeof rv, runtime);
    if (e == cudaErrorInsufficientDriver && driver == 0)
        return lm_err_set(err, LM_ERR_DEVICE, "no NVIDIA driver is installed (the CUDA %s runtime found no libcuda)",
                          rv);
    if (e == cudaErrorInsufficientDriver)
        return lm_err_set(err, LM_ERR_DEVICE, "the NVIDIA driver supports CUDA %s, older than this llmerge's CUDA %s "
                          "runtime: install a driver for CUDA %s or newer%s", cuda_version(dv, sizeof dv, driver), rv,
                          rv, runtime / 1000 == 13 ? " (R580 or newer)" : "");
    return lm_err_set(err, LM_ERR_DEVICE, "cudaGetDeviceCount: %s (driver for CUDA %s, CUDA %s runtime)",
                      cudaGetErrorString(e), driver ? cuda_version(dv, sizeof dv, driver) : "none", rv);
}

extern "C" const char *lm_cuda_device_note(lm_dev *d)
{
    return d && d->iface == &cuda_iface && ctx_of(d)->note[0] ? ctx_of(d)->note : NULL;
}

// What the driver says is free, for measuring what a library's handle takes; 0 when it cannot.
static size_t driver_free(void)
{
    size_t fr = 0, tot = 0;
    if (cudaMemGetInfo(&fr, &tot) != cudaSuccess) {
        cudaGetLastError();
        fr = 0;
    }
    return fr;
}

// Counts what the driver's free memory lost from `before` as taken by a library's handle.
static void count_lib(cuda_ctx *c, size_t before)
{
    size_t after = driver_free();
    if (before > after && after) {
        c->lib_bytes += before - after;
        c->used += before - after;
    }
}

// cuBLAS: its handle on the stream, in plain FP32, with a workspace of ours counted against the
// cap (the recommended size, or the least that fails no GEMM when the cap leaves no more, or
// none when it leaves not even that), and
// one small GEMM run, so that its module and first kernel are loaded now.
static lm_status open_cublas(lm_dev *d, lm_err *err)
{
    cuda_ctx *c = ctx_of(d);
    lm_status status = LM_OK;
    cublasStatus_t bs;
    int major = 0;
    if ((status = lm_cuda_load_cublas(&c->cublas, err)) != LM_OK) {
        err->status = LM_ERR_USAGE;  // a device that cannot be used, as lm_dev_open says them
        return lm_err_prefix(err, "%s", c->name);
    }
    size_t before = driver_free();
    if ((bs = c->cublas->create(&c->blas)) != CUBLAS_STATUS_SUCCESS) {
        c->blas = NULL;
        cudaGetLastError();
        return lm_err_set(err, bs == CUBLAS_STATUS_ALLOC_FAILED ? LM_ERR_DEVICE_OOM : LM_ERR_DEVICE,
                          "%s: cublasCreate: %s", c->name, c->cublas->status_string(bs));
    }
    count_lib(c, before);
    CUDA_TRY(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, c->ordinal));
    c->blas_ws_size = major >= 9 ? (size_t)32 << 20 : (size_t)4 << 20;
    if ((status = dev_malloc(d, c->blas_ws_size, &c->blas_ws, err)) == LM_ERR_DEVICE_OOM) {
        c->blas_ws_size = BLAS_WS_MIN;
        status = dev_malloc(d, c->blas_ws_size, &c->blas_ws, err);
    }
    if (status == LM_ERR_DEVICE_OOM) {
        // the cap leaves nothing: no workspace, rather than cuBLAS's own uncounted one; a GEMM
        // that needs one then fails as out of memory (CUBLAS_STATUS_ALLOC_FAILED) and falls back
        c->blas_ws = NULL;
        c->blas_ws_size = 0;
        status = LM_OK;
    }
    if (status != LM_OK)
        return lm_err_prefix(err, "cuBLAS's workspace");
    // Plain FP32 arithmetic: CUBLAS_DEFAULT_MATH never uses TF32 (only CUBLAS_TF32_TENSOR_OP_MATH
    // or a TF32 compute type would), so the GEMM agrees with the CPU's to float32 rounding. The
    // workspace after the stream: cublasSetStream puts back cuBLAS's own.
    if ((bs = c->cublas->set_stream(c->blas, c->stream)) != CUBLAS_STATUS_SUCCESS ||
        (bs = c->cublas->set_math_mode(c->blas, CUBLAS_DEFAULT_MATH)) != CUBLAS_STATUS_SUCCESS ||
        (bs = c->cublas->set_workspace(c->blas, c->blas_ws, c->blas_ws_size)) != CUBLAS_STATUS_SUCCESS) {
        cudaGetLastError();
        return lm_err_set(err, LM_ERR_DEVICE, "%s: setting up cuBLAS: %s", c->name, c->cublas->status_string(bs));
    }
    // C (8 x 8) = A B in the scratch when there is one (the cap may leave none)
    if (c->scratch) {
        float *m = (float *)c->scratch;
        CUDA_TRY(cudaMemsetAsync(m, 0, 3 * 64 * sizeof(float), c->stream));
        if ((status = lm_cuda_sgemm(c->blas, false, false, 8, 8, 8, 1.0f, m, 8, m + 64, 8, 0.0f, m + 128, 8, c->stream,
                                    err)) != LM_OK ||
            (status = device_state(c, err)) != LM_OK)
            return lm_err_prefix(err, "%s: cuBLAS's first GEMM", c->name);
    }
    return LM_OK;
fail:
    return status;
}

// cuSOLVER: loaded, its handle on the stream and Xpotrf's parameters. A library that cannot be
// loaded is no failure: the device factors on the CPU, and says so in its note.
static lm_status open_cusolver(lm_dev *d, lm_err *err)
{
    cuda_ctx *c = ctx_of(d);
    cusolverStatus_t ss;
    lm_err why;
    if (lm_cuda_load_cusolver(&c->cusolver, &why) != LM_OK) {
        c->cusolver = NULL;
        snprintf(c->note, sizeof c->note, "Cholesky factorisations on the CPU: %s", why.msg);
        return LM_OK;
    }
    size_t before = driver_free();
    if ((ss = c->cusolver->create(&c->solver)) != CUSOLVER_STATUS_SUCCESS) {
        c->solver = NULL;
        cudaGetLastError();
        // A device (or --gpu-mem) too small for the handle still merges: it factors on the CPU.
        if (ss == CUSOLVER_STATUS_ALLOC_FAILED) {
            snprintf(c->note, sizeof c->note, "Cholesky factorisations on the CPU: no room for cuSOLVER's handle");
            return LM_OK;
        }
        return lm_err_set(err, LM_ERR_DEVICE, "%s: cusolverDnCreate: cuSOLVER status %d", c->name, (int)ss);
    }
    count_lib(c, before);
    if ((ss = c->cusolver->set_stream(c->solver, c->stream)) != CUSOLVER_STATUS_SUCCESS ||
        (ss = c->cusolver->create_params(&c->solver_params)) != CUSOLVER_STATUS_SUCCESS) {
        c->solver_params = NULL;
        cudaGetLastError();
        return lm_err_set(err, LM_ERR_DEVICE, "%s: setting up cuSOLVER: cuSOLVER status %d", c->name, (int)ss);
    }
    return LM_OK;
}

// Opens CUDA device `ordinal`: checks that it exists, then creates the stream, the staging
// buffers and their events, a first scratch buffer, loads every kernel, makes the cuBLAS and
// cuSOLVER handles and cuBLAS's workspace. The caller frees the device with lm_dev_destroy; on
// failure nothing is left allocated and *out stays NULL.
extern "C" lm_status lm_dev_cuda_create(lm_dev **out, int ordinal, uint64_t mem_cap, int threads, lm_err *err)
{
    lm_status status = LM_OK;
    lm_dev *d = NULL;
    cuda_ctx *c = NULL;
    int count = 0;

    *out = NULL;
    if (lm_cuda_device_count(&count, err) != LM_OK) {
        err->status = LM_ERR_USAGE;  // as a device that does not exist
        return lm_err_prefix(err, "cuda:%d: CUDA is not usable", ordinal);
    }
    if (ordinal < 0 || ordinal >= count)
        return lm_err_set(err, LM_ERR_USAGE, "cuda:%d: no such device (%d CUDA device%s found)", ordinal, count,
                          count == 1 ? "" : "s");

    d = (lm_dev *)calloc(1, sizeof *d);
    c = (cuda_ctx *)calloc(1, sizeof *c);
    if (!d || !c) {
        free(d);
        free(c);
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    }
    d->iface = &cuda_iface;
    d->ctx = c;
    d->host_memory = false;
    d->threads = threads > 0 ? threads : lm_cpu_count();
    c->ordinal = ordinal;
    c->mem_cap = mem_cap;
    snprintf(c->name, sizeof c->name, "cuda:%d", ordinal);

    CUDA_TRY(cudaSetDevice(ordinal));
    CUDA_TRY(cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking));
    for (int b = 0; b < N_STAGE; b++)
        CUDA_TRY(cudaEventCreateWithFlags(&c->staged[b], cudaEventDisableTiming));
    if ((status = lm_pool_create(&c->pool, d->threads, err)) != LM_OK)
        goto fail;
    CUDA_TRY(cudaMemGetInfo(&c->last_free, &c->last_total));
    if ((status = load_kernels(c, err)) != LM_OK)
        goto fail;
    // Pinned staging buffers, as many as can be had up to N_STAGE. With fewer than two
    // (pinned memory is a limited resource of the host) copies go straight from pageable memory
    // and wait for themselves: slower, still correct.
    for (int b = 0; b < N_STAGE; b++) {
        if (cudaHostAlloc(&c->pinned[b], STAGE_BYTES, cudaHostAllocDefault) != cudaSuccess) {
            cudaGetLastError();
            c->pinned[b] = NULL;
            break;
        }
        c->n_stage = b + 1;
    }
    if (c->n_stage < 2) {
        if (c->pinned[0])
            cudaFreeHost(c->pinned[0]);
        c->pinned[0] = NULL;
        c->n_stage = 0;
    }
    // A first scratch buffer now, while memory is free, so the reductions need not allocate
    // later. When the cap leaves no room for it they try again when they need it; any other
    // failure means the device is not usable.
    {
        lm_err scratch_err;
        lm_status s = scratch_reserve(d, SCRATCH_MIN, &scratch_err);
        if (s != LM_OK && s != LM_ERR_DEVICE_OOM) {
            status = lm_err_set(err, s, "%s", scratch_err.msg);
            goto fail;
        }
    }
    if ((status = open_cublas(d, err)) != LM_OK || (status = open_cusolver(d, err)) != LM_OK ||
        (status = device_state(c, err)) != LM_OK)
        goto fail;
    // A cap that opening the device spent half of or more is said with the device, since the
    // fallbacks it causes would otherwise look like the work's (on an H200 the handles alone
    // take some 164 MiB)
    if (c->mem_cap && 2 * c->used >= c->mem_cap) {
        char used[32], cap[32];
        size_t len = strlen(c->note);
        snprintf(c->note + len, sizeof c->note - len, "%s--gpu-mem %s: %s of it taken when the device opened, by the "
                 "cuBLAS and cuSOLVER handles, cuBLAS's workspace and the scratch", len ? "; " : "",
                 lm_format_bytes(cap, sizeof cap, c->mem_cap), lm_format_bytes(used, sizeof used, c->used));
    }
    *out = d;
    return LM_OK;
fail:
    cuda_destroy(d);
    return status;
}
