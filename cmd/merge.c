// `llmerge ties | dare | dare-ties | task-arithmetic BASE FT [FT...] -o OUT [options]`: the merge
// commands, sparsegpt's too. One file runs every method; argv[0] says which. The command line
// (the methods, their options, --help) is parsed by merge_args.c, to the contract of
// docs/design.md "Options every merge takes".
//
// Everything that can be checked is checked before any work starts, and a problem found then
// is exit status 2 with a message naming it: option values and counts, OUT (missing, existing
// without --force, or holding an input), BASE (a model directory), each FT (opened and checked
// against BASE: an adapter made for another base names the key and both shapes), the merge
// options against each other, the device. Only then does the work start: the output goes into
// a temporary directory beside OUT (outdir.h), is filled with the shards (the merge engine
// streams tensor by tensor into the writer), config.json with the dtype updated, the base's
// tokenizer and generation files and llmerge.json (manifest.h), and is renamed into place.
// A failure from then on removes the temporary directory and is exit status 1. From the start
// of the work until OUT is in place, SIGINT, SIGTERM, SIGHUP and SIGQUIT stop the run at the
// next tensor (or slab of a large one), remove the temporary directory, and exit with 128 + the
// signal (130, 143, 129, 131); a second signal, or an input truncated under the run (SIGBUS),
// ends it at once after the same cleanup (signals.h); another run writing the same OUT is
// refused with exit status 2 (outdir.h). No output (OUT, OUT.lock, --log-json, --cache-dir)
// may be, hold or lie inside an input (outdir.h's lm_guard), which is checked before anything is
// created or truncated: the log is opened only after the inputs are.
#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "adapter.h"
#include "args.h"
#include "cmd.h"
#include "command.h"
#include "cache.h"
#include "card.h"
#include "calib.h"
#include "device.h"
#include "device_registry.h"
#include "hessian.h"
#include "manifest.h"
#include "merge.h"
#include "merge_args.h"
#include "model.h"
#include "outdir.h"
#include "progress.h"
#include "signals.h"
#include "sparsegpt.h"
#include "st_writer.h"
#include "status.h"
#include "util.h"

// ==== the run =================================================================================

// A tensor of a full FT that the base does not have: no output tensor takes it.
typedef struct dropped_tensor {
    int ft;            // the FT's index
    const char *name;  // points into the FT's model
} dropped_tensor;

typedef struct merge_run {
    merge_args args;
    // llmerge run's parse (the command line and the configuration), or NULL: the merge commands'
    lm_status (*parse_fn)(merge_args *a, int argc, char **argv, lm_err *err);
    char prefix[64];           // "llmerge ties"
    lm_progress progress;
    double t0;                 // when the command started
    lm_model *base;
    lm_ft **fts;               // (args.n_ft)
    char **labels;             // (args.n_ft + 1) "BASE", "FT 1", ...: args.input_name of the merge commands
    lm_dev *dev;
    char dev_why[512];         // what --device opened and, for auto, why
    cJSON *fallbacks;          // the units that went to the CPU, for llmerge.json (or NULL)
    lm_calib *calib;           // (n_calib) sparsegpt: the calibration files, read and checked
    int n_calib;
    lm_cmd_sgpt sgpt;          // sparsegpt: each FT's masks or Hessian terms, the cache
    double *weights;           // (n_ft) resolved
    double *densities;         // (n_ft) resolved
    double *gammas;            // (n_ft) resolved
    double *epsilons;          // (n_ft) resolved
    // the command line's per-tensor settings (args.sets) as the engine reads them: the global
    // ones and each model's (the base's, then each FT's), pointing at args.sets' values
    lm_merge_params cli_params;
    lm_params cli_global;
    lm_params *cli_models;     // (n_ft + 1)
    const lm_params **cli_model_ptrs;  // (n_ft + 1)
    lm_merge_opts opts;
    lm_st_desc *descs;         // (n_descs) the output tensors
    int64_t n_descs;
    lm_outdir od;
    lm_st_writer *writer;
    lm_merge_result res;
    lm_manifest manifest;
    lm_hasher *hasher;         // hashes the input files for llmerge.json while the merge runs
    lm_guard guard;            // the inputs, which no output may be, hold or lie inside
    dropped_tensor *dropped;   // (n_dropped) full FTs' tensors the base does not have, left out
    int64_t n_dropped;
    lm_cmd_lora *lora;         // --to-lora: the adapter being made, or NULL
} merge_run;

static void run_free(merge_run *r)
{
    lm_hasher_free(r->hasher);
    lm_cmd_lora_free(r->lora);
    lm_manifest_free(&r->manifest);
    lm_st_writer_free(r->writer);
    lm_outdir_abort(&r->od);
    lm_merge_result_free(&r->res);
    cJSON_Delete(r->fallbacks);
    free(r->descs);
    for (int i = 0; r->fts && i < r->args.n_ft; i++)
        lm_ft_free(r->fts[i]);
    free(r->fts);
    for (int i = 0; r->labels && i <= r->args.n_ft; i++)
        free(r->labels[i]);
    free(r->labels);
    lm_model_free(r->base);
    lm_dev_destroy(r->dev);
    free(r->weights);
    free(r->densities);
    free(r->gammas);
    free(r->cli_global.items);
    for (int i = 0; r->cli_models && i <= r->args.n_ft; i++)
        free(r->cli_models[i].items);
    free(r->cli_models);
    free(r->cli_model_ptrs);
    lm_merge_args_free_sets(&r->args);
    if (r->args.preset_free)
        r->args.preset_free(r->args.preset);
    free(r->epsilons);
    free(r->args.weight_text);
    free(r->args.density_text);
    free(r->args.epsilons);
    free(r->args.weights);
    free(r->args.densities);
    free(r->args.gammas);
    free(r->args.fts);
    free(r->args.calib);
    for (int i = 0; r->calib && i < r->n_calib; i++)
        lm_calib_free(&r->calib[i]);
    free(r->calib);
    lm_cmd_sgpt_free(&r->sgpt);
    lm_guard_free(&r->guard);
    free(r->dropped);
    lm_progress_free(&r->progress);
}

// The options whose values are inputs, for r->guard with the operands BASE and the FTs:
// sparsegpt's --calib files.
static const int guarded_opts[] = {OPT_CALIB, OPT_TOKENIZER};

// What the merge writes, checked against the inputs known so far (r->guard): OUT and OUT.lock,
// and sparsegpt's cache directory (--cache-dir, or the default one). --log-json is checked when
// it is opened.
static lm_status check_outputs(merge_run *r, lm_err *err)
{
    const merge_args *a = &r->args;
    lm_status s = lm_guard_check_outdir(&r->guard, a->out, err);
    if (s != LM_OK || !a->use.hessians)
        return s;
    char *dir = lm_cache_dir(a->cache_dir);
    if (dir)  // no directory at all (no HOME) is said when the cache is opened
        s = lm_guard_check(&r->guard, a->cache_dir ? "--cache-dir" : "the cache directory", dir, err);
    free(dir);
    return s;
}

// Checks that the directory OUT goes into exists (lm_outdir_begin checks again at the start of
// the work; this says it before the inputs are read).
static lm_status check_parent(const char *out, lm_err *err)
{
    char *parent = lm_path_parent(out);
    if (!parent)
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    lm_status s = LM_OK;
    if (!lm_is_dir(parent))
        s = lm_err_set(err, LM_ERR_NOT_FOUND, "%s: its parent directory %s does not exist", out,
                       parent);
    free(parent);
    return s;
}

