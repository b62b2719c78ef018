// The safetensors writer: see st_writer.h. A writer plans the shards, computes every tensor's
// place in its shard file, and writes each shard's header (and sets the file to its final
// length) before any data arrives; after that a tensor's bytes go straight to their offset,
// in any order and from several threads at once. The writer keeps, per tensor, the byte ranges
// written so far, so a part written twice or past the tensor's end is refused and finish can
// name a tensor that is still incomplete.
//
// Tensor data goes to the files with direct I/O (O_DIRECT) from a writer thread of its own.
// A buffered pwrite copies every byte into freshly allocated page-cache pages on the caller's
// thread: for a 2.5 GB output that cost 1.5 to 6 s of system CPU, on the merge's critical path
// (the merge computes a piece, writes it, waits, computes the next). Direct writes go to the
// disk from the writer's own page-aligned buffers (dd with oflag=direct wrote 2.4 GB in 1.1 s
// with 0.2 s of system time on the same machine), and the caller only copies into those
// buffers, which are reused. How the bytes travel:
//   - a tensor at file range [F, F + nbytes) has the interior [A, Z): F rounded up and
//     F + nbytes rounded down to DIO_ALIGN. The interior is cut into blocks of DIO_BLOCK bytes
//     from A (the last one shorter, still whole pages);
//   - put_part copies the bytes of a part that fall in a block into that block's aligned
//     buffer (the copy outside the mutex: parts never overlap, so copies into one block do
//     not either); the thread whose copy completes a block queues it, and the writer thread
//     writes queued blocks, oldest first, with pwrite on the shard's O_DIRECT descriptor;
//   - bytes outside the interior (each tensor's first and last partial pages, and all of a
//     tensor that spans no whole page) are written by put_part with a buffered pwrite, as
//     before. Buffered and direct writes therefore never share a page and never interfere;
//   - buffers are reused; put_part waits for one when DIO_SOFT_CAP are in use and the writer
//     thread has work that will free one, and otherwise allocates another (every buffer may
//     be a block still waiting for a part that another thread holds: waiting could deadlock);
//   - LLMERGE_DIRECT_IO=0 in the environment (read when the writer opens) writes everything
//     buffered. So does a filesystem that refuses O_DIRECT when the shard is opened a second
//     time with it; one that accepts the open but then refuses a direct write with EINVAL
//     gets that block written buffered, and everything after it too;
//   - any other failure of a direct write (ENOSPC, EFBIG, EIO) is recorded: every later
//     put_part, and finish, returns LM_ERR_IO "PATH: writing tensor data at byte N: REASON";
//   - a testing aid: LLMERGE_TEST_DIRECT_IO_FAIL=EINVAL or =ENOSPC (read when the writer opens)
//     makes the first direct write fail with that errno without writing anything, so that the
//     fallback and the late error can be tested.
//
// Decisions beyond the reference:
//   - zero tensors: the reference writes no file at all; llmerge writes one
//     model.safetensors holding only __metadata__, so the output is still a loadable model
//     file;
//   - __metadata__ keys are written sorted (the reference serialises a hash map, in no fixed
//     order), with "format": "pt" added unless the caller gives a "format";
//   - names and metadata must be valid UTF-8 (a Rust String always is) and tensor names
//     unique and not "__metadata__", so every file written reads back with lm_st_open;
//   - a zero-byte part is accepted and does nothing; parts of one tensor may arrive in any
//     order, but may not overlap;
//   - put and put_part may be called from several threads at once (the bookkeeping is under a
//     mutex, the copies and buffered writes outside it); finish must come after every put has
//     returned.
#define _GNU_SOURCE  // O_DIRECT
#include "st_writer.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define ST_INDEX_NAME "model.safetensors.index.json"
#define ST_NAME_MAX 64  // room for "model-00001-of-00003.safetensors"

#define DIO_ALIGN 4096u         // offsets, lengths and buffer addresses of direct writes
#define DIO_BLOCK (2u << 20)    // bytes of a direct write (a tensor's last block may be shorter)
#define DIO_SOFT_CAP 8          // buffers before put_part waits for the writer thread to free one

// ==== JSON strings ===========================================================================

// A JSON string as serde_json writes it (the reference's header): `"` and `\` escaped, the
// short escapes \b \f \n \r \t, other control characters as \u00xx, every other byte as is.
static void buf_json_serde(lm_buf *b, const char *s)
{
    static const char hex[] = "0123456789abcdef";
    lm_buf_put(b, "\"", 1);
    const unsigned char *p = (const unsigned char *)s;
    size_t run = 0;  // bytes before p[run] not yet copied
    for (;; p++) {
        unsigned c = *p;
        if (c == 0)
            break;
        const char *esc = NULL;
        char u[7];
        switch (c) {
        case '"': esc = "\\\""; break;
        case '\\': esc = "\\\\"; break;
        case '\b': esc = "\\b"; break;
        case '\f': esc = "\\f"; break;
        case '\n': esc = "\\n"; break;
        case '\r': esc = "\\r"; break;
        case '\t': esc = "\\t"; break;
        default:
            if (c < 0x20) {
                u[0] = '\\', u[1] = 'u', u[2] = '0', u[3] = '0';
                u[4] = hex[c >> 4], u[5] = hex[c & 15], u[6] = '\0';
                esc = u;
            }
        }
        if (esc) {
            lm_buf_put(b, (const char *)p - run, run);
            lm_buf_str(b, esc);
            run = 0;
        } else {
            run++;
        }
    }
    lm_buf_put(b, (const char *)p - run, run);
    lm_buf_put(b, "\"", 1);
}

