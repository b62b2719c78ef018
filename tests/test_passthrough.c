// Tests of lib/passthrough.c, layer stacking, on small Llama-shaped models written here with
// values that say where they come from (each tensor's values depend on its model, name and
// element): the output's names and the layer each comes from, the tensors before the layers from
// the first slice's model and those after from the last's, config.json (num_hidden_layers, a
// per-layer array stacked, every other key the first model's, numbers as written), a model
// named twice opened once, the written tensors byte for byte (copied), times the slice's scale
// and converted to BF16 (against a loop here, slab by slab and whole), a tensor in a dtype
// llmerge cannot compute with copied, and every error: a range outside the model or empty, a
// missing model, another architecture, other tied embeddings, another shape in a layer or
// outside, a scale on an integer tensor, a config.json whose layer count its tensors do not
// fill, a per-layer array of the wrong length, no slices.
#include <cJSON.h>
#include <inttypes.h>
#include <xxhash.h>

#include "check.h"
#include "dtype.h"
#include "model.h"
#include "passthrough.h"
#include "st_writer.h"
#include "testfs.h"

#define H 8    // hidden
#define I 12   // intermediate
#define V 16   // vocabulary

// How a test model differs from the plain one.
typedef struct model_spec {
    int id;               // changes every value
    int layers;
    const char *arch;     // architectures[0] (default LlamaForCausalLM)
    bool tied;            // tie_word_embeddings: no lm_head.weight
    int inter;            // intermediate size (default I)
    int vocab;            // vocabulary (default V)
    int config_layers;    // num_hidden_layers in config.json (default: layers)
    bool layer_types;     // a layer_types array, "m<id>l<layer>" per layer
    int layer_types_len;  // its length (default: config's layer count)
    bool int_tensor;      // an I32 tensor model.layers.0.mask [H] in layer 0
} model_spec;

// The value of element e of tensor t of model id: distinct everywhere, exact in F32 and scaled
// by 0.5 exactly.
static float value_of(int id, int t, int64_t e)
{
    return (float)(id * 4096 + t * 64 + (int)(e % 61)) / 256.0f - 7.0f;
}

