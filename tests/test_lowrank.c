// Tests of lowrank.c: the truncated SVD behind adapters written from merged deltas, against an
// exact SVD computed here in double (LAPACKE's dgesvd): on matrices with a decaying spectrum the
// rank-r error within 1% of the Eckart-Young optimum sqrt(Σ_{i>=r} σ_i²)/‖M‖, wide and tall;
// matrices of rank at most r recovered to float32 rounding; the error it reports against the
// residual recomputed here; the rank the energy rule picks; tall and wide matrices through both
// ways of making the bases and the CPU's narrow products; the same bits on 1 and 3 threads and on
// the simulated device; a zero matrix, NaN, ranks out of range, a device out of memory.
#include <lapacke.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "device.h"
#include "lowrank.h"
#include "sparsify.h"

// An orthonormal n × k basis (row-major, double) from the QR of a Gaussian matrix of stream key.
static double *basis(int64_t n, int k, uint64_t key)
{
    double *q = malloc((size_t)(n * k) * sizeof *q), tau[k];
    for (int64_t i = 0; i < n * k; i++)
        q[i] = lm_lowrank_normal(key, i);
    LAPACKE_dgeqrf(LAPACK_ROW_MAJOR, (lapack_int)n, k, q, k, tau);
    LAPACKE_dorgqr(LAPACK_ROW_MAJOR, (lapack_int)n, k, k, q, k, tau);
    return q;
}

// M = U·diag(s)·Vᵀ as float32, rows × cols, s[i] = decay^i for i < rank_m, 0 after.
static float *make_matrix(int64_t rows, int64_t cols, int rank_m, double decay, uint64_t key)
{
    int k = (int)(rows < cols ? rows : cols);
    double *u = basis(rows, k, key), *v = basis(cols, k, key + 1);
    float *m = malloc((size_t)(rows * cols) * sizeof *m);
    for (int64_t i = 0; i < rows; i++)
        for (int64_t j = 0; j < cols; j++) {
            double x = 0, s = 1;
            for (int q = 0; q < rank_m; q++, s *= decay)
                x += u[i * k + q] * s * v[j * k + q];
            m[i * cols + j] = (float)x;
        }
    free(u);
    free(v);
    return m;
}

// The singular values of the float32 matrix m, exactly, in double (largest first), into sv.
static void exact_sigma(const float *m, int64_t rows, int64_t cols, double *sv)
{
    double *a = malloc((size_t)(rows * cols) * sizeof *a);
    for (int64_t i = 0; i < rows * cols; i++)
        a[i] = m[i];
    double u = 0, vt = 0, sup[rows < cols ? rows : cols];
    lapack_int info = LAPACKE_dgesvd(LAPACK_ROW_MAJOR, 'N', 'N', (lapack_int)rows, (lapack_int)cols, a,
                                     (lapack_int)cols, sv, &u, 1, &vt, 1, sup);
    CHECK(info == 0);
    free(a);
}

// ‖M − B·A‖_F / ‖M‖_F in double, from the factors.
static double residual(const float *m, int64_t rows, int64_t cols, const lm_lowrank *lr)
{
    double res = 0, norm = 0;
    for (int64_t i = 0; i < rows; i++)
        for (int64_t j = 0; j < cols; j++) {
            double x = 0;
            for (int q = 0; q < lr->rank; q++)
                x += (double)lr->b[i * lr->rank + q] * lr->a[q * cols + j];
            double d = m[i * cols + j] - x;
            res += d * d;
            norm += (double)m[i * cols + j] * m[i * cols + j];
        }
    return norm > 0 ? sqrt(res / norm) : 0;
}

static lm_dev *cpu(int threads)
{
    lm_dev *d = NULL;
    lm_err err = {0};
    CHECK_OK(lm_dev_cpu_create(&d, threads, &err), &err);
    return d;
}