// A JSON string as Python's json.dumps writes it by default (ensure_ascii): as serde_json for
// `"`, `\` and the short escapes, and every other byte outside ' '..'~' as \uxxxx of its code
// point, with a surrogate pair above U+FFFF. `s` must be valid UTF-8.
static void buf_json_python(lm_buf *b, const char *s)
{
    static const char hex[] = "0123456789abcdef";
    lm_buf_put(b, "\"", 1);
    const unsigned char *p = (const unsigned char *)s;
    while (*p) {
        unsigned c = *p;
        const char *esc = NULL;
        switch (c) {
        case '"': esc = "\\\""; break;
        case '\\': esc = "\\\\"; break;
        case '\b': esc = "\\b"; break;
        case '\f': esc = "\\f"; break;
        case '\n': esc = "\\n"; break;
        case '\r': esc = "\\r"; break;
        case '\t': esc = "\\t"; break;
        }
        if (esc) {
            lm_buf_str(b, esc);
            p++;
            continue;
        }
        if (c >= 0x20 && c < 0x7F) {
            lm_buf_put(b, (const char *)p, 1);
            p++;
            continue;
        }
        uint32_t cp;
        int extra;
        if (c < 0x80) { cp = c; extra = 0; }
        else if ((c & 0xE0) == 0xC0) { cp = c & 0x1F; extra = 1; }
        else if ((c & 0xF0) == 0xE0) { cp = c & 0x0F; extra = 2; }
        else { cp = c & 0x07; extra = 3; }
        p++;
        for (int k = 0; k < extra && *p; k++, p++)
            cp = (cp << 6) | (*p & 0x3Fu);
        uint32_t units[2];
        int nu = 0;
        if (cp >= 0x10000) {
            cp -= 0x10000;
            units[nu++] = 0xD800 | (cp >> 10);
            units[nu++] = 0xDC00 | (cp & 0x3FF);
        } else {
            units[nu++] = cp;
        }
        for (int k = 0; k < nu; k++) {
            char u[6] = {'\\', 'u', hex[(units[k] >> 12) & 15], hex[(units[k] >> 8) & 15],
                         hex[(units[k] >> 4) & 15], hex[units[k] & 15]};
            lm_buf_put(b, u, 6);
        }
    }
    lm_buf_put(b, "\"", 1);
}

// ==== sizes and the shard plan ================================================================

// Sets *out to the bytes of tensor `t` (numel * bits / 8), refusing overflow, negative or
// too many dimensions, unknown dtypes and a bit count that is not whole bytes.
static lm_status desc_bytes(const lm_st_desc *t, uint64_t *out, lm_err *err)
{
    const char *name = t->name ? t->name : "(null)";
    if (!t->name)
        return lm_err_set(err, LM_ERR_USAGE, "tensor with no name");
    if ((unsigned)t->dtype >= LM_DTYPE_COUNT)
        return lm_err_set(err, LM_ERR_UNSUPPORTED, "tensor '%s': unknown dtype %d", name,
                          (int)t->dtype);
    if (t->ndim < 0 || t->ndim > LM_ST_MAX_DIMS)
        return lm_err_set(err, LM_ERR_USAGE, "tensor '%s': %d dimensions (0 to %d allowed)",
                          name, t->ndim, LM_ST_MAX_DIMS);
    uint64_t bits = lm_dtype_bits(t->dtype);
    for (int d = 0; d < t->ndim; d++) {
        if (t->shape[d] < 0)
            return lm_err_set(err, LM_ERR_USAGE, "tensor '%s': dimension %d is negative (%lld)",
                              name, d, (long long)t->shape[d]);
        if (!lm_mul_u64(bits, (uint64_t)t->shape[d], &bits))
            return lm_err_set(err, LM_ERR_USAGE, "tensor '%s': size overflows 64 bits", name);
    }
    if (bits % 8 != 0)
        return lm_err_set(err, LM_ERR_USAGE,
                          "tensor '%s': %llu bits of %s is not a whole number of bytes", name,
                          (unsigned long long)bits, lm_dtype_name(t->dtype));
    *out = bits / 8;
    return LM_OK;
}

lm_status lm_shard_plan_make(lm_shard_plan *plan, const lm_st_desc *tensors, int64_t n,
                             uint64_t max_shard_size, lm_err *err)
{
    memset(plan, 0, sizeof *plan);
    int64_t *pending = NULL;  // (n) tensors of the shard being filled, not yet numbered
    lm_status s = LM_OK;
    if (n < 0 || (n > 0 && !tensors))
        return lm_err_set(err, LM_ERR_USAGE, "shard plan: bad tensor list (%lld tensors)",
                          (long long)n);
    if ((uint64_t)n >= (uint64_t)INT32_MAX)
        return lm_err_set(err, LM_ERR_USAGE, "shard plan: %lld tensors is too many",
                          (long long)n);
    plan->n_tensors = n;
    plan->shard_of = calloc((size_t)n + 1, sizeof *plan->shard_of);
    plan->shard_bytes = calloc((size_t)n + 1, sizeof *plan->shard_bytes);
    pending = calloc((size_t)n + 1, sizeof *pending);
    if (!plan->shard_of || !plan->shard_bytes || !pending) {
        s = lm_err_set(err, LM_ERR_NOMEM, "shard plan: out of memory for %lld tensors",
                       (long long)n);
        goto fail;
    }

    // huggingface_hub's split_state_dict_into_shards_factory: the shard being filled joins
    // the list only when it is closed, so a tensor too large for any shard, which joins at
    // once, is numbered before it.
    int64_t n_pending = 0;
    uint64_t cur_size = 0;
    for (int64_t i = 0; i < n; i++) {
        uint64_t size;
        s = desc_bytes(&tensors[i], &size, err);
        if (s != LM_OK)
            goto fail;
        if (!lm_add_u64(plan->total_size, size, &plan->total_size)) {
            s = lm_err_set(err, LM_ERR_USAGE, "shard plan: total size overflows 64 bits");
            goto fail;
        }
        if (size > max_shard_size) {
            plan->shard_of[i] = plan->n_shards;
            plan->shard_bytes[plan->n_shards++] = size;
            continue;
        }
        uint64_t grown;
        if (n_pending > 0 && (!lm_add_u64(cur_size, size, &grown) || grown > max_shard_size)) {
            for (int64_t k = 0; k < n_pending; k++)
                plan->shard_of[pending[k]] = plan->n_shards;
            plan->shard_bytes[plan->n_shards++] = cur_size;
            n_pending = 0;
            cur_size = 0;
        }
        pending[n_pending++] = i;
        cur_size += size;  // cannot overflow: checked above, or the shard was just emptied
    }
    if (n_pending > 0 || plan->n_shards == 0) {
        // the last shard; with no tensors at all, one empty shard (see the top of the file)
        for (int64_t k = 0; k < n_pending; k++)
            plan->shard_of[pending[k]] = plan->n_shards;
        plan->shard_bytes[plan->n_shards++] = cur_size;
    }
    free(pending);
    return LM_OK;

fail:
    free(pending);
    lm_shard_plan_free(plan);
    return s;
}

void lm_shard_plan_free(lm_shard_plan *plan)
{
    if (!plan)
        return;
    free(plan->shard_of);
    free(plan->shard_bytes);
    memset(plan, 0, sizeof *plan);
}

char *lm_shard_name(char *buf, size_t cap, int idx, int n)
{
    if (n == 1)
        snprintf(buf, cap, "model.safetensors");
    else
        snprintf(buf, cap, "model-%05d-of-%05d.safetensors", idx + 1, n);
    return buf;
}

// ==== the writer ==============================================================================

typedef struct st_span {
    uint64_t begin, end;  // bytes of the tensor, end exclusive
} st_span;

