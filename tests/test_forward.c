// Tests of the forward pass (lib/forward.c) and its device operations. The reference is a naive
// forward pass written here in double, loop by loop from docs/formats.md "config.json" and
// docs/formats.md "The forward pass", and the PEFT rules of adapter.h, sharing no code with
// lib/forward.c: it reads the
// tensors itself and computes its own rotary frequencies (also the Llama 3 scaling). Against it,
// on the generated fixtures (LLMERGE_FIXTURES): the Llama base (BF16, two shards) alone and
// with three adapters (plain LoRA; rsLoRA on all seven linears with rank and alpha patterns;
// an embedding LoRA with lm_head saved whole), the Qwen2 model (q/k/v biases, tied embeddings)
// alone and with a lora_bias adapter, the Llama 3 model (llama3 rope scaling, head_dim 24 != 64
// / 4, one KV head for four query heads, biases everywhere, F16) and the base relabelled as
// MistralForCausalLM with a sliding window of 6 tokens: logits within 1e-4 relative, and each
// adapter, the rope scaling and the sliding window must change the logits by far more than that.
// DoRA, against a reference that merges the DoRA weights explicitly in double and runs the
// plain pass: the fixture (q_proj, v_proj) and adapters written here with DoRA on the embedding,
// k_proj, down_proj and lm_head of the Llama base and on the tied Qwen2 model; the DoRA scaling
// must change the logits by far more than the tolerance, the sim gives the CPU's bit for bit,
// and DoRA with fan_in_fan_out is refused. Then: packed batches, in any order, give every
// sequence the logits it gets alone, on 1 and 3 threads, to float32 rounding (1e-5 relative),
// and the sim device gives the CPU's bit for bit; the hook sees each
// layer's linear inputs for the real tokens only; out-of-vocabulary ids are refused;
// the fallbacks of lm_fwd_runner on small sim budgets (weights that do not fit, a batch
// halved, one sequence sent to the CPU and the next batch back on the device) give the CPU's
// NLLs and perplexity, and a device failure that is not out-of-memory stops the run; a device without the
// forward operations is refused by name.
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "adapter.h"
#include "calib.h"
#include "check.h"
#include "device.h"
#include "device_impl.h"  // a device lacking rope, built by hand
#include "forward.h"
#include "model.h"
#include "notes.h"
#include "safetensors.h"
#include "st_writer.h"
#include "testfs.h"
#include "util.h"

#define REL 1e-4       // relative error allowed against the double reference (max |diff| / max |ref|)
#define ROUNDING 1e-5  // float32 results of one computation done in different batches or splits

#include "ref_forward.h"

// max |got − ref| / max |ref| over n values.
static double rel_err(const float *got, const double *ref, int64_t n)
{
    double md = 0, mr = 0;
    for (int64_t i = 0; i < n; i++) {
        double d = fabs((double)got[i] - ref[i]);
        md = d > md || isnan(d) ? d : md;
        mr = fabs(ref[i]) > mr ? fabs(ref[i]) : mr;
    }
    return mr > 0 ? md / mr : md;
}

static double max_abs(const float *a, int64_t n)
{
    double m = 0;
    for (int64_t i = 0; i < n; i++)
        m = fabs((double)a[i]) > m ? fabs((double)a[i]) : m;
    return m > 0 ? m : 1;
}

static double max_diff(const float *a, const float *b, int64_t n)
{
    double md = 0;
    for (int64_t i = 0; i < n; i++)
        md = fabs((double)a[i] - b[i]) > md ? fabs((double)a[i] - b[i]) : md;
    return md;
}

static double rel_diff_d(const double *a, const double *b, int64_t n)
{
    double md = 0, mr = 0;
    for (int64_t i = 0; i < n; i++) {
        md = fabs(a[i] - b[i]) > md ? fabs(a[i] - b[i]) : md;
        mr = fabs(b[i]) > mr ? fabs(b[i]) : mr;
    }
    return mr > 0 ? md / mr : md;
}

// Logits of every sequence run as one packed batch on d (host (T, V), caller frees).
static float *run_logits(lm_fwd *f, const seqs *q, int64_t V)
{
    float *lg = malloc((size_t)(q->T * V) * sizeof *lg);
    lm_fwd_req req = {.logits = lg};
    lm_err err;
    CHECK_OK(lm_fwd_run(f, q->s, q->n, &req, &err), &err);
    return lg;
}

// ==== against the reference ===================================================================

// The forward pass of `model` (+ `adapter`) on the calibration sequences against the
// reference; returns the reference logits of all sequences (caller frees) for comparisons
// between variants. With want_diff, the rope scaling is switched off in a second reference and
// must make a difference.
static double *check_model(lm_dev *cpu, const char *label, lm_model *m, lm_adapter *a, bool check_scaling)
{
    if (!m)
        return NULL;
    lm_err err;
    const lm_config *cfg = &m->config;
    int64_t V = cfg->vocab_size;
    seqs q;
    load_seqs(&q, V);
    lm_fwd *f = NULL;
    CHECK_OK(lm_fwd_create(&f, m, a, cpu, &err), &err);
    if (!f) {
        free_seqs(&q);
        return NULL;
    }
    float *lg = run_logits(f, &q, V);
    double *all = malloc((size_t)(q.T * V) * sizeof *all);
    ref_ctx c = {m, a, false};
    double worst = 0;
    int64_t longest = 0;
    for (int64_t i = 0; i < q.n; i++)
        longest = q.s[i].len > longest ? q.s[i].len : longest;
    for (int64_t i = 0, row = 0; i < q.n; row += q.s[i].len, i++) {
        ref_out o;
        ref_forward(&c, q.s[i].ids, q.s[i].len, &o);
        double e = rel_err(lg + row * V, o.logits, q.s[i].len * V);
        worst = e > worst ? e : worst;
        memcpy(all + row * V, o.logits, (size_t)(q.s[i].len * V) * sizeof *all);
        if (check_scaling && q.s[i].len == longest) {
            // the scaling must matter at these positions, or the comparison proves nothing
            ref_ctx c0 = {m, a, true};
            ref_out o0;
            ref_forward(&c0, q.s[i].ids, q.s[i].len, &o0);
            double d = rel_diff_d(o0.logits, o.logits, q.s[i].len * V);
            CHECK_MSG(d > 5 * REL, "%s: rope scaling changes the logits by only %g", label, d);
            printf("%-28s rope scaling changes the logits by %.2e\n", label, d);
            ref_free(&o0);
        }
        ref_free(&o);
    }
    CHECK_MSG(worst < REL, "%s: logits differ from the reference by %g (relative)", label, worst);
    printf("%-28s max relative error %.2e\n", label, worst);
    free(lg);
    lm_fwd_free(f);
    free_seqs(&q);
    return all;
}

