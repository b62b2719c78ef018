// Truncated SVD of one matrix to LoRA factors: M ≈ B·A with B [rows, r] and A [r, cols], the
// factorisation behind writing a merge's deltas as an adapter. A randomised range finder with
// power iterations (Halko, Martinsson and Tropp, 2011) on the device: Y = M·Ω with Ω a Gaussian
// test matrix of l = r + oversampling columns, re-orthonormalised after each product with Mᵀ and
// M (in double on the host: Cholesky QR, once or twice, where the product is well conditioned,
// else a Householder QR by blocks of rows); then the small matrix Q'·M [l, cols] decomposed
// exactly in double on the host (the same QR of its transpose, then LAPACKE's SVD of the l × l
// triangle). B = Q·U_r·√Σ_r and A = √Σ_r·V_rᵀ share the singular values, so that neither factor
// is much larger than the other. Where M's rank is at most l the
// range is found whole and the factorisation is exact to float32 rounding.
//
// Every draw of Ω is a pure function of (key, its index), the products are the device's
// (lm_dev_gemm), and the host's work is split by the shape alone (blocks of rows, each
// decomposed on one thread, added in block order), so the factors are the same bits for any
// thread count and slab order. The relative error ‖M − B·A‖_F / ‖M‖_F is measured with the
// factors as they will be stored, not from the singular values: as ‖M‖² − 2⟨M, B·A⟩ + ‖B·A‖²
// (⟨M, B·A⟩ from one product M·Aᵀ on the device) where that is 1% of ‖M‖² or more (an error of
// 0.1 or more, which that sum gives to 1e-4 of itself or better), else from the residual
// M − B·A itself.
#ifndef LM_LOWRANK_H
#define LM_LOWRANK_H

#include <stdbool.h>
#include <stdint.h>

#include "device.h"
#include "status.h"

typedef struct lm_lowrank_opts {
    int rank;         // the most singular values kept (r), at least 1
    double energy;    // in (0, 1]: the fewest singular values that keep this fraction of ‖M‖_F²
                      // (capped by rank); 0: rank of them
    int oversample;   // extra columns of Ω beyond rank (10 is usual), as far as min(rows, cols)
    int power_iters;  // products with MᵀM before the range is taken (2 is usual)
    uint64_t key;     // the random stream of Ω (lm_rng_key of the seed and the tensor's name)
    bool round_bf16;  // the factors rounded to the dtype they will be stored in before the
    bool round_f16;   // error is measured (at most one of the two; neither: float32)
} lm_lowrank_opts;

typedef struct lm_lowrank {
    int rank;        // singular values kept: 0 where M is zero
    float *b;        // (rows × rank) host memory, row-major: Q·U_r·√Σ_r
    float *a;        // (rank × cols) host memory, row-major: √Σ_r·V_rᵀ
    double *sigma;   // (l) the singular values of Q'·M found, largest first (M's, where the range
                     // is whole)
    int n_sigma;
    double norm;     // ‖M‖_F
    double err;      // ‖M − B·A‖_F / ‖M‖_F (0 where M is zero)
    bool err_residual;   // err from the residual itself (under 0.1), not from the Gram sum
    int bases_cholesky;  // of the range's bases (one, and two per power iteration), how many were
                         // made by Cholesky QR (the others by the QR by blocks)
    int bases_one_pass;  // of those, how many by one pass of it (the others by two)
    double host_s;       // seconds of the host's work: Ω, the bases' QRs, the small SVD and the
                         // products with its vectors (the rest is the device's products and copies)
    double device_s;     // seconds of the device's work outside the error's pass: the norm, the
                         // products (each waited for by the copy after it) and the copies
    double residual_s;   // seconds of the error's pass: the Gram matrices of B and A, Aᵀ copied to
                         // the device and M·Aᵀ made there and summed against B, and where the
                         // error is under 0.1, B and A copied there, B·A and M − B·A made and
                         // summed (both times kept when the factorisation fails)
} lm_lowrank;

// Factors the matrix M [rows, cols] (row-major, device memory of `dev`) as above into *out
// (free with lm_lowrank_free). LM_ERR_USAGE where rank is below 1 or above min(rows, cols);
// LM_ERR_DEVICE_OOM where the device's buffers do not fit (nothing is left allocated, so the
// caller may redo it on the CPU); LM_ERR_FORMAT for a matrix that holds NaN or Inf, or that
// LAPACK cannot decompose.
lm_status lm_lowrank_factor(lm_dev *dev, const float *m, int64_t rows, int64_t cols, const lm_lowrank_opts *o,
                            lm_lowrank *out, lm_err *err);

void lm_lowrank_free(lm_lowrank *lr);

// The standard normal draw of index i of the stream `key`: Ω's entry i in row-major order.
// Box-Muller, in double, from the uniform draws 2j and 2j + 1 of the stream (j = i / 2): the
// cosine of their angle for even i, its sine for odd i, so that each pair of draws makes two.
double lm_lowrank_normal(uint64_t key, int64_t i);

#endif
