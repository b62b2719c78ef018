// The forward pass over the device interface, and the runner that falls back to the CPU. See
// forward.h.
//
// Per batch of T tokens (packed sequences), with H hidden, Q = heads·head_dim, KV =
// kv_heads·head_dim and I intermediate:
//
//   h = embed[ids] (+ s·Aᵀ[ids] Bᵀ for an embedding LoRA)
//   per layer:  xn = rmsnorm(h);  q, k, v = linear(xn);  rope(q, k);  att = attention(q, k, v)
//               h += linear_o(att);  xn = rmsnorm(h);  g = silu(linear_gate(xn)) · linear_up(xn)
//               h += linear_down(g)
//   logits = linear_head(rmsnorm(h)), in chunks of rows;  nll = log-softmax NLL of each row
//
// where linear(x) = x Wᵀ + b + s·(x Aᵀ) Bᵀ, the residual additions done by the GEMM itself
// (beta = 1) into h.
#include "forward.h"

#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "arch.h"
#include "dtype.h"
#include "safetensors.h"
#include "util.h"

// Logits are computed for at most this many floats of rows at a time (64 MiB), so a large
// vocabulary does not make the arena grow with the batch.
#define LOGIT_FLOATS ((int64_t)1 << 24)
#define DEFAULT_MAX_TOKENS 4096
#define ALIGN 64  // bytes; every arena region starts on such a boundary

// ==== the model on a device ===================================================================

// One linear layer, y = x Wᵀ + b + scale·(x Aᵀ) Bᵀ. Pointers are device memory.
typedef struct fwd_linear {
    const float *w;   // (out, in)
    const float *b;   // (out) the bias plus scale·lora_B.bias, or NULL
    const float *a;   // (r, in) lora_A, or NULL without LoRA
    const float *bm;  // (out, r) lora_B
    int64_t out, in, r;
    float scale;
} fwd_linear;

typedef struct fwd_layer {
    const float *in_norm;    // (hidden) input_layernorm
    const float *post_norm;  // (hidden) post_attention_layernorm
    fwd_linear q, k, v, o, gate, up, down;
} fwd_layer;

// The activations of one batch: regions of one device allocation.
typedef struct fwd_arena {
    float *h;          // (T, hidden) the residual stream
    float *xn;         // (T, hidden) its normed copy
    float *q;          // (T, heads·head_dim)
    float *k, *v;      // (T, kv_heads·head_dim)
    float *att;        // (T, heads·head_dim) attention output
    float *gate, *up;  // (T, intermediate)
    float *lora;       // (T, max_r) x Aᵀ
    float *logits;     // (logit_rows, vocab)
    float *nll;        // (T)
    int32_t *ints;     // (4, T): ids, positions, sequence starts, targets, one upload
} fwd_arena;

struct lm_fwd {
    lm_dev *dev;
    int64_t hidden, inter, n_layers, heads, kv_heads, head_dim, vocab;
    float eps;
    float attn_scale;          // head_dim^-1/2
    const float *embed;        // (vocab, hidden)
    const float *emb_at;       // (vocab, emb_r) lora_embedding_A transposed, or NULL
    const float *emb_b;        // (hidden, emb_r) lora_embedding_B
    int64_t emb_r;
    float emb_scale;
    fwd_layer *layers;         // (n_layers)
    const float *final_norm;   // (hidden)
    fwd_linear head;           // lm_head; its w is embed when the embeddings are tied
    const float *inv_freq;     // (head_dim / 2)
    int64_t max_r;             // the largest LoRA rank (0 without)
    int64_t window;            // sliding-window attention: keys within this many rows (0: all)

    void **owned;              // (n_owned) device allocations holding the weights
    int64_t n_owned, cap_owned;
    size_t weight_bytes;

    void *arena;               // device memory for arena_tokens tokens, or NULL
    int64_t arena_tokens;
    int32_t *host_ints;        // (4, arena_tokens) staged for the upload
};

const char *lm_fwd_point_module(lm_fwd_point p)
{
    switch (p) {
    case LM_FWD_ATTN_IN: return "self_attn.q_proj";
    case LM_FWD_O_IN: return "self_attn.o_proj";
    case LM_FWD_MLP_IN: return "mlp.gate_proj";
    case LM_FWD_DOWN_IN: return "mlp.down_proj";
    case LM_FWD_N_POINTS: break;
    }
    return "?";
}

lm_status lm_fwd_device_ok(lm_dev *d, lm_err *err)
{
    const lm_dev_i *i = d->iface;
    struct { bool have; const char *name; } ops[] = {
        {i->gemm != NULL, "gemm"},           {i->gather_rows != NULL, "gather_rows"},
        {i->add_rows != NULL, "add_rows"},   {i->rmsnorm != NULL, "rmsnorm"},
        {i->rope != NULL, "rope"},           {i->attention != NULL, "attention"},
        {i->silu_mul != NULL, "silu_mul"},   {i->nll_rows != NULL, "nll_rows"},
    };
    for (size_t k = 0; k < sizeof ops / sizeof ops[0]; k++)
        if (!ops[k].have)
            return lm_err_set(err, LM_ERR_UNSUPPORTED, "%s: the operation %s is not implemented on this device",
                              lm_dev_name(d), ops[k].name);
    return LM_OK;
}

