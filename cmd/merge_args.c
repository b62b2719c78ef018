// The merge commands' command line: see merge_args.h. Every option of docs/design.md's table is
// parsed, also in the --name=value form, and an unknown one gets a "did you mean".
#include "merge_args.h"

#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cmd.h"
#include "util.h"

// ==== the methods =============================================================================

merge_uses lm_merge_uses(const lm_method *m)
{
    return (merge_uses){
        .weights = !m->ignores_weights,
        .normalize = !m->ignores_normalize,
        .lambda = !m->ignores_lambda,
        .density = m->density,
        .sign = m->elect,
        .topk = m->rank != LM_RANK_NONE,
        .rescale = m->drop,
        .seed = m->drop,
        .hessians = m->rank == LM_RANK_IMPORTANCE,
        .t = m->reads_t,
        .gamma = m->outliers,
        .epsilon = m->della || m->threshold,
        .threshold = m->threshold,
        .ramplus = m->ramplus,
        .per_row = m->rows_ok,
        .per_col = m->cols_ok,
        .select_topk = m->sce,
        .iter = m->reads_iter,
        .models_only = m->input == LM_METHOD_EITHER,
        .models = m->input == LM_METHOD_MODELS,
    };
}

void lm_cmd_method_names(char *buf, size_t cap)
{
    size_t len = 0;
    buf[0] = '\0';
    const lm_method *m;
    for (size_t i = 0; (m = lm_method_at(i)) && len < cap; i++)
        len += (size_t)snprintf(buf + len, cap - len, "%s%s", i ? ", " : "", m->name);
}

// ==== options =================================================================================

const lm_opt lm_merge_opt_defs[] = {
    {"output", 'o', true, OPT_OUTPUT},
    {"weights", 0, true, OPT_WEIGHTS},
    {"density", 0, true, OPT_DENSITY},
    {"densities", 0, true, OPT_DENSITIES},
    {"lambda", 0, true, OPT_LAMBDA},
    {"normalize", 0, false, OPT_NORMALIZE},
    {"no-normalize", 0, false, OPT_NO_NORMALIZE},
    {"sign", 0, true, OPT_SIGN},
    {"topk", 0, true, OPT_TOPK},
    {"rescale", 0, true, OPT_RESCALE},
    {"seed", 0, true, OPT_SEED},
    {"dtype", 0, true, OPT_DTYPE},
    {"shard-size", 0, true, OPT_SHARD_SIZE},
    {"device", 0, true, OPT_DEVICE},
    {"gpu-mem", 0, true, OPT_GPU_MEM},
    {"threads", 0, true, OPT_THREADS},
    {"cache-dir", 0, true, OPT_CACHE_DIR},
    {"log-json", 0, true, OPT_LOG_JSON},
    {"quiet", 'q', false, OPT_QUIET},
    {"verbose", 'v', false, OPT_VERBOSE},
    {"force", 0, false, OPT_FORCE},
    {"calib", 0, true, OPT_CALIB},
    {"calib-samples", 0, true, OPT_CALIB_SAMPLES},
    {"seq-len", 0, true, OPT_SEQ_LEN},
    {"hessian-from", 0, true, OPT_HESSIAN_FROM},
    {"sticky-fallback", 0, false, OPT_STICKY},
    {"no-card", 0, false, OPT_NO_CARD},
    {"strict", 0, false, OPT_STRICT},
    {"t", 0, true, OPT_T},
    {"max-iter", 0, true, OPT_MAX_ITER},
    {"tol", 0, true, OPT_TOL},
    {"models-only", 0, false, OPT_MODELS_ONLY},
    {"gamma", 0, true, OPT_GAMMA},
    {"epsilon", 0, true, OPT_EPSILON},
    {"r", 0, true, OPT_RAM_R},
    {"alpha", 0, true, OPT_RAM_ALPHA},
    {"per-row", 0, false, OPT_PER_ROW},
    {"select-topk", 0, true, OPT_SELECT_TOPK},
    {"per-column", 0, false, OPT_PER_COL},
    {"to-lora", 0, true, OPT_TO_LORA},
    {"to-lora-energy", 0, true, OPT_TO_LORA_ENERGY},
    {"rank", 0, true, OPT_RANK},
    {"tokenizer", 0, true, OPT_TOKENIZER},
    {"data-format", 0, true, OPT_DATA_FORMAT},
    {"help", 'h', false, OPT_HELP},
};
const size_t lm_merge_n_opts = sizeof lm_merge_opt_defs / sizeof lm_merge_opt_defs[0];

