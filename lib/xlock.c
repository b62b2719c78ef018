// A lock file for processes on many nodes: see xlock.h.
#define _GNU_SOURCE
#include "xlock.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "signals.h"
#include "util.h"

#define TEXT_MAX 512

struct lm_xlock {
    char *path;
    char text[TEXT_MAX];  // what the file holds: "HOST PID TOKEN\n"
    int sig_id;           // the signal handlers' entry for the file
    double beat_s;
    pthread_t beat;
    bool beating;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool stop;
};

double lm_xlock_stale_seconds(void)
{
    const char *v = getenv("LLMERGE_LOCK_STALE");
    char *end;
    double s = v && *v ? strtod(v, &end) : 0;
    return v && *v && *end == '\0' && s > 0 && s < 1e9 ? s : 300.0;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void sleep_s(double s)
{
    struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
    nanosleep(&ts, NULL);  // a signal cuts it short; the caller checks lm_interrupted
}

// This host's name (or "localhost" where it has none).
static void host_name(char *buf, size_t cap)
{
    if (gethostname(buf, cap) != 0 || !buf[0])
        snprintf(buf, cap, "localhost");
    buf[cap - 1] = '\0';
}

// This process's PID namespace (the inode of /proc/self/ns/pid; 0 where it cannot be told).
static unsigned long long pid_ns(void)
{
    struct stat st;
    return stat("/proc/self/ns/pid", &st) == 0 ? (unsigned long long)st.st_ino : 0;
}

// Whether a process with this pid runs here: /proc/PID/stat exists and its state is not a
// zombie's (a dead holder's parent may not have reaped it yet).
static bool pid_alive(long pid)
{
    char p[64], buf[512];
    snprintf(p, sizeof p, "/proc/%ld/stat", pid);
    FILE *f = fopen(p, "r");
    if (!f)
        return kill((pid_t)pid, 0) == 0 || errno == EPERM;  // no /proc: ask the kernel
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = '\0';
    const char *close_paren = strrchr(buf, ')');
    return !(close_paren && close_paren[1] == ' ' && (close_paren[2] == 'Z' || close_paren[2] == 'X'));
}

// The lock file's text and identity: 1 when read, 0 when there is no file, -1 on another error
// (errno set).
static int read_lock(const char *path, char *text, struct stat *st)
{
    int fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0)
        return errno == ENOENT ? 0 : -1;
    ssize_t n = fstat(fd, st) == 0 ? read(fd, text, TEXT_MAX - 1) : -1;
    int e = errno;
    close(fd);
    if (n < 0) {
        errno = e;
        return -1;
    }
    text[n] = '\0';
    return 1;
}

// Creates the lock file holding `text`: 1 when this process made it, 0 when it is there, -1 on
// another error (errno set; nothing left behind).
static int create_lock(const char *path, const char *text)
{
    int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd < 0)
        return errno == EEXIST ? 0 : -1;
    size_t len = strlen(text);
    bool ok = write(fd, text, len) == (ssize_t)len;
    int e = errno;
    ok = close(fd) == 0 && ok;  // on NFS, close sends the data: other clients then see it
    if (!ok) {
        unlink(path);
        errno = e ? e : EIO;
        return -1;
    }
    return 1;
}

// The text a lock file of this process holds.
static void lock_text(char *buf, size_t cap)
{
    char host[256];
    host_name(host, sizeof host);
    uint64_t token = 0;
    if (getrandom(&token, sizeof token, GRND_NONBLOCK) != (ssize_t)sizeof token)
        token = (uint64_t)time(NULL) * 6364136223846793005ull ^ (uint64_t)getpid() ^ (uint64_t)(uintptr_t)buf;
    snprintf(buf, cap, "%s %ld %016llx %llu\n", host, (long)getpid(), (unsigned long long)token, pid_ns());
}

static void *beat_main(void *arg)
{
    lm_xlock *l = arg;
    pthread_mutex_lock(&l->mu);
    while (!l->stop) {
        struct timespec until;
        clock_gettime(CLOCK_REALTIME, &until);
        double t = (double)until.tv_nsec * 1e-9 + l->beat_s;
        until.tv_sec += (time_t)t;
        until.tv_nsec = (long)((t - (double)(time_t)t) * 1e9);
        if (pthread_cond_timedwait(&l->cv, &l->mu, &until) == ETIMEDOUT && !l->stop) {
            pthread_mutex_unlock(&l->mu);  // a hung file system holds the touch, not the release
            utimensat(AT_FDCWD, l->path, NULL, AT_SYMLINK_NOFOLLOW);  // the server's time now
            pthread_mutex_lock(&l->mu);
        }
    }
    pthread_mutex_unlock(&l->mu);
    return NULL;
}

