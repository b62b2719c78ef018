// `llmerge plan METHOD BASE FT [FT...] -o OUT [merge options] [--json]`: what the merge with
// the same arguments will need, before anything runs. The arguments go through the merge's
// own parsing and preparation (lm_cmd_merge_prepare: the same checks, the same exit status 2
// for bad ones, the same device opened, so `--device auto` plans for what auto opens); then
// lm_plan_make reads the headers and the device's free memory, and this file prints, per
// phase: for sparsegpt the Hessian capture of each model (its weights and whether they fit the
// device, the accumulators and where they go, the activations of a batch, the largest batch
// that fits, which batches will be halved or run on the CPU, and what is already in the cache);
// which adapters' LoRA factors will be placed on the device and which stay on the CPU, the
// merge units (tensors) that will not fit and run on the CPU, the CPU's peak memory over all
// phases, and the output's size, shards and the free disk space where it goes. --json prints
// the same as one object.
#include <cJSON.h>
#include <dirent.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cache.h"
#include "cmd.h"
#include "device.h"
#include "forward.h"
#include "merge.h"
#include "merge_args.h"
#include "plan.h"
#include "util.h"

#define PREFIX "llmerge plan"

static void usage(FILE *out)
{
    fprintf(out,
            "Usage: llmerge plan METHOD BASE FT [FT...] -o OUT [merge options] [--json]\n"
            "       llmerge plan CONFIG.yml -o OUT [run options] [--json]\n"
            "       llmerge plan extract BASE FT -o ADAPTER --rank R [options] [--json]\n"
            "\n"
            "Prints what `llmerge METHOD BASE FT... -o OUT [options]` (or `llmerge run CONFIG.yml`,\n"
            "or `llmerge extract`) will need, reading only the inputs' headers and configs: each\n"
            "adapter's LoRA factors and whether they fit the device, each tensor's working set on\n"
            "the device and which tensors will fall back to the CPU, the CPU's peak memory over all\n"
            "phases, and the output's bytes, shards and the free disk space beside OUT. METHOD is\n"
            "any merge method (llmerge --help lists them); the options are the merge's (see llmerge\n"
            "METHOD --help), --device and --gpu-mem included.\n"
            "\n"
            "For an adapter (--to-lora, extract) it also sizes each matrix's change, held in\n"
            "float32 while it is factored (on the device where the merge runs on one), the\n"
            "factorisation's buffers, and the adapter's bytes at most.\n"
            "\n"
            "For sparsegpt it also plans the Hessian capture of each model (each FT's, or the\n"
            "base's once with --hessian-from base), from the calibration files' sequence lengths:\n"
            "the forward pass's float32 weights and whether they fit the device (else that model\n"
            "runs on the CPU), the Hessian accumulators and where they go, the activations of the\n"
            "largest batch and the largest batch that fits beside them, the batches the capture\n"
            "will halve or run on the CPU, and the importance buffers the merge adds. A model whose\n"
            "Hessians are already in the cache needs no capture; to know, plan hashes the inputs\n"
            "as the merge does, but only when the cache directory holds entries.\n"
            "\n"
            "  --json   print the plan as one JSON object\n");
}

static const char *fmt(char *buf, uint64_t bytes)
{
    return lm_format_bytes(buf, 32, bytes);
}

// ==== what the cache holds ====================================================================

// Whether directory `dir` holds an entry of a kind that can spare work (U_cc², Hessians,
// masks): when it holds none, no key needs computing, and no input needs hashing.
static bool has_entries(const char *dir)
{
    DIR *d = opendir(dir);
    if (!d)
        return false;
    bool found = false;
    const lm_cache_kind kinds[] = {LM_CACHE_UCC2, LM_CACHE_HESS, LM_CACHE_MASK};
    for (struct dirent *e; !found && (e = readdir(d));)
        for (size_t k = 0; k < sizeof kinds / sizeof kinds[0] && !found; k++) {
            const char *name = lm_cache_kind_name(kinds[k]);
            size_t nl = strlen(e->d_name);
            found = strncmp(e->d_name, name, strlen(name)) == 0 && e->d_name[strlen(name)] == '-' && nl > 4 &&
                    strcmp(e->d_name + nl - 4, ".bin") == 0;  // not a lock (xlock.h)
        }
    closedir(d);
    return found;
}

static bool entry_exists(const char *dir, lm_cache_kind kind, uint64_t key)
{
    char *path = lm_cache_entry_path(dir, kind, key);
    bool there = path && access(path, R_OK) == 0;
    free(path);
    return there;
}

