// Tests of the merge engine against docs/merging.md, computed in ref_merge.h independently in
// double: every task-vector rule of LoRA adapters (alpha / r, rslora, rank_pattern /
// alpha_pattern first match in file order, fan_in_fan_out, lora_bias, DoRA, embedding LoRA,
// modules_to_save) and of full models; a tensor an FT does not touch taking no part in the
// divisor; BF16 output rounded to nearest even; option and input checks; the NaN and Inf counts
// of every input and output tensor. The methods' selection and combination are tested in
// test_merge_methods.c.
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/wait.h>
#include <unistd.h>

#include "adapter.h"
#include "check.h"
#include "dtype.h"
#include "merge.h"
#include "merge_fixture.h"
#include "model.h"
#include "ref_merge.h"
#include "safetensors.h"


// ==== LoRA task vectors =======================================================================
// One FT, task-arithmetic, weight 1, lambda 1: the output is θ_b + τ, so τ is seen alone.

// The base of the LoRA tests.
static void lora_base(tset *b)
{
    rng_seed(11);
    fill_q(ts_add2(b, "layer.q_proj.weight", 6, 5), 30, 2.0, 12);
    fill_q(ts_add1(b, "layer.q_proj.bias", 6), 6, 2.0, 12);
    fill_q(ts_add2(b, "layer.v_proj.weight", 4, 5), 20, 2.0, 12);
    fill_q(ts_add2(b, "other.v_proj.weight", 3, 5), 15, 2.0, 12);
    fill_q(ts_add2(b, "model.embed_tokens.weight", 7, 5), 35, 2.0, 12);
    fill_q(ts_add2(b, "lm_head.weight", 7, 5), 35, 2.0, 12);
    fill_q(ts_add1(b, "norm.weight", 5), 5, 2.0, 12);
}

static const float *lora_factor(const tset *a, const char *path, const char *suffix)
{
    char k[128];
    snprintf(k, sizeof k, "base_model.model.%s%s", path, suffix);
    return ts_get(a, k);
}

// τ of linear module `path` against base tensor `bname` (s · B@A, transposed with fifo).
static void lora_tau(const tset *base, const tset *a, const char *path, const char *bname, int64_t r,
                     double s, bool fifo, double *tau, double *mag)
{
    const tensor *bt = ts_find(base, bname);
    int64_t out = fifo ? bt->shape[1] : bt->shape[0], in = fifo ? bt->shape[0] : bt->shape[1];
    lora_ref(tau, mag, lora_factor(a, path, ".lora_A.weight"), lora_factor(a, path, ".lora_B.weight"), r,
             in, out, s, fifo);
}

static void check_lora(const lm_st_file *st, const tset *base, const tset *a, const char *path, int64_t r,
                       double s, bool fifo, double f)
{
    char bname[128];
    snprintf(bname, sizeof bname, "%s.weight", path);
    int64_t n = ts_find(base, bname)->n;
    double *tau = malloc((size_t)n * sizeof *tau), *mag = malloc((size_t)n * sizeof *mag);
    lora_tau(base, a, path, bname, r, s, fifo, tau, mag);
    check_sum(st, base, bname, tau, mag, f);
    free(tau);
    free(mag);
}

// Task-arithmetic of the FTs at dirs with weights w, lambda and normalize.
static lm_st_file *merge_ta(const fixture *f, const char *const *dirs, int n, const double *w,
                            double lambda, bool normalize, lm_merge_result *res)
{
    double d[MAX_FT] = {1, 1, 1, 1};
    lm_merge_opts o = fixture_merge_opts(LM_MERGE_TASK_ARITHMETIC, n, w, d);
    o.lambda = lambda;
    o.normalize = normalize;
    return run_merge(f->root, &o, f->base_dir, dirs, res);
}

static lm_st_file *merge_one(const fixture *f, const char *dir, lm_merge_result *res)
{
    static const double one = 1.0;
    const char *dirs[1] = {dir};
    return merge_ta(f, dirs, 1, &one, 1.0, false, res);
}

static void test_lora_alpha_over_r(void)
{
    fixture f;
    fx_open(&f, lora_base, "float32");
    char *ad = subdir(f.root, "ad");
    tset a = {0};
    rng_seed(21);
    add_lora(&a, "layer.q_proj", 2, 5, 6);
    add_lora(&a, "layer.v_proj", 2, 5, 4);
    write_adapter(ad, "{\"peft_type\": \"LORA\", \"r\": 2, \"lora_alpha\": 4, "
                      "\"target_modules\": [\"q_proj\", \"v_proj\"]}", &a);
    lm_merge_result res;
    memset(&res, 0, sizeof res);
    lm_st_file *st = merge_one(&f, ad, &res);
    if (st) {
        check_lora(st, &f.base, &a, "layer.q_proj", 2, 2.0, false, 1.0);
        check_lora(st, &f.base, &a, "layer.v_proj", 2, 2.0, false, 1.0);
        static const char *untouched[] = {"layer.q_proj.bias", "other.v_proj.weight",
                                          "model.embed_tokens.weight", "lm_head.weight", "norm.weight"};
        for (int i = 0; i < 5; i++)
            check_same(st, &f.base, untouched[i]);
        CHECK_MSG(res.n_merged == 2 && res.n_copied == 5, "merged %lld, copied %lld",
                  (long long)res.n_merged, (long long)res.n_copied);
        lm_merge_result_free(&res);
    }
    lm_st_close(st);

    // Weight and lambda scale τ in task arithmetic: θ_b + λ·w·τ (normalize off).
    const double w = 0.5;
    const char *dirs[1] = {ad};
    st = merge_ta(&f, dirs, 1, &w, 1.5, false, NULL);
    if (st) {
        check_lora(st, &f.base, &a, "layer.q_proj", 2, 2.0, false, 0.75);
        check_lora(st, &f.base, &a, "layer.v_proj", 2, 2.0, false, 0.75);
    }
    lm_st_close(st);
    // With normalize the weight divides out: θ_b + λ·τ.
    st = merge_ta(&f, dirs, 1, &w, 1.5, true, NULL);
    if (st)
        check_lora(st, &f.base, &a, "layer.q_proj", 2, 2.0, false, 1.5);
    lm_st_close(st);
    ts_free(&a);
    free(ad);
    fx_close(&f);
}

