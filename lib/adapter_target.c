// PEFT LoRA adapters, which modules get LoRA (adapter.h): PEFT's patterns run with PCRE2, the
// rules by which PEFT decides whether a module is adapted (target_modules, exclude_modules,
// modules_to_save, layers_to_transform), its default targets per model_type, and
// lm_adapter_select, which sets aside the modules PEFT would not load. How the patterns are
// read as Python reads them: adapter.c's opening comment.
#include "adapter_int.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "util.h"

// ==== regexes (PCRE2) =========================================================================

struct lm_lora_re {
    pcre2_code *code;
    pcre2_match_context *mctx;  // the limits
    const char *key;            // the config key it came from ("rank_pattern"; static)
    char *pattern;              // as written in the file
};

void lm_lora_re_free(lm_lora_re *re)
{
    if (!re)
        return;
    pcre2_code_free(re->code);
    pcre2_match_context_free(re->mctx);
    free(re->pattern);
    free(re);
}

// Python reads `{,n}` as {0,n} and `{,}` as `*`; PCRE2 before 10.43 reads both as literal
// text, and every PCRE2 reads `{,}` so. Returns the offset of the first such quantifier in
// `p` (outside a character class), or -1.
static long brace_quantifier_at(const char *p)
{
    bool in_class = false;
    for (size_t i = 0; p[i]; i++) {
        if (p[i] == '\\') {
            if (!p[++i])
                break;
            continue;
        }
        if (in_class) {
            in_class = p[i] != ']';
            continue;
        }
        if (p[i] == '[') {
            in_class = true;
            if (p[i + 1] == '^')
                i++;
            if (p[i + 1] == ']')  // a leading ']' is literal
                i++;
            continue;
        }
        if (p[i] == '{' && p[i + 1] == ',') {
            size_t j = i + 2;
            while (p[j] >= '0' && p[j] <= '9')
                j++;
            bool digits = j > i + 2;
#if PCRE2_MAJOR > 10 || (PCRE2_MAJOR == 10 && PCRE2_MINOR >= 43)
            if (p[j] == '}' && !digits)
                return (long)i;
#else
            (void)digits;
            if (p[j] == '}')
                return (long)i;
#endif
        }
    }
    return -1;
}

// Compiles head + pattern + tail with `opts` (PCRE2_ANCHORED for Python's re.match, with
// PCRE2_ENDANCHORED for re.fullmatch) into *out. LM_ERR_FORMAT naming the file (label), the key
// and the pattern when it is too long, does not compile or uses a form PCRE2 reads otherwise
// than Python.
lm_status lm_lora_re_compile(lm_lora_re **out, const char *label, const char *key, const char *pattern,
                                    const char *head, const char *tail, uint32_t opts, lm_err *err)
{
    *out = NULL;
    size_t len = strlen(pattern);
    if (len > LM_LORA_RE_MAX_LEN)
        return lm_err_set(err, LM_ERR_FORMAT, "%s: key '%s': regex '%.60s...' is %zu bytes long, over the "
                          "limit of %d", label, key, pattern, len, LM_LORA_RE_MAX_LEN);
    long at = brace_quantifier_at(pattern);
    if (at >= 0)
        return lm_err_set(err, LM_ERR_FORMAT, "%s: key '%s': regex '%s' uses the quantifier '{,n}' or '{,}' "
                          "(at byte %ld), which Python reads as {0,n} and PCRE2 %d.%d as literal text: write "
                          "{0,n} or *", label, key, pattern, at, PCRE2_MAJOR, PCRE2_MINOR);
    char *full = lm_strfmt("%s%s%s", head, pattern, tail);
    lm_lora_re *re = calloc(1, sizeof *re);
    pcre2_compile_context *cctx = pcre2_compile_context_create(NULL);
    lm_status s = LM_OK;
    if (!full || !re || !cctx || !(re->pattern = lm_strdup(pattern)) ||
        !(re->mctx = pcre2_match_context_create(NULL))) {
        s = lm_err_set(err, LM_ERR_NOMEM, "%s: out of memory", label);
        goto done;
    }
    re->key = key;
    // Python's `.` stops at "\n" alone; `$` matches at the end and before a final "\n".
    pcre2_set_newline(cctx, PCRE2_NEWLINE_LF);
    int code;
    PCRE2_SIZE off;
    re->code = pcre2_compile((PCRE2_SPTR)full, PCRE2_ZERO_TERMINATED,
                             opts | PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF |
                                 PCRE2_NEVER_BACKSLASH_C, &code, &off, cctx);
    if (!re->code) {
        PCRE2_UCHAR why[256];
        pcre2_get_error_message(code, why, sizeof why);
        size_t hl = strlen(head);
        size_t in = off < hl ? 0 : off - hl > len ? len : off - hl;
        s = code == PCRE2_ERROR_HEAPLIMIT || code == PCRE2_ERROR_NOMEMORY
                ? lm_err_set(err, LM_ERR_NOMEM, "%s: key '%s': regex '%s': out of memory compiling it", label,
                             key, pattern)
                : lm_err_set(err, LM_ERR_FORMAT, "%s: key '%s': regex '%s' does not compile: %s (at byte %zu)",
                             label, key, pattern, (const char *)why, in);
        goto done;
    }
    pcre2_set_match_limit(re->mctx, LM_LORA_RE_MATCH_LIMIT);
    pcre2_set_depth_limit(re->mctx, LM_LORA_RE_DEPTH_LIMIT);
    pcre2_set_heap_limit(re->mctx, LM_LORA_RE_HEAP_KIB);
    *out = re;
    re = NULL;
done:
    pcre2_compile_context_free(cctx);
    lm_lora_re_free(re);
    free(full);
    return s;
}

