// Tests of the methods that interpolate whole tensors (lib/methods/: linear, slerp, nuslerp,
// multislerp, karcher, model_stock) and of nearswap, against references computed here in double
// on the tensors as vectors, following each method's definition in docs/merging.md step by step
// (not through Gram matrices, as the engine does): full FTs and LoRA adapters, a tensor an
// adapter leaves alone, weights and normalize, per-tensor parameters through tensor_params,
// the degenerate cases (colinear slerp, one vector, t at 0 and 1), and the same bytes on the
// simulated device under budgets where units fall back.
#include <math.h>
#include <stdbool.h>
#include <stdint.h>

#include "check.h"
#include "merge.h"
#include "merge_fixture.h"
#include "ref_merge.h"
#include "safetensors.h"

// ==== the fixtures ============================================================================

// A base of three tensors: a LoRA target, a second matrix and a vector.
static void interp_base(tset *b)
{
    rng_seed(71);
    fill_q(ts_add2(b, "layers.0.q_proj.weight", 6, 5), 30, 2.0, 12);
    fill_q(ts_add2(b, "layers.1.mlp.weight", 7, 9), 63, 2.0, 12);
    fill_q(ts_add1(b, "norm.weight", 9), 9, 2.0, 12);
}

#define NT 3  // tensors of interp_base

// The inputs: up to MAX_FT FTs, each a full model (tau given for every tensor) or an adapter
// of layers.0.q_proj (tau zero elsewhere). tau[i][t] is FT i's τ of tensor t, as the engine
// computes it (exact for the full models; s·B@A for the adapter, mag its rounding scale).
typedef struct inputs {
    int n;
    char *dirs[MAX_FT];
    double *tau[MAX_FT][MAX_T];
    double *mag[MAX_FT][MAX_T];
} inputs;

static void add_full(inputs *in, const fixture *f, double scale)
{
    int i = in->n++;
    char nm[16];
    snprintf(nm, sizeof nm, "ft%d", i);
    in->dirs[i] = subdir(f->root, nm);
    alloc_taus(&f->base, in->tau[i]);
    alloc_taus(&f->base, in->mag[i]);
    for (int t = 0; t < f->base.n; t++)
        for (int64_t j = 0; j < f->base.t[t].n; j++) {
            in->tau[i][t][j] = scale * rng_q(0.5, 10);
            in->mag[i][t][j] = fabs(in->tau[i][t][j]);
        }
    write_ft(in->dirs[i], &f->base, in->tau[i]);
}

static void add_lora_ft(inputs *in, const fixture *f)
{
    int i = in->n++;
    char nm[16];
    snprintf(nm, sizeof nm, "ad%d", i);
    in->dirs[i] = subdir(f->root, nm);
    alloc_taus(&f->base, in->tau[i]);
    alloc_taus(&f->base, in->mag[i]);
    tset a = {0};
    add_lora(&a, "layers.0.q_proj", 2, 5, 6);
    write_adapter(in->dirs[i], "{\"peft_type\": \"LORA\", \"r\": 2, \"lora_alpha\": 4, "
                               "\"target_modules\": [\"q_proj\"]}", &a);
    lora_ref(in->tau[i][0], in->mag[i][0], ts_get(&a, "base_model.model.layers.0.q_proj.lora_A.weight"),
             ts_get(&a, "base_model.model.layers.0.q_proj.lora_B.weight"), 2, 5, 6, 2.0, false);
    ts_free(&a);
}

static void free_inputs(inputs *in)
{
    for (int i = 0; i < in->n; i++) {
        free_taus(in->tau[i]);
        free_taus(in->mag[i]);
        free(in->dirs[i]);
    }
}

// The options of method m for the inputs: weights w (n of them), the base's weight bw.
static lm_merge_opts interp_opts(lm_merge_method m, const inputs *in, const double *w, double bw)
{
    lm_merge_opts o = fixture_merge_opts(m, in->n, w, NULL);
    o.base_weight = bw;
    o.t = 0.5;
    o.max_iter = 10;
    o.tol = 1e-5;
    return o;
}

static const char *dirs_of(const inputs *in, const char **d)
{
    for (int i = 0; i < in->n; i++)
        d[i] = in->dirs[i];
    return d[0];
}

// ==== references: vectors in double ===========================================================

static double vdot(const double *a, const double *b, int64_t n)
{
    double s = 0;
    for (int64_t j = 0; j < n; j++)
        s += a[j] * b[j];
    return s;
}

// x[j] of the vectors a method reads for tensor t: with `models` the models (x_0 = θ_b, x_{i+1} =
// θ_b + τ_i), else the task vectors τ_i. Returns how many; the caller frees each.
static int vectors(const fixture *f, const inputs *in, int t, bool models, double **x)
{
    const tensor *b = &f->base.t[t];
    int m = 0;
    if (models) {
        x[m] = malloc((size_t)b->n * sizeof(double));
        for (int64_t j = 0; j < b->n; j++)
            x[m][j] = b->v[j];
        m++;
    }
    for (int i = 0; i < in->n; i++, m++) {
        x[m] = malloc((size_t)b->n * sizeof(double));
        for (int64_t j = 0; j < b->n; j++)
            x[m][j] = (models ? (double)b->v[j] : 0.0) + in->tau[i][t][j];
    }
    return m;
}

