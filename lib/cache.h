// The cache of sparsegpt's Hessian terms under --cache-dir: for each (model, adapter,
// calibration data, caps, damping) the U_cc² of every layer input (lm_hess_ucc2_model), so that
// a second run of the same sweep point skips the activation capture. An entry is one file,
// "ucc2-KEY.bin", KEY being xxHash64 of everything the terms depend on (the bytes of every
// model, adapter and calibration file, the sequence cap, the length cap, the damping and this
// format's version): a changed input gives another key and can never reach a stale entry. The
// file ends with xxHash64 of its contents, so a damaged entry is detected, reported and
// computed again. Entries are written to a temporary name and renamed into place.
#ifndef LM_CACHE_H
#define LM_CACHE_H

#include <stdbool.h>
#include <stdint.h>

#include "adapter.h"
#include "model.h"
#include "status.h"

// The cache directory: `given` when not NULL, else $XDG_CACHE_HOME/llmerge, else
// $HOME/.cache/llmerge. A new string the caller frees; NULL when none can be named.
char *lm_cache_dir(const char *given);

// The key of the U_cc² set of model m (with adapter a, or NULL) on calibration file `calib`
// with the given caps (0: none) and damping. Hashes the files' bytes (config.json, index and
// shards of m, adapter_config.json and weights of a, the calibration file).
lm_status lm_cache_key_ucc2(const lm_model *m, const lm_adapter *a, const char *calib, int64_t max_samples,
                            int64_t max_len, double damp, uint64_t *key, lm_err *err);

// Looks the entry up in dir. *hit false and LM_OK when there is none; when there is one but it
// is damaged (size, header or checksum), *hit is false, `why` (may be NULL) says what is wrong
// and the file is removed. On a hit *out gets n arrays, array i of dims[i] doubles (free with
// lm_hess_ucc2_free).
lm_status lm_cache_load_ucc2(const char *dir, uint64_t key, double ***out, int64_t *n, int64_t **dims, bool *hit,
                             char *why, size_t why_size, lm_err *err);

// Stores the n arrays (array i of dims[i] doubles) under key in dir (created if needed).
lm_status lm_cache_store_ucc2(const char *dir, uint64_t key, double *const *ucc2, int64_t n, const int64_t *dims,
                              lm_err *err);

#endif