lm_dev *lm_fwd_device(const lm_fwd *f)
{
    return f->dev;
}

size_t lm_fwd_weight_bytes(const lm_fwd *f)
{
    return f->weight_bytes;
}

void lm_fwd_free(lm_fwd *f)
{
    if (!f)
        return;
    for (int64_t i = 0; i < f->n_owned; i++)
        lm_dev_release(f->dev, f->owned[i]);
    lm_dev_release(f->dev, f->arena);
    free(f->owned);
    free(f->layers);
    free(f->host_ints);
    free(f);
}

// ---- loading --------------------------------------------------------------------------------

// What loading needs besides the model under construction.
typedef struct fwd_loader {
    lm_fwd *f;
    const lm_model *m;
    const lm_adapter *a;
    bool *used_module;  // (a->n_modules) consumed by the forward pass
    bool *used_saved;   // (a->n_saved)
} fwd_loader;

// Allocates n floats of device memory for weights; remembered for lm_fwd_free.
static lm_status weight_alloc(lm_fwd *f, int64_t n, float **out, lm_err *err)
{
    *out = NULL;
    if (f->n_owned == f->cap_owned) {
        int64_t cap = f->cap_owned ? 2 * f->cap_owned : 64;
        void **o = realloc(f->owned, (size_t)cap * sizeof *o);
        if (!o)
            return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
        f->owned = o;
        f->cap_owned = cap;
    }
    uint64_t bytes;
    if (n < 0 || !lm_mul_u64((uint64_t)n, sizeof(float), &bytes) || bytes > SIZE_MAX)
        return lm_err_set(err, LM_ERR_UNSUPPORTED, "a weight of %" PRId64 " floats is too large", n);
    void *p;
    lm_status s = lm_dev_alloc(f->dev, (size_t)bytes, &p, err);
    if (s != LM_OK)
        return s;
    f->owned[f->n_owned++] = p;
    f->weight_bytes += (size_t)bytes;
    *out = p;
    return LM_OK;
}

// Places n host floats on the device.
static lm_status put_host(lm_fwd *f, const float *host, int64_t n, const float **out, lm_err *err)
{
    float *d;
    lm_status s = weight_alloc(f, n, &d, err);
    if (s == LM_OK)
        s = lm_dev_upload(f->dev, d, host, (size_t)n * sizeof *host, err);
    *out = d;
    return s;
}

// A tensor as float32 in new host memory (caller frees).
static lm_status read_host(const lm_st_tensor *t, float **out, lm_err *err)
{
    *out = malloc((size_t)t->numel * sizeof **out + 1);
    if (!*out)
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory reading %s", t->name);
    lm_status s = lm_st_read_f32(t, *out, err);
    if (s != LM_OK) {
        free(*out);
        *out = NULL;
    }
    return s;
}

// Places tensor t on the device as float32: in place when the device reads host memory and the
// tensor is F32 and aligned, else converted (on the device when it reads host memory, through
// a host copy otherwise).
static lm_status put_tensor(lm_fwd *f, const lm_st_tensor *t, const float **out, lm_err *err)
{
    lm_dev *d = f->dev;
    if (d->host_memory && t->dtype == LM_DTYPE_F32 && (uintptr_t)t->data % sizeof(float) == 0) {
        *out = t->data;
        return LM_OK;
    }
    lm_status s;
    if (d->host_memory) {
        float *dst;
        if ((s = weight_alloc(f, t->numel, &dst, err)) != LM_OK)
            return s;
        *out = dst;
        s = lm_dev_to_f32(d, dst, t->data, t->dtype, t->numel, err);
        return s == LM_OK ? s : lm_err_prefix(err, "%s", t->name);
    }
    float *host;
    if ((s = read_host(t, &host, err)) != LM_OK)
        return s;
    s = put_host(f, host, t->numel, out, err);
    free(host);
    return s;
}

// The tensor the forward pass uses for base tensor `name`: the adapter's saved replacement when
// it has one, else the model's. NULL (no error) when neither has it.
static const lm_st_tensor *source(fwd_loader *L, const char *name, bool use_adapter)
{
    int64_t i;
    if (use_adapter && L->a && lm_adapter_lookup(L->a, name, &i) == LM_TOUCH_SAVED) {
        L->used_saved[i] = true;
        return L->a->saved[i].t;
    }
    return lm_model_find(L->m, name);
}

// Places the tensor the architecture calls (layer, slot) (its bias with want_bias); *out NULL
// when the architecture has no such tensor.
static lm_status put_arch(fwd_loader *L, const lm_arch_desc *desc, int layer, lm_arch_slot slot, bool want_bias,
                          bool use_adapter, const float **out, lm_err *err)
{
    *out = NULL;
    const lm_arch_tensor *at = lm_arch_get(desc, layer, slot, want_bias);
    if (!at)
        return LM_OK;
    const lm_st_tensor *t = source(L, at->name, use_adapter);
    if (!t)
        return lm_err_set(err, LM_ERR_NOT_FOUND, "%s: tensor %s is missing", L->m->dir, at->name);
    return put_tensor(L->f, t, out, err);
}

