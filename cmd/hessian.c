// `llmerge hessian MODEL [--adapter DIR] --calib FILE -o H.safetensors [options]`: the input
// Hessians H = (2 / n_tokens) Σ x xᵀ of every distinct linear input of MODEL (with a LoRA adapter
// applied, not merged, when --adapter is given) over the calibration tokens (docs/hessian.md),
// written as one safetensors file: a float32 [in, in] tensor per input, named after its first
// consumer (model.layers.L.self_attn.q_proj, ...o_proj, ...mlp.gate_proj, ...mlp.down_proj),
// with n_tokens and the inputs in __metadata__.
//
// As in `llmerge eval`: everything that can be checked is checked before the work (exit status
// 2): the options, MODEL, the adapter, every line of the calibration file, the device, and the
// output path (it must not exist without --force). The forward pass runs through lm_fwd_runner
// with its fallbacks; accumulators that do not fit the device stay in host memory. A failure
// from then on is exit status 1. The file is streamed, one Hessian finished, written and freed
// at a time, into a temporary directory beside the output and renamed into place, so a failed
// run leaves nothing at the output path.
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
#include "command.h"
#include "device.h"
#include "forward.h"
#include "hessian.h"
#include "model.h"
#include "outdir.h"
#include "progress.h"
#include "signals.h"
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
            "  -o, --output FILE   the safetensors file to write (required); written in a\n"
            "                      temporary directory beside it (FILE.tmp-XXXXXX) and\n"
            "                      renamed into place\n"
            "  --force             overwrite FILE when it exists (default: refuse); never a file\n"
            "                      of MODEL or the adapter, nor the calibration file\n"
            "  --adapter DIR       apply the PEFT LoRA adapter DIR to MODEL (not merged): the\n"
            "                      Hessians of the fine-tuned model (DoRA too)\n"
            "  --calib FILE        the calibration tokens (required): FILE.jsonl with one\n"
            "                      {\"input_ids\": [...]} per line, or FILE.txt with one sequence of\n"
            "                      space-separated token ids per line; a regular file (a FIFO or\n"
            "                      device is refused); a bad line is an error naming the file and\n"
            "                      line\n"
            "  --calib-samples N   use the first N sequences of FILE (default: all)\n"
            "  --tokenizer DIR     the tokenizer.json for FILE's \"text\" lines (default:\n"
            "                      MODEL's own)\n"
            "  --data-format F     text: FILE is one text document, tokenized and cut into\n"
            "                      windows of --seq-len tokens (stride = window); ids: the\n"
            "                      default\n"
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
            "  --threads N         CPU threads (default 0: the cores it may use)\n"
            "  --log-json FILE     write one JSON object per event to FILE (JSON Lines): progress,\n"
            "                      fallbacks, errors (default: none); not inside an input\n"
            "  --sticky-fallback   once a sequence has gone to the CPU, run every later batch\n"
            "                      there too instead of trying the device again (default: try)\n"
            "  -q, --quiet         nothing on stderr but errors\n"
            "  -h, --help          this help\n"
            "\n"
            "Exit status: 0 done; 1 the work failed, or an input changed while it was read (nothing\n"
            "is left at the output path); 2 bad usage or bad input (a broken model, adapter or\n"
            "calibration file, an existing output without --force, an output or log inside an\n"
            "input), found before any work started; 128 + the signal when one stopped it.\n");
}

// ==== options =================================================================================

// hessian's own options; the rest are those of every command that runs a model (args.h).
typedef enum opt_id {
    OPT_OUTPUT, OPT_FORCE,
} opt_id;

static const lm_opt opt_defs[] = {
    {"output", 'o', true, OPT_OUTPUT},
    {"force", 0, false, OPT_FORCE},
    {"calib", 0, true, LM_RUN_OPT_DATA},
    {"log-json", 0, true, LM_RUN_OPT_LOG_JSON},
    LM_RUN_OPTS("calib-samples"),
};
#define N_OPTS (sizeof opt_defs / sizeof opt_defs[0])

