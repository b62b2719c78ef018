// The llmerge command line: dispatches the subcommand, answers --help and --version, suggests
// the nearest command for a typo, and answers a mergekit method's name with llmerge's name for
// it or the news that llmerge does not have it. Each subcommand lives in its own file and parses
// its own options (cmd.h).
#include <signal.h>
#include <stdio.h>
#include <string.h>

#include "cmd.h"
#include "method.h"
#include "signals.h"

typedef struct command {
    const char *name;
    const char *summary;
    int (*run)(int argc, char **argv);
} command;

// The commands other than the merge methods, which come first (the registry, method.h).
static const command commands[] = {
    {"run", "merge what a mergekit configuration file (YAML) says", lm_cmd_run},
    {"passthrough", "stack layer ranges of several models into one (mergekit's slices)", lm_cmd_passthrough},
    {"extract", "a fine-tune's change from its base as a LoRA adapter (truncated SVD)", lm_cmd_extract},
    {"eval", "perplexity of a model (with a LoRA adapter applied) on token data", lm_cmd_eval},
    {"hessian", "input Hessians of a model's linear layers from calibration data", lm_cmd_hessian},
    {"plan", "what a merge will need: memory per phase and device, fallbacks, disk", lm_cmd_plan},
    {"tokenize", "text to token ids with the model's tokenizer.json (JSON Lines out)", lm_cmd_tokenize},
    {"inspect", "show the tensors of a safetensors file, a model directory or an adapter", lm_cmd_inspect},
};
#define N_COMMANDS (sizeof commands / sizeof commands[0])

// Command i in the order --help lists them: each merge method (lm_cmd_merge runs them all),
// then commands[]. False past the last.
static bool command_at(size_t i, command *c)
{
    const lm_method *m = lm_method_at(i);
    if (m)
        *c = (command){m->name, m->brief, lm_cmd_merge};
    else if ((i -= lm_method_count()) < N_COMMANDS)
        *c = commands[i];
    else
        return false;
    return true;
}

// The line that follows an unknown method: llmerge's methods and where mergekit's are mapped.
static void methods_line(void)
{
    char names[256];
    lm_cmd_method_names(names, sizeof names);
    fprintf(stderr, "llmerge: merge methods: %s (llmerge METHOD --help); docs/mergekit.md says which of mergekit's "
            "methods llmerge has and what it calls them\n", names);
}

static void usage(FILE *out)
{
    fprintf(out,
            "llmerge %s: merge fine-tuned LLM checkpoints and LoRA adapters\n"
            "\n"
            "Usage: llmerge COMMAND [ARGS...]\n"
            "\n"
            "Commands:\n",
            LLMERGE_VERSION);
    command c;
    for (size_t i = 0; command_at(i, &c); i++)
        fprintf(out, "  %-16s %s\n", c.name, c.summary);
    fprintf(out,
            "\n"
            "Options:\n"
            "  -h, --help       this help; `llmerge COMMAND --help` for a command's options\n"
            "  --version        the version and how it was built\n"
            "\n"
            "Exit status: 0 done, 1 the work failed, 2 bad usage or bad input.\n");
}

// ==== mergekit's method names =================================================================

// mergekit's merge_method values (docs/mergekit.md) that llmerge does not have. Its others are
// llmerge's methods, found under mergekit's spelling too (lm_method_find).
static const char *const mergekit_missing[] = {
    "arcee_fusion",
};

// Whether `name` is mergekit's `mk`, written with - or _ between words.
static bool mergekit_name_is(const char *name, const char *mk)
{
    for (; *name && *mk; name++, mk++)
        if (*name != *mk && !(*name == '-' && *mk == '_'))
            return false;
    return *name == *mk;
}

bool lm_cmd_mergekit_hint(const char *name, char *buf, size_t cap)
{
    for (size_t i = 0; i < sizeof mergekit_missing / sizeof mergekit_missing[0]; i++)
        if (mergekit_name_is(name, mergekit_missing[i])) {
            snprintf(buf, cap, "mergekit's %s is not in llmerge (yet)", mergekit_missing[i]);
            return true;
        }
    return false;
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
    command c;
    for (size_t i = 0; command_at(i, &c); i++)
        if (strcmp(cmd, c.name) == 0) {
            // An input truncated while it is mapped raises SIGBUS: named, output removed, exit 1.
            static char prefix[64];
            snprintf(prefix, sizeof prefix, "llmerge %s", c.name);
            lm_signals_init(prefix);
            return c.run(argc - 1, argv + 1);
        }

    // a method named as mergekit names it (dare_ties, dare_linear): the same method
    const lm_method *m = lm_method_find(cmd);
    if (m) {
        static char prefix[64];
        snprintf(prefix, sizeof prefix, "llmerge %s", m->name);
        lm_signals_init(prefix);
        return lm_cmd_merge(argc - 1, argv + 1);
    }
    // or one llmerge does not have
    char hint[256];
    if (lm_cmd_mergekit_hint(cmd, hint, sizeof hint)) {
        fprintf(stderr, "llmerge: error: unknown command '%s': %s\n", cmd, hint);
        methods_line();
        return 2;
    }
    const char *best = NULL;
    size_t best_d = 3;
    for (size_t i = 0; command_at(i, &c); i++) {
        size_t d = lm_cmd_edit_distance(cmd, c.name);
        if (d < best_d) {
            best_d = d;
            best = c.name;
        }
    }
    if (best) {
        fprintf(stderr, "llmerge: error: unknown command '%s'; did you mean '%s'?\n", cmd, best);
    } else {
        fprintf(stderr, "llmerge: error: unknown command '%s' (the commands: see llmerge --help)\n", cmd);
        methods_line();
    }
    return 2;
}
