// Atomic, durable output directories, and the guard of inputs: see outdir.h. The temporary
// directory is "OUT.tmp-XXXXXX" beside OUT (same parent, so the final rename never crosses
// filesystems, and a leftover from a killed run sits next to what the user named, where they
// will see it and where the next run finds it). It is made with mkdir under a fresh name rather
// than mkdtemp, because mkdtemp's mode 0700 would become the output's mode: mkdir's 0777 minus
// the umask gives what any other directory the user creates gets. Replacing with --force moves
// the old OUT aside to "OUT.old-XXXXXX", renames the new one in, and only then removes the old
// one, so at every moment OUT is either the old output or the new one; the two renames happen
// inside an lm_signals_hold section, so a dying signal handler never sees the moment between
// them. The lock protocol (outdir.h) is the classic one for lock files that are removed: unlink
// only while holding the lock, and after locking check that the path still names the file
// locked.
#include "outdir.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include "signals.h"
#include "util.h"

// Returns a new path "<base><tag>XXXXXX" that does not exist yet (caller frees), or NULL when
// memory runs out. When `make_dir` is set the directory is also created (mode 0777 & ~umask)
// and *e is set to the errno of a failure other than a name clash.
static char *unique_path(const char *base, const char *tag, bool make_dir, int *e)
{
    static const char alnum[] = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
    static atomic_uint counter;
    *e = 0;
    for (int attempt = 0; attempt < 1000; attempt++) {
        // a name that differs between processes and calls; it needs to be unique, not secret
        uint64_t key[3] = {(uint64_t)getpid(), atomic_fetch_add(&counter, 1), (uint64_t)attempt};
        uint64_t h = lm_xxh64(key, sizeof key) ^ lm_xxh64(base, strlen(base));
        char suffix[7];
        for (int i = 0; i < 6; i++) {
            suffix[i] = alnum[h % 62];
            h /= 62;
        }
        suffix[6] = '\0';
        char *p = lm_strfmt("%s%s%s", base, tag, suffix);
        if (!p)
            return NULL;
        struct stat st;
        if (make_dir) {
            if (mkdir(p, 0777) == 0)
                return p;
            if (errno != EEXIST) {
                *e = errno;
                free(p);
                return NULL;
            }
        } else if (lstat(p, &st) != 0 && errno == ENOENT) {
            return p;
        }
        free(p);
    }
    *e = EEXIST;
    return NULL;
}

// The lock file's open flags: never through a symbolic link, never a terminal, never waiting
// on a FIFO.
#define LOCK_OPEN_FLAGS (O_RDWR | O_NOFOLLOW | O_NOCTTY | O_NONBLOCK | O_CLOEXEC)

