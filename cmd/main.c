// The llmerge command line: dispatches the subcommand, answers --help and --version, and
// suggests the nearest command for a typo. Each subcommand lives in its own file and parses
// its own options (cmd.h).
#include <signal.h>
#include <stdio.h>
#include <string.h>

#include "cmd.h"
#include "signals.h"

typedef struct command {
    const char *name;
    const char *summary;
    int (*run)(int argc, char **argv);
} command;

static const command commands[] = {
    {"ties", "TIES merge: trim each task vector to its largest entries, elect signs, average", lm_cmd_merge},
    {"dare", "DARE merge: drop task-vector entries at random, rescale the rest, sum", lm_cmd_merge},
    {"dare-ties", "DARE's random drop with TIES's sign election", lm_cmd_merge},
    {"task-arithmetic", "add the weighted sum of the task vectors to the base", lm_cmd_merge},
    {"sparsegpt", "TIES with entries kept by Hessian importance on calibration data", lm_cmd_merge},
    {"eval", "perplexity of a model (with a LoRA adapter applied) on token data", lm_cmd_eval},
    {"hessian", "input Hessians of a model's linear layers from calibration data", lm_cmd_hessian},
    {"plan", "what a merge will need: memory per phase and device, fallbacks, disk", lm_cmd_plan},
    {"inspect", "show the tensors of a safetensors file, a model directory or an adapter", lm_cmd_inspect},
};
#define N_COMMANDS (sizeof commands / sizeof commands[0])

static void usage(FILE *out)
{
    fprintf(out,
            "llmerge %s: merge fine-tuned LLM checkpoints and LoRA adapters\n"
            "\n"
            "Usage: llmerge COMMAND [ARGS...]\n"
            "\n"
            "Commands:\n",
            LLMERGE_VERSION);
    for (size_t i = 0; i < N_COMMANDS; i++)
        fprintf(out, "  %-16s %s\n", commands[i].name, commands[i].summary);
    fprintf(out,
            "\n"
            "Options:\n"
            "  -h, --help       this help; `llmerge COMMAND --help` for a command's options\n"
            "  --version        the version and how it was built\n"
            "\n"
            "Exit status: 0 done, 1 the work failed, 2 bad usage or bad input.\n");
}

// Levenshtein distance, for "did you mean" (cmd.h).
size_t lm_cmd_edit_distance(const char *a, const char *b)
{
    size_t la = strlen(a), lb = strlen(b);
    if (la > 63 || lb > 63)
        return 64;
    size_t row[64];
    for (size_t j = 0; j <= lb; j++)
        row[j] = j;
    for (size_t i = 1; i <= la; i++) {
        size_t diag = row[0];
        row[0] = i;
        for (size_t j = 1; j <= lb; j++) {
            size_t up = row[j];
            size_t best = diag + (a[i - 1] != b[j - 1]);
            if (up + 1 < best) best = up + 1;
            if (row[j - 1] + 1 < best) best = row[j - 1] + 1;
            row[j] = best;
            diag = up;
        }
    }
    return row[lb];
}

int main(int argc, char **argv)
{
    // A reader of our stderr that goes away (`llmerge ... 2>&1 | head`) must not kill a merge
    // half-way and leave its temporary output behind: writes to it fail instead, and the work
    // goes on.
    signal(SIGPIPE, SIG_IGN);
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    const char *cmd = argv[1];
    if (strcmp(cmd, "-h") == 0 || strcmp(cmd, "--help") == 0 || strcmp(cmd, "help") == 0) {
        usage(stdout);
        return 0;
    }
    if (strcmp(cmd, "--version") == 0 || strcmp(cmd, "version") == 0) {
        printf("llmerge %s (CUDA %s)\n", LLMERGE_VERSION,
#ifdef LLMERGE_HAVE_CUDA
               "built in"
#else
               "not built"
#endif
        );
        return 0;
    }
    for (size_t i = 0; i < N_COMMANDS; i++)
        if (strcmp(cmd, commands[i].name) == 0) {
            // An input truncated while it is mapped raises SIGBUS: named, output removed, exit 1.
            static char prefix[64];
            snprintf(prefix, sizeof prefix, "llmerge %s", commands[i].name);
            lm_signals_init(prefix);
            return commands[i].run(argc - 1, argv + 1);
        }

    const char *best = NULL;
    size_t best_d = 3;
    for (size_t i = 0; i < N_COMMANDS; i++) {
        size_t d = lm_cmd_edit_distance(cmd, commands[i].name);
        if (d < best_d) {
            best_d = d;
            best = commands[i].name;
        }
    }
    if (best)
        fprintf(stderr, "llmerge: unknown command '%s'; did you mean '%s'?\n", cmd, best);
    else
        fprintf(stderr, "llmerge: unknown command '%s' (see llmerge --help)\n", cmd);
    return 2;
}
