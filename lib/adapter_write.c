// Writing a PEFT LoRA adapter: see adapter_write.h.
#include "adapter_write.h"

#include <cJSON.h>
#include <cblas.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "arch.h"
#include "manifest.h"
#include "st_writer.h"
#include "util.h"

typedef struct aw_tensor {
    char *key;  // "base_model.model.M.lora_A.weight"
    int ndim;
    int64_t shape[2];
    void *data;  // in the writer's dtype
} aw_tensor;

typedef struct aw_module {
    char *path;      // "model.layers.0.self_attn.q_proj"
    int r;           // 0: a saved module
    bool embedding;  // the base's embedding (lora_embedding_A/B where it has factors)
} aw_module;

struct lm_adapter_out {
    const lm_model *base;
    char *base_name;
    lm_dtype dtype;
    aw_tensor *t;
    int64_t n_t, cap_t;
    aw_module *mods;  // LoRA modules, then (r 0) saved ones, in the order added
    int64_t n_mods, cap_mods;
    bool lora_bias;
    int64_t count;
    lm_arch_desc arch;  // the base's description, made once (have_arch: it has one)
    bool have_arch;
};

static lm_status nomem(lm_err *err)
{
    return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
}

lm_status lm_adapter_out_new(lm_adapter_out **out, const lm_model *base, const char *base_name, lm_dtype dtype,
                             lm_err *err)
{
    *out = NULL;
    if (!lm_dtype_writable(dtype))
        return lm_err_set(err, LM_ERR_USAGE, "an adapter is not written in %s", lm_dtype_name(dtype));
    lm_adapter_out *w = calloc(1, sizeof *w);
    if (!w || !(w->base_name = lm_strdup(base_name ? base_name : ""))) {
        free(w);
        return nomem(err);
    }
    w->base = base;
    w->dtype = dtype;
    lm_err ignored = {0};
    w->have_arch = lm_arch_describe(&w->arch, &base->config, &ignored) == LM_OK;
    *out = w;
    return LM_OK;
}

void lm_adapter_out_free(lm_adapter_out *w)
{
    if (!w)
        return;
    for (int64_t i = 0; i < w->n_t; i++) {
        free(w->t[i].key);
        free(w->t[i].data);
    }
    for (int64_t i = 0; i < w->n_mods; i++)
        free(w->mods[i].path);
    free(w->t);
    free(w->mods);
    free(w->base_name);
    if (w->have_arch)
        lm_arch_desc_free(&w->arch);
    free(w);
}

int64_t lm_adapter_out_count(const lm_adapter_out *w)
{
    return w->count;
}

// Adds tensor `suffix` of module `module` ([d0] or [d0, d1]) from float32 values, converted.
static lm_status add_tensor(lm_adapter_out *w, const char *module, const char *suffix, int ndim, int64_t d0,
                            int64_t d1, const float *values, lm_err *err)
{
    if (w->n_t == w->cap_t) {
        int64_t cap = w->cap_t ? 2 * w->cap_t : 64;
        aw_tensor *g = realloc(w->t, (size_t)cap * sizeof *g);
        if (!g)
            return nomem(err);
        w->t = g;
        w->cap_t = cap;
    }
    int64_t n = ndim == 1 ? d0 : d0 * d1;
    aw_tensor *t = &w->t[w->n_t];
    memset(t, 0, sizeof *t);
    size_t len = strlen("base_model.model.") + strlen(module) + strlen(suffix) + 2;
    t->key = malloc(len);
    t->data = malloc((size_t)n * lm_dtype_bits(w->dtype) / 8 + 1);
    if (!t->key || !t->data) {
        free(t->key);
        free(t->data);
        return nomem(err);
    }
    snprintf(t->key, len, "base_model.model.%s.%s", module, suffix);
    t->ndim = ndim;
    t->shape[0] = d0;
    t->shape[1] = d1;
    lm_status s = lm_convert_from_f32(t->data, w->dtype, values, n, err);
    if (s != LM_OK) {
        free(t->key);
        free(t->data);
        return s;
    }
    w->n_t++;
    return LM_OK;
}

