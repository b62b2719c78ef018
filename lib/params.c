// Per-tensor parameter settings: evaluation, lookup, the tensor's position, numbers as the
// configuration reader and the command line read them, and the command-line form (params.h).
#include "params.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "util.h"

// ---- numbers ----------------------------------------------------------------------------------

static bool is_digit(char c) { return c >= '0' && c <= '9'; }

static bool span_eq(const char *s, size_t len, const char *lit)
{
    return strlen(lit) == len && memcmp(s, lit, len) == 0;
}

// True for the forms YAML 1.1 (PyYAML, which mergekit reads its files with) takes as numbers
// and llmerge's reader does not: 0x.., 0b.., digits with '_' separators, base 60 ("1:30").
// The leading-zero integers (octal there) are caught by the caller.
static bool yaml11_number(const char *s, size_t len)
{
    size_t i = 0;
    if (i < len && (s[i] == '+' || s[i] == '-'))
        i++;
    if (len - i > 2 && s[i] == '0' && (s[i + 1] == 'x' || s[i + 1] == 'b')) {
        bool hex = s[i + 1] == 'x';
        for (size_t j = i + 2; j < len; j++) {
            char c = s[j];
            bool ok = c == '_' || (hex ? is_digit(c) || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F')
                                       : c == '0' || c == '1');
            if (!ok)
                return false;
        }
        return true;
    }
    if (i >= len || !is_digit(s[i]))
        return false;
    bool sep = false;
    for (size_t j = i; j < len; j++) {
        char c = s[j];
        if (c == '_' || c == ':')
            sep = true;
        else if (!is_digit(c) && c != '.')
            return false;
    }
    return sep;
}

lm_pnum lm_param_scan_number(const char *s, size_t len, double *out)
{
    size_t i = 0;
    if (len > 0 && (s[0] == '+' || s[0] == '-'))
        i = 1;
    const char *r = s + i;
    size_t rl = len - i;
    if (span_eq(r, rl, ".inf") || span_eq(r, rl, ".Inf") || span_eq(r, rl, ".INF") || span_eq(r, rl, ".nan") ||
        span_eq(r, rl, ".NaN") || span_eq(r, rl, ".NAN"))
        return LM_PNUM_NONFINITE;

    size_t d1 = 0, d2 = 0;
    bool dot = false, exp = false;
    while (i < len && is_digit(s[i]))
        i++, d1++;
    if (i < len && s[i] == '.') {
        dot = true;
        i++;
        while (i < len && is_digit(s[i]))
            i++, d2++;
    }
    bool ok = d1 + d2 > 0;
    if (ok && i < len && (s[i] == 'e' || s[i] == 'E')) {
        exp = true;
        i++;
        if (i < len && (s[i] == '+' || s[i] == '-'))
            i++;
        size_t d3 = 0;
        while (i < len && is_digit(s[i]))
            i++, d3++;
        ok = d3 > 0;
    }
    if (!ok || i != len)
        return yaml11_number(s, len) ? LM_PNUM_UNREADABLE : LM_PNUM_NONE;
    bool integer = !dot && !exp;
    if (integer && d1 > 1 && s[len - d1] == '0')
        return LM_PNUM_UNREADABLE;  // 010 is 8 to YAML 1.1

    char small[128];
    char *buf = len < sizeof small ? small : malloc(len + 1);
    if (!buf)
        return LM_PNUM_UNREADABLE;  // a number thousands of digits long, and no memory for it
    memcpy(buf, s, len);
    buf[len] = '\0';
    errno = 0;
    double v = strtod(buf, NULL);
    bool range = errno == ERANGE && fabs(v) > 1.0;  // underflow to 0 or a subnormal is a value
    if (buf != small)
        free(buf);
    if (range || !isfinite(v))
        return LM_PNUM_NONFINITE;
    *out = v;
    return integer ? LM_PNUM_INT : LM_PNUM_FLOAT;
}

// ---- evaluation ---------------------------------------------------------------------------------

// The setting that applies to `tensor`: v itself, or the value of its first matching condition
// (followed down), or NULL when no condition matches.
static const lm_pval *leaf_of(const lm_pval *v, const char *tensor)
{
    while (v && v->kind == LM_PVAL_CONDS) {
        const lm_pval *next = NULL;
        for (int i = 0; i < v->n_conds && !next; i++) {
            const char *f = v->conds[i].filter;
            if (!f || strcmp(f, "*") == 0 || (tensor && strstr(tensor, f)))
                next = v->conds[i].value;
        }
        v = next;
    }
    return v;
}

