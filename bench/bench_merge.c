// Benchmark of the CPU merge at a real model size: `llmerge ties`, `dare` and `task-arithmetic`
// on a synthetic model with Llama-3.2-1B's shapes (1.24 B parameters, BF16, 2.47 GB), three
// full fine-tuned variants and three LoRA adapters (r 16 on every linear). The inputs are
// generated once into a work directory, a tensor at a time in parts (never a whole model in
// memory), and reused by later runs while their stamp files match. In the same run it measures
// the floor the merge cannot beat on this machine: a plain read() of every input byte the merge
// reads (in the page-cache state the merges will find) plus a write and fsync of as many bytes
// as the output holds. Then it runs each merge as a child process and prints its wall time,
// peak RSS, input throughput and ratio to the floor, with the targets beside them. Not a test:
// it asserts nothing, and exits non-zero only when something fails to run (a merge exiting
// non-zero, an input that cannot be made).
//
// With --device cuda[:N] (a GPU machine) the merges run there. Before them it measures
// cudaMemcpy's bandwidth between pinned memory and the device, and llmerge's own copies
// (lm_dev_upload and lm_dev_download from pageable memory) against it: the target is 70%. Each
// merge's line also gives the bytes copied between host and device per second of merging (from
// llmerge.json), which the floor bounds (a LoRA merge's copied bytes over its floor); and with
// --fallback-mem SIZE a TIES merge of each kind runs once more with --gpu-mem SIZE, small
// enough that tensors fall back to the CPU, giving its time and how many fell back. With
// --generate it makes the inputs and stops, for bench_methods alone.
//
//   bench_merge [--work DIR] [--llmerge PATH] [--only full|lora] [--keep] [--device DEV]
//               [--fallback-mem SIZE] [--generate]
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "dtype.h"
#include "st_writer.h"
#include "util.h"

#define BENCH_PROG "bench_merge"
#include "bench_run.h"
#include "bench_util.h"
#ifdef LLMERGE_HAVE_CUDA
#include "device.h"
#include "device_registry.h"
#include "kernels.h"
#endif

// ==== the synthetic model =====================================================================

// Llama-3.2-1B (meta-llama/Llama-3.2-1B config.json): tied embeddings, so no lm_head.
enum {
    HIDDEN = 2048,
    INTER = 8192,
    LAYERS = 16,
    HEADS = 32,
    KV_HEADS = 8,
    HEAD_DIM = 64,
    VOCAB = 128256,
    N_FT = 3,          // fine-tuned inputs of each kind
    LORA_R = 16,
    LORA_ALPHA = 32,
    MAX_TENSORS = 1 + LAYERS * 9 + 1,
};
#define SHARD_SIZE 5000000000ull   // transformers' default max_shard_size, "5GB"
#define CHUNK_ELEMS (1 << 20)      // elements generated and written per part (2 MiB of BF16)
#define IO_BLOCK (8u << 20)        // read() and write() block of the floor
#define DENSITY "0.2"
#define SEED "0"

// Bumped whenever what the generator writes changes, so stale inputs are never reused.
#define GEN_VERSION "bench_merge inputs v1: llama-3.2-1b shapes, bf16, xorshift64, chunk 1048576"

static const char *const LINEARS[] = {"q_proj", "k_proj", "v_proj", "o_proj",
                                      "gate_proj", "up_proj", "down_proj"};
enum { N_LINEARS = 7 };

typedef struct bm_tensor {
    char name[96];
    int ndim;
    int64_t shape[2];  // (ndim)
    int64_t numel;
    bool norm;         // an RMSNorm weight: values around 1
} bm_tensor;

// The module path of linear `mod` in layer `l`, e.g. "model.layers.0.self_attn.q_proj".
static void linear_path(char *buf, size_t cap, int l, int mod)
{
    snprintf(buf, cap, "model.layers.%d.%s.%s", l, mod < 4 ? "self_attn" : "mlp", LINEARS[mod]);
}

// The [out, in] of linear `mod`.
static void linear_dims(int mod, int64_t *out, int64_t *in)
{
    static const int64_t dims[N_LINEARS][2] = {
        {HEADS * HEAD_DIM, HIDDEN}, {KV_HEADS * HEAD_DIM, HIDDEN}, {KV_HEADS * HEAD_DIM, HIDDEN},
        {HIDDEN, HEADS * HEAD_DIM}, {INTER, HIDDEN}, {INTER, HIDDEN}, {HIDDEN, INTER},
    };
    *out = dims[mod][0];
    *in = dims[mod][1];
}

static void tensor_set(bm_tensor *t, int64_t d0, int64_t d1, bool norm)
{
    t->ndim = d1 < 0 ? 1 : 2;
    t->shape[0] = d0;
    t->shape[1] = d1 < 0 ? 0 : d1;
    t->numel = d1 < 0 ? d0 : d0 * d1;
    t->norm = norm;
}

// Fills t (MAX_TENSORS) with the model's tensors in transformers' state-dict order; returns n.
static int model_tensors(bm_tensor *t)
{
    int n = 0;
    snprintf(t[n].name, sizeof t[n].name, "model.embed_tokens.weight");
    tensor_set(&t[n++], VOCAB, HIDDEN, false);
    for (int l = 0; l < LAYERS; l++) {
        for (int k = 0; k < N_LINEARS; k++) {
            char path[64];
            int64_t out, in;
            linear_path(path, sizeof path, l, k);
            linear_dims(k, &out, &in);
            snprintf(t[n].name, sizeof t[n].name, "%s.weight", path);
            tensor_set(&t[n++], out, in, false);
        }
        snprintf(t[n].name, sizeof t[n].name, "model.layers.%d.input_layernorm.weight", l);
        tensor_set(&t[n++], HIDDEN, -1, true);
        snprintf(t[n].name, sizeof t[n].name, "model.layers.%d.post_attention_layernorm.weight", l);
        tensor_set(&t[n++], HIDDEN, -1, true);
    }
    snprintf(t[n].name, sizeof t[n].name, "model.norm.weight");
    tensor_set(&t[n++], HIDDEN, -1, true);
    return n;
}

static uint64_t model_bytes(void)
{
    static bm_tensor t[MAX_TENSORS];
    int n = model_tensors(t);
    uint64_t b = 0;
    for (int i = 0; i < n; i++)
        b += (uint64_t)t[i].numel * 2;
    return b;
}

