// Tests of config.json parsing (lib/config.c), the architecture description (lib/arch.c) and
// model directories (lib/model.c): old and new key names, defaults, derived biases, head_dim
// given or not, every config error naming its key (numbers out of a key's range among them, and
// the JSON reader's refusals: a byte order mark, a key twice), Llama 3 rope frequencies against
// values computed here in double from the formula, the tensor list of each architecture, single
// and sharded checkpoints with lookups across shards, each way an index and its shards can
// disagree (text after the index's object, a shard that is a directory or a FIFO), and a
// config.json with a byte order mark refused when the model is opened. Every test writes its
// own files (config.json text, and safetensors bytes laid out by a small writer here,
// independent of lib/st_writer.c) into a fresh directory under /tmp.
#include <math.h>
#include <stdint.h>
#include <sys/stat.h>
#include <unistd.h>

#include "arch.h"
#include "check.h"
#include "fixture.h"
#include "testfs.h"
#include "config.h"
#include "model.h"
#include "util.h"

// ==== helpers =================================================================================

// The config.json of fixture.h's tiny Llama (fixture_tiny_llama has its tensors): 2 layers,
// hidden 8, intermediate 12, 2 heads of 4, 1 kv head, vocab 16.
#define TINY_LLAMA_CONFIG                                                                          \
    "{\"architectures\": [\"LlamaForCausalLM\"], \"model_type\": \"llama\", \"hidden_size\": 8, "  \
    "\"intermediate_size\": 12, \"num_hidden_layers\": 2, \"num_attention_heads\": 2, "            \
    "\"num_key_value_heads\": 1, \"vocab_size\": 16, \"rms_norm_eps\": 1e-05, "                    \
    "\"torch_dtype\": \"float32\", \"tie_word_embeddings\": false}"

static int cmp_tt_name(const void *a, const void *b)
{
    return strcmp(((const fixture_tensor *)a)->name, ((const fixture_tensor *)b)->name);
}

static lm_status parse(lm_config *cfg, const char *json, lm_err *err)
{
    return lm_config_parse(cfg, json, strlen(json), "test/config.json", err);
}

// ==== config ==================================================================================

static void test_config_llama_old_keys(void)
{
    lm_config c;
    lm_err err;
    CHECK_OK(parse(&c,
                   "{\"architectures\": [\"LlamaForCausalLM\"], \"model_type\": \"llama\", "
                   "\"hidden_size\": 4096, \"intermediate_size\": 14336, \"num_hidden_layers\": 32, "
                   "\"num_attention_heads\": 32, \"num_key_value_heads\": 8, \"vocab_size\": 128256, "
                   "\"rms_norm_eps\": 1e-05, \"rope_theta\": 500000.0, \"max_position_embeddings\": 131072, "
                   "\"rope_scaling\": {\"factor\": 8.0, \"low_freq_factor\": 1.0, \"high_freq_factor\": 4.0, "
                   "\"original_max_position_embeddings\": 8192, \"rope_type\": \"llama3\"}, "
                   "\"tie_word_embeddings\": false, \"torch_dtype\": \"bfloat16\", "
                   "\"attention_bias\": false, \"mlp_bias\": false, \"unknown_field\": [1, 2]}",
                   &err), &err);
    CHECK(c.arch == LM_ARCH_LLAMA);
    CHECK(strcmp(c.architecture, "LlamaForCausalLM") == 0);
    CHECK(strcmp(c.model_type, "llama") == 0);
    CHECK(c.hidden_size == 4096 && c.intermediate_size == 14336 && c.num_hidden_layers == 32);
    CHECK(c.num_attention_heads == 32 && c.num_key_value_heads == 8);
    CHECK(c.head_dim == 128 && !c.head_dim_given);
    CHECK(c.vocab_size == 128256 && c.max_position_embeddings == 131072);
    CHECK(c.rms_norm_eps == 1e-5 && c.rope_theta == 500000.0);
    CHECK(c.rope_scaling.kind == LM_ROPE_LLAMA3 && strcmp(c.rope_scaling.type, "llama3") == 0);
    CHECK(c.rope_scaling.factor == 8.0 && c.rope_scaling.low_freq_factor == 1.0);
    CHECK(c.rope_scaling.high_freq_factor == 4.0);
    CHECK(c.rope_scaling.original_max_position_embeddings == 8192);
    CHECK(!c.tie_word_embeddings);
    CHECK(c.has_dtype && c.dtype == LM_DTYPE_BF16 && strcmp(c.dtype_name, "bfloat16") == 0);
    CHECK(!c.q_bias && !c.k_bias && !c.v_bias && !c.o_bias && !c.gate_bias);
    lm_config_free(&c);
    lm_config_free(&c);  // freeing twice is harmless: the first zeroed it
}