// Fills a linear layer: weight, bias, and the adapter's LoRA factors and bias delta.
static lm_status put_linear(fwd_loader *L, const lm_arch_desc *desc, int layer, lm_arch_slot slot,
                            fwd_linear *lin, lm_err *err)
{
    lm_fwd *f = L->f;
    const lm_arch_tensor *wt = lm_arch_get(desc, layer, slot, false);
    const lm_arch_tensor *bt = lm_arch_get(desc, layer, slot, true);
    if (!wt)
        return lm_err_set(err, LM_ERR_UNSUPPORTED, "the architecture has no weight for slot %d of layer %d",
                          (int)slot, layer);
    lin->out = wt->shape[0];
    lin->in = wt->shape[1];
    lm_status s = put_arch(L, desc, layer, slot, false, true, &lin->w, err);
    if (s != LM_OK)
        return s;

    int64_t mi = -1;
    const lm_lora_module *mod = NULL;
    if (L->a && lm_adapter_lookup(L->a, wt->name, &mi) == LM_TOUCH_LORA) {
        mod = &L->a->modules[mi];
        if (mod->kind != LM_LORA_LINEAR)
            return lm_err_set(err, LM_ERR_UNSUPPORTED, "%s: module %s is an embedding LoRA on a linear layer",
                              L->a->dir, mod->path);
        L->used_module[mi] = true;
        lin->r = mod->r;
        lin->scale = (float)mod->scale;
        if ((s = put_tensor(f, mod->a, &lin->a, err)) != LM_OK || (s = put_tensor(f, mod->b, &lin->bm, err)) != LM_OK)
            return s;
        if (lin->r > f->max_r)
            f->max_r = lin->r;
    }

    // The bias: the model's (or a saved replacement), plus scale·lora_B.bias (PEFT adds the
    // lora_B layer's bias inside the scaled LoRA branch).
    int64_t bi = -1;
    bool lora_bias = bt && L->a && lm_adapter_lookup(L->a, bt->name, &bi) == LM_TOUCH_BIAS;
    if (!lora_bias)
        return bt ? put_arch(L, desc, layer, slot, true, true, &lin->b, err) : LM_OK;
    const lm_lora_module *bm = &L->a->modules[bi];
    L->used_module[bi] = true;
    const lm_st_tensor *base_bias = source(L, bt->name, false);
    float *b = NULL, *db = NULL;
    if (!base_bias) {
        s = lm_err_set(err, LM_ERR_NOT_FOUND, "%s: tensor %s is missing", L->m->dir, bt->name);
    } else if ((s = read_host(base_bias, &b, err)) == LM_OK && (s = read_host(bm->bias, &db, err)) == LM_OK) {
        float sc = (float)bm->scale;
        for (int64_t i = 0; i < base_bias->numel; i++)
            b[i] += sc * db[i];
        s = put_host(f, b, base_bias->numel, &lin->b, err);
    }
    free(b);
    free(db);
    return s;
}

// The embedding, with its LoRA (lora_embedding_A transposed so that a token's row of it is a
// row gather) when the adapter has one.
static lm_status put_embedding(fwd_loader *L, const lm_arch_desc *desc, lm_err *err)
{
    lm_fwd *f = L->f;
    lm_status s = put_arch(L, desc, -1, LM_SLOT_EMBED, false, true, &f->embed, err);
    const lm_arch_tensor *et = lm_arch_get(desc, -1, LM_SLOT_EMBED, false);
    int64_t mi;
    if (s != LM_OK || !L->a || lm_adapter_lookup(L->a, et->name, &mi) != LM_TOUCH_LORA)
        return s;
    const lm_lora_module *mod = &L->a->modules[mi];
    if (mod->kind != LM_LORA_EMBEDDING)
        return lm_err_set(err, LM_ERR_UNSUPPORTED, "%s: module %s is a linear LoRA on the embedding", L->a->dir,
                          mod->path);
    L->used_module[mi] = true;
    f->emb_r = mod->r;
    f->emb_scale = (float)mod->scale;
    if (f->emb_r > f->max_r)
        f->max_r = f->emb_r;
    float *a = NULL, *at = NULL;
    int64_t r = mod->r, v = mod->a->shape[1];  // A is (r, vocab)
    if ((s = read_host(mod->a, &a, err)) == LM_OK) {
        if (!(at = malloc((size_t)(r * v) * sizeof *at + 1))) {
            s = lm_err_set(err, LM_ERR_NOMEM, "out of memory");
        } else {
            for (int64_t j = 0; j < r; j++)
                for (int64_t t = 0; t < v; t++)
                    at[t * r + j] = a[j * v + t];
            s = put_host(f, at, r * v, &f->emb_at, err);
        }
    }
    free(a);
    free(at);
    return s == LM_OK ? put_tensor(f, mod->b, &f->emb_b, err) : s;
}

static lm_status put_rope(lm_fwd *f, const lm_config *cfg, lm_err *err)
{
    int64_t half = f->head_dim / 2;
    double *dv = malloc((size_t)half * sizeof *dv + 1);
    float *fv = malloc((size_t)half * sizeof *fv + 1);
    lm_status s;
    if (!dv || !fv)
        s = lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    else if ((s = lm_config_rope_inv_freq(cfg, dv, err)) == LM_OK) {
        for (int64_t i = 0; i < half; i++)
            fv[i] = (float)dv[i];  // Hugging Face keeps inv_freq in float32
        s = put_host(f, fv, half, &f->inv_freq, err);
    }
    free(dv);
    free(fv);
    return s;
}

