// llmerge.json, config.json and the side files of a merged model directory: see manifest.h.
//
// config.json is rewritten as text rather than re-printed from a parsed tree, so that every
// value the base wrote stays exactly as it was (10000.0 stays 10000.0, key order and spacing
// are kept) and only the dtype changes: transformers and other tools read these files, and a
// merge has no business reformatting them.
#include "manifest.h"

#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "json.h"
#include "util.h"

static lm_status nomem(lm_err *err) { return lm_err_set(err, LM_ERR_NOMEM, "out of memory"); }

static void hex64(char out[17], uint64_t v) { snprintf(out, 17, "%016" PRIx64, v); }

// ==== building the document ===================================================================

lm_status lm_manifest_init(lm_manifest *m, const char *method, lm_err *err)
{
    memset(m, 0, sizeof *m);
    m->root = cJSON_CreateObject();
    if (!m->root ||
        !cJSON_AddStringToObject(m->root, "llmerge_version", LLMERGE_VERSION) ||
        !cJSON_AddStringToObject(m->root, "method", method) ||
        !(m->options = cJSON_AddObjectToObject(m->root, "options")) ||
        !(m->base = cJSON_AddObjectToObject(m->root, "base")) ||
        !(m->inputs = cJSON_AddArrayToObject(m->root, "inputs")) ||
        !(m->outputs = cJSON_AddObjectToObject(m->root, "outputs")) ||
        !(m->devices = cJSON_AddObjectToObject(m->root, "devices")) ||
        !(m->timings = cJSON_AddObjectToObject(m->root, "timings")) ||
        !(m->stats = cJSON_AddObjectToObject(m->root, "stats"))) {
        lm_manifest_free(m);
        return nomem(err);
    }
    return LM_OK;
}

void lm_manifest_free(lm_manifest *m)
{
    if (!m)
        return;
    cJSON_Delete(m->root);
    memset(m, 0, sizeof *m);
}

static const char *user_dtype(lm_dtype dt)
{
    switch (dt) {
    case LM_DTYPE_F32: return "f32";
    case LM_DTYPE_F16: return "f16";
    case LM_DTYPE_BF16: return "bf16";
    default: return lm_dtype_name(dt);
    }
}

static cJSON *number_array(const double *v, int n)
{
    cJSON *a = cJSON_CreateArray();
    for (int i = 0; a && i < n; i++) {
        cJSON *x = cJSON_CreateNumber(v[i]);
        if (!x || !cJSON_AddItemToArray(a, x)) {
            cJSON_Delete(x);
            cJSON_Delete(a);
            return NULL;
        }
    }
    return a;
}

lm_status lm_manifest_merge_options(lm_manifest *m, const lm_merge_opts *o, lm_err *err)
{
    cJSON *opt = m->options;
    char seed[24];
    snprintf(seed, sizeof seed, "%" PRIu64, o->seed);
    cJSON *w = number_array(o->weights, o->weights ? o->n_ft : 0);
    cJSON *d = o->densities ? number_array(o->densities, o->n_ft) : cJSON_CreateNull();
    if (!w || !cJSON_AddItemToObject(opt, "weights", w)) {
        cJSON_Delete(w);
        cJSON_Delete(d);
        return nomem(err);
    }
    if (!d || !cJSON_AddItemToObject(opt, "densities", d)) {
        cJSON_Delete(d);
        return nomem(err);
    }
    bool ok = cJSON_AddNumberToObject(opt, "lambda", o->lambda) &&
              cJSON_AddBoolToObject(opt, "normalize", o->normalize) &&
              cJSON_AddStringToObject(opt, "sign", o->sign == LM_SIGN_COUNT ? "count" : "sum") &&
              cJSON_AddStringToObject(opt, "topk", o->topk_global ? "global" : "tensor") &&
              cJSON_AddStringToObject(opt, "rescale", lm_rescale_name(o->rescale)) &&
              cJSON_AddStringToObject(opt, "seed", seed) &&
              cJSON_AddStringToObject(opt, "dtype", user_dtype(o->out_dtype)) &&
              cJSON_AddNumberToObject(opt, "threads", o->threads);
    return ok ? LM_OK : nomem(err);
}

