// Tests of the methods that sparsify task vectors beyond TIES and DARE (lib/methods/): breadcrumbs
// and breadcrumbs-ties against a reference computed here in double (the entries ranked by
// magnitude with ties to the lower index, the band between the outliers and the smallest kept),
// including the cases mergekit gets wrong (γ·numel < 1 keeps the top d·numel, not nothing),
// density 1, a band cut short where d + γ exceed 1, and the same bytes in slabs and on the
// simulated and emulated devices under budgets where units fall back; della, della-linear, sce and
// ram against references of their own.
#include <math.h>
#include <stdbool.h>
#include <stdint.h>

#include "check.h"
#include "merge.h"
#include "merge_fixture.h"
#include "ref_merge.h"
#include "safetensors.h"
#include "sparsify.h"
#include "util.h"

// A base with tensors of 1, 30, 96 and 221 entries.
static void band_base(tset *b)
{
    rng_seed(91);
    fill_q(ts_add1(b, "s.weight", 1), 1, 2.0, 12);
    fill_q(ts_add2(b, "a.weight", 5, 6), 30, 2.0, 12);
    fill_q(ts_add2(b, "b.weight", 8, 12), 96, 2.0, 12);
    fill_q(ts_add2(b, "c.weight", 13, 17), 221, 2.0, 12);
}

// n full FTs whose τ are multiples of 1/16 in [-1, 1]: many ties at every threshold.
static void make_fts(const fixture *f, int n, char **dirs, double *(*tau)[MAX_T])
{
    for (int i = 0; i < n; i++) {
        char nm[8];
        snprintf(nm, sizeof nm, "ft%d", i);
        dirs[i] = subdir(f->root, nm);
        alloc_taus(&f->base, tau[i]);
        for (int t = 0; t < f->base.n; t++)
            for (int64_t j = 0; j < f->base.t[t].n; j++)
                tau[i][t][j] = rng_int(-16, 16) / 16.0;
        write_ft(dirs[i], &f->base, tau[i]);
    }
}

// The merge of o again, each variant the same bytes as st: in slabs of `slab` elements, on 3
// threads, and on the devices, where budgets of 900 bytes make units fall back (checked with
// `fallback`).
static void same_variants(const char *root, const lm_merge_opts *o, const char *base_dir, const char *const *dirs,
                          lm_st_file *st, int64_t slab, bool fallback, const char *what)
{
    const char *devices[] = {NULL, NULL, "sim:64MiB", "sim:900", "cuda-emu:900"};
    for (size_t v = 0; st && v < sizeof devices / sizeof devices[0]; v++) {
        lm_merge_opts o2 = *o;
        o2.slab_elems = v == 0 ? slab : 0;
        o2.threads = v == 1 ? 3 : 1;
        g_device = devices[v];
        lm_merge_result res;
        memset(&res, 0, sizeof res);
        lm_st_file *st2 = run_merge(root, &o2, base_dir, dirs, &res);
        CHECK_MSG(same_output(st, st2), "%s: variant %zu differs", what, v);
        if (fallback && devices[v] && strstr(devices[v], ":900"))
            CHECK_MSG(res.fallback_merge > 0, "%s on %s: no unit fell back", what, devices[v]);
        lm_merge_result_free(&res);
        lm_st_close(st2);
    }
    g_device = NULL;
}

// out = τ kept to its band: ranked by |τ| (ties to the lower index), the first floor(γ·n)
// dropped and the next floor(d·n) kept; everything at d = 1; the band cut at n.
static void band_ref(const double *tau, int64_t n, double d, double g, double *out)
{
    int64_t target = (int64_t)floor(d * (double)n), top = (int64_t)floor(g * (double)n);
    if (d >= 1) {
        memcpy(out, tau, (size_t)n * sizeof *out);
        return;
    }
    if (target + top > n)
        top = n - target;
    bool *lo = malloc((size_t)n * sizeof *lo), *hi = malloc((size_t)n * sizeof *hi);
    topk_ref(tau, n, target + top, lo);
    topk_ref(tau, n, top, hi);
    for (int64_t j = 0; j < n; j++)
        out[j] = lo[j] && !hi[j] ? tau[j] : 0;
    free(lo);
    free(hi);
}

