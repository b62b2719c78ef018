// config.json parsing: see config.h. The JSON is read by the one JSON reader (json.h) into a
// cJSON tree; each key goes through one typed getter that turns a wrong type, or a number out
// of the key's range, into an LM_ERR_FORMAT naming the file and key. For an
// unknown architecture the getters are lenient (a key of an unexpected type is skipped as if
// absent), because such configs may use the same names for other things (lists of per-layer
// sizes, for instance) and merging must still work on their tensors.
#include "config.h"

#include <cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "json.h"
#include "util.h"

#define CONFIG_MAX_BYTES (16u << 20)  // a config.json is a few KiB; refuse absurd files

// ==== typed getters ===========================================================================

typedef struct cfg_ctx {
    const char *label;  // file name for messages
    bool strict;        // a known architecture: wrong types are errors
    lm_err *err;
} cfg_ctx;

static lm_status bad_key(cfg_ctx *c, const char *prefix, const char *key, const char *want,
                         const cJSON *v)
{
    return lm_err_set(c->err, LM_ERR_FORMAT, "%s: key '%s%s' must be %s, not %s", c->label,
                      prefix, key, want, lm_json_kind(v));
}

#define INT_LIMIT 9007199254740992.0  // 2^53: beyond it a double skips integers

// A whole number beyond what an integer key takes: said as out of range, quoting the file.
static lm_status out_of_range(cfg_ctx *c, const char *prefix, const char *key, const cJSON *v)
{
    char shown[64];
    const char *text = lm_json_number_text(v);
    if (!text)
        snprintf(shown, sizeof shown, "%.17g", v->valuedouble);
    return lm_err_set(c->err, LM_ERR_FORMAT, "%s: key '%s%s': %s is out of range (%s %.0f)", c->label, prefix,
                      key, text ? text : shown, v->valuedouble > 0 ? "at most" : "at least",
                      v->valuedouble > 0 ? INT_LIMIT : -INT_LIMIT);
}

// The item for `key` in `obj`, or NULL when absent or null.
static const cJSON *item(const cJSON *obj, const char *key)
{
    const cJSON *v = obj ? cJSON_GetObjectItemCaseSensitive(obj, key) : NULL;
    return v && !cJSON_IsNull(v) ? v : NULL;
}

static bool is_integer(const cJSON *v)
{
    if (!cJSON_IsNumber(v))
        return false;
    double d = v->valuedouble;
    return isfinite(d) && d == floor(d) && fabs(d) <= INT_LIMIT;
}

// Reads an integer key. *present says whether it was there (not null); *out is left alone
// when not. In lenient mode a wrong type counts as absent.
static lm_status get_int(cfg_ctx *c, const cJSON *obj, const char *prefix, const char *key,
                         int64_t *out, bool *present)
{
    *present = false;
    const cJSON *v = item(obj, key);
    if (!v)
        return LM_OK;
    if (!is_integer(v) && cJSON_IsNumber(v) && fabs(v->valuedouble) > INT_LIMIT)
        return c->strict ? out_of_range(c, prefix, key, v) : LM_OK;
    if (!is_integer(v))
        return c->strict ? bad_key(c, prefix, key, "an integer", v) : LM_OK;
    *out = (int64_t)v->valuedouble;
    *present = true;
    return LM_OK;
}

static lm_status get_num(cfg_ctx *c, const cJSON *obj, const char *prefix, const char *key,
                         double *out, bool *present)
{
    *present = false;
    const cJSON *v = item(obj, key);
    if (!v)
        return LM_OK;
    if (!cJSON_IsNumber(v) || !isfinite(v->valuedouble))
        return c->strict ? bad_key(c, prefix, key, "a number", v) : LM_OK;
    *out = v->valuedouble;
    *present = true;
    return LM_OK;
}

static lm_status get_bool(cfg_ctx *c, const cJSON *obj, const char *key, bool *out)
{
    const cJSON *v = item(obj, key);
    if (!v)
        return LM_OK;
    if (!cJSON_IsBool(v))
        return c->strict ? bad_key(c, "", key, "true or false", v) : LM_OK;
    *out = cJSON_IsTrue(v);
    return LM_OK;
}

