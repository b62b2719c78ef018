// Signals: see signals.h. The first of SIGINT, SIGTERM, SIGHUP and SIGQUIT is stored in an
// atomic the work polls. What ends the process (a second signal, any signal in fatal mode,
// SIGBUS) runs in the handler, so it uses only what is async-signal-safe: lock-free atomics,
// write, openat, getdents64 (through syscall), unlinkat, lseek, close, nanosleep, sigaction,
// raise, _exit and strcmp, on fixed tables and stack buffers.
//
// The state word keeps a dying handler and the code that changes the registered paths apart:
// IDLE, BUSY (a thread is in an lm_signals_hold section) or DYING (a handler is removing what
// is registered; the process ends once it is done). A handler waits out BUSY, which is short
// and never held by its own thread (a holding thread blocks the four signals, and SIGBUS does
// not come from the code inside a section); a thread that wants to hold while DYING sleeps
// until the process ends.
#include "signals.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

// A handler may only touch atomics that need no lock.
_Static_assert(ATOMIC_INT_LOCK_FREE == 2 && ATOMIC_BOOL_LOCK_FREE == 2 && ATOMIC_POINTER_LOCK_FREE == 2 &&
                   ATOMIC_LONG_LOCK_FREE == 2,
               "the signal handlers need lock-free atomics");

#define N_STOP 4
static const int stop_sigs[N_STOP] = {SIGINT, SIGTERM, SIGHUP, SIGQUIT};
static bool installed[N_STOP];  // ours (not left ignored)

static atomic_int caught;             // the first stop signal, 0 before
static atomic_bool fatal_mode;        // lm_signals_install_fatal: no polling, every signal ends it
static const char *msg_prefix = "llmerge";
static bool stderr_tty;               // a progress line may be on screen: the message clears it

enum { STATE_IDLE, STATE_BUSY, STATE_DYING };
static atomic_int state = STATE_IDLE;
static _Thread_local int hold_depth;
static _Thread_local sigset_t hold_saved;

// The paths a dying handler removes (a slot is free when path is NULL).
#define N_REMOVE 8
static struct {
    _Atomic(const char *) path;
    atomic_bool named;
} removes[N_REMOVE];

// The mapped input files: [start, start + len) maps path. A slot is claimed through `used`;
// len is set last on adding and cleared first on removing, so a reader that sees len > 0 sees
// the rest.
#define N_MAPS 1024
static struct {
    atomic_bool used;
    atomic_uintptr_t start;
    atomic_size_t len;
    _Atomic(const char *) path;
} maps[N_MAPS];

// ==== async-signal-safe pieces ================================================================

// A line built in a stack buffer, cut at its capacity, for one write(2).
typedef struct line {
    char buf[2048];
    size_t len;
} line;

static void put(line *l, const char *s)
{
    while (*s && l->len < sizeof l->buf - 1)
        l->buf[l->len++] = *s++;
}

// Begins the line with the prefix, first clearing a progress line that may be on a terminal.
static void start(line *l)
{
    l->len = 0;
    if (stderr_tty)
        put(l, "\r\033[K");
    put(l, msg_prefix);
}

static void put_hex(line *l, uintptr_t v)
{
    char tmp[2 + 2 * sizeof v + 1];
    int n = 0;
    char digits[2 * sizeof v];
    do {
        digits[n++] = "0123456789abcdef"[v & 15];
        v >>= 4;
    } while (v);
    tmp[0] = '0';
    tmp[1] = 'x';
    for (int i = 0; i < n; i++)
        tmp[2 + i] = digits[n - 1 - i];
    tmp[2 + n] = '\0';
    put(l, tmp);
}

static void put_signame(line *l, int sig)
{
    const char *name = sig == SIGINT ? "SIGINT" : sig == SIGTERM ? "SIGTERM" : sig == SIGHUP ? "SIGHUP"
                       : sig == SIGQUIT ? "SIGQUIT" : sig == SIGBUS ? "SIGBUS" : "a signal";
    put(l, name);
}

static void emit(line *l)
{
    l->buf[l->len++] = '\n';
    for (size_t done = 0; done < l->len;) {
        ssize_t w = write(2, l->buf + done, l->len - done);
        if (w <= 0 && errno != EINTR)
            return;
        if (w > 0)
            done += (size_t)w;
    }
}

static void pause_ms(long ms)
{
    struct timespec ts = {.tv_sec = 0, .tv_nsec = ms * 1000000L};
    nanosleep(&ts, NULL);
}

// What getdents64 returns, one entry after another.
struct dirent64_raw {
    uint64_t d_ino;
    int64_t d_off;
    unsigned short d_reclen;
    unsigned char d_type;
    char d_name[];
};

