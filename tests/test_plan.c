// Tests of the sizes `llmerge plan` predicts for sparsegpt's Hessian capture, against what the
// code allocates when it runs, on the generated fixtures (LLMERGE_FIXTURES): lm_fwd_plan_make's
// weight bytes are lm_fwd_create's (on the CPU, where F32 tensors are used in place, and on a
// simulated device, where every tensor is converted), its arena bytes lm_fwd_arena_bytes';
// lm_hess_plan_make places the accumulators where lm_hess_init does at several free budgets;
// lm_fwd_plan_runner predicts exactly the fallbacks lm_hess_ucc2_model reports on simulated
// devices of several sizes (weights on the CPU, batches halved, sequences on the CPU, sticky);
// lm_hess_point_of names the Hessian of each linear weight; lm_plan_make's capture phases
// and importance buffers follow from them; and the merge's units fall back on a simulated device
// exactly where lm_plan_make, sizing them with the functions the run allocates by, says they will.
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "adapter.h"
#include "check.h"
#include "device.h"
#include "fixture.h"
#include "forward.h"
#include "hessian.h"
#include "model.h"
#include "plan.h"
#include "st_writer.h"
#include "util.h"

// The adapter fixtures/name, opened and validated against base; NULL where it did not open.
static lm_adapter *open_adapter(const char *name, const lm_model *base)
{
    lm_err err = {0};
    lm_adapter *a = fixture_adapter(name);
    if (a)
        CHECK_OK(lm_adapter_validate(a, base, &err), &err);
    return a;
}

// ==== weights and activations =================================================================

// The plan's weight and arena bytes against a model placed on the device.
static void check_weights(const char *label, const lm_model *m, const lm_adapter *a, lm_dev *d)
{
    lm_err err = {0};
    lm_fwd_plan p;
    lm_fwd *f = NULL;
    CHECK_OK(lm_fwd_plan_make(&p, m, a, lm_dev_host_memory(d), &err), &err);
    CHECK_OK(lm_fwd_create(&f, m, a, d, &err), &err);
    if (!f)
        return;
    CHECK_MSG(p.weight_bytes == lm_fwd_weight_bytes(f), "%s on %s: plan %" PRIu64 " weight bytes, placed %zu", label,
              lm_dev_name(d), p.weight_bytes, lm_fwd_weight_bytes(f));
    if (!lm_dev_host_memory(d)) {
        size_t fr = 0, tot = 0;
        lm_dev_mem_info(d, &fr, &tot);
        CHECK_MSG(tot - fr == p.weight_bytes, "%s: %zu bytes in use on %s, plan %" PRIu64, label, tot - fr,
                  lm_dev_name(d), p.weight_bytes);
        CHECK(p.host_scratch > 0);  // every tensor went through a host copy
    }
    CHECK(p.mapped_bytes > 0 && p.mapped_bytes <= lm_model_nbytes(m) + (a ? (uint64_t)a->st->size : 0));
    const int64_t T[] = {1, 7, 155, 4096, 70000};
    for (size_t i = 0; i < sizeof T / sizeof T[0]; i++) {
        CHECK_MSG(lm_fwd_plan_arena_bytes(&p, T[i]) == lm_fwd_arena_bytes(f, T[i]), "%s: arena of %" PRId64
                  " tokens: plan %zu, forward %zu", label, T[i], lm_fwd_plan_arena_bytes(&p, T[i]),
                  lm_fwd_arena_bytes(f, T[i]));
        // a pass without logits writes less than it allocates, and more than nothing
        size_t touched = lm_fwd_plan_arena_touched(&p, T[i]);
        CHECK(touched > 0 && touched < lm_fwd_plan_arena_bytes(&p, T[i]));
    }
    lm_fwd_free(f);
}

