// A Hugging Face model directory: config.json plus its weights, either one model.safetensors
// or shards listed by model.safetensors.index.json. Each shard is opened (mmapped) once and
// every tensor is a view into its shard; a name-to-tensor map spans all shards. Tensors are
// listed in a state-dict-like order: shards in file-name order, and within a shard by data
// offset. The index (read by the one JSON reader, json.h) must agree with the shards: a tensor
// listed but absent from its shard, a shard file missing or not a regular file (a directory, a
// FIFO: named as such, never opened), a tensor present in two shards or missing from the index
// is LM_ERR_FORMAT naming the file and the tensor. Opening does not require a known
// architecture (merging works on any model's tensors); lm_model_check compares a model of a
// known architecture with its description (arch.h).
#ifndef LM_MODEL_H
#define LM_MODEL_H

#include <cJSON.h>
#include <stdint.h>

#include "arch.h"
#include "config.h"
#include "safetensors.h"
#include "util.h"

typedef struct lm_model_shard {
    char *file;          // the name as listed in the index, e.g. "model-00001-of-00002.safetensors"
    char *path;          // dir/file
    lm_st_file *st;      // the open shard
    int64_t n_tensors;   // tensors of the model in this shard
    uint64_t nbytes;     // their data bytes
} lm_model_shard;

typedef struct lm_model {
    char *dir;                     // as given to lm_model_open
    char *index_path;              // model.safetensors.index.json, or NULL for one file
    lm_config config;
    lm_model_shard *shards;        // (n_shards) in file-name order
    int n_shards;
    const lm_st_tensor **tensors;  // (n_tensors) views into the shards, shard order then offset
    int *tensor_shard;             // (n_tensors) index into shards
    int64_t n_tensors;
    lm_strmap index;               // tensor name -> position in tensors (keys owned by shards)
    lm_st_file **overlays;         // (n_overlays) files whose tensors replace some of the shards'
    int n_overlays;                // (lm_model_overlay)
} lm_model;

// Opens the model directory `dir`: parses config.json (lm_config_load) and opens the weights.
// On success *out is a new model the caller frees with lm_model_free; on failure *out is NULL
// and err says what is wrong and where. A directory with only pytorch_model.bin weights is
// LM_ERR_UNSUPPORTED (convert to safetensors); no config.json or no weights is
// LM_ERR_NOT_FOUND.
lm_status lm_model_open(lm_model **out, const char *dir, lm_err *err);

// Parses the `len` bytes of a model.safetensors.index.json at `text` (`label` names it in
// messages) with the one JSON reader (json.h): an object whose weight_map maps each tensor name
// (once) to a plain file name in the model directory. On success *out is the tree, which the
// caller frees with cJSON_Delete, and *weight_map points into it; on failure both are NULL and
// the result is LM_ERR_FORMAT naming the file and the entry (or LM_ERR_NOMEM).
lm_status lm_model_index_parse(cJSON **out, const cJSON **weight_map, const char *text, size_t len,
                               const char *label, lm_err *err);

// Unmaps the shards and frees everything; safe on NULL and on a half-built model.
void lm_model_free(lm_model *m);

// Replaces tensors of m by the tensors of the same names in `f`, which m then owns (and closes
// with itself), and sets m's config.vocab_size to `vocab_size`: the embedding and output
// matrices rebuilt to another vocabulary (lib/embed_perm.h). Each of f's tensors must be one of
// m's (else LM_ERR_MISMATCH naming it; f is closed and m unchanged). The tensors keep their
// places in m's order; m's files (config, index, shards) stay what m was read from.
lm_status lm_model_overlay(lm_model *m, lm_st_file *f, int64_t vocab_size, lm_err *err);

// The tensor called `name` in whichever shard holds it, or NULL.
const lm_st_tensor *lm_model_find(const lm_model *m, const char *name);

// The position of tensor `name` in m->tensors, or -1.
int64_t lm_model_find_index(const lm_model *m, const char *name);

// Checks the model against the description `d`: every described tensor present with the
// described shape. The first problem is LM_ERR_MISMATCH naming the tensor and both shapes (and
// how many more problems there are). Tensors the description does not list are not errors;
// their number goes to *n_extra when it is not NULL.
lm_status lm_model_check_desc(const lm_model *m, const lm_arch_desc *d, int64_t *n_extra,
                              lm_err *err);

// Describes the model's own architecture from its config and checks against it. Returns
// LM_ERR_UNSUPPORTED for an architecture llmerge does not describe, else as
// lm_model_check_desc.
lm_status lm_model_check(const lm_model *m, int64_t *n_extra, lm_err *err);

// Checks a full fine-tuned model `ft` against its base: every tensor of the base present in
// `ft` with the same shape (a merge needs each one). The first problem is LM_ERR_MISMATCH naming
// the tensor, both directories and both shapes (and how many more problems there are). Tensors
// only `ft` has are not errors; their number goes to *n_extra when it is not NULL.
lm_status lm_model_compare(const lm_model *ft, const lm_model *base, int64_t *n_extra,
                           lm_err *err);

// The number of elements over all tensors (what the files hold; a tied lm_head the files do
// not store is not counted).
int64_t lm_model_param_count(const lm_model *m);

// The bytes of tensor data over all shards.
uint64_t lm_model_nbytes(const lm_model *m);

// Counts tensors per dtype into counts[LM_DTYPE_COUNT] (zeroed first).
void lm_model_dtype_counts(const lm_model *m, int64_t counts[LM_DTYPE_COUNT]);

// The dtype an output made from m is written in when the user names none: config.json's dtype
// when it is one a model is saved in (F32, F16, BF16), else the dtype most of m's floating
// tensors have (F64 read as F32), else F32.
lm_dtype lm_model_out_dtype(const lm_model *m);

#endif
