// PEFT LoRA adapters: see adapter.h. PEFT matches target_modules, exclude_modules,
// modules_to_save, layers_pattern, rank_pattern and alpha_pattern with Python's re; llmerge
// hands the patterns to PCRE2 as written, wrapped the way PEFT wraps them, with the options
// that make PCRE2 read them as Python reads a str pattern (UTF-8, Unicode properties for \d,
// \w, \s and \b, `.` not matching a newline, `$` also before a final newline), and bounds every
// match, so that no pattern can take unbounded time or memory. This file reads
// adapter_config.json and the adapter's keys, validates an adapter against a base and tells what
// a path is; adapter_target.c holds the regexes and which modules get LoRA (lm_adapter_select).
#include "adapter_int.h"

#include <cJSON.h>
#include <dirent.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>

#include "hfcache.h"
#include "json.h"

#define ADAPTER_CONFIG_MAX_BYTES (16u << 20)

static const char *const KEY_PREFIX = "base_model.model.";

// ==== adapter_config.json =====================================================================

static lm_status bad_key(const char *label, const char *key, const char *want, const cJSON *v,
                         lm_err *err)
{
    return lm_err_set(err, LM_ERR_FORMAT, "%s: key '%s' must be %s, not %s", label, key, want,
                      lm_json_kind(v));
}

static const cJSON *item(const cJSON *obj, const char *key)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
    return v && !cJSON_IsNull(v) ? v : NULL;
}

static bool is_integer(const cJSON *v)
{
    if (!cJSON_IsNumber(v))
        return false;
    double d = v->valuedouble;
    return isfinite(d) && d == floor(d) && fabs(d) <= 9007199254740992.0;
}

static lm_status get_bool(const cJSON *root, const char *key, bool *out, const char *label,
                          lm_err *err)
{
    const cJSON *v = item(root, key);
    if (!v)
        return LM_OK;
    if (!cJSON_IsBool(v))
        return bad_key(label, key, "true or false", v, err);
    *out = cJSON_IsTrue(v);
    return LM_OK;
}

// A list of strings (or null) into a new array of new strings.
static lm_status get_str_list(const cJSON *root, const char *key, char ***out, int64_t *n,
                              const char *label, lm_err *err)
{
    const cJSON *v = item(root, key);
    if (!v)
        return LM_OK;
    if (!cJSON_IsArray(v))
        return bad_key(label, key, "a list of strings", v, err);
    int count = cJSON_GetArraySize(v);
    *out = calloc((size_t)count + 1, sizeof **out);
    if (!*out)
        return lm_err_set(err, LM_ERR_NOMEM, "%s: out of memory", label);
    for (const cJSON *e = v->child; e; e = e->next) {
        if (!cJSON_IsString(e))
            return lm_err_set(err, LM_ERR_FORMAT, "%s: key '%s' must be a list of strings, but holds %s",
                              label, key, lm_json_kind(e));
        if (!((*out)[*n] = lm_strdup(e->valuestring)))
            return lm_err_set(err, LM_ERR_NOMEM, "%s: out of memory", label);
        (*n)++;
    }
    return LM_OK;
}

// rank_pattern (integers) or alpha_pattern (numbers), kept in file order, each compiled.
static lm_status get_patterns(const cJSON *root, const char *key, bool is_rank,
                              lm_lora_pattern **out, int64_t *n, const char *label, lm_err *err)
{
    const cJSON *v = item(root, key);
    if (!v)
        return LM_OK;
    if (!cJSON_IsObject(v))
        return bad_key(label, key, "an object", v, err);
    int count = cJSON_GetArraySize(v);
    *out = calloc((size_t)count + 1, sizeof **out);
    if (!*out)
        return lm_err_set(err, LM_ERR_NOMEM, "%s: out of memory", label);
    for (const cJSON *e = v->child; e; e = e->next) {
        lm_lora_pattern *p = &(*out)[*n];
        bool ok = is_rank ? is_integer(e) && e->valuedouble > 0
                          : cJSON_IsNumber(e) && isfinite(e->valuedouble);
        if (!ok && cJSON_IsNumber(e))
            return lm_err_set(err, LM_ERR_FORMAT, "%s: %s['%s'] must be a positive integer, not %g",
                              label, key, e->string, e->valuedouble);
        if (!ok)
            return lm_err_set(err, LM_ERR_FORMAT, "%s: %s['%s'] must be %s, not %s", label, key,
                              e->string, is_rank ? "a positive integer" : "a number", lm_json_kind(e));
        if (!(p->key = lm_strdup(e->string)))
            return lm_err_set(err, LM_ERR_NOMEM, "%s: out of memory", label);
        (*n)++;
        if (is_rank)
            p->r = (int64_t)e->valuedouble;
        else
            p->alpha = e->valuedouble;
        // PEFT's get_pattern_key: re.match(rf"(.*\.)?({key})$", module)
        lm_status s = lm_lora_re_compile(&p->re, label, key, p->key, "(.*\\.)?(", ")$", PCRE2_ANCHORED, err);
        if (s != LM_OK)
            return s;
    }
    return LM_OK;
}

// A list of strings or one string (or null): *str gets a string, *list the list.
static lm_status get_str_or_list(const cJSON *root, const char *key, char **str, char ***list, int64_t *n,
                                 const char *label, lm_err *err)
{
    const cJSON *v = item(root, key);
    if (!v)
        return LM_OK;
    if (cJSON_IsString(v))
        return (*str = lm_strdup(v->valuestring)) ? LM_OK : lm_err_set(err, LM_ERR_NOMEM, "%s: out of memory", label);
    if (!cJSON_IsArray(v))
        return bad_key(label, key, "a list of names or a regex string", v, err);
    return get_str_list(root, key, list, n, label, err);
}

