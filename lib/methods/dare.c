// DARE merging (Yu et al. 2023): each task-vector entry dropped at random with keep
// probability d_i, the kept ones rescaled, and the parts summed (docs/merging.md "The methods").
#include "method.h"

const lm_method lm_method_dare = {
    .name = "dare",
    .id = LM_MERGE_DARE,
    .brief = "DARE merge: drop task-vector entries at random, rescale the rest, sum",
    .summary = "DARE merging: drop each task-vector entry at random, rescale the kept ones, and sum.",
    .formula = "  tau_i = FT_i - BASE (s*B@A for a LoRA adapter); each entry kept with probability d_i\n"
               "  (a pure function of the seed, the input, the tensor name and the index) and the kept\n"
               "  ones multiplied by 1/d_i (--rescale l1: by |tau_i|_1 / |kept|_1);\n"
               "  delta = sum_i w_i * tau_i (divided by sum_i w_i with --normalize);\n"
               "  result = BASE + lambda * delta.\n",
    .input = LM_METHOD_TASK_VECTORS,
    .density = true,
    .drop = true,
};
