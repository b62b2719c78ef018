// Tests of the merge's out-of-memory fallbacks on the simulated device (sim:SIZE), on the
// generated fixtures (LLMERGE_FIXTURES). For each setup the merge runs once on the CPU, then on
// the sim device at budgets from ample down to almost nothing. At every budget the output must
// be byte-identical to the CPU's, every fallback must be reported once with its phase, unit and
// the device's message, the counts in the result must agree with the reports, and the device
// must hold nothing once the merge is done. Among the budgets the test then finds, and
// requires, the three situations the design names: (a) one FT's LoRA factors do not fit but
// every tensor does, (b) only the largest tensors do not fit, (c) nothing fits.
//
// With LLMERGE_FALLBACK_DEVICE=cuda-emu the budgets are those of the emulated CUDA device (the
// CUDA backend's own out-of-memory paths), and the device must also be empty after each merge.
// There only the full-model setup runs: its output is the CPU's bit for bit on CUDA, while the
// LoRA products are cuBLAS's, which may round otherwise.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "device_registry.h"
#include "fixture.h"
#include "merge.h"
#include "testfs.h"
#include "util.h"

#define MAX_UNITS 256

static const char *dev_kind = "sim";  // the device whose budgets are swept

typedef struct seen {
    int n;
    int place, select, merge;
    int bad;                      // reports with the wrong devices or an empty reason
    char unit[MAX_UNITS][160];    // "phase unit"
    const char *dev_name;
} seen;

static void on_fallback(void *ctx, const char *line, const lm_fallback *fb)
{
    (void)line;
    seen *s = ctx;
    const char *phase = fb->phase, *unit = fb->unit, *from = fb->from, *to = fb->to, *reason = fb->reason;
    if (strcmp(from, s->dev_name) != 0 || strcmp(to, "cpu") != 0 || !reason || !strstr(reason, "out of memory"))
        s->bad++;
    if (strcmp(phase, "place") == 0)
        s->place++;
    else if (strcmp(phase, "select") == 0)
        s->select++;
    else if (strcmp(phase, "merge") == 0)
        s->merge++;
    else
        s->bad++;
    if (s->n < MAX_UNITS)
        snprintf(s->unit[s->n], sizeof s->unit[0], "%s %s", phase, unit);
    s->n++;
}

typedef struct outcome {
    bool ok;
    unsigned char *data;  // the output file
    size_t size;
    lm_merge_result res;
    seen fb;
} outcome;

static void outcome_free(outcome *o)
{
    free(o->data);
    lm_merge_result_free(&o->res);
    memset(o, 0, sizeof *o);
}

static unsigned char *slurp(const char *path, size_t *size)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *b = n > 0 ? malloc((size_t)n) : NULL;
    if (b && fread(b, 1, (size_t)n, f) != (size_t)n) {
        free(b);
        b = NULL;
    }
    fclose(f);
    *size = b ? (size_t)n : 0;
    return b;
}

// Merges fts into base on `device` into a fresh directory under root.
static outcome merge_on(const char *root, const lm_merge_opts *o, const char *base_dir, const char *const *ft_dirs,
                        const char *device)
{
    static int counter;
    outcome out;
    memset(&out, 0, sizeof out);
    lm_err err = {0};
    lm_model *base = NULL;
    lm_ft *fts[4] = {0};
    lm_st_desc *desc = NULL;
    int64_t n = 0;
    lm_st_writer *w = NULL;
    lm_dev *dev = NULL;
    char name[32];
    snprintf(name, sizeof name, "out-%d", counter++);
    char *dir = subdir(root, name);
    char *file = lm_path_join(dir, "model.safetensors");
    lm_status s = lm_model_open(&base, base_dir, &err);
    for (int i = 0; s == LM_OK && i < o->n_ft; i++)
        s = lm_ft_open(&fts[i], ft_dirs[i], base, &err);
    if (s == LM_OK)
        s = lm_merge_outputs(o, base, &desc, &n, &err);
    if (s == LM_OK)
        s = lm_st_writer_open(&w, dir, desc, n, 5000000000ull, NULL, &err);
    lm_dev_opts dopts = {.threads = 2};
    if (s == LM_OK)
        s = lm_dev_open(&dev, device, &dopts, NULL, 0, &err);
    // what the device holds for its whole life from the start (CUDA: cuBLAS's workspace)
    size_t fr0 = 0, tot0 = 0;
    if (s == LM_OK)
        lm_dev_mem_info(dev, &fr0, &tot0);
    if (s == LM_OK) {
        out.fb.dev_name = lm_dev_name(dev);
        lm_merge_hooks hooks = {.fallback = on_fallback, .ctx = &out.fb};
        s = lm_merge_run(o, dev, base, fts, w, &hooks, &out.res, &err);
    }
    if (s == LM_OK)
        s = lm_st_writer_finish(w, &err);
    CHECK_MSG(s == LM_OK, "merge on %s: %s", device, err.msg);
    if (s == LM_OK) {
        out.data = slurp(file, &out.size);
        out.ok = out.data != NULL;
        // whatever the merge took on the device, it gave back
        size_t fr = 0, tot = 0;
        lm_dev_mem_info(dev, &fr, &tot);
        // (CUDA keeps its scratch for the reductions once it has it: 1 MiB for the fixtures)
        size_t kept = strcmp(device, "cpu") == 0 ? 0 : (tot - fr) - (tot0 - fr0);
        CHECK_MSG(kept == 0 || (strncmp(device, "sim:", 4) != 0 && kept == ((size_t)1 << 20)),
                  "%s: %zu bytes still allocated after the merge", device, kept);
    }
    lm_st_writer_free(w);
    lm_dev_destroy(dev);
    free(desc);
    for (int i = 0; i < 4; i++)
        lm_ft_free(fts[i]);
    lm_model_free(base);
    free(file);
    free(dir);
    return out;
}

