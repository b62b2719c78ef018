// Passthrough merges with slices (passthrough.h): the plan (models opened and checked, the
// output's tensor list and config.json) and the writing of its tensors.
#include "passthrough.h"

#include <cJSON.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
#include <xxhash.h>

#include "json.h"
#include "signals.h"
#include "util.h"

#define LAYER_PREFIX "model.layers."
#define COPY_PIECE ((uint64_t)4 << 20)          // bytes of a copied tensor put at once
#define DEFAULT_SLAB ((int64_t)4 << 20)         // elements of a converted tensor at once

// The top-level config.json keys that hold one entry per layer (transformers' names), rebuilt
// for the output layer by layer. Arrays that list layer indices (Qwen2-MoE's mlp_only_layers)
// and numbers that count layers (Qwen2's max_window_layers) are kept as the first model has
// them (docs/merging.md "Passthrough: layer stacking").
static const char *const per_layer_keys[] = {"layer_types", "no_rope_layers", "block_configs", "layers_block_type"};

// A model of the plan and its layers.
typedef struct pt_model {
    lm_model *m;
    cJSON *config;         // its config.json, parsed by the one reader
    int64_t n_layers;      // config.json's num_hidden_layers
    int64_t *layer_start;  // (n_layers + 1) where each layer's tensors start in `by_layer`
    int64_t *by_layer;     // indices into m->tensors, grouped by layer, in the model's order
} pt_model;

struct lm_pt_plan {
    lm_pt_source *src;     // (n_src) the slices, model paths copied
    int n_src;
    pt_model *models;      // (n_models) distinct, in the order the slices first name them
    int n_models;
    int *model_of;         // (n_src) the model of each slice
    int64_t *out_start;    // (n_src) the output layer each slice starts at
    lm_pt_tensor *tensors; // (n_tensors) in output order
    int64_t n_tensors;
    int64_t n_layers;
    char *config;          // the output's config.json
};

// ==== names ===================================================================================

// When `name` is a tensor of a layer ("model.layers.<i>.<rest>"), sets *layer and *rest and
// returns true. The index is decimal without leading zeros, as transformers writes it.
static bool layer_of(const char *name, int64_t *layer, const char **rest)
{
    if (strncmp(name, LAYER_PREFIX, strlen(LAYER_PREFIX)) != 0)
        return false;
    const char *p = name + strlen(LAYER_PREFIX);
    if (*p < '0' || *p > '9' || (p[0] == '0' && p[1] >= '0' && p[1] <= '9'))
        return false;
    int64_t v = 0;
    for (; *p >= '0' && *p <= '9'; p++) {
        if (v > (INT64_MAX - 9) / 10)
            return false;
        v = v * 10 + (*p - '0');
    }
    if (*p != '.' || !p[1])
        return false;
    *layer = v;
    *rest = p + 1;
    return true;
}

// A tensor outside the layers that comes before them: the token (and position) embeddings.
static bool before_layers(const char *name)
{
    return strstr(name, "embed") != NULL;
}

static bool same_shape(const lm_st_tensor *a, const lm_st_tensor *b)
{
    return a->ndim == b->ndim && memcmp(a->shape, b->shape, (size_t)a->ndim * sizeof a->shape[0]) == 0;
}

static const char *str_or(const char *s, const char *none) { return s ? s : none; }

static bool str_eq(const char *a, const char *b) { return (!a && !b) || (a && b && strcmp(a, b) == 0); }

// ==== the models ==============================================================================

static void model_free(pt_model *pm)
{
    lm_model_free(pm->m);
    cJSON_Delete(pm->config);
    free(pm->layer_start);
    free(pm->by_layer);
}

