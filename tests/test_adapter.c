// Tests of PEFT LoRA adapters (lib/adapter.c): adapter_config.json fields and errors, the scale
// rules (alpha / r, alpha / sqrt(r) with rslora), rank_pattern / alpha_pattern taking the first
// key in file order whose `(.*\.)?(K)$` matches (a suffix such as "v_proj" matches, "proj" does
// not match "...v_proj" because "v_" is not followed by a dot), target_modules as a list, a
// full-match regex or "all-linear", with exclude_modules, modules_to_save, layers_to_transform
// and layers_pattern as PEFT applies them, and lm_adapter_select setting aside the modules PEFT
// would not load (or refusing a target_modules that selects no layer of the base); Python regex
// syntax (look-arounds, \b, inline flags, named groups) matched as Python matches it, and
// patterns that would run away (nested repeats, 40 KB long, catastrophic backtracking) failing
// at once, naming the file, key and pattern; grouping of keys into linear, DoRA, bias and embedding
// modules and modules_to_save tensors; every open and validation error naming the key (and,
// against a base, the base tensor and both shapes); adapter_model.bin; and what lm_input_detect
// says about files, model and adapter directories, and the nested layout. Each test writes its
// own files into a fresh directory under /tmp with the hand-written safetensors writer of
// fixture.h.
#include <stdint.h>
#include <sys/stat.h>
#include <unistd.h>

#include "adapter.h"
#include "check.h"
#include "fixture.h"
#include "testfs.h"
#include "model.h"
#include "util.h"

// ==== helpers =================================================================================

static void remove_file(const char *dir, const char *name)
{
    char *p = lm_path_join(dir, name);
    unlink(p);
    free(p);
}

// A LoRA key for module `module` of layer `layer` ("self_attn.q_proj") with `suffix`.
static const char *K(int layer, const char *module, const char *suffix)
{
    static char bufs[16][112];
    static int next;
    char *b = bufs[next++ % 16];
    snprintf(b, sizeof bufs[0], "base_model.model.model.layers.%d.%s%s", layer, module, suffix);
    return b;
}

// fixture.h's tiny Llama as a base: 2 layers, hidden 8, intermediate 12, 2 heads of 4, 1 kv
// head, vocab 16; with `bias`, attention_bias (q, k, v, o biases). Tensor `odd` (may be NULL) is
// written in dtype `odd_dt` instead of F32.
static void write_base_odd(const char *dir, bool bias, const char *odd, const char *odd_dt);

static void write_base(const char *dir, bool bias)
{
    write_base_odd(dir, bias, NULL, NULL);
}

static void write_base_odd(const char *dir, bool bias, const char *odd, const char *odd_dt)
{
    char cfg[512];
    snprintf(cfg, sizeof cfg,
             "{\"architectures\": [\"LlamaForCausalLM\"], \"hidden_size\": 8, "
             "\"intermediate_size\": 12, \"num_hidden_layers\": 2, \"num_attention_heads\": 2, "
             "\"num_key_value_heads\": 1, \"vocab_size\": 16, \"attention_bias\": %s}",
             bias ? "true" : "false");
    write_text(dir, "config.json", cfg);
    fixture_tensor ts[64];
    int n = fixture_tiny_llama(ts, bias);
    for (int i = 0; odd && i < n; i++)
        if (strcmp(ts[i].name, odd) == 0)
            ts[i].dtype = odd_dt;
    fixture_write_st(dir, "model.safetensors", ts, n, FIXTURE_ZEROS);
}

static void write_adapter(const char *dir, const char *config, const fixture_tensor *ts, int n)
{
    write_text(dir, "adapter_config.json", config);
    fixture_write_st(dir, "adapter_model.safetensors", ts, n, FIXTURE_ZEROS);
}

// Writes the adapter (config and the n tensors ts) into dir and opens it. Returns the adapter,
// or NULL after a failed check; the caller frees it with lm_adapter_free.
static lm_adapter *write_open(const char *dir, const char *config, const fixture_tensor *ts, int n)
{
    write_adapter(dir, config, ts, n);
    lm_adapter *a = NULL;
    lm_err err;
    CHECK_OK(lm_adapter_open(&a, dir, &err), &err);
    return a;
}

// A test's directory: fixture.h's tiny Llama without biases written to root/base and opened,
// and root/adapter for the test's adapter. Remove it all with tiny_close.
typedef struct tiny {
    char *root, *base_dir, *ad;
    lm_model *base;  // NULL after a failed check
} tiny;

static tiny tiny_open(void)
{
    tiny t = {.root = make_tmpdir()};
    t.base_dir = subdir(t.root, "base");
    t.ad = subdir(t.root, "adapter");
    write_base(t.base_dir, false);
    lm_err err;
    CHECK_OK(lm_model_open(&t.base, t.base_dir, &err), &err);
    return t;
}

// Frees the base and removes the directory with everything in it.
static void tiny_close(tiny *t)
{
    lm_model_free(t->base);
    free(t->base_dir);
    free(t->ad);
    remove_tmpdir(t->root);
}

static lm_status parse(lm_lora_config *c, const char *json, lm_err *err)
{
    return lm_lora_config_parse(c, json, strlen(json), "test/adapter_config.json", err);
}

// lm_lora_config_rank, which must succeed.
static void rank(const lm_lora_config *c, const char *path, int64_t *r, double *alpha, const char **rk,
                 const char **ak)
{
    lm_err err = {0};
    CHECK_OK(lm_lora_config_rank(c, path, r, alpha, rk, ak, &err), &err);
}

// lm_lora_config_select, which must succeed: whether it selects `path`.
static bool sel(const lm_lora_config *c, const char *path)
{
    lm_err err = {0};
    lm_lora_select why = LM_LORA_NOT_TARGETED;
    CHECK_OK(lm_lora_config_select(c, path, &why, NULL, &err), &err);
    return why == LM_LORA_SELECTED;
}

// JSON text of {"peft_type": "LORA", KEY: <"pattern" as a JSON string>}: `pattern` escaped.
static char *config_with(const char *key, const char *pattern, bool in_object)
{
    size_t n = strlen(pattern);
    char *out = malloc(2 * n + 128), *o = out;
    o += sprintf(o, "{\"peft_type\": \"LORA\", \"%s\": %s\"", key, in_object ? "{" : "");
    for (size_t i = 0; i < n; i++) {
        if (pattern[i] == '"' || pattern[i] == '\\')
            *o++ = '\\';
        *o++ = pattern[i];
    }
    sprintf(o, "\"%s}", in_object ? ": 4}" : "");
    return out;
}

// ==== adapter_config.json =====================================================================

static void test_config_fields(void)
{
    lm_lora_config c;
    lm_err err;
    CHECK_OK(parse(&c,
                   "{\"peft_type\": \"LORA\", \"r\": 16, \"lora_alpha\": 32, \"task_type\": \"CAUSAL_LM\", "
                   "\"target_modules\": [\"q_proj\", \"v_proj\"], \"use_rslora\": false, \"use_dora\": false, "
                   "\"fan_in_fan_out\": false, \"lora_bias\": false, \"rank_pattern\": {}, "
                   "\"alpha_pattern\": {}, \"modules_to_save\": [\"lm_head\", \"embed_tokens\"], "
                   "\"layers_to_transform\": null, \"base_model_name_or_path\": \"meta-llama/Llama-3.2-1B\", "
                   "\"loftq_config\": {}, \"megatron_config\": null, \"lora_dropout\": 0.05}", &err), &err);
    CHECK(strcmp(c.peft_type, "LORA") == 0);
    CHECK(c.r == 16 && c.lora_alpha == 32);
    CHECK(c.targets == LM_LORA_TARGETS_LIST && c.n_target_modules == 2);
    CHECK(strcmp(c.target_modules[1], "v_proj") == 0);
    CHECK(!c.use_rslora && !c.use_dora && !c.fan_in_fan_out && !c.lora_bias);
    CHECK(c.n_rank_pattern == 0 && c.n_alpha_pattern == 0);
    CHECK(c.n_modules_to_save == 2 && strcmp(c.modules_to_save[0], "lm_head") == 0);
    CHECK(c.n_layers_to_transform == 0);
    CHECK(strcmp(c.base_model_name_or_path, "meta-llama/Llama-3.2-1B") == 0);
    CHECK(lm_lora_config_scale(&c, c.r, c.lora_alpha) == 2.0);
    lm_lora_config_free(&c);
    lm_lora_config_free(&c);

    // PEFT's defaults for r and lora_alpha; rslora scale alpha / sqrt(r).
    CHECK_OK(parse(&c, "{\"peft_type\": \"LORA\", \"use_rslora\": true}", &err), &err);
    CHECK(c.r == 8 && c.lora_alpha == 8 && c.targets == LM_LORA_TARGETS_NONE);
    CHECK(c.use_rslora);
    CHECK_NEAR(lm_lora_config_scale(&c, 16, 16.0), 4.0, 1e-15);
    CHECK_NEAR(lm_lora_config_scale(&c, 8, 8.0), 8.0 / sqrt(8.0), 1e-15);
    lm_lora_config_free(&c);

    // layers_to_transform as one integer or a list.
    CHECK_OK(parse(&c, "{\"peft_type\": \"LORA\", \"layers_to_transform\": 3}", &err), &err);
    CHECK(c.n_layers_to_transform == 1 && c.layers_to_transform[0] == 3);
    lm_lora_config_free(&c);
    CHECK_OK(parse(&c, "{\"peft_type\": \"LORA\", \"layers_to_transform\": [0, 2]}", &err), &err);
    CHECK(c.n_layers_to_transform == 2 && c.layers_to_transform[1] == 2);
    lm_lora_config_free(&c);
}

