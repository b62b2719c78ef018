// Element types of safetensors files and the conversions llmerge computes with. Every dtype in
// the safetensors format parses, so a file holding FP8 or integer tensors can be read and
// inspected; arithmetic happens in float32, converted from F32, F16, BF16 or F64 and back to
// F32, F16 or BF16 with round-to-nearest-even (NaN stays NaN, Inf stays Inf, subnormals kept).
// Every NaN written is the canonical quiet NaN (LM_F32_NAN, LM_F16_NAN, LM_BF16_NAN: sign clear,
// no payload), whatever sign and payload the float32 held: arithmetic on a GPU does not carry
// payloads as x86 does, so only a canonical NaN lets every device write the same bits. Reading
// keeps the bits (F16 and BF16 NaNs widen with their sign and payload).
// The conversion loops are branch-free per element so the compiler can vectorise them.
#ifndef LM_DTYPE_H
#define LM_DTYPE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "status.h"

#ifdef __cplusplus
extern "C" {
#endif

// In the order of the reference implementation's Dtype enum: its writer sorts tensors by this
// order, descending, then by name, and llmerge's writer does the same.
typedef enum lm_dtype {
    LM_DTYPE_BOOL,
    LM_DTYPE_F4,
    LM_DTYPE_F6_E2M3,
    LM_DTYPE_F6_E3M2,
    LM_DTYPE_U8,
    LM_DTYPE_I8,
    LM_DTYPE_F8_E5M2,
    LM_DTYPE_F8_E4M3,
    LM_DTYPE_F8_E8M0,
    LM_DTYPE_F8_E4M3FNUZ,
    LM_DTYPE_F8_E5M2FNUZ,
    LM_DTYPE_I16,
    LM_DTYPE_U16,
    LM_DTYPE_F16,
    LM_DTYPE_BF16,
    LM_DTYPE_I32,
    LM_DTYPE_U32,
    LM_DTYPE_F32,
    LM_DTYPE_C64,
    LM_DTYPE_F64,
    LM_DTYPE_I64,
    LM_DTYPE_U64,
    LM_DTYPE_COUNT
} lm_dtype;

// The safetensors name ("BF16"), static.
const char *lm_dtype_name(lm_dtype dt);

// Looks up a safetensors dtype name of `len` bytes (not NUL-terminated). Returns true and sets
// *out when known.
bool lm_dtype_from_name(const char *name, size_t len, lm_dtype *out);

// Parses a user-facing dtype ("f32", "bf16", "float16", "bfloat16", "F32", ...) for
// --dtype and config.json's torch_dtype; only F32, F16 and BF16 (and F64 for config) match.
bool lm_dtype_from_user(const char *name, lm_dtype *out);

// Bits per element (4 for F4, 6 for F6_*, 8 for BOOL).
unsigned lm_dtype_bits(lm_dtype dt);

// True for the dtypes llmerge converts to float32: F32, F16, BF16, F64.
bool lm_dtype_readable(lm_dtype dt);

// True for the dtypes llmerge writes results in: F32, F16, BF16.
bool lm_dtype_writable(lm_dtype dt);

// ---- scalar conversions ---------------------------------------------------------------------
// Shared by the CPU loops and the CUDA kernels (backends/cuda/convert.cu), so both round the same
// way bit for bit.

#ifdef __CUDACC__
#define LM_HD __host__ __device__
#else
#define LM_HD
#endif

// The NaN every conversion to F32, F16 or BF16 writes.
#define LM_F32_NAN 0x7FC00000u
#define LM_F16_NAN 0x7E00u
#define LM_BF16_NAN 0x7FC0u

LM_HD static inline float lm_bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
LM_HD static inline uint32_t lm_f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

LM_HD static inline float lm_bf16_to_f32(uint16_t h) { return lm_bits_f32((uint32_t)h << 16); }

LM_HD static inline uint16_t lm_f32_to_bf16(float f)
{
    uint32_t u = lm_f32_bits(f);
    uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)((u & 0x7FFFFFFFu) > 0x7F800000u ? LM_BF16_NAN : rounded);
}