typedef struct hess_args {
    lm_run_args run;   // MODEL, --adapter, --calib, --seq-len, --calib-samples, the device, -q, -h
    const char *output;
    bool force;
} hess_args;

// Applies hessian's own options, -o and --force (lm_opt_fn; ctx: the run, whose first member is
// its hess_args). Short options with a value (-o) take the rest of the word or the next word.
static lm_status apply_option(void *ctx, const lm_opt *d, const char *shown, const char *v, lm_err *err)
{
    hess_args *a = ctx;
    if (d->id == OPT_FORCE)
        a->force = true;
    else if (!*v)
        return lm_err_set(err, LM_ERR_USAGE, "%s needs a value", shown);
    else
        a->output = v;
    return LM_OK;
}

// ==== the run =================================================================================

typedef struct hess_run {
    hess_args args;       // first: apply_option takes the run for it
    lm_model_run run;     // its guard: the inputs, which neither -o nor --log-json may be, hold or lie inside
    lm_hess hess;
    int64_t n_out;        // tensors written: n_layers · LM_FWD_N_POINTS
    lm_st_desc *desc;     // (n_out)
    char **names;         // (n_out)
} hess_run;

static void run_free(void *ctx)
{
    hess_run *r = ctx;
    for (int64_t i = 0; r->names && i < r->n_out; i++)
        free(r->names[i]);
    free(r->names);
    free(r->desc);
    lm_hess_free(&r->hess);
    lm_cmd_model_run_free(&r->run);
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

// Everything before the work: inputs opened and checked, the data read, the device opened. The
// files of the inputs are guarded here, before -o is checked against them.
static lm_status prepare(void *ctx, bool *no_log, lm_err *err)
{
    hess_run *r = ctx;
    hess_args *a = &r->args;
    (void)no_log;
    lm_status s;
    if (!a->run.model)
        return lm_err_set(err, LM_ERR_USAGE, "needs MODEL (usage: llmerge hessian MODEL [--adapter DIR] --calib FILE "
                          "-o H.safetensors)");
    if (!a->run.data)
        return lm_err_set(err, LM_ERR_USAGE, "no calibration data: give --calib FILE (.jsonl or .txt)");
    if (!a->output)
        return lm_err_set(err, LM_ERR_USAGE, "no output: give -o H.safetensors");
    // never an input (checked again once the inputs' files are known), whatever --force says
    if ((s = lm_guard_check(&r->run.guard, "-o", a->output, err)) != LM_OK || (s = check_output(a, err)) != LM_OK)
        return s;
    s = lm_cmd_run_open(&a->run, &r->run.model, &r->run.adapter, err);
    lm_err gerr;
    if (lm_cmd_guard_model(&r->run.guard, "MODEL", r->run.model, &gerr) != LM_OK ||
        lm_cmd_guard_adapter(&r->run.guard, "--adapter", r->run.adapter, &gerr) != LM_OK)
        return s != LM_OK ? s : lm_err_set(err, LM_ERR_NOMEM, "%s", gerr.msg);
    if (s != LM_OK || (s = lm_guard_check(&r->run.guard, "-o", a->output, err)) != LM_OK ||
        (s = lm_cmd_run_tokens(&a->run, r->run.model, a->run.data, &r->run.data, &r->run.seq_len, &r->run.seqs,
                               err)) != LM_OK)
        return s;

    // the output's tensors, named and sized before any work
    const lm_config *cfg = &r->run.model->config;
    r->n_out = cfg->num_hidden_layers * LM_FWD_N_POINTS;
    if (!(r->desc = calloc((size_t)r->n_out, sizeof *r->desc)) || !(r->names = calloc((size_t)r->n_out, sizeof *r->names)))
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
    return lm_cmd_run_device(&a->run, &r->run.dev, r->run.dev_why, sizeof r->run.dev_why, err);
}

static void on_progress(void *ctx, int64_t done)
{
    lm_progress_update(ctx, done, 0, NULL);
}

// The accumulators: on the device the weights run on, as many as fit with room for a full
// batch's activations; the rest in host memory, said as a fallback.
static lm_status place_accumulators(hess_run *r, lm_err *err)
{
    lm_fwd_runner *u = &r->run.runner;
    lm_dev *dev = u->on_dev ? r->run.dev : NULL;
    size_t reserve = 0;
    if (u->on_dev) {
        int64_t longest = 0;
        for (int64_t i = 0; i < r->run.data.n_seqs; i++)
            longest = r->run.seqs[i].len > longest ? r->run.seqs[i].len : longest;
        int64_t batch = r->run.data.n_tokens < u->max_tokens ? r->run.data.n_tokens : u->max_tokens;
        reserve = lm_fwd_arena_bytes(u->on_dev, batch > longest ? batch : longest);
        if (reserve == SIZE_MAX)
            reserve = 0;
    }
    lm_status s = lm_hess_init(&r->hess, r->run.model, r->run.dev, dev != NULL, reserve, err);
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
        lm_progress_fallback(&r->run.progress, &(lm_fallback){"hessian", unit, lm_dev_name(dev), "cpu", reason});
    }
    return LM_OK;
}

