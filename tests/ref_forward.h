// The reference forward pass the forward-pass and Hessian tests compare with: Hugging Face's
// semantics written out in double precision, one sequence at a time, with plain loops straight
// from docs/formats.md "The forward pass" and nothing shared with lib/forward.c, so the two
// cannot agree by sharing a mistake. Also the calibration sequences both tests load from the
// fixtures. For test programs only (static functions; each includes it once). The program sets
// `fixtures` (fixture_env) before loading them.
#ifndef LM_TEST_REF_FORWARD_H
#define LM_TEST_REF_FORWARD_H

#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "adapter.h"
#include "calib.h"
#include "check.h"
#include "fixture.h"
#include "forward.h"
#include "config.h"
#include "model.h"
#include "util.h"

// ==== the reference forward pass ==============================================================

typedef struct ref_ctx {
    const lm_model *m;
    const lm_adapter *a;
    bool no_rope_scaling;  // compute rope without the config's scaling (to see that it matters)
} ref_ctx;

// A tensor as doubles (new memory), the adapter's saved replacement first; NULL when absent.
static double *tensor_d(const ref_ctx *c, const char *name, int64_t *numel)
{
    const lm_st_tensor *t = NULL;
    for (int64_t i = 0; c->a && i < c->a->n_saved && !t; i++)
        if (strcmp(c->a->saved[i].base_name, name) == 0)
            t = c->a->saved[i].t;
    if (!t)
        t = lm_model_find(c->m, name);
    if (!t)
        return NULL;
    float *f = malloc((size_t)t->numel * sizeof *f);
    double *d = malloc((size_t)t->numel * sizeof *d);
    lm_err err;
    CHECK_OK(lm_st_read_f32(t, f, &err), &err);
    for (int64_t i = 0; i < t->numel; i++)
        d[i] = f[i];
    free(f);
    if (numel)
        *numel = t->numel;
    return d;
}

static double *st_d(const lm_st_tensor *t)
{
    float *f = malloc((size_t)t->numel * sizeof *f);
    double *d = malloc((size_t)t->numel * sizeof *d);
    lm_err err;
    CHECK_OK(lm_st_read_f32(t, f, &err), &err);
    for (int64_t i = 0; i < t->numel; i++)
        d[i] = f[i];
    free(f);
    return d;
}

// The DoRA weight of docs/merging.md "Task vectors" merged explicitly, in place over W (out, in):
// W ← m ⊙ (W + s·B@A) / ‖W + s·B@A‖, the norm per row o of B@A ([out, in]), whose element
// (o, i) is at W[o·so + i·si] (a linear weight: so = in, si = 1; an embedding table stored
// transposed: so = 1, si = out).
static void ref_dora_merge_strided(const lm_lora_module *mod, double *W, int64_t out, int64_t in, int64_t so,
                                   int64_t si)
{
    double *A = st_d(mod->a), *B = st_d(mod->b), *m = st_d(mod->magnitude);
    for (int64_t o = 0; o < out; o++) {
        double ss = 0;
        for (int64_t i = 0; i < in; i++) {
            double d = 0;
            for (int64_t j = 0; j < mod->r; j++)
                d += B[o * mod->r + j] * A[j * in + i];
            W[o * so + i * si] += mod->scale * d;
            ss += W[o * so + i * si] * W[o * so + i * si];
        }
        for (int64_t i = 0; i < in; i++)
            W[o * so + i * si] *= ss > 0 ? m[o] / sqrt(ss) : 0.0;
    }
    free(A);
    free(B);
    free(m);
}

static void ref_dora_merge(const lm_lora_module *mod, double *W, int64_t out, int64_t in)
{
    ref_dora_merge_strided(mod, W, out, in, in, 1);
}

