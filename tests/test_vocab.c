// Tests of vocab.c: the vocabulary of a tokenizer.json as Hugging Face's tokenizers lists it
// (get_vocab()): BPE's object of token ids and Unigram's list of [token, score] pairs (a piece
// listed twice), added tokens given the ids the tokenizers library gives them (not the file's),
// stripping to the embeddings' rows, the comparison of two vocabularies below a limit, and each
// refusal with what it names.
#include <stdio.h>
#include <string.h>

#include "check.h"
#include "vocab.h"

// Parses `text` (labelled "tok.json") into *v, checking it is accepted.
static lm_vocab *parsed(const char *text)
{
    lm_vocab *v = NULL;
    lm_err err = {0};
    CHECK_OK(lm_vocab_parse(&v, text, strlen(text), "tok.json", &err), &err);
    return v;
}

static void test_bpe(void)
{
    lm_vocab *v = parsed("{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 1, \"ab\": 4}, \"merges\": []},"
                         " \"added_tokens\": [{\"id\": 5, \"content\": \"<eos>\", \"special\": true},"
                         " {\"id\": 1, \"content\": \"b\"}]}");
    if (!v)
        return;
    // <eos> (the file says 5) gets id 3: the model lists three entries, and b's added id, the
    // model's 1, is below that
    CHECK(v->n_ids == 5 && v->n_tokens == 4);
    CHECK(strcmp(lm_vocab_token(v, 0), "a") == 0 && strcmp(lm_vocab_token(v, 1), "b") == 0);
    CHECK(lm_vocab_token(v, 2) == NULL && strcmp(lm_vocab_token(v, 3), "<eos>") == 0);
    CHECK(strcmp(lm_vocab_token(v, 4), "ab") == 0);
    CHECK(lm_vocab_token(v, 5) == NULL && lm_vocab_token(v, -1) == NULL);
    lm_vocab_strip(v, 4);  // the ids of 4 embedding rows: ab goes
    CHECK(v->n_ids == 4 && v->n_tokens == 3 && lm_vocab_token(v, 4) == NULL);
    lm_vocab_strip(v, 3);  // and <eos>; the gap before it goes from the end too
    CHECK(v->n_ids == 2 && v->n_tokens == 2);
    lm_vocab_strip(v, 10);
    CHECK(v->n_ids == 2 && v->n_tokens == 2);
    lm_vocab_free(v);
}

static void test_unigram(void)
{
    lm_vocab *v = parsed("{\"model\": {\"type\": \"Unigram\", \"unk_id\": 0,"
                         " \"vocab\": [[\"<unk>\", 0.0], [\"\\u2581the\", -3.5], [\"s\", -4]]}}");
    if (!v)
        return;
    CHECK(v->n_ids == 3 && v->n_tokens == 3);
    CHECK(strcmp(lm_vocab_token(v, 1), "\xe2\x96\x81the") == 0 && strcmp(lm_vocab_token(v, 2), "s") == 0);
    lm_vocab_free(v);
}

// Added tokens as the tokenizers library adds them, whatever ids the file writes: one the model
// holds keeps the model's id; a new one gets the next id after the model's vocabulary (its
// entries) and the added tokens so far; the same token again keeps its first id; an empty one
// is skipped.
static void test_added_ids(void)
{
    // the file's ids disagree: y stays at the model's 1, <n> goes to 3 (after 3 entries), <m> to 4
    lm_vocab *v = parsed("{\"model\": {\"vocab\": {\"x\": 0, \"y\": 1, \"<pad>\": 2}}, \"added_tokens\": "
                         "[{\"id\": 7, \"content\": \"y\"}, {\"id\": 9, \"content\": \"<n>\"}, {\"id\": 0, "
                         "\"content\": \"\"}, {\"id\": 5, \"content\": \"<n>\"}, {\"id\": 5, \"content\": \"<m>\"}]}");
    // a vocabulary with a gap: the next id is its size (2), then one past the largest added id
    lm_vocab *w = parsed("{\"model\": {\"vocab\": {\"a\": 0, \"b\": 5}}, \"added_tokens\": "
                         "[{\"id\": 2, \"content\": \"<x>\"}, {\"id\": 6, \"content\": \"b\"}, "
                         "{\"id\": 7, \"content\": \"<y>\"}]}");
    // Unigram: a piece listed twice has its later position; the earlier id has no token
    lm_vocab *u = parsed("{\"model\": {\"type\": \"Unigram\", \"vocab\": [[\"a\", 0], [\"b\", -1], [\"a\", -2]]},"
                         " \"added_tokens\": [{\"id\": 3, \"content\": \"<s>\"}]}");
    if (v && w && u) {
        CHECK(v->n_ids == 5 && v->n_tokens == 5);
        CHECK(strcmp(lm_vocab_token(v, 1), "y") == 0 && strcmp(lm_vocab_token(v, 3), "<n>") == 0);
        CHECK(strcmp(lm_vocab_token(v, 4), "<m>") == 0 && lm_vocab_token(v, 7) == NULL);
        // b (5) is the largest added id once b is added: <y> goes to 6
        CHECK(w->n_ids == 7 && strcmp(lm_vocab_token(w, 2), "<x>") == 0 && strcmp(lm_vocab_token(w, 5), "b") == 0);
        CHECK(strcmp(lm_vocab_token(w, 6), "<y>") == 0);
        CHECK(u->n_ids == 4 && u->n_tokens == 3 && lm_vocab_token(u, 0) == NULL);
        CHECK(strcmp(lm_vocab_token(u, 2), "a") == 0 && strcmp(lm_vocab_token(u, 3), "<s>") == 0);
    }
    lm_vocab_free(v);
    lm_vocab_free(w);
    lm_vocab_free(u);
    lm_vocab *e = parsed("{\"model\": {\"vocab\": {}}}");
    if (e)
        CHECK(e->n_ids == 0 && e->n_tokens == 0 && lm_vocab_token(e, 0) == NULL);
    lm_vocab_free(e);
}