static void test_breadcrumbs(void)
{
    fixture f;
    fx_open(&f, band_base, "float32");
    char *dirs_own[3];
    double *tau[3][MAX_T];
    rng_seed(92);
    make_fts(&f, 3, dirs_own, tau);
    const char *dirs[3] = {dirs_own[0], dirs_own[1], dirs_own[2]};
    static const struct {
        lm_merge_method m;
        double w[3], d[3], g[3];
        bool normalize;
    } runs[] = {
        {LM_MERGE_BREADCRUMBS, {1, 1, 1}, {0.3, 0.3, 0.3}, {0.05, 0.05, 0.05}, false},
        // γ·n < 1 in the small tensors (mergekit keeps nothing there), density 1, d + γ > 1
        {LM_MERGE_BREADCRUMBS, {1, 0.5, 2}, {0.5, 1.0, 0.9}, {0.01, 0.2, 0.3}, true},
        {LM_MERGE_BREADCRUMBS, {0.5, 1, 1}, {0.2, 0.6, 0.4}, {0.0, 0.1, 0.5}, false},
        {LM_MERGE_BREADCRUMBS_TIES, {1, 1, 1}, {0.4, 0.4, 0.4}, {0.1, 0.1, 0.1}, false},
        {LM_MERGE_BREADCRUMBS_TIES, {1, 0.5, 2}, {0.3, 0.7, 0.5}, {0.02, 0.1, 0.25}, true},
    };
    for (size_t r = 0; r < sizeof runs / sizeof runs[0]; r++) {
        lm_merge_opts o = fixture_merge_opts(runs[r].m, 3, runs[r].w, runs[r].d);
        o.gammas = runs[r].g;
        o.normalize = runs[r].normalize;
        combo c = {.k = 3, .w = runs[r].w, .sign = runs[r].m == LM_MERGE_BREADCRUMBS_TIES ? SIGN_SUM : SIGN_NONE,
                   .normalize = runs[r].normalize, .lambda = 1.0};
        double *tp[3][MAX_T] = {{0}};
        for (int i = 0; i < 3; i++)
            for (int t = 0; t < f.base.n; t++) {
                tp[i][t] = malloc((size_t)f.base.t[t].n * sizeof(double));
                band_ref(tau[i][t], f.base.t[t].n, runs[r].d[i], runs[r].g[i], tp[i][t]);
            }
        lm_st_file *st = run_merge(f.root, &o, f.base_dir, dirs, NULL);
        if (st)
            check_combined(st, &f.base, &c, tp);
        // the same bytes in slabs of a row, on more threads, and on the devices, with fallbacks
        char what[64];
        snprintf(what, sizeof what, "%s run %zu", lm_merge_method_name(runs[r].m), r);
        same_variants(f.root, &o, f.base_dir, dirs, st, 12, true, what);
        lm_st_close(st);
        for (int i = 0; i < 3; i++)
            for (int t = 0; t < f.base.n; t++)
                free(tp[i][t]);
    }
    // a gamma outside [0, 1], and --topk global, are refused before any work
    double g_bad[3] = {0.1, 1.5, 0.1}, w[3] = {1, 1, 1}, d[3] = {0.5, 0.5, 0.5};
    lm_merge_opts o = fixture_merge_opts(LM_MERGE_BREADCRUMBS, 3, w, d);
    lm_err err = {0};
    o.gammas = g_bad;
    CHECK_FAILS(lm_merge_check_opts(&o, &err), LM_ERR_USAGE, "gamma 2 is 1.5", &err);
    o.gammas = NULL;
    o.topk_global = true;
    CHECK_FAILS(lm_merge_check_opts(&o, &err), LM_ERR_USAGE, "--topk global", &err);
    for (int i = 0; i < 3; i++) {
        free_taus(tau[i]);
        free(dirs_own[i]);
    }
    fx_close(&f);
}

// ==== della ===================================================================================

static const double *g_row;

static int cmp_rank(const void *pa, const void *pb)
{
    int64_t a = *(const int64_t *)pa, b = *(const int64_t *)pb;
    double ma = fabs(g_row[a]), mb = fabs(g_row[b]);
    if (ma != mb)
        return ma < mb ? -1 : 1;
    return a < b ? -1 : a > b;
}

