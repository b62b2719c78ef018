// The model card of a merged model: see card.h.
#include "card.h"

#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hfcache.h"

// ==== quoting =================================================================================

// The length of the UTF-8 sequence at s (its code point in *cp), or 0 when it is not one.
static size_t utf8_next(const unsigned char *s, uint32_t *cp)
{
    size_t n = s[0] < 0x80 ? 1 : (s[0] & 0xe0) == 0xc0 ? 2 : (s[0] & 0xf0) == 0xe0 ? 3 : (s[0] & 0xf8) == 0xf0 ? 4 : 0;
    for (size_t i = 1; i < n; i++)
        if ((s[i] & 0xc0) != 0x80)
            return 0;
    if (n == 0 || !lm_utf8_valid(s, n))
        return 0;
    static const unsigned char lead_mask[5] = {0, 0x7f, 0x1f, 0x0f, 0x07};
    uint32_t c = s[0] & lead_mask[n];
    for (size_t i = 1; i < n; i++)
        c = c << 6 | (s[i] & 0x3f);
    *cp = c;
    return n;
}

void lm_card_yaml_str(lm_buf *b, const char *s)
{
    const unsigned char *p = (const unsigned char *)s;
    lm_buf_put(b, "\"", 1);
    while (*p) {
        uint32_t c;
        size_t n = utf8_next(p, &c);
        if (n == 0) {
            lm_buf_fmt(b, "\\x%02x", *p);  // not UTF-8, which YAML is written in
            p++;
            continue;
        }
        if (c == '"' || c == '\\')
            lm_buf_fmt(b, "\\%c", (char)c);
        else if (c == '\n')
            lm_buf_put(b, "\\n", 2);
        else if (c == '\t')
            lm_buf_put(b, "\\t", 2);
        else if (c < 0x20 || c == 0x7f)
            lm_buf_fmt(b, "\\x%02x", (unsigned)c);
        else if ((c >= 0x80 && c <= 0x9f) || c == 0x2028 || c == 0x2029 || c == 0xfeff)
            lm_buf_fmt(b, "\\u%04x", (unsigned)c);  // not printable in YAML, or a line break
        else
            lm_buf_put(b, (const char *)p, n);
        p += n;
    }
    lm_buf_put(b, "\"", 1);
}

void lm_card_shell_word(lm_buf *b, const char *s)
{
    bool plain = *s != '\0';
    for (const char *c = s; *c && plain; c++)
        plain = (*c >= 'a' && *c <= 'z') || (*c >= 'A' && *c <= 'Z') || (*c >= '0' && *c <= '9') ||
                strchr("_-./,:=+@%", *c) != NULL;
    if (plain) {
        lm_buf_str(b, s);
        return;
    }
    lm_buf_put(b, "'", 1);
    for (const char *c = s; *c; c++) {
        if (*c == '\'')
            lm_buf_put(b, "'\\''", 4);
        else
            lm_buf_put(b, c, 1);
    }
    lm_buf_put(b, "'", 1);
}

// The longest run of c in s.
static size_t longest_run(const char *s, char c)
{
    size_t best = 0, run = 0;
    for (; *s; s++) {
        run = *s == c ? run + 1 : 0;
        best = run > best ? run : best;
    }
    return best;
}

static void put_repeat(lm_buf *b, char c, size_t n)
{
    for (size_t i = 0; i < n; i++)
        lm_buf_put(b, &c, 1);
}

void lm_card_md_code(lm_buf *b, const char *s)
{
    size_t ticks = longest_run(s, '`') + 1, len = strlen(s);
    bool pad = len > 0 && (s[0] == '`' || s[0] == ' ' || s[len - 1] == '`' || s[len - 1] == ' ');
    put_repeat(b, '`', ticks);
    if (pad)
        lm_buf_put(b, " ", 1);
    for (const char *c = s; *c; c++)
        lm_buf_put(b, *c == '\n' || *c == '\r' ? " " : c, 1);  // a line break would end a list item
    if (pad)
        lm_buf_put(b, " ", 1);
    put_repeat(b, '`', ticks);
}

