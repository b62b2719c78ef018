// Tests of the merge methods (lib/methods/) against docs/merging.md, computed in ref_merge.h
// independently in double: TIES magnitude trimming with exactly k kept and ties at the
// threshold to the lower flat index, k = 0, sign election by sum and by count, normalize,
// lambda, weights, densities, --topk global; DARE masks as properties (each value dropped or
// rescaled, the kept fraction within a binomial bound, bit-identical for any thread count, slab
// size and tensor order, a different mask per seed and per model, L1 rescaling); DARE-TIES
// election on the DARE masks; sparsegpt's selection by Hessian importance. Every selection
// gives the same bytes in slabs, on more threads and on the simulated device.
#include <math.h>
#include <stdbool.h>
#include <stdint.h>

#include "check.h"
#include "merge.h"
#include "merge_fixture.h"
#include "ref_merge.h"
#include "safetensors.h"


// ==== fine-tuned models ======================================================================

// Creates f->root/ft<i> for FT i; the caller frees the path (free_fts).
static char *ft_dir(const fixture *f, int i)
{
    char nm[8];
    snprintf(nm, sizeof nm, "ft%d", i);
    return subdir(f->root, nm);
}

// Writes n full FTs of f's base into ft0, ft1, ...: every element of each τ drawn by gen, FT by
// FT and tensor by tensor. dirs[i] and tau[i] are FT i's; free them with free_fts.
static void make_fts(const fixture *f, int n, char **dirs, double *(*tau)[MAX_T], double (*gen)(void))
{
    for (int i = 0; i < n; i++) {
        dirs[i] = ft_dir(f, i);
        alloc_taus(&f->base, tau[i]);
        for (int t = 0; t < f->base.n; t++)
            for (int64_t j = 0; j < f->base.t[t].n; j++)
                tau[i][t][j] = gen();
        write_ft(dirs[i], &f->base, tau[i]);
    }
}

// Frees the n FTs' directories and τ.
static void free_fts(int n, char **dirs, double *(*tau)[MAX_T])
{
    for (int i = 0; i < n; i++) {
        free_taus(tau[i]);
        free(dirs[i]);
    }
}

// Generators for make_fts: multiples of 1/16 and of 1/8 in [-1, 1] (many ties), and of 2^-10.
static double gen_16ths(void)
{
    return rng_int(-16, 16) / 16.0;
}

static double gen_8ths(void)
{
    return rng_int(-8, 8) / 8.0;
}

static double gen_q10(void)
{
    return rng_q(1.0, 10);
}

// ==== TIES ====================================================================================

static void ties_base(tset *b)
{
    rng_seed(31);
    fill_q(ts_add2(b, "t.weight", 4, 6), 24, 2.0, 12);
    fill_q(ts_add1(b, "u.weight", 11), 11, 2.0, 12);
    fill_q(ts_add1(b, "v.weight", 3), 3, 2.0, 12);
    fill_q(ts_add2(b, "w.weight", 13, 17), 221, 2.0, 12);
}

// Magnitude trimming of one model: exactly k = floor(d · numel) kept, ties at the threshold to
// the lower flat index, k = 0 keeps nothing. One FT, weight 1, normalize: θ_b + τ' exactly.
static void test_ties_topk_exact(void)
{
    fixture f;
    fx_open(&f, ties_base, "float32");
    char *fd = subdir(f.root, "ft");
    double *tau[MAX_T];
    alloc_taus(&f.base, tau);
    // t: k = floor(0.3 · 24) = 7: 7/8 (index 9), 6/8 (17, 23), then four of the six 5/8
    // (2, 3, 5, 6 kept; 10 and 18 not).
    static const int tv[24] = {3, 1, 5, 5, -2, 5, -5, 1, 2, 7, -5, 0, 4, -4, 4, 1, -1, 6, 5, -3, 2, 0, 1, -6};
    for (int j = 0; j < 24; j++)
        tau[0][j] = tv[j] / 8.0;
    // u: k = floor(3.3) = 3: 3/8 (index 7), then the first two of the 2/8 (0 and 1).
    static const int uv[11] = {2, -2, 2, 1, -2, 2, 0, 3, -1, 2, -2};
    for (int j = 0; j < 11; j++)
        tau[1][j] = uv[j] / 8.0;
    // v: k = floor(0.9) = 0: nothing kept.
    rng_seed(32);
    for (int j = 0; j < 3; j++)
        tau[2][j] = rng_qmag(0.25, 1, 6);
    // w: k = floor(66.3) = 66 among values k/8 with many ties.
    for (int j = 0; j < 221; j++)
        tau[3][j] = rng_int(-8, 8) / 8.0;
    write_ft(fd, &f.base, tau);

    // The reference's masks for t and u, against the hand-worked sets above.
    bool keep[24];
    topk_ref(tau[0], 24, k_of(0.3, 24), keep);
    static const int kept_t[7] = {2, 3, 5, 6, 9, 17, 23};
    int nk = 0;
    bool hand = true;
    for (int j = 0; j < 24; j++) {
        bool want = false;
        for (int i = 0; i < 7; i++)
            want |= kept_t[i] == j;
        hand &= keep[j] == want;
        nk += keep[j];
    }
    CHECK(hand && nk == 7);
    topk_ref(tau[1], 11, k_of(0.3, 11), keep);
    CHECK(keep[0] && keep[1] && keep[7] && !keep[2] && !keep[4] && !keep[5] && !keep[9]);

    const char *dirs[1] = {fd};
    static const double dens[] = {0.3, 0.5, 0.125, 1.0};
    for (int r = 0; r < 4; r++) {
        const double w = 1.0, d = dens[r];
        lm_merge_opts o = fixture_merge_opts(LM_MERGE_TIES, 1, &w, &d);
        lm_st_file *st = run_merge(f.root, &o, f.base_dir, dirs, NULL);
        for (int t = 0; t < f.base.n && st; t++) {
            const tensor *b = &f.base.t[t];
            double *tp = malloc((size_t)b->n * sizeof *tp);
            trim_ref(tau[t], b->n, d, tp);
            for (int64_t j = 0; j < b->n; j++)
                tp[j] += b->v[j];
            check_exact(st, b->name, tp, b->n);
            free(tp);
        }
        // Slabs of two rows of w.weight: the same bytes.
        o.slab_elems = 34;
        lm_st_file *st2 = run_merge(f.root, &o, f.base_dir, dirs, NULL);
        CHECK_MSG(same_output(st, st2), "ties density %g: output differs in slabs of 34", d);
        lm_st_close(st2);
        lm_st_close(st);
    }
    free_taus(tau);
    free(fd);
    fx_close(&f);
}