// The keys that say which modules get LoRA besides target_modules: exclude_modules,
// layers_pattern and modules_to_save compiled as PEFT uses them, target_parameters refused, and
// the combinations PEFT's LoraConfig refuses.
static lm_status parse_selection(lm_lora_config *cfg, const cJSON *root, const char *label, lm_err *err)
{
    lm_status s;
    const cJSON *v;
    if ((v = item(root, "target_parameters")) && !(cJSON_IsArray(v) && cJSON_GetArraySize(v) == 0))
        return lm_err_set(err, LM_ERR_UNSUPPORTED, "%s: key 'target_parameters' is not supported: llmerge "
                          "merges LoRA on modules (target_modules), not on parameters", label);

    if ((s = get_str_or_list(root, "exclude_modules", &cfg->exclude_regex, &cfg->exclude_modules,
                             &cfg->n_exclude_modules, label, err)) != LM_OK)
        return s;
    if (cfg->exclude_regex &&
        (s = lm_lora_re_compile(&cfg->exclude_re, label, "exclude_modules", cfg->exclude_regex, "", "",
                                PCRE2_ANCHORED | PCRE2_ENDANCHORED, err)) != LM_OK)
        return s;

    // modules_to_save: PEFT puts no LoRA on re.match(rf"(^|.*\.){name}($|\..*)", module)
    if (cfg->n_modules_to_save) {
        if (!(cfg->saved_re = calloc((size_t)cfg->n_modules_to_save, sizeof *cfg->saved_re)))
            return lm_err_set(err, LM_ERR_NOMEM, "%s: out of memory", label);
        for (int64_t i = 0; i < cfg->n_modules_to_save; i++)
            if ((s = lm_lora_re_compile(&cfg->saved_re[i], label, "modules_to_save", cfg->modules_to_save[i],
                                        "(^|.*\\.)", "($|\\..*)", PCRE2_ANCHORED, err)) != LM_OK)
                return s;
    }

    char *one = NULL;
    if ((s = get_str_or_list(root, "layers_pattern", &one, &cfg->layers_pattern, &cfg->n_layers_pattern,
                             label, err)) != LM_OK)
        return s;
    bool pattern_given = item(root, "layers_pattern") != NULL;
    // PEFT takes an empty string or list as no layers_pattern
    bool pattern_set = one ? one[0] != '\0' : cfg->n_layers_pattern > 0;
    if (one && !one[0]) {
        free(one);
    } else if (one) {
        if (!(cfg->layers_pattern = calloc(2, sizeof *cfg->layers_pattern))) {
            free(one);
            return lm_err_set(err, LM_ERR_NOMEM, "%s: out of memory", label);
        }
        cfg->layers_pattern[cfg->n_layers_pattern++] = one;
    }
    bool is_str = cfg->targets == LM_LORA_TARGETS_REGEX || cfg->targets == LM_LORA_TARGETS_ALL_LINEAR;
    if (is_str && cfg->has_layers_to_transform)
        return lm_err_set(err, LM_ERR_FORMAT, "%s: key 'layers_to_transform' cannot be used with a "
                          "target_modules string ('%s'): PEFT refuses the two together", label,
                          cfg->targets == LM_LORA_TARGETS_REGEX ? cfg->target_regex : "all-linear");
    if (is_str && pattern_given)
        return lm_err_set(err, LM_ERR_FORMAT, "%s: key 'layers_pattern' cannot be used with a "
                          "target_modules string ('%s'): PEFT refuses the two together", label,
                          cfg->targets == LM_LORA_TARGETS_REGEX ? cfg->target_regex : "all-linear");
    if (pattern_set && !cfg->has_layers_to_transform)
        return lm_err_set(err, LM_ERR_FORMAT, "%s: key 'layers_pattern' needs layers_to_transform: "
                          "PEFT refuses it alone", label);

    // The layer index of a module path: PEFT's re.match(r".*?\.[^.]*\.(\d+)\.", module), or
    // with layers_pattern re.match(rf".*?\.{pattern}\.(\d+)\.", module) for each pattern in turn.
    if (cfg->n_layers_to_transform == 0)
        return LM_OK;
    int64_t n = pattern_set ? cfg->n_layers_pattern : 1;
    if (!(cfg->layer_re = calloc((size_t)n, sizeof *cfg->layer_re)))
        return lm_err_set(err, LM_ERR_NOMEM, "%s: out of memory", label);
    for (int64_t i = 0; i < n; i++) {
        s = pattern_set ? lm_lora_re_compile(&cfg->layer_re[i], label, "layers_pattern", cfg->layers_pattern[i],
                                             ".*?\\.", "\\.(\\d+)\\.", PCRE2_ANCHORED, err)
                        : lm_lora_re_compile(&cfg->layer_re[i], label, "layers_to_transform", ".*?\\.[^.]*\\.(\\d+)\\.",
                                             "", "", PCRE2_ANCHORED, err);
        if (s != LM_OK)
            return s;
        cfg->n_layer_re++;
    }
    return LM_OK;
}

