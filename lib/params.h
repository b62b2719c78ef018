// Per-tensor parameter settings as mergekit writes and evaluates them, and their command-line
// form. A setting is a number, a bool, a string, a gradient (a list of numbers interpolated
// over the layers), or a list of conditions ({filter, value}) of which the first whose filter
// is absent, is "*", or is a substring of the tensor's name gives the value. A setting is
// evaluated for one tensor at one position t in [0, 1] (lm_param_position): a gradient
// [v0 .. vn-1] gives, with scaled = t (n - 1), i0 = (int)scaled, i1 = min(n - 1, i0 + 1) and
// frac = scaled - i0, (1 - frac) v[i0] + frac v[i1], in double precision, the arithmetic and
// order of mergekit's evaluate_setting, so the two agree to the bit.
//
// A parameter is looked up in a model's settings first, then in the global ones; a setting
// whose conditions all miss gives nothing and the lookup falls through to the next level (and
// at the end to the method's default, the caller's). The configuration reader (mergecfg.h)
// builds these from YAML; lm_pval_parse_cli from an option's text:
//
//     FILTER=VALUE;FILTER=VALUE;...;VALUE
//
// where VALUE is a number or a comma-separated gradient ("0,0.5,1"), FILTER any text without
// '=' or ';' ("*" matches every tensor), and only the last item may go without a filter (it
// then matches every tensor). "0.5" is a number, "0,0.5,1" a gradient, and
// "self_attn=0,0.5,1;mlp=1,0.5,0;0.5" three conditions: each evaluates as the YAML form of the
// same setting does.
#ifndef LM_PARAMS_H
#define LM_PARAMS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "status.h"

typedef enum lm_pval_kind {
    LM_PVAL_NUMBER,
    LM_PVAL_BOOL,
    LM_PVAL_STRING,
    LM_PVAL_GRADIENT,
    LM_PVAL_CONDS,
} lm_pval_kind;

typedef struct lm_pval lm_pval;

typedef struct lm_pcond {
    char *filter;    // NULL: matches any tensor (as "*" does)
    lm_pval *value;  // a number, bool, string or gradient
} lm_pcond;

struct lm_pval {
    lm_pval_kind kind;
    double num;       // NUMBER; BOOL as 0 or 1
    char *str;        // STRING
    double *grad;     // (n_grad) GRADIENT, n_grad >= 1
    int n_grad;
    int *grad_lines;  // (n_grad) where each of the gradient's numbers was written, 1-based; NULL
    int *grad_cols;   // for the command line
    lm_pcond *conds;  // (n_conds) CONDS, n_conds >= 1
    int n_conds;
    int line, col;    // where it was written in its file, 1-based; 0 for the command line
};

typedef struct lm_param {
    char *name;
    lm_pval *value;
    int line, col;  // of the key; 0 for the command line
} lm_param;

typedef struct lm_params {
    lm_param *items;  // (n) each name once
    int n;
} lm_params;

// Evaluates `v` for the tensor named `tensor` (NULL: no name, which only filters that are
// absent or "*" match) at position t (clamped to [0, 1]; NaN counts as 0). Returns false when
// v is a list of conditions none of which matches (the lookup falls through); otherwise true
// with *kind LM_PVAL_NUMBER (a number or a gradient's value) or LM_PVAL_BOOL, and *num, or
// LM_PVAL_STRING and *str (pointing into v). Any of kind, num, str may be NULL. Allocates
// nothing.
bool lm_pval_eval(const lm_pval *v, const char *tensor, double t, lm_pval_kind *kind, double *num,
                  const char **str);

// The parameter named `name` in ps (ps may be NULL), or NULL when it has none.
const lm_param *lm_params_find(const lm_params *ps, const char *name);

// The position t of a tensor among n_layers layers, as mergekit computes it: for a tensor of
// layer i (its name holds ".layers.<i>.", or starts with "layers.<i>."), i / (n_layers - 1),
// 1 when n_layers is 1, and at most 1 (a layer index past the last counts as the last); for a
// tensor outside the layers (embeddings, the final norm, lm_head) and when n_layers < 1, 0.
double lm_param_position(const char *tensor, int64_t n_layers);

// The layer index of a tensor name by the rule above, or -1 when it names no layer.
int64_t lm_param_layer(const char *tensor);

