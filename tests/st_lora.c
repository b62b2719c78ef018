// st_lora: BASE plus an adapter's change, computed here apart from llmerge's adapter code, against
// a merge of the adapter onto BASE, for the end-to-end round trips of --to-lora.
//   st_lora BASE ADAPTER MERGED TOL    (each a .safetensors file, or a directory: its
//                                       .safetensors files, shards of one model)
// Each tensor NAME of MERGED is expected to be, in double:
// - BASE + B·A where ADAPTER holds base_model.model.MODULE.lora_A.weight [r, in] and lora_B.weight
//   [out, r] (MODULE: NAME without ".weight"), or (B·A)ᵀ from lora_embedding_A [r, vocab] and
//   lora_embedding_B [hidden, r]; the scale is 1, as llmerge writes it (r = lora_alpha, and each
//   module of another rank the same value in alpha_pattern), which the caller checks;
// - BASE + the change where ADAPTER holds MODULE.lora_B.bias for a bias;
// - ADAPTER's base_model.model.NAME where it saves the tensor whole (modules_to_save);
// - else BASE.
// Every value must be within TOL times the largest |expected| of its tensor. Prints the number of
// tensors with factors and the worst deviation (relative to that largest value). Exit status 0
// when every tensor is within and at least one has factors, 1 otherwise, 2 for bad usage or a
// file that cannot be read.
#include <dirent.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "dtype.h"
#include "safetensors.h"

#define MAX_FILES 16

// The tensors of one model: a file, or the .safetensors files of a directory.
typedef struct model {
    lm_st_file *f[MAX_FILES];
    int n;
} model;

static void close_model(model *m)
{
    for (int i = 0; i < m->n; i++)
        lm_st_close(m->f[i]);
    m->n = 0;
}

static bool open_model(model *m, const char *path)
{
    lm_err err;
    struct stat st;
    m->n = 0;
    if (stat(path, &st) == 0 && S_ISDIR(st.st_mode)) {
        DIR *d = opendir(path);
        struct dirent *e;
        while (d && (e = readdir(d)) != NULL) {
            size_t len = strlen(e->d_name);
            if (len < 12 || strcmp(e->d_name + len - 12, ".safetensors") != 0)
                continue;
            char file[4096];
            snprintf(file, sizeof file, "%s/%s", path, e->d_name);
            if (m->n == MAX_FILES || lm_st_open(&m->f[m->n], file, &err) != LM_OK) {
                fprintf(stderr, "st_lora: %s: %s\n", file, m->n == MAX_FILES ? "too many files" : err.msg);
                closedir(d);
                close_model(m);
                return false;
            }
            m->n++;
        }
        if (!d) {
            fprintf(stderr, "st_lora: %s: cannot read the directory\n", path);
            return false;
        }
        closedir(d);
    } else if (lm_st_open(&m->f[0], path, &err) == LM_OK) {
        m->n = 1;
    } else {
        fprintf(stderr, "st_lora: %s\n", err.msg);
        return false;
    }
    if (m->n == 0)
        fprintf(stderr, "st_lora: %s: no .safetensors file\n", path);
    return m->n > 0;
}

static const lm_st_tensor *find(const model *m, const char *name)
{
    for (int i = 0; i < m->n; i++) {
        const lm_st_tensor *t = lm_st_find(m->f[i], name);
        if (t)
            return t;
    }
    return NULL;
}

static double *values(const lm_st_tensor *t)
{
    float *f = malloc((size_t)(t->numel > 0 ? t->numel : 1) * sizeof *f);
    double *d = malloc((size_t)(t->numel > 0 ? t->numel : 1) * sizeof *d);
    lm_err err;
    if (!f || !d || lm_convert_to_f32(f, t->data, t->dtype, t->numel, &err) != LM_OK) {
        free(f);
        free(d);
        return NULL;
    }
    for (int64_t i = 0; i < t->numel; i++)
        d[i] = f[i];
    free(f);
    return d;
}

static const lm_st_tensor *adapter_key(const model *ad, const char *module, const char *suffix)
{
    char key[2200];  // the prefix, a module and a suffix
    snprintf(key, sizeof key, "base_model.model.%s%s", module, suffix);
    return find(ad, key);
}