static lm_status parse_lora_root(lm_lora_config *cfg, const cJSON *root, const char *label,
                                 lm_err *err)
{
    lm_status s;
    const cJSON *v = item(root, "peft_type");
    if (!v)
        return lm_err_set(err, LM_ERR_FORMAT, "%s: key 'peft_type' is missing", label);
    if (!cJSON_IsString(v))
        return bad_key(label, "peft_type", "a string", v, err);
    if (strcmp(v->valuestring, "LORA") != 0)
        return lm_err_set(err, LM_ERR_UNSUPPORTED,
                          "%s: peft_type '%s' is not supported: llmerge merges LoRA adapters "
                          "(peft_type \"LORA\")", label, v->valuestring);
    if (!(cfg->peft_type = lm_strdup(v->valuestring)))
        return lm_err_set(err, LM_ERR_NOMEM, "%s: out of memory", label);

    cfg->r = 8;
    cfg->lora_alpha = 8;
    if ((v = item(root, "r"))) {
        if (!is_integer(v) || v->valuedouble <= 0)
            return cJSON_IsNumber(v)
                       ? lm_err_set(err, LM_ERR_FORMAT, "%s: key 'r' must be a positive integer, not %g",
                                    label, v->valuedouble)
                       : bad_key(label, "r", "a positive integer", v, err);
        cfg->r = (int64_t)v->valuedouble;
    }
    if ((v = item(root, "lora_alpha"))) {
        if (!cJSON_IsNumber(v) || !isfinite(v->valuedouble))
            return bad_key(label, "lora_alpha", "a number", v, err);
        cfg->lora_alpha = v->valuedouble;
    }

    if ((v = item(root, "target_modules"))) {
        if (cJSON_IsString(v)) {
            if (strcasecmp(v->valuestring, "all-linear") == 0) {
                cfg->targets = LM_LORA_TARGETS_ALL_LINEAR;
            } else {
                cfg->targets = LM_LORA_TARGETS_REGEX;
                if (!(cfg->target_regex = lm_strdup(v->valuestring)))
                    return lm_err_set(err, LM_ERR_NOMEM, "%s: out of memory", label);
                s = lm_lora_re_compile(&cfg->target_re, label, "target_modules", cfg->target_regex, "", "",
                                       PCRE2_ANCHORED | PCRE2_ENDANCHORED, err);  // re.fullmatch
                if (s != LM_OK)
                    return s;
            }
        } else if (cJSON_IsArray(v)) {
            cfg->targets = LM_LORA_TARGETS_LIST;
            s = get_str_list(root, "target_modules", &cfg->target_modules, &cfg->n_target_modules,
                             label, err);
            if (s != LM_OK)
                return s;
        } else {
            return bad_key(label, "target_modules", "a list of names or a regex string", v, err);
        }
    }

    if ((s = get_bool(root, "use_rslora", &cfg->use_rslora, label, err)) != LM_OK ||
        (s = get_bool(root, "use_dora", &cfg->use_dora, label, err)) != LM_OK ||
        (s = get_bool(root, "fan_in_fan_out", &cfg->fan_in_fan_out, label, err)) != LM_OK ||
        (s = get_bool(root, "lora_bias", &cfg->lora_bias, label, err)) != LM_OK ||
        (s = get_bool(root, "ensure_weight_tying", &cfg->ensure_weight_tying, label, err)) != LM_OK)
        return s;
    if ((s = get_patterns(root, "rank_pattern", true, &cfg->rank_pattern, &cfg->n_rank_pattern,
                          label, err)) != LM_OK ||
        (s = get_patterns(root, "alpha_pattern", false, &cfg->alpha_pattern,
                          &cfg->n_alpha_pattern, label, err)) != LM_OK)
        return s;
    if ((s = get_str_list(root, "modules_to_save", &cfg->modules_to_save,
                          &cfg->n_modules_to_save, label, err)) != LM_OK)
        return s;

    if ((v = item(root, "layers_to_transform"))) {
        cfg->has_layers_to_transform = true;
        int count = cJSON_IsArray(v) ? cJSON_GetArraySize(v) : 1;
        if (!is_integer(v) && !cJSON_IsArray(v))
            return bad_key(label, "layers_to_transform", "an integer or a list of integers", v, err);
        cfg->layers_to_transform = calloc((size_t)count + 1, sizeof *cfg->layers_to_transform);
        if (!cfg->layers_to_transform)
            return lm_err_set(err, LM_ERR_NOMEM, "%s: out of memory", label);
        for (const cJSON *e = cJSON_IsArray(v) ? v->child : v; e; e = cJSON_IsArray(v) ? e->next : NULL) {
            if (!is_integer(e) || e->valuedouble < 0)
                return lm_err_set(err, LM_ERR_FORMAT,
                                  "%s: key 'layers_to_transform' must hold layer indices (integers >= 0)",
                                  label);
            cfg->layers_to_transform[cfg->n_layers_to_transform++] = (int64_t)e->valuedouble;
        }
    }

    if ((s = parse_selection(cfg, root, label, err)) != LM_OK)
        return s;

    if ((v = item(root, "base_model_name_or_path"))) {
        if (!cJSON_IsString(v))
            return bad_key(label, "base_model_name_or_path", "a string", v, err);
        if (!(cfg->base_model_name_or_path = lm_strdup(v->valuestring)))
            return lm_err_set(err, LM_ERR_NOMEM, "%s: out of memory", label);
    }
    return LM_OK;
}

lm_status lm_lora_config_parse(lm_lora_config *cfg, const char *json, size_t len,
                               const char *label, lm_err *err)
{
    memset(cfg, 0, sizeof *cfg);
    if (!(cfg->path = lm_strdup(label)))
        return lm_err_set(err, LM_ERR_NOMEM, "%s: out of memory", label);
    cJSON *root = NULL;
    lm_status s = lm_json_parse(&root, json, len, label, err);
    if (s == LM_OK && !cJSON_IsObject(root))
        s = lm_err_set(err, LM_ERR_FORMAT, "%s: expected a JSON object, found %s", label,
                       lm_json_kind(root));
    else if (s == LM_OK)
        s = parse_lora_root(cfg, root, label, err);
    cJSON_Delete(root);
    if (s != LM_OK)
        lm_lora_config_free(cfg);
    return s;
}

lm_status lm_lora_config_load(lm_lora_config *cfg, const char *path, lm_err *err)
{
    memset(cfg, 0, sizeof *cfg);
    char *text = NULL;
    size_t len = 0;
    lm_status s = lm_read_file(path, ADAPTER_CONFIG_MAX_BYTES, &text, &len, err);
    if (s != LM_OK)
        return s;
    s = lm_lora_config_parse(cfg, text, len, path, err);
    free(text);
    return s;
}

static void free_patterns(lm_lora_pattern *p, int64_t n)
{
    for (int64_t i = 0; i < n; i++) {
        lm_lora_re_free(p[i].re);
        free(p[i].key);
    }
    free(p);
}

static void free_res(lm_lora_re **v, int64_t n)
{
    for (int64_t i = 0; v && i < n; i++)
        lm_lora_re_free(v[i]);
    free(v);
}

static void free_strs(char **v, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        free(v[i]);
    free(v);
}

void lm_lora_config_free(lm_lora_config *cfg)
{
    if (!cfg)
        return;
    free(cfg->path);
    free(cfg->peft_type);
    free_strs(cfg->target_modules, cfg->n_target_modules);
    free(cfg->target_regex);
    lm_lora_re_free(cfg->target_re);
    free_strs(cfg->exclude_modules, cfg->n_exclude_modules);
    free(cfg->exclude_regex);
    lm_lora_re_free(cfg->exclude_re);
    free_patterns(cfg->rank_pattern, cfg->n_rank_pattern);
    free_patterns(cfg->alpha_pattern, cfg->n_alpha_pattern);
    free_res(cfg->saved_re, cfg->n_modules_to_save);
    free_strs(cfg->modules_to_save, cfg->n_modules_to_save);
    free(cfg->layers_to_transform);
    free_strs(cfg->layers_pattern, cfg->n_layers_pattern);
    free_res(cfg->layer_re, cfg->n_layer_re);
    free(cfg->base_model_name_or_path);
    memset(cfg, 0, sizeof *cfg);
}

