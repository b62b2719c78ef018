// `llmerge hessian MODEL [--adapter DIR] --calib FILE -o H.safetensors [options]`: the input
// Hessians H = (2 / n_tokens) Σ x xᵀ of every distinct linear input of MODEL (with a LoRA adapter
// applied, not merged, when --adapter is given) over the calibration tokens (METHODS.md
// "Hessians (activation capture)"), written as one safetensors file: a float32 [in, in] tensor
// per input, named after its first consumer (model.layers.L.self_attn.q_proj, ...o_proj,
// ...mlp.gate_proj, ...mlp.down_proj), with n_tokens and the inputs in __metadata__.
//
// As in `llmerge eval`: everything that can be checked is checked before the work (exit status
// 2): the options, MODEL, the adapter, every line of the calibration file, the device, and the
// output path (it must not exist without --force). The forward pass runs through lm_fwd_runner
// with its fallbacks; accumulators that do not fit the device stay in host memory. A failure
// from then on is exit status 1, and the file is written through a temporary file renamed into
// place, so a failed run leaves nothing at the output path.
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "adapter.h"
#include "calib.h"
#include "args.h"
#include "cmd.h"
#include "device.h"
#include "forward.h"
#include "hessian.h"
#include "model.h"
#include "progress.h"
#include "st_writer.h"
#include "status.h"
#include "util.h"


static void usage(FILE *out)
{
    fprintf(out,
            "Usage: llmerge hessian MODEL [--adapter DIR] --calib FILE -o H.safetensors [options]\n"
            "\n"
            "The input Hessians of MODEL's linear layers, H = (2 / n_tokens) sum x x^T over every\n"
            "calibration token x (no padding), for each distinct linear input: per layer those of\n"
            "self_attn.q_proj (shared by k_proj and v_proj), self_attn.o_proj, mlp.gate_proj\n"
            "(shared by up_proj) and mlp.down_proj. MODEL is a Hugging Face model directory\n"
            "(LlamaForCausalLM, MistralForCausalLM or Qwen2ForCausalLM). The output is one\n"
            "safetensors file with a float32 [in, in] tensor per input, named after its first\n"
            "consumer (model.layers.0.self_attn.q_proj, ...), and n_tokens in __metadata__.\n"
            "\n"
            "Options (also as --name=value):\n"
            "  -o, --output FILE   the safetensors file to write (required); written to a\n"
            "                      temporary file beside it and renamed into place\n"
            "  --force             overwrite FILE when it exists (default: refuse)\n"
            "  --adapter DIR       apply the PEFT LoRA adapter DIR to MODEL (not merged): the\n"
            "                      Hessians of the fine-tuned model; DoRA is not supported yet\n"
            "  --calib FILE        the calibration tokens (required): FILE.jsonl with one\n"
            "                      {\"input_ids\": [...]} per line, or FILE.txt with one sequence of\n"
            "                      space-separated token ids per line; a bad line is an error\n"
            "                      naming the file and line\n"
            "  --calib-samples N   use the first N sequences of FILE (default: all)\n"
            "  --seq-len L         cut longer sequences to L tokens (default: the model's\n"
            "                      max_position_embeddings)\n"
            "  --device DEV        where the work runs: auto, cpu, cuda[:N] or sim:SIZE (default\n"
            "                      auto: CUDA device 0 when usable, else the CPU). Weights that do\n"
            "                      not fit the device run on the CPU; a batch that does not fit is\n"
            "                      halved, one sequence that still does not fit runs on the CPU;\n"
            "                      Hessian accumulators that do not fit stay in host memory (each\n"
            "                      said on stderr as 'fallback:')\n"
            "  --gpu-mem SIZE      most device memory to use (default: all free); SIZE is bytes\n"
            "                      with K, M, G, KiB, MiB, GiB (powers of 1024) or KB, MB, GB\n"
            "  --threads N         CPU threads (default 0: all cores)\n"
            "  --log-json FILE     write one JSON object per event to FILE (JSON Lines): progress,\n"
            "                      fallbacks, errors (default: none)\n"
            "  --sticky-fallback   once a sequence has gone to the CPU, run every later batch\n"
            "                      there too instead of trying the device again (default: try)\n"
            "  -q, --quiet         nothing on stderr but errors\n"
            "  -h, --help          this help\n"
            "\n"
            "Exit status: 0 done; 1 the work failed (nothing is left at the output path); 2 bad\n"
            "usage or bad input (a broken model, adapter or calibration file, an existing output\n"
            "without --force), found before any work started.\n");
}