// Says which given options the method does not use, so a sweep notices a typo in its plan.
static void note_unused(merge_run *r)
{
    const merge_args *a = &r->args;
    const merge_uses *use = &a->use;
    struct { bool unused; const char *opt; const char *why; } u[] = {
        {!use->weights && a->given[OPT_WEIGHTS], "--weights", a->m->ignores_weights},
        {!use->normalize && (a->given[OPT_NORMALIZE] || a->given[OPT_NO_NORMALIZE]),
         a->given[OPT_NO_NORMALIZE] ? "--no-normalize" : "--normalize", a->m->ignores_normalize},
        {!use->lambda && a->given[OPT_LAMBDA], "--lambda", a->m->ignores_lambda},
        {!use->density && (a->given[OPT_DENSITY] || a->given[OPT_DENSITIES]), a->density_opt,
         "task vectors are used whole"},
        {!use->sign && a->given[OPT_SIGN], "--sign", "it elects no signs"},
        {!use->topk && a->given[OPT_TOPK], "--topk", "it has no magnitude trim"},
        {!use->rescale && a->given[OPT_RESCALE], "--rescale", "it drops nothing at random"},
        {!use->seed && a->given[OPT_SEED], "--seed", "it draws nothing at random"},
        {!use->hessians && !a->prepare_inputs && a->given[OPT_CACHE_DIR], "--cache-dir",
         "it keeps nothing between runs"},
        {!use->hessians && a->given[OPT_CALIB], "--calib", "it uses no Hessians"},
        {!use->hessians && a->given[OPT_CALIB_SAMPLES], "--calib-samples", "it uses no Hessians"},
        {!use->hessians && a->given[OPT_TOKENIZER], "--tokenizer", "it reads no calibration text"},
        {!use->hessians && a->given[OPT_DATA_FORMAT], "--data-format", "it reads no calibration data"},
        {!use->hessians && a->given[OPT_SEQ_LEN], "--seq-len", "it uses no Hessians"},
        {!use->hessians && a->given[OPT_HESSIAN_FROM], "--hessian-from", "it uses no Hessians"},
        {!use->hessians && a->given[OPT_STICKY], "--sticky-fallback", "it uses no Hessians"},
        {!use->t && a->given[OPT_T], "--t", "it interpolates by weights or not at all"},
        {!use->gamma && a->given[OPT_GAMMA], "--gamma", "it drops no outliers"},
        {!use->epsilon && a->given[OPT_EPSILON], "--epsilon", "its keep probabilities do not vary by rank"},
        {!use->per_row && a->given[OPT_PER_ROW], "--per-row", "it takes each tensor as one vector"},
        {!use->per_col && a->given[OPT_PER_COL], "--per-column", "it takes each tensor as one vector"},
        {!use->select_topk && a->given[OPT_SELECT_TOPK], "--select-topk", "it has no variance mask"},
        {!use->iter && (a->given[OPT_MAX_ITER] || a->given[OPT_TOL]), "--max-iter and --tol", "it does not iterate"},
        {!use->ramplus && (a->given[OPT_RAM_R] || a->given[OPT_RAM_ALPHA]), "--r and --alpha",
         "it scales no FT's own entries"},
        {!use->models_only && a->given[OPT_MODELS_ONLY], "--models-only",
         use->models ? "its inputs are models already" : "it merges task vectors against BASE"},
    };
    for (size_t i = 0; i < sizeof u / sizeof u[0]; i++)
        if (u[i].unused)
            lm_progress_note(&r->progress, "note: %s has no effect on %s (%s)", u[i].opt, a->m->name,
                             u[i].why);
}

// sparsegpt's calibration files, read and checked (ids within the base's vocabulary) before any
// work: one for every FT, or one per FT; with --hessian-from base the first serves all.
static lm_status read_calib(merge_run *r, lm_err *err)
{
    merge_args *a = &r->args;
    if (a->n_calib == 0)
        return lm_err_set(err, LM_ERR_USAGE, "sparsegpt needs calibration data: --calib FILE (once, or once per FT)");
    if (a->n_calib != 1 && a->n_calib != a->n_ft)
        return lm_err_set(err, LM_ERR_USAGE, "--calib given %d times for %d FTs: give it once, or once per FT",
                          a->n_calib, a->n_ft);
    if (a->hessian_from_base && a->n_calib != 1)
        return lm_err_set(err, LM_ERR_USAGE, "--hessian-from base takes one --calib file, not %d", a->n_calib);
    const lm_config *cfg = &r->base->config;
    int64_t seq_len = a->seq_len ? a->seq_len : cfg->max_position_embeddings > 1 ? cfg->max_position_embeddings : 0;
    lm_calib_opts co = {.max_samples = a->calib_samples, .max_len = seq_len, .vocab_size = cfg->vocab_size,
                        .text = a->calib_text};
    // a line of text is tokenized with BASE's own tokenizer.json, or --tokenizer DIR's
    char why[LM_ERR_MSG_MAX / 2],
        *tok = lm_cmd_calib_tokenizer(a->tokenizer, "BASE", r->base->dir, &co, why, sizeof why);
    if (!tok)
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    if (!(r->calib = calloc((size_t)a->n_calib, sizeof *r->calib))) {
        free(tok);
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    }
    r->n_calib = a->n_calib;
    for (int i = 0; i < a->n_calib; i++) {
        lm_status s = lm_calib_load(&r->calib[i], a->calib[i], &co, err);
        if (s != LM_OK) {
            free(tok);
            return s;
        }
    }
    free(tok);
    for (int i = 0; i < a->n_ft; i++) {
        lm_status s = lm_fwd_check(r->fts[i]->model ? r->fts[i]->model : r->base, r->fts[i]->adapter, err);
        if (s != LM_OK)
            return lm_err_prefix(err, "%s (%s)", a->input_name[1 + i], r->fts[i]->path);
    }
    // with --hessian-from base the forward pass runs BASE itself, whatever the FTs are
    if (a->hessian_from_base) {
        lm_status s = lm_fwd_check(r->base, NULL, err);
        if (s != LM_OK)
            return lm_err_prefix(err, "BASE %s (--hessian-from base)", a->base);
    }
    return LM_OK;
}

// Why a dropped tensor is not in the base, when there is a known reason.
static const char *dropped_why(const merge_run *r, const char *name)
{
    return strcmp(name, "lm_head.weight") == 0 && r->base->config.tie_word_embeddings
           ? " (the base has tie_word_embeddings: its lm_head is model.embed_tokens.weight)" : "";
}

// Lists the full FTs' tensors the base does not have (no output tensor takes them); with
// --strict the first is an error naming it (LM_ERR_MISMATCH), else each gets a warning later.
static lm_status find_dropped(merge_run *r, lm_err *err)
{
    for (int i = 0; i < r->args.n_ft; i++) {
        const lm_model *m = r->fts[i]->model;
        for (int64_t t = 0; m && t < m->n_tensors; t++) {
            if (lm_model_find(r->base, m->tensors[t]->name))
                continue;
            dropped_tensor *d = realloc(r->dropped, (size_t)(r->n_dropped + 1) * sizeof *d);
            if (!d)
                return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
            r->dropped = d;
            r->dropped[r->n_dropped++] = (dropped_tensor){i, m->tensors[t]->name};
        }
    }
    if (!r->args.strict || r->n_dropped == 0)
        return LM_OK;
    const dropped_tensor *d = &r->dropped[0];
    char more[64] = "";
    if (r->n_dropped > 1)
        snprintf(more, sizeof more, " (and %lld more)", (long long)(r->n_dropped - 1));
    return lm_err_set(err, LM_ERR_MISMATCH, "%s (%s): tensor '%s' is not in the base %s%s, so it cannot be "
                      "merged%s; without --strict it is left out with a warning", r->args.input_name[1 + d->ft],
                      r->fts[d->ft]->path, d->name, r->base->dir, dropped_why(r, d->name), more);
}

// A warning for each tensor find_dropped listed, on stderr and in the log.
static void note_dropped(merge_run *r)
{
    for (int64_t i = 0; i < r->n_dropped; i++) {
        const dropped_tensor *d = &r->dropped[i];
        char msg[LM_ERR_MSG_MAX];
        snprintf(msg, sizeof msg, "%s (%s): tensor '%s' is not in the base%s: left out of the merge "
                 "(--strict refuses it)", r->args.input_name[1 + d->ft], r->fts[d->ft]->path, d->name,
                 dropped_why(r, d->name));
        lm_progress_note(&r->progress, "warning: %s", msg);
        cJSON *f = cJSON_CreateObject();
        cJSON_AddStringToObject(f, "message", msg);
        lm_progress_event(&r->progress, "warning", f);
    }
}

// Adds setting v named `name` to ps (the item's name is static, its value the caller's).
static lm_status add_setting(lm_params *ps, const char *name, lm_pval *v, lm_err *err)
{
    lm_param *items = realloc(ps->items, (size_t)(ps->n + 1) * sizeof *items);
    if (!items)
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    ps->items = items;
    items[ps->n++] = (lm_param){.name = (char *)name, .value = v};
    return LM_OK;
}

