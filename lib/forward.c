// The forward pass over the device interface, and the runner that falls back to the CPU. See
// forward.h.
//
// Per batch of T tokens (packed sequences), with H hidden, Q = heads·head_dim, KV =
// kv_heads·head_dim and I intermediate:
//
//   h = embed[ids] (+ s·Aᵀ[ids] Bᵀ for an embedding LoRA)
//   per layer:  xn = rmsnorm(h);  q, k, v = linear(xn);  rope(q, k);  att = attention(q, k, v)
//               h += linear_o(att);  xn = rmsnorm(h);  g = silu(linear_gate(xn)) · linear_up(xn)
//               h += linear_down(g)
//   logits = linear_head(rmsnorm(h)), in chunks of rows;  nll = log-softmax NLL of each row
//
// where linear(x) = x Wᵀ + b + s·(x Aᵀ) Bᵀ, the residual additions done by the GEMM itself
// (beta = 1) into h.
#include "forward.h"

#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "arch.h"
#include "dtype.h"
#include "safetensors.h"
#include "util.h"

// Logits are computed for at most this many floats of rows at a time (64 MiB), so a large
// vocabulary does not make the arena grow with the batch.
#define LOGIT_FLOATS ((int64_t)1 << 24)
#define DEFAULT_MAX_TOKENS 4096
#define ALIGN 64  // bytes; every arena region starts on such a boundary

// ==== the model on a device ===================================================================

// One linear layer, y = x Wᵀ + b + scale·(x Aᵀ) Bᵀ. Pointers are device memory.
typedef struct fwd_linear {
    const float *w;   // (out, in)
    const float *b;   // (out) the bias plus scale·lora_B.bias, or NULL
    const float *a;   // (r, in) lora_A, or NULL without LoRA
    const float *bm;  // (out, r) lora_B
    int64_t out, in, r;
    float scale;
} fwd_linear;

typedef struct fwd_layer {
    const float *in_norm;    // (hidden) input_layernorm
    const float *post_norm;  // (hidden) post_attention_layernorm
    fwd_linear q, k, v, o, gate, up, down;
} fwd_layer;

// The activations of one batch: regions of one device allocation.
typedef struct fwd_arena {
    float *h;          // (T, hidden) the residual stream
    float *xn;         // (T, hidden) its normed copy
    float *q;          // (T, heads·head_dim)
    float *k, *v;      // (T, kv_heads·head_dim)
    float *att;        // (T, heads·head_dim) attention output
    float *gate, *up;  // (T, intermediate)
    float *lora;       // (T, max_r) x Aᵀ
    float *logits;     // (logit_rows, vocab)
    float *nll;        // (T)
    int32_t *ints;     // (4, T): ids, positions, sequence starts, targets, one upload
} fwd_arena;

struct lm_fwd {
    lm_dev *dev;
    int64_t hidden, inter, n_layers, heads, kv_heads, head_dim, vocab;
    float eps;
    float attn_scale;          // head_dim^-1/2
    const float *embed;        // (vocab, hidden) the table tokens are looked up in
    bool embed_scaled;         // embed has a DoRA scale folded in (a tied lm_head reads the base's)
    const float *emb_at;       // (vocab, emb_r) lora_embedding_A transposed, or NULL
    const float *emb_b;        // (hidden, emb_r) lora_embedding_B
    int64_t emb_r;
    float emb_scale;
    fwd_layer *layers;         // (n_layers)
    const float *final_norm;   // (hidden)
    fwd_linear head;           // lm_head; its w is embed when the embeddings are tied
    const float *inv_freq;     // (head_dim / 2)
    int64_t max_r;             // the largest LoRA rank (0 without)
    int64_t window;            // sliding-window attention: keys within this many rows (0: all)

    void **owned;              // (n_owned) device allocations holding the weights
    int64_t n_owned, cap_owned;
    int64_t host_converted;    // weights converted on the host: no room on the device for their
                               // stored bytes beside them
    size_t weight_bytes;

    void *arena;               // device memory for arena_tokens tokens, or NULL
    int64_t arena_tokens;
    int32_t *host_ints;        // (4, arena_tokens) staged for the upload
};

const char *lm_fwd_point_module(lm_fwd_point p)
{
    switch (p) {
    case LM_FWD_ATTN_IN: return "self_attn.q_proj";
    case LM_FWD_O_IN: return "self_attn.o_proj";
    case LM_FWD_MLP_IN: return "mlp.gate_proj";
    case LM_FWD_DOWN_IN: return "mlp.down_proj";
    case LM_FWD_N_POINTS: break;
    }
    return "?";
}

lm_dev *lm_fwd_device(const lm_fwd *f)
{
    return f->dev;
}

int64_t lm_fwd_host_converted(const lm_fwd *f)
{
    return f->host_converted;
}

size_t lm_fwd_weight_bytes(const lm_fwd *f)
{
    return f->weight_bytes;
}

void lm_fwd_free(lm_fwd *f)
{
    if (!f)
        return;
    for (int64_t i = 0; i < f->n_owned; i++)
        lm_dev_buf_free(f->dev, f->owned[i]);
    lm_dev_buf_free(f->dev, f->arena);
    free(f->owned);
    free(f->layers);
    free(f->host_ints);
    free(f);
}

// ---- loading --------------------------------------------------------------------------------

// What loading needs besides the model under construction.
typedef struct fwd_loader {
    lm_fwd *f;
    const lm_model *m;
    const lm_adapter *a;
    bool *used_module;  // (a->n_modules) consumed by the forward pass
    bool *used_saved;   // (a->n_saved)
} fwd_loader;

// Allocates n floats of device memory for weights; remembered for lm_fwd_free.
static lm_status weight_alloc(lm_fwd *f, int64_t n, float **out, lm_err *err)
{
    *out = NULL;
    if (f->n_owned == f->cap_owned) {
        int64_t cap = f->cap_owned ? 2 * f->cap_owned : 64;
        void **o = realloc(f->owned, (size_t)cap * sizeof *o);
        if (!o)
            return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
        f->owned = o;
        f->cap_owned = cap;
    }
    uint64_t bytes;
    if (n < 0 || !lm_mul_u64((uint64_t)n, sizeof(float), &bytes) || bytes > SIZE_MAX)
        return lm_err_set(err, LM_ERR_UNSUPPORTED, "a weight of %" PRId64 " floats is too large", n);
    void *p;
    lm_status s = lm_dev_alloc(f->dev, (size_t)bytes, &p, err);
    if (s != LM_OK)
        return s;
    f->owned[f->n_owned++] = p;
    f->weight_bytes += (size_t)bytes;
    *out = p;
    return LM_OK;
}

// Places n host floats on the device.
static lm_status put_host(lm_fwd *f, const float *host, int64_t n, const float **out, lm_err *err)
{
    float *d;
    lm_status s = weight_alloc(f, n, &d, err);
    if (s == LM_OK)
        s = lm_dev_upload(f->dev, d, host, (size_t)n * sizeof *host, err);
    *out = d;
    return s;
}

// Names the tensor a failure to place it concerns. Out of memory is left as the device said it:
// that is the reason a fallback line gives, and the runner names the weights there.
static lm_status placing(lm_status s, const char *tensor, lm_err *err)
{
    return s == LM_OK || s == LM_ERR_DEVICE_OOM ? s : lm_err_prefix(err, "tensor '%s'", tensor);
}

// A tensor as float32 in new host memory (caller frees).
static lm_status read_host(const lm_st_tensor *t, float **out, lm_err *err)
{
    *out = malloc((size_t)t->numel * sizeof **out + 1);
    if (!*out)
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory reading %s", t->name);
    lm_status s = lm_st_read_f32(t, *out, err);
    if (s != LM_OK) {
        free(*out);
        *out = NULL;
    }
    return s;
}

// Places tensor t on a device with memory of its own as float32 from its stored bytes: F32
// uploaded as it is, BF16 and F16 uploaded into a buffer beside the weight and converted there
// (the conversion is exact, so the values are the host's), so that the host neither converts
// nor copies them into memory of its own and the link carries half the bytes. LM_ERR_DEVICE_OOM
// with nothing left allocated when the device has no room for that buffer (the caller then
// converts on the host); other failures as the device said them.
static lm_status put_stored(lm_fwd *f, const lm_st_tensor *t, float *dst, lm_err *err)
{
    size_t bytes = (size_t)t->nbytes;
    if (t->dtype == LM_DTYPE_F32)
        return lm_dev_upload(f->dev, dst, t->data, bytes, err);
    void *stored = NULL;
    lm_status s = lm_dev_alloc(f->dev, bytes, &stored, err);
    if (s == LM_OK && (s = lm_dev_upload(f->dev, stored, t->data, bytes, err)) == LM_OK)
        s = lm_dev_to_f32(f->dev, dst, stored, t->dtype, t->numel, err);
    lm_dev_buf_free(f->dev, stored);
    return s;
}

