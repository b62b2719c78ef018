// `llmerge inspect`: what a safetensors file, a model directory or a LoRA adapter directory
// holds. The kind of PATH is detected from its files (lm_input_detect, nested layout
// included). A file shows its tensors, metadata and totals; a model its architecture,
// dimensions, rope, parameter count, dtypes, shards, the check against its architecture, and
// its tensors; an adapter its configuration and every module with r, alpha, scale and the base
// tensor it changes. With --base DIR an adapter is validated against that base model (a full
// model is compared with it tensor by tensor). --json prints the same as one JSON object on
// one line. Exit status: 0 fine; 2 bad usage or a broken, mismatched or unsupported input (the
// report is still printed when the input could be read, then the message on stderr); 1 other
// failures.
#include <cJSON.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "adapter.h"
#include "cmd.h"
#include "config.h"
#include "model.h"
#include "safetensors.h"
#include "status.h"
#include "util.h"

static void usage(FILE *out)
{
    fprintf(out,
            "Usage: llmerge inspect PATH [--base DIR] [--json]\n"
            "\n"
            "Shows what PATH holds: a .safetensors file (tensors, metadata, totals), a model\n"
            "directory (config.json with model.safetensors or model.safetensors.index.json:\n"
            "architecture, dimensions, parameters, dtypes, shards, tensors, and a check against\n"
            "the architecture) or a PEFT LoRA adapter directory (adapter_config.json with\n"
            "adapter_model.safetensors: configuration and every module with its r, alpha, scale\n"
            "and base tensor). A directory holding exactly one such subdirectory also works.\n"
            "\n"
            "Options:\n"
            "  --base DIR   validate an adapter against the base model DIR (every base tensor\n"
            "               present, every shape fitting); compare a full model with DIR\n"
            "  --json       print one JSON object instead of text\n"
            "  -h, --help   this help\n"
            "\n"
            "Exit status: 0 fine, 1 the inspection failed, 2 bad usage or a broken, mismatched\n"
            "or unsupported input.\n");
}

// Prints "llmerge inspect: MESSAGE" and returns the exit status for `s`.
static int fail(lm_status s, const lm_err *err)
{
    fprintf(stderr, "llmerge inspect: %s\n", err->msg);
    return lm_status_exit_code(s);
}

// ==== shared pieces ===========================================================================

static cJSON *json_shape(const int64_t *shape, int ndim)
{
    cJSON *a = cJSON_CreateArray();
    for (int d = 0; a && d < ndim; d++)
        cJSON_AddItemToArray(a, cJSON_CreateNumber((double)shape[d]));
    return a;
}

static cJSON *json_tensor(const lm_st_tensor *t)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "name", t->name);
    cJSON_AddStringToObject(o, "dtype", lm_dtype_name(t->dtype));
    cJSON_AddItemToObject(o, "shape", json_shape(t->shape, t->ndim));
    cJSON_AddNumberToObject(o, "bytes", (double)t->nbytes);
    return o;
}

static cJSON *json_dtype_counts(const int64_t counts[LM_DTYPE_COUNT])
{
    cJSON *o = cJSON_CreateObject();
    for (int d = 0; d < LM_DTYPE_COUNT; d++)
        if (counts[d])
            cJSON_AddNumberToObject(o, lm_dtype_name((lm_dtype)d), (double)counts[d]);
    return o;
}

static void print_dtype_counts(const int64_t counts[LM_DTYPE_COUNT])
{
    printf("dtypes:");
    const char *sep = " ";
    for (int d = 0; d < LM_DTYPE_COUNT; d++) {
        if (counts[d]) {
            printf("%s%s x%" PRId64, sep, lm_dtype_name((lm_dtype)d), counts[d]);
            sep = ", ";
        }
    }
    printf("\n");
}

// "1.24 B", "135 M", "12.3 K", or the plain count below a thousand.
static char *format_count(char *buf, size_t cap, int64_t n)
{
    if (n >= 1000000000)
        snprintf(buf, cap, "%.2f B", (double)n / 1e9);
    else if (n >= 1000000)
        snprintf(buf, cap, "%.1f M", (double)n / 1e6);
    else if (n >= 1000)
        snprintf(buf, cap, "%.1f K", (double)n / 1e3);
    else
        snprintf(buf, cap, "%" PRId64, n);
    return buf;
}

