// A type-only stand-in for cuSOLVER's dense header, for the CUDA backend compiled onto the
// emulated device (backends/cuda-emu/): the types and status codes the backend names. The
// functions are reached through the backend's function table (cuda_libs.h), which the emulator
// fills with its LAPACKE wrappers (libs.cpp).
#ifndef LM_EMU_CUSOLVERDN_H
#define LM_EMU_CUSOLVERDN_H

#include <cublas_v2.h>

#define CUSOLVER_VER_MAJOR 11
#define CUSOLVER_VER_MINOR 7

typedef enum {
    CUSOLVER_STATUS_SUCCESS = 0,
    CUSOLVER_STATUS_NOT_INITIALIZED = 1,
    CUSOLVER_STATUS_ALLOC_FAILED = 2,
    CUSOLVER_STATUS_INVALID_VALUE = 3,
    CUSOLVER_STATUS_ARCH_MISMATCH = 4,
    CUSOLVER_STATUS_MAPPING_ERROR = 5,
    CUSOLVER_STATUS_EXECUTION_FAILED = 6,
    CUSOLVER_STATUS_INTERNAL_ERROR = 7,
    CUSOLVER_STATUS_NOT_SUPPORTED = 9
} cusolverStatus_t;

typedef struct lm_emu_cusolver *cusolverDnHandle_t;
typedef struct lm_emu_cusolver_params *cusolverDnParams_t;

#endif
