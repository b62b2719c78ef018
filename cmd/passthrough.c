// `llmerge passthrough -o OUT --slice MODEL:FROM:TO[:SCALE] [--slice ...] [options]`: layer
// stacking, mergekit's passthrough merge with slices (passthrough.h; docs/merging.md
// "Passthrough: layer stacking"). The slices' layers are stacked in order into OUT, the
// embeddings taken from the first slice's model and the final norm and lm_head from the last's.
//
// As in the merge commands (merge.c): everything that can be checked is checked before any work
// starts, and a problem found then is exit status 2 naming it (the options, OUT, each slice's
// model and range, the models against each other); the output goes into a temporary directory
// beside OUT (outdir.h), streamed tensor by tensor, with config.json (num_hidden_layers the
// total, the dtype updated), the first slice's model's tokenizer and generation files, the model
// card and llmerge.json, and is renamed into place; a failure from then on removes it and is
// exit status 1; a signal stops the run at the next tensor with 128 + the signal.
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "adapter.h"
#include "args.h"
#include "card.h"
#include "cmd.h"
#include "command.h"
#include "hasher.h"
#include "manifest.h"
#include "model.h"
#include "outdir.h"
#include "passthrough.h"
#include "progress.h"
#include "signals.h"
#include "st_writer.h"
#include "status.h"
#include "util.h"

#define DEFAULT_SHARD_SIZE 5000000000ull  // "5GB", as transformers and the merge commands

enum {
    OPT_OUTPUT,
    OPT_SLICE,
    OPT_DTYPE,
    OPT_SHARD_SIZE,
    OPT_LOG_JSON,
    OPT_QUIET,
    OPT_FORCE,
    OPT_NO_CARD,
    OPT_HELP,
    OPT_TO_LORA,  // the merge commands' options a passthrough cannot take, refused with the reason
};

static const lm_opt opt_defs[] = {
    {"output", 'o', true, OPT_OUTPUT},
    {"slice", 0, true, OPT_SLICE},
    {"dtype", 0, true, OPT_DTYPE},
    {"shard-size", 0, true, OPT_SHARD_SIZE},
    {"log-json", 0, true, OPT_LOG_JSON},
    {"quiet", 'q', false, OPT_QUIET},
    {"force", 0, false, OPT_FORCE},
    {"no-card", 0, false, OPT_NO_CARD},
    {"help", 'h', false, OPT_HELP},
    {"to-lora", 0, true, OPT_TO_LORA},
    {"to-lora-energy", 0, true, OPT_TO_LORA},
};
#define N_OPTS (sizeof opt_defs / sizeof opt_defs[0])

// One --slice as given.
typedef struct slice_arg {
    const char *value;  // "MODEL:FROM:TO[:SCALE]" as given
    char *model;        // MODEL (then resolved by lm_input_detect)
    int64_t from, to;
    double scale;
    bool has_scale;
    char scale_text[40];  // SCALE as given, for the card
} slice_arg;

typedef struct pt_run {
    lm_progress progress;
    lm_guard guard;
    double t0;
    // the command line
    const char *out;
    slice_arg *slices;    // (n_slices)
    int n_slices;
    lm_dtype dtype;
    bool have_dtype;
    uint64_t shard_size;
    bool quiet, force, no_card, help;
    // prepared
    lm_pt_source *src;    // (n_slices) the slices with their models resolved
    lm_pt_plan_t *plan;
    lm_dtype out_dtype;
    lm_st_desc *descs;    // (n_descs)
    int64_t n_descs;
    // the work
    lm_outdir od;
    lm_st_writer *writer;
    lm_hasher *hasher;
    lm_manifest manifest;
    lm_pt_result res;
    const char *config_text;  // llmerge run: the configuration, written as mergekit_config.yml
    const char *chat_template;  // llmerge run: the chat template OUT's tokenizer gets, or NULL
} pt_run;

