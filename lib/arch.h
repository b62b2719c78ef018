// The architecture description: from a config of a known architecture (Llama, Mistral, Qwen2),
// the tensors such a checkpoint must hold, with their shapes, in the order transformers'
// state_dict lists them: model.embed_tokens; then per layer the attention projections q, k, v,
// o (each weight followed by its bias when it has one), the MLP gate, up, down, then
// input_layernorm and post_attention_layernorm (the registration order of LlamaDecoderLayer:
// self_attn, mlp, input_layernorm, post_attention_layernorm); then model.norm and lm_head
// (absent when the embeddings are tied). Models are checked against it (lm_model_check) and
// the forward pass finds its weights through it; merging does not need it.
#ifndef LM_ARCH_H
#define LM_ARCH_H

#include <stdbool.h>
#include <stdint.h>

#include "config.h"
#include "status.h"

// What a tensor is, so later stages can treat kinds differently (no Hessian for norms and
// embeddings, for instance) without matching names.
typedef enum lm_tensor_role {
    LM_ROLE_EMBED,    // model.embed_tokens.weight
    LM_ROLE_LINEAR,   // a projection weight [out, in]
    LM_ROLE_BIAS,     // a projection bias [out]
    LM_ROLE_NORM,     // an RMSNorm weight [hidden]
    LM_ROLE_LM_HEAD,  // lm_head.weight
} lm_tensor_role;

// Which weight of a layer (or of the model) an entry is.
typedef enum lm_arch_slot {
    LM_SLOT_EMBED,
    LM_SLOT_Q, LM_SLOT_K, LM_SLOT_V, LM_SLOT_O,
    LM_SLOT_GATE, LM_SLOT_UP, LM_SLOT_DOWN,
    LM_SLOT_INPUT_NORM, LM_SLOT_POST_NORM,
    LM_SLOT_FINAL_NORM,
    LM_SLOT_LM_HEAD,
} lm_arch_slot;

typedef struct lm_arch_tensor {
    const char *name;      // e.g. "model.layers.3.self_attn.q_proj.weight"; owned by the desc
    lm_tensor_role role;
    lm_arch_slot slot;
    int layer;             // layer index, -1 outside the layers
    int ndim;              // 1 or 2
    int64_t shape[2];      // (ndim)
    int64_t numel;
} lm_arch_tensor;

typedef struct lm_arch_desc {
    lm_arch arch;
    lm_arch_tensor *tensors;  // (n_tensors) in state-dict order
    int64_t n_tensors;
    int64_t n_params;         // sum of numel; tied lm_head counted once (not at all)
    char *names;              // arena holding every name
} lm_arch_desc;

// Builds the description of `cfg`'s architecture into *out (overwritten). Returns
// LM_ERR_UNSUPPORTED naming the architecture when it is not a known one. On success the caller
// frees *out with lm_arch_desc_free; on failure nothing needs freeing.
lm_status lm_arch_describe(lm_arch_desc *out, const lm_config *cfg, lm_err *err);

// Frees and zeroes the description; safe on a zeroed one.
void lm_arch_desc_free(lm_arch_desc *d);

// The entry named `name`, or NULL (a linear search: descriptions are small).
const lm_arch_tensor *lm_arch_find(const lm_arch_desc *d, const char *name);

// The entry for (layer, slot), with want_bias selecting the bias of a projection; NULL when the
// architecture has no such tensor. layer is ignored for model-level slots.
const lm_arch_tensor *lm_arch_get(const lm_arch_desc *d, int layer, lm_arch_slot slot,
                                  bool want_bias);

// The parameter count of `cfg`'s architecture without building the list (0 when unknown).
int64_t lm_arch_param_count(const lm_config *cfg);

#endif
