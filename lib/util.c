// Small shared helpers: see util.h.
#include "util.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <xxhash.h>

#include "signals.h"

// ==== time ===================================================================================

double lm_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

// ==== sizes =================================================================================

lm_status lm_parse_size(const char *text, uint64_t *out, lm_err *err)
{
    if (!text || !*text)
        return lm_err_set(err, LM_ERR_USAGE, "empty size");
    const char *p = text;
    uint64_t whole = 0;
    int digits = 0;
    while (*p >= '0' && *p <= '9') {
        if (!lm_mul_u64(whole, 10, &whole) || !lm_add_u64(whole, (uint64_t)(*p - '0'), &whole))
            return lm_err_set(err, LM_ERR_USAGE, "size '%s' is too large", text);
        p++;
        digits++;
    }
    double frac = 0.0, scale = 0.1;
    if (*p == '.') {
        p++;
        while (*p >= '0' && *p <= '9') {
            frac += (*p - '0') * scale;
            scale /= 10;
            p++;
            digits++;
        }
    }
    if (digits == 0)
        return lm_err_set(err, LM_ERR_USAGE, "size '%s' does not start with a number", text);

    static const struct { const char *suffix; uint64_t mult; } units[] = {
        {"", 1}, {"B", 1},
        {"K", 1ull << 10}, {"KiB", 1ull << 10}, {"KB", 1000ull},
        {"M", 1ull << 20}, {"MiB", 1ull << 20}, {"MB", 1000000ull},
        {"G", 1ull << 30}, {"GiB", 1ull << 30}, {"GB", 1000000000ull},
        {"T", 1ull << 40}, {"TiB", 1ull << 40}, {"TB", 1000000000000ull},
    };
    for (size_t i = 0; i < sizeof units / sizeof units[0]; i++) {
        if (strcmp(p, units[i].suffix) != 0)
            continue;
        uint64_t v;
        if (!lm_mul_u64(whole, units[i].mult, &v))
            return lm_err_set(err, LM_ERR_USAGE, "size '%s' is too large", text);
        // mergekit's --out-shard-size 1B counts parameters, a billion of them: taken as bytes it
        // would make a shard of every tensor. No one means a few bytes and writes B.
        if (strcmp(p, "B") == 0 && v < ((uint64_t)1 << 20)) {
            int n = (int)(p - text);
            double params = (double)whole + frac;
            return lm_err_set(err, LM_ERR_USAGE,
                              "size '%s' is %.*s byte%s, and a size under 1 MiB written with B is refused: llmerge "
                              "counts bytes (B or no suffix), K, M, G, T and KiB, MiB, GiB, TiB are powers of 1024, "
                              "KB, MB, GB, TB powers of 1000. If you meant %.*s billion parameters (mergekit's "
                              "--out-shard-size %s), give their bytes: %.15gGB in bf16 or f16, %.15gGB in f32%s%.*s%s",
                              text, n, text, params == 1.0 ? "" : "s", n, text, text, 2 * params, 4 * params,
                              frac > 0 ? "" : "; for bytes, write ", frac > 0 ? 0 : n, text,
                              frac > 0 ? "" : " without B");
        }
        double extra = frac * (double)units[i].mult;
        if (frac > 0 && units[i].mult == 1)
            return lm_err_set(err, LM_ERR_USAGE, "size '%s' has a fraction of a byte", text);
        if (!lm_add_u64(v, (uint64_t)(extra + 0.5), &v))
            return lm_err_set(err, LM_ERR_USAGE, "size '%s' is too large", text);
        *out = v;
        return LM_OK;
    }
    return lm_err_set(err, LM_ERR_USAGE,
                      "size '%s': unknown suffix '%s' (use K, M, G, KiB, MiB, GiB, KB, MB or GB)",
                      text, p);
}

