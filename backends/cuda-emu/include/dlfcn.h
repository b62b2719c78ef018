// The system's dlfcn.h, with dlopen, dlsym, dlclose and dlerror redirected to the emulated
// device's library table (libs.cpp), for the CUDA backend compiled onto cuda-emu: its loader
// (cuda_libs.cu) then finds "libcublas.so.N" and "libcusolver.so.N" as the emulator's OpenBLAS
// and LAPACKE wrappers, by the same names and symbols it asks a real system for. C++ only.
#ifndef LM_EMU_DLFCN_H
#define LM_EMU_DLFCN_H

#include_next <dlfcn.h>

namespace lm_emu {
void *emu_dlopen(const char *file, int mode);
void *emu_dlsym(void *handle, const char *name);
int emu_dlclose(void *handle);
char *emu_dlerror(void);
}  // namespace lm_emu

#define dlopen lm_emu::emu_dlopen
#define dlsym lm_emu::emu_dlsym
#define dlclose lm_emu::emu_dlclose
#define dlerror lm_emu::emu_dlerror

#endif