// The command line's per-tensor settings (args.sets) as the engine's tensor_params: each
// per-input option's settings, one for every input or one per input (the first model's first
// where the base is one of the models), and the merge-wide ones.
static lm_status cli_settings(merge_run *r, bool models, lm_err *err)
{
    merge_args *a = &r->args;
    static const char *const names[SET_COUNT] = {"weight", "density", "gamma", "epsilon", "t", "lambda",
                                                 "select_topk"};
    static const char *const opts[SET_COUNT] = {"--weights", "--densities", "--gamma", "--epsilon", "--t", "--lambda",
                                                "--select-topk"};
    bool any = false;
    for (int id = 0; id < SET_COUNT; id++)
        any = any || a->sets[id].n > 0;
    if (!any)
        return LM_OK;
    int n = a->n_ft;
    r->cli_models = calloc((size_t)n + 1, sizeof *r->cli_models);
    r->cli_model_ptrs = calloc((size_t)n + 1, sizeof *r->cli_model_ptrs);
    if (!r->cli_models || !r->cli_model_ptrs)
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    lm_status s = LM_OK;
    for (int id = 0; s == LM_OK && id < SET_COUNT; id++) {
        const cli_setting *c = &a->sets[id];
        if (c->n == 0)
            continue;
        if (id >= SET_T) {
            s = add_setting(&r->cli_global, names[id], c->v[0], err);
            continue;
        }
        // the inputs the option is given for: the FTs, and the first model for weights
        int first = id == SET_WEIGHT && models ? 0 : 1, count = n + 1 - first;
        if (c->n != 1 && c->n != count)
            return lm_err_set(err, LM_ERR_USAGE, "%s gives %d settings for %d input%s (one for all, or one per %s, "
                              "separated by '|')", opts[id], c->n, count, count == 1 ? "" : "s",
                              first == 0 ? "MODEL" : "FT");
        for (int m = first; s == LM_OK && m <= n; m++)
            s = add_setting(&r->cli_models[m], names[id], c->v[c->n == 1 ? 0 : m - first], err);
    }
    for (int m = 0; m <= n; m++)
        r->cli_model_ptrs[m] = &r->cli_models[m];
    r->cli_params = (lm_merge_params){.global = &r->cli_global, .models = r->cli_model_ptrs, .n_ft = n,
                                      .base_is_model = models};
    a->params = &r->cli_params;
    return s;
}

// With per-tensor settings, the options' weights, densities and lambda are only where each
// tensor's values start from (the method's defaults); the card and llmerge.json read them. Each
// is set to what the settings give where that is one number for the whole merge, and where it
// varies from tensor to tensor, a->weight_text and the like say so instead.
static lm_status settings_summary(merge_run *r, bool models, lm_err *err)
{
    merge_args *a = &r->args;
    const lm_merge_params *mp = a->params;
    lm_merge_opts *o = &r->opts;
    a->weight_text = calloc((size_t)(a->n_ft ? a->n_ft : 1), sizeof *a->weight_text);
    a->density_text = calloc((size_t)(a->n_ft ? a->n_ft : 1), sizeof *a->density_text);
    if (!a->weight_text || !a->density_text)
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    bool cfg = a->config_text != NULL;
    double x = 0;
    for (int i = 0; i < a->n_ft; i++) {
        lm_mp_form f = lm_merge_params_form(mp, 1 + i, "weight", &x);
        if (f == LM_MP_NUMBER)
            r->weights[i] = x;
        else if (f == LM_MP_PER_TENSOR)
            a->weight_text[i] = cfg ? "per tensor: see the configuration" : "per tensor: see --weights";
        if ((f = lm_merge_params_form(mp, 1 + i, "density", &x)) == LM_MP_NUMBER)
            r->densities[i] = x;
        else if (f == LM_MP_PER_TENSOR)
            a->density_text[i] = cfg ? "per tensor: see the configuration" : "per tensor: see --densities";
    }
    lm_mp_form bf = models ? lm_merge_params_form(mp, 0, "weight", &x) : LM_MP_NUMBER;
    if (models && bf == LM_MP_NUMBER)
        o->base_weight = x;
    else if (models && bf == LM_MP_PER_TENSOR)
        a->base_weight_text = cfg ? "per tensor: see the configuration" : "per tensor: see --weights";
    lm_mp_form f = lm_merge_params_form(mp, -1, "lambda", &x);
    if (f == LM_MP_NUMBER)
        o->lambda = x;
    else if (f == LM_MP_PER_TENSOR)
        a->lambda_text = cfg ? "per tensor: see the configuration" : "per tensor: see --lambda";
    return LM_OK;
}

