// llmerge run CONFIG.yml -o OUT [run options]: a mergekit configuration file merged as it says
// (docs/mergekit.md). The file is read (lib/mergecfg.h) and checked against its method before
// any work: every parameter the method does not take, every value llmerge does not support, is
// an error naming it and its line (exit status 2). What it says becomes the merge's arguments
// (merge_args): the base and the inputs in order, the method's options, and its parameters as
// per-tensor settings (lib/merge_params.h), which the merge engine evaluates tensor by tensor
// with mergekit's rules. The merge itself is the merge commands' (cmd/merge.c); OUT also gets
// the configuration, as mergekit_config.yml.
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <cJSON.h>

#include "adapter.h"
#include "cmd.h"
#include "manifest.h"
#include "merge_args.h"
#include "mergecfg.h"
#include "util.h"
#include "vocab.h"

// ==== what each method takes ==================================================================

// One parameter of a method as mergekit declares it: per model (a tensor parameter, looked up
// in the model's settings and then the global ones) or global; required or with a default.
typedef enum param_kind { P_SETTING, P_BOOL, P_INT, P_NUMBER } param_kind;

typedef struct param_def {
    const char *name;
    bool per_model;    // a tensor parameter of mergekit's (weight, density, ...)
    param_kind kind;   // P_SETTING: evaluated per tensor; the others one value for the merge
    bool required;
} param_def;

#define MAX_PARAMS 8

typedef struct method_params {
    lm_merge_method id;
    param_def p[MAX_PARAMS];
} method_params;

// mergekit's parameters of each method llmerge runs from a configuration (its registry and
// merge_methods/), by llmerge's method.
static const method_params method_table[] = {
    {LM_MERGE_TASK_ARITHMETIC, {{"weight", true, P_SETTING, true}, {"lambda", false, P_SETTING, false},
                                {"normalize", false, P_BOOL, false}, {"rescale", false, P_BOOL, false},
                                {"int8_mask", false, P_BOOL, false}}},
    {LM_MERGE_TIES, {{"weight", true, P_SETTING, true}, {"density", true, P_SETTING, false},
                     {"lambda", false, P_SETTING, false}, {"normalize", false, P_BOOL, false},
                     {"rescale", false, P_BOOL, false}, {"int8_mask", false, P_BOOL, false}}},
    {LM_MERGE_DARE, {{"weight", true, P_SETTING, true}, {"density", true, P_SETTING, false},
                     {"lambda", false, P_SETTING, false}, {"normalize", false, P_BOOL, false},
                     {"rescale", false, P_BOOL, false}, {"int8_mask", false, P_BOOL, false}}},
    {LM_MERGE_DARE_TIES, {{"weight", true, P_SETTING, true}, {"density", true, P_SETTING, false},
                          {"lambda", false, P_SETTING, false}, {"normalize", false, P_BOOL, false},
                          {"rescale", false, P_BOOL, false}, {"int8_mask", false, P_BOOL, false}}},
    {LM_MERGE_BREADCRUMBS, {{"weight", true, P_SETTING, true}, {"density", true, P_SETTING, false},
                            {"gamma", true, P_SETTING, false}, {"lambda", false, P_SETTING, false},
                            {"normalize", false, P_BOOL, false}, {"rescale", false, P_BOOL, false},
                            {"int8_mask", false, P_BOOL, false}}},
    {LM_MERGE_BREADCRUMBS_TIES, {{"weight", true, P_SETTING, true}, {"density", true, P_SETTING, false},
                                 {"gamma", true, P_SETTING, false}, {"lambda", false, P_SETTING, false},
                                 {"normalize", false, P_BOOL, false}, {"rescale", false, P_BOOL, false},
                                 {"int8_mask", false, P_BOOL, false}}},
    {LM_MERGE_DELLA, {{"weight", true, P_SETTING, true}, {"density", true, P_SETTING, false},
                      {"epsilon", true, P_SETTING, false}, {"lambda", false, P_SETTING, false},
                      {"normalize", false, P_BOOL, false}, {"rescale", false, P_BOOL, false},
                      {"int8_mask", false, P_BOOL, false}}},
    {LM_MERGE_DELLA_LINEAR, {{"weight", true, P_SETTING, true}, {"density", true, P_SETTING, false},
                             {"epsilon", true, P_SETTING, false}, {"lambda", false, P_SETTING, false},
                             {"normalize", false, P_BOOL, false}, {"rescale", false, P_BOOL, false},
                             {"int8_mask", false, P_BOOL, false}}},
    {LM_MERGE_LINEAR, {{"weight", true, P_SETTING, true}, {"normalize", false, P_BOOL, false}}},
    {LM_MERGE_SLERP, {{"t", false, P_SETTING, true}}},
    {LM_MERGE_NUSLERP, {{"weight", true, P_SETTING, true}, {"nuslerp_flatten", false, P_BOOL, false},
                        {"nuslerp_row_wise", false, P_BOOL, false}}},
    {LM_MERGE_MULTISLERP, {{"weight", true, P_SETTING, true}, {"normalize_weights", false, P_BOOL, false},
                           {"eps", false, P_NUMBER, false}}},
    {LM_MERGE_KARCHER, {{"max_iter", false, P_INT, false}, {"tol", false, P_NUMBER, false}}},
    {LM_MERGE_MODEL_STOCK, {{"filter_wise", false, P_BOOL, false}}},
    {LM_MERGE_NEARSWAP, {{"t", false, P_SETTING, true}}},
    {LM_MERGE_SCE, {{"select_topk", false, P_SETTING, false}, {"int8_mask", false, P_BOOL, false}}},
    {LM_MERGE_RAM, {{"epsilon", false, P_SETTING, false}}},
    {LM_MERGE_RAMPLUS, {{"r", false, P_NUMBER, false}, {"alpha", false, P_NUMBER, false},
                        {"epsilon", false, P_SETTING, false}}},
};

static const method_params *params_of(lm_merge_method id)
{
    for (size_t i = 0; i < sizeof method_table / sizeof method_table[0]; i++)
        if (method_table[i].id == id)
            return &method_table[i];
    return NULL;
}

// The merge_method values llmerge runs from a configuration, as llmerge names them: every
// method but sparsegpt (which needs calibration data), and passthrough.
static void config_method_names(char *buf, size_t cap)
{
    size_t len = 0;
    buf[0] = '\0';
    const lm_method *m;
    for (size_t i = 0; (m = lm_method_at(i)) && len < cap; i++)
        if (m->id != LM_MERGE_SPARSEGPT && params_of(m->id))
            len += (size_t)snprintf(buf + len, cap - len, "%s%s", len ? ", " : "", m->name);
    if (len < cap)
        snprintf(buf + len, cap - len, "%spassthrough", len ? ", " : "");
}

static const param_def *param_find(const method_params *mp, const char *name)
{
    for (int i = 0; i < MAX_PARAMS && mp->p[i].name; i++)
        if (strcmp(mp->p[i].name, name) == 0)
            return &mp->p[i];
    return NULL;
}

// Whether the method needs parameter `name` from every tensor's settings.
static bool required_param(const method_params *mp, const char *name)
{
    const param_def *d = param_find(mp, name);
    return d && d->required;
}

// The parameter names of mp, for messages.
static void param_names(const method_params *mp, bool per_model, char *buf, size_t cap)
{
    size_t len = 0;
    buf[0] = '\0';
    for (int i = 0; i < MAX_PARAMS && mp->p[i].name && len < cap; i++)
        if (!per_model || mp->p[i].per_model)
            len += (size_t)snprintf(buf + len, cap - len, "%s%s", len ? ", " : "", mp->p[i].name);
    if (!buf[0])
        snprintf(buf, cap, "none");
}

// ==== the run's own state =====================================================================

// What a configuration becomes, kept until the merge is done (merge_args' preset).
typedef struct run_preset {
    lm_mergecfg *cfg;
    bool sliced;                    // cfg's models were its one slice's sources (slice_as_models)
    // the PATH+LORA inputs on a model other than the base: input ft[i] is made from path[i] and
    // lora[i] before the merge opens its inputs (lm_cmd_lora_model)
    int *pending_ft;
    const char **pending_path, **pending_lora;
    int n_pending;
    char **owned;                   // (n_owned) strings made here (model paths, a template)
    int n_owned;
    const lm_params **models;       // (n_ft + 1) each model's settings: the base's, then each FT's
    const char **names;             // (n_ft + 1) how each was written, for messages
    const char **where;             // (n_ft + 1) where each was written (merge_args' input_where)
    const char **label;             // (n_ft + 1) "model 'NAME'" (merge_args' input_name)
    lm_merge_params mp;
    lm_vocab *vocab;                // the vocabulary the embeddings are rebuilt to, or NULL
} run_preset;

static void preset_free(void *ctx)
{
    run_preset *p = ctx;
    if (!p)
        return;
    lm_mergecfg_free(p->cfg);
    lm_vocab_free(p->vocab);
    for (int i = 0; i < p->n_owned; i++)
        free(p->owned[i]);
    free(p->owned);
    free(p->models);
    free(p->names);
    free(p->where);
    free(p->label);
    free(p->pending_ft);
    free(p->pending_path);
    free(p->pending_lora);
    free(p);
}

// Keeps s (made here) until the run is freed; NULL (and s freed) when memory runs out.
static char *keep(run_preset *p, char *s)
{
    char **o = s ? realloc(p->owned, (size_t)(p->n_owned + 1) * sizeof *o) : NULL;
    if (!o) {
        free(s);
        return NULL;
    }
    p->owned = o;
    return p->owned[p->n_owned++] = s;
}

// ==== reading the configuration ===============================================================

