// Merge methods as data. A method is one descriptor (lib/methods/<name>.c) that says what it
// needs of each tensor and how it combines the parts per element; the merge engine (merge.c
// and the files merge_int.h names) reads the descriptor and runs the passes those needs call
// for, on the device, with fallback to the CPU, in bounded memory. A method has no code of its
// own: adding one that needs only the statistics and combines below is a new descriptor;
// docs/design.md ("The merge engine") says how the next methods would be expressed and what
// the engine would gain for them.
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
//                elected sign.
#ifndef LM_METHOD_H
#define LM_METHOD_H

#include <stdbool.h>
#include <stddef.h>

#include "merge.h"

// What the combine reads of each part.
typedef enum lm_method_input {
    LM_METHOD_TASK_VECTORS,  // τ_i = θ_i − θ_base
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
} lm_method_stat;

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
} lm_method;

extern const lm_method lm_method_ties;
extern const lm_method lm_method_dare;
extern const lm_method lm_method_dare_ties;
extern const lm_method lm_method_task_arithmetic;
extern const lm_method lm_method_sparsegpt;

// The descriptor of method `id`; never NULL for a value of lm_merge_method (an unknown value
// gets ties', which no caller passes). Static: nothing to free.
const lm_method *lm_method_of(lm_merge_method id);

// The descriptor called `name` ("ties", ...), or NULL. Static: nothing to free.
const lm_method *lm_method_find(const char *name);

// The i-th method of the registry (lib/methods/methods.c), in the order `llmerge --help` lists
// them, or NULL when i is lm_method_count() or more. Static: nothing to free.
const lm_method *lm_method_at(size_t i);
size_t lm_method_count(void);

// The LM_STAT_* bits method m needs per tensor under options o (LM_STAT_L1 only with
// --rescale l1).
unsigned lm_method_stats(const lm_method *m, const lm_merge_opts *o);

#endif
