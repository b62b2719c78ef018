// Passthrough merges with slices: layer stacking ("frankenmerges"), as mergekit's `passthrough`
// method builds them from a `slices:` list. Each slice takes the layers [from, to) of one model;
// the output's layers are the slices' layers stacked in order, so output layer j of a slice that
// starts at output layer s is its model's layer from + (j - s), and every tensor of a layer
// (`model.layers.<i>.<rest>`) is renamed to the output layer's index. The tensors outside the
// layers come whole from one model: those before the layers (the embeddings: a name holding
// "embed") from the first slice's model, the others (the final norm, lm_head) from the last
// slice's. A slice's `scale`, when given, multiplies every tensor taken from it (in float32),
// the embeddings and the final norm and lm_head included where they come from that slice, as
// mergekit's `tensor * scale` does. The output's config.json is the first slice's model's with
// `num_hidden_layers` set to the total and each per-layer array (a top-level array as long as
// the model's layers, such as `layer_types`) rebuilt from the slices' own models layer by layer.
//
// Everything is checked before anything is written: each range inside its model's layers (and
// not empty), the models of one architecture (architectures[0], model_type and
// tie_word_embeddings alike), a tensor kind of the layers (the name after the layer index) of
// one shape wherever it appears, and each tensor outside the layers of the shape the first
// model gives it. A mismatch is LM_ERR_MISMATCH naming the model, the tensor and both shapes.
// The output is then written tensor by tensor into an lm_st_writer, never a whole model in
// memory: a tensor kept in its dtype is copied from the mapping a piece at a time, any other
// is converted a slab at a time.
#ifndef LM_PASSTHROUGH_H
#define LM_PASSTHROUGH_H

#include <stdbool.h>
#include <stdint.h>

#include "model.h"
#include "st_writer.h"
#include "status.h"

// One slice: the layers [from, to) of `model` (a model directory, resolved by the caller),
// multiplied by `scale` when has_scale.
typedef struct lm_pt_source {
    const char *model;
    int64_t from, to;
    double scale;
    bool has_scale;
} lm_pt_source;

// One output tensor of a plan and where it comes from.
typedef struct lm_pt_tensor {
    const char *name;         // the output's name (owned by the plan)
    int slice;                // the slice it comes from (its scale applies)
    const lm_st_tensor *in;   // the input tensor, a view into that slice's model
    int64_t layer_in;         // its layer in that model, or -1 outside the layers
    int64_t layer_out;        // its layer in the output, or -1
} lm_pt_tensor;

typedef struct lm_pt_plan lm_pt_plan_t;

// Plans the stacked output of the n slices src (n >= 1): opens each distinct model once (the
// paths as given, compared as strings), checks the ranges, the architectures and the shapes as
// this header says, and builds the output's tensor list (the first model's tensors before the
// layers, then each output layer's tensors in their model's order, then the last model's
// tensors after the layers) and its config.json text. On success *out is a new plan the caller
// frees with lm_pt_plan_free; on failure *out is NULL and err names the slice, model, tensor or
// key: LM_ERR_USAGE for a bad range, LM_ERR_MISMATCH for models that do not stack, what
// lm_model_open returns for a model that does not open, LM_ERR_FORMAT for a config.json whose
// num_hidden_layers disagrees with its tensors, LM_ERR_UNSUPPORTED for a slice with a scale
// holding a tensor llmerge cannot compute with (integers, FP8).
lm_status lm_pt_plan(lm_pt_plan_t **out, const lm_pt_source *src, int n, lm_err *err);

// Frees the plan and closes its models; safe on NULL.
void lm_pt_plan_free(lm_pt_plan_t *p);

// The plan's output tensors (in the order the writer takes them) and their number, valid until
// lm_pt_plan_free.
const lm_pt_tensor *lm_pt_tensors(const lm_pt_plan_t *p, int64_t *n);

// The output's layer count.
int64_t lm_pt_n_layers(const lm_pt_plan_t *p);

// The output's config.json (a JSON object, two-space indented, each number as its model's file
// wrote it; its dtype keys left as the first model has them), valid until lm_pt_plan_free.
const char *lm_pt_config(const lm_pt_plan_t *p);

// The distinct models of the plan in the order the slices first name them (model 0 is the
// first slice's), and their number; slice i's is lm_pt_model(p, lm_pt_slice_model(p, i)).
// Valid until lm_pt_plan_free.
int lm_pt_n_models(const lm_pt_plan_t *p);
const lm_model *lm_pt_model(const lm_pt_plan_t *p, int i);
int lm_pt_slice_model(const lm_pt_plan_t *p, int slice);

// The slices as planned (copies of the caller's, the model paths included) and their number.
const lm_pt_source *lm_pt_slices(const lm_pt_plan_t *p, int *n);

// The writer's descriptors for the output in dtype out_dt (F32, F16 or BF16): one per tensor of
// lm_pt_tensors in that order, a tensor llmerge cannot compute with (integers, FP8) kept in its
// own dtype. The names point into the plan. *out is a new array the caller frees; LM_ERR_NOMEM
// only. (lm_model_out_dtype of the first model is the default out_dt.)
lm_status lm_pt_outputs(const lm_pt_plan_t *p, lm_dtype out_dt, lm_st_desc **out, int64_t *n, lm_err *err);

// Called after each tensor is written: done of total tensors, the last one's output name, the
// output bytes written so far of bytes_total.
typedef void (*lm_pt_progress_fn)(void *ctx, int64_t done, int64_t total, const char *name, uint64_t bytes_done,
                                  uint64_t bytes_total);

// What lm_pt_write did.
typedef struct lm_pt_result {
    uint64_t *xxh64;      // (n tensors) xxHash64 of each output tensor's data, in plan order
    int64_t n_scaled;     // tensors multiplied by their slice's scale
    int64_t n_converted;  // tensors converted to another dtype without a scale
    int64_t n_copied;     // tensors copied byte for byte
    uint64_t bytes_in, bytes_out;
} lm_pt_result;

// Writes every tensor of the plan into w, which was opened over lm_pt_outputs(p, out_dt): a
// tensor whose slice has no scale and whose dtype is out_dt (or one llmerge cannot compute with)
// is copied byte for byte, any other is read as float32, multiplied by its scale and written in
// out_dt, a slab of at most slab_elems elements at a time (0: 4 Mi), so memory stays bounded
// whatever the tensor's size. The input pages of each tensor are let go once it is written.
// Stops between tensors (and slabs) after SIGINT or SIGTERM (LM_ERR_INTERRUPTED, signals.h).
// progress (may be NULL) is called after each tensor. *res is filled (its xxh64 array
// allocated) on success; free it with lm_pt_result_free, also after a failure.
lm_status lm_pt_write(const lm_pt_plan_t *p, lm_dtype out_dt, lm_st_writer *w, int64_t slab_elems,
                      lm_pt_progress_fn progress, void *ctx, lm_pt_result *res, lm_err *err);

// Frees what lm_pt_write allocated in res and zeroes it; safe on a zeroed result.
void lm_pt_result_free(lm_pt_result *res);

#endif