// Matches `re` against `subject` (a module path): *hit says whether it matched; *g1 / *g1_len
// (g1 may be NULL) get capture group 1, NULL when it did not take part. LM_ERR_FORMAT naming the
// file, the key, the pattern and the subject when the match runs past a limit.
lm_status lm_lora_re_match(const lm_lora_re *re, const char *label, const char *subject, bool *hit,
                                  const char **g1, size_t *g1_len, lm_err *err)
{
    *hit = false;
    if (g1)
        *g1 = NULL;
    pcre2_match_data *md = pcre2_match_data_create_from_pattern(re->code, NULL);
    if (!md)
        return lm_err_set(err, LM_ERR_NOMEM, "%s: out of memory", label);
    int rc = pcre2_match(re->code, (PCRE2_SPTR)subject, strlen(subject), 0, 0, md, re->mctx);
    lm_status s = LM_OK;
    if (rc >= 0) {
        *hit = true;
        PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
        if (g1 && rc >= 2 && ov[2] != PCRE2_UNSET) {
            *g1 = subject + ov[2];
            *g1_len = ov[3] - ov[2];
        }
    } else if (rc != PCRE2_ERROR_NOMATCH) {
        PCRE2_UCHAR why[256];
        pcre2_get_error_message(rc, why, sizeof why);
        s = rc == PCRE2_ERROR_NOMEMORY
                ? lm_err_set(err, LM_ERR_NOMEM, "%s: out of memory matching key '%s' regex '%s'", label,
                             re->key, re->pattern)
                : lm_err_set(err, LM_ERR_FORMAT, "%s: key '%s': regex '%s' runs past its limits matching "
                             "module '%s' (PCRE2: %s)", label, re->key, re->pattern, subject, (const char *)why);
    }
    pcre2_match_data_free(md);
    return s;
}

// ==== which modules get LoRA ==================================================================

// PEFT's list rule: the module is `name`, or ends with "." + name.
static bool names_module(const char *path, const char *name)
{
    size_t lp = strlen(path), ln = strlen(name);
    return strcmp(path, name) == 0 ||
           (lp > ln && path[lp - ln - 1] == '.' && strcmp(path + lp - ln, name) == 0);
}