lm_status lm_lora_config_rank(const lm_lora_config *cfg, const char *path, int64_t *r, double *alpha,
                              const char **r_key, const char **alpha_key, lm_err *err)
{
    *r = cfg->r;
    *alpha = cfg->lora_alpha;
    if (r_key)
        *r_key = NULL;
    if (alpha_key)
        *alpha_key = NULL;
    bool hit = false;
    lm_status s;
    for (int64_t i = 0; i < cfg->n_rank_pattern && !hit; i++) {
        if ((s = lm_lora_re_match(cfg->rank_pattern[i].re, cfg->path, path, &hit, NULL, NULL, err)) != LM_OK)
            return s;
        if (hit) {
            *r = cfg->rank_pattern[i].r;
            if (r_key)
                *r_key = cfg->rank_pattern[i].key;
        }
    }
    hit = false;
    for (int64_t i = 0; i < cfg->n_alpha_pattern && !hit; i++) {
        if ((s = lm_lora_re_match(cfg->alpha_pattern[i].re, cfg->path, path, &hit, NULL, NULL, err)) != LM_OK)
            return s;
        if (hit) {
            *alpha = cfg->alpha_pattern[i].alpha;
            if (alpha_key)
                *alpha_key = cfg->alpha_pattern[i].key;
        }
    }
    return LM_OK;
}

double lm_lora_config_scale(const lm_lora_config *cfg, int64_t r, double alpha)
{
    return cfg->use_rslora ? alpha / sqrt((double)r) : alpha / (double)r;
}

// ==== keys and modules ========================================================================

typedef enum key_part { PART_A, PART_B, PART_BIAS, PART_MAGNITUDE } key_part;

static const struct {
    const char *suffix;
    lm_lora_kind kind;
    key_part part;
} lora_suffixes[] = {
    {".lora_A.weight", LM_LORA_LINEAR, PART_A},
    {".lora_B.weight", LM_LORA_LINEAR, PART_B},
    {".lora_B.bias", LM_LORA_LINEAR, PART_BIAS},
    {".lora_embedding_A", LM_LORA_EMBEDDING, PART_A},
    {".lora_embedding_B", LM_LORA_EMBEDDING, PART_B},
    {".lora_magnitude_vector", LM_LORA_LINEAR, PART_MAGNITUDE},
    // DoRA before PEFT dropped the ".weight" of its ModuleDict from saved keys.
    {".lora_magnitude_vector.weight", LM_LORA_LINEAR, PART_MAGNITUDE},
};
#define N_LORA_SUFFIXES (sizeof lora_suffixes / sizeof lora_suffixes[0])

// Lookup codes in by_target: index * 4 + lm_adapter_touch.
static int64_t touch_code(lm_adapter_touch t, int64_t index) { return index * 4 + (int64_t)t; }

// Registers `base_name` as changed by (touch, index); a second change of one tensor is an error
// naming both keys.
lm_status lm_adapter_claim_target(lm_adapter *a, const char *base_name, lm_adapter_touch touch,
                                         int64_t index, const char *key, lm_err *err)
{
    int put = lm_strmap_put(&a->by_target, base_name, touch_code(touch, index));
    if (put < 0)
        return lm_err_set(err, LM_ERR_NOMEM, "%s: out of memory", a->weights_path);
    if (put == 0) {
        int64_t prev = -1;
        lm_adapter_touch pt = lm_adapter_lookup(a, base_name, &prev);
        const char *other = pt == LM_TOUCH_SAVED ? a->saved[prev].t->name
                            : pt == LM_TOUCH_BIAS ? a->modules[prev].bias->name
                                                  : a->modules[prev].b->name;
        return lm_err_set(err, LM_ERR_FORMAT, "%s: base tensor '%s' is changed by two keys, '%s' and '%s'",
                          a->weights_path, base_name, other, key);
    }
    return LM_OK;
}

// Whether module `path` is one of modules_to_save (PEFT: the name, or a ".name" suffix).
bool lm_lora_is_saved_module(const lm_lora_config *cfg, const char *path)
{
    for (int64_t i = 0; i < cfg->n_modules_to_save; i++) {
        const char *m = cfg->modules_to_save[i];
        size_t lp = strlen(path), lm = strlen(m);
        if (strcmp(path, m) == 0 || (lp > lm && path[lp - lm - 1] == '.' && strcmp(path + lp - lm, m) == 0))
            return true;
    }
    return false;
}

// Adds a full modules_to_save tensor under base name `base_name` (taken over).
static lm_status add_saved(lm_adapter *a, char *base_name, const lm_st_tensor *t, lm_err *err)
{
    if (!base_name)
        return lm_err_set(err, LM_ERR_NOMEM, "%s: out of memory", a->weights_path);
    lm_lora_saved *sv = &a->saved[a->n_saved++];
    sv->base_name = base_name;
    sv->t = t;
    return LM_OK;
}

