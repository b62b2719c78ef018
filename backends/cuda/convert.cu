// dtype conversion kernels: float32 to and from BF16 and F16 (and F64 in), element-wise with
// grid-stride loops. The per-element code is dtype.h's, shared with the CPU, so results are
// identical bit for bit on both, every NaN written the canonical one. Also the device self-test
// that `--device auto` runs.
#include <cuda_runtime.h>

#include <stdlib.h>
#include <string.h>

#include "cuda_check.h"
#include "kernels.h"

static unsigned grid_for(int64_t n)
{
    return lm_cuda_grid(n, 256);
}

__global__ void k_bf16_to_f32(float *dst, const uint16_t *src, int64_t n)
{
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        dst[i] = lm_bf16_to_f32(src[i]);
}

__global__ void k_f16_to_f32(float *dst, const uint16_t *src, int64_t n)
{
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        dst[i] = lm_f16_to_f32(src[i]);
}

__global__ void k_f64_to_f32(float *dst, const double *src, int64_t n)
{
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        dst[i] = __double2float_rn(src[i]);
}

// An F32 output: the values as they are but for NaNs, which become the canonical NaN (dtype.h),
// so that the NaNs this GPU's arithmetic made (0x7FFFFFFF) and those the CPU's kept from its
// inputs are written the same. dst may equal src.
__global__ void k_f32_canonical(float *dst, const float *src, int64_t n)
{
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        dst[i] = lm_f32_canonical(src[i]);
}

__global__ void k_f32_to_bf16(uint16_t *dst, const float *src, int64_t n)
{
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        dst[i] = lm_f32_to_bf16(src[i]);
}

__global__ void k_f32_to_f16(uint16_t *dst, const float *src, int64_t n)
{
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        dst[i] = lm_f32_to_f16(src[i]);
}

extern "C" lm_status lm_cuda_convert_to_f32(float *d_dst, const void *d_src, lm_dtype dt, int64_t n,
                                            void *stream, lm_err *err)
{
    lm_status status = LM_OK;
    cudaStream_t s = (cudaStream_t)stream;
    if (n == 0)
        return LM_OK;
    switch (dt) {
    case LM_DTYPE_F32:
        CUDA_TRY(cudaMemcpyAsync(d_dst, d_src, (size_t)n * 4, cudaMemcpyDeviceToDevice, s));
        break;
    case LM_DTYPE_BF16:
        k_bf16_to_f32<<<grid_for(n), 256, 0, s>>>(d_dst, (const uint16_t *)d_src, n);
        break;
    case LM_DTYPE_F16:
        k_f16_to_f32<<<grid_for(n), 256, 0, s>>>(d_dst, (const uint16_t *)d_src, n);
        break;
    case LM_DTYPE_F64:
        k_f64_to_f32<<<grid_for(n), 256, 0, s>>>(d_dst, (const double *)d_src, n);
        break;
    default:
        return lm_err_set(err, LM_ERR_UNSUPPORTED, "dtype %s cannot be computed with", lm_dtype_name(dt));
    }
    CUDA_TRY(cudaGetLastError());
fail:
    return status;
}

extern "C" lm_status lm_cuda_convert_from_f32(void *d_dst, lm_dtype dt, const float *d_src, int64_t n,
                                              void *stream, lm_err *err)
{
    lm_status status = LM_OK;
    cudaStream_t s = (cudaStream_t)stream;
    if (n == 0)
        return LM_OK;
    switch (dt) {
    case LM_DTYPE_F32:
        k_f32_canonical<<<grid_for(n), 256, 0, s>>>((float *)d_dst, d_src, n);
        break;
    case LM_DTYPE_BF16:
        k_f32_to_bf16<<<grid_for(n), 256, 0, s>>>((uint16_t *)d_dst, d_src, n);
        break;
    case LM_DTYPE_F16:
        k_f32_to_f16<<<grid_for(n), 256, 0, s>>>((uint16_t *)d_dst, d_src, n);
        break;
    default:
        return lm_err_set(err, LM_ERR_UNSUPPORTED, "cannot write dtype %s", lm_dtype_name(dt));
    }
    CUDA_TRY(cudaGetLastError());
fail:
    return status;
}

