// Tests of lib/outdir.c and lib/signals.c: the guard that keeps outputs out of inputs (paths
// resolved through symbolic links and "..", hard links caught by inode, is / holds / lies
// inside); the lock file never followed through a symbolic link nor used when it is not a
// regular file of one link; what a dead run left beside OUT removed (or an old output put back)
// and said; commit fsyncing and leaving nothing registered; and, in child processes, what a
// signal that ends the process does: a second SIGINT, any signal in fatal mode, and SIGBUS from
// a truncated mapped file each remove the registered temporary directory (however full) and
// the lock file, say so on stderr, and end the process as a shell expects.
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "check.h"
#include "outdir.h"
#include "safetensors.h"
#include "signals.h"
#include "st_writer.h"
#include "testfs.h"

static char *path_in(const char *dir, const char *name)
{
    return lm_path_join(dir, name);
}

static bool exists(const char *path)
{
    struct stat st;
    return lstat(path, &st) == 0;
}

// The number of entries of `dir` whose name starts with `prefix`.
static int count_prefixed(const char *dir, const char *prefix)
{
    DIR *d = opendir(dir);
    int n = 0;
    struct dirent *e;
    while (d && (e = readdir(d)) != NULL)
        n += strncmp(e->d_name, prefix, strlen(prefix)) == 0;
    if (d)
        closedir(d);
    return n;
}

// The whole of a small file, or "" (static buffer).
static const char *slurp(const char *path)
{
    static char buf[8192];
    buf[0] = '\0';
    int fd = open(path, O_RDONLY);
    if (fd < 0)
        return buf;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    buf[n > 0 ? n : 0] = '\0';
    close(fd);
    return buf;
}

// ==== the guard ===============================================================================

static void test_resolve(void)
{
    char *dir = make_tmpdir();
    char *real = realpath(dir, NULL);
    char *sub = subdir(dir, "a/b");
    char *link = path_in(dir, "ln");
    CHECK(symlink(sub, link) == 0);

    char *want = lm_strfmt("%s/a/b", real), *got = lm_guard_resolve(link);
    CHECK_MSG(got && strcmp(got, want) == 0, "%s -> %s, wanted %s", link, got, want);
    free(got);
    free(want);
    // below the deepest existing ancestor, "." and ".." are folded as text
    char *p = lm_strfmt("%s/ln/new/./x/../y/", dir);
    want = lm_strfmt("%s/a/b/new/y", real);
    got = lm_guard_resolve(p);
    CHECK_MSG(got && strcmp(got, want) == 0, "%s -> %s, wanted %s", p, got, want);
    free(got);
    free(want);
    free(p);
    // relative to the working directory
    char *cwd = getcwd(NULL, 0);
    CHECK(chdir(sub) == 0);
    got = lm_guard_resolve("../b/c");
    want = lm_strfmt("%s/a/b/c", real);
    CHECK_MSG(got && strcmp(got, want) == 0, "../b/c -> %s, wanted %s", got, want);
    free(got);
    free(want);
    CHECK(chdir(cwd) == 0);
    free(cwd);
    got = lm_guard_resolve("/");
    CHECK(got && strcmp(got, "/") == 0);
    free(got);
    got = lm_guard_resolve("/no-such-dir-here/../etc");
    CHECK(got && strcmp(got, "/etc") == 0);
    free(got);

    free(link);
    free(sub);
    free(real);
    remove_tmpdir(dir);
}

