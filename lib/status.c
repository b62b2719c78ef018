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
    char head[LM_ERR_MSG_MAX], old[LM_ERR_MSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(head, sizeof head, fmt, ap);
    va_end(ap);
    memcpy(old, err->msg, sizeof old);
    snprintf(err->msg, sizeof err->msg, "%s: %s", head, old);
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
        return 2;
    case LM_ERR_INTERRUPTED: return 130;
    default: return 1;
    }
}