// Prints the tensor table; `shard_of` (may be NULL) gives a shard name per tensor.
static void print_tensor_table(const lm_st_tensor *const *ts, int64_t n,
                               const char *(*shard_of)(const void *ctx, int64_t i), const void *ctx)
{
    int wn = 4, ws = 5;
    char shape[256];
    for (int64_t i = 0; i < n; i++) {
        int l = (int)strlen(ts[i]->name);
        if (l > wn)
            wn = l;
        l = (int)strlen(lm_st_shape_str(ts[i]->shape, ts[i]->ndim, shape, sizeof shape));
        if (l > ws)
            ws = l;
    }
    printf("  %-*s  %-11s  %-*s  %12s%s\n", wn, "NAME", "DTYPE", ws, "SHAPE", "BYTES",
           shard_of ? "  SHARD" : "");
    for (int64_t i = 0; i < n; i++) {
        lm_st_shape_str(ts[i]->shape, ts[i]->ndim, shape, sizeof shape);
        printf("  %-*s  %-11s  %-*s  %12" PRIu64 "%s%s\n", wn, ts[i]->name,
               lm_dtype_name(ts[i]->dtype), ws, shape, ts[i]->nbytes, shard_of ? "  " : "",
               shard_of ? shard_of(ctx, i) : "");
    }
}

static int emit_json(cJSON *root)
{
    char *s = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    if (!s) {
        fprintf(stderr, "llmerge inspect: out of memory printing JSON\n");
        return 1;
    }
    printf("%s\n", s);
    free(s);
    return 0;
}

// ==== a safetensors file ======================================================================

static int inspect_file(const char *path, bool json)
{
    lm_st_file *f = NULL;
    lm_err err = {0};
    lm_status s = lm_st_open(&f, path, &err);
    if (s != LM_OK)
        return fail(s, &err);

    int64_t counts[LM_DTYPE_COUNT] = {0}, params = 0;
    uint64_t bytes = 0;
    for (int64_t i = 0; i < f->n_tensors; i++) {
        counts[f->tensors[i].dtype]++;
        params += f->tensors[i].numel;
        bytes += f->tensors[i].nbytes;
    }
    int rc = 0;
    if (json) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "kind", "safetensors");
        cJSON_AddStringToObject(o, "path", path);
        cJSON_AddNumberToObject(o, "size", (double)f->size);
        cJSON_AddNumberToObject(o, "header_bytes", (double)f->header_len);
        cJSON *meta = cJSON_AddObjectToObject(o, "metadata");
        for (int64_t i = 0; i < f->n_meta; i++)
            cJSON_AddStringToObject(meta, f->meta_keys[i], f->meta_vals[i]);
        cJSON_AddNumberToObject(o, "n_tensors", (double)f->n_tensors);
        cJSON_AddNumberToObject(o, "n_params", (double)params);
        cJSON_AddNumberToObject(o, "n_bytes", (double)bytes);
        cJSON_AddItemToObject(o, "dtypes", json_dtype_counts(counts));
        cJSON *arr = cJSON_AddArrayToObject(o, "tensors");
        for (int64_t i = 0; i < f->n_tensors; i++) {
            cJSON *t = json_tensor(&f->tensors[i]);
            cJSON *off = cJSON_CreateArray();
            cJSON_AddItemToArray(off, cJSON_CreateNumber((double)f->tensors[i].begin));
            cJSON_AddItemToArray(off, cJSON_CreateNumber((double)f->tensors[i].end));
            cJSON_AddItemToObject(t, "offsets", off);
            cJSON_AddItemToArray(arr, t);
        }
        rc = emit_json(o);
    } else {
        char b1[32], b2[32];
        printf("safetensors file: %s\n", path);
        printf("size: %" PRIu64 " bytes (%s), header %" PRIu64 " bytes\n", f->size,
               lm_format_bytes(b1, sizeof b1, f->size), f->header_len);
        if (f->n_meta) {
            printf("metadata:\n");
            for (int64_t i = 0; i < f->n_meta; i++)
                printf("  %s: %s\n", f->meta_keys[i], f->meta_vals[i]);
        }
        printf("tensors: %" PRId64 "\n", f->n_tensors);
        const lm_st_tensor **ts = malloc(sizeof *ts * (size_t)(f->n_tensors + 1));
        if (!ts) {
            lm_st_close(f);
            fprintf(stderr, "llmerge inspect: out of memory\n");
            return 1;
        }
        for (int64_t i = 0; i < f->n_tensors; i++)
            ts[i] = &f->tensors[i];
        print_tensor_table(ts, f->n_tensors, NULL, NULL);
        free(ts);
        printf("total: %" PRId64 " tensors, %" PRId64 " parameters (%s), %" PRIu64 " bytes (%s)\n",
               f->n_tensors, params, format_count(b2, sizeof b2, params), bytes,
               lm_format_bytes(b1, sizeof b1, bytes));
        print_dtype_counts(counts);
    }
    lm_st_close(f);
    return rc;
}

// ==== a model directory =======================================================================

static const char *model_shard_of(const void *ctx, int64_t i)
{
    const lm_model *m = ctx;
    return m->shards[m->tensor_shard[i]].file;
}

static const char *yes_no(bool b) { return b ? "yes" : "no"; }

