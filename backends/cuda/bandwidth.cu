// The host <-> device copy bandwidth the GPU benchmark compares llmerge's transfers with:
// cudaMemcpy between pinned host memory and device memory, the best a plain copy achieves.
#include <cuda_runtime.h>

#include <string.h>
#include <time.h>

#include "cuda_check.h"
#include "kernels.h"

static double seconds(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

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
        double t = seconds();
        for (int i = 0; i < reps; i++)
            CUDA_TRY(cudaMemcpy(dev, host, bytes, cudaMemcpyHostToDevice));
        *h2d = (double)bytes * reps / (seconds() - t);
        t = seconds();
        for (int i = 0; i < reps; i++)
            CUDA_TRY(cudaMemcpy(host, dev, bytes, cudaMemcpyDeviceToHost));
        *d2h = (double)bytes * reps / (seconds() - t);
    }
fail:
    if (dev)
        cudaFree(dev);
    if (host)
        cudaFreeHost(host);
    return status;
}
