// The fixture generator: `gen_fixtures OUTDIR` writes the small models, adapters, calibration
// files and broken inputs that the tests and end-to-end scripts run on (testdata/README.md
// says what each is for). Everything comes from splitmix64 streams with fixed seeds, normal
// draws are Irwin-Hall sums (additions only, so no libm function can round differently on
// another machine), and every file goes through llmerge's own writer: the output is the same
// byte for byte on every run and every machine. Each fixture directory is removed and written
// afresh; nothing else under OUTDIR is touched.
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "dtype.h"
#include "st_writer.h"
#include "status.h"
#include "util.h"

#define TRY(call)                                                                             \
    do {                                                                                      \
        s = (call);                                                                           \
        if (s != LM_OK)                                                                       \
            goto fail;                                                                        \
    } while (0)

// ==== random numbers ==========================================================================

typedef struct fx_rng {
    uint64_t state;
} fx_rng;

static uint64_t rng_u64(fx_rng *r)
{
    uint64_t z = (r->state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// A stream for one tensor: the same values whatever order tensors are made in.
static fx_rng rng_for(uint64_t seed, const char *name)
{
    return (fx_rng){seed * 0x2545F4914F6CDD1Dull ^ lm_xxh64(name, strlen(name))};
}

static double rng_uniform(fx_rng *r)
{
    return (double)(rng_u64(r) >> 11) * 0x1p-53;
}

// N(0, std²), approximately: the sum of 12 uniforms has mean 6 and variance 1.
static float rng_normal(fx_rng *r, double std)
{
    double sum = 0;
    for (int i = 0; i < 12; i++)
        sum += rng_uniform(r);
    return (float)((sum - 6.0) * std);
}

// ==== text ====================================================================================

typedef struct fx_text {
    char *p;
    size_t len, cap;
    bool oom;
} fx_text;

static void text_add(fx_text *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void text_add(fx_text *t, const char *fmt, ...)
{
    if (t->oom)
        return;
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (n < 0) {
        t->oom = true;
        return;
    }
    if (t->len + (size_t)n + 1 > t->cap) {
        size_t cap = (t->len + (size_t)n + 1) * 2;
        char *p = realloc(t->p, cap);
        if (!p) {
            t->oom = true;
            return;
        }
        t->p = p;
        t->cap = cap;
    }
    va_start(ap, fmt);
    vsnprintf(t->p + t->len, (size_t)n + 1, fmt, ap);
    va_end(ap);
    t->len += (size_t)n;
}

// Writes `t` to dir/name and frees it.
static lm_status text_save(fx_text *t, const char *dir, const char *name, lm_err *err)
{
    char *path = lm_path_join(dir, name);
    lm_status s;
    if (t->oom || !path)
        s = lm_err_set(err, LM_ERR_NOMEM, "out of memory writing %s", name);
    else
        s = lm_write_file(path, t->p, t->len, err);
    free(path);
    free(t->p);
    memset(t, 0, sizeof *t);
    return s;
}

static lm_status save_string(const char *dir, const char *name, const char *text, lm_err *err)
{
    char *path = lm_path_join(dir, name);
    if (!path)
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    lm_status s = lm_write_file(path, text, strlen(text), err);
    free(path);
    return s;
}

// ==== tensor sets =============================================================================

typedef struct fx_tensor {
    char *name;
    int ndim;
    int64_t shape[2];  // (ndim)
    int64_t numel;
    float *v;          // (numel) row-major
    bool own_dtype;    // written as `dtype` (odd_bytes), not as the rest of its set
    lm_dtype dtype;
} fx_tensor;

// A state dict in the order it is built, as torch's state_dict() would list it.
typedef struct fx_set {
    fx_tensor *t;  // (n)
    int n, cap;
} fx_set;

static void set_free(fx_set *s)
{
    for (int i = 0; i < s->n; i++) {
        free(s->t[i].name);
        free(s->t[i].v);
    }
    free(s->t);
    memset(s, 0, sizeof *s);
}

// Adds a zeroed tensor called name (printf format) of shape [d0] (d1 < 0) or [d0, d1]; returns
// it, or NULL when memory runs out.
static fx_tensor *set_add(fx_set *s, int64_t d0, int64_t d1, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static fx_tensor *set_add(fx_set *s, int64_t d0, int64_t d1, const char *fmt, ...)
{
    if (s->n == s->cap) {
        int cap = s->cap ? s->cap * 2 : 32;
        fx_tensor *t = realloc(s->t, (size_t)cap * sizeof *t);
        if (!t)
            return NULL;
        s->t = t;
        s->cap = cap;
    }
    char name[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(name, sizeof name, fmt, ap);
    va_end(ap);
    fx_tensor *t = &s->t[s->n];
    memset(t, 0, sizeof *t);
    t->name = lm_strdup(name);
    t->ndim = d1 < 0 ? 1 : 2;
    t->shape[0] = d0;
    t->shape[1] = d1 < 0 ? 0 : d1;
    t->numel = d1 < 0 ? d0 : d0 * d1;
    t->v = calloc((size_t)t->numel + 1, sizeof *t->v);
    if (!t->name || !t->v) {
        free(t->name);
        free(t->v);
        return NULL;
    }
    s->n++;
    return t;
}

static fx_tensor *set_find(const fx_set *s, const char *name)
{
    for (int i = 0; i < s->n; i++) {
        if (strcmp(s->t[i].name, name) == 0)
            return &s->t[i];
    }
    return NULL;
}

// Fills t with mean + N(0, std²) from its own stream.
static void fill_normal(fx_tensor *t, uint64_t seed, double mean, double std)
{
    fx_rng r = rng_for(seed, t->name);
    for (int64_t i = 0; i < t->numel; i++)
        t->v[i] = (float)mean + rng_normal(&r, std);
}

// Rounds every value to `dt` and back, so the floats in memory equal what the file will hold.
static lm_status set_round(fx_set *s, lm_dtype dt, lm_err *err)
{
    for (int i = 0; i < s->n; i++) {
        fx_tensor *t = &s->t[i];
        void *tmp = malloc((size_t)t->numel * 4 + 4);
        if (!tmp)
            return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
        lm_status st = lm_convert_from_f32(tmp, dt, t->v, t->numel, err);
        if (st == LM_OK)
            st = lm_convert_to_f32(t->v, tmp, dt, t->numel, err);
        free(tmp);
        if (st != LM_OK)
            return st;
    }
    return LM_OK;
}

// The bytes of t->v in a dtype llmerge does not write (I32, U8, F8_E4M3), for the fixtures whose
// tensors must be refused or copied: I32 the values times 1000 truncated, U8 128 + the values
// times 2000 (clamped), F8_E4M3 the sign, exponent and top three mantissa bits (truncated,
// never the NaN pattern). dst holds numel elements.
static void odd_bytes(void *dst, const fx_tensor *t)
{
    for (int64_t i = 0; i < t->numel; i++) {
        float v = t->v[i];
        if (t->dtype == LM_DTYPE_I32) {
            int32_t x = (int32_t)(v * 1000.0f);
            memcpy((char *)dst + 4 * i, &x, 4);
        } else if (t->dtype == LM_DTYPE_U8) {
            int x = 128 + (int)(v * 2000.0f);
            ((uint8_t *)dst)[i] = (uint8_t)(x < 0 ? 0 : x > 255 ? 255 : x);
        } else {  // F8_E4M3: bias 7
            uint32_t u = lm_f32_bits(v);
            int e = (int)((u >> 23) & 0xFF) - 127 + 7, m = (int)((u >> 20) & 7);
            e = e < 1 ? 1 : e > 15 ? 15 : e;
            m = e == 15 && m == 7 ? 6 : m;
            ((uint8_t *)dst)[i] = (uint8_t)((u >> 31) << 7 | (uint32_t)e << 3 | (uint32_t)m);
        }
    }
}

// Writes the set in `dt` (a tensor with own_dtype in its own): into directory `dir` split at
// shard_size (expecting want_shards shards) when `file` is NULL, else as the single file
// dir/file.
static lm_status set_save(const fx_set *set, lm_dtype dt, const char *dir, const char *file,
                          uint64_t shard_size, int want_shards, lm_err *err)
{
    lm_status s = LM_OK;
    lm_st_desc *d = calloc((size_t)set->n + 1, sizeof *d);
    void **data = calloc((size_t)set->n + 1, sizeof *data);
    lm_st_writer *w = NULL;
    char *path = NULL;
    if (!d || !data) {
        s = lm_err_set(err, LM_ERR_NOMEM, "out of memory");
        goto fail;
    }
    for (int i = 0; i < set->n; i++) {
        const fx_tensor *t = &set->t[i];
        lm_dtype tdt = t->own_dtype ? t->dtype : dt;
        d[i] = (lm_st_desc){.name = t->name, .dtype = tdt, .ndim = t->ndim};
        d[i].shape[0] = t->shape[0];
        d[i].shape[1] = t->shape[1];
        data[i] = malloc((size_t)t->numel * (lm_dtype_bits(tdt) / 8) + 1);
        if (!data[i]) {
            s = lm_err_set(err, LM_ERR_NOMEM, "out of memory");
            goto fail;
        }
        if (lm_dtype_writable(tdt))
            TRY(lm_convert_from_f32(data[i], tdt, t->v, t->numel, err));
        else
            odd_bytes(data[i], t);
    }
    if (file) {
        path = lm_path_join(dir, file);
        if (!path) {
            s = lm_err_set(err, LM_ERR_NOMEM, "out of memory");
            goto fail;
        }
        TRY(lm_st_write_file(path, d, (const void *const *)data, set->n, NULL, err));
    } else {
        TRY(lm_st_writer_open(&w, dir, d, set->n, shard_size, NULL, err));
        if (lm_st_writer_plan(w)->n_shards != want_shards) {
            s = lm_err_set(err, LM_ERR_MISMATCH, "%s: %d shards, the fixture wants %d", dir,
                           lm_st_writer_plan(w)->n_shards, want_shards);
            goto fail;
        }
        for (int i = 0; i < set->n; i++) {
            uint64_t bytes = (uint64_t)set->t[i].numel * (lm_dtype_bits(d[i].dtype) / 8);
            TRY(lm_st_writer_put(w, i, data[i], bytes, err));
        }
        TRY(lm_st_writer_finish(w, err));
    }

fail:
    lm_st_writer_free(w);
    for (int i = 0; data && i < set->n; i++)
        free(data[i]);
    free(data);
    free(d);
    free(path);
    return s;
}

// ==== models ==================================================================================

typedef struct fx_arch {
    const char *arch;        // "LlamaForCausalLM"
    const char *model_type;  // "llama"
    int hidden, inter, layers, heads, kv, head_dim, vocab;
    bool qkv_bias;           // Qwen2: q, k and v have a bias
    bool tied;               // no lm_head.weight
    bool attention_bias;     // Llama attention_bias: q, k, v and o have a bias
    bool mlp_bias;           // Llama mlp_bias: gate, up and down have a bias
    const char *rope_theta;  // as written in config.json; NULL for the default of the layout
    const char *rope_scaling;  // the rope_scaling object as JSON; NULL for null
} fx_arch;

static const fx_arch LLAMA = {"LlamaForCausalLM", "llama", 64, 128, 2, 4, 2, 16, 256, false, false,
                              false, false, NULL, NULL};
static const fx_arch QWEN = {"Qwen2ForCausalLM", "qwen2", 64, 128, 2, 4, 2, 16, 256, true, true,
                             false, false, NULL, NULL};
// Llama 3 style: rope_scaling "llama3" (with orig 256, low 1, high 8 the frequencies of head_dim
// 24 and theta 5e5 fall in all three bands), head_dim 24 that is not hidden / heads, one KV head
// for four query heads, biases on every projection (attention_bias and mlp_bias).
static const fx_arch LLAMA3 = {"LlamaForCausalLM", "llama", 64, 96, 2, 4, 1, 24, 256, false, false, true, true,
                               "500000.0",
                               "{\n    \"factor\": 8.0,\n    \"high_freq_factor\": 8.0,\n"
                               "    \"low_freq_factor\": 1.0,\n"
                               "    \"original_max_position_embeddings\": 256,\n"
                               "    \"rope_type\": \"llama3\"\n  }"};

static const char *const LINEARS[] = {"q_proj", "k_proj", "v_proj", "o_proj",
                                      "gate_proj", "up_proj", "down_proj"};
enum { N_LINEARS = 7 };

// The module path of linear `mod` in layer `l`, e.g. "model.layers.0.self_attn.q_proj".
static void linear_path(char *buf, size_t cap, int l, const char *mod)
{
    bool mlp = strstr(mod, "gate") || strstr(mod, "up_") || strstr(mod, "down");
    snprintf(buf, cap, "model.layers.%d.%s.%s", l, mlp ? "mlp" : "self_attn", mod);
}

// The [out, in] of linear `mod`.
static void linear_dims(const fx_arch *a, const char *mod, int64_t *out, int64_t *in)
{
    int64_t q = (int64_t)a->heads * a->head_dim, kv = (int64_t)a->kv * a->head_dim;
    *in = a->hidden;
    if (strcmp(mod, "q_proj") == 0) *out = q;
    else if (strcmp(mod, "k_proj") == 0 || strcmp(mod, "v_proj") == 0) *out = kv;
    else if (strcmp(mod, "o_proj") == 0) { *out = a->hidden; *in = q; }
    else if (strcmp(mod, "down_proj") == 0) { *out = a->hidden; *in = a->inter; }
    else *out = a->inter;  // gate_proj, up_proj
}

// Builds a model's state dict in transformers' order: weights ~N(0, 0.02), norms ~1.
static lm_status make_model(fx_set *m, const fx_arch *a, uint64_t seed, lm_err *err)
{
    fx_tensor *t;
#define ADD(d0, d1, mean, std, ...)                                                           \
    do {                                                                                      \
        if (!(t = set_add(m, d0, d1, __VA_ARGS__)))                                           \
            return lm_err_set(err, LM_ERR_NOMEM, "out of memory");                            \
        fill_normal(t, seed, mean, std);                                                      \
    } while (0)
    ADD(a->vocab, a->hidden, 0, 0.02, "model.embed_tokens.weight");
    for (int l = 0; l < a->layers; l++) {
        for (int k = 0; k < N_LINEARS; k++) {
            char path[128];
            int64_t out, in;
            linear_path(path, sizeof path, l, LINEARS[k]);
            linear_dims(a, LINEARS[k], &out, &in);
            ADD(out, in, 0, 0.02, "%s.weight", path);
            if ((a->qkv_bias && k < 3) || (a->attention_bias && k < 4) || (a->mlp_bias && k >= 4))
                ADD(out, -1, 0, 0.02, "%s.bias", path);
        }
        ADD(a->hidden, -1, 1, 0.05, "model.layers.%d.input_layernorm.weight", l);
        ADD(a->hidden, -1, 1, 0.05, "model.layers.%d.post_attention_layernorm.weight", l);
    }
    ADD(a->hidden, -1, 1, 0.05, "model.norm.weight");
    if (!a->tied)
        ADD(a->vocab, a->hidden, 0, 0.02, "lm_head.weight");
#undef ADD
    return LM_OK;
}

// A fine-tuned copy of `base`: every tensor plus N(0, std²) (norms get five times more).
static lm_status make_finetune(fx_set *ft, const fx_set *base, uint64_t seed, double std,
                               lm_err *err)
{
    for (int i = 0; i < base->n; i++) {
        const fx_tensor *b = &base->t[i];
        fx_tensor *t = set_add(ft, b->shape[0], b->ndim == 1 ? -1 : b->shape[1], "%s", b->name);
        if (!t)
            return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
        fill_normal(t, seed, 0, strstr(b->name, "norm") ? 5 * std : std);
        for (int64_t k = 0; k < t->numel; k++)
            t->v[k] += b->v[k];
    }
    return LM_OK;
}

static lm_status save_config(const char *dir, const fx_arch *a, const char *torch_dtype,
                             lm_err *err)
{
    fx_text t = {0};
    text_add(&t, "{\n  \"architectures\": [\n    \"%s\"\n  ],\n", a->arch);
    if (!a->qkv_bias)
        text_add(&t, "  \"attention_bias\": %s,\n", a->attention_bias ? "true" : "false");
    text_add(&t, "  \"attention_dropout\": 0.0,\n  \"bos_token_id\": 1,\n  \"eos_token_id\": 2,\n");
    if (!a->qkv_bias)  // Qwen2 configs carry no head_dim
        text_add(&t, "  \"head_dim\": %d,\n", a->head_dim);
    text_add(&t, "  \"hidden_act\": \"silu\",\n  \"hidden_size\": %d,\n"
             "  \"initializer_range\": 0.02,\n  \"intermediate_size\": %d,\n"
             "  \"max_position_embeddings\": 256,\n", a->hidden, a->inter);
    if (a->qkv_bias)
        text_add(&t, "  \"max_window_layers\": %d,\n", a->layers);
    else
        text_add(&t, "  \"mlp_bias\": %s,\n", a->mlp_bias ? "true" : "false");
    text_add(&t, "  \"model_type\": \"%s\",\n  \"num_attention_heads\": %d,\n"
             "  \"num_hidden_layers\": %d,\n  \"num_key_value_heads\": %d,\n", a->model_type,
             a->heads, a->layers, a->kv);
    if (!a->qkv_bias)
        text_add(&t, "  \"pretraining_tp\": 1,\n");
    text_add(&t, "  \"rms_norm_eps\": %s,\n  \"rope_scaling\": %s,\n  \"rope_theta\": %s,\n",
             a->qkv_bias ? "1e-06" : "1e-05", a->rope_scaling ? a->rope_scaling : "null",
             a->rope_theta ? a->rope_theta : a->qkv_bias ? "1000000.0" : "10000.0");
    if (a->qkv_bias)
        text_add(&t, "  \"sliding_window\": null,\n");
    text_add(&t, "  \"tie_word_embeddings\": %s,\n  \"torch_dtype\": \"%s\",\n"
             "  \"transformers_version\": \"4.44.2\",\n  \"use_cache\": true,\n",
             a->tied ? "true" : "false", torch_dtype);
    if (a->qkv_bias)
        text_add(&t, "  \"use_sliding_window\": false,\n");
    text_add(&t, "  \"vocab_size\": %d\n}\n", a->vocab);
    return text_save(&t, dir, "config.json", err);
}

// The small tokenizer and generation files a model directory carries beside its weights.
static lm_status save_side_files(const char *dir, lm_err *err)
{
    lm_status s;
    TRY(save_string(dir, "tokenizer_config.json",
                    "{\n  \"add_bos_token\": true,\n  \"add_eos_token\": false,\n"
                    "  \"bos_token\": \"<s>\",\n  \"clean_up_tokenization_spaces\": false,\n"
                    "  \"eos_token\": \"</s>\",\n  \"model_max_length\": 256,\n"
                    "  \"pad_token\": null,\n  \"tokenizer_class\": \"PreTrainedTokenizerFast\",\n"
                    "  \"unk_token\": \"<unk>\"\n}\n", err));
    TRY(save_string(dir, "special_tokens_map.json",
                    "{\n  \"bos_token\": \"<s>\",\n  \"eos_token\": \"</s>\",\n"
                    "  \"unk_token\": \"<unk>\"\n}\n", err));
    TRY(save_string(dir, "generation_config.json",
                    "{\n  \"_from_model_config\": true,\n  \"bos_token_id\": 1,\n"
                    "  \"eos_token_id\": 2,\n  \"transformers_version\": \"4.44.2\"\n}\n", err));
fail:
    return s;
}

// Removes OUTDIR/name and creates it empty; *dir is the new path (caller frees).
static lm_status fresh_dir(const char *root, const char *name, char **dir, lm_err *err)
{
    *dir = lm_path_join(root, name);
    if (!*dir)
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    lm_status s = lm_rm_rf(*dir, err);
    if (s == LM_OK)
        s = lm_mkdir_p(*dir, err);
    return s;
}

// ==== adapters ================================================================================

typedef struct fx_adapter_cfg {
    const char *base;                  // base_model_name_or_path
    const char *peft_type;             // "LORA"
    int r, alpha;
    const char *const *targets;        // (n_targets)
    int n_targets;
    const char *rank_key;              // rank_pattern {rank_key: rank_r}, or NULL for {}
    int rank_r;
    const char *alpha_key;             // alpha_pattern {alpha_key: alpha_a}, or NULL for {}
    int alpha_a;
    const char *modules_to_save;       // one module, or NULL for null
    bool rslora, dora, lora_bias;
} fx_adapter_cfg;

// adapter_config.json as PEFT writes it (json.dumps(indent=2, sort_keys=True)), with the
// fields llmerge reads and some it must ignore.
static lm_status save_adapter_config(const char *dir, const fx_adapter_cfg *c, lm_err *err)
{
    fx_text t = {0};
    text_add(&t, "{\n");
    if (c->alpha_key)
        text_add(&t, "  \"alpha_pattern\": {\n    \"%s\": %d\n  },\n", c->alpha_key, c->alpha_a);
    else
        text_add(&t, "  \"alpha_pattern\": {},\n");
    text_add(&t, "  \"auto_mapping\": null,\n  \"base_model_name_or_path\": \"%s\",\n"
             "  \"bias\": \"none\",\n  \"fan_in_fan_out\": false,\n  \"inference_mode\": true,\n"
             "  \"init_lora_weights\": true,\n  \"layer_replication\": null,\n"
             "  \"layers_pattern\": null,\n  \"layers_to_transform\": null,\n"
             "  \"loftq_config\": {},\n  \"lora_alpha\": %d,\n  \"lora_bias\": %s,\n"
             "  \"lora_dropout\": 0.05,\n  \"megatron_config\": null,\n"
             "  \"megatron_core\": \"megatron.core\",\n",
             c->base, c->alpha, c->lora_bias ? "true" : "false");
    if (c->modules_to_save)
        text_add(&t, "  \"modules_to_save\": [\n    \"%s\"\n  ],\n", c->modules_to_save);
    else
        text_add(&t, "  \"modules_to_save\": null,\n");
    text_add(&t, "  \"peft_type\": \"%s\",\n  \"r\": %d,\n", c->peft_type, c->r);
    if (c->rank_key)
        text_add(&t, "  \"rank_pattern\": {\n    \"%s\": %d\n  },\n", c->rank_key, c->rank_r);
    else
        text_add(&t, "  \"rank_pattern\": {},\n");
    text_add(&t, "  \"revision\": null,\n  \"target_modules\": [\n");
    for (int i = 0; i < c->n_targets; i++)
        text_add(&t, "    \"%s\"%s\n", c->targets[i], i + 1 < c->n_targets ? "," : "");
    text_add(&t, "  ],\n  \"task_type\": \"CAUSAL_LM\",\n  \"use_dora\": %s,\n"
             "  \"use_rslora\": %s\n}\n", c->dora ? "true" : "false", c->rslora ? "true" : "false");
    return text_save(&t, dir, "adapter_config.json", err);
}

static bool targeted(const fx_adapter_cfg *c, const char *mod)
{
    for (int i = 0; i < c->n_targets; i++) {
        if (strcmp(c->targets[i], mod) == 0)
            return true;
    }
    return false;
}

// The LoRA tensors of every targeted linear, in PEFT's order: per module lora_A [r, in],
// lora_B [out, r] (both random, so the delta is not zero), then lora_B.bias [out] and the
// DoRA magnitude [out] when asked. `in_fix` > 0 replaces q_proj's in-dim of layer 0 (for the
// broken fixture). DoRA magnitudes are the row norms of base + s·B@A, perturbed.
static lm_status add_lora_linears(fx_set *ad, const fx_arch *a, const fx_set *base,
                                  const fx_adapter_cfg *c, uint64_t seed, int64_t in_fix,
                                  lm_err *err)
{
    for (int l = 0; l < a->layers; l++) {
        for (int k = 0; k < N_LINEARS; k++) {
            const char *mod = LINEARS[k];
            if (!targeted(c, mod))
                continue;
            char path[128];
            int64_t out, in;
            linear_path(path, sizeof path, l, mod);
            linear_dims(a, mod, &out, &in);
            if (in_fix > 0 && l == 0 && k == 0)
                in = in_fix;
            int r = c->rank_key && strcmp(c->rank_key, path) == 0 ? c->rank_r : c->r;
            int ia = ad->n, ib = ad->n + 1;  // positions: set_add may move the array
            fx_tensor *t = set_add(ad, r, in, "base_model.model.%s.lora_A.weight", path);
            if (!t)
                return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
            fill_normal(t, seed, 0, 1.0 / 8.0);
            t = set_add(ad, out, r, "base_model.model.%s.lora_B.weight", path);
            if (!t)
                return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
            fill_normal(t, seed, 0, 0.01);
            if (c->lora_bias) {
                t = set_add(ad, out, -1, "base_model.model.%s.lora_B.bias", path);
                if (!t)
                    return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
                fill_normal(t, seed, 0, 0.01);
            }
            if (!c->dora)
                continue;
            char wname[160];
            snprintf(wname, sizeof wname, "%s.weight", path);
            const fx_tensor *W = set_find(base, wname);  // [out, in]
            fx_tensor *m = set_add(ad, out, -1, "base_model.model.%s.lora_magnitude_vector", path);
            if (!m || !W)
                return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
            const float *A = ad->t[ia].v;  // [r, in]
            const float *B = ad->t[ib].v;  // [out, r]
            double scale = (double)c->alpha / r;
            fx_rng rr = rng_for(seed, m->name);
            for (int64_t o = 0; o < out; o++) {
                double norm2 = 0;
                for (int64_t i = 0; i < in; i++) {
                    double dw = 0;
                    for (int j = 0; j < r; j++)
                        dw += (double)B[o * r + j] * A[(int64_t)j * in + i];
                    double v = W->v[o * in + i] + scale * dw;
                    norm2 += v * v;
                }
                // sqrt is correctly rounded by IEEE 754: the same bits everywhere
                m->v[o] = (float)(sqrt(norm2) * (1.0 + rng_normal(&rr, 0.05)));
            }
        }
    }
    return LM_OK;
}

static lm_status save_adapter(const char *dir, const fx_set *ad, lm_dtype dt,
                              const fx_adapter_cfg *c, lm_err *err)
{
    lm_status s = save_adapter_config(dir, c, err);
    if (s == LM_OK)
        s = set_save(ad, dt, dir, "adapter_model.safetensors", 0, 1, err);
    return s;
}

// ==== the fixtures ============================================================================

static const char *const QV[] = {"q_proj", "v_proj"};
static const char *const ALL_LINEAR[] = {"q_proj", "k_proj", "v_proj", "o_proj",
                                         "gate_proj", "up_proj", "down_proj"};
static const char *const QKV[] = {"q_proj", "k_proj", "v_proj"};
static const char *const EMB_Q[] = {"embed_tokens", "q_proj"};

#define BASE_SHARD_SIZE 110000ull  // splits base/ in two: layer 0 | layer 1 (see README)
#define FT2_SHARD_SIZE 150000ull   // splits ft_full2/ in two, inside layer 1

static lm_status gen_llama(const char *root, lm_err *err)
{
    lm_status s = LM_OK;
    fx_set base = {0}, ft = {0}, ad = {0};
    char *dir = NULL;

    // base/: BF16 in two shards
    TRY(make_model(&base, &LLAMA, 1, err));
    TRY(set_round(&base, LM_DTYPE_BF16, err));
    TRY(fresh_dir(root, "base", &dir, err));
    TRY(save_config(dir, &LLAMA, "bfloat16", err));
    TRY(save_side_files(dir, err));
    TRY(set_save(&base, LM_DTYPE_BF16, dir, NULL, BASE_SHARD_SIZE, 2, err));
    free(dir);
    dir = NULL;

    // ft_full/: base plus small deltas, one shard; ft_full2/: others, two shards
    TRY(make_finetune(&ft, &base, 2, 0.002, err));
    TRY(fresh_dir(root, "ft_full", &dir, err));
    TRY(save_config(dir, &LLAMA, "bfloat16", err));
    TRY(save_side_files(dir, err));
    TRY(set_save(&ft, LM_DTYPE_BF16, dir, NULL, 5000000000ull, 1, err));
    free(dir);
    dir = NULL;
    set_free(&ft);
    TRY(make_finetune(&ft, &base, 3, 0.002, err));
    TRY(fresh_dir(root, "ft_full2", &dir, err));
    TRY(save_config(dir, &LLAMA, "bfloat16", err));
    TRY(set_save(&ft, LM_DTYPE_BF16, dir, NULL, FT2_SHARD_SIZE, 2, err));
    free(dir);
    dir = NULL;
    set_free(&ft);

    // lora_plain/ (and the same files nested one level down in lora_nested/)
    fx_adapter_cfg plain = {.base = "llmerge-fixtures/base", .peft_type = "LORA", .r = 8,
                            .alpha = 16, .targets = QV, .n_targets = 2};
    TRY(add_lora_linears(&ad, &LLAMA, &base, &plain, 10, 0, err));
    TRY(fresh_dir(root, "lora_plain", &dir, err));
    TRY(save_adapter(dir, &ad, LM_DTYPE_F32, &plain, err));
    free(dir);
    dir = NULL;
    TRY(fresh_dir(root, "lora_nested", &dir, err));
    free(dir);
    dir = NULL;
    TRY(fresh_dir(root, "lora_nested/checkpoint-100", &dir, err));
    TRY(save_adapter(dir, &ad, LM_DTYPE_F32, &plain, err));
    free(dir);
    dir = NULL;
    set_free(&ad);

    // lora_rslora/: all linears, rsLoRA, a rank pattern and an alpha pattern, BF16
    fx_adapter_cfg rs = {.base = "llmerge-fixtures/base", .peft_type = "LORA", .r = 8,
                         .alpha = 8, .targets = ALL_LINEAR, .n_targets = 7,
                         .rank_key = "model.layers.1.self_attn.v_proj", .rank_r = 4,
                         .alpha_key = "v_proj", .alpha_a = 32, .rslora = true};
    TRY(add_lora_linears(&ad, &LLAMA, &base, &rs, 11, 0, err));
    TRY(fresh_dir(root, "lora_rslora", &dir, err));
    TRY(save_adapter(dir, &ad, LM_DTYPE_BF16, &rs, err));
    free(dir);
    dir = NULL;
    set_free(&ad);

    // lora_dora/: DoRA on q and v, F32
    fx_adapter_cfg dora = {.base = "llmerge-fixtures/base", .peft_type = "LORA", .r = 8,
                           .alpha = 16, .targets = QV, .n_targets = 2, .dora = true};
    TRY(add_lora_linears(&ad, &LLAMA, &base, &dora, 12, 0, err));
    TRY(fresh_dir(root, "lora_dora", &dir, err));
    TRY(save_adapter(dir, &ad, LM_DTYPE_F32, &dora, err));
    free(dir);
    dir = NULL;
    set_free(&ad);

    // lora_mts/: LoRA on embed_tokens and q_proj, lm_head saved whole, BF16
    {
        fx_adapter_cfg mts = {.base = "llmerge-fixtures/base", .peft_type = "LORA", .r = 4,
                              .alpha = 8, .targets = EMB_Q, .n_targets = 2,
                              .modules_to_save = "lm_head"};
        fx_tensor *t = set_add(&ad, mts.r, LLAMA.vocab,
                               "base_model.model.model.embed_tokens.lora_embedding_A");
        if (!t) {
            s = lm_err_set(err, LM_ERR_NOMEM, "out of memory");
            goto fail;
        }
        fill_normal(t, 13, 0, 0.5);
        t = set_add(&ad, LLAMA.hidden, mts.r, "base_model.model.model.embed_tokens.lora_embedding_B");
        if (!t) {
            s = lm_err_set(err, LM_ERR_NOMEM, "out of memory");
            goto fail;
        }
        fill_normal(t, 13, 0, 0.01);
        TRY(add_lora_linears(&ad, &LLAMA, &base, &mts, 13, 0, err));
        const fx_tensor *head = set_find(&base, "lm_head.weight");
        t = set_add(&ad, LLAMA.vocab, LLAMA.hidden, "base_model.model.lm_head.weight");
        if (!t || !head) {
            s = lm_err_set(err, LM_ERR_NOMEM, "out of memory");
            goto fail;
        }
        fill_normal(t, 13, 0, 0.004);
        for (int64_t i = 0; i < t->numel; i++)
            t->v[i] += head->v[i];
        TRY(fresh_dir(root, "lora_mts", &dir, err));
        TRY(save_adapter(dir, &ad, LM_DTYPE_BF16, &mts, err));
        free(dir);
        dir = NULL;
        set_free(&ad);
    }

    // broken/: inputs every one of which must fail with a clear message
    TRY(fresh_dir(root, "broken", &dir, err));
    free(dir);
    dir = NULL;
    {
        // a model whose index names a shard that is not there
        static const char *const keep[] = {"config.json", "model.safetensors.index.json",
                                           "model-00001-of-00002.safetensors"};
        TRY(fresh_dir(root, "broken/missing_shard", &dir, err));
        for (int i = 0; i < 3; i++) {
            char *src = lm_strfmt("%s/base/%s", root, keep[i]);
            char *dst = lm_path_join(dir, keep[i]);
            s = src && dst ? lm_copy_file(src, dst, err) : lm_err_set(err, LM_ERR_NOMEM, "oom");
            free(src);
            free(dst);
            if (s != LM_OK)
                goto fail;
        }
        free(dir);
        dir = NULL;
    }
    {
        // an adapter saved as a torch pickle only (bytes that start like a zip, as torch's do)
        TRY(fresh_dir(root, "broken/adapter_bin", &dir, err));
        TRY(save_adapter_config(dir, &plain, err));
        unsigned char pickle[256] = {'P', 'K', 3, 4};
        fx_rng r = {99};
        for (size_t i = 4; i < sizeof pickle; i++)
            pickle[i] = (unsigned char)(rng_u64(&r) >> 56);
        char *p = lm_path_join(dir, "adapter_model.bin");
        s = p ? lm_write_file(p, pickle, sizeof pickle, err) : lm_err_set(err, LM_ERR_NOMEM, "oom");
        free(p);
        if (s != LM_OK)
            goto fail;
        free(dir);
        dir = NULL;
    }
    {
        // an adapter whose layer-0 q_proj lora_A has in-dim 48, not the base's 64
        TRY(add_lora_linears(&ad, &LLAMA, &base, &plain, 14, 48, err));
        TRY(fresh_dir(root, "broken/lora_bad_shape", &dir, err));
        TRY(save_adapter(dir, &ad, LM_DTYPE_F32, &plain, err));
        free(dir);
        dir = NULL;
        set_free(&ad);
    }
    {
        // an adapter of another PEFT method
        fx_adapter_cfg ia3 = plain;
        ia3.peft_type = "IA3";
        fx_tensor *t = set_add(&ad, 32, -1, "base_model.model.model.layers.0.self_attn.k_proj.ia3_l");
        if (!t) {
            s = lm_err_set(err, LM_ERR_NOMEM, "out of memory");
            goto fail;
        }
        fill_normal(t, 15, 1, 0.01);
        TRY(fresh_dir(root, "broken/peft_ia3", &dir, err));
        TRY(save_adapter(dir, &ad, LM_DTYPE_F32, &ia3, err));
        free(dir);
        dir = NULL;
        set_free(&ad);
    }
    {
        // a safetensors file cut short: its header promises 10 bytes more than there are
        fx_tensor *t = set_add(&ad, 4, 8, "model.norm.weight");
        if (!t) {
            s = lm_err_set(err, LM_ERR_NOMEM, "out of memory");
            goto fail;
        }
        fill_normal(t, 16, 0, 1);
        char *broken = lm_path_join(root, "broken");
        s = broken ? set_save(&ad, LM_DTYPE_F32, broken, "bad.safetensors.full", 0, 1, err)
                   : lm_err_set(err, LM_ERR_NOMEM, "oom");
        char *full = lm_strfmt("%s/bad.safetensors.full", broken ? broken : "");
        char *cut = lm_strfmt("%s/bad.safetensors", broken ? broken : "");
        char *bytes = NULL;
        size_t len = 0;
        if (s == LM_OK)
            s = lm_read_file(full, 1 << 20, &bytes, &len, err);
        if (s == LM_OK)
            s = lm_write_file(cut, bytes, len - 10, err);
        if (full && broken)
            unlink(full);
        free(bytes);
        free(full);
        free(cut);
        free(broken);
        if (s != LM_OK)
            goto fail;
        set_free(&ad);
    }

fail:
    free(dir);
    set_free(&base);
    set_free(&ft);
    set_free(&ad);
    return s;
}

static lm_status gen_qwen(const char *root, lm_err *err)
{
    lm_status s = LM_OK;
    fx_set base = {0}, ad = {0}, ft = {0};
    char *dir = NULL;

    // qwen/: Qwen2 layout (q/k/v biases, tied embeddings), F32, one shard
    TRY(make_model(&base, &QWEN, 20, err));
    TRY(fresh_dir(root, "qwen", &dir, err));
    TRY(save_config(dir, &QWEN, "float32", err));
    TRY(save_side_files(dir, err));
    TRY(set_save(&base, LM_DTYPE_F32, dir, NULL, 5000000000ull, 1, err));
    free(dir);
    dir = NULL;

    // qwen_ft/: a full fine-tune of qwen/, every tensor changed (its biases and the tied
    // embedding too), F32, one shard
    TRY(make_finetune(&ft, &base, 22, 0.002, err));
    TRY(fresh_dir(root, "qwen_ft", &dir, err));
    TRY(save_config(dir, &QWEN, "float32", err));
    TRY(save_side_files(dir, err));
    TRY(set_save(&ft, LM_DTYPE_F32, dir, NULL, 5000000000ull, 1, err));
    free(dir);
    dir = NULL;

    // lora_bias/: LoRA on q, k, v with lora_bias
    fx_adapter_cfg c = {.base = "llmerge-fixtures/qwen", .peft_type = "LORA", .r = 8, .alpha = 16,
                        .targets = QKV, .n_targets = 3, .lora_bias = true};
    TRY(add_lora_linears(&ad, &QWEN, &base, &c, 21, 0, err));
    TRY(fresh_dir(root, "lora_bias", &dir, err));
    TRY(save_adapter(dir, &ad, LM_DTYPE_F32, &c, err));

fail:
    free(dir);
    set_free(&base);
    set_free(&ad);
    set_free(&ft);
    return s;
}

// llama3/: a Llama 3 style model (LLAMA3 above), F16, one shard, no adapters.
static lm_status gen_llama3(const char *root, lm_err *err)
{
    lm_status s = LM_OK;
    fx_set m = {0};
    char *dir = NULL;
    TRY(make_model(&m, &LLAMA3, 40, err));
    TRY(fresh_dir(root, "llama3", &dir, err));
    TRY(save_config(dir, &LLAMA3, "float16", err));
    TRY(set_save(&m, LM_DTYPE_F16, dir, NULL, 5000000000ull, 1, err));
fail:
    free(dir);
    set_free(&m);
    return s;
}

// odd/: inputs with tensors llmerge cannot compute with, tensors the base does not have, and
// NaN or Inf values (testdata/README.md lists each). Built from the same streams as base/,
// ft_full/, qwen/ and lora_plain/, so each differs from its model only where it says.
static lm_status odd_model(const char *root, const char *name, fx_set *set, const fx_arch *a, const char *torch_dtype,
                           lm_dtype dt, lm_err *err)
{
    char *dir = NULL;
    lm_status s = fresh_dir(root, name, &dir, err);
    if (s == LM_OK)
        s = save_config(dir, a, torch_dtype, err);
    if (s == LM_OK)
        s = set_save(set, dt, dir, NULL, 5000000000ull, 1, err);
    free(dir);
    return s;
}

// Gives tensor `name` of `set` its own dtype; false when the set has no such tensor.
static bool odd_dtype(fx_set *set, const char *name, lm_dtype dt)
{
    fx_tensor *t = set_find(set, name);
    if (t) {
        t->own_dtype = true;
        t->dtype = dt;
    }
    return t != NULL;
}

// Sets element i of tensor `name` to the float whose bits are `bits` (a NaN or an Inf).
static bool odd_value(fx_set *set, const char *name, int64_t i, uint32_t bits)
{
    fx_tensor *t = set_find(set, name);
    if (t && i < t->numel)
        t->v[i] = lm_bits_f32(bits);
    return t && i < t->numel;
}

#define NAN_BITS 0x7FC00000u
#define INF_BITS 0x7F800000u
#define NINF_BITS 0xFF800000u
#define Q0 "model.layers.0.self_attn.q_proj.weight"

static lm_status gen_odd(const char *root, lm_err *err)
{
    lm_status s = LM_OK;
    fx_set base = {0}, ft = {0}, ad = {0}, q = {0};
    char *dir = NULL;
    TRY(fresh_dir(root, "odd", &dir, err));
    free(dir);
    dir = NULL;
    TRY(make_model(&base, &LLAMA, 1, err));
    TRY(set_round(&base, LM_DTYPE_BF16, err));

    // ft_i32/, ft_f8/: ft_full/ with its final norm in a dtype llmerge cannot compute with
    TRY(make_finetune(&ft, &base, 2, 0.002, err));
    TRY(set_round(&ft, LM_DTYPE_BF16, err));
    if (!odd_dtype(&ft, "model.norm.weight", LM_DTYPE_I32))
        goto missing;
    TRY(odd_model(root, "odd/ft_i32", &ft, &LLAMA, "bfloat16", LM_DTYPE_BF16, err));
    odd_dtype(&ft, "model.norm.weight", LM_DTYPE_F8_E4M3);
    TRY(odd_model(root, "odd/ft_f8", &ft, &LLAMA, "bfloat16", LM_DTYPE_BF16, err));
    set_free(&ft);

    // base_u8/: base/ in one shard with layer 0's q_proj in U8 (lora_plain/ changes it);
    // ft_u8/: ft_full/ with the same U8 q_proj, equal to the base's
    if (!odd_dtype(&base, Q0, LM_DTYPE_U8))
        goto missing;
    TRY(odd_model(root, "odd/base_u8", &base, &LLAMA, "bfloat16", LM_DTYPE_BF16, err));
    TRY(make_finetune(&ft, &base, 2, 0.002, err));
    TRY(set_round(&ft, LM_DTYPE_BF16, err));
    memcpy(set_find(&ft, Q0)->v, set_find(&base, Q0)->v, (size_t)set_find(&base, Q0)->numel * sizeof(float));
    odd_dtype(&ft, Q0, LM_DTYPE_U8);
    TRY(odd_model(root, "odd/ft_u8", &ft, &LLAMA, "bfloat16", LM_DTYPE_BF16, err));
    set_free(&ft);
    set_find(&base, Q0)->own_dtype = false;

    // ft_extra/: ft_full/ plus a rotary buffer the base does not have
    TRY(make_finetune(&ft, &base, 2, 0.002, err));
    fx_tensor *t = set_add(&ft, LLAMA.head_dim / 2, -1, "model.layers.0.self_attn.rotary_emb.inv_freq");
    if (!t) {
        s = lm_err_set(err, LM_ERR_NOMEM, "out of memory");
        goto fail;
    }
    for (int64_t i = 0; i < t->numel; i++)
        t->v[i] = 1.0f / (float)(1 << i);
    TRY(odd_model(root, "odd/ft_extra", &ft, &LLAMA, "bfloat16", LM_DTYPE_BF16, err));
    set_free(&ft);

    // ft_nonfinite/: ft_full/ with 3 NaN in layer 0's down_proj and +Inf, -Inf in layer 1's o_proj
    TRY(make_finetune(&ft, &base, 2, 0.002, err));
    for (int64_t i = 0; i < 3; i++)
        if (!odd_value(&ft, "model.layers.0.mlp.down_proj.weight", 10 * i, NAN_BITS))
            goto missing;
    if (!odd_value(&ft, "model.layers.1.self_attn.o_proj.weight", 5, INF_BITS) ||
        !odd_value(&ft, "model.layers.1.self_attn.o_proj.weight", 6, NINF_BITS))
        goto missing;
    TRY(odd_model(root, "odd/ft_nonfinite", &ft, &LLAMA, "bfloat16", LM_DTYPE_BF16, err));
    set_free(&ft);

    // lora_nan/: lora_plain/ with a NaN in layer 0's q_proj lora_A (a whole column of its delta)
    fx_adapter_cfg plain = {.base = "llmerge-fixtures/base", .peft_type = "LORA", .r = 8,
                            .alpha = 16, .targets = QV, .n_targets = 2};
    TRY(add_lora_linears(&ad, &LLAMA, &base, &plain, 10, 0, err));
    if (!odd_value(&ad, "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", 3, NAN_BITS))
        goto missing;
    TRY(fresh_dir(root, "odd/lora_nan", &dir, err));
    TRY(save_adapter(dir, &ad, LM_DTYPE_F32, &plain, err));
    free(dir);
    dir = NULL;

    // base_inf/: base/ in one shard with +Inf in layer 0's up_proj
    if (!odd_value(&base, "model.layers.0.mlp.up_proj.weight", 7, INF_BITS))
        goto missing;
    TRY(odd_model(root, "odd/base_inf", &base, &LLAMA, "bfloat16", LM_DTYPE_BF16, err));

    // qwen_head/: a fine-tune of qwen/ (tied embeddings) that saved an lm_head of its own
    TRY(make_model(&q, &QWEN, 20, err));
    TRY(make_finetune(&ft, &q, 22, 0.002, err));
    t = set_add(&ft, QWEN.vocab, QWEN.hidden, "lm_head.weight");
    if (!t) {
        s = lm_err_set(err, LM_ERR_NOMEM, "out of memory");
        goto fail;
    }
    fill_normal(t, 22, 0, 0.02);
    TRY(odd_model(root, "odd/qwen_head", &ft, &QWEN, "float32", LM_DTYPE_F32, err));
    goto fail;
missing:
    s = lm_err_set(err, LM_ERR_NOT_FOUND, "odd/: a tensor the fixtures change is missing");
fail:
    free(dir);
    set_free(&base);
    set_free(&ft);
    set_free(&ad);
    set_free(&q);
    return s;
}

// `n` token sequences drawn from the stream `seed` (lengths 8 to 32, ids below 256, each
// starting with BOS = 1), appended as JSON Lines to jl and, when txt is not NULL, as text.
static void add_sequences(fx_text *jl, fx_text *txt, uint64_t seed, int n)
{
    fx_rng r = {seed};
    for (int line = 0; line < n; line++) {
        int len = 8 + (int)(rng_u64(&r) % 25);
        text_add(jl, "{\"input_ids\": [");
        for (int i = 0; i < len; i++) {
            int id = i == 0 ? 1 : 3 + (int)(rng_u64(&r) % 253);
            text_add(jl, i ? ", %d" : "%d", id);
            if (txt)
                text_add(txt, i ? " %d" : "%d", id);
        }
        text_add(jl, "]}\n");
        if (txt)
            text_add(txt, "\n");
    }
}

// calib/: the same 8 sequences as JSON Lines and as text (calib.jsonl, calib.txt), and 8 other
// sequences of the same kind from another stream (heldout.jsonl), to evaluate on data that no
// calibration saw.
static lm_status gen_calib(const char *root, lm_err *err)
{
    lm_status s = LM_OK;
    fx_text jl = {0}, txt = {0}, held = {0};
    char *dir = NULL;
    add_sequences(&jl, &txt, 30, 8);
    add_sequences(&held, NULL, 31, 8);
    TRY(fresh_dir(root, "calib", &dir, err));
    TRY(text_save(&jl, dir, "calib.jsonl", err));
    TRY(text_save(&txt, dir, "calib.txt", err));
    TRY(text_save(&held, dir, "heldout.jsonl", err));
fail:
    free(jl.p);
    free(txt.p);
    free(held.p);
    free(dir);
    return s;
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: gen_fixtures OUTDIR\n");
        return 2;
    }
    const char *root = argv[1];
    lm_err err = {0};
    lm_status s = lm_mkdir_p(root, &err);
    if (s == LM_OK)
        s = gen_llama(root, &err);
    if (s == LM_OK)
        s = gen_qwen(root, &err);
    if (s == LM_OK)
        s = gen_calib(root, &err);
    if (s == LM_OK)
        s = gen_llama3(root, &err);
    if (s == LM_OK)
        s = gen_odd(root, &err);
    if (s != LM_OK) {
        fprintf(stderr, "gen_fixtures: %s\n", err.msg);
        return 1;
    }
    return 0;
}
