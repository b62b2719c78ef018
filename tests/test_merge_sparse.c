// Tests of the methods that sparsify task vectors beyond TIES and DARE (lib/methods/): breadcrumbs
// and breadcrumbs-ties against a reference computed here in double (the entries ranked by
// magnitude with ties to the lower index, the band between the outliers and the smallest kept),
// including the cases mergekit gets wrong (γ·numel < 1 keeps the top d·numel, not nothing),
// density 1, a band cut short where d + γ exceed 1, and the same bytes in slabs and on the
// simulated and emulated devices under budgets where units fall back.
#include <math.h>
#include <stdbool.h>
#include <stdint.h>

#include "check.h"
#include "merge.h"
#include "merge_fixture.h"
#include "ref_merge.h"
#include "safetensors.h"

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
        const char *devices[] = {NULL, NULL, "sim:64MiB", "sim:900", "cuda-emu:900"};
        for (size_t v = 0; st && v < sizeof devices / sizeof devices[0]; v++) {
            lm_merge_opts o2 = o;
            o2.slab_elems = v == 0 ? 12 : 0;
            o2.threads = v == 1 ? 3 : 1;
            g_device = devices[v];
            lm_merge_result res;
            memset(&res, 0, sizeof res);
            lm_st_file *st2 = run_merge(f.root, &o2, f.base_dir, dirs, &res);
            CHECK_MSG(same_output(st, st2), "%s run %zu: variant %zu differs", lm_merge_method_name(runs[r].m), r, v);
            if (devices[v] && strstr(devices[v], ":900"))
                CHECK_MSG(res.fallback_merge > 0, "%s on %s: no unit fell back", lm_merge_method_name(runs[r].m),
                          devices[v]);
            lm_merge_result_free(&res);
            lm_st_close(st2);
        }
        g_device = NULL;
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

int main(void)
{
    test_breadcrumbs();
    return check_report("test_merge_sparse");
}
