// --to-lora: a merge written as a PEFT LoRA adapter of BASE rather than as a model. The merge
// runs as always with float32 output; its bytes come here (lm_merge_hooks' put) instead of to
// the safetensors writer, one tensor at a time, and when a tensor is complete (tensor_done) its
// change Δ = merged − BASE is made in float32 and:
//   - a matrix (a 2-D ".weight") is factored by a truncated SVD (lib/lowrank.h) to the rank
//     --to-lora gives (or the smallest that keeps --to-lora-energy of its energy), on the merge's
//     device, the CPU where the device is out of memory, and its factors kept for the adapter:
//     linear LoRA, or embedding LoRA for the embedding;
//   - any other tensor that changes (norms, biases) is kept whole until the end: a bias of a
//     module with factors becomes lora_B.bias, any other goes into modules_to_save with its
//     merged values;
//   - a tensor that does not change is left out.
// At the end lib/adapter_write.h writes adapter_config.json and adapter_model.safetensors.
// --to-lora exact runs no merge: the adapters' factors are concatenated (lm_cmd_lora_exact).
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "adapter_write.h"
#include "lowrank.h"
#include "merge_args.h"
#include "sparsify.h"
#include "util.h"

#define LORA_POWER_ITERS 1
#define BASE_CHUNK 4096                // base values converted at once
#define RELEASE_BYTES ((uint64_t)8 << 20)  // base bytes read between two madvise calls

// A tensor that changed, with what was made of it.
typedef struct lora_rec {
    char *name;
    int ndim;
    int64_t shape[2];
    int rank;        // factored: its rank (0 where Δ has none); kept whole: -1
    double err;      // factored: ‖Δ − B·A‖ / ‖Δ‖
    double norm;     // ‖Δ‖
    float *values;   // kept whole: the merged values (until the end)
    bool on_cpu;     // factored on the CPU after the device ran out of memory
    bool exact;      // the inputs' factors concatenated (--to-lora exact): no error to measure
    bool as_bias;    // kept whole and written as its layer's lora_B.bias (lm_cmd_lora_finish), not
                     // into modules_to_save (a bias an input saves whole, under --to-lora exact)
} lora_rec;

struct lm_cmd_lora {
    const merge_args *a;
    const lm_model *base;
    const lm_st_desc *descs;
    int64_t n;
    lm_dev *dev;
    lm_progress *p;
    lm_adapter_out *w;
    lm_dtype dtype;
    float *buf;         // the current tensor's merged values (on the host)
    int64_t buf_idx;
    size_t buf_cap;
    float *chunk;       // (LM_LORA_DELTA_CHUNK) the base's values as float32
    // On a device whose memory is not the host's, a matrix's merged values go straight to the
    // device as they come, where Δ is made and factored: the host never holds the matrix (the
    // embedding's change alone is 1 GB in float32 at 1B shapes). Where it does not fit, the
    // host's buffer above as on the CPU.
    float *dbuf;        // the current matrix's merged values, then its Δ, on dev
    bool on_dev;        // the current tensor is in dbuf, not buf
    void *dstage;       // while Δ is made on dev: a chunk of the base's bytes there
    float *dchunk;      // and its values as float32
    int64_t deltas_on_dev, deltas_on_host;  // matrices whose Δ was made on dev, on the host
    lora_rec *rec;
    int64_t n_rec, cap_rec;
    int64_t fallbacks;  // fallback notes: a matrix's Δ made on the host, its factors on the CPU
    int rank;           // the adapter's r: --to-lora's, or with exact the commonest module's
    // seconds, over the matrices: Δ made, then factored (Δ's copy to the device where it was made
    // on the host; of the factorisation, the host's work, the device's and the error's pass)
    double delta_s, factor_s, host_s, device_s, residual_s;
};

// Frees the device's chunk buffers of Δ's making.
static void stage_free(lm_cmd_lora *l)
{
    lm_dev_buf_free(l->dev, l->dstage);
    lm_dev_buf_free(l->dev, l->dchunk);
    l->dstage = NULL;
    l->dchunk = NULL;
}

static lm_status nomem(lm_err *err)
{
    return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
}

// The float32 values of tensor t (free with free()), or NULL with *err set.
static float *values_of(const lm_st_tensor *t, lm_err *err)
{
    return lm_convert_to_f32_new(t->data, t->dtype, t->numel, err);
}

static bool ends_with(const char *s, const char *suffix)
{
    size_t n = strlen(s), m = strlen(suffix);
    return n >= m && strcmp(s + n - m, suffix) == 0;
}

// Whether the base tensor is a matrix written as factors.
static bool is_matrix(const lm_st_tensor *t)
{
    return t->ndim == 2 && ends_with(t->name, ".weight");
}

