// What several test programs build their inputs with: a safetensors file written by hand from
// a list of tensors (header and data laid out as the format says, no library writer involved,
// so that the reader is tested against bytes it did not produce), the tensor list of a tiny
// Llama, the generated fixtures (LLMERGE_FIXTURES, which ctest sets: its directory, and its
// models and adapters opened), and merge options with the command line's defaults. Inline, so a
// program uses only what it needs.
#ifndef LM_TEST_FIXTURE_H
#define LM_TEST_FIXTURE_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "adapter.h"
#include "check.h"
#include "merge.h"
#include "model.h"
#include "util.h"

// ==== a safetensors file by hand ==============================================================

// One tensor of fixture_write_st.
typedef struct fixture_tensor {
    char name[112];
    const char *dtype;  // "F32", "F16", "BF16", "F64", "I32", "I8", "U8", ...
    int ndim;
    int64_t shape[4];
} fixture_tensor;

// An F32 tensor [a, b] and [a] called name.
static inline fixture_tensor fixture_t2(const char *name, int64_t a, int64_t b)
{
    fixture_tensor t = {.dtype = "F32", .ndim = 2, .shape = {a, b}};
    snprintf(t.name, sizeof t.name, "%s", name);
    return t;
}

static inline fixture_tensor fixture_t1(const char *name, int64_t a)
{
    fixture_tensor t = {.dtype = "F32", .ndim = 1, .shape = {a}};
    snprintf(t.name, sizeof t.name, "%s", name);
    return t;
}

// The bytes of one element of safetensors dtype dt (2 for any other name).
static inline size_t fixture_dtype_size(const char *dt)
{
    if (strcmp(dt, "F32") == 0 || strcmp(dt, "I32") == 0) return 4;
    if (strcmp(dt, "F64") == 0) return 8;
    if (strcmp(dt, "I8") == 0 || strcmp(dt, "U8") == 0) return 1;
    return 2;
}

// What the data of fixture_write_st's tensors holds.
typedef enum fixture_fill {
    FIXTURE_ZEROS,    // every byte 0
    FIXTURE_PATTERN,  // byte i of the data section (i · 7 + 3) mod 256
} fixture_fill;

// Writes dir/file, a safetensors file holding the n tensors ts with their data in that order
// (__metadata__ {"format": "pt"}, the header padded with spaces to a multiple of 8). A failure
// to write is a failed check.
static inline void fixture_write_st(const char *dir, const char *file, const fixture_tensor *ts, int n,
                                    fixture_fill fill)
{
    size_t cap = 256 + (size_t)n * 220, hl = 0;
    char *hdr = malloc(cap);
    hl += (size_t)snprintf(hdr + hl, cap - hl, "{\"__metadata__\":{\"format\":\"pt\"}");
    uint64_t off = 0;
    for (int i = 0; i < n; i++) {
        int64_t numel = 1;
        hl += (size_t)snprintf(hdr + hl, cap - hl, ",\"%s\":{\"dtype\":\"%s\",\"shape\":[", ts[i].name,
                               ts[i].dtype);
        for (int d = 0; d < ts[i].ndim; d++) {
            numel *= ts[i].shape[d];
            hl += (size_t)snprintf(hdr + hl, cap - hl, d ? ",%lld" : "%lld", (long long)ts[i].shape[d]);
        }
        uint64_t nb = (uint64_t)numel * fixture_dtype_size(ts[i].dtype);
        hl += (size_t)snprintf(hdr + hl, cap - hl, "],\"data_offsets\":[%llu,%llu]}",
                               (unsigned long long)off, (unsigned long long)(off + nb));
        off += nb;
    }
    hl += (size_t)snprintf(hdr + hl, cap - hl, "}");
    while (hl % 8)
        hdr[hl++] = ' ';
    size_t total = 8 + hl + off;
    unsigned char *buf = calloc(1, total);
    for (int b = 0; b < 8; b++)
        buf[b] = (unsigned char)((uint64_t)hl >> (8 * b));
    memcpy(buf + 8, hdr, hl);
    unsigned char *data = buf + 8 + hl;
    for (uint64_t i = 0; fill == FIXTURE_PATTERN && i < off; i++)
        data[i] = (unsigned char)(i * 7 + 3);
    char *p = lm_path_join(dir, file);
    lm_err err;
    CHECK_OK(lm_write_file(p, buf, total, &err), &err);
    free(p);
    free(buf);
    free(hdr);
}

