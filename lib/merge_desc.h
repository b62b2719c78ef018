// What one fused dense pass computes, as the merge engine describes it to a device: the parts
// (each fine-tuned model's slab of a tensor, its task vector given or made from the inputs),
// the sparsify step each part takes (a top-k trim or a random drop), its rescale and weight,
// and the rule that combines them (sign election, normalisation, lambda). These are merge
// rules: the merge side owns them and fills them in; a backend that fuses the operations reads
// them (lm_dev_dense_hist, lm_dev_dense_merge, lm_dev_combine in device.h) and computes exactly
// what the separate operations would.
#ifndef LM_MERGE_DESC_H
#define LM_MERGE_DESC_H

#include <stdbool.h>
#include <stdint.h>

#include "dtype.h"

#define LM_DENSE_KEEP_SEGMENT 4096  // lm_dense_part's kept values: elements per segment

// Sign election rule of lm_dev_combine.
typedef enum lm_combine_sign {
    LM_COMBINE_SIGN_NONE,   // no election: Δ = Σ W_i
    LM_COMBINE_SIGN_SUM,    // s = +1 where Σ W_i >= 0
    LM_COMBINE_SIGN_COUNT,  // s = +1 where Σ sign(W_i) >= 0
    LM_COMBINE_SIGN_TAU,    // s = +1 where Σ τ_i >= 0, the weights left out of the vote (sce)
    LM_COMBINE_SIGN_NONZERO,  // no election, every part that is not zero counted: Δ = Σ W_i, and
                              // normalize divides by the weights of the parts not zero there (ram)
    LM_COMBINE_SIGN_RAMPLUS,  // no election: where one part is not zero Δ is its W_i, where several
                              // are the unweighted mean of their w_tau, else 0; normalize not read
                              // (ramplus_tl, whose weights are its λ_i)
} lm_combine_sign;

// One fine-tuned model's slab for the fused dense operations (lm_dev_dense_hist,
// lm_dev_dense_merge): a full model's task vector τ = float32(src) − float32(base) is computed
// where it is needed and never stored; any other τ (a LoRA product) is given in `tau`.
typedef struct lm_dense_part {
    const void *src;   // host memory: the slab's first element (when tau is NULL)
    lm_dtype dt;
    const float *tau;  // or τ itself, device memory (which is host memory on these devices)
    // or τ = scale · (B @ A), made here from a LoRA pair's float32 factors as lm_dev_gemm makes
    // it (rank lora_r <= LM_DEV_LOWRANK_MAX): the slab's element e is at row (col0 + e) / cols
    // of lora_b and column (col0 + e) % cols of lora_a.
    const float *lora_b;  // [rows, lora_r] from the row of the slab's first element
    const float *lora_a;  // [lora_r, cols]
    int64_t lora_r, cols, col0;
    float scale;
    // A LoRA pair's candidates, kept so that the merge need not make the product again. The
    // arrays cover the whole tensor, indexed from its first element (`first` is the call's
    // first element there, on a segment of LM_DENSE_KEEP_SEGMENT elements). lm_dev_dense_hist
    // sets bit e % 16 of keep_bits[e / 16] for each element e at or above its window's lowest
    // bin and puts their values in keep_vals, in order, those of segment s from
    // keep_vals[keep_off[s]] (each task's at the index of its own first element, so at most
    // as many as its elements); given them, lm_dev_dense_merge reads τ there (zero where no
    // bit is set) instead of making it, which is exact when its threshold is at or above that
    // bin.
    uint16_t *keep_bits;  // (numel / 16 rounded up)
    int64_t *keep_off;    // (segments)
    float *keep_vals;     // (numel + 16)
    // lm_dev_dense_hist: the window counts of |τ| as lm_dev_hist_window adds them (win NULL:
    // this part is not counted).
    uint64_t *above, *win;
    uint32_t lo_bin;
    int n_win;
    // lm_dev_dense_merge: what is done to τ before it is combined, in this order: trimmed to
    // the top k (as lm_dev_topk_apply with thr_bits and ties_allowed; ties_used is set), then,
    // with band (breadcrumbs), its own top k' dropped (as lm_dev_topk_drop with hi_bits and
    // hi_allowed; hi_used is set); or dropped at random (as lm_dev_random_drop with key,
    // first, keep_below); then multiplied by rescale (as lm_dev_axpby(τ, rescale, τ, 0))
    // unless it is 1; weight is its weight.
    bool trim;
    uint32_t thr_bits;
    int64_t ties_allowed, ties_used;
    bool band;
    uint32_t hi_bits;
    int64_t hi_allowed, hi_used;
    bool drop;
    uint64_t key, keep_below;
    int64_t first;
    float rescale;
    float weight;
    // lm_dev_dense_merge: when not NULL, the NaN and Inf among the src values it reads (a full
    // model's part) are added here.
    lm_nonfinite *nf;
} lm_dense_part;

// How lm_dev_combine and lm_dev_dense_merge combine the parts: with the sign election `sign`,
// divided by the sum of the weights where normalize, scaled by lambda (lm_dev_combine's
// contract, device.h); or, lm_dev_dense_merge only, where linear is set, as the linear pass's
// sequence out = base (times base_scale where scale_base), then out = 1·out + weight_i·τ_i for
// each part in turn (lm_dev_axpby), whose rounding differs.
typedef struct lm_combine_how {
    lm_combine_sign sign;
    bool normalize;
    float lambda;
    bool linear;
    bool scale_base;   // linear only: out = base_scale·base + 0·base first (lm_dev_axpby's arithmetic)
    float base_scale;
    // when not NULL, lm_dev_dense_merge adds the NaN and Inf among the base values it reads to
    // *base_nf, and among the output values it writes (in out_dt) to *out_nf
    lm_nonfinite *base_nf, *out_nf;
} lm_combine_how;

#endif
