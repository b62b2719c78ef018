// What the commands share on their command lines. The option scanner: "--name value",
// "--name=value", short options ("-o OUT", "-oOUT", bundled flags such as "-qv"), "--" ending
// the options, operands anywhere, and an unknown option answered with the closest known name
// ("did you mean"). The checks of options several commands take. And the options and inputs of
// the commands that run a model over token data (`llmerge eval`, `llmerge hessian`): MODEL,
// --adapter, the caps on the data, the device, opened and checked the same way in both.
#ifndef LM_CMD_ARGS_H
#define LM_CMD_ARGS_H

#include <stdbool.h>
#include <stddef.h>

#include "adapter.h"
#include "calib.h"
#include "device.h"
#include "forward.h"
#include "model.h"
#include "outdir.h"
#include "progress.h"
#include "status.h"

typedef struct lm_opt {
    const char *name;  // without the leading "--"
    char short_name;   // or 0
    bool value;        // takes a value
    int id;            // the command's own identifier
} lm_opt;

// Called for each option with how the user wrote it ("--density", "-o") and its value (NULL for
// a flag), and for each operand; a status other than LM_OK stops the scan and is returned.
typedef lm_status (*lm_opt_fn)(void *ctx, const lm_opt *opt, const char *shown, const char *value, lm_err *err);
typedef lm_status (*lm_operand_fn)(void *ctx, const char *arg, lm_err *err);

#include <stdint.h>

#define LM_CMD_MAX_THREADS 4096

// Whether text is a whole decimal number in [lo, hi] (no sign, nothing after it); *out gets it.
bool lm_cmd_parse_int(const char *text, int64_t lo, int64_t hi, int64_t *out);

// The --dtype word of an output dtype: "f32", "f16" or "bf16" (static).
const char *lm_cmd_dtype_flag(lm_dtype dt);

// The options several commands take, checked the same way everywhere: --gpu-mem SIZE (more
// than 0 bytes) and --threads N (0 for all cores, at most LM_CMD_MAX_THREADS). LM_ERR_USAGE
// naming the option as the user wrote it (`shown`).
lm_status lm_cmd_opt_gpu_mem(const char *shown, const char *v, uint64_t *out, lm_err *err);
lm_status lm_cmd_opt_threads(const char *shown, const char *v, int *out, lm_err *err);
// --data-format of the commands that read token data: "ids" (the default) or "text" (*text).
lm_status lm_cmd_opt_data_format(const char *shown, const char *v, bool *text, lm_err *err);

// The tokenizer.json a command's "text" data is tokenized with: --tokenizer DIR's (opt_dir), else
// that of `what` ("MODEL", "BASE"), the model directory `dir`. Sets co->tokenizer to it where the
// file is there (else NULL, and co->no_tokenizer to why[why_size], which says so). Returns the
// path, for the caller to free once the data is read; NULL when memory runs out.
char *lm_cmd_calib_tokenizer(const char *opt_dir, const char *what, const char *dir, lm_calib_opts *co, char *why,
                             size_t why_size);

// Scans argv[1..argc) against the n options. Unknown options, a missing value and a value given
// to a flag are LM_ERR_USAGE naming them.
lm_status lm_cmd_scan(int argc, char **argv, const lm_opt *opts, size_t n, lm_opt_fn on_opt, lm_operand_fn on_operand,
                      void *ctx, lm_err *err);

// The last --log-json value in argv (before "--"), or NULL: a command opens its log whether or
// not the rest parses, so that errors of the parsing itself are logged too (the scan checks the
// value properly).
const char *lm_cmd_find_log_json(int argc, char **argv);

// ==== outputs clear of the inputs (outdir.h) ==================================================

// Adds to g the inputs argv names: its operands (the first called `first`, "BASE" or "MODEL",
// the others `rest` and their number, "FT 1", ...) and the values of the options whose ids are
// in input_ids (n_ids of them; "--calib FILE" is called "--calib"). argv is read as
// lm_cmd_scan reads it, but also when it does not parse (an unknown option counts as a flag),
// so that a command line with a usage error still cannot log over one of its inputs.
// LM_ERR_NOMEM only.
lm_status lm_cmd_guard_args(lm_guard *g, int argc, char **argv, const lm_opt *opts, size_t n, const int *input_ids,
                            size_t n_ids, const char *first, const char *rest, lm_err *err);

