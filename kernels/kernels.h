// CUDA kernels and their host entry points, built only when the CUDA toolkit is found
// (LLMERGE_CUDA). Every entry point returns an lm_status: a failed device allocation is
// LM_ERR_DEVICE_OOM and any other CUDA failure LM_ERR_DEVICE with the failing statement, file
// and line in the message; nothing here aborts. Pointers named d_* are device memory.
#ifndef LM_KERNELS_H
#define LM_KERNELS_H

#include <stdint.h>

#include "dtype.h"
#include "status.h"

#ifdef __cplusplus
extern "C" {
#endif

// Sets *count to the number of CUDA devices (0 when there is no driver or no device: that is
// not an error).
lm_status lm_cuda_device_count(int *count, lm_err *err);

// Converts n elements of d_src (F32, F16, BF16 or F64) to float32 in d_dst on `stream`
// (a cudaStream_t, NULL for the default stream), with the same rounding as the CPU loops.
lm_status lm_cuda_convert_to_f32(float *d_dst, const void *d_src, lm_dtype dt, int64_t n,
                                 void *stream, lm_err *err);

// Converts n float32 values to F32, F16 or BF16, rounding to nearest even as the CPU does.
lm_status lm_cuda_convert_from_f32(void *d_dst, lm_dtype dt, const float *d_src, int64_t n,
                                   void *stream, lm_err *err);

// The test operation run before a device is trusted: allocates on `device`, converts a block
// of edge-case values (NaN, Inf, subnormals, ties) to BF16 and F16 and back on the device,
// copies the results home and compares them bit for bit with the CPU conversions.
lm_status lm_cuda_selftest(int device, lm_err *err);

#ifdef __cplusplus
}
#endif

#endif
