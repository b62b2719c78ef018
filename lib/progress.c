// Progress, summary and JSON Lines events: see progress.h.
#include "progress.h"

#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include "util.h"

#define TTY_INTERVAL_S 0.1   // a terminal line is redrawn at most ten times a second
#define LOG_INTERVAL_S 5.0   // elsewhere one line every five seconds
#define MIB 1048576.0         // rates in MiB/s: lm_format_bytes writes sizes in binary units

uint64_t lm_peak_rss_bytes(void)
{
    struct rusage ru;
    if (getrusage(RUSAGE_SELF, &ru) != 0 || ru.ru_maxrss < 0)
        return 0;
    return (uint64_t)ru.ru_maxrss * 1024u;  // Linux reports KiB
}

void lm_progress_init(lm_progress *p, const char *prefix, bool quiet)
{
    memset(p, 0, sizeof *p);
    p->mu_ready = pthread_mutex_init(&p->mu, NULL) == 0;
    p->prefix = prefix;
    p->quiet = quiet;
    p->tty = isatty(2) == 1;
    p->t_init = lm_now();
    p->t_start = p->t_init;
}

static void lock(lm_progress *p)
{
    if (p->mu_ready)
        pthread_mutex_lock(&p->mu);
}

static void unlock(lm_progress *p)
{
    if (p->mu_ready)
        pthread_mutex_unlock(&p->mu);
}

// ==== the JSON Lines file =====================================================================

lm_status lm_progress_log_open(lm_progress *p, const char *path, lm_err *err)
{
    FILE *f = fopen(path, "w");
    if (!f)
        return lm_err_set(err, LM_ERR_IO, "--log-json %s: %s", path, strerror(errno));
    char *copy = lm_strdup(path);
    if (!copy) {
        fclose(f);
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    }
    lock(p);
    if (p->log)
        fclose(p->log);
    free(p->log_path);
    p->log = f;
    p->log_path = copy;
    unlock(p);
    return LM_OK;
}

// "2024-05-01T12:34:56.789Z" into buf.
static void utc_now(char *buf, size_t cap)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    struct tm tm;
    gmtime_r(&ts.tv_sec, &tm);
    size_t n = strftime(buf, cap, "%Y-%m-%dT%H:%M:%S", &tm);
    snprintf(buf + n, cap - n, ".%03dZ", (int)(ts.tv_nsec / 1000000));
}

// Writes the event with the mutex held.
static void event_locked(lm_progress *p, const char *event, cJSON *fields)
{
    if (!p->log) {
        cJSON_Delete(fields);
        return;
    }
    char when[40];
    utc_now(when, sizeof when);
    cJSON *o = cJSON_CreateObject();
    bool ok = o && cJSON_AddStringToObject(o, "event", event) &&
              cJSON_AddStringToObject(o, "time", when) &&
              cJSON_AddNumberToObject(o, "elapsed_s", lm_now() - p->t_init);
    // move the caller's fields after the three standard ones, keeping their order
    while (ok && fields && fields->child) {
        cJSON *item = cJSON_DetachItemViaPointer(fields, fields->child);
        if (!cJSON_AddItemToObject(o, item->string, item)) {
            cJSON_Delete(item);
            ok = false;
        }
    }
    char *line = ok ? cJSON_PrintUnformatted(o) : NULL;
    cJSON_Delete(o);
    cJSON_Delete(fields);
    int e = 0;
    if (!line)
        e = ENOMEM;
    else if (fprintf(p->log, "%s\n", line) < 0 || fflush(p->log) != 0)
        e = errno ? errno : EIO;
    free(line);
    if (e) {
        // the run matters more than its log: say so once and stop logging
        if (p->line_open) {
            fputc('\n', stderr);
            p->line_open = false;
        }
        fprintf(stderr, "%s: warning: --log-json %s: %s; no more events are logged\n", p->prefix,
                p->log_path ? p->log_path : "", strerror(e));
        fclose(p->log);
        p->log = NULL;
    }
}

void lm_progress_event(lm_progress *p, const char *event, cJSON *fields)
{
    lock(p);
    event_locked(p, event, fields);
    unlock(p);
}

// ==== the progress line =======================================================================