// The rounding scale of tensor t's result: |θ_b| + Σ|τ| (+ mag) per entry, times `s`.
static double *scale_of(const fixture *f, const inputs *in, int t, double s)
{
    const tensor *b = &f->base.t[t];
    double *m = malloc((size_t)b->n * sizeof *m);
    for (int64_t j = 0; j < b->n; j++) {
        m[j] = fabs((double)b->v[j]);
        for (int i = 0; i < in->n; i++)
            m[j] += fabs(in->tau[i][t][j]) + in->mag[i][t][j];
        m[j] *= s;
    }
    return m;
}

static void free_vecs(double **x, int m)
{
    for (int j = 0; j < m; j++)
        free(x[j]);
}

// mergekit's slerp between v0 and v1 at t into out.
static void slerp_ref(double t, const double *v0, const double *v1, int64_t n, double *out)
{
    double n0 = sqrt(vdot(v0, v0, n)), n1 = sqrt(vdot(v1, v1, n));
    double d = vdot(v0, v1, n) / ((n0 > 1e-8 ? n0 : 1) * (n1 > 1e-8 ? n1 : 1));
    double s0, s1;
    if (fabs(d) > 0.9995) {
        s0 = 1 - t;
        s1 = t;
    } else {
        double th = acos(d);
        s0 = sin(th - th * t) / sin(th);
        s1 = sin(th * t) / sin(th);
    }
    for (int64_t j = 0; j < n; j++)
        out[j] = s0 * v0[j] + s1 * v1[j];
}

// ==== slerp ===================================================================================

// Per-tensor t: 0.2 for layers.0, 0.9 for layers.1, else the options' t (the callback of the
// tests of per-tensor parameters).
static lm_status t_by_layer(void *ctx, const char *tensor, lm_tensor_params *tp, lm_err *err)
{
    (void)ctx;
    (void)err;
    if (strstr(tensor, "layers.0."))
        tp->t = 0.2;
    else if (strstr(tensor, "layers.1."))
        tp->t = 0.9;
    return LM_OK;
}

static void test_slerp(void)
{
    fixture f;
    fx_open(&f, interp_base, "float32");
    inputs in = {0};
    rng_seed(72);
    add_full(&in, &f, 1.0);
    const char *d[MAX_FT];
    dirs_of(&in, d);
    double w = 1;
    const double ts[] = {0.0, 0.3, 1.0};
    for (int r = 0; r < 4; r++) {
        lm_merge_opts o = interp_opts(LM_MERGE_SLERP, &in, &w, 1);
        if (r < 3)
            o.t = ts[r];
        else
            o.tensor_params = t_by_layer;
        lm_st_file *st = run_merge(f.root, &o, f.base_dir, d, NULL);
        for (int t = 0; st && t < NT; t++) {
            double *x[2], tt = r < 3 ? ts[r] : t == 0 ? 0.2 : t == 1 ? 0.9 : 0.5;
            int64_t n = f.base.t[t].n;
            vectors(&f, &in, t, true, x);
            double *exp = malloc((size_t)n * sizeof *exp), *mag = scale_of(&f, &in, t, 1);
            slerp_ref(tt, x[0], x[1], n, exp);
            check_values(st, f.base.t[t].name, exp, mag, n);
            free(exp);
            free(mag);
            free_vecs(x, 2);
        }
        lm_st_close(st);
    }
    free_inputs(&in);

    // nearly colinear: θ_1 = 1.001·θ_b, linear interpolation
    in = (inputs){0};
    in.n = 1;
    in.dirs[0] = subdir(f.root, "colinear");
    alloc_taus(&f.base, in.tau[0]);
    alloc_taus(&f.base, in.mag[0]);
    for (int t = 0; t < NT; t++)
        for (int64_t j = 0; j < f.base.t[t].n; j++)
            in.tau[0][t][j] = (double)(float)(1.001 * f.base.t[t].v[j]) - f.base.t[t].v[j];
    write_ft(in.dirs[0], &f.base, in.tau[0]);
    dirs_of(&in, d);
    lm_merge_opts o = interp_opts(LM_MERGE_SLERP, &in, &w, 1);
    o.t = 0.25;
    lm_st_file *st = run_merge(f.root, &o, f.base_dir, d, NULL);
    for (int t = 0; st && t < NT; t++)
        check_sum(st, &f.base, f.base.t[t].name, in.tau[0][t], NULL, 0.25);
    lm_st_close(st);
    free_inputs(&in);

    // an adapter: the tensors it leaves alone are the base's (the two models agree there)
    in = (inputs){0};
    rng_seed(73);
    add_lora_ft(&in, &f);
    dirs_of(&in, d);
    o = interp_opts(LM_MERGE_SLERP, &in, &w, 1);
    o.t = 0.6;
    st = run_merge(f.root, &o, f.base_dir, d, NULL);
    if (st) {
        double *x[2];
        int64_t n = f.base.t[0].n;
        vectors(&f, &in, 0, true, x);
        double *exp = malloc((size_t)n * sizeof *exp), *mag = scale_of(&f, &in, 0, 1);
        slerp_ref(0.6, x[0], x[1], n, exp);
        check_values(st, f.base.t[0].name, exp, mag, n);
        check_same(st, &f.base, f.base.t[1].name);
        check_same(st, &f.base, f.base.t[2].name);
        free(exp);
        free(mag);
        free_vecs(x, 2);
    }
    lm_st_close(st);
    free_inputs(&in);
    fx_close(&f);
}

// ==== linear ==================================================================================

