// The model card of a merge (card.h): the inputs as given, the resolved options, and a command
// line making the same merge, every option that shapes the result spelled out; for llmerge run,
// the configuration itself and `llmerge run` on it.
#include <inttypes.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "card.h"
#include "merge_args.h"
#include "sparsegpt.h"
#include "util.h"

// An operand as a word of the card's command line: a path starting with '-' would read as an
// option there.
static const char *operand_word(const char *path, char *buf, size_t cap)
{
    if (path[0] != '-')
        return path;
    snprintf(buf, cap, "./%s", path);
    return buf;
}

// "1,0.5,2": the n values, each as lm_card_number writes it, into b.
static void number_list(lm_buf *b, const double *v, int n)
{
    char num[40];
    for (int i = 0; i < n; i++) {
        lm_card_number(num, sizeof num, v[i]);
        if (i)
            lm_buf_put(b, ",", 1);
        lm_buf_str(b, num);
    }
}

// Writes OUT's model card (card.h) into the temporary directory: the inputs as given, the
// resolved options, and a command line with every option that shapes the result spelled out.
lm_status lm_merge_write_card(const merge_args *a, const lm_merge_opts *o, const lm_ft *const *fts, const char *dir,
                              lm_err *err)
{
    const lm_method *m = a->m;
    const merge_uses *u = &a->use;
    int n = a->n_ft;
    lm_card_input inputs[n];
    for (int i = 0; i < n; i++)
        inputs[i] = (lm_card_input){a->fts[i], fts[i]->adapter ? "LoRA adapter" : "model", o->weights[i],
                                    u->density ? o->densities[i] : -1, a->weight_text ? a->weight_text[i] : NULL,
                                    u->density && a->density_text ? a->density_text[i] : NULL};

    // the methods whose base is one of the models take its weight first
    bool models = u->models || (u->models_only && o->models_only);
    lm_buf weights = {0}, densities = {0}, gammas = {0}, epsilons = {0};
    if (models) {
        number_list(&weights, &o->base_weight, 1);
        if (n)
            lm_buf_put(&weights, ",", 1);
    }
    number_list(&weights, o->weights, n);
    number_list(&densities, o->densities, n);
    if (u->gamma)
        number_list(&gammas, o->gammas, n);
    if (u->epsilon)
        number_list(&epsilons, o->epsilons, n);
    char t[40], max_iter[24], tol[40], topk_w[40], ram_r[40], ram_alpha[40];
    lm_card_number(ram_r, sizeof ram_r, o->ram_r);
    lm_card_number(ram_alpha, sizeof ram_alpha, o->ram_alpha);
    lm_card_number(t, sizeof t, o->t);
    lm_card_number(topk_w, sizeof topk_w, o->select_topk);
    snprintf(max_iter, sizeof max_iter, "%d", o->max_iter);
    lm_card_number(tol, sizeof tol, o->tol);
    char lambda[40], seed[24], shard[24], shard_h[64], samples[24], seq_len[24], damp[40];
    lm_card_number(lambda, sizeof lambda, o->lambda);
    snprintf(seed, sizeof seed, "%" PRIu64, o->seed);
    snprintf(shard, sizeof shard, "%" PRIu64, a->shard_size);
    char h[32];
    snprintf(shard_h, sizeof shard_h, "%s (%s bytes)", lm_format_bytes(h, sizeof h, a->shard_size), shard);
    snprintf(samples, sizeof samples, "%" PRId64, a->calib_samples);
    snprintf(seq_len, sizeof seq_len, "%" PRId64, a->seq_len);
    lm_card_number(damp, sizeof damp, SGPT_DAMP);
    const char *sign = o->sign == LM_SIGN_COUNT ? "count" : "sum", *topk = o->topk_global ? "global" : "tensor";
    const char *rescale = lm_rescale_name(o->rescale);
    bool lora = a->to_lora || a->to_lora_exact;
    const char *dtype = lm_cmd_dtype_flag(lora ? a->lora_dtype : o->out_dtype);
    char lora_r[24], lora_e[40], lora_h[96];
    snprintf(lora_r, sizeof lora_r, a->to_lora_exact ? "exact" : "%d", a->to_lora);
    lm_card_number(lora_e, sizeof lora_e, a->to_lora_energy);
    if (a->to_lora_exact)
        snprintf(lora_h, sizeof lora_h, "the inputs' factors concatenated");
    else
        snprintf(lora_h, sizeof lora_h, "rank %d%s%s%s", a->to_lora, a->to_lora_energy > 0 ? ", or the smallest keeping " : "",
             a->to_lora_energy > 0 ? lora_e : "", a->to_lora_energy > 0 ? " of each matrix's energy" : "");
    bool sgpt = u->hessians;

    // the options shown in the body, those the method uses
    lm_card_option opts[16 + a->n_calib];
    int k = 0;
    if (u->lambda)
        opts[k++] = (lm_card_option){"lambda", a->lambda_text ? a->lambda_text : lambda, false};
    if (u->normalize)
        opts[k++] = (lm_card_option){"normalize", o->normalize ? "on" : "off", false};
    if (u->sign)
        opts[k++] = (lm_card_option){"sign election", sign, false};
    if (u->topk)
        opts[k++] = (lm_card_option){"top-k", topk, false};
    if (u->rescale)
        opts[k++] = (lm_card_option){"rescale", rescale, false};
    if (u->seed)
        opts[k++] = (lm_card_option){"seed", seed, false};
    opts[k++] = (lm_card_option){"dtype", dtype, false};
    if (lora)
        opts[k++] = (lm_card_option){"LoRA adapter", lora_h, false};
    else
        opts[k++] = (lm_card_option){"shard size", shard_h, false};
    for (int i = 0; sgpt && i < a->n_calib; i++)
        opts[k++] = (lm_card_option){a->n_calib == 1 ? "calibration data" : "calibration data (in FT order)",
                                     a->calib[i], true};
    if (sgpt) {
        opts[k++] = (lm_card_option){"Hessians from", a->hessian_from_base ? "the base" : "each FT's own model",
                                     false};
        opts[k++] = (lm_card_option){"calibration sequences", a->calib_samples ? samples : "all", false};
        opts[k++] = (lm_card_option){"sequence length", a->seq_len ? seq_len : "the model's max_position_embeddings",
                                     false};
        opts[k++] = (lm_card_option){"damping", damp, false};
    }

    // the command line: every option that shapes the result, whatever its default
    char base_w[PATH_MAX + 3];
    char (*ft_w)[PATH_MAX + 3] = malloc((size_t)(n ? n : 1) * sizeof *ft_w);
    const char **argv = malloc((size_t)(40 + n + 2 * a->n_calib) * sizeof *argv);
    lm_status s = LM_OK;
    if (!ft_w || !argv || weights.oom || densities.oom || gammas.oom || epsilons.oom) {
        s = lm_err_set(err, LM_ERR_NOMEM, "out of memory");
        goto done;
    }
    int c = 0;
    argv[c++] = "llmerge";
    if (a->config_text) {  // llmerge run: the configuration says the rest
        argv[c++] = "run";
        argv[c++] = "mergekit_config.yml";
        argv[c++] = "-o";
        argv[c++] = a->out;
        if (!lora) {
            argv[c++] = "--shard-size";
            argv[c++] = shard;
        }
        goto lora;
    }
    argv[c++] = m->name;
    if (u->models_only && o->models_only)
        argv[c++] = "--models-only";
    if (u->per_row && o->per_row)
        argv[c++] = "--per-row";
    if (u->per_col && o->per_col)
        argv[c++] = "--per-column";
    argv[c++] = operand_word(a->base, base_w, sizeof base_w);
    for (int i = 0; i < n; i++)
        argv[c++] = operand_word(a->fts[i], ft_w[i], sizeof ft_w[i]);
    argv[c++] = "-o";
    argv[c++] = a->out;
    // an option given as per-tensor settings is written as it was given; one the method does
    // not read is left out
    if (u->weights) {
        argv[c++] = "--weights";
        argv[c++] = a->sets[SET_WEIGHT].text ? a->sets[SET_WEIGHT].text : weights.p;
    }
    if (u->density) {
        argv[c++] = "--densities";
        argv[c++] = a->sets[SET_DENSITY].text ? a->sets[SET_DENSITY].text : densities.p;
    }
    if (u->gamma) {
        argv[c++] = "--gamma";
        argv[c++] = a->sets[SET_GAMMA].text ? a->sets[SET_GAMMA].text : gammas.p;
    }
    if (u->epsilon) {
        argv[c++] = "--epsilon";
        argv[c++] = a->sets[SET_EPSILON].text ? a->sets[SET_EPSILON].text : epsilons.p;
    }
    if (u->t) {
        argv[c++] = "--t";
        argv[c++] = a->sets[SET_T].text ? a->sets[SET_T].text : t;
    }
    if (u->select_topk) {
        argv[c++] = "--select-topk";
        argv[c++] = a->sets[SET_SELECT_TOPK].text ? a->sets[SET_SELECT_TOPK].text : topk_w;
    }
    if (u->iter) {
        argv[c++] = "--max-iter";
        argv[c++] = max_iter;
        argv[c++] = "--tol";
        argv[c++] = tol;
    }
    if (u->ramplus) {
        argv[c++] = "--r";
        argv[c++] = ram_r;
        argv[c++] = "--alpha";
        argv[c++] = ram_alpha;
    }
    if (u->lambda) {
        argv[c++] = "--lambda";
        argv[c++] = a->sets[SET_LAMBDA].text ? a->sets[SET_LAMBDA].text : lambda;
    }
    if (u->normalize)
        argv[c++] = o->normalize ? "--normalize" : "--no-normalize";
    if (u->sign) {
        argv[c++] = "--sign";
        argv[c++] = sign;
    }
    if (u->topk) {
        argv[c++] = "--topk";
        argv[c++] = topk;
    }
    if (u->rescale) {
        argv[c++] = "--rescale";
        argv[c++] = rescale;
    }
    if (u->seed) {
        argv[c++] = "--seed";
        argv[c++] = seed;
    }
    argv[c++] = "--dtype";
    argv[c++] = dtype;
    if (!lora) {
        argv[c++] = "--shard-size";
        argv[c++] = shard;
    }
    for (int i = 0; sgpt && i < a->n_calib; i++) {
        argv[c++] = "--calib";
        argv[c++] = a->calib[i];
    }
    if (sgpt) {
        argv[c++] = "--hessian-from";
        argv[c++] = a->hessian_from_base ? "base" : "ft";
        if (a->calib_samples) {
            argv[c++] = "--calib-samples";
            argv[c++] = samples;
        }
        if (a->seq_len) {
            argv[c++] = "--seq-len";
            argv[c++] = seq_len;
        }
    }

lora:
    if (lora) {
        argv[c++] = "--to-lora";
        argv[c++] = lora_r;
        if (a->to_lora_energy > 0) {
            argv[c++] = "--to-lora-energy";
            argv[c++] = lora_e;
        }
    }
    char name[PATH_MAX];  // OUT's last component names the model
    snprintf(name, sizeof name, "%s", a->out);
    for (size_t len = strlen(name); len > 1 && name[len - 1] == '/'; len--)
        name[len - 1] = '\0';
    const char *title = lm_path_base(name);
    lm_card card = {
        .title = *title ? title : "merged model", .version = LLMERGE_VERSION, .method = m->name,
        .method_summary = m->summary, .base = a->base, .inputs = inputs, .n_inputs = n, .options = opts,
        .n_options = k, .argv = argv, .argc = c, .config = a->config_text, .adapter_rank = a->to_lora_exact ? -1 : a->to_lora,
    };
    char *path = lm_path_join(dir, LM_CARD_NAME);
    s = path ? lm_card_write(path, &card, err) : lm_err_set(err, LM_ERR_NOMEM, "out of memory");
    free(path);
done:
    free(argv);
    free(ft_w);
    free(weights.p);
    free(densities.p);
    free(gammas.p);
    free(epsilons.p);
    return s;
}