static void test_guard(void)
{
    lm_err err;
    char *dir = make_tmpdir();
    char *base = subdir(dir, "base"), *ft = subdir(dir, "ft");
    write_text(base, "config.json", "{}");
    write_text(dir, "calib.jsonl", "{}");
    char *config = path_in(base, "config.json"), *calib = path_in(dir, "calib.jsonl");
    lm_guard g = {0};
    CHECK_OK(lm_guard_add(&g, "BASE", base, &err), &err);
    CHECK_OK(lm_guard_add(&g, "FT 1", ft, &err), &err);
    CHECK_OK(lm_guard_add(&g, "--calib", calib, &err), &err);
    CHECK_OK(lm_guard_add(&g, "BASE", config, &err), &err);

    // clear: beside the inputs, or not existing yet beside them
    char *out = path_in(dir, "out"), *log = path_in(dir, "run.jsonl");
    CHECK_OK(lm_guard_check(&g, "-o", out, &err), &err);
    CHECK_OK(lm_guard_check(&g, "--log-json", log, &err), &err);
    CHECK_OK(lm_guard_check_outdir(&g, out, &err), &err);
    // a name that only starts like an input's is not inside it
    char *near = path_in(dir, "base2");
    CHECK_OK(lm_guard_check(&g, "-o", near, &err), &err);

    // is, is inside, holds
    CHECK_FAILS(lm_guard_check(&g, "-o", base, &err), LM_ERR_USAGE, "is BASE", &err);
    CHECK(strstr(err.msg, "refusing") && strstr(err.msg, "--force"));
    CHECK_FAILS(lm_guard_check(&g, "--log-json", config, &err), LM_ERR_USAGE, "is inside BASE", &err);
    CHECK(strstr(err.msg, config) != NULL);
    char *deep = lm_strfmt("%s/not/yet/there", ft);
    CHECK_FAILS(lm_guard_check(&g, "--cache-dir", deep, &err), LM_ERR_USAGE, "is inside FT 1", &err);
    CHECK_FAILS(lm_guard_check(&g, "-o", dir, &err), LM_ERR_USAGE, "holds BASE", &err);
    CHECK_FAILS(lm_guard_check(&g, "-o", "/", &err), LM_ERR_USAGE, "holds BASE", &err);
    CHECK_FAILS(lm_guard_check(&g, "-o", calib, &err), LM_ERR_USAGE, "is --calib", &err);
    // through "..", a trailing slash, a symbolic link, a hard link
    char *dotted = lm_strfmt("%s/../../%s/ft/", base, lm_path_base(dir));
    CHECK_FAILS(lm_guard_check(&g, "-o", dotted, &err), LM_ERR_USAGE, "is FT 1", &err);
    char *sym = path_in(dir, "sym"), *hard = path_in(dir, "hard");
    CHECK(symlink(base, sym) == 0);
    CHECK_FAILS(lm_guard_check(&g, "-o", sym, &err), LM_ERR_USAGE, "is BASE", &err);
    char *through = path_in(sym, "merged");
    CHECK_FAILS(lm_guard_check(&g, "-o", through, &err), LM_ERR_USAGE, "is inside BASE", &err);
    CHECK(link(calib, hard) == 0);
    CHECK_FAILS(lm_guard_check(&g, "--log-json", hard, &err), LM_ERR_USAGE, "is --calib", &err);
    // the lock file of OUT is checked with OUT
    char *locked = path_in(dir, "x"), *lockfile = path_in(dir, "x.lock");
    write_text(dir, "x.lock", "1 2 3\n");
    CHECK_OK(lm_guard_add(&g, "--calib", lockfile, &err), &err);
    CHECK_FAILS(lm_guard_check_outdir(&g, locked, &err), LM_ERR_USAGE, "its lock file", &err);
    char *slashed = lm_strfmt("%s/", locked);
    CHECK_FAILS(lm_guard_check_outdir(&g, slashed, &err), LM_ERR_USAGE, "its lock file", &err);
    CHECK(strcmp(slurp(lockfile), "1 2 3\n") == 0);

    lm_guard_free(&g);
    lm_guard_free(&g);  // twice is harmless
    CHECK_OK(lm_guard_check(&g, "-o", base, &err), &err);  // an empty guard refuses nothing
    free(slashed);
    free(locked);
    free(lockfile);
    free(through);
    free(sym);
    free(hard);
    free(dotted);
    free(deep);
    free(near);
    free(out);
    free(log);
    free(config);
    free(calib);
    free(base);
    free(ft);
    remove_tmpdir(dir);
}

// ==== the lock file ===========================================================================

