// The merge engine's passes over a tensor (see merge_int.h for the engine's files): its parts'
// task vectors τ (a full model's difference from the base, a LoRA pair's s·B@A made on the
// device or on the CPU beside it, DoRA's row scaling, sparsegpt's importance), and the passes
// that merge a tensor and write it, chosen by lm_eng_merge_tensor from the method's descriptor
// and the device: the fused dense pass (every part a full model or a plain LoRA pair on a
// device with the fused operations), the pieces pass (τ in buffers, the rest fused), the
// linear pass (task arithmetic: each τ added in as it exists), the separate operations, and
// the copy of a tensor no FT changes.
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "merge_int.h"
#include "signals.h"
#include "util.h"

// The factors of FT ft where ws is: the CPU's copy on the CPU, the device's
// on the device, NULL when they did not fit there.
const resident *lm_eng_resident_for(const engine *e, wset *ws, int ft)
{
    if (ws->dev == e->cpu)
        return &e->res_cpu[ft];
    return e->res_dev[ft].data ? &e->res_dev[ft] : NULL;
}

static lm_status gemm_factors(engine *e, lm_dev *dev, const resident *rs, const part *p, const lm_st_tensor *bt,
                              int64_t r0, int64_t rows, float alpha, float beta, float *dst)
{
    const lm_lora_module *m = p->mod;
    const float *a = rs->data + rs->a_off[p->mod_index];  // [r, in] or [r, vocab]
    const float *b = rs->data + rs->b_off[p->mod_index];  // [out, r] or [hidden, r]
    int64_t r = m->r, cols = bt->numel / tensor_rows(bt);
    if (!(m->kind == LM_LORA_EMBEDDING || e->fts[p->ft]->adapter->config.fan_in_fan_out))
        // base [out, in]: rows r0: of B @ A are B[r0:, :] @ A
        return lm_dev_gemm(dev, false, false, rows, cols, r, alpha, b + r0 * r, r, a, cols, beta, dst, cols, e->err);
    // base [in, out] (or [vocab, hidden]): (B @ A)ᵀ = Aᵀ Bᵀ, rows r0: of Aᵀ being columns r0: of A
    return lm_dev_gemm(dev, true, true, rows, cols, r, alpha, a + r0, tensor_rows(bt), b, r, beta, dst, cols, e->err);
}

// dst = alpha · (B @ A) + beta · dst for rows [r0, r0 + rows) of base tensor bt, from the
// factors of LoRA part p (transposed for embeddings and fan_in_fan_out). When they stayed on
// the CPU (they did not fit on the device), the product is made there, from the same values
// with the same GEMM as a CPU run, and the result copied to the device.
static lm_status lora_gemm(engine *e, wset *ws, const part *p, const lm_st_tensor *bt, int64_t r0, int64_t rows,
                           float alpha, float beta, float *dst)
{
    const resident *rs = lm_eng_resident_for(e, ws, p->ft);
    if (rs)
        return gemm_factors(e, ws->dev, rs, p, bt, r0, rows, alpha, beta, dst);
    size_t bytes = (size_t)(rows * (bt->numel / tensor_rows(bt))) * sizeof(float);
    lm_status s = lm_eng_cpu_ready(e);
    if (s != LM_OK)
        return s;
    float *host = e->cpu_ws.tau_buf[p->ft];
    if (beta != 0.0f) {
        s = lm_dev_download(ws->dev, host, dst, bytes, e->err);
        e->res->bytes_from_device += bytes;
    }
    if (s == LM_OK)
        s = gemm_factors(e, e->cpu, &e->res_cpu[p->ft], p, bt, r0, rows, alpha, beta, host);
    e->res->bytes_to_device += bytes;
    return s != LM_OK ? s : lm_dev_upload(ws->dev, dst, host, bytes, e->err);
}

// Computes τ of part p for rows [r0, r0 + rows) of base tensor bt into p->tau; base_slab holds
// the base's float32 values of those rows.
static lm_status compute_tau(engine *e, wset *ws, part *p, const lm_st_tensor *bt, int64_t r0, int64_t rows,
                             const float *base_slab)
{
    int64_t cols = bt->numel / tensor_rows(bt), cnt = rows * cols;
    lm_status s;
    if (p->src == SRC_FULL) {
        const lm_st_tensor *t = p->full;
        const void *in;
        lm_nonfinite *nf = lm_eng_first_read(e, 1 + p->ft, r0 * cols, cnt);
        s = lm_eng_stage(e, ws, (const char *)t->data + (size_t)(r0 * cols) * esize(t->dtype), t->dtype, cnt, nf, &in);
        if (s != LM_OK)
            return s;
        return nf && lm_eng_dev_counts(ws) ? lm_dev_delta_count(ws->dev, p->tau, in, t->dtype, base_slab, cnt, nf,
                                                                e->err)
                                   : lm_dev_delta(ws->dev, p->tau, in, t->dtype, base_slab, cnt, e->err);
    }
    const lm_lora_module *m = p->mod;
    float scale = (float)m->scale;
    if (p->src == SRC_LORA_BIAS) {
        s = lm_eng_load_f32(e, ws, p->tau, (const char *)m->bias->data + (size_t)r0 * esize(m->bias->dtype),
                            m->bias->dtype, cnt);
        return s != LM_OK ? s : lm_dev_axpby(ws->dev, p->tau, scale, p->tau, 0.0f, cnt, e->err);
    }
    s = lora_gemm(e, ws, p, bt, r0, rows, scale, 0.0f, p->tau);
    if (s != LM_OK || !m->magnitude)
        return s;
    return lm_dev_dora_rows(ws->dev, p->tau, base_slab, ws->mag_buf + r0, rows, cols, e->err);
}