static void biases_text(const lm_config *c, char *buf, size_t cap)
{
    const struct { bool on; const char *name; } b[] = {
        {c->q_bias, "q"}, {c->k_bias, "k"}, {c->v_bias, "v"}, {c->o_bias, "o"},
        {c->gate_bias, "gate"}, {c->up_bias, "up"}, {c->down_bias, "down"},
    };
    size_t n = 0;
    buf[0] = '\0';
    for (size_t i = 0; i < sizeof b / sizeof b[0]; i++)
        if (b[i].on)
            n += (size_t)snprintf(buf + n, cap - n, "%s%s", n ? " " : "", b[i].name);
    if (!n)
        snprintf(buf, cap, "none");
}

static cJSON *json_config(const lm_config *c)
{
    cJSON *o = cJSON_CreateObject();
    if (c->architecture)
        cJSON_AddStringToObject(o, "architecture", c->architecture);
    else
        cJSON_AddNullToObject(o, "architecture");
    if (c->model_type)
        cJSON_AddStringToObject(o, "model_type", c->model_type);
    else
        cJSON_AddNullToObject(o, "model_type");
    cJSON_AddBoolToObject(o, "known_architecture", c->arch != LM_ARCH_UNKNOWN);
    if (c->dtype_name)
        cJSON_AddStringToObject(o, "dtype", c->dtype_name);
    else
        cJSON_AddNullToObject(o, "dtype");
    cJSON_AddNumberToObject(o, "hidden_size", (double)c->hidden_size);
    cJSON_AddNumberToObject(o, "intermediate_size", (double)c->intermediate_size);
    cJSON_AddNumberToObject(o, "num_hidden_layers", (double)c->num_hidden_layers);
    cJSON_AddNumberToObject(o, "num_attention_heads", (double)c->num_attention_heads);
    cJSON_AddNumberToObject(o, "num_key_value_heads", (double)c->num_key_value_heads);
    cJSON_AddNumberToObject(o, "head_dim", (double)c->head_dim);
    cJSON_AddNumberToObject(o, "vocab_size", (double)c->vocab_size);
    cJSON_AddNumberToObject(o, "max_position_embeddings", (double)c->max_position_embeddings);
    cJSON_AddNumberToObject(o, "rms_norm_eps", c->rms_norm_eps);
    cJSON_AddBoolToObject(o, "tie_word_embeddings", c->tie_word_embeddings);
    cJSON_AddBoolToObject(o, "attention_bias", c->attention_bias);
    cJSON_AddBoolToObject(o, "mlp_bias", c->mlp_bias);
    cJSON *b = cJSON_AddObjectToObject(o, "biases");
    cJSON_AddBoolToObject(b, "q_proj", c->q_bias);
    cJSON_AddBoolToObject(b, "k_proj", c->k_bias);
    cJSON_AddBoolToObject(b, "v_proj", c->v_bias);
    cJSON_AddBoolToObject(b, "o_proj", c->o_bias);
    cJSON_AddBoolToObject(b, "gate_proj", c->gate_bias);
    cJSON_AddBoolToObject(b, "up_proj", c->up_bias);
    cJSON_AddBoolToObject(b, "down_proj", c->down_bias);
    cJSON *r = cJSON_AddObjectToObject(o, "rope");
    cJSON_AddNumberToObject(r, "theta", c->rope_theta);
    const lm_rope_scaling *rs = &c->rope_scaling;
    if (rs->type)
        cJSON_AddStringToObject(r, "type", rs->type);
    else
        cJSON_AddNullToObject(r, "type");
    if (rs->factor > 0)
        cJSON_AddNumberToObject(r, "factor", rs->factor);
    if (rs->kind == LM_ROPE_LLAMA3) {
        cJSON_AddNumberToObject(r, "low_freq_factor", rs->low_freq_factor);
        cJSON_AddNumberToObject(r, "high_freq_factor", rs->high_freq_factor);
        cJSON_AddNumberToObject(r, "original_max_position_embeddings",
                                (double)rs->original_max_position_embeddings);
    }
    return o;
}