lm_status lm_cmd_lora_check(const merge_args *a, const lm_model *base, lm_err *err)
{
    if (a->to_lora_energy > 0 && !a->to_lora)
        return lm_err_set(err, LM_ERR_USAGE, "--to-lora-energy needs --to-lora RANK (the most any tensor keeps)%s",
                          a->to_lora_exact ? ", not exact" : "");
    if ((a->to_lora || a->to_lora_exact) && a->vocab)
        return lm_err_set(err, LM_ERR_USAGE, "--to-lora: the merge moves the embeddings' rows to another "
                          "vocabulary (%s), and an adapter is of the base as it is", a->vocab_source);
    if (a->to_lora_exact && a->m->id != LM_MERGE_TASK_ARITHMETIC && a->m->id != LM_MERGE_LINEAR)
        return lm_err_set(err, LM_ERR_USAGE, "--to-lora exact concatenates the inputs' factors, which only "
                          "task-arithmetic and linear merges of LoRA adapters allow, not %s: give a rank",
                          a->m->name);
    if (!a->to_lora)
        return LM_OK;
    for (int64_t i = 0; i < base->n_tensors; i++) {
        const lm_st_tensor *t = base->tensors[i];
        if (!lm_dtype_readable(t->dtype))
            continue;  // copied as it is: never changes
        if (t->ndim > 2 || t->ndim == 0)
            return lm_err_set(err, LM_ERR_UNSUPPORTED, "--to-lora: tensor '%s' has %d dimensions: an adapter holds "
                              "matrices as factors and vectors whole, not this", t->name, t->ndim);
        if (is_matrix(t)) {
            int64_t k = t->shape[0] < t->shape[1] ? t->shape[0] : t->shape[1];
            if (a->to_lora > k)
                return lm_err_set(err, LM_ERR_USAGE, "%s %d: tensor '%s' is [%" PRId64 ", %" PRId64 "], whose "
                                  "rank is at most %" PRId64 ": give a rank from 1 to %" PRId64,
                                  a->extract ? "--rank" : "--to-lora", a->to_lora, t->name, t->shape[0], t->shape[1],
                                  k, k);
        }
    }
    return LM_OK;
}

lm_status lm_cmd_lora_begin(lm_cmd_lora **out, const merge_args *a, const lm_model *base, const lm_st_desc *descs,
                            int64_t n, lm_dev *dev, lm_dtype dtype, lm_progress *p, lm_err *err)
{
    *out = NULL;
    lm_cmd_lora *l = calloc(1, sizeof *l);
    if (!l)
        return nomem(err);
    l->a = a;
    l->base = base;
    l->descs = descs;
    l->n = n;
    l->dev = dev;
    l->p = p;
    l->dtype = dtype;
    l->buf_idx = -1;
    l->rank = a->to_lora;
    lm_status s = lm_adapter_out_new(&l->w, base, a->base, dtype, err);
    if (s != LM_OK) {
        lm_cmd_lora_free(l);
        return s;
    }
    *out = l;
    return LM_OK;
}

void lm_cmd_lora_free(lm_cmd_lora *l)
{
    if (!l)
        return;
    for (int64_t i = 0; i < l->n_rec; i++) {
        free(l->rec[i].name);
        free(l->rec[i].values);
    }
    free(l->rec);
    free(l->buf);
    free(l->chunk);
    lm_dev_buf_free(l->dev, l->dbuf);
    stage_free(l);
    lm_adapter_out_free(l->w);
    free(l);
}

// Whether output tensor idx, once complete, is a matrix whose Δ is factored.
static bool matrix_delta(const lm_cmd_lora *l, int64_t idx)
{
    const lm_st_tensor *bt = l->base->tensors[idx];
    return lm_dtype_readable(bt->dtype) && l->descs[idx].dtype == LM_DTYPE_F32 && is_matrix(bt);
}

// Room on the device for matrix bt's values (size bytes): l->on_dev set where there is, a note
// where there is not (the host's buffer then, as on the CPU).
static lm_status dev_room(lm_cmd_lora *l, const lm_st_tensor *bt, size_t size, lm_err *err)
{
    lm_status s = lm_dev_alloc(l->dev, size, (void **)&l->dbuf, err);
    if (s == LM_OK) {
        l->on_dev = true;
        return LM_OK;
    }
    if (s != LM_ERR_DEVICE_OOM)
        return s;
    lm_progress_note(l->p, "fallback: --to-lora: the change of %s did not fit on %s beside the merge (%s): made "
                     "on the cpu", bt->name, lm_dev_name(l->dev), err->msg);
    lm_err_clear(err);
    l->fallbacks++;
    return LM_OK;
}

lm_status lm_cmd_lora_put(lm_cmd_lora *l, int64_t idx, uint64_t offset, const void *data, uint64_t nbytes,
                          lm_err *err)
{
    if (idx < 0 || idx >= l->n)
        return lm_err_set(err, LM_ERR_USAGE, "--to-lora: output tensor %" PRId64 " of %" PRId64, idx, l->n);
    const lm_st_tensor *bt = l->base->tensors[idx];
    size_t size = (size_t)bt->numel * lm_dtype_bits(l->descs[idx].dtype) / 8;
    if (offset + nbytes > size)
        return lm_err_set(err, LM_ERR_USAGE, "--to-lora: bytes past the end of '%s'", bt->name);
    if (idx != l->buf_idx) {
        lm_dev_buf_free(l->dev, l->dbuf);
        l->dbuf = NULL;
        l->on_dev = false;
        l->buf_idx = -1;
        if (!lm_dev_host_memory(l->dev) && matrix_delta(l, idx)) {
            lm_status s = dev_room(l, bt, size, err);
            if (s != LM_OK)
                return s;
        }
        if (!l->on_dev && size > l->buf_cap) {
            float *g = realloc(l->buf, size);
            if (!g)
                return nomem(err);
            l->buf = g;
            l->buf_cap = size;
        }
        l->buf_idx = idx;
    }
    if (l->on_dev)
        return lm_dev_upload(l->dev, (char *)l->dbuf + offset, data, nbytes, err);
    memcpy((char *)l->buf + offset, data, nbytes);
    return LM_OK;
}