// Takes the lock "<final>.lock" for od (od->lock and od->lock_fd set on success). LM_ERR_BUSY
// when another process holds it, naming its pid when the file says it; LM_ERR_USAGE when the
// path is a symbolic link or not a regular file of one link. *stale is set when the lock file
// was there already and nobody held it: a run that wrote it died; *stale_pid is the pid it
// wrote (0 when none).
static lm_status lock_take(lm_outdir *od, bool *stale, long *stale_pid, lm_err *err)
{
    *stale = false;
    *stale_pid = 0;
    char *path = lm_strfmt("%s.lock", od->final);
    if (!path)
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    lm_status s = LM_OK;
    for (int attempt = 0; attempt < 100; attempt++) {
        bool created = true;
        int fd = open(path, LOCK_OPEN_FLAGS | O_CREAT | O_EXCL, 0666);
        if (fd < 0 && errno == EEXIST) {
            created = false;
            fd = open(path, LOCK_OPEN_FLAGS);
            if (fd < 0 && errno == ENOENT)
                continue;  // removed between the two opens: start over
        }
        if (fd < 0) {
            int e = errno;
            if (e == ELOOP)
                s = lm_err_set(err, LM_ERR_USAGE, "%s: its lock file %s is a symbolic link, which llmerge does "
                               "not follow (writing through it would overwrite another file); remove it or "
                               "choose another output", od->final, path);
            else if (e == EISDIR)
                s = lm_err_set(err, LM_ERR_USAGE, "%s: its lock file %s is not a regular file (a directory); "
                               "remove it or choose another output", od->final, path);
            else
                s = lm_err_set(err, LM_ERR_IO, "%s: cannot create the lock file %s: %s", od->final, path,
                               strerror(e));
            break;
        }
        struct stat held, now;
        if (fstat(fd, &held) != 0) {
            s = lm_err_set(err, LM_ERR_IO, "%s: %s: %s", od->final, path, strerror(errno));
            close(fd);
            break;
        }
        if (!S_ISREG(held.st_mode) || held.st_nlink > 1) {
            // Truncating it would write through to whatever else it is.
            if (!S_ISREG(held.st_mode))
                s = lm_err_set(err, LM_ERR_USAGE, "%s: its lock file %s is not a regular file; remove it or "
                               "choose another output", od->final, path);
            else
                s = lm_err_set(err, LM_ERR_USAGE, "%s: its lock file %s has %lu links (another name of the "
                               "same file would be overwritten); remove it or choose another output",
                               od->final, path, (unsigned long)held.st_nlink);
            close(fd);
            break;
        }
        if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
            int e = errno;
            if (e == EWOULDBLOCK) {
                char buf[32];
                ssize_t n = pread(fd, buf, sizeof buf - 1, 0);
                buf[n > 0 ? n : 0] = '\0';
                long pid = strtol(buf, NULL, 10);
                char who[48] = "";
                if (pid > 0)
                    snprintf(who, sizeof who, " (pid %ld)", pid);
                s = lm_err_set(err, LM_ERR_BUSY, "%s: another llmerge%s is writing it (it holds %s); "
                               "wait for it to end or choose another output", od->final, who, path);
            } else if (e == ENOLCK || e == EOPNOTSUPP || e == EINVAL) {
                // A filesystem without locks: the run goes on unprotected, as it did before
                // locking existed, rather than failing.
                unlink(path);
                s = LM_OK;
            } else {
                s = lm_err_set(err, LM_ERR_IO, "%s: locking %s: %s", od->final, path, strerror(e));
            }
            close(fd);
            break;
        }
        if (lstat(path, &now) == 0 && held.st_dev == now.st_dev && held.st_ino == now.st_ino) {
            if (!created) {
                // nobody held it: the run that wrote it is gone
                char buf[32];
                ssize_t n = pread(fd, buf, sizeof buf - 1, 0);
                buf[n > 0 ? n : 0] = '\0';
                long pid = strtol(buf, NULL, 10);
                *stale = true;
                *stale_pid = pid > 0 ? pid : 0;
            }
            // ours: the pid is for the message of a run that finds it locked
            char pid[32];
            int len = snprintf(pid, sizeof pid, "%ld\n", (long)getpid());
            if (ftruncate(fd, 0) != 0 || pwrite(fd, pid, (size_t)len, 0) != len) {
                // the pid is a courtesy; the lock is what matters
            }
            od->lock = path;
            od->lock_fd = fd;
            od->lock_id = lm_signals_remove_on_exit(path, false);
            return LM_OK;
        }
        // The run that held it removed it between our open and our flock: what we locked is
        // no longer anyone's lock file. Start over with whatever is at the path now.
        close(fd);
        if (attempt == 99)
            s = lm_err_set(err, LM_ERR_BUSY, "%s: the lock file %s keeps changing", od->final, path);
    }
    free(path);
    return s;
}

// Removes the lock file, then lets the lock go (in that order: see outdir.h).
static void lock_drop(lm_outdir *od)
{
    if (!od->lock)
        return;
    unlink(od->lock);
    lm_signals_forget(od->lock_id);
    od->lock_id = 0;
    close(od->lock_fd);
    free(od->lock);
    od->lock = NULL;
    od->lock_fd = -1;
}

static void outdir_clear(lm_outdir *od)
{
    lock_drop(od);
    free(od->final);
    free(od->tmp);
    free(od->note);
    od->final = NULL;
    od->tmp = NULL;
    od->note = NULL;
}

// Appends one line to od->note (lines are separated by '\n').
static void add_note(lm_outdir *od, const char *line)
{
    char *n = od->note ? lm_strfmt("%s\n%s", od->note, line) : lm_strdup(line);
    if (n) {
        free(od->note);
        od->note = n;
    }
}