static void usage(FILE *out, const void *arg)
{
    (void)arg;
    fprintf(out,
            "Usage: llmerge passthrough -o OUT --slice MODEL:FROM:TO[:SCALE] [--slice ...] [options]\n"
            "\n"
            "Layer stacking (a \"frankenmerge\"), mergekit's passthrough merge with slices: each\n"
            "--slice takes the layers FROM to TO - 1 of MODEL (mergekit's layer_range: [FROM, TO]),\n"
            "and OUT's layers are the slices' layers in the order given, each tensor of a layer\n"
            "renamed to its place in the stack (model.layers.<i>.*). The embeddings come from the\n"
            "first slice's MODEL, the final norm and lm_head from the last slice's; config.json is\n"
            "the first slice's MODEL's with num_hidden_layers the total (and per-layer arrays such\n"
            "as layer_types stacked the same way). SCALE, when given, multiplies every tensor taken\n"
            "from that slice, as mergekit's scale parameter does. The models must be of one\n"
            "architecture, with the same shape for each kind of tensor. MODEL is a Hugging Face\n"
            "model directory; FROM, TO and SCALE are read from the end, so a MODEL whose path ends\n"
            "in ':' and a number (dir:3) needs SCALE written out (dir:3:0:2:1).\n"
            "\n"
            "Options (also as --name=value):\n"
            "  -o, --output DIR       the output model directory (required); an existing one is\n"
            "                         refused unless --force is given\n"
            "  --slice MODEL:FROM:TO[:SCALE]\n"
            "                         a slice, in output order (at least one)\n"
            "  --dtype f32|f16|bf16   output dtype (default: the first slice's MODEL's, from\n"
            "                         config.json or else its tensors); a tensor kept in its dtype\n"
            "                         without a scale is copied byte for byte\n"
            "  --shard-size SIZE      most tensor bytes per output shard (default 5GB); SIZE is\n"
            "                         bytes with K, M, G, KiB, MiB, GiB (powers of 1024) or KB,\n"
            "                         MB, GB (powers of 1000, as transformers)\n"
            "  --log-json FILE        write one JSON object per event to FILE (JSON Lines):\n"
            "                         start, each tensor, end, error or interrupted (default: none)\n"
            "  -q, --quiet            nothing on stderr but errors\n"
            "  --force                replace OUT if it exists (it is replaced only at the end)\n"
            "  --no-card              do not write README.md, the model card, into OUT\n"
            "  -h, --help             this help\n"
            "\n"
            "OUT gets the stacked weights (model.safetensors, or shards and\n"
            "model.safetensors.index.json), config.json, the first slice's MODEL's tokenizer and\n"
            "generation files, README.md (the model card, unless --no-card) and llmerge.json (the\n"
            "slices, the inputs with xxHash64 of their files, per-tensor xxHash64 of the output).\n"
            "While it works, OUT.tmp-XXXXXX beside OUT holds the partial output and OUT.lock keeps\n"
            "a second llmerge from writing the same OUT; a failed or interrupted run leaves nothing.\n"
            "\n"
            "Exit status: 0 done, 1 the work failed, 2 bad usage or bad input, 128 + N stopped by\n"
            "signal N.\n");
}

static void run_free(pt_run *r)
{
    lm_hasher_free(r->hasher);
    lm_manifest_free(&r->manifest);
    lm_st_writer_free(r->writer);
    lm_outdir_abort(&r->od);
    lm_pt_result_free(&r->res);
    free(r->descs);
    lm_pt_plan_free(r->plan);
    free(r->src);
    for (int i = 0; i < r->n_slices; i++)
        free(r->slices[i].model);
    free(r->slices);
    lm_guard_free(&r->guard);
    lm_progress_free(&r->progress);
}

// ==== the command line ========================================================================