// "FILE:LINE:COL: " as the configuration reader writes it.
#define AT(cfg, line, col) (cfg)->path, (line), (col)

// The first number of setting v (a number, a gradient, or conditions on those) outside the range
// of parameter `name` (density: (0, 1]; gamma: [0, 1]; others: none), into *bad with where it
// was written, *line and *col (a gradient's own number's place); false when every number is in
// range. Every value the setting gives a tensor lies between two of its numbers, so checking
// them is checking all.
static bool out_of_range(const char *name, const lm_pval *v, double *bad, int *line, int *col)
{
    bool density = strcmp(name, "density") == 0, gamma = strcmp(name, "gamma") == 0;
    if (!density && !gamma)
        return false;
    if (v->kind == LM_PVAL_CONDS) {
        for (int c = 0; c < v->n_conds; c++)
            if (out_of_range(name, v->conds[c].value, bad, line, col))
                return true;
        return false;
    }
    int n = v->kind == LM_PVAL_GRADIENT ? v->n_grad : 1;
    for (int i = 0; i < n; i++) {
        double x = v->kind == LM_PVAL_GRADIENT ? v->grad[i] : v->num;
        if (density ? !(x > 0 && x <= 1) : !(x >= 0 && x <= 1)) {
            bool own = v->kind == LM_PVAL_GRADIENT && v->grad_lines;
            *bad = x;
            *line = own ? v->grad_lines[i] : v->line;
            *col = own ? v->grad_cols[i] : v->col;
            return true;
        }
    }
    return false;
}

// Checks one parameter set (a model's, or the global one) against the method's.
static lm_status check_params(const lm_mergecfg *cfg, const lm_params *ps, const method_params *mp, const char *mname,
                              bool per_model, const char *where, lm_err *err)
{
    for (int i = 0; i < ps->n; i++) {
        const lm_param *q = &ps->items[i];
        const param_def *d = param_find(mp, q->name);
        char names[256];
        if (!d || (per_model && !d->per_model)) {
            param_names(mp, per_model, names, sizeof names);
            return lm_err_set(err, LM_ERR_USAGE, "%s:%d:%d: %s: '%s' is not a%s parameter of %s (%s: %s)",
                              AT(cfg, q->line, q->col), where, q->name, per_model ? " per-model" : "", mname,
                              per_model ? "its per-model parameters" : "its parameters", names);
        }
        const lm_pval *v = q->value;
        if (d->kind == P_SETTING) {
            // a number, a gradient or conditions on those: the engine evaluates it per tensor
            bool ok = v->kind == LM_PVAL_NUMBER || v->kind == LM_PVAL_GRADIENT || v->kind == LM_PVAL_CONDS;
            for (int c = 0; v->kind == LM_PVAL_CONDS && c < v->n_conds; c++)
                ok = ok && (v->conds[c].value->kind == LM_PVAL_NUMBER || v->conds[c].value->kind == LM_PVAL_GRADIENT);
            if (!ok)
                return lm_err_set(err, LM_ERR_USAGE, "%s:%d:%d: %s: %s must be a number, a list of numbers (a gradient) "
                                  "or a list of {filter, value} with such values", AT(cfg, v->line, v->col), where,
                                  q->name);
            double x;
            int line, col;
            if (out_of_range(q->name, v, &x, &line, &col))
                return lm_err_set(err, LM_ERR_USAGE, "%s:%d:%d: %s: %s %g is not in %s", AT(cfg, line, col),
                                  where, q->name, x, q->name[0] == 'd' ? "(0, 1]" : "[0, 1]");
            continue;
        }
        bool ok = d->kind == P_BOOL ? v->kind == LM_PVAL_BOOL : v->kind == LM_PVAL_NUMBER;
        if (ok && d->kind == P_INT)
            ok = v->num == floor(v->num) && v->num >= 0 && v->num <= 1e6;
        if (!ok)
            return lm_err_set(err, LM_ERR_USAGE, "%s:%d:%d: %s: %s takes %s here (one value for the whole merge)",
                              AT(cfg, v->line, v->col), where, q->name,
                              d->kind == P_BOOL ? "true or false" : d->kind == P_INT ? "a whole number" : "a number");
    }
    return LM_OK;
}

// The merge-wide value of global parameter `name`, when given.
static const lm_pval *global_value(const lm_mergecfg *cfg, const char *name)
{
    const lm_param *q = lm_params_find(&cfg->params, name);
    return q ? q->value : NULL;
}

// Whether two model strings name the same directory: the same text, or the same real path.
static bool same_model(const char *a, const char *b)
{
    if (strcmp(a, b) == 0)
        return true;
    char ra[PATH_MAX], rb[PATH_MAX];
    return realpath(a, ra) && realpath(b, rb) && strcmp(ra, rb) == 0;
}

// Whether two models: entries name the same input: PATH, or PATH+LORA with both parts the same.
static bool same_entry(const char *a, const char *b)
{
    const char *pa = strchr(a, '+'), *pb = strchr(b, '+');
    if (!pa || !pb)
        return !pa && !pb && same_model(a, b);
    char *ha = strndup(a, (size_t)(pa - a)), *hb = strndup(b, (size_t)(pb - b));
    bool same = ha && hb && same_model(ha, hb) && same_model(pa + 1, pb + 1);
    free(ha);
    free(hb);
    return same;
}

// A model listed twice in models, the same text: mergekit keeps one input (its references are
// equal), with the first entry's parameters, where llmerge would merge it twice; refused, so
// that neither reading is guessed at. The same directory spelled otherwise is two references to
// mergekit as well, merged twice by both.
static lm_status check_repeats(const lm_mergecfg *cfg, const char *list, lm_err *err)
{
    for (int j = 1; j < cfg->n_models; j++)
        for (int i = 0; i < j; i++)
            if (strcmp(cfg->models[i].model, cfg->models[j].model) == 0)
                return lm_err_set(err, LM_ERR_USAGE, "%s:%d:%d: model '%s' is listed twice in %s (lines %d and "
                                  "%d): mergekit would merge it once, with the first entry's parameters; list it once",
                                  AT(cfg, cfg->models[j].line, cfg->models[j].col), cfg->models[j].model, list,
                                  cfg->models[i].line, cfg->models[j].line);
    return LM_OK;
}

// An input as the merge opens it: PATH, or for PATH+LORA (mergekit's LoRA applied to a model)
// the adapter LORA, which llmerge merges onto the base as it is when PATH is the base; on any
// other PATH, the model PATH+LORA is made in the cache before the merge (*pending set; the
// input is PATH until then).
static lm_status model_input(run_preset *p, const lm_cfg_model *m, const char *base, const char **out,
                             bool *pending, lm_err *err)
{
    const char *plus = strchr(m->model, '+');
    *pending = false;
    if (!plus || !plus[1]) {
        *out = m->model;
        return LM_OK;
    }
    char *path = keep(p, strndup(m->model, (size_t)(plus - m->model)));
    if (!path)
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    if (base && same_model(path, base)) {
        *out = plus + 1;
        return LM_OK;
    }
    int *f = realloc(p->pending_ft, (size_t)(p->n_pending + 1) * sizeof *f);
    if (f)
        p->pending_ft = f;
    const char **pp = f ? realloc(p->pending_path, (size_t)(p->n_pending + 1) * sizeof *pp) : NULL;
    if (pp)
        p->pending_path = pp;
    const char **pl = pp ? realloc(p->pending_lora, (size_t)(p->n_pending + 1) * sizeof *pl) : NULL;
    if (!pl)
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    p->pending_lora = pl;
    p->pending_path[p->n_pending] = path;
    p->pending_lora[p->n_pending] = plus + 1;
    p->n_pending++;
    *pending = true;
    *out = path;
    return LM_OK;
}

// llmerge run's prepare_inputs: each PATH+LORA on a model other than the base made (or found)
// in the cache, the input then that model.
static lm_status make_pending(merge_args *a, lm_progress *pr, lm_err *err)
{
    run_preset *p = a->preset;
    if (a->to_lora_exact && p->n_pending > 0)  // refused before it is made, naming it as written
        return lm_err_set(err, LM_ERR_USAGE, "%s: --to-lora exact concatenates the inputs' factors: this is a LoRA "
                          "of another model than the base, so a full model once merged onto it, which has none "
                          "(give a rank)", p->where[1 + p->pending_ft[0]]);
    // llmerge plan writes nothing: each such input is planned as PATH itself, whose tensors the
    // model made from it has (names and shapes, in PATH's dtype)
    for (int i = 0; !a->planning && i < p->n_pending; i++) {
        char *dir = NULL;
        bool made = false;
        lm_status s = lm_cmd_lora_model(p->pending_path[i], p->pending_lora[i], a->cache_dir, a->threads, &dir, &made,
                                        err);
        if (s != LM_OK)
            return s;
        if (!keep(p, dir))
            return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
        a->fts[p->pending_ft[i]] = dir;
        lm_progress_note(pr, "%s+%s: %s %s", p->pending_path[i], p->pending_lora[i],
                         made ? "merged into a model once, in the cache:" : "from the cache:", dir);
    }
    return LM_OK;
}

