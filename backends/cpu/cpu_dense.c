// The CPU backend's fused dense passes (lm_dev_dense_hist, lm_dev_dense_merge): what the
// separate operations do to a tensor's parts, done a chunk at a time from the mapped inputs.
// See cpu_impl.h.
#include "cpu_impl.h"

// ==== fused dense operations ==================================================================
// A full model's τ is computed again from the mapped 16-bit inputs a CHUNK at a time and used
// at once (device.h). Each step is the separate operation's own code on the chunk (conversion,
// cpu_subtract, cpu_hist_win, the top-k rule, the random mask, cpu_combine_values, conversion
// back), so the results are theirs bit for bit.

typedef struct dense_job {
    const void *base;
    lm_dtype base_dt;
    lm_dense_part *parts;
    int k;
    int64_t n;
    // dense_hist: the elements per task, and the lock on the caller's histograms
    int64_t per_task;
    pthread_mutex_t *mu;
    // dense_merge
    void *out;
    lm_dtype out_dt;
    lm_combine_how how;
    int64_t nb;      // blocks
    int64_t *ties;   // (k × 4 nb) per part: each block's ties, then the ties it may keep; the
                     // same for the band's drop
    bool *counted;   // (k) parts whose ties are counted per block
    bool *counted_hi;  // (k) parts whose band's ties are counted per block
    bool *counting;    // (k) either
    bool first;      // the first run over every block (see cpu_dense_merge)
    bool *redo;      // (nb) blocks the first run left to the second
    int64_t *redo_list;  // the second run's blocks, by task
    float *scratch;  // (nb × k × CHUNK) each block's τ of its parts, a chunk at a time
    // LoRA parts: τ made a span of rows at a time (lora_span's tile keeps A's columns in cache
    // across the rows), each task's in its own k × span values of lora
    float *lora;
    int64_t span;
    bool read_kept;  // dense_merge: parts with keep_bits are read from there, not made
} dense_job;

// dst = float32 of elements [lo, lo + cnt) of src, their NaN and Inf added to *nf when it is
// not NULL.
static void dense_load(float *dst, const void *src, lm_dtype dt, int64_t lo, int64_t cnt, lm_nonfinite *nf)
{
    const char *at = (const char *)src + (size_t)lo * (lm_dtype_bits(dt) / 8);
    if (nf)
        lm_convert_to_f32_nf(dst, at, dt, cnt, nf, NULL);
    else
        lm_convert_to_f32(dst, at, dt, cnt, NULL);
}

// t = τ of LoRA part p at elements [lo, lo + cnt): the first row's stretch, the whole rows
// after it as one tile, the last row's stretch.
static void lora_span(float *t, const lm_dense_part *p, int64_t lo, int64_t cnt)
{
    int64_t at = p->col0 + lo, row = at / p->cols, col = at % p->cols, r = p->lora_r, cols = p->cols;
    while (cnt > 0) {
        int64_t rows = col == 0 ? cnt / cols : 0, len = rows ? rows * cols : cols - col < cnt ? cols - col : cnt;
        cpu_lowrank_tile(t, cols, p->lora_b + row * r, r, p->lora_a + col, cols, rows ? rows : 1, r, rows ? cols : len,
                         p->scale, 0.0f);
        t += len;
        cnt -= len;
        row += rows ? rows : 1;
        col = 0;
    }
}

// t = τ of part p at elements [lo, lo + cnt), b holding the base's values there; the NaN and Inf
// among the src values read go to *nf (when not NULL).
static void dense_tau(float *t, const lm_dense_part *p, const float *b, int64_t lo, int64_t cnt, lm_nonfinite *nf)
{
    if (p->tau) {
        memcpy(t, p->tau + lo, (size_t)cnt * sizeof *t);
        return;
    }
    dense_load(t, p->src, p->dt, lo, cnt, nf);
    cpu_subtract(t, b, cnt);
}

// The values of a LoRA span: whole rows where the rows are short, so that A's columns are
// loaded once for several rows, and a bound on the scratch per part and task.
#define LORA_SPAN_ROWS 8
#define LORA_SPAN_MIN 8192
#define LORA_SPAN_MAX 65536

static int64_t lora_span_elems(const lm_dense_part *parts, int k)
{
    int64_t span = 0;
    for (int i = 0; i < k; i++) {
        if (!parts[i].lora_a)
            continue;
        int64_t want = LORA_SPAN_ROWS * parts[i].cols;
        want = want < LORA_SPAN_MIN ? LORA_SPAN_MIN : want > LORA_SPAN_MAX ? LORA_SPAN_MAX : want;
        want = (want + CHUNK - 1) / CHUNK * CHUNK;  // chunks then never cross a kept-value segment
        span = want > span ? want : span;
    }
    return span;
}

