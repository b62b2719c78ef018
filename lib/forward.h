// The forward pass of LlamaForCausalLM, MistralForCausalLM and Qwen2ForCausalLM with Hugging
// Face semantics (docs/formats.md "The forward pass"), written once over the device interface: the
// same code runs on the CPU, on the simulated device and on any accelerator that fills in the
// forward-pass operations of lm_dev_i. A model's weights are converted to float32 and placed on
// the device once (lm_fwd_create); a LoRA adapter is applied without merging, y = x Wᵀ + b +
// s·(x Aᵀ) Bᵀ for every adapted linear layer (and the embedding LoRA on the token lookup),
// its modules_to_save replacing base tensors whole. A DoRA layer's output features are further
// scaled by m / ‖W + s·B@A‖ (the norm over each feature's row of the adapted weight), a scale
// computed once while placing the layer and folded into its W and B.
//
// Sequences of different lengths run together packed back to back: one row per real token,
// each row attending only to the rows of its own sequence, so no padding exists anywhere and a
// sequence gets the same values in any batch (to float32 rounding: see lm_fwd_runner_run). The activations of a batch live in one device
// allocation (the arena), sized for the batch's token count and reused while batches are no
// larger; it is allocated before the first layer runs, so a batch that does not fit fails with
// LM_ERR_DEVICE_OOM before anything was computed or reported.
//
// A hook sees, per layer, the inputs of the linear layers (for activation capture): the normed
// hidden state that q/k/v read, the attention output that o_proj reads, the normed hidden state
// that gate/up read and the product that down_proj reads, one row per real token.
//
// lm_fwd_runner adds the fallbacks of docs/design.md "Devices and the fallback contract" on top:
// weights that do not fit on the device make that model run on the CPU; a batch that does not
// fit is halved, and a single sequence that still does not fit runs on the CPU while the next
// batch tries the device again.
#ifndef LM_FORWARD_H
#define LM_FORWARD_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "adapter.h"
#include "device.h"
#include "fallback.h"
#include "model.h"
#include "status.h"

typedef struct lm_fwd lm_fwd;

// One sequence of token ids.
typedef struct lm_fwd_seq {
    const int32_t *ids;  // (len) each in [0, vocab_size)
    int64_t len;         // at least 1
} lm_fwd_seq;

// Where in a layer a hook is called: the input of which linear layers.
typedef enum lm_fwd_point {
    LM_FWD_ATTN_IN,  // q_proj, k_proj, v_proj read input_layernorm(h)        (rows, hidden)
    LM_FWD_O_IN,     // o_proj reads the attention output                     (rows, heads·head_dim)
    LM_FWD_MLP_IN,   // gate_proj, up_proj read post_attention_layernorm(h)   (rows, hidden)
    LM_FWD_DOWN_IN,  // down_proj reads silu(gate)·up                         (rows, intermediate)
    LM_FWD_N_POINTS
} lm_fwd_point;

// The first module a point feeds, as it is named in a layer: "self_attn.q_proj",
// "self_attn.o_proj", "mlp.gate_proj" or "mlp.down_proj" (static).
const char *lm_fwd_point_module(lm_fwd_point p);

// Called with x, device memory of `dev` holding rows × cols floats (row-major, one row per real
// token of the batch, sequences in batch order), valid only during the call. A status other
// than LM_OK stops the forward pass and is returned from it; LM_ERR_DEVICE_OOM makes a runner
// redo the batch in halves, so a hook that accumulates must not fail with it after it has
// changed anything.
typedef lm_status (*lm_fwd_hook)(void *ctx, lm_dev *dev, int layer, lm_fwd_point point, const float *x,
                                 int64_t rows, int64_t cols, lm_err *err);

// What a forward pass produces; anything NULL is not produced. With neither logits nor nll the
// pass stops after the last layer (no final norm, no lm_head).
typedef struct lm_fwd_req {
    float *logits;       // host (T, vocab_size): every row's logits, T = the batch's tokens
    float *nll;          // host (T): −log p(next token) per row; 0 on each sequence's last row
    lm_fwd_hook hook;
    void *hook_ctx;
} lm_fwd_req;

// Checks, allocating nothing, that the forward pass can run model `m` with adapter `a` (may be
// NULL): m is a known architecture whose tensors pass lm_model_check, a fits m
// (lm_adapter_validate) and is not DoRA with fan_in_fan_out, and m does not use Qwen2's
// per-layer sliding window or a rope scaling other than linear and llama3 (LM_ERR_UNSUPPORTED
// naming config.json and the key; Mistral's sliding window is applied). lm_fwd_create checks
// the same.
lm_status lm_fwd_check(const lm_model *m, const lm_adapter *a, lm_err *err);