typedef struct st_slot {
    uint64_t nbytes;    // the tensor's size
    uint64_t file_off;  // where its data starts in its shard file
    st_span *spans;     // (n_spans) written ranges: sorted, disjoint, never touching
    int64_t n_spans, cap_spans;
    uint64_t written;   // sum of the spans
} st_slot;

typedef enum st_block_state {
    ST_BLOCK_FREE,     // a spare buffer
    ST_BLOCK_OPEN,     // being filled by put_part
    ST_BLOCK_QUEUED,   // complete, waiting for the writer thread
    ST_BLOCK_WRITING,  // the writer thread is writing it
} st_block_state;

// A direct write being assembled: the bytes of file range [off, off + len) of one shard.
typedef struct st_block {
    unsigned char *buf;     // (DIO_BLOCK) DIO_ALIGN-aligned
    st_block_state state;
    int shard;
    uint64_t off, len;      // multiples of DIO_ALIGN
    uint64_t filled;        // bytes copied in; the block is complete at len
    struct st_block *next;  // the next in the writer thread's queue
} st_block;

struct lm_st_writer {
    char *dir;
    lm_st_desc *tensors;  // (n) a copy of the caller's array (names not copied)
    int64_t n;
    lm_shard_plan plan;
    st_slot *slots;       // (n)
    char **paths;         // (plan.n_shards) each shard file's path
    int *fds;             // (plan.n_shards) -1 once closed
    pthread_mutex_t lock; // guards slots, the failure, finished and the blocks below
    bool lock_ok;
    bool failed;          // a write failed: the files are not to be trusted
    int failed_shard;     // where it failed: shard, errno and file offset
    int failed_errno;
    uint64_t failed_off;
    bool finished;

    // direct I/O (see the top of the file)
    int *dfds;             // (plan.n_shards) O_DIRECT descriptors, -1 when none
    bool thread_ok;        // the writer thread runs: tensor interiors go through blocks
    bool direct;           // blocks are written with direct I/O (false after an EINVAL)
    pthread_t thread;
    pthread_cond_t queued; // signalled when a block joins the queue, or the thread is to stop
    pthread_cond_t freed;  // broadcast when the writer thread lets a block go
    bool conds_ok;
    st_block **blocks;     // (n_blocks) every buffer, in whatever state
    int n_blocks, cap_blocks;
    st_block *queue, *queue_tail;  // complete blocks, oldest first
    bool busy;             // the writer thread holds a block
    bool stop;             // the writer thread is to exit
    int test_fail;         // errno for the first direct write (LLMERGE_TEST_DIRECT_IO_FAIL), or 0
};

typedef struct st_order {
    const lm_st_desc *d;
    int64_t idx;
} st_order;

// The reference's order within a file: dtype descending, then name.
static int cmp_order(const void *pa, const void *pb)
{
    const st_order *a = pa, *b = pb;
    if (a->d->dtype != b->d->dtype)
        return a->d->dtype > b->d->dtype ? -1 : 1;
    int c = strcmp(a->d->name, b->d->name);
    if (c != 0)
        return c;
    return a->idx < b->idx ? -1 : a->idx > b->idx;
}

static int cmp_str(const void *pa, const void *pb)
{
    return strcmp(*(const char *const *)pa, *(const char *const *)pb);
}

// Writes all `len` bytes at `off` of `fd`, retrying short writes. Returns 0 or an errno, and
// then sets *at (when not NULL) to the file offset the failed write started at.
static int pwrite_all(int fd, const void *data, uint64_t len, uint64_t off, uint64_t *at)
{
    const char *p = data;
    while (len > 0) {
        size_t chunk = len > (1u << 30) ? (1u << 30) : (size_t)len;
        ssize_t w = pwrite(fd, p, chunk, (off_t)off);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0) {
            if (at)
                *at = off;
            return w < 0 ? errno : EIO;
        }
        p += w;
        off += (uint64_t)w;
        len -= (uint64_t)w;
    }
    return 0;
}

// Checks the NULL-terminated key, value list `meta` and sets *keys_out and *vals_out to new
// arrays (caller frees both; the strings stay the caller's) of its *count entries sorted by
// key, with "format": "pt" added when no "format" is given.
static lm_status meta_sorted(const char *const *meta, const char ***keys_out, const char ***vals_out,
                             int64_t *count, lm_err *err)
{
    *keys_out = NULL;
    *vals_out = NULL;
    *count = 0;
    int64_t n = 0;
    bool has_format = false;
    for (; meta && meta[2 * n]; n++) {
        if (!meta[2 * n + 1])
            return lm_err_set(err, LM_ERR_USAGE, "__metadata__ key '%s' has no value", meta[2 * n]);
        if (strcmp(meta[2 * n], "format") == 0)
            has_format = true;
    }
    int64_t total = n + (has_format ? 0 : 1);
    const char **pairs = calloc((size_t)total, 2 * sizeof *pairs);  // key, value, key, ...
    if (!pairs)
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory for __metadata__");
    for (int64_t i = 0; i < n; i++) {
        for (int k = 0; k < 2; k++) {
            const char *s = meta[2 * i + k];
            if (!lm_utf8_valid(s, strlen(s))) {
                free(pairs);
                return lm_err_set(err, LM_ERR_USAGE, "__metadata__ %s '%s' is not valid UTF-8",
                                  k ? "value" : "key", s);
            }
        }
        pairs[2 * i] = meta[2 * i];
        pairs[2 * i + 1] = meta[2 * i + 1];
    }
    if (!has_format) {
        pairs[2 * n] = "format";
        pairs[2 * n + 1] = "pt";
    }
    // sort the pairs by key: as units of two pointers, comparing the first
    qsort(pairs, (size_t)total, 2 * sizeof *pairs, cmp_str);
    for (int64_t i = 1; i < total; i++) {
        if (strcmp(pairs[2 * i], pairs[2 * i - 2]) == 0) {
            lm_err_set(err, LM_ERR_USAGE, "__metadata__ key '%s' given twice", pairs[2 * i]);
            free(pairs);
            return LM_ERR_USAGE;
        }
    }
    const char **keys = malloc((size_t)total * sizeof *keys);
    const char **vals = malloc((size_t)total * sizeof *vals);
    if (!keys || !vals) {
        free(keys);
        free(vals);
        free(pairs);
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory for __metadata__");
    }
    for (int64_t i = 0; i < total; i++) {
        keys[i] = pairs[2 * i];
        vals[i] = pairs[2 * i + 1];
    }
    free(pairs);
    *keys_out = keys;
    *vals_out = vals;
    *count = total;
    return LM_OK;
}

