// Text to token ids from tokenizer.json: see tokenizer.h.
#define _GNU_SOURCE  // memmem
#include "tokenizer.h"

#include <inttypes.h>
#include <cJSON.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <utf8proc.h>

#include "json.h"
#include "util.h"

#define MAX_FILE ((size_t)1 << 30)
#define MERGE_SEP '\x01'  // between the two sides of a merge's key: in no token's text

// GPT-2's pattern, ByteLevel's use_regex.
static const char GPT2_PATTERN[] = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

typedef enum norm_kind { N_UTF8PROC, N_PREPEND, N_REPLACE } norm_kind;
typedef struct norm_step {
    norm_kind kind;
    int options;        // N_UTF8PROC: utf8proc's flags
    const char *a, *b;  // N_PREPEND: a; N_REPLACE: a by b
} norm_step;

// How a split's matches and the gaps between them make pieces (tokenizers' SplitDelimiterBehavior).
typedef enum split_how {
    H_ISOLATED,     // each match and each gap a piece
    H_REMOVED,      // the gaps only
    H_MERGED_PREV,  // a match joins the gap before it (a match after a match stays alone)
    H_MERGED_NEXT,  // a match joins the gap after it (a match before a match stays alone)
    H_CONTIGUOUS,   // matches in a row join
} split_how;

typedef enum prepend_how { PREPEND_NEVER, PREPEND_FIRST, PREPEND_ALWAYS } prepend_how;

typedef enum pre_kind { P_SPLIT, P_BYTELEVEL, P_METASPACE } pre_kind;
typedef struct pre_step {
    pre_kind kind;
    pcre2_code *re;      // P_SPLIT by a regex, and P_BYTELEVEL with use_regex
    const char *lit;     // P_SPLIT by a string
    split_how how;       // P_SPLIT
    bool prefix_space;   // P_BYTELEVEL: add_prefix_space
    char rep[5];         // P_METASPACE: the replacement character, UTF-8
    prepend_how prepend; // P_METASPACE: where the replacement goes before a piece
    bool split;          // P_METASPACE: split before each replacement character (MergedWithNext)
} pre_step;

typedef struct added_tok {
    const char *content;  // as matched: the file's, or normalized (normalized: true)
    size_t len;
    int32_t id;
    const char *name;     // as the file writes it (in the tree)
} added_tok;

// Added tokens matched on one text: the raw text, or (normalized: true) each normalized text
// between two raw ones.
typedef struct added_set {
    added_tok *tok;
    int n;
    bool starts[256];  // a byte some token starts with
} added_set;

struct lm_tokenizer {
    cJSON *tree;
    char *label;
    norm_step *norm;
    int n_norm;
    pre_step *pre;
    int n_pre;
    bool byte_level;      // a ByteLevel pre-tokenizer: the model sees bytes as GPT-2's characters
    lm_strmap vocab;      // token -> id (keys in the tree)
    lm_strmap merges;     // "a\x01b" -> rank (keys in merge_keys)
    char **merge_keys;
    int64_t n_merge_keys;
    bool ignore_merges, byte_fallback, fuse_unk;
    int32_t unk;          // -1: none
    int32_t byte_tok[256];  // <0xNN> ids for byte_fallback, -1 where missing
    int32_t *before, *after;  // the template's special ids around the sequence
    int n_before, n_after;
    int64_t max_id, max_model;        // the largest id the tokenizer can give; without added tokens
    const char *max_tok, *max_model_tok;  // a token with that id (in the tree)
    added_set raw, normed;  // the added tokens matched before the normalizer, and after it
    char **norm_text;     // (normed.n) normed's contents, normalized
    char byte_char[256][3];  // GPT-2's character for each byte, UTF-8, NUL-terminated
};

static lm_status nomem(lm_err *err)
{
    return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
}

// ==== growing byte buffers =====================================================================

typedef struct sbuf {
    char *p;
    size_t n, cap;
} sbuf;

static bool sb_put(sbuf *b, const void *s, size_t n)
{
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->n + n + 1)
            cap *= 2;
        char *g = realloc(b->p, cap);
        if (!g)
            return false;
        b->p = g;
        b->cap = cap;
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = '\0';
    return true;
}

static bool push_id(int32_t **ids, int64_t *n, int64_t *cap, int32_t id)
{
    if (*n == *cap) {
        int64_t c = *cap ? 2 * *cap : 256;
        int32_t *g = realloc(*ids, (size_t)c * sizeof *g);
        if (!g)
            return false;
        *ids = g;
        *cap = c;
    }
    (*ids)[(*n)++] = id;
    return true;
}

// ==== the cache of pieces =======================================================================

struct lm_tok_cache {
    lm_strmap map;     // piece -> its entry's index
    char **keys;       // (n) the pieces, owned
    int64_t *first;    // (n) where its ids start in ids
    int32_t *count;    // (n) how many
    int32_t *ids;
    int64_t n, n_ids, cap_ids;
};

lm_tok_cache *lm_tok_cache_new(void)
{
    lm_tok_cache *c = calloc(1, sizeof *c);
    if (!c || lm_strmap_init(&c->map, LM_TOK_CACHE_MAX) != LM_OK || !(c->keys = calloc(LM_TOK_CACHE_MAX, sizeof *c->keys)) ||
        !(c->first = malloc(LM_TOK_CACHE_MAX * sizeof *c->first)) ||
        !(c->count = malloc(LM_TOK_CACHE_MAX * sizeof *c->count))) {
        lm_tok_cache_free(c);
        return NULL;
    }
    return c;
}

static void cache_clear(lm_tok_cache *c)
{
    for (int64_t i = 0; i < c->n; i++)
        free(c->keys[i]);
    c->n = c->n_ids = 0;
    lm_strmap_free(&c->map);
    lm_strmap_init(&c->map, LM_TOK_CACHE_MAX);
}

void lm_tok_cache_free(lm_tok_cache *c)
{
    if (!c)
        return;
    for (int64_t i = 0; c->keys && i < c->n; i++)
        free(c->keys[i]);
    lm_strmap_free(&c->map);
    free(c->keys);
    free(c->first);
    free(c->count);
    free(c->ids);
    free(c);
}

// Remembers that `piece` gives ids[0..n); silently nothing where memory runs out.
static void cache_put(lm_tok_cache *c, const char *piece, const int32_t *ids, int64_t n)
{
    if (c->n == LM_TOK_CACHE_MAX || !c->map.keys)
        cache_clear(c);
    if (!c->map.keys)
        return;
    if (c->n_ids + n > c->cap_ids) {
        int64_t cap = c->cap_ids ? 2 * c->cap_ids : 4096;
        while (cap < c->n_ids + n)
            cap *= 2;
        int32_t *g = realloc(c->ids, (size_t)cap * sizeof *g);
        if (!g)
            return;
        c->ids = g;
        c->cap_ids = cap;
    }
    char *key = lm_strdup(piece);
    if (!key || lm_strmap_put(&c->map, key, c->n) != 1) {
        free(key);
        return;
    }
    memcpy(c->ids + c->n_ids, ids, (size_t)n * sizeof *ids);
    c->keys[c->n] = key;
    c->first[c->n] = c->n_ids;
    c->count[c->n] = (int32_t)n;
    c->n++;
    c->n_ids += n;
}

