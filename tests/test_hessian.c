// Tests of the Hessians from activation capture (lib/hessian.c). The reference is a naive forward
// pass in double (the helpers of tests/test_forward.c, copied here: test code) that keeps each
// layer's linear inputs; from them H = (2 / n) Σ x xᵀ in double. Against it, on the Llama fixture
// (alone, with a LoRA and with a DoRA adapter) and the Qwen2 fixture (alone and with a lora_bias
// adapter): every Hessian within 1e-4 relative (max |diff| / max |ref|), exactly symmetric and
// positive semi-definite (a Cholesky factorisation of H + εI succeeds), and the adapter changes the
// Hessians by far more than the tolerance. Packed batches give what one sequence at a time gives,
// to float32 rounding. On the simulated device the CPU's Hessians come out, also on small budgets
// that force each fallback (weights on the CPU, accumulators in host memory, a batch halved, a
// sequence on the CPU), with nothing left allocated on the device (accumulators on the device that
// no batch reached read as zeros). A device failure that is not out-of-memory stops the capture.
// Accumulating upper triangles by syrk gives what whole GEMMs give, and the hook alone leaves them
// incomplete until lm_hess_capture_end completes them (once or twice, the same bits). Finishing:
// lm_hess_get's in-place pass gives the bits of a pass over a double copy for accumulators on the
// device, in host memory or both; released accumulators free their memory; lm_hess_ucc2_model hands
// each finished Hessian to its callback (the bits lm_hess_get reads) and stops when the callback
// fails. The importance τ²/U_cc² matches one computed here by an explicit inverse and Cholesky.
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "adapter.h"
#include "calib.h"
#include "check.h"
#include "device.h"
#include "device_impl.h"  // a device lacking syrk, built by hand
#include "device_registry.h"
#include "forward.h"
#include "hessian.h"
#include "model.h"
#include "notes.h"
#include "safetensors.h"
#include "testfs.h"
#include "util.h"

#define REL 1e-4       // against the double reference (max |diff| / max |ref|)
#define ROUNDING 1e-5  // the same sums in another order, in float32

#include "ref_forward.h"


// ==== Hessians as the library computes them ===================================================

// Every Hessian of a model, host float arrays indexed as lm_hess_index.
typedef struct hset {
    int64_t n;                     // n_layers · N_POINTS
    int64_t dim[LM_FWD_N_POINTS];
    float **h;
    int64_t n_tokens;
    int64_t upper_only;            // capture_by_hook: accumulators whose lower triangle was not current
} hset;

static void hset_free(hset *s)
{
    for (int64_t i = 0; s->h && i < s->n; i++)
        free(s->h[i]);
    free(s->h);
    memset(s, 0, sizeof *s);
}

static void on_note(void *ctx, const char *line, const lm_fallback *fb)
{
    (void)fb;
    (void)ctx;
    printf("  note: %s\n", line);
}

// Runs the sequences through a runner on `dev` (max_tokens per batch; 0: the default) with
// accumulators placed on the runner's device keeping `reserve` free, and reads the Hessians.
// The runner's counters go to *r_out when not NULL. Returns the capture's status.
static lm_status capture(const lm_model *m, const lm_adapter *a, lm_dev *dev, const seqs *q, int64_t max_tokens,
                         size_t reserve, hset *out, lm_fwd_runner *r_out, int64_t *n_host, lm_err *err)
{
    memset(out, 0, sizeof *out);
    lm_fwd_runner r;
    lm_hess h;
    memset(&h, 0, sizeof h);
    lm_status s = lm_fwd_runner_init(&r, m, a, dev, "test", "MODEL", max_tokens, on_note, NULL, err);
    if (s != LM_OK)
        return s;
    if ((s = lm_hess_init(&h, m, dev, r.on_dev != NULL, reserve, err)) != LM_OK)
        goto out;
    if (n_host)
        *n_host = h.n_host;
    if ((s = lm_hess_capture(&h, &r, q->s, q->n, err)) != LM_OK)
        goto out;
    out->n = h.n_layers * LM_FWD_N_POINTS;
    memcpy(out->dim, h.dim, sizeof h.dim);
    out->n_tokens = h.n_tokens;
    out->h = calloc((size_t)out->n, sizeof *out->h);
    for (int64_t i = 0; i < out->n && s == LM_OK; i++) {
        int64_t d = h.dim[i % LM_FWD_N_POINTS];
        out->h[i] = malloc((size_t)(d * d) * sizeof(float));
        s = lm_hess_get(&h, i / LM_FWD_N_POINTS, (lm_fwd_point)(i % LM_FWD_N_POINTS), out->h[i], err);
    }
out:
    if (r_out)
        *r_out = r;
    lm_hess_free(&h);
    lm_hess_free(&h);  // twice is safe
    lm_fwd_runner_free(&r);
    return s;
}

// max |a − b| / max |b| over all Hessians.
static double hset_rel(const hset *a, const hset *b)
{
    double md = 0, mr = 0;
    for (int64_t i = 0; i < a->n && i < b->n; i++) {
        int64_t d = a->dim[i % LM_FWD_N_POINTS];
        for (int64_t k = 0; k < d * d; k++) {
            double x = fabs((double)a->h[i][k] - b->h[i][k]);
            md = x > md || isnan(x) ? x : md;
            mr = fabs((double)b->h[i][k]) > mr ? fabs((double)b->h[i][k]) : mr;
        }
    }
    return mr > 0 ? md / mr : md;
}