// Builds shard `sh`'s header (padded, without the 8-byte length) into *hb, and sets each of
// its tensors' file offsets. `order` holds the shard's tensors, already sorted.
static lm_status build_header(lm_st_writer *w, const st_order *order, int64_t count,
                              const char **mkeys, const char **mvals, int64_t n_meta,
                              lm_buf *hb, lm_err *err)
{
    lm_buf_str(hb, "{\"__metadata__\":{");
    for (int64_t i = 0; i < n_meta; i++) {
        if (i)
            lm_buf_put(hb, ",", 1);
        buf_json_serde(hb, mkeys[i]);
        lm_buf_put(hb, ":", 1);
        buf_json_serde(hb, mvals[i]);
    }
    lm_buf_put(hb, "}", 1);
    uint64_t off = 0;
    for (int64_t k = 0; k < count; k++) {
        const lm_st_desc *d = order[k].d;
        st_slot *slot = &w->slots[order[k].idx];
        lm_buf_put(hb, ",", 1);
        buf_json_serde(hb, d->name);
        lm_buf_fmt(hb, ":{\"dtype\":\"%s\",\"shape\":[", lm_dtype_name(d->dtype));
        for (int j = 0; j < d->ndim; j++)
            lm_buf_fmt(hb, j ? ",%lld" : "%lld", (long long)d->shape[j]);
        lm_buf_fmt(hb, "],\"data_offsets\":[%llu,%llu]}", (unsigned long long)off,
                (unsigned long long)(off + slot->nbytes));
        slot->file_off = off;  // made absolute by the caller once the header length is known
        off += slot->nbytes;
    }
    lm_buf_put(hb, "}", 1);
    while (hb->len % 8 != 0)
        lm_buf_put(hb, " ", 1);
    if (hb->oom)
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory building a safetensors header");
    return LM_OK;
}

// Creates shard file `sh` at w->paths[sh] (exclusively when `excl`), sized to its final
// length, with its header in place.
static lm_status open_shard(lm_st_writer *w, int sh, const st_order *order, int64_t count,
                            const char **mkeys, const char **mvals, int64_t n_meta, bool excl,
                            lm_err *err)
{
    lm_buf hb = {0};
    const char *path = w->paths[sh];
    lm_status s = build_header(w, order, count, mkeys, mvals, n_meta, &hb, err);
    if (s != LM_OK)
        goto fail;
    if (hb.len > LM_ST_MAX_HEADER) {
        s = lm_err_set(err, LM_ERR_USAGE, "%s: header of %zu bytes is over the %llu allowed",
                       path, hb.len, LM_ST_MAX_HEADER);
        goto fail;
    }
    uint64_t file_size = 8 + (uint64_t)hb.len;
    if (!lm_add_u64(file_size, w->plan.shard_bytes[sh], &file_size) || file_size > INT64_MAX) {
        s = lm_err_set(err, LM_ERR_USAGE, "%s: file size overflows", path);
        goto fail;
    }
    for (int64_t k = 0; k < count; k++)
        w->slots[order[k].idx].file_off += 8 + (uint64_t)hb.len;

    int flags = O_WRONLY | O_CREAT | O_CLOEXEC | (excl ? O_EXCL : O_TRUNC);
    w->fds[sh] = open(path, flags, 0644);
    if (w->fds[sh] < 0) {
        s = lm_err_set(err, LM_ERR_IO, "%s: %s", path, strerror(errno));
        goto fail;
    }
    if (ftruncate(w->fds[sh], (off_t)file_size) != 0) {
        s = lm_err_set(err, LM_ERR_IO, "%s: setting its size to %llu bytes: %s", path,
                       (unsigned long long)file_size, strerror(errno));
        goto fail;
    }
    unsigned char len8[8];
    for (int i = 0; i < 8; i++)
        len8[i] = (unsigned char)((uint64_t)hb.len >> (8 * i));
    int e = pwrite_all(w->fds[sh], len8, 8, 0, NULL);
    if (!e)
        e = pwrite_all(w->fds[sh], hb.p, hb.len, 8, NULL);
    if (e) {
        s = lm_err_set(err, LM_ERR_IO, "%s: writing the header: %s", path, strerror(e));
        goto fail;
    }
    free(hb.p);
    return LM_OK;

fail:
    if (excl && w->fds[sh] >= 0) {  // a file this call created exclusively is this call's
        close(w->fds[sh]);
        w->fds[sh] = -1;
        unlink(path);
    }
    free(hb.p);
    return s;
}

// ==== direct I/O: blocks and the writer thread ================================================

static uint64_t align_down(uint64_t x)
{
    return x / DIO_ALIGN * DIO_ALIGN;
}

static uint64_t align_up(uint64_t x)  // x is a file offset, far below UINT64_MAX
{
    return align_down(x + DIO_ALIGN - 1);
}

// Records the writer's first failure (w->lock held): errno `e` writing shard sh at file offset
// `off`. Every later put and finish report it.
static void note_failure(lm_st_writer *w, int sh, int e, uint64_t off)
{
    if (w->failed)
        return;
    w->failed = true;
    w->failed_shard = sh;
    w->failed_errno = e;
    w->failed_off = off;
}

// Sets `err` to the recorded failure and returns its status (w->lock held, or every other
// thread done with the writer).
static lm_status failure_err(const lm_st_writer *w, lm_err *err)
{
    return lm_err_set(err, w->failed_errno == ENOMEM ? LM_ERR_NOMEM : LM_ERR_IO,
                      "%s: writing tensor data at byte %llu: %s", w->paths[w->failed_shard],
                      (unsigned long long)w->failed_off, strerror(w->failed_errno));
}

// The writer thread: writes queued blocks, oldest first, until told to stop.
static void *writer_thread(void *arg)
{
    lm_st_writer *w = arg;
    pthread_mutex_lock(&w->lock);
    for (;;) {
        while (!w->queue && !w->stop)
            pthread_cond_wait(&w->queued, &w->lock);
        if (w->stop)
            break;
        st_block *b = w->queue;
        w->queue = b->next;
        if (!w->queue)
            w->queue_tail = NULL;
        b->state = ST_BLOCK_WRITING;
        w->busy = true;
        bool write = !w->failed;  // after a failure the output is lost: let blocks go unwritten
        bool direct = w->direct;
        int fake = 0;
        if (write && direct) {
            fake = w->test_fail;
            w->test_fail = 0;
        }
        pthread_mutex_unlock(&w->lock);

        int e = 0;
        uint64_t at = b->off;
        bool fell_back = false;
        if (write && direct) {
            e = fake ? fake : pwrite_all(w->dfds[b->shard], b->buf, b->len, b->off, &at);
            // the filesystem took the O_DIRECT open but refuses the write: this block and
            // everything after it go through the page cache
            fell_back = e == EINVAL;
        }
        if (write && (!direct || fell_back))
            e = pwrite_all(w->fds[b->shard], b->buf, b->len, b->off, &at);

        pthread_mutex_lock(&w->lock);
        if (fell_back)
            w->direct = false;
        if (e)
            note_failure(w, b->shard, e, at);
        b->state = ST_BLOCK_FREE;
        w->busy = false;
        pthread_cond_broadcast(&w->freed);
    }
    pthread_mutex_unlock(&w->lock);
    return NULL;
}