// Bytes of tensor data in one adapter: lora_A [r, in] and lora_B [out, r] for every linear.
static uint64_t lora_bytes(void)
{
    uint64_t b = 0;
    for (int k = 0; k < N_LINEARS; k++) {
        int64_t out, in;
        linear_dims(k, &out, &in);
        b += (uint64_t)LAYERS * LORA_R * (uint64_t)(out + in) * 2;
    }
    return b;
}

// ==== random values ===========================================================================
// Speed matters more than distribution: each part of a tensor is its own xorshift64 stream
// seeded from (stream, tensor, part), so a fine-tuned variant regenerates the base's values
// part by part instead of reading the base back.

static uint64_t splitmix64(uint64_t z)
{
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// n (a multiple of 4; raw has room) uniformly random int16 values.
static void fill_raw(int16_t *raw, int64_t n, uint64_t stream, uint64_t tensor, uint64_t part)
{
    uint64_t x = splitmix64(stream * 0x2545F4914F6CDD1Dull ^ (tensor << 32) ^ part) | 1;
    for (int64_t i = 0; i < n; i += 4) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        memcpy(raw + i, &x, 8);
    }
}

// The base's BF16 values of part `part` of tensor `ti`: weights uniform in ±2^-5, norms 1 ± 2^-5.
static void base_part(uint16_t *out, int16_t *raw, int64_t n, const bm_tensor *t, int ti,
                      int64_t part)
{
    fill_raw(raw, n, 0, (uint64_t)ti, (uint64_t)part);
    float offset = t->norm ? 1.0f : 0.0f;
    for (int64_t i = 0; i < n; i++)
        out[i] = (uint16_t)(lm_f32_bits((float)raw[i] * 0x1p-20f + offset) >> 16);
}

// Fine-tune `ft` (1..N_FT): the base part plus a delta uniform in ±2^-9 (±2^-5 on norms),
// rounded to BF16 to nearest even, in place over the base's values in `out`.
static void ft_part(uint16_t *out, int16_t *raw, int64_t n, const bm_tensor *t, int ti,
                    int64_t part, int ft)
{
    fill_raw(raw, n, (uint64_t)ft * 7919, (uint64_t)ti, (uint64_t)part);
    float scale = t->norm ? 0x1p-20f : 0x1p-24f;
    for (int64_t i = 0; i < n; i++)
        out[i] = lm_f32_to_bf16(lm_bf16_to_f32(out[i]) + (float)raw[i] * scale);
}

// ==== small files =============================================================================

static int save_text(const char *dir, const char *name, const char *text)
{
    lm_err err = {0};
    char *path = lm_path_join(dir, name);
    lm_status s = path ? lm_write_file(path, text, strlen(text), &err)
                       : lm_err_set(&err, LM_ERR_NOMEM, "out of memory");
    free(path);
    if (s != LM_OK) {
        fprintf(stderr, "bench_merge: %s\n", err.msg);
        return -1;
    }
    return 0;
}

// meta-llama/Llama-3.2-1B's config.json.
static const char CONFIG_JSON[] =
    "{\n"
    "  \"architectures\": [\n    \"LlamaForCausalLM\"\n  ],\n"
    "  \"attention_bias\": false,\n"
    "  \"attention_dropout\": 0.0,\n"
    "  \"bos_token_id\": 128000,\n"
    "  \"eos_token_id\": 128001,\n"
    "  \"head_dim\": 64,\n"
    "  \"hidden_act\": \"silu\",\n"
    "  \"hidden_size\": 2048,\n"
    "  \"initializer_range\": 0.02,\n"
    "  \"intermediate_size\": 8192,\n"
    "  \"max_position_embeddings\": 131072,\n"
    "  \"mlp_bias\": false,\n"
    "  \"model_type\": \"llama\",\n"
    "  \"num_attention_heads\": 32,\n"
    "  \"num_hidden_layers\": 16,\n"
    "  \"num_key_value_heads\": 8,\n"
    "  \"pretraining_tp\": 1,\n"
    "  \"rms_norm_eps\": 1e-05,\n"
    "  \"rope_scaling\": {\n"
    "    \"factor\": 32.0,\n"
    "    \"high_freq_factor\": 4.0,\n"
    "    \"low_freq_factor\": 1.0,\n"
    "    \"original_max_position_embeddings\": 8192,\n"
    "    \"rope_type\": \"llama3\"\n"
    "  },\n"
    "  \"rope_theta\": 500000.0,\n"
    "  \"tie_word_embeddings\": true,\n"
    "  \"torch_dtype\": \"bfloat16\",\n"
    "  \"transformers_version\": \"4.45.0.dev0\",\n"
    "  \"use_cache\": true,\n"
    "  \"vocab_size\": 128256\n"
    "}\n";

// adapter_config.json as PEFT writes it (json.dumps(indent=2, sort_keys=True)).
static const char ADAPTER_CONFIG_JSON[] =
    "{\n"
    "  \"alpha_pattern\": {},\n"
    "  \"auto_mapping\": null,\n"
    "  \"base_model_name_or_path\": \"meta-llama/Llama-3.2-1B\",\n"
    "  \"bias\": \"none\",\n"
    "  \"fan_in_fan_out\": false,\n"
    "  \"inference_mode\": true,\n"
    "  \"init_lora_weights\": true,\n"
    "  \"layer_replication\": null,\n"
    "  \"layers_pattern\": null,\n"
    "  \"layers_to_transform\": null,\n"
    "  \"loftq_config\": {},\n"
    "  \"lora_alpha\": 32,\n"
    "  \"lora_bias\": false,\n"
    "  \"lora_dropout\": 0.05,\n"
    "  \"megatron_config\": null,\n"
    "  \"megatron_core\": \"megatron.core\",\n"
    "  \"modules_to_save\": null,\n"
    "  \"peft_type\": \"LORA\",\n"
    "  \"r\": 16,\n"
    "  \"rank_pattern\": {},\n"
    "  \"revision\": null,\n"
    "  \"target_modules\": [\n"
    "    \"k_proj\",\n    \"gate_proj\",\n    \"v_proj\",\n    \"up_proj\",\n"
    "    \"q_proj\",\n    \"o_proj\",\n    \"down_proj\"\n"
    "  ],\n"
    "  \"task_type\": \"CAUSAL_LM\",\n"
    "  \"use_dora\": false,\n"
    "  \"use_rslora\": false\n"
    "}\n";

