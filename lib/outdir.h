// Atomic output directories. A run writes into a fresh temporary directory beside the output
// ("OUT.tmp-XXXXXX" in the same parent, so the final rename stays on one filesystem) and
// renames it into place at the very end; on any failure the temporary directory is removed,
// so a failed or interrupted run leaves nothing behind and never half-replaces an old output.
#ifndef LM_OUTDIR_H
#define LM_OUTDIR_H

#include <stdbool.h>

#include "status.h"

typedef struct lm_outdir {
    char *final;   // the path the user named
    char *tmp;     // the temporary directory being filled; NULL once committed or aborted
    bool force;    // replace an existing `final`
} lm_outdir;

// Checks `final` (exists without force: LM_ERR_USAGE naming it and --force; its parent missing:
// LM_ERR_NOT_FOUND) and creates the temporary directory. On failure nothing is created and the
// caller need not call lm_outdir_abort (it is harmless).
lm_status lm_outdir_begin(lm_outdir *od, const char *final, bool force, lm_err *err);

// Renames the temporary directory to `final`; with force an existing `final` is moved aside
// first and removed after the rename. Frees the paths.
lm_status lm_outdir_commit(lm_outdir *od, lm_err *err);

// Removes the temporary directory and everything in it, and frees the paths. Safe to call
// after a commit, twice, or on a zeroed object.
void lm_outdir_abort(lm_outdir *od);

#endif