// What the cache in `dir` holds under the keys the merge computes (from digests of every
// input, as the merge's cache_keys): per Hessian set (one with --hessian-from base, else one
// per FT) its U_cc² or its Hessians, and per FT its top-k masks. An entry that exists is taken
// as sound; the merge checks it and computes again what a damaged one held. *looked says
// whether the inputs were hashed to find out.
static lm_status lookup_cache(const lm_cmd_prepared *pr, const char *dir, lm_plan_cached *cached, int n_sets,
                              bool *mask_hit, bool *looked, lm_err *err)
{
    int n_ft = pr->opts->n_ft;
    *looked = false;
    if (!dir || !has_entries(dir))
        return LM_OK;
    *looked = true;
    uint64_t base_d = 0, ft_d[n_ft > 0 ? n_ft : 1], calib_d[pr->n_calib > 0 ? pr->n_calib : 1],
             ucc2_key[n_sets > 0 ? n_sets : 1];
    lm_status s = lm_cache_digest_model(pr->base, &base_d, err);
    for (int j = 0; s == LM_OK && j < n_ft; j++)
        s = pr->fts[j]->model ? lm_cache_digest_model(pr->fts[j]->model, &ft_d[j], err)
                              : lm_cache_digest_adapter(pr->fts[j]->adapter, &ft_d[j], err);
    for (int i = 0; s == LM_OK && i < pr->n_calib; i++)
        s = lm_cache_digest_file(pr->calib[i].path, &calib_d[i], err);
    if (s != LM_OK)
        return s;
    for (int i = 0; i < n_sets; i++) {
        const lm_ft *ft = pr->hessian_from_base ? NULL : pr->fts[i];
        lm_cache_hess_src src = {
            .model = ft && ft->model ? ft_d[i] : base_d,
            .has_adapter = ft && ft->adapter,
            .adapter = ft && ft->adapter ? ft_d[i] : 0,
            .calib = calib_d[pr->n_calib == 1 ? 0 : i],
            .max_samples = pr->calib_samples,
            .max_len = pr->seq_len,
        };
        ucc2_key[i] = lm_cache_key_ucc2(&src, pr->damp);
        if (entry_exists(dir, LM_CACHE_UCC2, ucc2_key[i]))
            cached[i] = LM_PLAN_CACHE_UCC2;
        else if (entry_exists(dir, LM_CACHE_HESS, lm_cache_key_hess(&src)))
            cached[i] = LM_PLAN_CACHE_HESS;
    }
    for (int j = 0; j < n_ft; j++) {
        lm_cache_mask_src src = {ucc2_key[n_sets == 1 ? 0 : j], base_d, ft_d[j], pr->opts->densities[j],
                                 pr->opts->topk_global};
        mask_hit[j] = entry_exists(dir, LM_CACHE_MASK, lm_cache_key_mask(&src));
    }
    return LM_OK;
}

// ==== text ====================================================================================

// "FT 2 (path)", or "base (dir)" for --hessian-from base.
static const char *who(char *buf, size_t cap, const lm_plan_capture *c)
{
    if (c->ft >= 0)
        snprintf(buf, cap, "FT %d (%s)", c->ft + 1, c->label);
    else
        snprintf(buf, cap, "base (%s)", c->label);
    return buf;
}

static void print_capture(const lm_plan *p, const lm_plan_capture *c, const char *dev_name)
{
    char a[32], b[32], d[32], w[1200];
    who(w, sizeof w, c);
    if (c->cached == LM_PLAN_CACHE_UCC2) {
        printf("capture: %s on %s: its U_cc² are in the cache: no capture\n", w, c->calib);
        return;
    }
    if (c->cached == LM_PLAN_CACHE_MASKS) {
        printf("capture: %s on %s: the top-k masks it would select are in the cache: no Hessians needed\n", w,
               c->calib);
        return;
    }
    if (c->cached == LM_PLAN_CACHE_HESS) {
        printf("capture: %s on %s: its Hessians are in the cache: no capture; U_cc² computed from them, cpu "
               "peak about %s\n", w, c->calib, fmt(a, c->cpu.peak));
        return;
    }
    printf("capture: %s on %s: %" PRId64 " sequence%s, %" PRId64 " tokens (the longest %" PRId64 "); %" PRId64
           " batch%s of at most %" PRId64 " tokens (the largest %" PRId64 ")\n", w, c->calib, c->n_seqs,
           c->n_seqs == 1 ? "" : "s", c->n_tokens, c->longest, c->run.n_formed, c->run.n_formed == 1 ? "" : "es",
           c->max_tokens, c->run.formed_tokens);
    const char *where = c->weights_on_device ? dev_name : "cpu";
    if (!p->dev_accelerator)
        printf("capture: %s weights: %s of float32 on cpu (F32 tensors used in place), %s of input read\n", w,
               fmt(a, c->fwd.weight_bytes), fmt(b, c->fwd.mapped_bytes));
    else if (c->weights_on_device)
        printf("capture: %s weights: %s of float32 on %s (budget %s)\n", w, fmt(a, c->fwd.weight_bytes), where,
               fmt(b, p->budget));
    else if (!strstr(c->weights_why, "fit"))
        printf("capture: %s weights: on cpu (%s); %s of float32 on cpu\n", w, c->weights_why,
               fmt(a, c->fwd_cpu.weight_bytes));
    else
        printf("capture: %s weights: stay on cpu (%s: %s on %s at most while placed, budget %s); %s of float32 on "
               "cpu\n", w, c->weights_why, fmt(a, c->fwd.placing_peak), dev_name, fmt(b, p->budget),
               fmt(d, c->fwd_cpu.weight_bytes));
    uint64_t acc = c->hess.dev_bytes + c->hess.host_bytes;
    if (p->dev_accelerator && c->weights_on_device)
        printf("capture: %s Hessians: %" PRId64 " accumulators, %s: %" PRId64 " on %s (%s), %" PRId64
               " in host memory (%s)\n", w, c->hess.n_acc, fmt(a, acc), c->hess.n_dev, dev_name,
               fmt(b, c->hess.dev_bytes), c->hess.n_acc - c->hess.n_dev, fmt(d, c->hess.host_bytes));
    else
        printf("capture: %s Hessians: %" PRId64 " accumulators, %s, in host memory\n", w, c->hess.n_acc, fmt(a, acc));
    if (p->dev_accelerator && c->weights_on_device) {
        printf("capture: %s activations: %s for the largest batch (%" PRId64 " tokens); %s left on %s beside the "
               "weights and Hessians: ", w, fmt(a, c->arena_bytes), c->run.formed_tokens, fmt(b, c->avail), dev_name);
        if (c->fit_tokens == 0)
            printf("not even one token fits\n");
        else
            printf("the largest batch that fits is %" PRId64 " tokens (%" PRId64 " sequence%s of %" PRId64 ")%s\n",
                   c->fit_tokens, c->fit_tokens / c->longest, c->fit_tokens / c->longest == 1 ? "" : "s", c->longest,
                   c->fit_tokens >= c->run.formed_tokens ? ": every batch fits" : "");
    } else {
        printf("capture: %s activations: %s for the largest batch (%" PRId64 " tokens) on cpu\n", w,
               fmt(a, c->arena_bytes), c->run.formed_tokens);
    }
    for (int64_t i = 0; i < c->n_notes; i++) {
        const lm_plan_capture_note *n = &c->notes[i];
        if (n->halved)
            printf("capture: %s fallback: sequences %" PRId64 "-%" PRId64 " (%" PRId64 " tokens) halved on %s "
                   "(activations %s, %s left)\n", w, n->first + 1, n->first + n->n, n->tokens, dev_name,
                   fmt(a, n->need), fmt(b, c->avail));
        else
            printf("capture: %s fallback: sequence %" PRId64 " (%" PRId64 " tokens) on cpu (activations %s, %s "
                   "left)\n", w, n->first + 1, n->tokens, fmt(a, n->need), fmt(b, c->avail));
    }
    if (c->run.stuck)
        printf("capture: %s fallback: every later sequence on cpu (--sticky-fallback)\n", w);
    const lm_plan_capture_cpu *u = &c->cpu;
    if (p->dev_accelerator && c->weights_on_device)
        printf("capture: %s %s: peak about %s\n", w, dev_name, fmt(a, c->dev_peak));
    if (p->dev_accelerator && c->factor_dev_peak)
        printf("capture: %s Hessian factors on %s: peak about %s\n", w, dev_name, fmt(a, c->factor_dev_peak));
    if (c->factor_fallbacks)
        printf("capture: %s fallback: %" PRId64 " Hessian factor%s on cpu (the damped matrix does not fit)\n", w,
               c->factor_fallbacks, c->factor_fallbacks == 1 ? "" : "s");
    printf("capture: %s cpu: peak about %s (placing %s, capturing %s: weights %s, Hessians %s, activations %s; "
           "finishing %s)\n", w, fmt(a, u->peak), fmt(b, u->placing), fmt(d, u->capturing),
           fmt((char[32]){0}, u->weights + u->device_host), fmt((char[32]){0}, u->accumulators),
           fmt((char[32]){0}, u->activations + u->stage), fmt((char[32]){0}, u->finishing));
}

