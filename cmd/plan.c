// `llmerge plan METHOD BASE FT [FT...] -o OUT [merge options] [--json]`: what the merge with
// the same arguments will need, before anything runs. The arguments go through the merge's
// own parsing and preparation (lm_cmd_merge_prepare: the same checks, the same exit status 2
// for bad ones, the same device opened, so `--device auto` plans for what auto opens); then
// lm_plan_make reads the headers and the device's free memory, and this file prints, per
// phase: which adapters' LoRA factors will be placed on the device and which stay on the CPU,
// the merge units (tensors) that will not fit and run on the CPU, the CPU's peak memory, and
// the output's size, shards and the free disk space where it goes. --json prints the same as
// one object.
#include <cJSON.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cmd.h"
#include "device.h"
#include "merge.h"
#include "plan.h"
#include "util.h"

#define PREFIX "llmerge plan"

static void usage(FILE *out)
{
    fprintf(out,
            "Usage: llmerge plan METHOD BASE FT [FT...] -o OUT [merge options] [--json]\n"
            "\n"
            "Prints what `llmerge METHOD BASE FT... -o OUT [options]` will need, reading only the\n"
            "inputs' headers and configs: each adapter's LoRA factors and whether they fit the\n"
            "device, each tensor's working set on the device and which tensors will fall back to\n"
            "the CPU, the CPU's peak memory, and the output's bytes, shards and the free disk space\n"
            "beside OUT. METHOD is ties, dare, dare-ties or task-arithmetic; the options are the\n"
            "merge's (see llmerge METHOD --help), --device and --gpu-mem included.\n"
            "\n"
            "  --json   print the plan as one JSON object\n");
}

static const char *fmt(char *buf, uint64_t bytes)
{
    return lm_format_bytes(buf, 32, bytes);
}

static void print_text(const lm_cmd_prepared *pr, const lm_plan *p, const char *dev_name, size_t free_b,
                       size_t total_b)
{
    char a[32], b[32], c[32];
    if (p->accelerator)
        printf("device: %s, %s free of %s, budget %s%s\n", dev_name, fmt(a, free_b), fmt(b, total_b),
               fmt(c, p->budget), pr->gpu_mem ? " (with --gpu-mem)" : "");
    else
        printf("device: %s (%s)\n", dev_name, pr->dev_why);
    for (int i = 0; i < p->n_ft; i++) {
        const lm_plan_ft *f = &p->ft[i];
        if (!pr->fts[i]->adapter)
            printf("place: FT %d (%s) is a full model: no LoRA factors to place\n", i + 1, pr->ft_args[i]);
        else if (!p->accelerator)
            printf("place: FT %d (%s) %s of LoRA factors: on cpu\n", i + 1, pr->ft_args[i], fmt(a, f->resident_bytes));
        else
            printf("place: FT %d (%s) %s of LoRA factors: %s%s\n", i + 1, pr->ft_args[i], fmt(a, f->resident_bytes),
                   f->on_device ? "on " : "stays on cpu (does not fit)", f->on_device ? dev_name : "");
    }
    if (p->largest < 0) {
        printf("merge: no tensor is changed by the FTs; all %" PRId64 " are copied on the cpu\n", p->n_tensors);
    } else {
        const lm_plan_tensor *t = &p->tensors[p->largest];
        printf("merge: largest tensor %s needs %s on %s", t->name, fmt(a, t->dev_bytes), dev_name);
        if (!p->accelerator)
            printf("; all %" PRId64 " merged tensors run on the cpu\n", p->n_merged);
        else if (p->n_fallback == 0)
            printf("; all %" PRId64 " merged tensors fit beside %s of factors\n", p->n_merged, fmt(b, p->placed_bytes));
        else
            printf("; %" PRId64 " of %" PRId64 " tensors do not fit and will run on the CPU (the largest: %s, %s)\n",
                   p->n_fallback, p->n_merged, p->tensors[p->largest_fallback].name,
                   fmt(b, p->tensors[p->largest_fallback].dev_bytes));
        for (int64_t i = 0; p->accelerator && i < p->n_tensors; i++)
            if (p->tensors[i].cpu.parts > 0 && !p->tensors[i].fits)
                printf("merge: fallback %s on cpu (needs %s, %s left beside the factors)\n", p->tensors[i].name,
                       fmt(a, p->tensors[i].dev_bytes), fmt(b, p->budget - p->placed_bytes));
        if (p->accelerator)
            printf("%s: peak about %s\n", dev_name, fmt(a, p->dev_peak));
    }
    const lm_plan_cpu *m = &p->cpu;
    printf("cpu: peak about %s (buffers %s of %s reserved, LoRA factors %s, mapped inputs %s, adapters mapped %s, "
           "histograms %s, other %s)\n",
           fmt(a, m->peak), fmt(b, m->ws_touched), fmt(c, m->ws_reserved), fmt((char[32]){0}, m->residents),
           fmt((char[32]){0}, m->mapped), fmt((char[32]){0}, m->adapter_mapped), fmt((char[32]){0}, m->hist + m->select),
           fmt((char[32]){0}, m->out_host + m->out_slab + m->mag + m->device_host + m->runtime));
    if (p->disk_known)
        printf("output: %" PRIu64 " bytes in %d shard%s; %s free at %s (%s)\n", p->out_bytes, p->n_shards,
               p->n_shards == 1 ? "" : "s", fmt(a, p->disk_free), p->out_parent,
               p->out_bytes <= p->disk_free ? "fits" : "does NOT fit");
    else
        printf("output: %" PRIu64 " bytes in %d shard%s; free space at %s unknown\n", p->out_bytes, p->n_shards,
               p->n_shards == 1 ? "" : "s", p->out_parent);
}