// A Cholesky factorisation in double of H + eps·I (n × n): true when every pivot is positive.
static bool cholesky_ok(const float *H, int64_t n, double eps)
{
    double *L = calloc((size_t)(n * n), sizeof *L);
    bool ok = true;
    for (int64_t j = 0; j < n && ok; j++) {
        for (int64_t i = j; i < n; i++) {
            double s = H[i * n + j] + (i == j ? eps : 0);
            for (int64_t k = 0; k < j; k++)
                s -= L[i * n + k] * L[j * n + k];
            if (i == j) {
                if (!(s > 0)) {
                    ok = false;
                    break;
                }
                L[j * n + j] = sqrt(s);
            } else {
                L[i * n + j] = s / L[j * n + j];
            }
        }
    }
    free(L);
    return ok;
}

// ==== against the reference ===================================================================

static void check_reference(lm_dev *cpu, const char *label, lm_model *m, lm_adapter *a, hset *keep)
{
    lm_err err = {0};
    const lm_config *cfg = &m->config;
    seqs q;
    load_seqs(&q, cfg->vocab_size);
    hset got;
    CHECK_OK(capture(m, a, cpu, &q, 0, 0, &got, NULL, NULL, &err), &err);
    CHECK(got.n_tokens == q.T);
    int64_t L = cfg->num_hidden_layers;
    CHECK(got.n == L * LM_FWD_N_POINTS && L <= 8);
    double *ref[8 * LM_FWD_N_POINTS] = {0};
    for (int64_t i = 0; i < got.n; i++)
        ref[i] = calloc((size_t)(got.dim[i % 4] * got.dim[i % 4]), sizeof(double));
    ref_ctx c = {m, a, false};
    for (int64_t sq = 0; sq < q.n; sq++) {
        ref_out o;
        ref_forward(&c, q.s[sq].ids, q.s[sq].len, &o);
        for (int64_t i = 0; i < got.n; i++) {
            int64_t d = got.dim[i % 4];
            const double *x = o.points[i / 4][i % 4];
            for (int64_t t = 0; t < q.s[sq].len; t++)
                for (int64_t r = 0; r < d; r++)
                    for (int64_t k = 0; k < d; k++)
                        ref[i][r * d + k] += x[t * d + r] * x[t * d + k];
        }
        ref_free(&o);
    }
    double worst = 0;
    for (int64_t i = 0; i < got.n && got.h; i++) {
        int64_t d = got.dim[i % 4];
        double md = 0, mr = 0;
        bool sym = true;
        for (int64_t k = 0; k < d * d; k++) {
            double want = ref[i][k] * 2.0 / (double)q.T;
            md = fabs(got.h[i][k] - want) > md || isnan(got.h[i][k]) ? fabs(got.h[i][k] - want) : md;
            mr = fabs(want) > mr ? fabs(want) : mr;
            int64_t r = k / d, cc = k % d;
            sym = sym && got.h[i][k] == got.h[i][cc * d + r];
        }
        double e = md / mr;
        worst = e > worst ? e : worst;
        char name[128];
        lm_hess_name(name, sizeof name, i / 4, (lm_fwd_point)(i % 4));
        CHECK_MSG(e < REL, "%s %s: differs from the reference by %g", label, name, e);
        CHECK_MSG(sym, "%s %s: not symmetric", label, name);
        double diag = 0;
        for (int64_t r = 0; r < d; r++)
            diag = got.h[i][r * d + r] > diag ? got.h[i][r * d + r] : diag;
        CHECK_MSG(cholesky_ok(got.h[i], d, 1e-5 * diag), "%s %s: not positive semi-definite", label, name);
        // xᵀ H x ≥ 0 for a few random x, to float32 rounding
        uint64_t st = 12345 + (uint64_t)i;
        for (int trial = 0; trial < 4; trial++) {
            double *x = malloc((size_t)d * sizeof *x), quad = 0, scale = 0;
            for (int64_t r = 0; r < d; r++) {
                st = st * 6364136223846793005ull + 1442695040888963407ull;
                x[r] = (double)(st >> 11) / 9007199254740992.0 - 0.5;
            }
            for (int64_t r = 0; r < d; r++)
                for (int64_t k = 0; k < d; k++) {
                    quad += x[r] * got.h[i][r * d + k] * x[k];
                    scale += fabs(x[r] * got.h[i][r * d + k] * x[k]);
                }
            CHECK_MSG(quad >= -1e-6 * scale, "%s %s: x^T H x = %g", label, name, quad);
            free(x);
        }
    }
    printf("%-22s %lld Hessians, max relative error %.2e\n", label, (long long)got.n, worst);
    for (int64_t i = 0; i < got.n; i++)
        free(ref[i]);
    if (keep)
        *keep = got;
    else
        hset_free(&got);
    free_seqs(&q);
}

static void test_reference(lm_dev *cpu)
{
    static const char *const cases[][2] = {{"base", NULL}, {"base", "lora_plain"}, {"base", "lora_dora"},
                                           {"qwen", NULL}, {"qwen", "lora_bias"}};
    hset without = {0};
    for (int i = 0; i < 5; i++) {
        lm_model *m = fixture_model(cases[i][0]);
        lm_adapter *a = cases[i][1] ? fixture_adapter(cases[i][1]) : NULL;
        if (m && (a || !cases[i][1])) {
            char label[64];
            snprintf(label, sizeof label, "%s%s%s", cases[i][0], a ? " + " : "", a ? cases[i][1] : "");
            hset h = {0};
            check_reference(cpu, label, m, a, &h);
            if (!a) {
                hset_free(&without);
                without = h;
            } else {
                // the adapter must change the Hessians by far more than the tolerance
                double d = hset_rel(&h, &without);
                CHECK_MSG(d > 20 * REL, "%s changes the Hessians by only %g", label, d);
                printf("%-22s changes the Hessians by %.2e\n", label, d);
                hset_free(&h);
            }
        }
        lm_adapter_free(a);
        lm_model_free(m);
    }
    hset_free(&without);
}

