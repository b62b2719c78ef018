// test_device's comparison of the forward pass's device operations (gather and add rows,
// RMSNorm, rotary embedding, attention, SiLU, NLL) with the CPU backend's, on its harness.
// Included by test_device.c only.
#ifndef LM_TEST_DEVICE_FORWARD_H
#define LM_TEST_DEVICE_FORWARD_H

#include "device_harness.h"
#ifdef LLMERGE_HAVE_CUDA
#include "kernels.h"  // LM_CUDA_ATTN_MAX_HEAD_DIM
#endif

// ==== the forward-pass operations against the CPU =============================================

// gather_rows (a copy: the bits of the table on every device, zeros for ids outside it) and
// add_rows (one IEEE addition per element: the same bits on every device).
static void h_gather_add(harness *h, int64_t rows, int64_t cols)
{
    char what[64];
    int64_t table_rows = rows + 3, n = rows * cols;
    float *table = hmalloc((size_t)(table_rows * cols) * 4), *want = hmalloc((size_t)n * 4),
          *got = hmalloc((size_t)n * 4), *b = hmalloc((size_t)cols * 4);
    int32_t *ids = hmalloc((size_t)rows * 4);
    fill_special(table, table_rows * cols);
    fill(b, cols);
    for (int64_t r = 0; r < rows; r++)  // a few ids outside the table, both sides
        ids[r] = (int32_t)(lm_mix64(state++) % (uint64_t)(table_rows + 4)) - 2;
    if (rows > 1)
        ids[rows - 1] = (int32_t)table_rows;
    float *dt = put(h, table, (size_t)(table_rows * cols) * 4), *dout = put(h, NULL, (size_t)n * 4),
          *db = put(h, b, (size_t)cols * 4);
    int32_t *dids = put(h, ids, (size_t)rows * 4);
    CHECK_OK(lm_dev_gather_rows(h->cpu, want, table, table_rows, cols, ids, rows, &h->err), &h->err);
    snprintf(what, sizeof what, "gather_rows %lld x %lld", (long long)rows, (long long)cols);
    if (dt && dout && dids && DEV_OK(h, lm_dev_gather_rows(h->dev, dout, dt, table_rows, cols, dids, rows, &h->err)) &&
        get(h, got, dout, (size_t)n * 4)) {
        check_close(h, ST_GATHER, what, got, want, n, 0.0);
        CHECK_MSG(same_bits(got, want, n), "%s on %s is not the table's bits", what, lm_dev_name(h->dev));
    }
    // the bias on the gathered rows, specials included (NaN + b, inf + b)
    CHECK_OK(lm_dev_add_rows(h->cpu, want, b, rows, cols, &h->err), &h->err);
    snprintf(what, sizeof what, "add_rows %lld x %lld", (long long)rows, (long long)cols);
    if (dt && dout && db && DEV_OK(h, lm_dev_add_rows(h->dev, dout, db, rows, cols, &h->err)) &&
        get(h, got, dout, (size_t)n * 4)) {
        check_close(h, ST_ADD_ROWS, what, got, want, n, 0.0);
        int64_t differ = 0;
        for (int64_t i = 0; i < n; i++)
            differ += !(lm_f32_bits(got[i]) == lm_f32_bits(want[i]) || (isnan(got[i]) && isnan(want[i])));
        CHECK_MSG(differ == 0, "%s on %s: %lld sums differ from the CPU's", what, lm_dev_name(h->dev),
                  (long long)differ);
    }
    lm_dev_buf_free(h->dev, dt);
    lm_dev_buf_free(h->dev, dout);
    lm_dev_buf_free(h->dev, db);
    lm_dev_buf_free(h->dev, dids);
    free(table);
    free(want);
    free(got);
    free(b);
    free(ids);
}