// Sets up j->lora for `tasks` tasks when some part is a LoRA pair (j->span 0 when none is).
static lm_status lora_scratch(lm_dev *d, dense_job *j, int64_t tasks, lm_err *err)
{
    cpu_ctx *c = d->ctx;
    j->span = lora_span_elems(j->parts, j->k);
    if (!j->span)
        return LM_OK;
    size_t cells = (size_t)tasks * (size_t)j->k * (size_t)j->span;
    if (cells > c->lora_cells) {
        free(c->lora_tau);
        c->lora_cells = 0;
        if (!(c->lora_tau = malloc(cells * sizeof(float))))
            return lm_err_set(err, LM_ERR_NOMEM, "cpu: out of memory for %zu LoRA products", cells);
        c->lora_cells = cells;
    }
    j->lora = c->lora_tau;
    return LM_OK;
}

// Task t's span of part i in j->lora.
static float *span_of(const dense_job *j, int64_t t, int i)
{
    return j->lora + ((size_t)t * (size_t)j->k + (size_t)i) * (size_t)j->span;
}

// Makes the LoRA parts' τ of elements [s0, s0 + len) in task t's spans (for the parts `use`
// selects, all when NULL).
static void lora_fill(const dense_job *j, int64_t t, int64_t s0, int64_t len, const bool *use)
{
    for (int i = 0; j->span && i < j->k; i++)
        if (j->parts[i].lora_a && (!use || use[i]) && !(j->read_kept && j->parts[i].keep_bits))
            lora_span(span_of(j, t, i), &j->parts[i], s0, len);
}

// ---- kept LoRA candidates (lm_dense_part's keep_bits, keep_off and keep_vals) ---------------
// Chunks never cross a segment (they start on multiples of CHUNK from a segment's start). *pos
// is the index in keep_vals of the next value; the element indices here are the tensor's.

// Keeps chunk x's values (elements [e0, e0 + cnt) of the tensor) whose magnitude bits are at
// least lo; end bounds what the task may write (its own elements' room).
#ifdef HAVE_AVX512_PATH
__attribute__((target("avx512f"))) static void keep_chunk_avx512(const lm_dense_part *p, const float *x, int64_t e0,
                                                                int64_t cnt, uint32_t lo, int64_t *pos, int64_t end)
{
    const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF), low = _mm512_set1_epi32((int)lo);
    for (int64_t e = 0; e < cnt; e += 16) {
        __mmask16 valid = cnt - e >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (cnt - e)) - 1);
        __m512 v = _mm512_maskz_loadu_ps(valid, x + e);
        __mmask16 m = _mm512_mask_cmpge_epu32_mask(valid, _mm512_and_si512(_mm512_castps_si512(v), abs_mask), low);
        if (*pos + 16 <= end) {  // stored whole (a compressing store to memory is slow)
            _mm512_storeu_ps(p->keep_vals + *pos, _mm512_maskz_compress_ps(m, v));
        } else {
            float tmp[16];
            _mm512_storeu_ps(tmp, _mm512_maskz_compress_ps(m, v));
            memcpy(p->keep_vals + *pos, tmp, (size_t)__builtin_popcount(m) * sizeof *tmp);
        }
        p->keep_bits[(e0 + e) / 16] = (uint16_t)m;
        *pos += __builtin_popcount(m);
    }
}

// The kept values back in place: τ at elements [e0, e0 + cnt), zero where none was kept.
__attribute__((target("avx512f"))) static void kept_chunk_avx512(float *t, const lm_dense_part *p, int64_t e0,
                                                                int64_t cnt, int64_t *pos)
{
    for (int64_t e = 0; e < cnt; e += 16) {
        __mmask16 valid = cnt - e >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (cnt - e)) - 1);
        __mmask16 m = p->keep_bits[(e0 + e) / 16];
        // (keep_vals has 16 values of room past its end for this load)
        _mm512_mask_storeu_ps(t + e, valid, _mm512_maskz_expand_ps(m, _mm512_loadu_ps(p->keep_vals + *pos)));
        *pos += __builtin_popcount(m);
    }
}
#endif

static void keep_chunk(const lm_dense_part *p, const float *x, int64_t e0, int64_t cnt, uint32_t lo, int64_t *pos,
                       int64_t end)
{
    if (e0 % LM_DENSE_KEEP_SEGMENT == 0)
        p->keep_off[e0 / LM_DENSE_KEEP_SEGMENT] = *pos;
#ifdef HAVE_AVX512_PATH
    if (__builtin_cpu_supports("avx512f")) {
        keep_chunk_avx512(p, x, e0, cnt, lo, pos, end);
        return;
    }
#endif
    for (int64_t e = 0; e < cnt; e += 16) {
        unsigned m = 0;
        for (int64_t u = 0; u < 16 && e + u < cnt; u++)
            if (lm_abs_bits(x[e + u]) >= lo) {
                m |= 1u << u;
                p->keep_vals[(*pos)++] = x[e + u];
            }
        p->keep_bits[(e0 + e) / 16] = (uint16_t)m;
    }
}