// Everything before the work: inputs opened and checked, options resolved, the device opened.
// Returns the status; err says what is wrong.
static lm_status prepare(merge_run *r, lm_err *err)
{
    merge_args *a = &r->args;
    lm_status s;
    if ((!a->base || a->n_ft == 0) && a->extract)
        return lm_err_set(err, LM_ERR_USAGE, "needs BASE and FT (usage: llmerge extract BASE FT -o ADAPTER --rank R)");
    if (!a->base || a->n_ft == 0)
        return lm_err_set(err, LM_ERR_USAGE, "needs BASE and at least one FT (usage: llmerge %s "
                          "BASE FT [FT...] -o OUT)", a->m->name);
    if (!a->out)
        return lm_err_set(err, LM_ERR_USAGE, "no output directory: give -o OUT");
    if (!a->input_name) {  // the merge commands' names of the inputs in messages
        if (!(r->labels = calloc((size_t)a->n_ft + 1, sizeof *r->labels)))
            return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
        for (int i = 0; i <= a->n_ft; i++)
            if (!(r->labels[i] = i == 0 ? lm_strdup("BASE") : lm_strfmt("FT %d", i)))
                return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
        a->input_name = (const char *const *)r->labels;
    }
    // the methods whose base is one of the models take a weight for it first
    bool models = a->use.models || (a->use.models_only && a->models_only);
    int n_w = a->n_ft + (models ? 1 : 0);
    if (a->weights && a->n_weights != n_w)
        return lm_err_set(err, LM_ERR_USAGE, "--weights gives %d weight%s for %d %s%s (one per %s)", a->n_weights,
                          a->n_weights == 1 ? "" : "s", n_w, models ? "model" : "FT", n_w == 1 ? "" : "s",
                          models ? "MODEL, the first one's first" : "FT");
    if (a->epsilons && a->n_epsilons != 1 && a->n_epsilons != a->n_ft)
        return lm_err_set(err, LM_ERR_USAGE, "--epsilon gives %d values for %d FT%s (one per FT, or one for all)",
                          a->n_epsilons, a->n_ft, a->n_ft == 1 ? "" : "s");
    if (a->gammas && a->n_gammas != 1 && a->n_gammas != a->n_ft)
        return lm_err_set(err, LM_ERR_USAGE, "--gamma gives %d values for %d FT%s (one per FT, or one for all)",
                          a->n_gammas, a->n_ft, a->n_ft == 1 ? "" : "s");
    if (a->densities && a->n_densities != 1 && a->n_densities != a->n_ft)
        return lm_err_set(err, LM_ERR_USAGE, "%s gives %d densities for %d FT%s (one per FT, or "
                          "one for all)", a->density_opt, a->n_densities, a->n_ft,
                          a->n_ft == 1 ? "" : "s");

    // OUT: refused now, before the inputs are read, rather than after the work; never an input
    // (nor OUT.lock or --cache-dir), whatever --force says
    if ((s = check_outputs(r, err)) != LM_OK)
        return s;
    struct stat st;
    if (lstat(a->out, &st) == 0 && !a->force)
        return lm_err_set(err, LM_ERR_USAGE, "%s: already exists (use --force to replace it)",
                          a->out);
    if ((s = check_parent(a->out, err)) != LM_OK)
        return s;

    // BASE
    lm_input_kind kind;
    char *resolved = NULL;
    if ((s = lm_input_detect(a->base, &kind, &resolved, err)) != LM_OK)
        return lm_err_prefix(err, "%s", lm_merge_input_where(a, 0));
    if (kind != LM_INPUT_MODEL) {
        s = lm_err_set(err, LM_ERR_USAGE, "BASE %s is not a model directory (it is %s %s); "
                       "BASE must hold config.json and model.safetensors or shards", a->base,
                       kind == LM_INPUT_ADAPTER ? "an" : "a", lm_input_kind_name(kind));
        free(resolved);
        return a->input_where ? lm_err_prefix(err, "%s", a->input_where[0]) : s;  // (the message says BASE)
    }
    s = lm_model_open(&r->base, resolved, err);
    free(resolved);
    if (s != LM_OK || (s = lm_cmd_guard_model(&r->guard, "BASE", r->base, err)) != LM_OK)
        return s;
    // llmerge run's one slice: its sources' [0, N] is the base's whole stack of layers
    int64_t n_layers = r->base->config.layer_count;
    if (a->slice_layers > 0 && a->slice_layers != n_layers)
        return lm_err_set(err, LM_ERR_UNSUPPORTED, "%s: its sources' layer_range is [0, %" PRId64 "], and the base "
                          "%s has %" PRId64 " layers%s: with merge_method %s a slice gives every layer (passthrough "
                          "stacks parts of stacks)", a->slice_where, a->slice_layers, r->base->dir, n_layers,
                          n_layers > 0 ? "" : " (its config.json gives no num_hidden_layers)", a->m->name);

    // each FT, checked against BASE
    r->fts = calloc((size_t)a->n_ft, sizeof *r->fts);
    if (!r->fts)
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    // --to-lora's checks against the base, before the FTs are made, opened or rebuilt
    if ((s = lm_cmd_lora_check(a, r->base, err)) != LM_OK)
        return s;
    // llmerge run's inputs made before they are opened (PATH+LORA)
    if (a->prepare_inputs && (s = a->prepare_inputs(a, &r->progress, err)) != LM_OK)
        return s;
    // (llmerge run's models of other vocabularies: their embeddings rebuilt first, llmerge plan's
    // only as large as they will be)
    if (a->vocab && (s = lm_cmd_vocab_open(a, r->base, r->fts, !a->planning, &r->progress, err)) != LM_OK)
        return s;
    for (int i = 0; i < a->n_ft; i++) {
        if (!a->vocab && (s = lm_ft_open(&r->fts[i], a->fts[i], r->base, err)) != LM_OK)
            return lm_err_prefix(err, "%s", lm_merge_input_where(a, 1 + i));
        const char *what = a->input_name[1 + i];
        if ((s = lm_cmd_guard_model(&r->guard, what, r->fts[i]->model, err)) != LM_OK ||
            (s = lm_cmd_guard_adapter(&r->guard, what, r->fts[i]->adapter, err)) != LM_OK)
            return s;
    }
    // again, with every file the inputs were read from: a link to one of them is caught too
    if ((s = check_outputs(r, err)) != LM_OK)
        return s;
    if ((s = find_dropped(r, err)) != LM_OK)
        return s;
    for (int i = 0; i < a->n_ft; i++) {
        char who[LM_ERR_MSG_MAX / 2];
        snprintf(who, sizeof who, "%s %s", a->input_name[1 + i], r->fts[i]->path);
        lm_cmd_adapter_warnings(&r->progress, who, r->fts[i]->adapter, "merged", a->base);
    }

    // options, resolved
    r->weights = malloc((size_t)a->n_ft * sizeof *r->weights);
    r->densities = malloc((size_t)a->n_ft * sizeof *r->densities);
    r->gammas = malloc((size_t)a->n_ft * sizeof *r->gammas);
    r->epsilons = malloc((size_t)a->n_ft * sizeof *r->epsilons);
    if (!r->weights || !r->densities || !r->gammas || !r->epsilons)
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    for (int i = 0; i < a->n_ft; i++) {
        r->gammas[i] = !a->gammas ? 0.01 : a->n_gammas == 1 ? a->gammas[0] : a->gammas[i];
        r->epsilons[i] = !a->epsilons ? lm_method_epsilon(a->m) : a->n_epsilons == 1 ? a->epsilons[0] : a->epsilons[i];
        r->weights[i] = a->weights ? a->weights[i + (models ? 1 : 0)] : 1.0;
        r->densities[i] = !a->densities ? DEFAULT_DENSITY
                          : a->n_densities == 1 ? a->densities[0] : a->densities[i];
    }
    lm_merge_opts *o = &r->opts;
    o->method = a->m->id;
    o->n_ft = a->n_ft;
    o->weights = r->weights;
    o->densities = r->densities;
    o->gammas = r->gammas;
    o->epsilons = r->epsilons;
    o->lambda = a->lambda;
    o->normalize = a->normalize < 0 ? a->m->normalize : a->normalize;
    o->sign = a->sign;
    o->topk_global = a->topk_global;
    o->rescale = a->rescale;
    o->seed = a->seed;
    o->out_dtype = a->have_dtype ? a->dtype : lm_model_out_dtype(r->base);
    if (a->to_lora || a->to_lora_exact) {  // the merge's values in float32, from which each tensor's Δ is made
        // (exact: float32 unless --dtype says otherwise, so that the adapter is the merge)
        a->lora_dtype = a->to_lora_exact && !a->have_dtype ? LM_DTYPE_F32 : o->out_dtype;
        o->out_dtype = LM_DTYPE_F32;
    }
    o->threads = a->threads;
    o->base_weight = models && a->weights ? a->weights[0] : 1.0;
    o->models_only = a->models_only;
    o->per_row = a->per_row;
    o->per_col = a->per_col;
    o->select_topk = a->select_topk;
    o->t = a->t;
    o->max_iter = a->max_iter;
    o->tol = a->tol;
    o->ram_r = a->ram_r;
    o->ram_alpha = a->ram_alpha;
    o->ft_names = a->input_name + 1;
    if (!a->params && (s = cli_settings(r, models, err)) != LM_OK)
        return s;
    if (a->params) {
        o->tensor_params = lm_merge_params_tensor;
        o->params_ctx = a->params;
        lm_merge_params_layout(a->params, r->base);
        if ((s = settings_summary(r, models, err)) != LM_OK)
            return s;
    }
    if ((s = lm_merge_check_opts(o, err)) != LM_OK || (s = lm_merge_check_params(o, r->base, r->fts, err)) != LM_OK ||
        (s = lm_cmd_lora_exact_check(a, o, r->base, r->fts, err)) != LM_OK)
        return s;
    if (a->use.hessians && (s = read_calib(r, err)) != LM_OK)
        return s;

    // the device
    lm_dev_opts dev_opts = {.threads = a->threads, .mem_cap = a->gpu_mem, .sim_fail = getenv("LLMERGE_SIM_FAIL")};
    if ((s = lm_dev_open(&r->dev, a->device, &dev_opts, r->dev_why, sizeof r->dev_why, err)) != LM_OK)
        return s;  // the message names the device
    if (lm_dev_threads(r->dev) > 0)
        o->threads = lm_dev_threads(r->dev);

    return lm_merge_outputs(o, r->base, &r->descs, &r->n_descs, err);
}

// ---- reporting ------------------------------------------------------------------------------

static void on_tensor(void *ctx, int64_t done, int64_t total, const char *name,
                      uint64_t bytes_done, uint64_t bytes_total)
{
    merge_run *r = ctx;
    lm_progress *p = &r->progress;
    if (total != p->n_total || bytes_total != p->bytes_total)
        lm_progress_set_total(p, total, bytes_total);
    lm_progress_update(p, done, bytes_done, name);
    lm_test_delay();  // LLMERGE_TEST_DELAY_MS, for the tests that interrupt a run
}

// --to-lora: the merge's bytes and each complete tensor, to the adapter being made.
static lm_status on_put(void *ctx, int64_t idx, uint64_t offset, const void *data, uint64_t nbytes, lm_err *err)
{
    return lm_cmd_lora_put(((merge_run *)ctx)->lora, idx, offset, data, nbytes, err);
}

static lm_status on_done(void *ctx, int64_t idx, lm_err *err)
{
    return lm_cmd_lora_done(((merge_run *)ctx)->lora, idx, err);
}

// A unit went to the CPU: said on stderr and in the log, and kept for llmerge.json.
static void on_fallback(void *ctx, const char *line, const lm_fallback *fb)
{
    merge_run *r = ctx;
    lm_cmd_note(&r->progress, line, fb);
    if (!fb)
        return;
    if (!r->fallbacks)
        r->fallbacks = cJSON_CreateArray();
    cJSON_AddItemToArray(r->fallbacks, lm_fallback_json(fb));
}

// Where the units ran, when there was an accelerator: units per device, fallbacks per phase
// and the time they cost.
static void device_summary(merge_run *r)
{
    const lm_merge_result *res = &r->res;
    if (lm_dev_host_memory(r->dev))
        return;
    lm_progress_note(&r->progress,
                     "devices: %" PRId64 " tensor%s merged on %s, %" PRId64 " on cpu (%" PRId64
                     " copied on cpu); fallbacks: place %" PRId64 ", select %" PRId64 ", merge %" PRId64
                     " (%.2f s)",
                     res->tensors_on_device, res->tensors_on_device == 1 ? "" : "s", lm_dev_name(r->dev),
                     res->tensors_on_cpu, res->n_copied, res->fallback_place, res->fallback_select,
                     res->fallback_merge, res->fallback_s);
}

static const char *ft_kind(const lm_ft *ft) { return ft->adapter ? "adapter" : "model"; }