// The adapter must change the logits by far more than the tolerance.
static void check_changes(const char *label, const double *with, const double *without, int64_t n)
{
    if (!with || !without)
        return;
    double d = rel_diff_d(with, without, n);
    CHECK_MSG(d > 20 * REL, "%s changes the logits by only %g", label, d);
}

static void test_reference(lm_dev *cpu)
{
    lm_err err;
    lm_model *base = fixture_model("base"), *qwen = fixture_model("qwen"), *l3 = fixture_model("llama3");
    if (!base || !qwen || !l3)
        goto out;
    int64_t n = 0;
    {
        seqs q;
        load_seqs(&q, 256);
        n = q.T * 256;
        free_seqs(&q);
    }
    double *b0 = check_model(cpu, "base", base, NULL, false);
    static const char *const ads[] = {"lora_plain", "lora_rslora", "lora_mts"};
    for (int i = 0; i < 3; i++) {
        lm_adapter *a = fixture_adapter(ads[i]);
        char label[64];
        snprintf(label, sizeof label, "base + %s", ads[i]);
        double *r = check_model(cpu, label, base, a, false);
        check_changes(label, r, b0, n);
        free(r);
        lm_adapter_free(a);
    }

    double *q0 = check_model(cpu, "qwen", qwen, NULL, false);
    lm_adapter *lb = fixture_adapter("lora_bias");
    double *q1 = check_model(cpu, "qwen + lora_bias", qwen, lb, false);
    check_changes("qwen + lora_bias", q1, q0, n);
    free(q0);
    free(q1);
    lm_adapter_free(lb);

    // llama3: the library's inv_freq agrees with the formula, and the scaling is exercised
    const lm_config *cfg = &l3->config;
    CHECK(cfg->rope_scaling.kind == LM_ROPE_LLAMA3 && cfg->head_dim == 24 && cfg->num_key_value_heads == 1);
    double mine[64], lib[64], plain[64];
    ref_inv_freq(cfg, false, mine);
    ref_inv_freq(cfg, true, plain);
    CHECK_OK(lm_config_rope_inv_freq(cfg, lib, &err), &err);
    int kept = 0, divided = 0, blended = 0;
    for (int64_t i = 0; i < cfg->head_dim / 2; i++) {
        CHECK_MSG(fabs(mine[i] - lib[i]) <= 1e-12 * plain[i], "inv_freq[%lld] %g, config.c says %g", (long long)i,
                  mine[i], lib[i]);
        kept += mine[i] == plain[i];
        divided += fabs(mine[i] - plain[i] / 8) <= 1e-15 * plain[i];
        blended += mine[i] != plain[i] && fabs(mine[i] - plain[i] / 8) > 1e-15 * plain[i];
    }
    CHECK_MSG(kept > 0 && divided > 0 && blended > 0, "llama3 bands: %d kept, %d divided, %d blended", kept, divided,
              blended);
    free(check_model(cpu, "llama3 (rope llama3, GQA 4:1)", l3, NULL, true));

    // the base relabelled as MistralForCausalLM
    {
        char *dir = make_tmpdir(), *src = fx("base");
        static const char *const files[] = {"model.safetensors.index.json", "model-00001-of-00002.safetensors",
                                            "model-00002-of-00002.safetensors"};
        for (int i = 0; i < 3; i++) {
            char *a = lm_path_join(src, files[i]), *b = lm_path_join(dir, files[i]);
            CHECK_OK(lm_copy_file(a, b, &err), &err);
            free(a);
            free(b);
        }
        char *cp = lm_path_join(src, "config.json"), *text = NULL;
        size_t len;
        CHECK_OK(lm_read_file(cp, 1 << 20, &text, &len, &err), &err);
        free(cp);
        if (text) {
            char *at = strstr(text, "LlamaForCausalLM"), *mt = strstr(text, "\"llama\"");
            CHECK(at && mt);
            lm_buf b = {0};
            lm_buf_put(&b, text, (size_t)(at - text));
            lm_buf_str(&b, "MistralForCausalLM");
            lm_buf_put(&b, at + 16, (size_t)(mt - at - 16));
            lm_buf_str(&b, "\"mistral\",\n  \"sliding_window\": 6");
            lm_buf_str(&b, mt + 7);
            write_text(dir, "config.json", b.p);
            free(b.p);
            free(text);
        }
        lm_model *mis = NULL;
        CHECK_OK(lm_model_open(&mis, dir, &err), &err);
        if (mis) {
            CHECK(mis->config.arch == LM_ARCH_MISTRAL && mis->config.sliding_window == 6);
            double *with = check_model(cpu, "mistral (sliding window 6)", mis, NULL, false);
            check_changes("mistral's sliding window", with, b0, n);
            free(with);
        }
        lm_model_free(mis);
        free(src);
        remove_tmpdir(dir);
    }
    free(b0);

    // A rope scaling the pass does not compute (yarn) is refused by the check that runs when a
    // model is opened for a forward pass, naming config.json and the key, not when placing it.
    {
        char *src = fx("base"), *cp = lm_path_join(src, "config.json"), *text = NULL;
        size_t len;
        CHECK_OK(lm_read_file(cp, 1 << 20, &text, &len, &err), &err);
        char *at = text ? strstr(text, "\"rope_scaling\": null") : NULL;
        CHECK(at != NULL);
        if (at) {
            lm_buf b = {0};
            lm_buf_put(&b, text, (size_t)(at - text));
            lm_buf_str(&b, "\"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 4.0, "
                           "\"original_max_position_embeddings\": 64}");
            lm_buf_str(&b, at + strlen("\"rope_scaling\": null"));
            lm_config yarn, kept = base->config;
            CHECK_OK(lm_config_parse(&yarn, b.p, b.len, cp, &err), &err);
            base->config = yarn;
            CHECK_FAILS(lm_fwd_check(base, NULL, &err), LM_ERR_UNSUPPORTED,
                        "config.json: key 'rope_scaling.rope_type': rope scaling type 'yarn' is not supported", &err);
            CHECK_MSG(strstr(err.msg, cp) != NULL, "%s", err.msg);
            lm_fwd *y = NULL;
            CHECK_FAILS(lm_fwd_create(&y, base, NULL, cpu, &err), LM_ERR_UNSUPPORTED, "'yarn'", &err);
            CHECK(y == NULL);
            base->config = kept;
            lm_config_free(&yarn);
            free(b.p);
        }
        free(text);
        free(cp);
        free(src);
    }

    lm_fwd *f = NULL;
    // an adapter of another base does not fit
    lm_adapter *lb2 = fixture_adapter("lora_bias");
    if (lb2)
        CHECK_FAILS(lm_fwd_create(&f, base, lb2, cpu, &err), LM_ERR_MISMATCH, "", &err);
    lm_adapter_free(lb2);
out:
    lm_model_free(base);
    lm_model_free(qwen);
    lm_model_free(l3);
}

