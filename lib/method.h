// Merge methods as data. A method is one descriptor (lib/methods/<name>.c) that says what it
// needs of each tensor and how it combines the parts per element; the merge engine (merge.c
// and the files merge_int.h names) reads the descriptor and runs the passes those needs call
// for, on the device, with fallback to the CPU, in bounded memory. A method has no code of its
// own but for the methods with coefficients (their coeffs function, in their file): adding one
// that needs only the statistics and combines below is a new descriptor; docs/design.md ("The
// merge engine") says how the methods are expressed.
//
// Per tensor the engine offers:
//   input      - the parts' task vectors τ_i = θ_i − θ_base (a LoRA adapter's s·B@A, made
//                when the tensor is merged);
//   statistics - whole-tensor figures computed in passes before the merge pass:
//                LM_STAT_TOPK  per part, the exact k-th largest rank (|τ|, or sparsegpt's
//                              importance) with k = floor(d_i · numel) and the ties to keep
//                              (lm_eng_select_tensor; --topk global: over the whole model);
//                LM_STAT_L1    per part, ‖τ‖₁ and ‖τ ⊙ m‖₁ of the random drop (DARE with
//                              --rescale l1);
//   sparsify   - per element, from those: trim below the threshold, or drop at random with
//                keep probability d_i, then rescale;
//   combine    - per element, as the fused device passes read it (lm_combine_how): a
//                linear sum θ_b + λ Σ c_i τ_i, or a mean of the parts that agree with an
//                elected sign;
//   coefficients - for the methods that interpolate whole tensors (linear, slerp, model_stock,
//                ...): a function of the method's own (its file) that turns the tensor's Gram
//                matrix (LM_STAT_GRAM: the dot products of θ_b and the τ_i, one pass) and its
//                parameters into the coefficients of a linear sum a·θ_b + Σ c_i τ_i.
#ifndef LM_METHOD_H
#define LM_METHOD_H

#include <stdbool.h>
#include <stddef.h>

#include "merge.h"

// What the combine reads of each part.
// What the method reads of its inputs, and so what its command line's inputs are.
typedef enum lm_method_input {
    LM_METHOD_TASK_VECTORS,  // τ_i = θ_i − θ_base: BASE FT [FT...]
    LM_METHOD_MODELS,        // the models themselves, the base the first of them: MODEL MODEL [MODEL...]
                             // (the base's weight is o->base_weight)
    LM_METHOD_EITHER,        // task vectors against a base, or the models themselves where
                             // o->models_only (nuslerp, multislerp: mergekit's base_model or none)
} lm_method_input;

// How a top-k trim ranks a part's entries.
typedef enum lm_method_rank {
    LM_RANK_NONE,        // no top-k trim
    LM_RANK_MAGNITUDE,   // |τ|
    LM_RANK_IMPORTANCE,  // τ² / U_cc² where the tensor has a Hessian (o->ucc2), else |τ|
} lm_method_rank;

// Whole-tensor statistics a method needs before its merge pass (lm_method_stats).
typedef enum lm_method_stat {
    LM_STAT_TOPK = 1u << 0,  // per part: the k-th largest rank and the ties to keep
    LM_STAT_L1 = 1u << 1,    // per part: ‖τ‖₁ and ‖τ ⊙ m‖₁ of its random drop
    LM_STAT_GRAM = 1u << 2,  // the Gram matrix of θ_b and every τ_i (lm_coef_in's gram)
} lm_method_stat;

// What a method's coefficient function is given for one tensor.
typedef struct lm_coef_in {
    const lm_merge_opts *o;       // the scalar options (normalize, models_only, max_iter, tol, ...)
    const lm_tensor_params *tp;   // this tensor's weights, base weight, lambda and t
    const char *tensor;
    int64_t numel;
    int n;                        // o->n_ft
    const bool *present;          // (n) FT i holds the tensor (a full model may lack one); an
                                  // adapter holds every tensor (those it leaves alone are the base's)
    // (n + 1)² doubles, row-major: the dot products of x_0 = θ_b and x_{i+1} = τ_i over the
    // whole tensor (lm_dev_row_dot, the rows added in order; τ_i zero where FT i does not change
    // the tensor); NULL unless the method asks for LM_STAT_GRAM.
    const double *gram;
} lm_coef_in;

