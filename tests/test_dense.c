// Tests of the fused dense operations (lm_dev_dense_hist, lm_dev_dense_merge, lm_dev_dense_gram)
// on the CPU backend, with τ computed from the inputs, made from LoRA factors, or (merge) given in
// buffers: each must give bit for bit what the separate operations it replaces give
// (conversion, delta or GEMM, hist_window, topk_apply or random_drop, axpby, combine,
// conversion back), with 1 and with 3 threads, on inputs full of ties at the threshold (16-bit
// fine-tuned values a few steps from the base's, LoRA factors of a few binary digits) in every
// readable input dtype and every output dtype, over several work blocks with a ragged end and
// from an offset into the tensor. The CPU's GEMM of low rank, which the LoRA parts must match,
// is checked against the fused multiply-add chain it promises.
#include "check.h"
#include "dot_ref.h"
#include "device.h"
#include "merge_desc.h"
#include "sparsify.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

enum { N = 300007, K = 3 };

// lm_dev_combine's rule: election, normalisation and lambda.
static lm_combine_how how_of(lm_combine_sign sign, bool normalize, float lambda)
{
    return (lm_combine_how){.sign = sign, .normalize = normalize, .lambda = lambda};
}

static uint64_t state = 11;
static uint64_t next(void)
{
    return lm_mix64(state += 0x9E3779B97F4A7C15ull);
}

// Inputs: the base in BF16, part 0 in BF16, part 1 in F16, part 2 in F32. Each fine-tuned
// value is its base value plus a small whole number of steps of 2⁻⁸ (a quarter of them
// unchanged), so τ takes few distinct values and ties at any threshold are many.
typedef struct inputs {
    uint16_t *base;
    void *src[K];
    lm_dtype dt[K];
} inputs;

static void make_inputs(inputs *in)
{
    in->base = malloc(N * sizeof *in->base);
    in->dt[0] = LM_DTYPE_BF16;
    in->dt[1] = LM_DTYPE_F16;
    in->dt[2] = LM_DTYPE_F32;
    for (int i = 0; i < K; i++)
        in->src[i] = malloc((size_t)N * (lm_dtype_bits(in->dt[i]) / 8));
    for (int64_t j = 0; j < N; j++) {
        float b = (float)((int64_t)(next() % 2001) - 1000) / 512.0f;
        in->base[j] = lm_f32_to_bf16(b);
        float bv = lm_bf16_to_f32(in->base[j]);
        for (int i = 0; i < K; i++) {
            int steps = (int)(next() % 9) - 4;
            float v = bv + (next() % 4 == 0 ? 0.0f : (float)steps / 256.0f);
            if (in->dt[i] == LM_DTYPE_BF16)
                ((uint16_t *)in->src[i])[j] = lm_f32_to_bf16(v);
            else if (in->dt[i] == LM_DTYPE_F16)
                ((uint16_t *)in->src[i])[j] = lm_f32_to_f16(v);
            else
                ((float *)in->src[i])[j] = v;
        }
    }
}

static void free_inputs(inputs *in)
{
    free(in->base);
    for (int i = 0; i < K; i++)
        free(in->src[i]);
}

static const void *at(const void *p, lm_dtype dt, int64_t j)
{
    return (const char *)p + (size_t)j * (lm_dtype_bits(dt) / 8);
}

// τ of every part over [first, first + n) with the separate operations.
static void taus(lm_dev *d, const inputs *in, int64_t first, int64_t n, float *b, float **t)
{
    lm_err err = {0};
    CHECK_OK(lm_dev_to_f32(d, b, in->base + first, LM_DTYPE_BF16, n, &err), &err);
    for (int i = 0; i < K; i++)
        CHECK_OK(lm_dev_delta(d, t[i], at(in->src[i], in->dt[i], first), in->dt[i], b, n, &err), &err);
}

static void test_hist(lm_dev *d, const inputs *in)
{
    lm_err err = {0};
    float *b = malloc(N * sizeof *b), *t[K];
    for (int i = 0; i < K; i++)
        t[i] = malloc(N * sizeof *t[i]);
    taus(d, in, 0, N, b, t);
    // Windows placed around the top 16 bits of a value of each τ; part 1 not counted.
    uint64_t above[K] = {0}, want_above[K] = {0};
    uint64_t *win[K], *want_win[K];
    lm_dense_part parts[K];
    for (int i = 0; i < K; i++) {
        win[i] = calloc((size_t)LM_HIST_WINDOW * LM_HIST_BINS, sizeof(uint64_t));
        want_win[i] = calloc((size_t)LM_HIST_WINDOW * LM_HIST_BINS, sizeof(uint64_t));
        uint32_t lo = lm_abs_bits(t[i][1234 + i]) >> 16;
        parts[i] = (lm_dense_part){.src = in->src[i], .dt = in->dt[i], .above = &above[i], .win = win[i],
                                  .lo_bin = lo > 1 ? lo - 1 : 0, .n_win = i == 2 ? LM_HIST_WINDOW : 4};
        if (i != 1)
            CHECK_OK(lm_dev_hist_window(d, &want_above[i], want_win[i], parts[i].n_win, parts[i].lo_bin, t[i], N,
                                        &err),
                     &err);
    }
    parts[1].win = NULL;
    // twice: the counts add up, as lm_dev_hist_window's do
    for (int rep = 0; rep < 2; rep++)
        CHECK_OK(lm_dev_dense_hist(d, in->base, LM_DTYPE_BF16, parts, K, N, &err), &err);
    for (int i = 0; i < K; i++) {
        size_t cells = (size_t)LM_HIST_WINDOW * LM_HIST_BINS;
        int64_t bad = 0, counted = 0;
        for (size_t c = 0; c < cells; c++) {
            bad += win[i][c] != 2 * want_win[i][c];
            counted += (int64_t)want_win[i][c];
        }
        CHECK_MSG(bad == 0 && above[i] == 2 * want_above[i], "part %d: %lld cells differ, above %llu vs %llu", i,
                  (long long)bad, (unsigned long long)above[i], (unsigned long long)want_above[i]);
        if (i != 1)  // the window holds values, so the comparison is not of zeros only
            CHECK_MSG(counted > 1000, "part %d: %lld values in the window", i, (long long)counted);
        free(win[i]);
        free(want_win[i]);
    }
    // One part counted twice in a call (breadcrumbs' two thresholds), with windows at two places:
    // each copy's counts are its own window's.
    uint64_t above2[2] = {0}, want2[2] = {0}, *win2[2], *want_win2[2];
    lm_dense_part twice[2];
    for (int q = 0; q < 2; q++) {
        win2[q] = calloc((size_t)LM_HIST_WINDOW * LM_HIST_BINS, sizeof(uint64_t));
        want_win2[q] = calloc((size_t)LM_HIST_WINDOW * LM_HIST_BINS, sizeof(uint64_t));
        uint32_t lo = lm_abs_bits(t[0][q ? 99 : 1234]) >> 16;
        twice[q] = (lm_dense_part){.src = in->src[0], .dt = in->dt[0], .above = &above2[q], .win = win2[q],
                                   .lo_bin = lo > 1 ? lo - 1 : 0, .n_win = 4};
        CHECK_OK(lm_dev_hist_window(d, &want2[q], want_win2[q], 4, twice[q].lo_bin, t[0], N, &err), &err);
    }
    CHECK(twice[0].lo_bin != twice[1].lo_bin);
    CHECK_OK(lm_dev_dense_hist(d, in->base, LM_DTYPE_BF16, twice, 2, N, &err), &err);
    for (int q = 0; q < 2; q++) {
        CHECK_MSG(memcmp(win2[q], want_win2[q], (size_t)LM_HIST_WINDOW * LM_HIST_BINS * sizeof(uint64_t)) == 0 &&
                      above2[q] == want2[q],
                  "part 0 counted twice: copy %d's counts differ", q);
        free(win2[q]);
        free(want_win2[q]);
    }
    free(b);
    for (int i = 0; i < K; i++)
        free(t[i]);
}