static void test_difference(void)
{
    lm_vocab *a = parsed("{\"model\": {\"vocab\": {\"a\": 0, \"b\": 1, \"c\": 2}}}");
    lm_vocab *same = parsed("{\"normalizer\": null, \"model\": {\"type\": \"BPE\", \"vocab\": {\"c\": 2, \"a\": 0,"
                            " \"b\": 1}, \"merges\": [\"a b\"]}}");
    lm_vocab *swapped = parsed("{\"model\": {\"vocab\": {\"a\": 0, \"c\": 1, \"b\": 2}}}");
    lm_vocab *longer = parsed("{\"model\": {\"vocab\": {\"a\": 0, \"b\": 1, \"c\": 2}}, \"added_tokens\": "
                              "[{\"id\": 3, \"content\": \"<new>\"}]}");
    if (a && same && swapped && longer) {
        CHECK(lm_vocab_first_difference(a, same, 10) == -1);
        CHECK(lm_vocab_first_difference(a, swapped, 10) == 1);
        CHECK(lm_vocab_first_difference(a, swapped, 1) == -1);
        CHECK(lm_vocab_first_difference(a, longer, 10) == 3);  // a token where the other has none
        CHECK(lm_vocab_first_difference(longer, a, 3) == -1);
    }
    lm_vocab_free(a);
    lm_vocab_free(same);
    lm_vocab_free(swapped);
    lm_vocab_free(longer);
}

// Each refusal: LM_ERR_FORMAT naming the file and what is wrong.
static void test_refusals(void)
{
    static const struct {
        const char *text, *needle;
    } bad[] = {
        {"{\"model\": {\"vocab\": {\"a\": 0}", "tok.json: not valid JSON"},
        {"[1, 2]", "tok.json: no model object"},
        {"{\"added_tokens\": []}", "tok.json: no model object"},
        {"{\"model\": {\"type\": \"BPE\"}}", "model.vocab is missing"},
        {"{\"model\": {\"vocab\": \"a b\"}}", "model.vocab is a string, not an object"},
        {"{\"model\": {\"vocab\": {\"a\": -1}}}", "token 'a' has id -1, not a token id"},
        {"{\"model\": {\"vocab\": {\"a\": 1.5}}}", "token 'a' has id 1.5"},
        {"{\"model\": {\"vocab\": {\"a\": 4194304}}}", "token 'a' has id 4194304"},
        {"{\"model\": {\"vocab\": {\"a\": \"0\"}}}", "token 'a' has id a string"},
        {"{\"model\": {\"vocab\": [[\"a\", 0], [\"b\"]]}}", "model.vocab[1] is an array, not a [token, score] pair"},
        {"{\"model\": {\"vocab\": [[\"a\", 0], 7]}}", "model.vocab[1] is a number"},
        {"{\"model\": {\"vocab\": {\"a\": 0, \"b\": 0}}}", "tok.json: 'a' and 'b' both have id 0"},
        {"{\"model\": {\"vocab\": {}}, \"added_tokens\": {}}", "added_tokens is an object, not a list"},
        {"{\"model\": {\"vocab\": {}}, \"added_tokens\": [3]}", "added_tokens[0]: not an object"},
        {"{\"model\": {\"vocab\": {}}, \"added_tokens\": [{\"id\": 1}]}", "added_tokens[0]: no content string"},
        {"{\"model\": {\"vocab\": {}}, \"added_tokens\": [{\"content\": \"x\"}]}", "added_tokens[0]: no id"},
        {"{\"model\": {\"vocab\": {}}, \"added_tokens\": [{\"content\": \"x\", \"id\": -2}]}",
         "added_tokens[0]: its id is not a token id"},
        // a gap in the model's ids: the next id (its two entries) is b's
        {"{\"model\": {\"vocab\": {\"a\": 0, \"b\": 2}}, \"added_tokens\": [{\"content\": \"c\", \"id\": 3}]}",
         "tok.json: 'b' and 'c' both have id 2"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        lm_vocab *v = (lm_vocab *)1;
        lm_err err = {0};
        CHECK_FAILS(lm_vocab_parse(&v, bad[i].text, strlen(bad[i].text), "tok.json", &err), LM_ERR_FORMAT,
                    bad[i].needle, &err);
        CHECK(v == NULL);
    }
    lm_vocab *v = (lm_vocab *)1;
    lm_err err = {0};
    CHECK_FAILS(lm_vocab_load(&v, "/nonexistent/tokenizer.json", &err), LM_ERR_NOT_FOUND,
                "/nonexistent/tokenizer.json", &err);
    CHECK(v == NULL);
}

int main(void)
{
    test_bpe();
    test_unigram();
    test_added_ids();
    test_difference();
    test_refusals();
    return check_report("test_vocab");
}
