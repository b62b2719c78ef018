// llmerge tokenize MODEL FILE [-o OUT.jsonl]: text to token ids with the model's own
// tokenizer.json (lib/tokenizer.h), so that a sweep tokenizes its data once. FILE is JSON Lines
// (each line an object with "text", tokenized, or "input_ids", passed through) or, with
// --data-format text, one document cut into --seq-len windows. The documents are tokenized on
// the thread pool, each thread with its own cache of pieces; the output is written into a
// temporary file beside OUT and renamed into place, so a failure leaves nothing.
#define _GNU_SOURCE
#include <cJSON.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "adapter.h"
#include "args.h"
#include "cmd.h"
#include "command.h"
#include "json.h"
#include "outdir.h"
#include "parallel.h"
#include "signals.h"
#include "tokenizer.h"
#include "util.h"

#define PREFIX "llmerge tokenize"
#define MAX_INPUT ((size_t)16 << 30)
#define LINES_PER_TASK 64

enum { T_OUTPUT, T_TOKENIZER, T_FORMAT, T_SEQ_LEN, T_THREADS, T_QUIET, T_FORCE, T_HELP };
static const lm_opt opt_defs[] = {
    {"output", 'o', true, T_OUTPUT},     {"tokenizer", 0, true, T_TOKENIZER}, {"data-format", 0, true, T_FORMAT},
    {"seq-len", 0, true, T_SEQ_LEN},     {"threads", 0, true, T_THREADS},     {"quiet", 'q', false, T_QUIET},
    {"force", 0, false, T_FORCE},        {"help", 'h', false, T_HELP},
};
#define N_OPTS (sizeof opt_defs / sizeof opt_defs[0])
static const int input_opts[] = {T_TOKENIZER};

typedef struct tok_run {
    const char *model, *file, *out, *tok_dir;
    bool text;            // --data-format text
    int64_t seq_len;      // 0: none
    int threads;
    bool quiet, force, help;
    int n_operands;
    lm_progress progress;
    lm_guard guard;
    lm_tokenizer *tok;
    char *tok_path, *cfg_path;
    int64_t vocab_size;   // MODEL's config.json's (0: not known)
    char *data;           // FILE's bytes
    size_t len;
} tok_run;

static void usage(FILE *out, const void *arg)
{
    (void)arg;
    fprintf(out,
            "Usage: llmerge tokenize MODEL FILE [-o OUT.jsonl] [options]\n"
            "\n"
            "Writes the token ids of FILE's text, one JSON object {\"input_ids\": [...]} per line, as the\n"
            "model's tokenizer.json encodes it (Hugging Face's tokenizers: added tokens, normalizer,\n"
            "pre-tokenizer, BPE, the post-processor's special tokens such as BOS, as\n"
            "tokenizer_config.json's add_bos_token and add_eos_token say where it has them). MODEL is\n"
            "a model directory or a Hub id in the Hugging Face cache; --tokenizer DIR takes the\n"
            "tokenizer from DIR instead. Where MODEL has a config.json, no id may reach its\n"
            "vocab_size. The output feeds llmerge eval, hessian and sparsegpt (--data, --calib).\n"
            "\n"
            "FILE: a .jsonl file is JSON Lines: each line an object with \"text\" (tokenized) or\n"
            "\"input_ids\" (written as it is); empty lines are skipped. A file of any other name must be\n"
            "said to be text with --data-format text: one document, cut into windows of --seq-len\n"
            "tokens (each window starts where the last ended: the stride is the window; the last one\n"
            "is shorter), or one line without --seq-len. A file is never taken for the other format by\n"
            "its content.\n"
            "\n"
            "Options (also as --name=value):\n"
            "  -o, --output FILE      where the ids go (default: stdout); an existing file is refused\n"
            "                         unless --force is given\n"
            "  --tokenizer DIR        the directory holding tokenizer.json (default: MODEL)\n"
            "  --data-format F        jsonl or text (default: jsonl for a .jsonl file)\n"
            "  --seq-len N            text: the window's length in tokens\n"
            "  --threads N            CPU threads (default: the cores it may use)\n"
            "  -q, --quiet            nothing on stderr but errors\n"
            "  --force                replace the output file\n"
            "  -h, --help             this help\n"
            "\n"
            "Text that is not valid UTF-8 is refused, naming its line (exit status 2).\n"
            "\n"
            "Exit status: 0 done; 1 the work failed; 2 bad usage or input.\n");
}