// out = τ after DELLA's drop as docs/merging.md states it: per row (a vector one row), entries
// ranked by magnitude ascending (ties: the lower index first), p = (d − ε) + 2ε·r/(n − 1), kept
// when the counter-based draw of (seed, model, tensor, index) is below p, then times 1/p (inv),
// the whole tensor times ‖τ‖₁/‖kept‖₁ (l1), or as is; d = 1 keeps τ whole.
static void della_ref(const double *tau, const tensor *t, int ft, double d, double eps, lm_rescale rescale,
                      double *out)
{
    int64_t rows = t->ndim == 2 ? t->shape[0] : 1, cols = t->n / rows;
    if (d >= 1) {
        memcpy(out, tau, (size_t)t->n * sizeof *out);
        return;
    }
    uint64_t key = lm_rng_key(0, ft, lm_xxh64(t->name, strlen(t->name)));
    int64_t *idx = malloc((size_t)cols * sizeof *idx);
    double l1_all = 0, l1_kept = 0;
    for (int64_t r = 0; r < rows; r++) {
        g_row = tau + r * cols;
        for (int64_t c = 0; c < cols; c++)
            idx[c] = c;
        qsort(idx, (size_t)cols, sizeof *idx, cmp_rank);
        for (int64_t rank = 0; rank < cols; rank++) {
            int64_t j = r * cols + idx[rank];
            double p = cols > 1 ? (d - eps) + 2 * eps * (double)rank / (double)(cols - 1) : d - eps;
            bool keep = lm_rng_keep(key, j, (uint64_t)(p * 4294967296.0));
            out[j] = keep ? (rescale == LM_RESCALE_INV ? tau[j] / p : tau[j]) : 0;
            l1_all += fabs(tau[j]);
            l1_kept += fabs(keep ? tau[j] : 0);
        }
    }
    if (rescale == LM_RESCALE_L1 && l1_all >= 1e-7 && l1_kept >= 1e-7)
        for (int64_t j = 0; j < t->n; j++)
            out[j] *= l1_all / l1_kept;
    free(idx);
}

static void test_della(void)
{
    fixture f;
    fx_open(&f, band_base, "float32");
    char *dirs_own[3];
    double *tau[3][MAX_T];
    rng_seed(93);
    make_fts(&f, 3, dirs_own, tau);
    const char *dirs[3] = {dirs_own[0], dirs_own[1], dirs_own[2]};
    static const struct {
        lm_merge_method m;
        double w[3], d[3], eps[3];
        lm_rescale rescale;
        bool normalize;
    } runs[] = {
        {LM_MERGE_DELLA, {1, 1, 1}, {0.5, 0.5, 0.5}, {0.15, 0.15, 0.15}, LM_RESCALE_INV, true},
        {LM_MERGE_DELLA, {1, 0.5, 2}, {0.3, 1.0, 0.6}, {0.1, 0.2, 0.3}, LM_RESCALE_L1, true},
        {LM_MERGE_DELLA_LINEAR, {1, 1, 0.5}, {0.4, 0.7, 0.5}, {0.0, 0.25, 0.1}, LM_RESCALE_NONE, false},
        {LM_MERGE_DELLA_LINEAR, {0.5, 1, 1}, {0.6, 0.6, 0.2}, {0.1, 0.1, 0.1}, LM_RESCALE_INV, false},
    };
    for (size_t r = 0; r < sizeof runs / sizeof runs[0]; r++) {
        lm_merge_opts o = fixture_merge_opts(runs[r].m, 3, runs[r].w, runs[r].d);
        o.epsilons = runs[r].eps;
        o.rescale = runs[r].rescale;
        o.normalize = runs[r].normalize;
        combo c = {.k = 3, .w = runs[r].w, .sign = runs[r].m == LM_MERGE_DELLA ? SIGN_SUM : SIGN_NONE,
                   .normalize = runs[r].normalize, .lambda = 1.0};
        double *tp[3][MAX_T] = {{0}};
        for (int i = 0; i < 3; i++)
            for (int t = 0; t < f.base.n; t++) {
                tp[i][t] = malloc((size_t)f.base.t[t].n * sizeof(double));
                della_ref(tau[i][t], &f.base.t[t], i, runs[r].d[i], runs[r].eps[i], runs[r].rescale, tp[i][t]);
            }
        lm_st_file *st = run_merge(f.root, &o, f.base_dir, dirs, NULL);
        if (st)
            check_combined(st, &f.base, &c, tp);
        // slabs of whole rows (vectors stay whole: one slab)
        char what[64];
        snprintf(what, sizeof what, "%s run %zu", lm_merge_method_name(runs[r].m), r);
        same_variants(f.root, &o, f.base_dir, dirs, st, 24, false, what);
        lm_st_close(st);
        for (int i = 0; i < 3; i++)
            for (int t = 0; t < f.base.n; t++)
                free(tp[i][t]);
    }
    // d ± ε outside (0, 1) is refused, as mergekit refuses it
    double w[3] = {1, 1, 1}, d[3] = {0.5, 0.1, 0.5}, eps[3] = {0.1, 0.1, 0.1};
    lm_merge_opts o = fixture_merge_opts(LM_MERGE_DELLA, 3, w, d);
    o.epsilons = eps;
    lm_err err = {0};
    CHECK_FAILS(lm_merge_check_opts(&o, &err), LM_ERR_USAGE, "input 2 has density 0.1 and epsilon 0.1", &err);
    for (int i = 0; i < 3; i++) {
        free_taus(tau[i]);
        free(dirs_own[i]);
    }
    fx_close(&f);
}