static void test_linear(void)
{
    fixture f;
    fx_open(&f, interp_base, "float32");
    inputs in = {0};
    rng_seed(74);
    add_full(&in, &f, 1.0);
    add_lora_ft(&in, &f);
    const char *d[MAX_FT];
    dirs_of(&in, d);
    const struct {
        double bw, w[2];
        bool normalize;
    } runs[] = {{1, {1, 1}, true}, {0.5, {2, 3}, true}, {0, {1, 3}, true}, {0.5, {0.25, 0.5}, false}};
    for (size_t r = 0; r < sizeof runs / sizeof runs[0]; r++) {
        lm_merge_opts o = interp_opts(LM_MERGE_LINEAR, &in, runs[r].w, runs[r].bw);
        o.normalize = runs[r].normalize;
        lm_st_file *st = run_merge(f.root, &o, f.base_dir, d, NULL);
        double W = runs[r].normalize ? runs[r].bw + runs[r].w[0] + runs[r].w[1] : 1.0;
        for (int t = 0; st && t < NT; t++) {
            double *x[3];
            int64_t n = f.base.t[t].n;
            vectors(&f, &in, t, true, x);
            double *exp = malloc((size_t)n * sizeof *exp), *mag = scale_of(&f, &in, t, 1);
            // every model holds every tensor: an adapter's untouched ones are the base's
            for (int64_t j = 0; j < n; j++)
                exp[j] = (runs[r].bw * x[0][j] + runs[r].w[0] * x[1][j] + runs[r].w[1] * x[2][j]) / W;
            check_values(st, f.base.t[t].name, exp, mag, n);
            free(exp);
            free(mag);
            free_vecs(x, 3);
        }
        lm_st_close(st);
    }
    // weights that sum to zero cannot be normalised: an error naming the tensor
    double wz[2] = {1, -2};
    lm_merge_opts o = interp_opts(LM_MERGE_LINEAR, &in, wz, 1);
    lm_err err = {0};
    lm_model *base = NULL;
    lm_ft *fts[2] = {0};
    CHECK_OK(lm_model_open(&base, f.base_dir, &err), &err);
    for (int i = 0; i < 2 && base; i++)
        CHECK_OK(lm_ft_open(&fts[i], d[i], base, &err), &err);
    lm_dev *dev = NULL;
    CHECK_OK(lm_dev_cpu_create(&dev, 1, &err), &err);
    lm_st_desc *desc = NULL;
    int64_t nd = 0;
    char *out = lm_path_join(f.root, "zero");
    CHECK_OK(lm_mkdir_p(out, &err), &err);
    CHECK_OK(lm_merge_outputs(&o, base, &desc, &nd, &err), &err);
    lm_st_writer *w = NULL;
    CHECK_OK(lm_st_writer_open(&w, out, desc, nd, 5000000000ull, NULL, &err), &err);
    lm_merge_result res;
    CHECK_FAILS(lm_merge_run(&o, dev, base, fts, w, NULL, &res, &err), LM_ERR_USAGE, "sum to 0", &err);
    lm_st_writer_free(w);
    free(desc);
    free(out);
    lm_dev_destroy(dev);
    for (int i = 0; i < 2; i++)
        lm_ft_free(fts[i]);
    lm_model_free(base);
    free_inputs(&in);
    fx_close(&f);
}

// ==== nuslerp =================================================================================

// mergekit's nuslerp of v0 and v1 at t, the tensor one vector.
static void nuslerp_ref(double t, const double *v0, const double *v1, int64_t n, double *out)
{
    double n0 = fmax(sqrt(vdot(v0, v0, n)), 1e-7), n1 = fmax(sqrt(vdot(v1, v1, n)), 1e-7);
    double c = vdot(v0, v1, n) / (n0 * n1);
    double th = acos(c < -1 ? -1 : c > 1 ? 1 : c), s = sin(th);
    for (int64_t j = 0; j < n; j++)
        out[j] = fabs(s) < 1e-8 ? (1 - t) * v0[j] + t * v1[j] : (sin((1 - t) * th) * v0[j] + sin(t * th) * v1[j]) / s;
}

static void test_nuslerp(void)
{
    fixture f;
    fx_open(&f, interp_base, "float32");
    inputs in = {0};
    rng_seed(75);
    add_full(&in, &f, 1.0);
    add_full(&in, &f, 0.75);
    const char *d[MAX_FT];
    dirs_of(&in, d);
    // with a base: the two task vectors, t = w_2 / (w_1 + w_2)
    double w[2] = {1, 3};
    lm_merge_opts o = interp_opts(LM_MERGE_NUSLERP, &in, w, 1);
    lm_st_file *st = run_merge(f.root, &o, f.base_dir, d, NULL);
    for (int t = 0; st && t < NT; t++) {
        double *x[2];
        int64_t n = f.base.t[t].n;
        vectors(&f, &in, t, false, x);
        double *exp = malloc((size_t)n * sizeof *exp), *mag = scale_of(&f, &in, t, 1);
        nuslerp_ref(0.75, x[0], x[1], n, exp);
        for (int64_t j = 0; j < n; j++)
            exp[j] += f.base.t[t].v[j];
        check_values(st, f.base.t[t].name, exp, mag, n);
        free(exp);
        free(mag);
        free_vecs(x, 2);
    }
    lm_st_close(st);
    // the models themselves: the base and FT 1, t from the base's weight and FT 1's
    inputs one = {.n = 1, .dirs = {in.dirs[0]}};
    memcpy(one.tau[0], in.tau[0], sizeof one.tau[0]);
    memcpy(one.mag[0], in.mag[0], sizeof one.mag[0]);
    double w1 = 3;
    o = interp_opts(LM_MERGE_NUSLERP, &one, &w1, 1);
    o.models_only = true;
    st = run_merge(f.root, &o, f.base_dir, d, NULL);
    for (int t = 0; st && t < NT; t++) {
        double *x[2];
        int64_t n = f.base.t[t].n;
        vectors(&f, &one, t, true, x);
        double *exp = malloc((size_t)n * sizeof *exp), *mag = scale_of(&f, &one, t, 1);
        nuslerp_ref(0.75, x[0], x[1], n, exp);
        check_values(st, f.base.t[t].name, exp, mag, n);
        free(exp);
        free(mag);
        free_vecs(x, 2);
    }
    lm_st_close(st);
    free_inputs(&in);
    fx_close(&f);
}