// Refuses what the forward pass cannot apply: DoRA, and adapter entries it did not consume.
static lm_status check_adapter(const lm_adapter *a, const bool *used_module, const bool *used_saved,
                               bool before, lm_err *err)
{
    for (int64_t i = 0; i < a->n_modules; i++) {
        const lm_lora_module *m = &a->modules[i];
        if (before && m->magnitude)
            return lm_err_set(err, LM_ERR_UNSUPPORTED, "%s: DoRA adapters (use_dora, module %s) are not supported by "
                              "the forward pass yet; merge it into its base first (llmerge task-arithmetic BASE "
                              "ADAPTER -o OUT) and use OUT", a->dir, m->path);
        if (!before && !used_module[i])
            return lm_err_set(err, LM_ERR_UNSUPPORTED, "%s: module %s changes %s, which the forward pass does not "
                              "use", a->dir, m->path, m->base_name);
    }
    for (int64_t i = 0; !before && i < a->n_saved; i++)
        if (!used_saved[i])
            return lm_err_set(err, LM_ERR_UNSUPPORTED, "%s: modules_to_save replaces %s, which the forward pass "
                              "does not use", a->dir, a->saved[i].base_name);
    return LM_OK;
}

lm_status lm_fwd_check(const lm_model *m, const lm_adapter *a, lm_err *err)
{
    const lm_config *cfg = &m->config;
    lm_status s = lm_model_check(m, NULL, err);
    if (s != LM_OK)
        return lm_err_prefix(err, "%s", m->dir);
    if (cfg->vocab_size > INT32_MAX || cfg->head_dim % 2 != 0)
        return lm_err_set(err, LM_ERR_UNSUPPORTED, "%s: vocab_size %" PRId64 " or head_dim %" PRId64 " is beyond "
                          "what the forward pass takes", cfg->path, cfg->vocab_size, cfg->head_dim);
    if (cfg->arch == LM_ARCH_QWEN2 && cfg->use_sliding_window && cfg->sliding_window > 0)
        return lm_err_set(err, LM_ERR_UNSUPPORTED, "%s: use_sliding_window (Qwen2's sliding window from layer "
                          "max_window_layers on) is not supported by the forward pass", cfg->path);
    if (a && (s = lm_adapter_validate(a, m, err)) == LM_OK)
        s = check_adapter(a, NULL, NULL, true, err);
    return s;
}

lm_status lm_fwd_create(lm_fwd **out, const lm_model *m, const lm_adapter *a, lm_dev *d, lm_err *err)
{
    *out = NULL;
    const lm_config *cfg = &m->config;
    lm_arch_desc desc = {0};
    fwd_loader L = {0};
    lm_status s = lm_fwd_device_ok(d, err);
    if (s != LM_OK || (s = lm_fwd_check(m, a, err)) != LM_OK)
        return s;
    if ((s = lm_arch_describe(&desc, cfg, err)) != LM_OK)
        return s;

    lm_fwd *f = calloc(1, sizeof *f);
    L.f = f;
    L.m = m;
    L.a = a;
    if (!f || (a && (!(L.used_module = calloc((size_t)a->n_modules + 1, 1)) ||
                     !(L.used_saved = calloc((size_t)a->n_saved + 1, 1))))) {
        s = lm_err_set(err, LM_ERR_NOMEM, "out of memory");
        goto fail;
    }
    f->dev = d;
    f->hidden = cfg->hidden_size;
    f->inter = cfg->intermediate_size;
    f->n_layers = cfg->num_hidden_layers;
    f->heads = cfg->num_attention_heads;
    f->kv_heads = cfg->num_key_value_heads;
    f->head_dim = cfg->head_dim;
    f->vocab = cfg->vocab_size;
    f->eps = (float)cfg->rms_norm_eps;
    f->attn_scale = (float)(1.0 / sqrt((double)cfg->head_dim));
    // MistralAttention masks keys sliding_window or more positions back whenever it is set
    f->window = cfg->arch == LM_ARCH_MISTRAL ? cfg->sliding_window : 0;
    if (!(f->layers = calloc((size_t)f->n_layers, sizeof *f->layers))) {
        s = lm_err_set(err, LM_ERR_NOMEM, "out of memory");
        goto fail;
    }

    if ((s = put_embedding(&L, &desc, err)) != LM_OK)
        goto fail;
    static const lm_arch_slot slots[7] = {LM_SLOT_Q, LM_SLOT_K, LM_SLOT_V, LM_SLOT_O,
                                          LM_SLOT_GATE, LM_SLOT_UP, LM_SLOT_DOWN};
    for (int l = 0; l < f->n_layers; l++) {
        fwd_layer *y = &f->layers[l];
        fwd_linear *lins[7] = {&y->q, &y->k, &y->v, &y->o, &y->gate, &y->up, &y->down};
        for (int k = 0; k < 7; k++)
            if ((s = put_linear(&L, &desc, l, slots[k], lins[k], err)) != LM_OK)
                goto fail;
        if ((s = put_arch(&L, &desc, l, LM_SLOT_INPUT_NORM, false, true, &y->in_norm, err)) != LM_OK ||
            (s = put_arch(&L, &desc, l, LM_SLOT_POST_NORM, false, true, &y->post_norm, err)) != LM_OK)
            goto fail;
    }
    if ((s = put_arch(&L, &desc, -1, LM_SLOT_FINAL_NORM, false, true, &f->final_norm, err)) != LM_OK)
        goto fail;
    if (lm_arch_get(&desc, -1, LM_SLOT_LM_HEAD, false)) {
        if ((s = put_linear(&L, &desc, -1, LM_SLOT_LM_HEAD, &f->head, err)) != LM_OK)
            goto fail;
    } else {
        // Tied: lm_head is the embedding matrix; the base's even when modules_to_save
        // replaced the embedding (PEFT copies the module it saves, the tie stays on the original).
        f->head = (fwd_linear){.w = f->embed, .out = f->vocab, .in = f->hidden};
        const lm_arch_tensor *et = lm_arch_get(&desc, -1, LM_SLOT_EMBED, false);
        if (a && lm_adapter_lookup(a, et->name, NULL) == LM_TOUCH_SAVED &&
            (s = put_arch(&L, &desc, -1, LM_SLOT_EMBED, false, false, &f->head.w, err)) != LM_OK)
            goto fail;
    }
    if ((s = put_rope(f, cfg, err)) != LM_OK)
        goto fail;
    if (a && (s = check_adapter(a, L.used_module, L.used_saved, false, err)) != LM_OK)
        goto fail;

    free(L.used_module);
    free(L.used_saved);
    lm_arch_desc_free(&desc);
    *out = f;
    return LM_OK;

fail:
    free(L.used_module);
    free(L.used_saved);
    lm_arch_desc_free(&desc);
    lm_fwd_free(f);
    return s;
}