static void test_lock_refused(void)
{
    lm_err err;
    char *dir = make_tmpdir();
    char *out = path_in(dir, "out"), *lock = path_in(dir, "out.lock");
    char *precious = path_in(dir, "precious"), *nowhere = path_in(dir, "nowhere");
    write_text(dir, "precious", "precious\n");
    lm_outdir od;

    // a symbolic link to a file, or to nothing: refused, nothing written through it or created
    CHECK(symlink(precious, lock) == 0);
    CHECK_FAILS(lm_outdir_begin(&od, out, false, &err), LM_ERR_USAGE, "symbolic link", &err);
    CHECK(strstr(err.msg, lock) != NULL);
    CHECK(strcmp(slurp(precious), "precious\n") == 0);
    CHECK(count_prefixed(dir, "out.tmp-") == 0 && !exists(out));
    unlink(lock);
    CHECK(symlink(nowhere, lock) == 0);
    CHECK_FAILS(lm_outdir_begin(&od, out, true, &err), LM_ERR_USAGE, "symbolic link", &err);
    CHECK(!exists(nowhere));
    unlink(lock);
    // another name of a file: truncating it would truncate that file
    CHECK(link(precious, lock) == 0);
    CHECK_FAILS(lm_outdir_begin(&od, out, false, &err), LM_ERR_USAGE, "2 links", &err);
    CHECK(strcmp(slurp(precious), "precious\n") == 0);
    unlink(lock);
    // not a regular file
    CHECK(mkfifo(lock, 0600) == 0);
    CHECK_FAILS(lm_outdir_begin(&od, out, false, &err), LM_ERR_USAGE, "not a regular file", &err);
    unlink(lock);
    CHECK(mkdir(lock, 0700) == 0);
    CHECK_FAILS(lm_outdir_begin(&od, out, false, &err), LM_ERR_USAGE, "not a regular file", &err);
    rmdir(lock);
    CHECK(count_prefixed(dir, "out") == 0);

    // and an ordinary one still works, leaving nothing
    CHECK_OK(lm_outdir_begin(&od, out, false, &err), &err);
    CHECK(od.note == NULL);
    CHECK(exists(lock) && atol(slurp(lock)) == (long)getpid());
    CHECK_OK(lm_outdir_commit(&od, &err), &err);
    CHECK(exists(out) && !exists(lock) && count_prefixed(dir, "out.") == 0);

    free(out);
    free(lock);
    free(precious);
    free(nowhere);
    remove_tmpdir(dir);
}

// A stale lock (nobody holds it): what the dead run left is removed, or put back, and said.
static void test_leftovers(void)
{
    lm_err err;
    char *dir = make_tmpdir();
    char *out = path_in(dir, "out");
    lm_outdir od;

    // OUT there: the dead run's temporary directories and an old output it moved aside go
    char *tmp1 = subdir(dir, "out.tmp-AbC123/sub"), *old = subdir(dir, "out.old-XyZ789");
    write_text(tmp1, "model.safetensors", "partial");
    CHECK(mkdir(out, 0777) == 0);
    write_text(dir, "out.lock", "4242\n");
    char *keep1 = subdir(dir, "out.tmp-notmine"), *keep2 = subdir(dir, "out.tmp-abc12"), *keep3 = subdir(dir, "out.tmp-abc1234");
    write_text(dir, "out.tmp-aBc123", "a file, not a directory");
    CHECK_OK(lm_outdir_begin(&od, out, true, &err), &err);
    CHECK(!exists(tmp1) && !exists(old));
    CHECK(lm_is_dir(keep1) && lm_is_dir(keep2) && lm_is_dir(keep3));
    char *f = path_in(dir, "out.tmp-aBc123");
    CHECK(lm_is_file(f));
    CHECK_MSG(od.note && strstr(od.note, "removed ") && strstr(od.note, "out.tmp-AbC123, left by pid 4242") &&
                  strstr(od.note, "out.old-XyZ789") && strchr(od.note, '\n'),
              "note: %s", od.note);
    char *named = lm_strfmt("%s.tmp-AbC123", out);
    CHECK(od.note && strstr(od.note, named));  // named as OUT was given
    free(named);
    char *ours = lm_strdup(od.tmp);
    lm_outdir_abort(&od);
    CHECK(lm_is_dir(out) && ours && !exists(ours) && count_prefixed(dir, "out.lock") == 0);
    free(ours);

    // OUT missing and one old output aside: put back (so without --force it exists now)
    CHECK(rmdir(out) == 0);
    char *old2 = subdir(dir, "out.old-Rst456");
    write_text(old2, "marker", "old");
    write_text(dir, "out.lock", "");
    CHECK_FAILS(lm_outdir_begin(&od, out, false, &err), LM_ERR_USAGE, "already exists", &err);
    CHECK(strstr(err.msg, "put back") && strstr(err.msg, "out.old-Rst456"));
    CHECK(strstr(err.msg, "a run that did not finish") != NULL);  // no pid in the lock file
    char *marker = path_in(out, "marker");
    CHECK(!exists(old2) && lm_is_file(marker));
    CHECK(count_prefixed(dir, "out.lock") == 0 && count_prefixed(dir, "out.tmp-") == 4);
    free(marker);

    // a lock file that was not there: nothing is cleaned, even what looks like ours
    char *tmp2 = subdir(dir, "out.tmp-Zzz999");
    CHECK_OK(lm_outdir_begin(&od, out, true, &err), &err);
    CHECK(od.note == NULL && lm_is_dir(tmp2));
    lm_outdir_abort(&od);

    free(f);
    free(keep1);
    free(keep2);
    free(keep3);
    free(tmp1);
    free(tmp2);
    free(old);
    free(old2);
    free(out);
    remove_tmpdir(dir);
}

