// Model Breadcrumbs (Davari and Belilovsky, 2023): each task vector keeps a band of its
// magnitudes, the largest γ_i·numel (outliers) and the smallest dropped, and the bands are summed
// (docs/merging.md "breadcrumbs").
#include "method.h"

const lm_method lm_method_breadcrumbs = {
    .name = "breadcrumbs",
    .id = LM_MERGE_BREADCRUMBS,
    .brief = "drop each task vector's largest (--gamma) and smallest magnitudes, sum the rest",
    .summary = "Model Breadcrumbs: drop the largest magnitudes of each task vector (a fraction gamma) and\n"
               "the smallest, keep a density d of it between them, and sum.",
    .formula = "  tau_i = FT_i - BASE (s*B@A for a LoRA adapter); of its entries ranked by |tau_i|\n"
               "  (ties to the lower index), drop the first floor(g_i * numel) and keep the next\n"
               "  floor(d_i * numel) (everything with d_i = 1);\n"
               "  delta = sum_i w_i * tau_i (divided by sum_i w_i with --normalize);\n"
               "  result = BASE + lambda * delta.\n",
    .input = LM_METHOD_TASK_VECTORS,
    .density = true,
    .rank = LM_RANK_MAGNITUDE,
    .outliers = true,
};
