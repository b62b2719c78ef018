// Tests of the CUDA backend's host code (backends/cuda/cuda.cu) on a CUDA device: the emulated
// one, cuda-emu, where the build has it, or the device LLMERGE_TEST_DEVICE names (cuda or
// cuda:N on a GPU machine). What they check: --gpu-mem counts buffers as the driver rounds them
// and counts cuBLAS's workspace; the 64-bit factorisation factors and refuses a matrix that is
// not positive definite; lm_dev_check reports a fault that no call has reported yet, and
// mem_info does not turn a device in error into a full one; an out-of-memory at an allocation
// or a launch is LM_ERR_DEVICE_OOM and leaves the device usable; a released buffer is reused
// without a cudaMalloc and without waiting for the device (counted on cuda-emu), and copies of
// several staging buffers' worth come back as they went. Where the build has no such
// device (lm_dev_open: LM_ERR_USAGE), the test says so and passes; a device LLMERGE_TEST_DEVICE
// names must open.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "cuda_emu.h"
#include "device_registry.h"
#include "sparsify.h"

// --gpu-mem of the tests: below any device's size (the emulation's 256 MiB), and on a GPU above
// what the libraries take when the device opens. On an H200 with CUDA 13, cublasCreate took
// 68 MiB of the driver's free memory and cusolverDnCreate 96 MiB, and cuBLAS's workspace is
// 32 MiB on Hopper: a cap of 48 MiB would be spent before any work.
#define CAP_EMU ((uint64_t)48 << 20)
#define CAP_GPU ((uint64_t)512 << 20)
static uint64_t cap_bytes = CAP_EMU;  // the one of the device under test

// The device under test with --gpu-mem cap_bytes and the fault switch `fail` (cuda-emu's
// LLMERGE_EMU_FAIL, NULL for none); NULL when the build has no such device and none was named.
static lm_dev *open_device(const char *fail)
{
    const char *named = getenv("LLMERGE_TEST_DEVICE");
    bool asked = named && strncmp(named, "cuda", 4) == 0;
    const char *spec = asked ? named : "cuda-emu:256MiB";
    cap_bytes = strncmp(spec, "cuda-emu", 8) == 0 ? CAP_EMU : CAP_GPU;
    lm_dev_opts o = {.threads = 2, .mem_cap = cap_bytes};
    lm_dev *d = NULL;
    lm_err err = {0};
    if (fail)
        setenv("LLMERGE_EMU_FAIL", fail, 1);
    lm_status s = lm_dev_open(&d, spec, &o, NULL, 0, &err);
    unsetenv("LLMERGE_EMU_FAIL");
    if (s == LM_ERR_USAGE && !asked) {
        CHECK_MSG(strstr(err.msg, spec) != NULL, "the refusal does not name %s: %s", spec, err.msg);
        printf("test_cuda_host: skipped: %s\n", err.msg);
        return NULL;
    }
    CHECK_OK(s, &err);
    return d;
}

static size_t used_of(lm_dev *d)
{
    size_t fr = 0, tot = 0;
    lm_dev_mem_info(d, &fr, &tot);
    CHECK(tot == cap_bytes);
    return tot - fr;
}

// --gpu-mem's accounting: a small buffer costs its size rounded to 512 bytes, one above 1 MiB
// whole 2 MiB pages; the scratch and cuBLAS's workspace are counted from the start.
static void test_accounting(lm_dev *d)
{
    lm_err err = {0};
    size_t base = used_of(d);
    CHECK_MSG(base >= ((size_t)1 << 20) + ((size_t)16 << 10),
              "%zu bytes in use after opening: not the 1 MiB scratch and cuBLAS's workspace", base);
    void *small = NULL, *large = NULL;
    CHECK_OK(lm_dev_alloc(d, 1000, &small, &err), &err);
    CHECK_MSG(used_of(d) - base == 1024, "a 1000-byte buffer counted as %zu", used_of(d) - base);
    CHECK_OK(lm_dev_alloc(d, ((size_t)1 << 20) + 1, &large, &err), &err);
    CHECK_MSG(used_of(d) - base == 1024 + ((size_t)2 << 20), "1 MiB + 1 counted as %zu",
              used_of(d) - base - 1024);
    lm_dev_buf_free(d, small);
    lm_dev_buf_free(d, large);
    CHECK(used_of(d) == base);
    // the cap refuses what its rounding would not fit, as out of memory
    size_t fr = 0, tot = 0;
    lm_dev_mem_info(d, &fr, &tot);
    void *p = NULL;
    CHECK_FAILS(lm_dev_alloc(d, fr - ((size_t)1 << 20) + 1, &p, &err), LM_ERR_DEVICE_OOM, "out of memory", &err);
    CHECK_OK(lm_dev_check(d, &err), &err);
}

