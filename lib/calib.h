// Token data for evaluation and activation capture (docs/eval.md "The data"): a `.jsonl`
// file with one {"input_ids": [...]} object per line (or {"text": "..."}, tokenized with the
// model's tokenizer.json where the caller names it) (each line read by the one JSON reader,
// json.h), or a `.txt` file with one sequence per line of token ids separated by spaces or
// tabs. The format is chosen by the file's extension.
// Reading is strict, since a silently skipped or mangled sequence would change every result
// computed from the file: a malformed line, an empty sequence, an id that is not a whole
// number in [0, 2^31) or, when the vocabulary size is given, not below it, is LM_ERR_FORMAT
// with a message "FILE:LINE: what is wrong". Other keys of a JSON object are ignored; a UTF-8
// byte-order mark before the first line and a carriage return before each newline are allowed.
// A cap on the number of sequences stops reading there; sequences longer than the maximum
// length are cut to it.
#ifndef LM_CALIB_H
#define LM_CALIB_H

#include <stdbool.h>
#include <stdint.h>

#include "status.h"

typedef struct lm_calib_opts {
    int64_t max_samples;  // read at most this many sequences (0: all)
    int64_t max_len;      // cut longer sequences to this many tokens (0: no limit)
    int64_t vocab_size;   // every id must be below it (0: not checked)
    // A .jsonl line {"text": "..."} (without "input_ids") is tokenized by this tokenizer.json
    // (lib/tokenizer.h, loaded at the first such line), the post-processor's special tokens
    // included, as llmerge tokenize writes them; NULL: such a line is refused, saying
    // no_tokenizer (why there is none, and what to do).
    const char *tokenizer;
    const char *no_tokenizer;
    // The file is one text document (any name): tokenized whole with the tokenizer above (its
    // post-processor's tokens once, at the start), then cut into windows of max_len tokens, each
    // starting where the last ended (the stride is the window; the last one shorter), each a
    // sequence (its line 1). Text that is not valid UTF-8 is LM_ERR_FORMAT naming its line.
    bool text;
} lm_calib_opts;

typedef struct lm_calib {
    char *path;         // as given
    int32_t *ids;       // (n_tokens) every sequence's ids, back to back
    int64_t *offsets;   // (n_seqs + 1) sequence i is ids[offsets[i] .. offsets[i + 1])
    int64_t *lines;     // (n_seqs) the line each sequence came from (1-based)
    int64_t n_seqs;
    int64_t n_tokens;
    int64_t n_cut;      // sequences cut to max_len
    bool capped;        // reading stopped at max_samples with lines left in the file
} lm_calib;

// Reads the data file `path` into *c (overwritten). On success the caller frees it with
// lm_calib_free; on failure nothing needs freeing (lm_calib_free is still safe) and err says
// what is wrong: LM_ERR_FORMAT "PATH:LINE: ..." for bad content (also a file without any
// sequence or with an extension other than .jsonl or .txt), LM_ERR_NOT_FOUND for a missing
// file, LM_ERR_USAGE for a directory, FIFO, socket or device ("PATH is a FIFO, not a regular
// file": refused before anything is read, without waiting on a FIFO), LM_ERR_IO when reading
// fails.
lm_status lm_calib_load(lm_calib *c, const char *path, const lm_calib_opts *o, lm_err *err);

// Frees and zeroes; safe on a zeroed calib and twice.
void lm_calib_free(lm_calib *c);

#endif