// Opens the model at `path` and groups its layers' tensors by layer. Every layer index must be
// below config.json's num_hidden_layers, and every layer must have tensors.
static lm_status model_open(pt_model *pm, const char *path, lm_err *err)
{
    lm_status s = lm_model_open(&pm->m, path, err);
    if (s != LM_OK)
        return s;
    const lm_model *m = pm->m;
    if ((s = lm_json_load(&pm->config, m->config.path, 64u << 20, err)) != LM_OK)
        return s;
    const cJSON *nl = cJSON_GetObjectItemCaseSensitive(pm->config, "num_hidden_layers");
    if (!cJSON_IsNumber(nl) || nl->valuedouble < 1 || nl->valuedouble > 1e6 || nl->valuedouble != (int64_t)nl->valuedouble)
        return lm_err_set(err, LM_ERR_FORMAT, "%s: num_hidden_layers is %s, not a layer count: a passthrough merge "
                          "stacks the layers config.json counts", m->config.path,
                          nl ? str_or(lm_json_number_text(nl), lm_json_kind(nl)) : "missing");
    pm->n_layers = (int64_t)nl->valuedouble;
    pm->layer_start = calloc((size_t)pm->n_layers + 1, sizeof *pm->layer_start);
    pm->by_layer = malloc((size_t)(m->n_tensors ? m->n_tensors : 1) * sizeof *pm->by_layer);
    if (!pm->layer_start || !pm->by_layer)
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    // counts, then positions: a counting sort keeps the model's order within each layer
    for (int64_t i = 0; i < m->n_tensors; i++) {
        int64_t l;
        const char *rest;
        if (!layer_of(m->tensors[i]->name, &l, &rest))
            continue;
        if (l >= pm->n_layers)
            return lm_err_set(err, LM_ERR_FORMAT, "%s: tensor '%s' is of layer %" PRId64 ", but config.json says "
                              "the model has %" PRId64 " layers (num_hidden_layers)", m->dir, m->tensors[i]->name, l,
                              pm->n_layers);
        pm->layer_start[l + 1]++;
    }
    for (int64_t l = 0; l < pm->n_layers; l++) {
        if (pm->layer_start[l + 1] == 0)
            return lm_err_set(err, LM_ERR_FORMAT, "%s: layer %" PRId64 " has no tensors (no '" LAYER_PREFIX
                              "%" PRId64 ".*'), but config.json says the model has %" PRId64 " layers", m->dir, l, l,
                              pm->n_layers);
        pm->layer_start[l + 1] += pm->layer_start[l];
    }
    int64_t *fill = calloc((size_t)pm->n_layers, sizeof *fill);
    if (!fill)
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    for (int64_t i = 0; i < m->n_tensors; i++) {
        int64_t l;
        const char *rest;
        if (layer_of(m->tensors[i]->name, &l, &rest))
            pm->by_layer[pm->layer_start[l] + fill[l]++] = i;
    }
    free(fill);
    return LM_OK;
}

// The models stack only when they are of one architecture: architectures[0], model_type and
// tie_word_embeddings as the first model has them.
static lm_status check_arch(const lm_pt_plan_t *p, int slice, lm_err *err)
{
    const lm_config *a = &p->models[0].m->config, *b = &p->models[p->model_of[slice]].m->config;
    const char *what = NULL, *va = NULL, *vb = NULL;
    if (!str_eq(a->architecture, b->architecture))
        what = "architectures[0]", va = str_or(a->architecture, "none"), vb = str_or(b->architecture, "none");
    else if (!str_eq(a->model_type, b->model_type))
        what = "model_type", va = str_or(a->model_type, "none"), vb = str_or(b->model_type, "none");
    else if (a->tie_word_embeddings != b->tie_word_embeddings)
        what = "tie_word_embeddings", va = a->tie_word_embeddings ? "true" : "false",
        vb = b->tie_word_embeddings ? "true" : "false";
    if (!what)
        return LM_OK;
    return lm_err_set(err, LM_ERR_MISMATCH, "slice %d: %s is not of the first slice's architecture: its config.json "
                      "has %s %s, %s's has %s; the layers of models of one architecture stack", slice + 1,
                      p->models[p->model_of[slice]].m->dir, what, vb, p->models[0].m->dir, va);
}

// ==== the plan ================================================================================

void lm_pt_plan_free(lm_pt_plan_t *p)
{
    if (!p)
        return;
    for (int i = 0; i < p->n_src; i++)
        free((char *)p->src[i].model);
    free(p->src);
    for (int i = 0; i < p->n_models; i++)
        model_free(&p->models[i]);
    free(p->models);
    free(p->model_of);
    free(p->out_start);
    for (int64_t i = 0; p->tensors && i < p->n_tensors; i++)
        free((char *)p->tensors[i].name);
    free(p->tensors);
    free(p->config);
    free(p);
}

