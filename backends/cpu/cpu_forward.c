// The CPU backend's forward-pass operations (embedding rows, bias, RMSNorm, rotary embedding,
// causal attention, SiLU gate, NLL). See cpu_impl.h.
#include "cpu_impl.h"

// ==== the forward pass ========================================================================
// Row-wise operations: each row (or (row, head) pair for attention) is one task's, computed
// by the same fixed sequence of float operations wherever it lies in a batch, so a packed
// batch gives every sequence the values it gets alone, on any thread count.

// Rows per task for row-wise work on rows of `cols` elements: about BLOCK elements a task.
static int64_t rows_per_task(int64_t cols)
{
    return cols >= BLOCK ? 1 : BLOCK / (cols > 0 ? cols : 1);
}

typedef struct rows_job {
    float *out;
    const float *x, *w;
    const int32_t *ids;
    int64_t rows, cols, table_rows, per;
    float eps;
} rows_job;

static void gather_task(void *ctx, int64_t t)
{
    rows_job *j = ctx;
    int64_t r0 = t * j->per, r1 = r0 + j->per < j->rows ? r0 + j->per : j->rows;
    for (int64_t r = r0; r < r1; r++) {
        float *o = j->out + r * j->cols;
        int64_t id = j->ids[r];
        if (id >= 0 && id < j->table_rows)
            memcpy(o, j->x + id * j->cols, (size_t)j->cols * sizeof *o);
        else
            memset(o, 0, (size_t)j->cols * sizeof *o);
    }
}

lm_status cpu_gather_rows(lm_dev *d, float *out, const float *table, int64_t table_rows, int64_t cols,
                          const int32_t *ids, int64_t n, lm_err *err)
{
    (void)err;
    rows_job j = {.out = out, .x = table, .ids = ids, .rows = n, .cols = cols, .table_rows = table_rows,
                  .per = rows_per_task(cols)};
    lm_pool_run(pool_of(d), (n + j.per - 1) / j.per, gather_task, &j);
    return LM_OK;
}

static void add_rows_task(void *ctx, int64_t t)
{
    rows_job *j = ctx;
    int64_t r0 = t * j->per, r1 = r0 + j->per < j->rows ? r0 + j->per : j->rows;
    for (int64_t r = r0; r < r1; r++) {
        float *restrict y = j->out + r * j->cols;
        const float *restrict b = j->w;
        for (int64_t c = 0; c < j->cols; c++)
            y[c] += b[c];
    }
}

lm_status cpu_add_rows(lm_dev *d, float *y, const float *b, int64_t rows, int64_t cols, lm_err *err)
{
    (void)err;
    rows_job j = {.out = y, .w = b, .rows = rows, .cols = cols, .per = rows_per_task(cols)};
    lm_pool_run(pool_of(d), (rows + j.per - 1) / j.per, add_rows_task, &j);
    return LM_OK;
}

static void rmsnorm_task(void *ctx, int64_t t)
{
    rows_job *j = ctx;
    int64_t r0 = t * j->per, r1 = r0 + j->per < j->rows ? r0 + j->per : j->rows;
    for (int64_t r = r0; r < r1; r++) {
        const float *x = j->x + r * j->cols;
        float *o = j->out + r * j->cols;
        double ss = 0;
        for (int64_t c = 0; c < j->cols; c++)
            ss += (double)x[c] * x[c];
        float g = (float)(1.0 / sqrt(ss / (double)j->cols + (double)j->eps));
        for (int64_t c = 0; c < j->cols; c++)
            o[c] = j->w[c] * (x[c] * g);
    }
}

lm_status cpu_rmsnorm(lm_dev *d, float *out, const float *x, const float *w, int64_t rows, int64_t cols,
                      float eps, lm_err *err)
{
    (void)err;
    if (cols <= 0)
        return LM_OK;
    rows_job j = {.out = out, .x = x, .w = w, .rows = rows, .cols = cols, .per = rows_per_task(cols), .eps = eps};
    lm_pool_run(pool_of(d), (rows + j.per - 1) / j.per, rmsnorm_task, &j);
    return LM_OK;
}

typedef struct rope_job {
    float *x;
    const int32_t *pos;
    const float *inv_freq;
    int64_t heads, head_dim;
} rope_job;

#define ROPE_CHUNK 256  // cos and sin of this many frequencies are computed once per row

static void rope_task(void *ctx, int64_t r)
{
    rope_job *j = ctx;
    int64_t half = j->head_dim / 2, width = j->heads * j->head_dim;
    float *row = j->x + r * width, fpos = (float)j->pos[r];
    float cs[ROPE_CHUNK], sn[ROPE_CHUNK];
    for (int64_t i0 = 0; i0 < half; i0 += ROPE_CHUNK) {
        int64_t cnt = half - i0 < ROPE_CHUNK ? half - i0 : ROPE_CHUNK;
        for (int64_t i = 0; i < cnt; i++) {
            float a = fpos * j->inv_freq[i0 + i];  // rounded to float32, as Hugging Face's
            cs[i] = (float)cos((double)a);
            sn[i] = (float)sin((double)a);
        }
        for (int64_t h = 0; h < j->heads; h++) {
            float *lo = row + h * j->head_dim + i0, *hi = lo + half;
            for (int64_t i = 0; i < cnt; i++) {
                float a = lo[i], b = hi[i];
                lo[i] = a * cs[i] - b * sn[i];
                hi[i] = b * cs[i] + a * sn[i];
            }
        }
    }
}

