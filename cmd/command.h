// The entry skeleton of the subcommands that do a run (`llmerge eval`, `llmerge hessian` and
// the merge commands): the order in which a command line is parsed, checked against the
// inputs, prepared and worked on, and how each outcome becomes an exit status (cmd.h). A
// command fills an lm_command with its own steps; lm_command_run does the rest the same way
// for all of them:
//
//   1. no arguments: the usage on stderr, exit status 2;
//   2. the options parsed; the inputs the command line names added to the guard, also when
//      it does not parse (a failure there: exit status 1);
//   3. when it parsed and --help was not given, the run prepared (inputs opened and checked);
//   4. --log-json opened whether or not 2 and 3 went well, so that their errors are logged
//      too, but only once it is known not to be (or lie inside) an input: when it cannot be
//      opened, both errors on stderr, exit status 2 (or the preparation's);
//   5. a parse error: "(see PREFIX --help)" after it, exit status 2; --help: the usage on
//      stdout, exit status 0; a preparation error: its exit status (lm_status_exit_code);
//   6. the work, whose exit status is returned (signals are the work's: 128 + N);
//   7. in every case, the command's cleanup.
#ifndef LM_CMD_COMMAND_H
#define LM_CMD_COMMAND_H

#include <stdbool.h>
#include <stdio.h>

#include "outdir.h"
#include "progress.h"
#include "status.h"

typedef struct lm_command {
    const char *prefix;      // "llmerge eval": messages start with it, and the --help hint names it
    lm_progress *progress;   // the command's own; lm_command_run initialises it
    lm_guard *guard;         // the inputs no output may be, hold or lie inside (outdir.h)
    // Put before a --log-json error that is not a usage error (a file that cannot be created):
    // "--log-json: " for eval and hessian, "" for the merges, as each has always said it.
    const char *log_error_prefix;

    // Prints the command's usage on out.
    void (*usage)(void *ctx, FILE *out);
    // Parses argv (argv[0] the command's name) into ctx; *help is set when --help was given.
    // LM_ERR_USAGE naming the option.
    lm_status (*parse)(void *ctx, int argc, char **argv, bool *help, lm_err *err);
    // Adds the inputs argv names to the guard, also when argv does not parse. LM_ERR_NOMEM only.
    lm_status (*guard_args)(void *ctx, int argc, char **argv, lm_err *err);
    // Everything before the work (quiet applied, inputs opened and checked, the device
    // opened). Sets *no_log when the inputs it opened could not be added to the guard: no log
    // is opened then rather than an unchecked one.
    lm_status (*prepare)(void *ctx, bool *no_log, lm_err *err);
    // The work; returns the exit status, its errors said on the progress.
    int (*work)(void *ctx);
    // Frees what parse, prepare and work left in ctx, the progress included; called once,
    // whatever happened.
    void (*cleanup)(void *ctx);
    void *ctx;
} lm_command;

// Runs command c over argv (argv[0] the command's name) as this header's steps say and returns
// the process exit status. Allocates nothing itself; everything the steps allocate is freed
// by c->cleanup before it returns.
int lm_command_run(const lm_command *c, int argc, char **argv);

#endif
