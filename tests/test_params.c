// Tests of per-tensor parameter settings (params.h): scalars, gradients at the ends and between
// their points, conditions (first match, "*", no filter, substrings, no match falling through to
// the global setting), a model's settings over the global ones, the position of a tensor among
// the layers, numbers as the reader takes them, and the command-line form, valid and refused,
// evaluating as the YAML form of the same setting does, to the bit. Every expected value is
// written out here by hand.
#include <math.h>

#include "check.h"
#include "mergecfg.h"
#include "params.h"
#include "util.h"

// ---- settings built by hand -------------------------------------------------------------------

static lm_pval *num(double x)
{
    lm_pval *v = calloc(1, sizeof *v);
    v->kind = LM_PVAL_NUMBER;
    v->num = x;
    return v;
}

static lm_pval *grad(int n, const double *xs)
{
    lm_pval *v = calloc(1, sizeof *v);
    v->kind = LM_PVAL_GRADIENT;
    v->grad = malloc((size_t)n * sizeof *v->grad);
    memcpy(v->grad, xs, (size_t)n * sizeof *xs);
    v->n_grad = n;
    return v;
}

// Conditions from n (filter, value) pairs; a NULL filter matches anything.
static lm_pval *conds(int n, const char *const *filters, lm_pval **values)
{
    lm_pval *v = calloc(1, sizeof *v);
    v->kind = LM_PVAL_CONDS;
    v->conds = calloc((size_t)n, sizeof *v->conds);
    v->n_conds = n;
    for (int i = 0; i < n; i++) {
        v->conds[i].filter = filters[i] ? lm_strdup(filters[i]) : NULL;
        v->conds[i].value = values[i];
    }
    return v;
}

// The number v gives for tensor at t; NAN when it gives nothing or not a number.
static double eval_num(const lm_pval *v, const char *tensor, double t)
{
    lm_pval_kind k;
    double x = -1;
    const char *s = NULL;
    if (!lm_pval_eval(v, tensor, t, &k, &x, &s) || (k != LM_PVAL_NUMBER && k != LM_PVAL_BOOL))
        return NAN;
    return x;
}

static void test_scalars(void)
{
    lm_pval *v = num(0.25);
    lm_pval_kind k = LM_PVAL_CONDS;
    double x = 0;
    const char *s = NULL;
    CHECK(lm_pval_eval(v, "model.layers.0.mlp.up_proj.weight", 0.7, &k, &x, &s));
    CHECK(k == LM_PVAL_NUMBER && x == 0.25);
    CHECK(lm_pval_eval(v, NULL, 0, NULL, NULL, NULL));  // every output is optional
    lm_pval_free(v);

    v = calloc(1, sizeof *v);
    v->kind = LM_PVAL_BOOL;
    v->num = 1;
    CHECK(lm_pval_eval(v, "x", 0, &k, &x, &s) && k == LM_PVAL_BOOL && x == 1);
    lm_pval_free(v);

    v = calloc(1, sizeof *v);
    v->kind = LM_PVAL_STRING;
    v->str = lm_strdup("sum");
    x = 5;
    CHECK(lm_pval_eval(v, "x", 0, &k, &x, &s) && k == LM_PVAL_STRING && s && strcmp(s, "sum") == 0 && x == 5);
    lm_pval_free(v);
    lm_pval_free(NULL);
}