// Copies a string key into *out (NULL when absent). NOMEM when the copy fails.
static lm_status get_str(cfg_ctx *c, const cJSON *obj, const char *prefix, const char *key,
                         char **out)
{
    *out = NULL;
    const cJSON *v = item(obj, key);
    if (!v)
        return LM_OK;
    if (!cJSON_IsString(v))
        return c->strict ? bad_key(c, prefix, key, "a string", v) : LM_OK;
    *out = lm_strdup(v->valuestring);
    if (!*out)
        return lm_err_set(c->err, LM_ERR_NOMEM, "%s: out of memory", c->label);
    return LM_OK;
}

// A required positive dimension of a known architecture, or an optional one elsewhere.
static lm_status get_dim(cfg_ctx *c, const cJSON *root, const char *key, int64_t *out)
{
    bool present;
    lm_status s = get_int(c, root, "", key, out, &present);
    if (s != LM_OK)
        return s;
    if (!present) {
        *out = 0;
        if (c->strict)
            return lm_err_set(c->err, LM_ERR_FORMAT, "%s: key '%s' is missing", c->label, key);
        return LM_OK;
    }
    if (*out <= 0) {
        if (!c->strict) {
            *out = 0;
            return LM_OK;
        }
        return lm_err_set(c->err, LM_ERR_FORMAT, "%s: key '%s' must be positive, not %lld",
                          c->label, key, (long long)*out);
    }
    return LM_OK;
}

// ==== architectures ===========================================================================

static const struct {
    const char *arch_name, *model_type;
    lm_arch arch;
    int64_t max_pos;  // transformers' default max_position_embeddings
} known_archs[] = {
    {"LlamaForCausalLM", "llama", LM_ARCH_LLAMA, 2048},
    {"MistralForCausalLM", "mistral", LM_ARCH_MISTRAL, 4096 * 32},
    {"Qwen2ForCausalLM", "qwen2", LM_ARCH_QWEN2, 32768},
};
#define N_KNOWN_ARCHS (sizeof known_archs / sizeof known_archs[0])

const char *lm_arch_name(lm_arch arch)
{
    for (size_t i = 0; i < N_KNOWN_ARCHS; i++)
        if (known_archs[i].arch == arch)
            return known_archs[i].arch_name;
    return "unknown";
}

// ==== rope ====================================================================================