// Appends an output tensor (its name copied) to p->tensors, which has room.
static lm_status add_tensor(lm_pt_plan_t *p, const char *name, int slice, const lm_st_tensor *in, int64_t layer_in,
                            int64_t layer_out, lm_err *err)
{
    char *copy = lm_strdup(name);
    if (!copy)
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    p->tensors[p->n_tensors++] = (lm_pt_tensor){copy, slice, in, layer_in, layer_out};
    return LM_OK;
}

// The output's layers: every slice's layers in order, each tensor renamed to its output layer,
// a layer tensor's kind (the name after its index) of one shape wherever it appears.
static lm_status plan_layers(lm_pt_plan_t *p, lm_err *err)
{
    lm_strmap kinds = {0};
    lm_status s = lm_strmap_init(&kinds, 64);
    if (s != LM_OK)
        return lm_err_set(err, s, "out of memory");
    // the first tensor of each kind (kinds maps the kind to its index here) and its model
    const lm_st_tensor **first = NULL;
    int *first_model = NULL;
    size_t n_first = 0, cap = 0;
    char name[512];
    for (int k = 0; k < p->n_src && s == LM_OK; k++) {
        const pt_model *pm = &p->models[p->model_of[k]];
        for (int64_t l = p->src[k].from; l < p->src[k].to && s == LM_OK; l++) {
            int64_t out_l = p->out_start[k] + (l - p->src[k].from);
            for (int64_t j = pm->layer_start[l]; j < pm->layer_start[l + 1] && s == LM_OK; j++) {
                const lm_st_tensor *t = pm->m->tensors[pm->by_layer[j]];
                int64_t li;
                const char *rest;
                layer_of(t->name, &li, &rest);
                int64_t at = lm_strmap_get(&kinds, rest);
                if (at < 0) {
                    if (n_first == cap) {
                        cap = cap ? cap * 2 : 64;
                        const lm_st_tensor **f = realloc(first, cap * sizeof *first);
                        int *fm = f ? realloc(first_model, cap * sizeof *first_model) : NULL;
                        if (f)
                            first = f;
                        if (fm)
                            first_model = fm;
                        if (!f || !fm) {
                            s = lm_err_set(err, LM_ERR_NOMEM, "out of memory");
                            break;
                        }
                    }
                    if (lm_strmap_put(&kinds, rest, (int64_t)n_first) < 0) {
                        s = lm_err_set(err, LM_ERR_NOMEM, "out of memory");
                        break;
                    }
                    first[n_first] = t;
                    first_model[n_first++] = p->model_of[k];
                } else if (!same_shape(first[at], t)) {
                    char sa[96], sb[96];
                    s = lm_err_set(err, LM_ERR_MISMATCH, "slice %d: %s: tensor '%s' is %s, but '%s' of %s is %s: "
                                   "the layers do not stack", k + 1, pm->m->dir, t->name,
                                   lm_st_shape_str(t->shape, t->ndim, sa, sizeof sa), first[at]->name,
                                   p->models[first_model[at]].m->dir,
                                   lm_st_shape_str(first[at]->shape, first[at]->ndim, sb, sizeof sb));
                    break;
                }
                if (snprintf(name, sizeof name, LAYER_PREFIX "%" PRId64 ".%s", out_l, rest) >= (int)sizeof name) {
                    s = lm_err_set(err, LM_ERR_FORMAT, "%s: tensor name '%s' is too long", pm->m->dir, t->name);
                    break;
                }
                s = add_tensor(p, name, k, t, l, out_l, err);
            }
        }
    }
    free(first);
    free(first_model);
    lm_strmap_free(&kinds);
    return s;
}

// The tensors outside the layers of slice k's model that come before the layers (before) or
// after them, each of the shape the first model gives a tensor of that name.
static lm_status plan_outside(lm_pt_plan_t *p, int k, bool before, lm_err *err)
{
    const lm_model *m = p->models[p->model_of[k]].m, *m0 = p->models[0].m;
    for (int64_t i = 0; i < m->n_tensors; i++) {
        const lm_st_tensor *t = m->tensors[i];
        int64_t l;
        const char *rest;
        if (layer_of(t->name, &l, &rest) || before_layers(t->name) != before)
            continue;
        const lm_st_tensor *t0 = lm_model_find(m0, t->name);
        if (t0 && !same_shape(t, t0)) {
            char sa[96], sb[96];
            return lm_err_set(err, LM_ERR_MISMATCH, "slice %d: %s: tensor '%s' is %s, but %s in %s: the models do "
                              "not stack", k + 1, m->dir, t->name, lm_st_shape_str(t->shape, t->ndim, sa, sizeof sa),
                              lm_st_shape_str(t0->shape, t0->ndim, sb, sizeof sb), m0->dir);
        }
        lm_status s = add_tensor(p, t->name, k, t, -1, -1, err);
        if (s != LM_OK)
            return s;
    }
    return LM_OK;
}