// ==== DoRA ====================================================================================

// Reference logits of every calibration sequence (host (T, V), caller frees).
static double *ref_logits(lm_model *m, const lm_adapter *a, const seqs *q)
{
    int64_t V = m->config.vocab_size;
    double *all = malloc((size_t)(q->T * V) * sizeof *all);
    ref_ctx c = {m, a, false};
    for (int64_t i = 0, row = 0; i < q->n; row += q->s[i].len, i++) {
        ref_out o;
        ref_forward(&c, q->s[i].ids, q->s[i].len, &o);
        memcpy(all + row * V, o.logits, (size_t)(q->s[i].len * V) * sizeof *all);
        ref_free(&o);
    }
    return all;
}

// The adapter with its DoRA magnitudes dropped (a shallow copy; free with free(x.modules)): the
// same LoRA without the scaling, for the reference only.
static lm_adapter without_magnitudes(const lm_adapter *a)
{
    lm_adapter x = *a;
    x.modules = malloc((size_t)a->n_modules * sizeof *x.modules + 1);
    memcpy(x.modules, a->modules, (size_t)a->n_modules * sizeof *x.modules);
    for (int64_t i = 0; i < a->n_modules; i++)
        x.modules[i].magnitude = NULL;
    return x;
}

// A uniform number in [-1, 1) from the stream *st.
static float uniform(uint64_t *st)
{
    *st = *st * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((double)(*st >> 11) / 4503599627370496.0 - 1.0);
}

enum { DORA_R = 4, DORA_MAX_T = 16 };

// One module's tensors for write_dora: A, B and the magnitude, named and filled.
typedef struct dora_mod {
    char names[3][160];
    float *v[3];
    int64_t shape[3][2];
} dora_mod;

// Fills mod for the base weight `path` ([out, in]; for the embedding [vocab, hidden], its DoRA
// running per hidden feature) with factors from the stream and magnitudes equal to the norms of
// the base weight, per output row (per column for the embedding), times 0.8 to 1.2: near where
// DoRA's training leaves them, far enough that the scaling shows.
static void dora_module(dora_mod *mod, const lm_model *m, const char *path, bool embedding, uint64_t *st)
{
    char wname[160];
    snprintf(wname, sizeof wname, "%s.weight", path);
    const lm_st_tensor *w = lm_model_find(m, wname);
    CHECK_MSG(w && w->ndim == 2, "%s missing", wname);
    int64_t rows = w->shape[0], cols = w->shape[1];
    double *W = st_d(w);
    // linear: A [r, in], B [out, r], magnitude [out]; embedding: A [r, vocab], B [hidden, r], [hidden]
    int64_t a_cols = embedding ? rows : cols, b_rows = embedding ? cols : rows;
    static const char *const lin[3] = {"lora_A.weight", "lora_B.weight", "lora_magnitude_vector"};
    static const char *const emb[3] = {"lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector"};
    int64_t shapes[3][2] = {{DORA_R, a_cols}, {b_rows, DORA_R}, {b_rows, 1}};
    for (int k = 0; k < 3; k++) {
        snprintf(mod->names[k], sizeof mod->names[k], "base_model.model.%s.%s", path, embedding ? emb[k] : lin[k]);
        mod->shape[k][0] = shapes[k][0];
        mod->shape[k][1] = shapes[k][1];
        mod->v[k] = malloc((size_t)(shapes[k][0] * shapes[k][1]) * sizeof(float));
    }
    for (int64_t i = 0; i < DORA_R * a_cols; i++)
        mod->v[0][i] = 0.3f * uniform(st);
    for (int64_t i = 0; i < b_rows * DORA_R; i++)
        mod->v[1][i] = 0.3f * uniform(st);
    for (int64_t o = 0; o < b_rows; o++) {
        double ss = 0;
        for (int64_t i = 0; i < (embedding ? rows : cols); i++) {
            double x = embedding ? W[i * cols + o] : W[o * cols + i];
            ss += x * x;
        }
        mod->v[2][o] = (float)(sqrt(ss) * (1.0 + 0.2 * uniform(st)));
    }
    free(W);
}

// Writes a DoRA adapter for model m into dir: r 4, alpha 8, on the embedding, layer 0's k_proj,
// every down_proj and, when the model has one, lm_head.
static void write_dora(const char *dir, const lm_model *m, uint64_t seed)
{
    dora_mod mods[DORA_MAX_T] = {0};
    int n = 0;
    uint64_t st = seed;
    bool head = lm_model_find(m, "lm_head.weight") != NULL;
    dora_module(&mods[n++], m, "model.embed_tokens", true, &st);
    dora_module(&mods[n++], m, "model.layers.0.self_attn.k_proj", false, &st);
    for (int64_t l = 0; l < m->config.num_hidden_layers && n < DORA_MAX_T - 1; l++) {
        char path[96];
        snprintf(path, sizeof path, "model.layers.%lld.mlp.down_proj", (long long)l);
        dora_module(&mods[n++], m, path, false, &st);
    }
    if (head)
        dora_module(&mods[n++], m, "lm_head", false, &st);
    lm_st_desc desc[3 * DORA_MAX_T];
    const void *data[3 * DORA_MAX_T];
    for (int i = 0; i < n; i++)
        for (int k = 0; k < 3; k++) {
            desc[3 * i + k] = (lm_st_desc){.name = mods[i].names[k], .dtype = LM_DTYPE_F32, .ndim = k == 2 ? 1 : 2,
                                           .shape = {mods[i].shape[k][0], mods[i].shape[k][1]}};
            data[3 * i + k] = mods[i].v[k];
        }
    char cfg[512];
    snprintf(cfg, sizeof cfg, "{\"peft_type\": \"LORA\", \"r\": %d, \"lora_alpha\": 8, \"use_dora\": true, "
             "\"target_modules\": [\"embed_tokens\", \"k_proj\", \"down_proj\"%s]}", DORA_R,
             head ? ", \"lm_head\"" : "");
    write_text(dir, "adapter_config.json", cfg);
    char *path = lm_path_join(dir, "adapter_model.safetensors");
    lm_err err;
    CHECK_OK(lm_st_write_file(path, desc, data, 3 * n, NULL, &err), &err);
    free(path);
    for (int i = 0; i < n; i++)
        for (int k = 0; k < 3; k++)
            free(mods[i].v[k]);
}