// Sorts one key into its module (creating it) or the saved tensors.
static lm_status map_key(lm_adapter *a, lm_strmap *by_path, const lm_st_tensor *t, lm_err *err)
{
    const char *key = t->name, *wp = a->weights_path;
    size_t plen = strlen(KEY_PREFIX);
    if (strncmp(key, KEY_PREFIX, plen) != 0)
        return lm_err_set(err, LM_ERR_FORMAT, "%s: key '%s' does not start with '%s'", wp, key,
                          KEY_PREFIX);
    const char *rest = key + plen;
    size_t rlen = strlen(rest);

    for (size_t i = 0; i < N_LORA_SUFFIXES; i++) {
        size_t sl = strlen(lora_suffixes[i].suffix);
        if (rlen <= sl || strcmp(rest + rlen - sl, lora_suffixes[i].suffix) != 0)
            continue;
        char *path = malloc(rlen - sl + 1);
        if (!path)
            return lm_err_set(err, LM_ERR_NOMEM, "%s: out of memory", wp);
        memcpy(path, rest, rlen - sl);
        path[rlen - sl] = '\0';

        int64_t mi = lm_strmap_get(by_path, path);
        lm_lora_module *m;
        if (mi < 0) {
            mi = a->n_modules++;
            m = &a->modules[mi];
            m->path = path;
            m->kind = lora_suffixes[i].kind;
            if (lm_strmap_put(by_path, m->path, mi) < 0)
                return lm_err_set(err, LM_ERR_NOMEM, "%s: out of memory", wp);
        } else {
            free(path);
            m = &a->modules[mi];
        }
        key_part part = lora_suffixes[i].part;
        if (part == PART_A || part == PART_B) {
            // A module is linear or an embedding; the other's factor cannot join it.
            const lm_st_tensor *other = m->a ? m->a : m->b;
            if (other && m->kind != lora_suffixes[i].kind)
                return lm_err_set(err, LM_ERR_FORMAT,
                                  "%s: key '%s' mixes linear and embedding LoRA factors with '%s'",
                                  wp, key, other->name);
            m->kind = lora_suffixes[i].kind;
        }
        const lm_st_tensor **slot = part == PART_A ? &m->a : part == PART_B ? &m->b
                                    : part == PART_BIAS ? &m->bias : &m->magnitude;
        if (*slot)
            return lm_err_set(err, LM_ERR_FORMAT, "%s: keys '%s' and '%s' are the same tensor of module '%s'",
                              wp, (*slot)->name, key, m->path);
        *slot = t;
        return LM_OK;
    }

    // "X.modules_to_save.<adapter>.weight": how PEFT holds them in memory; saved files drop it.
    const char *mts = strstr(rest, ".modules_to_save.");
    if (mts) {
        const char *after = mts + strlen(".modules_to_save.");
        const char *dot = strchr(after, '.');  // skip the adapter name
        if (!dot || (strcmp(dot, ".weight") != 0 && strcmp(dot, ".bias") != 0))
            return lm_err_set(err, LM_ERR_FORMAT, "%s: key '%s': unknown modules_to_save key", wp, key);
        return add_saved(a, lm_strfmt("%.*s%s", (int)(mts - rest), rest, dot), t, err);
    }
    if (strstr(rest, "trainable_tokens"))
        return lm_err_set(err, LM_ERR_UNSUPPORTED,
                          "%s: key '%s': trainable tokens (trainable_token_indices) are not supported",
                          wp, key);
    if (strstr(rest, "lora_"))
        return lm_err_set(err, LM_ERR_FORMAT,
                          "%s: key '%s': unknown LoRA key (expected .lora_A.weight, .lora_B.weight, "
                          ".lora_B.bias, .lora_magnitude_vector, .lora_embedding_A or .lora_embedding_B)",
                          wp, key);
    bool w = lm_str_ends_with(rest, ".weight"), b = lm_str_ends_with(rest, ".bias");
    if (w || b) {
        size_t mlen = rlen - (w ? strlen(".weight") : strlen(".bias"));
        char *module = lm_strfmt("%.*s", (int)mlen, rest);
        if (!module)
            return lm_err_set(err, LM_ERR_NOMEM, "%s: out of memory", wp);
        // (PEFT saves a tied lm_head beside a saved embed_tokens under ensure_weight_tying
        // without listing it: on a tied base lm_adapter_select checks it is the embedding's copy;
        // on another, PEFT loads it into lm_head as any key that is not an adapter's)
        bool ok = lm_lora_is_saved_module(&a->config, module) ||
                  (a->config.ensure_weight_tying && strcmp(module, "lm_head") == 0);
        free(module);
        if (!ok)
            return lm_err_set(err, LM_ERR_FORMAT,
                              "%s: key '%s' is a full tensor, but its module is not in "
                              "modules_to_save of %s", wp, key, a->config.path);
        return add_saved(a, lm_strdup(rest), t, err);
    }
    return lm_err_set(err, LM_ERR_FORMAT, "%s: key '%s': unknown key (not a LoRA factor or a "
                      "modules_to_save tensor)", wp, key);
}

// The expected key of a module part, for messages ("...v_proj.lora_B.weight").
static void part_key(char *buf, size_t cap, const lm_lora_module *m, key_part part)
{
    bool emb = m->kind == LM_LORA_EMBEDDING;
    const char *sfx = part == PART_A ? (emb ? ".lora_embedding_A" : ".lora_A.weight")
                      : part == PART_B ? (emb ? ".lora_embedding_B" : ".lora_B.weight")
                      : part == PART_BIAS ? ".lora_B.bias" : ".lora_magnitude_vector";
    snprintf(buf, cap, "%s%s%s", KEY_PREFIX, m->path, sfx);
}

// Whether every value of floating tensor t is +0 or -0 (false for a dtype llmerge cannot read).
static bool all_zero(const lm_st_tensor *t)
{
    if (!lm_dtype_readable(t->dtype))
        return false;
    const unsigned char *p = t->data;
    size_t width = lm_dtype_bits(t->dtype) / 8;
    for (int64_t i = 0; i < t->numel; i++, p += width) {
        // little-endian: the sign is the top bit of the last byte
        for (size_t b = 0; b + 1 < width; b++)
            if (p[b])
                return false;
        if (p[width - 1] & 0x7f)
            return false;
    }
    return true;
}

