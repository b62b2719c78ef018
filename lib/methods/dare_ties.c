// DARE-TIES merging: DARE's random drop and rescale, then TIES's sign election and disjoint
// mean (docs/merging.md "The methods").
#include "method.h"

const lm_method lm_method_dare_ties = {
    .name = "dare-ties",
    .id = LM_MERGE_DARE_TIES,
    .input = LM_METHOD_TASK_VECTORS,
    .density = true,
    .drop = true,
    .elect = true,
};
