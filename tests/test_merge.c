// Tests of the merge engine (lib/merge.c) against docs/merging.md, computed here independently in
// double with naive loops: every task-vector rule of LoRA adapters (alpha / r, rslora,
// rank_pattern / alpha_pattern first match in file order, fan_in_fan_out, lora_bias, DoRA,
// embedding LoRA, modules_to_save) and of full models; a tensor an FT does not touch taking no
// part in the divisor; TIES magnitude trimming with exactly k kept and ties at the threshold to
// the lower flat index, k = 0, sign election by sum and by count, normalize, lambda, weights,
// densities, --topk global; DARE masks as properties (each value dropped or rescaled, the kept
// fraction within a binomial bound, bit-identical for any thread count, slab size and tensor
// order, a different mask per seed and per model, L1 rescaling); DARE-TIES election on the DARE
// masks; BF16 output rounded to nearest even; option and input checks. Each test writes its
// own base model, fine-tuned models and adapters into a fresh directory under /tmp, merges them
// through the public API into an output directory, reads the output back and removes it all.
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "adapter.h"
#include "check.h"
#include "testfs.h"
#include "device.h"
#include "dtype.h"
#include "merge.h"
#include "model.h"
#include "safetensors.h"
#include "st_writer.h"
#include "util.h"

#define MAX_T 12   // tensors in one test file
#define MAX_FT 4   // FTs in one merge
#define REL 1e-5   // relative tolerance of float32 results against the double reference

// ==== files and directories ===================================================================

// ==== deterministic values ====================================================================
// Values are multiples of powers of two in small ranges, so that they are exact in float32,
// sums such as θ_b + τ are exact, and magnitudes tie exactly where a test wants ties.

static uint64_t rng_s;

static void rng_seed(uint64_t s)
{
    rng_s = s * 0x9E3779B97F4A7C15ull + 12345;
}

