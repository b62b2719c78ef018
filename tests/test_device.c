// Tests of the device interface. On the CPU backend: every operation against a naive loop
// written here (in double where it sums), on sizes that span several work blocks, and each
// result bit-identical between 1 and 3 threads; a huge allocation fails with a status, not an
// abort. Then test_against_cpu, which runs every operation of a device, the forward pass's
// included, through the public API (alloc, upload, operation, download) and compares it with
// the CPU backend: on sim:1GiB always, and on the device named by LLMERGE_TEST_DEVICE when it
// is set (cuda on a GPU machine): exactly for the operations documented bit for bit, to float32
// rounding for the others; a device one ulp off in a low-rank GEMM shows that the comparison is
// that strict. Last, the capability question and the CPU companion. What is particular to the
// sim device is test_sim's.
#include "check.h"
#include "dot_ref.h"
#include "device.h"
#include "device_forward.h"  // the harness (device_harness.h), and the forward pass's operations on it
#include "device_registry.h"
#include "merge_desc.h"
#include "device_impl.h"  // the backends' vtables, and devices built by hand
#include "sparsify.h"

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

// lm_dev_combine's rule: election, normalisation and lambda.
static lm_combine_how how_of(lm_combine_sign sign, bool normalize, float lambda)
{
    return (lm_combine_how){.sign = sign, .normalize = normalize, .lambda = lambda};
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

    // the counting conversions: the same values, and the NaN and Inf among those read (to_f32,
    // delta's src) or written (from_f32), on 1 and 3 threads
    {
        float *z = malloc(N * sizeof *z), *t1 = malloc(N * sizeof *t1), *t3 = malloc(N * sizeof *t3);
        uint16_t *h1 = malloc(N * sizeof *h1), *h3 = malloc(N * sizeof *h3);
        uint64_t nan = 0, inf = 0;
        memcpy(z, x, N * sizeof *x);
        for (int64_t i = 0; i < N; i += 997)
            z[i] = i % 3 == 0 ? NAN : i % 3 == 1 ? -INFINITY : 1e6f;  // 1e6 is Inf in F16 only
        for (int64_t i = 0; i < N; i++) {
            float r = lm_f16_to_f32(lm_f32_to_f16(z[i]));
            nan += isnan(r) != 0;
            inf += isinf(r) != 0;
        }
        CHECK(lm_dev_supports(d1, LM_OP_COUNTS) && lm_dev_supports(d3, LM_OP_COUNTS));
        lm_nonfinite c1 = {0, 0}, c3 = {0, 0};
        CHECK_OK(lm_dev_from_f32_count(d1, h1, LM_DTYPE_F16, z, N, &c1, &err), &err);
        CHECK_OK(lm_dev_from_f32_count(d3, h3, LM_DTYPE_F16, z, N, &c3, &err), &err);
        CHECK_OK(lm_dev_from_f32(d1, h, LM_DTYPE_F16, z, N, &err), &err);
        CHECK(memcmp(h1, h, N * sizeof *h) == 0 && memcmp(h3, h, N * sizeof *h) == 0);
        CHECK_MSG(c1.nan == nan && c1.inf == inf && c3.nan == nan && c3.inf == inf && inf > nan / 2,
                  "from_f32_count: %llu NaN, %llu Inf (3 threads %llu, %llu); there are %llu, %llu",
                  (unsigned long long)c1.nan, (unsigned long long)c1.inf, (unsigned long long)c3.nan,
                  (unsigned long long)c3.inf, (unsigned long long)nan, (unsigned long long)inf);
        c1 = c3 = (lm_nonfinite){0, 0};
        CHECK_OK(lm_dev_to_f32_count(d1, t1, h, LM_DTYPE_F16, N, &c1, &err), &err);
        CHECK_OK(lm_dev_to_f32_count(d3, t3, h, LM_DTYPE_F16, N, &c3, &err), &err);
        CHECK_OK(lm_dev_to_f32(d1, y1, h, LM_DTYPE_F16, N, &err), &err);
        CHECK(same_bits(t1, y1, N) && same_bits(t3, y1, N));
        CHECK(c1.nan == nan && c1.inf == inf && c3.nan == nan && c3.inf == inf);
        c1 = c3 = (lm_nonfinite){0, 0};
        CHECK_OK(lm_dev_delta_count(d1, t1, h, LM_DTYPE_F16, x, N, &c1, &err), &err);
        CHECK_OK(lm_dev_delta_count(d3, t3, h, LM_DTYPE_F16, x, N, &c3, &err), &err);
        CHECK_OK(lm_dev_delta(d1, y1, h, LM_DTYPE_F16, x, N, &err), &err);
        CHECK(same_bits(t1, y1, N) && same_bits(t3, y1, N));
        CHECK(c1.nan == nan && c1.inf == inf && c3.nan == nan && c3.inf == inf);
        CHECK_FAILS(lm_dev_to_f32_count(d3, t3, h, LM_DTYPE_I16, N, &c3, &err), LM_ERR_UNSUPPORTED, "I16", &err);
        free(z);
        free(t1);
        free(t3);
        free(h1);
        free(h3);
    }

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

// GEMMs large enough to be split into several tiles of C both ways, with ragged edges: every
// element against a double reference, and the same bits on 1 and 3 threads (the split is the
// shape's, never the thread count's).
static void test_gemm_tiles(lm_dev *d1, lm_dev *d3)
{
    lm_err err = {0};
    const int64_t shapes[][3] = {{1100, 2100, 9}, {130, 5000, 3}, {700, 300, 20}};
    for (int t = 0; t < 3; t++) {
        int64_t m = shapes[t][0], n = shapes[t][1], k = shapes[t][2];
        float *a = malloc((size_t)(m * k) * 4), *b = malloc((size_t)(n * k) * 4);
        float *c1 = malloc((size_t)(m * n) * 4), *c3 = malloc((size_t)(m * n) * 4);
        fill(a, m * k);
        fill(b, n * k);
        for (int64_t i = 0; i < m * n; i++)
            c1[i] = c3[i] = NAN;  // beta 0: whatever C held must not show
        // C = A Bᵀ: the forward pass's shape, B stored [n, k]
        CHECK_OK(lm_dev_gemm(d1, false, true, m, n, k, 1.0f, a, k, b, k, 0.0f, c1, n, &err), &err);
        CHECK_OK(lm_dev_gemm(d3, false, true, m, n, k, 1.0f, a, k, b, k, 0.0f, c3, n, &err), &err);
        double maxerr = 0;
        for (int64_t i = 0; i < m; i++)
            for (int64_t j = 0; j < n; j++) {
                double s = 0;
                for (int64_t l = 0; l < k; l++)
                    s += (double)a[i * k + l] * b[j * k + l];
                double e = fabs(s - c3[i * n + j]);
                maxerr = e > maxerr || isnan(e) ? e : maxerr;
            }
        CHECK_MSG(maxerr < 1e-5, "gemm %lld x %lld x %lld: max error %g", (long long)m, (long long)n, (long long)k,
                  maxerr);
        CHECK_MSG(same_bits(c1, c3, m * n), "gemm %lld x %lld x %lld: 1 and 3 threads differ", (long long)m,
                  (long long)n, (long long)k);
        free(a);
        free(b);
        free(c1);
        free(c3);
    }
}

// C = A·W and Aᵀ·W with C of a few columns and A large: the randomised SVD's products, which
// the CPU makes with kernels of its own where the processor has AVX-512 (one to five 16-wide
// vectors a row of C; more columns go to OpenBLAS, as does everything elsewhere). Every element
// against a double reference (within 1e-6 of the sum of its terms' magnitudes); the same bits on
// 1 and 3 threads; A, W and C with strides past their widths (C's columns past n keep what they
// held); ragged rows and sums; and a sum of 131,072 positive terms kept to 2e-6 of its value
// (one chain of float32 additions over them lost 1.5e-5).
static void test_gemm_narrow(lm_dev *d1, lm_dev *d3)
{
    lm_err err = {0};
    // m, n, k, ta: C [m, n]; A [m, k] (ta 0) or [k, m] (ta 1)
    const int64_t shapes[][4] = {{1000, 26, 1100, 0}, {1030, 26, 1050, 1}, {2001, 74, 600, 0}, {600, 74, 2003, 1},
                                 {1100, 1, 1000, 0},  {1100, 1, 1000, 1},  {700, 80, 1500, 0}, {1500, 80, 700, 1},
                                 {650, 33, 1700, 1},  {1700, 48, 650, 0},  {900, 81, 1200, 1}};
    for (size_t t = 0; t < sizeof shapes / sizeof shapes[0]; t++) {
        int64_t m = shapes[t][0], n = shapes[t][1], k = shapes[t][2];
        bool ta = shapes[t][3];
        int64_t lda = (ta ? m : k) + 3, ldw = n + 5, ldc = n + 2;
        float *a = malloc((size_t)((ta ? k : m) * lda) * 4), *w = malloc((size_t)(k * ldw) * 4);
        float *c1 = malloc((size_t)(m * ldc) * 4), *c3 = malloc((size_t)(m * ldc) * 4);
        fill(a, (ta ? k : m) * lda);
        fill(w, k * ldw);
        for (int64_t i = 0; i < m * ldc; i++)
            c1[i] = c3[i] = NAN;
        CHECK_OK(lm_dev_gemm(d1, ta, false, m, n, k, 1.0f, a, lda, w, ldw, 0.0f, c1, ldc, &err), &err);
        CHECK_OK(lm_dev_gemm(d3, ta, false, m, n, k, 1.0f, a, lda, w, ldw, 0.0f, c3, ldc, &err), &err);
        double maxerr = 0;
        bool pad_kept = true;
        for (int64_t i = 0; i < m; i++) {
            for (int64_t j = 0; j < n; j++) {
                double s = 0, mag = 0;  // the sum, and of its terms' magnitudes (its rounding's scale)
                for (int64_t q = 0; q < k; q++) {
                    double x = (double)(ta ? a[q * lda + i] : a[i * lda + q]) * w[q * ldw + j];
                    s += x;
                    mag += fabs(x);
                }
                double e = fabs(s - c3[i * ldc + j]) / mag;
                maxerr = e > maxerr || isnan(e) ? e : maxerr;
            }
            for (int64_t j = n; j < ldc; j++)
                pad_kept &= isnan(c1[i * ldc + j]) && isnan(c3[i * ldc + j]);
        }
        CHECK_MSG(maxerr < 1e-6, "narrow gemm ta=%d %lld x %lld x %lld: max error %g", (int)ta, (long long)m,
                  (long long)n, (long long)k, maxerr);
        CHECK_MSG(pad_kept, "narrow gemm ta=%d n=%lld: C's columns past n were written", (int)ta, (long long)n);
        CHECK_MSG(same_bits(c1, c3, m * ldc), "narrow gemm ta=%d %lld x %lld x %lld: 1 and 3 threads differ",
                  (int)ta, (long long)m, (long long)n, (long long)k);
        free(a);
        free(w);
        free(c1);
        free(c3);
    }
    // long sums of positive terms, both ways: C [16, 26] over k = 131,072
    enum { LM = 16, LN = 26, LK = 131072 };
    float *a = malloc((size_t)LM * LK * 4), *w = malloc((size_t)LK * LN * 4), *c = malloc(LM * LN * 4);
    fill(a, (int64_t)LM * LK);
    fill(w, (int64_t)LK * LN);
    for (int64_t i = 0; i < (int64_t)LM * LK; i++)
        a[i] = fabsf(a[i]);
    for (int64_t i = 0; i < (int64_t)LK * LN; i++)
        w[i] = fabsf(w[i]);
    for (int ta = 0; ta < 2; ta++) {
        CHECK_OK(lm_dev_gemm(d3, ta, false, LM, LN, LK, 1.0f, a, ta ? LM : LK, w, LN, 0.0f, c, LN, &err), &err);
        double worst = 0;
        for (int i = 0; i < LM; i++)
            for (int j = 0; j < LN; j++) {
                double s = 0;
                for (int64_t q = 0; q < LK; q++)
                    s += (double)(ta ? a[q * LM + i] : a[(int64_t)i * LK + q]) * w[q * LN + j];
                worst = fmax(worst, fabs(c[i * LN + j] - s) / s);
            }
        CHECK_MSG(worst < 2e-6, "narrow gemm ta=%d over %d positive terms: relative error %g", ta, (int)LK, worst);
    }
    free(a);
    free(w);
    free(c);
}

// syrk against a double reference: C[n,n] = alpha·AᵀA + beta·C on the upper triangle, the lower
// one left alone (or mirrored), over sizes that make one tile, several with a ragged edge
// (n 1000: tiles of 256), and none (k 0); beta 0 over NaN; 1 and 3 threads bit for bit; and a
// device without the operation says so.
static void test_syrk(lm_dev *d1, lm_dev *d3)
{
    lm_err err = {0};
    const struct { int64_t n, k; float alpha, beta; } cases[] = {
        {1000, 37, 1.0f, 1.0f}, {1000, 5, 0.5f, 0.0f}, {3, 5, 2.0f, -1.0f}, {1, 1, 1.0f, 1.0f}, {600, 0, 0.0f, 0.5f},
        {70, 300, 1.0f, 1.0f},
    };
    for (size_t t = 0; t < sizeof cases / sizeof cases[0]; t++) {
        int64_t n = cases[t].n, k = cases[t].k, lda = n + 3, ldc = n + 1;
        float alpha = cases[t].alpha, beta = cases[t].beta;
        float *a = malloc((size_t)(k * lda + 1) * 4), *c0 = malloc((size_t)(n * ldc) * 4);
        float *c1 = malloc((size_t)(n * ldc) * 4), *c3 = malloc((size_t)(n * ldc) * 4);
        fill(a, k * lda);
        fill(c0, n * ldc);
        if (beta == 0.0f)
            for (int64_t i = 0; i < n * ldc; i++)
                c0[i] = NAN;
        for (int mirror = 0; mirror < 2; mirror++) {
            memcpy(c1, c0, (size_t)(n * ldc) * 4);
            memcpy(c3, c0, (size_t)(n * ldc) * 4);
            CHECK_OK(lm_dev_syrk(d1, n, k, alpha, a, lda, beta, mirror, c1, ldc, &err), &err);
            CHECK_OK(lm_dev_syrk(d3, n, k, alpha, a, lda, beta, mirror, c3, ldc, &err), &err);
            CHECK_MSG(same_bits(c1, c3, n * ldc), "syrk n %lld k %lld: 1 and 3 threads differ", (long long)n,
                      (long long)k);
            double maxerr = 0;
            int64_t wrong_lower = 0, pad = 0;
            for (int64_t r = 0; r < n; r++) {
                for (int64_t c = r; c < n; c++) {
                    double s = 0;
                    for (int64_t l = 0; l < k; l++)
                        s += (double)a[l * lda + r] * a[l * lda + c];
                    double want = alpha * s + (beta == 0.0f ? 0.0 : beta * (double)c0[r * ldc + c]);
                    double e = fabs(want - c3[r * ldc + c]) / fmax(1.0, fabs(want));
                    maxerr = e > maxerr || isnan(e) ? e : maxerr;
                }
                for (int64_t c = 0; c < r; c++) {
                    float want = mirror ? c3[c * ldc + r] : c0[r * ldc + c];
                    wrong_lower += !same_bits(&c3[r * ldc + c], &want, 1);
                }
                pad += !same_bits(&c3[r * ldc + n], &c0[r * ldc + n], 1);
            }
            CHECK_MSG(maxerr < 1e-5, "syrk n %lld k %lld beta %g: max error %g", (long long)n, (long long)k, beta,
                      maxerr);
            CHECK_MSG(wrong_lower == 0, "syrk n %lld k %lld mirror %d: %lld wrong below the diagonal", (long long)n,
                      (long long)k, mirror, (long long)wrong_lower);
            CHECK_MSG(pad == 0, "syrk n %lld: wrote into the padding of %lld rows", (long long)n, (long long)pad);
        }
        free(a);
        free(c0);
        free(c1);
        free(c3);
    }
    CHECK(lm_dev_supports(d1, LM_OP_SYRK));
    float x[4] = {1, 2, 3, 4}, y[4];
    CHECK_FAILS(lm_dev_syrk(d1, 2, 2, 1.0f, x, 1, 0.0f, false, y, 2, &err), LM_ERR_USAGE, "lda 1", &err);
    lm_dev_i lacking = *d1->iface;
    lacking.syrk = NULL;
    lm_dev fake = *d1;
    fake.iface = &lacking;
    CHECK(!lm_dev_supports(&fake, LM_OP_SYRK));
    CHECK_FAILS(lm_dev_syrk(&fake, 2, 2, 1.0f, x, 2, 0.0f, false, y, 2, &err), LM_ERR_UNSUPPORTED,
                "cpu: the operation syrk is not implemented", &err);
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
    const lm_combine_sign signs[] = {LM_COMBINE_SIGN_NONE, LM_COMBINE_SIGN_SUM, LM_COMBINE_SIGN_COUNT,
                                     LM_COMBINE_SIGN_TAU, LM_COMBINE_SIGN_NONZERO, LM_COMBINE_SIGN_RAMPLUS};
    for (int si = 0; si < 6; si++) {
        for (int norm = 0; norm < 2; norm++) {
            lm_combine_how how = how_of(signs[si], norm, 0.8f);
            CHECK_OK(lm_dev_combine(d1, o1, base, (const float *const *)t, w, K, N, how, &err), &err);
            CHECK_OK(lm_dev_combine(d3, o3, base, (const float *const *)t, w, K, N, how, &err), &err);
            CHECK(same_bits(o1, o3, N));
            double maxerr = 0;
            for (int64_t e = 0; e < N; e++) {
                double W[K], delta = 0, div = 0, vote = 0;
                for (int i = 0; i < K; i++) {
                    W[i] = (double)w[i] * t[i][e];
                    vote += signs[si] == LM_COMBINE_SIGN_COUNT ? (W[i] > 0) - (W[i] < 0)
                            : signs[si] == LM_COMBINE_SIGN_TAU  ? t[i][e]  // the unweighted sum
                                                                : W[i];
                }
                int s = vote >= 0 ? 1 : -1;
                for (int i = 0; i < K; i++) {
                    int sg = (W[i] > 0) - (W[i] < 0);
                    if (signs[si] == LM_COMBINE_SIGN_NONZERO) {  // no election; only the nonzero divide
                        delta += W[i];
                        div += t[i][e] != 0 ? w[i] : 0;
                    } else if (signs[si] == LM_COMBINE_SIGN_NONE || sg == s) {
                        delta += W[i];
                        div += w[i];
                    }
                }
                if (norm && div != 0)
                    delta /= div;
                if (signs[si] == LM_COMBINE_SIGN_RAMPLUS) {  // one part: its W_i; several: their plain mean
                    int c = 0;
                    double one = 0, sum = 0;
                    for (int i = 0; i < K; i++)
                        if (t[i][e] != 0) {
                            c++;
                            one = W[i];
                            sum += t[i][e];
                        }
                    delta = c == 1 ? one : c > 1 ? sum / c : 0;
                }
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

static void h_convert(harness *h, int64_t n)
{
    char what[64];
    float *x = hmalloc((size_t)n * 4), *want = hmalloc((size_t)n * 4), *got = hmalloc((size_t)n * 4);
    char *src = hmalloc((size_t)n * 8), *wbytes = hmalloc((size_t)n * 4), *gbytes = hmalloc((size_t)n * 4);
    fill_special(x, n);

    // to_f32 from every readable dtype. F16 and BF16 sources are random bit patterns (NaNs,
    // infinities and subnormals included); F64 values carry bits below float precision. F64 has
    // no NaN: its payload's fate is not part of the interface (x86 keeps it, CUDA does not).
    const lm_dtype in[] = {LM_DTYPE_F32, LM_DTYPE_F16, LM_DTYPE_BF16, LM_DTYPE_F64};
    for (int t = 0; t < 4; t++) {
        for (int64_t i = 0; i < n; i++) {
            if (in[t] == LM_DTYPE_F32) {
                memcpy(src + 4 * i, &x[i], 4);
            } else if (in[t] == LM_DTYPE_F64) {
                double v = (double)x[i] * 3.0 + frand() * 1e-12;
                if (i % 11 == 3 || i % 11 == 5)
                    v = (i % 11 == 3 ? 1e300 : 1e-300) * x[i];  // beyond float's range both ways
                v = isnan(v) ? 1.0 : v;
                memcpy(src + 8 * i, &v, 8);
            } else {
                uint16_t v = (uint16_t)lm_mix64(state++);
                memcpy(src + 2 * i, &v, 2);
            }
        }
        size_t sbytes = (size_t)n * lm_dtype_bits(in[t]) / 8;
        snprintf(what, sizeof what, "to_f32 from %s, n=%lld", lm_dtype_name(in[t]), (long long)n);
        CHECK_OK(lm_dev_to_f32(h->cpu, want, src, in[t], n, &h->err), &h->err);
        float *ddst = put(h, NULL, (size_t)n * 4);
        void *dsrc = put(h, src, sbytes);
        if (ddst && dsrc && DEV_OK(h, lm_dev_to_f32(h->dev, ddst, dsrc, in[t], n, &h->err)) &&
            get(h, got, ddst, (size_t)n * 4))
            CHECK_MSG(same_bits(got, want, n), "%s on %s is not bit-identical", what, lm_dev_name(h->dev));
        lm_dev_buf_free(h->dev, ddst);
        lm_dev_buf_free(h->dev, dsrc);
    }

    // from_f32 to every writable dtype, rounding bit-identical to the CPU's, every NaN the
    // canonical one (F32 included)
    const lm_dtype out[] = {LM_DTYPE_F32, LM_DTYPE_F16, LM_DTYPE_BF16};
    for (int t = 0; t < 3; t++) {
        size_t obytes = (size_t)n * lm_dtype_bits(out[t]) / 8, es = lm_dtype_bits(out[t]) / 8;
        snprintf(what, sizeof what, "from_f32 to %s, n=%lld", lm_dtype_name(out[t]), (long long)n);
        CHECK_OK(lm_dev_from_f32(h->cpu, wbytes, out[t], x, n, &h->err), &h->err);
        int64_t not_canonical = 0;
        for (int64_t i = 0; i < n; i++) {
            uint32_t v = 0;
            memcpy(&v, wbytes + es * (size_t)i, es);
            not_canonical += isnan(x[i]) && v != (t == 0 ? 0x7FC00000u : t == 1 ? 0x7E00u : 0x7FC0u);
        }
        CHECK_MSG(not_canonical == 0, "%s: %lld NaNs written with other bits", what, (long long)not_canonical);
        float *dx = put(h, x, (size_t)n * 4);
        void *ddst = put(h, NULL, obytes);
        if (dx && ddst && DEV_OK(h, lm_dev_from_f32(h->dev, ddst, out[t], dx, n, &h->err)) &&
            get(h, gbytes, ddst, obytes))
            CHECK_MSG(memcmp(gbytes, wbytes, obytes) == 0, "%s on %s is not bit-identical", what,
                      lm_dev_name(h->dev));
        lm_dev_buf_free(h->dev, dx);
        lm_dev_buf_free(h->dev, ddst);
    }

    // dtypes llmerge does not compute with are refused with a status naming them
    void *dbuf = put(h, NULL, (size_t)n * 8);
    if (dbuf) {
        CHECK_FAILS(lm_dev_to_f32(h->dev, dbuf, dbuf, LM_DTYPE_I16, n, &h->err), LM_ERR_UNSUPPORTED, "I16", &h->err);
        CHECK_FAILS(lm_dev_from_f32(h->dev, dbuf, LM_DTYPE_F64, dbuf, n, &h->err), LM_ERR_UNSUPPORTED, "F64",
                    &h->err);
    }
    lm_dev_buf_free(h->dev, dbuf);
    free(x);
    free(want);
    free(got);
    free(src);
    free(wbytes);
    free(gbytes);
}

// One GEMM in every transposition, with padded row strides: C's padding must stay untouched.
// The product without transposes of rank <= LM_DEV_LOWRANK_MAX (LoRA's) must be the CPU's bit
// for bit; the others agree to float32 rounding.
static void h_gemm(harness *h, int64_t m, int64_t n, int64_t k, float alpha, float beta)
{
    char what[96];
    for (int ta = 0; ta < 2; ta++) {
        for (int tb = 0; tb < 2; tb++) {
            // Stored shapes: A is [m,k] or [k,m]; B is [k,n] or [n,k]; C is [m,n].
            int64_t ra = ta ? k : m, ca = ta ? m : k, rb = tb ? n : k, cb = tb ? k : n;
            int64_t lda = ca + 3, ldb = cb + 1, ldc = n + 2;
            size_t na = (size_t)(ra * lda), nb = (size_t)(rb * ldb), nc = (size_t)(m * ldc);
            float *a = hmalloc(na * 4), *b = hmalloc(nb * 4), *c0 = hmalloc(nc * 4), *want = hmalloc(nc * 4),
                  *got = hmalloc(nc * 4);
            fill(a, (int64_t)na);
            fill(b, (int64_t)nb);
            fill(c0, (int64_t)nc);
            memcpy(want, c0, nc * 4);
            snprintf(what, sizeof what, "gemm ta=%d tb=%d m=%lld n=%lld k=%lld beta=%g", ta, tb, (long long)m,
                     (long long)n, (long long)k, beta);
            CHECK_OK(lm_dev_gemm(h->cpu, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, want, ldc, &h->err), &h->err);
            float *da = put(h, a, na * 4), *db = put(h, b, nb * 4), *dc = put(h, c0, nc * 4);
            if (da && db && dc &&
                DEV_OK(h, lm_dev_gemm(h->dev, ta, tb, m, n, k, alpha, da, lda, db, ldb, beta, dc, ldc, &h->err)) &&
                get(h, got, dc, nc * 4)) {
                int64_t pad_changed = 0;
                int op = !ta && !tb && k <= LM_DEV_LOWRANK_MAX ? ST_LOWRANK : ST_GEMM;
                for (int64_t i = 0; i < m; i++) {
                    check_close(h, op, what, got + i * ldc, want + i * ldc, n, 1e-5);
                    pad_changed += !same_bits(got + i * ldc + n, c0 + i * ldc + n, ldc - n);
                }
                CHECK_MSG(pad_changed == 0, "%s on %s wrote into %lld rows' padding", what, lm_dev_name(h->dev),
                          (long long)pad_changed);
            }
            lm_dev_buf_free(h->dev, da);
            lm_dev_buf_free(h->dev, db);
            lm_dev_buf_free(h->dev, dc);
            free(a);
            free(b);
            free(c0);
            free(want);
            free(got);
        }
    }
}

// syrk on the device against the CPU's, padded strides, mirrored and not (counted as GEMM); a
// device without it is skipped (callers use GEMM there).
static void h_syrk(harness *h, int64_t n, int64_t k, float alpha, float beta)
{
    if (!lm_dev_supports(h->dev, LM_OP_SYRK))
        return;
    char what[96];
    int64_t lda = n + 3, ldc = n + 2;
    size_t na = (size_t)(k * lda), nc = (size_t)(n * ldc);
    float *a = hmalloc(na * 4), *c0 = hmalloc(nc * 4), *want = hmalloc(nc * 4), *got = hmalloc(nc * 4);
    fill(a, (int64_t)na);
    fill(c0, (int64_t)nc);
    for (int mirror = 0; mirror < 2; mirror++) {
        snprintf(what, sizeof what, "syrk n=%lld k=%lld beta=%g mirror=%d", (long long)n, (long long)k, beta, mirror);
        memcpy(want, c0, nc * 4);
        CHECK_OK(lm_dev_syrk(h->cpu, n, k, alpha, a, lda, beta, mirror, want, ldc, &h->err), &h->err);
        float *da = put(h, a, na * 4), *dc = put(h, c0, nc * 4);
        if (da && dc && DEV_OK(h, lm_dev_syrk(h->dev, n, k, alpha, da, lda, beta, mirror, dc, ldc, &h->err)) &&
            get(h, got, dc, nc * 4))
            check_close(h, ST_GEMM, what, got, want, (int64_t)nc, 1e-5);
        lm_dev_buf_free(h->dev, da);
        lm_dev_buf_free(h->dev, dc);
    }
    free(a);
    free(c0);
    free(want);
    free(got);
}

// The Cholesky factorisation of an n × n positive definite matrix, against the textbook
// algorithm in double written out here: U's upper triangle and the diagonal returned beside it
// to 1e-12 of the largest entry (the devices block the factorisation differently: bit for bit
// only on the sim, which runs the CPU's). A matrix with a negative pivot is refused.
static void h_potrf(harness *h, int64_t n)
{
    size_t nn = (size_t)(n * n);
    double *a = hmalloc(nn * 8), *want = hmalloc(nn * 8), *got = hmalloc(nn * 8), *diag = hmalloc((size_t)n * 8);
    float *g = hmalloc(nn * 4);
    // a = G Gᵀ + n·I: symmetric, positive definite, well conditioned
    fill(g, (int64_t)nn);
    for (int64_t r = 0; r < n; r++)
        for (int64_t c = 0; c < n; c++) {
            double v = r == c ? (double)n : 0.0;
            for (int64_t k = 0; k < n; k++)
                v += (double)g[r * n + k] * g[c * n + k];
            a[c * n + r] = v;
        }
    memset(want, 0, nn * 8);
    double most = 0;
    for (int64_t j = 0; j < n; j++) {
        double d = a[j * n + j];
        for (int64_t k = 0; k < j; k++)
            d -= want[j * n + k] * want[j * n + k];
        want[j * n + j] = sqrt(d);
        for (int64_t i = j + 1; i < n; i++) {
            double v = a[i * n + j];
            for (int64_t k = 0; k < j; k++)
                v -= want[j * n + k] * want[i * n + k];
            want[i * n + j] = v / want[j * n + j];
        }
    }
    for (size_t i = 0; i < nn; i++)
        most = fmax(most, fabs(want[i]));
    double *da = put(h, a, nn * 8), *dd = put(h, NULL, (size_t)n * 8);
    if (da && dd && DEV_OK(h, lm_dev_potrf(h->dev, da, n, dd, &h->err)) && get(h, got, da, nn * 8) &&
        get(h, diag, dd, (size_t)n * 8)) {
        int64_t bad = 0;
        for (int64_t c = 0; c < n; c++) {
            for (int64_t r = 0; r <= c; r++)
                bad += !(fabs(got[c * n + r] - want[c * n + r]) <= 1e-12 * most);
            bad += diag[c] != got[c * n + c];
        }
        CHECK_MSG(bad == 0, "potrf n=%lld on %s: %lld entries of U or its diagonal differ from the reference",
                  (long long)n, lm_dev_name(h->dev), (long long)bad);
    }
    // a negative pivot in the middle: the factorisation fails there, as a bad input
    a[(n / 2) * n + n / 2] = -1.0;
    if (da && n > 1 && lm_dev_upload(h->dev, da, a, nn * 8, &h->err) == LM_OK)
        CHECK_FAILS(lm_dev_potrf(h->dev, da, n, dd, &h->err), LM_ERR_FORMAT, "not positive definite", &h->err);
    lm_dev_buf_free(h->dev, da);
    lm_dev_buf_free(h->dev, dd);
    free(a);
    free(want);
    free(got);
    free(diag);
    free(g);
}

// delta from every readable dtype: bit-identical to to_f32 then axpby(1, base, -1) on the CPU,
// which is its contract.
static void h_delta(harness *h, int64_t n)
{
    char what[64];
    const lm_dtype in[] = {LM_DTYPE_F32, LM_DTYPE_F16, LM_DTYPE_BF16, LM_DTYPE_F64};
    float *base = hmalloc((size_t)n * 4), *want = hmalloc((size_t)n * 4), *got = hmalloc((size_t)n * 4);
    unsigned char *src = hmalloc((size_t)n * 8);
    fill(base, n);
    uint64_t state = 77;
    for (int t = 0; t < 4; t++) {
        size_t esz = lm_dtype_bits(in[t]) / 8;
        for (int64_t i = 0; i < n; i++) {
            float f = i % 7 == 0 ? base[i] : base[i] + (float)((int64_t)(lm_mix64(state++) % 2001) - 1000) * 1e-4f;
            double v = f;
            uint16_t hv = in[t] == LM_DTYPE_BF16 ? lm_f32_to_bf16(f) : lm_f32_to_f16(f);
            memcpy(src + esz * i, in[t] == LM_DTYPE_F32 ? (const void *)&f : in[t] == LM_DTYPE_F64 ? (const void *)&v
                                                                                                  : (const void *)&hv,
                   esz);
        }
        snprintf(what, sizeof what, "delta from %s n=%lld", lm_dtype_name(in[t]), (long long)n);
        CHECK_OK(lm_dev_to_f32(h->cpu, want, src, in[t], n, &h->err), &h->err);
        CHECK_OK(lm_dev_axpby(h->cpu, want, 1.0f, base, -1.0f, n, &h->err), &h->err);
        // the CPU's own fused version first, then the device's
        CHECK_OK(lm_dev_delta(h->cpu, got, src, in[t], base, n, &h->err), &h->err);
        CHECK_MSG(same_bits(got, want, n), "%s on cpu differs from to_f32 + axpby", what);
        float *dt = put(h, NULL, (size_t)n * 4), *db = put(h, base, (size_t)n * 4);
        void *ds = put(h, src, (size_t)n * esz);
        if (dt && db && ds && DEV_OK(h, lm_dev_delta(h->dev, dt, ds, in[t], db, n, &h->err)) &&
            get(h, got, dt, (size_t)n * 4))
            CHECK_MSG(same_bits(got, want, n), "%s on %s is not bit-identical", what, lm_dev_name(h->dev));
        lm_dev_buf_free(h->dev, dt);
        lm_dev_buf_free(h->dev, db);
        lm_dev_buf_free(h->dev, ds);
    }
    free(base);
    free(want);
    free(got);
    free(src);
}

static void h_axpby(harness *h, int64_t n)
{
    char what[64];
    float *x = hmalloc((size_t)n * 4), *y = hmalloc((size_t)n * 4), *got = hmalloc((size_t)n * 4);
    fill(x, n);
    fill(y, n);
    for (int64_t i = 0; i < n; i += 5)
        x[i] = 0.0f;
    float *dx = put(h, x, (size_t)n * 4), *dy = put(h, y, (size_t)n * 4);
    snprintf(what, sizeof what, "axpby n=%lld", (long long)n);
    CHECK_OK(lm_dev_axpby(h->cpu, y, 0.75f, x, -1.25f, n, &h->err), &h->err);
    if (dx && dy && DEV_OK(h, lm_dev_axpby(h->dev, dy, 0.75f, dx, -1.25f, n, &h->err)) &&
        get(h, got, dy, (size_t)n * 4))
        check_close(h, ST_AXPBY, what, got, y, n, 1e-5);
    // the in-place scaling merging does: x = s·x + 0·x
    snprintf(what, sizeof what, "axpby in place n=%lld", (long long)n);
    CHECK_OK(lm_dev_axpby(h->cpu, x, 3.5f, x, 0.0f, n, &h->err), &h->err);
    if (dx && DEV_OK(h, lm_dev_axpby(h->dev, dx, 3.5f, dx, 0.0f, n, &h->err)) && get(h, got, dx, (size_t)n * 4))
        check_close(h, ST_AXPBY, what, got, x, n, 1e-5);
    lm_dev_buf_free(h->dev, dx);
    lm_dev_buf_free(h->dev, dy);
    free(x);
    free(y);
    free(got);
}

static void h_dora(harness *h, int64_t rows, int64_t cols)
{
    char what[64];
    size_t n = (size_t)(rows * cols);
    float *tau = hmalloc(n * 4), *base = hmalloc(n * 4), *mag = hmalloc((size_t)rows * 4), *got = hmalloc(n * 4);
    fill(tau, (int64_t)n);
    fill(base, (int64_t)n);
    fill(mag, rows);
    for (int64_t c = 0; c < cols; c++)
        tau[c] = -base[c];  // row 0 adapts to all zeros: no direction to scale
    float *dt = put(h, tau, n * 4), *db = put(h, base, n * 4), *dm = put(h, mag, (size_t)rows * 4);
    snprintf(what, sizeof what, "dora_rows %lld x %lld", (long long)rows, (long long)cols);
    CHECK_OK(lm_dev_dora_rows(h->cpu, tau, base, mag, rows, cols, &h->err), &h->err);
    if (dt && db && dm && DEV_OK(h, lm_dev_dora_rows(h->dev, dt, db, dm, rows, cols, &h->err)) &&
        get(h, got, dt, n * 4))
        check_close(h, ST_DORA, what, got, tau, (int64_t)n, 1e-5);
    lm_dev_buf_free(h->dev, dt);
    lm_dev_buf_free(h->dev, db);
    lm_dev_buf_free(h->dev, dm);
    free(tau);
    free(base);
    free(mag);
    free(got);
}

// Values drawn from a few magnitudes (many exact ties), signs mixed, some random.
static void fill_ties(float *x, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        x[i] = i % 13 == 0 ? frand() : (float)((int)(lm_mix64((uint64_t)i ^ state) % 9) - 4) * 0.5f;
}

// Histograms add to what the host array holds; level 1 looks into a bin of ties and into a
// bin of a random value.
static void h_hist(harness *h, const float *x, const float *dx, int64_t n)
{
    uint64_t *hw = hmalloc(LM_HIST_BINS * 8), *hg = hmalloc(LM_HIST_BINS * 8);
    const int levels[] = {0, 1, 1};
    const uint32_t bins[] = {0, lm_abs_bits(1.5f) >> 16, n > 0 ? lm_abs_bits(x[0]) >> 16 : 0};
    for (int i = 0; i < 3; i++) {
        for (int b = 0; b < LM_HIST_BINS; b++)
            hw[b] = hg[b] = (uint64_t)(b % 7);
        CHECK_OK(lm_dev_hist_abs(h->cpu, hw, x, n, levels[i], bins[i], &h->err), &h->err);
        if (DEV_OK(h, lm_dev_hist_abs(h->dev, hg, dx, n, levels[i], bins[i], &h->err)))
            CHECK_MSG(memcmp(hg, hw, LM_HIST_BINS * 8) == 0, "hist_abs level %d bin %u n=%lld differs on %s",
                      levels[i], bins[i], (long long)n, lm_dev_name(h->dev));
    }
    free(hw);
    free(hg);
}

// hist_window against its contract, from the CPU's hist_abs: the count of magnitudes whose top
// bits are at or beyond the window and level 1 for each bin of the window, added to what the
// arrays held. Also the dispatcher's own version, for devices without the operation.
static void h_hist_window(harness *h, const float *x, const float *dx, int64_t n)
{
    enum { W = LM_HIST_WINDOW };
    uint64_t *want = hmalloc(W * LM_HIST_BINS * 8), *got = hmalloc(W * LM_HIST_BINS * 8),
             *h0 = hmalloc(LM_HIST_BINS * 8);
    uint32_t centre = n > 0 ? lm_abs_bits(x[n / 2]) >> 16 : 0;
    const uint32_t los[] = {centre > 1 ? centre - 1 : 0, lm_abs_bits(1.5f) >> 16, 0, 0xFFFEu};
    const int wins[] = {W, 2, W, W};
    // the CPU without its hist_window: the dispatcher composes it from hist_abs
    lm_dev_i plain_i = *h->cpu->iface;
    plain_i.hist_window = NULL;
    lm_dev plain = *h->cpu;
    plain.iface = &plain_i;
    for (int i = 0; i < 4; i++) {
        uint64_t above_want = 7;
        memset(h0, 0, LM_HIST_BINS * 8);
        CHECK_OK(lm_dev_hist_abs(h->cpu, h0, x, n, 0, 0, &h->err), &h->err);
        for (uint64_t b = (uint64_t)los[i] + (uint64_t)wins[i]; b < LM_HIST_BINS; b++)
            above_want += h0[b];
        for (size_t b = 0; b < (size_t)W * LM_HIST_BINS; b++)
            want[b] = (uint64_t)(b % 5);
        for (int w = 0; w < wins[i]; w++)
            CHECK_OK(lm_dev_hist_abs(h->cpu, want + (size_t)w * LM_HIST_BINS, x, n, 1, los[i] + (uint32_t)w, &h->err),
                     &h->err);
        for (int way = 0; way < 2; way++) {
            uint64_t above = 7;
            for (size_t b = 0; b < (size_t)W * LM_HIST_BINS; b++)
                got[b] = (uint64_t)(b % 5);
            lm_status st = way == 0 ? lm_dev_hist_window(h->dev, &above, got, wins[i], los[i], dx, n, &h->err)
                                    : lm_dev_hist_window(&plain, &above, got, wins[i], los[i], x, n, &h->err);
            if (way == 1)
                CHECK_OK(st, &h->err);
            if ((way == 1 && st == LM_OK) || (way == 0 && DEV_OK(h, st)))
                CHECK_MSG(above == above_want && memcmp(got, want, (size_t)W * LM_HIST_BINS * 8) == 0,
                          "hist_window from bin %u, %d bins, n=%lld differs on %s (above %llu, want %llu)", los[i],
                          wins[i], (long long)n, way ? "the dispatcher's version" : lm_dev_name(h->dev),
                          (unsigned long long)above, (unsigned long long)above_want);
        }
    }
    uint64_t above = 0;
    CHECK_FAILS(lm_dev_hist_window(h->dev, &above, got, W + 1, 0, dx, n, &h->err), LM_ERR_USAGE, "window", &h->err);
    free(want);
    free(got);
    free(h0);
}

// Top-k with the ties at the threshold kept all, none, some (the lowest indices first) and
// more than there are. dx is overwritten.
static void h_topk(harness *h, const float *x, float *dx, int64_t n)
{
    float *want = hmalloc((size_t)n * 4), *got = hmalloc((size_t)n * 4);
    uint32_t thr = lm_abs_bits(1.5f);
    int64_t ties = 0;
    for (int64_t i = 0; i < n; i++)
        ties += lm_abs_bits(x[i]) == thr;
    const int64_t allowed[] = {LM_TIES_ALL, 0, ties / 2, ties + 5};
    for (int a = 0; a < 4; a++) {
        int64_t uw = -1, ug = -2;
        memcpy(want, x, (size_t)n * 4);
        CHECK_OK(lm_dev_topk_apply(h->cpu, want, n, thr, allowed[a], &uw, &h->err), &h->err);
        if (DEV_OK(h, lm_dev_upload(h->dev, dx, x, (size_t)n * 4, &h->err)) &&
            DEV_OK(h, lm_dev_topk_apply(h->dev, dx, n, thr, allowed[a], &ug, &h->err)) &&
            get(h, got, dx, (size_t)n * 4))
            CHECK_MSG(same_bits(got, want, n) && ug == uw, "topk_apply ties_allowed=%lld n=%lld on %s: mask %s, "
                      "ties used %lld (cpu %lld)", (long long)allowed[a], (long long)n, lm_dev_name(h->dev),
                      same_bits(got, want, n) ? "same" : "differs", (long long)ug, (long long)uw);
        // topk_drop zeroes exactly what topk_apply keeps: every entry is in one of the two
        float *dropped = hmalloc((size_t)n * 4);
        int64_t dw = -1, dg = -2;
        memcpy(dropped, x, (size_t)n * 4);
        CHECK_OK(lm_dev_topk_drop(h->cpu, dropped, n, thr, allowed[a], &dw, &h->err), &h->err);
        int64_t bad = 0;
        for (int64_t i = 0; i < n; i++)
            bad += lm_f32_bits(want[i]) == lm_f32_bits(x[i]) ? dropped[i] != 0.0f
                                                             : lm_f32_bits(dropped[i]) != lm_f32_bits(x[i]);
        CHECK_MSG(bad == 0 && dw == uw, "topk_drop ties_allowed=%lld n=%lld on cpu: %lld entries not the complement, "
                  "ties %lld (apply %lld)", (long long)allowed[a], (long long)n, (long long)bad, (long long)dw,
                  (long long)uw);
        if (DEV_OK(h, lm_dev_upload(h->dev, dx, x, (size_t)n * 4, &h->err)) &&
            DEV_OK(h, lm_dev_topk_drop(h->dev, dx, n, thr, allowed[a], &dg, &h->err)) &&
            get(h, got, dx, (size_t)n * 4))
            CHECK_MSG(same_bits(got, dropped, n) && dg == dw, "topk_drop ties_allowed=%lld n=%lld on %s differs",
                      (long long)allowed[a], (long long)n, lm_dev_name(h->dev));
        free(dropped);
    }
    // a threshold above every magnitude (nothing kept), with no ties to keep: all zero after
    // apply, all left by drop
    for (int drop = 0; drop < 2; drop++) {
        int64_t used = -1, bad = 0;
        memcpy(want, x, (size_t)n * 4);
        CHECK_OK(drop ? lm_dev_topk_drop(h->cpu, want, n, 0xFFFFFFFFu, 0, &used, &h->err)
                      : lm_dev_topk_apply(h->cpu, want, n, 0xFFFFFFFFu, 0, &used, &h->err),
                 &h->err);
        for (int64_t i = 0; i < n; i++)
            bad += lm_f32_bits(want[i]) != (drop ? lm_f32_bits(x[i]) : 0u);
        CHECK_MSG(bad == 0 && used == 0, "topk_%s above every magnitude, no ties: %lld entries wrong",
                  drop ? "drop" : "apply", (long long)bad);
    }
    free(want);
    free(got);
}

// row_dot against sums in the order device.h fixes (dot_ref.h), the same bits as the CPU's;
// nearswap against its formula.
static void h_row_dot_near(harness *h, int64_t rows, int64_t cols)
{
    int64_t n = rows * cols;
    float *x = hmalloc((size_t)(n ? n : 1) * 4), *y = hmalloc((size_t)(n ? n : 1) * 4),
          *got = hmalloc((size_t)(n ? n : 1) * 4);
    double *rw = hmalloc((size_t)(rows ? rows : 1) * 8), *rg = hmalloc((size_t)(rows ? rows : 1) * 8);
    fill(x, n);
    fill(y, n);
    CHECK_OK(lm_dev_row_dot(h->cpu, x, y, rows, cols, rw, &h->err), &h->err);
    for (int64_t r = 0; r < rows; r++) {
        double s = dot_ref(x + r * cols, y + r * cols, cols);
        CHECK_MSG(memcmp(&rw[r], &s, sizeof s) == 0, "row_dot row %lld of %lldx%lld: %.17g, wanted %.17g",
                  (long long)r, (long long)rows, (long long)cols, rw[r], s);
    }
    float *dx = put(h, x, (size_t)n * 4), *dy = put(h, y, (size_t)n * 4);
    if (dx && dy && DEV_OK(h, lm_dev_row_dot(h->dev, dx, dy, rows, cols, rg, &h->err)))
        CHECK_MSG(rows == 0 || memcmp(rg, rw, (size_t)rows * 8) == 0, "row_dot %lldx%lld on %s: not the cpu's sums",
                  (long long)rows, (long long)cols, lm_dev_name(h->dev));
    // della_drop: ranks by magnitude per row (fill_ties-like repeats from fill's rounding), both
    // rescales; the device's bits are the CPU's. The device's free memory is as it was after it
    // (on the devices whose free memory no other process changes): a scratch of the slab's size
    // kept live would shrink the room of every later unit, and the scratch every device keeps
    // stays taken.
    const char *dname = lm_dev_name(h->dev);
    bool own_memory = strncmp(dname, "sim:", 4) == 0 || strncmp(dname, "cuda-emu", 8) == 0;
    for (int inv = 0; inv < 2; inv++) {
        float *want = hmalloc((size_t)(n ? n : 1) * 4);
        memcpy(want, x, (size_t)n * 4);
        uint64_t key = lm_rng_key(5, 1, 0x1234);
        CHECK_OK(lm_dev_della_drop(h->cpu, want, rows, cols, key, 77, 0.3, 0.7, inv, &h->err), &h->err);
        size_t fr0 = 0, fr1 = 0, tot = 0;
        lm_dev_mem_info(h->dev, &fr0, &tot);
        if (dx && DEV_OK(h, lm_dev_upload(h->dev, dx, x, (size_t)n * 4, &h->err)) &&
            DEV_OK(h, lm_dev_della_drop(h->dev, dx, rows, cols, key, 77, 0.3, 0.7, inv, &h->err)) &&
            get(h, got, dx, (size_t)n * 4)) {
            CHECK_MSG(same_bits(got, want, n), "della_drop %lldx%lld inv=%d on %s differs", (long long)rows,
                      (long long)cols, inv, dname);
            lm_dev_mem_info(h->dev, &fr1, &tot);
            CHECK_MSG(!own_memory || fr1 == fr0, "della_drop %lldx%lld on %s: %zu bytes free before, %zu after",
                      (long long)rows, (long long)cols, dname, fr0, fr1);
        }
        free(want);
    }
    // row_axpby: each row's factors, against the formula; tau_var against its definition
    if (rows > 0) {
        float *ra = hmalloc((size_t)rows * 4), *rb = hmalloc((size_t)rows * 4), *want = hmalloc((size_t)n * 4);
        for (int64_t r = 0; r < rows; r++) {
            ra[r] = (float)(r % 3) - 0.5f;
            rb[r] = 0.25f * (float)(r % 5);
        }
        memcpy(want, y, (size_t)n * 4);
        CHECK_OK(lm_dev_row_axpby(h->cpu, want, ra, x, rb, rows, cols, &h->err), &h->err);
        int64_t bad = 0;
        for (int64_t i = 0; i < n; i++)
            bad += lm_f32_bits(want[i]) != lm_f32_bits(ra[i / cols] * y[i] + rb[i / cols] * x[i]);
        CHECK_MSG(bad == 0, "row_axpby %lldx%lld on cpu: %lld values differ from the formula", (long long)rows,
                  (long long)cols, (long long)bad);
        float *dy2 = put(h, y, (size_t)n * 4);
        if (dx && dy2 && DEV_OK(h, lm_dev_upload(h->dev, dx, x, (size_t)n * 4, &h->err)) &&
            DEV_OK(h, lm_dev_row_axpby(h->dev, dy2, ra, dx, rb, rows, cols, &h->err)) &&
            get(h, got, dy2, (size_t)n * 4))
            CHECK_MSG(same_bits(got, want, n), "row_axpby %lldx%lld on %s differs", (long long)rows, (long long)cols,
                      lm_dev_name(h->dev));
        lm_dev_buf_free(h->dev, dy2);
        const float *hv[2] = {x, y};
        CHECK_OK(lm_dev_tau_var(h->cpu, want, hv, 2, 3, n, &h->err), &h->err);
        bad = 0;
        for (int64_t i = 0; i < n; i++) {
            double m = ((double)x[i] + (double)y[i]) / 3, v = ((double)x[i] - m) * ((double)x[i] - m) +
                                                              ((double)y[i] - m) * ((double)y[i] - m) + m * m;
            bad += lm_f32_bits(want[i]) != lm_f32_bits((float)(v / 3));
        }
        CHECK_MSG(bad == 0, "tau_var n=%lld on cpu: %lld values differ from the definition", (long long)n,
                  (long long)bad);
        const float *dv[2] = {dx, dy};
        float *dk = put(h, NULL, (size_t)n * 4);
        if (dk && DEV_OK(h, lm_dev_tau_var(h->dev, dk, dv, 2, 3, n, &h->err)) && get(h, got, dk, (size_t)n * 4))
            CHECK_MSG(same_bits(got, want, n), "tau_var n=%lld on %s differs", (long long)n, lm_dev_name(h->dev));
        lm_dev_buf_free(h->dev, dk);
        // col_dot adds to running sums down the rows; col_axpby scales by column
        double *cw = hmalloc((size_t)cols * 8), *cg = hmalloc((size_t)cols * 8);
        for (int64_t c = 0; c < cols; c++)
            cw[c] = cg[c] = 0.5 * (double)c;
        CHECK_OK(lm_dev_col_dot(h->cpu, x, y, rows, cols, cw, &h->err), &h->err);
        bad = 0;
        for (int64_t c = 0; c < cols; c++) {
            double s = 0.5 * (double)c;
            for (int64_t r = 0; r < rows; r++)
                s += (double)x[r * cols + c] * (double)y[r * cols + c];
            bad += s != cw[c];
        }
        CHECK_MSG(bad == 0, "col_dot %lldx%lld on cpu: %lld sums differ", (long long)rows, (long long)cols,
                  (long long)bad);
        if (dx && DEV_OK(h, lm_dev_col_dot(h->dev, dx, dy, rows, cols, cg, &h->err)))
            CHECK_MSG(memcmp(cg, cw, (size_t)cols * 8) == 0, "col_dot %lldx%lld on %s: not the cpu's sums",
                      (long long)rows, (long long)cols, lm_dev_name(h->dev));
        float *ca = hmalloc((size_t)cols * 4), *cb = hmalloc((size_t)cols * 4);
        for (int64_t c = 0; c < cols; c++) {
            ca[c] = (float)(c % 3) - 1.5f;
            cb[c] = 0.125f * (float)(c % 7);
        }
        memcpy(want, y, (size_t)n * 4);
        CHECK_OK(lm_dev_col_axpby(h->cpu, want, ca, x, cb, rows, cols, &h->err), &h->err);
        bad = 0;
        for (int64_t i = 0; i < n; i++)
            bad += lm_f32_bits(want[i]) != lm_f32_bits(ca[i % cols] * y[i] + cb[i % cols] * x[i]);
        CHECK_MSG(bad == 0, "col_axpby on cpu: %lld values differ from the formula", (long long)bad);
        float *dy3 = put(h, y, (size_t)n * 4);
        if (dx && dy3 && DEV_OK(h, lm_dev_col_axpby(h->dev, dy3, ca, dx, cb, rows, cols, &h->err)) &&
            get(h, got, dy3, (size_t)n * 4))
            CHECK_MSG(same_bits(got, want, n), "col_axpby %lldx%lld on %s differs", (long long)rows, (long long)cols,
                      lm_dev_name(h->dev));
        lm_dev_buf_free(h->dev, dy3);
        free(ca);
        free(cb);
        free(cw);
        free(cg);
        free(ra);
        free(rb);
        free(want);
    }
    const float ts[] = {0.0f, 0.3f, 2.0f};
    for (int k = 0; k < 3; k++) {
        float *want = hmalloc((size_t)(n ? n : 1) * 4);
        memcpy(want, x, (size_t)n * 4);
        CHECK_OK(lm_dev_nearswap(h->cpu, want, n, ts[k], &h->err), &h->err);
        int64_t bad = 0;
        for (int64_t i = 0; i < n; i++) {
            float a = fabsf(x[i]), w = ts[k] / (a > 1e-6f ? a : 1e-6f);
            w = w < 0 ? 0 : w > 1 ? 1 : w;
            bad += lm_f32_bits(want[i]) != lm_f32_bits(w * x[i]);
        }
        CHECK_MSG(bad == 0, "nearswap t=%g on cpu: %lld values differ from the formula", ts[k], (long long)bad);
        if (dx && DEV_OK(h, lm_dev_upload(h->dev, dx, x, (size_t)n * 4, &h->err)) &&
            DEV_OK(h, lm_dev_nearswap(h->dev, dx, n, ts[k], &h->err)) && get(h, got, dx, (size_t)n * 4))
            CHECK_MSG(same_bits(got, want, n), "nearswap t=%g n=%lld on %s differs", ts[k], (long long)n,
                      lm_dev_name(h->dev));
        free(want);
    }
    lm_dev_buf_free(h->dev, dx);
    lm_dev_buf_free(h->dev, dy);
    free(x);
    free(y);
    free(got);
    free(rw);
    free(rg);
}

// A random drop keyed by the element's index in its whole tensor, and an L1 norm. dx is
// overwritten.
static void h_drop_l1(harness *h, const float *x, float *dx, int64_t n)
{
    float *want = hmalloc((size_t)n * 4), *got = hmalloc((size_t)n * 4);
    uint64_t key = lm_rng_key(11, 2, 0xABCDEF), below = lm_rng_threshold(0.3);
    memcpy(want, x, (size_t)n * 4);
    CHECK_OK(lm_dev_random_drop(h->cpu, want, n, key, 123457, below, &h->err), &h->err);
    if (DEV_OK(h, lm_dev_upload(h->dev, dx, x, (size_t)n * 4, &h->err)) &&
        DEV_OK(h, lm_dev_random_drop(h->dev, dx, n, key, 123457, below, &h->err)) && get(h, got, dx, (size_t)n * 4))
        CHECK_MSG(same_bits(got, want, n), "random_drop n=%lld differs on %s", (long long)n, lm_dev_name(h->dev));

    fill(want, n);
    double lw = -1, lg = -2;
    CHECK_OK(lm_dev_l1(h->cpu, want, n, &lw, &h->err), &h->err);
    if (DEV_OK(h, lm_dev_upload(h->dev, dx, want, (size_t)n * 4, &h->err)) &&
        DEV_OK(h, lm_dev_l1(h->dev, dx, n, &lg, &h->err)))
        CHECK_MSG(lg == lw, "l1 n=%lld on %s: %.17g, cpu %.17g (the sums must be identical)", (long long)n,
                  lm_dev_name(h->dev), lg, lw);
    free(want);
    free(got);
}

// topk_apply_by against its contract written out here (keep x[j] when key[j]'s magnitude bits
// exceed thr, or equal it among the first ties_allowed such j), and importance against τ²/d
// in double; both on the device and on the CPU.
static void h_by_key(harness *h, int64_t n)
{
    float *x = hmalloc((size_t)n * 4), *key = hmalloc((size_t)n * 4), *want = hmalloc((size_t)n * 4),
          *got = hmalloc((size_t)n * 4);
    fill(x, n);
    fill_ties(key, n);
    uint32_t thr = lm_abs_bits(1.5f);
    int64_t ties = 0;
    for (int64_t i = 0; i < n; i++)
        ties += lm_abs_bits(key[i]) == thr;
    const int64_t allowed[] = {LM_TIES_ALL, 0, ties / 2, ties + 5};
    float *dx = put(h, x, (size_t)n * 4), *dk = put(h, key, (size_t)n * 4);
    for (int a = 0; a < 4 && dx && dk; a++) {
        int64_t left = allowed[a], used = 0;
        for (int64_t i = 0; i < n; i++) {
            uint32_t b = lm_abs_bits(key[i]);
            bool keep = b > thr || (b == thr && (allowed[a] == LM_TIES_ALL || left-- > 0));
            want[i] = keep ? x[i] : 0.0f;
        }
        int64_t want_used = allowed[a] == LM_TIES_ALL ? 0 : (ties < allowed[a] ? ties : allowed[a]);
        memcpy(got, x, (size_t)n * 4);
        CHECK_OK(lm_dev_topk_apply_by(h->cpu, got, key, n, thr, allowed[a], &used, &h->err), &h->err);
        CHECK_MSG(same_bits(got, want, n) && used == want_used, "topk_apply_by on cpu, allowed %lld, n=%lld",
                  (long long)allowed[a], (long long)n);
        int64_t dused = -1;
        if (DEV_OK(h, lm_dev_upload(h->dev, dx, x, (size_t)n * 4, &h->err)) &&
            DEV_OK(h, lm_dev_topk_apply_by(h->dev, dx, dk, n, thr, allowed[a], &dused, &h->err)) &&
            get(h, got, dx, (size_t)n * 4))
            CHECK_MSG(same_bits(got, want, n) && dused == want_used, "topk_apply_by on %s, allowed %lld, n=%lld",
                      lm_dev_name(h->dev), (long long)allowed[a], (long long)n);
    }
    // importance over rows × cols, with a column whose U_cc² is huge and one tiny
    int64_t cols = n >= 7 ? 7 : (n > 0 ? n : 1), rows = n / cols;
    double ucc2[7] = {1.0, 0.25, 3.0e-6, 1.0e30, 2.0, 0.5, 7.0};
    for (int64_t i = 0; i < rows * cols; i++) {
        double v = x[i];
        want[i] = (float)(v * v / ucc2[i % cols]);
    }
    CHECK_OK(lm_dev_importance(h->cpu, got, x, ucc2, rows, cols, &h->err), &h->err);
    CHECK_MSG(same_bits(got, want, rows * cols), "importance on cpu, %lld x %lld", (long long)rows, (long long)cols);
    double *du = put(h, ucc2, sizeof ucc2);
    float *dkey = put(h, NULL, (size_t)n * 4 + 4);
    if (dx && du && dkey && DEV_OK(h, lm_dev_upload(h->dev, dx, x, (size_t)n * 4, &h->err)) &&
        DEV_OK(h, lm_dev_importance(h->dev, dkey, dx, du, rows, cols, &h->err)) &&
        get(h, got, dkey, (size_t)(rows * cols) * 4))
        CHECK_MSG(same_bits(got, want, rows * cols), "importance on %s, %lld x %lld", lm_dev_name(h->dev),
                  (long long)rows, (long long)cols);
    lm_dev_buf_free(h->dev, dx);
    lm_dev_buf_free(h->dev, dk);
    lm_dev_buf_free(h->dev, du);
    lm_dev_buf_free(h->dev, dkey);
    free(x);
    free(key);
    free(want);
    free(got);
}

// A stored mask taken and applied, bit for bit with the CPU's, at offsets that are and are not
// multiples of 8, into a mask whose other bits (set and clear, before first and after the last
// bit) must survive; x holds zeros of both signs and NaNs. dx is overwritten.
static void h_masks(harness *h, const float *x, float *dx, int64_t n)
{
    const int64_t firsts[] = {0, 3, 8, 61, 8 * 70001 + 5};
    float *want = hmalloc((size_t)n * 4), *got = hmalloc((size_t)n * 4), *y = hmalloc((size_t)n * 4);
    memcpy(y, x, (size_t)n * 4);
    for (int64_t i = 0; i < n; i += 5)
        y[i] = i % 10 ? -0.0f : 0.0f;
    for (int64_t i = 2; i < n; i += 97)
        y[i] = NAN;
    for (size_t f = 0; f < sizeof firsts / sizeof firsts[0]; f++) {
        int64_t first = firsts[f];
        size_t nbytes = (size_t)((first + n) / 8 + 2);
        uint8_t *wbits = hmalloc(nbytes), *gbits = hmalloc(nbytes);
        for (size_t b = 0; b < nbytes; b++)
            wbits[b] = (uint8_t)lm_mix64(state++);
        memcpy(gbits, wbits, nbytes);
        CHECK_OK(lm_dev_mask_get(h->cpu, wbits, first, y, n, &h->err), &h->err);
        if (DEV_OK(h, lm_dev_upload(h->dev, dx, y, (size_t)n * 4, &h->err)) &&
            DEV_OK(h, lm_dev_mask_get(h->dev, gbits, first, dx, n, &h->err)))
            CHECK_MSG(memcmp(gbits, wbits, nbytes) == 0, "mask_get first=%lld n=%lld on %s differs from the CPU's",
                      (long long)first, (long long)n, lm_dev_name(h->dev));
        // apply a mask of random bits (not the one just taken) to x
        for (size_t b = 0; b < nbytes; b++)
            wbits[b] = (uint8_t)lm_mix64(state++);
        memcpy(want, x, (size_t)n * 4);
        CHECK_OK(lm_dev_mask_apply(h->cpu, want, wbits, first, n, &h->err), &h->err);
        if (DEV_OK(h, lm_dev_upload(h->dev, dx, x, (size_t)n * 4, &h->err)) &&
            DEV_OK(h, lm_dev_mask_apply(h->dev, dx, wbits, first, n, &h->err)) && get(h, got, dx, (size_t)n * 4))
            CHECK_MSG(same_bits(got, want, n), "mask_apply first=%lld n=%lld on %s differs from the CPU's",
                      (long long)first, (long long)n, lm_dev_name(h->dev));
        free(wbits);
        free(gbits);
    }
    free(want);
    free(got);
    free(y);
}

static void h_select(harness *h, int64_t n)
{
    float *x = hmalloc((size_t)n * 4);
    fill_ties(x, n);
    float *dx = put(h, x, (size_t)n * 4);
    if (dx) {
        h_hist(h, x, dx, n);
        h_hist_window(h, x, dx, n);
        h_topk(h, x, dx, n);
        h_drop_l1(h, x, dx, n);
        h_masks(h, x, dx, n);
    }
    lm_dev_buf_free(h->dev, dx);
    free(x);
}

static void h_combine(harness *h, int64_t n)
{
    enum { KMAX = 4 };
    char what[96];
    const float w[KMAX] = {1.0f, 0.5f, -0.75f, 2.0f};
    const lm_combine_sign signs[] = {LM_COMBINE_SIGN_NONE, LM_COMBINE_SIGN_SUM, LM_COMBINE_SIGN_COUNT,
                                     LM_COMBINE_SIGN_TAU, LM_COMBINE_SIGN_NONZERO, LM_COMBINE_SIGN_RAMPLUS};
    float *t[KMAX], *dt[KMAX], *base = hmalloc((size_t)n * 4), *want = hmalloc((size_t)n * 4),
                               *got = hmalloc((size_t)n * 4);
    bool ok = true;
    for (int i = 0; i < KMAX; i++) {
        t[i] = hmalloc((size_t)n * 4);
        fill(t[i], n);
        for (int64_t e = i; e < n; e += i + 2)
            t[i][e] = 0.0f;  // trimmed entries, and elements where every model is zero
        for (int64_t e = 5 + i; e < n; e += 101)  // NaNs with payloads and both signs
            t[i][e] = lm_bits_f32((e & 1 ? 0xFFC00000u : 0x7F800000u) | (uint32_t)(e % 4093 + 1));
        dt[i] = put(h, t[i], (size_t)n * 4);
        ok = ok && dt[i];
    }
    fill(base, n);
    float *dbase = put(h, base, (size_t)n * 4), *dout = put(h, NULL, (size_t)n * 4);
    uint16_t *dbf = put(h, NULL, (size_t)n * 2), *wbf = hmalloc((size_t)n * 2);
    for (int k = 1; ok && dbase && dout && k <= KMAX; k++) {
        for (int si = 0; si < 6; si++) {
            for (int norm = 0; norm < 2; norm++) {
                snprintf(what, sizeof what, "combine k=%d sign=%d normalize=%d n=%lld", k, si, norm, (long long)n);
                lm_combine_how how = how_of(signs[si], norm, 0.8f);
                CHECK_OK(lm_dev_combine(h->cpu, want, base, (const float *const *)t, w, k, n, how, &h->err), &h->err);
                if (DEV_OK(h, lm_dev_combine(h->dev, dout, dbase, (const float *const *)dt, w, k, n, how, &h->err)) &&
                    get(h, got, dout, (size_t)n * 4))
                    check_close(h, ST_COMBINE, what, got, want, n, 1e-5);
                // written out, the NaN bits are the same too
                if (si == 0 && norm == 0 && dbf &&
                    DEV_OK(h, lm_dev_from_f32(h->dev, dbf, LM_DTYPE_BF16, dout, n, &h->err)) &&
                    get(h, got, dbf, (size_t)n * 2) &&
                    DEV_OK(h, lm_dev_from_f32(h->cpu, wbf, LM_DTYPE_BF16, want, n, &h->err)))
                    CHECK_MSG(memcmp(got, wbf, (size_t)n * 2) == 0, "%s written as BF16 differs on %s", what,
                              lm_dev_name(h->dev));
            }
        }
    }
    // in place, as merging calls it: out == base
    snprintf(what, sizeof what, "combine in place n=%lld", (long long)n);
    lm_combine_how sum = how_of(LM_COMBINE_SIGN_SUM, true, 0.8f);
    CHECK_OK(lm_dev_combine(h->cpu, base, base, (const float *const *)t, w, KMAX, n, sum, &h->err), &h->err);
    if (ok && dbase &&
        DEV_OK(h, lm_dev_combine(h->dev, dbase, dbase, (const float *const *)dt, w, KMAX, n, sum, &h->err)) &&
        get(h, got, dbase, (size_t)n * 4))
        check_close(h, ST_COMBINE, what, got, base, n, 1e-5);
    for (int i = 0; i < KMAX; i++) {
        lm_dev_buf_free(h->dev, dt[i]);
        free(t[i]);
    }
    lm_dev_buf_free(h->dev, dbase);
    lm_dev_buf_free(h->dev, dout);
    lm_dev_buf_free(h->dev, dbf);
    free(wbf);
    free(base);
    free(want);
    free(got);
}

// Runs every operation of `dev` through the public interface and compares it with the CPU
// backend: bit for bit where device.h and docs/devices.md promise it (conversions, low-rank
// products, the merge's arithmetic, histograms, masks, the exact forward operations), within
// float32 rounding elsewhere, and bit for bit everywhere on the CPU and the sim.
static void test_against_cpu(lm_dev *dev)
{
    harness h;
    memset(&h, 0, sizeof h);
    h.dev = dev;
    const char *name = lm_dev_name(dev);
    h.identical = strcmp(name, "cpu") == 0 || strncmp(name, "sim:", 4) == 0;
    CHECK_OK(lm_dev_cpu_create(&h.cpu, 2, &h.err), &h.err);
    if (!h.cpu)
        return;
    size_t free0 = 0, total0 = 0, free1 = 0, total1 = 0;
    lm_dev_mem_info(dev, &free0, &total0);

    // sizes that are not multiples of the CPU's 64 Ki blocks, down to one element and none
    const int64_t sizes[] = {70001, 3, 1, 0};
    for (int i = 0; i < (int)(sizeof sizes / sizeof sizes[0]); i++) {
        h_convert(&h, sizes[i]);
        h_axpby(&h, sizes[i]);
        h_delta(&h, sizes[i]);
        h_by_key(&h, sizes[i]);
        h_select(&h, sizes[i]);
        h_combine(&h, sizes[i]);
    }
    h_gemm(&h, 37, 53, 5, 0.5f, 0.0f);
    h_gemm(&h, 130, 70, 17, 0.75f, -0.5f);
    h_gemm(&h, 1, 1, 1, -2.0f, 1.0f);
    h_gemm(&h, 4, 1, 300, 1.0f, 0.25f);
    h_gemm(&h, 300, 1000, LM_DEV_LOWRANK_MAX, 0.5f, 0.0f);  // LoRA's largest rank, many blocks of C
    h_gemm(&h, 3, 2049, 1, -1.5f, 0.75f);
    h_gemm(&h, 70, 90, LM_DEV_LOWRANK_MAX + 1, 1.0f, 0.0f);  // one past: any order
    h_gemm(&h, 5, 7, 0, 2.0f, 0.5f);                        // an empty sum
    if (strncmp(name, "cuda", 4) == 0)  // cuBLAS's syrk, which the Hessian's accumulation uses
        CHECK(lm_dev_supports(dev, LM_OP_SYRK));
    h_syrk(&h, 300, 41, 1.0f, 1.0f);
    h_syrk(&h, 5, 2, 0.5f, 0.0f);
    h_syrk(&h, 70, 0, 1.0f, 0.5f);  // an empty sum: C scaled
    h_syrk(&h, 33, 0, 1.0f, 1.0f);  // nothing to add: mirrored only
    h_row_dot_near(&h, 3, 7001);
    h_row_dot_near(&h, 700, 33);
    h_row_dot_near(&h, 1, 1);
    h_row_dot_near(&h, 0, 5);
    h_row_dot_near(&h, 300, 900);  // della's ranks need more scratch than a device keeps
    h_dora(&h, 3, 23335);
    h_dora(&h, 70, 3);
    h_dora(&h, 1, 1);
    h_potrf(&h, 1);
    h_potrf(&h, 7);
    h_potrf(&h, 200);
    forward_against_cpu(&h);
    CHECK(lm_dev_sync(dev, &h.err) == LM_OK);

    // on the sim, the harness gave back every byte it took
    lm_dev_mem_info(dev, &free1, &total1);
    if (strncmp(name, "sim:", 4) == 0)
        CHECK_MSG(free0 == total0 && free1 == total1 && total0 == total1, "%s: %zu of %zu free before, %zu of %zu "
                  "after", name, free0, total0, free1, total1);
    for (int op = 0; op < ST_COUNT; op++)
        printf("test_against_cpu(%s): %s: %lld of %lld values bit-identical to the CPU's, worst relative error %g\n",
               name, st_names[op], (long long)h.st[op].exact, (long long)h.st[op].compared, h.st[op].worst);
    lm_dev_destroy(h.cpu);
}

// The harness itself: a device that is the CPU but for a GEMM one ulp off in each row's first
// element must fail the check of the low-rank product (exact) and pass the others (rounding).
static const lm_dev_i *cpu_iface;
static const char *ulp_name(lm_dev *d) { (void)d; return "cpu-one-ulp-off"; }
static lm_status ulp_gemm(lm_dev *d, bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float *a,
                          int64_t lda, const float *b, int64_t ldb, float beta, float *c, int64_t ldc, lm_err *err)
{
    lm_status s = cpu_iface->gemm(d, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, err);
    for (int64_t i = 0; s == LM_OK && n > 0 && i < m; i++)
        c[i * ldc] = nextafterf(c[i * ldc], INFINITY);
    return s;
}

static void test_harness_strict(void)
{
    harness h;
    memset(&h, 0, sizeof h);
    CHECK_OK(lm_dev_cpu_create(&h.cpu, 2, &h.err), &h.err);
    if (!h.cpu)
        return;
    cpu_iface = h.cpu->iface;
    lm_dev_i ulp_i = *cpu_iface;
    ulp_i.name = ulp_name;
    ulp_i.gemm = ulp_gemm;
    lm_dev ulp = *h.cpu;
    ulp.iface = &ulp_i;
    h.dev = &ulp;
    int passed = check_passed, failed = check_failed;
    printf("test_harness_strict: one failed check of the low-rank GEMM on %s is expected below\n", ulp_name(&ulp));
    fflush(stdout);
    h_gemm(&h, 1, 53, 5, 0.5f, 0.0f);  // m 1: one row, one check per transposition
    int fails = check_failed - failed;
    check_passed = passed;
    check_failed = failed;
    CHECK_MSG(fails == 1 && h.st[ST_LOWRANK].compared == 53 && h.st[ST_LOWRANK].exact == 52 &&
              h.st[ST_GEMM].exact == 3 * 52, "a GEMM one ulp off: %d checks failed, %lld of %lld low-rank values "
              "exact", fails, (long long)h.st[ST_LOWRANK].exact, (long long)h.st[ST_LOWRANK].compared);
    lm_dev_destroy(h.cpu);
}

// The capability question on each backend, the status that names what is missing, and the CPU
// companion: the CPU's is itself; an accelerator's is one CPU device of its thread count, the
// same on every call, destroyed with it (a leak would fail the sanitizer build).
static void test_supports_and_companion(void)
{
    lm_err err = {0};
    lm_dev *cpu = NULL, *sim = NULL, *c = NULL, *again = NULL;
    CHECK_OK(lm_dev_cpu_create(&cpu, 2, &err), &err);
    CHECK_OK(lm_dev_sim_create(&sim, 1 << 20, NULL, 3, &err), &err);
    if (!cpu || !sim) {
        lm_dev_destroy(cpu);
        lm_dev_destroy(sim);
        return;
    }
    const lm_op all[] = {LM_OP_SYRK, LM_OP_POTRF, LM_OP_IMPORTANCE, LM_OP_DENSE, LM_OP_COUNTS, LM_OP_FORWARD};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) {
        CHECK(lm_dev_supports(cpu, all[i]));
        CHECK_OK(lm_dev_require(cpu, all[i], &err), &err);
    }
    // the sim has every operation but those that read host memory
    CHECK(lm_dev_supports(sim, LM_OP_SYRK) && lm_dev_supports(sim, LM_OP_POTRF) &&
          lm_dev_supports(sim, LM_OP_IMPORTANCE) && lm_dev_supports(sim, LM_OP_FORWARD));
    CHECK(!lm_dev_supports(sim, LM_OP_DENSE) && !lm_dev_supports(sim, LM_OP_COUNTS));
    CHECK_FAILS(lm_dev_require(sim, LM_OP_DENSE, &err), LM_ERR_UNSUPPORTED,
                "sim:1MiB: the operation dense_hist (it needs host memory) is not implemented", &err);
    lm_dev_i lacking = *cpu->iface;
    lacking.potrf = NULL;
    lacking.nll_rows = NULL;
    lm_dev fake = *cpu;
    fake.iface = &lacking;
    CHECK(!lm_dev_supports(&fake, LM_OP_POTRF) && !lm_dev_supports(&fake, LM_OP_FORWARD));
    CHECK(lm_dev_supports(&fake, LM_OP_SYRK));
    CHECK_FAILS(lm_dev_require(&fake, LM_OP_FORWARD, &err), LM_ERR_UNSUPPORTED,
                "cpu: the operation nll_rows is not implemented on this device", &err);

    CHECK_OK(lm_dev_cpu_companion(cpu, &c, &err), &err);
    CHECK(c == cpu);
    c = NULL;
    CHECK_OK(lm_dev_cpu_companion(sim, &c, &err), &err);
    CHECK_OK(lm_dev_cpu_companion(sim, &again, &err), &err);
    CHECK(c && c == again && c != sim);
    if (c) {
        CHECK(strcmp(lm_dev_name(c), "cpu") == 0 && lm_dev_host_memory(c) && lm_dev_threads(c) == lm_dev_threads(sim));
        lm_dev *self = NULL;
        CHECK_OK(lm_dev_cpu_companion(c, &self, &err), &err);
        CHECK(self == c);
        float *buf = NULL;
        CHECK_OK(lm_dev_alloc(c, 64 * sizeof *buf, (void **)&buf, &err), &err);
        lm_dev_buf_free(c, buf);
    }
    lm_dev_destroy(sim);
    lm_dev_destroy(cpu);
}

int main(void)
{
    lm_err err = {0};
    lm_dev *d1 = NULL, *d3 = NULL;
    lm_dev_opts o1 = {.threads = 1}, o3 = {.threads = 3};
    CHECK_OK(lm_dev_open(&d1, "cpu", &o1, NULL, 0, &err), &err);
    CHECK_OK(lm_dev_cpu_create(&d3, 3, &err), &err);
    if (!d1 || !d3)
        return check_report("test_device");
    CHECK(strcmp(lm_dev_name(d1), "cpu") == 0 && lm_dev_threads(d3) == 3 && lm_dev_host_memory(d3));
    size_t fr = 0, tot = 0;
    lm_dev_mem_info(d1, &fr, &tot);
    CHECK(tot > 0 && fr <= tot);
    void *p = NULL;
    CHECK_FAILS(lm_dev_alloc(d1, SIZE_MAX / 2, &p, &err), LM_ERR_NOMEM, "out of memory", &err);
    CHECK(p == NULL);
    lm_dev *none = NULL;
    CHECK_FAILS(lm_dev_open(&none, "tpu", &o3, NULL, 0, &err), LM_ERR_USAGE, "tpu", &err);

    test_elementwise(d1, d3);
    test_gemm(d3);
    test_gemm_tiles(d1, d3);
    test_gemm_narrow(d1, d3);
    test_syrk(d1, d3);
    test_dora(d3);
    test_combine(d1, d3);
    lm_dev_destroy(d1);
    lm_dev_destroy(d3);

    lm_dev *sim = NULL;
    lm_dev_opts os = {.threads = 3};
    CHECK_OK(lm_dev_open(&sim, "sim:1GiB", &os, NULL, 0, &err), &err);
    if (sim)
        test_against_cpu(sim);
    lm_dev_destroy(sim);
    const char *spec = getenv("LLMERGE_TEST_DEVICE");
    if (spec && *spec) {
        lm_dev *dev = NULL;
        char why[256];
        CHECK_OK(lm_dev_open(&dev, spec, &os, why, sizeof why, &err), &err);
        if (dev) {
            printf("LLMERGE_TEST_DEVICE=%s: %s\n", spec, why);
            test_against_cpu(dev);
        }
        lm_dev_destroy(dev);
    }
#ifdef LLMERGE_HAVE_CUDA
    // the CUDA backend's libraries, opened as a device opens them: every function it looks up
    // is there (this machine has the toolkit the build used, if not a GPU)
    CHECK_OK(lm_cuda_load_libs(&err), &err);
#endif
    test_harness_strict();
    test_supports_and_companion();
    return check_report("test_device");
}
