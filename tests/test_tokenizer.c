// Tests of tokenizer.c on small tokenizer.json files written here, with ids worked out by hand:
// byte-level BPE through GPT-2's pattern (merges by rank, ignore_merges), SentencePiece-style
// BPE (Prepend and Replace normalizers, byte fallback, unk and fuse_unk, TemplateProcessing's
// BOS), added tokens (leftmost, the longest), NFC, a Split by a string with each behavior,
// Metaspace with each prepend scheme and split, tokenizer_config.json's add_bos_token and
// add_eos_token, the cache, and each refusal with what it names. The real tokenizers against Hugging Face's own are
// tests/e2e_tokenize.sh's.
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "tokenizer.h"
#include "util.h"

static lm_tokenizer *parsed(const char *json)
{
    lm_tokenizer *t = NULL;
    lm_err err = {0};
    CHECK_OK(lm_tok_parse(&t, json, strlen(json), "tok.json", &err), &err);
    return t;
}

// The ids of text equal want (n of them).
static void check_ids(const lm_tokenizer *t, lm_tok_cache *c, const char *text, int special, const int32_t *want,
                      int64_t n)
{
    int32_t *ids = NULL;
    int64_t got = 0, cap = 0;
    lm_err err = {0};
    CHECK_OK(lm_tok_encode(t, c, text, strlen(text), special, &ids, &got, &cap, &err), &err);
    bool same = got == n && (n == 0 || memcmp(ids, want, (size_t)n * sizeof *ids) == 0);
    if (!same) {
        fprintf(stderr, "'%s': got", text);
        for (int64_t i = 0; i < got; i++)
            fprintf(stderr, " %d", ids[i]);
        fprintf(stderr, ", wanted");
        for (int64_t i = 0; i < n; i++)
            fprintf(stderr, " %d", want[i]);
        fprintf(stderr, "\n");
    }
    CHECK(same);
    free(ids);
}

#define IDS(...) ((const int32_t[]){__VA_ARGS__}), (int64_t)(sizeof((const int32_t[]){__VA_ARGS__}) / sizeof(int32_t))

static const char *BYTE_LEVEL =
    "{\"added_tokens\": [{\"id\": 20, \"content\": \"<x\", \"special\": true},"
    " {\"id\": 21, \"content\": \"<x>\", \"special\": true}],"
    " \"normalizer\": null,"
    " \"pre_tokenizer\": {\"type\": \"ByteLevel\", \"add_prefix_space\": false, \"use_regex\": true},"
    " \"post_processor\": {\"type\": \"ByteLevel\"},"
    " \"model\": {\"type\": \"BPE\", \"dropout\": null, \"ignore_merges\": %s,"
    "  \"vocab\": {\"h\": 0, \"e\": 1, \"l\": 2, \"o\": 3, \"\\u0120\": 4, \"w\": 5, \"r\": 6, \"d\": 7, \"he\": 8,"
    "   \"ll\": 9, \"llo\": 10, \"hello\": 11, \"\\u0120w\": 12, \"or\": 13, \"\\u0120wor\": 14, \"ld\": 15,"
    "   \"\\u0120world\": 16, \"lo\": 17},"
    "  \"merges\": [\"h e\", \"l l\", \"ll o\", \"he llo\", \"\\u0120 w\", \"o r\", \"\\u0120w or\", \"l d\","
    "   [\"\\u0120wor\", \"ld\"]]}}";

