// Tests of mergekit's configuration files (mergecfg.h): a configuration with every key read into
// the right fields and positions, a configuration of slices, and every refusal with the file,
// line and column of its message: unknown keys (at the top, in models[i], in a slice, in a
// slice's source, in a condition), wrong types, keys given twice, merge_method missing, both or
// neither of models and slices, YAML syntax errors, non-finite numbers, malformed layer ranges,
// anchors, tags, a second document, the unsupported keys and the limits.
// `test_mergecfg --write-corpus DIR` writes the good configurations and the refused texts out
// instead, as the seed corpus of fuzz_yaml.
#include <errno.h>
#include <sys/stat.h>

#include "check.h"
#include "mergecfg.h"
#include "testfs.h"

static const char every_key[] =
    "# a configuration with every key\n"                    // 1
    "merge_method: dare_ties\n"                              // 2
    "base_model: org/base\n"                                 // 3
    "models:\n"                                              // 4
    "  - model: org/base\n"                                  // 5
    "  - model: ./ft-math+./lora-math\n"                     // 6
    "    parameters:\n"                                      // 7
    "      weight: 0.7\n"                                    // 8
    "      density: [0.2, 0.4, 0.6]\n"                       // 9
    "  - model: \"ft code\"\n"                               // 10
    "    parameters:\n"                                      // 11
    "      weight:\n"                                        // 12
    "        - filter: self_attn\n"                          // 13
    "          value: 0.5\n"                                 // 14
    "        - value: 1\n"                                   // 15
    "      density: [{filter: mlp, value: 0.3}]\n"           // 16
    "      normalize: true\n"                                // 17
    "      flag: False\n"                                    // 18
    "parameters:\n"                                          // 19
    "  normalize: false\n"                                   // 20
    "  lambda: 1e-3\n"                                       // 21
    "  t: [0, .5, 1]\n"                                      // 22
    "  label: 'yes'\n"                                       // 23
    "  mode: yes\n"                                          // 24
    "dtype: bfloat16\n"                                      // 25
    "out_dtype: float16\n"                                   // 26
    "tokenizer_source: base\n"                               // 27
    "chat_template: chatml\n"                                // 28
    "random_seed: 18446744073709551615\n";                   // 29

static const char slices_cfg[] =
    "merge_method: passthrough\n"                            // 1
    "slices:\n"                                              // 2
    "  - sources:\n"                                         // 3
    "      - model: a\n"                                     // 4
    "        layer_range: [0, 4]\n"                          // 5
    "  - sources:\n"                                         // 6
    "      - model: b\n"                                     // 7
    "        layer_range: [2, 6]\n"                          // 8
    "        parameters:\n"                                  // 9
    "          scale: [{filter: o_proj, value: 0}, {value: 1}]\n"  // 10
    "      - {model: c, layer_range: [10, 14]}\n"            // 11
    "dtype: float16\n";                                      // 12

static lm_mergecfg *parse(const char *text, lm_err *err)
{
    lm_mergecfg *c = NULL;
    CHECK_OK(lm_mergecfg_parse(&c, "cfg.yml", text, strlen(text), err), err);
    return c;
}

static const lm_pval *param(const lm_params *ps, const char *name)
{
    const lm_param *p = lm_params_find(ps, name);
    return p ? p->value : NULL;
}

