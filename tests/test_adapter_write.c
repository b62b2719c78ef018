// Tests of adapter_write.c: an adapter written for the fixtures' base and read back by llmerge's
// own reader (adapter.h, held to PEFT's format by test_adapter), field by field: the config's r,
// lora_alpha, rank_pattern and alpha_pattern for a module of another rank, target_modules by last
// name where every such module has factors and by full path where not, modules_to_save; each
// module's kind, rank, scale (1) and factors (linear A and B as given; an embedding's transposed,
// so that PEFT's (B·A)ᵀ is the product given); a saved tensor; bias deltas (lora_bias); BF16
// rounding; an empty adapter and a bad rank refused. PEFT's rules on what it loads: an embedding
// written whole under lora_bias, a saved module's unchanged tensors written with the base's
// values, ensure_weight_tying for a tied base, "dummy-target-modules" where nothing has factors,
// the embeddings of an architecture llmerge does not describe found by name.
#include <cJSON.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "adapter.h"
#include "adapter_write.h"
#include "check.h"
#include "fixture.h"
#include "testfs.h"

// Values of a factor: distinct and exact in BF16.
static void fill(float *x, int64_t n, int salt)
{
    for (int64_t i = 0; i < n; i++)
        x[i] = (float)((i * 7 + salt * 13) % 41 - 20) / 16.0f;
}

static const lm_lora_module *find_module(const lm_adapter *ad, const char *path)
{
    for (int64_t i = 0; i < ad->n_modules; i++)
        if (strcmp(ad->modules[i].path, path) == 0)
            return &ad->modules[i];
    return NULL;
}

static bool same_f32(const lm_st_tensor *t, const float *want, int64_t n)
{
    if (!t || t->numel != n)
        return false;
    float got[n];
    lm_err err = {0};
    if (lm_convert_to_f32(got, t->data, t->dtype, n, &err) != LM_OK)
        return false;
    return memcmp(got, want, (size_t)n * sizeof *got) == 0;
}