// Fills cfg->rope_scaling from an object holding rope_type/type and the scaling fields (the
// old rope_scaling object, or the new rope_parameters). `prefix` names it in messages.
static lm_status parse_rope_scaling(cfg_ctx *c, lm_config *cfg, const cJSON *obj,
                                    const char *prefix)
{
    lm_rope_scaling *rs = &cfg->rope_scaling;
    bool params = strcmp(prefix, "rope_parameters.") == 0;
    lm_status s = get_str(c, obj, prefix, "rope_type", &rs->type);
    if (s == LM_OK && rs->type)
        rs->type_key = params ? "rope_parameters.rope_type" : "rope_scaling.rope_type";
    if (s == LM_OK && !rs->type && (s = get_str(c, obj, prefix, "type", &rs->type)) == LM_OK && rs->type)
        rs->type_key = params ? "rope_parameters.type" : "rope_scaling.type";
    if (s != LM_OK)
        return s;
    if (!rs->type || strcmp(rs->type, "default") == 0)
        rs->kind = LM_ROPE_DEFAULT;
    else if (strcmp(rs->type, "linear") == 0)
        rs->kind = LM_ROPE_LINEAR;
    else if (strcmp(rs->type, "llama3") == 0)
        rs->kind = LM_ROPE_LLAMA3;
    else
        rs->kind = LM_ROPE_OTHER;

    bool has_factor, has_low, has_high, has_orig;
    if ((s = get_num(c, obj, prefix, "factor", &rs->factor, &has_factor)) != LM_OK ||
        (s = get_num(c, obj, prefix, "low_freq_factor", &rs->low_freq_factor, &has_low)) != LM_OK ||
        (s = get_num(c, obj, prefix, "high_freq_factor", &rs->high_freq_factor, &has_high)) != LM_OK ||
        (s = get_int(c, obj, prefix, "original_max_position_embeddings",
                     &rs->original_max_position_embeddings, &has_orig)) != LM_OK)
        return s;
    if (!c->strict)
        return LM_OK;

    if ((rs->kind == LM_ROPE_LINEAR || rs->kind == LM_ROPE_LLAMA3) && !has_factor)
        return lm_err_set(c->err, LM_ERR_FORMAT, "%s: key '%sfactor' is missing (rope type %s)",
                          c->label, prefix, rs->type);
    if (has_factor && !(rs->factor > 0))
        return lm_err_set(c->err, LM_ERR_FORMAT, "%s: key '%sfactor' must be positive, not %g",
                          c->label, prefix, rs->factor);
    if (rs->kind == LM_ROPE_LLAMA3) {
        const char *missing = !has_low ? "low_freq_factor"
                              : !has_high ? "high_freq_factor"
                              : !has_orig ? "original_max_position_embeddings"
                                          : NULL;
        if (missing)
            return lm_err_set(c->err, LM_ERR_FORMAT, "%s: key '%s%s' is missing (rope type llama3)",
                              c->label, prefix, missing);
        if (!(rs->low_freq_factor > 0) || !(rs->high_freq_factor > rs->low_freq_factor))
            return lm_err_set(c->err, LM_ERR_FORMAT,
                              "%s: rope scaling needs 0 < %slow_freq_factor < %shigh_freq_factor "
                              "(got %g and %g)", c->label, prefix, prefix, rs->low_freq_factor,
                              rs->high_freq_factor);
        if (rs->original_max_position_embeddings <= 0)
            return lm_err_set(c->err, LM_ERR_FORMAT,
                              "%s: key '%soriginal_max_position_embeddings' must be positive, "
                              "not %lld", c->label, prefix,
                              (long long)rs->original_max_position_embeddings);
    }
    return LM_OK;
}

// rope_theta and rope scaling, from rope_parameters (newer transformers) or the top level.
static lm_status parse_rope(cfg_ctx *c, lm_config *cfg, const cJSON *root)
{
    bool present;
    cfg->rope_theta = 10000.0;
    lm_status s = get_num(c, root, "", "rope_theta", &cfg->rope_theta, &present);
    if (s != LM_OK)
        return s;

    const cJSON *params = item(root, "rope_parameters");
    if (params && !cJSON_IsObject(params)) {
        if (c->strict)
            return bad_key(c, "", "rope_parameters", "an object", params);
        params = NULL;
    }
    const cJSON *scaling = item(root, "rope_scaling");
    if (scaling && !cJSON_IsObject(scaling)) {
        if (c->strict)
            return bad_key(c, "", "rope_scaling", "an object", scaling);
        scaling = NULL;
    }
    if (params) {
        s = get_num(c, params, "rope_parameters.", "rope_theta", &cfg->rope_theta, &present);
        if (s == LM_OK)
            s = parse_rope_scaling(c, cfg, params, "rope_parameters.");
        // Some files carry both: an explicit rope_scaling wins over a default rope_parameters.
        if (s == LM_OK && cfg->rope_scaling.kind == LM_ROPE_DEFAULT && scaling) {
            free(cfg->rope_scaling.type);
            memset(&cfg->rope_scaling, 0, sizeof cfg->rope_scaling);
            s = parse_rope_scaling(c, cfg, scaling, "rope_scaling.");
        }
    } else if (scaling) {
        s = parse_rope_scaling(c, cfg, scaling, "rope_scaling.");
    }
    if (s != LM_OK)
        return s;
    if (c->strict && !(cfg->rope_theta > 0))
        return lm_err_set(c->err, LM_ERR_FORMAT, "%s: key 'rope_theta' must be positive, not %g",
                          c->label, cfg->rope_theta);
    return LM_OK;
}

