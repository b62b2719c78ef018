// Tests of embed_perm.c: the rows of each model's embedding matrices under the output's
// vocabulary, against rows worked out by hand from the vocabularies below (mergekit's rules:
// the model's own row; else the only model that has the token; zeros where none has it or the
// id has no token; the base's row where it has it and prefer_base; else the mean of those that
// have it), with the models in four dtypes; the counts; the file without its data (for a plan);
// and a tensor of a dtype the rows cannot be rebuilt in.
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "dtype.h"
#include "embed_perm.h"

#define H 3       // columns of every matrix
#define MODELS 4  // the base and three models

static lm_vocab *parsed(const char *text)
{
    lm_vocab *v = NULL;
    lm_err err = {0};
    CHECK_OK(lm_vocab_parse(&v, text, strlen(text), "tok.json", &err), &err);
    return v;
}

// Model m's value at (row, col) of matrix k: distinct for every (m, row, col), exact in BF16,
// F16 and F32 (and so are the means of two of them), negated in the second matrix.
static double value(int k, int m, int row, int col)
{
    double v = m * 8 + row + col * 0.25;
    return k == 0 ? v : -v;
}

// The output vocabulary: a b c d e at 0-4, no token at 5, g at 6. The base has a b c (x at 3,
// which the output lacks); model 1 has b a d c (y at 4, past its 4 rows: absent); model 2 has no
// vocabulary of its own (the base's); model 3 has e d a in 3 rows.
static const char *out_json = "{\"model\": {\"vocab\": {\"a\": 0, \"b\": 1, \"c\": 2, \"d\": 3, \"e\": 4, \"g\": 6}}}";
static const char *base_json = "{\"model\": {\"vocab\": {\"a\": 0, \"b\": 1, \"c\": 2, \"x\": 3}}}";
static const char *m1_json = "{\"model\": {\"vocab\": {\"b\": 0, \"a\": 1, \"d\": 2, \"c\": 3, \"y\": 4}}}";
static const char *m3_json = "{\"model\": {\"vocab\": {\"e\": 0, \"d\": 1, \"a\": 2}}}";
static const int64_t rows[MODELS] = {4, 4, 4, 3};
static const lm_dtype dtypes[MODELS] = {LM_DTYPE_BF16, LM_DTYPE_F32, LM_DTYPE_BF16, LM_DTYPE_F16};

// Each model's own row of each output id (-1: it lacks the token), by hand from the above.
static const int own[MODELS][7] = {
    {0, 1, 2, -1, -1, -1, -1},
    {1, 0, 3, 2, -1, -1, -1},
    {0, 1, 2, -1, -1, -1, -1},
    {2, -1, -1, 1, 0, -1, -1},
};

// The expected value of model m's rebuilt matrix k at (id, col).
static double expected(int k, int m, int id, int col, bool prefer_base)
{
    if (own[m][id] >= 0)
        return value(k, m, own[m][id], col);
    switch (id) {
    case 1:
    case 2:  // b, c: the base, model 1 and model 2 have them
        if (prefer_base)
            return value(k, 0, id, col);
        return (value(k, 0, id, col) + value(k, 1, own[1][id], col) + value(k, 2, id, col)) / 3;
    case 3:  // d: models 1 and 3, not the base
        return (value(k, 1, 2, col) + value(k, 3, 1, col)) / 2;
    case 4:  // e: model 3 only
        return value(k, 3, 0, col);
    default:  // no token (5), or a token no model has (6)
        return 0;
    }
}

// Model m's matrix k as the test stores it: rows[m] rows of H values in dtypes[m].
static uint8_t storage[2][MODELS][4 * H * 4];
static lm_st_tensor tensors[2][MODELS];

static void make_tensors(void)
{
    lm_err err = {0};
    for (int k = 0; k < 2; k++)
        for (int m = 0; m < MODELS; m++) {
            float f[4 * H];
            for (int r = 0; r < rows[m]; r++)
                for (int c = 0; c < H; c++)
                    f[r * H + c] = (float)value(k, m, r, c);
            CHECK_OK(lm_convert_from_f32(storage[k][m], dtypes[m], f, rows[m] * H, &err), &err);
            lm_st_tensor *t = &tensors[k][m];
            t->name = k == 0 ? "embed" : "head";
            t->dtype = dtypes[m];
            t->ndim = 2;
            t->shape[0] = rows[m];
            t->shape[1] = H;
            t->numel = rows[m] * H;
            t->data = storage[k][m];
        }
}

