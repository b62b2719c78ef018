// `llmerge eval MODEL [--adapter DIR] --data FILE [options]`: perplexity of a model (with a LoRA
// adapter applied, not merged, when --adapter is given) on token data, exp of the mean negative
// log-likelihood over every next-token prediction of every sequence (docs/eval.md).
// The result goes to stdout as `perplexity P tokens N` or, with --json, one JSON object; notes,
// fallbacks, progress and errors go to stderr.
//
// Everything that can be checked is checked before the work starts (exit status 2): the
// options, MODEL (a model directory of a known architecture), the adapter against MODEL, every
// line of the data file against the vocabulary, the device. The forward pass then runs in
// packed batches through lm_fwd_runner, which falls back to the CPU as
// docs/design.md "Devices and the fallback contract" says; a failure from then on is exit status 1.
#include <cJSON.h>
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "adapter.h"
#include "calib.h"
#include "args.h"
#include "cmd.h"
#include "command.h"
#include "device.h"
#include "forward.h"
#include "model.h"
#include "progress.h"
#include "signals.h"
#include "status.h"
#include "util.h"


static void usage(FILE *out)
{
    fprintf(out,
            "Usage: llmerge eval MODEL [--adapter DIR] --data FILE [options]\n"
            "\n"
            "Perplexity of MODEL on the token sequences of FILE: exp of the mean negative\n"
            "log-likelihood over every next-token prediction (token t predicting token t+1) of\n"
            "every sequence, computed in float32 with a stable log-softmax. MODEL is a Hugging Face\n"
            "model directory (LlamaForCausalLM, MistralForCausalLM or Qwen2ForCausalLM). Sequences\n"
            "of different lengths run packed together without padding.\n"
            "\n"
            "Prints `perplexity P tokens N` (N: the number of predictions) on stdout.\n"
            "\n"
            "Options (also as --name=value):\n"
            "  --adapter DIR     apply the PEFT LoRA adapter DIR to MODEL (not merged: each adapted\n"
            "                    layer computes x W^T + s (x A^T) B^T, scaled per output row by\n"
            "                    m / ||W + s B A|| with DoRA)\n"
            "  --data FILE       the token data (required): FILE.jsonl with one\n"
            "                    {\"input_ids\": [...]} per line, or FILE.txt with one sequence of\n"
            "                    space-separated token ids per line; a regular file (a FIFO or\n"
            "                    device is refused); a bad line is an error naming the file and line\n"
            "  --seq-len L       cut longer sequences to L tokens (default: the model's\n"
            "                    max_position_embeddings)\n"
            "  --samples N       use the first N sequences of FILE (default: all)\n"
            "  --tokenizer DIR   the tokenizer.json for FILE's \"text\" lines (default:\n"
            "                    MODEL's own)\n"
            "  --data-format F   text: FILE is one text document, tokenized and cut into\n"
            "                    windows of --seq-len tokens (stride = window); ids: the\n"
            "                    default\n"
            "  --device DEV      where the forward pass runs: auto, cpu, cuda[:N] or sim:SIZE\n"
            "                    (default auto: CUDA device 0 when usable, else the CPU). A device\n"
            "                    whose memory does not hold the weights runs the model on the CPU; a\n"
            "                    batch that does not fit is halved, and one sequence that still\n"
            "                    does not fit runs on the CPU (each said on stderr as 'fallback:')\n"
            "  --gpu-mem SIZE    most device memory to use (default: all free); SIZE is bytes\n"
            "                    with K, M, G, KiB, MiB, GiB (powers of 1024) or KB, MB, GB\n"
            "  --threads N       CPU threads (default 0: the cores it may use)\n"
            "  --json            print one JSON object instead: perplexity, nll_mean, tokens,\n"
            "                    sequences, the inputs, the device and the fallbacks\n"
            "  --log-json FILE   write one JSON object per event to FILE (JSON Lines): progress,\n"
            "                    fallbacks, errors (default: none); not inside an input\n"
            "  --sticky-fallback once a sequence has gone to the CPU, run every later batch there\n"
            "                    too instead of trying the device again (default: try again)\n"
            "  -q, --quiet       nothing on stderr but errors\n"
            "  -h, --help        this help\n"
            "\n"
            "Exit status: 0 done; 1 the evaluation failed, or an input changed while it was read; 2\n"
            "bad usage or bad input (a broken model, adapter or data file, a log inside an input),\n"
            "found before any work started; 128 + the signal (130 for SIGINT) when one stopped it.\n");
}

// ==== options =================================================================================

// eval's own options; the rest are those of every command that runs a model (args.h).
typedef enum opt_id {
    OPT_JSON,
} opt_id;