static void test_every_key(void)
{
    lm_err err = {0};
    lm_mergecfg *c = parse(every_key, &err);
    if (!c)
        return;
    CHECK(strcmp(c->path, "cfg.yml") == 0);
    CHECK(c->text_len == strlen(every_key) && strcmp(c->text, every_key) == 0);
    CHECK(strcmp(c->merge_method, "dare_ties") == 0 && c->method_line == 2 && c->method_col == 15);
    CHECK(strcmp(c->base_model, "org/base") == 0 && c->base_line == 3 && c->base_col == 13);
    CHECK(c->n_slices == 0 && c->slices == NULL);
    CHECK(c->n_models == 3);
    if (c->n_models == 3) {
        const lm_cfg_model *m = c->models;
        CHECK(strcmp(m[0].model, "org/base") == 0 && m[0].line == 5 && m[0].col == 12 && m[0].params.n == 0);
        CHECK(m[0].layer_range[0] == -1 && m[0].layer_range[1] == -1);
        CHECK(strcmp(m[1].model, "./ft-math+./lora-math") == 0 && m[1].line == 6 && m[1].params.n == 2);
        const lm_param *w = lm_params_find(&m[1].params, "weight");
        CHECK(w && w->line == 8 && w->col == 7 && w->value->kind == LM_PVAL_NUMBER && w->value->num == 0.7 &&
              w->value->line == 8 && w->value->col == 15);
        const lm_pval *d = param(&m[1].params, "density");
        CHECK(d && d->kind == LM_PVAL_GRADIENT && d->n_grad == 3 && d->grad[0] == 0.2 && d->grad[1] == 0.4 &&
              d->grad[2] == 0.6 && d->line == 9 && d->col == 16);
        CHECK(strcmp(m[2].model, "ft code") == 0 && m[2].line == 10 && m[2].col == 12 && m[2].params.n == 4);
        const lm_pval *wc = param(&m[2].params, "weight");
        CHECK(wc && wc->kind == LM_PVAL_CONDS && wc->n_conds == 2 && wc->line == 13 && wc->col == 9);
        if (wc && wc->kind == LM_PVAL_CONDS && wc->n_conds == 2) {
            CHECK(strcmp(wc->conds[0].filter, "self_attn") == 0 && wc->conds[0].value->num == 0.5 &&
                  wc->conds[0].value->line == 14 && wc->conds[0].value->col == 18);
            CHECK(wc->conds[1].filter == NULL && wc->conds[1].value->kind == LM_PVAL_NUMBER &&
                  wc->conds[1].value->num == 1 && wc->conds[1].value->line == 15);
        }
        const lm_pval *dc = param(&m[2].params, "density");
        CHECK(dc && dc->kind == LM_PVAL_CONDS && dc->n_conds == 1 && strcmp(dc->conds[0].filter, "mlp") == 0 &&
              dc->conds[0].value->num == 0.3);
        const lm_pval *nb = param(&m[2].params, "normalize"), *fb = param(&m[2].params, "flag");
        CHECK(nb && nb->kind == LM_PVAL_BOOL && nb->num == 1);
        CHECK(fb && fb->kind == LM_PVAL_BOOL && fb->num == 0);
    }
    CHECK(c->params.n == 5);
    const lm_pval *v = param(&c->params, "normalize");
    CHECK(v && v->kind == LM_PVAL_BOOL && v->num == 0);
    v = param(&c->params, "lambda");
    CHECK(v && v->kind == LM_PVAL_NUMBER && v->num == 1e-3);
    v = param(&c->params, "t");
    CHECK(v && v->kind == LM_PVAL_GRADIENT && v->n_grad == 3 && v->grad[1] == 0.5);
    // each number's own place, for messages about one of them
    CHECK(v && v->grad_lines && v->grad_cols && v->grad_lines[0] == 22 && v->grad_cols[0] == 7 &&
          v->grad_lines[1] == 22 && v->grad_cols[1] == 10 && v->grad_lines[2] == 22 && v->grad_cols[2] == 14);
    v = param(&c->params, "label");
    CHECK(v && v->kind == LM_PVAL_STRING && strcmp(v->str, "yes") == 0);
    v = param(&c->params, "mode");  // YAML 1.1's yes is a string here
    CHECK(v && v->kind == LM_PVAL_STRING && strcmp(v->str, "yes") == 0 && v->line == 24 && v->col == 9);
    CHECK(strcmp(c->dtype, "bfloat16") == 0 && c->dtype_line == 25);
    CHECK(strcmp(c->out_dtype, "float16") == 0 && c->out_dtype_line == 26);
    CHECK(strcmp(c->tokenizer_source, "base") == 0 && c->tokenizer_line == 27);
    CHECK(strcmp(c->chat_template, "chatml") == 0 && c->chat_template_line == 28);
    CHECK(c->has_seed && c->random_seed == UINT64_MAX && c->seed_line == 29);
    lm_mergecfg_free(c);

    // the least a configuration holds; absent keys read as absent, null ones too
    c = parse("merge_method: linear\nmodels:\n- model: a\n  parameters: ~\nbase_model: null\ndtype:\nparameters:\n",
              &err);
    if (c) {
        CHECK(c->n_models == 1 && c->models[0].params.n == 0 && c->params.n == 0);
        CHECK(!c->base_model && c->base_line == 0 && !c->dtype && c->dtype_line == 0 && !c->out_dtype &&
              !c->tokenizer_source && !c->chat_template && !c->has_seed && c->seed_line == 0);
    }
    lm_mergecfg_free(c);
    // mergekit's tokenizer block with a source is tokenizer_source; null or empty parts count as absent
    c = parse("merge_method: linear\nmodels:\n- model: a\ntokenizer:\n  tokens: {}\n  pad_to_multiple_of: ~\n"
              "  source: m/b\n", &err);
    CHECK(c && c->tokenizer_source && strcmp(c->tokenizer_source, "m/b") == 0 && c->tokenizer_line == 7);
    lm_mergecfg_free(c);
    c = parse("merge_method: linear\nmodels:\n- model: a\ntokenizer: ~\ntokenizer_source: base\n", &err);
    CHECK(c && c->tokenizer_source && strcmp(c->tokenizer_source, "base") == 0 && c->tokenizer_line == 5);
    lm_mergecfg_free(c);
    // a null tokenizer_source after the block leaves the block's source, and the key messages name
    c = parse("merge_method: linear\nmodels:\n- model: a\ntokenizer:\n  source: m/b\ntokenizer_source: ~\n", &err);
    CHECK(c && c->tokenizer_source && strcmp(c->tokenizer_source, "m/b") == 0 && c->tokenizer_line == 5 &&
          strcmp(c->tokenizer_key, "tokenizer.source") == 0);
    lm_mergecfg_free(c);
    // JSON is YAML too
    c = parse("{\"merge_method\": \"ties\", \"models\": [{\"model\": \"a\", \"parameters\": {\"density\": 0.5}}], "
              "\"random_seed\": 7}", &err);
    CHECK(c && c->n_models == 1 && param(&c->models[0].params, "density")->num == 0.5 && c->random_seed == 7);
    lm_mergecfg_free(c);
    lm_mergecfg_free(NULL);
}

