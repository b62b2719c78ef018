// Tests of the simulated accelerator (backends/sim): its budget and what it says when it is
// exceeded, its name and how --device sim:SIZE opens it, its fault switch, its refusal of
// memory that is not its own (host pointers, freed buffers, buffers too short), and that its
// interface leaves no entry empty but those that need host memory. test_device runs every
// operation on it against the CPU backend.
#include "check.h"
#include "device.h"
#include "device_impl.h"  // the sim's vtable, read entry by entry
#include "device_registry.h"
#include "merge_desc.h"
#include "sparsify.h"

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

// lm_dev_combine's rule: election, normalisation and lambda.
static lm_combine_how how_of(lm_combine_sign sign, bool normalize, float lambda)
{
    return (lm_combine_how){.sign = sign, .normalize = normalize, .lambda = lambda};
}

static void test_sim_budget(void)
{
    lm_err err = {0};
    lm_dev *d = NULL;
    CHECK_OK(lm_dev_sim_create(&d, 1 << 20, NULL, 1, &err), &err);
    if (!d)
        return;
    CHECK(strcmp(lm_dev_name(d), "sim:1MiB") == 0 && !lm_dev_host_memory(d) && lm_dev_threads(d) == 1);
    void *a = NULL, *b = NULL, *c = NULL;
    size_t fr = 0, tot = 0;
    CHECK_OK(lm_dev_alloc(d, 600 << 10, &a, &err), &err);
    lm_dev_mem_info(d, &fr, &tot);
    CHECK(fr == (424 << 10) && tot == (1 << 20));
    b = (void *)&err;  // must be cleared by the failed allocation
    CHECK_FAILS(lm_dev_alloc(d, 500 << 10, &b, &err), LM_ERR_DEVICE_OOM,
                "sim:1MiB: out of memory allocating 500.00 KiB (600.00 KiB of 1.00 MiB in use)", &err);
    CHECK(b == NULL);
    CHECK_OK(lm_dev_alloc(d, 424 << 10, &b, &err), &err);  // exactly what is left
    lm_dev_mem_info(d, &fr, &tot);
    CHECK(fr == 0 && tot == (1 << 20));
    CHECK_FAILS(lm_dev_alloc(d, 1, &c, &err), LM_ERR_DEVICE_OOM, "out of memory allocating 1 B", &err);
    lm_dev_buf_free(d, a);  // freeing gives the bytes back
    lm_dev_mem_info(d, &fr, &tot);
    CHECK(fr == (600 << 10) && tot == (1 << 20));
    CHECK_OK(lm_dev_alloc(d, 500 << 10, &c, &err), &err);
    CHECK_FAILS(lm_dev_alloc(d, SIZE_MAX, &a, &err), LM_ERR_DEVICE_OOM, "out of memory", &err);
    CHECK(a == NULL);
    lm_dev_buf_free(d, b);
    lm_dev_buf_free(d, c);
    lm_dev_mem_info(d, &fr, &tot);
    CHECK(fr == tot && tot == (1 << 20));
    lm_dev_destroy(d);
}