// "1:02:03", "2:03" or "7s" into buf.
static void format_duration(char *buf, size_t cap, double s)
{
    if (s < 0)
        s = 0;
    uint64_t t = (uint64_t)(s + 0.5);
    if (t >= 3600)
        snprintf(buf, cap, "%" PRIu64 ":%02u:%02u", t / 3600, (unsigned)(t / 60 % 60),
                 (unsigned)(t % 60));
    else if (t >= 60)
        snprintf(buf, cap, "%u:%02u", (unsigned)(t / 60), (unsigned)(t % 60));
    else
        snprintf(buf, cap, "%us", (unsigned)t);
}

// Writes the progress line with the mutex held.
static void draw_locked(lm_progress *p)
{
    double now = lm_now();
    double el = now - p->t_start;
    char line[256], done[32], total[32], eta[32];
    double rate = el > 0 ? (double)p->bytes_done / el / MIB : 0.0;  // MiB/s, as the sizes are binary
    bool finished = p->n_done >= p->n_total;
    bool units_only = p->bytes_total == 0;  // work counted in units alone (an evaluation's sequences)
    if (finished)
        format_duration(eta, sizeof eta, el);
    else if (rate > 0 && p->bytes_done > 0 && p->bytes_done <= p->bytes_total)
        format_duration(eta, sizeof eta,
                        (double)(p->bytes_total - p->bytes_done) / (rate * MIB));
    else if (units_only && p->n_done > 0 && el > 0)
        format_duration(eta, sizeof eta, el * (double)(p->n_total - p->n_done) / (double)p->n_done);
    else
        snprintf(eta, sizeof eta, "?");
    int n = units_only
                ? snprintf(line, sizeof line, "%s: %s %" PRId64 "/%" PRId64 ", %s %s", p->prefix,
                           p->unit ? p->unit : "unit", p->n_done, p->n_total, finished ? "took" : "ETA", eta)
                : snprintf(line, sizeof line, "%s: %s %" PRId64 "/%" PRId64 ", %s/%s, %.1f MiB/s, %s %s",
                           p->prefix, p->unit ? p->unit : "unit", p->n_done, p->n_total,
                           lm_format_bytes(done, sizeof done, p->bytes_done),
                           lm_format_bytes(total, sizeof total, p->bytes_total), rate,
                           finished ? "took" : "ETA", eta);
    if (n < 0)
        return;
    if (n >= (int)sizeof line)
        n = (int)sizeof line - 1;
    if (p->fallbacks > 0 && n < (int)sizeof line - 1) {
        int m = snprintf(line + n, sizeof line - (size_t)n, ", %" PRId64 " fallback%s to cpu", p->fallbacks,
                         p->fallbacks == 1 ? "" : "s");
        n = m < 0 || n + m >= (int)sizeof line ? (int)sizeof line - 1 : n + m;
    }
    if (p->tty) {
        int pad = p->line_len > n ? p->line_len - n : 0;
        fprintf(stderr, "\r%s%*s", line, pad, "");
        p->line_len = n;
        p->line_open = true;
    } else {
        fprintf(stderr, "%s\n", line);
    }
    fflush(stderr);
    p->t_printed = now;
    if (finished)
        p->printed_final = true;
}

void lm_progress_start(lm_progress *p, const char *unit, int64_t n_total, uint64_t bytes_total)
{
    lock(p);
    p->unit = unit;
    p->n_total = n_total;
    p->bytes_total = bytes_total;
    p->n_done = 0;
    p->bytes_done = 0;
    p->t_start = lm_now();
    p->t_printed = p->t_start;
    p->t_end = 0;
    p->printed_final = false;
    unlock(p);
}

void lm_progress_set_total(lm_progress *p, int64_t n_total, uint64_t bytes_total)
{
    lock(p);
    p->n_total = n_total;
    p->bytes_total = bytes_total;
    unlock(p);
}

void lm_progress_update(lm_progress *p, int64_t n_done, uint64_t bytes_done, const char *name)
{
    lock(p);
    p->n_done = n_done;
    p->bytes_done = bytes_done;
    if (p->log) {
        cJSON *f = cJSON_CreateObject();
        cJSON_AddNumberToObject(f, "index", (double)n_done);
        cJSON_AddNumberToObject(f, "total", (double)p->n_total);
        if (name)
            cJSON_AddStringToObject(f, "name", name);
        cJSON_AddNumberToObject(f, "bytes_done", (double)bytes_done);
        cJSON_AddNumberToObject(f, "bytes_total", (double)p->bytes_total);
        event_locked(p, p->unit ? p->unit : "unit", f);
    }
    if (!p->quiet) {
        double since = lm_now() - p->t_printed;
        bool last = n_done >= p->n_total;
        if (last || since >= (p->tty ? TTY_INTERVAL_S : LOG_INTERVAL_S))
            draw_locked(p);
    }
    unlock(p);
}

