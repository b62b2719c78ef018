// Tests of the device interface on the CPU backend: every operation against a naive loop
// written here (in double where it sums), on sizes that span several work blocks, and each
// result bit-identical between 1 and 3 threads. A huge allocation fails with a status, not an
// abort.
#include "check.h"
#include "device.h"
#include "sparsify.h"

#include <math.h>
#include <stdint.h>

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

static bool same_bits(const float *a, const float *b, int64_t n)
{
    return memcmp(a, b, (size_t)n * sizeof *a) == 0;
}

enum { N = 200003 };  // several 64 Ki blocks and a ragged end

static void test_elementwise(lm_dev *d1, lm_dev *d3)
{
    lm_err err = {0};
    float *x = malloc(N * sizeof *x), *y1 = malloc(N * sizeof *y1), *y3 = malloc(N * sizeof *y3);
    uint16_t *h = malloc(N * sizeof *h);
    fill(x, N);

    // conversions
    CHECK_OK(lm_dev_from_f32(d3, h, LM_DTYPE_BF16, x, N, &err), &err);
    int bad = 0;
    for (int64_t i = 0; i < N; i++)
        bad += h[i] != lm_f32_to_bf16(x[i]);
    CHECK(bad == 0);
    CHECK_OK(lm_dev_to_f32(d3, y3, h, LM_DTYPE_BF16, N, &err), &err);
    bad = 0;
    for (int64_t i = 0; i < N; i++)
        bad += lm_f32_bits(y3[i]) != lm_f32_bits(lm_bf16_to_f32(h[i]));
    CHECK(bad == 0);
    CHECK_FAILS(lm_dev_to_f32(d3, y3, h, LM_DTYPE_I16, N, &err), LM_ERR_UNSUPPORTED, "I16", &err);

    // axpby
    fill(y1, N);
    memcpy(y3, y1, N * sizeof *y1);
    float *want = malloc(N * sizeof *want);
    for (int64_t i = 0; i < N; i++)
        want[i] = 0.5f * y1[i] + -2.0f * x[i];
    CHECK_OK(lm_dev_axpby(d1, y1, 0.5f, x, -2.0f, N, &err), &err);
    CHECK_OK(lm_dev_axpby(d3, y3, 0.5f, x, -2.0f, N, &err), &err);
    CHECK(same_bits(y1, want, N) && same_bits(y3, want, N));

    // random drop: a pure function of (key, first + j)
    memcpy(y1, x, N * sizeof *x);
    memcpy(y3, x, N * sizeof *x);
    uint64_t key = lm_rng_key(3, 1, 99), thr = lm_rng_threshold(0.3);
    CHECK_OK(lm_dev_random_drop(d1, y1, N, key, 1000, thr, &err), &err);
    CHECK_OK(lm_dev_random_drop(d3, y3, N, key, 1000, thr, &err), &err);
    bad = 0;
    for (int64_t i = 0; i < N; i++)
        bad += y1[i] != (lm_rng_keep(key, 1000 + i, thr) ? x[i] : 0.0f);
    CHECK(bad == 0 && same_bits(y1, y3, N));

    // l1: close to the double sum, identical across thread counts
    double l1a = 0, l1b = 0, ref = 0;
    for (int64_t i = 0; i < N; i++)
        ref += fabs((double)x[i]);
    CHECK_OK(lm_dev_l1(d1, x, N, &l1a, &err), &err);
    CHECK_OK(lm_dev_l1(d3, x, N, &l1b, &err), &err);
    CHECK(l1a == l1b);
    CHECK_NEAR(l1a, ref, 1e-9 * ref);

    // histograms and top-k with ties in index order
    for (int64_t i = 0; i < N; i++)
        y1[i] = (float)((int)(lm_mix64((uint64_t)i) % 9) - 4) * 0.5f;  // many ties
    static uint64_t hd[LM_HIST_BINS], hn[LM_HIST_BINS];
    memset(hd, 0, sizeof hd);
    memset(hn, 0, sizeof hn);
    CHECK_OK(lm_dev_hist_abs(d3, hd, y1, N, 0, 0, &err), &err);
    for (int64_t i = 0; i < N; i++)
        hn[lm_abs_bits(y1[i]) >> 16]++;
    CHECK(memcmp(hd, hn, sizeof hd) == 0);
    uint32_t bin = lm_abs_bits(1.5f) >> 16;
    memset(hd, 0, sizeof hd);
    memset(hn, 0, sizeof hn);
    CHECK_OK(lm_dev_hist_abs(d3, hd, y1, N, 1, bin, &err), &err);
    for (int64_t i = 0; i < N; i++)
        if ((lm_abs_bits(y1[i]) >> 16) == bin)
            hn[lm_abs_bits(y1[i]) & 0xFFFF]++;
    CHECK(memcmp(hd, hn, sizeof hd) == 0);
    memcpy(y3, y1, N * sizeof *y1);
    memcpy(want, y1, N * sizeof *y1);
    int64_t allowed = 12345, used1 = 0, used3 = 0, left = allowed;
    uint32_t thr_bits = lm_abs_bits(1.5f);
    for (int64_t i = 0; i < N; i++) {
        uint32_t b = lm_abs_bits(want[i]);
        if (!(b > thr_bits || (b == thr_bits && left-- > 0)))
            want[i] = 0.0f;
    }
    CHECK_OK(lm_dev_topk_apply(d1, y1, N, thr_bits, allowed, &used1, &err), &err);
    CHECK_OK(lm_dev_topk_apply(d3, y3, N, thr_bits, allowed, &used3, &err), &err);
    CHECK(same_bits(y1, want, N) && same_bits(y3, want, N) && used1 == allowed && used3 == allowed);
    free(x);
    free(y1);
    free(y3);
    free(h);
    free(want);
}