// Sign election by sum and by count, on cases built so they differ; zeros never agree; Σ = 0
// elects +1. Density 1 so only the election acts.
static void sign_base(tset *b)
{
    rng_seed(41);
    fill_q(ts_add1(b, "s.weight", 12), 12, 2.0, 12);
    fill_q(ts_add2(b, "r.weight", 6, 7), 42, 2.0, 12);
}

static void test_ties_sign(void)
{
    fixture f;
    fx_open(&f, sign_base, "float32");
    char *dirs_own[3];
    double *tau[3][MAX_T];
    // Triples in eighths: (+3,−1,−1) sum elects +, count −; (−3,+1,+1) the other way; (+1,−1,0)
    // Σ = 0 elects + both ways; (0,0,0); (0,+2,0) alone (divisor 1); (−2,0,+2) Σ = 0 → +.
    static const int cases[6][3] = {{3, -1, -1}, {-3, 1, 1}, {1, -1, 0}, {0, 0, 0}, {0, 2, 0}, {-2, 0, 2}};
    rng_seed(42);
    for (int i = 0; i < 3; i++) {
        dirs_own[i] = ft_dir(&f, i);
        alloc_taus(&f.base, tau[i]);
        for (int j = 0; j < 12; j++)
            tau[i][0][j] = j < 6 ? cases[j][i] / 8.0 : rng_int(-8, 8) / 8.0;
        for (int j = 0; j < 42; j++)
            tau[i][1][j] = rng_int(-8, 8) / 8.0;
        write_ft(dirs_own[i], &f.base, tau[i]);
    }
    const char *dirs[3] = {dirs_own[0], dirs_own[1], dirs_own[2]};
    double *tp[3][MAX_T];
    for (int i = 0; i < 3; i++)
        for (int t = 0; t < MAX_T; t++)
            tp[i][t] = tau[i][t];
    const double d[3] = {1, 1, 1}, w1[3] = {1, 1, 1}, w2[3] = {1, 0.5, 2};
    const float *sb = ts_get(&f.base, "s.weight");
    // Hand values (weights 1, normalize) for the six built cases, by sum and by count.
    static const double by_sum[6] = {3, -3, 1, 0, 2, 2}, by_count[6] = {-1, 1, 1, 0, 2, 2};
    for (int run = 0; run < 4; run++) {
        int sign = run % 2 ? SIGN_COUNT : SIGN_SUM;
        bool plain = run < 2;
        const double *w = plain ? w1 : w2;
        lm_merge_opts o = fixture_merge_opts(LM_MERGE_TIES, 3, w, d);
        o.sign = sign == SIGN_SUM ? LM_SIGN_SUM : LM_SIGN_COUNT;
        o.normalize = plain;
        o.lambda = plain ? 1.0 : 0.75;
        combo c = {.k = 3, .w = w, .sign = sign, .normalize = o.normalize, .lambda = o.lambda};
        lm_st_file *st = run_merge(f.root, &o, f.base_dir, dirs, NULL);
        if (st) {
            check_combined(st, &f.base, &c, tp);
            if (plain) {
                float *got = out_values(st, "s.weight", 12);
                for (int j = 0; j < 6 && got; j++) {
                    double want = sb[j] + (sign == SIGN_SUM ? by_sum[j] : by_count[j]) / 8.0;
                    CHECK_MSG(got[j] == (float)want, "sign %s case %d: got %.9g, expected %.9g",
                              sign == SIGN_SUM ? "sum" : "count", j, (double)got[j], want);
                }
                free(got);
            }
        }
        lm_st_close(st);
    }
    free_fts(3, dirs_own, tau);
    fx_close(&f);
}

// Trimming, then election, with normalize on and off, lambda, weights and per-FT densities.
static void opts_base(tset *b)
{
    rng_seed(51);
    fill_q(ts_add2(b, "p.weight", 9, 11), 99, 2.0, 12);
    fill_q(ts_add1(b, "q.weight", 11), 11, 2.0, 12);
}

static void test_ties_options(void)
{
    fixture f;
    fx_open(&f, opts_base, "float32");
    char *dirs_own[3];
    double *tau[3][MAX_T];
    rng_seed(52);
    make_fts(&f, 3, dirs_own, tau, gen_16ths);
    const char *dirs[3] = {dirs_own[0], dirs_own[1], dirs_own[2]};
    static const struct {
        double w[3], d[3], lambda;
        bool normalize;
        int sign;
    } runs[] = {
        {{1, 1, 1}, {0.5, 0.5, 0.5}, 1.0, true, SIGN_SUM},
        {{1, 0.5, 2}, {0.5, 0.3, 0.7}, 0.6, false, SIGN_SUM},
        {{0.3, 1, 0.7}, {0.25, 0.75, 0.5}, 1.3, true, SIGN_COUNT},
        {{2, 1, 1}, {0.9, 0.2, 0.4}, 1.0, false, SIGN_COUNT},
    };
    for (size_t r = 0; r < sizeof runs / sizeof runs[0]; r++) {
        lm_merge_opts o = fixture_merge_opts(LM_MERGE_TIES, 3, runs[r].w, runs[r].d);
        o.lambda = runs[r].lambda;
        o.normalize = runs[r].normalize;
        o.sign = runs[r].sign == SIGN_SUM ? LM_SIGN_SUM : LM_SIGN_COUNT;
        combo c = {.k = 3, .w = runs[r].w, .sign = runs[r].sign, .normalize = runs[r].normalize,
                   .lambda = runs[r].lambda};
        double *tp[3][MAX_T] = {{0}};
        for (int i = 0; i < 3; i++) {
            for (int t = 0; t < f.base.n; t++) {
                tp[i][t] = malloc((size_t)f.base.t[t].n * sizeof(double));
                trim_ref(tau[i][t], f.base.t[t].n, runs[r].d[i], tp[i][t]);
            }
        }
        lm_st_file *st = run_merge(f.root, &o, f.base_dir, dirs, NULL);
        if (st)
            check_combined(st, &f.base, &c, tp);
        lm_st_close(st);
        for (int i = 0; i < 3; i++)
            for (int t = 0; t < f.base.n; t++)
                free(tp[i][t]);
    }
    free_fts(3, dirs_own, tau);
    fx_close(&f);
}

