// Benchmark of the merge methods that came with mergekit's configurations (linear, slerp,
// nuslerp, multislerp, karcher, model-stock, nearswap, breadcrumbs, breadcrumbs-ties, della,
// della-linear, sce, ram, ramplus-tl, passthrough) and merges written as LoRA adapters
// (--to-lora: a full fine-tune extracted at rank 16 and 64, ties of three adapters into one of
// rank 64, each with its relative errors) on the 1B-shape inputs bench_merge generates
// (Llama-3.2-1B shapes, BF16: the base, three full fine-tunes, three rank-16 LoRA adapters),
// each against a reference method run on the same inputs in the same run: task-arithmetic for
// the interpolations, averages, the ram methods and passthrough (the base's layers and a
// fine-tune's stacked), ties for the band selections, della and sce. Each case runs its
// reference and then itself, and the whole list of cases is gone through --rounds times, so a
// method and its reference are always neighbours in time and a slow moment of a shared machine
// falls on both; the figures are the medians over the rounds. It prints each run, then per case
// the median wall times, their ratio against the target (1.25x the reference for linear, slerp,
// breadcrumbs, breadcrumbs-ties, della and della-linear; 2x for the adapters; the others have
// none) and the median peak RSS against the reference's and against TIES's bound of 1.5 GB. Not
// a test: it asserts nothing, and exits non-zero only when something fails to run (a merge
// exiting non-zero, inputs missing).
//
//   bench_methods [--work DIR] [--llmerge PATH] [--only full|lora] [--rounds N]
//                 [--methods M1,M2,...] [--device DEV]
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cJSON.h>

#include "util.h"

#define BENCH_PROG "bench_methods"
#include "bench_run.h"
#include "bench_util.h"

#define DENSITY "0.2"
#define SEED "0"
#define RSS_BOUND 1500000000ull  // TIES's peak RSS target for three full fine-tunes (bench_merge)
enum { N_FT = 3, MAX_ROUNDS = 15 };

enum { BOTH = 0, FULL_ONLY = 1, LORA_ONLY = 2 };

// One method measured against its reference.
typedef struct bm_case {
    const char *method;
    const char *ref;            // the reference method, run on the same inputs
    int n_ft;                   // fine-tunes (or adapters) after the base
    const char *extra[3];       // options of this method only (NULL-terminated)
    double target;              // the most method / reference time allowed; 0 for none
    const char *name;           // how --methods and the tables call it (NULL: method)
    int kinds;                  // BOTH, or the one kind of input it runs on
} bm_case;

// nearswap's --t: the full fine-tunes' task vectors are uniform in ±2^-9, so about half of
// their entries lie beyond it (with the default 0.5 every entry would be taken whole).
static const bm_case CASES[] = {
    {"linear", "task-arithmetic", N_FT, {NULL}, 1.25, NULL, BOTH},
    {"slerp", "task-arithmetic", 1, {NULL}, 1.25, NULL, BOTH},
    {"nuslerp", "task-arithmetic", 2, {NULL}, 0, NULL, BOTH},
    {"multislerp", "task-arithmetic", N_FT, {NULL}, 0, NULL, BOTH},
    {"karcher", "task-arithmetic", N_FT, {NULL}, 0, NULL, BOTH},
    {"model-stock", "task-arithmetic", N_FT, {NULL}, 0, NULL, BOTH},
    {"nearswap", "task-arithmetic", 1, {"--t", "0.001", NULL}, 0, NULL, BOTH},
    {"breadcrumbs", "ties", N_FT, {NULL}, 1.25, NULL, BOTH},
    {"breadcrumbs-ties", "ties", N_FT, {NULL}, 1.25, NULL, BOTH},
    {"della", "ties", N_FT, {NULL}, 1.25, NULL, BOTH},
    {"della-linear", "ties", N_FT, {NULL}, 1.25, NULL, BOTH},
    {"sce", "ties", N_FT, {NULL}, 0, NULL, BOTH},
    {"sce", "ties", N_FT, {"--select-topk", "0.1", NULL}, 0, "sce-topk0.1", BOTH},  // a mask of the variances
    {"ram", "task-arithmetic", N_FT, {NULL}, 0, NULL, BOTH},
    {"ramplus-tl", "task-arithmetic", N_FT, {NULL}, 0, NULL, BOTH},
    // merges written as LoRA adapters: a full fine-tune extracted at rank 16 and 64, and ties of
    // the three adapters into one of rank 64, each against task arithmetic of the same inputs
    {"task-arithmetic", "task-arithmetic", 1, {"--to-lora", "16", NULL}, 2.0, "extract-r16", FULL_ONLY},
    {"task-arithmetic", "task-arithmetic", 1, {"--to-lora", "64", NULL}, 2.0, "extract-r64", FULL_ONLY},
    {"ties", "task-arithmetic", N_FT, {"--to-lora", "64", NULL}, 2.0, "ties-to-lora-r64", LORA_ONLY},
    {"task-arithmetic", "task-arithmetic", N_FT, {"--to-lora", "exact", NULL}, 0, "ta-to-lora-exact", LORA_ONLY},
    // every layer of the base, then every layer of the fine-tune, stacked (a model twice as
    // deep), against task arithmetic of the same two: the same reads, twice the writes
    {"passthrough", "task-arithmetic", 1, {NULL}, 0, NULL, FULL_ONLY},
};