// Loads the DoRA magnitudes any part of this tensor needs into mag_buf (one adapter at a time
// is enough: parts are computed one after another, so each loads its own before use).
static lm_status load_magnitude(engine *e, wset *ws, const part *p)
{
    if (p->src != SRC_LORA || !p->mod->magnitude)
        return LM_OK;
    const lm_st_tensor *mt = p->mod->magnitude;
    if (mt->numel > ws->mag_cap) {
        lm_dev_buf_free(ws->dev, ws->mag_buf);
        ws->mag_buf = NULL;
        ws->mag_cap = 0;
        lm_status s = lm_dev_alloc(ws->dev, (size_t)mt->numel * sizeof(float), (void **)&ws->mag_buf, e->err);
        if (s != LM_OK)
            return s;
        ws->mag_cap = mt->numel;
    }
    return lm_eng_load_f32(e, ws, ws->mag_buf, mt->data, mt->dtype, mt->numel);
}

lm_status lm_eng_tau_for(engine *e, wset *ws, part *p, const lm_st_tensor *bt, int64_t r0, int64_t rows,
                         const float *base_slab)
{
    lm_status s = load_magnitude(e, ws, p);
    if (s == LM_OK)
        s = compute_tau(e, ws, p, bt, r0, rows, base_slab);
    if (s == LM_OK && p->key)
        s = lm_dev_importance(ws->dev, p->key, p->tau, p->ucc2_dev, rows, bt->numel / tensor_rows(bt), e->err);
    return s;
}

// After a pass over one slab of a tensor that has several, lets the slab's input pages go, so
// memory holds a slab per input rather than the whole tensor (a later pass reads them again
// from the page cache).
void lm_eng_release_slab(const engine *e, const lm_st_tensor *bt, const part *parts, int k, int64_t r0,
                         int64_t rows)
{
    // A tensor whose inputs are small stays mapped until it is done (the loop in lm_merge_run
    // releases it): each pass over it would otherwise fault every page in again.
    if (lm_eng_keeps_mapped(lm_eng_mapped_bytes(bt, parts, k)))
        return;
    int64_t cols = bt->numel / tensor_rows(bt);
    lm_eng_release_bytes(e, (const char *)bt->data + (size_t)(r0 * cols) * esize(bt->dtype),
                         (uint64_t)(rows * cols) * esize(bt->dtype));
    for (int i = 0; i < k; i++)
        if (parts[i].src == SRC_FULL)
            lm_eng_release_bytes(e,
                                 (const char *)parts[i].full->data + (size_t)(r0 * cols) * esize(parts[i].full->dtype),
                                 (uint64_t)(rows * cols) * esize(parts[i].full->dtype));
}

// ==== selection passes ========================================================================

// Whether computing any part's τ reads the base's values (full models and saved tensors
// subtract them, DoRA normalises with them; a plain LoRA delta does not).
bool lm_eng_needs_base(const part *parts, int k)
{
    for (int i = 0; i < k; i++)
        if (parts[i].src == SRC_FULL || (parts[i].src == SRC_LORA && parts[i].mod->magnitude))
            return true;
    return false;
}

// Whether the fused dense operations can make part p's τ themselves: a full model's tensor (or
// an adapter's saved one), or a plain LoRA pair of low rank on a base [out, in] (not DoRA,
// whose scale needs the rows' norms first, nor the transposed products of embeddings and
// fan_in_fan_out).
bool lm_eng_dense_part(const engine *e, const part *p)
{
    if (p->src == SRC_FULL)
        return true;
    if (p->src != SRC_LORA)
        return false;
    const lm_lora_module *m = p->mod;
    return !m->magnitude && m->kind != LM_LORA_EMBEDDING && !e->fts[p->ft]->adapter->config.fan_in_fan_out &&
           m->r <= LM_DEV_LOWRANK_MAX;
}

// Whether tensor bt's passes run as the device's fused dense operations (device.h): every part
// one they make (lm_eng_dense_part), ranked by magnitude, on a device that has them, and no
// DARE L1 rescale (whose norms need τ before the merge) nor della's drop.
bool lm_eng_fused(const engine *e, const lm_dev *dev, const lm_st_tensor *bt, const part *parts, int k)
{
    if (!lm_dev_supports(dev, LM_OP_DENSE) || !lm_dtype_readable(bt->dtype) ||
        (lm_method_stats(e->m, e->o) & LM_STAT_L1) || e->m->della)
        return false;
    for (int i = 0; i < k; i++)
        if (!lm_eng_dense_part(e, &parts[i]) || parts[i].key || parts[i].mask || parts[i].bits)
            return false;
    return k > 0;
}


// Tells the fused operations where part p's τ comes from for the elements of tensor bt from
// `first` on: its mapped input, or (a LoRA pair) its factors. Returns the input bytes read per
// element (none for a LoRA pair, whose factors are in memory already).
size_t lm_eng_dense_source(const engine *e, wset *ws, const part *p, const lm_st_tensor *bt, int64_t first,
                           lm_dense_part *d)
{
    if (p->src == SRC_FULL) {
        d->src = (const char *)p->full->data + (size_t)first * esize(p->full->dtype);
        d->dt = p->full->dtype;
        return esize(p->full->dtype);
    }
    const resident *rs = lm_eng_resident_for(e, ws, p->ft);
    int64_t cols = bt->numel / tensor_rows(bt), r = p->mod->r;
    if (p->keeps) {  // the whole tensor's; `first`, the call's first element, is on a segment
        d->keep_bits = e->keep_bits[p->ft];
        d->keep_off = e->keep_off[p->ft];
        d->keep_vals = e->keep_vals[p->ft];
    }
    d->first = first;
    d->lora_a = rs->data + rs->a_off[p->mod_index];
    d->lora_b = rs->data + rs->b_off[p->mod_index] + first / cols * r;
    d->lora_r = r;
    d->cols = cols;
    d->col0 = first % cols;
    d->scale = (float)p->mod->scale;
    d->dt = LM_DTYPE_F32;
    return 0;
}