// ==== --to-lora ================================================================================

// What --to-lora adds: each matrix's change held in float32 while it is factored (the largest
// one's, with the factorisation's buffers: its range and projection in float32 and double, its
// factors), and the adapter's size (every matrix at the rank, every vector whole, as if each
// changed) in place of the model's.
typedef struct plan_lora {
    const char *largest;  // the largest matrix
    uint64_t delta;       // its change in float32
    uint64_t work;        // the factorisation's buffers for it
    uint64_t bytes;       // the adapter's tensor data, at most
    uint64_t stage;       // on a device, the chunks its change is made with there (base's and float32)
} plan_lora;

// Whether the largest matrix's change fits a device's budget, with the chunks it is made with:
// where it does, the changes are held on the device (merge_lora.c); else on the host.
static bool lora_on_device(const lm_plan *p, const plan_lora *l)
{
    return p->dev_accelerator && l->delta + l->stage <= p->budget;
}

static plan_lora lora_need(const lm_cmd_prepared *pr)
{
    plan_lora l = {0};
    const lm_model *b = pr->base;
    int threads = lm_dev_threads(pr->dev) > 0 ? lm_dev_threads(pr->dev) : 1;
    uint64_t es = lm_dtype_bits((lm_dtype)pr->lora_dtype) / 8;
    for (int64_t i = 0; i < b->n_tensors; i++) {
        const lm_st_tensor *t = b->tensors[i];
        if (!lm_dtype_readable(t->dtype))
            continue;
        size_t nl = strlen(t->name);
        bool matrix = t->ndim == 2 && nl > 7 && strcmp(t->name + nl - 7, ".weight") == 0;
        if (!matrix) {
            l.bytes += (uint64_t)t->numel * es;
            continue;
        }
        int64_t rows = t->shape[0], cols = t->shape[1], k = rows < cols ? rows : cols;
        int64_t r = pr->to_lora_exact ? 0 : pr->to_lora, lw = r + LM_LORA_OVERSAMPLE < k ? r + LM_LORA_OVERSAMPLE : k;
        l.bytes += (uint64_t)(r * (rows + cols)) * es;
        if ((uint64_t)t->numel * 4 > l.delta) {
            l.largest = t->name;
            l.delta = (uint64_t)t->numel * 4;
            int64_t chunk = t->numel < LM_LORA_DELTA_CHUNK ? t->numel : LM_LORA_DELTA_CHUNK;
            l.stage = (uint64_t)chunk * (lm_dtype_bits(t->dtype) / 8 + 4);
            int64_t big = rows > cols ? rows : cols;
            // lowrank.c's buffers: the sketches in float and double, the small SVD's, the factors,
            // the device's copies, the residual's chunk (4 MiB); the stacked triangles of a QR by
            // blocks, each thread's block of its basis, the CPU's packed test matrix
            int64_t qr_rows = 2 * lw > 512 ? 2 * lw : 512;
            l.work = (uint64_t)(big * lw) * 12 + (uint64_t)(lw * cols) * 28 + (uint64_t)((rows + cols) * r) * 8 +
                     (uint64_t)(rows + cols) * (uint64_t)lw * 4 + (4u << 20) +
                     (uint64_t)(big / qr_rows + 1) * (uint64_t)(lw * lw) * 8 +
                     (uint64_t)threads * (uint64_t)(2 * qr_rows * lw) * 8 + (uint64_t)cols * (uint64_t)(lw + 15) / 16 * 64;
        }
    }
    if (pr->to_lora_exact)  // no merge: the inputs' factors, which the adapters' files size
        l.delta = l.work = 0;
    return l;
}

