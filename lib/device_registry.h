// The device registry: opening a device by the name a user gives (--device), the one place
// that knows every backend this build has (the CPU, the simulated accelerator, the emulated CUDA
// device, CUDA when it is built). It is the llmerge_devices library, above the core and the backends, so that neither
// the dispatcher (device.c) nor a backend calls another: a program that opens devices by name
// includes this header and links that library; code that is handed a device needs device.h
// only.
#ifndef LM_DEVICE_REGISTRY_H
#define LM_DEVICE_REGISTRY_H

#include <stddef.h>
#include <stdint.h>

#include "device.h"

// How lm_dev_open opens a device.
typedef struct lm_dev_opts {
    int threads;           // CPU threads the device uses for host-side work (0: all cores)
    uint64_t mem_cap;      // the most bytes llmerge takes on an accelerator (--gpu-mem; 0: no cap)
    const char *sim_fail;  // the sim device's fault switch ("alloc:N" or "launch:N"; NULL or ""
                           // for none): the command line takes it from LLMERGE_SIM_FAIL
} lm_dev_opts;

// Opens a device from a --device value: "cpu"; "cuda" or "cuda:N" (CUDA device N, default 0);
// "sim:SIZE", the simulated accelerator with a budget of SIZE bytes (lm_parse_size's syntax,
// further capped by mem_cap); "cuda-emu" or "cuda-emu:SIZE", the CUDA backend on an emulated GPU
// of SIZE bytes (1 GiB by default; its failures from LLMERGE_EMU_FAIL, cuda_emu.h); or "auto":
// CUDA device 0 when this build has CUDA, the device exists and passes lm_cuda_selftest, else
// the CPU (never cuda-emu). When `why` is not NULL it receives one line saying what was chosen
// and why (for auto) or what was opened. Unknown, malformed or unavailable devices are
// LM_ERR_USAGE naming them. Free with lm_dev_destroy.
lm_status lm_dev_open(lm_dev **out, const char *spec, const lm_dev_opts *o, char *why, size_t why_size,
                      lm_err *err);

#endif
