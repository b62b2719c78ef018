// mergekit's merge configuration files (mergecfg.h): libyaml's events are built into a small
// tree of nodes under the limits, then the tree is walked key by key, in the file's order (a
// mapping's keys are checked, strings and each once, before its values are read), so that a
// defect is reported where it is, and the first one the walk meets.
#include "mergecfg.h"

#include <errno.h>
#include <stdarg.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <yaml.h>

#include "util.h"

// ==== the tree ===================================================================================

typedef enum node_kind { NODE_SCALAR, NODE_SEQ, NODE_MAP } node_kind;

typedef struct node {
    node_kind kind;
    int line, col;        // 1-based, where the node starts
    char *text;           // (len) NODE_SCALAR: NUL-terminated, no NUL inside
    size_t len;
    bool plain;           // NODE_SCALAR: written plain (typed), not quoted or as a block
    struct node **kids;   // (n) NODE_SEQ: the items; NODE_MAP: key, value, key, value, ...
    int n, cap;
} node;

typedef struct reader {
    const char *path;
    const char *text;     // (len) the file
    size_t len;
    int nodes;
    lm_err *err;
} reader;

static void node_free(node *n)
{
    if (!n)
        return;
    for (int i = 0; i < n->n; i++)
        node_free(n->kids[i]);
    free(n->kids);
    free(n->text);
    free(n);
}

static bool node_add(node *parent, node *kid)
{
    if (parent->n == parent->cap) {
        int cap = parent->cap ? parent->cap * 2 : 4;
        node **k = realloc(parent->kids, (size_t)cap * sizeof *k);
        if (!k)
            return false;
        parent->kids = k;
        parent->cap = cap;
    }
    parent->kids[parent->n++] = kid;
    return true;
}

// Writes a key path ("models[0].parameters.weight") or other short text into buf, cut short
// when it does not fit (only messages read it).
static void key_path(char *buf, size_t cap, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

static void key_path(char *buf, size_t cap, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, cap, fmt, ap);
    va_end(ap);
}

static lm_status fail_at(reader *r, lm_status s, int line, int col, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));