// Ends the thread that touches the file.
static void stop_beat(lm_xlock *l)
{
    if (!l->beating)
        return;
    pthread_mutex_lock(&l->mu);
    l->stop = true;
    pthread_cond_signal(&l->cv);
    pthread_mutex_unlock(&l->mu);
    pthread_join(l->beat, NULL);
    l->beating = false;
}

static void free_lock(lm_xlock *l)
{
    stop_beat(l);
    pthread_mutex_destroy(&l->mu);
    pthread_cond_destroy(&l->cv);
    free(l->path);
    free(l);
}

void lm_xlock_release(lm_xlock *l)
{
    if (!l)
        return;
    stop_beat(l);  // no more touches: the file may go
    lm_signals_hold();
    char text[TEXT_MAX];
    struct stat st;
    if (read_lock(l->path, text, &st) == 1 && strcmp(text, l->text) == 0)  // still this holder's
        unlink(l->path);
    lm_signals_forget(l->sig_id);
    lm_signals_release();
    free_lock(l);
}

// A new lock for path, its text made (not yet created).
static lm_xlock *new_lock(const char *path)
{
    lm_xlock *l = calloc(1, sizeof *l);
    if (!l || !(l->path = lm_strdup(path))) {
        free(l);
        return NULL;
    }
    pthread_mutex_init(&l->mu, NULL);
    pthread_cond_init(&l->cv, NULL);
    lock_text(l->text, sizeof l->text);
    double beat = lm_xlock_stale_seconds() / 5;
    l->beat_s = beat < 0.05 ? 0.05 : beat > 30 ? 30 : beat;
    return l;
}

// Starts touching the file and registers it with the signal handlers: the lock is held.
static lm_status start_holding(lm_xlock *l, lm_err *err)
{
    lm_signals_hold();
    l->sig_id = lm_signals_remove_on_exit(l->path, false);
    lm_signals_release();
    sigset_t all, old;  // the thread takes no signal: the work's threads handle them
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    int rc = pthread_create(&l->beat, NULL, beat_main, l);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (rc != 0) {
        lm_err_set(err, LM_ERR_NOMEM, "cannot start a thread for the lock %s", l->path);
        lm_xlock_release(l);
        return LM_ERR_NOMEM;
    }
    l->beating = true;
    return LM_OK;
}

// "HOST pid PID" of a lock file's text, and whether that holder is on this host and in this PID
// namespace, and gone: no such process, or this process's pid under another token.
static bool holder_gone_here(const char *text, const char *mine, char *who, size_t cap)
{
    char host[256], my_host[256], token[64] = "", my_token[64] = "";
    long pid = 0, my_pid = 0;
    unsigned long long ns = 0, my_ns = 0;
    int n = sscanf(text, "%255s %ld %63s %llu", host, &pid, token, &ns);
    if (n < 2) {
        snprintf(who, cap, "an unknown holder");
        return false;
    }
    snprintf(who, cap, "%s pid %ld", host, pid);
    sscanf(mine, "%255s %ld %63s %llu", my_host, &my_pid, my_token, &my_ns);
    if (strcmp(host, my_host) != 0 || pid <= 0 || (n == 4 && ns != my_ns) || (n < 4 && my_ns != 0))
        return false;
    return pid == my_pid ? strcmp(token, my_token) != 0 : !pid_alive(pid);
}

