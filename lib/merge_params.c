// A merge's parameters per tensor from settings: see merge_params.h.
#include "merge_params.h"

#include <string.h>

lm_mp_form lm_merge_params_form(const lm_merge_params *mp, int m, const char *name, double *num)
{
    const lm_param *p = m >= 0 ? lm_params_find(mp->models[m], name) : NULL;
    if (!p)
        p = lm_params_find(mp->global, name);
    if (!p)
        return LM_MP_UNSET;
    if (p->value->kind != LM_PVAL_NUMBER && p->value->kind != LM_PVAL_BOOL)
        return LM_MP_PER_TENSOR;
    *num = p->value->num;
    return LM_MP_NUMBER;
}

void lm_merge_params_layout(lm_merge_params *mp, const lm_model *base)
{
    memset(&mp->layout, 0, sizeof mp->layout);
    mp->layout.n_layers = base->config.layer_count;
    for (int64_t i = 0; i < base->n_tensors; i++)
        lm_param_layout_add(&mp->layout, base->tensors[i]->name);
}

// Sets *v from setting `name` of model m (m NULL: the global ones only) for the tensor, when
// one gives a value; *found says whether one did. `why` is NULL where the tensor's position t
// is known, else why it is not: a gradient then is an error, unless its numbers are all one.
static lm_status lookup(const lm_merge_params *mp, int m, const char *name, const char *tensor, double t,
                        const char *why, double *v, bool *found, lm_err *err)
{
    const lm_params *own = m >= 0 ? mp->models[m] : NULL;
    const lm_pval *leaf = why ? lm_param_leaf(own, mp->global, name, tensor, NULL) : NULL;
    bool constant = leaf && leaf->kind == LM_PVAL_GRADIENT;  // the same value at every position
    for (int q = 1; constant && q < leaf->n_grad; q++)
        constant = leaf->grad[q] == leaf->grad[0];
    if (leaf && leaf->kind == LM_PVAL_GRADIENT && !constant) {
        const char *who = m < 0 ? "the merge" : mp->names && mp->names[m] ? mp->names[m] : m == 0 ? "the base" : "FT";
        static const char fix[] = "give such tensors a value of their own (a condition with a filter before the "
                                  "gradient), or a number";
        if (mp->file && leaf->line > 0)
            return lm_err_set(err, LM_ERR_USAGE, "%s:%d:%d: %s: parameter '%s' is a gradient over the layers, and "
                              "tensor '%s' has no known position among them: %s; %s", mp->file, leaf->line, leaf->col,
                              who, name, tensor, why, fix);
        return lm_err_set(err, LM_ERR_USAGE, "%s: parameter '%s' is a gradient over the layers, and tensor '%s' has no "
                          "known position among them: %s; %s", who, name, tensor, why, fix);
    }
    double x = 0;
    lm_status s = lm_param_number(own, mp->global, name, tensor, t, &x, found, err);
    if (s != LM_OK) {
        const char *who = m < 0 ? "the merge" : mp->names && mp->names[m] ? mp->names[m] : m == 0 ? "the base" : "FT";
        return lm_err_prefix(err, "%s, tensor '%s'", who, tensor);
    }
    if (*found)
        *v = x;
    return LM_OK;
}

static lm_status model_value(const lm_merge_params *mp, int m, const char *name, unsigned bit, const char *tensor,
                             double t, const char *why, double *v, lm_err *err)
{
    bool found = false;
    lm_status s = lookup(mp, m, name, tensor, t, why, v, &found, err);
    if (s == LM_OK && !found && (mp->required & bit)) {
        const char *who = mp->names && mp->names[m] ? mp->names[m] : m == 0 ? "the base" : "an FT";
        return lm_err_set(err, LM_ERR_USAGE, "%s: no %s for tensor '%s' (no setting of the model's or the global "
                          "ones gives one, and the method needs it)", who, name, tensor);
    }
    return s;
}

lm_status lm_merge_params_tensor(void *ctx, const char *tensor, lm_tensor_params *tp, lm_err *err)
{
    const lm_merge_params *mp = ctx;
    double t = 0;
    char buf[LM_ERR_MSG_MAX / 2];
    const char *why = lm_param_layout_position(&mp->layout, tensor, &t, buf, sizeof buf) ? NULL : buf;
    lm_status s = LM_OK;
    bool found;
    if (mp->base_is_model)
        s = model_value(mp, 0, "weight", LM_MP_WEIGHT, tensor, t, why, &tp->base_weight, err);
    for (int i = 0; s == LM_OK && i < mp->n_ft; i++) {
        if ((s = model_value(mp, 1 + i, "weight", LM_MP_WEIGHT, tensor, t, why, &tp->weights[i], err)) != LM_OK ||
            (s = lookup(mp, 1 + i, "density", tensor, t, why, &tp->densities[i], &found, err)) != LM_OK ||
            (s = lookup(mp, 1 + i, "gamma", tensor, t, why, &tp->gammas[i], &found, err)) != LM_OK)
            break;
        s = lookup(mp, 1 + i, "epsilon", tensor, t, why, &tp->epsilons[i], &found, err);
    }
    if (s == LM_OK)
        s = lookup(mp, -1, "lambda", tensor, t, why, &tp->lambda, &found, err);
    if (s == LM_OK)
        s = lookup(mp, -1, "t", tensor, t, why, &tp->t, &found, err);
    if (s == LM_OK && !found && (mp->required & LM_MP_T)) {
        const lm_param *tp_set = mp->global ? lm_params_find(mp->global, "t") : NULL;
        if (mp->file && tp_set && tp_set->line > 0)
            return lm_err_set(err, LM_ERR_USAGE, "%s:%d:%d: t: no condition matches tensor '%s', and the method "
                              "needs a t for every tensor (add one without a filter, last)", mp->file, tp_set->line,
                              tp_set->col, tensor);
        s = lm_err_set(err, LM_ERR_USAGE, "no t for tensor '%s': no setting gives one, and the method needs it",
                       tensor);
    }
    if (s == LM_OK)
        s = lookup(mp, -1, "select_topk", tensor, t, why, &tp->select_topk, &found, err);
    return s;
}