static void test_rows(bool prefer_base)
{
    lm_vocab *out = parsed(out_json), *base = parsed(base_json), *m1 = parsed(m1_json), *m3 = parsed(m3_json);
    const lm_vocab *vocabs[MODELS] = {base, m1, NULL, m3};
    lm_embed_perm *p = NULL;
    lm_err err = {0};
    CHECK_OK(lm_embed_perm_make(&p, out, vocabs, rows, MODELS, prefer_base, &err), &err);
    if (!p)
        goto done;
    CHECK(p->n_rows == 7 && p->n_tokens == 6);
    for (int m = 0; m < MODELS; m++)
        for (int id = 0; id < 7; id++)
            CHECK_MSG(p->row[m][id] == own[m][id], "model %d id %d: row %d, wanted %d", m, id, p->row[m][id],
                      own[m][id]);
    // e from model 3; g in none; b and c from the base or averaged; d averaged; a all have
    CHECK(p->n_single == 1 && p->n_none == 1);
    CHECK(p->n_base == (prefer_base ? 2 : 0) && p->n_average == (prefer_base ? 1 : 3));
    int64_t own_n[MODELS] = {3, 4, 3, 3}, moved[MODELS] = {0, 4, 0, 3};
    for (int m = 0; m < MODELS; m++)
        CHECK_MSG(p->n_own[m] == own_n[m] && p->n_moved[m] == moved[m], "model %d: %lld own, %lld moved", m,
                  (long long)p->n_own[m], (long long)p->n_moved[m]);

    const lm_st_tensor *t[2 * MODELS];
    for (int k = 0; k < 2; k++)
        for (int m = 0; m < MODELS; m++)
            t[k * MODELS + m] = &tensors[k][m];
    const char *names[2] = {"embed", "head"};
    for (int m = 0; m < MODELS; m++) {
        FILE *tmp = tmpfile();
        lm_st_file *f = NULL;
        CHECK_OK(lm_embed_perm_write(p, m, t, names, 2, fileno(tmp), true, "rebuilt", &err), &err);
        CHECK_OK(lm_st_open_fd(&f, fileno(tmp), "rebuilt", &err), &err);
        fclose(tmp);
        if (!f)
            continue;
        CHECK(f->n_tensors == 2);
        for (int k = 0; k < 2; k++) {
            const lm_st_tensor *r = lm_st_find(f, names[k]);
            CHECK(r && r->dtype == dtypes[m] && r->ndim == 2 && r->shape[0] == 7 && r->shape[1] == H);
            if (!r || r->shape[0] != 7)
                continue;
            float got[7 * H];
            CHECK_OK(lm_convert_to_f32(got, r->data, r->dtype, 7 * H, &err), &err);
            // a mean of three is rounded to the model's dtype: within half of its unit
            double tol = dtypes[m] == LM_DTYPE_BF16 ? 1.0 / 256 : dtypes[m] == LM_DTYPE_F16 ? 1.0 / 2048 : 1e-6;
            for (int id = 0; id < 7; id++)
                for (int c = 0; c < H; c++) {
                    double want = expected(k, m, id, c, prefer_base);
                    CHECK_MSG(fabs(got[id * H + c] - want) <= tol * fabs(want), "model %d %s[%d][%d] = %.9g, "
                              "wanted %.9g (prefer_base %d)", m, names[k], id, c, got[id * H + c], want, prefer_base);
                }
        }
        lm_st_close(f);
    }
    lm_embed_perm_free(p);
done:
    lm_vocab_free(out);
    lm_vocab_free(base);
    lm_vocab_free(m1);
    lm_vocab_free(m3);
}

// Without its data the file has its header and its full size, and reads as the same shapes.
static void test_shapes_only(void)
{
    lm_vocab *out = parsed(out_json), *base = parsed(base_json), *m1 = parsed(m1_json), *m3 = parsed(m3_json);
    const lm_vocab *vocabs[MODELS] = {base, m1, NULL, m3};
    lm_embed_perm *p = NULL;
    lm_err err = {0};
    CHECK_OK(lm_embed_perm_make(&p, out, vocabs, rows, MODELS, true, &err), &err);
    const lm_st_tensor *t[2 * MODELS];
    for (int k = 0; k < 2; k++)
        for (int m = 0; m < MODELS; m++)
            t[k * MODELS + m] = &tensors[k][m];
    const char *names[2] = {"embed", "head"};
    FILE *tmp = tmpfile();
    lm_st_file *f = NULL;
    CHECK_OK(lm_embed_perm_write(p, 1, t, names, 2, fileno(tmp), false, "sized", &err), &err);
    CHECK_OK(lm_st_open_fd(&f, fileno(tmp), "sized", &err), &err);
    if (f) {
        const lm_st_tensor *e = lm_st_find(f, "embed"), *h = lm_st_find(f, "head");
        CHECK(e && h && e->dtype == LM_DTYPE_F32 && e->shape[0] == 7 && h->nbytes == 7 * H * 4);
        CHECK(f->data_size == 2 * 7 * H * 4);
        lm_st_close(f);
    }
    // a model whose matrix is not a floating dtype cannot give or take rows
    lm_st_tensor odd = tensors[0][2];
    odd.dtype = LM_DTYPE_I32;
    t[2] = &odd;
    FILE *tmp2 = tmpfile();
    CHECK_FAILS(lm_embed_perm_write(p, 2, t, names, 2, fileno(tmp2), true, "odd", &err), LM_ERR_UNSUPPORTED,
                "'embed' is I32", &err);
    CHECK_FAILS(lm_embed_perm_write(p, 0, t, names, 2, fileno(tmp2), true, "odd", &err), LM_ERR_UNSUPPORTED,
                "'embed' of model 2 is I32", &err);
    fclose(tmp2);
    fclose(tmp);
    lm_embed_perm_free(p);
    lm_vocab_free(out);
    lm_vocab_free(base);
    lm_vocab_free(m1);
    lm_vocab_free(m3);
}

int main(void)
{
    make_tensors();
    test_rows(true);
    test_rows(false);
    test_shapes_only();
    return check_report("test_embed_perm");
}
