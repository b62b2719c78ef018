// Planning a merge before it runs (`llmerge plan`): from the merge options, the opened base and
// fine-tuned inputs (headers only: no tensor data is read) and a description of the device,
// what each phase will allocate and where: each adapter's float32 LoRA factors and whether
// they fit the device after the ones before them (place_residents' order), each tensor's
// device working set and whether it fits beside the factors (lm_eng_run_unit's ws_alloc), the CPU's
// buffers and a peak RSS estimate, and the output's bytes, shards and the disk space beside
// it. The per-tensor figures come from the merge engine's own rules (lm_merge_plan_tensor), so
// the predicted fallbacks are the ones a run on the same device reports.
//
// For sparsegpt it adds the Hessian capture before the merge, one phase per model whose
// Hessians are computed (lm_hess_ucc2_model's steps, sized by lm_fwd_plan_*, lm_hess_plan_make
// and the calibration files' sequence lengths): the forward pass's float32 weights and whether
// they fit the device, the Hessian accumulators and where they go, the activations of each
// batch, which batches the runner will halve or send to the CPU, the largest batch that fits,
// and the host memory of each step; and the importance buffers the merge adds per tensor.
#ifndef LM_PLAN_H
#define LM_PLAN_H

#include <stdbool.h>
#include <stdint.h>

#include "calib.h"
#include "forward.h"
#include "hessian.h"
#include "merge.h"

// The device a plan is for, as the merge would open it.
typedef struct lm_plan_device {
    const char *name;      // "cpu", "cuda:0", "sim:64KiB"; not copied
    bool host_memory;      // the CPU: no placement, no fallback
    uint64_t free_bytes;   // what the device reports free (an accelerator)
    uint64_t total_bytes;
    uint64_t cap;          // --gpu-mem, 0 for none
    bool forward_ops;      // it has the forward pass's operations (lm_dev_supports LM_OP_FORWARD)
    bool importance_ops;   // it has sparsegpt's importance operations (else that merge runs on the CPU)
    bool factor_op;        // it has the Cholesky factorisation (lm_dev_potrf; else the CPU's is used)
} lm_plan_device;

// What the cache holds for one model's Hessians (sparsegpt).
typedef enum lm_plan_cached {
    LM_PLAN_CACHE_NONE,   // nothing: the capture runs
    LM_PLAN_CACHE_HESS,   // its Hessians: no forward pass, U_cc² computed from them
    LM_PLAN_CACHE_UCC2,   // its U_cc²: nothing to compute
    LM_PLAN_CACHE_MASKS,  // the top-k masks of every FT it serves: its Hessians are not needed
} lm_plan_cached;

// sparsegpt's Hessians as the merge will get them.
typedef struct lm_plan_hess_in {
    const lm_calib *calib;        // (n_calib) the files as the merge read them (caps applied)
    int n_calib;                  // 1 for every FT, or one per FT
    bool from_base;               // --hessian-from base: the base's Hessians, once, for all
    bool sticky;                  // --sticky-fallback
    const lm_plan_cached *cached; // (one per capture: 1 with from_base, else n_ft; HESS or UCC2)
                                  // what the cache holds, or NULL: nothing
    const bool *mask_hit;         // (n_ft) the FT's top-k masks are in the cache, or NULL: none
    const char *cache_dir;        // where the merge keeps Hessians, U_cc² and masks (NULL: none)
    bool keep_hessians;           // it keeps the Hessians too (lm_cache_keeps_hessians)
} lm_plan_hess_in;

// One fallback the capture's runner will report (lm_fwd_plan_note, 0-based).
typedef lm_fwd_plan_note lm_plan_capture_note;

// Host memory of one capture, bytes (the process's other holdings are in lm_plan_capture.held).
typedef struct lm_plan_capture_cpu {
    uint64_t held;            // what stays through it: runtime, calibration data, U_cc² sets
                              // of the models before, input pages read so far
    uint64_t weights;         // the float32 weights on the CPU (converted; F32 used in place)
    uint64_t device_host;     // a simulated device's weights, accumulators and activations
    uint64_t activations;     // the CPU's arena as written, and each forward's staged ids
    uint64_t accumulators;    // the accumulators in host memory
    uint64_t stage;           // a device batch copied to the host for host accumulators
    uint64_t placing;         // the peak while the weights are placed (their host copies)
    uint64_t capturing;       // the peak while batches run
    uint64_t finishing;       // the peak while each Hessian becomes U_cc² (weights freed)
    uint64_t peak;            // the largest of the three
} lm_plan_capture_cpu;

// The Hessian capture of one model (lm_hess_ucc2_model), or its cache entry.
typedef struct lm_plan_capture {
    int ft;                       // the FT whose Hessians these are (0-based); -1: the base's
    const char *label;            // the model as the merge names it (not copied)
    const char *calib;            // its calibration file (not copied)
    int64_t n_seqs, n_tokens, longest;
    lm_plan_cached cached;
    int64_t max_tokens;           // tokens per batch
    lm_fwd_plan fwd;              // the weights on the device asked for (where they try first)
    lm_fwd_plan fwd_cpu;          // the same placed on the CPU (where they go when they do not fit)
    bool weights_on_device;       // an accelerator that has the operations and room for them
    const char *weights_why;      // why not, on an accelerator (static)
    uint64_t reserve;             // device bytes kept for activations beside the accumulators
    lm_hess_plan hess;            // the accumulators
    uint64_t avail;               // device bytes left for a batch's activations
    int64_t fit_tokens;           // the largest batch whose activations fit (up to the largest
                                  // the runner forms; 0: none fits)
    uint64_t arena_bytes;         // the activations of the largest batch formed
    lm_fwd_plan_run run;          // what the runner does with the batches
    lm_plan_capture_note *notes;  // (n_notes) its fallbacks, in order
    int64_t n_notes;
    uint64_t dev_peak;            // device bytes at most (an accelerator)
    uint64_t factor_dev_peak;     // device bytes at most while the Hessians are factored there
    int64_t factor_fallbacks;     // factorisations that do not fit on the accelerator (on the CPU)
    lm_plan_capture_cpu cpu;
} lm_plan_capture;