static void test_byte_level(void)
{
    char json[2048];
    snprintf(json, sizeof json, BYTE_LEVEL, "false");
    lm_tokenizer *t = parsed(json);
    if (!t)
        return;
    // "hello" merges by rank: he, ll, llo, hello; " world" is "Ġworld" (the space as Ġ)
    check_ids(t, NULL, "hello world", 1, IDS(11, 16));
    check_ids(t, NULL, "held", 1, IDS(8, 15));     // he, then ld; no he+ld merge
    check_ids(t, NULL, "lo", 1, IDS(2, 3));        // no l o merge, though "lo" is a token
    check_ids(t, NULL, "hello<x>hello<x", 1, IDS(11, 21, 11, 20));  // the longest added token
    check_ids(t, NULL, "", 1, NULL, 0);
    lm_tok_cache *c = lm_tok_cache_new();
    CHECK(c != NULL);
    for (int round = 0; round < 2; round++)  // a cache's hits give the same ids
        check_ids(t, c, "hello world held", 1, IDS(11, 16, 4, 8, 15));
    lm_tok_cache_free(c);
    // not UTF-8
    int32_t *ids = NULL;
    int64_t n = 0, cap = 0;
    lm_err err = {0};
    CHECK_FAILS(lm_tok_encode(t, NULL, "a\xC3(", 3, 1, &ids, &n, &cap, &err), LM_ERR_FORMAT,
                "not valid UTF-8 at byte 1", &err);
    free(ids);
    lm_tok_free(t);
    // ignore_merges: a piece that is a token is that token
    snprintf(json, sizeof json, BYTE_LEVEL, "true");
    t = parsed(json);
    if (t) {
        check_ids(t, NULL, "lo", 1, IDS(17));
        check_ids(t, NULL, "held", 1, IDS(8, 15));
        lm_tok_free(t);
    }
}

static const char *SPM =
    "{\"added_tokens\": [],"
    " \"normalizer\": {\"type\": \"Sequence\", \"normalizers\": [{\"type\": \"Prepend\", \"prepend\": \"\\u2581\"},"
    "  {\"type\": \"Replace\", \"pattern\": {\"String\": \" \"}, \"content\": \"\\u2581\"}]},"
    " \"pre_tokenizer\": null,"
    " \"post_processor\": {\"type\": \"TemplateProcessing\", \"single\": [{\"SpecialToken\": {\"id\": \"<s>\"}},"
    "  {\"Sequence\": {\"id\": \"A\"}}], \"special_tokens\": {\"<s>\": {\"id\": \"<s>\", \"ids\": [1]}}},"
    " \"model\": {\"type\": \"BPE\", \"unk_token\": \"<unk>\", \"byte_fallback\": true, \"fuse_unk\": %s,"
    "  \"vocab\": {\"<unk>\": 0, \"<s>\": 1, \"</s>\": 2, \"<0xC3>\": 3, \"<0xA9>\": 4, \"\\u2581\": 5, \"h\": 6,"
    "   \"i\": 7, \"\\u2581h\": 8, \"\\u2581hi\": 9, \"t\": 10, \"\\u2581t\": 11},"
    "  \"merges\": [\"\\u2581 h\", \"\\u2581h i\", \"\\u2581 t\"]}}";

static void test_sentencepiece(void)
{
    char json[2048];
    snprintf(json, sizeof json, SPM, "true");
    lm_tokenizer *t = parsed(json);
    if (!t)
        return;
    check_ids(t, NULL, "hi", 1, IDS(1, 9));              // ▁hi, after <s>
    check_ids(t, NULL, "hi", 0, IDS(9));                 // without the template
    check_ids(t, NULL, "hi t\xC3\xA9", 1, IDS(1, 9, 11, 3, 4));  // é by its bytes
    check_ids(t, NULL, "xx", 1, IDS(1, 5, 0));           // no byte token for x: unk, fused
    check_ids(t, NULL, "", 1, IDS(1));                   // nothing to prepend to
    lm_tok_free(t);
    snprintf(json, sizeof json, SPM, "false");
    if ((t = parsed(json))) {
        check_ids(t, NULL, "xx", 1, IDS(1, 5, 0, 0));
        lm_tok_free(t);
    }
}

