// The merge commands' command line (cmd/merge.c runs them): the options of the methods llmerge
// merges with (each method's descriptor, lib/methods/, gives its --help text and the fields its
// options derive from), --help, and the parsing of argv into merge_args. Private to cmd/: merge.c and
// merge_args.c share it.
#ifndef LM_CMD_MERGE_ARGS_H
#define LM_CMD_MERGE_ARGS_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "args.h"
#include "dtype.h"
#include "merge.h"
#include "merge_params.h"
#include "method.h"
#include "params.h"
#include "status.h"
#include "vocab.h"

// Which options of the merge commands method m reads, derived from its descriptor (method.h):
// an option a method does not read is said to have no effect in --help and, when given, in a
// note before the work.
typedef struct merge_uses {
    bool weights;   // --weights: unless m->ignores_weights (sce, ramplus-tl, slerp, karcher,
                    // model-stock, nearswap)
    bool normalize; // --normalize, --no-normalize: unless m->ignores_normalize (those and nuslerp)
    bool lambda;    // --lambda: unless m->ignores_lambda (sce and the interpolations: linear, the
                    // slerps, karcher, model-stock, nearswap)
    bool density;   // --density, --densities: m->density
    bool sign;      // --sign: m->elect
    bool topk;      // --topk: a top-k trim, m->rank
    bool rescale;   // --rescale: the random drop, m->drop
    bool seed;      // --seed: the random drop, m->drop
    bool hessians;  // --calib and the Hessians' options, and what --cache-dir keeps: importance
                    // ranks (LM_RANK_IMPORTANCE), which come from the Hessians of calibration data
    bool t;         // --t: m->reads_t
    bool gamma;     // --gamma: m->outliers
    bool epsilon;   // --epsilon: m->della (its spread) or m->threshold (ram's threshold)
    bool threshold; // --epsilon is ram's threshold: m->threshold
    bool ramplus;   // --r, --alpha: m->ramplus
    bool per_row;   // --per-row: m->rows_ok
    bool per_col;   // --per-column: m->cols_ok
    bool select_topk;  // --select-topk: m->sce
    bool iter;      // --max-iter, --tol: m->reads_iter
    bool models_only;  // --models-only: task vectors or the models themselves (LM_METHOD_EITHER)
    bool models;    // the inputs are models, the first the reference (LM_METHOD_MODELS): --weights
                    // has one weight more
} merge_uses;

// The options method m reads. Allocates nothing.
merge_uses lm_merge_uses(const lm_method *m);

typedef enum opt_id {
    OPT_OUTPUT, OPT_WEIGHTS, OPT_DENSITY, OPT_DENSITIES, OPT_LAMBDA, OPT_NORMALIZE,
    OPT_NO_NORMALIZE, OPT_SIGN, OPT_TOPK, OPT_RESCALE, OPT_SEED, OPT_DTYPE, OPT_SHARD_SIZE,
    OPT_DEVICE, OPT_GPU_MEM, OPT_THREADS, OPT_CACHE_DIR, OPT_LOG_JSON, OPT_QUIET, OPT_VERBOSE,
    OPT_FORCE, OPT_CALIB, OPT_CALIB_SAMPLES, OPT_SEQ_LEN, OPT_HESSIAN_FROM, OPT_STICKY, OPT_NO_CARD,
    OPT_STRICT, OPT_T, OPT_MAX_ITER, OPT_TOL, OPT_MODELS_ONLY, OPT_GAMMA, OPT_EPSILON, OPT_PER_ROW, OPT_SELECT_TOPK, OPT_PER_COL, OPT_RAM_R, OPT_RAM_ALPHA,
    OPT_TO_LORA, OPT_TO_LORA_ENERGY, OPT_RANK, OPT_TOKENIZER, OPT_DATA_FORMAT, OPT_HELP,
} opt_id;

// The options every merge command takes, for lm_cmd_scan and the output guard.
extern const lm_opt lm_merge_opt_defs[];
extern const size_t lm_merge_n_opts;

#define DEFAULT_DENSITY 0.2
#define DEFAULT_SHARD_SIZE 5000000000ull  // "5GB", as transformers

// The options that take per-tensor settings (params.h) on the command line: a per-input one
// (--weights, --density/--densities, --gamma, --epsilon) as settings separated by '|', one for
// every input or one per input; a merge-wide one (--t, --lambda) as one setting.
typedef enum set_id {
    SET_WEIGHT, SET_DENSITY, SET_GAMMA, SET_EPSILON, SET_T, SET_LAMBDA, SET_SELECT_TOPK, SET_COUNT
} set_id;