// ==== options =================================================================================

typedef enum opt_id {
    OPT_OUTPUT, OPT_FORCE, OPT_ADAPTER, OPT_CALIB, OPT_SAMPLES, OPT_SEQ_LEN, OPT_DEVICE, OPT_GPU_MEM,
    OPT_THREADS, OPT_LOG_JSON, OPT_QUIET, OPT_STICKY, OPT_HELP,
} opt_id;

typedef lm_opt opt_def;

static const opt_def opt_defs[] = {
    {"output", 'o', true, OPT_OUTPUT},       {"force", 0, false, OPT_FORCE},
    {"adapter", 0, true, OPT_ADAPTER},       {"calib", 0, true, OPT_CALIB},
    {"calib-samples", 0, true, OPT_SAMPLES}, {"seq-len", 0, true, OPT_SEQ_LEN},
    {"device", 0, true, OPT_DEVICE},         {"gpu-mem", 0, true, OPT_GPU_MEM},
    {"threads", 0, true, OPT_THREADS},       {"log-json", 0, true, OPT_LOG_JSON},
    {"quiet", 'q', false, OPT_QUIET},        {"help", 'h', false, OPT_HELP},
    {"sticky-fallback", 0, false, OPT_STICKY},
};
#define N_OPTS (sizeof opt_defs / sizeof opt_defs[0])

typedef struct hess_args {
    const char *model, *adapter, *calib, *output, *device, *log_json;
    int64_t seq_len;   // 0: not given
    int64_t samples;   // 0: all
    uint64_t gpu_mem;  // 0: not given
    int threads;
    bool force, quiet, help, sticky;
} hess_args;

