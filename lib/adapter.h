// PEFT LoRA adapters: adapter_config.json and adapter_model.safetensors, read into modules
// that each say which base tensor they change and how. A module is one adapted layer
// ("model.layers.0.self_attn.v_proj"): its factors A [r, in] and B [out, r] (for an embedding
// A [r, vocab] and B [hidden, r]), optionally a bias delta [out] (lora_bias) and a DoRA
// magnitude [out], with its own r, alpha and scale from rank_pattern / alpha_pattern (first key
// in file order whose regex `(.*\.)?(K)$` matches the module path) and use_rslora. Full tensors
// saved through modules_to_save replace base tensors whole. Keys map to base names by dropping
// "base_model.model." and the LoRA suffix (docs/formats.md "Adapter keys"). Nothing is
// expanded: the factors stay views into the mapped file, and a delta is computed only when its
// tensor is merged.
//
// Which modules of a base get LoRA is decided as PEFT decides it when it loads the adapter
// (lm_adapter_select): target_modules, exclude_modules, modules_to_save, layers_to_transform and
// layers_pattern; the factors of any other module are set aside, not used. The config's
// regexes are Python `re` patterns, matched with PCRE2 in UTF and Unicode-property mode under
// a match, depth and heap limit, so a pattern that would run away is an error naming the file,
// the key and the pattern instead.
//
// This module also decides what kind of input a command-line path is (lm_input_detect).
#ifndef LM_ADAPTER_H
#define LM_ADAPTER_H

#include <stdbool.h>
#include <stdint.h>

#include "model.h"
#include "safetensors.h"
#include "status.h"
#include "util.h"

// ==== adapter_config.json =====================================================================

typedef enum lm_lora_targets {
    LM_LORA_TARGETS_NONE = 0,    // target_modules absent or null
    LM_LORA_TARGETS_LIST,        // names matched as PEFT does: equal, or a ".NAME" suffix
    LM_LORA_TARGETS_REGEX,       // a regex string, full match
    LM_LORA_TARGETS_ALL_LINEAR,  // "all-linear": every linear layer but the output layer
} lm_lora_targets;

// A compiled regex of adapter_config.json with the key it came from (adapter.c).
typedef struct lm_lora_re lm_lora_re;

// Limits on those regexes: a pattern longer than LM_LORA_RE_MAX_LEN bytes is refused; one match
// may take LM_LORA_RE_MATCH_LIMIT backtracking steps, LM_LORA_RE_DEPTH_LIMIT nested
// backtracking frames and LM_LORA_RE_HEAP_KIB KiB of backtracking memory.
#define LM_LORA_RE_MAX_LEN 4096
#define LM_LORA_RE_MATCH_LIMIT 100000
#define LM_LORA_RE_DEPTH_LIMIT 10000
#define LM_LORA_RE_HEAP_KIB 8192

// One rank_pattern or alpha_pattern entry, compiled as PEFT writes it: `(.*\.)?(KEY)$`,
// matched from the start of the module path.
typedef struct lm_lora_pattern {
    char *key;       // as written
    lm_lora_re *re;  // or NULL
    int64_t r;       // rank_pattern value
    double alpha;    // alpha_pattern value
} lm_lora_pattern;