// Opens each shard a second time with O_DIRECT and starts the writer thread, unless
// LLMERGE_DIRECT_IO=0 or no tensor spans a whole page. Leaves the writer writing everything
// buffered when the filesystem refuses O_DIRECT or the thread cannot start: direct I/O only
// saves time, so neither is an error.
static void direct_start(lm_st_writer *w)
{
    const char *env = getenv("LLMERGE_DIRECT_IO");
    if (env && strcmp(env, "0") == 0)
        return;
    bool any = false;
    for (int64_t i = 0; i < w->n && !any; i++) {
        const st_slot *slot = &w->slots[i];
        any = align_up(slot->file_off) < align_down(slot->file_off + slot->nbytes);
    }
    if (!any)
        return;
    for (int sh = 0; sh < w->plan.n_shards; sh++) {
        w->dfds[sh] = open(w->paths[sh], O_WRONLY | O_DIRECT | O_CLOEXEC);
        if (w->dfds[sh] < 0)
            goto buffered;
    }
    const char *fail = getenv("LLMERGE_TEST_DIRECT_IO_FAIL");
    if (fail && strcmp(fail, "EINVAL") == 0)
        w->test_fail = EINVAL;
    else if (fail && strcmp(fail, "ENOSPC") == 0)
        w->test_fail = ENOSPC;
    w->direct = true;
    if (pthread_create(&w->thread, NULL, writer_thread, w) == 0) {
        w->thread_ok = true;
        return;
    }
    w->direct = false;
buffered:
    for (int sh = 0; sh < w->plan.n_shards; sh++) {
        if (w->dfds[sh] >= 0)
            close(w->dfds[sh]);
        w->dfds[sh] = -1;
    }
}

// Stops and joins the writer thread, if it runs: with `drain`, once it has written every
// queued block; otherwise after the block it is writing (the output is being thrown away).
static void direct_stop(lm_st_writer *w, bool drain)
{
    if (!w->thread_ok)
        return;
    pthread_mutex_lock(&w->lock);
    while (drain && (w->queue || w->busy))
        pthread_cond_wait(&w->freed, &w->lock);
    w->stop = true;
    pthread_cond_signal(&w->queued);
    pthread_mutex_unlock(&w->lock);
    pthread_join(w->thread, NULL);
    w->thread_ok = false;
}

// Adds a new free buffer to w->blocks and returns it (w->lock held; the writer owns it and
// frees it in lm_st_writer_free). NULL when memory runs out.
static st_block *block_new(lm_st_writer *w)
{
    if (w->n_blocks == w->cap_blocks) {
        int cap = w->cap_blocks ? 2 * w->cap_blocks : DIO_SOFT_CAP;
        st_block **bs = realloc(w->blocks, (size_t)cap * sizeof *bs);
        if (!bs)
            return NULL;
        w->blocks = bs;
        w->cap_blocks = cap;
    }
    st_block *b = calloc(1, sizeof *b);
    unsigned char *buf = aligned_alloc(DIO_ALIGN, DIO_BLOCK);
    if (!b || !buf) {
        free(b);
        free(buf);
        return NULL;
    }
    b->buf = buf;
    b->state = ST_BLOCK_FREE;
    w->blocks[w->n_blocks++] = b;
    return b;
}

// Sets *out to the open block for file range [off, off + len) of shard sh, starting it in a
// free buffer if there is none (w->lock not held). Sets *out to NULL, for the caller to write
// its bytes buffered, when the writer has gone back to buffered writes and no block holds the
// range. Fails with the recorded failure once a write has failed, or when memory runs out.
static lm_status block_get(lm_st_writer *w, int sh, uint64_t off, uint64_t len, st_block **out,
                           lm_err *err)
{
    *out = NULL;
    lm_status s = LM_OK;
    pthread_mutex_lock(&w->lock);
    for (;;) {
        if (w->failed) {
            s = failure_err(w, err);
            break;
        }
        st_block *spare = NULL;
        for (int i = 0; i < w->n_blocks && !*out; i++) {
            st_block *b = w->blocks[i];
            if (b->state == ST_BLOCK_OPEN && b->shard == sh && b->off == off)
                *out = b;
            else if (b->state == ST_BLOCK_FREE && !spare)
                spare = b;
        }
        if (*out || !w->direct)
            break;
        if (!spare && w->n_blocks < DIO_SOFT_CAP)
            spare = block_new(w);
        if (!spare && (w->queue || w->busy)) {  // the writer thread will free one
            pthread_cond_wait(&w->freed, &w->lock);
            continue;
        }
        // every buffer is a block still being filled, perhaps waiting for a part that the
        // caller of another thread holds: waiting could deadlock, so go past the cap
        if (!spare)
            spare = block_new(w);
        if (!spare) {
            note_failure(w, sh, ENOMEM, off);
            s = failure_err(w, err);
            break;
        }
        spare->state = ST_BLOCK_OPEN;
        spare->shard = sh;
        spare->off = off;
        spare->len = len;
        spare->filled = 0;
        *out = spare;
        break;
    }
    pthread_mutex_unlock(&w->lock);
    return s;
}

// Counts n more bytes copied into open block b; the caller whose bytes complete it hands it to
// the writer thread.
static void block_add(lm_st_writer *w, st_block *b, uint64_t n)
{
    pthread_mutex_lock(&w->lock);
    b->filled += n;
    if (b->filled == b->len) {
        b->state = ST_BLOCK_QUEUED;
        b->next = NULL;
        if (w->queue_tail)
            w->queue_tail->next = b;
        else
            w->queue = b;
        w->queue_tail = b;
        pthread_cond_signal(&w->queued);
    }
    pthread_mutex_unlock(&w->lock);
}

// ==== opening, writing, finishing =============================================================

