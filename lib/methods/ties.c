// TIES merging (Yadav et al. 2023): each task vector trimmed to its largest entries by
// magnitude, a sign elected per entry, and the entries that agree with it averaged
// (docs/merging.md "The methods").
#include "method.h"

const lm_method lm_method_ties = {
    .name = "ties",
    .id = LM_MERGE_TIES,
    .brief = "TIES merge: trim each task vector to its largest entries, elect signs, average",
    .summary = "TIES merging: trim each task vector to its largest entries, elect a sign per entry, and\n"
               "average the entries that agree with it.",
    .formula = "  tau_i = FT_i - BASE (s*B@A for a LoRA adapter), trimmed to the k = floor(d_i * numel)\n"
               "  entries of largest |tau_i| (ties at the threshold go to the lower index);\n"
               "  W_i = w_i * tau_i; s = sign(sum_i W_i) per entry (--sign count: of sum_i sign(W_i));\n"
               "  delta = sum of the W_i whose sign is s, divided by the sum of their w_i (normalize);\n"
               "  result = BASE + lambda * delta.\n",
    .input = LM_METHOD_TASK_VECTORS,
    .density = true,
    .normalize = true,
    .rank = LM_RANK_MAGNITUDE,
    .elect = true,
};