static void test_nfc_and_split(void)
{
    const char *nfc = "{\"normalizer\": {\"type\": \"NFC\"}, \"model\": {\"type\": \"BPE\", \"unk_token\": \"<unk>\","
                      " \"vocab\": {\"\\u00e9\": 0, \"e\": 1, \"<unk>\": 2}, \"merges\": []}}";
    const char *none = "{\"normalizer\": null, \"model\": {\"type\": \"BPE\", \"unk_token\": \"<unk>\","
                       " \"vocab\": {\"\\u00e9\": 0, \"e\": 1, \"<unk>\": 2}, \"merges\": []}}";
    lm_tokenizer *t = parsed(nfc);
    if (t) {
        check_ids(t, NULL, "e\xCC\x81", 1, IDS(0));  // e + U+0301 composes to é
        lm_tok_free(t);
    }
    if ((t = parsed(none))) {
        check_ids(t, NULL, "e\xCC\x81", 1, IDS(1, 2));
        lm_tok_free(t);
    }
    const char *split = "{\"pre_tokenizer\": {\"type\": \"Split\", \"pattern\": {\"String\": \" \"}, \"behavior\":"
                        " \"Removed\", \"invert\": false}, \"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0,"
                        " \"b\": 1, \"ab\": 2}, \"merges\": [\"a b\"]}}";
    if ((t = parsed(split))) {
        check_ids(t, NULL, "a b ab", 1, IDS(0, 1, 2));  // the spaces removed; each piece merged alone
        lm_tok_free(t);
    }
}

// Every behavior of a split, on tokenizers' own example: "the-final--countdown" split at "-" is
// Removed: the final countdown; Isolated: the - final - - countdown; MergedWithPrevious: the-
// final- - countdown; MergedWithNext: the -final - -countdown; Contiguous: the - final --
// countdown. Here with a for "the", b for "final", c for "countdown": each piece is a whole token
// (ignore_merges), so the ids show the pieces.
static void test_split_behaviors(void)
{
    static const struct {
        const char *how, *text;
        int32_t want[8];
        int64_t n;
    } cases[] = {
        {"Removed", "a-b--c", {0, 1, 2}, 3},
        {"Isolated", "a-b--c", {0, 3, 1, 3, 3, 2}, 6},
        {"MergedWithPrevious", "a-b--c", {4, 5, 3, 2}, 4},
        {"MergedWithNext", "a-b--c", {0, 6, 3, 7}, 4},
        {"Contiguous", "a-b--c", {0, 3, 1, 8, 2}, 5},
        // a match first or last: alone where there is nothing to join
        {"MergedWithPrevious", "-a-", {3, 4}, 2},
        {"MergedWithNext", "-a-", {9, 3}, 2},
        {"Contiguous", "--a", {8, 0}, 2},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char json[1024];
        snprintf(json, sizeof json,
                 "{\"pre_tokenizer\": {\"type\": \"Split\", \"pattern\": {\"String\": \"-\"}, \"behavior\": \"%s\","
                 " \"invert\": false}, \"model\": {\"type\": \"BPE\", \"ignore_merges\": true, \"vocab\": {\"a\": 0,"
                 " \"b\": 1, \"c\": 2, \"-\": 3, \"a-\": 4, \"b-\": 5, \"-b\": 6, \"-c\": 7, \"--\": 8, \"-a\": 9},"
                 " \"merges\": []}}", cases[i].how);
        lm_tokenizer *t = parsed(json);
        if (!t)
            continue;
        check_ids(t, NULL, cases[i].text, 1, cases[i].want, cases[i].n);
        lm_tok_free(t);
    }
}

