// Benchmark of activation capture (`llmerge hessian`) on the 1B-shape synthetic model that
// bench_merge generates (Llama-3.2-1B shapes, BF16): tokens per second, and the arithmetic rate
// it implies as a share of the device's SGEMM peak measured in the same run: OpenBLAS's on the
// CPU (all cores, square 2048 matrices, best of three; target 60%), or, with --device DEV for an
// accelerator (cuda on a GPU machine), lm_dev_gemm's on that device (cuBLAS in FP32 on CUDA,
// square 4096 matrices in device memory, best of three; target 40%). The work counted per token
// is the linear layers' forward (2 · their parameters) plus the Hessian accumulation as one GEMM
// would do it (2 · in² for each of the four layer inputs of every layer); attention, norms and
// the rest are left out. Devices with syrk (the CPU, CUDA) accumulate only the upper triangle
// (in·(in + 1) per input), so the arithmetic performed is printed beside the counted work: the
// counted rate compares runs whatever the accumulation, the performed one says how busy the
// device was. The capture time is llmerge's own: placing the weights and the accumulators
// included. Not a test: it asserts nothing, and exits non-zero only when something fails to run.
//
//   bench_capture [--work DIR] [--llmerge PATH] [--seqs N] [--len L] [--device DEV]
#include <limits.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cblas.h>

#include "config.h"
#include "device.h"
#include "device_registry.h"
#include "util.h"

#include "bench_util.h"

extern void openblas_set_num_threads(int num_threads);

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

// The best rate of three 2048³ sgemm calls, in FLOP/s, on every core.
static double sgemm_peak(void)
{
    const int n = 2048;
    float *a = malloc((size_t)n * n * 4), *b = malloc((size_t)n * n * 4), *c = malloc((size_t)n * n * 4);
    if (!a || !b || !c)
        return 0;
    for (size_t i = 0; i < (size_t)n * n; i++) {
        a[i] = (float)(i % 7) * 0.1f;
        b[i] = (float)(i % 5) * 0.2f;
    }
    openblas_set_num_threads((int)sysconf(_SC_NPROCESSORS_ONLN));
    double best = 0;
    for (int r = 0; r < 4; r++) {  // the first warms up
        double t = now();
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, a, n, b, n, 0.0f, c, n);
        double rate = 2.0 * n * n * (double)n / (now() - t);
        if (r > 0 && rate > best)
            best = rate;
    }
    free(a);
    free(b);
    free(c);
    return best;
}

// The best rate of three n³ lm_dev_gemm calls on the device `spec` names, in FLOP/s, the
// matrices in its memory and each call timed to its lm_dev_sync; 0 after printing why when the
// device cannot be opened or the GEMM fails.
static double device_gemm_peak(const char *spec)
{
    const int64_t n = 4096;
    const size_t bytes = (size_t)(n * n) * sizeof(float);
    lm_dev_opts o = {.threads = 0};
    lm_dev *d = NULL;
    lm_err err = {0};
    float *a = NULL, *b = NULL, *c = NULL, *h = malloc(bytes);
    double best = 0;
    if (!h || lm_dev_open(&d, spec, &o, NULL, 0, &err) != LM_OK) {
        fprintf(stderr, "bench_capture: %s\n", h ? err.msg : "out of memory");
        free(h);
        return 0;
    }
    for (int64_t i = 0; i < n * n; i++)
        h[i] = (float)(i % 7) * 0.1f;
    lm_status st;
    if ((st = lm_dev_alloc(d, bytes, (void **)&a, &err)) != LM_OK ||
        (st = lm_dev_alloc(d, bytes, (void **)&b, &err)) != LM_OK ||
        (st = lm_dev_alloc(d, bytes, (void **)&c, &err)) != LM_OK ||
        (st = lm_dev_upload(d, a, h, bytes, &err)) != LM_OK || (st = lm_dev_upload(d, b, h, bytes, &err)) != LM_OK ||
        (st = lm_dev_sync(d, &err)) != LM_OK)
        goto out;
    for (int r = 0; r < 4; r++) {  // the first warms up
        double t = now();
        if ((st = lm_dev_gemm(d, false, false, n, n, n, 1.0f, a, n, b, n, 0.0f, c, n, &err)) != LM_OK ||
            (st = lm_dev_sync(d, &err)) != LM_OK)
            goto out;
        double rate = 2.0 * (double)n * n * (double)n / (now() - t);
        if (r > 0 && rate > best)
            best = rate;
    }
out:
    if (st != LM_OK) {
        fprintf(stderr, "bench_capture: GEMM peak on %s: %s\n", spec, err.msg);
        best = 0;
    }
    if (a)
        lm_dev_buf_free(d, a);
    if (b)
        lm_dev_buf_free(d, b);
    if (c)
        lm_dev_buf_free(d, c);
    lm_dev_destroy(d);
    free(h);
    return best;
}

