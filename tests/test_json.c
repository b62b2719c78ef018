// Tests of the one JSON reader (lib/json.c): documents of every kind of value read into the
// trees cJSON prints back as expected (escapes, surrogate pairs, numbers with their text kept,
// order of members); random documents generated here from a seed, printed by cJSON, read back
// to the same text; a table of defects, each refused with its kind, line, column (counted in
// characters) and wording: syntax, text after the value, a byte order mark, bad UTF-8, lone
// surrogates, \u0000, a key twice (in small and large objects, naming where it was first),
// nesting past the limit, numbers out of range naming the key; the messages of lm_json_parse;
// and lm_json_load on a good file, a missing one, a directory and a FIFO (refused without
// blocking). `test_json --write-corpus DIR` writes the table's texts, the good documents and a
// config.json, an adapter_config.json and an index out instead, as the seed corpus of fuzz_json.
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "check.h"
#include "json.h"
#include "testfs.h"
#include "util.h"

// ==== good documents ==========================================================================

typedef struct good_case {
    const char *text;
    const char *printed;  // cJSON_PrintUnformatted of the tree
} good_case;

static const good_case good_cases[] = {
    {"{}", "{}"},
    {" \t\r\n[ ] \n", "[]"},
    {"null", "null"},
    {"true", "true"},
    {"\"\"", "\"\""},
    {"{\"a\": 1, \"b\": [true, false, null], \"c\": {\"d\": \"e\"}}",
     "{\"a\":1,\"b\":[true,false,null],\"c\":{\"d\":\"e\"}}"},
    // members in file order, also when a later key sorts first
    {"{\"z\": 1, \"a\": 2, \"m\": 3}", "{\"z\":1,\"a\":2,\"m\":3}"},
    // escapes: the simple ones, \u in the BMP, a surrogate pair, and UTF-8 as it is
    {"\"\\\"\\\\\\/\\b\\f\\n\\r\\t\"", "\"\\\"\\\\/\\b\\f\\n\\r\\t\""},
    {"\"caf\\u00e9 \\u20AC \\ud83d\\ude00\"", "\"caf\xC3\xA9 \xE2\x82\xAC \xF0\x9F\x98\x80\""},
    {"\"caf\xC3\xA9 \xF0\x9F\x98\x80\"", "\"caf\xC3\xA9 \xF0\x9F\x98\x80\""},
    // numbers as the grammar writes them
    {"[0, -0, 1.5, -2.25e-3, 1E+2, 3e2, 1e-400, 123456789012]",
     "[0,-0,1.5,-0.00225,100,300,0,123456789012]"},
    {"9223372036854775808", "9.2233720368547758e+18"},
};

