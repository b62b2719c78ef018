// The safetensors writer. Output is laid out exactly as the reference writer and transformers'
// save_pretrained lay it out: tensors split into shards of at most `max_shard_size` bytes of
// data with the huggingface_hub rule (docs/formats.md "What llmerge writes"), shard files named
// model.safetensors or model-00001-of-00003.safetensors, in each shard the tensors sorted by
// descending dtype (the reference's Dtype order) then by name, compact JSON header with
// __metadata__ first, padded with spaces to a multiple of 8, and model.safetensors.index.json
// when there is more than one shard. Because every offset is known from the plan, each shard's
// header is written when the writer opens and tensor data may then arrive in any order, whole or
// in parts (pwrite at its offset): a merge streams tensor by tensor and never holds a shard in
// memory.
//
// Tensor data is written with direct I/O (O_DIRECT) by a writer thread: a put copies the bytes
// into page-aligned blocks of 2 MiB and returns, and the thread writes complete blocks. Copying
// the output into the page cache with buffered writes cost seconds of system CPU per few GB, on
// the caller's thread. The first and last partial page of each tensor, and tensors smaller than
// a page, are still written buffered by the caller. LLMERGE_DIRECT_IO=0 in the environment
// writes everything buffered; a filesystem without direct I/O falls back to that by itself.
// A failed write of the thread is reported by the next put, and by finish.
#ifndef LM_ST_WRITER_H
#define LM_ST_WRITER_H

#include <stdint.h>

#include "safetensors.h"

// One tensor of the output, as the caller plans it.
typedef struct lm_st_desc {
    const char *name;               // not copied: must outlive the writer
    lm_dtype dtype;
    int ndim;
    int64_t shape[LM_ST_MAX_DIMS];  // (ndim)
} lm_st_desc;

// How tensors fall into shards. shard_of[i] is tensor i's shard (0-based) in file numbering.
typedef struct lm_shard_plan {
    int64_t n_tensors;
    int n_shards;
    int *shard_of;          // (n_tensors)
    uint64_t *shard_bytes;  // (n_shards) tensor data per shard
    uint64_t total_size;    // all tensor data
} lm_shard_plan;

// Splits tensors (in the given order, the state dict's) into shards as huggingface_hub's
// split_state_dict_into_shards does: a tensor larger than max_shard_size gets a shard of its own
// (placed, as there, before the shard being filled); otherwise a new shard starts when the
// tensor would take the current one past max_shard_size. Fills *plan; free with
// lm_shard_plan_free.
lm_status lm_shard_plan_make(lm_shard_plan *plan, const lm_st_desc *tensors, int64_t n,
                             uint64_t max_shard_size, lm_err *err);
void lm_shard_plan_free(lm_shard_plan *plan);

// The file name of shard `idx` (0-based) of `n`: "model.safetensors" when n == 1, else
// "model-%05d-of-%05d.safetensors". Writes into buf; returns buf.
char *lm_shard_name(char *buf, size_t cap, int idx, int n);

typedef struct lm_st_writer lm_st_writer;

// Plans the shards and creates them in directory `dir` (which must exist), writing each header.
// `meta` is NULL or a NULL-terminated list of key, value strings for __metadata__ (written
// sorted by key, with "format": "pt" added unless given). Nothing is copied from `tensors`
// but the array itself; names must outlive the writer. Free with lm_st_writer_free.
lm_status lm_st_writer_open(lm_st_writer **out, const char *dir, const lm_st_desc *tensors,
                            int64_t n, uint64_t max_shard_size, const char *const *meta,
                            lm_err *err);

// Writes all of tensor idx's data (nbytes must equal its size). Any order of tensors.
lm_status lm_st_writer_put(lm_st_writer *w, int64_t idx, const void *data, uint64_t nbytes,
                           lm_err *err);

// Writes bytes [offset, offset + nbytes) of tensor idx's data, for tensors produced in parts.
// Parts may come in any order and from several threads at once, but may not overlap. The data
// is the caller's again when this returns (copied or written). Fails with LM_ERR_IO naming the
// shard once any write to the output has failed, the writer thread's included.
lm_status lm_st_writer_put_part(lm_st_writer *w, int64_t idx, uint64_t offset, const void *data,
                                uint64_t nbytes, lm_err *err);

// Waits for the writer thread's last writes, checks every byte of every tensor was written,
// flushes and closes the shards, and writes model.safetensors.index.json when there is more
// than one shard. Call it after every put has returned. Errors name the file.
lm_status lm_st_writer_finish(lm_st_writer *w, lm_err *err);

// The plan the writer follows (valid until lm_st_writer_free).
const lm_shard_plan *lm_st_writer_plan(const lm_st_writer *w);

// Stops the writer thread, closes whatever is open and frees the writer, at any point (blocks
// not yet written are dropped). Files already created are left for the caller (who writes into
// a temporary directory and removes it on failure). Safe on NULL.
void lm_st_writer_free(lm_st_writer *w);

// Writes one safetensors file at `path` from in-memory tensors (data[i] holds tensor i), via a
// temporary file beside it renamed into place, so a failure leaves nothing at `path`.
lm_status lm_st_write_file(const char *path, const lm_st_desc *tensors, const void *const *data,
                           int64_t n, const char *const *meta, lm_err *err);

#endif