// ==== one tensor ==============================================================================

// ramplus_tl's weights: over the whole tensor, each part's entries above its threshold that no
// other part's are (unique) and that another's are too (shared), from the trimmed τ's bits
// (lm_dev_mask_get), give λ_i = 1 + r·clamp(shared_i / max(unique_i, ε_i), 0, alpha), the weight
// LM_COMBINE_SIGN_RAMPLUS gives the part's unique entries (in e->tp.weights, this tensor's).
static lm_status ramplus_weights(engine *e, wset *ws, const lm_st_tensor *bt, part *parts, int k, int64_t slab_rows,
                                 bool one_slab)
{
    int64_t rows = tensor_rows(bt), cols = bt->numel / rows, cap = (slab_rows < rows ? slab_rows : rows) * cols;
    size_t words = (size_t)(cap + 63) / 64;
    uint64_t *bits = calloc((size_t)(k > 0 ? k : 1) * words, sizeof *bits);
    int64_t shared[k > 0 ? k : 1], unique[k > 0 ? k : 1];
    if (!bits)
        return lm_err_set(e->err, LM_ERR_NOMEM, "out of memory");
    memset(shared, 0, sizeof shared);
    memset(unique, 0, sizeof unique);
    lm_status s = LM_OK;
    for (int64_t r0 = 0; r0 < rows && s == LM_OK; r0 += slab_rows) {
        int64_t nr = rows - r0 < slab_rows ? rows - r0 : slab_rows, cnt = nr * cols;
        if (r0 > 0 && lm_interrupted()) {
            s = lm_interrupted_err(e->err);
            break;
        }
        memset(bits, 0, (size_t)k * words * sizeof *bits);
        s = lm_eng_load_base(e, ws, bt, r0, nr);
        for (int i = 0; s == LM_OK && i < k; i++) {
            part *p = &parts[i];
            int64_t used = 0;
            if ((s = lm_eng_tau_for(e, ws, p, bt, r0, nr, ws->base_buf)) == LM_OK &&
                (s = lm_dev_topk_apply(ws->dev, p->tau, cnt, p->topk.thr_bits, 0, &used, e->err)) == LM_OK)
                s = lm_dev_mask_get(ws->dev, (uint8_t *)(bits + (size_t)i * words), 0, p->tau, cnt, e->err);
        }
        // per 64 entries: those kept by exactly one part, and by more than one
        for (size_t w = 0; s == LM_OK && w < (size_t)(cnt + 63) / 64; w++) {
            uint64_t once = 0, more = 0;
            for (int i = 0; i < k; i++) {
                uint64_t b = bits[(size_t)i * words + w];
                more |= once & b;
                once = (once ^ b) & ~more;
            }
            for (int i = 0; i < k; i++) {
                uint64_t b = bits[(size_t)i * words + w];
                unique[i] += __builtin_popcountll(b & once);
                shared[i] += __builtin_popcountll(b & more);
            }
        }
        if (!one_slab)
            lm_eng_release_slab(e, bt, parts, k, r0, nr);
    }
    free(bits);
    for (int i = 0; s == LM_OK && i < k; i++) {
        int ft = parts[i].ft;
        double eps = e->tp.epsilons[ft], rho = (double)shared[i] / fmax((double)unique[i], eps);
        double clamped = rho < 0 ? 0 : rho > e->o->ram_alpha ? e->o->ram_alpha : rho;
        e->tp.weights[ft] = 1.0 + e->o->ram_r * clamped;
    }
    return s;
}

// Bytes [offset, offset + nbytes) of output tensor idx to the writer, or to the caller's put.
lm_status lm_eng_put(engine *e, int64_t idx, uint64_t offset, const void *data, size_t nbytes)
{
    if (e->hooks && e->hooks->put)
        return e->hooks->put(e->hooks->ctx, idx, offset, data, nbytes, e->err);
    return lm_st_writer_put_part(e->w, idx, offset, data, nbytes, e->err);
}

// Hashes and writes nbytes of tensor idx's output at its byte offset.
static lm_status put_piece(engine *e, int64_t idx, const void *piece, size_t nbytes, uint64_t offset,
                           XXH64_state_t *hash)
{
    if (!e->hooks || !e->hooks->put)  // the caller's own output has no tensor hashes
        XXH64_update(hash, piece, nbytes);
    e->bytes_out += nbytes;
    return lm_eng_put(e, idx, offset, piece, nbytes);
}

// Converts a slab of float32 results to the output dtype, hashes it and writes it at its offset.
// On the CPU this goes in pieces of OUT_PIECE bytes: the converted piece is still in cache when
// the hash and the writer's copy read it (one large write from a buffer that no longer fits in
// cache copies several times slower). From an accelerator the slab comes home in one download
// (whose copies overlap) and is then hashed and written by pieces. The output's NaN and Inf are
// counted as it is converted, or (where the device does not count) in each piece before the
// hash reads it.
lm_status lm_eng_write_slab(engine *e, wset *ws, int64_t idx, lm_dtype out_dt, const float *out_f32, int64_t cnt,
                            uint64_t offset, XXH64_state_t *hash)
{
    size_t es = esize(out_dt), total = (size_t)cnt * es;
    int64_t per_piece = (int64_t)(OUT_PIECE / es);
    bool host = lm_dev_host_memory(ws->dev);
    lm_nonfinite *nf = lm_eng_out_count(e);
    lm_status s = LM_OK;
    if (!host) {
        if (!e->out_slab && !(e->out_slab = malloc((size_t)e->slab_max * sizeof(float))))
            return lm_err_set(e->err, LM_ERR_NOMEM, "out of memory");
        s = lm_dev_from_f32(ws->dev, ws->out_dev, out_dt, out_f32, cnt, e->err);
        if (s == LM_OK)
            s = lm_dev_download(ws->dev, e->out_slab, ws->out_dev, total, e->err);
        e->res->bytes_from_device += total;
    }
    for (int64_t off = 0; s == LM_OK && off < cnt; off += per_piece) {
        int64_t n = cnt - off < per_piece ? cnt - off : per_piece;
        size_t nbytes = (size_t)n * es;
        const unsigned char *piece = host ? e->out_host : e->out_slab + (size_t)off * es;
        if (host && (s = nf && lm_eng_dev_counts(ws) ? lm_dev_from_f32_count(ws->dev, e->out_host, out_dt,
                                                                             out_f32 + off, n, nf, e->err)
                                             : lm_dev_from_f32(ws->dev, e->out_host, out_dt, out_f32 + off, n,
                                                               e->err)) != LM_OK)
            break;
        if (nf && !lm_eng_dev_counts(ws))
            lm_count_nonfinite(piece, out_dt, n, nf);
        s = put_piece(e, idx, piece, nbytes, offset + (uint64_t)off * es, hash);
    }
    return s;
}