// Whether `name` is "<base><tag>" and six letters or digits, as unique_path makes them.
static bool is_ours(const char *name, const char *base, const char *tag)
{
    size_t lb = strlen(base), lt = strlen(tag);
    if (strncmp(name, base, lb) != 0 || strncmp(name + lb, tag, lt) != 0)
        return false;
    const char *rest = name + lb + lt;
    for (int i = 0; i < 6; i++)
        if (!((rest[i] >= 'a' && rest[i] <= 'z') || (rest[i] >= 'A' && rest[i] <= 'Z') ||
              (rest[i] >= '0' && rest[i] <= '9')))
            return false;
    return rest[6] == '\0';
}

// The lock was stale: removes what the dead run (pid, 0 when unknown) left beside OUT, each said
// in od->note. Its OUT.tmp-XXXXXX directories are removed. An OUT.old-XXXXXX is an old output
// that a replace moved aside: removed when OUT is there (the replace got that far), put back
// when OUT is missing and it is the only one. Only directories of this user with exactly those
// names are touched; nothing that fails here stops the run.
static void clear_leftovers(lm_outdir *od, const char *parent, long pid)
{
    DIR *d = opendir(parent);
    if (!d)
        return;
    const char *base = lm_path_base(od->final);
    char who[64] = "a run that did not finish";
    if (pid > 0)
        snprintf(who, sizeof who, "pid %ld", pid);
    char *olds[8];
    int n_old = 0, more_old = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        bool tmp = is_ours(e->d_name, base, ".tmp-"), old = is_ours(e->d_name, base, ".old-");
        if (!tmp && !old)
            continue;
        // named as the user named OUT: "out.tmp-AbC123" beside "out"
        char *path = lm_strfmt("%s%s", od->final, e->d_name + strlen(base));
        struct stat st;
        if (!path || lstat(path, &st) != 0 || !S_ISDIR(st.st_mode) || st.st_uid != geteuid()) {
            free(path);
            continue;
        }
        if (old) {
            if (n_old < 8)
                olds[n_old++] = path;
            else {
                more_old++;
                free(path);
            }
            continue;
        }
        char line[2 * 4096 + 64];
        if (lm_rm_rf(path, NULL) == LM_OK)
            snprintf(line, sizeof line, "removed %s, left by %s", path, who);
        else
            snprintf(line, sizeof line, "could not remove %s, left by %s", path, who);
        add_note(od, line);
        free(path);
    }
    closedir(d);
    struct stat st;
    bool have_final = lstat(od->final, &st) == 0;
    for (int i = 0; i < n_old; i++) {
        char line[3 * 4096 + 128];
        if (have_final) {
            snprintf(line, sizeof line, "%s %s, an old output that a replace by %s had moved aside",
                     lm_rm_rf(olds[i], NULL) == LM_OK ? "removed" : "could not remove", olds[i], who);
        } else if (n_old == 1 && !more_old) {
            if (rename(olds[i], od->final) == 0)
                snprintf(line, sizeof line, "put back %s as %s: a replace (--force) by %s moved it aside and "
                         "did not finish", olds[i], od->final, who);
            else
                snprintf(line, sizeof line, "could not put back %s as %s: %s", olds[i], od->final, strerror(errno));
        } else {
            snprintf(line, sizeof line, "kept %s: %s is missing, and a replace by %s left more than one old "
                     "output aside", olds[i], od->final, who);
        }
        add_note(od, line);
        free(olds[i]);
    }
}