// --topk global: one threshold per model over all its tensors. Magnitudes within a model are
// all distinct, so no tie sits at the threshold (the order of tensors across the model then
// does not matter).
static void global_base(tset *b)
{
    rng_seed(61);
    fill_q(ts_add2(b, "a.weight", 5, 4), 20, 2.0, 12);
    fill_q(ts_add1(b, "b.weight", 12), 12, 2.0, 12);
    fill_q(ts_add1(b, "c.weight", 8), 8, 2.0, 12);
}

static void test_ties_topk_global(void)
{
    fixture f;
    fx_open(&f, global_base, "float32");
    char *dirs_own[2];
    double *tau[2][MAX_T];
    rng_seed(62);
    for (int i = 0; i < 2; i++) {
        dirs_own[i] = ft_dir(&f, i);
        alloc_taus(&f.base, tau[i]);
        // Magnitudes 1..40 (in 32nds), shuffled; model 0 puts its 10 largest mostly in a.weight.
        int perm[40];
        for (int j = 0; j < 40; j++)
            perm[j] = j + 1;
        for (int j = 39; j > 0; j--) {
            int s = (int)rng_int(0, j), x = perm[j];
            perm[j] = perm[s];
            perm[s] = x;
        }
        if (i == 0) {
            // Sort descending the first 20 slots' worth: a.weight gets 40..31 in its first ten.
            for (int j = 0; j < 10; j++) {
                for (int l = 0; l < 40; l++) {
                    if (perm[l] == 40 - j) {
                        int x = perm[j];
                        perm[j] = perm[l];
                        perm[l] = x;
                        break;
                    }
                }
            }
        }
        int pos = 0;
        for (int t = 0; t < 3; t++)
            for (int64_t j = 0; j < f.base.t[t].n; j++)
                tau[i][t][j] = (rng_u64() & 1 ? -1 : 1) * perm[pos++] / 32.0;
        write_ft(dirs_own[i], &f.base, tau[i]);
    }
    const char *dirs[2] = {dirs_own[0], dirs_own[1]};
    const double w[2] = {1, 1}, d[2] = {0.25, 0.25};
    combo c = {.k = 2, .w = w, .sign = SIGN_SUM, .normalize = true, .lambda = 1.0};
    for (int global = 0; global < 2; global++) {
        double *tp[2][MAX_T] = {{0}};
        bool differs = false;
        for (int i = 0; i < 2; i++) {
            // Per tensor, and over the model's 40 entries (k = 10).
            double all[40];
            bool keep[40];
            int pos = 0;
            for (int t = 0; t < 3; t++)
                for (int64_t j = 0; j < f.base.t[t].n; j++)
                    all[pos++] = tau[i][t][j];
            topk_ref(all, 40, k_of(0.25, 40), keep);
            pos = 0;
            for (int t = 0; t < 3; t++) {
                int64_t n = f.base.t[t].n;
                tp[i][t] = malloc((size_t)n * sizeof(double));
                double *per = malloc((size_t)n * sizeof(double));
                trim_ref(tau[i][t], n, 0.25, per);
                for (int64_t j = 0; j < n; j++, pos++) {
                    double g = keep[pos] ? tau[i][t][j] : 0;
                    differs |= g != per[j];
                    tp[i][t][j] = global ? g : per[j];
                }
                free(per);
            }
        }
        CHECK(differs);  // the test tells the two modes apart
        lm_merge_opts o = fixture_merge_opts(LM_MERGE_TIES, 2, w, d);
        o.topk_global = global;
        lm_st_file *st = run_merge(f.root, &o, f.base_dir, dirs, NULL);
        if (st)
            check_combined(st, &f.base, &c, tp);
        // Slabs of two rows of a.weight and two threads: the same bytes.
        o.slab_elems = 8;
        o.threads = 2;
        lm_st_file *st2 = run_merge(f.root, &o, f.base_dir, dirs, NULL);
        CHECK_MSG(same_output(st, st2), "topk %s: output differs in slabs of 8", global ? "global" : "tensor");
        lm_st_close(st2);
        lm_st_close(st);
        for (int i = 0; i < 2; i++)
            for (int t = 0; t < 3; t++)
                free(tp[i][t]);
    }
    free_fts(2, dirs_own, tau);
    fx_close(&f);
}

// Property: TIES at density 1 with normalize is, element by element, the weighted mean of the
// task vectors whose sign agrees with the sign of the weighted sum.
static void test_ties_density1_mean(void)
{
    fixture f;
    fx_open(&f, opts_base, "float32");
    char *dirs_own[3];
    double *tau[3][MAX_T];
    rng_seed(71);
    make_fts(&f, 3, dirs_own, tau, gen_q10);
    const char *dirs[3] = {dirs_own[0], dirs_own[1], dirs_own[2]};
    const double w[3] = {0.2, 1.0, 0.6}, d[3] = {1, 1, 1};
    lm_merge_opts o = fixture_merge_opts(LM_MERGE_TIES, 3, w, d);
    lm_st_file *st = run_merge(f.root, &o, f.base_dir, dirs, NULL);
    for (int t = 0; t < f.base.n && st; t++) {
        const tensor *b = &f.base.t[t];
        double *e = malloc((size_t)b->n * sizeof *e), *m = malloc((size_t)b->n * sizeof *m);
        for (int64_t j = 0; j < b->n; j++) {
            double sum = 0;
            for (int i = 0; i < 3; i++)
                sum += w[i] * tau[i][t][j];
            double num = 0, den = 0, mag = 0;
            for (int i = 0; i < 3; i++) {
                bool agree = sum >= 0 ? tau[i][t][j] > 0 : tau[i][t][j] < 0;
                if (agree) {
                    num += w[i] * tau[i][t][j];
                    den += w[i];
                    mag += w[i] * fabs(tau[i][t][j]);
                }
            }
            e[j] = b->v[j] + (den > 0 ? num / den : 0);
            m[j] = fabs((double)b->v[j]) + (den > 0 ? mag / den : 0);
        }
        check_values(st, b->name, e, m, b->n);
        free(e);
        free(m);
    }
    lm_st_close(st);
    free_fts(3, dirs_own, tau);
    fx_close(&f);
}