// A tensor no FT changes: the base's values in the output dtype.
lm_status lm_eng_copy_tensor(engine *e, wset *ws, int64_t idx, const lm_st_tensor *bt, lm_dtype out_dt,
                             XXH64_state_t *hash)
{
    // In pieces of a slab's bytes, each let go once written, so memory stays bounded.
    if (bt->dtype == out_dt || !lm_dtype_readable(bt->dtype)) {
        uint64_t piece = OUT_PIECE;
        for (uint64_t off = 0; off < bt->nbytes; off += piece) {
            uint64_t len = bt->nbytes - off < piece ? bt->nbytes - off : piece;
            const char *src = (const char *)bt->data + off;
            // the base's values are the output's: counted once for both, before the hash reads
            // them (an integer or FP8 tensor is not counted)
            if (e->counting && lm_dtype_readable(bt->dtype)) {
                lm_nonfinite c = {0, 0};
                lm_count_nonfinite(src, bt->dtype, (int64_t)(len / esize(bt->dtype)), &c);
                e->in[0].nan += c.nan;
                e->in[0].inf += c.inf;
                e->out.nan += c.nan;
                e->out.inf += c.inf;
            }
            XXH64_update(hash, src, len);
            lm_status s = lm_eng_put(e, idx, off, src, len);
            if (s != LM_OK)
                return s;
            lm_eng_release_bytes(e, src, len);
        }
        e->bytes_in += bt->nbytes;
        e->bytes_out += bt->nbytes;
        return LM_OK;
    }
    for (int64_t off = 0; off < bt->numel; off += e->slab_max) {
        int64_t cnt = bt->numel - off < e->slab_max ? bt->numel - off : e->slab_max;
        const char *src = (const char *)bt->data + (size_t)off * esize(bt->dtype);
        lm_status s = lm_eng_load_f32_nf(e, ws, ws->base_buf, src, bt->dtype, cnt, lm_eng_first_read(e, 0, off, cnt));
        if (s == LM_OK)
            s = lm_eng_write_slab(e, ws, idx, out_dt, ws->base_buf, cnt, (uint64_t)off * esize(out_dt), hash);
        if (s != LM_OK)
            return s;
        lm_eng_release_bytes(e, src, (uint64_t)cnt * esize(bt->dtype));
    }
    return LM_OK;
}

// Task arithmetic's coefficients: c_i = λ w_i / (Σ w_i over the parts when normalizing), the
// base's 1.
static void task_arithmetic_coef(engine *e, const part *parts, int k)
{
    double div = 0;
    for (int i = 0; i < k; i++)
        div += e->tp.weights[parts[i].ft];
    if (!e->o->normalize || div == 0)
        div = 1;
    for (int i = 0; i < k; i++)
        e->coef[parts[i].ft] = (float)(e->tp.lambda * e->tp.weights[parts[i].ft] / div);
    e->base_coef = 1.0f;
}

// The linear pass: θ = a θ_b + Σ_i c_i τ_i with the engine's coefficients (e->base_coef,
// e->coef), so each τ is added into the result as soon as it exists, and a plain LoRA τ is
// never materialised at all: one GEMM adds c_i s B@A to the result in place. NearSwap's step
// (the method's nearswap) is applied to each τ first, which then is materialised. With
// have_slab the tensor is one slab whose base values and τ are in the buffers already (the
// Gram pass left them).
lm_status lm_eng_merge_linear(engine *e, wset *ws, int64_t idx, const lm_st_desc *desc, const lm_st_tensor *bt,
                              part *parts, int k, int64_t slab_rows, bool have_slab, XXH64_state_t *hash)
{
    int64_t rows = tensor_rows(bt), cols = bt->numel / rows;
    bool near = e->m->nearswap;
    lm_status s = LM_OK;
    for (int64_t r0 = 0; r0 < rows && s == LM_OK; r0 += slab_rows) {
        int64_t nr = rows - r0 < slab_rows ? rows - r0 : slab_rows, cnt = nr * cols;
        if (r0 > 0 && lm_interrupted())  // a large tensor stops between its slabs too
            return lm_interrupted_err(e->err);
        if (!have_slab)
            s = lm_eng_load_base(e, ws, bt, r0, nr);
        // Task vectors that need the base's values (full models, DoRA, biases) first, while
        // base_buf still holds them; then everything is added in.
        for (int i = 0; s == LM_OK && !have_slab && i < k; i++)
            if (parts[i].src != SRC_LORA || parts[i].mod->magnitude || near)
                s = lm_eng_tau_for(e, ws, &parts[i], bt, r0, nr, ws->base_buf);
        for (int i = 0; s == LM_OK && near && i < k; i++)
            s = lm_dev_nearswap(ws->dev, parts[i].tau, cnt, (float)e->tp.t, e->err);
        // the base's own coefficient (1 but for the methods that interpolate): a·θ_b + 0·θ_b,
        // the fused pass's arithmetic
        if (s == LM_OK && e->base_coef != 1.0f)
            s = lm_dev_axpby(ws->dev, ws->base_buf, e->base_coef, ws->base_buf, 0.0f, cnt, e->err);
        for (int i = 0; s == LM_OK && i < k; i++) {
            part *p = &parts[i];
            float c = e->coef[p->ft];
            if (p->src == SRC_LORA && !p->mod->magnitude && !near && !have_slab)
                s = lora_gemm(e, ws, p, bt, r0, nr, c * (float)p->mod->scale, 1.0f, ws->base_buf);
            else
                s = lm_dev_axpby(ws->dev, ws->base_buf, 1.0f, p->tau, c, cnt, e->err);
        }
        if (s == LM_OK)
            s = lm_eng_write_slab(e, ws, idx, desc->dtype, ws->base_buf, cnt, (uint64_t)(r0 * cols) * esize(desc->dtype),
                           hash);
        if (rows > slab_rows)
            lm_eng_release_slab(e, bt, parts, k, r0, nr);
    }
    return s;
}