static void test_gradients(void)
{
    // n = 1: the one value everywhere
    lm_pval *g1 = grad(1, (const double[]){0.7});
    CHECK(eval_num(g1, "t", 0) == 0.7);
    CHECK(eval_num(g1, "t", 0.5) == 0.7);
    CHECK(eval_num(g1, "t", 1) == 0.7);

    // n = 2: a straight line from 0.2 to 1.0
    lm_pval *g2 = grad(2, (const double[]){0.2, 1.0});
    CHECK(eval_num(g2, "t", 0) == 0.2);
    CHECK(eval_num(g2, "t", 1) == 1.0);
    CHECK_NEAR(eval_num(g2, "t", 0.25), 0.75 * 0.2 + 0.25 * 1.0, 1e-15);  // 0.4
    CHECK_NEAR(eval_num(g2, "t", 0.25), 0.4, 1e-15);
    CHECK_NEAR(eval_num(g2, "t", 0.5), 0.6, 1e-15);

    // n = 5: points at t = 0, 0.25, 0.5, 0.75, 1
    lm_pval *g5 = grad(5, (const double[]){0, 0.3, 0.5, 0.7, 1});
    CHECK(eval_num(g5, "t", 0) == 0);
    CHECK(eval_num(g5, "t", 1) == 1);
    CHECK_NEAR(eval_num(g5, "t", 0.25), 0.3, 1e-15);  // on a point
    CHECK_NEAR(eval_num(g5, "t", 0.5), 0.5, 1e-15);
    CHECK_NEAR(eval_num(g5, "t", 0.6), 0.58, 1e-15);  // 0.6 * 4 = 2.4: 0.6 of 0.5 and 0.4 of 0.7
    CHECK_NEAR(eval_num(g5, "t", 0.1), 0.12, 1e-15);  // 0.4: 0.6 of 0 and 0.4 of 0.3
    CHECK_NEAR(eval_num(g5, "t", 0.9), 0.88, 1e-15);  // 3.6: 0.4 of 0.7 and 0.6 of 1
    // mergekit's arithmetic to the bit, at t = 3/7 (layer 3 of 8): scaled 12/7
    double t = 3.0 / 7.0, scaled = t * 4, frac = scaled - 1;
    CHECK(eval_num(g5, "t", t) == (1 - frac) * 0.3 + frac * 0.5);
    // outside [0, 1] t is clamped; NaN counts as 0
    CHECK(eval_num(g5, "t", -1) == 0);
    CHECK(eval_num(g5, "t", 2) == 1);
    CHECK(eval_num(g5, "t", NAN) == 0);
    lm_pval_free(g1);
    lm_pval_free(g2);
    lm_pval_free(g5);
}

static void test_conditions(void)
{
    // self_attn: 0.1; mlp: gradient 1 -> 0; "*": 0.9; then no filter (never reached)
    lm_pval *v = conds(4, (const char *const[]){"self_attn", "mlp", "*", NULL},
                       (lm_pval *[]){num(0.1), grad(2, (const double[]){1, 0}), num(0.9), num(0.3)});
    CHECK(eval_num(v, "model.layers.2.self_attn.q_proj.weight", 0.5) == 0.1);
    CHECK_NEAR(eval_num(v, "model.layers.2.mlp.up_proj.weight", 0.25), 0.75, 1e-15);
    CHECK(eval_num(v, "model.embed_tokens.weight", 0) == 0.9);  // "*" before the unfiltered one
    CHECK(eval_num(v, NULL, 0) == 0.9);                         // no name: "*" still matches
    lm_pval_free(v);

    // first match wins: "proj" and "q_proj" both match q_proj; order decides
    v = conds(2, (const char *const[]){"proj", "q_proj"}, (lm_pval *[]){num(1), num(2)});
    CHECK(eval_num(v, "model.layers.0.self_attn.q_proj.weight", 0) == 1);
    lm_pval_free(v);
    v = conds(2, (const char *const[]){"q_proj", "proj"}, (lm_pval *[]){num(1), num(2)});
    CHECK(eval_num(v, "model.layers.0.self_attn.q_proj.weight", 0) == 1);
    CHECK(eval_num(v, "model.layers.0.self_attn.k_proj.weight", 0) == 2);
    // substring anywhere, not a whole component, and case matters
    CHECK(eval_num(v, "xq_projx", 0) == 1);
    CHECK(eval_num(v, "Q_PROJ", 0) != eval_num(v, "Q_PROJ", 0));  // NaN: nothing matched
    lm_pval_kind k;
    CHECK(!lm_pval_eval(v, "model.norm.weight", 0, &k, NULL, NULL));
    CHECK(!lm_pval_eval(v, NULL, 0, &k, NULL, NULL));  // no name: only "*" or no filter match
    lm_pval_free(v);

    // an absent filter matches anything
    v = conds(2, (const char *const[]){"mlp", NULL}, (lm_pval *[]){num(1), num(7)});
    CHECK(eval_num(v, "lm_head.weight", 0) == 7);
    CHECK(eval_num(v, NULL, 0) == 7);
    lm_pval_free(v);
}