// Factors m on dev into lr, with device buffers for m.
static lm_status factor(lm_dev *dev, const float *m, int64_t rows, int64_t cols, const lm_lowrank_opts *o,
                        lm_lowrank *lr, lm_err *err)
{
    float *dm = NULL;
    lm_status s = lm_dev_alloc(dev, (size_t)(rows * cols) * sizeof *dm, (void **)&dm, err);
    if (s == LM_OK)
        s = lm_dev_upload(dev, dm, m, (size_t)(rows * cols) * sizeof *dm, err);
    if (s == LM_OK)
        s = lm_lowrank_factor(dev, dm, rows, cols, o, lr, err);
    else
        memset(lr, 0, sizeof *lr);
    lm_dev_buf_free(dev, dm);
    return s;
}

// The rank-r error against the optimum on a decaying spectrum, wide and tall, several ranks.
static void test_decaying(lm_dev *dev)
{
    const int64_t shapes[][2] = {{96, 160}, {200, 64}, {128, 128}};
    const int ranks[] = {1, 4, 16};
    for (size_t si = 0; si < 3; si++) {
        int64_t rows = shapes[si][0], cols = shapes[si][1], k = rows < cols ? rows : cols;
        float *m = make_matrix(rows, cols, (int)k, 0.85, 100 + si);
        double *sv = malloc((size_t)k * sizeof *sv), total = 0;
        exact_sigma(m, rows, cols, sv);
        for (int64_t i = 0; i < k; i++)
            total += sv[i] * sv[i];
        for (size_t ri = 0; ri < 3; ri++) {
            int r = ranks[ri];
            double tail = 0;
            for (int64_t i = r; i < k; i++)
                tail += sv[i] * sv[i];
            double best = sqrt(tail / total);
            lm_lowrank_opts o = {.rank = r, .oversample = 10, .power_iters = 1, .key = 7};
            lm_lowrank lr;
            lm_err err = {0};
            CHECK_OK(factor(dev, m, rows, cols, &o, &lr, &err), &err);
            CHECK(lr.rank == r);
            CHECK_MSG(lr.err <= 1.01 * best, "%lldx%lld rank %d: error %.6g, optimum %.6g", (long long)rows,
                      (long long)cols, r, lr.err, best);
            double mine = residual(m, rows, cols, &lr);
            CHECK_MSG(fabs(lr.err - mine) <= 1e-4 * mine + 1e-7, "reported %.9g, recomputed %.9g", lr.err, mine);
            CHECK_NEAR(lr.norm, sqrt(total), 1e-5 * sqrt(total));
            for (int q = 0; q < r; q++)
                CHECK_MSG(fabs(lr.sigma[q] - sv[q]) <= 1e-3 * sv[0], "sigma %d: %.9g, exact %.9g", q, lr.sigma[q],
                          sv[q]);
            lm_lowrank_free(&lr);
        }
        free(sv);
        free(m);
    }
}

// A matrix of rank at most r is found whole: the error is float32 rounding.
static void test_exact(lm_dev *dev)
{
    for (int rank_m = 1; rank_m <= 6; rank_m += 5) {
        float *m = make_matrix(80, 120, rank_m, 0.5, 300 + rank_m);
        for (int r = rank_m; r <= 8; r += 8 - rank_m) {
            lm_lowrank_opts o = {.rank = r, .oversample = 4, .power_iters = 1, .key = 9};
            lm_lowrank lr;
            lm_err err = {0};
            CHECK_OK(factor(dev, m, 80, 120, &o, &lr, &err), &err);
            // singular values past the matrix's rank are rounding: dropped, or tiny
            CHECK_MSG(lr.err < 2e-6, "rank %d matrix at rank %d: error %.3g", rank_m, r, lr.err);
            CHECK(lr.rank >= rank_m && lr.rank <= r);
            lm_lowrank_free(&lr);
        }
        free(m);
    }
}