static void test_weights(lm_dev *cpu, lm_dev *sim)
{
    lm_model *base = fixture_model("base"), *qwen = fixture_model("qwen"), *llama3 = fixture_model("llama3");
    lm_adapter *plain = base ? open_adapter("lora_plain", base) : NULL;
    lm_adapter *rs = base ? open_adapter("lora_rslora", base) : NULL;
    lm_adapter *mts = base ? open_adapter("lora_mts", base) : NULL;
    lm_adapter *bias = qwen ? open_adapter("lora_bias", qwen) : NULL;
    lm_adapter *dora = base ? open_adapter("lora_dora", base) : NULL;
    struct { const char *label; const lm_model *m; const lm_adapter *a; } cases[] = {
        {"base", base, NULL},                  // BF16: every tensor converted, even on the CPU
        {"base+lora_plain", base, plain},      // F32 factors: in place on the CPU
        {"base+lora_rslora", base, rs},        // BF16 factors, per-module ranks
        {"base+lora_mts", base, mts},          // embedding LoRA (Aᵀ staged), a saved lm_head
        {"base+lora_dora", base, dora},        // DoRA: W and B placed scaled, even F32 on the CPU
        {"qwen", qwen, NULL},                  // F32, tied: nothing converted on the CPU
        {"qwen+lora_bias", qwen, bias},        // bias sums made in host memory
        {"llama3", llama3, NULL},              // F16, biases everywhere
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        if (!cases[i].m)
            continue;
        check_weights(cases[i].label, cases[i].m, cases[i].a, cpu);
        check_weights(cases[i].label, cases[i].m, cases[i].a, sim);
    }
    // the F32 model is used in place on the CPU: only the rope table is allocated there
    if (qwen) {
        lm_err err = {0};
        lm_fwd_plan p;
        CHECK_OK(lm_fwd_plan_make(&p, qwen, NULL, true, &err), &err);
        CHECK(p.weight_bytes == (uint64_t)(qwen->config.head_dim / 2) * sizeof(float));
    }
    lm_adapter_free(dora);
    lm_adapter_free(plain);
    lm_adapter_free(rs);
    lm_adapter_free(mts);
    lm_adapter_free(bias);
    lm_model_free(base);
    lm_model_free(qwen);
    lm_model_free(llama3);
}

// ==== accumulators ============================================================================

// lm_hess_plan_make against lm_hess_init on a simulated device with `taken` bytes already in
// use and `reserve` kept free.
static void check_accumulators(const lm_model *m, uint64_t budget, uint64_t taken, size_t reserve)
{
    lm_err err = {0};
    lm_dev *sim = NULL;
    CHECK_OK(lm_dev_sim_create(&sim, budget, NULL, 2, &err), &err);
    if (!sim)
        return;
    void *hold = NULL;
    if (taken)
        CHECK_OK(lm_dev_alloc(sim, taken, &hold, &err), &err);
    lm_hess h;
    CHECK_OK(lm_hess_init(&h, m, sim, true, reserve, &err), &err);
    lm_hess_plan p;
    CHECK_OK(lm_hess_plan_make(&p, m, true, false, budget - taken, reserve, &err), &err);
    CHECK_MSG(p.dev_bytes == h.dev_bytes && p.n_acc - p.n_dev == h.n_host,
              "budget %" PRIu64 ", reserve %zu: plan %" PRId64 " on the device (%" PRIu64 " bytes), init %" PRId64
              " in host memory (%zu bytes on the device)", budget, reserve, p.n_dev, p.dev_bytes, h.n_host,
              h.dev_bytes);
    uint64_t all = 0;
    for (int64_t i = 0; i < p.n_acc; i++)
        all += (uint64_t)h.dim[i % LM_FWD_N_POINTS] * (uint64_t)h.dim[i % LM_FWD_N_POINTS] * sizeof(float);
    CHECK(p.dev_bytes + p.host_bytes == all);
    lm_hess_free(&h);
    lm_dev_buf_free(sim, hold);
    lm_dev_destroy(sim);
}

