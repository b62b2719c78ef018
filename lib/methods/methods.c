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
    &lm_method_linear,
    &lm_method_slerp,
    &lm_method_nuslerp,
    &lm_method_multislerp,
    &lm_method_karcher,
    &lm_method_model_stock,
    &lm_method_nearswap,
    &lm_method_breadcrumbs,
    &lm_method_breadcrumbs_ties,
    &lm_method_della,
    &lm_method_della_linear,
    &lm_method_sce,
    &lm_method_ram,
    &lm_method_ramplus_tl,
};

// mergekit's names where they differ from llmerge's by more than '_' for '-'.
static const struct {
    const char *alias, *name;
} aliases[] = {
    {"dare_linear", "dare"},
    {"dare-linear", "dare"},
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

// Whether a and b are equal with '_' and '-' taken as the same character.
static bool same_name(const char *a, const char *b)
{
    for (; *a && *b; a++, b++)
        if (*a != *b && !((*a == '_' || *a == '-') && (*b == '_' || *b == '-')))
            return false;
    return *a == *b;
}

const lm_method *lm_method_find(const char *name)
{
    for (size_t i = 0; i < sizeof aliases / sizeof aliases[0]; i++)
        if (strcmp(aliases[i].alias, name) == 0)
            name = aliases[i].name;
    for (size_t i = 0; i < sizeof methods / sizeof methods[0]; i++)
        if (same_name(methods[i]->name, name))
            return methods[i];
    return NULL;
}

double lm_method_epsilon(const lm_method *m)
{
    return m->threshold ? 1e-5 : 0.15;
}

unsigned lm_method_stats(const lm_method *m, const lm_merge_opts *o)
{
    return (m->rank != LM_RANK_NONE ? LM_STAT_TOPK : 0u) | (m->drop && o->rescale == LM_RESCALE_L1 ? LM_STAT_L1 : 0u) |
           (m->gram ? LM_STAT_GRAM : 0u);
}