static void kept_chunk(float *t, const lm_dense_part *p, int64_t e0, int64_t cnt, int64_t *pos)
{
    if (e0 % LM_DENSE_KEEP_SEGMENT == 0)
        *pos = p->keep_off[e0 / LM_DENSE_KEEP_SEGMENT];
#ifdef HAVE_AVX512_PATH
    if (__builtin_cpu_supports("avx512f")) {
        kept_chunk_avx512(t, p, e0, cnt, pos);
        return;
    }
#endif
    for (int64_t e = 0; e < cnt; e += 16) {
        unsigned m = p->keep_bits[(e0 + e) / 16];
        for (int64_t u = 0; u < 16 && e + u < cnt; u++)
            t[e + u] = m >> u & 1 ? p->keep_vals[(*pos)++] : 0.0f;
    }
}

// Part i's τ at chunk [c, c + cnt) of the span from s0 that task t is in: a LoRA part's where
// lora_fill made it (changed in place by whoever trims it), any other's made into buf.
static float *chunk_tau(const dense_job *j, int64_t t, int i, float *buf, const float *b, int64_t s0, int64_t c,
                        int64_t cnt, int64_t *kpos, lm_nonfinite *nf)
{
    const lm_dense_part *p = &j->parts[i];
    if (j->read_kept && p->keep_bits) {
        kept_chunk(buf, p, p->first + c, cnt, &kpos[i]);
        return buf;
    }
    if (p->lora_a)
        return span_of(j, t, i) + (c - s0);
    dense_tau(buf, p, b, c, cnt, nf);
    return buf;
}

static void dense_hist_task(void *ctx, int64_t t)
{
    dense_job *j = ctx;
    int64_t lo = t * j->per_task, hi = lo + j->per_task < j->n ? lo + j->per_task : j->n;
    // the keys go to the caller's histograms a list at a time: no tables of the task's own to
    // add up and clear at the end of every call (megabytes per part)
    win_list l;
    l.tables = NULL;
    l.parts = j->parts;
    l.mu = j->mu;
    l.m = 0;
    uint64_t above[j->k];
    int64_t kpos[j->k];  // each part's kept values go from the index of the task's first element
    float b[CHUNK], tau[CHUNK];
    bool use[j->k], make[j->k], base = false;
    int same[j->k];  // a part counted twice (breadcrumbs' two thresholds): the first, whose τ it takes
    memset(above, 0, sizeof above);
    for (int i = 0; i < j->k; i++) {
        const lm_dense_part *p = &j->parts[i];
        use[i] = p->win != NULL;
        base = base || (use[i] && !p->lora_a);
        kpos[i] = p->first + lo;
        same[i] = -1;
        for (int q = 0; use[i] && same[i] < 0 && q < i; q++) {
            const lm_dense_part *o = &j->parts[q];
            if (use[q] && same[q] < 0 && !p->keep_bits && !o->keep_bits && o->src == p->src && o->dt == p->dt &&
                o->tau == p->tau && o->lora_a == p->lora_a && o->lora_b == p->lora_b && o->lora_r == p->lora_r &&
                o->cols == p->cols && o->col0 == p->col0 && o->scale == p->scale)
                same[i] = q;
        }
        make[i] = use[i] && same[i] < 0;
    }
    int64_t span = j->span ? j->span : hi - lo;
    for (int64_t s0 = lo; s0 < hi; s0 += span) {
        int64_t s1 = hi - s0 < span ? hi : s0 + span;
        lora_fill(j, t, s0, s1 - s0, make);
        for (int64_t c = s0; c < s1; c += CHUNK) {
            int64_t cnt = s1 - c < CHUNK ? s1 - c : CHUNK;
            if (base)
                dense_load(b, j->base, j->base_dt, c, cnt, NULL);
            for (int i = 0; i < j->k; i++) {
                if (!make[i])
                    continue;
                const float *x = chunk_tau(j, t, i, tau, b, s0, c, cnt, kpos, NULL);
                for (int q = i; q < j->k; q++) {  // the part and those that take its τ
                    const lm_dense_part *p = &j->parts[q];
                    if (q != i && same[q] != i)
                        continue;
                    above[q] +=
                        cpu_hist_win(&l, (uint32_t)q << WIN_PART_SHIFT, x, cnt, p->lo_bin, (uint32_t)p->n_win);
                    if (p->keep_bits)
                        keep_chunk(p, x, p->first + c, cnt, p->lo_bin << 16, &kpos[q], p->first + hi);
                }
            }
        }
    }
    cpu_win_flush(&l);
    pthread_mutex_lock(j->mu);  // integer sums: the order does not matter
    for (int i = 0; i < j->k; i++)
        if (use[i])
            *j->parts[i].above += above[i];
    pthread_mutex_unlock(j->mu);
}

#define HIST_TASKS_PER_THREAD 4

