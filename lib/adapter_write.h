// Writing a PEFT LoRA adapter: adapter_config.json and adapter_model.safetensors laid out as
// PEFT's save_pretrained writes them and as PEFT, vLLM and llmerge (adapter.h) load them. The
// caller adds each module's factors as it makes them; the writer keeps them (in the adapter's
// dtype) until lm_adapter_out_write writes the directory.
//
// Keys (after `base_model.model.`): a linear module M gets `M.lora_A.weight` [r, in] and
// `M.lora_B.weight` [out, r] (and `M.lora_B.bias` [out] where its bias changes: lora_bias), an
// embedding `M.lora_embedding_A` [r, vocab] and `M.lora_embedding_B` [hidden, r], a module
// saved whole (modules_to_save) every one of its tensors, `M.weight` and `M.bias` (PEFT loads
// a saved module as a whole copy: those that did not change are written with the base's
// values). The config: r and lora_alpha the default rank (so that every module's scale alpha/r
// is 1), rank_pattern and alpha_pattern for the modules of another rank (their full paths, both
// the module's rank), target_modules the modules' last names where every module of that name in
// the base has factors, else their full paths ("dummy-target-modules", PEFT's name for none,
// where no module has factors), modules_to_save likewise, use_rslora, use_dora and
// fan_in_fan_out false, ensure_weight_tying true where the base ties lm_head to embed_tokens and
// the adapter changes it (so that PEFT adapts the output layer with it; lm_head's tensors are
// written too, as PEFT saves them: the whole embedding's copy, or its factors transposed).
//
// lora_bias is one setting for the whole adapter, and PEFT refuses an Embedding layer under it:
// where a bias changes, an embedding with factors is written whole instead (modules_to_save,
// BASE plus the factors' product, which is what PEFT would have added).
#ifndef LM_ADAPTER_WRITE_H
#define LM_ADAPTER_WRITE_H

#include <stdbool.h>
#include <stdint.h>

#include "dtype.h"
#include "model.h"
#include "status.h"

typedef struct lm_adapter_out lm_adapter_out;

// A writer whose tensors are stored in `dtype` (F32, F16 or BF16), for an adapter of `base`
// (whose module names decide target_modules' form); base_name is written as
// base_model_name_or_path. Free with lm_adapter_out_free.
lm_status lm_adapter_out_new(lm_adapter_out **out, const lm_model *base, const char *base_name, lm_dtype dtype,
                             lm_err *err);
void lm_adapter_out_free(lm_adapter_out *w);

// Module `module` ("model.layers.0.self_attn.q_proj") changes its weight [rows, cols] by B·A:
// b [rows, r] and a [r, cols] row-major float32 (copied). An embedding (embedding: the weight is
// [vocab, hidden]) is written as lora_embedding_A = bᵀ [r, vocab] and lora_embedding_B = aᵀ
// [hidden, r], so that PEFT's (B·A)ᵀ is the same b·a.
lm_status lm_adapter_out_lora(lm_adapter_out *w, const char *module, bool embedding, int64_t rows, int64_t cols,
                              int r, const float *b, const float *a, lm_err *err);

// Module `module`'s bias changes by `delta` [n] (float32, copied): lora_B.bias, lora_bias on.
lm_status lm_adapter_out_bias(lm_adapter_out *w, const char *module, int64_t n, const float *delta, lm_err *err);

// Base tensor `tensor` ("model.norm.weight") is replaced whole by `values` (float32, copied,
// with the tensor's shape): its module goes into modules_to_save.
lm_status lm_adapter_out_saved(lm_adapter_out *w, const char *tensor, int ndim, const int64_t *shape,
                               const float *values, lm_err *err);

// Writes adapter_config.json and adapter_model.safetensors into the existing directory `dir`
// (each through a temporary file renamed into place), `rank` the default r. Modules whose rank
// differs from it go into rank_pattern and alpha_pattern. LM_ERR_USAGE where nothing was added.
lm_status lm_adapter_out_write(lm_adapter_out *w, const char *dir, int rank, lm_err *err);

// Modules with factors, saved tensors and bias deltas added so far.
int64_t lm_adapter_out_count(const lm_adapter_out *w);

// After lm_adapter_out_write: where lora_bias is on, the first module with factors whose base
// layer has no bias (PEFT applies such an adapter, but its merge_and_unload refuses the layer);
// else NULL.
const char *lm_adapter_out_biasless(const lm_adapter_out *w);

// After lm_adapter_out_write: whether module `module` is written whole (modules_to_save).
bool lm_adapter_out_is_whole(const lm_adapter_out *w, const char *module);

// Whether base tensor `tensor` (a ".weight") is an embedding, which PEFT adapts with
// lora_embedding_A/B: by the architecture's description where it lists the tensor, else by its
// module's last name (embed_tokens, wte, wpe, word_embeddings, ...).
bool lm_adapter_embedding(const lm_model *base, const char *tensor);
// The same for the writer's base, from its description made once (for a call per tensor).
bool lm_adapter_out_embedding(const lm_adapter_out *w, const char *tensor);

#endif