bool lm_card_hub_id(const char *path, char *buf, size_t cap)
{
    char real[PATH_MAX];
    if (!realpath(path, real)) {
        // not on disk: a Hub id given on the command line names the cache's snapshot
        char *snap = NULL;
        lm_err err;
        bool found = lm_hf_resolve(path, &snap, &err) == LM_OK && realpath(snap, real);
        free(snap);
        if (!found)
            return false;
    }
    // the cache names a repository's directory models--ORG--NAME (the Hub allows no "--" within
    // an organisation or a name), with its revisions under snapshots/
    for (const char *p = strstr(real, "/models--"); p; p = strstr(p + 1, "/models--")) {
        const char *name = p + strlen("/models--"), *end = strchr(name, '/');
        if (!end || end == name || strncmp(end, "/snapshots/", strlen("/snapshots/")) != 0)
            continue;
        int n = (int)(end - name), seps = 0, at = 0;
        for (int i = 0; i + 1 < n; i++)
            if (name[i] == '-' && name[i + 1] == '-') {
                seps++;
                at = i;
                i++;
            }
        if (seps > 1 || (seps == 1 && (at == 0 || at + 2 == n)) || (size_t)n + 1 > cap)
            continue;
        if (seps)
            snprintf(buf, cap, "%.*s/%.*s", at, name, n - at - 2, name + at + 2);
        else
            snprintf(buf, cap, "%.*s", n, name);
        return true;
    }
    return false;
}

// ==== the card ================================================================================

void lm_card_number(char *buf, size_t cap, double v)
{
    for (int prec = 1; prec <= 17; prec++) {
        snprintf(buf, cap, "%.*g", prec, v);
        if (strtod(buf, NULL) == v)
            return;
    }
}

// The Hub id of each model (the base, then the FTs) found in the Hub's cache, into ids[]
// (cap bytes each), each id once (two revisions of a repository, or a model given twice, are
// one id); returns how many; *all whether every model had one. Local paths are not ids: the Hub
// refuses a base_model that names no repository.
static int hub_ids(const lm_card *c, char (*ids)[256], bool *all)
{
    int n = 0;
    *all = true;
    for (int i = -1; i < c->n_inputs; i++) {
        if (!lm_card_hub_id(i < 0 ? c->base : c->inputs[i].path, ids[n], sizeof ids[n])) {
            *all = false;
            continue;
        }
        bool seen = false;
        for (int j = 0; j < n && !seen; j++)
            seen = strcmp(ids[j], ids[n]) == 0;
        n += !seen;
    }
    return n;
}

// Appends s with line breaks as spaces (a paragraph of running text).
static void put_flowing(lm_buf *b, const char *s)
{
    for (const char *c = s; *c; c++)
        lm_buf_put(b, *c == '\n' ? " " : c, 1);
}