lm_status cpu_dense_hist(lm_dev *d, const void *base, lm_dtype base_dt, lm_dense_part *parts, int k, int64_t n,
                         lm_err *err)
{
    cpu_ctx *c = d->ctx;
    if (k > WIN_MAX_PARTS)
        return lm_err_set(err, LM_ERR_UNSUPPORTED, "dense_hist: %d parts, at most %d at once", k, WIN_MAX_PARTS);
    bool any = false;
    for (int i = 0; i < k; i++)
        any = any || parts[i].win;
    // A few tasks per thread: a thread slowed by other work (the input hasher shares the
    // cores) leaves the others something to take instead of waiting for it at the end.
    int64_t tasks = (int64_t)lm_pool_threads(c->pool) * HIST_TASKS_PER_THREAD;
    if (tasks > n_blocks(n))
        tasks = n_blocks(n);
    if (tasks < 1 || !any)
        return LM_OK;
    // tasks start on a segment of the kept values
    int64_t per_task =
        ((n + tasks - 1) / tasks + LM_DENSE_KEEP_SEGMENT - 1) / LM_DENSE_KEEP_SEGMENT * LM_DENSE_KEEP_SEGMENT;
    tasks = (n + per_task - 1) / per_task;
    dense_job j = {.base = base, .base_dt = base_dt, .parts = parts, .k = k, .n = n, .per_task = per_task,
                   .mu = &c->hist_mu};
    lm_status s = lora_scratch(d, &j, tasks, err);
    if (s != LM_OK)
        return s;
    lm_pool_run(c->pool, tasks, dense_hist_task, &j);
    return LM_OK;
}

// ==== the Gram pass ===========================================================================

typedef struct gram_job {
    dense_job j;          // the parts and the LoRA spans (j.per_task rows of cols per task)
    int64_t rows, cols;
    double *out;          // (rows × n_dots)
    int n_dots;
    bool bf16;            // gram_rows_bf16 takes the rows
} gram_job;

typedef double v8d __attribute__((vector_size(8 * sizeof(double))));
typedef float v8f __attribute__((vector_size(8 * sizeof(float))));

static inline __attribute__((always_inline)) void load_v8d(v8d *v, const float *x)
{
    v8f f;
    memcpy(&f, x, sizeof f);
    *v = __builtin_convertvector(f, v8d);
}

// One element's base value b and τ values t[0..k), at lane l, added to each dot product's lane
// (lanes in lm_dev_dense_gram's order of the products).
static inline void gram_one(double (*lanes)[LM_DOT_LANES], int l, float b, const float *t, int k)
{
    double bd = b;
    int q = 0;
    lanes[q++][l] += bd * bd;
    for (int a = 0; a < k; a++)
        lanes[q++][l] += bd * (double)t[a];
    for (int a = 0; a < k; a++)
        for (int c = 0; c <= a; c++)
            lanes[q++][l] += (double)t[a] * (double)t[c];
}

// Element i of a stretch: its base value and τ from b and t.
static inline void gram_at(double (*lanes)[LM_DOT_LANES], int l, const float *b, const float *const *t, int k,
                           int64_t i)
{
    float tv[k > 0 ? k : 1];
    for (int a = 0; a < k; a++)
        tv[a] = t[a][i];
    gram_one(lanes, l, b[i], tv, k);
}

// The products of one vector of base values and k of τ added to the lanes' vectors acc[q][h].
static inline __attribute__((always_inline)) void gram_vec(v8d (*acc)[2], int h, const v8d *b, const v8d *tv,
                                                           const int k)
{
    v8d bv = *b;
    int q = 0;
    acc[q++][h] += bv * bv;
    for (int a = 0; a < k; a++)
        acc[q++][h] += bv * tv[a];
    for (int a = 0; a < k; a++)
        for (int c = 0; c <= a; c++)
            acc[q++][h] += tv[a] * tv[c];
}

// Every dot product of a stretch of n elements of one row, its first at column col, added to
// the lanes as cpu_dot_lanes adds each (the products are exact, so the bits are the same), but
// all in one sweep: each value converted once, and the lanes of every product in registers
// (k a constant where this is inlined, so that the loops over the products unroll).
static inline __attribute__((always_inline)) void gram_lanes_k(double (*lanes)[LM_DOT_LANES], const float *b,
                                                               const float *const *t, const int k, int64_t n,
                                                               int64_t col)
{
    const int nd = 1 + k + k * (k + 1) / 2;
    int64_t i = 0;
    for (; i < n && (col + i) % LM_DOT_LANES; i++)  // up to the next lane 0
        gram_at(lanes, (int)((col + i) % LM_DOT_LANES), b, t, k, i);
    v8d acc[nd][2];
    memcpy(acc, lanes, sizeof acc);
    for (; i + LM_DOT_LANES <= n; i += LM_DOT_LANES)
        for (int h = 0; h < 2; h++) {
            v8d bv, tv[k > 0 ? k : 1];
            load_v8d(&bv, b + i + 8 * h);
            for (int a = 0; a < k; a++)
                load_v8d(&tv[a], t[a] + i + 8 * h);
            gram_vec(acc, h, &bv, tv, k);
        }
    memcpy(lanes, acc, sizeof acc);
    for (int l = 0; i < n; i++, l++)
        gram_at(lanes, l, b, t, k, i);
}

typedef uint16_t v8h __attribute__((vector_size(8 * sizeof(uint16_t))));
typedef uint32_t v8u __attribute__((vector_size(8 * sizeof(uint32_t))));

// Eight BF16 values as float32: their 16 bits above 16 zero bits, lm_convert_to_f32's.
static inline __attribute__((always_inline)) void load_bf16(v8f *v, const uint16_t *x)
{
    v8h h;
    memcpy(&h, x, sizeof h);
    v8u u = __builtin_convertvector(h, v8u) << 16;
    memcpy(v, &u, sizeof *v);
}

