// How a run ends when a signal ends it. Four signals stop a long run cleanly: SIGINT (Ctrl-C),
// SIGTERM, SIGHUP (the terminal went away) and SIGQUIT (Ctrl-\). The handlers record which one
// came first; the work polls lm_interrupted() at points where stopping is safe (between tensors,
// between slabs of a large tensor, between layers of a forward pass) and returns
// LM_ERR_INTERRUPTED, and the command then removes its partial output and exits with 128 + the
// signal's number (130 for SIGINT, 143 for SIGTERM, 129, 131), as a shell reports a process
// killed by that signal.
//
// A second of these signals (for a run that does not reach a check soon enough), or the first
// one under lm_signals_install_fatal, ends the process at once, and so does SIGBUS, which
// reading a mapped input raises when the file was truncated under the run. Before it ends, the
// handler removes what was registered with lm_signals_remove_on_exit (the temporary output, the
// lock file) with async-signal-safe calls only (openat, getdents64, unlinkat, close), writes one
// line on stderr saying why and what it removed, and then dies of the signal (the default
// action, re-raised), or for SIGBUS exits with status 1 naming the file, found from the fault
// address in the table of mapped input files (lm_signals_map_add). So no catchable signal
// leaves a temporary output or a lock file behind.
//
// Registering and forgetting a path, and the renames that move a temporary output into place,
// happen inside lm_signals_hold sections, which a dying handler waits out, so that it never
// removes a directory half-way through its rename to OUT. The tables are fixed arrays of
// atomics: the handler reads them without locks or allocation.
#ifndef LM_SIGNALS_H
#define LM_SIGNALS_H

#include <stdbool.h>
#include <stddef.h>

#include "status.h"

// Installs the SIGBUS handler for the rest of the process and records `prefix` ("llmerge ties";
// not copied, must live as long as the process) for the handlers' messages. Called once when
// the command starts.
void lm_signals_init(const char *prefix);

// Installs the handlers for SIGINT, SIGTERM, SIGHUP and SIGQUIT (SA_RESTART, so no system call
// of the work fails with EINTR because of them) and clears any signal recorded before: the
// first signal is recorded for lm_interrupted, a second one ends the process after the
// cleanup. A signal that was ignored when the process started (a background job of a script,
// nohup) is left ignored.
void lm_signals_install(void);

// The same handlers for a phase that does not poll: every signal ends the process at once,
// after the cleanup (llmerge hessian while it writes its output).
void lm_signals_install_fatal(void);

// Puts back the default action of the four signals, for when the run is past the point where
// stopping could remove anything (its output is in place).
void lm_signals_restore(void);

// The number of the first signal since lm_signals_install, or 0. Safe from any thread.
int lm_interrupted(void);

// Sets `err` to LM_ERR_INTERRUPTED "interrupted by SIGINT" (or the signal that came) and
// returns LM_ERR_INTERRUPTED.
lm_status lm_interrupted_err(lm_err *err);

// "SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT" or "signal N" for lm_interrupted()'s value (static
// or thread-local storage: copy it before the next call).
const char *lm_signal_name(int sig);

// The exit status of a run stopped by `sig`: 128 + sig.
int lm_signal_exit_code(int sig);

// ==== what a dying handler removes ============================================================

// Registers `path` to be removed (a directory with everything in it) when a signal ends the
// process; `named`: the handler's message names it as the partial output. The string is not
// copied and must stay valid until lm_signals_forget. Returns an id for lm_signals_forget, or 0
// when the table is full (the path is then not removed by a handler).
int lm_signals_remove_on_exit(const char *path, bool named);

// Forgets the path registered under `id` (0: nothing). Call it after the path was removed or
// renamed into place, before freeing the string.
void lm_signals_forget(int id);

// Begins a section in which registered paths change together with the files they name; the
// four signals are blocked in this thread meanwhile, and a handler in another thread waits for
// lm_signals_release before it removes anything. Nests. When a handler is already ending the
// process, does not return (the process is about to die, and the handler removes what is
// registered).
void lm_signals_hold(void);
void lm_signals_release(void);

// ==== mapped input files ======================================================================

// Records that [addr, addr + len) maps the file `path` (not copied; valid until
// lm_signals_map_remove), so that a SIGBUS there names it. Returns an id for
// lm_signals_map_remove, or 0 when the table is full (a SIGBUS there names no file). Safe from
// any thread.
int lm_signals_map_add(const void *addr, size_t len, const char *path);

// Forgets the mapping `id` (0: nothing); call it before unmapping.
void lm_signals_map_remove(int id);

// A testing aid: when the environment variable LLMERGE_TEST_DELAY_MS holds a positive number,
// sleeps that many milliseconds (cut short by a signal). The commands call it after each unit
// of work (a merged tensor, an evaluated batch) so that the end-to-end tests have time to
// interrupt a run on the tiny fixtures. Not for users; does nothing when the variable is unset.
void lm_test_delay(void);

#endif