static void print_config(const lm_config *c)
{
    char buf[128];
    printf("architecture: %s", c->architecture ? c->architecture : "(not given)");
    if (c->model_type)
        printf(" (model_type %s)", c->model_type);
    printf("%s\n", c->arch == LM_ARCH_UNKNOWN ? " [not a known architecture: tensors only]" : "");
    printf("dtype: %s\n", c->dtype_name ? c->dtype_name : "(not given)");
    printf("dims: hidden %" PRId64 ", intermediate %" PRId64 ", layers %" PRId64 ", heads %" PRId64
           ", kv heads %" PRId64 ", head_dim %" PRId64 "%s, vocab %" PRId64 "\n",
           c->hidden_size, c->intermediate_size, c->num_hidden_layers, c->num_attention_heads,
           c->num_key_value_heads, c->head_dim, c->head_dim_given ? " (given)" : "", c->vocab_size);
    printf("max_position_embeddings: %" PRId64 ", rms_norm_eps: %g\n", c->max_position_embeddings,
           c->rms_norm_eps);
    printf("tied embeddings: %s\n", yes_no(c->tie_word_embeddings));
    biases_text(c, buf, sizeof buf);
    printf("biases: %s\n", buf);
    const lm_rope_scaling *rs = &c->rope_scaling;
    printf("rope: theta %g", c->rope_theta);
    if (rs->kind == LM_ROPE_LLAMA3)
        printf(", scaling llama3 (factor %g, low_freq_factor %g, high_freq_factor %g, "
               "original_max_position_embeddings %" PRId64 ")", rs->factor, rs->low_freq_factor,
               rs->high_freq_factor, rs->original_max_position_embeddings);
    else if (rs->type && rs->kind != LM_ROPE_DEFAULT)
        printf(", scaling %s (factor %g)", rs->type, rs->factor);
    printf("\n");
}

static int inspect_model(const char *path, const char *base_dir, bool json)
{
    lm_model *m = NULL, *base = NULL;
    lm_err err = {0}, check_err = {0}, base_err = {0};
    lm_status s = lm_model_open(&m, path, &err);
    if (s != LM_OK)
        return fail(s, &err);
    if (base_dir && (s = lm_model_open(&base, base_dir, &err)) != LM_OK) {
        lm_model_free(m);
        lm_err_prefix(&err, "--base");
        return fail(s, &err);
    }

    int64_t extra = 0, base_extra = 0;
    lm_status cs = m->config.arch == LM_ARCH_UNKNOWN ? LM_ERR_UNSUPPORTED
                                                     : lm_model_check(m, &extra, &check_err);
    lm_status bs = base ? lm_model_compare(m, base, &base_extra, &base_err) : LM_OK;
    int64_t counts[LM_DTYPE_COUNT];
    lm_model_dtype_counts(m, counts);
    int64_t params = lm_model_param_count(m);
    uint64_t bytes = lm_model_nbytes(m);

    int rc = 0;
    if (json) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "kind", "model");
        cJSON_AddStringToObject(o, "path", path);
        cJSON_AddItemToObject(o, "config", json_config(&m->config));
        cJSON_AddNumberToObject(o, "n_params", (double)params);
        cJSON_AddNumberToObject(o, "n_bytes", (double)bytes);
        cJSON_AddNumberToObject(o, "n_tensors", (double)m->n_tensors);
        cJSON_AddItemToObject(o, "dtypes", json_dtype_counts(counts));
        cJSON *sh = cJSON_AddArrayToObject(o, "shards");
        for (int i = 0; i < m->n_shards; i++) {
            cJSON *e = cJSON_CreateObject();
            cJSON_AddStringToObject(e, "file", m->shards[i].file);
            cJSON_AddNumberToObject(e, "n_tensors", (double)m->shards[i].n_tensors);
            cJSON_AddNumberToObject(e, "bytes", (double)m->shards[i].nbytes);
            cJSON_AddItemToArray(sh, e);
        }
        cJSON *ck = cJSON_AddObjectToObject(o, "check");
        if (m->config.arch == LM_ARCH_UNKNOWN) {
            cJSON_AddStringToObject(ck, "status", "skipped");
        } else {
            cJSON_AddStringToObject(ck, "status", cs == LM_OK ? "ok" : "failed");
            if (cs != LM_OK)
                cJSON_AddStringToObject(ck, "message", check_err.msg);
            cJSON_AddNumberToObject(ck, "n_extra", (double)extra);
        }
        if (base) {
            cJSON *b = cJSON_AddObjectToObject(o, "base");
            cJSON_AddStringToObject(b, "path", base_dir);
            cJSON_AddStringToObject(b, "status", bs == LM_OK ? "ok" : "failed");
            if (bs != LM_OK)
                cJSON_AddStringToObject(b, "message", base_err.msg);
            cJSON_AddNumberToObject(b, "n_extra", (double)base_extra);
        }
        cJSON *arr = cJSON_AddArrayToObject(o, "tensors");
        for (int64_t i = 0; i < m->n_tensors; i++) {
            cJSON *t = json_tensor(m->tensors[i]);
            cJSON_AddStringToObject(t, "shard", m->shards[m->tensor_shard[i]].file);
            cJSON_AddItemToArray(arr, t);
        }
        rc = emit_json(o);
    } else {
        char b1[32], b2[32];
        printf("model directory: %s\n", path);
        print_config(&m->config);
        printf("parameters: %" PRId64 " (%s) in %" PRId64 " tensors, %" PRIu64 " bytes (%s)\n",
               params, format_count(b2, sizeof b2, params), m->n_tensors, bytes,
               lm_format_bytes(b1, sizeof b1, bytes));
        print_dtype_counts(counts);
        printf("shards: %d%s\n", m->n_shards, m->index_path ? " (model.safetensors.index.json)" : "");
        for (int i = 0; i < m->n_shards; i++)
            printf("  %s  %" PRId64 " tensors  %s\n", m->shards[i].file, m->shards[i].n_tensors,
                   lm_format_bytes(b1, sizeof b1, m->shards[i].nbytes));
        if (m->config.arch == LM_ARCH_UNKNOWN)
            printf("check: skipped (not a known architecture)\n");
        else if (cs == LM_OK)
            printf("check: ok, every tensor of %s present with its shape%s\n",
                   lm_arch_name(m->config.arch), extra ? "" : ", none extra");
        else
            printf("check: FAILED: %s\n", check_err.msg);
        if (m->config.arch != LM_ARCH_UNKNOWN && extra)
            printf("  (%" PRId64 " tensors the architecture does not list)\n", extra);
        if (base) {
            if (bs == LM_OK)
                printf("base %s: ok, every base tensor present with its shape (%" PRId64 " extra)\n",
                       base_dir, base_extra);
            else
                printf("base %s: FAILED: %s\n", base_dir, base_err.msg);
        }
        printf("tensors:\n");
        print_tensor_table(m->tensors, m->n_tensors, model_shard_of, m);
    }
    if (rc == 0 && cs != LM_OK && cs != LM_ERR_UNSUPPORTED)
        rc = fail(cs, &check_err);
    if (rc == 0 && bs != LM_OK)
        rc = fail(bs, &base_err);
    lm_model_free(base);
    lm_model_free(m);
    return rc;
}