// ==== sce =====================================================================================

// sce as docs/merging.md states it, in double: the variance over all n FTs per entry (float32, as
// the selection ranks it), the top floor(p · nonzero) kept in every task vector (ties to the lower
// index), weights from the masked mean squares (1/n each when they sum below 1e-6), the sign of
// Σ τ, the agreeing entries' weighted mean. tau[i] NULL: FT i does not change the tensor.
static void sce_ref(const tensor *b, double *const *tau, int n, double p, double *exp, double *mag)
{
    int64_t m = b->n;
    double *key = malloc((size_t)m * sizeof *key), *t[MAX_FT];
    for (int i = 0; i < n; i++)
        t[i] = calloc((size_t)m, sizeof(double));
    int64_t nonzero = 0;
    for (int64_t j = 0; j < m; j++) {
        double sum = 0, sq = 0;
        for (int i = 0; i < n; i++)
            sum += tau[i] ? tau[i][j] : 0;
        double mean = sum / n;
        for (int i = 0; i < n; i++) {
            double v = (tau[i] ? tau[i][j] : 0) - mean;
            sq += v * v;
        }
        key[j] = (float)(sq / n);
        nonzero += key[j] != 0;
    }
    bool *keep = malloc((size_t)m * sizeof *keep);
    if (p >= 1)
        for (int64_t j = 0; j < m; j++)
            keep[j] = true;
    else
        topk_ref(key, m, (int64_t)floor((double)nonzero * p), keep);
    double w[MAX_FT], wsum = 0;
    for (int i = 0; i < n; i++) {
        double s2 = 0;
        for (int64_t j = 0; j < m; j++) {
            t[i][j] = tau[i] && keep[j] ? tau[i][j] : 0;
            s2 += t[i][j] * t[i][j];
        }
        w[i] = s2 / (double)m;
        wsum += w[i];
    }
    for (int i = 0; i < n; i++)
        w[i] = fabs(wsum) < 1e-6 ? 1.0 / n : w[i] / wsum;
    for (int64_t j = 0; j < m; j++) {
        double vote = 0, num = 0, div = 0, abs_sum = 0;
        for (int i = 0; i < n; i++)
            vote += t[i][j];
        double s = vote >= 0 ? 1 : -1;
        for (int i = 0; i < n; i++)
            if (t[i][j] != 0 && (t[i][j] > 0) == (s > 0)) {
                num += w[i] * t[i][j];
                div += w[i];
                abs_sum += fabs(w[i] * t[i][j]);
            }
        exp[j] = b->v[j] + (div != 0 ? num / div : num);
        mag[j] = fabs((double)b->v[j]) + (div != 0 ? abs_sum / div : abs_sum);
    }
    for (int i = 0; i < n; i++)
        free(t[i]);
    free(key);
    free(keep);
}

static void test_sce(void)
{
    fixture f;
    fx_open(&f, band_base, "float32");
    char *dirs_own[3];
    double *tau[3][MAX_T];
    rng_seed(94);
    make_fts(&f, 3, dirs_own, tau);
    const char *dirs[3] = {dirs_own[0], dirs_own[1], dirs_own[2]};
    double w[3] = {1, 1, 1};
    const double topks[] = {1.0, 0.5, 0.1, 0.0};
    for (size_t r = 0; r < sizeof topks / sizeof topks[0]; r++) {
        lm_merge_opts o = fixture_merge_opts(LM_MERGE_SCE, 3, w, NULL);
        o.select_topk = topks[r];
        lm_st_file *st = run_merge(f.root, &o, f.base_dir, dirs, NULL);
        for (int t = 0; st && t < f.base.n; t++) {
            const tensor *b = &f.base.t[t];
            double *exp = malloc((size_t)b->n * sizeof *exp), *mag = malloc((size_t)b->n * sizeof *mag);
            double *cols[3] = {tau[0][t], tau[1][t], tau[2][t]};
            sce_ref(b, cols, 3, topks[r], exp, mag);
            check_values(st, b->name, exp, mag, b->n);
            free(exp);
            free(mag);
        }
        char what[64];
        snprintf(what, sizeof what, "sce select_topk %g", topks[r]);
        same_variants(f.root, &o, f.base_dir, dirs, st, 12, false, what);
        lm_st_close(st);
    }
    for (int i = 0; i < 3; i++) {
        free_taus(tau[i]);
        free(dirs_own[i]);
    }
    fx_close(&f);
}

