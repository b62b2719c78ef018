// The option scanner: see args.h.
#include "args.h"

#include <errno.h>
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cmd.h"
#include "device_registry.h"
#include "util.h"

bool lm_cmd_parse_int(const char *text, int64_t lo, int64_t hi, int64_t *out)
{
    if (*text < '0' || *text > '9')
        return false;
    char *end;
    errno = 0;
    long long v = strtoll(text, &end, 10);
    if (*end || errno == ERANGE || v < lo || v > hi)
        return false;
    *out = v;
    return true;
}

lm_status lm_cmd_opt_gpu_mem(const char *shown, const char *v, uint64_t *out, lm_err *err)
{
    if (lm_parse_size(v, out, err) != LM_OK)
        return lm_err_prefix(err, "%s", shown);
    if (*out == 0)
        return lm_err_set(err, LM_ERR_USAGE, "%s %s: must be more than 0 bytes", shown, v);
    return LM_OK;
}

lm_status lm_cmd_opt_threads(const char *shown, const char *v, int *out, lm_err *err)
{
    int64_t n;
    if (!lm_cmd_parse_int(v, 0, LM_CMD_MAX_THREADS, &n))
        return lm_err_set(err, LM_ERR_USAGE, "%s '%s': a whole number of threads from 1 to %d is needed (0: all "
                          "cores)", shown, v, LM_CMD_MAX_THREADS);
    *out = (int)n;
    return LM_OK;
}

lm_status lm_cmd_opt_data_format(const char *shown, const char *v, bool *text, lm_err *err)
{
    if (strcmp(v, "text") != 0 && strcmp(v, "ids") != 0)
        return lm_err_set(err, LM_ERR_USAGE, "%s '%s': ids (the default: .jsonl or .txt of token ids) or text",
                          shown, v);
    *text = strcmp(v, "text") == 0;
    return LM_OK;
}

char *lm_cmd_calib_tokenizer(const char *opt_dir, const char *what, const char *dir, lm_calib_opts *co, char *why,
                             size_t why_size)
{
    char *tok = lm_path_join(opt_dir ? opt_dir : dir, "tokenizer.json");
    if (!tok)
        return NULL;
    snprintf(why, why_size, "%s %s has no tokenizer.json: give token ids (llmerge tokenize) or --tokenizer DIR",
             opt_dir ? "--tokenizer" : what, opt_dir ? opt_dir : dir);
    co->tokenizer = lm_is_file(tok) ? tok : NULL;
    co->no_tokenizer = why;
    return tok;
}

// The closest option name to `name` (without dashes), or NULL when none is close; a typed
// prefix of a name ("--dens") counts as close.
static const char *suggest(const char *name, const lm_opt *opts, size_t n)
{
    const char *best = NULL;
    size_t best_d = SIZE_MAX, len = strlen(name);
    for (size_t i = 0; i < n; i++) {
        size_t d = lm_cmd_edit_distance(name, opts[i].name);
        if (len >= 3 && strncmp(opts[i].name, name, len) == 0)
            d = 1;
        if (d < best_d) {
            best_d = d;
            best = opts[i].name;
        }
    }
    size_t limit = len <= 4 ? 1 : len <= 8 ? 2 : 3;
    return best_d <= limit ? best : NULL;
}

static lm_status unknown(const char *arg, const char *name, const lm_opt *opts, size_t n, lm_err *err)
{
    const char *s = suggest(name, opts, n);
    if (s)
        return lm_err_set(err, LM_ERR_USAGE, "unknown option '%s'; did you mean '--%s'?", arg, s);
    return lm_err_set(err, LM_ERR_USAGE, "unknown option '%s'", arg);
}

