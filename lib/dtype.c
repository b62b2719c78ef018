// Element types and float32 conversions: see dtype.h.
#include "dtype.h"

#include "util.h"

#include <stdlib.h>
#include <string.h>

static const struct { const char *name; unsigned bits; } dtype_info[LM_DTYPE_COUNT] = {
    [LM_DTYPE_BOOL] = {"BOOL", 8},
    [LM_DTYPE_F4] = {"F4", 4},
    [LM_DTYPE_F6_E2M3] = {"F6_E2M3", 6},
    [LM_DTYPE_F6_E3M2] = {"F6_E3M2", 6},
    [LM_DTYPE_U8] = {"U8", 8},
    [LM_DTYPE_I8] = {"I8", 8},
    [LM_DTYPE_F8_E5M2] = {"F8_E5M2", 8},
    [LM_DTYPE_F8_E4M3] = {"F8_E4M3", 8},
    [LM_DTYPE_F8_E8M0] = {"F8_E8M0", 8},
    [LM_DTYPE_F8_E4M3FNUZ] = {"F8_E4M3FNUZ", 8},
    [LM_DTYPE_F8_E5M2FNUZ] = {"F8_E5M2FNUZ", 8},
    [LM_DTYPE_I16] = {"I16", 16},
    [LM_DTYPE_U16] = {"U16", 16},
    [LM_DTYPE_F16] = {"F16", 16},
    [LM_DTYPE_BF16] = {"BF16", 16},
    [LM_DTYPE_I32] = {"I32", 32},
    [LM_DTYPE_U32] = {"U32", 32},
    [LM_DTYPE_F32] = {"F32", 32},
    [LM_DTYPE_C64] = {"C64", 64},
    [LM_DTYPE_F64] = {"F64", 64},
    [LM_DTYPE_I64] = {"I64", 64},
    [LM_DTYPE_U64] = {"U64", 64},
};

const char *lm_dtype_name(lm_dtype dt)
{
    return (unsigned)dt < LM_DTYPE_COUNT ? dtype_info[dt].name : "?";
}

bool lm_dtype_from_name(const char *name, size_t len, lm_dtype *out)
{
    for (int i = 0; i < LM_DTYPE_COUNT; i++) {
        if (strlen(dtype_info[i].name) == len && memcmp(dtype_info[i].name, name, len) == 0) {
            *out = (lm_dtype)i;
            return true;
        }
    }
    return false;
}

bool lm_dtype_from_user(const char *name, lm_dtype *out)
{
    static const struct { const char *name; lm_dtype dt; } names[] = {
        {"f32", LM_DTYPE_F32}, {"F32", LM_DTYPE_F32}, {"float32", LM_DTYPE_F32}, {"float", LM_DTYPE_F32},
        {"f16", LM_DTYPE_F16}, {"F16", LM_DTYPE_F16}, {"float16", LM_DTYPE_F16}, {"half", LM_DTYPE_F16},
        {"bf16", LM_DTYPE_BF16}, {"BF16", LM_DTYPE_BF16}, {"bfloat16", LM_DTYPE_BF16},
        {"f64", LM_DTYPE_F64}, {"F64", LM_DTYPE_F64}, {"float64", LM_DTYPE_F64}, {"double", LM_DTYPE_F64},
    };
    const char *n = strncmp(name, "torch.", 6) == 0 ? name + 6 : name;
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        if (strcmp(names[i].name, n) == 0) {
            *out = names[i].dt;
            return true;
        }
    }
    return false;
}

unsigned lm_dtype_bits(lm_dtype dt)
{
    return (unsigned)dt < LM_DTYPE_COUNT ? dtype_info[dt].bits : 0;
}

bool lm_dtype_readable(lm_dtype dt)
{
    return dt == LM_DTYPE_F32 || dt == LM_DTYPE_F16 || dt == LM_DTYPE_BF16 || dt == LM_DTYPE_F64;
}

bool lm_dtype_writable(lm_dtype dt)
{
    return dt == LM_DTYPE_F32 || dt == LM_DTYPE_F16 || dt == LM_DTYPE_BF16;
}

// Unaligned little-endian loads and stores: memcpy compiles to a plain (vector) move.
static inline uint16_t load16(const unsigned char *p, int64_t i)
{
    uint16_t v;
    memcpy(&v, p + 2 * i, 2);
    return v;
}

static inline void store16(unsigned char *p, int64_t i, uint16_t v)
{
    memcpy(p + 2 * i, &v, 2);
}