// A params list of one setting.
static lm_params one(const char *name, lm_pval *v)
{
    lm_params ps = {calloc(1, sizeof(lm_param)), 1};
    ps.items[0].name = lm_strdup(name);
    ps.items[0].value = v;
    return ps;
}

static void test_lookup(void)
{
    lm_params global = one("density", conds(2, (const char *const[]){"mlp", NULL},
                                            (lm_pval *[]){num(0.5), grad(3, (const double[]){0.1, 0.2, 0.4})}));
    lm_params model = one("density", conds(1, (const char *const[]){"self_attn"}, (lm_pval *[]){num(0.9)}));
    lm_err err = {0};
    double x = -1;
    bool found = true;

    CHECK(lm_params_find(&global, "density") == &global.items[0]);
    CHECK(lm_params_find(&global, "weight") == NULL);
    CHECK(lm_params_find(NULL, "density") == NULL);

    // the model's setting matches: it wins
    CHECK_OK(lm_param_number(&model, &global, "density", "model.layers.1.self_attn.o_proj.weight", 0.5, &x, &found,
                             &err), &err);
    CHECK(found && x == 0.9);
    // the model's conditions miss: the global setting's first match
    CHECK_OK(lm_param_number(&model, &global, "density", "model.layers.1.mlp.down_proj.weight", 0.5, &x, &found,
                             &err), &err);
    CHECK(found && x == 0.5);
    // ... and its unfiltered gradient: t = 0.75 is 0.5 of 0.2 and 0.5 of 0.4
    CHECK_OK(lm_param_number(&model, &global, "density", "model.layers.1.input_layernorm.weight", 0.75, &x, &found,
                             &err), &err);
    CHECK(found);
    CHECK_NEAR(x, 0.3, 1e-15);
    // no model settings at all
    CHECK_OK(lm_param_number(NULL, &global, "density", "model.norm.weight", 0, &x, &found, &err), &err);
    CHECK(found && x == 0.1);
    // a name neither has: not found, the caller's default applies
    x = 42;
    CHECK_OK(lm_param_number(&model, &global, "epsilon", "model.norm.weight", 0, &x, &found, &err), &err);
    CHECK(!found && x == 42);
    CHECK_OK(lm_param_number(NULL, NULL, "density", "t", 0, &x, &found, &err), &err);
    CHECK(!found);
    // the model's setting misses and there is no global one
    CHECK_OK(lm_param_number(&model, NULL, "density", "lm_head.weight", 0, &x, &found, &err), &err);
    CHECK(!found);
    lm_params_free(&global);
    lm_params_free(&model);
    CHECK(global.n == 0 && global.items == NULL);
    lm_params_free(NULL);
}

