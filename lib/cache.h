// The cache under --cache-dir (docs/hessian.md "The cache": where sparsegpt keeps them), so
// that a sweep captures each model's Hessians once and selects each FT's top-k masks once. It
// keeps three kinds of entry, one file each, named KIND-KEY.bin with KEY in hex:
//
//   hess  the Hessians of one model run on one calibration file (float32 [in, in] per layer
//         input, n_tokens in the header): what a sweep that changes only the damping or the
//         density needs to skip the capture. Large: 4 bytes · in² per input, about 5 GB for a
//         1B model, so LLMERGE_CACHE_HESSIANS=0 turns them off (docs/hessian.md).
//   ucc2  U_cc² of every Hessian of that model with one damping (lm_hess_ucc2, doubles [in]
//         per input): all sparsegpt's importance needs, a thousandth of the Hessians' size.
//   mask  one FT's final top-k mask of every tensor it changes, as a bitmap (a bit an element).
//
// KEY is xxHash64 of everything the entry depends on (docs/hessian.md "The cache" lists it per
// kind): the bytes of every model, adapter and calibration file, the caps, and for U_cc² the
// damping, for masks also the base, the FT, the density and the top-k mode, each with this
// format's version. A changed input gives
// another key, so it can never reach a stale entry; the key is also in the entry's header, so
// a file renamed to another key is refused.
//
// An entry is a header, records (a name, an element count and bytes of data, each followed by
// xxHash64 of the record) and a footer (the count of records and a checksum over the header's
// and every record's), so a damaged or truncated entry is found record by record while it is
// streamed, without reading 5 GB twice. A damaged entry is reported to the caller, who says so
// and computes the thing again, and is removed (only when the path still names the file read,
// so a sound entry another run has just put there stays). Entries are written to a temporary
// file in the same directory and renamed into place when complete, so a concurrent reader
// (a sweep's parallel jobs) sees the whole entry or none; a temporary file left by a process
// that died is removed by the next writer once it is an hour old (lm_cache_create).
#ifndef LM_CACHE_H
#define LM_CACHE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "adapter.h"
#include "model.h"
#include "status.h"
#include "util.h"

// The cache directory: `given` when not NULL or empty, else $XDG_CACHE_HOME/llmerge, else
// $HOME/.cache/llmerge. A new string the caller frees; NULL when none can be named.
char *lm_cache_dir(const char *given);

// Whether full Hessians are kept (hess entries): true unless LLMERGE_CACHE_HESSIANS is set to
// 0, "no", "off" or "false". U_cc² and masks are kept either way.
bool lm_cache_keeps_hessians(void);

// ==== keys ====================================================================================

// Digests of inputs, each xxHash64 over the xxHash64 of every file's bytes (the paths do not
// count: the same bytes elsewhere are the same input). A model: config.json, the index when
// there is one, every shard. An adapter: adapter_config.json and its weights. A file: its bytes.
// LM_ERR_IO naming the file that cannot be read.
lm_status lm_cache_digest_model(const lm_model *m, uint64_t *out, lm_err *err);
lm_status lm_cache_digest_adapter(const lm_adapter *a, uint64_t *out, lm_err *err);
lm_status lm_cache_digest_file(const char *path, uint64_t *out, lm_err *err);

// What the Hessians of one model depend on.
typedef struct lm_cache_hess_src {
    uint64_t model;       // lm_cache_digest_model of the model run
    bool has_adapter;     // an adapter applied to it
    uint64_t adapter;     // lm_cache_digest_adapter of that adapter
    uint64_t calib;       // lm_cache_digest_file of the calibration file
    int64_t max_samples;  // --calib-samples (0: all)
    int64_t max_len;      // the sequence cap in effect (0: none)
} lm_cache_hess_src;

// What one FT's final top-k mask depends on beyond the Hessians it was selected by.
typedef struct lm_cache_mask_src {
    uint64_t ucc2_key;  // lm_cache_key_ucc2 of the Hessians (their inputs and the damping)
    uint64_t base;      // lm_cache_digest_model of the base
    uint64_t ft;        // the FT's digest (its model's or its adapter's)
    double density;     // d_i
    bool topk_global;   // --topk global (the threshold over the whole model) or tensor
} lm_cache_mask_src;

// The keys. Pure functions of their arguments; no two kinds share a key.
uint64_t lm_cache_key_hess(const lm_cache_hess_src *src);
uint64_t lm_cache_key_ucc2(const lm_cache_hess_src *src, double damp);
uint64_t lm_cache_key_mask(const lm_cache_mask_src *src);

// ==== entries =================================================================================

typedef enum lm_cache_kind {
    LM_CACHE_HESS,
    LM_CACHE_UCC2,
    LM_CACHE_MASK,
} lm_cache_kind;

// "hess", "ucc2", "mask".
const char *lm_cache_kind_name(lm_cache_kind kind);

// The path of the entry: DIR/KIND-KEY.bin (KEY in 16 hex digits). A new string the caller
// frees; NULL when memory runs out.
char *lm_cache_entry_path(const char *dir, lm_cache_kind kind, uint64_t key);