// Appends {"name", "bytes", "xxh64"} for the file at `path` to `files`: the hash from m's
// hasher when it has that file, else read whole here.
static lm_status add_file(const lm_manifest *m, cJSON *files, const char *name, const char *path, lm_err *err)
{
    struct stat st;
    if (stat(path, &st) != 0)
        return lm_err_set(err, LM_ERR_IO, "%s: %s", path, strerror(errno));
    uint64_t h;
    bool found = false;
    lm_status s = m->hasher ? lm_hasher_get(m->hasher, path, &h, &found, err) : LM_OK;
    if (s == LM_OK && !found)
        s = lm_xxh64_file(path, &h, err);
    if (s != LM_OK)
        return s;
    char hex[17];
    hex64(hex, h);
    cJSON *f = cJSON_CreateObject();
    if (!f || !cJSON_AddStringToObject(f, "name", name) ||
        !cJSON_AddNumberToObject(f, "bytes", (double)st.st_size) ||
        !cJSON_AddStringToObject(f, "xxh64", hex) || !cJSON_AddItemToArray(files, f)) {
        cJSON_Delete(f);
        return nomem(err);
    }
    return LM_OK;
}

// Fills `o` with "path" (absolute when it resolves), "kind" when not NULL, and "files".
static lm_status describe(const lm_manifest *m, cJSON *o, const char *dir, const char *kind,
                          const lm_model *model, const lm_adapter *adapter, lm_err *err)
{
    char abs[PATH_MAX];
    const char *path = realpath(dir, abs) ? abs : dir;
    if (!cJSON_AddStringToObject(o, "path", path) ||
        (kind && !cJSON_AddStringToObject(o, "kind", kind)))
        return nomem(err);
    cJSON *files = cJSON_AddArrayToObject(o, "files");
    if (!files)
        return nomem(err);
    lm_status s = LM_OK;
    if (model) {
        s = add_file(m, files, lm_path_base(model->config.path), model->config.path, err);
        if (s == LM_OK && model->index_path)
            s = add_file(m, files, lm_path_base(model->index_path), model->index_path, err);
        for (int i = 0; s == LM_OK && i < model->n_shards; i++)
            s = add_file(m, files, model->shards[i].file, model->shards[i].path, err);
    } else {
        s = add_file(m, files, lm_path_base(adapter->config.path), adapter->config.path, err);
        if (s == LM_OK)
            s = add_file(m, files, lm_path_base(adapter->weights_path), adapter->weights_path, err);
    }
    return s;
}

lm_status lm_manifest_set_base(lm_manifest *m, const lm_model *base, lm_err *err)
{
    return describe(m, m->base, base->dir, NULL, base, NULL, err);
}

lm_status lm_manifest_add_input(lm_manifest *m, const lm_model *model, const lm_adapter *adapter,
                                lm_err *err)
{
    if (!model == !adapter)
        return lm_err_set(err, LM_ERR_USAGE, "manifest: an input is a model or an adapter");
    cJSON *o = cJSON_CreateObject();
    if (!o || !cJSON_AddItemToArray(m->inputs, o)) {
        cJSON_Delete(o);
        return nomem(err);
    }
    return describe(m, o, model ? model->dir : adapter->dir, model ? "model" : "adapter", model,
                    adapter, err);
}