// The inputs method m takes on the command line, "BASE FT [FT...]" and the like, from its
// descriptor: `first` and `more` name them, min and max count them (max 0: any).
static void operands(char *buf, size_t cap, const char *first, const char *more, int min, int max)
{
    size_t len = (size_t)snprintf(buf, cap, "%s", first);
    for (int i = 0; i < (min > 1 ? min : 1) && len < cap; i++)
        len += (size_t)snprintf(buf + len, cap - len, " %s", more);
    if (max == 0 && len < cap)
        snprintf(buf + len, cap - len, " [%s...]", more);
}

void lm_merge_usage(FILE *out, const lm_method *m)
{
    merge_uses u = lm_merge_uses(m);
    char usage[128], models[128];
    if (u.models)
        operands(usage, sizeof usage, "MODEL", "MODEL", m->min_inputs - 1, m->max_inputs ? m->max_inputs - 1 : 0);
    else
        operands(usage, sizeof usage, "BASE", "FT", m->min_inputs, m->max_inputs);
    operands(models, sizeof models, "MODEL", "MODEL", m->min_inputs - 1, m->max_inputs ? m->max_inputs - 1 : 0);
    char alt[256] = "", normalize[96] = "no effect on this method";
    if (u.normalize)
        snprintf(normalize, sizeof normalize, "default for %s: %s", m->name, m->normalize ? "on" : "off");
    if (u.models_only)
        snprintf(alt, sizeof alt, "       llmerge %s --models-only %s -o OUT [options]\n", m->name, models);
    fprintf(out,
            "Usage: llmerge %s %s -o OUT [options]\n"
            "%s"
            "\n"
            "%s\n"
            "\n"
            "%s"
            "\n"
            "%s is a Hugging Face model directory (config.json with model.safetensors, or shards\n"
            "and model.safetensors.index.json). Each %s is a PEFT LoRA adapter directory\n"
            "(adapter_config.json + adapter_model.safetensors) or a full fine-tuned model directory\n"
            "of %s, also when the directory holds exactly one such subdirectory. Task vectors are\n"
            "computed in float32 whatever the input dtype; adapters are never expanded into models.\n"
            "A model or adapter that is not a directory, ORG/NAME[@REVISION], is read from the\n"
            "Hugging Face cache ($HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub),\n"
            "never downloaded.\n"
            "%s"
            "\n"
            "Per tensor: an option of numbers takes, for each input (separated by '|', or one for\n"
            "all), a number, a gradient over the layers '0,0.5,1', or filters\n"
            "'FILTER=VALUE;...;VALUE' (the first whose FILTER is in the tensor's name, '*' any; a\n"
            "tensor none matches takes the default), as a mergekit configuration's parameters:\n"
            "  --weights '1 | mlp=0.5;1'   --t 'self_attn=0,0.5,1;mlp=1,0.5,0;0.5'\n"
            "(docs/mergekit.md: Parameters).\n"
            "\n"
            "Options (also as --name=value):\n"
            "  -o, --output DIR       the output model directory (required); an existing one is\n"
            "                         refused unless --force is given\n"
            "  --weights W1,W2,...    one weight per %s (default: 1 each)%s\n"
            "  --density D            fraction of each task vector kept, in (0, 1], for every FT\n"
            "                         (default 0.2)%s\n"
            "  --densities D1,D2,...  one density per FT (a single value applies to all)\n"
            "  --lambda L             scale of the merged task vector (default 1)%s\n"
            "  --normalize            divide by the sum of the weights (of the FTs that agree,\n"
            "                         with a sign election); %s\n"
            "                         (on for ties; off for dare, dare-ties, task-arithmetic)\n"
            "  --no-normalize         do not divide\n"
            "  --sign sum|count       sign election by the sign of the weighted sum, or by the\n"
            "                         count of signs (default sum)%s\n"
            "  --topk tensor|global   keep the top D of each tensor, or of each model as a whole\n"
            "                         as in the TIES paper (default tensor)%s\n"
            "  --rescale inv|l1|none  multiply the kept entries by 1/D (DARE paper, PEFT; della: by\n"
            "                         1/p, each its own), match the L1 norm of the task vector\n"
            "                         (mergekit), or leave them (default inv)%s\n"
            "  --seed N               seed of the random masks: the same seed gives the same\n"
            "                         output on any device and thread count (default 0)%s\n"
            "  --dtype f32|f16|bf16   output dtype (default: the base's, from config.json or\n"
            "                         else its tensors; f32 for --to-lora exact)\n"
            "  --shard-size SIZE      most tensor bytes per output shard (default 5GB); SIZE is\n"
            "                         bytes with K, M, G, KiB, MiB, GiB (powers of 1024) or KB,\n"
            "                         MB, GB (powers of 1000, as transformers). Not mergekit's\n"
            "                         parameter count: 1B (under 1 MiB with a bare B) is refused;\n"
            "                         a billion bf16 parameters take 2GB\n"
            "  --device DEV           where the work runs (default auto): cpu; cuda or cuda:N, GPU\n"
            "                         N; sim:SIZE, a simulated GPU of SIZE bytes (for tests); auto,\n"
            "                         GPU 0 when it passes a self-test, else the CPU. A unit of work\n"
            "                         that does not fit on the GPU runs on the CPU (a 'fallback:'\n"
            "                         line says which); the output is the same\n"
            "  --gpu-mem SIZE         most device memory to use (default: all free; no effect on\n"
            "                         the CPU)\n"
            "  --threads N            CPU threads (default: the cores it may use)\n"
            "  --cache-dir DIR        where Hessians and masks are kept between runs (default\n"
            "                         $XDG_CACHE_HOME/llmerge;%s)\n",
            m->name, usage, alt, m->summary, m->formula,
            u.models ? "The first MODEL" : "BASE", u.models ? "other MODEL" : "FT", u.models ? "the first" : "BASE",
            u.models ? "The first MODEL is one of the models averaged, and the one the others are checked\n"
                       "against (its tensors, shapes and config.json are the output's).\n"
                     : "",
            u.models ? "MODEL" : "FT", u.weights ? "" : "; no effect on this method",
            u.density ? "" : "; no effect on this method",
            u.lambda ? "" : ";\n                         no effect on this method",
            normalize,
            u.sign ? "" : ";\n                         no effect on this method",
            u.topk ? "" : ";\n                         no effect on this method",
            u.rescale ? "" : ";\n                         no effect on this method",
            u.seed ? "" : ";\n                         no effect on this method",
            u.hessians ? "\n"
                         "                         sparsegpt keeps each model's Hessians, their U_cc^2\n"
                         "                         and each FT's top-k masks there, so a rerun skips the\n"
                         "                         capture and the selection; LLMERGE_CACHE_HESSIANS=0:\n"
                         "                         not the Hessians, about 5 GB per model for a 1B Llama"
                       : " this method keeps nothing there");
    fprintf(out,
            "  --to-lora RANK         write OUT as a PEFT LoRA adapter of BASE instead of a model:\n"
            "                         each matrix's merged change Δ as factors of rank RANK\n"
            "                         (a truncated SVD), an embedding's as embedding LoRA, biases\n"
            "                         as lora_B.bias, other tensors that change (norms) whole in\n"
            "                         modules_to_save (docs/merging.md: PEFT's rules);\n"
            "                         llmerge.json records each tensor's rank and relative error\n"
            "  --to-lora exact        (task-arithmetic and linear of LoRA adapters) the inputs'\n"
            "                         factors concatenated, each weight folded into its B: rank\n"
            "                         the sum of theirs, no SVD, no error; written in f32 unless\n"
            "                         --dtype says otherwise (which rounds the factors)\n"
            "  --to-lora-energy F     with --to-lora: per matrix the smallest rank keeping the\n"
            "                         fraction F of Δ's energy (sum of squares), at most RANK\n"
            "                         (rank_pattern holds the others)\n"
            "  --log-json FILE        write one JSON object per event to FILE (JSON Lines):\n"
            "                         start, warnings, each tensor, end, error or interrupted\n"
            "                         (default: none)\n"
            "  -q, --quiet            nothing on stderr but errors\n"
            "  -v, --verbose          also the resolved settings and each input\n"
            "  --force                replace OUT if it exists (it is replaced only at the end)\n"
            "  --no-card              do not write README.md, the model card (the Hub's metadata,\n"
            "                         the inputs, the options, a command line making the same\n"
            "                         merge), into OUT\n"
            "  --strict               refuse a full FT holding a tensor the base does not have\n"
            "                         (default: such a tensor is left out, with a warning)\n"
            "  -h, --help             this help\n"
            "%s%s%s%s%s%s%s%s%s%s%s"
            "\n"
            "OUT gets the merged weights (model.safetensors, or shards and\n"
            "model.safetensors.index.json), config.json from BASE with the dtype updated, BASE's\n"
            "tokenizer and generation files, README.md (the model card, unless --no-card), and\n"
            "llmerge.json: inputs with xxHash64 of their files, options, per-tensor xxHash64 of the\n"
            "output, timings.\n",
            !u.hessians ? "" :
            "\nHessians (sparsegpt):\n"
            "  --calib FILE           calibration data, .jsonl ({\"input_ids\": [...]} per line) or\n"
            "                         .txt (space-separated ids per line), a regular file: once for\n"
            "                         every FT, or once per FT in FT order (required)\n"
            "  --calib-samples N      at most the first N sequences of each file (default: all)\n"
            "  --tokenizer DIR        the tokenizer.json for the files' \"text\" lines (default:\n"
            "                         BASE's own)\n"
            "  --data-format ids|text text: each --calib file is one text document, tokenized and\n"
            "                         cut into windows of --seq-len tokens (stride = window)\n"
            "  --seq-len L            longer sequences are cut to L tokens (default: the model's\n"
            "                         max_position_embeddings)\n"
            "  --hessian-from ft|base each FT's Hessians from its own model (its adapter applied to\n"
            "                         BASE) on its calibration file (default ft), or BASE's on the\n"
            "                         first file for all\n"
            "  --sticky-fallback      once a calibration sequence has gone to the CPU, run every\n"
            "                         later batch there too (default: try the device again)\n",
            !(u.t || u.iter || u.models_only || u.gamma || u.epsilon || u.per_row || u.per_col || u.select_topk ||
              u.ramplus)
                ? "" : "\nOptions of this method:\n",
            !u.t ? "" :
            "  --t T                  the position between the base (0) and the FT (1) for slerp,\n"
            "                         the largest change per entry for nearswap (default 0.5)\n",
            !u.ramplus ? "" :
            "  --r R                  how much an FT's own entries grow with its share of common\n"
            "                         ones: lambda_i = 1 + R * clamp(rho_i, 0, A) (default 0.1)\n"
            "  --alpha A              the most rho_i counts for (default 0.2)\n",
            !u.iter ? "" :
            "  --max-iter N           most iterations of the mean (default 10)\n"
            "  --tol X                stop when the step is below X; norms below X count as zero\n"
            "                         (default 1e-5)\n",
            !u.models_only ? "" :
            "  --models-only          interpolate the models themselves, the first MODEL one of them,\n"
            "                         rather than task vectors against BASE (mergekit without a\n"
            "                         base_model); --weights then has one weight per MODEL\n",
            !u.gamma ? "" :
            "  --gamma G[,G2,...]     the fraction of each task vector's largest magnitudes dropped,\n"
            "                         in [0, 1]: one for every FT, or one per FT (default 0.01)\n",
            !u.epsilon ? "" :
            u.threshold ?
            "  --epsilon E[,E2,...]   the magnitude an entry of a task vector must exceed to count,\n"
            "                         0 or more: one for every FT, or one per FT (default 1e-5)\n" :
            "  --epsilon E[,E2,...]   the spread of the keep probabilities: from D - E for a row's\n"
            "                         smallest entry to D + E for its largest, both in (0, 1); one\n"
            "                         for every FT, or one per FT (default 0.15)\n",
            !u.per_row ? "" :
            "  --per-row              each row of a matrix its own vector with its own coefficients\n"
            "                         (mergekit's nuslerp_flatten: false, model_stock's filter_wise:\n"
            "                         true), rather than the whole tensor\n",
            !u.per_col ? "" :
            "  --per-column           each column of a matrix its own vector (mergekit's\n"
            "                         nuslerp_row_wise: true with nuslerp_flatten: false)\n",
            !u.select_topk ? "" :
            "  --select-topk P        the fraction of the entries of nonzero variance across the FTs\n"
            "                         kept, those of largest variance (default 1: all)\n");
    fprintf(out,
            "\n"
            "While a merge works, OUT.tmp-XXXXXX beside OUT holds the partial output and OUT.lock\n"
            "keeps a second llmerge from writing the same OUT (it exits with status 2 naming the\n"
            "first one's pid). Ctrl-C (SIGINT), SIGTERM, SIGHUP or SIGQUIT stops the merge at the\n"
            "next tensor and removes the partial output; a second signal ends it at once, after\n"
            "removing it too. A run after one that was killed removes what that one left. OUT,\n"
            "OUT.lock, --log-json and --cache-dir may not be, hold or lie inside BASE, an FT or a\n"
            "--calib file, even with --force.\n"
            "\n"
            "Exit status: 0 done; 1 the merge failed, or an input changed while it was read (nothing\n"
            "is left at OUT); 2 bad usage or bad input, found before any work started, or OUT being\n"
            "written by another run; 128 + the signal (130 SIGINT, 143 SIGTERM, 129 SIGHUP, 131\n"
            "SIGQUIT) stopped by a signal (nothing is left at OUT).\n");
}

