// The safetensors reader. A file is mmapped and its header parsed by a strict JSON parser
// written for this one schema; every check of the reference implementation is made, in its
// order, plus what the spec requires and the reference lets through (duplicate keys, integers
// that are not exact 64-bit integers, non-string metadata). Tensors are views into the
// mapping: nothing is copied until a caller converts a tensor. The first failure is returned
// as LM_ERR_FORMAT with a message "FILE: DEFECT: details", DEFECT being the reference's name
// for it (HeaderTooSmall, HeaderTooLarge, InvalidHeaderLength, InvalidHeaderUtf8,
// InvalidHeaderJson, InvalidHeaderSchema, DuplicateKey, InvalidInteger, UnknownDtype,
// TooManyDims, ValidationOverflow, TensorInvalidInfo, MisalignedSlice, InvalidOffset,
// MetadataIncompleteBuffer).
#ifndef LM_SAFETENSORS_H
#define LM_SAFETENSORS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "dtype.h"
#include "status.h"
#include "util.h"

#define LM_ST_MAX_HEADER 100000000ull  // the reference's limit on the JSON header length
#define LM_ST_MAX_DIMS 16              // more dimensions than any model uses: reject beyond

typedef struct lm_st_tensor {
    const char *name;               // NUL-terminated, owned by the file
    lm_dtype dtype;
    int ndim;                       // 0 for a scalar
    int64_t shape[LM_ST_MAX_DIMS];  // (ndim)
    int64_t numel;                  // product of shape (1 for a scalar)
    uint64_t begin, end;            // byte offsets in the data buffer, end exclusive
    uint64_t nbytes;                // end - begin
    const void *data;               // view into the mapping: (numel) elements of dtype
} lm_st_tensor;

typedef struct lm_st_file {
    char *path;               // as given to lm_st_open, or the label of lm_st_parse
    void *map;                // the mapping (NULL for lm_st_parse)
    size_t map_size;
    int map_id;               // the mapping as registered for SIGBUS messages (signals.h), or 0
    const uint8_t *bytes;     // (size) the whole file
    uint64_t size;
    uint64_t header_len;      // N, the JSON length
    const uint8_t *data;      // bytes + 8 + N
    uint64_t data_size;
    lm_st_tensor *tensors;    // (n_tensors) sorted by data offset, i.e. in data order
    int64_t n_tensors;
    const char **meta_keys;   // (n_meta) __metadata__ entries in header order
    const char **meta_vals;   // (n_meta)
    int64_t n_meta;
    char *strings;            // arena holding every name, key and value
    lm_strmap index;          // name -> position in tensors
} lm_st_file;

// Opens and validates the safetensors file at `path`, mapping it read-only. On success *out
// is a new file the caller releases with lm_st_close; on failure *out is NULL and err names
// the file and the defect.
lm_status lm_st_open(lm_st_file **out, const char *path, lm_err *err);

// As lm_st_open, for the file open as `fd` (which the caller keeps and may close once this
// returns: the mapping stays), named `label` in messages.
lm_status lm_st_open_fd(lm_st_file **out, int fd, const char *label, lm_err *err);

// Validates an in-memory file of `size` bytes (used by the fuzzer and tests). The buffer must
// outlive the returned object; `label` names it in messages.
lm_status lm_st_parse(lm_st_file **out, const void *buf, size_t size, const char *label, lm_err *err);

// Unmaps and frees everything; safe on NULL and on a half-built object.
void lm_st_close(lm_st_file *f);

// The tensor called `name`, or NULL.
const lm_st_tensor *lm_st_find(const lm_st_file *f, const char *name);

// The __metadata__ value for `key`, or NULL.
const char *lm_st_meta(const lm_st_file *f, const char *key);

// Converts tensor `t` to float32 into dst (t->numel floats). The message names the tensor when
// its dtype cannot be computed with.
lm_status lm_st_read_f32(const lm_st_tensor *t, float *dst, lm_err *err);

// Writes "[2, 3]" for the tensor's shape into buf; returns buf.
char *lm_st_shape_str(const int64_t *shape, int ndim, char *buf, size_t cap);

#endif