static void test_config_new_keys_and_defaults(void)
{
    lm_config c;
    lm_err err;
    // transformers 5: "dtype", rope inside rope_parameters, null kv heads and head_dim.
    CHECK_OK(parse(&c,
                   "{\"architectures\": [\"LlamaForCausalLM\"], \"hidden_size\": 64, "
                   "\"intermediate_size\": 128, \"num_hidden_layers\": 2, \"num_attention_heads\": 4, "
                   "\"num_key_value_heads\": null, \"head_dim\": null, \"vocab_size\": 100, "
                   "\"dtype\": \"float16\", \"rope_parameters\": {\"rope_theta\": 250000.0, "
                   "\"rope_type\": \"llama3\", \"factor\": 32.0, \"low_freq_factor\": 1.0, "
                   "\"high_freq_factor\": 4.0, \"original_max_position_embeddings\": 8192}}",
                   &err), &err);
    CHECK(c.num_key_value_heads == 4 && c.head_dim == 16 && !c.head_dim_given);
    CHECK(c.has_dtype && c.dtype == LM_DTYPE_F16);
    CHECK(c.rope_theta == 250000.0);
    CHECK(c.rope_scaling.kind == LM_ROPE_LLAMA3 && c.rope_scaling.factor == 32.0);
    CHECK(c.rope_scaling.original_max_position_embeddings == 8192);
    // Defaults: LlamaConfig's.
    CHECK(c.rms_norm_eps == 1e-6);
    CHECK(c.max_position_embeddings == 2048);
    CHECK(!c.tie_word_embeddings && !c.attention_bias && !c.mlp_bias);
    lm_config_free(&c);

    // rope_parameters with rope_type "default" and no theta key at top level.
    CHECK_OK(parse(&c,
                   "{\"architectures\": [\"MistralForCausalLM\"], \"hidden_size\": 64, "
                   "\"intermediate_size\": 128, \"num_hidden_layers\": 2, \"num_attention_heads\": 4, "
                   "\"num_key_value_heads\": 2, \"vocab_size\": 100, "
                   "\"rope_parameters\": {\"rope_type\": \"default\", \"rope_theta\": 1000000.0}}",
                   &err), &err);
    CHECK(c.arch == LM_ARCH_MISTRAL);
    CHECK(c.rope_theta == 1000000.0 && c.rope_scaling.kind == LM_ROPE_DEFAULT);
    CHECK(c.max_position_embeddings == 131072);
    CHECK(!c.has_dtype && c.dtype_name == NULL);
    lm_config_free(&c);

    // No rope keys at all: theta 10000. Both dtype names: "dtype" wins.
    CHECK_OK(parse(&c,
                   "{\"architectures\": [\"LlamaForCausalLM\"], \"hidden_size\": 64, "
                   "\"intermediate_size\": 128, \"num_hidden_layers\": 2, \"num_attention_heads\": 4, "
                   "\"vocab_size\": 100, \"rope_scaling\": null, \"dtype\": \"bfloat16\", "
                   "\"torch_dtype\": \"float32\"}", &err), &err);
    CHECK(c.rope_theta == 10000.0 && c.rope_scaling.kind == LM_ROPE_DEFAULT && !c.rope_scaling.type);
    CHECK(c.dtype == LM_DTYPE_BF16);
    lm_config_free(&c);

    // Old "type" key for rope scaling; a dtype llmerge does not compute with is kept by name.
    CHECK_OK(parse(&c,
                   "{\"architectures\": [\"LlamaForCausalLM\"], \"hidden_size\": 64, "
                   "\"intermediate_size\": 128, \"num_hidden_layers\": 2, \"num_attention_heads\": 4, "
                   "\"vocab_size\": 100, \"rope_scaling\": {\"type\": \"linear\", \"factor\": 2.0}, "
                   "\"torch_dtype\": \"float8_e4m3fn\"}", &err), &err);
    CHECK(c.rope_scaling.kind == LM_ROPE_LINEAR && strcmp(c.rope_scaling.type, "linear") == 0);
    CHECK(!c.has_dtype && strcmp(c.dtype_name, "float8_e4m3fn") == 0);
    lm_config_free(&c);
}

static void test_config_biases_and_head_dim(void)
{
    lm_config c;
    lm_err err;
    // Qwen2: no attention_bias key, q/k/v biased, o not; tied embeddings as small Qwen2 set them.
    CHECK_OK(parse(&c,
                   "{\"architectures\": [\"Qwen2ForCausalLM\"], \"model_type\": \"qwen2\", "
                   "\"hidden_size\": 896, \"intermediate_size\": 4864, \"num_hidden_layers\": 24, "
                   "\"num_attention_heads\": 14, \"num_key_value_heads\": 2, \"vocab_size\": 151936, "
                   "\"rope_theta\": 1000000.0, \"tie_word_embeddings\": true, \"torch_dtype\": \"bfloat16\"}",
                   &err), &err);
    CHECK(c.arch == LM_ARCH_QWEN2);
    CHECK(c.q_bias && c.k_bias && c.v_bias && !c.o_bias);
    CHECK(!c.gate_bias && !c.up_bias && !c.down_bias);
    CHECK(c.tie_word_embeddings && c.head_dim == 64);
    CHECK(c.max_position_embeddings == 32768);
    lm_config_free(&c);

    // Qwen2 ignores attention_bias: false still means q/k/v biases.
    CHECK_OK(parse(&c,
                   "{\"architectures\": [\"Qwen2ForCausalLM\"], \"hidden_size\": 64, "
                   "\"intermediate_size\": 128, \"num_hidden_layers\": 1, \"num_attention_heads\": 4, "
                   "\"vocab_size\": 10, \"attention_bias\": false}", &err), &err);
    CHECK(c.q_bias && c.k_bias && c.v_bias && !c.o_bias);
    lm_config_free(&c);

    // Llama attention_bias: q, k, v and o; mlp_bias: gate, up, down.
    CHECK_OK(parse(&c,
                   "{\"architectures\": [\"LlamaForCausalLM\"], \"hidden_size\": 64, "
                   "\"intermediate_size\": 128, \"num_hidden_layers\": 1, \"num_attention_heads\": 4, "
                   "\"vocab_size\": 10, \"attention_bias\": true, \"mlp_bias\": true}", &err), &err);
    CHECK(c.q_bias && c.k_bias && c.v_bias && c.o_bias);
    CHECK(c.gate_bias && c.up_bias && c.down_bias);
    lm_config_free(&c);

    // Mistral has no biases whatever the file says.
    CHECK_OK(parse(&c,
                   "{\"architectures\": [\"MistralForCausalLM\"], \"hidden_size\": 64, "
                   "\"intermediate_size\": 128, \"num_hidden_layers\": 1, \"num_attention_heads\": 4, "
                   "\"vocab_size\": 10, \"attention_bias\": true}", &err), &err);
    CHECK(!c.q_bias && !c.o_bias);
    lm_config_free(&c);

    // head_dim given and different from hidden / heads (Mistral Nemo: 5120 / 32 = 160, but 128).
    CHECK_OK(parse(&c,
                   "{\"architectures\": [\"MistralForCausalLM\"], \"hidden_size\": 5120, "
                   "\"intermediate_size\": 14336, \"num_hidden_layers\": 40, \"num_attention_heads\": 32, "
                   "\"num_key_value_heads\": 8, \"head_dim\": 128, \"vocab_size\": 131072}", &err), &err);
    CHECK(c.head_dim == 128 && c.head_dim_given);
    lm_config_free(&c);

    // head_dim given lets hidden_size not divide by heads.
    CHECK_OK(parse(&c,
                   "{\"architectures\": [\"LlamaForCausalLM\"], \"hidden_size\": 100, "
                   "\"intermediate_size\": 128, \"num_hidden_layers\": 1, \"num_attention_heads\": 3, "
                   "\"head_dim\": 32, \"vocab_size\": 10}", &err), &err);
    CHECK(c.head_dim == 32);
    lm_config_free(&c);

    // No architectures: the model_type decides.
    CHECK_OK(parse(&c,
                   "{\"model_type\": \"qwen2\", \"hidden_size\": 64, \"intermediate_size\": 128, "
                   "\"num_hidden_layers\": 1, \"num_attention_heads\": 4, \"vocab_size\": 10}", &err), &err);
    CHECK(c.arch == LM_ARCH_QWEN2 && c.q_bias);
    lm_config_free(&c);
}