// ==== an adapter directory ====================================================================

static const char *kind_name(lm_lora_kind k) { return k == LM_LORA_EMBEDDING ? "embedding" : "linear"; }

static cJSON *json_factor(const lm_st_tensor *t)
{
    if (!t)
        return cJSON_CreateNull();
    return json_tensor(t);
}

static cJSON *json_lora_config(const lm_lora_config *c)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "peft_type", c->peft_type);
    cJSON_AddNumberToObject(o, "r", (double)c->r);
    cJSON_AddNumberToObject(o, "lora_alpha", c->lora_alpha);
    cJSON_AddBoolToObject(o, "use_rslora", c->use_rslora);
    cJSON_AddBoolToObject(o, "use_dora", c->use_dora);
    cJSON_AddBoolToObject(o, "fan_in_fan_out", c->fan_in_fan_out);
    cJSON_AddBoolToObject(o, "lora_bias", c->lora_bias);
    switch (c->targets) {
    case LM_LORA_TARGETS_NONE: cJSON_AddNullToObject(o, "target_modules"); break;
    case LM_LORA_TARGETS_REGEX: cJSON_AddStringToObject(o, "target_modules", c->target_regex); break;
    case LM_LORA_TARGETS_ALL_LINEAR: cJSON_AddStringToObject(o, "target_modules", "all-linear"); break;
    case LM_LORA_TARGETS_LIST: {
        cJSON *a = cJSON_AddArrayToObject(o, "target_modules");
        for (int64_t i = 0; i < c->n_target_modules; i++)
            cJSON_AddItemToArray(a, cJSON_CreateString(c->target_modules[i]));
        break;
    }
    }
    if (c->targets_default_for)
        cJSON_AddStringToObject(o, "target_modules_default_for", c->targets_default_for);
    if (c->exclude_regex)
        cJSON_AddStringToObject(o, "exclude_modules", c->exclude_regex);
    else if (c->exclude_modules) {
        cJSON *a = cJSON_AddArrayToObject(o, "exclude_modules");
        for (int64_t i = 0; i < c->n_exclude_modules; i++)
            cJSON_AddItemToArray(a, cJSON_CreateString(c->exclude_modules[i]));
    }
    cJSON *rp = cJSON_AddObjectToObject(o, "rank_pattern");
    for (int64_t i = 0; i < c->n_rank_pattern; i++)
        cJSON_AddNumberToObject(rp, c->rank_pattern[i].key, (double)c->rank_pattern[i].r);
    cJSON *ap = cJSON_AddObjectToObject(o, "alpha_pattern");
    for (int64_t i = 0; i < c->n_alpha_pattern; i++)
        cJSON_AddNumberToObject(ap, c->alpha_pattern[i].key, c->alpha_pattern[i].alpha);
    cJSON *ms = cJSON_AddArrayToObject(o, "modules_to_save");
    for (int64_t i = 0; i < c->n_modules_to_save; i++)
        cJSON_AddItemToArray(ms, cJSON_CreateString(c->modules_to_save[i]));
    cJSON *lt = cJSON_AddArrayToObject(o, "layers_to_transform");
    for (int64_t i = 0; i < c->n_layers_to_transform; i++)
        cJSON_AddItemToArray(lt, cJSON_CreateNumber((double)c->layers_to_transform[i]));
    if (c->n_layers_pattern) {
        cJSON *lp = cJSON_AddArrayToObject(o, "layers_pattern");
        for (int64_t i = 0; i < c->n_layers_pattern; i++)
            cJSON_AddItemToArray(lp, cJSON_CreateString(c->layers_pattern[i]));
    }
    if (c->base_model_name_or_path)
        cJSON_AddStringToObject(o, "base_model_name_or_path", c->base_model_name_or_path);
    else
        cJSON_AddNullToObject(o, "base_model_name_or_path");
    return o;
}