static lm_status add_module(lm_adapter_out *w, const char *path, int r, lm_err *err)
{
    for (int64_t i = 0; i < w->n_mods; i++)
        if (strcmp(w->mods[i].path, path) == 0)
            return r == 0 && w->mods[i].r == 0 ? LM_OK
                                               : lm_err_set(err, LM_ERR_USAGE, "module '%s' added twice", path);
    if (w->n_mods == w->cap_mods) {
        int64_t cap = w->cap_mods ? 2 * w->cap_mods : 64;
        aw_module *g = realloc(w->mods, (size_t)cap * sizeof *g);
        if (!g)
            return nomem(err);
        w->mods = g;
        w->cap_mods = cap;
    }
    if (!(w->mods[w->n_mods].path = lm_strdup(path)))
        return nomem(err);
    w->mods[w->n_mods].embedding = false;
    w->mods[w->n_mods++].r = r;
    return LM_OK;
}

// Names of embedding modules where llmerge's description does not say: the last component of
// the module's path (PEFT makes an Embedding layer of whatever module is nn.Embedding; these are
// the names transformers gives them).
static const char *const embedding_names[] = {"embed_tokens", "wte", "wpe", "word_embeddings",
                                              "position_embeddings", "token_type_embeddings", "embed_positions",
                                              "tok_embeddings", "embed_in", "embeddings", NULL};

// lm_adapter_embedding with the base's description d (NULL where it has none).
static bool is_embedding(const lm_arch_desc *d, const char *tensor)
{
    const lm_arch_tensor *at = d ? lm_arch_find(d, tensor) : NULL;
    if (at)
        return at->role == LM_ROLE_EMBED;
    // a name the description does not have (another prefix, say): by the name
    const char *end = strrchr(tensor, '.');
    if (!end || strcmp(end, ".weight") != 0)
        return false;
    const char *start = end;
    while (start > tensor && start[-1] != '.')
        start--;
    for (int i = 0; embedding_names[i]; i++)
        if ((size_t)(end - start) == strlen(embedding_names[i]) && strncmp(start, embedding_names[i],
                                                                             (size_t)(end - start)) == 0)
            return true;
    return false;
}

bool lm_adapter_embedding(const lm_model *base, const char *tensor)
{
    lm_arch_desc d;
    lm_err ignored = {0};
    if (lm_arch_describe(&d, &base->config, &ignored) != LM_OK)
        return is_embedding(NULL, tensor);
    bool e = is_embedding(&d, tensor);
    lm_arch_desc_free(&d);
    return e;
}

bool lm_adapter_out_embedding(const lm_adapter_out *w, const char *tensor)
{
    return is_embedding(w->have_arch ? &w->arch : NULL, tensor);
}

// lm_adapter_out_embedding for a module path (its weight's name made from it).
static bool module_is_embedding(const lm_adapter_out *w, const char *path)
{
    char *name = lm_strfmt("%s.weight", path);
    bool e = name && lm_adapter_out_embedding(w, name);
    free(name);
    return e;
}

lm_status lm_adapter_out_lora(lm_adapter_out *w, const char *module, bool embedding, int64_t rows, int64_t cols,
                              int r, const float *b, const float *a, lm_err *err)
{
    if (r < 1)
        return lm_err_set(err, LM_ERR_USAGE, "module '%s': rank %d", module, r);
    lm_status s = add_module(w, module, r, err);
    if (s != LM_OK)
        return s;
    w->mods[w->n_mods - 1].embedding = embedding;
    if (!embedding) {
        s = add_tensor(w, module, "lora_A.weight", 2, r, cols, a, err);
        if (s == LM_OK)
            s = add_tensor(w, module, "lora_B.weight", 2, rows, r, b, err);
    } else {
        // lora_embedding_A = bᵀ [r, vocab], lora_embedding_B = aᵀ [hidden, r]
        float *ta = malloc((size_t)(r * rows) * sizeof *ta), *tb = malloc((size_t)(cols * r) * sizeof *tb);
        if (!ta || !tb) {
            free(ta);
            free(tb);
            return nomem(err);
        }
        for (int64_t i = 0; i < rows; i++)
            for (int q = 0; q < r; q++)
                ta[q * rows + i] = b[i * r + q];
        for (int q = 0; q < r; q++)
            for (int64_t j = 0; j < cols; j++)
                tb[j * r + q] = a[q * cols + j];
        s = add_tensor(w, module, "lora_embedding_A", 2, r, rows, ta, err);
        if (s == LM_OK)
            s = add_tensor(w, module, "lora_embedding_B", 2, cols, r, tb, err);
        free(ta);
        free(tb);
    }
    if (s == LM_OK)
        w->count++;
    return s;
}