// Places tensor t on the device as float32: in place when the device reads host memory and the
// tensor is F32 and aligned, else converted (on the device from the stored bytes where there is
// room for them, through a host copy otherwise).
static lm_status put_tensor(lm_fwd *f, const lm_st_tensor *t, const float **out, lm_err *err)
{
    lm_dev *d = f->dev;
    if (lm_dev_host_memory(d) && t->dtype == LM_DTYPE_F32 && (uintptr_t)t->data % sizeof(float) == 0) {
        *out = t->data;
        return LM_OK;
    }
    lm_status s;
    if (lm_dev_host_memory(d)) {
        float *dst;
        if ((s = weight_alloc(f, t->numel, &dst, err)) != LM_OK)
            return s;
        *out = dst;
        s = lm_dev_to_f32(d, dst, t->data, t->dtype, t->numel, err);
        return s == LM_OK ? s : lm_err_prefix(err, "%s", t->name);
    }
    if (t->dtype == LM_DTYPE_F32 || t->dtype == LM_DTYPE_BF16 || t->dtype == LM_DTYPE_F16) {
        float *dst;
        if ((s = weight_alloc(f, t->numel, &dst, err)) != LM_OK)
            return placing(s, t->name, err);
        *out = dst;
        if ((s = put_stored(f, t, dst, err)) != LM_ERR_DEVICE_OOM)
            return placing(s, t->name, err);
        // no room for the stored bytes beside the weight: converted on the host into it
        f->host_converted++;
        float *host;
        if ((s = read_host(t, &host, err)) != LM_OK)
            return s;
        s = lm_dev_upload(f->dev, dst, host, (size_t)t->numel * sizeof *host, err);
        free(host);
        return placing(s, t->name, err);
    }
    float *host;
    if ((s = read_host(t, &host, err)) != LM_OK)
        return s;
    s = put_host(f, host, t->numel, out, err);
    free(host);
    return placing(s, t->name, err);
}

// The tensor the forward pass uses for base tensor `name`: the adapter's saved replacement when
// it has one, else the model's. NULL (no error) when neither has it.
static const lm_st_tensor *source(fwd_loader *L, const char *name, bool use_adapter)
{
    int64_t i;
    if (use_adapter && L->a && lm_adapter_lookup(L->a, name, &i) == LM_TOUCH_SAVED) {
        L->used_saved[i] = true;
        return L->a->saved[i].t;
    }
    return lm_model_find(L->m, name);
}

// Places the tensor the architecture calls (layer, slot) (its bias with want_bias); *out NULL
// when the architecture has no such tensor.
// The tensor of `slot` (NULL in *t, and LM_OK, when the architecture has none there).
static lm_status arch_tensor(fwd_loader *L, const lm_arch_desc *desc, int layer, lm_arch_slot slot, bool want_bias,
                             bool use_adapter, const lm_st_tensor **t, lm_err *err)
{
    *t = NULL;
    const lm_arch_tensor *at = lm_arch_get(desc, layer, slot, want_bias);
    if (!at)
        return LM_OK;
    if (!(*t = source(L, at->name, use_adapter)))
        return lm_err_set(err, LM_ERR_NOT_FOUND, "%s: tensor %s is missing", L->m->dir, at->name);
    return LM_OK;
}

static lm_status put_arch(fwd_loader *L, const lm_arch_desc *desc, int layer, lm_arch_slot slot, bool want_bias,
                          bool use_adapter, const float **out, lm_err *err)
{
    *out = NULL;
    const lm_st_tensor *t;
    lm_status s = arch_tensor(L, desc, layer, slot, want_bias, use_adapter, &t, err);
    return s != LM_OK || !t ? s : put_tensor(L->f, t, out, err);
}

// ---- DoRA ------------------------------------------------------------------------------------
// A DoRA layer computes m ⊙ (x Wᵀ + s·(x Aᵀ) Bᵀ) / ‖W + s·B@A‖ per output feature, its bias
// added after (PEFT's DoraLinearLayer without dropout; the merged weight of
// docs/merging.md "Task vectors"). That is the plain LoRA layer with W and B each multiplied
// row by row by c = m / ‖W + s·B@A‖_row, so c
// is computed once while the layer is placed and folded into the placed W and B: the pass itself
// has no extra step, and a device needs no operation for DoRA besides GEMM. For the embedding
// (PEFT's DoraEmbeddingLayer) the norm runs down each hidden feature, over the vocabulary, and c
// multiplies the columns of the table and the rows of lora_embedding_B.
//
// The norms are taken a block of rows at a time: the block of W converted to float32 on the
// host, s·B@A added to it by the device's GEMM, the sum brought back and squared in double. No
// whole adapted matrix is ever formed.

#define DORA_BLOCK ((int64_t)1 << 20)  // floats in one block of rows

// The scale of one output feature: m / norm, or 0 for an adapted weight of all zeros (no
// direction to scale; the merge engine keeps such a row zero too).
static float dora_scale(double mag, double sum_sq)
{
    return sum_sq > 0 ? (float)(mag / sqrt(sum_sq)) : 0.0f;
}

// Scratch for one pass: device (rows, cols) and (rows, r) blocks, host (rows, cols) twice.
typedef struct dora_scratch {
    lm_dev *d;
    float *blk, *fac;    // device
    float *w, *sum;      // host: the tensor's rows as float32, and W + s·ΔW
    int64_t rows;        // rows per block
} dora_scratch;

// Safe twice and on a zeroed scratch.
static void dora_scratch_free(dora_scratch *x)
{
    if (x->d) {
        lm_dev_buf_free(x->d, x->blk);
        lm_dev_buf_free(x->d, x->fac);
    }
    free(x->w);
    free(x->sum);
    x->blk = x->fac = x->w = x->sum = NULL;
}

static lm_status dora_scratch_init(dora_scratch *x, lm_dev *d, int64_t n_rows, int64_t cols, int64_t r, lm_err *err)
{
    memset(x, 0, sizeof *x);
    x->d = d;
    x->rows = cols > 0 && DORA_BLOCK / cols > 0 ? DORA_BLOCK / cols : 1;
    x->rows = x->rows < n_rows ? x->rows : n_rows;
    size_t blk = (size_t)(x->rows * cols) * sizeof(float), fac = (size_t)(x->rows * r) * sizeof(float);
    lm_status s = lm_dev_alloc(d, blk, (void **)&x->blk, err);
    if (s == LM_OK)
        s = lm_dev_alloc(d, fac, (void **)&x->fac, err);
    if (s == LM_OK && (!(x->w = malloc(blk + 1)) || !(x->sum = malloc(blk + 1))))
        s = lm_err_set(err, LM_ERR_NOMEM, "out of memory for DoRA scratch (%zu bytes)", 2 * blk);
    if (s != LM_OK)
        dora_scratch_free(x);
    return s;
}

// Rows [r0, r0 + rows) of tensor t ([n, cols]) as float32 into the host buffer dst.
static lm_status read_rows(const lm_st_tensor *t, int64_t r0, int64_t rows, int64_t cols, float *dst, lm_err *err)
{
    size_t esz = lm_dtype_bits(t->dtype) / 8;
    lm_status s = lm_convert_to_f32(dst, (const char *)t->data + (size_t)(r0 * cols) * esz, t->dtype, rows * cols,
                                    err);
    return s == LM_OK ? s : lm_err_prefix(err, "%s", t->name);
}

// One block of the pass: x->w gets rows [r0, r0 + rows) of t, x->sum the same rows of
// t + s·F·op(G), F being host (n, r) (its rows uploaded beside them) and G device memory,
// (r, cols) or, with g_trans, (cols, r).
static lm_status dora_block(dora_scratch *x, const lm_st_tensor *t, int64_t r0, int64_t rows, int64_t cols,
                            const float *fac, const float *g, bool g_trans, int64_t r, float scale, lm_err *err)
{
    lm_dev *d = x->d;
    size_t bytes = (size_t)(rows * cols) * sizeof(float);
    lm_status s = read_rows(t, r0, rows, cols, x->w, err);
    if (s == LM_OK)
        s = lm_dev_upload(d, x->blk, x->w, bytes, err);
    if (s == LM_OK)
        s = lm_dev_upload(d, x->fac, fac + r0 * r, (size_t)(rows * r) * sizeof(float), err);
    if (s == LM_OK)
        s = lm_dev_gemm(d, false, g_trans, rows, cols, r, scale, x->fac, r, g, g_trans ? r : cols, 1.0f, x->blk, cols,
                        err);
    if (s == LM_OK)
        s = lm_dev_download(d, x->sum, x->blk, bytes, err);
    return s == LM_OK ? lm_dev_sync(d, err) : s;
}