static void describe_run(merge_run *r)
{
    const merge_args *a = &r->args;
    const lm_merge_opts *o = &r->opts;
    char shard[32];
    lm_format_bytes(shard, sizeof shard, a->shard_size);
    char lora[64] = "";
    if (a->to_lora)
        snprintf(lora, sizeof lora, " as a LoRA adapter of rank %d", a->to_lora);
    else if (a->to_lora_exact)
        snprintf(lora, sizeof lora, " as a LoRA adapter of the inputs' factors");
    lm_progress_note(&r->progress, "merging %d fine-tune%s onto %s into %s%s (%s, %s, %d thread%s)",
                     a->n_ft, a->n_ft == 1 ? "" : "s", a->base, a->out, lora,
                     lm_cmd_dtype_flag(lora[0] ? a->lora_dtype : o->out_dtype), lm_dev_name(r->dev), o->threads,
                     o->threads == 1 ? "" : "s");
    if (strncmp(r->dev_why, "auto:", 5) == 0 || strcmp(r->dev_why, lm_dev_name(r->dev)) != 0 || a->verbose)
        lm_progress_note(&r->progress, "device %s", r->dev_why);
    if (!a->verbose)
        return;
    lm_progress_note(&r->progress, "  base %s: %s, %" PRId64 " tensors in %d shard%s",
                     r->base->dir, r->base->config.architecture ? r->base->config.architecture
                                                                : "unknown architecture",
                     r->base->n_tensors, r->base->n_shards, r->base->n_shards == 1 ? "" : "s");
    for (int i = 0; i < a->n_ft; i++) {
        const lm_ft *ft = r->fts[i];
        char what[64];
        if (ft->adapter)
            snprintf(what, sizeof what, "%" PRId64 " LoRA modules, %" PRId64 " saved tensors",
                     ft->adapter->n_modules, ft->adapter->n_saved);
        else
            snprintf(what, sizeof what, "%" PRId64 " tensors", ft->model->n_tensors);
        char density[32] = "";
        if (a->use.density)
            snprintf(density, sizeof density, ", density %g", o->densities[i]);
        lm_progress_note(&r->progress, "  %s %s: %s (%s), weight %g%s", a->input_name[1 + i], ft->path,
                         ft_kind(ft), what, o->weights[i], density);
    }
    lm_progress_note(&r->progress, "  lambda %g, normalize %s, sign %s, topk %s, rescale %s, "
                     "seed %" PRIu64 ", shard size %s (%" PRIu64 " bytes)", o->lambda,
                     o->normalize ? "on" : "off", o->sign == LM_SIGN_COUNT ? "count" : "sum",
                     o->topk_global ? "global" : "tensor",
                     lm_rescale_name(o->rescale), o->seed, shard, a->shard_size);
    lm_progress_note(&r->progress, "  %" PRId64 " output tensors", r->n_descs);
}

static cJSON *start_event(const merge_run *r)
{
    const merge_args *a = &r->args;
    cJSON *f = cJSON_CreateObject();
    cJSON_AddStringToObject(f, "method", a->m->name);
    cJSON_AddStringToObject(f, "base", r->base->dir);
    cJSON *in = cJSON_AddArrayToObject(f, "inputs");
    for (int i = 0; in && i < a->n_ft; i++) {
        cJSON *e = cJSON_CreateObject();
        cJSON_AddStringToObject(e, "path", r->fts[i]->path);
        cJSON_AddStringToObject(e, "kind", ft_kind(r->fts[i]));
        cJSON_AddItemToArray(in, e);
    }
    cJSON_AddStringToObject(f, "output", a->out);
    cJSON_AddStringToObject(f, "dtype", lm_cmd_dtype_flag(r->opts.out_dtype));
    cJSON_AddStringToObject(f, "device", lm_dev_name(r->dev));
    cJSON_AddNumberToObject(f, "threads", r->opts.threads);
    cJSON_AddNumberToObject(f, "n_tensors", (double)r->n_descs);
    return f;
}

// ---- the work -------------------------------------------------------------------------------

// Records what llmerge.json holds beyond the options; hashes every input file.
// Starts hashing every input file llmerge.json lists (lm_manifest_set_base and _add_input
// take the hashes from it), so that it reads them while the merge does.
static lm_status start_hasher(merge_run *r, lm_err *err)
{
    const lm_model *models[1 + r->args.n_ft];
    int n_models = 0, n = 0;
    models[n_models++] = r->base;
    int cap = 2;
    for (int i = 0; i < r->args.n_ft; i++) {
        if (r->fts[i]->model)
            models[n_models++] = r->fts[i]->model;
        cap += 2;
    }
    for (int i = 0; i < n_models; i++)
        cap += models[i]->n_shards;
    const char *paths[cap];
    for (int i = 0; i < n_models; i++) {
        paths[n++] = models[i]->config.path;
        if (models[i]->index_path)
            paths[n++] = models[i]->index_path;
        for (int j = 0; j < models[i]->n_shards; j++)
            paths[n++] = models[i]->shards[j].path;
    }
    for (int i = 0; i < r->args.n_ft; i++)
        if (r->fts[i]->adapter) {
            paths[n++] = r->fts[i]->adapter->config.path;
            paths[n++] = r->fts[i]->adapter->weights_path;
        }
    return lm_hasher_start(&r->hasher, paths, n, err);
}

// What llmerge.json records for parameter `name` of model m (1 + i FT i; -1 the merge's own)
// whose option `option` has value v: where per-tensor settings give it (llmerge run's
// configuration, or settings on the command line), the number they give every tensor, or where
// it varies from tensor to tensor, a string saying so; else v. NULL when memory runs out.
static cJSON *resolved(const merge_args *a, int m, const char *name, const char *option, double v)
{
    double x = v;
    lm_mp_form f = a->params ? lm_merge_params_form(a->params, m, name, &x) : LM_MP_UNSET;
    if (f != LM_MP_PER_TENSOR)
        return cJSON_CreateNumber(x);
    char text[64];
    snprintf(text, sizeof text, "per tensor: see %s", a->config_text ? "the configuration" : option);
    return cJSON_CreateString(text);
}

// resolved() of parameter `name` of each FT (its option's values v), as an array.
static cJSON *resolved_each(const merge_args *a, const char *name, const char *option, const double *v)
{
    cJSON *arr = cJSON_CreateArray();
    for (int i = 0; arr && i < a->n_ft; i++) {
        cJSON *x = resolved(a, 1 + i, name, option, v[i]);
        if (!x || !cJSON_AddItemToArray(arr, x)) {
            cJSON_Delete(x);
            cJSON_Delete(arr);
            return NULL;
        }
    }
    return arr;
}

// What llmerge.json's options add for the methods beyond ties and dare and for per-tensor
// settings: t, the base's weight, gamma, epsilon, karcher's iteration, --models-only; each option
// given as settings, as given; llmerge run's configuration, with the xxHash64 of its text.
static lm_status manifest_method_options(const merge_run *r, cJSON *opt, lm_err *err)
{
    const merge_args *a = &r->args;
    const lm_merge_opts *o = &r->opts;
    const merge_uses *u = &a->use;
    bool ok = true;
    cJSON *x;
    if (u->t)
        ok = ok && (x = resolved(a, -1, "t", "--t", o->t)) && cJSON_AddItemToObject(opt, "t", x);
    if (u->select_topk)
        ok = ok && (x = resolved(a, -1, "select_topk", "--select-topk", o->select_topk)) &&
             cJSON_AddItemToObject(opt, "select_topk", x);
    if ((u->models || (u->models_only && o->models_only)) && a->base_weight_text)
        ok = ok && cJSON_AddStringToObject(opt, "base_weight", a->base_weight_text);
    else if (u->models || (u->models_only && o->models_only))
        ok = ok && cJSON_AddNumberToObject(opt, "base_weight", o->base_weight);
    if (u->models_only)
        ok = ok && cJSON_AddBoolToObject(opt, "models_only", o->models_only);
    if (u->per_row)
        ok = ok && cJSON_AddBoolToObject(opt, "per_row", o->per_row);
    if (u->per_col)
        ok = ok && cJSON_AddBoolToObject(opt, "per_column", o->per_col);
    if (u->iter)
        ok = ok && cJSON_AddNumberToObject(opt, "max_iter", o->max_iter) && cJSON_AddNumberToObject(opt, "tol", o->tol);
    if (u->ramplus)
        ok = ok && cJSON_AddNumberToObject(opt, "r", o->ram_r) && cJSON_AddNumberToObject(opt, "alpha", o->ram_alpha);
    if (u->gamma)
        ok = ok && (x = resolved_each(a, "gamma", "--gamma", o->gammas)) && cJSON_AddItemToObject(opt, "gammas", x);
    if (u->epsilon)
        ok = ok && (x = resolved_each(a, "epsilon", "--epsilon", o->epsilons)) &&
             cJSON_AddItemToObject(opt, "epsilons", x);
    static const char *const names[SET_COUNT] = {"weights", "densities", "gamma", "epsilon", "t", "lambda",
                                                 "select_topk"};
    cJSON *sets = NULL;
    for (int id = 0; ok && id < SET_COUNT; id++) {
        if (!a->sets[id].text)
            continue;
        ok = (sets || (sets = cJSON_AddObjectToObject(opt, "settings"))) &&
             cJSON_AddStringToObject(sets, names[id], a->sets[id].text);
    }
    if (ok && a->config_text) {
        char hex[17];
        snprintf(hex, sizeof hex, "%016" PRIx64, lm_xxh64(a->config_text, strlen(a->config_text)));
        cJSON *c = cJSON_AddObjectToObject(opt, "config");
        ok = c && cJSON_AddStringToObject(c, "path", a->config_path) && cJSON_AddStringToObject(c, "xxh64", hex);
    }
    return ok ? LM_OK : lm_err_set(err, LM_ERR_NOMEM, "out of memory");
}

