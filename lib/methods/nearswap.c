// NearSwap: the fine-tune's values where they are within t of the base's, the base's moved by
// at most t elsewhere (docs/merging.md "nearswap").
#include "method.h"

const lm_method lm_method_nearswap = {
    .name = "nearswap",
    .id = LM_MERGE_NEARSWAP,
    .brief = "the FT's values where they lie within --t of the base's",
    .summary = "NearSwap: take the fine-tune's value of each entry that lies within t of the base's; move\n"
               "the others towards it by t.",
    .formula = "  tau = FT - BASE (s*B@A for a LoRA adapter); w = clamp(t / max(|tau|, 1e-6), 0, 1)\n"
               "  per entry; result = BASE + w * tau (= FT where |tau| <= t, else BASE + t*sign(tau)).\n",
    .input = LM_METHOD_TASK_VECTORS,
    .linear = true,
    .nearswap = true,
    .min_inputs = 1,
    .max_inputs = 1,
    .reads_t = true,
    .ignores_weights = "it steps by --t",
    .ignores_normalize = "it steps by --t",
    .ignores_lambda = "it steps by --t",
};