static void test_accumulators(void)
{
    lm_model *base = fixture_model("base");
    if (!base)
        return;
    // 16 KiB per [64, 64] accumulator, 64 KiB per [128, 128]: 224 KiB in all
    const uint64_t budgets[] = {8u << 10, 20u << 10, 100u << 10, 300u << 10, 1u << 20};
    const size_t reserves[] = {0, 10u << 10, 50u << 10};
    for (size_t b = 0; b < sizeof budgets / sizeof budgets[0]; b++)
        for (size_t r = 0; r < sizeof reserves / sizeof reserves[0]; r++) {
            check_accumulators(base, budgets[b], 0, reserves[r]);
            check_accumulators(base, budgets[b] + (5u << 10), 5u << 10, reserves[r]);
        }
    lm_err err = {0};
    lm_hess_plan p;
    // with the weights on the CPU every accumulator is in host memory
    CHECK_OK(lm_hess_plan_make(&p, base, false, false, 1u << 30, 0, &err), &err);
    CHECK(p.n_dev == 0 && p.host_bytes == 2 * (3 * 64 * 64 + 128 * 128) * sizeof(float) && p.max_dim == 128);
    // the finishing pass holds, at its worst, what is left of the accumulators, the float32
    // Hessian and the double copy of the widest (factored in place) with its diagonal
    const uint64_t f128 = (128 * 128 + 128) * 8, f64 = (64 * 64 + 64) * 8;
    uint64_t fin = lm_hess_plan_finish(&p, base, false, false, NULL);
    CHECK(fin > 128 * 128 * 4 + f128 && fin < p.host_bytes + 128 * 128 * 4 + f128);
    // factored on an accelerator: each Hessian's copy there when it fits, beside nothing else
    // (the accumulators are in host memory); one byte short for the widest, those two go to
    // the CPU; on the sim, the copy there is host memory too
    lm_hess_plan_factor f = {.budget = f128};
    CHECK(lm_hess_plan_finish(&p, base, false, false, &f) == fin && f.fallbacks == 0 && f.dev_peak == f128);
    f = (lm_hess_plan_factor){.budget = f128 - 1};
    CHECK(lm_hess_plan_finish(&p, base, false, false, &f) == fin && f.fallbacks == 2 && f.dev_peak == f64);
    f = (lm_hess_plan_factor){.budget = f128, .host_copy = true};
    uint64_t sim_fin = lm_hess_plan_finish(&p, base, false, false, &f);
    CHECK_MSG(sim_fin > fin && sim_fin <= fin + f128, "finishing on the sim %llu, on the host %llu",
              (unsigned long long)sim_fin, (unsigned long long)fin);
    // with the accumulators on the accelerator, those not yet finished are beside the copy: at
    // layer 0's widest, layer 1's four (3·64² + 128² floats)
    CHECK_OK(lm_hess_plan_make(&p, base, true, false, 1u << 30, 0, &err), &err);
    f = (lm_hess_plan_factor){.budget = 1u << 30};
    lm_hess_plan_finish(&p, base, false, false, &f);
    CHECK(p.n_dev == 8 && f.fallbacks == 0 && f.dev_peak == f128 + (3 * 64 * 64 + 128 * 128) * 4);
    p.n_acc = 0;
    CHECK(lm_hess_plan_finish(&p, base, false, false, NULL) == 128 * 128 * 4 + f128);
    lm_model_free(base);
}

// ==== the runner's fallbacks ==================================================================

typedef struct lines {
    char text[16384];
} lines;

// Keeps the fallbacks of the runner in the plan's words: "sequences A-B (T tokens) halved",
// "sequence N (T tokens) on cpu", "weights".
static void on_line(void *ctx, const char *line, const lm_fallback *fb)
{
    (void)fb;
    lines *l = ctx;
    int64_t a, b, t;
    char buf[128] = "";
    if (sscanf(line, "fallback: hessian sequences %" SCNd64 "-%" SCNd64 " (%" SCNd64 " tokens) halved", &a, &b, &t) ==
        3)
        snprintf(buf, sizeof buf, "halved %" PRId64 "-%" PRId64 " %" PRId64 "\n", a, b, t);
    else if (sscanf(line, "fallback: hessian sequence %" SCNd64 " (%" SCNd64 " tokens) on cpu", &a, &t) == 2)
        snprintf(buf, sizeof buf, "cpu %" PRId64 " %" PRId64 "\n", a, t);
    else if (strncmp(line, "fallback: hessian weights of ", 29) == 0)
        snprintf(buf, sizeof buf, "weights\n");
    else if (strstr(line, "--sticky-fallback"))
        snprintf(buf, sizeof buf, "sticky\n");
    size_t len = strlen(l->text);
    snprintf(l->text + len, sizeof l->text - len, "%s", buf);
}

static void on_plan_note(void *ctx, const lm_fwd_plan_note *n)
{
    lines *l = ctx;
    size_t len = strlen(l->text);
    if (n->halved)
        snprintf(l->text + len, sizeof l->text - len, "halved %" PRId64 "-%" PRId64 " %" PRId64 "\n", n->first + 1,
                 n->first + n->n, n->tokens);
    else
        snprintf(l->text + len, sizeof l->text - len, "cpu %" PRId64 " %" PRId64 "\n", n->first + 1, n->tokens);
}