// ==== generation ==============================================================================

// Removes `dir` and creates it empty.
static int fresh_dir(const char *dir)
{
    lm_err err = {0};
    if (lm_rm_rf(dir, &err) != LM_OK || lm_mkdir_p(dir, &err) != LM_OK) {
        fprintf(stderr, "bench_merge: %s\n", err.msg);
        return -1;
    }
    return 0;
}

// Writes model `which` (0 the base, 1..N_FT a fine-tune) into `dir`: config.json and the
// shards, streamed one part of one tensor at a time.
static int gen_model(const char *dir, int which)
{
    static bm_tensor t[MAX_TENSORS];
    lm_st_desc d[MAX_TENSORS];
    int n = model_tensors(t);
    for (int i = 0; i < n; i++) {
        d[i] = (lm_st_desc){.name = t[i].name, .dtype = LM_DTYPE_BF16, .ndim = t[i].ndim};
        d[i].shape[0] = t[i].shape[0];
        d[i].shape[1] = t[i].shape[1];
    }
    if (fresh_dir(dir) != 0 || save_text(dir, "config.json", CONFIG_JSON) != 0)
        return -1;

    int rc = -1;
    lm_err err = {0};
    lm_st_writer *w = NULL;
    uint16_t *out = malloc((size_t)CHUNK_ELEMS * 2);
    int16_t *raw = malloc((size_t)CHUNK_ELEMS * 2);
    if (!out || !raw) {
        fprintf(stderr, "bench_merge: out of memory\n");
        goto done;
    }
    if (lm_st_writer_open(&w, dir, d, n, SHARD_SIZE, NULL, &err) != LM_OK)
        goto fail;
    for (int i = 0; i < n; i++) {
        for (int64_t off = 0, part = 0; off < t[i].numel; off += CHUNK_ELEMS, part++) {
            int64_t m = t[i].numel - off < CHUNK_ELEMS ? t[i].numel - off : CHUNK_ELEMS;
            base_part(out, raw, m, &t[i], i, part);
            if (which > 0)
                ft_part(out, raw, m, &t[i], i, part, which);
            if (lm_st_writer_put_part(w, i, (uint64_t)off * 2, out, (uint64_t)m * 2, &err) != LM_OK)
                goto fail;
        }
    }
    if (lm_st_writer_finish(w, &err) != LM_OK)
        goto fail;
    rc = 0;
    goto done;
fail:
    fprintf(stderr, "bench_merge: writing %s: %s\n", dir, err.msg);
done:
    lm_st_writer_free(w);
    free(out);
    free(raw);
    return rc;
}

// Writes LoRA adapter `which` (1..N_FT) into `dir`: adapter_config.json and
// adapter_model.safetensors with lora_A [r, in] and lora_B [out, r] for every linear of every
// layer, in PEFT's key layout. The whole adapter (22.5 MB) is built in memory.
static int gen_adapter(const char *dir, int which)
{
    enum { NT = LAYERS * N_LINEARS * 2 };
    static char names[NT][128];
    lm_st_desc d[NT];
    void *data[NT] = {0};
    int16_t *raw = NULL;
    int rc = -1, n = 0;
    if (fresh_dir(dir) != 0 || save_text(dir, "adapter_config.json", ADAPTER_CONFIG_JSON) != 0)
        return -1;
    raw = malloc((size_t)INTER * LORA_R * 2);
    if (!raw)
        goto oom;
    for (int l = 0; l < LAYERS; l++) {
        for (int k = 0; k < N_LINEARS; k++) {
            char path[64];
            int64_t out, in;
            linear_path(path, sizeof path, l, k);
            linear_dims(k, &out, &in);
            for (int ab = 0; ab < 2; ab++) {
                int64_t d0 = ab ? out : LORA_R, d1 = ab ? LORA_R : in, numel = d0 * d1;
                snprintf(names[n], sizeof names[n], "base_model.model.%s.lora_%c.weight", path,
                         ab ? 'B' : 'A');
                d[n] = (lm_st_desc){.name = names[n], .dtype = LM_DTYPE_BF16, .ndim = 2,
                                    .shape = {d0, d1}};
                uint16_t *v = malloc((size_t)numel * 2);
                if (!v)
                    goto oom;
                data[n] = v;
                // A uniform in ±2^-6 (about 1/sqrt(in)), B in ±2^-7: trained B are small
                fill_raw(raw, numel, 100 + (uint64_t)which, (uint64_t)n, 0);
                float scale = ab ? 0x1p-22f : 0x1p-21f;
                for (int64_t i = 0; i < numel; i++)
                    v[i] = lm_f32_to_bf16((float)raw[i] * scale);
                n++;
            }
        }
    }
    {
        lm_err err = {0};
        char *file = lm_path_join(dir, "adapter_model.safetensors");
        lm_status s = file ? lm_st_write_file(file, d, (const void *const *)data, n, NULL, &err)
                           : lm_err_set(&err, LM_ERR_NOMEM, "out of memory");
        free(file);
        if (s != LM_OK) {
            fprintf(stderr, "bench_merge: writing %s: %s\n", dir, err.msg);
            goto done;
        }
    }
    rc = 0;
    goto done;
oom:
    fprintf(stderr, "bench_merge: out of memory\n");
done:
    for (int i = 0; i < NT; i++)
        free(data[i]);
    free(raw);
    return rc;
}

// True when the stamp file `path` exists and holds exactly `want`.
static bool stamp_ok(const char *path, const char *want)
{
    char *text = NULL;
    size_t len = 0;
    lm_err err = {0};
    if (lm_read_file(path, 4096, &text, &len, &err) != LM_OK)
        return false;
    bool ok = len == strlen(want) && memcmp(text, want, len) == 0;
    free(text);
    return ok;
}

// ==== measuring ===============================================================================