lm_status lm_manifest_set_outputs(lm_manifest *m, const char *dir, const lm_shard_plan *plan,
                                  const lm_st_desc *t, int64_t n, const uint64_t *xxh64,
                                  lm_err *err)
{
    cJSON *shards = cJSON_AddArrayToObject(m->outputs, "shards");
    if (!shards)
        return nomem(err);
    char name[64];
    for (int i = 0; i < plan->n_shards; i++) {
        lm_shard_name(name, sizeof name, i, plan->n_shards);
        int64_t count = 0;
        for (int64_t j = 0; j < plan->n_tensors; j++)
            count += plan->shard_of[j] == i;
        char *path = lm_path_join(dir, name);
        if (!path)
            return nomem(err);
        struct stat st;
        int rc = stat(path, &st), e = errno;
        if (rc != 0)
            lm_err_set(err, LM_ERR_IO, "%s: %s", path, strerror(e));
        free(path);
        if (rc != 0)
            return LM_ERR_IO;
        cJSON *o = cJSON_CreateObject();
        if (!o || !cJSON_AddStringToObject(o, "name", name) ||
            !cJSON_AddNumberToObject(o, "n_tensors", (double)count) ||
            !cJSON_AddNumberToObject(o, "data_bytes", (double)plan->shard_bytes[i]) ||
            !cJSON_AddNumberToObject(o, "bytes", (double)st.st_size) ||
            !cJSON_AddItemToArray(shards, o)) {
            cJSON_Delete(o);
            return nomem(err);
        }
    }
    cJSON *index = plan->n_shards > 1 ? cJSON_CreateString("model.safetensors.index.json")
                                      : cJSON_CreateNull();
    if (!index || !cJSON_AddItemToObject(m->outputs, "index", index)) {
        cJSON_Delete(index);
        return nomem(err);
    }
    if (!cJSON_AddNumberToObject(m->outputs, "total_size", (double)plan->total_size))
        return nomem(err);

    cJSON *tensors = cJSON_AddArrayToObject(m->outputs, "tensors");
    if (!tensors)
        return nomem(err);
    for (int64_t i = 0; i < n; i++) {
        char hex[17];
        hex64(hex, xxh64[i]);
        lm_shard_name(name, sizeof name, plan->shard_of[i], plan->n_shards);
        cJSON *o = cJSON_CreateObject();
        cJSON *shape = cJSON_CreateArray();
        for (int d = 0; shape && d < t[i].ndim; d++) {
            cJSON *x = cJSON_CreateNumber((double)t[i].shape[d]);
            if (!x || !cJSON_AddItemToArray(shape, x)) {
                cJSON_Delete(x);
                cJSON_Delete(shape);
                shape = NULL;
            }
        }
        if (!o || !shape || !cJSON_AddStringToObject(o, "name", t[i].name) ||
            !cJSON_AddStringToObject(o, "shard", name) ||
            !cJSON_AddStringToObject(o, "dtype", lm_dtype_name(t[i].dtype)) ||
            !cJSON_AddItemToObject(o, "shape", shape)) {
            cJSON_Delete(o);
            cJSON_Delete(shape);
            return nomem(err);
        }
        if (!cJSON_AddStringToObject(o, "xxh64", hex) || !cJSON_AddItemToArray(tensors, o)) {
            cJSON_Delete(o);
            return nomem(err);
        }
    }
    return LM_OK;
}

lm_status lm_manifest_add_device_units(lm_manifest *m, const char *device, int64_t units,
                                       lm_err *err)
{
    cJSON *have = cJSON_GetObjectItemCaseSensitive(m->devices, device);
    if (have) {
        cJSON_SetNumberValue(have, have->valuedouble + (double)units);
        return LM_OK;
    }
    return cJSON_AddNumberToObject(m->devices, device, (double)units) ? LM_OK : nomem(err);
}

// Sets key to the number v in object o, replacing what is there.
static bool set_number(cJSON *o, const char *key, double v)
{
    cJSON_DeleteItemFromObjectCaseSensitive(o, key);
    return cJSON_AddNumberToObject(o, key, v) != NULL;
}

lm_status lm_manifest_set_timings(lm_manifest *m, const lm_manifest_timings *t, lm_err *err)
{
    bool ok = set_number(m->timings, "load_s", t->load_s) &&
              set_number(m->timings, "merge_s", t->merge_s) &&
              set_number(m->timings, "write_s", t->write_s) &&
              set_number(m->timings, "hash_s", t->hash_s) &&
              set_number(m->timings, "total_s", t->total_s);
    return ok ? LM_OK : nomem(err);
}

lm_status lm_manifest_set_stats(lm_manifest *m, uint64_t bytes_in, uint64_t bytes_out,
                                int64_t tensors_merged, int64_t tensors_copied, lm_err *err)
{
    bool ok = set_number(m->stats, "bytes_in", (double)bytes_in) &&
              set_number(m->stats, "bytes_out", (double)bytes_out) &&
              set_number(m->stats, "tensors_merged", (double)tensors_merged) &&
              set_number(m->stats, "tensors_copied", (double)tensors_copied);
    return ok ? LM_OK : nomem(err);
}

// One "nonfinite" entry: the sums over the tensors of res->nonfinite from `input`, and those
// tensors. NULL when memory runs out.
static cJSON *nonfinite_of(const lm_merge_result *res, int input)
{
    uint64_t nan = 0, inf = 0;
    for (int64_t i = 0; i < res->n_nonfinite; i++)
        if (res->nonfinite[i].input == input) {
            nan += res->nonfinite[i].nan;
            inf += res->nonfinite[i].inf;
        }
    cJSON *o = cJSON_CreateObject(), *list = NULL;
    bool ok = o && cJSON_AddNumberToObject(o, "nan", (double)nan) && cJSON_AddNumberToObject(o, "inf", (double)inf) &&
              (list = cJSON_AddArrayToObject(o, "tensors"));
    for (int64_t i = 0; ok && i < res->n_nonfinite; i++) {
        const lm_merge_nonfinite *n = &res->nonfinite[i];
        if (n->input != input)
            continue;
        cJSON *t = cJSON_CreateObject();
        if (!t || !cJSON_AddItemToArray(list, t)) {
            cJSON_Delete(t);
            ok = false;
            break;
        }
        ok = cJSON_AddStringToObject(t, "name", n->tensor) && cJSON_AddNumberToObject(t, "nan", (double)n->nan) &&
             cJSON_AddNumberToObject(t, "inf", (double)n->inf);
    }
    if (!ok) {
        cJSON_Delete(o);
        return NULL;
    }
    return o;
}