const char *lm_lora_select_reason(lm_lora_select why)
{
    switch (why) {
    case LM_LORA_SELECTED: return "selected";
    case LM_LORA_NOT_TARGETED: return "target_modules does not select it";
    case LM_LORA_EXCLUDED: return "exclude_modules excludes it";
    case LM_LORA_SAVED_MODULE: return "it is in modules_to_save (or inside one), which PEFT puts no LoRA on";
    case LM_LORA_OTHER_LAYER: return "its layer is not in layers_to_transform";
    case LM_LORA_NO_LAYER: return "layers_to_transform is given and its path has no layer index";
    case LM_LORA_NOT_LINEAR: return "target_modules is all-linear and it is not a linear layer";
    case LM_LORA_TIED:
        return "lm_head is tied to embed_tokens (ensure_weight_tying), and its keys are embed_tokens' own";
    }
    return "unknown";
}

// The layer index PEFT reads from `path` for layers_to_transform: group 1 of the first layer
// regex that matches; *found false when none does. A group that is not a number (a
// layers_pattern with a group of its own) is LM_ERR_FORMAT, where PEFT fails too.
static lm_status layer_of(const lm_lora_config *cfg, const char *path, bool *found, int64_t *layer,
                          lm_err *err)
{
    *found = false;
    *layer = -1;
    for (int64_t i = 0; i < cfg->n_layer_re; i++) {
        const char *g;
        size_t gl = 0;
        lm_status s = lm_lora_re_match(cfg->layer_re[i], cfg->path, path, found, &g, &gl, err);
        if (s != LM_OK)
            return s;
        if (!*found)
            continue;
        bool digits = g && gl > 0;
        for (size_t j = 0; digits && j < gl; j++)
            digits = g[j] >= '0' && g[j] <= '9';
        if (!digits)
            return lm_err_set(err, LM_ERR_FORMAT, "%s: key '%s': regex '%s' takes '%.*s' from module '%s' as "
                              "its layer index, which is not a number of ASCII digits", cfg->path,
                              cfg->layer_re[i]->key, cfg->layer_re[i]->pattern, g ? (int)gl : 6,
                              g ? g : "(none)", path);
        for (; gl > 1 && *g == '0'; gl--)
            g++;
        // a number past int64 is no index layers_to_transform can hold
        *layer = gl > 18 ? INT64_MAX : strtoll(g, NULL, 10);
        return LM_OK;
    }
    return LM_OK;
}

lm_status lm_lora_config_select(const lm_lora_config *cfg, const char *path, lm_lora_select *why,
                                int64_t *layer, lm_err *err)
{
    *why = LM_LORA_SELECTED;
    if (layer)
        *layer = -1;
    bool hit = false;
    lm_status s;

    if (cfg->exclude_re) {
        if ((s = lm_lora_re_match(cfg->exclude_re, cfg->path, path, &hit, NULL, NULL, err)) != LM_OK)
            return s;
    } else {
        for (int64_t i = 0; i < cfg->n_exclude_modules && !hit; i++)
            hit = names_module(path, cfg->exclude_modules[i]);
    }
    if (hit) {
        *why = LM_LORA_EXCLUDED;
        return LM_OK;
    }
    for (int64_t i = 0; cfg->saved_re && i < cfg->n_modules_to_save && !hit; i++)
        if ((s = lm_lora_re_match(cfg->saved_re[i], cfg->path, path, &hit, NULL, NULL, err)) != LM_OK)
            return s;
    if (hit) {
        *why = LM_LORA_SAVED_MODULE;
        return LM_OK;
    }

    bool by_suffix = false;  // layers_to_transform applies to a list matched by suffix only
    switch (cfg->targets) {
    case LM_LORA_TARGETS_NONE:
        return LM_OK;
    case LM_LORA_TARGETS_REGEX:
        if ((s = lm_lora_re_match(cfg->target_re, cfg->path, path, &hit, NULL, NULL, err)) != LM_OK)
            return s;
        break;
    case LM_LORA_TARGETS_ALL_LINEAR:
        if (strcmp(path, "lm_head") == 0 || lm_str_ends_with(path, ".lm_head"))
            *why = LM_LORA_NOT_LINEAR;
        return LM_OK;
    case LM_LORA_TARGETS_LIST:
        for (int64_t i = 0; i < cfg->n_target_modules && !hit; i++)
            hit = strcmp(path, cfg->target_modules[i]) == 0;
        for (int64_t i = 0; i < cfg->n_target_modules && !hit; i++)
            by_suffix = hit = names_module(path, cfg->target_modules[i]);
        break;
    }
    if (!hit) {
        *why = LM_LORA_NOT_TARGETED;
        return LM_OK;
    }
    if (!by_suffix || cfg->n_layers_to_transform == 0)
        return LM_OK;
    bool found;
    int64_t idx;
    if ((s = layer_of(cfg, path, &found, &idx, err)) != LM_OK)
        return s;
    if (layer)
        *layer = idx;
    if (!found) {
        *why = LM_LORA_NO_LAYER;
        return LM_OK;
    }
    for (int64_t i = 0; i < cfg->n_layers_to_transform; i++)
        if (cfg->layers_to_transform[i] == idx)
            return LM_OK;
    *why = LM_LORA_OTHER_LAYER;
    return LM_OK;
}