// Reads "MODEL:FROM:TO" or "MODEL:FROM:TO:SCALE" into *s: the numbers are the last two or three
// ':'-separated fields, so MODEL may hold ':' itself.
static lm_status parse_slice(slice_arg *s, const char *shown, const char *v, lm_err *err)
{
    const char *c[3] = {NULL, NULL, NULL};  // the last three colons, c[0] the last
    int n = 0;
    for (const char *p = v + strlen(v); p > v && n < 3;)
        if (*--p == ':')
            c[n++] = p;
    char num[3][40];
    for (int i = 0; i < n; i++) {
        const char *end = i == 0 ? v + strlen(v) : c[i - 1];
        size_t len = (size_t)(end - c[i] - 1);
        snprintf(num[i], sizeof num[i], "%.*s", len < sizeof num[i] ? (int)len : 0, c[i] + 1);
        if (len >= sizeof num[i])
            num[i][0] = '\0';
    }
    // with a scale: TO in num[1], FROM in num[2]
    char *end = NULL;
    double scale = n == 3 ? strtod(num[0], &end) : 0;
    bool scaled = n == 3 && num[0][0] && *end == '\0' && isfinite(scale) && c[2] > v &&
                  lm_cmd_parse_int(num[2], 0, INT64_MAX, &s->from) && lm_cmd_parse_int(num[1], 0, INT64_MAX, &s->to);
    if (scaled) {
        s->model = malloc((size_t)(c[2] - v) + 1);
        if (s->model)
            snprintf(s->model, (size_t)(c[2] - v) + 1, "%s", v);
        s->scale = scale;
        s->has_scale = true;
        snprintf(s->scale_text, sizeof s->scale_text, "%s", num[0]);
    } else if (n >= 2 && c[1] > v && lm_cmd_parse_int(num[1], 0, INT64_MAX, &s->from) &&
               lm_cmd_parse_int(num[0], 0, INT64_MAX, &s->to)) {
        s->model = malloc((size_t)(c[1] - v) + 1);
        if (s->model)
            snprintf(s->model, (size_t)(c[1] - v) + 1, "%s", v);
    } else {
        return lm_err_set(err, LM_ERR_USAGE, "%s '%s': use MODEL:FROM:TO or MODEL:FROM:TO:SCALE (the layers FROM "
                          "to TO - 1 of MODEL, FROM and TO whole numbers, SCALE a number)", shown, v);
    }
    if (!s->model)
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    return LM_OK;
}

static lm_status apply_option(void *ctx, const lm_opt *d, const char *shown, const char *v, lm_err *err)
{
    pt_run *r = ctx;
    lm_status s;
    switch (d->id) {
    case OPT_OUTPUT:
        if (!*v)
            return lm_err_set(err, LM_ERR_USAGE, "%s needs a directory", shown);
        r->out = v;
        return LM_OK;
    case OPT_SLICE: {
        slice_arg *grown = realloc(r->slices, (size_t)(r->n_slices + 1) * sizeof *grown);
        if (!grown)
            return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
        r->slices = grown;
        slice_arg *sl = &r->slices[r->n_slices++];
        memset(sl, 0, sizeof *sl);
        sl->value = v;
        s = parse_slice(sl, shown, v, err);
        // the model is an input no output may be, also when the rest of the line is bad
        char what[32];
        snprintf(what, sizeof what, "slice %d", r->n_slices);
        lm_err gerr;
        if (lm_guard_add(&r->guard, what, sl->model ? sl->model : v, &gerr) != LM_OK && s == LM_OK)
            s = lm_err_set(err, LM_ERR_NOMEM, "%s", gerr.msg);
        return s;
    }
    case OPT_DTYPE:
        if (!lm_dtype_from_user(v, &r->dtype) || !lm_dtype_writable(r->dtype))
            return lm_err_set(err, LM_ERR_USAGE, "%s '%s': not an output dtype (use f32, f16 or bf16)", shown, v);
        r->have_dtype = true;
        return LM_OK;
    case OPT_SHARD_SIZE:
        if ((s = lm_parse_size(v, &r->shard_size, err)) != LM_OK)
            return lm_err_prefix(err, "%s", shown);
        if (r->shard_size == 0)
            return lm_err_set(err, LM_ERR_USAGE, "%s %s: must be more than 0 bytes", shown, v);
        return LM_OK;
    case OPT_LOG_JSON:
        if (!*v)
            return lm_err_set(err, LM_ERR_USAGE, "%s needs a file", shown);
        return LM_OK;  // opened by the skeleton (command.h)
    case OPT_QUIET:
        r->quiet = true;
        return LM_OK;
    case OPT_FORCE:
        r->force = true;
        return LM_OK;
    case OPT_NO_CARD:
        r->no_card = true;
        return LM_OK;
    case OPT_HELP:
        r->help = true;
        return LM_OK;
    case OPT_TO_LORA:
        return lm_err_set(err, LM_ERR_USAGE, "%s: a passthrough stacks layers into a new model, which has no base "
                          "to be an adapter of", shown);
    }
    return LM_OK;
}