// The dtype `name` names (written at `line` for `key`), into *dt.
static lm_status dtype_named(const lm_mergecfg *cfg, const char *key, const char *name, int line, lm_dtype *dt,
                             lm_err *err)
{
    static const struct {
        const char *name;
        lm_dtype dt;
    } names[] = {{"float32", LM_DTYPE_F32}, {"fp32", LM_DTYPE_F32}, {"float", LM_DTYPE_F32},
                 {"float16", LM_DTYPE_F16}, {"fp16", LM_DTYPE_F16}, {"half", LM_DTYPE_F16},
                 {"bfloat16", LM_DTYPE_BF16}, {"bf16", LM_DTYPE_BF16}};
    const char *bare = strncmp(name, "torch.", 6) == 0 ? name + 6 : name;  // mergekit's torch.float16
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (strcmp(names[i].name, bare) == 0) {
            *dt = names[i].dt;
            return LM_OK;
        }
    return lm_err_set(err, LM_ERR_USAGE, "%s:%d: %s: '%s' is not a dtype llmerge writes (float32, float16 or "
                      "bfloat16)", cfg->path, line, key, name);
}

// The output dtype a configuration names: out_dtype, else dtype (mergekit writes in the dtype it
// merges in), else none. dtype is checked even where out_dtype wins: mergekit computes in it, so
// a name it cannot read fails there whatever out_dtype says.
static lm_status config_dtype(const lm_mergecfg *cfg, merge_args *a, lm_err *err)
{
    lm_dtype dt = LM_DTYPE_F32, out = LM_DTYPE_F32;
    lm_status s;
    if (cfg->dtype && (s = dtype_named(cfg, "dtype", cfg->dtype, cfg->dtype_line, &dt, err)) != LM_OK)
        return s;
    if (cfg->out_dtype && (s = dtype_named(cfg, "out_dtype", cfg->out_dtype, cfg->out_dtype_line, &out, err)) != LM_OK)
        return s;
    if (cfg->out_dtype || cfg->dtype) {
        a->have_dtype = true;
        a->dtype = cfg->out_dtype ? out : dt;
    }
    return LM_OK;
}

// The global parameters that are one value for the merge, into the merge's options.
static lm_status config_options(const lm_mergecfg *cfg, const lm_method *m, merge_args *a, lm_err *err)
{
    const lm_pval *v;
    if ((v = global_value(cfg, "normalize")) || (v = global_value(cfg, "normalize_weights")))
        a->normalize = v->num != 0;
    if ((v = global_value(cfg, "rescale"))) {
        if (m->drop)
            a->rescale = v->num != 0 ? LM_RESCALE_L1 : LM_RESCALE_NONE;
        else if (v->num != 0)
            return lm_err_set(err, LM_ERR_UNSUPPORTED, "%s:%d:%d: rescale: true with %s (the kept entries' L1 norm "
                              "matched after a magnitude trim) is not supported yet", AT(cfg, v->line, v->col),
                              m->name);
    } else if (m->drop) {
        a->rescale = LM_RESCALE_L1;  // mergekit's default for dare and della: rescale: true
    }
    if ((v = global_value(cfg, "int8_mask")) && v->num != 0)
        a->note = "int8_mask has no effect in llmerge: it keeps no masks in memory (the result is the same)";
    if ((v = global_value(cfg, "max_iter")))
        a->max_iter = (int)v->num;
    if ((v = global_value(cfg, "tol")))
        a->tol = v->num;
    if ((v = global_value(cfg, "r")))
        a->ram_r = v->num;
    if ((v = global_value(cfg, "alpha")))
        a->ram_alpha = v->num;
    if ((v = global_value(cfg, "eps")) && v->num != 1e-8)
        return lm_err_set(err, LM_ERR_UNSUPPORTED, "%s:%d:%d: eps: only multislerp's default 1e-8 is supported",
                          AT(cfg, v->line, v->col));
    // nuslerp_flatten: false slerps each row (the last dimension), with nuslerp_row_wise: true
    // each column; model_stock's filter_wise: true takes each row
    const lm_pval *rw = global_value(cfg, "nuslerp_row_wise");
    if ((v = global_value(cfg, "nuslerp_flatten")) && v->num == 0) {
        if (rw && rw->num != 0)
            a->per_col = true;
        else
            a->per_row = true;
    }
    if ((v = global_value(cfg, "filter_wise")) && v->num != 0)
        a->per_row = true;
    if (cfg->has_seed)
        a->seed = cfg->random_seed;
    return LM_OK;
}

// Input i (0 the base) as model cm was written, for messages about it (owned by p): where,
// "FILE:LINE:COL: model 'NAME'", and its label, "model 'NAME'"; with cm NULL, base_model's.
// False when memory runs out.
static bool written_at(run_preset *p, int i, const lm_cfg_model *cm)
{
    const lm_mergecfg *cfg = p->cfg;
    const char *key = cm ? "model" : "base_model", *name = cm ? cm->model : cfg->base_model;
    p->label[i] = keep(p, lm_strfmt("%s '%s'", key, name));
    p->where[i] = keep(p, lm_strfmt("%s:%d:%d: %s", AT(cfg, cm ? cm->line : cfg->base_line,
                                                       cm ? cm->col : cfg->base_col), p->label[i] ? p->label[i] : ""));
    return p->label[i] && p->where[i];
}

// Appends input `path`, written as model cm (its settings, its name, where), as FT n of the
// preset.
static lm_status add_ft(run_preset *p, merge_args *a, const char *path, const lm_cfg_model *cm, lm_err *err)
{
    a->fts[a->n_ft] = path;
    p->models[1 + a->n_ft] = &cm->params;
    p->names[1 + a->n_ft] = cm->model;
    if (!written_at(p, 1 + a->n_ft, cm))
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    a->n_ft++;
    return LM_OK;
}

// The models of a configuration as the merge's BASE and inputs, by what the method reads.
static lm_status config_models(run_preset *p, const lm_method *m, merge_args *a, lm_err *err)
{
    const lm_mergecfg *cfg = p->cfg;
    int n = cfg->n_models;
    a->fts = calloc((size_t)n + 1, sizeof *a->fts);
    p->models = calloc((size_t)n + 2, sizeof *p->models);
    p->names = calloc((size_t)n + 2, sizeof *p->names);
    p->where = calloc((size_t)n + 2, sizeof *p->where);
    p->label = calloc((size_t)n + 2, sizeof *p->label);
    if (!a->fts || !p->models || !p->names || !p->where || !p->label)
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    a->input_where = p->where;
    a->input_name = p->label;
    const char *base = cfg->base_model;
    if (base && strchr(base, '+'))
        return lm_err_set(err, LM_ERR_UNSUPPORTED, "%s:%d:%d: base_model '%s': a LoRA on the base is not supported "
                          "(merge it into the base first)", AT(cfg, cfg->base_line, cfg->base_col), base);
    int base_at = -1;  // the entry of models: that is base_model
    for (int i = 0; base && i < n; i++)
        if (same_model(cfg->models[i].model, base)) {
            base_at = i;
            break;
        }
    bool models = m->input == LM_METHOD_MODELS || (m->input == LM_METHOD_EITHER && !base);
    a->models_only = m->input == LM_METHOD_EITHER && !base;
    lm_status s = LM_OK;
    if (!models) {
        if (!base)
            return lm_err_set(err, LM_ERR_USAGE, "%s:%d:%d: %s needs base_model: the task vectors are taken against "
                              "it", AT(cfg, cfg->method_line, cfg->method_col), m->name);
        // A base_model listed among the models is the base, not an input, as mergekit drops it from
        // the tensors it interpolates; but mergekit's nuslerp refuses it where it is one of just two
        // listed, which leaves one task vector (with three listed it interpolates the other two).
        if (m->id == LM_MERGE_NUSLERP && base_at >= 0 && n == 2)
            return lm_err_set(err, LM_ERR_USAGE, "%s:%d:%d: %s with base_model interpolates two other models' task "
                              "vectors: base_model is one of only two models listed (list two besides it, or "
                              "leave base_model out to interpolate these two)",
                              AT(cfg, cfg->models[base_at].line, cfg->models[base_at].col), m->name);
        a->base = base;
        p->models[0] = base_at >= 0 ? &cfg->models[base_at].params : NULL;
        p->names[0] = base;
        if (!written_at(p, 0, NULL))
            return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
        for (int i = 0; s == LM_OK && i < n; i++) {
            if (i == base_at)
                continue;
            const char *in;
            bool pending;
            if ((s = model_input(p, &cfg->models[i], base, &in, &pending, err)) != LM_OK)
                break;
            if (pending)
                p->pending_ft[p->n_pending - 1] = a->n_ft;
            s = add_ft(p, a, in, &cfg->models[i], err);
        }
        return s;
    }
    // the models themselves: the reference is base_model, or the first model
    if (base && base_at < 0 && m->id == LM_MERGE_LINEAR)
        return lm_err_set(err, LM_ERR_USAGE, "%s:%d:%d: linear averages the models listed: base_model '%s' is not "
                          "among them (mergekit would give it no weight)", AT(cfg, cfg->base_line, cfg->base_col),
                          base);
    int ref = base_at >= 0 ? base_at : base ? -1 : 0;
    a->base = ref >= 0 ? cfg->models[ref].model : base;
    p->models[0] = ref >= 0 ? &cfg->models[ref].params : NULL;
    p->names[0] = a->base;
    if (!written_at(p, 0, ref >= 0 ? &cfg->models[ref] : NULL))
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    if (ref >= 0 && strchr(cfg->models[ref].model, '+'))
        return lm_err_set(err, LM_ERR_UNSUPPORTED, "%s:%d:%d: model '%s': the first model of %s is the one the "
                          "others are checked against: a LoRA on it is not supported (list a plain model first)",
                          AT(cfg, cfg->models[ref].line, cfg->models[ref].col), cfg->models[ref].model, m->name);
    for (int i = 0; s == LM_OK && i < n; i++) {
        if (i == ref)
            continue;
        const char *in;
        bool pending;
        if ((s = model_input(p, &cfg->models[i], a->base, &in, &pending, err)) != LM_OK)
            break;
        if (pending)
            p->pending_ft[p->n_pending - 1] = a->n_ft;
        s = add_ft(p, a, in, &cfg->models[i], err);
    }
    return s;
}