// ---- where a base's tensors lie, for gradients ----
//
// mergekit places each layer of a module at i / (n - 1) by that module's own layer count, and
// knows which tensors are layers from its architecture files. llmerge knows one naming, a name
// holding "layers.<i>." (lm_param_layer), and the base's count (num_hidden_layers, or
// text_config's). A layout records, for each prefix under which the base has such layers (the
// text before "layers."; a vision tower's layers beside a language model's make two), how many
// there are (the highest index + 1). The stack the count counts is placed by it (layers past it,
// a multi-token-prediction layer, at t = 1); any other by its own length, as mergekit places
// another module's layers by that module's count; a tensor outside every stack with no numbered
// part in its name at t = 0. A gradient anywhere else would be evaluated at a guessed position,
// and lm_param_layout_position refuses it.

#define LM_PARAM_MAX_STACKS 8

typedef struct lm_param_stack {
    const char *prefix;  // points into the name it was first seen in; not owned
    size_t len;          // of the prefix, up to "layers."
    int64_t n;           // the highest index seen + 1
} lm_param_stack;

typedef struct lm_param_layout {
    int64_t n_layers;    // the base's layer count (lm_config's layer_count); < 1 when it has none
    lm_param_stack stacks[LM_PARAM_MAX_STACKS];
    int n_stacks;
    bool overflow;       // more prefixes than stacks: the ones left out have no position
} lm_param_layout;

// Adds a base tensor's name to l (l->n_layers set first, the rest zeroed). The name must
// outlive l. Allocates nothing.
void lm_param_layout_add(lm_param_layout *l, const char *tensor);

// The position t of `tensor` for a gradient (true), or false with why in `why` (a clause: "its
// name has numbered blocks ('h.3') that are not llmerge's 'layers.<i>.'", ...) when llmerge
// cannot place it where mergekit would: the base's layer count is unknown, the base has layers
// under more prefixes than a layout holds, or the name has a part that is a number but no
// "layers.<i>.". Allocates nothing.
bool lm_param_layout_position(const lm_param_layout *l, const char *tensor, double *t, char *why, size_t cap);

// The setting lm_param_number evaluates for parameter `name` of `tensor` (the model's first,
// then the global ones; any may be NULL): a number, bool, string or gradient, with the
// parameter holding it in *from (may be NULL); NULL when none gives one. Allocates nothing.
const lm_pval *lm_param_leaf(const lm_params *model, const lm_params *global, const char *name, const char *tensor,
                             const lm_param **from);

// The value of the numeric (or bool) parameter `name` for a tensor: the model's settings first
// (model may be NULL), then the global ones (global may be NULL). On LM_OK, *found says whether
// either gave a value and *out holds it (a bool as 0 or 1); when *found is false the caller
// uses its default. A setting that gives a string is LM_ERR_USAGE naming the parameter and the
// line and column the string was written at. Allocates nothing.
lm_status lm_param_number(const lm_params *model, const lm_params *global, const char *name,
                          const char *tensor, double t, double *out, bool *found, lm_err *err);

// Parses the command-line form above into a new setting, *out, freed with lm_pval_free (lines
// and columns 0). LM_ERR_USAGE names the item (1-based) and what is wrong with it: an empty
// item or filter, a filter without a value, an item without a filter that is not the last, a
// value that is not a number or a list of numbers, a number that is not finite. *out is NULL on
// failure.
lm_status lm_pval_parse_cli(const char *text, lm_pval **out, lm_err *err);

// What lm_param_scan_number found in a piece of text.
typedef enum lm_pnum {
    LM_PNUM_NONE = 0,    // not a number: a string
    LM_PNUM_INT,         // decimal digits with an optional sign: *out holds it
    LM_PNUM_FLOAT,       // a decimal fraction or exponent (1.5, .5, 1e-3, -2.5E+4): *out holds it
    LM_PNUM_NONFINITE,   // .inf, -.inf, .nan (YAML's), or a number beyond a double (1e400)
    LM_PNUM_UNREADABLE,  // a number YAML 1.1 reads that llmerge does not: a leading 0 (octal
                         // there), 0x.., 0b.., '_' separators, base 60 (1:30)
} lm_pnum;

// Classifies the `len` bytes at `s` (no NUL needed) as the configuration reader and the
// command-line form read numbers, and for LM_PNUM_INT and LM_PNUM_FLOAT sets *out (else leaves
// it alone). Allocates nothing that outlives the call (a number over 127 characters is copied
// to the heap to be read; LM_PNUM_UNREADABLE when that fails).
lm_pnum lm_param_scan_number(const char *s, size_t len, double *out);

// Frees a setting and everything it holds; NULL is fine.
void lm_pval_free(lm_pval *v);

// Frees the items of ps (their names and settings), not ps itself, and leaves it empty.
void lm_params_free(lm_params *ps);

#endif
