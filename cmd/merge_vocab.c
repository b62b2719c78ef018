// llmerge run's vocabulary rebuild: the inputs of a merge whose models' tokenizers put tokens at
// other ids than the output's vocabulary (a tokenizer_source of another vocabulary, or a model
// whose tokenizer differs from it). Before the FTs are checked against the base, each full
// model's embedding and output matrices (the base's 2-D tensors with config.json's vocab_size
// rows, and the same tensors of each model) are rebuilt to the output's ids (lib/embed_perm.h)
// into a temporary file beside OUT that has no name (removed as it is made, so that nothing is
// ever left behind), mapped, and put in the model's place (lm_model_overlay). The merge then
// runs on the rebuilt matrices as on any other tensor, in bounded memory.
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "embed_perm.h"
#include "merge_args.h"
#include "util.h"
#include "vocab.h"

// A new file with no name in directory `dir`, open for reading and writing; -1 and err set.
static int unnamed_file(const char *dir, lm_err *err)
{
    int fd = -1;
#ifdef O_TMPFILE
    fd = open(dir, O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
    if (fd >= 0)
        return fd;
#endif
    // a file system without O_TMPFILE: a named file, unlinked at once
    char *tmpl = lm_path_join(dir, ".llmerge-vocab-XXXXXX");
    if (!tmpl) {
        lm_err_set(err, LM_ERR_NOMEM, "out of memory");
        return -1;
    }
    fd = mkostemp(tmpl, O_CLOEXEC);
    if (fd >= 0)
        unlink(tmpl);
    else
        lm_err_set(err, LM_ERR_IO, "%s: cannot create a temporary file for the rebuilt embeddings: %s", dir,
                   strerror(errno));
    free(tmpl);
    return fd;
}

// Whether `name` is one of the n names.
static bool listed(const char *name, const char *const *names, int n)
{
    for (int k = 0; name && k < n; k++)
        if (strcmp(name, names[k]) == 0)
            return true;
    return false;
}

// An adapter may not change a rebuilt matrix: its rows are the base's before the rebuild.
static lm_status check_adapter(const lm_ft *ft, const char *const *names, int n, const char *source, lm_err *err)
{
    const lm_adapter *ad = ft->adapter;
    for (int64_t i = 0; i < ad->n_modules; i++)
        if (listed(ad->modules[i].base_name, names, n))
            return lm_err_set(err, LM_ERR_UNSUPPORTED, "%s: its LoRA module '%s' changes %s, whose rows are rebuilt to "
                              "the output's vocabulary (%s): an adapter's rows cannot be moved with them",
                              ft->path, ad->modules[i].path, ad->modules[i].base_name, source);
    for (int64_t i = 0; i < ad->n_saved; i++)
        if (listed(ad->saved[i].base_name, names, n))
            return lm_err_set(err, LM_ERR_UNSUPPORTED, "%s: it saves %s whole (modules_to_save), whose rows are rebuilt "
                              "to the output's vocabulary (%s): an adapter's rows cannot be moved with them",
                              ft->path, ad->saved[i].base_name, source);
    return LM_OK;
}

// Prefixes err with FT i as lm_merge_input_where names it.
static void ft_prefix(const merge_args *a, int i, lm_err *err)
{
    lm_err_prefix(err, "%s", lm_merge_input_where(a, 1 + i));
}

lm_status lm_cmd_vocab_open(const merge_args *a, lm_model *base, lm_ft **fts, bool data, lm_progress *p,
                            lm_err *err)
{
    const char *source = a->vocab_source;
    int n_ft = a->n_ft, n_models = 1;
    lm_model **models = calloc((size_t)n_ft + 1, sizeof *models);
    int *slot = calloc((size_t)n_ft + 1, sizeof *slot);  // FT i's model: models[slot[i]], or 0: an adapter
    lm_vocab **vocabs = calloc((size_t)n_ft + 1, sizeof *vocabs);
    int64_t *rows = calloc((size_t)n_ft + 1, sizeof *rows);
    const char **names = NULL;
    const lm_st_tensor **t = NULL;
    lm_embed_perm *perm = NULL;
    char *dir = lm_path_parent(a->out);
    int n_names = 0, fd = -1;
    lm_status s = LM_OK;
    if (!models || !slot || !vocabs || !rows || !dir) {
        s = lm_err_set(err, LM_ERR_NOMEM, "out of memory");
        goto done;
    }
    models[0] = base;
    rows[0] = base->config.vocab_size;
    if (rows[0] <= 0) {
        s = lm_err_set(err, LM_ERR_UNSUPPORTED, "%s: config.json has no vocab_size: the embeddings cannot be rebuilt "
                       "to the output's vocabulary (%s)", base->dir, source);
        goto done;
    }
    // the matrices with a row per token: the base's 2-D tensors of vocab_size rows
    if (!(names = calloc((size_t)base->n_tensors, sizeof *names))) {
        s = lm_err_set(err, LM_ERR_NOMEM, "out of memory");
        goto done;
    }
    for (int64_t i = 0; i < base->n_tensors; i++)
        if (base->tensors[i]->ndim == 2 && base->tensors[i]->shape[0] == rows[0])
            names[n_names++] = base->tensors[i]->name;
    if (n_names == 0) {
        s = lm_err_set(err, LM_ERR_UNSUPPORTED, "%s: no tensor has vocab_size (%" PRId64 ") rows: no embedding to "
                       "rebuild to the output's vocabulary (%s)", base->dir, rows[0], source);
        goto done;
    }
    if ((s = lm_vocab_load_dir(&vocabs[0], base->dir, true, NULL, err)) != LM_OK)
        goto done;
    if (!vocabs[0]) {
        s = lm_err_set(err, LM_ERR_UNSUPPORTED, "%s: no tokenizer.json: its rows cannot be matched to the output's "
                       "vocabulary (%s)", base->dir, source);
        goto done;
    }

    // the FTs: adapters opened as usual (and kept off the rebuilt matrices), models opened here
    for (int i = 0; i < n_ft; i++) {
        lm_input_kind kind;
        char *resolved = NULL;
        if ((s = lm_input_detect(a->fts[i], &kind, &resolved, err)) != LM_OK) {
            ft_prefix(a, i, err);
            goto done;
        }
        if (kind != LM_INPUT_MODEL) {
            free(resolved);
            if ((s = lm_ft_open(&fts[i], a->fts[i], base, err)) != LM_OK ||
                (s = check_adapter(fts[i], names, n_names, source, err)) != LM_OK) {
                ft_prefix(a, i, err);
                goto done;
            }
            continue;
        }
        lm_model *m = NULL;
        s = lm_model_open(&m, resolved, err);
        free(resolved);
        if (s != LM_OK) {
            ft_prefix(a, i, err);
            goto done;
        }
        slot[i] = n_models;
        models[n_models] = m;
        rows[n_models] = m->config.vocab_size;
        if ((s = lm_vocab_load_dir(&vocabs[n_models], m->dir, true, NULL, err)) != LM_OK) {
            ft_prefix(a, i, err);
            goto done;
        }
        n_models++;
        if (rows[n_models - 1] <= 0) {
            s = lm_err_set(err, LM_ERR_UNSUPPORTED, "%s %s: config.json has no vocab_size: its embeddings cannot "
                           "be rebuilt to the output's vocabulary (%s)", a->input_name[1 + i], m->dir, source);
            goto done;
        }
        for (int k = 0; k < n_names; k++) {
            const lm_st_tensor *mine = lm_model_find(m, names[k]), *b = lm_model_find(base, names[k]);
            if (!mine || mine->ndim != 2 || mine->shape[0] != m->config.vocab_size || mine->shape[1] != b->shape[1]) {
                char want[64], got[64];
                snprintf(want, sizeof want, "[%" PRId64 ", %" PRId64 "]", m->config.vocab_size, b->shape[1]);
                if (mine)
                    lm_st_shape_str(mine->shape, mine->ndim, got, sizeof got);
                s = lm_err_set(err, LM_ERR_MISMATCH, "%s %s: tensor '%s' is %s%s; a model of vocab_size %" PRId64
                               " whose embeddings are rebuilt to the output's vocabulary (%s) needs it %s",
                               a->input_name[1 + i], m->dir, names[k], mine ? "" : "missing", mine ? got : "",
                               m->config.vocab_size, source, want);
                goto done;
            }
        }
    }

    if ((s = lm_embed_perm_make(&perm, a->vocab, (const lm_vocab *const *)vocabs, rows, n_models,
                                a->vocab_prefer_base, err)) != LM_OK)
        goto done;
    if (!(t = malloc((size_t)n_names * (size_t)n_models * sizeof *t))) {
        s = lm_err_set(err, LM_ERR_NOMEM, "out of memory");
        goto done;
    }
    for (int k = 0; k < n_names; k++)
        for (int j = 0; j < n_models; j++)
            t[k * n_models + j] = lm_model_find(models[j], names[k]);
    // each model's rebuilt matrices in place of its own (t keeps pointing at the originals)
    for (int j = n_models - 1; j >= 0; j--) {
        char label[LM_ERR_MSG_MAX / 2];
        snprintf(label, sizeof label, "%s's embeddings rebuilt to the output's vocabulary (a file without a name in "
                 "%s)", models[j]->dir, dir);
        lm_st_file *f = NULL;
        if ((fd = unnamed_file(dir, err)) < 0) {
            s = err->status != LM_OK ? err->status : LM_ERR_IO;
            goto done;
        }
        if ((s = lm_embed_perm_write(perm, j, t, names, n_names, fd, data, label, err)) != LM_OK ||
            (s = lm_st_open_fd(&f, fd, label, err)) != LM_OK ||
            (s = lm_model_overlay(models[j], f, perm->n_rows, err)) != LM_OK)
            goto done;
        close(fd);
        fd = -1;
    }
    for (int i = 0; i < n_ft; i++)
        if (slot[i]) {
            s = lm_ft_of_model(&fts[i], models[slot[i]], base, err);
            models[slot[i]] = NULL;  // fts[i] has it, or freed it
            if (s != LM_OK) {
                ft_prefix(a, i, err);
                goto done;
            }
        }

    lm_progress_note(p, "vocabulary: %d embedding tensor%s of each model rebuilt to the %" PRId64 " ids of %s; of "
                     "the tokens some model lacks, %" PRId64 " from the only model that has them, %" PRId64 " from "
                     "the base, %" PRId64 " averaged, %" PRId64 " in no model (zeros)", n_names,
                     n_names == 1 ? "" : "s", perm->n_rows, source, perm->n_single, perm->n_base, perm->n_average,
                     perm->n_none);
    for (int j = 0; j < n_models; j++) {
        int ft = 0;  // input 0 the base, 1 + i FT i
        for (int i = 0; i < n_ft; i++)
            ft = slot[i] == j && j > 0 ? i + 1 : ft;
        const char *who = a->input_name[ft];
        lm_progress_note(p, "vocabulary: %s has %" PRId64 " of the %" PRId64 " tokens (%" PRId64 " at other ids)", who,
                         perm->n_own[j], perm->n_tokens, perm->n_moved[j]);
    }

done:
    if (fd >= 0)
        close(fd);
    for (int j = 1; models && j < n_models; j++)
        lm_model_free(models[j]);
    for (int j = 0; vocabs && j < n_models; j++)
        lm_vocab_free(vocabs[j]);
    lm_embed_perm_free(perm);
    free(models);
    free(slot);
    free(vocabs);
    free(rows);
    free(names);
    free(t);
    free(dir);
    return s;
}