// The factorisation: a positive definite matrix's diagonal as LAPACK's, one that is not as
// LM_ERR_FORMAT.
static void test_potrf(lm_dev *d)
{
    enum { N = 40 };
    lm_err err = {0};
    double *a = malloc(N * N * sizeof *a), *want = malloc(N * N * sizeof *a), diag[N], want_diag[N];
    double *da = NULL, *dd = NULL;
    if (!a || !want) {
        CHECK(!"out of memory");
        goto done;
    }
    for (int i = 0; i < N; i++)
        for (int j = 0; j < N; j++)
            a[i * N + j] = (i == j ? N : 0) + 1.0 / (1 + i + j);  // symmetric, diagonally dominant
    memcpy(want, a, N * N * sizeof *a);
    int info = 0;
    CHECK(lm_cpu_potrf(want, N, want_diag, &info) == LM_OK);
    CHECK_OK(lm_dev_alloc(d, N * N * sizeof *a, (void **)&da, &err), &err);
    CHECK_OK(lm_dev_alloc(d, N * sizeof *dd, (void **)&dd, &err), &err);
    if (!da || !dd)
        goto done;
    CHECK_OK(lm_dev_upload(d, da, a, N * N * sizeof *a, &err), &err);
    CHECK_OK(lm_dev_potrf(d, da, N, dd, &err), &err);
    CHECK_OK(lm_dev_download(d, diag, dd, sizeof diag, &err), &err);
    for (int i = 0; i < N; i++)
        CHECK_NEAR(diag[i], want_diag[i], 1e-12 * want_diag[i]);
    a[5 * N + 5] = -1.0;  // no longer positive definite
    CHECK_OK(lm_dev_upload(d, da, a, N * N * sizeof *a, &err), &err);
    CHECK_FAILS(lm_dev_potrf(d, da, N, dd, &err), LM_ERR_FORMAT, "not positive definite", &err);
    CHECK_OK(lm_dev_check(d, &err), &err);
done:
    lm_dev_buf_free(d, da);
    lm_dev_buf_free(d, dd);
    free(a);
    free(want);
}

// Runs `n` axpby's on a small buffer; returns the first status other than LM_OK (or LM_OK).
static lm_status some_work(lm_dev *d, int n, lm_err *err)
{
    float *x = NULL;
    float h[256] = {0};
    lm_status s = lm_dev_alloc(d, sizeof h, (void **)&x, err);
    if (s == LM_OK)
        s = lm_dev_upload(d, x, h, sizeof h, err);
    for (int i = 0; s == LM_OK && i < n; i++)
        s = lm_dev_axpby(d, x, 1.0f, x, 1.0f, 256, err);
    lm_dev_buf_free(d, x);
    return s;
}

// cuda-emu's counts since the device opened (all zero on another device).
static lm_cuda_emu_stats emu_stats(lm_dev *d)
{
    lm_cuda_emu_stats st = {0};
    if (strncmp(lm_dev_name(d), "cuda-emu", 8) == 0)
        lm_cuda_emu_get_stats(&st);
    return st;
}