char *lm_format_bytes(char *buf, size_t cap, uint64_t bytes)
{
    static const char *names[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    double v = (double)bytes;
    int u = 0;
    while (v >= 1024.0 && u < 4) {
        v /= 1024.0;
        u++;
    }
    if (u == 0)
        snprintf(buf, cap, "%llu B", (unsigned long long)bytes);
    else
        snprintf(buf, cap, "%.2f %s", v, names[u]);
    return buf;
}

// ==== files and paths ========================================================================

lm_status lm_read_file(const char *path, size_t max_bytes, char **out, size_t *len, lm_err *err)
{
    *out = NULL;
    int fd;
    lm_status os = lm_open_regular(path, &fd, err);
    if (os != LM_OK)
        return os;
    struct stat st;
    if (fstat(fd, &st) != 0) {
        lm_err_set(err, LM_ERR_IO, "%s: %s", path, strerror(errno));
        close(fd);
        return LM_ERR_IO;
    }
    if ((uint64_t)st.st_size > max_bytes) {
        close(fd);
        return lm_err_set(err, LM_ERR_FORMAT, "%s: %lld bytes, more than the %zu allowed", path,
                          (long long)st.st_size, max_bytes);
    }
    size_t n = (size_t)st.st_size;
    char *buf = malloc(n + 1);
    if (!buf) {
        close(fd);
        return lm_err_set(err, LM_ERR_NOMEM, "%s: out of memory reading %zu bytes", path, n);
    }
    size_t got = 0;
    while (got < n) {
        ssize_t r = read(fd, buf + got, n - got);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0) {
            lm_err_set(err, LM_ERR_IO, "%s: %s", path, r < 0 ? strerror(errno) : "file shrank while reading");
            free(buf);
            close(fd);
            return LM_ERR_IO;
        }
        got += (size_t)r;
    }
    close(fd);
    buf[n] = '\0';
    *out = buf;
    if (len)
        *len = n;
    return LM_OK;
}

lm_status lm_write_file(const char *path, const void *data, size_t len, lm_err *err)
{
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0)
        return lm_err_set(err, LM_ERR_IO, "%s: %s", path, strerror(errno));
    const char *p = data;
    size_t done = 0;
    while (done < len) {
        ssize_t w = write(fd, p + done, len - done);
        if (w < 0 && errno == EINTR)
            continue;
        if (w < 0) {
            lm_err_set(err, LM_ERR_IO, "%s: %s", path, strerror(errno));
            close(fd);
            return LM_ERR_IO;
        }
        done += (size_t)w;
    }
    if (close(fd) != 0)
        return lm_err_set(err, LM_ERR_IO, "%s: %s", path, strerror(errno));
    return LM_OK;
}

char *lm_path_join(const char *a, const char *b)
{
    if (!a || !*a || b[0] == '/')
        return lm_strdup(b);
    size_t la = strlen(a);
    bool slash = a[la - 1] == '/';
    return lm_strfmt("%s%s%s", a, slash ? "" : "/", b);
}

const char *lm_path_base(const char *path)
{
    const char *s = strrchr(path, '/');
    return s ? s + 1 : path;
}

char *lm_path_parent(const char *out)
{
    size_t len = strlen(out);
    while (len > 1 && out[len - 1] == '/')  // "a/b/" names "a/b"
        len--;
    size_t cut = len;
    while (cut > 0 && out[cut - 1] != '/')
        cut--;
    if (cut == 0)
        return lm_strfmt(".");
    if (cut == 1)
        return lm_strfmt("/");
    return lm_strfmt("%.*s", (int)(cut - 1), out);
}

bool lm_is_dir(const char *path)
{
    struct stat st;
    return stat(path, &st) == 0 && S_ISDIR(st.st_mode);
}

bool lm_is_file(const char *path)
{
    struct stat st;
    return stat(path, &st) == 0 && S_ISREG(st.st_mode);
}

