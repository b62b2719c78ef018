// The merge pass of the methods with coefficients (method.h's coeffs: linear, slerp, nuslerp,
// multislerp, karcher, model_stock) and of nearswap: a pass computing the tensor's Gram matrix
// where the method reads it (the dot products of θ_b and the parts' τ, on the device, slab by
// slab), the method's coefficients from it, then the linear pass (lm_eng_merge_linear) or the
// fused dense pass with those coefficients. See merge_int.h for the engine's files.
#include <stdlib.h>
#include <string.h>

#include "merge_int.h"
#include "signals.h"

// acc += Σ_r x[r, :]·y[r, :] over the slab's rows, added in row order (rows[] is scratch); with
// per_row, each row's sum also goes to per_row[r · stride] (the row's Gram matrix entry); with
// per_col, each column's sum is added to per_col[c] (lm_dev_col_dot).
static lm_status add_dot(engine *e, wset *ws, const float *x, const float *y, int64_t nr, int64_t cols, double *rows,
                         double *acc, double *per_row, int64_t stride, double *per_col)
{
    lm_status s = per_col ? lm_dev_col_dot(ws->dev, x, y, nr, cols, per_col, e->err) : LM_OK;
    if (s == LM_OK)
        s = lm_dev_row_dot(ws->dev, x, y, nr, cols, rows, e->err);
    for (int64_t r = 0; s == LM_OK && r < nr; r++) {
        *acc += rows[r];
        if (per_row)
            per_row[r * stride] = rows[r];
    }
    return s;
}

// The Gram pass fused on a device that has it (the CPU): per slab, every row's dot products
// made from the mapped inputs as the fused merge pass reads them (lm_dev_dense_gram), no
// buffers filled; the same sums, in the same order, as the pass below.
static lm_status gram_fused(engine *e, wset *ws, const lm_st_tensor *bt, part *parts, int k, int64_t slab_rows,
                            double *g, double *grows)
{
    int s1 = e->o->n_ft + 1, n_dots = 1 + k + k * (k + 1) / 2;
    int64_t rows = tensor_rows(bt), cols = bt->numel / rows, cap = slab_rows < rows ? slab_rows : rows;
    double *dots = malloc((size_t)cap * (size_t)n_dots * sizeof *dots);
    if (!dots)
        return lm_err_set(e->err, LM_ERR_NOMEM, "out of memory");
    // where each of a row's dot products goes in the Gram matrix
    int at[n_dots];
    int q = 0;
    at[q++] = 0;
    for (int i = 0; i < k; i++)
        at[q++] = 1 + parts[i].ft;
    for (int i = 0; i < k; i++)
        for (int j = 0; j <= i; j++)
            at[q++] = (1 + parts[i].ft) * s1 + 1 + parts[j].ft;
    lm_dense_part d[k > 0 ? k : 1];
    lm_status s = LM_OK;
    for (int64_t r0 = 0; r0 < rows && s == LM_OK; r0 += slab_rows) {
        int64_t nr = rows - r0 < slab_rows ? rows - r0 : slab_rows, first = r0 * cols;
        if (r0 > 0 && lm_interrupted()) {
            s = lm_interrupted_err(e->err);
            break;
        }
        memset(d, 0, sizeof d);
        e->bytes_in += (uint64_t)(nr * cols) * esize(bt->dtype);
        for (int i = 0; i < k; i++)
            e->bytes_in += (uint64_t)(nr * cols) * lm_eng_dense_source(e, ws, &parts[i], bt, first, &d[i]);
        s = lm_dev_dense_gram(ws->dev, (const char *)bt->data + (size_t)first * esize(bt->dtype), bt->dtype, d, k, nr,
                              cols, dots, e->err);
        for (int64_t r = 0; s == LM_OK && r < nr; r++)
            for (int x = 0; x < n_dots; x++) {
                g[at[x]] += dots[r * n_dots + x];
                if (grows)
                    grows[(r0 + r) * s1 * s1 + at[x]] = dots[r * n_dots + x];
            }
        if (rows > slab_rows)
            lm_eng_release_slab(e, bt, parts, k, r0, nr);
    }
    free(dots);
    return s;
}

