// Planning a merge: see plan.h. Every size comes from the engine's own rules through
// lm_merge_plan_*, lm_fwd_plan_* and lm_hess_plan_make; this file only adds them up the way a
// run holds them at once.
#include "plan.h"

#include <stdlib.h>
#include <string.h>
#include <sys/statvfs.h>

#include "device.h"
#include "hasher.h"
#include "method.h"
#include "sparsify.h"
#include "util.h"

void lm_plan_free(lm_plan *p)
{
    if (!p)
        return;
    for (int i = 0; p->captures && i < p->n_captures; i++)
        free(p->captures[i].notes);
    free(p->captures);
    free(p->ft);
    free(p->tensors);
    free(p->out_parent);
    memset(p, 0, sizeof *p);
}

static uint64_t max_u64(uint64_t a, uint64_t b)
{
    return a > b ? a : b;
}

static bool is_sim(const lm_plan_device *dev)
{
    return dev->name && strncmp(dev->name, "sim:", 4) == 0;
}

// The bytes available to an unprivileged writer at `dir`, or at its nearest existing ancestor
// (a cache directory the merge will create). False when none can be asked.
static bool free_space(const char *dir, uint64_t *out)
{
    char *d = lm_strfmt("%s", dir);
    for (int depth = 0; d && depth < 64; depth++) {
        struct statvfs vfs;
        if (statvfs(d, &vfs) == 0) {
            *out = (uint64_t)vfs.f_bavail * (uint64_t)vfs.f_frsize;
            free(d);
            return true;
        }
        char *up = lm_path_parent(d);
        bool top = !up || strcmp(up, d) == 0;
        free(d);
        d = up;
        if (top)
            break;
    }
    free(d);
    return false;
}

// The adapter's tensor bytes the merge reads from its mapping and never lets go: the factors
// (read once, when placed), biases, DoRA magnitudes and saved tensors.
static uint64_t adapter_mapped(const lm_ft *ft)
{
    const lm_adapter *a = ft->adapter;
    uint64_t n = 0;
    for (int64_t m = 0; a && m < a->n_modules; m++) {
        const lm_lora_module *mod = &a->modules[m];
        n += (mod->a ? mod->a->nbytes : 0) + (mod->b ? mod->b->nbytes : 0) +
             (mod->bias ? mod->bias->nbytes : 0) + (mod->magnitude ? mod->magnitude->nbytes : 0);
    }
    for (int64_t s = 0; a && s < a->n_saved; s++)
        n += a->saved[s].t->nbytes;
    return n;
}

// ==== sparsegpt's Hessians ====================================================================

// The plan's answers to the engine's questions: a U_cc² set non-NULL exactly where a run's has
// one to give (every FT has one, captured or cached), by lm_hess_point_of and the widths; a
// stored mask for every tensor of an FT whose masks the cache holds (the merge takes an entry
// only when it covers them all). Neither is ever read.
typedef struct hess_ctx {
    int64_t n_layers;
    int64_t dim[LM_FWD_N_POINTS];
    const bool *mask_hit;  // (n_ft) or NULL
} hess_ctx;

static const double *plan_ucc2(void *ctx, int ft, const char *tensor, int64_t cols)
{
    static const double present = 1.0;
    const hess_ctx *h = ctx;
    int64_t layer;
    lm_fwd_point point;
    (void)ft;
    if (!lm_hess_point_of(tensor, &layer, &point) || layer >= h->n_layers || h->dim[point] != cols)
        return NULL;
    return &present;
}

static const uint8_t *plan_mask(void *ctx, int ft, const char *tensor, int64_t numel)
{
    static const uint8_t present = 0xff;
    const hess_ctx *h = ctx;
    (void)tensor;
    (void)numel;
    return h->mask_hit && h->mask_hit[ft] ? &present : NULL;
}

// The bytes of the accumulators (and of a Hessian entry in the cache) of a model.
static uint64_t hessian_bytes(const hess_ctx *h)
{
    uint64_t n = 0;
    for (int k = 0; k < LM_FWD_N_POINTS; k++)
        n += (uint64_t)h->dim[k] * (uint64_t)h->dim[k];
    return n * (uint64_t)h->n_layers * sizeof(float);
}

