// RAM, Reinforced Agent Merging (mergekit's `ram`): of each task vector only the entries above
// epsilon in magnitude count; an entry that one fine-tune changes takes its change, one that
// several change the mean of theirs (docs/merging.md "ram").
#include "method.h"

const lm_method lm_method_ram = {
    .name = "ram",
    .id = LM_MERGE_RAM,
    .brief = "average each entry over the task vectors that change it by more than --epsilon",
    .summary = "RAM (Reinforced Agent Merging): the entries of each task vector above epsilon in\n"
               "magnitude count, the others not; each entry of the result is the mean of the changes\n"
               "that count there (one FT's change where only it changes the entry, none where no FT\n"
               "does).",
    .formula = "  tau_i = FT_i - BASE (s*B@A for a LoRA adapter); m_i = [|tau_i| > e_i] (--epsilon,\n"
               "  default 1e-5);\n"
               "  delta = sum_i w_i m_i tau_i, divided by sum_i w_i m_i where that is not 0 (normalize;\n"
               "  with the default weights 1: the mean over the FTs that change the entry);\n"
               "  result = BASE + lambda * delta.\n",
    .input = LM_METHOD_TASK_VECTORS,
    .normalize = true,
    .threshold = true,
};