// Side files as llmerge meets them: seeds for the fuzzer, and read here like any document.
static const char *const seed_docs[] = {
    "{\n  \"architectures\": [\"LlamaForCausalLM\"],\n  \"hidden_size\": 64,\n  \"intermediate_size\": 128,\n"
    "  \"max_position_embeddings\": 256,\n  \"model_type\": \"llama\",\n  \"num_attention_heads\": 4,\n"
    "  \"num_hidden_layers\": 2,\n  \"num_key_value_heads\": 2,\n  \"rms_norm_eps\": 1e-05,\n"
    "  \"rope_scaling\": {\"factor\": 8.0, \"low_freq_factor\": 1.0, \"high_freq_factor\": 4.0,\n"
    "    \"original_max_position_embeddings\": 8192, \"rope_type\": \"llama3\"},\n  \"rope_theta\": 500000.0,\n"
    "  \"tie_word_embeddings\": false,\n  \"torch_dtype\": \"bfloat16\",\n  \"vocab_size\": 256\n}\n",
    "{\n  \"alpha_pattern\": {\"v_proj\": 32},\n  \"base_model_name_or_path\": \"base\",\n  \"lora_alpha\": 16,\n"
    "  \"modules_to_save\": null,\n  \"peft_type\": \"LORA\",\n  \"r\": 8,\n  \"rank_pattern\": {\"q_proj\": 4},\n"
    "  \"target_modules\": [\"q_proj\", \"v_proj\"],\n  \"layers_to_transform\": [0, 1],\n  \"use_dora\": false,\n"
    "  \"use_rslora\": true\n}\n",
    "{\n  \"metadata\": {\"total_size\": 213632},\n  \"weight_map\": {\n"
    "    \"lm_head.weight\": \"model-00002-of-00002.safetensors\",\n"
    "    \"model.embed_tokens.weight\": \"model-00001-of-00002.safetensors\"\n  }\n}\n",
    ("{\n  \"version\": \"1.0\",\n  \"added_tokens\": [{\"id\": 3, \"content\": \"<eos>\", \"special\": true}],\n"
     "  \"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 1, \"ab\": 2}, \"merges\": [\"a b\"]}\n}\n"),
    "{\"model\": {\"type\": \"Unigram\", \"unk_id\": 0, \"vocab\": [[\"<unk>\", 0.0], [\"\\u2581a\", -1.5]]}}\n",
    // a tokenizer that tokenizes: a normalizer, a Split and ByteLevel, byte fallback, a template
    ("{\"added_tokens\": [{\"id\": 4, \"content\": \"<s>\", \"special\": true}],\n"
     " \"normalizer\": {\"type\": \"Sequence\", \"normalizers\": [{\"type\": \"NFC\"},\n"
     "  {\"type\": \"Replace\", \"pattern\": {\"String\": \"x\"}, \"content\": \"y\"}]},\n"
     " \"pre_tokenizer\": {\"type\": \"Sequence\", \"pretokenizers\": [{\"type\": \"Split\", \"pattern\":\n"
     "  {\"Regex\": \"\\\\p{L}+|\\\\s+\"}, \"behavior\": \"Isolated\", \"invert\": false},\n"
     "  {\"type\": \"ByteLevel\", \"add_prefix_space\": false, \"use_regex\": false}]},\n"
     " \"post_processor\": {\"type\": \"TemplateProcessing\", \"single\": [{\"SpecialToken\": {\"id\": \"<s>\"}},\n"
     "  {\"Sequence\": {\"id\": \"A\"}}], \"special_tokens\": {\"<s>\": {\"id\": \"<s>\", \"ids\": [4]}}},\n"
     " \"model\": {\"type\": \"BPE\", \"byte_fallback\": true, \"unk_token\": \"a\",\n"
     "  \"vocab\": {\"a\": 0, \"b\": 1, \"ab\": 2, \"<0x41>\": 3}, \"merges\": [[\"a\", \"b\"]]}}\n"),
};
#define N_SEEDS (sizeof seed_docs / sizeof seed_docs[0])

// The text of every number in `v`'s tree, in order, joined by spaces into buf.
static void number_texts(const cJSON *v, char *buf, size_t cap)
{
    for (; v; v = v->next) {
        const char *t = lm_json_number_text(v);
        if (t) {
            size_t at = strlen(buf);
            snprintf(buf + at, cap - at, "%s%s", at ? " " : "", t);
        }
        number_texts(v->child, buf, cap);
    }
}