// Writes dir/<name>: config.json and model.safetensors as spec says. Returns the path (freed by
// the caller).
static char *write_model(const char *dir, const char *name, const model_spec *spec)
{
    char *path = subdir(dir, name);
    int inter = spec->inter ? spec->inter : I, vocab = spec->vocab ? spec->vocab : V;
    int cfg_layers = spec->config_layers ? spec->config_layers : spec->layers;
    lm_st_desc d[64];
    char names[64][96];
    int n = 0;
#define ADD(shape0, shape1, nd, ...)                                                   \
    do {                                                                              \
        snprintf(names[n], sizeof names[n], __VA_ARGS__);                             \
        d[n] = (lm_st_desc){names[n], LM_DTYPE_F32, nd, {shape0, shape1}};             \
        n++;                                                                          \
    } while (0)
    ADD(vocab, H, 2, "model.embed_tokens.weight");
    for (int l = 0; l < spec->layers; l++) {
        ADD(H, H, 2, "model.layers.%d.self_attn.q_proj.weight", l);
        ADD(inter, H, 2, "model.layers.%d.mlp.up_proj.weight", l);
        ADD(H, 0, 1, "model.layers.%d.input_layernorm.weight", l);
        if (l == 0 && spec->int_tensor) {
            ADD(H, 0, 1, "model.layers.0.mask");
            d[n - 1].dtype = LM_DTYPE_I32;
        }
    }
    ADD(H, 0, 1, "model.norm.weight");
    if (!spec->tied)
        ADD(vocab, H, 2, "lm_head.weight");
#undef ADD
    void *data[64];
    for (int t = 0; t < n; t++) {
        int64_t numel = d[t].shape[0] * (d[t].ndim == 2 ? d[t].shape[1] : 1);
        float *f = malloc((size_t)numel * sizeof *f);
        for (int64_t e = 0; e < numel; e++)
            f[e] = value_of(spec->id, t, e);
        if (d[t].dtype == LM_DTYPE_I32)
            for (int64_t e = 0; e < numel; e++) {
                int32_t v = (int32_t)(spec->id * 100 + e);
                memcpy(&f[e], &v, 4);
            }
        data[t] = f;
    }
    lm_err err;
    char *st = lm_path_join(path, "model.safetensors");
    CHECK_OK(lm_st_write_file(st, d, (const void *const *)data, n, NULL, &err), &err);
    free(st);
    for (int t = 0; t < n; t++)
        free(data[t]);

    lm_buf c = {0};
    lm_buf_fmt(&c, "{\n  \"architectures\": [\n    \"%s\"\n  ],\n", spec->arch ? spec->arch : "LlamaForCausalLM");
    lm_buf_fmt(&c, "  \"hidden_size\": %d,\n  \"intermediate_size\": %d,\n", H, inter);
    if (spec->layer_types) {
        int len = spec->layer_types_len ? spec->layer_types_len : cfg_layers;
        lm_buf_str(&c, "  \"layer_types\": [\n");
        for (int l = 0; l < len; l++)
            lm_buf_fmt(&c, "    \"m%dl%d\"%s\n", spec->id, l, l + 1 < len ? "," : "");
        lm_buf_str(&c, "  ],\n");
    }
    lm_buf_fmt(&c, "  \"model_type\": \"llama\",\n  \"num_attention_heads\": 2,\n  \"num_hidden_layers\": %d,\n"
               "  \"num_key_value_heads\": 1,\n  \"rms_norm_eps\": 1e-05,\n  \"rope_theta\": 10000.0,\n"
               "  \"tie_word_embeddings\": %s,\n  \"torch_dtype\": \"float32\",\n  \"vocab_size\": %d\n}\n",
               cfg_layers, spec->tied ? "true" : "false", vocab);
    char *cfg = lm_path_join(path, "config.json");
    CHECK_OK(lm_write_file(cfg, c.p, c.len, &err), &err);
    free(cfg);
    free(c.p);
    return path;
}

// The output tensor called name in plan p, or NULL.
static const lm_pt_tensor *find(const lm_pt_plan_t *p, const char *name)
{
    int64_t n;
    const lm_pt_tensor *t = lm_pt_tensors(p, &n);
    for (int64_t i = 0; i < n; i++)
        if (strcmp(t[i].name, name) == 0)
            return &t[i];
    return NULL;
}

// Whether output tensor `out` of p is `in_name` of model `model`, of slice `slice`.
static bool comes_from(const lm_pt_plan_t *p, const char *out, int model, const char *in_name, int slice)
{
    const lm_pt_tensor *t = find(p, out);
    return t && t->slice == slice && lm_pt_slice_model(p, slice) == model &&
           t->in == lm_model_find(lm_pt_model(p, model), in_name);
}

// ==== the plan ================================================================================

