// The background file hasher: see hasher.h.
#include "hasher.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#define WINDOW LM_HASHER_WINDOW

typedef struct file {
    char *path;
    int fd;               // -1 once closed
    uint64_t size, done;  // bytes in all, hashed so far
    XXH64_state_t *st;
    bool finished;        // hash or err set
    uint64_t hash;
    lm_err err;           // err.status != LM_OK when the file could not be hashed
} file;

struct lm_hasher {
    file *files;
    int n;
    pthread_t thread;
    bool started;
    pthread_mutex_t mu;
    pthread_cond_t cv;  // a file finished
    bool stop;          // read by the thread between windows
};

static void finish(lm_hasher *h, file *f)
{
    if (f->fd >= 0)
        close(f->fd);
    f->fd = -1;
    XXH64_freeState(f->st);
    f->st = NULL;
    pthread_mutex_lock(&h->mu);
    f->finished = true;
    pthread_cond_broadcast(&h->cv);
    pthread_mutex_unlock(&h->mu);
}

// Opens f; a file that is not regular (or empty) is hashed whole at once by lm_xxh64_file.
static void open_file(lm_hasher *h, file *f)
{
    struct stat sb;
    f->fd = open(f->path, O_RDONLY | O_CLOEXEC);
    if (f->fd < 0) {
        lm_err_set(&f->err, LM_ERR_IO, "%s: %s", f->path, strerror(errno));
        finish(h, f);
        return;
    }
    if (fstat(f->fd, &sb) != 0 || !S_ISREG(sb.st_mode) || sb.st_size == 0 || !(f->st = XXH64_createState())) {
        lm_xxh64_file(f->path, &f->hash, &f->err);
        finish(h, f);
        return;
    }
    XXH64_reset(f->st, 0);
    f->size = (uint64_t)sb.st_size;
}

static bool stopping(lm_hasher *h)
{
    pthread_mutex_lock(&h->mu);
    bool stop = h->stop;
    pthread_mutex_unlock(&h->mu);
    return stop;
}

static void *run(void *arg)
{
    lm_hasher *h = arg;
    for (int i = 0; i < h->n; i++)
        open_file(h, &h->files[i]);
    for (bool left = true; left && !stopping(h);) {
        left = false;
        for (int i = 0; i < h->n; i++) {
            file *f = &h->files[i];
            if (f->finished)
                continue;
            size_t len = f->size - f->done < WINDOW ? (size_t)(f->size - f->done) : WINDOW;
            if (lm_xxh64_mapped(f->st, f->fd, f->done, len, f->path, &f->err) != LM_OK) {
                finish(h, f);
                continue;
            }
            f->done += len;
            if (f->done == f->size) {
                f->hash = XXH64_digest(f->st);
                finish(h, f);
            } else {
                left = true;
            }
        }
    }
    return NULL;
}

lm_status lm_hasher_start(lm_hasher **out, const char *const *paths, int n, lm_err *err)
{
    *out = NULL;
    lm_hasher *h = calloc(1, sizeof *h);
    if (!h || !(h->files = calloc((size_t)(n > 0 ? n : 1), sizeof *h->files))) {
        free(h);
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    }
    pthread_mutex_init(&h->mu, NULL);
    pthread_cond_init(&h->cv, NULL);
    h->n = n;
    for (int i = 0; i < n; i++) {
        h->files[i].fd = -1;
        if (!(h->files[i].path = lm_strdup(paths[i]))) {
            lm_hasher_free(h);
            return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
        }
    }
    int rc = pthread_create(&h->thread, NULL, run, h);
    if (rc != 0) {
        lm_hasher_free(h);
        return lm_err_set(err, LM_ERR_NOMEM, "cannot start the hashing thread: %s", strerror(rc));
    }
    h->started = true;
    *out = h;
    return LM_OK;
}

lm_status lm_hasher_get(lm_hasher *h, const char *path, uint64_t *hash, bool *found, lm_err *err)
{
    *found = false;
    file *f = NULL;
    for (int i = 0; h && i < h->n && !f; i++)
        if (strcmp(h->files[i].path, path) == 0)
            f = &h->files[i];
    if (!f)
        return LM_OK;
    pthread_mutex_lock(&h->mu);
    while (!f->finished && !h->stop)
        pthread_cond_wait(&h->cv, &h->mu);
    bool finished = f->finished;
    pthread_mutex_unlock(&h->mu);
    if (!finished)  // stopped: the caller hashes it itself
        return LM_OK;
    *found = true;
    if (f->err.status != LM_OK) {
        if (err)
            *err = f->err;
        return f->err.status;
    }
    *hash = f->hash;
    return LM_OK;
}

void lm_hasher_free(lm_hasher *h)
{
    if (!h)
        return;
    if (h->started) {
        pthread_mutex_lock(&h->mu);
        h->stop = true;
        pthread_cond_broadcast(&h->cv);
        pthread_mutex_unlock(&h->mu);
        pthread_join(h->thread, NULL);
    }
    for (int i = 0; i < h->n; i++) {
        if (h->files[i].fd >= 0)
            close(h->files[i].fd);
        XXH64_freeState(h->files[i].st);
        free(h->files[i].path);
    }
    pthread_cond_destroy(&h->cv);
    pthread_mutex_destroy(&h->mu);
    free(h->files);
    free(h);
}
