// The entry skeleton of the subcommands that do a run (command.h).
#include "command.h"

#include "args.h"

int lm_command_run(const lm_command *c, int argc, char **argv)
{
    lm_progress *p = c->progress;
    lm_progress_init(p, c->prefix, false);
    lm_err err = {0}, log_err = {0};
    int rc;
    if (argc < 2) {
        c->usage(c->ctx, stderr);
        rc = 2;
        goto done;
    }
    const char *log_json = lm_cmd_find_log_json(argc, argv);
    bool help = false, no_log = false;
    lm_status ps = c->parse(c->ctx, argc, argv, &help, &err), s = ps;
    // the inputs the command line names, which no output may be: also when it does not parse
    if (c->guard_args(c->ctx, argc, argv, &log_err) != LM_OK) {
        lm_progress_error(p, 1, "%s", log_err.msg);
        rc = 1;
        goto done;
    }
    if (ps == LM_OK && !help)
        s = c->prepare(c->ctx, &no_log, &err);
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
        c->usage(c->ctx, stdout);
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