// One DoRA case: the forward pass against the reference (which merges the DoRA weights
// explicitly), and the scaling must matter: the same LoRA without it gives other logits.
static void check_dora(lm_dev *cpu, const char *label, lm_model *m, lm_adapter *a)
{
    if (!m || !a)
        return;
    double *with = check_model(cpu, label, m, a, false);
    seqs q;
    load_seqs(&q, m->config.vocab_size);
    lm_adapter plain = without_magnitudes(a);
    double *without = ref_logits(m, &plain, &q);
    double d = with ? rel_diff_d(with, without, q.T * m->config.vocab_size) : 0;
    CHECK_MSG(d > 20 * REL, "%s: the DoRA scaling changes the logits by only %g", label, d);
    printf("%-28s the DoRA scaling changes the logits by %.2e\n", label, d);
    free(plain.modules);
    free(without);
    free(with);
    free_seqs(&q);
}

static void test_dora(lm_dev *cpu, lm_dev *sim)
{
    lm_err err;
    lm_model *base = fixture_model("base"), *qwen = fixture_model("qwen");
    // the fixture: DoRA on q_proj and v_proj of the Llama base
    lm_adapter *fxd = fixture_adapter("lora_dora");
    CHECK_OK(lm_fwd_check(base, fxd, &err), &err);
    check_dora(cpu, "base + lora_dora", base, fxd);

    // written here: DoRA on the embedding, k_proj, down_proj and lm_head of the Llama base, and
    // on the tied Qwen2 model (whose lm_head must keep reading the base's embedding)
    char *dir = make_tmpdir(), *d1 = subdir(dir, "llama"), *d2 = subdir(dir, "qwen");
    lm_adapter *ab = NULL, *aq = NULL;
    if (base && qwen) {
        write_dora(d1, base, 11);
        write_dora(d2, qwen, 12);
        CHECK_OK(lm_adapter_open(&ab, d1, &err), &err);
        CHECK_OK(lm_adapter_open(&aq, d2, &err), &err);
    }
    check_dora(cpu, "base + DoRA embed/k/down/head", base, ab);
    check_dora(cpu, "qwen (tied) + DoRA embed/k/down", qwen, aq);

    // on the sim device: the CPU's logits bit for bit, nothing left allocated, and a budget that
    // holds the weights but not the DoRA scratch is out of device memory (a runner's fallback)
    if (ab && sim) {
        seqs q;
        load_seqs(&q, base->config.vocab_size);
        lm_fwd *fc = NULL, *fs = NULL;
        CHECK_OK(lm_fwd_create(&fc, base, ab, cpu, &err), &err);
        CHECK_OK(lm_fwd_create(&fs, base, ab, sim, &err), &err);
        if (fc && fs) {
            int64_t V = base->config.vocab_size;
            float *lc = run_logits(fc, &q, V), *ls = run_logits(fs, &q, V);
            CHECK_MSG(memcmp(lc, ls, (size_t)(q.T * V) * sizeof *lc) == 0, "DoRA: sim and cpu differ");
            free(lc);
            free(ls);
        }
        lm_fwd_free(fc);
        lm_fwd_free(fs);
        free_seqs(&q);
        size_t fr = 0, tot = 0;
        lm_dev_mem_info(sim, &fr, &tot);
        CHECK_MSG(fr == tot, "DoRA on sim: %llu bytes left allocated", (unsigned long long)(tot - fr));
    }

    // DoRA with fan_in_fan_out is refused by name before anything is placed
    if (fxd) {
        lm_adapter fio = *fxd;
        fio.config.fan_in_fan_out = true;
        lm_fwd *f = NULL;
        CHECK_FAILS(lm_fwd_check(base, &fio, &err), LM_ERR_UNSUPPORTED, "fan_in_fan_out", &err);
        CHECK_FAILS(lm_fwd_create(&f, base, &fio, cpu, &err), LM_ERR_UNSUPPORTED, "DoRA with fan_in_fan_out", &err);
        CHECK(f == NULL);
    }
    lm_adapter_free(ab);
    lm_adapter_free(aq);
    lm_adapter_free(fxd);
    free(d1);
    free(d2);
    remove_tmpdir(dir);
    lm_model_free(base);
    lm_model_free(qwen);
}

// ==== batches, threads, devices, hooks ========================================================

typedef struct capture {
    int calls[8][LM_FWD_N_POINTS];
    int64_t rows, cols[LM_FWD_N_POINTS];
    double *x[8][LM_FWD_N_POINTS];  // what the hook saw, (rows, cols)
    int fail_layer;                 // return an error at this layer's first point (-1: never)
} capture;

static lm_status on_hook(void *ctx, lm_dev *dev, int layer, lm_fwd_point point, const float *x, int64_t rows,
                         int64_t cols, lm_err *err)
{
    capture *c = ctx;
    if (layer == c->fail_layer)
        return lm_err_set(err, LM_ERR_INTERRUPTED, "stopped by the hook at layer %d", layer);
    if (layer < 0 || layer >= 8 || (int)point < 0 || point >= LM_FWD_N_POINTS)
        return lm_err_set(err, LM_ERR_USAGE, "bad hook call");
    c->calls[layer][point]++;
    c->rows = rows;
    c->cols[point] = cols;
    float *h = malloc((size_t)(rows * cols) * sizeof *h);
    lm_status s = lm_dev_download(dev, h, x, (size_t)(rows * cols) * sizeof *h, err);
    free(c->x[layer][point]);
    c->x[layer][point] = malloc((size_t)(rows * cols) * sizeof(double));
    for (int64_t i = 0; i < rows * cols; i++)
        c->x[layer][point][i] = h[i];
    free(h);
    return s;
}

