// Falling back from a device to the CPU: the event and the driver (fallback.h).
#include "fallback.h"

#include <stdio.h>

#include "util.h"

char *lm_fallback_line(char *buf, size_t cap, const lm_fallback *fb)
{
    snprintf(buf, cap, "fallback: %s %s on %s (%s)", fb->phase, fb->unit, fb->to, fb->reason);
    return buf;
}

void lm_fallback_say(lm_fallback_fn say, void *ctx, const lm_fallback *fb)
{
    if (!say)
        return;
    char line[LM_FALLBACK_LINE_MAX];
    say(ctx, lm_fallback_line(line, sizeof line, fb), fb);
}

// Ends a unit that ran on dev, or left it: a fault of the unit's last work on dev, or a failure
// kept from a release that could not report it, stops the run here rather than going unseen.
static lm_status unit_end(lm_dev *dev, lm_dev *cpu, lm_status s, lm_err *err)
{
    return s == LM_OK && dev && dev != cpu ? lm_dev_check(dev, err) : s;
}

lm_status lm_fallback_run(lm_fallback_unit *u, lm_dev *dev, lm_dev *cpu, lm_err *err)
{
    u->fell_back = false;
    u->seconds = 0;
    double t0 = lm_now();
    lm_status s = u->work(u->ctx, dev, err);
    if (s != LM_ERR_DEVICE_OOM || dev == cpu)
        return unit_end(dev, cpu, s, err);
    if (u->undo)
        u->undo(u->ctx);
    u->fell_back = true;
    lm_fallback_say(u->say, u->say_ctx,
                    &(lm_fallback){u->phase, u->unit, lm_dev_name(dev), cpu ? lm_dev_name(cpu) : "cpu", err->msg});
    lm_err_clear(err);
    s = u->work(u->ctx, cpu, err);
    u->seconds = lm_now() - t0;
    return unit_end(dev, cpu, s, err);
}