// ==== multislerp ==============================================================================

// mergekit's multislerp of m vectors with weights w (normalised to sum 1 when `norm`).
static void multislerp_ref(double **x, const double *w_in, int m, bool norm, int64_t n, double *out)
{
    const double eps = 1e-8;
    double w[MAX_FT + 1], nrm[MAX_FT + 1], ws = 0;
    for (int i = 0; i < m; i++)
        ws += w_in[i];
    double *u[MAX_FT + 1], *mean = calloc((size_t)n, sizeof *mean), *tan = calloc((size_t)n, sizeof *tan);
    for (int i = 0; i < m; i++) {
        w[i] = norm ? w_in[i] / ws : w_in[i];
        nrm[i] = sqrt(vdot(x[i], x[i], n));
        u[i] = malloc((size_t)n * sizeof(double));
        for (int64_t j = 0; j < n; j++) {
            u[i][j] = x[i][j] / (nrm[i] + eps);
            mean[j] += w[i] * u[i][j];
        }
    }
    double mn = sqrt(vdot(mean, mean, n));
    for (int64_t j = 0; j < n; j++)
        mean[j] /= mn;
    for (int i = 0; i < m; i++) {
        double dt = vdot(u[i], mean, n);
        for (int64_t j = 0; j < n; j++)
            tan[j] += w[i] * (u[i][j] - dt * mean[j]);
    }
    double tn = sqrt(vdot(tan, tan, n)) + eps, avg = 0;
    for (int i = 0; i < m; i++)
        avg += nrm[i] * w[i];
    for (int64_t j = 0; j < n; j++)
        out[j] = avg * (mean[j] * cos(tn) + tan[j] * sin(tn) / tn);
    for (int i = 0; i < m; i++)
        free(u[i]);
    free(mean);
    free(tan);
}

static void test_multislerp(void)
{
    fixture f;
    fx_open(&f, interp_base, "float32");
    inputs in = {0};
    rng_seed(76);
    add_full(&in, &f, 1.0);
    add_full(&in, &f, 0.5);
    add_lora_ft(&in, &f);
    const char *d[MAX_FT];
    dirs_of(&in, d);
    double w[3] = {1, 2, 0.5};
    for (int models = 0; models < 2; models++) {
        lm_merge_opts o = interp_opts(LM_MERGE_MULTISLERP, &in, w, 1.5);
        o.models_only = models;
        o.normalize = true;
        lm_st_file *st = run_merge(f.root, &o, f.base_dir, d, NULL);
        for (int t = 0; st && t < NT; t++) {
            double *x[4], wv[4];
            int64_t n = f.base.t[t].n;
            int m = vectors(&f, &in, t, models, x);
            for (int i = 0; i < m; i++)
                wv[i] = models ? (i == 0 ? 1.5 : w[i - 1]) : w[i];
            double *exp = malloc((size_t)n * sizeof *exp), *mag = scale_of(&f, &in, t, 1);
            multislerp_ref(x, wv, m, true, n, exp);
            for (int64_t j = 0; !models && j < n; j++)
                exp[j] += f.base.t[t].v[j];
            check_values(st, f.base.t[t].name, exp, mag, n);
            free(exp);
            free(mag);
            free_vecs(x, m);
        }
        lm_st_close(st);
    }
    // one task vector: the FT itself
    inputs one = {.n = 1, .dirs = {in.dirs[0]}};
    lm_merge_opts o = interp_opts(LM_MERGE_MULTISLERP, &one, w, 1);
    lm_st_file *st = run_merge(f.root, &o, f.base_dir, d, NULL);
    for (int t = 0; st && t < NT; t++)
        check_sum(st, &f.base, f.base.t[t].name, in.tau[0][t], NULL, 1.0);
    lm_st_close(st);
    free_inputs(&in);
    fx_close(&f);
}

// ==== karcher =================================================================================

