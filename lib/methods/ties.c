// TIES merging (Yadav et al. 2023): each task vector trimmed to its largest entries by
// magnitude, a sign elected per entry, and the entries that agree with it averaged
// (docs/merging.md "The methods").
#include "method.h"

const lm_method lm_method_ties = {
    .name = "ties",
    .id = LM_MERGE_TIES,
    .input = LM_METHOD_TASK_VECTORS,
    .density = true,
    .normalize = true,
    .rank = LM_RANK_MAGNITUDE,
    .elect = true,
};