lm_status cpu_rope(lm_dev *d, float *x, int64_t rows, int64_t heads, int64_t head_dim, const int32_t *pos,
                   const float *inv_freq, lm_err *err)
{
    (void)err;
    rope_job j = {x, pos, inv_freq, heads, head_dim};
    lm_pool_run(pool_of(d), rows, rope_task, &j);
    return LM_OK;
}

typedef struct attn_job {
    float *out;
    const float *q, *k, *v;
    const int32_t *start;
    int64_t heads, group, head_dim;  // group: query heads per kv head
    float scale;
    int failed;                      // a task could not get its scratch memory
} attn_job;

// The dot product in eight interleaved partial sums, added in a fixed order: the compiler
// can vectorise it, and the result is the same wherever it runs.
static float dot8(const float *restrict a, const float *restrict b, int64_t n)
{
    float s[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int l = 0; l < 8; l++)
            s[l] += a[i + l] * b[i + l];
    float tail = 0;
    for (; i < n; i++)
        tail += a[i] * b[i];
    return (((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]))) + tail;
}

#define ATTN_STACK 512  // head_dim up to this keeps its accumulator on the stack

// One query row and head: an online softmax over the keys of its sequence up to itself (the
// running maximum m and sum l rescale the accumulator whenever m grows).
static void attn_task(void *ctx, int64_t t)
{
    attn_job *j = ctx;
    int64_t r = t / j->heads, h = t % j->heads, g = h / j->group, hd = j->head_dim;
    int64_t qw = j->heads * hd, kw = (j->heads / j->group) * hd;
    const float *q = j->q + r * qw + h * hd;
    float stack[ATTN_STACK], *acc = hd <= ATTN_STACK ? stack : malloc((size_t)hd * sizeof *acc);
    if (!acc) {
        __atomic_store_n(&j->failed, 1, __ATOMIC_RELAXED);
        return;
    }
    int64_t s0 = j->start[r];
    if (s0 < 0 || s0 > r)
        s0 = s0 < 0 ? 0 : r;
    float m = -INFINITY, l = 0.0f;
    for (int64_t i = 0; i < hd; i++)
        acc[i] = 0.0f;
    for (int64_t c = s0; c <= r; c++) {
        const float *kc = j->k + c * kw + g * hd, *vc = j->v + c * kw + g * hd;
        float s = dot8(q, kc, hd) * j->scale;
        if (s > m) {
            float f = expf(m - s);  // 0 for the first key (m = -inf)
            l *= f;
            for (int64_t i = 0; i < hd; i++)
                acc[i] *= f;
            m = s;
        }
        float p = expf(s - m);
        l += p;
        for (int64_t i = 0; i < hd; i++)
            acc[i] += p * vc[i];
    }
    float *o = j->out + r * qw + h * hd;
    for (int64_t i = 0; i < hd; i++)
        o[i] = acc[i] / l;
    if (acc != stack)
        free(acc);
}

lm_status cpu_attention(lm_dev *d, float *out, const float *q, const float *k, const float *v,
                        const int32_t *start, int64_t rows, int64_t heads, int64_t kv_heads,
                        int64_t head_dim, float scale, lm_err *err)
{
    if (heads <= 0 || kv_heads <= 0 || heads % kv_heads != 0)
        return lm_err_set(err, LM_ERR_USAGE, "cpu: attention with %lld heads and %lld kv heads (heads must be a "
                          "multiple of kv heads)", (long long)heads, (long long)kv_heads);
    attn_job j = {out, q, k, v, start, heads, heads / kv_heads, head_dim, scale, 0};
    lm_pool_run(pool_of(d), rows * heads, attn_task, &j);
    if (j.failed)
        return lm_err_set(err, LM_ERR_NOMEM, "cpu: out of memory for attention scratch (head_dim %lld)",
                          (long long)head_dim);
    return LM_OK;
}

typedef struct silu_job {
    float *g;
    const float *u;
    int64_t n;
} silu_job;

static void silu_task(void *ctx, int64_t blk)
{
    silu_job *j = ctx;
    int64_t lo = blk * BLOCK, hi = lo + BLOCK < j->n ? lo + BLOCK : j->n;
    for (int64_t i = lo; i < hi; i++) {
        float x = j->g[i];
        j->g[i] = x / (1.0f + expf(-x)) * j->u[i];
    }
}

lm_status cpu_silu_mul(lm_dev *d, float *gate, const float *up, int64_t n, lm_err *err)
{
    (void)err;
    silu_job j = {gate, up, n};
    lm_pool_run(pool_of(d), n_blocks(n), silu_task, &j);
    return LM_OK;
}

typedef struct nll_job {
    float *nll;
    const float *logits;
    const int32_t *targets;
    int64_t cols;
} nll_job;

static void nll_task(void *ctx, int64_t r)
{
    nll_job *j = ctx;
    const float *x = j->logits + r * j->cols;
    int64_t t = j->targets[r];
    if (t < 0 || t >= j->cols) {
        j->nll[r] = 0.0f;
        return;
    }
    float m = x[0];
    for (int64_t c = 1; c < j->cols; c++)
        m = x[c] > m ? x[c] : m;
    double sum = 0;
    for (int64_t c = 0; c < j->cols; c++)
        sum += (double)expf(x[c] - m);
    j->nll[r] = (float)((double)m + log(sum) - (double)x[t]);
}

lm_status cpu_nll_rows(lm_dev *d, float *nll, const float *logits, const int32_t *targets, int64_t rows,
                       int64_t cols, lm_err *err)
{
    (void)err;
    nll_job j = {nll, logits, targets, cols};
    lm_pool_run(pool_of(d), rows, nll_task, &j);
    return LM_OK;
}
