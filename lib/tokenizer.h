// Text to token ids as Hugging Face's tokenizers library encodes it, from a model's
// tokenizer.json: the added tokens matched first (on the raw text, leftmost and longest), the
// normalizer on the text between them (then the added tokens with normalized: true on that),
// the pre-tokenizer's pieces, the BPE model on each piece (merges by rank, byte-level or with
// byte fallback), the post-processor's special tokens. Where the JavaScript library and the
// Rust one differ (Metaspace's split and "first", Split's behaviors), this is the Rust one.
//
// What is read (any other component, or an option of these that changes the result in a way not
// built here, is LM_ERR_UNSUPPORTED naming it, never approximated):
//   normalizer      null, NFC, NFKC, NFD, NFKD (utf8proc), Prepend, Replace of a String, Sequence
//   pre_tokenizer   null, Split (a Regex, matched with PCRE2 in UTF and Unicode-property mode, or a
//                   String; every behavior: Isolated, Removed, MergedWithPrevious, MergedWithNext,
//                   Contiguous; not inverted), ByteLevel (its add_prefix_space, and use_regex:
//                   GPT-2's pattern), Metaspace (replacement, prepend_scheme first/never/always or
//                   the older add_prefix_space, split), Sequence
//   model           BPE: vocab, merges (the "a b" strings or [a, b] pairs), ignore_merges,
//                   byte_fallback, unk_token and fuse_unk; no dropout, no subword prefix or suffix
//   post_processor  null, ByteLevel (nothing to ids), TemplateProcessing's single template,
//                   Sequence
//   added_tokens    matched on the raw text (normalized: false) or on the normalized text
//                   (normalized: true, as their content normalized); without lstrip, rstrip or
//                   single_word
// Invalid UTF-8 in the text is refused (the caller names the line), and so is a NUL character (a
// vocabulary's "\u0000" token is kept as C0 80, which no text holds).
#ifndef LM_TOKENIZER_H
#define LM_TOKENIZER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "status.h"

typedef struct lm_tokenizer lm_tokenizer;

// Reads the tokenizer.json at `path`, and the tokenizer_config.json beside it where there is one
// (lm_tok_config). LM_ERR_FORMAT naming the file and the entry for a malformed file,
// LM_ERR_UNSUPPORTED naming the component, LM_ERR_NOT_FOUND where the file is not there.
lm_status lm_tok_load(lm_tokenizer **out, const char *path, lm_err *err);

// The same from `len` bytes of JSON text named `label` in messages (no tokenizer_config.json).
lm_status lm_tok_parse(lm_tokenizer **out, const char *text, size_t len, const char *label, lm_err *err);

// Applies tokenizer_config.json's text (`len` bytes named `label`) to t, as transformers (5)
// rewrites the post-processor: where the file has add_bos_token or add_eos_token, the ids before
// a sequence become its bos_token where add_bos_token is true and none otherwise (false, null or
// absent), in place of the template's, and the ids after it likewise by add_eos_token and
// eos_token. A token is named by its text or by an object with its "content" (an added token's
// content as the file writes it, else a vocabulary entry). Without either key nothing changes.
// LM_ERR_FORMAT for a key that is not true, false or null, or true with a token that is not one
// of t's; t is then unchanged.
lm_status lm_tok_config(lm_tokenizer *t, const char *text, size_t len, const char *label, lm_err *err);

// The largest id t can give, with a token of that id in *token (when not NULL; t's to keep): of
// its vocabulary and the post-processor's special tokens, which ordinary text gives, and with
// `added` also of its added tokens, which only a text that holds them gives (a tokenizer shared
// by a model family may hold tokens past a text model's rows: Gemma 3's image token).
int64_t lm_tok_max_id(const lm_tokenizer *t, const char **token, bool added);

void lm_tok_free(lm_tokenizer *t);

// The first line (1-based) of the `len` bytes at text that is not valid UTF-8 (lm_utf8_valid's
// rule), or 0 where every line is: what a text file's message names.
int64_t lm_utf8_bad_line(const char *text, size_t len);

// Pieces already encoded, for one thread: most words recur, and a hit skips the merges. It holds
// at most LM_TOK_CACHE_MAX pieces and starts again empty when full. NULL when memory runs out.
#define LM_TOK_CACHE_MAX 65536
typedef struct lm_tok_cache lm_tok_cache;
lm_tok_cache *lm_tok_cache_new(void);
void lm_tok_cache_free(lm_tok_cache *c);

// Appends the ids of the `len` bytes of UTF-8 text at `text` to *ids (n of them, cap its
// capacity; grown with realloc), with the post-processor's special tokens where `special`.
// `cache` (may be NULL) is the calling thread's own. LM_ERR_FORMAT for text that is not valid
// UTF-8 (naming the byte offset).
lm_status lm_tok_encode(const lm_tokenizer *t, lm_tok_cache *cache, const char *text, size_t len, int special,
                        int32_t **ids, int64_t *n, int64_t *cap, lm_err *err);

#endif