// The *.safetensors files of `dir`, appended to list[*n] (new strings; the caller frees).
static int list_safetensors(const char *dir, char **list, int *n, int cap)
{
    DIR *dp = opendir(dir);
    if (!dp) {
        fprintf(stderr, "bench_merge: %s: %s\n", dir, strerror(errno));
        return -1;
    }
    struct dirent *e;
    int rc = 0;
    while ((e = readdir(dp))) {
        if (!lm_str_ends_with(e->d_name, ".safetensors"))
            continue;
        if (*n == cap || !(list[*n] = lm_path_join(dir, e->d_name))) {
            rc = -1;
            break;
        }
        (*n)++;
    }
    closedir(dp);
    return rc;
}

static uint64_t file_size(const char *path)
{
    struct stat st;
    return stat(path, &st) == 0 ? (uint64_t)st.st_size : 0;
}

// How many bytes of the files are in the page cache now (mincore over a read-only mapping).
static uint64_t cached_bytes(char *const *files, int n)
{
    long page = sysconf(_SC_PAGESIZE);
    uint64_t cached = 0;
    for (int i = 0; i < n; i++) {
        uint64_t size = file_size(files[i]);
        int fd = open(files[i], O_RDONLY);
        if (fd < 0 || size == 0) {
            if (fd >= 0)
                close(fd);
            continue;
        }
        void *map = mmap(NULL, (size_t)size, PROT_READ, MAP_SHARED, fd, 0);
        close(fd);
        if (map == MAP_FAILED)
            continue;
        size_t pages = (size_t)((size + (uint64_t)page - 1) / (uint64_t)page);
        unsigned char *vec = malloc(pages);
        if (vec && mincore(map, (size_t)size, vec) == 0) {
            for (size_t p = 0; p < pages; p++)
                cached += (vec[p] & 1) ? (uint64_t)page : 0;
        }
        free(vec);
        munmap(map, (size_t)size);
    }
    return cached;
}

// Reads every file start to end with read() in IO_BLOCK blocks; *bytes is the total read.
static int read_all(char *const *files, int n, uint8_t *buf, double *secs, uint64_t *bytes)
{
    double t0 = now();
    *bytes = 0;
    for (int i = 0; i < n; i++) {
        int fd = open(files[i], O_RDONLY);
        if (fd < 0) {
            fprintf(stderr, "bench_merge: %s: %s\n", files[i], strerror(errno));
            return -1;
        }
        ssize_t got;
        while ((got = read(fd, buf, IO_BLOCK)) > 0)
            *bytes += (uint64_t)got;
        int e = errno;
        close(fd);
        if (got < 0) {
            fprintf(stderr, "bench_merge: reading %s: %s\n", files[i], strerror(e));
            return -1;
        }
    }
    *secs = now() - t0;
    return 0;
}

// Writes `bytes` bytes to a new file `path` in IO_BLOCK blocks, fsyncs and closes it (timed),
// then deletes it.
static int write_floor(const char *path, uint64_t bytes, const uint8_t *buf, double *secs)
{
    double t0 = now();
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0) {
        fprintf(stderr, "bench_merge: %s: %s\n", path, strerror(errno));
        return -1;
    }
    int rc = 0;
    for (uint64_t done = 0; done < bytes && rc == 0;) {
        size_t m = bytes - done < IO_BLOCK ? (size_t)(bytes - done) : IO_BLOCK;
        ssize_t put = write(fd, buf, m);
        if (put <= 0)
            rc = -1;
        else
            done += (uint64_t)put;
    }
    if (rc == 0 && fsync(fd) != 0)
        rc = -1;
    if (rc != 0)
        fprintf(stderr, "bench_merge: writing %s: %s\n", path, strerror(errno));
    if (close(fd) != 0 && rc == 0) {
        fprintf(stderr, "bench_merge: closing %s: %s\n", path, strerror(errno));
        rc = -1;
    }
    *secs = now() - t0;
    unlink(path);
    return rc;
}

static uint64_t disk_free(const char *path)
{
    struct statvfs vfs;
    return statvfs(path, &vfs) == 0 ? (uint64_t)vfs.f_bavail * vfs.f_frsize : 0;
}

// ==== running a merge =========================================================================

typedef struct bm_run {
    const char *method;   // "ties", "dare", "task-arithmetic"
    const char *kind;     // "full" or "lora"
    bm_child c;           // its exit status, wall time and peak memory
    uint64_t in_bytes;    // input safetensors bytes
    double floor;         // seconds: the floor of this kind
    const char *gpu_mem;  // --gpu-mem given to this run, or NULL
    // from the output's llmerge.json
    double merge_s;       // timings.merge_s
    double xfer_bytes;    // transfers: bytes to and from the device
    int64_t fallbacks;    // fallbacks.merge
    int64_t on_device;    // tensors merged on the device
} bm_run;

// ==== the benchmark ===========================================================================

typedef struct bm_opts {
    const char *work;
    const char *llmerge;
    bool full, lora;  // which kinds of fine-tuned inputs to merge
    bool keep;
    bool generate;             // make the inputs, then stop
    const char *device;        // --device for the merges (default cpu)
    const char *fallback_mem;  // --gpu-mem of the extra TIES run, or NULL
} bm_opts;

// Reads what the bench reports from an output's llmerge.json; fields stay 0 when absent.
static void read_manifest(const char *out, bm_run *r)
{
    char *path = lm_path_join(out, "llmerge.json");
    FILE *f = path ? fopen(path, "rb") : NULL;
    free(path);
    if (!f)
        return;
    char *text = NULL;
    size_t cap = 0, len = 0, n;
    char chunk[65536];
    while ((n = fread(chunk, 1, sizeof chunk, f)) > 0) {
        if (len + n + 1 > cap) {
            cap = (len + n + 1) * 2;
            char *t = realloc(text, cap);
            if (!t)
                break;
            text = t;
        }
        memcpy(text + len, chunk, n);
        len += n;
        text[len] = 0;
    }
    fclose(f);
    cJSON *root = text ? cJSON_Parse(text) : NULL;
    free(text);
    if (!root)
        return;
    cJSON *t = cJSON_GetObjectItem(root, "timings"), *x = cJSON_GetObjectItem(root, "transfers"),
          *fb = cJSON_GetObjectItem(root, "fallbacks"), *dv = cJSON_GetObjectItem(root, "devices");
    cJSON *v;
    if ((v = cJSON_GetObjectItem(t, "merge_s")) && cJSON_IsNumber(v))
        r->merge_s = v->valuedouble;
    if ((v = cJSON_GetObjectItem(x, "bytes_to_device")) && cJSON_IsNumber(v))
        r->xfer_bytes += v->valuedouble;
    if ((v = cJSON_GetObjectItem(x, "bytes_from_device")) && cJSON_IsNumber(v))
        r->xfer_bytes += v->valuedouble;
    if ((v = cJSON_GetObjectItem(fb, "merge")) && cJSON_IsNumber(v))
        r->fallbacks = (int64_t)v->valuedouble;
    for (cJSON *d = dv ? dv->child : NULL; d; d = d->next)
        if (strcmp(d->string, "cpu") != 0 && cJSON_IsNumber(d))
            r->on_device += (int64_t)d->valuedouble;
    cJSON_Delete(root);
}