// A DoRA linear layer: from W (tensor wt, [out, in]), A (placed, lin->a), B (tensor mod->b,
// [out, r]) and the magnitude, places W and B with every row multiplied by its scale, in one
// pass over W.
static lm_status put_dora_linear(fwd_loader *L, const lm_st_tensor *wt, const lm_lora_module *mod, fwd_linear *lin,
                                 lm_err *err)
{
    lm_fwd *f = L->f;
    int64_t out = lin->out, in = lin->in, r = lin->r;
    float *b = NULL, *mag = NULL, *w = NULL;
    dora_scratch x = {0};
    lm_status s = read_host(mod->b, &b, err);
    if (s == LM_OK)
        s = read_host(mod->magnitude, &mag, err);
    if (s == LM_OK)
        s = weight_alloc(f, out * in, &w, err);
    if (s == LM_OK)
        s = dora_scratch_init(&x, f->dev, out, in, r, err);
    for (int64_t r0 = 0; s == LM_OK && r0 < out; r0 += x.rows) {
        int64_t rows = out - r0 < x.rows ? out - r0 : x.rows;
        if ((s = dora_block(&x, wt, r0, rows, in, b, lin->a, false, r, lin->scale, err)) != LM_OK)
            break;
        for (int64_t i = 0; i < rows; i++) {
            double ss = 0;
            const float *row = x.sum + i * in;
            for (int64_t c = 0; c < in; c++)
                ss += (double)row[c] * row[c];
            float sc = dora_scale(mag[r0 + i], ss);
            for (int64_t c = 0; c < in; c++)
                x.w[i * in + c] *= sc;
            for (int64_t j = 0; j < r; j++)
                b[(r0 + i) * r + j] *= sc;
        }
        s = lm_dev_upload(f->dev, w + r0 * in, x.w, (size_t)(rows * in) * sizeof(float), err);
    }
    dora_scratch_free(&x);
    if (s == LM_OK) {
        lin->w = w;
        s = put_host(f, b, out * r, &lin->bm, err);
    }
    free(b);
    free(mag);
    return s == LM_OK ? s : lm_err_prefix(err, "DoRA module %s", mod->path);
}

// A DoRA embedding: the table E ([vocab, hidden]) placed with every column multiplied by its
// scale (a first pass over E for the norms, a second to place it), and lora_embedding_B (host
// `b`, [hidden, r]) scaled by rows in place. at (host, [vocab, r]) is lora_embedding_A
// transposed, eb the unscaled B on the device.
static lm_status put_dora_embedding(fwd_loader *L, const lm_st_tensor *et, const lm_lora_module *mod,
                                    const float *at, const float *eb, float *b, const float **out_table,
                                    lm_err *err)
{
    lm_fwd *f = L->f;
    int64_t vocab = f->vocab, hidden = f->hidden, r = f->emb_r;
    float *mag = NULL, *w = NULL, *scale = malloc((size_t)hidden * sizeof *scale + 1);
    double *ss = calloc((size_t)hidden + 1, sizeof *ss);
    dora_scratch x = {0};
    lm_status s = scale && ss ? read_host(mod->magnitude, &mag, err) : lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    if (s == LM_OK)
        s = dora_scratch_init(&x, f->dev, vocab, hidden, r, err);
    for (int64_t r0 = 0; s == LM_OK && r0 < vocab; r0 += x.rows) {
        int64_t rows = vocab - r0 < x.rows ? vocab - r0 : x.rows;
        if ((s = dora_block(&x, et, r0, rows, hidden, at, eb, true, r, f->emb_scale, err)) != LM_OK)
            break;
        for (int64_t i = 0; i < rows; i++)
            for (int64_t c = 0; c < hidden; c++)
                ss[c] += (double)x.sum[i * hidden + c] * x.sum[i * hidden + c];
    }
    if (s == LM_OK) {
        for (int64_t c = 0; c < hidden; c++)
            scale[c] = dora_scale(mag[c], ss[c]);
        for (int64_t c = 0; c < hidden; c++)
            for (int64_t j = 0; j < r; j++)
                b[c * r + j] *= scale[c];
        s = weight_alloc(f, vocab * hidden, &w, err);
    }
    for (int64_t r0 = 0; s == LM_OK && r0 < vocab; r0 += x.rows) {
        int64_t rows = vocab - r0 < x.rows ? vocab - r0 : x.rows;
        if ((s = read_rows(et, r0, rows, hidden, x.w, err)) != LM_OK)
            break;
        for (int64_t i = 0; i < rows; i++)
            for (int64_t c = 0; c < hidden; c++)
                x.w[i * hidden + c] *= scale[c];
        s = lm_dev_upload(f->dev, w + r0 * hidden, x.w, (size_t)(rows * hidden) * sizeof(float), err);
    }
    dora_scratch_free(&x);
    *out_table = w;
    free(mag);
    free(scale);
    free(ss);
    return s == LM_OK ? s : lm_err_prefix(err, "DoRA module %s", mod->path);
}

// What a linear layer is made of: the tensors put_linear places and plan_linear sizes, found
// once by linear_parts.
typedef struct linear_parts {
    int64_t out, in;                 // the weight's shape
    const lm_st_tensor *w;           // the weight (the adapter's saved one where it has one); with
                                     // DoRA the one placed scaled
    const lm_lora_module *mod;       // the adapter's LoRA module on it, or NULL
    const lm_st_tensor *bias;        // the bias placed as it is, or NULL
    const lm_lora_module *bias_mod;  // a LoRA bias added to base_bias before it is placed, or NULL
    const lm_st_tensor *base_bias;   // the model's bias under bias_mod
} linear_parts;

// Finds the parts of the linear layer in (layer, slot) and marks the adapter's modules it
// uses. Errors: the architecture has no weight there, an embedding LoRA on it, a tensor missing.
static lm_status linear_parts_of(fwd_loader *L, const lm_arch_desc *desc, int layer, lm_arch_slot slot,
                                 linear_parts *lp, lm_err *err)
{
    memset(lp, 0, sizeof *lp);
    const lm_arch_tensor *wt = lm_arch_get(desc, layer, slot, false);
    const lm_arch_tensor *bt = lm_arch_get(desc, layer, slot, true);
    if (!wt)
        return lm_err_set(err, LM_ERR_UNSUPPORTED, "the architecture has no weight for slot %d of layer %d",
                          (int)slot, layer);
    lp->out = wt->shape[0];
    lp->in = wt->shape[1];
    int64_t mi = -1;
    bool lora = L->a && lm_adapter_lookup(L->a, wt->name, &mi) == LM_TOUCH_LORA;
    lm_status s = arch_tensor(L, desc, layer, slot, false, true, &lp->w, err);
    if (s != LM_OK)
        return s;
    if (lora) {
        lp->mod = &L->a->modules[mi];
        if (lp->mod->kind != LM_LORA_LINEAR)
            return lm_err_set(err, LM_ERR_UNSUPPORTED, "%s: module %s is an embedding LoRA on a linear layer",
                              L->a->dir, lp->mod->path);
        L->used_module[mi] = true;
    }
    // The bias: the model's (or a saved replacement), plus scale·lora_B.bias (PEFT adds the
    // lora_B layer's bias inside the scaled LoRA branch).
    int64_t bi = -1;
    if (!(bt && L->a && lm_adapter_lookup(L->a, bt->name, &bi) == LM_TOUCH_BIAS))
        return bt ? arch_tensor(L, desc, layer, slot, true, true, &lp->bias, err) : LM_OK;
    lp->bias_mod = &L->a->modules[bi];
    L->used_module[bi] = true;
    if (!(lp->base_bias = source(L, bt->name, false)))
        return lm_err_set(err, LM_ERR_NOT_FOUND, "%s: tensor %s is missing", L->m->dir, bt->name);
    return LM_OK;
}

// Fills a linear layer: weight, bias, and the adapter's LoRA factors and bias delta, with a
// DoRA module's scale folded into the weight and B.
static lm_status put_linear(fwd_loader *L, const lm_arch_desc *desc, int layer, lm_arch_slot slot,
                            fwd_linear *lin, lm_err *err)
{
    lm_fwd *f = L->f;
    linear_parts lp;
    lm_status s = linear_parts_of(L, desc, layer, slot, &lp, err);
    if (s != LM_OK)
        return s;
    lin->out = lp.out;
    lin->in = lp.in;
    const lm_lora_module *mod = lp.mod;
    if (!(mod && mod->magnitude) && (s = put_tensor(f, lp.w, &lin->w, err)) != LM_OK)
        return s;

    if (mod) {
        lin->r = mod->r;
        lin->scale = (float)mod->scale;
        if ((s = put_tensor(f, mod->a, &lin->a, err)) != LM_OK)
            return s;
        if (mod->magnitude) {
            // W and B placed scaled: W is not placed as it is
            if ((s = put_dora_linear(L, lp.w, mod, lin, err)) != LM_OK)
                return s;
        } else if ((s = put_tensor(f, mod->b, &lin->bm, err)) != LM_OK) {
            return s;
        }
        if (lin->r > f->max_r)
            f->max_r = lin->r;
    }

    if (!lp.bias_mod)
        return lp.bias ? put_tensor(f, lp.bias, &lin->b, err) : LM_OK;
    float *b = NULL, *db = NULL;
    if ((s = read_host(lp.base_bias, &b, err)) == LM_OK && (s = read_host(lp.bias_mod->bias, &db, err)) == LM_OK) {
        float sc = (float)lp.bias_mod->scale;
        for (int64_t i = 0; i < lp.base_bias->numel; i++)
            b[i] += sc * db[i];
        s = placing(put_host(f, b, lp.base_bias->numel, &lin->b, err), lp.base_bias->name, err);
    }
    free(b);
    free(db);
    return s;
}