// g ((n_ft + 1)², zeroed by the caller) = the dot products of the base and the parts' τ over
// the whole tensor: g[0] = θ_b·θ_b, g[1 + ft] = θ_b·τ_ft, g[(1 + a)(n_ft + 1) + 1 + b] = τ_a·τ_b,
// and their mirror images. Each is a sum of per-row sums in row order, the same bits however the
// tensor is cut into slabs (lm_dev_row_dot). When the tensor is one slab its base values and τ
// stay in the buffers (*have_slab).
static lm_status gram_pass(engine *e, wset *ws, const lm_st_tensor *bt, part *parts, int k, int64_t slab_rows,
                           double *g, double *grows, double *const *gcols, bool *have_slab)
{
    int s1 = e->o->n_ft + 1;
    int64_t rows = tensor_rows(bt), cols = bt->numel / rows;
    bool one_slab = slab_rows >= rows;
    bool fused = !gcols && lm_eng_fused(e, ws->dev, bt, parts, k) && lm_dev_supports(ws->dev, LM_OP_DENSE);
    double *row = fused ? NULL : malloc((size_t)(slab_rows < rows ? slab_rows : rows) * sizeof *row);
    if (!fused && !row)
        return lm_err_set(e->err, LM_ERR_NOMEM, "out of memory");
    lm_status s = fused ? gram_fused(e, ws, bt, parts, k, slab_rows, g, grows) : LM_OK;
    one_slab = one_slab && !fused;  // the fused pass leaves nothing in the buffers
    for (int64_t r0 = 0; r0 < rows && s == LM_OK && !fused; r0 += slab_rows) {
        int64_t nr = rows - r0 < slab_rows ? rows - r0 : slab_rows;
        if (r0 > 0 && lm_interrupted()) {
            s = lm_interrupted_err(e->err);
            break;
        }
        int64_t st = (int64_t)s1 * s1;  // a row's Gram matrix, in grows
        double *gr = grows ? grows + r0 * st : NULL;
        if ((s = lm_eng_load_base(e, ws, bt, r0, nr)) != LM_OK ||
            (s = add_dot(e, ws, ws->base_buf, ws->base_buf, nr, cols, row, &g[0], gr, st, gcols ? gcols[0] : NULL)) !=
                LM_OK)
            break;
        for (int i = 0; s == LM_OK && i < k; i++)
            s = lm_eng_tau_for(e, ws, &parts[i], bt, r0, nr, ws->base_buf);
        for (int i = 0; s == LM_OK && i < k; i++) {
            int a = 1 + parts[i].ft;
            s = add_dot(e, ws, ws->base_buf, parts[i].tau, nr, cols, row, &g[a], gr ? gr + a : NULL, st,
                        gcols ? gcols[a] : NULL);
            for (int j = 0; s == LM_OK && j <= i; j++) {
                int b = a * s1 + 1 + parts[j].ft;
                s = add_dot(e, ws, parts[i].tau, parts[j].tau, nr, cols, row, &g[b], gr ? gr + b : NULL, st,
                            gcols ? gcols[b] : NULL);
            }
        }
        if (!one_slab)
            lm_eng_release_slab(e, bt, parts, k, r0, nr);
    }
    free(row);
    if (s != LM_OK)
        return s;
    // filled: row 0 (θ_b·τ) and the lower triangle of the τ·τ block; mirrored across the diagonal
    for (int64_t r = -1; r < (grows ? rows : 0); r++) {
        double *m = r < 0 ? g : grows + r * s1 * s1;
        for (int a = 1; a < s1; a++) {
            m[a * s1] = m[a];
            for (int b = 1; b < a; b++)
                m[b * s1 + a] = m[a * s1 + b];
        }
    }
    *have_slab = one_slab;
    return LM_OK;
}