// Checks that every model has the method's required per-model parameters somewhere (its own
// settings or the global ones), and the required global ones are there.
static lm_status check_required(const run_preset *p, const method_params *mp, const lm_method *m,
                                const merge_args *a, lm_err *err)
{
    const lm_mergecfg *cfg = p->cfg;
    bool models = m->input == LM_METHOD_MODELS || (m->input == LM_METHOD_EITHER && a->models_only);
    for (int i = 0; i < MAX_PARAMS && mp->p[i].name; i++) {
        const param_def *d = &mp->p[i];
        if (!d->required)
            continue;
        if (lm_params_find(&cfg->params, d->name))
            continue;
        if (!d->per_model)
            return lm_err_set(err, LM_ERR_USAGE, "%s:%d:%d: %s needs parameters: %s (none given)",
                              AT(cfg, cfg->method_line, cfg->method_col), m->name, d->name);
        for (int j = models ? 0 : 1; j <= a->n_ft; j++) {
            if (p->models[j] && lm_params_find(p->models[j], d->name))
                continue;
            // where the model was written: its entry of models:, else base_model
            int line = cfg->base_line, col = cfg->base_col;
            for (int i = 0; i < cfg->n_models; i++)
                if (p->models[j] == &cfg->models[i].params) {
                    line = cfg->models[i].line;
                    col = cfg->models[i].col;
                }
            return lm_err_set(err, LM_ERR_USAGE, "%s:%d:%d: model '%s' has no %s, and the global parameters give "
                              "none (%s needs one for every model%s)", AT(cfg, line, col), p->names[j], d->name,
                              m->name, models ? "" : " but the base");
        }
    }
    return LM_OK;
}

// The chat templates a configuration may name, as mergekit names them: llmerge's own renderings
// of these formats (docs/mergekit.md says where they differ from mergekit's files).
static const struct {
    const char *name, *jinja;
} named_templates[] = {
    {"chatml", "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
               "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"},
    {"llama3", "{% for m in messages %}{% if loop.first %}{{ bos_token }}{% endif %}{{ '<|start_header_id|>' + "
               "m['role'] + '<|end_header_id|>\\n\\n' + (m['content'] | trim) + '<|eot_id|>' }}{% endfor %}"
               "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"},
    {"alpaca", "{% set heads = {'user': '### Instruction:\\n', 'user_context': '### Input:\\n', "
               "'assistant': '### Response:\\n'} %}{% set system = messages | selectattr('role', 'equalto', "
               "'system') | list %}{% if system %}{{ (system | last)['content'] | trim }}{% endif %}{{ '\\n\\n' }}"
               "{% for m in messages if m['role'] in heads %}{% if not loop.first %}{{ '\\n\\n' }}{% endif %}"
               "{{ heads[m['role']] + (m['content'] | trim) }}{% endfor %}{% if add_generation_prompt and "
               "messages[-1]['role'] != 'assistant' %}{{ '\\n\\n### Response:\\n' }}{% endif %}"},
    {"exaone", "{% for m in messages %}{% if loop.first and m['role'] != 'system' %}"
               "{{ '[|system|][|endofturn|]\\n' }}{% endif %}{{ '[|' + m['role'] + '|]' + m['content'] + "
               "('\\n' if m['role'] == 'user' else '[|endofturn|]\\n') }}{% endfor %}"
               "{% if add_generation_prompt %}{{ '[|assistant|]' }}{% endif %}"},
    // Mistral's [INST] turns, a leading system message put before the first user turn
    {"mistral", "{% set sys = messages[0]['content'] if messages and messages[0]['role'] == 'system' else none %}"
                "{{ bos_token }}{% for m in (messages[1:] if sys is not none else messages) %}"
                "{% if m['role'] not in ['user', 'assistant'] or (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
                "{{ raise_exception('mistral: after an optional system message, the roles alternate user, assistant, "
                "user, ...') }}{% endif %}{% if m['role'] == 'user' %}{{ ' [INST] ' + (sys + '\\n\\n' if loop.first "
                "and sys is not none else '') + m['content'] + ' [/INST]' }}{% else %}{{ ' ' + m['content'] + "
                "eos_token }}{% endif %}{% endfor %}"},
};

// ---- tokenizer_source -----------------------------------------------------------------------

// Whether directory d holds a tokenizer.model.
static bool has_spm(const char *d)
{
    char *path = lm_path_join(d, "tokenizer.model");
    bool has = path && lm_is_file(path);
    free(path);
    return has;
}

// Whether two model directories' tokenizer.model files (SentencePiece's, read by llmerge no
// further) are there and byte for byte the same.
static bool same_spm(const char *a, const char *b)
{
    char *pa = lm_path_join(a, "tokenizer.model"), *pb = lm_path_join(b, "tokenizer.model");
    char *ta = NULL, *tb = NULL;
    size_t la = 0, lb = 0;
    lm_err e = {0};
    bool same = pa && pb && lm_read_file(pa, 1u << 30, &ta, &la, &e) == LM_OK &&
                lm_read_file(pb, 1u << 30, &tb, &lb, &e) == LM_OK && la == lb && memcmp(ta, tb, la) == 0;
    free(ta);
    free(tb);
    free(pa);
    free(pb);
    return same;
}

// tokenizer_source: base or a model. With it mergekit rebuilds the embedding and output
// matrices to that tokenizer's vocabulary, each model's rows moved to the ids its tokens have
// there. llmerge does the same (cmd/merge_vocab.c) where that moves a row: where the output's
// vocabulary (the source's, as it is; the base's stripped to its vocab_size) is not the base's,
// or a model's (its tokenizer.json's, stripped to its own vocab_size) is not the output's; where
// nothing would move it merges the rows where they are, keeping the base's row count. A model's
// tokenizer files go into OUT.
static lm_status config_vocab(run_preset *p, merge_args *a, lm_err *err)
{
    const lm_mergecfg *cfg = p->cfg;
    const char *src = cfg->tokenizer_source, *key = cfg->tokenizer_key;
    bool from_base = strcmp(src, "base") == 0, rebuild = false;
    lm_input_kind kind;
    char *base_dir = NULL, *src_dir = NULL;
    lm_vocab *base = NULL, *out = NULL;
    int64_t base_rows = 0;
    lm_status s = lm_input_detect(a->base, &kind, &base_dir, err);
    if (s != LM_OK || kind != LM_INPUT_MODEL) {  // the merge says what is wrong with the base
        free(base_dir);
        return LM_OK;
    }
    if ((s = lm_vocab_load_dir(&base, base_dir, true, &base_rows, err)) != LM_OK)
        lm_err_prefix(err, "%s:%d: %s: the base's tokenizer", cfg->path, cfg->tokenizer_line, key);
    if (s == LM_OK && !from_base) {
        // a PATH+LORA model of the configuration: PATH's tokenizer
        const char *dir = src, *plus = strchr(src, '+');
        for (int i = 0; i < cfg->n_models; i++)
            if (strcmp(cfg->models[i].model, src) == 0 && plus && plus[1])
                dir = keep(p, strndup(src, (size_t)(plus - src)));
        if (!dir)
            s = lm_err_set(err, LM_ERR_NOMEM, "out of memory");
        else if ((s = lm_input_detect(dir, &kind, &src_dir, err)) == LM_OK && kind != LM_INPUT_MODEL)
            s = lm_err_set(err, LM_ERR_USAGE, "%s:%d: %s '%s' is not a model directory", cfg->path,
                           cfg->tokenizer_line, key, src);
        if (s == LM_OK && (s = lm_vocab_load_dir(&out, src_dir, false, NULL, err)) != LM_OK)
            lm_err_prefix(err, "%s:%d: %s '%s'", cfg->path, cfg->tokenizer_line, key, src);
        if (s == LM_OK && !out && !base) {
            // no tokenizer.json on either side: the base's own directory, or SentencePiece's
            // tokenizer.model, the same bytes
            bool spm_src = has_spm(src_dir), spm_base = has_spm(base_dir);
            if (!same_model(src_dir, base_dir) && !same_spm(src_dir, base_dir))
                s = lm_err_set(err, LM_ERR_UNSUPPORTED, "%s:%d: %s '%s': neither it nor the base has a "
                               "tokenizer.json, and %s: the vocabularies cannot be compared (llmerge reads "
                               "tokenizer.json's)", cfg->path, cfg->tokenizer_line, key, src,
                               spm_src && spm_base ? "their tokenizer.model files are not the same"
                               : spm_src           ? "the base has no tokenizer.model"
                               : spm_base          ? "it has no tokenizer.model"
                                                   : "neither has a tokenizer.model");
        } else if (s == LM_OK && (!out || !base)) {
            s = lm_err_set(err, LM_ERR_UNSUPPORTED, "%s:%d: %s '%s': %s has no tokenizer.json and %s "
                           "has one: the vocabularies cannot be compared", cfg->path, cfg->tokenizer_line, key, src,
                           !out ? "it" : "the base", !out ? "the base" : "it");
        } else if (s == LM_OK) {
            int64_t n = out->n_ids > base_rows ? out->n_ids : base_rows;
            rebuild = lm_vocab_first_difference(out, base, n) >= 0;
        }
        if (s == LM_OK) {
            a->tokenizer_dir = keep(p, src_dir);  // kept, or freed by keep
            src_dir = NULL;
            if (!a->tokenizer_dir)
                s = lm_err_set(err, LM_ERR_NOMEM, "out of memory");
        }
    }
    // every model with a tokenizer of its own, against the output's vocabulary (one that has none
    // cannot be matched to a model's)
    lm_vocab *want = out ? out : base;
    for (int i = 0; s == LM_OK && i <= cfg->n_models; i++) {
        const char *m = i < cfg->n_models ? cfg->models[i].model : cfg->base_model;
        int line = i < cfg->n_models ? cfg->models[i].line : cfg->base_line;
        if (!m)
            continue;
        const char *plus = strchr(m, '+');
        char *dir = plus && plus[1] ? strndup(m, (size_t)(plus - m)) : lm_strdup(m), *resolved = NULL;
        lm_vocab *v = NULL;
        lm_err ignored = {0};
        if (!dir) {
            s = lm_err_set(err, LM_ERR_NOMEM, "out of memory");
        } else if (lm_input_detect(dir, &kind, &resolved, &ignored) == LM_OK && kind == LM_INPUT_MODEL) {
            // (what is not a model is refused with its line where the models are read)
            if ((s = lm_vocab_load_dir(&v, resolved, true, NULL, err)) != LM_OK)
                lm_err_prefix(err, "%s:%d: model '%s'", cfg->path, line, m);
            else if (v && !want)
                s = lm_err_set(err, LM_ERR_UNSUPPORTED, "%s:%d: model '%s' has a tokenizer.json, and the output's "
                               "vocabulary (%s: %s) has none: its rows cannot be matched to the "
                               "output's ids", cfg->path, line, m, key, src);
            else if (v && !rebuild)
                rebuild = lm_vocab_first_difference(v, want, v->n_ids > want->n_ids ? v->n_ids : want->n_ids) >= 0;
        }
        lm_vocab_free(v);
        free(resolved);
        free(dir);
    }
    if (s == LM_OK && rebuild && want->n_tokens == 0)
        s = lm_err_set(err, LM_ERR_USAGE, "%s:%d: %s '%s': its vocabulary has no tokens: no embedding "
                       "rows to rebuild the models' to", cfg->path, cfg->tokenizer_line, key, src);
    if (s == LM_OK && rebuild) {
        char what[LM_ERR_MSG_MAX / 4];
        snprintf(what, sizeof what, "%s: %s", key, src);
        p->vocab = want;
        a->vocab = want;
        a->vocab_prefer_base = cfg->base_model != NULL;
        if (want == out)
            out = NULL;
        else
            base = NULL;
        if (!(a->vocab_source = keep(p, lm_strdup(what))))
            s = lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    }
    lm_vocab_free(base);
    lm_vocab_free(out);
    free(base_dir);
    free(src_dir);
    return s;
}

