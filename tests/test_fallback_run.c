// Tests of fallback.h: the line a fallback is said with, and lm_fallback_run's contract (a unit
// that runs out of device memory is undone, said once and run again on the CPU; any other
// failure stops at once; on the CPU alone the unit runs once). The units here are counters,
// the devices the simulated one and the CPU, so that each step of the driver can be seen.
#include <stdio.h>
#include <string.h>

#include "check.h"
#include "device_registry.h"
#include "fallback.h"
#include "notes.h"

// A unit that fails with `fail` on `fail_on` and records where and in what order it ran.
typedef struct unit {
    lm_dev *fail_on;
    lm_status fail;
    int runs, undos;
    lm_dev *ran_on[4];
    char order[16];  // 'w' for each try, 'u' for each undo
} unit;

static lm_status work(void *ctx, lm_dev *dev, lm_err *err)
{
    unit *u = ctx;
    if (u->runs < 4)
        u->ran_on[u->runs] = dev;
    u->runs++;
    strcat(u->order, "w");
    if (dev == u->fail_on && u->fail != LM_OK)
        return lm_err_set(err, u->fail, "%s: out of memory (4096 bytes asked)", lm_dev_name(dev));
    return LM_OK;
}

static void undo(void *ctx)
{
    unit *u = ctx;
    u->undos++;
    strcat(u->order, "u");
}

static void test_line(void)
{
    char line[LM_FALLBACK_LINE_MAX];
    lm_fallback fb = {"merge", "model.layers.7.mlp.up_proj.weight", "sim:1MiB", "cpu", "sim: out of memory"};
    CHECK(strcmp(lm_fallback_line(line, sizeof line, &fb),
                 "fallback: merge model.layers.7.mlp.up_proj.weight on cpu (sim: out of memory)") == 0);
    char small[16];
    lm_fallback_line(small, sizeof small, &fb);
    CHECK(strcmp(small, "fallback: merge") == 0);
    notes n = {0};
    lm_fallback_say(collect_note, &n, &fb);
    lm_fallback_say(NULL, &n, &fb);  // nobody to tell: nothing said
    CHECK(n.n == 1 && n.fallbacks == 1 && strcmp(n.phase, "merge") == 0 && strcmp(n.to, "cpu") == 0);
    CHECK(strcmp(n.text, "fallback: merge model.layers.7.mlp.up_proj.weight on cpu (sim: out of memory)\n") == 0);
}

static void test_run(lm_dev *sim, lm_dev *cpu)
{
    lm_err err = {0};
    // fits: one try on the device, nothing said
    unit a = {.fail_on = cpu, .fail = LM_ERR_DEVICE_OOM};
    notes n = {0};
    lm_fallback_unit u = {.phase = "merge", .unit = "T", .work = work, .undo = undo, .ctx = &a, .say = collect_note,
                          .say_ctx = &n};
    CHECK_OK(lm_fallback_run(&u, sim, cpu, &err), &err);
    CHECK(a.runs == 1 && a.ran_on[0] == sim && a.undos == 0 && !u.fell_back && u.seconds == 0 && n.n == 0);

    // out of memory on the device: undone, said, run again on the CPU
    unit b = {.fail_on = sim, .fail = LM_ERR_DEVICE_OOM};
    memset(&n, 0, sizeof n);
    u.ctx = &b;
    CHECK_OK(lm_fallback_run(&u, sim, cpu, &err), &err);
    CHECK(b.runs == 2 && b.ran_on[0] == sim && b.ran_on[1] == cpu && strcmp(b.order, "wuw") == 0);
    CHECK(u.fell_back && u.seconds >= 0 && err.msg[0] == '\0');
    CHECK(n.n == 1 && n.fallbacks == 1 && strcmp(n.phase, "merge") == 0 && strcmp(n.unit, "T") == 0 &&
          strcmp(n.from, lm_dev_name(sim)) == 0 && strcmp(n.to, "cpu") == 0);
    char want[256];
    snprintf(want, sizeof want, "fallback: merge T on cpu (%s: out of memory (4096 bytes asked))\n", lm_dev_name(sim));
    CHECK_MSG(strcmp(n.text, want) == 0, "%s", n.text);

    // without a CPU device the redo gets NULL, and the event says "cpu"
    unit c = {.fail_on = sim, .fail = LM_ERR_DEVICE_OOM};
    memset(&n, 0, sizeof n);
    u.ctx = &c;
    u.undo = NULL;
    CHECK_OK(lm_fallback_run(&u, sim, NULL, &err), &err);
    CHECK(c.runs == 2 && c.ran_on[1] == NULL && u.fell_back && n.fallbacks == 1 && strcmp(n.to, "cpu") == 0);

    // any other failure stops: no undo, nothing said, no redo
    unit d = {.fail_on = sim, .fail = LM_ERR_DEVICE};
    memset(&n, 0, sizeof n);
    u.ctx = &d;
    u.undo = undo;
    CHECK_FAILS(lm_fallback_run(&u, sim, cpu, &err), LM_ERR_DEVICE, "out of memory", &err);
    CHECK(d.runs == 1 && d.undos == 0 && !u.fell_back && n.n == 0);

    // the CPU alone: one run, its out of memory returned as it is
    unit e = {.fail_on = cpu, .fail = LM_ERR_DEVICE_OOM};
    u.ctx = &e;
    CHECK_FAILS(lm_fallback_run(&u, cpu, cpu, &err), LM_ERR_DEVICE_OOM, "out of memory", &err);
    CHECK(e.runs == 1 && e.undos == 0 && !u.fell_back && n.n == 0);

}