typedef struct lm_lora_config {
    char *path;                      // the file, for messages
    char *peft_type;                 // always "LORA" once parsed
    int64_t r;                       // default 8 (PEFT's)
    double lora_alpha;               // default 8 (PEFT's)
    lm_lora_targets targets;
    char **target_modules;           // (n_target_modules) for LM_LORA_TARGETS_LIST
    int64_t n_target_modules;
    char *target_regex;              // as written, for LM_LORA_TARGETS_REGEX
    lm_lora_re *target_re;           // target_regex, a full match
    const char *targets_default_for; // the base's model_type whose PEFT default filled a null
                                     // target_modules (lm_adapter_select), or NULL
    char **exclude_modules;          // (n_exclude_modules) names, as target_modules' list
    int64_t n_exclude_modules;
    char *exclude_regex;             // exclude_modules given as a regex string, or NULL
    lm_lora_re *exclude_re;          // exclude_regex, a full match
    bool use_rslora, use_dora, fan_in_fan_out, lora_bias;
    bool ensure_weight_tying;        // a tied lm_head takes embed_tokens' adapter (PEFT 0.18+)
    lm_lora_pattern *rank_pattern;   // (n_rank_pattern) in file order
    int64_t n_rank_pattern;
    lm_lora_pattern *alpha_pattern;  // (n_alpha_pattern) in file order
    int64_t n_alpha_pattern;
    char **modules_to_save;          // (n_modules_to_save)
    int64_t n_modules_to_save;
    lm_lora_re **saved_re;           // (n_modules_to_save) `(^|.*\.)NAME($|\..*)`: no LoRA there
    bool has_layers_to_transform;    // given and not null (an empty list selects every layer)
    int64_t *layers_to_transform;    // (n_layers_to_transform); none means every layer
    int64_t n_layers_to_transform;
    char **layers_pattern;           // (n_layers_pattern) names of the layer list, or none
    int64_t n_layers_pattern;
    lm_lora_re **layer_re;           // (n_layer_re) `.*?\.P\.(\d+)\.` per layers_pattern P, or
    int64_t n_layer_re;              // PEFT's default `.*?\.[^.]*\.(\d+)\.`; none without layers
    char *base_model_name_or_path;   // or NULL
} lm_lora_config;

// Reads and parses adapter_config.json at `path` into *cfg (overwritten). peft_type other
// than "LORA", or target_parameters, is LM_ERR_UNSUPPORTED naming it; wrong types, a bad r,
// keys PEFT refuses together (layers_to_transform or layers_pattern with a target_modules
// string, layers_pattern without layers_to_transform), or a regex that does not compile (or is
// longer than LM_LORA_RE_MAX_LEN) are LM_ERR_FORMAT naming the file, the key and the pattern.
// Unknown fields are ignored. On success free with lm_lora_config_free; on failure nothing
// needs freeing.
lm_status lm_lora_config_load(lm_lora_config *cfg, const char *path, lm_err *err);

// The same from `len` bytes of JSON text; `label` names it in messages.
lm_status lm_lora_config_parse(lm_lora_config *cfg, const char *json, size_t len,
                               const char *label, lm_err *err);

// Frees and zeroes; safe on a zeroed or half-filled config.
void lm_lora_config_free(lm_lora_config *cfg);

// The r and alpha of module `path` (e.g. "model.layers.0.self_attn.v_proj"): the first
// rank_pattern / alpha_pattern key in file order whose regex matches, else r / lora_alpha.
// *r_key / *alpha_key (either may be NULL) get the matching key or NULL. LM_ERR_FORMAT naming
// the file, the key and the pattern when a pattern runs past its limits on `path`.
lm_status lm_lora_config_rank(const lm_lora_config *cfg, const char *path, int64_t *r,
                              double *alpha, const char **r_key, const char **alpha_key,
                              lm_err *err);

// The scale of a module with rank r and alpha: alpha / r, or alpha / sqrt(r) with use_rslora.
double lm_lora_config_scale(const lm_lora_config *cfg, int64_t r, double alpha);

// Why PEFT would or would not put LoRA on a module.
typedef enum lm_lora_select {
    LM_LORA_SELECTED = 0,
    LM_LORA_NOT_TARGETED,  // target_modules does not name it
    LM_LORA_EXCLUDED,      // exclude_modules names it
    LM_LORA_SAVED_MODULE,  // it is, or is inside, a modules_to_save module
    LM_LORA_OTHER_LAYER,   // its layer index is not in layers_to_transform
    LM_LORA_NO_LAYER,      // layers_to_transform is given and its path has no layer index
    LM_LORA_NOT_LINEAR,    // target_modules is "all-linear" and it is not a linear layer
    LM_LORA_TIED,          // the base's lm_head, tied to embed_tokens (ensure_weight_tying),
                           // its keys embed_tokens' own (the tied tensor takes the embedding's)
} lm_lora_select;