// Removes `name` under the directory dirfd (AT_FDCWD: the working directory) and, when it is a
// directory, everything in it, without following links. Entries created meanwhile by another
// thread are caught by reading the directory again until it is empty (a few passes at most).
static void remove_tree(int dirfd, const char *name, int depth)
{
    if (unlinkat(dirfd, name, 0) == 0 || errno == ENOENT)
        return;
    if ((errno != EISDIR && errno != EPERM) || depth > 32)
        return;
    int fd = openat(dirfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0)
        return;
    _Alignas(8) char buf[2048];
    for (int pass = 0; pass < 16; pass++) {
        bool any = false;
        lseek(fd, 0, SEEK_SET);
        long n;
        while ((n = syscall(SYS_getdents64, fd, buf, sizeof buf)) > 0) {
            for (long off = 0; off < n;) {
                struct dirent64_raw *d = (struct dirent64_raw *)(void *)(buf + off);
                off += d->d_reclen;
                if (strcmp(d->d_name, ".") == 0 || strcmp(d->d_name, "..") == 0)
                    continue;
                remove_tree(fd, d->d_name, depth + 1);
                any = true;
            }
        }
        if (!any)
            break;
    }
    close(fd);
    unlinkat(dirfd, name, AT_REMOVEDIR);
}

// Takes the state word for the dying handler: waits out a hold section of another thread, and
// never returns when another handler is already ending the process.
static void take_dying(void)
{
    for (;;) {
        int expected = STATE_IDLE;
        if (atomic_compare_exchange_strong(&state, &expected, STATE_DYING))
            return;
        if (expected == STATE_DYING)
            for (;;)
                pause_ms(100);
        pause_ms(1);
    }
}

// Removes every registered path (the named ones first: they are the big ones) and adds
// "SEP removed the partial output P" to the line for the named ones.
static void remove_registered(line *l, const char *sep)
{
    bool said = false;
    for (int pass = 0; pass < 2; pass++)
        for (int i = 0; i < N_REMOVE; i++) {
            const char *p = atomic_load(&removes[i].path);
            bool named = atomic_load(&removes[i].named);
            if (!p || named != (pass == 0))
                continue;
            remove_tree(AT_FDCWD, p, 0);
            if (named) {
                if (!said) {
                    put(l, sep);
                    put(l, " removed the partial output ");
                } else {
                    put(l, ", ");
                }
                put(l, p);
                said = true;
            }
        }
}

// Ends the process for the stop signal `sig` (a second one, or any in fatal mode): removes what
// is registered, says so, and dies of the signal.
static void die_of(int sig, bool again)
{
    take_dying();
    line l;
    start(&l);
    put(&l, ": error: interrupted by ");
    put_signame(&l, sig);
    if (again)
        put(&l, " again");
    remove_registered(&l, ":");
    put(&l, again ? "; stopped at once" : "");
    emit(&l);
    struct sigaction dfl = {.sa_handler = SIG_DFL};
    sigemptyset(&dfl.sa_mask);
    sigaction(sig, &dfl, NULL);
    // Blocked while this handler runs: delivered, with the default action, as it returns.
    raise(sig);
}

static void on_stop(int sig)
{
    int saved = errno;
    int expected = 0;
    if (!atomic_load(&fatal_mode) && atomic_compare_exchange_strong(&caught, &expected, sig)) {
        errno = saved;
        return;  // the first one: the work polls and stops cleanly
    }
    die_of(sig, !atomic_load(&fatal_mode));
    errno = saved;
}

static void on_bus(int sig, siginfo_t *info, void *uctx)
{
    (void)uctx;
    uintptr_t addr = (uintptr_t)info->si_addr;
    const char *file = NULL;
    for (int i = 0; i < N_MAPS && !file; i++) {
        size_t len = atomic_load(&maps[i].len);
        uintptr_t start = atomic_load(&maps[i].start);
        if (len && addr >= start && addr - start < len)
            file = atomic_load(&maps[i].path);
    }
    take_dying();
    line l;
    start(&l);
    put(&l, ": error: ");
    if (file) {
        put(&l, file);
        put(&l, " changed while llmerge was reading it (it is shorter than when it was opened: "
                "another program truncated or rewrote it)");
    } else {
        put(&l, "bus error (");
        put_signame(&l, sig);
        put(&l, ") at ");
        put_hex(&l, addr);
        put(&l, ": a file mapped into memory may have been truncated");
    }
    remove_registered(&l, ";");
    emit(&l);
    _exit(1);
}

// ==== installing ==============================================================================