// A unit whose work succeeds but leaves the device in error: it releases a pointer the device
// never gave out (which a release cannot report), on dev and, when it falls back, in its undo.
typedef struct leaky {
    lm_dev *dev;
    bool oom_first;  // the try on dev runs out of memory, and the undo makes the bad release
    int runs;
} leaky;

static lm_status leaky_work(void *ctx, lm_dev *dev, lm_err *err)
{
    leaky *l = ctx;
    static char not_a_buffer[8];
    l->runs++;
    if (dev == l->dev && l->oom_first)
        return lm_err_set(err, LM_ERR_DEVICE_OOM, "%s: out of memory", lm_dev_name(dev));
    if (dev == l->dev)
        lm_dev_buf_free(dev, not_a_buffer);
    return LM_OK;
}

static void leaky_undo(void *ctx)
{
    leaky *l = ctx;
    static char not_a_buffer[8];
    lm_dev_buf_free(l->dev, not_a_buffer);
}

// lm_fallback_run ends a unit with lm_dev_check: a failure the device kept from the unit is the
// unit's, whether the unit ran there or fell back; on the CPU alone nothing is checked.
static void test_unit_end(lm_dev *sim, lm_dev *cpu)
{
    lm_err err = {0};
    notes n = {0};
    leaky l = {.dev = sim};
    lm_fallback_unit u = {.phase = "merge", .unit = "t", .work = leaky_work, .undo = leaky_undo, .ctx = &l,
                          .say = collect_note, .say_ctx = &n};
    CHECK_FAILS(lm_fallback_run(&u, sim, cpu, &err), LM_ERR_DEVICE, "not a live sim buffer", &err);
    CHECK(l.runs == 1 && !u.fell_back);
    // reported once: the device is clean again
    CHECK_OK(lm_dev_check(sim, &err), &err);

    leaky f = {.dev = sim, .oom_first = true};
    u.ctx = &f;
    CHECK_FAILS(lm_fallback_run(&u, sim, cpu, &err), LM_ERR_DEVICE, "not a live sim buffer", &err);
    CHECK(f.runs == 2 && u.fell_back && n.fallbacks == 1);
    CHECK_OK(lm_dev_check(sim, &err), &err);

    // a unit that leaves the device clean passes the check
    leaky ok = {.dev = cpu};
    u.ctx = &ok;
    CHECK_OK(lm_fallback_run(&u, sim, cpu, &err), &err);
    CHECK(ok.runs == 1);
}

int main(void)
{
    test_line();
    lm_err err = {0};
    lm_dev *sim = NULL, *cpu = NULL;
    lm_dev_opts o = {.threads = 1};
    CHECK_OK(lm_dev_open(&sim, "sim:1MiB", &o, NULL, 0, &err), &err);
    CHECK_OK(lm_dev_cpu_create(&cpu, 1, &err), &err);
    if (sim && cpu) {
        test_run(sim, cpu);
        test_unit_end(sim, cpu);
    }
    lm_dev_destroy(sim);
    lm_dev_destroy(cpu);
    return check_report("test_fallback_run");
}
