// Tests of PEFT LoRA adapters (lib/adapter.c): adapter_config.json fields and errors, the scale
// rules (alpha / r, alpha / sqrt(r) with rslora), rank_pattern / alpha_pattern taking the first
// key in file order whose `(.*\.)?(K)$` matches (a suffix such as "v_proj" matches, "proj" does
// not match "...v_proj" because "v_" is not followed by a dot), target_modules as a list, a
// full-match regex or "all-linear"; grouping of keys into linear, DoRA, bias and embedding
// modules and modules_to_save tensors; every open and validation error naming the key (and,
// against a base, the base tensor and both shapes); adapter_model.bin; and what lm_input_detect
// says about files, model and adapter directories, and the nested layout. Each test writes its
// own files into a fresh directory under /tmp with a small safetensors writer of its own.
#include <stdint.h>
#include <sys/stat.h>
#include <unistd.h>

#include "adapter.h"
#include "check.h"
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

typedef struct tt {
    char name[112];
    const char *dtype;
    int ndim;
    int64_t shape[4];
} tt;

static size_t dtype_size(const char *dt)
{
    if (strcmp(dt, "F32") == 0) return 4;
    if (strcmp(dt, "F64") == 0) return 8;
    if (strcmp(dt, "I32") == 0) return 4;
    if (strcmp(dt, "I8") == 0 || strcmp(dt, "U8") == 0) return 1;
    return 2;
}

// Writes a safetensors file holding `ts` with their data in the given order.
static void write_st(const char *dir, const char *file, const tt *ts, int n)
{
    size_t cap = 256 + (size_t)n * 220, hl = 0;
    char *hdr = malloc(cap);
    hl += (size_t)snprintf(hdr + hl, cap - hl, "{\"__metadata__\":{\"format\":\"pt\"}");
    uint64_t off = 0;
    for (int i = 0; i < n; i++) {
        int64_t numel = 1;
        hl += (size_t)snprintf(hdr + hl, cap - hl, ",\"%s\":{\"dtype\":\"%s\",\"shape\":[", ts[i].name,
                               ts[i].dtype);
        for (int d = 0; d < ts[i].ndim; d++) {
            numel *= ts[i].shape[d];
            hl += (size_t)snprintf(hdr + hl, cap - hl, d ? ",%lld" : "%lld", (long long)ts[i].shape[d]);
        }
        uint64_t nb = (uint64_t)numel * dtype_size(ts[i].dtype);
        hl += (size_t)snprintf(hdr + hl, cap - hl, "],\"data_offsets\":[%llu,%llu]}",
                               (unsigned long long)off, (unsigned long long)(off + nb));
        off += nb;
    }
    hl += (size_t)snprintf(hdr + hl, cap - hl, "}");
    while (hl % 8)
        hdr[hl++] = ' ';
    size_t total = 8 + hl + off;
    unsigned char *buf = calloc(1, total);
    for (int b = 0; b < 8; b++)
        buf[b] = (unsigned char)((uint64_t)hl >> (8 * b));
    memcpy(buf + 8, hdr, hl);
    char *p = lm_path_join(dir, file);
    lm_err err;
    CHECK_OK(lm_write_file(p, buf, total, &err), &err);
    free(p);
    free(buf);
    free(hdr);
}

static tt T2(const char *name, int64_t a, int64_t b)
{
    tt t = {.dtype = "F32", .ndim = 2, .shape = {a, b}};
    snprintf(t.name, sizeof t.name, "%s", name);
    return t;
}