// The defaults for method m over the first n_ft of four FTs, with seed 11, BF16 output and two
// threads.
static lm_merge_opts opts(lm_merge_method m, int n_ft)
{
    static const double w[4] = {1.0, 0.7, 1.3, 0.5}, d[4] = {0.3, 0.5, 0.2, 0.6};
    lm_merge_opts o = fixture_merge_opts(m, n_ft, w, d);
    o.seed = 11;
    o.out_dtype = LM_DTYPE_BF16;
    o.threads = 2;
    return o;
}

// What the budgets showed, for the situations the test requires.
typedef struct found {
    bool a;  // one FT's factors fell back, no tensor did
    bool b;  // some tensors fell back, others ran on the device, and the fallbacks were the largest
    bool c;  // every merged tensor and every adapter fell back
} found;

// The numel of tensor `name` of the base.
static int64_t numel_of(const lm_model *m, const char *name)
{
    const lm_st_tensor *t = lm_model_find(m, name);
    return t ? t->numel : -1;
}

// Runs the setup at budgets from 512 KiB (2 MiB on CUDA) down to 512 bytes and checks each
// against the CPU.
static void sweep(const char *root, const char *what, const lm_merge_opts *o, const char *base_dir,
                  const char *const *ft_dirs, int n_adapters, found *f)
{
    outcome cpu = merge_on(root, o, base_dir, ft_dirs, "cpu");
    CHECK_MSG(cpu.ok && cpu.fb.n == 0 && cpu.res.tensors_on_device == 0, "%s: the CPU merge", what);
    if (!cpu.ok) {
        outcome_free(&cpu);
        return;
    }
    lm_err err = {0};
    lm_model *base = NULL;
    CHECK_OK(lm_model_open(&base, base_dir, &err), &err);
    int runs = 0;
    // CUDA keeps 1 MiB of scratch for its reductions: its budgets start above that
    double top = strcmp(dev_kind, "sim") == 0 ? 512 * 1024 : 2 * 1024 * 1024;
    for (double budget = top; budget >= 512; budget *= 0.9, runs++) {
        char dev[48];
        snprintf(dev, sizeof dev, "%s:%llu", dev_kind, (unsigned long long)budget);
        outcome r = merge_on(root, o, base_dir, ft_dirs, dev);
        if (!r.ok) {
            outcome_free(&r);
            continue;
        }
        const lm_merge_result *res = &r.res;
        CHECK_MSG(r.size == cpu.size && memcmp(r.data, cpu.data, cpu.size) == 0,
                  "%s on %s: output differs from the CPU's", what, dev);
        CHECK_MSG(r.fb.bad == 0, "%s on %s: %d fallback reports with wrong devices or reasons", what, dev, r.fb.bad);
        CHECK_MSG(r.fb.place == res->fallback_place && r.fb.select == res->fallback_select &&
                      r.fb.merge == res->fallback_merge,
                  "%s on %s: reported %d/%d/%d fallbacks, counted %lld/%lld/%lld", what, dev, r.fb.place,
                  r.fb.select, r.fb.merge, (long long)res->fallback_place, (long long)res->fallback_select,
                  (long long)res->fallback_merge);
        CHECK_MSG(res->tensors_on_device + res->tensors_on_cpu == res->n_merged &&
                      res->tensors_on_cpu == res->fallback_merge && res->n_merged == cpu.res.n_merged,
                  "%s on %s: %lld on the device + %lld on the cpu for %lld merged, %lld merge fallbacks", what,
                  dev, (long long)res->tensors_on_device, (long long)res->tensors_on_cpu,
                  (long long)res->n_merged, (long long)res->fallback_merge);
        CHECK_MSG(res->ft_on_device + res->fallback_place == n_adapters,
                  "%s on %s: %lld adapters placed, %lld fell back, of %d", what, dev,
                  (long long)res->ft_on_device, (long long)res->fallback_place, n_adapters);

        if (res->fallback_place == 1 && res->fallback_merge == 0 && n_adapters >= 2)
            f->a = true;
        if (res->fallback_merge > 0 && res->tensors_on_device > 0 && res->fallback_place == 0) {
            // every tensor that fell back is at least as large as every one that did not
            int64_t smallest_fallen = INT64_MAX;
            for (int i = 0; i < r.fb.n && i < MAX_UNITS; i++)
                if (strncmp(r.fb.unit[i], "merge ", 6) == 0) {
                    int64_t ne = numel_of(base, r.fb.unit[i] + 6);
                    smallest_fallen = ne < smallest_fallen ? ne : smallest_fallen;
                }
            int64_t largest_kept = 0;
            for (int64_t t = 0; t < base->n_tensors; t++) {
                bool fell = false;
                for (int i = 0; i < r.fb.n && i < MAX_UNITS && !fell; i++)
                    fell = strncmp(r.fb.unit[i], "merge ", 6) == 0 && strcmp(r.fb.unit[i] + 6, base->tensors[t]->name) == 0;
                if (!fell && base->tensors[t]->numel > largest_kept && lm_dtype_readable(base->tensors[t]->dtype))
                    largest_kept = base->tensors[t]->numel;
            }
            if (smallest_fallen >= largest_kept)
                f->b = true;
        }
        if (res->tensors_on_device == 0 && res->fallback_merge == res->n_merged && res->ft_on_device == 0)
            f->c = true;
        outcome_free(&r);
    }
    CHECK_MSG(runs > 50, "%s: only %d budgets ran", what, runs);
    lm_model_free(base);
    outcome_free(&cpu);
}