// Places model `m` (a known architecture whose tensors pass lm_model_check) and, when `a` is not
// NULL, adapter `a` (validated against m here) on device `d`, every weight in float32: on a
// device with host memory an F32 tensor is used where it lies in the mapped file, anything else
// is converted into device memory. A DoRA module's W and B are always placed as new float32
// copies with its scale folded in (the norms taken a block of rows at a time, with scratch of
// a few MiB on the device and the host, freed before returning). Out of device memory is
// LM_ERR_DEVICE_OOM with nothing left allocated. m, a and d must outlive the result, which the
// caller frees with lm_fwd_free.
lm_status lm_fwd_create(lm_fwd **out, const lm_model *m, const lm_adapter *a, lm_dev *d, lm_err *err);

// Releases the weights and the arena; safe on NULL.
void lm_fwd_free(lm_fwd *f);

// The device the weights are on.
lm_dev *lm_fwd_device(const lm_fwd *f);

// Device bytes the weights took (tensors used in place in mapped files not counted).
size_t lm_fwd_weight_bytes(const lm_fwd *f);

// The weights converted to float32 on the host and uploaded so, for want of room on the device
// for their stored bytes beside them (the others go up as stored and are converted there).
int64_t lm_fwd_host_converted(const lm_fwd *f);

// Device bytes of the arena for a batch of n_tokens tokens (SIZE_MAX when it overflows).
size_t lm_fwd_arena_bytes(const lm_fwd *f, int64_t n_tokens);

// Runs the n_seqs sequences as one packed batch of T = Σ len tokens and fills what `req` asks
// for, rows in sequence order. The arena is (re)allocated when T exceeds what it holds:
// LM_ERR_DEVICE_OOM then, before any hook is called, with the arena released. A token id
// outside the vocabulary is LM_ERR_FORMAT naming the sequence and position.
lm_status lm_fwd_run(lm_fwd *f, const lm_fwd_seq *seqs, int64_t n_seqs, const lm_fwd_req *req, lm_err *err);

// ==== with fallbacks ==========================================================================

// Reports progress: `done` sequences of the current lm_fwd_runner_run are finished.
typedef void (*lm_fwd_progress_fn)(void *ctx, int64_t done);

typedef struct lm_fwd_runner {
    const lm_model *model;
    const lm_adapter *adapter;
    lm_dev *dev;              // the device asked for (not owned)
    const char *phase;        // "eval", in the fallback lines (not copied)
    const char *label;        // the model as the user named it (not copied)
    int64_t max_tokens;       // tokens per batch (a longer sequence forms a batch of its own)
    lm_fallback_fn note;      // says the fallbacks (fallback.h) and notes on batches; may be NULL
    void *note_ctx;
    lm_fwd_progress_fn progress;  // may be NULL
    void *progress_ctx;
    bool sticky;              // --sticky-fallback: once a sequence has gone to the CPU, every
                              // later batch runs there too (set after lm_fwd_runner_init)
    bool stuck;               // that has happened

    lm_fwd *on_dev;           // the weights on dev; NULL when they are on the CPU only
    lm_dev *cpu;              // the CPU device for fallbacks, dev's companion (lm_dev_cpu_companion)
    lm_fwd *on_cpu;           // the weights on it, placed when first needed

    // What happened, for the summary.
    bool weights_fell_back;   // the model runs on the CPU (its weights did not fit, or the
                              // device lacks forward-pass operations)
    int64_t weights_host_converted;  // of the weights on dev, those converted on the host
                                     // (lm_fwd_host_converted)
    int64_t n_batches;        // batches that ran to the end (halves count one each)
    int64_t n_halved;         // batches halved after running out of device memory
    int64_t n_seq_cpu;        // single sequences sent to the CPU after that
    int64_t tokens_dev, tokens_cpu;  // tokens run on dev and on the CPU
    double fallback_s;        // seconds spent on failed attempts and on CPU fallbacks
} lm_fwd_runner;

// Prepares *r (overwritten) for model m with adapter a (may be NULL) on device dev: places the
// weights there, or, when they do not fit (LM_ERR_DEVICE_OOM) or dev lacks a forward-pass
// operation, on the CPU, saying so through `note` as "fallback: PHASE weights of LABEL on cpu
// (REASON)". max_tokens <= 0 means 4096. Any other failure is returned with nothing left to
// free, its message starting "placing the weights of MODEL_DIR [with adapter ADAPTER_DIR] on
// DEVICE: " (with "tensor 'NAME': " next when one tensor was being placed). Free with
// lm_fwd_runner_free.
lm_status lm_fwd_runner_init(lm_fwd_runner *r, const lm_model *m, const lm_adapter *a, lm_dev *dev,
                             const char *phase, const char *label, int64_t max_tokens, lm_fallback_fn note,
                             void *note_ctx, lm_err *err);