static void test_batches(lm_dev *cpu1, lm_dev *cpu3, lm_dev *sim)
{
    lm_err err;
    lm_model *m = fixture_model("llama3");
    lm_adapter *a = NULL;
    lm_model *base = fixture_model("base");
    if (!m || !base) {
        lm_model_free(m);
        lm_model_free(base);
        return;
    }
    a = fixture_adapter("lora_rslora");
    int64_t V = m->config.vocab_size;
    seqs q;
    load_seqs(&q, V);

    // packed = one at a time, bit for bit, on 1 and 3 threads and on the sim device
    struct { lm_model *m; lm_adapter *a; const char *name; } cases[] = {{m, NULL, "llama3"},
                                                                        {base, a, "base + lora_rslora"}};
    for (int k = 0; k < 2; k++) {
        lm_fwd *f1 = NULL, *f3 = NULL, *fs = NULL;
        CHECK_OK(lm_fwd_create(&f1, cases[k].m, cases[k].a, cpu1, &err), &err);
        CHECK_OK(lm_fwd_create(&f3, cases[k].m, cases[k].a, cpu3, &err), &err);
        CHECK_OK(lm_fwd_create(&fs, cases[k].m, cases[k].a, sim, &err), &err);
        if (!f1 || !f3 || !fs) {
            lm_fwd_free(f1);
            lm_fwd_free(f3);
            lm_fwd_free(fs);
            continue;
        }
        float *packed = run_logits(f3, &q, V), *p1 = run_logits(f1, &q, V), *ps = run_logits(fs, &q, V);
        float *alone = malloc((size_t)(q.T * V) * sizeof *alone);
        for (int64_t i = 0, row = 0; i < q.n; row += q.s[i].len, i++) {
            lm_fwd_req req = {.logits = alone + row * V};
            CHECK_OK(lm_fwd_run(f3, &q.s[i], 1, &req, &err), &err);
        }
        // Packed and alone, 1 and 3 threads agree to float32 rounding: OpenBLAS picks its kernel by
        // the matrix sizes, and for matrices as small as these a row's sum can round differently
        // with the number of rows beside it. The sim runs the CPU's code with the same threads
        // and batch: bit for bit.
        size_t bytes = (size_t)(q.T * V) * sizeof *alone;
        double scale = max_abs(packed, q.T * V), d_alone = max_diff(packed, alone, q.T * V) / scale;
        double d_threads = max_diff(packed, p1, q.T * V) / scale;
        CHECK_MSG(d_alone < ROUNDING, "%s: packed logits differ from one sequence at a time by %g", cases[k].name,
                  d_alone);
        CHECK_MSG(d_threads < ROUNDING, "%s: 3 threads and 1 thread differ by %g", cases[k].name, d_threads);
        CHECK_MSG(memcmp(packed, ps, bytes) == 0, "%s: sim and cpu differ", cases[k].name);
        printf("%-28s packed vs alone %.1e, 1 vs 3 threads %.1e (relative)\n", cases[k].name, d_alone, d_threads);
        // a reversed order packs the sequences differently and still changes nothing
        lm_fwd_seq *rev = malloc((size_t)q.n * sizeof *rev);
        for (int64_t i = 0; i < q.n; i++)
            rev[i] = q.s[q.n - 1 - i];
        float *rl = malloc(bytes);
        lm_fwd_req rq = {.logits = rl};
        CHECK_OK(lm_fwd_run(f3, rev, q.n, &rq, &err), &err);
        double d_order = 0;
        for (int64_t i = 0, row = 0, rrow = q.T; i < q.n; row += q.s[i].len, i++) {
            rrow -= q.s[i].len;
            double d = max_diff(packed + row * V, rl + rrow * V, q.s[i].len * V) / scale;
            d_order = d > d_order ? d : d_order;
        }
        CHECK_MSG(d_order < ROUNDING, "%s: the packing order changes logits by %g", cases[k].name, d_order);
        // nll rows: each sequence's last row 0, the others the log-softmax of their logits
        float *nll = malloc((size_t)q.T * sizeof *nll);
        lm_fwd_req nq = {.nll = nll};
        CHECK_OK(lm_fwd_run(fs, q.s, q.n, &nq, &err), &err);
        double worst = 0;
        for (int64_t i = 0, row = 0; i < q.n; row += q.s[i].len, i++)
            for (int64_t p = 0; p < q.s[i].len; p++) {
                const float *x = packed + (row + p) * V;
                double want = 0;
                if (p + 1 < q.s[i].len) {
                    double mx = -INFINITY, sum = 0;
                    for (int64_t c = 0; c < V; c++)
                        mx = x[c] > mx ? x[c] : mx;
                    for (int64_t c = 0; c < V; c++)
                        sum += exp(x[c] - mx);
                    want = mx + log(sum) - x[q.s[i].ids[p + 1]];
                }
                double e = fabs(nll[row + p] - want);
                worst = e > worst ? e : worst;
            }
        CHECK_MSG(worst < 1e-5, "%s: nll off by %g", cases[k].name, worst);
        free(nll);
        free(rl);
        free(rev);
        free(packed);
        free(p1);
        free(ps);
        free(alone);
        lm_fwd_free(f1);
        lm_fwd_free(f3);
        lm_fwd_free(fs);
    }

    // the hook: each layer's four linear inputs once per batch, real tokens only, as the
    // reference computes them for each sequence; the pass stops without logits when none are asked
    lm_fwd *f = NULL;
    CHECK_OK(lm_fwd_create(&f, m, NULL, sim, &err), &err);
    if (f) {
        capture cap = {.fail_layer = -1};
        lm_fwd_req req = {.hook = on_hook, .hook_ctx = &cap};
        CHECK_OK(lm_fwd_run(f, q.s, 3, &req, &err), &err);
        int64_t T3 = q.s[0].len + q.s[1].len + q.s[2].len;
        const lm_config *cfg = &m->config;
        int64_t want_cols[LM_FWD_N_POINTS] = {cfg->hidden_size, cfg->num_attention_heads * cfg->head_dim,
                                              cfg->hidden_size, cfg->intermediate_size};
        CHECK(cap.rows == T3);
        for (int p = 0; p < LM_FWD_N_POINTS; p++) {
            CHECK(cap.cols[p] == want_cols[p]);
            for (int l = 0; l < cfg->num_hidden_layers; l++)
                CHECK(cap.calls[l][p] == 1);
        }
        ref_ctx c = {m, NULL, false};
        double worst = 0;
        for (int64_t i = 0, row = 0; i < 3; row += q.s[i].len, i++) {
            ref_out o;
            ref_forward(&c, q.s[i].ids, q.s[i].len, &o);
            for (int l = 0; l < cfg->num_hidden_layers; l++)
                for (int p = 0; p < LM_FWD_N_POINTS; p++) {
                    double e = rel_diff_d(cap.x[l][p] + row * want_cols[p], o.points[l][p], q.s[i].len * want_cols[p]);
                    worst = e > worst ? e : worst;
                }
            ref_free(&o);
        }
        CHECK_MSG(worst < REL, "hook inputs differ from the reference by %g", worst);
        CHECK(strcmp(lm_fwd_point_module(LM_FWD_DOWN_IN), "mlp.down_proj") == 0);
        for (int l = 0; l < 8; l++)
            for (int p = 0; p < LM_FWD_N_POINTS; p++)
                free(cap.x[l][p]);
        // a hook's failure stops the pass and comes back as it was
        capture stop = {.fail_layer = 1};
        lm_fwd_req sreq = {.hook = on_hook, .hook_ctx = &stop, .nll = (float[64]){0}};
        CHECK_FAILS(lm_fwd_run(f, q.s, 1, &sreq, &err), LM_ERR_INTERRUPTED, "stopped by the hook at layer 1", &err);
        CHECK(stop.calls[0][LM_FWD_DOWN_IN] == 1 && stop.calls[1][LM_FWD_ATTN_IN] == 0);
        for (int l = 0; l < 8; l++)
            for (int p = 0; p < LM_FWD_N_POINTS; p++)
                free(stop.x[l][p]);

        // an id outside the vocabulary is refused, naming where
        int32_t bad_ids[3] = {1, 300, 2};
        lm_fwd_seq two[2] = {q.s[0], {bad_ids, 3}};
        float nll[64];
        lm_fwd_req nreq = {.nll = nll};
        CHECK_FAILS(lm_fwd_run(f, two, 2, &nreq, &err), LM_ERR_FORMAT, "sequence 2, position 1: token id 300", &err);
        lm_fwd_seq empty = {bad_ids, 0};
        CHECK_FAILS(lm_fwd_run(f, &empty, 1, &nreq, &err), LM_ERR_USAGE, "sequence 1 has 0 tokens", &err);
    }
    lm_fwd_free(f);
    lm_adapter_free(a);
    free_seqs(&q);
    lm_model_free(m);
    lm_model_free(base);
}

