// The pieces of sparsification that are the same on every device: the counter-based random
// generator behind DARE masks, and the exact top-k threshold found from two radix histograms
// of magnitudes (device.h's lm_dev_hist_abs). Both are pure functions, shared by the CPU code
// and the CUDA kernels, so masks agree bit for bit between devices.
#ifndef LM_SPARSIFY_H
#define LM_SPARSIFY_H

#include <stdbool.h>
#include <stdint.h>

#include "dtype.h"  // LM_HD

// ---- random masks -----------------------------------------------------------------------------

// SplitMix64's finaliser: a bijective mix of 64 bits.
LM_HD static inline uint64_t lm_mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// The key of the random stream for one model and one tensor: a mix of the seed, the model's
// index among the FT arguments and xxh64 of the tensor's name.
static inline uint64_t lm_rng_key(uint64_t seed, int model, uint64_t name_hash)
{
    uint64_t k = lm_mix64(seed ^ 0x6C6D6D65726765ull);  // "lmmerge"
    k = lm_mix64(k ^ ((uint64_t)(model + 1) * 0xD1B54A32D192ED03ull));
    return lm_mix64(k ^ name_hash);
}

// The threshold for keeping an entry with probability d: floor(d · 2^32), so d = 1 keeps all.
LM_HD static inline uint64_t lm_rng_threshold(double d)
{
    if (!(d > 0))
        return 0;
    if (d >= 1)
        return 1ull << 32;
    return (uint64_t)(d * 4294967296.0);
}

// The draw of element j (its index in the whole tensor): the top 32 bits of the j-th SplitMix64
// output of the stream starting at `key`. A pure function of (key, j).
LM_HD static inline uint32_t lm_rng_draw(uint64_t key, int64_t j)
{
    return (uint32_t)(lm_mix64(key + (uint64_t)(j + 1) * 0x9E3779B97F4A7C15ull) >> 32);
}

// Whether element j is kept: its draw below the threshold.
LM_HD static inline bool lm_rng_keep(uint64_t key, int64_t j, uint64_t keep_below)
{
    return lm_rng_draw(key, j) < keep_below;
}

// ---- DELLA ------------------------------------------------------------------------------------

// DELLA's keep probability of the entry of rank r (0 the smallest magnitude) among a row of
// `cols`: p_lo + (p_hi − p_lo)·r/(cols − 1), in double, p_lo for a row of one.
LM_HD static inline double lm_della_p(int64_t r, int64_t cols, double p_lo, double p_hi)
{
    return cols > 1 ? p_lo + (p_hi - p_lo) * ((double)r / (double)(cols - 1)) : p_lo;
}

// An accelerator ranks a row's entries by sorting them in chunks of at most LM_DELLA_CHUNK (the
// row's power of two where it is shorter), each chunk padded to its length: the bytes of the
// sorted keys (8 bytes each) of `rows` rows of `cols`, its scratch.
#define LM_DELLA_CHUNK 4096
LM_HD static inline int64_t lm_della_chunk(int64_t cols)
{
    int64_t len = 1;
    while (len < cols && len < LM_DELLA_CHUNK)
        len *= 2;
    return len;
}

LM_HD static inline int64_t lm_della_sort_bytes(int64_t rows, int64_t cols)
{
    int64_t len = lm_della_chunk(cols);
    return rows * ((cols + len - 1) / len) * len * 8;
}

// The rows an accelerator sorts at once: as many as LM_DELLA_SORT_MAX bytes of keys hold (at
// least one), so that della's scratch is bounded whatever the slab (an embedding's whole slab
// would take 2 GB), and still at least 4,096 chunks at a time where the slab has them: several
// waves of a large GPU's blocks.
#define LM_DELLA_SORT_MAX ((int64_t)128 << 20)
LM_HD static inline int64_t lm_della_sort_rows(int64_t rows, int64_t cols)
{
    int64_t row = lm_della_sort_bytes(1, cols), group = row > 0 ? LM_DELLA_SORT_MAX / row : rows;
    if (group < 1)
        group = 1;
    return group < rows ? group : rows;
}