// gram_lanes_k for a whole row of n elements read straight from BF16 inputs: the base b and
// the fine-tunes f[0..k), τ = f − b in float32 as cpu_subtract makes it.
static inline __attribute__((always_inline)) void gram_bf16_k(double (*lanes)[LM_DOT_LANES], const uint16_t *b,
                                                              const uint16_t *const *f, const int k, int64_t n)
{
    const int nd = 1 + k + k * (k + 1) / 2;
    v8d acc[nd][2];
    memset(acc, 0, sizeof acc);
    int64_t i = 0;
    for (; i + LM_DOT_LANES <= n; i += LM_DOT_LANES)
        for (int h = 0; h < 2; h++) {
            v8f bf, tf;
            v8d bv, tv[k];
            load_bf16(&bf, b + i + 8 * h);
            bv = __builtin_convertvector(bf, v8d);
            for (int a = 0; a < k; a++) {
                load_bf16(&tf, f[a] + i + 8 * h);
                tf -= bf;
                tv[a] = __builtin_convertvector(tf, v8d);
            }
            gram_vec(acc, h, &bv, tv, k);
        }
    memcpy(lanes, acc, sizeof acc);
    for (int l = 0; i < n; i++, l++) {
        float bv = lm_bf16_to_f32(b[i]), tv[k];
        for (int a = 0; a < k; a++)
            tv[a] = lm_bf16_to_f32(f[a][i]) - bv;
        gram_one(lanes, l, bv, tv, k);
    }
}

// Rows [r0, r1) of a slab whose base and parts are all BF16 inputs, 1 to 3 parts: each row's
// products in one sweep over the mapped inputs, no chunk buffers.
LM_VECTOR_CLONES static void gram_rows_bf16(const uint16_t *base, const lm_dense_part *parts, int k, int64_t r0,
                                            int64_t r1, int64_t cols, double *out, int n_dots)
{
    double lanes[n_dots][LM_DOT_LANES];
    for (int64_t r = r0; r < r1; r++) {
        const uint16_t *f[3] = {NULL, NULL, NULL};
        for (int a = 0; a < k; a++)
            f[a] = (const uint16_t *)parts[a].src + r * cols;
        const uint16_t *b = base + r * cols;
        switch (k) {
        case 1: gram_bf16_k(lanes, b, f, 1, cols); break;
        case 2: gram_bf16_k(lanes, b, f, 2, cols); break;
        default: gram_bf16_k(lanes, b, f, 3, cols); break;
        }
        for (int q = 0; q < n_dots; q++)
            out[r * n_dots + q] = cpu_dot_lanes_sum(lanes[q]);
    }
}

// Whether a slab takes gram_rows_bf16.
static bool gram_all_bf16(lm_dtype base_dt, const lm_dense_part *parts, int k)
{
    bool ok = base_dt == LM_DTYPE_BF16 && k >= 1 && k <= 3;
    for (int a = 0; ok && a < k; a++)
        ok = parts[a].src && parts[a].dt == LM_DTYPE_BF16 && !parts[a].tau && !parts[a].lora_a;
    return ok;
}

LM_VECTOR_CLONES static void gram_lanes(double (*lanes)[LM_DOT_LANES], const float *b, const float *const *t, int k,
                                        int64_t n, int64_t col)
{
    _Static_assert(LM_DOT_LANES == 16, "two vectors of eight lanes");
    switch (k) {
    case 1: gram_lanes_k(lanes, b, t, 1, n, col); break;
    case 2: gram_lanes_k(lanes, b, t, 2, n, col); break;
    case 3: gram_lanes_k(lanes, b, t, 3, n, col); break;
    default: {  // each product on its own
        int q = 0;
        cpu_dot_lanes(lanes[q++], b, b, n, col);
        for (int a = 0; a < k; a++)
            cpu_dot_lanes(lanes[q++], b, t[a], n, col);
        for (int a = 0; a < k; a++)
            for (int c = 0; c <= a; c++)
                cpu_dot_lanes(lanes[q++], t[a], t[c], n, col);
    }
    }
}