static void test_sim_open(void)
{
    lm_err err = {0};
    lm_dev *d = NULL;
    lm_dev_opts o = {.threads = 2};
    char why[128];
    size_t fr = 0, tot = 0;
    CHECK_OK(lm_dev_open(&d, "sim:64KiB", &o, why, sizeof why, &err), &err);
    if (d) {
        lm_dev_mem_info(d, &fr, &tot);
        CHECK(tot == 65536 && fr == tot && !lm_dev_host_memory(d) && lm_dev_threads(d) == 2);
        CHECK(strcmp(lm_dev_name(d), "sim:64KiB") == 0 && strcmp(why, "sim:64KiB") == 0);
        lm_dev_destroy(d);
    }
    d = NULL;
    CHECK_OK(lm_dev_open(&d, "sim:1.5GiB", &o, NULL, 0, &err), &err);
    CHECK(d && strcmp(lm_dev_name(d), "sim:1536MiB") == 0);
    lm_dev_destroy(d);
    d = NULL;
    CHECK_OK(lm_dev_open(&d, "sim:1000", &o, NULL, 0, &err), &err);
    CHECK(d && strcmp(lm_dev_name(d), "sim:1000") == 0);
    lm_dev_destroy(d);
    d = NULL;
    CHECK_FAILS(lm_dev_open(&d, "sim:0", &o, NULL, 0, &err), LM_ERR_USAGE, "sim:0", &err);
    CHECK(d == NULL);
    CHECK_FAILS(lm_dev_open(&d, "sim:abc", &o, NULL, 0, &err), LM_ERR_USAGE, "sim:abc", &err);
    CHECK(d == NULL);
    CHECK_FAILS(lm_dev_sim_create(&d, 0, NULL, 1, &err), LM_ERR_USAGE, "sim", &err);
    CHECK(d == NULL);

    // --gpu-mem caps the budget
    o.mem_cap = 1 << 20;
    CHECK_OK(lm_dev_open(&d, "sim:1GiB", &o, NULL, 0, &err), &err);
    if (d) {
        lm_dev_mem_info(d, &fr, &tot);
        CHECK(tot == (1 << 20) && strcmp(lm_dev_name(d), "sim:1MiB") == 0);
        void *p = NULL;
        CHECK_FAILS(lm_dev_alloc(d, (1 << 20) + 1, &p, &err), LM_ERR_DEVICE_OOM, "sim:1MiB: out of memory", &err);
        lm_dev_destroy(d);
    }
}

static void test_sim_faults(void)
{
    lm_err err = {0};
    lm_dev *d = NULL;
    lm_dev_opts o = {.threads = 1, .sim_fail = "alloc:2"};
    void *p1 = NULL, *p2 = NULL, *p3 = NULL;
    CHECK_OK(lm_dev_open(&d, "sim:1MiB", &o, NULL, 0, &err), &err);
    if (d) {
        CHECK_OK(lm_dev_alloc(d, 64, &p1, &err), &err);
        CHECK_FAILS(lm_dev_alloc(d, 64, &p2, &err), LM_ERR_DEVICE,
                    "sim: injected failure of allocation 2 (LLMERGE_SIM_FAIL=alloc:2)", &err);
        CHECK(p2 == NULL);
        CHECK_OK(lm_dev_alloc(d, 64, &p3, &err), &err);  // only the second
        lm_dev_buf_free(d, p1);
        lm_dev_buf_free(d, p3);
        lm_dev_destroy(d);
    }

    // operations count copies and syncs too: upload, l1, then the third fails
    o.sim_fail = "launch:3";
    d = NULL;
    CHECK_OK(lm_dev_open(&d, "sim:1MiB", &o, NULL, 0, &err), &err);
    if (d) {
        float host[4] = {1, -2, 3, -4}, *x = NULL;
        double l1 = 0;
        CHECK_OK(lm_dev_alloc(d, sizeof host, (void **)&x, &err), &err);
        CHECK_OK(lm_dev_upload(d, x, host, sizeof host, &err), &err);
        CHECK_OK(lm_dev_l1(d, x, 4, &l1, &err), &err);
        CHECK(l1 == 10);
        CHECK_FAILS(lm_dev_sync(d, &err), LM_ERR_DEVICE, "sim: injected failure of operation 3", &err);
        CHECK(strstr(err.msg, "LLMERGE_SIM_FAIL=launch:3") != NULL);
        CHECK_OK(lm_dev_download(d, host, x, sizeof host, &err), &err);
        lm_dev_buf_free(d, x);
        lm_dev_destroy(d);
    }

    const char *bad[] = {"alloc", "launch:0", "boom:1", "alloc:", "alloc:2x", "launch:-1",
                         "alloc:99999999999999999999"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        d = NULL;
        o.sim_fail = bad[i];
        char want[64];
        snprintf(want, sizeof want, "LLMERGE_SIM_FAIL=%s", bad[i]);
        CHECK_FAILS(lm_dev_open(&d, "sim:1MiB", &o, NULL, 0, &err), LM_ERR_USAGE, want, &err);
        CHECK(d == NULL);
        lm_dev_destroy(d);
    }
    o.sim_fail = "";
    CHECK_OK(lm_dev_open(&d, "sim:1MiB", &o, NULL, 0, &err), &err);
    lm_dev_destroy(d);
}