// Adds the files of an opened model (config.json, the index, every shard) or adapter
// (adapter_config.json, adapter_model.safetensors) as more of the input `what`, so that a hard
// link or a symbolic link to one of them is caught too. NULL adds nothing.
lm_status lm_cmd_guard_model(lm_guard *g, const char *what, const lm_model *m, lm_err *err);
lm_status lm_cmd_guard_adapter(lm_guard *g, const char *what, const lm_adapter *a, lm_err *err);

// Opens the JSON Lines log `path` for p (lm_progress_log_open) once lm_guard_check has found it
// clear of g's inputs; LM_ERR_USAGE naming both when it is not, and then nothing is created.
lm_status lm_cmd_log_open(lm_progress *p, const lm_guard *g, const char *path, lm_err *err);

// ==== commands that run a model: eval, hessian ================================================

// The identifiers of their shared options; a command numbers its own below LM_RUN_OPT_FIRST.
enum {
    LM_RUN_OPT_FIRST = 1000,
    LM_RUN_OPT_ADAPTER = LM_RUN_OPT_FIRST,
    LM_RUN_OPT_SEQ_LEN,
    LM_RUN_OPT_SAMPLES,
    LM_RUN_OPT_DEVICE,
    LM_RUN_OPT_GPU_MEM,
    LM_RUN_OPT_THREADS,
    LM_RUN_OPT_STICKY,
    LM_RUN_OPT_QUIET,
    LM_RUN_OPT_HELP,
    LM_RUN_OPT_DATA,      // the token file: eval's --data, hessian's --calib
    LM_RUN_OPT_LOG_JSON,  // opened by the skeleton, whether or not the rest parses (command.h)
    LM_RUN_OPT_TOKENIZER, // --tokenizer DIR: tokenizer.json for text lines (default: MODEL's)
    LM_RUN_OPT_FORMAT,    // --data-format ids|text
};

// Their entries in a command's option table; `samples` is the name of the cap on sequences
// ("samples" for eval's --data, "calib-samples" for hessian's --calib).
#define LM_RUN_OPTS(samples)                                                                                     \
    {"adapter", 0, true, LM_RUN_OPT_ADAPTER}, {"seq-len", 0, true, LM_RUN_OPT_SEQ_LEN},                           \
        {samples, 0, true, LM_RUN_OPT_SAMPLES}, {"device", 0, true, LM_RUN_OPT_DEVICE},                           \
        {"gpu-mem", 0, true, LM_RUN_OPT_GPU_MEM}, {"threads", 0, true, LM_RUN_OPT_THREADS},                       \
        {"sticky-fallback", 0, false, LM_RUN_OPT_STICKY}, {"quiet", 'q', false, LM_RUN_OPT_QUIET},               \
        {"tokenizer", 0, true, LM_RUN_OPT_TOKENIZER}, {"data-format", 0, true, LM_RUN_OPT_FORMAT},                \
        {"help", 'h', false, LM_RUN_OPT_HELP}

// What those options and the MODEL operand say.
typedef struct lm_run_args {
    const char *model;     // MODEL (one)
    const char *data;      // the token file (LM_RUN_OPT_DATA), or NULL
    const char *adapter;   // --adapter, or NULL
    const char *tokenizer; // --tokenizer DIR, or NULL: MODEL's tokenizer.json
    bool text;             // --data-format text: the data file is one text document
    const char *device;    // --device (lm_cmd_run_scan: "auto")
    int64_t seq_len;       // --seq-len, 0 when not given
    int64_t min_seq_len;   // the least --seq-len the command takes
    int64_t samples;       // the cap on sequences, 0: all
    uint64_t gpu_mem;      // --gpu-mem, 0 when not given
    int threads;           // --threads, 0: all cores
    bool sticky, quiet, help;
} lm_run_args;

// Scans argv as lm_cmd_scan does against the n options, LM_RUN_OPTS among them, into *a (zeroed,
// then the defaults: device auto, --seq-len from min_seq_len): the shared options and the
// operand, MODEL once, into a; each of the command's own options (ids below LM_RUN_OPT_FIRST)
// to own(ctx, ...). LM_ERR_USAGE naming the option as the user wrote it for a bad value.
lm_status lm_cmd_run_scan(lm_run_args *a, int64_t min_seq_len, int argc, char **argv, const lm_opt *opts, size_t n,
                          lm_opt_fn own, void *ctx, lm_err *err);

