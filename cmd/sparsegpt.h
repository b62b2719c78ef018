// sparsegpt's side of the merge command (merge.c): what it needs before the merge, and the cache
// under --cache-dir (lib/cache.h, docs/hessian.md "The cache").
//
// For each FT the merge needs its top-k masks, or else U_cc² of the Hessians it is selected by
// (its own model's, or the base's for all with --hessian-from base). Each comes from the cache
// when it holds it, in this order: the FT's masks (then neither its Hessians nor its selection
// are needed); else the U_cc² of the model its Hessians come from (the damping is in that key);
// else that model's Hessians (a sweep that changed only the damping or the density), U_cc²
// computed from them one at a time; else the capture, whose Hessians (as they are finished)
// and U_cc² are kept. Each is said on stderr ("from the cache", "not needed", the capture's
// sequences and tokens) and logged as a "cache" event with --log-json. During the merge the
// engine asks for U_cc² and masks through lm_merge_opts' callbacks, and hands over the masks it
// selects, which are kept once the merge has succeeded. A damaged entry is said, removed and
// computed again; a cache that cannot be written is said and the merge goes on without it.
#ifndef LM_CMD_SPARSEGPT_H
#define LM_CMD_SPARSEGPT_H

#include <stdbool.h>
#include <stdint.h>

#include "cache.h"
#include "calib.h"
#include "device.h"
#include "merge.h"
#include "model.h"
#include "progress.h"
#include "status.h"

// The damping of docs/merging.md "The methods" (sparsegpt): 0.01 · mean(diag H) added to the
// diagonal (raised tenfold where a Hessian needs it, lm_hess_ucc2_raised).
#define SGPT_DAMP 0.01

// What the merge command resolved; nothing is copied, all must outlive the lm_cmd_sgpt.
typedef struct lm_cmd_sgpt_in {
    const lm_model *base;
    lm_ft *const *fts;         // (n_ft)
    int n_ft;
    const double *densities;   // (n_ft) resolved
    bool topk_global;          // --topk global
    const lm_calib *calib;     // (n_calib) one for every FT, or one per FT
    int n_calib;
    int64_t calib_samples;     // --calib-samples (0: all)
    int64_t seq_len;           // --seq-len as given (0: the model's max_position_embeddings)
    bool from_base;            // --hessian-from base
    bool sticky;               // --sticky-fallback for the capture
    const char *cache_dir;     // --cache-dir, or NULL for the default place
    lm_dev *dev;               // where the capture runs (its CPU companion takes the host-side work)
    lm_progress *progress;     // notes and "cache" events
} lm_cmd_sgpt_in;

// The cache's state for one merge: the keys of its entries and what was read back.
typedef struct sgpt_cache {
    char *dir;                 // the cache directory; NULL when none can be named (nothing kept)
    uint64_t *hess_key;        // (n_sets) each Hessian set's entries
    uint64_t *ucc2_key;        // (n_sets)
    uint64_t *mask_key;        // (n_ft) each FT's masks
    lm_cache_masks *masks;     // (n_ft) read back where mask_hit
    bool *mask_hit;            // (n_ft)
    lm_cache_entry **mask_out; // (n_ft) the masks this merge selects, being written (NULL: none)
    bool *mask_failed;         // (n_ft) writing them failed once: said, not tried again
    int n_ft;
    bool polling;              // looking again while another job captures: misses are not events
} sgpt_cache;

typedef struct lm_cmd_sgpt {
    lm_cmd_sgpt_in in;
    double ***ucc2;            // (n_sets) U_cc² per (layer, point) (lm_hess_index); NULL where not
    int n_sets;                // needed. One set per FT, or one for all with --hessian-from base
    int64_t n_ucc2;            // arrays per set
    sgpt_cache cache;
} lm_cmd_sgpt;

// Everything the merge needs before it starts (see above), into *g (overwritten; free with
// lm_cmd_sgpt_free in every case). A failed capture is its error, prefixed with the model;
// the cache's own failures are notes, never errors.
lm_status lm_cmd_sgpt_prepare(lm_cmd_sgpt *g, const lm_cmd_sgpt_in *in, lm_err *err);

// Points o's ucc2 and mask callbacks at g (which must outlive lm_merge_run).
void lm_cmd_sgpt_attach(lm_cmd_sgpt *g, lm_merge_opts *o);

// After a merge that succeeded: the masks it selected go into place in the cache, said in one
// line. (After a failed merge, lm_cmd_sgpt_free drops them.)
void lm_cmd_sgpt_commit(lm_cmd_sgpt *g);

// Frees the U_cc² sets, the masks read back and the entries being written (removing their
// temporary files); safe on a zeroed object and twice.
void lm_cmd_sgpt_free(lm_cmd_sgpt *g);

#endif