static void test_good(void)
{
    for (size_t i = 0; i < sizeof good_cases / sizeof good_cases[0]; i++) {
        const good_case *g = &good_cases[i];
        cJSON *root = NULL;
        lm_err err = {0};
        CHECK_OK(lm_json_parse(&root, g->text, strlen(g->text), "good.json", &err), &err);
        char *printed = root ? cJSON_PrintUnformatted(root) : NULL;
        CHECK_MSG(printed && strcmp(printed, g->printed) == 0, "case %zu: '%s' printed '%s', wanted '%s'", i, g->text,
                  printed ? printed : "(null)", g->printed);
        free(printed);
        cJSON_Delete(root);
    }

    for (size_t i = 0; i < N_SEEDS; i++) {
        cJSON *root = NULL;
        lm_err err = {0};
        CHECK_OK(lm_json_parse(&root, seed_docs[i], strlen(seed_docs[i]), "seed.json", &err), &err);
        CHECK(cJSON_IsObject(root));
        cJSON_Delete(root);
    }

    // Numbers keep their text; what cJSON makes itself has none, nor does a string.
    const char *text = "{\"a\": [1E+2, -0.50], \"b\": {\"c\": 9223372036854775808}, \"d\": \"7\"}";
    cJSON *root = NULL;
    lm_err err = {0};
    CHECK_OK(lm_json_parse(&root, text, strlen(text), "t.json", &err), &err);
    char texts[256] = "";
    if (root) {
        number_texts(root, texts, sizeof texts);
        CHECK_MSG(strcmp(texts, "1E+2 -0.50 9223372036854775808") == 0, "%s", texts);
        CHECK(lm_json_number_text(cJSON_GetObjectItem(root, "d")) == NULL);
        cJSON *made = cJSON_CreateNumber(3);
        CHECK(lm_json_number_text(made) == NULL);
        // the tree is cJSON's to change: appending to a parsed array keeps its links
        cJSON *a = cJSON_GetObjectItem(root, "a");
        CHECK(cJSON_AddItemToArray(a, made));
        CHECK(cJSON_GetArraySize(a) == 3 && cJSON_GetArrayItem(a, 2) == made);
        char *p = cJSON_PrintUnformatted(root);
        CHECK_MSG(p && strcmp(p, "{\"a\":[100,-0.5,3],\"b\":{\"c\":9.2233720368547758e+18},\"d\":\"7\"}") == 0, "%s",
                  p ? p : "(null)");
        free(p);
    }
    cJSON_Delete(root);

    // The kinds, for messages.
    CHECK(strcmp(lm_json_kind(NULL), "invalid") == 0);
    static const char *const kinds[][2] = {{"null", "null"}, {"false", "a boolean"}, {"1", "a number"},
                                           {"\"x\"", "a string"}, {"[]", "an array"}, {"{}", "an object"}};
    for (int k = 0; k < 6; k++) {
        CHECK_OK(lm_json_parse(&root, kinds[k][0], strlen(kinds[k][0]), "k.json", &err), &err);
        CHECK(root && strcmp(lm_json_kind(root), kinds[k][1]) == 0);
        cJSON_Delete(root);
    }

    // Nesting up to the limit reads; one level more does not.
    char deep[2 * (LM_JSON_MAX_DEPTH + 1) + 1];
    for (int d = 0; d < LM_JSON_MAX_DEPTH; d++) {
        deep[d] = '[';
        deep[LM_JSON_MAX_DEPTH + d] = ']';
    }
    CHECK_OK(lm_json_parse(&root, deep, 2 * LM_JSON_MAX_DEPTH, "deep.json", &err), &err);
    cJSON_Delete(root);
}

// ==== random documents ========================================================================