// The embedding, with its LoRA (lora_embedding_A transposed so that a token's row of it is a
// row gather) when the adapter has one, and its DoRA scale folded into the table and B.
static lm_status put_embedding(fwd_loader *L, const lm_arch_desc *desc, lm_err *err)
{
    lm_fwd *f = L->f;
    const lm_arch_tensor *et = lm_arch_get(desc, -1, LM_SLOT_EMBED, false);
    int64_t mi;
    if (!L->a || lm_adapter_lookup(L->a, et->name, &mi) != LM_TOUCH_LORA)
        return put_arch(L, desc, -1, LM_SLOT_EMBED, false, true, &f->embed, err);
    const lm_lora_module *mod = &L->a->modules[mi];
    if (mod->kind != LM_LORA_EMBEDDING)
        return lm_err_set(err, LM_ERR_UNSUPPORTED, "%s: module %s is a linear LoRA on the embedding", L->a->dir,
                          mod->path);
    L->used_module[mi] = true;
    f->emb_r = mod->r;
    f->emb_scale = (float)mod->scale;
    if (f->emb_r > f->max_r)
        f->max_r = f->emb_r;
    float *a = NULL, *at = NULL, *b = NULL, *eb = NULL;
    int64_t r = mod->r, v = mod->a->shape[1], hidden = mod->b->shape[0];  // A is (r, vocab), B (hidden, r)
    lm_status s = LM_OK;
    if (!mod->magnitude)
        s = put_arch(L, desc, -1, LM_SLOT_EMBED, false, true, &f->embed, err);
    if (s == LM_OK && (s = read_host(mod->a, &a, err)) == LM_OK) {
        if (!(at = malloc((size_t)(r * v) * sizeof *at + 1))) {
            s = lm_err_set(err, LM_ERR_NOMEM, "out of memory");
        } else {
            for (int64_t j = 0; j < r; j++)
                for (int64_t t = 0; t < v; t++)
                    at[t * r + j] = a[j * v + t];
            s = placing(put_host(f, at, r * v, &f->emb_at, err), mod->a->name, err);
        }
    }
    if (s == LM_OK && !mod->magnitude)
        s = put_tensor(f, mod->b, &f->emb_b, err);
    if (s == LM_OK && mod->magnitude) {
        // B unscaled on the device for the norms (scratch), then scaled in place for good
        size_t bytes = (size_t)(hidden * r) * sizeof(float);
        const lm_st_tensor *t = source(L, et->name, true);
        if (!t)
            s = lm_err_set(err, LM_ERR_NOT_FOUND, "%s: tensor %s is missing", L->m->dir, et->name);
        if (s == LM_OK && (s = read_host(mod->b, &b, err)) == LM_OK &&
            (s = lm_dev_alloc(f->dev, bytes, (void **)&eb, err)) == LM_OK &&
            (s = lm_dev_upload(f->dev, eb, b, bytes, err)) == LM_OK &&
            (s = put_dora_embedding(L, t, mod, at, eb, b, &f->embed, err)) == LM_OK)
            s = put_host(f, b, hidden * r, &f->emb_b, err);
        f->embed_scaled = true;
    }
    lm_dev_buf_free(f->dev, eb);
    free(a);
    free(at);
    free(b);
    return s;
}

static lm_status put_rope(lm_fwd *f, const lm_config *cfg, lm_err *err)
{
    int64_t half = f->head_dim / 2;
    double *dv = malloc((size_t)half * sizeof *dv + 1);
    float *fv = malloc((size_t)half * sizeof *fv + 1);
    lm_status s;
    if (!dv || !fv)
        s = lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    else if ((s = lm_config_rope_inv_freq(cfg, dv, err)) == LM_OK) {
        for (int64_t i = 0; i < half; i++)
            fv[i] = (float)dv[i];  // Hugging Face keeps inv_freq in float32
        s = put_host(f, fv, half, &f->inv_freq, err);
        if (s != LM_OK && s != LM_ERR_DEVICE_OOM)
            lm_err_prefix(err, "the rotary frequencies (inv_freq)");
    }
    free(dv);
    free(fv);
    return s;
}

// Refuses what the forward pass cannot apply: DoRA with fan_in_fan_out, and adapter entries it
// did not consume.
static lm_status check_adapter(const lm_adapter *a, const bool *used_module, const bool *used_saved,
                               bool before, lm_err *err)
{
    for (int64_t i = 0; i < a->n_modules; i++) {
        const lm_lora_module *m = &a->modules[i];
        // With fan_in_fan_out the norm would run along the other axis of the stored weight; the
        // architectures the forward pass runs never store their layers that way.
        if (before && m->magnitude && a->config.fan_in_fan_out)
            return lm_err_set(err, LM_ERR_UNSUPPORTED, "%s: DoRA with fan_in_fan_out (module %s) is not supported "
                              "by the forward pass", a->dir, m->path);
        if (!before && !used_module[i])
            return lm_err_set(err, LM_ERR_UNSUPPORTED, "%s: module %s changes %s, which the forward pass does not "
                              "use", a->dir, m->path, m->base_name);
    }
    for (int64_t i = 0; !before && i < a->n_saved; i++)
        if (!used_saved[i])
            return lm_err_set(err, LM_ERR_UNSUPPORTED, "%s: modules_to_save replaces %s, which the forward pass "
                              "does not use", a->dir, a->saved[i].base_name);
    return LM_OK;
}

lm_status lm_fwd_check(const lm_model *m, const lm_adapter *a, lm_err *err)
{
    const lm_config *cfg = &m->config;
    lm_status s = lm_model_check(m, NULL, err);
    if (s != LM_OK)
        return lm_err_prefix(err, "%s", m->dir);
    if (cfg->vocab_size > INT32_MAX || cfg->head_dim % 2 != 0)
        return lm_err_set(err, LM_ERR_UNSUPPORTED, "%s: vocab_size %" PRId64 " or head_dim %" PRId64 " is beyond "
                          "what the forward pass takes", cfg->path, cfg->vocab_size, cfg->head_dim);
    if (cfg->arch == LM_ARCH_QWEN2 && cfg->use_sliding_window && cfg->sliding_window > 0)
        return lm_err_set(err, LM_ERR_UNSUPPORTED, "%s: use_sliding_window (Qwen2's sliding window from layer "
                          "max_window_layers on) is not supported by the forward pass", cfg->path);
    if ((s = lm_config_rope_check(cfg, err)) != LM_OK)
        return s;
    if (a && (s = check_adapter(a, NULL, NULL, true, err)) == LM_OK)
        s = lm_adapter_validate(a, m, err);
    return s;
}

lm_status lm_fwd_create(lm_fwd **out, const lm_model *m, const lm_adapter *a, lm_dev *d, lm_err *err)
{
    *out = NULL;
    const lm_config *cfg = &m->config;
    lm_arch_desc desc = {0};
    fwd_loader L = {0};
    lm_status s = lm_dev_require(d, LM_OP_FORWARD, err);
    if (s != LM_OK || (s = lm_fwd_check(m, a, err)) != LM_OK)
        return s;
    if ((s = lm_arch_describe(&desc, cfg, err)) != LM_OK)
        return s;

    lm_fwd *f = calloc(1, sizeof *f);
    L.f = f;
    L.m = m;
    L.a = a;
    if (!f || (a && (!(L.used_module = calloc((size_t)a->n_modules + 1, 1)) ||
                     !(L.used_saved = calloc((size_t)a->n_saved + 1, 1))))) {
        s = lm_err_set(err, LM_ERR_NOMEM, "out of memory");
        goto fail;
    }
    f->dev = d;
    f->hidden = cfg->hidden_size;
    f->inter = cfg->intermediate_size;
    f->n_layers = cfg->num_hidden_layers;
    f->heads = cfg->num_attention_heads;
    f->kv_heads = cfg->num_key_value_heads;
    f->head_dim = cfg->head_dim;
    f->vocab = cfg->vocab_size;
    f->eps = (float)cfg->rms_norm_eps;
    f->attn_scale = (float)(1.0 / sqrt((double)cfg->head_dim));
    // MistralAttention masks keys sliding_window or more positions back whenever it is set
    f->window = cfg->arch == LM_ARCH_MISTRAL ? cfg->sliding_window : 0;
    if (!(f->layers = calloc((size_t)f->n_layers, sizeof *f->layers))) {
        s = lm_err_set(err, LM_ERR_NOMEM, "out of memory");
        goto fail;
    }

    if ((s = put_embedding(&L, &desc, err)) != LM_OK)
        goto fail;
    static const lm_arch_slot slots[7] = {LM_SLOT_Q, LM_SLOT_K, LM_SLOT_V, LM_SLOT_O,
                                          LM_SLOT_GATE, LM_SLOT_UP, LM_SLOT_DOWN};
    for (int l = 0; l < f->n_layers; l++) {
        fwd_layer *y = &f->layers[l];
        fwd_linear *lins[7] = {&y->q, &y->k, &y->v, &y->o, &y->gate, &y->up, &y->down};
        for (int k = 0; k < 7; k++)
            if ((s = put_linear(&L, &desc, l, slots[k], lins[k], err)) != LM_OK)
                goto fail;
        if ((s = put_arch(&L, &desc, l, LM_SLOT_INPUT_NORM, false, true, &y->in_norm, err)) != LM_OK ||
            (s = put_arch(&L, &desc, l, LM_SLOT_POST_NORM, false, true, &y->post_norm, err)) != LM_OK)
            goto fail;
    }
    if ((s = put_arch(&L, &desc, -1, LM_SLOT_FINAL_NORM, false, true, &f->final_norm, err)) != LM_OK)
        goto fail;
    if (lm_arch_get(&desc, -1, LM_SLOT_LM_HEAD, false)) {
        if ((s = put_linear(&L, &desc, -1, LM_SLOT_LM_HEAD, &f->head, err)) != LM_OK)
            goto fail;
    } else {
        // Tied: lm_head is the embedding matrix; the base's even when modules_to_save
        // replaced the embedding (PEFT copies the module it saves, the tie stays on the original)
        // or a DoRA scale was folded into the table (the adapter wraps the embedding module
        // only; lm_head reads the shared weight as it is).
        f->head = (fwd_linear){.w = f->embed, .out = f->vocab, .in = f->hidden};
        const lm_arch_tensor *et = lm_arch_get(&desc, -1, LM_SLOT_EMBED, false);
        if (((a && lm_adapter_lookup(a, et->name, NULL) == LM_TOUCH_SAVED) || f->embed_scaled) &&
            (s = put_arch(&L, &desc, -1, LM_SLOT_EMBED, false, false, &f->head.w, err)) != LM_OK)
            goto fail;
    }
    if ((s = put_rope(f, cfg, err)) != LM_OK)
        goto fail;
    if (a && (s = check_adapter(a, L.used_module, L.used_saved, false, err)) != LM_OK)
        goto fail;

    free(L.used_module);
    free(L.used_saved);
    lm_arch_desc_free(&desc);
    *out = f;
    return LM_OK;

fail:
    free(L.used_module);
    free(L.used_saved);
    lm_arch_desc_free(&desc);
    lm_fwd_free(f);
    return s;
}