// ==== which modules PEFT loads ================================================================

// PEFT's default target_modules per model_type, used when target_modules is null
// (TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING): names separated by spaces, or a regex.
static const struct {
    const char *model_type;
    const char *names;  // or NULL
    const char *regex;  // or NULL
} peft_default_targets[] = {
    {"t5", "q v", NULL}, {"mt5", "q v", NULL}, {"bart", "q_proj v_proj", NULL},
    {"gpt2", "c_attn", NULL}, {"bloom", "query_key_value", NULL},
    {"blip-2", "q v q_proj v_proj", NULL}, {"opt", "q_proj v_proj", NULL},
    {"gptj", "q_proj v_proj", NULL}, {"gpt_neox", "query_key_value", NULL},
    {"gpt_neo", "q_proj v_proj", NULL}, {"bert", "query value", NULL},
    {"roberta", "query value", NULL}, {"xlm-roberta", "query value", NULL},
    {"electra", "query value", NULL}, {"deberta-v2", "query_proj value_proj", NULL},
    {"deberta", "in_proj", NULL}, {"layoutlm", "query value", NULL},
    {"llama", "q_proj v_proj", NULL}, {"llama4", "q_proj v_proj", NULL},
    {"chatglm", "query_key_value", NULL}, {"gpt_bigcode", "c_attn", NULL}, {"mpt", "Wqkv", NULL},
    {"RefinedWebModel", "query_key_value", NULL}, {"RefinedWeb", "query_key_value", NULL},
    {"falcon", "query_key_value", NULL}, {"btlm", "c_proj c_attn", NULL},
    {"codegen", "qkv_proj", NULL}, {"mistral", "q_proj v_proj", NULL},
    {"mixtral", "q_proj v_proj", NULL}, {"stablelm", "q_proj v_proj", NULL},
    {"phi", "q_proj v_proj fc1 fc2", NULL}, {"gemma", "q_proj v_proj", NULL},
    {"gemma2", "q_proj v_proj", NULL}, {"gemma3_text", "q_proj v_proj", NULL},
    {"gemma4", NULL, ".*language_model\\..*\\.(q_proj|v_proj)"}, {"qwen2", "q_proj v_proj", NULL},
    {"qwen3", "q_proj v_proj", NULL}, {"nemotron_h", "q_proj k_proj v_proj o_proj", NULL},
    {"rwkv", "key value receptance output", NULL},
    {"rwkv7", "r_proj k_proj v_proj o_proj key value", NULL},
};
#define N_PEFT_DEFAULT_TARGETS (sizeof peft_default_targets / sizeof peft_default_targets[0])