LM_HD static inline float lm_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t em = h & 0x7FFFu;
    // Exponent and mantissa moved into float position, then re-biased by 2^(127-15): exact
    // for normals and subnormals alike.
    float scaled = lm_bits_f32(em << 13) * 0x1p112f;
    uint32_t bits = lm_f32_bits(scaled);
    uint32_t special = 0x7F800000u | ((em & 0x3FFu) << 13);  // Inf or NaN
    bits = em >= 0x7C00u ? special : bits;
    return lm_bits_f32(bits | sign);
}

LM_HD static inline uint16_t lm_f32_to_f16(float f)
{
    uint32_t u = lm_f32_bits(f);
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t x = u & 0x7FFFFFFFu;
    // Normal range: round the 13 dropped bits to nearest even, re-bias the exponent.
    uint32_t normal = (x + ((uint32_t)(15 - 127) << 23) + 0xFFFu + ((x >> 13) & 1u)) >> 13;
    // Subnormal range: adding 0.5f aligns the bits so the FPU's own rounding (to nearest
    // even) does the work; 0.5f's bits are subtracted back out.
    uint32_t sub = lm_f32_bits(lm_bits_f32(x) + 0.5f) - 0x3F000000u;
    uint32_t h = x < 0x38800000u ? sub : normal;
    h = x >= 0x477FF000u ? 0x7C00u : h;  // 65520 and up round to Inf
    h |= sign;
    h = x > 0x7F800000u ? LM_F16_NAN : h;
    return (uint16_t)h;
}

// f, or the canonical NaN when f is a NaN: the float32 a conversion to F32 writes.
LM_HD static inline float lm_f32_canonical(float f)
{
    uint32_t u = lm_f32_bits(f);
    return lm_bits_f32((u & 0x7FFFFFFFu) > 0x7F800000u ? LM_F32_NAN : u);
}

// ---- bulk conversions -----------------------------------------------------------------------

// How many of some values are NaN and how many are ±Inf.
typedef struct lm_nonfinite {
    uint64_t nan;
    uint64_t inf;
} lm_nonfinite;

// Converts n elements of `src` (type `dt`, little-endian, any alignment) to float32 in `dst`.
// Returns LM_ERR_UNSUPPORTED (message naming the dtype) when dt is not readable.
lm_status lm_convert_to_f32(float *dst, const void *src, lm_dtype dt, int64_t n, lm_err *err);

// lm_convert_to_f32 into a new array (free with free()); NULL with *err set (LM_ERR_NOMEM, or
// as lm_convert_to_f32) on failure.
float *lm_convert_to_f32_new(const void *src, lm_dtype dt, int64_t n, lm_err *err);

// Converts n float32 values to `dt` (F32, F16 or BF16) into `dst` (any alignment), rounding
// to nearest even, every NaN written as the dtype's canonical NaN (for F32, dst may equal src).
// Returns LM_ERR_UNSUPPORTED when dt is not writable.
lm_status lm_convert_from_f32(void *dst, lm_dtype dt, const float *src, int64_t n, lm_err *err);

// lm_convert_to_f32, also adding to *nf the NaN and Inf among the float32 values written (an
// F64 value beyond float32's range counts as the Inf it becomes). The loop that converts keeps
// the largest magnitude it meets beside; only a run of values holding NaN or Inf is read again
// to count them, so clean data costs no pass of its own.
lm_status lm_convert_to_f32_nf(float *dst, const void *src, lm_dtype dt, int64_t n, lm_nonfinite *nf, lm_err *err);

// lm_convert_from_f32, also adding to *nf the NaN and Inf among the values written in `dt` (a
// finite float32 that rounds to Inf in F16 or BF16 counts as Inf).
lm_status lm_convert_from_f32_nf(void *dst, lm_dtype dt, const float *src, int64_t n, lm_nonfinite *nf, lm_err *err);

// Adds to *nf the NaN and Inf among n elements of `src` (dtype dt, any alignment) as
// lm_convert_to_f32_nf counts them; nothing for a dtype that is not readable.
void lm_count_nonfinite(const void *src, lm_dtype dt, int64_t n, lm_nonfinite *nf);

#ifdef __cplusplus
}
#endif

#endif
