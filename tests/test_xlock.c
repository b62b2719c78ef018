// Tests of xlock.c: a second process waits while the lock is held and reads what the holder made
// instead of taking it; the holder touches its file; a dead holder on this host is taken over at
// once, one on another host (or in another PID namespace) once its file has stood still for the
// stale time (and not while it is touched); this pid under another token is a dead holder; a
// breaker left by a dead process is removed; processes taking the lock over and over from a dead
// holder's are never two inside; a release leaves a file that is no longer its own; a signal
// ends the wait; a lock that cannot be created is an error naming the path.
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "check.h"
#include "signals.h"
#include "util.h"
#include "xlock.h"

static char dir[] = "/tmp/test_xlock_XXXXXX";
static char lock_path[128], entry_path[128];

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void write_text(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    CHECK(f != NULL);
    if (f) {
        fputs(text, f);
        fclose(f);
    }
}

static char *read_text(const char *path)
{
    char *text = NULL;
    size_t len = 0;
    lm_err err = {0};
    return lm_read_file(path, 4096, &text, &len, &err) == LM_OK ? text : NULL;
}

// A lock file's text for a holder on this host: `pid`, `token`, and this PID namespace (plus
// ns_delta: another namespace).
static void holder_text(char *buf, size_t cap, long pid, const char *token, unsigned long long ns_delta)
{
    char host[256] = "";
    gethostname(host, sizeof host);
    struct stat ns;
    CHECK(stat("/proc/self/ns/pid", &ns) == 0);
    snprintf(buf, cap, "%s %ld %s %llu\n", host, pid, token, (unsigned long long)ns.st_ino + ns_delta);
}

// ready: the entry is there
static lm_status entry_ready(void *ctx, bool *done, lm_err *err)
{
    (void)ctx;
    (void)err;
    *done = access(entry_path, F_OK) == 0;
    return LM_OK;
}

typedef struct told {
    int n, gone, bad_path;
    int fd;  // a byte is written here at each call (-1: none)
    char who[400];
} told;

static void on_waiting(void *ctx, const char *who, bool gone, const char *path)
{
    told *t = ctx;
    t->n++;
    t->gone += gone;
    t->bad_path += strcmp(path, lock_path) != 0;
    snprintf(t->who, sizeof t->who, "%s", who);
    if (t->fd >= 0)
        (void)!write(t->fd, "w", 1);
}

// A waiting process reads the holder's entry instead of taking the lock.
static void test_wait_then_ready(void)
{
    int to_child[2], to_parent[2];
    CHECK(pipe(to_child) == 0 && pipe(to_parent) == 0);
    pid_t pid = fork();
    if (pid == 0) {
        char c;
        if (read(to_child[0], &c, 1) != 1)
            _exit(10);
        told t = {.fd = to_parent[1]};
        lm_xlock *l = NULL;
        lm_err err = {0};
        lm_status s = lm_xlock_acquire(&l, lock_path, entry_ready, on_waiting, &t, &err);
        _exit(s != LM_OK ? 11 : l != NULL ? 12 : t.n != 1 ? 13 : t.bad_path ? 14 : 0);
    }
    lm_xlock *l = NULL;
    lm_err err = {0};
    told t = {.fd = -1};
    CHECK_OK(lm_xlock_acquire(&l, lock_path, entry_ready, on_waiting, &t, &err), &err);
    CHECK(l != NULL && t.n == 0);
    char *text = read_text(lock_path), host[256] = "", want[300];
    gethostname(host, sizeof host);
    snprintf(want, sizeof want, "%s %ld ", host, (long)getpid());
    CHECK(text && strncmp(text, want, strlen(want)) == 0);
    free(text);
    CHECK(write(to_child[1], "go", 1) == 1);
    char c;
    CHECK(read(to_parent[0], &c, 1) == 1);  // the child waits
    usleep(300 * 1000);
    write_text(entry_path, "made");
    lm_xlock_release(l);
    CHECK(access(lock_path, F_OK) != 0);
    int status = 0;
    CHECK(waitpid(pid, &status, 0) == pid);
    CHECK_MSG(WIFEXITED(status) && WEXITSTATUS(status) == 0, "the waiting child ended with status %d", status);
    unlink(entry_path);
    close(to_child[0]), close(to_child[1]), close(to_parent[0]), close(to_parent[1]);
}

