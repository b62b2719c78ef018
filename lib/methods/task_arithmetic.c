// Task arithmetic (Ilharco et al. 2023): the weighted sum of the whole task vectors added to
// the base (docs/merging.md "The methods").
#include "method.h"

const lm_method lm_method_task_arithmetic = {
    .name = "task-arithmetic",
    .id = LM_MERGE_TASK_ARITHMETIC,
    .brief = "add the weighted sum of the task vectors to the base",
    .summary = "Task arithmetic: add the weighted sum of the task vectors to the base.",
    .formula = "  tau_i = FT_i - BASE (s*B@A for a LoRA adapter), whole (no density);\n"
               "  delta = sum_i w_i * tau_i (divided by sum_i w_i with --normalize);\n"
               "  result = BASE + lambda * delta.\n",
    .input = LM_METHOD_TASK_VECTORS,
    .linear = true,
};
