// PEFT LoRA adapters: see adapter.h. PEFT matches target_modules, exclude_modules,
// modules_to_save, layers_pattern, rank_pattern and alpha_pattern with Python's re; llmerge
// hands the patterns to PCRE2 as written, wrapped the way PEFT wraps them, with the options
// that make PCRE2 read them as Python reads a str pattern (UTF-8, Unicode properties for \d,
// \w, \s and \b, `.` not matching a newline, `$` also before a final newline), and bounds every
// match, so that no pattern can take unbounded time or memory.
#include "adapter.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <cJSON.h>
#include <dirent.h>
#include <inttypes.h>
#include <math.h>
#include <pcre2.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>

#include "json.h"

#define ADAPTER_CONFIG_MAX_BYTES (16u << 20)

static const char *const KEY_PREFIX = "base_model.model.";

// ==== regexes (PCRE2) =========================================================================

struct lm_lora_re {
    pcre2_code *code;
    pcre2_match_context *mctx;  // the limits
    const char *key;            // the config key it came from ("rank_pattern"; static)
    char *pattern;              // as written in the file
};

static void re_free(lm_lora_re *re)
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
static lm_status re_compile(lm_lora_re **out, const char *label, const char *key, const char *pattern,
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
    re_free(re);
    free(full);
    return s;
}