// The bytes of one U_cc² set: a double per input of every (layer, point).
static uint64_t ucc2_set_bytes(const hess_ctx *h)
{
    uint64_t n = 0;
    for (int k = 0; k < LM_FWD_N_POINTS; k++)
        n += (uint64_t)h->dim[k];
    return n * (uint64_t)h->n_layers * sizeof(double);
}

// The bytes the merge keeps of the calibration files: ids, offsets and line numbers, and
// (while a model's Hessians are computed) its sequence list.
static uint64_t calib_bytes(const lm_plan_hess_in *hin)
{
    uint64_t n = 0, most = 0;
    for (int i = 0; i < hin->n_calib; i++) {
        const lm_calib *c = &hin->calib[i];
        n += (uint64_t)c->n_tokens * sizeof(int32_t) + (uint64_t)(2 * c->n_seqs + 1) * sizeof(int64_t);
        most = max_u64(most, (uint64_t)c->n_seqs * sizeof(lm_fwd_seq));
    }
    return n + most;
}

// Collects the runner's fallbacks into a capture's notes.
typedef struct note_ctx {
    lm_plan_capture *c;
    int64_t cap;
    bool nomem;
} note_ctx;

static void on_note(void *ctx, const lm_fwd_plan_note *n)
{
    note_ctx *nc = ctx;
    lm_plan_capture *c = nc->c;
    if (nc->nomem)
        return;
    if (c->n_notes == nc->cap) {
        int64_t cap = nc->cap ? 2 * nc->cap : 16;
        lm_plan_capture_note *p = realloc(c->notes, (size_t)cap * sizeof *p);
        if (!p) {
            nc->nomem = true;
            return;
        }
        c->notes = p;
        nc->cap = cap;
    }
    c->notes[c->n_notes++] = *n;
}

