// The embedding and output matrices of a merge's models under the output's vocabulary, where the
// models' tokenizers put tokens at other ids (a configuration's tokenizer_source naming a model of
// another vocabulary, or a model whose tokenizer differs from the output's): mergekit's rebuild
// of these matrices, done before the merge so that the merge itself is unchanged.
//
// Each model's matrix gets one row per id of the output vocabulary: the model's own row for that
// token where it has one (its id in its own vocabulary, below its embedding rows), else a row
// every model lacking the token shares, chosen as mergekit chooses it: the row of the only model
// that has the token; zeros where none has it (and for an id the output vocabulary leaves
// without a token); the base's row where the base has it (only when `prefer_base`: mergekit does
// so when the configuration names a base_model); else the mean of the rows of the models that
// have it. Model 0 is the base. The mean is computed in float32, in model order, and rounded once
// to each model's dtype; a row taken from a model of another dtype is converted likewise.
#ifndef LM_EMBED_PERM_H
#define LM_EMBED_PERM_H

#include <stdbool.h>
#include <stdint.h>

#include "safetensors.h"
#include "status.h"
#include "vocab.h"

enum {
    LM_EMBED_ZERO = -1,     // lm_embed_perm's fill: zeros
    LM_EMBED_AVERAGE = -2,  // ... the mean of the rows of the models that have the token
};

typedef struct lm_embed_perm {
    int n_models;      // model 0 is the base
    int64_t n_rows;    // the output vocabulary's ids: each rebuilt matrix's rows
    int32_t **row;     // (n_models)(n_rows) the model's row holding each output id's token, or -1
    int32_t *fill;     // (n_rows) for the models without the token: a model's index (that model's
                       // row), LM_EMBED_ZERO or LM_EMBED_AVERAGE
    int64_t n_tokens;  // output ids with a token
    int64_t n_single;  // tokens one model has (filled from its row where the others lack them)
    int64_t n_none;    // tokens no model has (zeros)
    int64_t n_base;    // tokens several have, the base among them, that some model lacks
    int64_t n_average; // tokens several have, not the base (or with prefer_base off), that some lack
    int64_t *n_own;    // (n_models) output ids whose row is the model's own
    int64_t *n_moved;  // (n_models) of those, the ones at another id than in the model
} lm_embed_perm;

// Builds the rows for output vocabulary `vocab` from the models' vocabularies vocabs[i] (each
// stripped to its rows; NULL: the base's, vocabs[0], which must not be NULL) and their
// embedding rows rows[i] (ids at or past them count as absent). LM_ERR_NOMEM only.
lm_status lm_embed_perm_make(lm_embed_perm **out, const lm_vocab *vocab, const lm_vocab *const *vocabs,
                             const int64_t *rows, int n_models, bool prefer_base, lm_err *err);

void lm_embed_perm_free(lm_embed_perm *p);

// Writes into `fd` (an empty file open for writing) a safetensors file of model m's rebuilt
// matrices: for each k < n_names, t[k * n_models + j] is model j's tensor names[k], [rows_j, H]
// with the same H for every j, and the file's tensor names[k] is [n_rows, H] in the dtype of
// model m's. Without `data` only the header is written and the file given its full size (a
// plan reads the shapes only). `label` names the file in messages. LM_ERR_IO naming it;
// LM_ERR_UNSUPPORTED for a dtype llmerge does not convert (naming the tensor).
lm_status lm_embed_perm_write(const lm_embed_perm *p, int m, const lm_st_tensor *const *t, const char *const *names,
                              int n_names, int fd, bool data, const char *label, lm_err *err);

#endif