// mergekit's Karcher mean of m vectors, equal weights.
static void karcher_ref(double **x, int m, int max_iter, double tol, int64_t n, double *out)
{
    double nrm[MAX_FT + 1], al[MAX_FT + 1], asum = 0;
    int first = -1;
    for (int i = 0; i < m; i++) {
        nrm[i] = sqrt(vdot(x[i], x[i], n));
        al[i] = nrm[i] > tol ? 1.0 / m : 0;
        asum += al[i];
        if (first < 0 && nrm[i] > tol)
            first = i;
    }
    double *u = calloc((size_t)n, sizeof *u), *T = malloc((size_t)n * sizeof *T);
    for (int i = 0; i < m; i++)
        for (int64_t j = 0; al[i] > 0 && j < n; j++)
            u[j] += al[i] / asum * x[i][j] / nrm[i];
    double nu = sqrt(vdot(u, u, n));
    for (int64_t j = 0; j < n; j++)
        u[j] = nu < tol ? x[first][j] / nrm[first] : u[j] / nu;
    for (int it = 0; it < max_iter; it++) {
        memset(T, 0, (size_t)n * sizeof *T);
        for (int i = 0; i < m; i++) {
            if (al[i] == 0)
                continue;
            double dt = 0;
            for (int64_t j = 0; j < n; j++)
                dt += u[j] * x[i][j] / nrm[i];
            dt = dt < -1 ? -1 : dt > 1 ? 1 : dt;
            double th = acos(dt);
            if (th < tol)
                continue;
            for (int64_t j = 0; j < n; j++)
                T[j] += al[i] / asum * th / sin(th) * (x[i][j] / nrm[i] - dt * u[j]);
        }
        double nt = sqrt(vdot(T, T, n));
        if (nt < tol)
            break;
        for (int64_t j = 0; j < n; j++)
            u[j] = cos(nt) * u[j] + sin(nt) * T[j] / nt;
        double un = sqrt(vdot(u, u, n));
        for (int64_t j = 0; un > tol && j < n; j++)
            u[j] /= un;
    }
    double s = 0;
    for (int i = 0; i < m; i++)
        s += nrm[i] / m;
    for (int64_t j = 0; j < n; j++)
        out[j] = s * u[j];
    free(u);
    free(T);
}

static void test_karcher(void)
{
    fixture f;
    fx_open(&f, interp_base, "float32");
    inputs in = {0};
    rng_seed(77);
    add_full(&in, &f, 1.5);
    add_full(&in, &f, 1.0);
    add_lora_ft(&in, &f);
    const char *d[MAX_FT];
    dirs_of(&in, d);
    double w[3] = {1, 1, 1};
    const int iters[] = {0, 1, 10};
    for (int r = 0; r < 3; r++) {
        lm_merge_opts o = interp_opts(LM_MERGE_KARCHER, &in, w, 1);
        o.max_iter = iters[r];
        lm_st_file *st = run_merge(f.root, &o, f.base_dir, d, NULL);
        for (int t = 0; st && t < NT; t++) {
            double *x[4];
            int64_t n = f.base.t[t].n;
            int m = vectors(&f, &in, t, true, x);
            double *exp = malloc((size_t)n * sizeof *exp), *mag = scale_of(&f, &in, t, 1);
            karcher_ref(x, m, iters[r], 1e-5, n, exp);
            check_values(st, f.base.t[t].name, exp, mag, n);
            free(exp);
            free(mag);
            free_vecs(x, m);
        }
        lm_st_close(st);
    }
    free_inputs(&in);
    fx_close(&f);
}

// ==== model_stock =============================================================================

static void test_model_stock(void)
{
    fixture f;
    fx_open(&f, interp_base, "float32");
    inputs in = {0};
    rng_seed(78);
    add_full(&in, &f, 1.0);
    add_full(&in, &f, 1.0);
    add_lora_ft(&in, &f);
    const char *d[MAX_FT];
    dirs_of(&in, d);
    double w[3] = {1, 1, 1};
    for (int k = 2; k <= 3; k++) {
        inputs sub = in;
        sub.n = k;
        lm_merge_opts o = interp_opts(LM_MERGE_MODEL_STOCK, &sub, w, 1);
        lm_st_file *st = run_merge(f.root, &o, f.base_dir, d, NULL);
        for (int t = 0; st && t < NT; t++) {
            double *x[4];
            int64_t n = f.base.t[t].n;
            int m = vectors(&f, &sub, t, false, x);
            // the mean cosine over pairs (a zero task vector has cosine 0 with any)
            double cs = 0;
            int pairs = 0;
            for (int i = 0; i < m; i++)
                for (int j = i + 1; j < m; j++, pairs++) {
                    double c = vdot(x[i], x[j], n) / fmax(sqrt(vdot(x[i], x[i], n) * vdot(x[j], x[j], n)), 1e-6);
                    cs += c < -1 ? -1 : c > 1 ? 1 : c;
                }
            cs /= pairs;
            double tt = m * cs / (1 + (m - 1) * cs);
            double *exp = malloc((size_t)n * sizeof *exp), *mag = scale_of(&f, &sub, t, 1);
            for (int64_t j = 0; j < n; j++) {
                double mean = 0;
                for (int i = 0; i < m; i++)
                    mean += x[i][j] / m;
                exp[j] = f.base.t[t].v[j] + tt * mean;
            }
            check_values(st, f.base.t[t].name, exp, mag, n);
            free(exp);
            free(mag);
            free_vecs(x, m);
        }
        lm_st_close(st);
    }
    free_inputs(&in);
    fx_close(&f);
}

// ==== nearswap ================================================================================

