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
        if (pthread_cond_timedwait(&l->cv, &l->mu, &until) == ETIMEDOUT && !l->stop)
            utimensat(AT_FDCWD, l->path, NULL, AT_SYMLINK_NOFOLLOW);  // the server's time now
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
    char host[256];
    host_name(host, sizeof host);
    uint64_t token = 0;
    if (getrandom(&token, sizeof token, GRND_NONBLOCK) != (ssize_t)sizeof token)
        token = (uint64_t)time(NULL) * 6364136223846793005ull ^ (uint64_t)getpid() ^ (uint64_t)(uintptr_t)l;
    snprintf(l->text, sizeof l->text, "%s %ld %016llx\n", host, (long)getpid(), (unsigned long long)token);
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
        lm_xlock_release(l);
        return lm_err_set(err, LM_ERR_NOMEM, "cannot start a thread for the lock %s", l->path);
    }
    l->beating = true;
    return LM_OK;
}

// "HOST pid PID" of a lock file's text, and whether that holder is on this host and gone.
static bool holder_gone_here(const char *text, char *who, size_t cap)
{
    char host[256], mine[256];
    long pid = 0;
    if (sscanf(text, "%255s %ld", host, &pid) != 2) {
        snprintf(who, cap, "an unknown holder");
        return false;
    }
    snprintf(who, cap, "%s pid %ld", host, pid);
    host_name(mine, sizeof mine);
    return strcmp(host, mine) == 0 && pid > 0 && !pid_alive(pid);
}

// Moves a dead holder's file out of the way. The rename is atomic: of several waiters that found
// it dead, one moves it. Where the file moved is not the one found dead (a new holder took the
// lock between the look and the rename), it is put back unless another is there by then. False
// when the file could not be moved (nor was gone already): the caller waits before it looks again.
static bool take_over(const char *path, const char *dead_text)
{
    char host[256];
    host_name(host, sizeof host);
    char *aside = NULL;
    if (asprintf(&aside, "%s.dead.%s.%ld", path, host, (long)getpid()) < 0)
        return false;
    bool moved = rename(path, aside) == 0, gone = !moved && errno == ENOENT;
    if (moved) {
        char text[TEXT_MAX];
        struct stat st;
        if (read_lock(aside, text, &st) == 1 && strcmp(text, dead_text) != 0)
            (void)link(aside, path);
        unlink(aside);
    }
    free(aside);
    return moved || gone;
}

lm_status lm_xlock_acquire(lm_xlock **out, const char *path, lm_xlock_ready_fn ready, lm_xlock_waiting_fn waiting,
                           void *ctx, lm_err *err)
{
    *out = NULL;
    lm_xlock *l = new_lock(path);
    if (!l)
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    double stale = lm_xlock_stale_seconds(), pause = 0.05;
    char seen[TEXT_MAX] = "";       // the holder's file as last seen, and since when unchanged
    struct stat seen_st = {0};
    double seen_since = 0;
    bool told = false;
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
        bool gone = holder_gone_here(text, who, sizeof who);
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
            if (waiting) {
                char msg[400];
                snprintf(msg, sizeof msg, "%s, which is gone (the lock is taken over)", who);
                waiting(ctx, msg, path);
            }
            if (take_over(path, text)) {
                seen[0] = '\0';
                continue;
            }
        }
        if (!told && waiting)
            waiting(ctx, who, path);
        told = true;
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