int main(void)
{
    if (!fixture_env("test_fallback"))
        return 1;
    char *root = make_tmpdir();
    char *base = fx("base");
    char *p[6] = {fx("lora_plain"), fx("lora_dora"), fx("ft_full"), fx("ft_full2"), fx("lora_rslora"), fx("lora_mts")};

    const char *kind = getenv("LLMERGE_FALLBACK_DEVICE");
    bool sim = !kind || !*kind || strcmp(kind, "sim") == 0;
    if (!sim)
        dev_kind = kind;
    lm_merge_opts o;
    const char *mixed[3] = {p[0], p[1], p[2]};
    if (sim) {
        // (a) and (c): two adapters and a full model, TIES. Slabs of 512 elements keep each
        // tensor's working set below the adapters' factors, as with a real model's, so there
        // are budgets where the factors do not fit and the tensors do.
        found f1 = {0};
        o = opts(LM_MERGE_TIES, 3);
        o.slab_elems = 512;
        sweep(root, "ties of 2 adapters + 1 model", &o, base, mixed, 2, &f1);
        CHECK_MSG(f1.a, "no budget had exactly one adapter's factors fall back and every tensor fit");
        CHECK_MSG(f1.c, "no budget had everything fall back");
    }

    // (b): full models only, so every tensor's working set grows with its size
    found f2 = {0};
    const char *full[2] = {p[2], p[3]};
    o = opts(LM_MERGE_DARE_TIES, 2);
    o.rescale = LM_RESCALE_L1;
    sweep(root, "dare-ties (l1) of 2 models", &o, base, full, 0, &f2);
    CHECK_MSG(f2.b, "no budget had only the largest tensors fall back");
    CHECK_MSG(f2.c, "no budget had every tensor fall back");

    if (sim) {
        // --topk global: the selection pass falls back per tensor as well
        found f3 = {0};
        const char *three[3] = {p[4], p[2], p[5]};
        o = opts(LM_MERGE_TIES, 3);
        o.topk_global = true;
        sweep(root, "ties --topk global", &o, base, three, 2, &f3);
        CHECK(f3.c);

        // task arithmetic: LoRA products added in place, also from factors left on the CPU
        found f4 = {0};
        o = opts(LM_MERGE_TASK_ARITHMETIC, 3);
        o.slab_elems = 512;
        sweep(root, "task-arithmetic", &o, base, mixed, 2, &f4);
        CHECK(f4.a && f4.c);
    }

    for (int i = 0; i < 6; i++)
        free(p[i]);
    free(base);
    remove_tmpdir(root);
    return check_report("test_fallback");
}