lm_status lm_adapter_out_bias(lm_adapter_out *w, const char *module, int64_t n, const float *delta, lm_err *err)
{
    lm_status s = add_tensor(w, module, "lora_B.bias", 1, n, 0, delta, err);
    if (s == LM_OK) {
        w->lora_bias = true;
        w->count++;
    }
    return s;
}

lm_status lm_adapter_out_saved(lm_adapter_out *w, const char *tensor, int ndim, const int64_t *shape,
                               const float *values, lm_err *err)
{
    const char *dot = strrchr(tensor, '.');
    if (!dot || dot == tensor || (ndim != 1 && ndim != 2))
        return lm_err_set(err, LM_ERR_UNSUPPORTED, "tensor '%s' (%d dimensions) cannot be saved in an adapter", tensor,
                          ndim);
    char *module = strndup(tensor, (size_t)(dot - tensor));
    if (!module)
        return nomem(err);
    lm_status s = add_module(w, module, 0, err);
    if (s == LM_OK)
        s = add_tensor(w, module, dot + 1, ndim, shape[0], ndim == 2 ? shape[1] : 0, values, err);
    free(module);
    if (s == LM_OK)
        w->count++;
    return s;
}

// The last component of a module path.
static const char *leaf(const char *path)
{
    const char *d = strrchr(path, '.');
    return d ? d + 1 : path;
}

// Whether every module of the base named `name` last (a tensor "X.name.weight") is among the
// writer's modules of kind `saved` (r 0) or not.
static bool all_of_leaf(const lm_adapter_out *w, const char *name, bool saved)
{
    size_t nl = strlen(name);
    for (int64_t i = 0; i < w->base->n_tensors; i++) {
        const char *t = w->base->tensors[i]->name, *d = strrchr(t, '.');
        if (!d || strcmp(d, ".weight") != 0)
            continue;
        size_t ml = (size_t)(d - t);
        if (ml < nl || strncmp(t + ml - nl, name, nl) != 0 || (ml > nl && t[ml - nl - 1] != '.'))
            continue;
        bool found = false;
        for (int64_t m = 0; !found && m < w->n_mods; m++)
            found = (w->mods[m].r == 0) == saved && strlen(w->mods[m].path) == ml &&
                    strncmp(w->mods[m].path, t, ml) == 0;
        if (!found)
            return false;
    }
    return true;
}

// target_modules (saved false) or modules_to_save (true): for target_modules each last name whose
// modules all have factors, else the full paths; for modules_to_save the full paths, but
// embed_tokens by its last name where that is all of them; where there are none,
// "dummy-target-modules" (target_modules) or null (modules_to_save).
static cJSON *module_list(const lm_adapter_out *w, bool saved)
{
    cJSON *list = cJSON_CreateArray();
    int n = 0;
    for (int64_t m = 0; list && m < w->n_mods; m++) {
        if ((w->mods[m].r == 0) != saved)
            continue;
        // a saved embed_tokens by that name alone: PEFT 0.18 ties lm_head to a saved embedding
        // only where modules_to_save names it so
        bool by_leaf = saved ? strcmp(leaf(w->mods[m].path), "embed_tokens") == 0 : true;
        const char *name = by_leaf ? leaf(w->mods[m].path) : w->mods[m].path;
        if (by_leaf && all_of_leaf(w, name, saved)) {
            bool listed = false;  // once per last name
            const cJSON *e;
            cJSON_ArrayForEach(e, list)
            listed = listed || strcmp(e->valuestring, name) == 0;
            if (listed)
                continue;
        } else {
            name = w->mods[m].path;
        }
        cJSON_AddItemToArray(list, cJSON_CreateString(name));
        n++;
    }
    if (list && n == 0) {
        cJSON_Delete(list);
        // no targets: PEFT's name for none (a null would be its default targets)
        return saved ? cJSON_CreateNull() : cJSON_CreateString("dummy-target-modules");
    }
    return list;
}