// The holder touches its file every stale / 5 seconds.
static void test_heartbeat(void)
{
    setenv("LLMERGE_LOCK_STALE", "0.5", 1);
    lm_xlock *l = NULL;
    lm_err err = {0};
    CHECK_OK(lm_xlock_acquire(&l, lock_path, NULL, NULL, NULL, &err), &err);
    struct stat a, b;
    CHECK(stat(lock_path, &a) == 0);
    usleep(350 * 1000);
    CHECK(stat(lock_path, &b) == 0);
    CHECK(b.st_mtim.tv_sec > a.st_mtim.tv_sec ||
          (b.st_mtim.tv_sec == a.st_mtim.tv_sec && b.st_mtim.tv_nsec > a.st_mtim.tv_nsec));
    // a release leaves a file that is no longer this holder's
    write_text(lock_path, "elsewhere 1 0000\n");
    lm_xlock_release(l);
    char *text = read_text(lock_path);
    CHECK(text && strcmp(text, "elsewhere 1 0000\n") == 0);
    free(text);
    unlink(lock_path);
    unsetenv("LLMERGE_LOCK_STALE");
}

// A holder on this host whose process is gone: taken over at once, whatever the stale time.
static void test_dead_here(void)
{
    pid_t pid = fork();
    if (pid == 0)
        _exit(0);
    waitpid(pid, NULL, 0);
    char text[400];
    holder_text(text, sizeof text, pid, "0123456789abcdef", 0);
    write_text(lock_path, text);
    setenv("LLMERGE_LOCK_STALE", "5", 1);  // well past the 2 s allowed
    told t = {.fd = -1};
    lm_xlock *l = NULL;
    lm_err err = {0};
    double t0 = now_s();
    CHECK_OK(lm_xlock_acquire(&l, lock_path, NULL, on_waiting, &t, &err), &err);
    CHECK_MSG(now_s() - t0 < 2.0, "took %.2f s", now_s() - t0);
    unsetenv("LLMERGE_LOCK_STALE");
    CHECK(l != NULL && t.gone == 1 && t.n == 1 && !t.bad_path);
    char *got = read_text(lock_path);
    CHECK(got && strcmp(got, text) != 0);
    free(got);
    lm_xlock_release(l);
    CHECK(access(lock_path, F_OK) != 0);
}

typedef struct toucher {
    double until;
} toucher;

static void *touch_main(void *arg)
{
    toucher *tc = arg;
    while (now_s() < tc->until) {
        utimensat(AT_FDCWD, lock_path, NULL, 0);
        usleep(100 * 1000);
    }
    return NULL;
}

// A holder on another host: taken over once its file has stood still for the stale time, not
// while it is touched.
static void test_stale_elsewhere(void)
{
    setenv("LLMERGE_LOCK_STALE", "0.6", 1);
    write_text(lock_path, "no-such-host.example 12345 0123456789abcdef\n");
    told t = {.fd = -1};
    lm_xlock *l = NULL;
    lm_err err = {0};
    double t0 = now_s();
    CHECK_OK(lm_xlock_acquire(&l, lock_path, NULL, on_waiting, &t, &err), &err);
    double took = now_s() - t0;
    CHECK_MSG(took >= 0.6 && took < 3.0, "took %.2f s", took);
    CHECK(l != NULL && t.n == 2 && t.gone == 1 && strstr(t.who, "no-such-host.example pid 12345"));
    lm_xlock_release(l);

    write_text(lock_path, "no-such-host.example 12345 0123456789abcdef\n");
    toucher tc = {now_s() + 1.5};
    pthread_t th;
    CHECK(pthread_create(&th, NULL, touch_main, &tc) == 0);
    t0 = now_s();
    CHECK_OK(lm_xlock_acquire(&l, lock_path, NULL, NULL, NULL, &err), &err);
    took = now_s() - t0;
    CHECK_MSG(took >= 1.5 + 0.6 - 0.15, "taken over after %.2f s while the holder still touched it", took);
    pthread_join(th, NULL);
    lm_xlock_release(l);
    unsetenv("LLMERGE_LOCK_STALE");
}