static lm_status on_opt(void *ctx, const lm_opt *d, const char *shown, const char *v, lm_err *err)
{
    tok_run *r = ctx;
    switch (d->id) {
    case T_OUTPUT: r->out = v; return LM_OK;
    case T_TOKENIZER: r->tok_dir = v; return LM_OK;
    case T_FORMAT:
        if (strcmp(v, "text") != 0 && strcmp(v, "jsonl") != 0)
            return lm_err_set(err, LM_ERR_USAGE, "%s '%s': jsonl or text", shown, v);
        r->text = strcmp(v, "text") == 0;
        return LM_OK;
    case T_SEQ_LEN:
        if (!lm_cmd_parse_int(v, 1, INT64_MAX, &r->seq_len))
            return lm_err_set(err, LM_ERR_USAGE, "%s '%s': a number of tokens, 1 or more", shown, v);
        return LM_OK;
    case T_THREADS:
        return lm_cmd_opt_threads(shown, v, &r->threads, err);
    case T_QUIET: r->quiet = true; return LM_OK;
    case T_FORCE: r->force = true; return LM_OK;
    default: r->help = true; return LM_OK;
    }
}

static lm_status on_operand(void *ctx, const char *arg, lm_err *err)
{
    tok_run *r = ctx;
    if (r->n_operands == 0)
        r->model = arg;
    else if (r->n_operands == 1)
        r->file = arg;
    else
        return lm_err_set(err, LM_ERR_USAGE, "llmerge tokenize takes MODEL and FILE ('%s' is a third)", arg);
    r->n_operands++;
    return LM_OK;
}

static lm_status parse(void *ctx, int argc, char **argv, lm_err *err)
{
    tok_run *r = ctx;
    lm_status s = lm_cmd_scan(argc, argv, opt_defs, N_OPTS, on_opt, on_operand, r, err);
    if (s != LM_OK || r->help)
        return s;
    if (r->n_operands != 2)
        return lm_err_set(err, LM_ERR_USAGE, "needs MODEL and FILE");
    size_t fl = strlen(r->file);
    bool jsonl = fl > 6 && strcmp(r->file + fl - 6, ".jsonl") == 0;
    if (!r->text && !jsonl)
        return lm_err_set(err, LM_ERR_USAGE, "%s: not a .jsonl file: say --data-format text if it is text (a file "
                          "is never taken for text or ids by its content)", r->file);
    if (r->seq_len && !r->text)
        return lm_err_set(err, LM_ERR_USAGE, "--seq-len cuts text (--data-format text); JSON Lines keep their lines");
    return LM_OK;
}

static lm_status prepare(void *ctx, bool *no_log, lm_err *err)
{
    tok_run *r = ctx;
    (void)no_log;
    lm_status s;
    // MODEL: a directory (with a tokenizer, weights or not), or a Hub id in the Hugging Face
    // cache (which --tokenizer DIR does not need)
    char *resolved = NULL;
    const char *mdir = lm_is_dir(r->model) ? r->model : NULL;
    if (!mdir) {
        lm_input_kind kind;
        lm_err ierr = {0};
        if ((s = lm_input_detect(r->model, &kind, &resolved, &ierr)) == LM_OK)
            mdir = resolved;
        else if (!r->tok_dir) {
            *err = ierr;
            return lm_err_prefix(err, "MODEL");
        }
    }
    r->tok_path = lm_path_join(r->tok_dir ? r->tok_dir : mdir, "tokenizer.json");
    // MODEL's config.json, where it has one: every id must be below its vocab_size
    r->cfg_path = mdir ? lm_path_join(mdir, "config.json") : NULL;
    bool nomem = !r->tok_path || (mdir && !r->cfg_path);
    free(resolved);
    if (nomem)
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    if (r->cfg_path && lm_is_file(r->cfg_path)) {
        cJSON *cfg = NULL;
        if ((s = lm_json_load(&cfg, r->cfg_path, (size_t)1 << 24, err)) != LM_OK)
            return s;
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(cfg, "vocab_size");
        if (cJSON_IsNumber(v) && v->valuedouble >= 1 && v->valuedouble <= INT32_MAX)
            r->vocab_size = (int64_t)v->valuedouble;
        cJSON_Delete(cfg);
    }
    if ((s = lm_guard_add(&r->guard, "FILE", r->file, err)) != LM_OK ||
        (s = lm_guard_add(&r->guard, "tokenizer", r->tok_path, err)) != LM_OK)
        return s;
    if (r->out) {
        if ((s = lm_guard_check(&r->guard, "-o", r->out, err)) != LM_OK)
            return s;
        if (!r->force && access(r->out, F_OK) == 0)
            return lm_err_set(err, LM_ERR_USAGE, "%s: already exists (use --force to replace it)", r->out);
    }
    if ((s = lm_tok_load(&r->tok, r->tok_path, err)) != LM_OK)
        return s;
    const char *tok;
    int64_t max = lm_tok_max_id(r->tok, &tok, false);
    if (r->vocab_size && max >= r->vocab_size)
        return lm_err_set(err, LM_ERR_FORMAT, "%s: token '%s' has id %" PRId64 ", past the model's vocab_size %" PRId64
                          " (%s): the tokenizer does not fit the model", r->tok_path, tok, max, r->vocab_size,
                          r->cfg_path);
    return lm_read_file(r->file, MAX_INPUT, &r->data, &r->len, err);
}

