// The one JSON reader for the JSON text llmerge reads: config.json, adapter_config.json,
// model.safetensors.index.json, each line of a .jsonl token file, and the config.json a merge
// writes (checked before it is written). (Safetensors headers have their own reader, made for
// their one schema.) Every file is held to the same rules, so that a defect is refused the
// same way wherever it is, when the file is first read, with the line and column:
//
//   - one value (RFC 8259) and nothing after it but whitespace (space, tab, CR, LF);
//   - no UTF-8 byte order mark: Python's json module, which transformers and PEFT read these
//     files with, refuses one ("Unexpected UTF-8 BOM"), so a file llmerge took would not load
//     there; the message says to save the file without it;
//   - UTF-8 throughout: invalid bytes, overlong forms, lone surrogates (also as \u escapes) and
//     raw control characters in strings are refused, and so is \u0000 (a C string would end
//     there);
//   - each key once per object: Python keeps the last of two, cJSON's lookups find the first,
//     so the two would read different values;
//   - nesting at most LM_JSON_MAX_DEPTH deep;
//   - numbers as the grammar writes them (no NaN, Infinity, '+', leading zeros or hex); one
//     whose magnitude a double cannot hold (1e400) is out of range.
//
// The result is a cJSON tree, read with cJSON's accessors. Every number keeps the text it was
// written as in valuestring (which cJSON frees with the tree; cJSON's own functions do not
// read it for numbers): messages quote what the file says (lm_json_number_text).
#ifndef LM_JSON_H
#define LM_JSON_H

#include <cJSON.h>
#include <stddef.h>
#include <stdint.h>

#include "status.h"

#define LM_JSON_MAX_DEPTH 64

typedef enum lm_json_defect {
    LM_JSON_SYNTAX = 1,  // not JSON at all at that point ("expected ':' after the key")
    LM_JSON_TRAILING,    // text after the value
    LM_JSON_INVALID,     // JSON text llmerge refuses: a byte order mark, bad UTF-8, a key
                         // twice, too deep, a number out of range, \u0000
} lm_json_defect;

// Where and what a defect is, for callers that word their own messages (lm_json_parse words
// one for everyone else).
typedef struct lm_json_error {
    lm_json_defect defect;
    size_t offset;                 // byte offset of the defect in the text
    int64_t line, column;          // 1-based; columns count characters, not bytes
    int64_t first_line, first_column;  // a key given twice: where it was first (else 0)
    char what[LM_ERR_MSG_MAX / 2];     // the defect without file or position, e.g.
                                       // "key 'r' appears twice"
} lm_json_error;

// Parses the `len` bytes at `text` (no NUL needed). On success *out is the new tree, freed by
// the caller with cJSON_Delete, and the result is LM_OK. Otherwise *out is NULL and the result
// is LM_ERR_FORMAT with *e filled in, or LM_ERR_NOMEM (e->what says so).
lm_status lm_json_parse_detail(cJSON **out, const char *text, size_t len, lm_json_error *e);

// As lm_json_parse_detail, with the message in err: "LABEL: not valid JSON: WHAT (line L,
// column C)", "LABEL: text after the JSON value (line L, column C)", or "LABEL: WHAT (line L,
// column C)" for the other defects (a key twice adds where it was first).
lm_status lm_json_parse(cJSON **out, const char *text, size_t len, const char *label, lm_err *err);

// As lm_json_parse, but a \u0000 in a string is kept, as the two bytes C0 80 (NUL's form in
// Java's modified UTF-8, which no valid UTF-8 text holds), not refused: for a tokenizer's
// vocabulary, where a token may be a NUL character.
lm_status lm_json_parse_nul(cJSON **out, const char *text, size_t len, const char *label, lm_err *err);

// Reads the file at `path` (a regular file of at most max_bytes: a directory or FIFO is
// refused, never opened for reading in a way that blocks) and parses it as lm_json_parse does,
// with the path as the label. *out is the caller's to cJSON_Delete; NULL on failure.
lm_status lm_json_load(cJSON **out, const char *path, size_t max_bytes, lm_err *err);

// The kind of a value for messages: "null", "a boolean", "a number", "a string", "an array",
// "an object" (a static string).
const char *lm_json_kind(const cJSON *v);

// The text a number of a tree from this reader was written as ("1e400"), or NULL for anything
// else (also for a number cJSON made itself). Owned by the tree.
const char *lm_json_number_text(const cJSON *v);

#endif