// The index of the tensor whose key is `key`, or -1.
static int64_t find_key(const lm_adapter_out *w, const char *key)
{
    for (int64_t i = 0; i < w->n_t; i++)
        if (strcmp(w->t[i].key, key) == 0)
            return i;
    return -1;
}

static void drop_tensor(lm_adapter_out *w, int64_t i)
{
    free(w->t[i].key);
    free(w->t[i].data);
    memmove(&w->t[i], &w->t[i + 1], (size_t)(w->n_t - i - 1) * sizeof *w->t);
    w->n_t--;
}

#define WHOLE_ROWS 4096  // rows of an embedding made whole at once

// PEFT refuses an Embedding layer under lora_bias: embedding module m's factors become its
// weight whole (modules_to_save), BASE + lora_embedding_Aᵀ·lora_embedding_Bᵀ (the product PEFT
// would add, from the factors as stored), a block of rows at a time.
static lm_status embedding_whole(lm_adapter_out *w, aw_module *m, lm_err *err)
{
    char *ka = lm_strfmt("base_model.model.%s.lora_embedding_A", m->path);
    char *kb = lm_strfmt("base_model.model.%s.lora_embedding_B", m->path);
    char *name = lm_strfmt("%s.weight", m->path), *key = lm_strfmt("base_model.model.%s.weight", m->path);
    int64_t ia = ka ? find_key(w, ka) : -1, ib = kb ? find_key(w, kb) : -1;
    const lm_st_tensor *bt = name ? lm_model_find(w->base, name) : NULL;
    float *ea = NULL, *eb = NULL, *rows = NULL;
    void *out = NULL;
    lm_status s = LM_OK;
    if (!ka || !kb || !name || !key) {
        s = nomem(err);
        goto done;
    }
    if (ia < 0 || ib < 0 || !bt || bt->ndim != 2) {
        s = lm_err_set(err, LM_ERR_USAGE, "module '%s': no embedding factors or base weight to make whole", m->path);
        goto done;
    }
    int64_t vocab = bt->shape[0], hidden = bt->shape[1], r = w->t[ia].shape[0], es = lm_dtype_bits(bt->dtype) / 8;
    int64_t wb = lm_dtype_bits(w->dtype) / 8;
    ea = lm_convert_to_f32_new(w->t[ia].data, w->dtype, r * vocab, err);  // [r, vocab]
    eb = ea ? lm_convert_to_f32_new(w->t[ib].data, w->dtype, hidden * r, err) : NULL;  // [hidden, r]
    rows = eb ? malloc((size_t)(WHOLE_ROWS * hidden) * sizeof *rows) : NULL;
    out = rows ? malloc((size_t)(vocab * hidden * wb)) : NULL;
    if (!ea || !eb) {
        s = err->status != LM_OK ? err->status : LM_ERR_NOMEM;
        goto done;
    }
    if (!rows || !out) {
        s = nomem(err);
        goto done;
    }
    for (int64_t i0 = 0; i0 < vocab && s == LM_OK; i0 += WHOLE_ROWS) {
        int64_t nr = vocab - i0 < WHOLE_ROWS ? vocab - i0 : WHOLE_ROWS;
        s = lm_convert_to_f32(rows, (const char *)bt->data + (size_t)(i0 * hidden * es), bt->dtype, nr * hidden,
                              err);
        if (s != LM_OK)
            break;
        // rows += (A[:, i0:i0+nr])ᵀ · Bᵀ
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasTrans, (int)nr, (int)hidden, (int)r, 1.0f, ea + i0, (int)vocab,
                    eb, (int)r, 1.0f, rows, (int)hidden);
        s = lm_convert_from_f32((char *)out + (size_t)(i0 * hidden * wb), w->dtype, rows, nr * hidden, err);
    }
    if (s != LM_OK)
        goto done;
    drop_tensor(w, ia > ib ? ia : ib);
    drop_tensor(w, ia > ib ? ib : ia);
    w->t[w->n_t] = (aw_tensor){.key = key, .ndim = 2, .shape = {vocab, hidden}, .data = out};  // room: two dropped
    w->n_t++;
    key = NULL;
    out = NULL;
    m->r = 0;