// ==== loading ==================================================================================

void lm_tok_free(lm_tokenizer *t)
{
    if (!t)
        return;
    for (int i = 0; i < t->n_pre; i++)
        pcre2_code_free(t->pre[i].re);
    free(t->pre);
    free(t->norm);
    lm_strmap_free(&t->vocab);
    lm_strmap_free(&t->merges);
    for (int64_t i = 0; i < t->n_merge_keys; i++)
        free(t->merge_keys[i]);
    free(t->merge_keys);
    free(t->before);
    free(t->after);
    for (int i = 0; t->norm_text && i < t->normed.n; i++)
        free(t->norm_text[i]);
    free(t->norm_text);
    free(t->raw.tok);
    free(t->normed.tok);
    free(t->label);
    cJSON_Delete(t->tree);
    free(t);
}

// A token id as the file writes it: a whole number from 0 to 2^31 - 1, else -1.
static int64_t id_of(const cJSON *v)
{
    if (!cJSON_IsNumber(v) || !(v->valuedouble >= 0 && v->valuedouble <= INT32_MAX) ||
        v->valuedouble != (double)(int64_t)v->valuedouble)
        return -1;
    return (int64_t)v->valuedouble;
}

static const char *type_of(const cJSON *o)
{
    const cJSON *ty = cJSON_GetObjectItemCaseSensitive(o, "type");
    return cJSON_IsString(ty) ? ty->valuestring : NULL;
}

static bool flag(const cJSON *o, const char *key)
{
    return cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(o, key));
}

static lm_status compile_re(const lm_tokenizer *t, const char *where, const char *pattern, pcre2_code **out,
                            lm_err *err)
{
    int code;
    PCRE2_SIZE at;
    *out = pcre2_compile((PCRE2_SPTR)pattern, PCRE2_ZERO_TERMINATED, PCRE2_UTF | PCRE2_UCP, &code, &at, NULL);
    if (!*out) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(code, msg, sizeof msg);
        return lm_err_set(err, LM_ERR_UNSUPPORTED, "%s: %s: the regex '%s' does not compile here (at %zu: %s)",
                          t->label, where, pattern, (size_t)at, (const char *)msg);
    }
    pcre2_jit_compile(*out, PCRE2_JIT_COMPLETE);  // where the JIT is not there, the interpreter matches the same
    return LM_OK;
}

typedef lm_status (*component_fn)(lm_tokenizer *t, const cJSON *o, lm_err *err);

// A Sequence component (of kind `what`): each member of its list `key`, in order, to add.
static lm_status sequence(lm_tokenizer *t, const cJSON *o, const char *what, const char *key, component_fn add,
                          lm_err *err)
{
    const cJSON *list = cJSON_GetObjectItemCaseSensitive(o, key), *e;
    if (!cJSON_IsArray(list))
        return lm_err_set(err, LM_ERR_FORMAT, "%s: %s Sequence: no %s list", t->label, what, key);
    cJSON_ArrayForEach(e, list)
    {
        lm_status s = add(t, e, err);
        if (s != LM_OK)
            return s;
    }
    return LM_OK;
}

static lm_status add_norm(lm_tokenizer *t, const cJSON *n, lm_err *err)
{
    const char *ty = type_of(n);
    if (!ty)
        return lm_err_set(err, LM_ERR_FORMAT, "%s: normalizer: no type", t->label);
    if (strcmp(ty, "Sequence") == 0)
        return sequence(t, n, "normalizer", "normalizers", add_norm, err);
    norm_step st = {0};
    if (strcmp(ty, "NFC") == 0) {
        st = (norm_step){N_UTF8PROC, UTF8PROC_STABLE | UTF8PROC_COMPOSE, NULL, NULL};
    } else if (strcmp(ty, "NFKC") == 0) {
        st = (norm_step){N_UTF8PROC, UTF8PROC_STABLE | UTF8PROC_COMPOSE | UTF8PROC_COMPAT, NULL, NULL};
    } else if (strcmp(ty, "NFD") == 0) {
        st = (norm_step){N_UTF8PROC, UTF8PROC_STABLE | UTF8PROC_DECOMPOSE, NULL, NULL};
    } else if (strcmp(ty, "NFKD") == 0) {
        st = (norm_step){N_UTF8PROC, UTF8PROC_STABLE | UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT, NULL, NULL};
    } else if (strcmp(ty, "Prepend") == 0) {
        const cJSON *p = cJSON_GetObjectItemCaseSensitive(n, "prepend");
        if (!cJSON_IsString(p))
            return lm_err_set(err, LM_ERR_FORMAT, "%s: normalizer Prepend: no prepend string", t->label);
        st = (norm_step){N_PREPEND, 0, p->valuestring, NULL};
    } else if (strcmp(ty, "Replace") == 0) {
        const cJSON *pat = cJSON_GetObjectItemCaseSensitive(n, "pattern");
        const cJSON *str = cJSON_GetObjectItemCaseSensitive(pat, "String");
        const cJSON *content = cJSON_GetObjectItemCaseSensitive(n, "content");
        if (!cJSON_IsString(str) || !*str->valuestring || !cJSON_IsString(content))
            return lm_err_set(err, LM_ERR_UNSUPPORTED, "%s: normalizer Replace: only a non-empty String pattern "
                              "is supported", t->label);
        st = (norm_step){N_REPLACE, 0, str->valuestring, content->valuestring};
    } else {
        return lm_err_set(err, LM_ERR_UNSUPPORTED, "%s: normalizer '%s' is not supported", t->label, ty);
    }
    norm_step *g = realloc(t->norm, (size_t)(t->n_norm + 1) * sizeof *g);
    if (!g)
        return nomem(err);
    t->norm = g;
    t->norm[t->n_norm++] = st;
    return LM_OK;
}