typedef struct lm_plan_ft {
    uint64_t resident_bytes;  // float32 LoRA factors; 0 for a full model
    bool on_device;           // placed on the accelerator (false on the CPU device)
} lm_plan_ft;

typedef struct lm_plan_tensor {
    const char *name;         // points into the base
    lm_merge_need dev;        // its unit on the device (the CPU device: same as cpu)
    lm_merge_need cpu;        // its unit on the CPU
    lm_merge_imp_need imp_dev;  // sparsegpt: its importance buffers on the device
    lm_merge_imp_need imp_cpu;  // ... on the CPU
    uint64_t dev_bytes;       // dev.ws_bytes + dev.mag_bytes (+ imp_dev's keys and U_cc²)
    bool fits;                // merged and fits the device beside the placed factors
} lm_plan_tensor;

// CPU memory, bytes. RSS counts pages written, so buffers the engine reserves at their
// largest but fills less are counted as filled.
typedef struct lm_plan_cpu {
    uint64_t ws_reserved;     // (1 + n_ft) × slab_max float32 (sce: one more), when the CPU's buffers exist
    uint64_t ws_touched;      // the part of them the tensors fill
    uint64_t residents;       // every adapter's factors as float32 (always in host memory)
    uint64_t adapter_mapped;  // adapters' tensor bytes read from their mapping (kept mapped)
    uint64_t out_host;        // the output piece
    uint64_t out_slab;        // an accelerator's output slab on the host (slab_max float32)
    uint64_t hist;            // the largest lm_eng_select_tensor histogram block, as written
    uint64_t mag;             // the largest DoRA magnitude buffer
    uint64_t mapped;          // the largest input bytes mapped at once (KEEP_MAPPED rule)
    uint64_t select;          // --topk global's model-wide histograms
    uint64_t device_host;     // a simulated device's buffers, which are host memory
    uint64_t keys_reserved;   // sparsegpt: n_ft importance buffers of slab_max float32 (CPU)
    uint64_t keys_touched;    // ... the part of them the tensors fill
    uint64_t hessian_sets;    // sparsegpt: the U_cc² every FT's importance reads
    uint64_t masks;           // sparsegpt: top-k masks read from the cache (whole), and the
                              // largest tensor's masks recorded for it
    uint64_t calib;           // sparsegpt: the calibration files' ids, as read
    uint64_t runtime;         // the process itself: code, libraries, thread stacks (measured), and
                              // the input hasher's mapped window (merges)
    uint64_t peak;            // the sum: the merge's peak RSS estimate
} lm_plan_cpu;

typedef struct lm_plan {
    bool accelerator;         // the merge runs on an accelerator (!host_memory, and for
                              // sparsegpt one with the importance operations)
    bool dev_accelerator;     // the device is one (!host_memory)
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
    uint64_t dev_peak;        // the most device memory in use at once (the merge)
    int64_t slab_max;
    lm_plan_cpu cpu;          // the merge phase
    lm_plan_capture *captures;  // (n_captures) sparsegpt: in the order the merge runs them
    int n_captures;
    uint64_t cpu_peak;        // the CPU's peak over every phase
    int cpu_peak_phase;       // where it is: -1 the merge, else the capture of that index
    uint64_t out_bytes;       // output tensor data
    int n_shards;
    uint64_t cache_bytes;     // sparsegpt: what the merge writes into the cache directory
    bool cache_known;
    uint64_t cache_free;      // bytes available there (when cache_known)
    char *out_parent;         // the directory OUT goes into
    bool disk_known;
    uint64_t disk_free;       // bytes available there to an unprivileged writer
} lm_plan;

// The bytes of the process without its buffers (code, libraries, thread stacks, allocator),
// measured on the fixtures' merges (their peak RSS is about this).
#define LM_PLAN_RUNTIME_BYTES (8ull << 20)

// Fills *p for merging `fts` (o->n_ft of them, opened as the merge opens them) into `base` on
// `dev`, writing shards of at most shard_size bytes to OUT `out`; for sparsegpt `hin` says
// how its Hessians come (NULL for the other methods). Reads headers only (and the sequence
// lengths of the calibration files already read). On success the caller frees p with
// lm_plan_free; on failure p holds nothing.
lm_status lm_plan_make(lm_plan *p, const lm_merge_opts *o, const lm_model *base, lm_ft *const *fts,
                       const lm_plan_device *dev, const lm_plan_hess_in *hin, uint64_t shard_size, const char *out,
                       lm_err *err);

// Frees what lm_plan_make allocated; safe on a zeroed plan.
void lm_plan_free(lm_plan *p);

#endif
