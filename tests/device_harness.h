// test_device's harness: random data, a device under test beside the CPU backend, copies to
// and from it, and the comparison of its results with the CPU's (exact where the docs promise
// bit for bit, to float32 rounding elsewhere). Included by test_device.c only: check.h's
// counters are the program's.
#ifndef LM_TEST_DEVICE_HARNESS_H
#define LM_TEST_DEVICE_HARNESS_H

#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "device.h"
#include "dtype.h"
#include "sparsify.h"

static uint64_t state = 7;
static float frand(void)
{
    uint64_t z = lm_mix64(state += 0x9E3779B97F4A7C15ull);
    return (float)((double)(int64_t)z / 9.2e18);
}

static void fill(float *x, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        x[i] = frand();
}

// Whether the n floats of a and b have the same bits.
static bool same_bits(const float *a, const float *b, int64_t n)
{
    return memcmp(a, b, (size_t)n * sizeof *a) == 0;
}

// ==== every operation of a device against the CPU backend =====================================

// Host memory for a test (never NULL, also for 0 bytes); without it the test cannot go on.
static void *hmalloc(size_t bytes)
{
    void *p = malloc(bytes ? bytes : 1);
    if (!p) {
        fprintf(stderr, "test_device: out of host memory\n");
        exit(1);
    }
    return p;
}

// The float32 operations compared value by value, whose exact matches are counted and reported.
// Those docs/devices.md promises bit for bit on every device (st_exact) must match every value
// (a NaN any NaN: which NaN the arithmetic makes is the device's, docs/merging.md); the others
// agree to float32 rounding.
enum { ST_GEMM, ST_LOWRANK, ST_AXPBY, ST_DORA, ST_COMBINE, ST_GATHER, ST_ADD_ROWS, ST_RMSNORM, ST_ROPE,
       ST_ATTENTION, ST_SILU, ST_NLL, ST_COUNT };
static const char *const st_names[ST_COUNT] = {"gemm", "gemm of low rank", "axpby", "dora_rows", "combine",
                                               "gather_rows", "add_rows", "rmsnorm", "rope", "attention", "silu_mul",
                                               "nll_rows"};
static const bool st_exact[ST_COUNT] = {[ST_LOWRANK] = true, [ST_AXPBY] = true, [ST_DORA] = true,
                                        [ST_COMBINE] = true, [ST_GATHER] = true, [ST_ADD_ROWS] = true,
                                        [ST_RMSNORM] = true};

typedef struct harness {
    lm_dev *dev;     // the device under test
    lm_dev *cpu;     // the reference
    bool identical;  // dev must agree with the CPU bit for bit, NaNs too (the CPU and the sim do)
    struct {
        int64_t compared, exact;
        double worst;  // largest error relative to max(1, |CPU result|)
    } st[ST_COUNT];
    lm_err err;
} harness;

// A buffer of `bytes` on the device under test holding a copy of src (nothing when src is
// NULL); NULL, after a failed check, when the device refuses.
static void *put(harness *h, const void *src, size_t bytes)
{
    void *p = NULL;
    lm_status s = lm_dev_alloc(h->dev, bytes, &p, &h->err);
    CHECK_MSG(s == LM_OK, "alloc of %zu bytes on %s: %s", bytes, lm_dev_name(h->dev), h->err.msg);
    if (s == LM_OK && src) {
        s = lm_dev_upload(h->dev, p, src, bytes, &h->err);
        CHECK_MSG(s == LM_OK, "upload of %zu bytes to %s: %s", bytes, lm_dev_name(h->dev), h->err.msg);
        if (s != LM_OK) {
            lm_dev_buf_free(h->dev, p);
            p = NULL;
        }
    }
    return s == LM_OK ? p : NULL;
}

// Copies `bytes` of device memory to the host; false, after a failed check, when that fails.
static bool get(harness *h, void *dst, const void *src, size_t bytes)
{
    lm_status s = lm_dev_download(h->dev, dst, src, bytes, &h->err);
    CHECK_MSG(s == LM_OK, "download of %zu bytes from %s: %s", bytes, lm_dev_name(h->dev), h->err.msg);
    return s == LM_OK;
}

// A device call that must succeed; evaluates to whether it did.
#define DEV_OK(h, call) dev_ok((h), (call), #call)
static bool dev_ok(harness *h, lm_status s, const char *call)
{
    CHECK_MSG(s == LM_OK, "%s on %s -> %s: %s", call, lm_dev_name(h->dev), lm_status_name(s), h->err.msg);
    return s == LM_OK;
}

// Compares got with the CPU's want: for an operation of st_exact every value identical (a NaN
// where the CPU has one), for the others within rel·max(1, |want|) (NaN matching NaN), and on a
// device that must be identical, every bit. Exact matches are counted for the report.
static void check_close(harness *h, int op, const char *what, const float *got, const float *want, int64_t n,
                        double rel)
{
    int64_t bad = 0, exact = 0, same = 0;
    double worst = 0;
    for (int64_t i = 0; i < n; i++) {
        if (lm_f32_bits(got[i]) == lm_f32_bits(want[i])) {
            exact++;
            same++;
            continue;
        }
        same += isnan(got[i]) && isnan(want[i]);
        double e = isnan(got[i]) && isnan(want[i]) ? 0.0 : fabs((double)got[i] - want[i]) / fmax(1.0, fabs(want[i]));
        if (!(e <= rel)) {
            bad++;
            e = isnan(e) ? INFINITY : e;
        }
        worst = fmax(worst, e);
    }
    h->st[op].compared += n;
    h->st[op].exact += exact;
    h->st[op].worst = fmax(h->st[op].worst, worst);
    CHECK_MSG(bad == 0, "%s on %s: %lld of %lld values beyond a relative error of %g (worst %g)", what,
              lm_dev_name(h->dev), (long long)bad, (long long)n, rel, worst);
    if (st_exact[op])
        CHECK_MSG(same == n, "%s on %s: %lld of %lld values differ from the CPU's, which this operation must "
                  "match exactly (worst relative error %g)", what, lm_dev_name(h->dev), (long long)(n - same),
                  (long long)n, worst);
    if (h->identical)
        CHECK_MSG(exact == n, "%s on %s: %lld of %lld values are not bit-identical to the CPU's", what,
                  lm_dev_name(h->dev), (long long)(n - exact), (long long)n);
}

// Random values with exact zeros every 7th element and special values at the start: NaNs of
// both signs with payloads, quiet and signalling, among them.
static void fill_special(float *x, int64_t n)
{
    static const uint32_t nan_bits[] = {0xFFC01234u, 0x7F800001u, 0xFFFFFFFFu};
    const float special[] = {0.0f, -0.0f, INFINITY, -INFINITY, NAN, 1e-40f, 65520.0f, 1e-8f, -3e38f,
                             lm_bits_f32(nan_bits[0]), lm_bits_f32(nan_bits[1]), lm_bits_f32(nan_bits[2])};
    fill(x, n);
    for (int64_t i = 0; i < n; i += 7)
        x[i] = 0.0f;
    for (int64_t i = 0; i < n && i < (int64_t)(sizeof special / sizeof special[0]); i++)
        x[i] = special[i];
}

#endif
