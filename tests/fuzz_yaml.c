// libFuzzer target for mergekit's configuration files: any byte string goes through
// lm_mergecfg_parse. It must either give a configuration or refuse the text with LM_ERR_FORMAT,
// LM_ERR_UNSUPPORTED or LM_ERR_NOMEM, a message that starts with the file's name and, for
// anything but the size, a line and column inside the text, and no configuration; never a crash,
// a leak or an out-of-bounds read (run under ASan and UBSan). A configuration that parses has
// the shape mergecfg.h promises, and every parameter setting in it (global, per model, per
// slice source) is evaluated, and looked up as a number, for a few tensor names at a few
// positions. The same bytes also go through the command-line form's parser.
#include <math.h>
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "mergecfg.h"
#include "params.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static const char *const tensors[] = {
    "model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.layers.3.mlp.down_proj.weight",
    "model.layers.31.input_layernorm.weight", "model.norm.weight", "lm_head.weight", NULL,
};

static void check_pval(const lm_pval *v, int depth)
{
    if (!v || depth > 2)
        abort();
    switch (v->kind) {
    case LM_PVAL_NUMBER:
    case LM_PVAL_BOOL:
        if (!isfinite(v->num) || (v->kind == LM_PVAL_BOOL && v->num != 0 && v->num != 1))
            abort();
        break;
    case LM_PVAL_STRING:
        if (!v->str)
            abort();
        break;
    case LM_PVAL_GRADIENT:
        if (v->n_grad < 1 || !v->grad)
            abort();
        for (int i = 0; i < v->n_grad; i++)
            if (!isfinite(v->grad[i]))
                abort();
        break;
    case LM_PVAL_CONDS:
        if (v->n_conds < 1 || !v->conds || depth > 0)
            abort();
        for (int i = 0; i < v->n_conds; i++)
            check_pval(v->conds[i].value, depth + 1);
        break;
    default: abort();
    }
}

// Evaluates every setting of ps, alone and under `global`, on every tensor at a few positions.
static void exercise(const lm_params *ps, const lm_params *global)
{
    static const double ts[] = {0, 0.25, 1.0 / 3.0, 0.999, 1};
    for (int i = 0; i < ps->n; i++) {
        const lm_param *p = &ps->items[i];
        if (!p->name || lm_params_find(ps, p->name) != p || p->line < 1 || p->col < 1)
            abort();
        check_pval(p->value, 0);
        for (size_t n = 0; n < sizeof tensors / sizeof tensors[0]; n++) {
            for (size_t k = 0; k < sizeof ts / sizeof ts[0]; k++) {
                double t = n + 1 < sizeof tensors / sizeof tensors[0] ? lm_param_position(tensors[n], 32) : ts[k];
                lm_pval_kind kind;
                double x = 0;
                const char *s = NULL;
                if (lm_pval_eval(p->value, tensors[n], t, &kind, &x, &s)) {
                    if (kind == LM_PVAL_STRING ? !s : !isfinite(x))
                        abort();
                }
                lm_err err = {0};
                bool found = false;
                lm_status st = lm_param_number(ps, global, p->name, tensors[n], ts[k], &x, &found, &err);
                if (st != LM_OK && (st != LM_ERR_USAGE || !err.msg[0]))
                    abort();
                if (st == LM_OK && found && !isfinite(x))
                    abort();
            }
        }
    }
}

static void check_model(const lm_cfg_model *m, const lm_params *global, bool slice)
{
    if (!m->model || !m->model[0] || m->line < 1 || m->col < 1)
        abort();
    if (slice ? !(m->layer_range[0] >= 0 && m->layer_range[0] < m->layer_range[1])
              : (m->layer_range[0] != -1 || m->layer_range[1] != -1))
        abort();
    exercise(&m->params, global);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const char *text = (const char *)data;
    lm_err err = {0};
    lm_mergecfg *c = NULL;
    lm_status s = lm_mergecfg_parse(&c, "fuzz.yml", text, size, &err);
    if (s == LM_OK) {
        if (!c || !c->merge_method || c->text_len != size || memcmp(c->text, data, size) != 0 || c->text[size])
            abort();
        if ((c->n_models > 0) == (c->n_slices > 0))
            abort();
        for (int i = 0; i < c->n_models; i++)
            check_model(&c->models[i], &c->params, false);
        for (int i = 0; i < c->n_slices; i++) {
            if (c->slices[i].n_sources < 1)
                abort();
            for (int j = 0; j < c->slices[i].n_sources; j++)
                check_model(&c->slices[i].sources[j], &c->params, true);
        }
        exercise(&c->params, NULL);
        lm_mergecfg_free(c);
    } else {
        if (c || !err.msg[0] || strncmp(err.msg, "fuzz.yml:", 9) != 0)
            abort();
        if (s != LM_ERR_FORMAT && s != LM_ERR_UNSUPPORTED && s != LM_ERR_NOMEM)
            abort();
        int line = 0, col = 0;
        bool sized = strstr(err.msg, "a configuration may have") != NULL;  // the size: no position
        if (s != LM_ERR_NOMEM && !sized && (sscanf(err.msg + 9, "%d:%d:", &line, &col) != 2 || line < 1 || col < 1))
            abort();
    }

    // the command-line form on the same bytes (up to the first NUL)
    char *cli = malloc(size + 1);
    if (!cli)
        return 0;
    memcpy(cli, data, size);
    cli[size] = '\0';
    lm_pval *v = NULL;
    s = lm_pval_parse_cli(cli, &v, &err);
    if (s == LM_OK) {
        check_pval(v, 0);
        for (size_t n = 0; n < sizeof tensors / sizeof tensors[0]; n++) {
            double x = 0;
            lm_pval_kind kind;
            if (lm_pval_eval(v, tensors[n], 0.5, &kind, &x, NULL) && (kind != LM_PVAL_NUMBER || !isfinite(x)))
                abort();
        }
        lm_pval_free(v);
    } else if (v || (s != LM_ERR_USAGE && s != LM_ERR_NOMEM) || !err.msg[0]) {
        abort();
    }
    free(cli);
    return 0;
}