typedef struct merge_case {
    const char *name;
    bool trim, drop, linear;
    int64_t ties[K];  // ties_allowed per part (trim)
    float rescale;
    lm_combine_sign sign;
    bool normalize;
    float lambda;
    lm_dtype out_dt;
    bool band;           // then the top k' dropped (breadcrumbs): band_hi's thresholds,
    int64_t hi_ties[K];  // these ties dropped per part
} merge_case;

// The band's thresholds (test_merge sets them): part 0's the trim's own, part 1's above it.
static uint32_t band_hi[K];

// The separate operations' result over [first, first + n) in out_dt, and the ties each part used
// (used[i]: the trim kept; used[K + i]: the band dropped, with c->band; 2K values).
static void merge_separate(lm_dev *d, const inputs *in, const merge_case *c, const uint32_t *thr, int64_t first,
                           int64_t n, void *out, int64_t *used)
{
    lm_err err = {0};
    float *b = malloc((size_t)n * sizeof *b), *t[K], w[K] = {1.0f, 0.5f, 2.0f};
    for (int i = 0; i < K; i++)
        t[i] = malloc((size_t)n * sizeof *t[i]);
    taus(d, in, first, n, b, t);
    for (int i = 0; i < K; i++) {
        used[i] = 0;
        if (c->trim)
            CHECK_OK(lm_dev_topk_apply(d, t[i], n, thr[i], c->ties[i], &used[i], &err), &err);
        if (c->band) {
            int64_t dropped = 0;
            CHECK_OK(lm_dev_topk_drop(d, t[i], n, band_hi[i], c->hi_ties[i], &dropped, &err), &err);
            used[K + i] = dropped;
        }
        if (c->drop)
            CHECK_OK(lm_dev_random_drop(d, t[i], n, 1000 + (uint64_t)i, first, lm_rng_threshold(0.3), &err), &err);
        if (c->rescale != 1.0f)
            CHECK_OK(lm_dev_axpby(d, t[i], c->rescale, t[i], 0.0f, n, &err), &err);
    }
    if (c->linear) {
        for (int i = 0; i < K; i++)
            CHECK_OK(lm_dev_axpby(d, b, 1.0f, t[i], w[i], n, &err), &err);
    } else {
        const float *tp[K] = {t[0], t[1], t[2]};
        CHECK_OK(lm_dev_combine(d, b, b, tp, w, K, n, how_of(c->sign, c->normalize, c->lambda), &err), &err);
    }
    CHECK_OK(lm_dev_from_f32(d, out, c->out_dt, b, n, &err), &err);
    free(b);
    for (int i = 0; i < K; i++)
        free(t[i]);
}

// The fused operation over [first, first + n): τ computed from the inputs, or (from_buf) given
// in buffers, as a LoRA product's is.
static void merge_fused(lm_dev *d, const inputs *in, const merge_case *c, const uint32_t *thr, int64_t first,
                        int64_t n, void *out, int64_t *used, bool from_buf)
{
    lm_err err = {0};
    float w[K] = {1.0f, 0.5f, 2.0f}, *b = malloc((size_t)n * sizeof *b), *t[K];
    for (int i = 0; i < K; i++)
        t[i] = malloc((size_t)n * sizeof *t[i]);
    if (from_buf)
        taus(d, in, first, n, b, t);
    lm_dense_part parts[K];
    for (int i = 0; i < K; i++)
        parts[i] = (lm_dense_part){.src = from_buf ? NULL : at(in->src[i], in->dt[i], first), .dt = in->dt[i],
                                  .tau = from_buf ? t[i] : NULL, .trim = c->trim,
                                  .thr_bits = thr[i], .ties_allowed = c->ties[i], .drop = c->drop,
                                  .key = 1000 + (uint64_t)i, .keep_below = lm_rng_threshold(0.3), .first = first,
                                  .rescale = c->rescale, .weight = w[i], .band = c->band, .hi_bits = band_hi[i],
                                  .hi_allowed = c->band ? c->hi_ties[i] : 0};
    lm_combine_how how = {.sign = c->sign, .normalize = c->normalize, .lambda = c->lambda, .linear = c->linear};
    CHECK_OK(lm_dev_dense_merge(d, out, c->out_dt, in->base + first, LM_DTYPE_BF16, parts, K, n, how, &err), &err);
    for (int i = 0; i < K; i++) {
        used[i] = parts[i].ties_used;
        used[K + i] = c->band ? parts[i].hi_used : 0;
        free(t[i]);
    }
    free(b);
}