static void print_text(const lm_cmd_prepared *pr, const lm_plan *p, const char *dev_name, size_t free_b,
                       size_t total_b, const char *cache_dir, bool looked)
{
    char a[32], b[32], c[32], d[32];
    if (p->dev_accelerator)
        printf("device: %s, %s free of %s, budget %s%s\n", dev_name, fmt(a, free_b), fmt(b, total_b),
               fmt(c, p->budget), pr->gpu_mem ? " (with --gpu-mem)" : "");
    else
        printf("device: %s (%s)\n", dev_name, pr->dev_why);
    if (p->n_captures > 0 && !cache_dir)
        printf("cache: none (no --cache-dir, XDG_CACHE_HOME or HOME): every set of Hessians is captured\n");
    else if (p->n_captures > 0)
        printf("cache: %s: %s\n", cache_dir, looked ? "looked up (the inputs hashed as the merge hashes them)"
                                                    : "holds no entries");
    for (int i = 0; i < p->n_captures; i++)
        print_capture(p, &p->captures[i], dev_name);
    for (int i = 0; i < p->n_ft; i++) {
        const lm_plan_ft *f = &p->ft[i];
        const char *name = pr->ft_names[i];
        if (!pr->fts[i]->adapter)
            printf("place: %s (%s) is a full model: no LoRA factors to place\n", name, pr->ft_args[i]);
        else if (!p->accelerator)
            printf("place: %s (%s) %s of LoRA factors: on cpu\n", name, pr->ft_args[i], fmt(a, f->resident_bytes));
        else
            printf("place: %s (%s) %s of LoRA factors: %s%s\n", name, pr->ft_args[i], fmt(a, f->resident_bytes),
                   f->on_device ? "on " : "stays on cpu (does not fit)", f->on_device ? dev_name : "");
    }
    const char *merge_dev = p->accelerator ? dev_name : "cpu";
    if (p->dev_accelerator && !p->accelerator)
        printf("merge: on cpu (%s has no importance operations)\n", dev_name);
    if (p->largest < 0) {
        printf("merge: no tensor is changed by the FTs; all %" PRId64 " are copied on the cpu\n", p->n_tensors);
    } else {
        const lm_plan_tensor *t = &p->tensors[p->largest];
        printf("merge: largest tensor %s needs %s on %s", t->name, fmt(a, t->dev_bytes), merge_dev);
        if (!p->accelerator)
            printf("; all %" PRId64 " merged tensors run on the cpu\n", p->n_merged);
        else if (p->n_fallback == 0)
            printf("; all %" PRId64 " merged tensors fit beside %s of factors\n", p->n_merged, fmt(b, p->placed_bytes));
        else
            printf("; %" PRId64 " of %" PRId64 " tensors do not fit and will run on the CPU (the largest: %s, %s)\n",
                   p->n_fallback, p->n_merged, p->tensors[p->largest_fallback].name,
                   fmt(b, p->tensors[p->largest_fallback].dev_bytes));
        if (p->n_captures > 0) {
            int64_t n_imp = 0, most = -1;
            for (int64_t i = 0; i < p->n_tensors; i++) {
                const lm_merge_imp_need *m = &p->tensors[i].imp_dev;
                n_imp += m->parts > 0;
                if (m->parts > 0 && (most < 0 || m->key_bytes + m->ucc2_bytes > p->tensors[most].imp_dev.key_bytes +
                                                                               p->tensors[most].imp_dev.ucc2_bytes))
                    most = i;
            }
            if (most < 0)
                printf("merge: importance (sparsegpt): none (every FT's masks come from the cache)\n");
            else
                printf("merge: importance (sparsegpt): %" PRId64 " tensors ranked by their Hessians, with a buffer per "
                       "FT that has one (the most: %s for %s)\n", n_imp,
                       fmt(a, p->tensors[most].imp_dev.key_bytes + p->tensors[most].imp_dev.ucc2_bytes),
                       p->tensors[most].name);
        }
        for (int64_t i = 0; p->accelerator && i < p->n_tensors; i++)
            if (p->tensors[i].cpu.parts > 0 && !p->tensors[i].fits)
                printf("merge: fallback %s on cpu (needs %s, %s left beside the factors)\n", p->tensors[i].name,
                       fmt(a, p->tensors[i].dev_bytes), fmt(b, p->budget - p->placed_bytes));
        if (p->accelerator)
            printf("%s: peak about %s\n", dev_name, fmt(a, p->dev_peak));
    }
    const lm_plan_cpu *m = &p->cpu;
    if (p->n_captures == 0) {
        printf("cpu: peak about %s (buffers %s of %s reserved, LoRA factors %s, mapped inputs %s, adapters mapped %s, "
               "histograms %s, other %s)\n",
               fmt(a, m->peak), fmt(b, m->ws_touched), fmt(c, m->ws_reserved), fmt((char[32]){0}, m->residents),
               fmt((char[32]){0}, m->mapped), fmt((char[32]){0}, m->adapter_mapped),
               fmt((char[32]){0}, m->hist + m->select),
               fmt((char[32]){0}, m->out_host + m->out_slab + m->mag + m->device_host + m->runtime));
    } else {
        char w[1200];
        if (p->cpu_peak_phase >= 0)
            printf("cpu: peak about %s, in the capture of %s; ", fmt(a, p->cpu_peak),
                   who(w, sizeof w, &p->captures[p->cpu_peak_phase]));
        else
            printf("cpu: peak about %s, in the merge; ", fmt(a, p->cpu_peak));
        printf("the merge about %s (buffers %s of %s reserved, importance %s of %s, LoRA factors %s, mapped inputs %s, "
               "adapters mapped %s, U_cc² %s, masks %s, calibration data %s, other %s)\n",
               fmt(b, m->peak), fmt(c, m->ws_touched), fmt((char[32]){0}, m->ws_reserved),
               fmt((char[32]){0}, m->keys_touched), fmt((char[32]){0}, m->keys_reserved),
               fmt((char[32]){0}, m->residents), fmt((char[32]){0}, m->mapped), fmt((char[32]){0}, m->adapter_mapped),
               fmt((char[32]){0}, m->hessian_sets), fmt((char[32]){0}, m->masks), fmt((char[32]){0}, m->calib),
               fmt((char[32]){0}, m->hist + m->select + m->out_host + m->out_slab + m->mag + m->device_host +
                   m->runtime));
    }
    if (p->n_captures > 0 && cache_dir) {
        printf("cache: the merge writes about %s into %s", fmt(a, p->cache_bytes), cache_dir);
        if (p->cache_known)
            printf("; %s free there (%s)\n", fmt(b, p->cache_free), p->cache_bytes <= p->cache_free ? "fits"
                                                                                              : "does NOT fit");
        else
            printf("\n");
    }
    if (pr->to_lora || pr->to_lora_exact) {
        plan_lora l = lora_need(pr);
        if (pr->to_lora && lora_on_device(p, &l))
            printf("adapter: each matrix's change is held in float32 on %s while it is factored at rank %d (the "
                   "largest, %s, %s), with %s of the factorisation's buffers on the host; a change that does not "
                   "fit there beside the merge is held on the host (about %s in all)\n", dev_name, pr->to_lora,
                   l.largest ? l.largest : "-", fmt(a, l.delta), fmt(b, l.work),
                   fmt(c, p->cpu.peak + l.delta + l.work));
        else if (pr->to_lora && p->dev_accelerator)
            printf("adapter: each matrix's change is held in float32 on %s while it is factored at rank %d where it "
                   "fits beside the merge; the largest, %s, %s, does not fit its budget of %s and is held on the host, "
                   "with %s of the factorisation's buffers, beside the merge's peak (about %s in all)\n", dev_name,
                   pr->to_lora, l.largest ? l.largest : "-", fmt(a, l.delta), fmt(d, p->budget), fmt(b, l.work),
                   fmt(c, p->cpu.peak + l.delta + l.work));
        else if (pr->to_lora)
            printf("adapter: each matrix's change is held in float32 while it is factored at rank %d: the largest, "
                   "%s, %s, with %s of the factorisation's buffers, beside the merge's peak (about %s in all)\n",
                   pr->to_lora, l.largest ? l.largest : "-", fmt(a, l.delta), fmt(b, l.work),
                   fmt(c, p->cpu.peak + l.delta + l.work));
        else
            printf("adapter: the inputs' factors concatenated (--to-lora exact): no merge, no factorisation\n");
        if (pr->to_lora)
            printf("output: an adapter of at most %" PRIu64 " bytes of tensors (every matrix at rank %d, every other "
                   "tensor whole, as if each changed); %s free at %s\n", l.bytes, pr->to_lora,
                   p->disk_known ? fmt(a, p->disk_free) : "unknown", p->out_parent);
        else
            printf("output: an adapter the size of the inputs' factors together; %s free at %s\n",
                   p->disk_known ? fmt(a, p->disk_free) : "unknown", p->out_parent);
        return;
    }
    if (pr->vocab_bytes)
        printf("vocabulary: the embeddings are rebuilt to the output's vocabulary in %s of temporary files "
               "beside OUT (at %s, counted below) while the merge runs\n", fmt(a, pr->vocab_bytes), p->out_parent);
    if (p->disk_known)
        printf("output: %" PRIu64 " bytes in %d shard%s; %s free at %s (%s)\n", p->out_bytes, p->n_shards,
               p->n_shards == 1 ? "" : "s", fmt(a, p->disk_free), p->out_parent,
               p->out_bytes + pr->vocab_bytes <= p->disk_free ? "fits" : "does NOT fit");
    else
        printf("output: %" PRIu64 " bytes in %d shard%s; free space at %s unknown\n", p->out_bytes, p->n_shards,
               p->n_shards == 1 ? "" : "s", p->out_parent);
}