// Whether the config selects module `path` of a base model as PEFT's check_target_module_exists
// decides it: exclude_modules (a list: the name or a ".NAME" suffix; a string: a full-match
// regex) and modules_to_save leave a module out first; then target_modules as a list selects
// the name or a ".NAME" suffix, a string is a full-match regex, "all-linear" every module but
// the output layer (lm_head; the caller knows which modules are linear); then, for a list
// match by suffix only, layers_to_transform keeps the modules whose layer index (the first
// number after layers_pattern, or after any component, in the path) it lists. With
// target_modules null (not yet resolved by lm_adapter_select) every module is selected.
// *why gets LM_LORA_SELECTED or the reason; *layer (may be NULL) the layer index that
// layers_to_transform looked at, or -1. LM_ERR_FORMAT naming the file, the key and the pattern
// when a regex runs past its limits on `path` (or a layers_pattern group is not a number).
lm_status lm_lora_config_select(const lm_lora_config *cfg, const char *path, lm_lora_select *why,
                                int64_t *layer, lm_err *err);

// What `why` says, as a clause ("target_modules does not select it"; static). The layer index
// of LM_LORA_OTHER_LAYER is not in it (lm_adapter_ignored_msg says it).
const char *lm_lora_select_reason(lm_lora_select why);

// ==== the adapter =============================================================================

typedef enum lm_lora_kind {
    LM_LORA_LINEAR,     // lora_A.weight / lora_B.weight
    LM_LORA_EMBEDDING,  // lora_embedding_A / lora_embedding_B
} lm_lora_kind;

typedef struct lm_lora_module {
    char *path;                     // "model.layers.0.self_attn.v_proj"
    char *base_name;                // the base weight it changes: path + ".weight"
    char *bias_name;                // path + ".bias" when it has lora_B.bias, else NULL
    lm_lora_kind kind;
    int64_t r;                      // from rank_pattern or r
    double alpha;                   // from alpha_pattern or lora_alpha
    double scale;                   // alpha / r, or alpha / sqrt(r) with use_rslora
    const char *r_key, *alpha_key;  // the pattern keys that gave r and alpha, or NULL
    const lm_st_tensor *a;          // linear [r, in]; embedding [r, vocab]
    const lm_st_tensor *b;          // linear [out, r]; embedding [hidden, r]
    const lm_st_tensor *bias;       // [out] lora_B.bias, or NULL
    const lm_st_tensor *magnitude;  // [out] DoRA lora_magnitude_vector, or NULL
} lm_lora_module;

// A full tensor saved through modules_to_save: it replaces the base tensor.
typedef struct lm_lora_saved {
    char *base_name;                // e.g. "lm_head.weight"
    const lm_st_tensor *t;          // same shape as the base tensor
} lm_lora_saved;

// A module whose keys are in the file but that PEFT would not put LoRA on (lm_adapter_select):
// its keys are not used.
typedef struct lm_lora_ignored {
    char *path;                    // the module, e.g. "model.layers.0.self_attn.k_proj"
    lm_lora_select why;
    int64_t layer;                 // the layer index layers_to_transform looked at, or -1
    const lm_st_tensor *keys[4];   // its tensors: A, B, bias, magnitude (NULL where absent)
} lm_lora_ignored;

typedef struct lm_adapter {
    char *dir;                 // as given to lm_adapter_open
    char *weights_path;        // dir/adapter_model.safetensors
    lm_lora_config config;
    lm_st_file *st;
    lm_lora_module *modules;   // (n_modules) in the order their first key appears in the file
    int64_t n_modules;
    lm_lora_saved *saved;      // (n_saved)
    int64_t n_saved;
    lm_lora_ignored *ignored;  // (n_ignored) set aside by lm_adapter_select, in file order
    int64_t n_ignored;
    bool selected;             // lm_adapter_select has run
    lm_strmap by_target;       // base tensor name -> lookup code (see lm_adapter_lookup)
} lm_adapter;

// Opens the adapter directory `dir`: adapter_config.json and adapter_model.safetensors (mmapped),
// keys grouped into modules, factor shapes checked against r. On success *out is a new adapter
// the caller frees with lm_adapter_free; on failure *out is NULL and err names the file and key.
// adapter_model.bin without safetensors is LM_ERR_UNSUPPORTED saying to convert it.
lm_status lm_adapter_open(lm_adapter **out, const char *dir, lm_err *err);

