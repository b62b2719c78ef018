// NuSLERP: spherical interpolation of two fine-tunes' task vectors (with a base) or of two
// models (without), t from their weights (docs/merging.md "nuslerp").
#include <math.h>

#include "method.h"

#define NUSLERP_NORM_MIN 1e-7  // norms are clamped below to this (mergekit's)
#define NUSLERP_EPS 1e-8       // |sin Ω| below it: linear interpolation

// t = w_1 / (w_0 + w_1) (0.5 where the sum is below 1e-6 in magnitude); the two vectors are
// the task vectors of the two FTs, or the two models where o->models_only; then
// v = (sin((1−t)Ω) v_0 + sin(tΩ) v_1) / sin Ω with cos Ω from the vectors divided by their
// norms (clamped to 1e-7), or (1−t) v_0 + t v_1 where |sin Ω| < 1e-8.
static lm_status nuslerp_coeffs(const lm_coef_in *in, double *a, double *c, lm_err *err)
{
    (void)err;
    bool models = in->o->models_only;
    double w0 = models ? in->tp->base_weight : in->tp->weights[0];
    double w1 = models ? in->tp->weights[0] : in->tp->weights[1];
    double t = fabs(w0 + w1) < 1e-6 ? 0.5 : w1 / (w0 + w1);
    double g[4];
    lm_coef_vectors_gram(in, models, g);
    double n0 = fmax(sqrt(g[0]), NUSLERP_NORM_MIN), n1 = fmax(sqrt(g[3]), NUSLERP_NORM_MIN);
    double cos_o = g[1] / (n0 * n1);
    double omega = acos(cos_o < -1 ? -1 : cos_o > 1 ? 1 : cos_o), s = sin(omega);
    double r[2];
    if (fabs(s) < NUSLERP_EPS) {
        r[0] = 1.0 - t;
        r[1] = t;
    } else {
        r[0] = sin((1.0 - t) * omega) / s;
        r[1] = sin(t * omega) / s;
    }
    lm_coef_from_vectors(in, models, r, a, c);
    return LM_OK;
}

const lm_method lm_method_nuslerp = {
    .name = "nuslerp",
    .id = LM_MERGE_NUSLERP,
    .brief = "spherical interpolation of two FTs' task vectors (or of two models), t from the weights",
    .summary = "NuSLERP: spherical interpolation of two fine-tunes' task vectors against the base, or\n"
               "with --models-only of the two models themselves; t = w_2 / (w_1 + w_2).",
    .formula = "  v_1, v_2 = FT_1 - BASE, FT_2 - BASE (with --models-only: the two models);\n"
               "  t = w_2 / (w_1 + w_2); cos W = <v_1, v_2> / (|v_1| |v_2|) over the whole tensor;\n"
               "  v = (sin((1-t) W) v_1 + sin(t W) v_2) / sin W, or (1-t) v_1 + t v_2 where sin W ~ 0;\n"
               "  result = BASE + v (with --models-only: v).\n",
    .input = LM_METHOD_EITHER,
    .linear = true,
    .coeffs = nuslerp_coeffs,
    .gram = true,
    .rows_ok = true,
    .cols_ok = true,
    .min_inputs = 2,
    .max_inputs = 2,
    .ignores_normalize = "its t is w_2 / (w_1 + w_2), whatever the weights' scale",
    .ignores_lambda = "it interpolates, with no task vector to scale",
};