// Rows [r0, r1) of the slab: base and τ made a chunk at a time as the merge makes them, each
// product added to its row's lanes (lm_dev_row_dot's order).
static void dense_gram_task(void *ctx, int64_t t)
{
    gram_job *g = ctx;
    dense_job *j = &g->j;
    int k = j->k;
    int64_t r0 = t * j->per_task, r1 = r0 + j->per_task < g->rows ? r0 + j->per_task : g->rows;
    int64_t lo = r0 * g->cols, hi = r1 * g->cols;
    if (g->bf16) {
        gram_rows_bf16(j->base, j->parts, k, r0, r1, g->cols, g->out, g->n_dots);
        return;
    }
    float b[CHUNK], buf[k > 0 ? k : 1][CHUNK];
    float *tp[k > 0 ? k : 1];
    int64_t kpos[k > 0 ? k : 1];
    double lanes[g->n_dots][LM_DOT_LANES];  // the current row's
    memset(lanes, 0, sizeof lanes);
    int64_t span = j->span ? j->span : hi - lo;
    for (int64_t s0 = lo; s0 < hi; s0 += span) {
        int64_t s1 = hi - s0 < span ? hi : s0 + span;
        lora_fill(j, t, s0, s1 - s0, NULL);
        for (int64_t c = s0; c < s1; c += CHUNK) {
            int64_t cnt = s1 - c < CHUNK ? s1 - c : CHUNK;
            dense_load(b, j->base, j->base_dt, c, cnt, NULL);
            for (int i = 0; i < k; i++)
                tp[i] = chunk_tau(j, t, i, buf[i], b, s0, c, cnt, kpos, NULL);
            // the chunk's rows: each stretch adds to its row's lanes, a row's end gives its sums
            for (int64_t e0 = 0; e0 < cnt;) {
                int64_t row = (c + e0) / g->cols, end = (row + 1) * g->cols - c;
                int64_t e1 = end < cnt ? end : cnt, col = c + e0 - row * g->cols;
                const float *ts[k > 0 ? k : 1];
                for (int i = 0; i < k; i++)
                    ts[i] = tp[i] + e0;
                gram_lanes(lanes, b + e0, ts, k, e1 - e0, col);
                if (e1 == end) {
                    for (int q = 0; q < g->n_dots; q++)
                        g->out[row * g->n_dots + q] = cpu_dot_lanes_sum(lanes[q]);
                    memset(lanes, 0, sizeof lanes);
                }
                e0 = e1;
            }
        }
    }
}

lm_status cpu_dense_gram(lm_dev *d, const void *base, lm_dtype base_dt, lm_dense_part *parts, int k, int64_t rows,
                         int64_t cols, double *out, lm_err *err)
{
    cpu_ctx *c = d->ctx;
    if (rows <= 0 || cols <= 0)
        return LM_OK;
    int64_t per = (BLOCK + cols - 1) / cols;  // rows of about a block of entries per task
    int64_t tasks = (rows + per - 1) / per;
    gram_job g = {.j = {.base = base, .base_dt = base_dt, .parts = parts, .k = k, .n = rows * cols, .per_task = per},
                  .rows = rows, .cols = cols, .out = out, .n_dots = 1 + k + k * (k + 1) / 2,
                  .bf16 = gram_all_bf16(base_dt, parts, k)};
    lm_status s = lora_scratch(d, &g.j, tasks, err);
    if (s != LM_OK)
        return s;
    lm_pool_run(c->pool, tasks, dense_gram_task, &g);
    return LM_OK;
}

// The top-k rule on a chunk whose ties are kept one by one while *left lasts (the block where
// a part's budget runs out).
static void keep_counted(float *t, int64_t cnt, uint32_t thr, int64_t *left)
{
    for (int64_t e = 0; e < cnt; e++) {
        uint32_t bits = lm_abs_bits(t[e]);
        bool keep = bits > thr;
        if (bits == thr && *left > 0) {
            keep = true;
            --*left;
        }
        t[e] = keep ? t[e] : 0.0f;
    }
}

// The band's drop of the top k' on a chunk: magnitudes above hi are zeroed, and those equal
// to it while *left lasts (drop 1: every one, 0: none, -1: counted).
static void drop_top(float *t, int64_t cnt, uint32_t hi, int drop, int64_t *left)
{
    if (drop < 0) {
        for (int64_t e = 0; e < cnt; e++) {
            uint32_t bits = lm_abs_bits(t[e]);
            bool gone = bits > hi;
            if (bits == hi && *left > 0) {
                gone = true;
                --*left;
            }
            t[e] = gone ? 0.0f : t[e];
        }
        return;
    }
    if (hi > 0x7FFFFFFFu)  // above every magnitude: nothing dropped (and hi + 1 would wrap)
        return;
    uint32_t floor = drop ? hi : hi + 1;
    for (int64_t e = 0; e < cnt; e++)
        t[e] = lm_abs_bits(t[e]) >= floor ? 0.0f : t[e];
}

// keep: 1 every tie kept, 0 none, -1 counted (left says how many); drop_hi and left_hi the
// same for the band's drop.
static void dense_sparsify(float *t, const lm_dense_part *p, int keep, int64_t *left, int drop_hi, int64_t *left_hi,
                           int64_t first, int64_t cnt)
{
    if (p->trim) {
        if (keep < 0)
            keep_counted(t, cnt, p->thr_bits, left);
        else if (keep == 0 && p->thr_bits == 0xFFFFFFFFu)  // no magnitude exceeds it
            memset(t, 0, (size_t)cnt * sizeof *t);
        else
            cpu_topk_keep(t, 0, cnt, keep ? p->thr_bits : p->thr_bits + 1, true);
        if (p->band)
            drop_top(t, cnt, p->hi_bits, drop_hi, left_hi);
    } else if (p->drop) {
        for (int64_t e = 0; e < cnt; e++)
            if (!lm_rng_keep(p->key, first + e, p->keep_below))
                t[e] = 0.0f;
    }
    if (p->rescale != 1.0f)
        for (int64_t e = 0; e < cnt; e++)
            t[e] = p->rescale * t[e] + 0.0f * t[e];
}

