// Planning a merge before it runs (`llmerge plan`): from the merge options, the opened base and
// fine-tuned inputs (headers only: no tensor data is read) and a description of the device,
// what each phase will allocate and where: each adapter's float32 LoRA factors and whether
// they fit the device after the ones before them (place_residents' order), each tensor's
// device working set and whether it fits beside the factors (run_unit's ws_alloc), the CPU's
// buffers and a peak RSS estimate, and the output's bytes, shards and the disk space beside
// it. The per-tensor figures come from the merge engine's own rules (lm_merge_plan_tensor), so
// the predicted fallbacks are the ones a run on the same device reports.
#ifndef LM_PLAN_H
#define LM_PLAN_H

#include <stdbool.h>
#include <stdint.h>

#include "merge.h"

// The device a plan is for, as the merge would open it.
typedef struct lm_plan_device {
    const char *name;      // "cpu", "cuda:0", "sim:64KiB"; not copied
    bool host_memory;      // the CPU: no placement, no fallback
    uint64_t free_bytes;   // what the device reports free (an accelerator)
    uint64_t total_bytes;
    uint64_t cap;          // --gpu-mem, 0 for none
} lm_plan_device;

typedef struct lm_plan_ft {
    uint64_t resident_bytes;  // float32 LoRA factors; 0 for a full model
    bool on_device;           // placed on the accelerator (false on the CPU device)
} lm_plan_ft;

typedef struct lm_plan_tensor {
    const char *name;         // points into the base
    lm_merge_need dev;        // its unit on the device (the CPU device: same as cpu)
    lm_merge_need cpu;        // its unit on the CPU
    uint64_t dev_bytes;       // dev.ws_bytes + dev.mag_bytes
    bool fits;                // merged and fits the device beside the placed factors
} lm_plan_tensor;

// CPU memory, bytes. RSS counts pages written, so buffers the engine reserves at their
// largest but fills less are counted as filled.
typedef struct lm_plan_cpu {
    uint64_t ws_reserved;     // (1 + n_ft) × slab_max float32, when the CPU's buffers exist
    uint64_t ws_touched;      // the part of them the tensors fill
    uint64_t residents;       // every adapter's factors as float32 (always in host memory)
    uint64_t adapter_mapped;  // adapters' tensor bytes read from their mapping (kept mapped)
    uint64_t out_host;        // the output piece
    uint64_t out_slab;        // an accelerator's output slab on the host (slab_max float32)
    uint64_t hist;            // the largest select_tensor histogram block, as written
    uint64_t mag;             // the largest DoRA magnitude buffer
    uint64_t mapped;          // the largest input bytes mapped at once (KEEP_MAPPED rule)
    uint64_t select;          // --topk global's model-wide histograms
    uint64_t device_host;     // a simulated device's buffers, which are host memory
    uint64_t runtime;         // the process itself: code, libraries, thread stacks (measured)
    uint64_t peak;            // the sum: the peak RSS estimate
} lm_plan_cpu;

typedef struct lm_plan {
    bool accelerator;         // !host_memory
    uint64_t budget;          // device bytes the merge may use (free, capped by --gpu-mem)
    int n_ft;
    lm_plan_ft *ft;           // (n_ft)
    uint64_t placed_bytes;    // factors placed on the device
    int n_place_fallback;
    int64_t n_tensors;
    lm_plan_tensor *tensors;  // (n_tensors) output order
    int64_t n_merged;         // tensors some FT changes (the merge units)
    int64_t n_fallback;       // merge units that will not fit and run on the CPU
    int64_t largest;          // the merge unit with the largest device need, or -1
    int64_t largest_fallback; // the largest of those that fall back, or -1
    uint64_t dev_peak;        // the most device memory in use at once
    int64_t slab_max;
    lm_plan_cpu cpu;
    uint64_t out_bytes;       // output tensor data
    int n_shards;
    char *out_parent;         // the directory OUT goes into
    bool disk_known;
    uint64_t disk_free;       // bytes available there to an unprivileged writer
} lm_plan;

// The bytes of the process without its buffers (code, libraries, thread stacks, allocator),
// measured on the fixtures' merges (their peak RSS is about this).
#define LM_PLAN_RUNTIME_BYTES (8ull << 20)

// Fills *p for merging `fts` (o->n_ft of them, opened as the merge opens them) into `base` on
// `dev`, writing shards of at most shard_size bytes to OUT `out`. Reads headers only. On
// success the caller frees p with lm_plan_free; on failure p holds nothing.
lm_status lm_plan_make(lm_plan *p, const lm_merge_opts *o, const lm_model *base, lm_ft *const *fts,
                       const lm_plan_device *dev, uint64_t shard_size, const char *out, lm_err *err);

// Frees what lm_plan_make allocated; safe on a zeroed plan.
void lm_plan_free(lm_plan *p);

// The directory `out` goes into: "a/b" for "a/b/c", "." for "c", "/" for "/c". A new string
// the caller frees, or NULL when out of memory.
char *lm_plan_parent(const char *out);

#endif