// ==== one batch ===============================================================================

static int64_t logit_rows(const lm_fwd *f, int64_t tokens)
{
    int64_t rows = LOGIT_FLOATS / (f->vocab > 0 ? f->vocab : 1);
    if (rows < 1)
        rows = 1;
    return rows < tokens ? rows : tokens;
}

// Lays the arena out for `tokens` tokens from `base` (NULL: only the size). Returns the bytes,
// or SIZE_MAX when they overflow.
static size_t arena_layout(const lm_fwd *f, int64_t tokens, char *base, fwd_arena *a)
{
    int64_t T = tokens, q = f->heads * f->head_dim, kv = f->kv_heads * f->head_dim;
    // (rows, cols) of 4-byte elements per region, in the order of fwd_arena
    const int64_t dims[][2] = {
        {T, f->hidden}, {T, f->hidden}, {T, q}, {T, kv}, {T, kv}, {T, q}, {T, f->inter}, {T, f->inter},
        {T, f->max_r}, {logit_rows(f, T), f->vocab}, {T, 1}, {4 * T, 1},
    };
    enum { N_REGIONS = sizeof dims / sizeof dims[0] };
    uint64_t off[N_REGIONS + 1] = {0};
    for (int i = 0; i < N_REGIONS; i++) {
        uint64_t n;
        if (dims[i][0] < 0 || dims[i][1] < 0 || !lm_mul_u64((uint64_t)dims[i][0], (uint64_t)dims[i][1], &n) ||
            !lm_mul_u64(n, 4, &n) || !lm_add_u64(n, ALIGN - 1, &n))
            return SIZE_MAX;
        n &= ~(uint64_t)(ALIGN - 1);
        if (!lm_add_u64(off[i], n, &off[i + 1]) || off[i + 1] >= SIZE_MAX)
            return SIZE_MAX;
    }
    if (base) {
        a->h = (float *)(void *)(base + off[0]);
        a->xn = (float *)(void *)(base + off[1]);
        a->q = (float *)(void *)(base + off[2]);
        a->k = (float *)(void *)(base + off[3]);
        a->v = (float *)(void *)(base + off[4]);
        a->att = (float *)(void *)(base + off[5]);
        a->gate = (float *)(void *)(base + off[6]);
        a->up = (float *)(void *)(base + off[7]);
        a->lora = (float *)(void *)(base + off[8]);
        a->logits = (float *)(void *)(base + off[9]);
        a->nll = (float *)(void *)(base + off[10]);
        a->ints = (int32_t *)(void *)(base + off[11]);
    }
    return (size_t)off[N_REGIONS];
}

size_t lm_fwd_arena_bytes(const lm_fwd *f, int64_t n_tokens)
{
    fwd_arena a;
    return arena_layout(f, n_tokens, NULL, &a);
}

// Makes the arena hold `tokens` tokens; on failure it is released.
static lm_status arena_reserve(lm_fwd *f, int64_t tokens, lm_err *err)
{
    if (f->arena && tokens <= f->arena_tokens)
        return LM_OK;
    lm_dev_release(f->dev, f->arena);
    f->arena = NULL;
    f->arena_tokens = 0;
    free(f->host_ints);
    f->host_ints = NULL;
    size_t bytes = lm_fwd_arena_bytes(f, tokens);
    if (bytes == SIZE_MAX)
        return lm_err_set(err, LM_ERR_UNSUPPORTED, "a batch of %" PRId64 " tokens is too large", tokens);
    if (!(f->host_ints = malloc((size_t)tokens * 4 * sizeof(int32_t))))
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory for a batch of %" PRId64 " tokens", tokens);
    lm_status s = lm_dev_alloc(f->dev, bytes, &f->arena, err);
    if (s != LM_OK) {
        free(f->host_ints);
        f->host_ints = NULL;
        return lm_err_prefix(err, "activations of a batch of %" PRId64 " tokens", tokens);
    }
    f->arena_tokens = tokens;
    return LM_OK;
}