// Exact top-k across slabs: a 301 x 319 tensor with 16 magnitude levels, so the threshold's
// ties span many slabs of slab_elems 1000; a full FT and a LoRA FT whose products are exact
// (dyadic factors), both trimmed; masks exact for each alone, and the same bytes for every slab
// size and thread count.
static void big_base(tset *b)
{
    rng_seed(81);
    fill_q(ts_add2(b, "big.weight", 301, 319), 301 * 319, 2.0, 12);
    fill_q(ts_add1(b, "small.weight", 7), 7, 2.0, 12);
}

static void test_ties_slabs(void)
{
    fixture f;
    fx_open(&f, big_base, "float32");
    char *fd = subdir(f.root, "full"), *ad = subdir(f.root, "ad");
    const int64_t rows = 301, cols = 319, n = rows * cols;
    double *tau_f[MAX_T], *tau_l[MAX_T] = {0};
    alloc_taus(&f.base, tau_f);
    rng_seed(82);
    for (int64_t j = 0; j < n; j++)
        tau_f[0][j] = rng_qmag(1.0 / 8, 1.0, 3);
    for (int64_t j = 0; j < 7; j++)
        tau_f[1][j] = rng_qmag(1.0 / 8, 1.0, 3);
    write_ft(fd, &f.base, tau_f);
    tset a = {0};
    float *A = ts_add2(&a, "base_model.model.big.lora_A.weight", 2, cols);
    float *B = ts_add2(&a, "base_model.model.big.lora_B.weight", rows, 2);
    for (int64_t j = 0; j < 2 * cols; j++)
        A[j] = (float)(rng_int(-4, 4) / 8.0);
    for (int64_t j = 0; j < 2 * rows; j++)
        B[j] = (float)(rng_int(-4, 4) / 8.0);
    write_adapter(ad, "{\"peft_type\": \"LORA\", \"r\": 2, \"lora_alpha\": 4, \"target_modules\": [\"big\"]}", &a);
    tau_l[0] = malloc((size_t)n * sizeof(double));
    lora_ref(tau_l[0], NULL, A, B, 2, cols, rows, 2.0, false);

    const double d1 = 0.3;  // k = floor(0.3 · 96019) = 28805
    const double w1 = 1.0;
    // Each FT alone, in slabs: exact masks.
    for (int which = 0; which < 2; which++) {
        const char *dirs[1] = {which ? ad : fd};
        double **tau = which ? tau_l : tau_f;
        for (int slab = 0; slab < 2; slab++) {
            lm_merge_opts o = fixture_merge_opts(LM_MERGE_TIES, 1, &w1, &d1);
            o.slab_elems = slab ? 1000 : 0;
            o.threads = slab ? 2 : 1;
            lm_st_file *st = run_merge(f.root, &o, f.base_dir, dirs, NULL);
            for (int t = 0; t < 2 && st; t++) {
                const tensor *b = &f.base.t[t];
                double *e = malloc((size_t)b->n * sizeof *e);
                if (tau[t])
                    trim_ref(tau[t], b->n, d1, e);
                else
                    memset(e, 0, (size_t)b->n * sizeof *e);
                for (int64_t j = 0; j < b->n; j++)
                    e[j] += b->v[j];
                check_exact(st, b->name, e, b->n);
                free(e);
            }
            lm_st_close(st);
        }
    }

    // Both together: values against the reference, bytes equal across slab sizes and threads.
    const char *dirs[2] = {fd, ad};
    const double w[2] = {1.0, 0.5}, d[2] = {0.3, 0.45};
    combo c = {.k = 2, .w = w, .sign = SIGN_SUM, .normalize = true, .lambda = 1.0};
    double *tp[2][MAX_T] = {{0}};
    for (int t = 0; t < 2; t++) {
        tp[0][t] = malloc((size_t)f.base.t[t].n * sizeof(double));
        trim_ref(tau_f[t], f.base.t[t].n, d[0], tp[0][t]);
    }
    tp[1][0] = malloc((size_t)n * sizeof(double));
    trim_ref(tau_l[0], n, d[1], tp[1][0]);
    lm_st_file *first = NULL;
    static const struct { int threads; int64_t slab; } cfg[] = {{1, 0}, {2, 0}, {1, 1000}, {2, 1000}, {3, 4000}};
    for (size_t r = 0; r < sizeof cfg / sizeof cfg[0]; r++) {
        lm_merge_opts o = fixture_merge_opts(LM_MERGE_TIES, 2, w, d);
        o.threads = cfg[r].threads;
        o.slab_elems = cfg[r].slab;
        lm_st_file *st = run_merge(f.root, &o, f.base_dir, dirs, NULL);
        if (r == 0) {
            if (st)
                check_combined(st, &f.base, &c, tp);
            first = st;
        } else {
            CHECK_MSG(same_output(first, st), "ties output differs with %d threads, slab %lld",
                      cfg[r].threads, (long long)cfg[r].slab);
            lm_st_close(st);
        }
    }
    lm_st_close(first);
    for (int t = 0; t < 2; t++) {
        free(tp[0][t]);
        free(tp[1][t]);
    }
    free_taus(tau_f);
    free(tau_l[0]);
    ts_free(&a);
    free(fd);
    free(ad);
    fx_close(&f);
}