// A regex that matches the empty string cuts the text where it does (as the Rust library's
// matches and the JavaScript reference give them), but not right after a match: "x*" on "ab"
// is a and b (no merge across the cut); on "axb", a, x, b.
static void test_empty_matches(void)
{
    lm_tokenizer *t = parsed("{\"pre_tokenizer\": {\"type\": \"Split\", \"pattern\": {\"Regex\": \"x*\"},"
                             " \"behavior\": \"Isolated\", \"invert\": false}, \"model\": {\"type\": \"BPE\","
                             " \"vocab\": {\"a\": 0, \"b\": 1, \"ab\": 2, \"x\": 3, \"xb\": 4}, \"merges\": [\"a b\", \"x b\"]}}");
    if (t) {
        check_ids(t, NULL, "ab", 1, IDS(0, 1));
        check_ids(t, NULL, "axb", 1, IDS(0, 3, 1));
        lm_tok_free(t);
    }
    // MergedWithPrevious: an empty match after a gap joins it, so the x after it stands alone
    t = parsed("{\"pre_tokenizer\": {\"type\": \"Split\", \"pattern\": {\"Regex\": \"x*\"},"
               " \"behavior\": \"MergedWithPrevious\", \"invert\": false}, \"model\": {\"type\": \"BPE\","
               " \"ignore_merges\": true, \"vocab\": {\"a\": 0, \"b\": 1, \"ax\": 2, \"x\": 3}, \"merges\": []}}");
    if (t) {
        check_ids(t, NULL, "axb", 1, IDS(2, 1));
        lm_tok_free(t);
    }
}

// Metaspace: spaces become the replacement, put before a piece that does not start with one
// (always; first: only before the piece that starts the text; never), then split before each
// (split, MergedWithNext) or kept whole. Each piece is a whole token (ignore_merges) or unk.
static void test_metaspace(void)
{
    static const char *const vocab =
        "\"vocab\": {\"\\u2581hey\": 0, \"\\u2581\": 1, \"\\u2581friend\": 2, \"hey\": 3, \"friend\": 4,"
        " \"\\u2581hey\\u2581friend\": 5, \"<unk>\": 6, \"<s>\": 7, \"hey\\u2581friend\": 9, \"x\": 10}";
    static const struct {
        const char *options, *text;
        int32_t want[6];
        int64_t n;
    } cases[] = {
        {"\"prepend_scheme\": \"always\", \"split\": true", "hey friend", {0, 2}, 2},
        {"\"prepend_scheme\": \"always\", \"split\": true", "hey  friend", {0, 1, 2}, 3},
        {"\"prepend_scheme\": \"always\", \"split\": true", " hey", {0}, 1},    // starts with one already
        {"\"prepend_scheme\": \"always\"", "hey friend", {0, 2}, 2},             // split where absent
        {"\"prepend_scheme\": \"always\", \"split\": false", "hey friend", {5}, 1},
        {"\"prepend_scheme\": \"always\", \"split\": false", "<s>friend", {7, 2}, 2},
        {"\"prepend_scheme\": \"first\", \"split\": false", "hey friend", {5}, 1},
        {"\"prepend_scheme\": \"first\", \"split\": false", "<s>friend", {7, 4}, 2},  // not the text's start
        {"\"prepend_scheme\": \"first\", \"split\": false", "<s>hey friend", {7, 9}, 2},
        {"\"prepend_scheme\": \"never\", \"split\": false", "friend", {4}, 1},
        {"\"add_prefix_space\": false", "friend", {4}, 1},                   // the older key
        {"\"add_prefix_space\": true", "friend", {2}, 1},
        {"", "friend", {2}, 1},                                           // always where absent
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char json[1024];
        snprintf(json, sizeof json,
                 "{\"added_tokens\": [{\"id\": 7, \"content\": \"<s>\"}], \"pre_tokenizer\": {\"type\": \"Metaspace\","
                 " \"replacement\": \"\\u2581\"%s%s}, \"model\": {\"type\": \"BPE\", \"ignore_merges\": true,"
                 " \"unk_token\": \"<unk>\", \"fuse_unk\": true, %s, \"merges\": []}}",
                 *cases[i].options ? ", " : "", cases[i].options, vocab);
        lm_tokenizer *t = parsed(json);
        if (!t)
            continue;
        check_ids(t, NULL, cases[i].text, 1, cases[i].want, cases[i].n);
        lm_tok_free(t);
    }
    // "first" after a normalizer that removes the text's first characters: the piece no longer
    // starts at the text's start (its offset is the first kept character's), so nothing is put
    {
        char j[1024];
        snprintf(j, sizeof j,
                 "{\"normalizer\": {\"type\": \"Replace\", \"pattern\": {\"String\": \"q\"}, \"content\": \"\"},"
                 " \"pre_tokenizer\": {\"type\": \"Metaspace\", \"replacement\": \"\\u2581\", \"prepend_scheme\":"
                 " \"first\", \"split\": false}, \"model\": {\"type\": \"BPE\", \"ignore_merges\": true,"
                 " \"unk_token\": \"<unk>\", %s, \"merges\": []}}", vocab);
        lm_tokenizer *tq = parsed(j);
        if (tq) {
            check_ids(tq, NULL, "friend", 1, IDS(2));   // ▁friend
            check_ids(tq, NULL, "qfriend", 1, IDS(4));  // friend
            check_ids(tq, NULL, "fqriend", 1, IDS(2));  // a character removed later: still ▁friend
            lm_tok_free(tq);
        }
    }
    // after a split in a sequence, "first" is the piece at the text's start only (tokenizers
    // looks at the piece's offset in the text)
    char json[1024];
    snprintf(json, sizeof json,
             "{\"pre_tokenizer\": {\"type\": \"Sequence\", \"pretokenizers\": [{\"type\": \"Split\", \"pattern\":"
             " {\"String\": \"x\"}, \"behavior\": \"Isolated\", \"invert\": false}, {\"type\": \"Metaspace\","
             " \"replacement\": \"\\u2581\", \"prepend_scheme\": \"first\", \"split\": false}]}, \"model\": {\"type\":"
             " \"BPE\", \"ignore_merges\": true, \"unk_token\": \"<unk>\", %s, \"merges\": []}}", vocab);
    lm_tokenizer *t = parsed(json);
    if (t) {
        check_ids(t, NULL, "heyxfriend", 1, IDS(0, 10, 4));
        lm_tok_free(t);
    }
}