// A slice with a scale computes with each of its tensors: none may be in a dtype llmerge cannot
// compute with.
static lm_status check_scaled(const lm_pt_plan_t *p, lm_err *err)
{
    for (int64_t i = 0; i < p->n_tensors; i++) {
        const lm_pt_tensor *t = &p->tensors[i];
        if (p->src[t->slice].has_scale && !lm_dtype_readable(t->in->dtype))
            return lm_err_set(err, LM_ERR_UNSUPPORTED, "slice %d: %s: tensor '%s' is %s, which llmerge cannot "
                              "multiply by the slice's scale (it computes with F32, F16, BF16 and F64)", t->slice + 1,
                              p->models[p->model_of[t->slice]].m->dir, t->in->name, lm_dtype_name(t->in->dtype));
    }
    return LM_OK;
}

// ==== config.json =============================================================================

// Appends v as JSON in the layout of Python's json.dumps(indent=2), which transformers writes
// config.json in: numbers as the file wrote them (lm_json_number_text).
static void put_json(lm_buf *b, const cJSON *v, int depth)
{
    if (cJSON_IsObject(v) || cJSON_IsArray(v)) {
        bool obj = cJSON_IsObject(v);
        if (!v->child) {
            lm_buf_str(b, obj ? "{}" : "[]");
            return;
        }
        lm_buf_str(b, obj ? "{\n" : "[\n");
        for (const cJSON *c = v->child; c; c = c->next) {
            for (int i = 0; i <= depth; i++)
                lm_buf_str(b, "  ");
            if (obj) {
                cJSON *key = cJSON_CreateString(c->string);
                char *k = key ? cJSON_PrintUnformatted(key) : NULL;
                if (!k)
                    b->oom = true;
                else
                    lm_buf_str(b, k);
                free(k);
                cJSON_Delete(key);
                lm_buf_str(b, ": ");
            }
            put_json(b, c, depth + 1);
            lm_buf_str(b, c->next ? ",\n" : "\n");
        }
        for (int i = 0; i < depth; i++)
            lm_buf_str(b, "  ");
        lm_buf_str(b, obj ? "}" : "]");
        return;
    }
    const char *num = lm_json_number_text(v);
    if (num) {
        lm_buf_str(b, num);
        return;
    }
    char *s = cJSON_PrintUnformatted(v);
    if (!s)
        b->oom = true;
    else
        lm_buf_str(b, s);
    free(s);
}