// Writes the output as one safetensors file, streamed: one Hessian at a time is finished
// (lm_hess_get), written at its offset and its accumulators freed, so memory never holds the
// finished copies of all of them beside the accumulators. The file is written inside a
// temporary directory beside the output (OUTPUT.tmp-XXXXXX, the writer's single shard) and
// renamed into place; a failure removes the directory, leaving nothing at the output path.
static lm_status write_hessians(hess_run *r, lm_err *err)
{
    hess_args *a = &r->args;
    char n_tokens[32], n_seqs[32], seq_len[32];
    snprintf(n_tokens, sizeof n_tokens, "%" PRId64, r->hess.n_tokens);
    snprintf(n_seqs, sizeof n_seqs, "%" PRId64, r->run.data.n_seqs);
    snprintf(seq_len, sizeof seq_len, "%" PRId64, r->run.seq_len);
    const char *meta[] = {"n_tokens", n_tokens, "n_sequences", n_seqs, "seq_len", seq_len, "model", a->run.model,
                          "calib", a->run.data, "llmerge", "hessian " LLMERGE_VERSION, "adapter", a->run.adapter, NULL};
    if (!a->run.adapter)
        meta[12] = NULL;  // no adapter key at all
    int64_t most = 0;
    for (int64_t i = 0; i < r->n_out; i++)
        most = r->desc[i].shape[0] > most ? r->desc[i].shape[0] : most;
    char *tmp = lm_strfmt("%s.tmp-XXXXXX", a->output), *file = NULL;
    float *H = malloc((size_t)(most * most) * sizeof *H);
    lm_st_writer *w = NULL;
    lm_status s = LM_OK;
    int tmp_id = 0;
    if (!tmp || !H) {
        s = lm_err_set(err, LM_ERR_NOMEM, "out of memory for a Hessian of %" PRId64 " x %" PRId64, most, most);
        goto out;
    }
    // From here a signal ends the run at once (nothing polls while the file is written), and
    // the handler removes the temporary directory first; so does SIGBUS.
    lm_signals_install_fatal();
    lm_signals_hold();
    bool made = mkdtemp(tmp) != NULL;
    int e = errno;
    if (made)
        tmp_id = lm_signals_remove_on_exit(tmp, true);
    lm_signals_release();
    if (!made) {
        s = lm_err_set(err, LM_ERR_IO, "%s: %s", tmp, strerror(e));
        tmp[0] = '\0';  // nothing of ours to remove
        goto out;
    }
    // no shard limit: the writer's one file, laid out as lm_st_write_file lays it out
    if ((s = lm_st_writer_open(&w, tmp, r->desc, r->n_out, UINT64_MAX, meta, err)) != LM_OK)
        goto out;
    for (int64_t i = 0; i < r->n_out; i++) {
        int64_t layer = i / LM_FWD_N_POINTS, d = r->desc[i].shape[0];
        lm_fwd_point pt = (lm_fwd_point)(i % LM_FWD_N_POINTS);
        if ((s = lm_hess_get(&r->hess, layer, pt, H, err)) != LM_OK)
            goto out;
        lm_hess_release(&r->hess, layer, pt);
        if ((s = lm_st_writer_put(w, i, H, (uint64_t)(d * d) * sizeof(float), err)) != LM_OK)
            goto out;
    }
    char shard[64];
    if ((s = lm_st_writer_finish(w, err)) != LM_OK)
        goto out;
    if (!(file = lm_path_join(tmp, lm_shard_name(shard, sizeof shard, 0, 1)))) {
        s = lm_err_set(err, LM_ERR_NOMEM, "out of memory");
        goto out;
    }
    // the file was fsynced by the writer; after the rename, the directory that now holds it
    if (rename(file, a->output) != 0)
        s = lm_err_set(err, LM_ERR_IO, "%s: renaming %s into place: %s", a->output, file, strerror(errno));
    else
        s = lm_outdir_sync_parent(a->output, err);
out:
    lm_st_writer_free(w);
    if (tmp && tmp[0]) {
        lm_err rerr = {0};
        lm_rm_rf(tmp, &rerr);
    }
    lm_signals_forget(tmp_id);
    lm_signals_restore();
    free(file);
    free(tmp);
    free(H);
    return s;
}