lm_status lm_config_rope_check(const lm_config *cfg, lm_err *err)
{
    const lm_rope_scaling *rs = &cfg->rope_scaling;
    if (rs->kind != LM_ROPE_OTHER)
        return LM_OK;
    return lm_err_set(err, LM_ERR_UNSUPPORTED, "%s: key '%s': rope scaling type '%s' is not supported "
                      "(the forward pass computes default, linear and llama3)", cfg->path ? cfg->path : "config",
                      rs->type_key ? rs->type_key : "rope_scaling.rope_type", rs->type ? rs->type : "?");
}

lm_status lm_config_rope_inv_freq(const lm_config *cfg, double *out, lm_err *err)
{
    int64_t d = cfg->head_dim;
    if (d <= 0 || d % 2 != 0)
        return lm_err_set(err, LM_ERR_FORMAT, "%s: head_dim %lld is not a positive even number",
                          cfg->path ? cfg->path : "config", (long long)d);
    lm_status s = lm_config_rope_check(cfg, err);
    if (s != LM_OK)
        return s;
    const lm_rope_scaling *rs = &cfg->rope_scaling;
    for (int64_t i = 0; i < d / 2; i++)
        out[i] = 1.0 / pow(cfg->rope_theta, (double)(2 * i) / (double)d);
    if (rs->kind == LM_ROPE_LINEAR) {
        for (int64_t i = 0; i < d / 2; i++)
            out[i] /= rs->factor;
    } else if (rs->kind == LM_ROPE_LLAMA3) {
        const double orig = (double)rs->original_max_position_embeddings;
        const double low = rs->low_freq_factor, high = rs->high_freq_factor;
        const double low_wavelen = orig / low, high_wavelen = orig / high;
        for (int64_t i = 0; i < d / 2; i++) {
            double f = out[i], wavelen = 2.0 * M_PI / f;
            if (wavelen < high_wavelen)
                continue;  // high frequencies are kept
            if (wavelen > low_wavelen) {
                out[i] = f / rs->factor;
            } else {
                double smooth = (orig / wavelen - low) / (high - low);
                out[i] = (1.0 - smooth) * f / rs->factor + smooth * f;
            }
        }
    }
    return LM_OK;
}

// ==== the config ==============================================================================