// Completes one module: both factors present, r and alpha, shapes consistent with r.
static lm_status finish_module(lm_adapter *a, int64_t mi, lm_err *err)
{
    lm_lora_module *m = &a->modules[mi];
    const lm_lora_config *cfg = &a->config;
    const char *wp = a->weights_path;
    char want[LM_ERR_MSG_MAX / 4], sa[64], sb[64];

    if (!m->a || !m->b) {
        const lm_st_tensor *have = m->a ? m->a : m->b ? m->b : m->bias ? m->bias : m->magnitude;
        part_key(want, sizeof want, m, !m->a ? PART_A : PART_B);
        return lm_err_set(err, LM_ERR_FORMAT, "%s: key '%s' has no matching '%s'", wp, have->name, want);
    }
    lm_status s = lm_lora_config_rank(cfg, m->path, &m->r, &m->alpha, &m->r_key, &m->alpha_key, err);
    if (s != LM_OK)
        return s;
    m->scale = lm_lora_config_scale(cfg, m->r, m->alpha);

    char rsrc[LM_ERR_MSG_MAX / 4];
    if (m->r_key)
        snprintf(rsrc, sizeof rsrc, "rank_pattern key '%s'", m->r_key);
    else
        snprintf(rsrc, sizeof rsrc, "r in %s", cfg->path);
    lm_st_shape_str(m->a->shape, m->a->ndim, sa, sizeof sa);
    lm_st_shape_str(m->b->shape, m->b->ndim, sb, sizeof sb);
    if (m->a->ndim != 2 || m->a->shape[0] != m->r)
        return lm_err_set(err, LM_ERR_FORMAT, "%s: key '%s' has shape %s, but r = %lld (%s) "
                          "needs [%lld, in]", wp, m->a->name, sa, (long long)m->r, rsrc, (long long)m->r);
    if (m->b->ndim != 2 || m->b->shape[1] != m->r)
        return lm_err_set(err, LM_ERR_FORMAT, "%s: key '%s' has shape %s, but r = %lld (%s) "
                          "needs [out, %lld]", wp, m->b->name, sb, (long long)m->r, rsrc, (long long)m->r);
    const int64_t out = m->b->shape[0];
    const lm_st_tensor *vecs[2] = {m->bias, m->magnitude};
    for (int i = 0; i < 2; i++) {
        const lm_st_tensor *t = vecs[i];
        if (t && (t->ndim != 1 || t->shape[0] != out)) {
            char st[64];
            lm_st_shape_str(t->shape, t->ndim, st, sizeof st);
            return lm_err_set(err, LM_ERR_FORMAT, "%s: key '%s' has shape %s, but '%s' is %s: "
                              "it must be [%lld]", wp, t->name, st, m->b->name, sb, (long long)out);
        }
    }
    if (m->magnitude && !cfg->use_dora)
        return lm_err_set(err, LM_ERR_FORMAT, "%s: key '%s' is a DoRA magnitude, but use_dora is "
                          "not true in %s", wp, m->magnitude->name, cfg->path);
    if (!m->magnitude && cfg->use_dora) {
        part_key(want, sizeof want, m, PART_MAGNITUDE);
        return lm_err_set(err, LM_ERR_FORMAT, "%s: use_dora is true in %s, but key '%s' is missing",
                          wp, cfg->path, want);
    }
    if (m->bias && !cfg->lora_bias)
        return lm_err_set(err, LM_ERR_FORMAT, "%s: key '%s' is a LoRA bias, but lora_bias is not "
                          "true in %s", wp, m->bias->name, cfg->path);
    if (m->bias && m->kind == LM_LORA_EMBEDDING)
        return lm_err_set(err, LM_ERR_FORMAT, "%s: key '%s': an embedding has no bias", wp,
                          m->bias->name);

    m->base_name = lm_strfmt("%s.weight", m->path);
    if (m->bias)
        m->bias_name = lm_strfmt("%s.bias", m->path);
    if (!m->base_name || (m->bias && !m->bias_name))
        return lm_err_set(err, LM_ERR_NOMEM, "%s: out of memory", wp);
    s = lm_adapter_claim_target(a, m->base_name, LM_TOUCH_LORA, mi, m->b->name, err);
    if (s == LM_OK && m->bias)
        s = lm_adapter_claim_target(a, m->bias_name, LM_TOUCH_BIAS, mi, m->bias->name, err);
    return s;
}

lm_status lm_adapter_open(lm_adapter **out, const char *dir, lm_err *err)
{
    *out = NULL;
    lm_adapter *a = calloc(1, sizeof *a);
    char *cfg_path = NULL, *bin = NULL;
    lm_strmap by_path = {0};
    lm_status s;
    if (!a || !(a->dir = lm_strdup(dir)) || !(cfg_path = lm_path_join(dir, "adapter_config.json")) ||
        !(a->weights_path = lm_path_join(dir, "adapter_model.safetensors")) ||
        !(bin = lm_path_join(dir, "adapter_model.bin"))) {
        s = lm_err_set(err, LM_ERR_NOMEM, "%s: out of memory", dir);
        goto fail;
    }
    if (!lm_is_dir(dir)) {
        s = lm_err_set(err, LM_ERR_NOT_FOUND, "%s: not a directory", dir);
        goto fail;
    }
    if (!lm_is_file(cfg_path)) {
        s = lm_err_set(err, LM_ERR_NOT_FOUND, "%s: no adapter_config.json in the adapter directory", dir);
        goto fail;
    }
    if ((s = lm_lora_config_load(&a->config, cfg_path, err)) != LM_OK)
        goto fail;
    if (!lm_is_file(a->weights_path)) {
        if (lm_is_file(bin))
            s = lm_err_set(err, LM_ERR_UNSUPPORTED,
                           "%s: adapter_model.bin is a torch pickle and llmerge reads only "
                           "safetensors: convert it to adapter_model.safetensors (load it with PEFT "
                           "and save_pretrained(..., safe_serialization=True))", dir);
        else
            s = lm_err_set(err, LM_ERR_NOT_FOUND, "%s: no adapter_model.safetensors", dir);
        goto fail;
    }
    if ((s = lm_st_open(&a->st, a->weights_path, err)) != LM_OK)
        goto fail;

    int64_t n = a->st->n_tensors;
    a->modules = calloc((size_t)n + 1, sizeof *a->modules);
    a->saved = calloc((size_t)n + 1, sizeof *a->saved);
    if (!a->modules || !a->saved || lm_strmap_init(&by_path, (size_t)n) != LM_OK ||
        lm_strmap_init(&a->by_target, (size_t)n) != LM_OK) {
        s = lm_err_set(err, LM_ERR_NOMEM, "%s: out of memory", a->weights_path);
        goto fail;
    }
    for (int64_t i = 0; i < n; i++)
        if ((s = map_key(a, &by_path, &a->st->tensors[i], err)) != LM_OK)
            goto fail;
    for (int64_t i = 0; i < a->n_modules; i++)
        if ((s = finish_module(a, i, err)) != LM_OK)
            goto fail;
    for (int64_t i = 0; i < a->n_saved; i++)
        if ((s = lm_adapter_claim_target(a, a->saved[i].base_name, LM_TOUCH_SAVED, i, a->saved[i].t->name,
                                         err)) != LM_OK)
            goto fail;

    lm_strmap_free(&by_path);
    free(cfg_path);
    free(bin);
    *out = a;
    return LM_OK;

fail:
    lm_strmap_free(&by_path);
    free(cfg_path);
    free(bin);
    lm_adapter_free(a);
    return s;
}

void lm_adapter_free(lm_adapter *a)
{
    if (!a)
        return;
    for (int64_t i = 0; i < a->n_modules; i++) {
        free(a->modules[i].path);
        free(a->modules[i].base_name);
        free(a->modules[i].bias_name);
    }
    free(a->modules);
    for (int64_t i = 0; i < a->n_ignored; i++)
        free(a->ignored[i].path);
    free(a->ignored);
    for (int64_t i = 0; i < a->n_saved; i++)
        free(a->saved[i].base_name);
    free(a->saved);
    lm_strmap_free(&a->by_target);
    lm_st_close(a->st);
    lm_lora_config_free(&a->config);
    free(a->weights_path);
    free(a->dir);
    free(a);
}