// ---- value parsers --------------------------------------------------------------------------

// A finite number written entirely as one.
static bool parse_number(const char *text, double *out)
{
    // the grammar of the settings' numbers (and a configuration's): no hexadecimal, no leading
    // zeros, nothing beyond a double, so that a plain number and a setting read alike
    // (blanks around it are for reading, as around a setting)
    while (*text == ' ')
        text++;
    size_t len = strlen(text);
    while (len > 0 && text[len - 1] == ' ')
        len--;
    lm_pnum k = lm_param_scan_number(text, len, out);
    return k == LM_PNUM_INT || k == LM_PNUM_FLOAT;
}

// "1,0.5,2" into a new array (*out, caller frees) of *n numbers.
static lm_status parse_list(const char *opt, const char *text, double **out, int *n, lm_err *err)
{
    size_t cap = 1;
    for (const char *c = text; *c; c++)
        cap += *c == ',';
    double *v = malloc(cap * sizeof *v);
    char *copy = lm_strdup(text);
    if (!v || !copy) {
        free(v);
        free(copy);
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    }
    int k = 0;
    char *item = copy;
    for (;;) {
        char *comma = strchr(item, ',');
        if (comma)
            *comma = '\0';
        if (!parse_number(item, &v[k])) {
            lm_err_set(err, LM_ERR_USAGE, "%s %s: '%s' is not a number%s", opt, text, item,
                       *item ? "" : " (an empty item)");
            free(v);
            free(copy);
            return LM_ERR_USAGE;
        }
        k++;
        if (!comma)
            break;
        item = comma + 1;
    }
    free(copy);
    free(*out);
    *out = v;
    *n = k;
    return LM_OK;
}