static void test_merge(lm_dev *d1, lm_dev *d3, const inputs *in)
{
    // Thresholds at values τ takes often: the magnitude bits of 2, 3 and 1 steps (part 2's
    // at 0xFFFFFFFF in one case: nothing kept).
    uint32_t thr[K], none[K];
    for (int i = 0; i < K; i++) {
        thr[i] = lm_abs_bits((float)(i == 2 ? 1 : i + 2) / 256.0f);
        none[i] = i == 2 ? 0xFFFFFFFFu : thr[i];
    }
    int64_t all = LM_TIES_ALL;
    for (int i = 0; i < K; i++)
        band_hi[i] = i == 0 ? thr[0] : lm_abs_bits((float)(i == 1 ? 4 : 2) / 256.0f);
    const merge_case cases[] = {
        {"ties sum, some ties of each", true, false, false, {5000, 20000, 12345}, 1.0f, LM_COMBINE_SIGN_SUM, true, 1.0f,
         LM_DTYPE_BF16, false, {0}},
        {"ties count, all / none / some", true, false, false, {all, 0, 77}, 1.0f, LM_COMBINE_SIGN_COUNT, false, 0.7f,
         LM_DTYPE_F16, false, {0}},
        {"ties, a budget larger than the ties", true, false, false, {1 << 30, 3, all}, 1.0f, LM_COMBINE_SIGN_SUM, true,
         1.3f, LM_DTYPE_F32, false, {0}},
        {"dare-ties, rescaled", false, true, false, {0}, 1.0f / 0.3f, LM_COMBINE_SIGN_SUM, true, 1.0f, LM_DTYPE_BF16,
         false, {0}},
        {"dare, no election", false, true, false, {0}, 1.0f / 0.3f, LM_COMBINE_SIGN_NONE, false, 1.0f, LM_DTYPE_BF16,
         false, {0}},
        {"task arithmetic", false, false, true, {0}, 1.0f, LM_COMBINE_SIGN_NONE, false, 1.0f, LM_DTYPE_BF16, false,
         {0}},
        {"disjoint mean, no trim", false, false, false, {0}, 1.0f, LM_COMBINE_SIGN_SUM, true, 1.0f, LM_DTYPE_F32, false,
         {0}},
        // breadcrumbs' band: part 0's top at the trim's own threshold (the drop counts a prefix
        // of the ties the trim keeps), part 1's above it, part 2's ties all dropped
        {"band, sum election", true, false, false, {5000, 20000, 12345}, 1.0f, LM_COMBINE_SIGN_SUM, true, 1.0f,
         LM_DTYPE_BF16, true, {2000, 777, all}},
        {"band, no election, none of part 1's ties dropped", true, false, false, {9000, all, 100}, 1.0f,
         LM_COMBINE_SIGN_NONE, false, 1.0f, LM_DTYPE_F32, true, {8999, 0, all}},
    };
    const int64_t firsts[] = {0, 70001};
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
        const merge_case *c = &cases[ci];
        for (int fi = 0; fi < 2; fi++) {
            int64_t first = firsts[fi], n = N - first;
            size_t bytes = (size_t)n * (lm_dtype_bits(c->out_dt) / 8);
            void *want = malloc(bytes), *got1 = malloc(bytes), *got3 = malloc(bytes);
            int64_t used_want[2 * K], used1[2 * K], used3[2 * K];
            const uint32_t *th = ci == 1 ? none : thr;
            merge_separate(d1, in, c, th, first, n, want, used_want);
            for (int from_buf = 0; from_buf < 2; from_buf++) {
                merge_fused(d1, in, c, th, first, n, got1, used1, from_buf);
                merge_fused(d3, in, c, th, first, n, got3, used3, from_buf);
                CHECK_MSG(memcmp(want, got1, bytes) == 0,
                          "%s from %lld (tau %s): 1 thread differs from the separate operations", c->name,
                          (long long)first, from_buf ? "given" : "computed");
                CHECK_MSG(memcmp(want, got3, bytes) == 0,
                          "%s from %lld (tau %s): 3 threads differ from the separate operations", c->name,
                          (long long)first, from_buf ? "given" : "computed");
                for (int i = 0; i < (c->band ? 2 * K : K); i++)
                    CHECK_MSG(used1[i] == used_want[i] && used3[i] == used_want[i],
                              "%s part %d: ties used %lld, %lld, wanted %lld", c->name, i, (long long)used1[i],
                              (long long)used3[i], (long long)used_want[i]);
            }
            // The partial budgets run out inside the range: the cases test the counted path.
            if (ci == 0)
                for (int i = 0; i < K; i++)
                    CHECK_MSG(used_want[i] == c->ties[i], "part %d used %lld of %lld ties", i,
                              (long long)used_want[i], (long long)c->ties[i]);
            if (ci == 7)  // and the band's drop runs out inside it too
                for (int i = 0; i < 2; i++)
                    CHECK_MSG(used_want[K + i] == c->hi_ties[i], "band: part %d dropped %lld of %lld ties", i,
                              (long long)used_want[K + i], (long long)c->hi_ties[i]);
            free(want);
            free(got1);
            free(got3);
        }
    }
}

// The NaN and Inf lm_dev_dense_merge counts, with NaN and ±Inf sprinkled over the base and every
// part: those of the base and of each src it reads and of the output it writes, each once (the
// blocks the counted ties make it run twice included), on 1 and 3 threads, the output the same as
// without counting. τ given in buffers reads no src: nothing is counted for the parts.
static uint64_t nf_decode(const void *p, lm_dtype dt, int64_t n, bool want_nan)
{
    uint64_t c = 0;
    for (int64_t j = 0; j < n; j++) {
        float v = dt == LM_DTYPE_F32 ? ((const float *)p)[j]
                  : dt == LM_DTYPE_BF16 ? lm_bf16_to_f32(((const uint16_t *)p)[j])
                                        : lm_f16_to_f32(((const uint16_t *)p)[j]);
        c += want_nan ? isnan(v) != 0 : isinf(v) != 0;
    }
    return c;
}