// ==== fallbacks ===============================================================================

// Synthetic sequences of the given lengths (ids from a fixed stream).
static void make_seqs(lm_fwd_seq *s, int32_t *ids, const int64_t *lens, int n)
{
    uint64_t x = 99;
    for (int i = 0; i < n; i++) {
        s[i].ids = ids;
        s[i].len = lens[i];
        for (int64_t p = 0; p < lens[i]; p++) {
            x = x * 6364136223846793005ull + 1442695040888963407ull;
            *ids++ = (int32_t)((x >> 33) % 256);
        }
    }
}

// Runs the sequences through a runner on sim:budget and compares the NLLs with `want`.
static lm_fwd_runner run_on_budget(const lm_model *m, const lm_adapter *a, uint64_t budget, const char *fail,
                                   const lm_fwd_seq *s, int n, int64_t max_tokens, const float *want, int64_t T,
                                   notes *nt, lm_status expect)
{
    lm_err err = {0};
    lm_dev *sim = NULL;
    lm_fwd_runner r;
    memset(&r, 0, sizeof r);
    CHECK_OK(lm_dev_sim_create(&sim, budget, fail, 2, &err), &err);
    if (!sim)
        return r;
    memset(nt, 0, sizeof *nt);
    lm_status st = lm_fwd_runner_init(&r, m, a, sim, "test", "MODEL", max_tokens, collect_note, nt, &err);
    CHECK_OK(st, &err);
    if (st == LM_OK) {
        float *nll = calloc((size_t)T, sizeof *nll);
        lm_fwd_req req = {.nll = nll};
        st = lm_fwd_runner_run(&r, s, n, &req, &err);
        CHECK_MSG(st == expect, "budget %llu: %s (%s), wanted %s", (unsigned long long)budget, lm_status_name(st),
                  err.msg, lm_status_name(expect));
        if (st == LM_ERR_DEVICE)  // the message names the batch and the device
            CHECK_MSG(strstr(err.msg, "test sequences ") && strstr(err.msg, " on sim:"), "%s", err.msg);
        if (st == LM_OK) {
            // the same NLL for every prediction (to float32 rounding), so the same perplexity
            double worst = 0, sum = 0, sum_want = 0;
            for (int64_t i = 0; i < T; i++) {
                double d = fabs((double)nll[i] - want[i]);
                worst = d > worst || isnan(d) ? d : worst;
                sum += nll[i];
                sum_want += want[i];
            }
            CHECK_MSG(worst < 1e-5, "budget %llu: the NLLs differ by up to %g", (unsigned long long)budget, worst);
            double ppl = exp(sum / (T - n)), ppl_want = exp(sum_want / (T - n));
            CHECK_MSG(fabs(ppl - ppl_want) <= 1e-6 * ppl_want, "budget %llu: perplexity %.9g, on the cpu %.9g",
                      (unsigned long long)budget, ppl, ppl_want);
        }
        free(nll);
    }
    lm_fwd_runner_free(&r);
    lm_fwd_runner_free(&r);  // twice is safe
    size_t fr = 0, tot = 0;
    lm_dev_mem_info(sim, &fr, &tot);
    CHECK_MSG(fr == tot, "budget %llu: %llu bytes left allocated", (unsigned long long)budget,
              (unsigned long long)(tot - fr));
    lm_dev_destroy(sim);
    return r;
}