lm_adapter_touch lm_adapter_lookup(const lm_adapter *a, const char *name, int64_t *index)
{
    int64_t code = lm_strmap_get(&a->by_target, name);
    if (code < 0)
        return LM_TOUCH_NONE;
    if (index)
        *index = code / 4;
    return (lm_adapter_touch)(code % 4);
}

// ==== validation against a base model =========================================================

static lm_status need_readable(const lm_st_tensor *t, const char *wp, lm_err *err)
{
    if (!t || lm_dtype_readable(t->dtype))
        return LM_OK;
    return lm_err_set(err, LM_ERR_UNSUPPORTED, "%s: key '%s' has dtype %s, which llmerge cannot "
                      "compute with (F32, F16, BF16 or F64)", wp, t->name, lm_dtype_name(t->dtype));
}

// A base tensor the adapter changes (through `key`) must be one llmerge computes with: an
// integer or FP8 tensor would otherwise be copied and the change lost.
static lm_status need_readable_base(const lm_adapter *a, const lm_model *base, const lm_st_tensor *b,
                                    const lm_st_tensor *key, lm_err *err)
{
    if (lm_dtype_readable(b->dtype))
        return LM_OK;
    return lm_err_set(err, LM_ERR_UNSUPPORTED, "%s: adapter key '%s' changes '%s', which is %s in the base %s: "
                      "llmerge cannot compute with %s (F32, F16, BF16 or F64)", a->weights_path, key->name, b->name,
                      lm_dtype_name(b->dtype), base->dir, lm_dtype_name(b->dtype));
}

// The MISMATCH message for adapter tensor `t` against base tensor `b`, saying what was needed.
static lm_status shape_mismatch(const lm_adapter *a, const lm_model *base, const lm_st_tensor *t,
                                const lm_st_tensor *b, const char *need, lm_err *err)
{
    char st[64], sb[64];
    lm_st_shape_str(t->shape, t->ndim, st, sizeof st);
    lm_st_shape_str(b->shape, b->ndim, sb, sizeof sb);
    return lm_err_set(err, LM_ERR_MISMATCH,
                      "%s: adapter key '%s' has shape %s, but base tensor '%s' in %s has shape %s "
                      "(%s)", a->weights_path, t->name, st, b->name, base->dir, sb, need);
}

static lm_status validate_module(const lm_adapter *a, const lm_lora_module *m,
                                 const lm_model *base, lm_err *err)
{
    const char *wp = a->weights_path;
    const lm_st_tensor *w = lm_model_find(base, m->base_name);
    if (!w)
        return lm_err_set(err, LM_ERR_MISMATCH,
                          "%s: adapter key '%s' changes '%s', which the base model %s does not have",
                          wp, m->a->name, m->base_name, base->dir);
    char need[256];
    if (w->ndim != 2) {
        snprintf(need, sizeof need, "a LoRA base must be 2-D");
        return shape_mismatch(a, base, m->a, w, need, err);
    }
    // Each factor's free dimension against the base: [out, in] for a linear layer ([in, out]
    // with fan_in_fan_out), [vocab, hidden] for an embedding whose A is [r, vocab].
    int64_t in, out;
    if (m->kind == LM_LORA_EMBEDDING) {
        in = w->shape[0];
        out = w->shape[1];
    } else if (a->config.fan_in_fan_out) {
        in = w->shape[0];
        out = w->shape[1];
    } else {
        in = w->shape[1];
        out = w->shape[0];
    }
    const char *layout = m->kind == LM_LORA_EMBEDDING ? "embedding [vocab, hidden]"
                         : a->config.fan_in_fan_out ? "fan_in_fan_out [in, out]" : "[out, in]";
    if (m->a->shape[1] != in) {
        snprintf(need, sizeof need, "base %s needs %s [%lld, %lld]", layout,
                 m->kind == LM_LORA_EMBEDDING ? "lora_embedding_A" : "lora_A", (long long)m->r,
                 (long long)in);
        return shape_mismatch(a, base, m->a, w, need, err);
    }
    if (m->b->shape[0] != out) {
        snprintf(need, sizeof need, "base %s needs %s [%lld, %lld]", layout,
                 m->kind == LM_LORA_EMBEDDING ? "lora_embedding_B" : "lora_B", (long long)out,
                 (long long)m->r);
        return shape_mismatch(a, base, m->b, w, need, err);
    }
    // B's first dimension is `out` and bias/magnitude were checked against it at open, so they
    // fit too; a bias also needs a base bias of that shape. Under lora_bias PEFT gives every
    // LoRA layer a bias in lora_B and saves it, zeros where the base has none (llmerge writes
    // those too): such a bias changes nothing and is accepted. Where the base has the bias, one
    // of zeros is a change like any other (it counts among the inputs that touch the tensor).
    const lm_st_tensor *bb = m->bias ? lm_model_find(base, m->bias_name) : NULL;
    if (m->bias && !bb && !all_zero(m->bias))
        return lm_err_set(err, LM_ERR_MISMATCH,
                          "%s: adapter key '%s' changes '%s', which the base model %s does not "
                          "have (base tensor '%s' has no bias)", wp, m->bias->name,
                          m->bias_name, base->dir, m->base_name);
    if (bb && (bb->ndim != 1 || bb->shape[0] != out)) {
        snprintf(need, sizeof need, "a bias must be [%lld]", (long long)out);
        return shape_mismatch(a, base, m->bias, bb, need, err);
    }
    lm_status s;
    if ((s = need_readable_base(a, base, w, m->a, err)) != LM_OK ||
        (bb && (s = need_readable_base(a, base, bb, m->bias, err)) != LM_OK))
        return s;
    if ((s = need_readable(m->a, wp, err)) != LM_OK || (s = need_readable(m->b, wp, err)) != LM_OK ||
        (s = need_readable(m->bias, wp, err)) != LM_OK ||
        (s = need_readable(m->magnitude, wp, err)) != LM_OK)
        return s;
    return LM_OK;
}