static void test_written(lm_dtype dt)
{
    lm_model *base = fixture_model("base");
    if (!base)
        return;
    char *dir = make_tmpdir();
    lm_adapter_out *w = NULL;
    lm_err err = {0};
    CHECK_OK(lm_adapter_out_new(&w, base, "org/base", dt, &err), &err);
    // q_proj in both layers at rank 2 (target "q_proj"), v_proj in layer 0 only at rank 3 (its
    // full path, and rank_pattern), the embedding at rank 2, model.norm saved whole
    float qb[2][64 * 2], qa[2][2 * 64], vb[32 * 3], va[3 * 64], eb[256 * 2], ea[2 * 64], norm[64];
    for (int l = 0; l < 2; l++) {
        fill(qb[l], 64 * 2, 1 + l);
        fill(qa[l], 2 * 64, 3 + l);
    }
    fill(vb, 32 * 3, 5);
    fill(va, 3 * 64, 6);
    fill(eb, 256 * 2, 7);
    fill(ea, 2 * 64, 8);
    fill(norm, 64, 9);
    CHECK_OK(lm_adapter_out_lora(w, "model.layers.0.self_attn.q_proj", false, 64, 64, 2, qb[0], qa[0], &err), &err);
    CHECK_OK(lm_adapter_out_lora(w, "model.layers.1.self_attn.q_proj", false, 64, 64, 2, qb[1], qa[1], &err), &err);
    CHECK_OK(lm_adapter_out_lora(w, "model.layers.0.self_attn.v_proj", false, 32, 64, 3, vb, va, &err), &err);
    CHECK_OK(lm_adapter_out_lora(w, "model.embed_tokens", true, 256, 64, 2, eb, ea, &err), &err);
    int64_t ns = 64;
    CHECK_OK(lm_adapter_out_saved(w, "model.norm.weight", 1, &ns, norm, &err), &err);
    CHECK_FAILS(lm_adapter_out_lora(w, "model.layers.0.self_attn.q_proj", false, 64, 64, 2, qb[0], qa[0], &err),
                LM_ERR_USAGE, "added twice", &err);
    CHECK_FAILS(lm_adapter_out_lora(w, "model.layers.0.mlp.up_proj", false, 128, 64, 0, NULL, NULL, &err),
                LM_ERR_USAGE, "rank 0", &err);
    CHECK(lm_adapter_out_count(w) == 5);
    CHECK_OK(lm_adapter_out_write(w, dir, 2, &err), &err);
    lm_adapter_out_free(w);

    lm_adapter *ad = NULL;
    CHECK_OK(lm_adapter_open(&ad, dir, &err), &err);
    if (ad) {
        CHECK_OK(lm_adapter_select(ad, base, &err), &err);
        CHECK_OK(lm_adapter_validate(ad, base, &err), &err);
        const lm_lora_config *c = &ad->config;
        CHECK(c->r == 2 && c->lora_alpha == 2 && !c->use_rslora && !c->use_dora && !c->fan_in_fan_out);
        CHECK(!c->lora_bias);
        CHECK(strcmp(c->base_model_name_or_path, "org/base") == 0);
        CHECK(c->targets == LM_LORA_TARGETS_LIST && c->n_target_modules == 3);
        if (c->n_target_modules == 3)
            CHECK(strcmp(c->target_modules[0], "q_proj") == 0 &&
                  strcmp(c->target_modules[1], "model.layers.0.self_attn.v_proj") == 0 &&
                  strcmp(c->target_modules[2], "embed_tokens") == 0);
        CHECK(c->n_modules_to_save == 1 && strcmp(c->modules_to_save[0], "model.norm") == 0);
        CHECK(c->n_rank_pattern == 1 && c->n_alpha_pattern == 1);
        if (c->n_rank_pattern == 1)
            CHECK(strcmp(c->rank_pattern[0].key, "model.layers.0.self_attn.v_proj") == 0 && c->rank_pattern[0].r == 3 &&
                  c->alpha_pattern[0].alpha == 3);
        CHECK(ad->n_modules == 4 && ad->n_saved == 1 && ad->n_ignored == 0);
        for (int l = 0; l < 2; l++) {
            char path[64];
            snprintf(path, sizeof path, "model.layers.%d.self_attn.q_proj", l);
            const lm_lora_module *m = find_module(ad, path);
            CHECK(m && m->kind == LM_LORA_LINEAR && m->r == 2 && m->scale == 1.0 && m->a->dtype == dt);
            CHECK(m && same_f32(m->a, qa[l], 2 * 64) && same_f32(m->b, qb[l], 64 * 2));
        }
        const lm_lora_module *v = find_module(ad, "model.layers.0.self_attn.v_proj");
        CHECK(v && v->r == 3 && v->alpha == 3 && v->scale == 1.0 && same_f32(v->a, va, 3 * 64) &&
              same_f32(v->b, vb, 32 * 3));
        const lm_lora_module *e = find_module(ad, "model.embed_tokens");
        CHECK(e && e->kind == LM_LORA_EMBEDDING && e->r == 2 && e->a->shape[0] == 2 && e->a->shape[1] == 256 &&
              e->b->shape[0] == 64 && e->b->shape[1] == 2);
        if (e) {
            // PEFT's delta (B·A)ᵀ [256, 64] is the product given, eb·ea
            float A[2 * 256], B[64 * 2];
            CHECK_OK(lm_convert_to_f32(A, e->a->data, e->a->dtype, 2 * 256, &err), &err);
            CHECK_OK(lm_convert_to_f32(B, e->b->data, e->b->dtype, 64 * 2, &err), &err);
            int bad = 0;
            for (int i = 0; i < 256; i++)
                for (int j = 0; j < 64; j++) {
                    double peft = 0, given = 0;
                    for (int q = 0; q < 2; q++) {
                        peft += (double)B[j * 2 + q] * A[q * 256 + i];
                        given += (double)eb[i * 2 + q] * ea[q * 64 + j];
                    }
                    bad += peft != given;
                }
            CHECK_MSG(bad == 0, "%d entries of the embedding's delta differ", bad);
        }
        CHECK(ad->n_saved == 1 && strcmp(ad->saved[0].base_name, "model.norm.weight") == 0 &&
              same_f32(ad->saved[0].t, norm, 64));
        lm_adapter_free(ad);
    }
    remove_tmpdir(dir);
    lm_model_free(base);
}

