// The reference the merge engine's tests compare with: docs/merging.md computed here
// independently in double with naive loops, nothing shared with lib/: the product of LoRA
// factors, magnitude trimming that keeps exactly k with ties to the lower flat index, and the
// election and weighted combination of task vectors. For test programs only (static inline
// functions; each includes it once).
#ifndef LM_TEST_REF_MERGE_H
#define LM_TEST_REF_MERGE_H

#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "merge_fixture.h"


// τ = s · B @ A with A [r, in], B [out, r] as [out, in], or its transpose [in, out] (fan_in_fan_out,
// embeddings). mag gets s · Σ|B||A|, the scale of float32 rounding.
static inline void lora_ref(double *tau, double *mag, const float *A, const float *B, int64_t r, int64_t in,
                            int64_t out, double s, bool transposed)
{
    for (int64_t o = 0; o < out; o++) {
        for (int64_t i = 0; i < in; i++) {
            double acc = 0, m = 0;
            for (int64_t k = 0; k < r; k++) {
                acc += (double)B[o * r + k] * (double)A[k * in + i];
                m += fabs((double)B[o * r + k] * (double)A[k * in + i]);
            }
            int64_t j = transposed ? i * out + o : o * in + i;
            tau[j] = s * acc;
            if (mag)
                mag[j] = fabs(s) * m;
        }
    }
}

static const double *g_sort_key;

static inline int cmp_mag_desc(const void *pa, const void *pb)
{
    int64_t a = *(const int64_t *)pa, b = *(const int64_t *)pb;
    double ma = fabs(g_sort_key[a]), mb = fabs(g_sort_key[b]);
    if (ma != mb)
        return ma > mb ? -1 : 1;
    return a < b ? -1 : a > b;
}

// keep[j]: j is among the k entries of largest |x|, ties going to the lower index.
static inline void topk_ref(const double *x, int64_t n, int64_t k, bool *keep)
{
    int64_t *idx = malloc((size_t)n * sizeof *idx);
    for (int64_t j = 0; j < n; j++)
        idx[j] = j;
    g_sort_key = x;
    qsort(idx, (size_t)n, sizeof *idx, cmp_mag_desc);
    memset(keep, 0, (size_t)n * sizeof *keep);
    for (int64_t j = 0; j < k && j < n; j++)
        keep[idx[j]] = true;
    free(idx);
}

static inline int64_t k_of(double d, int64_t n)
{
    return (int64_t)floor(d * (double)n);
}

// out[j] = keep[j] ? τ[j] : 0 after magnitude trimming with density d.
static inline void trim_ref(const double *tau, int64_t n, double d, double *out)
{
    bool *keep = malloc((size_t)n * sizeof *keep);
    topk_ref(tau, n, k_of(d, n), keep);
    for (int64_t j = 0; j < n; j++)
        out[j] = keep[j] ? tau[j] : 0;
    free(keep);
}

enum { SIGN_NONE, SIGN_SUM, SIGN_COUNT };

typedef struct combo {
    int k;            // models
    const double *w;  // (k) weights
    int sign;         // SIGN_*
    bool normalize;
    double lambda;
} combo;

static inline double sgn(double x)
{
    return x > 0 ? 1 : x < 0 ? -1 : 0;
}

// One element: tp[i] is model i's τ' (sparsified and rescaled), touched[i] whether model i takes
// part in the tensor at all. Returns θ and sets *mag to the scale of the summed terms.
static inline double combine_ref(const combo *c, double base, const double *tp, const bool *touched, double *mag)
{
    double W[MAX_FT], sum_w = 0, sum_sign = 0;
    for (int i = 0; i < c->k; i++) {
        W[i] = touched[i] ? c->w[i] * tp[i] : 0;
        sum_w += W[i];
        sum_sign += sgn(W[i]);
    }
    double delta = 0, div = 0, abs_sum = 0;
    if (c->sign == SIGN_NONE) {
        for (int i = 0; i < c->k; i++) {
            if (!touched[i])
                continue;
            delta += W[i];
            div += c->w[i];
            abs_sum += fabs(W[i]);
        }
    } else {
        double s = (c->sign == SIGN_SUM ? sum_w : sum_sign) >= 0 ? 1 : -1;
        for (int i = 0; i < c->k; i++) {
            if (W[i] == 0 || sgn(W[i]) != s)
                continue;  // zeros never agree
            delta += W[i];
            div += c->w[i];
            abs_sum += fabs(W[i]);
        }
    }
    if (c->normalize && div != 0) {
        delta /= div;
        abs_sum /= fabs(div);
    }
    *mag = fabs(base) + fabs(c->lambda) * abs_sum;
    return base + c->lambda * delta;
}

// exp and mag for a tensor of n elements; tp[i] NULL: model i does not touch the tensor.
static inline void combine_tensor(const combo *c, const float *base, int64_t n, double *const *tp, double *exp,
                                  double *mag)
{
    for (int64_t j = 0; j < n; j++) {
        double t[MAX_FT];
        bool touched[MAX_FT];
        for (int i = 0; i < c->k; i++) {
            touched[i] = tp[i] != NULL;
            t[i] = tp[i] ? tp[i][j] : 0;
        }
        exp[j] = combine_ref(c, base[j], t, touched, &mag[j]);
    }
}

// Checks every tensor of the base against the combination of tp[i][t], model i's sparsified and
// rescaled τ' for tensor t (NULL where model i does not touch tensor t).
static inline void check_combined(const lm_st_file *st, const tset *base, const combo *c, double *(*tp)[MAX_T])
{
    for (int t = 0; t < base->n; t++) {
        const tensor *b = &base->t[t];
        double *e = malloc((size_t)b->n * sizeof *e), *m = malloc((size_t)b->n * sizeof *m);
        double *cols[MAX_FT];
        for (int i = 0; i < c->k; i++)
            cols[i] = tp[i][t];
        combine_tensor(c, b->v, b->n, cols, e, m);
        check_values(st, b->name, e, m, b->n);
        free(e);
        free(m);
    }
}

#endif