// The base's model_type: config.json's, or the one of its known architecture.
static const char *base_model_type(const lm_model *base)
{
    const lm_config *c = &base->config;
    if (c->model_type)
        return c->model_type;
    switch (c->arch) {
    case LM_ARCH_LLAMA: return "llama";
    case LM_ARCH_MISTRAL: return "mistral";
    case LM_ARCH_QWEN2: return "qwen2";
    case LM_ARCH_UNKNOWN: break;
    }
    return NULL;
}

// A null target_modules becomes PEFT's default for the base's model_type, as PEFT does when it
// injects the adapter; LM_ERR_FORMAT when PEFT has none.
static lm_status default_targets(lm_lora_config *cfg, const lm_model *base, lm_err *err)
{
    const char *mt = base_model_type(base);
    for (size_t i = 0; mt && i < N_PEFT_DEFAULT_TARGETS; i++) {
        if (strcmp(mt, peft_default_targets[i].model_type) != 0)
            continue;
        const char *names = peft_default_targets[i].names;
        if (!names) {
            if (!(cfg->target_regex = lm_strdup(peft_default_targets[i].regex)))
                return lm_err_set(err, LM_ERR_NOMEM, "%s: out of memory", cfg->path);
            lm_status s = lm_lora_re_compile(&cfg->target_re, cfg->path, "target_modules", cfg->target_regex, "", "",
                                             PCRE2_ANCHORED | PCRE2_ENDANCHORED, err);
            if (s != LM_OK)
                return s;
            cfg->targets = LM_LORA_TARGETS_REGEX;
        } else {
            int64_t n = 1;
            for (const char *p = names; *p; p++)
                n += *p == ' ';
            if (!(cfg->target_modules = calloc((size_t)n, sizeof *cfg->target_modules)))
                return lm_err_set(err, LM_ERR_NOMEM, "%s: out of memory", cfg->path);
            for (const char *p = names; *p;) {
                size_t l = strcspn(p, " ");
                if (!(cfg->target_modules[cfg->n_target_modules] = lm_strfmt("%.*s", (int)l, p)))
                    return lm_err_set(err, LM_ERR_NOMEM, "%s: out of memory", cfg->path);
                cfg->n_target_modules++;
                p += l + (p[l] == ' ');
            }
            cfg->targets = LM_LORA_TARGETS_LIST;
        }
        cfg->targets_default_for = peft_default_targets[i].model_type;
        return LM_OK;
    }
    if (!mt)
        return lm_err_set(err, LM_ERR_FORMAT, "%s: key 'target_modules' is null, and the base model %s has no "
                          "model_type to take PEFT's default target modules from: name the modules in "
                          "target_modules", cfg->path, base->dir);
    return lm_err_set(err, LM_ERR_FORMAT, "%s: key 'target_modules' is null, and PEFT has no default target "
                      "modules for model_type '%s' of the base model %s: name the modules in target_modules",
                      cfg->path, mt, base->dir);
}

// target_modules as the config gives it, for messages: ["a", "b"], 'regex' or 'all-linear'.
static void targets_str(const lm_lora_config *cfg, char *buf, size_t cap)
{
    size_t o = 0;
    buf[0] = '\0';
    switch (cfg->targets) {
    case LM_LORA_TARGETS_NONE: snprintf(buf, cap, "null"); return;
    case LM_LORA_TARGETS_REGEX: snprintf(buf, cap, "'%s'", cfg->target_regex); return;
    case LM_LORA_TARGETS_ALL_LINEAR: snprintf(buf, cap, "'all-linear'"); return;
    case LM_LORA_TARGETS_LIST:
        o += (size_t)snprintf(buf, cap, "[");
        for (int64_t i = 0; i < cfg->n_target_modules && o < cap; i++)
            o += (size_t)snprintf(buf + o, cap - o, "%s\"%s\"", i ? ", " : "", cfg->target_modules[i]);
        if (o < cap)
            snprintf(buf + o, cap - o, "]");
        return;
    }
}