// ==== JSON ====================================================================================

static cJSON *tensor_json(const lm_plan_tensor *t, bool accelerator)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "name", t->name);
    cJSON_AddNumberToObject(o, "parts", t->cpu.parts);
    cJSON_AddNumberToObject(o, "slab_elems", (double)t->dev.slab_elems);
    cJSON_AddNumberToObject(o, "device_bytes", (double)t->dev_bytes);
    cJSON_AddNumberToObject(o, "importance_bytes", (double)(t->imp_dev.key_bytes + t->imp_dev.ucc2_bytes));
    cJSON_AddBoolToObject(o, "fits", accelerator ? t->fits : true);
    return o;
}

static void add_u64s(cJSON *o, const char *const *keys, const uint64_t *vals, size_t n)
{
    for (size_t i = 0; i < n; i++)
        cJSON_AddNumberToObject(o, keys[i], (double)vals[i]);
}

static cJSON *capture_json(const lm_plan *p, const lm_plan_capture *c, const char *dev_name)
{
    static const char *cached[] = {"none", "hessians", "ucc2", "masks"};
    cJSON *o = cJSON_CreateObject();
    if (c->ft >= 0)
        cJSON_AddNumberToObject(o, "ft", c->ft + 1);
    else
        cJSON_AddNullToObject(o, "ft");
    cJSON_AddStringToObject(o, "model", c->label);
    cJSON_AddStringToObject(o, "calib", c->calib);
    cJSON_AddNumberToObject(o, "sequences", (double)c->n_seqs);
    cJSON_AddNumberToObject(o, "tokens", (double)c->n_tokens);
    cJSON_AddNumberToObject(o, "longest", (double)c->longest);
    cJSON_AddStringToObject(o, "cached", cached[c->cached]);
    bool runs = c->cached == LM_PLAN_CACHE_NONE;
    cJSON_AddBoolToObject(o, "captured", runs);
    if (runs) {
        cJSON_AddNumberToObject(o, "max_tokens", (double)c->max_tokens);
        cJSON_AddNumberToObject(o, "batches", (double)c->run.n_formed);
        cJSON_AddNumberToObject(o, "largest_batch", (double)c->run.formed_tokens);
        cJSON *w = cJSON_AddObjectToObject(o, "weights");
        cJSON_AddNumberToObject(w, "bytes", (double)c->fwd.weight_bytes);
        cJSON_AddNumberToObject(w, "placing_bytes", (double)c->fwd.placing_peak);
        cJSON_AddNumberToObject(w, "cpu_bytes", (double)c->fwd_cpu.weight_bytes);
        cJSON_AddNumberToObject(w, "input_bytes", (double)c->fwd.mapped_bytes);
        cJSON_AddStringToObject(w, "on", c->weights_on_device ? dev_name : "cpu");
        cJSON_AddBoolToObject(w, "fallback", p->dev_accelerator && !c->weights_on_device);
        if (c->weights_why)
            cJSON_AddStringToObject(w, "why", c->weights_why);
        else
            cJSON_AddNullToObject(w, "why");
        cJSON *h = cJSON_AddObjectToObject(o, "hessians");
        cJSON_AddNumberToObject(h, "count", (double)c->hess.n_acc);
        cJSON_AddNumberToObject(h, "bytes", (double)(c->hess.dev_bytes + c->hess.host_bytes));
        bool on_accel = p->dev_accelerator && c->weights_on_device;
        cJSON_AddNumberToObject(h, "on_device", on_accel ? (double)c->hess.n_dev : 0);
        cJSON_AddNumberToObject(h, "device_bytes", on_accel ? (double)c->hess.dev_bytes : 0);
        cJSON_AddNumberToObject(h, "host_bytes", on_accel ? (double)c->hess.host_bytes
                                                          : (double)(c->hess.dev_bytes + c->hess.host_bytes));
        cJSON *act = cJSON_AddObjectToObject(o, "activations");
        cJSON_AddNumberToObject(act, "largest_batch_bytes", (double)c->arena_bytes);
        cJSON_AddNumberToObject(act, "reserve_bytes", (double)c->reserve);
        if (on_accel) {
            cJSON_AddNumberToObject(act, "available_bytes", (double)c->avail);
            cJSON_AddNumberToObject(act, "fit_tokens", (double)c->fit_tokens);
            cJSON_AddNumberToObject(act, "fit_sequences", (double)(c->fit_tokens / c->longest));
        } else {
            cJSON_AddNullToObject(act, "available_bytes");
            cJSON_AddNullToObject(act, "fit_tokens");
            cJSON_AddNullToObject(act, "fit_sequences");
        }
        cJSON *fb = cJSON_AddArrayToObject(o, "fallbacks");
        for (int64_t i = 0; i < c->n_notes; i++) {
            const lm_plan_capture_note *n = &c->notes[i];
            cJSON *e = cJSON_CreateObject();
            cJSON_AddStringToObject(e, "kind", n->halved ? "halved" : "cpu");
            cJSON_AddNumberToObject(e, "first", (double)(n->first + 1));
            cJSON_AddNumberToObject(e, "last", (double)(n->first + n->n));
            cJSON_AddNumberToObject(e, "tokens", (double)n->tokens);
            cJSON_AddNumberToObject(e, "need_bytes", (double)n->need);
            cJSON_AddItemToArray(fb, e);
        }
        cJSON_AddBoolToObject(o, "sticky", c->run.stuck);
        cJSON_AddNumberToObject(o, "halved", (double)c->run.n_halved);
        cJSON_AddNumberToObject(o, "sequences_on_cpu", (double)c->run.n_seq_cpu);
        cJSON_AddNumberToObject(o, "tokens_on_device", on_accel ? (double)c->run.tokens_dev : 0);
        cJSON_AddNumberToObject(o, "tokens_on_cpu", on_accel ? (double)c->run.tokens_cpu
                                                            : (double)(c->run.tokens_dev + c->run.tokens_cpu));
        if (on_accel)
            cJSON_AddNumberToObject(o, "device_peak_bytes", (double)c->dev_peak);
        else
            cJSON_AddNullToObject(o, "device_peak_bytes");
    }
    cJSON_AddNumberToObject(o, "factor_device_peak_bytes", (double)c->factor_dev_peak);
    cJSON_AddNumberToObject(o, "factor_fallbacks", (double)c->factor_fallbacks);
    const lm_plan_capture_cpu *u = &c->cpu;
    static const char *keys[] = {"peak_bytes", "held", "weights", "device_host", "activations", "accumulators",
                                 "stage", "placing", "capturing", "finishing"};
    uint64_t vals[] = {u->peak, u->held, u->weights, u->device_host, u->activations, u->accumulators,
                       u->stage, u->placing, u->capturing, u->finishing};
    add_u64s(cJSON_AddObjectToObject(o, "cpu"), keys, vals, sizeof vals / sizeof vals[0]);
    return o;
}