static tt T1(const char *name, int64_t a)
{
    tt t = {.dtype = "F32", .ndim = 1, .shape = {a}};
    snprintf(t.name, sizeof t.name, "%s", name);
    return t;
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

// The tiny Llama base of test_model.c: 2 layers, hidden 8, intermediate 12, 2 heads of 4,
// 1 kv head, vocab 16; with `bias`, attention_bias (q, k, v, o biases). Tensor `odd` (may be
// NULL) is written in dtype `odd_dt` instead of F32.
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
    tt ts[64];
    int n = 0;
    char name[112];
    ts[n++] = T2("model.embed_tokens.weight", 16, 8);
    for (int l = 0; l < 2; l++) {
        static const struct { const char *m; int64_t o, i; } lin[] = {
            {"self_attn.q_proj", 8, 8}, {"self_attn.k_proj", 4, 8}, {"self_attn.v_proj", 4, 8},
            {"self_attn.o_proj", 8, 8}, {"mlp.gate_proj", 12, 8}, {"mlp.up_proj", 12, 8},
            {"mlp.down_proj", 8, 12},
        };
        for (int k = 0; k < 7; k++) {
            snprintf(name, sizeof name, "model.layers.%d.%s.weight", l, lin[k].m);
            ts[n++] = T2(name, lin[k].o, lin[k].i);
            if (bias && k < 4) {
                snprintf(name, sizeof name, "model.layers.%d.%s.bias", l, lin[k].m);
                ts[n++] = T1(name, lin[k].o);
            }
        }
        snprintf(name, sizeof name, "model.layers.%d.input_layernorm.weight", l);
        ts[n++] = T1(name, 8);
        snprintf(name, sizeof name, "model.layers.%d.post_attention_layernorm.weight", l);
        ts[n++] = T1(name, 8);
    }
    ts[n++] = T1("model.norm.weight", 8);
    ts[n++] = T2("lm_head.weight", 16, 8);
    for (int i = 0; odd && i < n; i++)
        if (strcmp(ts[i].name, odd) == 0)
            ts[i].dtype = odd_dt;
    write_st(dir, "model.safetensors", ts, n);
}

static void write_adapter(const char *dir, const char *config, const tt *ts, int n)
{
    write_text(dir, "adapter_config.json", config);
    write_st(dir, "adapter_model.safetensors", ts, n);
}

static lm_status parse(lm_lora_config *c, const char *json, lm_err *err)
{
    return lm_lora_config_parse(c, json, strlen(json), "test/adapter_config.json", err);
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
    lm_lora_config_rank(&c, v0, &r, &alpha, &rk, &ak);
    CHECK(r == 4 && alpha == 16 && rk && strcmp(rk, "v_proj") == 0 && ak == NULL);
    lm_lora_config_rank(&c, "model.layers.0.self_attn.q_proj", &r, &alpha, &rk, &ak);
    CHECK(r == 8 && alpha == 32 && rk == NULL && ak && strcmp(ak, "q_proj") == 0);
    CHECK(lm_lora_config_scale(&c, 8, 32) == 4.0);
    lm_lora_config_free(&c);

    // The other order: the full path now comes first for layer 0.
    CHECK_OK(parse(&c,
                   "{\"peft_type\": \"LORA\", \"r\": 8, "
                   "\"rank_pattern\": {\"model.layers.0.self_attn.v_proj\": 2, \"v_proj\": 4}}", &err), &err);
    lm_lora_config_rank(&c, v0, &r, &alpha, NULL, NULL);
    CHECK(r == 2);
    lm_lora_config_rank(&c, v1, &r, &alpha, NULL, NULL);
    CHECK(r == 4);
    lm_lora_config_free(&c);

    // "proj" must not match "...v_proj": "(.*\.)?(proj)$" needs a dot right before "proj".
    // "self_attn.v_proj" matches as a dotted suffix; "_proj" and "layers.0" do not.
    CHECK_OK(parse(&c,
                   "{\"peft_type\": \"LORA\", \"r\": 8, "
                   "\"rank_pattern\": {\"proj\": 1, \"_proj\": 2, \"layers.0\": 3, \"self_attn.v_proj\": 5}}",
                   &err), &err);
    lm_lora_config_rank(&c, v0, &r, &alpha, &rk, NULL);
    CHECK_MSG(r == 5 && rk && strcmp(rk, "self_attn.v_proj") == 0, "r = %lld", (long long)r);
    lm_lora_config_rank(&c, "model.layers.0.mlp.down_proj", &r, &alpha, &rk, NULL);
    CHECK(r == 8 && rk == NULL);
    lm_lora_config_rank(&c, "proj", &r, &alpha, &rk, NULL);  // the whole path may be the key
    CHECK(r == 1);
    lm_lora_config_free(&c);

    // Keys are Python regexes: \d, alternation, (?:...), lazy quantifiers, {m,n}.
    CHECK_OK(parse(&c,
                   "{\"peft_type\": \"LORA\", \"r\": 8, \"rank_pattern\": {"
                   "\"layers\\\\.[1-3]\\\\.mlp\\\\..*\": 3, "
                   "\"(?:q|k)_proj\": 6, "
                   "\"layers\\\\.\\\\d{2,}\\\\..*?\": 7, "
                   "\"gate_proj|up_proj\": 9}}", &err), &err);
    lm_lora_config_rank(&c, "model.layers.2.mlp.up_proj", &r, &alpha, NULL, NULL);
    CHECK(r == 3);
    lm_lora_config_rank(&c, "model.layers.0.mlp.up_proj", &r, &alpha, NULL, NULL);
    CHECK(r == 9);
    lm_lora_config_rank(&c, "model.layers.0.self_attn.k_proj", &r, &alpha, NULL, NULL);
    CHECK(r == 6);
    lm_lora_config_rank(&c, "model.layers.0.self_attn.v_proj", &r, &alpha, NULL, NULL);
    CHECK(r == 8);
    lm_lora_config_rank(&c, "model.layers.12.self_attn.v_proj", &r, &alpha, NULL, NULL);
    CHECK(r == 7);
    lm_lora_config_free(&c);

    // Python constructs with no POSIX equivalent are refused, naming the key.
    CHECK_FAILS(parse(&c, "{\"peft_type\": \"LORA\", \"rank_pattern\": {\"(?!q)_proj\": 2}}", &err),
                LM_ERR_UNSUPPORTED, "rank_pattern key regex '(?!q)_proj'", &err);
    CHECK_FAILS(parse(&c, "{\"peft_type\": \"LORA\", \"alpha_pattern\": {\"\\\\bq\": 2}}", &err),
                LM_ERR_UNSUPPORTED, "alpha_pattern key regex", &err);
    CHECK_FAILS(parse(&c, "{\"peft_type\": \"LORA\", \"rank_pattern\": {\"q[_proj\": 2}}", &err),
                LM_ERR_UNSUPPORTED, "'q[_proj'", &err);
    CHECK_FAILS(parse(&c, "{\"peft_type\": \"LORA\", \"rank_pattern\": {\"q(_proj\": 2}}", &err),
                LM_ERR_FORMAT, "rank_pattern key regex 'q(_proj' is not valid", &err);
    CHECK_FAILS(parse(&c, "{\"peft_type\": \"LORA\", \"rank_pattern\": {\"q_proj\": 0}}", &err),
                LM_ERR_FORMAT, "rank_pattern['q_proj'] must be a positive integer, not 0", &err);
    CHECK_FAILS(parse(&c, "{\"peft_type\": \"LORA\", \"rank_pattern\": {\"q_proj\": \"4\"}}", &err),
                LM_ERR_FORMAT, "rank_pattern['q_proj'] must be a positive integer, not a string", &err);
    CHECK_FAILS(parse(&c, "{\"peft_type\": \"LORA\", \"alpha_pattern\": [1]}", &err),
                LM_ERR_FORMAT, "key 'alpha_pattern' must be an object", &err);
}