// y = x Wᵀ + beta·y + b + scale·(x Aᵀ) Bᵀ for `rows` rows; tmp holds (rows, r).
static lm_status linear(lm_fwd *f, float *y, const float *x, int64_t rows, const fwd_linear *L, float beta,
                        float *tmp, lm_err *err)
{
    lm_dev *d = f->dev;
    lm_status s = lm_dev_gemm(d, false, true, rows, L->out, L->in, 1.0f, x, L->in, L->w, L->in, beta, y, L->out, err);
    if (s == LM_OK && L->b)
        s = lm_dev_add_rows(d, y, L->b, rows, L->out, err);
    if (s == LM_OK && L->a) {
        s = lm_dev_gemm(d, false, true, rows, L->r, L->in, 1.0f, x, L->in, L->a, L->in, 0.0f, tmp, L->r, err);
        if (s == LM_OK)
            s = lm_dev_gemm(d, false, true, rows, L->out, L->r, L->scale, tmp, L->r, L->bm, L->r, 1.0f, y, L->out,
                            err);
    }
    return s;
}

static lm_status hook(const lm_fwd_req *req, lm_fwd *f, int layer, lm_fwd_point p, const float *x, int64_t rows,
                      int64_t cols, lm_err *err)
{
    return req->hook ? req->hook(req->hook_ctx, f->dev, layer, p, x, rows, cols, err) : LM_OK;
}

// One layer on the T rows of the arena.
static lm_status run_layer(lm_fwd *f, const fwd_arena *a, int64_t T, int l, const lm_fwd_req *req, lm_err *err)
{
    lm_dev *d = f->dev;
    const fwd_layer *y = &f->layers[l];
    const int32_t *pos = a->ints + T, *start = a->ints + 2 * T;
    lm_status s;
#define DO(call)                                                                              \
    do {                                                                                      \
        if ((s = (call)) != LM_OK)                                                            \
            return s;                                                                         \
    } while (0)
    DO(lm_dev_rmsnorm(d, a->xn, a->h, y->in_norm, T, f->hidden, f->eps, err));
    DO(hook(req, f, l, LM_FWD_ATTN_IN, a->xn, T, f->hidden, err));
    DO(linear(f, a->q, a->xn, T, &y->q, 0.0f, a->lora, err));
    DO(linear(f, a->k, a->xn, T, &y->k, 0.0f, a->lora, err));
    DO(linear(f, a->v, a->xn, T, &y->v, 0.0f, a->lora, err));
    DO(lm_dev_rope(d, a->q, T, f->heads, f->head_dim, pos, f->inv_freq, err));
    DO(lm_dev_rope(d, a->k, T, f->kv_heads, f->head_dim, pos, f->inv_freq, err));
    DO(lm_dev_attention(d, a->att, a->q, a->k, a->v, start, T, f->heads, f->kv_heads, f->head_dim, f->attn_scale,
                        err));
    DO(hook(req, f, l, LM_FWD_O_IN, a->att, T, f->heads * f->head_dim, err));
    DO(linear(f, a->h, a->att, T, &y->o, 1.0f, a->lora, err));
    DO(lm_dev_rmsnorm(d, a->xn, a->h, y->post_norm, T, f->hidden, f->eps, err));
    DO(hook(req, f, l, LM_FWD_MLP_IN, a->xn, T, f->hidden, err));
    DO(linear(f, a->gate, a->xn, T, &y->gate, 0.0f, a->lora, err));
    DO(linear(f, a->up, a->xn, T, &y->up, 0.0f, a->lora, err));
    DO(lm_dev_silu_mul(d, a->gate, a->up, T * f->inter, err));
    DO(hook(req, f, l, LM_FWD_DOWN_IN, a->gate, T, f->inter, err));
    DO(linear(f, a->h, a->gate, T, &y->down, 1.0f, a->lora, err));
#undef DO
    return LM_OK;
}

// The batch's ids, positions, sequence starts and targets, staged in f->host_ints.
static lm_status stage_ints(lm_fwd *f, const lm_fwd_seq *seqs, int64_t n_seqs, int64_t T, lm_err *err)
{
    int32_t *ids = f->host_ints, *pos = ids + T, *start = ids + 2 * T, *tgt = ids + 3 * T;
    int64_t row = 0;
    for (int64_t i = 0; i < n_seqs; i++) {
        const lm_fwd_seq *q = &seqs[i];
        for (int64_t p = 0; p < q->len; p++, row++) {
            int32_t id = q->ids[p];
            if (id < 0 || id >= f->vocab)
                return lm_err_set(err, LM_ERR_FORMAT, "sequence %" PRId64 ", position %" PRId64 ": token id %" PRId32
                                  " is outside the vocabulary (vocab_size %" PRId64 ")", i + 1, p, id, f->vocab);
            ids[row] = id;
            pos[row] = (int32_t)p;
            // the first key row: the sequence's start, or the window's when that is later
            start[row] = (int32_t)(f->window > 0 && p >= f->window ? row - f->window + 1 : row - p);
            tgt[row] = p + 1 < q->len ? q->ids[p + 1] : -1;
        }
    }
    return LM_OK;
}