// Removes a dead holder's file, found as `dead_text` at inode `dead_ino`, under the lock
// PATH.break: looked at again once that is held, and removed only when it is still that file,
// so that of several waiters one removes it and none removes a lock taken meanwhile. A breaker
// left by a process that died (it is held for a moment) is removed once this process has seen
// it for `break_stale` seconds, as kept across calls in *break_seen_at. 1: done (the file is
// gone, by this process or another); 0: the breaker is busy, look again later; -1: the file
// cannot be removed (errno set).
static int take_over(const char *path, const char *dead_text, ino_t dead_ino, const char *mine, double break_stale,
                     double *break_seen_at)
{
    char *brk = NULL;
    if (asprintf(&brk, "%s.break", path) < 0) {
        errno = ENOMEM;
        return -1;
    }
    int rc = create_lock(brk, mine);
    if (rc == 0) {  // another waiter breaks it now, or one died doing so
        char text[TEXT_MAX];
        struct stat st;
        double t = now_s();
        if (*break_seen_at == 0)
            *break_seen_at = t;
        else if (t - *break_seen_at >= break_stale && read_lock(brk, text, &st) == 1)
            unlink(brk), *break_seen_at = 0;
        free(brk);
        return 0;
    }
    *break_seen_at = 0;
    if (rc < 0) {
        free(brk);
        return -1;
    }
    char text[TEXT_MAX];
    struct stat st;
    int got = read_lock(path, text, &st), e = 0;
    if (got == 1 && st.st_ino == dead_ino && strcmp(text, dead_text) == 0 && unlink(path) != 0 && errno != ENOENT)
        e = errno, rc = -1;
    unlink(brk);
    free(brk);
    errno = e;
    return rc;
}

lm_status lm_xlock_acquire(lm_xlock **out, const char *path, lm_xlock_ready_fn ready, lm_xlock_waiting_fn waiting,
                           void *ctx, lm_err *err)
{
    *out = NULL;
    lm_xlock *l = new_lock(path);
    if (!l)
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    double stale = lm_xlock_stale_seconds(), pause = 0.05, break_seen_at = 0;
    char seen[TEXT_MAX] = "";       // the holder's file as last seen, and since when unchanged
    struct stat seen_st = {0};
    double seen_since = 0;
    char told[TEXT_MAX] = "";       // the holder `waiting` was last told of
    lm_status s = LM_OK;
    for (;;) {
        bool done = false;
        if (ready && ((s = ready(ctx, &done, err)) != LM_OK || done))
            break;
        int rc = create_lock(path, l->text);
        if (rc < 0) {
            s = lm_err_set(err, LM_ERR_IO, "%s: cannot create the lock file: %s", path, strerror(errno));
            break;
        }
        if (rc == 1) {
            if ((s = start_holding(l, err)) != LM_OK)
                return s;  // l is released
            if (ready && ((s = ready(ctx, &done, err)) != LM_OK || done)) {  // finished between the look
                lm_xlock_release(l);                                        // and the lock
                return s;
            }
            *out = l;
            return LM_OK;
        }
        char text[TEXT_MAX], who[300];
        struct stat st;
        rc = read_lock(path, text, &st);
        if (rc < 0) {
            s = lm_err_set(err, LM_ERR_IO, "%s: cannot read the lock file: %s", path, strerror(errno));
            break;
        }
        if (rc == 0)
            continue;  // released meanwhile: try again at once
        bool gone = holder_gone_here(text, l->text, who, sizeof who);
        double t = now_s();
        if (strcmp(text, seen) != 0 || st.st_ino != seen_st.st_ino || st.st_mtim.tv_sec != seen_st.st_mtim.tv_sec ||
            st.st_mtim.tv_nsec != seen_st.st_mtim.tv_nsec) {
            snprintf(seen, sizeof seen, "%s", text);
            seen_st = st;
            seen_since = t;
        } else if (t - seen_since >= stale) {
            gone = true;
        }
        if (gone) {
            int taken = take_over(path, text, st.st_ino, l->text, stale < 10 ? stale : 10, &break_seen_at);
            if (taken < 0) {
                s = lm_err_set(err, LM_ERR_IO, "%s: the lock of %s, which is gone, cannot be removed: %s", path, who,
                               strerror(errno));
                break;
            }
            if (taken == 1) {
                if (waiting)
                    waiting(ctx, who, true, path);
                seen[0] = told[0] = '\0';
                continue;
            }
        } else if (waiting && strcmp(text, told) != 0) {
            waiting(ctx, who, false, path);
            snprintf(told, sizeof told, "%s", text);
        }
        if (lm_interrupted()) {
            s = lm_interrupted_err(err);
            break;
        }
        sleep_s(pause);
        pause = pause * 1.5 > 1.0 ? 1.0 : pause * 1.5;
        if (lm_interrupted()) {
            s = lm_interrupted_err(err);
            break;
        }
    }
    free_lock(l);
    return s;
}