static void test_config_unknown_arch(void)
{
    lm_config c;
    lm_err err;
    // Parsed leniently: what fits is recorded, the rest skipped, no required keys.
    CHECK_OK(parse(&c,
                   "{\"architectures\": [\"GPT2LMHeadModel\"], \"model_type\": \"gpt2\", "
                   "\"n_embd\": 768, \"vocab_size\": 50257, \"intermediate_size\": [1, 2], "
                   "\"num_attention_heads\": \"twelve\", \"tie_word_embeddings\": \"yes\", "
                   "\"rope_scaling\": 3, \"torch_dtype\": \"float32\"}", &err), &err);
    CHECK(c.arch == LM_ARCH_UNKNOWN);
    CHECK(strcmp(c.architecture, "GPT2LMHeadModel") == 0);
    CHECK(c.vocab_size == 50257 && c.hidden_size == 0 && c.intermediate_size == 0);
    CHECK(c.num_attention_heads == 0 && !c.tie_word_embeddings);
    CHECK(c.has_dtype && c.dtype == LM_DTYPE_F32);
    CHECK(strcmp(lm_arch_name(c.arch), "unknown") == 0);
    lm_config_free(&c);

    CHECK_OK(parse(&c, "{}", &err), &err);
    CHECK(c.arch == LM_ARCH_UNKNOWN && !c.architecture && !c.model_type);
    lm_config_free(&c);
}

