// A tokenizer's vocabulary from tokenizer.json: see vocab.h.
#include "vocab.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"
#include "json.h"
#include "util.h"

#define MAX_FILE ((size_t)1 << 30)  // tokenizer.json files run to tens of MB

// An id as the file writes it: a whole number in [0, LM_VOCAB_MAX_IDS), else -1.
static int64_t id_of(const cJSON *v)
{
    if (!cJSON_IsNumber(v))
        return -1;
    double d = v->valuedouble;
    if (!(d >= 0 && d < (double)LM_VOCAB_MAX_IDS) || floor(d) != d)
        return -1;
    return (int64_t)d;
}

// The value as the file writes it, for messages.
static const char *shown(const cJSON *v)
{
    const char *t = lm_json_number_text(v);
    return t ? t : lm_json_kind(v);
}

// Where the vocabulary is listed: its (token, id) pairs in order, as model.vocab holds them.
typedef struct entry {
    const char *token;
    int64_t id;
} entry;

// model.vocab's pairs into *out (n of them).
static lm_status read_model_vocab(const cJSON *vocab, const char *label, entry **out, int64_t *n, lm_err *err)
{
    *out = NULL;
    *n = 0;
    int64_t count = cJSON_GetArraySize(vocab);
    entry *e = malloc((size_t)(count > 0 ? count : 1) * sizeof *e);
    if (!e)
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory reading %s", label);
    int64_t i = 0;
    const cJSON *c;
    cJSON_ArrayForEach(c, vocab)
    {
        if (cJSON_IsObject(vocab)) {  // "token": id
            e[i].token = c->string;
            e[i].id = id_of(c);
            if (e[i].id < 0) {
                lm_status s = lm_err_set(err, LM_ERR_FORMAT, "%s: model.vocab: token '%s' has id %s, not a token id",
                                         label, c->string, shown(c));
                free(e);
                return s;
            }
        } else {  // [token, score]: the position is the id
            const cJSON *tok = cJSON_GetArrayItem(c, 0);
            if (!cJSON_IsArray(c) || cJSON_GetArraySize(c) != 2 || !cJSON_IsString(tok) ||
                !cJSON_IsNumber(cJSON_GetArrayItem(c, 1))) {
                free(e);
                return lm_err_set(err, LM_ERR_FORMAT, "%s: model.vocab[%lld] is %s, not a [token, score] pair", label,
                                  (long long)i, lm_json_kind(c));
            }
            if (i >= LM_VOCAB_MAX_IDS) {
                free(e);
                return lm_err_set(err, LM_ERR_FORMAT, "%s: model.vocab holds more than %lld tokens", label,
                                  (long long)LM_VOCAB_MAX_IDS);
            }
            e[i].token = tok->valuestring;
            e[i].id = i;
        }
        i++;
    }
    *out = e;
    *n = i;
    return LM_OK;
}

