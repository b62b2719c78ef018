// The dot product of two rows in the order device.h fixes for lm_dev_row_dot (the product of
// column c to lane c mod LM_DOT_LANES, each lane in column order, then the lanes added in pairs
// of neighbours, level by level), written from that description, apart from the backends, for
// the tests that hold every device to those bits.
#ifndef LM_TEST_DOT_REF_H
#define LM_TEST_DOT_REF_H

#include <stdint.h>

#include "device.h"

static inline double dot_ref(const float *x, const float *y, int64_t n)
{
    double l[LM_DOT_LANES] = {0};
    for (int64_t c = 0; c < n; c++)
        l[c % LM_DOT_LANES] += (double)x[c] * (double)y[c];
    for (int m = LM_DOT_LANES; m > 1; m /= 2)  // level by level: l[i] = l[2i] + l[2i + 1]
        for (int i = 0; i < m / 2; i++)
            l[i] = l[2 * i] + l[2 * i + 1];
    return l[0];
}

#endif