// Tall and wide matrices, whose bases are made by blocks of rows: a change of rank 3 (its
// sketches are rank-deficient, so their bases come from the QR by blocks, nine blocks of 512
// rows) found whole, and a decaying spectrum (bases by Cholesky QR over three blocks of 4,096
// rows) within 1% of the optimum; then a matrix of each kind large enough for the CPU's narrow
// products (a million elements). Each the same bits on 1 and 3 threads, its bases made the way
// said.
static void test_blocks(void)
{
    lm_dev *one = cpu(1), *three = cpu(3);
    // rows, cols, the matrix's rank (0: full), whether its bases are Cholesky QR's
    const int64_t cases[][4] = {{5000, 40, 3, 0},    {40, 5000, 3, 0},    {9000, 48, 0, 1}, {48, 9000, 0, 1},
                                {1100, 1000, 3, 0}, {1000, 1100, 60, 1}};
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
        int64_t rows = cases[ci][0], cols = cases[ci][1], k = rows < cols ? rows : cols;
        int rank_m = cases[ci][2] ? (int)cases[ci][2] : (int)k, r = 8;
        bool low = rank_m <= r, chol = cases[ci][3];
        float *m = make_matrix(rows, cols, rank_m, low ? 0.5 : 0.85, 900 + ci);
        lm_lowrank_opts o = {.rank = r, .oversample = low ? 4 : 10, .power_iters = 1, .key = 13};
        lm_lowrank lr1, lr3;
        lm_err err = {0};
        CHECK_OK(factor(one, m, rows, cols, &o, &lr1, &err), &err);
        CHECK_OK(factor(three, m, rows, cols, &o, &lr3, &err), &err);
        CHECK_MSG(lr3.bases_cholesky == (chol ? 3 : 0), "%lldx%lld: %d of 3 bases by Cholesky QR", (long long)rows,
                  (long long)cols, lr3.bases_cholesky);
        if (low) {
            CHECK_MSG(lr3.err < 2e-6 && lr3.rank >= rank_m, "%lldx%lld of rank %d: error %.3g at rank %d",
                      (long long)rows, (long long)cols, rank_m, lr3.err, lr3.rank);
        } else {
            double *sv = malloc((size_t)k * sizeof *sv), total = 0, tail = 0;
            exact_sigma(m, rows, cols, sv);
            for (int64_t i = 0; i < k; i++) {
                total += sv[i] * sv[i];
                tail += i >= r ? sv[i] * sv[i] : 0.0;
            }
            CHECK_MSG(lr3.rank == r && lr3.err <= 1.01 * sqrt(tail / total), "%lldx%lld rank %d: error %.6g, "
                      "optimum %.6g", (long long)rows, (long long)cols, r, lr3.err, sqrt(tail / total));
            free(sv);
        }
        double mine = residual(m, rows, cols, &lr3);
        CHECK_MSG(fabs(lr3.err - mine) <= 1e-4 * mine + 1e-7, "reported %.9g, recomputed %.9g", lr3.err, mine);
        CHECK_MSG(lr1.rank == lr3.rank && lr1.bases_cholesky == lr3.bases_cholesky &&
                      memcmp(lr1.a, lr3.a, (size_t)(lr1.rank * cols) * sizeof(float)) == 0 &&
                      memcmp(lr1.b, lr3.b, (size_t)(rows * lr1.rank) * sizeof(float)) == 0,
                  "%lldx%lld: 1 and 3 threads give other factors", (long long)rows, (long long)cols);
        lm_lowrank_free(&lr1);
        lm_lowrank_free(&lr3);
        free(m);
    }
    lm_dev_destroy(one);
    lm_dev_destroy(three);
}