// The cache of released buffers: a released buffer is taken back by the next allocation of its
// rounded size, the same memory, without a cudaMalloc, and neither the release nor the taking
// waits for the device; a tensor's work (buffers taken, uploaded, worked on, downloaded,
// released) waits for the device only for its download. The cache counts as free in mem_info,
// and an allocation it stands in the way of gets its memory: up to the cap, when all is
// released. The counts are cuda-emu's; on another device only what the API shows is checked.
static void test_cache(lm_dev *d)
{
    enum { TENSORS = 6, BUFS = 5, N = 300000 };  // 1.2 MB a buffer: whole pages
    lm_err err = {0};
    size_t base = used_of(d);
    float *host = calloc(N, sizeof *host), *back = malloc(N * sizeof *back);
    CHECK(host && back);
    if (!host || !back)
        goto done;
    void *a = NULL, *b = NULL;
    CHECK_OK(lm_dev_alloc(d, N * sizeof(float), &a, &err), &err);
    lm_dev_buf_free(d, a);
    CHECK_MSG(used_of(d) == base, "a released buffer still counted as %zu bytes in use", used_of(d) - base);
    lm_cuda_emu_stats st0 = emu_stats(d);
    CHECK_OK(lm_dev_alloc(d, N * sizeof(float) - 100, &b, &err), &err);  // the same rounding
    lm_cuda_emu_stats st1 = emu_stats(d);
    CHECK_MSG(b == a, "a released buffer was not taken back by the next allocation of its size");
    CHECK_MSG(st1.allocs == st0.allocs && st1.syncs == st0.syncs,
              "taking a released buffer back made %llu cudaMalloc and %llu waits",
              (unsigned long long)(st1.allocs - st0.allocs), (unsigned long long)(st1.syncs - st0.syncs));
    lm_dev_buf_free(d, b);
    lm_cuda_emu_stats st2 = emu_stats(d);
    CHECK_MSG(st2.syncs == st1.syncs && st2.frees == st1.frees, "a release waited %llu times, freed %llu",
              (unsigned long long)(st2.syncs - st1.syncs), (unsigned long long)(st2.frees - st1.frees));

    // tensors: BUFS buffers each, one download
    for (int t = 0; t < TENSORS; t++) {
        float *buf[BUFS] = {0};
        host[t] = (float)(t + 1);
        bool placed = true;
        for (int i = 0; i < BUFS && placed; i++) {
            CHECK_OK(lm_dev_alloc(d, N * sizeof(float), (void **)&buf[i], &err), &err);
            placed = buf[i] != NULL;
            if (placed)
                CHECK_OK(lm_dev_upload(d, buf[i], host, N * sizeof(float), &err), &err);
        }
        if (!placed) {  // checked above; no work on a buffer that is not there
            for (int i = 0; i < BUFS; i++)
                lm_dev_buf_free(d, buf[i]);
            goto done;
        }
        for (int i = 1; i < BUFS; i++)
            CHECK_OK(lm_dev_axpby(d, buf[0], 1.0f, buf[i], 1.0f, N, &err), &err);
        CHECK_OK(lm_dev_download(d, back, buf[0], N * sizeof(float), &err), &err);
        for (int i = 0; i < BUFS; i++)
            lm_dev_buf_free(d, buf[i]);
    }
    lm_cuda_emu_stats st3 = emu_stats(d);
    CHECK_MSG(back[TENSORS - 1] == (float)(BUFS * TENSORS), "the last tensor's sum %g, not %d", back[TENSORS - 1],
              BUFS * TENSORS);
    if (st3.launches) {
        // the first tensor's buffers are cudaMalloc'ed (one of them the cache's), the rest reused
        CHECK_MSG(st3.allocs - st2.allocs == BUFS - 1, "%d tensors of %d buffers made %llu cudaMalloc", TENSORS, BUFS,
                  (unsigned long long)(st3.allocs - st2.allocs));
        CHECK_MSG(st3.syncs - st2.syncs == 0 && st3.frees == st2.frees,
                  "%d tensors waited for the device %llu times and freed %llu buffers", TENSORS,
                  (unsigned long long)(st3.syncs - st2.syncs), (unsigned long long)(st3.frees - st2.frees));
    }
    CHECK(used_of(d) == base);
    // all the cap leaves, the cache's buffers given back for it
    size_t fr = 0, tot = 0;
    lm_dev_mem_info(d, &fr, &tot);
    void *all = NULL;
    CHECK_OK(lm_dev_alloc(d, fr - ((size_t)2 << 20), &all, &err), &err);
    lm_cuda_emu_stats st4 = emu_stats(d);
    if (st4.launches)
        CHECK_MSG(st4.frees - st3.frees >= BUFS, "%llu cached buffers given back, not all %d",
                  (unsigned long long)(st4.frees - st3.frees), BUFS);
    lm_dev_buf_free(d, all);
    CHECK_OK(lm_dev_check(d, &err), &err);
done:
    free(host);
    free(back);
}