// A whole decimal number in [lo, hi].
static bool parse_u64(const char *text, uint64_t lo, uint64_t hi, uint64_t *out)
{
    if (*text < '0' || *text > '9')
        return false;
    char *end;
    errno = 0;
    unsigned long long v = strtoull(text, &end, 10);
    if (*end || errno == ERANGE || v < lo || v > hi)
        return false;
    *out = v;
    return true;
}

// Whether an option's value is written as settings (params.h) rather than plain numbers.
static bool is_setting(const char *v)
{
    return strpbrk(v, "|=;") != NULL;
}

// Parses `v`, items separated by '|', into the settings of option `id` (replacing any before).
static lm_status parse_settings(merge_args *a, set_id id, const char *shown, const char *v, bool one, lm_err *err)
{
    cli_setting *c = &a->sets[id];
    for (int i = 0; i < c->n; i++)
        lm_pval_free(c->v[i]);
    free(c->v);
    free(c->text);
    c->v = NULL;
    c->n = 0;
    if (!(c->text = lm_strdup(v)))
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    size_t cap = 1;
    for (const char *p = v; *p; p++)
        cap += *p == '|';
    if (one && cap > 1)
        return lm_err_set(err, LM_ERR_USAGE, "%s %s: one setting for the whole merge, not one per input ('|')", shown,
                          v);
    if (!(c->v = calloc(cap, sizeof *c->v)))
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    char *copy = lm_strdup(v);
    if (!copy)
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    lm_status s = LM_OK;
    char *item = copy;
    for (;;) {
        char *bar = strchr(item, '|');
        if (bar)
            *bar = '\0';
        // spaces around an item are for reading only
        while (*item == ' ')
            item++;
        for (char *e = item + strlen(item); e > item && e[-1] == ' ';)
            *--e = '\0';
        if ((s = lm_pval_parse_cli(item, &c->v[c->n], err)) != LM_OK) {
            if (cap > 1)
                lm_err_prefix(err, "%s: input %d's setting '%s'", shown, c->n + 1, item);
            else
                lm_err_prefix(err, "%s '%s'", shown, item);
            break;
        }
        c->n++;
        if (!bar)
            break;
        item = bar + 1;
    }
    free(copy);
    return s;
}