// DELLA's decision for entry x at index j of its tensor with keep probability p: zero, or x
// (times 1/p in double with inv).
LM_HD static inline float lm_della_keep(float x, uint64_t key, int64_t j, double p, bool inv)
{
    if (!lm_rng_keep(key, j, lm_rng_threshold(p)))
        return 0.0f;
    return inv ? (float)((double)x / p) : x;
}

// ---- sce --------------------------------------------------------------------------------------

// The variance of k values x[0..k) and n − k zeros, Σ (v − mean)² / n with mean = Σ v / n, each
// step in double, rounded once to float32 (k <= n, n >= 1).
LM_HD static inline float lm_tau_var(const double *x, int k, int n)
{
    double sum = 0, sq = 0;
    for (int i = 0; i < k; i++)
        sum += x[i];
    double mean = sum / n;
    for (int i = 0; i < k; i++)
        sq += (x[i] - mean) * (x[i] - mean);
    sq += (double)(n - k) * (mean * mean);
    return (float)(sq / n);
}

// ---- NearSwap ---------------------------------------------------------------------------------

// NearSwap's weight of a task-vector entry x for threshold t: min(1, max(0, t / max(|x|, 1e-6))),
// in float32. x·weight is x where |x| <= t, else ±t (a NaN x stays NaN).
LM_HD static inline float lm_nearswap_weight(float x, float t)
{
    float a = x < 0 ? -x : x;
    float w = t / (a > 1e-6f ? a : 1e-6f);
    return w < 0.0f ? 0.0f : w > 1.0f ? 1.0f : w;
}

// ---- exact top-k by magnitude -----------------------------------------------------------------

// The magnitude bits of a float: its bits without the sign. For finite values and infinities
// their order is the order of |x|; NaNs sort above infinity.
LM_HD static inline uint32_t lm_abs_bits(float x)
{
    return lm_f32_bits(x) & 0x7FFFFFFFu;
}

#define LM_HIST_BINS 65536
#define LM_HIST_WINDOW 16  // most bins of level 1 counted in one pass by lm_dev_hist_window
#define LM_TIES_ALL INT64_MAX  // ties_allowed when every value equal to the threshold is kept

// Finding the k-th largest magnitude of a set of values in two histogram passes.
typedef struct lm_topk {
    int64_t k;              // how many to keep
    int64_t n;              // how many there are
    bool none;              // k == 0: keep nothing
    uint32_t hi_bin;        // after level 0: the top 16 bits of the threshold
    int64_t above;          // after level 0: values in bins above hi_bin
    uint32_t thr_bits;      // after level 1: the threshold's magnitude bits
    int64_t ties_allowed;   // after level 1: how many values equal to the threshold are kept
                            // (LM_TIES_ALL: all of them)
} lm_topk;

// Starts a selection of k of n values.
void lm_topk_init(lm_topk *t, int64_t k, int64_t n);

// Reads the level-0 histogram (top 16 bits of every magnitude) and picks hi_bin.
void lm_topk_level0(lm_topk *t, const uint64_t *hist);

// Reads the level-1 histogram (low 16 bits of the magnitudes in hi_bin) and sets thr_bits and
// ties_allowed: exactly k values are then kept, those above the threshold and the first
// ties_allowed equal to it in index order (LM_TIES_ALL when that is every one of them).
void lm_topk_level1(lm_topk *t, const uint64_t *hist);

// Both levels at once from lm_dev_hist_window's counts: `above` values beyond the window and
// the level-1 histograms of its n_win bins from lo_bin. True when the k-th largest lies in the
// window (t is then as after lm_topk_level1); false when it does not, and the two-pass way is
// needed.
bool lm_topk_window(lm_topk *t, uint64_t above, const uint64_t *win, int n_win, uint32_t lo_bin);

#endif
