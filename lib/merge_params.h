// A merge's parameters per tensor, from settings (params.h): mergekit's gradients over the layers
// and filters on tensor names, given in a configuration file or on the command line. It is the
// callback lm_merge_opts' tensor_params calls before each tensor: the engine's values there are
// the options' (the method's defaults), and each setting that gives a value for the tensor
// replaces one. Per-model settings (weight, density, gamma, epsilon) are looked up in the
// model's own settings, then in the global ones; the merge's own (lambda, t, select_topk) in the
// global ones.
#ifndef LM_MERGE_PARAMS_H
#define LM_MERGE_PARAMS_H

#include <stdbool.h>
#include <stdint.h>

#include "merge.h"
#include "params.h"

// Parameters a tensor must get from a setting (a configuration's required weight, or slerp's
// and nearswap's t): a tensor where none gives one is an error naming the model (for t, the
// global settings) and the tensor.
enum {
    LM_MP_WEIGHT = 1u << 0,
    LM_MP_T = 1u << 1,
};

typedef struct lm_merge_params {
    const lm_params *global;        // the global settings, or NULL
    const lm_params *const *models; // (n_ft + 1): [0] the base's, [1 + i] FT i's; any may be NULL
    int n_ft;
    lm_param_layout layout;         // where the base's tensors lie, for gradients (lm_merge_params_layout)
    const char *file;               // the configuration the settings come from, for messages, or NULL
    unsigned required;              // LM_MP_*: the weight for the FTs (and the base where it is a
                                    // model), t for the merge
    bool base_is_model;             // the base takes a weight (linear, karcher, --models-only)
    const char *const *names;       // (n_ft + 1) how each model was named, for messages, or NULL
} lm_merge_params;

// How a parameter is set for the whole merge, for the records of it (the card, llmerge.json).
typedef enum lm_mp_form {
    LM_MP_UNSET,       // no setting gives it: the method's default applies everywhere
    LM_MP_NUMBER,      // one number (or bool) for every tensor
    LM_MP_PER_TENSOR,  // a gradient or conditions: it may differ from tensor to tensor
} lm_mp_form;

// How parameter `name` of model m (0 the base, 1 + i FT i; -1 the merge's own, the global
// settings only) is set: the model's setting where it has one, else the global one; for
// LM_MP_NUMBER *num holds the number (a bool as 0 or 1). Allocates nothing.
lm_mp_form lm_merge_params_form(const lm_merge_params *mp, int m, const char *name, double *num);

// Fills mp->layout from the base: its num_hidden_layers and the stacks of layers its tensors
// form (params.h). The base must outlive mp's use. Allocates nothing.
void lm_merge_params_layout(lm_merge_params *mp, const lm_model *base);

// lm_merge_opts' tensor_params for ctx, an lm_merge_params: sets tp's values for `tensor` where
// a setting gives one (t from the tensor's layer, lm_param_layout_position). LM_ERR_USAGE naming
// the parameter, the model and the tensor when a setting gives a string, a required one gives
// nothing, or a gradient applies to a tensor whose position among the layers llmerge does not
// know (naming the gradient's line and column, and why). Allocates nothing.
lm_status lm_merge_params_tensor(void *ctx, const char *tensor, lm_tensor_params *tp, lm_err *err);

#endif