static uint64_t rng_u64(void)
{
    uint64_t z = (rng_s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static int64_t rng_int(int64_t lo, int64_t hi)
{
    return lo + (int64_t)(rng_u64() % (uint64_t)(hi - lo + 1));
}

// A multiple of 2^-q in [-lim, lim].
static double rng_q(double lim, int q)
{
    int64_t m = (int64_t)ldexp(lim, q);
    return ldexp((double)rng_int(-m, m), -q);
}

// A multiple of 2^-q with magnitude in [lo, hi] and a random sign (never 0 when lo > 0).
static double rng_qmag(double lo, double hi, int q)
{
    double v = ldexp((double)rng_int((int64_t)ldexp(lo, q), (int64_t)ldexp(hi, q)), -q);
    return (rng_u64() & 1) ? -v : v;
}

static void fill_q(float *v, int64_t n, double lim, int q)
{
    for (int64_t j = 0; j < n; j++)
        v[j] = (float)rng_q(lim, q);
}

// ==== tensor sets: what a test writes into a safetensors file =================================

typedef struct tensor {
    char name[128];
    lm_dtype dt;      // F32 or BF16 on disk
    int ndim;
    int64_t shape[2];
    int64_t n;
    float *v;         // (n) values, exact in dt
} tensor;

typedef struct tset {
    tensor t[MAX_T];
    int n;
} tset;

static float *ts_add(tset *s, const char *name, lm_dtype dt, int ndim, int64_t d0, int64_t d1)
{
    if (s->n >= MAX_T) {
        fprintf(stderr, "test_merge: too many tensors\n");
        exit(1);
    }
    tensor *t = &s->t[s->n++];
    memset(t, 0, sizeof *t);
    snprintf(t->name, sizeof t->name, "%s", name);
    t->dt = dt;
    t->ndim = ndim;
    t->shape[0] = d0;
    t->shape[1] = ndim == 2 ? d1 : 0;
    t->n = ndim == 2 ? d0 * d1 : d0;
    t->v = calloc((size_t)t->n, sizeof(float));
    return t->v;
}

static float *ts_add2(tset *s, const char *name, int64_t d0, int64_t d1)
{
    return ts_add(s, name, LM_DTYPE_F32, 2, d0, d1);
}

static float *ts_add1(tset *s, const char *name, int64_t d0)
{
    return ts_add(s, name, LM_DTYPE_F32, 1, d0, 0);
}

static const tensor *ts_find(const tset *s, const char *name)
{
    for (int i = 0; i < s->n; i++)
        if (strcmp(s->t[i].name, name) == 0)
            return &s->t[i];
    fprintf(stderr, "test_merge: no tensor %s in a test set\n", name);
    exit(1);
}

static const float *ts_get(const tset *s, const char *name)
{
    return ts_find(s, name)->v;
}

static void ts_free(tset *s)
{
    for (int i = 0; i < s->n; i++)
        free(s->t[i].v);
    s->n = 0;
}

static tset ts_copy(const tset *s)
{
    tset c = *s;
    for (int i = 0; i < s->n; i++) {
        c.t[i].v = malloc((size_t)s->t[i].n * sizeof(float));
        memcpy(c.t[i].v, s->t[i].v, (size_t)s->t[i].n * sizeof(float));
    }
    return c;
}

// Writes the set as one safetensors file dir/file with the library's writer.
static void ts_write(const tset *s, const char *dir, const char *file)
{
    lm_st_desc desc[MAX_T];
    const void *data[MAX_T];
    uint16_t *half[MAX_T] = {0};
    for (int i = 0; i < s->n; i++) {
        const tensor *t = &s->t[i];
        memset(&desc[i], 0, sizeof desc[i]);
        desc[i].name = t->name;
        desc[i].dtype = t->dt;
        desc[i].ndim = t->ndim;
        desc[i].shape[0] = t->shape[0];
        desc[i].shape[1] = t->shape[1];
        if (t->dt == LM_DTYPE_BF16) {
            half[i] = malloc((size_t)t->n * 2);
            int64_t inexact = 0;
            for (int64_t j = 0; j < t->n; j++) {
                uint32_t u;
                memcpy(&u, &t->v[j], 4);
                inexact += (u & 0xFFFFu) != 0;
                half[i][j] = (uint16_t)(u >> 16);
            }
            CHECK_MSG(inexact == 0, "%s: %lld values not exact in bf16", t->name, (long long)inexact);
            data[i] = half[i];
        } else {
            data[i] = t->v;
        }
    }
    char *p = lm_path_join(dir, file);
    lm_err err;
    CHECK_OK(lm_st_write_file(p, desc, data, s->n, NULL, &err), &err);
    free(p);
    for (int i = 0; i < s->n; i++)
        free(half[i]);
}

// A model directory: a config.json of an architecture llmerge does not describe (merging needs
// none) and model.safetensors.
static void write_model(const char *dir, const tset *s, const char *torch_dtype)
{
    char cfg[256];
    snprintf(cfg, sizeof cfg,
             "{\"architectures\": [\"TestForCausalLM\"], \"model_type\": \"test\", "
             "\"torch_dtype\": \"%s\"}", torch_dtype);
    write_text(dir, "config.json", cfg);
    ts_write(s, dir, "model.safetensors");
}

static void write_adapter(const char *dir, const char *config, const tset *s)
{
    write_text(dir, "adapter_config.json", config);
    ts_write(s, dir, "adapter_model.safetensors");
}

// A full fine-tuned model: base + tau[t] for tensor t of the base (tau[t] NULL: unchanged). The
// test's τ must be exactly what the engine computes, float32(θ_i) − float32(θ_b), so the sum
// must be exact in float32: checked.
static void write_ft(const char *dir, const tset *base, double *const *tau)
{
    tset f = ts_copy(base);
    int64_t inexact = 0;
    for (int t = 0; t < f.n; t++) {
        if (!tau[t])
            continue;
        for (int64_t j = 0; j < f.t[t].n; j++) {
            float v = (float)((double)base->t[t].v[j] + tau[t][j]);
            inexact += (double)v - (double)base->t[t].v[j] != tau[t][j];
            f.t[t].v[j] = v;
        }
    }
    CHECK_MSG(inexact == 0, "%s: %lld fine-tuned values are not exact", dir, (long long)inexact);
    write_model(dir, &f, "float32");
    ts_free(&f);
}

// tau arrays for every tensor of `base`, allocated (zeroed); free with free_taus.
static void alloc_taus(const tset *base, double **tau)
{
    for (int t = 0; t < MAX_T; t++)
        tau[t] = t < base->n ? calloc((size_t)base->t[t].n, sizeof(double)) : NULL;
}

static void free_taus(double **tau)
{
    for (int t = 0; t < MAX_T; t++) {
        free(tau[t]);
        tau[t] = NULL;
    }
}

static int ts_index(const tset *s, const char *name)
{
    return (int)(ts_find(s, name) - s->t);
}

// ==== running a merge =========================================================================

static int out_counter;

static lm_merge_opts opts_for(lm_merge_method m, int n_ft, const double *w, const double *d)
{
    lm_merge_opts o;
    memset(&o, 0, sizeof o);
    o.method = m;
    o.n_ft = n_ft;
    o.weights = w;
    o.densities = d;
    o.lambda = 1.0;
    o.normalize = lm_merge_default_normalize(m);
    o.sign = LM_SIGN_SUM;
    o.topk_global = false;
    o.rescale = LM_RESCALE_INV;
    o.seed = 0;
    o.out_dtype = LM_DTYPE_F32;
    o.threads = 1;
    o.slab_elems = 0;
    return o;
}

typedef struct progress_seen {
    int64_t calls;
    int64_t bad;  // calls whose counts did not follow
} progress_seen;

static void on_progress(void *ctx, int64_t done, int64_t total, const char *name, uint64_t bytes_done,
                        uint64_t bytes_total)
{
    progress_seen *p = ctx;
    p->calls++;
    if (done != p->calls || done > total || !name || bytes_done > bytes_total)
        p->bad++;
}

#define TRY(call)                                                                             \
    do {                                                                                      \
        lm_status try_s_ = (call);                                                            \
        CHECK_MSG(try_s_ == LM_OK, "%s -> %s: %s", #call, lm_status_name(try_s_), err.msg);   \
        if (try_s_ != LM_OK)                                                                  \
            goto done;                                                                        \
    } while (0)

// The device run_merge uses: the CPU unless a test names another (lm_dev_open's syntax).
static const char *g_device;

// Merges `ft_dirs` into the base at base_dir with options o through the public API (open, check,
// plan the outputs, write, finish) into a new directory under root, checks what every merge must
// satisfy (outputs in the base's order and dtype, one progress call per tensor, the reported
// hashes and byte count), and returns the output file opened for reading, or NULL after a
// failed check. *res_out (may be NULL) gets the result; the caller frees it.
static lm_st_file *run_merge(const char *root, const lm_merge_opts *o, const char *base_dir,
                             const char *const *ft_dirs, lm_merge_result *res_out)
{
    lm_err err = {0};
    lm_model *base = NULL;
    lm_ft *fts[MAX_FT] = {0};
    lm_st_desc *desc = NULL;
    int64_t n = 0;
    lm_st_writer *w = NULL;
    lm_dev *dev = NULL;
    lm_st_file *st = NULL;
    lm_merge_result res;
    memset(&res, 0, sizeof res);
    bool have_res = false;
    progress_seen prog = {0};
    char name[32];
    snprintf(name, sizeof name, "out-%d", out_counter++);
    char *out = lm_path_join(root, name);
    char *file = lm_path_join(out, "model.safetensors");

    TRY(lm_mkdir_p(out, &err));
    TRY(lm_model_open(&base, base_dir, &err));
    for (int i = 0; i < o->n_ft; i++)
        TRY(lm_ft_open(&fts[i], ft_dirs[i], base, &err));
    TRY(lm_merge_check_opts(o, &err));
    TRY(lm_merge_outputs(o, base, &desc, &n, &err));
    CHECK(n == base->n_tensors);
    for (int64_t i = 0; i < n && i < base->n_tensors; i++) {
        const lm_st_tensor *bt = base->tensors[i];
        lm_dtype want = lm_dtype_readable(bt->dtype) ? o->out_dtype : bt->dtype;
        bool same = strcmp(desc[i].name, bt->name) == 0 && desc[i].dtype == want &&
                    desc[i].ndim == bt->ndim &&
                    memcmp(desc[i].shape, bt->shape, sizeof(int64_t) * (size_t)bt->ndim) == 0;
        CHECK_MSG(same, "output %lld is %s, base tensor %s", (long long)i, desc[i].name, bt->name);
    }
    TRY(lm_st_writer_open(&w, out, desc, n, 5000000000ull, NULL, &err));
    if (g_device) {
        lm_dev_opts dopts = {.threads = o->threads};
        TRY(lm_dev_open(&dev, g_device, &dopts, NULL, 0, &err));
    } else {
        TRY(lm_dev_cpu_create(&dev, o->threads, &err));
    }
    lm_merge_hooks hooks = {.progress = on_progress, .ctx = &prog};
    TRY(lm_merge_run(o, dev, base, fts, w, &hooks, &res, &err));
    have_res = true;
    CHECK_MSG(prog.calls == n && prog.bad == 0, "%lld progress calls for %lld tensors, %lld bad",
              (long long)prog.calls, (long long)n, (long long)prog.bad);
    CHECK(res.n_tensors == n && res.n_merged + res.n_copied == n);
    TRY(lm_st_writer_finish(w, &err));
    lm_st_writer_free(w);
    w = NULL;
    TRY(lm_st_open(&st, file, &err));
    uint64_t total = 0;
    int64_t bad_hash = 0;
    for (int64_t i = 0; i < n; i++) {
        const lm_st_tensor *t = lm_st_find(st, desc[i].name);
        CHECK_MSG(t != NULL, "output has no tensor %s", desc[i].name);
        if (!t)
            continue;
        total += t->nbytes;
        bad_hash += res.tensor_xxh64 && lm_xxh64(t->data, t->nbytes) != res.tensor_xxh64[i];
    }
    CHECK_MSG(bad_hash == 0 && res.tensor_xxh64, "%lld tensor hashes differ from the data",
              (long long)bad_hash);
    CHECK(res.bytes_out == total);
done:
    if (have_res) {
        if (res_out)
            *res_out = res;
        else
            lm_merge_result_free(&res);
    }
    lm_st_writer_free(w);
    lm_dev_destroy(dev);
    free(desc);
    for (int i = 0; i < MAX_FT; i++)
        lm_ft_free(fts[i]);
    lm_model_free(base);
    free(out);
    free(file);
    return st;
}

// ==== reading and comparing the output ========================================================

// Output tensor `name` as float (n values), or NULL after a failed check. Caller frees.
static float *out_values(const lm_st_file *st, const char *name, int64_t n)
{
    const lm_st_tensor *t = st ? lm_st_find(st, name) : NULL;
    CHECK_MSG(t && t->numel == n, "output tensor %s missing or not of %lld elements", name, (long long)n);
    if (!t || t->numel != n)
        return NULL;
    float *v = malloc((size_t)n * sizeof *v);
    lm_err err;
    CHECK_OK(lm_st_read_f32(t, v, &err), &err);
    return v;
}

// Checks output tensor `name` against exp within REL·(|exp| + mag[j]) (mag: the magnitude of the
// terms that were summed, which bounds float32 rounding; may be NULL). NaN must stay NaN.
static void check_values(const lm_st_file *st, const char *name, const double *exp, const double *mag,
                         int64_t n)
{
    float *got = out_values(st, name, n);
    if (!got)
        return;
    int64_t bad = 0, first = -1;
    for (int64_t j = 0; j < n; j++) {
        bool ok;
        if (isnan(exp[j]))
            ok = isnan(got[j]);
        else
            ok = fabs((double)got[j] - exp[j]) <= REL * (fabs(exp[j]) + (mag ? mag[j] : 0)) + 1e-30;
        if (!ok && bad++ == 0)
            first = j;
    }
    CHECK_MSG(bad == 0, "%s: %lld of %lld values differ; first [%lld]: got %.9g, expected %.9g", name,
              (long long)bad, (long long)n, (long long)first, first >= 0 ? (double)got[first] : 0.0,
              first >= 0 ? exp[first] : 0.0);
    free(got);
}

// Checks output tensor `name` is bit for bit float32(exp[j]) (each exp exact in float32; NaN
// must stay NaN).
static void check_exact(const lm_st_file *st, const char *name, const double *exp, int64_t n)
{
    float *got = out_values(st, name, n);
    if (!got)
        return;
    int64_t bad = 0, first = -1;
    for (int64_t j = 0; j < n; j++) {
        float e = (float)exp[j];
        bool ok = isnan(exp[j]) ? isnan(got[j]) : memcmp(&e, &got[j], 4) == 0;
        if (!ok && bad++ == 0)
            first = j;
    }
    CHECK_MSG(bad == 0, "%s: %lld of %lld values differ; first [%lld]: got %.9g, expected %.9g", name,
              (long long)bad, (long long)n, (long long)first, first >= 0 ? (double)got[first] : 0.0,
              first >= 0 ? exp[first] : 0.0);
    free(got);
}

// Checks output tensor `name` holds exactly the base's values (a tensor no FT changed).
static void check_same(const lm_st_file *st, const tset *base, const char *name)
{
    const tensor *b = ts_find(base, name);
    double *e = malloc((size_t)b->n * sizeof *e);
    for (int64_t j = 0; j < b->n; j++)
        e[j] = b->v[j];
    check_exact(st, name, e, b->n);
    free(e);
}

// Checks output tensor `name` is θ_b + f·τ (tau_mag: magnitude of the terms of τ, or NULL).
static void check_sum(const lm_st_file *st, const tset *base, const char *name, const double *tau,
                      const double *tau_mag, double f)
{
    const tensor *b = ts_find(base, name);
    double *e = malloc((size_t)b->n * sizeof *e), *m = malloc((size_t)b->n * sizeof *m);
    for (int64_t j = 0; j < b->n; j++) {
        e[j] = (double)b->v[j] + f * tau[j];
        m[j] = fabs((double)b->v[j]) + fabs(f) * (tau_mag ? tau_mag[j] : fabs(tau[j]));
    }
    check_values(st, name, e, m, b->n);
    free(e);
    free(m);
}

// Whether two outputs hold the same tensors with the same bytes.
static bool same_output(const lm_st_file *a, const lm_st_file *b)
{
    if (!a || !b || a->n_tensors != b->n_tensors)
        return false;
    for (int64_t i = 0; i < a->n_tensors; i++) {
        const lm_st_tensor *ta = &a->tensors[i], *tb = lm_st_find(b, ta->name);
        if (!tb || tb->dtype != ta->dtype || tb->nbytes != ta->nbytes ||
            memcmp(ta->data, tb->data, ta->nbytes) != 0)
            return false;
    }
    return true;
}

// ==== the reference: docs/merging.md in double ================================================

// τ = s · B @ A with A [r, in], B [out, r] as [out, in], or its transpose [in, out] (fan_in_fan_out,
// embeddings). mag gets s · Σ|B||A|, the scale of float32 rounding.
static void lora_ref(double *tau, double *mag, const float *A, const float *B, int64_t r, int64_t in,
                     int64_t out, double s, bool transposed)
{
    for (int64_t o = 0; o < out; o++) {
        for (int64_t i = 0; i < in; i++) {
            double acc = 0, m = 0;
            for (int64_t k = 0; k < r; k++) {
                acc += (double)B[o * r + k] * (double)A[k * in + i];
                m += fabs((double)B[o * r + k] * (double)A[k * in + i]);
            }
            int64_t j = transposed ? i * out + o : o * in + i;
            tau[j] = s * acc;
            if (mag)
                mag[j] = fabs(s) * m;
        }
    }
}

static const double *g_sort_key;

static int cmp_mag_desc(const void *pa, const void *pb)
{
    int64_t a = *(const int64_t *)pa, b = *(const int64_t *)pb;
    double ma = fabs(g_sort_key[a]), mb = fabs(g_sort_key[b]);
    if (ma != mb)
        return ma > mb ? -1 : 1;
    return a < b ? -1 : a > b;
}

// keep[j]: j is among the k entries of largest |x|, ties going to the lower index.
static void topk_ref(const double *x, int64_t n, int64_t k, bool *keep)
{
    int64_t *idx = malloc((size_t)n * sizeof *idx);
    for (int64_t j = 0; j < n; j++)
        idx[j] = j;
    g_sort_key = x;
    qsort(idx, (size_t)n, sizeof *idx, cmp_mag_desc);
    memset(keep, 0, (size_t)n * sizeof *keep);
    for (int64_t j = 0; j < k && j < n; j++)
        keep[idx[j]] = true;
    free(idx);
}

static int64_t k_of(double d, int64_t n)
{
    return (int64_t)floor(d * (double)n);
}

// out[j] = keep[j] ? τ[j] : 0 after magnitude trimming with density d.
static void trim_ref(const double *tau, int64_t n, double d, double *out)
{
    bool *keep = malloc((size_t)n * sizeof *keep);
    topk_ref(tau, n, k_of(d, n), keep);
    for (int64_t j = 0; j < n; j++)
        out[j] = keep[j] ? tau[j] : 0;
    free(keep);
}

enum { SIGN_NONE, SIGN_SUM, SIGN_COUNT };

typedef struct combo {
    int k;            // models
    const double *w;  // (k) weights
    int sign;         // SIGN_*
    bool normalize;
    double lambda;
} combo;

static double sgn(double x)
{
    return x > 0 ? 1 : x < 0 ? -1 : 0;
}

// One element: tp[i] is model i's τ' (sparsified and rescaled), touched[i] whether model i takes
// part in the tensor at all. Returns θ and sets *mag to the scale of the summed terms.
static double combine_ref(const combo *c, double base, const double *tp, const bool *touched, double *mag)
{
    double W[MAX_FT], sum_w = 0, sum_sign = 0;
    for (int i = 0; i < c->k; i++) {
        W[i] = touched[i] ? c->w[i] * tp[i] : 0;
        sum_w += W[i];
        sum_sign += sgn(W[i]);
    }
    double delta = 0, div = 0, abs_sum = 0;
    if (c->sign == SIGN_NONE) {
        for (int i = 0; i < c->k; i++) {
            if (!touched[i])
                continue;
            delta += W[i];
            div += c->w[i];
            abs_sum += fabs(W[i]);
        }
    } else {
        double s = (c->sign == SIGN_SUM ? sum_w : sum_sign) >= 0 ? 1 : -1;
        for (int i = 0; i < c->k; i++) {
            if (W[i] == 0 || sgn(W[i]) != s)
                continue;  // zeros never agree
            delta += W[i];
            div += c->w[i];
            abs_sum += fabs(W[i]);
        }
    }
    if (c->normalize && div != 0) {
        delta /= div;
        abs_sum /= fabs(div);
    }
    *mag = fabs(base) + fabs(c->lambda) * abs_sum;
    return base + c->lambda * delta;
}

// exp and mag for a tensor of n elements; tp[i] NULL: model i does not touch the tensor.
static void combine_tensor(const combo *c, const float *base, int64_t n, double *const *tp, double *exp,
                           double *mag)
{
    for (int64_t j = 0; j < n; j++) {
        double t[MAX_FT];
        bool touched[MAX_FT];
        for (int i = 0; i < c->k; i++) {
            touched[i] = tp[i] != NULL;
            t[i] = tp[i] ? tp[i][j] : 0;
        }
        exp[j] = combine_ref(c, base[j], t, touched, &mag[j]);
    }
}

// Checks every tensor of the base against the combination of tp[i][t], model i's sparsified and
// rescaled τ' for tensor t (NULL where model i does not touch tensor t).
static void check_combined(const lm_st_file *st, const tset *base, const combo *c, double *(*tp)[MAX_T])
{
    for (int t = 0; t < base->n; t++) {
        const tensor *b = &base->t[t];
        double *e = malloc((size_t)b->n * sizeof *e), *m = malloc((size_t)b->n * sizeof *m);
        double *cols[MAX_FT];
        for (int i = 0; i < c->k; i++)
            cols[i] = tp[i][t];
        combine_tensor(c, b->v, b->n, cols, e, m);
        check_values(st, b->name, e, m, b->n);
        free(e);
        free(m);
    }
}

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

typedef struct fixture {
    char *root;
    char *base_dir;
    tset base;
} fixture;

static void fx_open(fixture *f, void (*make)(tset *), const char *torch_dtype)
{
    memset(f, 0, sizeof *f);
    f->root = make_tmpdir();
    f->base_dir = subdir(f->root, "base");
    make(&f->base);
    write_model(f->base_dir, &f->base, torch_dtype);
}

static void fx_close(fixture *f)
{
    ts_free(&f->base);
    free(f->base_dir);
    remove_tmpdir(f->root);
}

// Adds random factors of linear module `path`: A [r, in], B [out, r].
static void add_lora(tset *a, const char *path, int64_t r, int64_t in, int64_t out)
{
    char k[128];
    snprintf(k, sizeof k, "base_model.model.%s.lora_A.weight", path);
    fill_q(ts_add2(a, k, r, in), r * in, 1.0, 8);
    snprintf(k, sizeof k, "base_model.model.%s.lora_B.weight", path);
    fill_q(ts_add2(a, k, out, r), out * r, 1.0, 8);
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
    lm_merge_opts o = opts_for(LM_MERGE_TASK_ARITHMETIC, n, w, d);
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

    // DARE at density 1 (every entry kept, rescale 1) with normalize: the same divisors.
    const double d[2] = {1.0, 1.0};
    lm_merge_opts o = opts_for(LM_MERGE_DARE, 2, w, d);
    o.normalize = true;
    st = run_merge(f.root, &o, f.base_dir, dirs, NULL);
    if (st)
        check_combined(st, &f.base, &c, tp);
    lm_st_close(st);

    // TIES at density 1, sign by count and by sum, normalize.
    for (int sign = SIGN_SUM; sign <= SIGN_COUNT; sign++) {
        o = opts_for(LM_MERGE_TIES, 2, w, d);
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
        lm_merge_opts o = opts_for(LM_MERGE_TIES, 1, &w, &d);
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
        char nm[8];
        snprintf(nm, sizeof nm, "ft%d", i);
        dirs_own[i] = subdir(f.root, nm);
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
        lm_merge_opts o = opts_for(LM_MERGE_TIES, 3, w, d);
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
    for (int i = 0; i < 3; i++) {
        free_taus(tau[i]);
        free(dirs_own[i]);
    }
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
    for (int i = 0; i < 3; i++) {
        char nm[8];
        snprintf(nm, sizeof nm, "ft%d", i);
        dirs_own[i] = subdir(f.root, nm);
        alloc_taus(&f.base, tau[i]);
        for (int t = 0; t < f.base.n; t++)
            for (int64_t j = 0; j < f.base.t[t].n; j++)
                tau[i][t][j] = rng_int(-16, 16) / 16.0;
        write_ft(dirs_own[i], &f.base, tau[i]);
    }
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
        lm_merge_opts o = opts_for(LM_MERGE_TIES, 3, runs[r].w, runs[r].d);
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
    for (int i = 0; i < 3; i++) {
        free_taus(tau[i]);
        free(dirs_own[i]);
    }
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
        char nm[8];
        snprintf(nm, sizeof nm, "ft%d", i);
        dirs_own[i] = subdir(f.root, nm);
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
        lm_merge_opts o = opts_for(LM_MERGE_TIES, 2, w, d);
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
    for (int i = 0; i < 2; i++) {
        free_taus(tau[i]);
        free(dirs_own[i]);
    }
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
    for (int i = 0; i < 3; i++) {
        char nm[8];
        snprintf(nm, sizeof nm, "ft%d", i);
        dirs_own[i] = subdir(f.root, nm);
        alloc_taus(&f.base, tau[i]);
        for (int t = 0; t < f.base.n; t++)
            for (int64_t j = 0; j < f.base.t[t].n; j++)
                tau[i][t][j] = rng_q(1.0, 10);
        write_ft(dirs_own[i], &f.base, tau[i]);
    }
    const char *dirs[3] = {dirs_own[0], dirs_own[1], dirs_own[2]};
    const double w[3] = {0.2, 1.0, 0.6}, d[3] = {1, 1, 1};
    lm_merge_opts o = opts_for(LM_MERGE_TIES, 3, w, d);
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
    for (int i = 0; i < 3; i++) {
        free_taus(tau[i]);
        free(dirs_own[i]);
    }
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
            lm_merge_opts o = opts_for(LM_MERGE_TIES, 1, &w1, &d1);
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
        lm_merge_opts o = opts_for(LM_MERGE_TIES, 2, w, d);
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
        lm_merge_opts o = opts_for(LM_MERGE_DARE, 1, &w, &d);
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
        lm_merge_opts o = opts_for(LM_MERGE_DARE, 2, w, d);
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
    lm_merge_opts o = opts_for(LM_MERGE_DARE, 2, w, d);
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
    o = opts_for(LM_MERGE_DARE, 2, w11, d55);
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
    o = opts_for(LM_MERGE_DARE, 1, &w1, &dd);
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
        lm_merge_opts o = opts_for(LM_MERGE_DARE, 1, &w, &d);
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

    lm_merge_opts o = opts_for(LM_MERGE_DARE, 2, w, d);
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
        o = opts_for(LM_MERGE_DARE_TIES, 2, w, d);
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
        lm_merge_opts o = opts_for(LM_MERGE_TASK_ARITHMETIC, 1, &w, &dd);
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
    lm_merge_opts o = opts_for(LM_MERGE_TIES, 2, w2, d2);
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
        lm_merge_opts o = opts_for(LM_MERGE_TASK_ARITHMETIC, 1, &w, &d);
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
            lm_merge_opts o = opts_for(cfg[c].m, 3, w, d);
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
    char *fd[2] = {subdir(f.root, "ft0"), subdir(f.root, "ft1")};
    double *tau[2][MAX_T];
    rng_seed(77);
    for (int c = 0; c < 17; c++)
        g_ucc2_w0[c] = c % 5 == 0 ? 1.0 : rng_int(1, 40) / 8.0;
    for (int i = 0; i < 2; i++) {
        alloc_taus(&f.base, tau[i]);
        for (int t = 0; t < f.base.n; t++)
            for (int64_t j = 0; j < f.base.t[t].n; j++)
                tau[i][t][j] = rng_int(-8, 8) / 8.0;  // many ties, in magnitude and importance
        write_ft(fd[i], &f.base, tau[i]);
    }
    const double w[2] = {1.0, 0.6}, d[2] = {0.4, 0.3};
    int calls = 0;
    lm_merge_opts o = opts_for(LM_MERGE_SPARSEGPT, 2, w, d);
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
    lm_merge_opts ot = opts_for(LM_MERGE_TIES, 2, w, d);
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
    for (int i = 0; i < 2; i++) {
        for (int t = 0; t < f.base.n; t++)
            free(tp[i][t]);
        free_taus(tau[i]);
        free(fd[i]);
    }
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
    test_bf16_output();
    test_nonfinite();
    test_sparsegpt();
    return check_report("test_merge");
}