extern "C" lm_status lm_cuda_selftest(int device, lm_err *err)
{
    enum { N = 4096 };
    lm_status status = LM_OK;
    float *h_in = NULL, *h_back = NULL, *d_in = NULL, *d_back = NULL;
    uint16_t *h_half = NULL, *d_half = NULL;
    lm_dtype kinds[2] = {LM_DTYPE_BF16, LM_DTYPE_F16};
    uint32_t x = 12345;

    CUDA_TRY(cudaSetDevice(device));
    h_in = (float *)malloc(N * sizeof(float));
    h_back = (float *)malloc(N * sizeof(float));
    h_half = (uint16_t *)malloc(N * sizeof(uint16_t));
    if (!h_in || !h_back || !h_half) {
        status = lm_err_set(err, LM_ERR_NOMEM, "cuda self-test: out of host memory");
        goto fail;
    }
    // Edge cases first (NaN, Inf, signed zeros, subnormals, exact ties), then random bits.
    {
        const uint32_t edge[] = {0x00000000u, 0x80000000u, 0x7F800000u, 0xFF800000u, 0x7FC00000u,
                                 0x7F800001u, 0x00000001u, 0x33800000u, 0x3F808000u, 0x3F818000u,
                                 0x477FF000u, 0x477FEFFFu, 0x387FC000u, 0x7F7FFFFFu, 0xFFC01234u,
                                 0x7FFFFFFFu};
        for (int i = 0; i < N; i++) {
            x ^= x << 13; x ^= x >> 17; x ^= x << 5;
            uint32_t bits = i < (int)(sizeof edge / sizeof edge[0]) ? edge[i] : x;
            h_in[i] = lm_bits_f32(bits);
        }
    }
    CUDA_TRY(cudaMalloc((void **)&d_in, N * sizeof(float)));
    CUDA_TRY(cudaMalloc((void **)&d_back, N * sizeof(float)));
    CUDA_TRY(cudaMalloc((void **)&d_half, N * sizeof(uint16_t)));
    CUDA_TRY(cudaMemcpy(d_in, h_in, N * sizeof(float), cudaMemcpyHostToDevice));
    for (int k = 0; k < 2; k++) {
        if ((status = lm_cuda_convert_from_f32(d_half, kinds[k], d_in, N, NULL, err)) != LM_OK)
            goto fail;
        if ((status = lm_cuda_convert_to_f32(d_back, d_half, kinds[k], N, NULL, err)) != LM_OK)
            goto fail;
        CUDA_TRY(cudaMemcpy(h_half, d_half, N * sizeof(uint16_t), cudaMemcpyDeviceToHost));
        CUDA_TRY(cudaMemcpy(h_back, d_back, N * sizeof(float), cudaMemcpyDeviceToHost));
        for (int i = 0; i < N; i++) {
            uint16_t want = kinds[k] == LM_DTYPE_BF16 ? lm_f32_to_bf16(h_in[i]) : lm_f32_to_f16(h_in[i]);
            float back = kinds[k] == LM_DTYPE_BF16 ? lm_bf16_to_f32(want) : lm_f16_to_f32(want);
            if (h_half[i] != want || lm_f32_bits(h_back[i]) != lm_f32_bits(back)) {
                status = lm_err_set(err, LM_ERR_DEVICE,
                                    "cuda:%d self-test: %s conversion of 0x%08x gave 0x%04x, the CPU 0x%04x",
                                    device, lm_dtype_name(kinds[k]), lm_f32_bits(h_in[i]), h_half[i], want);
                goto fail;
            }
        }
    }
fail:
    cudaFree(d_in);
    cudaFree(d_back);
    cudaFree(d_half);
    free(h_in);
    free(h_back);
    free(h_half);
    return status;
}

// Loaded when a device opens (cuda_check.h).
LM_CUDA_PRELOAD(k_bf16_to_f32);
LM_CUDA_PRELOAD(k_f16_to_f32);
LM_CUDA_PRELOAD(k_f64_to_f32);
LM_CUDA_PRELOAD(k_f32_canonical);
LM_CUDA_PRELOAD(k_f32_to_bf16);
LM_CUDA_PRELOAD(k_f32_to_f16);