// The sign rule of the method's combine: ram's mean of the parts not zero (ramplus_tl's), none,
// or the election o->sign asks for.
static lm_combine_sign combine_sign(const engine *e)
{
    if (e->m->threshold)
        return e->m->ramplus ? LM_COMBINE_SIGN_RAMPLUS : LM_COMBINE_SIGN_NONZERO;
    return !e->m->elect ? LM_COMBINE_SIGN_NONE : e->o->sign == LM_SIGN_COUNT ? LM_COMBINE_SIGN_COUNT : LM_COMBINE_SIGN_SUM;
}

// What lm_dev_dense_merge is told of tensor bt's parts and their combination (each part's src or
// tau, first and ties_allowed are set per piece by merge_pieces).
static lm_combine_how dense_parts(const engine *e, const lm_st_tensor *bt, const part *parts, int k,
                                      lm_dense_part *d)
{
    const lm_merge_opts *o = e->o;
    bool linear = e->m->linear;  // the coefficients are the engine's, as lm_eng_merge_linear's
    uint64_t name_hash = lm_xxh64(bt->name, strlen(bt->name));
    for (int i = 0; i < k; i++) {
        const part *p = &parts[i];
        const lm_topk *t = o->topk_global && e->global ? &e->global[p->ft] : &p->topk;
        d[i] = (lm_dense_part){
            .dt = p->src == SRC_FULL ? p->full->dtype : LM_DTYPE_F32,
            .trim = e->m->rank != LM_RANK_NONE || e->m->threshold,
            .thr_bits = t->thr_bits,
            .band = e->m->outliers && !p->topk_hi.none,  // breadcrumbs: the top k_hi dropped after
            .hi_bits = p->topk_hi.thr_bits,
            .drop = e->m->drop && !p->dropped && !e->m->della,  // della drops in the buffers first
            .key = lm_rng_key(o->seed, p->ft, name_hash),
            .keep_below = lm_rng_threshold(e->tp.densities[p->ft]),
            .rescale = (float)p->rescale,
            .weight = linear ? e->coef[p->ft] : (float)e->tp.weights[p->ft],
        };
    }
    return (lm_combine_how){.sign = combine_sign(e), .normalize = o->normalize, .lambda = (float)e->tp.lambda,
                            .linear = linear, .scale_base = linear && e->base_coef != 1.0f,
                            .base_scale = e->base_coef};
}

// Merges elements [first0, first0 + cnt) of tensor idx with lm_dev_dense_merge, an OUT_PIECE of
// output at a time: τ, trimmed or dropped, rescaled, combined with the base read where it is
// mapped, converted, hashed and written in one pass. With from_buf each part's τ is in its
// buffer (the slab from first0), else it is computed from the part's mapped input.
// A piece of output waiting to be hashed and written: put_pending does it on the merge's thread
// while the device merges the next piece into the other half of out_host.
typedef struct pending_piece {
    engine *e;
    int64_t idx;
    XXH64_state_t *hash;
    const void *data;  // NULL: nothing waiting
    size_t nbytes;
    uint64_t offset;
    lm_status s;
} pending_piece;

static void put_pending(void *ctx)
{
    pending_piece *pp = ctx;
    if (pp->data && pp->s == LM_OK)
        pp->s = put_piece(pp->e, pp->idx, pp->data, pp->nbytes, pp->offset, pp->hash);
    pp->data = NULL;
}