lm_status lm_vocab_parse(lm_vocab **out, const char *text, size_t len, const char *label, lm_err *err)
{
    *out = NULL;
    lm_vocab *v = calloc(1, sizeof *v);
    entry *model = NULL;
    int64_t *slot = NULL;
    lm_strmap by_token = {0};
    lm_status s = v ? lm_json_parse(&v->tree, text, len, label, err)
                    : lm_err_set(err, LM_ERR_NOMEM, "out of memory reading %s", label);
    if (s != LM_OK)
        goto done;
    const cJSON *m = cJSON_GetObjectItemCaseSensitive(v->tree, "model");
    const cJSON *vocab = cJSON_IsObject(m) ? cJSON_GetObjectItemCaseSensitive(m, "vocab") : NULL;
    const cJSON *added = cJSON_GetObjectItemCaseSensitive(v->tree, "added_tokens");
    if (!cJSON_IsObject(v->tree) || !cJSON_IsObject(m)) {
        s = lm_err_set(err, LM_ERR_FORMAT, "%s: no model object: not a tokenizer.json", label);
        goto done;
    }
    if (!cJSON_IsObject(vocab) && !cJSON_IsArray(vocab)) {
        s = lm_err_set(err, LM_ERR_FORMAT, "%s: model.vocab is %s, not an object of token ids or a list of "
                       "[token, score] pairs", label, vocab ? lm_json_kind(vocab) : "missing");
        goto done;
    }
    if (added && !cJSON_IsArray(added) && !cJSON_IsNull(added)) {
        s = lm_err_set(err, LM_ERR_FORMAT, "%s: added_tokens is %s, not a list", label, lm_json_kind(added));
        goto done;
    }
    int64_t n_model = 0;
    if ((s = read_model_vocab(vocab, label, &model, &n_model, err)) != LM_OK)
        goto done;
    // The added tokens, checked; each token's id lives in slot[] (the map gives the slot).
    int64_t n_added = 0;
    const cJSON *a;
    cJSON_ArrayForEach(a, added)
    {
        const cJSON *content = cJSON_GetObjectItemCaseSensitive(a, "content");
        const cJSON *id = cJSON_GetObjectItemCaseSensitive(a, "id");
        if (!cJSON_IsObject(a) || !cJSON_IsString(content) || id_of(id) < 0) {
            s = lm_err_set(err, LM_ERR_FORMAT, "%s: added_tokens[%lld]: %s", label, (long long)n_added,
                           !cJSON_IsObject(a)      ? "not an object"
                           : !cJSON_IsString(content) ? "no content string"
                           : id                    ? "its id is not a token id"
                                                   : "no id");
            goto done;
        }
        n_added++;
    }
    slot = malloc((size_t)(n_model + n_added + 1) * sizeof *slot);
    if (!slot || lm_strmap_init(&by_token, (size_t)(n_model + n_added)) != LM_OK) {
        s = lm_err_set(err, LM_ERR_NOMEM, "out of memory reading %s", label);
        goto done;
    }
    // The model's tokens: a piece a Unigram list holds twice keeps its later position, as the
    // tokenizers library's map from tokens to ids does (BPE's object has each token once: the
    // reader refuses a key twice).
    int64_t n_slots = 0, n_ids = 0;
    for (int64_t i = 0; i < n_model; i++) {
        int64_t k = lm_strmap_get(&by_token, model[i].token);
        if (k < 0) {
            k = n_slots++;
            if (lm_strmap_put(&by_token, model[i].token, k) < 0) {
                s = lm_err_set(err, LM_ERR_NOMEM, "out of memory reading %s", label);
                goto done;
            }
        }
        slot[k] = model[i].id;
    }
    // The added tokens, as the tokenizers library adds them when it loads the file (the ids the
    // file gives them are not read there): one the model holds keeps the model's id; a new one
    // gets the next id after the model's vocabulary (its size: the entries it lists) and the
    // added tokens so far; the same token again keeps its first id.
    int64_t max_added = -1;
    cJSON_ArrayForEach(a, added)
    {
        const char *t = cJSON_GetObjectItemCaseSensitive(a, "content")->valuestring;
        if (!t[0])
            continue;  // the tokenizers library skips an empty token
        int64_t k = lm_strmap_get(&by_token, t);
        if (k < 0) {
            k = n_slots++;
            if (lm_strmap_put(&by_token, t, k) < 0) {
                s = lm_err_set(err, LM_ERR_NOMEM, "out of memory reading %s", label);
                goto done;
            }
            slot[k] = max_added >= n_model || (max_added >= 0 && n_model == 0) ? max_added + 1 : n_model;
            if (slot[k] >= LM_VOCAB_MAX_IDS) {
                s = lm_err_set(err, LM_ERR_FORMAT, "%s: added token '%s' would have id %lld, beyond %lld", label, t,
                               (long long)slot[k], (long long)LM_VOCAB_MAX_IDS);
                goto done;
            }
        }
        max_added = slot[k] > max_added ? slot[k] : max_added;
    }
    for (int64_t k = 0; k < n_slots; k++)
        n_ids = slot[k] + 1 > n_ids ? slot[k] + 1 : n_ids;
    v->n_ids = n_ids;
    v->token = calloc((size_t)(n_ids > 0 ? n_ids : 1), sizeof *v->token);
    if (!v->token) {
        s = lm_err_set(err, LM_ERR_NOMEM, "out of memory reading %s", label);
        goto done;
    }
    // each token at its id (the map's keys are the tokens, in the tree)
    for (size_t c = 0; c < by_token.cap; c++) {
        const char *t = by_token.keys[c];
        if (!t)
            continue;
        int64_t id = slot[by_token.vals[c]];
        if (v->token[id]) {
            const char *x = strcmp(v->token[id], t) < 0 ? v->token[id] : t, *y = x == t ? v->token[id] : t;
            s = lm_err_set(err, LM_ERR_FORMAT, "%s: '%s' and '%s' both have id %lld", label, x, y, (long long)id);
            goto done;
        }
        v->token[id] = t;
        v->n_tokens++;
    }
done:
    free(model);
    free(slot);
    lm_strmap_free(&by_token);
    if (s != LM_OK) {
        lm_vocab_free(v);
        return s;
    }
    *out = v;
    return LM_OK;
}