done:
    free(ka);
    free(kb);
    free(name);
    free(key);
    free(ea);
    free(eb);
    free(rows);
    free(out);
    return s;
}

// PEFT loads a saved module (modules_to_save) as a copy of the whole module, every one of its
// parameters from the file: those of saved module m that did not change are added with the
// base's values.
static lm_status complete_saved(lm_adapter_out *w, const aw_module *m, lm_err *err)
{
    size_t pl = strlen(m->path);
    for (int64_t i = 0; i < w->base->n_tensors; i++) {
        const lm_st_tensor *t = w->base->tensors[i];
        if (strncmp(t->name, m->path, pl) != 0 || t->name[pl] != '.' || strchr(t->name + pl + 1, '.'))
            continue;
        char *key = lm_strfmt("base_model.model.%s", t->name);
        if (!key)
            return nomem(err);
        bool have = find_key(w, key) >= 0;
        free(key);
        if (have)
            continue;
        if (!lm_dtype_readable(t->dtype) || (t->ndim != 1 && t->ndim != 2))
            return lm_err_set(err, LM_ERR_UNSUPPORTED, "tensor '%s' of saved module '%s' (%s, %d dimensions) "
                              "cannot be written in an adapter", t->name, m->path, lm_dtype_name(t->dtype), t->ndim);
        float *v = lm_convert_to_f32_new(t->data, t->dtype, t->numel, err);
        if (!v)
            return err->status != LM_OK ? err->status : LM_ERR_NOMEM;
        lm_status s = add_tensor(w, m->path, t->name + pl + 1, t->ndim, t->shape[0], t->ndim == 2 ? t->shape[1] : 0,
                                 v, err);
        free(v);
        if (s != LM_OK)
            return s;
    }
    return LM_OK;
}

bool lm_adapter_out_is_whole(const lm_adapter_out *w, const char *module)
{
    for (int64_t m = 0; m < w->n_mods; m++)
        if (strcmp(w->mods[m].path, module) == 0)
            return w->mods[m].r == 0;
    return false;
}

// Whether module m is an embedding that the base's lm_head is tied to, in the way PEFT ties
// adapters (ensure_weight_tying): it finds the embedding by its last name, embed_tokens, and the
// tied layer from the model (lm_head, which the base then does not hold).
static bool tied_embedding(const lm_adapter_out *w, const aw_module *m)
{
    return w->base->config.tie_word_embeddings && !lm_model_find(w->base, "lm_head.weight") &&
           strcmp(leaf(m->path), "embed_tokens") == 0 && (m->embedding || module_is_embedding(w, m->path));
}

