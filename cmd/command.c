// The entry skeleton of the subcommands that do a run (command.h).
#include "command.h"

#include <signal.h>
#include <stdlib.h>
#include <string.h>

#include "card.h"
#include "signals.h"
#include "util.h"

int lm_command_run(const lm_command *c, int argc, char **argv)
{
    lm_progress *p = c->progress;
    lm_progress_init(p, c->prefix, false);
    lm_err err = {0}, log_err = {0};
    int rc;
    if (argc < 2) {
        c->usage(stderr, c->usage_arg);
        rc = 2;
        goto done;
    }
    const char *log_json = lm_cmd_find_log_json(argc, argv);
    bool no_log = false;
    lm_status ps = c->parse(c->ctx, argc, argv, &err), s = ps;
    bool help = *c->help;
    // the inputs the command line names, which no output may be: also when it does not parse
    if (lm_cmd_guard_args(c->guard, argc, argv, c->opts, c->n_opts, c->inputs, c->n_inputs, c->first, c->rest,
                          &log_err) != LM_OK) {
        lm_progress_error(p, 1, "%s", log_err.msg);
        rc = 1;
        goto done;
    }
    if (ps == LM_OK && !help) {
        p->quiet = *c->quiet;
        s = c->prepare(c->ctx, &no_log, &err);
    }
    if (no_log)
        log_json = NULL;
    // The log opens whether or not the rest was good, so that a usage error is logged too, but
    // only once it is known not to be (or lie inside) an input.
    lm_status ls = log_json && *log_json ? lm_cmd_log_open(p, c->guard, log_json, &log_err) : LM_OK;
    if (ls != LM_OK) {
        if (ps != LM_OK)
            lm_progress_error(p, 2, "%s (see %s --help)", err.msg, c->prefix);
        else if (s != LM_OK)
            lm_progress_error(p, lm_status_exit_code(s), "%s", err.msg);
        lm_progress_error(p, 2, "%s%s", ls == LM_ERR_USAGE ? "" : c->log_error_prefix, log_err.msg);
        rc = s != LM_OK ? lm_status_exit_code(s) : 2;
        goto done;
    }
    if (ps != LM_OK) {
        lm_progress_error(p, 2, "%s (see %s --help)", err.msg, c->prefix);
        rc = 2;
        goto done;
    }
    if (help) {
        c->usage(stdout, c->usage_arg);
        rc = 0;
        goto done;
    }
    if (s != LM_OK) {
        rc = lm_status_exit_code(s);
        lm_progress_error(p, rc, "%s", err.msg);
        goto done;
    }
    rc = c->work(c->ctx);
done:
    c->cleanup(c->ctx);
    return rc;
}

// ---- a command that runs a model ------------------------------------------------------------

// What lm_command_run_model hands the skeleton as its ctx.
typedef struct model_ctx {
    const lm_model_command *mc;
    void *run;
    lm_run_args *a;
} model_ctx;

static void model_usage(FILE *out, const void *mc)
{
    ((const lm_model_command *)mc)->usage(out);
}

static lm_status model_parse(void *ctx, int argc, char **argv, lm_err *err)
{
    model_ctx *x = ctx;
    return lm_cmd_run_scan(x->a, x->mc->min_seq_len, argc, argv, x->mc->opts, x->mc->n_opts, x->mc->option, x->run,
                           err);
}

static lm_status model_prepare(void *ctx, bool *no_log, lm_err *err)
{
    model_ctx *x = ctx;
    return x->mc->prepare(x->run, no_log, err);
}

static int model_work(void *ctx)
{
    model_ctx *x = ctx;
    return x->mc->work(x->run);
}

static void model_cleanup(void *ctx)
{
    model_ctx *x = ctx;
    x->mc->cleanup(x->run);
}

int lm_command_run_model(const lm_model_command *mc, void *run, lm_model_run *m, lm_run_args *a, int argc,
                         char **argv)
{
    static const int inputs[] = {LM_RUN_OPT_ADAPTER, LM_RUN_OPT_DATA, LM_RUN_OPT_TOKENIZER};
    model_ctx x = {mc, run, a};
    lm_command c = {
        .prefix = mc->prefix, .log_error_prefix = "--log-json: ", .progress = &m->progress, .guard = &m->guard,
        .opts = mc->opts, .n_opts = mc->n_opts, .inputs = inputs, .n_inputs = 3, .first = "MODEL", .rest = "MODEL",
        .help = &a->help, .quiet = &a->quiet,
        .usage = model_usage, .usage_arg = mc, .parse = model_parse, .prepare = model_prepare, .work = model_work,
        .cleanup = model_cleanup, .ctx = &x,
    };
    return lm_command_run(&c, argc, argv);
}