lm_status lm_vocab_load(lm_vocab **out, const char *path, lm_err *err)
{
    *out = NULL;
    if (!lm_is_file(path))
        return lm_err_set(err, LM_ERR_NOT_FOUND, "%s: no such file", path);
    char *text = NULL;
    size_t len = 0;
    lm_status s = lm_read_file(path, MAX_FILE, &text, &len, err);
    if (s == LM_OK)
        s = lm_vocab_parse(out, text, len, path, err);
    free(text);
    return s;
}

lm_status lm_vocab_load_dir(lm_vocab **out, const char *dir, bool strip, int64_t *rows, lm_err *err)
{
    int64_t n = 0;
    *out = NULL;
    char *tj = lm_path_join(dir, "tokenizer.json"), *cj = lm_path_join(dir, "config.json");
    lm_config c = {0};
    lm_status s = tj && cj ? lm_config_load(&c, cj, err) : lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    if (s == LM_OK) {
        n = c.vocab_size > 0 ? c.vocab_size : 0;
        if (lm_is_file(tj) && (s = lm_vocab_load(out, tj, err)) == LM_OK) {
            if (n == 0)
                n = (*out)->n_ids;
            if (strip)
                lm_vocab_strip(*out, n);
        }
    }
    if (rows)
        *rows = n;
    lm_config_free(&c);
    free(tj);
    free(cj);
    return s;
}

void lm_vocab_free(lm_vocab *v)
{
    if (!v)
        return;
    free(v->token);
    cJSON_Delete(v->tree);
    free(v);
}

void lm_vocab_strip(lm_vocab *v, int64_t n)
{
    for (int64_t id = n < 0 ? 0 : n; id < v->n_ids; id++)
        v->n_tokens -= v->token[id] != NULL;
    while (v->n_ids > 0 && (v->n_ids > n || !v->token[v->n_ids - 1]))
        v->n_ids--;
}

const char *lm_vocab_token(const lm_vocab *v, int64_t id)
{
    return v && id >= 0 && id < v->n_ids ? v->token[id] : NULL;
}

int64_t lm_vocab_first_difference(const lm_vocab *a, const lm_vocab *b, int64_t limit)
{
    for (int64_t id = 0; id < limit; id++) {
        const char *x = lm_vocab_token(a, id), *y = lm_vocab_token(b, id);
        if ((x == NULL) != (y == NULL) || (x && strcmp(x, y) != 0))
            return id;
    }
    return -1;
}
