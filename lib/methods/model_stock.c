// Model Stock (Jang et al. 2024): the fine-tunes' mean, interpolated from the base by a ratio
// that follows from the angle between their task vectors (docs/merging.md "model-stock").
#include <math.h>

#include "method.h"

// With N task vectors, cos θ = the mean over the pairs i < j of <τ_i, τ_j> / max(‖τ_i‖ ‖τ_j‖,
// 1e-6), each clamped to [−1, 1]; t = N cos θ / (1 + (N − 1) cos θ); θ = θ_b + t · mean(τ_i),
// that is a = 1 and c_i = t / N.
static lm_status model_stock_coeffs(const lm_coef_in *in, double *a, double *c, lm_err *err)
{
    (void)err;
    int n = in->n, s = n + 1;
    const double *G = in->gram;
    double sum = 0;
    int pairs = 0;
    for (int i = 0; i < n; i++)
        for (int j = i + 1; j < n; j++) {
            double ni = sqrt(fmax(G[(i + 1) * s + i + 1], 0)), nj = sqrt(fmax(G[(j + 1) * s + j + 1], 0));
            double cs = G[(i + 1) * s + j + 1] / fmax(ni * nj, 1e-6);
            sum += cs < -1 ? -1 : cs > 1 ? 1 : cs;
            pairs++;
        }
    double cos_t = sum / pairs;
    double t = n * cos_t / (1.0 + (n - 1) * cos_t);
    *a = 1.0;
    for (int i = 0; i < n; i++)
        c[i] = t / n;
    return LM_OK;
}

const lm_method lm_method_model_stock = {
    .name = "model-stock",
    .id = LM_MERGE_MODEL_STOCK,
    .brief = "the FTs' mean, interpolated from the base by the angle between their task vectors",
    .summary = "Model Stock: the fine-tunes' mean, moved towards the base by a ratio computed per tensor\n"
               "from the angles between their task vectors.",
    .formula = "  tau_i = FT_i - BASE (s*B@A for a LoRA adapter); cos = the mean over pairs i < j of\n"
               "  <tau_i, tau_j> / (|tau_i| |tau_j|) over the whole tensor;\n"
               "  t = N cos / (1 + (N-1) cos) for N FTs; result = BASE + t * mean_i tau_i.\n",
    .input = LM_METHOD_TASK_VECTORS,
    .linear = true,
    .coeffs = model_stock_coeffs,
    .gram = true,
    .rows_ok = true,
    .min_inputs = 2,
    .ignores_weights = "its ratio comes from the cosines between the task vectors",
    .ignores_normalize = "its ratio comes from the cosines between the task vectors",
    .ignores_lambda = "its ratio comes from the cosines between the task vectors",
};
