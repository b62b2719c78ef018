// Errors as values: see status.h.
#include "status.h"

#include <stdio.h>
#include <string.h>

lm_status lm_err_set(lm_err *err, lm_status status, const char *fmt, ...)
{
    if (err) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err->msg, sizeof err->msg, fmt, ap);
        va_end(ap);
        err->status = status;
    }
    return status;
}

lm_status lm_err_prefix(lm_err *err, const char *fmt, ...)
{
    if (!err)
        return LM_OK;
    char old[LM_ERR_MSG_MAX];
    memcpy(old, err->msg, sizeof old);
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(err->msg, sizeof err->msg, fmt, ap);
    va_end(ap);
    // Append ": old" after the head, cut to the buffer (the tail of a long message is lost).
    if (n >= 0 && (size_t)n < sizeof err->msg - 3) {
        size_t room = sizeof err->msg - (size_t)n;
        err->msg[n] = ':';
        err->msg[n + 1] = ' ';
        size_t len = strnlen(old, sizeof old - 1);
        if (len > room - 3)
            len = room - 3;
        memcpy(err->msg + n + 2, old, len);
        err->msg[n + 2 + len] = '\0';
    }
    return err->status;
}

void lm_err_clear(lm_err *err)
{
    if (err) {
        err->status = LM_OK;
        err->msg[0] = '\0';
    }
}

const char *lm_status_name(lm_status status)
{
    switch (status) {
    case LM_OK: return "OK";
    case LM_ERR_USAGE: return "USAGE";
    case LM_ERR_NOMEM: return "NOMEM";
    case LM_ERR_IO: return "IO";
    case LM_ERR_FORMAT: return "FORMAT";
    case LM_ERR_UNSUPPORTED: return "UNSUPPORTED";
    case LM_ERR_NOT_FOUND: return "NOT_FOUND";
    case LM_ERR_MISMATCH: return "MISMATCH";
    case LM_ERR_DEVICE: return "DEVICE";
    case LM_ERR_DEVICE_OOM: return "DEVICE_OOM";
    case LM_ERR_INTERRUPTED: return "INTERRUPTED";
    case LM_ERR_BUSY: return "BUSY";
    }
    return "UNKNOWN";
}

int lm_status_exit_code(lm_status status)
{
    switch (status) {
    case LM_OK: return 0;
    case LM_ERR_USAGE:
    case LM_ERR_FORMAT:
    case LM_ERR_UNSUPPORTED:
    case LM_ERR_NOT_FOUND:
    case LM_ERR_MISMATCH:
    case LM_ERR_BUSY:
        return 2;
    case LM_ERR_INTERRUPTED: return 130;
    default: return 1;
    }
}
