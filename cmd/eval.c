// `llmerge eval MODEL [--adapter DIR] --data FILE [options]`: perplexity of a model (with a LoRA
// adapter applied, not merged, when --adapter is given) on token data, exp of the mean negative
// log-likelihood over every next-token prediction of every sequence (METHODS.md "Perplexity").
// The result goes to stdout as `perplexity P tokens N` or, with --json, one JSON object; notes,
// fallbacks, progress and errors go to stderr.
//
// Everything that can be checked is checked before the work starts (exit status 2): the
// options, MODEL (a model directory of a known architecture), the adapter against MODEL, every
// line of the data file against the vocabulary, the device. The forward pass then runs in
// packed batches through lm_fwd_runner, which falls back to the CPU as DESIGN.md says; a failure
// from then on is exit status 1.
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
            "                    layer computes x W^T + s (x A^T) B^T); DoRA is not supported yet\n"
            "  --data FILE       the token data (required): FILE.jsonl with one\n"
            "                    {\"input_ids\": [...]} per line, or FILE.txt with one sequence of\n"
            "                    space-separated token ids per line; a bad line is an error naming\n"
            "                    the file and line\n"
            "  --seq-len L       cut longer sequences to L tokens (default: the model's\n"
            "                    max_position_embeddings)\n"
            "  --samples N       use the first N sequences of FILE (default: all)\n"
            "  --device DEV      where the forward pass runs: auto, cpu, cuda[:N] or sim:SIZE\n"
            "                    (default auto: CUDA device 0 when usable, else the CPU). A device\n"
            "                    whose memory does not hold the weights runs the model on the CPU; a\n"
            "                    batch that does not fit is halved, and one sequence that still\n"
            "                    does not fit runs on the CPU (each said on stderr as 'fallback:')\n"
            "  --gpu-mem SIZE    most device memory to use (default: all free); SIZE is bytes\n"
            "                    with K, M, G, KiB, MiB, GiB (powers of 1024) or KB, MB, GB\n"
            "  --threads N       CPU threads (default 0: all cores)\n"
            "  --json            print one JSON object instead: perplexity, nll_mean, tokens,\n"
            "                    sequences, the inputs, the device and the fallbacks\n"
            "  --sticky-fallback once a sequence has gone to the CPU, run every later batch there\n"
            "                    too instead of trying the device again (default: try again)\n"
            "  -q, --quiet       nothing on stderr but errors\n"
            "  -h, --help        this help\n"
            "\n"
            "Exit status: 0 done; 1 the evaluation failed; 2 bad usage or bad input (a broken\n"
            "model, adapter or data file), found before any work started.\n");
}

// ==== options =================================================================================

typedef enum opt_id {
    OPT_ADAPTER, OPT_DATA, OPT_SEQ_LEN, OPT_SAMPLES, OPT_DEVICE, OPT_GPU_MEM, OPT_THREADS, OPT_JSON,
    OPT_QUIET, OPT_STICKY, OPT_HELP,
} opt_id;

typedef lm_opt opt_def;

static const opt_def opt_defs[] = {
    {"adapter", 0, true, OPT_ADAPTER}, {"data", 0, true, OPT_DATA},
    {"seq-len", 0, true, OPT_SEQ_LEN}, {"samples", 0, true, OPT_SAMPLES},
    {"device", 0, true, OPT_DEVICE},   {"gpu-mem", 0, true, OPT_GPU_MEM},
    {"threads", 0, true, OPT_THREADS}, {"json", 0, false, OPT_JSON},
    {"quiet", 'q', false, OPT_QUIET},  {"help", 'h', false, OPT_HELP},
    {"sticky-fallback", 0, false, OPT_STICKY},
};
#define N_OPTS (sizeof opt_defs / sizeof opt_defs[0])

typedef struct eval_args {
    const char *model, *adapter, *data, *device;
    int64_t seq_len;   // 0: not given
    int64_t samples;   // 0: all
    uint64_t gpu_mem;  // 0: not given
    int threads;
    bool json, quiet, help, sticky;
} eval_args;