static void test_gemm(lm_dev *d)
{
    lm_err err = {0};
    enum { M = 37, K = 5, NN = 53 };
    float a[M * K], b[K * NN], c[M * NN];
    fill(a, M * K);
    fill(b, K * NN);
    for (int ta = 0; ta < 2; ta++) {
        for (int tb = 0; tb < 2; tb++) {
            // Stored shapes: A is [M,K] or [K,M]; B is [K,N] or [N,K].
            CHECK_OK(lm_dev_gemm(d, ta, tb, M, NN, K, 0.5f, a, ta ? M : K, b, tb ? K : NN, 0.0f, c, NN, &err), &err);
            double maxerr = 0;
            for (int i = 0; i < M; i++)
                for (int j = 0; j < NN; j++) {
                    double s = 0;
                    for (int l = 0; l < K; l++)
                        s += (double)(ta ? a[l * M + i] : a[i * K + l]) * (tb ? b[j * K + l] : b[l * NN + j]);
                    maxerr = fmax(maxerr, fabs(0.5 * s - c[i * NN + j]));
                }
            CHECK_MSG(maxerr < 1e-6, "gemm ta=%d tb=%d max error %g", ta, tb, maxerr);
        }
    }
}

static void test_dora(lm_dev *d)
{
    lm_err err = {0};
    enum { R = 7, C = 300 };
    float tau[R * C], base[R * C], mag[R], t0[R * C];
    fill(tau, R * C);
    fill(base, R * C);
    fill(mag, R);
    memcpy(t0, tau, sizeof tau);
    CHECK_OK(lm_dev_dora_rows(d, tau, base, mag, R, C, &err), &err);
    double maxerr = 0;
    for (int r = 0; r < R; r++) {
        double ss = 0;
        for (int c = 0; c < C; c++)
            ss += ((double)base[r * C + c] + t0[r * C + c]) * ((double)base[r * C + c] + t0[r * C + c]);
        for (int c = 0; c < C; c++) {
            double w = (double)base[r * C + c] + t0[r * C + c];
            maxerr = fmax(maxerr, fabs(mag[r] / sqrt(ss) * w - base[r * C + c] - tau[r * C + c]));
        }
    }
    CHECK_MSG(maxerr < 1e-6, "dora max error %g", maxerr);
}

