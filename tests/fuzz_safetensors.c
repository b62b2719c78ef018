// libFuzzer target for the safetensors reader: any byte string must be either accepted with
// every tensor inside the buffer and consistent sizes, or rejected with LM_ERR_FORMAT and a
// message; never a crash, a leak or an out-of-bounds read (run under ASan and UBSan).
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "safetensors.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    lm_err err = {0};
    lm_st_file *f = NULL;
    lm_status s = lm_st_parse(&f, data, size, "fuzz", &err);
    if (s != LM_OK) {
        if (s != LM_ERR_FORMAT || f != NULL || err.msg[0] == '\0')
            abort();
        return 0;
    }
    uint64_t covered = 0;
    for (int64_t i = 0; i < f->n_tensors; i++) {
        const lm_st_tensor *t = &f->tensors[i];
        if (t->begin != covered || t->end > f->data_size || lm_st_find(f, t->name) != t)
            abort();
        covered = t->end;
        // Touch the first and last byte of each tensor so ASan sees any bad view.
        if (t->nbytes) {
            volatile uint8_t x = ((const uint8_t *)t->data)[0];
            x = ((const uint8_t *)t->data)[t->nbytes - 1];
            (void)x;
        }
        if (lm_dtype_readable(t->dtype) && t->numel <= 4096) {
            float *buf = malloc((size_t)(t->numel ? t->numel : 1) * sizeof *buf);
            if (buf && lm_st_read_f32(t, buf, &err) != LM_OK)
                abort();
            free(buf);
        }
    }
    if (covered != f->data_size)
        abort();
    lm_st_close(f);
    return 0;
}