// The writer behind lm_st_writer_open and lm_st_write_file: with `single_path` set, everything
// goes into that one file (created exclusively), whatever the shard size.
static lm_status writer_open(lm_st_writer **out, const char *dir, const char *single_path,
                             const lm_st_desc *tensors, int64_t n, uint64_t max_shard_size,
                             const char *const *meta, lm_err *err)
{
    *out = NULL;
    lm_st_writer *w = calloc(1, sizeof *w);
    st_order *order = NULL;
    const char **mkeys = NULL, **mvals = NULL;
    lm_strmap names = {0};
    lm_status s;
    if (!w)
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory");

    s = lm_shard_plan_make(&w->plan, tensors, n, single_path ? UINT64_MAX : max_shard_size, err);
    if (s != LM_OK)
        goto fail;
    w->n = n;
    w->dir = lm_strdup(single_path ? "" : dir);
    w->tensors = calloc((size_t)n + 1, sizeof *w->tensors);
    w->slots = calloc((size_t)n + 1, sizeof *w->slots);
    w->paths = calloc((size_t)w->plan.n_shards, sizeof *w->paths);
    w->fds = malloc((size_t)w->plan.n_shards * sizeof *w->fds);
    w->dfds = malloc((size_t)w->plan.n_shards * sizeof *w->dfds);
    order = calloc((size_t)n + 1, sizeof *order);
    if (!w->dir || !w->tensors || !w->slots || !w->paths || !w->fds || !w->dfds || !order) {
        s = lm_err_set(err, LM_ERR_NOMEM, "out of memory for %lld tensors", (long long)n);
        goto fail;
    }
    for (int i = 0; i < w->plan.n_shards; i++)
        w->fds[i] = w->dfds[i] = -1;
    if (pthread_mutex_init(&w->lock, NULL) != 0) {
        s = lm_err_set(err, LM_ERR_NOMEM, "cannot create a mutex");
        goto fail;
    }
    w->lock_ok = true;
    if (pthread_cond_init(&w->queued, NULL) != 0) {
        s = lm_err_set(err, LM_ERR_NOMEM, "cannot create a condition variable");
        goto fail;
    }
    if (pthread_cond_init(&w->freed, NULL) != 0) {
        pthread_cond_destroy(&w->queued);
        s = lm_err_set(err, LM_ERR_NOMEM, "cannot create a condition variable");
        goto fail;
    }
    w->conds_ok = true;
    if (n > 0)
        memcpy(w->tensors, tensors, (size_t)n * sizeof *tensors);

    // names: unique, not the metadata key, valid UTF-8 (so the file reads back)
    if (lm_strmap_init(&names, (size_t)n) != LM_OK) {
        s = lm_err_set(err, LM_ERR_NOMEM, "out of memory for %lld tensors", (long long)n);
        goto fail;
    }
    for (int64_t i = 0; i < n; i++) {
        const char *name = w->tensors[i].name;
        if (strcmp(name, "__metadata__") == 0) {
            s = lm_err_set(err, LM_ERR_USAGE, "a tensor may not be called __metadata__");
            goto fail;
        }
        if (!lm_utf8_valid(name, strlen(name))) {
            s = lm_err_set(err, LM_ERR_USAGE, "tensor name '%s' is not valid UTF-8", name);
            goto fail;
        }
        int r = lm_strmap_put(&names, name, i);
        if (r < 0) {
            s = lm_err_set(err, LM_ERR_NOMEM, "out of memory for %lld tensors", (long long)n);
            goto fail;
        }
        if (r == 0) {
            s = lm_err_set(err, LM_ERR_USAGE, "tensor '%s' given twice", name);
            goto fail;
        }
        s = desc_bytes(&w->tensors[i], &w->slots[i].nbytes, err);  // checked by the plan
        if (s != LM_OK)
            goto fail;
    }
    int64_t n_meta;
    s = meta_sorted(meta, &mkeys, &mvals, &n_meta, err);
    if (s != LM_OK)
        goto fail;

    for (int sh = 0; sh < w->plan.n_shards; sh++) {
        if (single_path) {
            w->paths[sh] = lm_strdup(single_path);
        } else {
            char name[ST_NAME_MAX];
            w->paths[sh] = lm_path_join(dir, lm_shard_name(name, sizeof name, sh, w->plan.n_shards));
        }
        if (!w->paths[sh]) {
            s = lm_err_set(err, LM_ERR_NOMEM, "out of memory");
            goto fail;
        }
        int64_t count = 0;
        for (int64_t i = 0; i < n; i++) {
            if (w->plan.shard_of[i] == sh)
                order[count++] = (st_order){&w->tensors[i], i};
        }
        qsort(order, (size_t)count, sizeof *order, cmp_order);
        s = open_shard(w, sh, order, count, mkeys, mvals, n_meta, single_path != NULL, err);
        if (s != LM_OK)
            goto fail;
    }
    direct_start(w);
    free(order);
    free(mkeys);
    free(mvals);
    lm_strmap_free(&names);
    *out = w;
    return LM_OK;

fail:
    free(order);
    free(mkeys);
    free(mvals);
    lm_strmap_free(&names);
    lm_st_writer_free(w);
    return s;
}

lm_status lm_st_writer_open(lm_st_writer **out, const char *dir, const lm_st_desc *tensors,
                            int64_t n, uint64_t max_shard_size, const char *const *meta,
                            lm_err *err)
{
    *out = NULL;
    if (!dir)
        return lm_err_set(err, LM_ERR_USAGE, "safetensors writer: no directory");
    if (!lm_is_dir(dir))
        return lm_err_set(err, LM_ERR_NOT_FOUND, "%s: not a directory", dir);
    return writer_open(out, dir, NULL, tensors, n, max_shard_size, meta, err);
}

// Records bytes [begin, end) of slot as written. Returns false (changing nothing) when they
// overlap bytes already written, or when memory runs out (*oom set).
static bool slot_add(st_slot *slot, uint64_t begin, uint64_t end, bool *oom)
{
    // i: the first span that starts after `begin`
    int64_t lo = 0, hi = slot->n_spans;
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        if (slot->spans[mid].begin <= begin)
            lo = mid + 1;
        else
            hi = mid;
    }
    int64_t i = lo;
    st_span *prev = i > 0 ? &slot->spans[i - 1] : NULL;
    st_span *next = i < slot->n_spans ? &slot->spans[i] : NULL;
    if ((prev && prev->end > begin) || (next && next->begin < end))
        return false;
    bool join_prev = prev && prev->end == begin;
    bool join_next = next && next->begin == end;
    if (join_prev && join_next) {
        prev->end = next->end;
        memmove(next, next + 1, (size_t)(slot->n_spans - i - 1) * sizeof *next);
        slot->n_spans--;
    } else if (join_prev) {
        prev->end = end;
    } else if (join_next) {
        next->begin = begin;
    } else {
        if (slot->n_spans == slot->cap_spans) {
            int64_t cap = slot->cap_spans ? slot->cap_spans * 2 : 4;
            st_span *sp = realloc(slot->spans, (size_t)cap * sizeof *sp);
            if (!sp) {
                *oom = true;
                return false;
            }
            slot->spans = sp;
            slot->cap_spans = cap;
        }
        memmove(&slot->spans[i + 1], &slot->spans[i],
                (size_t)(slot->n_spans - i) * sizeof *slot->spans);
        slot->spans[i] = (st_span){begin, end};
        slot->n_spans++;
    }
    slot->written += end - begin;
    return true;
}