void lm_signals_init(const char *prefix)
{
    if (prefix)
        msg_prefix = prefix;
    stderr_tty = isatty(2) == 1;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_bus;
    sigemptyset(&sa.sa_mask);
    for (int i = 0; i < N_STOP; i++)
        sigaddset(&sa.sa_mask, stop_sigs[i]);
    sa.sa_flags = SA_SIGINFO;
    sigaction(SIGBUS, &sa, NULL);
}

static void install(bool fatal)
{
    atomic_store(&caught, 0);
    atomic_store(&fatal_mode, fatal);
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_stop;
    sigemptyset(&sa.sa_mask);
    // The four are blocked while a handler runs in this thread; another thread's handler is
    // kept apart by the atomics.
    for (int i = 0; i < N_STOP; i++)
        sigaddset(&sa.sa_mask, stop_sigs[i]);
    sa.sa_flags = SA_RESTART;
    for (int i = 0; i < N_STOP; i++) {
        if (installed[i]) {
            sigaction(stop_sigs[i], &sa, NULL);
            continue;
        }
        // A signal ignored when we started stays ignored, as for any well-behaved program:
        // `llmerge ... &` from a script, or under nohup, is not for Ctrl-C (or a hangup) to stop.
        struct sigaction old;
        if (sigaction(stop_sigs[i], NULL, &old) == 0 && old.sa_handler == SIG_IGN)
            continue;
        installed[i] = sigaction(stop_sigs[i], &sa, NULL) == 0;
    }
}

void lm_signals_install(void)
{
    install(false);
}

void lm_signals_install_fatal(void)
{
    install(true);
}

void lm_signals_restore(void)
{
    for (int i = 0; i < N_STOP; i++) {
        if (installed[i])
            signal(stop_sigs[i], SIG_DFL);
        installed[i] = false;
    }
}

int lm_interrupted(void)
{
    return atomic_load(&caught);
}

const char *lm_signal_name(int sig)
{
    static _Thread_local char buf[32];
    switch (sig) {
    case SIGINT: return "SIGINT";
    case SIGTERM: return "SIGTERM";
    case SIGHUP: return "SIGHUP";
    case SIGQUIT: return "SIGQUIT";
    }
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

// ==== the registered paths ====================================================================

void lm_signals_hold(void)
{
    if (hold_depth++ > 0)
        return;
    sigset_t block;
    sigemptyset(&block);
    for (int i = 0; i < N_STOP; i++)
        sigaddset(&block, stop_sigs[i]);
    pthread_sigmask(SIG_BLOCK, &block, &hold_saved);
    for (;;) {
        int expected = STATE_IDLE;
        if (atomic_compare_exchange_strong(&state, &expected, STATE_BUSY))
            return;
        if (expected == STATE_DYING)  // a handler is ending the process and cleaning up
            for (;;)
                pause_ms(100);
        pause_ms(1);
    }
}

void lm_signals_release(void)
{
    if (hold_depth == 0 || --hold_depth > 0)
        return;
    atomic_store(&state, STATE_IDLE);
    pthread_sigmask(SIG_SETMASK, &hold_saved, NULL);
}

int lm_signals_remove_on_exit(const char *path, bool named)
{
    int id = 0;
    lm_signals_hold();
    for (int i = 0; i < N_REMOVE && !id; i++)
        if (!atomic_load(&removes[i].path)) {
            atomic_store(&removes[i].named, named);
            atomic_store(&removes[i].path, path);
            id = i + 1;
        }
    lm_signals_release();
    return id;
}

void lm_signals_forget(int id)
{
    if (id < 1 || id > N_REMOVE)
        return;
    lm_signals_hold();
    atomic_store(&removes[id - 1].path, NULL);
    lm_signals_release();
}

// ==== mapped input files ======================================================================

int lm_signals_map_add(const void *addr, size_t len, const char *path)
{
    static atomic_int hint;
    int first = atomic_load(&hint);
    for (int k = 0; k < N_MAPS; k++) {
        int i = (first + k) % N_MAPS;
        bool expected = false;
        if (atomic_load(&maps[i].used) || !atomic_compare_exchange_strong(&maps[i].used, &expected, true))
            continue;
        atomic_store(&maps[i].path, path);
        atomic_store(&maps[i].start, (uintptr_t)addr);
        atomic_store(&maps[i].len, len);
        atomic_store(&hint, (i + 1) % N_MAPS);
        return i + 1;
    }
    return 0;
}

void lm_signals_map_remove(int id)
{
    if (id < 1 || id > N_MAPS)
        return;
    int i = id - 1;
    atomic_store(&maps[i].len, 0);
    atomic_store(&maps[i].start, 0);
    atomic_store(&maps[i].path, NULL);
    atomic_store(&maps[i].used, false);
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
