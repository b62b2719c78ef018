// SCE (Wan et al. 2024, FuseChat): select the entries where the fine-tunes' task vectors vary most,
// calculate each FT's weight from its masked task vector's mean square, erase the entries that
// disagree with the sign of the task vectors' sum, and average the rest with those weights
// (docs/merging.md "sce"). Its passes are the engine's own (lib/merge_sce.c).
#include "method.h"

const lm_method lm_method_sce = {
    .name = "sce",
    .id = LM_MERGE_SCE,
    .brief = "keep where the task vectors vary most, weight by mean square, elect, average",
    .summary = "SCE merging: keep the entries where the fine-tunes' task vectors vary most (the top\n"
               "--select-topk of the nonzero variances, one mask for all), weight each FT by its masked\n"
               "task vector's mean square, elect a sign per entry from the sum of the task vectors, and\n"
               "average the entries that agree with it with those weights.",
    .formula = "  tau_i = FT_i - BASE (s*B@A for a LoRA adapter); v = the variance of the tau_i per entry\n"
               "  (an FT that does not change the tensor counts as zeros); keep the floor(p * #(v != 0))\n"
               "  entries of largest v in every tau_i (--select-topk p; p >= 1 keeps all);\n"
               "  w_i = mean(tau_i^2) / sum_j mean(tau_j^2) (1/N each when that sum is below 1e-6);\n"
               "  s = sign(sum_i tau_i) per entry; result = BASE + sum_i w_i tau_i [sign(tau_i) = s] /\n"
               "  sum_i w_i [sign(tau_i) = s].\n",
    .input = LM_METHOD_TASK_VECTORS,
    .normalize = true,
    .sce = true,
    .ignores_weights = "its weights are the task vectors' mean squares",
    .ignores_normalize = "it always divides by the weights of the FTs that agree",
    .ignores_lambda = "it does not scale the merged task vector",
};