// Applies option `d` with value `v` (NULL for a flag); `shown` is how the user wrote it.
static lm_status apply_option(void *ctx, const lm_opt *d, const char *shown, const char *v, lm_err *err)
{
    hess_args *a = ctx;
    switch (d->id) {
    case OPT_OUTPUT:
    case OPT_ADAPTER:
    case OPT_CALIB:
    case OPT_DEVICE:
    case OPT_LOG_JSON:
        if (!*v)
            return lm_err_set(err, LM_ERR_USAGE, "%s needs a value", shown);
        *(d->id == OPT_OUTPUT    ? &a->output
          : d->id == OPT_ADAPTER ? &a->adapter
          : d->id == OPT_CALIB   ? &a->calib
          : d->id == OPT_DEVICE  ? &a->device
                                 : &a->log_json) = v;
        return LM_OK;
    case OPT_SEQ_LEN:
        if (!lm_cmd_parse_int(v, 1, INT32_MAX, &a->seq_len))
            return lm_err_set(err, LM_ERR_USAGE, "%s '%s': a whole number of tokens from 1 to %d is needed", shown,
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
    case OPT_FORCE:
        a->force = true;
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
    hess_args *a = ctx;
    if (a->model)
        return lm_err_set(err, LM_ERR_USAGE, "one MODEL only ('%s' and '%s'); an adapter goes with --adapter",
                          a->model, arg);
    a->model = arg;
    return LM_OK;
}

// Parses argv into *a (zeroed by the caller): MODEL anywhere among the options, "--" ends them.
// Short options with a value (-o) take the rest of the word or the next word.
static lm_status parse_args(hess_args *a, int argc, char **argv, lm_err *err)
{
    a->device = "auto";
    return lm_cmd_scan(argc, argv, opt_defs, N_OPTS, apply_option, on_operand, a, err);
}

// ==== the run =================================================================================

typedef struct hess_run {
    hess_args args;
    lm_progress progress;
    lm_model *model;
    lm_adapter *adapter;
    lm_calib data;
    int64_t seq_len;      // in effect (0: none)
    lm_fwd_seq *seqs;     // (data.n_seqs)
    lm_dev *dev;
    char dev_why[512];
    lm_fwd_runner runner;
    lm_hess hess;
    int64_t n_out;        // tensors written: n_layers · LM_FWD_N_POINTS
    lm_st_desc *desc;     // (n_out)
    char **names;         // (n_out)
    float **data_out;     // (n_out) host [in, in]
} hess_run;

static void run_free(hess_run *r)
{
    for (int64_t i = 0; i < r->n_out; i++) {
        if (r->names)
            free(r->names[i]);
        if (r->data_out)
            free(r->data_out[i]);
    }
    free(r->names);
    free(r->data_out);
    free(r->desc);
    lm_hess_free(&r->hess);
    lm_fwd_runner_free(&r->runner);
    lm_dev_free(r->dev);
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

// The output path: not a directory, not an existing file without --force, in a directory that
// exists.
static lm_status check_output(const hess_args *a, lm_err *err)
{
    const char *o = a->output;
    if (lm_is_dir(o))
        return lm_err_set(err, LM_ERR_USAGE, "-o %s is a directory; the output is one safetensors file", o);
    if (lm_is_file(o) && !a->force)
        return lm_err_set(err, LM_ERR_USAGE, "-o %s exists (give --force to overwrite it)", o);
    const char *base = lm_path_base(o);
    if (base == o)
        return LM_OK;
    char *dir = lm_strfmt("%.*s", (int)(base - o), o);
    if (!dir)
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    bool ok = lm_is_dir(dir);
    free(dir);
    if (!ok)
        return lm_err_set(err, LM_ERR_USAGE, "-o %s: its directory does not exist", o);
    return LM_OK;
}

// Everything before the work: inputs opened and checked, the data read, the device opened.
static lm_status prepare(hess_run *r, lm_err *err)
{
    hess_args *a = &r->args;
    lm_status s;
    if (!a->model)
        return lm_err_set(err, LM_ERR_USAGE, "needs MODEL (usage: llmerge hessian MODEL [--adapter DIR] --calib FILE "
                          "-o H.safetensors)");
    if (!a->calib)
        return lm_err_set(err, LM_ERR_USAGE, "no calibration data: give --calib FILE (.jsonl or .txt)");
    if (!a->output)
        return lm_err_set(err, LM_ERR_USAGE, "no output: give -o H.safetensors");
    if ((s = check_output(a, err)) != LM_OK)
        return s;

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
    if ((s = lm_calib_load(&r->data, a->calib, &co, err)) != LM_OK)
        return s;
    if (!(r->seqs = calloc((size_t)r->data.n_seqs, sizeof *r->seqs)))
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    for (int64_t i = 0; i < r->data.n_seqs; i++) {
        r->seqs[i].ids = r->data.ids + r->data.offsets[i];
        r->seqs[i].len = r->data.offsets[i + 1] - r->data.offsets[i];
    }

    // the output's tensors, named and sized before any work
    r->n_out = cfg->num_hidden_layers * LM_FWD_N_POINTS;
    if (!(r->desc = calloc((size_t)r->n_out, sizeof *r->desc)) || !(r->names = calloc((size_t)r->n_out, sizeof *r->names)) ||
        !(r->data_out = calloc((size_t)r->n_out, sizeof *r->data_out)))
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    int64_t dims[LM_FWD_N_POINTS] = {cfg->hidden_size, cfg->num_attention_heads * cfg->head_dim, cfg->hidden_size,
                                     cfg->intermediate_size};
    for (int64_t l = 0; l < cfg->num_hidden_layers; l++)
        for (int p = 0; p < LM_FWD_N_POINTS; p++) {
            int64_t i = lm_hess_index(l, (lm_fwd_point)p);
            char name[128];
            if (!(r->names[i] = lm_strdup(lm_hess_name(name, sizeof name, l, (lm_fwd_point)p))))
                return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
            r->desc[i] = (lm_st_desc){.name = r->names[i], .dtype = LM_DTYPE_F32, .ndim = 2, .shape = {dims[p], dims[p]}};
        }

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
}

// The accumulators: on the device the weights run on, as many as fit with room for a full
// batch's activations; the rest in host memory, said as a fallback.
static lm_status place_accumulators(hess_run *r, lm_err *err)
{
    lm_fwd_runner *u = &r->runner;
    lm_dev *dev = u->on_dev ? r->dev : NULL;
    size_t reserve = 0;
    if (u->on_dev) {
        int64_t longest = 0;
        for (int64_t i = 0; i < r->data.n_seqs; i++)
            longest = r->seqs[i].len > longest ? r->seqs[i].len : longest;
        int64_t batch = r->data.n_tokens < u->max_tokens ? r->data.n_tokens : u->max_tokens;
        reserve = lm_fwd_arena_bytes(u->on_dev, batch > longest ? batch : longest);
        if (reserve == SIZE_MAX)
            reserve = 0;
    }
    lm_status s = lm_hess_init(&r->hess, r->model, dev, reserve, r->args.threads, err);
    if (s != LM_OK)
        return s;
    lm_hess *h = &r->hess;
    if (dev && h->n_host) {
        int64_t first = (h->n_layers * LM_FWD_N_POINTS - h->n_host) / LM_FWD_N_POINTS;
        char unit[96], reason[256], b[32];
        snprintf(unit, sizeof unit, "accumulators of layers %" PRId64 "-%" PRId64, first, h->n_layers - 1);
        size_t fr = 0, tot = 0;
        lm_dev_mem_info(dev, &fr, &tot);
        snprintf(reason, sizeof reason, "%s out of memory: %s free, kept for activations", lm_dev_name(dev),
                 lm_format_bytes(b, sizeof b, fr));
        lm_progress_fallback(&r->progress, "hessian", unit, lm_dev_name(dev), "cpu", reason);
    }
    return LM_OK;
}

// The work: the model placed, every batch run, the Hessians written. Returns the exit status.
static int work(hess_run *r)
{
    hess_args *a = &r->args;
    lm_progress *p = &r->progress;
    lm_err err = {0};
    char threads[32] = "";
    if (r->dev->threads > 0)
        snprintf(threads, sizeof threads, ", %d thread%s", r->dev->threads, r->dev->threads == 1 ? "" : "s");
    lm_progress_note(p, "capturing Hessians of %s%s%s on %s: %" PRId64 " sequence%s, %" PRId64 " tokens (%s%s)",
                     a->model, a->adapter ? " with " : "", a->adapter ? a->adapter : "", a->calib, r->data.n_seqs,
                     r->data.n_seqs == 1 ? "" : "s", r->data.n_tokens, r->dev_why, threads);
    if (r->data.n_cut)
        lm_progress_note(p, "note: %" PRId64 " sequence%s cut to %" PRId64 " tokens (--seq-len)", r->data.n_cut,
                         r->data.n_cut == 1 ? "" : "s", r->seq_len);
    if (a->gpu_mem && strcmp(lm_dev_name(r->dev), "cpu") == 0)
        lm_progress_note(p, "note: --gpu-mem has no effect on the cpu device");

    double t0 = lm_progress_now();
    lm_status s = lm_fwd_runner_init(&r->runner, r->model, r->adapter, r->dev, "hessian", a->model, 0, on_note, p,
                                     &err);
    r->runner.sticky = a->sticky;
    if (s == LM_OK)
        s = place_accumulators(r, &err);
    if (s != LM_OK) {
        lm_progress_error(p, 1, "%s", err.msg);
        return 1;
    }
    r->runner.progress = on_progress;
    r->runner.progress_ctx = p;
    lm_progress_start(p, "sequence", r->data.n_seqs, 0);
    s = lm_hess_capture(&r->hess, &r->runner, r->seqs, r->data.n_seqs, &err);
    lm_progress_end(p);
    if (s == LM_OK && r->hess.n_tokens != r->data.n_tokens)
        s = lm_err_set(&err, LM_ERR_DEVICE, "captured %" PRId64 " tokens of %" PRId64, r->hess.n_tokens,
                       r->data.n_tokens);
    if (s != LM_OK) {
        lm_progress_error(p, 1, "%s", err.msg);
        return 1;
    }
    double t_capture = lm_progress_now() - t0;

    for (int64_t i = 0; i < r->n_out; i++) {
        int64_t d = r->desc[i].shape[0];
        if (!(r->data_out[i] = malloc((size_t)(d * d) * sizeof(float)))) {
            lm_progress_error(p, 1, "out of memory for the Hessian of %s", r->names[i]);
            return 1;
        }
        if ((s = lm_hess_get(&r->hess, i / LM_FWD_N_POINTS, (lm_fwd_point)(i % LM_FWD_N_POINTS), r->data_out[i],
                             &err)) != LM_OK) {
            lm_progress_error(p, 1, "%s", err.msg);
            return 1;
        }
    }
    char n_tokens[32], n_seqs[32], seq_len[32];
    snprintf(n_tokens, sizeof n_tokens, "%" PRId64, r->hess.n_tokens);
    snprintf(n_seqs, sizeof n_seqs, "%" PRId64, r->data.n_seqs);
    snprintf(seq_len, sizeof seq_len, "%" PRId64, r->seq_len);
    const char *meta[] = {"n_tokens", n_tokens, "n_sequences", n_seqs, "seq_len", seq_len, "model", a->model,
                          "calib", a->calib, "llmerge", "hessian " LLMERGE_VERSION, "adapter", a->adapter, NULL};
    if (!a->adapter)
        meta[12] = NULL;  // no adapter key at all
    if ((s = lm_st_write_file(a->output, r->desc, (const void *const *)r->data_out, r->n_out, meta, &err)) != LM_OK) {
        lm_progress_error(p, 1, "%s", err.msg);
        return 1;
    }
    double secs = lm_progress_now() - t0;
    const lm_fwd_runner *u = &r->runner;
    lm_progress_note(p, "%" PRId64 " tokens captured in %.2f s (%.0f tokens/s) on %s; %" PRId64 " Hessians written to "
                     "%s in %.2f s", r->hess.n_tokens, t_capture, t_capture > 0 ? (double)r->hess.n_tokens / t_capture : 0.0,
                     u->weights_fell_back ? "cpu" : lm_dev_name(r->dev), r->n_out, a->output, secs);
    if (u->n_halved || u->n_seq_cpu)
        lm_progress_note(p, "fallbacks: %" PRId64 " batch%s halved, %" PRId64 " sequence%s (%" PRId64 " tokens) on "
                         "cpu, %.2f s", u->n_halved, u->n_halved == 1 ? "" : "es", u->n_seq_cpu,
                         u->n_seq_cpu == 1 ? "" : "s", u->tokens_cpu, u->fallback_s);
    return 0;
}

// The last --log-json value in argv (before "--"), so that errors of the parsing itself are
// logged too; parse_args checks it properly.
static const char *find_log_json(int argc, char **argv)
{
    const char *v = NULL;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--") == 0)
            break;
        if (strcmp(argv[i], "--log-json") == 0 && i + 1 < argc)
            v = argv[++i];
        else if (strncmp(argv[i], "--log-json=", 11) == 0)
            v = argv[i] + 11;
    }
    return v;
}

int lm_cmd_hessian(int argc, char **argv)
{
    hess_run r;
    memset(&r, 0, sizeof r);
    lm_progress_init(&r.progress, "llmerge hessian", false);
    lm_err err = {0};
    int rc;
    if (argc < 2) {
        usage(stderr);
        rc = 2;
        goto done;
    }
    const char *log_json = find_log_json(argc, argv);
    if (log_json && *log_json && lm_progress_log_open(&r.progress, log_json, &err) != LM_OK) {
        lm_progress_error(&r.progress, 2, "--log-json: %s", err.msg);
        rc = 2;
        goto done;
    }
    lm_status s = parse_args(&r.args, argc, argv, &err);
    if (s != LM_OK) {
        lm_progress_error(&r.progress, 2, "%s (see llmerge hessian --help)", err.msg);
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