// The settings of one such option: NULL where the option gave plain numbers (or was not given).
typedef struct cli_setting {
    lm_pval **v;  // (n)
    int n;
    char *text;   // the option's value as given
} cli_setting;

// What the command line says, parsed but not yet checked against the inputs.
typedef struct merge_args merge_args;
struct merge_args {
    const lm_method *m;
    merge_uses use;            // lm_merge_uses(m), set by lm_merge_parse_args
    const char *base;
    const char **fts;          // (n_ft) pointers into argv
    int n_ft;
    const char *out;
    double *weights;           // (n_weights) or NULL: 1 each
    int n_weights;
    double *densities;         // (n_densities) or NULL: DEFAULT_DENSITY each
    int n_densities;
    const char *density_opt;   // "--density" or "--densities", whichever came last
    double lambda;
    int normalize;             // -1: the method's default
    lm_sign_rule sign;
    bool topk_global;
    lm_rescale rescale;
    uint64_t seed;
    bool have_dtype;
    lm_dtype dtype;
    uint64_t shard_size;
    const char *device;
    uint64_t gpu_mem;          // 0: not given
    int threads;               // 0: all cores
    const char *cache_dir;
    const char *log_json;
    bool quiet, force, help;
    bool no_card;              // --no-card: no README.md in OUT
    int verbose;
    const char **calib;        // (n_calib) sparsegpt's calibration files
    int n_calib;
    int64_t calib_samples;     // 0: all
    int64_t seq_len;           // 0: the model's max_position_embeddings
    bool hessian_from_base;
    bool sticky;               // --sticky-fallback, for the Hessians' forward pass
    bool strict;               // --strict: an FT tensor the base does not have is an error
    double t;                  // --t (default 0.5)
    double select_topk;        // --select-topk (default 1)
    double *gammas;            // (n_gammas) --gamma, or NULL: 0.01 each
    int n_gammas;
    double *epsilons;          // (n_epsilons) --epsilon, or NULL: lm_method_epsilon's each
    int n_epsilons;
    int max_iter;              // --max-iter (default 10)
    double tol;                // --tol (default 1e-5)
    double ram_r, ram_alpha;   // --r, --alpha (defaults 0.1, 0.2)
    bool models_only;          // --models-only
    bool per_row;              // --per-row
    bool per_col;              // --per-column
    bool extract;              // llmerge extract (its --rank is --to-lora)
    const char *tokenizer;     // --tokenizer DIR: tokenizer.json for --calib's text (default: BASE's)
    bool calib_text;           // --data-format text: each --calib file is one text document
    int to_lora;               // --to-lora RANK: OUT is a LoRA adapter of that rank (0: a model)
    bool to_lora_exact;        // --to-lora exact: the adapter inputs' factors concatenated
    lm_dtype lora_dtype;       // --to-lora: the adapter's dtype (--dtype, else the base's; exact:
                               // else float32); the merge's own output is then float32
    double to_lora_energy;     // --to-lora-energy F: per tensor the rank that keeps F of Δ's
                               // energy, at most to_lora (0: to_lora each)
    bool given[OPT_HELP + 1];  // which options appeared
    cli_setting sets[SET_COUNT];  // per-tensor settings given on the command line
    // llmerge run: the settings of a configuration file (the parse of cmd/run.c sets them), else
    // NULL; with sets[] given, the merge builds its own from those (merge.c)
    lm_merge_params *params;
    // with params: what the card and llmerge.json say, in place of the number, of a parameter
    // whose setting varies from tensor to tensor (a gradient, filters); NULL where it is one
    // number, which the merge's options then hold (merge.c)
    const char **weight_text;  // (n_ft)
    const char **density_text; // (n_ft)
    const char *lambda_text;
    const char *base_weight_text;  // the first model's weight (linear, karcher, the --models-only
                                   // slerps), likewise
    // what llmerge run adds (cmd/run.c): its context, freed by preset_free with the run, and its
    // work on the inputs before they are opened (the PATH+LORA models), or NULL
    void *preset;
    void (*preset_free)(void *preset);
    lm_status (*prepare_inputs)(merge_args *a, lm_progress *p, lm_err *err);
    bool planning;  // prepared for llmerge plan, which writes nothing (prepare_inputs makes no model)
    // llmerge run: the configuration's text, written into OUT as mergekit_config.yml and shown
    // in the model card (NULL for the merge commands)
    const char *config_text;
    const char *config_path;
    // llmerge run: where the base ([0]) and each FT ([1 + i]) were written in the configuration
    // ("FILE:LINE:COL: model 'NAME'"), the prefix of a message about one of them; NULL elsewhere
    const char *const *input_where;
    // how messages name the base ([0]) and each FT: llmerge run's "base_model 'NAME'" and
    // "model 'NAME'", else set by the merge's prepare to "BASE", "FT 1", ...
    const char *const *input_name;
    // llmerge run of one slice with a method: its layer_range's N, which must be the base's
    // layer count, and where the slice was written ("FILE:LINE:COL: slices[0]"); 0 and NULL
    // elsewhere
    int64_t slice_layers;
    const char *slice_where;
    const char *tokenizer_dir;  // tokenizer files from this model's directory rather than BASE's
    const char *chat_template;  // set in OUT's tokenizer_config.json, or NULL
    const char *note;           // a line said before the work (a key that changes nothing), or NULL
    // llmerge run: the vocabulary the embeddings are rebuilt to (cmd/merge_vocab.c), or NULL
    // where every model's rows already are its ids; where it comes from, for messages; whether
    // the base's row fills a token some models lack (mergekit: when there is a base_model)
    const lm_vocab *vocab;
    const char *vocab_source;
    bool vocab_prefer_base;
};