static lm_status add_rec(lm_cmd_lora *l, const lora_rec *r, lm_err *err)
{
    if (l->n_rec == l->cap_rec) {
        int64_t cap = l->cap_rec ? 2 * l->cap_rec : 64;
        lora_rec *g = realloc(l->rec, (size_t)cap * sizeof *g);
        if (!g)
            return nomem(err);
        l->rec = g;
        l->cap_rec = cap;
    }
    l->rec[l->n_rec++] = *r;
    return LM_OK;
}

// Lets the pages of bytes [from, to) of a mapped tensor go from this process's memory (they stay
// in the page cache), as the merge does once it is done with a tensor: reading the base again
// made them resident.
static void release(const lm_st_tensor *t, uint64_t from, uint64_t to)
{
    long page = sysconf(_SC_PAGESIZE);
    uintptr_t lo = ((uintptr_t)t->data + from) & ~(uintptr_t)(page - 1);
    uintptr_t hi = ((uintptr_t)t->data + to + (uintptr_t)page - 1) & ~(uintptr_t)(page - 1);
    if (to > from)
        madvise((void *)lo, hi - lo, MADV_DONTNEED);
}

// Factors Δ (host, rows × cols) on dev into lr: in place where the device's memory is the
// host's, else from a copy on the device.
static lm_status factor_on(lm_dev *dev, const float *delta, int64_t rows, int64_t cols, const lm_lowrank_opts *o,
                           lm_lowrank *lr, lm_err *err)
{
    if (lm_dev_host_memory(dev))
        return lm_lowrank_factor(dev, delta, rows, cols, o, lr, err);
    float *dm = NULL;
    size_t size = (size_t)(rows * cols) * sizeof *dm;
    lm_status s = lm_dev_alloc(dev, size, (void **)&dm, err);
    if (s == LM_OK)
        s = lm_dev_upload(dev, dm, delta, size, err);
    if (s == LM_OK)
        s = lm_lowrank_factor(dev, dm, rows, cols, o, lr, err);
    else
        memset(lr, 0, sizeof *lr);
    lm_dev_buf_free(dev, dm);
    return s;
}

// The current matrix's values on the device (merged, or Δ) to the host's buffer, for the CPU.
static lm_status delta_home(lm_cmd_lora *l, size_t size, lm_err *err)
{
    if (size > l->buf_cap) {
        free(l->buf);  // nothing in it to keep
        l->buf_cap = 0;
        if (!(l->buf = malloc(size)))
            return nomem(err);
        l->buf_cap = size;
    }
    return lm_dev_download(l->dev, l->buf, l->dbuf, size, err);
}