static void test_counts(lm_dev *d1, lm_dev *d3, const inputs *clean)
{
    inputs in = *clean;
    in.base = malloc(N * sizeof *in.base);
    memcpy(in.base, clean->base, N * sizeof *in.base);
    for (int i = 0; i < K; i++) {
        size_t bytes = (size_t)N * (lm_dtype_bits(in.dt[i]) / 8);
        in.src[i] = malloc(bytes);
        memcpy(in.src[i], clean->src[i], bytes);
    }
    for (int64_t j = 17; j < N; j += 1 + (int64_t)(next() % 4000)) {
        int which = (int)(next() % (K + 1));
        float v = next() % 2 ? NAN : next() % 2 ? INFINITY : -INFINITY;
        if (which == K)
            in.base[j] = lm_f32_to_bf16(v);
        else if (in.dt[which] == LM_DTYPE_F32)
            ((float *)in.src[which])[j] = v;
        else
            ((uint16_t *)in.src[which])[j] = in.dt[which] == LM_DTYPE_BF16 ? lm_f32_to_bf16(v) : lm_f32_to_f16(v);
    }
    uint32_t thr[K];
    for (int i = 0; i < K; i++)
        thr[i] = lm_abs_bits((float)(i == 2 ? 1 : i + 2) / 256.0f);
    const merge_case cases[] = {
        {"ties, counted ties", true, false, false, {5000, 20000, 12345}, 1.0f, LM_COMBINE_SIGN_SUM, true, 1.0f,
         LM_DTYPE_F16, false, {0}},
        {"dare", false, true, false, {0}, 1.0f / 0.3f, LM_COMBINE_SIGN_NONE, false, 1.0f, LM_DTYPE_BF16, false, {0}},
        {"task arithmetic", false, false, true, {0}, 1.0f, LM_COMBINE_SIGN_NONE, false, 1.0f, LM_DTYPE_F32, false, {0}},
    };
    lm_err err = {0};
    int64_t first = 1001, n = N - first;
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
        const merge_case *c = &cases[ci];
        size_t bytes = (size_t)n * (lm_dtype_bits(c->out_dt) / 8);
        void *want = malloc(bytes), *got = malloc(bytes);
        int64_t used[2 * K];
        merge_fused(d1, &in, c, thr, first, n, want, used, false);
        uint64_t out_nan = nf_decode(want, c->out_dt, n, true), out_inf = nf_decode(want, c->out_dt, n, false);
        for (int th = 0; th < 2; th++)
            for (int from_buf = 0; from_buf < 2; from_buf++) {
                float w[K] = {1.0f, 0.5f, 2.0f}, *b = malloc((size_t)n * sizeof *b), *t[K];
                for (int i = 0; i < K; i++)
                    t[i] = malloc((size_t)n * sizeof *t[i]);
                if (from_buf)
                    taus(d1, &in, first, n, b, t);
                lm_nonfinite src_nf[K], base_nf = {0, 0}, out_nf = {0, 0};
                lm_dense_part parts[K];
                for (int i = 0; i < K; i++) {
                    src_nf[i] = (lm_nonfinite){0, 0};
                    parts[i] = (lm_dense_part){.src = from_buf ? NULL : at(in.src[i], in.dt[i], first), .dt = in.dt[i],
                                              .tau = from_buf ? t[i] : NULL, .trim = c->trim, .thr_bits = thr[i],
                                              .ties_allowed = c->ties[i], .drop = c->drop, .key = 1000 + (uint64_t)i,
                                              .keep_below = lm_rng_threshold(0.3), .first = first,
                                              .rescale = c->rescale, .weight = w[i], .nf = &src_nf[i]};
                }
                lm_combine_how how = {.sign = c->sign, .normalize = c->normalize, .lambda = c->lambda,
                                          .linear = c->linear, .base_nf = &base_nf, .out_nf = &out_nf};
                CHECK_OK(lm_dev_dense_merge(th ? d3 : d1, got, c->out_dt, in.base + first, LM_DTYPE_BF16, parts, K, n,
                                            how, &err),
                         &err);
                CHECK_MSG(memcmp(want, got, bytes) == 0, "%s: counting changed the output", c->name);
                CHECK_MSG(out_nf.nan == out_nan && out_nf.inf == out_inf && out_nan + out_inf > 0,
                          "%s: output counted %llu NaN, %llu Inf; it holds %llu, %llu", c->name,
                          (unsigned long long)out_nf.nan, (unsigned long long)out_nf.inf,
                          (unsigned long long)out_nan, (unsigned long long)out_inf);
                CHECK(base_nf.nan == nf_decode(in.base + first, LM_DTYPE_BF16, n, true) &&
                      base_nf.inf == nf_decode(in.base + first, LM_DTYPE_BF16, n, false) && base_nf.nan > 0);
                for (int i = 0; i < K; i++) {
                    uint64_t nan = from_buf ? 0 : nf_decode(at(in.src[i], in.dt[i], first), in.dt[i], n, true);
                    uint64_t inf = from_buf ? 0 : nf_decode(at(in.src[i], in.dt[i], first), in.dt[i], n, false);
                    CHECK_MSG(src_nf[i].nan == nan && src_nf[i].inf == inf,
                              "%s part %d (tau %s): counted %llu NaN, %llu Inf; it holds %llu, %llu", c->name, i,
                              from_buf ? "given" : "computed", (unsigned long long)src_nf[i].nan,
                              (unsigned long long)src_nf[i].inf, (unsigned long long)nan, (unsigned long long)inf);
                }
                free(b);
                for (int i = 0; i < K; i++)
                    free(t[i]);
            }
        free(want);
        free(got);
    }
    free_inputs(&in);
}

// ---- LoRA parts ------------------------------------------------------------------------------