static void test_lora_rslora(void)
{
    fixture f;
    fx_open(&f, lora_base, "float32");
    char *ad = subdir(f.root, "ad");
    tset a = {0};
    rng_seed(22);
    add_lora(&a, "layer.q_proj", 4, 5, 6);
    add_lora(&a, "layer.v_proj", 2, 5, 4);
    // q_proj: 6 / sqrt(4) = 3; v_proj (rank_pattern r = 2): 6 / sqrt(2).
    write_adapter(ad, "{\"peft_type\": \"LORA\", \"r\": 4, \"lora_alpha\": 6, \"use_rslora\": true, "
                      "\"rank_pattern\": {\"v_proj\": 2}, \"target_modules\": [\"q_proj\", \"v_proj\"]}", &a);
    lm_st_file *st = merge_one(&f, ad, NULL);
    if (st) {
        check_lora(st, &f.base, &a, "layer.q_proj", 4, 3.0, false, 1.0);
        check_lora(st, &f.base, &a, "layer.v_proj", 2, 6.0 / sqrt(2.0), false, 1.0);
        check_same(st, &f.base, "other.v_proj.weight");
    }
    lm_st_close(st);
    ts_free(&a);
    free(ad);
    fx_close(&f);
}

static void test_lora_patterns(void)
{
    fixture f;
    fx_open(&f, lora_base, "float32");
    char *ad = subdir(f.root, "ad");
    tset a = {0};
    rng_seed(23);
    add_lora(&a, "layer.q_proj", 2, 5, 6);
    add_lora(&a, "layer.v_proj", 3, 5, 4);
    add_lora(&a, "other.v_proj", 3, 5, 3);
    // rank_pattern: "v_proj" comes first and matches both v_proj modules (r = 3), so the later
    // "layer.v_proj" never applies. alpha_pattern: "proj" matches nothing ((.*\.)?(proj)$ needs
    // a dot before it); "other.v_proj" gives 1.5 to other.v_proj, before "v_proj" (9) could;
    // layer.v_proj gets 9. Scales: q_proj 4 / 2 = 2, layer.v_proj 9 / 3 = 3, other.v_proj 0.5.
    write_adapter(ad, "{\"peft_type\": \"LORA\", \"r\": 2, \"lora_alpha\": 4, "
                      "\"rank_pattern\": {\"v_proj\": 3, \"layer.v_proj\": 1}, "
                      "\"alpha_pattern\": {\"proj\": 100, \"other.v_proj\": 1.5, \"v_proj\": 9}, "
                      "\"target_modules\": [\"q_proj\", \"v_proj\"]}", &a);
    lm_st_file *st = merge_one(&f, ad, NULL);
    if (st) {
        check_lora(st, &f.base, &a, "layer.q_proj", 2, 2.0, false, 1.0);
        check_lora(st, &f.base, &a, "layer.v_proj", 3, 3.0, false, 1.0);
        check_lora(st, &f.base, &a, "other.v_proj", 3, 0.5, false, 1.0);
    }
    lm_st_close(st);
    ts_free(&a);
    free(ad);
    fx_close(&f);
}

static void test_lora_fan_in_fan_out(void)
{
    fixture f;
    fx_open(&f, lora_base, "float32");
    char *ad = subdir(f.root, "ad");
    tset a = {0};
    rng_seed(24);
    // Base weights read as [in, out]: q_proj [6, 5] is in 6, out 5; other.v_proj [3, 5] in 3, out 5.
    add_lora(&a, "layer.q_proj", 2, 6, 5);
    add_lora(&a, "other.v_proj", 2, 3, 5);
    write_adapter(ad, "{\"peft_type\": \"LORA\", \"r\": 2, \"lora_alpha\": 3, \"fan_in_fan_out\": true, "
                      "\"target_modules\": [\"q_proj\", \"v_proj\"]}", &a);
    lm_st_file *st = merge_one(&f, ad, NULL);
    if (st) {
        check_lora(st, &f.base, &a, "layer.q_proj", 2, 1.5, true, 1.0);
        check_lora(st, &f.base, &a, "other.v_proj", 2, 1.5, true, 1.0);
        check_same(st, &f.base, "layer.v_proj.weight");
    }
    lm_st_close(st);
    ts_free(&a);
    free(ad);
    fx_close(&f);
}

static void test_lora_bias(void)
{
    fixture f;
    fx_open(&f, lora_base, "float32");
    char *ad = subdir(f.root, "ad");
    tset a = {0};
    rng_seed(25);
    add_lora(&a, "layer.q_proj", 2, 5, 6);
    fill_q(ts_add1(&a, "base_model.model.layer.q_proj.lora_B.bias", 6), 6, 1.0, 8);
    add_lora(&a, "layer.v_proj", 2, 5, 4);  // no bias of its own (the base has none)
    write_adapter(ad, "{\"peft_type\": \"LORA\", \"r\": 2, \"lora_alpha\": 5, \"lora_bias\": true, "
                      "\"target_modules\": [\"q_proj\", \"v_proj\"]}", &a);
    lm_merge_result res;
    memset(&res, 0, sizeof res);
    lm_st_file *st = merge_one(&f, ad, &res);
    if (st) {
        check_lora(st, &f.base, &a, "layer.q_proj", 2, 2.5, false, 1.0);
        check_lora(st, &f.base, &a, "layer.v_proj", 2, 2.5, false, 1.0);
        const float *bias = ts_get(&a, "base_model.model.layer.q_proj.lora_B.bias");
        double tau[6];
        for (int j = 0; j < 6; j++)
            tau[j] = 2.5 * bias[j];
        check_sum(st, &f.base, "layer.q_proj.bias", tau, NULL, 1.0);
        CHECK_MSG(res.n_merged == 3, "merged %lld", (long long)res.n_merged);
        lm_merge_result_free(&res);
    }
    lm_st_close(st);
    ts_free(&a);
    free(ad);
    fx_close(&f);
}