static void test_config_targets(void)
{
    lm_lora_config c;
    lm_err err;
    const char *q0 = "model.layers.0.self_attn.q_proj", *k0 = "model.layers.0.self_attn.k_proj";
    const char *q1 = "model.layers.1.self_attn.q_proj";

    CHECK_OK(parse(&c, "{\"peft_type\": \"LORA\", \"target_modules\": [\"q_proj\", \"v_proj\"]}", &err), &err);
    CHECK(lm_lora_config_targets(&c, q0) && !lm_lora_config_targets(&c, k0));
    CHECK(lm_lora_config_targets(&c, "q_proj"));
    CHECK(!lm_lora_config_targets(&c, "model.layers.0.self_attn.xq_proj"));
    lm_lora_config_free(&c);

    // A regex string is a full match: "q_proj" alone does not select the full path.
    CHECK_OK(parse(&c, "{\"peft_type\": \"LORA\", \"target_modules\": \".*\\\\.(q|v)_proj\"}", &err), &err);
    CHECK(c.targets == LM_LORA_TARGETS_REGEX && strcmp(c.target_regex, ".*\\.(q|v)_proj") == 0);
    CHECK(lm_lora_config_targets(&c, q0) && !lm_lora_config_targets(&c, k0));
    lm_lora_config_free(&c);
    CHECK_OK(parse(&c, "{\"peft_type\": \"LORA\", \"target_modules\": \"q_proj\"}", &err), &err);
    CHECK(!lm_lora_config_targets(&c, q0) && lm_lora_config_targets(&c, "q_proj"));
    lm_lora_config_free(&c);

    CHECK_OK(parse(&c, "{\"peft_type\": \"LORA\", \"target_modules\": \"all-linear\"}", &err), &err);
    CHECK(c.targets == LM_LORA_TARGETS_ALL_LINEAR);
    CHECK(lm_lora_config_targets(&c, q0) && !lm_lora_config_targets(&c, "lm_head"));
    lm_lora_config_free(&c);

    // layers_to_transform narrows a list to the named layers.
    CHECK_OK(parse(&c, "{\"peft_type\": \"LORA\", \"target_modules\": [\"q_proj\"], "
                       "\"layers_to_transform\": [1]}", &err), &err);
    CHECK(!lm_lora_config_targets(&c, q0) && lm_lora_config_targets(&c, q1));
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
        {"{\"peft_type\": \"LORA\", \"target_modules\": \"(?<=x)q\"}", LM_ERR_UNSUPPORTED, "target_modules regex"},
        {"[]", LM_ERR_FORMAT, "expected a JSON object"},
        {"{", LM_ERR_FORMAT, "not valid JSON"},
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
    char *root = make_tmpdir();
    char *base_dir = subdir(root, "base"), *ad = subdir(root, "adapter");
    write_base(base_dir, false);
    tt ts[] = {
        T2(K(0, "self_attn.q_proj", ".lora_A.weight"), 2, 8),
        T2(K(0, "self_attn.q_proj", ".lora_B.weight"), 8, 2),
        T2(K(0, "self_attn.v_proj", ".lora_A.weight"), 4, 8),
        T2(K(0, "self_attn.v_proj", ".lora_B.weight"), 4, 4),
        T2(K(1, "self_attn.q_proj", ".lora_B.weight"), 8, 2),  // B before A is fine
        T2(K(1, "self_attn.q_proj", ".lora_A.weight"), 2, 8),
        T2(K(1, "self_attn.v_proj", ".lora_A.weight"), 4, 8),
        T2(K(1, "self_attn.v_proj", ".lora_B.weight"), 4, 4),
    };
    write_adapter(ad,
                  "{\"peft_type\": \"LORA\", \"r\": 2, \"lora_alpha\": 4, "
                  "\"target_modules\": [\"q_proj\", \"v_proj\"], \"rank_pattern\": {\"v_proj\": 4}, "
                  "\"alpha_pattern\": {\"model.layers.1.self_attn.q_proj\": 8}}",
                  ts, 8);
    lm_adapter *a = NULL;
    lm_model *base = NULL;
    lm_err err;
    CHECK_OK(lm_model_open(&base, base_dir, &err), &err);
    CHECK_OK(lm_adapter_open(&a, ad, &err), &err);
    if (a && base) {
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
        CHECK_OK(lm_adapter_validate(a, base, &err), &err);
    }
    lm_adapter_free(a);
    lm_adapter_free(NULL);
    lm_model_free(base);
    free(base_dir);
    free(ad);
    remove_tmpdir(root);
}