// A LoRA pair for a [rows, cols] tensor: B [rows, r] and A [r, cols] of values with few binary
// digits (ties in the product), and the product as the CPU's GEMM makes it.
typedef struct lora {
    int64_t rows, cols, r;
    float scale;
    float *a, *b, *tau;
} lora;

static void make_lora(lm_dev *d, lora *l, int64_t rows, int64_t cols, int64_t r, float scale)
{
    lm_err err = {0};
    *l = (lora){rows, cols, r, scale, malloc((size_t)(r * cols) * sizeof(float)),
                malloc((size_t)(rows * r) * sizeof(float)), malloc((size_t)(rows * cols) * sizeof(float))};
    for (int64_t i = 0; i < r * cols; i++)
        l->a[i] = (float)((int)(next() % 7) - 3) / 8.0f;
    for (int64_t i = 0; i < rows * r; i++)
        l->b[i] = (float)((int)(next() % 5) - 2) / 4.0f;
    CHECK_OK(lm_dev_gemm(d, false, false, rows, cols, r, scale, l->b, r, l->a, cols, 0.0f, l->tau, cols, &err), &err);
}

static void free_lora(lora *l)
{
    free(l->a);
    free(l->b);
    free(l->tau);
}

// The GEMM of rank <= LM_DEV_LOWRANK_MAX without transposes: each element the fused multiply-add
// chain over q in order, times alpha (beta 0), and with beta the old value added after; the
// values as a double-precision product gives them, to float32 rounding.
static void test_lowrank_gemm(lm_dev *d)
{
    lm_err err = {0};
    const int64_t shapes[][3] = {{37, 1000, 16}, {5, 130, 1}, {64, 77, LM_DEV_LOWRANK_MAX}, {300, 2048, 7}};
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        int64_t m = shapes[si][0], n = shapes[si][1], k = shapes[si][2];
        float *a = malloc((size_t)(m * k) * sizeof *a), *b = malloc((size_t)(k * n) * sizeof *b);
        float *c = malloc((size_t)(m * n) * sizeof *c), *c2 = malloc((size_t)(m * n) * sizeof *c2);
        for (int64_t i = 0; i < m * k; i++)
            a[i] = (float)((double)(int64_t)(next() % 20001 - 10000) / 3777.0);
        for (int64_t i = 0; i < k * n; i++)
            b[i] = (float)((double)(int64_t)(next() % 20001 - 10000) / 5113.0);
        for (int64_t i = 0; i < m * n; i++)
            c2[i] = (float)i / 1000.0f;
        CHECK_OK(lm_dev_gemm(d, false, false, m, n, k, 0.75f, a, k, b, n, 0.0f, c, n, &err), &err);
        CHECK_OK(lm_dev_gemm(d, false, false, m, n, k, 0.75f, a, k, b, n, 0.5f, c2, n, &err), &err);
        int64_t chain = 0, close = 0;
        for (int64_t i = 0; i < m; i++)
            for (int64_t j = 0; j < n; j++) {
                float acc = 0.0f;
                double ref = 0.0;
                for (int64_t q = 0; q < k; q++) {
                    acc = fmaf(a[i * k + q], b[q * n + j], acc);
                    ref += (double)a[i * k + q] * b[q * n + j];
                }
                float want = 0.75f * acc, want2 = 0.75f * acc + 0.5f * ((float)(i * n + j) / 1000.0f);
                chain += memcmp(&c[i * n + j], &want, sizeof want) == 0 &&
                         memcmp(&c2[i * n + j], &want2, sizeof want2) == 0;
                close += fabs(c[i * n + j] - 0.75 * ref) <= 1e-5 * (1.0 + fabs(0.75 * ref)) * (double)k;
            }
        CHECK_MSG(chain == m * n, "gemm %lldx%lldx%lld: %lld of %lld elements are not the fma chain", (long long)m,
                  (long long)n, (long long)k, (long long)(m * n - chain), (long long)(m * n));
        CHECK_MSG(close == m * n, "gemm %lldx%lldx%lld: %lld elements far from the double product", (long long)m,
                  (long long)n, (long long)k, (long long)(m * n - close));
        free(a);
        free(b);
        free(c);
        free(c2);
    }
}

// Part i of the LoRA cases for elements from `first` of the tensor: part 1 a full model's
// (BF16 from the base), the others LoRA pairs.
static lm_dense_part lora_part(const lora *l, const uint16_t *ft, int i, int64_t first)
{
    if (i == 1)
        return (lm_dense_part){.src = ft + first, .dt = LM_DTYPE_BF16};
    return (lm_dense_part){.lora_a = l->a, .lora_b = l->b + first / l->cols * l->r, .lora_r = l->r,
                          .cols = l->cols, .col0 = first % l->cols, .scale = l->scale, .dt = LM_DTYPE_F32};
}