// chat_template: *out the Jinja template (a name of mergekit's as llmerge's template of that
// format), "auto", or NULL where the configuration gives none.
static lm_status config_template(const lm_mergecfg *cfg, const char **out, lm_err *err)
{
    const char *t = cfg->chat_template;
    *out = NULL;
    if (!t)
        return LM_OK;
    if (strcmp(t, "auto") == 0) {
        *out = "auto";
        return LM_OK;
    }
    for (size_t i = 0; i < sizeof named_templates / sizeof *named_templates; i++)
        if (strcmp(t, named_templates[i].name) == 0) {
            *out = named_templates[i].jinja;
            return LM_OK;
        }
    if (strlen(t) < 20 || !strchr(t, '{'))  // mergekit's rule for a template given by name
        return lm_err_set(err, LM_ERR_USAGE, "%s:%d: chat_template '%s': not a template llmerge knows by name "
                          "(alpaca, chatml, exaone, llama3, mistral), nor a Jinja template, nor auto", cfg->path,
                          cfg->chat_template_line, t);
    *out = t;
    return LM_OK;
}

// tokenizer_source and chat_template.
static lm_status config_tokenizer(run_preset *p, merge_args *a, lm_err *err)
{
    const lm_mergecfg *cfg = p->cfg;
    lm_status s;
    if (cfg->tokenizer_source && (s = config_vocab(p, a, err)) != LM_OK)
        return s;
    return config_template(cfg, &a->chat_template, err);
}

// mergekit merges a slice's sources layer by layer, the output's layers being the slices'
// in turn. llmerge runs with a method the form such files have: one slice whose sources each
// give the whole stack, [0, N], N the base's layers (merge.c checks N once the base is open).
// mergekit turns models: into that very slice, so it runs as models:, each source's parameters
// a model's: the sources become cfg's models, and the span goes to a.
static lm_status slice_as_models(run_preset *p, const lm_method *m, merge_args *a, lm_err *err)
{
    lm_mergecfg *cfg = p->cfg;
    const lm_cfg_slice *sl = &cfg->slices[0];
    if (cfg->n_slices > 1)
        return lm_err_set(err, LM_ERR_UNSUPPORTED, "%s:%d:%d: %d slices: with merge_method %s llmerge merges one "
                          "slice, whose sources each give every layer, [0, N]; slices merged apart and stacked are "
                          "not supported yet (passthrough stacks slices of one source each)",
                          AT(cfg, cfg->slices[1].line, cfg->slices[1].col), cfg->n_slices, m->name);
    for (int i = 0; i < sl->n_sources; i++)
        if (sl->sources[i].layer_range[0] != 0)
            return lm_err_set(err, LM_ERR_UNSUPPORTED, "%s:%d:%d: model '%s': layer_range [%" PRId64 ", %" PRId64
                              "]: with merge_method %s a slice's sources each give every layer, [0, N] with N the "
                              "base's num_hidden_layers (passthrough stacks parts of stacks)",
                              AT(cfg, sl->sources[i].line, sl->sources[i].col), sl->sources[i].model,
                              sl->sources[i].layer_range[0], sl->sources[i].layer_range[1], m->name);
    // mergekit merges a slice's sources only: under models: it adds a base_model not listed, in a
    // slice its methods that take task vectors stop without it, and the others leave it out
    bool base_listed = !cfg->base_model;
    for (int i = 0; !base_listed && i < sl->n_sources; i++)
        base_listed = same_model(cfg->base_model, sl->sources[i].model);
    if (!base_listed)
        return lm_err_set(err, LM_ERR_UNSUPPORTED, "%s:%d:%d: base_model '%s' is not among the slice's sources, which "
                          "are all mergekit merges in a slice (where the method needs the base, it stops): list it "
                          "among them, or write models:", AT(cfg, cfg->base_line, cfg->base_col), cfg->base_model);
    a->slice_layers = sl->sources[0].layer_range[1];
    if (!(a->slice_where = keep(p, lm_strfmt("%s:%d:%d: slices[0]", AT(cfg, sl->line, sl->col)))))
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    cfg->models = sl->sources;
    cfg->n_models = sl->n_sources;
    free(cfg->slices);
    cfg->slices = NULL;
    cfg->n_slices = 0;
    p->sliced = true;
    return LM_OK;
}

lm_status lm_cmd_run_config(merge_args *a, const char *path, lm_err *err)
{
    run_preset *p = calloc(1, sizeof *p);
    if (!p)
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    a->preset = p;
    a->preset_free = preset_free;
    lm_status s = lm_mergecfg_load(&p->cfg, path, err);
    if (s != LM_OK)
        return s;
    const lm_mergecfg *cfg = p->cfg;
    a->config_path = cfg->path;
    a->config_text = cfg->text;
    const lm_method *m = lm_method_find(cfg->merge_method);
    if (!m || m->id == LM_MERGE_SPARSEGPT || !params_of(m->id)) {
        char names[512];
        config_method_names(names, sizeof names);
        if (strcmp(cfg->merge_method, "arcee_fusion") == 0)  // mergekit's, which llmerge lacks
            return lm_err_set(err, LM_ERR_UNSUPPORTED, "%s:%d:%d: merge_method: arcee_fusion is mergekit's and not "
                              "in llmerge (docs/mergekit.md, Methods, says why); llmerge runs %s",
                              AT(cfg, cfg->method_line, cfg->method_col), names);
        if (strcmp(cfg->merge_method, "passthrough") == 0)  // llmerge plan: llmerge run stacks them
            return lm_err_set(err, LM_ERR_UNSUPPORTED, "%s:%d:%d: merge_method: passthrough: llmerge plan does not "
                              "plan a stack of layers (llmerge run CONFIG does it)",
                              AT(cfg, cfg->method_line, cfg->method_col));
        return lm_err_set(err, LM_ERR_USAGE, "%s:%d:%d: merge_method: '%s' is not a method llmerge runs from a "
                          "configuration (%s; sparsegpt needs calibration data: llmerge sparsegpt)",
                          AT(cfg, cfg->method_line, cfg->method_col), cfg->merge_method, names);
    }
    a->m = m;
    a->use = lm_merge_uses(m);
    if (cfg->n_slices > 0 && (s = slice_as_models(p, m, a, err)) != LM_OK)
        return s;
    const method_params *mp = params_of(m->id);
    if ((s = check_params(cfg, &cfg->params, mp, m->name, false, "parameters", err)) != LM_OK)
        return s;
    for (int i = 0; i < cfg->n_models; i++) {
        char where[64];
        snprintf(where, sizeof where, p->sliced ? "slices[0].sources[%d].parameters" : "models[%d].parameters", i);
        if ((s = check_params(cfg, &cfg->models[i].params, mp, m->name, true, where, err)) != LM_OK)
            return s;
    }
    if ((s = check_repeats(cfg, p->sliced ? "the slice's sources" : "models", err)) != LM_OK ||
        (s = config_models(p, m, a, err)) != LM_OK)
        return s;
    // as many models as the method takes, said of the configuration (the merge's own check
    // speaks of the command line's BASE and FTs)
    bool as_models = m->input == LM_METHOD_MODELS || (m->input == LM_METHOD_EITHER && a->models_only);
    int inputs = a->n_ft + (as_models ? 1 : 0);
    if (inputs < m->min_inputs || (m->max_inputs > 0 && inputs > m->max_inputs))
        return lm_err_set(err, LM_ERR_USAGE, "%s:%d:%d: %s takes %s%d model%s%s, not %d",
                          AT(cfg, cfg->method_line, cfg->method_col), m->name,
                          m->min_inputs == m->max_inputs ? "" : inputs < m->min_inputs ? "at least " : "at most ",
                          inputs < m->min_inputs ? m->min_inputs : m->max_inputs,
                          (inputs < m->min_inputs ? m->min_inputs : m->max_inputs) == 1 ? "" : "s",
                          as_models ? "" : " besides base_model", inputs);
    if ((s = check_required(p, mp, m, a, err)) != LM_OK ||
        (s = config_options(cfg, m, a, err)) != LM_OK || (s = config_dtype(cfg, a, err)) != LM_OK ||
        (s = config_tokenizer(p, a, err)) != LM_OK)
        return s;
    // mergekit's defaults where the configuration gives none: density 1 (nothing trimmed)
    if (!(a->densities = malloc(sizeof *a->densities)))
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    a->densities[0] = 1.0;
    a->n_densities = 1;
    a->density_opt = "density";
    bool models = m->input == LM_METHOD_MODELS || (m->input == LM_METHOD_EITHER && a->models_only);
    p->mp = (lm_merge_params){.global = &cfg->params, .models = p->models, .n_ft = a->n_ft,
                              .required = (required_param(mp, "weight") ? LM_MP_WEIGHT : 0) |
                                          (required_param(mp, "t") ? LM_MP_T : 0),
                              .base_is_model = models, .names = p->names, .file = cfg->path};
    a->params = &p->mp;
    if (p->n_pending > 0)
        a->prepare_inputs = make_pending;
    return LM_OK;
}