// ==== batching and devices ====================================================================

// Leaves freed NaN-filled blocks of the accumulators' sizes on the heap, so that accumulators
// allocated next most likely hold NaN until something writes them (the device does not clear
// what it allocates, and a fresh heap would hide a missing zeroing).
static void poison_heap(const lm_config *cfg)
{
    enum { N_BLOCKS = 64 };
    int64_t dims[3] = {cfg->hidden_size, cfg->num_attention_heads * cfg->head_dim, cfg->intermediate_size};
    float *blocks[3 * N_BLOCKS];
    for (int i = 0; i < 3 * N_BLOCKS; i++) {
        size_t n = (size_t)(dims[i % 3] * dims[i % 3]);
        blocks[i] = aligned_alloc(64, (n * sizeof(float) + 63) & ~(size_t)63);
        for (size_t j = 0; blocks[i] && j < n; j++)
            blocks[i][j] = NAN;
    }
    for (int i = 0; i < 3 * N_BLOCKS; i++)
        free(blocks[i]);
}

// Opens the base model into *m and lora_plain into *a, and loads the calibration sequences into
// *q: what several tests capture Hessians from. Returns false after a failed check, with *q
// empty; close_plain frees them either way.
static bool open_plain(lm_model **m, lm_adapter **a, seqs *q)
{
    memset(q, 0, sizeof *q);
    *m = fixture_model("base");
    *a = fixture_adapter("lora_plain");
    if (!*m || !*a)
        return false;
    load_seqs(q, (*m)->config.vocab_size);
    return true;
}

static void close_plain(lm_model *m, lm_adapter *a, seqs *q)
{
    free_seqs(q);
    lm_adapter_free(a);
    lm_model_free(m);
}

static void test_batches_and_devices(lm_dev *cpu)
{
    lm_err err = {0};
    lm_model *m;
    lm_adapter *a;
    seqs q;
    if (!open_plain(&m, &a, &q))
        goto out;
    hset packed, single;
    CHECK_OK(capture(m, a, cpu, &q, 0, 0, &packed, NULL, NULL, &err), &err);
    // max_tokens 1: every sequence is a batch of its own
    CHECK_OK(capture(m, a, cpu, &q, 1, 0, &single, NULL, NULL, &err), &err);
    double d = hset_rel(&single, &packed);
    CHECK_MSG(d < ROUNDING, "one sequence at a time differs from packed batches by %g", d);
    printf("%-22s one sequence at a time vs packed: %.2e\n", "base + lora_plain", d);
    hset_free(&single);

    // the sizes on a device
    lm_dev *big = NULL;
    lm_fwd *f = NULL;
    CHECK_OK(lm_dev_sim_create(&big, 1ull << 30, NULL, 2, &err), &err);
    CHECK_OK(lm_fwd_create(&f, m, a, big, &err), &err);
    int64_t longest = 0;
    for (int64_t i = 0; i < q.n; i++)
        longest = q.s[i].len > longest ? q.s[i].len : longest;
    uint64_t W = f ? lm_fwd_weight_bytes(f) : 0, A_all = f ? lm_fwd_arena_bytes(f, q.T) : 0;
    uint64_t A_long = f ? lm_fwd_arena_bytes(f, longest) : 0, A_short = f ? lm_fwd_arena_bytes(f, longest - 1) : 0;
    uint64_t A_one = f ? lm_fwd_arena_bytes(f, 1) : 0;
    lm_fwd_free(f);
    lm_dev_destroy(big);
    const lm_config *cfg = &m->config;
    uint64_t per_layer = 4 * (uint64_t)(2 * cfg->hidden_size * cfg->hidden_size +
                                        (cfg->num_attention_heads * cfg->head_dim) * (cfg->num_attention_heads * cfg->head_dim) +
                                        cfg->intermediate_size * cfg->intermediate_size);
    uint64_t ACC = per_layer * (uint64_t)cfg->num_hidden_layers;

    struct {
        const char *what;
        uint64_t budget;
        size_t reserve;
        bool weights_cpu;
        bool some_host;   // some accumulators in host memory
        bool seq_cpu;     // a sequence ran on the CPU
        bool halved;
    } cases[] = {
        {"everything fits", W + ACC + A_all, A_all, false, false, false, false},
        {"weights do not fit", W - 1, 0, true, true, false, false},
        {"half the accumulators on the host", W + ACC / 2 + A_all, A_all, false, true, false, false},
        {"a batch halved", W + ACC + A_long, A_long, false, false, false, true},
        {"a sequence on the cpu", W + ACC + A_short, A_short, false, false, true, true},
        // the accumulators on the device are never reached: they must read as zeros
        {"every sequence on the cpu", W + ACC + A_one, A_one, false, false, true, true},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        lm_dev *sim = NULL;
        CHECK_OK(lm_dev_sim_create(&sim, cases[k].budget, NULL, 2, &err), &err);
        if (!sim)
            continue;
        poison_heap(cfg);
        hset got;
        lm_fwd_runner r;
        int64_t n_host = -1;
        CHECK_OK(capture(m, a, sim, &q, 0, cases[k].reserve, &got, &r, &n_host, &err), &err);
        double e = got.h ? hset_rel(&got, &packed) : 1;
        CHECK_MSG(e < ROUNDING, "sim, %s: differs from the cpu by %g", cases[k].what, e);
        CHECK_MSG(r.weights_fell_back == cases[k].weights_cpu, "sim, %s: weights_fell_back %d", cases[k].what,
                  r.weights_fell_back);
        CHECK_MSG((n_host > 0) == cases[k].some_host, "sim, %s: %lld accumulators on the host", cases[k].what,
                  (long long)n_host);
        CHECK_MSG((r.n_seq_cpu > 0) == cases[k].seq_cpu && (r.n_halved > 0) == cases[k].halved,
                  "sim, %s: %lld halved, %lld sequences on cpu", cases[k].what, (long long)r.n_halved,
                  (long long)r.n_seq_cpu);
        printf("sim, %-34s %lld accumulators on host, %lld halved, %lld seq on cpu: %.2e\n", cases[k].what,
               (long long)n_host, (long long)r.n_halved, (long long)r.n_seq_cpu, e);
        hset_free(&got);
        size_t fr = 0, tot = 0;
        lm_dev_mem_info(sim, &fr, &tot);
        CHECK_MSG(fr == tot, "sim, %s: %llu bytes left allocated", cases[k].what, (unsigned long long)(tot - fr));
        lm_dev_destroy(sim);
    }

    // a device failure that is not out of memory stops the capture, naming what failed
    for (int n = 1; n <= 81; n += 20) {  // a run has a little over 81 operations
        char fail[32];
        snprintf(fail, sizeof fail, "launch:%d", n);
        lm_dev *sim = NULL;
        CHECK_OK(lm_dev_sim_create(&sim, 1ull << 30, fail, 2, &err), &err);
        if (!sim)
            continue;
        hset got;
        lm_status s = capture(m, a, sim, &q, 0, 0, &got, NULL, NULL, &err);
        CHECK_MSG(s == LM_ERR_DEVICE, "%s: %s (%s)", fail, lm_status_name(s), err.msg);
        hset_free(&got);
        size_t fr = 0, tot = 0;
        lm_dev_mem_info(sim, &fr, &tot);
        CHECK_MSG(fr == tot, "%s: %llu bytes left allocated", fail, (unsigned long long)(tot - fr));
        lm_dev_destroy(sim);
    }
    hset_free(&packed);
out:
    close_plain(m, a, &q);
}