// Metaspace's options as tokenizers reads them: one replacement character; prepend_scheme
// (first, never, always; always where absent), or the older add_prefix_space, whose false means
// never; split, true where absent.
static lm_status metaspace(const lm_tokenizer *t, const cJSON *p, pre_step *st, lm_err *err)
{
    const cJSON *rep = cJSON_GetObjectItemCaseSensitive(p, "replacement");
    const cJSON *scheme = cJSON_GetObjectItemCaseSensitive(p, "prepend_scheme");
    const cJSON *aps = cJSON_GetObjectItemCaseSensitive(p, "add_prefix_space");
    const cJSON *split = cJSON_GetObjectItemCaseSensitive(p, "split");
    size_t rl = cJSON_IsString(rep) ? strlen(rep->valuestring) : 0;
    utf8proc_int32_t cp;
    if (rl == 0 || rl > 4 || utf8proc_iterate((const utf8proc_uint8_t *)rep->valuestring, (utf8proc_ssize_t)rl, &cp) !=
                                 (utf8proc_ssize_t)rl)
        return lm_err_set(err, LM_ERR_FORMAT, "%s: pre_tokenizer Metaspace: replacement is not one character",
                          t->label);
    memcpy(st->rep, rep->valuestring, rl + 1);
    st->kind = P_METASPACE;
    st->prepend = PREPEND_ALWAYS;
    if (scheme && !cJSON_IsNull(scheme)) {
        const char *v = cJSON_IsString(scheme) ? scheme->valuestring : "";
        if (strcmp(v, "first") == 0)
            st->prepend = PREPEND_FIRST;
        else if (strcmp(v, "never") == 0)
            st->prepend = PREPEND_NEVER;
        else if (strcmp(v, "always") != 0)
            return lm_err_set(err, LM_ERR_FORMAT, "%s: pre_tokenizer Metaspace: prepend_scheme '%s' is none of "
                              "first, never, always", t->label, v);
    }
    if (aps && !cJSON_IsBool(aps))
        return lm_err_set(err, LM_ERR_FORMAT, "%s: pre_tokenizer Metaspace: add_prefix_space is not true or false",
                          t->label);
    if (cJSON_IsFalse(aps)) {
        if (scheme && !cJSON_IsNull(scheme) && st->prepend != PREPEND_NEVER)
            return lm_err_set(err, LM_ERR_FORMAT, "%s: pre_tokenizer Metaspace: add_prefix_space false contradicts "
                              "prepend_scheme '%s'", t->label, scheme->valuestring);
        st->prepend = PREPEND_NEVER;
    }
    if (split && !cJSON_IsBool(split))
        return lm_err_set(err, LM_ERR_FORMAT, "%s: pre_tokenizer Metaspace: split is not true or false", t->label);
    st->split = !cJSON_IsFalse(split);
    return LM_OK;
}

static lm_status add_pre(lm_tokenizer *t, const cJSON *p, lm_err *err)
{
    const char *ty = type_of(p);
    if (!ty)
        return lm_err_set(err, LM_ERR_FORMAT, "%s: pre_tokenizer: no type", t->label);
    if (strcmp(ty, "Sequence") == 0)
        return sequence(t, p, "pre_tokenizer", "pretokenizers", add_pre, err);
    pre_step st = {0};
    lm_status s = LM_OK;
    if (strcmp(ty, "Split") == 0) {
        const cJSON *pat = cJSON_GetObjectItemCaseSensitive(p, "pattern");
        const cJSON *re = cJSON_GetObjectItemCaseSensitive(pat, "Regex"), *str = cJSON_GetObjectItemCaseSensitive(pat, "String");
        const cJSON *beh = cJSON_GetObjectItemCaseSensitive(p, "behavior");
        const char *b = cJSON_IsString(beh) ? beh->valuestring : "";
        if (flag(p, "invert"))
            return lm_err_set(err, LM_ERR_UNSUPPORTED, "%s: pre_tokenizer Split with invert: true is not supported",
                              t->label);
        static const char *const hows[] = {"Isolated", "Removed", "MergedWithPrevious", "MergedWithNext", "Contiguous"};
        const int n_hows = (int)(sizeof hows / sizeof hows[0]);
        int h = 0;
        while (h < n_hows && strcmp(b, hows[h]) != 0)
            h++;
        if (h == n_hows)
            return lm_err_set(err, LM_ERR_FORMAT, "%s: pre_tokenizer Split: behavior '%s' is none of Isolated, "
                              "Removed, MergedWithPrevious, MergedWithNext, Contiguous", t->label, b);
        st.kind = P_SPLIT;
        st.how = (split_how)h;
        if (cJSON_IsString(re))
            s = compile_re(t, "pre_tokenizer Split", re->valuestring, &st.re, err);
        else if (cJSON_IsString(str) && *str->valuestring)
            st.lit = str->valuestring;
        else
            return lm_err_set(err, LM_ERR_FORMAT, "%s: pre_tokenizer Split: no Regex or String pattern", t->label);
    } else if (strcmp(ty, "ByteLevel") == 0) {
        st.kind = P_BYTELEVEL;
        st.prefix_space = flag(p, "add_prefix_space");
        if (flag(p, "use_regex"))
            s = compile_re(t, "pre_tokenizer ByteLevel", GPT2_PATTERN, &st.re, err);
        t->byte_level = true;
    } else if (strcmp(ty, "Metaspace") == 0) {
        s = metaspace(t, p, &st, err);
    } else {
        return lm_err_set(err, LM_ERR_UNSUPPORTED, "%s: pre_tokenizer '%s' is not supported", t->label, ty);
    }
    if (s != LM_OK)
        return s;
    pre_step *g = realloc(t->pre, (size_t)(t->n_pre + 1) * sizeof *g);
    if (!g) {
        pcre2_code_free(st.re);
        return nomem(err);
    }
    t->pre = g;
    t->pre[t->n_pre++] = st;
    return LM_OK;
}

// The special ids TemplateProcessing's `single` puts before and after the sequence.
static lm_status add_post(lm_tokenizer *t, const cJSON *p, lm_err *err)
{
    const char *ty = type_of(p);
    if (!ty)
        return lm_err_set(err, LM_ERR_FORMAT, "%s: post_processor: no type", t->label);
    if (strcmp(ty, "Sequence") == 0)
        return sequence(t, p, "post_processor", "processors", add_post, err);
    if (strcmp(ty, "ByteLevel") == 0)
        return LM_OK;  // offsets only
    if (strcmp(ty, "TemplateProcessing") != 0)
        return lm_err_set(err, LM_ERR_UNSUPPORTED, "%s: post_processor '%s' is not supported", t->label, ty);
    const cJSON *single = cJSON_GetObjectItemCaseSensitive(p, "single"), *specials = cJSON_GetObjectItemCaseSensitive(p, "special_tokens"), *e;
    bool seen_seq = false;
    cJSON_ArrayForEach(e, single)
    {
        const cJSON *sp = cJSON_GetObjectItemCaseSensitive(e, "SpecialToken");
        if (cJSON_GetObjectItemCaseSensitive(e, "Sequence")) {
            seen_seq = true;
            continue;
        }
        const cJSON *id = cJSON_GetObjectItemCaseSensitive(sp, "id");
        const cJSON *entry = cJSON_IsString(id) ? cJSON_GetObjectItemCaseSensitive(specials, id->valuestring) : NULL;
        const cJSON *ids = cJSON_GetObjectItemCaseSensitive(entry, "ids"), *x;
        if (!cJSON_IsArray(ids))
            return lm_err_set(err, LM_ERR_FORMAT, "%s: post_processor TemplateProcessing: special token '%s' has no "
                              "ids", t->label, cJSON_IsString(id) ? id->valuestring : "?");
        cJSON_ArrayForEach(x, ids)
        {
            if (id_of(x) < 0)
                return lm_err_set(err, LM_ERR_FORMAT, "%s: post_processor: an id that is not a token id", t->label);
            int32_t **dst = seen_seq ? &t->after : &t->before;
            int *n = seen_seq ? &t->n_after : &t->n_before;
            int32_t *g = realloc(*dst, (size_t)(*n + 1) * sizeof *g);
            if (!g)
                return nomem(err);
            *dst = g;
            g[(*n)++] = (int32_t)id_of(x);
        }
    }
    return LM_OK;
}

