// Tests of dtype names and the float32 conversions. Reference values are computed here
// independently: every 16-bit pattern is decoded with ldexp from its fields, and the correctly
// rounded 16-bit value of a float is found by a binary search over the decoded table in double
// precision (nearest value, ties to the even pattern), never with the code under test.
#include "check.h"
#include "dtype.h"

#include <math.h>
#include <stdint.h>

static double decode16(uint16_t h, int exp_bits, int man_bits)
{
    int bias = (1 << (exp_bits - 1)) - 1;
    int sign = h >> 15;
    int e = (h >> man_bits) & ((1 << exp_bits) - 1);
    int m = h & ((1 << man_bits) - 1);
    double v;
    if (e == (1 << exp_bits) - 1)
        v = m ? NAN : INFINITY;
    else if (e == 0)
        v = ldexp((double)m, 1 - bias - man_bits);
    else
        v = ldexp((double)((1 << man_bits) | m), e - bias - man_bits);
    return sign ? -v : v;
}

// The correctly rounded pattern of x (finite or not) in a 16-bit format, by search.
static uint16_t round16(double x, const double *table /* positive finite patterns, ascending */,
                        int n_finite, uint16_t inf_bits)
{
    if (isnan(x))
        return 0xFFFF;  // caller only checks that the result is a NaN
    uint16_t sign = signbit(x) ? 0x8000 : 0;
    double a = fabs(x);
    double max = table[n_finite - 1], next = max + (max - table[n_finite - 2]);
    if (a >= (max + next) / 2)
        return sign | inf_bits;
    int lo = 0, hi = n_finite - 1;  // table[lo] <= a < table[hi] after the search
    while (hi - lo > 1) {
        int mid = (lo + hi) / 2;
        if (table[mid] <= a) lo = mid; else hi = mid;
    }
    if (a >= table[hi]) lo = hi;
    int pick = lo;
    if (lo + 1 < n_finite && a > table[lo]) {
        double dl = a - table[lo], dh = table[lo + 1] - a;
        if (dh < dl || (dh == dl && ((lo + 1) & 1) == 0))
            pick = lo + 1;
    }
    return sign | (uint16_t)pick;
}

static double f16_table[0x7C00], bf16_table[0x7F80];

