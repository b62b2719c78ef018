// The entry skeleton of the subcommands that do a run (`llmerge eval`, `llmerge hessian` and
// the merge commands): the order in which a command line is parsed, checked against the
// inputs, prepared and worked on, and how each outcome becomes an exit status (cmd.h). A
// command states only what differs: its usage, options and inputs as data, and its own parse,
// prepare, work and cleanup (a command that runs a model, less: lm_model_command);
// lm_command_run does the rest the same way for all of them:
//
//   1. no arguments: the usage on stderr, exit status 2;
//   2. the options parsed; the inputs the command line names (its operands and the values of
//      its input options) added to the guard, also when it does not parse (a failure there:
//      exit status 1);
//   3. when it parsed and --help was not given, -q applied and the run prepared (inputs opened
//      and checked);
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

#include "args.h"
#include "manifest.h"
#include "outdir.h"
#include "progress.h"
#include "st_writer.h"
#include "status.h"

typedef struct lm_command {
    const char *prefix;      // "llmerge eval": messages start with it, and the --help hint names it
    // Put before a --log-json error that is not a usage error (a file that cannot be created):
    // "--log-json: " for eval and hessian, "" for the merges, as each has always said it.
    const char *log_error_prefix;
    lm_progress *progress;   // the command's own; lm_command_run initialises it
    lm_guard *guard;         // the inputs no output may be, hold or lie inside (outdir.h)

    // The command line as data. The options (n_opts), and the ids of those whose value is an
    // input (n_inputs: "--calib FILE" is guarded as "--calib"); the operands' names for the
    // guard, the first and the others ("BASE" and "FT", numbered: lm_cmd_guard_args).
    const lm_opt *opts;
    size_t n_opts;
    const int *inputs;
    size_t n_inputs;
    const char *first, *rest;
    // Where parse leaves -h and -q (read after parse; quiet is applied before prepare).
    const bool *help, *quiet;

    // Prints the command's usage on out; arg is usage_arg (the merge commands': the method).
    void (*usage)(FILE *out, const void *arg);
    const void *usage_arg;
    // Parses argv (argv[0] the command's name) into ctx. LM_ERR_USAGE naming the option.
    lm_status (*parse)(void *ctx, int argc, char **argv, lm_err *err);
    // Everything before the work (inputs opened and checked, the device opened). Sets *no_log
    // when the inputs it opened could not be added to the guard: no log is opened then rather
    // than an unchecked one.
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

// A command that runs a model over token data (eval, hessian), as the little that differs
// between them. The rest is theirs alike: MODEL is the operand, --adapter and the token file
// (LM_RUN_OPT_DATA) are its inputs, the shared options are lm_run_args' (lm_cmd_run_scan), and a
// --log-json that cannot be created is said after "--log-json: ".
typedef struct lm_model_command {
    const char *prefix;      // "llmerge eval"
    const lm_opt *opts;      // (n_opts) LM_RUN_OPTS among them
    size_t n_opts;
    int64_t min_seq_len;     // the least --seq-len it takes
    lm_opt_fn option;        // its own options (ids below LM_RUN_OPT_FIRST), with its run as ctx
    void (*usage)(FILE *out);
    // As lm_command's, with its run as ctx.
    lm_status (*prepare)(void *run, bool *no_log, lm_err *err);
    int (*work)(void *run);
    void (*cleanup)(void *run);
} lm_model_command;

// Runs command mc over argv (argv[0] the command's name) as lm_command_run does and returns the
// process exit status. run is the command's run, zeroed, holding m (its progress and guard) and
// a (its options); mc->cleanup frees what the steps allocate.
int lm_command_run_model(const lm_model_command *mc, void *run, lm_model_run *m, lm_run_args *a, int argc,
                         char **argv);

// The start of a run that writes into OUT (the merges, passthrough): a signal from here on
// stops the work instead of the process, the temporary directory beside OUT is made, and what
// runs that died left there is noted. Returns 0, or the exit status after saying the error.
int lm_cmd_output_begin(lm_outdir *od, const char *out, bool force, lm_progress *p);

// The end of such a run that failed with s (err's message): the writer freed (*w NULL), the
// temporary directory removed, and the error said; after a signal (LM_ERR_INTERRUPTED), that
// said on stderr and in the log ({"event": "interrupted", "signal", "removed",
// "exit_status"}, then the error event). Returns the exit status: 1, or 128 + the signal.
int lm_cmd_output_failed(lm_status s, const lm_err *err, lm_outdir *od, lm_st_writer **w, lm_progress *p,
                         const char *out);

// The end of a run that writes a model into OUT (the merges, passthrough): llmerge.json with
// its timings written into the temporary directory, the writer freed (*w NULL; *n_shards its
// shards), a last check for a signal (LM_ERR_INTERRUPTED), then OUT renamed into place and the
// signals restored. On failure the caller aborts the output.
lm_status lm_cmd_finish_output(lm_manifest *m, const lm_manifest_timings *tm, lm_outdir *od, lm_st_writer **w,
                               int *n_shards, lm_err *err);

// The line saying what OUT got: "wrote OUT: N shards, config.json, ..., llmerge.json".
void lm_cmd_note_written(lm_progress *p, const char *out, int n_shards, int n_side, bool card);

// The "end" event of a run that wrote OUT: lm_cmd_end_event makes its object with status ok,
// the output, exit status 0 and the total seconds since t0 (NULL when memory runs out); the
// caller adds its own fields, and lm_cmd_end_send adds the shards and the peak RSS and sends it.
cJSON *lm_cmd_end_event(const char *out, double t0);
void lm_cmd_end_send(lm_progress *p, cJSON *f, int n_shards);

#endif
