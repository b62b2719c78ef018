// Tests of the device-independent sparsification pieces: the exact top-k threshold from two
// radix histograms (against a sort of the magnitudes, with many ties and with k at the edges)
// and the counter-based random generator (a pure function of key and index, keeping a fraction
// within a binomial bound of d, different streams for different seeds, models and names).
#include "check.h"
#include "sparsify.h"
#include "util.h"

#include <math.h>
#include <stdint.h>

static uint64_t state = 42;
static uint64_t next(void)
{
    return lm_mix64(state += 0x9E3779B97F4A7C15ull);
}

static int cmp_desc_u32(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return x < y ? 1 : x > y ? -1 : 0;
}

// Selects k of x with the histogram method, then checks against a sort: the threshold is the
// k-th largest magnitude, and exactly k entries are kept when ties go to the lowest indices.
static void check_topk(const float *x, int64_t n, int64_t k)
{
    static uint64_t hist[LM_HIST_BINS];
    lm_topk t;
    lm_topk_init(&t, k, n);
    memset(hist, 0, sizeof hist);
    for (int64_t i = 0; i < n; i++)
        hist[lm_abs_bits(x[i]) >> 16]++;
    lm_topk_level0(&t, hist);
    memset(hist, 0, sizeof hist);
    for (int64_t i = 0; i < n; i++)
        if ((lm_abs_bits(x[i]) >> 16) == t.hi_bin)
            hist[lm_abs_bits(x[i]) & 0xFFFF]++;
    lm_topk_level1(&t, hist);

    // The window way gives the same selection whenever the threshold's bin is in the window,
    // and says so exactly then.
    for (int shift = -5; shift <= 1 && !t.none; shift++) {
        int64_t lo = (int64_t)t.hi_bin + shift;
        if (lo < 0 || lo + LM_HIST_WINDOW > LM_HIST_BINS)
            continue;
        static uint64_t win[LM_HIST_WINDOW * LM_HIST_BINS];
        memset(win, 0, sizeof win);
        uint64_t above = 0;
        for (int64_t i = 0; i < n; i++) {
            uint32_t b = lm_abs_bits(x[i]), top = b >> 16;
            if (top >= (uint64_t)lo + LM_HIST_WINDOW)
                above++;
            else if (top >= (uint64_t)lo)
                win[(size_t)(top - lo) * LM_HIST_BINS + (b & 0xFFFF)]++;
        }
        lm_topk w;
        lm_topk_init(&w, k, n);
        bool inside = t.hi_bin >= lo && t.hi_bin < lo + LM_HIST_WINDOW;
        bool found = lm_topk_window(&w, above, win, LM_HIST_WINDOW, (uint32_t)lo);
        CHECK_MSG(found == inside, "k=%lld window from %lld: found %d, threshold bin %u", (long long)k, (long long)lo,
                  found, t.hi_bin);
        if (found)
            CHECK_MSG(w.thr_bits == t.thr_bits && w.ties_allowed == t.ties_allowed && w.hi_bin == t.hi_bin,
                      "k=%lld window from %lld: threshold %08x ties %lld, two passes %08x ties %lld", (long long)k,
                      (long long)lo, w.thr_bits, (long long)w.ties_allowed, t.thr_bits, (long long)t.ties_allowed);
    }

    uint32_t *sorted = malloc((size_t)n * sizeof *sorted);
    for (int64_t i = 0; i < n; i++)
        sorted[i] = lm_abs_bits(x[i]);
    qsort(sorted, (size_t)n, sizeof *sorted, cmp_desc_u32);
    int64_t kept = 0, ties = t.ties_allowed;
    for (int64_t i = 0; i < n; i++) {
        uint32_t b = lm_abs_bits(x[i]);
        if (b > t.thr_bits || (b == t.thr_bits && ties-- > 0))
            kept++;
    }
    if (k == 0) {
        CHECK(t.none && kept == 0);
    } else {
        CHECK_MSG(t.thr_bits == sorted[k - 1], "k=%lld: threshold %08x, sorted %08x", (long long)k, t.thr_bits,
                  sorted[k - 1]);
        int64_t above = 0;
        for (int64_t i = 0; i < n; i++)
            above += sorted[i] > sorted[k - 1];
        int64_t equal = 0;
        for (int64_t i = 0; i < n; i++)
            equal += sorted[i] == sorted[k - 1];
        // Exactly the ties needed; LM_TIES_ALL when that is every value at the threshold.
        CHECK(t.ties_allowed == LM_TIES_ALL ? k - above == equal : t.ties_allowed == k - above && k - above < equal);
        CHECK_MSG(kept == k, "kept %lld of k=%lld", (long long)kept, (long long)k);
    }
    free(sorted);
}