static lm_status load_model(lm_tokenizer *t, const cJSON *m, lm_err *err)
{
    const char *ty = type_of(m);
    if (!ty || strcmp(ty, "BPE") != 0)
        return lm_err_set(err, LM_ERR_UNSUPPORTED, "%s: model '%s' is not supported (BPE is)", t->label,
                          ty ? ty : "(no type)");
    const cJSON *dropout = cJSON_GetObjectItemCaseSensitive(m, "dropout");
    const cJSON *csp = cJSON_GetObjectItemCaseSensitive(m, "continuing_subword_prefix");
    const cJSON *ews = cJSON_GetObjectItemCaseSensitive(m, "end_of_word_suffix");
    if (dropout && !cJSON_IsNull(dropout))
        return lm_err_set(err, LM_ERR_UNSUPPORTED, "%s: model BPE with dropout is not supported", t->label);
    if ((cJSON_IsString(csp) && *csp->valuestring) || (cJSON_IsString(ews) && *ews->valuestring))
        return lm_err_set(err, LM_ERR_UNSUPPORTED, "%s: model BPE with a continuing_subword_prefix or "
                          "end_of_word_suffix is not supported", t->label);
    t->ignore_merges = flag(m, "ignore_merges");
    t->byte_fallback = flag(m, "byte_fallback");
    t->fuse_unk = flag(m, "fuse_unk");
    const cJSON *vocab = cJSON_GetObjectItemCaseSensitive(m, "vocab"), *merges = cJSON_GetObjectItemCaseSensitive(m, "merges"), *e;
    if (!cJSON_IsObject(vocab) || !cJSON_IsArray(merges))
        return lm_err_set(err, LM_ERR_FORMAT, "%s: model: no vocab object or merges list", t->label);
    if (lm_strmap_init(&t->vocab, (size_t)cJSON_GetArraySize(vocab) + 1024) != LM_OK)
        return nomem(err);
    cJSON_ArrayForEach(e, vocab)
    {
        if (id_of(e) < 0)
            return lm_err_set(err, LM_ERR_FORMAT, "%s: model.vocab: token '%s' has no token id", t->label, e->string);
        if (lm_strmap_put(&t->vocab, e->string, id_of(e)) < 0)
            return nomem(err);
    }
    int64_t n = cJSON_GetArraySize(merges), rank = 0;
    if (lm_strmap_init(&t->merges, (size_t)n + 16) != LM_OK || !(t->merge_keys = calloc((size_t)n + 1, sizeof(char *))))
        return nomem(err);
    cJSON_ArrayForEach(e, merges)
    {
        const char *a = NULL, *b = NULL;
        size_t la = 0;
        if (cJSON_IsString(e)) {  // "a b"
            const char *sp = strchr(e->valuestring, ' ');
            if (sp) {
                a = e->valuestring;
                la = (size_t)(sp - a);
                b = sp + 1;
            }
        } else if (cJSON_IsArray(e) && cJSON_GetArraySize(e) == 2 && cJSON_IsString(cJSON_GetArrayItem(e, 0)) &&
                   cJSON_IsString(cJSON_GetArrayItem(e, 1))) {
            a = cJSON_GetArrayItem(e, 0)->valuestring;
            la = strlen(a);
            b = cJSON_GetArrayItem(e, 1)->valuestring;
        }
        if (!a)
            return lm_err_set(err, LM_ERR_FORMAT, "%s: model.merges[%" PRId64 "]: not a pair of tokens", t->label, rank);
        size_t lb = strlen(b);
        char *key = malloc(la + lb + 2);
        if (!key)
            return nomem(err);
        memcpy(key, a, la);
        key[la] = MERGE_SEP;
        memcpy(key + la + 1, b, lb + 1);
        t->merge_keys[t->n_merge_keys++] = key;
        if (lm_strmap_put(&t->merges, key, rank) < 0)  // a pair listed twice keeps its first rank
            return nomem(err);
        rank++;
    }
    t->unk = -1;
    const cJSON *unk = cJSON_GetObjectItemCaseSensitive(m, "unk_token");
    if (cJSON_IsString(unk)) {
        int64_t id = lm_strmap_get(&t->vocab, unk->valuestring);
        t->unk = id >= 0 ? (int32_t)id : -1;
    }
    for (int b2 = 0; b2 < 256; b2++) {
        char name[8];
        snprintf(name, sizeof name, "<0x%02X>", b2);
        int64_t id = lm_strmap_get(&t->vocab, name);
        t->byte_tok[b2] = id >= 0 ? (int32_t)id : -1;
    }
    return LM_OK;
}

static bool normalize(const lm_tokenizer *t, const char *w, size_t len, sbuf *out, bool *lead_kept);

// The added tokens: those with normalized: true are matched on the normalized text, as their
// content normalized; the others on the raw text.
static lm_status load_added(lm_tokenizer *t, const cJSON *added, lm_err *err)
{
    size_t n = (size_t)cJSON_GetArraySize(added) + 1;
    if (!(t->raw.tok = calloc(n, sizeof *t->raw.tok)) || !(t->normed.tok = calloc(n, sizeof *t->normed.tok)) ||
        !(t->norm_text = calloc(n, sizeof *t->norm_text)))
        return nomem(err);
    const cJSON *e;
    cJSON_ArrayForEach(e, added)
    {
        const cJSON *c = cJSON_GetObjectItemCaseSensitive(e, "content"), *id = cJSON_GetObjectItemCaseSensitive(e, "id");
        if (!cJSON_IsString(c) || id_of(id) < 0)
            return lm_err_set(err, LM_ERR_FORMAT, "%s: added_tokens: an entry without content or a token id",
                              t->label);
        if (flag(e, "lstrip") || flag(e, "rstrip") || flag(e, "single_word"))
            return lm_err_set(err, LM_ERR_UNSUPPORTED, "%s: added token '%s' with lstrip, rstrip or single_word is "
                              "not supported", t->label, c->valuestring);
        added_set *set = &t->raw;
        const char *text = c->valuestring;
        // a token holding NUL (C0 80 here) matches no text, and no normalizer takes it: it keeps its id
        if (flag(e, "normalized") && !strstr(text, "\xC0\x80")) {
            sbuf nt = {0};
            if (!normalize(t, text, strlen(text), &nt, NULL)) {
                free(nt.p);
                return nomem(err);
            }
            if (nt.n == 0) {
                free(nt.p);
                continue;
            }
            text = t->norm_text[t->normed.n] = nt.p;
            set = &t->normed;
        }
        if (!*text)
            continue;
        set->tok[set->n++] = (added_tok){text, strlen(text), (int32_t)id_of(id), c->valuestring};
        set->starts[(unsigned char)text[0]] = true;
    }
    return LM_OK;
}