static int print_json(const lm_cmd_prepared *pr, const lm_plan *p, const char *dev_name, size_t free_b,
                      size_t total_b, const char *cache_dir, bool looked)
{
    cJSON *root = cJSON_CreateObject();
    cJSON_AddStringToObject(root, "method", pr->method);
    cJSON *d = cJSON_AddObjectToObject(root, "device");
    cJSON_AddStringToObject(d, "name", dev_name);
    cJSON_AddBoolToObject(d, "accelerator", p->dev_accelerator);
    cJSON_AddStringToObject(d, "why", pr->dev_why);
    if (p->dev_accelerator) {
        cJSON_AddNumberToObject(d, "free_bytes", (double)free_b);
        cJSON_AddNumberToObject(d, "total_bytes", (double)total_b);
        cJSON_AddNumberToObject(d, "gpu_mem", (double)pr->gpu_mem);
        cJSON_AddNumberToObject(d, "budget", (double)p->budget);
        cJSON_AddNumberToObject(d, "peak_bytes", (double)p->dev_peak);
    }
    if (p->n_captures > 0) {
        cJSON *k = cJSON_AddObjectToObject(root, "cache");
        if (cache_dir)
            cJSON_AddStringToObject(k, "dir", cache_dir);
        else
            cJSON_AddNullToObject(k, "dir");
        cJSON_AddBoolToObject(k, "looked_up", looked);
        cJSON_AddNumberToObject(k, "bytes", (double)p->cache_bytes);
        if (p->cache_known) {
            cJSON_AddNumberToObject(k, "disk_free", (double)p->cache_free);
            cJSON_AddBoolToObject(k, "fits", p->cache_bytes <= p->cache_free);
        } else {
            cJSON_AddNullToObject(k, "disk_free");
            cJSON_AddNullToObject(k, "fits");
        }
        cJSON *caps = cJSON_AddArrayToObject(root, "capture");
        for (int i = 0; i < p->n_captures; i++)
            cJSON_AddItemToArray(caps, capture_json(p, &p->captures[i], dev_name));
    }
    cJSON *place = cJSON_AddArrayToObject(root, "place");
    for (int i = 0; i < p->n_ft; i++) {
        cJSON *f = cJSON_CreateObject();
        cJSON_AddNumberToObject(f, "ft", i + 1);
        cJSON_AddStringToObject(f, "path", pr->ft_args[i]);
        cJSON_AddStringToObject(f, "kind", pr->fts[i]->adapter ? "adapter" : "model");
        cJSON_AddNumberToObject(f, "bytes", (double)p->ft[i].resident_bytes);
        cJSON_AddStringToObject(f, "on", p->ft[i].on_device ? dev_name : "cpu");
        cJSON_AddBoolToObject(f, "fallback", p->accelerator && pr->fts[i]->adapter && !p->ft[i].on_device);
        cJSON_AddItemToArray(place, f);
    }
    cJSON *m = cJSON_AddObjectToObject(root, "merge");
    cJSON_AddStringToObject(m, "on", p->accelerator ? dev_name : "cpu");
    cJSON_AddNumberToObject(m, "tensors", (double)p->n_tensors);
    cJSON_AddNumberToObject(m, "merged", (double)p->n_merged);
    cJSON_AddNumberToObject(m, "slab_max", (double)p->slab_max);
    cJSON_AddItemToObject(m, "largest", p->largest >= 0 ? tensor_json(&p->tensors[p->largest], p->accelerator)
                                                          : cJSON_CreateNull());
    cJSON_AddItemToObject(m, "largest_fallback", p->largest_fallback >= 0
                          ? tensor_json(&p->tensors[p->largest_fallback], p->accelerator) : cJSON_CreateNull());
    cJSON *fb = cJSON_AddArrayToObject(m, "fallbacks");
    cJSON *units = cJSON_AddArrayToObject(m, "units");
    for (int64_t i = 0; i < p->n_tensors; i++) {
        if (p->tensors[i].cpu.parts == 0)
            continue;
        if (p->accelerator && !p->tensors[i].fits)
            cJSON_AddItemToArray(fb, cJSON_CreateString(p->tensors[i].name));
        cJSON_AddItemToArray(units, tensor_json(&p->tensors[i], p->accelerator));
    }
    const lm_plan_cpu *c = &p->cpu;
    cJSON *cj = cJSON_AddObjectToObject(root, "cpu");
    static const char *keys[] = {
        "peak_bytes", "merge_peak_bytes", "buffers_reserved", "buffers_touched", "importance_reserved",
        "importance_touched", "lora_factors", "adapters_mapped", "out_piece", "out_slab", "histograms",
        "dora_magnitudes", "mapped_inputs", "select", "device_host", "hessian_sets", "masks", "calib", "runtime",
    };
    uint64_t vals[] = {
        p->cpu_peak, c->peak, c->ws_reserved, c->ws_touched, c->keys_reserved,
        c->keys_touched, c->residents, c->adapter_mapped, c->out_host, c->out_slab, c->hist,
        c->mag, c->mapped, c->select, c->device_host, c->hessian_sets, c->masks, c->calib, c->runtime,
    };
    add_u64s(cj, keys, vals, sizeof vals / sizeof vals[0]);
    if (p->cpu_peak_phase >= 0)
        cJSON_AddNumberToObject(cj, "peak_capture", p->cpu_peak_phase);
    else
        cJSON_AddNullToObject(cj, "peak_capture");
    if (pr->to_lora || pr->to_lora_exact) {
        plan_lora l = lora_need(pr);
        cJSON *ad = cJSON_AddObjectToObject(root, "adapter");
        cJSON_AddItemToObject(ad, "rank", pr->to_lora_exact ? cJSON_CreateString("exact")
                                                            : cJSON_CreateNumber(pr->to_lora));
        cJSON_AddItemToObject(ad, "largest", l.largest ? cJSON_CreateString(l.largest) : cJSON_CreateNull());
        cJSON_AddNumberToObject(ad, "delta_bytes", (double)l.delta);
        cJSON_AddNumberToObject(ad, "work_bytes", (double)l.work);
        // the host's peak where the changes are on the host: the CPU's merges, and a device's
        // where a change does not fit beside the merge (it is held on the device otherwise);
        // delta_on: where the largest is held
        cJSON_AddNumberToObject(ad, "cpu_peak", (double)(p->cpu.peak + l.delta + l.work));
        cJSON_AddStringToObject(ad, "delta_on", lora_on_device(p, &l) ? "device" : "host");
        if (pr->to_lora)
            cJSON_AddNumberToObject(ad, "bytes_at_most", (double)l.bytes);
        else
            cJSON_AddNullToObject(ad, "bytes_at_most");
    }
    cJSON *o = cJSON_AddObjectToObject(root, "output");
    cJSON_AddNumberToObject(o, "bytes", (double)p->out_bytes);
    cJSON_AddNumberToObject(o, "shards", p->n_shards);
    cJSON_AddStringToObject(o, "parent", p->out_parent);
    cJSON_AddNumberToObject(o, "vocab_bytes", (double)pr->vocab_bytes);
    if (p->disk_known) {
        cJSON_AddNumberToObject(o, "disk_free", (double)p->disk_free);
        cJSON_AddBoolToObject(o, "fits", p->out_bytes + pr->vocab_bytes <= p->disk_free);
    } else {
        cJSON_AddNullToObject(o, "disk_free");
        cJSON_AddNullToObject(o, "fits");
    }
    char *text = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    if (!text) {
        fprintf(stderr, PREFIX ": out of memory\n");
        return 1;
    }
    printf("%s\n", text);
    free(text);
    return 0;
}