lm_status lm_manifest_set_nonfinite(lm_manifest *m, const lm_merge_result *res, int n_ft, lm_err *err)
{
    cJSON *nf = cJSON_AddObjectToObject(m->root, "nonfinite"), *inputs = NULL;
    if (!nf || !cJSON_AddItemToObject(nf, "base", nonfinite_of(res, 0)) ||
        !(inputs = cJSON_AddArrayToObject(nf, "inputs")))
        return nomem(err);
    for (int i = 0; i < n_ft; i++)
        if (!cJSON_AddItemToArray(inputs, nonfinite_of(res, 1 + i)))
            return nomem(err);
    return cJSON_AddItemToObject(nf, "output", nonfinite_of(res, -1)) ? LM_OK : nomem(err);
}

// ==== printing ================================================================================

static void pb_indent(lm_buf *b, int depth)
{
    for (int i = 0; i < depth; i++)
        lm_buf_put(b, "  ", 2);
}

// A scalar or a string key as JSON text (cJSON does the number formatting and escaping).
static void pb_leaf(lm_buf *b, const cJSON *x)
{
    char *s = cJSON_PrintUnformatted(x);
    if (!s) {
        b->oom = true;
        return;
    }
    lm_buf_str(b, s);
    free(s);
}

static void pb_key(lm_buf *b, const char *key)
{
    cJSON *k = cJSON_CreateString(key);
    if (!k) {
        b->oom = true;
        return;
    }
    pb_leaf(b, k);
    cJSON_Delete(k);
    lm_buf_put(b, ": ", 2);
}

static bool is_container(const cJSON *x) { return cJSON_IsObject(x) || cJSON_IsArray(x); }

// Holds only scalars and arrays of scalars: may go on one line.
static bool is_flat(const cJSON *x)
{
    for (const cJSON *c = x->child; c; c = c->next) {
        if (cJSON_IsObject(c))
            return false;
        if (cJSON_IsArray(c))
            for (const cJSON *g = c->child; g; g = g->next)
                if (is_container(g))
                    return false;
    }
    return true;
}

static void print_inline(lm_buf *b, const cJSON *x)
{
    if (!is_container(x)) {
        pb_leaf(b, x);
        return;
    }
    bool obj = cJSON_IsObject(x);
    lm_buf_put(b, obj ? "{" : "[", 1);
    for (const cJSON *c = x->child; c; c = c->next) {
        if (obj)
            pb_key(b, c->string);
        print_inline(b, c);
        if (c->next)
            lm_buf_put(b, ", ", 2);
    }
    lm_buf_put(b, obj ? "}" : "]", 1);
}

#define LINE_MAX_CHARS 200

static void print_item(lm_buf *b, const cJSON *x, int depth)
{
    if (!is_container(x) || !x->child) {
        print_inline(b, x);
        return;
    }
    if (is_flat(x)) {
        size_t start = b->len;
        print_inline(b, x);
        if (b->oom || b->len - start + (size_t)depth * 2 <= LINE_MAX_CHARS)
            return;
        b->len = start;  // too long for one line: undo and spread it out
        b->p[start] = '\0';
    }
    bool obj = cJSON_IsObject(x);
    lm_buf_put(b, obj ? "{\n" : "[\n", 2);
    for (const cJSON *c = x->child; c; c = c->next) {
        pb_indent(b, depth + 1);
        if (obj)
            pb_key(b, c->string);
        print_item(b, c, depth + 1);
        lm_buf_put(b, c->next ? ",\n" : "\n", c->next ? 2 : 1);
    }
    pb_indent(b, depth);
    lm_buf_put(b, obj ? "}" : "]", 1);
}

char *lm_manifest_print_json(const cJSON *item)
{
    lm_buf b = {0};
    print_item(&b, item, 0);
    lm_buf_put(&b, "\n", 1);
    if (b.oom) {
        free(b.p);
        return NULL;
    }
    return b.p;
}

