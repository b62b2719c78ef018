// The device registry: opens a device from a --device value (lm_dev_open, device.h). It is the
// one place that knows every backend (the CPU, the simulated accelerator, and CUDA in builds
// with it), so it sits in a library of its own, llmerge_devices, above the core (which holds the
// dispatcher and the CPU and sim backends) and the CUDA backend (which uses the core's helpers):
// the command and the tests that open devices by name link it, and nothing below calls it. The
// emulated CUDA device (cuda-emu, backends/cuda-emu/) is in every build, for testing; auto never
// picks it.
#include "device_registry.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_emu.h"
#include "util.h"

#ifdef LLMERGE_HAVE_CUDA
#include "kernels.h"
#endif

static void say(char *why, size_t why_size, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

static void say(char *why, size_t why_size, const char *fmt, ...)
{
    if (why && why_size) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(why, why_size, fmt, ap);
        va_end(ap);
    }
}

// "cuda" or "cuda:N": *ordinal = N (0 for plain "cuda"); false when the text is malformed.
static bool parse_cuda(const char *spec, int *ordinal)
{
    if (strcmp(spec, "cuda") == 0) {
        *ordinal = 0;
        return true;
    }
    if (strncmp(spec, "cuda:", 5) != 0 || !spec[5])
        return false;
    long v = 0;
    for (const char *p = spec + 5; *p; p++) {
        if (*p < '0' || *p > '9' || v > 1000000)
            return false;
        v = v * 10 + (*p - '0');
    }
    *ordinal = (int)v;
    return true;
}

// Says what was opened: d's name, and after it in parentheses what it does without (its note).
static void say_opened(char *why, size_t why_size, lm_dev *d, const char *note)
{
    if (note)
        say(why, why_size, "%s (%s)", lm_dev_name(d), note);
    else
        say(why, why_size, "%s", lm_dev_name(d));
}

// "cuda-emu" or "cuda-emu:SIZE": the emulated CUDA device (default 1 GiB), whatever the build;
// LLMERGE_EMU_FAIL injects its failures.
static lm_status open_cuda_emu(lm_dev **out, const char *spec, const lm_dev_opts *o, char *why, size_t why_size,
                               lm_err *err)
{
    uint64_t budget = (uint64_t)1 << 30;
    if (spec[8] && lm_parse_size(spec + 9, &budget, err) != LM_OK)
        return lm_err_prefix(err, "--device %s", spec);
    if (budget == 0)
        return lm_err_set(err, LM_ERR_USAGE, "--device %s: the emulated device needs a size above 0", spec);
    lm_status s = lm_dev_cuda_emu_create(out, budget, o->mem_cap, getenv("LLMERGE_EMU_FAIL"), o->threads, err);
    if (s != LM_OK)
        return lm_err_prefix(err, "--device %s", spec);
    say_opened(why, why_size, *out, lm_cuda_emu_note(*out));
    return LM_OK;
}

static lm_status open_cuda(lm_dev **out, const char *spec, int ordinal, const lm_dev_opts *o, char *why,
                           size_t why_size, lm_err *err)
{
#ifdef LLMERGE_HAVE_CUDA
    lm_status s = lm_dev_cuda_create(out, ordinal, o->mem_cap, o->threads, err);
    if (s != LM_OK)
        return lm_err_prefix(err, "--device %s", spec);
    say_opened(why, why_size, *out, lm_cuda_device_note(*out));
    return LM_OK;
#else
    (void)out, (void)ordinal, (void)o, (void)why, (void)why_size;
    return lm_err_set(err, LM_ERR_USAGE, "--device %s: this llmerge was built without CUDA "
                      "(use auto, cpu or sim:SIZE)", spec);
#endif
}

// --device auto: CUDA device 0 when there is one and it passes the self-test, else the CPU.
// Why it chose the CPU says what stood in the way: no driver or one too old for this build's
// runtime (lm_cuda_device_count's message, with both versions), no device, the self-test, or
// the device failing to open (a library missing, with the dynamic linker's words).
static lm_status open_auto(lm_dev **out, const lm_dev_opts *o, char *why, size_t why_size, lm_err *err)
{
#ifdef LLMERGE_HAVE_CUDA
    int count = 0;
    lm_err probe = {0};
    if (lm_cuda_device_count(&count, &probe) != LM_OK) {
        say(why, why_size, "auto: cpu (CUDA is not usable: %s)", probe.msg);
    } else if (count == 0) {
        say(why, why_size, "auto: cpu (no CUDA device found)");
    } else if (lm_cuda_selftest(0, &probe) != LM_OK) {
        say(why, why_size, "auto: cpu (cuda:0 failed its self-test: %s)", probe.msg);
    } else if (lm_dev_cuda_create(out, 0, o->mem_cap, o->threads, &probe) != LM_OK) {
        say(why, why_size, "auto: cpu (cuda:0 could not be opened: %s)", probe.msg);
    } else {
        const char *note = lm_cuda_device_note(*out);
        say(why, why_size, "auto: %s (passed its self-test%s%s)", lm_dev_name(*out), note ? "; " : "",
            note ? note : "");
        return LM_OK;
    }
#else
    say(why, why_size, "auto: cpu (this llmerge was built without CUDA)");
#endif
    return lm_dev_cpu_create(out, o->threads, err);
}

lm_status lm_dev_open(lm_dev **out, const char *spec, const lm_dev_opts *o, char *why, size_t why_size,
                      lm_err *err)
{
    *out = NULL;
    if (why && why_size)
        why[0] = 0;
    int ordinal;
    lm_status s;
    if (strcmp(spec, "auto") == 0)
        return open_auto(out, o, why, why_size, err);
    if (strcmp(spec, "cpu") == 0) {
        s = lm_dev_cpu_create(out, o->threads, err);
    } else if (parse_cuda(spec, &ordinal)) {
        return open_cuda(out, spec, ordinal, o, why, why_size, err);
    } else if (strcmp(spec, "cuda-emu") == 0 || strncmp(spec, "cuda-emu:", 9) == 0) {
        return open_cuda_emu(out, spec, o, why, why_size, err);
    } else if (strncmp(spec, "sim:", 4) == 0) {
        uint64_t budget;
        if (lm_parse_size(spec + 4, &budget, err) != LM_OK)
            return lm_err_prefix(err, "--device %s", spec);
        if (budget == 0)
            return lm_err_set(err, LM_ERR_USAGE, "--device %s: the simulated device needs a size above 0", spec);
        if (o->mem_cap && o->mem_cap < budget)
            budget = o->mem_cap;
        s = lm_dev_sim_create(out, budget, o->sim_fail, o->threads, err);
    } else {
        return lm_err_set(err, LM_ERR_USAGE, "--device %s: unknown device (use auto, cpu, cuda[:N], sim:SIZE "
                          "or cuda-emu[:SIZE])",
                          spec);
    }
    if (s == LM_OK)
        say(why, why_size, "%s", lm_dev_name(*out));
    return s;
}