// What lm_hess_ucc2_model does for one model (with adapter a, or NULL) on the calibration
// file `cal`: places the weights (on the device, or on the CPU when they do not fit), the
// accumulators beside them, and runs the batches; `held` is the host memory the process holds
// throughout (cpu figures include it).
static lm_status plan_capture(lm_plan_capture *c, const lm_model *m, const lm_adapter *a, const lm_calib *cal,
                              const lm_plan_device *dev, uint64_t budget, bool sticky, uint64_t held, lm_err *err)
{
    c->n_seqs = cal->n_seqs;
    c->n_tokens = cal->n_tokens;
    c->max_tokens = lm_fwd_plan_max_tokens(0);  // lm_hess_ucc2_model's runner takes the default
    int64_t *lens = malloc((size_t)(cal->n_seqs > 0 ? cal->n_seqs : 1) * sizeof *lens);
    if (!lens)
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    for (int64_t i = 0; i < cal->n_seqs; i++) {
        lens[i] = cal->offsets[i + 1] - cal->offsets[i];
        c->longest = lens[i] > c->longest ? lens[i] : c->longest;
    }
    lm_status s;
    bool accel = !dev->host_memory;
    // the factorisations try the accelerator once the forward pass has let go of it
    lm_hess_plan_factor f = {.budget = accel && dev->factor_op ? budget : 0, .host_copy = accel && is_sim(dev)};
    if ((s = lm_fwd_plan_make(&c->fwd_cpu, m, a, true, err)) != LM_OK ||
        (s = lm_fwd_plan_make(&c->fwd, m, a, dev->host_memory, err)) != LM_OK) {
        free(lens);
        return lm_err_prefix(err, "%s", c->label);
    }
    int64_t dim[LM_FWD_N_POINTS];
    lm_hess_dims(&m->config, dim);
    lm_plan_capture_cpu *u = &c->cpu;
    u->held = held;
    if (c->cached == LM_PLAN_CACHE_UCC2 || c->cached == LM_PLAN_CACHE_MASKS) {
        free(lens);
        u->peak = held;
        return LM_OK;
    }
    if (c->cached == LM_PLAN_CACHE_HESS) {
        // no forward pass: each Hessian read back and turned into U_cc² in turn
        free(lens);
        if ((s = lm_hess_plan_make(&c->hess, m, false, true, 0, 0, err)) != LM_OK)
            return s;
        c->hess.n_acc = 0;  // no accumulators: each Hessian comes from the cache in turn
        c->hess.host_bytes = 0;
        u->finishing = held + lm_hess_plan_finish(&c->hess, m, false, false, &f);
        c->factor_dev_peak = f.dev_peak;
        c->factor_fallbacks = f.fallbacks;
        u->peak = u->finishing;
        return LM_OK;
    }

    // the weights: on the device asked for, unless an accelerator lacks the operations or room
    c->weights_on_device = !accel || (dev->forward_ops && c->fwd.placing_peak <= budget);
    if (accel && !dev->forward_ops)
        c->weights_why = "the device has no forward-pass operations";
    else if (accel && !c->weights_on_device)
        c->weights_why = "they do not fit";
    const lm_fwd_plan *w = c->weights_on_device ? &c->fwd : &c->fwd_cpu;  // where they run
    uint64_t free_after = accel && c->weights_on_device ? budget - w->weight_bytes : 0;
    if (c->weights_on_device) {
        size_t r = lm_fwd_plan_arena_bytes(w, lm_hess_reserve_tokens(c->n_tokens, c->longest, c->max_tokens));
        c->reserve = r == SIZE_MAX ? 0 : r;
    }
    if ((s = lm_hess_plan_make(&c->hess, m, c->weights_on_device, dev->host_memory, free_after, c->reserve, err)) !=
        LM_OK) {
        free(lens);
        return s;
    }
    bool on_accel = accel && c->weights_on_device;
    c->avail = on_accel ? free_after - c->hess.dev_bytes : UINT64_MAX;
    note_ctx nc = {.c = c};
    lm_fwd_plan_runner(w, lens, c->n_seqs, c->max_tokens, c->weights_on_device, c->avail, sticky, on_note, &nc,
                       &c->run);
    free(lens);
    if (nc.nomem)
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    size_t ab = lm_fwd_plan_arena_bytes(w, c->run.formed_tokens);
    c->arena_bytes = ab == SIZE_MAX ? UINT64_MAX : ab;
    // the largest batch that fits beside the weights and accumulators, up to the largest formed
    int64_t most = c->max_tokens > c->longest ? c->max_tokens : c->longest;
    if (!on_accel) {
        c->fit_tokens = c->weights_on_device ? most : 0;
    } else {
        int64_t lo = 0, hi = most;
        while (lo < hi) {
            int64_t mid = lo + (hi - lo + 1) / 2;
            size_t need = lm_fwd_plan_arena_bytes(w, mid);
            if (need != SIZE_MAX && need <= c->avail)
                lo = mid;
            else
                hi = mid - 1;
        }
        c->fit_tokens = lo;
    }
    uint64_t dev_arena = c->run.dev_tokens > 0 ? lm_fwd_plan_arena_bytes(w, c->run.dev_tokens) : 0;
    if (on_accel)
        c->dev_peak = w->weight_bytes + c->hess.dev_bytes + dev_arena;

    // host memory
    uint64_t ints = 4 * sizeof(int32_t);  // per token: ids, positions, starts, targets
    bool cpu_runs = !c->weights_on_device || c->run.n_seq_cpu > 0;
    if (!accel) {
        u->weights = w->weight_bytes;
        u->activations = lm_fwd_plan_arena_touched(w, c->run.dev_tokens) + ints * (uint64_t)c->run.dev_tokens;
        u->accumulators = c->hess.dev_bytes + c->hess.host_bytes;
    } else {
        u->weights = cpu_runs ? c->fwd_cpu.weight_bytes : 0;
        u->activations = (cpu_runs ? lm_fwd_plan_arena_touched(&c->fwd_cpu, c->run.cpu_tokens) : 0) +
                         ints * (uint64_t)(c->run.cpu_tokens + c->run.dev_tokens);
        // a batch run on the CPU adds into host-side accumulators of its own for every input
        u->accumulators = c->hess.host_bytes + (on_accel && c->run.n_seq_cpu > 0 ? c->hess.dev_bytes : 0);
        if (on_accel && is_sim(dev))
            u->device_host = w->weight_bytes + c->hess.dev_bytes + lm_fwd_plan_arena_touched(w, c->run.dev_tokens);
        // a device batch is copied to the host for each input whose accumulator is there
        int64_t widest = 0;
        for (int64_t i = c->hess.n_dev; on_accel && i < c->hess.n_acc; i++)
            widest = dim[i % LM_FWD_N_POINTS] > widest ? dim[i % LM_FWD_N_POINTS] : widest;
        u->stage = (uint64_t)c->run.dev_tokens * (uint64_t)widest * sizeof(float);
    }
    // placing: the weights in host memory (the CPU's, or a simulated device's) and a host copy
    u->placing = held + (!on_accel || is_sim(dev) ? w->weight_bytes : 0) + w->host_scratch;
    u->capturing = held + u->weights + u->device_host + u->activations + u->accumulators + u->stage;
    // finishing: the runner's weights and arenas are freed; the accumulators go one by one
    u->finishing = held + u->stage +
                   lm_hess_plan_finish(&c->hess, m, !accel || is_sim(dev), on_accel && c->run.n_seq_cpu > 0, &f);
    c->factor_dev_peak = f.dev_peak;
    c->factor_fallbacks = f.fallbacks;
    u->peak = max_u64(u->placing, max_u64(u->capturing, u->finishing));
    return LM_OK;
}