// ==== the command line ========================================================================

// The options of llmerge run: where and how the work runs. What the merge computes is the
// configuration's to say.
static bool run_option(int id)
{
    switch (id) {
    case OPT_OUTPUT: case OPT_SHARD_SIZE: case OPT_DEVICE: case OPT_GPU_MEM: case OPT_THREADS: case OPT_CACHE_DIR:
    case OPT_LOG_JSON: case OPT_QUIET: case OPT_VERBOSE: case OPT_FORCE: case OPT_NO_CARD: case OPT_STRICT:
    case OPT_TO_LORA: case OPT_TO_LORA_ENERGY: case OPT_HELP:
        return true;
    default:
        return false;
    }
}

typedef struct run_scan {
    merge_args *a;
    const char *config;
    int n_operands;
} run_scan;

static lm_status run_opt(void *ctx, const lm_opt *d, const char *shown, const char *v, lm_err *err)
{
    run_scan *rs = ctx;
    if (!run_option(d->id))
        return lm_err_set(err, LM_ERR_USAGE, "%s shapes the merge: llmerge run takes it from CONFIG (its parameters: "
                          "docs/mergekit.md), not from the command line", shown);
    return lm_merge_apply_option(rs->a, d, shown, v, err);
}

static lm_status run_operand(void *ctx, const char *arg, lm_err *err)
{
    (void)err;
    run_scan *rs = ctx;
    if (rs->n_operands++ == 0)
        rs->config = arg;
    return LM_OK;
}

static lm_status run_parse(merge_args *a, int argc, char **argv, lm_err *err)
{
    lm_merge_args_defaults(a);
    run_scan rs = {a, NULL, 0};
    lm_status s = lm_cmd_scan(argc, argv, lm_merge_opt_defs, lm_merge_n_opts, run_opt, run_operand, &rs, err);
    if (s != LM_OK || a->help)
        return s;
    if (rs.n_operands != 1)
        return lm_err_set(err, LM_ERR_USAGE, "llmerge run takes one configuration file, not %d", rs.n_operands);
    return lm_cmd_run_config(a, rs.config, err);
}

lm_status lm_cmd_run_parse_file(merge_args *a, int argc, char **argv, lm_err *err)
{
    lm_merge_args_defaults(a);
    run_scan rs = {a, NULL, 0};
    lm_status s = lm_cmd_scan(argc, argv, lm_merge_opt_defs, lm_merge_n_opts, run_opt, run_operand, &rs, err);
    if (s != LM_OK || a->help)
        return s;
    if (rs.n_operands != 0)
        return lm_err_set(err, LM_ERR_USAGE, "llmerge plan CONFIG.yml takes no other operand ('%s')", rs.config);
    return lm_cmd_run_config(a, argv[0], err);
}

static void run_usage(FILE *out, const void *arg)
{
    (void)arg;
    char names[512];
    config_method_names(names, sizeof names);
    fprintf(out,
            "Usage: llmerge run CONFIG.yml -o OUT [options]\n"
            "\n"
            "Merges what a mergekit configuration file says: merge_method, base_model, models (each\n"
            "model: PATH, ORG/NAME from the Hugging Face cache, or PATH+LORA: on another PATH than\n"
            "the base, the adapter is merged into PATH once, in --cache-dir, and reused), slices\n"
            "(passthrough's layer stacks; with another method, one slice whose sources each give\n"
            "every layer, [0, N], merged as those models would be under models:), parameters\n"
            "(numbers, gradients over the layers, {filter, value} lists; a model's own before the\n"
            "global ones), dtype, out_dtype, tokenizer_source (or tokenizer: with a source),\n"
            "chat_template and random_seed, with mergekit's defaults (density 1, normalize and\n"
            "rescale per method). Where tokenizer_source or a model puts tokens at other ids than the\n"
            "output's vocabulary, each model's embedding rows are moved to the output's ids first, as\n"
            "mergekit moves them (docs/merging.md, \"Other vocabularies\"). A key, parameter or value\n"
            "llmerge does not support is an error naming its line (exit status 2), never ignored.\n"
            "docs/mergekit.md says what llmerge does with each key and method, and where the results\n"
            "differ from mergekit's.\n"
            "\n"
            "Methods: %s.\n"
            "\n"
            "Options (also as --name=value): where and how the merge runs; what it computes is the\n"
            "configuration's to say.\n"
            "  -o, --output DIR       the output model directory (required); an existing one is\n"
            "                         refused unless --force is given\n"
            "  --shard-size SIZE      most tensor bytes per output shard (default 5GB)\n"
            "  --device DEV           auto, cpu, cuda[:N], sim:SIZE, cuda-emu[:SIZE] (default auto)\n"
            "  --gpu-mem SIZE         most device memory to use (default: all free)\n"
            "  --threads N            CPU threads (default: the cores it may use)\n"
            "  --cache-dir DIR        where PATH+LORA models are kept once made (default\n"
            "                         $XDG_CACHE_HOME/llmerge)\n"
            "  --log-json FILE        one JSON object per event to FILE\n"
            "  -q, --quiet            nothing on stderr but errors\n"
            "  -v, --verbose          also the resolved settings and each input\n"
            "  --force                replace OUT if it exists (it is replaced only at the end)\n"
            "  --no-card              do not write README.md, the model card\n"
            "  --strict               refuse a full model holding a tensor the base does not have\n"
            "  --to-lora RANK         write OUT as a PEFT LoRA adapter of base_model (each matrix's\n"
            "                         merged change as factors of rank RANK; llmerge METHOD --help);\n"
            "                         not for passthrough\n"
            "  --to-lora exact        (task_arithmetic and linear of LoRA adapters of base_model)\n"
            "                         the inputs' factors concatenated: no SVD, no error\n"
            "  --to-lora-energy F     with --to-lora RANK: per matrix the smallest rank keeping F\n"
            "                         of its change's energy, at most RANK\n"
            "  -h, --help             this help\n"
            "\n"
            "OUT gets what a merge command writes (the weights, config.json, the tokenizer and\n"
            "generation files, README.md, llmerge.json; with --to-lora, adapter_config.json and\n"
            "adapter_model.safetensors instead of the model's files) and the configuration itself\n"
            "as mergekit_config.yml. llmerge plan CONFIG.yml -o OUT says what the merge will need.\n"
            "\n"
            "Exit status: 0 done; 1 the merge failed; 2 bad usage or a bad configuration or input,\n"
            "found before any work; 128 + the signal when stopped by one (nothing is left at OUT).\n",
            names);
}

// ==== passthrough ==============================================================================

// Any option, for finding the operand (and --to-lora, noted).
static lm_status any_opt(void *ctx, const lm_opt *d, const char *shown, const char *v, lm_err *err)
{
    (void)shown, (void)v, (void)err;
    if (d->id == OPT_TO_LORA)  // which a passthrough refuses
        ((run_scan *)ctx)->a->to_lora = 1;
    return LM_OK;
}

// llmerge passthrough's command line from llmerge run's (pt_opt, pt_operand): each option written
// again as --name[=value] but those a stack of copied layers has no use for (where the work runs,
// the cache of PATH+LORA models, -v, --strict: checked, then dropped); the configuration left out
// (pt_operand).
typedef struct pt_line {
    char **args;   // the command line being made
    int n;
    char **owned;  // the options written again, freed by the caller
    int n_owned;
    merge_args checked;  // where the dropped options' values are checked
} pt_line;