// ==== finishing: lm_hess_get, lm_hess_release, lm_hess_ucc2_model's Hessians ==================

// The Hessian of accumulators dev (may be NULL) and host (may be NULL) as lm_hess_get first
// computed it: the sum in a double copy of the matrix, then symmetrised and scaled.
static void finish_ref(float *out, const float *dev, const float *host, int64_t d, int64_t n_tokens)
{
    double *sum = calloc((size_t)(d * d), sizeof *sum);
    for (int64_t k = 0; dev && k < d * d; k++)
        sum[k] = dev[k];
    for (int64_t k = 0; host && k < d * d; k++)
        sum[k] += host[k];
    double scale = 2.0 / (double)n_tokens;
    for (int64_t r = 0; r < d; r++)
        for (int64_t c = 0; c < d; c++)
            out[r * d + c] = (float)(0.5 * (sum[r * d + c] + sum[c * d + r]) * scale);
    free(sum);
}

// Accumulators made by hand on the simulated device and in host memory, in every combination
// (device only, host only, both), at widths that are not multiples of the pass's tiles: the
// in-place pass gives the bits of the double-copy one, an exactly symmetric matrix; released
// accumulators free their memory and cannot be read.
static void test_finishing(void)
{
    lm_err err = {0};
    lm_dev *sim = NULL;
    CHECK_OK(lm_dev_sim_create(&sim, 64 << 20, NULL, 2, &err), &err);
    if (!sim)
        return;
    lm_hess h;
    memset(&h, 0, sizeof h);
    h.n_layers = 2;
    h.dev = sim;
    h.n_tokens = 37;
    const int64_t dims[LM_FWD_N_POINTS] = {70, 64, 1, 131};
    memcpy(h.dim, dims, sizeof dims);
    int64_t n = h.n_layers * LM_FWD_N_POINTS;
    h.on_dev = calloc((size_t)n, sizeof *h.on_dev);
    h.on_host = calloc((size_t)n, sizeof *h.on_host);
    float *dev_vals[8] = {0};
    uint64_t x = 99;
    for (int64_t i = 0; i < n; i++) {
        int64_t d = dims[i % LM_FWD_N_POINTS];
        size_t bytes = (size_t)(d * d) * sizeof(float);
        bool on_dev = i % 3 != 1, on_host = i % 3 != 0;  // 0: device, 1: host, 2: both
        float *v = malloc(bytes);
        for (int64_t k = 0; k < d * d; k++) {
            x = x * 6364136223846793005ull + 1442695040888963407ull;
            v[k] = k % 11 == 0 ? -0.0f : (float)((double)(x >> 11) / 9007199254740992.0 * 200.0 - 100.0);
        }
        if (on_dev) {
            CHECK_OK(lm_dev_alloc(sim, bytes, (void **)&h.on_dev[i], &err), &err);
            if (h.on_dev[i])
                CHECK_OK(lm_dev_upload(sim, h.on_dev[i], v, bytes, &err), &err);
            h.dev_bytes += bytes;
            dev_vals[i] = v;
        }
        if (on_host) {
            h.on_host[i] = on_dev ? malloc(bytes) : v;
            for (int64_t k = 0; on_dev && k < d * d; k++)
                h.on_host[i][k] = v[k] * 0.5f - 1.0f;
        }
    }
    for (int64_t i = 0; i < n; i++) {
        int64_t d = dims[i % LM_FWD_N_POINTS], layer = i / LM_FWD_N_POINTS;
        lm_fwd_point p = (lm_fwd_point)(i % LM_FWD_N_POINTS);
        float *got = malloc((size_t)(d * d) * sizeof *got), *want = malloc((size_t)(d * d) * sizeof *want);
        finish_ref(want, dev_vals[i], h.on_host[i], d, h.n_tokens);
        CHECK_OK(lm_hess_get(&h, layer, p, got, &err), &err);
        CHECK_MSG(memcmp(got, want, (size_t)(d * d) * sizeof *got) == 0, "Hessian %lld (%s) differs from the "
                  "double-copy pass", (long long)i, i % 3 == 0 ? "device" : i % 3 == 1 ? "host" : "both");
        int64_t asym = 0;
        for (int64_t r = 0; r < d; r++)
            for (int64_t c = 0; c < d; c++)
                asym += memcmp(&got[r * d + c], &got[c * d + r], sizeof(float)) != 0;
        CHECK(asym == 0);
        lm_hess_release(&h, layer, p);
        CHECK(!h.on_dev[i] && !h.on_host[i]);
        CHECK_FAILS(lm_hess_get(&h, layer, p, got, &err), LM_ERR_USAGE, "already released", &err);
        lm_hess_release(&h, layer, p);  // twice is harmless
        free(got);
        free(want);
        free(dev_vals[i]);
    }
    size_t fr = 0, tot = 0;
    lm_dev_mem_info(sim, &fr, &tot);
    CHECK_MSG(fr == tot && h.dev_bytes == 0, "%llu bytes left on the device after every release",
              (unsigned long long)(tot - fr));
    h.n_tokens = 0;
    CHECK(lm_hess_get(&h, 0, LM_FWD_ATTN_IN, NULL, &err) == LM_ERR_USAGE);
    lm_hess_free(&h);
    lm_dev_destroy(sim);
}