static uint64_t rng = 0x9e3779b97f4a7c15u;
static uint64_t next_u64(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

// A random string: ASCII, escapes cJSON will write, and characters of 2, 3 and 4 bytes.
static void random_string(char *out, size_t cap)
{
    static const uint32_t pool[] = {'a', 'Z', '0', ' ', '"', '\\', '/', '\n', '\t', 0x01, 0x7f, 0xe9, 0x3b1, 0x20ac,
                                    0xfffd, 0x1f600, 0x10ffff};
    size_t n = next_u64() % 12, k = 0;
    for (size_t i = 0; i < n && k + 5 < cap; i++) {
        uint32_t cp = pool[next_u64() % (sizeof pool / sizeof pool[0])];
        if (cp < 0x80) {
            out[k++] = (char)cp;
        } else if (cp < 0x800) {
            out[k++] = (char)(0xC0 | cp >> 6);
            out[k++] = (char)(0x80 | (cp & 0x3F));
        } else if (cp < 0x10000) {
            out[k++] = (char)(0xE0 | cp >> 12);
            out[k++] = (char)(0x80 | (cp >> 6 & 0x3F));
            out[k++] = (char)(0x80 | (cp & 0x3F));
        } else {
            out[k++] = (char)(0xF0 | cp >> 18);
            out[k++] = (char)(0x80 | (cp >> 12 & 0x3F));
            out[k++] = (char)(0x80 | (cp >> 6 & 0x3F));
            out[k++] = (char)(0x80 | (cp & 0x3F));
        }
    }
    out[k] = '\0';
}

static cJSON *random_value(int depth)
{
    int kind = (int)(next_u64() % (depth < 5 ? 7 : 5));
    char s[64];
    switch (kind) {
    case 0: return cJSON_CreateNull();
    case 1: return cJSON_CreateBool(next_u64() & 1);
    case 2: {
        // integers, fractions and large or small magnitudes
        double v = (double)(int64_t)(next_u64() % 2000001) - 1e6;
        if (next_u64() & 1)
            v = ldexp(v, (int)(next_u64() % 400) - 200);
        return cJSON_CreateNumber(v);
    }
    case 3:
    case 4:
        random_string(s, sizeof s);
        return cJSON_CreateString(s);
    case 5: {
        cJSON *a = cJSON_CreateArray();
        for (int n = (int)(next_u64() % 6); n > 0; n--)
            cJSON_AddItemToArray(a, random_value(depth + 1));
        return a;
    }
    default: {
        cJSON *o = cJSON_CreateObject();
        // more members than the reader compares one by one, at times
        int n = (int)(next_u64() % 4 == 0 ? 40 : next_u64() % 6);
        for (int k = 0; k < n; k++) {
            char key[80];
            random_string(s, sizeof s);
            snprintf(key, sizeof key, "%s#%d", s, k);  // each key once
            cJSON_AddItemToObject(o, key, random_value(depth + 1));
        }
        return o;
    }
    }
}

static void test_random_documents(void)
{
    for (int round = 0; round < 300; round++) {
        cJSON *made = random_value(0);
        char *text = cJSON_Print(made);  // formatted: newlines and tabs between values
        cJSON *root = NULL;
        lm_err err = {0};
        CHECK_OK(lm_json_parse(&root, text, strlen(text), "random.json", &err), &err);
        char *again = root ? cJSON_Print(root) : NULL;
        CHECK_MSG(again && strcmp(text, again) == 0, "round %d: read back as\n%s\nfrom\n%s", round,
                  again ? again : "(null)", text);
        CHECK(cJSON_Compare(made, root, true));
        free(again);
        free(text);
        cJSON_Delete(root);
        cJSON_Delete(made);
    }
}

// ==== defects =================================================================================

typedef struct bad_case {
    const char *name;  // corpus file name
    const char *text;
    size_t len;        // 0: strlen(text)
    lm_json_defect defect;
    int64_t line, column;
    const char *needle;  // in the defect's wording
} bad_case;

// 65 arrays, one more than the limit
#define BIG_DEPTH                                                                                  \
    "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]" \
    "]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]"

static const bad_case bad_cases[] = {
    {"empty", "", 0, LM_JSON_SYNTAX, 1, 1, "expected a value, found the end of the text"},
    {"blank", " \n\t", 0, LM_JSON_SYNTAX, 2, 2, "expected a value, found the end of the text"},
    {"bom", "\xEF\xBB\xBF{}", 0, LM_JSON_INVALID, 1, 1, "starts with a UTF-8 byte order mark"},
    {"bom_late", " \xEF\xBB\xBF{}", 0, LM_JSON_SYNTAX, 1, 2, "expected a value, found byte 0xEF"},
    {"trailing", "{\"a\": 1}\n\n  x", 0, LM_JSON_TRAILING, 3, 3, "text after the JSON value"},
    {"two_values", "1 2", 0, LM_JSON_TRAILING, 1, 3, "text after the JSON value"},
    {"trailing_nul", "{}\0", 3, LM_JSON_TRAILING, 1, 3, "text after the JSON value"},
    {"comma_object", "{\"a\": 1,}", 0, LM_JSON_SYNTAX, 1, 9, "expected a string key after ','"},
    {"comma_array", "[1, 2,]", 0, LM_JSON_SYNTAX, 1, 7, "expected a value, found ']'"},
    {"single_quotes", "{'a': 1}", 0, LM_JSON_SYNTAX, 1, 2, "expected a string key or '}', found '''"},
    {"bare_key", "{a: 1}", 0, LM_JSON_SYNTAX, 1, 2, "found 'a'"},
    {"no_colon", "{\"a\" 1}", 0, LM_JSON_SYNTAX, 1, 6, "expected ':' after the key"},
    {"no_comma", "{\"a\": 1 \"b\": 2}", 0, LM_JSON_SYNTAX, 1, 9, "expected ',' or '}' after a member"},
    {"no_close", "[1, 2", 0, LM_JSON_SYNTAX, 1, 6, "expected ',' or ']' after an element, found the end"},
    {"comment", "{} // done", 0, LM_JSON_TRAILING, 1, 4, "text after the JSON value"},
    {"leading_zero", "[01]", 0, LM_JSON_SYNTAX, 1, 2, "no leading zeros"},
    {"plus", "+1", 0, LM_JSON_SYNTAX, 1, 1, "found '+'"},
    {"dot_first", ".5", 0, LM_JSON_SYNTAX, 1, 1, "found '.'"},
    {"dot_last", "1.", 0, LM_JSON_SYNTAX, 1, 3, "digits after its '.'"},
    {"exp_empty", "[1e]", 0, LM_JSON_SYNTAX, 1, 4, "digits in its exponent"},
    {"minus_alone", "-", 0, LM_JSON_SYNTAX, 1, 2, "a '-' must be followed by a digit"},
    {"hex", "0x10", 0, LM_JSON_TRAILING, 1, 2, "text after the JSON value"},
    {"nan", "NaN", 0, LM_JSON_SYNTAX, 1, 1, "expected a value, found 'N'"},
    {"infinity", "[-Infinity]", 0, LM_JSON_SYNTAX, 1, 3, "a '-' must be followed by a digit"},
    {"word", "[tru]", 0, LM_JSON_SYNTAX, 1, 2, "expected a value, found 't'"},
    {"unclosed_string", "{\"a\": \"b}", 0, LM_JSON_SYNTAX, 1, 7, "a string is not closed"},
    {"newline_in_string", "[\"a\nb\"]", 0, LM_JSON_SYNTAX, 1, 4, "a control character (byte 0x0A)"},
    {"nul_in_string", "[\"a\0b\"]", 7, LM_JSON_SYNTAX, 1, 4, "a control character (byte 0x00)"},
    {"bad_escape", "[\"\\x\"]", 0, LM_JSON_SYNTAX, 1, 3, "'\\x' is not a JSON escape"},
    {"short_u", "[\"\\u12\"]", 0, LM_JSON_SYNTAX, 1, 3, "'\\u' must be followed by four hex digits"},
    {"u0000", "{\"a\": \"x\\u0000y\"}", 0, LM_JSON_INVALID, 1, 9, "\\u0000"},
    {"lone_low", "[\"\\udc00\"]", 0, LM_JSON_INVALID, 1, 3, "\\uDC00 is the second half of a surrogate pair"},
    {"lone_high", "[\"\\ud83d x\"]", 0, LM_JSON_INVALID, 1, 3, "\\uD83D is the first half of a surrogate pair"},
    {"high_high", "[\"\\ud83d\\ud83d\"]", 0, LM_JSON_INVALID, 1, 3, "first half of a surrogate pair"},
    {"utf8_continuation", "[\"a\x80\"]", 0, LM_JSON_INVALID, 1, 4, "not valid UTF-8 (byte 0x80)"},
    {"utf8_overlong", "[\"\xC0\x80\"]", 0, LM_JSON_INVALID, 1, 3, "not valid UTF-8 (byte 0xC0)"},
    {"utf8_surrogate", "[\"\xED\xA0\x80\"]", 0, LM_JSON_INVALID, 1, 3, "not valid UTF-8 (byte 0xED)"},
    {"utf8_too_big", "[\"\xF4\x90\x80\x80\"]", 0, LM_JSON_INVALID, 1, 3, "not valid UTF-8 (byte 0xF4)"},
    {"utf8_cut", "[\"\xE2\x82\"]", 0, LM_JSON_INVALID, 1, 3, "not valid UTF-8 (byte 0xE2)"},
    {"utf8_column", "{\"\xC3\xA9t\xC3\xA9\": 1,\n \"caf\xC3\xA9\": [1, \"\xFF\"]}", 0, LM_JSON_INVALID, 2, 15,
     "not valid UTF-8 (byte 0xFF)"},
    {"outside_string", "{\"a\": \xC3\xA9}", 0, LM_JSON_SYNTAX, 1, 7, "expected a value, found byte 0xC3"},
    {"dup_top", "{\"a\": 1,\n \"b\": 2,\n \"a\": 3}", 0, LM_JSON_INVALID, 3, 2, "key 'a' appears twice"},
    {"dup_nested", "{\"x\": {\"y\": [0, {\"k\": 1, \"k\": 2}]}}", 0, LM_JSON_INVALID, 1, 26,
     "key 'k' in 'x.y[1]' appears twice"},
    {"dup_large",
     "{\"k0\":0,\"k1\":1,\"k2\":2,\"k3\":3,\"k4\":4,\"k5\":5,\"k6\":6,\"k7\":7,\"k8\":8,\"k9\":9,\"k10\":10,\"k11\":11,"
     "\"k12\":12,\"k13\":13,\"k14\":14,\"k15\":15,\"k16\":16,\"k17\":17,\"k3\":3}", 0, LM_JSON_INVALID, 1, 144,
     "key 'k3' appears twice"},
    {"dup_large_last",
     "{\"k0\":0,\"k1\":1,\"k2\":2,\"k3\":3,\"k4\":4,\"k5\":5,\"k6\":6,\"k7\":7,\"k8\":8,\"k9\":9,\"k10\":10,\"k11\":11,"
     "\"k12\":12,\"k13\":13,\"k14\":14,\"k15\":15,\"k16\":16,\"k17\":17,\"k17\":3}", 0, LM_JSON_INVALID, 1, 144,
     "key 'k17' appears twice"},
    {"too_deep", BIG_DEPTH, 0, LM_JSON_INVALID, 1, LM_JSON_MAX_DEPTH + 1, "nested deeper than 64 levels"},
    {"huge_key", "{\"rope_scaling\": {\"factor\": 1e400}}", 0, LM_JSON_INVALID, 1, 29,
     "key 'rope_scaling.factor': 1e400 is out of range"},
    {"huge_element", "{\"input_ids\": [1, -2E+999]}", 0, LM_JSON_INVALID, 1, 19,
     "input_ids[1]: -2E+999 is out of range"},
    {"huge_alone", "1e309", 0, LM_JSON_INVALID, 1, 1, "1e309 is out of range"},
};
#define N_BAD (sizeof bad_cases / sizeof bad_cases[0])

static size_t case_len(const bad_case *b) { return b->len ? b->len : strlen(b->text); }

static void test_bad(void)
{
    for (size_t i = 0; i < N_BAD; i++) {
        const bad_case *b = &bad_cases[i];
        cJSON *root = (cJSON *)1;
        lm_json_error e;
        lm_status s = lm_json_parse_detail(&root, b->text, case_len(b), &e);
        CHECK_MSG(s == LM_ERR_FORMAT && root == NULL && e.defect == b->defect && e.line == b->line &&
                      e.column == b->column && strstr(e.what, b->needle) != NULL,
                  "%s: %s, defect %d at line %lld, column %lld: '%s'; wanted defect %d at %lld:%lld with '%s'", b->name,
                  lm_status_name(s), (int)e.defect, (long long)e.line, (long long)e.column, e.what, (int)b->defect,
                  (long long)b->line, (long long)b->column, b->needle);
        CHECK_MSG(e.offset <= case_len(b), "%s: offset %zu", b->name, e.offset);
        bool dup = strstr(b->name, "dup_") == b->name;
        CHECK_MSG(dup == (e.first_line > 0), "%s: first at %lld:%lld", b->name, (long long)e.first_line,
                  (long long)e.first_column);
    }

    // Where a key given twice was first.
    cJSON *root = NULL;
    lm_json_error e;
    const bad_case *top = NULL, *large = NULL;
    for (size_t i = 0; i < N_BAD; i++) {
        if (strcmp(bad_cases[i].name, "dup_top") == 0)
            top = &bad_cases[i];
        if (strcmp(bad_cases[i].name, "dup_large") == 0)
            large = &bad_cases[i];
    }
    lm_json_parse_detail(&root, top->text, strlen(top->text), &e);
    CHECK(e.first_line == 1 && e.first_column == 2);
    lm_json_parse_detail(&root, large->text, strlen(large->text), &e);
    CHECK(e.first_line == 1 && e.first_column == 23);

    // The messages of lm_json_parse: the label, the kind, the position.
    lm_err err = {0};
    static const struct { const char *text, *msg; } msgs[] = {
        {"{\"a\": }", "x/config.json: not valid JSON: expected a value, found '}' (line 1, column 7)"},
        {"{}\n}", "x/config.json: text after the JSON value (line 2, column 1)"},
        {"{\"r\": 8,\n \"r\": 16}",
         "x/config.json: key 'r' appears twice (line 2, column 2; first at line 1, column 2)"},
        {"{\"lora_alpha\": 1e400}", "x/config.json: key 'lora_alpha': 1e400 is out of range (a double holds magnitudes "
                                    "up to 1.8e308) (line 1, column 16)"},
    };
    for (size_t i = 0; i < sizeof msgs / sizeof msgs[0]; i++) {
        CHECK_FAILS(lm_json_parse(&root, msgs[i].text, strlen(msgs[i].text), "x/config.json", &err), LM_ERR_FORMAT,
                    msgs[i].msg, &err);
        CHECK_MSG(strcmp(err.msg, msgs[i].msg) == 0, "'%s', wanted '%s'", err.msg, msgs[i].msg);
        CHECK(root == NULL);
    }
}

// lm_json_parse_nul keeps \u0000 as C0 80, where lm_json_parse refuses it; nothing else changes.
static void test_nul(void)
{
    static const char text[] = "{\"x\\u0000y\": \"\\u0000\", \"b\": \"\\u0041\"}";
    cJSON *root = NULL;
    lm_err err = {0};
    CHECK_OK(lm_json_parse_nul(&root, text, sizeof text - 1, "t.json", &err), &err);
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, "x\xC0\x80y");
    CHECK(cJSON_IsString(v) && strcmp(v->valuestring, "\xC0\x80") == 0);
    v = cJSON_GetObjectItemCaseSensitive(root, "b");
    CHECK(cJSON_IsString(v) && strcmp(v->valuestring, "A") == 0);
    cJSON_Delete(root);
    root = NULL;
    CHECK_FAILS(lm_json_parse(&root, text, sizeof text - 1, "t.json", &err), LM_ERR_FORMAT, "\\u0000", &err);
    CHECK_FAILS(lm_json_parse_nul(&root, "{\"a\": \"\\u00\"}", 13, "t.json", &err), LM_ERR_FORMAT, "four hex digits",
                &err);
}