static lm_status pt_opt(void *ctx, const lm_opt *d, const char *shown, const char *v, lm_err *err)
{
    pt_line *pl = ctx;
    switch (d->id) {
    case OPT_DEVICE: case OPT_GPU_MEM: case OPT_THREADS: case OPT_CACHE_DIR: case OPT_VERBOSE: case OPT_STRICT:
        return lm_merge_apply_option(&pl->checked, d, shown, v, err);
    default:
        break;
    }
    char *o = v ? lm_strfmt("--%s=%s", d->name, v) : lm_strfmt("--%s", d->name);
    if (!o)
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    pl->owned[pl->n_owned++] = o;
    pl->args[pl->n++] = o;
    return LM_OK;
}

// The one operand, the configuration (run_passthrough handles a command line of one only), is
// not llmerge passthrough's.
static lm_status pt_operand(void *ctx, const char *arg, lm_err *err)
{
    (void)ctx, (void)arg, (void)err;
    return LM_OK;
}

static char *auto_template(const lm_mergecfg *cfg);

// Whether models a and b (as a configuration writes them) put their tokens at the same ids:
// one directory, or tokenizer.json's vocabularies (each stripped to its vocab_size) that agree,
// or neither with a tokenizer.json and their tokenizer.model files alike or both absent.
static lm_status same_ids(const char *a, const char *b, bool *same, lm_err *err)
{
    char *da = NULL, *db = NULL;
    lm_vocab *va = NULL, *vb = NULL;
    lm_input_kind ka, kb;
    *same = false;
    lm_status s = lm_input_detect(a, &ka, &da, err);
    if (s == LM_OK)
        s = lm_input_detect(b, &kb, &db, err);
    if (s == LM_OK && same_model(da, db))
        *same = true;
    else if (s == LM_OK && (s = lm_vocab_load_dir(&va, da, true, NULL, err)) == LM_OK &&
             (s = lm_vocab_load_dir(&vb, db, true, NULL, err)) == LM_OK) {
        if (va && vb)
            *same = lm_vocab_first_difference(va, vb, va->n_ids > vb->n_ids ? va->n_ids : vb->n_ids) < 0;
        else if (!va && !vb)
            *same = same_spm(da, db) || (!has_spm(da) && !has_spm(db));
    }
    lm_vocab_free(va);
    lm_vocab_free(vb);
    free(da);
    free(db);
    return s;
}

// A configuration of merge_method: passthrough runs as llmerge passthrough on its slices (one
// source each, with an optional scalar scale), OUT getting the configuration and its chat
// template too. Returns the exit status; *handled false when argv's configuration is not one
// (it is then llmerge run's).
static int run_passthrough(int argc, char **argv, bool *handled)
{
    *handled = false;
    merge_args a;
    memset(&a, 0, sizeof a);
    run_scan rs = {&a, NULL, 0};
    lm_err err = {0};
    if (lm_cmd_scan(argc, argv, lm_merge_opt_defs, lm_merge_n_opts, any_opt, run_operand, &rs, &err) != LM_OK ||
        rs.n_operands != 1)
        return 0;
    lm_mergecfg *cfg = NULL;
    if (lm_mergecfg_load(&cfg, rs.config, &err) != LM_OK || strcmp(cfg->merge_method, "passthrough") != 0) {
        lm_mergecfg_free(cfg);
        return 0;
    }
    *handled = true;
    lm_status s = LM_OK;
    int n = cfg->n_slices, c = 0, rc = 2, n_opts = 0;
    // the options written again: bundled short flags (-qv) are one each, so at most a character
    // of argv each
    size_t n_chars = 0;
    for (int i = 0; i < argc; i++)
        n_chars += strlen(argv[i]);
    char **args = calloc(n_chars + (size_t)(argc + 2 * n + 4), sizeof *args);
    char **owned = calloc((size_t)n + 1, sizeof *owned), **opts = calloc(n_chars + 1, sizeof *opts);
    if (!args || !owned || !opts) {
        s = lm_err_set(&err, LM_ERR_NOMEM, "out of memory");
        goto done;
    }
    if (cfg->n_models > 0 || n == 0)
        s = lm_err_set(&err, LM_ERR_UNSUPPORTED, "%s:%d:%d: passthrough takes slices (layer ranges of models "
                       "stacked); a passthrough of models: is not supported",
                       AT(cfg, cfg->method_line, cfg->method_col));
    else if (cfg->params.n > 0)
        s = lm_err_set(&err, LM_ERR_USAGE, "%s:%d:%d: passthrough takes no global parameters (a source's scale is "
                       "its own)", AT(cfg, cfg->params.items[0].line, cfg->params.items[0].col));
    // mergekit takes the output's config.json and tokenizer files from base_model, llmerge from
    // the first slice's model: the same only where base_model is that model
    const lm_cfg_model *first = s == LM_OK && n > 0 && cfg->slices[0].n_sources > 0 ? &cfg->slices[0].sources[0] : NULL;
    if (first && cfg->base_model && !same_model(cfg->base_model, first->model))
        s = lm_err_set(&err, LM_ERR_UNSUPPORTED, "%s:%d:%d: base_model '%s': mergekit's passthrough takes the output's "
                       "config.json and tokenizer files from base_model, and llmerge takes them from the first slice's "
                       "model ('%s'); a base_model other than that model is not supported yet (leave base_model out, "
                       "or list its layers first)", AT(cfg, cfg->base_line, cfg->base_col), cfg->base_model,
                       first->model);
    // tokenizer_source: the first slice's model's tokenizer, as base (base_model being that model)
    // or by its name, keeps every row where it is; another's would move the embeddings' rows
    const char *ts = cfg->tokenizer_source;
    if (s == LM_OK && first && ts && strcmp(ts, "base") == 0 && !cfg->base_model)
        s = lm_err_set(&err, LM_ERR_USAGE, "%s:%d: %s: base needs base_model", cfg->path, cfg->tokenizer_line,
                       cfg->tokenizer_key);
    else if (s == LM_OK && first && ts && strcmp(ts, "base") != 0 && !same_model(ts, first->model))
        s = lm_err_set(&err, LM_ERR_UNSUPPORTED, "%s:%d: %s '%s': with passthrough, the tokenizer is the first "
                       "slice's model's ('%s'); another model's, whose vocabulary would move the embeddings' rows, is "
                       "not supported yet", cfg->path, cfg->tokenizer_line, cfg->tokenizer_key, ts, first->model);
    // ... and lm_head comes from the last slice's model, whose rows mergekit moves to that
    // tokenizer's ids: they must be there already
    const lm_cfg_model *last = first && n > 0 && cfg->slices[n - 1].n_sources > 0 ? &cfg->slices[n - 1].sources[0]
                                                                                 : NULL;
    bool same = true;
    if (s == LM_OK && ts && last && !same_model(last->model, first->model) && !strchr(first->model, '+') &&
        !strchr(last->model, '+') && (s = same_ids(first->model, last->model, &same, &err)) == LM_OK && !same)
        s = lm_err_set(&err, LM_ERR_UNSUPPORTED, "%s:%d:%d: model '%s': the last slice's model gives the output layer "
                       "(lm_head), and its tokens are not at the ids of the first slice's model's tokenizer "
                       "(%s); moving its rows there is not supported yet with passthrough",
                       AT(cfg, last->line, last->col), last->model, cfg->tokenizer_key);
    // chat_template: as for a merge, auto over base_model and the slices' models
    const char *tmpl = NULL;
    char *picked = NULL;
    if (s == LM_OK && (s = config_template(cfg, &tmpl, &err)) == LM_OK && tmpl && strcmp(tmpl, "auto") == 0)
        tmpl = picked = auto_template(cfg);  // none among them: nothing set, as mergekit
    if (s == LM_OK && (a.to_lora || a.to_lora_exact))
        s = lm_err_set(&err, LM_ERR_USAGE, "--to-lora: a passthrough stacks layers into a new model, which has no "
                       "base to be an adapter of");
    args[c++] = "passthrough";
    pt_line pl = {.args = args, .n = c, .owned = opts};
    if (s == LM_OK)
        s = lm_cmd_scan(argc, argv, lm_merge_opt_defs, lm_merge_n_opts, pt_opt, pt_operand, &pl, &err);
    c = pl.n;
    n_opts = pl.n_owned;
    for (int i = 0; s == LM_OK && i < n; i++) {
        const lm_cfg_slice *sl = &cfg->slices[i];
        if (sl->n_sources != 1) {
            s = lm_err_set(&err, LM_ERR_UNSUPPORTED, "%s:%d:%d: slices[%d] has %d sources: passthrough stacks one "
                           "source per slice", AT(cfg, sl->line, sl->col), i, sl->n_sources);
            break;
        }
        const lm_cfg_model *src = &sl->sources[0];
        char scale[48] = "";
        for (int q = 0; s == LM_OK && q < src->params.n; q++) {
            const lm_param *p = &src->params.items[q];
            if (strcmp(p->name, "scale") != 0)
                s = lm_err_set(&err, LM_ERR_USAGE, "%s:%d:%d: '%s' is not a parameter of passthrough (its parameter: "
                               "scale)", AT(cfg, p->line, p->col), p->name);
            else if (p->value->kind != LM_PVAL_NUMBER)
                s = lm_err_set(&err, LM_ERR_UNSUPPORTED, "%s:%d:%d: scale: one number per source (gradients and "
                               "filters for passthrough's scale are not supported yet)",
                               AT(cfg, p->value->line, p->value->col));
            else
                snprintf(scale, sizeof scale, ":%.17g", p->value->num);
        }
        if (s == LM_OK && strchr(src->model, '+'))
            s = lm_err_set(&err, LM_ERR_UNSUPPORTED, "%s:%d:%d: model '%s': a LoRA adapter in a slice is not "
                           "supported", AT(cfg, src->line, src->col), src->model);
        if (s != LM_OK)
            break;
        owned[i] = lm_strfmt("%s:%" PRId64 ":%" PRId64 "%s", src->model, src->layer_range[0], src->layer_range[1],
                             scale);
        if (!owned[i]) {
            s = lm_err_set(&err, LM_ERR_NOMEM, "out of memory");
            break;
        }
        args[c++] = "--slice";
        args[c++] = owned[i];
    }
    if (s == LM_OK && (cfg->out_dtype || cfg->dtype)) {
        merge_args d;
        memset(&d, 0, sizeof d);
        if ((s = config_dtype(cfg, &d, &err)) == LM_OK) {
            args[c++] = "--dtype";
            args[c++] = (char *)lm_cmd_dtype_flag(d.dtype);
        }
    }
    if (s == LM_OK)
        rc = lm_cmd_passthrough_config(c, args, cfg->text, tmpl, "llmerge run");
    free(picked);
done:
    if (s != LM_OK)
        fprintf(stderr, "llmerge run: error: %s\n", err.msg);
    for (int i = 0; owned && i < n; i++)
        free(owned[i]);
    for (int i = 0; i < n_opts; i++)
        free(opts[i]);
    free(opts);
    free(owned);
    free(args);
    lm_mergecfg_free(cfg);
    return s != LM_OK ? lm_status_exit_code(s) : rc;
}