// Memory that is not a live sim buffer, or not all of it, is refused before anything is touched.
static void test_sim_foreign(void)
{
    lm_err err = {0};
    lm_dev *d = NULL;
    CHECK_OK(lm_dev_sim_create(&d, 1 << 20, NULL, 1, &err), &err);
    if (!d)
        return;
    float host[16], copy[16], *x = NULL, *y = NULL;
    for (int i = 0; i < 16; i++)
        host[i] = copy[i] = (float)i - 7.5f;
    CHECK_OK(lm_dev_alloc(d, sizeof host, (void **)&x, &err), &err);
    CHECK_OK(lm_dev_alloc(d, sizeof host, (void **)&y, &err), &err);
    if (!x || !y) {
        lm_dev_destroy(d);
        return;
    }
    CHECK_OK(lm_dev_upload(d, x, host, sizeof host, &err), &err);
    CHECK_OK(lm_dev_upload(d, y, host, sizeof host, &err), &err);
    const char *nots = "was given memory that is not a sim buffer";
    double l1 = -1;
    CHECK_FAILS(lm_dev_l1(d, host, 16, &l1, &err), LM_ERR_DEVICE,
                "sim: l1 was given memory that is not a sim buffer (x:", &err);
    CHECK(l1 == -1);
    CHECK_FAILS(lm_dev_axpby(d, host, 2.0f, x, 1.0f, 16, &err), LM_ERR_DEVICE, "sim: axpby", &err);
    CHECK_FAILS(lm_dev_axpby(d, x, 2.0f, host, 1.0f, 16, &err), LM_ERR_DEVICE, "(x:", &err);
    CHECK_FAILS(lm_dev_upload(d, host, x, sizeof host, &err), LM_ERR_DEVICE, "sim: upload", &err);
    CHECK_FAILS(lm_dev_download(d, host, copy, sizeof host, &err), LM_ERR_DEVICE, "sim: download", &err);
    CHECK(memcmp(host, copy, sizeof host) == 0);
    CHECK_FAILS(lm_dev_to_f32(d, x, host, LM_DTYPE_F16, 16, &err), LM_ERR_DEVICE, nots, &err);
    CHECK_FAILS(lm_dev_from_f32(d, host, LM_DTYPE_BF16, x, 16, &err), LM_ERR_DEVICE, nots, &err);
    CHECK_FAILS(lm_dev_random_drop(d, host, 16, 1, 0, 0, &err), LM_ERR_DEVICE, nots, &err);
    int64_t used = -1;
    CHECK_FAILS(lm_dev_topk_apply(d, host, 16, 0, 3, &used, &err), LM_ERR_DEVICE, nots, &err);
    CHECK(used == -1 && memcmp(host, copy, sizeof host) == 0);
    static uint64_t hist[LM_HIST_BINS];
    CHECK_FAILS(lm_dev_hist_abs(d, hist, host, 16, 0, 0, &err), LM_ERR_DEVICE, nots, &err);
    CHECK_OK(lm_dev_hist_abs(d, hist, x, 16, 0, 0, &err), &err);  // the histogram itself is host memory
    CHECK_FAILS(lm_dev_dora_rows(d, x, y, host, 4, 4, &err), LM_ERR_DEVICE, "(magnitude:", &err);

    // an extent running past the end of a buffer, also from inside it
    CHECK_OK(lm_dev_l1(d, x + 8, 8, &l1, &err), &err);
    CHECK(l1 == 32);
    CHECK_FAILS(lm_dev_l1(d, x, 17, &l1, &err), LM_ERR_DEVICE,
                "68 bytes at offset 0 run past the end of a buffer of 64", &err);
    CHECK_FAILS(lm_dev_l1(d, x + 8, 9, &l1, &err), LM_ERR_DEVICE, "run past the end", &err);
    CHECK_FAILS(lm_dev_l1(d, x, -1, &l1, &err), LM_ERR_DEVICE, "invalid count -1", &err);
    CHECK_FAILS(lm_dev_upload(d, x + 1, host, sizeof host, &err), LM_ERR_DEVICE, "run past the end", &err);
    CHECK_FAILS(lm_dev_dora_rows(d, x, y, x, 4, 5, &err), LM_ERR_DEVICE, "(tau:", &err);

    // GEMM extents follow the shapes, strides and transpositions: x and y as 4 × 4 fit,
    // 4 × 4 with a row stride of 5 does not, nor does A transposed as [k,m] = [5,4]
    CHECK_OK(lm_dev_gemm(d, false, true, 4, 4, 4, 1.0f, x, 4, x, 4, 0.0f, y, 4, &err), &err);
    CHECK_FAILS(lm_dev_gemm(d, false, false, 4, 4, 4, 1.0f, x, 4, x, 4, 0.0f, y, 5, &err), LM_ERR_DEVICE, "(c:",
                &err);
    CHECK_FAILS(lm_dev_gemm(d, true, false, 4, 3, 5, 1.0f, x, 4, y, 3, 0.0f, y, 3, &err), LM_ERR_DEVICE, "(a:",
                &err);
    CHECK_FAILS(lm_dev_gemm(d, false, false, 4, 4, 4, 1.0f, x, 4, host, 4, 0.0f, y, 4, &err), LM_ERR_DEVICE, "(b:",
                &err);
    CHECK_FAILS(lm_dev_gemm(d, false, false, 4, 4, 4, 1.0f, x, 3, x, 4, 0.0f, y, 4, &err), LM_ERR_DEVICE,
                "invalid shape", &err);
    // syrk: A [k,n] and C [n,n] checked the same way; A is not read when k is 0
    CHECK_OK(lm_dev_syrk(d, 4, 4, 1.0f, x, 4, 1.0f, true, y, 4, &err), &err);
    CHECK_OK(lm_dev_syrk(d, 4, 0, 0.0f, NULL, 4, 1.0f, true, y, 4, &err), &err);
    CHECK_FAILS(lm_dev_syrk(d, 4, 5, 1.0f, x, 4, 1.0f, false, y, 4, &err), LM_ERR_DEVICE, "(a:", &err);
    CHECK_FAILS(lm_dev_syrk(d, 4, 4, 1.0f, x, 4, 1.0f, false, host, 4, &err), LM_ERR_DEVICE, "(c:", &err);

    // and device memory where the host's belongs is refused as well
    uint64_t *dhist = NULL;
    CHECK_OK(lm_dev_alloc(d, sizeof hist, (void **)&dhist, &err), &err);
    if (dhist)
        CHECK_FAILS(lm_dev_hist_abs(d, dhist, x, 16, 0, 0, &err), LM_ERR_DEVICE,
                    "sim: hist_abs was given a sim buffer where host memory belongs (hist:", &err);
    lm_dev_buf_free(d, dhist);
    CHECK_FAILS(lm_dev_l1(d, x, 16, (double *)(void *)(y + 2), &err), LM_ERR_DEVICE, "(out:", &err);
    CHECK_FAILS(lm_dev_topk_apply(d, x, 16, 0, 3, (int64_t *)(void *)y, &err), LM_ERR_DEVICE, "(ties_used:", &err);
    CHECK_FAILS(lm_dev_upload(d, x, y, sizeof host, &err), LM_ERR_DEVICE, "(src:", &err);
    CHECK_FAILS(lm_dev_download(d, y, x, sizeof host, &err), LM_ERR_DEVICE, "(dst:", &err);

    // combine checks out, base and every task vector; the arrays of pointers and weights are
    // the host's
    const float w[2] = {1, 1};
    const float *taus[2] = {x, y}, *bad_taus[2] = {x, host};
    lm_combine_how sum = how_of(LM_COMBINE_SIGN_SUM, true, 1.0f), plain = how_of(LM_COMBINE_SIGN_NONE, false, 1.0f);
    CHECK_OK(lm_dev_combine(d, y, x, taus, w, 2, 16, sum, &err), &err);
    CHECK_FAILS(lm_dev_combine(d, y, x, bad_taus, w, 2, 16, sum, &err), LM_ERR_DEVICE, "(w_tau[1]:", &err);
    CHECK_FAILS(lm_dev_combine(d, host, x, taus, w, 2, 16, sum, &err), LM_ERR_DEVICE, "(out:", &err);
    CHECK_FAILS(lm_dev_combine(d, y, host, taus, w, 2, 16, plain, &err), LM_ERR_DEVICE, "(base:", &err);
    CHECK_FAILS(lm_dev_combine(d, y, x, taus, x, 2, 16, plain, &err), LM_ERR_DEVICE, "(weights:", &err);
    CHECK(memcmp(host, copy, sizeof host) == 0);

    // a released buffer is no longer the device's; releasing a host pointer fails the next call
    lm_dev_buf_free(d, y);
    CHECK_FAILS(lm_dev_l1(d, y, 16, &l1, &err), LM_ERR_DEVICE, nots, &err);
    y = NULL;
    lm_dev_buf_free(d, host);
    CHECK_FAILS(lm_dev_l1(d, x, 16, &l1, &err), LM_ERR_DEVICE, "an earlier release was given", &err);
    CHECK_OK(lm_dev_l1(d, x, 16, &l1, &err), &err);
    CHECK(l1 == 64);
    lm_dev_buf_free(d, x);
    lm_dev_destroy(d);
}