static void print_lora_config(const lm_lora_config *c)
{
    printf("peft_type: %s\n", c->peft_type);
    printf("base_model_name_or_path: %s\n",
           c->base_model_name_or_path ? c->base_model_name_or_path : "(not given)");
    printf("r: %" PRId64 ", lora_alpha: %g\n", c->r, c->lora_alpha);
    printf("use_rslora: %s, use_dora: %s, fan_in_fan_out: %s, lora_bias: %s\n",
           yes_no(c->use_rslora), yes_no(c->use_dora), yes_no(c->fan_in_fan_out),
           yes_no(c->lora_bias));
    printf("target_modules: ");
    switch (c->targets) {
    case LM_LORA_TARGETS_NONE: printf("(none)"); break;
    case LM_LORA_TARGETS_REGEX: printf("regex '%s' (full match)", c->target_regex); break;
    case LM_LORA_TARGETS_ALL_LINEAR: printf("all-linear"); break;
    case LM_LORA_TARGETS_LIST:
        for (int64_t i = 0; i < c->n_target_modules; i++)
            printf("%s%s", i ? ", " : "", c->target_modules[i]);
        break;
    }
    if (c->targets_default_for)
        printf(" (null in the file: PEFT's default for model_type %s)", c->targets_default_for);
    printf("\n");
    if (c->exclude_regex)
        printf("exclude_modules: regex '%s' (full match)\n", c->exclude_regex);
    else if (c->exclude_modules) {
        printf("exclude_modules:");
        for (int64_t i = 0; i < c->n_exclude_modules; i++)
            printf("%s %s", i ? "," : "", c->exclude_modules[i]);
        printf("%s\n", c->n_exclude_modules ? "" : " (none)");
    }
    if (c->n_rank_pattern) {
        printf("rank_pattern:");
        for (int64_t i = 0; i < c->n_rank_pattern; i++)
            printf("%s %s=%" PRId64, i ? "," : "", c->rank_pattern[i].key, c->rank_pattern[i].r);
        printf("\n");
    }
    if (c->n_alpha_pattern) {
        printf("alpha_pattern:");
        for (int64_t i = 0; i < c->n_alpha_pattern; i++)
            printf("%s %s=%g", i ? "," : "", c->alpha_pattern[i].key, c->alpha_pattern[i].alpha);
        printf("\n");
    }
    printf("modules_to_save:");
    for (int64_t i = 0; i < c->n_modules_to_save; i++)
        printf("%s %s", i ? "," : "", c->modules_to_save[i]);
    printf("%s\n", c->n_modules_to_save ? "" : " (none)");
    if (c->n_layers_to_transform) {
        printf("layers_to_transform:");
        for (int64_t i = 0; i < c->n_layers_to_transform; i++)
            printf("%s %" PRId64, i ? "," : "", c->layers_to_transform[i]);
        printf("\n");
    }
    if (c->n_layers_pattern) {
        printf("layers_pattern:");
        for (int64_t i = 0; i < c->n_layers_pattern; i++)
            printf("%s %s", i ? "," : "", c->layers_pattern[i]);
        printf("\n");
    }
}