lm_status lm_cmd_scan(int argc, char **argv, const lm_opt *opts, size_t n, lm_opt_fn on_opt, lm_operand_fn on_operand,
                      void *ctx, lm_err *err)
{
    bool options_done = false;
    lm_status s;
    for (int i = 1; i < argc; i++) {
        const char *arg = argv[i];
        if (options_done || arg[0] != '-' || arg[1] == '\0') {
            if ((s = on_operand(ctx, arg, err)) != LM_OK)
                return s;
            continue;
        }
        if (strcmp(arg, "--") == 0) {
            options_done = true;
            continue;
        }
        if (arg[1] == '-') {  // --name or --name=value
            const char *name = arg + 2, *eq = strchr(name, '=');
            size_t len = eq ? (size_t)(eq - name) : strlen(name);
            const lm_opt *d = NULL;
            for (size_t k = 0; k < n && !d; k++)
                if (strlen(opts[k].name) == len && strncmp(opts[k].name, name, len) == 0)
                    d = &opts[k];
            if (!d) {
                char typed[64];
                snprintf(typed, sizeof typed, "%.*s", (int)(len < 63 ? len : 63), name);
                return unknown(arg, typed, opts, n, err);
            }
            char shown[64];
            snprintf(shown, sizeof shown, "--%s", d->name);
            const char *v = NULL;
            if (d->value) {
                if (eq)
                    v = eq + 1;
                else if (i + 1 < argc)
                    v = argv[++i];
                else
                    return lm_err_set(err, LM_ERR_USAGE, "%s needs a value", shown);
            } else if (eq) {
                return lm_err_set(err, LM_ERR_USAGE, "%s takes no value ('%s')", shown, arg);
            }
            if ((s = on_opt(ctx, d, shown, v, err)) != LM_OK)
                return s;
            continue;
        }
        for (const char *c = arg + 1; *c; c++) {  // -o OUT, -oOUT, and bundled flags such as -qv
            const lm_opt *d = NULL;
            for (size_t k = 0; k < n && !d; k++)
                if (opts[k].short_name == *c)
                    d = &opts[k];
            if (!d)
                return c == arg + 1 ? unknown(arg, arg + 1, opts, n, err)
                                    : lm_err_set(err, LM_ERR_USAGE, "unknown option '-%c' in '%s'", *c, arg);
            char shown[4] = {'-', *c, '\0', '\0'};
            if (d->value) {
                const char *v = c[1] ? c + 1 : i + 1 < argc ? argv[++i] : NULL;
                if (!v)
                    return lm_err_set(err, LM_ERR_USAGE, "%s needs a value", shown);
                if ((s = on_opt(ctx, d, shown, v, err)) != LM_OK)
                    return s;
                break;
            }
            if ((s = on_opt(ctx, d, shown, NULL, err)) != LM_OK)
                return s;
        }
    }
    return LM_OK;
}

const char *lm_cmd_find_log_json(int argc, char **argv)
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

// ==== outputs clear of the inputs =============================================================

lm_status lm_cmd_guard_args(lm_guard *g, int argc, char **argv, const lm_opt *opts, size_t n, const int *input_ids,
                            size_t n_ids, const char *first, const char *rest, lm_err *err)
{
    bool options_done = false;
    int n_operands = 0;
    lm_status s = LM_OK;
    for (int i = 1; i < argc && s == LM_OK; i++) {
        const char *arg = argv[i], *v = NULL;
        const lm_opt *d = NULL;
        if (options_done || arg[0] != '-' || arg[1] == '\0') {
            char what[64];
            if (n_operands++ == 0)
                snprintf(what, sizeof what, "%s", first);
            else
                snprintf(what, sizeof what, "%s %d", rest, n_operands - 1);
            s = lm_guard_add(g, what, arg, err);
            continue;
        }
        if (strcmp(arg, "--") == 0) {
            options_done = true;
            continue;
        }
        if (arg[1] == '-') {  // --name or --name=value
            const char *name = arg + 2, *eq = strchr(name, '=');
            size_t len = eq ? (size_t)(eq - name) : strlen(name);
            for (size_t k = 0; k < n && !d; k++)
                if (strlen(opts[k].name) == len && strncmp(opts[k].name, name, len) == 0)
                    d = &opts[k];
            if (d && d->value)
                v = eq ? eq + 1 : i + 1 < argc ? argv[++i] : NULL;
        } else {  // -o OUT, -oOUT, bundled flags
            for (const char *c = arg + 1; *c && !v; c++) {
                d = NULL;
                for (size_t k = 0; k < n && !d; k++)
                    if (opts[k].short_name == *c)
                        d = &opts[k];
                if (!d)
                    break;
                if (d->value)
                    v = c[1] ? c + 1 : i + 1 < argc ? argv[++i] : NULL;
            }
        }
        for (size_t k = 0; d && v && k < n_ids; k++)
            if (d->id == input_ids[k]) {
                char what[72];
                snprintf(what, sizeof what, "--%s", d->name);
                s = lm_guard_add(g, what, v, err);
            }
    }
    return s;
}