static void test_adapter_dora_bias(void)
{
    char *root = make_tmpdir();
    char *plain = subdir(root, "plain"), *biased = subdir(root, "biased"), *ad = subdir(root, "adapter");
    write_base(plain, false);
    write_base(biased, true);
    tt ts[] = {
        T2(K(0, "self_attn.k_proj", ".lora_A.weight"), 4, 8),
        T2(K(0, "self_attn.k_proj", ".lora_B.weight"), 4, 4),
        T1(K(0, "self_attn.k_proj", ".lora_B.bias"), 4),
        T1(K(0, "self_attn.k_proj", ".lora_magnitude_vector"), 4),
        T2(K(0, "mlp.down_proj", ".lora_A.weight"), 4, 12),
        T2(K(0, "mlp.down_proj", ".lora_B.weight"), 8, 4),
        T1(K(0, "mlp.down_proj", ".lora_magnitude_vector"), 8),
    };
    write_adapter(ad,
                  "{\"peft_type\": \"LORA\", \"r\": 4, \"lora_alpha\": 8, \"use_rslora\": true, "
                  "\"use_dora\": true, \"lora_bias\": true, \"target_modules\": [\"k_proj\", \"down_proj\"]}",
                  ts, 7);
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
    lm_model_free(bp);
    lm_model_free(bb);
    free(plain);
    free(biased);
    free(ad);
    remove_tmpdir(root);
}