// The merge pass with coefficients per row: θ[r] = a[r]·θ_b[r] + Σ_i c_i[r]·τ_i[r] (c[i] the
// coefficients of parts[i], rows values each), or per column with by_col (cols values each),
// every τ made in its buffer (a LoRA's too). With have_slab the tensor is one slab whose base
// and τ are in the buffers already.
static lm_status merge_rows(engine *e, wset *ws, int64_t idx, const lm_st_desc *desc, const lm_st_tensor *bt,
                            part *parts, int k, int64_t slab_rows, bool have_slab, bool by_col, const float *a,
                            float *const *c, XXH64_state_t *hash)
{
    int64_t rows = tensor_rows(bt), cols = bt->numel / rows;
    int64_t cap = by_col ? cols : slab_rows < rows ? slab_rows : rows;
    float *zero = calloc((size_t)cap, sizeof *zero), *one = malloc((size_t)cap * sizeof *one);
    lm_status s = zero && one ? LM_OK : lm_err_set(e->err, LM_ERR_NOMEM, "out of memory");
    for (int64_t r = 0; one && r < cap; r++)
        one[r] = 1.0f;
    for (int64_t r0 = 0; r0 < rows && s == LM_OK; r0 += slab_rows) {
        int64_t nr = rows - r0 < slab_rows ? rows - r0 : slab_rows, cnt = nr * cols;
        if (r0 > 0 && lm_interrupted()) {
            s = lm_interrupted_err(e->err);
            break;
        }
        if (!have_slab)
            s = lm_eng_load_base(e, ws, bt, r0, nr);
        for (int i = 0; s == LM_OK && !have_slab && i < k; i++)
            s = lm_eng_tau_for(e, ws, &parts[i], bt, r0, nr, ws->base_buf);
        // a·θ_b + 0·θ_b, then each part added in
        if (s == LM_OK)
            s = by_col ? lm_dev_col_axpby(ws->dev, ws->base_buf, a, ws->base_buf, zero, nr, cols, e->err)
                       : lm_dev_row_axpby(ws->dev, ws->base_buf, a + r0, ws->base_buf, zero, nr, cols, e->err);
        for (int i = 0; s == LM_OK && i < k; i++)
            s = by_col ? lm_dev_col_axpby(ws->dev, ws->base_buf, one, parts[i].tau, c[i], nr, cols, e->err)
                       : lm_dev_row_axpby(ws->dev, ws->base_buf, one, parts[i].tau, c[i] + r0, nr, cols, e->err);
        if (s == LM_OK)
            s = lm_eng_write_slab(e, ws, idx, desc->dtype, ws->base_buf, cnt, (uint64_t)(r0 * cols) * esize(desc->dtype),
                                  hash);
        if (rows > slab_rows)
            lm_eng_release_slab(e, bt, parts, k, r0, nr);
    }
    free(zero);
    free(one);
    return s;
}

// Each row's coefficients from its Gram matrix (grows, rows of them), or with by_col each
// column's (grows, cols of them), then the merge pass per row or column.
static lm_status coef_rows(engine *e, wset *ws, int64_t idx, const lm_st_desc *desc, const lm_st_tensor *bt,
                           part *parts, int k, int64_t slab_rows, bool have_slab, bool by_col, const double *grows,
                           const bool *present, XXH64_state_t *hash)
{
    int n = e->o->n_ft, s1 = n + 1;
    int64_t rows = by_col ? bt->numel / tensor_rows(bt) : tensor_rows(bt);
    float *a = malloc((size_t)rows * sizeof *a), **c = calloc((size_t)(k ? k : 1), sizeof *c);
    double *cd = calloc((size_t)n + 1, sizeof *cd);
    lm_status s = a && c && cd ? LM_OK : lm_err_set(e->err, LM_ERR_NOMEM, "out of memory");
    for (int i = 0; s == LM_OK && i < k; i++)
        if (!(c[i] = malloc((size_t)rows * sizeof *c[i])))
            s = lm_err_set(e->err, LM_ERR_NOMEM, "out of memory");
    for (int64_t r = 0; s == LM_OK && r < rows; r++) {
        lm_coef_in in = {.o = e->o, .tp = &e->tp, .tensor = bt->name, .numel = bt->numel / rows, .n = n,
                         .present = present, .gram = grows + r * s1 * s1};
        double ar = 1.0;
        if ((s = e->m->coeffs(&in, &ar, cd, e->err)) != LM_OK)
            break;
        a[r] = (float)ar;
        for (int i = 0; i < k; i++)
            c[i][r] = (float)cd[parts[i].ft];
    }
    if (s == LM_OK)
        s = merge_rows(e, ws, idx, desc, bt, parts, k, slab_rows, have_slab, by_col, a, c, hash);
    for (int i = 0; c && i < k; i++)
        free(c[i]);
    free(c);
    free(a);
    free(cd);
    return s;
}