// ==== one batch ===============================================================================

static int64_t logit_rows(const lm_fwd *f, int64_t tokens)
{
    int64_t rows = LOGIT_FLOATS / (f->vocab > 0 ? f->vocab : 1);
    if (rows < 1)
        rows = 1;
    return rows < tokens ? rows : tokens;
}

// Lays the arena out for `tokens` tokens from `base` (NULL: only the size). Returns the bytes,
// or SIZE_MAX when they overflow.
static size_t arena_layout(const lm_fwd *f, int64_t tokens, char *base, fwd_arena *a)
{
    int64_t T = tokens, q = f->heads * f->head_dim, kv = f->kv_heads * f->head_dim;
    // (rows, cols) of 4-byte elements per region, in the order of fwd_arena
    const int64_t dims[][2] = {
        {T, f->hidden}, {T, f->hidden}, {T, q}, {T, kv}, {T, kv}, {T, q}, {T, f->inter}, {T, f->inter},
        {T, f->max_r}, {logit_rows(f, T), f->vocab}, {T, 1}, {4 * T, 1},
    };
    enum { N_REGIONS = sizeof dims / sizeof dims[0] };
    uint64_t off[N_REGIONS + 1] = {0};
    for (int i = 0; i < N_REGIONS; i++) {
        uint64_t n;
        if (dims[i][0] < 0 || dims[i][1] < 0 || !lm_mul_u64((uint64_t)dims[i][0], (uint64_t)dims[i][1], &n) ||
            !lm_mul_u64(n, 4, &n) || !lm_add_u64(n, ALIGN - 1, &n))
            return SIZE_MAX;
        n &= ~(uint64_t)(ALIGN - 1);
        if (!lm_add_u64(off[i], n, &off[i + 1]) || off[i + 1] >= SIZE_MAX)
            return SIZE_MAX;
    }
    if (base) {
        a->h = (float *)(void *)(base + off[0]);
        a->xn = (float *)(void *)(base + off[1]);
        a->q = (float *)(void *)(base + off[2]);
        a->k = (float *)(void *)(base + off[3]);
        a->v = (float *)(void *)(base + off[4]);
        a->att = (float *)(void *)(base + off[5]);
        a->gate = (float *)(void *)(base + off[6]);
        a->up = (float *)(void *)(base + off[7]);
        a->lora = (float *)(void *)(base + off[8]);
        a->logits = (float *)(void *)(base + off[9]);
        a->nll = (float *)(void *)(base + off[10]);
        a->ints = (int32_t *)(void *)(base + off[11]);
    }
    return (size_t)off[N_REGIONS];
}

size_t lm_fwd_arena_bytes(const lm_fwd *f, int64_t n_tokens)
{
    fwd_arena a;
    return arena_layout(f, n_tokens, NULL, &a);
}

// Makes the arena hold `tokens` tokens; on failure it is released.
static lm_status arena_reserve(lm_fwd *f, int64_t tokens, lm_err *err)
{
    if (f->arena && tokens <= f->arena_tokens)
        return LM_OK;
    lm_dev_buf_free(f->dev, f->arena);
    f->arena = NULL;
    f->arena_tokens = 0;
    free(f->host_ints);
    f->host_ints = NULL;
    size_t bytes = lm_fwd_arena_bytes(f, tokens);
    if (bytes == SIZE_MAX)
        return lm_err_set(err, LM_ERR_UNSUPPORTED, "a batch of %" PRId64 " tokens is too large", tokens);
    if (!(f->host_ints = malloc((size_t)tokens * 4 * sizeof(int32_t))))
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory for a batch of %" PRId64 " tokens", tokens);
    lm_status s = lm_dev_alloc(f->dev, bytes, &f->arena, err);
    if (s != LM_OK) {
        free(f->host_ints);
        f->host_ints = NULL;
        return lm_err_prefix(err, "activations of a batch of %" PRId64 " tokens", tokens);
    }
    f->arena_tokens = tokens;
    return LM_OK;
}

// y = x Wᵀ + beta·y + b + scale·(x Aᵀ) Bᵀ for `rows` rows; tmp holds (rows, r).
static lm_status linear(lm_fwd *f, float *y, const float *x, int64_t rows, const fwd_linear *L, float beta,
                        float *tmp, lm_err *err)
{
    lm_dev *d = f->dev;
    lm_status s = lm_dev_gemm(d, false, true, rows, L->out, L->in, 1.0f, x, L->in, L->w, L->in, beta, y, L->out, err);
    if (s == LM_OK && L->b)
        s = lm_dev_add_rows(d, y, L->b, rows, L->out, err);
    if (s == LM_OK && L->a) {
        s = lm_dev_gemm(d, false, true, rows, L->r, L->in, 1.0f, x, L->in, L->a, L->in, 0.0f, tmp, L->r, err);
        if (s == LM_OK)
            s = lm_dev_gemm(d, false, true, rows, L->out, L->r, L->scale, tmp, L->r, L->bm, L->r, 1.0f, y, L->out,
                            err);
    }
    return s;
}

static lm_status hook(const lm_fwd_req *req, lm_fwd *f, int layer, lm_fwd_point p, const float *x, int64_t rows,
                      int64_t cols, lm_err *err)
{
    return req->hook ? req->hook(req->hook_ctx, f->dev, layer, p, x, rows, cols, err) : LM_OK;
}

// One layer on the T rows of the arena.
static lm_status run_layer(lm_fwd *f, const fwd_arena *a, int64_t T, int l, const lm_fwd_req *req, lm_err *err)
{
    lm_dev *d = f->dev;
    const fwd_layer *y = &f->layers[l];
    const int32_t *pos = a->ints + T, *start = a->ints + 2 * T;
    lm_status s;
#define DO(call)                                                                              \
    do {                                                                                      \
        if ((s = (call)) != LM_OK)                                                            \
            return s;                                                                         \
    } while (0)
    DO(lm_dev_rmsnorm(d, a->xn, a->h, y->in_norm, T, f->hidden, f->eps, err));
    DO(hook(req, f, l, LM_FWD_ATTN_IN, a->xn, T, f->hidden, err));
    DO(linear(f, a->q, a->xn, T, &y->q, 0.0f, a->lora, err));
    DO(linear(f, a->k, a->xn, T, &y->k, 0.0f, a->lora, err));
    DO(linear(f, a->v, a->xn, T, &y->v, 0.0f, a->lora, err));
    DO(lm_dev_rope(d, a->q, T, f->heads, f->head_dim, pos, f->inv_freq, err));
    DO(lm_dev_rope(d, a->k, T, f->kv_heads, f->head_dim, pos, f->inv_freq, err));
    DO(lm_dev_attention(d, a->att, a->q, a->k, a->v, start, T, f->heads, f->kv_heads, f->head_dim, f->attn_scale,
                        err));
    DO(hook(req, f, l, LM_FWD_O_IN, a->att, T, f->heads * f->head_dim, err));
    DO(linear(f, a->h, a->att, T, &y->o, 1.0f, a->lora, err));
    DO(lm_dev_rmsnorm(d, a->xn, a->h, y->post_norm, T, f->hidden, f->eps, err));
    DO(hook(req, f, l, LM_FWD_MLP_IN, a->xn, T, f->hidden, err));
    DO(linear(f, a->gate, a->xn, T, &y->gate, 0.0f, a->lora, err));
    DO(linear(f, a->up, a->xn, T, &y->up, 0.0f, a->lora, err));
    DO(lm_dev_silu_mul(d, a->gate, a->up, T * f->inter, err));
    DO(hook(req, f, l, LM_FWD_DOWN_IN, a->gate, T, f->inter, err));
    DO(linear(f, a->h, a->gate, T, &y->down, 1.0f, a->lora, err));
#undef DO
    return LM_OK;
}