// ==== DARE ====================================================================================

static void dare_base(tset *b)
{
    rng_seed(91);
    fill_q(ts_add2(b, "big.weight", 317, 331), 317 * 331, 2.0, 12);
    fill_q(ts_add1(b, "small.weight", 7), 7, 2.0, 12);
}

// One FT's DARE output: each element is θ_b exactly (dropped) or θ_b + f·τ (kept). Fills keep
// (may be NULL), returns the kept count, counts the elements that are neither in *bad.
static int64_t dare_decode(const float *out, const float *base, const double *tau, double f, int64_t n,
                           bool *keep, int64_t *bad)
{
    int64_t kept = 0;
    for (int64_t j = 0; j < n; j++) {
        double want = base[j] + f * tau[j];
        bool k = fabs((double)out[j] - want) <= REL * (fabs(want) + fabs((double)base[j]) + fabs(f * tau[j]));
        bool dropped = out[j] == base[j];
        if (keep)
            keep[j] = k;
        kept += k;
        *bad += !(k || dropped) || (k && dropped);
    }
    return kept;
}

// |kept − d·n| within 5 binomial standard deviations.
static void check_fraction(const char *what, int64_t kept, int64_t n, double d)
{
    double sd = sqrt((double)n * d * (1 - d));
    CHECK_MSG(fabs((double)kept - d * (double)n) <= 5 * sd, "%s: kept %lld of %lld, expected %.1f ± %.1f",
              what, (long long)kept, (long long)n, d * (double)n, 5 * sd);
}

static void make_dare_ft(const fixture *f, const char *dir, double **tau, uint64_t seed)
{
    alloc_taus(&f->base, tau);
    rng_seed(seed);
    for (int t = 0; t < f->base.n; t++)
        for (int64_t j = 0; j < f->base.t[t].n; j++)
            tau[t][j] = rng_qmag(0.25, 1.0, 6);
    write_ft(dir, &f->base, tau);
}

static void test_dare_values(void)
{
    fixture f;
    fx_open(&f, dare_base, "float32");
    char *fd = subdir(f.root, "ft");
    double *tau[MAX_T];
    make_dare_ft(&f, fd, tau, 92);
    const char *dirs[1] = {fd};
    const double w = 0.5, d = 0.3;
    const int64_t n = 317 * 331;
    // normalize off: kept entries w·τ/d; normalize on, lambda 2: λ·(w·τ/d)/w.
    for (int run = 0; run < 2; run++) {
        lm_merge_opts o = fixture_merge_opts(LM_MERGE_DARE, 1, &w, &d);
        o.seed = 42;
        o.normalize = run == 1;
        o.lambda = run == 1 ? 2.0 : 1.0;
        double fct = run == 1 ? 2.0 / d : w / d;
        lm_st_file *st = run_merge(f.root, &o, f.base_dir, dirs, NULL);
        float *big = out_values(st, "big.weight", n), *small = out_values(st, "small.weight", 7);
        if (big && small) {
            int64_t bad = 0;
            int64_t kept = dare_decode(big, ts_get(&f.base, "big.weight"), tau[0], fct, n, NULL, &bad);
            dare_decode(small, ts_get(&f.base, "small.weight"), tau[1], fct, 7, NULL, &bad);
            CHECK_MSG(bad == 0, "dare run %d: %lld values neither dropped nor w·τ/d", run, (long long)bad);
            check_fraction("dare big.weight", kept, n, d);
        }
        free(big);
        free(small);
        lm_st_close(st);
    }
    free_taus(tau);
    free(fd);
    fx_close(&f);
}