// The largest id the tokenizer can give, and a token of it: the vocabulary's, the added tokens',
// the template's.
static void find_max_id(lm_tokenizer *t)
{
    const cJSON *vocab = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(t->tree, "model"), "vocab");
    const cJSON *e;
    t->max_id = -1;
    t->max_tok = NULL;
    cJSON_ArrayForEach(e, vocab)
    {
        if (id_of(e) > t->max_id)
            t->max_id = id_of(e), t->max_tok = e->string;
    }
    for (int i = 0; i < t->n_before + t->n_after; i++) {
        int32_t id = i < t->n_before ? t->before[i] : t->after[i - t->n_before];
        if (id > t->max_id)
            t->max_id = id, t->max_tok = "(a special token of the post-processor)";
    }
    t->max_model = t->max_id;
    t->max_model_tok = t->max_tok;
    for (int i = 0; i < t->raw.n + t->normed.n; i++) {
        const added_tok *a = i < t->raw.n ? &t->raw.tok[i] : &t->normed.tok[i - t->raw.n];
        if (a->id > t->max_id)
            t->max_id = a->id, t->max_tok = a->name;
    }
}

// GPT-2's bytes_to_unicode: the printable bytes stand for themselves, the others for 256 + n in
// their order.
static void byte_chars(lm_tokenizer *t)
{
    int n = 0;
    for (int b = 0; b < 256; b++) {
        bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
        int cp = printable ? b : 256 + n++;
        utf8proc_uint8_t buf[4];
        utf8proc_ssize_t len = utf8proc_encode_char(cp, buf);
        memcpy(t->byte_char[b], buf, (size_t)len);
        t->byte_char[b][len] = '\0';
    }
}

lm_status lm_tok_parse(lm_tokenizer **out, const char *text, size_t len, const char *label, lm_err *err)
{
    *out = NULL;
    lm_tokenizer *t = calloc(1, sizeof *t);
    if (!t || !(t->label = lm_strdup(label))) {
        free(t);
        return nomem(err);
    }
    lm_status s = lm_json_parse_nul(&t->tree, text, len, label, err);  // a token may be NUL
    const cJSON *root = t->tree;
    if (s == LM_OK && !cJSON_IsObject(root))
        s = lm_err_set(err, LM_ERR_FORMAT, "%s: not a JSON object", label);
    if (s == LM_OK)
        s = load_model(t, cJSON_GetObjectItemCaseSensitive(root, "model"), err);
    const cJSON *norm = cJSON_GetObjectItemCaseSensitive(root, "normalizer");
    const cJSON *pre = cJSON_GetObjectItemCaseSensitive(root, "pre_tokenizer");
    const cJSON *post = cJSON_GetObjectItemCaseSensitive(root, "post_processor");
    if (s == LM_OK && norm && !cJSON_IsNull(norm))
        s = add_norm(t, norm, err);
    if (s == LM_OK && pre && !cJSON_IsNull(pre))
        s = add_pre(t, pre, err);
    if (s == LM_OK && post && !cJSON_IsNull(post))
        s = add_post(t, post, err);
    if (s == LM_OK)
        s = load_added(t, cJSON_GetObjectItemCaseSensitive(root, "added_tokens"), err);
    byte_chars(t);
    if (s != LM_OK) {
        lm_tok_free(t);
        return s;
    }
    find_max_id(t);
    *out = t;
    return LM_OK;
}

// The id of a token named in tokenizer_config.json: a string, or an object with its "content"
// (as transformers writes an AddedToken); an added token's id, else the vocabulary's; -1: none.
static int64_t config_token(const lm_tokenizer *t, const cJSON *v)
{
    if (cJSON_IsObject(v))
        v = cJSON_GetObjectItemCaseSensitive(v, "content");
    if (!cJSON_IsString(v))
        return -1;
    for (int i = 0; i < t->raw.n + t->normed.n; i++) {
        const added_tok *a = i < t->raw.n ? &t->raw.tok[i] : &t->normed.tok[i - t->raw.n];
        if (strcmp(a->name, v->valuestring) == 0)
            return a->id;
    }
    return lm_strmap_get(&t->vocab, v->valuestring);
}

// What add_bos_token (add_eos_token) asks for: *id the token's (bos_token, eos_token), or -1 for
// none (false, null or absent).
static lm_status config_side(const lm_tokenizer *t, const cJSON *root, const char *add_key, const char *tok_key,
                             int64_t *id, const char *label, lm_err *err)
{
    const cJSON *add = cJSON_GetObjectItemCaseSensitive(root, add_key);
    *id = -1;
    if (add && !cJSON_IsBool(add) && !cJSON_IsNull(add))
        return lm_err_set(err, LM_ERR_FORMAT, "%s: %s is not true, false or null", label, add_key);
    if (!cJSON_IsTrue(add))
        return LM_OK;
    if ((*id = config_token(t, cJSON_GetObjectItemCaseSensitive(root, tok_key))) < 0)
        return lm_err_set(err, LM_ERR_FORMAT, "%s: %s is true but %s is no token of %s", label, add_key, tok_key,
                          t->label);
    return LM_OK;
}

// Sets the ids of one side of the template to `id` alone, or to none (id < 0).
static bool set_side(int32_t **ids, int *n, int64_t id)
{
    *n = 0;
    if (id < 0)
        return true;
    int32_t *g = realloc(*ids, sizeof *g);
    if (!g)
        return false;
    *ids = g;
    g[0] = (int32_t)id;
    *n = 1;
    return true;
}

lm_status lm_tok_config(lm_tokenizer *t, const char *text, size_t len, const char *label, lm_err *err)
{
    cJSON *root = NULL;
    lm_status s = lm_json_parse_nul(&root, text, len, label, err);  // a chat template may hold \u0000
    if (s == LM_OK && !cJSON_IsObject(root))
        s = lm_err_set(err, LM_ERR_FORMAT, "%s: not a JSON object", label);
    int64_t bos = -1, eos = -1;
    bool given = s == LM_OK && (cJSON_GetObjectItemCaseSensitive(root, "add_bos_token") ||
                                cJSON_GetObjectItemCaseSensitive(root, "add_eos_token"));
    if (given && (s = config_side(t, root, "add_bos_token", "bos_token", &bos, label, err)) == LM_OK)
        s = config_side(t, root, "add_eos_token", "eos_token", &eos, label, err);
    cJSON_Delete(root);
    if (s != LM_OK || !given)  // nothing changed
        return s;
    if (!set_side(&t->before, &t->n_before, bos) || !set_side(&t->after, &t->n_after, eos))
        return nomem(err);
    find_max_id(t);
    return LM_OK;
}

