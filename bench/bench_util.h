// What the benchmark programs share. Static functions; each program includes this once.
#ifndef LM_BENCH_UTIL_H
#define LM_BENCH_UTIL_H

#include <limits.h>
#include <string.h>
#include <unistd.h>

#include "util.h"

// llmerge in the directory of this program (both live in the build directory).
static char *bench_default_llmerge(void)
{
    char self[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n <= 0)
        return lm_strdup("./llmerge");
    self[n] = '\0';
    char *slash = strrchr(self, '/');
    if (slash)
        *slash = '\0';
    return lm_path_join(self, "llmerge");
}

#endif
