// Small helpers shared by every module: overflow-checked size arithmetic for sizes that come
// from untrusted files, SIZE option parsing ("5GB", "512MiB"), whole-file reads of small text
// files, paths, recursive removal, file hashing, UTF-8 validation, a string-keyed hash map and
// the one monotonic clock every timing is taken with.
#ifndef LM_UTIL_H
#define LM_UTIL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "status.h"

// Marks a hot element-wise loop to be compiled for AVX-512 and AVX2 as well as for the
// baseline, the best one picked when the program starts (function multi-versioning, GCC and
// clang on x86-64). The clones compute the same values: element-wise float arithmetic rounds
// the same at any vector width, nothing is contracted into an FMA (the build passes
// -ffp-contract=off, which GCC's ISO C mode implies anyway, where clang's "avx512f" target
// would otherwise contract), and no reduction is reordered. Off under the sanitizers, whose
// runtime starts after ifunc resolvers. On the 2-core test machine the AVX-512 clones took
// about 5% off the CPU time of a TIES merge of LoRA adapters (bench_merge's inputs).
#if defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(undefined_behavior_sanitizer)
#define LM_SANITIZED 1
#endif
#endif
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__SANITIZE_ADDRESS__) && !defined(LM_SANITIZED)
#define LM_VECTOR_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define LM_VECTOR_CLONES
#endif

// ---- checked arithmetic -------------------------------------------------------------------

// Sets *out = a * b and returns true, or returns false (leaving *out alone) on overflow.
static inline bool lm_mul_u64(uint64_t a, uint64_t b, uint64_t *out)
{
    uint64_t r;
    if (__builtin_mul_overflow(a, b, &r))
        return false;
    *out = r;
    return true;
}

// Sets *out = a + b and returns true, or returns false on overflow.
static inline bool lm_add_u64(uint64_t a, uint64_t b, uint64_t *out)
{
    uint64_t r;
    if (__builtin_add_overflow(a, b, &r))
        return false;
    *out = r;
    return true;
}

// ---- time -----------------------------------------------------------------------------------

// Seconds on the monotonic clock (CLOCK_MONOTONIC) from an arbitrary start: only differences
// mean anything. Every phase, fallback and event time is measured with it. Allocates nothing.
double lm_now(void);

// ---- sizes ----------------------------------------------------------------------------------

// Parses a byte count with an optional suffix: K, M, G, T or KiB, MiB, GiB, TiB (powers of
// 1024), KB, MB, GB, TB (powers of 1000, as transformers reads "5GB"), B or none (bytes).
// Fractions are allowed before a suffix ("1.5GiB"). A size under 1 MiB written with a bare B
// ("1B", "5B") is refused: it is mergekit's count of parameters (a billion), and the message
// says so and what to give instead. On failure returns LM_ERR_USAGE with a message quoting the
// text, and leaves *out alone.
lm_status lm_parse_size(const char *text, uint64_t *out, lm_err *err);

// Writes a short human form of `bytes` ("1.50 GiB", "512 B") into buf; returns buf.
char *lm_format_bytes(char *buf, size_t cap, uint64_t bytes);

// ---- files and paths ------------------------------------------------------------------------

// Reads the whole file at `path` (at most max_bytes) into a new NUL-terminated buffer that the
// caller frees with free(). Sets *len to the byte count (without the NUL). The file is opened
// with lm_open_regular: a directory, FIFO or device is refused without blocking on it.
lm_status lm_read_file(const char *path, size_t max_bytes, char **out, size_t *len, lm_err *err);

// Writes `len` bytes to `path` (created or truncated, mode 0644). The message names the path.
lm_status lm_write_file(const char *path, const void *data, size_t len, lm_err *err);

// Returns a new string "a/b" (b alone when it is absolute or a is empty); caller frees.
// Returns NULL only when memory runs out.
char *lm_path_join(const char *a, const char *b);

// Returns the last component of `path` (a pointer into it).
const char *lm_path_base(const char *path);

// The directory `out` goes into: "a/b" for "a/b/c" (and "a/b/c/"), "." for "c", "/" for "/c".
// A new string the caller frees, or NULL when out of memory.
char *lm_path_parent(const char *out);