static lm_status on_operand(void *ctx, const char *arg, lm_err *err)
{
    (void)ctx;
    return lm_err_set(err, LM_ERR_USAGE, "'%s': passthrough takes its models in --slice MODEL:FROM:TO options, not "
                      "as operands", arg);
}

static lm_status parse(void *ctx, int argc, char **argv, lm_err *err)
{
    pt_run *r = ctx;
    r->shard_size = DEFAULT_SHARD_SIZE;
    return lm_cmd_scan(argc, argv, opt_defs, N_OPTS, apply_option, on_operand, r, err);
}

// ==== before the work =========================================================================

// Everything before the work: OUT checked, the slices' models resolved, opened and planned.
static lm_status prepare(void *ctx, bool *no_log, lm_err *err)
{
    (void)no_log;
    pt_run *r = ctx;
    lm_status s;
    if (r->n_slices == 0)
        return lm_err_set(err, LM_ERR_USAGE, "no slices: give --slice MODEL:FROM:TO at least once (usage: llmerge "
                          "passthrough -o OUT --slice MODEL:FROM:TO [--slice ...])");
    if (!r->out)
        return lm_err_set(err, LM_ERR_USAGE, "no output directory: give -o OUT");
    if ((s = lm_guard_check_outdir(&r->guard, r->out, err)) != LM_OK)
        return s;
    struct stat st;
    if (lstat(r->out, &st) == 0 && !r->force)
        return lm_err_set(err, LM_ERR_USAGE, "%s: already exists (use --force to replace it)", r->out);
    char *parent = lm_path_parent(r->out);
    if (!parent)
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    s = lm_is_dir(parent) ? LM_OK : lm_err_set(err, LM_ERR_NOT_FOUND, "%s: its parent directory %s does not exist",
                                              r->out, parent);
    free(parent);
    if (s != LM_OK)
        return s;

    if (!(r->src = calloc((size_t)r->n_slices, sizeof *r->src)))
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    for (int i = 0; i < r->n_slices; i++) {
        slice_arg *sl = &r->slices[i];
        lm_input_kind kind;
        char *resolved = NULL;
        if ((s = lm_input_detect(sl->model, &kind, &resolved, err)) != LM_OK)
            return lm_err_prefix(err, "slice %d", i + 1);
        if (kind != LM_INPUT_MODEL) {
            s = lm_err_set(err, LM_ERR_USAGE, "slice %d: %s is not a model directory (it is %s %s); a slice takes "
                           "the layers of a model", i + 1, sl->model, kind == LM_INPUT_ADAPTER ? "an" : "a",
                           lm_input_kind_name(kind));
            free(resolved);
            return s;
        }
        free(sl->model);
        sl->model = resolved;
        r->src[i] = (lm_pt_source){sl->model, sl->from, sl->to, sl->scale, sl->has_scale};
    }
    if ((s = lm_pt_plan(&r->plan, r->src, r->n_slices, err)) != LM_OK)
        return s;
    // again, with every file the models were read from: a link to one of them is caught too
    for (int i = 0; i < r->n_slices; i++) {
        char what[32];
        snprintf(what, sizeof what, "slice %d", i + 1);
        if ((s = lm_cmd_guard_model(&r->guard, what, lm_pt_model(r->plan, lm_pt_slice_model(r->plan, i)), err)) !=
            LM_OK)
            return s;
    }
    if ((s = lm_guard_check_outdir(&r->guard, r->out, err)) != LM_OK)
        return s;
    r->out_dtype = r->have_dtype ? r->dtype : lm_model_out_dtype(lm_pt_model(r->plan, 0));
    return lm_pt_outputs(r->plan, r->out_dtype, &r->descs, &r->n_descs, err);
}

// ==== the model card ==========================================================================