static void test_config_patterns(void)
{
    lm_lora_config c;
    lm_err err;
    int64_t r;
    double alpha;
    const char *rk, *ak;
    const char *v0 = "model.layers.0.self_attn.v_proj", *v1 = "model.layers.1.self_attn.v_proj";

    // First key in file order wins: the suffix "v_proj" comes first and matches both layers.
    CHECK_OK(parse(&c,
                   "{\"peft_type\": \"LORA\", \"r\": 8, \"lora_alpha\": 16, "
                   "\"rank_pattern\": {\"v_proj\": 4, \"model.layers.0.self_attn.v_proj\": 2}, "
                   "\"alpha_pattern\": {\"q_proj\": 32}}", &err), &err);
    CHECK(c.n_rank_pattern == 2 && strcmp(c.rank_pattern[0].key, "v_proj") == 0);
    rank(&c, v0, &r, &alpha, &rk, &ak);
    CHECK(r == 4 && alpha == 16 && rk && strcmp(rk, "v_proj") == 0 && ak == NULL);
    rank(&c, "model.layers.0.self_attn.q_proj", &r, &alpha, &rk, &ak);
    CHECK(r == 8 && alpha == 32 && rk == NULL && ak && strcmp(ak, "q_proj") == 0);
    CHECK(lm_lora_config_scale(&c, 8, 32) == 4.0);
    lm_lora_config_free(&c);

    // The other order: the full path now comes first for layer 0.
    CHECK_OK(parse(&c,
                   "{\"peft_type\": \"LORA\", \"r\": 8, "
                   "\"rank_pattern\": {\"model.layers.0.self_attn.v_proj\": 2, \"v_proj\": 4}}", &err), &err);
    rank(&c, v0, &r, &alpha, NULL, NULL);
    CHECK(r == 2);
    rank(&c, v1, &r, &alpha, NULL, NULL);
    CHECK(r == 4);
    lm_lora_config_free(&c);

    // "proj" must not match "...v_proj": "(.*\.)?(proj)$" needs a dot right before "proj".
    // "self_attn.v_proj" matches as a dotted suffix; "_proj" and "layers.0" do not.
    CHECK_OK(parse(&c,
                   "{\"peft_type\": \"LORA\", \"r\": 8, "
                   "\"rank_pattern\": {\"proj\": 1, \"_proj\": 2, \"layers.0\": 3, \"self_attn.v_proj\": 5}}",
                   &err), &err);
    rank(&c, v0, &r, &alpha, &rk, NULL);
    CHECK_MSG(r == 5 && rk && strcmp(rk, "self_attn.v_proj") == 0, "r = %lld", (long long)r);
    rank(&c, "model.layers.0.mlp.down_proj", &r, &alpha, &rk, NULL);
    CHECK(r == 8 && rk == NULL);
    rank(&c, "proj", &r, &alpha, &rk, NULL);  // the whole path may be the key
    CHECK(r == 1);
    lm_lora_config_free(&c);

    // Keys are Python regexes: \d, alternation, (?:...), lazy quantifiers, {m,n}.
    CHECK_OK(parse(&c,
                   "{\"peft_type\": \"LORA\", \"r\": 8, \"rank_pattern\": {"
                   "\"layers\\\\.[1-3]\\\\.mlp\\\\..*\": 3, "
                   "\"(?:q|k)_proj\": 6, "
                   "\"layers\\\\.\\\\d{2,}\\\\..*?\": 7, "
                   "\"gate_proj|up_proj\": 9}}", &err), &err);
    rank(&c, "model.layers.2.mlp.up_proj", &r, &alpha, NULL, NULL);
    CHECK(r == 3);
    rank(&c, "model.layers.0.mlp.up_proj", &r, &alpha, NULL, NULL);
    CHECK(r == 9);
    rank(&c, "model.layers.0.self_attn.k_proj", &r, &alpha, NULL, NULL);
    CHECK(r == 6);
    rank(&c, "model.layers.0.self_attn.v_proj", &r, &alpha, NULL, NULL);
    CHECK(r == 8);
    rank(&c, "model.layers.12.self_attn.v_proj", &r, &alpha, NULL, NULL);
    CHECK(r == 7);
    lm_lora_config_free(&c);

    // Python's own constructs mean what they mean in Python: look-aheads and look-behinds, \b,
    // inline flags, named groups and backreferences, \w and \s.
    CHECK_OK(parse(&c,
                   "{\"peft_type\": \"LORA\", \"r\": 8, \"rank_pattern\": {"
                   "\"(?<!self_attn\\\\.)q_proj\": 1, "
                   "\"(?!layers\\\\.1\\\\b)\\\\w+\\\\.\\\\d+\\\\.self_attn\\\\.(?=k)\\\\w+\": 2, "
                   "\"(?i:MLP\\\\.UP_PROJ)\": 3, "
                   "\"(?P<x>e)xperts\\\\.\\\\d+\\\\.(?P=x)\\\\w*\": 4, "
                   "\"\\\\bdown_proj\\\\b\": 5, "
                   "\"\\\\S+\\\\s?gate_proj\": 6}, "
                   "\"alpha_pattern\": {\"(?<=\\\\.)(q|v)_proj(?!\\\\.)\": 32}}", &err), &err);
    rank(&c, "model.layers.0.self_attn.q_proj", &r, &alpha, NULL, NULL);
    CHECK_MSG(r == 8 && alpha == 32, "r %lld alpha %g", (long long)r, alpha);  // look-behind fails
    rank(&c, "model.layers.0.cross.q_proj", &r, &alpha, NULL, NULL);
    CHECK(r == 1 && alpha == 32);
    rank(&c, "model.layers.0.self_attn.k_proj", &r, &alpha, NULL, NULL);
    CHECK(r == 2 && alpha == 8);
    rank(&c, "model.layers.1.self_attn.k_proj", &r, &alpha, NULL, NULL);
    CHECK(r == 8);  // the negative look-ahead, with \b: layer 1 but not layer 12
    rank(&c, "model.layers.12.self_attn.k_proj", &r, &alpha, NULL, NULL);
    CHECK(r == 2);
    rank(&c, "model.layers.3.mlp.up_proj", &r, &alpha, NULL, NULL);
    CHECK(r == 3);  // (?i:...)
    rank(&c, "model.layers.3.mlp.experts.7.expert_up", &r, &alpha, NULL, NULL);
    CHECK(r == 4);  // a named group and its backreference
    rank(&c, "model.layers.3.mlp.experts.7.fc", &r, &alpha, NULL, NULL);
    CHECK(r == 8);
    rank(&c, "model.layers.3.mlp.down_proj", &r, &alpha, NULL, NULL);
    CHECK(r == 5);
    rank(&c, "model.layers.3.mlp.gate_proj", &r, &alpha, NULL, NULL);
    CHECK(r == 6);
    lm_lora_config_free(&c);

    // A pattern that does not compile names the file, the key and the pattern.
    CHECK_FAILS(parse(&c, "{\"peft_type\": \"LORA\", \"rank_pattern\": {\"q[_proj\": 2}}", &err),
                LM_ERR_FORMAT, "test/adapter_config.json: key 'rank_pattern': regex 'q[_proj' does not compile",
                &err);
    CHECK_FAILS(parse(&c, "{\"peft_type\": \"LORA\", \"rank_pattern\": {\"q(_proj\": 2}}", &err),
                LM_ERR_FORMAT, "key 'rank_pattern': regex 'q(_proj' does not compile: missing closing parenthesis",
                &err);
    // A key that closes PEFT's own group reads as Python reads the whole: "(.*\.)?(layers)|(x)$",
    // whose first branch needs no end of the path.
    CHECK_OK(parse(&c, "{\"peft_type\": \"LORA\", \"rank_pattern\": {\"layers)|(x\": 2}}", &err), &err);
    rank(&c, "model.layers.0.self_attn.q_proj", &r, &alpha, NULL, NULL);
    CHECK(r == 2);
    lm_lora_config_free(&c);
    // Python reads {,n} as {0,n}; PCRE2 before 10.43 as text: refused, not read otherwise.
    CHECK_FAILS(parse(&c, "{\"peft_type\": \"LORA\", \"alpha_pattern\": {\"q{,2}_proj\": 2}}", &err),
                LM_ERR_FORMAT, "key 'alpha_pattern': regex 'q{,2}_proj' uses the quantifier", &err);
    CHECK_OK(parse(&c, "{\"peft_type\": \"LORA\", \"alpha_pattern\": {\"[{,2}]q\\\\{,2}_proj\": 2}}", &err), &err);
    lm_lora_config_free(&c);
    CHECK_FAILS(parse(&c, "{\"peft_type\": \"LORA\", \"rank_pattern\": {\"q_proj\": 0}}", &err),
                LM_ERR_FORMAT, "rank_pattern['q_proj'] must be a positive integer, not 0", &err);
    CHECK_FAILS(parse(&c, "{\"peft_type\": \"LORA\", \"rank_pattern\": {\"q_proj\": \"4\"}}", &err),
                LM_ERR_FORMAT, "rank_pattern['q_proj'] must be a positive integer, not a string", &err);
    CHECK_FAILS(parse(&c, "{\"peft_type\": \"LORA\", \"alpha_pattern\": [1]}", &err),
                LM_ERR_FORMAT, "key 'alpha_pattern' must be an object", &err);
}

