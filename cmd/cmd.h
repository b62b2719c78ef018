// The subcommands of the llmerge command line. Each takes its own argv (argv[0] is the
// subcommand's name), parses its options, prints what it has to say, and returns the process
// exit status: 0 done, 1 the work failed, 2 bad usage or bad input (lm_status_exit_code). Error
// messages go to stderr as "llmerge COMMAND: MESSAGE".
#ifndef LM_CMD_H
#define LM_CMD_H

#include <stddef.h>

// `llmerge inspect PATH [--base DIR] [--json]`: describes a safetensors file, a model directory
// or an adapter directory (validated against --base when given). Allocates nothing that
// outlives the call.
int lm_cmd_inspect(int argc, char **argv);

// `llmerge ties|dare|dare-ties|task-arithmetic BASE FT [FT...] -o OUT [options]`: merges the
// fine-tuned inputs into BASE by the method named in argv[0] and writes the model directory
// OUT atomically (nothing is left there when it fails). Allocates nothing that outlives the
// call.
int lm_cmd_merge(int argc, char **argv);

// `llmerge eval MODEL [--adapter DIR] --data FILE [options]`: prints the perplexity of MODEL
// (with the adapter applied, not merged) on the token data FILE. Allocates nothing that
// outlives the call.
int lm_cmd_eval(int argc, char **argv);

// `llmerge hessian MODEL [--adapter DIR] --calib FILE -o H.safetensors [options]`: writes the
// input Hessians of MODEL's linear layers (with the adapter applied, not merged) over the
// calibration tokens as one safetensors file, atomically. Allocates nothing that outlives the
// call.
int lm_cmd_hessian(int argc, char **argv);

// The Levenshtein distance between a and b (64 or more for strings over 63 bytes), for "did
// you mean" suggestions.
size_t lm_cmd_edit_distance(const char *a, const char *b);

#endif
