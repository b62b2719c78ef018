// lm_dev_cuda_emu_create (cuda_emu.h): the CUDA backend's own constructor, built for the
// emulator (every extern "C" name of the backend carries an _emu suffix in this build, see
// CMakeLists.txt), on an emulated device set up with its budget and failures. The device keeps
// the backend's interface but for its name (also in the backend's own messages) and its destroy,
// which also closes the emulated device.
#include "emu_impl.h"

#include <stdio.h>

extern "C" {
#include "device_impl.h"
#include "util.h"
}

#include "cuda_emu.h"

// cuda_tail.inc, compiled into the backend's cuda.cu.
extern "C" void lm_cuda_emu_rename(lm_dev *d, const char *name);

static lm_dev_i emu_iface;
static const lm_dev_i *cuda_iface;
static char emu_name[32];

static const char *emu_dev_name(lm_dev *d)
{
    (void)d;
    return emu_name;
}

static void emu_destroy(lm_dev *d)
{
    cuda_iface->destroy(d);
    lm_emu::close_device();
}

extern "C" lm_status lm_dev_cuda_emu_create(lm_dev **out, uint64_t budget, uint64_t mem_cap, const char *fail,
                                            int threads, lm_err *err)
{
    *out = NULL;
    char why[512];
    if (!lm_emu::open_device(budget, fail, why, sizeof why))
        return lm_err_set(err, LM_ERR_USAGE, "%s", why);
    lm_status s = lm_dev_cuda_create(out, 0, mem_cap, threads, err);
    if (s != LM_OK) {
        lm_emu::close_device();
        return s;
    }
    static const char *const units[] = {"", "KiB", "MiB", "GiB", "TiB"};
    uint64_t v = budget;
    int u = 0;
    while (u < 4 && v && v % 1024 == 0) {
        v /= 1024;
        u++;
    }
    snprintf(emu_name, sizeof emu_name, "cuda-emu:%llu%s", (unsigned long long)v, units[u]);
    lm_cuda_emu_rename(*out, emu_name);
    cuda_iface = (*out)->iface;
    emu_iface = *cuda_iface;
    emu_iface.name = emu_dev_name;
    emu_iface.destroy = emu_destroy;
    (*out)->iface = &emu_iface;
    return LM_OK;
}

extern "C" void lm_cuda_emu_get_stats(lm_cuda_emu_stats *out)
{
    uint64_t c[4];
    lm_emu::stats(c);
    out->allocs = c[0];
    out->launches = c[1];
    out->syncs = c[2];
    out->frees = c[3];
}
