// SparseGPT-importance merging: TIES with each task vector trimmed to the entries of largest
// importance τ² / U_cc² (U the Cholesky factor of the inverse Hessian of the layer's inputs on
// calibration data), entries of tensors without a Hessian by magnitude (docs/merging.md "The
// methods"). The Hessians come from the caller (lm_merge_opts' ucc2).
#include "method.h"

const lm_method lm_method_sparsegpt = {
    .name = "sparsegpt",
    .id = LM_MERGE_SPARSEGPT,
    .input = LM_METHOD_TASK_VECTORS,
    .density = true,
    .normalize = true,
    .rank = LM_RANK_IMPORTANCE,
    .elect = true,
};