// Patterns that would take unbounded time or memory fail at once, naming the file, the key and
// the pattern: nested bounded repeats (too large to compile), a pattern over the length limit,
// and catastrophic backtracking (past the match limit on the first module path).
static void test_config_regex_limits(void)
{
    lm_lora_config c;
    lm_err err;
    const char *q0 = "model.layers.0.self_attn.q_proj";

    double t0 = lm_now();
    char *json = config_with("rank_pattern", "(((.{0,255}){0,255}){0,255})", true);
    CHECK_FAILS(parse(&c, json, &err), LM_ERR_FORMAT,
                "test/adapter_config.json: key 'rank_pattern': regex '(((.{0,255}){0,255}){0,255})' does not compile",
                &err);
    free(json);
    double t1 = lm_now();
    CHECK_MSG(t1 - t0 < 2.0, "nested repeats took %.2f s", t1 - t0);

    // ".*" × 20000 + "q_proj": over the length limit before PCRE2 sees it
    char *big = malloc(40100);
    big[0] = '\0';
    for (int i = 0; i < 20000; i++)
        memcpy(big + 2 * i, ".*", 3);
    strcat(big, "q_proj");
    json = config_with("target_modules", big, false);
    CHECK_FAILS(parse(&c, json, &err), LM_ERR_FORMAT,
                "test/adapter_config.json: key 'target_modules': regex '.*.*", &err);
    CHECK(strstr(err.msg, "is 40006 bytes long, over the limit of 4096") != NULL);
    free(json);
    double t2 = lm_now();
    CHECK_MSG(t2 - t1 < 2.0, "a 40006-byte pattern took %.2f s", t2 - t1);

    // Under the length limit, the same shape compiles and runs into the match limit.
    big[2 * 200] = '\0';
    strcat(big, "z_proj");
    json = config_with("target_modules", big, false);
    CHECK_OK(parse(&c, json, &err), &err);
    lm_lora_select why;
    CHECK_FAILS(lm_lora_config_select(&c, q0, &why, NULL, &err), LM_ERR_FORMAT,
                "test/adapter_config.json: key 'target_modules': regex '.*.*.*", &err);
    CHECK(strstr(err.msg, "z_proj' runs past its limits matching module 'model.layers.0.self_attn.q_proj' "
                          "(PCRE2: match limit exceeded)") != NULL);
    lm_lora_config_free(&c);
    free(json);
    double t3 = lm_now();
    CHECK_MSG(t3 - t2 < 2.0, "200 nested .* took %.2f s", t3 - t2);

    // Exponential backtracking in a rank_pattern key, in exclude_modules and in a layers_pattern.
    json = config_with("rank_pattern", "(\\w|.)*(\\w|.)*(\\w|.)*\\.\\.", true);
    CHECK_OK(parse(&c, json, &err), &err);
    int64_t r;
    double alpha;
    CHECK_FAILS(lm_lora_config_rank(&c, q0, &r, &alpha, NULL, NULL, &err), LM_ERR_FORMAT,
                "key 'rank_pattern': regex '(\\w|.)*(\\w|.)*(\\w|.)*\\.\\.' runs past its limits", &err);
    lm_lora_config_free(&c);
    free(json);
    CHECK_OK(parse(&c, "{\"peft_type\": \"LORA\", \"target_modules\": [\"q_proj\"], "
                       "\"exclude_modules\": \"(.*.*)*[.]{2}\"}", &err), &err);
    CHECK_FAILS(lm_lora_config_select(&c, q0, &why, NULL, &err), LM_ERR_FORMAT,
                "key 'exclude_modules': regex '(.*.*)*[.]{2}' runs past its limits", &err);
    lm_lora_config_free(&c);
    CHECK_OK(parse(&c, "{\"peft_type\": \"LORA\", \"target_modules\": [\"q_proj\"], \"layers_to_transform\": [0], "
                       "\"layers_pattern\": \"(?:(?:.*)*)*[.]{2}\"}", &err), &err);
    CHECK_FAILS(lm_lora_config_select(&c, q0, &why, NULL, &err), LM_ERR_FORMAT,
                "key 'layers_pattern': regex '(?:(?:.*)*)*[.]{2}' runs past its limits", &err);
    lm_lora_config_free(&c);
    CHECK_MSG(lm_now() - t3 < 2.0, "the backtracking patterns took %.2f s", lm_now() - t3);
    free(big);
}

static void test_config_targets(void)
{
    lm_lora_config c;
    lm_err err;
    const char *q0 = "model.layers.0.self_attn.q_proj", *k0 = "model.layers.0.self_attn.k_proj";
    const char *q1 = "model.layers.1.self_attn.q_proj";

    CHECK_OK(parse(&c, "{\"peft_type\": \"LORA\", \"target_modules\": [\"q_proj\", \"v_proj\"]}", &err), &err);
    CHECK(sel(&c, q0) && !sel(&c, k0));
    CHECK(sel(&c, "q_proj"));
    CHECK(!sel(&c, "model.layers.0.self_attn.xq_proj"));
    lm_lora_config_free(&c);

    // A regex string is a full match: "q_proj" alone does not select the full path.
    CHECK_OK(parse(&c, "{\"peft_type\": \"LORA\", \"target_modules\": \".*\\\\.(q|v)_proj\"}", &err), &err);
    CHECK(c.targets == LM_LORA_TARGETS_REGEX && strcmp(c.target_regex, ".*\\.(q|v)_proj") == 0);
    CHECK(sel(&c, q0) && !sel(&c, k0));
    CHECK(!sel(&c, "model.layers.0.self_attn.q_proj.x"));
    lm_lora_config_free(&c);
    CHECK_OK(parse(&c, "{\"peft_type\": \"LORA\", \"target_modules\": \"q_proj\"}", &err), &err);
    CHECK(!sel(&c, q0) && sel(&c, "q_proj"));
    lm_lora_config_free(&c);
    // A full match backtracks into alternatives as Python's re.fullmatch does.
    CHECK_OK(parse(&c, "{\"peft_type\": \"LORA\", \"target_modules\": \"q|q_proj\"}", &err), &err);
    CHECK(sel(&c, "q_proj") && sel(&c, "q") && !sel(&c, "q_pro"));
    lm_lora_config_free(&c);
    // Look-arounds, \b and (?i) as Python reads them.
    CHECK_OK(parse(&c, "{\"peft_type\": \"LORA\", \"target_modules\": "
                       "\"(?i)MODEL\\\\.LAYERS\\\\.(?!1\\\\b)\\\\d+\\\\..*(?<=self_attn\\\\.)[QK]_PROJ\"}",
                   &err), &err);
    CHECK(sel(&c, q0) && sel(&c, k0) && !sel(&c, q1));
    CHECK(sel(&c, "model.layers.10.self_attn.q_proj") && !sel(&c, "model.layers.0.mlp.k_proj"));
    lm_lora_config_free(&c);

    CHECK_OK(parse(&c, "{\"peft_type\": \"LORA\", \"target_modules\": \"all-linear\"}", &err), &err);
    CHECK(c.targets == LM_LORA_TARGETS_ALL_LINEAR);
    CHECK(sel(&c, q0) && !sel(&c, "lm_head"));
    lm_lora_config_free(&c);

    // layers_to_transform narrows a list to the named layers: the layer index is the first
    // number after a component (after layers_pattern when given), as PEFT reads it.
    CHECK_OK(parse(&c, "{\"peft_type\": \"LORA\", \"target_modules\": [\"q_proj\", \"up_proj\"], "
                       "\"layers_to_transform\": [1]}", &err), &err);
    CHECK(!sel(&c, q0) && sel(&c, q1));
    CHECK(sel(&c, "model.layers.1.mlp.experts.0.up_proj") && !sel(&c, "model.layers.0.mlp.experts.1.up_proj"));
    lm_lora_select why;
    int64_t layer = -2;
    CHECK_OK(lm_lora_config_select(&c, "model.layers.0.mlp.experts.1.up_proj", &why, &layer, &err), &err);
    CHECK(why == LM_LORA_OTHER_LAYER && layer == 0);
    CHECK_OK(lm_lora_config_select(&c, "layers.1.q_proj", &why, &layer, &err), &err);
    CHECK(why == LM_LORA_NO_LAYER && layer == -1);  // no component before "layers"
    CHECK_OK(lm_lora_config_select(&c, "model.layers.01.q_proj", &why, &layer, &err), &err);
    CHECK(why == LM_LORA_SELECTED && layer == 1);
    CHECK_OK(lm_lora_config_select(&c, "model.layers.99999999999999999999999.q_proj", &why, &layer, &err), &err);
    CHECK(why == LM_LORA_OTHER_LAYER);
    lm_lora_config_free(&c);
    // A module named in full is selected whatever its layer (PEFT checks layers on suffixes only).
    CHECK_OK(parse(&c, "{\"peft_type\": \"LORA\", \"target_modules\": [\"model.layers.0.self_attn.q_proj\", "
                       "\"k_proj\"], \"layers_to_transform\": 1}", &err), &err);
    CHECK(sel(&c, q0) && !sel(&c, k0) && sel(&c, "model.layers.1.self_attn.k_proj"));
    lm_lora_config_free(&c);
    // layers_pattern: the number after one of the names, tried in order.
    CHECK_OK(parse(&c, "{\"peft_type\": \"LORA\", \"target_modules\": [\"q_proj\"], \"layers_to_transform\": [2], "
                       "\"layers_pattern\": [\"blocks\", \"h\"]}", &err), &err);
    CHECK(sel(&c, "transformer.h.2.attn.q_proj") && !sel(&c, "transformer.h.1.attn.q_proj"));
    CHECK(sel(&c, "model.blocks.2.h.5.q_proj") && !sel(&c, "model.layers.2.self_attn.q_proj"));
    lm_lora_config_free(&c);
    // An empty layers_pattern is PEFT's default.
    CHECK_OK(parse(&c, "{\"peft_type\": \"LORA\", \"target_modules\": [\"q_proj\"], \"layers_to_transform\": [0], "
                       "\"layers_pattern\": \"\"}", &err), &err);
    CHECK(sel(&c, q0) && !sel(&c, q1) && c.n_layers_pattern == 0);
    lm_lora_config_free(&c);
    // A layers_pattern whose own group PEFT would take as the index fails as PEFT does.
    CHECK_OK(parse(&c, "{\"peft_type\": \"LORA\", \"target_modules\": [\"q_proj\"], \"layers_to_transform\": [0], "
                       "\"layers_pattern\": \"(layers)\"}", &err), &err);
    CHECK_FAILS(lm_lora_config_select(&c, q0, &why, NULL, &err), LM_ERR_FORMAT,
                "key 'layers_pattern': regex '(layers)' takes 'layers' from module 'model.layers.0.self_attn.q_proj' "
                "as its layer index", &err);
    lm_lora_config_free(&c);

    // exclude_modules (a list of names, or a full-match regex) and modules_to_save come first.
    CHECK_OK(parse(&c, "{\"peft_type\": \"LORA\", \"target_modules\": [\"q_proj\", \"k_proj\", \"lm_head\"], "
                       "\"exclude_modules\": [\"model.layers.0.self_attn.q_proj\"], "
                       "\"modules_to_save\": [\"lm_head\"]}",
                   &err), &err);
    CHECK_OK(lm_lora_config_select(&c, q0, &why, NULL, &err), &err);
    CHECK(why == LM_LORA_EXCLUDED);
    CHECK(sel(&c, q1) && sel(&c, k0));
    CHECK_OK(lm_lora_config_select(&c, "lm_head", &why, NULL, &err), &err);
    CHECK(why == LM_LORA_SAVED_MODULE);
    CHECK_OK(lm_lora_config_select(&c, "model.lm_head.proj", &why, NULL, &err), &err);
    CHECK(why == LM_LORA_SAVED_MODULE);
    CHECK_OK(lm_lora_config_select(&c, "model.xlm_head", &why, NULL, &err), &err);
    CHECK(why == LM_LORA_NOT_TARGETED);
    lm_lora_config_free(&c);
    CHECK_OK(parse(&c, "{\"peft_type\": \"LORA\", \"target_modules\": \"all-linear\", "
                       "\"exclude_modules\": \".*\\\\.1\\\\..*\"}", &err), &err);
    CHECK(sel(&c, q0) && !sel(&c, q1));
    CHECK(strcmp(lm_lora_select_reason(LM_LORA_EXCLUDED), "exclude_modules excludes it") == 0);
    lm_lora_config_free(&c);

    // Without target_modules (PEFT's default comes with the base: lm_adapter_select) nothing is
    // left out.
    CHECK_OK(parse(&c, "{\"peft_type\": \"LORA\"}", &err), &err);
    CHECK(sel(&c, q0) && sel(&c, "anything"));
    lm_lora_config_free(&c);
}