static const lm_opt opt_defs[] = {
    {"data", 0, true, LM_RUN_OPT_DATA},
    {"json", 0, false, OPT_JSON},
    {"log-json", 0, true, LM_RUN_OPT_LOG_JSON},  // opened whether or not the rest parses (lm_cmd_find_log_json)
    LM_RUN_OPTS("samples"),
};
#define N_OPTS (sizeof opt_defs / sizeof opt_defs[0])

typedef struct eval_args {
    lm_run_args run;   // MODEL, --adapter, --data, --seq-len, --samples, the device, -q, -h
    bool json;
} eval_args;

// Applies eval's one option of its own, --json (lm_opt_fn; ctx: the run, whose first member is
// its eval_args).
static lm_status apply_json(void *ctx, const lm_opt *d, const char *shown, const char *v, lm_err *err)
{
    (void)d, (void)shown, (void)v, (void)err;
    ((eval_args *)ctx)->json = true;
    return LM_OK;
}

// ==== the run =================================================================================

typedef struct eval_run {
    eval_args args;       // first: apply_json takes the run for it
    lm_model_run run;     // its guard: the inputs, which --log-json may not be, hold or lie inside
    int64_t n_pred;       // next-token predictions
    float *nll;           // (run.data.n_tokens)
} eval_run;

static void run_free(void *ctx)
{
    eval_run *r = ctx;
    free(r->nll);
    lm_cmd_model_run_free(&r->run);
}

// Everything before the work: inputs opened and checked, the data read, the device opened.
static lm_status open_inputs(eval_run *r, lm_err *err)
{
    eval_args *a = &r->args;
    lm_status s;
    if (!a->run.model)
        return lm_err_set(err, LM_ERR_USAGE, "needs MODEL (usage: llmerge eval MODEL [--adapter DIR] --data FILE)");
    if (!a->run.data)
        return lm_err_set(err, LM_ERR_USAGE, "no data: give --data FILE (.jsonl or .txt)");
    if ((s = lm_cmd_run_open(&a->run, &r->run.model, &r->run.adapter, err)) != LM_OK ||
        (s = lm_cmd_run_tokens(&a->run, r->run.model, a->run.data, &r->run.data, &r->run.seq_len, &r->run.seqs,
                               err)) != LM_OK)
        return s;
    if (!(r->nll = calloc((size_t)(r->run.data.n_tokens ? r->run.data.n_tokens : 1), sizeof *r->nll)))
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    for (int64_t i = 0; i < r->run.data.n_seqs; i++)
        r->n_pred += r->run.seqs[i].len - 1;
    if (r->n_pred == 0)
        return lm_err_set(err, LM_ERR_FORMAT, "%s: no next-token predictions (every sequence has one token)",
                          a->run.data);
    return lm_cmd_run_device(&a->run, &r->run.dev, r->run.dev_why, sizeof r->run.dev_why, err);
}

static void on_progress(void *ctx, int64_t done)
{
    lm_progress_update(ctx, done, 0, NULL);
    lm_test_delay();  // LLMERGE_TEST_DELAY_MS, for the tests that interrupt a run
}

// Called between the layers of every batch: stops the forward pass after SIGINT or SIGTERM.
static lm_status check_interrupt(void *ctx, lm_dev *dev, int layer, lm_fwd_point point, const float *x,
                                 int64_t rows, int64_t cols, lm_err *err)
{
    (void)ctx, (void)dev, (void)layer, (void)x, (void)rows, (void)cols;
    return point == LM_FWD_ATTN_IN && lm_interrupted() ? lm_interrupted_err(err) : LM_OK;
}

static int print_json(const eval_run *r, double nll_mean, double ppl, double secs)
{
    const lm_fwd_runner *u = &r->run.runner;
    cJSON *o = cJSON_CreateObject(), *fb = NULL;
    bool ok = o && cJSON_AddNumberToObject(o, "perplexity", ppl) && cJSON_AddNumberToObject(o, "nll_mean", nll_mean) &&
              cJSON_AddNumberToObject(o, "tokens", (double)r->n_pred) &&
              cJSON_AddNumberToObject(o, "sequences", (double)r->run.data.n_seqs) &&
              cJSON_AddNumberToObject(o, "sequences_cut", (double)r->run.data.n_cut) &&
              cJSON_AddStringToObject(o, "model", r->args.run.model) &&
              (r->args.run.adapter ? cJSON_AddStringToObject(o, "adapter", r->args.run.adapter)
                               : cJSON_AddNullToObject(o, "adapter")) &&
              cJSON_AddStringToObject(o, "data", r->args.run.data) &&
              (r->run.seq_len ? cJSON_AddNumberToObject(o, "seq_len", (double)r->run.seq_len)
                          : cJSON_AddNullToObject(o, "seq_len")) &&
              cJSON_AddStringToObject(o, "device", lm_dev_name(r->run.dev)) &&
              (fb = cJSON_AddObjectToObject(o, "fallbacks")) &&
              cJSON_AddBoolToObject(fb, "weights_on_cpu", u->weights_fell_back) &&
              cJSON_AddNumberToObject(fb, "weights_converted_on_host", (double)u->weights_host_converted) &&
              cJSON_AddNumberToObject(fb, "batches_halved", (double)u->n_halved) &&
              cJSON_AddNumberToObject(fb, "sequences_on_cpu", (double)u->n_seq_cpu) &&
              cJSON_AddNumberToObject(o, "tokens_on_device", (double)u->tokens_dev) &&
              cJSON_AddNumberToObject(o, "tokens_on_cpu", (double)u->tokens_cpu) &&
              cJSON_AddNumberToObject(o, "seconds", secs);
    char *text = ok ? cJSON_PrintUnformatted(o) : NULL;
    cJSON_Delete(o);
    if (!text) {
        fprintf(stderr, "llmerge eval: out of memory printing JSON\n");
        return 1;
    }
    printf("%s\n", text);
    free(text);
    return 0;
}

