// st_diff: compares the tensors of two safetensors files for the device tests, where outputs
// made on different devices must agree to float32 rounding. `st_diff [--ulps N] A B` checks
// that both files hold the same tensor names, dtypes and shapes, and that every element of a
// floating tensor is within N units in the last place of its dtype (default 0: identical bits;
// with N > 0 two NaN agree whatever their payloads); other dtypes must be identical. With `--rel R` an element also passes when it differs by at
// most R times the largest magnitude of its tensor in A: for sums such as Hessians, whose small
// entries are differences of large terms, float32 rounding is relative to the terms, not to the
// entry. Prints one line per tensor that differs and a summary.
// Exit status: 0 within the bound, 1 not, 2 usage or an unreadable file.
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dtype.h"
#include "safetensors.h"

// The element's position on the line of representable values of its dtype: consecutive values
// differ by one, and +0 and -0 are both 0.
static int64_t ordinal(const unsigned char *p, lm_dtype dt)
{
    uint64_t bits = 0;
    int width = (int)lm_dtype_bits(dt);
    memcpy(&bits, p, (size_t)width / 8);
    uint64_t sign = 1ull << (width - 1);
    int64_t mag = (int64_t)(bits & (sign - 1));
    return bits & sign ? -mag : mag;
}

// The element's value (a floating dtype).
static double value(const unsigned char *p, lm_dtype dt)
{
    float f;
    uint16_t h;
    if (dt == LM_DTYPE_F32) {
        memcpy(&f, p, 4);
        return f;
    }
    memcpy(&h, p, 2);
    return dt == LM_DTYPE_BF16 ? lm_bf16_to_f32(h) : lm_f16_to_f32(h);
}

int main(int argc, char **argv)
{
    int64_t max_ulps = 0;
    double rel = -1, worst_rel = 0;  // rel < 0: no --rel
    int a = 1;
    for (; a + 2 < argc; a += 2) {
        if (strcmp(argv[a], "--ulps") == 0)
            max_ulps = strtoll(argv[a + 1], NULL, 10);
        else if (strcmp(argv[a], "--rel") == 0)
            rel = strtod(argv[a + 1], NULL);
        else
            break;
    }
    if (argc - a != 2) {
        fprintf(stderr, "usage: st_diff [--ulps N] [--rel R] A.safetensors B.safetensors\n");
        return 2;
    }
    lm_err err = {0};
    lm_st_file *fa = NULL, *fb = NULL;
    if (lm_st_open(&fa, argv[a], &err) != LM_OK || lm_st_open(&fb, argv[a + 1], &err) != LM_OK) {
        fprintf(stderr, "st_diff: %s\n", err.msg);
        lm_st_close(fa);
        return 2;
    }
    int64_t bad_tensors = 0, differing = 0, total = 0, worst = 0;
    if (fa->n_tensors != fb->n_tensors) {
        printf("%s has %" PRId64 " tensors, %s %" PRId64 "\n", argv[a], fa->n_tensors, argv[a + 1], fb->n_tensors);
        bad_tensors++;
    }
    for (int64_t t = 0; t < fa->n_tensors; t++) {
        const lm_st_tensor *x = &fa->tensors[t], *y = lm_st_find(fb, x->name);
        if (!y || y->dtype != x->dtype || y->nbytes != x->nbytes) {
            printf("%s: missing or of another dtype or size in %s\n", x->name, argv[a + 1]);
            bad_tensors++;
            continue;
        }
        bool floating = x->dtype == LM_DTYPE_F32 || x->dtype == LM_DTYPE_F16 || x->dtype == LM_DTYPE_BF16;
        if (!floating) {
            if (memcmp(x->data, y->data, x->nbytes) != 0) {
                printf("%s: %s data differs\n", x->name, lm_dtype_name(x->dtype));
                bad_tensors++;
            }
            continue;
        }
        size_t es = lm_dtype_bits(x->dtype) / 8;
        int64_t diff = 0, over = 0, most = 0;
        double amax = 0;
        for (int64_t i = 0; rel >= 0 && i < x->numel; i++)
            amax = fmax(amax, fabs(value((const unsigned char *)x->data + i * es, x->dtype)));
        for (int64_t i = 0; i < x->numel; i++) {
            const unsigned char *px = (const unsigned char *)x->data + i * es;
            const unsigned char *py = (const unsigned char *)y->data + i * es;
            int64_t d = ordinal(px, x->dtype) - ordinal(py, x->dtype);
            d = d < 0 ? -d : d;
            // beyond identical bits, a NaN is any NaN: devices differ in the payload they give one
            if (max_ulps > 0 && isnan(value(px, x->dtype)) && isnan(value(py, x->dtype)))
                d = 0;
            diff += d != 0;
            most = d > most ? d : most;
            if (d > max_ulps && rel >= 0) {
                double r = fabs(value(px, x->dtype) - value(py, x->dtype)) / (amax > 0 ? amax : 1);
                worst_rel = r > worst_rel || isnan(r) ? r : worst_rel;
                over += !(r <= rel);
            } else {
                over += d > max_ulps;
            }
        }
        total += x->numel;
        differing += diff;
        worst = most > worst ? most : worst;
        if (over) {
            printf("%s: %" PRId64 " of %" PRId64 " elements differ by more than %" PRId64 " ulp%s (up to %" PRId64
                   " ulp)\n", x->name, over, x->numel, max_ulps, rel >= 0 ? " and --rel" : "", most);
            bad_tensors++;
        }
    }
    printf("st_diff: %" PRId64 " of %" PRId64 " elements differ, by at most %" PRId64 " ulp; %" PRId64
           " tensors beyond %" PRId64 " ulp\n", differing, total, worst, bad_tensors, max_ulps);
    if (rel >= 0)
        printf("st_diff: beyond %" PRId64 " ulp, at most %.3g of the tensor's largest magnitude (--rel %g)\n", max_ulps,
               worst_rel, rel);
    lm_st_close(fa);
    lm_st_close(fb);
    return bad_tensors ? 1 : 0;
}