// ram: Δ = Σ_i w_i τ_i [|τ_i| > ε_i] / Σ_i w_i [|τ_i| > ε_i] (Δ = 0 where no τ_i counts), in
// double; exp and mag as check_values reads them.
static void ram_ref(const tensor *b, double *const *tau, int n, const double *w, const double *eps, double *exp,
                    double *mag)
{
    for (int64_t j = 0; j < b->n; j++) {
        double num = 0, den = 0, abs_sum = 0;
        for (int i = 0; i < n; i++)
            if (fabs(tau[i][j]) > eps[i]) {
                num += w[i] * tau[i][j];
                den += w[i];
                abs_sum += fabs(w[i] * tau[i][j]);
            }
        exp[j] = b->v[j] + (den != 0 ? num / den : 0);
        mag[j] = fabs((double)b->v[j]) + (den != 0 ? abs_sum / den : 0);
    }
}

// ram against ram_ref: mergekit's default epsilon (every change counts), a threshold between the
// task vectors' steps of 1/16 (0.2: 0.1875 does not count, 0.25 does), one per FT with unequal
// weights, and 0 (any change counts); then the same bytes in slabs, on 3 threads and on the
// devices with fallbacks.
static void test_ram(void)
{
    fixture f;
    fx_open(&f, band_base, "float32");
    char *dirs_own[3];
    double *tau[3][MAX_T];
    rng_seed(95);
    make_fts(&f, 3, dirs_own, tau);
    const char *dirs[3] = {dirs_own[0], dirs_own[1], dirs_own[2]};
    static const struct {
        double eps[3], w[3];
        bool default_eps;
    } cases[] = {
        {{1e-5, 1e-5, 1e-5}, {1, 1, 1}, true},
        {{0.2, 0.2, 0.2}, {1, 1, 1}, false},
        {{0, 0.3, 0.5}, {1, 2, 0.5}, false},
        {{0, 0, 0}, {1, 1, 1}, false},
    };
    int64_t counted = 0, none = 0, several = 0;
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        double w[3], eps[3];
        memcpy(w, cases[c].w, sizeof w);
        memcpy(eps, cases[c].eps, sizeof eps);
        lm_merge_opts o = fixture_merge_opts(LM_MERGE_RAM, 3, w, NULL);
        o.normalize = true;
        o.epsilons = cases[c].default_eps ? NULL : eps;
        lm_st_file *st = run_merge(f.root, &o, f.base_dir, dirs, NULL);
        for (int t = 0; st && t < f.base.n; t++) {
            const tensor *b = &f.base.t[t];
            double *exp = malloc((size_t)b->n * sizeof *exp), *mag = malloc((size_t)b->n * sizeof *mag);
            double *cols[3] = {tau[0][t], tau[1][t], tau[2][t]};
            ram_ref(b, cols, 3, w, eps, exp, mag);
            check_values(st, b->name, exp, mag, b->n);
            for (int64_t j = 0; j < b->n; j++) {
                int m = 0;
                for (int i = 0; i < 3; i++)
                    m += fabs(cols[i][j]) > eps[i];
                counted += m == 1;
                none += m == 0;
                several += m > 1;
            }
            free(exp);
            free(mag);
        }
        char what[64];
        snprintf(what, sizeof what, "ram case %zu", c);
        same_variants(f.root, &o, f.base_dir, dirs, st, 12, c == 1, what);
        lm_st_close(st);
    }
    // the cases reach every rule: entries that one FT alone changes, that several do, that none does
    CHECK_MSG(counted > 0 && several > 0 && none > 0, "ram: %lld entries with one change, %lld with several, %lld "
              "with none", (long long)counted, (long long)several, (long long)none);
    for (int i = 0; i < 3; i++) {
        free_taus(tau[i]);
        free(dirs_own[i]);
    }
    fx_close(&f);
}