// A case's name in --methods and the tables.
static const char *case_name(const bm_case *c)
{
    return c->name ? c->name : c->method;
}
enum { N_CASES = sizeof CASES / sizeof CASES[0] };

typedef struct bm_opts {
    const char *work;
    const char *llmerge;
    const char *device;
    bool full, lora;
    int rounds;
    bool chosen[N_CASES];  // --methods
} bm_opts;

// An adapter's figures from its llmerge.json: the relative errors, mean and worst (-1 where
// there are none), and where the factorisation's time went (outputs.adapter.timings: Δ made,
// factored, and of that the host's work, the device's and the error's pass; -1 where absent).
typedef struct bm_adapter {
    double mean, max;
    double delta_s, factor_s, host_s, device_s, residual_s;
    int on_device, on_host;  // matrices whose Δ was made on the device, on the host (-1: absent)
} bm_adapter;

// The measurements of one case on one kind of input, a run of each per round.
typedef struct bm_result {
    const bm_case *c;
    const char *kind;          // "full" or "lora"
    int n;                     // rounds completed
    bm_child ref[MAX_ROUNDS];
    bm_child run[MAX_ROUNDS];
    bm_adapter ad[MAX_ROUNDS];  // an adapter's figures (llmerge.json)
} bm_result;

// ==== running =================================================================================

// The adapter's figures from OUT/llmerge.json.
static void adapter_figures(const char *out, bm_adapter *ad)
{
    *ad = (bm_adapter){-1, -1, -1, -1, -1, -1, -1, -1, -1};
    char *path = lm_path_join(out, "llmerge.json"), *text = NULL;
    size_t len = 0;
    lm_err err = {0};
    if (path && lm_read_file(path, 64u << 20, &text, &len, &err) == LM_OK) {
        cJSON *j = cJSON_ParseWithLength(text, len);
        const cJSON *a = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(j, "outputs"), "adapter");
        const cJSON *m = cJSON_GetObjectItemCaseSensitive(a, "error_mean"), *x = cJSON_GetObjectItemCaseSensitive(a, "error_max");
        if (cJSON_IsNumber(m) && cJSON_IsNumber(x)) {
            ad->mean = m->valuedouble;
            ad->max = x->valuedouble;
        }
        const cJSON *t = cJSON_GetObjectItemCaseSensitive(a, "timings");
        const char *names[] = {"delta_s", "factor_s", "host_s", "device_s", "residual_s"};
        double *to[] = {&ad->delta_s, &ad->factor_s, &ad->host_s, &ad->device_s, &ad->residual_s};
        for (int i = 0; i < 5; i++) {
            const cJSON *v = cJSON_GetObjectItemCaseSensitive(t, names[i]);
            if (cJSON_IsNumber(v))
                *to[i] = v->valuedouble;
        }
        const cJSON *dd = cJSON_GetObjectItemCaseSensitive(a, "deltas_on_device"),
                    *dh = cJSON_GetObjectItemCaseSensitive(a, "deltas_on_host");
        if (cJSON_IsNumber(dd) && cJSON_IsNumber(dh)) {
            ad->on_device = dd->valueint;
            ad->on_host = dh->valueint;
        }
        cJSON_Delete(j);
    }
    free(text);
    free(path);
}