static lm_status parse_root(lm_config *cfg, const cJSON *root, cfg_ctx *c)
{
    lm_status s;

    // Architecture first: it decides how strict the rest is.
    const cJSON *archs = item(root, "architectures");
    if (archs && !(cJSON_IsArray(archs) && cJSON_GetArraySize(archs) == 0)) {
        const cJSON *first = cJSON_IsArray(archs) ? cJSON_GetArrayItem(archs, 0) : NULL;
        if (!first || !cJSON_IsString(first))
            return lm_err_set(c->err, LM_ERR_FORMAT,
                              "%s: key 'architectures' must be an array of strings", c->label);
        if (!(cfg->architecture = lm_strdup(first->valuestring)))
            return lm_err_set(c->err, LM_ERR_NOMEM, "%s: out of memory", c->label);
    }
    if ((s = get_str(c, root, "", "model_type", &cfg->model_type)) != LM_OK)
        return s;
    int64_t max_pos_default = 0;
    for (size_t i = 0; i < N_KNOWN_ARCHS; i++) {
        bool by_arch = cfg->architecture && strcmp(cfg->architecture, known_archs[i].arch_name) == 0;
        bool by_type = !cfg->architecture && cfg->model_type &&
                       strcmp(cfg->model_type, known_archs[i].model_type) == 0;
        if (by_arch || by_type) {
            cfg->arch = known_archs[i].arch;
            max_pos_default = known_archs[i].max_pos;
        }
    }
    c->strict = cfg->arch != LM_ARCH_UNKNOWN;

    if ((s = get_dim(c, root, "hidden_size", &cfg->hidden_size)) != LM_OK ||
        (s = get_dim(c, root, "intermediate_size", &cfg->intermediate_size)) != LM_OK ||
        (s = get_dim(c, root, "num_hidden_layers", &cfg->num_hidden_layers)) != LM_OK ||
        (s = get_dim(c, root, "num_attention_heads", &cfg->num_attention_heads)) != LM_OK ||
        (s = get_dim(c, root, "vocab_size", &cfg->vocab_size)) != LM_OK)
        return s;

    // Optional dimensions: null or absent take their defaults.
    bool present;
    // the layers a gradient is spread over: the top level's count, else (a multimodal model:
    // Mistral3, Gemma 3, Qwen2.5-VL) its language model's, under text_config
    cfg->layer_count = cfg->num_hidden_layers;
    const cJSON *tc = item(root, "text_config");
    if (!cfg->layer_count && cJSON_IsObject(tc)) {
        int64_t n = 0;
        if ((s = get_int(c, tc, "text_config.", "num_hidden_layers", &n, &present)) != LM_OK)
            return s;
        cfg->layer_count = present && n > 0 ? n : 0;
    }
    if ((s = get_int(c, root, "", "num_key_value_heads", &cfg->num_key_value_heads, &present)) != LM_OK)
        return s;
    if (!present)
        cfg->num_key_value_heads = cfg->num_attention_heads;
    if ((s = get_int(c, root, "", "head_dim", &cfg->head_dim, &cfg->head_dim_given)) != LM_OK)
        return s;
    if ((s = get_int(c, root, "", "max_position_embeddings", &cfg->max_position_embeddings,
                     &present)) != LM_OK)
        return s;
    if (!present)
        cfg->max_position_embeddings = max_pos_default;
    cfg->rms_norm_eps = 1e-6;
    if ((s = get_num(c, root, "", "rms_norm_eps", &cfg->rms_norm_eps, &present)) != LM_OK)
        return s;
    if ((s = parse_rope(c, cfg, root)) != LM_OK)
        return s;
    if ((s = get_bool(c, root, "tie_word_embeddings", &cfg->tie_word_embeddings)) != LM_OK ||
        (s = get_bool(c, root, "attention_bias", &cfg->attention_bias)) != LM_OK ||
        (s = get_bool(c, root, "mlp_bias", &cfg->mlp_bias)) != LM_OK ||
        (s = get_bool(c, root, "use_sliding_window", &cfg->use_sliding_window)) != LM_OK ||
        (s = get_int(c, root, "", "sliding_window", &cfg->sliding_window, &present)) != LM_OK)
        return s;
    if (cfg->sliding_window < 0)
        cfg->sliding_window = 0;

    // "dtype" is the newer name; either may be null.
    if ((s = get_str(c, root, "", "dtype", &cfg->dtype_name)) != LM_OK)
        return s;
    if (!cfg->dtype_name && (s = get_str(c, root, "", "torch_dtype", &cfg->dtype_name)) != LM_OK)
        return s;
    if (cfg->dtype_name)
        cfg->has_dtype = lm_dtype_from_user(cfg->dtype_name, &cfg->dtype);

    // Derived values, checked only where the architecture tells what they mean.
    if (!cfg->head_dim_given && cfg->num_attention_heads > 0)
        cfg->head_dim = cfg->hidden_size / cfg->num_attention_heads;
    if (!c->strict) {
        if (cfg->num_key_value_heads < 0)
            cfg->num_key_value_heads = 0;
        if (cfg->head_dim < 0)
            cfg->head_dim = 0;
        return LM_OK;
    }

    if (cfg->num_key_value_heads <= 0)
        return lm_err_set(c->err, LM_ERR_FORMAT, "%s: key 'num_key_value_heads' must be positive, not %lld",
                          c->label, (long long)cfg->num_key_value_heads);
    if (cfg->num_attention_heads % cfg->num_key_value_heads != 0)
        return lm_err_set(c->err, LM_ERR_FORMAT,
                          "%s: num_attention_heads (%lld) is not a multiple of num_key_value_heads (%lld)",
                          c->label, (long long)cfg->num_attention_heads,
                          (long long)cfg->num_key_value_heads);
    if (cfg->head_dim_given) {
        if (cfg->head_dim <= 0 || cfg->head_dim % 2 != 0)
            return lm_err_set(c->err, LM_ERR_FORMAT,
                              "%s: key 'head_dim' must be a positive even number, not %lld",
                              c->label, (long long)cfg->head_dim);
    } else {
        if (cfg->hidden_size % cfg->num_attention_heads != 0)
            return lm_err_set(c->err, LM_ERR_FORMAT,
                              "%s: hidden_size (%lld) is not a multiple of num_attention_heads (%lld) "
                              "and head_dim is not given", c->label, (long long)cfg->hidden_size,
                              (long long)cfg->num_attention_heads);
        if (cfg->head_dim % 2 != 0)
            return lm_err_set(c->err, LM_ERR_FORMAT,
                              "%s: head_dim = hidden_size / num_attention_heads = %lld is odd; "
                              "rotary embeddings need an even head_dim", c->label,
                              (long long)cfg->head_dim);
    }
    if (cfg->max_position_embeddings <= 0)
        return lm_err_set(c->err, LM_ERR_FORMAT,
                          "%s: key 'max_position_embeddings' must be positive, not %lld", c->label,
                          (long long)cfg->max_position_embeddings);
    if (!(cfg->rms_norm_eps >= 0))
        return lm_err_set(c->err, LM_ERR_FORMAT, "%s: key 'rms_norm_eps' must not be negative (%g)",
                          c->label, cfg->rms_norm_eps);

    switch (cfg->arch) {
    case LM_ARCH_LLAMA:
        cfg->q_bias = cfg->k_bias = cfg->v_bias = cfg->o_bias = cfg->attention_bias;
        cfg->gate_bias = cfg->up_bias = cfg->down_bias = cfg->mlp_bias;
        break;
    case LM_ARCH_QWEN2:
        // Qwen2Attention builds q, k, v with bias=True and o with bias=False, whatever the file says.
        cfg->q_bias = cfg->k_bias = cfg->v_bias = true;
        break;
    case LM_ARCH_MISTRAL:  // MistralAttention and MistralMLP have no biases
    case LM_ARCH_UNKNOWN:
        break;
    }
    return LM_OK;
}