static void test_slices(void)
{
    lm_err err = {0};
    lm_mergecfg *c = parse(slices_cfg, &err);
    if (!c)
        return;
    CHECK(c->n_models == 0 && c->models == NULL && c->n_slices == 2);
    if (c->n_slices == 2) {
        const lm_cfg_slice *s = c->slices;
        CHECK(s[0].n_sources == 1 && s[0].line == 3 && s[0].col == 5);
        CHECK(strcmp(s[0].sources[0].model, "a") == 0 && s[0].sources[0].line == 4 && s[0].sources[0].col == 16);
        CHECK(s[0].sources[0].layer_range[0] == 0 && s[0].sources[0].layer_range[1] == 4);
        CHECK(s[1].n_sources == 2 && s[1].line == 6);
        if (s[1].n_sources == 2) {
            CHECK(strcmp(s[1].sources[0].model, "b") == 0 && s[1].sources[0].layer_range[0] == 2 &&
                  s[1].sources[0].layer_range[1] == 6);
            const lm_pval *sc = param(&s[1].sources[0].params, "scale");
            CHECK(sc && sc->kind == LM_PVAL_CONDS && sc->n_conds == 2 && sc->line == 10 && sc->col == 18);
            CHECK(strcmp(s[1].sources[1].model, "c") == 0 && s[1].sources[1].layer_range[0] == 10 &&
                  s[1].sources[1].layer_range[1] == 14 && s[1].sources[1].line == 11 && s[1].sources[1].params.n == 0);
        }
    }
    CHECK(strcmp(c->merge_method, "passthrough") == 0 && strcmp(c->dtype, "float16") == 0);
    lm_mergecfg_free(c);
}

// ---- refusals ---------------------------------------------------------------------------------------

#define HEAD "merge_method: ties\nmodels:\n  - model: a\n"  // lines 1-3

typedef struct bad_case {
    const char *text;
    lm_status want;
    const char *needle;
} bad_case;