static void test_adapter_embedding_and_saved(void)
{
    char *root = make_tmpdir();
    char *base_dir = subdir(root, "base"), *ad = subdir(root, "adapter");
    write_base(base_dir, false);
    tt ts[] = {
        T2("base_model.model.model.embed_tokens.lora_embedding_A", 2, 16),
        T2("base_model.model.model.embed_tokens.lora_embedding_B", 8, 2),
        T2("base_model.model.lm_head.weight", 16, 8),
        T1("base_model.model.model.norm.modules_to_save.default.weight", 8),
    };
    write_adapter(ad,
                  "{\"peft_type\": \"LORA\", \"r\": 2, \"lora_alpha\": 2, "
                  "\"target_modules\": [\"embed_tokens\"], \"modules_to_save\": [\"lm_head\", \"norm\"]}",
                  ts, 4);
    lm_adapter *a = NULL;
    lm_model *base = NULL;
    lm_err err;
    CHECK_OK(lm_model_open(&base, base_dir, &err), &err);
    CHECK_OK(lm_adapter_open(&a, ad, &err), &err);
    if (a && base) {
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
        CHECK_OK(lm_adapter_validate(a, base, &err), &err);
    }
    lm_adapter_free(a);
    a = NULL;

    // Embedding factors the wrong way round against the base [vocab, hidden].
    tt bad[] = {
        T2("base_model.model.model.embed_tokens.lora_embedding_A", 2, 8),
        T2("base_model.model.model.embed_tokens.lora_embedding_B", 16, 2),
    };
    write_adapter(ad, "{\"peft_type\": \"LORA\", \"r\": 2}", bad, 2);
    CHECK_OK(lm_adapter_open(&a, ad, &err), &err);
    if (a && base)
        CHECK_FAILS(lm_adapter_validate(a, base, &err), LM_ERR_MISMATCH,
                    "adapter key 'base_model.model.model.embed_tokens.lora_embedding_A' has shape [2, 8], "
                    "but base tensor 'model.embed_tokens.weight' in", &err);
    CHECK(strstr(err.msg, "has shape [16, 8]") != NULL);
    lm_adapter_free(a);
    a = NULL;

    // A saved tensor with another shape than the base's.
    tt saved_bad[] = {T2("base_model.model.lm_head.weight", 16, 4)};
    write_adapter(ad, "{\"peft_type\": \"LORA\", \"modules_to_save\": [\"lm_head\"]}", saved_bad, 1);
    CHECK_OK(lm_adapter_open(&a, ad, &err), &err);
    if (a && base)
        CHECK_FAILS(lm_adapter_validate(a, base, &err), LM_ERR_MISMATCH,
                    "adapter key 'base_model.model.lm_head.weight' has shape [16, 4], but base tensor "
                    "'lm_head.weight'", &err);
    lm_adapter_free(a);
    lm_model_free(base);
    free(base_dir);
    free(ad);
    remove_tmpdir(root);
}

static void test_adapter_fan_in_fan_out(void)
{
    char *root = make_tmpdir();
    char *base_dir = subdir(root, "base"), *ad = subdir(root, "adapter");
    write_base(base_dir, false);
    lm_model *base = NULL;
    lm_adapter *a = NULL;
    lm_err err;
    CHECK_OK(lm_model_open(&base, base_dir, &err), &err);

    // gate_proj is [12, 8]: read as [in, out] with fan_in_fan_out, so A [r, 12], B [8, r].
    tt fifo[] = {
        T2(K(0, "mlp.gate_proj", ".lora_A.weight"), 2, 12),
        T2(K(0, "mlp.gate_proj", ".lora_B.weight"), 8, 2),
    };
    write_adapter(ad, "{\"peft_type\": \"LORA\", \"r\": 2, \"fan_in_fan_out\": true}", fifo, 2);
    CHECK_OK(lm_adapter_open(&a, ad, &err), &err);
    if (a && base)
        CHECK_OK(lm_adapter_validate(a, base, &err), &err);
    lm_adapter_free(a);
    a = NULL;

    // The same factors without fan_in_fan_out do not fit; the usual ones do not fit with it.
    write_adapter(ad, "{\"peft_type\": \"LORA\", \"r\": 2}", fifo, 2);
    CHECK_OK(lm_adapter_open(&a, ad, &err), &err);
    if (a && base)
        CHECK_FAILS(lm_adapter_validate(a, base, &err), LM_ERR_MISMATCH,
                    "has shape [2, 12], but base tensor 'model.layers.0.mlp.gate_proj.weight'", &err);
    lm_adapter_free(a);
    a = NULL;
    tt normal[] = {
        T2(K(0, "mlp.gate_proj", ".lora_A.weight"), 2, 8),
        T2(K(0, "mlp.gate_proj", ".lora_B.weight"), 12, 2),
    };
    write_adapter(ad, "{\"peft_type\": \"LORA\", \"r\": 2, \"fan_in_fan_out\": true}", normal, 2);
    CHECK_OK(lm_adapter_open(&a, ad, &err), &err);
    if (a && base)
        CHECK_FAILS(lm_adapter_validate(a, base, &err), LM_ERR_MISMATCH, "fan_in_fan_out", &err);
    lm_adapter_free(a);
    lm_model_free(base);
    free(base_dir);
    free(ad);
    remove_tmpdir(root);
}

