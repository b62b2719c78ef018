// RAM+ (tensor-local), mergekit's `ramplus_tl`: ram's trim and mean, with each fine-tune's own
// entries (those it alone changes) scaled by 1 + r·clamp(ρ_i, 0, alpha), ρ_i the ratio of its
// shared entries to its own over the tensor (docs/merging.md "ramplus-tl").
#include "method.h"

const lm_method lm_method_ramplus_tl = {
    .name = "ramplus-tl",
    .id = LM_MERGE_RAMPLUS,
    .brief = "ram, each FT's own entries scaled up by how much of it the others share",
    .summary = "RAM+ (tensor-local): as ram, the entries of each task vector above epsilon in magnitude\n"
               "count and each entry is the mean of the changes that count there; an entry only one FT\n"
               "changes is scaled by that FT's lambda_i = 1 + r * clamp(rho_i, 0, alpha), where rho_i\n"
               "is the number of its entries another FT changes too over the number only it changes,\n"
               "in the tensor.",
    .formula = "  tau_i = FT_i - BASE (s*B@A for a LoRA adapter); m_i = [|tau_i| > e_i] (--epsilon,\n"
               "  default 1e-5); c = sum_i m_i per entry;\n"
               "  rho_i = #(m_i and c > 1) / max(#(m_i and c = 1), e_i) over the tensor;\n"
               "  lambda_i = 1 + r * clamp(rho_i, 0, alpha) (--r, default 0.1; --alpha, default 0.2);\n"
               "  delta = lambda_i tau_i where c = 1 (i the FT that changes it), the mean of the m_i tau_i\n"
               "  where c > 1, 0 where c = 0; result = BASE + lambda * delta (--lambda).\n",
    .input = LM_METHOD_TASK_VECTORS,
    .threshold = true,
    .ramplus = true,
    .ignores_weights = "each FT's weight is its lambda_i",
    .ignores_normalize = "it takes the plain mean of the entries that count",
};