// Everything under the work directory (new strings, freed by paths_free).
typedef struct bm_paths {
    char *base;               // the base model
    char *ft[N_FT];           // full fine-tuned models
    char *lora[N_FT];         // LoRA adapters
    char *stamp_base, *stamp_full, *stamp_lora;
    char *log;                // a merge's stdout and stderr
    char *floor_file;         // the floor's write, deleted after it
} bm_paths;

static int paths_init(bm_paths *p, const char *w)
{
    memset(p, 0, sizeof *p);
    p->base = lm_strfmt("%s/base", w);
    bool ok = p->base;
    for (int i = 0; i < N_FT; i++) {
        p->ft[i] = lm_strfmt("%s/ft%d", w, i + 1);
        p->lora[i] = lm_strfmt("%s/lora%d", w, i + 1);
        ok = ok && p->ft[i] && p->lora[i];
    }
    p->stamp_base = lm_strfmt("%s/.stamp-base", w);
    p->stamp_full = lm_strfmt("%s/.stamp-full", w);
    p->stamp_lora = lm_strfmt("%s/.stamp-lora", w);
    p->log = lm_strfmt("%s/merge.log", w);
    p->floor_file = lm_strfmt("%s/floor-write.tmp", w);
    ok = ok && p->stamp_base && p->stamp_full && p->stamp_lora && p->log && p->floor_file;
    return ok ? 0 : -1;
}

static void paths_free(bm_paths *p)
{
    free(p->base);
    for (int i = 0; i < N_FT; i++) {
        free(p->ft[i]);
        free(p->lora[i]);
    }
    free(p->stamp_base);
    free(p->stamp_full);
    free(p->stamp_lora);
    free(p->log);
    free(p->floor_file);
}


// Generates what is missing: the base (and with it the fine-tunes, which are the base plus
// deltas), the full fine-tunes, the adapters. Each group's stamp is removed before it is made
// and written once it is complete, so an interrupted run is never taken for a finished one.
static int make_inputs(const bm_paths *p, const char *w, bool have_base, bool have_full,
                       bool have_lora)
{
    if (have_base && have_full && have_lora)
        return 0;
    printf("\ngenerating inputs (Llama-3.2-1B shapes, BF16, %.2f GB a model) ...\n",
           gb(model_bytes()));
    fflush(stdout);
    if (!have_base) {
        double t0 = now();
        unlink(p->stamp_base);
        unlink(p->stamp_full);
        if (gen_model(p->base, 0) != 0 || save_text(w, ".stamp-base", GEN_VERSION) != 0)
            return -1;
        printf("  base: %.1f s\n", now() - t0);
        fflush(stdout);
    }
    if (!have_full) {
        unlink(p->stamp_full);
        for (int i = 0; i < N_FT; i++) {
            double t0 = now();
            if (gen_model(p->ft[i], i + 1) != 0)
                return -1;
            printf("  ft%d: %.1f s\n", i + 1, now() - t0);
            fflush(stdout);
        }
        if (save_text(w, ".stamp-full", GEN_VERSION) != 0)
            return -1;
    }
    if (!have_lora) {
        double t0 = now();
        unlink(p->stamp_lora);
        for (int i = 0; i < N_FT; i++) {
            if (gen_adapter(p->lora[i], i + 1) != 0)
                return -1;
        }
        if (save_text(w, ".stamp-lora", GEN_VERSION) != 0)
            return -1;
        printf("  3 LoRA adapters (r %d, alpha %d, all linears): %.1f s\n", LORA_R, LORA_ALPHA,
               now() - t0);
    }
    return 0;
}