// Tensors whose spans of LoRA rows do not fall on rows (1000 wide), narrower than a vector (40),
// and wider than a span's bound (9000), with ranks 16, 3 and the largest: the fused window
// counts and merge, from 0 and from an offset inside a row, against the separate operations on
// the GEMM's product.
static void test_lora(lm_dev *d1, lm_dev *d3)
{
    const int64_t shapes[][3] = {{301, 1000, 16}, {2500, 40, 3}, {9, 9000, LM_DEV_LOWRANK_MAX}};
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        lm_err err = {0};
        int64_t rows = shapes[si][0], cols = shapes[si][1], n = rows * cols;
        lora l[K];
        make_lora(d1, &l[0], rows, cols, shapes[si][2], 0.5f);
        make_lora(d1, &l[2], rows, cols, shapes[si][2] > 4 ? shapes[si][2] / 2 : 2, 2.0f);
        uint16_t *base = malloc((size_t)n * sizeof *base), *ft = malloc((size_t)n * sizeof *ft);
        float *b = malloc((size_t)n * sizeof *b), *t1 = malloc((size_t)n * sizeof *t1);
        for (int64_t j = 0; j < n; j++) {
            base[j] = lm_f32_to_bf16((float)((int64_t)(next() % 2001) - 1000) / 512.0f);
            ft[j] = lm_f32_to_bf16(lm_bf16_to_f32(base[j]) + (float)((int)(next() % 9) - 4) / 256.0f);
        }
        CHECK_OK(lm_dev_to_f32(d1, b, base, LM_DTYPE_BF16, n, &err), &err);
        CHECK_OK(lm_dev_delta(d1, t1, ft, LM_DTYPE_BF16, b, n, &err), &err);
        float *tau[K] = {l[0].tau, t1, l[2].tau};

        // the window counts: around a value of each τ
        for (int th = 0; th < 2; th++) {
            lm_dev *d = th ? d3 : d1;
            uint64_t above[K] = {0}, want_above[K] = {0}, *win[K], *want_win[K];
            lm_dense_part parts[K];
            for (int i = 0; i < K; i++) {
                win[i] = calloc((size_t)LM_HIST_WINDOW * LM_HIST_BINS, sizeof(uint64_t));
                want_win[i] = calloc((size_t)LM_HIST_WINDOW * LM_HIST_BINS, sizeof(uint64_t));
                uint32_t lo = lm_abs_bits(tau[i][n / 3 + i]) >> 16;
                parts[i] = lora_part(&l[i], ft, i, 0);
                parts[i].above = &above[i];
                parts[i].win = win[i];
                parts[i].lo_bin = lo > 1 ? lo - 1 : 0;
                parts[i].n_win = 4;
                CHECK_OK(lm_dev_hist_window(d1, &want_above[i], want_win[i], 4, parts[i].lo_bin, tau[i], n, &err),
                         &err);
            }
            CHECK_OK(lm_dev_dense_hist(d, base, LM_DTYPE_BF16, parts, K, n, &err), &err);
            for (int i = 0; i < K; i++) {
                int64_t bad = 0;
                for (size_t c = 0; c < (size_t)4 * LM_HIST_BINS; c++)
                    bad += win[i][c] != want_win[i][c];
                CHECK_MSG(bad == 0 && above[i] == want_above[i], "lora %lldx%lld part %d, %d threads: %lld cells "
                          "differ, above %llu vs %llu", (long long)rows, (long long)cols, i, th ? 3 : 1, (long long)bad,
                          (unsigned long long)above[i], (unsigned long long)want_above[i]);
                free(win[i]);
                free(want_win[i]);
            }
        }

        // the merge, ties sum with partial budgets (the product's values tie often), and dare;
        // ties also from the candidates kept by a counting pass whose windows hold the
        // thresholds (from segment starts only)
        uint16_t *kbits[K];
        int64_t *koff[K];
        float *kvals[K];
        for (int i = 0; i < K; i++) {
            kbits[i] = malloc((size_t)(n / 16 + 1) * sizeof *kbits[i]);
            koff[i] = malloc((size_t)(n / LM_DENSE_KEEP_SEGMENT + 1) * sizeof *koff[i]);
            kvals[i] = malloc((size_t)(n + 16) * sizeof *kvals[i]);
        }
        for (int mc = 0; mc < 2; mc++) {
            const int64_t firsts[] = {0, n / 2 + 7, n / 2 / LM_DENSE_KEEP_SEGMENT * LM_DENSE_KEEP_SEGMENT};
            for (int fi = 0; fi < 3; fi++) {
                int64_t first = firsts[fi], cnt = n - first;
                float w[K] = {1.0f, 0.5f, 2.0f}, *o = malloc((size_t)cnt * sizeof *o), *t[K];
                uint32_t thr[K];
                int64_t ties[K] = {3, 10, 1}, used[K];
                uint16_t *want = malloc((size_t)cnt * 2), *got = malloc((size_t)cnt * 2);
                for (int i = 0; i < K; i++) {
                    t[i] = malloc((size_t)cnt * sizeof *t[i]);
                    memcpy(t[i], tau[i] + first, (size_t)cnt * sizeof *t[i]);
                    thr[i] = lm_abs_bits(tau[i][n / 2 + 11 * i]);
                    used[i] = 0;
                    if (mc == 0)
                        CHECK_OK(lm_dev_topk_apply(d1, t[i], cnt, thr[i], ties[i], &used[i], &err), &err);
                    else
                        CHECK_OK(lm_dev_random_drop(d1, t[i], cnt, 77 + (uint64_t)i, first, lm_rng_threshold(0.3),
                                                    &err),
                                 &err);
                }
                const float *tp[K] = {t[0], t[1], t[2]};
                CHECK_OK(lm_dev_combine(d1, o, b + first, tp, w, K, cnt, how_of(LM_COMBINE_SIGN_SUM, true, 1.0f), &err),
                         &err);
                CHECK_OK(lm_dev_from_f32(d1, want, LM_DTYPE_BF16, o, cnt, &err), &err);
                for (int run = 0; run < 4; run++) {
                    int th = run & 1;
                    bool kept = run >= 2;
                    if (kept && (mc == 1 || first % LM_DENSE_KEEP_SEGMENT != 0))
                        continue;
                    if (kept) {  // the counting pass over the whole tensor, keeping candidates
                        lm_dense_part hp[K];
                        uint64_t above[K] = {0}, *win[K];
                        for (int i = 0; i < K; i++) {
                            win[i] = calloc((size_t)4 * LM_HIST_BINS, sizeof(uint64_t));
                            hp[i] = lora_part(&l[i], ft, i, 0);
                            hp[i].above = &above[i];
                            hp[i].win = win[i];
                            hp[i].lo_bin = (thr[i] >> 16) > 1 ? (thr[i] >> 16) - 1 : 0;
                            hp[i].n_win = 4;
                            if (i != 1) {
                                hp[i].keep_bits = kbits[i];
                                hp[i].keep_off = koff[i];
                                hp[i].keep_vals = kvals[i];
                                memset(kvals[i], 0xFF, (size_t)(n + 16) * sizeof *kvals[i]);  // NaNs: nothing stale
                            }
                        }
                        CHECK_OK(lm_dev_dense_hist(th ? d3 : d1, base, LM_DTYPE_BF16, hp, K, n, &err), &err);
                        for (int i = 0; i < K; i++)
                            free(win[i]);
                    }
                    lm_dense_part parts[K];
                    for (int i = 0; i < K; i++) {
                        parts[i] = lora_part(&l[i], ft, i, first);
                        if (kept && i != 1) {
                            parts[i].keep_bits = kbits[i];
                            parts[i].keep_off = koff[i];
                            parts[i].keep_vals = kvals[i];
                        }
                        parts[i].trim = mc == 0;
                        parts[i].thr_bits = thr[i];
                        parts[i].ties_allowed = ties[i];
                        parts[i].drop = mc == 1;
                        parts[i].key = 77 + (uint64_t)i;
                        parts[i].keep_below = lm_rng_threshold(0.3);
                        parts[i].first = first;
                        parts[i].rescale = 1.0f;
                        parts[i].weight = w[i];
                    }
                    lm_combine_how how = {.sign = LM_COMBINE_SIGN_SUM, .normalize = true, .lambda = 1.0f};
                    CHECK_OK(lm_dev_dense_merge(th ? d3 : d1, got, LM_DTYPE_BF16, base + first, LM_DTYPE_BF16, parts, K,
                                                cnt, how, &err),
                             &err);
                    CHECK_MSG(memcmp(want, got, (size_t)cnt * 2) == 0, "lora %lldx%lld %s from %lld, %d threads%s: "
                              "differs from the separate operations", (long long)rows, (long long)cols,
                              mc ? "dare" : "ties", (long long)first, th ? 3 : 1, kept ? ", kept candidates" : "");
                    for (int i = 0; mc == 0 && i < K; i++)
                        CHECK_MSG(parts[i].ties_used == used[i], "lora part %d: ties used %lld, wanted %lld", i,
                                  (long long)parts[i].ties_used, (long long)used[i]);
                }
                // the budgets ran out inside the range: the redone blocks were exercised
                for (int i = 0; mc == 0 && i < K; i++)
                    CHECK_MSG(used[i] == ties[i], "lora part %d used %lld of %lld ties", i, (long long)used[i],
                              (long long)ties[i]);
                free(o);
                free(want);
                free(got);
                for (int i = 0; i < K; i++)
                    free(t[i]);
            }
        }
        for (int i = 0; i < K; i++) {
            free(kbits[i]);
            free(koff[i]);
            free(kvals[i]);
        }
        free_lora(&l[0]);
        free_lora(&l[2]);
        free(base);
        free(ft);
        free(b);
        free(t1);
    }
}

