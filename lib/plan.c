// Planning a merge: see plan.h. Every size comes from the engine's own rules through
// lm_merge_plan_*; this file only adds them up the way a run holds them at once.
#include "plan.h"

#include <stdlib.h>
#include <string.h>
#include <sys/statvfs.h>

#include "sparsify.h"
#include "util.h"

void lm_plan_free(lm_plan *p)
{
    if (!p)
        return;
    free(p->ft);
    free(p->tensors);
    free(p->out_parent);
    memset(p, 0, sizeof *p);
}

char *lm_plan_parent(const char *out)
{
    size_t len = strlen(out);
    while (len > 1 && out[len - 1] == '/')  // "a/b/" names "a/b"
        len--;
    size_t cut = len;
    while (cut > 0 && out[cut - 1] != '/')
        cut--;
    if (cut == 0)
        return lm_strfmt(".");
    if (cut == 1)
        return lm_strfmt("/");
    return lm_strfmt("%.*s", (int)(cut - 1), out);
}

static uint64_t max_u64(uint64_t a, uint64_t b)
{
    return a > b ? a : b;
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

lm_status lm_plan_make(lm_plan *p, const lm_merge_opts *o, const lm_model *base, lm_ft *const *fts,
                       const lm_plan_device *dev, uint64_t shard_size, const char *out, lm_err *err)
{
    memset(p, 0, sizeof *p);
    lm_status s = lm_merge_check_opts(o, err);
    if (s != LM_OK)
        return s;
    lm_st_desc *descs = NULL;
    int64_t n_out = 0;
    lm_shard_plan shards = {0};
    uint64_t *tau_touch = NULL;
    p->accelerator = !dev->host_memory;
    p->budget = dev->cap && dev->cap < dev->free_bytes ? dev->cap : dev->free_bytes;
    p->n_ft = o->n_ft;
    p->n_tensors = base->n_tensors;
    p->largest = p->largest_fallback = -1;
    p->ft = calloc((size_t)(o->n_ft > 0 ? o->n_ft : 1), sizeof *p->ft);
    p->tensors = calloc((size_t)(base->n_tensors > 0 ? base->n_tensors : 1), sizeof *p->tensors);
    tau_touch = calloc((size_t)(o->n_ft > 0 ? o->n_ft : 1), sizeof *tau_touch);
    p->out_parent = lm_plan_parent(out);
    if (!p->ft || !p->tensors || !tau_touch || !p->out_parent) {
        s = lm_err_set(err, LM_ERR_NOMEM, "out of memory");
        goto fail;
    }

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

    // merge (and select): one unit per tensor some FT changes
    p->slab_max = lm_merge_plan_slab_max(o, base);
    bool cpu_used = !p->accelerator;  // the CPU's buffers exist from the start on the CPU
    uint64_t base_touch = 0, dev_host = p->placed_bytes;
    for (int64_t i = 0; i < base->n_tensors; i++) {
        lm_plan_tensor *t = &p->tensors[i];
        t->name = base->tensors[i]->name;
        if ((s = lm_merge_plan_tensor(o, base, fts, i, true, &t->cpu)) != LM_OK ||
            (p->accelerator && (s = lm_merge_plan_tensor(o, base, fts, i, false, &t->dev)) != LM_OK)) {
            s = lm_err_set(err, LM_ERR_NOMEM, "out of memory");
            goto fail;
        }
        if (!p->accelerator)
            t->dev = t->cpu;
        if (t->cpu.parts == 0 || base->tensors[i]->numel == 0) {
            cpu_used = true;  // copied on the CPU
            base_touch = max_u64(base_touch, (uint64_t)t->cpu.copy_elems * sizeof(float));
            continue;
        }
        p->n_merged++;
        t->dev_bytes = t->dev.ws_bytes + t->dev.mag_bytes;
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
            base_touch = max_u64(base_touch, slab);
            for (int f = 0; f < o->n_ft; f++)
                if (where->part_mask >> (f < 63 ? f : 63) & 1)
                    tau_touch[f] = max_u64(tau_touch[f], slab);
            c->mag = max_u64(c->mag, where->mag_bytes);
        }
        // histograms are host memory wherever the unit runs; the inputs are mapped either way
        c->hist = max_u64(c->hist, t->cpu.hist_touched);
        c->mapped = max_u64(c->mapped, where ? where->mapped_bytes : t->dev.mapped_bytes);
    }
    if (cpu_used) {
        c->ws_reserved = (uint64_t)(1 + o->n_ft) * (uint64_t)p->slab_max * sizeof(float);
        c->ws_touched = base_touch;
        for (int f = 0; f < o->n_ft; f++)
            c->ws_touched += tau_touch[f];
    }
    c->out_host = lm_merge_plan_out_piece();
    c->out_slab = p->accelerator ? (uint64_t)p->slab_max * sizeof(float) : 0;
    if (lm_merge_plan_selects(o))
        c->select = 2ull * (uint64_t)o->n_ft * LM_HIST_BINS * sizeof(uint64_t);
    c->device_host = dev->name && strncmp(dev->name, "sim:", 4) == 0 ? dev_host : 0;
    c->runtime = LM_PLAN_RUNTIME_BYTES;
    c->peak = c->ws_touched + c->residents + c->adapter_mapped + c->out_host + c->out_slab + c->hist + c->mag +
              c->mapped + c->select + c->device_host + c->runtime;

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
    return LM_OK;
fail:
    lm_shard_plan_free(&shards);
    free(descs);
    free(tau_touch);
    lm_plan_free(p);
    return s;
}
