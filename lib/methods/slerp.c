// SLERP: spherical linear interpolation between the base and one fine-tune, the whole tensor as
// one vector (docs/merging.md "slerp"), with mergekit's threshold for nearly colinear tensors.
#include <math.h>

#include "method.h"

#define SLERP_DOT_THRESHOLD 0.9995  // |cos Ω| above it: linear interpolation (mergekit's)
#define SLERP_EPS 1e-8              // a norm at or below it: the vector is not normalised

// θ = s_0 θ_0 + s_1 θ_1 between θ_0 = θ_b and θ_1 = θ_b + τ: with cos Ω the cosine of the two
// (each divided by its norm only where the norm exceeds 1e-8, as mergekit does), s_0 =
// sin((1−t)Ω)/sin Ω and s_1 = sin(tΩ)/sin Ω; where |cos Ω| > 0.9995, s_0 = 1 − t, s_1 = t.
// In task vectors: a = s_0 + s_1, c = s_1.
static lm_status slerp_coeffs(const lm_coef_in *in, double *a, double *c, lm_err *err)
{
    (void)err;
    double g[4], t = in->tp->t;
    lm_coef_vectors_gram(in, true, g);
    double n0 = sqrt(g[0]), n1 = sqrt(g[3]);
    double dot = g[1] / ((n0 > SLERP_EPS ? n0 : 1.0) * (n1 > SLERP_EPS ? n1 : 1.0));
    double r[2];
    if (fabs(dot) > SLERP_DOT_THRESHOLD) {
        r[0] = 1.0 - t;
        r[1] = t;
    } else {
        double omega = acos(dot), s = sin(omega);
        r[0] = sin(omega - omega * t) / s;
        r[1] = sin(omega * t) / s;
    }
    lm_coef_from_vectors(in, true, r, a, c);
    return LM_OK;
}

const lm_method lm_method_slerp = {
    .name = "slerp",
    .id = LM_MERGE_SLERP,
    .brief = "spherical interpolation between the base and one FT at --t",
    .summary = "SLERP: spherical linear interpolation between the base (t = 0) and one fine-tune (t = 1),\n"
               "each tensor taken as one vector.",
    .formula = "  cos W = <BASE, FT> / (|BASE| |FT|) over the whole tensor;\n"
               "  result = sin((1-t) W) / sin W * BASE + sin(t W) / sin W * FT,\n"
               "  or (1-t) * BASE + t * FT where |cos W| > 0.9995 (nearly colinear).\n",
    .input = LM_METHOD_TASK_VECTORS,
    .linear = true,
    .coeffs = slerp_coeffs,
    .gram = true,
    .min_inputs = 1,
    .max_inputs = 1,
    .reads_t = true,
    .ignores_weights = "it interpolates by --t",
    .ignores_normalize = "it interpolates by --t",
    .ignores_lambda = "it interpolates by --t, with no task vector to scale",
};