// Measures the floor of one kind of merge (0 full fine-tunes, 1 LoRA adapters), then runs the
// three merges, appending them to runs[*nr]. Returns -1 when something could not be run at all;
// a merge that exits non-zero is counted in *failures and its output's tail printed.
static int bench_kind(const bm_opts *o, const bm_paths *p, int kind, const char *llmerge,
                      uint8_t *buf, bm_run *runs, int *nr, int *failures)
{
    static const char *const methods[] = {"ties", "dare", "task-arithmetic"};
    char *const *fts = kind == 0 ? p->ft : p->lora;
    const char *kname = kind == 0 ? "full" : "lora";
    char *files[64];
    int nf = 0, rc = -1;
    uint64_t base_in = 0, in_total = 0;
    if (list_safetensors(p->base, files, &nf, 64) != 0)
        goto done;
    for (int i = 0; i < nf; i++)
        base_in += file_size(files[i]);
    for (int i = 0; i < N_FT; i++) {
        if (list_safetensors(fts[i], files, &nf, 64) != 0)
            goto done;
    }
    for (int i = 0; i < nf; i++)
        in_total += file_size(files[i]);

    uint64_t ram = proc_kb("/proc/meminfo", "MemTotal:");
    // flush earlier writes (the inputs just generated) so that their writeback does not land
    // inside a measurement
    sync();
    // The merges run one after another on inputs the reads before them left in the page cache
    // (when they fit), so the floor's read is timed in that state too: a first pass brings the
    // files in, the second is timed. The disk's write speed varies from one write to the next
    // on this kind of machine: the floor takes the better of two.
    uint64_t cached = cached_bytes(files, nf);
    double t_first = 0, t_read = 0, t_write[2] = {0, 0};
    uint64_t got = 0, warm = 0;
    if (read_all(files, nf, buf, &t_first, &got) != 0)
        goto done;
    warm = cached_bytes(files, nf);
    if (read_all(files, nf, buf, &t_read, &got) != 0 ||
        write_floor(p->floor_file, base_in, buf, &t_write[0]) != 0 ||
        write_floor(p->floor_file, base_in, buf, &t_write[1]) != 0)
        goto done;
    double t_w = t_write[0] < t_write[1] ? t_write[0] : t_write[1];
    double floor = t_read + t_w;
    printf("\n%s: base + 3 %s: %d files, %.2f GB of input; %s RAM (%.1f GB)\n", kname,
           kind == 0 ? "full fine-tunes" : "LoRA adapters", nf, gb(in_total),
           in_total < ram ? "fits in" : "does NOT fit in", gb(ram));
    double pct0 = in_total ? 100.0 * (double)cached / (double)in_total : 0.0;
    double pct1 = in_total ? 100.0 * (double)warm / (double)in_total : 0.0;
    printf("  page cache: %.0f%% of the input bytes cached at the start; first read %.2f s "
           "(%.2f GB/s), then %.0f%% cached\n", pct0, t_first, gb(got) / t_first, pct1);
    printf("  floor: read %.2f GB in %.2f s (%.2f GB/s%s) + write %.2f GB with fsync in %.2f s "
           "(%.2f GB/s; best of %.2f s, %.2f s) = %.2f s\n", gb(got), t_read, gb(got) / t_read,
           pct1 >= 90 ? ", from the page cache" : "", gb(base_in), t_w, gb(base_in) / t_w,
           t_write[0], t_write[1], floor);
    fflush(stdout);

    int n_merges = o->fallback_mem ? 4 : 3;  // the 4th: ties again, with --gpu-mem
    for (int m = 0; m < n_merges; m++) {
        bm_run *r = &runs[(*nr)++];
        const char *method = methods[m < 3 ? m : 0];
        *r = (bm_run){.method = method, .kind = kname, .in_bytes = in_total, .floor = floor,
                      .gpu_mem = m == 3 ? o->fallback_mem : NULL};
        lm_err err = {0};
        char *out = lm_strfmt("%s/out-%s-%s", o->work, method, kname);
        char *args[] = {(char *)llmerge, (char *)method, p->base, fts[0], fts[1], fts[2],
                        "-o", out, "--density", DENSITY, "--seed", SEED, "-q", "--force",
                        "--device", (char *)o->device, m == 3 ? "--gpu-mem" : NULL, (char *)o->fallback_mem, NULL};
        if (!out || lm_rm_rf(out, &err) != LM_OK) {
            fprintf(stderr, "bench_merge: %s\n", out ? err.msg : "out of memory");
            free(out);
            goto done;
        }
        sync();  // a kept output of the run before is not written back during this one
        if (run_child(args, p->log, &r->c) != 0) {
            free(out);
            goto done;
        }
        if (r->c.status != 0) {
            (*failures)++;
            fprintf(stderr, "bench_merge: `llmerge %s` (%s) exited with status %d; its output "
                    "ends:\n", method, kname, r->c.status);
            print_tail(p->log, 2000);
        } else if (!lm_is_dir(out)) {
            (*failures)++;
            r->c.status = -1;
            fprintf(stderr, "bench_merge: `llmerge %s` (%s) exited 0 but wrote no %s\n",
                    method, kname, out);
        }
        read_manifest(out, r);
        if (!o->keep)
            lm_rm_rf(out, &err);
        printf("  %-16s %6.2f s, peak RSS %.2f GB%s%s\n", method, r->c.wall, gb(r->c.peak_rss),
               r->gpu_mem ? ", --gpu-mem " : "", r->gpu_mem ? r->gpu_mem : "");
        fflush(stdout);
        free(out);
    }
    rc = 0;
done:
    for (int i = 0; i < nf; i++)
        free(files[i]);
    return rc;
}

static void print_results(const bm_run *runs, int nr, bool device_run, const char *device, double h2d_bw,
                          double d2h_bw)
{
    printf("\n%-22s %9s %8s %8s %10s %10s %9s %9s %9s\n", "merge (3 inputs)", "input GB", "wall s",
           "floor s", "wall/floor", "in GB/s", "peak RSS", "anon*", "file*");
    for (int i = 0; i < nr; i++) {
        const bm_run *r = &runs[i];
        char name[40];
        snprintf(name, sizeof name, "%s %s%s", r->method, r->kind, r->gpu_mem ? " (gpu-mem)" : "");
        if (r->c.status != 0) {
            printf("%-22s %9.2f   FAILED (exit status %d)\n", name, gb(r->in_bytes), r->c.status);
            continue;
        }
        printf("%-22s %9.2f %8.2f %8.2f %10.2f %10.2f %9.2f %9.2f %9.2f\n", name, gb(r->in_bytes),
               r->c.wall, r->floor, r->c.wall / r->floor, gb(r->in_bytes) / r->c.wall, gb(r->c.peak_rss),
               gb(r->c.peak_anon), gb(r->c.peak_file));
    }
    if (device_run) {
        printf("\non %s: host<->device copies (llmerge.json's transfers over timings.merge_s) against "
               "cudaMemcpy from pinned memory (%.2f GB/s to the device, %.2f GB/s back)\n", device, gb(h2d_bw),
               gb(d2h_bw));
        printf("%-22s %10s %8s %10s %10s %9s %10s\n", "merge (3 inputs)", "--gpu-mem", "merge s", "copied GB",
               "copy GB/s", "of memcpy", "fell back");
        for (int i = 0; i < nr; i++) {
            const bm_run *r = &runs[i];
            if (r->c.status != 0)
                continue;
            char name[40];
            snprintf(name, sizeof name, "%s %s", r->method, r->kind);
            double rate = r->merge_s > 0 ? r->xfer_bytes / r->merge_s : 0;
            double ref = h2d_bw > 0 && d2h_bw > 0 ? (h2d_bw + d2h_bw) / 2 : 0;
            printf("%-22s %10s %8.2f %10.2f %10.2f %8.0f%% %4lld of %lld\n", name, r->gpu_mem ? r->gpu_mem : "-",
                   r->merge_s, gb((uint64_t)r->xfer_bytes), gb((uint64_t)rate), ref > 0 ? 100 * rate / ref : 0.0,
                   (long long)r->fallbacks, (long long)(r->fallbacks + r->on_device));
        }
    }
    printf("(GB = 10^9 bytes; peak RSS from wait4's ru_maxrss; * the most RssAnon / RssFile seen "
           "sampling /proc every 5 ms:\n mmapped input pages count as file RSS; default threads, "
           "density " DENSITY ", seed " SEED "; the merges ran after their floor's reads)\n");

    printf("\ntargets (%ld cores):\n", sysconf(_SC_NPROCESSORS_ONLN));
    for (int i = 0; i < nr; i++) {
        const bm_run *r = &runs[i];
        if (r->c.status != 0 || r->gpu_mem)
            continue;
        bool ties = strcmp(r->method, "ties") == 0, ta = strcmp(r->method, "task-arithmetic") == 0;
        if (ties && strcmp(r->kind, "full") == 0)
            printf("  %-22s peak RSS %.2f GB, target < 1.5 GB: %s\n", "ties full",
                   gb(r->c.peak_rss), r->c.peak_rss < 1500000000ull ? "met" : "MISSED");
        if (ties || ta) {
            double limit = ties ? 3.0 : 2.0;
            char name[40];
            snprintf(name, sizeof name, "%s %s", r->method, r->kind);
            printf("  %-22s wall %.2f s = %.2fx floor, target <= %.0fx: %s\n", name, r->c.wall,
                   r->c.wall / r->floor, limit, r->c.wall <= limit * r->floor ? "met" : "MISSED");
        }
        // On a GPU a LoRA merge's copies over its merge time can be no faster than its copied
        // bytes over the floor (the input's read and the output's write and fsync), whatever the
        // copy path's rate: the target of 70% of cudaMemcpy is the copy path's, measured above.
        if (device_run && strcmp(r->kind, "lora") == 0 && r->merge_s > 0) {
            char name[40];
            snprintf(name, sizeof name, "%s %s", r->method, r->kind);
            printf("  %-22s copies %.2f GB/s over the merge; the floor allows at most %.2f GB/s\n", name,
                   gb((uint64_t)(r->xfer_bytes / r->merge_s)), gb((uint64_t)(r->xfer_bytes / r->floor)));
        }
    }
}

