// Tests of the fused dense operations (lm_dev_dense_hist, lm_dev_dense_merge) on the CPU
// backend, with τ computed from the inputs and (merge) given in buffers, as the engine passes a
// LoRA product's: each must give bit for bit what the separate operations it replaces give
// (conversion, delta, hist_window, topk_apply or random_drop, axpby, combine, conversion back),
// with 1 and with 3 threads, on inputs full of ties at the threshold (16-bit fine-tuned values
// a few steps from the base's) in every readable input dtype and every output dtype, over
// several work blocks with a ragged end and from an offset into the tensor.
#include "check.h"
#include "device.h"
#include "sparsify.h"

#include <stdint.h>
#include <stdlib.h>

enum { N = 300007, K = 3 };

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
    lm_dev_dense parts[K];
    for (int i = 0; i < K; i++) {
        win[i] = calloc((size_t)LM_HIST_WINDOW * LM_HIST_BINS, sizeof(uint64_t));
        want_win[i] = calloc((size_t)LM_HIST_WINDOW * LM_HIST_BINS, sizeof(uint64_t));
        uint32_t lo = lm_abs_bits(t[i][1234 + i]) >> 16;
        parts[i] = (lm_dev_dense){.src = in->src[i], .dt = in->dt[i], .above = &above[i], .win = win[i],
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
    free(b);
    for (int i = 0; i < K; i++)
        free(t[i]);
}

typedef struct merge_case {
    const char *name;
    bool trim, drop, linear;
    int64_t ties[K];  // ties_allowed per part (trim)
    float rescale;
    lm_dev_sign sign;
    bool normalize;
    float lambda;
    lm_dtype out_dt;
} merge_case;

// The separate operations' result over [first, first + n) in out_dt, and the ties each part used.
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
        CHECK_OK(lm_dev_combine(d, b, b, tp, w, K, n, c->sign, c->normalize, c->lambda, &err), &err);
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
    lm_dev_dense parts[K];
    for (int i = 0; i < K; i++)
        parts[i] = (lm_dev_dense){.src = from_buf ? NULL : at(in->src[i], in->dt[i], first), .dt = in->dt[i],
                                  .tau = from_buf ? t[i] : NULL, .trim = c->trim,
                                  .thr_bits = thr[i], .ties_allowed = c->ties[i], .drop = c->drop,
                                  .key = 1000 + (uint64_t)i, .keep_below = lm_rng_threshold(0.3), .first = first,
                                  .rescale = c->rescale, .weight = w[i]};
    lm_dev_combine_how how = {c->sign, c->normalize, c->lambda, c->linear};
    CHECK_OK(lm_dev_dense_merge(d, out, c->out_dt, in->base + first, LM_DTYPE_BF16, parts, K, n, how, &err), &err);
    for (int i = 0; i < K; i++) {
        used[i] = parts[i].ties_used;
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
    const merge_case cases[] = {
        {"ties sum, some ties of each", true, false, false, {5000, 20000, 12345}, 1.0f, LM_DEV_SIGN_SUM, true, 1.0f,
         LM_DTYPE_BF16},
        {"ties count, all / none / some", true, false, false, {all, 0, 77}, 1.0f, LM_DEV_SIGN_COUNT, false, 0.7f,
         LM_DTYPE_F16},
        {"ties, a budget larger than the ties", true, false, false, {1 << 30, 3, all}, 1.0f, LM_DEV_SIGN_SUM, true,
         1.3f, LM_DTYPE_F32},
        {"dare-ties, rescaled", false, true, false, {0}, 1.0f / 0.3f, LM_DEV_SIGN_SUM, true, 1.0f, LM_DTYPE_BF16},
        {"dare, no election", false, true, false, {0}, 1.0f / 0.3f, LM_DEV_SIGN_NONE, false, 1.0f, LM_DTYPE_BF16},
        {"task arithmetic", false, false, true, {0}, 1.0f, LM_DEV_SIGN_NONE, false, 1.0f, LM_DTYPE_BF16},
        {"disjoint mean, no trim", false, false, false, {0}, 1.0f, LM_DEV_SIGN_SUM, true, 1.0f, LM_DTYPE_F32},
    };
    const int64_t firsts[] = {0, 70001};
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
        const merge_case *c = &cases[ci];
        for (int fi = 0; fi < 2; fi++) {
            int64_t first = firsts[fi], n = N - first;
            size_t bytes = (size_t)n * (lm_dtype_bits(c->out_dt) / 8);
            void *want = malloc(bytes), *got1 = malloc(bytes), *got3 = malloc(bytes);
            int64_t used_want[K], used1[K], used3[K];
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
                for (int i = 0; i < K; i++)
                    CHECK_MSG(used1[i] == used_want[i] && used3[i] == used_want[i],
                              "%s part %d: ties used %lld, %lld, wanted %lld", c->name, i, (long long)used1[i],
                              (long long)used3[i], (long long)used_want[i]);
            }
            // The partial budgets run out inside the range: the cases test the counted path.
            if (ci == 0)
                for (int i = 0; i < K; i++)
                    CHECK_MSG(used_want[i] == c->ties[i], "part %d used %lld of %lld ties", i,
                              (long long)used_want[i], (long long)c->ties[i]);
            free(want);
            free(got1);
            free(got3);
        }
    }
}

static void test_refusals(void)
{
    lm_err err = {0};
    lm_dev *sim = NULL;
    CHECK_OK(lm_dev_sim_create(&sim, 1 << 20, NULL, 1, &err), &err);
    if (!sim)
        return;
    CHECK(!lm_dev_has_dense(sim));
    uint16_t base[4] = {0}, out[4];
    lm_dev_dense p = {.src = base, .dt = LM_DTYPE_BF16, .weight = 1.0f, .rescale = 1.0f};
    lm_dev_combine_how how = {LM_DEV_SIGN_SUM, true, 1.0f, false};
    CHECK_FAILS(lm_dev_dense_merge(sim, out, LM_DTYPE_BF16, base, LM_DTYPE_BF16, &p, 1, 4, how, &err),
                LM_ERR_UNSUPPORTED, "no fused dense operations", &err);
    lm_dev_free(sim);
}

int main(void)
{
    lm_err err = {0};
    lm_dev *d1 = NULL, *d3 = NULL;
    CHECK_OK(lm_dev_cpu_create(&d1, 1, &err), &err);
    CHECK_OK(lm_dev_cpu_create(&d3, 3, &err), &err);
    if (!d1 || !d3)
        return check_report("test_dense");
    CHECK(lm_dev_has_dense(d1));
    inputs in;
    make_inputs(&in);
    test_hist(d1, &in);
    test_hist(d3, &in);
    test_merge(d1, d3, &in);
    test_refusals();
    free_inputs(&in);
    lm_dev_free(d1);
    lm_dev_free(d3);
    return check_report("test_dense");
}
