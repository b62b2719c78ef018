// libFuzzer target for the JSON side files: any byte string goes through the one JSON reader
// and through the parsers of config.json, adapter_config.json, model.safetensors.index.json,
// tokenizer.json's vocabulary and tokenizer.json as a tokenizer (which then encodes a few texts).
// Each must either accept it or refuse it with LM_ERR_FORMAT or LM_ERR_UNSUPPORTED and a
// message; never a crash, a leak or an out-of-bounds read (run under ASan and UBSan). What the
// reader accepts, cJSON prints, and the reader reads that back to a tree that prints the same.
//
// An adapter config that parses is also asked which modules it selects and their rank and alpha,
// on a few module paths: its regexes (target_modules, exclude_modules, rank_pattern, ...) run
// under PCRE2's limits, so a pattern may fail with a message but never run away.
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "adapter.h"
#include "config.h"
#include "json.h"
#include "model.h"
#include "tokenizer.h"
#include "vocab.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

// A refusal must say what is wrong, as a format (or unsupported) error.
static void check_refusal(lm_status s, const lm_err *err)
{
    if (s != LM_ERR_FORMAT && s != LM_ERR_UNSUPPORTED && s != LM_ERR_NOMEM)
        abort();
    if (err->msg[0] == '\0')
        abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const char *text = (const char *)data;

    // The reader: a tree, or a defect inside the text with a position.
    cJSON *root = NULL;
    lm_json_error e;
    lm_status s = lm_json_parse_detail(&root, text, size, &e);
    if (s == LM_OK) {
        char *printed = cJSON_PrintUnformatted(root);
        cJSON *again = NULL;
        if (printed) {
            if (lm_json_parse_detail(&again, printed, strlen(printed), &e) != LM_OK)
                abort();
            char *reprinted = cJSON_PrintUnformatted(again);
            if (reprinted && strcmp(printed, reprinted) != 0)
                abort();
            free(reprinted);
        }
        free(printed);
        cJSON_Delete(again);
        cJSON_Delete(root);
    } else if (s != LM_ERR_NOMEM &&
               (s != LM_ERR_FORMAT || root || e.offset > size || e.line < 1 || e.column < 1 || !e.what[0])) {
        abort();
    }

    // The side files' parsers on the same text.
    lm_err err = {0};
    lm_config cfg;
    s = lm_config_parse(&cfg, text, size, "config.json", &err);
    if (s != LM_OK)
        check_refusal(s, &err);
    lm_config_free(&cfg);

    lm_lora_config lc;
    s = lm_lora_config_parse(&lc, text, size, "adapter_config.json", &err);
    if (s != LM_OK) {
        check_refusal(s, &err);
    } else {
        static const char *const paths[] = {"model.layers.0.self_attn.q_proj", "model.layers.17.mlp.down_proj",
                                            "lm_head", "model.embed_tokens"};
        for (size_t i = 0; i < sizeof paths / sizeof paths[0]; i++) {
            lm_lora_select why;
            int64_t layer, r;
            double alpha;
            if ((s = lm_lora_config_select(&lc, paths[i], &why, &layer, &err)) != LM_OK)
                check_refusal(s, &err);
            if ((s = lm_lora_config_rank(&lc, paths[i], &r, &alpha, NULL, NULL, &err)) != LM_OK)
                check_refusal(s, &err);
        }
    }
    lm_lora_config_free(&lc);

    const cJSON *map = NULL;
    s = lm_model_index_parse(&root, &map, text, size, "model.safetensors.index.json", &err);
    if (s != LM_OK) {
        check_refusal(s, &err);
        if (root || map)
            abort();
    } else {
        if (!cJSON_IsObject(map))
            abort();
        for (const cJSON *m = map->child; m; m = m->next)
            if (!cJSON_IsString(m) || !m->valuestring[0] || strchr(m->valuestring, '/'))
                abort();
        cJSON_Delete(root);
    }

    // tokenizer.json's vocabulary: accepted with every id's token in range and counted, or refused
    lm_vocab *v = NULL;
    s = lm_vocab_parse(&v, text, size, "tokenizer.json", &err);
    if (s != LM_OK) {
        check_refusal(s, &err);
        if (v)
            abort();
    } else {
        int64_t n = 0;
        for (int64_t id = 0; id < v->n_ids; id++)
            n += lm_vocab_token(v, id) != NULL;
        if (n != v->n_tokens || (v->n_ids > 0 && !lm_vocab_token(v, v->n_ids - 1)) ||
            lm_vocab_first_difference(v, v, v->n_ids + 1) != -1)
            abort();
        lm_vocab_free(v);
    }

    // tokenizer.json as a tokenizer: accepted, then it encodes a few texts (ids in the output or
    // a refusal), or refused
    lm_tokenizer *tok = NULL;
    s = lm_tok_parse(&tok, text, size, "tokenizer.json", &err);
    if (s != LM_OK) {
        check_refusal(s, &err);
        if (tok)
            abort();
    } else {
        static const char *const texts[] = {"", "Hello world, it's 2024!", " <s>x</s>\n\t\xc3\xa9\xf0\x9f\x98\x80",
                                            "\xff"};
        lm_tok_cache *c = lm_tok_cache_new();
        for (size_t i = 0; i < sizeof texts / sizeof texts[0]; i++) {
            int32_t *ids = NULL;
            int64_t n = 0, cap = 0;
            s = lm_tok_encode(tok, i % 2 ? c : NULL, texts[i], strlen(texts[i]), 1, &ids, &n, &cap, &err);
            if (s != LM_OK)
                check_refusal(s, &err);
            for (int64_t k = 0; s == LM_OK && k < n; k++)  // every id within what the tokenizer says
                if (ids[k] < 0 || ids[k] > lm_tok_max_id(tok, NULL, true))
                    abort();
            free(ids);
        }
        lm_tok_cache_free(c);
        lm_tok_free(tok);
    }

    // tokenizer_config.json over a small tokenizer: accepted (the ids then within the largest) or
    // refused
    static const char small[] =
        "{\"added_tokens\": [{\"id\": 3, \"content\": \"<s>\"}, {\"id\": 4, \"content\": \"</s>\"}],"
        " \"model\": {\"type\": \"BPE\", \"vocab\": {\"h\": 0, \"i\": 1, \"hi\": 2}, \"merges\": [\"h i\"]}}";
    if (lm_tok_parse(&tok, small, sizeof small - 1, "tokenizer.json", &err) != LM_OK)
        abort();
    s = lm_tok_config(tok, text, size, "tokenizer_config.json", &err);
    if (s != LM_OK) {
        check_refusal(s, &err);
    } else {
        int32_t *ids = NULL;
        int64_t n = 0, cap = 0;
        if (lm_tok_encode(tok, NULL, "hi", 2, 1, &ids, &n, &cap, &err) != LM_OK || n < 1 || n > 3)
            abort();
        for (int64_t k = 0; k < n; k++)
            if (ids[k] < 0 || ids[k] > lm_tok_max_id(tok, NULL, true))
                abort();
        free(ids);
    }
    lm_tok_free(tok);
    return 0;
}