// A gradient's value at t: mergekit's interpolation between the two neighbouring points.
static double gradient_at(const lm_pval *g, double t)
{
    if (!(t > 0))
        t = 0;  // also NaN
    if (t > 1)
        t = 1;
    int n = g->n_grad;
    double scaled = t * (double)(n - 1);
    int i0 = (int)scaled;
    int i1 = i0 + 1 < n - 1 ? i0 + 1 : n - 1;
    if (i0 > n - 1)
        i0 = n - 1;
    double frac = scaled - (double)i0;
    return (1 - frac) * g->grad[i0] + frac * g->grad[i1];
}

bool lm_pval_eval(const lm_pval *v, const char *tensor, double t, lm_pval_kind *kind, double *num,
                  const char **str)
{
    const lm_pval *leaf = leaf_of(v, tensor);
    if (!leaf)
        return false;
    lm_pval_kind k = leaf->kind == LM_PVAL_GRADIENT ? LM_PVAL_NUMBER : leaf->kind;
    if (kind)
        *kind = k;
    if (k == LM_PVAL_STRING) {
        if (str)
            *str = leaf->str;
    } else if (num) {
        *num = leaf->kind == LM_PVAL_GRADIENT ? gradient_at(leaf, t) : leaf->num;
    }
    return true;
}

const lm_param *lm_params_find(const lm_params *ps, const char *name)
{
    if (!ps || !name)
        return NULL;
    for (int i = 0; i < ps->n; i++)
        if (ps->items[i].name && strcmp(ps->items[i].name, name) == 0)
            return &ps->items[i];
    return NULL;
}

// The layer index of `tensor` (-1: none) and in *prefix the length of the text before its
// "layers.".
static int64_t layer_at(const char *tensor, size_t *prefix)
{
    if (!tensor)
        return -1;
    for (const char *p = strstr(tensor, "layers."); p; p = strstr(p + 1, "layers.")) {
        if (p != tensor && p[-1] != '.')
            continue;
        const char *d = p + 7;
        int64_t idx = 0;
        size_t nd = 0;
        for (; is_digit(d[nd]); nd++)
            idx = idx > (INT64_MAX - 9) / 10 ? INT64_MAX : idx * 10 + (d[nd] - '0');
        if (nd > 0 && d[nd] == '.') {
            *prefix = (size_t)(p - tensor);
            return idx;
        }
    }
    return -1;
}

int64_t lm_param_layer(const char *tensor)
{
    size_t prefix;
    return layer_at(tensor, &prefix);
}

void lm_param_layout_add(lm_param_layout *l, const char *tensor)
{
    size_t len = 0;
    int64_t i = layer_at(tensor, &len);
    if (i < 0)
        return;
    for (int k = 0; k < l->n_stacks; k++) {
        lm_param_stack *st = &l->stacks[k];
        if (st->len == len && memcmp(st->prefix, tensor, len) == 0) {
            if (i >= st->n)
                st->n = i == INT64_MAX ? i : i + 1;
            return;
        }
    }
    if (l->n_stacks == LM_PARAM_MAX_STACKS) {
        l->overflow = true;
        return;
    }
    l->stacks[l->n_stacks++] = (lm_param_stack){tensor, len, i == INT64_MAX ? i : i + 1};
}

// The first part of `tensor` between dots that is all digits, with the part before it, as
// "h.3" into buf; false when there is none.
static bool numbered_part(const char *tensor, char *buf, size_t cap)
{
    const char *prev = NULL;
    for (const char *p = tensor; *p;) {
        const char *end = strchr(p, '.');
        if (!end)
            break;  // the last part (weight, bias) is no block
        size_t n = (size_t)(end - p), d = 0;
        while (d < n && is_digit(p[d]))
            d++;
        if (n > 0 && d == n) {
            if (prev)
                snprintf(buf, cap, "%.*s%.*s", (int)(p - prev), prev, (int)n, p);
            else
                snprintf(buf, cap, "%.*s", (int)n, p);
            return true;
        }
        prev = p;
        p = end + 1;
    }
    return false;
}