static void test_position(void)
{
    CHECK(lm_param_layer("model.layers.17.mlp.down_proj.weight") == 17);
    CHECK(lm_param_layer("layers.3.attention.wq.weight") == 3);
    CHECK(lm_param_layer("model.embed_tokens.weight") == -1);
    CHECK(lm_param_layer("model.layers.x.mlp") == -1);
    CHECK(lm_param_layer("model.layers.4") == -1);           // no '.' after the index
    CHECK(lm_param_layer("model.sublayers.4.mlp") == -1);    // "layers." must start a component
    CHECK(lm_param_layer("a.layers.b.layers.2.c") == 2);     // the first one with an index
    CHECK(lm_param_layer(NULL) == -1);

    CHECK(lm_param_position("model.layers.0.self_attn.q_proj.weight", 5) == 0);
    CHECK(lm_param_position("model.layers.1.self_attn.q_proj.weight", 5) == 0.25);
    CHECK(lm_param_position("model.layers.3.mlp.up_proj.weight", 5) == 0.75);
    CHECK(lm_param_position("model.layers.4.mlp.up_proj.weight", 5) == 1);
    CHECK(lm_param_position("model.layers.2.mlp.up_proj.weight", 7) == 2.0 / 6.0);
    CHECK(lm_param_position("model.layers.9.mlp.up_proj.weight", 5) == 1);  // past the last
    CHECK(lm_param_position("model.layers.0.mlp.up_proj.weight", 1) == 1);  // N = 1
    CHECK(lm_param_position("model.embed_tokens.weight", 5) == 0);
    CHECK(lm_param_position("model.norm.weight", 5) == 0);
    CHECK(lm_param_position("lm_head.weight", 5) == 0);
    CHECK(lm_param_position("lm_head.weight", 1) == 0);
    CHECK(lm_param_position("model.layers.1.mlp.up_proj.weight", 0) == 0);
}

// layout_of: a layout of n_layers over the names.
static lm_param_layout layout_of(int64_t n_layers, const char *const *names, int n)
{
    lm_param_layout l;
    memset(&l, 0, sizeof l);
    l.n_layers = n_layers;
    for (int i = 0; i < n; i++)
        lm_param_layout_add(&l, names[i]);
    return l;
}

