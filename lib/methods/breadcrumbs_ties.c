// Model Breadcrumbs with TIES' sign election: breadcrumbs' band of magnitudes per task vector,
// then a sign elected per entry and the entries that agree averaged (docs/merging.md
// "breadcrumbs-ties").
#include "method.h"

const lm_method lm_method_breadcrumbs_ties = {
    .name = "breadcrumbs-ties",
    .id = LM_MERGE_BREADCRUMBS_TIES,
    .brief = "breadcrumbs' band of magnitudes, then TIES' sign election",
    .summary = "Model Breadcrumbs with TIES: drop the largest (gamma) and the smallest magnitudes of each\n"
               "task vector, elect a sign per entry, and combine the entries that agree with it.",
    .formula = "  tau_i trimmed to its band as in breadcrumbs; W_i = w_i * tau_i;\n"
               "  s = sign(sum_i W_i) per entry (--sign count: of sum_i sign(W_i));\n"
               "  delta = sum of the W_i whose sign is s (divided by the sum of their w_i with\n"
               "  --normalize); result = BASE + lambda * delta.\n",
    .input = LM_METHOD_TASK_VECTORS,
    .density = true,
    .rank = LM_RANK_MAGNITUDE,
    .outliers = true,
    .elect = true,
};
