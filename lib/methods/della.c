// DELLA (Deep, Bhardwaj et al. 2024): each task-vector entry dropped at random with a keep
// probability that grows with its magnitude rank in its row, the kept ones rescaled, then TIES's
// sign election and disjoint mean (docs/merging.md "della").
#include "method.h"

const lm_method lm_method_della = {
    .name = "della",
    .id = LM_MERGE_DELLA,
    .brief = "drop entries at random by their magnitude rank in the row, rescale, elect signs",
    .summary = "DELLA merging: drop each task-vector entry at random with a probability from its magnitude\n"
               "rank within its row (larger entries kept more often), rescale the kept ones, elect a sign\n"
               "per entry, and average the entries that agree with it.",
    .formula = "  tau_i = FT_i - BASE (s*B@A for a LoRA adapter); in each row (a vector is one row) the\n"
               "  entry of magnitude rank r of n (0 the smallest) is kept with probability\n"
               "  p = (d_i - e_i) + 2 e_i r / (n - 1) (--epsilon e_i), times 1/p (--rescale inv) or the\n"
               "  tensor times |tau_i|_1 / |kept|_1 (l1); W_i = w_i * tau_i; s = sign(sum_i W_i);\n"
               "  delta = sum of the W_i whose sign is s (divided by the sum of their w_i with\n"
               "  --normalize); result = BASE + lambda * delta.\n",
    .input = LM_METHOD_TASK_VECTORS,
    .density = true,
    .normalize = true,
    .drop = true,
    .della = true,
    .elect = true,
};