// Same seed, same bytes: threads 1, 2, 3 and slabs of 1000 elements, with a full and a LoRA FT.
// Another seed, another mask. Two copies of one FT draw independent masks (the model index is
// part of the key). The mask of a tensor does not depend on the other tensors of the model.
static void test_dare_determinism(void)
{
    fixture f;
    fx_open(&f, dare_base, "float32");
    char *fd = subdir(f.root, "ft"), *ad = subdir(f.root, "ad");
    double *tau[MAX_T];
    make_dare_ft(&f, fd, tau, 93);
    tset a = {0};
    add_lora(&a, "big", 2, 331, 317);
    write_adapter(ad, "{\"peft_type\": \"LORA\", \"r\": 2, \"lora_alpha\": 2, \"target_modules\": [\"big\"]}", &a);
    const int64_t n = 317 * 331;

    const char *dirs[2] = {fd, ad};
    const double w[2] = {1.0, 0.5}, d[2] = {0.3, 0.6};
    static const struct { int threads; int64_t slab; } cfg[] = {{1, 0}, {2, 0}, {1, 1000}, {2, 1000}, {3, 777}};
    lm_st_file *first = NULL;
    for (size_t r = 0; r < sizeof cfg / sizeof cfg[0]; r++) {
        lm_merge_opts o = fixture_merge_opts(LM_MERGE_DARE, 2, w, d);
        o.seed = 7;
        o.threads = cfg[r].threads;
        o.slab_elems = cfg[r].slab;
        lm_st_file *st = run_merge(f.root, &o, f.base_dir, dirs, NULL);
        if (r == 0) {
            first = st;
        } else {
            CHECK_MSG(same_output(first, st), "dare output differs with %d threads, slab %lld",
                      cfg[r].threads, (long long)cfg[r].slab);
            lm_st_close(st);
        }
    }
    // Another seed: a different mask (about 2·d(1−d) of the entries of each model change).
    lm_merge_opts o = fixture_merge_opts(LM_MERGE_DARE, 2, w, d);
    o.seed = 8;
    lm_st_file *other = run_merge(f.root, &o, f.base_dir, dirs, NULL);
    float *v7 = out_values(first, "big.weight", n), *v8 = out_values(other, "big.weight", n);
    if (v7 && v8) {
        int64_t diff = 0;
        for (int64_t j = 0; j < n; j++)
            diff += v7[j] != v8[j];
        CHECK_MSG(diff > n / 4, "seeds 7 and 8 differ in %lld of %lld values", (long long)diff, (long long)n);
    }
    free(v7);
    free(v8);
    lm_st_close(other);
    lm_st_close(first);

    // One FT twice, density 0.5, weights 1: out − θ_b ∈ {0, 2τ, 4τ}, with 2τ (one model kept)
    // about half the time if the two masks are independent, never if they were the same.
    const char *twice[2] = {fd, fd};
    const double w11[2] = {1, 1}, d55[2] = {0.5, 0.5};
    o = fixture_merge_opts(LM_MERGE_DARE, 2, w11, d55);
    o.seed = 7;
    lm_st_file *st = run_merge(f.root, &o, f.base_dir, twice, NULL);
    float *v = out_values(st, "big.weight", n);
    if (v) {
        const float *b = ts_get(&f.base, "big.weight");
        int64_t one = 0, two = 0, bad = 0;
        for (int64_t j = 0; j < n; j++) {
            double tol = REL * (fabs((double)b[j]) + 4 * fabs(tau[0][j]));
            if (v[j] == b[j])
                continue;
            if (fabs(v[j] - (b[j] + 2 * tau[0][j])) <= tol)
                one++;
            else if (fabs(v[j] - (b[j] + 4 * tau[0][j])) <= tol)
                two++;
            else
                bad++;
        }
        CHECK_MSG(bad == 0, "%lld values of two DARE copies are none of 0, 2τ, 4τ", (long long)bad);
        check_fraction("one of two copies kept", one, n, 0.5);
        check_fraction("both copies kept", two, n, 0.25);
    }
    free(v);
    lm_st_close(st);

    // The same tensor in another base with other tensors around it, in another order: the mask
    // is the same (a pure function of seed, model index, name and element index).
    char *b2 = subdir(f.root, "base2"), *f2 = subdir(f.root, "ft2");
    tset base2 = {0};
    fill_q(ts_add1(&base2, "aa.weight", 9), 9, 2.0, 12);
    float *big2 = ts_add2(&base2, "big.weight", 317, 331);
    memcpy(big2, ts_get(&f.base, "big.weight"), (size_t)n * sizeof(float));
    write_model(b2, &base2, "float32");
    double *tau2[MAX_T];
    alloc_taus(&base2, tau2);
    memcpy(tau2[1], tau[0], (size_t)n * sizeof(double));
    for (int j = 0; j < 9; j++)
        tau2[0][j] = 0.5;
    write_ft(f2, &base2, tau2);
    const double w1 = 1.0, dd = 0.3;
    o = fixture_merge_opts(LM_MERGE_DARE, 1, &w1, &dd);
    o.seed = 11;
    const char *one1[1] = {fd}, *one2[1] = {f2};
    lm_st_file *s1 = run_merge(f.root, &o, f.base_dir, one1, NULL);
    lm_st_file *s2 = run_merge(f.root, &o, b2, one2, NULL);
    const lm_st_tensor *t1 = s1 ? lm_st_find(s1, "big.weight") : NULL, *t2 = s2 ? lm_st_find(s2, "big.weight") : NULL;
    CHECK_MSG(t1 && t2 && t1->nbytes == t2->nbytes && memcmp(t1->data, t2->data, t1->nbytes) == 0,
              "big.weight's DARE mask depends on the other tensors of the model");
    lm_st_close(s1);
    lm_st_close(s2);
    free_taus(tau2);
    ts_free(&base2);
    free(b2);
    free(f2);

    free_taus(tau);
    ts_free(&a);
    free(fd);
    free(ad);
    fx_close(&f);
}

// --rescale l1: kept entries times ‖τ‖₁ / ‖τ ⊙ m‖₁ over the whole tensor, whatever the slabs;
// skipped (factor 1) when a norm is below 1e-7.
static void l1_base(tset *b)
{
    rng_seed(101);
    fill_q(ts_add2(b, "big.weight", 317, 331), 317 * 331, 2.0, 12);
    ts_add1(b, "tiny.weight", 16);  // zeros
}

static void test_dare_rescale_l1(void)
{
    fixture f;
    fx_open(&f, l1_base, "float32");
    char *fd = subdir(f.root, "ft");
    double *tau[MAX_T];
    alloc_taus(&f.base, tau);
    rng_seed(102);
    const int64_t n = 317 * 331;
    for (int64_t j = 0; j < n; j++)
        tau[0][j] = rng_qmag(0.25, 1.0, 6);
    for (int j = 0; j < 16; j++)
        tau[1][j] = ldexp((double)rng_int(1, 8), -32) * (j % 2 ? -1 : 1);  // ‖τ‖₁ < 1e-7
    write_ft(fd, &f.base, tau);
    const char *dirs[1] = {fd};
    const double d = 0.4;
    static const double weights[2] = {1.0, 0.5};
    bool *keep = malloc((size_t)n * sizeof *keep);
    lm_st_file *ref = NULL;
    for (int run = 0; run < 3; run++) {
        const double w = weights[run == 1];
        lm_merge_opts o = fixture_merge_opts(LM_MERGE_DARE, 1, &w, &d);
        o.rescale = LM_RESCALE_L1;
        o.seed = 3;
        o.slab_elems = run == 2 ? 1000 : 0;
        o.threads = run == 2 ? 2 : 1;
        lm_st_file *st = run_merge(f.root, &o, f.base_dir, dirs, NULL);
        if (run == 2) {
            CHECK_MSG(same_output(ref, st), "l1 rescale differs in slabs of 1000");
            lm_st_close(st);
            break;
        }
        float *v = out_values(st, "big.weight", n);
        const float *b = ts_get(&f.base, "big.weight");
        if (v) {
            // The mask from what was dropped; then the factor; then every kept value.
            double all = 0, kept_l1 = 0;
            int64_t kept = 0;
            for (int64_t j = 0; j < n; j++) {
                keep[j] = v[j] != b[j];
                all += fabs(tau[0][j]);
                if (keep[j]) {
                    kept_l1 += fabs(tau[0][j]);
                    kept++;
                }
            }
            check_fraction("l1 big.weight", kept, n, d);
            double factor = all / kept_l1;
            int64_t bad = 0;
            dare_decode(v, b, tau[0], w * factor, n, NULL, &bad);
            CHECK_MSG(bad == 0, "l1 run %d: %lld values are not θ_b + w·τ·%.6f", run, (long long)bad, factor);
        }
        free(v);
        // tiny.weight (θ_b = 0): kept entries are τ itself, unscaled.
        float *tv = out_values(st, "tiny.weight", 16);
        int64_t bad_tiny = 0;
        for (int j = 0; j < 16 && tv; j++)
            bad_tiny += tv[j] != 0 && fabs(tv[j] - w * tau[1][j]) > 1e-6 * fabs(w * tau[1][j]);
        CHECK_MSG(tv && bad_tiny == 0, "l1 run %d: tiny.weight rescaled although its norm < 1e-7", run);
        free(tv);
        if (run == 0)
            ref = st;
        else
            lm_st_close(st);
    }
    lm_st_close(ref);
    free(keep);
    free_taus(tau);
    free(fd);
    fx_close(&f);
}