// The output's config.json: the first model's, num_hidden_layers the total, each per-layer array
// taken from the slices' models layer by layer.
static lm_status plan_config(lm_pt_plan_t *p, lm_err *err)
{
    cJSON *c = cJSON_Duplicate(p->models[0].config, true), *n = cJSON_CreateNumber((double)p->n_layers);
    if (!c || !n || !cJSON_ReplaceItemInObjectCaseSensitive(c, "num_hidden_layers", n)) {
        cJSON_Delete(c);
        cJSON_Delete(n);
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    }
    lm_status s = LM_OK;
    for (size_t k = 0; k < sizeof per_layer_keys / sizeof per_layer_keys[0] && s == LM_OK; k++) {
        const char *key = per_layer_keys[k];
        if (!cJSON_GetObjectItemCaseSensitive(c, key))
            continue;
        cJSON *stacked = cJSON_CreateArray();
        if (!stacked) {
            s = lm_err_set(err, LM_ERR_NOMEM, "out of memory");
            break;
        }
        for (int i = 0; i < p->n_src && s == LM_OK; i++) {
            const pt_model *pm = &p->models[p->model_of[i]];
            const cJSON *a = cJSON_GetObjectItemCaseSensitive(pm->config, key);
            if (!cJSON_IsArray(a) || cJSON_GetArraySize(a) != pm->n_layers) {
                s = lm_err_set(err, LM_ERR_FORMAT, "slice %d: %s: key '%s' is %s, not an array of one entry per layer "
                               "(%" PRId64 "): the output's cannot be built from it", i + 1, pm->m->config.path, key,
                               a ? (cJSON_IsArray(a) ? "an array of another length" : lm_json_kind(a)) : "missing",
                               pm->n_layers);
                break;
            }
            for (int64_t l = p->src[i].from; l < p->src[i].to; l++) {
                cJSON *e = cJSON_Duplicate(cJSON_GetArrayItem(a, (int)l), true);
                if (!e || !cJSON_AddItemToArray(stacked, e)) {
                    cJSON_Delete(e);
                    s = lm_err_set(err, LM_ERR_NOMEM, "out of memory");
                    break;
                }
            }
        }
        if (s != LM_OK || !cJSON_ReplaceItemInObjectCaseSensitive(c, key, stacked)) {
            cJSON_Delete(stacked);
            if (s == LM_OK)
                s = lm_err_set(err, LM_ERR_NOMEM, "out of memory");
        }
    }
    if (s == LM_OK) {
        lm_buf b = {0};
        put_json(&b, c, 0);
        lm_buf_str(&b, "\n");
        if (b.oom) {
            free(b.p);
            s = lm_err_set(err, LM_ERR_NOMEM, "out of memory");
        } else {
            p->config = b.p;
        }
    }
    cJSON_Delete(c);
    return s;
}

lm_status lm_pt_plan(lm_pt_plan_t **out, const lm_pt_source *src, int n, lm_err *err)
{
    *out = NULL;
    if (n < 1)
        return lm_err_set(err, LM_ERR_USAGE, "a passthrough merge needs at least one slice");
    lm_pt_plan_t *p = calloc(1, sizeof *p);
    if (!p || !(p->src = calloc((size_t)n, sizeof *p->src)) || !(p->models = calloc((size_t)n, sizeof *p->models)) ||
        !(p->model_of = calloc((size_t)n, sizeof *p->model_of)) ||
        !(p->out_start = calloc((size_t)n, sizeof *p->out_start))) {
        lm_pt_plan_free(p);
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    }
    lm_status s = LM_OK;
    for (int i = 0; i < n && s == LM_OK; i++) {
        p->src[i] = src[i];
        p->src[i].model = NULL;
        if (!src[i].model || !*src[i].model) {
            s = lm_err_set(err, LM_ERR_USAGE, "slice %d names no model", i + 1);
            break;
        }
        if (!(p->src[i].model = lm_strdup(src[i].model))) {
            s = lm_err_set(err, LM_ERR_NOMEM, "out of memory");
            break;
        }
        p->n_src = i + 1;
        // a model named by an earlier slice is opened once
        int m = -1;
        for (int j = 0; j < i && m < 0; j++)
            if (strcmp(p->src[j].model, src[i].model) == 0)
                m = p->model_of[j];
        if (m < 0) {
            m = p->n_models++;
            if ((s = model_open(&p->models[m], src[i].model, err)) != LM_OK) {
                lm_err_prefix(err, "slice %d", i + 1);
                break;
            }
        }
        p->model_of[i] = m;
        const pt_model *pm = &p->models[m];
        if (src[i].from < 0 || src[i].to > pm->n_layers || src[i].from >= src[i].to) {
            s = lm_err_set(err, LM_ERR_USAGE, "slice %d: layer range [%" PRId64 ", %" PRId64 ") of %s: %s (the model "
                           "has layers 0 to %" PRId64 "; a range [FROM, TO) takes FROM to TO - 1)", i + 1, src[i].from,
                           src[i].to, src[i].model, src[i].from >= src[i].to && src[i].from >= 0 &&
                           src[i].to <= pm->n_layers ? "holds no layer" : "is outside the model's layers",
                           pm->n_layers - 1);
            break;
        }
        if ((s = check_arch(p, i, err)) != LM_OK)
            break;
        p->out_start[i] = p->n_layers;
        p->n_layers += src[i].to - src[i].from;
    }
    // room for every tensor: the first model's and the last's outside the layers, and the layers
    int64_t cap = p->models[0].m ? p->models[0].m->n_tensors : 0;
    for (int i = 0; s == LM_OK && i < n; i++) {
        const pt_model *pm = &p->models[p->model_of[i]];
        cap += pm->layer_start[src[i].to] - pm->layer_start[src[i].from];
        if (i == n - 1)
            cap += pm->m->n_tensors;
    }
    if (s == LM_OK && !(p->tensors = calloc((size_t)(cap ? cap : 1), sizeof *p->tensors)))
        s = lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    if (s == LM_OK)
        s = plan_outside(p, 0, true, err);
    if (s == LM_OK)
        s = plan_layers(p, err);
    if (s == LM_OK)
        s = plan_outside(p, n - 1, false, err);
    if (s == LM_OK)
        s = check_scaled(p, err);
    if (s == LM_OK)
        s = plan_config(p, err);
    if (s != LM_OK) {
        lm_pt_plan_free(p);
        return s;
    }
    *out = p;
    return LM_OK;
}