// RMSNorm into another buffer and in place, on rows of very different scales (one all zeros,
// where only eps keeps the gain finite).
static void h_rmsnorm(harness *h, int64_t rows, int64_t cols)
{
    char what[64];
    int64_t n = rows * cols;
    float *x = hmalloc((size_t)n * 4), *w = hmalloc((size_t)cols * 4), *want = hmalloc((size_t)n * 4),
          *got = hmalloc((size_t)n * 4);
    fill(x, n);
    fill(w, cols);
    static const float scales[] = {1.0f, 1e3f, 1e-20f, 0.0f, 37.5f};
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++)
            x[r * cols + c] *= scales[r % 5];
    float *dx = put(h, x, (size_t)n * 4), *dw = put(h, w, (size_t)cols * 4), *dout = put(h, NULL, (size_t)n * 4);
    CHECK_OK(lm_dev_rmsnorm(h->cpu, want, x, w, rows, cols, 1e-5f, &h->err), &h->err);
    snprintf(what, sizeof what, "rmsnorm %lld x %lld", (long long)rows, (long long)cols);
    if (dx && dw && dout && DEV_OK(h, lm_dev_rmsnorm(h->dev, dout, dx, dw, rows, cols, 1e-5f, &h->err)) &&
        get(h, got, dout, (size_t)n * 4))
        check_close(h, ST_RMSNORM, what, got, want, n, 1e-5);
    snprintf(what, sizeof what, "rmsnorm in place %lld x %lld", (long long)rows, (long long)cols);
    if (dx && dw && DEV_OK(h, lm_dev_rmsnorm(h->dev, dx, dx, dw, rows, cols, 1e-5f, &h->err)) &&
        get(h, got, dx, (size_t)n * 4))
        check_close(h, ST_RMSNORM, what, got, want, n, 1e-5);
    lm_dev_buf_free(h->dev, dx);
    lm_dev_buf_free(h->dev, dw);
    lm_dev_buf_free(h->dev, dout);
    free(x);
    free(w);
    free(want);
    free(got);
}

// Rotary embedding of rows × heads heads at positions far apart (large angles), with the
// frequencies of theta 10000.
static void h_rope(harness *h, int64_t rows, int64_t heads, int64_t head_dim)
{
    char what[80];
    int64_t n = rows * heads * head_dim, half = head_dim / 2;
    float *x = hmalloc((size_t)n * 4), *got = hmalloc((size_t)n * 4), *inv = hmalloc((size_t)(half ? half : 1) * 4);
    int32_t *pos = hmalloc((size_t)rows * 4);
    fill(x, n);
    for (int64_t i = 0; i < half; i++)
        inv[i] = (float)pow(10000.0, -2.0 * (double)i / (double)head_dim);
    for (int64_t r = 0; r < rows; r++)
        pos[r] = r % 3 == 0 ? (int32_t)r : (int32_t)(lm_mix64(state++) % 40000);
    float *dx = put(h, x, (size_t)n * 4), *dinv = put(h, inv, (size_t)(half ? half : 1) * 4);
    int32_t *dpos = put(h, pos, (size_t)rows * 4);
    CHECK_OK(lm_dev_rope(h->cpu, x, rows, heads, head_dim, pos, inv, &h->err), &h->err);
    snprintf(what, sizeof what, "rope %lld rows, %lld heads of %lld", (long long)rows, (long long)heads,
             (long long)head_dim);
    if (dx && dinv && dpos && DEV_OK(h, lm_dev_rope(h->dev, dx, rows, heads, head_dim, dpos, dinv, &h->err)) &&
        get(h, got, dx, (size_t)n * 4))
        check_close(h, ST_ROPE, what, got, x, n, 1e-5);
    lm_dev_buf_free(h->dev, dx);
    lm_dev_buf_free(h->dev, dinv);
    lm_dev_buf_free(h->dev, dpos);
    free(x);
    free(got);
    free(inv);
    free(pos);
}