// Matches `re` against `subject` (a module path): *hit says whether it matched; *g1 / *g1_len
// (g1 may be NULL) get capture group 1, NULL when it did not take part. LM_ERR_FORMAT naming the
// file, the key, the pattern and the subject when the match runs past a limit.
static lm_status re_match(const lm_lora_re *re, const char *label, const char *subject, bool *hit,
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
        lm_status s = re_compile(&p->re, label, key, p->key, "(.*\\.)?(", ")$", PCRE2_ANCHORED, err);
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
        (s = re_compile(&cfg->exclude_re, label, "exclude_modules", cfg->exclude_regex, "", "",
                        PCRE2_ANCHORED | PCRE2_ENDANCHORED, err)) != LM_OK)
        return s;

    // modules_to_save: PEFT puts no LoRA on re.match(rf"(^|.*\.){name}($|\..*)", module)
    if (cfg->n_modules_to_save) {
        if (!(cfg->saved_re = calloc((size_t)cfg->n_modules_to_save, sizeof *cfg->saved_re)))
            return lm_err_set(err, LM_ERR_NOMEM, "%s: out of memory", label);
        for (int64_t i = 0; i < cfg->n_modules_to_save; i++)
            if ((s = re_compile(&cfg->saved_re[i], label, "modules_to_save", cfg->modules_to_save[i],
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
        s = pattern_set ? re_compile(&cfg->layer_re[i], label, "layers_pattern", cfg->layers_pattern[i],
                                     ".*?\\.", "\\.(\\d+)\\.", PCRE2_ANCHORED, err)
                        : re_compile(&cfg->layer_re[i], label, "layers_to_transform", ".*?\\.[^.]*\\.(\\d+)\\.",
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
                s = re_compile(&cfg->target_re, label, "target_modules", cfg->target_regex, "", "",
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
        (s = get_bool(root, "lora_bias", &cfg->lora_bias, label, err)) != LM_OK)
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
        re_free(p[i].re);
        free(p[i].key);
    }
    free(p);
}

static void free_res(lm_lora_re **v, int64_t n)
{
    for (int64_t i = 0; v && i < n; i++)
        re_free(v[i]);
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
    re_free(cfg->target_re);
    free_strs(cfg->exclude_modules, cfg->n_exclude_modules);
    free(cfg->exclude_regex);
    re_free(cfg->exclude_re);
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
        if ((s = re_match(cfg->rank_pattern[i].re, cfg->path, path, &hit, NULL, NULL, err)) != LM_OK)
            return s;
        if (hit) {
            *r = cfg->rank_pattern[i].r;
            if (r_key)
                *r_key = cfg->rank_pattern[i].key;
        }
    }
    hit = false;
    for (int64_t i = 0; i < cfg->n_alpha_pattern && !hit; i++) {
        if ((s = re_match(cfg->alpha_pattern[i].re, cfg->path, path, &hit, NULL, NULL, err)) != LM_OK)
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
        lm_status s = re_match(cfg->layer_re[i], cfg->path, path, found, &g, &gl, err);
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
        if ((s = re_match(cfg->exclude_re, cfg->path, path, &hit, NULL, NULL, err)) != LM_OK)
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
        if ((s = re_match(cfg->saved_re[i], cfg->path, path, &hit, NULL, NULL, err)) != LM_OK)
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
        if ((s = re_match(cfg->target_re, cfg->path, path, &hit, NULL, NULL, err)) != LM_OK)
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
static lm_status claim_target(lm_adapter *a, const char *base_name, lm_adapter_touch touch,
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
static bool is_saved_module(const lm_lora_config *cfg, const char *path)
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
        bool ok = is_saved_module(&a->config, module);
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
    s = claim_target(a, m->base_name, LM_TOUCH_LORA, mi, m->b->name, err);
    if (s == LM_OK && m->bias)
        s = claim_target(a, m->bias_name, LM_TOUCH_BIAS, mi, m->bias->name, err);
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
        if ((s = claim_target(a, a->saved[i].base_name, LM_TOUCH_SAVED, i, a->saved[i].t->name,
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
            lm_status s = re_compile(&cfg->target_re, cfg->path, "target_modules", cfg->target_regex, "", "",
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
// the base model").
static lm_status check_base_targets(const lm_lora_config *cfg, const lm_model *base, lm_err *err)
{
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
        s = claim_target(a, m->base_name, LM_TOUCH_LORA, i, m->b->name, err);
        if (s == LM_OK && m->bias)
            s = claim_target(a, m->bias_name, LM_TOUCH_BIAS, i, m->bias->name, err);
    }
    for (int64_t i = 0; i < a->n_saved && s == LM_OK; i++)
        s = claim_target(a, a->saved[i].base_name, LM_TOUCH_SAVED, i, a->saved[i].t->name, err);
    return s;
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
    for (int64_t i = 0; i < a->n_modules && s == LM_OK; i++) {
        const lm_lora_module *m = &a->modules[i];
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
    if (g->why == LM_LORA_OTHER_LAYER)
        snprintf(buf + o, cap - o, " are not %s, as PEFT would not load them: module %s: its layer %" PRId64
                 " is not in layers_to_transform", verb, g->path, g->layer);
    else
        snprintf(buf + o, cap - o, " are not %s, as PEFT would not load them: module %s: %s", verb, g->path,
                 lm_lora_select_reason(g->why));
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
    // fit too; a bias also needs a base bias of that shape.
    if (m->bias) {
        const lm_st_tensor *bb = lm_model_find(base, m->bias_name);
        if (!bb)
            return lm_err_set(err, LM_ERR_MISMATCH,
                              "%s: adapter key '%s' changes '%s', which the base model %s does not "
                              "have (base tensor '%s' has no bias)", wp, m->bias->name,
                              m->bias_name, base->dir, m->base_name);
        if (bb->ndim != 1 || bb->shape[0] != out) {
            snprintf(need, sizeof need, "a bias must be [%lld]", (long long)out);
            return shape_mismatch(a, base, m->bias, bb, need, err);
        }
    }
    lm_status s;
    if ((s = need_readable_base(a, base, w, m->a, err)) != LM_OK ||
        (m->bias && (s = need_readable_base(a, base, lm_model_find(base, m->bias_name), m->bias, err)) != LM_OK))
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
    if (stat(path, &st) != 0)
        return lm_err_set(err, LM_ERR_NOT_FOUND, "%s: no such file or directory", path);
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