#ifdef LLMERGE_HAVE_CUDA
// llmerge's own copies between the host and device `spec`: lm_dev_upload and lm_dev_download of
// `bytes` from and to pageable memory (what a merge copies from: mapped inputs, malloc'ed
// slabs), `reps` times each, against cudaMemcpy's rates from pinned memory measured just before
// (target: 70%). 0, or -1 after saying why it could not measure.
static int copy_path(const char *spec, size_t bytes, int reps, double h2d_ref, double d2h_ref)
{
    lm_dev *d = NULL;
    lm_err err = {0};
    lm_dev_opts opts = {0};
    unsigned char *host = malloc(bytes);
    void *dev = NULL;
    double up = 0, down = 0;
    int rc = -1;
    if (!host) {
        fprintf(stderr, "bench_merge: out of memory for the copy test\n");
        return -1;
    }
    for (size_t i = 0; i < bytes; i++)  // touched: no page faults in the timed copies
        host[i] = (unsigned char)(i * 2654435761u >> 13);
    if (lm_dev_open(&d, spec, &opts, NULL, 0, &err) != LM_OK || lm_dev_alloc(d, bytes, &dev, &err) != LM_OK ||
        lm_dev_upload(d, dev, host, bytes, &err) != LM_OK || lm_dev_download(d, host, dev, bytes, &err) != LM_OK)
        goto fail;
    double t0 = lm_now();
    for (int r = 0; r < reps; r++)
        if (lm_dev_upload(d, dev, host, bytes, &err) != LM_OK)
            goto fail;
    // an upload may return before its last bytes land: a one-byte download waits for them
    if (lm_dev_download(d, host, dev, 1, &err) != LM_OK)
        goto fail;
    up = (double)bytes * reps / (lm_now() - t0);
    t0 = lm_now();
    for (int r = 0; r < reps; r++)
        if (lm_dev_download(d, host, dev, bytes, &err) != LM_OK)
            goto fail;
    down = (double)bytes * reps / (lm_now() - t0);
    printf("llmerge's copies, pageable memory, %zu MiB x %d: %.2f GB/s to %s (%.0f%% of cudaMemcpy's), "
           "%.2f GB/s back (%.0f%%); target >= 70%%: %s\n",
           bytes >> 20, reps, gb((uint64_t)up), spec, 100 * up / h2d_ref, gb((uint64_t)down), 100 * down / d2h_ref,
           up >= 0.7 * h2d_ref && down >= 0.7 * d2h_ref ? "met" : "MISSED");
    rc = 0;
    goto done;
fail:
    fprintf(stderr, "bench_merge: llmerge's copies on %s: %s\n", spec, err.msg);
done:
    if (d)
        lm_dev_buf_free(d, dev);
    lm_dev_destroy(d);
    free(host);
    return rc;
}
#endif

static void usage(FILE *out)
{
    fprintf(out,
            "usage: bench_merge [--work DIR] [--llmerge PATH] [--only full|lora] [--keep]\n"
            "                   [--device DEV] [--fallback-mem SIZE] [--generate]\n"
            "  --work DIR      where inputs are generated (and reused) and merges write\n"
            "                  (default /tmp/llmerge-bench-merge)\n"
            "  --llmerge PATH  the binary to run (default: llmerge beside bench_merge)\n"
            "  --only KIND     only the merges of full fine-tunes, or only of LoRA adapters\n"
            "  --keep          keep the merge outputs (by default each is removed after its run)\n"
            "  --device DEV    where the merges run (default cpu): with cuda[:N] the transfer table too\n"
            "  --fallback-mem SIZE  also run ties of each kind with --gpu-mem SIZE (fallbacks)\n"
            "  --generate      only make the inputs (of --only's kind), for bench_methods\n");
}