int64_t lm_tok_max_id(const lm_tokenizer *t, const char **token, bool added)
{
    if (token)
        *token = added ? t->max_tok : t->max_model_tok;
    return added ? t->max_id : t->max_model;
}

lm_status lm_tok_load(lm_tokenizer **out, const char *path, lm_err *err)
{
    *out = NULL;
    if (!lm_is_file(path))
        return lm_err_set(err, LM_ERR_NOT_FOUND, "%s: no such file", path);
    char *text = NULL;
    size_t len = 0;
    lm_status s = lm_read_file(path, MAX_FILE, &text, &len, err);
    if (s == LM_OK)
        s = lm_tok_parse(out, text, len, path, err);
    free(text);
    text = NULL;
    // tokenizer_config.json beside it
    char *dir = lm_path_parent(path);
    char *cfg = dir ? lm_path_join(dir, "tokenizer_config.json") : NULL;
    if (s == LM_OK && !cfg)
        s = nomem(err);
    if (s == LM_OK && lm_is_file(cfg) && (s = lm_read_file(cfg, MAX_FILE, &text, &len, err)) == LM_OK)
        s = lm_tok_config(*out, text, len, cfg, err);
    free(text);
    free(cfg);
    free(dir);
    if (s != LM_OK) {
        lm_tok_free(*out);
        *out = NULL;
    }
    return s;
}

// ==== encoding =================================================================================

int64_t lm_utf8_bad_line(const char *text, size_t len)
{
    int64_t line = 1;
    for (size_t i = 0; i < len; line++) {
        const char *nl = memchr(text + i, '\n', len - i);
        size_t end = nl ? (size_t)(nl - text) : len;
        if (!lm_utf8_valid(text + i, end - i))
            return line;
        i = end + 1;
    }
    return 0;
}
// The byte length of the UTF-8 character at s (1 for a byte that starts none: the text was checked).
static size_t char_len(const unsigned char *s)
{
    return s[0] < 0x80 ? 1 : s[0] < 0xE0 ? 2 : s[0] < 0xF0 ? 3 : 4;
}

// What one lm_tok_encode carries down to every piece.
typedef struct enc {
    const lm_tokenizer *t;
    lm_tok_cache *c;       // may be NULL
    int32_t **ids;         // the ids so far: n of them, cap their room
    int64_t *n, *cap;
    sbuf key;              // a merge's key, reused
    const char *origin;    // the normalized text's first byte where it starts the whole text, else
                           // NULL: a piece that starts there is Metaspace's "first"
    lm_err *err;
} enc;

static bool emit(enc *e, int32_t id)
{
    return push_id(e->ids, e->n, e->cap, id);
}

// A piece's ids by BPE: its characters (or their bytes' tokens, or unk), then the merge of the
// adjacent pair of lowest rank, again, until none applies.
typedef struct sym {
    size_t start, end;  // in the piece
    int32_t id;         // >= 0: a byte-fallback or unknown symbol, not merged; -1: by its text
} sym;

static lm_status bpe_uncached(enc *e, char *piece, size_t len);

// bpe_uncached, through the cache where there is one.
static lm_status bpe(enc *e, const char *w, size_t len)
{
    char stack[128], *piece = len < sizeof stack ? stack : malloc(len + 1);
    if (!piece)
        return nomem(e->err);
    memcpy(piece, w, len);
    piece[len] = '\0';
    lm_tok_cache *c = e->c;
    int64_t hit = c ? lm_strmap_get(&c->map, piece) : -1;
    lm_status s = LM_OK;
    if (hit >= 0) {
        for (int32_t i = 0; i < c->count[hit] && s == LM_OK; i++)
            if (!emit(e, c->ids[c->first[hit] + i]))
                s = nomem(e->err);
    } else {
        int64_t before = *e->n;
        s = bpe_uncached(e, piece, len);
        if (s == LM_OK && c)
            cache_put(c, piece, *e->ids + before, *e->n - before);
    }
    if (piece != stack)
        free(piece);
    return s;
}

// The piece's ids by the merges (piece is NUL-terminated, the caller's to keep).
static lm_status bpe_uncached(enc *e, char *piece, size_t len)
{
    const lm_tokenizer *t = e->t;
    lm_status s = LM_OK;
    int64_t whole = t->ignore_merges ? lm_strmap_get(&t->vocab, piece) : -1;
    if (whole >= 0)
        return emit(e, (int32_t)whole) ? LM_OK : nomem(e->err);
    sym *sy = malloc((len + 1) * sizeof *sy);
    int ns = 0;
    if (!sy)
        return nomem(e->err);
    for (size_t i = 0; i < len;) {
        size_t cl = char_len((const unsigned char *)piece + i);
        char save = piece[i + cl];
        piece[i + cl] = '\0';
        bool known = lm_strmap_get(&t->vocab, piece + i) >= 0;
        piece[i + cl] = save;
        if (known) {
            sy[ns++] = (sym){i, i + cl, -1};
        } else if (t->byte_fallback && t->byte_tok[(unsigned char)piece[i]] >= 0) {
            for (size_t b = i; b < i + cl; b++)
                sy[ns++] = (sym){b, b + 1, t->byte_tok[(unsigned char)piece[b]] >= 0 ? t->byte_tok[(unsigned char)piece[b]] : t->unk};
        } else if (t->unk >= 0) {
            if (!(t->fuse_unk && ns > 0 && sy[ns - 1].id == t->unk))
                sy[ns++] = (sym){i, i + cl, t->unk};
        } else {
            free(sy);
            return lm_err_set(e->err, LM_ERR_FORMAT, "%s: '%s' has a character in no token and the model has no "
                              "unk_token", t->label, piece);
        }
        i += cl;
    }
    sbuf *key = &e->key;
    for (;;) {
        int64_t best = -1;
        int at = -1;
        for (int i = 0; i + 1 < ns; i++) {
            if (sy[i].id >= 0 || sy[i + 1].id >= 0)
                continue;
            key->n = 0;
            if (!sb_put(key, piece + sy[i].start, sy[i].end - sy[i].start) || !sb_put(key, (char[]){MERGE_SEP}, 1) ||
                !sb_put(key, piece + sy[i + 1].start, sy[i + 1].end - sy[i + 1].start)) {
                s = nomem(e->err);
                break;
            }
            int64_t r = lm_strmap_get(&t->merges, key->p);
            if (r >= 0 && (best < 0 || r < best))
                best = r, at = i;
        }
        if (s != LM_OK || at < 0)
            break;
        sy[at].end = sy[at + 1].end;
        memmove(sy + at + 1, sy + at + 2, (size_t)(ns - at - 2) * sizeof *sy);
        ns--;
    }
    for (int i = 0; s == LM_OK && i < ns; i++) {
        int32_t id = sy[i].id;
        if (id < 0) {
            char save = piece[sy[i].end];
            piece[sy[i].end] = '\0';
            int64_t v = lm_strmap_get(&t->vocab, piece + sy[i].start);
            piece[sy[i].end] = save;
            id = v >= 0 ? (int32_t)v : t->unk;
        }
        if (id >= 0 && !emit(e, id))
            s = nomem(e->err);
    }
    free(sy);
    return s;
}