// llmerge run with a->vocab: opens the FTs (into fts, n_ft of them, zeroed by the caller) with
// every full model's embedding matrices, and the base's, rebuilt to a->vocab's ids
// (cmd/merge_vocab.c), the rows written into unnamed files beside OUT; without `data` the files
// only have the right size (llmerge plan). Says what moved through p. LM_ERR_UNSUPPORTED for an
// input whose rows cannot be rebuilt (an adapter that changes them, no tokenizer.json in the
// base, no vocab_size), naming it; what lm_ft_open says of a bad FT.
lm_status lm_cmd_vocab_open(const merge_args *a, lm_model *base, lm_ft **fts, bool data, lm_progress *p,
                            lm_err *err);

// --to-lora (cmd/merge_lora.c): the merge's output made into a PEFT LoRA adapter of BASE.
typedef struct lm_cmd_lora lm_cmd_lora;
// The columns the range finder adds to the rank, and the base's values a matrix's change is made
// with at once (on a device, the chunks it is made with there): what llmerge plan sizes too.
#define LM_LORA_OVERSAMPLE 10
#define LM_LORA_DELTA_CHUNK ((int64_t)1 << 20)
// Before any work: --to-lora-energy without --to-lora, a rank above a matrix's smaller side, a
// floating tensor of more than two dimensions: LM_ERR_USAGE or LM_ERR_UNSUPPORTED naming it.
lm_status lm_cmd_lora_check(const merge_args *a, const lm_model *base, lm_err *err);
// The adapter being made from the merge of a (whose output descriptors, n of them and float32
// for every floating tensor, are descs) on dev, stored in dtype; notes through p.
lm_status lm_cmd_lora_begin(lm_cmd_lora **out, const merge_args *a, const lm_model *base, const lm_st_desc *descs,
                            int64_t n, lm_dev *dev, lm_dtype dtype, lm_progress *p, lm_err *err);
// lm_merge_hooks' put and tensor_done.
lm_status lm_cmd_lora_put(lm_cmd_lora *l, int64_t idx, uint64_t offset, const void *data, uint64_t nbytes,
                          lm_err *err);
lm_status lm_cmd_lora_done(lm_cmd_lora *l, int64_t idx, lm_err *err);
// --to-lora exact, before any work: every FT an adapter (not DoRA, not fan_in_fan_out), the
// method task-arithmetic or linear with the base's coefficient 1 in every tensor, no tensor both
// saved whole and factored. LM_ERR_USAGE naming what is not.
lm_status lm_cmd_lora_exact_check(const merge_args *a, const lm_merge_opts *o, const lm_model *base,
                                  lm_ft *const *fts, lm_err *err);