int main(int argc, char **argv)
{
    bm_opts o = {.work = "/tmp/llmerge-bench-merge", .full = true, .lora = true, .device = "cpu"};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        bool has = i + 1 < argc;
        if (strcmp(a, "--work") == 0 && has) {
            o.work = argv[++i];
        } else if (strcmp(a, "--llmerge") == 0 && has) {
            o.llmerge = argv[++i];
        } else if (strcmp(a, "--only") == 0 && has) {
            const char *k = argv[++i];
            o.full = strcmp(k, "full") == 0;
            o.lora = strcmp(k, "lora") == 0;
            if (!o.full && !o.lora) {
                fprintf(stderr, "bench_merge: --only takes full or lora, not '%s'\n", k);
                return 2;
            }
        } else if (strcmp(a, "--keep") == 0) {
            o.keep = true;
        } else if (strcmp(a, "--generate") == 0) {
            o.generate = true;
        } else if (strcmp(a, "--device") == 0 && has) {
            o.device = argv[++i];
        } else if (strcmp(a, "--fallback-mem") == 0 && has) {
            o.fallback_mem = argv[++i];
        } else if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
            usage(stdout);
            return 0;
        } else {
            usage(stderr);
            return 2;
        }
    }

    int rc = 1;
    lm_err err = {0};
    bm_paths p = {0};
    uint8_t *buf = malloc(IO_BLOCK);
    char *llmerge = o.llmerge ? lm_strdup(o.llmerge) : bench_default_llmerge();
    if (!buf || !llmerge || paths_init(&p, o.work) != 0) {
        fprintf(stderr, "bench_merge: out of memory\n");
        goto done;
    }
    if (!o.generate && access(llmerge, X_OK) != 0) {
        fprintf(stderr, "bench_merge: no llmerge binary at %s (give --llmerge PATH)\n", llmerge);
        goto done;
    }
    if (lm_mkdir_p(o.work, &err) != LM_OK) {
        fprintf(stderr, "bench_merge: %s\n", err.msg);
        goto done;
    }
    for (size_t i = 0; i < IO_BLOCK; i++)  // bytes no file system could compress away
        buf[i] = (uint8_t)(splitmix64(i) >> 56);

    // ---- the machine and the disk --------------------------------------------------------
    uint64_t mbytes = model_bytes();
    bool have_base = stamp_ok(p.stamp_base, GEN_VERSION);
    // fine-tunes are the base plus deltas: a new base means new fine-tunes
    bool have_full = !o.full || (have_base && stamp_ok(p.stamp_full, GEN_VERSION));
    bool have_lora = !o.lora || stamp_ok(p.stamp_lora, GEN_VERSION);
    int n_runs = 3 * (o.full + o.lora);
    uint64_t outputs = o.generate ? 0 : o.keep ? (uint64_t)n_runs * mbytes : mbytes;
    uint64_t need = (have_base ? 0 : mbytes) + (have_full ? 0 : N_FT * mbytes) +
                    (have_lora ? 0 : N_FT * lora_bytes()) + outputs + (1ull << 30);
    uint64_t free_disk = disk_free(o.work);
    printf("machine: %ld cores, %.1f GB RAM (%.1f GB available)\n", sysconf(_SC_NPROCESSORS_ONLN),
           gb(proc_kb("/proc/meminfo", "MemTotal:")), gb(proc_kb("/proc/meminfo", "MemAvailable:")));
    char gen[160];
    snprintf(gen, sizeof gen, "%s%s%s", have_base ? "" : ", base",
             have_full ? "" : ", 3 full fine-tunes", have_lora ? "" : ", 3 adapters");
    printf("work dir %s: %.1f GB free; this run needs %.1f GB (inputs to generate: %s; "
           "output %.2f GB%s; 1 GB margin)\n", o.work, gb(free_disk), gb(need),
           gen[0] ? gen + 2 : "none", gb(o.generate ? 0 : mbytes), o.keep ? " per merge (--keep)" : "");
    if (!o.generate)
        printf("llmerge: %s\n", llmerge);
    if (free_disk < need) {
        fprintf(stderr, "bench_merge: not enough disk in %s: %.1f GB free, %.1f GB needed\n",
                o.work, gb(free_disk), gb(need));
        goto done;
    }

    // ---- inputs, floors, merges ----------------------------------------------------------
    if (make_inputs(&p, o.work, have_base, have_full, have_lora) != 0)
        goto done;
    if (o.generate) {
        printf("inputs in %s\n", o.work);
        rc = 0;
        goto done;
    }
    // the reference bandwidth of a CUDA device, measured before the merges
    double h2d_bw = 0, d2h_bw = 0;
    bool cuda = strncmp(o.device, "cuda", 4) == 0;
    if (cuda) {
#ifdef LLMERGE_HAVE_CUDA
        int ordinal = o.device[4] == ':' ? atoi(o.device + 5) : 0;
        if (lm_cuda_memcpy_bandwidth(ordinal, 256u << 20, 8, &h2d_bw, &d2h_bw, &err) != LM_OK) {
            fprintf(stderr, "bench_merge: measuring cudaMemcpy: %s\n", err.msg);
            goto done;
        }
        printf("cudaMemcpy, pinned, 256 MiB x 8: %.2f GB/s to %s, %.2f GB/s back\n", gb(h2d_bw), o.device,
               gb(d2h_bw));
        if (copy_path(o.device, 256u << 20, 8, h2d_bw, d2h_bw) != 0)
            goto done;
#else
        fprintf(stderr, "bench_merge: --device %s needs a build with CUDA\n", o.device);
        goto done;
#endif
    }
    bm_run runs[8];
    int nr = 0, failures = 0;
    if (o.full && bench_kind(&o, &p, 0, llmerge, buf, runs, &nr, &failures) != 0)
        goto done;
    if (o.lora && bench_kind(&o, &p, 1, llmerge, buf, runs, &nr, &failures) != 0)
        goto done;
    print_results(runs, nr, cuda, o.device, h2d_bw, d2h_bw);

    // keep the inputs for the next run unless that leaves the disk short
    uint64_t left = disk_free(o.work);
    if (left < 10ull * 1000 * 1000 * 1000) {
        printf("\nonly %.1f GB left free in %s: removing the generated inputs\n", gb(left), o.work);
        unlink(p.stamp_base);
        unlink(p.stamp_full);
        unlink(p.stamp_lora);
        lm_rm_rf(p.base, &err);
        for (int i = 0; i < N_FT; i++) {
            lm_rm_rf(p.ft[i], &err);
            lm_rm_rf(p.lora[i], &err);
        }
    } else {
        printf("\ninputs kept in %s for the next run (%.1f GB left free)\n", o.work, gb(left));
    }
    rc = failures ? 1 : 0;
done:
    if (p.log)
        unlink(p.log);
    paths_free(&p);
    free(llmerge);
    free(buf);
    return rc;
}
