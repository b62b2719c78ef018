// A model's config.json, parsed into the numbers llmerge needs. LlamaForCausalLM,
// MistralForCausalLM and Qwen2ForCausalLM are known architectures: for them every dimension is
// required, validated (positive, heads dividing evenly) and the per-projection bias flags are
// derived as transformers derives them (Llama: attention_bias on q, k, v and o, mlp_bias on
// gate, up and down; Qwen2: q, k, v always biased, o never; Mistral: none). Any other
// architecture still parses: what is present is recorded and type-checked, the architecture is
// marked unknown, and merging (which works on whatever tensors a model has) goes on. Both the
// old key names (torch_dtype, top-level rope_theta/rope_scaling) and the new ones of recent
// transformers (dtype, rope_parameters) are read. The text goes through the one JSON reader
// (json.h). Errors are LM_ERR_FORMAT naming the file and the key: a wrong type, or a number
// beyond what the key takes ("key 'hidden_size': 9223372036854775808 is out of range (at most
// 9007199254740992)").
#ifndef LM_CONFIG_H
#define LM_CONFIG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "dtype.h"
#include "status.h"

typedef enum lm_arch {
    LM_ARCH_UNKNOWN = 0,
    LM_ARCH_LLAMA,    // LlamaForCausalLM
    LM_ARCH_MISTRAL,  // MistralForCausalLM
    LM_ARCH_QWEN2,    // Qwen2ForCausalLM
} lm_arch;

// How rotary frequencies are scaled (rope_scaling / rope_parameters "rope_type" or "type").
typedef enum lm_rope_kind {
    LM_ROPE_DEFAULT = 0,  // no scaling (absent, null, or rope_type "default")
    LM_ROPE_LINEAR,       // inv_freq / factor
    LM_ROPE_LLAMA3,       // Llama 3 frequency-dependent scaling (docs/formats.md "config.json")
    LM_ROPE_OTHER,        // recorded by name (dynamic, yarn, longrope, ...), not computed
} lm_rope_kind;

typedef struct lm_rope_scaling {
    lm_rope_kind kind;
    char *type;                    // the "rope_type" (or older "type") as written; NULL if none
    const char *type_key;          // the key it came from ("rope_scaling.rope_type", ...; a
                                   // static string), NULL if none
    double factor;                 // 0 when absent
    double low_freq_factor;        // llama3
    double high_freq_factor;       // llama3
    int64_t original_max_position_embeddings;  // llama3; 0 when absent
} lm_rope_scaling;

typedef struct lm_config {
    char *path;               // the file (or label) it came from, for messages
    char *architecture;       // architectures[0], or NULL
    char *model_type;         // or NULL
    lm_arch arch;

    // Dimensions; 0 where an unknown architecture's config does not give them.
    int64_t hidden_size;
    int64_t intermediate_size;
    int64_t num_hidden_layers;
    int64_t layer_count;          // the layers a gradient spreads over: num_hidden_layers, else
                                  // text_config's (a multimodal model); 0 where neither gives one
    int64_t num_attention_heads;
    int64_t num_key_value_heads;  // = num_attention_heads when null or absent
    int64_t head_dim;             // = hidden_size / num_attention_heads when null or absent
    bool head_dim_given;          // head_dim was a number in the file
    int64_t vocab_size;
    int64_t max_position_embeddings;  // the architecture's transformers default when absent

    double rms_norm_eps;      // default 1e-6
    double rope_theta;        // default 10000
    lm_rope_scaling rope_scaling;

    bool tie_word_embeddings;  // default false
    bool attention_bias;       // as written (default false)
    bool mlp_bias;             // as written (default false)
    // Derived per architecture: which projections carry a bias tensor.
    bool q_bias, k_bias, v_bias, o_bias;
    bool gate_bias, up_bias, down_bias;

    char *dtype_name;          // "dtype" or else "torch_dtype" as written, or NULL
    bool has_dtype;            // dtype_name is one llmerge computes with (lm_dtype_from_user)
    lm_dtype dtype;            // valid when has_dtype

    // Sliding-window attention: a token sees itself and the sliding_window − 1 tokens before
    // it. 0 when absent or null. Mistral applies it whenever it is set; Qwen2 only with
    // use_sliding_window (and then from layer max_window_layers on, which llmerge does not model).
    int64_t sliding_window;
    bool use_sliding_window;   // default false
} lm_config;

// Reads and parses the config.json at `path` into *cfg (which is overwritten; it need not be
// initialised). On success the caller frees it with lm_config_free; on failure *cfg holds
// nothing that needs freeing (lm_config_free is still safe) and err names the file and key.
lm_status lm_config_load(lm_config *cfg, const char *path, lm_err *err);

// Parses `len` bytes of JSON text; `label` names it in messages and is kept in cfg->path.
// Same ownership as lm_config_load.
lm_status lm_config_parse(lm_config *cfg, const char *json, size_t len, const char *label,
                          lm_err *err);

// Frees what the config owns and zeroes it. Safe on a zeroed or half-filled config.
void lm_config_free(lm_config *cfg);

// The architectures[0] name of a known architecture ("LlamaForCausalLM"), or "unknown".
const char *lm_arch_name(lm_arch arch);

// Checks that the rope scaling is one lm_config_rope_inv_freq computes (none, linear or
// llama3): LM_ERR_UNSUPPORTED naming the file and the key that gives its type otherwise (yarn,
// dynamic, longrope, ...). A model is checked with this when it is opened for a forward pass,
// before any work (lm_fwd_check).
lm_status lm_config_rope_check(const lm_config *cfg, lm_err *err);

// The rotary inverse frequencies, in double: inv_freq[i] = rope_theta^(-2i/head_dim) for
// i < head_dim/2, then scaled as rope_scaling says (linear: / factor; llama3: the formula in
// docs/formats.md "config.json"). Writes head_dim/2 values into `out` (the caller's array). Returns
// LM_ERR_UNSUPPORTED naming the rope type for kinds it does not compute, LM_ERR_FORMAT when
// head_dim is not a positive even number.
lm_status lm_config_rope_inv_freq(const lm_config *cfg, double *out /* (head_dim/2) */,
                                  lm_err *err);

#endif