// y (T, out) = x (T, in) · Wᵀ + b + s·((x Aᵀ) Bᵀ + lora_B.bias) for the module `path`; with
// DoRA, x · W'ᵀ + b + s·lora_B.bias for W' the merged DoRA weight.
static void ref_linear(const ref_ctx *c, const char *path, const double *x, int64_t T, int64_t in, int64_t out,
                       double *y)
{
    char name[256];
    snprintf(name, sizeof name, "%s.weight", path);
    double *W = tensor_d(c, name, NULL);
    snprintf(name, sizeof name, "%s.bias", path);
    double *b = tensor_d(c, name, NULL);
    CHECK_MSG(W != NULL, "%s.weight missing", path);
    const lm_lora_module *mod = NULL, *bmod = NULL;
    for (int64_t i = 0; c->a && i < c->a->n_modules; i++) {
        const lm_lora_module *q = &c->a->modules[i];
        snprintf(name, sizeof name, "%s.weight", path);
        if (strcmp(q->base_name, name) == 0 && q->kind == LM_LORA_LINEAR)
            mod = q;
        snprintf(name, sizeof name, "%s.bias", path);
        if (q->bias_name && strcmp(q->bias_name, name) == 0)
            bmod = q;
    }
    if (mod && mod->magnitude) {
        ref_dora_merge(mod, W, out, in);
        mod = NULL;  // W holds the whole adapted weight now
    }
    for (int64_t t = 0; t < T; t++)
        for (int64_t o = 0; o < out; o++) {
            double s = b ? b[o] : 0.0;
            for (int64_t i = 0; i < in; i++)
                s += x[t * in + i] * W[o * in + i];
            y[t * out + o] = s;
        }
    if (mod) {
        double *A = st_d(mod->a), *B = st_d(mod->b);
        int64_t r = mod->r;
        for (int64_t t = 0; t < T; t++)
            for (int64_t o = 0; o < out; o++) {
                double s = 0;
                for (int64_t j = 0; j < r; j++) {
                    double xa = 0;
                    for (int64_t i = 0; i < in; i++)
                        xa += x[t * in + i] * A[j * in + i];
                    s += xa * B[o * r + j];
                }
                y[t * out + o] += mod->scale * s;
            }
        free(A);
        free(B);
    }
    if (bmod) {
        double *bb = st_d(bmod->bias);
        for (int64_t t = 0; t < T; t++)
            for (int64_t o = 0; o < out; o++)
                y[t * out + o] += bmod->scale * bb[o];
        free(bb);
    }
    free(W);
    free(b);
}

static void ref_rmsnorm(const double *x, const double *w, int64_t T, int64_t H, double eps, double *y)
{
    for (int64_t t = 0; t < T; t++) {
        double ss = 0;
        for (int64_t i = 0; i < H; i++)
            ss += x[t * H + i] * x[t * H + i];
        double g = 1.0 / sqrt(ss / (double)H + eps);
        for (int64_t i = 0; i < H; i++)
            y[t * H + i] = w[i] * (x[t * H + i] * g);
    }
}

// inv_freq[i] = theta^(−2i/d), then the Llama 3 rule: with λ = 2π / inv_freq, keep when
// λ < orig/high, divide by factor when λ > orig/low, else blend with s = (orig/λ − low)/(high − low).
static void ref_inv_freq(const lm_config *cfg, bool no_scaling, double *out)
{
    int64_t d = cfg->head_dim;
    const lm_rope_scaling *rs = &cfg->rope_scaling;
    for (int64_t i = 0; i < d / 2; i++) {
        double f = pow(cfg->rope_theta, -2.0 * (double)i / (double)d);
        if (!no_scaling && rs->kind == LM_ROPE_LINEAR) {
            f /= rs->factor;
        } else if (!no_scaling && rs->kind == LM_ROPE_LLAMA3) {
            double orig = (double)rs->original_max_position_embeddings, lam = 2 * M_PI / f;
            if (lam > orig / rs->low_freq_factor) {
                f /= rs->factor;
            } else if (lam >= orig / rs->high_freq_factor) {
                double s = (orig / lam - rs->low_freq_factor) / (rs->high_freq_factor - rs->low_freq_factor);
                f = (1 - s) * f / rs->factor + s * f;
            }
        }
        out[i] = f;
    }
}

// Rotates x (T, heads·hd) in place: x·cos + rotate_half(x)·sin, rotate_half(x) = (−x2, x1).
static void ref_rope(double *x, int64_t T, int64_t heads, int64_t hd, const double *inv_freq)
{
    int64_t half = hd / 2;
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < heads; h++) {
            double *v = x + (t * heads + h) * hd, tmp[1024];
            for (int64_t i = 0; i < hd; i++) {
                double ang = (double)t * inv_freq[i % half];
                double rot = i < half ? -v[i + half] : v[i - half];
                tmp[i] = v[i] * cos(ang) + rot * sin(ang);
            }
            memcpy(v, tmp, (size_t)hd * sizeof *v);
        }
}

// What the reference keeps of one sequence: logits and each layer's linear inputs.
typedef struct ref_out {
    double *logits;                    // (T, V)
    double *points[8][LM_FWD_N_POINTS];  // per layer (< 8), (T, cols of the point)
} ref_out;

static void ref_free(ref_out *o)
{
    free(o->logits);
    for (int l = 0; l < 8; l++)
        for (int p = 0; p < LM_FWD_N_POINTS; p++)
            free(o->points[l][p]);
    memset(o, 0, sizeof *o);
}

