// The option scanner the commands share: "--name value", "--name=value", short options ("-o
// OUT", "-oOUT", bundled flags such as "-qv"), "--" ending the options, operands anywhere, and
// an unknown option answered with the closest known name ("did you mean").
#ifndef LM_CMD_ARGS_H
#define LM_CMD_ARGS_H

#include <stdbool.h>
#include <stddef.h>

#include "status.h"

typedef struct lm_opt {
    const char *name;  // without the leading "--"
    char short_name;   // or 0
    bool value;        // takes a value
    int id;            // the command's own identifier
} lm_opt;

// Called for each option with how the user wrote it ("--density", "-o") and its value (NULL for
// a flag), and for each operand; a status other than LM_OK stops the scan and is returned.
typedef lm_status (*lm_opt_fn)(void *ctx, const lm_opt *opt, const char *shown, const char *value, lm_err *err);
typedef lm_status (*lm_operand_fn)(void *ctx, const char *arg, lm_err *err);

#include <stdint.h>

#define LM_CMD_MAX_THREADS 4096

// Whether text is a whole decimal number in [lo, hi] (no sign, nothing after it); *out gets it.
bool lm_cmd_parse_int(const char *text, int64_t lo, int64_t hi, int64_t *out);

// The options several commands take, checked the same way everywhere: --gpu-mem SIZE (more
// than 0 bytes) and --threads N (0 for all cores, at most LM_CMD_MAX_THREADS). LM_ERR_USAGE
// naming the option as the user wrote it (`shown`).
lm_status lm_cmd_opt_gpu_mem(const char *shown, const char *v, uint64_t *out, lm_err *err);
lm_status lm_cmd_opt_threads(const char *shown, const char *v, int *out, lm_err *err);

// Scans argv[1..argc) against the n options. Unknown options, a missing value and a value given
// to a flag are LM_ERR_USAGE naming them.
lm_status lm_cmd_scan(int argc, char **argv, const lm_opt *opts, size_t n, lm_opt_fn on_opt, lm_operand_fn on_operand,
                      void *ctx, lm_err *err);

#endif
