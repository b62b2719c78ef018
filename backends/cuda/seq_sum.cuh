// Sequential double sums by one warp, shared by the .cu files of backends/cuda/ (CUDA code
// only).
// Where the CPU backend adds a row or block in double in index order, a kernel that must agree
// with it bit for bit has one warp walk the same elements in tiles of 32 and add the lanes'
// values one after another, lane 0's first: the same additions in the same order, with the
// loads of the next tiles issued ahead of the chain of dependent additions.
#ifndef LM_SEQ_SUM_CUH
#define LM_SEQ_SUM_CUH

#include <cuda_runtime.h>

#include <stdint.h>

#define FULL_MASK 0xFFFFFFFFu
#define SEQ_TILES 4  // tiles of 32 a warp loads ahead in the sequential sums

// Adds lane l's v to s for l = 0, 1, ..., cnt - 1, in that order: the sum a sequential CPU loop
// computes. Every lane of the warp calls it with the same s and cnt (so the branch is uniform)
// and every lane gets the same result.
__device__ __forceinline__ double add_lanes_in_order(double s, double v, int cnt)
{
    if (cnt == 32) {
#pragma unroll
        for (int l = 0; l < 32; l++)
            s += __shfl_sync(FULL_MASK, v, l);
    } else {
        for (int l = 0; l < cnt; l++)
            s += __shfl_sync(FULL_MASK, v, l);
    }
    return s;
}

// Loads SEQ_TILES tiles of 32 floats starting at lo (0 past hi), one per lane per tile. The
// loads are issued a group ahead of the additions that use them, to hide memory latency behind
// the chain of dependent additions.
__device__ __forceinline__ void load_tiles(float *v, const float *x, int64_t lo, int64_t hi, int lane)
{
#pragma unroll
    for (int j = 0; j < SEQ_TILES; j++) {
        int64_t i = lo + 32 * j + lane;
        v[j] = i < hi ? x[i] : 0.0f;
    }
}

#endif