// The Gram pass: every row's dot products of the base and the τ made from the inputs, the bits
// lm_dev_row_dot gives on the separate τ, and those of the order device.h fixes (dot_ref.h).
// The base's values span a wide range of magnitudes and the fine-tunes' are float32 with full
// mantissas or BF16 (all BF16 is a path of its own on the CPU), so that sums in another order
// differ (all but base·base, a sum of exact 16-bit products). Rows longer than a chunk and not
// a multiple of the lanes, so that a row's stretches start anywhere in its lanes; from an
// offset into the tensor; 1 to 4 parts (the CPU sweeps 1, 2 and 3 at once and more one product
// at a time; the fourth part is the first again).
enum { G_COLS = 1003, G_ROWS = 251, G_FIRST = 1001, G_MAXK = 4 };

static void check_gram(lm_dev *d, const inputs *in, const float *b, float *const *t, int k)
{
    lm_err err = {0};
    int nd = 1 + k + k * (k + 1) / 2;
    lm_dense_part parts[G_MAXK];
    const float *tk[G_MAXK];
    for (int i = 0; i < k; i++) {
        parts[i] = (lm_dense_part){.src = at(in->src[i % K], in->dt[i % K], G_FIRST), .dt = in->dt[i % K],
                                   .first = G_FIRST};
        tk[i] = t[i % K];
    }
    double *got = malloc((size_t)G_ROWS * nd * sizeof *got), *sep = malloc(G_ROWS * sizeof *sep);
    CHECK_OK(lm_dev_dense_gram(d, in->base + G_FIRST, LM_DTYPE_BF16, parts, k, G_ROWS, G_COLS, got, &err), &err);
    const float *x[nd], *y[nd];
    int q = 0;
    x[q] = b, y[q++] = b;
    for (int i = 0; i < k; i++)
        x[q] = b, y[q++] = tk[i];
    for (int i = 0; i < k; i++)
        for (int j = 0; j <= i; j++)
            x[q] = tk[i], y[q++] = tk[j];
    int bad_sep = 0, bad_lanes = 0, other_order = 0;
    for (q = 0; q < nd; q++) {
        CHECK_OK(lm_dev_row_dot(d, x[q], y[q], G_ROWS, G_COLS, sep, &err), &err);
        for (int64_t r = 0; r < G_ROWS; r++) {
            double seq = 0, want = dot_ref(x[q] + r * G_COLS, y[q] + r * G_COLS, G_COLS);
            for (int64_t c = 0; c < G_COLS; c++)
                seq += (double)x[q][r * G_COLS + c] * (double)y[q][r * G_COLS + c];
            bad_sep += memcmp(&got[r * nd + q], &sep[r], sizeof sep[r]) != 0;
            bad_lanes += memcmp(&sep[r], &want, sizeof want) != 0;
            other_order += seq != want;
        }
    }
    CHECK_MSG(bad_sep == 0, "dense_gram of %d parts: %d of %d sums differ from row_dot's", k, bad_sep, G_ROWS * nd);
    CHECK_MSG(bad_lanes == 0, "row_dot: %d of %d sums not in the lanes' order", bad_lanes, G_ROWS * nd);
    CHECK_MSG(other_order > G_ROWS * (nd - 1) / 2,
              "the inputs do not tell the orders apart: %d of %d sequential sums differ", other_order, G_ROWS * nd);
    free(got);
    free(sep);
}