// Fills d until less than `leave` bytes are free, in buffers of at most 512 KiB (counted to 512
// bytes) after one large one; returns how many of fills[max] it took.
static int fill_device(lm_dev *d, size_t leave, void **fills, int max)
{
    lm_err err = {0};
    size_t fr = 0, tot = 0, page = (size_t)2 << 20, chunk = (size_t)512 << 10;
    int k = 0;
    lm_dev_mem_info(d, &fr, &tot);
    if (fr > leave + page && k < max)  // whole 2 MiB pages, leaving at least `leave`
        CHECK_OK(lm_dev_alloc(d, (fr - leave) / page * page, &fills[k++], &err), &err);
    for (lm_dev_mem_info(d, &fr, &tot); fr >= leave && k < max; lm_dev_mem_info(d, &fr, &tot)) {
        size_t want = fr - leave + 512 < chunk ? fr - leave + 512 : chunk;
        if (lm_dev_alloc(d, want, &fills[k], &err) != LM_OK)
            break;
        k++;
    }
    return k;
}

// della's ranks where the device has less room than a slab's sorted keys (8 bytes an entry): the
// rows go in smaller groups (on cuda-emu, counted: two, the last one shorter), with the CPU's
// bits; where not even one row's keys find room, the call is LM_ERR_DEVICE_OOM (its unit falls
// back) and the device stays usable.
static void test_della_room(lm_dev *d)
{
    enum { ROWS = 63, COLS = 8192, N = ROWS * COLS, FILLS = 64 };  // the keys of all rows: 3.94 MiB
    lm_err err = {0};
    lm_dev *cpu = NULL;
    lm_dev_opts o = {.threads = 2};
    float *x = malloc(N * sizeof *x), *want = malloc(N * sizeof *want), *got = malloc(N * sizeof *got);
    void *dx = NULL, *fills[FILLS] = {0};
    int k = 0;
    CHECK(x && want && got);
    CHECK_OK(lm_dev_open(&cpu, "cpu", &o, NULL, 0, &err), &err);
    if (!x || !want || !got || !cpu)
        goto done;
    for (int i = 0; i < N; i++)  // magnitudes repeat within rows: ties broken by index
        x[i] = (float)((int)((uint32_t)i * 2654435761u % 2001u) - 1000) / 64.0f;
    memcpy(want, x, N * sizeof *x);
    uint64_t key = lm_rng_key(5, 1, 0x1234);
    CHECK_OK(lm_dev_della_drop(cpu, want, ROWS, COLS, key, 77, 0.3, 0.7, true, &err), &err);
    CHECK_OK(lm_dev_alloc(d, N * sizeof *x, &dx, &err), &err);
    if (!dx)
        goto done;
    CHECK_OK(lm_dev_upload(d, dx, x, N * sizeof *x, &err), &err);
    // free: under 2 MiB, so with the 1 MiB scratch under 3 MiB, where all rows' keys take 3.94 MiB
    k = fill_device(d, (size_t)2 << 20, fills, FILLS);
    size_t fr = 0, tot = 0;
    lm_dev_mem_info(d, &fr, &tot);
    CHECK_MSG(fr < ((size_t)2 << 20) && fr >= ((size_t)1 << 20), "%zu bytes free after filling, not 1 to 2 MiB", fr);
    CHECK_MSG((size_t)lm_della_sort_bytes(ROWS, COLS) > fr + ((size_t)1 << 20), "the slab's keys would fit");
    lm_cuda_emu_stats st0 = emu_stats(d);
    CHECK_OK(lm_dev_della_drop(d, dx, ROWS, COLS, key, 77, 0.3, 0.7, true, &err), &err);
    lm_cuda_emu_stats st1 = emu_stats(d);
    CHECK_MSG(!st1.launches || st1.launches - st0.launches == 4, "della_drop of 63 rows launched %llu kernels, not"
              " a sort and a ranking for each of two groups (32 rows, 31)",
              (unsigned long long)(st1.launches - st0.launches));
    CHECK_OK(lm_dev_download(d, got, dx, N * sizeof *x, &err), &err);
    CHECK_MSG(memcmp(got, want, N * sizeof *x) == 0, "della_drop in groups of rows: not the cpu's bits");
    size_t fr2 = 0;
    lm_dev_mem_info(d, &fr2, &tot);
    CHECK_MSG(fr2 >= fr, "della_drop left %zu bytes free, %zu before: its keys' scratch kept", fr2, fr);
    // the slab's first 262,144 entries as one row: its keys take 2 MiB, more than the room left
    k += fill_device(d, (size_t)512 << 10, fills + k, FILLS - k);
    CHECK_FAILS(lm_dev_della_drop(d, dx, 1, 262144, key, 77, 0.3, 0.7, true, &err), LM_ERR_DEVICE_OOM,
                "out of memory", &err);
    CHECK_OK(lm_dev_check(d, &err), &err);
    for (int i = 0; i < k; i++)
        lm_dev_buf_free(d, fills[i]);
    k = 0;
    // and with room, the whole slab at once
    CHECK_OK(lm_dev_upload(d, dx, x, N * sizeof *x, &err), &err);
    CHECK_OK(lm_dev_della_drop(d, dx, ROWS, COLS, key, 77, 0.3, 0.7, true, &err), &err);
    CHECK_OK(lm_dev_download(d, got, dx, N * sizeof *x, &err), &err);
    CHECK_MSG(memcmp(got, want, N * sizeof *x) == 0, "della_drop of the whole slab: not the cpu's bits");
done:
    for (int i = 0; i < k; i++)
        lm_dev_buf_free(d, fills[i]);
    lm_dev_buf_free(d, dx);
    if (cpu)
        lm_dev_destroy(cpu);
    free(x);
    free(want);
    free(got);
}