static void test_topk(void)
{
    enum { N = 20000 };
    float *x = malloc(N * sizeof *x);
    for (int i = 0; i < N; i++)
        x[i] = (float)((double)(int64_t)next() / 9.2e18);
    int64_t ks[] = {0, 1, 2, 17, N / 5, N / 2, N - 1, N};
    for (size_t i = 0; i < sizeof ks / sizeof ks[0]; i++)
        check_topk(x, N, ks[i]);
    // Heavy ties: few distinct magnitudes, both signs, zeros.
    for (int i = 0; i < N; i++)
        x[i] = (float)((int)(next() % 7) - 3) * 0.25f;
    for (size_t i = 0; i < sizeof ks / sizeof ks[0]; i++)
        check_topk(x, N, ks[i]);
    // Values that share the top 16 bits and differ only below, and infinities.
    for (int i = 0; i < N; i++)
        x[i] = lm_bits_f32(0x3F800000u | (uint32_t)(next() & 0xFFFF));
    x[5] = INFINITY;
    x[6] = -INFINITY;
    for (size_t i = 0; i < sizeof ks / sizeof ks[0]; i++)
        check_topk(x, N, ks[i]);
    free(x);
}

static void test_rng(void)
{
    uint64_t key = lm_rng_key(0, 0, lm_xxh64("w", 1));
    // A pure function of (key, index).
    bool same = true;
    for (int64_t j = 0; j < 1000; j++)
        same &= lm_rng_keep(key, j, lm_rng_threshold(0.3)) == lm_rng_keep(key, j, lm_rng_threshold(0.3));
    CHECK(same);
    // Kept fraction within 5 sigma of d for several d.
    const double ds[] = {0.01, 0.1, 0.5, 0.9};
    const int64_t n = 200000;
    for (size_t i = 0; i < 4; i++) {
        int64_t kept = 0;
        uint64_t thr = lm_rng_threshold(ds[i]);
        for (int64_t j = 0; j < n; j++)
            kept += lm_rng_keep(key, j, thr);
        double sigma = sqrt(n * ds[i] * (1 - ds[i]));
        CHECK_MSG(fabs((double)kept - n * ds[i]) < 5 * sigma, "d=%g kept %lld of %lld", ds[i], (long long)kept,
                  (long long)n);
    }
    // d = 1 keeps everything; a tiny d keeps nearly nothing.
    int64_t all = 0;
    for (int64_t j = 0; j < 10000; j++)
        all += lm_rng_keep(key, j, lm_rng_threshold(1.0));
    CHECK(all == 10000);
    CHECK(lm_rng_threshold(0) == 0 && lm_rng_threshold(1) == (1ull << 32) && lm_rng_threshold(0.5) == (1ull << 31));
    // Different seeds, models and tensor names give different streams (about half the
    // decisions differ at d = 0.5).
    uint64_t keys[4] = {key, lm_rng_key(1, 0, lm_xxh64("w", 1)), lm_rng_key(0, 1, lm_xxh64("w", 1)),
                        lm_rng_key(0, 0, lm_xxh64("v", 1))};
    for (int a = 1; a < 4; a++) {
        int64_t diff = 0;
        for (int64_t j = 0; j < 10000; j++)
            diff += lm_rng_keep(keys[0], j, 1ull << 31) != lm_rng_keep(keys[a], j, 1ull << 31);
        CHECK_MSG(diff > 4500 && diff < 5500, "stream %d differs from stream 0 at %lld of 10000", a, (long long)diff);
    }
}

// An accelerator's della chunks and sort groups: a row's chunk is its power of two up to 4,096; a
// group takes the rows whose keys fill 128 MiB, at least one, at most the slab's.
static void test_della_sizes(void)
{
    CHECK(lm_della_chunk(1) == 1 && lm_della_chunk(3) == 4 && lm_della_chunk(2048) == 2048 &&
          lm_della_chunk(8192) == 4096 && lm_della_chunk(5000) == 4096);
    CHECK(lm_della_sort_bytes(3, 5000) == 3 * 2 * 4096 * 8 && lm_della_sort_bytes(2, 3) == 2 * 4 * 8);
    CHECK_MSG(lm_della_sort_rows(128256, 2048) == 8192, "%lld rows of 2,048 a group",
              (long long)lm_della_sort_rows(128256, 2048));
    CHECK(lm_della_sort_rows(8192, 8192) == 2048 && lm_della_sort_rows(100, 8192) == 100);
    CHECK(lm_della_sort_rows(7, (int64_t)1 << 23) == 2 && lm_della_sort_rows(7, (int64_t)1 << 25) == 1 &&
          lm_della_sort_rows(1, 3) == 1);
}

int main(void)
{
    test_topk();
    test_rng();
    test_della_sizes();
    return check_report("test_sparsify");
}