// Bias deltas set lora_bias; rounding to BF16 is the dtype's; nothing added is refused.
static void test_bias_and_refusals(void)
{
    lm_model *base = fixture_model("base");
    if (!base)
        return;
    char *dir = make_tmpdir();
    lm_adapter_out *w = NULL;
    lm_err err = {0};
    CHECK_OK(lm_adapter_out_new(&w, base, NULL, LM_DTYPE_BF16, &err), &err);
    CHECK_FAILS(lm_adapter_out_write(w, dir, 4, &err), LM_ERR_USAGE, "would be empty", &err);
    float b[64 * 1], a[1 * 64], bias[64];
    for (int i = 0; i < 64; i++) {
        b[i] = 1.0f + (float)i / 1024;  // not all exact in BF16
        a[i] = 1.0f;
        bias[i] = (float)i;
    }
    CHECK_OK(lm_adapter_out_lora(w, "model.layers.1.self_attn.o_proj", false, 64, 64, 1, b, a, &err), &err);
    CHECK_OK(lm_adapter_out_bias(w, "model.layers.1.self_attn.o_proj", 64, bias, &err), &err);
    CHECK_OK(lm_adapter_out_write(w, dir, 1, &err), &err);
    lm_adapter_out_free(w);
    lm_lora_config c = {0};
    char *cfg = lm_path_join(dir, "adapter_config.json"), *st = lm_path_join(dir, "adapter_model.safetensors");
    CHECK_OK(lm_lora_config_load(&c, cfg, &err), &err);
    CHECK(c.lora_bias && c.r == 1 && c.n_rank_pattern == 0 && c.n_modules_to_save == 0);
    lm_lora_config_free(&c);
    lm_st_file *f = NULL;
    CHECK_OK(lm_st_open(&f, st, &err), &err);
    if (f) {
        const lm_st_tensor *tb = lm_st_find(f, "base_model.model.model.layers.1.self_attn.o_proj.lora_B.weight");
        const lm_st_tensor *tbias = lm_st_find(f, "base_model.model.model.layers.1.self_attn.o_proj.lora_B.bias");
        CHECK(tb && tb->dtype == LM_DTYPE_BF16 && tbias && tbias->ndim == 1 && tbias->shape[0] == 64);
        if (tb) {
            float got[64], want[64];
            CHECK_OK(lm_convert_to_f32(got, tb->data, tb->dtype, 64, &err), &err);
            for (int i = 0; i < 64; i++)
                want[i] = lm_bf16_to_f32(lm_f32_to_bf16(b[i]));
            CHECK(memcmp(got, want, sizeof got) == 0);
        }
        lm_st_close(f);
    }
    CHECK_FAILS(lm_adapter_out_new(&w, base, NULL, LM_DTYPE_I32, &err), LM_ERR_USAGE, "not written in", &err);
    free(cfg);
    free(st);
    remove_tmpdir(dir);
    lm_model_free(base);
}

// adapter_config.json of dir, parsed (NULL where it cannot be).
static cJSON *read_config(const char *dir)
{
    char *path = lm_path_join(dir, "adapter_config.json");
    lm_err err = {0};
    char *text = NULL;
    size_t n = 0;
    cJSON *c = path && lm_read_file(path, 1 << 20, &text, &n, &err) == LM_OK ? cJSON_Parse(text) : NULL;
    free(text);
    free(path);
    return c;
}

// Whether base tensor `name` of the fixture holds `want` (float32 values), bit for bit.
static bool holds_base(const lm_st_file *f, const char *key, const lm_model *base, const char *name)
{
    const lm_st_tensor *t = lm_st_find(f, key), *bt = lm_model_find(base, name);
    if (!t || !bt || t->numel != bt->numel)
        return false;
    lm_err err = {0};
    float *want = malloc((size_t)bt->numel * sizeof *want);
    bool ok = want && lm_convert_to_f32(want, bt->data, bt->dtype, bt->numel, &err) == LM_OK &&
              same_f32(t, want, bt->numel);
    free(want);
    return ok;
}