// ramplus_tl in double: ram's counted entries (m_i = [|τ_i| > ε_i], c = Σ m_i), each FT's λ_i
// from its entries counted with another's (shared) and alone (unique) over the tensor, then
// λ_i τ_i where c = 1, the mean of the counted τ where c > 1, 0 where c = 0.
static void ramplus_ref(const tensor *b, double *const *tau, int n, const double *eps, double r, double alpha,
                        double *exp, double *mag, double *lambda)
{
    double shared[3] = {0}, unique[3] = {0};
    for (int64_t j = 0; j < b->n; j++) {
        int c = 0;
        for (int i = 0; i < n; i++)
            c += fabs(tau[i][j]) > eps[i];
        for (int i = 0; i < n; i++)
            if (fabs(tau[i][j]) > eps[i]) {
                shared[i] += c > 1;
                unique[i] += c == 1;
            }
    }
    for (int i = 0; i < n; i++)
        lambda[i] = 1 + r * fmin(fmax(shared[i] / fmax(unique[i], eps[i]), 0), alpha);
    for (int64_t j = 0; j < b->n; j++) {
        int c = 0;
        double sum = 0, abs_sum = 0, one = 0;
        for (int i = 0; i < n; i++)
            if (fabs(tau[i][j]) > eps[i]) {
                c++;
                sum += tau[i][j];
                abs_sum += fabs(tau[i][j]);
                one = lambda[i] * tau[i][j];
            }
        double d = c == 1 ? one : c > 1 ? sum / c : 0;
        exp[j] = b->v[j] + d;
        mag[j] = fabs((double)b->v[j]) + (c == 1 ? fabs(one) : c > 1 ? abs_sum / c : 0);
    }
}

// ramplus_tl against ramplus_ref: mergekit's defaults, and a threshold between the task vectors'
// steps with r and alpha large enough that λ_i differ between FTs; the λ_i of the second case
// are checked to differ (else the test could not tell them apart); then the same bytes in slabs,
// on 3 threads and on the devices with fallbacks.
static void test_ramplus(void)
{
    fixture f;
    fx_open(&f, band_base, "float32");
    char *dirs_own[3];
    double *tau[3][MAX_T];
    rng_seed(96);
    make_fts(&f, 3, dirs_own, tau);
    const char *dirs[3] = {dirs_own[0], dirs_own[1], dirs_own[2]};
    static const struct {
        double eps[3], r, alpha;
    } cases[] = {
        {{1e-5, 1e-5, 1e-5}, 0.1, 0.2},
        {{0.3, 0.5, 0.7}, 0.5, 100},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        double w[3] = {1, 1, 1}, eps[3];
        memcpy(eps, cases[c].eps, sizeof eps);
        lm_merge_opts o = fixture_merge_opts(LM_MERGE_RAMPLUS, 3, w, NULL);
        o.epsilons = eps;
        o.ram_r = cases[c].r;
        o.ram_alpha = cases[c].alpha;
        lm_st_file *st = run_merge(f.root, &o, f.base_dir, dirs, NULL);
        bool lambdas_differ = false;
        for (int t = 0; st && t < f.base.n; t++) {
            const tensor *b = &f.base.t[t];
            double *exp = malloc((size_t)b->n * sizeof *exp), *mag = malloc((size_t)b->n * sizeof *mag), lam[3];
            double *cols[3] = {tau[0][t], tau[1][t], tau[2][t]};
            ramplus_ref(b, cols, 3, eps, cases[c].r, cases[c].alpha, exp, mag, lam);
            check_values(st, b->name, exp, mag, b->n);
            lambdas_differ = lambdas_differ || lam[0] != lam[1] || lam[1] != lam[2];
            free(exp);
            free(mag);
        }
        if (c == 1)
            CHECK_MSG(lambdas_differ, "ramplus_tl: every tensor's lambda_i are equal: the case tells nothing");
        char what[64];
        snprintf(what, sizeof what, "ramplus_tl case %zu", c);
        same_variants(f.root, &o, f.base_dir, dirs, st, 12, c == 1, what);
        lm_st_close(st);
    }
    for (int i = 0; i < 3; i++) {
        free_taus(tau[i]);
        free(dirs_own[i]);
    }
    fx_close(&f);
}

int main(void)
{
    test_breadcrumbs();
    test_della();
    test_sce();
    test_ram();
    test_ramplus();
    return check_report("test_merge_sparse");
}