int main(int argc, char **argv)
{
    const char *work = "/tmp/llmerge-bench-merge", *llmerge_arg = NULL, *device = "cpu";
    int seqs = 4, len = 128;
    for (int i = 1; i < argc; i++) {
        bool has = i + 1 < argc;
        if (strcmp(argv[i], "--work") == 0 && has)
            work = argv[++i];
        else if (strcmp(argv[i], "--llmerge") == 0 && has)
            llmerge_arg = argv[++i];
        else if (strcmp(argv[i], "--seqs") == 0 && has)
            seqs = atoi(argv[++i]);
        else if (strcmp(argv[i], "--len") == 0 && has)
            len = atoi(argv[++i]);
        else if (strcmp(argv[i], "--device") == 0 && has)
            device = argv[++i];
        else {
            fprintf(stderr, "usage: bench_capture [--work DIR] [--llmerge PATH] [--seqs N] [--len L] [--device DEV]\n");
            return 2;
        }
    }
    char *llmerge = llmerge_arg ? lm_strdup(llmerge_arg) : bench_default_llmerge();
    char *base = lm_path_join(work, "base"), *cfg_path = lm_path_join(base, "config.json");
    char *calib = lm_path_join(work, "capture.txt"), *out = lm_path_join(work, "capture-H.safetensors");
    lm_config cfg;
    lm_err err = {0};
    if (access(cfg_path, R_OK) != 0) {
        fprintf(stderr, "bench_capture: no model at %s: run bench_merge first, which generates it\n", base);
        return 1;
    }
    if (lm_config_load(&cfg, cfg_path, &err) != LM_OK) {
        fprintf(stderr, "bench_capture: %s\n", err.msg);
        return 1;
    }
    // calibration data: seqs sequences of len ids
    FILE *f = fopen(calib, "w");
    if (!f) {
        fprintf(stderr, "bench_capture: cannot write %s\n", calib);
        return 1;
    }
    uint64_t x = 88172645463325252ull;
    for (int s = 0; s < seqs; s++) {
        for (int t = 0; t < len; t++) {
            x ^= x << 13, x ^= x >> 7, x ^= x << 17;
            fprintf(f, "%s%llu", t ? " " : "", (unsigned long long)(x % (uint64_t)cfg.vocab_size));
        }
        fputc('\n', f);
    }
    fclose(f);

    bool on_cpu = strcmp(device, "cpu") == 0;
    double peak = on_cpu ? sgemm_peak() : device_gemm_peak(device);
    if (peak <= 0)
        return 1;
    int64_t h = cfg.hidden_size, q = cfg.num_attention_heads * cfg.head_dim;
    int64_t kv = cfg.num_key_value_heads * cfg.head_dim, in = cfg.intermediate_size;
    double linear = (double)(h * q + 2 * h * kv + q * h + 2 * h * in + in * h);
    double hess = (double)(h * h + q * q + h * h + in * in);
    double per_token = (2.0 * linear + 2.0 * hess) * (double)cfg.num_hidden_layers;
    double upper = (double)(h * (h + 1) + q * (q + 1) + h * (h + 1) + in * (in + 1));
    double performed = (2.0 * linear + upper) * (double)cfg.num_hidden_layers;
    if (on_cpu)
        printf("machine: %ld cores; OpenBLAS sgemm 2048^3 on all cores: %.1f GFLOP/s (best of 3)\n",
               sysconf(_SC_NPROCESSORS_ONLN), peak / 1e9);
    else
        printf("device %s: lm_dev_gemm 4096^3 in device memory: %.1f GFLOP/s (best of 3)\n", device, peak / 1e9);
    printf("model %s: %lld layers, hidden %lld, intermediate %lld; counted work %.2f GFLOP per token "
           "(linear forward %.2f + Hessians %.2f)\n", base, (long long)cfg.num_hidden_layers, (long long)h,
           (long long)in, per_token / 1e9, 2.0 * linear * (double)cfg.num_hidden_layers / 1e9,
           2.0 * hess * (double)cfg.num_hidden_layers / 1e9);
    fflush(stdout);

    char *log = lm_path_join(work, "capture.log");
    double t0 = now();
    pid_t pid = fork();
    if (pid == 0) {
        // stderr to the log: llmerge's summary line says how long the capture itself took
        if (!freopen(log, "w", stderr))
            _exit(127);
        execl(llmerge, llmerge, "hessian", base, "--calib", calib, "-o", out, "--force", "--device", device,
              (char *)NULL);
        perror("bench_capture: exec");
        _exit(127);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    double wall = now() - t0;
    unlink(out);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        fprintf(stderr, "bench_capture: llmerge hessian failed (status %d)\n", status);
        return 1;
    }
    // "... N tokens captured in T s ..." from llmerge's summary
    double tokens = (double)seqs * len, capture = 0;
    FILE *lf = fopen(log, "r");
    char line[1024];
    while (lf && fgets(line, sizeof line, lf)) {
        const char *p = strstr(line, " tokens captured in ");
        if (p)
            capture = atof(p + strlen(" tokens captured in "));
    }
    if (lf)
        fclose(lf);
    unlink(log);
    if (capture <= 0) {
        fprintf(stderr, "bench_capture: no capture time in llmerge's output\n");
        return 1;
    }
    double rate = tokens / capture;
    double target = on_cpu ? 0.6 : 0.4, share = rate * per_token / peak;
    printf("llmerge hessian, %d sequences x %d tokens on %s: %.2f s in all (the capture %.2f s, then the\n"
           "  Hessians finished and written), capture %.1f tokens/s, %.1f GFLOP/s counted = %.0f%% of the %s\n"
           "  peak (target %.0f%%: %s); performed (%.2f GFLOP per token, the Hessians' upper triangles): %.1f\n"
           "  GFLOP/s = %.0f%% of the peak\n", seqs, len, device, wall, capture, rate, rate * per_token / 1e9,
           100.0 * share, on_cpu ? "sgemm" : "device's GEMM", 100.0 * target, share >= target ? "met" : "MISSED",
           performed / 1e9, rate * performed / 1e9, 100.0 * rate * performed / peak);
    free(log);
    lm_config_free(&cfg);
    free(llmerge);
    free(base);
    free(cfg_path);
    free(calib);
    free(out);
    return 0;
}
