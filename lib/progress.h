// What a long run tells its user while it works: a progress line on stderr, the closing summary,
// and, with --log-json, one JSON object per event in a JSON Lines file. Any command that works
// through numbered units (a merge's tensors, a Hessian capture's batches, an evaluation's
// sequences) uses one lm_progress: lm_progress_init when the command starts (so even a usage
// error can be logged), lm_progress_start once the amount of work is known, lm_progress_update
// after each unit, lm_progress_end and lm_progress_summary at the end.
//
// On a terminal (isatty(2)) the progress is one line redrawn in place with \r at most about ten
// times a second; otherwise (a log file, a CI job) one full line about every five seconds and a
// final one, so logs stay short. With quiet nothing goes to stderr but errors; the JSON Lines
// file is written either way. Every event carries "event", "time" (UTC, ISO 8601 with
// milliseconds) and "elapsed_s" (monotonic seconds since lm_progress_init), and each line is
// flushed as it is written, so `tail -f` follows a run and a killed run keeps what it logged.
//
// The functions may be called from several threads: the state and both outputs are guarded by
// one mutex.
#ifndef LM_PROGRESS_H
#define LM_PROGRESS_H

#include <cJSON.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "fallback.h"
#include "status.h"

typedef struct lm_progress {
    pthread_mutex_t mu;
    bool mu_ready;         // mu was initialised (so lm_progress_free is safe on a zeroed object)
    const char *prefix;    // "llmerge ties", not copied
    const char *unit;      // "tensor", not copied; NULL until lm_progress_start
    bool quiet;            // nothing on stderr but errors
    bool tty;              // stderr is a terminal: redraw one line
    FILE *log;             // the JSON Lines file, or NULL
    char *log_path;        // its path, for messages
    int64_t n_total;       // units of work
    uint64_t bytes_total;  // bytes those units move
    int64_t n_done;
    uint64_t bytes_done;
    double t_init;         // lm_now() at init (util.h)
    double t_start;        // at lm_progress_start
    double t_end;          // at lm_progress_end (0 before)
    double t_printed;      // when the progress line was last written
    int line_len;          // length of the line on screen (tty), to blank what is left of it
    bool line_open;        // a \r line is on screen without its newline
    bool printed_final;    // the line for n_done == n_total has been written
    int64_t fallbacks;     // units that went from the device to the CPU (lm_progress_fallback)
} lm_progress;

// The peak resident memory of this process so far (getrusage ru_maxrss), in bytes. Pages of
// mmapped input files that were touched count, as the kernel counts them.
uint64_t lm_peak_rss_bytes(void);

// Prepares `p` (overwritten) to report for the command called `prefix` ("llmerge ties"; not
// copied, must outlive p). With `quiet` only errors reach stderr. Allocates nothing; free with
// lm_progress_free all the same.
void lm_progress_init(lm_progress *p, const char *prefix, bool quiet);

// Opens (creates or truncates) the JSON Lines file `path`. LM_ERR_IO naming the path when it
// cannot be opened. The file is closed by lm_progress_free.
lm_status lm_progress_log_open(lm_progress *p, const char *path, lm_err *err);

// Begins the work: n_total units called `unit` ("tensor"; not copied) moving bytes_total bytes.
void lm_progress_start(lm_progress *p, const char *unit, int64_t n_total, uint64_t bytes_total);

// Changes the amount of work once it is known better (a merge engine reports its own byte
// count with each unit).
void lm_progress_set_total(lm_progress *p, int64_t n_total, uint64_t bytes_total);

// Records that n_done units and bytes_done bytes are done, the last one being `name` (may be
// NULL): logs a `unit` event {"index", "total", "name", "bytes_done", "bytes_total"} and redraws
// the progress line when it is due (always for the last unit).
void lm_progress_update(lm_progress *p, int64_t n_done, uint64_t bytes_done, const char *name);

// Ends the progress line (its final state and the newline on a terminal) and stops the clock
// lm_progress_summary reports.
void lm_progress_end(lm_progress *p);

// Prints the summary line "PREFIX: VERB N units (BYTES) in T s (R MiB/s), peak memory M" unless
// quiet, e.g. "PREFIX: wrote 21 tensors (208.62 KiB) in 0.04 s (5.09 MiB/s), peak memory 9.80 MiB".
// Sizes and the rate are in binary units (KiB, MiB/s), as lm_format_bytes writes them.
void lm_progress_summary(lm_progress *p, const char *verb);

// The same line with the caller's words for what was done in place of "VERB N units", e.g.
// "llmerge ties: merged 4 tensors, copied 17 from the base (208.62 KiB) in ...".
void lm_progress_summary_as(lm_progress *p, const char *what);

// Prints "PREFIX: MESSAGE" on stderr unless quiet, first ending a progress line that is on
// screen so the two do not run together. For notes and warnings while work goes on.
void lm_progress_note(lm_progress *p, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

// A unit went from a device to another (the CPU) because the first was out of memory: prints
// "PREFIX: " and fb's line (lm_fallback_line: "fallback: PHASE UNIT on TO (REASON)") unless quiet, logs {"event": "fallback",
// "phase", "unit", "from", "to", "reason"}, and counts it in the progress line.
void lm_progress_fallback(lm_progress *p, const lm_fallback *fb);

// The fallback as a JSON object {"phase", "unit", "from", "to", "reason"} (new; NULL when
// memory runs out), as the event carries it and llmerge.json keeps it.
cJSON *lm_fallback_json(const lm_fallback *fb);

// Prints "PREFIX: error: MESSAGE" on stderr, quiet or not (ending a progress line first), and
// logs {"event": "error", "message", "exit_status"}.
void lm_progress_error(lm_progress *p, int exit_status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

// Writes one event to the JSON Lines file: `fields` (an object, or NULL) with "event", "time"
// and "elapsed_s" put first. Takes ownership of `fields` (deleted here). Does nothing but free
// `fields` when no file is open. A write error is reported once on stderr and the log is closed;
// the run goes on.
void lm_progress_event(lm_progress *p, const char *event, cJSON *fields);

// Closes the log and releases the mutex; safe on a zeroed object and twice.
void lm_progress_free(lm_progress *p);

#endif