// Writes `len` bytes of tensor `name` at file offset `off` of shard sh through the page cache,
// recording a failure.
static lm_status put_buffered(lm_st_writer *w, int sh, const void *data, uint64_t len,
                              uint64_t off, const char *name, lm_err *err)
{
    if (len == 0)
        return LM_OK;
    uint64_t at;
    int e = pwrite_all(w->fds[sh], data, len, off, &at);
    if (!e)
        return LM_OK;
    pthread_mutex_lock(&w->lock);
    note_failure(w, sh, e, at);
    pthread_mutex_unlock(&w->lock);
    return lm_err_set(err, LM_ERR_IO, "%s: writing tensor '%s': %s", w->paths[sh], name,
                      strerror(e));
}

lm_status lm_st_writer_put_part(lm_st_writer *w, int64_t idx, uint64_t offset, const void *data,
                                uint64_t nbytes, lm_err *err)
{
    if (!w)
        return lm_err_set(err, LM_ERR_USAGE, "safetensors writer: NULL writer");
    if (idx < 0 || idx >= w->n)
        return lm_err_set(err, LM_ERR_USAGE, "safetensors writer: tensor index %lld of %lld",
                          (long long)idx, (long long)w->n);
    const char *name = w->tensors[idx].name;
    st_slot *slot = &w->slots[idx];
    uint64_t end;
    if (!lm_add_u64(offset, nbytes, &end) || end > slot->nbytes)
        return lm_err_set(err, LM_ERR_MISMATCH,
                          "tensor '%s': bytes [%llu, +%llu) are outside its %llu bytes", name,
                          (unsigned long long)offset, (unsigned long long)nbytes,
                          (unsigned long long)slot->nbytes);
    if (nbytes == 0)
        return LM_OK;
    if (!data)
        return lm_err_set(err, LM_ERR_USAGE, "tensor '%s': no data", name);

    // reserve the range first so that two threads cannot both write it
    bool oom = false, ok = false, finished, failed;
    lm_status s = LM_OK;
    pthread_mutex_lock(&w->lock);
    finished = w->finished;
    failed = w->failed && !finished;
    if (failed)
        s = failure_err(w, err);
    else if (!finished)
        ok = slot_add(slot, offset, end, &oom);
    pthread_mutex_unlock(&w->lock);
    if (finished)
        return lm_err_set(err, LM_ERR_USAGE, "tensor '%s': written after finish", name);
    if (failed)
        return s;
    if (oom)
        return lm_err_set(err, LM_ERR_NOMEM, "tensor '%s': out of memory", name);
    if (!ok)
        return lm_err_set(err, LM_ERR_MISMATCH,
                          "tensor '%s': bytes [%llu, %llu) overlap bytes already written", name,
                          (unsigned long long)offset, (unsigned long long)end);

    // The part is file range [fbeg, fend). Its bytes in the tensor's interior [a, z), [ib, ie),
    // go through blocks; those before and after are written buffered (all of them when the
    // writer thread does not run, or the tensor spans no whole page).
    int sh = w->plan.shard_of[idx];
    const unsigned char *src = data;
    uint64_t fbeg = slot->file_off + offset, fend = slot->file_off + end;
    uint64_t a = align_up(slot->file_off), z = align_down(slot->file_off + slot->nbytes);
    uint64_t ib = fbeg > a ? fbeg : a, ie = fend < z ? fend : z;
    if (!w->thread_ok || ib >= ie)
        ib = ie = fend;
    s = put_buffered(w, sh, src, ib - fbeg, fbeg, name, err);
    for (uint64_t pos = ib; s == LM_OK && pos < ie;) {
        uint64_t boff = a + (pos - a) / DIO_BLOCK * DIO_BLOCK;
        uint64_t blen = z - boff < DIO_BLOCK ? z - boff : DIO_BLOCK;
        uint64_t n = (ie < boff + blen ? ie : boff + blen) - pos;
        st_block *b;
        s = block_get(w, sh, boff, blen, &b, err);
        if (s == LM_OK && b) {
            // outside the mutex: no other part has bytes in [pos, pos + n)
            memcpy(b->buf + (pos - boff), src + (pos - fbeg), (size_t)n);
            block_add(w, b, n);
        } else if (s == LM_OK) {
            s = put_buffered(w, sh, src + (pos - fbeg), n, pos, name, err);
        }
        pos += n;
    }
    if (s == LM_OK)
        s = put_buffered(w, sh, src + (ie - fbeg), fend - ie, ie, name, err);
    return s;
}

lm_status lm_st_writer_put(lm_st_writer *w, int64_t idx, const void *data, uint64_t nbytes,
                           lm_err *err)
{
    if (w && idx >= 0 && idx < w->n && nbytes != w->slots[idx].nbytes)
        return lm_err_set(err, LM_ERR_MISMATCH, "tensor '%s': %llu bytes given, it has %llu",
                          w->tensors[idx].name, (unsigned long long)nbytes,
                          (unsigned long long)w->slots[idx].nbytes);
    return lm_st_writer_put_part(w, idx, 0, data, nbytes, err);
}