lm_status lm_adapter_validate(const lm_adapter *a, const lm_model *base, lm_err *err)
{
    lm_status s;
    for (int64_t i = 0; i < a->n_modules; i++)
        if ((s = validate_module(a, &a->modules[i], base, err)) != LM_OK)
            return s;
    for (int64_t i = 0; i < a->n_saved; i++) {
        const lm_lora_saved *sv = &a->saved[i];
        const lm_st_tensor *b = lm_model_find(base, sv->base_name);
        if (!b)
            return lm_err_set(err, LM_ERR_MISMATCH,
                              "%s: adapter key '%s' replaces '%s', which the base model %s does not have",
                              a->weights_path, sv->t->name, sv->base_name, base->dir);
        bool same = b->ndim == sv->t->ndim;
        for (int d = 0; same && d < b->ndim; d++)
            same = b->shape[d] == sv->t->shape[d];
        if (!same)
            return shape_mismatch(a, base, sv->t, b, "a modules_to_save tensor must have the base's shape", err);
        if ((s = need_readable(sv->t, a->weights_path, err)) != LM_OK ||
            (s = need_readable_base(a, base, b, sv->t, err)) != LM_OK)
            return s;
    }
    return LM_OK;
}

// ==== what a path is ==========================================================================

static bool dir_has(const char *dir, const char *file)
{
    char *p = lm_path_join(dir, file);
    bool yes = p && lm_is_file(p);
    free(p);
    return yes;
}

// Classifies a directory by its files; returns 0 when it is neither kind.
static lm_input_kind classify_dir(const char *dir)
{
    if (dir_has(dir, "adapter_config.json"))
        return LM_INPUT_ADAPTER;
    if (dir_has(dir, "config.json") &&
        (dir_has(dir, "model.safetensors") || dir_has(dir, "model.safetensors.index.json") ||
         dir_has(dir, "pytorch_model.bin") || dir_has(dir, "pytorch_model.bin.index.json")))
        return LM_INPUT_MODEL;
    return (lm_input_kind)0;
}

const char *lm_input_kind_name(lm_input_kind kind)
{
    switch (kind) {
    case LM_INPUT_SAFETENSORS: return "safetensors file";
    case LM_INPUT_MODEL: return "model directory";
    case LM_INPUT_ADAPTER: return "adapter directory";
    }
    return "unknown input";
}

#define EXPECTED_INPUTS "a .safetensors file, a model directory (config.json with model.safetensors " \
                        "or model.safetensors.index.json) or an adapter directory " \
                        "(adapter_config.json with adapter_model.safetensors)"

lm_status lm_input_detect(const char *path, lm_input_kind *kind, char **resolved, lm_err *err)
{
    *resolved = NULL;
    struct stat st;
    if (stat(path, &st) != 0) {
        // not on disk: a Hub id (ORG/NAME[@REVISION]) names a snapshot of the Hugging Face cache,
        // which is then detected as any directory is
        char *snap = NULL;
        lm_status s = lm_hf_resolve(path, &snap, err);
        if (s != LM_OK)
            return s;
        if (strcmp(snap, path) == 0) {  // a dangling symbolic link
            free(snap);
            return lm_err_set(err, LM_ERR_NOT_FOUND, "%s: no such file or directory", path);
        }
        s = lm_input_detect(snap, kind, resolved, err);
        free(snap);
        return s == LM_OK ? s : lm_err_prefix(err, "%s", path);
    }
    if (S_ISREG(st.st_mode)) {
        // A directory's own description file stands for the directory.
        const char *base = lm_path_base(path);
        if (strcmp(base, "config.json") == 0 || strcmp(base, "adapter_config.json") == 0 ||
            strcmp(base, "model.safetensors.index.json") == 0) {
            size_t dl = (size_t)(base - path);  // "dir/" before the name
            char *dir = dl == 0 ? lm_strdup(".") : dl == 1 ? lm_strdup("/")
                                : lm_strfmt("%.*s", (int)(dl - 1), path);
            if (!dir)
                return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
            lm_input_kind k = classify_dir(dir);
            if (k) {
                *kind = k;
                *resolved = dir;
                return LM_OK;
            }
            free(dir);
        }
        if (!lm_str_ends_with(path, ".safetensors")) {
            if (lm_str_ends_with(path, ".bin") || lm_str_ends_with(path, ".pt") ||
                lm_str_ends_with(path, ".pth"))
                return lm_err_set(err, LM_ERR_UNSUPPORTED, "%s: a torch pickle; llmerge reads only "
                                  "safetensors: convert it first", path);
            return lm_err_set(err, LM_ERR_FORMAT, "%s: not a .safetensors file; expected "
                              EXPECTED_INPUTS, path);
        }
        *kind = LM_INPUT_SAFETENSORS;
        *resolved = lm_strdup(path);
        return *resolved ? LM_OK : lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    }
    if (!S_ISDIR(st.st_mode))
        return lm_err_set(err, LM_ERR_FORMAT, "%s: not a file or directory; expected " EXPECTED_INPUTS,
                          path);

    lm_input_kind k = classify_dir(path);
    if (k) {
        *kind = k;
        *resolved = lm_strdup(path);
        return *resolved ? LM_OK : lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    }

    // The nested layout: exactly one (visible) subdirectory, which is a model or an adapter.
    DIR *d = opendir(path);
    if (!d)
        return lm_err_set(err, LM_ERR_IO, "%s: cannot read the directory", path);
    char *sub = NULL;
    int n_sub = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (e->d_name[0] == '.')
            continue;
        char *p = lm_path_join(path, e->d_name);
        if (!p) {
            closedir(d);
            free(sub);
            return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
        }
        if (lm_is_dir(p) && n_sub++ == 0)
            sub = p;
        else
            free(p);
    }
    closedir(d);
    if (n_sub == 1 && (k = classify_dir(sub))) {
        *kind = k;
        *resolved = sub;
        return LM_OK;
    }
    free(sub);
    if (dir_has(path, "config.json"))
        return lm_err_set(err, LM_ERR_NOT_FOUND, "%s: has config.json but no model.safetensors or "
                          "model.safetensors.index.json", path);
    return lm_err_set(err, LM_ERR_NOT_FOUND, "%s: not %s", path,
                      n_sub == 1 ? "a model or adapter directory, nor is its one subdirectory; expected "
                                   EXPECTED_INPUTS
                                 : "a model or adapter directory; expected " EXPECTED_INPUTS);
}