lm_status lm_outdir_begin(lm_outdir *od, const char *final, bool force, lm_err *err)
{
    memset(od, 0, sizeof *od);
    lm_status s = LM_OK;
    char *parent = NULL;
    if (!final || !*final)
        return lm_err_set(err, LM_ERR_USAGE, "no output directory given");
    od->force = force;
    od->final = lm_strdup(final);
    if (!od->final)
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    // "out/" names "out": the temporary directory goes beside it, not inside it
    size_t len = strlen(od->final);
    while (len > 1 && od->final[len - 1] == '/')
        od->final[--len] = '\0';
    if (strcmp(od->final, "/") == 0 || strcmp(lm_path_base(od->final), ".") == 0 ||
        strcmp(lm_path_base(od->final), "..") == 0) {
        s = lm_err_set(err, LM_ERR_USAGE, "%s: cannot be an output directory (name a new "
                       "directory)", final);
        goto fail;
    }

    if (!(parent = lm_path_parent(od->final))) {
        s = lm_err_set(err, LM_ERR_NOMEM, "out of memory");
        goto fail;
    }
    if (!lm_is_dir(parent)) {
        s = lm_err_set(err, LM_ERR_NOT_FOUND, "%s: its parent directory %s does not exist",
                       od->final, parent);
        goto fail;
    }
    struct stat st;
    if (lstat(od->final, &st) == 0 && !force) {
        s = lm_err_set(err, LM_ERR_USAGE, "%s: already exists (use --force to replace it)",
                       od->final);
        goto fail;
    }
    // The lock file and the temporary directory are registered for a dying signal handler in
    // the same breath as they are made.
    lm_signals_hold();
    bool stale;
    long stale_pid;
    s = lock_take(od, &stale, &stale_pid, err);
    lm_signals_release();
    if (s != LM_OK)
        goto fail;
    if (stale)
        clear_leftovers(od, parent, stale_pid);
    // again, now that no other run can be writing it: one may have finished since
    if (lstat(od->final, &st) == 0 && !force) {
        s = od->note ? lm_err_set(err, LM_ERR_USAGE, "%s: already exists (use --force to replace it); %s",
                                  od->final, od->note)
                     : lm_err_set(err, LM_ERR_USAGE, "%s: already exists (use --force to replace it)", od->final);
        goto fail;
    }

    int e;
    lm_signals_hold();
    od->tmp = unique_path(od->final, ".tmp-", true, &e);
    if (od->tmp)
        od->tmp_id = lm_signals_remove_on_exit(od->tmp, true);
    lm_signals_release();
    if (!od->tmp) {
        s = e ? lm_err_set(err, LM_ERR_IO, "%s: cannot create a temporary directory beside it: "
                           "%s", od->final, strerror(e))
              : lm_err_set(err, LM_ERR_NOMEM, "out of memory");
        goto fail;
    }
    free(parent);
    return LM_OK;

fail:
    free(parent);
    outdir_clear(od);
    return s;
}

// ==== durability ==============================================================================

// Fsyncs `path` (a directory when dir). A filesystem that cannot sync directories (EINVAL) is
// not an error.
static lm_status sync_path(const char *path, bool dir, lm_err *err)
{
    int fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC | (dir ? O_DIRECTORY : 0));
    if (fd < 0)
        return lm_err_set(err, LM_ERR_IO, "%s: opening it to sync it: %s", path, strerror(errno));
    int e = fsync(fd) != 0 ? errno : 0;
    close(fd);
    if (e && !(dir && e == EINVAL))
        return lm_err_set(err, LM_ERR_IO, "%s: fsync: %s", path, strerror(e));
    return LM_OK;
}

// Fsyncs every regular file under the directory `path`, its subdirectories, and `path` itself.
static lm_status sync_tree(const char *path, int depth, lm_err *err)
{
    DIR *d = opendir(path);
    if (!d)
        return lm_err_set(err, LM_ERR_IO, "%s: %s", path, strerror(errno));
    lm_status s = LM_OK;
    struct dirent *e;
    while (s == LM_OK && (e = readdir(d)) != NULL) {
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0)
            continue;
        char *child = lm_path_join(path, e->d_name);
        struct stat st;
        if (!child)
            s = lm_err_set(err, LM_ERR_NOMEM, "out of memory");
        else if (lstat(child, &st) != 0)
            s = lm_err_set(err, LM_ERR_IO, "%s: %s", child, strerror(errno));
        else if (S_ISDIR(st.st_mode) && depth < 32)
            s = sync_tree(child, depth + 1, err);
        else if (S_ISREG(st.st_mode))
            s = sync_path(child, false, err);
        free(child);
    }
    closedir(d);
    return s == LM_OK ? sync_path(path, true, err) : s;
}

lm_status lm_outdir_sync_parent(const char *path, lm_err *err)
{
    char *parent = lm_path_parent(path);
    if (!parent)
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    lm_status s = sync_path(parent, true, err);
    free(parent);
    return s;
}