// The work: the model placed, every batch run, the Hessians written. Returns the exit status.
static int work(void *ctx)
{
    hess_run *r = ctx;
    hess_args *a = &r->args;
    lm_progress *p = &r->run.progress;
    lm_err err = {0};
    lm_status s = lm_cmd_model_run_begin(&r->run, &a->run, "capturing Hessians of", "hessian", &err);
    if (s == LM_OK)
        s = place_accumulators(r, &err);
    if (s != LM_OK) {
        lm_progress_error(p, 1, "%s", err.msg);
        return 1;
    }
    r->run.runner.progress = on_progress;
    r->run.runner.progress_ctx = p;
    lm_progress_start(p, "sequence", r->run.data.n_seqs, 0);
    s = lm_hess_capture(&r->hess, &r->run.runner, r->run.seqs, r->run.data.n_seqs, &err);
    lm_progress_end(p);
    // A device runs the last batches' products after lm_hess_capture returns: the capture's
    // time is taken once they are done
    if (s == LM_OK)
        s = lm_dev_sync(r->run.dev, &err);
    if (s == LM_OK && r->hess.n_tokens != r->run.data.n_tokens)
        s = lm_err_set(&err, LM_ERR_DEVICE, "captured %" PRId64 " tokens of %" PRId64, r->hess.n_tokens,
                       r->run.data.n_tokens);
    if (s != LM_OK) {
        lm_progress_error(p, 1, "%s", err.msg);
        return 1;
    }
    double t_capture = lm_now() - r->run.t0;
    // The weights are done with (the runner keeps its counts): their memory goes before 5 GB
    // of Hessians pass through the page cache.
    lm_fwd_runner_free(&r->run.runner);

    if ((s = write_hessians(r, &err)) != LM_OK) {
        lm_progress_error(p, 1, "%s", err.msg);
        return 1;
    }
    double secs = lm_now() - r->run.t0;
    const lm_fwd_runner *u = &r->run.runner;
    lm_progress_note(p, "%" PRId64 " tokens captured in %.2f s (%.0f tokens/s) on %s; %" PRId64 " Hessians finished "
                     "and written to %s in %.2f s more", r->hess.n_tokens, t_capture,
                     t_capture > 0 ? (double)r->hess.n_tokens / t_capture : 0.0,
                     u->weights_fell_back ? "cpu" : lm_dev_name(r->run.dev), r->n_out, a->output, secs - t_capture);
    lm_cmd_run_fallbacks(p, u);
    return 0;
}

// ==== the entry (command.h) ===================================================================

static const lm_model_command command = {
    .prefix = "llmerge hessian", .opts = opt_defs, .n_opts = N_OPTS, .min_seq_len = 1, .option = apply_option,
    .usage = usage, .prepare = prepare, .work = work, .cleanup = run_free,
};

int lm_cmd_hessian(int argc, char **argv)
{
    hess_run r;
    memset(&r, 0, sizeof r);
    return lm_command_run_model(&command, &r, &r.run, &r.args.run, argc, argv);
}