void lm_progress_end(lm_progress *p)
{
    lock(p);
    p->t_end = lm_now();
    if (!p->quiet && p->unit) {
        if (!p->printed_final)
            draw_locked(p);
        if (p->line_open) {
            fputc('\n', stderr);
            p->line_open = false;
        }
    }
    unlock(p);
}

void lm_progress_summary_as(lm_progress *p, const char *what)
{
    lock(p);
    if (!p->quiet) {
        double end = p->t_end > 0 ? p->t_end : lm_now();
        double el = end - p->t_start;
        char bytes[32], peak[32];
        if (p->line_open) {
            fputc('\n', stderr);
            p->line_open = false;
        }
        fprintf(stderr, "%s: %s (%s) in %.2f s (%.1f MiB/s), peak memory %s\n", p->prefix, what,
                lm_format_bytes(bytes, sizeof bytes, p->bytes_done), el,
                el > 0 ? (double)p->bytes_done / el / MIB : 0.0,
                lm_format_bytes(peak, sizeof peak, lm_peak_rss_bytes()));
        fflush(stderr);
    }
    unlock(p);
}

void lm_progress_summary(lm_progress *p, const char *verb)
{
    char what[128];
    lock(p);
    snprintf(what, sizeof what, "%s %" PRId64 " %s%s", verb, p->n_done, p->unit ? p->unit : "unit",
             p->n_done == 1 ? "" : "s");
    unlock(p);
    lm_progress_summary_as(p, what);
}

// ==== messages ================================================================================

// Ends a refreshing progress line so a message starts on a line of its own. Call locked.
static void end_line_locked(lm_progress *p)
{
    if (p->line_open) {
        fputc('\n', stderr);
        p->line_open = false;
        p->line_len = 0;
    }
}

void lm_progress_fallback(lm_progress *p, const lm_fallback *fb)
{
    lock(p);
    p->fallbacks++;
    unlock(p);
    char line[LM_FALLBACK_LINE_MAX];
    lm_progress_note(p, "%s", lm_fallback_line(line, sizeof line, fb));
    lm_progress_event(p, "fallback", lm_fallback_json(fb));
}

cJSON *lm_fallback_json(const lm_fallback *fb)
{
    cJSON *f = cJSON_CreateObject();
    cJSON_AddStringToObject(f, "phase", fb->phase);
    cJSON_AddStringToObject(f, "unit", fb->unit);
    cJSON_AddStringToObject(f, "from", fb->from);
    cJSON_AddStringToObject(f, "to", fb->to);
    cJSON_AddStringToObject(f, "reason", fb->reason);
    return f;
}

void lm_progress_note(lm_progress *p, const char *fmt, ...)
{
    if (p->quiet)
        return;
    char msg[LM_ERR_MSG_MAX + 256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    lock(p);
    end_line_locked(p);
    fprintf(stderr, "%s: %s\n", p->prefix, msg);
    fflush(stderr);
    unlock(p);
}

void lm_progress_error(lm_progress *p, int exit_status, const char *fmt, ...)
{
    char msg[LM_ERR_MSG_MAX + 256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    lock(p);
    end_line_locked(p);
    fprintf(stderr, "%s: error: %s\n", p->prefix, msg);
    fflush(stderr);
    if (p->log) {
        cJSON *f = cJSON_CreateObject();
        cJSON_AddStringToObject(f, "message", msg);
        cJSON_AddNumberToObject(f, "exit_status", exit_status);
        event_locked(p, "error", f);
    }
    unlock(p);
}

void lm_progress_free(lm_progress *p)
{
    if (!p)
        return;
    if (p->log)
        fclose(p->log);
    p->log = NULL;
    free(p->log_path);
    p->log_path = NULL;
    if (p->mu_ready)
        pthread_mutex_destroy(&p->mu);
    p->mu_ready = false;
}