// OUT's README.md: the Hub ids of the models in the front matter (where they are in the Hub's
// cache), then the slices, the options and a command line that makes the same stack again.
static lm_status write_card(pt_run *r, lm_err *err)
{
    lm_buf b = {0};
    char id[256], num[40], h[32];
    int n_models = lm_pt_n_models(r->plan), n_ids = 0;
    for (int m = 0; m < n_models; m++)
        if (lm_card_hub_id(lm_pt_model(r->plan, m)->dir, id, sizeof id)) {
            lm_buf_str(&b, n_ids++ ? "- " : "---\nbase_model:\n- ");
            lm_card_yaml_str(&b, id);
            lm_buf_str(&b, "\n");
        }
    lm_buf_str(&b, n_ids ? "base_model_relation: merge\n" : "---\n");
    lm_buf_str(&b, "library_name: transformers\ntags:\n- merge\n- llmerge\n---\n\n# ");
    char name[PATH_MAX];  // OUT's last component names the model
    snprintf(name, sizeof name, "%s", r->out);
    for (size_t len = strlen(name); len > 1 && name[len - 1] == '/'; len--)
        name[len - 1] = '\0';
    const char *title = lm_path_base(name);
    for (const char *t = *title ? title : "stacked model"; *t; t++)
        lm_buf_put(&b, (unsigned char)*t < 0x20 ? " " : t, 1);
    lm_buf_fmt(&b, "\n\nA stack of the layers of %d slice%s of %d model%s (a passthrough merge), made with llmerge "
               LLMERGE_VERSION ".\n\n## Slices\n\n", r->n_slices, r->n_slices == 1 ? "" : "s", n_models,
               n_models == 1 ? "" : "s");
    int64_t at = 0;
    for (int i = 0; i < r->n_slices; i++) {
        const slice_arg *sl = &r->slices[i];
        int64_t n = sl->to - sl->from;
        lm_buf_fmt(&b, "%d. layers %" PRId64 " to %" PRId64 " of ", i + 1, sl->from, sl->to - 1);
        lm_card_md_code(&b, sl->model);
        lm_buf_fmt(&b, " as layers %" PRId64 " to %" PRId64, at, at + n - 1);
        if (sl->has_scale) {
            lm_card_number(num, sizeof num, sl->scale);
            lm_buf_fmt(&b, ", every tensor times %s", num);
        }
        lm_buf_str(&b, "\n");
        at += n;
    }
    lm_buf_str(&b, "\nThe embeddings come from ");
    lm_card_md_code(&b, r->slices[0].model);
    lm_buf_str(&b, ", the tensors after the layers (the final norm, lm_head) from ");
    lm_card_md_code(&b, r->slices[r->n_slices - 1].model);
    lm_buf_fmt(&b, ", config.json from the first with num_hidden_layers %" PRId64 ".\n\n## Options\n\n- dtype: %s\n"
               "- shard size: %s (%" PRIu64 " bytes)\n", lm_pt_n_layers(r->plan), lm_cmd_dtype_flag(r->out_dtype),
               lm_format_bytes(h, sizeof h, r->shard_size), r->shard_size);

    // the command line, each slice's model as resolved
    lm_buf cmd = {0};
    char shard[24];
    snprintf(shard, sizeof shard, "%" PRIu64, r->shard_size);
    const char *words[] = {"llmerge", "passthrough", "-o", r->out};
    for (size_t i = 0; i < sizeof words / sizeof words[0]; i++) {
        lm_card_shell_word(&cmd, words[i]);
        lm_buf_str(&cmd, " ");
    }
    for (int i = 0; i < r->n_slices; i++) {
        const slice_arg *sl = &r->slices[i];
        lm_buf sv = {0};
        lm_buf_str(&sv, sl->model);
        lm_buf_fmt(&sv, ":%" PRId64 ":%" PRId64, sl->from, sl->to);
        if (sl->has_scale)
            lm_buf_fmt(&sv, ":%s", sl->scale_text);
        lm_buf_str(&cmd, "--slice ");
        if (sv.p)
            lm_card_shell_word(&cmd, sv.p);
        cmd.oom |= sv.oom;
        free(sv.p);
        lm_buf_str(&cmd, " ");
    }
    lm_buf_fmt(&cmd, "--dtype %s --shard-size %s", lm_cmd_dtype_flag(r->out_dtype), shard);
    lm_buf_str(&b, "\n## Making it again\n\nWith llmerge " LLMERGE_VERSION ", from the same inputs:\n\n```sh\n");
    if (cmd.p)
        lm_buf_str(&b, cmd.p);
    lm_buf_str(&b, "\n```\n\n`llmerge.json`, beside this card, records the slices, the inputs with the xxHash64 of "
               "their files and the xxHash64 of each output tensor.\n");
    if (n_ids < n_models)
        lm_buf_str(&b, "\nSome of the models above were given to llmerge as local paths, which the front matter's "
                   "`base_model` list leaves out (it takes Hub ids only): before uploading this model, add their Hub "
                   "ids there, and `base_model_relation: merge` if it is missing.\n");
    bool oom = b.oom || cmd.oom;
    free(cmd.p);
    lm_status s = LM_OK;
    char *path = lm_path_join(r->od.tmp, LM_CARD_NAME);
    if (oom || !path)
        s = lm_err_set(err, LM_ERR_NOMEM, "out of memory writing the model card");
    else
        s = lm_write_file(path, b.p, b.len, err);
    free(path);
    free(b.p);
    return s;
}

