// What the merge engine's tests share: values exact in float32 from a seeded generator; sets of
// tensors a test writes as a base model, a fine-tuned model or a LoRA adapter with the library's
// writer; a merge run through the public API (open, check, plan the outputs, write, finish) with
// the checks every merge must pass; and comparisons of its output with expected values. Each
// test writes its own base model, fine-tuned models and adapters into a fresh directory under
// /tmp, merges them into an output directory, reads the output back and removes it all. For
// test programs only (static inline functions and the program's own state; each includes it
// once).
#ifndef LM_TEST_MERGE_FIXTURE_H
#define LM_TEST_MERGE_FIXTURE_H

#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "adapter.h"
#include "check.h"
#include "device.h"
#include "device_registry.h"
#include "dtype.h"
#include "fixture.h"
#include "merge.h"
#include "model.h"
#include "safetensors.h"
#include "st_writer.h"
#include "testfs.h"
#include "util.h"

#define MAX_T 12   // tensors in one test file
#define MAX_FT 4   // FTs in one merge
#define REL 1e-5   // relative tolerance of float32 results against the double reference

// ==== deterministic values ====================================================================
// Values are multiples of powers of two in small ranges, so that they are exact in float32,
// sums such as θ_b + τ are exact, and magnitudes tie exactly where a test wants ties.

static uint64_t rng_s;

static inline void rng_seed(uint64_t s)
{
    rng_s = s * 0x9E3779B97F4A7C15ull + 12345;
}