// Whether target_modules selects at least one 2-D weight of the base; LM_ERR_FORMAT naming
// adapter_config.json and the key when it selects none (PEFT's "Target modules ... not found in
// the base model"), unless it is "dummy-target-modules", which PEFT lets select none.
static lm_status check_base_targets(const lm_lora_config *cfg, const lm_model *base, lm_err *err)
{
    // PEFT's name for no targets (an adapter of saved modules only): it selects none, knowingly
    if (cfg->targets == LM_LORA_TARGETS_REGEX && strcmp(cfg->target_regex, "dummy-target-modules") == 0)
        return LM_OK;
    bool seen[LM_LORA_NOT_LINEAR + 1] = {false};
    for (int64_t i = 0; i < base->n_tensors; i++) {
        const lm_st_tensor *t = base->tensors[i];
        size_t l = strlen(t->name);
        if (t->ndim != 2 || !lm_str_ends_with(t->name, ".weight"))
            continue;
        char *module = lm_strfmt("%.*s", (int)(l - strlen(".weight")), t->name);
        if (!module)
            return lm_err_set(err, LM_ERR_NOMEM, "%s: out of memory", cfg->path);
        lm_lora_select why;
        lm_status s = lm_lora_config_select(cfg, module, &why, NULL, err);
        free(module);
        if (s != LM_OK)
            return s;
        if (why == LM_LORA_SELECTED)
            return LM_OK;
        seen[why] = true;
    }
    char targets[LM_ERR_MSG_MAX / 4], after[160] = "";
    targets_str(cfg, targets, sizeof targets);
    if (cfg->targets_default_for)
        snprintf(targets + strlen(targets), sizeof targets - strlen(targets),
                 ", PEFT's default for model_type '%s'", cfg->targets_default_for);
    static const struct { lm_lora_select why; const char *key; } rules[] = {
        {LM_LORA_EXCLUDED, "exclude_modules"}, {LM_LORA_SAVED_MODULE, "modules_to_save"},
        {LM_LORA_OTHER_LAYER, "layers_to_transform"}, {LM_LORA_NO_LAYER, "layers_to_transform"},
    };
    // the keys that left out what target_modules named
    const char *keys[3];
    int n = 0;
    for (size_t i = 0; i < sizeof rules / sizeof rules[0]; i++)
        if (seen[rules[i].why] && (n == 0 || strcmp(keys[n - 1], rules[i].key) != 0))
            keys[n++] = rules[i].key;
    if (n)
        snprintf(after, sizeof after, " once %s%s%s%s%s %s applied", keys[0], n == 3 ? ", " : n == 2 ? " and " : "",
                 n > 1 ? keys[1] : "", n == 3 ? " and " : "", n == 3 ? keys[2] : "", n == 1 ? "is" : "are");
    return lm_err_set(err, LM_ERR_FORMAT, "%s: key 'target_modules' (%s) selects no layer of the base model "
                      "%s%s: PEFT refuses to load such an adapter", cfg->path, targets, base->dir, after);
}

// Rebuilds by_target from modules and saved.
static lm_status claim_all(lm_adapter *a, lm_err *err)
{
    lm_strmap_free(&a->by_target);
    if (lm_strmap_init(&a->by_target, (size_t)a->st->n_tensors) != LM_OK)
        return lm_err_set(err, LM_ERR_NOMEM, "%s: out of memory", a->weights_path);
    lm_status s = LM_OK;
    for (int64_t i = 0; i < a->n_modules && s == LM_OK; i++) {
        const lm_lora_module *m = &a->modules[i];
        s = lm_adapter_claim_target(a, m->base_name, LM_TOUCH_LORA, i, m->b->name, err);
        if (s == LM_OK && m->bias)
            s = lm_adapter_claim_target(a, m->bias_name, LM_TOUCH_BIAS, i, m->bias->name, err);
    }
    for (int64_t i = 0; i < a->n_saved && s == LM_OK; i++)
        s = lm_adapter_claim_target(a, a->saved[i].base_name, LM_TOUCH_SAVED, i, a->saved[i].t->name, err);
    return s;
}

// Whether PEFT ties the base's lm_head to embed_tokens' adapter: ensure_weight_tying, on a base
// whose config ties them (and which holds no lm_head of its own).
static bool tied_head(const lm_lora_config *cfg, const lm_model *base)
{
    return cfg->ensure_weight_tying && base->config.tie_word_embeddings && !lm_model_find(base, "lm_head.weight");
}