static void test_lora_dora(void)
{
    fixture f;
    fx_open(&f, lora_base, "float32");
    char *ad = subdir(f.root, "ad");
    tset a = {0};
    rng_seed(26);
    add_lora(&a, "layer.q_proj", 2, 5, 6);
    float *mq = ts_add1(&a, "base_model.model.layer.q_proj.lora_magnitude_vector", 6);
    add_lora(&a, "other.v_proj", 2, 5, 3);
    float *mv = ts_add1(&a, "base_model.model.other.v_proj.lora_magnitude_vector", 3);
    for (int j = 0; j < 6; j++)
        mq[j] = (float)fabs(rng_qmag(0.5, 3.0, 8));
    for (int j = 0; j < 3; j++)
        mv[j] = (float)fabs(rng_qmag(0.5, 3.0, 8));
    write_adapter(ad, "{\"peft_type\": \"LORA\", \"r\": 2, \"lora_alpha\": 4, \"use_dora\": true, "
                      "\"target_modules\": [\"q_proj\", \"v_proj\"]}", &a);
    lm_st_file *st = merge_one(&f, ad, NULL);
    static const char *paths[2] = {"layer.q_proj", "other.v_proj"};
    const float *mags[2] = {mq, mv};
    for (int p = 0; p < 2 && st; p++) {
        char bname[128];
        snprintf(bname, sizeof bname, "%s.weight", paths[p]);
        const tensor *bt = ts_find(&f.base, bname);
        int64_t rows = bt->shape[0], cols = bt->shape[1];
        double *dw = malloc((size_t)bt->n * sizeof *dw), *dm = malloc((size_t)bt->n * sizeof *dm);
        double *tau = malloc((size_t)bt->n * sizeof *tau), *mag = malloc((size_t)bt->n * sizeof *mag);
        lora_tau(&f.base, &a, paths[p], bname, 2, 2.0, false, dw, dm);
        // τ = m / ‖θ_b + ΔW‖_row ⊙ (θ_b + ΔW) − θ_b, the norm over each output row.
        for (int64_t r = 0; r < rows; r++) {
            double ss = 0;
            for (int64_t c = 0; c < cols; c++) {
                double wv = bt->v[r * cols + c] + dw[r * cols + c];
                ss += wv * wv;
            }
            double g = mags[p][r] / sqrt(ss);
            for (int64_t c = 0; c < cols; c++) {
                int64_t j = r * cols + c;
                double wv = bt->v[j] + dw[j];
                tau[j] = g * wv - bt->v[j];
                mag[j] = fabs(g * wv) + fabs((double)bt->v[j]) + g * (fabs((double)bt->v[j]) + dm[j]);
            }
        }
        check_sum(st, &f.base, bname, tau, mag, 1.0);
        free(dw);
        free(dm);
        free(tau);
        free(mag);
    }
    if (st)
        check_same(st, &f.base, "layer.v_proj.weight");
    lm_st_close(st);
    ts_free(&a);
    free(ad);
    fx_close(&f);
}

static void test_lora_embedding(void)
{
    fixture f;
    fx_open(&f, lora_base, "float32");
    char *ad = subdir(f.root, "ad");
    tset a = {0};
    rng_seed(27);
    // Base [vocab 7, hidden 5]; A [r, vocab], B [hidden, r]; τ = s · (B @ A)ᵀ.
    float *A = ts_add2(&a, "base_model.model.model.embed_tokens.lora_embedding_A", 2, 7);
    float *B = ts_add2(&a, "base_model.model.model.embed_tokens.lora_embedding_B", 5, 2);
    fill_q(A, 14, 1.0, 8);
    fill_q(B, 10, 1.0, 8);
    write_adapter(ad, "{\"peft_type\": \"LORA\", \"r\": 2, \"lora_alpha\": 4, "
                      "\"target_modules\": [\"embed_tokens\"]}", &a);
    lm_st_file *st = merge_one(&f, ad, NULL);
    if (st) {
        double tau[35], mag[35];
        lora_ref(tau, mag, A, B, 2, 7, 5, 2.0, true);
        check_sum(st, &f.base, "model.embed_tokens.weight", tau, mag, 1.0);
        check_same(st, &f.base, "lm_head.weight");
    }
    lm_st_close(st);
    ts_free(&a);
    free(ad);
    fx_close(&f);
}

static void test_lora_modules_to_save(void)
{
    fixture f;
    fx_open(&f, lora_base, "float32");
    char *ad = subdir(f.root, "ad");
    tset a = {0};
    rng_seed(28);
    add_lora(&a, "layer.q_proj", 2, 5, 6);
    float *saved = ts_add2(&a, "base_model.model.lm_head.weight", 7, 5);
    fill_q(saved, 35, 2.0, 12);
    write_adapter(ad, "{\"peft_type\": \"LORA\", \"r\": 2, \"lora_alpha\": 2, "
                      "\"target_modules\": [\"q_proj\"], \"modules_to_save\": [\"lm_head\"]}", &a);
    const float *b = ts_get(&f.base, "lm_head.weight");
    double tau[35];
    for (int j = 0; j < 35; j++)
        tau[j] = (double)saved[j] - (double)b[j];
    lm_st_file *st = merge_one(&f, ad, NULL);
    if (st) {
        // λ = 1: the saved tensor replaces the base one, exactly.
        double e[35];
        for (int j = 0; j < 35; j++)
            e[j] = saved[j];
        check_exact(st, "lm_head.weight", e, 35);
        check_lora(st, &f.base, &a, "layer.q_proj", 2, 1.0, false, 1.0);
    }
    lm_st_close(st);
    // λ = 0.5, weight 1: θ_b + 0.5 (saved − θ_b).
    const double w = 1.0;
    const char *dirs[1] = {ad};
    st = merge_ta(&f, dirs, 1, &w, 0.5, false, NULL);
    if (st)
        check_sum(st, &f.base, "lm_head.weight", tau, NULL, 0.5);
    lm_st_close(st);
    ts_free(&a);
    free(ad);
    fx_close(&f);
}