// ==== signals that end the process ============================================================

// Runs fn in a child process with stderr into `errfile`; returns its wait status.
static int in_child(void (*fn)(void *), void *ctx, const char *errfile)
{
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        int fd = open(errfile, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (fd >= 0)
            dup2(fd, 2);
        fn(ctx);
        _exit(99);  // fn was to end the process itself
    }
    int status = 0;
    CHECK(pid > 0 && waitpid(pid, &status, 0) == pid);
    return status;
}

typedef struct child_ctx {
    const char *out;
    const char *file;  // a safetensors file to map and truncate
    int n_files;       // files to fill the temporary directory with
} child_ctx;

// Begins an output directory and fills its temporary directory with n_files files (long names,
// so that they take several getdents64 buffers) and a subdirectory.
static void begin_full(lm_outdir *od, const child_ctx *c)
{
    lm_err err;
    if (lm_outdir_begin(od, c->out, false, &err) != LM_OK) {
        fprintf(stderr, "begin: %s\n", err.msg);
        _exit(98);
    }
    char *sub = subdir(od->tmp, "sub/deeper");
    write_text(sub, "x", "x");
    free(sub);
    for (int i = 0; i < c->n_files; i++) {
        char name[128];
        snprintf(name, sizeof name, "a-rather-long-file-name-to-fill-the-directory-buffers-%04d.safetensors", i);
        write_text(od->tmp, name, "data");
    }
}

// A second SIGINT before the work polls: dies of SIGINT after the cleanup.
static void child_twice(void *ctx)
{
    lm_outdir od;
    begin_full(&od, ctx);
    lm_signals_install();
    raise(SIGINT);
    if (lm_interrupted() != SIGINT)
        _exit(97);
    raise(SIGINT);
}

// Fatal mode: the first SIGTERM ends it.
static void child_fatal(void *ctx)
{
    lm_outdir od;
    begin_full(&od, ctx);
    lm_signals_install_fatal();
    raise(SIGTERM);
}

// A committed output is no longer the handler's to remove.
static void child_after_commit(void *ctx)
{
    lm_outdir od;
    lm_err err;
    begin_full(&od, ctx);
    if (lm_outdir_commit(&od, &err) != LM_OK)
        _exit(96);
    lm_signals_install_fatal();
    raise(SIGHUP);
}

// A mapped file truncated under the reader: SIGBUS names it, removes the output, exit 1.
static void child_bus(void *ctx)
{
    const child_ctx *c = ctx;
    lm_outdir od;
    lm_err err;
    begin_full(&od, c);
    lm_st_file *f;
    if (lm_st_open(&f, c->file, &err) != LM_OK)
        _exit(95);
    const lm_st_tensor *t = lm_st_find(f, "w");
    if (!t || truncate(c->file, 8) != 0)
        _exit(94);
    const volatile uint8_t *p = t->data;
    unsigned sum = 0;
    for (uint64_t i = 0; i < t->nbytes; i += 64)
        sum += p[i];
    _exit(93 + (int)(sum & 0));  // read what is gone without a fault
}

