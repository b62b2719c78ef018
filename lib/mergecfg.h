// mergekit's merge configuration files (YAML), read into a structure with the line and column
// of every part, so that whatever uses it can name where a value came from. The reader takes
// libyaml's parser events (not its document loader) under limits: a file of at most 4 MiB,
// nesting at most 32 deep, at most 100,000 nodes, strings of at most 64 KiB.
//
// What it accepts (docs/formats.md "Merge configuration files" says it for users):
//
//   - one YAML document whose top level is a mapping with the keys merge_method (a string,
//     required), base_model, models, slices, parameters, dtype, out_dtype, tokenizer_source,
//     chat_template (strings), tokenizer (a mapping whose source, a string, is read as
//     tokenizer_source; not both keys) and random_seed (a whole number from 0 to 2^64 - 1);
//     exactly one of models and slices;
//   - models: a list of mappings with model (a string, required) and parameters;
//   - slices: a list of mappings with sources, a list of mappings with model, layer_range
//     ([FROM, TO], whole numbers, 0 <= FROM < TO) and parameters;
//   - parameters: a mapping from names to settings (params.h): a number, true or false, a
//     string, a list of numbers (a gradient, at least one, each number's place kept), or a list
//     of {filter, value} mappings (value a number, bool, string or gradient; filter a string,
//     optional); one such mapping not in a list is refused (mergekit fails on it). The reader
//     does not know which names a method takes: it records every one;
//   - a key whose value is null (~, null, or nothing) counts as absent where the key is
//     optional.
//
// Plain scalars are typed as in YAML 1.1 with these differences: only true/false (any case as
// YAML writes them: true, True, TRUE) are bools, yes/no/on/off are strings; 1e-3 and 1E5 are
// numbers (PyYAML reads them as strings); the YAML 1.1 numbers llmerge does not read (a
// leading 0, 0x, 0b, '_' separators, base 60) and .inf/.nan are errors. Quoted and block
// scalars are strings. Refused, each with FILE:LINE:COLUMN: a YAML syntax error (with
// libyaml's text), a key not in the lists above (with the closest known key when one is
// close), a key given twice, a value of the wrong type (naming the key and the type needed),
// anchors and aliases, tags (!!str ...), a second document, a string holding a NUL character,
// and the limits above. mergekit's modules, a slice's parameters, base_model and
// residual_weight, tokenizer_source: union, and tokenizer's tokens, pad_to_multiple_of and a
// source of union or none (mergekit's default is union) are LM_ERR_UNSUPPORTED; every other
// defect is LM_ERR_FORMAT (both are exit status 2); LM_ERR_NOMEM and, for lm_mergecfg_load, the
// errors of reading the file otherwise.
#ifndef LM_MERGECFG_H
#define LM_MERGECFG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "params.h"
#include "status.h"

#define LM_MERGECFG_MAX_BYTES (4u << 20)
#define LM_MERGECFG_MAX_DEPTH 32
#define LM_MERGECFG_MAX_NODES 100000
#define LM_MERGECFG_MAX_STRING (64u << 10)

typedef struct lm_cfg_model {  // one item of `models:` (or of a slice's `sources:`)
    char *model;               // the `model:` string as written (PATH, PATH+LORA, ORG/NAME...)
    lm_params params;          // its `parameters:` (n = 0 when absent)
    int64_t layer_range[2];    // slices only: [from, to); both -1 in `models:`
    int line, col;             // of the `model:` value
} lm_cfg_model;

typedef struct lm_cfg_slice {
    lm_cfg_model *sources;     // (n_sources) at least one
    int n_sources;
    int line, col;             // of the slice's mapping
} lm_cfg_slice;

typedef struct lm_mergecfg {
    char *path;                // the file
    char *text;                // the file's bytes, NUL-terminated (written back into OUT by the command)
    size_t text_len;           // their count, without the NUL
    char *merge_method;
    int method_line, method_col;
    char *base_model;          // NULL if absent
    int base_line, base_col;
    lm_cfg_model *models;      // (n_models) `models:`; NULL and 0 when slices are given
    int n_models;
    lm_cfg_slice *slices;      // (n_slices) `slices:`; NULL and 0 when models are given
    int n_slices;
    lm_params params;          // top-level `parameters:`
    char *dtype;               // as written, NULL if absent
    char *out_dtype;
    char *tokenizer_source;    // NULL if absent
    const char *tokenizer_key; // how the file gave it, for messages: "tokenizer_source" or "tokenizer.source"
    char *chat_template;
    bool has_seed;
    uint64_t random_seed;
    int dtype_line, out_dtype_line, tokenizer_line, chat_template_line, seed_line;  // 0 if absent
} lm_mergecfg;

// Reads the file at `path` (a regular file of at most LM_MERGECFG_MAX_BYTES) and parses it as
// lm_mergecfg_parse does. On LM_OK *out is the new configuration, freed with lm_mergecfg_free;
// on failure *out is NULL and nothing needs freeing.
lm_status lm_mergecfg_load(lm_mergecfg **out, const char *path, lm_err *err);

// Parses the `len` bytes at `text` (no NUL needed; copied into the result's text) as a
// configuration; messages start "PATH:LINE:COLUMN: " with path_for_messages as PATH (also kept
// as the result's path). On LM_OK *out is the new configuration, freed with lm_mergecfg_free;
// on failure *out is NULL and nothing needs freeing.
lm_status lm_mergecfg_parse(lm_mergecfg **out, const char *path_for_messages, const char *text, size_t len,
                            lm_err *err);

// Frees a configuration and everything it holds; NULL is fine.
void lm_mergecfg_free(lm_mergecfg *c);

#endif