// Opens MODEL (a model directory of an architecture the forward pass runs, resolved as
// lm_input_detect resolves it) and, with --adapter, the adapter (checked against MODEL). *m
// and *ad (NULL without --adapter) are the caller's to free, also on failure. Errors name the
// option and the path: exit status 2.
lm_status lm_cmd_run_open(const lm_run_args *a, lm_model **m, lm_adapter **ad, lm_err *err);

// Reads the token file `path` for model m into *data with the caps of a (--seq-len, or the
// model's max_position_embeddings, in *seq_len; 0: none) and every id checked against the
// vocabulary; *seqs (the caller frees) gets the sequences as the forward pass takes them.
lm_status lm_cmd_run_tokens(const lm_run_args *a, const lm_model *m, const char *path, lm_calib *data,
                            int64_t *seq_len, lm_fwd_seq **seqs, lm_err *err);

// Opens --device with --gpu-mem and --threads (LLMERGE_SIM_FAIL for the sim device's faults);
// `why` gets what was opened and why.
lm_status lm_cmd_run_device(const lm_run_args *a, lm_dev **dev, char *why, size_t why_size, lm_err *err);

// The notes before the work: sequences cut to --seq-len, --gpu-mem without effect on the CPU.
void lm_cmd_run_notes(lm_progress *p, const lm_run_args *a, const lm_calib *data, int64_t seq_len, lm_dev *dev);

// The warnings for adapter a's modules that PEFT would not load (lm_adapter_select), one per
// module, "WHO: keys ... are not VERB, ...", at most LM_CMD_MAX_IGNORED_WARNINGS of them, then
// how many more and how to list them (llmerge inspect ADAPTER --base BASE). Nothing when a is
// NULL or sets nothing aside.
#define LM_CMD_MAX_IGNORED_WARNINGS 10
void lm_cmd_adapter_warnings(lm_progress *p, const char *who, const lm_adapter *a, const char *verb,
                             const char *base);

// The commands' lm_fallback_fn (ctx: the lm_progress): a fallback as lm_progress_fallback says
// it (a line, a --log-json event, the count), any other line as a note.
void lm_cmd_note(void *ctx, const char *line, const lm_fallback *fb);

// The note after the work when batches were halved or sequences ran on the CPU.
void lm_cmd_run_fallbacks(lm_progress *p, const lm_fwd_runner *u);

// What a command that runs a model over token data holds while it runs, from its lm_run_args:
// MODEL and the adapter opened, the tokens read, the device opened, the forward pass's runner.
// The caller zeroes it; lm_cmd_model_run_free frees what it holds.
typedef struct lm_model_run {
    lm_progress progress;
    lm_guard guard;          // the inputs, which no output may be, hold or lie inside
    lm_model *model;
    lm_adapter *adapter;     // --adapter, or NULL
    lm_calib data;           // the token file
    int64_t seq_len;         // in effect (0: none)
    lm_fwd_seq *seqs;        // (data.n_seqs)
    lm_dev *dev;
    char dev_why[512];       // what --device opened and, for auto, why
    lm_fwd_runner runner;
    double t0;               // when the work began (lm_cmd_model_run_begin)
} lm_model_run;

// Frees everything r holds, the progress and the guard included; r itself is the caller's.
void lm_cmd_model_run_free(lm_model_run *r);

// Begins the work: the notes "WHAT MODEL[ with ADAPTER] on FILE: N sequences, T tokens
// (DEVICE[, N threads])" (what: "evaluating", ...; FILE: a->data), lm_cmd_run_notes and the
// adapter's warnings; then r->t0, and r->runner initialised with --sticky-fallback (phase names
// the command in its fallbacks: "eval", "hessian"; fallbacks and notes go to lm_cmd_note).
// Returns the runner's status; r->runner is freed with r.
lm_status lm_cmd_model_run_begin(lm_model_run *r, const lm_run_args *a, const char *what, const char *phase,
                                 lm_err *err);

// What llmerge run's output gets from its configuration (cmd/run.c), into the model directory
// dir: the chat template tmpl unless NULL (into chat_template.jinja where dir has one, which
// transformers reads first, else into tokenizer_config.json's "chat_template", else a new
// chat_template.jinja), then config_text unless NULL as mergekit_config.yml.
lm_status lm_cmd_config_files(const char *dir, const char *config_text, const char *tmpl, lm_err *err);

#endif