// ==== files ===================================================================================

static void test_load(void)
{
    char *dir = make_tmpdir();
    lm_err err;
    cJSON *root = NULL;
    write_text(dir, "good.json", "{\"architectures\": [\"LlamaForCausalLM\"]}\n");
    char *good = lm_path_join(dir, "good.json");
    CHECK_OK(lm_json_load(&root, good, 1 << 20, &err), &err);
    CHECK(root && cJSON_IsArray(cJSON_GetObjectItem(root, "architectures")));
    cJSON_Delete(root);
    CHECK_FAILS(lm_json_load(&root, good, 8, &err), LM_ERR_FORMAT, "more than the 8 allowed", &err);
    CHECK(root == NULL);

    write_text(dir, "bad.json", "{\n  \"a\": 1\n  \"b\": 2\n}\n");
    char *bad = lm_path_join(dir, "bad.json"), want[512];
    snprintf(want, sizeof want, "%s: not valid JSON: expected ',' or '}' after a member, found '\"' (line 3, column 3)",
             bad);
    CHECK_FAILS(lm_json_load(&root, bad, 1 << 20, &err), LM_ERR_FORMAT, want, &err);

    char *missing = lm_path_join(dir, "missing.json");
    CHECK_FAILS(lm_json_load(&root, missing, 1 << 20, &err), LM_ERR_NOT_FOUND, missing, &err);
    char *sub = subdir(dir, "dir.json");
    snprintf(want, sizeof want, "%s is a directory, not a regular file", sub);
    CHECK_FAILS(lm_json_load(&root, sub, 1 << 20, &err), LM_ERR_USAGE, want, &err);
    // a FIFO with no writer would block a plain open: refused at once (the alarm turns a hang
    // into a failure of this test)
    char *fifo = lm_path_join(dir, "fifo.json");
    CHECK(mkfifo(fifo, 0644) == 0);
    alarm(60);
    snprintf(want, sizeof want, "%s is a FIFO, not a regular file", fifo);
    CHECK_FAILS(lm_json_load(&root, fifo, 1 << 20, &err), LM_ERR_USAGE, want, &err);
    alarm(0);
    CHECK(root == NULL);
    free(good);
    free(bad);
    free(missing);
    free(sub);
    free(fifo);
    remove_tmpdir(dir);
}