// The capture of model m (with a) on sim:budget: the fallbacks lm_hess_ucc2_model reports are
// the ones the plan predicts, from the same steps lm_plan_make takes.
static void check_capture(const char *label, const lm_model *m, const lm_adapter *a, const int64_t *lens, int n,
                          uint64_t budget, bool sticky, int *n_fallbacks)
{
    lm_err err = {0};
    lm_fwd_seq seqs[64];
    int32_t ids[4096];
    uint64_t x = 7;
    int64_t total = 0, longest = 0;
    for (int i = 0; i < n; i++) {
        seqs[i] = (lm_fwd_seq){ids + total, lens[i]};
        for (int64_t p = 0; p < lens[i]; p++) {
            x = x * 6364136223846793005ull + 1442695040888963407ull;
            ids[total + p] = (int32_t)((x >> 33) % 256);
        }
        total += lens[i];
        longest = lens[i] > longest ? lens[i] : longest;
    }
    // the plan
    lines want = {0};
    lm_fwd_plan w;
    CHECK_OK(lm_fwd_plan_make(&w, m, a, false, &err), &err);
    bool on_dev = w.placing_peak <= budget;
    if (!on_dev) {
        snprintf(want.text, sizeof want.text, "weights\n");
        CHECK_OK(lm_fwd_plan_make(&w, m, a, true, &err), &err);
    }
    int64_t mt = lm_fwd_plan_max_tokens(0);
    size_t reserve = on_dev ? lm_fwd_plan_arena_bytes(&w, lm_hess_reserve_tokens(total, longest, mt)) : 0;
    lm_hess_plan hp;
    CHECK_OK(lm_hess_plan_make(&hp, m, on_dev, false, on_dev ? budget - w.weight_bytes : 0, reserve, &err), &err);
    lm_fwd_plan_run run;
    lm_fwd_plan_runner(&w, lens, n, 0, on_dev, on_dev ? budget - w.weight_bytes - hp.dev_bytes : 0, sticky,
                       on_plan_note, &want, &run);
    if (run.stuck) {
        size_t len = strlen(want.text);
        snprintf(want.text + len, sizeof want.text - len, "sticky\n");
    }
    // the run
    lm_dev *sim = NULL;
    CHECK_OK(lm_dev_sim_create(&sim, budget, NULL, 2, &err), &err);
    if (!sim)
        return;
    lines got = {0};
    double **ucc2 = NULL;
    int64_t n_ucc2 = 0;
    CHECK_OK(lm_hess_ucc2_model(m, a, sim, label, seqs, n, 0.01, sticky, on_line, &got, NULL, NULL, &ucc2,
                                &n_ucc2, &err), &err);
    lm_hess_ucc2_free(ucc2, n_ucc2);
    lm_dev_destroy(sim);
    // the sticky line comes after the sequence that set it; compare the sets in order
    CHECK_MSG(strcmp(want.text, got.text) == 0, "%s on sim:%" PRIu64 "%s: the plan predicted\n%s-- the capture "
              "reported\n%s--", label, budget, sticky ? " (sticky)" : "", want.text, got.text);
    for (const char *p = got.text; (p = strchr(p, '\n')); p++)
        (*n_fallbacks)++;
}

static void test_runner(void)
{
    lm_model *base = fixture_model("base");
    lm_adapter *plain = base ? open_adapter("lora_plain", base) : NULL;
    lm_adapter *dora = base ? open_adapter("lora_dora", base) : NULL;
    if (!base || !plain || !dora) {
        lm_adapter_free(plain);
        lm_adapter_free(dora);
        lm_model_free(base);
        return;
    }
    const int64_t lens[] = {18, 11, 19, 21, 24, 17, 13, 32};
    const int64_t one[] = {40};
    const uint64_t budgets[] = {300u << 10, 440u << 10, 450u << 10, 460u << 10, 500u << 10, 700u << 10, 900u << 10,
                                2u << 20};
    int fallbacks = 0, quiet = 0;
    for (size_t b = 0; b < sizeof budgets / sizeof budgets[0]; b++) {
        int before = fallbacks;
        check_capture("base", base, NULL, lens, 8, budgets[b], false, &fallbacks);
        check_capture("base+lora_plain", base, plain, lens, 8, budgets[b], false, &fallbacks);
        check_capture("base+lora_dora", base, dora, lens, 8, budgets[b], false, &fallbacks);
        check_capture("base (sticky)", base, NULL, lens, 8, budgets[b], true, &fallbacks);
        check_capture("base, one sequence", base, NULL, one, 1, budgets[b], false, &fallbacks);
        quiet += fallbacks == before;
    }
    // the budgets must reach every kind of case: fallbacks at some, none at others
    CHECK_MSG(fallbacks > 10 && quiet > 0, "%d fallbacks, %d budgets without", fallbacks, quiet);
    // lm_fwd_runner_run's batching: at most max_tokens a batch, a longer sequence alone
    lm_fwd_plan w;
    lm_err err = {0};
    CHECK_OK(lm_fwd_plan_make(&w, base, NULL, true, &err), &err);
    const int64_t mixed[] = {3000, 2000, 5000, 100, 100};
    lm_fwd_plan_run run;
    lm_fwd_plan_runner(&w, mixed, 5, 0, true, UINT64_MAX, false, NULL, NULL, &run);
    CHECK(run.n_formed == 4 && run.formed_tokens == 5000 && run.n_batches == 4 && run.tokens_dev == 10200 &&
          run.dev_tokens == 5000 && run.n_halved == 0);
    lm_fwd_plan_runner(&w, mixed, 5, 0, false, 0, false, NULL, NULL, &run);
    CHECK(run.tokens_cpu == 10200 && run.cpu_tokens == 5000 && run.tokens_dev == 0);
    lm_adapter_free(plain);
    lm_adapter_free(dora);
    lm_model_free(base);
}

