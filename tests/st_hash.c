// st_hash: xxHash64 (seed 0) for the end-to-end tests, computed independently of the code that
// writes llmerge.json. `st_hash FILE.safetensors...` prints "NAME HEX" for every tensor of each
// file, HEX being the hash of the tensor's data bytes as 16 hex digits; `st_hash --file PATH...`
// prints "HEX PATH" for each whole file. Exit status: 0 done, 1 a file could not be read, 2
// usage.
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "safetensors.h"
#include "util.h"

int main(int argc, char **argv)
{
    if (argc < 2 || (strcmp(argv[1], "--file") == 0 && argc < 3)) {
        fprintf(stderr, "usage: st_hash FILE.safetensors... | st_hash --file PATH...\n");
        return 2;
    }
    lm_err err = {0};
    if (strcmp(argv[1], "--file") == 0) {
        for (int i = 2; i < argc; i++) {
            uint64_t h;
            if (lm_xxh64_file(argv[i], &h, &err) != LM_OK) {
                fprintf(stderr, "st_hash: %s\n", err.msg);
                return 1;
            }
            printf("%016" PRIx64 " %s\n", h, argv[i]);
        }
        return 0;
    }
    for (int i = 1; i < argc; i++) {
        lm_st_file *f = NULL;
        if (lm_st_open(&f, argv[i], &err) != LM_OK) {
            fprintf(stderr, "st_hash: %s\n", err.msg);
            return 1;
        }
        for (int64_t t = 0; t < f->n_tensors; t++)
            printf("%s %016" PRIx64 "\n", f->tensors[t].name,
                   lm_xxh64(f->tensors[t].data, f->tensors[t].nbytes));
        lm_st_close(f);
    }
    return 0;
}