static void test_fallbacks(lm_dev *cpu)
{
    lm_err err;
    lm_model *m = fixture_model("base");
    lm_adapter *a = fixture_adapter("lora_mts");
    if (!m || !a) {
        lm_model_free(m);
        lm_adapter_free(a);
        return;
    }
    // sequences 30, 5, 6 tokens and 4 × 10 in batches of at most 40: [30 5] [6 10 10 10] [10]
    static const int64_t lens[] = {30, 5, 6, 10, 10, 10, 10};
    enum { N = 7, T = 81 };
    lm_fwd_seq s[N];
    int32_t ids[T];
    make_seqs(s, ids, lens, N);

    // what the CPU says, and the sizes on a device
    float want[T];
    lm_fwd *f = NULL;
    CHECK_OK(lm_fwd_create(&f, m, a, cpu, &err), &err);
    lm_fwd_req req = {.nll = want};
    if (f)
        CHECK_OK(lm_fwd_run(f, s, N, &req, &err), &err);
    lm_fwd_free(f);
    f = NULL;
    lm_dev *big = NULL;
    CHECK_OK(lm_dev_sim_create(&big, 1ull << 30, NULL, 1, &err), &err);
    CHECK_OK(lm_fwd_create(&f, m, a, big, &err), &err);
    if (!f) {
        lm_dev_destroy(big);
        lm_model_free(m);
        lm_adapter_free(a);
        return;
    }
    uint64_t W = lm_fwd_weight_bytes(f);
    CHECK(W > 100000 && lm_fwd_arena_bytes(f, 35) < lm_fwd_arena_bytes(f, 36));
    uint64_t A21 = lm_fwd_arena_bytes(f, 21), A35 = lm_fwd_arena_bytes(f, 35), A36 = lm_fwd_arena_bytes(f, 36);
    lm_fwd_free(f);
    size_t fr, tot;
    lm_dev_mem_info(big, &fr, &tot);
    CHECK(fr == tot);
    lm_dev_destroy(big);

    notes nt;
    // everything fits: no fallback, 3 batches on the device
    lm_fwd_runner r = run_on_budget(m, a, W + A36, NULL, s, N, 40, want, T, &nt, LM_OK);
    CHECK(!r.weights_fell_back && r.n_halved == 0 && r.n_seq_cpu == 0 && r.tokens_dev == T && r.n_batches == 3);
    CHECK(nt.n == 0);

    // the weights do not fit: the model runs on the CPU, said once
    r = run_on_budget(m, a, W - 1, NULL, s, N, 40, want, T, &nt, LM_OK);
    CHECK(r.weights_fell_back && r.tokens_cpu == T && r.tokens_dev == 0 && r.n_halved == 0);
    CHECK_MSG(nt.n == 1 && strstr(nt.text, "fallback: test weights of MODEL on cpu (sim:") &&
              strstr(nt.text, "out of memory"), "notes: %s", nt.text);
    // said with its description, for the commands' --log-json event
    CHECK_MSG(nt.fallbacks == 1 && !strcmp(nt.phase, "test") && !strcmp(nt.unit, "weights of MODEL") &&
              !strncmp(nt.from, "sim:", 4) && !strcmp(nt.to, "cpu"), "fallback %d: %s %s from %s to %s", nt.fallbacks,
              nt.phase, nt.unit, nt.from, nt.to);

    // [6 10 10 10] (36 tokens) does not fit, its halves [6 10] and [10 10] do
    r = run_on_budget(m, a, W + A35, NULL, s, N, 40, want, T, &nt, LM_OK);
    CHECK_MSG(!r.weights_fell_back && r.n_halved == 1 && r.n_seq_cpu == 0 && r.tokens_dev == T,
              "halved %lld, cpu %lld, dev %lld", (long long)r.n_halved, (long long)r.n_seq_cpu, (long long)r.tokens_dev);
    CHECK_MSG(strstr(nt.text, "fallback: test sequences 3-6 (36 tokens) halved on sim:") != NULL, "notes: %s", nt.text);
    CHECK_MSG(nt.fallbacks == 1 && !strcmp(nt.unit, "sequences 3-6 (36 tokens) halved") &&
              !strcmp(nt.from, nt.to) && !strncmp(nt.to, "sim:", 4), "fallback %d: %s from %s to %s", nt.fallbacks,
              nt.unit, nt.from, nt.to);

    // 30 tokens do not fit even alone: [30 5] halves, 30 goes to the CPU, and 5 and everything
    // after run on the device again ([6 10 10 10] halved into [6 10] and [10 10])
    r = run_on_budget(m, a, W + A21, NULL, s, N, 40, want, T, &nt, LM_OK);
    CHECK_MSG(r.n_seq_cpu == 1 && r.tokens_cpu == 30 && r.tokens_dev == T - 30 && r.n_halved == 2,
              "halved %lld, cpu %lld (%lld tokens), dev %lld", (long long)r.n_halved, (long long)r.n_seq_cpu,
              (long long)r.tokens_cpu, (long long)r.tokens_dev);
    CHECK_MSG(strstr(nt.text, "fallback: test sequence 1 (30 tokens) on cpu (activations of a batch of 30 tokens: "
                              "sim:") != NULL, "notes: %s", nt.text);
    CHECK_MSG(nt.fallbacks == nt.n && nt.n == 3, "%d of %d lines said as fallbacks: %s", nt.fallbacks, nt.n, nt.text);

    // a device failure that is not out of memory stops the run: no fallback
    r = run_on_budget(m, a, W + A36, "launch:100", s, N, 40, want, T, &nt, LM_ERR_DEVICE);
    CHECK(r.n_seq_cpu == 0 && r.n_halved == 0 && r.n_batches >= 1 && r.n_batches < 3);
    CHECK(strstr(nt.text, "fallback") == NULL);

    lm_adapter_free(a);
    lm_model_free(m);
}

// ==== the operations and the interface ========================================================