// The captures the merge runs, in its order (sparsegpt_inputs): each FT's model (its own, or the
// base with its adapter) on its calibration file, or the base once on the first file. Returns
// the input pages the captures leave mapped (the models' files as read; adapters are counted
// with the merge's own).
static lm_status plan_captures(lm_plan *p, const lm_model *base, lm_ft *const *fts, const lm_plan_device *dev,
                               const lm_plan_hess_in *hin, const hess_ctx *hc, uint64_t *left_mapped, lm_err *err)
{
    int n = hin->from_base ? 1 : p->n_ft;
    *left_mapped = 0;
    if (!(p->captures = calloc((size_t)(n > 0 ? n : 1), sizeof *p->captures)))
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    p->n_captures = n;
    // input pages read by earlier captures, per model: the base, then each full FT's
    bool *seen = calloc((size_t)p->n_ft + 1, sizeof *seen);
    if (!seen)
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    uint64_t held = LM_PLAN_RUNTIME_BYTES + calib_bytes(hin);
    lm_status s = LM_OK;
    for (int i = 0; i < n && s == LM_OK; i++) {
        lm_plan_capture *c = &p->captures[i];
        const lm_ft *ft = hin->from_base ? NULL : fts[i];
        const lm_model *m = ft && ft->model ? ft->model : base;
        const lm_adapter *a = ft ? ft->adapter : NULL;
        const lm_calib *cal = &hin->calib[hin->n_calib == 1 ? 0 : i];
        c->ft = ft ? i : -1;
        c->label = ft ? ft->path : base->dir;
        c->calib = cal->path;
        c->cached = hin->cached ? hin->cached[i] : LM_PLAN_CACHE_NONE;
        // the Hessians are not needed when every FT they serve has its masks in the cache
        bool needed = !hin->cache_dir || !hin->mask_hit;
        for (int j = 0; !needed && j < p->n_ft; j++)
            needed = (hin->from_base || j == i) && !hin->mask_hit[j];
        if (!needed)
            c->cached = LM_PLAN_CACHE_MASKS;
        // what goes into the cache: the Hessians of a capture, and U_cc² unless they came from it
        if (hin->cache_dir && c->cached == LM_PLAN_CACHE_NONE && hin->keep_hessians)
            p->cache_bytes += hessian_bytes(hc);
        if (hin->cache_dir && (c->cached == LM_PLAN_CACHE_NONE || c->cached == LM_PLAN_CACHE_HESS))
            p->cache_bytes += ucc2_set_bytes(hc);
        // the pages this capture reads come into memory while it places the weights
        int which = ft && ft->model ? 1 + i : 0;
        lm_fwd_plan bare;
        bool reads = c->cached == LM_PLAN_CACHE_NONE;
        uint64_t model_pages = 0, adapter_pages = 0;
        if (reads) {
            if ((s = lm_fwd_plan_make(&bare, m, NULL, true, err)) != LM_OK)
                break;
            model_pages = seen[which] ? 0 : bare.mapped_bytes;
            adapter_pages = a ? adapter_mapped(ft) : 0;
            seen[which] = true;
            *left_mapped += model_pages;
        }
        s = plan_capture(c, m, a, cal, dev, p->budget, hin->sticky, held + model_pages + adapter_pages, err);
        held += model_pages + adapter_pages + (c->cached == LM_PLAN_CACHE_MASKS ? 0 : ucc2_set_bytes(hc));
    }
    free(seen);
    return s;
}