// The tied lm_head's tensors as PEFT saves them beside the embedding's (PEFT 0.18 and later
// read them): a copy of the whole embedding where it is saved, else linear factors that are
// the embedding's transposed, lora_A = lora_embedding_Bᵀ [r, hidden] and lora_B =
// lora_embedding_Aᵀ [vocab, r] (the embedding's change is (B·A)ᵀ = Aᵀ·Bᵀ, and so is lm_head's).
static lm_status add_tied_head(lm_adapter_out *w, const aw_module *m, lm_err *err)
{
    const char *suffix[2] = {"weight", NULL}, *tied[2] = {"weight", NULL};
    if (m->r > 0) {
        suffix[0] = "lora_embedding_B", suffix[1] = "lora_embedding_A";
        tied[0] = "lora_A.weight", tied[1] = "lora_B.weight";
    }
    for (int i = 0; i < 2 && suffix[i]; i++) {
        char *key = lm_strfmt("base_model.model.%s.%s", m->path, suffix[i]);
        int64_t at = key ? find_key(w, key) : -1;
        free(key);
        if (at < 0)
            return lm_err_set(err, LM_ERR_USAGE, "module '%s': no %s to tie lm_head to", m->path, suffix[i]);
        const aw_tensor *t = &w->t[at];
        int64_t d0 = t->shape[0], d1 = t->shape[1];
        float *v = lm_convert_to_f32_new(t->data, w->dtype, d0 * d1, err), *x = v;
        if (!v)
            return err->status != LM_OK ? err->status : LM_ERR_NOMEM;
        if (m->r > 0) {  // transposed: [d1, d0]
            x = malloc((size_t)(d0 * d1) * sizeof *x);
            for (int64_t a = 0; x && a < d0; a++)
                for (int64_t b = 0; b < d1; b++)
                    x[b * d0 + a] = v[a * d1 + b];
            int64_t d = d0;
            d0 = d1, d1 = d;
        }
        lm_status s = x ? add_tensor(w, "lm_head", tied[i], 2, d0, d1, x, err) : nomem(err);
        if (x != v)
            free(x);
        free(v);
        if (s != LM_OK)
            return s;
    }
    return LM_OK;
}

// Under lora_bias PEFT makes lora_B of every LoRA layer with a bias, and loading an adapter
// without one warns of missing keys (leaving it at its initial zeros): LoRA module m whose bias
// did not change, or whose base has none, gets a lora_B.bias of zeros (which llmerge's reader
// accepts where the base has no bias).
static lm_status zero_bias(lm_adapter_out *w, const aw_module *m, lm_err *err)
{
    char *bias = lm_strfmt("base_model.model.%s.lora_B.bias", m->path);
    char *weight = lm_strfmt("base_model.model.%s.lora_B.weight", m->path);
    if (!bias || !weight) {
        free(bias);
        free(weight);
        return nomem(err);
    }
    int64_t b = find_key(w, weight);
    lm_status s = LM_OK;
    if (b >= 0 && find_key(w, bias) < 0) {
        int64_t out = w->t[b].shape[0];
        float *zeros = calloc((size_t)out, sizeof *zeros);
        s = zeros ? add_tensor(w, m->path, "lora_B.bias", 1, out, 0, zeros, err) : nomem(err);
        free(zeros);
    }
    free(bias);
    free(weight);
    return s;
}

const char *lm_adapter_out_biasless(const lm_adapter_out *w)
{
    for (int64_t m = 0; w->lora_bias && m < w->n_mods; m++) {
        if (w->mods[m].r == 0)
            continue;
        char *name = lm_strfmt("%s.bias", w->mods[m].path);
        bool has = name && lm_model_find(w->base, name);
        free(name);
        if (!has)
            return w->mods[m].path;
    }
    return NULL;
}

