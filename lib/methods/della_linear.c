// DELLA's drop by magnitude rank, summed without a sign election (docs/merging.md
// "della-linear").
#include "method.h"

const lm_method lm_method_della_linear = {
    .name = "della-linear",
    .id = LM_MERGE_DELLA_LINEAR,
    .brief = "della's drop by magnitude rank, the task vectors summed",
    .summary = "DELLA-linear merging: della's random drop by magnitude rank within each row and its\n"
               "rescale, then the weighted sum of the task vectors.",
    .formula = "  tau_i dropped and rescaled as in della; delta = sum_i w_i * tau_i (divided by\n"
               "  sum_i w_i with --normalize); result = BASE + lambda * delta.\n",
    .input = LM_METHOD_TASK_VECTORS,
    .density = true,
    .drop = true,
    .della = true,
};