// Copies of several staging buffers' worth, whole and in parts: uploaded and downloaded bytes
// come back as they went, chunk boundaries and the staging buffers' turns included (the host
// threads fill and empty them in slices).
static void test_copies(lm_dev *d)
{
    const size_t n = ((size_t)36 << 20) + 12;  // two whole 16 MiB chunks and part of a third
    lm_err err = {0};
    unsigned char *h = malloc(n), *back = malloc(n);
    void *x = NULL;
    CHECK(h && back);
    if (!h || !back)
        goto done;
    for (size_t i = 0; i < n; i++)
        h[i] = (unsigned char)(i * 2654435761u >> 13);
    CHECK_OK(lm_dev_alloc(d, n, &x, &err), &err);
    if (!x)
        goto done;
    for (int round = 0; round < 3; round++) {  // each starts at another staging buffer
        size_t skip = (size_t)round * ((size_t)5 << 20) + 7;
        memset(back, 0, n);
        CHECK_OK(lm_dev_upload(d, x, h, n, &err), &err);
        CHECK_OK(lm_dev_upload(d, (char *)x + skip, h, n - skip, &err), &err);
        CHECK_OK(lm_dev_download(d, back, x, n, &err), &err);
        CHECK_MSG(memcmp(back, h, skip) == 0 && memcmp(back + skip, h, n - skip) == 0,
                  "round %d: %zu bytes uploaded at %zu did not come back", round, n - skip, skip);
        CHECK_OK(lm_dev_download(d, back, (char *)x + skip, n - skip, &err), &err);
        CHECK_MSG(memcmp(back, h, n - skip) == 0, "round %d: a download from %zu differs", round, skip);
    }
    lm_dev_buf_free(d, x);
    CHECK_OK(lm_dev_check(d, &err), &err);
done:
    free(h);
    free(back);
}