// What lm_hess_ucc2_model hands its `each` callback.
typedef struct each_seen {
    hset got;
    int calls;
    int fail_at;  // the call that fails (0: none)
} each_seen;

static lm_status on_each(void *ctx, int64_t layer, lm_fwd_point p, const float *H, int64_t dim, int64_t n_tokens,
                         lm_err *err)
{
    each_seen *e = ctx;
    int64_t i = lm_hess_index(layer, p);
    if (++e->calls == e->fail_at)
        return lm_err_set(err, LM_ERR_IO, "the callback failed at %lld", (long long)i);
    if (i != e->calls - 1 || i >= e->got.n || dim != e->got.dim[p])
        return lm_err_set(err, LM_ERR_USAGE, "Hessian %lld of width %lld out of order", (long long)i, (long long)dim);
    e->got.n_tokens = n_tokens;
    e->got.h[i] = malloc((size_t)(dim * dim) * sizeof(float));
    memcpy(e->got.h[i], H, (size_t)(dim * dim) * sizeof(float));
    return LM_OK;
}

// lm_hess_ucc2_model hands each finished Hessian to the callback, in order, with n_tokens: the
// bits a capture on the same device reads with lm_hess_get, and the U_cc² it returns are those
// of lm_hess_ucc2_raised on them; a failing callback stops it with its status.
static void test_each_hessian(lm_dev *cpu)
{
    lm_err err = {0};
    lm_model *m;
    lm_adapter *a;
    seqs q;
    if (!open_plain(&m, &a, &q))
        goto out;
    hset ref;
    CHECK_OK(capture(m, a, cpu, &q, 0, 0, &ref, NULL, NULL, &err), &err);
    each_seen e = {.got = {.n = ref.n}};
    memcpy(e.got.dim, ref.dim, sizeof ref.dim);
    e.got.h = calloc((size_t)ref.n, sizeof *e.got.h);
    double **ucc2 = NULL;
    int64_t n = 0;
    CHECK_OK(lm_hess_ucc2_model(m, a, cpu, "MODEL", q.s, q.n, 0.01, false, on_note, NULL, on_each, &e, &ucc2, &n,
                                &err), &err);
    CHECK(e.calls == ref.n && n == ref.n && e.got.n_tokens == ref.n_tokens);
    for (int64_t i = 0; ucc2 && i < n && i < ref.n; i++) {
        int64_t d = ref.dim[i % LM_FWD_N_POINTS];
        CHECK_MSG(e.got.h[i] && memcmp(e.got.h[i], ref.h[i], (size_t)(d * d) * sizeof(float)) == 0,
                  "the Hessian handed over %lld differs from lm_hess_get's", (long long)i);
        double *u = malloc((size_t)d * sizeof *u);
        CHECK_OK(lm_hess_ucc2_raised(NULL, u, ref.h[i], d, 0.01, "H", NULL, NULL, &err), &err);
        CHECK_MSG(memcmp(u, ucc2[i], (size_t)d * sizeof *u) == 0, "U_cc² %lld differs", (long long)i);
        free(u);
    }
    lm_hess_ucc2_free(ucc2, n);
    hset_free(&e.got);
    // a failing callback: its status, nothing returned
    each_seen f = {.got = {.n = ref.n}, .fail_at = 3};
    memcpy(f.got.dim, ref.dim, sizeof ref.dim);
    f.got.h = calloc((size_t)ref.n, sizeof *f.got.h);
    CHECK_FAILS(lm_hess_ucc2_model(m, a, cpu, "MODEL", q.s, q.n, 0.01, false, on_note, NULL, on_each, &f, &ucc2,
                                   &n, &err), LM_ERR_IO, "callback failed", &err);
    CHECK(ucc2 == NULL && n == 0 && f.calls == 3);
    hset_free(&f.got);
    hset_free(&ref);
out:
    close_plain(m, a, &q);
}

// ==== accumulation by syrk ====================================================================