// ==== the plan ================================================================================

lm_status lm_plan_make(lm_plan *p, const lm_merge_opts *o, const lm_model *base, lm_ft *const *fts,
                       const lm_plan_device *dev, const lm_plan_hess_in *hin, uint64_t shard_size, const char *out,
                       lm_err *err)
{
    memset(p, 0, sizeof *p);
    lm_status s = lm_merge_check_opts(o, err);
    if (s == LM_OK)
        s = lm_merge_check_params(o, base, fts, err);
    if (s != LM_OK)
        return s;
    // a method that ranks by Hessian importance (sparsegpt) captures Hessians first
    const lm_method *m = lm_method_of(o->method);
    bool hessians = m->rank == LM_RANK_IMPORTANCE;
    if (hessians && (!hin || hin->n_calib < 1))
        return lm_err_set(err, LM_ERR_USAGE, "%s needs calibration data: --calib FILE (once, or once per FT)", m->name);
    lm_st_desc *descs = NULL;
    int64_t n_out = 0;
    lm_shard_plan shards = {0};
    uint64_t *tau_touch = NULL, *key_touch = NULL;
    lm_dev *cpu_dev = NULL, *acc_dev = NULL;
    // the plan's options: for sparsegpt, U_cc² present where a run has a Hessian
    hess_ctx hc = {.n_layers = base->config.num_hidden_layers, .mask_hit = hin ? hin->mask_hit : NULL};
    lm_hess_dims(&base->config, hc.dim);
    lm_merge_opts so = *o;
    if (hessians) {
        so.ucc2 = plan_ucc2;
        so.ucc2_ctx = &hc;
        so.mask_load = plan_mask;
        so.mask_ctx = &hc;
    }
    o = &so;
    p->dev_accelerator = !dev->host_memory;
    // a device without the importance operations leaves sparsegpt's merge to the CPU
    p->accelerator = !dev->host_memory && (!hessians || dev->importance_ops);
    p->budget = dev->cap && dev->cap < dev->free_bytes ? dev->cap : dev->free_bytes;
    p->n_ft = o->n_ft;
    p->n_tensors = base->n_tensors;
    p->largest = p->largest_fallback = -1;
    p->cpu_peak_phase = -1;
    p->ft = calloc((size_t)(o->n_ft > 0 ? o->n_ft : 1), sizeof *p->ft);
    p->tensors = calloc((size_t)(base->n_tensors > 0 ? base->n_tensors : 1), sizeof *p->tensors);
    tau_touch = calloc((size_t)(o->n_ft > 0 ? o->n_ft : 1), sizeof *tau_touch);
    key_touch = calloc((size_t)(o->n_ft > 0 ? o->n_ft : 1), sizeof *key_touch);
    p->out_parent = lm_path_parent(out);
    if (!p->ft || !p->tensors || !tau_touch || !key_touch || !p->out_parent) {
        s = lm_err_set(err, LM_ERR_NOMEM, "out of memory");
        goto fail;
    }

    // capture (sparsegpt): before the merge, on the device asked for
    uint64_t capture_mapped = 0;
    if (hessians && (s = plan_captures(p, base, fts, dev, hin, &hc, &capture_mapped, err)) != LM_OK)
        goto fail;

    // place: every adapter's factors in host memory, then on the device in FT order while
    // they fit beside the ones placed before
    lm_plan_cpu *c = &p->cpu;
    for (int i = 0; i < o->n_ft; i++) {
        lm_plan_ft *f = &p->ft[i];
        f->resident_bytes = lm_merge_plan_resident_bytes(fts[i]);
        c->residents += f->resident_bytes;
        c->adapter_mapped += adapter_mapped(fts[i]);
        if (!p->accelerator || !fts[i]->adapter)
            continue;
        if (f->resident_bytes <= p->budget - p->placed_bytes) {
            f->on_device = true;
            p->placed_bytes += f->resident_bytes;
        } else {
            p->n_place_fallback++;
        }
    }
    p->dev_peak = p->placed_bytes;

    // merge (and select): one unit per tensor some FT changes, sized on the CPU device and, for
    // an accelerator, on a simulated one with its budget (the sizing reads what kind of device
    // it is, never its memory)
    if ((s = lm_dev_cpu_create(&cpu_dev, 1, err)) != LM_OK ||
        (p->accelerator && (s = lm_dev_sim_create(&acc_dev, p->budget ? p->budget : 1, NULL, 1, err)) != LM_OK))
        goto fail;
    p->slab_max = lm_merge_plan_slab_max(o, base);
    bool cpu_used = !p->accelerator;  // the CPU's buffers exist from the start on the CPU
    uint64_t base_touch = 0, var_touch = 0, dev_host = p->placed_bytes, masks_loaded = 0, masks_recorded = 0;
    for (int64_t i = 0; i < base->n_tensors; i++) {
        lm_plan_tensor *t = &p->tensors[i];
        t->name = base->tensors[i]->name;
        if ((s = lm_merge_plan_tensor(o, base, fts, i, cpu_dev, &t->cpu)) != LM_OK ||
            (p->accelerator && (s = lm_merge_plan_tensor(o, base, fts, i, acc_dev, &t->dev)) != LM_OK) ||
            (s = lm_merge_plan_importance(o, base, fts, i, cpu_dev, &t->imp_cpu)) != LM_OK ||
            (p->accelerator && (s = lm_merge_plan_importance(o, base, fts, i, acc_dev, &t->imp_dev)) != LM_OK)) {
            s = lm_err_set(err, LM_ERR_NOMEM, "out of memory");
            goto fail;
        }
        if (!p->accelerator) {
            t->dev = t->cpu;
            t->imp_dev = t->imp_cpu;
        }
        if (t->cpu.parts == 0 || base->tensors[i]->numel == 0) {
            cpu_used = true;  // copied on the CPU
            base_touch = max_u64(base_touch, (uint64_t)t->cpu.copy_elems * sizeof(float));
            continue;
        }
        p->n_merged++;
        t->dev_bytes = t->dev.ws_bytes + t->dev.mag_bytes + t->imp_dev.key_bytes + t->imp_dev.ucc2_bytes;
        if (p->largest < 0 || t->dev_bytes > p->tensors[p->largest].dev_bytes)
            p->largest = i;
        // where the unit runs decides which buffers it fills
        const lm_merge_need *where = &t->cpu;
        if (p->accelerator) {
            t->fits = t->dev_bytes <= p->budget - p->placed_bytes;
            if (t->fits) {
                where = NULL;
                p->dev_peak = max_u64(p->dev_peak, p->placed_bytes + t->dev_bytes);
                dev_host = max_u64(dev_host, p->placed_bytes + t->dev_bytes);
                // a LoRA part whose factors stayed on the CPU makes its product there
                for (int f = 0; f < o->n_ft; f++)
                    if (fts[f]->adapter && !p->ft[f].on_device && (t->dev.part_mask >> (f < 63 ? f : 63) & 1)) {
                        cpu_used = true;
                        tau_touch[f] = max_u64(tau_touch[f], (uint64_t)t->dev.slab_elems * sizeof(float));
                    }
            } else {
                p->n_fallback++;
                if (p->largest_fallback < 0 || t->dev_bytes > p->tensors[p->largest_fallback].dev_bytes)
                    p->largest_fallback = i;
                cpu_used = true;
            }
        }
        if (where) {
            uint64_t slab = (uint64_t)where->slab_elems * sizeof(float);
            uint64_t touched = (uint64_t)where->touched_elems * sizeof(float);
            base_touch = max_u64(base_touch, touched);
            var_touch = max_u64(var_touch, (uint64_t)where->var_elems * sizeof(float));
            for (int f = 0; f < o->n_ft; f++) {
                if (where->part_mask >> (f < 63 ? f : 63) & 1)
                    tau_touch[f] = max_u64(tau_touch[f], touched);
                if (t->imp_cpu.part_mask >> (f < 63 ? f : 63) & 1)
                    key_touch[f] = max_u64(key_touch[f], slab);
            }
            c->mag = max_u64(c->mag, where->mag_bytes);
        }
        // sparsegpt: the masks of the FTs the cache holds them for, read whole; the others'
        // recorded for the cache as each tensor is merged
        if (hessians) {
            uint64_t bits = (uint64_t)lm_dev_mask_bytes(base->tensors[i]->numel), recorded = 0;
            for (int f = 0; f < o->n_ft; f++) {
                if (!(t->cpu.part_mask >> (f < 63 ? f : 63) & 1))
                    continue;
                if (hc.mask_hit && hc.mask_hit[f]) {
                    masks_loaded += bits;
                } else {
                    recorded += bits;
                    if (hin->cache_dir)
                        p->cache_bytes += bits;
                }
            }
            masks_recorded = max_u64(masks_recorded, recorded);
        }
        // histograms are host memory wherever the unit runs; the inputs are mapped either way
        c->hist = max_u64(c->hist, t->cpu.hist_touched);
        c->mapped = max_u64(c->mapped, where ? where->mapped_bytes : t->dev.mapped_bytes);
    }
    if (cpu_used) {
        // base, one τ per FT, and sce's variances (written where a mask applies)
        bool sce = lm_method_of(o->method)->sce;
        c->ws_reserved = (uint64_t)(1 + o->n_ft + sce) * (uint64_t)p->slab_max * sizeof(float);
        c->ws_touched = base_touch + var_touch;
        for (int f = 0; f < o->n_ft; f++)
            c->ws_touched += tau_touch[f];
        // sparsegpt: the CPU's buffers have an importance buffer per FT besides
        if (hessians) {
            c->keys_reserved = (uint64_t)o->n_ft * (uint64_t)p->slab_max * sizeof(float);
            for (int f = 0; f < o->n_ft; f++)
                c->keys_touched += key_touch[f];
        }
    }
    c->out_host = lm_merge_plan_out_piece();
    c->out_slab = p->accelerator ? (uint64_t)p->slab_max * sizeof(float) : 0;
    if (lm_merge_plan_selects(o))
        c->select = 2ull * (uint64_t)o->n_ft * LM_HIST_BINS * sizeof(uint64_t);
    c->device_host = is_sim(dev) ? dev_host : 0;
    if (hessians) {
        // the U_cc² sets and the calibration data stay to the end; the models' pages the captures
        // read are still mapped when the merge starts, and it lets them go tensor by tensor
        for (int i = 0; i < p->n_captures; i++)
            c->hessian_sets += p->captures[i].cached == LM_PLAN_CACHE_MASKS ? 0 : ucc2_set_bytes(&hc);
        c->calib = calib_bytes(hin);
        c->mapped = max_u64(c->mapped, capture_mapped);
        c->masks = masks_loaded + masks_recorded;
        if (hin->cache_dir)
            p->cache_known = free_space(hin->cache_dir, &p->cache_free);
    }
    c->runtime = LM_PLAN_RUNTIME_BYTES + LM_HASHER_WINDOW;  // and the input hasher's mapped window
    c->peak = c->ws_touched + c->keys_touched + c->residents + c->adapter_mapped + c->out_host + c->out_slab +
              c->hist + c->mag + c->mapped + c->select + c->device_host + c->hessian_sets + c->masks + c->calib +
              c->runtime;
    p->cpu_peak = c->peak;
    for (int i = 0; i < p->n_captures; i++)
        if (p->captures[i].cpu.peak > p->cpu_peak) {
            p->cpu_peak = p->captures[i].cpu.peak;
            p->cpu_peak_phase = i;
        }

    // output: the writer's shard rule over the merge's output descriptors
    if ((s = lm_merge_outputs(o, base, &descs, &n_out, err)) != LM_OK)
        goto fail;
    if ((s = lm_shard_plan_make(&shards, descs, n_out, shard_size, err)) != LM_OK)
        goto fail;
    p->out_bytes = shards.total_size;
    p->n_shards = shards.n_shards;
    struct statvfs vfs;
    if (statvfs(p->out_parent, &vfs) == 0) {
        p->disk_known = true;
        p->disk_free = (uint64_t)vfs.f_bavail * (uint64_t)vfs.f_frsize;
    }
    lm_shard_plan_free(&shards);
    free(descs);
    free(tau_touch);
    free(key_touch);
    lm_dev_destroy(acc_dev);
    lm_dev_destroy(cpu_dev);
    return LM_OK;
fail:
    lm_dev_destroy(acc_dev);
    lm_dev_destroy(cpu_dev);
    lm_shard_plan_free(&shards);
    free(descs);
    free(tau_touch);
    free(key_touch);
    lm_plan_free(p);
    return s;
}
