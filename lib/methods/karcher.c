// The Karcher mean: the Riemannian mean of the models on the hypersphere, each tensor one vector,
// scaled by the mean of their norms (docs/merging.md "karcher"). The base is one of the models.
#include <math.h>
#include <stdlib.h>

#include "method.h"

// mergekit's iteration, on coefficients: the m models x_j with norms n_j and equal weights
// α = 1/m; the units u_j = x_j / n_j of those with n_j > tol, their weights renormalised; u =
// their weighted mean, made unit (the first unit where its norm is below tol); then up to
// max_iter times: T = Σ α_j (θ_j / sin θ_j)(u_j − cos θ_j u) over the units with θ_j =
// acos<u, u_j> >= tol; stop when ‖T‖ < tol; u = cos‖T‖ u + sin‖T‖ T/‖T‖, made unit. The result
// is (Σ α_j n_j) u (every model counted in the scale, zero ones too); zero if no norm exceeds tol.
static lm_status karcher_coeffs(const lm_coef_in *in, double *a, double *c, lm_err *err)
{
    int m = in->n + 1;
    double *g = malloc(sizeof(double) * (size_t)(m * m + 6 * m));
    if (!g)
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    double *nrm = g + m * m, *al = nrm + m, *u = al + m, *T = u + m, *r = T + m, *e = r + m;
    lm_coef_vectors_gram(in, true, g);
    double tol = in->o->tol, asum = 0;
    int first = -1;
    for (int j = 0; j < m; j++) {
        nrm[j] = sqrt(g[j * m + j] > 0 ? g[j * m + j] : 0);
        al[j] = nrm[j] > tol ? 1.0 / m : 0.0;
        asum += al[j];
        if (first < 0 && nrm[j] > tol)
            first = j;
    }
    for (int j = 0; j < m; j++)
        r[j] = 0;
    if (first < 0)
        goto done;
    for (int j = 0; j < m; j++) {
        al[j] /= asum;
        u[j] = al[j] > 0 ? al[j] / nrm[j] : 0.0;
    }
    double nu = sqrt(fmax(lm_coef_dot(g, m, u, u), 0));
    if (nu < tol) {
        for (int j = 0; j < m; j++)
            u[j] = j == first ? 1.0 / nrm[j] : 0.0;
    } else {
        for (int j = 0; j < m; j++)
            u[j] /= nu;
    }
    for (int it = 0; it < in->o->max_iter; it++) {
        for (int j = 0; j < m; j++)
            T[j] = 0;
        for (int j = 0; j < m; j++) {
            if (al[j] == 0)
                continue;
            for (int l = 0; l < m; l++)
                e[l] = l == j ? 1.0 / nrm[j] : 0.0;
            double dot = lm_coef_dot(g, m, u, e);
            dot = dot < -1 ? -1 : dot > 1 ? 1 : dot;
            double theta = acos(dot);
            if (theta < tol)
                continue;
            double f = al[j] * theta / sin(theta);
            for (int l = 0; l < m; l++)
                T[l] += f * (e[l] - dot * u[l]);
        }
        double nt = sqrt(fmax(lm_coef_dot(g, m, T, T), 0));
        if (nt < tol)
            break;
        for (int l = 0; l < m; l++)
            u[l] = cos(nt) * u[l] + sin(nt) * T[l] / nt;
        double un = sqrt(fmax(lm_coef_dot(g, m, u, u), 0));
        if (un > tol)
            for (int l = 0; l < m; l++)
                u[l] /= un;
    }
    double scale = 0;
    for (int j = 0; j < m; j++)
        scale += nrm[j] / m;
    for (int j = 0; j < m; j++)
        r[j] = scale * u[j];
done:
    lm_coef_from_vectors(in, true, r, a, c);
    free(g);
    return LM_OK;
}

const lm_method lm_method_karcher = {
    .name = "karcher",
    .id = LM_MERGE_KARCHER,
    .brief = "the Riemannian (Karcher) mean of the models on the sphere",
    .summary = "Karcher mean: the Riemannian mean of the models on the hypersphere, each tensor one vector,\n"
               "scaled by the mean of their norms. The first model is one of them; weights are equal.",
    .formula = "  u_j = MODEL_j / |MODEL_j|; u = the mean of the u_j, made unit; repeat up to --max-iter\n"
               "  times: T = mean_j (a_j / sin a_j) (u_j - cos a_j u) with a_j = angle(u, u_j),\n"
               "  stop when |T| < --tol, u = cos|T| u + sin|T| T/|T|;\n"
               "  result = mean_j |MODEL_j| * u.\n",
    .input = LM_METHOD_MODELS,
    .linear = true,
    .coeffs = karcher_coeffs,
    .gram = true,
    .min_inputs = 2,
    .reads_iter = true,
    .ignores_weights = "its models weigh equally",
    .ignores_normalize = "its models weigh equally",
    .ignores_lambda = "it takes the models' mean, with no task vector to scale",
};