// ==== the command =============================================================================

int lm_cmd_plan(int argc, char **argv)
{
    if (argc < 2 || strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0) {
        usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    // The merge's own arguments, with --json (plan's only option) taken out: argv[1] is the
    // method, which the merge's parser sees as its argv[0].
    char **margv = calloc((size_t)argc, sizeof *margv);
    if (!margv) {
        fprintf(stderr, PREFIX ": out of memory\n");
        return 1;
    }
    int margc = 0;
    bool json = false, options_done = false;
    for (int i = 1; i < argc; i++) {
        if (!options_done && strcmp(argv[i], "--json") == 0) {
            json = true;
            continue;
        }
        if (strcmp(argv[i], "--") == 0)
            options_done = true;
        margv[margc++] = argv[i];
    }
    lm_plan_cached *cached = NULL;
    bool *mask_hit = NULL;
    char *cache_dir = NULL;
    lm_cmd_prepared pr;
    int rc = lm_cmd_merge_prepare(margc, margv, PREFIX, &pr);
    if (rc != 0 || pr.help)
        goto done;

    size_t free_b = 0, total_b = 0;
    lm_dev_mem_info(pr.dev, &free_b, &total_b);
    const char *dev_name = lm_dev_name(pr.dev);
    lm_err err = {0};
    lm_plan_device dev = {.name = dev_name, .host_memory = lm_dev_host_memory(pr.dev), .free_bytes = free_b,
                          .total_bytes = total_b, .cap = pr.gpu_mem,
                          .forward_ops = lm_dev_supports(pr.dev, LM_OP_FORWARD),
                          .importance_ops = lm_dev_supports(pr.dev, LM_OP_IMPORTANCE),
                          .factor_op = lm_dev_supports(pr.dev, LM_OP_POTRF)};
    lm_plan_hess_in hin = {.calib = pr.calib, .n_calib = pr.n_calib, .from_base = pr.hessian_from_base,
                           .sticky = pr.sticky, .keep_hessians = lm_cache_keeps_hessians()};
    bool looked = false;
    lm_status s = LM_OK;
    if (pr.n_calib > 0) {
        int n = pr.hessian_from_base ? 1 : pr.opts->n_ft;
        cache_dir = lm_cache_dir(pr.cache_dir);
        if (!(cached = calloc((size_t)n, sizeof *cached)) ||
            !(mask_hit = calloc((size_t)pr.opts->n_ft, sizeof *mask_hit))) {
            fprintf(stderr, PREFIX ": out of memory\n");
            rc = 1;
            goto done;
        }
        if ((s = lookup_cache(&pr, cache_dir, cached, n, mask_hit, &looked, &err)) != LM_OK) {
            rc = lm_status_exit_code(s);
            fprintf(stderr, PREFIX ": error: looking in the cache: %s\n", err.msg);
            goto done;
        }
        hin.cached = cached;
        hin.mask_hit = mask_hit;
        hin.cache_dir = cache_dir;
    }
    lm_plan p;
    s = lm_plan_make(&p, pr.opts, pr.base, pr.fts, &dev, pr.n_calib > 0 ? &hin : NULL, pr.shard_size, pr.out, &err);
    if (s != LM_OK) {
        rc = lm_status_exit_code(s);
        fprintf(stderr, PREFIX ": error: %s\n", err.msg);
        goto done;
    }
    if (json)
        rc = print_json(&pr, &p, dev_name, free_b, total_b, cache_dir, looked);
    else
        print_text(&pr, &p, dev_name, free_b, total_b, cache_dir, looked);
    lm_plan_free(&p);
done:
    free(cached);
    free(mask_hit);
    free(cache_dir);
    lm_cmd_merge_release(&pr);
    free(margv);
    return rc;
}