// --to-lora exact: the adapter made from the inputs' factors, concatenated per module with each
// FT's coefficient (lm_merge_linear_coefs) and scale folded into its B; biases and saved tensors
// merged whole. No merge runs and no SVD.
lm_status lm_cmd_lora_exact(lm_cmd_lora *l, const lm_merge_opts *o, lm_ft *const *fts, lm_err *err);
// Writes the adapter's two files into dir.
lm_status lm_cmd_lora_finish(lm_cmd_lora *l, const char *dir, lm_err *err);
// A line on what was written: matrices as factors, their ranks and errors, tensors whole.
void lm_cmd_lora_summary(const lm_cmd_lora *l, lm_progress *p);
// llmerge.json's outputs.adapter: the files, rank, and per tensor how it was written.
lm_status lm_cmd_lora_manifest(const lm_cmd_lora *l, cJSON *outputs, lm_err *err);
void lm_cmd_lora_free(lm_cmd_lora *l);

// llmerge extract BASE FT -o ADAPTER --rank R (cmd/extract.c): the merge's parse.
lm_status lm_cmd_extract_parse(merge_args *a, int argc, char **argv, lm_err *err);
void lm_cmd_extract_usage(FILE *out, const void *arg);

// Frees the settings of sets[] (not the struct).
void lm_merge_args_free_sets(merge_args *a);

// Input i (0 the base, 1 + j FT j) for the prefix of a message about it: where llmerge run's
// configuration wrote it, else its name ("BASE", "FT 2"). Once the merge's prepare has named
// the inputs (input_name).
const char *lm_merge_input_where(const merge_args *a, int i);

// Sets the defaults of the options in a (zeroed by the caller): lambda 1, the method's
// normalize, shard size, device auto, t, max_iter, tol.
void lm_merge_args_defaults(merge_args *a);

// Applies merge option `d` with value `v` (NULL for a flag) to a merge_args (ctx); `shown` is
// how the user wrote it. LM_ERR_USAGE naming the option. lm_cmd_scan's lm_opt_fn.
lm_status lm_merge_apply_option(void *ctx, const lm_opt *d, const char *shown, const char *v, lm_err *err);

// llmerge run (cmd/run.c): reads the configuration at `path` into a (its method, inputs,
// options and per-tensor settings; the configuration itself kept in a->preset until the run is
// freed). Errors name the file, line and column (exit status 2).
lm_status lm_cmd_run_config(merge_args *a, const char *path, lm_err *err);

// Runs a merge whose arguments `parse_fn` reads from argv (argv[0] the command's name): the merge
// commands' steps (command.h) with that parse, `usage_fn` for --help, `prefix` before messages
// and `first` naming the operands for the output guard. llmerge run's entry. Returns the exit
// status.
int lm_cmd_merge_with(const char *prefix, void (*usage_fn)(FILE *out, const void *arg),
                      lm_status (*parse_fn)(merge_args *a, int argc, char **argv, lm_err *err), const char *first,
                      int argc, char **argv);

// llmerge run: what OUT gets besides a merge's files, into out_dir (the temporary directory):
// the configuration as mergekit_config.yml, tokenizer_source's tokenizer files and the chat
// template. Nothing for the merge commands.
lm_status lm_cmd_run_outputs(const merge_args *a, const char *out_dir, lm_err *err);

// llmerge plan CONFIG.yml: argv[0] the configuration, the rest llmerge run's options, read into
// a as llmerge run reads them.
lm_status lm_cmd_run_parse_file(merge_args *a, int argc, char **argv, lm_err *err);

// Writes OUT's model card (card.h) into `dir` for the merge of a with options o over the
// opened inputs fts (cmd/merge_card.c). LM_ERR_IO naming the file, LM_ERR_NOMEM.
lm_status lm_merge_write_card(const merge_args *a, const lm_merge_opts *o, const lm_ft *const *fts, const char *dir,
                              lm_err *err);

// mergekit's PATH+LORA for a PATH other than the base (cmd/run_lora.c): the model at `path` with
// the adapter `lora` merged into it, made in the cache directory (cache_dir, or the default of
// lib/cache.h) unless an earlier run made it; *out is its directory (the caller frees), *made
// whether this call made it. Errors name both inputs.
lm_status lm_cmd_lora_model(const char *path, const char *lora, const char *cache_dir, int threads, char **out,
                            bool *made, lm_err *err);

// Prints the --help of method m to out.
void lm_merge_usage(FILE *out, const lm_method *m);

// Parses argv (argv[0] the method's name) into a, whose m is already set (use is set here); a->fts (and the
// weight and density lists) are allocated and freed by the caller. LM_ERR_USAGE naming the
// option or value that is wrong.
lm_status lm_merge_parse_args(merge_args *a, int argc, char **argv, lm_err *err);

#endif