lm_status lm_manifest_write(const lm_manifest *m, const char *path, lm_err *err)
{
    char *text = lm_manifest_print_json(m->root);
    if (!text)
        return nomem(err);
    lm_status s = lm_write_file(path, text, strlen(text), err);
    free(text);
    return s;
}

// ==== config.json =============================================================================

const char *lm_manifest_torch_dtype(lm_dtype dt)
{
    switch (dt) {
    case LM_DTYPE_F32: return "float32";
    case LM_DTYPE_F16: return "float16";
    case LM_DTYPE_BF16: return "bfloat16";
    default: return NULL;
    }
}

// One member of the top-level object, as offsets into the text.
typedef struct json_member {
    size_t lead;          // just after the '{' or ',' before it (whitespace from here to key)
    size_t key, key_end;  // the key's quotes included
    size_t val, val_end;  // the value
} json_member;

static size_t skip_ws(const char *s, size_t i, size_t n)
{
    while (i < n && (s[i] == ' ' || s[i] == '\t' || s[i] == '\n' || s[i] == '\r'))
        i++;
    return i;
}

// s[i] is '"': returns the offset after the closing quote, or n when unterminated.
static size_t skip_string(const char *s, size_t i, size_t n)
{
    for (i++; i < n; i++) {
        if (s[i] == '\\')
            i++;
        else if (s[i] == '"')
            return i + 1;
    }
    return n + 1;
}

// Returns the offset just after the value starting at s[i], or n + 1 when it is malformed.
static size_t skip_value(const char *s, size_t i, size_t n)
{
    if (i >= n)
        return n + 1;
    if (s[i] == '"')
        return skip_string(s, i, n);
    if (s[i] == '{' || s[i] == '[') {
        int depth = 0;
        while (i < n) {
            char c = s[i];
            if (c == '"') {
                i = skip_string(s, i, n);
                continue;
            }
            if (c == '{' || c == '[')
                depth++;
            else if (c == '}' || c == ']')
                depth--;
            i++;
            if (depth == 0)
                return i;
        }
        return n + 1;
    }
    size_t start = i;
    while (i < n && !strchr(",}] \t\r\n", s[i]))
        i++;
    return i > start ? i : n + 1;
}

static bool key_is(const char *s, const json_member *m, const char *name)
{
    size_t len = m->key_end - m->key - 2;
    return len == strlen(name) && memcmp(s + m->key + 1, name, len) == 0;
}

// Compares the key of m (raw, without quotes) with name as strcmp does.
static int key_cmp(const char *s, const json_member *m, const char *name)
{
    size_t len = m->key_end - m->key - 2, nl = strlen(name);
    int c = memcmp(s + m->key + 1, name, len < nl ? len : nl);
    return c ? c : (len > nl) - (len < nl);
}