// Hessians read after a capture driven by lm_hess_hook directly (no lm_hess_capture), with
// lm_hess_capture_end called `ends` times before reading.
static void capture_by_hook(const lm_model *m, const lm_adapter *a, lm_dev *dev, const seqs *q, int ends, hset *out)
{
    lm_err err = {0};
    memset(out, 0, sizeof *out);
    lm_fwd_runner r;
    lm_hess h;
    memset(&h, 0, sizeof h);
    CHECK_OK(lm_fwd_runner_init(&r, m, a, dev, "test", "MODEL", 0, NULL, NULL, &err), &err);
    CHECK_OK(lm_hess_init(&h, m, dev, true, 0, &err), &err);
    lm_fwd_req req = {.hook = lm_hess_hook, .hook_ctx = &h};
    CHECK_OK(lm_fwd_runner_run(&r, q->s, q->n, &req, &err), &err);
    for (int e = 0; e < ends; e++)
        CHECK_OK(lm_hess_capture_end(&h, &err), &err);
    out->n = h.n_layers * LM_FWD_N_POINTS;
    memcpy(out->dim, h.dim, sizeof h.dim);
    out->n_tokens = h.n_tokens;
    out->h = calloc((size_t)out->n, sizeof *out->h);
    for (int64_t i = 0; i < out->n; i++)
        out->upper_only += (h.dev_upper && h.dev_upper[i]) + (h.host_upper && h.host_upper[i]);
    for (int64_t i = 0; i < out->n; i++) {
        int64_t d = h.dim[i % LM_FWD_N_POINTS];
        out->h[i] = malloc((size_t)(d * d) * sizeof(float));
        CHECK_OK(lm_hess_get(&h, i / LM_FWD_N_POINTS, (lm_fwd_point)(i % LM_FWD_N_POINTS), out->h[i], &err), &err);
    }
    lm_hess_free(&h);
    lm_fwd_runner_free(&r);
}

// The CPU accumulates the upper triangles by syrk and lm_hess_capture completes them: the same
// Hessians as a device without syrk (every batch a whole GEMM), to float32 rounding; the hook
// run alone leaves the lower triangles behind (the Hessians read then are wrong), and
// lm_hess_capture_end, once or twice, gives exactly what lm_hess_capture gives.
static void test_syrk_accumulation(lm_dev *cpu)
{
    lm_err err = {0};
    lm_model *m;
    lm_adapter *a;
    seqs q;
    if (!open_plain(&m, &a, &q))
        goto out;
    CHECK(lm_dev_supports(cpu, LM_OP_SYRK));
    hset by_syrk, by_gemm, no_end, one_end, two_ends;
    CHECK_OK(capture(m, a, cpu, &q, 0, 0, &by_syrk, NULL, NULL, &err), &err);
    lm_dev_i lacking = *cpu->iface;
    lacking.syrk = NULL;
    lm_dev gemm_only = *cpu;
    gemm_only.iface = &lacking;
    CHECK_OK(capture(m, a, &gemm_only, &q, 0, 0, &by_gemm, NULL, NULL, &err), &err);
    lm_dev_destroy(gemm_only.companion);  // the CPU the capture used beside it; gemm_only is a copy
    double d = hset_rel(&by_syrk, &by_gemm);
    CHECK_MSG(d < ROUNDING, "syrk and GEMM accumulation differ by %g", d);
    printf("%-22s syrk vs GEMM accumulation: %.2e\n", "base + lora_plain", d);

    capture_by_hook(m, a, cpu, &q, 0, &no_end);
    capture_by_hook(m, a, cpu, &q, 1, &one_end);
    capture_by_hook(m, a, cpu, &q, 2, &two_ends);
    // Without lm_hess_capture_end the lower triangles are not current (what memory they hold
    // then is undefined: it may even be a freed copy of the finished Hessians, so only the flags
    // can say it); after it, every accumulator is whole.
    CHECK_MSG(no_end.upper_only > 0, "without lm_hess_capture_end no accumulator waits for its lower triangle");
    CHECK_MSG(one_end.upper_only == 0 && two_ends.upper_only == 0,
              "after lm_hess_capture_end %lld and %lld accumulators still wait for their lower triangles",
              (long long)one_end.upper_only, (long long)two_ends.upper_only);
    bool same1 = true, same2 = true;
    for (int64_t i = 0; i < by_syrk.n && i < one_end.n && i < two_ends.n; i++) {
        size_t bytes = (size_t)(by_syrk.dim[i % 4] * by_syrk.dim[i % 4]) * sizeof(float);
        same1 = same1 && memcmp(one_end.h[i], by_syrk.h[i], bytes) == 0;
        same2 = same2 && memcmp(two_ends.h[i], by_syrk.h[i], bytes) == 0;
    }
    CHECK_MSG(same1 && same2, "lm_hess_capture_end once %d, twice %d: not lm_hess_capture's Hessians", same1, same2);
    hset_free(&by_syrk);
    hset_free(&by_gemm);
    hset_free(&no_end);
    hset_free(&one_end);
    hset_free(&two_ends);
out:
    close_plain(m, a, &q);
}

// ==== importance ==============================================================================

// The inverse of the n × n matrix A (Gauss-Jordan with partial pivoting), in double.
static void invert(const double *A, int n, double *inv)
{
    int w = 2 * n;
    double *M = malloc((size_t)n * (size_t)w * sizeof *M);
    if (!M)
        abort();
    for (int r = 0; r < n; r++)
        for (int c = 0; c < w; c++)
            M[r * w + c] = c < n ? A[r * n + c] : (c - n == r);
    for (int c = 0; c < n; c++) {
        int p = c;
        for (int r = c + 1; r < n; r++)
            if (fabs(M[r * w + c]) > fabs(M[p * w + c]))
                p = r;
        for (int k = 0; k < w; k++) {
            double t = M[c * w + k];
            M[c * w + k] = M[p * w + k];
            M[p * w + k] = t;
        }
        double piv = M[c * w + c];
        for (int k = 0; k < w; k++)
            M[c * w + k] /= piv;
        for (int r = 0; r < n; r++)
            if (r != c) {
                double f = M[r * w + c];
                for (int k = 0; k < w; k++)
                    M[r * w + k] -= f * M[c * w + k];
            }
    }
    for (int r = 0; r < n; r++)
        for (int c = 0; c < n; c++)
            inv[r * n + c] = M[r * w + c + n];
    free(M);
}