lm_status lm_adapter_out_write(lm_adapter_out *w, const char *dir, int rank, lm_err *err)
{
    if (w->n_t == 0)
        return lm_err_set(err, LM_ERR_USAGE, "no tensor changes: the adapter would be empty");
    lm_status s = LM_OK;
    for (int64_t m = 0; s == LM_OK && w->lora_bias && m < w->n_mods; m++)
        if (w->mods[m].r > 0 && w->mods[m].embedding)
            s = embedding_whole(w, &w->mods[m], err);
    for (int64_t m = 0; s == LM_OK && w->lora_bias && m < w->n_mods; m++)
        if (w->mods[m].r > 0)
            s = zero_bias(w, &w->mods[m], err);
    for (int64_t m = 0; s == LM_OK && m < w->n_mods; m++)
        if (w->mods[m].r == 0)
            s = complete_saved(w, &w->mods[m], err);
    if (s != LM_OK)
        return s;
    bool tie = false;
    for (int64_t m = 0; s == LM_OK && !tie && m < w->n_mods; m++)
        if ((tie = tied_embedding(w, &w->mods[m])))
            s = add_tied_head(w, &w->mods[m], err);
    if (s != LM_OK)
        return s;
    cJSON *c = cJSON_CreateObject(), *rp = cJSON_CreateObject(), *ap = cJSON_CreateObject();
    char *text = NULL, *cfg_path = lm_path_join(dir, "adapter_config.json");
    char *st_path = lm_path_join(dir, "adapter_model.safetensors");
    lm_st_desc *d = calloc((size_t)w->n_t, sizeof *d);
    const void **data = calloc((size_t)w->n_t, sizeof *data);
    if (!c || !rp || !ap || !cfg_path || !st_path || !d || !data) {
        s = nomem(err);
        goto done;
    }
    for (int64_t m = 0; m < w->n_mods; m++)
        if (w->mods[m].r > 0 && w->mods[m].r != rank) {
            cJSON_AddNumberToObject(rp, w->mods[m].path, w->mods[m].r);
            cJSON_AddNumberToObject(ap, w->mods[m].path, w->mods[m].r);
        }
    cJSON_AddItemToObject(c, "alpha_pattern", ap);
    ap = NULL;
    cJSON_AddStringToObject(c, "base_model_name_or_path", w->base_name);
    cJSON_AddStringToObject(c, "bias", "none");
    cJSON_AddBoolToObject(c, "ensure_weight_tying", tie);
    cJSON_AddBoolToObject(c, "fan_in_fan_out", false);
    cJSON_AddBoolToObject(c, "inference_mode", true);
    cJSON_AddBoolToObject(c, "init_lora_weights", true);
    cJSON_AddNumberToObject(c, "lora_alpha", rank);
    cJSON_AddBoolToObject(c, "lora_bias", w->lora_bias);
    cJSON_AddNumberToObject(c, "lora_dropout", 0.0);
    cJSON_AddItemToObject(c, "modules_to_save", module_list(w, true));
    cJSON_AddStringToObject(c, "peft_type", "LORA");
    cJSON_AddNumberToObject(c, "r", rank);
    cJSON_AddItemToObject(c, "rank_pattern", rp);
    rp = NULL;
    cJSON_AddItemToObject(c, "target_modules", module_list(w, false));
    cJSON_AddStringToObject(c, "task_type", "CAUSAL_LM");
    cJSON_AddBoolToObject(c, "use_dora", false);
    cJSON_AddBoolToObject(c, "use_rslora", false);
    if (!(text = lm_manifest_print_json(c))) {
        s = nomem(err);
        goto done;
    }
    size_t tl = strlen(text);
    char *nl = realloc(text, tl + 2);
    if (!nl) {
        s = nomem(err);
        goto done;
    }
    text = nl;
    memcpy(text + tl, "\n", 2);
    for (int64_t i = 0; i < w->n_t; i++) {
        d[i].name = w->t[i].key;
        d[i].dtype = w->dtype;
        d[i].ndim = w->t[i].ndim;
        d[i].shape[0] = w->t[i].shape[0];
        d[i].shape[1] = w->t[i].shape[1];
        data[i] = w->t[i].data;
    }
    const char *meta[] = {"format", "pt", NULL};
    if ((s = lm_st_write_file(st_path, d, data, w->n_t, meta, err)) == LM_OK)
        s = lm_write_file(cfg_path, text, strlen(text), err);
done:
    cJSON_Delete(c);
    cJSON_Delete(rp);
    cJSON_Delete(ap);
    free(text);
    free(cfg_path);
    free(st_path);
    free(d);
    free(data);
    return s;
}