lm_status lm_manifest_write_config(const char *base_path, const char *out_path, lm_dtype dt,
                                   int64_t vocab_size, lm_err *err)
{
    const char *dname = lm_manifest_torch_dtype(dt);
    if (!dname)
        return lm_err_set(err, LM_ERR_USAGE, "config.json: a model is not saved in %s",
                          lm_dtype_name(dt));
    char *text = NULL;
    size_t n = 0;
    lm_status s = lm_read_file(base_path, 64u << 20, &text, &n, err);
    if (s != LM_OK)
        return s;
    // The splice below finds the members of text that is JSON: the one reader says so first
    // (opening the model read the same file with it already).
    cJSON *parsed = NULL;
    if ((s = lm_json_parse(&parsed, text, n, base_path, err)) != LM_OK) {
        free(text);
        return s;
    }
    cJSON_Delete(parsed);
    json_member *mem = NULL;
    size_t n_mem = 0, cap = 0;
    lm_buf out = {0};
    char value[32];
    snprintf(value, sizeof value, "\"%s\"", dname);

    // Find the members of the top-level object.
    size_t i = skip_ws(text, 0, n);
    size_t open = i;
    if (i >= n || text[i] != '{')
        goto malformed;
    i = skip_ws(text, i + 1, n);
    if (i < n && text[i] == '}') {
        i++;
    } else {
        size_t lead = open + 1;
        for (;;) {
            json_member m = {.lead = lead, .key = i};
            if (i >= n || text[i] != '"')
                goto malformed;
            m.key_end = skip_string(text, i, n);
            i = skip_ws(text, m.key_end, n);
            if (i >= n || text[i] != ':')
                goto malformed;
            m.val = skip_ws(text, i + 1, n);
            m.val_end = skip_value(text, m.val, n);
            if (m.val_end > n)
                goto malformed;
            if (n_mem == cap) {
                cap = cap ? cap * 2 : 32;
                json_member *grown = realloc(mem, cap * sizeof *mem);
                if (!grown) {
                    s = nomem(err);
                    goto done;
                }
                mem = grown;
            }
            mem[n_mem++] = m;
            i = skip_ws(text, m.val_end, n);
            if (i < n && text[i] == ',') {
                lead = i + 1;
                i = skip_ws(text, i + 1, n);
                continue;
            }
            if (i < n && text[i] == '}') {
                i++;
                break;
            }
            goto malformed;
        }
    }
    if (skip_ws(text, i, n) != n)
        goto malformed;

    // Replace the dtype values, or add torch_dtype where sorted order puts it.
    bool replaced = false;
    size_t copied = 0;
    for (size_t k = 0; k < n_mem; k++) {
        if (key_is(text, &mem[k], "torch_dtype") || key_is(text, &mem[k], "dtype")) {
            lm_buf_put(&out, text + copied, mem[k].val - copied);
            lm_buf_str(&out, value);
            copied = mem[k].val_end;
            replaced = true;
        } else if (vocab_size > 0 && key_is(text, &mem[k], "vocab_size")) {
            char v[32];
            snprintf(v, sizeof v, "%" PRId64, vocab_size);
            lm_buf_put(&out, text + copied, mem[k].val - copied);
            lm_buf_str(&out, v);
            copied = mem[k].val_end;
        }
    }
    if (!replaced) {
        char member[64];
        snprintf(member, sizeof member, "\"torch_dtype\": %s", value);
        size_t k = 0;
        while (k < n_mem && key_cmp(text, &mem[k], "torch_dtype") < 0)
            k++;
        if (n_mem == 0) {
            lm_buf_put(&out, text, open + 1);
            lm_buf_str(&out, member);
            copied = open + 1;
        } else if (k < n_mem) {
            // before member k, with the same whitespace in front of it
            lm_buf_put(&out, text, mem[k].key);
            lm_buf_str(&out, member);
            lm_buf_put(&out, ",", 1);
            lm_buf_put(&out, text + mem[k].lead, mem[k].key - mem[k].lead);
            copied = mem[k].key;
        } else {
            const json_member *last = &mem[n_mem - 1];
            lm_buf_put(&out, text, last->val_end);
            lm_buf_put(&out, ",", 1);
            lm_buf_put(&out, text + last->lead, last->key - last->lead);
            lm_buf_str(&out, member);
            copied = last->val_end;
        }
    }
    lm_buf_put(&out, text + copied, n - copied);
    if (out.oom) {
        s = nomem(err);
        goto done;
    }
    // The splice keeps the text valid JSON; check it all the same before writing.
    cJSON *check = NULL;
    lm_err cerr = {0};
    if ((s = lm_json_parse(&check, out.p, out.len, out_path, &cerr)) != LM_OK) {
        s = s == LM_ERR_NOMEM ? nomem(err)
                              : lm_err_set(err, s, "%s: the updated config is not valid JSON: %s", base_path, cerr.msg);
        goto done;
    }
    cJSON_Delete(check);
    s = lm_write_file(out_path, out.p, out.len, err);
    goto done;

malformed:
    s = lm_err_set(err, LM_ERR_FORMAT, "%s: not a JSON object", base_path);
done:
    free(out.p);
    free(mem);
    free(text);
    return s;
}

// ==== side files ==============================================================================

const char *const lm_manifest_side_files[] = {
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "generation_config.json",
    NULL,
};

lm_status lm_manifest_copy_side_files(const char *base_dir, const char *out_dir, int *n_copied,
                                      lm_err *err)
{
    int copied = 0;
    lm_status s = LM_OK;
    for (int i = 0; s == LM_OK && lm_manifest_side_files[i]; i++) {
        char *src = lm_path_join(base_dir, lm_manifest_side_files[i]);
        char *dst = lm_path_join(out_dir, lm_manifest_side_files[i]);
        if (!src || !dst)
            s = nomem(err);
        else if (lm_is_file(src) && (s = lm_copy_file(src, dst, err)) == LM_OK)
            copied++;
        free(src);
        free(dst);
    }
    if (n_copied)
        *n_copied = copied;
    return s;
}