// DARE-TIES: the masks of DARE, then TIES election on the masked, rescaled values. A DARE run
// with the same seed shows each model's mask: the values are built so that the four outcomes
// (neither, model 0, model 1, both kept) are all at least 1/8 apart.
static void dt_base(tset *b)
{
    rng_seed(111);
    fill_q(ts_add2(b, "dt.weight", 40, 50), 2000, 2.0, 12);
    fill_q(ts_add1(b, "e.weight", 6), 6, 2.0, 12);
}

static void test_dare_ties(void)
{
    fixture f;
    fx_open(&f, dt_base, "float32");
    char *d0 = subdir(f.root, "ft0"), *d1 = subdir(f.root, "ft1");
    double *tau[2][MAX_T];
    alloc_taus(&f.base, tau[0]);
    alloc_taus(&f.base, tau[1]);
    const double w[2] = {1.0, 0.7}, d[2] = {0.5, 0.4};
    rng_seed(112);
    for (int t = 0; t < f.base.n; t++) {
        for (int64_t j = 0; j < f.base.t[t].n; j++) {
            // c0 = w0·τ0/d0 = 2·τ0 ∈ ±{1/4, ..., 2}; c1 = w1·τ1/d1 = 1.75·τ1 ≈ ±(m + 1/2)/4.
            tau[0][t][j] = rng_qmag(1.0 / 8, 1.0, 3);
            double c1 = (double)(rng_int(0, 7) * 2 + 1) / 8.0 * (rng_u64() & 1 ? -1 : 1);
            tau[1][t][j] = round(ldexp(c1 / 1.75, 12)) / 4096.0;
        }
    }
    write_ft(d0, &f.base, tau[0]);
    write_ft(d1, &f.base, tau[1]);
    const char *dirs[2] = {d0, d1};

    lm_merge_opts o = fixture_merge_opts(LM_MERGE_DARE, 2, w, d);
    o.seed = 5;
    lm_st_file *dare = run_merge(f.root, &o, f.base_dir, dirs, NULL);
    // Decoded masks, as τ' = m·τ/d per model and tensor.
    double *tp[2][MAX_T] = {{0}};
    bool decoded = dare != NULL;
    int64_t opposite = 0;
    for (int t = 0; t < f.base.n && decoded; t++) {
        const tensor *b = &f.base.t[t];
        float *v = out_values(dare, b->name, b->n);
        if (!v) {
            decoded = false;
            break;
        }
        tp[0][t] = calloc((size_t)b->n, sizeof(double));
        tp[1][t] = calloc((size_t)b->n, sizeof(double));
        int64_t undecided = 0, kept0 = 0, kept1 = 0;
        for (int64_t j = 0; j < b->n; j++) {
            double c0 = w[0] * tau[0][t][j] / d[0], c1 = w[1] * tau[1][t][j] / d[1];
            double cand[4] = {0, c0, c1, c0 + c1}, delta = (double)v[j] - b->v[j];
            int best = 0;
            for (int k = 1; k < 4; k++)
                if (fabs(delta - cand[k]) < fabs(delta - cand[best]))
                    best = k;
            if (fabs(delta - cand[best]) > 1e-3) {
                undecided++;
                continue;
            }
            if (best & 1) {
                tp[0][t][j] = tau[0][t][j] / d[0];
                kept0++;
            }
            if (best & 2) {
                tp[1][t][j] = tau[1][t][j] / d[1];
                kept1++;
            }
            opposite += best == 3 && (c0 > 0) != (c1 > 0);
        }
        CHECK_MSG(undecided == 0, "%s: %lld DARE values match no mask", b->name, (long long)undecided);
        if (b->n > 1000) {
            check_fraction("dare-ties model 0", kept0, b->n, d[0]);
            check_fraction("dare-ties model 1", kept1, b->n, d[1]);
        }
        free(v);
    }
    CHECK_MSG(opposite > 100, "only %lld elements with both kept and opposite signs", (long long)opposite);
    lm_st_close(dare);

    static const struct { int sign; bool normalize; double lambda; } runs[] = {
        {SIGN_SUM, false, 1.0}, {SIGN_COUNT, false, 1.0}, {SIGN_SUM, true, 0.8}, {SIGN_COUNT, true, 1.0},
    };
    for (size_t r = 0; r < sizeof runs / sizeof runs[0] && decoded; r++) {
        o = fixture_merge_opts(LM_MERGE_DARE_TIES, 2, w, d);
        o.seed = 5;
        o.sign = runs[r].sign == SIGN_SUM ? LM_SIGN_SUM : LM_SIGN_COUNT;
        o.normalize = runs[r].normalize;
        o.lambda = runs[r].lambda;
        combo c = {.k = 2, .w = w, .sign = runs[r].sign, .normalize = runs[r].normalize, .lambda = runs[r].lambda};
        lm_st_file *st = run_merge(f.root, &o, f.base_dir, dirs, NULL);
        if (st)
            check_combined(st, &f.base, &c, tp);
        if (r == 0) {
            o.slab_elems = 100;
            o.threads = 2;
            lm_st_file *st2 = run_merge(f.root, &o, f.base_dir, dirs, NULL);
            CHECK_MSG(same_output(st, st2), "dare-ties output differs in slabs of 100");
            lm_st_close(st2);
        }
        lm_st_close(st);
    }
    for (int i = 0; i < 2; i++) {
        for (int t = 0; t < MAX_T; t++)
            free(tp[i][t]);
        free_taus(tau[i]);
    }
    free(d0);
    free(d1);
    fx_close(&f);
}