static lm_status fail_at(reader *r, lm_status s, int line, int col, const char *fmt, ...)
{
    char what[LM_ERR_MSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    return lm_err_set(r->err, s, "%s:%d:%d: %s", r->path, line, col, what);
}

// Line and column (1-based, columns in characters) of byte `off` of the text.
static void position_of(const reader *r, size_t off, int *line, int *col)
{
    int l = 1, c = 1;
    for (size_t i = 0; i < off && i < r->len; i++) {
        unsigned char b = (unsigned char)r->text[i];
        if (b == '\n') {
            l++;
            c = 1;
        } else if ((b & 0xC0) != 0x80) {
            c++;
        }
    }
    *line = l;
    *col = c;
}

static lm_status syntax_error(reader *r, const yaml_parser_t *p)
{
    if (p->error == YAML_MEMORY_ERROR)
        return lm_err_set(r->err, LM_ERR_NOMEM, "%s: out of memory reading the configuration", r->path);
    const char *problem = p->problem ? p->problem : "not valid YAML";
    if (p->error == YAML_READER_ERROR) {
        int line, col;
        position_of(r, p->problem_offset, &line, &col);
        if (p->problem_value != -1)
            return fail_at(r, LM_ERR_FORMAT, line, col, "not valid YAML: %s (#%X)", problem, (unsigned)p->problem_value);
        return fail_at(r, LM_ERR_FORMAT, line, col, "not valid YAML: %s", problem);
    }
    int line = (int)p->problem_mark.line + 1, col = (int)p->problem_mark.column + 1;
    if (p->context)
        return fail_at(r, LM_ERR_FORMAT, line, col, "not valid YAML: %s (%s at line %d, column %d)", problem,
                       p->context, (int)p->context_mark.line + 1, (int)p->context_mark.column + 1);
    return fail_at(r, LM_ERR_FORMAT, line, col, "not valid YAML: %s", problem);
}

// The one document of the text as a tree (*root NULL for an empty stream).
static lm_status build_tree(reader *r, node **root)
{
    *root = NULL;
    yaml_parser_t p;
    if (!yaml_parser_initialize(&p))
        return lm_err_set(r->err, LM_ERR_NOMEM, "%s: out of memory reading the configuration", r->path);
    yaml_parser_set_input_string(&p, (const unsigned char *)r->text, r->len);
    node *stack[LM_MERGECFG_MAX_DEPTH];
    int depth = 0, docs = 0;
    lm_status s = LM_OK;
    bool done = false;
    while (!done && s == LM_OK) {
        yaml_event_t ev;
        if (!yaml_parser_parse(&p, &ev)) {
            s = syntax_error(r, &p);
            break;
        }
        int line = (int)ev.start_mark.line + 1, col = (int)ev.start_mark.column + 1;
        const yaml_char_t *anchor = NULL, *tag = NULL;
        node_kind kind = NODE_SCALAR;
        switch (ev.type) {
        case YAML_STREAM_END_EVENT:
            done = true;
            break;
        case YAML_DOCUMENT_START_EVENT:
            if (++docs > 1)
                s = fail_at(r, LM_ERR_FORMAT, line, col, "a second YAML document: a configuration is one "
                            "document (mergekit-multi's stages each go in a file of their own)");
            break;
        case YAML_ALIAS_EVENT:
            s = fail_at(r, LM_ERR_FORMAT, line, col, "alias '*%.100s': anchors and aliases are not supported "
                        "(write the value out where it is used)", (const char *)ev.data.alias.anchor);
            break;
        case YAML_SEQUENCE_END_EVENT:
        case YAML_MAPPING_END_EVENT:
            depth--;
            break;
        case YAML_SCALAR_EVENT:
        case YAML_SEQUENCE_START_EVENT:
        case YAML_MAPPING_START_EVENT:
            if (ev.type == YAML_SCALAR_EVENT) {
                anchor = ev.data.scalar.anchor;
                tag = ev.data.scalar.tag;
            } else if (ev.type == YAML_SEQUENCE_START_EVENT) {
                kind = NODE_SEQ;
                anchor = ev.data.sequence_start.anchor;
                tag = ev.data.sequence_start.tag;
            } else {
                kind = NODE_MAP;
                anchor = ev.data.mapping_start.anchor;
                tag = ev.data.mapping_start.tag;
            }
            if (anchor) {
                s = fail_at(r, LM_ERR_FORMAT, line, col, "anchor '&%.100s': anchors and aliases are not supported "
                            "(write the value out where it is used)", (const char *)anchor);
                break;
            }
            if (tag) {
                s = fail_at(r, LM_ERR_FORMAT, line, col, "tag '%.100s': tags are not supported (quote a value to "
                            "make it a string)", (const char *)tag);
                break;
            }
            if (++r->nodes > LM_MERGECFG_MAX_NODES) {
                s = fail_at(r, LM_ERR_FORMAT, line, col, "more than %d values: a configuration holds fewer",
                            LM_MERGECFG_MAX_NODES);
                break;
            }
            if (kind == NODE_SCALAR && ev.data.scalar.length > LM_MERGECFG_MAX_STRING) {
                s = fail_at(r, LM_ERR_FORMAT, line, col, "a string of %zu bytes, more than the %u allowed",
                            ev.data.scalar.length, LM_MERGECFG_MAX_STRING);
                break;
            }
            if (kind == NODE_SCALAR && memchr(ev.data.scalar.value, '\0', ev.data.scalar.length)) {
                s = fail_at(r, LM_ERR_FORMAT, line, col, "a string holding a NUL character (\\0)");
                break;
            }
            if (kind != NODE_SCALAR && depth == LM_MERGECFG_MAX_DEPTH) {
                s = fail_at(r, LM_ERR_FORMAT, line, col, "lists and mappings nested more than %d deep",
                            LM_MERGECFG_MAX_DEPTH);
                break;
            }
            node *n = calloc(1, sizeof *n);
            if (n && kind == NODE_SCALAR) {
                n->len = ev.data.scalar.length;
                n->plain = ev.data.scalar.style == YAML_PLAIN_SCALAR_STYLE;
                if ((n->text = malloc(n->len + 1))) {
                    memcpy(n->text, ev.data.scalar.value, n->len);
                    n->text[n->len] = '\0';
                }
            }
            if (!n || (kind == NODE_SCALAR && !n->text) || (depth > 0 && !node_add(stack[depth - 1], n))) {
                node_free(n);
                s = lm_err_set(r->err, LM_ERR_NOMEM, "%s: out of memory reading the configuration", r->path);
                break;
            }
            n->kind = kind;
            n->line = line;
            n->col = col;
            if (depth == 0)
                *root = n;  // one document, whose root is the one node at depth 0
            if (kind != NODE_SCALAR)
                stack[depth++] = n;
            break;
        default:
            break;
        }
        yaml_event_delete(&ev);
    }
    yaml_parser_delete(&p);
    if (s != LM_OK) {
        node_free(*root);
        *root = NULL;
    }
    return s;
}

// ==== scalars and types ==========================================================================

typedef enum scalar_kind { SC_NULL, SC_BOOL, SC_INT, SC_FLOAT, SC_STRING, SC_BAD } scalar_kind;

static bool null_text(const char *t)
{
    return !t[0] || strcmp(t, "~") == 0 || strcmp(t, "null") == 0 || strcmp(t, "Null") == 0 || strcmp(t, "NULL") == 0;
}

// The type of scalar n as the reader takes it, *num for SC_BOOL, SC_INT and SC_FLOAT; SC_BAD
// for a non-finite number or a YAML 1.1 number llmerge does not read (*pn says which).
static scalar_kind classify(const node *n, double *num, lm_pnum *pn)
{
    if (!n->plain)
        return SC_STRING;
    const char *t = n->text;
    if (null_text(t))
        return SC_NULL;
    if (strcmp(t, "true") == 0 || strcmp(t, "True") == 0 || strcmp(t, "TRUE") == 0) {
        *num = 1;
        return SC_BOOL;
    }
    if (strcmp(t, "false") == 0 || strcmp(t, "False") == 0 || strcmp(t, "FALSE") == 0) {
        *num = 0;
        return SC_BOOL;
    }
    *pn = lm_param_scan_number(t, n->len, num);
    switch (*pn) {
    case LM_PNUM_INT: return SC_INT;
    case LM_PNUM_FLOAT: return SC_FLOAT;
    case LM_PNUM_NONFINITE:
    case LM_PNUM_UNREADABLE: return SC_BAD;
    case LM_PNUM_NONE: break;
    }
    return SC_STRING;
}

// As classify, for scalar n written at key path `what`, failing on SC_BAD.
static lm_status scalar_type(reader *r, const node *n, const char *what, scalar_kind *k, double *num)
{
    lm_pnum pn = LM_PNUM_NONE;
    *k = classify(n, num, &pn);
    if (*k != SC_BAD)
        return LM_OK;
    if (pn == LM_PNUM_NONFINITE)
        return fail_at(r, LM_ERR_FORMAT, n->line, n->col, "%s: %.100s is not a finite number", what, n->text);
    return fail_at(r, LM_ERR_FORMAT, n->line, n->col, "%s: '%.100s' is a number to YAML 1.1 in a form llmerge does "
                   "not read (a leading 0, 0x, 0b, '_' or ':'): write it as a decimal number, or quote it to make "
                   "it a string", what, n->text);
}

// "a list", "a number", ... for messages.
static const char *type_name(const node *n)
{
    if (n->kind == NODE_SEQ)
        return "a list";
    if (n->kind == NODE_MAP)
        return "a mapping";
    double x;
    lm_pnum pn;
    switch (classify(n, &x, &pn)) {
    case SC_NULL: return "null";
    case SC_BOOL: return "true/false";
    case SC_INT:
    case SC_FLOAT:
    case SC_BAD: return "a number";
    case SC_STRING: break;
    }
    return "a string";
}

static bool is_null(const node *n)
{
    return n->kind == NODE_SCALAR && n->plain && null_text(n->text);
}

// A string value: a scalar that is not null, true/false or a number; a copy in *out.
static lm_status want_string(reader *r, const node *n, const char *what, char **out)
{
    *out = NULL;
    scalar_kind k = SC_STRING;
    double x;
    lm_status s;
    if (n->kind == NODE_SCALAR && (s = scalar_type(r, n, what, &k, &x)) != LM_OK)
        return s;
    if (n->kind != NODE_SCALAR || k != SC_STRING)
        return fail_at(r, LM_ERR_FORMAT, n->line, n->col, "%s: a string is needed, not %s%s", what, type_name(n),
                       n->kind == NODE_SCALAR ? " (quote it to make it a string)" : "");
    if (n->len == 0)
        return fail_at(r, LM_ERR_FORMAT, n->line, n->col, "%s: an empty string", what);
    if (!(*out = lm_strdup(n->text)))
        return lm_err_set(r->err, LM_ERR_NOMEM, "%s: out of memory reading the configuration", r->path);
    return LM_OK;
}

// A whole number from lo to hi written plainly (digits with an optional sign).
static lm_status want_uint(reader *r, const node *n, const char *what, uint64_t hi, uint64_t *out)
{
    scalar_kind k = SC_STRING;
    double x = 0;
    lm_status s;
    if (n->kind == NODE_SCALAR && (s = scalar_type(r, n, what, &k, &x)) != LM_OK)
        return s;
    if (k != SC_INT || n->kind != NODE_SCALAR)
        return fail_at(r, LM_ERR_FORMAT, n->line, n->col, "%s: a whole number is needed, not %s", what,
                       k == SC_FLOAT && n->kind == NODE_SCALAR ? "a fraction" : type_name(n));
    if (n->text[0] == '-' && x != 0)
        return fail_at(r, LM_ERR_FORMAT, n->line, n->col, "%s: %.100s is negative: a whole number from 0 is needed",
                       what, n->text);
    errno = 0;
    unsigned long long v = strtoull(n->text + (n->text[0] == '+' || n->text[0] == '-'), NULL, 10);
    if (errno == ERANGE || v > hi)
        return fail_at(r, LM_ERR_FORMAT, n->line, n->col, "%s: %.100s is out of range (at most %" PRIu64 ")", what,
                       n->text, hi);
    *out = v;
    return LM_OK;
}

// ==== mappings ===================================================================================

// Levenshtein distance between a (any length) and b (a short known key).
static size_t edit_distance(const char *a, const char *b)
{
    size_t lb = strlen(b);
    size_t row[64];
    if (lb >= sizeof row / sizeof row[0])
        return SIZE_MAX;
    for (size_t j = 0; j <= lb; j++)
        row[j] = j;
    for (size_t i = 1; a[i - 1]; i++) {
        size_t diag = row[0];
        row[0] = i;
        for (size_t j = 1; j <= lb; j++) {
            size_t up = row[j];
            size_t best = diag + (a[i - 1] != b[j - 1]);
            if (up + 1 < best)
                best = up + 1;
            if (row[j - 1] + 1 < best)
                best = row[j - 1] + 1;
            row[j] = best;
            diag = up;
        }
    }
    return row[lb];
}

// The known key closest to `key`, or NULL when none is close (as the option scanner's
// suggestions: a distance of at most 1, 2 or 3 by the key's length, or a typed prefix).
static const char *suggest(const char *key, const char *const *known)
{
    const char *best = NULL;
    size_t best_d = SIZE_MAX, len = strlen(key);
    if (len > 256)
        return NULL;
    for (size_t i = 0; known[i]; i++) {
        size_t d = edit_distance(key, known[i]);
        if (len >= 3 && strncmp(known[i], key, len) == 0)
            d = 1;
        if (d < best_d) {
            best_d = d;
            best = known[i];
        }
    }
    size_t limit = len <= 4 ? 1 : len <= 8 ? 2 : 3;
    return best_d <= limit ? best : NULL;
}

static lm_status unknown_key(reader *r, const node *k, const char *where, const char *const *known)
{
    const char *s = suggest(k->text, known);
    char ctx[160] = "";
    if (where[0])
        key_path(ctx, sizeof ctx, "%s: ", where);
    if (s)
        return fail_at(r, LM_ERR_FORMAT, k->line, k->col, "%sunknown key '%.100s'; did you mean '%s'?", ctx, k->text, s);
    return fail_at(r, LM_ERR_FORMAT, k->line, k->col, "%sunknown key '%.100s'", ctx, k->text);
}

// Checks that mapping m (at key path `what`) has string keys, each once.
static lm_status check_keys(reader *r, const node *m, const char *what)
{
    char ctx[160] = "";
    if (what[0])
        key_path(ctx, sizeof ctx, "%s: ", what);
    lm_strmap seen = {0};
    bool use_map = m->n / 2 > 8;
    if (use_map && lm_strmap_init(&seen, (size_t)m->n / 2) != LM_OK)
        return lm_err_set(r->err, LM_ERR_NOMEM, "%s: out of memory reading the configuration", r->path);
    lm_status s = LM_OK;
    for (int i = 0; i < m->n && s == LM_OK; i += 2) {
        const node *k = m->kids[i];
        if (k->kind != NODE_SCALAR) {
            s = fail_at(r, LM_ERR_FORMAT, k->line, k->col, "%sa key is a string, not %s", ctx, type_name(k));
            break;
        }
        int first = -1;
        if (use_map) {
            int put = lm_strmap_put(&seen, k->text, i);
            if (put < 0)
                s = lm_err_set(r->err, LM_ERR_NOMEM, "%s: out of memory reading the configuration", r->path);
            else if (put == 0)
                first = (int)lm_strmap_get(&seen, k->text);
        } else {
            for (int j = 0; j < i && first < 0; j += 2)
                if (strcmp(m->kids[j]->text, k->text) == 0)
                    first = j;
        }
        if (first >= 0)
            s = fail_at(r, LM_ERR_FORMAT, k->line, k->col, "%skey '%.100s' appears twice (first at line %d, column "
                        "%d)", ctx, k->text, m->kids[first]->line, m->kids[first]->col);
    }
    lm_strmap_free(&seen);
    return s;
}

// A mapping (at key path `what`) with its keys checked.
static lm_status want_map(reader *r, const node *n, const char *what)
{
    if (n->kind != NODE_MAP)
        return fail_at(r, LM_ERR_FORMAT, n->line, n->col, "%s: a mapping of keys is needed, not %s", what,
                       type_name(n));
    return check_keys(r, n, what);
}

// A non-empty list (at key path `what`).
static lm_status want_list(reader *r, const node *n, const char *what)
{
    if (n->kind != NODE_SEQ)
        return fail_at(r, LM_ERR_FORMAT, n->line, n->col, "%s: a list is needed, not %s", what, type_name(n));
    if (n->n == 0)
        return fail_at(r, LM_ERR_FORMAT, n->line, n->col, "%s: the list is empty", what);
    return LM_OK;
}

static lm_status nomem(reader *r)
{
    return lm_err_set(r->err, LM_ERR_NOMEM, "%s: out of memory reading the configuration", r->path);
}

// ==== parameter settings =========================================================================

static lm_pval *pval_new(lm_pval_kind kind, const node *n)
{
    lm_pval *v = calloc(1, sizeof *v);
    if (v) {
        v->kind = kind;
        v->line = n->line;
        v->col = n->col;
    }
    return v;
}

static lm_status read_setting(reader *r, const node *n, const char *what, bool conds_allowed, lm_pval **out);

// One {filter, value} mapping into cond.
static lm_status read_cond(reader *r, const node *m, const char *what, lm_pcond *cond)
{
    static const char *const known[] = {"filter", "value", NULL};
    lm_status s = check_keys(r, m, what);
    const node *value = NULL;
    char sub[256];
    for (int i = 0; i < m->n && s == LM_OK; i += 2) {
        const node *k = m->kids[i], *v = m->kids[i + 1];
        key_path(sub, sizeof sub, "%s.%.40s", what, k->text);
        if (strcmp(k->text, "filter") == 0) {
            if (!is_null(v))
                s = want_string(r, v, sub, &cond->filter);
        } else if (strcmp(k->text, "value") == 0) {
            value = v;
            s = read_setting(r, v, sub, false, &cond->value);
        } else {
            s = unknown_key(r, k, what, known);
        }
    }
    if (s == LM_OK && !value)
        s = fail_at(r, LM_ERR_FORMAT, m->line, m->col, "%s: 'value' is missing (a condition is {filter, value})", what);
    return s;
}

static lm_status read_setting(reader *r, const node *n, const char *what, bool conds_allowed, lm_pval **out)
{
    *out = NULL;
    lm_status s;
    if (n->kind == NODE_SCALAR) {
        scalar_kind k;
        double x = 0;
        if ((s = scalar_type(r, n, what, &k, &x)) != LM_OK)
            return s;
        if (k == SC_NULL)
            return fail_at(r, LM_ERR_FORMAT, n->line, n->col, "%s: a value is needed, not null", what);
        lm_pval *v = pval_new(k == SC_STRING ? LM_PVAL_STRING : k == SC_BOOL ? LM_PVAL_BOOL : LM_PVAL_NUMBER, n);
        if (!v || (k == SC_STRING && !(v->str = lm_strdup(n->text)))) {
            free(v);
            return nomem(r);
        }
        v->num = x;
        *out = v;
        return LM_OK;
    }
    const char *expected = conds_allowed ? "a number, true/false, a string, a list of numbers or a list of "
                                           "{filter, value} mappings"
                                         : "a number, true/false, a string or a list of numbers";
    if (n->kind == NODE_MAP) {
        if (!conds_allowed)
            return fail_at(r, LM_ERR_FORMAT, n->line, n->col, "%s: %s is needed, not a mapping (conditions do not "
                           "nest)", what, expected);
        // mergekit reads conditions only as a list: one mapping on its own fails there for
        // every tensor, so it is refused here rather than given a meaning mergekit lacks
        return fail_at(r, LM_ERR_FORMAT, n->line, n->col, "%s: a {filter, value} mapping on its own is not a setting "
                       "(mergekit fails on it): write it as a list of conditions, [{filter: ..., value: ...}]", what);
    }
    if (n->n == 0)
        return fail_at(r, LM_ERR_FORMAT, n->line, n->col, "%s: an empty list (a gradient needs at least one number)",
                       what);
    // a gradient when the first item is a number, conditions when it is a mapping
    char sub[256];
    const node *first = n->kids[0];
    bool conds = first->kind == NODE_MAP;
    for (int i = 0; i < n->n; i++) {
        const node *it = n->kids[i];
        key_path(sub, sizeof sub, "%s[%d]", what, i);
        scalar_kind k = SC_STRING;
        double x;
        if (it->kind == NODE_SCALAR && (s = scalar_type(r, it, sub, &k, &x)) != LM_OK)
            return s;
        bool number = it->kind == NODE_SCALAR && (k == SC_INT || k == SC_FLOAT);
        if ((it->kind == NODE_MAP && !conds) || (number && conds))
            return fail_at(r, LM_ERR_FORMAT, n->line, n->col, "%s: a list mixing numbers and {filter, value} "
                           "mappings (item %d is %s, item 0 %s)", what, i, type_name(it), type_name(first));
        if (it->kind == NODE_MAP && !conds_allowed)
            return fail_at(r, LM_ERR_FORMAT, it->line, it->col, "%s: %s is needed, not a mapping (conditions do "
                           "not nest)", sub, expected);
        if (!number && it->kind != NODE_MAP)
            return fail_at(r, LM_ERR_FORMAT, it->line, it->col, "%s: %s is needed; this list's items are %s, "
                           "and this one is %s", sub, "a number or a {filter, value} mapping",
                           conds ? "{filter, value} mappings" : "numbers (a gradient)", type_name(it));
    }
    lm_pval *v = pval_new(conds ? LM_PVAL_CONDS : LM_PVAL_GRADIENT, n);
    if (!v)
        return nomem(r);
    if (!conds) {
        if (!(v->grad = calloc((size_t)n->n, sizeof *v->grad))) {
            free(v);
            return nomem(r);
        }
        v->n_grad = n->n;
        if (!(v->grad_lines = calloc((size_t)n->n, sizeof *v->grad_lines)) ||
            !(v->grad_cols = calloc((size_t)n->n, sizeof *v->grad_cols))) {
            lm_pval_free(v);
            return nomem(r);
        }
        for (int i = 0; i < n->n; i++) {
            scalar_kind k;
            key_path(sub, sizeof sub, "%s[%d]", what, i);
            scalar_type(r, n->kids[i], sub, &k, &v->grad[i]);  // checked above
            v->grad_lines[i] = n->kids[i]->line;
            v->grad_cols[i] = n->kids[i]->col;
        }
        *out = v;
        return LM_OK;
    }
    if (!(v->conds = calloc((size_t)n->n, sizeof *v->conds))) {
        free(v);
        return nomem(r);
    }
    v->n_conds = n->n;
    for (int i = 0; i < n->n; i++) {
        key_path(sub, sizeof sub, "%s[%d]", what, i);
        if ((s = read_cond(r, n->kids[i], sub, &v->conds[i])) != LM_OK) {
            lm_pval_free(v);
            return s;
        }
    }
    *out = v;
    return LM_OK;
}

// A `parameters:` mapping (null: none) into *ps.
static lm_status read_params(reader *r, const node *n, const char *what, lm_params *ps)
{
    if (is_null(n))
        return LM_OK;
    lm_status s = want_map(r, n, what);
    if (s != LM_OK)
        return s;
    if (n->n == 0)
        return LM_OK;
    if (!(ps->items = calloc((size_t)n->n / 2, sizeof *ps->items)))
        return nomem(r);
    char sub[256];
    for (int i = 0; i < n->n; i += 2) {
        const node *k = n->kids[i];
        lm_param *p = &ps->items[ps->n];
        key_path(sub, sizeof sub, "%s.%.60s", what, k->text);
        if (!(p->name = lm_strdup(k->text)))
            return nomem(r);
        p->line = k->line;
        p->col = k->col;
        ps->n++;
        if ((s = read_setting(r, n->kids[i + 1], sub, true, &p->value)) != LM_OK)
            return s;
    }
    return LM_OK;
}

// ==== models and slices ==========================================================================

static lm_status read_model_ref(reader *r, const node *v, const char *what, lm_cfg_model *m)
{
    m->line = v->line;
    m->col = v->col;
    return want_string(r, v, what, &m->model);
}

static lm_status read_models(reader *r, const node *n, lm_mergecfg *c)
{
    static const char *const known[] = {"model", "parameters", NULL};
    lm_status s = want_list(r, n, "models");
    if (s != LM_OK)
        return s;
    if (!(c->models = calloc((size_t)n->n, sizeof *c->models)))
        return nomem(r);
    char what[64], sub[128];
    for (int i = 0; i < n->n; i++) {
        const node *m = n->kids[i];
        lm_cfg_model *cm = &c->models[i];
        cm->layer_range[0] = cm->layer_range[1] = -1;
        c->n_models++;
        key_path(what, sizeof what, "models[%d]", i);
        if ((s = want_map(r, m, what)) != LM_OK)
            return s;
        bool have_model = false;
        for (int j = 0; j < m->n; j += 2) {
            const node *k = m->kids[j], *v = m->kids[j + 1];
            key_path(sub, sizeof sub, "%s.%.40s", what, k->text);
            if (strcmp(k->text, "model") == 0) {
                have_model = true;
                s = read_model_ref(r, v, sub, cm);
            } else if (strcmp(k->text, "parameters") == 0) {
                s = read_params(r, v, sub, &cm->params);
            } else {
                s = unknown_key(r, k, what, known);
            }
            if (s != LM_OK)
                return s;
        }
        if (!have_model)
            return fail_at(r, LM_ERR_FORMAT, m->line, m->col, "%s: 'model' is missing", what);
    }
    return LM_OK;
}

static lm_status read_layer_range(reader *r, const node *n, const char *what, int64_t range[2])
{
    if (n->kind != NODE_SEQ || n->n != 2)
        return fail_at(r, LM_ERR_FORMAT, n->line, n->col, "%s: [FROM, TO] is needed (two whole numbers, 0 <= FROM < "
                       "TO), not %s%s", what, n->kind == NODE_SEQ ? "a list of " : type_name(n),
                       n->kind == NODE_SEQ ? (n->n == 1 ? "one item" : n->n > 2 ? "more than two items" : "none") : "");
    char sub[160];
    for (int i = 0; i < 2; i++) {
        uint64_t v;
        key_path(sub, sizeof sub, "%s[%d]", what, i);
        lm_status s = want_uint(r, n->kids[i], sub, (uint64_t)1 << 40, &v);
        if (s != LM_OK)
            return s;
        range[i] = (int64_t)v;
    }
    if (range[0] >= range[1])
        return fail_at(r, LM_ERR_FORMAT, n->line, n->col, "%s: [%" PRId64 ", %" PRId64 "] is empty: FROM must be "
                       "below TO (the layers FROM to TO - 1)", what, range[0], range[1]);
    return LM_OK;
}

static lm_status read_slice(reader *r, const node *m, const char *what, lm_cfg_slice *sl)
{
    static const char *const known[] = {"sources", "parameters", "base_model", "residual_weight", NULL};
    static const char *const src_known[] = {"model", "layer_range", "parameters", NULL};
    sl->line = m->line;
    sl->col = m->col;
    lm_status s = want_map(r, m, what);
    if (s != LM_OK)
        return s;
    char sub[128], what2[128], sub2[192];
    const node *sources = NULL;
    for (int j = 0; j < m->n; j += 2) {
        const node *k = m->kids[j], *v = m->kids[j + 1];
        key_path(sub, sizeof sub, "%s.%.40s", what, k->text);
        if (strcmp(k->text, "sources") == 0) {
            sources = v;
            if ((s = want_list(r, v, sub)) != LM_OK)
                return s;
            if (!(sl->sources = calloc((size_t)v->n, sizeof *sl->sources)))
                return nomem(r);
            for (int i = 0; i < v->n; i++) {
                const node *src = v->kids[i];
                lm_cfg_model *cm = &sl->sources[i];
                sl->n_sources++;
                key_path(what2, sizeof what2, "%s[%d]", sub, i);
                if ((s = want_map(r, src, what2)) != LM_OK)
                    return s;
                bool have_model = false, have_range = false;
                for (int q = 0; q < src->n; q += 2) {
                    const node *k2 = src->kids[q], *v2 = src->kids[q + 1];
                    key_path(sub2, sizeof sub2, "%s.%.40s", what2, k2->text);
                    if (strcmp(k2->text, "model") == 0) {
                        have_model = true;
                        s = read_model_ref(r, v2, sub2, cm);
                    } else if (strcmp(k2->text, "layer_range") == 0) {
                        have_range = true;
                        s = read_layer_range(r, v2, sub2, cm->layer_range);
                    } else if (strcmp(k2->text, "parameters") == 0) {
                        s = read_params(r, v2, sub2, &cm->params);
                    } else {
                        s = unknown_key(r, k2, what2, src_known);
                    }
                    if (s != LM_OK)
                        return s;
                }
                if (!have_model || !have_range)
                    return fail_at(r, LM_ERR_FORMAT, src->line, src->col, "%s: '%s' is missing", what2,
                                   have_model ? "layer_range" : "model");
                int64_t len0 = sl->sources[0].layer_range[1] - sl->sources[0].layer_range[0];
                int64_t len = cm->layer_range[1] - cm->layer_range[0];
                if (len != len0)
                    return fail_at(r, LM_ERR_FORMAT, src->line, src->col, "%s: %" PRId64 " layers, where %s[0] has %"
                                   PRId64 ": the sources of a slice have as many layers each", what2, len, sub, len0);
            }
        } else if (strcmp(k->text, "parameters") == 0 || strcmp(k->text, "base_model") == 0 ||
                   strcmp(k->text, "residual_weight") == 0) {
            if (!is_null(v))
                return fail_at(r, LM_ERR_UNSUPPORTED, k->line, k->col, "%s: a slice's '%s' is not supported (give "
                               "parameters per source or at the top level)", what, k->text);
        } else {
            return unknown_key(r, k, what, known);
        }
    }
    if (!sources)
        return fail_at(r, LM_ERR_FORMAT, m->line, m->col, "%s: 'sources' is missing", what);
    return LM_OK;
}

static lm_status read_slices(reader *r, const node *n, lm_mergecfg *c)
{
    lm_status s = want_list(r, n, "slices");
    if (s != LM_OK)
        return s;
    if (!(c->slices = calloc((size_t)n->n, sizeof *c->slices)))
        return nomem(r);
    char what[64];
    for (int i = 0; i < n->n; i++) {
        c->n_slices++;
        key_path(what, sizeof what, "slices[%d]", i);
        if ((s = read_slice(r, n->kids[i], what, &c->slices[i])) != LM_OK)
            return s;
    }
    return LM_OK;
}

// ==== the top level ==============================================================================

static lm_status optional_string(reader *r, const node *k, const node *v, char **out, int *line, int *col)
{
    if (is_null(v))
        return LM_OK;
    if (line)
        *line = v->line;
    if (col)
        *col = v->col;
    return want_string(r, v, k->text, out);
}

// A tokenizer source (key's value v, read into source): 'union' is refused.
static lm_status not_union(reader *r, const node *v, const char *key, const char *source)
{
    if (!source || strcmp(source, "union") != 0)
        return LM_OK;
    return fail_at(r, LM_ERR_UNSUPPORTED, v->line, v->col, "%s: 'union' (a vocabulary merged from every model's) is "
                   "not supported: give 'base' or a model", key);
}

// mergekit's `tokenizer:` block. Its `source` is tokenizer_source's (and, absent, mergekit's
// default, union; null is refused, as mergekit's validation refuses it); `tokens` (an embedding
// chosen per token) and `pad_to_multiple_of` (rows added to the vocabulary) are not supported
// (null or empty, they are absent). With `source: base` or a model and neither of those it is the
// same merge as tokenizer_source.
static lm_status read_tokenizer(reader *r, const node *k, const node *v, lm_mergecfg *c)
{
    static const char *const known[] = {"source", "tokens", "pad_to_multiple_of", NULL};
    if (is_null(v))
        return LM_OK;
    lm_status s = want_map(r, v, "tokenizer");
    const node *source = NULL;
    for (int i = 0; s == LM_OK && i < v->n; i += 2) {
        const node *k2 = v->kids[i], *v2 = v->kids[i + 1];
        bool none = is_null(v2) || ((v2->kind == NODE_MAP || v2->kind == NODE_SEQ) && v2->n == 0);
        if (strcmp(k2->text, "source") == 0) {
            source = v2;
            if (is_null(v2))
                s = fail_at(r, LM_ERR_FORMAT, v2->line, v2->col, "tokenizer.source: null is not a source (give base "
                            "or a model; without the key mergekit builds a union)");
        } else if (strcmp(k2->text, "tokens") == 0 || strcmp(k2->text, "pad_to_multiple_of") == 0) {
            if (!none)
                s = fail_at(r, LM_ERR_UNSUPPORTED, k2->line, k2->col, "tokenizer.%s (%s) is not supported", k2->text,
                            k2->text[0] == 't' ? "embeddings chosen per token" : "the vocabulary padded with rows");
        } else {
            s = unknown_key(r, k2, "tokenizer", known);
        }
    }
    if (s != LM_OK)
        return s;
    if (!source)
        return fail_at(r, LM_ERR_UNSUPPORTED, k->line, k->col, "tokenizer: without 'source', mergekit builds a "
                       "'union' of every model's vocabulary, which is not supported: give source: base or a model");
    if ((s = want_string(r, source, "tokenizer.source", &c->tokenizer_source)) != LM_OK)
        return s;
    c->tokenizer_line = source->line;
    c->tokenizer_key = "tokenizer.source";
    return not_union(r, source, c->tokenizer_key, c->tokenizer_source);
}

static lm_status read_top(reader *r, const node *root, lm_mergecfg *c)
{
    static const char *const known[] = {"merge_method", "base_model", "models", "slices", "parameters", "dtype",
                                        "out_dtype", "tokenizer_source", "tokenizer", "chat_template", "random_seed",
                                        NULL};
    if (root->kind != NODE_MAP)
        return fail_at(r, LM_ERR_FORMAT, root->line, root->col, "a configuration is a mapping of keys (merge_method, "
                       "models, ...), not %s", type_name(root));
    lm_status s = check_keys(r, root, "");
    const node *models = NULL, *slices = NULL, *method = NULL, *tok_source = NULL, *tokenizer = NULL;
    for (int i = 0; i < root->n && s == LM_OK; i += 2) {
        const node *k = root->kids[i], *v = root->kids[i + 1];
        const char *key = k->text;
        if (strcmp(key, "merge_method") == 0) {
            method = v;
            c->method_line = v->line;
            c->method_col = v->col;
            s = want_string(r, v, key, &c->merge_method);
        } else if (strcmp(key, "base_model") == 0) {
            s = optional_string(r, k, v, &c->base_model, &c->base_line, &c->base_col);
        } else if (strcmp(key, "models") == 0) {
            if (!is_null(v)) {
                models = k;
                if (slices)
                    break;
                s = read_models(r, v, c);
            }
        } else if (strcmp(key, "slices") == 0) {
            if (!is_null(v)) {
                slices = k;
                if (models)
                    break;
                s = read_slices(r, v, c);
            }
        } else if (strcmp(key, "parameters") == 0) {
            s = read_params(r, v, key, &c->params);
        } else if (strcmp(key, "dtype") == 0) {
            s = optional_string(r, k, v, &c->dtype, &c->dtype_line, NULL);
        } else if (strcmp(key, "out_dtype") == 0) {
            s = optional_string(r, k, v, &c->out_dtype, &c->out_dtype_line, NULL);
        } else if (strcmp(key, "tokenizer_source") == 0 || strcmp(key, "tokenizer") == 0) {
            // two spellings of one setting: mergekit refuses both together, the second met here
            bool block = strcmp(key, "tokenizer") == 0;
            const node *other = block ? tok_source : tokenizer;
            *(block ? &tokenizer : &tok_source) = is_null(v) ? NULL : k;
            if (!is_null(v) && other)
                s = fail_at(r, LM_ERR_FORMAT, k->line, k->col, "%s and %s (line %d) are both given: give one", key,
                            other->text, other->line);
            else if (block)
                s = read_tokenizer(r, k, v, c);
            else if (!is_null(v) && (s = optional_string(r, k, v, &c->tokenizer_source, &c->tokenizer_line, NULL)) ==
                                        LM_OK)
                c->tokenizer_key = "tokenizer_source";  // (a null one leaves the block's key as it was)
            if (s == LM_OK && !block && !is_null(v))
                s = not_union(r, v, key, c->tokenizer_source);
        } else if (strcmp(key, "chat_template") == 0) {
            s = optional_string(r, k, v, &c->chat_template, &c->chat_template_line, NULL);
        } else if (strcmp(key, "random_seed") == 0) {
            if (!is_null(v)) {
                c->seed_line = v->line;
                c->has_seed = true;
                s = want_uint(r, v, key, UINT64_MAX, &c->random_seed);
            }
        } else if (strcmp(key, "modules") == 0) {
            s = fail_at(r, LM_ERR_UNSUPPORTED, k->line, k->col, "key 'modules' (mergekit's merges of several modules) "
                        "is not supported");
        } else {
            s = unknown_key(r, k, "", known);
        }
    }
    if (s != LM_OK)
        return s;
    if (models && slices) {
        const node *second = models->line > slices->line || (models->line == slices->line && models->col > slices->col)
                                 ? models : slices;
        const node *first = second == models ? slices : models;
        return fail_at(r, LM_ERR_FORMAT, second->line, second->col, "both '%s' (line %d) and '%s' are given: a "
                       "configuration has one of them", first->text, first->line, second->text);
    }
    if (!method)
        return fail_at(r, LM_ERR_FORMAT, root->line, root->col, "'merge_method' is missing (the method to merge with, "
                       "e.g. ties, slerp, linear)");
    if (!models && !slices)
        return fail_at(r, LM_ERR_FORMAT, root->line, root->col, "neither 'models' nor 'slices' is given: a "
                       "configuration has one of them");
    return LM_OK;
}

// ==== the public functions =======================================================================

lm_status lm_mergecfg_parse(lm_mergecfg **out, const char *path_for_messages, const char *text, size_t len,
                            lm_err *err)
{
    *out = NULL;
    lm_err local;
    if (!err)
        err = &local;
    const char *path = path_for_messages ? path_for_messages : "(configuration)";
    if (len > LM_MERGECFG_MAX_BYTES)
        return lm_err_set(err, LM_ERR_FORMAT, "%s: %zu bytes, more than the %u a configuration may have", path, len,
                          LM_MERGECFG_MAX_BYTES);
    lm_mergecfg *c = calloc(1, sizeof *c);
    if (!c || !(c->path = lm_strdup(path)) || !(c->text = malloc(len + 1))) {
        lm_mergecfg_free(c);
        return lm_err_set(err, LM_ERR_NOMEM, "%s: out of memory reading the configuration", path);
    }
    if (len)
        memcpy(c->text, text, len);
    c->text[len] = '\0';
    c->text_len = len;
    reader r = {.path = path, .text = c->text, .len = len, .err = err};
    node *root = NULL;
    lm_status s = build_tree(&r, &root);
    if (s == LM_OK && !root)
        s = lm_err_set(err, LM_ERR_FORMAT, "%s:1:1: the configuration is empty (merge_method and models or slices "
                       "are needed)", path);
    if (s == LM_OK)
        s = read_top(&r, root, c);
    node_free(root);
    if (s != LM_OK) {
        lm_mergecfg_free(c);
        return s;
    }
    *out = c;
    return LM_OK;
}

lm_status lm_mergecfg_load(lm_mergecfg **out, const char *path, lm_err *err)
{
    *out = NULL;
    char *text = NULL;
    size_t len = 0;
    lm_status s = lm_read_file(path, LM_MERGECFG_MAX_BYTES, &text, &len, err);
    if (s != LM_OK)
        return s;
    s = lm_mergecfg_parse(out, path, text, len, err);
    free(text);
    return s;
}

static void model_free(lm_cfg_model *m)
{
    free(m->model);
    lm_params_free(&m->params);
}

void lm_mergecfg_free(lm_mergecfg *c)
{
    if (!c)
        return;
    for (int i = 0; i < c->n_models; i++)
        model_free(&c->models[i]);
    free(c->models);
    for (int i = 0; i < c->n_slices; i++) {
        for (int j = 0; j < c->slices[i].n_sources; j++)
            model_free(&c->slices[i].sources[j]);
        free(c->slices[i].sources);
    }
    free(c->slices);
    lm_params_free(&c->params);
    free(c->path);
    free(c->text);
    free(c->merge_method);
    free(c->base_model);
    free(c->dtype);
    free(c->out_dtype);
    free(c->tokenizer_source);
    free(c->chat_template);
    free(c);
}