// A piece as the model sees it after the ByteLevel step: each byte as GPT-2's character.
static bool to_bytelevel(const lm_tokenizer *t, const char *w, size_t len, sbuf *out)
{
    out->n = 0;
    if (!sb_put(out, "", 0))
        return false;
    for (size_t i = 0; i < len; i++)
        if (!sb_put(out, t->byte_char[(unsigned char)w[i]], strlen(t->byte_char[(unsigned char)w[i]])))
            return false;
    return true;
}

static lm_status pieces(enc *e, int k, const char *w, size_t len);

// A split of w into pieces for the pre-tokenizer's steps from k on: its parts (each match of the
// pattern and each gap between two) come in order and are joined as `how` says; one piece is
// held back until the next part shows whether they join.
typedef struct splitter {
    enc *e;
    int k;
    split_how how;
    const char *w;
    size_t a, b;  // the piece held back, [a, b) of w (a == b: none)
    bool prev;    // the last part was a match
} splitter;

static lm_status give(splitter *sp, size_t a, size_t b)
{
    return pieces(sp->e, sp->k, sp->w + a, b - a);
}

static lm_status flush(splitter *sp)
{
    lm_status s = sp->a < sp->b ? give(sp, sp->a, sp->b) : LM_OK;
    sp->a = sp->b = 0;
    return s;
}

// The next part, [a, b) of w, a match or a gap; only a match may be empty (it joins or holds
// nothing, but it is a match for the rules of the parts around it).
static lm_status part(splitter *sp, size_t a, size_t b, bool match)
{
    lm_status s = LM_OK;
    bool held = sp->a < sp->b;
    switch (sp->how) {
    case H_ISOLATED:
        s = give(sp, a, b);
        break;
    case H_REMOVED:
        s = match ? LM_OK : give(sp, a, b);
        break;
    case H_MERGED_PREV:
        if (match && !sp->prev && held) {
            sp->b = b;
        } else {
            s = flush(sp);
            sp->a = a, sp->b = b;
        }
        break;
    case H_MERGED_NEXT:  // only a match is held
        if (!match && held) {
            s = give(sp, sp->a, b);
            sp->a = sp->b = 0;
        } else {
            s = flush(sp);
            if (match)
                sp->a = a, sp->b = b;
            else if (s == LM_OK)
                s = give(sp, a, b);
        }
        break;
    case H_CONTIGUOUS:
        if (held && match == sp->prev) {
            sp->b = b;
        } else {
            s = flush(sp);
            sp->a = a, sp->b = b;
        }
        break;
    }
    sp->prev = match;
    return s;
}

// w split by the regex re or the string lit, its pieces to the steps from k on.
static lm_status split(enc *e, int k, const pcre2_code *re, const char *lit, split_how how, const char *w,
                       size_t len)
{
    splitter sp = {e, k, how, w, 0, 0, false};
    lm_status s = LM_OK;
    size_t last = 0;  // where the gap before the next match starts
    if (lit) {
        size_t ll = strlen(lit);
        const char *hit;
        while (s == LM_OK && (hit = memmem(w + last, len - last, lit, ll)) != NULL) {
            size_t at = (size_t)(hit - w);
            if (at > last)
                s = part(&sp, last, at, false);
            if (s == LM_OK)
                s = part(&sp, at, at + ll, true);
            last = at + ll;
        }
    } else {
        pcre2_match_data *md = pcre2_match_data_create_from_pattern(re, NULL);
        if (!md)
            return nomem(e->err);
        size_t pos = 0, prev_end = SIZE_MAX;  // where the last match ended (none yet)
        while (s == LM_OK && pos <= len) {
            int rc = pcre2_match(re, (PCRE2_SPTR)w, len, pos, 0, md, NULL);
            if (rc == PCRE2_ERROR_NOMATCH)
                break;
            if (rc < 0) {
                s = lm_err_set(e->err, LM_ERR_FORMAT, "%s: the pre-tokenizer's regex failed on a text (PCRE2 error "
                               "%d)", e->t->label, rc);
                break;
            }
            PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
            // An empty match is a match (it cuts the gap where it is), as the Rust library's
            // iterator gives them, but for one right where the last match ended; then on to the
            // next character.
            bool empty = ov[1] == ov[0];
            if (!(empty && ov[0] == prev_end)) {
                if (ov[0] > last)
                    s = part(&sp, last, ov[0], false);
                if (s == LM_OK)
                    s = part(&sp, ov[0], ov[1], true);
                last = prev_end = ov[1];
            }
            pos = !empty ? ov[1] : ov[0] < len ? ov[0] + char_len((const unsigned char *)w + ov[0]) : len + 1;
        }
        pcre2_match_data_free(md);
    }
    if (s == LM_OK && last < len)
        s = part(&sp, last, len, false);
    if (s == LM_OK)
        s = flush(&sp);
    return s;
}

// Metaspace: each space becomes the replacement character, which is put before the piece where
// the scheme says and the piece does not start with it; then, with split, a piece starts at each.
static lm_status metaspace_piece(enc *e, int k, const pre_step *st, const char *w, size_t len)
{
    size_t rl = strlen(st->rep);
    bool starts = w[0] == ' ' || (len >= rl && memcmp(w, st->rep, rl) == 0);
    bool put = !starts && (st->prepend == PREPEND_ALWAYS || (st->prepend == PREPEND_FIRST && w == e->origin));
    sbuf x = {0};
    bool ok = sb_put(&x, "", 0) && (!put || sb_put(&x, st->rep, rl));
    for (size_t i = 0, from = 0; ok && i <= len; i++)
        if (i == len || w[i] == ' ') {
            ok = sb_put(&x, w + from, i - from) && (i == len || sb_put(&x, st->rep, rl));
            from = i + 1;
        }
    lm_status s = !ok                ? nomem(e->err)
                  : st->split ? split(e, k + 1, NULL, st->rep, H_MERGED_NEXT, x.p, x.n)
                              : pieces(e, k + 1, x.p, x.n);
    free(x.p);
    return s;
}

