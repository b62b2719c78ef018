// Benchmark of the conversions every merge runs on every byte (BF16/F16 to float32 and back)
// and of opening a safetensors file with many tensors. Prints throughput next to the floor set
// by memory bandwidth (a plain memcpy of the same bytes in the same run) and the ratio.
// Not a test: it prints figures and asserts nothing.
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "dtype.h"
#include "safetensors.h"
#include "st_writer.h"
#include "util.h"

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

// Best of `reps` runs of fn, in seconds.
#define BEST_OF(reps, stmt)                                                                   \
    ({                                                                                        \
        double best_ = 1e30;                                                                  \
        for (int r_ = 0; r_ < (reps); r_++) {                                                 \
            double t0_ = now();                                                               \
            stmt;                                                                             \
            double t_ = now() - t0_;                                                          \
            if (t_ < best_) best_ = t_;                                                       \
        }                                                                                     \
        best_;                                                                                \
    })

int main(void)
{
    const int64_t n = 64ll << 20;  // 64 Mi elements: 128 MiB of 16-bit, 256 MiB of float32
    uint16_t *half = malloc((size_t)n * 2);
    float *f32 = malloc((size_t)n * 4), *f32b = malloc((size_t)n * 4);
    if (!half || !f32 || !f32b) {
        fprintf(stderr, "bench_convert: out of memory\n");
        return 1;
    }
    uint64_t x = 88172645463325252ull;
    for (int64_t i = 0; i < n; i++) {
        x ^= x << 13; x ^= x >> 7; x ^= x << 17;
        f32[i] = (float)((int64_t)(x >> 11) - (1ll << 52)) * 0x1p-60f;
        half[i] = (uint16_t)x;
    }
    memcpy(f32b, f32, (size_t)n * 4);  // fault the pages in before timing
    lm_err err = {0};
    double bytes_rw = (double)n * 6;   // 2 bytes read + 4 written (or the reverse)
    double t_copy = BEST_OF(3, memcpy(f32b, f32, (size_t)n * 4));
    double copy_bw = (double)n * 8 / t_copy;  // 4 read + 4 written
    printf("%-28s %10s %12s %14s\n", "operation", "time (ms)", "GB/s (r+w)", "vs memcpy");
    printf("%-28s %10.1f %12.2f %14s\n", "memcpy float32 (floor)", t_copy * 1e3, copy_bw / 1e9, "1.00");
    struct { const char *name; lm_dtype dt; int to_f32; } ops[] = {
        {"BF16 -> float32", LM_DTYPE_BF16, 1},
        {"F16 -> float32", LM_DTYPE_F16, 1},
        {"float32 -> BF16 (RNE)", LM_DTYPE_BF16, 0},
        {"float32 -> F16 (RNE)", LM_DTYPE_F16, 0},
    };
    for (size_t k = 0; k < sizeof ops / sizeof ops[0]; k++) {
        double t = ops[k].to_f32 ? BEST_OF(3, lm_convert_to_f32(f32b, half, ops[k].dt, n, &err))
                                 : BEST_OF(3, lm_convert_from_f32(half, ops[k].dt, f32, n, &err));
        double bw = bytes_rw / t;
        printf("%-28s %10.1f %12.2f %14.2f\n", ops[k].name, t * 1e3, bw / 1e9, bw / copy_bw);
    }

    // Opening: a file with 50,000 small tensors (a header of a few MB), mmapped and validated.
    enum { NT = 50000 };
    lm_st_desc *d = calloc(NT, sizeof *d);
    char (*names)[48] = malloc((size_t)NT * 48);
    const void **data = malloc(NT * sizeof *data);
    static const uint16_t zeros[16];
    for (int i = 0; i < NT; i++) {
        snprintf(names[i], 48, "model.layers.%d.block.%d.weight", i / 100, i % 100);
        d[i] = (lm_st_desc){.name = names[i], .dtype = LM_DTYPE_BF16, .ndim = 2, .shape = {4, 4}};
        data[i] = zeros;
    }
    char path[] = "/tmp/lm_bench_open_XXXXXX";
    int fd = mkstemp(path);
    if (fd >= 0)
        close(fd);
    if (lm_st_write_file(path, d, data, NT, NULL, &err) != LM_OK) {
        fprintf(stderr, "bench_convert: %s\n", err.msg);
        return 1;
    }
    lm_st_file *f = NULL;
    double t_open = BEST_OF(3, ({ lm_st_open(&f, path, &err); lm_st_close(f); }));
    lm_st_open(&f, path, &err);
    double t_find = BEST_OF(3, ({ for (int i = 0; i < NT; i++) (void)lm_st_find(f, names[i]); }));
    printf("\nopen + validate %d tensors (%.1f MB header): %.1f ms; %d lookups by name: %.1f ms\n", NT,
           f ? (double)f->header_len / 1e6 : 0.0, t_open * 1e3, NT, t_find * 1e3);
    lm_st_close(f);
    unlink(path);
    free(d);
    free(names);
    free(data);
    free(half);
    free(f32);
    free(f32b);
    return 0;
}