lm_status lm_cmd_lora_done(lm_cmd_lora *l, int64_t idx, lm_err *err)
{
    const lm_st_tensor *bt = l->base->tensors[idx];
    if (!lm_dtype_readable(bt->dtype) || l->descs[idx].dtype != LM_DTYPE_F32)
        return LM_OK;  // copied as it is
    if (idx != l->buf_idx)
        return LM_OK;  // no FT changes it: the merge put nothing
    size_t size = (size_t)bt->numel * sizeof(float), es = lm_dtype_bits(bt->dtype) / 8;
    lm_status s = LM_OK;
    uint64_t let_go = 0;  // bytes of the base's data let go so far
    if (!is_matrix(bt)) {
        // a vector: whether it changed (two NaN are the same), then its merged values kept whole
        bool changed = false;
        for (int64_t c0 = 0; c0 < bt->numel && s == LM_OK && !changed; c0 += BASE_CHUNK) {
            int64_t cnt = bt->numel - c0 < BASE_CHUNK ? bt->numel - c0 : BASE_CHUNK;
            float b[BASE_CHUNK];
            s = lm_convert_to_f32(b, (const char *)bt->data + (size_t)c0 * es, bt->dtype, cnt, err);
            const float *x = l->buf + c0;
            for (int64_t i = 0; i < cnt; i++)
                changed |= x[i] != b[i] && !(isnan(x[i]) && isnan(b[i]));
        }
        release(bt, 0, bt->nbytes);
        if (s != LM_OK || !changed)
            return s;
        lora_rec r = {.ndim = bt->ndim, .shape = {bt->shape[0], bt->ndim == 2 ? bt->shape[1] : 0}, .rank = -1};
        r.name = lm_strdup(bt->name);
        r.values = malloc(size);
        if (!r.name || !r.values || (s = add_rec(l, &r, err)) != LM_OK) {
            free(r.name);
            free(r.values);
            return s != LM_OK ? s : nomem(err);
        }
        memcpy(r.values, l->buf, size);
        return LM_OK;
    }
    // a matrix: Δ = merged − base in place, on the device that holds it (dbuf on l->dev, else buf
    // on the CPU's threads), the base's values a chunk at a time (no second copy of the tensor)
    // and its pages let go as it goes; a Δ of zeros has no factors (the factorisation finds its
    // norm 0)
    lm_dev *cpu = NULL;
    double t0 = lm_now();
    if ((s = lm_dev_cpu_companion(l->dev, &cpu, err)) != LM_OK)
        return s;
    if (l->on_dev) {
        // the base's chunks on the device, now that the merge's unit has let go of its memory;
        // where they do not fit, the merged values come home and Δ is made there
        int64_t elems = bt->numel < LM_LORA_DELTA_CHUNK ? bt->numel : LM_LORA_DELTA_CHUNK;
        s = lm_dev_alloc(l->dev, (size_t)elems * es, &l->dstage, err);
        if (s == LM_OK)
            s = lm_dev_alloc(l->dev, (size_t)elems * sizeof(float), (void **)&l->dchunk, err);
        if (s == LM_ERR_DEVICE_OOM) {
            lm_progress_note(l->p, "fallback: --to-lora: the change of %s: no room on %s for the base's values (%s): "
                             "made on the cpu", bt->name, lm_dev_name(l->dev), err->msg);
            lm_err_clear(err);
            l->fallbacks++;
            stage_free(l);
            s = delta_home(l, size, err);
            lm_dev_buf_free(l->dev, l->dbuf);
            l->dbuf = NULL;
            l->on_dev = false;
        }
        if (s != LM_OK)
            return s;
    }
    if (!l->on_dev && !l->chunk && !(l->chunk = malloc(LM_LORA_DELTA_CHUNK * sizeof *l->chunk)))
        return nomem(err);
    lm_dev *dd = l->on_dev ? l->dev : cpu;
    float *delta = l->on_dev ? l->dbuf : l->buf, *chunk = l->on_dev ? l->dchunk : l->chunk;
    for (int64_t c0 = 0; c0 < bt->numel && s == LM_OK; c0 += LM_LORA_DELTA_CHUNK) {
        int64_t cnt = bt->numel - c0 < LM_LORA_DELTA_CHUNK ? bt->numel - c0 : LM_LORA_DELTA_CHUNK;
        const char *src = (const char *)bt->data + (size_t)c0 * es;
        if (l->on_dev && (s = lm_dev_upload(dd, l->dstage, src, (size_t)cnt * es, err)) != LM_OK)
            break;
        s = lm_dev_to_f32(dd, chunk, l->on_dev ? l->dstage : src, bt->dtype, cnt, err);
        if (s == LM_OK)
            s = lm_dev_axpby(dd, delta + c0, 1.0f, chunk, -1.0f, cnt, err);
        uint64_t done = (uint64_t)(c0 + cnt) * es;
        if (done - let_go >= RELEASE_BYTES) {
            release(bt, let_go, done);
            let_go = done;
        }
    }
    release(bt, let_go, bt->nbytes);
    if (s == LM_OK && l->on_dev)
        s = lm_dev_sync(dd, err);  // Δ made, for the timings
    stage_free(l);
    if (s != LM_OK)
        return s;
    lora_rec r = {.ndim = 2, .shape = {bt->shape[0], bt->shape[1]}};
    if (!(r.name = lm_strdup(bt->name)))
        return nomem(err);
    int64_t rows = bt->shape[0], cols = bt->shape[1];
    lm_lowrank_opts o = {.rank = l->a->to_lora, .energy = l->a->to_lora_energy, .oversample = LM_LORA_OVERSAMPLE,
                         .power_iters = LORA_POWER_ITERS, .key = lm_rng_key(l->a->seed, 0, lm_xxh64(bt->name,
                         strlen(bt->name))), .round_bf16 = l->dtype == LM_DTYPE_BF16,
                         .round_f16 = l->dtype == LM_DTYPE_F16};
    lm_lowrank lr;
    double t1 = lm_now();
    l->delta_s += t1 - t0;
    if (l->on_dev) {
        l->deltas_on_dev++;
        s = lm_lowrank_factor(l->dev, l->dbuf, rows, cols, &o, &lr, err);
    } else {
        l->deltas_on_host++;
        s = factor_on(l->dev, l->buf, rows, cols, &o, &lr, err);
    }
    if (s == LM_ERR_DEVICE_OOM && cpu != l->dev) {
        lm_progress_note(l->p, "fallback: --to-lora: the factors of %s did not fit on %s (%s): made on the cpu",
                         bt->name, lm_dev_name(l->dev), err->msg);
        lm_err_clear(err);
        l->fallbacks++;
        r.on_cpu = true;
        l->host_s += lr.host_s;  // the attempt on the device counts too
        l->device_s += lr.device_s;
        l->residual_s += lr.residual_s;
        s = l->on_dev ? delta_home(l, size, err) : LM_OK;
        if (s == LM_OK)
            s = factor_on(cpu, l->buf, rows, cols, &o, &lr, err);
    }
    lm_dev_buf_free(l->dev, l->dbuf);  // factored: its device memory goes back before the next
    l->dbuf = NULL;
    l->on_dev = false;
    if (!lm_dev_host_memory(l->dev)) {  // nor does the host keep a matrix a fallback brought there
        free(l->buf);
        l->buf = NULL;
        l->buf_cap = 0;
    }
    l->factor_s += lm_now() - t1;
    l->host_s += lr.host_s;
    l->device_s += lr.device_s;
    l->residual_s += lr.residual_s;
    if (s != LM_OK) {
        free(r.name);
        return s;
    }
    if (lr.norm == 0) {  // it did not change
        free(r.name);
        lm_lowrank_free(&lr);
        return LM_OK;
    }
    r.rank = lr.rank;
    r.err = lr.err;
    r.norm = lr.norm;
    const char *dot = strrchr(bt->name, '.');
    char *module = strndup(bt->name, (size_t)(dot - bt->name));
    bool embedding = lm_adapter_out_embedding(l->w, bt->name);
    if (!module)
        s = nomem(err);
    else if (lr.rank > 0)
        s = lm_adapter_out_lora(l->w, module, embedding, rows, cols, lr.rank, lr.b, lr.a, err);
    free(module);
    lm_lowrank_free(&lr);
    if (s == LM_OK)
        s = add_rec(l, &r, err);
    if (s != LM_OK)
        free(r.name);
    return s;
}

