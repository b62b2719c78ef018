// llmerge extract BASE FT -o ADAPTER --rank R: a full fine-tune (or a merged model) written as a
// LoRA adapter of BASE, mergekit-extract-lora's job. It is the task arithmetic of the one FT
// with --to-lora R (cmd/merge_lora.c): the same code, the same adapter.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cmd.h"
#include "merge_args.h"

// The options extract takes: where and how it runs, and the adapter's.
static bool extract_option(int id)
{
    switch (id) {
    case OPT_OUTPUT: case OPT_RANK: case OPT_TO_LORA_ENERGY: case OPT_DTYPE: case OPT_SEED: case OPT_DEVICE:
    case OPT_GPU_MEM: case OPT_THREADS: case OPT_LOG_JSON: case OPT_QUIET: case OPT_VERBOSE: case OPT_FORCE:
    case OPT_NO_CARD: case OPT_STRICT: case OPT_HELP:
        return true;
    default:
        return false;
    }
}

static lm_status extract_opt(void *ctx, const lm_opt *d, const char *shown, const char *v, lm_err *err)
{
    merge_args *a = ctx;
    if (!extract_option(d->id))
        return lm_err_set(err, LM_ERR_USAGE, "%s is not an option of llmerge extract", shown);
    return lm_merge_apply_option(a, d, shown, v, err);
}

static lm_status extract_operand(void *ctx, const char *arg, lm_err *err)
{
    merge_args *a = ctx;
    if (!a->base)
        a->base = arg;
    else if (a->n_ft == 0)
        a->fts[a->n_ft++] = arg;
    else
        return lm_err_set(err, LM_ERR_USAGE, "llmerge extract takes BASE and one FT ('%s' is a third)", arg);
    return LM_OK;
}

lm_status lm_cmd_extract_parse(merge_args *a, int argc, char **argv, lm_err *err)
{
    a->m = lm_method_find("task-arithmetic");
    a->use = lm_merge_uses(a->m);
    lm_merge_args_defaults(a);
    a->extract = true;
    if (!(a->fts = calloc(1, sizeof *a->fts)))
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    lm_status s = lm_cmd_scan(argc, argv, lm_merge_opt_defs, lm_merge_n_opts, extract_opt, extract_operand, a, err);
    if (s != LM_OK || a->help)
        return s;
    if (!a->to_lora)
        return lm_err_set(err, LM_ERR_USAGE, "--rank R is needed: the adapter's rank");
    return LM_OK;
}

void lm_cmd_extract_usage(FILE *out, const void *arg)
{
    (void)arg;
    fprintf(out,
            "Usage: llmerge extract BASE FT -o ADAPTER --rank R [options]\n"
            "\n"
            "Writes the change from BASE to FT (a full fine-tune, a merged model, or BASE with an\n"
            "adapter) as a PEFT LoRA adapter of BASE: each matrix's change as factors of rank R from\n"
            "a truncated SVD (a randomised range finder seeded by --seed, then an exact SVD of the\n"
            "small projected matrix), the embedding's as embedding LoRA, biases as lora_B.bias\n"
            "(lora_bias), other tensors that change (norms) whole in modules_to_save; unchanged\n"
            "tensors are left out. PEFT takes no embedding LoRA beside lora_bias: where a bias\n"
            "changes, the embedding is written whole, BASE plus its factors' product. It is llmerge\n"
            "task-arithmetic BASE FT --to-lora R: the same adapter. ADAPTER holds\n"
            "adapter_config.json, adapter_model.safetensors, README.md and llmerge.json, which\n"
            "records each tensor's rank and its relative error |D - B.A| / |D|.\n"
            "\n"
            "Options (also as --name=value):\n"
            "  -o, --output DIR       the adapter directory (required); an existing one is refused\n"
            "                         unless --force is given\n"
            "  --rank R               the adapter's rank (required): at most each matrix's smaller\n"
            "                         side\n"
            "  --to-lora-energy F     per matrix the smallest rank keeping the fraction F of its\n"
            "                         change's energy (sum of squares), at most R\n"
            "  --dtype f32|f16|bf16   the factors' dtype (default: the base's)\n"
            "  --seed N               the random test matrices' seed (default 0): the same seed gives\n"
            "                         the same adapter on any device and thread count\n"
            "  --device DEV           auto, cpu, cuda[:N], sim:SIZE (default auto); a matrix whose\n"
            "                         factorisation does not fit on the GPU is done on the CPU\n"
            "  --gpu-mem SIZE         most device memory to use\n"
            "  --threads N            CPU threads (default: the cores it may use)\n"
            "  --log-json FILE        one JSON object per event to FILE\n"
            "  -q, --quiet            nothing on stderr but errors\n"
            "  -v, --verbose          also the resolved settings and each input\n"
            "  --force                replace ADAPTER if it exists (only at the end)\n"
            "  --no-card              do not write README.md\n"
            "  --strict               refuse an FT holding a tensor BASE does not have\n"
            "  -h, --help             this help\n"
            "\n"
            "Example: llmerge extract meta-llama/Llama-3.2-1B ./my-finetune -o ./my-lora --rank 32\n"
            "\n"
            "Exit status: 0 done; 1 the work failed; 2 bad usage or input, found before any work;\n"
            "128 + the signal when stopped by one (nothing is left at ADAPTER).\n");
}

int lm_cmd_extract(int argc, char **argv)
{
    return lm_cmd_merge_with("llmerge extract", lm_cmd_extract_usage, lm_cmd_extract_parse, "BASE", argc, argv);
}