// A tensor an FT does not touch: τ = 0, and the FT is left out of that tensor's divisor (and
// election). FT A is a full model (touches every tensor, with some exact zeros in τ that still
// count); FT B an adapter touching only layer.q_proj.weight.
static void test_untouched_tensor(void)
{
    fixture f;
    fx_open(&f, lora_base, "float32");
    char *fa = subdir(f.root, "full"), *fb = subdir(f.root, "ad");
    double *tau_a[MAX_T], *tau_b[MAX_T] = {0};
    alloc_taus(&f.base, tau_a);
    rng_seed(29);
    for (int t = 0; t < f.base.n; t++)
        for (int64_t j = 0; j < f.base.t[t].n; j++)
            tau_a[t][j] = j % 4 == 1 ? 0.0 : rng_qmag(0.125, 1.0, 6);
    write_ft(fa, &f.base, tau_a);
    tset a = {0};
    add_lora(&a, "layer.q_proj", 2, 5, 6);
    write_adapter(fb, "{\"peft_type\": \"LORA\", \"r\": 2, \"lora_alpha\": 4, "
                      "\"target_modules\": [\"q_proj\"]}", &a);
    int q = ts_index(&f.base, "layer.q_proj.weight");
    tau_b[q] = calloc(30, sizeof(double));
    lora_tau(&f.base, &a, "layer.q_proj", "layer.q_proj.weight", 2, 2.0, false, tau_b[q], NULL);

    const double w[2] = {1.0, 3.0};
    const char *dirs[2] = {fa, fb};
    double *tp[2][MAX_T];
    for (int t = 0; t < MAX_T; t++) {
        tp[0][t] = tau_a[t];
        tp[1][t] = tau_b[t];
    }
    // Task arithmetic with normalize: q_proj (τ_A + 3 τ_B) / 4, every other tensor τ_A / 1.
    combo c = {.k = 2, .w = w, .sign = SIGN_NONE, .normalize = true, .lambda = 1.0};
    lm_merge_result res;
    memset(&res, 0, sizeof res);
    lm_st_file *st = merge_ta(&f, dirs, 2, w, 1.0, true, &res);
    if (st) {
        check_combined(st, &f.base, &c, tp);
        // An explicit spot check of the rule on an untouched tensor.
        float *got = out_values(st, "norm.weight", 5);
        const float *b = ts_get(&f.base, "norm.weight");
        int nw = ts_index(&f.base, "norm.weight");
        if (got)
            CHECK_NEAR(got[0], (double)b[0] + tau_a[nw][0], 1e-6);
        free(got);
        CHECK(res.n_merged == f.base.n);
        lm_merge_result_free(&res);
    }
    lm_st_close(st);

    // The other sums without an election at density 1 (every entry kept, rescale 1) with
    // normalize: DARE, breadcrumbs, della-linear, the same divisors (mergekit's are Σ w over all).
    const double d[2] = {1.0, 1.0};
    const lm_merge_method sums[] = {LM_MERGE_DARE, LM_MERGE_BREADCRUMBS, LM_MERGE_DELLA_LINEAR};
    lm_merge_opts o;
    for (size_t m = 0; m < sizeof sums / sizeof sums[0]; m++) {
        o = fixture_merge_opts(sums[m], 2, w, d);
        o.normalize = true;
        st = run_merge(f.root, &o, f.base_dir, dirs, NULL);
        if (st)
            check_combined(st, &f.base, &c, tp);
        lm_st_close(st);
    }

    // TIES at density 1, sign by count and by sum, normalize.
    for (int sign = SIGN_SUM; sign <= SIGN_COUNT; sign++) {
        o = fixture_merge_opts(LM_MERGE_TIES, 2, w, d);
        o.sign = sign == SIGN_SUM ? LM_SIGN_SUM : LM_SIGN_COUNT;
        c.sign = sign;
        st = run_merge(f.root, &o, f.base_dir, dirs, NULL);
        if (st)
            check_combined(st, &f.base, &c, tp);
        lm_st_close(st);
    }
    free_taus(tau_a);
    free(tau_b[q]);
    ts_free(&a);
    free(fa);
    free(fb);
    fx_close(&f);
}

// ==== BF16 output =============================================================================

// The bf16 nearest to float x, ties to even, from its bits (x finite).
static uint16_t ref_bf16(float x)
{
    uint32_t u;
    memcpy(&u, &x, 4);
    uint32_t hi = u >> 16, lo = u & 0xFFFFu;
    if (lo > 0x8000u || (lo == 0x8000u && (hi & 1u)))
        hi++;
    return (uint16_t)hi;
}

static void bf16_base(tset *b)
{
    float *x = ts_add(b, "x.weight", LM_DTYPE_BF16, 2, 4, 8);
    float *y = ts_add(b, "y.weight", LM_DTYPE_BF16, 1, 3, 0);
    // Built cases (with the deltas of test_bf16_output), then random multiples of 1/8 in ±4.
    static const double xb[10] = {1, 1 + 0x1p-7, 1, 1, -1, -(1 + 0x1p-7), 256, 258, 0 /* NaN */, 3};
    for (int j = 0; j < 10; j++)
        x[j] = (float)xb[j];
    x[8] = NAN;
    rng_seed(121);
    for (int j = 10; j < 32; j++)
        x[j] = (float)rng_q(4.0, 3);
    for (int j = 0; j < 3; j++)
        y[j] = (float)rng_q(4.0, 3);
}