static const bad_case bad_cases[] = {
    // unknown keys
    {HEAD "base_modle: b\n", LM_ERR_FORMAT, "cfg.yml:4:1: unknown key 'base_modle'; did you mean 'base_model'?"},
    {HEAD "zzz: 1\n", LM_ERR_FORMAT, "cfg.yml:4:1: unknown key 'zzz'"},
    {HEAD "  - model: b\n    paramters: {}\n", LM_ERR_FORMAT,
     "cfg.yml:5:5: models[1]: unknown key 'paramters'; did you mean 'parameters'?"},
    {"merge_method: passthrough\nslices:\n  - sources:\n      - model: a\n        layer_rnage: [0, 2]\n",
     LM_ERR_FORMAT, "cfg.yml:5:9: slices[0].sources[0]: unknown key 'layer_rnage'; did you mean 'layer_range'?"},
    {"merge_method: passthrough\nslices:\n  - source:\n      - model: a\n", LM_ERR_FORMAT,
     "cfg.yml:3:5: slices[0]: unknown key 'source'; did you mean 'sources'?"},
    {HEAD "parameters:\n  w: [{filtr: mlp, value: 1}]\n", LM_ERR_FORMAT,
     "cfg.yml:5:8: parameters.w[0]: unknown key 'filtr'; did you mean 'filter'?"},
    // wrong types
    {"merge_method: ties\nmodels: a\n", LM_ERR_FORMAT, "cfg.yml:2:9: models: a list is needed, not a string"},
    {"merge_method: [ties]\nmodels:\n  - model: a\n", LM_ERR_FORMAT,
     "cfg.yml:1:15: merge_method: a string is needed, not a list"},
    {"merge_method: ties\nmodels:\n  - model: 5\n", LM_ERR_FORMAT,
     "cfg.yml:3:12: models[0].model: a string is needed, not a number (quote it to make it a string)"},
    {"merge_method: ties\nmodels:\n  - model: \"\"\n", LM_ERR_FORMAT, "cfg.yml:3:12: models[0].model: an empty string"},
    {"merge_method: ties\nmodels:\n  - a\n", LM_ERR_FORMAT,
     "cfg.yml:3:5: models[0]: a mapping of keys is needed, not a string"},
    {"merge_method: ties\nmodels: []\n", LM_ERR_FORMAT, "cfg.yml:2:9: models: the list is empty"},
    {"merge_method: ties\nmodels:\n  - parameters: {}\n", LM_ERR_FORMAT, "cfg.yml:3:5: models[0]: 'model' is missing"},
    {HEAD "parameters: [1]\n", LM_ERR_FORMAT, "cfg.yml:4:13: parameters: a mapping of keys is needed, not a list"},
    {HEAD "dtype: {a: 1}\n", LM_ERR_FORMAT, "cfg.yml:4:8: dtype: a string is needed, not a mapping"},
    {HEAD "chat_template: true\n", LM_ERR_FORMAT, "cfg.yml:4:16: chat_template: a string is needed, not true/false"},
    {HEAD "random_seed: -1\n", LM_ERR_FORMAT, "cfg.yml:4:14: random_seed: -1 is negative"},
    {HEAD "random_seed: 1.5\n", LM_ERR_FORMAT, "cfg.yml:4:14: random_seed: a whole number is needed, not a fraction"},
    {HEAD "random_seed: '7'\n", LM_ERR_FORMAT, "cfg.yml:4:14: random_seed: a whole number is needed, not a string"},
    {HEAD "random_seed: 18446744073709551616\n", LM_ERR_FORMAT,
     "cfg.yml:4:14: random_seed: 18446744073709551616 is out of range"},
    {HEAD "? [a]\n: 1\n", LM_ERR_FORMAT, "cfg.yml:4:3: a key is a string, not a list"},
    // keys given twice
    {HEAD "merge_method: dare\n", LM_ERR_FORMAT,
     "cfg.yml:4:1: key 'merge_method' appears twice (first at line 1, column 1)"},
    {HEAD "parameters:\n  w: 1\n  w: 2\n", LM_ERR_FORMAT,
     "cfg.yml:6:3: parameters: key 'w' appears twice (first at line 5, column 3)"},
    {HEAD "parameters:\n  w: [{value: 1, value: 2}]\n", LM_ERR_FORMAT,
     "cfg.yml:5:18: parameters.w[0]: key 'value' appears twice (first at line 5, column 8)"},
    // merge_method, models and slices
    {"models:\n  - model: a\n", LM_ERR_FORMAT, "cfg.yml:1:1: 'merge_method' is missing"},
    {"merge_method: ~\nmodels:\n  - model: a\n", LM_ERR_FORMAT, "cfg.yml:1:15: merge_method: a string is needed, not null"},
    {HEAD "slices:\n  - sources: [{model: a, layer_range: [0, 1]}]\n", LM_ERR_FORMAT,
     "cfg.yml:4:1: both 'models' (line 2) and 'slices' are given: a configuration has one of them"},
    {"merge_method: ties\nslices:\n  - sources: [{model: a, layer_range: [0, 1]}]\nmodels:\n  - model: a\n",
     LM_ERR_FORMAT, "cfg.yml:4:1: both 'slices' (line 2) and 'models' are given"},
    {"merge_method: ties\n", LM_ERR_FORMAT, "cfg.yml:1:1: neither 'models' nor 'slices' is given"},
    {"merge_method: ties\nmodels: ~\n", LM_ERR_FORMAT, "cfg.yml:1:1: neither 'models' nor 'slices' is given"},
    // YAML syntax
    {"merge_method: ties\nmodels: [a, b\n", LM_ERR_FORMAT,
     "cfg.yml:3:1: not valid YAML: did not find expected ',' or ']' (while parsing a flow sequence at line 2, column 9)"},
    {"merge_method: ties: x\n", LM_ERR_FORMAT, "cfg.yml:1:19: not valid YAML: mapping values are not allowed in this context"},
    {"merge_method: ties\n\tmodels: x\n", LM_ERR_FORMAT, "cfg.yml:2:1: not valid YAML: found a tab character that violates indentation"},
    {"merge_method: \"ties\n", LM_ERR_FORMAT, "cfg.yml:2:1: not valid YAML: found unexpected end of stream"},
    {"merge_method: \xff\n", LM_ERR_FORMAT, "cfg.yml:1:15: not valid YAML: invalid leading UTF-8 octet (#FF)"},
    {"", LM_ERR_FORMAT, "cfg.yml:1:1: the configuration is empty"},
    {"# nothing\n", LM_ERR_FORMAT, "cfg.yml:1:1: the configuration is empty"},
    {"- merge_method: ties\n", LM_ERR_FORMAT, "cfg.yml:1:1: a configuration is a mapping of keys (merge_method, "
                                              "models, ...), not a list"},
    {HEAD "---\nmerge_method: dare\n", LM_ERR_FORMAT, "cfg.yml:4:1: a second YAML document"},
    {"merge_method: &m ties\nmodels:\n  - model: a\n", LM_ERR_FORMAT,
     "cfg.yml:1:15: anchor '&m': anchors and aliases are not supported"},
    {"merge_method: *m\nmodels:\n  - model: a\n", LM_ERR_FORMAT,
     "cfg.yml:1:15: alias '*m': anchors and aliases are not supported"},
    {"merge_method: !!str ties\nmodels:\n  - model: a\n", LM_ERR_FORMAT,
     "cfg.yml:1:15: tag 'tag:yaml.org,2002:str': tags are not supported"},
    {"merge_method: \"ti\\0es\"\nmodels:\n  - model: a\n", LM_ERR_FORMAT,
     "cfg.yml:1:15: a string holding a NUL character"},
    // numbers
    {HEAD "parameters:\n  w: .inf\n", LM_ERR_FORMAT, "cfg.yml:5:6: parameters.w: .inf is not a finite number"},
    {HEAD "parameters:\n  w: [0, -.Inf]\n", LM_ERR_FORMAT, "cfg.yml:5:10: parameters.w[1]: -.Inf is not a finite number"},
    {HEAD "parameters:\n  w: [{filter: mlp, value: 1e400}]\n", LM_ERR_FORMAT,
     "cfg.yml:5:28: parameters.w[0].value: 1e400 is not a finite number"},
    {HEAD "parameters:\n  w: .nan\n", LM_ERR_FORMAT, "cfg.yml:5:6: parameters.w: .nan is not a finite number"},
    {HEAD "parameters:\n  w: 010\n", LM_ERR_FORMAT,
     "cfg.yml:5:6: parameters.w: '010' is a number to YAML 1.1 in a form llmerge does not read"},
    {HEAD "parameters:\n  w: 1_000\n", LM_ERR_FORMAT, "cfg.yml:5:6: parameters.w: '1_000' is a number to YAML 1.1"},
    // settings
    {HEAD "parameters:\n  w: [0.5, {value: 1}]\n", LM_ERR_FORMAT,
     "cfg.yml:5:6: parameters.w: a list mixing numbers and {filter, value} mappings (item 1 is a mapping, item 0 a "
     "number)"},
    {HEAD "parameters:\n  w: [{value: 1}, 0.5]\n", LM_ERR_FORMAT,
     "cfg.yml:5:6: parameters.w: a list mixing numbers and {filter, value} mappings"},
    {HEAD "parameters:\n  w: []\n", LM_ERR_FORMAT,
     "cfg.yml:5:6: parameters.w: an empty list (a gradient needs at least one number)"},
    {HEAD "parameters:\n  w: [a, b]\n", LM_ERR_FORMAT,
     "cfg.yml:5:7: parameters.w[0]: a number or a {filter, value} mapping is needed; this list's items are numbers "
     "(a gradient), and this one is a string"},
    {HEAD "parameters:\n  w: [0, true]\n", LM_ERR_FORMAT, "cfg.yml:5:10: parameters.w[1]: a number or a {filter, "
                                                          "value} mapping is needed"},
    {HEAD "parameters:\n  w: [[0, 1]]\n", LM_ERR_FORMAT, "cfg.yml:5:7: parameters.w[0]:"},
    {HEAD "parameters:\n  w: [{value: {value: 1}}]\n", LM_ERR_FORMAT,
     "cfg.yml:5:15: parameters.w[0].value: a number, true/false, a string or a list of numbers is needed, not a "
     "mapping (conditions do not nest)"},
    {HEAD "parameters:\n  w: [{value: [{value: 1}]}]\n", LM_ERR_FORMAT, "cfg.yml:5:16: parameters.w[0].value[0]:"},
    // one condition on its own, not in a list: mergekit fails on it
    {HEAD "parameters:\n  w: {filter: mlp, value: 1}\n", LM_ERR_FORMAT,
     "cfg.yml:5:6: parameters.w: a {filter, value} mapping on its own is not a setting (mergekit fails on it): write "
     "it as a list of conditions"},
    {HEAD "  - model: b\n    parameters:\n      weight:\n        filter: mlp\n        value: 1\n", LM_ERR_FORMAT,
     "cfg.yml:7:9: models[1].parameters.weight: a {filter, value} mapping on its own"},
    {HEAD "parameters:\n  w:\n", LM_ERR_FORMAT, "cfg.yml:5:5: parameters.w: a value is needed, not null"},
    {HEAD "parameters:\n  w: [{filter: mlp}]\n", LM_ERR_FORMAT,
     "cfg.yml:5:7: parameters.w[0]: 'value' is missing (a condition is {filter, value})"},
    {HEAD "parameters:\n  w: [{filter: 3, value: 1}]\n", LM_ERR_FORMAT,
     "cfg.yml:5:16: parameters.w[0].filter: a string is needed, not a number"},
    // layer ranges
    {"merge_method: passthrough\nslices:\n  - sources:\n      - model: a\n        layer_range: [3, 1]\n",
     LM_ERR_FORMAT, "cfg.yml:5:22: slices[0].sources[0].layer_range: [3, 1] is empty: FROM must be below TO"},
    {"merge_method: passthrough\nslices:\n  - sources:\n      - model: a\n        layer_range: [2, 2]\n",
     LM_ERR_FORMAT, "cfg.yml:5:22: slices[0].sources[0].layer_range: [2, 2] is empty"},
    {"merge_method: passthrough\nslices:\n  - sources:\n      - model: a\n        layer_range: [1]\n", LM_ERR_FORMAT,
     "cfg.yml:5:22: slices[0].sources[0].layer_range: [FROM, TO] is needed (two whole numbers, 0 <= FROM < TO), not "
     "a list of one item"},
    {"merge_method: passthrough\nslices:\n  - sources:\n      - model: a\n        layer_range: [0, 1, 2]\n",
     LM_ERR_FORMAT, "cfg.yml:5:22: slices[0].sources[0].layer_range: [FROM, TO] is needed (two whole numbers, 0 <= "
     "FROM < TO), not a list of more than two items"},
    {"merge_method: passthrough\nslices:\n  - sources:\n      - model: a\n        layer_range: 0-4\n", LM_ERR_FORMAT,
     "cfg.yml:5:22: slices[0].sources[0].layer_range: [FROM, TO] is needed (two whole numbers, 0 <= FROM < TO), not "
     "a string"},
    {"merge_method: passthrough\nslices:\n  - sources:\n      - model: a\n        layer_range: [a, 2]\n",
     LM_ERR_FORMAT, "cfg.yml:5:23: slices[0].sources[0].layer_range[0]: a whole number is needed, not a string"},
    {"merge_method: passthrough\nslices:\n  - sources:\n      - model: a\n        layer_range: [-1, 2]\n",
     LM_ERR_FORMAT, "cfg.yml:5:23: slices[0].sources[0].layer_range[0]: -1 is negative"},
    {"merge_method: passthrough\nslices:\n  - sources:\n      - model: a\n        layer_range: [0, 2.5]\n",
     LM_ERR_FORMAT, "cfg.yml:5:26: slices[0].sources[0].layer_range[1]: a whole number is needed, not a fraction"},
    {"merge_method: passthrough\nslices:\n  - sources:\n      - model: a\n", LM_ERR_FORMAT,
     "cfg.yml:4:9: slices[0].sources[0]: 'layer_range' is missing"},
    {"merge_method: passthrough\nslices:\n  - sources:\n      - {model: a, layer_range: [0, 4]}\n"
     "      - {model: b, layer_range: [0, 3]}\n", LM_ERR_FORMAT,
     "cfg.yml:5:9: slices[0].sources[1]: 3 layers, where slices[0].sources[0] has 4"},
    {"merge_method: passthrough\nslices:\n  - {}\n", LM_ERR_FORMAT, "cfg.yml:3:5: slices[0]: 'sources' is missing"},
    {"merge_method: passthrough\nslices:\n  - sources: []\n", LM_ERR_FORMAT,
     "cfg.yml:3:14: slices[0].sources: the list is empty"},
    // mergekit's keys llmerge does not take
    {HEAD "modules:\n  text: {}\n", LM_ERR_UNSUPPORTED, "cfg.yml:4:1: key 'modules' (mergekit's merges of several "
                                                         "modules) is not supported"},
    {HEAD "tokenizer:\n  source: union\n", LM_ERR_UNSUPPORTED,
     "cfg.yml:5:11: tokenizer.source: 'union' (a vocabulary merged from every model's) is not supported"},
    {HEAD "tokenizer:\n  pad_to_multiple_of: ~\n", LM_ERR_UNSUPPORTED,
     "cfg.yml:4:1: tokenizer: without 'source', mergekit builds a 'union'"},
    {HEAD "tokenizer:\n  source: ~\n", LM_ERR_FORMAT, "cfg.yml:5:11: tokenizer.source: null is not a source"},
    {HEAD "tokenizer:\n  source: base\n  pad_to_multiple_of: 64\n", LM_ERR_UNSUPPORTED,
     "cfg.yml:6:3: tokenizer.pad_to_multiple_of (the vocabulary padded with rows) is not supported"},
    {HEAD "tokenizer:\n  source: base\n  tokens:\n    <x>: {source: a}\n", LM_ERR_UNSUPPORTED,
     "cfg.yml:6:3: tokenizer.tokens (embeddings chosen per token) is not supported"},
    {HEAD "tokenizer:\n  sourc: base\n", LM_ERR_FORMAT, "cfg.yml:5:3: tokenizer: unknown key 'sourc'; did you mean "
                                                        "'source'?"},
    {HEAD "tokenizer:\n  source: [base]\n", LM_ERR_FORMAT, "cfg.yml:5:11: tokenizer.source: a string is needed"},
    {HEAD "tokenizer: base\n", LM_ERR_FORMAT, "cfg.yml:4:12: tokenizer: a mapping of keys is needed, not a string"},
    {HEAD "tokenizer_source: base\ntokenizer:\n  source: base\n", LM_ERR_FORMAT,
     "cfg.yml:5:1: tokenizer and tokenizer_source (line 4) are both given: give one"},
    {HEAD "tokenizer:\n  source: base\ntokenizer_source: base\n", LM_ERR_FORMAT,
     "cfg.yml:6:1: tokenizer_source and tokenizer (line 4) are both given: give one"},
    {HEAD "tokenizer_source: union\n", LM_ERR_UNSUPPORTED,
     "cfg.yml:4:19: tokenizer_source: 'union' (a vocabulary merged from every model's) is not supported"},
    {"merge_method: passthrough\nslices:\n  - sources: [{model: a, layer_range: [0, 1]}]\n    parameters: {w: 1}\n",
     LM_ERR_UNSUPPORTED, "cfg.yml:4:5: slices[0]: a slice's 'parameters' is not supported"},
    {"merge_method: passthrough\nslices:\n  - sources: [{model: a, layer_range: [0, 1]}]\n    residual_weight: 1\n",
     LM_ERR_UNSUPPORTED, "cfg.yml:4:5: slices[0]: a slice's 'residual_weight' is not supported"},
};

