// Errors as values. Every fallible llmerge function returns an lm_status and, when it fails,
// fills an lm_err with a message that names the file, tensor, line or defect, so the caller
// can print it as it is. LM_ERR_DEVICE_OOM is kept apart from every other failure: it is the
// only status that makes llmerge fall back from an accelerator to the CPU.
#ifndef LM_STATUS_H
#define LM_STATUS_H

#include <stdarg.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum lm_status {
    LM_OK = 0,
    LM_ERR_USAGE,        // bad command line or option value
    LM_ERR_NOMEM,        // host allocation failed
    LM_ERR_IO,           // open/read/write/rename failed (errno text in the message)
    LM_ERR_FORMAT,       // a file is malformed: safetensors, JSON, config, adapter
    LM_ERR_UNSUPPORTED,  // well-formed but not something llmerge handles (dtype, peft_type)
    LM_ERR_NOT_FOUND,    // a named file or tensor does not exist
    LM_ERR_MISMATCH,     // inputs do not fit together (shapes, architectures)
    LM_ERR_DEVICE,       // any device failure other than out-of-memory
    LM_ERR_DEVICE_OOM,   // device out of memory: the one error that falls back
    LM_ERR_INTERRUPTED,  // stopped by a signal
    LM_ERR_BUSY,         // another process is using it (an output directory being written)
} lm_status;

#define LM_ERR_MSG_MAX 1024

typedef struct lm_err {
    lm_status status;
    char msg[LM_ERR_MSG_MAX];
} lm_err;

// Records `status` and a printf-style message in `err` (which may be NULL) and returns
// `status`, so a failure reads `return lm_err_set(err, LM_ERR_IO, "%s: %s", path, why);`.
lm_status lm_err_set(lm_err *err, lm_status status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

// Puts `fmt ...: ` in front of the message already in `err`, keeping its status, and returns
// that status. Used to add context ("model-00001.safetensors: ") on the way up.
lm_status lm_err_prefix(lm_err *err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

// Clears `err` to LM_OK with an empty message.
void lm_err_clear(lm_err *err);

// The enum value's name without the prefix, e.g. "FORMAT" (static string).
const char *lm_status_name(lm_status status);

// The process exit status for a failure: 2 for what can be known before any work starts
// (usage, malformed or mismatched input, an output another run is writing), 1 for failures of
// the work itself, 130 (128 + SIGINT) for a run stopped by a signal (a command that knows the
// signal exits 128 + its number instead: signals.h).
int lm_status_exit_code(lm_status status);

#ifdef __cplusplus
}
#endif

#endif
