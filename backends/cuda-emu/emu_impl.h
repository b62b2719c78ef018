// What the parts of the emulated CUDA device (backends/cuda-emu/) share among themselves: the
// runtime's state and error recording (runtime.cpp), the block runner (fiber.cpp), the library
// wrappers (libs.cpp). C++ only; nothing outside backends/cuda-emu/ includes it.
#ifndef LM_EMU_IMPL_H
#define LM_EMU_IMPL_H

#include <cuda_runtime.h>

namespace lm_emu {

// Runs every block of `grid` (at most `max_blocks` of them, the rest left to the grid-stride
// loops) with `block` threads as fibers on the calling OS thread, shmem bytes of dynamic shared
// memory each; the threads in thread order, or in an order drawn from `seed` when it is not 0.
// False, with a message in why, when the kernel deadlocked (a barrier or a warp operation some
// threads never reach).
bool run_grid(const char *name, dim3 grid, dim3 block, size_t shmem, unsigned max_blocks, uint64_t seed,
              void (*body)(void *), void *arg, char *why, size_t why_size);

// Sets the error cudaGetLastError returns next; a sticky one poisons the device for good.
cudaError_t set_error(cudaError_t e);
void set_sticky(cudaError_t e);

// Device memory: whether [p, p + n) lies inside one live allocation.
bool is_device(const void *p, size_t n);

// Whether LLMERGE_EMU_FAIL makes the library `soname` (a file name) missing.
bool lib_missing(const char *soname);

// Runs all queued work (the library calls, which run at once, wait for it first).
void wait_idle(void);

// Takes and returns bytes of the budget for the libraries' own workspaces (cuBLAS, cuSOLVER):
// false when the budget has not `n` bytes left.
bool take_bytes(size_t n);
void give_bytes(size_t n);

// Sets up the device for a new lm_dev: a budget of `budget` bytes and the failures `fail`
// injects (LLMERGE_EMU_FAIL's syntax, NULL or "" for none); counters and errors start afresh.
// False, with why, when `fail` is malformed or a device is open already (there is one device per
// process, as there is one GPU).
bool open_device(uint64_t budget, const char *fail, char *why, size_t why_size);

// What the device counted since it opened: cudaMalloc calls, kernel launches, host waits for a
// stream or the device (cudaStreamSynchronize, cudaDeviceSynchronize, cudaFree), cudaFree calls.
void stats(uint64_t counts[4]);

// Ends the device open_device began: what is still allocated stays valid until freed.
void close_device(void);

}  // namespace lm_emu

#endif