static void test_bad(void)
{
    for (size_t i = 0; i < sizeof bad_cases / sizeof bad_cases[0]; i++) {
        lm_err err = {0};
        lm_mergecfg *c = (lm_mergecfg *)&err;  // must come back NULL
        const char *t = bad_cases[i].text;
        lm_status s = lm_mergecfg_parse(&c, "cfg.yml", t, strlen(t), &err);
        CHECK_MSG(s == bad_cases[i].want && strstr(err.msg, bad_cases[i].needle) == err.msg &&
                      c == NULL,
                  "case %zu: %s \"%s\", wanted %s with \"%s\"", i, lm_status_name(s), err.msg,
                  lm_status_name(bad_cases[i].want), bad_cases[i].needle);
        if (s == LM_OK)
            lm_mergecfg_free(c);
    }
}

// The limits: size, depth, number of values, string length.
static void test_limits(void)
{
    lm_err err = {0};
    lm_mergecfg *c = NULL;
    lm_buf b = {0};

    // nesting: 31 lists under parameters.w (depth 33) is too deep; 29 (depth 31) reads to the
    // refusal of a nested list as a setting
    lm_buf_str(&b, HEAD "parameters:\n  w: ");
    for (int i = 0; i < 31; i++)
        lm_buf_str(&b, "[");
    CHECK_FAILS(lm_mergecfg_parse(&c, "cfg.yml", b.p, b.len, &err), LM_ERR_FORMAT,
                "cfg.yml:5:36: lists and mappings nested more than 32 deep", &err);
    CHECK(c == NULL);
    free(b.p);
    memset(&b, 0, sizeof b);
    lm_buf_str(&b, HEAD "parameters:\n  w: ");
    for (int i = 0; i < 29; i++)
        lm_buf_str(&b, "[");
    for (int i = 0; i < 29; i++)
        lm_buf_str(&b, "]");
    CHECK_FAILS(lm_mergecfg_parse(&c, "cfg.yml", b.p, b.len, &err), LM_ERR_FORMAT, "cfg.yml:5:7: parameters.w[0]: ",
                &err);
    free(b.p);
    memset(&b, 0, sizeof b);

    // values: 12 nodes up to the list, so a gradient of 99,988 points makes 100,000 values
    // and reads; one more point does not
    for (int n = 99988; n <= 99989; n++) {
        lm_buf_str(&b, HEAD "parameters:\n  w: [0");
        for (int i = 1; i < n; i++)
            lm_buf_str(&b, ",1");
        lm_buf_str(&b, "]\n");
        c = NULL;
        if (n == 99988) {
            CHECK_OK(lm_mergecfg_parse(&c, "cfg.yml", b.p, b.len, &err), &err);
            CHECK(c && c->params.n == 1 && c->params.items[0].value->n_grad == n);
            lm_mergecfg_free(c);
        } else {
            CHECK_FAILS(lm_mergecfg_parse(&c, "cfg.yml", b.p, b.len, &err), LM_ERR_FORMAT,
                        "more than 100000 values: a configuration holds fewer", &err);
            CHECK(c == NULL);
        }
        free(b.p);
        memset(&b, 0, sizeof b);
    }

    // strings: 64 KiB is allowed, one byte more is not
    for (size_t len = LM_MERGECFG_MAX_STRING; len <= LM_MERGECFG_MAX_STRING + 1; len++) {
        lm_buf_str(&b, "merge_method: ties\nmodels:\n  - model: ");
        for (size_t i = 0; i < len; i++)
            lm_buf_put(&b, "m", 1);
        lm_buf_str(&b, "\n");
        c = NULL;
        lm_status s = lm_mergecfg_parse(&c, "cfg.yml", b.p, b.len, &err);
        if (len == LM_MERGECFG_MAX_STRING) {
            CHECK(s == LM_OK && c && strlen(c->models[0].model) == len);
        } else {
            CHECK_MSG(s == LM_ERR_FORMAT && strstr(err.msg, "cfg.yml:3:12: a string of 65537 bytes, more than the "
                                                            "65536 allowed"), "%s", err.msg);
            CHECK(c == NULL);
        }
        lm_mergecfg_free(c);
        free(b.p);
        memset(&b, 0, sizeof b);
    }

    // the file: 4 MiB at most
    size_t big = LM_MERGECFG_MAX_BYTES + 1;
    char *text = malloc(big);
    memset(text, ' ', big);
    CHECK_FAILS(lm_mergecfg_parse(&c, "cfg.yml", text, big, &err), LM_ERR_FORMAT,
                "cfg.yml: 4194305 bytes, more than the 4194304 a configuration may have", &err);
    free(text);
}