// The work: the model placed, every batch run, the result printed. Returns the exit status.
static int work(void *ctx)
{
    lm_signals_install();  // Ctrl-C stops at the next layer: exit 128 + the signal, no result
    eval_run *r = ctx;
    eval_args *a = &r->args;
    lm_progress *p = &r->run.progress;
    lm_err err = {0};
    lm_status s = lm_cmd_model_run_begin(&r->run, &a->run, "evaluating", "eval", &err);
    if (s != LM_OK) {
        int code = lm_status_exit_code(s);
        lm_progress_error(p, code, "%s", err.msg);
        return code;
    }
    r->run.runner.progress = on_progress;
    r->run.runner.progress_ctx = p;
    lm_progress_start(p, "sequence", r->run.data.n_seqs, 0);
    lm_fwd_req req = {.nll = r->nll, .hook = check_interrupt};
    s = lm_fwd_runner_run(&r->run.runner, r->run.seqs, r->run.data.n_seqs, &req, &err);
    lm_progress_end(p);
    if (s == LM_ERR_INTERRUPTED || (s == LM_OK && lm_interrupted())) {
        int sig = lm_interrupted() ? lm_interrupted() : SIGINT;
        int code = lm_signal_exit_code(sig);
        cJSON *f = cJSON_CreateObject();
        cJSON_AddStringToObject(f, "signal", lm_signal_name(sig));
        cJSON_AddNumberToObject(f, "exit_status", code);
        lm_progress_event(p, "interrupted", f);
        lm_progress_error(p, code, "interrupted by %s: no result", lm_signal_name(sig));
        return code;
    }
    lm_signals_restore();
    if (s != LM_OK) {
        lm_progress_error(p, 1, "%s", err.msg);
        return 1;
    }
    double secs = lm_now() - r->run.t0;

    // Summed in sequence order in double: the same total whatever ran where.
    double sum = 0;
    for (int64_t i = 0; i < r->run.data.n_tokens; i++)
        sum += r->nll[i];
    double mean = sum / (double)r->n_pred, ppl = exp(mean);
    const lm_fwd_runner *u = &r->run.runner;
    lm_progress_note(p, "%" PRId64 " predictions in %.2f s (%.0f tokens/s) on %s", r->n_pred, secs,
                     secs > 0 ? (double)r->run.data.n_tokens / secs : 0.0,
                     u->weights_fell_back ? "cpu" : lm_dev_name(r->run.dev));
    lm_cmd_run_fallbacks(p, u);
    if (!isfinite(mean)) {
        lm_progress_error(p, 1, "the mean negative log-likelihood is %g (the model produced non-finite logits)",
                          mean);
        return 1;
    }
    if (a->json)
        return print_json(r, mean, ppl, secs);
    printf("perplexity %.3f tokens %" PRId64 "\n", ppl, r->n_pred);
    return 0;
}

// ==== the entry (command.h) ===================================================================

// open_inputs, and the files it read from added to the guard, whatever it said.
static lm_status prepare(void *ctx, bool *no_log, lm_err *err)
{
    eval_run *r = ctx;
    lm_err gerr;
    lm_status s = open_inputs(r, err);
    if (lm_cmd_guard_model(&r->run.guard, "MODEL", r->run.model, &gerr) != LM_OK ||
        lm_cmd_guard_adapter(&r->run.guard, "--adapter", r->run.adapter, &gerr) != LM_OK)
        *no_log = true;  // out of memory: no log rather than an unchecked one
    return s;
}

static const lm_model_command command = {
    .prefix = "llmerge eval", .opts = opt_defs, .n_opts = N_OPTS,
    .min_seq_len = 2,  // a sequence needs two tokens to predict one
    .option = apply_json, .usage = usage, .prepare = prepare, .work = work, .cleanup = run_free,
};

int lm_cmd_eval(int argc, char **argv)
{
    eval_run r;
    memset(&r, 0, sizeof r);
    return lm_command_run_model(&command, &r, &r.run, &r.args.run, argc, argv);
}