LM_VECTOR_CLONES lm_status lm_convert_to_f32(float *dst, const void *src, lm_dtype dt, int64_t n, lm_err *err)
{
    const unsigned char *s = src;
    switch (dt) {
    case LM_DTYPE_F32:
        memmove(dst, src, (size_t)n * 4);
        return LM_OK;
    case LM_DTYPE_BF16:
        for (int64_t i = 0; i < n; i++)
            dst[i] = lm_bf16_to_f32(load16(s, i));
        return LM_OK;
    case LM_DTYPE_F16:
        for (int64_t i = 0; i < n; i++)
            dst[i] = lm_f16_to_f32(load16(s, i));
        return LM_OK;
    case LM_DTYPE_F64:
        for (int64_t i = 0; i < n; i++) {
            double d;
            memcpy(&d, s + 8 * i, 8);
            dst[i] = (float)d;
        }
        return LM_OK;
    default:
        return lm_err_set(err, LM_ERR_UNSUPPORTED,
                          "dtype %s cannot be computed with (llmerge reads F32, F16, BF16 and F64)",
                          lm_dtype_name(dt));
    }
}

float *lm_convert_to_f32_new(const void *src, lm_dtype dt, int64_t n, lm_err *err)
{
    float *v = malloc((size_t)(n > 0 ? n : 1) * sizeof *v);
    if (!v) {
        lm_err_set(err, LM_ERR_NOMEM, "out of memory");
        return NULL;
    }
    if (lm_convert_to_f32(v, src, dt, n, err) != LM_OK) {
        free(v);
        return NULL;
    }
    return v;
}

LM_VECTOR_CLONES lm_status lm_convert_from_f32(void *dst, lm_dtype dt, const float *src, int64_t n, lm_err *err)
{
    unsigned char *d = dst;
    switch (dt) {
    case LM_DTYPE_F32:
        for (int64_t i = 0; i < n; i++) {
            float v = lm_f32_canonical(src[i]);
            memcpy(d + 4 * i, &v, 4);
        }
        return LM_OK;
    case LM_DTYPE_BF16:
        for (int64_t i = 0; i < n; i++)
            store16(d, i, lm_f32_to_bf16(src[i]));
        return LM_OK;
    case LM_DTYPE_F16:
        for (int64_t i = 0; i < n; i++)
            store16(d, i, lm_f32_to_f16(src[i]));
        return LM_OK;
    default:
        return lm_err_set(err, LM_ERR_UNSUPPORTED,
                          "cannot write dtype %s (llmerge writes F32, F16 and BF16)",
                          lm_dtype_name(dt));
    }
}

// ---- counting NaN and Inf ---------------------------------------------------------------------
// A value is ±Inf when its magnitude bits (the sign cleared) equal the Inf pattern of its dtype,
// NaN when they exceed it. The conversion loops keep only the largest magnitude of a run of
// NF_RUN values, one vector maximum beside the conversion, and a run whose largest is Inf or NaN
// (rare) is counted exactly by a pass of its own, while it is still in cache.

#define NF_RUN (1 << 14)

// The exact counts of n values whose magnitude bits are those of F32 (16-bit: F16, BF16) values
// at s, any alignment.
static void exact_f32(const unsigned char *s, int64_t n, lm_nonfinite *nf)
{
    for (int64_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, s + 4 * i, 4);
        u &= 0x7FFFFFFFu;
        nf->nan += u > 0x7F800000u;
        nf->inf += u == 0x7F800000u;
    }
}

static void exact_16(const unsigned char *s, int64_t n, uint32_t inf_bits, lm_nonfinite *nf)
{
    for (int64_t i = 0; i < n; i++) {
        uint32_t a = load16(s, i) & 0x7FFFu;
        nf->nan += a > inf_bits;
        nf->inf += a == inf_bits;
    }
}

#define NF_TOP(top, a) ((top) = (a) > (top) ? (a) : (top))

LM_VECTOR_CLONES static void count_f32_bits(const unsigned char *s, int64_t n, lm_nonfinite *nf)
{
    for (int64_t lo = 0; lo < n; lo += NF_RUN) {
        int64_t hi = n - lo < NF_RUN ? n : lo + NF_RUN;
        uint32_t top = 0;
        for (int64_t i = lo; i < hi; i++) {
            uint32_t u;
            memcpy(&u, s + 4 * i, 4);
            NF_TOP(top, u & 0x7FFFFFFFu);
        }
        if (top >= 0x7F800000u)
            exact_f32(s + 4 * lo, hi - lo, nf);
    }
}