// Applies option `d` with value `v` (NULL for a flag); `shown` is how the user wrote it.
static lm_status apply_option(void *ctx, const lm_opt *d, const char *shown, const char *v, lm_err *err)
{
    eval_args *a = ctx;
    switch (d->id) {
    case OPT_ADAPTER:
    case OPT_DATA:
    case OPT_DEVICE:
        if (!*v)
            return lm_err_set(err, LM_ERR_USAGE, "%s needs a value", shown);
        *(d->id == OPT_ADAPTER ? &a->adapter : d->id == OPT_DATA ? &a->data : &a->device) = v;
        return LM_OK;
    case OPT_SEQ_LEN:
        if (!lm_cmd_parse_int(v, 2, INT32_MAX, &a->seq_len))
            return lm_err_set(err, LM_ERR_USAGE, "%s '%s': a whole number of tokens from 2 to %d is needed", shown,
                              v, INT32_MAX);
        return LM_OK;
    case OPT_SAMPLES:
        if (!lm_cmd_parse_int(v, 1, INT64_MAX, &a->samples))
            return lm_err_set(err, LM_ERR_USAGE, "%s '%s': a whole number of sequences from 1 is needed", shown, v);
        return LM_OK;
    case OPT_GPU_MEM:
        return lm_cmd_opt_gpu_mem(shown, v, &a->gpu_mem, err);
    case OPT_THREADS:
        return lm_cmd_opt_threads(shown, v, &a->threads, err);
    case OPT_JSON:
        a->json = true;
        return LM_OK;
    case OPT_QUIET:
        a->quiet = true;
        return LM_OK;
    case OPT_STICKY:
        a->sticky = true;
        return LM_OK;
    case OPT_HELP:
        a->help = true;
        return LM_OK;
    }
    return LM_OK;
}

static lm_status on_operand(void *ctx, const char *arg, lm_err *err)
{
    eval_args *a = ctx;
    if (a->model)
        return lm_err_set(err, LM_ERR_USAGE, "one MODEL only ('%s' and '%s'); an adapter goes with --adapter",
                          a->model, arg);
    a->model = arg;
    return LM_OK;
}

// Parses argv into *a (zeroed by the caller): MODEL anywhere among the options, "--" ends them.
static lm_status parse_args(eval_args *a, int argc, char **argv, lm_err *err)
{
    a->device = "auto";
    return lm_cmd_scan(argc, argv, opt_defs, N_OPTS, apply_option, on_operand, a, err);
}

// ==== the run =================================================================================

typedef struct eval_run {
    eval_args args;
    lm_progress progress;
    lm_model *model;
    lm_adapter *adapter;
    lm_calib data;
    int64_t seq_len;      // in effect (0: none)
    lm_fwd_seq *seqs;     // (data.n_seqs)
    int64_t n_pred;       // next-token predictions
    lm_dev *dev;
    char dev_why[512];
    lm_fwd_runner runner;
    float *nll;           // (data.n_tokens)
} eval_run;

static void run_free(eval_run *r)
{
    lm_fwd_runner_free(&r->runner);
    lm_dev_free(r->dev);
    free(r->nll);
    free(r->seqs);
    lm_calib_free(&r->data);
    lm_adapter_free(r->adapter);
    lm_model_free(r->model);
    lm_progress_free(&r->progress);
}

// Opens what `path` names as `want` (a model or an adapter directory); *resolved (caller frees)
// is the directory to open.
static lm_status detect(const char *what, const char *path, lm_input_kind want, char **resolved, lm_err *err)
{
    lm_input_kind kind;
    lm_status s = lm_input_detect(path, &kind, resolved, err);
    if (s != LM_OK)
        return lm_err_prefix(err, "%s", what);
    if (kind == want)
        return LM_OK;
    free(*resolved);
    *resolved = NULL;
    if (want == LM_INPUT_MODEL && kind == LM_INPUT_ADAPTER)
        return lm_err_set(err, LM_ERR_USAGE, "%s %s is an adapter directory: give its base model as MODEL and the "
                          "adapter with --adapter", what, path);
    return lm_err_set(err, LM_ERR_USAGE, "%s %s is %s %s, not %s", what, path,
                      kind == LM_INPUT_ADAPTER ? "an" : "a", lm_input_kind_name(kind),
                      want == LM_INPUT_MODEL ? "a model directory" : "an adapter directory");
}