// What a block does with the ties of one rule of a part (the trim's kept, the band's dropped):
// 1 every tie, 0 none, -1 the first *left of them. ties: the rule's count per block, then each
// block's share (nb each), NULL when the rule is not counted. In the first run a counted rule
// takes every tie: the blocks where it has one are redone once the shares are known.
static int tie_rule(bool on, int64_t allowed, bool first, const int64_t *ties, int64_t nb, int64_t blk, int64_t *left)
{
    *left = 0;
    if (!on || allowed == LM_TIES_ALL || (first && ties))
        return 1;
    if (!ties)
        return 0;
    if (ties[nb + blk] == ties[blk])
        return 1;
    if (ties[nb + blk] == 0)
        return 0;
    *left = ties[nb + blk];
    return -1;
}

static void dense_merge_task(void *ctx, int64_t task)
{
    dense_job *j = ctx;
    int k = j->k;
    int64_t blk = j->first ? task : j->redo_list[task];
    bool deferred = false;  // the first run found a tie of a counted part here
    int64_t lo = blk * BLOCK, hi = lo + BLOCK < j->n ? lo + BLOCK : j->n;
    size_t es = lm_dtype_bits(j->out_dt) / 8;
    float b[CHUNK], o[CHUNK], w[k];
    float (*t)[CHUNK] = (float (*)[CHUNK])(j->scratch + (size_t)blk * (size_t)k * CHUNK);
    float *tp[k];
    int keep[k], drop_hi[k];
    int64_t left[k], left_hi[k], kpos[k];
    // The block's NaN and Inf: added to the operation's sums by the run that merges the whole
    // block (a block the first run defers is counted again from the start in the second).
    lm_nonfinite nb_base = {0, 0}, nb_out = {0, 0}, nb_src[k];
    lm_nonfinite *c_base = j->how.base_nf ? &nb_base : NULL, *c_out = j->how.out_nf ? &nb_out : NULL, *c_src[k];
    for (int i = 0; i < k; i++) {
        nb_src[i] = (lm_nonfinite){0, 0};
        c_src[i] = j->parts[i].nf ? &nb_src[i] : NULL;
    }
    for (int i = 0; i < k; i++) {
        const lm_dense_part *p = &j->parts[i];
        // the trim's counts, then the band's (no array when nothing is counted)
        const int64_t *ties = j->ties ? j->ties + (size_t)i * 4 * j->nb : NULL;
        w[i] = p->weight;
        keep[i] = tie_rule(p->trim, p->ties_allowed, j->first, j->counted[i] ? ties : NULL, j->nb, blk, &left[i]);
        drop_hi[i] = tie_rule(p->band, p->hi_allowed, j->first, j->counted_hi[i] ? ties + 2 * j->nb : NULL, j->nb, blk,
                              &left_hi[i]);
    }
    int64_t span = j->span ? j->span : hi - lo;
    for (int64_t s0 = lo; s0 < hi; s0 += span) {
        int64_t s1 = hi - s0 < span ? hi : s0 + span;
        lora_fill(j, blk, s0, s1 - s0, deferred ? j->counting : NULL);
        for (int64_t c = s0; c < s1; c += CHUNK) {
            int64_t cnt = s1 - c < CHUNK ? s1 - c : CHUNK;
            dense_load(b, j->base, j->base_dt, c, cnt, c_base);
            for (int i = 0; j->first && j->ties && i < k; i++) {
                if (!j->counting[i])
                    continue;
                tp[i] = chunk_tau(j, blk, i, t[i], b, s0, c, cnt, kpos, c_src[i]);
                int64_t *at = j->ties + (size_t)i * 4 * j->nb + blk;
                int64_t n = j->counted[i] ? cpu_count_ties(tp[i], 0, cnt, j->parts[i].thr_bits) : 0;
                // the band's ties counted on τ before the trim: where the two thresholds are
                // the same, the trim keeps a prefix of the ties that holds the band's budget
                int64_t n_hi = j->counted_hi[i] ? cpu_count_ties(tp[i], 0, cnt, j->parts[i].hi_bits) : 0;
                at[0] += n;
                at[2 * j->nb] += n_hi;
                deferred = deferred || n > 0 || n_hi > 0;
            }
            if (deferred)  // only the counts matter in this run now
                continue;
            for (int i = 0; i < k; i++) {
                const lm_dense_part *p = &j->parts[i];
                if (!(j->first && j->ties && j->counting[i]))
                    tp[i] = chunk_tau(j, blk, i, t[i], b, s0, c, cnt, kpos, c_src[i]);
                dense_sparsify(tp[i], p, keep[i], &left[i], drop_hi[i], &left_hi[i], p->first + c, cnt);
            }
            if (j->how.linear) {
                float bs = j->how.base_scale;
                if (j->how.scale_base)
                    for (int64_t e = 0; e < cnt; e++)
                        o[e] = bs * b[e] + 0.0f * b[e];
                else
                    memcpy(o, b, (size_t)cnt * sizeof *o);
                for (int i = 0; i < k; i++)
                    for (int64_t e = 0; e < cnt; e++)
                        o[e] = 1.0f * o[e] + w[i] * tp[i][e];
            } else {
                cpu_combine_values(o, b, (const float *const *)tp, w, k, cnt, j->how.sign, j->how.normalize,
                                   j->how.lambda);
            }
            if (c_out)
                lm_convert_from_f32_nf((char *)j->out + (size_t)c * es, j->out_dt, o, cnt, c_out, NULL);
            else
                lm_convert_from_f32((char *)j->out + (size_t)c * es, j->out_dt, o, cnt, NULL);
        }
    }
    if (deferred) {
        j->redo[blk] = true;
        return;
    }
    if (c_base)
        cpu_nf_add(j->how.base_nf, c_base);
    if (c_out)
        cpu_nf_add(j->how.out_nf, c_out);
    for (int i = 0; i < k; i++)
        if (c_src[i])
            cpu_nf_add(j->parts[i].nf, c_src[i]);
}