// On failure the paths are kept, so that the caller's lm_outdir_abort removes the temporary
// directory; on success they are freed and abort does nothing.
lm_status lm_outdir_commit(lm_outdir *od, lm_err *err)
{
    if (!od->tmp || !od->final)
        return lm_err_set(err, LM_ERR_USAGE, "output directory: nothing to commit");
    // Every file of the new output, and its directory, on disk before the rename makes it OUT:
    // otherwise a power cut could leave an OUT that looks complete and is not.
    lm_status s = sync_tree(od->tmp, 0, err);
    if (s != LM_OK)
        return s;
    struct stat st;
    char *aside = NULL;
    if (lstat(od->final, &st) == 0) {
        if (!od->force)  // appeared while the run was working
            return lm_err_set(err, LM_ERR_USAGE, "%s: appeared while this run was working "
                              "(use --force to replace it)", od->final);
        int e;
        aside = unique_path(od->final, ".old-", false, &e);
        if (!aside)
            return e ? lm_err_set(err, LM_ERR_IO, "%s: no free name to move it aside", od->final)
                     : lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    }
    lm_signals_hold();
    if (aside && rename(od->final, aside) != 0) {
        lm_signals_release();
        lm_err_set(err, LM_ERR_IO, "%s: moving the old output aside to %s: %s", od->final,
                   aside, strerror(errno));
        free(aside);
        return LM_ERR_IO;
    }
    if (rename(od->tmp, od->final) != 0) {
        int e = errno;
        // put the old output back where it was, so a failed commit replaces nothing
        bool restored = !aside || rename(aside, od->final) == 0;
        lm_signals_release();
        lm_err_set(err, LM_ERR_IO, "%s: renaming %s into place: %s%s%s", od->final, od->tmp,
                   strerror(e), restored ? "" : "; the old output is now at ",
                   restored ? "" : aside);
        free(aside);
        return LM_ERR_IO;
    }
    // OUT is the new output: what a dying handler removes is the old one, no longer `tmp`
    lm_signals_forget(od->tmp_id);
    od->tmp_id = 0;
    int aside_id = aside ? lm_signals_remove_on_exit(aside, false) : 0;
    lm_signals_release();
    // the renames on disk too
    s = lm_outdir_sync_parent(od->final, err);
    if (s != LM_OK)
        lm_err_prefix(err, "%s: renamed into place, but not yet safe on disk", od->final);
    if (aside) {
        lm_err old;
        if (lm_rm_rf(aside, &old) != LM_OK && s == LM_OK)
            s = lm_err_set(err, LM_ERR_IO, "%s: written, but the old output moved to %s could "
                           "not be removed: %s", od->final, aside, old.msg);
        lm_signals_forget(aside_id);
        free(aside);
    }
    outdir_clear(od);
    return s;
}

void lm_outdir_abort(lm_outdir *od)
{
    if (!od)
        return;
    // removed first, forgotten after: a handler that comes meanwhile removes it too
    if (od->tmp)
        lm_rm_rf(od->tmp, NULL);
    lm_signals_forget(od->tmp_id);
    od->tmp_id = 0;
    outdir_clear(od);
}

// ==== outputs clear of the inputs =============================================================

