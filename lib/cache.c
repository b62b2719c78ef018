// The cache of Hessians, U_cc² and masks: see cache.h. An entry file, little-endian as the
// machine writes it:
//
//   header  "llmcache" | kind u32 | version u32 | key u64 | meta i64 | xxh64 of the 32 bytes before
//   record  name_len u32 | 0 u32 | n i64 | bytes u64 | name | data | xxh64 of the record before it
//   ...
//   footer  0xFFFFFFFF u32 | 0 u32 | records i64 | xxh64 over the header's and each record's sums
//
// The footer's count and chained checksum make a truncated entry (one that ends between two
// records) as detectable as a damaged one.
// the checksum states live inside lm_cache_entry rather than on the heap
#define XXH_STATIC_LINKING_ONLY
#include "cache.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <xxhash.h>

#include "device.h"
#include "hessian.h"

#define MAGIC "llmcache"
#define VERSION 1u
#define HEADER_BYTES 40
#define RECORD_HEAD 24
#define FOOTER_MARK 0xFFFFFFFFu

char *lm_cache_dir(const char *given)
{
    if (given && *given)
        return lm_strdup(given);
    const char *xdg = getenv("XDG_CACHE_HOME");
    if (xdg && *xdg)
        return lm_path_join(xdg, "llmerge");
    const char *home = getenv("HOME");
    if (!home || !*home)
        return NULL;
    return lm_strfmt("%s/.cache/llmerge", home);
}

bool lm_cache_keeps_hessians(void)
{
    const char *v = getenv("LLMERGE_CACHE_HESSIANS");
    if (!v || !*v)
        return true;
    return !(strcmp(v, "0") == 0 || strcasecmp(v, "no") == 0 || strcasecmp(v, "off") == 0 ||
             strcasecmp(v, "false") == 0);
}

// ==== keys ====================================================================================

static lm_status add_file(XXH64_state_t *st, const char *path, lm_err *err)
{
    uint64_t h;
    lm_status s = lm_xxh64_file(path, &h, err);
    if (s == LM_OK)
        XXH64_update(st, &h, sizeof h);
    return s;
}

// Hashes the n files of paths into *out.
static lm_status digest_files(const char *const *paths, int n, uint64_t *out, lm_err *err)
{
    XXH64_state_t *st = XXH64_createState();
    if (!st)
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    XXH64_reset(st, 0);
    lm_status s = LM_OK;
    for (int i = 0; s == LM_OK && i < n; i++)
        s = add_file(st, paths[i], err);
    *out = XXH64_digest(st);
    XXH64_freeState(st);
    return s;
}

lm_status lm_cache_digest_model(const lm_model *m, uint64_t *out, lm_err *err)
{
    const char **paths = malloc((size_t)(m->n_shards + 2) * sizeof *paths);
    if (!paths)
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    int n = 0;
    paths[n++] = m->config.path;
    if (m->index_path)
        paths[n++] = m->index_path;
    for (int i = 0; i < m->n_shards; i++)
        paths[n++] = m->shards[i].path;
    lm_status s = digest_files(paths, n, out, err);
    free(paths);
    return s;
}

lm_status lm_cache_digest_adapter(const lm_adapter *a, uint64_t *out, lm_err *err)
{
    const char *paths[2] = {a->config.path, a->weights_path};
    return digest_files(paths, 2, out, err);
}

lm_status lm_cache_digest_file(const char *path, uint64_t *out, lm_err *err)
{
    return digest_files(&path, 1, out, err);
}

// A key is xxHash64 over a tag naming the kind and the format's version, then each input as a
// fixed-width value (never a struct's bytes: padding is not an input).
typedef struct keyer {
    XXH64_state_t st;
} keyer;

static void key_start(keyer *k, const char *tag)
{
    XXH64_reset(&k->st, 0);
    XXH64_update(&k->st, tag, strlen(tag) + 1);
}