static cJSON *tensor_json(const lm_plan_tensor *t, bool accelerator)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "name", t->name);
    cJSON_AddNumberToObject(o, "parts", t->cpu.parts);
    cJSON_AddNumberToObject(o, "slab_elems", (double)t->dev.slab_elems);
    cJSON_AddNumberToObject(o, "device_bytes", (double)t->dev_bytes);
    cJSON_AddBoolToObject(o, "fits", accelerator ? t->fits : true);
    return o;
}

static int print_json(const lm_cmd_prepared *pr, const lm_plan *p, const char *dev_name, size_t free_b, size_t total_b)
{
    cJSON *root = cJSON_CreateObject();
    cJSON_AddStringToObject(root, "method", pr->method);
    cJSON *d = cJSON_AddObjectToObject(root, "device");
    cJSON_AddStringToObject(d, "name", dev_name);
    cJSON_AddBoolToObject(d, "accelerator", p->accelerator);
    cJSON_AddStringToObject(d, "why", pr->dev_why);
    if (p->accelerator) {
        cJSON_AddNumberToObject(d, "free_bytes", (double)free_b);
        cJSON_AddNumberToObject(d, "total_bytes", (double)total_b);
        cJSON_AddNumberToObject(d, "gpu_mem", (double)pr->gpu_mem);
        cJSON_AddNumberToObject(d, "budget", (double)p->budget);
        cJSON_AddNumberToObject(d, "peak_bytes", (double)p->dev_peak);
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
    struct { const char *k; uint64_t v; } f[] = {
        {"peak_bytes", c->peak}, {"buffers_reserved", c->ws_reserved}, {"buffers_touched", c->ws_touched},
        {"lora_factors", c->residents}, {"adapters_mapped", c->adapter_mapped}, {"out_piece", c->out_host},
        {"out_slab", c->out_slab}, {"histograms", c->hist}, {"dora_magnitudes", c->mag},
        {"mapped_inputs", c->mapped}, {"select", c->select}, {"device_host", c->device_host},
        {"runtime", c->runtime},
    };
    for (size_t i = 0; i < sizeof f / sizeof f[0]; i++)
        cJSON_AddNumberToObject(cj, f[i].k, (double)f[i].v);
    cJSON *o = cJSON_AddObjectToObject(root, "output");
    cJSON_AddNumberToObject(o, "bytes", (double)p->out_bytes);
    cJSON_AddNumberToObject(o, "shards", p->n_shards);
    cJSON_AddStringToObject(o, "parent", p->out_parent);
    if (p->disk_known) {
        cJSON_AddNumberToObject(o, "disk_free", (double)p->disk_free);
        cJSON_AddBoolToObject(o, "fits", p->out_bytes <= p->disk_free);
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
    lm_cmd_prepared pr;
    int rc = lm_cmd_merge_prepare(margc, margv, PREFIX, &pr);
    if (rc != 0 || pr.help)
        goto done;

    size_t free_b = 0, total_b = 0;
    lm_dev_mem_info(pr.dev, &free_b, &total_b);
    const char *dev_name = lm_dev_name(pr.dev);
    lm_plan_device dev = {.name = dev_name, .host_memory = pr.dev->host_memory, .free_bytes = free_b,
                          .total_bytes = total_b, .cap = pr.gpu_mem};
    lm_plan p;
    lm_err err = {0};
    lm_status s = lm_plan_make(&p, pr.opts, pr.base, pr.fts, &dev, pr.shard_size, pr.out, &err);
    if (s != LM_OK) {
        rc = lm_status_exit_code(s);
        fprintf(stderr, PREFIX ": error: %s\n", err.msg);
        goto done;
    }
    if (json)
        rc = print_json(&pr, &p, dev_name, free_b, total_b);
    else
        print_text(&pr, &p, dev_name, free_b, total_b);
    lm_plan_free(&p);
done:
    lm_cmd_merge_release(&pr);
    free(margv);
    return rc;
}