// Whether tensor `name` (a bias) belongs to a module that has factors.
static bool module_factored(const lm_cmd_lora *l, const char *name)
{
    const char *dot = strrchr(name, '.');
    size_t ml = dot ? (size_t)(dot - name) : strlen(name);
    for (int64_t i = 0; i < l->n_rec; i++) {
        const lora_rec *r = &l->rec[i];
        if (r->rank > 0 && strncmp(r->name, name, ml) == 0 && strcmp(r->name + ml, ".weight") == 0)
            return true;
    }
    return false;
}

// The weight of the layer whose bias is tensor `name`, where the layer is linear (a matrix that
// is not an embedding), else NULL.
static const lm_st_tensor *linear_weight(const lm_cmd_lora *l, const char *name)
{
    if (!ends_with(name, ".bias"))
        return NULL;
    char *wn = lm_strfmt("%.*s.weight", (int)(strlen(name) - strlen(".bias")), name);
    const lm_st_tensor *wt = wn ? lm_model_find(l->base, wn) : NULL;
    bool linear = wt && is_matrix(wt) && !lm_adapter_out_embedding(l->w, wn);
    free(wn);
    return linear ? wt : NULL;
}

lm_status lm_cmd_lora_finish(lm_cmd_lora *l, const char *dir, lm_err *err)
{
    lm_status s = LM_OK;
    for (int64_t i = 0; s == LM_OK && i < l->n_rec; i++) {
        lora_rec *r = &l->rec[i];
        if (r->rank >= 0 || !r->values)  // factored, or (exact) written already
            continue;
        const lm_st_tensor *bt = lm_model_find(l->base, r->name), *wt = linear_weight(l, r->name);
        if (r->ndim == 1 && wt) {
            // lora_B.bias: the change itself; a layer whose weight did not change gets factors of
            // zeros, rank 1, to carry it (rather than the layer saved whole, weight and all)
            const char *dot = strrchr(r->name, '.');
            char *module = strndup(r->name, (size_t)(dot - r->name));
            float *base = module ? values_of(bt, err) : NULL;
            if (!base) {
                free(module);
                return module ? err->status : nomem(err);
            }
            for (int64_t e = 0; e < bt->numel; e++)
                r->values[e] -= base[e];
            free(base);
            if (s == LM_OK && !module_factored(l, r->name)) {
                float *zeros = calloc((size_t)(wt->shape[0] + wt->shape[1]), sizeof *zeros);
                s = zeros ? lm_adapter_out_lora(l->w, module, false, wt->shape[0], wt->shape[1], 1, zeros,
                                                zeros + wt->shape[0], err)
                          : nomem(err);
                free(zeros);
            }
            if (s == LM_OK)
                s = lm_adapter_out_bias(l->w, module, bt->numel, r->values, err);
            r->as_bias = s == LM_OK;
            free(module);
        } else {
            s = lm_adapter_out_saved(l->w, r->name, r->ndim, r->shape, r->values, err);
        }
        free(r->values);
        r->values = NULL;
    }
    if (s == LM_OK && lm_adapter_out_count(l->w) == 0)
        return lm_err_set(err, LM_ERR_USAGE, "--to-lora: no tensor changes (the merge is BASE itself): there is no "
                          "adapter to write");
    return s == LM_OK ? lm_adapter_out_write(l->w, dir, l->rank, err) : s;
}

// Whether factored tensor `name`'s module was written whole (lm_adapter_out_write: an embedding
// under lora_bias).
static bool made_whole(const lm_cmd_lora *l, const char *name)
{
    const char *dot = strrchr(name, '.');
    char *module = dot ? strndup(name, (size_t)(dot - name)) : NULL;
    bool whole = module && lm_adapter_out_is_whole(l->w, module);
    free(module);
    return whole;
}