// The error as reported against the residual recomputed in double, on both sides of the 0.1
// below which it is measured from the residual itself (above it from ‖M‖² − 2⟨M, B·A⟩ + ‖B·A‖²),
// with float32 and with BF16-rounded factors: a matrix of random entries (a flat spectrum, an
// error near 1, rows long enough for several of the narrow product's blocks of 256 terms) and a
// decaying spectrum at ranks whose optimum is just above and just below 0.1.
static void test_error_paths(lm_dev *dev)
{
    int64_t rows = 120, cols = 1100;
    float *flat = malloc((size_t)(rows * cols) * sizeof *flat);
    for (int64_t i = 0; i < rows * cols; i++)
        flat[i] = (float)lm_lowrank_normal(99, i);
    float *steep = make_matrix(rows, cols, (int)rows, 0.8, 900);  // optimum 0.8^r: 0.107 at 10, 0.086 at 11
    struct { const float *m; int r; double lo, hi; } cases[] = {
        {flat, 8, 0.9, 1.0}, {steep, 10, 0.1, 0.11}, {steep, 11, 0.08, 0.0999}};
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++)
        for (int bf16 = 0; bf16 < 2; bf16++) {
            lm_lowrank_opts o = {.rank = cases[c].r, .oversample = 10, .power_iters = 1, .key = 5,
                                 .round_bf16 = bf16};
            lm_lowrank lr;
            lm_err err = {0};
            CHECK_OK(factor(dev, cases[c].m, rows, cols, &o, &lr, &err), &err);
            double mine = residual(cases[c].m, rows, cols, &lr);
            CHECK_MSG(mine >= cases[c].lo && mine <= cases[c].hi, "case %zu: error %.6g outside [%g, %g]", c, mine,
                      cases[c].lo, cases[c].hi);
            CHECK_MSG(fabs(lr.err - mine) <= 1e-5 * mine, "case %zu%s: reported %.9g, recomputed %.9g", c,
                      bf16 ? " (BF16)" : "", lr.err, mine);
            CHECK_MSG(lr.err_residual == (mine < 0.1), "case %zu%s: error %.6g measured %s", c, bf16 ? " (BF16)" : "",
                      mine, lr.err_residual ? "from the residual" : "from the Gram sum");
            // the bases: one pass of Cholesky QR for the flat spectrum's (well conditioned), two
            // for some of the steep one's; either way B = Q·U_r·√Σ_r has BᵀB = Σ_r to float32
            // rounding (Q orthonormal)
            if (c == 0)
                CHECK_MSG(lr.bases_cholesky == 3 && lr.bases_one_pass == 3, "flat: %d bases by Cholesky QR, %d by "
                          "one pass", lr.bases_cholesky, lr.bases_one_pass);
            else
                CHECK_MSG(lr.bases_cholesky == 3 && lr.bases_one_pass < 3, "steep: %d bases by Cholesky QR, %d by "
                          "one pass", lr.bases_cholesky, lr.bases_one_pass);
            double worst = 0;
            for (int p = 0; !bf16 && p < lr.rank; p++)
                for (int q = 0; q < lr.rank; q++) {
                    double g = 0;
                    for (int64_t i = 0; i < rows; i++)
                        g += (double)lr.b[i * lr.rank + p] * lr.b[i * lr.rank + q];
                    worst = fmax(worst, fabs(g - (p == q ? lr.sigma[p] : 0.0)) / lr.sigma[0]);
                }
            CHECK_MSG(worst <= 2e-6, "case %zu: B'B differs from the singular values by %.3g of the largest", c,
                      worst);
            lm_lowrank_free(&lr);
        }
    free(flat);
    free(steep);
}

// The energy rule: the fewest values that keep the fraction, capped by rank.
static void test_energy(lm_dev *dev)
{
    int64_t rows = 64, cols = 90;
    float *m = make_matrix(rows, cols, 64, 0.7, 500);
    double sv[64], total = 0, run = 0;
    exact_sigma(m, rows, cols, sv);
    for (int i = 0; i < 64; i++)
        total += sv[i] * sv[i];
    int want = 0;
    while (run < 0.95 * total)
        run += sv[want] * sv[want], want++;
    lm_lowrank_opts o = {.rank = 32, .energy = 0.95, .oversample = 10, .power_iters = 1, .key = 3};
    lm_lowrank lr;
    lm_err err = {0};
    CHECK_OK(factor(dev, m, rows, cols, &o, &lr, &err), &err);
    CHECK_MSG(lr.rank == want, "energy 0.95: rank %d, wanted %d", lr.rank, want);
    CHECK(lr.err <= sqrt(0.05) + 1e-6);
    lm_lowrank_free(&lr);
    o.rank = 3;  // the cap
    CHECK_OK(factor(dev, m, rows, cols, &o, &lr, &err), &err);
    CHECK(lr.rank == 3);
    lm_lowrank_free(&lr);
    free(m);
}