// expected += the product of the factors of `module` in ad; -1 where they do not fit t, 1 where
// there are some, 0 where none.
static int add_factors(const model *ad, const char *module, const lm_st_tensor *t, double *expected)
{
    const lm_st_tensor *a = adapter_key(ad, module, ".lora_A.weight"), *b = adapter_key(ad, module, ".lora_B.weight");
    bool embedding = false;
    if (!a && !b) {
        a = adapter_key(ad, module, ".lora_embedding_A");
        b = adapter_key(ad, module, ".lora_embedding_B");
        embedding = true;
    }
    if (!a && !b)
        return 0;
    if (!a || !b || t->ndim != 2 || a->ndim != 2 || b->ndim != 2 || a->shape[0] != b->shape[1])
        return -1;
    int64_t rows = t->shape[0], cols = t->shape[1], r = a->shape[0];
    // linear: Δ [out, in] = B [out, r] · A [r, in]; embedding: Δ [vocab, hidden] = (B [hidden, r] ·
    // A [r, vocab])ᵀ
    if (embedding ? b->shape[0] != cols || a->shape[1] != rows : b->shape[0] != rows || a->shape[1] != cols)
        return -1;
    double *av = values(a), *bv = values(b);
    if (!av || !bv) {
        free(av);
        free(bv);
        return -1;
    }
    for (int64_t i = 0; i < rows; i++)
        for (int64_t j = 0; j < cols; j++) {
            double s = 0;
            for (int64_t k = 0; k < r; k++)
                s += embedding ? bv[j * r + k] * av[k * rows + i] : bv[i * r + k] * av[k * cols + j];
            expected[i * cols + j] += s;
        }
    free(av);
    free(bv);
    return 1;
}

// Tensor m of MERGED against BASE plus ADAPTER's change: 0 within tol, 1 not, 2 for a tensor
// that cannot be checked; *dev its deviation, *factored whether ADAPTER has factors for it.
static int check_tensor(const model *base, const model *ad, const lm_st_tensor *m, double tol, double *dev,
                        bool *factored)
{
    const lm_st_tensor *bt = find(base, m->name);
    if (!bt || bt->numel != m->numel) {
        fprintf(stderr, "st_lora: %s: not in BASE with that shape\n", m->name);
        return 2;
    }
    const char *dot = strrchr(m->name, '.');
    char module[1024];
    snprintf(module, sizeof module, "%.*s", dot ? (int)(dot - m->name) : (int)strlen(m->name), m->name);
    const lm_st_tensor *saved = adapter_key(ad, m->name, "");
    double *expected = values(saved ? saved : bt), *got = values(m);
    int factors = 0;
    if (expected && got && !saved && dot && strcmp(dot, ".weight") == 0)
        factors = add_factors(ad, module, m, expected);
    if (expected && got && !saved && dot && strcmp(dot, ".bias") == 0) {
        const lm_st_tensor *db = adapter_key(ad, module, ".lora_B.bias");
        double *d = db && db->numel == m->numel ? values(db) : NULL;
        if (db && !d)
            factors = -1;  // a change of another length, or unreadable
        for (int64_t i = 0; d && i < m->numel; i++)
            expected[i] += d[i];
        free(d);
    }
    int rc = 0;
    if (!expected || !got || factors < 0) {
        fprintf(stderr, "st_lora: %s: %s\n", m->name,
                factors < 0 ? "the adapter's change does not fit it" : "cannot read its values");
        rc = 2;
    } else {
        double largest = 0;
        *dev = 0;
        for (int64_t i = 0; i < m->numel; i++)
            largest = fmax(largest, fabs(expected[i]));
        for (int64_t i = 0; i < m->numel; i++)
            *dev = fmax(*dev, fabs(got[i] - expected[i]) / (largest > 0 ? largest : 1));
        if (!(*dev <= tol)) {
            fprintf(stderr, "st_lora: %s: %.3g of its largest value away from BASE plus the adapter's change\n",
                    m->name, *dev);
            rc = 1;
        }
    }
    *factored = factors > 0;
    free(expected);
    free(got);
    return rc;
}

int main(int argc, char **argv)
{
    if (argc != 5) {
        fprintf(stderr, "usage: st_lora BASE ADAPTER MERGED TOL (safetensors files or directories)\n");
        return 2;
    }
    model models[3] = {{.n = 0}, {.n = 0}, {.n = 0}};
    for (int i = 0; i < 3; i++)
        if (!open_model(&models[i], argv[1 + i])) {
            for (int j = 0; j < i; j++)
                close_model(&models[j]);
            return 2;
        }
    double tol = atof(argv[4]), worst = 0;
    int n_factored = 0, rc = 0;
    for (int fi = 0; fi < models[2].n && rc != 2; fi++)
        for (int64_t k = 0; k < models[2].f[fi]->n_tensors && rc != 2; k++) {
            double dev = 0;
            bool factored = false;
            int t = check_tensor(&models[0], &models[1], &models[2].f[fi]->tensors[k], tol, &dev, &factored);
            rc = t > rc ? t : rc;
            n_factored += factored;
            worst = fmax(worst, dev);
        }
    printf("%d tensors with factors, worst deviation %.3g\n", n_factored, worst);
    if (rc == 0 && n_factored == 0) {
        fprintf(stderr, "st_lora: no tensor of MERGED has factors in ADAPTER\n");
        rc = 1;
    }
    for (int i = 0; i < 3; i++)
        close_model(&models[i]);
    return rc;
}