lm_status lm_fwd_run(lm_fwd *f, const lm_fwd_seq *seqs, int64_t n_seqs, const lm_fwd_req *req, lm_err *err)
{
    int64_t T = 0;
    for (int64_t i = 0; i < n_seqs; i++) {
        if (seqs[i].len < 1 || seqs[i].len > INT32_MAX - T)
            return lm_err_set(err, LM_ERR_USAGE, "sequence %" PRId64 " has %" PRId64 " tokens (at least 1, and a "
                              "batch below 2^31)", i + 1, seqs[i].len);
        T += seqs[i].len;
    }
    if (T == 0)
        return LM_OK;
    lm_dev *d = f->dev;
    lm_status s = arena_reserve(f, T, err);
    if (s != LM_OK)
        return s;
    fwd_arena a;
    arena_layout(f, T, f->arena, &a);
    if ((s = stage_ints(f, seqs, n_seqs, T, err)) != LM_OK ||
        (s = lm_dev_upload(d, a.ints, f->host_ints, (size_t)T * 4 * sizeof(int32_t), err)) != LM_OK)
        return s;

    // embeddings, with the embedding LoRA's s·Aᵀ[ids] Bᵀ
    if ((s = lm_dev_gather_rows(d, a.h, f->embed, f->vocab, f->hidden, a.ints, T, err)) != LM_OK)
        return s;
    if (f->emb_at &&
        ((s = lm_dev_gather_rows(d, a.lora, f->emb_at, f->vocab, f->emb_r, a.ints, T, err)) != LM_OK ||
         (s = lm_dev_gemm(d, false, true, T, f->hidden, f->emb_r, f->emb_scale, a.lora, f->emb_r, f->emb_b,
                          f->emb_r, 1.0f, a.h, f->hidden, err)) != LM_OK))
        return s;
    for (int l = 0; l < f->n_layers; l++)
        if ((s = run_layer(f, &a, T, l, req, err)) != LM_OK)
            return lm_err_prefix(err, "layer %d", l);
    if (!req->logits && !req->nll)
        return LM_OK;

    // the head, a chunk of rows at a time
    if ((s = lm_dev_rmsnorm(d, a.xn, a.h, f->final_norm, T, f->hidden, f->eps, err)) != LM_OK)
        return s;
    int64_t chunk = logit_rows(f, T);
    for (int64_t r0 = 0; r0 < T; r0 += chunk) {
        int64_t rows = T - r0 < chunk ? T - r0 : chunk;
        if ((s = linear(f, a.logits, a.xn + r0 * f->hidden, rows, &f->head, 0.0f, a.lora, err)) != LM_OK)
            return s;
        if (req->logits && (s = lm_dev_download(d, req->logits + r0 * f->vocab, a.logits,
                                                (size_t)(rows * f->vocab) * sizeof(float), err)) != LM_OK)
            return s;
        if (req->nll && (s = lm_dev_nll_rows(d, a.nll + r0, a.logits, a.ints + 3 * T + r0, rows, f->vocab, err)) != LM_OK)
            return s;
    }
    if (req->nll && (s = lm_dev_download(d, req->nll, a.nll, (size_t)T * sizeof(float), err)) != LM_OK)
        return s;
    return lm_dev_sync(d, err);
}