// On the Qwen2 fixture (q, k and v biases; lm_head tied to the embedding): an embedding with
// factors beside a bias delta is written whole, BASE + the factors' product, since PEFT takes no
// Embedding under lora_bias; a module saved for its bias alone gets its weight (the base's); the
// tie is declared; the first module with factors and no bias in BASE is named.
static void test_peft_rules(void)
{
    lm_model *base = fixture_model("qwen");
    if (!base)
        return;
    char *dir = make_tmpdir();
    lm_adapter_out *w = NULL;
    lm_err err = {0};
    CHECK_OK(lm_adapter_out_new(&w, base, NULL, LM_DTYPE_F32, &err), &err);
    float eb[256 * 2], ea[2 * 64], qb[64 * 2], qa[2 * 64], ob[64 * 2], oa[2 * 64], bias[64], kbias[32];
    fill(eb, 256 * 2, 1);
    fill(ea, 2 * 64, 2);
    fill(qb, 64 * 2, 3);
    fill(qa, 2 * 64, 4);
    fill(ob, 64 * 2, 5);
    fill(oa, 2 * 64, 6);
    fill(bias, 64, 7);
    fill(kbias, 32, 8);
    CHECK_OK(lm_adapter_out_lora(w, "model.embed_tokens", true, 256, 64, 2, eb, ea, &err), &err);
    CHECK_OK(lm_adapter_out_lora(w, "model.layers.0.self_attn.q_proj", false, 64, 64, 2, qb, qa, &err), &err);
    CHECK_OK(lm_adapter_out_bias(w, "model.layers.0.self_attn.q_proj", 64, bias, &err), &err);
    CHECK_OK(lm_adapter_out_lora(w, "model.layers.0.self_attn.o_proj", false, 64, 64, 2, ob, oa, &err), &err);
    int64_t ks = 32;
    CHECK_OK(lm_adapter_out_saved(w, "model.layers.1.self_attn.k_proj.bias", 1, &ks, kbias, &err), &err);
    CHECK_OK(lm_adapter_out_write(w, dir, 2, &err), &err);
    CHECK(lm_adapter_out_is_whole(w, "model.embed_tokens") && !lm_adapter_out_is_whole(w, "model.norm") &&
          !lm_adapter_out_is_whole(w, "model.layers.0.self_attn.q_proj"));
    const char *biasless = lm_adapter_out_biasless(w);
    CHECK_MSG(biasless && strcmp(biasless, "model.layers.0.self_attn.o_proj") == 0, "biasless: %s",
              biasless ? biasless : "(none)");
    lm_adapter_out_free(w);

    cJSON *c = read_config(dir);
    CHECK(c != NULL);
    if (c) {
        CHECK(cJSON_IsTrue(cJSON_GetObjectItem(c, "lora_bias")) &&
              cJSON_IsTrue(cJSON_GetObjectItem(c, "ensure_weight_tying")));
        const cJSON *saved = cJSON_GetObjectItem(c, "modules_to_save"), *targets = cJSON_GetObjectItem(c,
                                                                                                     "target_modules");
        CHECK(cJSON_GetArraySize(saved) == 2 && cJSON_GetArraySize(targets) == 2);
        if (cJSON_GetArraySize(saved) == 2)
            CHECK(strcmp(cJSON_GetArrayItem(saved, 0)->valuestring, "embed_tokens") == 0 &&
                  strcmp(cJSON_GetArrayItem(saved, 1)->valuestring, "model.layers.1.self_attn.k_proj") == 0);
        cJSON_Delete(c);
    }
    char *st = lm_path_join(dir, "adapter_model.safetensors");
    lm_st_file *f = NULL;
    CHECK_OK(lm_st_open(&f, st, &err), &err);
    if (f) {
        CHECK(!lm_st_find(f, "base_model.model.model.embed_tokens.lora_embedding_A") &&
              !lm_st_find(f, "base_model.model.model.embed_tokens.lora_embedding_B"));
        const lm_st_tensor *e = lm_st_find(f, "base_model.model.model.embed_tokens.weight");
        const lm_st_tensor *be = lm_model_find(base, "model.embed_tokens.weight");
        CHECK(e && e->ndim == 2 && e->shape[0] == 256 && e->shape[1] == 64);
        if (e && be && e->numel == 256 * 64) {
            static float got[256 * 64], b0[256 * 64];
            CHECK_OK(lm_convert_to_f32(got, e->data, e->dtype, 256 * 64, &err), &err);
            CHECK_OK(lm_convert_to_f32(b0, be->data, be->dtype, 256 * 64, &err), &err);
            double worst = 0;
            for (int i = 0; i < 256; i++)
                for (int j = 0; j < 64; j++) {
                    double want = b0[i * 64 + j];
                    for (int q = 0; q < 2; q++)
                        want += (double)eb[i * 2 + q] * ea[q * 64 + j];
                    double d = fabs(got[i * 64 + j] - want) / (fabs(want) + 1e-3);
                    worst = d > worst ? d : worst;
                }
            CHECK_MSG(worst < 1e-6, "embedding made whole: worst relative difference %g", worst);
        }
        // the tied lm_head, as PEFT saves it beside a saved embedding: the same values
        const lm_st_tensor *h = lm_st_find(f, "base_model.model.lm_head.weight");
        CHECK(h && e && h->nbytes == e->nbytes && memcmp(h->data, e->data, (size_t)e->nbytes) == 0);
        CHECK(holds_base(f, "base_model.model.model.layers.1.self_attn.k_proj.weight", base,
                         "model.layers.1.self_attn.k_proj.weight"));
        CHECK(same_f32(lm_st_find(f, "base_model.model.model.layers.1.self_attn.k_proj.bias"), kbias, 32));
        CHECK(same_f32(lm_st_find(f, "base_model.model.model.layers.0.self_attn.q_proj.lora_B.bias"), bias, 64));
        // o_proj's factors, no bias in BASE: a lora_B.bias of zeros, which PEFT's lora_B (made
        // with a bias for every layer under lora_bias) expects in the file
        static const float zeros[64];
        CHECK(same_f32(lm_st_find(f, "base_model.model.model.layers.0.self_attn.o_proj.lora_B.bias"), zeros, 64));
        lm_st_close(f);
    }
    lm_adapter *ad = NULL;  // and llmerge's reader takes it
    CHECK_OK(lm_adapter_open(&ad, dir, &err), &err);
    if (ad) {
        CHECK_OK(lm_adapter_select(ad, base, &err), &err);
        CHECK(ad->n_modules == 2 && ad->n_saved == 3);
        for (int64_t m = 0; m < ad->n_modules; m++)  // o_proj's bias of zeros is accepted
            CHECK_MSG(ad->modules[m].bias != NULL, "%s: no bias read", ad->modules[m].path);
        lm_adapter_free(ad);
    }
    free(st);
    remove_tmpdir(dir);
    lm_model_free(base);
}