lm_status lm_mkdir_p(const char *path, lm_err *err)
{
    char *tmp = lm_strdup(path);
    if (!tmp)
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    for (char *p = tmp + 1; ; p++) {
        if (*p == '/' || *p == '\0') {
            char c = *p;
            *p = '\0';
            if (mkdir(tmp, 0755) != 0 && errno != EEXIST) {
                lm_err_set(err, LM_ERR_IO, "%s: %s", tmp, strerror(errno));
                free(tmp);
                return LM_ERR_IO;
            }
            *p = c;
            if (c == '\0')
                break;
        }
    }
    free(tmp);
    if (!lm_is_dir(path))
        return lm_err_set(err, LM_ERR_IO, "%s: exists and is not a directory", path);
    return LM_OK;
}

lm_status lm_rm_rf(const char *path, lm_err *err)
{
    struct stat st;
    if (lstat(path, &st) != 0)
        return errno == ENOENT ? LM_OK : lm_err_set(err, LM_ERR_IO, "%s: %s", path, strerror(errno));
    if (S_ISDIR(st.st_mode)) {
        DIR *d = opendir(path);
        if (!d)
            return lm_err_set(err, LM_ERR_IO, "%s: %s", path, strerror(errno));
        struct dirent *e;
        lm_status s = LM_OK;
        while (s == LM_OK && (e = readdir(d)) != NULL) {
            if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0)
                continue;
            char *child = lm_path_join(path, e->d_name);
            if (!child) {
                s = lm_err_set(err, LM_ERR_NOMEM, "out of memory");
                break;
            }
            s = lm_rm_rf(child, err);
            free(child);
        }
        closedir(d);
        if (s != LM_OK)
            return s;
        if (rmdir(path) != 0)
            return lm_err_set(err, LM_ERR_IO, "%s: %s", path, strerror(errno));
        return LM_OK;
    }
    if (unlink(path) != 0 && errno != ENOENT)
        return lm_err_set(err, LM_ERR_IO, "%s: %s", path, strerror(errno));
    return LM_OK;
}

lm_status lm_copy_file(const char *src, const char *dst, lm_err *err)
{
    int in = open(src, O_RDONLY | O_CLOEXEC);
    if (in < 0)
        return lm_err_set(err, LM_ERR_IO, "%s: %s", src, strerror(errno));
    int outfd = open(dst, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (outfd < 0) {
        lm_err_set(err, LM_ERR_IO, "%s: %s", dst, strerror(errno));
        close(in);
        return LM_ERR_IO;
    }
    char buf[1 << 16];
    lm_status s = LM_OK;
    for (;;) {
        ssize_t r = read(in, buf, sizeof buf);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0) {
            s = lm_err_set(err, LM_ERR_IO, "%s: %s", src, strerror(errno));
            break;
        }
        if (r == 0)
            break;
        for (ssize_t done = 0; done < r;) {
            ssize_t w = write(outfd, buf + done, (size_t)(r - done));
            if (w < 0 && errno == EINTR)
                continue;
            if (w < 0) {
                s = lm_err_set(err, LM_ERR_IO, "%s: %s", dst, strerror(errno));
                break;
            }
            done += w;
        }
        if (s != LM_OK)
            break;
    }
    close(in);
    if (close(outfd) != 0 && s == LM_OK)
        s = lm_err_set(err, LM_ERR_IO, "%s: %s", dst, strerror(errno));
    return s;
}

lm_status lm_xxh64_mapped(void *state, int fd, uint64_t offset, size_t len, const char *path, lm_err *err)
{
    void *p = mmap(NULL, len, PROT_READ, MAP_PRIVATE, fd, (off_t)offset);
    if (p == MAP_FAILED)
        return lm_err_set(err, LM_ERR_IO, "%s: %s", path, strerror(errno));
    madvise(p, len, MADV_SEQUENTIAL);
    int id = lm_signals_map_add(p, len, path);  // a file truncated meanwhile: SIGBUS names it
    XXH64_update(state, p, len);
    lm_signals_map_remove(id);
    munmap(p, len);
    return LM_OK;
}

