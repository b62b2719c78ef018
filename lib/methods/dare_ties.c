// DARE-TIES merging: DARE's random drop and rescale, then TIES's sign election and disjoint
// mean (docs/merging.md "The methods").
#include "method.h"

const lm_method lm_method_dare_ties = {
    .name = "dare-ties",
    .id = LM_MERGE_DARE_TIES,
    .brief = "DARE's random drop with TIES's sign election",
    .summary = "DARE-TIES merging: DARE's random drop and rescale, then TIES's sign election.",
    .formula = "  tau_i dropped and rescaled as in dare; W_i = w_i * tau_i; s = sign(sum_i W_i) per entry\n"
               "  (--sign count: of sum_i sign(W_i)); delta = sum of the W_i whose sign is s (divided by\n"
               "  the sum of their w_i with --normalize); result = BASE + lambda * delta.\n",
    .input = LM_METHOD_TASK_VECTORS,
    .density = true,
    .drop = true,
    .elect = true,
};