static lm_status build_manifest(merge_run *r, double *hash_s, lm_err *err)
{
    const merge_args *a = &r->args;
    lm_manifest *m = &r->manifest;
    lm_status s = lm_manifest_init(m, a->m->name, err);
    if (s != LM_OK || (s = lm_manifest_merge_options(m, &r->opts, err)) != LM_OK)
        return s;
    cJSON *opt = m->options;
    // a setting that varies from tensor to tensor: said so, not the number the engine starts from
    cJSON *ws = cJSON_GetObjectItemCaseSensitive(opt, "weights");
    cJSON *ds = cJSON_GetObjectItemCaseSensitive(opt, "densities");
    for (int i = 0; i < a->n_ft && a->weight_text; i++) {
        cJSON *w = a->weight_text[i] ? cJSON_CreateString(a->weight_text[i]) : NULL;
        cJSON *d = a->density_text[i] && cJSON_IsArray(ds) ? cJSON_CreateString(a->density_text[i]) : NULL;
        if ((a->weight_text[i] && (!w || !cJSON_ReplaceItemInArray(ws, i, w))) ||
            (a->density_text[i] && cJSON_IsArray(ds) && (!d || !cJSON_ReplaceItemInArray(ds, i, d)))) {
            cJSON_Delete(w);
            cJSON_Delete(d);
            return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
        }
    }
    if (a->lambda_text) {
        cJSON *l = cJSON_CreateString(a->lambda_text);
        if (!l || !cJSON_ReplaceItemInObjectCaseSensitive(opt, "lambda", l)) {
            cJSON_Delete(l);
            return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
        }
    }
    bool ok = cJSON_AddNumberToObject(opt, "shard_size", (double)a->shard_size) &&
              cJSON_AddStringToObject(opt, "device", lm_dev_name(r->dev)) &&
              (a->gpu_mem ? cJSON_AddNumberToObject(opt, "gpu_mem", (double)a->gpu_mem)
                          : cJSON_AddNullToObject(opt, "gpu_mem")) &&
              (a->cache_dir ? cJSON_AddStringToObject(opt, "cache_dir", a->cache_dir)
                            : cJSON_AddNullToObject(opt, "cache_dir")) &&
              cJSON_AddBoolToObject(opt, "strict", a->strict);
    if (!ok)
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    if ((s = manifest_method_options(r, opt, err)) != LM_OK)
        return s;
    if (a->use.hessians) {
        // what the Hessians came from: each calibration file with its xxHash64, the caps
        cJSON *files = cJSON_AddArrayToObject(opt, "calib");
        for (int i = 0; files && i < a->n_calib; i++) {
            uint64_t h;
            lm_status hs = lm_xxh64_file(a->calib[i], &h, err);
            if (hs != LM_OK)
                return hs;
            char hex[17];
            snprintf(hex, sizeof hex, "%016" PRIx64, h);
            cJSON *f = cJSON_CreateObject();
            cJSON_AddStringToObject(f, "path", a->calib[i]);
            cJSON_AddStringToObject(f, "xxh64", hex);
            cJSON_AddNumberToObject(f, "sequences", (double)r->calib[i].n_seqs);
            cJSON_AddNumberToObject(f, "tokens", (double)r->calib[i].n_tokens);
            cJSON_AddItemToArray(files, f);
        }
        if (!files || !cJSON_AddStringToObject(opt, "hessian_from", a->hessian_from_base ? "base" : "ft") ||
            !(a->calib_samples ? cJSON_AddNumberToObject(opt, "calib_samples", (double)a->calib_samples)
                               : cJSON_AddNullToObject(opt, "calib_samples")) ||
            !(a->seq_len ? cJSON_AddNumberToObject(opt, "seq_len", (double)a->seq_len)
                         : cJSON_AddNullToObject(opt, "seq_len")) ||
            !cJSON_AddNumberToObject(opt, "damp", 0.01))
            return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    }

    // What is left of hashing the inputs: the hasher has been at it since the merge started.
    double t = lm_now();
    m->hasher = r->hasher;
    if ((s = lm_manifest_set_base(m, r->base, err)) != LM_OK)
        return s;
    for (int i = 0; i < a->n_ft; i++)
        if ((s = lm_manifest_add_input(m, r->fts[i]->model, r->fts[i]->adapter, err)) != LM_OK)
            return s;
    *hash_s = lm_now() - t;

    if (r->lora) {
        if ((s = lm_cmd_lora_manifest(r->lora, m->outputs, err)) != LM_OK)
            return s;
    } else if ((s = lm_manifest_set_outputs(m, r->od.tmp, lm_st_writer_plan(r->writer), r->descs, r->n_descs,
                                            r->res.tensor_xxh64, err)) != LM_OK) {
        return s;
    }
    if (!(a->no_card ? cJSON_AddNullToObject(m->outputs, "card") : cJSON_AddStringToObject(m->outputs, "card", LM_CARD_NAME)))
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    // Tensors per device: merged ones where they ran, copied ones on the CPU.
    const lm_merge_result *res = &r->res;
    if (res->tensors_on_device &&
        (s = lm_manifest_add_device_units(m, lm_dev_name(r->dev), res->tensors_on_device, err)) != LM_OK)
        return s;
    if ((s = lm_manifest_add_device_units(m, "cpu", res->n_tensors - res->tensors_on_device, err)) != LM_OK)
        return s;
    cJSON *fb = cJSON_AddObjectToObject(m->root, "fallbacks");
    if (!fb || !cJSON_AddNumberToObject(fb, "place", (double)res->fallback_place) ||
        !cJSON_AddNumberToObject(fb, "select", (double)res->fallback_select) ||
        !cJSON_AddNumberToObject(fb, "merge", (double)res->fallback_merge) ||
        !cJSON_AddNumberToObject(fb, "seconds", res->fallback_s))
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    cJSON_AddItemToObject(fb, "units", r->fallbacks ? r->fallbacks : cJSON_CreateArray());
    r->fallbacks = NULL;  // the manifest owns it now
    // the FT tensors the base does not have, left out
    cJSON *drop = cJSON_AddObjectToObject(m->root, "dropped"), *list = cJSON_CreateArray();
    if (!drop || !list || !cJSON_AddNumberToObject(drop, "tensors", (double)r->n_dropped) ||
        !cJSON_AddItemToObject(drop, "list", list)) {
        cJSON_Delete(list);
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    }
    for (int64_t i = 0; i < r->n_dropped; i++) {
        cJSON *o = cJSON_CreateObject();
        if (!o || !cJSON_AddItemToArray(list, o) || !cJSON_AddNumberToObject(o, "ft", r->dropped[i].ft + 1) ||
            !cJSON_AddStringToObject(o, "tensor", r->dropped[i].name))
            return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    }
    if ((s = lm_manifest_set_nonfinite(m, res, a->n_ft, err)) != LM_OK)
        return s;
    cJSON *sel = cJSON_AddObjectToObject(m->root, "selection");
    if (!sel || !cJSON_AddNumberToObject(sel, "windows", (double)res->windows) ||
        !cJSON_AddNumberToObject(sel, "window_misses", (double)res->window_misses))
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    cJSON *xfer = cJSON_AddObjectToObject(m->root, "transfers");
    if (!xfer || !cJSON_AddNumberToObject(xfer, "bytes_to_device", (double)res->bytes_to_device) ||
        !cJSON_AddNumberToObject(xfer, "bytes_from_device", (double)res->bytes_from_device))
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    return lm_manifest_set_stats(m, r->res.bytes_in, r->res.bytes_out, r->res.n_merged,
                                 r->res.n_copied, err);
}