// Runs the n_seqs sequences in packed batches of at most max_tokens tokens (in order; a sequence
// longer than that alone), filling req's host arrays for all of them together (rows of every
// sequence in order, as one lm_fwd_run of all would). A batch that runs out of device memory is
// halved (by sequences) and each half run in turn; a single sequence that does not fit runs on
// the CPU; each of these is said through note. Every row gets the values it gets in any other
// batch on any device to float32 rounding (bit for bit where the GEMM rounds a row the same
// whatever rows are beside it: OpenBLAS does at model sizes, not always for tiny matrices).
lm_status lm_fwd_runner_run(lm_fwd_runner *r, const lm_fwd_seq *seqs, int64_t n_seqs, const lm_fwd_req *req,
                            lm_err *err);

// Frees the weights on both devices and the CPU device the runner opened; safe on a zeroed
// runner and twice.
void lm_fwd_runner_free(lm_fwd_runner *r);

// ==== sizes for llmerge plan ==================================================================

// What lm_fwd_create will place for a model, from headers only (no tensor data is read).
typedef struct lm_fwd_plan {
    uint64_t weight_bytes;   // device bytes of the weights (lm_fwd_weight_bytes once created)
    uint64_t placing_peak;   // device bytes at most while they are placed (DoRA's scratch
                             // blocks beside them): they fit a device when this does
    uint64_t mapped_bytes;   // input bytes read from the mapped files, used in place or converted
    uint64_t host_scratch;   // the largest host copy made while placing (a tensor as float32 on a
                             // device without host memory, a bias sum, the embedding LoRA's Aᵀ)
    int64_t hidden, inter, heads, kv_heads, head_dim, vocab;
    int64_t max_r;           // the largest LoRA rank the pass applies (0 without)
} lm_fwd_plan;

// Fills *p for lm_fwd_create(m, a) on a device with or without host memory: the same checks
// (lm_fwd_check, the adapter's modules all used) and the same rule per tensor as placing. Returns
// what lm_fwd_create would return for a bad model or adapter; allocates nothing that outlives
// the call.
lm_status lm_fwd_plan_make(lm_fwd_plan *p, const lm_model *m, const lm_adapter *a, bool host_memory, lm_err *err);

// The device bytes of the arena for a batch of n_tokens tokens (lm_fwd_arena_bytes of the
// created model; SIZE_MAX when it overflows), and the part of it a pass without logits writes
// (activation capture: the logits rows are allocated and never touched).
size_t lm_fwd_plan_arena_bytes(const lm_fwd_plan *p, int64_t n_tokens);
size_t lm_fwd_plan_arena_touched(const lm_fwd_plan *p, int64_t n_tokens);

// The tokens per batch of a runner given max_tokens (lm_fwd_runner_init's default for <= 0).
int64_t lm_fwd_plan_max_tokens(int64_t max_tokens);

// A fallback the runner will report: sequences [first, first + n) of `tokens` tokens halved, or
// (halved false, n 1) sequence `first` (0-based) sent to the CPU; `need` the arena bytes asked.
typedef struct lm_fwd_plan_note {
    bool halved;
    int64_t first, n, tokens;
    size_t need;
} lm_fwd_plan_note;
typedef void (*lm_fwd_plan_note_fn)(void *ctx, const lm_fwd_plan_note *note);

// What lm_fwd_runner_run does with sequences of these lengths.
typedef struct lm_fwd_plan_run {
    int64_t n_formed;        // batches of at most max_tokens tokens (a longer sequence alone)
    int64_t formed_tokens;   // the largest of them
    int64_t n_batches;       // batches run, halves counted one each (lm_fwd_runner's n_batches)
    int64_t n_halved, n_seq_cpu;
    int64_t tokens_dev, tokens_cpu;
    int64_t dev_tokens;      // the largest batch run on the device: the arena it keeps
    int64_t cpu_tokens;      // the largest batch run on the CPU
    bool stuck;              // --sticky-fallback took effect
} lm_fwd_plan_run;

// Forms the batches as lm_fwd_runner_run does and follows run_batch's fallbacks: a batch runs
// on the device (on_device: the weights are there) when its arena fits in `avail` bytes, else
// it is halved, and a single sequence that does not fit runs on the CPU (and, with sticky, every
// later one). Each fallback goes to note (may be NULL) in the order the runner reports them.
void lm_fwd_plan_runner(const lm_fwd_plan *p, const int64_t *lens, int64_t n_seqs, int64_t max_tokens,
                        bool on_device, uint64_t avail, bool sticky, lm_fwd_plan_note_fn note, void *ctx,
                        lm_fwd_plan_run *r);

#endif