static int inspect_adapter(const char *path, const char *base_dir, bool json)
{
    lm_adapter *a = NULL;
    lm_model *base = NULL;
    lm_err err = {0}, base_err = {0};
    lm_status s = lm_adapter_open(&a, path, &err);
    if (s != LM_OK)
        return fail(s, &err);
    if (base_dir && (s = lm_model_open(&base, base_dir, &err)) != LM_OK) {
        lm_adapter_free(a);
        lm_err_prefix(&err, "--base");
        return fail(s, &err);
    }
    // Without --base only what the config decides alone sets modules aside.
    lm_status bs = lm_adapter_select(a, base, &base_err);
    if (bs != LM_OK && !base) {
        lm_model_free(base);
        lm_adapter_free(a);
        return fail(bs, &base_err);
    }
    if (base && bs == LM_OK)
        bs = lm_adapter_validate(a, base, &base_err);

    int64_t params = 0;
    for (int64_t i = 0; i < a->st->n_tensors; i++)
        params += a->st->tensors[i].numel;

    int rc = 0;
    if (json) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "kind", "adapter");
        cJSON_AddStringToObject(o, "path", path);
        cJSON_AddItemToObject(o, "config", json_lora_config(&a->config));
        cJSON_AddNumberToObject(o, "n_tensors", (double)a->st->n_tensors);
        cJSON_AddNumberToObject(o, "n_params", (double)params);
        cJSON_AddNumberToObject(o, "n_bytes", (double)a->st->data_size);
        cJSON *mods = cJSON_AddArrayToObject(o, "modules");
        for (int64_t i = 0; i < a->n_modules; i++) {
            const lm_lora_module *m = &a->modules[i];
            cJSON *e = cJSON_CreateObject();
            cJSON_AddStringToObject(e, "module", m->path);
            cJSON_AddStringToObject(e, "kind", kind_name(m->kind));
            cJSON_AddNumberToObject(e, "r", (double)m->r);
            cJSON_AddNumberToObject(e, "alpha", m->alpha);
            cJSON_AddNumberToObject(e, "scale", m->scale);
            cJSON_AddStringToObject(e, "base_tensor", m->base_name);
            if (m->bias_name)
                cJSON_AddStringToObject(e, "bias_tensor", m->bias_name);
            else
                cJSON_AddNullToObject(e, "bias_tensor");
            cJSON_AddItemToObject(e, "a", json_factor(m->a));
            cJSON_AddItemToObject(e, "b", json_factor(m->b));
            cJSON_AddItemToObject(e, "bias", json_factor(m->bias));
            cJSON_AddItemToObject(e, "magnitude", json_factor(m->magnitude));
            cJSON_AddItemToArray(mods, e);
        }
        cJSON *sv = cJSON_AddArrayToObject(o, "saved");
        for (int64_t i = 0; i < a->n_saved; i++) {
            cJSON *e = json_tensor(a->saved[i].t);
            cJSON_AddStringToObject(e, "base_tensor", a->saved[i].base_name);
            cJSON_AddItemToArray(sv, e);
        }
        if (a->n_ignored) {
            cJSON *ig = cJSON_AddArrayToObject(o, "not_loaded");
            for (int64_t i = 0; i < a->n_ignored; i++) {
                const lm_lora_ignored *g = &a->ignored[i];
                cJSON *e = cJSON_CreateObject();
                cJSON_AddStringToObject(e, "module", g->path);
                cJSON_AddStringToObject(e, "reason", lm_lora_select_reason(g->why));
                if (g->layer >= 0)
                    cJSON_AddNumberToObject(e, "layer", (double)g->layer);
                cJSON *k = cJSON_AddArrayToObject(e, "keys");
                for (int j = 0; j < 4; j++)
                    if (g->keys[j])
                        cJSON_AddItemToArray(k, cJSON_CreateString(g->keys[j]->name));
                cJSON_AddItemToArray(ig, e);
            }
        }
        if (base) {
            cJSON *b = cJSON_AddObjectToObject(o, "base");
            cJSON_AddStringToObject(b, "path", base_dir);
            cJSON_AddStringToObject(b, "status", bs == LM_OK ? "ok" : "failed");
            if (bs != LM_OK)
                cJSON_AddStringToObject(b, "message", base_err.msg);
        }
        rc = emit_json(o);
    } else {
        char b1[32], b2[32], sa[64], sb[64];
        printf("adapter directory: %s\n", path);
        print_lora_config(&a->config);
        printf("tensors: %" PRId64 ", %" PRId64 " parameters (%s), %s\n", a->st->n_tensors, params,
               format_count(b2, sizeof b2, params), lm_format_bytes(b1, sizeof b1, a->st->data_size));
        printf("modules: %" PRId64 "\n", a->n_modules);
        if (a->n_modules) {
            int wp = 6;
            for (int64_t i = 0; i < a->n_modules; i++)
                if ((int)strlen(a->modules[i].path) > wp)
                    wp = (int)strlen(a->modules[i].path);
            printf("  %-*s  %-9s  %5s  %8s  %8s  %-12s  %-12s  %-14s  %s\n", wp, "MODULE", "KIND", "R",
                   "ALPHA", "SCALE", "A", "B", "EXTRA", "BASE TENSOR");
            for (int64_t i = 0; i < a->n_modules; i++) {
                const lm_lora_module *m = &a->modules[i];
                const char *extra = m->bias && m->magnitude ? "bias+magnitude"
                                    : m->bias ? "bias" : m->magnitude ? "magnitude" : "-";
                printf("  %-*s  %-9s  %5" PRId64 "  %8g  %8g  %-12s  %-12s  %-14s  %s\n", wp, m->path,
                       kind_name(m->kind), m->r, m->alpha, m->scale,
                       lm_st_shape_str(m->a->shape, m->a->ndim, sa, sizeof sa),
                       lm_st_shape_str(m->b->shape, m->b->ndim, sb, sizeof sb), extra, m->base_name);
            }
        }
        if (a->n_saved) {
            printf("saved tensors (modules_to_save): %" PRId64 "\n", a->n_saved);
            for (int64_t i = 0; i < a->n_saved; i++) {
                const lm_st_tensor *t = a->saved[i].t;
                printf("  %s  %s  %s  (key %s)\n", a->saved[i].base_name, lm_dtype_name(t->dtype),
                       lm_st_shape_str(t->shape, t->ndim, sa, sizeof sa), t->name);
            }
        }
        if (a->n_ignored) {
            printf("not loaded (PEFT would not load them; not merged): %" PRId64 "\n", a->n_ignored);
            for (int64_t i = 0; i < a->n_ignored; i++) {
                char msg[LM_ERR_MSG_MAX];
                lm_adapter_ignored_msg(a, i, "merged", msg, sizeof msg);
                printf("  %s\n", msg);
            }
        }
        if (base) {
            if (bs == LM_OK)
                printf("base %s: ok, every module fits\n", base_dir);
            else
                printf("base %s: FAILED: %s\n", base_dir, base_err.msg);
        }
    }
    if (rc == 0 && bs != LM_OK)
        rc = fail(bs, &base_err);
    lm_model_free(base);
    lm_adapter_free(a);
    return rc;
}