bool lm_param_layout_position(const lm_param_layout *l, const char *tensor, double *t, char *why, size_t cap)
{
    char part[96];
    *t = 0;
    if (l->n_layers < 1) {
        snprintf(why, cap, "the base's config.json has no num_hidden_layers (at its top level or in text_config), so "
                 "llmerge does not know where its layers lie");
        return false;
    }
    size_t len = 0;
    int64_t i = layer_at(tensor, &len);
    if (i < 0) {
        if (!numbered_part(tensor, part, sizeof part))
            return true;  // outside the layers: embeddings, the final norm, lm_head
        snprintf(why, cap, "its name has numbered blocks ('%s') that are not llmerge's 'layers.<i>.', whose "
                 "positions it does not know", part);
        return false;
    }
    const lm_param_stack *st = NULL;
    for (int k = 0; k < l->n_stacks && !st; k++)
        if (l->stacks[k].len == len && memcmp(l->stacks[k].prefix, tensor, len) == 0)
            st = &l->stacks[k];
    if (!st) {
        snprintf(why, cap, "the base has layers under more than %d prefixes, and llmerge does not know which "
                 "num_hidden_layers counts", LM_PARAM_MAX_STACKS);
        return false;
    }
    // The counted stack is one of num_hidden_layers layers; where there is none, the one stack
    // that is longer: the counted layers and extra ones past them (a multi-token-prediction
    // layer), which take the last position, t = 1 (lm_param_position). Any other stack is another
    // module's (a vision tower's), placed by its own count as mergekit places each module's
    // layers: the layers it holds.
    int exact = 0, longer = 0;
    for (int k = 0; k < l->n_stacks; k++) {
        exact += l->stacks[k].n == l->n_layers;
        longer += l->stacks[k].n > l->n_layers;
    }
    bool counted = st->n == l->n_layers || (exact == 0 && longer == 1 && st->n > l->n_layers);
    *t = lm_param_position(tensor, counted ? l->n_layers : st->n);
    return true;
}

double lm_param_position(const char *tensor, int64_t n_layers)
{
    int64_t i = lm_param_layer(tensor);
    if (i < 0 || n_layers < 1)
        return 0;
    if (n_layers == 1 || i >= n_layers - 1)
        return 1;
    return (double)i / (double)(n_layers - 1);
}

const lm_pval *lm_param_leaf(const lm_params *model, const lm_params *global, const char *name, const char *tensor,
                             const lm_param **from)
{
    const lm_params *levels[2] = {model, global};
    for (int l = 0; l < 2; l++) {
        const lm_param *p = lm_params_find(levels[l], name);
        const lm_pval *leaf = p ? leaf_of(p->value, tensor) : NULL;
        if (leaf) {
            if (from)
                *from = p;
            return leaf;
        }
    }
    return NULL;
}

lm_status lm_param_number(const lm_params *model, const lm_params *global, const char *name,
                          const char *tensor, double t, double *out, bool *found, lm_err *err)
{
    *found = false;
    const lm_params *levels[2] = {model, global};
    for (int l = 0; l < 2; l++) {
        const lm_param *p = lm_params_find(levels[l], name);
        const lm_pval *leaf = p ? leaf_of(p->value, tensor) : NULL;
        if (!leaf)
            continue;
        if (leaf->kind == LM_PVAL_STRING) {
            if (leaf->line > 0)
                return lm_err_set(err, LM_ERR_USAGE, "parameter '%s' (line %d:%d): a number is needed, not the "
                                  "string '%.200s'", name, leaf->line, leaf->col, leaf->str);
            return lm_err_set(err, LM_ERR_USAGE, "parameter '%s': a number is needed, not the string '%.200s'",
                              name, leaf->str);
        }
        *out = leaf->kind == LM_PVAL_GRADIENT ? gradient_at(leaf, t) : leaf->num;
        *found = true;
        return LM_OK;
    }
    return LM_OK;
}

// ---- the command-line form ------------------------------------------------------------------------

static void trim(const char **s, size_t *len)
{
    while (*len > 0 && (**s == ' ' || **s == '\t'))
        (*s)++, (*len)--;
    while (*len > 0 && ((*s)[*len - 1] == ' ' || (*s)[*len - 1] == '\t'))
        (*len)--;
}

// Parses VALUE (a number, or numbers separated by commas) of item `item` into a new setting.
static lm_status cli_value(const char *s, size_t len, int item, lm_pval **out, lm_err *err)
{
    *out = NULL;
    int n = 1;
    for (size_t i = 0; i < len; i++)
        n += s[i] == ',';
    lm_pval *v = calloc(1, sizeof *v);
    double *g = n > 1 ? calloc((size_t)n, sizeof *g) : NULL;
    if (!v || (n > 1 && !g)) {
        free(v);
        free(g);
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory reading a parameter's value");
    }
    const char *p = s, *end = s + len;
    for (int k = 0; k < n; k++) {
        const char *c = memchr(p, ',', (size_t)(end - p));
        const char *e = c ? c : end;
        const char *t = p;
        size_t tl = (size_t)(e - p);
        trim(&t, &tl);
        double x = 0;
        lm_pnum kind = lm_param_scan_number(t, tl, &x);
        if (kind != LM_PNUM_INT && kind != LM_PNUM_FLOAT) {
            free(v);
            free(g);
            if (tl == 0)
                return lm_err_set(err, LM_ERR_USAGE, "item %d: '%.*s' has an empty number%s", item, (int)len, s,
                                  n > 1 ? " in its list" : "");
            if (kind == LM_PNUM_NONFINITE)
                return lm_err_set(err, LM_ERR_USAGE, "item %d: %.*s is not a finite number", item, (int)tl, t);
            return lm_err_set(err, LM_ERR_USAGE, "item %d: '%.*s' is not a number (a value is a number or "
                              "numbers separated by commas, e.g. 0,0.5,1)", item, (int)tl, t);
        }
        if (g)
            g[k] = x;
        else
            v->num = x;
        p = e + 1;
    }
    if (g) {
        v->kind = LM_PVAL_GRADIENT;
        v->grad = g;
        v->n_grad = n;
    } else {
        v->kind = LM_PVAL_NUMBER;
    }
    *out = v;
    return LM_OK;
}

