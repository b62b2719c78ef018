// Exact top-k thresholds from radix histograms: see sparsify.h.
#include "sparsify.h"

#include <string.h>

void lm_topk_init(lm_topk *t, int64_t k, int64_t n)
{
    memset(t, 0, sizeof *t);
    t->k = k < 0 ? 0 : (k > n ? n : k);
    t->n = n;
    t->none = t->k == 0;
    if (t->none) {
        // No magnitude bits exceed this and no value equals it: nothing is kept.
        t->thr_bits = 0xFFFFFFFFu;
        t->ties_allowed = 0;
    }
}

void lm_topk_level0(lm_topk *t, const uint64_t *hist)
{
    if (t->none)
        return;
    int64_t cum = 0;
    for (int64_t b = LM_HIST_BINS - 1; b >= 0; b--) {
        if (cum + (int64_t)hist[b] >= t->k) {
            t->hi_bin = (uint32_t)b;
            t->above = cum;
            return;
        }
        cum += (int64_t)hist[b];
    }
    t->hi_bin = 0;  // unreachable when the histogram counts n >= k values
    t->above = cum;
}

void lm_topk_level1(lm_topk *t, const uint64_t *hist)
{
    if (t->none)
        return;
    int64_t need = t->k - t->above, cum = 0;
    for (int64_t l = LM_HIST_BINS - 1; l >= 0; l--) {
        if (cum + (int64_t)hist[l] >= need) {
            t->thr_bits = (t->hi_bin << 16) | (uint32_t)l;
            t->ties_allowed = need - cum;
            // Every value equal to the threshold is kept (the usual case): say so, and the
            // masks need no count of ties in index order.
            if (t->ties_allowed == (int64_t)hist[l])
                t->ties_allowed = LM_TIES_ALL;
            return;
        }
        cum += (int64_t)hist[l];
    }
    t->thr_bits = t->hi_bin << 16;
    t->ties_allowed = need - cum;
}

bool lm_topk_window(lm_topk *t, uint64_t above, const uint64_t *win, int n_win, uint32_t lo_bin)
{
    if (t->none)
        return true;
    int64_t cum = (int64_t)above;
    if (cum >= t->k)
        return false;
    for (int w = n_win - 1; w >= 0; w--) {
        const uint64_t *h = win + (size_t)w * LM_HIST_BINS;
        int64_t c = 0;
        for (int64_t b = 0; b < LM_HIST_BINS; b++)
            c += (int64_t)h[b];
        if (cum + c >= t->k) {
            t->hi_bin = lo_bin + (uint32_t)w;
            t->above = cum;
            lm_topk_level1(t, h);
            return true;
        }
        cum += c;
    }
    return false;
}