char *lm_guard_resolve(const char *path)
{
    char *abs;
    if (path[0] == '/') {
        abs = lm_strdup(path);
    } else {
        char *cwd = getcwd(NULL, 0);
        abs = cwd ? lm_path_join(cwd, path) : NULL;
        free(cwd);
    }
    if (!abs)
        return NULL;
    // the deepest ancestor that resolves; "/" always does
    size_t cut = strlen(abs);
    char *real = NULL;
    for (;;) {
        char save = abs[cut];
        abs[cut] = '\0';
        real = realpath(cut ? abs : "/", NULL);
        abs[cut] = save;
        if (real || cut == 0)
            break;
        while (cut > 0 && abs[cut - 1] != '/')
            cut--;
        while (cut > 0 && abs[cut - 1] == '/')
            cut--;
    }
    if (!real) {
        free(abs);
        return NULL;
    }
    // then the rest, component by component: it does not exist, so "." and ".." are only text
    lm_buf b = {0};
    lm_buf_str(&b, strcmp(real, "/") == 0 ? "" : real);
    free(real);
    for (char *c = abs + cut; *c;) {
        while (*c == '/')
            c++;
        size_t n = strcspn(c, "/");
        if (n == 0)
            break;
        if (n == 1 && c[0] == '.') {
        } else if (n == 2 && c[0] == '.' && c[1] == '.') {
            while (b.len > 0 && b.p[b.len - 1] != '/')
                b.len--;
            if (b.len > 0)
                b.len--;
            if (b.p)
                b.p[b.len] = '\0';
        } else {
            lm_buf_put(&b, "/", 1);
            lm_buf_put(&b, c, n);
        }
        c += n;
    }
    free(abs);
    if (b.len == 0)
        lm_buf_put(&b, "/", 1);
    if (b.oom) {
        free(b.p);
        return NULL;
    }
    return b.p;
}

lm_status lm_guard_add(lm_guard *g, const char *what, const char *path, lm_err *err)
{
    if (g->n == g->cap) {
        int cap = g->cap ? 2 * g->cap : 16;
        lm_guard_input *in = realloc(g->in, (size_t)cap * sizeof *in);
        if (!in)
            return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
        g->in = in;
        g->cap = cap;
    }
    lm_guard_input *e = &g->in[g->n];
    memset(e, 0, sizeof *e);
    e->what = lm_strdup(what);
    e->shown = lm_strdup(path);
    e->real = lm_guard_resolve(path);
    if (!e->what || !e->shown || !e->real) {
        free(e->what);
        free(e->shown);
        free(e->real);
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    }
    struct stat st;
    if (stat(path, &st) == 0) {
        e->have_id = true;
        e->dev = (uint64_t)st.st_dev;
        e->ino = (uint64_t)st.st_ino;
    }
    g->n++;
    return LM_OK;
}

// Whether the resolved path `a` lies inside the directory `b` (both from lm_guard_resolve).
static bool inside(const char *a, const char *b)
{
    size_t n = strlen(b);
    if (n == 1)  // "/"
        return a[1] != '\0';
    return strncmp(a, b, n) == 0 && a[n] == '/';
}

lm_status lm_guard_check(const lm_guard *g, const char *opt, const char *path, lm_err *err)
{
    char *real = lm_guard_resolve(path);
    if (!real)
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    struct stat st;
    bool exists = stat(path, &st) == 0;
    lm_status s = LM_OK;
    for (int i = 0; i < g->n && s == LM_OK; i++) {
        const lm_guard_input *in = &g->in[i];
        const char *rel = NULL;
        if ((exists && in->have_id && in->dev == (uint64_t)st.st_dev && in->ino == (uint64_t)st.st_ino) ||
            strcmp(real, in->real) == 0)
            rel = "is";
        else if (inside(real, in->real))
            rel = "is inside";
        else if (inside(in->real, real))
            rel = "holds";
        if (rel)
            s = lm_err_set(err, LM_ERR_USAGE, "%s %s %s %s %s: refusing to write there (an output must not be, "
                           "hold or lie inside an input, even with --force)", opt, path, rel, in->what, in->shown);
    }
    free(real);
    return s;
}

lm_status lm_guard_check_outdir(const lm_guard *g, const char *out, lm_err *err)
{
    lm_status s = lm_guard_check(g, "-o", out, err);
    if (s != LM_OK)
        return s;
    // the lock file goes beside OUT as lm_outdir_begin names it: "out/" is "out"
    size_t len = strlen(out);
    while (len > 1 && out[len - 1] == '/')
        len--;
    char *lock = lm_strfmt("%.*s.lock", (int)len, out), *opt = lm_strfmt("-o %s: its lock file", out);
    if (!lock || !opt)
        s = lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    else
        s = lm_guard_check(g, opt, lock, err);
    free(lock);
    free(opt);
    return s;
}

void lm_guard_free(lm_guard *g)
{
    for (int i = 0; i < g->n; i++) {
        free(g->in[i].what);
        free(g->in[i].shown);
        free(g->in[i].real);
    }
    free(g->in);
    memset(g, 0, sizeof *g);
}