static void test_signals(void)
{
    lm_err err;
    char *dir = make_tmpdir();
    char *out = path_in(dir, "out"), *errfile = path_in(dir, "stderr");
    child_ctx c = {.out = out, .n_files = 300};
    lm_signals_init("test_outdir");

    int st = in_child(child_twice, &c, errfile);
    CHECK_MSG(WIFSIGNALED(st) && WTERMSIG(st) == SIGINT, "status %#x", st);
    CHECK_MSG(count_prefixed(dir, "out") == 0, "left %d entries out*", count_prefixed(dir, "out"));
    const char *said = slurp(errfile);
    CHECK_MSG(strstr(said, "test_outdir: error: interrupted by SIGINT again: removed the partial output ") &&
                  strstr(said, "out.tmp-"),
              "stderr: %s", said);

    st = in_child(child_fatal, &c, errfile);
    CHECK_MSG(WIFSIGNALED(st) && WTERMSIG(st) == SIGTERM, "status %#x", st);
    CHECK(count_prefixed(dir, "out") == 0);
    said = slurp(errfile);
    CHECK_MSG(strstr(said, "interrupted by SIGTERM: removed the partial output") && !strstr(said, "again"),
              "stderr: %s", said);

    st = in_child(child_after_commit, &c, errfile);
    CHECK_MSG(WIFSIGNALED(st) && WTERMSIG(st) == SIGHUP, "status %#x", st);
    char *kept = path_in(out, "sub/deeper/x");
    CHECK(lm_is_file(kept) && count_prefixed(dir, "out") == 1);
    said = slurp(errfile);
    CHECK_MSG(!strstr(said, "removed"), "stderr: %s", said);
    free(kept);
    CHECK_OK(lm_rm_rf(out, &err), &err);

    // a file of one F32 tensor of 64 KiB, truncated to nothing under the mapping
    char *file = path_in(dir, "w.safetensors");
    static float w[16384];
    lm_st_desc desc = {.name = "w", .dtype = LM_DTYPE_F32, .ndim = 1, .shape = {16384}};
    const void *data[1] = {w};
    CHECK_OK(lm_st_write_file(file, &desc, data, 1, NULL, &err), &err);
    c.file = file;
    st = in_child(child_bus, &c, errfile);
    CHECK_MSG(WIFEXITED(st) && WEXITSTATUS(st) == 1, "status %#x", st);
    CHECK(count_prefixed(dir, "out") == 0);
    said = slurp(errfile);
    char *want = lm_strfmt("test_outdir: error: %s changed while llmerge was reading it", file);
    CHECK_MSG(strstr(said, want) && strstr(said, "; removed the partial output ") && strstr(said, "out.tmp-"),
              "stderr: %s", said);
    free(want);

    free(file);
    free(out);
    free(errfile);
    remove_tmpdir(dir);
}

// The registration tables: full ones answer 0 and nothing breaks.
static void test_tables(void)
{
    int ids[9];
    for (int i = 0; i < 9; i++)
        ids[i] = lm_signals_remove_on_exit("/nonexistent/x", false);
    CHECK(ids[0] > 0 && ids[7] > 0 && ids[8] == 0);
    for (int i = 0; i < 9; i++)
        lm_signals_forget(ids[i]);
    CHECK(lm_signals_remove_on_exit("/nonexistent/y", false) > 0);  // free again
    lm_signals_forget(1);
    int m = lm_signals_map_add(&ids, sizeof ids, "ids");
    CHECK(m > 0);
    lm_signals_map_remove(m);
    lm_signals_map_remove(0);
    // holds nest
    lm_signals_hold();
    lm_signals_hold();
    lm_signals_release();
    lm_signals_release();
    lm_signals_release();  // one too many is harmless
}

int main(void)
{
    test_resolve();
    test_guard();
    test_lock_refused();
    test_leftovers();
    test_signals();
    test_tables();
    return check_report("test_outdir");
}