// Causal attention over sequences of the given lengths packed back to back, with `heads` query
// heads reading kv_heads (GQA) and, when window > 0, a sliding window (start = the later of the
// sequence's first row and r − window + 1, as forward.c stages it). Two starts are broken on
// purpose, one below 0 and one beyond its row, which both clamp.
static void h_attention(harness *h, const int64_t *lens, int n_seqs, int64_t heads, int64_t kv_heads,
                        int64_t head_dim, int64_t window)
{
    char what[96];
    int64_t rows = 0;
    for (int i = 0; i < n_seqs; i++)
        rows += lens[i];
    int64_t nq = rows * heads * head_dim, nkv = rows * kv_heads * head_dim;
    float *q = hmalloc((size_t)nq * 4), *k = hmalloc((size_t)nkv * 4), *v = hmalloc((size_t)nkv * 4),
          *want = hmalloc((size_t)nq * 4), *got = hmalloc((size_t)nq * 4);
    int32_t *start = hmalloc((size_t)rows * 4);
    fill(q, nq);
    fill(k, nkv);
    fill(v, nkv);
    for (int64_t i = 0; i < nq; i++)
        q[i] *= 4.0f;  // peaked softmaxes, so the running maximum changes often
    for (int i = 0, row = 0; i < n_seqs; i++)
        for (int64_t p = 0; p < lens[i]; p++, row++)
            start[row] = (int32_t)(window > 0 && p >= window ? row - window + 1 : row - p);
    if (rows > 3) {
        start[rows - 1] = -3;
        start[2] = (int32_t)rows + 5;
    }
    float scale = (float)(1.0 / sqrt((double)head_dim));
    float *dq = put(h, q, (size_t)nq * 4), *dk = put(h, k, (size_t)nkv * 4), *dv = put(h, v, (size_t)nkv * 4),
          *dout = put(h, NULL, (size_t)nq * 4);
    int32_t *dstart = put(h, start, (size_t)rows * 4);
    CHECK_OK(lm_dev_attention(h->cpu, want, q, k, v, start, rows, heads, kv_heads, head_dim, scale, &h->err), &h->err);
    snprintf(what, sizeof what, "attention %lld rows in %d sequences, %lld/%lld heads of %lld, window %lld",
             (long long)rows, n_seqs, (long long)heads, (long long)kv_heads, (long long)head_dim, (long long)window);
    if (dq && dk && dv && dout && dstart &&
        DEV_OK(h, lm_dev_attention(h->dev, dout, dq, dk, dv, dstart, rows, heads, kv_heads, head_dim, scale,
                                   &h->err)) &&
        get(h, got, dout, (size_t)nq * 4))
        check_close(h, ST_ATTENTION, what, got, want, nq, 1e-5);
    lm_dev_buf_free(h->dev, dq);
    lm_dev_buf_free(h->dev, dk);
    lm_dev_buf_free(h->dev, dv);
    lm_dev_buf_free(h->dev, dout);
    lm_dev_buf_free(h->dev, dstart);
    free(q);
    free(k);
    free(v);
    free(want);
    free(got);
    free(start);
}

// SiLU-gated products over gates from −40 to 40, where e^−x under- and overflows.
static void h_silu(harness *h, int64_t n)
{
    char what[64];
    float *g = hmalloc((size_t)n * 4), *u = hmalloc((size_t)n * 4), *got = hmalloc((size_t)n * 4);
    fill(g, n);
    fill(u, n);
    for (int64_t i = 0; i < n; i++)
        g[i] *= 40.0f;
    float *dg = put(h, g, (size_t)n * 4), *du = put(h, u, (size_t)n * 4);
    CHECK_OK(lm_dev_silu_mul(h->cpu, g, u, n, &h->err), &h->err);
    snprintf(what, sizeof what, "silu_mul n=%lld", (long long)n);
    if (dg && du && DEV_OK(h, lm_dev_silu_mul(h->dev, dg, du, n, &h->err)) && get(h, got, dg, (size_t)n * 4))
        check_close(h, ST_SILU, what, got, g, n, 1e-5);
    lm_dev_buf_free(h->dev, dg);
    lm_dev_buf_free(h->dev, du);
    free(g);
    free(u);
    free(got);
}