// One document's ids.
typedef struct doc {
    const char *text;   // its text (NULL: ids given)
    size_t len;
    int64_t line;       // 1-based, for messages
    int32_t *ids;
    int64_t n, cap;
} doc;

typedef struct tok_job {
    const lm_tokenizer *tok;
    doc *docs;
    int64_t n_docs;
    lm_tok_cache **caches;  // one per thread, taken from the free list while a task runs
    int n_free;
    pthread_mutex_t mu;
    lm_status s;
    lm_err err;
} tok_job;

static void tok_task(void *ctx, int64_t t)
{
    tok_job *j = ctx;
    pthread_mutex_lock(&j->mu);
    lm_tok_cache *c = j->n_free > 0 ? j->caches[--j->n_free] : NULL;
    pthread_mutex_unlock(&j->mu);
    lm_err err = {0};
    lm_status s = LM_OK;
    for (int64_t i = t * LINES_PER_TASK; s == LM_OK && i < j->n_docs && i < (t + 1) * LINES_PER_TASK; i++) {
        doc *d = &j->docs[i];
        if (d->text && (s = lm_tok_encode(j->tok, c, d->text, d->len, 1, &d->ids, &d->n, &d->cap, &err)) != LM_OK)
            lm_err_prefix(&err, "line %" PRId64, d->line);
    }
    pthread_mutex_lock(&j->mu);
    if (c)
        j->caches[j->n_free++] = c;
    if (s != LM_OK && j->s == LM_OK) {
        j->s = s;
        j->err = err;
    }
    pthread_mutex_unlock(&j->mu);
}

// FILE's documents: each JSON line's text or ids, or the whole text.
static lm_status read_docs(tok_run *r, doc **out, int64_t *n_out, lm_err *err)
{
    *out = NULL;
    *n_out = 0;
    if (r->text) {
        // invalid UTF-8 named by its line before any work
        int64_t bad = lm_utf8_bad_line(r->data ? r->data : "", r->len);
        if (bad)
            return lm_err_set(err, LM_ERR_FORMAT, "%s: line %" PRId64 ": not valid UTF-8", r->file, bad);
        doc *d = calloc(1, sizeof *d);
        if (!d)
            return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
        *d = (doc){.text = r->data ? r->data : "", .len = r->len, .line = 1};
        *out = d;
        *n_out = 1;
        return LM_OK;
    }
    int64_t lines = 1;
    for (size_t i = 0; i < r->len; i++)
        lines += r->data[i] == '\n';
    doc *d = calloc((size_t)lines, sizeof *d);
    if (!d)
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    int64_t n = 0, line = 0;
    lm_status s = LM_OK;
    for (size_t p = 0; s == LM_OK && p < r->len;) {
        const char *nl = memchr(r->data + p, '\n', r->len - p);
        size_t l = nl ? (size_t)(nl - (r->data + p)) : r->len - p;
        line++;
        size_t q = p;
        p += l + 1;
        if (l == 0 || (l == 1 && r->data[q] == '\r'))
            continue;
        cJSON *j = NULL;
        char label[64];
        snprintf(label, sizeof label, "line %" PRId64, line);
        if ((s = lm_json_parse(&j, r->data + q, l, label, err)) != LM_OK)
            break;
        const cJSON *text = cJSON_GetObjectItemCaseSensitive(j, "text"), *ids = cJSON_GetObjectItemCaseSensitive(j, "input_ids");
        doc *dd = &d[n];
        dd->line = line;
        if (cJSON_IsString(text)) {
            // the text stays in the tree, which goes: a copy
            if (!(dd->text = lm_strdup(text->valuestring))) {
                s = lm_err_set(err, LM_ERR_NOMEM, "out of memory");
            } else {
                dd->len = strlen(dd->text);
                n++;
            }
        } else if (cJSON_IsArray(ids)) {
            const cJSON *x;
            cJSON_ArrayForEach(x, ids)
            {
                if (!cJSON_IsNumber(x) || x->valuedouble < 0 || x->valuedouble > INT32_MAX ||
                    x->valuedouble != (double)(int32_t)x->valuedouble) {
                    s = lm_err_set(err, LM_ERR_FORMAT, "%s: line %" PRId64 ": input_ids holds a value that is not a "
                                   "token id", r->file, line);
                    break;
                }
                if (r->vocab_size && x->valuedouble >= (double)r->vocab_size) {
                    s = lm_err_set(err, LM_ERR_FORMAT, "%s: line %" PRId64 ": input_ids holds %s, past the model's "
                                   "vocab_size %" PRId64, r->file, line, x->valuestring, r->vocab_size);
                    break;
                }
                int32_t *g = dd->n == dd->cap ? realloc(dd->ids, (size_t)(dd->cap ? 2 * dd->cap : 64) * sizeof *g)
                                              : dd->ids;
                if (!g) {
                    s = lm_err_set(err, LM_ERR_NOMEM, "out of memory");
                    break;
                }
                if (dd->n == dd->cap)
                    dd->cap = dd->cap ? 2 * dd->cap : 64;
                dd->ids = g;
                dd->ids[dd->n++] = (int32_t)x->valuedouble;
            }
            n++;
        } else if (cJSON_GetObjectItemCaseSensitive(j, "messages")) {
            s = lm_err_set(err, LM_ERR_FORMAT, "%s: line %" PRId64 ": chat data (\"messages\") is not read: render each "
                           "conversation with the model's chat template into \"text\" first", r->file, line);
        } else {
            s = lm_err_set(err, LM_ERR_FORMAT, "%s: line %" PRId64 ": no \"text\" string or \"input_ids\" list",
                           r->file, line);
        }
        cJSON_Delete(j);
    }
    *out = d;
    *n_out = n;
    return s;
}

