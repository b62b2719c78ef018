// What the programs that run llmerge merges as child processes share (bench_merge and
// bench_methods): a monotonic clock, values from /proc, and running one command while sampling
// its memory. Static functions; a program defines BENCH_PROG (its name, for messages) and
// includes this once.
#ifndef LM_BENCH_RUN_H
#define LM_BENCH_RUN_H

#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#ifndef BENCH_PROG
#error "define BENCH_PROG, the program's name, before including bench_run.h"
#endif

// Seconds on the monotonic clock.
static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

// Bytes as GB (10^9 bytes).
static double gb(uint64_t b) { return (double)b / 1e9; }

// A value from /proc/meminfo or /proc/PID/status ("MemAvailable:", "VmRSS:"), in bytes.
static uint64_t proc_kb(const char *file, const char *key)
{
    FILE *f = fopen(file, "r");
    if (!f)
        return 0;
    char line[256];
    size_t klen = strlen(key);
    uint64_t v = 0;
    while (fgets(line, sizeof line, f)) {
        if (strncmp(line, key, klen) == 0) {
            v = strtoull(line + klen, NULL, 10) * 1024;
            break;
        }
    }
    fclose(f);
    return v;
}

// Prints the last `max` bytes of `path` to stderr.
static void print_tail(const char *path, long max)
{
    FILE *f = fopen(path, "r");
    if (!f)
        return;
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    fseek(f, size > max ? size - max : 0, SEEK_SET);
    char buf[512];
    size_t got;
    while ((got = fread(buf, 1, sizeof buf, f)) > 0)
        fwrite(buf, 1, got, stderr);
    fclose(f);
}

// What one child process did.
typedef struct bm_child {
    int status;           // the child's exit status (or 128 + signal)
    double wall;          // seconds, fork to waitpid
    uint64_t peak_rss;    // bytes, from wait4's ru_maxrss
    uint64_t peak_anon;   // bytes, the most RssAnon seen sampling /proc/PID/status
    uint64_t peak_file;   // bytes, the most RssFile seen
} bm_child;

// Runs `argv` (argv[0] the program) with stdout and stderr into `log`, sampling the child's
// resident memory every 5 ms until it exits, and fills *c. Returns -1 (after a message) when
// the child could not be started or waited for; a child that fails is status != 0 in *c.
static int run_child(char *const *argv, const char *log, bm_child *c)
{
    *c = (bm_child){0};
    double t0 = now();
    pid_t pid = fork();
    if (pid < 0) {
        fprintf(stderr, BENCH_PROG ": fork: %s\n", strerror(errno));
        return -1;
    }
    if (pid == 0) {
        int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (fd >= 0) {
            dup2(fd, 1);
            dup2(fd, 2);
            close(fd);
        }
        execv(argv[0], argv);
        fprintf(stderr, BENCH_PROG ": exec %s: %s\n", argv[0], strerror(errno));
        _exit(127);
    }
    char status_file[64];
    snprintf(status_file, sizeof status_file, "/proc/%d/status", (int)pid);
    struct rusage ru;
    int st = 0;
    for (;;) {
        pid_t got = wait4(pid, &st, WNOHANG, &ru);
        if (got == pid)
            break;
        if (got < 0 && errno != EINTR) {
            fprintf(stderr, BENCH_PROG ": wait4: %s\n", strerror(errno));
            return -1;
        }
        uint64_t anon = proc_kb(status_file, "RssAnon:"), file = proc_kb(status_file, "RssFile:");
        if (anon > c->peak_anon) c->peak_anon = anon;
        if (file > c->peak_file) c->peak_file = file;
        nanosleep(&(struct timespec){0, 5000000}, NULL);
    }
    c->wall = now() - t0;
    c->peak_rss = (uint64_t)ru.ru_maxrss * 1024;
    c->status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + (WIFSIGNALED(st) ? WTERMSIG(st) : 0);
    return 0;
}

#endif