// ==== llmerge.json ============================================================================

// Starts hashing the files of every model for llmerge.json while the tensors are written.
static lm_status start_hasher(pt_run *r, lm_err *err)
{
    int n_models = lm_pt_n_models(r->plan), cap = 0, n = 0;
    for (int m = 0; m < n_models; m++)
        cap += 2 + lm_pt_model(r->plan, m)->n_shards;
    const char **paths = malloc((size_t)cap * sizeof *paths);
    if (!paths)
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    for (int m = 0; m < n_models; m++) {
        const lm_model *md = lm_pt_model(r->plan, m);
        paths[n++] = md->config.path;
        if (md->index_path)
            paths[n++] = md->index_path;
        for (int j = 0; j < md->n_shards; j++)
            paths[n++] = md->shards[j].path;
    }
    lm_status s = lm_hasher_start(&r->hasher, paths, n, err);
    free(paths);
    return s;
}

// llmerge.json: the slices under options, the first slice's model as the base and every other
// model as an input, the outputs with their hashes, the counts.
static lm_status build_manifest(pt_run *r, double *hash_s, lm_err *err)
{
    lm_manifest *m = &r->manifest;
    lm_status s = lm_manifest_init(m, "passthrough", err);
    if (s != LM_OK)
        return s;
    cJSON *opt = m->options, *slices = cJSON_AddArrayToObject(opt, "slices");
    bool ok = slices != NULL;
    int64_t at = 0;
    for (int i = 0; ok && i < r->n_slices; i++) {
        const slice_arg *sl = &r->slices[i];
        cJSON *o = cJSON_CreateObject();
        if (!o || !cJSON_AddItemToArray(slices, o)) {
            cJSON_Delete(o);
            ok = false;
            break;
        }
        char *abs = lm_guard_resolve(sl->model);  // llmerge.json's paths are absolute
        ok = abs && cJSON_AddStringToObject(o, "model", abs);
        free(abs);
        cJSON *range = ok ? cJSON_AddArrayToObject(o, "layer_range") : NULL;
        cJSON *out = range ? cJSON_AddArrayToObject(o, "output_layers") : NULL;
        const double v[4] = {(double)sl->from, (double)sl->to, (double)at, (double)(at + sl->to - sl->from)};
        ok = out && (sl->has_scale ? cJSON_AddNumberToObject(o, "scale", sl->scale) : cJSON_AddNullToObject(o, "scale"));
        for (int k = 0; ok && k < 4; k++) {
            cJSON *x = cJSON_CreateNumber(v[k]);
            if (!x || !cJSON_AddItemToArray(k < 2 ? range : out, x)) {
                cJSON_Delete(x);
                ok = false;
            }
        }
        at += sl->to - sl->from;
    }
    ok = ok && cJSON_AddNumberToObject(opt, "num_hidden_layers", (double)lm_pt_n_layers(r->plan)) &&
         cJSON_AddStringToObject(opt, "dtype", lm_cmd_dtype_flag(r->out_dtype)) &&
         cJSON_AddNumberToObject(opt, "shard_size", (double)r->shard_size);
    if (!ok)
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");

    double t = lm_now();
    m->hasher = r->hasher;
    if ((s = lm_manifest_set_base(m, lm_pt_model(r->plan, 0), err)) != LM_OK)
        return s;
    for (int i = 1; i < lm_pt_n_models(r->plan); i++)
        if ((s = lm_manifest_add_input(m, lm_pt_model(r->plan, i), NULL, err)) != LM_OK)
            return s;
    *hash_s = lm_now() - t;
    if ((s = lm_manifest_set_outputs(m, r->od.tmp, lm_st_writer_plan(r->writer), r->descs, r->n_descs, r->res.xxh64,
                                     err)) != LM_OK)
        return s;
    if (!(r->no_card ? cJSON_AddNullToObject(m->outputs, "card") : cJSON_AddStringToObject(m->outputs, "card",
                                                                                          LM_CARD_NAME)))
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    if ((s = lm_manifest_add_device_units(m, "cpu", r->n_descs, err)) != LM_OK)
        return s;
    // a scaled or converted tensor is computed, the others copied
    return lm_manifest_set_stats(m, r->res.bytes_in, r->res.bytes_out, r->res.n_scaled + r->res.n_converted,
                                 r->res.n_copied, err);
}