// Says which inputs and whether the output hold NaN or Inf (res->nonfinite): a warning line each,
// on stderr and in the log, naming the first few tensors (llmerge.json lists them all).
static void warn_nonfinite(merge_run *r)
{
    const lm_merge_result *res = &r->res;
    for (int input = 0; input <= r->args.n_ft + 1; input++) {
        int who = input <= r->args.n_ft ? input : -1;  // the base, the FTs, then the output
        uint64_t nan = 0, inf = 0;
        int64_t tensors = 0;
        char names[512] = "";
        size_t len = 0;
        for (int64_t i = 0; i < res->n_nonfinite; i++) {
            const lm_merge_nonfinite *n = &res->nonfinite[i];
            if (n->input != who)
                continue;
            nan += n->nan;
            inf += n->inf;
            if (++tensors <= 3 && len < sizeof names)
                len += (size_t)snprintf(names + len, sizeof names - len, "%s%s", tensors > 1 ? ", " : "", n->tensor);
        }
        if (tensors == 0)
            continue;
        if (tensors > 3 && len < sizeof names)
            snprintf(names + len, sizeof names - len, " and %lld more", (long long)(tensors - 3));
        char what[LM_ERR_MSG_MAX], msg[sizeof what + sizeof names + 128];
        if (who == 0)
            snprintf(what, sizeof what, "the base (%s):", r->base->dir);
        else if (who > 0)
            snprintf(what, sizeof what, "%s (%s):", r->args.input_name[who], r->fts[who - 1]->path);
        else
            snprintf(what, sizeof what, "the output holds");
        snprintf(msg, sizeof msg, "%s %" PRIu64 " NaN and %" PRIu64 " Inf value%s in %lld tensor%s (%s)", what, nan,
                 inf, nan + inf == 1 ? "" : "s", (long long)tensors, tensors == 1 ? "" : "s", names);
        lm_progress_note(&r->progress, "warning: %s", msg);
        cJSON *f = cJSON_CreateObject();
        cJSON_AddStringToObject(f, "message", msg);
        lm_progress_event(&r->progress, "warning", f);
    }
}

// Says where the trim kept nothing of an FT (res->empty_trims): the first such tensor and how
// many there were. llmerge merges those tensors without that FT; mergekit's ties stops at them,
// its breadcrumbs keeps nothing there too, silently; sparsegpt's importance has no counterpart.
static void note_empty_trims(merge_run *r)
{
    const lm_merge_result *res = &r->res;
    if (res->empty_trims == 0)
        return;
    int ft = res->empty_trim_ft;
    const lm_method *m = r->args.m;
    const char *mk = m->rank == LM_RANK_IMPORTANCE ? ""
                     : m->outliers                 ? " (mergekit's breadcrumbs keeps nothing there too, silently)"
                                                   : " (mergekit's ties stops at the first)";
    lm_progress_note(&r->progress, "note: %s keeps nothing of %s (%s) in '%s', where floor(density * numel) is 0: "
                     "%lld tensor%s lose an FT's task vector so%s", m->name, r->args.input_name[1 + ft],
                     r->fts[ft]->path,
                     res->empty_trim_tensor, (long long)res->empty_trims, res->empty_trims == 1 ? "" : "s", mk);
}

// Does the merge into a temporary directory and renames it to OUT. Returns the exit status.
static int work(merge_run *r, double t_loaded)
{
    merge_args *a = &r->args;
    lm_progress *p = &r->progress;
    lm_err err = {0};
    // From here until OUT is in place, a signal stops the work instead of the process, so the
    // temporary directory is removed.
    int code = lm_cmd_output_begin(&r->od, a->out, a->force, p);
    if (code)
        return code;
    lm_status s = LM_OK;
    lm_progress_event(p, "start", start_event(r));
    describe_run(r);

    char *path = NULL;
    int n_side = 0;
    double t_merge = lm_now(), t_written = 0, hash_s = 0;
    bool lora = a->to_lora || a->to_lora_exact;
    s = lora ? lm_cmd_lora_begin(&r->lora, a, r->base, r->descs, r->n_descs, r->dev, a->lora_dtype, p, &err)
             : lm_st_writer_open(&r->writer, r->od.tmp, r->descs, r->n_descs, a->shard_size, NULL, &err);
    if (s != LM_OK)
        goto fail;
    uint64_t out_bytes = 0;
    for (int64_t i = 0; i < r->n_descs; i++) {
        uint64_t numel = 1;
        for (int d = 0; d < r->descs[i].ndim; d++)
            numel *= (uint64_t)r->descs[i].shape[d];
        out_bytes += numel * lm_dtype_bits(r->descs[i].dtype) / 8;
    }
    if (a->use.hessians) {
        lm_cmd_sgpt_in in = {
            .base = r->base, .fts = r->fts, .n_ft = a->n_ft, .densities = r->densities, .topk_global = a->topk_global,
            .calib = r->calib, .n_calib = r->n_calib, .calib_samples = a->calib_samples, .seq_len = a->seq_len,
            .from_base = a->hessian_from_base, .sticky = a->sticky, .cache_dir = a->cache_dir, .dev = r->dev,
            .progress = p,
        };
        if ((s = lm_cmd_sgpt_prepare(&r->sgpt, &in, &err)) != LM_OK)
            goto fail;
        lm_cmd_sgpt_attach(&r->sgpt, &r->opts);
    }
    if (!a->to_lora_exact)
        lm_progress_start(p, "tensor", r->n_descs, out_bytes);
    // A device without the importance operations (every built-in one has them) leaves sparsegpt's merge to
    // the CPU: said, not silent.
    lm_dev *merge_dev = r->dev;
    if (a->use.hessians && !lm_dev_supports(r->dev, LM_OP_IMPORTANCE)) {
        if ((s = lm_dev_cpu_companion(r->dev, &merge_dev, &err)) != LM_OK)
            goto fail;
        lm_progress_note(p, "note: %s has no importance operations: the merge runs on the cpu",
                         lm_dev_name(r->dev));
    }
    if ((s = start_hasher(r, &err)) != LM_OK)
        goto fail;
    if (a->to_lora_exact) {  // no merge: the inputs' factors, concatenated
        if ((s = lm_cmd_lora_exact(r->lora, &r->opts, r->fts, &err)) != LM_OK)
            goto fail;
        t_merge = lm_now();
        goto merged;
    }
    lm_merge_hooks hooks = {.progress = on_tensor, .fallback = on_fallback, .ctx = r,
                            .put = r->lora ? on_put : NULL, .tensor_done = r->lora ? on_done : NULL};
    s = lm_merge_run(&r->opts, merge_dev, r->base, r->fts, r->writer, &hooks, &r->res, &err);
    lm_progress_end(p);
    if (s != LM_OK)
        goto fail;
    warn_nonfinite(r);
    note_empty_trims(r);
    if (a->use.hessians)
        lm_cmd_sgpt_commit(&r->sgpt);  // they depend on the inputs only: kept even if writing OUT fails
merged:;
    double t_merged = lm_now();
    if (r->lora) {  // the adapter's files, and the configuration of llmerge run
        if ((s = lm_cmd_lora_finish(r->lora, r->od.tmp, &err)) != LM_OK ||
            (s = lm_cmd_run_outputs(a, r->od.tmp, &err)) != LM_OK)
            goto fail;
        goto card;
    }
    if ((s = lm_st_writer_finish(r->writer, &err)) != LM_OK)
        goto fail;

    // config.json with the new dtype, then the side files
    if (!(path = lm_path_join(r->od.tmp, "config.json"))) {
        s = lm_err_set(&err, LM_ERR_NOMEM, "out of memory");
        goto fail;
    }
    if ((s = lm_manifest_write_config(r->base->config.path, path, r->opts.out_dtype,
                                        r->args.vocab ? r->base->config.vocab_size : 0, &err)) != LM_OK)
        goto fail;
    free(path);
    path = NULL;
    if ((s = lm_manifest_copy_side_files(r->base->dir, r->od.tmp, &n_side, &err)) != LM_OK ||
        (s = lm_cmd_run_outputs(a, r->od.tmp, &err)) != LM_OK)
        goto fail;
card:
    if (!a->no_card &&
        (s = lm_merge_write_card(a, &r->opts, (const lm_ft *const *)r->fts, r->od.tmp, &err)) != LM_OK)
        goto fail;
    t_written = lm_now();

    if ((s = build_manifest(r, &hash_s, &err)) != LM_OK)
        goto fail;
    lm_manifest_timings tm = {
        .load_s = t_loaded - r->t0,
        .merge_s = t_merged - t_merge,
        .write_s = t_written - t_merged,
        .hash_s = hash_s,
        .total_s = lm_now() - r->t0,
    };
    int n_shards = 0;
    if ((s = lm_cmd_finish_output(&r->manifest, &tm, &r->od, &r->writer, &n_shards, &err)) != LM_OK)
        goto fail;

    // both counts, as llmerge.json's stats give them: a tensor no FT changes is copied, not merged
    char what[128];
    snprintf(what, sizeof what, "merged %" PRId64 " tensor%s, copied %" PRId64 " from the base", r->res.n_merged,
             r->res.n_merged == 1 ? "" : "s", r->res.n_copied);
    if (!a->to_lora_exact) {
        lm_progress_summary_as(p, what);
        device_summary(r);
    }
    if (r->lora) {
        lm_cmd_lora_summary(r->lora, p);
        lm_progress_note(p, "wrote %s: adapter_config.json, adapter_model.safetensors, %s%s", a->out,
                         a->no_card ? "" : LM_CARD_NAME ", ", LM_MANIFEST_NAME);
    } else {
        lm_cmd_note_written(p, a->out, n_shards, n_side, !a->no_card);
    }
    cJSON *f = lm_cmd_end_event(a->out, r->t0);
    cJSON_AddNumberToObject(f, "tensors_merged", (double)r->res.n_merged);
    cJSON_AddNumberToObject(f, "tensors_copied", (double)r->res.n_copied);
    cJSON_AddNumberToObject(f, "bytes_in", (double)r->res.bytes_in);
    cJSON_AddNumberToObject(f, "bytes_out", (double)r->res.bytes_out);
    lm_cmd_end_send(p, f, n_shards);
    return 0;

fail:
    free(path);
    return lm_cmd_output_failed(s, &err, &r->od, &r->writer, p, a->out);
}