// Where a gradient may be evaluated: a position where llmerge's is mergekit's, a refusal
// (and why) everywhere else.
static void test_layout(void)
{
    char why[512];
    double t = -1;
    // a Llama-style base of 3 layers: the layers and the tensors outside them
    static const char *const llama[] = {"model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight",
                                        "model.layers.1.mlp.up_proj.weight", "model.layers.2.mlp.up_proj.weight",
                                        "model.norm.weight", "lm_head.weight"};
    lm_param_layout l = layout_of(3, llama, 6);
    CHECK(l.n_stacks == 1 && l.stacks[0].n == 3 && l.stacks[0].len == strlen("model."));
    CHECK(lm_param_layout_position(&l, "model.layers.1.mlp.up_proj.weight", &t, why, sizeof why) && t == 0.5);
    CHECK(lm_param_layout_position(&l, "model.layers.2.mlp.up_proj.weight", &t, why, sizeof why) && t == 1);
    CHECK(lm_param_layout_position(&l, "lm_head.weight", &t, why, sizeof why) && t == 0);
    // a layer past num_hidden_layers in the same stack (a multi-token-prediction layer): the last
    // position
    static const char *const mtp[] = {"model.layers.0.mlp.up_proj.weight", "model.layers.1.mlp.up_proj.weight",
                                      "model.layers.2.mlp.up_proj.weight", "model.layers.3.mlp.up_proj.weight"};
    lm_param_layout lm = layout_of(3, mtp, 4);
    CHECK(lm_param_layout_position(&lm, "model.layers.3.mlp.up_proj.weight", &t, why, sizeof why) && t == 1);
    CHECK(lm_param_layout_position(&lm, "model.layers.1.mlp.up_proj.weight", &t, why, sizeof why) && t == 0.5);
    // the layer count unknown: nothing is placed, not even the embeddings
    l.n_layers = 0;
    CHECK(!lm_param_layout_position(&l, "model.embed_tokens.weight", &t, why, sizeof why) &&
          strstr(why, "no num_hidden_layers"));
    // GPT-2's numbered blocks: not llmerge's naming, refused; its embeddings are outside them
    static const char *const gpt2[] = {"transformer.wte.weight", "transformer.h.0.attn.c_attn.weight",
                                       "transformer.h.1.attn.c_attn.weight", "transformer.ln_f.weight"};
    l = layout_of(2, gpt2, 4);
    CHECK(l.n_stacks == 0);
    CHECK(!lm_param_layout_position(&l, "transformer.h.1.attn.c_attn.weight", &t, why, sizeof why) &&
          strstr(why, "numbered blocks ('h.1')"));
    CHECK(!lm_param_layout_position(&l, "blocks.0.weight", &t, why, sizeof why) && strstr(why, "('blocks.0')"));
    CHECK(!lm_param_layout_position(&l, "0.weight", &t, why, sizeof why) && strstr(why, "('0')"));
    CHECK(lm_param_layout_position(&l, "transformer.wte.weight", &t, why, sizeof why) && t == 0);
    CHECK(lm_param_layout_position(&l, "transformer.h1.weight", &t, why, sizeof why) && t == 0);  // h1: a name
    // a vision tower beside the language model: its 4 layers are placed by their own count, as
    // the language model's by num_hidden_layers (mergekit places each module's layers by its own
    // count), and those of a tower of the same length alike
    static const char *const vlm[] = {"model.language_model.layers.0.q.weight",
                                      "model.language_model.layers.1.q.weight",
                                      "model.vision_tower.layers.0.q.weight", "model.vision_tower.layers.3.q.weight",
                                      "model.audio.layers.1.q.weight"};
    l = layout_of(2, vlm, 5);
    CHECK(l.n_stacks == 3);
    CHECK(lm_param_layout_position(&l, "model.language_model.layers.1.q.weight", &t, why, sizeof why) && t == 1);
    CHECK(lm_param_layout_position(&l, "model.vision_tower.layers.0.q.weight", &t, why, sizeof why) && t == 0);
    CHECK(lm_param_layout_position(&l, "model.vision_tower.layers.2.q.weight", &t, why, sizeof why) &&
          fabs(t - 2.0 / 3.0) < 1e-15);
    CHECK(lm_param_layout_position(&l, "model.audio.layers.0.q.weight", &t, why, sizeof why) && t == 0);
    // more prefixes than a layout holds: the ones left out are not placed
    lm_param_layout many;
    memset(&many, 0, sizeof many);
    many.n_layers = 1;
    char names[LM_PARAM_MAX_STACKS + 1][32];
    for (int i = 0; i <= LM_PARAM_MAX_STACKS; i++) {
        snprintf(names[i], sizeof names[i], "m%d.layers.0.w", i);
        lm_param_layout_add(&many, names[i]);
    }
    CHECK(many.overflow && many.n_stacks == LM_PARAM_MAX_STACKS);
    CHECK(lm_param_layout_position(&many, names[0], &t, why, sizeof why) && t == 1);
    CHECK(!lm_param_layout_position(&many, names[LM_PARAM_MAX_STACKS], &t, why, sizeof why) &&
          strstr(why, "more than 8 prefixes"));
}