static void test_plan(const char *a, const char *b)
{
    lm_err err;
    lm_pt_plan_t *p = NULL;
    lm_pt_source src[] = {{a, 0, 2, 0, false}, {b, 1, 3, 0, false}};
    CHECK_OK(lm_pt_plan(&p, src, 2, &err), &err);
    if (!p)
        return;
    CHECK(lm_pt_n_layers(p) == 4);
    CHECK(lm_pt_n_models(p) == 2);
    int64_t n;
    const lm_pt_tensor *t = lm_pt_tensors(p, &n);
    // embed, 4 layers of 3, norm, lm_head
    CHECK_MSG(n == 1 + 4 * 3 + 2, "%" PRId64 " tensors", n);
    // the order: embeddings, the layers in output order (each in its model's order, which for a
    // file of llmerge's writer is by name), the rest
    CHECK(strcmp(t[0].name, "model.embed_tokens.weight") == 0);
    CHECK(strcmp(t[1].name, "model.layers.0.input_layernorm.weight") == 0);
    CHECK(strcmp(t[3].name, "model.layers.0.self_attn.q_proj.weight") == 0);
    CHECK(strcmp(t[7].name, "model.layers.2.input_layernorm.weight") == 0);
    CHECK(strcmp(t[n - 2].name, "lm_head.weight") == 0);
    CHECK(strcmp(t[n - 1].name, "model.norm.weight") == 0);
    // where each comes from
    CHECK(comes_from(p, "model.embed_tokens.weight", 0, "model.embed_tokens.weight", 0));
    CHECK(comes_from(p, "model.layers.0.mlp.up_proj.weight", 0, "model.layers.0.mlp.up_proj.weight", 0));
    CHECK(comes_from(p, "model.layers.1.input_layernorm.weight", 0, "model.layers.1.input_layernorm.weight", 0));
    CHECK(comes_from(p, "model.layers.2.self_attn.q_proj.weight", 1, "model.layers.1.self_attn.q_proj.weight", 1));
    CHECK(comes_from(p, "model.layers.3.mlp.up_proj.weight", 1, "model.layers.2.mlp.up_proj.weight", 1));
    CHECK(comes_from(p, "model.norm.weight", 1, "model.norm.weight", 1));
    CHECK(comes_from(p, "lm_head.weight", 1, "lm_head.weight", 1));
    const lm_pt_tensor *l3 = find(p, "model.layers.3.input_layernorm.weight");
    CHECK(l3 && l3->layer_in == 2 && l3->layer_out == 3);
    const lm_pt_tensor *e = find(p, "model.embed_tokens.weight");
    CHECK(e && e->layer_in == -1 && e->layer_out == -1);
    CHECK(!find(p, "model.layers.4.mlp.up_proj.weight"));

    // config.json: the first model's, num_hidden_layers 4, layer_types stacked from both
    cJSON *c = cJSON_Parse(lm_pt_config(p));
    CHECK(c != NULL);
    CHECK(cJSON_GetObjectItem(c, "num_hidden_layers") && cJSON_GetObjectItem(c, "num_hidden_layers")->valuedouble == 4);
    CHECK(cJSON_GetObjectItem(c, "hidden_size") && cJSON_GetObjectItem(c, "hidden_size")->valuedouble == H);
    const cJSON *lt = cJSON_GetObjectItem(c, "layer_types");
    static const char *const want[] = {"m1l0", "m1l1", "m2l1", "m2l2"};
    CHECK(cJSON_GetArraySize(lt) == 4);
    for (int i = 0; i < 4 && cJSON_GetArraySize(lt) == 4; i++)
        CHECK_MSG(strcmp(cJSON_GetArrayItem(lt, i)->valuestring, want[i]) == 0, "layer_types[%d] = %s", i,
                  cJSON_GetArrayItem(lt, i)->valuestring);
    cJSON_Delete(c);
    // numbers as the first model's file wrote them, the layout as transformers writes it
    CHECK(strstr(lm_pt_config(p), "\n  \"rope_theta\": 10000.0,\n") != NULL);
    CHECK(strstr(lm_pt_config(p), "\n  \"rms_norm_eps\": 1e-05,\n") != NULL);
    CHECK(strstr(lm_pt_config(p), "\n  \"num_hidden_layers\": 4,\n") != NULL);
    CHECK(strstr(lm_pt_config(p), "  \"architectures\": [\n    \"LlamaForCausalLM\"\n  ],\n") != NULL);

    // descriptors for the writer
    lm_st_desc *d = NULL;
    int64_t nd;
    CHECK_OK(lm_pt_outputs(p, LM_DTYPE_BF16, &d, &nd, &err), &err);
    CHECK(nd == n && d && d[1].dtype == LM_DTYPE_BF16 && d[1].ndim == 1 && d[1].shape[0] == H &&
          strcmp(d[1].name, t[1].name) == 0 && d[3].ndim == 2 && d[3].shape[1] == H);
    free(d);
    lm_pt_plan_free(p);

    // one model named twice is opened once; its layers stacked twice
    lm_pt_source twice[] = {{a, 0, 2, 0, false}, {a, 1, 2, 0, false}};
    CHECK_OK(lm_pt_plan(&p, twice, 2, &err), &err);
    if (p) {
        CHECK(lm_pt_n_models(p) == 1 && lm_pt_n_layers(p) == 3);
        CHECK(comes_from(p, "model.layers.2.self_attn.q_proj.weight", 0, "model.layers.1.self_attn.q_proj.weight", 1));
        CHECK(comes_from(p, "lm_head.weight", 0, "lm_head.weight", 1));
    }
    lm_pt_plan_free(p);
}

