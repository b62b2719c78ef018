// The architecture description: see arch.h. Llama, Mistral and Qwen2 share one layout and
// differ only in which projections carry biases, which lm_config already derived, so one
// builder serves all three.
#include "arch.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "util.h"

#define ARCH_NAME_MAX 96          // longest name is "model.layers.N.post_attention_layernorm.weight"
#define ARCH_MAX_LAYERS 10000     // far beyond any model; keeps sizes from a bad config sane

typedef struct arch_build {
    lm_arch_desc *d;
    size_t names_used;
    bool overflow;  // an element count did not fit in 64 bits
} arch_build;

static void add(arch_build *b, lm_tensor_role role, lm_arch_slot slot, int layer, int64_t d0,
                int64_t d1, const char *fmt, ...) __attribute__((format(printf, 7, 8)));

// Appends one entry; d1 < 0 makes it one-dimensional.
static void add(arch_build *b, lm_tensor_role role, lm_arch_slot slot, int layer, int64_t d0,
                int64_t d1, const char *fmt, ...)
{
    lm_arch_desc *d = b->d;
    lm_arch_tensor *t = &d->tensors[d->n_tensors++];
    char *name = d->names + b->names_used;
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(name, ARCH_NAME_MAX, fmt, ap);
    va_end(ap);
    b->names_used += (size_t)n + 1;
    t->name = name;
    t->role = role;
    t->slot = slot;
    t->layer = layer;
    t->ndim = d1 < 0 ? 1 : 2;
    t->shape[0] = d0;
    t->shape[1] = d1 < 0 ? 0 : d1;
    uint64_t numel = (uint64_t)d0, total;
    if (d1 >= 0 && !lm_mul_u64(numel, (uint64_t)d1, &numel))
        b->overflow = true;
    t->numel = (int64_t)numel;
    if (numel > INT64_MAX || !lm_add_u64((uint64_t)d->n_params, numel, &total) || total > INT64_MAX)
        b->overflow = true;
    else
        d->n_params = (int64_t)total;
}

// A projection: its weight [out, in], then its bias [out] when it has one.
static void add_linear(arch_build *b, lm_arch_slot slot, int layer, const char *module,
                       int64_t out, int64_t in, bool bias)
{
    add(b, LM_ROLE_LINEAR, slot, layer, out, in, "model.layers.%d.%s.weight", layer, module);
    if (bias)
        add(b, LM_ROLE_BIAS, slot, layer, out, -1, "model.layers.%d.%s.bias", layer, module);
}

lm_status lm_arch_describe(lm_arch_desc *out, const lm_config *cfg, lm_err *err)
{
    memset(out, 0, sizeof *out);
    const char *label = cfg->path ? cfg->path : "config";
    if (cfg->arch == LM_ARCH_UNKNOWN)
        return lm_err_set(err, LM_ERR_UNSUPPORTED,
                          "%s: architecture '%s' is not one llmerge describes "
                          "(LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM)",
                          label, cfg->architecture ? cfg->architecture
                                 : cfg->model_type ? cfg->model_type : "(none given)");
    if (cfg->num_hidden_layers > ARCH_MAX_LAYERS)
        return lm_err_set(err, LM_ERR_FORMAT, "%s: num_hidden_layers %lld is more than %d", label,
                          (long long)cfg->num_hidden_layers, ARCH_MAX_LAYERS);

    const int layers = (int)cfg->num_hidden_layers;
    const int64_t H = cfg->hidden_size, I = cfg->intermediate_size, V = cfg->vocab_size;
    const int64_t q_out = cfg->num_attention_heads * cfg->head_dim;
    const int64_t kv_out = cfg->num_key_value_heads * cfg->head_dim;
    const int64_t cap = 3 + (int64_t)layers * 16;  // per layer at most 7 weights, 7 biases, 2 norms

    out->arch = cfg->arch;
    out->tensors = calloc((size_t)cap + 1, sizeof *out->tensors);
    out->names = malloc(((size_t)cap + 1) * ARCH_NAME_MAX);
    if (!out->tensors || !out->names) {
        lm_arch_desc_free(out);
        return lm_err_set(err, LM_ERR_NOMEM, "%s: out of memory describing %d layers", label, layers);
    }

    arch_build b = {.d = out};
    add(&b, LM_ROLE_EMBED, LM_SLOT_EMBED, -1, V, H, "model.embed_tokens.weight");
    for (int l = 0; l < layers; l++) {
        add_linear(&b, LM_SLOT_Q, l, "self_attn.q_proj", q_out, H, cfg->q_bias);
        add_linear(&b, LM_SLOT_K, l, "self_attn.k_proj", kv_out, H, cfg->k_bias);
        add_linear(&b, LM_SLOT_V, l, "self_attn.v_proj", kv_out, H, cfg->v_bias);
        add_linear(&b, LM_SLOT_O, l, "self_attn.o_proj", H, q_out, cfg->o_bias);
        add_linear(&b, LM_SLOT_GATE, l, "mlp.gate_proj", I, H, cfg->gate_bias);
        add_linear(&b, LM_SLOT_UP, l, "mlp.up_proj", I, H, cfg->up_bias);
        add_linear(&b, LM_SLOT_DOWN, l, "mlp.down_proj", H, I, cfg->down_bias);
        add(&b, LM_ROLE_NORM, LM_SLOT_INPUT_NORM, l, H, -1, "model.layers.%d.input_layernorm.weight", l);
        add(&b, LM_ROLE_NORM, LM_SLOT_POST_NORM, l, H, -1,
            "model.layers.%d.post_attention_layernorm.weight", l);
    }
    add(&b, LM_ROLE_NORM, LM_SLOT_FINAL_NORM, -1, H, -1, "model.norm.weight");
    if (!cfg->tie_word_embeddings)
        add(&b, LM_ROLE_LM_HEAD, LM_SLOT_LM_HEAD, -1, V, H, "lm_head.weight");

    if (b.overflow) {
        lm_arch_desc_free(out);
        return lm_err_set(err, LM_ERR_FORMAT, "%s: the dimensions give more than 2^63 parameters",
                          label);
    }
    return LM_OK;
}

void lm_arch_desc_free(lm_arch_desc *d)
{
    if (!d)
        return;
    free(d->tensors);
    free(d->names);
    memset(d, 0, sizeof *d);
}

const lm_arch_tensor *lm_arch_find(const lm_arch_desc *d, const char *name)
{
    for (int64_t i = 0; i < d->n_tensors; i++)
        if (strcmp(d->tensors[i].name, name) == 0)
            return &d->tensors[i];
    return NULL;
}

const lm_arch_tensor *lm_arch_get(const lm_arch_desc *d, int layer, lm_arch_slot slot,
                                  bool want_bias)
{
    bool model_level = slot == LM_SLOT_EMBED || slot == LM_SLOT_FINAL_NORM || slot == LM_SLOT_LM_HEAD;
    for (int64_t i = 0; i < d->n_tensors; i++) {
        const lm_arch_tensor *t = &d->tensors[i];
        if (t->slot == slot && (model_level || t->layer == layer) &&
            (t->role == LM_ROLE_BIAS) == want_bias)
            return t;
    }
    return NULL;
}

int64_t lm_arch_param_count(const lm_config *cfg)
{
    lm_arch_desc d;
    if (lm_arch_describe(&d, cfg, NULL) != LM_OK)
        return 0;
    int64_t n = d.n_params;
    lm_arch_desc_free(&d);
    return n;
}