char *lm_card_text(const lm_card *c)
{
    lm_buf b = {0};
    char num[40];

    char (*ids)[256] = calloc((size_t)c->n_inputs + 1, sizeof *ids);
    if (!ids)
        return NULL;
    bool every_id;
    int n_ids = hub_ids(c, ids, &every_id);
    bool adapter = c->adapter_rank != 0;
    // an adapter is an adapter of its base alone
    bool base_id = adapter && lm_card_hub_id(c->base, ids[0], sizeof ids[0]);
    if (adapter)
        n_ids = base_id ? 1 : 0;
    lm_buf_str(&b, "---\n");
    if (n_ids > 0) {
        lm_buf_str(&b, "base_model:\n");
        for (int i = 0; i < n_ids; i++) {
            lm_buf_str(&b, "- ");
            lm_card_yaml_str(&b, ids[i]);
            lm_buf_str(&b, "\n");
        }
        lm_buf_str(&b, adapter ? "base_model_relation: adapter\n" : "base_model_relation: merge\n");
    }
    bool all_hub = adapter ? base_id : every_id;
    free(ids);
    lm_buf_str(&b, adapter ? "library_name: peft\ntags:\n- merge\n- llmerge\n- lora\n---\n\n"
                           : "library_name: transformers\ntags:\n- merge\n- llmerge\n---\n\n");

    lm_buf_str(&b, "# ");
    for (const char *t = c->title; *t; t++)
        lm_buf_put(&b, (unsigned char)*t < 0x20 ? " " : t, 1);
    if (adapter) {
        if (c->adapter_rank > 0)
            lm_buf_fmt(&b, "\n\nA LoRA adapter of rank %d for ", c->adapter_rank);
        else
            lm_buf_str(&b, "\n\nA LoRA adapter (its inputs' factors concatenated) for ");
        lm_card_md_code(&b, c->base);
        lm_buf_str(&b, ", holding the change of the merge of ");
    } else {
        lm_buf_str(&b, "\n\nA merge of ");
    }
    lm_buf_fmt(&b, "%d fine-tune%s onto ", c->n_inputs, c->n_inputs == 1 ? "" : "s");
    lm_card_md_code(&b, c->base);
    lm_buf_str(&b, " by the ");
    lm_buf_str(&b, c->method);
    lm_buf_str(&b, " method, made with llmerge ");
    lm_buf_str(&b, c->version);
    lm_buf_str(&b, ".\n\n## Method\n\n`");
    lm_buf_str(&b, c->method);
    lm_buf_str(&b, "`: ");
    put_flowing(&b, c->method_summary);

    lm_buf_str(&b, "\n\n## Models merged\n\nBase model: ");
    lm_card_md_code(&b, c->base);
    lm_buf_str(&b, "\n\nFine-tunes, each merged as its task vector (the difference it makes to the base):\n\n");
    for (int i = 0; i < c->n_inputs; i++) {
        const lm_card_input *in = &c->inputs[i];
        lm_buf_fmt(&b, "%d. ", i + 1);
        lm_card_md_code(&b, in->path);
        lm_buf_fmt(&b, " (%s): weight ", in->kind);
        lm_card_number(num, sizeof num, in->weight);
        lm_buf_str(&b, in->weight_text ? in->weight_text : num);
        if (in->density >= 0 || in->density_text) {
            lm_card_number(num, sizeof num, in->density);
            lm_buf_str(&b, ", density ");
            lm_buf_str(&b, in->density_text ? in->density_text : num);
        }
        lm_buf_str(&b, "\n");
    }

    lm_buf_str(&b, "\n## Options\n\n");
    for (int i = 0; i < c->n_options; i++) {
        lm_buf_str(&b, "- ");
        lm_buf_str(&b, c->options[i].name);
        lm_buf_str(&b, ": ");
        if (c->options[i].code)
            lm_card_md_code(&b, c->options[i].value);
        else
            lm_buf_str(&b, c->options[i].value);
        lm_buf_str(&b, "\n");
    }

    // the configuration, in a fence longer than any run of backticks inside it
    if (c->config) {
        size_t f = longest_run(c->config, '`') + 1;
        f = f < 3 ? 3 : f;
        lm_buf_str(&b, "\n## Configuration\n\nThe configuration merged (`mergekit_config.yml`, beside this card):\n\n");
        put_repeat(&b, '`', f);
        lm_buf_str(&b, "yaml\n");
        lm_buf_str(&b, c->config);
        if (c->config[0] && c->config[strlen(c->config) - 1] != '\n')
            lm_buf_str(&b, "\n");
        put_repeat(&b, '`', f);
        lm_buf_str(&b, "\n");
    }

    // the command line, in a fence longer than any run of backticks inside it
    lm_buf cmd = {0};
    for (int i = 0; i < c->argc; i++) {
        if (i)
            lm_buf_put(&cmd, " ", 1);
        lm_card_shell_word(&cmd, c->argv[i]);
    }
    size_t fence = cmd.p ? longest_run(cmd.p, '`') + 1 : 0;
    fence = fence < 3 ? 3 : fence;
    lm_buf_str(&b, "\n## Making it again\n\nWith llmerge ");
    lm_buf_str(&b, c->version);
    lm_buf_str(&b, ", from the same inputs:\n\n");
    put_repeat(&b, '`', fence);
    lm_buf_str(&b, "sh\n");
    if (cmd.p)
        lm_buf_str(&b, cmd.p);
    lm_buf_str(&b, "\n");
    put_repeat(&b, '`', fence);
    lm_buf_str(&b, "\n\n`llmerge.json`, beside this card, records the inputs with the xxHash64 of their files, "
                   "every option's resolved value and the xxHash64 of each output tensor.\n");
    if (!all_hub && adapter)
        lm_buf_str(&b, "\nThe base model was given to llmerge as a local path, which the front matter's "
                       "`base_model` leaves out (it takes Hub ids only): before uploading this adapter, add its Hub "
                       "id there, and `base_model_relation: adapter`.\n");
    else if (!all_hub)
        lm_buf_str(&b, "\nSome of the models above were given to llmerge as local paths, which the front matter's "
                       "`base_model` list leaves out (it takes Hub ids only): before uploading this model, add "
                       "their Hub ids there, and `base_model_relation: merge` if it is missing.\n");
    bool oom = b.oom || cmd.oom;
    free(cmd.p);
    if (oom) {
        free(b.p);
        return NULL;
    }
    return b.p;
}

lm_status lm_card_write(const char *path, const lm_card *c, lm_err *err)
{
    char *text = lm_card_text(c);
    if (!text)
        return lm_err_set(err, LM_ERR_NOMEM, "%s: out of memory writing the model card", path);
    lm_status s = lm_write_file(path, text, strlen(text), err);
    free(text);
    return s;
}