int lm_cmd_run(int argc, char **argv)
{
    bool handled;
    int rc = run_passthrough(argc, argv, &handled);
    if (handled)
        return rc;
    return lm_cmd_merge_with("llmerge run", run_usage, run_parse, "CONFIG", argc, argv);
}

// ==== what OUT gets besides a merge's files ===================================================

// The chat template a model's tokenizer has, as transformers loads it for mergekit: the file
// chat_template.jinja where the directory has one (it wins over tokenizer_config.json), else
// tokenizer_config.json's "chat_template": a string, or of the named templates (a list of
// {name, template}, or a mapping of names) the one named "default". Stripped of the whitespace
// around it, as mergekit strips it before comparing; NULL when there is none or nothing is left.
// A new string the caller frees.
static char *model_template(const char *dir)
{
    char *jinja = lm_path_join(dir, "chat_template.jinja"), *cfg = lm_path_join(dir, "tokenizer_config.json");
    char *text = NULL, *res = NULL;
    size_t len = 0;
    lm_err e = {0};
    if (jinja && lm_is_file(jinja)) {
        if (lm_read_file(jinja, 64u << 20, &text, &len, &e) == LM_OK)
            res = lm_strdup(text);
    } else if (cfg && lm_read_file(cfg, 64u << 20, &text, &len, &e) == LM_OK) {
        cJSON *j = cJSON_Parse(text);
        const cJSON *ct = cJSON_GetObjectItemCaseSensitive(j, "chat_template"), *it;
        if (cJSON_IsObject(ct))
            ct = cJSON_GetObjectItemCaseSensitive(ct, "default");
        else if (cJSON_IsArray(ct)) {
            const cJSON *found = NULL;
            cJSON_ArrayForEach(it, ct) {
                const cJSON *name = cJSON_GetObjectItemCaseSensitive(it, "name");
                if (!found && cJSON_IsString(name) && strcmp(name->valuestring, "default") == 0)
                    found = cJSON_GetObjectItemCaseSensitive(it, "template");
            }
            ct = found;
        }
        if (cJSON_IsString(ct))
            res = lm_strdup(ct->valuestring);
        cJSON_Delete(j);
    }
    free(text);
    free(jinja);
    free(cfg);
    if (!res)
        return NULL;
    size_t a = 0, b = strlen(res);
    while (a < b && strchr(" \t\n\r\v\f", res[a]))
        a++;
    while (b > a && strchr(" \t\n\r\v\f", res[b - 1]))
        b--;
    memmove(res, res + a, b - a);
    res[b - a] = '\0';
    if (!res[0]) {
        free(res);
        return NULL;
    }
    return res;
}

// The chat template `auto` picks, as mergekit does: the one most of the models refs[0..n) have
// (each model once, NULL entries skipped; a tie goes to the first met, where mergekit's order is
// a set's), each read from the model's directory (PATH of PATH+LORA), or NULL when none has one.
// A new string the caller frees.
static char *pick_template(const char *const *refs, int n)
{
    int best = -1, best_count = 0;
    char **t = calloc((size_t)(n > 0 ? n : 1), sizeof *t);
    if (!t)
        return NULL;
    for (int i = 0; i < n; i++) {
        const char *ref = refs[i];
        bool seen = !ref;
        for (int j = 0; !seen && j < i; j++)
            seen = refs[j] && same_entry(refs[j], ref);
        if (seen)
            continue;
        const char *plus = strchr(ref, '+');
        char *path = plus && plus[1] ? strndup(ref, (size_t)(plus - ref)) : lm_strdup(ref), *dir = NULL;
        lm_input_kind kind;
        lm_err e = {0};
        if (path && lm_input_detect(path, &kind, &dir, &e) == LM_OK && kind == LM_INPUT_MODEL)
            t[i] = model_template(dir);
        free(dir);
        free(path);
    }
    for (int i = 0; i < n; i++) {
        int count = 0;
        for (int j = 0; t[i] && j < n; j++)
            count += t[j] && strcmp(t[i], t[j]) == 0;
        if (count > best_count) {
            best_count = count;
            best = i;
        }
    }
    char *res = best >= 0 ? t[best] : NULL;
    for (int i = 0; i < n; i++)
        if (i != best)
            free(t[i]);
    free(t);
    return res;
}

// pick_template over the configuration's base_model, then its models in order (a passthrough's:
// each slice's first source).
static char *auto_template(const lm_mergecfg *cfg)
{
    int n = cfg->n_models > 0 ? cfg->n_models : cfg->n_slices;
    const char **refs = calloc((size_t)n + 1, sizeof *refs);
    if (!refs)
        return NULL;
    refs[0] = cfg->base_model;
    for (int i = 0; i < n; i++)
        refs[1 + i] = cfg->n_models > 0               ? cfg->models[i].model
                      : cfg->slices[i].n_sources > 0 ? cfg->slices[i].sources[0].model
                                                      : NULL;
    char *t = pick_template(refs, n + 1);
    free(refs);
    return t;
}

static lm_status set_template(const char *dir, const char *tmpl, lm_err *err)
{
    char *jinja = lm_path_join(dir, "chat_template.jinja"), *cfg = lm_path_join(dir, "tokenizer_config.json");
    lm_status s = LM_OK;
    if (!jinja || !cfg) {
        s = lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    } else if (lm_is_file(jinja) || !lm_is_file(cfg)) {
        s = lm_write_file(jinja, tmpl, strlen(tmpl), err);
    } else {
        char *text = NULL;
        size_t len = 0;
        if ((s = lm_read_file(cfg, 64u << 20, &text, &len, err)) == LM_OK) {
            cJSON *j = cJSON_Parse(text), *t = NULL;
            char *out = NULL;
            if (!cJSON_IsObject(j))
                s = lm_err_set(err, LM_ERR_FORMAT, "%s: not a JSON object", cfg);
            else if (cJSON_GetObjectItemCaseSensitive(j, "chat_template")
                         ? !(t = cJSON_CreateString(tmpl)) ||
                               !cJSON_ReplaceItemInObjectCaseSensitive(j, "chat_template", t)
                         : !cJSON_AddStringToObject(j, "chat_template", tmpl)) {
                cJSON_Delete(t);  // (not in j: the replacement failed)
                s = lm_err_set(err, LM_ERR_NOMEM, "out of memory");
            } else if (!(out = cJSON_Print(j))) {
                s = lm_err_set(err, LM_ERR_NOMEM, "out of memory");
            } else {
                s = lm_write_file(cfg, out, strlen(out), err);
            }
            free(out);
            cJSON_Delete(j);
        }
        free(text);
    }
    free(jinja);
    free(cfg);
    return s;
}

lm_status lm_cmd_run_outputs(const merge_args *a, const char *out_dir, lm_err *err)
{
    if (!a->config_text)
        return LM_OK;
    lm_status s = LM_OK;
    if (a->tokenizer_dir) {
        // the tokenizer's files from tokenizer_source (generation_config.json stays the base's)
        for (int i = 0; s == LM_OK && lm_manifest_side_files[i]; i++) {
            if (strcmp(lm_manifest_side_files[i], "generation_config.json") == 0)
                continue;
            char *src = lm_path_join(a->tokenizer_dir, lm_manifest_side_files[i]);
            char *dst = lm_path_join(out_dir, lm_manifest_side_files[i]);
            if (!src || !dst)
                s = lm_err_set(err, LM_ERR_NOMEM, "out of memory");
            else if (lm_is_file(src))
                s = lm_copy_file(src, dst, err);
            free(src);
            free(dst);
        }
    }
    if (s != LM_OK)
        return s;
    // auto with no template among the models: nothing to set, as mergekit
    char *tmpl = !a->chat_template                      ? NULL
                 : strcmp(a->chat_template, "auto") == 0 ? auto_template(((const run_preset *)a->preset)->cfg)
                                                         : lm_strdup(a->chat_template);
    s = lm_cmd_config_files(out_dir, a->config_text, tmpl, err);
    free(tmpl);
    return s;
}

lm_status lm_cmd_config_files(const char *dir, const char *config_text, const char *tmpl, lm_err *err)
{
    lm_status s = tmpl ? set_template(dir, tmpl, err) : LM_OK;
    if (s != LM_OK || !config_text)
        return s;
    char *path = lm_path_join(dir, "mergekit_config.yml");
    s = path ? lm_write_file(path, config_text, strlen(config_text), err)
             : lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    free(path);
    return s;
}