lm_status lm_cmd_guard_model(lm_guard *g, const char *what, const lm_model *m, lm_err *err)
{
    if (!m)
        return LM_OK;
    lm_status s = lm_guard_add(g, what, m->dir, err);
    if (s == LM_OK && m->config.path)
        s = lm_guard_add(g, what, m->config.path, err);
    if (s == LM_OK && m->index_path)
        s = lm_guard_add(g, what, m->index_path, err);
    for (int i = 0; s == LM_OK && i < m->n_shards; i++)
        if (m->shards[i].path)
            s = lm_guard_add(g, what, m->shards[i].path, err);
    return s;
}

lm_status lm_cmd_guard_adapter(lm_guard *g, const char *what, const lm_adapter *a, lm_err *err)
{
    if (!a)
        return LM_OK;
    lm_status s = lm_guard_add(g, what, a->dir, err);
    if (s == LM_OK && a->config.path)
        s = lm_guard_add(g, what, a->config.path, err);
    if (s == LM_OK && a->weights_path)
        s = lm_guard_add(g, what, a->weights_path, err);
    return s;
}

lm_status lm_cmd_log_open(lm_progress *p, const lm_guard *g, const char *path, lm_err *err)
{
    lm_status s = lm_guard_check(g, "--log-json", path, err);
    return s != LM_OK ? s : lm_progress_log_open(p, path, err);
}

// ==== commands that run a model: eval, hessian ================================================

// Applies shared option d (id LM_RUN_OPT_*) with value v.
static lm_status run_option(lm_run_args *a, const lm_opt *d, const char *shown, const char *v, lm_err *err)
{
    switch (d->id) {
    case LM_RUN_OPT_TOKENIZER:
        a->tokenizer = v;
        return LM_OK;
    case LM_RUN_OPT_FORMAT:
        return lm_cmd_opt_data_format(shown, v, &a->text, err);
    case LM_RUN_OPT_ADAPTER:
    case LM_RUN_OPT_DEVICE:
    case LM_RUN_OPT_DATA:
    case LM_RUN_OPT_LOG_JSON:
        if (!*v)
            return lm_err_set(err, LM_ERR_USAGE, "%s needs a value", shown);
        if (d->id != LM_RUN_OPT_LOG_JSON)
            *(d->id == LM_RUN_OPT_ADAPTER ? &a->adapter : d->id == LM_RUN_OPT_DEVICE ? &a->device : &a->data) = v;
        return LM_OK;
    case LM_RUN_OPT_SEQ_LEN:
        if (!lm_cmd_parse_int(v, a->min_seq_len, INT32_MAX, &a->seq_len))
            return lm_err_set(err, LM_ERR_USAGE, "%s '%s': a whole number of tokens from %lld to %d is needed", shown,
                              v, (long long)a->min_seq_len, INT32_MAX);
        return LM_OK;
    case LM_RUN_OPT_SAMPLES:
        if (!lm_cmd_parse_int(v, 1, INT64_MAX, &a->samples))
            return lm_err_set(err, LM_ERR_USAGE, "%s '%s': a whole number of sequences from 1 is needed", shown, v);
        return LM_OK;
    case LM_RUN_OPT_GPU_MEM:
        return lm_cmd_opt_gpu_mem(shown, v, &a->gpu_mem, err);
    case LM_RUN_OPT_THREADS:
        return lm_cmd_opt_threads(shown, v, &a->threads, err);
    case LM_RUN_OPT_STICKY:
        a->sticky = true;
        return LM_OK;
    case LM_RUN_OPT_QUIET:
        a->quiet = true;
        return LM_OK;
    case LM_RUN_OPT_HELP:
        a->help = true;
        return LM_OK;
    }
    return lm_err_set(err, LM_ERR_USAGE, "%s is not an option of this command", shown);
}

// The scan of a command that runs a model: its lm_run_args, and its own options' function.
typedef struct run_scan {
    lm_run_args *a;
    lm_opt_fn own;
    void *ctx;
} run_scan;