// ==== the seed corpus =========================================================================

static int write_corpus(const char *dir)
{
    lm_err err;
    if (lm_mkdir_p(dir, &err) != LM_OK) {
        fprintf(stderr, "%s\n", err.msg);
        return 1;
    }
    for (size_t i = 0; i < N_BAD; i++) {
        char name[64];
        snprintf(name, sizeof name, "bad_%s.json", bad_cases[i].name);
        char *p = lm_path_join(dir, name);
        if (lm_write_file(p, bad_cases[i].text, case_len(&bad_cases[i]), &err) != LM_OK) {
            fprintf(stderr, "%s\n", err.msg);
            free(p);
            return 1;
        }
        free(p);
    }
    for (size_t i = 0; i < sizeof good_cases / sizeof good_cases[0]; i++) {
        char name[64];
        snprintf(name, sizeof name, "good_%zu.json", i);
        char *p = lm_path_join(dir, name);
        lm_status s = lm_write_file(p, good_cases[i].text, strlen(good_cases[i].text), &err);
        free(p);
        if (s != LM_OK) {
            fprintf(stderr, "%s\n", err.msg);
            return 1;
        }
    }
    for (size_t i = 0; i < N_SEEDS; i++) {
        char name[64];
        snprintf(name, sizeof name, "seed_%zu.json", i);
        char *p = lm_path_join(dir, name);
        lm_status s = lm_write_file(p, seed_docs[i], strlen(seed_docs[i]), &err);
        free(p);
        if (s != LM_OK) {
            fprintf(stderr, "%s\n", err.msg);
            return 1;
        }
    }
    printf("%zu files written to %s\n", N_BAD + sizeof good_cases / sizeof good_cases[0] + N_SEEDS, dir);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc == 3 && strcmp(argv[1], "--write-corpus") == 0)
        return write_corpus(argv[2]);
    test_good();
    test_random_documents();
    test_bad();
    test_nul();
    test_load();
    return check_report("test_json");
}