static void test_numbers(void)
{
    static const struct {
        const char *text;
        lm_pnum want;
        double value;
    } cases[] = {
        {"0", LM_PNUM_INT, 0},         {"-3", LM_PNUM_INT, -3},       {"+7", LM_PNUM_INT, 7},
        {"0.5", LM_PNUM_FLOAT, 0.5},   {".5", LM_PNUM_FLOAT, 0.5},    {"-0.1", LM_PNUM_FLOAT, -0.1},
        {"1.", LM_PNUM_FLOAT, 1},      {"1e-3", LM_PNUM_FLOAT, 1e-3}, {"2.5E+4", LM_PNUM_FLOAT, 25000},
        {"1e400", LM_PNUM_NONFINITE, 0}, {".inf", LM_PNUM_NONFINITE, 0}, {"-.Inf", LM_PNUM_NONFINITE, 0},
        {".NaN", LM_PNUM_NONFINITE, 0}, {"1e-400", LM_PNUM_FLOAT, 0},
        {"010", LM_PNUM_UNREADABLE, 0}, {"0x1F", LM_PNUM_UNREADABLE, 0}, {"0b101", LM_PNUM_UNREADABLE, 0},
        {"1_000", LM_PNUM_UNREADABLE, 0}, {"1:30", LM_PNUM_UNREADABLE, 0},
        {"", LM_PNUM_NONE, 0},         {".", LM_PNUM_NONE, 0},        {"-", LM_PNUM_NONE, 0},
        {"1e", LM_PNUM_NONE, 0},       {"e3", LM_PNUM_NONE, 0},       {"inf", LM_PNUM_NONE, 0},
        {"nan", LM_PNUM_NONE, 0},      {"1.2.3", LM_PNUM_NONE, 0},    {"0.5x", LM_PNUM_NONE, 0},
        {" 1", LM_PNUM_NONE, 0},       {"0x", LM_PNUM_NONE, 0},       {"yes", LM_PNUM_NONE, 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        double x = -99;
        lm_pnum got = lm_param_scan_number(cases[i].text, strlen(cases[i].text), &x);
        CHECK_MSG(got == cases[i].want, "'%s': %d, wanted %d", cases[i].text, (int)got, (int)cases[i].want);
        if (cases[i].want == LM_PNUM_INT || cases[i].want == LM_PNUM_FLOAT)
            CHECK_MSG(x == cases[i].value, "'%s' read as %.17g", cases[i].text, x);
        else
            CHECK_MSG(x == -99, "'%s' set the value", cases[i].text);
    }
    // a long number is read whole; a span need not end in a NUL
    char big[300];
    memset(big, '0', sizeof big);
    big[0] = '1';
    big[1] = '.';
    double x = 0;
    CHECK(lm_param_scan_number(big, sizeof big, &x) == LM_PNUM_FLOAT && x == 1);
    CHECK(lm_param_scan_number("0.25junk", 4, &x) == LM_PNUM_FLOAT && x == 0.25);
}

static void test_cli(void)
{
    lm_err err = {0};
    lm_pval *v = NULL;

    CHECK_OK(lm_pval_parse_cli("0.5", &v, &err), &err);
    CHECK(v && v->kind == LM_PVAL_NUMBER && v->num == 0.5 && v->line == 0);
    lm_pval_free(v);

    CHECK_OK(lm_pval_parse_cli("0,0.5,1", &v, &err), &err);
    CHECK(v && v->kind == LM_PVAL_GRADIENT && v->n_grad == 3 && v->grad[0] == 0 && v->grad[1] == 0.5 &&
          v->grad[2] == 1);
    lm_pval_free(v);

    CHECK_OK(lm_pval_parse_cli("self_attn=0,0.5,1;mlp=1,0.5,0;0.5", &v, &err), &err);
    CHECK(v && v->kind == LM_PVAL_CONDS && v->n_conds == 3);
    if (v && v->kind == LM_PVAL_CONDS && v->n_conds == 3) {
        CHECK(strcmp(v->conds[0].filter, "self_attn") == 0 && v->conds[0].value->kind == LM_PVAL_GRADIENT);
        CHECK(strcmp(v->conds[1].filter, "mlp") == 0 && v->conds[1].value->n_grad == 3 &&
              v->conds[1].value->grad[0] == 1);
        CHECK(v->conds[2].filter == NULL && v->conds[2].value->kind == LM_PVAL_NUMBER && v->conds[2].value->num == 0.5);
        CHECK_NEAR(eval_num(v, "model.layers.1.self_attn.v_proj.weight", 0.25), 0.25, 1e-15);
        CHECK_NEAR(eval_num(v, "model.layers.1.mlp.gate_proj.weight", 0.25), 0.75, 1e-15);
        CHECK(eval_num(v, "model.norm.weight", 0) == 0.5);
    }
    lm_pval_free(v);

    // one filtered item: conditions of one, which miss elsewhere
    CHECK_OK(lm_pval_parse_cli("mlp=0.3", &v, &err), &err);
    CHECK(v && v->kind == LM_PVAL_CONDS && v->n_conds == 1 && eval_num(v, "x.mlp.y", 0) == 0.3);
    CHECK(v && !lm_pval_eval(v, "x.self_attn.y", 0, NULL, NULL, NULL));
    lm_pval_free(v);
    // "*" and spaces around the parts
    CHECK_OK(lm_pval_parse_cli(" mlp = 1 , 2 ; * = -1e-3 ", &v, &err), &err);
    CHECK(v && v->kind == LM_PVAL_CONDS && v->n_conds == 2 && strcmp(v->conds[0].filter, "mlp") == 0 &&
          strcmp(v->conds[1].filter, "*") == 0 && eval_num(v, "lm_head", 0) == -1e-3 && eval_num(v, "mlp", 1) == 2);
    lm_pval_free(v);

    static const struct {
        const char *text;
        const char *needle;
    } bad[] = {
        {"", "empty value"},
        {"a=1;;0.5", "item 2 of 'a=1;;0.5' is empty"},
        {"a=1;", "item 2 of 'a=1;' is empty"},
        {";0.5", "item 1 of ';0.5' is empty"},
        {"=0.5", "item 1 ('=0.5'): the filter before '=' is empty"},
        {"mlp=", "item 1 ('mlp=') has no value after '='"},
        {"0.5;mlp=1", "item 1 ('0.5') has no filter: only the last item may go without one"},
        {"mlp=0.1;0.2;0.3", "item 2 ('0.2') has no filter"},
        {"a=b=1", "item 1 ('a=b=1') has more than one '='"},
        {"mlp=high", "item 1: 'high' is not a number"},
        {"x", "item 1: 'x' is not a number"},
        {"mlp=1,,2", "item 1: '1,,2' has an empty number in its list"},
        {"0,1,", "item 1: '0,1,' has an empty number in its list"},
        {"a=1;b=.inf", "item 2: .inf is not a finite number"},
        {"1e400", "item 1: 1e400 is not a finite number"},
        {"true", "item 1: 'true' is not a number"},
        {"010", "item 1: '010' is not a number"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        v = (lm_pval *)&err;  // must come back NULL
        CHECK_FAILS(lm_pval_parse_cli(bad[i].text, &v, &err), LM_ERR_USAGE, bad[i].needle, &err);
        CHECK(v == NULL);
    }
    v = (lm_pval *)&err;
    CHECK_FAILS(lm_pval_parse_cli(NULL, &v, &err), LM_ERR_USAGE, "empty", &err);
    CHECK(v == NULL);
}

// The command-line form and the YAML form of the same settings evaluate alike, to the bit, on
// tensors in and out of the layers, at every layer's position of a 7-layer model.
static void test_cli_as_yaml(void)
{
    static const struct {
        const char *cli;
        const char *yaml;  // the setting, under `parameters: {p: ...}`
    } pairs[] = {
        {"0.5", "0.5"},
        {"0,0.5,1", "[0, 0.5, 1]"},
        {"0.1,0.9,0.3,0.3,1", "[0.1, 0.9, 0.3, 0.3, 1]"},
        {"self_attn=0,0.5,1;mlp=1,0.5,0;0.5",
         "[{filter: self_attn, value: [0, 0.5, 1]}, {filter: mlp, value: [1, 0.5, 0]}, {value: 0.5}]"},
        {"q_proj=0.2;*=0.7", "[{filter: q_proj, value: 0.2}, {filter: '*', value: 0.7}]"},
        {"layers.1.=3,4;norm=-1", "[{filter: layers.1., value: [3, 4]}, {filter: norm, value: -1}]"},
    };
    static const char *const names[] = {
        "model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.up_proj.weight",
        "model.layers.3.self_attn.o_proj.weight", "model.layers.5.input_layernorm.weight",
        "model.layers.6.mlp.down_proj.weight", "model.norm.weight", "lm_head.weight",
    };
    for (size_t i = 0; i < sizeof pairs / sizeof pairs[0]; i++) {
        lm_err err = {0};
        lm_pval *cli = NULL;
        CHECK_OK(lm_pval_parse_cli(pairs[i].cli, &cli, &err), &err);
        char text[512];
        snprintf(text, sizeof text, "merge_method: linear\nmodels:\n  - model: a\nparameters:\n  p: %s\n", pairs[i].yaml);
        lm_mergecfg *c = NULL;
        CHECK_OK(lm_mergecfg_parse(&c, "cfg.yml", text, strlen(text), &err), &err);
        const lm_param *p = c ? lm_params_find(&c->params, "p") : NULL;
        CHECK(p != NULL);
        if (!cli || !p) {
            lm_pval_free(cli);
            lm_mergecfg_free(c);
            continue;
        }
        int compared = 0;
        for (size_t n = 0; n < sizeof names / sizeof names[0]; n++) {
            for (int layers = 1; layers <= 7; layers += 6) {
                double t = lm_param_position(names[n], layers);
                lm_pval_kind k1 = LM_PVAL_CONDS, k2 = LM_PVAL_STRING;
                double x1 = -1, x2 = -2;
                bool m1 = lm_pval_eval(cli, names[n], t, &k1, &x1, NULL);
                bool m2 = lm_pval_eval(p->value, names[n], t, &k2, &x2, NULL);
                CHECK_MSG(m1 == m2 && (!m1 || (k1 == k2 && memcmp(&x1, &x2, sizeof x1) == 0)),
                          "'%s' on %s at t = %g: %d %.17g against YAML's %d %.17g", pairs[i].cli, names[n], t, m1, x1,
                          m2, x2);
                compared++;
            }
        }
        CHECK(compared == 16);
        lm_pval_free(cli);
        lm_mergecfg_free(c);
    }
}

// A string where a number is needed names the parameter and where the string was written.
static void test_string_refused(void)
{
    const char *text = "merge_method: ties\n"
                       "models:\n"
                       "  - model: a\n"
                       "    parameters:\n"
                       "      density: [{filter: mlp, value: high}, {value: 0.5}]\n"
                       "parameters:\n"
                       "  density: 0.3\n";
    lm_err err = {0};
    lm_mergecfg *c = NULL;
    CHECK_OK(lm_mergecfg_parse(&c, "cfg.yml", text, strlen(text), &err), &err);
    if (!c)
        return;
    double x = 0;
    bool found = false;
    CHECK_FAILS(lm_param_number(&c->models[0].params, &c->params, "density", "model.layers.0.mlp.up_proj.weight", 0,
                                &x, &found, &err),
                LM_ERR_USAGE, "parameter 'density' (line 5:38): a number is needed, not the string 'high'", &err);
    CHECK_OK(lm_param_number(&c->models[0].params, &c->params, "density", "model.layers.0.self_attn.q_proj.weight", 0,
                             &x, &found, &err), &err);
    CHECK(found && x == 0.5);
    lm_mergecfg_free(c);

    lm_pval *v = calloc(1, sizeof *v);
    v->kind = LM_PVAL_STRING;
    v->str = lm_strdup("abc");
    lm_params ps = one("t", v);
    CHECK_FAILS(lm_param_number(&ps, NULL, "t", "x", 0, &x, &found, &err), LM_ERR_USAGE,
                "parameter 't': a number is needed, not the string 'abc'", &err);
    lm_params_free(&ps);
}

int main(void)
{
    test_scalars();
    test_gradients();
    test_conditions();
    test_lookup();
    test_position();
    test_layout();
    test_numbers();
    test_cli();
    test_cli_as_yaml();
    test_string_refused();
    return check_report("test_params");
}