static void test_combine(lm_dev *d1, lm_dev *d3)
{
    lm_err err = {0};
    enum { K = 3 };
    float *t[K], *base = malloc(N * sizeof *base), *o1 = malloc(N * sizeof *o1), *o3 = malloc(N * sizeof *o3);
    for (int i = 0; i < K; i++) {
        t[i] = malloc(N * sizeof *t[i]);
        fill(t[i], N);
        for (int64_t e = i; e < N; e += 5)
            t[i][e] = 0.0f;  // trimmed entries
    }
    fill(base, N);
    const float w[K] = {1.0f, 0.5f, -0.75f};
    const lm_dev_sign signs[] = {LM_DEV_SIGN_NONE, LM_DEV_SIGN_SUM, LM_DEV_SIGN_COUNT};
    for (int si = 0; si < 3; si++) {
        for (int norm = 0; norm < 2; norm++) {
            CHECK_OK(lm_dev_combine(d1, o1, base, (const float *const *)t, w, K, N, signs[si], norm, 0.8f, &err), &err);
            CHECK_OK(lm_dev_combine(d3, o3, base, (const float *const *)t, w, K, N, signs[si], norm, 0.8f, &err), &err);
            CHECK(same_bits(o1, o3, N));
            double maxerr = 0;
            for (int64_t e = 0; e < N; e++) {
                double W[K], delta = 0, div = 0, vote = 0;
                for (int i = 0; i < K; i++) {
                    W[i] = (double)w[i] * t[i][e];
                    vote += signs[si] == LM_DEV_SIGN_COUNT ? (W[i] > 0) - (W[i] < 0) : W[i];
                }
                int s = vote >= 0 ? 1 : -1;
                for (int i = 0; i < K; i++) {
                    int sg = (W[i] > 0) - (W[i] < 0);
                    if (signs[si] == LM_DEV_SIGN_NONE || sg == s) {
                        delta += W[i];
                        div += w[i];
                    }
                }
                if (norm && div != 0)
                    delta /= div;
                double want = base[e] + 0.8 * delta;
                maxerr = fmax(maxerr, fabs(want - o1[e]) / fmax(1.0, fabs(want)));
            }
            CHECK_MSG(maxerr < 1e-5, "combine sign=%d normalize=%d max error %g", si, norm, maxerr);
        }
    }
    for (int i = 0; i < K; i++)
        free(t[i]);
    free(base);
    free(o1);
    free(o3);
}

int main(void)
{
    lm_err err = {0};
    lm_dev *d1 = NULL, *d3 = NULL;
    CHECK_OK(lm_dev_open(&d1, "cpu", 1, &err), &err);
    CHECK_OK(lm_dev_open(&d3, "auto", 3, &err), &err);
    if (!d1 || !d3)
        return check_report("test_device");
    CHECK(strcmp(lm_dev_name(d1), "cpu") == 0 && d3->threads == 3 && d3->host_memory);
    size_t fr = 0, tot = 0;
    lm_dev_mem_info(d1, &fr, &tot);
    CHECK(tot > 0 && fr <= tot);
    void *p = NULL;
    CHECK_FAILS(lm_dev_alloc(d1, SIZE_MAX / 2, &p, &err), LM_ERR_NOMEM, "out of memory", &err);
    CHECK(p == NULL);
    lm_dev *none = NULL;
    CHECK_FAILS(lm_dev_open(&none, "tpu", 1, &err), LM_ERR_USAGE, "tpu", &err);

    test_elementwise(d1, d3);
    test_gemm(d3);
    test_dora(d3);
    test_combine(d1, d3);
    lm_dev_free(d1);
    lm_dev_free(d3);
    return check_report("test_device");
}
