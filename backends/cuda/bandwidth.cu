// The host <-> device copy bandwidth the GPU benchmark compares llmerge's transfers with:
// cudaMemcpy between pinned host memory and device memory, the best a plain copy achieves.
#include <cuda_runtime.h>

#include <string.h>

extern "C" {
#include "util.h"
}

#include "cuda_check.h"
#include "kernels.h"

extern "C" lm_status lm_cuda_memcpy_bandwidth(int device, size_t bytes, int reps, double *h2d, double *d2h,
                                              lm_err *err)
{
    lm_status status = LM_OK;
    void *host = NULL, *dev = NULL;
    *h2d = *d2h = 0;
    CUDA_TRY(cudaSetDevice(device));
    CUDA_TRY(cudaHostAlloc(&host, bytes, cudaHostAllocDefault));
    CUDA_TRY(cudaMalloc(&dev, bytes));
    memset(host, 1, bytes);
    // one copy each way to warm up, then the timed ones
    CUDA_TRY(cudaMemcpy(dev, host, bytes, cudaMemcpyHostToDevice));
    CUDA_TRY(cudaMemcpy(host, dev, bytes, cudaMemcpyDeviceToHost));
    {
        double t = lm_now();
        for (int i = 0; i < reps; i++)
            CUDA_TRY(cudaMemcpy(dev, host, bytes, cudaMemcpyHostToDevice));
        *h2d = (double)bytes * reps / (lm_now() - t);
        t = lm_now();
        for (int i = 0; i < reps; i++)
            CUDA_TRY(cudaMemcpy(host, dev, bytes, cudaMemcpyDeviceToHost));
        *d2h = (double)bytes * reps / (lm_now() - t);
    }
fail:
    if (dev)
        cudaFree(dev);
    if (host)
        cudaFreeHost(host);
    return status;
}