static void test_config_errors(void)
{
    static const struct { const char *json; lm_status want; const char *needle; } cases[] = {
        {"{\"peft_type\": \"IA3\", \"r\": 8}", LM_ERR_UNSUPPORTED, "peft_type 'IA3' is not supported"},
        {"{\"peft_type\": \"LOHA\"}", LM_ERR_UNSUPPORTED, "'LOHA'"},
        {"{\"r\": 8}", LM_ERR_FORMAT, "key 'peft_type' is missing"},
        {"{\"peft_type\": 1}", LM_ERR_FORMAT, "key 'peft_type' must be a string"},
        {"{\"peft_type\": \"LORA\", \"r\": \"8\"}", LM_ERR_FORMAT, "key 'r' must be a positive integer, not a string"},
        {"{\"peft_type\": \"LORA\", \"r\": 0}", LM_ERR_FORMAT, "key 'r' must be a positive integer, not 0"},
        {"{\"peft_type\": \"LORA\", \"r\": 2.5}", LM_ERR_FORMAT, "key 'r' must be a positive integer"},
        {"{\"peft_type\": \"LORA\", \"lora_alpha\": \"16\"}", LM_ERR_FORMAT, "key 'lora_alpha' must be a number"},
        {"{\"peft_type\": \"LORA\", \"target_modules\": 5}", LM_ERR_FORMAT, "key 'target_modules' must be"},
        {"{\"peft_type\": \"LORA\", \"target_modules\": [\"q\", 1]}", LM_ERR_FORMAT, "'target_modules' must be a list of strings"},
        {"{\"peft_type\": \"LORA\", \"use_dora\": \"yes\"}", LM_ERR_FORMAT, "key 'use_dora' must be true or false"},
        {"{\"peft_type\": \"LORA\", \"use_rslora\": 1}", LM_ERR_FORMAT, "key 'use_rslora'"},
        {"{\"peft_type\": \"LORA\", \"modules_to_save\": \"lm_head\"}", LM_ERR_FORMAT, "key 'modules_to_save' must be a list"},
        {"{\"peft_type\": \"LORA\", \"layers_to_transform\": [\"0\"]}", LM_ERR_FORMAT, "'layers_to_transform'"},
        {"{\"peft_type\": \"LORA\", \"base_model_name_or_path\": 3}", LM_ERR_FORMAT, "'base_model_name_or_path'"},
        {"{\"peft_type\": \"LORA\", \"target_modules\": \"(?<=x)q(\"}", LM_ERR_FORMAT,
         "key 'target_modules': regex '(?<=x)q(' does not compile"},
        {"{\"peft_type\": \"LORA\", \"target_modules\": \"q\", \"layers_to_transform\": []}", LM_ERR_FORMAT,
         "key 'layers_to_transform' cannot be used with a target_modules string ('q')"},
        {"{\"peft_type\": \"LORA\", \"target_modules\": \"all-linear\", \"layers_pattern\": \"h\"}", LM_ERR_FORMAT,
         "key 'layers_pattern' cannot be used with a target_modules string ('all-linear')"},
        {"{\"peft_type\": \"LORA\", \"target_modules\": [\"q\"], \"layers_pattern\": [\"h\"]}", LM_ERR_FORMAT,
         "key 'layers_pattern' needs layers_to_transform"},
        {"{\"peft_type\": \"LORA\", \"target_modules\": [\"q\"], \"layers_pattern\": 1}", LM_ERR_FORMAT,
         "key 'layers_pattern' must be a list of names or a regex string"},
        {"{\"peft_type\": \"LORA\", \"exclude_modules\": {}}", LM_ERR_FORMAT, "key 'exclude_modules' must be"},
        {"{\"peft_type\": \"LORA\", \"exclude_modules\": \"[\"}", LM_ERR_FORMAT, "key 'exclude_modules': regex '['"},
        {"{\"peft_type\": \"LORA\", \"modules_to_save\": [\"lm_head(\"]}", LM_ERR_FORMAT,
         "key 'modules_to_save': regex 'lm_head(' does not compile"},
        {"{\"peft_type\": \"LORA\", \"target_parameters\": [\"experts.w1\"]}", LM_ERR_UNSUPPORTED,
         "key 'target_parameters' is not supported"},
        {"[]", LM_ERR_FORMAT, "expected a JSON object"},
        {"{", LM_ERR_FORMAT, "not valid JSON"},
        // A number a double cannot hold is out of range, not "not a number".
        {"{\"peft_type\": \"LORA\", \"lora_alpha\": 1e400}", LM_ERR_FORMAT,
         "key 'lora_alpha': 1e400 is out of range"},
        {"\xEF\xBB\xBF{\"peft_type\": \"LORA\"}", LM_ERR_FORMAT, "starts with a UTF-8 byte order mark"},
        {"{\"peft_type\": \"LORA\", \"r\": 8, \"r\": 16}", LM_ERR_FORMAT, "key 'r' appears twice"},
        {"{\"peft_type\": \"LORA\"} {}", LM_ERR_FORMAT, "text after the JSON value (line 1, column 23)"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        lm_lora_config c;
        lm_err err = {0};
        CHECK_FAILS(parse(&c, cases[i].json, &err), cases[i].want, cases[i].needle, &err);
        CHECK_MSG(strstr(err.msg, "test/adapter_config.json") != NULL, "case %zu: %s", i, err.msg);
        CHECK(c.path == NULL && c.peft_type == NULL);
    }
}

// ==== adapters ================================================================================

static void test_adapter_linear(void)
{
    tiny t = tiny_open();
    fixture_tensor ts[] = {
        fixture_t2(K(0, "self_attn.q_proj", ".lora_A.weight"), 2, 8),
        fixture_t2(K(0, "self_attn.q_proj", ".lora_B.weight"), 8, 2),
        fixture_t2(K(0, "self_attn.v_proj", ".lora_A.weight"), 4, 8),
        fixture_t2(K(0, "self_attn.v_proj", ".lora_B.weight"), 4, 4),
        fixture_t2(K(1, "self_attn.q_proj", ".lora_B.weight"), 8, 2),  // B before A is fine
        fixture_t2(K(1, "self_attn.q_proj", ".lora_A.weight"), 2, 8),
        fixture_t2(K(1, "self_attn.v_proj", ".lora_A.weight"), 4, 8),
        fixture_t2(K(1, "self_attn.v_proj", ".lora_B.weight"), 4, 4),
    };
    write_adapter(t.ad,
                  "{\"peft_type\": \"LORA\", \"r\": 2, \"lora_alpha\": 4, "
                  "\"target_modules\": [\"q_proj\", \"v_proj\"], \"rank_pattern\": {\"v_proj\": 4}, "
                  "\"alpha_pattern\": {\"model.layers.1.self_attn.q_proj\": 8}}",
                  ts, 8);
    lm_adapter *a = NULL;
    lm_err err;
    CHECK_OK(lm_adapter_open(&a, t.ad, &err), &err);
    if (a && t.base) {
        CHECK(a->n_modules == 4 && a->n_saved == 0);
        static const struct { const char *path; int64_t r; double alpha, scale; } want[] = {
            {"model.layers.0.self_attn.q_proj", 2, 4, 2},
            {"model.layers.0.self_attn.v_proj", 4, 4, 1},
            {"model.layers.1.self_attn.q_proj", 2, 8, 4},
            {"model.layers.1.self_attn.v_proj", 4, 4, 1},
        };
        for (int i = 0; i < 4 && i < a->n_modules; i++) {
            const lm_lora_module *m = &a->modules[i];
            CHECK_MSG(strcmp(m->path, want[i].path) == 0, "%s", m->path);
            CHECK(m->kind == LM_LORA_LINEAR && m->r == want[i].r);
            CHECK(m->alpha == want[i].alpha && m->scale == want[i].scale);
            CHECK(lm_str_ends_with(m->base_name, ".weight") && strncmp(m->base_name, m->path, strlen(m->path)) == 0);
            CHECK(m->bias == NULL && m->magnitude == NULL && m->bias_name == NULL);
            CHECK(m->a->shape[0] == m->r && m->b->shape[1] == m->r);
            CHECK(lm_str_ends_with(m->a->name, ".lora_A.weight") && lm_str_ends_with(m->b->name, ".lora_B.weight"));
        }
        CHECK(a->modules[1].r_key && strcmp(a->modules[1].r_key, "v_proj") == 0);
        CHECK(a->modules[2].alpha_key && strcmp(a->modules[2].alpha_key, "model.layers.1.self_attn.q_proj") == 0);
        int64_t idx = -1;
        CHECK(lm_adapter_lookup(a, "model.layers.1.self_attn.v_proj.weight", &idx) == LM_TOUCH_LORA && idx == 3);
        CHECK(lm_adapter_lookup(a, "model.layers.1.self_attn.k_proj.weight", &idx) == LM_TOUCH_NONE);
        CHECK(lm_adapter_lookup(a, "model.layers.1.self_attn.v_proj.bias", NULL) == LM_TOUCH_NONE);
        CHECK_OK(lm_adapter_validate(a, t.base, &err), &err);
    }
    lm_adapter_free(a);
    lm_adapter_free(NULL);
    tiny_close(&t);
}

// lm_adapter_select: the modules PEFT would not put LoRA on are set aside and change nothing; a
// target_modules that selects no layer of the base is an error naming adapter_config.json and
// the key; a null target_modules is PEFT's default for the base's model_type.
static void test_adapter_select(void)
{
    tiny t = tiny_open();
    char *other = subdir(t.root, "other");
    // the same weights under a model_type PEFT has no default for
    write_text(other, "config.json", "{\"architectures\": [\"TestForCausalLM\"], \"model_type\": \"test\"}");
    {
        char *from = lm_path_join(t.base_dir, "model.safetensors"), *to = lm_path_join(other, "model.safetensors");
        CHECK(link(from, to) == 0);
        free(from);
        free(to);
    }
    lm_model *obase = NULL;
    lm_err err;
    CHECK_OK(lm_model_open(&obase, other, &err), &err);
    fixture_tensor ts[] = {
        fixture_t2(K(0, "self_attn.q_proj", ".lora_A.weight"), 2, 8), fixture_t2(K(0, "self_attn.q_proj", ".lora_B.weight"), 8, 2),
        fixture_t2(K(0, "self_attn.k_proj", ".lora_A.weight"), 2, 8), fixture_t2(K(0, "self_attn.k_proj", ".lora_B.weight"), 4, 2),
        fixture_t2(K(1, "self_attn.q_proj", ".lora_A.weight"), 2, 8), fixture_t2(K(1, "self_attn.q_proj", ".lora_B.weight"), 8, 2),
        fixture_t2(K(1, "self_attn.v_proj", ".lora_A.weight"), 2, 8), fixture_t2(K(1, "self_attn.v_proj", ".lora_B.weight"), 4, 2),
        // for a layer the base does not have: set aside, not a mismatch, when not selected
        fixture_t2(K(7, "self_attn.k_proj", ".lora_A.weight"), 2, 8), fixture_t2(K(7, "self_attn.k_proj", ".lora_B.weight"), 4, 2),
        fixture_t2("base_model.model.model.embed_tokens.lora_embedding_A", 2, 16),
        fixture_t2("base_model.model.model.embed_tokens.lora_embedding_B", 8, 2),
    };
    const char *q0 = "model.layers.0.self_attn.q_proj.weight", *k0 = "model.layers.0.self_attn.k_proj.weight";
    const char *q1 = "model.layers.1.self_attn.q_proj.weight", *v1 = "model.layers.1.self_attn.v_proj.weight";
    const char *emb = "model.embed_tokens.weight";
    static const struct {
        const char *config;
        int n_kept;                  // modules left
        const char *kept[5];         // their base tensors, in file order
        lm_lora_select first_why;    // why the first module set aside was
        const char *first_msg;       // part of its message
    } cases[] = {
        {"\"target_modules\": [\"q_proj\", \"embed_tokens\"]", 3, {"0q", "1q", "emb"}, LM_LORA_NOT_TARGETED,
         "keys 'base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight', "
         "'base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight' are not merged, as PEFT would not load "
         "them: module model.layers.0.self_attn.k_proj: target_modules does not select it"},
        {"\"target_modules\": [\"q_proj\", \"k_proj\", \"v_proj\"], \"layers_to_transform\": [1]", 2, {"1q", "1v"},
         LM_LORA_OTHER_LAYER, "module model.layers.0.self_attn.q_proj: its layer 0 is not in layers_to_transform"},
        {"\"target_modules\": \".*\\\\.(?![07]\\\\.)\\\\d\\\\.self_attn\\\\.[qk]_proj\"", 1, {"1q"},
         LM_LORA_NOT_TARGETED,
         "module model.layers.0.self_attn.q_proj: target_modules does not select it"},
        {"\"target_modules\": [\"q_proj\", \"k_proj\", \"v_proj\"], "
         "\"exclude_modules\": [\"model.layers.1.self_attn.q_proj\", \"k_proj\"]",
         2, {"0q", "1v"}, LM_LORA_EXCLUDED, "module model.layers.0.self_attn.k_proj: exclude_modules excludes it"},
        {"\"target_modules\": [\"q_proj\", \"v_proj\"], \"modules_to_save\": [\"v_proj\"]", 2, {"0q", "1q"},
         LM_LORA_NOT_TARGETED, "module model.layers.0.self_attn.k_proj"},
        // all-linear: every linear layer but the output layer; an embedding is not one
        {"\"target_modules\": \"ALL-LINEAR\", \"exclude_modules\": \".*\\\\.7\\\\..*\"", 4, {"0q", "0k", "1q", "1v"},
         LM_LORA_EXCLUDED, "module model.layers.7.self_attn.k_proj: exclude_modules excludes it"},
        // null: PEFT's default for Llama, q_proj and v_proj
        {"\"target_modules\": null", 3, {"0q", "1q", "1v"}, LM_LORA_NOT_TARGETED, "self_attn.k_proj: target_modules"},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        char cfg[512];
        snprintf(cfg, sizeof cfg, "{\"peft_type\": \"LORA\", \"r\": 2, %s}", cases[c].config);
        lm_adapter *a = write_open(t.ad, cfg, ts, 12);
        if (!a || !t.base)
            continue;
        CHECK(a->n_modules == 6 && a->n_ignored == 0 && !a->selected);
        CHECK_OK(lm_adapter_select(a, t.base, &err), &err);
        CHECK_MSG(a->n_modules == cases[c].n_kept && a->n_ignored == 6 - cases[c].n_kept, "case %zu: %lld kept",
                  c, (long long)a->n_modules);
        for (int i = 0; i < a->n_modules && i < cases[c].n_kept; i++) {
            const char *k = cases[c].kept[i];
            const char *want = strcmp(k, "0q") == 0 ? q0 : strcmp(k, "0k") == 0 ? k0 : strcmp(k, "1q") == 0 ? q1
                               : strcmp(k, "1v") == 0 ? v1 : emb;
            CHECK_MSG(strcmp(a->modules[i].base_name, want) == 0, "case %zu: module %d is %s", c, i,
                      a->modules[i].base_name);
            int64_t idx = -1;
            CHECK(lm_adapter_lookup(a, want, &idx) == LM_TOUCH_LORA && idx == i);
        }
        for (int64_t i = 0; i < a->n_ignored; i++) {
            char *w = lm_strfmt("%s.weight", a->ignored[i].path);
            CHECK_MSG(lm_adapter_lookup(a, w, NULL) == LM_TOUCH_NONE, "case %zu: %s still changed", c, w);
            free(w);
        }
        if (a->n_ignored) {
            char msg[LM_ERR_MSG_MAX];
            lm_adapter_ignored_msg(a, 0, "merged", msg, sizeof msg);
            CHECK_MSG(a->ignored[0].why == cases[c].first_why && strstr(msg, cases[c].first_msg), "case %zu: %s",
                      c, msg);
        }
        // what is left fits the base; a second call changes nothing
        CHECK_OK(lm_adapter_validate(a, t.base, &err), &err);
        int64_t n = a->n_modules;
        CHECK_OK(lm_adapter_select(a, t.base, &err), &err);
        CHECK(a->n_modules == n);
        if (c == sizeof cases / sizeof cases[0] - 1)
            CHECK(a->config.targets == LM_LORA_TARGETS_LIST && a->config.n_target_modules == 2 &&
                  strcmp(a->config.targets_default_for, "llama") == 0);
        lm_adapter_free(a);
    }

    // Selected by the config but absent from the base: still the mismatch it was.
    lm_adapter *a = write_open(t.ad, "{\"peft_type\": \"LORA\", \"r\": 2, \"target_modules\": [\"k_proj\"]}", ts, 12);
    if (a && t.base) {
        CHECK_OK(lm_adapter_select(a, t.base, &err), &err);
        CHECK_FAILS(lm_adapter_validate(a, t.base, &err), LM_ERR_MISMATCH,
                    "changes 'model.layers.7.self_attn.k_proj.weight', which the base model", &err);
    }
    lm_adapter_free(a);

    // Without a base only the config decides: null keeps everything.
    a = write_open(t.ad, "{\"peft_type\": \"LORA\", \"r\": 2}", ts, 12);
    if (a) {
        CHECK_OK(lm_adapter_select(a, NULL, &err), &err);
        CHECK(a->n_modules == 6 && a->n_ignored == 0);
    }
    lm_adapter_free(a);

    // Errors: no layer of the base selected (with the rule that left them out), no default for
    // the model_type, a regex past its limits while matching; the modules stay as opened.
    static const struct { const char *config; bool other; const char *needle; } bad[] = {
        {"\"target_modules\": [\"xq_proj\"]", false,
         "adapter/adapter_config.json: key 'target_modules' ([\"xq_proj\"]) selects no layer of the base model "},
        {"\"target_modules\": [\"q_proj\"], \"layers_to_transform\": [5]", false,
         "key 'target_modules' ([\"q_proj\"]) selects no layer of the base model"},
        {"\"target_modules\": [\"q_proj\"], \"layers_to_transform\": [5]", false,
         " once layers_to_transform is applied"},
        {"\"target_modules\": [\"q_proj\", \"v_proj\"], \"exclude_modules\": [\"q_proj\"], "
         "\"modules_to_save\": [\"v_proj\"]",
         false, " once exclude_modules and modules_to_save are applied: PEFT refuses to load such an adapter"},
        {"\"target_modules\": \"q_proj\"", false, "key 'target_modules' ('q_proj') selects no layer"},
        {"\"target_modules\": null", true,
         "key 'target_modules' is null, and PEFT has no default target modules for model_type 'test' of the "
         "base model"},
        {"\"target_modules\": \"(.*.*)*[.]{2}\"", false,
         "key 'target_modules': regex '(.*.*)*[.]{2}' runs past its limits"},
    };
    for (size_t c = 0; c < sizeof bad / sizeof bad[0]; c++) {
        char cfg[512];
        snprintf(cfg, sizeof cfg, "{\"peft_type\": \"LORA\", \"r\": 2, %s}", bad[c].config);
        a = write_open(t.ad, cfg, ts, 12);
        if (a && t.base && obase) {
            CHECK_FAILS(lm_adapter_select(a, bad[c].other ? obase : t.base, &err), LM_ERR_FORMAT, bad[c].needle, &err);
            CHECK_MSG(a->n_modules == 6 && a->n_ignored == 0, "case %zu", c);
        }
        lm_adapter_free(a);
        a = NULL;
    }
    lm_model_free(obase);
    free(other);
    tiny_close(&t);
}

static void test_adapter_dora_bias(void)
{
    char *root = make_tmpdir();
    char *plain = subdir(root, "plain"), *biased = subdir(root, "biased"), *ad = subdir(root, "adapter");
    write_base(plain, false);
    write_base(biased, true);
    fixture_tensor ts[] = {
        fixture_t2(K(0, "self_attn.k_proj", ".lora_A.weight"), 4, 8),
        fixture_t2(K(0, "self_attn.k_proj", ".lora_B.weight"), 4, 4),
        fixture_t1(K(0, "self_attn.k_proj", ".lora_B.bias"), 4),
        fixture_t1(K(0, "self_attn.k_proj", ".lora_magnitude_vector"), 4),
        fixture_t2(K(0, "mlp.down_proj", ".lora_A.weight"), 4, 12),
        fixture_t2(K(0, "mlp.down_proj", ".lora_B.weight"), 8, 4),
        fixture_t1(K(0, "mlp.down_proj", ".lora_magnitude_vector"), 8),
    };
    // values that are not zero: a bias of zeros changes nothing and is set aside (below)
    write_text(ad, "adapter_config.json",
               "{\"peft_type\": \"LORA\", \"r\": 4, \"lora_alpha\": 8, \"use_rslora\": true, "
               "\"use_dora\": true, \"lora_bias\": true, \"target_modules\": [\"k_proj\", \"down_proj\"]}");
    fixture_write_st(ad, "adapter_model.safetensors", ts, 7, FIXTURE_PATTERN);
    lm_adapter *a = NULL;
    lm_model *bp = NULL, *bb = NULL;
    lm_err err;
    CHECK_OK(lm_model_open(&bp, plain, &err), &err);
    CHECK_OK(lm_model_open(&bb, biased, &err), &err);
    CHECK_OK(lm_adapter_open(&a, ad, &err), &err);
    if (a && bp && bb) {
        CHECK(a->n_modules == 2);
        const lm_lora_module *k = &a->modules[0], *d = &a->modules[1];
        CHECK(strcmp(k->path, "model.layers.0.self_attn.k_proj") == 0);
        CHECK(k->bias && k->bias_name && strcmp(k->bias_name, "model.layers.0.self_attn.k_proj.bias") == 0);
        CHECK(k->magnitude && k->magnitude->shape[0] == 4);
        CHECK(d->bias == NULL && d->magnitude && d->magnitude->shape[0] == 8);
        CHECK(k->scale == 4.0);  // 8 / sqrt(4)
        int64_t idx = -1;
        CHECK(lm_adapter_lookup(a, "model.layers.0.self_attn.k_proj.bias", &idx) == LM_TOUCH_BIAS && idx == 0);
        CHECK(lm_adapter_lookup(a, "model.layers.0.mlp.down_proj.weight", &idx) == LM_TOUCH_LORA && idx == 1);
        // A bias delta needs a base bias.
        CHECK_FAILS(lm_adapter_validate(a, bp, &err), LM_ERR_MISMATCH,
                    "adapter key 'base_model.model.model.layers.0.self_attn.k_proj.lora_B.bias' changes "
                    "'model.layers.0.self_attn.k_proj.bias', which the base model", &err);
        CHECK_OK(lm_adapter_validate(a, bb, &err), &err);
    }
    lm_adapter_free(a);
    // PEFT saves lora_B.bias for every LoRA layer under lora_bias, zeros where the base has no
    // bias (as llmerge writes them too): a bias of zeros (-0 included) is accepted there. It is
    // still the module's bias: on a base with the bias it is a change like any other (it counts
    // among the inputs touching the tensor, which --normalize divides by).
    fixture_tensor zb[] = {
        fixture_t2(K(0, "self_attn.k_proj", ".lora_A.weight"), 4, 8),
        fixture_t2(K(0, "self_attn.k_proj", ".lora_B.weight"), 4, 4),
        fixture_t1(K(0, "self_attn.k_proj", ".lora_B.bias"), 4),
    };
    write_text(ad, "adapter_config.json", "{\"peft_type\": \"LORA\", \"r\": 4, \"lora_bias\": true}");
    fixture_write_st(ad, "adapter_model.safetensors", zb, 3, FIXTURE_ZEROS);
    a = NULL;
    CHECK_OK(lm_adapter_open(&a, ad, &err), &err);
    if (a && bp && bb) {
        CHECK(a->n_modules == 1 && a->modules[0].bias != NULL);
        int64_t idx = -1;
        CHECK(lm_adapter_lookup(a, "model.layers.0.self_attn.k_proj.bias", &idx) == LM_TOUCH_BIAS && idx == 0);
        CHECK_OK(lm_adapter_validate(a, bp, &err), &err);
        CHECK_OK(lm_adapter_validate(a, bb, &err), &err);
    }
    lm_adapter_free(a);
    {
        // -0.0f in the last element: still zeros; 1e-45 (the smallest subnormal) is a change
        char *w = lm_path_join(ad, "adapter_model.safetensors");
        size_t len = 0;
        char *text = NULL;
        CHECK_OK(lm_read_file(w, 1 << 20, &text, &len, &err), &err);
        unsigned char *bytes = (unsigned char *)text;
        if (bytes && len >= 4) {
            bytes[len - 1] = 0x80;
            CHECK_OK(lm_write_file(w, bytes, len, &err), &err);
            a = NULL;
            CHECK_OK(lm_adapter_open(&a, ad, &err), &err);
            if (a && bp)
                CHECK_OK(lm_adapter_validate(a, bp, &err), &err);
            lm_adapter_free(a);
            bytes[len - 1] = 0;
            bytes[len - 4] = 1;
            CHECK_OK(lm_write_file(w, bytes, len, &err), &err);
            a = NULL;
            CHECK_OK(lm_adapter_open(&a, ad, &err), &err);
            if (a && bp)
                CHECK_FAILS(lm_adapter_validate(a, bp, &err), LM_ERR_MISMATCH, "which the base model", &err);
            lm_adapter_free(a);
        }
        free(bytes);
        free(w);
    }
    lm_model_free(bp);
    lm_model_free(bb);
    free(plain);
    free(biased);
    free(ad);
    remove_tmpdir(root);
}

static void test_adapter_embedding_and_saved(void)
{
    tiny t = tiny_open();
    fixture_tensor ts[] = {
        fixture_t2("base_model.model.model.embed_tokens.lora_embedding_A", 2, 16),
        fixture_t2("base_model.model.model.embed_tokens.lora_embedding_B", 8, 2),
        fixture_t2("base_model.model.lm_head.weight", 16, 8),
        fixture_t1("base_model.model.model.norm.modules_to_save.default.weight", 8),
    };
    write_adapter(t.ad,
                  "{\"peft_type\": \"LORA\", \"r\": 2, \"lora_alpha\": 2, "
                  "\"target_modules\": [\"embed_tokens\"], \"modules_to_save\": [\"lm_head\", \"norm\"]}",
                  ts, 4);
    lm_adapter *a = NULL;
    lm_err err;
    CHECK_OK(lm_adapter_open(&a, t.ad, &err), &err);
    if (a && t.base) {
        CHECK(a->n_modules == 1 && a->n_saved == 2);
        const lm_lora_module *m = &a->modules[0];
        CHECK(m->kind == LM_LORA_EMBEDDING && strcmp(m->base_name, "model.embed_tokens.weight") == 0);
        CHECK(m->a->shape[0] == 2 && m->a->shape[1] == 16 && m->scale == 1.0);
        CHECK(strcmp(a->saved[0].base_name, "lm_head.weight") == 0);
        CHECK(strcmp(a->saved[1].base_name, "model.norm.weight") == 0);
        int64_t idx = -1;
        CHECK(lm_adapter_lookup(a, "lm_head.weight", &idx) == LM_TOUCH_SAVED && idx == 0);
        CHECK(lm_adapter_lookup(a, "model.norm.weight", &idx) == LM_TOUCH_SAVED && idx == 1);
        CHECK(lm_adapter_lookup(a, "model.embed_tokens.weight", &idx) == LM_TOUCH_LORA && idx == 0);
        CHECK_OK(lm_adapter_validate(a, t.base, &err), &err);
    }
    lm_adapter_free(a);

    // Embedding factors the wrong way round against the base [vocab, hidden].
    fixture_tensor bad[] = {
        fixture_t2("base_model.model.model.embed_tokens.lora_embedding_A", 2, 8),
        fixture_t2("base_model.model.model.embed_tokens.lora_embedding_B", 16, 2),
    };
    a = write_open(t.ad, "{\"peft_type\": \"LORA\", \"r\": 2}", bad, 2);
    if (a && t.base)
        CHECK_FAILS(lm_adapter_validate(a, t.base, &err), LM_ERR_MISMATCH,
                    "adapter key 'base_model.model.model.embed_tokens.lora_embedding_A' has shape [2, 8], "
                    "but base tensor 'model.embed_tokens.weight' in", &err);
    CHECK(strstr(err.msg, "has shape [16, 8]") != NULL);
    lm_adapter_free(a);

    // A saved tensor with another shape than the base's.
    fixture_tensor saved_bad[] = {fixture_t2("base_model.model.lm_head.weight", 16, 4)};
    a = write_open(t.ad, "{\"peft_type\": \"LORA\", \"modules_to_save\": [\"lm_head\"]}", saved_bad, 1);
    if (a && t.base)
        CHECK_FAILS(lm_adapter_validate(a, t.base, &err), LM_ERR_MISMATCH,
                    "adapter key 'base_model.model.lm_head.weight' has shape [16, 4], but base tensor "
                    "'lm_head.weight'", &err);
    lm_adapter_free(a);
    tiny_close(&t);
}

static void test_adapter_fan_in_fan_out(void)
{
    tiny t = tiny_open();
    lm_adapter *a = NULL;
    lm_err err;

    // gate_proj is [12, 8]: read as [in, out] with fan_in_fan_out, so A [r, 12], B [8, r].
    fixture_tensor fifo[] = {
        fixture_t2(K(0, "mlp.gate_proj", ".lora_A.weight"), 2, 12),
        fixture_t2(K(0, "mlp.gate_proj", ".lora_B.weight"), 8, 2),
    };
    a = write_open(t.ad, "{\"peft_type\": \"LORA\", \"r\": 2, \"fan_in_fan_out\": true}", fifo, 2);
    if (a && t.base)
        CHECK_OK(lm_adapter_validate(a, t.base, &err), &err);
    lm_adapter_free(a);

    // The same factors without fan_in_fan_out do not fit; the usual ones do not fit with it.
    a = write_open(t.ad, "{\"peft_type\": \"LORA\", \"r\": 2}", fifo, 2);
    if (a && t.base)
        CHECK_FAILS(lm_adapter_validate(a, t.base, &err), LM_ERR_MISMATCH,
                    "has shape [2, 12], but base tensor 'model.layers.0.mlp.gate_proj.weight'", &err);
    lm_adapter_free(a);
    fixture_tensor normal[] = {
        fixture_t2(K(0, "mlp.gate_proj", ".lora_A.weight"), 2, 8),
        fixture_t2(K(0, "mlp.gate_proj", ".lora_B.weight"), 12, 2),
    };
    a = write_open(t.ad, "{\"peft_type\": \"LORA\", \"r\": 2, \"fan_in_fan_out\": true}", normal, 2);
    if (a && t.base)
        CHECK_FAILS(lm_adapter_validate(a, t.base, &err), LM_ERR_MISMATCH, "fan_in_fan_out", &err);
    lm_adapter_free(a);
    tiny_close(&t);
}

static void test_adapter_validate_errors(void)
{
    tiny t = tiny_open();
    lm_adapter *a = NULL;
    lm_err err;
    const char *cfg = "{\"peft_type\": \"LORA\", \"r\": 2}";

    // A's in-dimension: the adapter key, the base tensor and both shapes.
    fixture_tensor a_in[] = {
        fixture_t2(K(0, "self_attn.q_proj", ".lora_A.weight"), 2, 7),
        fixture_t2(K(0, "self_attn.q_proj", ".lora_B.weight"), 8, 2),
    };
    a = write_open(t.ad, cfg, a_in, 2);
    if (a && t.base) {
        CHECK_FAILS(lm_adapter_validate(a, t.base, &err), LM_ERR_MISMATCH,
                    "adapter key 'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight' has "
                    "shape [2, 7], but base tensor 'model.layers.0.self_attn.q_proj.weight' in", &err);
        CHECK(strstr(err.msg, "has shape [8, 8]") && strstr(err.msg, "needs lora_A [2, 8]"));
    }
    lm_adapter_free(a);

    // B's out-dimension (k_proj is [4, 8] with one kv head).
    fixture_tensor b_out[] = {
        fixture_t2(K(1, "self_attn.k_proj", ".lora_A.weight"), 2, 8),
        fixture_t2(K(1, "self_attn.k_proj", ".lora_B.weight"), 8, 2),
    };
    a = write_open(t.ad, cfg, b_out, 2);
    if (a && t.base) {
        CHECK_FAILS(lm_adapter_validate(a, t.base, &err), LM_ERR_MISMATCH,
                    "adapter key 'base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight' has "
                    "shape [8, 2], but base tensor 'model.layers.1.self_attn.k_proj.weight'", &err);
        CHECK(strstr(err.msg, "has shape [4, 8]") != NULL);
    }
    lm_adapter_free(a);

    // A module the base does not have.
    fixture_tensor absent[] = {
        fixture_t2(K(7, "self_attn.q_proj", ".lora_A.weight"), 2, 8),
        fixture_t2(K(7, "self_attn.q_proj", ".lora_B.weight"), 8, 2),
    };
    a = write_open(t.ad, cfg, absent, 2);
    if (a && t.base)
        CHECK_FAILS(lm_adapter_validate(a, t.base, &err), LM_ERR_MISMATCH,
                    "changes 'model.layers.7.self_attn.q_proj.weight', which the base model", &err);
    lm_adapter_free(a);

    // Factors in a dtype llmerge does not compute with.
    fixture_tensor i8[] = {
        fixture_t2(K(0, "self_attn.q_proj", ".lora_A.weight"), 2, 8),
        fixture_t2(K(0, "self_attn.q_proj", ".lora_B.weight"), 8, 2),
    };
    i8[1].dtype = "I8";
    a = write_open(t.ad, cfg, i8, 2);
    if (a && t.base)
        CHECK_FAILS(lm_adapter_validate(a, t.base, &err), LM_ERR_UNSUPPORTED,
                    "q_proj.lora_B.weight' has dtype I8", &err);
    lm_adapter_free(a);
    tiny_close(&t);
}

// A LoRA, a bias delta or a saved tensor on a base tensor in a dtype llmerge does not compute
// with is refused, naming the key, the tensor and its dtype: it would be copied and the change
// lost. The adapter's other modules are not concerned.
static void test_adapter_base_dtype(void)
{
    char *root = make_tmpdir();
    char *u8 = subdir(root, "u8"), *i32 = subdir(root, "i32"), *head = subdir(root, "head"),
         *ad = subdir(root, "adapter");
    write_base_odd(u8, false, "model.layers.0.self_attn.q_proj.weight", "U8");
    write_base_odd(i32, true, "model.layers.0.self_attn.k_proj.bias", "I32");
    write_base_odd(head, false, "lm_head.weight", "I32");
    lm_model *bu8 = NULL, *bi32 = NULL, *bhead = NULL;
    lm_adapter *a = NULL;
    lm_err err;
    CHECK_OK(lm_model_open(&bu8, u8, &err), &err);
    CHECK_OK(lm_model_open(&bi32, i32, &err), &err);
    CHECK_OK(lm_model_open(&bhead, head, &err), &err);

    fixture_tensor q[] = {
        fixture_t2(K(0, "self_attn.q_proj", ".lora_A.weight"), 2, 8),
        fixture_t2(K(0, "self_attn.q_proj", ".lora_B.weight"), 8, 2),
    };
    a = write_open(ad, "{\"peft_type\": \"LORA\", \"r\": 2}", q, 2);
    if (a && bu8) {
        CHECK_FAILS(lm_adapter_validate(a, bu8, &err), LM_ERR_UNSUPPORTED,
                    "adapter key 'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight' changes "
                    "'model.layers.0.self_attn.q_proj.weight', which is U8 in the base", &err);
        CHECK(strstr(err.msg, "adapter_model.safetensors") != NULL);
    }
    lm_adapter_free(a);
    // the same adapter on layer 1: the U8 tensor is no concern of it
    fixture_tensor q1[] = {
        fixture_t2(K(1, "self_attn.q_proj", ".lora_A.weight"), 2, 8),
        fixture_t2(K(1, "self_attn.q_proj", ".lora_B.weight"), 8, 2),
    };
    a = write_open(ad, "{\"peft_type\": \"LORA\", \"r\": 2}", q1, 2);
    if (a && bu8)
        CHECK_OK(lm_adapter_validate(a, bu8, &err), &err);
    lm_adapter_free(a);

    fixture_tensor kb[] = {
        fixture_t2(K(0, "self_attn.k_proj", ".lora_A.weight"), 2, 8),
        fixture_t2(K(0, "self_attn.k_proj", ".lora_B.weight"), 4, 2),
        fixture_t1(K(0, "self_attn.k_proj", ".lora_B.bias"), 4),
    };
    write_text(ad, "adapter_config.json", "{\"peft_type\": \"LORA\", \"r\": 2, \"lora_bias\": true}");
    fixture_write_st(ad, "adapter_model.safetensors", kb, 3, FIXTURE_PATTERN);  // a bias that is not zeros
    a = NULL;
    CHECK_OK(lm_adapter_open(&a, ad, &err), &err);
    if (a && bi32)
        CHECK_FAILS(lm_adapter_validate(a, bi32, &err), LM_ERR_UNSUPPORTED,
                    "k_proj.lora_B.bias' changes 'model.layers.0.self_attn.k_proj.bias', which is I32", &err);
    lm_adapter_free(a);

    fixture_tensor saved[] = {fixture_t2("base_model.model.lm_head.weight", 16, 8)};
    a = write_open(ad, "{\"peft_type\": \"LORA\", \"modules_to_save\": [\"lm_head\"]}", saved, 1);
    if (a && bhead)
        CHECK_FAILS(lm_adapter_validate(a, bhead, &err), LM_ERR_UNSUPPORTED,
                    "'base_model.model.lm_head.weight' changes 'lm_head.weight', which is I32", &err);
    lm_adapter_free(a);
    lm_model_free(bu8);
    lm_model_free(bi32);
    lm_model_free(bhead);
    free(u8);
    free(i32);
    free(head);
    free(ad);
    remove_tmpdir(root);
}

static void test_adapter_open_errors(void)
{
    char *ad = make_tmpdir();
    lm_adapter *a = NULL;
    lm_err err;
    const char *cfg = "{\"peft_type\": \"LORA\", \"r\": 2}";
    const char *q = "self_attn.q_proj";

    fixture_tensor only_a[] = {fixture_t2(K(0, q, ".lora_A.weight"), 2, 8)};
    write_adapter(ad, cfg, only_a, 1);
    CHECK_FAILS(lm_adapter_open(&a, ad, &err), LM_ERR_FORMAT,
                "key 'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight' has no matching "
                "'base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight'", &err);
    CHECK(a == NULL);

    fixture_tensor only_b[] = {fixture_t2(K(0, q, ".lora_B.weight"), 8, 2)};
    write_adapter(ad, cfg, only_b, 1);
    CHECK_FAILS(lm_adapter_open(&a, ad, &err), LM_ERR_FORMAT,
                "q_proj.lora_B.weight' has no matching 'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight'",
                &err);

    fixture_tensor unknown[] = {fixture_t2(K(0, q, ".lora_A.weight"), 2, 8), fixture_t2(K(0, q, ".lora_B.weight"), 8, 2),
                    fixture_t1(K(0, q, ".lora_A.bias"), 2)};
    write_adapter(ad, cfg, unknown, 3);
    CHECK_FAILS(lm_adapter_open(&a, ad, &err), LM_ERR_FORMAT,
                "key 'base_model.model.model.layers.0.self_attn.q_proj.lora_A.bias': unknown LoRA key", &err);
    unknown[2] = fixture_t1(K(0, q, ".weird"), 2);
    write_adapter(ad, cfg, unknown, 3);
    CHECK_FAILS(lm_adapter_open(&a, ad, &err), LM_ERR_FORMAT, "q_proj.weird': unknown key", &err);

    fixture_tensor no_prefix[] = {fixture_t2("model.layers.0.self_attn.q_proj.lora_A.weight", 2, 8)};
    write_adapter(ad, cfg, no_prefix, 1);
    CHECK_FAILS(lm_adapter_open(&a, ad, &err), LM_ERR_FORMAT,
                "key 'model.layers.0.self_attn.q_proj.lora_A.weight' does not start with 'base_model.model.'", &err);

    // Factor shapes against r (from r, then from a rank_pattern key).
    fixture_tensor r3[] = {fixture_t2(K(0, q, ".lora_A.weight"), 3, 8), fixture_t2(K(0, q, ".lora_B.weight"), 8, 3)};
    write_adapter(ad, cfg, r3, 2);
    CHECK_FAILS(lm_adapter_open(&a, ad, &err), LM_ERR_FORMAT,
                "key 'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight' has shape [3, 8], but r = 2", &err);
    write_adapter(ad, "{\"peft_type\": \"LORA\", \"r\": 3, \"rank_pattern\": {\"q_proj\": 4}}", r3, 2);
    CHECK_FAILS(lm_adapter_open(&a, ad, &err), LM_ERR_FORMAT, "r = 4 (rank_pattern key 'q_proj')", &err);
    fixture_tensor rb[] = {fixture_t2(K(0, q, ".lora_A.weight"), 2, 8), fixture_t2(K(0, q, ".lora_B.weight"), 8, 3)};
    write_adapter(ad, cfg, rb, 2);
    CHECK_FAILS(lm_adapter_open(&a, ad, &err), LM_ERR_FORMAT, "q_proj.lora_B.weight' has shape [8, 3], but r = 2", &err);

    // DoRA and bias keys must agree with the config and with B.
    fixture_tensor mag[] = {fixture_t2(K(0, q, ".lora_A.weight"), 2, 8), fixture_t2(K(0, q, ".lora_B.weight"), 8, 2),
                fixture_t1(K(0, q, ".lora_magnitude_vector"), 8)};
    write_adapter(ad, cfg, mag, 3);
    CHECK_FAILS(lm_adapter_open(&a, ad, &err), LM_ERR_FORMAT,
                "q_proj.lora_magnitude_vector' is a DoRA magnitude, but use_dora is not true", &err);
    write_adapter(ad, "{\"peft_type\": \"LORA\", \"r\": 2, \"use_dora\": true}", mag, 2);
    CHECK_FAILS(lm_adapter_open(&a, ad, &err), LM_ERR_FORMAT,
                "use_dora is true in", &err);
    CHECK(strstr(err.msg, "'base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector' is missing"));
    mag[2] = fixture_t1(K(0, q, ".lora_magnitude_vector"), 4);
    write_adapter(ad, "{\"peft_type\": \"LORA\", \"r\": 2, \"use_dora\": true}", mag, 3);
    CHECK_FAILS(lm_adapter_open(&a, ad, &err), LM_ERR_FORMAT,
                "q_proj.lora_magnitude_vector' has shape [4], but", &err);
    fixture_tensor bias[] = {fixture_t2(K(0, q, ".lora_A.weight"), 2, 8), fixture_t2(K(0, q, ".lora_B.weight"), 8, 2),
                 fixture_t1(K(0, q, ".lora_B.bias"), 8)};
    write_adapter(ad, cfg, bias, 3);
    CHECK_FAILS(lm_adapter_open(&a, ad, &err), LM_ERR_FORMAT,
                "q_proj.lora_B.bias' is a LoRA bias, but lora_bias is not true", &err);
    fixture_tensor only_bias[] = {fixture_t1(K(0, q, ".lora_B.bias"), 8)};
    write_adapter(ad, "{\"peft_type\": \"LORA\", \"r\": 2, \"lora_bias\": true}", only_bias, 1);
    CHECK_FAILS(lm_adapter_open(&a, ad, &err), LM_ERR_FORMAT, "q_proj.lora_B.bias' has no matching", &err);

    // Linear and embedding factors of one module.
    fixture_tensor mixed[] = {fixture_t2(K(0, q, ".lora_A.weight"), 2, 8), fixture_t2(K(0, q, ".lora_embedding_B"), 8, 2)};
    write_adapter(ad, cfg, mixed, 2);
    CHECK_FAILS(lm_adapter_open(&a, ad, &err), LM_ERR_FORMAT, "mixes linear and embedding", &err);

    // Full tensors need modules_to_save; one tensor saved two ways is changed twice.
    fixture_tensor full[] = {fixture_t2("base_model.model.lm_head.weight", 16, 8)};
    write_adapter(ad, cfg, full, 1);
    CHECK_FAILS(lm_adapter_open(&a, ad, &err), LM_ERR_FORMAT,
                "key 'base_model.model.lm_head.weight' is a full tensor, but its module is not in modules_to_save", &err);
    fixture_tensor twice[] = {fixture_t2("base_model.model.lm_head.weight", 16, 8),
                  fixture_t2("base_model.model.lm_head.modules_to_save.default.weight", 16, 8)};
    write_adapter(ad, "{\"peft_type\": \"LORA\", \"modules_to_save\": [\"lm_head\"]}", twice, 2);
    CHECK_FAILS(lm_adapter_open(&a, ad, &err), LM_ERR_FORMAT, "base tensor 'lm_head.weight' is changed by two keys", &err);
    fixture_tensor tokens[] = {fixture_t2("base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta", 2, 8)};
    write_adapter(ad, cfg, tokens, 1);
    CHECK_FAILS(lm_adapter_open(&a, ad, &err), LM_ERR_UNSUPPORTED, "trainable tokens", &err);

    // peft_type, adapter_model.bin, missing files.
    write_adapter(ad, "{\"peft_type\": \"PREFIX_TUNING\"}", only_a, 1);
    CHECK_FAILS(lm_adapter_open(&a, ad, &err), LM_ERR_UNSUPPORTED, "peft_type 'PREFIX_TUNING'", &err);
    write_text(ad, "adapter_config.json", cfg);
    remove_file(ad, "adapter_model.safetensors");
    write_text(ad, "adapter_model.bin", "PK\x03\x04");
    CHECK_FAILS(lm_adapter_open(&a, ad, &err), LM_ERR_UNSUPPORTED, "adapter_model.bin", &err);
    CHECK(strstr(err.msg, "convert it to adapter_model.safetensors") != NULL);
    remove_file(ad, "adapter_model.bin");
    CHECK_FAILS(lm_adapter_open(&a, ad, &err), LM_ERR_NOT_FOUND, "no adapter_model.safetensors", &err);
    remove_file(ad, "adapter_config.json");
    CHECK_FAILS(lm_adapter_open(&a, ad, &err), LM_ERR_NOT_FOUND, "no adapter_config.json", &err);
    CHECK(a == NULL);
    remove_tmpdir(ad);
}

// ==== input detection =========================================================================

static void test_input_detect(void)
{
    char *root = make_tmpdir();
    lm_input_kind kind = 0;
    char *res = NULL;
    lm_err err;

    char *model = subdir(root, "model");
    write_base(model, false);
    CHECK_OK(lm_input_detect(model, &kind, &res, &err), &err);
    CHECK(kind == LM_INPUT_MODEL && res && strcmp(res, model) == 0);
    free(res);

    char *st = lm_path_join(model, "model.safetensors");
    CHECK_OK(lm_input_detect(st, &kind, &res, &err), &err);
    CHECK(kind == LM_INPUT_SAFETENSORS && strcmp(res, st) == 0);
    free(res);
    free(st);

    // A model's own description file stands for the model directory.
    char *mc = lm_path_join(model, "config.json");
    CHECK_OK(lm_input_detect(mc, &kind, &res, &err), &err);
    CHECK(kind == LM_INPUT_MODEL && res && strcmp(res, model) == 0);
    free(res);
    free(mc);

    char *ad = subdir(root, "adapter");
    fixture_tensor ts[] = {fixture_t2(K(0, "self_attn.q_proj", ".lora_A.weight"), 2, 8),
               fixture_t2(K(0, "self_attn.q_proj", ".lora_B.weight"), 8, 2)};
    write_adapter(ad, "{\"peft_type\": \"LORA\", \"r\": 2}", ts, 2);
    write_text(ad, "config.json", "{}");  // some trainers save the base config too
    CHECK_OK(lm_input_detect(ad, &kind, &res, &err), &err);
    CHECK(kind == LM_INPUT_ADAPTER && strcmp(res, ad) == 0);
    free(res);
    char *ac = lm_path_join(ad, "adapter_config.json");
    CHECK_OK(lm_input_detect(ac, &kind, &res, &err), &err);
    CHECK(kind == LM_INPUT_ADAPTER && res && strcmp(res, ad) == 0);
    free(res);
    free(ac);

    // Nested: a directory whose one subdirectory is the model (files beside it do not count).
    char *outer = subdir(root, "download");
    char *inner = subdir(outer, "snapshot");
    write_base(inner, false);
    write_text(outer, "README.md", "hello");
    CHECK_OK(lm_input_detect(outer, &kind, &res, &err), &err);
    CHECK(kind == LM_INPUT_MODEL && res && strcmp(res, inner) == 0);
    free(res);
    char *outer2 = subdir(root, "download2");
    char *inner2 = subdir(outer2, "lora");
    write_adapter(inner2, "{\"peft_type\": \"LORA\", \"r\": 2}", ts, 2);
    CHECK_OK(lm_input_detect(outer2, &kind, &res, &err), &err);
    CHECK(kind == LM_INPUT_ADAPTER && res && strcmp(res, inner2) == 0);
    free(res);
    // Only one level, and only exactly one subdirectory.
    char *other = subdir(outer, "other");
    CHECK_FAILS(lm_input_detect(outer, &kind, &res, &err), LM_ERR_NOT_FOUND,
                "not a model or adapter directory; expected", &err);
    CHECK(res == NULL);
    CHECK_FAILS(lm_input_detect(root, &kind, &res, &err), LM_ERR_NOT_FOUND, "expected a .safetensors file", &err);
    CHECK(strstr(err.msg, "adapter_config.json") != NULL);

    // Empty, config only, a file of another kind, nothing at all.
    char *empty = subdir(root, "empty");
    CHECK_FAILS(lm_input_detect(empty, &kind, &res, &err), LM_ERR_NOT_FOUND, "model directory (config.json", &err);
    write_text(empty, "config.json", "{}");
    CHECK_FAILS(lm_input_detect(empty, &kind, &res, &err), LM_ERR_NOT_FOUND,
                "has config.json but no model.safetensors", &err);
    write_text(empty, "notes.txt", "x");
    char *txt = lm_path_join(empty, "notes.txt");
    CHECK_FAILS(lm_input_detect(txt, &kind, &res, &err), LM_ERR_FORMAT, "not a .safetensors file", &err);
    free(txt);
    write_text(empty, "weights.bin", "x");
    char *bin = lm_path_join(empty, "weights.bin");
    CHECK_FAILS(lm_input_detect(bin, &kind, &res, &err), LM_ERR_UNSUPPORTED, "convert", &err);
    free(bin);
    char *none = lm_path_join(root, "none");
    CHECK_FAILS(lm_input_detect(none, &kind, &res, &err), LM_ERR_NOT_FOUND, "no such file or directory", &err);
    free(none);
    CHECK(strcmp(lm_input_kind_name(LM_INPUT_ADAPTER), "adapter directory") == 0);

    free(model);
    free(ad);
    free(outer);
    free(inner);
    free(outer2);
    free(inner2);
    free(other);
    free(empty);
    remove_tmpdir(root);
}

int main(void)
{
    test_config_fields();
    test_config_patterns();
    test_config_regex_limits();
    test_config_targets();
    test_config_errors();
    test_adapter_linear();
    test_adapter_select();
    test_adapter_dora_bias();
    test_adapter_embedding_and_saved();
    test_adapter_fan_in_fan_out();
    test_adapter_validate_errors();
    test_adapter_base_dtype();
    test_adapter_open_errors();
    test_input_detect();
    return check_report("test_adapter");
}
