// Linear merging (Wortsman et al. 2022, "model soups"): the weighted average of the models'
// weights, the base one of the models (docs/merging.md "linear").
#include <math.h>

#include "method.h"

// θ = (w_0 θ_0 + Σ w_i θ_i) / W with W the sum of the weights of the models that hold the
// tensor (normalize; else W = 1): in task vectors, a = (w_0 + Σ w_i) / W and c_i = w_i / W. An
// adapter holds every tensor (its untouched ones are the base's, a τ of zero), so its weight is
// always in W; a full model without the tensor takes no part, as in mergekit.
static lm_status linear_coeffs(const lm_coef_in *in, double *a, double *c, lm_err *err)
{
    double sum = in->tp->base_weight;
    for (int i = 0; i < in->n; i++)
        sum += in->present[i] ? in->tp->weights[i] : 0.0;
    double div = in->o->normalize ? sum : 1.0;
    if (in->o->normalize && fabs(div) < 1e-8)
        return lm_err_set(err, LM_ERR_USAGE,
                          "linear: the weights of the models sum to %g in tensor '%s': nothing to divide by "
                          "(give other weights, or --no-normalize)",
                          sum, in->tensor);
    *a = sum / div;
    for (int i = 0; i < in->n; i++)
        c[i] = in->present[i] ? in->tp->weights[i] / div : 0.0;
    return LM_OK;
}

const lm_method lm_method_linear = {
    .name = "linear",
    .id = LM_MERGE_LINEAR,
    .brief = "the weighted average of the models (the first one is the reference)",
    .summary = "Linear: the weighted average of the models' weights. The first model is one of them and\n"
               "the one the others are checked against.",
    .formula = "  result = sum_j w_j * MODEL_j / sum_j w_j (without --normalize: not divided),\n"
               "  computed as MODEL_0 + sum_{j>0} (w_j / W) * (MODEL_j - MODEL_0) (s*B@A for an adapter).\n",
    .input = LM_METHOD_MODELS,
    .normalize = true,
    .linear = true,
    .coeffs = linear_coeffs,
    .min_inputs = 2,
    .ignores_lambda = "it averages the models, with no task vector to scale",
};