// Whether tensors x and y hold the same values, y read transposed when `transposed` (both 2-D).
static bool same_values(const lm_st_tensor *x, const lm_st_tensor *y, bool transposed)
{
    if (!x || !y || x->ndim != 2 || y->ndim != 2 || x->numel != y->numel ||
        x->shape[0] != y->shape[transposed ? 1 : 0])
        return false;
    if (!transposed)
        return x->dtype == y->dtype && x->nbytes == y->nbytes && memcmp(x->data, y->data, (size_t)x->nbytes) == 0;
    int64_t rows = x->shape[0], cols = x->shape[1];
    lm_err ignored = {0};
    float *xv = lm_convert_to_f32_new(x->data, x->dtype, x->numel, &ignored);
    float *yv = lm_convert_to_f32_new(y->data, y->dtype, y->numel, &ignored);
    bool same = xv && yv;
    for (int64_t i = 0; same && i < rows; i++)
        for (int64_t j = 0; same && j < cols; j++)
            same = memcmp(&xv[i * cols + j], &yv[j * rows + i], sizeof *xv) == 0;
    free(xv);
    free(yv);
    return same;
}

// On a base whose lm_head is tied to embed_tokens, under ensure_weight_tying: lm_head's keys,
// where the adapter has them, must be embed_tokens' own, as PEFT saves a tied pair (a copy of the
// saved embedding; the embedding's factors transposed). Other values are refused: PEFT 0.19 and
// later load them into the tied tensors at both ends, PEFT 0.18 keeps the two apart, and the base
// has one tensor for both.
static lm_status check_tied_copies(const lm_adapter *a, lm_err *err)
{
    const lm_lora_module *head = NULL, *emb = NULL;
    const lm_st_tensor *head_saved = NULL, *emb_saved = NULL;
    for (int64_t i = 0; i < a->n_modules; i++) {
        const lm_lora_module *m = &a->modules[i];
        if (strcmp(m->path, "lm_head") == 0)
            head = m;
        else if (m->kind == LM_LORA_EMBEDDING && lm_str_ends_with(m->base_name, "embed_tokens.weight"))
            emb = m;
    }
    for (int64_t i = 0; i < a->n_saved; i++) {
        if (strcmp(a->saved[i].base_name, "lm_head.weight") == 0)
            head_saved = a->saved[i].t;
        else if (lm_str_ends_with(a->saved[i].base_name, "embed_tokens.weight"))
            emb_saved = a->saved[i].t;
    }
    bool ok = (!head || (emb && same_values(head->a, emb->b, true) && same_values(head->b, emb->a, true))) &&
              (!head_saved || same_values(head_saved, emb_saved, false));
    if (ok)
        return LM_OK;
    return lm_err_set(err, LM_ERR_FORMAT, "%s: lm_head's keys ('%s') are not embed_tokens' own, and the base ties "
                      "the two (ensure_weight_tying is set): PEFT 0.19 and later would put lm_head's values in both, "
                      "PEFT 0.18 would keep them apart, and llmerge does not guess which", a->weights_path,
                      head ? head->a->name : head_saved->name);
}