// ==== sparsegpt: selection by Hessian importance =============================================
// Two full FTs on a base with two matrices and a vector. The engine is given U_cc² per column
// (as lm_hess_ucc2 would compute them from Hessians) for both matrices of FT 0 and for t of
// FT 1; w of FT 1 and the vector have none and are trimmed by magnitude. The reference ranks
// importance τ²/U_cc² (float32 of the double quotient, as device.h defines it), keeps exactly
// k with ties to the lower index, then elects signs and takes the disjoint mean.
static double g_ucc2_t0[6] = {1.0, 4.0, 0.25, 1.0, 9.0, 0.5};
static double g_ucc2_w0[17], g_ucc2_t1[6] = {2.0, 2.0, 1.0, 0.125, 1.0, 16.0};

static const double *sgpt_ucc2(void *ctx, int ft, const char *tensor, int64_t cols)
{
    int *calls = ctx;
    (*calls)++;
    if (strcmp(tensor, "t.weight") == 0 && cols == 6)
        return ft == 0 ? g_ucc2_t0 : g_ucc2_t1;
    if (strcmp(tensor, "w.weight") == 0 && cols == 17 && ft == 0)
        return g_ucc2_w0;
    return NULL;
}

static void test_sparsegpt(void)
{
    fixture f;
    fx_open(&f, ties_base, "float32");
    char *fd[2];
    double *tau[2][MAX_T];
    rng_seed(77);
    for (int c = 0; c < 17; c++)
        g_ucc2_w0[c] = c % 5 == 0 ? 1.0 : rng_int(1, 40) / 8.0;
    make_fts(&f, 2, fd, tau, gen_8ths);  // many ties, in magnitude and importance
    const double w[2] = {1.0, 0.6}, d[2] = {0.4, 0.3};
    int calls = 0;
    lm_merge_opts o = fixture_merge_opts(LM_MERGE_SPARSEGPT, 2, w, d);
    o.ucc2 = sgpt_ucc2;
    o.ucc2_ctx = &calls;
    CHECK(o.normalize);  // sparsegpt normalizes by default, as ties
    const char *dirs[2] = {fd[0], fd[1]};
    lm_st_file *st = run_merge(f.root, &o, f.base_dir, dirs, NULL);
    CHECK_MSG(calls > 0, "the engine never asked for U_cc²");

    // reference: τ' per FT and tensor, then the election and disjoint mean
    double *tp[2][MAX_T];
    for (int i = 0; i < 2; i++) {
        for (int t = 0; t < f.base.n; t++) {
            const tensor *b = &f.base.t[t];
            const double *u = b->ndim == 2 ? sgpt_ucc2(&calls, i, b->name, b->shape[1]) : NULL;
            double *key = malloc((size_t)b->n * sizeof *key);
            bool *keep = malloc((size_t)b->n * sizeof *keep);
            for (int64_t j = 0; j < b->n; j++)
                key[j] = u ? (double)(float)(tau[i][t][j] * tau[i][t][j] / u[j % b->shape[1]]) : tau[i][t][j];
            topk_ref(key, b->n, k_of(d[i], b->n), keep);
            tp[i][t] = malloc((size_t)b->n * sizeof(double));
            for (int64_t j = 0; j < b->n; j++)
                tp[i][t][j] = keep[j] ? tau[i][t][j] : 0.0;
            free(key);
            free(keep);
        }
    }
    combo c = {2, w, SIGN_SUM, true, 1.0};
    if (st)
        check_combined(st, &f.base, &c, tp);
    // Importance must matter: magnitude trimming (ties) gives another output here.
    lm_merge_opts ot = fixture_merge_opts(LM_MERGE_TIES, 2, w, d);
    lm_st_file *st_ties = run_merge(f.root, &ot, f.base_dir, dirs, NULL);
    CHECK_MSG(st && st_ties && !same_output(st, st_ties), "sparsegpt gave the same output as ties");
    // Slabs of a few rows, and the simulated device with and without room: the same bytes.
    o.slab_elems = 34;
    lm_st_file *st2 = run_merge(f.root, &o, f.base_dir, dirs, NULL);
    CHECK_MSG(st && st2 && same_output(st, st2), "sparsegpt in slabs of 34 differs");
    o.slab_elems = 0;
    const char *devs[3] = {"sim:1GiB", "sim:2KiB", "sim:200"};
    for (int v = 0; v < 3; v++) {
        g_device = devs[v];
        lm_st_file *sd = run_merge(f.root, &o, f.base_dir, dirs, NULL);
        CHECK_MSG(st && sd && same_output(st, sd), "sparsegpt on %s differs from the cpu", devs[v]);
        lm_st_close(sd);
    }
    g_device = NULL;
    lm_st_close(st2);
    lm_st_close(st_ties);
    lm_st_close(st);
    for (int i = 0; i < 2; i++)
        for (int t = 0; t < f.base.n; t++)
            free(tp[i][t]);
    free_fts(2, fd, tau);
    fx_close(&f);
}

int main(void)
{
    test_ties_topk_exact();
    test_ties_sign();
    test_ties_options();
    test_ties_topk_global();
    test_ties_density1_mean();
    test_ties_slabs();
    test_dare_values();
    test_dare_determinism();
    test_dare_rescale_l1();
    test_dare_ties();
    test_sparsegpt();
    return check_report("test_merge_methods");
}