// The num_hidden_layers of the model directory `dir`'s config.json, or 0.
static int n_layers(const char *dir)
{
    char *path = lm_path_join(dir, "config.json"), *text = NULL;
    size_t len = 0;
    lm_err err = {0};
    int n = 0;
    if (path && lm_read_file(path, 16u << 20, &text, &len, &err) == LM_OK) {
        cJSON *j = cJSON_ParseWithLength(text, len);
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(j, "num_hidden_layers");
        n = cJSON_IsNumber(v) ? (int)v->valuedouble : 0;
        cJSON_Delete(j);
    }
    free(text);
    free(path);
    return n;
}

// Runs `method` on BASE and the first n_ft inputs of `fts` into WORK/methods/out, removing the
// output afterwards (an adapter's figures into *ad first, where ad is not NULL); passthrough
// stacks all of BASE's layers, then all of each input's (--slice MODEL:0:N each).
// Returns -1 when it could not be run; a failing merge has c->status != 0.
static int run_merge(const bm_opts *o, const char *method, const char *base, char *const *fts,
                     int n_ft, const char *const *extra, const char *dir, bm_child *c, bm_adapter *ad)
{
    char *out = lm_path_join(dir, "out"), *log = lm_path_join(dir, "merge.log");
    char *args[32];
    int n = 0, rc = -1;
    lm_err err = {0};
    if (!out || !log) {
        fprintf(stderr, BENCH_PROG ": out of memory\n");
        goto done;
    }
    args[n++] = (char *)o->llmerge;
    args[n++] = (char *)method;
    bool stack = strcmp(method, "passthrough") == 0;
    char slices[1 + N_FT][4096];
    int layers = stack ? n_layers(base) : 0;
    if (stack && layers < 1) {
        fprintf(stderr, BENCH_PROG ": %s/config.json: no num_hidden_layers\n", base);
        goto done;
    }
    for (int i = 0; stack && i <= n_ft && i <= N_FT; i++) {
        snprintf(slices[i], sizeof slices[i], "%s:0:%d", i == 0 ? base : fts[i - 1], layers);
        args[n++] = "--slice";
        args[n++] = slices[i];
    }
    if (!stack) {
        args[n++] = (char *)base;
        for (int i = 0; i < n_ft; i++)
            args[n++] = fts[i];
    }
    const char *common[] = {"-o", out, "-q", "--force", "--density", DENSITY, "--seed", SEED, "--device", o->device};
    for (size_t i = 0; i < (stack ? 4 : sizeof common / sizeof common[0]); i++)  // passthrough: the first four
        args[n++] = (char *)common[i];
    for (int i = 0; extra && extra[i]; i++)
        args[n++] = (char *)extra[i];
    args[n] = NULL;
    lm_rm_rf(out, &err);
    sync();  // the output before is written back before this run, not during it
    if (run_child(args, log, c) != 0)
        goto done;
    if (c->status != 0) {
        fprintf(stderr, BENCH_PROG ": `llmerge %s` exited with status %d; its output ends:\n",
                method, c->status);
        print_tail(log, 2000);
    } else if (!lm_is_dir(out)) {
        fprintf(stderr, BENCH_PROG ": `llmerge %s` exited 0 but wrote no %s\n", method, out);
        c->status = -1;
    } else if (ad) {
        adapter_figures(out, ad);
    }
    lm_rm_rf(out, &err);
    rc = 0;
done:
    free(out);
    free(log);
    return rc;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

// The median of v[0..n) (n >= 1); v is sorted in place.
static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

// ==== reporting ===============================================================================

typedef struct bm_summary {
    double ref_s, run_s;          // median wall seconds
    double ratio;                 // run_s / ref_s
    double pair_lo, pair_hi;      // the smallest and largest ratio of a round's pair
    double ref_rss, run_rss;      // median peak RSS, bytes
} bm_summary;

static bm_summary summarize(const bm_result *r)
{
    double a[MAX_ROUNDS], b[MAX_ROUNDS], ra[MAX_ROUNDS], rb[MAX_ROUNDS];
    bm_summary s = {.pair_lo = 1e300, .pair_hi = 0};
    for (int i = 0; i < r->n; i++) {
        a[i] = r->ref[i].wall;
        b[i] = r->run[i].wall;
        ra[i] = (double)r->ref[i].peak_rss;
        rb[i] = (double)r->run[i].peak_rss;
        double q = b[i] / a[i];
        s.pair_lo = q < s.pair_lo ? q : s.pair_lo;
        s.pair_hi = q > s.pair_hi ? q : s.pair_hi;
    }
    s.ref_s = median(a, r->n);
    s.run_s = median(b, r->n);
    s.ratio = s.run_s / s.ref_s;
    s.ref_rss = median(ra, r->n);
    s.run_rss = median(rb, r->n);
    return s;
}

static void print_results(const bm_result *res, int nres, int rounds)
{
    printf("\n%-22s %-16s %3s %9s %9s %7s %13s %9s %9s  %s\n", "method (inputs)", "reference",
           "n", "ref s", "method s", "ratio", "pairs", "ref RSS", "RSS", "target");
    for (int i = 0; i < nres; i++) {
        const bm_result *r = &res[i];
        char name[48], pairs[32], target[64];
        snprintf(name, sizeof name, "%s %s", case_name(r->c), r->kind);
        if (r->n == 0) {
            printf("%-22s %-16s   FAILED\n", name, r->c->ref);
            continue;
        }
        bm_summary s = summarize(r);
        snprintf(pairs, sizeof pairs, "%.2f-%.2f", s.pair_lo, s.pair_hi);
        if (r->c->target > 0)
            snprintf(target, sizeof target, "<= %.2fx: %s", r->c->target,
                     s.ratio <= r->c->target ? "met" : "MISSED");
        else
            snprintf(target, sizeof target, "-");
        printf("%-22s %-16s %3d %9.2f %9.2f %6.2fx %13s %9.2f %9.2f  %s\n", name, r->c->ref, r->n,
               s.ref_s, s.run_s, s.ratio, pairs, gb((uint64_t)s.ref_rss), gb((uint64_t)s.run_rss),
               target);
    }
    for (int i = 0; i < nres; i++) {
        const bm_result *r = &res[i];
        const bm_adapter *a = &r->ad[0];
        if (r->n > 0 && a->mean >= 0)
            printf("  %s %s: the adapter's relative error |D - B.A| / |D|, mean %.4g, worst %.4g (first round)\n",
                   case_name(r->c), r->kind, a->mean, a->max);
        if (r->n > 0 && a->factor_s >= 0 && a->device_s >= 0)
            printf("  %s %s: D made in %.2f s, factored in %.2f s: the host's work %.2f s, the device's products "
                   "and copies %.2f s, the error's pass %.2f s, the rest %.2f s (first round)\n",
                   case_name(r->c), r->kind, a->delta_s, a->factor_s, a->host_s, a->device_s, a->residual_s,
                   a->factor_s - a->host_s - a->device_s - a->residual_s);
        else if (r->n > 0 && a->factor_s >= 0)  // an llmerge from before device_s
            printf("  %s %s: D made in %.2f s, factored in %.2f s: the host's work %.2f s, the error's pass %.2f s "
                   "(first round)\n", case_name(r->c), r->kind, a->delta_s, a->factor_s, a->host_s, a->residual_s);
        if (r->n > 0 && a->on_device > 0)
            printf("  %s %s: D made on the device for %d matrices, on the host for %d (first round)\n",
                   case_name(r->c), r->kind, a->on_device, a->on_host);
    }
    printf("(medians over %d rounds of reference then method on the same inputs; ratio = method s"
           " / ref s;\n pairs: the smallest and largest ratio within one round; RSS: peak RSS in GB "
           "from wait4's ru_maxrss;\n density " DENSITY ", seed " SEED ", default threads)\n",
           rounds);
    printf("\npeak RSS (target: under TIES's bound of %.1f GB):\n", gb(RSS_BOUND));
    for (int i = 0; i < nres; i++) {
        const bm_result *r = &res[i];
        if (r->n == 0)
            continue;
        bm_summary s = summarize(r);
        char name[48];
        snprintf(name, sizeof name, "%s %s", case_name(r->c), r->kind);
        printf("  %-22s %.2f GB (%s %.2f GB): %s\n", name, gb((uint64_t)s.run_rss), r->c->ref,
               gb((uint64_t)s.ref_rss), s.run_rss < (double)RSS_BOUND ? "met" : "MISSED");
    }
}

// ==== main ====================================================================================

static void usage(FILE *out)
{
    fprintf(out,
            "usage: bench_methods [--work DIR] [--llmerge PATH] [--only full|lora] [--rounds N]\n"
            "                     [--methods M1,M2,...] [--device DEV]\n"
            "  --work DIR       where bench_merge generated its inputs (default\n"
            "                   /tmp/llmerge-bench-merge); merges write under DIR/methods\n"
            "  --llmerge PATH   the binary to run (default: llmerge beside bench_methods)\n"
            "  --only KIND      only the full fine-tunes, or only the LoRA adapters\n"
            "  --rounds N       rounds of reference-then-method per case (default 3, at most %d)\n"
            "  --methods LIST   only these methods (default: all)\n"
            "  --device DEV     where the merges run (default cpu)\n",
            MAX_ROUNDS);
}

// Marks the cases named in the comma-separated `list`; returns -1 for a name not among them.
static int choose(bm_opts *o, const char *list)
{
    char *copy = lm_strdup(list);
    if (!copy)
        return -1;
    int rc = 0;
    for (char *save = NULL, *m = strtok_r(copy, ",", &save); m; m = strtok_r(NULL, ",", &save)) {
        int k = 0;
        while (k < N_CASES && strcmp(case_name(&CASES[k]), m) != 0)
            k++;
        if (k == N_CASES) {
            fprintf(stderr, BENCH_PROG ": no case for method '%s'\n", m);
            rc = -1;
            break;
        }
        o->chosen[k] = true;
    }
    free(copy);
    return rc;
}

int main(int argc, char **argv)
{
    bm_opts o = {.work = "/tmp/llmerge-bench-merge", .device = "cpu", .full = true, .lora = true,
                 .rounds = 3};
    bool any_chosen = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        bool has = i + 1 < argc;
        if (strcmp(a, "--work") == 0 && has) {
            o.work = argv[++i];
        } else if (strcmp(a, "--llmerge") == 0 && has) {
            o.llmerge = argv[++i];
        } else if (strcmp(a, "--device") == 0 && has) {
            o.device = argv[++i];
        } else if (strcmp(a, "--only") == 0 && has) {
            const char *k = argv[++i];
            o.full = strcmp(k, "full") == 0;
            o.lora = strcmp(k, "lora") == 0;
            if (!o.full && !o.lora) {
                fprintf(stderr, BENCH_PROG ": --only takes full or lora, not '%s'\n", k);
                return 2;
            }
        } else if (strcmp(a, "--rounds") == 0 && has) {
            o.rounds = atoi(argv[++i]);
            if (o.rounds < 1 || o.rounds > MAX_ROUNDS) {
                fprintf(stderr, BENCH_PROG ": --rounds takes 1 to %d\n", MAX_ROUNDS);
                return 2;
            }
        } else if (strcmp(a, "--methods") == 0 && has) {
            if (choose(&o, argv[++i]) != 0)
                return 2;
            any_chosen = true;
        } else if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
            usage(stdout);
            return 0;
        } else {
            usage(stderr);
            return 2;
        }
    }
    if (!any_chosen)
        for (int k = 0; k < N_CASES; k++)
            o.chosen[k] = true;

    int rc = 1, failures = 0, nres = 0;
    lm_err err = {0};
    bm_result *res = calloc(2 * N_CASES, sizeof *res);
    char *llmerge = o.llmerge ? lm_strdup(o.llmerge) : bench_default_llmerge();
    char *dir = lm_path_join(o.work, "methods");
    char *base = lm_path_join(o.work, "base");
    char *ft[N_FT] = {0}, *lora[N_FT] = {0};
    bool ok = res && llmerge && dir && base;
    for (int i = 0; i < N_FT; i++) {
        ft[i] = lm_strfmt("%s/ft%d", o.work, i + 1);
        lora[i] = lm_strfmt("%s/lora%d", o.work, i + 1);
        ok = ok && ft[i] && lora[i];
    }
    if (!ok) {
        fprintf(stderr, BENCH_PROG ": out of memory\n");
        goto done;
    }
    o.llmerge = llmerge;
    if (access(llmerge, X_OK) != 0) {
        fprintf(stderr, BENCH_PROG ": no llmerge binary at %s (give --llmerge PATH)\n", llmerge);
        goto done;
    }
    // the inputs are bench_merge's, complete only once it has written their stamps
    const char *stamps[] = {".stamp-base", o.full ? ".stamp-full" : NULL,
                            o.lora ? ".stamp-lora" : NULL};
    for (int i = 0; i < 3; i++) {
        char *stamp = stamps[i] ? lm_path_join(o.work, stamps[i]) : NULL;
        bool there = !stamps[i] || (stamp && access(stamp, R_OK) == 0);
        free(stamp);
        if (!there) {
            fprintf(stderr, BENCH_PROG ": no complete inputs in %s (%s missing): run bench_merge "
                    "first (bench_merge --generate only generates them)\n", o.work, stamps[i]);
            goto done;
        }
    }
    if (lm_mkdir_p(dir, &err) != LM_OK) {
        fprintf(stderr, BENCH_PROG ": %s\n", err.msg);
        goto done;
    }
    printf("machine: %ld cores, %.1f GB RAM; llmerge: %s; inputs: %s; --device %s\n",
           sysconf(_SC_NPROCESSORS_ONLN), gb(proc_kb("/proc/meminfo", "MemTotal:")), llmerge,
           o.work, o.device);

    for (int kind = 0; kind < 2; kind++) {
        if (kind == 0 ? !o.full : !o.lora)
            continue;
        char *const *fts = kind == 0 ? ft : lora;
        const char *kname = kind == 0 ? "full" : "lora";
        int first = nres;
        for (int k = 0; k < N_CASES; k++)
            if (o.chosen[k] && (CASES[k].kinds == BOTH || CASES[k].kinds == (kind == 0 ? FULL_ONLY : LORA_ONLY)))
                res[nres++] = (bm_result){.c = &CASES[k], .kind = kname};
        // an untimed merge first, so that the first case does not pay for reading the inputs
        // into the page cache
        bm_child warm;
        printf("\n%s: warming the page cache (task-arithmetic of base + %d) ...\n", kname, N_FT);
        fflush(stdout);
        if (run_merge(&o, "task-arithmetic", base, fts, N_FT, NULL, dir, &warm, NULL) != 0)
            goto done;
        for (int round = 0; round < o.rounds; round++) {
            for (int i = first; i < nres; i++) {
                bm_result *r = &res[i];
                if (r->n < round)  // a failure earlier: not run again
                    continue;
                bm_child *ref = &r->ref[round], *run = &r->run[round];
                if (run_merge(&o, r->c->ref, base, fts, r->c->n_ft, NULL, dir, ref, NULL) != 0 ||
                    run_merge(&o, r->c->method, base, fts, r->c->n_ft, r->c->extra, dir, run, &r->ad[round]) != 0)
                    goto done;
                if (ref->status != 0 || run->status != 0) {
                    failures++;
                    continue;
                }
                r->n++;
                printf("  round %d  %-16s %-5s base + %d: %-16s %7.2f s %5.2f GB, %-16s %7.2f s "
                       "%5.2f GB (%.2fx)\n", round + 1, case_name(r->c), kname, r->c->n_ft, r->c->ref,
                       ref->wall, gb(ref->peak_rss), case_name(r->c), run->wall, gb(run->peak_rss),
                       run->wall / ref->wall);
                fflush(stdout);
            }
        }
    }
    print_results(res, nres, o.rounds);
    rc = failures ? 1 : 0;
done:
    free(res);
    free(llmerge);
    free(dir);
    free(base);
    for (int i = 0; i < N_FT; i++) {
        free(ft[i]);
        free(lora[i]);
    }
    return rc;
}