static void test_nearswap(void)
{
    fixture f;
    fx_open(&f, interp_base, "float32");
    inputs in = {0};
    rng_seed(79);
    add_full(&in, &f, 1.0);
    const char *d[MAX_FT];
    dirs_of(&in, d);
    double w = 1;
    const double ts[] = {0.0, 0.1, 10.0};
    for (int r = 0; r < 3; r++) {
        lm_merge_opts o = interp_opts(LM_MERGE_NEARSWAP, &in, &w, 1);
        o.t = ts[r];
        lm_st_file *st = run_merge(f.root, &o, f.base_dir, d, NULL);
        for (int t = 0; st && t < NT; t++) {
            int64_t n = f.base.t[t].n;
            double *exp = malloc((size_t)n * sizeof *exp);
            for (int64_t j = 0; j < n; j++) {
                double tau = in.tau[0][t][j], a = fabs(tau);
                double wt = ts[r] / (a > 1e-6 ? a : 1e-6);
                wt = wt < 0 ? 0 : wt > 1 ? 1 : wt;
                exp[j] = f.base.t[t].v[j] + wt * tau;
            }
            double *mag = scale_of(&f, &in, t, 1);
            check_values(st, f.base.t[t].name, exp, mag, n);
            free(exp);
            free(mag);
        }
        lm_st_close(st);
    }
    free_inputs(&in);
    fx_close(&f);
}

// ==== per row =================================================================================

// The merge of o on the devices, whole and where units fall back (budgets of 600 bytes), each
// the same bytes as cpu, the CPU's; with `fallback`, some unit must fall back at 600 bytes.
static void same_on_devices(const char *root, const lm_merge_opts *o, const char *base_dir, const char *const *d,
                            lm_st_file *cpu, bool fallback, const char *what)
{
    const char *devices[] = {"sim:64MiB", "sim:600", "cuda-emu:600"};
    for (size_t v = 0; cpu && v < sizeof devices / sizeof devices[0]; v++) {
        g_device = devices[v];
        lm_merge_result res;
        memset(&res, 0, sizeof res);
        lm_st_file *dev = run_merge(root, o, base_dir, d, &res);
        CHECK_MSG(same_output(cpu, dev), "%s on %s differs from the cpu's", what, devices[v]);
        if (fallback && strstr(devices[v], ":600"))
            CHECK_MSG(res.fallback_merge > 0, "%s on %s: no unit fell back", what, devices[v]);
        lm_merge_result_free(&res);
        lm_st_close(dev);
    }
    g_device = NULL;
}

// nuslerp and model_stock with each row of a matrix its own vector (a vector stays whole), against
// the per-vector references applied row by row.
static void test_per_row(void)
{
    fixture f;
    fx_open(&f, interp_base, "float32");
    inputs in = {0};
    rng_seed(81);
    add_full(&in, &f, 1.0);
    add_full(&in, &f, 0.5);
    add_lora_ft(&in, &f);
    const char *d[MAX_FT];
    dirs_of(&in, d);
    double w[3] = {1, 3, 1};
    for (int method = 0; method < 2; method++) {
        inputs sub = in;
        sub.n = method == 0 ? 2 : 3;
        lm_merge_opts o = interp_opts(method == 0 ? LM_MERGE_NUSLERP : LM_MERGE_MODEL_STOCK, &sub, w, 1);
        o.per_row = true;
        o.slab_elems = 20;  // several slabs: the rows' sums do not depend on them
        lm_st_file *st = run_merge(f.root, &o, f.base_dir, d, NULL);
        for (int t = 0; st && t < NT; t++) {
            const tensor *b = &f.base.t[t];
            int64_t rows = b->ndim == 2 ? b->shape[0] : 1, cols = b->n / rows;
            double *x[4];
            int m = vectors(&f, &sub, t, false, x);
            double *exp = malloc((size_t)b->n * sizeof *exp), *mag = scale_of(&f, &sub, t, 1);
            for (int64_t r = 0; r < rows; r++) {
                double *row[4];
                for (int i = 0; i < m; i++)
                    row[i] = x[i] + r * cols;
                double *out = exp + r * cols;
                if (method == 0) {
                    nuslerp_ref(0.75, row[0], row[1], cols, out);
                } else {
                    double cs = 0;
                    int pairs = 0;
                    for (int i = 0; i < m; i++)
                        for (int j = i + 1; j < m; j++, pairs++) {
                            double c = vdot(row[i], row[j], cols) /
                                       fmax(sqrt(vdot(row[i], row[i], cols) * vdot(row[j], row[j], cols)), 1e-6);
                            cs += c < -1 ? -1 : c > 1 ? 1 : c;
                        }
                    cs /= pairs;
                    double tt = m * cs / (1 + (m - 1) * cs);
                    for (int64_t c = 0; c < cols; c++) {
                        double mean = 0;
                        for (int i = 0; i < m; i++)
                            mean += row[i][c] / m;
                        out[c] = tt * mean;
                    }
                }
                for (int64_t c = 0; c < cols; c++)
                    out[c] += b->v[r * cols + c];
            }
            check_values(st, b->name, exp, mag, b->n);
            free(exp);
            free(mag);
            free_vecs(x, m);
        }
        // the same bytes on the devices, whole and with units falling back
        same_on_devices(f.root, &o, f.base_dir, d, st, false, method ? "model-stock per row" : "nuslerp per row");
        lm_st_close(st);
    }
    // nuslerp per column (mergekit's nuslerp_row_wise): each column of a matrix its own vector
    {
        inputs sub = in;
        sub.n = 2;
        lm_merge_opts o = interp_opts(LM_MERGE_NUSLERP, &sub, w, 1);
        o.per_col = true;
        o.slab_elems = 20;
        lm_st_file *st = run_merge(f.root, &o, f.base_dir, d, NULL);
        for (int t = 0; st && t < NT; t++) {
            const tensor *b = &f.base.t[t];
            int64_t rows = b->ndim == 2 ? b->shape[0] : 1, cols = b->n / rows;
            double *x[2];
            vectors(&f, &sub, t, false, x);
            double *exp = malloc((size_t)b->n * sizeof *exp), *mag = scale_of(&f, &sub, t, 1);
            double *v0 = malloc((size_t)rows * sizeof *v0), *v1 = malloc((size_t)rows * sizeof *v1),
                   *o1 = malloc((size_t)rows * sizeof *o1);
            for (int64_t c = 0; c < (b->ndim == 2 ? cols : 1); c++) {
                int64_t len = b->ndim == 2 ? rows : b->n, step = b->ndim == 2 ? cols : 1;
                double *c0 = realloc(v0, (size_t)len * sizeof *c0), *c1 = realloc(v1, (size_t)len * sizeof *c1),
                       *co = realloc(o1, (size_t)len * sizeof *co);
                v0 = c0, v1 = c1, o1 = co;
                for (int64_t r = 0; r < len; r++) {
                    v0[r] = x[0][c + r * step];
                    v1[r] = x[1][c + r * step];
                }
                nuslerp_ref(0.75, v0, v1, len, o1);
                for (int64_t r = 0; r < len; r++)
                    exp[c + r * step] = o1[r] + b->v[c + r * step];
            }
            check_values(st, b->name, exp, mag, b->n);
            free(v0);
            free(v1);
            free(o1);
            free(exp);
            free(mag);
            free_vecs(x, 2);
        }
        same_on_devices(f.root, &o, f.base_dir, d, st, false, "nuslerp per column");
        lm_st_close(st);
    }
    // a method that takes each tensor whole refuses it
    lm_merge_opts o = interp_opts(LM_MERGE_SLERP, &in, w, 1);
    o.n_ft = 1;
    o.per_row = true;
    lm_err err = {0};
    CHECK_FAILS(lm_merge_check_opts(&o, &err), LM_ERR_USAGE, "--per-row", &err);
    free_inputs(&in);
    fx_close(&f);
}