// Unmaps and frees everything; safe on NULL and on a half-built adapter.
void lm_adapter_free(lm_adapter *a);

// Applies the config's targeting as PEFT does when it loads the adapter onto `base`: a null
// target_modules becomes PEFT's default for the base's model_type (LM_ERR_FORMAT when PEFT has
// none), then each module goes through lm_lora_config_select ("all-linear" also leaves out
// embeddings and base weights that are not 2-D). Modules PEFT would not put LoRA on move from
// modules to ignored and no longer change any base tensor. A target_modules that selects no
// 2-D weight of the base is LM_ERR_FORMAT naming adapter_config.json and the key (PEFT refuses
// such an adapter), as is a regex that runs past its limits. With base NULL only what the
// config decides alone is applied (a null target_modules keeps every module, and nothing is
// checked against a base). Call it once, after lm_adapter_open and before
// lm_adapter_validate; later calls do nothing. On failure the adapter is as opened.
lm_status lm_adapter_select(lm_adapter *a, const lm_model *base, lm_err *err);

// Writes into buf (cap bytes) why ignored[i]'s keys are not used: "keys 'A', 'B' are not
// VERB, as PEFT would not load them: module M: REASON" (VERB: "merged", "applied", ...).
void lm_adapter_ignored_msg(const lm_adapter *a, int64_t i, const char *verb, char *buf, size_t cap);

// Checks the adapter against base model `base`: every base tensor it names exists and every
// shape fits (linear A [r, in], B [out, r] against base [out, in], transposed base with
// fan_in_fan_out; embedding A [r, vocab], B [hidden, r] against base [vocab, hidden]; magnitude
// and bias [out], a bias needing a base bias; saved tensors the base's shape), and the factors,
// saved tensors and the base tensors they change have a dtype llmerge computes with. The first
// problem is LM_ERR_MISMATCH naming the adapter key, the base tensor and both shapes
// (LM_ERR_UNSUPPORTED naming the key, the tensor and its dtype for a dtype).
lm_status lm_adapter_validate(const lm_adapter *a, const lm_model *base, lm_err *err);

typedef enum lm_adapter_touch {
    LM_TOUCH_NONE = 0,  // the adapter leaves the tensor alone
    LM_TOUCH_LORA,      // the weight of modules[*index]
    LM_TOUCH_BIAS,      // the bias of modules[*index] (lora_B.bias)
    LM_TOUCH_SAVED,     // replaced by saved[*index]
} lm_adapter_touch;

// What the adapter does to base tensor `name`; *index (may be NULL) gets the module or saved
// entry.
lm_adapter_touch lm_adapter_lookup(const lm_adapter *a, const char *name, int64_t *index);

// ==== what a path is ==========================================================================

typedef enum lm_input_kind {
    LM_INPUT_SAFETENSORS = 1,  // one .safetensors file
    LM_INPUT_MODEL,            // config.json + model.safetensors or the index
    LM_INPUT_ADAPTER,          // adapter_config.json (+ adapter_model.*)
} lm_input_kind;

// Decides what `path` is: a .safetensors file, a model directory or an adapter directory, also
// when a directory holds exactly one subdirectory that is one of those (a common layout of
// downloads). adapter_config.json wins over config.json (some trainers save both). A path to
// a directory's config.json, adapter_config.json or model.safetensors.index.json stands for
// that directory. A `path` that does not exist on disk is looked up in the Hugging Face cache
// as a Hub id, ORG/NAME[@REVISION] (lm_hf_resolve, hfcache.h), and its snapshot directory is
// detected as above. *resolved gets a new string, the path to use (the subdirectory in the nested
// case, the directory for a description file, the snapshot); caller frees. Returns
// LM_ERR_NOT_FOUND for a missing path, a model the cache does not hold or a directory that is
// none of these, with a message saying what was expected (or where it looked);
// LM_ERR_FORMAT for a file that is not .safetensors (LM_ERR_UNSUPPORTED for a torch pickle).
lm_status lm_input_detect(const char *path, lm_input_kind *kind, char **resolved, lm_err *err);

// "safetensors file", "model directory" or "adapter directory" (static).
const char *lm_input_kind_name(lm_input_kind kind);

#endif