void lm_cmd_lora_summary(const lm_cmd_lora *l, lm_progress *p)
{
    int64_t n_f = 0, n_whole = 0, n_bias = 0;
    double worst = 0, sum = 0;
    const char *worst_name = NULL;
    int r_min = 0, r_max = 0;
    for (int64_t i = 0; i < l->n_rec; i++) {
        const lora_rec *r = &l->rec[i];
        if (r->rank < 0) {
            n_bias += r->as_bias;
            n_whole += !r->as_bias;
            continue;
        }
        if (n_f == 0 || r->rank < r_min)
            r_min = r->rank;
        if (r->rank > r_max)
            r_max = r->rank;
        n_f++;
        sum += r->err;
        if (!worst_name || r->err > worst)
            worst = r->err, worst_name = r->name;
    }
    char ranks[48], biases[64] = "";
    if (n_bias)
        snprintf(biases, sizeof biases, "; %" PRId64 " bias change%s as lora_B.bias", n_bias, n_bias == 1 ? "" : "s");
    if (r_min == r_max)
        snprintf(ranks, sizeof ranks, "%d", r_min);
    else
        snprintf(ranks, sizeof ranks, "%d to %d", r_min, r_max);
    if (n_f && l->a->to_lora_exact)
        lm_progress_note(p, "adapter: %" PRId64 " matri%s as the inputs' factors concatenated (rank %s, exact%s%s)%s; %"
                         PRId64 " tensor%s whole", n_f, n_f == 1 ? "x" : "ces", ranks,
                         l->dtype == LM_DTYPE_F32 ? "" : ", then rounded to ",
                         l->dtype == LM_DTYPE_F32 ? "" : lm_cmd_dtype_flag(l->dtype), biases, n_whole,
                         n_whole == 1 ? "" : "s");
    else if (n_f)
        lm_progress_note(p, "adapter: %" PRId64 " matri%s as factors of rank %s, relative error mean %.3g, worst "
                         "%.3g (%s)%s; %" PRId64 " tensor%s whole", n_f, n_f == 1 ? "x" : "ces", ranks,
                         sum / (double)n_f, worst, worst_name, biases, n_whole, n_whole == 1 ? "" : "s");
    else
        lm_progress_note(p, "adapter: no matrix changes%s; %" PRId64 " tensor%s whole", biases, n_whole,
                         n_whole == 1 ? "" : "s");
    for (int64_t i = 0; i < l->n_rec; i++)
        if (l->rec[i].rank > 0 && made_whole(l, l->rec[i].name))
            lm_progress_note(p, "adapter: %s written whole (modules_to_save, BASE plus its factors' product): a "
                             "bias changes, and PEFT takes no embedding LoRA beside lora_bias", l->rec[i].name);
    const char *biasless = lm_adapter_out_biasless(l->w);
    if (biasless)
        lm_progress_note(p, "adapter: lora_bias is on (a bias changes), and %s has no bias in BASE: PEFT applies "
                         "the adapter but its merge_and_unload refuses such a layer (llmerge merges it)", biasless);
}

lm_status lm_cmd_lora_manifest(const lm_cmd_lora *l, cJSON *outputs, lm_err *err)
{
    cJSON *ad = cJSON_AddObjectToObject(outputs, "adapter"), *list = ad ? cJSON_AddArrayToObject(ad, "tensors") : NULL;
    double worst = 0, sum = 0;
    int64_t n_f = 0;
    if (!list || !cJSON_AddStringToObject(ad, "config", "adapter_config.json") ||
        !cJSON_AddStringToObject(ad, "weights", "adapter_model.safetensors") ||
        !cJSON_AddNumberToObject(ad, "rank", l->rank) || !cJSON_AddBoolToObject(ad, "exact", l->a->to_lora_exact) ||
        !(l->a->to_lora_energy > 0 ? cJSON_AddNumberToObject(ad, "energy", l->a->to_lora_energy)
                                   : cJSON_AddNullToObject(ad, "energy")) ||
        !cJSON_AddStringToObject(ad, "dtype", lm_dtype_name(l->dtype)))
        return nomem(err);
    for (int64_t i = 0; i < l->n_rec; i++) {
        const lora_rec *r = &l->rec[i];
        cJSON *o = cJSON_CreateObject();
        if (!o || !cJSON_AddItemToArray(list, o) || !cJSON_AddStringToObject(o, "name", r->name))
            return nomem(err);
        if (r->rank < 0) {  // a bias's change (lora_B.bias), or a tensor saved whole (modules_to_save)
            if (!cJSON_AddStringToObject(o, "as", r->as_bias ? "bias" : "whole"))
                return nomem(err);
            continue;
        }
        // factors, or (an embedding under lora_bias) BASE plus their product, whole
        const char *as = made_whole(l, r->name) ? "whole" : "factors";
        if (r->exact) {  // concatenated: nothing measured
            if (!cJSON_AddStringToObject(o, "as", as) || !cJSON_AddNumberToObject(o, "rank", r->rank))
                return nomem(err);
            continue;
        }
        if (!cJSON_AddStringToObject(o, "as", as) || !cJSON_AddNumberToObject(o, "rank", r->rank) ||
            !cJSON_AddNumberToObject(o, "error", r->err) || !cJSON_AddNumberToObject(o, "norm", r->norm) ||
            !cJSON_AddBoolToObject(o, "cpu_fallback", r->on_cpu))
            return nomem(err);
        n_f++;
        sum += r->err;
        worst = r->err > worst ? r->err : worst;
    }
    int64_t n_factored = 0;
    for (int64_t i = 0; i < l->n_rec; i++)
        n_factored += l->rec[i].rank >= 0;
    cJSON *t = cJSON_AddObjectToObject(ad, "timings");
    if (!t || !cJSON_AddNumberToObject(t, "delta_s", l->delta_s) ||
        !cJSON_AddNumberToObject(t, "factor_s", l->factor_s) || !cJSON_AddNumberToObject(t, "host_s", l->host_s) ||
        !cJSON_AddNumberToObject(t, "device_s", l->device_s) ||
        !cJSON_AddNumberToObject(t, "residual_s", l->residual_s))
        return nomem(err);
    // where the matrices' changes were made: on the device, beside the merge, or on the host
    // (the CPU's merges; on a device, where there was no room)
    if (!cJSON_AddNumberToObject(ad, "deltas_on_device", (double)l->deltas_on_dev) ||
        !cJSON_AddNumberToObject(ad, "deltas_on_host", (double)l->deltas_on_host) ||
        !cJSON_AddNumberToObject(ad, "fallbacks", (double)l->fallbacks))
        return nomem(err);
    if (!cJSON_AddNumberToObject(ad, "factored", (double)n_factored) ||
        !(n_f ? cJSON_AddNumberToObject(ad, "error_mean", sum / (double)n_f) : cJSON_AddNullToObject(ad, "error_mean")) ||
        !(n_f ? cJSON_AddNumberToObject(ad, "error_max", worst) : cJSON_AddNullToObject(ad, "error_max")))
        return nomem(err);
    return LM_OK;
}