// Many keys (the hashed check of keys given twice).
static void test_many_keys(void)
{
    lm_buf b = {0};
    lm_buf_str(&b, HEAD "parameters:\n");
    for (int i = 0; i < 40; i++)
        lm_buf_fmt(&b, "  p%d: %d\n", i, i);
    lm_err err = {0};
    lm_mergecfg *c = NULL;
    CHECK_OK(lm_mergecfg_parse(&c, "cfg.yml", b.p, b.len, &err), &err);
    CHECK(c && c->params.n == 40 && param(&c->params, "p39")->num == 39 && param(&c->params, "p0")->line == 5);
    lm_mergecfg_free(c);
    lm_buf_str(&b, "  p17: 3\n");
    CHECK_FAILS(lm_mergecfg_parse(&c, "cfg.yml", b.p, b.len, &err), LM_ERR_FORMAT,
                "cfg.yml:45:3: parameters: key 'p17' appears twice (first at line 22, column 3)", &err);
    free(b.p);
}

static void test_load(void)
{
    char *dir = make_tmpdir();
    char *path = lm_path_join(dir, "merge.yml");
    lm_err err = {0};
    CHECK_OK(lm_write_file(path, slices_cfg, strlen(slices_cfg), &err), &err);
    lm_mergecfg *c = NULL;
    CHECK_OK(lm_mergecfg_load(&c, path, &err), &err);
    CHECK(c && strcmp(c->path, path) == 0 && strcmp(c->text, slices_cfg) == 0 && c->n_slices == 2);
    lm_mergecfg_free(c);

    const char *bad = HEAD "densty: 1\n";
    CHECK_OK(lm_write_file(path, bad, strlen(bad), &err), &err);
    c = (lm_mergecfg *)&err;
    char *want = lm_strfmt("%s:4:1: unknown key 'densty'", path);
    CHECK_FAILS(lm_mergecfg_load(&c, path, &err), LM_ERR_FORMAT, want, &err);
    CHECK(c == NULL);
    free(want);

    char *missing = lm_path_join(dir, "nope.yml");
    lm_status s = lm_mergecfg_load(&c, missing, &err);
    CHECK(s != LM_OK && c == NULL && strstr(err.msg, missing));
    CHECK(lm_mergecfg_load(&c, dir, &err) != LM_OK && c == NULL);  // a directory
    free(missing);
    free(path);
    remove_tmpdir(dir);
}

