// The one JSON reader: see json.h. A recursive descent over the bytes that builds the cJSON tree
// itself, because cJSON's own parser is lenient where llmerge must not be: it skips a byte order
// mark, takes text after the value unless asked not to, cuts a string at \u0000, keeps both
// copies of a key (its lookups then find the first, Python the last) and reads at most 63
// characters of a number.
#include "json.h"

#include <locale.h>
#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "util.h"

// ==== the parser ==============================================================================

// One step of the path to the value being parsed: an object's key, or an array's index.
typedef struct path_step {
    const char *key;  // NULL for an array element
    int64_t index;
} path_step;

typedef struct parser {
    const unsigned char *s;
    size_t n, i;                           // the text and the cursor
    int depth;                             // containers open around the cursor
    path_step path[LM_JSON_MAX_DEPTH];     // path[d]: the step inside the container at depth d
    size_t first_at;                       // a key given twice: its first offset (else SIZE_MAX)
    bool nul_c080;                         // \u0000 is kept as C0 80, not refused
    lm_json_error *e;
} parser;

static lm_status fail_at(parser *p, size_t at, lm_json_defect d, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

static lm_status fail_at(parser *p, size_t at, lm_json_defect d, const char *fmt, ...)
{
    p->e->defect = d;
    p->e->offset = at;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(p->e->what, sizeof p->e->what, fmt, ap);
    va_end(ap);
    return LM_ERR_FORMAT;
}

static lm_status nomem(parser *p)
{
    p->e->defect = LM_JSON_INVALID;
    p->e->offset = p->i;
    snprintf(p->e->what, sizeof p->e->what, "out of memory");
    return LM_ERR_NOMEM;
}

// "expected X, found Y" at the cursor.
static lm_status unexpected(parser *p, const char *wanted)
{
    if (p->i >= p->n)
        return fail_at(p, p->i, LM_JSON_SYNTAX, "%s, found the end of the text", wanted);
    unsigned c = p->s[p->i];
    if (c > 0x20 && c < 0x7f)
        return fail_at(p, p->i, LM_JSON_SYNTAX, "%s, found '%c'", wanted, (int)c);
    return fail_at(p, p->i, LM_JSON_SYNTAX, "%s, found byte 0x%02X", wanted, c);
}

// The path of the first `steps` steps, as "rope_scaling.factor" or "input_ids[3]".
static void path_str(const parser *p, int steps, char *buf, size_t cap)
{
    size_t at = 0;
    buf[0] = '\0';
    for (int d = 0; d < steps && at < cap; d++) {
        int w = p->path[d].key ? snprintf(buf + at, cap - at, "%s%s", d ? "." : "", p->path[d].key)
                               : snprintf(buf + at, cap - at, "[%lld]", (long long)p->path[d].index);
        if (w < 0)
            break;
        at += (size_t)w;
    }
}

static void skip_ws(parser *p)
{
    while (p->i < p->n && (p->s[p->i] == ' ' || p->s[p->i] == '\t' || p->s[p->i] == '\n' || p->s[p->i] == '\r'))
        p->i++;
}

static bool is_digit(unsigned char c) { return c >= '0' && c <= '9'; }

// The length of the well-formed UTF-8 sequence at s[0..n) (no overlongs, surrogates or values
// beyond U+10FFFF), or 0.
static size_t utf8_len(const unsigned char *s, size_t n)
{
    unsigned c = s[0];
    if (c < 0x80)
        return 1;
    size_t len;
    uint32_t cp, min;
    if ((c & 0xE0) == 0xC0)
        len = 2, cp = c & 0x1F, min = 0x80;
    else if ((c & 0xF0) == 0xE0)
        len = 3, cp = c & 0x0F, min = 0x800;
    else if ((c & 0xF8) == 0xF0)
        len = 4, cp = c & 0x07, min = 0x10000;
    else
        return 0;
    if (len > n)
        return 0;
    for (size_t k = 1; k < len; k++) {
        if ((s[k] & 0xC0) != 0x80)
            return 0;
        cp = cp << 6 | (s[k] & 0x3Fu);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
        return 0;
    return len;
}

static size_t put_utf8(char *o, uint32_t cp)
{
    if (cp < 0x80) {
        o[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        o[0] = (char)(0xC0 | cp >> 6);
        o[1] = (char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        o[0] = (char)(0xE0 | cp >> 12);
        o[1] = (char)(0x80 | (cp >> 6 & 0x3F));
        o[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    o[0] = (char)(0xF0 | cp >> 18);
    o[1] = (char)(0x80 | (cp >> 12 & 0x3F));
    o[2] = (char)(0x80 | (cp >> 6 & 0x3F));
    o[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

// Four hex digits at s[at..) into *v; false when they are not there.
static bool hex4(const parser *p, size_t at, uint32_t *v)
{
    if (at + 4 > p->n)
        return false;
    *v = 0;
    for (size_t k = at; k < at + 4; k++) {
        unsigned c = p->s[k];
        unsigned low = c | 0x20;  // 'A'-'F' as 'a'-'f'
        unsigned d = is_digit((unsigned char)c) ? c - '0' : low >= 'a' && low <= 'f' ? low - 'a' + 10 : 16;
        if (d == 16)
            return false;
        *v = *v << 4 | d;
    }
    return true;
}

// The string at the cursor (on its opening quote), decoded into a new string from
// cJSON_malloc (*out), the cursor after its closing quote.
static lm_status parse_string(parser *p, char **out)
{
    *out = NULL;
    size_t open = p->i, end = p->i + 1;
    while (end < p->n && p->s[end] != '"')
        end += p->s[end] == '\\' ? 2 : 1;
    if (end >= p->n)
        return fail_at(p, open, LM_JSON_SYNTAX, "a string is not closed");
    char *o = cJSON_malloc(end - open);  // what it decodes to is never longer
    if (!o)
        return nomem(p);
    size_t k = 0, i = open + 1;
    lm_status s = LM_OK;
    while (i < end && s == LM_OK) {
        unsigned c = p->s[i];
        if (c < 0x20) {
            s = fail_at(p, i, LM_JSON_SYNTAX, "a control character (byte 0x%02X) in a string must be written "
                        "as an escape", c);
        } else if (c != '\\') {
            size_t len = utf8_len(p->s + i, end - i);
            if (!len)
                s = fail_at(p, i, LM_JSON_INVALID, "a string is not valid UTF-8 (byte 0x%02X)", c);
            memcpy(o + k, p->s + i, len);
            k += len;
            i += len;
        } else {
            unsigned e = p->s[i + 1];
            const char *simple = strchr("\"\\/bfnrt", (int)e);
            if (e && simple) {
                o[k++] = "\"\\/\b\f\n\r\t"[simple - "\"\\/bfnrt"];
                i += 2;
                continue;
            }
            uint32_t cp, lo;
            if (e != 'u') {
                s = e > 0x20 && e < 0x7f ? fail_at(p, i, LM_JSON_SYNTAX, "'\\%c' is not a JSON escape", (int)e)
                                         : fail_at(p, i, LM_JSON_SYNTAX, "a '\\' not followed by an escape");
            } else if (!hex4(p, i + 2, &cp)) {
                s = fail_at(p, i, LM_JSON_SYNTAX, "'\\u' must be followed by four hex digits");
            } else if (cp == 0 && p->nul_c080) {
                o[k++] = (char)0xC0;
                o[k++] = (char)0x80;
                i += 6;
            } else if (cp == 0) {
                s = fail_at(p, i, LM_JSON_INVALID, "a string holds \\u0000 (a NUL character), which llmerge "
                            "does not take");
            } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
                s = fail_at(p, i, LM_JSON_INVALID, "\\u%04X is the second half of a surrogate pair without "
                            "the first", (unsigned)cp);
            } else if (cp >= 0xD800 && cp <= 0xDBFF) {
                if (i + 12 > end || p->s[i + 6] != '\\' || p->s[i + 7] != 'u' || !hex4(p, i + 8, &lo) ||
                    lo < 0xDC00 || lo > 0xDFFF) {
                    s = fail_at(p, i, LM_JSON_INVALID, "\\u%04X is the first half of a surrogate pair without "
                                "the second", (unsigned)cp);
                } else {
                    k += put_utf8(o + k, 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00));
                    i += 12;
                }
            } else {
                k += put_utf8(o + k, cp);
                i += 6;
            }
        }
    }
    if (s != LM_OK) {
        cJSON_free(o);
        return s;
    }
    o[k] = '\0';
    p->i = end + 1;
    *out = o;
    return LM_OK;
}

// A number at the cursor ('-' or a digit), as the grammar writes it.
static lm_status parse_number(parser *p, cJSON **out)
{
    size_t start = p->i, i = p->i;
    const unsigned char *s = p->s;
    if (s[i] == '-')
        i++;
    if (i >= p->n || !is_digit(s[i]))
        return fail_at(p, i, LM_JSON_SYNTAX, "a '-' must be followed by a digit");
    if (s[i] == '0') {
        if (++i < p->n && is_digit(s[i]))
            return fail_at(p, start, LM_JSON_SYNTAX, "a number may not start with 0 (no leading zeros)");
    } else {
        while (i < p->n && is_digit(s[i]))
            i++;
    }
    if (i < p->n && s[i] == '.') {
        if (++i >= p->n || !is_digit(s[i]))
            return fail_at(p, i, LM_JSON_SYNTAX, "a number needs digits after its '.'");
        while (i < p->n && is_digit(s[i]))
            i++;
    }
    if (i < p->n && (s[i] == 'e' || s[i] == 'E')) {
        if (++i < p->n && (s[i] == '+' || s[i] == '-'))
            i++;
        if (i >= p->n || !is_digit(s[i]))
            return fail_at(p, i, LM_JSON_SYNTAX, "a number needs digits in its exponent");
        while (i < p->n && is_digit(s[i]))
            i++;
    }
    size_t len = i - start;
    char *lit = cJSON_malloc(len + 1);
    if (!lit)
        return nomem(p);
    memcpy(lit, s + start, len);
    lit[len] = '\0';
    // strtod reads the locale's decimal point: give it that in a copy
    double v;
    const char *point = localeconv()->decimal_point, *dot = strchr(lit, '.');
    if (dot && point && point[0] && strcmp(point, ".") != 0) {
        char *fixed = lm_strfmt("%.*s%s%s", (int)(dot - lit), lit, point, dot + 1);
        if (!fixed) {
            cJSON_free(lit);
            return nomem(p);
        }
        v = strtod(fixed, NULL);
        free(fixed);
    } else {
        v = strtod(lit, NULL);
    }
    if (isinf(v)) {
        // "key 'rope_scaling.factor': ", "input_ids[3]: " or nothing for a number alone
        char where[LM_ERR_MSG_MAX / 4] = "", path[LM_ERR_MSG_MAX / 4 - 16];
        path_str(p, p->depth, path, sizeof path);
        if (p->depth > 0 && p->path[p->depth - 1].key)
            snprintf(where, sizeof where, "key '%s': ", path);
        else if (p->depth > 0)
            snprintf(where, sizeof where, "%s: ", path);
        lm_status st = fail_at(p, start, LM_JSON_INVALID, "%s%.*s%s is out of range (a double holds magnitudes "
                               "up to 1.8e308)", where, (int)(len > 40 ? 40 : len), lit, len > 40 ? "..." : "");
        cJSON_free(lit);
        return st;
    }
    cJSON *num = cJSON_CreateNumber(v);
    if (!num) {
        cJSON_free(lit);
        return nomem(p);
    }
    num->valuestring = lit;
    p->i = i;
    *out = num;
    return LM_OK;
}

static lm_status parse_value(parser *p, cJSON **out);

// Appends `item` to the container's children as cJSON keeps them (the first child's prev is
// the last child).
static void append(cJSON *c, cJSON *item)
{
    cJSON *first = c->child;
    if (!first) {
        c->child = item;
        item->prev = item;
        return;
    }
    cJSON *last = first->prev;
    last->next = item;
    item->prev = last;
    first->prev = item;
}

// Opens a container at the cursor: checks the depth, makes the node, steps inside.
static lm_status open_container(parser *p, cJSON **c, bool object)
{
    if (p->depth == LM_JSON_MAX_DEPTH)
        return fail_at(p, p->i, LM_JSON_INVALID, "nested deeper than %d levels", LM_JSON_MAX_DEPTH);
    *c = object ? cJSON_CreateObject() : cJSON_CreateArray();
    if (!*c)
        return nomem(p);
    p->i++;
    p->depth++;
    skip_ws(p);
    return LM_OK;
}

// Objects of more members than this find a key given twice through a hash map; smaller ones
// compare with each member.
#define SMALL_OBJECT 16

static lm_status parse_object(parser *p, cJSON **out)
{
    cJSON *obj = NULL;
    lm_status s = open_container(p, &obj, true);
    if (s != LM_OK)
        return s;
    size_t *key_at = NULL, n = 0, cap = 0;  // (n) where each member's key is
    lm_strmap seen = {0};                   // key -> member, once n > SMALL_OBJECT
    char *key = NULL;
    if (p->i < p->n && p->s[p->i] == '}') {
        p->i++;
        goto done;
    }
    for (;;) {
        skip_ws(p);
        if (p->i >= p->n || p->s[p->i] != '"') {
            s = unexpected(p, n ? "expected a string key after ','" : "expected a string key or '}'");
            goto done;
        }
        size_t at = p->i;
        if ((s = parse_string(p, &key)) != LM_OK)
            goto done;
        int64_t dup = -1;
        if (n >= SMALL_OBJECT) {
            dup = lm_strmap_get(&seen, key);
        } else {
            int64_t k = 0;
            for (const cJSON *m = obj->child; m && dup < 0; m = m->next, k++)
                if (strcmp(m->string, key) == 0)
                    dup = k;
        }
        if (dup >= 0) {
            char parent[LM_ERR_MSG_MAX / 4], in[LM_ERR_MSG_MAX / 4 + 8] = "";
            path_str(p, p->depth - 1, parent, sizeof parent);
            if (parent[0])
                snprintf(in, sizeof in, " in '%s'", parent);
            p->first_at = key_at[dup];
            s = fail_at(p, at, LM_JSON_INVALID, "key '%.200s'%s appears twice", key, in);
            goto done;
        }
        if (n == cap) {
            size_t *grown = realloc(key_at, (cap = cap ? 2 * cap : 8) * sizeof *key_at);
            if (!grown) {
                s = nomem(p);
                goto done;
            }
            key_at = grown;
        }
        skip_ws(p);
        if (p->i >= p->n || p->s[p->i] != ':') {
            s = unexpected(p, "expected ':' after the key");
            goto done;
        }
        p->i++;
        skip_ws(p);
        p->path[p->depth - 1] = (path_step){.key = key};
        cJSON *v = NULL;
        if ((s = parse_value(p, &v)) != LM_OK)
            goto done;
        v->string = key;
        key = NULL;
        append(obj, v);
        key_at[n++] = at;
        if (n == SMALL_OBJECT) {  // from here on, look keys up in a map
            if (lm_strmap_init(&seen, 4 * SMALL_OBJECT) != LM_OK) {
                s = nomem(p);
                goto done;
            }
            int64_t k = 0;
            for (const cJSON *m = obj->child; m; m = m->next)
                lm_strmap_put(&seen, m->string, k++);  // sized to hold them
        } else if (n > SMALL_OBJECT && lm_strmap_put(&seen, v->string, (int64_t)n - 1) < 0) {
            s = nomem(p);
            goto done;
        }
        skip_ws(p);
        if (p->i < p->n && p->s[p->i] == ',') {
            p->i++;
            continue;
        }
        if (p->i < p->n && p->s[p->i] == '}') {
            p->i++;
            break;
        }
        s = unexpected(p, "expected ',' or '}' after a member");
        goto done;
    }
done:
    cJSON_free(key);
    free(key_at);
    lm_strmap_free(&seen);
    if (s != LM_OK) {
        cJSON_Delete(obj);
        return s;
    }
    p->depth--;
    *out = obj;
    return LM_OK;
}

static lm_status parse_array(parser *p, cJSON **out)
{
    cJSON *arr = NULL;
    lm_status s = open_container(p, &arr, false);
    if (s != LM_OK)
        return s;
    if (p->i < p->n && p->s[p->i] == ']') {
        p->i++;
    } else {
        for (int64_t k = 0;; k++) {
            skip_ws(p);
            p->path[p->depth - 1] = (path_step){.index = k};
            cJSON *v = NULL;
            if ((s = parse_value(p, &v)) != LM_OK)
                break;
            append(arr, v);
            skip_ws(p);
            if (p->i < p->n && p->s[p->i] == ',') {
                p->i++;
                continue;
            }
            if (p->i < p->n && p->s[p->i] == ']') {
                p->i++;
                break;
            }
            s = unexpected(p, "expected ',' or ']' after an element");
            break;
        }
    }
    if (s != LM_OK) {
        cJSON_Delete(arr);
        return s;
    }
    p->depth--;
    *out = arr;
    return LM_OK;
}

// true, false or null at the cursor.
static lm_status parse_word(parser *p, cJSON **out)
{
    static const char *const words[] = {"true", "false", "null"};
    for (int w = 0; w < 3; w++) {
        size_t len = strlen(words[w]);
        if (p->n - p->i >= len && memcmp(p->s + p->i, words[w], len) == 0) {
            *out = w == 0 ? cJSON_CreateTrue() : w == 1 ? cJSON_CreateFalse() : cJSON_CreateNull();
            if (!*out)
                return nomem(p);
            p->i += len;
            return LM_OK;
        }
    }
    return unexpected(p, "expected a value");
}

static lm_status parse_value(parser *p, cJSON **out)
{
    *out = NULL;
    if (p->i >= p->n)
        return unexpected(p, "expected a value");
    unsigned char c = p->s[p->i];
    if (c == '{')
        return parse_object(p, out);
    if (c == '[')
        return parse_array(p, out);
    if (c == '"') {
        char *str = NULL;
        lm_status s = parse_string(p, &str);
        if (s != LM_OK)
            return s;
        // made as null, then turned into a string that takes `str` as it is (no copy)
        if (!(*out = cJSON_CreateNull())) {
            cJSON_free(str);
            return nomem(p);
        }
        (*out)->type = cJSON_String;
        (*out)->valuestring = str;
        return LM_OK;
    }
    if (c == '-' || is_digit(c))
        return parse_number(p, out);
    return parse_word(p, out);
}

// ==== the entry points ========================================================================

// Line and column (in characters) of byte `at` of the text.
static void position(const unsigned char *s, size_t at, int64_t *line, int64_t *column)
{
    int64_t l = 1, c = 1;
    for (size_t k = 0; k < at; k++) {
        if (s[k] == '\n')
            l++, c = 1;
        else if ((s[k] & 0xC0) != 0x80)
            c++;
    }
    *line = l;
    *column = c;
}

static lm_status parse_detail(cJSON **out, const char *text, size_t len, bool nul_c080, lm_json_error *e)
{
    *out = NULL;
    memset(e, 0, sizeof *e);
    parser p = {.s = (const unsigned char *)text, .n = len, .first_at = SIZE_MAX, .nul_c080 = nul_c080, .e = e};
    cJSON *root = NULL;
    lm_status s;
    if (len >= 3 && memcmp(text, "\xEF\xBB\xBF", 3) == 0) {
        s = fail_at(&p, 0, LM_JSON_INVALID, "starts with a UTF-8 byte order mark (bytes EF BB BF), which Python's "
                    "json module, and so transformers and PEFT, refuses: save the file as UTF-8 without it");
    } else {
        skip_ws(&p);
        s = parse_value(&p, &root);
        skip_ws(&p);
        if (s == LM_OK && p.i < p.n)
            s = fail_at(&p, p.i, LM_JSON_TRAILING, "text after the JSON value");
    }
    if (s != LM_OK) {
        cJSON_Delete(root);
        position(p.s, e->offset, &e->line, &e->column);
        if (p.first_at != SIZE_MAX)
            position(p.s, p.first_at, &e->first_line, &e->first_column);
        return s;
    }
    *out = root;
    return LM_OK;
}

lm_status lm_json_parse_detail(cJSON **out, const char *text, size_t len, lm_json_error *e)
{
    return parse_detail(out, text, len, false, e);
}

static lm_status parse_worded(cJSON **out, const char *text, size_t len, bool nul_c080, const char *label,
                              lm_err *err)
{
    lm_json_error e;
    lm_status s = parse_detail(out, text, len, nul_c080, &e);
    if (s == LM_ERR_NOMEM)
        return lm_err_set(err, s, "%s: out of memory", label);
    if (s == LM_OK)
        return s;
    char first[64] = "";
    if (e.first_line)
        snprintf(first, sizeof first, "; first at line %lld, column %lld", (long long)e.first_line,
                 (long long)e.first_column);
    return lm_err_set(err, s, "%s: %s%s (line %lld, column %lld%s)", label,
                      e.defect == LM_JSON_SYNTAX ? "not valid JSON: " : "", e.what, (long long)e.line,
                      (long long)e.column, first);
}

lm_status lm_json_parse(cJSON **out, const char *text, size_t len, const char *label, lm_err *err)
{
    return parse_worded(out, text, len, false, label, err);
}

lm_status lm_json_parse_nul(cJSON **out, const char *text, size_t len, const char *label, lm_err *err)
{
    return parse_worded(out, text, len, true, label, err);
}

lm_status lm_json_load(cJSON **out, const char *path, size_t max_bytes, lm_err *err)
{
    *out = NULL;
    char *text = NULL;
    size_t len = 0;
    lm_status s = lm_read_file(path, max_bytes, &text, &len, err);
    if (s != LM_OK)
        return s;
    s = lm_json_parse(out, text, len, path, err);
    free(text);
    return s;
}

const char *lm_json_kind(const cJSON *v)
{
    if (cJSON_IsNull(v)) return "null";
    if (cJSON_IsBool(v)) return "a boolean";
    if (cJSON_IsNumber(v)) return "a number";
    if (cJSON_IsString(v)) return "a string";
    if (cJSON_IsArray(v)) return "an array";
    if (cJSON_IsObject(v)) return "an object";
    return "invalid";
}

const char *lm_json_number_text(const cJSON *v)
{
    return cJSON_IsNumber(v) ? v->valuestring : NULL;
}
