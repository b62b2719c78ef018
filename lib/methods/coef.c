// Helpers shared by the coefficient functions of the methods that interpolate whole tensors
// (method.h's coeffs): the Gram matrix of the vectors a method works with, from the engine's
// matrix of θ_b and the task vectors, and the way back from coefficients of those vectors to
// the merge's a·θ_b + Σ c_i τ_i.
#include "method.h"

void lm_coef_vectors_gram(const lm_coef_in *in, bool models, double *g)
{
    int n = in->n, s = n + 1, m = models ? n + 1 : n;
    const double *G = in->gram;
    for (int j = 0; j < m; j++)
        for (int l = 0; l < m; l++) {
            if (!models) {
                g[j * m + l] = G[(j + 1) * s + (l + 1)];
                continue;
            }
            // x_j = θ_b + τ_j (τ_0 = 0): x_j·x_l = θ_b·θ_b + θ_b·τ_l + τ_j·θ_b + τ_j·τ_l
            double v = G[0];
            if (l > 0)
                v += G[l];
            if (j > 0)
                v += G[j * s];
            if (j > 0 && l > 0)
                v += G[j * s + l];
            g[j * m + l] = v;
        }
}

void lm_coef_from_vectors(const lm_coef_in *in, bool models, const double *r, double *a, double *c)
{
    if (!models) {
        *a = 1.0;
        for (int i = 0; i < in->n; i++)
            c[i] = r[i];
        return;
    }
    double sum = 0;
    for (int j = 0; j <= in->n; j++)
        sum += r[j];
    *a = sum;
    for (int i = 0; i < in->n; i++)
        c[i] = r[i + 1];
}

double lm_coef_dot(const double *g, int m, const double *v, const double *w)
{
    double s = 0;
    for (int j = 0; j < m; j++)
        for (int l = 0; l < m; l++)
            s += v[j] * g[j * m + l] * w[l];
    return s;
}