// The batch's ids, positions, sequence starts and targets, staged in f->host_ints.
static lm_status stage_ints(lm_fwd *f, const lm_fwd_seq *seqs, int64_t n_seqs, int64_t T, lm_err *err)
{
    int32_t *ids = f->host_ints, *pos = ids + T, *start = ids + 2 * T, *tgt = ids + 3 * T;
    int64_t row = 0;
    for (int64_t i = 0; i < n_seqs; i++) {
        const lm_fwd_seq *q = &seqs[i];
        for (int64_t p = 0; p < q->len; p++, row++) {
            int32_t id = q->ids[p];
            if (id < 0 || id >= f->vocab)
                return lm_err_set(err, LM_ERR_FORMAT, "sequence %" PRId64 ", position %" PRId64 ": token id %" PRId32
                                  " is outside the vocabulary (vocab_size %" PRId64 ")", i + 1, p, id, f->vocab);
            ids[row] = id;
            pos[row] = (int32_t)p;
            // the first key row: the sequence's start, or the window's when that is later
            start[row] = (int32_t)(f->window > 0 && p >= f->window ? row - f->window + 1 : row - p);
            tgt[row] = p + 1 < q->len ? q->ids[p + 1] : -1;
        }
    }
    return LM_OK;
}

lm_status lm_fwd_run(lm_fwd *f, const lm_fwd_seq *seqs, int64_t n_seqs, const lm_fwd_req *req, lm_err *err)
{
    int64_t T = 0;
    for (int64_t i = 0; i < n_seqs; i++) {
        if (seqs[i].len < 1 || seqs[i].len > INT32_MAX - T)
            return lm_err_set(err, LM_ERR_USAGE, "sequence %" PRId64 " has %" PRId64 " tokens (at least 1, and a "
                              "batch below 2^31)", i + 1, seqs[i].len);
        T += seqs[i].len;
    }
    if (T == 0)
        return LM_OK;
    lm_dev *d = f->dev;
    lm_status s = arena_reserve(f, T, err);
    if (s != LM_OK)
        return s;
    fwd_arena a;
    arena_layout(f, T, f->arena, &a);
    if ((s = stage_ints(f, seqs, n_seqs, T, err)) != LM_OK ||
        (s = lm_dev_upload(d, a.ints, f->host_ints, (size_t)T * 4 * sizeof(int32_t), err)) != LM_OK)
        return s;

    // embeddings, with the embedding LoRA's s·Aᵀ[ids] Bᵀ
    if ((s = lm_dev_gather_rows(d, a.h, f->embed, f->vocab, f->hidden, a.ints, T, err)) != LM_OK)
        return s;
    if (f->emb_at &&
        ((s = lm_dev_gather_rows(d, a.lora, f->emb_at, f->vocab, f->emb_r, a.ints, T, err)) != LM_OK ||
         (s = lm_dev_gemm(d, false, true, T, f->hidden, f->emb_r, f->emb_scale, a.lora, f->emb_r, f->emb_b,
                          f->emb_r, 1.0f, a.h, f->hidden, err)) != LM_OK))
        return s;
    for (int l = 0; l < f->n_layers; l++)
        if ((s = run_layer(f, &a, T, l, req, err)) != LM_OK)
            return lm_err_prefix(err, "layer %d", l);
    if (!req->logits && !req->nll)
        return LM_OK;

    // the head, a chunk of rows at a time
    if ((s = lm_dev_rmsnorm(d, a.xn, a.h, f->final_norm, T, f->hidden, f->eps, err)) != LM_OK)
        return s;
    int64_t chunk = logit_rows(f, T);
    for (int64_t r0 = 0; r0 < T; r0 += chunk) {
        int64_t rows = T - r0 < chunk ? T - r0 : chunk;
        if ((s = linear(f, a.logits, a.xn + r0 * f->hidden, rows, &f->head, 0.0f, a.lora, err)) != LM_OK)
            return s;
        if (req->logits && (s = lm_dev_download(d, req->logits + r0 * f->vocab, a.logits,
                                                (size_t)(rows * f->vocab) * sizeof(float), err)) != LM_OK)
            return s;
        if (req->nll && (s = lm_dev_nll_rows(d, a.nll + r0, a.logits, a.ints + 3 * T + r0, rows, f->vocab, err)) != LM_OK)
            return s;
    }
    if (req->nll && (s = lm_dev_download(d, req->nll, a.nll, (size_t)T * sizeof(float), err)) != LM_OK)
        return s;
    return lm_dev_sync(d, err);
}

// ==== the runner ==============================================================================