lm_status lm_pval_parse_cli(const char *text, lm_pval **out, lm_err *err)
{
    *out = NULL;
    if (!text || !text[0])
        return lm_err_set(err, LM_ERR_USAGE, "an empty value (a number, a list 0,0.5,1, or FILTER=VALUE;...;VALUE)");
    int n = 1;
    for (const char *p = text; *p; p++)
        n += *p == ';';
    lm_pval *conds = NULL;
    if (n > 1 || strchr(text, '=')) {
        if (!(conds = calloc(1, sizeof *conds)) || !(conds->conds = calloc((size_t)n, sizeof *conds->conds))) {
            free(conds);
            return lm_err_set(err, LM_ERR_NOMEM, "out of memory reading a parameter's value");
        }
        conds->kind = LM_PVAL_CONDS;
    }
    lm_status s = LM_OK;
    const char *p = text;
    for (int k = 1; k <= n; k++) {
        const char *semi = strchr(p, ';');
        size_t len = semi ? (size_t)(semi - p) : strlen(p);
        const char *item = p;
        p += len + 1;
        const char *ti = item;
        size_t tl = len;
        trim(&ti, &tl);
        if (tl == 0) {
            s = lm_err_set(err, LM_ERR_USAGE, "item %d of '%.200s' is empty", k, text);
            break;
        }
        const char *eq = memchr(item, '=', len);
        const char *val = item;
        size_t vl = len;
        char *filter = NULL;
        if (eq) {
            const char *f = item;
            size_t fl = (size_t)(eq - item);
            trim(&f, &fl);
            val = eq + 1;
            vl = (size_t)(item + len - val);
            if (fl == 0) {
                s = lm_err_set(err, LM_ERR_USAGE, "item %d ('%.*s'): the filter before '=' is empty (write '*' "
                               "for every tensor)", k, (int)len, item);
                break;
            }
            if (memchr(val, '=', vl)) {
                s = lm_err_set(err, LM_ERR_USAGE, "item %d ('%.*s') has more than one '=' (an item is "
                               "FILTER=VALUE)", k, (int)len, item);
                break;
            }
            const char *tv = val;
            size_t tvl = vl;
            trim(&tv, &tvl);
            if (tvl == 0) {
                s = lm_err_set(err, LM_ERR_USAGE, "item %d ('%.*s') has no value after '='", k, (int)len, item);
                break;
            }
            if (!(filter = malloc(fl + 1))) {
                s = lm_err_set(err, LM_ERR_NOMEM, "out of memory reading a parameter's value");
                break;
            }
            memcpy(filter, f, fl);
            filter[fl] = '\0';
        } else if (k < n) {
            s = lm_err_set(err, LM_ERR_USAGE, "item %d ('%.*s') has no filter: only the last item may go without "
                           "one (FILTER=VALUE;...;VALUE)", k, (int)len, item);
            break;
        }
        lm_pval *v = NULL;
        if ((s = cli_value(val, vl, k, &v, err)) != LM_OK) {
            free(filter);
            break;
        }
        if (!conds) {
            *out = v;
            return LM_OK;
        }
        conds->conds[conds->n_conds].filter = filter;
        conds->conds[conds->n_conds].value = v;
        conds->n_conds++;
    }
    if (s != LM_OK) {
        lm_pval_free(conds);
        return s;
    }
    *out = conds;
    return LM_OK;
}

// ---- freeing --------------------------------------------------------------------------------------

void lm_pval_free(lm_pval *v)
{
    if (!v)
        return;
    free(v->str);
    free(v->grad);
    free(v->grad_lines);
    free(v->grad_cols);
    for (int i = 0; i < v->n_conds; i++) {
        free(v->conds[i].filter);
        lm_pval_free(v->conds[i].value);
    }
    free(v->conds);
    free(v);
}

void lm_params_free(lm_params *ps)
{
    if (!ps)
        return;
    for (int i = 0; i < ps->n; i++) {
        free(ps->items[i].name);
        lm_pval_free(ps->items[i].value);
    }
    free(ps->items);
    ps->items = NULL;
    ps->n = 0;
}