// The same bits on 1 and 3 threads, and on the simulated device.
static void test_same_bits(void)
{
    int64_t rows = 150, cols = 70;
    float *m = make_matrix(rows, cols, 70, 0.9, 700);
    lm_lowrank_opts o = {.rank = 12, .oversample = 10, .power_iters = 1, .key = 11};
    lm_dev *devs[3] = {cpu(1), cpu(3), NULL};
    lm_err err = {0};
    CHECK_OK(lm_dev_sim_create(&devs[2], 64u << 20, NULL, 2, &err), &err);
    lm_lowrank lr[3];
    for (int d = 0; d < 3; d++)
        CHECK_OK(factor(devs[d], m, rows, cols, &o, &lr[d], &err), &err);
    for (int d = 1; d < 3; d++)
        CHECK_MSG(lr[d].rank == lr[0].rank && lr[0].rank == 12 &&
                      memcmp(lr[d].a, lr[0].a, (size_t)(12 * cols) * sizeof(float)) == 0 &&
                      memcmp(lr[d].b, lr[0].b, (size_t)(rows * 12) * sizeof(float)) == 0,
                  "device %d's factors differ from one thread's", d);
    // another key: other factors, the same error to rounding
    lm_lowrank other;
    o.key = 12;
    CHECK_OK(factor(devs[0], m, rows, cols, &o, &other, &err), &err);
    CHECK(memcmp(other.a, lr[0].a, (size_t)(12 * cols) * sizeof(float)) != 0);
    CHECK_NEAR(other.err, lr[0].err, 1e-3 * lr[0].err);
    lm_lowrank_free(&other);
    for (int d = 0; d < 3; d++) {
        lm_lowrank_free(&lr[d]);
        lm_dev_destroy(devs[d]);
    }
    free(m);
}

static void test_refusals(lm_dev *dev)
{
    float m[6 * 4] = {0};
    lm_lowrank_opts o = {.rank = 2, .oversample = 2, .power_iters = 1, .key = 1};
    lm_lowrank lr;
    lm_err err = {0};
    // zero: rank 0, no factors, no error
    CHECK_OK(factor(dev, m, 6, 4, &o, &lr, &err), &err);
    CHECK(lr.rank == 0 && lr.err == 0 && lr.norm == 0 && !lr.a && !lr.b);
    lm_lowrank_free(&lr);
    o.rank = 0;
    CHECK_FAILS(factor(dev, m, 6, 4, &o, &lr, &err), LM_ERR_USAGE, "rank 0 of a 6 x 4 matrix", &err);
    o.rank = 5;
    CHECK_FAILS(factor(dev, m, 6, 4, &o, &lr, &err), LM_ERR_USAGE, "from 1 to 4", &err);
    o.rank = 2;
    m[5] = NAN;
    CHECK_FAILS(factor(dev, m, 6, 4, &o, &lr, &err), LM_ERR_FORMAT, "NaN or Inf", &err);
    CHECK(!lr.a && !lr.b && !lr.sigma);
    // a device whose memory holds the matrix but not the factorisation's buffers
    lm_dev *sim = NULL;
    float big[64 * 64];
    for (int i = 0; i < 64 * 64; i++)
        big[i] = (float)((i * 7919) % 101) - 50;
    CHECK_OK(lm_dev_sim_create(&sim, 64 * 64 * sizeof(float) + 1024, NULL, 1, &err), &err);
    o.rank = 8;
    CHECK_FAILS(factor(sim, big, 64, 64, &o, &lr, &err), LM_ERR_DEVICE_OOM, "", &err);
    size_t free_b = 0, total_b = 0;
    lm_dev_mem_info(sim, &free_b, &total_b);
    CHECK_MSG(free_b == total_b, "the sim device holds %zu bytes after the failure", total_b - free_b);
    lm_dev_destroy(sim);
}

int main(void)
{
    lm_dev *dev = cpu(2);
    test_decaying(dev);
    test_exact(dev);
    test_error_paths(dev);
    test_blocks();
    test_energy(dev);
    test_same_bits();
    test_refusals(dev);
    lm_dev_destroy(dev);
    return check_report("test_lowrank");
}
