// SIGINT and SIGTERM as a flag the work polls: see signals.h. The handler does the one thing
// that is async-signal-safe and enough: store the signal's number in a volatile sig_atomic_t.
// The first signal wins; SA_RESETHAND makes the next one of the same kind fatal.
#include "signals.h"

#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static volatile sig_atomic_t caught;
static bool installed[2];  // SIGINT, SIGTERM: ours (not left ignored)
static const int sigs[2] = {SIGINT, SIGTERM};

static void on_signal(int sig)
{
    if (!caught)
        caught = sig;
}

void lm_signals_install(void)
{
    caught = 0;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    // Both signals are blocked while the handler runs, so a SIGTERM cannot overwrite a SIGINT
    // half-way (on_signal keeps the first anyway).
    sigaddset(&sa.sa_mask, SIGINT);
    sigaddset(&sa.sa_mask, SIGTERM);
    sa.sa_flags = SA_RESTART | SA_RESETHAND;
    for (int i = 0; i < 2; i++) {
        // A signal ignored when we started stays ignored, as for any well-behaved program:
        // `llmerge ... &` from a script, or under nohup, is not for Ctrl-C to stop.
        struct sigaction old;
        if (sigaction(sigs[i], NULL, &old) == 0 && old.sa_handler == SIG_IGN)
            continue;
        installed[i] = sigaction(sigs[i], &sa, NULL) == 0;
    }
}

void lm_signals_restore(void)
{
    for (int i = 0; i < 2; i++) {
        if (installed[i])
            signal(sigs[i], SIG_DFL);
        installed[i] = false;
    }
}

int lm_interrupted(void)
{
    return caught;
}

const char *lm_signal_name(int sig)
{
    static _Thread_local char buf[32];
    if (sig == SIGINT)
        return "SIGINT";
    if (sig == SIGTERM)
        return "SIGTERM";
    snprintf(buf, sizeof buf, "signal %d", sig);
    return buf;
}

lm_status lm_interrupted_err(lm_err *err)
{
    return lm_err_set(err, LM_ERR_INTERRUPTED, "interrupted by %s", lm_signal_name(lm_interrupted()));
}

int lm_signal_exit_code(int sig)
{
    return 128 + sig;
}

void lm_test_delay(void)
{
    static int ms = -1;  // read once; the commands call this from one thread
    if (ms < 0) {
        const char *v = getenv("LLMERGE_TEST_DELAY_MS");
        ms = v ? atoi(v) : 0;
        if (ms < 0)
            ms = 0;
    }
    if (ms == 0 || lm_interrupted())
        return;
    struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);  // EINTR from our handler ends it early, as wanted
}
