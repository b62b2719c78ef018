// Stopping a long run cleanly on SIGINT (Ctrl-C) and SIGTERM. The handlers only record which
// signal came; the work polls lm_interrupted() at points where stopping is safe (between
// tensors, between slabs of a large tensor, between layers of a forward pass) and returns
// LM_ERR_INTERRUPTED, and the command then removes its partial output and exits with
// 128 + the signal's number (130 for SIGINT, 143 for SIGTERM), as a shell reports a process
// killed by that signal. Each handler is installed with SA_RESETHAND: a second signal of the
// same kind gets the default action and ends the process at once (for a run that does not reach
// a check soon enough); what it can leave is a temporary directory beside OUT, never a
// half-replaced OUT.
#ifndef LM_SIGNALS_H
#define LM_SIGNALS_H

#include "status.h"

// Installs the handlers for SIGINT and SIGTERM (SA_RESTART, so no system call of the work fails
// with EINTR because of them) and clears any signal recorded before. A signal that was ignored
// when the process started (a background job of a script, nohup) is left ignored.
void lm_signals_install(void);

// Puts back the default action of SIGINT and SIGTERM, for when the run is past the point where
// stopping could remove anything (its output is in place).
void lm_signals_restore(void);

// The number of the first SIGINT or SIGTERM since lm_signals_install, or 0. Safe from any thread.
int lm_interrupted(void);

// Sets `err` to LM_ERR_INTERRUPTED "interrupted by SIGINT" (or the signal that came) and
// returns LM_ERR_INTERRUPTED.
lm_status lm_interrupted_err(lm_err *err);

// "SIGINT", "SIGTERM" or "signal N" for lm_interrupted()'s value (static or thread-local
// storage: copy it before the next call).
const char *lm_signal_name(int sig);

// The exit status of a run stopped by `sig`: 128 + sig.
int lm_signal_exit_code(int sig);

// A testing aid: when the environment variable LLMERGE_TEST_DELAY_MS holds a positive number,
// sleeps that many milliseconds (cut short by a signal). The commands call it after each unit
// of work (a merged tensor, an evaluated batch) so that the end-to-end tests have time to
// interrupt a run on the tiny fixtures. Not for users; does nothing when the variable is unset.
void lm_test_delay(void);

#endif
