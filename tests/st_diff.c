// st_diff: compares the tensors of two safetensors files for the device tests, where outputs
// made on different devices must agree to float32 rounding. `st_diff [--ulps N] A B` checks
// that both files hold the same tensor names, dtypes and shapes, and that every element of a
// floating tensor is within N units in the last place of its dtype (default 0: identical bits);
// other dtypes must be identical. Prints one line per tensor that differs and a summary.
// Exit status: 0 within the bound, 1 not, 2 usage or an unreadable file.
#include <inttypes.h>
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

int main(int argc, char **argv)
{
    int64_t max_ulps = 0;
    int a = 1;
    if (argc > 2 && strcmp(argv[1], "--ulps") == 0) {
        max_ulps = strtoll(argv[2], NULL, 10);
        a = 3;
    }
    if (argc - a != 2) {
        fprintf(stderr, "usage: st_diff [--ulps N] A.safetensors B.safetensors\n");
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
        for (int64_t i = 0; i < x->numel; i++) {
            int64_t d = ordinal((const unsigned char *)x->data + i * es, x->dtype) -
                        ordinal((const unsigned char *)y->data + i * es, x->dtype);
            d = d < 0 ? -d : d;
            diff += d != 0;
            over += d > max_ulps;
            most = d > most ? d : most;
        }
        total += x->numel;
        differing += diff;
        worst = most > worst ? most : worst;
        if (over) {
            printf("%s: %" PRId64 " of %" PRId64 " elements differ by more than %" PRId64 " ulp (up to %" PRId64 ")\n",
                   x->name, over, x->numel, max_ulps, most);
            bad_tensors++;
        }
    }
    printf("st_diff: %" PRId64 " of %" PRId64 " elements differ, by at most %" PRId64 " ulp; %" PRId64
           " tensors beyond %" PRId64 " ulp\n", differing, total, worst, bad_tensors, max_ulps);
    lm_st_close(fa);
    lm_st_close(fb);
    return bad_tensors ? 1 : 0;
}