// Saved modules only: target_modules is "dummy-target-modules" (a null would be PEFT's default
// targets), no tie on an untied base, and llmerge's reader takes it. Embeddings by name where the
// architecture is not described.
static void test_no_targets(void)
{
    lm_model *base = fixture_model("base");
    if (!base)
        return;
    char *dir = make_tmpdir();
    lm_adapter_out *w = NULL;
    lm_err err = {0};
    CHECK_OK(lm_adapter_out_new(&w, base, NULL, LM_DTYPE_F32, &err), &err);
    float norm[64];
    fill(norm, 64, 9);
    int64_t ns = 64;
    CHECK_OK(lm_adapter_out_saved(w, "model.norm.weight", 1, &ns, norm, &err), &err);
    CHECK_OK(lm_adapter_out_write(w, dir, 4, &err), &err);
    CHECK(!lm_adapter_out_biasless(w));
    lm_adapter_out_free(w);
    cJSON *c = read_config(dir);
    CHECK(c != NULL);
    if (c) {
        const cJSON *t = cJSON_GetObjectItem(c, "target_modules");
        CHECK(cJSON_IsString(t) && strcmp(t->valuestring, "dummy-target-modules") == 0);
        CHECK(cJSON_IsFalse(cJSON_GetObjectItem(c, "ensure_weight_tying")) &&
              cJSON_IsFalse(cJSON_GetObjectItem(c, "lora_bias")));
        cJSON_Delete(c);
    }
    lm_adapter *ad = NULL;
    CHECK_OK(lm_adapter_open(&ad, dir, &err), &err);
    if (ad) {
        CHECK_OK(lm_adapter_select(ad, base, &err), &err);
        CHECK(ad->n_modules == 0 && ad->n_saved == 1);
        lm_adapter_free(ad);
    }
    remove_tmpdir(dir);

    CHECK(lm_adapter_embedding(base, "model.embed_tokens.weight") &&
          !lm_adapter_embedding(base, "model.layers.0.self_attn.q_proj.weight") &&
          !lm_adapter_embedding(base, "lm_head.weight"));
    lm_arch known = base->config.arch;  // as if an architecture llmerge does not describe
    base->config.arch = LM_ARCH_UNKNOWN;
    CHECK(lm_adapter_embedding(base, "transformer.wte.weight") && lm_adapter_embedding(base, "transformer.wpe.weight") &&
          lm_adapter_embedding(base, "model.embed_tokens.weight") &&
          !lm_adapter_embedding(base, "transformer.h.0.attn.c_attn.weight") &&
          !lm_adapter_embedding(base, "transformer.wte.bias") && !lm_adapter_embedding(base, "lm_head.weight"));
    base->config.arch = known;
    lm_model_free(base);
}