// A = the n × n H in double, dampened as the reference does it: a zero diagonal entry becomes 1,
// then the diagonal gains damp times the diagonal's mean.
static void damped(double *A, const float *H, int n, double damp)
{
    double mean = 0;
    for (int i = 0; i < n * n; i++)
        A[i] = H[i];
    for (int c = 0; c < n; c++) {
        if (A[c * n + c] == 0)
            A[c * n + c] = 1;
        mean += A[c * n + c] / n;
    }
    for (int c = 0; c < n; c++)
        A[c * n + c] += damp * mean;
}

// H = (2/t) Σ x xᵀ over t random input rows x of width n (at most 48); with `shaped`, input 5
// is dead and every third input leans on input 0, so that H has structure and a zero row.
static void sample_hessian(float *H, int n, int t, uint64_t st, bool shaped)
{
    static double X[128][48];
    for (int i = 0; i < t; i++)
        for (int c = 0; c < n; c++) {
            st = st * 6364136223846793005ull + 1442695040888963407ull;
            double v = (double)(st >> 11) / 9007199254740992.0 - 0.5;
            X[i][c] = !shaped ? v : c == 5 ? 0 : v + (c % 3 == 0 ? X[i][0] : 0);
        }
    for (int r = 0; r < n; r++)
        for (int c = 0; c < n; c++) {
            double sum = 0;
            for (int i = 0; i < t; i++)
                sum += X[i][r] * X[i][c];
            H[r * n + c] = (float)(2 * sum / t);
        }
}

// lm_hess_ucc2 on a 48-input Hessian with a dead input, against U_cc² found another way: the
// Cholesky factor U of H⁻¹ (Uᵀ U = H⁻¹, U upper) has U_cc² = the first diagonal entry of the
// inverse of H's trailing block from input c on (the Schur complement of the inputs after c,
// inverted), computed here by inverting each trailing block.
static void test_ucc2_blocks(void)
{
    lm_err err = {0};
    enum { N = 48, T = 120 };
    float *H = calloc(N * N, sizeof *H);
    double *A = malloc(N * N * sizeof *A), *B = malloc(N * N * sizeof *B), *inv = malloc(N * N * sizeof *inv);
    double ucc2[N], worst = 0;
    sample_hessian(H, N, T, 99, true);
    CHECK_OK(lm_hess_ucc2(ucc2, H, N, 0.01, &err), &err);
    damped(A, H, N, 0.01);
    for (int c = 0; c < N; c++) {
        int m = N - c;
        for (int r = 0; r < m; r++)
            for (int k = 0; k < m; k++)
                B[r * m + k] = A[(c + r) * N + c + k];
        invert(B, m, inv);
        double e = fabs(ucc2[c] - inv[0]) / inv[0];
        worst = e > worst ? e : worst;
    }
    CHECK_MSG(worst < 1e-9, "U_cc² differs from the trailing blocks' inverses by %g", worst);
    printf("U_cc² (48 inputs, one dead) max relative error %.2e\n", worst);
    free(H);
    free(A);
    free(B);
    free(inv);
}