static void test_bf16_output(void)
{
    fixture f;
    fx_open(&f, bf16_base, "bfloat16");
    char *ad = subdir(f.root, "ad");
    // τ = B @ I = B exactly (r = 8, alpha 8, s = 1), in F32: deltas bf16 cannot hold.
    tset a = {0};
    float *A = ts_add2(&a, "base_model.model.x.lora_A.weight", 8, 8);
    float *B = ts_add2(&a, "base_model.model.x.lora_B.weight", 4, 8);
    for (int k = 0; k < 8; k++)
        A[k * 8 + k] = 1;
    static const double delta[10] = {
        0x1p-8,              // 1 + half an ulp: tie, to even 1
        0x1p-8,              // (1 + 2^-7) + half: tie, to even 1 + 2^-6
        0x1p-8 + 0x1p-20,    // above half: up
        0x1p-8 - 0x1p-20,    // below half: down
        -0x1p-8,             // −1 − half: tie, to even −1
        -0x1p-8,             // −(1 + 2^-7) − half: to −(1 + 2^-6)
        1.0,                 // 256 + half an ulp (2): tie, to even 256
        1.0,                 // 258 + 1: tie between 258 (odd) and 260: 260
        0.25,                // NaN stays NaN
        0x1p-9 * 3,          // 3 + 3·2^-9: below half an ulp (2^-7 in [2, 4)): down to 3
    };
    rng_seed(122);
    for (int j = 0; j < 32; j++)
        B[j] = (float)(j < 10 ? delta[j] : rng_q(1.0, 14));
    write_adapter(ad, "{\"peft_type\": \"LORA\", \"r\": 8, \"lora_alpha\": 8, \"target_modules\": [\"x\"]}", &a);
    const float *xb = ts_get(&f.base, "x.weight");
    double exact[32];
    for (int j = 0; j < 32; j++)
        exact[j] = (double)xb[j] + (double)B[j];  // exact in float32 by construction
    static const double want_built[10] = {1, 1 + 0x1p-6, 1 + 0x1p-7, 1, -1, -(1 + 0x1p-6), 256, 260, NAN, 3};

    const double w = 1.0;
    const char *dirs[1] = {ad};
    for (int run = 0; run < 2; run++) {
        double dd = 1.0;
        lm_merge_opts o = fixture_merge_opts(LM_MERGE_TASK_ARITHMETIC, 1, &w, &dd);
        o.out_dtype = run == 0 ? LM_DTYPE_BF16 : LM_DTYPE_F32;
        lm_st_file *st = run_merge(f.root, &o, f.base_dir, dirs, NULL);
        const lm_st_tensor *t = st ? lm_st_find(st, "x.weight") : NULL;
        const lm_st_tensor *ty = st ? lm_st_find(st, "y.weight") : NULL;
        CHECK(t && ty && t->dtype == o.out_dtype && ty->dtype == o.out_dtype);
        if (t && ty && t->dtype == o.out_dtype && run == 0) {
            uint16_t got[32];
            memcpy(got, t->data, sizeof got);
            int64_t bad = 0, first = -1;
            for (int j = 0; j < 32; j++) {
                bool ok;
                if (j == 8) {
                    ok = (got[j] & 0x7F80u) == 0x7F80u && (got[j] & 0x7Fu) != 0;
                } else {
                    float e = (float)exact[j];
                    CHECK((double)e == exact[j]);
                    ok = got[j] == ref_bf16(e);
                    if (j < 10)
                        ok &= lm_bf16_to_f32(got[j]) == (float)want_built[j];
                }
                if (!ok && bad++ == 0)
                    first = j;
            }
            CHECK_MSG(bad == 0, "bf16 output: %lld of 32 wrong; first [%lld]: got 0x%04x, expected 0x%04x",
                      (long long)bad, (long long)first, first >= 0 ? got[first] : 0,
                      first >= 0 ? ref_bf16((float)exact[first]) : 0);
            uint16_t gy[3];
            memcpy(gy, ty->data, sizeof gy);
            const float *yb = ts_get(&f.base, "y.weight");
            for (int j = 0; j < 3; j++)
                CHECK(gy[j] == ref_bf16(yb[j]));
        } else if (t && ty && t->dtype == o.out_dtype) {
            // float32 output from a bf16 base: the exact sums.
            check_exact(st, "x.weight", exact, 32);
            const float *yb = ts_get(&f.base, "y.weight");
            double ey[3] = {yb[0], yb[1], yb[2]};
            check_exact(st, "y.weight", ey, 3);
        }
        lm_st_close(st);
    }
    ts_free(&a);
    free(ad);
    fx_close(&f);
}

// ==== options and inputs ======================================================================

// Runs lm_merge_check_opts(o) in a child process. Returns 0 when it failed with LM_ERR_USAGE and
// a message containing `needle`, 1 when it failed otherwise, 2 when it succeeded, or 1000 + the
// signal that killed the child.
static int check_opts_in_child(const lm_merge_opts *o, const char *needle)
{
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        lm_err err = {0};
        lm_status s = lm_merge_check_opts(o, &err);
        _exit(s == LM_OK ? 2 : s == LM_ERR_USAGE && strstr(err.msg, needle) ? 0 : 1);
    }
    int ws = 0;
    if (pid < 0 || waitpid(pid, &ws, 0) != pid)
        return 3;
    return WIFSIGNALED(ws) ? 1000 + WTERMSIG(ws) : WEXITSTATUS(ws);
}

static const char *child_outcome(int st)
{
    static char buf[64];
    if (st >= 1000)
        snprintf(buf, sizeof buf, "lm_merge_check_opts crashed with signal %d", st - 1000);
    else
        snprintf(buf, sizeof buf, "%s", st == 2 ? "accepted" : st == 1 ? "other status or message" : "ok");
    return buf;
}

