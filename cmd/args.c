// The option scanner: see args.h.
#include "args.h"

#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cmd.h"
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