// The factorisation as a unit of the fallback: on a device with room it runs there (the sim
// runs the CPU's LAPACK, so U_cc² is bit for bit the host's); on one without room for the
// matrix it runs on the CPU, said as a fallback, with the same result; the damping raised for a
// Hessian that is not positive definite is the host's too. Nothing is left on the device.
static void test_ucc2_devices(void)
{
    lm_err err = {0};
    enum { N = 48, T = 90 };
    static float H[N * N];
    double want[N], got[N];
    sample_hessian(H, N, T, 5, false);
    CHECK_OK(lm_hess_ucc2(want, H, N, 0.01, &err), &err);
    const char *specs[] = {"sim:1MiB", "sim:16KiB"};  // the damped matrix takes 18 KiB
    for (int i = 0; i < 2; i++) {
        lm_dev *sim = NULL;
        lm_dev_opts o = {.threads = 2};
        CHECK_OK(lm_dev_open(&sim, specs[i], &o, NULL, 0, &err), &err);
        if (!sim)
            continue;
        notes seen = {0};
        memset(got, 0, sizeof got);
        CHECK_OK(lm_hess_ucc2_raised(sim, got, H, N, 0.01, "model.layers.3.mlp.down_proj", collect_note, &seen, &err),
                 &err);
        CHECK_MSG(memcmp(got, want, sizeof want) == 0, "%s: U_cc² differs from the host's", specs[i]);
        if (i == 0)
            CHECK_MSG(seen.n == 0, "%s: notes where none were due: %s", specs[i], seen.text);
        else
            CHECK_MSG(seen.n == 1 && strstr(seen.text, "fallback: hessian factor of model.layers.3.mlp.down_proj on "
                                                       "cpu (sim:16KiB: out of memory allocating 18.00 KiB"),
                      "%s: the fallback is not said as expected: %s", specs[i], seen.text);
        if (i == 1)
            CHECK_MSG(seen.fallbacks == 1 && !strcmp(seen.phase, "hessian") &&
                      !strcmp(seen.unit, "factor of model.layers.3.mlp.down_proj") && !strcmp(seen.from, specs[i]) &&
                      !strcmp(seen.to, "cpu"), "%s: fallback %d: %s %s from %s to %s", specs[i], seen.fallbacks,
                      seen.phase, seen.unit, seen.from, seen.to);
        size_t fr = 0, tot = 0;
        lm_dev_mem_info(sim, &fr, &tot);
        CHECK_MSG(fr == tot, "%s: %zu of %zu bytes free after the factorisation", specs[i], fr, tot);
        // input 7 with a negative curvature: damping 0.01 and 0.1 are not enough, 1 is
        float bad = H[7 * N + 7];
        H[7 * N + 7] = -0.5f * bad;
        double raised[N];
        CHECK_OK(lm_hess_ucc2(raised, H, N, 1.0, &err), &err);
        memset(&seen, 0, sizeof seen);
        CHECK_OK(lm_hess_ucc2_raised(sim, got, H, N, 0.01, "H", collect_note, &seen, &err), &err);
        CHECK_MSG(memcmp(got, raised, sizeof raised) == 0, "%s: U_cc² with the damping raised differs from the host's",
                  specs[i]);
        CHECK_MSG(strstr(seen.text, "not positive definite with damping 0.01: trying 0.1") &&
                  strstr(seen.text, "with damping 0.1: trying 1\n") && !strstr(seen.text, "trying 10"),
                  "%s: the damping was not raised as expected: %s", specs[i], seen.text);
        // beyond any damping: an error naming the Hessian
        H[7 * N + 7] = -1e9f;
        CHECK_FAILS(lm_hess_ucc2_raised(sim, got, H, N, 0.01, "model.layers.0.self_attn.q_proj", NULL, NULL, &err),
                    LM_ERR_FORMAT, "model.layers.0.self_attn.q_proj: the damped Hessian (48 x 48) is not positive "
                    "definite", &err);
        H[7 * N + 7] = bad;
        lm_dev_destroy(sim);
    }
    // the device LLMERGE_TEST_DEVICE names (cuda on a GPU machine): its own factorisation,
    // which agrees with LAPACK's to double rounding
    const char *spec = getenv("LLMERGE_TEST_DEVICE");
    lm_dev *dev = NULL;
    lm_dev_opts o = {.threads = 2};
    if (spec && *spec && lm_dev_open(&dev, spec, &o, NULL, 0, &err) == LM_OK) {
        notes seen = {0};
        CHECK_OK(lm_hess_ucc2_raised(dev, got, H, N, 0.01, "H", collect_note, &seen, &err), &err);
        double worst = 0;
        for (int c = 0; c < N; c++)
            worst = fmax(worst, fabs(got[c] - want[c]) / want[c]);
        CHECK_MSG(worst < 1e-12 && seen.n == 0, "%s: U_cc² within %g of the host's, notes: %s", spec, worst,
                  seen.text);
        printf("U_cc² on %s: max relative difference from LAPACK's %.2e\n", spec, worst);
    }
    lm_dev_destroy(dev);
}

static void test_importance(void)
{
    lm_err err = {0};
    enum { N = 5, ROWS = 3 };
    // H = Xᵀ X / k for a fixed X, with input 3 dead (a zero row and column)
    float H[N * N] = {0}, tau[ROWS * N], imp[ROWS * N];
    uint64_t st = 7;
    double X[12][N];
    for (int t = 0; t < 12; t++)
        for (int c = 0; c < N; c++) {
            st = st * 6364136223846793005ull + 1442695040888963407ull;
            X[t][c] = c == 3 ? 0 : (double)(st >> 11) / 9007199254740992.0 - 0.5;
        }
    for (int r = 0; r < N; r++)
        for (int c = 0; c < N; c++) {
            double s = 0;
            for (int t = 0; t < 12; t++)
                s += X[t][r] * X[t][c];
            H[r * N + c] = (float)(s / 6);
        }
    for (int i = 0; i < ROWS * N; i++)
        tau[i] = (float)(i % 7) - 3.0f;
    CHECK_OK(lm_hess_importance(imp, tau, ROWS, N, H, 0.01, &err), &err);

    // the reference: zero diagonal → 1, + 0.01·mean(diag), inverse, U upper with Uᵀ U = H⁻¹
    double A[N * N], inv[N * N], U[N * N] = {0};
    damped(A, H, N, 0.01);
    invert(A, N, inv);
    for (int i = 0; i < N; i++)  // Uᵀ U = inv, row by row
        for (int j = i; j < N; j++) {
            double s = inv[i * N + j];
            for (int k = 0; k < i; k++)
                s -= U[k * N + i] * U[k * N + j];
            U[i * N + j] = i == j ? sqrt(s) : s / U[i * N + i];
        }
    double worst = 0;
    for (int j = 0; j < ROWS; j++)
        for (int c = 0; c < N; c++) {
            double want = (double)tau[j * N + c] * tau[j * N + c] / (U[c * N + c] * U[c * N + c]);
            double e = fabs(imp[j * N + c] - want) / (fabs(want) > 1e-30 ? fabs(want) : 1);
            worst = e > worst ? e : worst;
        }
    CHECK_MSG(worst < 1e-5, "importance differs from the reference by %g", worst);
    printf("importance (5 x 5, one dead input) max relative error %.2e\n", worst);

    // not positive definite even damped
    float bad[4] = {1, 2, 2, 1}, t2[2] = {1, 1}, i2[2];
    CHECK_FAILS(lm_hess_importance(i2, t2, 1, 2, bad, 0.01, &err), LM_ERR_FORMAT, "not positive definite", &err);
}

int main(void)
{
    if (!fixture_env("test_hessian"))
        return 1;
    lm_err err;
    lm_dev *cpu = NULL;
    CHECK_OK(lm_dev_cpu_create(&cpu, 2, &err), &err);
    if (cpu) {
        test_reference(cpu);
        test_batches_and_devices(cpu);
        test_syrk_accumulation(cpu);
        test_finishing();
        test_each_hessian(cpu);
        test_importance();
        test_ucc2_blocks();
        test_ucc2_devices();
    }
    lm_dev_destroy(cpu);
    return check_report("test_hessian");
}