static double *dup_d(const double *x, int64_t n)
{
    double *y = malloc((size_t)n * sizeof *y);
    memcpy(y, x, (size_t)n * sizeof *y);
    return y;
}

// The forward pass of one sequence of T tokens, in double.
static void ref_forward(const ref_ctx *c, const int32_t *ids, int64_t T, ref_out *o)
{
    const lm_config *cfg = &c->m->config;
    int64_t H = cfg->hidden_size, I = cfg->intermediate_size, nh = cfg->num_attention_heads;
    int64_t nkv = cfg->num_key_value_heads, hd = cfg->head_dim, V = cfg->vocab_size, L = cfg->num_hidden_layers;
    double eps = cfg->rms_norm_eps;
    memset(o, 0, sizeof *o);
    double *h = calloc((size_t)(T * H), sizeof *h), *xn = calloc((size_t)(T * H), sizeof *xn);
    double *q = calloc((size_t)(T * nh * hd), sizeof *q), *k = calloc((size_t)(T * nkv * hd), sizeof *k);
    double *v = calloc((size_t)(T * nkv * hd), sizeof *v), *att = calloc((size_t)(T * nh * hd), sizeof *att);
    double *tmp = calloc((size_t)(T * H), sizeof *tmp), *g = calloc((size_t)(T * I), sizeof *g);
    double *u = calloc((size_t)(T * I), sizeof *u), inv_freq[512];
    ref_inv_freq(cfg, c->no_rope_scaling, inv_freq);

    // embeddings (+ s · B A[:, id] for an embedding LoRA; with DoRA the table merged explicitly,
    // E' = m ⊙ (E + s·(B A)ᵀ) / ‖E + s·(B A)ᵀ‖ with the norm per hidden feature, over the
    // vocabulary, as PEFT's DoraEmbeddingLayer takes it)
    double *E = tensor_d(c, "model.embed_tokens.weight", NULL), *Ein = E;
    for (int64_t i = 0; c->a && i < c->a->n_modules; i++) {
        const lm_lora_module *mod = &c->a->modules[i];
        if (mod->kind != LM_LORA_EMBEDDING || !mod->magnitude)
            continue;
        Ein = dup_d(E, V * H);  // A (r, V), B (H, r): B@A is E transposed
        ref_dora_merge_strided(mod, Ein, H, V, 1, H);
    }
    for (int64_t t = 0; t < T; t++)
        memcpy(h + t * H, Ein + ids[t] * H, (size_t)H * sizeof *h);
    for (int64_t i = 0; c->a && i < c->a->n_modules; i++) {
        const lm_lora_module *mod = &c->a->modules[i];
        if (mod->kind != LM_LORA_EMBEDDING || mod->magnitude)
            continue;
        double *A = st_d(mod->a), *B = st_d(mod->b);  // A (r, V), B (H, r)
        for (int64_t t = 0; t < T; t++)
            for (int64_t e = 0; e < H; e++) {
                double s = 0;
                for (int64_t j = 0; j < mod->r; j++)
                    s += B[e * mod->r + j] * A[j * V + ids[t]];
                h[t * H + e] += mod->scale * s;
            }
        free(A);
        free(B);
    }

    char path[128], name[160];
    for (int64_t l = 0; l < L; l++) {
        snprintf(name, sizeof name, "model.layers.%lld.input_layernorm.weight", (long long)l);
        double *w = tensor_d(c, name, NULL);
        ref_rmsnorm(h, w, T, H, eps, xn);
        free(w);
        o->points[l][LM_FWD_ATTN_IN] = dup_d(xn, T * H);
        snprintf(path, sizeof path, "model.layers.%lld.self_attn.q_proj", (long long)l);
        ref_linear(c, path, xn, T, H, nh * hd, q);
        snprintf(path, sizeof path, "model.layers.%lld.self_attn.k_proj", (long long)l);
        ref_linear(c, path, xn, T, H, nkv * hd, k);
        snprintf(path, sizeof path, "model.layers.%lld.self_attn.v_proj", (long long)l);
        ref_linear(c, path, xn, T, H, nkv * hd, v);
        ref_rope(q, T, nh, hd, inv_freq);
        ref_rope(k, T, nkv, hd, inv_freq);
        // causal attention, query head hh reading kv head hh / (nh / nkv)
        // Mistral's sliding window: keys j with t − j < sliding_window
        int64_t win = cfg->arch == LM_ARCH_MISTRAL && cfg->sliding_window > 0 ? cfg->sliding_window : T;
        double *p = calloc((size_t)T, sizeof *p);
        for (int64_t t = 0; t < T; t++)
            for (int64_t hh = 0; hh < nh; hh++) {
                int64_t kh = hh / (nh / nkv), j0 = t - win + 1 > 0 ? t - win + 1 : 0;
                double mx = -INFINITY, sum = 0;
                for (int64_t j = j0; j <= t; j++) {
                    double s = 0;
                    for (int64_t i = 0; i < hd; i++)
                        s += q[(t * nh + hh) * hd + i] * k[(j * nkv + kh) * hd + i];
                    p[j] = s / sqrt((double)hd);
                    mx = p[j] > mx ? p[j] : mx;
                }
                for (int64_t j = j0; j <= t; j++)
                    sum += (p[j] = exp(p[j] - mx));
                for (int64_t i = 0; i < hd; i++) {
                    double s = 0;
                    for (int64_t j = j0; j <= t; j++)
                        s += p[j] / sum * v[(j * nkv + kh) * hd + i];
                    att[(t * nh + hh) * hd + i] = s;
                }
            }
        free(p);
        o->points[l][LM_FWD_O_IN] = dup_d(att, T * nh * hd);
        snprintf(path, sizeof path, "model.layers.%lld.self_attn.o_proj", (long long)l);
        ref_linear(c, path, att, T, nh * hd, H, tmp);
        for (int64_t i = 0; i < T * H; i++)
            h[i] += tmp[i];
        snprintf(name, sizeof name, "model.layers.%lld.post_attention_layernorm.weight", (long long)l);
        w = tensor_d(c, name, NULL);
        ref_rmsnorm(h, w, T, H, eps, xn);
        free(w);
        o->points[l][LM_FWD_MLP_IN] = dup_d(xn, T * H);
        snprintf(path, sizeof path, "model.layers.%lld.mlp.gate_proj", (long long)l);
        ref_linear(c, path, xn, T, H, I, g);
        snprintf(path, sizeof path, "model.layers.%lld.mlp.up_proj", (long long)l);
        ref_linear(c, path, xn, T, H, I, u);
        for (int64_t i = 0; i < T * I; i++)
            g[i] = g[i] / (1 + exp(-g[i])) * u[i];
        o->points[l][LM_FWD_DOWN_IN] = dup_d(g, T * I);
        snprintf(path, sizeof path, "model.layers.%lld.mlp.down_proj", (long long)l);
        ref_linear(c, path, g, T, I, H, tmp);
        for (int64_t i = 0; i < T * H; i++)
            h[i] += tmp[i];
    }
    double *w = tensor_d(c, "model.norm.weight", NULL);
    ref_rmsnorm(h, w, T, H, eps, xn);
    free(w);
    o->logits = malloc((size_t)(T * V) * sizeof *o->logits);
    if (lm_model_find(c->m, "lm_head.weight")) {
        ref_linear(c, "lm_head", xn, T, H, V, o->logits);
    } else {  // tied: the embedding matrix of the base
        for (int64_t t = 0; t < T; t++)
            for (int64_t r = 0; r < V; r++) {
                double s = 0;
                for (int64_t i = 0; i < H; i++)
                    s += xn[t * H + i] * E[r * H + i];
                o->logits[t * V + r] = s;
            }
    }
    if (Ein != E)
        free(Ein);
    free(E);
    free(h);
    free(xn);
    free(q);
    free(k);
    free(v);
    free(att);
    free(tmp);
    free(g);
    free(u);
}

// ==== fixtures ================================================================================

typedef struct seqs {
    lm_calib c;
    lm_fwd_seq *s;  // (c.n_seqs)
    int64_t n, T;
} seqs;

static void load_seqs(seqs *q, int64_t vocab)
{
    memset(q, 0, sizeof *q);
    char *p = fx("calib/calib.jsonl");
    lm_err err;
    lm_calib_opts o = {.vocab_size = vocab};
    CHECK_OK(lm_calib_load(&q->c, p, &o, &err), &err);
    free(p);
    q->n = q->c.n_seqs;
    q->T = q->c.n_tokens;
    q->s = calloc((size_t)q->n + 1, sizeof *q->s);
    for (int64_t i = 0; i < q->n; i++) {
        q->s[i].ids = q->c.ids + q->c.offsets[i];
        q->s[i].len = q->c.offsets[i + 1] - q->c.offsets[i];
    }
}

static void free_seqs(seqs *q)
{
    lm_calib_free(&q->c);
    free(q->s);
}

#endif
