// The emulated CUDA device, cuda-emu: the real CUDA backend (backends/cuda/*.cu) compiled with
// the host C++ compiler against an emulation of the CUDA runtime, cuBLAS and cuSOLVER of the
// project's own (backends/cuda-emu/), so that the backend's kernels and host code run, and are
// tested, on machines without a GPU. Kernels run block by block with their threads as fibers:
// barriers, shared memory and warp operations behave as on a GPU for the interleaving the
// emulator uses. It is a device for testing (docs/devices.md says what it proves and what it
// cannot); --device auto never picks it.
#ifndef LM_CUDA_EMU_H
#define LM_CUDA_EMU_H

#include <stdint.h>

#include "device.h"
#include "status.h"

#ifdef __cplusplus
extern "C" {
#endif

// Opens the emulated device with `budget` bytes of device memory (cudaMemGetInfo's total;
// cudaMalloc beyond it is cudaErrorMemoryAllocation, which the backend turns into
// LM_ERR_DEVICE_OOM) and at most mem_cap of them for llmerge (0: no cap), running the host side
// on `threads` threads. `fail` injects failures: "alloc-oom:N" (the Nth cudaMalloc runs out of
// memory), "launch-oom:N" (the Nth kernel launch is refused for lack of memory),
// "launch-fault:N" (the Nth kernel faults and poisons the device), "driver-old" (the driver is
// older than the runtime), "no-cublas", "no-cusolver" (the library cannot be loaded), several
// joined by '|'; NULL or "" for none, anything else LM_ERR_USAGE. One emulated device may be open at a time
// (LM_ERR_USAGE otherwise). The device is named "cuda-emu:SIZE" after its budget. The caller
// frees it with lm_dev_destroy.
lm_status lm_dev_cuda_emu_create(lm_dev **out, uint64_t budget, uint64_t mem_cap, const char *fail, int threads,
                                 lm_err *err);

// What the emulated device does without, as lm_cuda_device_note says it for CUDA (kernels.h),
// or NULL (cuda_tail.inc).
const char *lm_cuda_emu_note(lm_dev *d);

// What the emulated device opened last has counted since it opened, for the tests. syncs counts every host wait for a whole stream or the device (cudaStreamSynchronize,
// cudaDeviceSynchronize, and cudaFree, which waits for the device), frees the cudaFree calls.
typedef struct lm_cuda_emu_stats {
    uint64_t allocs;    // cudaMalloc (and cudaMallocAsync) calls
    uint64_t launches;  // kernel launches
    uint64_t syncs;
    uint64_t frees;
} lm_cuda_emu_stats;
void lm_cuda_emu_get_stats(lm_cuda_emu_stats *out);

#ifdef __cplusplus
}
#endif

#endif