// ==== the work ================================================================================

static void on_tensor(void *ctx, int64_t done, int64_t total, const char *name, uint64_t bytes_done,
                      uint64_t bytes_total)
{
    lm_progress *p = &((pt_run *)ctx)->progress;
    if (total != p->n_total || bytes_total != p->bytes_total)
        lm_progress_set_total(p, total, bytes_total);
    lm_progress_update(p, done, bytes_done, name);
    lm_test_delay();  // LLMERGE_TEST_DELAY_MS, for the tests that interrupt a run
}

static cJSON *start_event(const pt_run *r)
{
    cJSON *f = cJSON_CreateObject(), *sl = cJSON_AddArrayToObject(f, "slices");
    cJSON_AddStringToObject(f, "method", "passthrough");
    for (int i = 0; sl && i < r->n_slices; i++) {
        cJSON *e = cJSON_CreateObject();
        cJSON_AddStringToObject(e, "model", r->slices[i].model);
        cJSON_AddNumberToObject(e, "from", (double)r->slices[i].from);
        cJSON_AddNumberToObject(e, "to", (double)r->slices[i].to);
        if (r->slices[i].has_scale)
            cJSON_AddNumberToObject(e, "scale", r->slices[i].scale);
        cJSON_AddItemToArray(sl, e);
    }
    cJSON_AddStringToObject(f, "output", r->out);
    cJSON_AddStringToObject(f, "dtype", lm_cmd_dtype_flag(r->out_dtype));
    cJSON_AddNumberToObject(f, "num_hidden_layers", (double)lm_pt_n_layers(r->plan));
    cJSON_AddNumberToObject(f, "n_tensors", (double)r->n_descs);
    return f;
}