// ==== the command =============================================================================

int lm_cmd_inspect(int argc, char **argv)
{
    const char *path = NULL, *base = NULL;
    bool json = false, options_done = false;
    for (int i = 1; i < argc; i++) {
        const char *arg = argv[i];
        if (options_done || arg[0] != '-' || arg[1] == '\0') {
            if (path) {
                fprintf(stderr, "llmerge inspect: one PATH only ('%s' and '%s')\n", path, arg);
                return 2;
            }
            path = arg;
        } else if (strcmp(arg, "--") == 0) {
            options_done = true;
        } else if (strcmp(arg, "-h") == 0 || strcmp(arg, "--help") == 0) {
            usage(stdout);
            return 0;
        } else if (strcmp(arg, "--json") == 0) {
            json = true;
        } else if (strcmp(arg, "--base") == 0) {
            if (i + 1 >= argc) {
                fprintf(stderr, "llmerge inspect: --base needs a directory\n");
                return 2;
            }
            base = argv[++i];
        } else if (strncmp(arg, "--base=", 7) == 0) {
            base = arg + 7;
        } else {
            fprintf(stderr, "llmerge inspect: unknown option '%s' (see llmerge inspect --help)\n", arg);
            return 2;
        }
    }
    if (!path) {
        usage(stderr);
        return 2;
    }
    if (base && !*base) {
        fprintf(stderr, "llmerge inspect: --base needs a directory\n");
        return 2;
    }

    lm_input_kind kind;
    char *resolved = NULL, *base_resolved = NULL;
    lm_err err = {0};
    lm_status s = lm_input_detect(path, &kind, &resolved, &err);
    if (s != LM_OK)
        return fail(s, &err);
    if (base) {
        // The base may use the nested layout too, but it must be a model.
        lm_input_kind bk;
        if ((s = lm_input_detect(base, &bk, &base_resolved, &err)) != LM_OK) {
            free(resolved);
            lm_err_prefix(&err, "--base");
            return fail(s, &err);
        }
        if (bk != LM_INPUT_MODEL) {
            fprintf(stderr, "llmerge inspect: --base %s is not a model directory (it is an %s)\n",
                    base, lm_input_kind_name(bk));
            free(resolved);
            free(base_resolved);
            return 2;
        }
        base = base_resolved;
    }
    if (!json && strcmp(resolved, path) != 0) {
        if (lm_is_dir(path) || lm_is_file(path))
            printf("(%s holds one %s: %s)\n", path, lm_input_kind_name(kind), resolved);
        else  // a Hub id, found in the Hugging Face cache
            printf("(%s: the %s %s, from the Hugging Face cache)\n", path, lm_input_kind_name(kind), resolved);
    }

    int rc;
    switch (kind) {
    case LM_INPUT_SAFETENSORS:
        if (base) {
            fprintf(stderr, "llmerge inspect: --base applies to adapter and model directories, "
                            "not to a single file\n");
            rc = 2;
        } else {
            rc = inspect_file(resolved, json);
        }
        break;
    case LM_INPUT_MODEL:
        rc = inspect_model(resolved, base, json);
        break;
    case LM_INPUT_ADAPTER:
        rc = inspect_adapter(resolved, base, json);
        break;
    default:
        rc = 1;
    }
    free(resolved);
    free(base_resolved);
    return rc;
}