// Everything before the work: inputs opened and checked, the data read, the device opened.
static lm_status prepare(eval_run *r, lm_err *err)
{
    eval_args *a = &r->args;
    lm_status s;
    if (!a->model)
        return lm_err_set(err, LM_ERR_USAGE, "needs MODEL (usage: llmerge eval MODEL [--adapter DIR] --data FILE)");
    if (!a->data)
        return lm_err_set(err, LM_ERR_USAGE, "no data: give --data FILE (.jsonl or .txt)");

    char *dir = NULL;
    if ((s = detect("MODEL", a->model, LM_INPUT_MODEL, &dir, err)) != LM_OK)
        return s;
    s = lm_model_open(&r->model, dir, err);
    free(dir);
    if (s != LM_OK)
        return s;
    if ((s = lm_model_check(r->model, NULL, err)) != LM_OK)
        return lm_err_prefix(err, "MODEL %s", a->model);
    if (a->adapter) {
        if ((s = detect("--adapter", a->adapter, LM_INPUT_ADAPTER, &dir, err)) != LM_OK)
            return s;
        s = lm_adapter_open(&r->adapter, dir, err);
        free(dir);
        if (s != LM_OK)
            return s;
        if ((s = lm_adapter_validate(r->adapter, r->model, err)) != LM_OK)
            return lm_err_prefix(err, "--adapter %s does not fit MODEL %s", a->adapter, a->model);
    }
    if ((s = lm_fwd_check(r->model, r->adapter, err)) != LM_OK)
        return s;

    const lm_config *cfg = &r->model->config;
    r->seq_len = a->seq_len ? a->seq_len : cfg->max_position_embeddings > 1 ? cfg->max_position_embeddings : 0;
    lm_calib_opts co = {.max_samples = a->samples, .max_len = r->seq_len, .vocab_size = cfg->vocab_size};
    if ((s = lm_calib_load(&r->data, a->data, &co, err)) != LM_OK)
        return s;
    if (!(r->seqs = calloc((size_t)r->data.n_seqs, sizeof *r->seqs)) ||
        !(r->nll = calloc((size_t)r->data.n_tokens, sizeof *r->nll)))
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    for (int64_t i = 0; i < r->data.n_seqs; i++) {
        r->seqs[i].ids = r->data.ids + r->data.offsets[i];
        r->seqs[i].len = r->data.offsets[i + 1] - r->data.offsets[i];
        r->n_pred += r->seqs[i].len - 1;
    }
    if (r->n_pred == 0)
        return lm_err_set(err, LM_ERR_FORMAT, "%s: no next-token predictions (every sequence has one token)",
                          a->data);

    lm_dev_opts o = {.threads = a->threads, .mem_cap = a->gpu_mem, .sim_fail = getenv("LLMERGE_SIM_FAIL")};
    return lm_dev_open(&r->dev, a->device, &o, r->dev_why, sizeof r->dev_why, err);
}