lm_status lm_config_parse(lm_config *cfg, const char *json, size_t len, const char *label,
                          lm_err *err)
{
    memset(cfg, 0, sizeof *cfg);
    if (!(cfg->path = lm_strdup(label)))
        return lm_err_set(err, LM_ERR_NOMEM, "%s: out of memory", label);

    cJSON *root = NULL;
    lm_status s = lm_json_parse(&root, json, len, label, err);
    if (s != LM_OK)
        goto fail;
    if (!cJSON_IsObject(root)) {
        s = lm_err_set(err, LM_ERR_FORMAT, "%s: expected a JSON object, found %s", label,
                       lm_json_kind(root));
        goto fail;
    }
    cfg_ctx c = {.label = label, .strict = false, .err = err};
    if ((s = parse_root(cfg, root, &c)) != LM_OK)
        goto fail;
    cJSON_Delete(root);
    return LM_OK;

fail:
    cJSON_Delete(root);
    lm_config_free(cfg);
    return s;
}

lm_status lm_config_load(lm_config *cfg, const char *path, lm_err *err)
{
    memset(cfg, 0, sizeof *cfg);
    char *text = NULL;
    size_t len = 0;
    lm_status s = lm_read_file(path, CONFIG_MAX_BYTES, &text, &len, err);
    if (s != LM_OK)
        return s;
    s = lm_config_parse(cfg, text, len, path, err);
    free(text);
    return s;
}

void lm_config_free(lm_config *cfg)
{
    if (!cfg)
        return;
    free(cfg->path);
    free(cfg->architecture);
    free(cfg->model_type);
    free(cfg->rope_scaling.type);
    free(cfg->dtype_name);
    memset(cfg, 0, sizeof *cfg);
}