static void test_gram(lm_dev *d, lm_dtype dt)
{
    int64_t n = (int64_t)G_ROWS * G_COLS, all = G_FIRST + n;
    inputs in = {.base = malloc((size_t)all * 2), .dt = {dt, dt, dt}};
    for (int i = 0; i < K; i++)
        in.src[i] = malloc((size_t)all * 4);
    for (int64_t j = 0; j < all; j++) {
        float bv = ldexpf((float)(next() >> 40) / (float)(1 << 24) - 0.5f, (int)(next() % 25) - 12);
        in.base[j] = lm_f32_to_bf16(bv);
        for (int i = 0; i < K; i++) {
            float b = lm_bf16_to_f32(in.base[j]), e = (float)(next() >> 40) / (float)(1 << 24) - 0.5f;
            float v = b + b * ldexpf(e, -2 - i);  // τ in proportion to the base
            if (dt == LM_DTYPE_BF16)
                ((uint16_t *)in.src[i])[j] = lm_f32_to_bf16(v);
            else
                ((float *)in.src[i])[j] = v;
        }
    }
    float *b = malloc((size_t)n * sizeof *b), *t[K];
    for (int i = 0; i < K; i++)
        t[i] = malloc((size_t)n * sizeof *t[i]);
    taus(d, &in, G_FIRST, n, b, t);
    for (int k = 1; k <= G_MAXK; k++)
        check_gram(d, &in, b, t, k);
    free(b);
    for (int i = 0; i < K; i++)
        free(t[i]);
    free_inputs(&in);
}

// The caller's work given to lm_dev_dense_merge_side runs exactly once, on every path, and the
// merge is the same as without it.
static void count_side(void *ctx)
{
    ++*(int *)ctx;
}

static void test_side(lm_dev *d1, lm_dev *d3, const inputs *in)
{
    lm_err err = {0};
    uint32_t thr[K];
    for (int i = 0; i < K; i++)
        thr[i] = lm_abs_bits((float)(i + 2) / 256.0f);
    const merge_case c = {"ties with the caller's work", true, false, false, {5000, 20000, 12345}, 1.0f,
                          LM_COMBINE_SIGN_SUM, true, 1.0f, LM_DTYPE_BF16, false, {0}};
    size_t bytes = (size_t)N * 2;
    void *want = malloc(bytes), *got = malloc(bytes);
    int64_t used[2 * K];
    merge_fused(d1, in, &c, thr, 0, N, want, used, false);
    for (int th = 0; th < 2; th++) {
        int ran = 0;
        lm_dev_side side = {count_side, &ran};
        lm_dense_part parts[K];
        float w[K] = {1.0f, 0.5f, 2.0f};
        for (int i = 0; i < K; i++)
            parts[i] = (lm_dense_part){.src = in->src[i], .dt = in->dt[i], .trim = true, .thr_bits = thr[i],
                                      .ties_allowed = c.ties[i], .rescale = 1.0f, .weight = w[i]};
        lm_combine_how how = {.sign = c.sign, .normalize = c.normalize, .lambda = c.lambda, .linear = c.linear};
        CHECK_OK(lm_dev_dense_merge_side(th ? d3 : d1, got, LM_DTYPE_BF16, in->base, LM_DTYPE_BF16, parts, K, N, how,
                                         &side, &err),
                 &err);
        CHECK_MSG(ran == 1 && memcmp(want, got, bytes) == 0, "%d threads: the caller's work ran %d times, output %s",
                  th ? 3 : 1, ran, memcmp(want, got, bytes) ? "differs" : "same");
    }
    lm_dev *sim = NULL;
    CHECK_OK(lm_dev_sim_create(&sim, 1 << 20, NULL, 1, &err), &err);
    if (sim) {
        int ran = 0;
        lm_dev_side side = {count_side, &ran};
        lm_dense_part p = {.src = in->base, .dt = LM_DTYPE_BF16, .weight = 1.0f, .rescale = 1.0f};
        lm_combine_how how = {.sign = LM_COMBINE_SIGN_SUM, .normalize = true, .lambda = 1.0f};
        CHECK_FAILS(lm_dev_dense_merge_side(sim, got, LM_DTYPE_BF16, in->base, LM_DTYPE_BF16, &p, 1, 4, how, &side,
                                            &err),
                    LM_ERR_UNSUPPORTED, "no fused dense operations", &err);
        CHECK_MSG(ran == 1, "a device without the operation ran the caller's work %d times", ran);
        lm_dev_destroy(sim);
    }
    free(want);
    free(got);
}

static void test_refusals(void)
{
    lm_err err = {0};
    lm_dev *sim = NULL;
    CHECK_OK(lm_dev_sim_create(&sim, 1 << 20, NULL, 1, &err), &err);
    if (!sim)
        return;
    CHECK(!lm_dev_supports(sim, LM_OP_DENSE));
    uint16_t base[4] = {0}, out[4];
    lm_dense_part p = {.src = base, .dt = LM_DTYPE_BF16, .weight = 1.0f, .rescale = 1.0f};
    lm_combine_how how = {.sign = LM_COMBINE_SIGN_SUM, .normalize = true, .lambda = 1.0f};
    CHECK_FAILS(lm_dev_dense_merge(sim, out, LM_DTYPE_BF16, base, LM_DTYPE_BF16, &p, 1, 4, how, &err),
                LM_ERR_UNSUPPORTED, "no fused dense operations", &err);
    lm_dev_destroy(sim);
}

int main(void)
{
    lm_err err = {0};
    lm_dev *d1 = NULL, *d3 = NULL;
    CHECK_OK(lm_dev_cpu_create(&d1, 1, &err), &err);
    CHECK_OK(lm_dev_cpu_create(&d3, 3, &err), &err);
    if (!d1 || !d3)
        return check_report("test_dense");
    CHECK(lm_dev_supports(d1, LM_OP_DENSE));
    inputs in;
    make_inputs(&in);
    test_hist(d1, &in);
    test_hist(d3, &in);
    test_merge(d1, d3, &in);
    test_lowrank_gemm(d1);
    test_lowrank_gemm(d3);
    test_lora(d1, d3);
    test_side(d1, d3, &in);
    test_gram(d1, LM_DTYPE_F32);
    test_gram(d3, LM_DTYPE_F32);
    test_gram(d1, LM_DTYPE_BF16);
    test_gram(d3, LM_DTYPE_BF16);
    test_counts(d1, d3, &in);
    test_refusals();
    free_inputs(&in);
    lm_dev_destroy(d1);
    lm_dev_destroy(d3);
    return check_report("test_dense");
}