static void test_config_errors(void)
{
    static const struct { const char *json; lm_status want; const char *needle; } cases[] = {
        {"not json", LM_ERR_FORMAT, "not valid JSON"},
        {"[1, 2]", LM_ERR_FORMAT, "expected a JSON object"},
        {"{\"hidden_size\": 1} x", LM_ERR_FORMAT, "text after"},
        {"{\"architectures\": \"LlamaForCausalLM\"}", LM_ERR_FORMAT, "'architectures'"},
        {"{\"architectures\": [\"LlamaForCausalLM\"], \"intermediate_size\": 128, "
         "\"num_hidden_layers\": 1, \"num_attention_heads\": 4, \"vocab_size\": 10}",
         LM_ERR_FORMAT, "key 'hidden_size' is missing"},
        {"{\"architectures\": [\"LlamaForCausalLM\"], \"hidden_size\": \"64\", \"intermediate_size\": 128, "
         "\"num_hidden_layers\": 1, \"num_attention_heads\": 4, \"vocab_size\": 10}",
         LM_ERR_FORMAT, "key 'hidden_size' must be an integer, not a string"},
        {"{\"architectures\": [\"LlamaForCausalLM\"], \"hidden_size\": 64.5, \"intermediate_size\": 128, "
         "\"num_hidden_layers\": 1, \"num_attention_heads\": 4, \"vocab_size\": 10}",
         LM_ERR_FORMAT, "'hidden_size' must be an integer"},
        {"{\"architectures\": [\"LlamaForCausalLM\"], \"hidden_size\": 64, \"intermediate_size\": 128, "
         "\"num_hidden_layers\": 0, \"num_attention_heads\": 4, \"vocab_size\": 10}",
         LM_ERR_FORMAT, "'num_hidden_layers' must be positive, not 0"},
        {"{\"architectures\": [\"LlamaForCausalLM\"], \"hidden_size\": 64, \"intermediate_size\": -1, "
         "\"num_hidden_layers\": 1, \"num_attention_heads\": 4, \"vocab_size\": 10}",
         LM_ERR_FORMAT, "'intermediate_size' must be positive"},
        {"{\"architectures\": [\"LlamaForCausalLM\"], \"hidden_size\": 64, \"intermediate_size\": 128, "
         "\"num_hidden_layers\": 1, \"num_attention_heads\": 4, \"num_key_value_heads\": 3, \"vocab_size\": 10}",
         LM_ERR_FORMAT, "num_attention_heads (4) is not a multiple of num_key_value_heads (3)"},
        {"{\"architectures\": [\"LlamaForCausalLM\"], \"hidden_size\": 66, \"intermediate_size\": 128, "
         "\"num_hidden_layers\": 1, \"num_attention_heads\": 4, \"vocab_size\": 10}",
         LM_ERR_FORMAT, "hidden_size (66) is not a multiple of num_attention_heads (4)"},
        {"{\"architectures\": [\"LlamaForCausalLM\"], \"hidden_size\": 64, \"intermediate_size\": 128, "
         "\"num_hidden_layers\": 1, \"num_attention_heads\": 4, \"head_dim\": 0, \"vocab_size\": 10}",
         LM_ERR_FORMAT, "'head_dim' must be a positive even number"},
        {"{\"architectures\": [\"LlamaForCausalLM\"], \"hidden_size\": 64, \"intermediate_size\": 128, "
         "\"num_hidden_layers\": 1, \"num_attention_heads\": 4, \"vocab_size\": 10, "
         "\"tie_word_embeddings\": \"true\"}",
         LM_ERR_FORMAT, "key 'tie_word_embeddings' must be true or false, not a string"},
        {"{\"architectures\": [\"LlamaForCausalLM\"], \"hidden_size\": 64, \"intermediate_size\": 128, "
         "\"num_hidden_layers\": 1, \"num_attention_heads\": 4, \"vocab_size\": 10, \"rms_norm_eps\": \"x\"}",
         LM_ERR_FORMAT, "'rms_norm_eps' must be a number"},
        {"{\"architectures\": [\"LlamaForCausalLM\"], \"hidden_size\": 64, \"intermediate_size\": 128, "
         "\"num_hidden_layers\": 1, \"num_attention_heads\": 4, \"vocab_size\": 10, "
         "\"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": 8.0, \"high_freq_factor\": 4.0, "
         "\"original_max_position_embeddings\": 8192}}",
         LM_ERR_FORMAT, "'rope_scaling.low_freq_factor' is missing"},
        {"{\"architectures\": [\"LlamaForCausalLM\"], \"hidden_size\": 64, \"intermediate_size\": 128, "
         "\"num_hidden_layers\": 1, \"num_attention_heads\": 4, \"vocab_size\": 10, "
         "\"rope_parameters\": {\"rope_type\": \"linear\"}}",
         LM_ERR_FORMAT, "'rope_parameters.factor' is missing"},
        {"{\"architectures\": [\"LlamaForCausalLM\"], \"hidden_size\": 64, \"intermediate_size\": 128, "
         "\"num_hidden_layers\": 1, \"num_attention_heads\": 4, \"vocab_size\": 10, \"rope_scaling\": \"x\"}",
         LM_ERR_FORMAT, "key 'rope_scaling' must be an object"},
        {"{\"architectures\": [\"LlamaForCausalLM\"], \"hidden_size\": 64, \"intermediate_size\": 128, "
         "\"num_hidden_layers\": 1, \"num_attention_heads\": 4, \"vocab_size\": 10, \"rope_theta\": 0}",
         LM_ERR_FORMAT, "'rope_theta' must be positive"},
        {"{\"architectures\": [\"LlamaForCausalLM\"], \"hidden_size\": 64, \"intermediate_size\": 128, "
         "\"num_hidden_layers\": 1, \"num_attention_heads\": 4, \"vocab_size\": 10, \"torch_dtype\": 16}",
         LM_ERR_FORMAT, "'torch_dtype' must be a string"},
        // Numbers beyond what the key can hold are out of range, not of the wrong type.
        {"{\"architectures\": [\"LlamaForCausalLM\"], \"hidden_size\": 9223372036854775808, "
         "\"intermediate_size\": 128, \"num_hidden_layers\": 1, \"num_attention_heads\": 4, \"vocab_size\": 10}",
         LM_ERR_FORMAT, "key 'hidden_size': 9223372036854775808 is out of range (at most 9007199254740992)"},
        {"{\"architectures\": [\"LlamaForCausalLM\"], \"hidden_size\": 64, \"intermediate_size\": 128, "
         "\"num_hidden_layers\": 1, \"num_attention_heads\": 4, \"vocab_size\": -1e19}",
         LM_ERR_FORMAT, "key 'vocab_size': -1e19 is out of range"},
        {"{\"architectures\": [\"LlamaForCausalLM\"], \"hidden_size\": 64, \"intermediate_size\": 128, "
         "\"num_hidden_layers\": 1, \"num_attention_heads\": 4, \"vocab_size\": 10, \"rms_norm_eps\": 1e400}",
         LM_ERR_FORMAT, "'rms_norm_eps': 1e400 is out of range"},
        // The one JSON reader's rules: a byte order mark, a duplicate key, bad UTF-8.
        {"\xEF\xBB\xBF{\"architectures\": [\"LlamaForCausalLM\"]}", LM_ERR_FORMAT,
         "starts with a UTF-8 byte order mark"},
        {"{\"hidden_size\": 64,\n \"hidden_size\": 32}", LM_ERR_FORMAT,
         "key 'hidden_size' appears twice (line 2, column 2"},
        {"{\"model_type\": \"llama\xff\"}", LM_ERR_FORMAT, "not valid UTF-8"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        lm_config c;
        lm_err err = {0};
        CHECK_FAILS(parse(&c, cases[i].json, &err), cases[i].want, cases[i].needle, &err);
        CHECK_MSG(strstr(err.msg, "test/config.json") != NULL, "case %zu: %s", i, err.msg);
        CHECK(c.path == NULL && c.architecture == NULL);  // nothing left to free
        lm_config_free(&c);
    }

    // A missing file names it.
    lm_config c;
    lm_err err;
    CHECK_FAILS(lm_config_load(&c, "/nonexistent/config.json", &err), LM_ERR_NOT_FOUND,
                "/nonexistent/config.json", &err);
}

// ==== rope ====================================================================================

// The reference, written from docs/formats.md "config.json" independently of the code under test.
static double ref_llama3(double theta, int d, int i, double factor, double low, double high, double orig)
{
    double f = 1.0 / pow(theta, 2.0 * i / d);
    double wavelen = 2.0 * 3.14159265358979323846 / f;
    if (wavelen < orig / high)
        return f;
    if (wavelen > orig / low)
        return f / factor;
    double s = (orig / wavelen - low) / (high - low);
    return (1 - s) * f / factor + s * f;
}

static void test_rope(void)
{
    lm_config c;
    lm_err err;
    // Llama 3.1 8B's rope: every one of the three regions is crossed by head_dim 128.
    CHECK_OK(parse(&c,
                   "{\"architectures\": [\"LlamaForCausalLM\"], \"hidden_size\": 4096, "
                   "\"intermediate_size\": 14336, \"num_hidden_layers\": 1, \"num_attention_heads\": 32, "
                   "\"num_key_value_heads\": 8, \"vocab_size\": 10, \"rope_theta\": 500000.0, "
                   "\"rope_scaling\": {\"factor\": 8.0, \"low_freq_factor\": 1.0, \"high_freq_factor\": 4.0, "
                   "\"original_max_position_embeddings\": 8192, \"rope_type\": \"llama3\"}}",
                   &err), &err);
    double got[64];
    CHECK_OK(lm_config_rope_inv_freq(&c, got, &err), &err);
    int kept = 0, divided = 0, smoothed = 0;
    for (int i = 0; i < 64; i++) {
        double plain = 1.0 / pow(500000.0, 2.0 * i / 128);
        double want = ref_llama3(500000.0, 128, i, 8.0, 1.0, 4.0, 8192.0);
        CHECK_MSG(fabs(got[i] - want) <= 1e-15 * fabs(want), "i=%d got %.17g want %.17g", i, got[i], want);
        if (want == plain) kept++;
        else if (fabs(want - plain / 8.0) <= 1e-18) divided++;
        else smoothed++;
    }
    CHECK_MSG(kept > 0 && divided > 0 && smoothed > 0, "kept %d divided %d smoothed %d", kept,
              divided, smoothed);
    // Spot values worked out by hand: i = 0 is 1 (kept); the last is divided by 8.
    CHECK(got[0] == 1.0);
    CHECK_NEAR(got[63], pow(500000.0, -126.0 / 128) / 8.0, 1e-20);
    lm_config_free(&c);

    // The same through rope_parameters, small head_dim.
    CHECK_OK(parse(&c,
                   "{\"architectures\": [\"LlamaForCausalLM\"], \"hidden_size\": 64, "
                   "\"intermediate_size\": 64, \"num_hidden_layers\": 1, \"num_attention_heads\": 4, "
                   "\"vocab_size\": 10, \"rope_parameters\": {\"rope_theta\": 10000.0, \"rope_type\": \"llama3\", "
                   "\"factor\": 4.0, \"low_freq_factor\": 1.0, \"high_freq_factor\": 4.0, "
                   "\"original_max_position_embeddings\": 64}}", &err), &err);
    double g16[8];
    CHECK_OK(lm_config_rope_inv_freq(&c, g16, &err), &err);
    for (int i = 0; i < 8; i++)
        CHECK_NEAR(g16[i], ref_llama3(10000.0, 16, i, 4.0, 1.0, 4.0, 64.0), 1e-15);
    lm_config_free(&c);

    // Default and linear.
    CHECK_OK(parse(&c,
                   "{\"architectures\": [\"LlamaForCausalLM\"], \"hidden_size\": 64, "
                   "\"intermediate_size\": 64, \"num_hidden_layers\": 1, \"num_attention_heads\": 4, "
                   "\"vocab_size\": 10}", &err), &err);
    CHECK_OK(lm_config_rope_inv_freq(&c, g16, &err), &err);
    for (int i = 0; i < 8; i++)
        CHECK_NEAR(g16[i], pow(10000.0, -2.0 * i / 16), 1e-15);
    lm_config_free(&c);
    CHECK_OK(parse(&c,
                   "{\"architectures\": [\"LlamaForCausalLM\"], \"hidden_size\": 64, "
                   "\"intermediate_size\": 64, \"num_hidden_layers\": 1, \"num_attention_heads\": 4, "
                   "\"vocab_size\": 10, \"rope_scaling\": {\"type\": \"linear\", \"factor\": 2.0}}", &err), &err);
    CHECK_OK(lm_config_rope_inv_freq(&c, g16, &err), &err);
    for (int i = 0; i < 8; i++)
        CHECK_NEAR(g16[i], pow(10000.0, -2.0 * i / 16) / 2.0, 1e-15);
    lm_config_free(&c);

    // A type it does not compute is refused by name.
    CHECK_OK(parse(&c,
                   "{\"architectures\": [\"LlamaForCausalLM\"], \"hidden_size\": 64, "
                   "\"intermediate_size\": 64, \"num_hidden_layers\": 1, \"num_attention_heads\": 4, "
                   "\"vocab_size\": 10, \"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 4.0}}", &err), &err);
    CHECK(c.rope_scaling.kind == LM_ROPE_OTHER);
    CHECK_FAILS(lm_config_rope_inv_freq(&c, g16, &err), LM_ERR_UNSUPPORTED, "'yarn'", &err);
    lm_config_free(&c);
}

// ==== arch ====================================================================================

static void test_arch(void)
{
    lm_config c;
    lm_err err;
    CHECK_OK(parse(&c, TINY_LLAMA_CONFIG, &err), &err);
    lm_arch_desc d;
    CHECK_OK(lm_arch_describe(&d, &c, &err), &err);
    fixture_tensor want[64];
    int n = fixture_tiny_llama(want, false);
    CHECK(d.n_tensors == n);
    int64_t params = 0;
    for (int i = 0; i < n && i < d.n_tensors; i++) {
        CHECK_MSG(strcmp(d.tensors[i].name, want[i].name) == 0, "%d: %s vs %s", i, d.tensors[i].name,
                  want[i].name);
        CHECK(d.tensors[i].ndim == want[i].ndim);
        CHECK(d.tensors[i].shape[0] == want[i].shape[0]);
        if (want[i].ndim == 2)
            CHECK(d.tensors[i].shape[1] == want[i].shape[1]);
        params += want[i].shape[0] * (want[i].ndim == 2 ? want[i].shape[1] : 1);
    }
    CHECK(d.n_params == params);
    CHECK(lm_arch_param_count(&c) == params);
    // By hand: embed 128 + lm_head 128 + norm 8 + per layer (64+32+32+64+96+96+96+16) = 496.
    CHECK(params == 128 + 128 + 8 + 2 * 496);
    const lm_arch_tensor *t = lm_arch_get(&d, 1, LM_SLOT_DOWN, false);
    CHECK(t && strcmp(t->name, "model.layers.1.mlp.down_proj.weight") == 0 && t->role == LM_ROLE_LINEAR);
    CHECK(lm_arch_get(&d, 0, LM_SLOT_Q, true) == NULL);
    t = lm_arch_get(&d, 5, LM_SLOT_LM_HEAD, false);
    CHECK(t && t->role == LM_ROLE_LM_HEAD && t->layer == -1);
    CHECK(lm_arch_find(&d, "model.norm.weight") && lm_arch_find(&d, "model.norm.weight")->role == LM_ROLE_NORM);
    CHECK(lm_arch_find(&d, "nope") == NULL);
    lm_arch_desc_free(&d);
    lm_arch_desc_free(&d);
    lm_config_free(&c);

    // Qwen2, tied: biases right after their weights, no lm_head.
    CHECK_OK(parse(&c,
                   "{\"architectures\": [\"Qwen2ForCausalLM\"], \"hidden_size\": 8, "
                   "\"intermediate_size\": 12, \"num_hidden_layers\": 1, \"num_attention_heads\": 2, "
                   "\"num_key_value_heads\": 1, \"vocab_size\": 16, \"tie_word_embeddings\": true}", &err), &err);
    CHECK_OK(lm_arch_describe(&d, &c, &err), &err);
    static const char *qwen_order[] = {
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.bias",
        "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.k_proj.bias",
        "model.layers.0.self_attn.v_proj.weight", "model.layers.0.self_attn.v_proj.bias",
        "model.layers.0.self_attn.o_proj.weight",
        "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
        "model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight",
        "model.norm.weight",
    };
    CHECK(d.n_tensors == (int64_t)(sizeof qwen_order / sizeof qwen_order[0]));
    for (int64_t i = 0; i < d.n_tensors && i < 14; i++)
        CHECK_MSG(strcmp(d.tensors[i].name, qwen_order[i]) == 0, "%s", d.tensors[i].name);
    t = lm_arch_get(&d, 0, LM_SLOT_K, true);
    CHECK(t && t->ndim == 1 && t->shape[0] == 4 && t->role == LM_ROLE_BIAS);
    CHECK(lm_arch_get(&d, 0, LM_SLOT_O, true) == NULL);
    CHECK(lm_arch_get(&d, 0, LM_SLOT_LM_HEAD, false) == NULL);
    // 128 + (64+8 + 32+4 + 32+4 + 64 + 96*3 + 16) + 8
    CHECK(d.n_params == 128 + 512 + 8);
    lm_arch_desc_free(&d);
    lm_config_free(&c);

    // GQA with a head_dim that is not hidden / heads.
    CHECK_OK(parse(&c,
                   "{\"architectures\": [\"MistralForCausalLM\"], \"hidden_size\": 10, "
                   "\"intermediate_size\": 12, \"num_hidden_layers\": 1, \"num_attention_heads\": 4, "
                   "\"num_key_value_heads\": 2, \"head_dim\": 6, \"vocab_size\": 16}", &err), &err);
    CHECK_OK(lm_arch_describe(&d, &c, &err), &err);
    t = lm_arch_find(&d, "model.layers.0.self_attn.q_proj.weight");
    CHECK(t && t->shape[0] == 24 && t->shape[1] == 10);
    t = lm_arch_find(&d, "model.layers.0.self_attn.v_proj.weight");
    CHECK(t && t->shape[0] == 12 && t->shape[1] == 10);
    t = lm_arch_find(&d, "model.layers.0.self_attn.o_proj.weight");
    CHECK(t && t->shape[0] == 10 && t->shape[1] == 24);
    lm_arch_desc_free(&d);
    lm_config_free(&c);

    // Unknown architectures have no description.
    CHECK_OK(parse(&c, "{\"architectures\": [\"GPT2LMHeadModel\"]}", &err), &err);
    CHECK_FAILS(lm_arch_describe(&d, &c, &err), LM_ERR_UNSUPPORTED, "GPT2LMHeadModel", &err);
    CHECK(d.tensors == NULL);
    CHECK(lm_arch_param_count(&c) == 0);
    lm_config_free(&c);
}

// ==== models ==================================================================================

static void test_model_single(void)
{
    char *dir = make_tmpdir();
    write_text(dir, "config.json", TINY_LLAMA_CONFIG);
    fixture_tensor ts[64];
    int n = fixture_tiny_llama(ts, false);
    // Laid out sorted by name as the writer does: listing follows the data, not the config.
    qsort(ts, (size_t)n, sizeof ts[0], cmp_tt_name);
    fixture_write_st(dir, "model.safetensors", ts, n, FIXTURE_PATTERN);

    lm_model *m = NULL;
    lm_err err;
    CHECK_OK(lm_model_open(&m, dir, &err), &err);
    if (m) {
        CHECK(m->n_tensors == n && m->n_shards == 1 && m->index_path == NULL);
        CHECK(strcmp(m->shards[0].file, "model.safetensors") == 0);
        CHECK(m->shards[0].n_tensors == n);
        for (int i = 0; i < n && i < m->n_tensors; i++)
            CHECK(strcmp(m->tensors[i]->name, ts[i].name) == 0);
        const lm_st_tensor *t = lm_model_find(m, "model.layers.1.mlp.down_proj.weight");
        CHECK(t && t->shape[0] == 8 && t->shape[1] == 12 && t->dtype == LM_DTYPE_F32);
        CHECK(lm_model_find(m, "model.layers.2.mlp.down_proj.weight") == NULL);
        CHECK(lm_model_find_index(m, "lm_head.weight") >= 0);
        int64_t extra = -1;
        CHECK_OK(lm_model_check(m, &extra, &err), &err);
        CHECK(extra == 0);
        CHECK(lm_model_param_count(m) == 128 + 128 + 8 + 2 * 496);
        CHECK(lm_model_nbytes(m) == 4 * (uint64_t)lm_model_param_count(m));
        int64_t counts[LM_DTYPE_COUNT];
        lm_model_dtype_counts(m, counts);
        CHECK(counts[LM_DTYPE_F32] == n && counts[LM_DTYPE_BF16] == 0);
        CHECK(m->config.arch == LM_ARCH_LLAMA);
    }
    lm_model_free(m);
    lm_model_free(NULL);

    // A wrong shape names the tensor and both shapes; a missing one names the tensor; an
    // extra one is counted.
    n = fixture_tiny_llama(ts, false);
    ts[2] = fixture_t2("model.layers.0.self_attn.k_proj.weight", 8, 8);  // kv heads make it [4, 8]
    ts[n - 2] = fixture_t1("model.extra.weight", 8);                     // replaces model.norm.weight
    fixture_write_st(dir, "model.safetensors", ts, n, FIXTURE_PATTERN);
    CHECK_OK(lm_model_open(&m, dir, &err), &err);
    if (m) {
        int64_t extra = -1;
        CHECK_FAILS(lm_model_check(m, &extra, &err), LM_ERR_MISMATCH,
                    "tensor 'model.layers.0.self_attn.k_proj.weight' has shape [8, 8], but", &err);
        CHECK(strstr(err.msg, "gives [4, 8]") && strstr(err.msg, "and 1 more problems"));
        CHECK(extra == 1);
    }
    lm_model_free(m);
    n = fixture_tiny_llama(ts, false);
    ts[n - 2] = fixture_t1("model.extra.weight", 8);
    fixture_write_st(dir, "model.safetensors", ts, n, FIXTURE_PATTERN);
    CHECK_OK(lm_model_open(&m, dir, &err), &err);
    if (m)
        CHECK_FAILS(lm_model_check(m, NULL, &err), LM_ERR_MISMATCH,
                    "tensor 'model.norm.weight' [8] (from", &err);
    lm_model_free(m);

    // Tied config: lm_head.weight is then an extra tensor, not a problem.
    write_text(dir, "config.json",
               "{\"architectures\": [\"LlamaForCausalLM\"], \"hidden_size\": 8, "
               "\"intermediate_size\": 12, \"num_hidden_layers\": 2, \"num_attention_heads\": 2, "
               "\"num_key_value_heads\": 1, \"vocab_size\": 16, \"tie_word_embeddings\": true}");
    n = fixture_tiny_llama(ts, false);
    fixture_write_st(dir, "model.safetensors", ts, n, FIXTURE_PATTERN);
    CHECK_OK(lm_model_open(&m, dir, &err), &err);
    if (m) {
        int64_t extra = -1;
        CHECK_OK(lm_model_check(m, &extra, &err), &err);
        CHECK(extra == 1);
    }
    lm_model_free(m);

    // Any architecture opens; only the check needs a known one.
    write_text(dir, "config.json", "{\"architectures\": [\"PhiForCausalLM\"], \"hidden_size\": 8}");
    CHECK_OK(lm_model_open(&m, dir, &err), &err);
    if (m) {
        CHECK(m->config.arch == LM_ARCH_UNKNOWN && m->n_tensors == n);
        CHECK_FAILS(lm_model_check(m, NULL, &err), LM_ERR_UNSUPPORTED, "PhiForCausalLM", &err);
    }
    lm_model_free(m);

    // A broken config is reported with its path; so is a broken safetensors file.
    write_text(dir, "config.json", "{\"architectures\": [\"LlamaForCausalLM\"]}");
    CHECK_FAILS(lm_model_open(&m, dir, &err), LM_ERR_FORMAT, "config.json: key 'hidden_size' is missing", &err);
    CHECK(m == NULL);
    write_text(dir, "config.json", TINY_LLAMA_CONFIG);
    write_text(dir, "model.safetensors", "garbage");
    CHECK_FAILS(lm_model_open(&m, dir, &err), LM_ERR_FORMAT, "model.safetensors", &err);
    CHECK(m == NULL);
    remove_tmpdir(dir);
}

static void test_model_missing_files(void)
{
    char *dir = make_tmpdir();
    lm_model *m = NULL;
    lm_err err;
    CHECK_FAILS(lm_model_open(&m, dir, &err), LM_ERR_NOT_FOUND, "no config.json", &err);
    write_text(dir, "config.json", TINY_LLAMA_CONFIG);
    CHECK_FAILS(lm_model_open(&m, dir, &err), LM_ERR_NOT_FOUND,
                "no model.safetensors or model.safetensors.index.json", &err);
    write_text(dir, "pytorch_model.bin", "PK");
    CHECK_FAILS(lm_model_open(&m, dir, &err), LM_ERR_UNSUPPORTED, "convert", &err);
    CHECK(strstr(err.msg, "pytorch_model.bin") != NULL);
    CHECK(m == NULL);
    char *missing = lm_path_join(dir, "nope");
    CHECK_FAILS(lm_model_open(&m, missing, &err), LM_ERR_NOT_FOUND, "nope", &err);
    free(missing);
    remove_tmpdir(dir);
}

// Writes the tiny Llama as two shards (embed + layer 0 in the first; the rest in the second)
// and an index listing them; returns the tensor count. `index_json` replaces the generated
// index when not NULL.
static int write_sharded(const char *dir, fixture_tensor *ts)
{
    int n = fixture_tiny_llama(ts, false);
    int first = 10;  // embed + 9 tensors of layer 0
    fixture_write_st(dir, "model-00001-of-00002.safetensors", ts, first, FIXTURE_PATTERN);
    fixture_write_st(dir, "model-00002-of-00002.safetensors", ts + first, n - first, FIXTURE_PATTERN);
    size_t cap = 8192, len = 0;
    char *idx = malloc(cap);
    len += (size_t)snprintf(idx + len, cap - len, "{\"metadata\": {\"total_size\": 0}, \"weight_map\": {");
    // Listed in reverse so the index order is not the listing order.
    for (int i = n - 1; i >= 0; i--)
        len += (size_t)snprintf(idx + len, cap - len, "%s\"%s\": \"model-0000%d-of-00002.safetensors\"",
                                i == n - 1 ? "" : ", ", ts[i].name, i < first ? 1 : 2);
    snprintf(idx + len, cap - len, "}}");
    write_text(dir, "model.safetensors.index.json", idx);
    free(idx);
    return n;
}

static void test_model_sharded(void)
{
    char *dir = make_tmpdir();
    write_text(dir, "config.json", TINY_LLAMA_CONFIG);
    fixture_tensor ts[64];
    int n = write_sharded(dir, ts);
    lm_model *m = NULL;
    lm_err err;
    CHECK_OK(lm_model_open(&m, dir, &err), &err);
    if (m) {
        CHECK(m->n_shards == 2 && m->n_tensors == n && m->index_path != NULL);
        CHECK(strcmp(m->shards[0].file, "model-00001-of-00002.safetensors") == 0);
        CHECK(strcmp(m->shards[1].file, "model-00002-of-00002.safetensors") == 0);
        CHECK(m->shards[0].n_tensors == 10 && m->shards[1].n_tensors == n - 10);
        CHECK(m->shards[0].nbytes == 4 * (128 + 496));
        // State-dict order: shard order, then offset.
        for (int i = 0; i < n && i < m->n_tensors; i++)
            CHECK(strcmp(m->tensors[i]->name, ts[i].name) == 0);
        const lm_st_tensor *t = lm_model_find(m, "lm_head.weight");
        int64_t ti = lm_model_find_index(m, "lm_head.weight");
        CHECK(t && ti == n - 1 && m->tensor_shard[ti] == 1);
        t = lm_model_find(m, "model.layers.0.mlp.up_proj.weight");
        CHECK(t && m->tensor_shard[lm_model_find_index(m, t->name)] == 0);
        CHECK_OK(lm_model_check(m, NULL, &err), &err);
    }
    lm_model_free(m);

    // A shard with no model.safetensors beside it: the index is used; with one, the single file
    // wins (as in transformers).
    fixture_write_st(dir, "model.safetensors", ts, 1, FIXTURE_PATTERN);
    CHECK_OK(lm_model_open(&m, dir, &err), &err);
    if (m)
        CHECK(m->n_shards == 1 && m->n_tensors == 1);
    lm_model_free(m);
    char *single = lm_path_join(dir, "model.safetensors");
    unlink(single);
    free(single);

    // A missing shard names the file and a tensor it should hold.
    char *s2 = lm_path_join(dir, "model-00002-of-00002.safetensors");
    unlink(s2);
    CHECK_FAILS(lm_model_open(&m, dir, &err), LM_ERR_FORMAT,
                "shard 'model-00002-of-00002.safetensors' (holding tensor '", &err);
    CHECK(strstr(err.msg, "is missing") && strstr(err.msg, "model.safetensors.index.json"));
    CHECK(m == NULL);

    // A tensor listed but absent from its shard.
    fixture_write_st(dir, "model-00002-of-00002.safetensors", ts + 10, n - 11, FIXTURE_PATTERN);  // drops lm_head.weight
    CHECK_FAILS(lm_model_open(&m, dir, &err), LM_ERR_FORMAT,
                "tensor 'lm_head.weight' is listed in the index but not in its shard", &err);
    CHECK(strstr(err.msg, "model-00002-of-00002.safetensors") != NULL);

    // A tensor in two shards: the second shard also holds one of the first's.
    fixture_tensor dup[64];
    memcpy(dup, ts + 10, sizeof(fixture_tensor) * (size_t)(n - 10));
    dup[n - 10] = ts[1];
    fixture_write_st(dir, "model-00002-of-00002.safetensors", dup, n - 9, FIXTURE_PATTERN);
    CHECK_FAILS(lm_model_open(&m, dir, &err), LM_ERR_FORMAT, "is in two shards", &err);
    CHECK(strstr(err.msg, ts[1].name) != NULL);

    // A shard tensor the index does not list.
    memcpy(dup, ts + 10, sizeof(fixture_tensor) * (size_t)(n - 10));
    dup[n - 10] = fixture_t1("model.unlisted.weight", 3);
    fixture_write_st(dir, "model-00002-of-00002.safetensors", dup, n - 9, FIXTURE_PATTERN);
    CHECK_FAILS(lm_model_open(&m, dir, &err), LM_ERR_FORMAT,
                "tensor 'model.unlisted.weight' is in shard model-00002-of-00002.safetensors but not in", &err);
    fixture_write_st(dir, "model-00002-of-00002.safetensors", ts + 10, n - 10, FIXTURE_PATTERN);
    CHECK_OK(lm_model_open(&m, dir, &err), &err);
    lm_model_free(m);

    // Broken indexes.
    static const struct { const char *json; const char *needle; } bad[] = {
        {"[]", "not a JSON object"},
        {"{\"metadata\": {}}", "key 'weight_map' is missing"},
        {"{\"weight_map\": []}", "'weight_map' must be an object"},
        {"{\"weight_map\": {\"model.norm.weight\": 3}}", "weight_map['model.norm.weight'] must be a file name"},
        {"{\"weight_map\": {\"model.norm.weight\": \"../x.safetensors\"}}", "is not a file name in the model directory"},
        {"{\"weight_map\": {\"model.norm.weight\": \"model-00002-of-00002.safetensors\", "
         "\"model.norm.weight\": \"model-00001-of-00002.safetensors\"}}",
         "key 'model.norm.weight' in 'weight_map' appears twice"},
        // Only whitespace after the value, as in every other JSON file.
        {"{\"weight_map\": {\"model.norm.weight\": \"model-00002-of-00002.safetensors\"}}\n}garbage",
         "text after the JSON value (line 2, column 1)"},
        {"{\"weight_map\": {\"model.norm.weight\": \"model-00002-of-00002.safetensors\"},}",
         "not valid JSON"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        write_text(dir, "model.safetensors.index.json", bad[i].json);
        CHECK_FAILS(lm_model_open(&m, dir, &err), LM_ERR_FORMAT, bad[i].needle, &err);
        CHECK(m == NULL);
    }
    write_sharded(dir, ts);
    CHECK_OK(lm_model_open(&m, dir, &err), &err);
    lm_model_free(m);

    // A shard that is not a regular file is named as what it is, not as missing.
    unlink(s2);
    CHECK(mkdir(s2, 0755) == 0);
    CHECK_FAILS(lm_model_open(&m, dir, &err), LM_ERR_FORMAT,
                "shard 'model-00002-of-00002.safetensors' (holding tensor '", &err);
    CHECK_MSG(strstr(err.msg, "is a directory") && !strstr(err.msg, "missing"), "%s", err.msg);
    CHECK(m == NULL);
    rmdir(s2);
    CHECK(mkfifo(s2, 0644) == 0);
    CHECK_FAILS(lm_model_open(&m, dir, &err), LM_ERR_FORMAT, "is not a regular file (a FIFO)", &err);
    CHECK(strstr(err.msg, "missing") == NULL);
    CHECK(m == NULL);
    unlink(s2);
    free(s2);
    remove_tmpdir(dir);
}

// config.json is read by the one JSON reader when the model is opened: a byte order mark is
// refused there (as transformers refuses it), naming the file, not after the work.
static void test_model_config_bom(void)
{
    char *dir = make_tmpdir();
    write_text(dir, "config.json", "\xEF\xBB\xBF" TINY_LLAMA_CONFIG);
    fixture_tensor ts[64];
    int n = fixture_tiny_llama(ts, false);
    fixture_write_st(dir, "model.safetensors", ts, n, FIXTURE_PATTERN);
    lm_model *m = NULL;
    lm_err err;
    char *cfg = lm_path_join(dir, "config.json");
    CHECK_FAILS(lm_model_open(&m, dir, &err), LM_ERR_FORMAT, cfg, &err);
    CHECK_MSG(strstr(err.msg, "byte order mark") != NULL, "%s", err.msg);
    CHECK(m == NULL);
    write_text(dir, "config.json", TINY_LLAMA_CONFIG);
    CHECK_OK(lm_model_open(&m, dir, &err), &err);
    lm_model_free(m);
    free(cfg);
    remove_tmpdir(dir);
}

static void test_model_compare(void)
{
    char *root = make_tmpdir();
    char *bd = lm_path_join(root, "base"), *fd = lm_path_join(root, "ft");
    lm_err err;
    CHECK_OK(lm_mkdir_p(bd, &err), &err);
    CHECK_OK(lm_mkdir_p(fd, &err), &err);
    write_text(bd, "config.json", TINY_LLAMA_CONFIG);
    write_text(fd, "config.json", TINY_LLAMA_CONFIG);
    fixture_tensor ts[64];
    int n = fixture_tiny_llama(ts, false);
    fixture_write_st(bd, "model.safetensors", ts, n, FIXTURE_PATTERN);
    // The fine-tune: sharded differently, one extra tensor.
    fixture_tensor more[65];
    memcpy(more, ts, sizeof(fixture_tensor) * (size_t)n);
    more[n] = fixture_t1("model.extra.weight", 2);
    fixture_write_st(fd, "model.safetensors", more, n + 1, FIXTURE_PATTERN);
    lm_model *b = NULL, *f = NULL;
    CHECK_OK(lm_model_open(&b, bd, &err), &err);
    CHECK_OK(lm_model_open(&f, fd, &err), &err);
    int64_t extra = -1;
    if (b && f) {
        CHECK_OK(lm_model_compare(f, b, &extra, &err), &err);
        CHECK(extra == 1);
        CHECK_FAILS(lm_model_compare(b, f, &extra, &err), LM_ERR_MISMATCH,
                    "tensor 'model.extra.weight' [2] of the base", &err);
    }
    lm_model_free(f);
    ts[5] = fixture_t2("model.layers.0.mlp.gate_proj.weight", 8, 12);
    fixture_write_st(fd, "model.safetensors", ts, n, FIXTURE_PATTERN);
    CHECK_OK(lm_model_open(&f, fd, &err), &err);
    if (b && f)
        CHECK_FAILS(lm_model_compare(f, b, NULL, &err), LM_ERR_MISMATCH,
                    "tensor 'model.layers.0.mlp.gate_proj.weight' has shape [8, 12], but [12, 8] in the base", &err);
    lm_model_free(f);
    lm_model_free(b);
    free(bd);
    free(fd);
    remove_tmpdir(root);
}

int main(void)
{
    test_config_llama_old_keys();
    test_config_new_keys_and_defaults();
    test_config_biases_and_head_dim();
    test_config_unknown_arch();
    test_config_errors();
    test_rope();
    test_arch();
    test_model_single();
    test_model_missing_files();
    test_model_sharded();
    test_model_config_bom();
    test_model_compare();
    return check_report("test_model");
}