// The injected faults: an out-of-memory at an allocation or a launch is LM_ERR_DEVICE_OOM and
// the device goes on; a sticky fault is reported, by the work or at the latest by lm_dev_check,
// as LM_ERR_DEVICE, and mem_info keeps saying what it said before.
static void test_faults(void)
{
    lm_err err = {0};
    // The allocations the device makes when it opens (cuBLAS's workspace) come first, and one
    // refused there only makes it open with less: the work's first allocation is the least N
    // of alloc-oom:N that refuses it.
    lm_dev *d = NULL;
    bool refused = false, skipped = false;
    for (int n = 1; n <= 8 && !refused && !skipped; n++) {
        char fail[32];
        snprintf(fail, sizeof fail, "alloc-oom:%d", n);
        if (!(d = open_device(fail))) {
            skipped = true;
            break;
        }
        void *p = NULL;
        lm_status s = lm_dev_alloc(d, 4096, &p, &err);
        if (s == LM_OK) {
            lm_dev_buf_free(d, p);
        } else {
            refused = true;
            CHECK_MSG(s == LM_ERR_DEVICE_OOM && strstr(err.msg, "out of memory"),
                      "alloc-oom:%d: the work's first allocation was refused as %s: %s", n, lm_status_name(s), err.msg);
            CHECK_OK(some_work(d, 4, &err), &err);
            CHECK_OK(lm_dev_check(d, &err), &err);
        }
        lm_dev_destroy(d);
    }
    CHECK_MSG(refused || skipped, "no alloc-oom:N up to 8 refused an allocation after the device opened");
    // launches at opening (none but cuBLAS's first GEMM, which is no kernel of ours) come first:
    // the 3rd launch is one of some_work's
    d = open_device("launch-oom:3");
    if (d) {
        CHECK_FAILS(some_work(d, 8, &err), LM_ERR_DEVICE_OOM, "out of memory", &err);
        CHECK_OK(some_work(d, 8, &err), &err);
        CHECK_OK(lm_dev_check(d, &err), &err);
        lm_dev_destroy(d);
    }
    d = open_device("launch-fault:3");
    if (d) {
        size_t fr0 = 0, tot0 = 0, fr = 0, tot = 0;
        lm_dev_mem_info(d, &fr0, &tot0);
        lm_status s = some_work(d, 8, &err);
        CHECK_MSG(s == LM_OK || s == LM_ERR_DEVICE, "a fault was reported as %s: %s", lm_status_name(s), err.msg);
        if (s == LM_OK) {
            // nothing waited on the stream since: lm_dev_check does
            lm_dev_mem_info(d, &fr, &tot);
            CHECK_MSG(fr > 0 && tot == tot0, "a device in error says %zu of %zu bytes free", fr, tot);
            CHECK_FAILS(lm_dev_check(d, &err), LM_ERR_DEVICE, "cuda", &err);
        }
        // sticky: everything after fails as a device error, never as out of memory
        CHECK_FAILS(some_work(d, 1, &err), LM_ERR_DEVICE, "", &err);
        CHECK_FAILS(lm_dev_check(d, &err), LM_ERR_DEVICE, "", &err);
        lm_dev_destroy(d);
    }
}

int main(void)
{
    lm_dev *d = open_device(NULL);
    if (d) {
        // what the cap counts once the device is open: the scratch, cuBLAS's workspace and what
        // the driver's free memory lost while the cuBLAS and cuSOLVER handles were made
        printf("test_cuda_host: %s with --gpu-mem %llu MiB: %.2f MiB in use after opening\n", lm_dev_name(d),
               (unsigned long long)(cap_bytes >> 20), used_of(d) / 1048576.0);
        test_accounting(d);
        test_potrf(d);
        test_cache(d);
        test_copies(d);
        test_della_room(d);
        // the faults are cuda-emu's switches (LLMERGE_EMU_FAIL): a GPU cannot be made to fail
        bool emulated = strncmp(lm_dev_name(d), "cuda-emu", 8) == 0;
        lm_dev_destroy(d);
        if (emulated)
            test_faults();
        else
            printf("test_cuda_host: the injected faults are cuda-emu's: not run on a GPU\n");
    }
    return check_report("test_cuda_host");
}
