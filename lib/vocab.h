// A tokenizer's vocabulary, as Hugging Face's tokenizers library has it once it has loaded a
// tokenizer.json (get_vocab()): every token with its id. The model's own tokens come from
// model.vocab, an object of token: id (BPE, WordPiece, WordLevel) or a list of [token, score]
// pairs whose position is the id (Unigram; a piece listed twice keeps its later position). The
// added tokens (added_tokens) are then added as the library adds them, whatever ids the file
// writes beside them: one the model holds keeps the model's id, a new one gets the next id after
// the model's vocabulary (its entries) and the added tokens before it, the same token again keeps
// its first id, an empty one is skipped. Nothing else of the file is read (no normalizer,
// pre-tokenizer or merges: the vocabulary is what decides which embedding row a token has).
//
// Refused as LM_ERR_FORMAT, naming the file and the entry: a file that is not JSON (json.h's
// rules), no model object or no model.vocab, a vocabulary or added token of the wrong shape,
// an id that is not a whole number in [0, LM_VOCAB_MAX_IDS), two different tokens with one id.
#ifndef LM_VOCAB_H
#define LM_VOCAB_H

#include <cJSON.h>
#include <stdbool.h>
#include <stdint.h>

#include "status.h"

#define LM_VOCAB_MAX_IDS ((int64_t)1 << 22)  // more ids than any tokenizer has (Gemma 3: 262,144)

typedef struct lm_vocab {
    const char **token;  // (n_ids) each id's token (pointing into the tree), NULL where none
    int64_t n_ids;       // one more than the largest id with a token; 0 for an empty vocabulary
    int64_t n_tokens;    // the ids that have a token
    cJSON *tree;         // the parsed file, which the tokens point into
} lm_vocab;

// Reads the vocabulary of the tokenizer.json at `path` into *out (the caller frees it with
// lm_vocab_free). On failure *out is NULL and err names the file and what is wrong with it;
// a file that is not there is LM_ERR_NOT_FOUND.
lm_status lm_vocab_load(lm_vocab **out, const char *path, lm_err *err);

// As lm_vocab_load, from the `len` bytes at `text`, named `label` in messages.
lm_status lm_vocab_parse(lm_vocab **out, const char *text, size_t len, const char *label, lm_err *err);

// A model directory's vocabulary as a merge sees it: its tokenizer.json's (lm_vocab_load), stripped
// to config.json's vocab_size when `strip` (mergekit strips the tokens past a model's embedding
// rows), or *out NULL (and LM_OK) when the directory has no tokenizer.json. *rows (where rows is
// not NULL): config.json's vocab_size, or the vocabulary's size where the config has none (an
// architecture llmerge does not describe; mergekit falls back to it), 0 without either.
lm_status lm_vocab_load_dir(lm_vocab **out, const char *dir, bool strip, int64_t *rows, lm_err *err);

// Frees v; safe on NULL.
void lm_vocab_free(lm_vocab *v);

// Drops the tokens whose id is `n` or more, as mergekit strips a model's tokenizer to the ids
// its embeddings have (config.json's vocab_size).
void lm_vocab_strip(lm_vocab *v, int64_t n);

// The token of id `id`, or NULL where v has none (also for an id outside v).
const char *lm_vocab_token(const lm_vocab *v, int64_t id);

// The smallest id below `limit` at which a and b differ (a token in one and not in the other,
// or two different tokens), or -1 where they agree on every id below it.
int64_t lm_vocab_first_difference(const lm_vocab *a, const lm_vocab *b, int64_t limit);

#endif