typedef struct lm_method {
    const char *name;        // on the command line: "ties", "dare", ...
    lm_merge_method id;
    // What the command line says of it (cmd/merge_args.c derives which options it takes from the
    // fields below: --density from density, --sign from elect, --topk from rank, --rescale and
    // --seed from drop, the Hessians' options and --cache-dir from LM_RANK_IMPORTANCE).
    const char *brief;       // its line in `llmerge --help`
    const char *summary;     // the first paragraph of `llmerge NAME --help`, and of the model card
    const char *formula;     // how Δ is formed, for `llmerge NAME --help`: lines of two-space indent
    lm_method_input input;
    bool density;            // reads a density d_i per FT (--density)
    bool normalize;          // --normalize's default (docs/merging.md "Defaults")
    // sparsify
    lm_method_rank rank;     // a top-k trim by this rank (LM_STAT_TOPK), or none
    bool drop;               // DARE's random drop, kept entries rescaled (1/d_i, or --rescale l1:
                             // ‖τ‖₁ / ‖τ ⊙ m‖₁, LM_STAT_L1)
    // combine
    bool elect;              // a sign elected per entry (o->sign: of Σ W_i or of Σ sign(W_i)), the
                             // parts that agree averaged (lm_dev_combine's disjoint mean)
    bool linear;             // θ_b + λ Σ_i c_i τ_i with c_i = w_i (÷ Σ w_i when normalizing): each τ
                             // added in as soon as it exists, a plain LoRA's as one GEMM
    bool della;              // the drop keeps entry j of a row with probability d_i ± ε_i by its
                             // magnitude rank in the row (DELLA; lm_dev_della_drop), 1/p its own
                             // rescale with --rescale inv
    bool outliers;           // with the magnitude trim, the γ_i·numel largest entries dropped too
                             // (breadcrumbs: the kept ones rank from there down; lm_dev_topk_drop)
    bool nearswap;           // each τ_i replaced by NearSwap's step at t first (lm_dev_nearswap)
    bool sce;                // sce's own passes (lib/merge_sce.c): a mask from the variances across
                             // the FTs, weights from the masked τ's mean squares, an election by Σ τ
    bool threshold;          // RAM: each τ_i trimmed to its entries above ε_i in magnitude (the
                             // trim's rule with a fixed threshold, no selection), and the parts
                             // combined with LM_COMBINE_SIGN_NONZERO: a mean of those not zero
    bool ramplus;            // RAM+ (with threshold): a pass over the tensor counts each part's
                             // entries it alone keeps and those it shares, which give its weight
                             // λ_i; combined with LM_COMBINE_SIGN_RAMPLUS
    // coefficients: θ = a·θ_b + Σ_i c_i τ_i, a and c (n values) from coeffs; the merge pass is
    // then the linear one. err names what is wrong (a degenerate tensor the method cannot merge).
    lm_status (*coeffs)(const lm_coef_in *in, double *a, double *c, lm_err *err);
    bool gram;               // coeffs reads in->gram (LM_STAT_GRAM)
    bool rows_ok;            // o->per_row: coeffs per row of a matrix, from that row's Gram matrix
    bool cols_ok;            // o->per_col: the same per column
    // the command line
    // the vectors it interpolates, at least and at most (0: any): the FTs, and the base where it
    // is one of the models (LM_METHOD_MODELS, or LM_METHOD_EITHER with o->models_only)
    int min_inputs, max_inputs;
    bool reads_t;            // --t
    bool reads_iter;         // --max-iter and --tol
    // options it does not read, each with why (a note when one is given; "no effect" in --help);
    // NULL where it reads them
    const char *ignores_weights;    // --weights
    const char *ignores_normalize;  // --normalize, --no-normalize
    const char *ignores_lambda;     // --lambda
} lm_method;

extern const lm_method lm_method_ties;
extern const lm_method lm_method_dare;
extern const lm_method lm_method_dare_ties;
extern const lm_method lm_method_task_arithmetic;
extern const lm_method lm_method_sparsegpt;
extern const lm_method lm_method_linear;
extern const lm_method lm_method_slerp;
extern const lm_method lm_method_nuslerp;
extern const lm_method lm_method_multislerp;
extern const lm_method lm_method_karcher;
extern const lm_method lm_method_model_stock;
extern const lm_method lm_method_nearswap;
extern const lm_method lm_method_breadcrumbs;
extern const lm_method lm_method_breadcrumbs_ties;
extern const lm_method lm_method_della;
extern const lm_method lm_method_della_linear;
extern const lm_method lm_method_sce;
extern const lm_method lm_method_ram;
extern const lm_method lm_method_ramplus_tl;

// The ε_i a method takes when none is given: mergekit's 0.15 for della's spread, 1e-5 for the
// ram methods' threshold.
double lm_method_epsilon(const lm_method *m);

// The descriptor of method `id`; never NULL for a value of lm_merge_method (an unknown value
// gets ties', which no caller passes). Static: nothing to free.
const lm_method *lm_method_of(lm_merge_method id);

// The descriptor called `name` ("ties", ...), or NULL; mergekit's spellings with underscores
// ("dare_ties", "task_arithmetic", "model_stock") and its "dare_linear" (dare) are found too.
// Static: nothing to free.
const lm_method *lm_method_find(const char *name);

// The i-th method of the registry (lib/methods/methods.c), in the order `llmerge --help` lists
// them, or NULL when i is lm_method_count() or more. Static: nothing to free.
const lm_method *lm_method_at(size_t i);
size_t lm_method_count(void);

// The LM_STAT_* bits method m needs per tensor under options o (LM_STAT_L1 only with
// --rescale l1).
unsigned lm_method_stats(const lm_method *m, const lm_merge_opts *o);

// ---- helpers of the coefficient functions (lib/methods/coef.c) -------------------------------

// The Gram matrix of the vectors a method interpolates, from in->gram: with `models` the models
// themselves, x_0 = θ_b and x_i = θ_b + τ_i (i = 1..n, m = n + 1 vectors), else the task vectors
// x_i = τ_{i+1} (m = n). g is m² doubles, row-major.
void lm_coef_vectors_gram(const lm_coef_in *in, bool models, double *g);

// Turns coefficients r (m values) of those vectors into the merge's a and c: with `models`,
// a = Σ r_j and c_i = r_i for i >= 1 (θ_b + τ_i = x_i); else a = 1 and c_i = r_i.
void lm_coef_from_vectors(const lm_coef_in *in, bool models, const double *r, double *a, double *c);

// vᵀ G w for coefficient vectors v and w over m vectors with Gram matrix g.
double lm_coef_dot(const double *g, int m, const double *v, const double *w);

#endif