// ==== --to-lora exact ==========================================================================

// What the FTs do to one base tensor: the adapters that touch it and how.
typedef struct touch_set {
    int n_lora, n_bias, n_saved;
} touch_set;

static touch_set touches(lm_ft *const *fts, int n_ft, const char *name)
{
    touch_set t = {0};
    for (int i = 0; i < n_ft; i++) {
        lm_adapter_touch how = lm_adapter_lookup(fts[i]->adapter, name, NULL);
        t.n_lora += how == LM_TOUCH_LORA;
        t.n_bias += how == LM_TOUCH_BIAS;
        t.n_saved += how == LM_TOUCH_SAVED;
    }
    return t;
}

lm_status lm_cmd_lora_exact_check(const merge_args *a, const lm_merge_opts *o, const lm_model *base,
                                  lm_ft *const *fts, lm_err *err)
{
    if (!a->to_lora_exact)
        return LM_OK;
    for (int i = 0; i < a->n_ft; i++) {
        const lm_adapter *ad = fts[i]->adapter;
        const char *ft = a->input_name[1 + i];
        if (!ad)
            return lm_err_set(err, LM_ERR_USAGE, "--to-lora exact concatenates the inputs' factors: %s %s is a "
                              "full model, which has none (give a rank)", ft, fts[i]->path);
        if (ad->config.fan_in_fan_out)
            return lm_err_set(err, LM_ERR_UNSUPPORTED, "--to-lora exact: %s %s stores its weights transposed "
                              "(fan_in_fan_out), which the adapter written does not", ft, fts[i]->path);
        for (int64_t m = 0; m < ad->n_modules; m++)
            if (ad->modules[m].magnitude)
                return lm_err_set(err, LM_ERR_USAGE, "--to-lora exact: %s %s is DoRA (module '%s'), whose change "
                                  "is not its factors' product (give a rank)", ft, fts[i]->path,
                                  ad->modules[m].path);
    }
    double *c = malloc((size_t)(a->n_ft > 0 ? a->n_ft : 1) * sizeof *c);
    if (!c)
        return nomem(err);
    lm_status s = LM_OK;
    for (int64_t t = 0; s == LM_OK && t < base->n_tensors; t++) {
        const char *name = base->tensors[t]->name;
        touch_set ts = touches(fts, a->n_ft, name);
        double coef_a = 1;
        if ((s = lm_merge_linear_coefs(o, fts, name, &coef_a, c, err)) != LM_OK)
            break;
        if (coef_a != 1)
            s = lm_err_set(err, LM_ERR_USAGE, "--to-lora exact: the merge scales the base's '%s' by %g (linear's "
                           "weights without normalize), which no adapter can hold (give a rank)", name, coef_a);
        else if (ts.n_saved && (ts.n_lora || ts.n_bias))
            s = lm_err_set(err, LM_ERR_USAGE, "--to-lora exact: '%s' is saved whole by one adapter and changed "
                           "by another's factors, which no concatenation holds (give a rank)", name);
    }
    free(c);
    return s;
}

// Base tensor bt as the adapters' factors concatenated: B = [c_1 s_1 B_1 | c_2 s_2 B_2 | ...],
// A = [A_1; A_2; ...] (an embedding's in the writer's terms: b = c s Aᵀ, a = Bᵀ).
static lm_status concat_lora(lm_cmd_lora *l, lm_ft *const *fts, const lm_st_tensor *bt, const double *c,
                             lm_err *err)
{
    int n_ft = l->a->n_ft, rank = 0;
    const lm_lora_module *first = NULL;
    for (int i = 0; i < n_ft; i++) {
        int64_t idx;
        if (lm_adapter_lookup(fts[i]->adapter, bt->name, &idx) != LM_TOUCH_LORA)
            continue;
        const lm_lora_module *m = &fts[i]->adapter->modules[idx];
        if (first && m->kind != first->kind)
            return lm_err_set(err, LM_ERR_UNSUPPORTED, "--to-lora exact: '%s' is an embedding in one adapter and a "
                              "linear layer in another", bt->name);
        first = first ? first : m;
        rank += (int)m->r;
    }
    bool emb = first->kind == LM_LORA_EMBEDDING;
    int64_t rows = bt->shape[0], cols = bt->shape[1];
    float *b = malloc((size_t)(rows * rank) * sizeof *b), *a = malloc((size_t)(rank * cols) * sizeof *a);
    lm_status s = b && a ? LM_OK : nomem(err);
    int off = 0;
    for (int i = 0; s == LM_OK && i < n_ft; i++) {
        int64_t idx;
        if (lm_adapter_lookup(fts[i]->adapter, bt->name, &idx) != LM_TOUCH_LORA)
            continue;
        const lm_lora_module *m = &fts[i]->adapter->modules[idx];
        int r = (int)m->r;
        float *fa = values_of(m->a, err), *fb = values_of(m->b, err);
        float k = (float)(c[i] * m->scale);
        if (!fa || !fb) {
            s = err->status != LM_OK ? err->status : LM_ERR_NOMEM;
        } else if (!emb) {  // A [r, cols], B [rows, r]
            for (int64_t row = 0; row < rows; row++)
                for (int q = 0; q < r; q++)
                    b[row * rank + off + q] = k * fb[row * r + q];
            memcpy(a + (size_t)off * cols, fa, (size_t)(r * cols) * sizeof *a);
        } else {  // lora_embedding_A [r, rows], lora_embedding_B [cols, r]
            for (int64_t row = 0; row < rows; row++)
                for (int q = 0; q < r; q++)
                    b[row * rank + off + q] = k * fa[q * rows + row];
            for (int q = 0; q < r; q++)
                for (int64_t col = 0; col < cols; col++)
                    a[(off + q) * cols + col] = fb[col * r + q];
        }
        free(fa);
        free(fb);
        off += r;
    }
    const char *dot = strrchr(bt->name, '.');
    char *module = s == LM_OK ? strndup(bt->name, (size_t)(dot - bt->name)) : NULL;
    if (s == LM_OK && !module)
        s = nomem(err);
    if (s == LM_OK)
        s = lm_adapter_out_lora(l->w, module, emb, rows, cols, rank, b, a, err);
    lora_rec rec = {.ndim = 2, .shape = {rows, cols}, .rank = rank, .exact = true};
    if (s == LM_OK && !(rec.name = lm_strdup(bt->name)))
        s = nomem(err);
    if (s == LM_OK && (s = add_rec(l, &rec, err)) != LM_OK)
        free(rec.name);
    free(module);
    free(a);
    free(b);
    return s;
}

