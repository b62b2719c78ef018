// The subcommands of the llmerge command line. Each takes its own argv (argv[0] is the
// subcommand's name), parses its options, prints what it has to say, and returns the process
// exit status: 0 done, 1 the work failed, 2 bad usage or bad input (lm_status_exit_code). Error
// messages go to stderr as "llmerge COMMAND: MESSAGE".
#ifndef LM_CMD_H
#define LM_CMD_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

// `llmerge inspect PATH [--base DIR] [--json]`: describes a safetensors file, a model directory
// or an adapter directory (validated against --base when given). Allocates nothing that
// outlives the call.
int lm_cmd_inspect(int argc, char **argv);

// `llmerge METHOD BASE FT [FT...] -o OUT [options]`, METHOD one of lib/methods/ (ties, dare,
// ...): merges the fine-tuned inputs into BASE by the method named in argv[0] and writes the
// model directory OUT atomically (nothing is left there when it fails). Allocates nothing that
// outlives the call.
int lm_cmd_merge(int argc, char **argv);

// `llmerge eval MODEL [--adapter DIR] --data FILE [options]`: prints the perplexity of MODEL
// (with the adapter applied, not merged) on the token data FILE. Allocates nothing that
// outlives the call.
int lm_cmd_eval(int argc, char **argv);

// `llmerge passthrough -o OUT --slice MODEL:FROM:TO[:SCALE] [--slice ...] [options]`: stacks the
// slices' layers into the model directory OUT (passthrough.h), written atomically. Allocates
// nothing that outlives the call.
int lm_cmd_passthrough(int argc, char **argv);
// llmerge passthrough with argv built from a configuration (cmd/run.c): OUT also gets
// config_text as mergekit_config.yml and, where chat_template is not NULL, that chat template
// (lm_cmd_config_files); messages start with prefix.
int lm_cmd_passthrough_config(int argc, char **argv, const char *config_text, const char *chat_template,
                              const char *prefix);
// llmerge tokenize MODEL FILE [-o OUT.jsonl] (cmd/tokenize.c).
int lm_cmd_tokenize(int argc, char **argv);
// llmerge extract BASE FT -o ADAPTER --rank R (cmd/extract.c).
int lm_cmd_extract(int argc, char **argv);
int lm_cmd_run(int argc, char **argv);

// `llmerge hessian MODEL [--adapter DIR] --calib FILE -o H.safetensors [options]`: writes the
// input Hessians of MODEL's linear layers (with the adapter applied, not merged) over the
// calibration tokens as one safetensors file, atomically. Allocates nothing that outlives the
// call.
int lm_cmd_hessian(int argc, char **argv);

// The Levenshtein distance between a and b (64 or more for strings over 63 bytes), for "did
// you mean" suggestions.
size_t lm_cmd_edit_distance(const char *a, const char *b);

// When `name` is one of mergekit's merge methods that llmerge does not have (its merge_method
// values, with - or _ between words), writes into buf (cap bytes) that llmerge does not have it
// and returns true; returns false for any other name. Allocates nothing.
bool lm_cmd_mergekit_hint(const char *name, char *buf, size_t cap);

// Writes llmerge's method names, in the order of the registry (lib/methods/methods.c) and
// separated by ", " ("ties, dare, ..."), into buf (cap bytes, cut short if need be). Allocates
// nothing.
void lm_cmd_method_names(char *buf, size_t cap);


// `llmerge plan METHOD BASE FT [FT...] -o OUT [merge options] [--json]`: what a merge with
// these arguments will need in memory on each device and on disk, from the inputs' headers
// (plan.h). Allocates nothing that outlives the call.
int lm_cmd_plan(int argc, char **argv);

// A merge command line parsed and prepared as `llmerge METHOD` prepares it (inputs opened
// and checked, options resolved, the device opened), without the work. Everything points
// into priv; free with lm_cmd_merge_release.
typedef struct lm_cmd_prepared {
    const char *method;           // "ties", ...
    const char *out;              // -o OUT as given
    struct lm_model *base;
    struct lm_ft **fts;           // (opts->n_ft)
    const char **ft_args;         // (opts->n_ft) the FTs as given
    const char *const *ft_names;  // (opts->n_ft) how messages name them: "FT 2", llmerge run's "model 'NAME'"
    const struct lm_merge_opts *opts;
    struct lm_dev *dev;
    const char *dev_why;          // what --device opened and why
    uint64_t gpu_mem;             // --gpu-mem, 0 when not given
    uint64_t shard_size;          // --shard-size
    // sparsegpt's Hessians (zero for the other methods)
    const struct lm_calib *calib; // (n_calib) the calibration files as the merge read them
    int n_calib;
    int64_t calib_samples;        // --calib-samples (0: all)
    int64_t seq_len;              // the length cap in effect (0: none)
    bool hessian_from_base;       // --hessian-from base
    bool sticky;                  // --sticky-fallback
    const char *cache_dir;        // --cache-dir as given (NULL: the default place)
    double damp;                  // the damping U_cc² are computed (and cached) with
    bool help;                    // --help was answered
    // llmerge run whose embeddings are rebuilt to another vocabulary: the bytes of the files
    // (without names) that hold them beside OUT while the merge runs; 0 otherwise
    uint64_t vocab_bytes;
    // --to-lora: the adapter's rank (0: a model), or exact; its dtype
    int to_lora;
    bool to_lora_exact;
    int lora_dtype;
    void *priv;
} lm_cmd_prepared;

// Parses argv (argv[0] the method's name) and prepares the merge as lm_cmd_merge would,
// errors on stderr as "PREFIX: MESSAGE". Returns the exit status: 0 prepared (or --help
// answered on stdout), 2 bad usage or bad input, 1 another failure. Release *out in every case.
int lm_cmd_merge_prepare(int argc, char **argv, const char *prefix, lm_cmd_prepared *out);
void lm_cmd_merge_release(lm_cmd_prepared *p);

#endif