static void test_options(void)
{
    lm_err err = {0};
    const double w2[2] = {1, 1}, d2[2] = {0.5, 0.5};
    lm_merge_opts o = fixture_merge_opts(LM_MERGE_TIES, 2, w2, d2);
    CHECK_OK(lm_merge_check_opts(&o, &err), &err);

    const double d0[2] = {0.0, 0.5}, d15[2] = {0.5, 1.5}, dnan[2] = {0.5, NAN};
    o.densities = d0;
    CHECK_FAILS(lm_merge_check_opts(&o, &err), LM_ERR_USAGE, "densit", &err);
    o.densities = d15;
    CHECK_FAILS(lm_merge_check_opts(&o, &err), LM_ERR_USAGE, "densit", &err);
    o.densities = dnan;
    CHECK_FAILS(lm_merge_check_opts(&o, &err), LM_ERR_USAGE, "densit", &err);
    o.densities = d2;
    CHECK_OK(lm_merge_check_opts(&o, &err), &err);

    // Counts: the struct carries one count, n_ft, so a mismatch is an array missing for n_ft FTs.
    // Checked in a child process, so that a crash is one failed check, not the end of the run.
    o.weights = NULL;
    int st = check_opts_in_child(&o, "weight");
    CHECK_MSG(st == 0, "weights NULL for 2 FTs: %s", child_outcome(st));
    o.weights = w2;
    o.densities = NULL;
    st = check_opts_in_child(&o, "densit");
    CHECK_MSG(st == 0, "densities NULL for 2 FTs (ties): %s", child_outcome(st));
    o.densities = d2;

    const double winf[2] = {1, INFINITY};
    o.weights = winf;
    CHECK_FAILS(lm_merge_check_opts(&o, &err), LM_ERR_USAGE, "weight", &err);
    o.weights = w2;
    o.lambda = NAN;
    CHECK_FAILS(lm_merge_check_opts(&o, &err), LM_ERR_USAGE, "lambda", &err);
    o.lambda = 1.0;
    o.out_dtype = LM_DTYPE_I32;
    CHECK(lm_merge_check_opts(&o, &err) == LM_ERR_USAGE);
    o.out_dtype = LM_DTYPE_BF16;
    CHECK_OK(lm_merge_check_opts(&o, &err), &err);

    CHECK(lm_merge_default_normalize(LM_MERGE_TIES));
    CHECK(!lm_merge_default_normalize(LM_MERGE_DARE));
    CHECK(!lm_merge_default_normalize(LM_MERGE_DARE_TIES));
    CHECK(!lm_merge_default_normalize(LM_MERGE_TASK_ARITHMETIC));
    CHECK(strcmp(lm_merge_method_name(LM_MERGE_TIES), "ties") == 0);
    CHECK(strcmp(lm_merge_method_name(LM_MERGE_DARE), "dare") == 0);
    CHECK(strcmp(lm_merge_method_name(LM_MERGE_DARE_TIES), "dare-ties") == 0);
    CHECK(strcmp(lm_merge_method_name(LM_MERGE_TASK_ARITHMETIC), "task-arithmetic") == 0);
}

static void test_ft_open(void)
{
    fixture f;
    fx_open(&f, lora_base, "float32");
    lm_err err = {0};
    lm_model *base = NULL;
    CHECK_OK(lm_model_open(&base, f.base_dir, &err), &err);
    char *ad = subdir(f.root, "ad"), *fd = subdir(f.root, "full");
    lm_ft *ft = NULL;
    if (base) {
        // An adapter whose A does not fit the base [6, 5]: A [2, 4].
        tset a = {0};
        ts_add2(&a, "base_model.model.layer.q_proj.lora_A.weight", 2, 4);
        ts_add2(&a, "base_model.model.layer.q_proj.lora_B.weight", 6, 2);
        write_adapter(ad, "{\"peft_type\": \"LORA\", \"r\": 2, \"lora_alpha\": 4, \"target_modules\": [\"q_proj\"]}", &a);
        CHECK_FAILS(lm_ft_open(&ft, ad, base, &err), LM_ERR_MISMATCH,
                    "base_model.model.layer.q_proj.lora_A.weight", &err);
        CHECK(strstr(err.msg, "layer.q_proj.weight") != NULL);
        CHECK(ft == NULL);
        ts_free(&a);

        // A fitting one opens as an adapter.
        add_lora(&a, "layer.q_proj", 2, 5, 6);
        write_adapter(ad, "{\"peft_type\": \"LORA\", \"r\": 2, \"lora_alpha\": 4, \"target_modules\": [\"q_proj\"]}", &a);
        CHECK_OK(lm_ft_open(&ft, ad, base, &err), &err);
        CHECK(ft && ft->kind == LM_INPUT_ADAPTER && ft->adapter && !ft->model);
        lm_ft_free(ft);
        ft = NULL;
        ts_free(&a);

        // A full model with a tensor of another shape names the tensor.
        tset m = ts_copy(&f.base);
        for (int t = 0; t < m.n; t++) {
            if (strcmp(m.t[t].name, "other.v_proj.weight") == 0) {
                m.t[t].shape[0] = 5;
                m.t[t].shape[1] = 3;
            }
        }
        write_model(fd, &m, "float32");
        CHECK_FAILS(lm_ft_open(&ft, fd, base, &err), LM_ERR_MISMATCH, "other.v_proj.weight", &err);
        CHECK(ft == NULL);
        ts_free(&m);
        m = ts_copy(&f.base);
        write_model(fd, &m, "float32");
        CHECK_OK(lm_ft_open(&ft, fd, base, &err), &err);
        CHECK(ft && ft->kind == LM_INPUT_MODEL && ft->model && !ft->adapter);
        lm_ft_free(ft);
        lm_ft_free(NULL);
        ts_free(&m);
    }
    lm_model_free(base);
    free(ad);
    free(fd);
    fx_close(&f);
}