// ==== writing =================================================================================

// Stacks src into dir/out in out_dt with slab slab, checks every output tensor against the input
// it comes from (times its slice's scale, converted to out_dt by a loop here) and the hashes;
// returns the counts of lm_pt_write.
static lm_pt_result write_and_check(const char *dir, const char *out, const lm_pt_source *src, int n_src,
                                    lm_dtype out_dt, int64_t slab)
{
    lm_err err;
    lm_pt_result res = {0}, counts = {0};
    lm_pt_plan_t *p = NULL;
    CHECK_OK(lm_pt_plan(&p, src, n_src, &err), &err);
    if (!p)
        return counts;
    char *od = subdir(dir, out);
    lm_st_desc *d = NULL;
    int64_t n = 0;
    lm_st_writer *w = NULL;
    CHECK_OK(lm_pt_outputs(p, out_dt, &d, &n, &err), &err);
    CHECK_OK(lm_st_writer_open(&w, od, d, n, 1u << 12, NULL, &err), &err);  // several shards
    CHECK_OK(lm_pt_write(p, out_dt, w, slab, NULL, NULL, &res, &err), &err);
    CHECK_OK(lm_st_writer_finish(w, &err), &err);
    lm_st_writer_free(w);
    char *cfg = lm_path_join(od, "config.json");
    CHECK_OK(lm_write_file(cfg, lm_pt_config(p), strlen(lm_pt_config(p)), &err), &err);
    free(cfg);
    counts = res;
    counts.xxh64 = NULL;

    lm_model *m = NULL;
    CHECK_OK(lm_model_open(&m, od, &err), &err);
    const lm_pt_tensor *t = lm_pt_tensors(p, &n);
    int64_t bad = 0;
    for (int64_t i = 0; m && i < n; i++) {
        const lm_st_tensor *o = lm_model_find(m, t[i].name), *in = t[i].in;
        if (!o || o->numel != in->numel) {
            bad++;
            continue;
        }
        if (res.xxh64 && XXH64(o->data, (size_t)o->nbytes, 0) != res.xxh64[i])
            bad++;
        if (!lm_dtype_readable(in->dtype)) {
            bad += o->dtype != in->dtype || memcmp(o->data, in->data, (size_t)in->nbytes) != 0;
            continue;
        }
        const lm_pt_source *s = &src[t[i].slice];
        for (int64_t e = 0; e < in->numel; e++) {
            float x = ((const float *)in->data)[e] * (s->has_scale ? (float)s->scale : 1.0f);
            bool same;
            if (out_dt == LM_DTYPE_F32) {
                same = ((const float *)o->data)[e] == x;
            } else {
                uint16_t got;
                memcpy(&got, (const char *)o->data + 2 * e, 2);
                same = got == lm_f32_to_bf16(x);
            }
            if (!same) {
                bad++;
                break;
            }
        }
    }
    CHECK_MSG(bad == 0, "%s: %" PRId64 " tensors differ from their source", out, bad);
    lm_model_free(m);
    lm_pt_result_free(&res);
    free(d);
    free(od);
    lm_pt_plan_free(p);
    return counts;
}