// Writes one {"input_ids": [...]} line of ids[0..n).
static bool write_ids(FILE *f, const int32_t *ids, int64_t n)
{
    fputs("{\"input_ids\": [", f);
    for (int64_t i = 0; i < n; i++) {
        char buf[16], *e = buf + sizeof buf, *q = e;
        uint32_t v = (uint32_t)ids[i];
        do
            *--q = (char)('0' + v % 10);
        while (v /= 10);
        if (i)
            fputs(", ", f);
        fwrite(q, 1, (size_t)(e - q), f);
    }
    return fputs("]}\n", f) >= 0;
}

static int work(void *ctx)
{
    tok_run *r = ctx;
    lm_progress *p = &r->progress;
    lm_err err = {0};
    doc *docs = NULL;
    int64_t n_docs = 0, tokens = 0;
    lm_pool *pool = NULL;
    tok_job j = {.tok = r->tok};
    char *tmp = NULL;
    int tmp_id = 0, rc = 1;
    FILE *f = NULL;
    double t0 = lm_now();
    lm_status s = read_docs(r, &docs, &n_docs, &err);
    int threads = r->threads ? r->threads : lm_cpu_count();
    if (s == LM_OK)
        s = lm_pool_create(&pool, threads, &err);
    if (s == LM_OK && !(j.caches = calloc((size_t)threads, sizeof *j.caches)))
        s = lm_err_set(&err, LM_ERR_NOMEM, "out of memory");
    for (int i = 0; s == LM_OK && i < threads; i++)
        if ((j.caches[j.n_free++] = lm_tok_cache_new()) == NULL)
            s = lm_err_set(&err, LM_ERR_NOMEM, "out of memory");
    if (s == LM_OK) {
        pthread_mutex_init(&j.mu, NULL);
        j.docs = docs;
        j.n_docs = n_docs;
        lm_pool_run(pool, (n_docs + LINES_PER_TASK - 1) / LINES_PER_TASK, tok_task, &j);
        pthread_mutex_destroy(&j.mu);
        if ((s = j.s) != LM_OK) {
            err = j.err;
            lm_err_prefix(&err, "%s", r->file);
        }
    }
    // an id past the model's rows: an added token the model has none for (a multimodal
    // tokenizer's image token under a text model), found where the text holds it
    for (int64_t i = 0; s == LM_OK && r->vocab_size && i < n_docs; i++)
        for (int64_t k = 0; docs[i].text && k < docs[i].n; k++)
            if (docs[i].ids[k] >= r->vocab_size) {
                char where[48];
                snprintf(where, sizeof where, r->text ? "the document" : "line %" PRId64, docs[i].line);
                s = lm_err_set(&err, LM_ERR_FORMAT, "%s: %s: token %" PRId64 " is id %d, past the model's vocab_size %"
                               PRId64 " (%s)", r->file, where, k + 1, docs[i].ids[k], r->vocab_size, r->cfg_path);
                break;
            }
    if (s == LM_OK && r->out) {
        if (!(tmp = lm_strfmt("%s.tmp-XXXXXX", r->out))) {
            s = lm_err_set(&err, LM_ERR_NOMEM, "out of memory");
        } else {
            int fd = mkstemp(tmp);
            if (fd < 0 || !(f = fdopen(fd, "w"))) {
                s = lm_err_set(&err, LM_ERR_IO, "%s: cannot be created beside %s", tmp, r->out);
                if (fd >= 0) {  // made, but not opened as a stream: nothing may stay
                    close(fd);
                    unlink(tmp);
                }
            } else {
                tmp_id = lm_signals_remove_on_exit(tmp, true);
            }
        }
    } else if (s == LM_OK) {
        f = stdout;
    }
    for (int64_t i = 0; s == LM_OK && i < n_docs; i++) {
        int64_t w = r->seq_len ? r->seq_len : (docs[i].n > 0 ? docs[i].n : 1);
        for (int64_t o = 0; s == LM_OK && (o < docs[i].n || o == 0); o += w)
            if (!write_ids(f, docs[i].n ? docs[i].ids + o : NULL, docs[i].n - o < w ? docs[i].n - o : w))
                s = lm_err_set(&err, LM_ERR_IO, "%s: write failed", r->out ? tmp : "stdout");
        tokens += docs[i].n;
    }
    if (f && f != stdout) {
        if (fflush(f) != 0 || fsync(fileno(f)) != 0)
            s = s == LM_OK ? lm_err_set(&err, LM_ERR_IO, "%s: write failed", tmp) : s;
        fclose(f);
        if (s == LM_OK && rename(tmp, r->out) != 0)
            s = lm_err_set(&err, LM_ERR_IO, "%s: cannot be renamed to %s", tmp, r->out);
        if (s != LM_OK)
            unlink(tmp);
    } else if (f == stdout && fflush(stdout) != 0 && s == LM_OK) {
        s = lm_err_set(&err, LM_ERR_IO, "stdout: write failed");
    }
    lm_signals_forget(tmp_id);
    if (s == LM_OK) {
        double dt = lm_now() - t0;
        lm_progress_note(p, "%" PRId64 " tokens from %" PRId64 " document%s in %.2f s (%.2f M tokens/s, %d thread%s)%s%s",
                         tokens, n_docs, n_docs == 1 ? "" : "s", dt, dt > 0 ? (double)tokens / dt / 1e6 : 0.0,
                         threads, threads == 1 ? "" : "s", r->out ? " into " : "", r->out ? r->out : "");
        rc = 0;
    } else {
        rc = lm_status_exit_code(s);
        lm_progress_error(p, rc, "%s", err.msg);
    }
    for (int i = 0; j.caches && i < threads; i++)
        lm_tok_cache_free(j.caches[i]);
    free(j.caches);
    for (int64_t i = 0; docs && i < n_docs; i++) {
        if (!r->text)
            free((char *)docs[i].text);
        free(docs[i].ids);
    }
    free(docs);
    lm_pool_free(pool);
    free(tmp);
    return rc;
}

static void cleanup(void *ctx)
{
    tok_run *r = ctx;
    lm_tok_free(r->tok);
    free(r->tok_path);
    free(r->cfg_path);
    free(r->data);
    lm_guard_free(&r->guard);
    lm_progress_free(&r->progress);
}

int lm_cmd_tokenize(int argc, char **argv)
{
    tok_run r;
    memset(&r, 0, sizeof r);
    lm_command c = {
        .prefix = PREFIX, .log_error_prefix = "", .progress = &r.progress, .guard = &r.guard, .opts = opt_defs,
        .n_opts = N_OPTS, .inputs = input_opts, .n_inputs = 1, .first = "MODEL", .rest = "FILE", .help = &r.help,
        .quiet = &r.quiet, .usage = usage, .parse = parse, .prepare = prepare, .work = work, .cleanup = cleanup,
        .ctx = &r,
    };
    return lm_command_run(&c, argc, argv);
}