// Merges tensor idx from its k parts with the method's coefficients (or, for nearswap, its
// per-entry step and a coefficient of 1 per part) and writes it.
lm_status lm_eng_merge_coef(engine *e, wset *ws, int64_t idx, const lm_st_desc *desc, XXH64_state_t *hash,
                            part *parts, int k, int64_t slab_rows)
{
    const lm_st_tensor *bt = e->base->tensors[idx];
    int n = e->o->n_ft;
    bool have_slab = false;
    lm_status s = LM_OK;
    for (int i = 0; i < n; i++)
        e->coef[i] = 0.0f;
    e->base_coef = 1.0f;
    if (e->m->nearswap) {
        for (int i = 0; i < k; i++)
            e->coef[parts[i].ft] = 1.0f;
        return lm_eng_merge_linear(e, ws, idx, desc, bt, parts, k, slab_rows, false, hash);
    }
    // per row (per column): a Gram matrix for each row (column) of a matrix; a vector is one
    bool per_row = e->o->per_row && e->m->rows_ok && bt->ndim == 2;
    bool per_col = lm_eng_per_col(e, bt);
    int64_t rows = tensor_rows(bt), cols = bt->numel / rows, groups = per_col ? cols : rows;
    size_t st = (size_t)(n + 1) * (size_t)(n + 1);
    double *g = e->m->gram ? calloc(st, sizeof *g) : NULL;
    double *grows = per_row || per_col ? calloc((size_t)groups * st, sizeof *grows) : NULL;
    double **gcols = per_col ? calloc(st, sizeof *gcols) : NULL;  // each entry's column sums
    double *c = calloc((size_t)n + 1, sizeof *c);
    bool *present = calloc((size_t)n + 1, sizeof *present);
    bool nomem = (e->m->gram && !g) || ((per_row || per_col) && !grows) || (per_col && !gcols) || !c || !present;
    for (size_t q = 0; !nomem && per_col && q < st; q++)
        nomem = !(gcols[q] = calloc((size_t)cols, sizeof *gcols[q]));
    if (nomem) {
        s = lm_err_set(e->err, LM_ERR_NOMEM, "out of memory");
        goto done;
    }
    // A part's τ mirrors to 0 where it has none: an FT that does not change the tensor.
    if (e->m->gram && (s = gram_pass(e, ws, bt, parts, k, slab_rows, g, per_row ? grows : NULL, gcols, &have_slab)) !=
                          LM_OK)
        goto done;
    for (int i = 0; i < n; i++)
        present[i] = e->fts[i]->adapter || lm_model_find(e->fts[i]->model, bt->name);
    if (per_col) {  // each column's matrix from the entries' column sums, mirrored
        int s1 = n + 1;
        for (int64_t col = 0; col < cols; col++) {
            double *m = grows + (size_t)col * st;
            for (int a = 0; a < s1; a++)
                for (int b = 0; b <= a; b++) {
                    double v = gcols[b == 0 ? a : a * s1 + b][col];
                    m[a * s1 + b] = m[b * s1 + a] = v;
                }
        }
    }
    if (per_row || per_col) {
        s = coef_rows(e, ws, idx, desc, bt, parts, k, slab_rows, have_slab, per_col, grows, present, hash);
        goto done;
    }
    lm_coef_in in = {.o = e->o, .tp = &e->tp, .tensor = bt->name, .numel = bt->numel, .n = n, .present = present,
                     .gram = g};
    double a = 1.0;
    if ((s = e->m->coeffs(&in, &a, c, e->err)) != LM_OK)
        goto done;
    e->base_coef = (float)a;
    for (int i = 0; i < n; i++)
        e->coef[i] = (float)c[i];
    if (!have_slab && lm_eng_fused(e, ws->dev, bt, parts, k)) {
        int64_t ties_left[k];
        memset(ties_left, 0, sizeof ties_left);
        s = lm_eng_merge_dense(e, ws, idx, desc, bt, parts, k, slab_rows, ties_left, NULL, hash);
    } else {
        s = lm_eng_merge_linear(e, ws, idx, desc, bt, parts, k, slab_rows, have_slab, hash);
    }
done:
    free(g);
    free(grows);
    for (size_t q = 0; gcols && q < st; q++)
        free(gcols[q]);
    free(gcols);
    free(c);
    free(present);
    return s;
}