static void test_write(const char *dir, const char *a, const char *b, const char *f)
{
    // copied byte for byte
    lm_pt_source plain[] = {{a, 0, 2, 0, false}, {b, 1, 3, 0, false}};
    lm_pt_result r = write_and_check(dir, "plain", plain, 2, LM_DTYPE_F32, 0);
    CHECK(r.n_copied == 15 && r.n_scaled == 0 && r.n_converted == 0);
    CHECK(r.bytes_in == r.bytes_out && r.bytes_in > 0);
    // the second slice times 0.5: its layers, the norm and lm_head; the embeddings not
    lm_pt_source scaled[] = {{a, 0, 2, 0, false}, {b, 1, 3, 0.5, true}};
    r = write_and_check(dir, "scaled", scaled, 2, LM_DTYPE_F32, 0);
    CHECK_MSG(r.n_scaled == 2 * 3 + 2 && r.n_copied == 1 + 2 * 3, "scaled %" PRId64 ", copied %" PRId64, r.n_scaled,
              r.n_copied);
    // slab by slab (5 elements) gives the same
    r = write_and_check(dir, "scaled_slabs", scaled, 2, LM_DTYPE_F32, 5);
    CHECK(r.n_scaled == 8);
    // converted to BF16, the first slice scaled too (the embeddings with it)
    lm_pt_source both[] = {{a, 0, 1, 2.0, true}, {b, 0, 3, 0.5, true}};
    r = write_and_check(dir, "bf16", both, 2, LM_DTYPE_BF16, 7);
    CHECK(r.n_scaled == 1 + 4 * 3 + 2 && r.n_copied == 0);
    r = write_and_check(dir, "bf16_plain", plain, 2, LM_DTYPE_BF16, 0);
    CHECK(r.n_converted == 15 && r.n_copied == 0 && r.bytes_out * 2 == r.bytes_in);
    // an I32 tensor without a scale is copied in its own dtype
    lm_pt_source ints[] = {{f, 0, 2, 0, false}, {b, 2, 3, 0, false}};
    r = write_and_check(dir, "ints", ints, 2, LM_DTYPE_BF16, 0);
    CHECK(r.n_copied == 1 && r.n_converted == 1 + 2 * 3 + 3 + 2);
}

// ==== errors ==================================================================================