// Parts whose ties are counted keep the first ties_allowed of them in index order, so a block's
// share depends on the ties in the blocks before it. Ties are rare (they are values equal to
// the threshold), so every block runs first as if it kept all of its ties, counting them; a
// block that finds one stops merging and only counts. The budgets are then shared out in block
// order, and those few blocks run again.
lm_status cpu_dense_merge(lm_dev *d, void *out, lm_dtype out_dt, const void *base, lm_dtype base_dt,
                          lm_dense_part *parts, int k, int64_t n, lm_combine_how how,
                          const lm_dev_side *side, lm_err *err)
{
    int64_t nb = n_blocks(n);
    dense_job j = {.base = base, .base_dt = base_dt, .parts = parts, .k = k, .n = n, .out = out, .out_dt = out_dt,
                   .how = how, .nb = nb, .first = true, .read_kept = true};
    bool counted[k > 0 ? k : 1], counted_hi[k > 0 ? k : 1], counting[k > 0 ? k : 1], any = false;
    for (int i = 0; i < k; i++) {
        // Counting is needed only where some ties are kept and some not; a budget of 0 keeps
        // none of them, LM_TIES_ALL all.
        counted[i] = parts[i].trim && parts[i].ties_allowed != LM_TIES_ALL && parts[i].ties_allowed > 0;
        counted_hi[i] = parts[i].trim && parts[i].band && parts[i].hi_allowed != LM_TIES_ALL &&
                        parts[i].hi_allowed > 0 && parts[i].hi_bits <= 0x7FFFFFFFu;
        counting[i] = counted[i] || counted_hi[i];
        any = any || counting[i];
        parts[i].ties_used = 0;
        parts[i].hi_used = 0;
    }
    j.counted = counted;
    j.counted_hi = counted_hi;
    j.counting = counting;
    lm_err own = {0};
    lm_status s = lora_scratch(d, &j, nb, &own);
    size_t nb1 = (size_t)(nb ? nb : 1);
    j.scratch = malloc(nb1 * (size_t)(k > 0 ? k : 1) * CHUNK * sizeof(float));
    if (any) {
        j.ties = calloc((size_t)k * 4 * nb1, sizeof(int64_t));
        j.redo = calloc(nb1, sizeof(bool));
        j.redo_list = malloc(nb1 * sizeof(int64_t));
    }
    if (s != LM_OK || !j.scratch || (any && (!j.ties || !j.redo || !j.redo_list))) {
        if (side)  // (its errors are the caller's; this one is set after it, and wins)
            side->fn(side->ctx);
        s = s != LM_OK ? lm_err_set(err, s, "%s", own.msg) : lm_err_set(err, LM_ERR_NOMEM, "cpu: out of memory");
        goto done;
    }
    lm_pool_run_side(pool_of(d), nb, dense_merge_task, &j, side ? side->fn : NULL, side ? side->ctx : NULL);
    if (any) {
        // The ties each block may keep: the budget goes to the lowest indices first.
        for (int i = 0; i < k; i++) {
            int64_t *ties = j.ties + (size_t)i * 4 * nb, left = parts[i].ties_allowed;
            for (int64_t b = 0; counted[i] && b < nb; b++) {
                int64_t take = ties[b] < left ? ties[b] : left;
                ties[nb + b] = take;
                left -= take;
                parts[i].ties_used += take;
            }
            int64_t *hties = ties + 2 * nb, left_hi = parts[i].hi_allowed;
            for (int64_t b = 0; counted_hi[i] && b < nb; b++) {
                int64_t take = hties[b] < left_hi ? hties[b] : left_hi;
                hties[nb + b] = take;
                left_hi -= take;
                parts[i].hi_used += take;
            }
        }
        int64_t n_redo = 0;
        for (int64_t b = 0; b < nb; b++)
            if (j.redo[b])
                j.redo_list[n_redo++] = b;
        j.first = false;
        lm_pool_run(pool_of(d), n_redo, dense_merge_task, &j);
    }
done:
    free(j.redo_list);
    free(j.redo);
    free(j.ties);
    free(j.scratch);
    return s;
}