// ---- the entry (command.h) ------------------------------------------------------------------

static void usage(FILE *out, const void *m)
{
    lm_merge_usage(out, m);
}

static lm_status parse(void *ctx, int argc, char **argv, lm_err *err)
{
    merge_run *r = ctx;
    if (r->parse_fn)
        return r->parse_fn(&r->args, argc, argv, err);
    return lm_merge_parse_args(&r->args, argc, argv, err);
}

static lm_status cmd_prepare(void *ctx, bool *no_log, lm_err *err)
{
    (void)no_log;
    return prepare(ctx, err);
}

// The notes on what the command line asked, then the work.
static int cmd_work(void *ctx)
{
    merge_run *r = ctx;
    note_unused(r);
    note_dropped(r);
    if (r->args.note)
        lm_progress_note(&r->progress, "note: %s", r->args.note);
    if (r->args.gpu_mem && strcmp(lm_dev_name(r->dev), "cpu") == 0)
        lm_progress_note(&r->progress, "note: --gpu-mem has no effect on the cpu device");
    return work(r, lm_now());
}

static void cleanup(void *ctx)
{
    run_free(ctx);
}

int lm_cmd_merge(int argc, char **argv)
{
    merge_run r;
    memset(&r, 0, sizeof r);
    r.t0 = lm_now();
    r.args.m = lm_method_find(argv[0]);
    if (!r.args.m) {
        fprintf(stderr, "llmerge: %s is not a merge method\n", argv[0]);
        return 2;
    }
    snprintf(r.prefix, sizeof r.prefix, "llmerge %s", r.args.m->name);
    lm_command c = {
        .prefix = r.prefix, .log_error_prefix = "", .progress = &r.progress, .guard = &r.guard,
        .opts = lm_merge_opt_defs, .n_opts = lm_merge_n_opts, .inputs = guarded_opts, .n_inputs = 2, .first = "BASE",
        .rest = "FT", .help = &r.args.help, .quiet = &r.args.quiet,
        .usage = usage, .usage_arg = r.args.m, .parse = parse, .prepare = cmd_prepare, .work = cmd_work,
        .cleanup = cleanup, .ctx = &r,
    };
    return lm_command_run(&c, argc, argv);
}

int lm_cmd_merge_with(const char *prefix, void (*usage_fn)(FILE *out, const void *arg),
                      lm_status (*parse_fn)(merge_args *a, int argc, char **argv, lm_err *err), const char *first,
                      int argc, char **argv)
{
    merge_run r;
    memset(&r, 0, sizeof r);
    r.t0 = lm_now();
    r.parse_fn = parse_fn;
    snprintf(r.prefix, sizeof r.prefix, "%s", prefix);
    lm_command c = {
        .prefix = r.prefix, .log_error_prefix = "", .progress = &r.progress, .guard = &r.guard,
        .opts = lm_merge_opt_defs, .n_opts = lm_merge_n_opts, .inputs = guarded_opts, .n_inputs = 2, .first = first,
        .rest = first, .help = &r.args.help, .quiet = &r.args.quiet,
        .usage = usage_fn, .usage_arg = NULL, .parse = parse, .prepare = cmd_prepare, .work = cmd_work,
        .cleanup = cleanup, .ctx = &r,
    };
    return lm_command_run(&c, argc, argv);
}

// ==== for llmerge plan ========================================================================

// The parsed and prepared merge behind an lm_cmd_prepared (its `priv`).
int lm_cmd_merge_prepare(int argc, char **argv, const char *prefix, lm_cmd_prepared *out)
{
    memset(out, 0, sizeof *out);
    merge_run *r = calloc(1, sizeof *r);
    if (!r) {
        fprintf(stderr, "%s: out of memory\n", prefix);
        return 1;
    }
    out->priv = r;
    r->args.m = lm_method_find(argv[0]);
    // llmerge plan extract ..., or a configuration file (llmerge plan CONFIG.yml), rather than a
    // method
    bool extract = !r->args.m && strcmp(argv[0], "extract") == 0;
    if (extract)
        r->parse_fn = lm_cmd_extract_parse;
    else if (!r->args.m && lm_is_file(argv[0]))
        r->parse_fn = lm_cmd_run_parse_file;
    if (!r->args.m && !r->parse_fn) {
        char hint[256], names[256];
        bool mk = lm_cmd_mergekit_hint(argv[0], hint, sizeof hint);
        lm_cmd_method_names(names, sizeof names);
        fprintf(stderr, "%s: error: '%s' is not a merge method of llmerge (%s)%s%s\n%s: docs/mergekit.md says which "
                "of mergekit's methods llmerge has and what it calls them\n", prefix, argv[0], names, mk ? ": " : "",
                mk ? hint : "", prefix);
        return 2;
    }
    snprintf(r->prefix, sizeof r->prefix, "%s", prefix);
    r->args.planning = true;
    lm_progress_init(&r->progress, r->prefix, false);
    r->progress.quiet = true;  // a plan says what it finds on stdout; errors still go to stderr
    lm_err err = {0};
    lm_status s = r->parse_fn ? r->parse_fn(&r->args, argc, argv, &err) : lm_merge_parse_args(&r->args, argc, argv, &err);
    if (s != LM_OK) {
        lm_progress_error(&r->progress, 2, "%s (see llmerge %s --help)", err.msg,
                          extract ? "extract" : r->parse_fn ? "run" : r->args.m->name);
        return 2;
    }
    if ((s = lm_cmd_guard_args(&r->guard, argc, argv, lm_merge_opt_defs, lm_merge_n_opts, guarded_opts, 2, "BASE",
                               "FT", &err)) != LM_OK) {
        lm_progress_error(&r->progress, 1, "%s", err.msg);
        return 1;
    }
    if (r->args.help) {
        if (extract)
            lm_cmd_extract_usage(stdout, NULL);
        else if (!r->args.m)
            return 2;  // llmerge plan's own --help comes first; a configuration has none
        else
            lm_merge_usage(stdout, r->args.m);
        out->help = true;
        return 0;
    }
    if ((s = prepare(r, &err)) != LM_OK) {
        int rc = lm_status_exit_code(s);
        lm_progress_error(&r->progress, rc, "%s", err.msg);
        return rc;
    }
    out->method = r->args.m->name;
    out->out = r->args.out;
    out->base = r->base;
    out->fts = r->fts;
    out->ft_args = r->args.fts;
    out->ft_names = r->args.input_name + 1;
    out->opts = &r->opts;
    out->dev = r->dev;
    out->dev_why = r->dev_why;
    out->gpu_mem = r->args.gpu_mem;
    out->shard_size = r->args.shard_size;
    out->to_lora = r->args.to_lora;
    out->to_lora_exact = r->args.to_lora_exact;
    out->lora_dtype = r->args.lora_dtype;
    for (int i = -1; i < r->args.n_ft; i++) {
        const lm_model *m = i < 0 ? r->base : r->fts[i]->model;
        for (int j = 0; m && j < m->n_overlays; j++)
            out->vocab_bytes += m->overlays[j]->size;
    }
    if (r->args.use.hessians) {
        const lm_config *cfg = &r->base->config;
        out->calib = r->calib;
        out->n_calib = r->n_calib;
        out->calib_samples = r->args.calib_samples;
        out->seq_len = r->args.seq_len ? r->args.seq_len
                       : cfg->max_position_embeddings > 1 ? cfg->max_position_embeddings : 0;
        out->hessian_from_base = r->args.hessian_from_base;
        out->sticky = r->args.sticky;
        out->cache_dir = r->args.cache_dir;
        out->damp = SGPT_DAMP;
    }
    return 0;
}

void lm_cmd_merge_release(lm_cmd_prepared *p)
{
    merge_run *r = p->priv;
    if (r) {
        run_free(r);
        free(r);
    }
    memset(p, 0, sizeof *p);
}