static void test_errors(const char *dir, const char *a, const char *b)
{
    lm_err err;
    lm_pt_plan_t *p = NULL;
#define FAILS(want, needle, ...)                                                                    \
    do {                                                                                            \
        lm_pt_source s_[] = {__VA_ARGS__};                                                          \
        CHECK_FAILS(lm_pt_plan(&p, s_, (int)(sizeof s_ / sizeof s_[0]), &err), want, needle, &err); \
        CHECK(p == NULL);                                                                           \
    } while (0)

    // ranges
    FAILS(LM_ERR_USAGE, "slice 2: layer range [1, 4) of", {a, 0, 2, 0, false}, {b, 1, 4, 0, false});
    FAILS(LM_ERR_USAGE, "is outside the model's layers (the model has layers 0 to 2", {a, 0, 1, 0, false},
          {b, 1, 4, 0, false});
    FAILS(LM_ERR_USAGE, "slice 1: layer range [1, 1) of", {a, 1, 1, 0, false});
    FAILS(LM_ERR_USAGE, "holds no layer", {a, 2, 1, 0, false});
    FAILS(LM_ERR_USAGE, "is outside the model's layers", {a, -1, 1, 0, false});
    CHECK_FAILS(lm_pt_plan(&p, NULL, 0, &err), LM_ERR_USAGE, "at least one slice", &err);
    // a model that is not there
    char *missing = lm_path_join(dir, "missing");
    FAILS(LM_ERR_NOT_FOUND, "slice 2", {a, 0, 1, 0, false}, {missing, 0, 1, 0, false});
    free(missing);

    // models that do not stack
    char *qwen = write_model(dir, "qwen", &(model_spec){.id = 5, .layers = 2, .arch = "Qwen2ForCausalLM"});
    FAILS(LM_ERR_MISMATCH, "architectures[0] Qwen2ForCausalLM", {a, 0, 1, 0, false}, {qwen, 0, 1, 0, false});
    char *tied = write_model(dir, "tied", &(model_spec){.id = 6, .layers = 2, .tied = true});
    FAILS(LM_ERR_MISMATCH, "tie_word_embeddings true", {a, 0, 1, 0, false}, {tied, 0, 1, 0, false});
    char *wide = write_model(dir, "wide", &(model_spec){.id = 7, .layers = 2, .inter = 14});
    FAILS(LM_ERR_MISMATCH, "tensor 'model.layers.1.mlp.up_proj.weight' is [14, 8], but "
          "'model.layers.0.mlp.up_proj.weight' of", {a, 0, 1, 0, false}, {wide, 1, 2, 0, false});
    char *vocab = write_model(dir, "vocab", &(model_spec){.id = 8, .layers = 2, .vocab = 20});
    FAILS(LM_ERR_MISMATCH, "tensor 'lm_head.weight' is [20, 8], but [16, 8] in", {a, 0, 1, 0, false},
          {vocab, 0, 1, 0, false});
    FAILS(LM_ERR_MISMATCH, "tensor 'model.layers.0.mlp.up_proj.weight' is [12, 8]", {wide, 0, 1, 0, false},
          {a, 0, 1, 0, false});
    // a scale on a tensor llmerge cannot compute with
    char *ints = write_model(dir, "ints2", &(model_spec){.id = 9, .layers = 2, .int_tensor = true});
    FAILS(LM_ERR_UNSUPPORTED, "tensor 'model.layers.0.mask' is I32", {ints, 0, 2, 3.0, true});
    // config.json against the tensors, per-layer arrays
    char *short_ = write_model(dir, "short", &(model_spec){.id = 10, .layers = 2, .config_layers = 3});
    FAILS(LM_ERR_FORMAT, "layer 2 has no tensors", {short_, 0, 1, 0, false});
    char *long_ = write_model(dir, "long", &(model_spec){.id = 11, .layers = 3, .config_layers = 2});
    FAILS(LM_ERR_FORMAT, "tensor 'model.layers.2.input_layernorm.weight' is of layer 2, but config.json says the model has 2", {long_, 0, 1, 0, false});
    char *types = write_model(dir, "types", &(model_spec){.id = 12, .layers = 2, .layer_types = true,
                                                         .layer_types_len = 3});
    FAILS(LM_ERR_FORMAT, "key 'layer_types' is an array of another length", {a, 0, 1, 0, false},
          {types, 0, 1, 0, false});
    char *no_types = write_model(dir, "no_types", &(model_spec){.id = 13, .layers = 2});
    FAILS(LM_ERR_FORMAT, "key 'layer_types' is missing", {a, 0, 1, 0, false}, {no_types, 0, 1, 0, false});
#undef FAILS
    free(qwen);
    free(tied);
    free(wide);
    free(vocab);
    free(ints);
    free(short_);
    free(long_);
    free(types);
    free(no_types);
}

int main(void)
{
    char *dir = make_tmpdir();
    char *a = write_model(dir, "a", &(model_spec){.id = 1, .layers = 2, .layer_types = true});
    char *b = write_model(dir, "b", &(model_spec){.id = 2, .layers = 3, .layer_types = true});
    char *f = write_model(dir, "f", &(model_spec){.id = 3, .layers = 2, .int_tensor = true});
    test_plan(a, b);
    test_write(dir, a, b, f);
    test_errors(dir, a, b);
    free(a);
    free(b);
    free(f);
    remove_tmpdir(dir);
    return check_report("test_passthrough");
}