static void on_note(void *ctx, const char *line)
{
    lm_progress_note(ctx, "%s", line);
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
    const lm_fwd_runner *u = &r->runner;
    cJSON *o = cJSON_CreateObject(), *fb = NULL;
    bool ok = o && cJSON_AddNumberToObject(o, "perplexity", ppl) && cJSON_AddNumberToObject(o, "nll_mean", nll_mean) &&
              cJSON_AddNumberToObject(o, "tokens", (double)r->n_pred) &&
              cJSON_AddNumberToObject(o, "sequences", (double)r->data.n_seqs) &&
              cJSON_AddNumberToObject(o, "sequences_cut", (double)r->data.n_cut) &&
              cJSON_AddStringToObject(o, "model", r->args.model) &&
              (r->args.adapter ? cJSON_AddStringToObject(o, "adapter", r->args.adapter)
                               : cJSON_AddNullToObject(o, "adapter")) &&
              cJSON_AddStringToObject(o, "data", r->args.data) &&
              (r->seq_len ? cJSON_AddNumberToObject(o, "seq_len", (double)r->seq_len)
                          : cJSON_AddNullToObject(o, "seq_len")) &&
              cJSON_AddStringToObject(o, "device", lm_dev_name(r->dev)) &&
              (fb = cJSON_AddObjectToObject(o, "fallbacks")) &&
              cJSON_AddBoolToObject(fb, "weights_on_cpu", u->weights_fell_back) &&
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
static int work(eval_run *r)
{
    eval_args *a = &r->args;
    lm_progress *p = &r->progress;
    lm_err err = {0};
    char threads[32] = "";
    if (r->dev->threads > 0)
        snprintf(threads, sizeof threads, ", %d thread%s", r->dev->threads, r->dev->threads == 1 ? "" : "s");
    lm_progress_note(p, "evaluating %s%s%s on %s: %" PRId64 " sequence%s, %" PRId64 " tokens (%s%s)", a->model,
                     a->adapter ? " with " : "", a->adapter ? a->adapter : "", a->data, r->data.n_seqs,
                     r->data.n_seqs == 1 ? "" : "s", r->data.n_tokens, r->dev_why, threads);
    if (r->data.n_cut)
        lm_progress_note(p, "note: %" PRId64 " sequence%s cut to %" PRId64 " tokens (--seq-len)", r->data.n_cut,
                         r->data.n_cut == 1 ? "" : "s", r->seq_len);
    if (a->gpu_mem && strcmp(lm_dev_name(r->dev), "cpu") == 0)
        lm_progress_note(p, "note: --gpu-mem has no effect on the cpu device");

    double t0 = lm_progress_now();
    lm_signals_install();  // Ctrl-C stops at the next layer: exit 128 + the signal, no result
    lm_status s = lm_fwd_runner_init(&r->runner, r->model, r->adapter, r->dev, "eval", a->model, 0, on_note, p, &err);
    r->runner.sticky = a->sticky;
    if (s != LM_OK) {
        int code = lm_status_exit_code(s);
        lm_progress_error(p, code, "%s", err.msg);
        return code;
    }
    r->runner.progress = on_progress;
    r->runner.progress_ctx = p;
    lm_progress_start(p, "sequence", r->data.n_seqs, 0);
    lm_fwd_req req = {.nll = r->nll, .hook = check_interrupt};
    s = lm_fwd_runner_run(&r->runner, r->seqs, r->data.n_seqs, &req, &err);
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
    double secs = lm_progress_now() - t0;

    // Summed in sequence order in double: the same total whatever ran where.
    double sum = 0;
    for (int64_t i = 0; i < r->data.n_tokens; i++)
        sum += r->nll[i];
    double mean = sum / (double)r->n_pred, ppl = exp(mean);
    const lm_fwd_runner *u = &r->runner;
    lm_progress_note(p, "%" PRId64 " predictions in %.2f s (%.0f tokens/s) on %s", r->n_pred, secs,
                     secs > 0 ? (double)r->data.n_tokens / secs : 0.0,
                     u->weights_fell_back ? "cpu" : lm_dev_name(r->dev));
    if (u->n_halved || u->n_seq_cpu)
        lm_progress_note(p, "fallbacks: %" PRId64 " batch%s halved, %" PRId64 " sequence%s (%" PRId64 " tokens) on "
                         "cpu, %.2f s", u->n_halved, u->n_halved == 1 ? "" : "es", u->n_seq_cpu,
                         u->n_seq_cpu == 1 ? "" : "s", u->tokens_cpu, u->fallback_s);
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

int lm_cmd_eval(int argc, char **argv)
{
    eval_run r;
    memset(&r, 0, sizeof r);
    lm_progress_init(&r.progress, "llmerge eval", false);
    lm_err err = {0};
    int rc;
    if (argc < 2) {
        usage(stderr);
        rc = 2;
        goto done;
    }
    lm_status s = parse_args(&r.args, argc, argv, &err);
    if (s != LM_OK) {
        lm_progress_error(&r.progress, 2, "%s (see llmerge eval --help)", err.msg);
        rc = 2;
        goto done;
    }
    if (r.args.help) {
        usage(stdout);
        rc = 0;
        goto done;
    }
    r.progress.quiet = r.args.quiet;
    if ((s = prepare(&r, &err)) != LM_OK) {
        rc = lm_status_exit_code(s);
        lm_progress_error(&r.progress, rc, "%s", err.msg);
        goto done;
    }
    rc = work(&r);
done:
    run_free(&r);
    return rc;
}