static inline uint64_t rng_u64(void)
{
    uint64_t z = (rng_s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static inline int64_t rng_int(int64_t lo, int64_t hi)
{
    return lo + (int64_t)(rng_u64() % (uint64_t)(hi - lo + 1));
}

// A multiple of 2^-q in [-lim, lim].
static inline double rng_q(double lim, int q)
{
    int64_t m = (int64_t)ldexp(lim, q);
    return ldexp((double)rng_int(-m, m), -q);
}

// A multiple of 2^-q with magnitude in [lo, hi] and a random sign (never 0 when lo > 0).
static inline double rng_qmag(double lo, double hi, int q)
{
    double v = ldexp((double)rng_int((int64_t)ldexp(lo, q), (int64_t)ldexp(hi, q)), -q);
    return (rng_u64() & 1) ? -v : v;
}

static inline void fill_q(float *v, int64_t n, double lim, int q)
{
    for (int64_t j = 0; j < n; j++)
        v[j] = (float)rng_q(lim, q);
}

// ==== tensor sets: what a test writes into a safetensors file =================================

// One tensor of a set, its values held as float whatever its dtype on disk.
typedef struct tensor {
    char name[128];
    lm_dtype dt;      // F32 or BF16 on disk
    int ndim;
    int64_t shape[2];
    int64_t n;
    float *v;         // (n) values, exact in dt
} tensor;

// A set of tensors, in the order they are written; zero-initialise, free with ts_free.
typedef struct tset {
    tensor t[MAX_T];
    int n;
} tset;

// Appends a tensor of dtype dt, [d0, d1] (ndim 2) or [d0], and returns its zeroed values for
// the test to fill; the set owns them. More than MAX_T tensors ends the program.
static inline float *ts_add(tset *s, const char *name, lm_dtype dt, int ndim, int64_t d0, int64_t d1)
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

// An F32 tensor [d0, d1] or [d0] added to s: ts_add's values.
static inline float *ts_add2(tset *s, const char *name, int64_t d0, int64_t d1)
{
    return ts_add(s, name, LM_DTYPE_F32, 2, d0, d1);
}

static inline float *ts_add1(tset *s, const char *name, int64_t d0)
{
    return ts_add(s, name, LM_DTYPE_F32, 1, d0, 0);
}

// The tensor called name, which the set must hold (a test's mistake ends the program).
static inline const tensor *ts_find(const tset *s, const char *name)
{
    for (int i = 0; i < s->n; i++)
        if (strcmp(s->t[i].name, name) == 0)
            return &s->t[i];
    fprintf(stderr, "test_merge: no tensor %s in a test set\n", name);
    exit(1);
}

// The values of tensor name, owned by the set.
static inline const float *ts_get(const tset *s, const char *name)
{
    return ts_find(s, name)->v;
}

// Frees the values of every tensor and empties the set.
static inline void ts_free(tset *s)
{
    for (int i = 0; i < s->n; i++)
        free(s->t[i].v);
    s->n = 0;
}

// A copy of s with values of its own; free it with ts_free.
static inline tset ts_copy(const tset *s)
{
    tset c = *s;
    for (int i = 0; i < s->n; i++) {
        c.t[i].v = malloc((size_t)s->t[i].n * sizeof(float));
        memcpy(c.t[i].v, s->t[i].v, (size_t)s->t[i].n * sizeof(float));
    }
    return c;
}

// Writes the set as one safetensors file dir/file with the library's writer.
static inline void ts_write(const tset *s, const char *dir, const char *file)
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
static inline void write_model(const char *dir, const tset *s, const char *torch_dtype)
{
    char cfg[256];
    snprintf(cfg, sizeof cfg,
             "{\"architectures\": [\"TestForCausalLM\"], \"model_type\": \"test\", "
             "\"torch_dtype\": \"%s\"}", torch_dtype);
    write_text(dir, "config.json", cfg);
    ts_write(s, dir, "model.safetensors");
}

// A PEFT adapter directory: adapter_config.json holding config, and adapter_model.safetensors.
static inline void write_adapter(const char *dir, const char *config, const tset *s)
{
    write_text(dir, "adapter_config.json", config);
    ts_write(s, dir, "adapter_model.safetensors");
}

// A full fine-tuned model: base + tau[t] for tensor t of the base (tau[t] NULL: unchanged). The
// test's τ must be exactly what the engine computes, float32(θ_i) − float32(θ_b), so the sum
// must be exact in float32: checked.
static inline void write_ft(const char *dir, const tset *base, double *const *tau)
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
static inline void alloc_taus(const tset *base, double **tau)
{
    for (int t = 0; t < MAX_T; t++)
        tau[t] = t < base->n ? calloc((size_t)base->t[t].n, sizeof(double)) : NULL;
}

// Frees alloc_taus's arrays and sets them to NULL.
static inline void free_taus(double **tau)
{
    for (int t = 0; t < MAX_T; t++) {
        free(tau[t]);
        tau[t] = NULL;
    }
}

// The position of tensor name in the set.
static inline int ts_index(const tset *s, const char *name)
{
    return (int)(ts_find(s, name) - s->t);
}

// ==== running a merge =========================================================================

// Numbers run_merge's output directories, so that a test keeps several outputs open at once.
static int out_counter;

typedef struct progress_seen {
    int64_t calls;
    int64_t bad;  // calls whose counts did not follow
} progress_seen;

static inline void on_progress(void *ctx, int64_t done, int64_t total, const char *name, uint64_t bytes_done,
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
static inline lm_st_file *run_merge(const char *root, const lm_merge_opts *o, const char *base_dir,
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
static inline float *out_values(const lm_st_file *st, const char *name, int64_t n)
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
static inline void check_values(const lm_st_file *st, const char *name, const double *exp, const double *mag,
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
static inline void check_exact(const lm_st_file *st, const char *name, const double *exp, int64_t n)
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
static inline void check_same(const lm_st_file *st, const tset *base, const char *name)
{
    const tensor *b = ts_find(base, name);
    double *e = malloc((size_t)b->n * sizeof *e);
    for (int64_t j = 0; j < b->n; j++)
        e[j] = b->v[j];
    check_exact(st, name, e, b->n);
    free(e);
}

// Checks output tensor `name` is θ_b + f·τ (tau_mag: magnitude of the terms of τ, or NULL).
static inline void check_sum(const lm_st_file *st, const tset *base, const char *name, const double *tau,
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
static inline bool same_output(const lm_st_file *a, const lm_st_file *b)
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

// ==== a test's directory and base model =======================================================

// A test's scratch directory and the base model written into it.
typedef struct fixture {
    char *root;      // the test's directory under /tmp
    char *base_dir;  // root/base
    tset base;       // what base_dir holds
} fixture;

// Makes a fresh directory under /tmp and writes into root/base the base model that make builds,
// with torch_dtype in its config.json. Free it all with fx_close.
static inline void fx_open(fixture *f, void (*make)(tset *), const char *torch_dtype)
{
    memset(f, 0, sizeof *f);
    f->root = make_tmpdir();
    f->base_dir = subdir(f->root, "base");
    make(&f->base);
    write_model(f->base_dir, &f->base, torch_dtype);
}

// Frees the base's values and removes the test's directory and everything in it.
static inline void fx_close(fixture *f)
{
    ts_free(&f->base);
    free(f->base_dir);
    remove_tmpdir(f->root);
}

// Adds random factors of linear module `path`: A [r, in], B [out, r].
static inline void add_lora(tset *a, const char *path, int64_t r, int64_t in, int64_t out)
{
    char k[128];
    snprintf(k, sizeof k, "base_model.model.%s.lora_A.weight", path);
    fill_q(ts_add2(a, k, r, in), r * in, 1.0, 8);
    snprintf(k, sizeof k, "base_model.model.%s.lora_B.weight", path);
    fill_q(ts_add2(a, k, out, r), out * r, 1.0, 8);
}

#endif