const char *lm_merge_input_where(const merge_args *a, int i)
{
    return a->input_where && a->input_where[i] ? a->input_where[i] : a->input_name[i];
}

void lm_merge_args_free_sets(merge_args *a)
{
    for (int id = 0; id < SET_COUNT; id++) {
        for (int i = 0; i < a->sets[id].n; i++)
            lm_pval_free(a->sets[id].v[i]);
        free(a->sets[id].v);
        free(a->sets[id].text);
        a->sets[id].text = NULL;
        a->sets[id].v = NULL;
        a->sets[id].n = 0;
    }
}

lm_status lm_merge_apply_option(void *ctx, const lm_opt *d, const char *shown, const char *v, lm_err *err)
{
    merge_args *a = ctx;
    a->given[d->id] = true;
    lm_status s;
    switch (d->id) {
    case OPT_OUTPUT:
        if (!*v)
            return lm_err_set(err, LM_ERR_USAGE, "%s needs a directory", shown);
        a->out = v;
        return LM_OK;
    case OPT_WEIGHTS:
        if (is_setting(v))
            return parse_settings(a, SET_WEIGHT, shown, v, false, err);
        return parse_list(shown, v, &a->weights, &a->n_weights, err);
    case OPT_DENSITY:
    case OPT_DENSITIES:
        a->density_opt = d->id == OPT_DENSITY ? "--density" : "--densities";
        if (is_setting(v))
            return parse_settings(a, SET_DENSITY, shown, v, false, err);
        if ((s = parse_list(shown, v, &a->densities, &a->n_densities, err)) != LM_OK)
            return s;
        for (int i = 0; i < a->n_densities; i++)
            if (!(a->densities[i] > 0.0 && a->densities[i] <= 1.0)) {
                char which[48] = "";
                if (a->n_densities > 1)
                    snprintf(which, sizeof which, " (item %d is %g)", i + 1, a->densities[i]);
                return lm_err_set(err, LM_ERR_USAGE, "%s %s: a density must be in (0, 1], the "
                                  "fraction of each task vector kept%s", shown, v, which);
            }
        return LM_OK;
    case OPT_LAMBDA:
        if (is_setting(v) || strchr(v, ','))
            return parse_settings(a, SET_LAMBDA, shown, v, true, err);
        if (!parse_number(v, &a->lambda))
            return lm_err_set(err, LM_ERR_USAGE, "%s '%s' is not a number", shown, v);
        return LM_OK;
    case OPT_NORMALIZE:
        a->normalize = 1;
        return LM_OK;
    case OPT_NO_NORMALIZE:
        a->normalize = 0;
        return LM_OK;
    case OPT_SIGN:
        if (strcmp(v, "sum") == 0)
            a->sign = LM_SIGN_SUM;
        else if (strcmp(v, "count") == 0)
            a->sign = LM_SIGN_COUNT;
        else
            return lm_err_set(err, LM_ERR_USAGE, "%s '%s': use sum or count", shown, v);
        return LM_OK;
    case OPT_TOPK:
        if (strcmp(v, "tensor") == 0 || strcmp(v, "global") == 0)
            a->topk_global = v[0] == 'g';
        else
            return lm_err_set(err, LM_ERR_USAGE, "%s '%s': use tensor or global", shown, v);
        return LM_OK;
    case OPT_RESCALE:
        if (strcmp(v, "inv") == 0)
            a->rescale = LM_RESCALE_INV;
        else if (strcmp(v, "l1") == 0)
            a->rescale = LM_RESCALE_L1;
        else if (strcmp(v, "none") == 0)
            a->rescale = LM_RESCALE_NONE;
        else
            return lm_err_set(err, LM_ERR_USAGE, "%s '%s': use inv, l1 or none", shown, v);
        return LM_OK;
    case OPT_SEED:
        if (!parse_u64(v, 0, UINT64_MAX, &a->seed))
            return lm_err_set(err, LM_ERR_USAGE, "%s '%s': a whole number from 0 to %" PRIu64
                              " is needed", shown, v, UINT64_MAX);
        return LM_OK;
    case OPT_DTYPE:
        if (!lm_dtype_from_user(v, &a->dtype) || !lm_dtype_writable(a->dtype))
            return lm_err_set(err, LM_ERR_USAGE, "%s '%s': not an output dtype (use f32, f16 or "
                              "bf16)", shown, v);
        a->have_dtype = true;
        return LM_OK;
    case OPT_TOKENIZER:
        a->tokenizer = v;
        return LM_OK;
    case OPT_DATA_FORMAT:
        return lm_cmd_opt_data_format(shown, v, &a->calib_text, err);
    case OPT_RANK:
        if (!a->extract)
            return lm_err_set(err, LM_ERR_USAGE, "%s is llmerge extract's option: a merge written as an adapter "
                              "takes --to-lora RANK", shown);
        __attribute__((fallthrough));  // llmerge extract's --rank is --to-lora
    case OPT_TO_LORA: {
        if (strcmp(v, "exact") == 0 && !a->extract) {
            a->to_lora_exact = true;
            a->to_lora = 0;
            return LM_OK;
        }
        char *end = NULL;
        long r = strtol(v, &end, 10);
        if (!*v || *end || r < 1 || r > 65536)
            return lm_err_set(err, LM_ERR_USAGE, "%s '%s': the adapter's rank, a whole number from 1 to 65536%s, is "
                              "needed", shown, v, a->extract ? "" : " (or exact)");
        a->to_lora = (int)r;
        a->to_lora_exact = false;
        return LM_OK;
    }
    case OPT_TO_LORA_ENERGY: {
        char *end = NULL;
        double f = strtod(v, &end);
        if (!*v || *end || !(f > 0 && f <= 1))
            return lm_err_set(err, LM_ERR_USAGE, "%s '%s': a fraction of the energy in (0, 1] is needed", shown, v);
        a->to_lora_energy = f;
        return LM_OK;
    }
    case OPT_SHARD_SIZE:
        if ((s = lm_parse_size(v, &a->shard_size, err)) != LM_OK)
            return lm_err_prefix(err, "%s", shown);
        if (a->shard_size == 0)
            return lm_err_set(err, LM_ERR_USAGE, "%s %s: must be more than 0 bytes", shown, v);
        return LM_OK;
    case OPT_DEVICE:
        if (!*v)
            return lm_err_set(err, LM_ERR_USAGE, "%s needs a device (auto, cpu, cuda[:N] or sim:SIZE)", shown);
        a->device = v;
        return LM_OK;
    case OPT_GPU_MEM:
        return lm_cmd_opt_gpu_mem(shown, v, &a->gpu_mem, err);
    case OPT_THREADS:
        return lm_cmd_opt_threads(shown, v, &a->threads, err);
    case OPT_CACHE_DIR:
        if (!*v)
            return lm_err_set(err, LM_ERR_USAGE, "%s needs a directory", shown);
        a->cache_dir = v;
        return LM_OK;
    case OPT_LOG_JSON:
        if (!*v)
            return lm_err_set(err, LM_ERR_USAGE, "%s needs a file", shown);
        a->log_json = v;
        return LM_OK;
    case OPT_QUIET:
        a->quiet = true;
        return LM_OK;
    case OPT_VERBOSE:
        a->verbose++;
        return LM_OK;
    case OPT_NO_CARD:
        a->no_card = true;
        return LM_OK;
    case OPT_FORCE:
        a->force = true;
        return LM_OK;
    case OPT_CALIB: {
        if (!*v)
            return lm_err_set(err, LM_ERR_USAGE, "%s needs a file", shown);
        const char **c = realloc(a->calib, (size_t)(a->n_calib + 1) * sizeof *c);
        if (!c)
            return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
        a->calib = c;
        a->calib[a->n_calib++] = v;
        return LM_OK;
    }
    case OPT_CALIB_SAMPLES:
    case OPT_SEQ_LEN:
        if (!lm_cmd_parse_int(v, 1, INT64_MAX, d->id == OPT_SEQ_LEN ? &a->seq_len : &a->calib_samples))
            return lm_err_set(err, LM_ERR_USAGE, "%s %s: needs a whole number of at least 1", shown, v);
        return LM_OK;
    case OPT_STICKY:
        a->sticky = true;
        return LM_OK;
    case OPT_STRICT:
        a->strict = true;
        return LM_OK;
    case OPT_HESSIAN_FROM:
        if (strcmp(v, "ft") != 0 && strcmp(v, "base") != 0)
            return lm_err_set(err, LM_ERR_USAGE, "%s %s: use ft or base", shown, v);
        a->hessian_from_base = strcmp(v, "base") == 0;
        return LM_OK;
    case OPT_T:
        if (is_setting(v) || strchr(v, ','))
            return parse_settings(a, SET_T, shown, v, true, err);
        if (!parse_number(v, &a->t))
            return lm_err_set(err, LM_ERR_USAGE, "%s '%s' is not a number", shown, v);
        return LM_OK;
    case OPT_MAX_ITER: {
        int64_t n;
        if (!lm_cmd_parse_int(v, 0, 1000000, &n))
            return lm_err_set(err, LM_ERR_USAGE, "%s %s: needs a whole number from 0 to 1000000", shown, v);
        a->max_iter = (int)n;
        return LM_OK;
    }
    case OPT_RAM_R:
    case OPT_RAM_ALPHA: {
        double *x = d->id == OPT_RAM_R ? &a->ram_r : &a->ram_alpha;
        if (!parse_number(v, x) || !isfinite(*x))
            return lm_err_set(err, LM_ERR_USAGE, "%s '%s' is not a finite number", shown, v);
        return LM_OK;
    }
    case OPT_TOL:
        if (!parse_number(v, &a->tol) || a->tol < 0)
            return lm_err_set(err, LM_ERR_USAGE, "%s '%s' is not a number of at least 0", shown, v);
        return LM_OK;
    case OPT_MODELS_ONLY:
        a->models_only = true;
        return LM_OK;
    case OPT_PER_ROW:
        a->per_row = true;
        return LM_OK;
    case OPT_PER_COL:
        a->per_col = true;
        return LM_OK;
    case OPT_SELECT_TOPK:
        if (is_setting(v) || strchr(v, ','))
            return parse_settings(a, SET_SELECT_TOPK, shown, v, true, err);
        if (!parse_number(v, &a->select_topk))
            return lm_err_set(err, LM_ERR_USAGE, "%s '%s' is not a number", shown, v);
        return LM_OK;
    case OPT_EPSILON:
        if (is_setting(v))
            return parse_settings(a, SET_EPSILON, shown, v, false, err);
        if ((s = parse_list(shown, v, &a->epsilons, &a->n_epsilons, err)) != LM_OK)
            return s;
        for (int i = 0; i < a->n_epsilons; i++)
            if (a->m && a->m->threshold ? !(a->epsilons[i] >= 0.0 && isfinite(a->epsilons[i]))
                                        : !(a->epsilons[i] >= 0.0 && a->epsilons[i] < 0.5))
                return lm_err_set(err, LM_ERR_USAGE, "%s %s: an epsilon must be %s", shown, v,
                                  a->m && a->m->threshold ? "a finite number of 0 or more" : "in [0, 0.5)");
        return LM_OK;
    case OPT_GAMMA:
        if (is_setting(v))
            return parse_settings(a, SET_GAMMA, shown, v, false, err);
        if ((s = parse_list(shown, v, &a->gammas, &a->n_gammas, err)) != LM_OK)
            return s;
        for (int i = 0; i < a->n_gammas; i++)
            if (!(a->gammas[i] >= 0.0 && a->gammas[i] <= 1.0))
                return lm_err_set(err, LM_ERR_USAGE, "%s %s: a gamma must be in [0, 1], the fraction of largest "
                                  "magnitudes dropped", shown, v);
        return LM_OK;
    case OPT_HELP:
        a->help = true;
        return LM_OK;
    }
    return LM_OK;
}

static lm_status on_operand(void *ctx, const char *arg, lm_err *err)
{
    merge_args *a = ctx;
    (void)err;
    if (!a->base)
        a->base = arg;
    else
        a->fts[a->n_ft++] = arg;
    return LM_OK;
}

void lm_merge_args_defaults(merge_args *a)
{
    a->lambda = 1.0;
    a->normalize = -1;
    a->shard_size = DEFAULT_SHARD_SIZE;
    a->device = "auto";
    a->t = 0.5;
    a->select_topk = 1.0;
    a->max_iter = 10;
    a->tol = 1e-5;
    a->ram_r = 0.1;
    a->ram_alpha = 0.2;
}

// Parses argv into *a (zeroed by the caller, m set). Positional arguments are BASE then the FTs,
// anywhere among the options; "--" ends the options.
lm_status lm_merge_parse_args(merge_args *a, int argc, char **argv, lm_err *err)
{
    a->use = lm_merge_uses(a->m);
    lm_merge_args_defaults(a);
    a->fts = calloc((size_t)argc, sizeof *a->fts);
    if (!a->fts)
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    return lm_cmd_scan(argc, argv, lm_merge_opt_defs, lm_merge_n_opts, lm_merge_apply_option, on_operand, a, err);
}