// ==== a tensor no FT changes =================================================================

// Every coefficient method on adapters of layers.0 only: the tensors they leave alone are the
// base's in each model, and each method's reference on those equal vectors says what they become.
// The base, but for multislerp of the models without normalising: (Σ w_j)·θ_b (mergekit scales
// its result by Σ w_j ‖x_j‖). Also the same bytes on the devices.
static void test_untouched(void)
{
    fixture f;
    fx_open(&f, interp_base, "float32");
    inputs in = {0};
    rng_seed(80);
    add_lora_ft(&in, &f);
    add_lora_ft(&in, &f);
    const char *d[MAX_FT];
    dirs_of(&in, d);
    double w[2] = {0.25, 0.5};
    const struct {
        lm_merge_method m;
        int n;  // adapters
        bool models, normalize;
    } runs[] = {
        {LM_MERGE_SLERP, 1, true, false},       {LM_MERGE_NUSLERP, 2, false, false},
        {LM_MERGE_NUSLERP, 1, true, false},     {LM_MERGE_MULTISLERP, 2, false, false},
        {LM_MERGE_MULTISLERP, 2, true, true},   {LM_MERGE_MULTISLERP, 2, true, false},
        {LM_MERGE_MULTISLERP, 1, true, false},  {LM_MERGE_KARCHER, 2, true, false},
        {LM_MERGE_MODEL_STOCK, 2, false, false},
    };
    for (size_t r = 0; r < sizeof runs / sizeof runs[0]; r++) {
        inputs sub = in;
        sub.n = runs[r].n;
        lm_merge_opts o = interp_opts(runs[r].m, &sub, w, 0.5);
        o.models_only = runs[r].models && runs[r].m != LM_MERGE_SLERP && runs[r].m != LM_MERGE_KARCHER;
        o.normalize = runs[r].normalize;
        lm_st_file *st = run_merge(f.root, &o, f.base_dir, d, NULL);
        for (int t = 1; st && t < NT; t++) {
            double *x[MAX_FT + 1], wv[MAX_FT + 1] = {0.5, 0.25, 0.5};
            int64_t n = f.base.t[t].n;
            int m = vectors(&f, &sub, t, runs[r].models, x);
            double *exp = malloc((size_t)n * sizeof *exp), *mag = scale_of(&f, &sub, t, 1);
            if (runs[r].m == LM_MERGE_SLERP)
                slerp_ref(o.t, x[0], x[1], n, exp);
            else if (runs[r].m == LM_MERGE_NUSLERP)
                nuslerp_ref(runs[r].models ? 1.0 / 3 : 2.0 / 3, x[0], x[1], n, exp);
            else if (runs[r].m == LM_MERGE_MULTISLERP && runs[r].models)
                multislerp_ref(x, wv, m, runs[r].normalize, n, exp);
            else if (runs[r].m == LM_MERGE_KARCHER)
                karcher_ref(x, m, 10, 1e-5, n, exp);
            else  // zero task vectors: mergekit's multislerp falls back to their weighted sum (two of
                  // them), model_stock's ratio is 0
                memset(exp, 0, (size_t)n * sizeof *exp);
            for (int64_t j = 0; !runs[r].models && j < n; j++)
                exp[j] += f.base.t[t].v[j];
            check_values(st, f.base.t[t].name, exp, mag, n);
            free(exp);
            free(mag);
            free_vecs(x, m);
        }
        if (runs[r].m == LM_MERGE_MULTISLERP && runs[r].models && !runs[r].normalize && runs[r].n == 2)
            same_on_devices(f.root, &o, f.base_dir, d, st, false, "multislerp of untouched tensors");
        lm_st_close(st);
    }
    free_inputs(&in);
    fx_close(&f);
}