// The same host in another PID namespace (a container of the same name): its pid is not judged
// here, so the lock waits for the stale time; this process's own pid under another token (a pid
// used again) is a dead holder at once; a breaker left by a process that died is removed.
static void test_namespaces_and_breaker(void)
{
    char text[400], brk[160];
    setenv("LLMERGE_LOCK_STALE", "0.6", 1);
    holder_text(text, sizeof text, 1, "0123456789abcdef", 1);
    write_text(lock_path, text);
    lm_xlock *l = NULL;
    lm_err err = {0};
    double t0 = now_s();
    CHECK_OK(lm_xlock_acquire(&l, lock_path, NULL, NULL, NULL, &err), &err);
    CHECK_MSG(now_s() - t0 >= 0.6, "another namespace's pid 1 judged here: taken after %.2f s", now_s() - t0);
    lm_xlock_release(l);

    setenv("LLMERGE_LOCK_STALE", "5", 1);
    holder_text(text, sizeof text, (long)getpid(), "ffffffffffffffff", 0);
    write_text(lock_path, text);
    t0 = now_s();
    CHECK_OK(lm_xlock_acquire(&l, lock_path, NULL, NULL, NULL, &err), &err);
    CHECK_MSG(now_s() - t0 < 2.0, "this pid under another token waited %.2f s", now_s() - t0);
    lm_xlock_release(l);

    setenv("LLMERGE_LOCK_STALE", "0.5", 1);
    snprintf(brk, sizeof brk, "%s.break", lock_path);
    write_text(lock_path, "no-such-host.example 12345 0123456789abcdef 1\n");
    write_text(brk, "no-such-host.example 12346 0123456789abcdef 1\n");
    t0 = now_s();
    CHECK_OK(lm_xlock_acquire(&l, lock_path, NULL, NULL, NULL, &err), &err);
    double took = now_s() - t0;
    CHECK_MSG(took >= 0.9 && took < 4.0, "a dead breaker: taken after %.2f s", took);
    CHECK(access(brk, F_OK) != 0);
    lm_xlock_release(l);
    unsetenv("LLMERGE_LOCK_STALE");
}

// Processes that take and release the lock over and over, starting from a dead holder's lock:
// never two inside at once (each creates a marker file exclusively while it holds the lock).
static void test_exclusion(void)
{
    char text[400], marker[160];
    pid_t dead = fork();
    if (dead == 0)
        _exit(0);
    waitpid(dead, NULL, 0);
    holder_text(text, sizeof text, dead, "0123456789abcdef", 0);
    write_text(lock_path, text);
    snprintf(marker, sizeof marker, "%s/inside", dir);
    enum { WORKERS = 4, ROUNDS = 15 };
    pid_t kids[WORKERS];
    for (int w = 0; w < WORKERS; w++) {
        if ((kids[w] = fork()) == 0) {
            int violations = 0;
            for (int r = 0; r < ROUNDS; r++) {
                lm_xlock *l = NULL;
                lm_err err = {0};
                if (lm_xlock_acquire(&l, lock_path, NULL, NULL, NULL, &err) != LM_OK || !l)
                    _exit(100);
                int fd = open(marker, O_WRONLY | O_CREAT | O_EXCL, 0644);
                if (fd < 0) {
                    violations++;
                } else {
                    close(fd);
                    usleep(2000);
                    unlink(marker);
                }
                lm_xlock_release(l);
            }
            _exit(violations);
        }
    }
    for (int w = 0; w < WORKERS; w++) {
        int status = 0;
        CHECK(waitpid(kids[w], &status, 0) == kids[w]);
        CHECK_MSG(WIFEXITED(status) && WEXITSTATUS(status) == 0, "worker %d: status %d (a count of times another "
                  "held the lock too, or 100: no lock)", w, status);
    }
    CHECK(access(lock_path, F_OK) != 0 && access(marker, F_OK) != 0);
}

static void *interrupt_main(void *arg)
{
    (void)arg;
    usleep(300 * 1000);
    kill(getpid(), SIGTERM);
    return NULL;
}

// A signal ends the wait; a lock that cannot be created is an error naming its path.
static void test_interrupt_and_errors(void)
{
    lm_signals_init("test_xlock");
    lm_signals_install();
    write_text(lock_path, "no-such-host.example 12345 0123456789abcdef\n");
    pthread_t th;
    CHECK(pthread_create(&th, NULL, interrupt_main, NULL) == 0);
    lm_xlock *l = NULL;
    lm_err err = {0};
    CHECK_FAILS(lm_xlock_acquire(&l, lock_path, NULL, NULL, NULL, &err), LM_ERR_INTERRUPTED, "SIGTERM", &err);
    CHECK(l == NULL);
    pthread_join(th, NULL);
    lm_signals_restore();
    unlink(lock_path);
    char bad[200];
    snprintf(bad, sizeof bad, "%s/no/such/dir.lock", dir);
    CHECK_FAILS(lm_xlock_acquire(&l, bad, NULL, NULL, NULL, &err), LM_ERR_IO, "no/such/dir.lock: cannot create the lock",
                &err);
}

int main(void)
{
    alarm(120);  // a lock that never comes (or a child that never waits) fails the test, not hangs it
    if (!mkdtemp(dir)) {
        perror("mkdtemp");
        return 1;
    }
    snprintf(lock_path, sizeof lock_path, "%s/hess-0123.lock", dir);
    snprintf(entry_path, sizeof entry_path, "%s/hess-0123.bin", dir);
    test_wait_then_ready();
    test_heartbeat();
    test_dead_here();
    test_stale_elsewhere();
    test_namespaces_and_breaker();
    test_exclusion();
    test_interrupt_and_errors();
    rmdir(dir);
    return check_report("test_xlock");
}
