// The model card of a merged model: OUT/README.md, the file the Hugging Face Hub shows as a
// repository's page and reads its metadata from. It starts with YAML front matter between two
// "---" lines: base_model (the Hub ids of the base, then of each fine-tune) with
// base_model_relation: merge (so the Hub files the model under its parents' merges), then
// library_name: transformers and tags: [merge, llmerge]. A Markdown body follows: what was merged onto what by which method, each input with
// its kind, weight and density, the options that shape the result, the llmerge version, and a
// command line that makes the same merge again.
//
// A model in the Hub's local cache (.../models--ORG--NAME/snapshots/REVISION/...) is named by its
// Hub id ORG/NAME in base_model. Any other input is a local path, which the Hub would refuse as
// a base_model: it is named in the body only, and the body says to add its Hub id before the
// card is uploaded (with no id at all, base_model and base_model_relation are left out). Every string in
// the front matter is a double-quoted YAML scalar, escaped, so that a path holding ": ", "#",
// quotes or control characters stays one string; paths in the body are Markdown code spans, and
// the command line is quoted for a POSIX shell.
#ifndef LM_CARD_H
#define LM_CARD_H

#include <stdbool.h>
#include <stddef.h>

#include "status.h"
#include "util.h"

#define LM_CARD_NAME "README.md"

// One fine-tune merged onto the base.
typedef struct lm_card_input {
    const char *path;   // as the user gave it
    const char *kind;   // "LoRA adapter", "model"
    double weight;
    double density;     // the fraction kept; < 0 when the method keeps all of it
    const char *weight_text;   // said instead of the number when not NULL ("per tensor: ..."),
    const char *density_text;  // where a setting varies from tensor to tensor
} lm_card_input;

// An option shown in the body as "name: value" (value a code span when `code`).
typedef struct lm_card_option {
    const char *name;
    const char *value;
    bool code;
} lm_card_option;

// What the card says. Nothing is copied; every pointer is only read by the calls below.
typedef struct lm_card {
    const char *title;              // the model's name: the output directory's
    const char *version;            // llmerge's
    const char *method;             // the command: "ties", "dare-ties", ...
    const char *method_summary;     // a sentence or two on the method (line breaks become spaces)
    const char *base;               // BASE as the user gave it
    const lm_card_input *inputs;    // (n_inputs) the FTs in order
    int n_inputs;
    const lm_card_option *options;  // (n_options) the resolved options that shape the result
    int n_options;
    const char *const *argv;        // (argc) the words of a command line making the same merge,
    int argc;                       // unquoted ("llmerge", "ties", BASE, ...)
    const char *config;             // the configuration file the merge ran (YAML), shown before
                                    // the command line; NULL: none
    int adapter_rank;               // the merge written as a LoRA adapter of the base of this rank
                                    // (--to-lora; -1: of its inputs' factors concatenated):
                                    // library_name peft, base_model the base alone with
                                    // base_model_relation adapter; 0: a model
} lm_card;

// The card's text, a new NUL-terminated string the caller frees; NULL when memory runs out.
char *lm_card_text(const lm_card *c);

// Writes the card to `path` (created or replaced, mode 0644). LM_ERR_IO naming the path, or
// LM_ERR_NOMEM.
lm_status lm_card_write(const char *path, const lm_card *c, lm_err *err);

// Writes the shortest decimal that reads back as v into buf ("0.5", "1", "0.1"): the form the card
// gives weights and densities in, also on its command line.
void lm_card_number(char *buf, size_t cap, double v);

// ==== the pieces, for the tests ===============================================================

// Appends s as a YAML double-quoted scalar: ", \ and the characters YAML wants escaped (C0 and
// C1 controls, DEL, U+2028, U+2029, U+FEFF) as escapes, bytes that are not UTF-8 as \xNN.
void lm_card_yaml_str(lm_buf *b, const char *s);

// Appends s as one POSIX shell word: as it is when it holds only characters no shell treats
// specially, else in single quotes (a ' inside as '\'').
void lm_card_shell_word(lm_buf *b, const char *s);

// Appends s as a Markdown code span, delimited by one backtick more than its longest run of
// backticks, padded with a space where it starts or ends with a backtick or a space.
void lm_card_md_code(lm_buf *b, const char *s);

// When `path` (resolved with realpath; one not on disk, as lm_hf_resolve resolves it) lies in a
// snapshot of the Hub's cache (models--ORG--NAME/snapshots/...), writes ORG/NAME (NAME alone for a model without an
// organisation) into buf and returns true; else returns false.
bool lm_card_hub_id(const char *path, char *buf, size_t cap);

#endif