// Tensors in a dtype llmerge does not compute with (here I32, its raw values in the floats'
// storage): one that differs between base and FT is refused when the FT is opened, naming the
// tensor, both dtypes and the FT; one equal in both is copied as it is.
static void odd_base(tset *b)
{
    rng_seed(12);
    fill_q(ts_add2(b, "w.weight", 4, 6), 24, 2.0, 12);
    fill_q(ts_add1(b, "norm.weight", 6), 6, 2.0, 12);
    int32_t *steps = (int32_t *)ts_add(b, "steps", LM_DTYPE_I32, 1, 3, 0);
    for (int i = 0; i < 3; i++)
        steps[i] = 1000 + i;
}

static void test_ft_dtypes(void)
{
    fixture f;
    fx_open(&f, odd_base, "float32");
    lm_err err = {0};
    lm_model *base = NULL;
    CHECK_OK(lm_model_open(&base, f.base_dir, &err), &err);
    char *same = subdir(f.root, "same"), *other = subdir(f.root, "other"), *norm = subdir(f.root, "norm");
    lm_ft *ft = NULL;
    if (base) {
        tset m = ts_copy(&f.base);
        for (int64_t j = 0; j < m.t[0].n; j++)
            m.t[0].v[j] += 0.5f;
        write_model(same, &m, "float32");
        ((int32_t *)m.t[2].v)[1] = 7;
        write_model(other, &m, "float32");
        CHECK_FAILS(lm_ft_open(&ft, other, base, &err), LM_ERR_UNSUPPORTED, "tensor 'steps' is I32 here and I32 in",
                    &err);
        CHECK(ft == NULL && strstr(err.msg, other) != NULL);
        ts_free(&m);
        m = ts_copy(&f.base);
        m.t[1].dt = LM_DTYPE_I32;  // the same bits, but no longer floats
        write_model(norm, &m, "float32");
        CHECK_FAILS(lm_ft_open(&ft, norm, base, &err), LM_ERR_UNSUPPORTED,
                    "tensor 'norm.weight' is I32 here and F32 in the base", &err);
        ts_free(&m);

        // equal: the FT opens, and the merge copies the tensor
        const char *dirs[1] = {same};
        double w = 1.0, d = 1.0;
        lm_merge_opts o = fixture_merge_opts(LM_MERGE_TASK_ARITHMETIC, 1, &w, &d);
        lm_st_file *st = run_merge(f.root, &o, f.base_dir, dirs, NULL);
        const lm_st_tensor *t = st ? lm_st_find(st, "steps") : NULL;
        CHECK(t && t->dtype == LM_DTYPE_I32 && t->nbytes == 12 && memcmp(t->data, f.base.t[2].v, 12) == 0);
        lm_st_close(st);
    }
    lm_model_free(base);
    free(same);
    free(other);
    free(norm);
    fx_close(&f);
}

// ==== NaN and Inf ===============================================================================
// NaN and ±Inf in the base, in a full FT, in an adapter's LoRA factors, bias delta and saved
// tensor, and in a DoRA adapter's magnitudes: res->nonfinite must give, for every input tensor
// the merge reads, the number of each among its values, and for every output tensor those in
// the file written, each value counted once, whatever the method, the slabs, the device and its
// fallbacks.

typedef struct nf_want {
    int input;
    const char *name;
    uint64_t nan, inf;
} nf_want;

static void nf_of(nf_want *w, int input, const char *name, const float *v, int64_t n)
{
    *w = (nf_want){input, name, 0, 0};
    for (int64_t j = 0; j < n; j++) {
        w->nan += isnan(v[j]) != 0;
        w->inf += isinf(v[j]) != 0;
    }
}

// Whether res holds exactly the wanted records with any NaN or Inf (each once).
static void check_nonfinite(const lm_merge_result *res, const nf_want *want, int n_want, const char *what)
{
    int expected = 0;
    for (int i = 0; i < n_want; i++) {
        const nf_want *w = &want[i];
        if (!w->nan && !w->inf)
            continue;
        expected++;
        int found = 0;
        for (int64_t r = 0; r < res->n_nonfinite; r++) {
            const lm_merge_nonfinite *g = &res->nonfinite[r];
            if (g->input != w->input || strcmp(g->tensor, w->name) != 0)
                continue;
            found++;
            CHECK_MSG(g->nan == w->nan && g->inf == w->inf,
                      "%s: input %d's %s: %llu NaN, %llu Inf counted, %llu, %llu there", what, w->input, w->name,
                      (unsigned long long)g->nan, (unsigned long long)g->inf, (unsigned long long)w->nan,
                      (unsigned long long)w->inf);
        }
        CHECK_MSG(found == 1, "%s: input %d's %s listed %d times", what, w->input, w->name, found);
    }
    CHECK_MSG(res->n_nonfinite == expected, "%s: %lld tensors listed, %d hold NaN or Inf", what,
              (long long)res->n_nonfinite, expected);
}