// Writes model.safetensors.index.json as transformers does: json.dumps(index, indent=2,
// sort_keys=True) + "\n".
static lm_status write_index(lm_st_writer *w, lm_err *err)
{
    lm_buf b = {0};
    char *path = NULL;
    const char **names = malloc((size_t)w->n * sizeof *names);
    lm_strmap pos = {0};
    lm_status s = LM_OK;
    if (!names || lm_strmap_init(&pos, (size_t)w->n) != LM_OK) {
        s = lm_err_set(err, LM_ERR_NOMEM, "out of memory writing the index");
        goto done;
    }
    for (int64_t i = 0; i < w->n; i++) {
        names[i] = w->tensors[i].name;
        if (lm_strmap_put(&pos, names[i], i) < 0) {
            s = lm_err_set(err, LM_ERR_NOMEM, "out of memory writing the index");
            goto done;
        }
    }
    qsort(names, (size_t)w->n, sizeof *names, cmp_str);  // UTF-8 byte order = code point order
    lm_buf_fmt(&b, "{\n  \"metadata\": {\n    \"total_size\": %llu\n  },\n  \"weight_map\": {",
            (unsigned long long)w->plan.total_size);
    for (int64_t k = 0; k < w->n; k++) {
        char shard[ST_NAME_MAX];
        int sh = w->plan.shard_of[lm_strmap_get(&pos, names[k])];
        lm_buf_str(&b, k ? ",\n    " : "\n    ");
        buf_json_python(&b, names[k]);
        lm_buf_str(&b, ": ");
        buf_json_python(&b, lm_shard_name(shard, sizeof shard, sh, w->plan.n_shards));
    }
    lm_buf_str(&b, w->n ? "\n  }\n}\n" : "}\n}\n");
    path = lm_path_join(w->dir, ST_INDEX_NAME);
    if (b.oom || !path) {
        s = lm_err_set(err, LM_ERR_NOMEM, "out of memory writing the index");
        goto done;
    }
    s = lm_write_file(path, b.p, b.len, err);
done:
    free(b.p);
    free(path);
    free(names);
    lm_strmap_free(&pos);
    return s;
}

lm_status lm_st_writer_finish(lm_st_writer *w, lm_err *err)
{
    if (!w)
        return lm_err_set(err, LM_ERR_USAGE, "safetensors writer: NULL writer");
    pthread_mutex_lock(&w->lock);
    bool again = w->finished;
    w->finished = true;
    pthread_mutex_unlock(&w->lock);
    if (again)
        return lm_err_set(err, LM_ERR_USAGE, "safetensors writer: finished twice");
    direct_stop(w, true);  // every queued block written; from here this thread is alone
    if (w->failed)
        return failure_err(w, err);
    for (int64_t i = 0; i < w->n; i++) {
        const st_slot *slot = &w->slots[i];
        if (slot->written != slot->nbytes)
            return lm_err_set(err, LM_ERR_MISMATCH, "%s: tensor '%s' is incomplete: %llu of %llu "
                              "bytes written", w->paths[w->plan.shard_of[i]], w->tensors[i].name,
                              (unsigned long long)slot->written,
                              (unsigned long long)slot->nbytes);
    }
    // every byte is written, so every block was completed and queued: one still open would
    // be a bug here, and its bytes would be missing from the file
    for (int i = 0; i < w->n_blocks; i++) {
        const st_block *b = w->blocks[i];
        if (b->state != ST_BLOCK_FREE)
            return lm_err_set(err, LM_ERR_IO, "%s: internal error: the %llu bytes at byte %llu "
                              "were never written (%llu filled)", w->paths[b->shard],
                              (unsigned long long)b->len, (unsigned long long)b->off,
                              (unsigned long long)b->filled);
    }
    // data is durable before the caller renames the directory into place (one fsync covers
    // what either descriptor wrote)
    for (int sh = 0; sh < w->plan.n_shards; sh++) {
        int fd = w->fds[sh], dfd = w->dfds[sh];
        w->fds[sh] = w->dfds[sh] = -1;
        int e = fsync(fd) != 0 ? errno : 0;
        if (close(fd) != 0 && !e)
            e = errno;
        if (dfd >= 0 && close(dfd) != 0 && !e)
            e = errno;
        if (e)
            return lm_err_set(err, LM_ERR_IO, "%s: %s", w->paths[sh], strerror(e));
    }
    if (w->plan.n_shards > 1)
        return write_index(w, err);
    return LM_OK;
}

const lm_shard_plan *lm_st_writer_plan(const lm_st_writer *w)
{
    return &w->plan;
}

void lm_st_writer_free(lm_st_writer *w)
{
    if (!w)
        return;
    direct_stop(w, false);
    for (int sh = 0; w->fds && sh < w->plan.n_shards; sh++) {
        if (w->fds[sh] >= 0)
            close(w->fds[sh]);
    }
    for (int sh = 0; w->dfds && sh < w->plan.n_shards; sh++) {
        if (w->dfds[sh] >= 0)
            close(w->dfds[sh]);
    }
    for (int i = 0; i < w->n_blocks; i++) {
        free(w->blocks[i]->buf);
        free(w->blocks[i]);
    }
    free(w->blocks);
    for (int sh = 0; w->paths && sh < w->plan.n_shards; sh++)
        free(w->paths[sh]);
    for (int64_t i = 0; w->slots && i < w->n; i++)
        free(w->slots[i].spans);
    if (w->conds_ok) {
        pthread_cond_destroy(&w->queued);
        pthread_cond_destroy(&w->freed);
    }
    if (w->lock_ok)
        pthread_mutex_destroy(&w->lock);
    free(w->fds);
    free(w->dfds);
    free(w->paths);
    free(w->slots);
    free(w->tensors);
    free(w->dir);
    lm_shard_plan_free(&w->plan);
    free(w);
}

// ==== one file at once ========================================================================

lm_status lm_st_write_file(const char *path, const lm_st_desc *tensors, const void *const *data,
                           int64_t n, const char *const *meta, lm_err *err)
{
    static atomic_uint counter;
    lm_st_writer *w = NULL;
    char *tmp = NULL;
    lm_status s = LM_OK;
    if (!path)
        return lm_err_set(err, LM_ERR_USAGE, "safetensors writer: no path");
    // a fresh name beside `path`: pid and a counter keep concurrent writers apart, O_EXCL
    // (in writer_open) refuses anything left behind
    for (int attempt = 0;; attempt++) {
        free(tmp);
        tmp = lm_strfmt("%s.tmp-%ld-%u", path, (long)getpid(), atomic_fetch_add(&counter, 1));
        if (!tmp)
            return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
        s = writer_open(&w, NULL, tmp, tensors, n, UINT64_MAX, meta, err);
        if (s == LM_OK || attempt >= 100 || !lm_is_file(tmp))
            break;
    }
    if (s != LM_OK)
        goto fail;
    for (int64_t i = 0; i < n; i++) {
        s = lm_st_writer_put(w, i, data[i], w->slots[i].nbytes, err);
        if (s != LM_OK)
            goto fail;
    }
    s = lm_st_writer_finish(w, err);
    if (s != LM_OK)
        goto fail;
    if (rename(tmp, path) != 0) {
        s = lm_err_set(err, LM_ERR_IO, "%s: renaming %s into place: %s", path, tmp,
                       strerror(errno));
        goto fail;
    }
    lm_st_writer_free(w);
    free(tmp);
    return LM_OK;

fail:
    if (w)  // only a writer that opened created the file: never remove someone else's
        unlink(tmp);
    lm_st_writer_free(w);
    free(tmp);
    return s;
}
