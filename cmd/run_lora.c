// mergekit's `model: PATH+LORA` for a PATH other than the base: the model at PATH with the LoRA
// adapter merged into it, made once into the cache directory and reused, as mergekit keeps such
// models in its LoRA cache. The entry is `lora-KEY/` (a model directory: the weights, config.json
// and PATH's tokenizer files), KEY the xxHash64 of both inputs' bytes (lib/cache.h's digests), so
// a changed input never meets a stale entry. It is written into a temporary directory beside it
// and renamed into place when complete; the merge is task arithmetic of the adapter onto PATH with
// weight 1 (docs/merging.md), on the CPU, in PATH's dtype.
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cache.h"
#include "device.h"
#include "manifest.h"
#include "merge.h"
#include "merge_args.h"
#include "util.h"

// Merges ft onto model into dir (which exists and is empty).
static lm_status make_model(const lm_model *model, lm_ft *ft, const char *dir, int threads, lm_err *err)
{
    const double w = 1.0;
    lm_merge_opts o = {.method = LM_MERGE_TASK_ARITHMETIC, .n_ft = 1, .weights = &w, .lambda = 1.0,
                       .out_dtype = lm_model_out_dtype(model), .threads = threads, .t = 0.5, .max_iter = 10,
                       .tol = 1e-5, .select_topk = 1.0};
    lm_st_desc *desc = NULL;
    int64_t n = 0;
    lm_st_writer *w_out = NULL;
    lm_dev *dev = NULL;
    lm_merge_result res;
    memset(&res, 0, sizeof res);
    char *cfg = lm_path_join(dir, "config.json");
    lm_status s = cfg ? LM_OK : lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    if (s == LM_OK)
        s = lm_merge_outputs(&o, model, &desc, &n, err);
    if (s == LM_OK)
        s = lm_st_writer_open(&w_out, dir, desc, n, 5000000000ull, NULL, err);
    if (s == LM_OK)
        s = lm_dev_cpu_create(&dev, threads, err);
    if (s == LM_OK)
        s = lm_merge_run(&o, dev, model, &ft, w_out, NULL, &res, err);
    if (s == LM_OK)
        s = lm_st_writer_finish(w_out, err);
    if (s == LM_OK)
        s = lm_manifest_write_config(model->config.path, cfg, o.out_dtype, 0, err);
    if (s == LM_OK)
        s = lm_manifest_copy_side_files(model->dir, dir, NULL, err);
    lm_merge_result_free(&res);
    lm_dev_destroy(dev);
    lm_st_writer_free(w_out);
    free(desc);
    free(cfg);
    return s;
}

lm_status lm_cmd_lora_model(const char *path, const char *lora, const char *cache_dir, int threads, char **out,
                            bool *made, lm_err *err)
{
    *out = NULL;
    *made = false;
    lm_model *model = NULL;
    lm_ft *ft = NULL;
    char *dir = lm_cache_dir(cache_dir), *resolved = NULL, *entry = NULL, *tmp = NULL;
    lm_input_kind kind;
    lm_status s = LM_OK;
    if (!dir) {
        s = lm_err_set(err, LM_ERR_USAGE, "%s+%s: a LoRA adapter on a model other than the base is merged into "
                       "it once, in the cache, and there is none: give --cache-dir (or set XDG_CACHE_HOME or HOME)",
                       path, lora);
        goto done;
    }
    if ((s = lm_input_detect(path, &kind, &resolved, err)) != LM_OK)
        goto done;
    if (kind != LM_INPUT_MODEL) {
        s = lm_err_set(err, LM_ERR_USAGE, "%s+%s: %s is not a model directory", path, lora, path);
        goto done;
    }
    uint64_t dm = 0, da = 0;
    if ((s = lm_model_open(&model, resolved, err)) != LM_OK || (s = lm_ft_open(&ft, lora, model, err)) != LM_OK)
        goto done;
    if (!ft->adapter) {
        s = lm_err_set(err, LM_ERR_USAGE, "%s+%s: %s is not a LoRA adapter", path, lora, lora);
        goto done;
    }
    if ((s = lm_cache_digest_model(model, &dm, err)) != LM_OK || (s = lm_cache_digest_adapter(ft->adapter, &da, err)))
        goto done;
    uint64_t pair[2] = {dm, da};
    if (!(entry = lm_strfmt("%s/lora-%016" PRIx64, dir, lm_xxh64(pair, sizeof pair)))) {
        s = lm_err_set(err, LM_ERR_NOMEM, "out of memory");
        goto done;
    }
    if (lm_is_dir(entry))  // made by an earlier run: complete, since it was renamed into place
        goto done;
    if ((s = lm_mkdir_p(dir, err)) != LM_OK)
        goto done;
    if (!(tmp = lm_strfmt("%s.tmp-XXXXXX", entry))) {
        s = lm_err_set(err, LM_ERR_NOMEM, "out of memory");
        goto done;
    }
    if (!mkdtemp(tmp)) {
        s = lm_err_set(err, LM_ERR_IO, "%s: cannot create a temporary directory in the cache", tmp);
        free(tmp);
        tmp = NULL;
        goto done;
    }
    if ((s = make_model(model, ft, tmp, threads, err)) != LM_OK) {
        lm_err_prefix(err, "merging %s into %s", lora, path);
        goto done;
    }
    if (rename(tmp, entry) != 0 && !lm_is_dir(entry)) {  // another run may have put it there first
        s = lm_err_set(err, LM_ERR_IO, "%s: cannot rename into place", entry);
        goto done;
    }
    *made = true;
done:
    if (tmp && lm_is_dir(tmp)) {
        lm_err e2 = {0};
        lm_rm_rf(tmp, &e2);
    }
    free(tmp);
    lm_ft_free(ft);
    lm_model_free(model);
    free(resolved);
    free(dir);
    if (s == LM_OK)
        *out = entry;
    else
        free(entry);
    return s;
}