lm_status lm_xxh64_file(const char *path, uint64_t *out, lm_err *err)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return lm_err_set(err, LM_ERR_IO, "%s: %s", path, strerror(errno));
    XXH64_state_t *st = XXH64_createState();
    if (!st) {
        close(fd);
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    }
    XXH64_reset(st, 0);
    // A regular file is hashed through a mapping, in windows let go as they are done: its pages
    // are usually in the page cache already (llmerge has just read them), and reading them
    // from the mapping saves copying every byte into a buffer first.
    struct stat sb;
    if (fstat(fd, &sb) == 0 && S_ISREG(sb.st_mode) && sb.st_size > 0) {
        const size_t window = (size_t)64 << 20;
        lm_status s = LM_OK;
        for (off_t off = 0; s == LM_OK && off < sb.st_size; off += (off_t)window) {
            size_t len = (size_t)(sb.st_size - off) < window ? (size_t)(sb.st_size - off) : window;
            s = lm_xxh64_mapped(st, fd, (uint64_t)off, len, path, err);
        }
        if (s == LM_OK)
            *out = XXH64_digest(st);
        XXH64_freeState(st);
        close(fd);
        return s;
    }
    size_t cap = 1 << 20;
    char *buf = malloc(cap);
    lm_status s = LM_OK;
    if (!buf)
        s = lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    while (s == LM_OK) {
        ssize_t r = read(fd, buf, cap);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0)
            s = lm_err_set(err, LM_ERR_IO, "%s: %s", path, strerror(errno));
        if (r <= 0)
            break;
        XXH64_update(st, buf, (size_t)r);
    }
    if (s == LM_OK)
        *out = XXH64_digest(st);
    free(buf);
    XXH64_freeState(st);
    close(fd);
    return s;
}

uint64_t lm_xxh64(const void *data, size_t len)
{
    return XXH64(data, len, 0);
}

// ==== text ===================================================================================

bool lm_utf8_valid(const void *buf, size_t len)
{
    const unsigned char *s = buf;
    size_t i = 0;
    while (i < len) {
        unsigned c = s[i];
        if (c < 0x80) {
            i++;
            continue;
        }
        size_t n;
        uint32_t cp, min;
        if ((c & 0xE0) == 0xC0) { n = 1; cp = c & 0x1F; min = 0x80; }
        else if ((c & 0xF0) == 0xE0) { n = 2; cp = c & 0x0F; min = 0x800; }
        else if ((c & 0xF8) == 0xF0) { n = 3; cp = c & 0x07; min = 0x10000; }
        else return false;
        if (len - i <= n)
            return false;
        for (size_t k = 1; k <= n; k++) {
            if ((s[i + k] & 0xC0) != 0x80)
                return false;
            cp = (cp << 6) | (s[i + k] & 0x3F);
        }
        if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
            return false;
        i += n + 1;
    }
    return true;
}

char *lm_strdup(const char *s)
{
    if (!s)
        return NULL;
    size_t n = strlen(s) + 1;
    char *d = malloc(n);
    if (d)
        memcpy(d, s, n);
    return d;
}

char *lm_strfmt(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (n < 0)
        return NULL;
    char *s = malloc((size_t)n + 1);
    if (!s)
        return NULL;
    va_start(ap, fmt);
    vsnprintf(s, (size_t)n + 1, fmt, ap);
    va_end(ap);
    return s;
}

bool lm_str_ends_with(const char *s, const char *suffix)
{
    size_t a = strlen(s), b = strlen(suffix);
    return a >= b && memcmp(s + a - b, suffix, b) == 0;
}

// ==== growable text buffer ====================================================================

void lm_buf_put(lm_buf *b, const char *s, size_t n)
{
    if (b->oom)
        return;
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->len + n + 1) {
            if (cap > SIZE_MAX / 2) {
                b->oom = true;
                return;
            }
            cap *= 2;
        }
        char *p = realloc(b->p, cap);
        if (!p) {
            b->oom = true;
            return;
        }
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = '\0';
}

void lm_buf_str(lm_buf *b, const char *s)
{
    lm_buf_put(b, s, strlen(s));
}