static void key_u64(keyer *k, uint64_t v)
{
    XXH64_update(&k->st, &v, sizeof v);
}

static void key_f64(keyer *k, double v)
{
    uint64_t bits;
    memcpy(&bits, &v, sizeof bits);
    key_u64(k, bits);
}

static void key_hess_src(keyer *k, const lm_cache_hess_src *src)
{
    key_u64(k, src->model);
    key_u64(k, src->has_adapter);
    key_u64(k, src->has_adapter ? src->adapter : 0);
    key_u64(k, src->calib);
    key_u64(k, (uint64_t)src->max_samples);
    key_u64(k, (uint64_t)src->max_len);
}

uint64_t lm_cache_key_hess(const lm_cache_hess_src *src)
{
    keyer k;
    key_start(&k, "llmerge hess 1");
    key_hess_src(&k, src);
    return XXH64_digest(&k.st);
}

uint64_t lm_cache_key_ucc2(const lm_cache_hess_src *src, double damp)
{
    keyer k;
    key_start(&k, "llmerge ucc2 2");  // 2: U_cc² from one factorisation (lm_hess_ucc2)
    key_hess_src(&k, src);
    key_f64(&k, damp);
    return XXH64_digest(&k.st);
}

uint64_t lm_cache_key_mask(const lm_cache_mask_src *src)
{
    keyer k;
    key_start(&k, "llmerge mask 1");
    key_u64(&k, src->ucc2_key);
    key_u64(&k, src->base);
    key_u64(&k, src->ft);
    key_f64(&k, src->density);
    key_u64(&k, src->topk_global);
    return XXH64_digest(&k.st);
}

// ==== entries =================================================================================

struct lm_cache_entry {
    FILE *f;
    char *path;            // where the entry is (or goes)
    char *tmp;             // writing: the temporary file, renamed to path by lm_cache_commit
    lm_cache_kind kind;
    uint64_t key;
    bool damaged;          // reading: lm_cache_close removes the file
    dev_t dev;             // reading: the file opened, so that only it is ever removed
    ino_t ino;
    uint64_t size;         // reading: the file's size
    uint64_t pos;          // reading: bytes consumed
    XXH64_state_t rec;     // the current record's checksum
    XXH64_state_t chain;   // over the header's and every record's checksum
    int64_t n_records;
    bool pending;          // reading: a record's header was read, its data is next
    size_t rec_bytes;
};

const char *lm_cache_kind_name(lm_cache_kind kind)
{
    switch (kind) {
    case LM_CACHE_HESS: return "hess";
    case LM_CACHE_UCC2: return "ucc2";
    case LM_CACHE_MASK: return "mask";
    }
    return "unknown";
}

char *lm_cache_entry_path(const char *dir, lm_cache_kind kind, uint64_t key)
{
    return lm_strfmt("%s/%s-%016" PRIx64 ".bin", dir, lm_cache_kind_name(kind), key);
}

const char *lm_cache_path(const lm_cache_entry *e)
{
    return e->path;
}

void lm_cache_close(lm_cache_entry *e)
{
    if (!e)
        return;
    if (e->f)
        fclose(e->f);
    if (e->tmp) {
        unlink(e->tmp);
    } else if (e->damaged) {
        // another run may have put a sound entry there since this one was opened: keep it
        struct stat st;
        if (stat(e->path, &st) == 0 && st.st_dev == e->dev && st.st_ino == e->ino)
            unlink(e->path);
    }
    free(e->path);
    free(e->tmp);
    free(e);
}

// Removes the temporary files in dir that a process which no longer exists left behind (a
// capture killed halfway leaves gigabytes): ".KIND-KEY.bin.tmp-PID-N" whose PID is gone and
// which nothing has written to for ORPHAN_AGE seconds. The age spares a live writer whose PID
// means nothing here (another machine or container sharing the directory): a writer appends
// record after record, so its file is never that old.
#define ORPHAN_AGE 3600

