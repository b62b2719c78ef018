// A merge's parameters per tensor from settings: see merge_params.h.
#include "merge_params.h"

// Sets *v from setting `name` of model m (m NULL: the global ones only) for the tensor, when
// one gives a value; *found says whether one did.
static lm_status lookup(const lm_merge_params *mp, int m, const char *name, const char *tensor, double t, double *v,
                        bool *found, lm_err *err)
{
    const lm_params *own = m >= 0 ? mp->models[m] : NULL;
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
                             double t, double *v, lm_err *err)
{
    bool found = false;
    lm_status s = lookup(mp, m, name, tensor, t, v, &found, err);
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
    double t = lm_param_position(tensor, mp->n_layers);
    lm_status s = LM_OK;
    bool found;
    if (mp->base_is_model)
        s = model_value(mp, 0, "weight", LM_MP_WEIGHT, tensor, t, &tp->base_weight, err);
    for (int i = 0; s == LM_OK && i < mp->n_ft; i++) {
        if ((s = model_value(mp, 1 + i, "weight", LM_MP_WEIGHT, tensor, t, &tp->weights[i], err)) != LM_OK ||
            (s = lookup(mp, 1 + i, "density", tensor, t, &tp->densities[i], &found, err)) != LM_OK ||
            (s = lookup(mp, 1 + i, "gamma", tensor, t, &tp->gammas[i], &found, err)) != LM_OK)
            break;
        s = lookup(mp, 1 + i, "epsilon", tensor, t, &tp->epsilons[i], &found, err);
    }
    if (s == LM_OK)
        s = lookup(mp, -1, "lambda", tensor, t, &tp->lambda, &found, err);
    if (s == LM_OK)
        s = lookup(mp, -1, "t", tensor, t, &tp->t, &found, err);
    if (s == LM_OK)
        s = lookup(mp, -1, "select_topk", tensor, t, &tp->select_topk, &found, err);
    return s;
}