// ==== which Hessian ===========================================================================

static void test_point_of(void)
{
    struct { const char *name; bool has; int64_t layer; lm_fwd_point point; } cases[] = {
        {"model.layers.0.self_attn.q_proj.weight", true, 0, LM_FWD_ATTN_IN},
        {"model.layers.12.self_attn.k_proj.weight", true, 12, LM_FWD_ATTN_IN},
        {"model.layers.3.self_attn.v_proj.weight", true, 3, LM_FWD_ATTN_IN},
        {"model.layers.3.self_attn.o_proj.weight", true, 3, LM_FWD_O_IN},
        {"model.layers.1.mlp.gate_proj.weight", true, 1, LM_FWD_MLP_IN},
        {"model.layers.1.mlp.up_proj.weight", true, 1, LM_FWD_MLP_IN},
        {"model.layers.1.mlp.down_proj.weight", true, 1, LM_FWD_DOWN_IN},
        {"model.layers.1.self_attn.q_proj.bias", false, 0, 0},
        {"model.layers.1.input_layernorm.weight", false, 0, 0},
        {"model.layers.x.mlp.up_proj.weight", false, 0, 0},
        {"model.layers.-1.mlp.up_proj.weight", false, 0, 0},
        {"model.embed_tokens.weight", false, 0, 0},
        {"lm_head.weight", false, 0, 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        int64_t layer = -5;
        lm_fwd_point point = LM_FWD_N_POINTS;
        bool has = lm_hess_point_of(cases[i].name, &layer, &point);
        CHECK_MSG(has == cases[i].has && (!has || (layer == cases[i].layer && point == cases[i].point)),
                  "%s: %d, layer %" PRId64 ", point %d", cases[i].name, has, layer, (int)point);
    }
}

// ==== the plan ================================================================================

static void test_plan(void)
{
    lm_err err = {0};
    lm_model *base = fixture_model("base");
    if (!base)
        return;
    lm_ft *fts[2] = {NULL, NULL};
    char *p1 = fx("lora_plain"), *p2 = fx("ft_full");
    CHECK_OK(lm_ft_open(&fts[0], p1, base, &err), &err);
    CHECK_OK(lm_ft_open(&fts[1], p2, base, &err), &err);
    char *cpath = fx("calib/calib.jsonl");
    lm_calib cal;
    lm_calib_opts co = {.vocab_size = 256};
    CHECK_OK(lm_calib_load(&cal, cpath, &co, &err), &err);
    if (!fts[0] || !fts[1] || !cal.n_seqs)
        goto done;
    double w[2] = {1, 1}, d[2] = {0.3, 0.3};
    lm_merge_opts o = {.method = LM_MERGE_SPARSEGPT, .n_ft = 2, .weights = w, .densities = d, .lambda = 1,
                       .out_dtype = LM_DTYPE_BF16, .sign = LM_SIGN_SUM};
    lm_plan_device cpu = {.name = "cpu", .host_memory = true, .forward_ops = true, .importance_ops = true};
    lm_plan_hess_in hin = {.calib = &cal, .n_calib = 1};
    lm_plan p;
    CHECK_OK(lm_plan_make(&p, &o, base, fts, &cpu, &hin, 5000000000ull, "out", &err), &err);
    if (p.n_ft == 2) {
        CHECK(p.n_captures == 2 && p.captures[0].ft == 0 && p.captures[1].ft == 1);
        for (int i = 0; i < p.n_captures; i++) {
            const lm_plan_capture *c = &p.captures[i];
            CHECK(c->n_seqs == 8 && c->n_tokens == cal.n_tokens && c->longest == 32 && c->run.n_formed == 1);
            CHECK(c->weights_on_device && c->hess.n_acc == 8 && c->hess.host_bytes + c->hess.dev_bytes ==
                  2 * (3 * 64 * 64 + 128 * 128) * sizeof(float));
            CHECK(c->cpu.peak >= c->cpu.capturing && c->cpu.capturing > c->cpu.held && c->n_notes == 0);
        }
        // the base's pages are read by the first capture only: the second holds them already
        CHECK(p.captures[1].cpu.held > p.captures[0].cpu.held);
        // importance: a buffer for each FT on the tensors with a Hessian (14 linear weights)
        int64_t with = 0;
        for (int64_t i = 0; i < p.n_tensors; i++) {
            int64_t layer;
            lm_fwd_point pt;
            bool has = lm_hess_point_of(p.tensors[i].name, &layer, &pt);
            with += has;
            const lm_merge_imp_need *imp = &p.tensors[i].imp_cpu;
            // lora_plain changes q and v only; ft_full changes everything
            int want = !has ? 0 : strstr(p.tensors[i].name, "q_proj") || strstr(p.tensors[i].name, "v_proj") ? 2 : 1;
            CHECK_MSG(imp->parts == want && imp->key_bytes == (uint64_t)want * (uint64_t)imp->slab_elems * 4,
                      "%s: %d parts with a Hessian, wanted %d", p.tensors[i].name, imp->parts, want);
        }
        CHECK(with == 14);
        CHECK(p.cpu.keys_reserved == 2 * (uint64_t)p.slab_max * 4 && p.cpu.keys_touched > 0 &&
              p.cpu.hessian_sets == 2 * 2 * (64 + 64 + 64 + 128) * sizeof(double));
        CHECK(p.cpu_peak >= p.cpu.peak);
        lm_plan_free(&p);
    }
    // --hessian-from base: one capture, of the base; its U_cc² in the cache: nothing runs
    lm_plan_cached ucc2 = LM_PLAN_CACHE_UCC2;
    hin.from_base = true;
    hin.cached = &ucc2;
    CHECK_OK(lm_plan_make(&p, &o, base, fts, &cpu, &hin, 5000000000ull, "out", &err), &err);
    if (p.n_ft == 2) {
        CHECK(p.n_captures == 1 && p.captures[0].ft == -1 && p.captures[0].cached == LM_PLAN_CACHE_UCC2 &&
              p.captures[0].cpu.peak == p.captures[0].cpu.held && p.cpu.hessian_sets == 2 * (64 + 64 + 64 + 128) * 8);
        lm_plan_free(&p);
    }
    // a device without the forward-pass or importance operations: everything on the CPU
    lm_plan_device gpu = {.name = "gpu", .free_bytes = 1ull << 30, .total_bytes = 1ull << 30};
    hin.cached = NULL;
    CHECK_OK(lm_plan_make(&p, &o, base, fts, &gpu, &hin, 5000000000ull, "out", &err), &err);
    if (p.n_ft == 2) {
        CHECK(p.dev_accelerator && !p.accelerator && !p.captures[0].weights_on_device &&
              p.captures[0].weights_why && p.captures[0].run.tokens_cpu == cal.n_tokens && p.n_fallback == 0);
        lm_plan_free(&p);
    }
    // sparsegpt without calibration data is refused
    CHECK_FAILS(lm_plan_make(&p, &o, base, fts, &cpu, NULL, 5000000000ull, "out", &err), LM_ERR_USAGE, "--calib",
                &err);
done:
    lm_calib_free(&cal);
    free(cpath);
    free(p1);
    free(p2);
    lm_ft_free(fts[0]);
    lm_ft_free(fts[1]);
    lm_model_free(base);
}

// ==== the merge's units =======================================================================

// Runs merge o of fts into base on a simulated device of `budget` bytes, writing into dir, and
// returns its result (the caller frees it); false when the run failed.
static bool run_on_sim(const lm_merge_opts *o, const lm_model *base, lm_ft *const *fts, uint64_t budget,
                       const char *dir, lm_merge_result *res)
{
    lm_err err = {0};
    lm_dev *sim = NULL;
    lm_st_writer *w = NULL;
    lm_st_desc *desc = NULL;
    int64_t n = 0;
    bool ok = false;
    memset(res, 0, sizeof *res);
    CHECK_OK(lm_rm_rf(dir, &err), &err);
    CHECK_OK(lm_mkdir_p(dir, &err), &err);
    CHECK_OK(lm_dev_sim_create(&sim, budget, NULL, 1, &err), &err);
    CHECK_OK(lm_merge_outputs(o, base, &desc, &n, &err), &err);
    if (sim && desc)
        CHECK_OK(lm_st_writer_open(&w, dir, desc, n, 5000000000ull, NULL, &err), &err);
    if (w) {
        lm_status s = lm_merge_run(o, sim, base, fts, w, NULL, res, &err);
        CHECK_OK(s, &err);
        ok = s == LM_OK;
        if (ok)
            CHECK_OK(lm_st_writer_finish(w, &err), &err);
    }
    lm_st_writer_free(w);
    free(desc);
    lm_dev_destroy(sim);
    return ok;
}

// The plan's sizes of each merge unit are what the run allocates: on a simulated device with
// room for the placed factors and the largest unit nothing falls back, and with a byte less
// exactly the units the plan says will not fit do (for several methods, a full FT, a plain
// LoRA and a DoRA adapter); the plan asks a real simulated device of that budget. sce holds a
// slab of variances more where its mask reads them (select_topk < 1), and only there.
static void test_units(void)
{
    lm_err err = {0};
    lm_model *base = fixture_model("base");
    if (!base)
        return;
    const char *names[3] = {"ft_full", "lora_plain", "lora_dora"};
    lm_ft *fts[3] = {NULL, NULL, NULL};
    for (int i = 0; i < 3; i++) {
        char *dir = fx(names[i]);
        CHECK_OK(lm_ft_open(&fts[i], dir, base, &err), &err);
        free(dir);
    }
    char *out = lm_strfmt("%s/llmerge-test-plan-%d", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp", (int)getpid());
    double w[3] = {1, 0.5, 0.75}, d[3] = {0.3, 0.5, 0.2};
    struct { lm_merge_method m; lm_rescale r; bool global; double topk; } runs[] = {
        {LM_MERGE_TIES, LM_RESCALE_INV, false, 1},
        {LM_MERGE_TIES, LM_RESCALE_INV, true, 1},
        {LM_MERGE_DARE_TIES, LM_RESCALE_L1, false, 1},
        {LM_MERGE_TASK_ARITHMETIC, LM_RESCALE_INV, false, 1},
        {LM_MERGE_SCE, LM_RESCALE_INV, false, 1},
        {LM_MERGE_SCE, LM_RESCALE_INV, false, 0.5},
    };
    uint64_t sce_bytes[2] = {0, 0};  // the largest unit's, unmasked and masked
    int64_t sce_slab = 0;
    for (size_t r = 0; out && fts[0] && fts[1] && fts[2] && r < sizeof runs / sizeof runs[0]; r++) {
        lm_merge_opts o = {.method = runs[r].m, .n_ft = 3, .weights = w, .densities = d, .lambda = 1,
                           .out_dtype = LM_DTYPE_BF16, .sign = LM_SIGN_SUM, .rescale = runs[r].r,
                           .topk_global = runs[r].global, .seed = 5, .threads = 1, .select_topk = runs[r].topk};
        lm_plan_device big = {.name = "sim:1GiB", .free_bytes = 1ull << 30, .total_bytes = 1ull << 30};
        lm_plan p;
        CHECK_OK(lm_plan_make(&p, &o, base, fts, &big, NULL, 5000000000ull, out, &err), &err);
        if (p.largest < 0) {
            lm_plan_free(&p);
            continue;
        }
        uint64_t fits = p.placed_bytes + p.tensors[p.largest].dev_bytes;
        CHECK(p.n_fallback == 0 && p.n_place_fallback == 0 && p.n_merged > 0);
        if (runs[r].m == LM_MERGE_SCE) {
            sce_bytes[runs[r].topk < 1] = p.tensors[p.largest].dev_bytes;
            sce_slab = p.tensors[p.largest].dev.slab_elems;
        }
        lm_plan_free(&p);
        for (uint64_t budget = fits - 1; budget <= fits; budget++) {
            lm_plan_device dev = {.name = "sim", .free_bytes = budget, .total_bytes = budget};
            CHECK_OK(lm_plan_make(&p, &o, base, fts, &dev, NULL, 5000000000ull, out, &err), &err);
            lm_merge_result res;
            if (run_on_sim(&o, base, fts, budget, out, &res)) {
                CHECK_MSG(res.fallback_merge == p.n_fallback && res.fallback_place == p.n_place_fallback,
                          "%s on %" PRIu64 " bytes: the run fell back %" PRId64 " units and %" PRId64
                          " adapters, the plan says %" PRId64 " and %d", lm_merge_method_name(o.method), budget,
                          res.fallback_merge, res.fallback_place, p.n_fallback, p.n_place_fallback);
                CHECK((budget == fits) == (p.n_fallback == 0));
                CHECK(res.tensors_on_device == p.n_merged - p.n_fallback);
            }
            lm_merge_result_free(&res);
            lm_plan_free(&p);
        }
    }
    CHECK_MSG(sce_slab > 0 && sce_bytes[1] == sce_bytes[0] + (uint64_t)sce_slab * sizeof(float),
              "sce's largest unit: %" PRIu64 " bytes unmasked, %" PRIu64 " masked, slab %" PRId64, sce_bytes[0],
              sce_bytes[1], sce_slab);
    if (out)
        lm_rm_rf(out, &err);
    free(out);
    for (int i = 0; i < 3; i++)
        lm_ft_free(fts[i]);
    lm_model_free(base);
}

// On the CPU the fused passes fill the float32 buffers only at the selection's sample (task
// arithmetic and nuslerp: none, they have no selection); sce, nearswap and ramplus_tl, and
// nuslerp's Gram pass per column, make every τ in them, and sce fills a slab of variances besides
// where its mask applies. The plan's figures per tensor say so.
static void test_touched(lm_dev *cpu)
{
    lm_err err = {0};
    lm_model *base = fixture_model("base");
    char *dir = fx("ft_full");
    lm_ft *ft = NULL;
    if (base && dir)
        CHECK_OK(lm_ft_open(&ft, dir, base, &err), &err);
    free(dir);
    int64_t idx = -1;  // the largest tensor
    for (int64_t i = 0; base && i < base->n_tensors; i++)
        if (idx < 0 || base->tensors[i]->numel > base->tensors[idx]->numel)
            idx = i;
    struct { lm_merge_method m; double topk; bool per_col, all, var; } cases[] = {
        {LM_MERGE_TASK_ARITHMETIC, 1, false, false, false},
        {LM_MERGE_SCE, 1, false, true, false},      {LM_MERGE_SCE, 0.5, false, true, true},
        {LM_MERGE_NEARSWAP, 1, false, true, false}, {LM_MERGE_RAMPLUS, 1, false, true, false},
        {LM_MERGE_NUSLERP, 1, false, false, false}, {LM_MERGE_NUSLERP, 1, true, true, false},
    };
    double w[1] = {1}, d[1] = {0.3}, eps[1] = {0};
    for (size_t c = 0; ft && idx >= 0 && c < sizeof cases / sizeof cases[0]; c++) {
        lm_merge_opts o = {.method = cases[c].m, .n_ft = 1, .weights = w, .densities = d, .epsilons = eps,
                           .lambda = 1, .out_dtype = LM_DTYPE_BF16, .sign = LM_SIGN_SUM, .t = 0.5,
                           .select_topk = cases[c].topk, .ram_r = 0.1, .ram_alpha = 0.2, .threads = 1,
                           .per_col = cases[c].per_col};
        lm_merge_need need;
        CHECK_OK(lm_merge_plan_tensor(&o, base, &ft, idx, cpu, &need), &err);
        const char *name = lm_merge_method_name(o.method);
        CHECK_MSG(need.parts == 1 && need.slab_elems > 0, "%s: %d parts, slab %" PRId64, name, need.parts,
                  need.slab_elems);
        CHECK_MSG(cases[c].all ? need.touched_elems == need.slab_elems : need.touched_elems < need.slab_elems,
                  "%s select_topk %g: %" PRId64 " of %" PRId64 " elements touched", name, cases[c].topk,
                  need.touched_elems, need.slab_elems);
        CHECK_MSG(need.var_elems == (cases[c].var ? need.slab_elems : 0), "%s select_topk %g: %" PRId64
                  " variances", name, cases[c].topk, need.var_elems);
    }
    lm_ft_free(ft);
    lm_model_free(base);
}

int main(void)
{
    if (!fixture_env("test_plan"))
        return 1;
    lm_err err = {0};
    lm_dev *cpu = NULL, *sim = NULL;
    CHECK_OK(lm_dev_cpu_create(&cpu, 2, &err), &err);
    CHECK_OK(lm_dev_sim_create(&sim, 64u << 20, NULL, 2, &err), &err);
    if (cpu && sim)
        test_weights(cpu, sim);
    if (cpu)
        test_touched(cpu);
    lm_dev_destroy(cpu);
    lm_dev_destroy(sim);
    test_accumulators();
    test_runner();
    test_point_of();
    test_plan();
    test_units();
    return check_report("test_plan");
}