static lm_status merge_pieces(engine *e, wset *ws, int64_t idx, const lm_st_desc *desc, const lm_st_tensor *bt,
                              part *parts, int k, lm_dense_part *d, lm_combine_how how, int64_t first0, int64_t cnt,
                              bool from_buf, int64_t *ties_left, int64_t *ties_hi, XXH64_state_t *hash)
{
    const lm_merge_opts *o = e->o;
    size_t es = esize(desc->dtype);
    int64_t per_piece = (int64_t)(OUT_PIECE / es);
    lm_status s = LM_OK;
    pending_piece pp = {.e = e, .idx = idx, .hash = hash};
    lm_dev_side side = {put_pending, &pp};
    for (int64_t off = 0; off < cnt && s == LM_OK; off += per_piece) {
        unsigned char *out = e->out_host + (off / per_piece % 2) * OUT_PIECE;
        int64_t n = cnt - off < per_piece ? cnt - off : per_piece, first = first0 + off;
        e->bytes_in += (uint64_t)n * esize(bt->dtype);
        how.base_nf = lm_eng_first_read(e, 0, first, n);
        how.out_nf = lm_eng_out_count(e);
        for (int i = 0; i < k; i++) {
            if (from_buf)
                d[i].tau = parts[i].tau + off;
            else
                e->bytes_in += (uint64_t)n * lm_eng_dense_source(e, ws, &parts[i], bt, first, &d[i]);
            d[i].first = first;
            d[i].ties_allowed = ties_left[i];
            d[i].hi_allowed = ties_hi ? ties_hi[i] : 0;
            // a full model's values are read here unless τ is in its buffer already
            d[i].nf = !from_buf && parts[i].src == SRC_FULL ? lm_eng_first_read(e, 1 + parts[i].ft, first, n) : NULL;
        }
        s = lm_dev_dense_merge_side(ws->dev, out, desc->dtype,
                                    (const char *)bt->data + (size_t)first * esize(bt->dtype), bt->dtype, d, k, n, how,
                                    &side, e->err);
        if (s == LM_OK)
            s = pp.s;
        for (int i = 0; s == LM_OK && i < k; i++) {
            ties_left[i] -= d[i].ties_used;
            if (ties_hi)
                ties_hi[i] -= d[i].hi_used;
            if (o->topk_global && e->global)
                e->global[parts[i].ft].ties_allowed -= d[i].ties_used;
        }
        if (s == LM_OK) {
            pp.data = out;
            pp.nbytes = (size_t)n * es;
            pp.offset = (uint64_t)first * es;
        }
    }
    if (s != LM_OK)
        return s;
    put_pending(&pp);
    return pp.s;
}

// The merge pass of a tensor whose passes are fused (full models and plain LoRA pairs): τ is made
// (or read back from the kept candidates) as each piece is merged, slab by slab.
lm_status lm_eng_merge_dense(engine *e, wset *ws, int64_t idx, const lm_st_desc *desc, const lm_st_tensor *bt,
                             part *parts, int k, int64_t slab_rows, int64_t *ties_left, int64_t *ties_hi,
                             XXH64_state_t *hash)
{
    int64_t rows = tensor_rows(bt), cols = bt->numel / rows;
    lm_dense_part d[k];
    lm_combine_how how = dense_parts(e, bt, parts, k, d);
    lm_status s = LM_OK;
    for (int64_t r0 = 0; r0 < rows && s == LM_OK; r0 += slab_rows) {
        int64_t nr = rows - r0 < slab_rows ? rows - r0 : slab_rows;
        if (r0 > 0 && lm_interrupted())  // a large tensor stops between its slabs too
            return lm_interrupted_err(e->err);
        s = merge_pieces(e, ws, idx, desc, bt, parts, k, d, how, r0 * cols, nr * cols, false, ties_left, ties_hi,
                         hash);
        if (rows > slab_rows)
            lm_eng_release_slab(e, bt, parts, k, r0, nr);
    }
    return s;
}

// Breadcrumbs' trim of part p's τ in its buffer (cnt entries, the next of the tensor's): its
// band's top k_lo kept, then the top k_hi of those dropped (the same ties in index order as
// both selections count them, since the first keeps a prefix of the ties the second drops).
static lm_status trim_band(engine *e, wset *ws, part *p, int64_t cnt, int64_t *ties_lo, int64_t *ties_hi)
{
    int64_t used = 0;
    lm_status s = lm_dev_topk_apply(ws->dev, p->tau, cnt, p->topk.thr_bits, *ties_lo, &used, e->err);
    *ties_lo -= used;
    if (s != LM_OK || p->topk_hi.none)
        return s;
    s = lm_dev_topk_drop(ws->dev, p->tau, cnt, p->topk_hi.thr_bits, *ties_hi, &used, e->err);
    *ties_hi -= used;
    return s;
}

// DELLA's drop of part p's τ in its buffer, rows [r0, r0 + nr) of bt: a vector is one row, as
// mergekit ranks it (whole: a vector longer than a slab is refused). A density of 1 keeps it
// whole, as mergekit does.
static lm_status della_drop(engine *e, wset *ws, part *p, const lm_st_tensor *bt, int64_t r0, int64_t nr)
{
    double d = e->tp.densities[p->ft], eps = e->tp.epsilons[p->ft];
    if (d >= 1)
        return LM_OK;
    int64_t cols = bt->numel / tensor_rows(bt), rows = nr;
    if (bt->ndim < 2) {
        if (nr < tensor_rows(bt))
            return lm_err_set(e->err, LM_ERR_UNSUPPORTED, "della: the vector '%s' does not fit in one slab", bt->name);
        cols = nr * cols;
        rows = 1;
    }
    uint64_t key = lm_rng_key(e->o->seed, p->ft, lm_xxh64(bt->name, strlen(bt->name)));
    return lm_dev_della_drop(ws->dev, p->tau, rows, cols, key, r0 * (bt->numel / tensor_rows(bt)), d - eps, d + eps,
                             e->o->rescale == LM_RESCALE_INV, e->err);
}

// Whether the merge pass of a tensor whose τ are in buffers runs as lm_dev_dense_merge: on a
// device that has it, unless a part is ranked by importance or by a stored mask, or records one.
static bool pieces_from_buf(const wset *ws, const lm_st_tensor *bt, const part *parts, int k)
{
    if (!lm_dev_supports(ws->dev, LM_OP_DENSE) || !lm_dtype_readable(bt->dtype))
        return false;
    for (int i = 0; i < k; i++)
        if (parts[i].key || parts[i].mask || parts[i].bits)
            return false;
    return true;
}