static void say(lm_fwd_runner *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void say(lm_fwd_runner *r, const char *fmt, ...)
{
    if (!r->note)
        return;
    char line[LM_ERR_MSG_MAX + 256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    r->note(r->note_ctx, line, NULL);
}

// The model on the CPU, placed when first needed.
static lm_status cpu_fwd(lm_fwd_runner *r, lm_fwd **out, lm_err *err)
{
    lm_status s;
    if (!r->on_cpu) {
        if (!r->cpu && (s = lm_dev_cpu_companion(r->dev, &r->cpu, err)) != LM_OK)
            return s;
        if ((s = lm_fwd_create(&r->on_cpu, r->model, r->adapter, r->cpu, err)) != LM_OK)
            return s;
    }
    *out = r->on_cpu;
    return LM_OK;
}

// Puts "placing the weights of MODEL [with adapter DIR] on DEVICE: " before the message in err (as
// a merge names the tensor it was merging) and returns its status. The directories are the ones
// opened: the runner's label may name an adapter alone (sparsegpt's FTs).
static lm_status placing_weights(const lm_fwd_runner *r, lm_dev *dev, lm_err *err)
{
    return lm_err_prefix(err, "placing the weights of %s%s%s on %s", r->model->dir, r->adapter ? " with adapter " : "",
                         r->adapter ? r->adapter->dir : "", dev ? lm_dev_name(dev) : "cpu");
}

lm_status lm_fwd_runner_init(lm_fwd_runner *r, const lm_model *m, const lm_adapter *a, lm_dev *dev,
                             const char *phase, const char *label, int64_t max_tokens, lm_fallback_fn note,
                             void *note_ctx, lm_err *err)
{
    memset(r, 0, sizeof *r);
    r->model = m;
    r->adapter = a;
    r->dev = dev;
    r->phase = phase;
    r->label = label;
    r->max_tokens = max_tokens > 0 ? max_tokens : DEFAULT_MAX_TOKENS;
    r->note = note;
    r->note_ctx = note_ctx;
    lm_err why = {0};
    lm_status s = lm_dev_require(dev, LM_OP_FORWARD, &why);
    if (s == LM_OK) {
        s = lm_fwd_create(&r->on_dev, m, a, dev, &why);
        if (s != LM_OK && s != LM_ERR_DEVICE_OOM) {
            *err = why;
            return placing_weights(r, dev, err);
        }
    }
    if (s == LM_OK) {
        r->weights_host_converted = lm_fwd_host_converted(r->on_dev);
        return LM_OK;
    }
    // the weights do not fit, or the device cannot run the forward pass: the model runs on the CPU
    double t0 = lm_now();
    r->weights_fell_back = true;
    char unit[512];
    snprintf(unit, sizeof unit, "weights of %s", label);
    lm_fallback_say(r->note, r->note_ctx, &(lm_fallback){phase, unit, lm_dev_name(dev), "cpu", why.msg});
    lm_fwd *f;
    s = cpu_fwd(r, &f, err);
    r->fallback_s += lm_now() - t0;
    if (s != LM_OK) {
        placing_weights(r, r->cpu, err);
        lm_fwd_runner_free(r);
    }
    return s;
}

void lm_fwd_runner_free(lm_fwd_runner *r)
{
    lm_fwd_free(r->on_dev);
    lm_fwd_free(r->on_cpu);
    r->on_dev = r->on_cpu = NULL;
    r->cpu = NULL;
}

// The requested host arrays, moved on by `rows` rows.
static lm_fwd_req req_at(const lm_fwd_req *req, int64_t rows, int64_t vocab)
{
    lm_fwd_req q = *req;
    if (q.logits)
        q.logits += rows * vocab;
    if (q.nll)
        q.nll += rows;
    return q;
}

static int64_t tokens_of(const lm_fwd_seq *seqs, int64_t n)
{
    int64_t t = 0;
    for (int64_t i = 0; i < n; i++)
        t += seqs[i].len;
    return t;
}

// Puts "PHASE sequences A-B on DEVICE: " (or "sequence A") before the message in err.
static lm_status unit_error(const lm_fwd_runner *r, int64_t first, int64_t n, const char *dev, lm_err *err)
{
    if (n == 1)
        return lm_err_prefix(err, "%s sequence %" PRId64 " on %s", r->phase, first + 1, dev);
    return lm_err_prefix(err, "%s sequences %" PRId64 "-%" PRId64 " on %s", r->phase, first + 1, first + n, dev);
}

// A batch of sequences seqs[0..n) (numbered from first + 1 in messages), a unit of
// lm_fallback_run when it holds one sequence.
typedef struct batch {
    lm_fwd_runner *r;
    const lm_fwd_seq *seqs;
    int64_t n, first;
    const lm_fwd_req *req;
} batch;

// The batch's work on dev: the runner's device, or the CPU (any other dev: the runner's own CPU
// device, opened when first needed). Errors other than running out of device memory get
// unit_error's prefix.
static lm_status batch_work(void *ctx, lm_dev *dev, lm_err *err)
{
    batch *b = ctx;
    lm_fwd_runner *r = b->r;
    lm_fwd *f = r->on_dev;
    lm_status s;
    bool on_cpu = !r->on_dev || r->stuck || dev != r->dev;
    if (on_cpu) {
        // a sequence that fell back from the device, with --sticky-fallback: the later ones follow
        if (r->on_dev && !r->stuck && r->sticky) {
            r->stuck = true;
            say(r, "fallback: %s: every later sequence runs on cpu too (--sticky-fallback)", r->phase);
        }
        if ((s = cpu_fwd(r, &f, err)) != LM_OK)
            return s;
    }
    s = lm_fwd_run(f, b->seqs, b->n, b->req, err);
    if (s == LM_OK || (s == LM_ERR_DEVICE_OOM && !on_cpu))
        return s;
    return unit_error(r, b->first, b->n, on_cpu ? "cpu" : lm_dev_name(r->dev), err);
}

// Counts a batch that ran to the end, on the device or on the CPU.
static void batch_done(lm_fwd_runner *r, const batch *b, bool on_device, int64_t *done)
{
    int64_t T = tokens_of(b->seqs, b->n);
    r->n_batches++;
    *(on_device ? &r->tokens_dev : &r->tokens_cpu) += T;
    *done += b->n;
    if (r->progress)
        r->progress(r->progress_ctx, *done);
}

// Runs seqs[0..n) (numbered from first + 1 in messages) on the device, halving on out of memory
// and sending a single sequence that does not fit to the CPU (lm_fallback_run).
static lm_status run_batch(lm_fwd_runner *r, const lm_fwd_seq *seqs, int64_t n, int64_t first, const lm_fwd_req *req,
                           int64_t *done, lm_err *err)
{
    batch b = {r, seqs, n, first, req};
    lm_status s;
    if (!r->on_dev || r->stuck) {
        double t0 = lm_now();
        if ((s = batch_work(&b, NULL, err)) != LM_OK)
            return s;
        if (r->stuck)  // the device was given up on: the time is the fallback's
            r->fallback_s += lm_now() - t0;
        batch_done(r, &b, false, done);
        return LM_OK;
    }
    if (n == 1) {
        char unit[96];
        snprintf(unit, sizeof unit, "sequence %" PRId64 " (%" PRId64 " tokens)", first + 1, seqs[0].len);
        lm_fallback_unit u = {.phase = r->phase, .unit = unit, .work = batch_work, .ctx = &b, .say = r->note,
                              .say_ctx = r->note_ctx};
        s = lm_fallback_run(&u, r->dev, r->cpu, err);
        r->n_seq_cpu += u.fell_back;
        r->fallback_s += u.seconds;
        if (s == LM_OK)
            batch_done(r, &b, !u.fell_back, done);
        return s;
    }
    double t0 = lm_now();
    s = batch_work(&b, r->dev, err);
    if (s == LM_OK) {
        batch_done(r, &b, true, done);
        return LM_OK;
    }
    r->fallback_s += lm_now() - t0;
    if (s != LM_ERR_DEVICE_OOM)
        return s;
    // halved: each half tries the device again
    int64_t h = n / 2;
    r->n_halved++;
    char unit[128];
    snprintf(unit, sizeof unit, "sequences %" PRId64 "-%" PRId64 " (%" PRId64 " tokens) halved", first + 1, first + n,
             tokens_of(seqs, n));
    lm_fallback_say(r->note, r->note_ctx,
                    &(lm_fallback){r->phase, unit, lm_dev_name(r->dev), lm_dev_name(r->dev), err->msg});
    lm_fwd_req second = req_at(req, tokens_of(seqs, h), r->on_dev->vocab);
    if ((s = run_batch(r, seqs, h, first, req, done, err)) != LM_OK)
        return s;
    return run_batch(r, seqs + h, n - h, first + h, &second, done, err);
}

lm_status lm_fwd_runner_run(lm_fwd_runner *r, const lm_fwd_seq *seqs, int64_t n_seqs, const lm_fwd_req *req,
                            lm_err *err)
{
    lm_fwd *any = r->on_dev ? r->on_dev : r->on_cpu;
    int64_t done = 0, row = 0;
    for (int64_t i = 0; i < n_seqs;) {
        // as many sequences as fit in max_tokens, at least one
        int64_t k = 1, T = seqs[i].len;
        while (i + k < n_seqs && T + seqs[i + k].len <= r->max_tokens)
            T += seqs[i + k++].len;
        lm_fwd_req at = req_at(req, row, any->vocab);
        lm_status s = run_batch(r, seqs + i, k, i, &at, &done, err);
        if (s != LM_OK)
            return s;
        i += k;
        row += T;
    }
    return LM_OK;
}

// ==== sizes for llmerge plan ==================================================================

// The float32 bytes put_tensor allocates for t: none where the tensor is used where it lies
// (a device with host memory, an aligned F32 tensor), else its whole float32 copy. Planning
// sees the mapping's address, which is what put_tensor tests.
static uint64_t plan_put_bytes(const lm_st_tensor *t, bool host_memory)
{
    if (host_memory && t->dtype == LM_DTYPE_F32 && (uintptr_t)t->data % sizeof(float) == 0)
        return 0;
    return (uint64_t)t->numel * sizeof(float);
}

static uint64_t plan_max_u64(uint64_t a, uint64_t b)
{
    return a > b ? a : b;
}

// Adds `bytes` the weights keep on the device.
static void plan_keep(lm_fwd_plan *p, uint64_t bytes)
{
    p->weight_bytes += bytes;
    p->placing_peak = plan_max_u64(p->placing_peak, p->weight_bytes);
}

// Counts what put_tensor does with t: its device bytes, the input bytes it reads, and the
// float32 copy it stages in host memory on a device without host memory.
static void plan_put(lm_fwd_plan *p, const lm_st_tensor *t, bool host_memory)
{
    plan_keep(p, plan_put_bytes(t, host_memory));
    p->mapped_bytes += t->nbytes;
    if (!host_memory)
        p->host_scratch = plan_max_u64(p->host_scratch, (uint64_t)t->numel * sizeof(float));
}

// dora_scratch_init's blocks for a [n_rows, cols] tensor and rank r: device bytes (a block of
// rows and its factor rows) and host bytes (the block twice).
static void plan_dora_scratch(int64_t n_rows, int64_t cols, int64_t r, uint64_t *dev, uint64_t *host)
{
    int64_t rows = cols > 0 && DORA_BLOCK / cols > 0 ? DORA_BLOCK / cols : 1;
    rows = rows < n_rows ? rows : n_rows;
    uint64_t blk = (uint64_t)(rows * cols) * sizeof(float);
    *dev = blk + (uint64_t)(rows * r) * sizeof(float);
    *host = 2 * blk;
}

// As put_arch, for the plan.
static lm_status plan_arch(fwd_loader *L, lm_fwd_plan *p, const lm_arch_desc *desc, int layer, lm_arch_slot slot,
                           bool want_bias, bool use_adapter, bool host_memory, lm_err *err)
{
    const lm_st_tensor *t;
    lm_status s = arch_tensor(L, desc, layer, slot, want_bias, use_adapter, &t, err);
    if (s == LM_OK && t)
        plan_put(p, t, host_memory);
    return s;
}

// As put_linear, for the plan, from the same parts (linear_parts_of): the weight, the LoRA
// factors, and the bias (summed with the LoRA bias in host memory, then placed whole, when the
// adapter has one).
static lm_status plan_linear(fwd_loader *L, lm_fwd_plan *p, const lm_arch_desc *desc, int layer, lm_arch_slot slot,
                             bool host_memory, lm_err *err)
{
    linear_parts lp;
    lm_status s = linear_parts_of(L, desc, layer, slot, &lp, err);
    if (s != LM_OK)
        return s;
    const lm_lora_module *mod = lp.mod;
    if (!(mod && mod->magnitude))
        plan_put(p, lp.w, host_memory);
    if (mod) {
        plan_put(p, mod->a, host_memory);
        if (mod->magnitude) {
            // put_dora_linear: B and the magnitude read into host memory, W placed scaled (its
            // device copy allocated before the scratch blocks), then B placed scaled
            uint64_t sdev, shost, b = (uint64_t)(lp.out * mod->r) * sizeof(float);
            plan_dora_scratch(lp.out, lp.in, mod->r, &sdev, &shost);
            plan_keep(p, (uint64_t)(lp.out * lp.in) * sizeof(float));
            p->placing_peak = plan_max_u64(p->placing_peak, p->weight_bytes + sdev);
            p->host_scratch = plan_max_u64(p->host_scratch, b + (uint64_t)lp.out * sizeof(float) + shost);
            plan_keep(p, b);
            p->mapped_bytes += lp.w->nbytes + mod->b->nbytes + mod->magnitude->nbytes;
        } else {
            plan_put(p, mod->b, host_memory);
        }
        p->max_r = mod->r > p->max_r ? mod->r : p->max_r;
    }
    if (!lp.bias_mod) {
        if (lp.bias)
            plan_put(p, lp.bias, host_memory);
        return LM_OK;
    }
    uint64_t bytes = (uint64_t)lp.base_bias->numel * sizeof(float);
    plan_keep(p, bytes);
    p->mapped_bytes += lp.base_bias->nbytes + lp.bias_mod->bias->nbytes;
    p->host_scratch = plan_max_u64(p->host_scratch, 2 * bytes);
    return LM_OK;
}

lm_status lm_fwd_plan_make(lm_fwd_plan *p, const lm_model *m, const lm_adapter *a, bool host_memory, lm_err *err)
{
    memset(p, 0, sizeof *p);
    const lm_config *cfg = &m->config;
    lm_arch_desc desc = {0};
    fwd_loader L = {.m = m, .a = a};
    lm_status s = lm_fwd_check(m, a, err);
    if (s != LM_OK || (s = lm_arch_describe(&desc, cfg, err)) != LM_OK)
        return s;
    if (a && (!(L.used_module = calloc((size_t)a->n_modules + 1, 1)) ||
              !(L.used_saved = calloc((size_t)a->n_saved + 1, 1)))) {
        s = lm_err_set(err, LM_ERR_NOMEM, "out of memory");
        goto done;
    }
    p->hidden = cfg->hidden_size;
    p->inter = cfg->intermediate_size;
    p->heads = cfg->num_attention_heads;
    p->kv_heads = cfg->num_key_value_heads;
    p->head_dim = cfg->head_dim;
    p->vocab = cfg->vocab_size;

    // put_embedding
    const lm_arch_tensor *et = lm_arch_get(&desc, -1, LM_SLOT_EMBED, false);
    int64_t mi;
    bool scaled = false;  // a DoRA scale folded into the table
    if (!a || lm_adapter_lookup(a, et->name, &mi) != LM_TOUCH_LORA) {
        if ((s = plan_arch(&L, p, &desc, -1, LM_SLOT_EMBED, false, true, host_memory, err)) != LM_OK)
            goto done;
    } else {
        const lm_lora_module *mod = &a->modules[mi];
        if (mod->kind != LM_LORA_EMBEDDING) {
            s = lm_err_set(err, LM_ERR_UNSUPPORTED, "%s: module %s is a linear LoRA on the embedding", a->dir,
                           mod->path);
            goto done;
        }
        L.used_module[mi] = true;
        p->max_r = mod->r > p->max_r ? mod->r : p->max_r;
        if (!mod->magnitude && (s = plan_arch(&L, p, &desc, -1, LM_SLOT_EMBED, false, true, host_memory, err)) != LM_OK)
            goto done;
        // lora_embedding_A read and transposed in host memory, then placed
        uint64_t at_bytes = (uint64_t)mod->a->numel * sizeof(float);
        plan_keep(p, at_bytes);
        p->mapped_bytes += mod->a->nbytes;
        p->host_scratch = plan_max_u64(p->host_scratch, 2 * at_bytes);
        if (!mod->magnitude) {
            plan_put(p, mod->b, host_memory);
        } else {
            // put_dora_embedding: B unscaled on the device and the scratch blocks beside the
            // table being placed; then B placed scaled
            const lm_st_tensor *t = source(&L, et->name, true);
            if (!t) {
                s = lm_err_set(err, LM_ERR_NOT_FOUND, "%s: tensor %s is missing", m->dir, et->name);
                goto done;
            }
            int64_t vocab = cfg->vocab_size, hidden = mod->b->shape[0];
            uint64_t sdev, shost, b = (uint64_t)(hidden * mod->r) * sizeof(float);
            uint64_t table = (uint64_t)(vocab * hidden) * sizeof(float);
            plan_dora_scratch(vocab, hidden, mod->r, &sdev, &shost);
            p->placing_peak = plan_max_u64(p->placing_peak, p->weight_bytes + b + sdev + table);
            p->host_scratch = plan_max_u64(p->host_scratch, 2 * at_bytes + b + shost +
                                           (uint64_t)hidden * (2 * sizeof(float) + sizeof(double)));
            plan_keep(p, table);
            plan_keep(p, b);
            p->mapped_bytes += t->nbytes + mod->b->nbytes + mod->magnitude->nbytes;
            scaled = true;
        }
    }
    static const lm_arch_slot slots[7] = {LM_SLOT_Q, LM_SLOT_K, LM_SLOT_V, LM_SLOT_O,
                                          LM_SLOT_GATE, LM_SLOT_UP, LM_SLOT_DOWN};
    for (int l = 0; l < cfg->num_hidden_layers; l++) {
        for (int k = 0; k < 7; k++)
            if ((s = plan_linear(&L, p, &desc, l, slots[k], host_memory, err)) != LM_OK)
                goto done;
        if ((s = plan_arch(&L, p, &desc, l, LM_SLOT_INPUT_NORM, false, true, host_memory, err)) != LM_OK ||
            (s = plan_arch(&L, p, &desc, l, LM_SLOT_POST_NORM, false, true, host_memory, err)) != LM_OK)
            goto done;
    }
    if ((s = plan_arch(&L, p, &desc, -1, LM_SLOT_FINAL_NORM, false, true, host_memory, err)) != LM_OK)
        goto done;
    if (lm_arch_get(&desc, -1, LM_SLOT_LM_HEAD, false)) {
        if ((s = plan_linear(&L, p, &desc, -1, LM_SLOT_LM_HEAD, host_memory, err)) != LM_OK)
            goto done;
    } else if (((a && lm_adapter_lookup(a, et->name, NULL) == LM_TOUCH_SAVED) || scaled) &&
               (s = plan_arch(&L, p, &desc, -1, LM_SLOT_EMBED, false, false, host_memory, err)) != LM_OK) {
        goto done;  // tied to the base's embedding as it is, while the model's is replaced or scaled
    }
    plan_keep(p, (uint64_t)(cfg->head_dim / 2) * sizeof(float));  // put_rope
    if (a)
        s = check_adapter(a, L.used_module, L.used_saved, false, err);
done:
    free(L.used_module);
    free(L.used_saved);
    lm_arch_desc_free(&desc);
    return s;
}

// An lm_fwd holding only what arena_layout reads.
static lm_fwd plan_shape(const lm_fwd_plan *p)
{
    return (lm_fwd){.hidden = p->hidden, .inter = p->inter, .heads = p->heads, .kv_heads = p->kv_heads,
                    .head_dim = p->head_dim, .vocab = p->vocab, .max_r = p->max_r};
}

size_t lm_fwd_plan_arena_bytes(const lm_fwd_plan *p, int64_t n_tokens)
{
    lm_fwd f = plan_shape(p);
    fwd_arena a;
    return arena_layout(&f, n_tokens, NULL, &a);
}

size_t lm_fwd_plan_arena_touched(const lm_fwd_plan *p, int64_t n_tokens)
{
    // the arena laid out without a vocabulary: the logits region has no rows
    lm_fwd f = plan_shape(p);
    f.vocab = 0;
    fwd_arena a;
    return arena_layout(&f, n_tokens, NULL, &a);
}

int64_t lm_fwd_plan_max_tokens(int64_t max_tokens)
{
    return max_tokens > 0 ? max_tokens : DEFAULT_MAX_TOKENS;
}

// What run_batch does with seqs [first, first + n), on the device while it fits.
static void plan_batch(const lm_fwd_plan *p, const int64_t *lens, int64_t first, int64_t n, bool on_device,
                       uint64_t avail, bool sticky, lm_fwd_plan_note_fn note, void *ctx, lm_fwd_plan_run *r)
{
    int64_t T = 0;
    for (int64_t i = 0; i < n; i++)
        T += lens[first + i];
    if (on_device && !r->stuck) {
        size_t need = lm_fwd_plan_arena_bytes(p, T);
        if (need != SIZE_MAX && need <= avail) {
            r->n_batches++;
            r->tokens_dev += T;
            r->dev_tokens = T > r->dev_tokens ? T : r->dev_tokens;
            return;
        }
        if (n > 1) {
            int64_t h = n / 2;
            r->n_halved++;
            if (note)
                note(ctx, &(lm_fwd_plan_note){.halved = true, .first = first, .n = n, .tokens = T,
                                              .need = need});
            plan_batch(p, lens, first, h, on_device, avail, sticky, note, ctx, r);
            plan_batch(p, lens, first + h, n - h, on_device, avail, sticky, note, ctx, r);
            return;
        }
        r->n_seq_cpu++;
        if (note)
            note(ctx, &(lm_fwd_plan_note){.halved = false, .first = first, .n = 1, .tokens = T, .need = need});
        r->stuck = sticky;
    }
    r->n_batches++;
    r->tokens_cpu += T;
    r->cpu_tokens = T > r->cpu_tokens ? T : r->cpu_tokens;
}

void lm_fwd_plan_runner(const lm_fwd_plan *p, const int64_t *lens, int64_t n_seqs, int64_t max_tokens,
                        bool on_device, uint64_t avail, bool sticky, lm_fwd_plan_note_fn note, void *ctx,
                        lm_fwd_plan_run *r)
{
    memset(r, 0, sizeof *r);
    max_tokens = lm_fwd_plan_max_tokens(max_tokens);
    // lm_fwd_runner_run's batches: as many sequences as fit in max_tokens, at least one
    for (int64_t i = 0; i < n_seqs;) {
        int64_t k = 1, T = lens[i];
        while (i + k < n_seqs && T + lens[i + k] <= max_tokens)
            T += lens[i + k++];
        r->n_formed++;
        r->formed_tokens = T > r->formed_tokens ? T : r->formed_tokens;
        plan_batch(p, lens, i, k, on_device, avail, sticky, note, ctx, r);
        i += k;
    }
}