// ==== the runner ==============================================================================

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void say(lm_fwd_runner *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void say(lm_fwd_runner *r, const char *fmt, ...)
{
    if (!r->note)
        return;
    char line[LM_ERR_MSG_MAX + 256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    r->note(r->note_ctx, line);
}

// The model on the CPU, placed when first needed.
static lm_status cpu_fwd(lm_fwd_runner *r, lm_fwd **out, lm_err *err)
{
    lm_status s;
    if (!r->on_cpu) {
        if (!r->cpu && (s = lm_dev_cpu_create(&r->cpu, r->dev->threads, err)) != LM_OK)
            return s;
        if ((s = lm_fwd_create(&r->on_cpu, r->model, r->adapter, r->cpu, err)) != LM_OK)
            return s;
    }
    *out = r->on_cpu;
    return LM_OK;
}

lm_status lm_fwd_runner_init(lm_fwd_runner *r, const lm_model *m, const lm_adapter *a, lm_dev *dev,
                             const char *phase, const char *label, int64_t max_tokens, lm_fwd_note_fn note,
                             void *note_ctx, lm_err *err)
{
    memset(r, 0, sizeof *r);
    r->model = m;
    r->adapter = a;
    r->dev = dev;
    r->phase = phase;
    r->label = label;
    r->max_tokens = max_tokens > 0 ? max_tokens : DEFAULT_MAX_TOKENS;
    r->note = note;
    r->note_ctx = note_ctx;
    lm_err why = {0};
    lm_status s = lm_fwd_device_ok(dev, &why);
    if (s == LM_OK) {
        s = lm_fwd_create(&r->on_dev, m, a, dev, &why);
        if (s != LM_OK && s != LM_ERR_DEVICE_OOM) {
            *err = why;
            return s;
        }
    }
    if (s == LM_OK)
        return LM_OK;
    // the weights do not fit, or the device cannot run the forward pass: the model runs on the CPU
    double t0 = now_s();
    r->weights_fell_back = true;
    say(r, "fallback: %s weights of %s on cpu (%s)", phase, label, why.msg);
    lm_fwd *f;
    s = cpu_fwd(r, &f, err);
    r->fallback_s += now_s() - t0;
    if (s != LM_OK)
        lm_fwd_runner_free(r);
    return s;
}

void lm_fwd_runner_free(lm_fwd_runner *r)
{
    lm_fwd_free(r->on_dev);
    lm_fwd_free(r->on_cpu);
    lm_dev_free(r->cpu);
    r->on_dev = r->on_cpu = NULL;
    r->cpu = NULL;
}

// The requested host arrays, moved on by `rows` rows.
static lm_fwd_req req_at(const lm_fwd_req *req, int64_t rows, int64_t vocab)
{
    lm_fwd_req q = *req;
    if (q.logits)
        q.logits += rows * vocab;
    if (q.nll)
        q.nll += rows;
    return q;
}

static int64_t tokens_of(const lm_fwd_seq *seqs, int64_t n)
{
    int64_t t = 0;
    for (int64_t i = 0; i < n; i++)
        t += seqs[i].len;
    return t;
}

// Puts "PHASE sequences A-B on DEVICE: " (or "sequence A") before the message in err.
static lm_status unit_error(const lm_fwd_runner *r, int64_t first, int64_t n, const char *dev, lm_err *err)
{
    if (n == 1)
        return lm_err_prefix(err, "%s sequence %" PRId64 " on %s", r->phase, first + 1, dev);
    return lm_err_prefix(err, "%s sequences %" PRId64 "-%" PRId64 " on %s", r->phase, first + 1, first + n, dev);
}

// Runs seqs[0..n) (numbered from first + 1 in messages) on the device, halving on out of memory
// and sending a single sequence that does not fit to the CPU.
static lm_status run_batch(lm_fwd_runner *r, const lm_fwd_seq *seqs, int64_t n, int64_t first, const lm_fwd_req *req,
                           int64_t *done, lm_err *err)
{
    int64_t T = tokens_of(seqs, n);
    lm_status s;
    if (r->on_dev && !r->stuck) {
        double t0 = now_s();
        s = lm_fwd_run(r->on_dev, seqs, n, req, err);
        if (s == LM_OK) {
            r->n_batches++;
            r->tokens_dev += T;
            *done += n;
            if (r->progress)
                r->progress(r->progress_ctx, *done);
            return LM_OK;
        }
        r->fallback_s += now_s() - t0;
        if (s != LM_ERR_DEVICE_OOM)
            return unit_error(r, first, n, lm_dev_name(r->dev), err);
        if (n > 1) {
            int64_t h = n / 2;
            r->n_halved++;
            say(r, "fallback: %s sequences %" PRId64 "-%" PRId64 " (%" PRId64 " tokens) halved on %s (%s)", r->phase,
                first + 1, first + n, T, lm_dev_name(r->dev), err->msg);
            lm_fwd_req second = req_at(req, tokens_of(seqs, h), r->on_dev->vocab);
            if ((s = run_batch(r, seqs, h, first, req, done, err)) != LM_OK)
                return s;
            return run_batch(r, seqs + h, n - h, first + h, &second, done, err);
        }
        r->n_seq_cpu++;
        say(r, "fallback: %s sequence %" PRId64 " (%" PRId64 " tokens) on cpu (%s)", r->phase, first + 1, T,
            err->msg);
        if (r->sticky) {
            r->stuck = true;
            say(r, "fallback: %s: every later sequence runs on cpu too (--sticky-fallback)", r->phase);
        }
    }
    double t0 = now_s();
    lm_fwd *f;
    if ((s = cpu_fwd(r, &f, err)) != LM_OK)
        return s;
    if ((s = lm_fwd_run(f, seqs, n, req, err)) != LM_OK)
        return unit_error(r, first, n, "cpu", err);
    if (r->on_dev)
        r->fallback_s += now_s() - t0;
    r->n_batches++;
    r->tokens_cpu += T;
    *done += n;
    if (r->progress)
        r->progress(r->progress_ctx, *done);
    return LM_OK;
}

lm_status lm_fwd_runner_run(lm_fwd_runner *r, const lm_fwd_seq *seqs, int64_t n_seqs, const lm_fwd_req *req,
                            lm_err *err)
{
    lm_fwd *any = r->on_dev ? r->on_dev : r->on_cpu;
    int64_t done = 0, row = 0;
    for (int64_t i = 0; i < n_seqs;) {
        // as many sequences as fit in max_tokens, at least one
        int64_t k = 1, T = seqs[i].len;
        while (i + k < n_seqs && T + seqs[i + k].len <= r->max_tokens)
            T += seqs[i + k++].len;
        lm_fwd_req at = req_at(req, row, any->vocab);
        lm_status s = run_batch(r, seqs + i, k, i, &at, &done, err);
        if (s != LM_OK)
            return s;
        i += k;
        row += T;
    }
    return LM_OK;
}