bool lm_is_dir(const char *path);
bool lm_is_file(const char *path);

// Creates the directory and its missing parents (mode 0755).
lm_status lm_mkdir_p(const char *path, lm_err *err);

// Removes `path` and, when it is a directory, everything under it. Symlinks are removed, not
// followed. A missing path is not an error.
lm_status lm_rm_rf(const char *path, lm_err *err);

// Copies the regular file `src` to `dst` (created or truncated).
lm_status lm_copy_file(const char *src, const char *dst, lm_err *err);

// xxHash64 (seed 0) of a whole file, read in streaming blocks.
lm_status lm_xxh64_file(const char *path, uint64_t *out, lm_err *err);

// Adds bytes [offset, offset + len) of the regular file open as fd to the XXH64_state_t at
// `state`, read through a mapping that is let go afterwards (offset a multiple of the page
// size); `path` names the file in errors.
lm_status lm_xxh64_mapped(void *state, int fd, uint64_t offset, size_t len, const char *path, lm_err *err);

// xxHash64 (seed 0) of a buffer.
uint64_t lm_xxh64(const void *data, size_t len);

// ---- text -----------------------------------------------------------------------------------

// True when buf[0..len) is well-formed UTF-8 (no overlongs, surrogates or values > U+10FFFF).
bool lm_utf8_valid(const void *buf, size_t len);

// strdup that returns NULL on NULL input.
char *lm_strdup(const char *s);

// A new string formatted like printf; NULL when memory runs out. Caller frees.
char *lm_strfmt(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

// True when `s` ends with `suffix`.
bool lm_str_ends_with(const char *s, const char *suffix);

// ---- growable text buffer -------------------------------------------------------------------

// Text built piece by piece (JSON headers, indexes, manifests). A failed append sets oom and
// makes every later append a no-op, so a caller checks once at the end. Zero-initialise; free
// with free(b->p).
typedef struct lm_buf {
    char *p;     // (cap) NUL-terminated once anything was appended
    size_t len;
    size_t cap;
    bool oom;    // an append failed: the contents are incomplete
} lm_buf;

void lm_buf_put(lm_buf *b, const char *s, size_t n);
void lm_buf_str(lm_buf *b, const char *s);
// Appends printf-style text (short: numbers and names; longer text sets oom).
void lm_buf_fmt(lm_buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

// ---- string map -----------------------------------------------------------------------------

// Open-addressing hash map from NUL-terminated keys to int64 values. Keys are not copied: they
// must outlive the map (they usually point into a parsed header).
typedef struct lm_strmap {
    const char **keys;  // (cap) NULL where empty
    int64_t *vals;      // (cap)
    size_t cap;         // power of two
    size_t count;
} lm_strmap;

// Prepares an empty map sized for `expected` keys. Returns LM_ERR_NOMEM on failure.
lm_status lm_strmap_init(lm_strmap *m, size_t expected);

// Frees the map's arrays (not the keys). Safe on a zeroed map.
void lm_strmap_free(lm_strmap *m);

// Inserts key→val. Returns 1 when inserted, 0 when the key was already present (value left
// unchanged), -1 when memory runs out.
int lm_strmap_put(lm_strmap *m, const char *key, int64_t val);

// Returns the value for `key`, or -1 when absent.
int64_t lm_strmap_get(const lm_strmap *m, const char *key);

// ---- regular files --------------------------------------------------------------------------

// What a file of mode `mode` (st_mode) is, for messages: "a regular file", "a directory", "a
// FIFO", "a socket", "a character device", "a block device" or "a special file" (a static string).
const char *lm_file_kind(unsigned mode);

// Opens `path` read-only when it is a regular file (a symlink to one is one), without ever
// blocking on it: a FIFO would block a plain open until a writer came, so the kind is checked
// first and the file opened with O_NONBLOCK (and checked again, in case it was swapped), then
// O_NONBLOCK is cleared. A directory, FIFO, socket or device is LM_ERR_USAGE "PATH is a FIFO,
// not a regular file"; a missing file LM_ERR_NOT_FOUND; others LM_ERR_IO. On success *fd is
// the caller's to close.
lm_status lm_open_regular(const char *path, int *fd, lm_err *err);

#endif
