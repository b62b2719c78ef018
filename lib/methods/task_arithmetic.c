// Task arithmetic (Ilharco et al. 2023): the weighted sum of the whole task vectors added to
// the base (docs/merging.md "The methods").
#include "method.h"

const lm_method lm_method_task_arithmetic = {
    .name = "task-arithmetic",
    .id = LM_MERGE_TASK_ARITHMETIC,
    .input = LM_METHOD_TASK_VECTORS,
    .linear = true,
};
