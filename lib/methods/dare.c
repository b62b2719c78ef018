// DARE merging (Yu et al. 2023): each task-vector entry dropped at random with keep
// probability d_i, the kept ones rescaled, and the parts summed (docs/merging.md "The methods").
#include "method.h"

const lm_method lm_method_dare = {
    .name = "dare",
    .id = LM_MERGE_DARE,
    .input = LM_METHOD_TASK_VECTORS,
    .density = true,
    .drop = true,
};