static void test_nonfinite(void)
{
    fixture f;
    memset(&f, 0, sizeof f);
    f.root = make_tmpdir();
    f.base_dir = subdir(f.root, "base");
    lora_base(&f.base);
    float *bq = (float *)ts_get(&f.base, "layer.q_proj.weight"), *bo = (float *)ts_get(&f.base, "other.v_proj.weight");
    bq[3] = INFINITY;
    bo[2] = NAN;
    ((float *)ts_get(&f.base, "norm.weight"))[1] = -INFINITY;
    write_model(f.base_dir, &f.base, "float32");
    // a full FT: the base a little changed, with its own NaN and Inf
    char *full = subdir(f.root, "full"), *ad = subdir(f.root, "ad"), *dora = subdir(f.root, "dora");
    tset m = ts_copy(&f.base);
    rng_seed(40);
    for (int t = 0; t < m.n; t++)
        for (int64_t j = 0; j < m.t[t].n; j++)
            m.t[t].v[j] += (float)rng_q(0.25, 4);
    ((float *)ts_get(&m, "layer.v_proj.weight"))[7] = NAN;
    ((float *)ts_get(&m, "lm_head.weight"))[0] = INFINITY;
    ((float *)ts_get(&m, "lm_head.weight"))[1] = -INFINITY;
    write_model(full, &m, "float32");
    // an adapter: a NaN in q_proj's A (a column of its product), an Inf in its bias delta, a
    // NaN in the lm_head it saves
    tset a = {0};
    add_lora(&a, "layer.q_proj", 2, 5, 6);
    float *bias = ts_add1(&a, "base_model.model.layer.q_proj.lora_B.bias", 6);
    fill_q(bias, 6, 1.0, 8);
    float *saved = ts_add2(&a, "base_model.model.lm_head.weight", 7, 5);
    fill_q(saved, 35, 2.0, 12);
    ((float *)lora_factor(&a, "layer.q_proj", ".lora_A.weight"))[1] = NAN;
    bias[4] = INFINITY;
    saved[9] = NAN;
    write_adapter(ad, "{\"peft_type\": \"LORA\", \"r\": 2, \"lora_alpha\": 4, \"lora_bias\": true, "
                      "\"target_modules\": [\"q_proj\"], \"modules_to_save\": [\"lm_head\"]}", &a);
    // DoRA on other.v_proj: an Inf magnitude
    tset dm = {0};
    add_lora(&dm, "other.v_proj", 2, 5, 3);
    float *mag = ts_add1(&dm, "base_model.model.other.v_proj.lora_magnitude_vector", 3);
    for (int j = 0; j < 3; j++)
        mag[j] = 1.0f + (float)j;
    mag[1] = INFINITY;
    write_adapter(dora, "{\"peft_type\": \"LORA\", \"r\": 2, \"lora_alpha\": 4, \"use_dora\": true, "
                        "\"target_modules\": [\"v_proj\"]}", &dm);

    nf_want want[64];
    int n_in = 0;
    for (int t = 0; t < f.base.n; t++)
        nf_of(&want[n_in++], 0, f.base.t[t].name, f.base.t[t].v, f.base.t[t].n);
    for (int t = 0; t < m.n; t++)
        nf_of(&want[n_in++], 1, m.t[t].name, m.t[t].v, m.t[t].n);
    for (int t = 0; t < a.n; t++)
        nf_of(&want[n_in++], 2, a.t[t].name, a.t[t].v, a.t[t].n);
    for (int t = 0; t < dm.n; t++)
        nf_of(&want[n_in++], 3, dm.t[t].name, dm.t[t].v, dm.t[t].n);

    const char *dirs[3] = {full, ad, dora};
    double w[3] = {1.0, 0.5, 1.0}, d[3] = {0.5, 0.5, 0.5};
    static const struct { lm_merge_method m; bool global, l1; int64_t slab; lm_dtype out; } cfg[] = {
        {LM_MERGE_TIES, false, false, 0, LM_DTYPE_F32},
        {LM_MERGE_TIES, false, false, 10, LM_DTYPE_BF16},
        {LM_MERGE_TIES, true, false, 10, LM_DTYPE_F32},
        {LM_MERGE_DARE, false, true, 0, LM_DTYPE_F16},
        {LM_MERGE_DARE_TIES, false, false, 5, LM_DTYPE_F32},
        {LM_MERGE_TASK_ARITHMETIC, false, false, 0, LM_DTYPE_F32},
        {LM_MERGE_TASK_ARITHMETIC, false, false, 10, LM_DTYPE_F16},
    };
    const char *devices[] = {NULL, "sim:1GiB", "sim:700"};
    int64_t fell_back = 0;  // units that went from sim:700 to the CPU
    for (size_t dv = 0; dv < sizeof devices / sizeof devices[0]; dv++) {
        g_device = devices[dv];
        for (size_t c = 0; c < sizeof cfg / sizeof cfg[0]; c++) {
            lm_merge_opts o = fixture_merge_opts(cfg[c].m, 3, w, d);
            o.topk_global = cfg[c].global;
            o.rescale = cfg[c].l1 ? LM_RESCALE_L1 : LM_RESCALE_INV;
            o.slab_elems = cfg[c].slab;
            o.out_dtype = cfg[c].out;
            o.threads = 2;
            lm_merge_result res;
            memset(&res, 0, sizeof res);
            lm_st_file *st = run_merge(f.root, &o, f.base_dir, dirs, &res);
            if (!st)
                continue;
            nf_want all[64];
            memcpy(all, want, (size_t)n_in * sizeof *want);
            int n = n_in;
            uint64_t out_nan = 0;
            for (int t = 0; t < f.base.n; t++) {
                float *v = out_values(st, f.base.t[t].name, f.base.t[t].n);
                if (v)
                    nf_of(&all[n++], -1, f.base.t[t].name, v, f.base.t[t].n);
                out_nan += v ? all[n - 1].nan : 0;
                free(v);
            }
            char what[96];
            snprintf(what, sizeof what, "%s (config %zu) on %s", lm_merge_method_name(cfg[c].m), c,
                     devices[dv] ? devices[dv] : "cpu");
            check_nonfinite(&res, all, n, what);
            CHECK_MSG(out_nan > 0, "%s: no NaN in the output", what);
            if (dv == 2)
                fell_back += res.fallback_merge + res.fallback_select + res.fallback_place;
            lm_merge_result_free(&res);
            lm_st_close(st);
        }
    }
    g_device = NULL;
    CHECK_MSG(fell_back > 0, "nothing fell back from sim:700");
    ts_free(&m);
    ts_free(&a);
    ts_free(&dm);
    free(full);
    free(ad);
    free(dora);
    fx_close(&f);
}

int main(void)
{
    test_options();
    test_ft_open();
    test_ft_dtypes();
    test_lora_alpha_over_r();
    test_lora_rslora();
    test_lora_patterns();
    test_lora_fan_in_fan_out();
    test_lora_bias();
    test_lora_dora();
    test_lora_embedding();
    test_lora_modules_to_save();
    test_untouched_tensor();
    test_bf16_output();
    test_nonfinite();
    return check_report("test_merge");
}