// Negative log-likelihoods of rows × cols logits, with targets outside [0, cols) (nll 0), the
// row maximum as the target, and a row of huge logits.
static void h_nll(harness *h, int64_t rows, int64_t cols)
{
    char what[64];
    int64_t n = rows * cols;
    float *x = hmalloc((size_t)n * 4), *want = hmalloc((size_t)rows * 4), *got = hmalloc((size_t)rows * 4);
    int32_t *tg = hmalloc((size_t)rows * 4);
    fill(x, n);
    for (int64_t i = 0; i < n; i++)
        x[i] *= 12.0f;
    for (int64_t r = 0; r < rows; r++)
        tg[r] = (int32_t)(lm_mix64(state++) % (uint64_t)(cols + 2)) - 1;  // −1 and cols: none
    if (rows > 2) {
        for (int64_t c = 0; c < cols; c++)
            x[cols + c] = 1e30f + (float)c * 1e24f;
        tg[1] = (int32_t)(cols - 1);  // the row's maximum
        tg[2] = -7;
    }
    float *dx = put(h, x, (size_t)n * 4), *dnll = put(h, NULL, (size_t)rows * 4);
    int32_t *dtg = put(h, tg, (size_t)rows * 4);
    CHECK_OK(lm_dev_nll_rows(h->cpu, want, x, tg, rows, cols, &h->err), &h->err);
    snprintf(what, sizeof what, "nll_rows %lld x %lld", (long long)rows, (long long)cols);
    if (dx && dnll && dtg && DEV_OK(h, lm_dev_nll_rows(h->dev, dnll, dx, dtg, rows, cols, &h->err)) &&
        get(h, got, dnll, (size_t)rows * 4))
        check_close(h, ST_NLL, what, got, want, rows, 1e-5);
    lm_dev_buf_free(h->dev, dx);
    lm_dev_buf_free(h->dev, dnll);
    lm_dev_buf_free(h->dev, dtg);
    free(x);
    free(want);
    free(got);
    free(tg);
}

// Every forward-pass operation on shapes around the CUDA kernels' block sizes (rows and columns
// of 1, odd widths, more keys than a tile of 128, head_dim above 128 so a thread owns several
// dimensions), GQA and several packed sequences, and the refusals.
static void forward_against_cpu(harness *h)
{
    const int64_t shapes[][2] = {{1, 1}, {3, 67}, {37, 300}, {5, 4099}};
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
        h_gather_add(h, shapes[i][0], shapes[i][1]);
        h_rmsnorm(h, shapes[i][0], shapes[i][1]);
        h_nll(h, shapes[i][0], shapes[i][1]);
        h_silu(h, shapes[i][0] * shapes[i][1]);
    }
    h_rope(h, 1, 1, 2);
    h_rope(h, 37, 6, 16);
    h_rope(h, 9, 2, 130);
    h_rope(h, 4, 3, 258);

    const int64_t one[] = {1}, packed[] = {1, 130, 7, 300, 2}, two[] = {5, 3}, long_seq[] = {600};
    h_attention(h, one, 1, 1, 1, 1, 0);
    h_attention(h, packed, 5, 6, 2, 20, 0);      // GQA 3:1, tiles of keys across sequences
    h_attention(h, packed, 5, 4, 1, 5, 0);       // GQA 4:1, an odd head_dim
    h_attention(h, two, 2, 2, 2, 200, 0);        // head_dim above a block's threads
    h_attention(h, long_seq, 1, 2, 1, 64, 0);    // several tiles of keys
    h_attention(h, packed, 5, 4, 2, 16, 100);    // a sliding window
    float *d = put(h, NULL, 64);
    if (d)
        CHECK_FAILS(lm_dev_attention(h->dev, d, d, d, d, (int32_t *)(void *)d, 1, 3, 2, 1, 1.0f, &h->err),
                    LM_ERR_USAGE, "multiple", &h->err);
    lm_dev_buf_free(h->dev, d);
#ifdef LLMERGE_HAVE_CUDA
    // the CUDA kernel's limit: the largest head_dim runs, one more is refused, not a crash
    if (strncmp(lm_dev_name(h->dev), "cuda", 4) == 0) {
        const int64_t three[] = {3};
        h_attention(h, three, 1, 1, 1, LM_CUDA_ATTN_MAX_HEAD_DIM, 0);
        int64_t hd = LM_CUDA_ATTN_MAX_HEAD_DIM + 2;
        float *big = put(h, NULL, (size_t)hd * 4);
        int32_t zero = 0, *dz = put(h, &zero, 4);
        if (big && dz)
            CHECK_FAILS(lm_dev_attention(h->dev, big, big, big, big, dz, 1, 1, 1, hd, 1.0f, &h->err),
                        LM_ERR_UNSUPPORTED, "attention with head_dim", &h->err);
        lm_dev_buf_free(h->dev, big);
        lm_dev_buf_free(h->dev, dz);
    }
#endif
}

#endif