static void test_ops(lm_dev *cpu, lm_dev *sim)
{
    lm_err err;
    // nll: stable for large logits; targets outside the row give 0
    float lg[2 * 3] = {1000.0f, 1000.0f, 998.0f, -5.0f, 0.0f, 5.0f}, nll[2] = {-1, -1};
    int32_t tg[2] = {2, -1};
    CHECK_OK(lm_dev_nll_rows(cpu, nll, lg, tg, 2, 3, &err), &err);
    double want = log(2.0 + exp(-2.0)) + 2.0;
    CHECK_NEAR(nll[0], want, 1e-5);
    CHECK(nll[1] == 0.0f);
    // gather: an id outside the table gives a zero row
    float table[2 * 2] = {1, 2, 3, 4}, out[3 * 2];
    int32_t ids[3] = {1, 7, 0};
    CHECK_OK(lm_dev_gather_rows(cpu, out, table, 2, 2, ids, 3, &err), &err);
    CHECK(out[0] == 3 && out[1] == 4 && out[2] == 0 && out[3] == 0 && out[4] == 1 && out[5] == 2);
    // rope at position 0 is the identity; at 1 a rotation by inv_freq
    float x[4] = {1, 2, 3, 4}, inv[2] = {0.5f, 0.25f};
    int32_t pos[1] = {0};
    CHECK_OK(lm_dev_rope(cpu, x, 1, 1, 4, pos, inv, &err), &err);
    CHECK(x[0] == 1 && x[1] == 2 && x[2] == 3 && x[3] == 4);
    pos[0] = 1;
    CHECK_OK(lm_dev_rope(cpu, x, 1, 1, 4, pos, inv, &err), &err);
    CHECK_NEAR(x[0], 1 * cos(0.5) - 3 * sin(0.5), 1e-6);
    CHECK_NEAR(x[2], 3 * cos(0.5) + 1 * sin(0.5), 1e-6);
    CHECK_NEAR(x[3], 4 * cos(0.25) + 2 * sin(0.25), 1e-6);
    // attention: row 0 sees only itself; start clamps rows into their sequence
    float q[2] = {1, 1}, k[2] = {1, 2}, v[2] = {10, 20}, o[2];
    int32_t start[2] = {0, 1};
    CHECK_OK(lm_dev_attention(cpu, o, q, k, v, start, 2, 1, 1, 1, 1.0f, &err), &err);
    CHECK(o[0] == 10 && o[1] == 20);
    start[1] = 0;
    CHECK_OK(lm_dev_attention(cpu, o, q, k, v, start, 2, 1, 1, 1, 1.0f, &err), &err);
    CHECK_NEAR(o[1], (10 * exp(1.0) + 20 * exp(2.0)) / (exp(1.0) + exp(2.0)), 1e-4);
    CHECK_FAILS(lm_dev_attention(cpu, o, q, k, v, start, 2, 3, 2, 1, 1.0f, &err), LM_ERR_USAGE, "multiple", &err);
    // silu_mul
    float gte[2] = {0.0f, 2.0f}, up[2] = {3.0f, 0.5f};
    CHECK_OK(lm_dev_silu_mul(cpu, gte, up, 2, &err), &err);
    CHECK(gte[0] == 0.0f);
    CHECK_NEAR(gte[1], 2.0 / (1.0 + exp(-2.0)) * 0.5, 1e-6);

    // the sim checks every pointer of the new operations
    float *d = NULL;
    CHECK_OK(lm_dev_alloc(sim, 64 * sizeof(float), (void **)&d, &err), &err);
    if (d) {
        const char *nots = "not a sim buffer";
        CHECK_FAILS(lm_dev_rmsnorm(sim, d, lg, d, 1, 4, 1e-5f, &err), LM_ERR_DEVICE, "sim: rmsnorm", &err);
        CHECK_FAILS(lm_dev_rmsnorm(sim, d, d, d, 9, 8, 1e-5f, &err), LM_ERR_DEVICE, "run past the end", &err);
        CHECK_FAILS(lm_dev_gather_rows(sim, d, d, 2, 2, ids, 3, &err), LM_ERR_DEVICE, "(ids:", &err);
        CHECK_FAILS(lm_dev_add_rows(sim, d, table, 2, 2, &err), LM_ERR_DEVICE, "(b:", &err);
        CHECK_FAILS(lm_dev_rope(sim, d, 1, 1, 4, pos, d, &err), LM_ERR_DEVICE, "(pos:", &err);
        CHECK_FAILS(lm_dev_attention(sim, d, d, d, v, (int32_t *)(void *)d, 2, 1, 1, 1, 1.0f, &err), LM_ERR_DEVICE,
                    "(v:", &err);
        CHECK_FAILS(lm_dev_silu_mul(sim, gte, d, 2, &err), LM_ERR_DEVICE, nots, &err);
        CHECK_FAILS(lm_dev_nll_rows(sim, d, d, tg, 2, 3, &err), LM_ERR_DEVICE, "(targets:", &err);
        CHECK_FAILS(lm_dev_nll_rows(sim, d, d, (int32_t *)(void *)d, -1, 3, &err), LM_ERR_DEVICE, "invalid count",
                    &err);
        lm_dev_buf_free(sim, d);
    }

    // a device without the forward operations: refused by name, and a runner goes to the CPU
    lm_dev_i lacking = *cpu->iface;
    lacking.rope = NULL;
    lm_dev fake = *cpu;
    fake.iface = &lacking;
    CHECK_FAILS(lm_dev_rope(&fake, x, 1, 1, 4, pos, inv, &err), LM_ERR_UNSUPPORTED,
                "cpu: the operation rope is not implemented on this device", &err);
    CHECK_FAILS(lm_dev_require(&fake, LM_OP_FORWARD, &err), LM_ERR_UNSUPPORTED, "rope", &err);
    CHECK_OK(lm_dev_require(cpu, LM_OP_FORWARD, &err), &err);
    CHECK_OK(lm_dev_require(sim, LM_OP_FORWARD, &err), &err);
    lm_model *m = fixture_model("qwen");
    if (m) {
        lm_fwd *f = NULL;
        CHECK_FAILS(lm_fwd_create(&f, m, NULL, &fake, &err), LM_ERR_UNSUPPORTED, "rope", &err);
        notes nt = {0};
        lm_fwd_runner r;
        CHECK_OK(lm_fwd_runner_init(&r, m, NULL, &fake, "eval", "qwen", 0, collect_note, &nt, &err), &err);
        CHECK(r.weights_fell_back && r.on_dev == NULL && r.on_cpu != NULL);
        CHECK_MSG(strstr(nt.text, "fallback: eval weights of qwen on cpu (cpu: the operation rope") != NULL, "%s",
                  nt.text);
        lm_fwd_runner_free(&r);
    }
    lm_model_free(m);
    lm_dev_destroy(fake.companion);  // the CPU the runner fell back to; fake itself is a copy
}

int main(void)
{
    if (!fixture_env("test_forward"))
        return 1;
    lm_err err;
    lm_dev *cpu1 = NULL, *cpu3 = NULL, *sim = NULL;
    CHECK_OK(lm_dev_cpu_create(&cpu1, 1, &err), &err);
    CHECK_OK(lm_dev_cpu_create(&cpu3, 3, &err), &err);
    CHECK_OK(lm_dev_sim_create(&sim, 64u << 20, NULL, 3, &err), &err);
    if (cpu1 && cpu3 && sim) {
        test_ops(cpu3, sim);
        test_reference(cpu3);
        test_dora(cpu3, sim);
        test_batches(cpu1, cpu3, sim);
        test_fallbacks(cpu3);
    }
    lm_dev_destroy(cpu1);
    lm_dev_destroy(cpu3);
    lm_dev_destroy(sim);
    return check_report("test_forward");
}