static void remove_orphans(const char *dir)
{
    DIR *d = opendir(dir);
    if (!d)
        return;
    struct dirent *de;
    time_t now = time(NULL);
    while ((de = readdir(d)) != NULL) {
        const char *t = strstr(de->d_name, ".bin.tmp-");
        if (de->d_name[0] != '.' || !t)
            continue;
        char *end;
        long pid = strtol(t + 9, &end, 10);
        if (end == t + 9 || *end != '-' || pid <= 0 || pid == (long)getpid())
            continue;
        struct stat st;
        if (fstatat(dirfd(d), de->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(st.st_mode) ||
            now - st.st_mtime < ORPHAN_AGE)
            continue;
        if (kill((pid_t)pid, 0) != 0 && errno == ESRCH)
            unlinkat(dirfd(d), de->d_name, 0);
    }
    closedir(d);
}

static lm_status write_bytes(lm_cache_entry *e, const void *p, size_t n, lm_err *err)
{
    if (n && fwrite(p, 1, n, e->f) != n)
        return lm_err_set(err, LM_ERR_IO, "%s: %s", e->tmp, strerror(errno ? errno : EIO));
    return LM_OK;
}

lm_status lm_cache_create(lm_cache_entry **out, const char *dir, lm_cache_kind kind, uint64_t key, int64_t meta,
                          lm_err *err)
{
    static atomic_uint counter;
    *out = NULL;
    lm_status s = lm_mkdir_p(dir, err);
    if (s != LM_OK)
        return s;
    remove_orphans(dir);
    lm_cache_entry *e = calloc(1, sizeof *e);
    if (!e || !(e->path = lm_cache_entry_path(dir, kind, key)) ||
        !(e->tmp = lm_strfmt("%s/.%s-%016" PRIx64 ".bin.tmp-%ld-%u", dir, lm_cache_kind_name(kind), key,
                             (long)getpid(), atomic_fetch_add(&counter, 1)))) {
        if (e)
            free(e->path);
        free(e);
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    }
    e->kind = kind;
    e->key = key;
    int fd = open(e->tmp, O_WRONLY | O_CREAT | O_EXCL, 0644);
    if (fd < 0 || !(e->f = fdopen(fd, "wb"))) {
        s = lm_err_set(err, LM_ERR_IO, "%s: %s", e->tmp, strerror(errno));
        if (fd >= 0)
            close(fd);
        else {
            free(e->tmp);  // not ours to remove
            e->tmp = NULL;
        }
        lm_cache_close(e);
        return s;
    }
    unsigned char h[HEADER_BYTES];
    uint32_t k32 = (uint32_t)kind, v32 = VERSION;
    memcpy(h, MAGIC, 8);
    memcpy(h + 8, &k32, 4);
    memcpy(h + 12, &v32, 4);
    memcpy(h + 16, &key, 8);
    memcpy(h + 24, &meta, 8);
    uint64_t sum = XXH64(h, 32, 0);
    memcpy(h + 32, &sum, 8);
    XXH64_reset(&e->chain, 0);
    XXH64_update(&e->chain, &sum, sizeof sum);
    if ((s = write_bytes(e, h, sizeof h, err)) != LM_OK) {
        lm_cache_close(e);
        return s;
    }
    *out = e;
    return LM_OK;
}

lm_status lm_cache_put(lm_cache_entry *e, const char *name, int64_t n, const void *data, size_t bytes, lm_err *err)
{
    size_t name_len = strlen(name);
    if (name_len > LM_CACHE_NAME_MAX)
        return lm_err_set(err, LM_ERR_USAGE, "%s: a record name of %zu bytes (at most %d)", e->tmp, name_len,
                          LM_CACHE_NAME_MAX);
    unsigned char h[RECORD_HEAD];
    uint32_t len32 = (uint32_t)name_len, zero = 0;
    uint64_t b64 = bytes;
    memcpy(h, &len32, 4);
    memcpy(h + 4, &zero, 4);
    memcpy(h + 8, &n, 8);
    memcpy(h + 16, &b64, 8);
    XXH64_reset(&e->rec, 0);
    XXH64_update(&e->rec, h, sizeof h);
    XXH64_update(&e->rec, name, name_len);
    XXH64_update(&e->rec, data, bytes);
    uint64_t sum = XXH64_digest(&e->rec);
    lm_status s;
    if ((s = write_bytes(e, h, sizeof h, err)) != LM_OK || (s = write_bytes(e, name, name_len, err)) != LM_OK ||
        (s = write_bytes(e, data, bytes, err)) != LM_OK || (s = write_bytes(e, &sum, sizeof sum, err)) != LM_OK)
        return s;
    XXH64_update(&e->chain, &sum, sizeof sum);
    e->n_records++;
    return LM_OK;
}

lm_status lm_cache_commit(lm_cache_entry *e, lm_err *err)
{
    unsigned char f[24];
    uint32_t mark = FOOTER_MARK, zero = 0;
    uint64_t chain = XXH64_digest(&e->chain);
    memcpy(f, &mark, 4);
    memcpy(f + 4, &zero, 4);
    memcpy(f + 8, &e->n_records, 8);
    memcpy(f + 16, &chain, 8);
    lm_status s = write_bytes(e, f, sizeof f, err);
    if (s == LM_OK && fflush(e->f) != 0)
        s = lm_err_set(err, LM_ERR_IO, "%s: %s", e->tmp, strerror(errno));
    int rc = fclose(e->f);
    e->f = NULL;
    if (s == LM_OK && rc != 0)
        s = lm_err_set(err, LM_ERR_IO, "%s: %s", e->tmp, strerror(errno));
    if (s == LM_OK && rename(e->tmp, e->path) != 0)
        s = lm_err_set(err, LM_ERR_IO, "%s: %s", e->path, strerror(errno));
    if (s == LM_OK) {
        free(e->tmp);
        e->tmp = NULL;  // in place now: nothing for close to remove
    }
    lm_cache_close(e);
    return s;
}

// Marks e damaged with a message naming it.
static lm_status damaged(lm_cache_entry *e, lm_err *err, const char *what)
{
    e->damaged = true;
    return lm_err_set(err, LM_ERR_FORMAT, "%s has %s", e->path, what);
}

// Reads exactly n bytes; a short read is damage (the entry is truncated), a read error LM_ERR_IO.
static lm_status read_bytes(lm_cache_entry *e, void *p, size_t n, const char *what, lm_err *err)
{
    if (n && fread(p, 1, n, e->f) != n) {
        if (ferror(e->f))
            return lm_err_set(err, LM_ERR_IO, "%s: %s", e->path, strerror(errno ? errno : EIO));
        return damaged(e, err, what);
    }
    e->pos += n;
    return LM_OK;
}

lm_status lm_cache_reject(lm_cache_entry *e, const char *why, lm_err *err)
{
    e->damaged = true;
    return lm_err_set(err, LM_ERR_FORMAT, "%s: %s", e->path, why);
}

lm_status lm_cache_open(lm_cache_entry **out, const char *dir, lm_cache_kind kind, uint64_t key, int64_t *meta,
                        char *why, size_t why_size, lm_err *err)
{
    *out = NULL;
    *meta = 0;
    if (why && why_size)
        why[0] = '\0';
    lm_cache_entry *e = calloc(1, sizeof *e);
    if (!e || !(e->path = lm_cache_entry_path(dir, kind, key))) {
        free(e);
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    }
    e->kind = kind;
    e->key = key;
    if (!(e->f = fopen(e->path, "rb"))) {
        if (errno != ENOENT && why && why_size)
            snprintf(why, why_size, "%s: %s", e->path, strerror(errno));
        lm_cache_close(e);
        return LM_OK;
    }
    struct stat st;
    if (fstat(fileno(e->f), &st) != 0) {
        if (why && why_size)
            snprintf(why, why_size, "%s: %s", e->path, strerror(errno));
        lm_cache_close(e);
        return LM_OK;
    }
    e->dev = st.st_dev;
    e->ino = st.st_ino;
    e->size = (uint64_t)st.st_size;
    unsigned char h[HEADER_BYTES];
    lm_err rerr = {0};
    lm_status s = read_bytes(e, h, sizeof h, "a truncated header", &rerr);
    uint32_t k32 = 0, v32 = 0;
    uint64_t k64 = 0, sum = 0;
    if (s == LM_OK) {
        memcpy(&k32, h + 8, 4);
        memcpy(&v32, h + 12, 4);
        memcpy(&k64, h + 16, 8);
        memcpy(meta, h + 24, 8);
        memcpy(&sum, h + 32, 8);
        if (memcmp(h, MAGIC, 8) != 0 || v32 != VERSION)
            s = damaged(e, &rerr, "a header not of this cache format");
        else if (sum != XXH64(h, 32, 0))
            s = damaged(e, &rerr, "a header whose checksum does not match its contents");
        else if (k32 != (uint32_t)kind || k64 != key)
            s = damaged(e, &rerr, "the header of another entry (renamed?)");
    }
    if (s != LM_OK) {
        if (why && why_size)
            snprintf(why, why_size, "%s", rerr.msg);
        e->damaged = e->damaged || s == LM_ERR_FORMAT;
        *meta = 0;
        lm_cache_close(e);
        return LM_OK;
    }
    XXH64_reset(&e->chain, 0);
    XXH64_update(&e->chain, &sum, sizeof sum);
    *out = e;
    return LM_OK;
}

lm_status lm_cache_next(lm_cache_entry *e, char *name, size_t name_cap, int64_t *n, size_t *bytes, bool *end,
                        lm_err *err)
{
    *end = false;
    *n = 0;
    *bytes = 0;
    if (e->pending)
        return lm_err_set(err, LM_ERR_USAGE, "%s: the data of the record before was not read", e->path);
    unsigned char h[RECORD_HEAD];
    lm_status s = read_bytes(e, h, sizeof h, "a truncated record (no footer)", err);
    if (s != LM_OK)
        return s;
    uint32_t len32, zero;
    int64_t count;
    uint64_t b64;
    memcpy(&len32, h, 4);
    memcpy(&zero, h + 4, 4);
    memcpy(&count, h + 8, 8);
    memcpy(&b64, h + 16, 8);
    if (len32 == FOOTER_MARK) {
        uint64_t chain = XXH64_digest(&e->chain);
        if (zero != 0 || count != e->n_records)
            return damaged(e, err, "a footer whose count of records is wrong");
        if (b64 != chain)
            return damaged(e, err, "a footer whose checksum does not match its records");
        if (e->pos != e->size)
            return damaged(e, err, "bytes after its footer");
        *end = true;
        return LM_OK;
    }
    // every size is checked against what is left of the file before anything is allocated
    uint64_t left = e->size - e->pos;
    if (zero != 0 || len32 > LM_CACHE_NAME_MAX || count < 0 || (uint64_t)len32 + 8 > left ||
        b64 > left - len32 - 8 || b64 > SIZE_MAX)
        return damaged(e, err, "a record header that is damaged");
    if (len32 >= name_cap)
        return damaged(e, err, "a record name longer than its reader takes");
    XXH64_reset(&e->rec, 0);
    XXH64_update(&e->rec, h, sizeof h);
    if ((s = read_bytes(e, name, len32, "a truncated record", err)) != LM_OK)
        return s;
    name[len32] = '\0';
    if (memchr(name, '\0', len32))
        return damaged(e, err, "a record name with a NUL byte");
    XXH64_update(&e->rec, name, len32);
    *n = count;
    *bytes = (size_t)b64;
    e->rec_bytes = (size_t)b64;
    e->pending = true;
    return LM_OK;
}

lm_status lm_cache_read(lm_cache_entry *e, void *data, lm_err *err)
{
    if (!e->pending)
        return lm_err_set(err, LM_ERR_USAGE, "%s: no record header was read", e->path);
    e->pending = false;
    uint64_t sum;
    lm_status s = read_bytes(e, data, e->rec_bytes, "a truncated record", err);
    if (s == LM_OK)
        s = read_bytes(e, &sum, sizeof sum, "a truncated record", err);
    if (s != LM_OK)
        return s;
    XXH64_update(&e->rec, data, e->rec_bytes);
    if (sum != XXH64_digest(&e->rec))
        return damaged(e, err, "a record whose checksum does not match its contents");
    XXH64_update(&e->chain, &sum, sizeof sum);
    e->n_records++;
    return LM_OK;
}

// ==== U_cc² sets ==============================================================================

// How a load that read a bad entry ends: out of memory is the caller's error; anything else
// (the entry damaged, truncated, for another model) is a miss, said in `why`.
static lm_status load_failed(lm_status s, const lm_err *rerr, lm_err *err, char *why, size_t why_size)
{
    if (s == LM_ERR_NOMEM) {
        *err = *rerr;
        return s;
    }
    if (why && why_size)
        snprintf(why, why_size, "%s", rerr->msg);
    return LM_OK;
}

lm_status lm_cache_load_ucc2(const char *dir, uint64_t key, int64_t n, const int64_t *dims, double ***out, bool *hit,
                             char *why, size_t why_size, lm_err *err)
{
    *out = NULL;
    *hit = false;
    lm_cache_entry *e = NULL;
    int64_t meta;
    lm_status s = lm_cache_open(&e, dir, LM_CACHE_UCC2, key, &meta, why, why_size, err);
    if (s != LM_OK || !e)
        return s;
    double **arr = calloc((size_t)(n > 0 ? n : 1), sizeof *arr);
    if (!arr) {
        lm_cache_close(e);
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    }
    lm_err rerr = {0};
    char name[LM_CACHE_NAME_MAX + 1];
    int64_t count;
    size_t bytes;
    bool end = false;
    for (int64_t i = 0; s == LM_OK && i < n; i++) {
        if ((s = lm_cache_next(e, name, sizeof name, &count, &bytes, &end, &rerr)) != LM_OK)
            break;
        if (end || count != dims[i] || bytes != (size_t)count * sizeof(double)) {
            s = lm_cache_reject(e, "records that do not fit this model's Hessians", &rerr);
            break;
        }
        if (!(arr[i] = malloc(bytes ? bytes : 1))) {
            s = lm_err_set(&rerr, LM_ERR_NOMEM, "out of memory (%zu bytes)", bytes);
            break;
        }
        s = lm_cache_read(e, arr[i], &rerr);
    }
    if (s == LM_OK && (s = lm_cache_next(e, name, sizeof name, &count, &bytes, &end, &rerr)) == LM_OK && !end)
        s = lm_cache_reject(e, "more records than this model has Hessians", &rerr);
    lm_cache_close(e);
    if (s != LM_OK) {
        lm_hess_ucc2_free(arr, n);
        return load_failed(s, &rerr, err, why, why_size);
    }
    *out = arr;
    *hit = true;
    return LM_OK;
}

lm_status lm_cache_store_ucc2(const char *dir, uint64_t key, double *const *ucc2, int64_t n, const int64_t *dims,
                              const char *const *names, lm_err *err)
{
    lm_cache_entry *e = NULL;
    lm_status s = lm_cache_create(&e, dir, LM_CACHE_UCC2, key, 0, err);
    for (int64_t i = 0; s == LM_OK && i < n; i++)
        s = lm_cache_put(e, names[i], dims[i], ucc2[i], (size_t)dims[i] * sizeof(double), err);
    if (s != LM_OK) {
        lm_cache_close(e);
        return s;
    }
    return lm_cache_commit(e, err);
}

// ==== masks ===================================================================================

void lm_cache_masks_free(lm_cache_masks *m)
{
    for (int64_t i = 0; i < m->n; i++) {
        free(m->names[i]);
        free(m->bits[i]);
    }
    free(m->names);
    free(m->numel);
    free(m->bits);
    lm_strmap_free(&m->index);
    memset(m, 0, sizeof *m);
}

// Room for one more record in m.
static bool masks_grow(lm_cache_masks *m, int64_t *cap)
{
    if (m->n < *cap)
        return true;
    int64_t c = *cap ? 2 * *cap : 64;
    char **names = realloc(m->names, (size_t)c * sizeof *names);
    if (names)
        m->names = names;
    int64_t *numel = realloc(m->numel, (size_t)c * sizeof *numel);
    if (numel)
        m->numel = numel;
    uint8_t **bits = realloc(m->bits, (size_t)c * sizeof *bits);
    if (bits)
        m->bits = bits;
    if (!names || !numel || !bits)
        return false;
    *cap = c;
    return true;
}

lm_status lm_cache_load_masks(const char *dir, uint64_t key, lm_cache_masks *out, bool *hit, char *why,
                              size_t why_size, lm_err *err)
{
    memset(out, 0, sizeof *out);
    *hit = false;
    lm_cache_entry *e = NULL;
    int64_t meta;
    lm_status s = lm_cache_open(&e, dir, LM_CACHE_MASK, key, &meta, why, why_size, err);
    if (s != LM_OK || !e)
        return s;
    lm_err rerr = {0};
    if (lm_strmap_init(&out->index, 64) != LM_OK)
        s = lm_err_set(&rerr, LM_ERR_NOMEM, "out of memory");
    char name[LM_CACHE_NAME_MAX + 1];
    int64_t cap = 0, numel;
    size_t bytes;
    for (bool end = false; s == LM_OK;) {
        if ((s = lm_cache_next(e, name, sizeof name, &numel, &bytes, &end, &rerr)) != LM_OK || end)
            break;
        if (bytes != lm_dev_mask_bytes(numel)) {
            s = lm_cache_reject(e, "a mask whose size is not its element count's", &rerr);
            break;
        }
        if (!masks_grow(out, &cap) || !(out->names[out->n] = lm_strdup(name))) {
            s = lm_err_set(&rerr, LM_ERR_NOMEM, "out of memory");
            break;
        }
        if (!(out->bits[out->n] = malloc(bytes ? bytes : 1))) {
            free(out->names[out->n]);
            s = lm_err_set(&rerr, LM_ERR_NOMEM, "out of memory (%zu bytes)", bytes);
            break;
        }
        out->numel[out->n] = numel;
        out->n++;
        if ((s = lm_cache_read(e, out->bits[out->n - 1], &rerr)) != LM_OK)
            break;
        int r = lm_strmap_put(&out->index, out->names[out->n - 1], out->n - 1);
        if (r < 0)
            s = lm_err_set(&rerr, LM_ERR_NOMEM, "out of memory");
        else if (r == 0)
            s = lm_cache_reject(e, "a tensor's mask twice", &rerr);
    }
    lm_cache_close(e);
    if (s != LM_OK) {
        lm_cache_masks_free(out);
        return load_failed(s, &rerr, err, why, why_size);
    }
    *hit = true;
    return LM_OK;
}

const uint8_t *lm_cache_masks_find(const lm_cache_masks *m, const char *name, int64_t numel)
{
    int64_t i = lm_strmap_get(&m->index, name);
    return i >= 0 && m->numel[i] == numel ? m->bits[i] : NULL;
}