static void test_adapter_validate_errors(void)
{
    char *root = make_tmpdir();
    char *base_dir = subdir(root, "base"), *ad = subdir(root, "adapter");
    write_base(base_dir, false);
    lm_model *base = NULL;
    lm_adapter *a = NULL;
    lm_err err;
    CHECK_OK(lm_model_open(&base, base_dir, &err), &err);
    const char *cfg = "{\"peft_type\": \"LORA\", \"r\": 2}";

    // A's in-dimension: the adapter key, the base tensor and both shapes.
    tt a_in[] = {
        T2(K(0, "self_attn.q_proj", ".lora_A.weight"), 2, 7),
        T2(K(0, "self_attn.q_proj", ".lora_B.weight"), 8, 2),
    };
    write_adapter(ad, cfg, a_in, 2);
    CHECK_OK(lm_adapter_open(&a, ad, &err), &err);
    if (a && base) {
        CHECK_FAILS(lm_adapter_validate(a, base, &err), LM_ERR_MISMATCH,
                    "adapter key 'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight' has "
                    "shape [2, 7], but base tensor 'model.layers.0.self_attn.q_proj.weight' in", &err);
        CHECK(strstr(err.msg, "has shape [8, 8]") && strstr(err.msg, "needs lora_A [2, 8]"));
    }
    lm_adapter_free(a);
    a = NULL;

    // B's out-dimension (k_proj is [4, 8] with one kv head).
    tt b_out[] = {
        T2(K(1, "self_attn.k_proj", ".lora_A.weight"), 2, 8),
        T2(K(1, "self_attn.k_proj", ".lora_B.weight"), 8, 2),
    };
    write_adapter(ad, cfg, b_out, 2);
    CHECK_OK(lm_adapter_open(&a, ad, &err), &err);
    if (a && base) {
        CHECK_FAILS(lm_adapter_validate(a, base, &err), LM_ERR_MISMATCH,
                    "adapter key 'base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight' has "
                    "shape [8, 2], but base tensor 'model.layers.1.self_attn.k_proj.weight'", &err);
        CHECK(strstr(err.msg, "has shape [4, 8]") != NULL);
    }
    lm_adapter_free(a);
    a = NULL;

    // A module the base does not have.
    tt absent[] = {
        T2(K(7, "self_attn.q_proj", ".lora_A.weight"), 2, 8),
        T2(K(7, "self_attn.q_proj", ".lora_B.weight"), 8, 2),
    };
    write_adapter(ad, cfg, absent, 2);
    CHECK_OK(lm_adapter_open(&a, ad, &err), &err);
    if (a && base)
        CHECK_FAILS(lm_adapter_validate(a, base, &err), LM_ERR_MISMATCH,
                    "changes 'model.layers.7.self_attn.q_proj.weight', which the base model", &err);
    lm_adapter_free(a);
    a = NULL;

    // Factors in a dtype llmerge does not compute with.
    tt i8[] = {
        T2(K(0, "self_attn.q_proj", ".lora_A.weight"), 2, 8),
        T2(K(0, "self_attn.q_proj", ".lora_B.weight"), 8, 2),
    };
    i8[1].dtype = "I8";
    write_adapter(ad, cfg, i8, 2);
    CHECK_OK(lm_adapter_open(&a, ad, &err), &err);
    if (a && base)
        CHECK_FAILS(lm_adapter_validate(a, base, &err), LM_ERR_UNSUPPORTED,
                    "q_proj.lora_B.weight' has dtype I8", &err);
    lm_adapter_free(a);
    lm_model_free(base);
    free(base_dir);
    free(ad);
    remove_tmpdir(root);
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

    tt q[] = {
        T2(K(0, "self_attn.q_proj", ".lora_A.weight"), 2, 8),
        T2(K(0, "self_attn.q_proj", ".lora_B.weight"), 8, 2),
    };
    write_adapter(ad, "{\"peft_type\": \"LORA\", \"r\": 2}", q, 2);
    CHECK_OK(lm_adapter_open(&a, ad, &err), &err);
    if (a && bu8) {
        CHECK_FAILS(lm_adapter_validate(a, bu8, &err), LM_ERR_UNSUPPORTED,
                    "adapter key 'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight' changes "
                    "'model.layers.0.self_attn.q_proj.weight', which is U8 in the base", &err);
        CHECK(strstr(err.msg, "adapter_model.safetensors") != NULL);
    }
    lm_adapter_free(a);
    a = NULL;
    // the same adapter on layer 1: the U8 tensor is no concern of it
    tt q1[] = {
        T2(K(1, "self_attn.q_proj", ".lora_A.weight"), 2, 8),
        T2(K(1, "self_attn.q_proj", ".lora_B.weight"), 8, 2),
    };
    write_adapter(ad, "{\"peft_type\": \"LORA\", \"r\": 2}", q1, 2);
    CHECK_OK(lm_adapter_open(&a, ad, &err), &err);
    if (a && bu8)
        CHECK_OK(lm_adapter_validate(a, bu8, &err), &err);
    lm_adapter_free(a);
    a = NULL;

    tt kb[] = {
        T2(K(0, "self_attn.k_proj", ".lora_A.weight"), 2, 8),
        T2(K(0, "self_attn.k_proj", ".lora_B.weight"), 4, 2),
        T1(K(0, "self_attn.k_proj", ".lora_B.bias"), 4),
    };
    write_adapter(ad, "{\"peft_type\": \"LORA\", \"r\": 2, \"lora_bias\": true}", kb, 3);
    CHECK_OK(lm_adapter_open(&a, ad, &err), &err);
    if (a && bi32)
        CHECK_FAILS(lm_adapter_validate(a, bi32, &err), LM_ERR_UNSUPPORTED,
                    "k_proj.lora_B.bias' changes 'model.layers.0.self_attn.k_proj.bias', which is I32", &err);
    lm_adapter_free(a);
    a = NULL;

    tt saved[] = {T2("base_model.model.lm_head.weight", 16, 8)};
    write_adapter(ad, "{\"peft_type\": \"LORA\", \"modules_to_save\": [\"lm_head\"]}", saved, 1);
    CHECK_OK(lm_adapter_open(&a, ad, &err), &err);
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

    tt only_a[] = {T2(K(0, q, ".lora_A.weight"), 2, 8)};
    write_adapter(ad, cfg, only_a, 1);
    CHECK_FAILS(lm_adapter_open(&a, ad, &err), LM_ERR_FORMAT,
                "key 'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight' has no matching "
                "'base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight'", &err);
    CHECK(a == NULL);

    tt only_b[] = {T2(K(0, q, ".lora_B.weight"), 8, 2)};
    write_adapter(ad, cfg, only_b, 1);
    CHECK_FAILS(lm_adapter_open(&a, ad, &err), LM_ERR_FORMAT,
                "q_proj.lora_B.weight' has no matching 'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight'",
                &err);

    tt unknown[] = {T2(K(0, q, ".lora_A.weight"), 2, 8), T2(K(0, q, ".lora_B.weight"), 8, 2),
                    T1(K(0, q, ".lora_A.bias"), 2)};
    write_adapter(ad, cfg, unknown, 3);
    CHECK_FAILS(lm_adapter_open(&a, ad, &err), LM_ERR_FORMAT,
                "key 'base_model.model.model.layers.0.self_attn.q_proj.lora_A.bias': unknown LoRA key", &err);
    unknown[2] = T1(K(0, q, ".weird"), 2);
    write_adapter(ad, cfg, unknown, 3);
    CHECK_FAILS(lm_adapter_open(&a, ad, &err), LM_ERR_FORMAT, "q_proj.weird': unknown key", &err);

    tt no_prefix[] = {T2("model.layers.0.self_attn.q_proj.lora_A.weight", 2, 8)};
    write_adapter(ad, cfg, no_prefix, 1);
    CHECK_FAILS(lm_adapter_open(&a, ad, &err), LM_ERR_FORMAT,
                "key 'model.layers.0.self_attn.q_proj.lora_A.weight' does not start with 'base_model.model.'", &err);

    // Factor shapes against r (from r, then from a rank_pattern key).
    tt r3[] = {T2(K(0, q, ".lora_A.weight"), 3, 8), T2(K(0, q, ".lora_B.weight"), 8, 3)};
    write_adapter(ad, cfg, r3, 2);
    CHECK_FAILS(lm_adapter_open(&a, ad, &err), LM_ERR_FORMAT,
                "key 'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight' has shape [3, 8], but r = 2", &err);
    write_adapter(ad, "{\"peft_type\": \"LORA\", \"r\": 3, \"rank_pattern\": {\"q_proj\": 4}}", r3, 2);
    CHECK_FAILS(lm_adapter_open(&a, ad, &err), LM_ERR_FORMAT, "r = 4 (rank_pattern key 'q_proj')", &err);
    tt rb[] = {T2(K(0, q, ".lora_A.weight"), 2, 8), T2(K(0, q, ".lora_B.weight"), 8, 3)};
    write_adapter(ad, cfg, rb, 2);
    CHECK_FAILS(lm_adapter_open(&a, ad, &err), LM_ERR_FORMAT, "q_proj.lora_B.weight' has shape [8, 3], but r = 2", &err);

    // DoRA and bias keys must agree with the config and with B.
    tt mag[] = {T2(K(0, q, ".lora_A.weight"), 2, 8), T2(K(0, q, ".lora_B.weight"), 8, 2),
                T1(K(0, q, ".lora_magnitude_vector"), 8)};
    write_adapter(ad, cfg, mag, 3);
    CHECK_FAILS(lm_adapter_open(&a, ad, &err), LM_ERR_FORMAT,
                "q_proj.lora_magnitude_vector' is a DoRA magnitude, but use_dora is not true", &err);
    write_adapter(ad, "{\"peft_type\": \"LORA\", \"r\": 2, \"use_dora\": true}", mag, 2);
    CHECK_FAILS(lm_adapter_open(&a, ad, &err), LM_ERR_FORMAT,
                "use_dora is true in", &err);
    CHECK(strstr(err.msg, "'base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector' is missing"));
    mag[2] = T1(K(0, q, ".lora_magnitude_vector"), 4);
    write_adapter(ad, "{\"peft_type\": \"LORA\", \"r\": 2, \"use_dora\": true}", mag, 3);
    CHECK_FAILS(lm_adapter_open(&a, ad, &err), LM_ERR_FORMAT,
                "q_proj.lora_magnitude_vector' has shape [4], but", &err);
    tt bias[] = {T2(K(0, q, ".lora_A.weight"), 2, 8), T2(K(0, q, ".lora_B.weight"), 8, 2),
                 T1(K(0, q, ".lora_B.bias"), 8)};
    write_adapter(ad, cfg, bias, 3);
    CHECK_FAILS(lm_adapter_open(&a, ad, &err), LM_ERR_FORMAT,
                "q_proj.lora_B.bias' is a LoRA bias, but lora_bias is not true", &err);
    tt only_bias[] = {T1(K(0, q, ".lora_B.bias"), 8)};
    write_adapter(ad, "{\"peft_type\": \"LORA\", \"r\": 2, \"lora_bias\": true}", only_bias, 1);
    CHECK_FAILS(lm_adapter_open(&a, ad, &err), LM_ERR_FORMAT, "q_proj.lora_B.bias' has no matching", &err);

    // Linear and embedding factors of one module.
    tt mixed[] = {T2(K(0, q, ".lora_A.weight"), 2, 8), T2(K(0, q, ".lora_embedding_B"), 8, 2)};
    write_adapter(ad, cfg, mixed, 2);
    CHECK_FAILS(lm_adapter_open(&a, ad, &err), LM_ERR_FORMAT, "mixes linear and embedding", &err);

    // Full tensors need modules_to_save; one tensor saved two ways is changed twice.
    tt full[] = {T2("base_model.model.lm_head.weight", 16, 8)};
    write_adapter(ad, cfg, full, 1);
    CHECK_FAILS(lm_adapter_open(&a, ad, &err), LM_ERR_FORMAT,
                "key 'base_model.model.lm_head.weight' is a full tensor, but its module is not in modules_to_save", &err);
    tt twice[] = {T2("base_model.model.lm_head.weight", 16, 8),
                  T2("base_model.model.lm_head.modules_to_save.default.weight", 16, 8)};
    write_adapter(ad, "{\"peft_type\": \"LORA\", \"modules_to_save\": [\"lm_head\"]}", twice, 2);
    CHECK_FAILS(lm_adapter_open(&a, ad, &err), LM_ERR_FORMAT, "base tensor 'lm_head.weight' is changed by two keys", &err);
    tt tokens[] = {T2("base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta", 2, 8)};
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
    tt ts[] = {T2(K(0, "self_attn.q_proj", ".lora_A.weight"), 2, 8),
               T2(K(0, "self_attn.q_proj", ".lora_B.weight"), 8, 2)};
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
    test_config_targets();
    test_config_errors();
    test_adapter_linear();
    test_adapter_dora_bias();
    test_adapter_embedding_and_saved();
    test_adapter_fan_in_fan_out();
    test_adapter_validate_errors();
    test_adapter_base_dtype();
    test_adapter_open_errors();
    test_input_detect();
    return check_report("test_adapter");
}