// The per-tensor parameters of a tensor no FT changes are not read where the merge copies it: a
// callback that refuses every tensor but the adapter's (layers.0.q_proj) is asked about no other
// by task-arithmetic, neither before the work (lm_merge_check_params with the FTs) nor during
// it, but is by linear, which may scale such a tensor; without the FTs every tensor is checked.
static lm_status only_touched(void *ctx, const char *tensor, lm_tensor_params *tp, lm_err *err)
{
    (void)tp;
    return strcmp(tensor, (const char *)ctx) == 0 ? LM_OK : lm_err_set(err, LM_ERR_USAGE, "asked about '%s'", tensor);
}

static void test_untouched_params(void)
{
    fixture f;
    fx_open(&f, interp_base, "float32");
    inputs in = {0};
    rng_seed(81);
    add_lora_ft(&in, &f);
    const char *d[MAX_FT];
    dirs_of(&in, d);
    double w = 1;
    lm_err err = {0};
    lm_model *base = NULL;
    lm_ft *ft = NULL;
    CHECK_OK(lm_model_open(&base, f.base_dir, &err), &err);
    if (base)
        CHECK_OK(lm_ft_open(&ft, d[0], base, &err), &err);
    lm_merge_opts o = interp_opts(LM_MERGE_TASK_ARITHMETIC, &in, &w, 1);
    o.tensor_params = only_touched;
    o.params_ctx = (void *)"layers.0.q_proj.weight";
    if (base && ft) {
        CHECK_OK(lm_merge_check_params(&o, base, &ft, &err), &err);
        CHECK_FAILS(lm_merge_check_params(&o, base, NULL, &err), LM_ERR_USAGE, "asked about 'layers.1.mlp.weight'",
                    &err);
        lm_merge_opts lin = interp_opts(LM_MERGE_LINEAR, &in, &w, 1);
        lin.tensor_params = only_touched;
        lin.params_ctx = o.params_ctx;
        CHECK_FAILS(lm_merge_check_params(&lin, base, &ft, &err), LM_ERR_USAGE, "asked about 'layers.1.mlp.weight'",
                    &err);
    }
    lm_st_file *st = run_merge(f.root, &o, f.base_dir, d, NULL);  // the merge itself asks about no other
    CHECK(st != NULL);
    for (int t = 1; st && t < NT; t++) {  // the base's, copied
        int64_t n = f.base.t[t].n;
        double *exp = malloc((size_t)n * sizeof *exp), *mag = scale_of(&f, &in, t, 1);
        for (int64_t j = 0; exp && j < n; j++)
            exp[j] = f.base.t[t].v[j];
        check_values(st, f.base.t[t].name, exp, mag, n);
        free(exp);
        free(mag);
    }
    lm_st_close(st);
    lm_ft_free(ft);
    lm_model_free(base);
    free_inputs(&in);
    fx_close(&f);
}

// ==== the same bytes on the simulated device ==================================================

// Every method on the CPU and on the simulated device, whole and under budgets where units fall
// back: the same bytes (the Gram matrix is summed by rows in order wherever it is computed).
static void test_devices(void)
{
    fixture f;
    fx_open(&f, interp_base, "float32");
    inputs in = {0};
    rng_seed(80);
    add_full(&in, &f, 1.0);
    add_lora_ft(&in, &f);
    add_full(&in, &f, 0.5);
    const char *d[MAX_FT];
    dirs_of(&in, d);
    double w[3] = {1, 0.5, 2};
    const struct {
        lm_merge_method m;
        int n;
        bool models_only;
    } runs[] = {
        {LM_MERGE_LINEAR, 3, false},     {LM_MERGE_SLERP, 1, false},      {LM_MERGE_NUSLERP, 2, false},
        {LM_MERGE_NUSLERP, 1, true},     {LM_MERGE_MULTISLERP, 3, false}, {LM_MERGE_KARCHER, 3, false},
        {LM_MERGE_MODEL_STOCK, 3, false}, {LM_MERGE_NEARSWAP, 1, false},
    };
    for (size_t r = 0; r < sizeof runs / sizeof runs[0]; r++) {
        for (int slab = 0; slab < 2; slab++) {
            inputs sub = in;
            sub.n = runs[r].n;
            lm_merge_opts o = interp_opts(runs[r].m, &sub, w, 0.5);
            o.models_only = runs[r].models_only;
            o.t = 0.3;
            o.slab_elems = slab ? 14 : 0;  // whole tensors, or several slabs per tensor
            g_device = NULL;
            lm_st_file *cpu = run_merge(f.root, &o, f.base_dir, d, NULL);
            char what[64];
            snprintf(what, sizeof what, "%s (slab %d)", lm_merge_method_name(runs[r].m), slab);
            // whole tensors do not all fit in 600 bytes
            same_on_devices(f.root, &o, f.base_dir, d, cpu, !slab, what);
            lm_st_close(cpu);
        }
    }
    free_inputs(&in);
    fx_close(&f);
}

int main(void)
{
    test_slerp();
    test_linear();
    test_nuslerp();
    test_multislerp();
    test_karcher();
    test_model_stock();
    test_nearswap();
    test_per_row();
    test_untouched();
    test_untouched_params();
    test_devices();
    return check_report("test_merge_interp");
}