LM_VECTOR_CLONES static void count_16_bits(const unsigned char *s, int64_t n, uint32_t inf_bits, lm_nonfinite *nf)
{
    for (int64_t lo = 0; lo < n; lo += NF_RUN) {
        int64_t hi = n - lo < NF_RUN ? n : lo + NF_RUN;
        uint32_t top = 0;
        for (int64_t i = lo; i < hi; i++)
            NF_TOP(top, (uint32_t)(load16(s, i) & 0x7FFFu));
        if (top >= inf_bits)
            exact_16(s + 2 * lo, hi - lo, inf_bits, nf);
    }
}

void lm_count_nonfinite(const void *src, lm_dtype dt, int64_t n, lm_nonfinite *nf)
{
    const unsigned char *s = src;
    switch (dt) {
    case LM_DTYPE_F32:
        count_f32_bits(s, n, nf);
        return;
    case LM_DTYPE_BF16:
        count_16_bits(s, n, 0x7F80u, nf);
        return;
    case LM_DTYPE_F16:
        count_16_bits(s, n, 0x7C00u, nf);
        return;
    case LM_DTYPE_F64:
        for (int64_t i = 0; i < n; i++) {
            double d;
            memcpy(&d, s + 8 * i, 8);
            uint32_t a = lm_f32_bits((float)d) & 0x7FFFFFFFu;
            nf->nan += a > 0x7F800000u;
            nf->inf += a == 0x7F800000u;
        }
        return;
    default:
        return;
    }
}

LM_VECTOR_CLONES lm_status lm_convert_to_f32_nf(float *dst, const void *src, lm_dtype dt, int64_t n, lm_nonfinite *nf,
                                                lm_err *err)
{
    const unsigned char *s = src;
    if (dt == LM_DTYPE_F32 || dt == LM_DTYPE_F64 || !lm_dtype_readable(dt)) {
        // a copy, or a conversion whose count is by far the smaller part
        lm_status st = lm_convert_to_f32(dst, src, dt, n, err);
        if (st == LM_OK)
            count_f32_bits((const unsigned char *)dst, n, nf);
        return st;
    }
    uint32_t inf_bits = dt == LM_DTYPE_BF16 ? 0x7F80u : 0x7C00u;
    for (int64_t lo = 0; lo < n; lo += NF_RUN) {
        int64_t hi = n - lo < NF_RUN ? n : lo + NF_RUN;
        uint32_t top = 0;
        if (dt == LM_DTYPE_BF16) {
            for (int64_t i = lo; i < hi; i++) {
                uint16_t h = load16(s, i);
                dst[i] = lm_bf16_to_f32(h);
                NF_TOP(top, (uint32_t)(h & 0x7FFFu));
            }
        } else {
            for (int64_t i = lo; i < hi; i++) {
                uint16_t h = load16(s, i);
                dst[i] = lm_f16_to_f32(h);
                NF_TOP(top, (uint32_t)(h & 0x7FFFu));
            }
        }
        if (top >= inf_bits)
            exact_16(s + 2 * lo, hi - lo, inf_bits, nf);
    }
    return LM_OK;
}

LM_VECTOR_CLONES lm_status lm_convert_from_f32_nf(void *dst, lm_dtype dt, const float *src, int64_t n,
                                                  lm_nonfinite *nf, lm_err *err)
{
    unsigned char *d = dst;
    if (dt != LM_DTYPE_BF16 && dt != LM_DTYPE_F16) {
        lm_status st = lm_convert_from_f32(dst, dt, src, n, err);
        if (st == LM_OK)
            count_f32_bits(d, n, nf);
        return st;
    }
    uint32_t inf_bits = dt == LM_DTYPE_BF16 ? 0x7F80u : 0x7C00u;
    for (int64_t lo = 0; lo < n; lo += NF_RUN) {
        int64_t hi = n - lo < NF_RUN ? n : lo + NF_RUN;
        uint32_t top = 0;
        if (dt == LM_DTYPE_BF16) {
            for (int64_t i = lo; i < hi; i++) {
                uint16_t h = lm_f32_to_bf16(src[i]);
                store16(d, i, h);
                NF_TOP(top, (uint32_t)(h & 0x7FFFu));
            }
        } else {
            for (int64_t i = lo; i < hi; i++) {
                uint16_t h = lm_f32_to_f16(src[i]);
                store16(d, i, h);
                NF_TOP(top, (uint32_t)(h & 0x7FFFu));
            }
        }
        if (top >= inf_bits)
            exact_16(d + 2 * lo, hi - lo, inf_bits, nf);
    }
    return LM_OK;
}