static int write_corpus(const char *dir)
{
    if (mkdir(dir, 0755) != 0 && errno != EEXIST) {
        perror(dir);
        return 1;
    }
    lm_err err;
    const char *good[] = {every_key, slices_cfg};
    int n = 0;
    for (size_t i = 0; i < sizeof good / sizeof good[0]; i++) {
        char *p = lm_strfmt("%s/good-%zu.yml", dir, i);
        if (lm_write_file(p, good[i], strlen(good[i]), &err) != LM_OK)
            return fprintf(stderr, "%s\n", err.msg), 1;
        free(p);
        n++;
    }
    for (size_t i = 0; i < sizeof bad_cases / sizeof bad_cases[0]; i++) {
        char *p = lm_strfmt("%s/bad-%03zu.yml", dir, i);
        if (lm_write_file(p, bad_cases[i].text, strlen(bad_cases[i].text), &err) != LM_OK)
            return fprintf(stderr, "%s\n", err.msg), 1;
        free(p);
        n++;
    }
    printf("%d seeds in %s\n", n, dir);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc == 3 && strcmp(argv[1], "--write-corpus") == 0)
        return write_corpus(argv[2]);
    test_every_key();
    test_slices();
    test_bad();
    test_limits();
    test_many_keys();
    test_load();
    return check_report("test_mergecfg");
}
