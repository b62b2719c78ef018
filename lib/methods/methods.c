// The methods llmerge merges with: the registry of method.h's descriptors. A method is its
// descriptor file and its line here; this order is the order `llmerge --help` lists them in.
#include <string.h>

#include "method.h"

static const lm_method *const methods[] = {
    &lm_method_ties,
    &lm_method_dare,
    &lm_method_dare_ties,
    &lm_method_task_arithmetic,
    &lm_method_sparsegpt,
};

const lm_method *lm_method_at(size_t i)
{
    return i < sizeof methods / sizeof methods[0] ? methods[i] : NULL;
}

size_t lm_method_count(void)
{
    return sizeof methods / sizeof methods[0];
}

const lm_method *lm_method_of(lm_merge_method id)
{
    for (size_t i = 0; i < sizeof methods / sizeof methods[0]; i++)
        if (methods[i]->id == id)
            return methods[i];
    return &lm_method_ties;
}

const lm_method *lm_method_find(const char *name)
{
    for (size_t i = 0; i < sizeof methods / sizeof methods[0]; i++)
        if (strcmp(methods[i]->name, name) == 0)
            return methods[i];
    return NULL;
}

unsigned lm_method_stats(const lm_method *m, const lm_merge_opts *o)
{
    return (m->rank != LM_RANK_NONE ? LM_STAT_TOPK : 0u) | (m->drop && o->rescale == LM_RESCALE_L1 ? LM_STAT_L1 : 0u);
}