// Writes the stack into a temporary directory and renames it to OUT. Returns the exit status.
static int work(void *ctx)
{
    pt_run *r = ctx;
    lm_progress *p = &r->progress;
    lm_err err = {0};
    double t_loaded = lm_now();
    int code = lm_cmd_output_begin(&r->od, r->out, r->force, p);
    if (code)
        return code;
    lm_status s = LM_OK;
    lm_progress_event(p, "start", start_event(r));
    lm_progress_note(p, "stacking %" PRId64 " layers from %d slice%s of %d model%s into %s (%s)",
                     lm_pt_n_layers(r->plan), r->n_slices, r->n_slices == 1 ? "" : "s", lm_pt_n_models(r->plan),
                     lm_pt_n_models(r->plan) == 1 ? "" : "s", r->out, lm_cmd_dtype_flag(r->out_dtype));

    char *path = NULL;
    int n_side = 0;
    double t_write = lm_now(), t_written = 0, hash_s = 0;
    if ((s = lm_st_writer_open(&r->writer, r->od.tmp, r->descs, r->n_descs, r->shard_size, NULL, &err)) != LM_OK ||
        (s = start_hasher(r, &err)) != LM_OK)
        goto fail;
    lm_progress_start(p, "tensor", r->n_descs, 0);
    s = lm_pt_write(r->plan, r->out_dtype, r->writer, 0, on_tensor, r, &r->res, &err);
    lm_progress_end(p);
    if (s != LM_OK || (s = lm_st_writer_finish(r->writer, &err)) != LM_OK)
        goto fail;
    double t_tensors = lm_now();

    // config.json: the plan's, then its dtype set as a merge sets it
    if (!(path = lm_path_join(r->od.tmp, "config.json"))) {
        s = lm_err_set(&err, LM_ERR_NOMEM, "out of memory");
        goto fail;
    }
    const char *config = lm_pt_config(r->plan);
    if ((s = lm_write_file(path, config, strlen(config), &err)) != LM_OK ||
        (s = lm_manifest_write_config(path, path, r->out_dtype, 0, &err)) != LM_OK)
        goto fail;
    free(path);
    path = NULL;
    if ((s = lm_manifest_copy_side_files(lm_pt_model(r->plan, 0)->dir, r->od.tmp, &n_side, &err)) != LM_OK ||
        (s = lm_cmd_config_files(r->od.tmp, r->config_text, r->chat_template, &err)) != LM_OK ||
        (!r->no_card && (s = write_card(r, &err)) != LM_OK))
        goto fail;
    t_written = lm_now();
    if ((s = build_manifest(r, &hash_s, &err)) != LM_OK)
        goto fail;
    lm_manifest_timings tm = {
        .load_s = t_loaded - r->t0, .merge_s = t_tensors - t_write, .write_s = t_written - t_tensors,
        .hash_s = hash_s, .total_s = lm_now() - r->t0,
    };
    int n_shards = 0;
    if ((s = lm_cmd_finish_output(&r->manifest, &tm, &r->od, &r->writer, &n_shards, &err)) != LM_OK)
        goto fail;

    char what[160];
    snprintf(what, sizeof what, "stacked %" PRId64 " layers: wrote %" PRId64 " tensor%s (%" PRId64 " scaled, %" PRId64
             " converted, %" PRId64 " copied)", lm_pt_n_layers(r->plan), r->n_descs, r->n_descs == 1 ? "" : "s",
             r->res.n_scaled, r->res.n_converted, r->res.n_copied);
    lm_progress_summary_as(p, what);
    lm_cmd_note_written(p, r->out, n_shards, n_side, !r->no_card);
    cJSON *f = lm_cmd_end_event(r->out, r->t0);
    cJSON_AddNumberToObject(f, "tensors", (double)r->n_descs);
    cJSON_AddNumberToObject(f, "bytes_in", (double)r->res.bytes_in);
    cJSON_AddNumberToObject(f, "bytes_out", (double)r->res.bytes_out);
    lm_cmd_end_send(p, f, n_shards);
    return 0;

fail:
    free(path);
    return lm_cmd_output_failed(s, &err, &r->od, &r->writer, p, r->out);
}

static void cleanup(void *ctx)
{
    run_free(ctx);
}

int lm_cmd_passthrough(int argc, char **argv)
{
    return lm_cmd_passthrough_config(argc, argv, NULL, NULL, "llmerge passthrough");
}

int lm_cmd_passthrough_config(int argc, char **argv, const char *config_text, const char *chat_template,
                              const char *prefix)
{
    pt_run r;
    memset(&r, 0, sizeof r);
    r.t0 = lm_now();
    r.config_text = config_text;
    r.chat_template = chat_template;
    lm_command c = {
        .prefix = prefix, .log_error_prefix = "", .progress = &r.progress, .guard = &r.guard,
        .opts = opt_defs, .n_opts = N_OPTS, .inputs = NULL, .n_inputs = 0, .first = "MODEL", .rest = "MODEL",
        .help = &r.help, .quiet = &r.quiet, .usage = usage, .usage_arg = NULL, .parse = parse, .prepare = prepare,
        .work = work, .cleanup = cleanup, .ctx = &r,
    };
    return lm_command_run(&c, argc, argv);
}