static lm_status run_scan_option(void *ctx, const lm_opt *d, const char *shown, const char *v, lm_err *err)
{
    run_scan *rs = ctx;
    return d->id >= LM_RUN_OPT_FIRST ? run_option(rs->a, d, shown, v, err) : rs->own(rs->ctx, d, shown, v, err);
}

// The operand: MODEL, once.
static lm_status run_scan_operand(void *ctx, const char *arg, lm_err *err)
{
    lm_run_args *a = ((run_scan *)ctx)->a;
    if (a->model)
        return lm_err_set(err, LM_ERR_USAGE, "one MODEL only ('%s' and '%s'); an adapter goes with --adapter",
                          a->model, arg);
    a->model = arg;
    return LM_OK;
}

lm_status lm_cmd_run_scan(lm_run_args *a, int64_t min_seq_len, int argc, char **argv, const lm_opt *opts, size_t n,
                          lm_opt_fn own, void *ctx, lm_err *err)
{
    memset(a, 0, sizeof *a);
    a->device = "auto";
    a->min_seq_len = min_seq_len;
    run_scan rs = {a, own, ctx};
    return lm_cmd_scan(argc, argv, opts, n, run_scan_option, run_scan_operand, &rs, err);
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

lm_status lm_cmd_run_open(const lm_run_args *a, lm_model **m, lm_adapter **ad, lm_err *err)
{
    char *dir = NULL;
    lm_status s;
    if ((s = detect("MODEL", a->model, LM_INPUT_MODEL, &dir, err)) != LM_OK)
        return s;
    s = lm_model_open(m, dir, err);
    free(dir);
    if (s != LM_OK)
        return s;
    if ((s = lm_model_check(*m, NULL, err)) != LM_OK)
        return lm_err_prefix(err, "MODEL %s", a->model);
    if (a->adapter) {
        if ((s = detect("--adapter", a->adapter, LM_INPUT_ADAPTER, &dir, err)) != LM_OK)
            return s;
        s = lm_adapter_open(ad, dir, err);
        free(dir);
        if (s != LM_OK)
            return s;
        if ((s = lm_adapter_select(*ad, *m, err)) != LM_OK)
            return lm_err_prefix(err, "--adapter %s", a->adapter);
        if ((s = lm_adapter_validate(*ad, *m, err)) != LM_OK)
            return lm_err_prefix(err, "--adapter %s does not fit MODEL %s", a->adapter, a->model);
    }
    return lm_fwd_check(*m, *ad, err);
}

lm_status lm_cmd_run_tokens(const lm_run_args *a, const lm_model *m, const char *path, lm_calib *data,
                            int64_t *seq_len, lm_fwd_seq **seqs, lm_err *err)
{
    const lm_config *cfg = &m->config;
    *seq_len = a->seq_len ? a->seq_len : cfg->max_position_embeddings > 1 ? cfg->max_position_embeddings : 0;
    lm_calib_opts co = {.max_samples = a->samples, .max_len = *seq_len, .vocab_size = cfg->vocab_size, .text = a->text};
    // a line of text is tokenized with MODEL's own tokenizer.json, or --tokenizer DIR's
    char why[LM_ERR_MSG_MAX / 2], *tok = lm_cmd_calib_tokenizer(a->tokenizer, "MODEL", m->dir, &co, why, sizeof why);
    if (!tok)
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    lm_status s = lm_calib_load(data, path, &co, err);
    free(tok);
    if (s != LM_OK)
        return s;
    if (!(*seqs = calloc((size_t)(data->n_seqs ? data->n_seqs : 1), sizeof **seqs)))
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    for (int64_t i = 0; i < data->n_seqs; i++)
        (*seqs)[i] = (lm_fwd_seq){data->ids + data->offsets[i], data->offsets[i + 1] - data->offsets[i]};
    return LM_OK;
}

lm_status lm_cmd_run_device(const lm_run_args *a, lm_dev **dev, char *why, size_t why_size, lm_err *err)
{
    lm_dev_opts o = {.threads = a->threads, .mem_cap = a->gpu_mem, .sim_fail = getenv("LLMERGE_SIM_FAIL")};
    return lm_dev_open(dev, a->device, &o, why, why_size, err);
}

void lm_cmd_run_notes(lm_progress *p, const lm_run_args *a, const lm_calib *data, int64_t seq_len, lm_dev *dev)
{
    if (data->n_cut)
        lm_progress_note(p, "note: %" PRId64 " sequence%s cut to %" PRId64 " tokens (--seq-len)", data->n_cut,
                         data->n_cut == 1 ? "" : "s", seq_len);
    if (a->gpu_mem && strcmp(lm_dev_name(dev), "cpu") == 0)
        lm_progress_note(p, "note: --gpu-mem has no effect on the cpu device");
}

void lm_cmd_adapter_warnings(lm_progress *p, const char *who, const lm_adapter *a, const char *verb,
                             const char *base)
{
    int64_t shown = 0;
    for (int64_t i = 0; a && i < a->n_ignored; i++) {
        if (a->ignored[i].why == LM_LORA_TIED)
            continue;  // lm_head's copy of embed_tokens' adapter, as PEFT saves it: nothing is lost
        if (shown++ == LM_CMD_MAX_IGNORED_WARNINGS) {
            int64_t more = 0;
            for (int64_t j = i; j < a->n_ignored; j++)
                more += a->ignored[j].why != LM_LORA_TIED;
            lm_progress_note(p, "warning: %s: the keys of %" PRId64 " more module%s are not %s either "
                             "(llmerge inspect %s --base %s lists them all)", who, more, more == 1 ? "" : "s",
                             verb, a->dir, base);
            break;
        }
        char msg[LM_ERR_MSG_MAX];
        lm_adapter_ignored_msg(a, i, verb, msg, sizeof msg);
        lm_progress_note(p, "warning: %s: %s", who, msg);
    }
}

void lm_cmd_note(void *ctx, const char *line, const lm_fallback *fb)
{
    if (fb)
        lm_progress_fallback(ctx, fb);
    else
        lm_progress_note(ctx, "%s", line);
}

void lm_cmd_run_fallbacks(lm_progress *p, const lm_fwd_runner *u)
{
    if (u->n_halved || u->n_seq_cpu)
        lm_progress_note(p, "fallbacks: %" PRId64 " batch%s halved, %" PRId64 " sequence%s (%" PRId64 " tokens) on "
                         "cpu, %.2f s", u->n_halved, u->n_halved == 1 ? "" : "es", u->n_seq_cpu,
                         u->n_seq_cpu == 1 ? "" : "s", u->tokens_cpu, u->fallback_s);
}

void lm_cmd_model_run_free(lm_model_run *r)
{
    lm_fwd_runner_free(&r->runner);
    lm_dev_destroy(r->dev);
    free(r->seqs);
    lm_calib_free(&r->data);
    lm_adapter_free(r->adapter);
    lm_model_free(r->model);
    lm_guard_free(&r->guard);
    lm_progress_free(&r->progress);
}

lm_status lm_cmd_model_run_begin(lm_model_run *r, const lm_run_args *a, const char *what, const char *phase,
                                 lm_err *err)
{
    lm_progress *p = &r->progress;
    char threads[32] = "";
    int n_threads = lm_dev_threads(r->dev);
    if (n_threads > 0)
        snprintf(threads, sizeof threads, ", %d thread%s", n_threads, n_threads == 1 ? "" : "s");
    lm_progress_note(p, "%s %s%s%s on %s: %" PRId64 " sequence%s, %" PRId64 " tokens (%s%s)", what, a->model,
                     a->adapter ? " with " : "", a->adapter ? a->adapter : "", a->data, r->data.n_seqs,
                     r->data.n_seqs == 1 ? "" : "s", r->data.n_tokens, r->dev_why, threads);
    lm_cmd_run_notes(p, a, &r->data, r->seq_len, r->dev);
    if (r->adapter) {
        char who[LM_ERR_MSG_MAX / 2];
        snprintf(who, sizeof who, "--adapter %s", a->adapter);
        lm_cmd_adapter_warnings(p, who, r->adapter, "applied", a->model);
    }
    r->t0 = lm_now();
    lm_status s = lm_fwd_runner_init(&r->runner, r->model, r->adapter, r->dev, phase, a->model, 0, lm_cmd_note, p, err);
    r->runner.sticky = a->sticky;
    return s;
}

const char *lm_cmd_dtype_flag(lm_dtype dt)
{
    return dt == LM_DTYPE_BF16 ? "bf16" : dt == LM_DTYPE_F16 ? "f16" : "f32";
}