// An entry being written or read, one record after another.
typedef struct lm_cache_entry lm_cache_entry;

// Starts writing the entry (kind, key) in dir (created if needed) with `meta` in its header
// (n_tokens for Hessians, else 0): a temporary file beside where it will go. First removes the
// temporary files in dir of processes that no longer exist, untouched for an hour. Finish with
// lm_cache_commit, or drop it (and the temporary file) with lm_cache_close. LM_ERR_IO naming
// the path when the file cannot be created.
lm_status lm_cache_create(lm_cache_entry **out, const char *dir, lm_cache_kind kind, uint64_t key, int64_t meta,
                          lm_err *err);

// Appends a record: `name` (at most LM_CACHE_NAME_MAX bytes), an element count n, and `bytes`
// bytes of data. LM_ERR_IO naming the file when the write fails (a full disk).
#define LM_CACHE_NAME_MAX 1024
lm_status lm_cache_put(lm_cache_entry *e, const char *name, int64_t n, const void *data, size_t bytes, lm_err *err);

// Writes the footer and renames the entry into place (replacing one that is there). Frees e
// in every case; on failure nothing is left behind.
lm_status lm_cache_commit(lm_cache_entry *e, lm_err *err);

// Opens the entry (kind, key) in dir for reading. *out is NULL and the status LM_OK when there
// is no sound entry: none at all (why empty), or one whose header is damaged or not of this
// kind, key and version (`why`, which may be NULL, says what; the file is removed). *meta gets
// the header's meta. LM_ERR_NOMEM only as an error.
lm_status lm_cache_open(lm_cache_entry **out, const char *dir, lm_cache_kind kind, uint64_t key, int64_t *meta,
                        char *why, size_t why_size, lm_err *err);

// Reads the next record's header: its name (NUL-terminated into name[name_cap]), element count
// and byte count; or, at the footer, checks it (the count of records, the checksum, nothing
// after it) and sets *end. LM_ERR_FORMAT, the message naming the entry and the defect, when the
// entry is damaged or truncated (lm_cache_close then removes it); LM_ERR_IO for a read error.
lm_status lm_cache_next(lm_cache_entry *e, char *name, size_t name_cap, int64_t *n, size_t *bytes, bool *end,
                        lm_err *err);

// Reads the data of the record lm_cache_next announced into data[bytes] and checks the
// record's checksum: LM_ERR_FORMAT when it does not match (data then holds what was read).
lm_status lm_cache_read(lm_cache_entry *e, void *data, lm_err *err);

// Marks the entry damaged for a reason its reader found (a record that does not fit what the
// key promises): returns LM_ERR_FORMAT with "PATH: why", and lm_cache_close removes it.
lm_status lm_cache_reject(lm_cache_entry *e, const char *why, lm_err *err);

// The entry's path (valid until lm_cache_close).
const char *lm_cache_path(const lm_cache_entry *e);

// Ends reading (removing a damaged entry) or abandons writing (removing the temporary file).
// Safe on NULL.
void lm_cache_close(lm_cache_entry *e);

// ==== U_cc² sets and masks ====================================================================

// Reads the ucc2 entry `key`: n records, record i being `dims[i]` doubles. *hit false and
// LM_OK when there is none, or it is damaged or does not fit n and dims (`why` says which; the
// file is removed). On a hit *out gets n new arrays (free with lm_hess_ucc2_free).
lm_status lm_cache_load_ucc2(const char *dir, uint64_t key, int64_t n, const int64_t *dims, double ***out, bool *hit,
                             char *why, size_t why_size, lm_err *err);

// Writes the ucc2 entry `key`: n arrays, array i of dims[i] doubles, record i named names[i].
lm_status lm_cache_store_ucc2(const char *dir, uint64_t key, double *const *ucc2, int64_t n, const int64_t *dims,
                              const char *const *names, lm_err *err);

// One FT's masks read back: tensor name → bitmap of numel bits, as the mask operations of
// device.h read them (lm_dev_mask_bytes bytes; bit j in byte j / 8 at bit j % 8, set where
// entry j is kept).
typedef struct lm_cache_masks {
    int64_t n;
    char **names;      // (n)
    int64_t *numel;    // (n)
    uint8_t **bits;    // (n) (numel + 7) / 8 bytes each
    lm_strmap index;   // name → record, for lm_cache_masks_find
} lm_cache_masks;

// Reads the mask entry `key` whole into *out (zeroed first). *hit false and LM_OK when there is
// none, or it is damaged (`why` says what; the file is removed). Free with lm_cache_masks_free.
lm_status lm_cache_load_masks(const char *dir, uint64_t key, lm_cache_masks *out, bool *hit, char *why,
                              size_t why_size, lm_err *err);

// The bitmap of tensor `name` when it has numel elements, else NULL.
const uint8_t *lm_cache_masks_find(const lm_cache_masks *m, const char *name, int64_t numel);

// Frees what lm_cache_load_masks allocated; safe on a zeroed object and twice.
void lm_cache_masks_free(lm_cache_masks *m);

#endif