const lm_pt_tensor *lm_pt_tensors(const lm_pt_plan_t *p, int64_t *n)
{
    *n = p->n_tensors;
    return p->tensors;
}

int64_t lm_pt_n_layers(const lm_pt_plan_t *p) { return p->n_layers; }

const char *lm_pt_config(const lm_pt_plan_t *p) { return p->config; }

int lm_pt_n_models(const lm_pt_plan_t *p) { return p->n_models; }

const lm_model *lm_pt_model(const lm_pt_plan_t *p, int i) { return p->models[i].m; }

int lm_pt_slice_model(const lm_pt_plan_t *p, int slice) { return p->model_of[slice]; }

const lm_pt_source *lm_pt_slices(const lm_pt_plan_t *p, int *n)
{
    *n = p->n_src;
    return p->src;
}

lm_status lm_pt_outputs(const lm_pt_plan_t *p, lm_dtype out_dt, lm_st_desc **out, int64_t *n, lm_err *err)
{
    lm_st_desc *d = calloc((size_t)(p->n_tensors ? p->n_tensors : 1), sizeof *d);
    if (!d)
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    for (int64_t i = 0; i < p->n_tensors; i++) {
        const lm_st_tensor *t = p->tensors[i].in;
        d[i].name = p->tensors[i].name;
        d[i].dtype = lm_dtype_readable(t->dtype) ? out_dt : t->dtype;
        d[i].ndim = t->ndim;
        memcpy(d[i].shape, t->shape, sizeof d[i].shape);
    }
    *out = d;
    *n = p->n_tensors;
    return LM_OK;
}

// ==== writing =================================================================================

// Lets the pages around [data, data + nbytes) of a mapped input go from this process's memory.
static void release_pages(const void *data, uint64_t nbytes)
{
    static long page;
    if (!page)
        page = sysconf(_SC_PAGESIZE) > 0 ? sysconf(_SC_PAGESIZE) : 4096;
    if (!nbytes)
        return;
    uintptr_t lo = (uintptr_t)data & ~(uintptr_t)(page - 1);
    uintptr_t hi = ((uintptr_t)data + nbytes + (uintptr_t)page - 1) & ~(uintptr_t)(page - 1);
    madvise((void *)lo, hi - lo, MADV_DONTNEED);
}

void lm_pt_result_free(lm_pt_result *res)
{
    if (res) {
        free(res->xxh64);
        memset(res, 0, sizeof *res);
    }
}

// Tensor i's bytes as they are, a piece at a time.
static lm_status copy_tensor(lm_st_writer *w, int64_t i, const lm_st_tensor *t, XXH64_state_t *h, lm_err *err)
{
    for (uint64_t off = 0; off < t->nbytes; off += COPY_PIECE) {
        uint64_t len = t->nbytes - off < COPY_PIECE ? t->nbytes - off : COPY_PIECE;
        const char *src = (const char *)t->data + off;
        XXH64_update(h, src, (size_t)len);
        lm_status s = lm_st_writer_put_part(w, i, off, src, len, err);
        if (s != LM_OK)
            return s;
        release_pages(src, len);
    }
    return LM_OK;
}