int lm_cmd_output_begin(lm_outdir *od, const char *out, bool force, lm_progress *p)
{
    lm_err err = {0};
    lm_signals_install();
    lm_status s = lm_outdir_begin(od, out, force, &err);
    if (s != LM_OK) {
        int code = lm_status_exit_code(s);
        lm_progress_error(p, code, "%s", err.msg);
        return code;
    }
    for (const char *line = od->note; line && *line;) {
        size_t n = strcspn(line, "\n");
        lm_progress_note(p, "note: %.*s", (int)n, line);
        line += n + (line[n] == '\n');
    }
    return 0;
}

int lm_cmd_output_failed(lm_status s, const lm_err *err, lm_outdir *od, lm_st_writer **w, lm_progress *p,
                         const char *out)
{
    lm_st_writer_free(*w);
    *w = NULL;
    if (s != LM_ERR_INTERRUPTED) {
        lm_outdir_abort(od);
        lm_progress_error(p, 1, "%s", err->msg[0] ? err->msg : lm_status_name(s));
        return 1;
    }
    int sig = lm_interrupted() ? lm_interrupted() : SIGINT;
    const char *name = lm_signal_name(sig);
    int code = lm_signal_exit_code(sig);
    char *tmp = od->tmp ? lm_strdup(od->tmp) : NULL;
    lm_outdir_abort(od);
    cJSON *f = cJSON_CreateObject();
    cJSON_AddStringToObject(f, "signal", name);
    if (tmp)
        cJSON_AddStringToObject(f, "removed", tmp);
    cJSON_AddNumberToObject(f, "exit_status", code);
    lm_progress_event(p, "interrupted", f);
    lm_progress_error(p, code, "interrupted by %s: removed the partial output %s", name, tmp ? tmp : out);
    free(tmp);
    return code;
}

lm_status lm_cmd_finish_output(lm_manifest *m, const lm_manifest_timings *tm, lm_outdir *od, lm_st_writer **w,
                               int *n_shards, lm_err *err)
{
    lm_status s = lm_manifest_set_timings(m, tm, err);
    char *path = s == LM_OK ? lm_path_join(od->tmp, LM_MANIFEST_NAME) : NULL;
    if (s == LM_OK && !path)
        s = lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    if (s == LM_OK)
        s = lm_manifest_write(m, path, err);
    free(path);
    if (s != LM_OK)
        return s;
    *n_shards = *w ? lm_st_writer_plan(*w)->n_shards : 0;  // no writer: an adapter's files
    lm_st_writer_free(*w);
    *w = NULL;
    // writing the side files and hashing the inputs may have taken a while
    if (lm_interrupted())
        return lm_interrupted_err(err);
    if ((s = lm_outdir_commit(od, err)) != LM_OK)
        return s;
    // OUT is complete and in place: a signal from now on is not undone by us
    lm_signals_restore();
    return LM_OK;
}

void lm_cmd_note_written(lm_progress *p, const char *out, int n_shards, int n_side, bool card)
{
    lm_progress_note(p, "wrote %s: %d shard%s%s, config.json, %d tokenizer/generation file%s, %s%s", out, n_shards,
                     n_shards == 1 ? "" : "s", n_shards > 1 ? " + model.safetensors.index.json" : "", n_side,
                     n_side == 1 ? "" : "s", card ? LM_CARD_NAME ", " : "", LM_MANIFEST_NAME);
}

cJSON *lm_cmd_end_event(const char *out, double t0)
{
    cJSON *f = cJSON_CreateObject();
    cJSON_AddStringToObject(f, "status", "ok");
    cJSON_AddStringToObject(f, "output", out);
    cJSON_AddNumberToObject(f, "exit_status", 0);
    cJSON_AddNumberToObject(f, "total_s", lm_now() - t0);
    return f;
}

void lm_cmd_end_send(lm_progress *p, cJSON *f, int n_shards)
{
    cJSON_AddNumberToObject(f, "shards", n_shards);
    cJSON_AddNumberToObject(f, "peak_rss_bytes", (double)lm_peak_rss_bytes());
    lm_progress_event(p, "end", f);
}