// Destroying the device frees what callers left (AddressSanitizer's leak check would report
// it), and every entry of its interface is filled in, so an operation added to lm_dev_i
// without a sim version fails here.
static void test_sim_teardown(void)
{
    lm_err err = {0};
    lm_dev *d = NULL;
    CHECK_OK(lm_dev_sim_create(&d, 1 << 20, NULL, 1, &err), &err);
    if (!d)
        return;
    void *p[20] = {0};
    for (int i = 0; i < 20; i++)
        CHECK_OK(lm_dev_alloc(d, 1000, &p[i], &err), &err);
    size_t fr = 0, tot = 0;
    lm_dev_mem_info(d, &fr, &tot);
    CHECK(tot - fr == 20000);
    // lm_dev_i holds function pointers only: read each as a generic one. The fused dense
    // operations and the counting conversions are for devices whose memory is the host's, which
    // the sim's is not.
    typedef void (*fn)(void);
    size_t null = 0;
    for (size_t i = 0; i < sizeof *d->iface / sizeof(fn); i++) {
        fn f;
        memcpy(&f, (const char *)d->iface + i * sizeof f, sizeof f);
        size_t at = i * sizeof f;
        null += f == NULL && at != offsetof(lm_dev_i, dense_hist) && at != offsetof(lm_dev_i, dense_merge) &&
                at != offsetof(lm_dev_i, dense_gram) && at != offsetof(lm_dev_i, to_f32_count) && at != offsetof(lm_dev_i, delta_count) &&
                at != offsetof(lm_dev_i, from_f32_count);
    }
    CHECK_MSG(null == 0, "%zu entries of the sim's lm_dev_i are NULL", null);
    CHECK(!d->iface->dense_hist && !d->iface->dense_merge && !d->iface->dense_gram &&
          !lm_dev_supports(d, LM_OP_DENSE));
    CHECK(!lm_dev_supports(d, LM_OP_COUNTS));
    lm_nonfinite nf = {0, 0};
    float x = 0.0f;
    CHECK_FAILS(lm_dev_to_f32_count(d, p[0], &x, LM_DTYPE_F32, 1, &nf, &err), LM_ERR_UNSUPPORTED,
                "no counting conversions", &err);
    lm_dev_destroy(d);
}

int main(void)
{
    test_sim_budget();
    test_sim_open();
    test_sim_faults();
    test_sim_foreign();
    test_sim_teardown();
    return check_report("test_sim");
}