// The pieces of the pre-tokenizer from step `k` on, each then given to the model.
static lm_status pieces(enc *e, int k, const char *w, size_t len)
{
    const lm_tokenizer *t = e->t;
    if (len == 0)
        return LM_OK;
    if (k == t->n_pre) {
        if (!t->byte_level)
            return bpe(e, w, len);
        sbuf bl = {0};
        lm_status s = to_bytelevel(t, w, len, &bl) ? bpe(e, bl.p, bl.n) : nomem(e->err);
        free(bl.p);
        return s;
    }
    const pre_step *st = &t->pre[k];
    if (st->kind == P_METASPACE)
        return metaspace_piece(e, k, st, w, len);
    if (st->kind == P_SPLIT)
        return split(e, k + 1, st->re, st->lit, st->how, w, len);
    // ByteLevel: a space before the piece where add_prefix_space says; use_regex: GPT-2's pattern,
    // an Isolated split
    sbuf pre = {0};
    const char *x = w;
    size_t xl = len;
    if (st->prefix_space && w[0] != ' ') {
        if (!sb_put(&pre, " ", 1) || !sb_put(&pre, w, len)) {
            free(pre.p);
            return nomem(e->err);
        }
        x = pre.p;
        xl = pre.n;
    }
    lm_status s = st->re ? split(e, k + 1, st->re, NULL, H_ISOLATED, x, xl) : pieces(e, k + 1, x, xl);
    free(pre.p);
    return s;
}

// The normalizer's steps on the `len` bytes at w, into *out (NUL-terminated; the caller frees
// out->p, also on failure). *lead_kept (when not NULL): whether the normalized text still starts
// with what the text started with, not after characters a Replace removed there (the Rust
// library's offsets then no longer start at 0, which Metaspace's "first" looks at). False when
// memory runs out.
static bool normalize(const lm_tokenizer *t, const char *w, size_t len, sbuf *out, bool *lead_kept)
{
    sbuf cur = {0};
    bool ok = sb_put(&cur, w, len);
    if (lead_kept)
        *lead_kept = true;
    for (int i = 0; ok && i < t->n_norm; i++) {
        const norm_step *st = &t->norm[i];
        sbuf next = {0};
        if (st->kind == N_UTF8PROC) {
            utf8proc_uint8_t *o = NULL;
            utf8proc_ssize_t r = utf8proc_map((const utf8proc_uint8_t *)cur.p, (utf8proc_ssize_t)cur.n, &o,
                                              (utf8proc_option_t)st->options);
            ok = r >= 0 && sb_put(&next, o, (size_t)r);
            free(o);
        } else if (st->kind == N_PREPEND) {  // not to an empty text
            ok = sb_put(&next, "", 0) && (cur.n == 0 || (sb_put(&next, st->a, strlen(st->a)) &&
                                                         sb_put(&next, cur.p, cur.n)));
        } else {  // N_REPLACE
            size_t la = strlen(st->a), lb = strlen(st->b), p = 0;
            ok = sb_put(&next, "", 0);
            const char *hit;
            while (ok && (hit = memmem(cur.p + p, cur.n - p, st->a, la)) != NULL) {
                ok = sb_put(&next, cur.p + p, (size_t)(hit - cur.p) - p) && sb_put(&next, st->b, lb);
                if (lead_kept && lb == 0 && next.n == 0)  // removed at the start
                    *lead_kept = false;
                p = (size_t)(hit - cur.p) + la;
            }
            ok = ok && sb_put(&next, cur.p + p, cur.n - p);
        }
        free(cur.p);
        cur = next;
    }
    *out = cur;
    return ok;
}

typedef lm_status (*gap_fn)(enc *e, const char *w, size_t len, size_t at);

// w cut at the added tokens of set a, at the first place where one starts the longest that does:
// each token's id, and each text between two to gap (with its offset in w).
static lm_status cut_added(enc *e, const added_set *a, const char *w, size_t len, gap_fn gap)
{
    lm_status s = LM_OK;
    size_t start = 0;
    for (size_t i = 0; s == LM_OK && i < len;) {
        if (!a->starts[(unsigned char)w[i]]) {
            i++;
            continue;
        }
        int best = -1;
        for (int k = 0; k < a->n; k++)
            if (a->tok[k].content[0] == w[i] && a->tok[k].len <= len - i &&
                memcmp(w + i, a->tok[k].content, a->tok[k].len) == 0 && (best < 0 || a->tok[k].len > a->tok[best].len))
                best = k;
        if (best < 0) {
            i++;
            continue;
        }
        if (i > start)
            s = gap(e, w + start, i - start, start);
        if (s == LM_OK && !emit(e, a->tok[best].id))
            s = nomem(e->err);
        i += a->tok[best].len;
        start = i;
    }
    if (s == LM_OK && start < len)
        s = gap(e, w + start, len - start, start);
    return s;
}

// A normalized text between two normalized added tokens: to the pre-tokenizer.
static lm_status normalized_gap(enc *e, const char *w, size_t len, size_t at)
{
    (void)at;
    return pieces(e, 0, w, len);
}

// The raw text between two added tokens (at byte `at` of the whole text): normalized, cut at the
// normalized added tokens, pre-tokenized and given to the model.
static lm_status raw_gap(enc *e, const char *w, size_t len, size_t at)
{
    sbuf cur = {0};
    bool lead_kept;
    if (!normalize(e->t, w, len, &cur, &lead_kept)) {
        free(cur.p);
        return nomem(e->err);
    }
    e->origin = at == 0 && lead_kept ? cur.p : NULL;
    lm_status s = cut_added(e, &e->t->normed, cur.p, cur.n, normalized_gap);
    free(cur.p);
    return s;
}

lm_status lm_tok_encode(const lm_tokenizer *t, lm_tok_cache *c, const char *text, size_t len, int special,
                        int32_t **ids, int64_t *n, int64_t *cap, lm_err *err)
{
    utf8proc_int32_t cp;
    for (size_t i = 0; i < len;) {
        utf8proc_ssize_t r = utf8proc_iterate((const utf8proc_uint8_t *)text + i, (utf8proc_ssize_t)(len - i), &cp);
        if (r <= 0)
            return lm_err_set(err, LM_ERR_FORMAT, "not valid UTF-8 at byte %zu", i);
        if (cp == 0)
            return lm_err_set(err, LM_ERR_FORMAT, "a NUL character at byte %zu, which llmerge does not tokenize", i);
        i += (size_t)r;
    }
    enc e = {.t = t, .c = c, .ids = ids, .n = n, .cap = cap, .err = err};
    lm_status s = LM_OK;
    for (int i = 0; special && i < t->n_before; i++)
        if (!emit(&e, t->before[i]))
            s = nomem(err);
    if (s == LM_OK)
        s = cut_added(&e, &t->raw, text, len, raw_gap);
    for (int i = 0; s == LM_OK && special && i < t->n_after; i++)
        if (!emit(&e, t->after[i]))
            s = nomem(err);
    free(e.key.p);
    return s;
}