static void check_float(float f, int *bad_f16, int *bad_bf16)
{
    uint16_t want = round16(f, f16_table, 0x7C00, 0x7C00);
    uint16_t got = lm_f32_to_f16(f);
    if (isnan(f) ? !isnan(lm_f16_to_f32(got)) : got != want) {
        if ((*bad_f16)++ < 5)
            fprintf(stderr, "f16(%a): got %04x want %04x\n", (double)f, got, want);
    }
    want = round16(f, bf16_table, 0x7F80, 0x7F80);
    got = lm_f32_to_bf16(f);
    if (isnan(f) ? !isnan(lm_bf16_to_f32(got)) : got != want) {
        if ((*bad_bf16)++ < 5)
            fprintf(stderr, "bf16(%a): got %04x want %04x\n", (double)f, got, want);
    }
}

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static uint64_t rng(void)
{
    uint64_t z = (rng_state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// The NaN and Inf the counting conversions add, against isnan/isinf of the values, on more
// elements than one of their runs holds: NaN of every kind, ±Inf, finite floats that round to
// Inf in F16 or BF16, F64 values beyond float32's range. Their values equal the plain
// conversions' bit for bit, and lm_count_nonfinite counts as they do.
static void count_values(const float *x, int64_t n, uint64_t *nan, uint64_t *inf)
{
    *nan = *inf = 0;
    for (int64_t i = 0; i < n; i++) {
        *nan += isnan(x[i]) != 0;
        *inf += isinf(x[i]) != 0;
    }
}

static void test_counts(void)
{
    enum { M = (1 << 20) + 4099 };
    float *x = malloc(M * sizeof *x), *a = malloc(M * sizeof *a), *b = malloc(M * sizeof *b);
    double *wide = malloc(M * sizeof *wide);
    unsigned char *raw = malloc(8 * (size_t)M + 1), *plain = malloc(8 * (size_t)M + 1);
    const float odd[] = {NAN, -NAN, lm_bits_f32(0x7F800001u), lm_bits_f32(0xFFC01234u), INFINITY, -INFINITY,
                         70000.0f, -65520.0f, 3.4028235e38f, -3.39e38f};
    for (int64_t i = 0; i < M; i++) {
        x[i] = (float)((double)(int64_t)rng() / 9.2e18 * 100.0);
        if (rng() % 97 == 0)
            x[i] = odd[rng() % (sizeof odd / sizeof odd[0])];
        wide[i] = rng() % 101 == 0 ? (rng() % 2 ? 1e300 : -1e39) : (double)x[i];
    }
    lm_err err = {0};
    const lm_dtype kinds[] = {LM_DTYPE_F32, LM_DTYPE_BF16, LM_DTYPE_F16};
    int bad = 0;
    for (size_t k = 0; k < 3; k++) {
        lm_dtype dt = kinds[k];
        size_t es = lm_dtype_bits(dt) / 8;
        // from float32: the values written, as the plain conversion writes them
        lm_nonfinite nf = {7, 9};  // added to, not overwritten
        CHECK_OK(lm_convert_from_f32_nf(raw + 1, dt, x, M, &nf, &err), &err);
        CHECK_OK(lm_convert_from_f32(plain, dt, x, M, &err), &err);
        bad += memcmp(raw + 1, plain, es * M) != 0;
        CHECK_OK(lm_convert_to_f32(a, plain, dt, M, &err), &err);
        uint64_t nan, inf;
        count_values(a, M, &nan, &inf);
        CHECK_MSG(nf.nan == nan + 7 && nf.inf == inf + 9 && nan > 0 && inf > 0,
                  "from f32 to %s: counted %llu NaN, %llu Inf; there are %llu, %llu", lm_dtype_name(dt),
                  (unsigned long long)nf.nan - 7, (unsigned long long)nf.inf - 9, (unsigned long long)nan,
                  (unsigned long long)inf);
        // to float32, from a misaligned source
        nf = (lm_nonfinite){0, 0};
        CHECK_OK(lm_convert_to_f32_nf(b, raw + 1, dt, M, &nf, &err), &err);
        bad += memcmp(a, b, M * sizeof *a) != 0;
        CHECK(nf.nan == nan && nf.inf == inf);
        nf = (lm_nonfinite){0, 0};
        lm_count_nonfinite(raw + 1, dt, M, &nf);
        CHECK(nf.nan == nan && nf.inf == inf);
    }
    // F64: values beyond float32's range are the Inf they become
    lm_nonfinite nf = {0, 0}, raw_nf = {0, 0};
    CHECK_OK(lm_convert_to_f32_nf(a, wide, LM_DTYPE_F64, M, &nf, &err), &err);
    lm_count_nonfinite(wide, LM_DTYPE_F64, M, &raw_nf);
    uint64_t nan, inf;
    count_values(a, M, &nan, &inf);
    CHECK(nf.nan == nan && nf.inf == inf && raw_nf.nan == nan && raw_nf.inf == inf && inf > 0);
    // dtypes that are not floats are not counted; an unreadable one is still an error
    nf = (lm_nonfinite){0, 0};
    lm_count_nonfinite(raw, LM_DTYPE_I32, 100, &nf);
    CHECK(nf.nan == 0 && nf.inf == 0);
    CHECK_FAILS(lm_convert_to_f32_nf(a, raw, LM_DTYPE_I32, 100, &nf, &err), LM_ERR_UNSUPPORTED, "I32", &err);
    CHECK_FAILS(lm_convert_from_f32_nf(raw, LM_DTYPE_F64, a, 100, &nf, &err), LM_ERR_UNSUPPORTED, "F64", &err);
    CHECK_MSG(bad == 0, "%d counting conversions differ from the plain ones", bad);
    free(x);
    free(a);
    free(b);
    free(wide);
    free(raw);
    free(plain);
}

// NaN: whatever its sign and payload, quiet or signalling, a NaN is written as the canonical
// quiet NaN (0x7FC00000, 0x7E00, 0x7FC0) by the scalar conversions and by the bulk ones into
// every writable dtype, misaligned, counting or not, and in place for F32; the values around
// the NaNs (Inf, the largest finite, zeros of both signs) are untouched. Reading keeps a 16-bit
// NaN's sign and payload.
static void test_nan_bits(void)
{
    static const uint32_t nans[] = {0x7FC00000u, 0xFFC00000u, 0x7F800001u, 0xFF800001u, 0x7FC01234u, 0xFFFFFFFFu,
                                    0x7FFFFFFFu, 0xFFA5A5A5u, 0x7FBFFFFFu};
    enum { NN = sizeof nans / sizeof nans[0], M = 3 * NN + 5 };
    int bad = 0;
    for (int i = 0; i < NN; i++) {
        float f = lm_bits_f32(nans[i]);
        bad += lm_f32_to_bf16(f) != 0x7FC0 || lm_f32_to_f16(f) != 0x7E00 ||
               lm_f32_bits(lm_f32_canonical(f)) != 0x7FC00000u;
    }
    CHECK_MSG(bad == 0, "%d NaNs not converted to the canonical NaN", bad);
    CHECK(lm_f32_to_f16(-INFINITY) == 0xFC00 && lm_f32_to_bf16(-INFINITY) == 0xFF80 &&
          lm_f32_bits(lm_f32_canonical(-INFINITY)) == 0xFF800000u && lm_f32_to_f16(-0.0f) == 0x8000 &&
          lm_f32_bits(lm_f32_canonical(-0.0f)) == 0x80000000u);
    CHECK(LM_F32_NAN == 0x7FC00000u && LM_F16_NAN == 0x7E00u && LM_BF16_NAN == 0x7FC0u);
    // reading keeps the bits: sign and payload of F16 and BF16 NaNs
    CHECK(lm_f32_bits(lm_bf16_to_f32(0xFFC1)) == 0xFFC10000u && lm_f32_bits(lm_bf16_to_f32(0x7F81)) == 0x7F810000u);
    CHECK(lm_f32_bits(lm_f16_to_f32(0xFE01)) == 0xFFC02000u && lm_f32_bits(lm_f16_to_f32(0x7C01)) == 0x7F802000u);

    // the bulk conversions: NaNs between other values
    float src[M], in_place[M];
    static const float others[] = {INFINITY, -INFINITY, 3.4028235e38f, -0.0f, 0.0f, 1.5f, -1e-40f};
    int n_nan = 0;
    for (int i = 0; i < M; i++) {
        src[i] = i % 3 == 1 ? lm_bits_f32(nans[(i / 3) % NN]) : others[i % 7];
        n_nan += isnan(src[i]) != 0;
    }
    lm_err err = {0};
    const lm_dtype kinds[] = {LM_DTYPE_F32, LM_DTYPE_F16, LM_DTYPE_BF16};
    for (int k = 0; k < 3; k++) {
        size_t es = lm_dtype_bits(kinds[k]) / 8;
        unsigned char raw[4 * M + 1], raw_nf[4 * M + 1];
        lm_nonfinite nf = {0, 0};
        CHECK_OK(lm_convert_from_f32(raw + 1, kinds[k], src, M, &err), &err);
        CHECK_OK(lm_convert_from_f32_nf(raw_nf + 1, kinds[k], src, M, &nf, &err), &err);
        int wrong = 0;
        for (int i = 0; i < M; i++) {
            uint32_t got = 0, want;
            memcpy(&got, raw + 1 + es * (size_t)i, es);
            if (kinds[k] == LM_DTYPE_F32)
                want = isnan(src[i]) ? 0x7FC00000u : lm_f32_bits(src[i]);
            else if (kinds[k] == LM_DTYPE_F16)
                want = isnan(src[i]) ? 0x7E00u : lm_f32_to_f16(src[i]);
            else
                want = isnan(src[i]) ? 0x7FC0u : lm_f32_to_bf16(src[i]);
            wrong += got != want;
        }
        CHECK_MSG(wrong == 0 && memcmp(raw + 1, raw_nf + 1, es * M) == 0 && nf.nan == (uint64_t)n_nan,
                  "from f32 to %s: %d values wrong, %llu NaN counted of %d", lm_dtype_name(kinds[k]), wrong,
                  (unsigned long long)nf.nan, n_nan);
    }
    memcpy(in_place, src, sizeof src);
    CHECK_OK(lm_convert_from_f32(in_place, LM_DTYPE_F32, in_place, M, &err), &err);
    bad = 0;
    for (int i = 0; i < M; i++)
        bad += lm_f32_bits(in_place[i]) != (isnan(src[i]) ? 0x7FC00000u : lm_f32_bits(src[i]));
    CHECK_MSG(bad == 0, "from f32 to F32 in place: %d values wrong", bad);
}

int main(void)
{
    // Names round-trip and sizes.
    for (int i = 0; i < LM_DTYPE_COUNT; i++) {
        lm_dtype dt;
        const char *n = lm_dtype_name((lm_dtype)i);
        CHECK(lm_dtype_from_name(n, strlen(n), &dt) && dt == (lm_dtype)i);
    }
    lm_dtype dt;
    CHECK(!lm_dtype_from_name("F128", 4, &dt));
    CHECK(lm_dtype_bits(LM_DTYPE_BF16) == 16 && lm_dtype_bits(LM_DTYPE_F4) == 4 &&
          lm_dtype_bits(LM_DTYPE_F64) == 64 && lm_dtype_bits(LM_DTYPE_BOOL) == 8);
    CHECK(lm_dtype_from_user("bfloat16", &dt) && dt == LM_DTYPE_BF16);
    CHECK(lm_dtype_from_user("torch.float16", &dt) && dt == LM_DTYPE_F16);
    CHECK(lm_dtype_from_user("f32", &dt) && dt == LM_DTYPE_F32);
    CHECK(!lm_dtype_from_user("int8", &dt));

    // Every 16-bit pattern decodes to the independently computed value (NaN stays NaN, the
    // sign of zero kept).
    int bad = 0;
    for (uint32_t h = 0; h < 0x10000; h++) {
        double want = decode16((uint16_t)h, 5, 10);
        float got = lm_f16_to_f32((uint16_t)h);
        if (isnan(want) ? !isnan(got) : ((double)got != want || !signbit(got) != !signbit(want)))
            bad++;
        want = decode16((uint16_t)h, 8, 7);
        got = lm_bf16_to_f32((uint16_t)h);
        if (isnan(want) ? !isnan(got) : ((double)got != want || !signbit(got) != !signbit(want)))
            bad++;
    }
    CHECK_MSG(bad == 0, "%d 16-bit patterns decoded wrongly", bad);

    for (int i = 0; i < 0x7C00; i++)
        f16_table[i] = decode16((uint16_t)i, 5, 10);
    for (int i = 0; i < 0x7F80; i++)
        bf16_table[i] = decode16((uint16_t)i, 8, 7);

    // Rounding: exact values, exact midpoints (ties to even), one float ulp either side of
    // each midpoint, specials and random floats over the whole range.
    int bad16 = 0, badbf = 0;
    for (int i = 0; i + 1 < 0x7C00; i++) {
        double mid = (f16_table[i] + f16_table[i + 1]) / 2;
        float m = (float)mid;  // midpoints of f16 values are exact in float
        check_float((float)f16_table[i], &bad16, &badbf);
        check_float(m, &bad16, &badbf);
        check_float(nextafterf(m, 0), &bad16, &badbf);
        check_float(nextafterf(m, INFINITY), &bad16, &badbf);
        check_float(-m, &bad16, &badbf);
    }
    for (int i = 0; i + 1 < 0x7F80; i++) {
        float m = (float)((bf16_table[i] + bf16_table[i + 1]) / 2);
        check_float(m, &bad16, &badbf);
        check_float(nextafterf(m, 0), &bad16, &badbf);
        check_float(nextafterf(m, INFINITY), &bad16, &badbf);
        check_float(-m, &bad16, &badbf);
    }
    const float specials[] = {0.0f, -0.0f, INFINITY, -INFINITY, NAN, -NAN, 65504.0f, 65519.99f,
                              65520.0f, 65536.0f, 1e-8f, 5.9604645e-8f, 2.9802322e-8f, 2.9802326e-8f,
                              6.1035156e-5f, 3.3895314e38f, 3.3961776e38f, 3.4028235e38f, 1e-45f, 1.1754942e-38f};
    for (size_t i = 0; i < sizeof specials / sizeof specials[0]; i++)
        check_float(specials[i], &bad16, &badbf);
    for (int i = 0; i < 200000; i++) {
        uint32_t u = (uint32_t)rng();
        float f = lm_bits_f32(u);
        check_float(f, &bad16, &badbf);
    }
    CHECK_MSG(bad16 == 0, "%d floats rounded to F16 wrongly", bad16);
    CHECK_MSG(badbf == 0, "%d floats rounded to BF16 wrongly", badbf);
    CHECK(lm_f32_to_f16(65520.0f) == 0x7C00);
    CHECK(lm_f32_to_f16(65519.99f) == 0x7BFF);
    CHECK(lm_f32_to_bf16(1.0f + 0x1p-8f) == 0x3F80);          // tie, even stays
    CHECK(lm_f32_to_bf16(1.0f + 0x1p-7f + 0x1p-8f) == 0x3F82); // tie, odd rounds up
    test_nan_bits();

    // Bulk conversions at odd alignments agree with the scalar ones.
    enum { N = 1027 };
    float src[N], back[N];
    unsigned char raw[2 * N + 8 + 1];
    for (int i = 0; i < N; i++)
        src[i] = (float)((double)(int64_t)rng() / 9.2e18 * 1000.0);
    lm_err err = {0};
    lm_dtype kinds[] = {LM_DTYPE_BF16, LM_DTYPE_F16, LM_DTYPE_F32};
    for (size_t k = 0; k < 3; k++) {
        unsigned char *p = raw + 1;  // deliberately misaligned
        CHECK_OK(lm_convert_from_f32(p, kinds[k], src, N < 500 ? N : 500, &err), &err);
        CHECK_OK(lm_convert_to_f32(back, p, kinds[k], 500, &err), &err);
        int mismatch = 0;
        for (int i = 0; i < 500; i++) {
            float want = kinds[k] == LM_DTYPE_BF16 ? lm_bf16_to_f32(lm_f32_to_bf16(src[i]))
                       : kinds[k] == LM_DTYPE_F16  ? lm_f16_to_f32(lm_f32_to_f16(src[i]))
                                                   : src[i];
            mismatch += back[i] != want;
        }
        CHECK_MSG(mismatch == 0, "%s bulk round trip: %d mismatches", lm_dtype_name(kinds[k]), mismatch);
    }
    // The bulk loops (built with their own optimisation flags) agree bit for bit with the
    // scalar conversions on every 16-bit pattern and on random float bits.
    {
        enum { M = 65536 };
        uint16_t *pat = malloc(M * sizeof *pat), *out16 = malloc(M * sizeof *out16);
        float *wide = malloc(M * sizeof *wide);
        int diff = 0;
        for (int i = 0; i < M; i++)
            pat[i] = (uint16_t)i;
        for (size_t k = 0; k < 2; k++) {
            lm_dtype kd = k ? LM_DTYPE_F16 : LM_DTYPE_BF16;
            CHECK_OK(lm_convert_to_f32(wide, pat, kd, M, &err), &err);
            for (int i = 0; i < M; i++) {
                float want = k ? lm_f16_to_f32(pat[i]) : lm_bf16_to_f32(pat[i]);
                diff += lm_f32_bits(wide[i]) != lm_f32_bits(want);
            }
            for (int i = 0; i < M; i++)
                wide[i] = lm_bits_f32((uint32_t)rng());
            CHECK_OK(lm_convert_from_f32(out16, kd, wide, M, &err), &err);
            for (int i = 0; i < M; i++)
                diff += out16[i] != (k ? lm_f32_to_f16(wide[i]) : lm_f32_to_bf16(wide[i]));
        }
        CHECK_MSG(diff == 0, "%d bulk conversions differ from the scalar ones", diff);
        free(pat);
        free(out16);
        free(wide);
    }
    double d[3] = {1.0 / 3.0, -1e300, 1e-50};
    float df[3];
    CHECK_OK(lm_convert_to_f32(df, d, LM_DTYPE_F64, 3, &err), &err);
    CHECK(df[0] == (float)(1.0 / 3.0) && isinf(df[1]) && df[1] < 0 && df[2] == 0.0f);
    CHECK_FAILS(lm_convert_to_f32(df, d, LM_DTYPE_I64, 1, &err), LM_ERR_UNSUPPORTED, "I64", &err);
    CHECK_FAILS(lm_convert_from_f32(d, LM_DTYPE_F64, df, 1, &err), LM_ERR_UNSUPPORTED, "F64", &err);
    test_counts();
    return check_report("test_dtype");
}
