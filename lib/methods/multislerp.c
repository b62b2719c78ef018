// Multi-SLERP: the weighted barycentre of several task vectors (with a base) or models (without)
// on the hypersphere, through the tangent space at their weighted mean direction
// (docs/merging.md "multislerp"), each tensor one vector.
#include <math.h>
#include <stdlib.h>

#include "method.h"

#define MULTISLERP_EPS 1e-8  // mergekit's

// With x_j the vectors, n_j their norms and w_j the weights (divided by their sum when
// normalizing): u_j = x_j / (n_j + ε); μ = Σ w_j u_j, scaled to unit length; d_j = <u_j, μ>;
// T = Σ w_j (u_j − d_j μ); ‖T‖ + ε = τ; result = (Σ w_j n_j) (cos τ μ + sin τ / τ · T). Every
// vector is a combination of the x_j, so the whole computation is on coefficients and the Gram
// matrix. Where ‖μ‖ < ε (antipodal inputs): the weighted sum for two vectors, else an error.
static lm_status multislerp_coeffs(const lm_coef_in *in, double *a, double *c, lm_err *err)
{
    bool models = in->o->models_only;
    int m = models ? in->n + 1 : in->n;
    double *g = malloc(sizeof(double) * (size_t)(m * m + 6 * m));
    if (!g)
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    double *w = g + m * m, *nrm = w + m, *mu = nrm + m, *tan = mu + m, *r = tan + m, *e = r + m;
    lm_coef_vectors_gram(in, models, g);
    double wsum = 0;
    for (int j = 0; j < m; j++) {
        w[j] = models ? (j == 0 ? in->tp->base_weight : in->tp->weights[j - 1]) : in->tp->weights[j];
        wsum += w[j];
    }
    for (int j = 0; j < m; j++) {
        if (in->o->normalize)
            w[j] /= wsum;
        nrm[j] = sqrt(g[j * m + j] > 0 ? g[j * m + j] : 0);
    }
    lm_status s = LM_OK;
    if (m == 1) {
        r[0] = 1.0;
        goto done;
    }
    for (int j = 0; j < m; j++)
        mu[j] = w[j] / (nrm[j] + MULTISLERP_EPS);
    double mu_norm = sqrt(fmax(lm_coef_dot(g, m, mu, mu), 0));
    if (mu_norm < MULTISLERP_EPS) {
        if (m != 2) {
            s = lm_err_set(err, LM_ERR_USAGE,
                           "multislerp: the weighted sum of the inputs' directions is zero in tensor '%s' "
                           "(antipodal inputs whose weights balance): give other weights",
                           in->tensor);
            goto done;
        }
        r[0] = w[0];
        r[1] = w[1];
        goto done;
    }
    for (int j = 0; j < m; j++)
        mu[j] /= mu_norm;
    for (int j = 0; j < m; j++)
        tan[j] = 0;
    for (int j = 0; j < m; j++) {
        for (int l = 0; l < m; l++)
            e[l] = l == j ? 1.0 / (nrm[j] + MULTISLERP_EPS) : 0.0;
        double d = lm_coef_dot(g, m, e, mu);
        for (int l = 0; l < m; l++)
            tan[l] += w[j] * (e[l] - d * mu[l]);
    }
    double tn = sqrt(fmax(lm_coef_dot(g, m, tan, tan), 0)) + MULTISLERP_EPS;
    double avg = 0;
    for (int j = 0; j < m; j++)
        avg += nrm[j] * w[j];
    for (int j = 0; j < m; j++)
        r[j] = avg * (mu[j] * cos(tn) + tan[j] * (sin(tn) / tn));
done:
    if (s == LM_OK)
        lm_coef_from_vectors(in, models, r, a, c);
    free(g);
    return s;
}

const lm_method lm_method_multislerp = {
    .name = "multislerp",
    .id = LM_MERGE_MULTISLERP,
    .brief = "spherical weighted barycentre of several FTs' task vectors (or of the models)",
    .summary = "Multi-SLERP: the weighted barycentre of several fine-tunes' task vectors on the hypersphere\n"
               "(with --models-only, of the models themselves), each tensor one vector.",
    .formula = "  v_j = FT_j - BASE (with --models-only: the models), n_j = |v_j|, u_j = v_j / n_j;\n"
               "  m = sum_j w_j u_j / |...| (w normalized to sum 1 with --normalize);\n"
               "  T = sum_j w_j (u_j - <u_j, m> m); r = |T|;\n"
               "  v = (sum_j w_j n_j) (cos(r) m + sin(r) / r * T); result = BASE + v (--models-only: v).\n",
    .input = LM_METHOD_EITHER,
    .normalize = true,
    .linear = true,
    .coeffs = multislerp_coeffs,
    .gram = true,
    .min_inputs = 1,
    .ignores_lambda = "it interpolates, with no task vector to scale",
};