// Merges tensor idx from its k parts (their buffers those of ws, bound by bind) on ws->dev and
// writes it.
lm_status lm_eng_merge_tensor(engine *e, wset *ws, int64_t idx, const lm_st_desc *desc, XXH64_state_t *hash,
                              part *parts, int k)
{
    const lm_merge_opts *o = e->o;
    const lm_st_tensor *bt = e->base->tensors[idx];
    int64_t rows = tensor_rows(bt), cols = bt->numel / rows;
    int64_t slab_rows = lm_eng_slab_rows(e, ws->dev, bt, parts, k);
    bool one_slab = slab_rows >= rows;
    lm_status s = LM_OK;

    if (e->m->coeffs || e->m->nearswap)
        return lm_eng_merge_coef(e, ws, idx, desc, hash, parts, k, slab_rows);
    if (e->m->sce)
        return lm_eng_merge_sce(e, ws, idx, desc, hash, parts, k, slab_rows);

    // select: exact top-k per part over the whole tensor (none when every part has a stored mask).
    int n_masked = 0;
    for (int i = 0; i < k; i++)
        n_masked += parts[i].mask != NULL;
    unsigned stats = lm_method_stats(e->m, o);
    bool select = (stats & LM_STAT_TOPK) && !o->topk_global && n_masked < k;
    bool select_fused = select && lm_eng_fused(e, ws->dev, bt, parts, k);
    if (select && e->m->outliers && select_fused) {
        // breadcrumbs: both thresholds of every part from one fused counting pass, each part
        // there twice (the copies share its buffers): the outliers' (top k_hi), the band's lower
        // one (top k_lo)
        part twice[2 * k];
        int64_t keep[2 * k];
        for (int i = 0; i < k; i++) {
            twice[i] = twice[k + i] = parts[i];
            lm_eng_band(e->tp.densities[parts[i].ft], e->tp.gammas[parts[i].ft], bt->numel, &keep[k + i], &keep[i]);
        }
        s = lm_eng_select_tensor(e, ws, bt, twice, 2 * k, one_slab, keep, false);
        for (int i = 0; s == LM_OK && i < k; i++) {
            parts[i].topk_hi = twice[i].topk;
            parts[i].topk = twice[k + i].topk;
        }
    } else if (select && e->m->outliers) {
        // the same one threshold after the other; over a single slab the second counts τ as the
        // first left it in the buffers, rather than making it again from the inputs (on a GPU,
        // copying them to the device a second time)
        int64_t k_lo[k], k_hi[k];
        for (int i = 0; i < k; i++)
            lm_eng_band(e->tp.densities[parts[i].ft], e->tp.gammas[parts[i].ft], bt->numel, &k_lo[i], &k_hi[i]);
        if ((s = lm_eng_select_tensor(e, ws, bt, parts, k, one_slab, k_hi, false)) != LM_OK)
            return s;
        for (int i = 0; i < k; i++)
            parts[i].topk_hi = parts[i].topk;
        s = lm_eng_select_tensor(e, ws, bt, parts, k, one_slab, k_lo, true);
    } else if (select) {
        s = lm_eng_select_tensor(e, ws, bt, parts, k, one_slab, NULL, false);
    } else if (e->m->threshold) {
        // RAM: the trim's rule at a fixed threshold, no selection: kept where |τ| > ε_i, which
        // for the magnitude bits of float32 is bits(|τ|) > bits(ε_i) (no ties kept)
        for (int i = 0; i < k; i++) {
            float eps = fabsf((float)e->tp.epsilons[parts[i].ft]);
            parts[i].topk = (lm_topk){.k = bt->numel, .n = bt->numel, .thr_bits = lm_f32_bits(eps)};
        }
    }
    if (s != LM_OK)
        return s;

    // The ties budget each part may still spend in this tensor (and breadcrumbs' drop).
    int64_t ties_left[k], ties_hi[k];
    for (int i = 0; i < k; i++) {
        ties_left[i] = e->global ? e->global[parts[i].ft].ties_allowed : parts[i].topk.ties_allowed;
        ties_hi[i] = parts[i].topk_hi.ties_allowed;
    }

    // l1: DARE's L1-matching rescale needs both norms over the whole tensor first.
    bool random = e->m->drop;
    if (stats & LM_STAT_L1) {
        double l1_all[k], l1_kept[k];
        memset(l1_all, 0, sizeof l1_all);
        memset(l1_kept, 0, sizeof l1_kept);
        uint64_t name_hash = lm_xxh64(bt->name, strlen(bt->name));
        for (int64_t r0 = 0; r0 < rows && s == LM_OK; r0 += slab_rows) {
            int64_t nr = rows - r0 < slab_rows ? rows - r0 : slab_rows, cnt = nr * cols;
            s = lm_eng_load_base(e, ws, bt, r0, nr);
            for (int i = 0; s == LM_OK && i < k; i++) {
                double a, b;
                part *p = &parts[i];
                if ((s = lm_eng_tau_for(e, ws, p, bt, r0, nr, ws->base_buf)) != LM_OK ||
                    (s = lm_dev_l1(ws->dev, p->tau, cnt, &a, e->err)) != LM_OK)
                    break;
                uint64_t key = lm_rng_key(o->seed, p->ft, name_hash);
                if ((s = e->m->della ? della_drop(e, ws, p, bt, r0, nr)
                                     : lm_dev_random_drop(ws->dev, p->tau, cnt, key, r0 * cols,
                                                          lm_rng_threshold(e->tp.densities[p->ft]), e->err)) != LM_OK ||
                    (s = lm_dev_l1(ws->dev, p->tau, cnt, &b, e->err)) != LM_OK)
                    break;
                l1_all[i] += a;
                l1_kept[i] += b;
                p->dropped = one_slab;
            }
            if (!one_slab)
                lm_eng_release_slab(e, bt, parts, k, r0, nr);
        }
        if (s != LM_OK)
            return s;
        for (int i = 0; i < k; i++)
            parts[i].rescale = l1_all[i] >= 1e-7 && l1_kept[i] >= 1e-7 ? l1_all[i] / l1_kept[i] : 1.0;
    } else if (random && o->rescale == LM_RESCALE_INV && !e->m->della) {  // della's 1/p is per entry
        for (int i = 0; i < k; i++)
            parts[i].rescale = 1.0 / e->tp.densities[parts[i].ft];
    }

    if (e->m->ramplus && (s = ramplus_weights(e, ws, bt, parts, k, slab_rows, one_slab)) != LM_OK)
        return s;

    // merge: τ, sparsify, rescale, combine, convert, write.
    const float *taus[k];
    float weights[k];
    for (int i = 0; i < k; i++) {
        taus[i] = parts[i].tau;
        weights[i] = (float)e->tp.weights[parts[i].ft];
    }
    // τ is still in the buffers after the passes above only when they ran over a single slab,
    // not fused, and the last thing each did to it is what the merge needs next.
    bool have_tau = one_slab && ((select && !select_fused) || (random && o->rescale == LM_RESCALE_L1));
    // The base slab is still in base_buf too when those passes loaded it (the l1 pass always
    // does; the histogram pass when some τ needed it).
    bool have_base = have_tau && (random || lm_eng_needs_base(parts, k));
    uint64_t name_hash = lm_xxh64(bt->name, strlen(bt->name));
    lm_combine_sign sign = combine_sign(e);
    if (e->m->linear)
        task_arithmetic_coef(e, parts, k);
    if (lm_eng_fused(e, ws->dev, bt, parts, k))
        return lm_eng_merge_dense(e, ws, idx, desc, bt, parts, k, slab_rows, ties_left, ties_hi, hash);
    if (e->m->linear)
        return lm_eng_merge_linear(e, ws, idx, desc, bt, parts, k, slab_rows, false, hash);
    // With τ in the buffers, the rest of the pass in one operation where the device has it.
    bool pieces = pieces_from_buf(ws, bt, parts, k);
    lm_dense_part d[k];
    lm_combine_how how = dense_parts(e, bt, parts, k, d);
    for (int64_t r0 = 0; r0 < rows && s == LM_OK; r0 += slab_rows) {
        int64_t nr = rows - r0 < slab_rows ? rows - r0 : slab_rows, cnt = nr * cols;
        if (r0 > 0 && lm_interrupted())  // a large tensor stops between its slabs too
            return lm_interrupted_err(e->err);
        if (!have_base && (!pieces || lm_eng_needs_base(parts, k)))
            s = lm_eng_load_base(e, ws, bt, r0, nr);
        for (int i = 0; s == LM_OK && pieces && !have_tau && i < k; i++)
            s = lm_eng_tau_for(e, ws, &parts[i], bt, r0, nr, ws->base_buf);
        for (int i = 0; s == LM_OK && pieces && e->m->della && i < k; i++)
            if (!parts[i].dropped)
                s = della_drop(e, ws, &parts[i], bt, r0, nr);
        if (pieces) {
            if (s == LM_OK)
                s = merge_pieces(e, ws, idx, desc, bt, parts, k, d, how, r0 * cols, cnt, true, ties_left, ties_hi,
                                 hash);
            if (!one_slab)
                lm_eng_release_slab(e, bt, parts, k, r0, nr);
            continue;
        }
        for (int i = 0; s == LM_OK && i < k; i++) {
            part *p = &parts[i];
            if (!have_tau && (s = lm_eng_tau_for(e, ws, p, bt, r0, nr, ws->base_buf)) != LM_OK)
                break;
            if (e->m->outliers) {
                s = trim_band(e, ws, p, cnt, &ties_left[i], &ties_hi[i]);
            } else if (e->m->rank != LM_RANK_NONE || e->m->threshold) {
                const lm_topk *t = o->topk_global ? &e->global[p->ft] : &p->topk;
                int64_t used = 0;
                s = p->mask  ? lm_dev_mask_apply(ws->dev, p->tau, p->mask, r0 * cols, cnt, e->err)
                    : p->key ? lm_dev_topk_apply_by(ws->dev, p->tau, p->key, cnt, t->thr_bits, ties_left[i], &used,
                                                    e->err)
                             : lm_dev_topk_apply(ws->dev, p->tau, cnt, t->thr_bits, ties_left[i], &used, e->err);
                if (s == LM_OK && p->bits)  // recorded for the cache: what the trim kept
                    s = lm_dev_mask_get(ws->dev, p->bits, r0 * cols, p->tau, cnt, e->err);
                if (s != LM_OK)
                    break;
                ties_left[i] -= used;
                if (o->topk_global)
                    e->global[p->ft].ties_allowed -= used;
            } else if (random && !p->dropped) {
                uint64_t key = lm_rng_key(o->seed, p->ft, name_hash);
                if ((s = e->m->della ? della_drop(e, ws, p, bt, r0, nr)
                                     : lm_dev_random_drop(ws->dev, p->tau, cnt, key, r0 * cols,
                                                          lm_rng_threshold(e->tp.densities[p->ft]), e->err)) != LM_OK)
                    break;
            }
            if (p->rescale != 1.0 &&
                (s = lm_dev_axpby(ws->dev, p->tau, (float)p->rescale, p->tau, 0.0f, cnt, e->err)) != LM_OK)
                break;
        }
        if (s == LM_OK)
            s = lm_dev_combine(ws->dev, ws->base_buf, ws->base_buf, taus, weights, k, cnt,
                               (lm_combine_how){.sign = sign, .normalize = o->normalize, .lambda = (float)e->tp.lambda},
                               e->err);
        if (s == LM_OK)
            s = lm_eng_write_slab(e, ws, idx, desc->dtype, ws->base_buf, cnt, (uint64_t)(r0 * cols) * esize(desc->dtype),
                           hash);
        if (!one_slab)
            lm_eng_release_slab(e, bt, parts, k, r0, nr);
    }
    return s;
}