// tokenizer_config.json's add_bos_token and add_eos_token over the template (SPM's puts <s>, 1,
// before), and the largest id.
static void test_config(void)
{
    char json[2048];
    snprintf(json, sizeof json, SPM, "true");
    static const struct {
        const char *config;
        int32_t want[4];
        int64_t n;
    } cases[] = {
        {"{}", {1, 9}, 2},                                             // the template's
        {"{\"add_bos_token\": false}", {9}, 1},
        {"{\"add_bos_token\": null, \"add_eos_token\": false}", {9}, 1},  // null is false
        {"{\"add_eos_token\": true, \"eos_token\": \"</s>\"}", {9, 2}, 2},  // one key: the other false
        {"{\"bos_token\": \"</s>\"}", {1, 9}, 2},                        // no add_ key: the template's
        {"{\"add_bos_token\": true, \"bos_token\": \"</s>\", \"add_eos_token\": true,"
         " \"eos_token\": {\"content\": \"</s>\", \"lstrip\": false}}", {2, 9, 2}, 3},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        lm_tokenizer *t = parsed(json);
        lm_err err = {0};
        if (!t)
            continue;
        CHECK_OK(lm_tok_config(t, cases[i].config, strlen(cases[i].config), "tok_config.json", &err), &err);
        check_ids(t, NULL, "hi", 1, cases[i].want, cases[i].n);
        check_ids(t, NULL, "hi", 0, IDS(9));  // without special tokens, none
        lm_tok_free(t);
    }
    static const struct {
        const char *config, *needle;
    } bad[] = {
        {"{\"add_eos_token\": true, \"eos_token\": \"<nope>\"}",
         "tok_config.json: add_eos_token is true but eos_token is no token of tok.json"},
        {"{\"add_bos_token\": true}", "add_bos_token is true but bos_token is no token"},
        {"{\"add_bos_token\": \"yes\"}", "tok_config.json: add_bos_token is not true, false or null"},
        {"[]", "tok_config.json: not a JSON object"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        lm_tokenizer *t = parsed(json);
        lm_err err = {0};
        if (!t)
            continue;
        CHECK_FAILS(lm_tok_config(t, bad[i].config, strlen(bad[i].config), "tok_config.json", &err), LM_ERR_FORMAT,
                    bad[i].needle, &err);
        check_ids(t, NULL, "hi", 1, IDS(1, 9));  // unchanged
        lm_tok_free(t);
    }
    // bos_token names an added token by its content as the file writes it, also one matched
    // normalized (here "<b>", matched as "▁<b>" under SPM's Prepend)
    {
        char j2[2048];
        snprintf(j2, sizeof j2, SPM, "true");
        char *at = strstr(j2, "\"added_tokens\": []");
        CHECK(at != NULL);
        if (at) {
            char j3[2300];
            snprintf(j3, sizeof j3, "%.*s\"added_tokens\": [{\"id\": 12, \"content\": \"<b>\", \"normalized\": true}]%s",
                     (int)(at - j2), j2, at + strlen("\"added_tokens\": []"));
            lm_tokenizer *tb = parsed(j3);
            const char *c = "{\"add_bos_token\": true, \"bos_token\": {\"content\": \"<b>\"}}";
            lm_err e2 = {0};
            if (tb) {
                // the largest id: the added <b> (by its name as written), 11 without added tokens
                const char *name = NULL;
                CHECK(lm_tok_max_id(tb, &name, true) == 12 && name && strcmp(name, "<b>") == 0);
                CHECK(lm_tok_max_id(tb, NULL, false) == 11);
                CHECK_OK(lm_tok_config(tb, c, strlen(c), "tok_config.json", &e2), &e2);
                check_ids(tb, NULL, "hi", 1, IDS(12, 9));
                CHECK(lm_tok_max_id(tb, NULL, false) == 12);  // now the template's BOS: ordinary text gives it
                lm_tok_free(tb);
            }
        }
    }
    // the largest id: the vocabulary's ▁t (11), then an eos past it
    lm_tokenizer *t = parsed(json);
    if (t) {
        const char *tok = NULL;
        CHECK(lm_tok_max_id(t, &tok, true) == 11 && tok && strcmp(tok, "\xE2\x96\x81t") == 0);
        lm_tok_free(t);
    }
    // lm_tok_load reads the tokenizer_config.json beside tokenizer.json
    char dir[] = "/tmp/test_tokenizer_XXXXXX", path[64], cfg[64];
    lm_err err = {0};
    char *made = mkdtemp(dir);
    CHECK(made != NULL);
    if (made) {
        snprintf(path, sizeof path, "%s/tokenizer.json", dir);
        snprintf(cfg, sizeof cfg, "%s/tokenizer_config.json", dir);
        const char *c = "{\"add_bos_token\": false, \"add_eos_token\": true, \"eos_token\": \"</s>\"}";
        CHECK_OK(lm_write_file(path, json, strlen(json), &err), &err);
        CHECK_OK(lm_write_file(cfg, c, strlen(c), &err), &err);
        t = NULL;
        CHECK_OK(lm_tok_load(&t, path, &err), &err);
        if (t)
            check_ids(t, NULL, "hi", 1, IDS(9, 2));
        lm_tok_free(t);
        CHECK_OK(lm_write_file(cfg, "{\"add_bos_token\": 1}", 20, &err), &err);
        t = NULL;
        CHECK_FAILS(lm_tok_load(&t, path, &err), LM_ERR_FORMAT, "tokenizer_config.json: add_bos_token is not", &err);
        CHECK(t == NULL);
        unlink(cfg);
        unlink(path);
        rmdir(dir);
    }
}

// An added token with normalized: true is found, as its content normalized, in the normalized
// text; one without, in the raw text. A token that is a NUL character is read; text with one is
// refused.
static void test_normalized_added_and_nul(void)
{
    static const char *const fmt =
        "{\"added_tokens\": [{\"id\": 9, \"content\": \"a b\", \"normalized\": %s}],"
        " \"normalizer\": {\"type\": \"Replace\", \"pattern\": {\"String\": \" \"}, \"content\": \"\\u2581\"},"
        " \"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 1, \"\\u2581\": 2, \"\\u0000\": 3},"
        " \"merges\": []}}";
    char json[1024];
    snprintf(json, sizeof json, fmt, "true");
    lm_tokenizer *t = parsed(json);
    if (t) {
        check_ids(t, NULL, "a b", 1, IDS(9));  // "a b" normalized is "a▁b", the token's normalized content
        check_ids(t, NULL, "a\xE2\x96\x81" "b a b", 1, IDS(9, 2, 9));  // so is "a▁b"
        check_ids(t, NULL, "a  b", 1, IDS(0, 2, 2, 1));
        lm_tok_free(t);
    }
    snprintf(json, sizeof json, fmt, "false");
    if ((t = parsed(json))) {
        check_ids(t, NULL, "a b", 1, IDS(9));  // raw
        check_ids(t, NULL, "a\xE2\x96\x81" "b", 1, IDS(0, 2, 1));
        int32_t *ids = NULL;
        int64_t n = 0, cap = 0;
        lm_err err = {0};
        CHECK_FAILS(lm_tok_encode(t, NULL, "a\0b", 3, 1, &ids, &n, &cap, &err), LM_ERR_FORMAT,
                    "a NUL character at byte 1", &err);
        free(ids);
        CHECK(lm_tok_max_id(t, NULL, true) == 9 && lm_tok_max_id(t, NULL, false) == 3);
        lm_tok_free(t);
    }
}

// The pair of lowest rank merges first: b c (rank 0) before a b (rank 1).
static void test_rank_order(void)
{
    lm_tokenizer *t = parsed("{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 1, \"c\": 2,"
                             " \"ab\": 3, \"bc\": 4}, \"merges\": [\"b c\", \"a b\"]}}");
    if (t) {
        check_ids(t, NULL, "abc", 1, IDS(0, 4));
        check_ids(t, NULL, "abab", 1, IDS(3, 3));
        lm_tok_free(t);
    }
}

static void refused(const char *json, lm_status want, const char *needle)
{
    lm_tokenizer *t = NULL;
    lm_err err = {0};
    CHECK_FAILS(lm_tok_parse(&t, json, strlen(json), "tok.json", &err), want, needle, &err);
    CHECK(t == NULL);
}

static void test_refusals(void)
{
    const char *model = "\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": []}";
    char json[1024];
    refused("{\"model\": {\"type\": \"Unigram\", \"vocab\": []}}", LM_ERR_UNSUPPORTED, "tok.json: model 'Unigram'");
    refused("{\"model\": {\"type\": \"WordPiece\", \"vocab\": {}}}", LM_ERR_UNSUPPORTED, "model 'WordPiece'");
    snprintf(json, sizeof json, "{\"pre_tokenizer\": {\"type\": \"Whitespace\"}, %s}", model);
    refused(json, LM_ERR_UNSUPPORTED, "pre_tokenizer 'Whitespace' is not supported");
    snprintf(json, sizeof json, "{\"normalizer\": {\"type\": \"Lowercase\"}, %s}", model);
    refused(json, LM_ERR_UNSUPPORTED, "normalizer 'Lowercase' is not supported");
    snprintf(json, sizeof json, "{\"pre_tokenizer\": {\"type\": \"Split\", \"pattern\": {\"Regex\": \"a\"},"
             " \"behavior\": \"Sideways\"}, %s}", model);
    refused(json, LM_ERR_FORMAT, "behavior 'Sideways' is none of Isolated");
    snprintf(json, sizeof json, "{\"pre_tokenizer\": {\"type\": \"Metaspace\", \"replacement\": \"ab\"}, %s}", model);
    refused(json, LM_ERR_FORMAT, "Metaspace: replacement is not one character");
    snprintf(json, sizeof json, "{\"pre_tokenizer\": {\"type\": \"Metaspace\", \"replacement\": \"_\","
             " \"prepend_scheme\": \"sometimes\"}, %s}", model);
    refused(json, LM_ERR_FORMAT, "prepend_scheme 'sometimes' is none of first, never, always");
    snprintf(json, sizeof json, "{\"pre_tokenizer\": {\"type\": \"Metaspace\", \"replacement\": \"_\","
             " \"prepend_scheme\": \"first\", \"add_prefix_space\": false}, %s}", model);
    refused(json, LM_ERR_FORMAT, "add_prefix_space false contradicts prepend_scheme 'first'");
    snprintf(json, sizeof json, "{\"pre_tokenizer\": {\"type\": \"Split\", \"pattern\": {\"Regex\": \"(\"},"
             " \"behavior\": \"Isolated\"}, %s}", model);
    refused(json, LM_ERR_UNSUPPORTED, "the regex '(' does not compile");
    snprintf(json, sizeof json, "{\"added_tokens\": [{\"id\": 1, \"content\": \"<a>\", \"lstrip\": true}], %s}", model);
    refused(json, LM_ERR_UNSUPPORTED, "added token '<a>' with lstrip");
    snprintf(json, sizeof json, "{\"post_processor\": {\"type\": \"BertProcessing\"}, %s}", model);
    refused(json, LM_ERR_UNSUPPORTED, "post_processor 'BertProcessing'");
    refused("{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": [\"ab\"]}}", LM_ERR_FORMAT,
            "model.merges[0]: not a pair");
    refused("{\"model\": {\"type\": \"BPE\", \"dropout\": 0.1, \"vocab\": {}, \"merges\": []}}", LM_ERR_UNSUPPORTED,
            "dropout");
    refused("{\"normalizer\": null}", LM_ERR_UNSUPPORTED, "model '(no type)'");
    refused("[1, 2]", LM_ERR_FORMAT, "not a JSON object");
    // ids that are no token ids (found by fuzzing: a float too large for an int)
    snprintf(json, sizeof json, "{\"added_tokens\": [{\"id\": 39223372036854775808, \"content\": \"<a>\"}], %s}",
             model);
    refused(json, LM_ERR_FORMAT, "added_tokens: an entry without content or a token id");
    refused("{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0.5}, \"merges\": []}}", LM_ERR_FORMAT,
            "token 'a' has no token id");
    snprintf(json, sizeof json, "{\"post_processor\": {\"type\": \"TemplateProcessing\", \"single\": [{\"SpecialToken\":"
             " {\"id\": \"<s>\"}}], \"special_tokens\": {\"<s>\": {\"ids\": [1e30]}}}, %s}", model);
    refused(json, LM_ERR_FORMAT, "an id that is not a token id");
    refused("{\"model\": ", LM_ERR_FORMAT, "tok.json");
    lm_tokenizer *t = NULL;
    lm_err err = {0};
    CHECK_FAILS(lm_tok_load(&t, "/nonexistent/tokenizer.json", &err), LM_ERR_NOT_FOUND, "no such file", &err);
}

int main(void)
{
    test_byte_level();
    test_sentencepiece();
    test_nfc_and_split();
    test_rank_order();
    test_split_behaviors();
    test_empty_matches();
    test_metaspace();
    test_config();
    test_normalized_added_and_nul();
    test_refusals();
    return check_report("test_tokenizer");
}