lm_status lm_adapter_select(lm_adapter *a, const lm_model *base, lm_err *err)
{
    if (a->selected)
        return LM_OK;
    lm_lora_config *cfg = &a->config;
    lm_status s;
    if (base && cfg->targets == LM_LORA_TARGETS_NONE && (s = default_targets(cfg, base, err)) != LM_OK)
        return s;
    if (base && cfg->targets != LM_LORA_TARGETS_NONE && (s = check_base_targets(cfg, base, err)) != LM_OK)
        return s;

    // Decide every module first, so that on failure the adapter is as it was.
    lm_lora_select *why = calloc((size_t)a->n_modules + 1, sizeof *why);
    int64_t *layer = calloc((size_t)a->n_modules + 1, sizeof *layer);
    int64_t n_out = 0;
    s = why && layer ? LM_OK : lm_err_set(err, LM_ERR_NOMEM, "%s: out of memory", cfg->path);
    bool tied = base && tied_head(cfg, base);
    if (s == LM_OK && tied)
        s = check_tied_copies(a, err);
    for (int64_t i = 0; i < a->n_modules && s == LM_OK; i++) {
        const lm_lora_module *m = &a->modules[i];
        if (tied && strcmp(m->path, "lm_head") == 0) {
            why[i] = LM_LORA_TIED;
            n_out++;
            continue;
        }
        if ((s = lm_lora_config_select(cfg, m->path, &why[i], &layer[i], err)) != LM_OK)
            break;
        if (why[i] == LM_LORA_SELECTED && cfg->targets == LM_LORA_TARGETS_ALL_LINEAR) {
            // all-linear: the linear layers of the base, which an embedding or a base weight
            // that is not 2-D is not
            const lm_st_tensor *w = base ? lm_model_find(base, m->base_name) : NULL;
            if (m->kind == LM_LORA_EMBEDDING || (w && w->ndim != 2))
                why[i] = LM_LORA_NOT_LINEAR;
        }
        n_out += why[i] != LM_LORA_SELECTED;
    }
    if (s == LM_OK && n_out && !(a->ignored = calloc((size_t)n_out, sizeof *a->ignored)))
        s = lm_err_set(err, LM_ERR_NOMEM, "%s: out of memory", cfg->path);
    if (s != LM_OK) {
        free(why);
        free(layer);
        return s;
    }

    int64_t kept = 0;
    for (int64_t i = 0; i < a->n_modules; i++) {
        lm_lora_module *m = &a->modules[i];
        if (why[i] == LM_LORA_SELECTED) {
            a->modules[kept++] = *m;
            continue;
        }
        lm_lora_ignored *g = &a->ignored[a->n_ignored++];
        *g = (lm_lora_ignored){.path = m->path, .why = why[i], .layer = layer[i],
                               .keys = {m->a, m->b, m->bias, m->magnitude}};
        free(m->base_name);
        free(m->bias_name);
    }
    for (int64_t i = kept; i < a->n_modules; i++)
        memset(&a->modules[i], 0, sizeof a->modules[i]);
    a->n_modules = kept;
    free(why);
    free(layer);
    // a saved lm_head that is the tied embed_tokens' copy (check_tied_copies) is the same tensor
    int64_t n_saved = 0;
    for (int64_t i = 0; i < a->n_saved; i++) {
        if (tied && strcmp(a->saved[i].base_name, "lm_head.weight") == 0) {
            free(a->saved[i].base_name);
            n_out++;
            continue;
        }
        a->saved[n_saved++] = a->saved[i];
    }
    a->n_saved = n_saved;
    a->selected = true;
    return n_out ? claim_all(a, err) : LM_OK;
}

void lm_adapter_ignored_msg(const lm_adapter *a, int64_t i, const char *verb, char *buf, size_t cap)
{
    const lm_lora_ignored *g = &a->ignored[i];
    size_t o = (size_t)snprintf(buf, cap, "keys");
    int n = 0;
    for (int k = 0; k < 4; k++)
        if (g->keys[k] && o < cap)
            o += (size_t)snprintf(buf + o, cap - o, "%s '%s'", n++ ? "," : "", g->keys[k]->name);
    if (o >= cap)
        return;
    if (g->why == LM_LORA_TIED)
        snprintf(buf + o, cap - o, " are not %s apart: module %s: %s", verb, g->path, lm_lora_select_reason(g->why));
    else if (g->why == LM_LORA_OTHER_LAYER)
        snprintf(buf + o, cap - o, " are not %s, as PEFT would not load them: module %s: its layer %" PRId64
                 " is not in layers_to_transform", verb, g->path, g->layer);
    else
        snprintf(buf + o, cap - o, " are not %s, as PEFT would not load them: module %s: %s", verb, g->path,
                 lm_lora_select_reason(g->why));
}