// Tensor i read as float32, times scale (when has_scale), written in out_dt: a slab at a time.
static lm_status convert_tensor(lm_st_writer *w, int64_t i, const lm_st_tensor *t, lm_dtype out_dt, bool has_scale,
                                float scale, int64_t slab, float *f32, void *outb, XXH64_state_t *h, lm_err *err)
{
    size_t in_es = lm_dtype_bits(t->dtype) / 8, out_es = lm_dtype_bits(out_dt) / 8;
    for (int64_t off = 0; off < t->numel; off += slab) {
        if (off > 0 && lm_interrupted())
            return lm_interrupted_err(err);
        int64_t cnt = t->numel - off < slab ? t->numel - off : slab;
        const char *src = (const char *)t->data + (size_t)off * in_es;
        lm_status s = lm_convert_to_f32(f32, src, t->dtype, cnt, err);
        if (s != LM_OK)
            return lm_err_prefix(err, "tensor '%s'", t->name);
        if (has_scale)
            for (int64_t k = 0; k < cnt; k++)
                f32[k] *= scale;
        if ((s = lm_convert_from_f32(outb, out_dt, f32, cnt, err)) != LM_OK)
            return s;
        XXH64_update(h, outb, (size_t)cnt * out_es);
        if ((s = lm_st_writer_put_part(w, i, (uint64_t)off * out_es, outb, (uint64_t)cnt * out_es, err)) != LM_OK)
            return s;
        release_pages(src, (uint64_t)cnt * in_es);
    }
    return LM_OK;
}

lm_status lm_pt_write(const lm_pt_plan_t *p, lm_dtype out_dt, lm_st_writer *w, int64_t slab_elems,
                      lm_pt_progress_fn progress, void *ctx, lm_pt_result *res, lm_err *err)
{
    memset(res, 0, sizeof *res);
    if (!lm_dtype_writable(out_dt))
        return lm_err_set(err, LM_ERR_USAGE, "%s is not an output dtype (F32, F16 or BF16)", lm_dtype_name(out_dt));
    int64_t slab = slab_elems > 0 ? slab_elems : DEFAULT_SLAB, largest = 0;
    uint64_t bytes_total = 0;
    for (int64_t i = 0; i < p->n_tensors; i++) {
        const lm_st_tensor *t = p->tensors[i].in;
        if (t->numel > largest)
            largest = t->numel;
        bytes_total += lm_dtype_readable(t->dtype) ? (uint64_t)t->numel * lm_dtype_bits(out_dt) / 8 : t->nbytes;
    }
    if (largest < slab)
        slab = largest ? largest : 1;
    res->xxh64 = calloc((size_t)(p->n_tensors ? p->n_tensors : 1), sizeof *res->xxh64);
    float *f32 = malloc((size_t)slab * sizeof *f32);
    void *outb = malloc((size_t)slab * sizeof(float));
    XXH64_state_t *h = XXH64_createState();
    lm_status s = LM_OK;
    if (!res->xxh64 || !f32 || !outb || !h)
        s = lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    for (int64_t i = 0; i < p->n_tensors && s == LM_OK; i++) {
        if (lm_interrupted()) {
            s = lm_interrupted_err(err);
            break;
        }
        const lm_pt_tensor *pt = &p->tensors[i];
        const lm_st_tensor *t = pt->in;
        const lm_pt_source *sl = &p->src[pt->slice];
        XXH64_reset(h, 0);
        uint64_t out_bytes = t->nbytes;
        if (!lm_dtype_readable(t->dtype) || (t->dtype == out_dt && !sl->has_scale)) {
            s = copy_tensor(w, i, t, h, err);
            res->n_copied++;
        } else {
            s = convert_tensor(w, i, t, out_dt, sl->has_scale, (float)sl->scale, slab, f32, outb, h, err);
            out_bytes = (uint64_t)t->numel * lm_dtype_bits(out_dt) / 8;
            if (sl->has_scale)
                res->n_scaled++;
            else
                res->n_converted++;
        }
        if (s != LM_OK) {
            if (s != LM_ERR_INTERRUPTED)
                lm_err_prefix(err, "writing tensor '%s' (from '%s' of %s)", pt->name, t->name, sl->model);
            break;
        }
        res->xxh64[i] = XXH64_digest(h);
        res->bytes_in += t->nbytes;
        res->bytes_out += out_bytes;
        if (progress)
            progress(ctx, i + 1, p->n_tensors, pt->name, res->bytes_out, bytes_total);
    }
    if (h)
        XXH64_freeState(h);
    free(f32);
    free(outb);
    if (s != LM_OK)
        lm_pt_result_free(res);
    return s;
}