void lm_buf_fmt(lm_buf *b, const char *fmt, ...)
{
    char tmp[256];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (n < 0 || (size_t)n >= sizeof tmp) {
        b->oom = true;
        return;
    }
    lm_buf_put(b, tmp, (size_t)n);
}

// ==== string map =============================================================================

lm_status lm_strmap_init(lm_strmap *m, size_t expected)
{
    memset(m, 0, sizeof *m);
    size_t cap = 16;
    while (cap < expected * 2 + 1)
        cap *= 2;
    m->keys = calloc(cap, sizeof *m->keys);
    m->vals = calloc(cap, sizeof *m->vals);
    if (!m->keys || !m->vals) {
        lm_strmap_free(m);
        return LM_ERR_NOMEM;
    }
    m->cap = cap;
    return LM_OK;
}

void lm_strmap_free(lm_strmap *m)
{
    free(m->keys);
    free(m->vals);
    memset(m, 0, sizeof *m);
}

static size_t strmap_slot(const lm_strmap *m, const char *key)
{
    size_t i = (size_t)XXH64(key, strlen(key), 0) & (m->cap - 1);
    while (m->keys[i] && strcmp(m->keys[i], key) != 0)
        i = (i + 1) & (m->cap - 1);
    return i;
}

int lm_strmap_put(lm_strmap *m, const char *key, int64_t val)
{
    if ((m->count + 1) * 2 > m->cap) {
        lm_strmap grown;
        if (lm_strmap_init(&grown, m->cap) != LM_OK)
            return -1;
        for (size_t i = 0; i < m->cap; i++) {
            if (m->keys[i]) {
                size_t j = strmap_slot(&grown, m->keys[i]);
                grown.keys[j] = m->keys[i];
                grown.vals[j] = m->vals[i];
                grown.count++;
            }
        }
        lm_strmap_free(m);
        *m = grown;
    }
    size_t i = strmap_slot(m, key);
    if (m->keys[i])
        return 0;
    m->keys[i] = key;
    m->vals[i] = val;
    m->count++;
    return 1;
}

int64_t lm_strmap_get(const lm_strmap *m, const char *key)
{
    if (!m->cap)
        return -1;
    size_t i = strmap_slot(m, key);
    return m->keys[i] ? m->vals[i] : -1;
}

// ==== regular files =========================================================================

const char *lm_file_kind(unsigned mode)
{
    if (S_ISREG(mode)) return "a regular file";
    if (S_ISDIR(mode)) return "a directory";
    if (S_ISFIFO(mode)) return "a FIFO";
    if (S_ISSOCK(mode)) return "a socket";
    if (S_ISCHR(mode)) return "a character device";
    if (S_ISBLK(mode)) return "a block device";
    return "a special file";
}

static lm_status not_regular(const char *path, unsigned mode, lm_err *err)
{
    return lm_err_set(err, LM_ERR_USAGE, "%s is %s, not a regular file", path, lm_file_kind(mode));
}

lm_status lm_open_regular(const char *path, int *fd, lm_err *err)
{
    *fd = -1;
    struct stat st;
    if (stat(path, &st) != 0)
        return lm_err_set(err, errno == ENOENT ? LM_ERR_NOT_FOUND : LM_ERR_IO, "%s: %s", path, strerror(errno));
    if (!S_ISREG(st.st_mode))
        return not_regular(path, st.st_mode, err);
    int f = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (f < 0)
        return lm_err_set(err, errno == ENOENT ? LM_ERR_NOT_FOUND : LM_ERR_IO, "%s: %s", path, strerror(errno));
    int flags;
    if (fstat(f, &st) != 0 || (flags = fcntl(f, F_GETFL)) < 0 || fcntl(f, F_SETFL, flags & ~O_NONBLOCK) != 0) {
        lm_err_set(err, LM_ERR_IO, "%s: %s", path, strerror(errno));
        close(f);
        return LM_ERR_IO;
    }
    if (!S_ISREG(st.st_mode)) {
        close(f);
        return not_regular(path, st.st_mode, err);
    }
    *fd = f;
    return LM_OK;
}