// ==== a tiny Llama ============================================================================

// The tensors of a tiny Llama (2 layers, hidden 8, intermediate 12, 2 heads of 4, 1 kv head,
// vocab 16) in state-dict order, F32, with the q, k, v and o projections' biases where bias
// (attention_bias): fills ts, which has room for 64, and returns the count.
static inline int fixture_tiny_llama(fixture_tensor *ts, bool bias)
{
    int n = 0;
    char name[112];
    ts[n++] = fixture_t2("model.embed_tokens.weight", 16, 8);
    for (int l = 0; l < 2; l++) {
        static const struct { const char *m; int64_t o, i; } lin[] = {
            {"self_attn.q_proj", 8, 8}, {"self_attn.k_proj", 4, 8}, {"self_attn.v_proj", 4, 8},
            {"self_attn.o_proj", 8, 8}, {"mlp.gate_proj", 12, 8}, {"mlp.up_proj", 12, 8},
            {"mlp.down_proj", 8, 12},
        };
        for (int k = 0; k < 7; k++) {
            snprintf(name, sizeof name, "model.layers.%d.%s.weight", l, lin[k].m);
            ts[n++] = fixture_t2(name, lin[k].o, lin[k].i);
            if (bias && k < 4) {
                snprintf(name, sizeof name, "model.layers.%d.%s.bias", l, lin[k].m);
                ts[n++] = fixture_t1(name, lin[k].o);
            }
        }
        snprintf(name, sizeof name, "model.layers.%d.input_layernorm.weight", l);
        ts[n++] = fixture_t1(name, 8);
        snprintf(name, sizeof name, "model.layers.%d.post_attention_layernorm.weight", l);
        ts[n++] = fixture_t1(name, 8);
    }
    ts[n++] = fixture_t1("model.norm.weight", 8);
    ts[n++] = fixture_t2("lm_head.weight", 16, 8);
    return n;
}

// ==== the generated fixtures ==================================================================

// LLMERGE_FIXTURES, set by main.
static const char *fixtures __attribute__((unused));

// fixtures/name; the caller frees it.
static inline char *fx(const char *name)
{
    return lm_path_join(fixtures, name);
}

// Sets `fixtures` from LLMERGE_FIXTURES. Returns false, after a line on stderr naming the
// program prog, where it is not set or empty (the program was not run by ctest).
static inline bool fixture_env(const char *prog)
{
    fixtures = getenv("LLMERGE_FIXTURES");
    if (!fixtures || !*fixtures) {
        fprintf(stderr, "%s: LLMERGE_FIXTURES is not set (ctest sets it)\n", prog);
        return false;
    }
    return true;
}

// The model fixtures/name, opened, or NULL after a failed check; free it with lm_model_free.
static inline lm_model *fixture_model(const char *name)
{
    char *p = fx(name);
    lm_model *m = NULL;
    lm_err err;
    CHECK_OK(lm_model_open(&m, p, &err), &err);
    free(p);
    return m;
}

// The adapter fixtures/name, opened, or NULL after a failed check; free it with
// lm_adapter_free.
static inline lm_adapter *fixture_adapter(const char *name)
{
    char *p = fx(name);
    lm_adapter *a = NULL;
    lm_err err;
    CHECK_OK(lm_adapter_open(&a, p, &err), &err);
    free(p);
    return a;
}

// ==== merge options ===========================================================================

// Options for method m over n_ft FTs with weights w and densities d (n_ft each, not copied):
// what the command line gives when no other option is set (lambda 1, normalize as the method
// does by default, sign sum, --topk tensor, rescale inv, seed 0), float32 output, one thread,
// the default slab. The caller changes what its test needs.
static inline lm_merge_opts fixture_merge_opts(lm_merge_method m, int n_ft, const double *w, const double *d)
{
    lm_merge_opts o;
    memset(&o, 0, sizeof o);
    o.method = m;
    o.n_ft = n_ft;
    o.weights = w;
    o.densities = d;
    o.lambda = 1.0;
    o.normalize = lm_merge_default_normalize(m);
    o.sign = LM_SIGN_SUM;
    o.topk_global = false;
    o.rescale = LM_RESCALE_INV;
    o.seed = 0;
    o.out_dtype = LM_DTYPE_F32;
    o.threads = 1;
    o.slab_elems = 0;
    return o;
}

#endif
