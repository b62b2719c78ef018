// What a merged model directory carries besides its weights (docs/formats.md "Files a merged
// model directory carries"): llmerge.json, the record of the run; config.json, the base's with the
// dtype updated; and the base's tokenizer and generation files, copied.
//
// llmerge.json says what was merged and how, so a result can be traced and reproduced:
//
//   {"llmerge_version", "method",
//    "options": {every option's resolved value},
//    "base": {"path", "files": [{"name", "bytes", "xxh64"}]},
//    "inputs": [{"path", "kind": "model"|"adapter", "files": [...]}],
//    "outputs": {"shards": [{"name", "n_tensors", "data_bytes", "bytes"}], "index",
//                "card" (the model card's name, or null: added by the merge command),
//                "tensors": [{"name", "shard", "dtype", "shape", "xxh64"}]},
//    "devices": {"cpu": units run there, ...},
//    "nonfinite": {"base", "inputs": [...], "output"}, each {"nan", "inf",
//                  "tensors": [{"name", "nan", "inf"}]} (the tensors holding any),
//    "timings": {"load_s", "merge_s", "write_s", "hash_s", "total_s"},
//    "stats": {"bytes_in", "bytes_out", "tensors_merged", "tensors_copied"}}
//
// Hashes are xxHash64 (seed 0) written as 16 lower-case hex digits in a string, because a JSON
// number loses 64-bit precision in most readers. Input files hashed are a model's config.json,
// its index when it has one, and its weight files; an adapter's adapter_config.json and
// adapter_model.safetensors. Paths are absolute (resolved when the run starts), since the file
// may be read from anywhere.
//
// The document is built with cJSON and written with a two-space indent, small objects and
// arrays of numbers on one line (one line per output tensor).
#ifndef LM_MANIFEST_H
#define LM_MANIFEST_H

#include <cJSON.h>
#include <stdint.h>

#include "adapter.h"
#include "hasher.h"
#include "merge.h"
#include "model.h"
#include "st_writer.h"

#define LM_MANIFEST_NAME "llmerge.json"

typedef struct lm_manifest {
    cJSON *root;     // the document; the pointers below are its members
    cJSON *options;
    cJSON *base;
    cJSON *inputs;
    cJSON *outputs;
    cJSON *devices;
    cJSON *timings;
    cJSON *stats;
    lm_hasher *hasher;  // not owned; when set, input files it hashes take their hash from it
} lm_manifest;

typedef struct lm_manifest_timings {
    double load_s;   // opening and checking the inputs
    double merge_s;  // the merge itself (tensor data is written as it is merged)
    double write_s;  // finishing the shards, config, side files
    double hash_s;   // hashing the input files for this manifest (the wait for the hasher)
    double total_s;  // the whole run, up to writing the manifest
} lm_manifest_timings;

// Starts a manifest for `method` ("ties") with every section present and empty. On failure
// (LM_ERR_NOMEM) nothing needs freeing; on success free with lm_manifest_free.
lm_status lm_manifest_init(lm_manifest *m, const char *method, lm_err *err);

// Frees the document; safe on a zeroed or freed manifest.
void lm_manifest_free(lm_manifest *m);

// Records the merge options of `o` under "options": weights, densities, lambda, normalize, sign,
// topk, rescale, seed (a decimal string: seeds are 64-bit), dtype and threads. Callers add what
// else they resolved (shard_size, device, ...) to m->options with cJSON directly.
lm_status lm_manifest_merge_options(lm_manifest *m, const lm_merge_opts *o, lm_err *err);

// Records the base model: its absolute path and its files with sizes and hashes (reads them
// all). LM_ERR_IO naming the file when one cannot be read.
lm_status lm_manifest_set_base(lm_manifest *m, const lm_model *base, lm_err *err);

// Appends an input: a full model (kind "model") or an adapter (kind "adapter"); exactly one of
// `model` and `adapter` is non-NULL. Hashes its files as lm_manifest_set_base does.
lm_status lm_manifest_add_input(lm_manifest *m, const lm_model *model, const lm_adapter *adapter,
                                lm_err *err);

// Records the output: shards as `plan` lays them out in directory `dir` (their file sizes are
// read from there, so call after lm_st_writer_finish) and every tensor of `t` (n of them, in
// writer order) with its shard, dtype, shape and the hash xxh64[i] of its data.
lm_status lm_manifest_set_outputs(lm_manifest *m, const char *dir, const lm_shard_plan *plan,
                                  const lm_st_desc *t, int64_t n, const uint64_t *xxh64,
                                  lm_err *err);

// Records the NaN and Inf the merge counted (res->nonfinite) under "nonfinite": for the base,
// each of the n_ft FTs (in "inputs", in FT order) and the output, the totals and each tensor that
// holds any, in the order the merge met them.
lm_status lm_manifest_set_nonfinite(lm_manifest *m, const lm_merge_result *res, int n_ft, lm_err *err);

// Adds `units` to the count of work units that ran on `device` ("cpu", "cuda:0").
lm_status lm_manifest_add_device_units(lm_manifest *m, const char *device, int64_t units,
                                       lm_err *err);

// Records the timings and the totals of the run.
lm_status lm_manifest_set_timings(lm_manifest *m, const lm_manifest_timings *t, lm_err *err);
lm_status lm_manifest_set_stats(lm_manifest *m, uint64_t bytes_in, uint64_t bytes_out,
                                int64_t tensors_merged, int64_t tensors_copied, lm_err *err);

// Writes the manifest to `path` (LM_MANIFEST_NAME inside the output directory).
lm_status lm_manifest_write(const lm_manifest *m, const char *path, lm_err *err);

// Prints `item` as JSON with a two-space indent, keeping objects and arrays that hold only
// scalars (or arrays of scalars) on one line when it is short. Returns a new string the
// caller frees, or NULL when memory runs out.
char *lm_manifest_print_json(const cJSON *item);

// ==== the other files of the output ===========================================================

// The name transformers gives `dt` in config.json: "float32", "float16" or "bfloat16" (NULL
// for a dtype a model is not saved in).
const char *lm_manifest_torch_dtype(lm_dtype dt);

// Writes `out_path`, a copy of the config.json at `base_path` with its dtype changed to `dt`:
// the top-level "torch_dtype" and "dtype" keys, whichever the file has, get the new value, and
// "torch_dtype" is added (at its sorted place) when it has neither; a vocab_size above 0 replaces
// the top-level "vocab_size" value (embeddings rebuilt to another vocabulary). Everything else is
// kept as written, byte for byte. LM_ERR_FORMAT naming the file when it is not a JSON object,
// LM_ERR_IO naming the file that cannot be read or written.
lm_status lm_manifest_write_config(const char *base_path, const char *out_path, lm_dtype dt,
                                   int64_t vocab_size, lm_err *err);

// The tokenizer and generation files a merged model takes from its base, NULL-terminated.
extern const char *const lm_manifest_side_files[];

// Copies each of lm_manifest_side_files present in `base_dir` (symlinks followed) into
// `out_dir`; *n_copied (may be NULL) gets how many. Never copies weights or the index.
lm_status lm_manifest_copy_side_files(const char *base_dir, const char *out_dir, int *n_copied,
                                      lm_err *err);

#endif