lm_status lm_cmd_lora_exact(lm_cmd_lora *l, const lm_merge_opts *o, lm_ft *const *fts, lm_err *err)
{
    int n_ft = l->a->n_ft;
    double *c = malloc((size_t)(n_ft > 0 ? n_ft : 1) * sizeof *c), coef_a = 1;
    lm_status s = c ? LM_OK : nomem(err);
    for (int64_t t = 0; s == LM_OK && t < l->base->n_tensors; t++) {
        const lm_st_tensor *bt = l->base->tensors[t];
        touch_set ts = touches(fts, n_ft, bt->name);
        if (!ts.n_lora && !ts.n_bias && !ts.n_saved)
            continue;
        if ((s = lm_merge_linear_coefs(o, fts, bt->name, &coef_a, c, err)) != LM_OK)
            break;
        if (ts.n_lora) {
            s = concat_lora(l, fts, bt, c, err);
            continue;
        }
        // a bias: Σ c_i s_i lora_B.bias_i; a saved tensor: θ_b + Σ c_i (saved_i − θ_b), whole
        float *sum = calloc((size_t)bt->numel, sizeof *sum), *base = NULL;
        if (!sum)
            s = nomem(err);
        else if (ts.n_saved && !(base = values_of(bt, err)))
            s = err->status != LM_OK ? err->status : LM_ERR_NOMEM;
        for (int i = 0; s == LM_OK && i < n_ft; i++) {
            int64_t idx;
            lm_adapter_touch how = lm_adapter_lookup(fts[i]->adapter, bt->name, &idx);
            if (how == LM_TOUCH_NONE)
                continue;
            const lm_st_tensor *src = how == LM_TOUCH_BIAS ? fts[i]->adapter->modules[idx].bias
                                                           : fts[i]->adapter->saved[idx].t;
            double k = how == LM_TOUCH_BIAS ? c[i] * fts[i]->adapter->modules[idx].scale : c[i];
            float *v = values_of(src, err);
            if (!v) {
                s = err->status != LM_OK ? err->status : LM_ERR_NOMEM;
                break;
            }
            for (int64_t e = 0; e < bt->numel; e++)
                sum[e] += (float)k * (how == LM_TOUCH_SAVED ? v[e] - base[e] : v[e]);
            free(v);
        }
        const char *dot = strrchr(bt->name, '.');
        char *module = strndup(bt->name, (size_t)(dot - bt->name));
        lora_rec rec = {.ndim = bt->ndim, .shape = {bt->shape[0], bt->ndim == 2 ? bt->shape[1] : 0}, .rank = -1};
        if (s == LM_OK && (!module || !(rec.name = lm_strdup(bt->name))))
            s = nomem(err);
        if (s == LM_OK && ts.n_saved) {
            for (int64_t e = 0; e < bt->numel; e++)
                sum[e] += base[e];
            s = lm_adapter_out_saved(l->w, bt->name, bt->ndim, bt->shape, sum, err);
        } else if (s == LM_OK) {
            s = lm_adapter_out_bias(l->w, module, bt->numel, sum, err);
        }
        if (s == LM_OK && (s = add_rec(l, &rec, err)) == LM_OK)
            rec.name = NULL;
        free(rec.name);
        free(module);
        free(sum);
        free(base);
    }
    // r: the commonest rank among the modules (the others in rank_pattern)
    int best = 0, best_n = 0;
    for (int64_t i = 0; i < l->n_rec; i++) {
        int n = 0;
        for (int64_t j = 0; j < l->n_rec; j++)
            n += l->rec[j].rank > 0 && l->rec[j].rank == l->rec[i].rank;
        if (l->rec[i].rank > 0 && (n > best_n || (n == best_n && l->rec[i].rank > best)))
            best = l->rec[i].rank, best_n = n;
    }
    l->rank = best > 0 ? best : 1;
    free(c);
    return s;
}