// An embedding LoRA on the tied Qwen2 fixture: ensure_weight_tying, and lm_head's factors as PEFT
// saves them, the embedding's transposed (lora_A = lora_embedding_Bᵀ, lora_B =
// lora_embedding_Aᵀ), which llmerge's reader sets aside as tied, with no warning to give. An
// embedding PEFT would not tie (not embed_tokens) gets no tie.
static void test_tied_lora(void)
{
    lm_model *base = fixture_model("qwen");
    if (!base)
        return;
    char *dir = make_tmpdir(), *dir2 = make_tmpdir();
    lm_adapter_out *w = NULL;
    lm_err err = {0};
    CHECK_OK(lm_adapter_out_new(&w, base, NULL, LM_DTYPE_BF16, &err), &err);
    float eb[256 * 3], ea[3 * 64];
    fill(eb, 256 * 3, 11);
    fill(ea, 3 * 64, 12);
    CHECK_OK(lm_adapter_out_lora(w, "model.embed_tokens", true, 256, 64, 3, eb, ea, &err), &err);
    CHECK_OK(lm_adapter_out_write(w, dir, 3, &err), &err);
    lm_adapter_out_free(w);
    cJSON *c = read_config(dir);
    CHECK(c && cJSON_IsTrue(cJSON_GetObjectItem(c, "ensure_weight_tying")));
    cJSON_Delete(c);
    char *st = lm_path_join(dir, "adapter_model.safetensors");
    lm_st_file *f = NULL;
    CHECK_OK(lm_st_open(&f, st, &err), &err);
    if (f) {
        const lm_st_tensor *la = lm_st_find(f, "base_model.model.lm_head.lora_A.weight");
        const lm_st_tensor *lb = lm_st_find(f, "base_model.model.lm_head.lora_B.weight");
        const lm_st_tensor *ka = lm_st_find(f, "base_model.model.model.embed_tokens.lora_embedding_A");
        const lm_st_tensor *kb = lm_st_find(f, "base_model.model.model.embed_tokens.lora_embedding_B");
        CHECK(la && lb && ka && kb && la->shape[0] == 3 && la->shape[1] == 64 && lb->shape[0] == 256 &&
              lb->shape[1] == 3);
        if (la && lb && ka && kb && la->numel == 3 * 64 && lb->numel == 256 * 3) {
            static float A[3 * 64], B[256 * 3], EA[3 * 256], EB[64 * 3];
            CHECK_OK(lm_convert_to_f32(A, la->data, la->dtype, 3 * 64, &err), &err);
            CHECK_OK(lm_convert_to_f32(B, lb->data, lb->dtype, 256 * 3, &err), &err);
            CHECK_OK(lm_convert_to_f32(EA, ka->data, ka->dtype, 3 * 256, &err), &err);
            CHECK_OK(lm_convert_to_f32(EB, kb->data, kb->dtype, 64 * 3, &err), &err);
            int bad = 0;
            for (int q = 0; q < 3; q++) {
                for (int j = 0; j < 64; j++)
                    bad += A[q * 64 + j] != EB[j * 3 + q];
                for (int i = 0; i < 256; i++)
                    bad += B[i * 3 + q] != EA[q * 256 + i];
            }
            CHECK_MSG(bad == 0, "%d entries of lm_head's factors are not the embedding's transposed", bad);
        }
        lm_st_close(f);
    }
    lm_adapter *ad = NULL;
    CHECK_OK(lm_adapter_open(&ad, dir, &err), &err);
    if (ad) {
        CHECK_OK(lm_adapter_select(ad, base, &err), &err);
        CHECK(ad->n_modules == 1 && ad->n_ignored == 1 && ad->n_saved == 0);
        if (ad->n_ignored == 1)
            CHECK(ad->ignored[0].why == LM_LORA_TIED && strcmp(ad->ignored[0].path, "lm_head") == 0);
        lm_adapter_free(ad);
    }
    // lm_head's factors that are not the embedding's: refused, naming the key (rewritten here
    // with one value of lm_head.lora_A changed)
    f = NULL;
    CHECK_OK(lm_st_open(&f, st, &err), &err);
    if (f && f->n_tensors <= 8) {
        lm_st_desc d[8];
        const void *data[8];
        void *copy[8] = {NULL};
        for (int64_t i = 0; i < f->n_tensors; i++) {
            const lm_st_tensor *t = &f->tensors[i];
            d[i] = (lm_st_desc){.name = t->name, .dtype = t->dtype, .ndim = t->ndim,
                                .shape = {t->shape[0], t->ndim > 1 ? t->shape[1] : 0}};
            copy[i] = malloc((size_t)t->nbytes);
            if (copy[i])
                memcpy(copy[i], t->data, (size_t)t->nbytes);
            if (copy[i] && strcmp(t->name, "base_model.model.lm_head.lora_A.weight") == 0)
                ((uint16_t *)copy[i])[5] ^= 0x0100;  // a BF16 value's mantissa
            data[i] = copy[i];
        }
        char *st2 = lm_path_join(dir2, "adapter_model.safetensors"), *cfg = lm_path_join(dir, "adapter_config.json");
        char *cfg2 = lm_path_join(dir2, "adapter_config.json"), *text = NULL;
        size_t n = 0;
        const char *meta[] = {"format", "pt", NULL};
        CHECK_OK(lm_st_write_file(st2, d, data, f->n_tensors, meta, &err), &err);
        CHECK_OK(lm_read_file(cfg, 1 << 20, &text, &n, &err), &err);
        CHECK_OK(lm_write_file(cfg2, text, n, &err), &err);
        CHECK_OK(lm_adapter_open(&ad, dir2, &err), &err);
        if (ad) {
            CHECK_FAILS(lm_adapter_select(ad, base, &err), LM_ERR_FORMAT,
                        "lm_head's keys ('base_model.model.lm_head.lora_A.weight') are not embed_tokens' own", &err);
            lm_adapter_free(ad);
        }
        for (int64_t i = 0; i < f->n_tensors; i++)
            free(copy[i]);
        free(text);
        free(st2);
        free(cfg);
        free(cfg2);
    }
    lm_st_close(f);
    // not embed_tokens: PEFT ties no adapter to it
    CHECK_OK(lm_adapter_out_new(&w, base, NULL, LM_DTYPE_F32, &err), &err);
    CHECK_OK(lm_adapter_out_lora(w, "transformer.wte", true, 256, 64, 3, eb, ea, &err), &err);
    CHECK_OK(lm_adapter_out_write(w, dir2, 3, &err), &err);
    lm_adapter_out_free(w);
    c = read_config(dir2);
    CHECK(c && cJSON_IsFalse(cJSON_GetObjectItem(c, "ensure_weight_tying")));
    cJSON_Delete(c);
    free(st);
    remove_tmpdir(dir);
    remove_tmpdir(dir2);
    lm_model_free(base);
}

int main(void)
{
    if (!fixture_env("test_adapter_write"))
        return 77;
    test_written(LM_DTYPE_F32);
    test_written(LM_DTYPE_BF16);
    test_bias_and_refusals();
    test_peft_rules();
    test_no_targets();
    test_tied_lora();
    return check_report("test_adapter_write");
}
