// SparseGPT-importance merging: TIES with each task vector trimmed to the entries of largest
// importance τ² / U_cc² (U the Cholesky factor of the inverse Hessian of the layer's inputs on
// calibration data), entries of tensors without a Hessian by magnitude (docs/merging.md "The
// methods"). The Hessians come from the caller (lm_merge_opts' ucc2).
#include "method.h"

const lm_method lm_method_sparsegpt = {
    .name = "sparsegpt",
    .id = LM_MERGE_SPARSEGPT,
    .brief = "TIES with entries kept by Hessian importance on calibration data",
    .summary = "SparseGPT-importance merging: TIES, with each task vector trimmed to the entries that\n"
               "matter most to its layer's outputs on calibration data.",
    .formula = "  H = 2/n sum x x^T over the calibration tokens x entering each linear layer (from each\n"
               "  FT's own model, or the base's with --hessian-from base); U = the upper Cholesky factor\n"
               "  of (H + 0.01 mean(diag H) I)^-1; tau_i trimmed to the k = floor(d_i * numel) entries of\n"
               "  largest importance tau_jc^2 / U_cc^2 (ties to the lower index; tensors without a\n"
               "  Hessian, such as embeddings and norms, by |tau|); then TIES's sign election and\n"
               "  disjoint mean; result = BASE + lambda * delta.\n",
    .input = LM_METHOD_TASK_VECTORS,
    .density = true,
    .normalize = true,
    .rank = LM_RANK_IMPORTANCE,
    .elect = true,
};
