// Atomic, durable output directories, and the check that keeps outputs away from inputs.
//
// A run writes into a fresh temporary directory beside the output ("OUT.tmp-XXXXXX" in the same
// parent, so the final rename stays on one filesystem) and renames it into place at the very
// end; on any failure the temporary directory is removed, so a failed or interrupted run leaves
// nothing behind and never half-replaces an old output. Before the rename every file in the
// temporary directory and the directory itself are fsynced, and after it the parent directory,
// so that after a power cut OUT is either absent or complete. While the run works, the
// temporary directory and the lock file are registered with lib/signals.h, so that a signal
// that ends the process (a second Ctrl-C, SIGBUS) removes them too.
//
// Two runs naming the same OUT at once are kept apart by an advisory lock: lm_outdir_begin
// takes flock(LOCK_EX) on "OUT.lock" beside OUT, writes its pid there, and holds it until
// commit or abort, which unlink the file while still holding the lock. The second run fails at
// once (LM_ERR_BUSY, exit status 2, naming the pid). Unlinking a lock file races with a run
// that has opened it but not yet locked it; that run therefore checks, once it holds the lock,
// that the file it locked is still the one at the path, and starts over when it is not. The
// lock file is opened without following a symbolic link, and one that is not a regular file of
// one link is refused (LM_ERR_USAGE), so OUT.lock can never be made to overwrite another file.
// A run killed outright (SIGKILL, a power cut) leaves OUT.lock (unlocked: the kernel drops
// flock locks with the process) and its temporary directory; the next run takes the stale lock
// file over and removes what the dead run left beside OUT (its OUT.tmp-XXXXXX, and the
// OUT.old-XXXXXX of a replace that did not finish), saying so in od->note.
//
// lm_guard: the inputs of a command (its model directories, adapter directories, data files,
// with each file it opened in them), against which every path the command will write (-o,
// OUT.lock, --log-json, --cache-dir) is checked before anything is created or truncated: an
// output that is, holds or lies inside an input is refused (LM_ERR_USAGE naming both), whatever
// --force says. Paths are compared resolved (symbolic links and "..": the realpath of the
// deepest existing ancestor, then the rest), and existing files also by device and inode, so
// neither a symbolic nor a hard link gets past it.
#ifndef LM_OUTDIR_H
#define LM_OUTDIR_H

#include <stdbool.h>
#include <stdint.h>

#include "status.h"

typedef struct lm_outdir {
    char *final;   // the path the user named
    char *tmp;     // the temporary directory being filled; NULL once committed or aborted
    bool force;    // replace an existing `final`
    char *lock;    // "final.lock", held while `tmp` is being filled; NULL when not held
    int lock_fd;   // the open, flock'ed lock file (meaningful only while `lock` is set)
    int tmp_id;    // `tmp` and `lock` as registered with lm_signals_remove_on_exit (0: not)
    int lock_id;
    char *note;    // what lm_outdir_begin found and cleaned up, one line per thing (or NULL);
                   // for the caller to print; freed by commit and abort
} lm_outdir;

// Checks `final` (exists without force: LM_ERR_USAGE naming it and --force; its parent missing:
// LM_ERR_NOT_FOUND), takes the lock (another run holds it: LM_ERR_BUSY naming `final` and that
// run's pid; OUT.lock a symbolic link or not a regular file: LM_ERR_USAGE naming it), removes
// what a dead run left (said in od->note) and creates the temporary directory. On failure
// nothing is created or held and the caller need not call lm_outdir_abort (it is harmless).
lm_status lm_outdir_begin(lm_outdir *od, const char *final, bool force, lm_err *err);

// Fsyncs every file in the temporary directory and the directory itself, renames it to `final`
// (with force an existing `final` is moved aside first and removed after the rename; without
// force an existing `final` is LM_ERR_USAGE: the rename never replaces an output silently),
// and fsyncs the parent directory. Then removes the lock file and lets the lock go. Frees the
// paths. On failure before the rename everything is kept for lm_outdir_abort.
lm_status lm_outdir_commit(lm_outdir *od, lm_err *err);

// Removes the temporary directory and everything in it, removes the lock file and lets the
// lock go, and frees the paths. Safe to call after a commit, twice, or on a zeroed object.
void lm_outdir_abort(lm_outdir *od);

// Fsyncs the directory that holds `path` (after a rename into it). LM_ERR_IO naming it.
lm_status lm_outdir_sync_parent(const char *path, lm_err *err);

// ==== outputs clear of the inputs =============================================================

typedef struct lm_guard_input {
    char *what;      // how the messages call it: "BASE", "FT 2", "--calib", "MODEL"
    char *shown;     // its path as given (or the path of one of its files)
    char *real;      // that path resolved (lm_guard_resolve)
    bool have_id;    // it exists: dev and ino are its device and inode
    uint64_t dev, ino;
} lm_guard_input;

typedef struct lm_guard {
    lm_guard_input *in;  // (n) in the order added; zero-initialise the struct
    int n, cap;
} lm_guard;

// Adds the input `path` (a directory or a file; need not exist) under the name `what`. Both
// strings are copied. LM_ERR_NOMEM only.
lm_status lm_guard_add(lm_guard *g, const char *what, const char *path, lm_err *err);

// Checks the output `path`, which the messages call `opt` ("-o", "--log-json"): LM_ERR_USAGE
// "OPT PATH is [inside] WHAT INPUT" (or "holds") when it is, lies inside or holds an input,
// naming the first such input; LM_OK when it is clear of all of them.
lm_status lm_guard_check(const lm_guard *g, const char *opt, const char *path, lm_err *err);

// The output directory `out` of lm_outdir_begin and its lock file OUT.lock, checked as
// lm_guard_check does ("-o OUT", "-o OUT: its lock file OUT.lock").
lm_status lm_guard_check_outdir(const lm_guard *g, const char *out, lm_err *err);

// Frees what the guard holds; safe on a zeroed object and twice.
void lm_guard_free(lm_guard *g);

// `path` made absolute, with every symbolic link and "." or ".." resolved as far as it exists:
// the realpath of its deepest existing ancestor, then the rest with "." and ".." folded. A new
// string the caller frees; NULL when memory runs out.
char *lm_guard_resolve(const char *path);

#endif
