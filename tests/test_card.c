// Tests of the model card (card.h): YAML, shell and Markdown quoting of awkward strings, Hub ids
// from the Hub's cache layout, the shortest numbers, and a whole card's front matter and body.
#include "card.h"
#include "check.h"
#include "testfs.h"

#include <unistd.h>

// s quoted by fn, as a new string in *out (freed by the next call, and at the end with NULL).
static const char *quoted(void (*fn)(lm_buf *, const char *), const char *s)
{
    static lm_buf b;
    free(b.p);
    memset(&b, 0, sizeof b);
    if (!fn)
        return NULL;
    fn(&b, s);
    return b.oom || !b.p ? "(oom)" : b.p;
}

#define CHECK_QUOTED(fn, in, want)                                                              \
    do {                                                                                        \
        const char *got_ = quoted(fn, in);                                                      \
        CHECK_MSG(strcmp(got_, want) == 0, "%s(%s) = [%s], wanted [%s]", #fn, #in, got_, want); \
    } while (0)

static void test_yaml(void)
{
    CHECK_QUOTED(lm_card_yaml_str, "org/model", "\"org/model\"");
    CHECK_QUOTED(lm_card_yaml_str, "", "\"\"");
    // what a plain scalar would misread: ": ", " #", a leading "-", "[", quotes, backslashes
    CHECK_QUOTED(lm_card_yaml_str, "a: b #c", "\"a: b #c\"");
    CHECK_QUOTED(lm_card_yaml_str, "- [x]", "\"- [x]\"");
    CHECK_QUOTED(lm_card_yaml_str, "say \"hi\" \\ it's", "\"say \\\"hi\\\" \\\\ it's\"");
    // line breaks and controls escaped; UTF-8 kept, C1 controls and U+2028 escaped
    CHECK_QUOTED(lm_card_yaml_str, "a\nb\tc\x01\x7f", "\"a\\nb\\tc\\x01\\x7f\"");
    CHECK_QUOTED(lm_card_yaml_str, "caf\xc3\xa9 \xe2\x80\xa8 \xc2\x85", "\"caf\xc3\xa9 \\u2028 \\u0085\"");
    // bytes that are not UTF-8 (a path may hold them): escaped, the rest kept
    CHECK_QUOTED(lm_card_yaml_str, "x\xff\xc3y", "\"x\\xff\\xc3y\"");
}

static void test_shell(void)
{
    CHECK_QUOTED(lm_card_shell_word, "/data/base-1.5B_v2", "/data/base-1.5B_v2");
    CHECK_QUOTED(lm_card_shell_word, "1,0.5", "1,0.5");
    CHECK_QUOTED(lm_card_shell_word, "", "''");
    CHECK_QUOTED(lm_card_shell_word, "my model", "'my model'");
    CHECK_QUOTED(lm_card_shell_word, "it's $HOME `x` *", "'it'\\''s $HOME `x` *'");
    CHECK_QUOTED(lm_card_shell_word, "a\nb", "'a\nb'");
}

static void test_markdown(void)
{
    CHECK_QUOTED(lm_card_md_code, "base/", "`base/`");
    CHECK_QUOTED(lm_card_md_code, "a`b", "``a`b``");
    CHECK_QUOTED(lm_card_md_code, "`x``", "``` `x`` ```");
    CHECK_QUOTED(lm_card_md_code, " lead", "`  lead `");  // one space is stripped from each side
    CHECK_QUOTED(lm_card_md_code, "two\nlines", "`two lines`");
}

static void test_numbers(void)
{
    char buf[40];
    struct { double v; const char *want; } cases[] = {
        {1, "1"}, {0.5, "0.5"}, {0.1, "0.1"}, {0.2, "0.2"}, {1.0 / 3, "0.3333333333333333"}, {-2.5, "-2.5"},
        {1e-7, "1e-07"}, {0.80000000000000004, "0.8"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        lm_card_number(buf, sizeof buf, cases[i].v);
        CHECK_MSG(strcmp(buf, cases[i].want) == 0 && strtod(buf, NULL) == cases[i].v, "%.17g -> %s, wanted %s",
                  cases[i].v, buf, cases[i].want);
    }
}

static void test_hub_id(void)
{
    char *dir = make_tmpdir(), id[64];
    char *org = subdir(dir, "hub/models--meta-llama--Llama-3.2-1B/snapshots/0123abcd");
    char *nested = subdir(dir, "hub/models--meta-llama--Llama-3.2-1B/snapshots/0123abcd/adapter");
    char *bare = subdir(dir, "hub/models--gpt2/snapshots/f00");
    char *bad = subdir(dir, "hub/models--a--b--c/snapshots/1");
    char *blobs = subdir(dir, "hub/models--x--y/blobs");
    char *plain = subdir(dir, "plain/base");
    CHECK(lm_card_hub_id(org, id, sizeof id) && strcmp(id, "meta-llama/Llama-3.2-1B") == 0);
    CHECK(lm_card_hub_id(nested, id, sizeof id) && strcmp(id, "meta-llama/Llama-3.2-1B") == 0);
    CHECK(lm_card_hub_id(bare, id, sizeof id) && strcmp(id, "gpt2") == 0);
    CHECK(!lm_card_hub_id(bad, id, sizeof id));      // no Hub name holds "--"
    CHECK(!lm_card_hub_id(blobs, id, sizeof id));    // not a snapshot
    CHECK(!lm_card_hub_id(plain, id, sizeof id));
    CHECK(!lm_card_hub_id("/no/such/path", id, sizeof id));
    char small[8];
    CHECK(!lm_card_hub_id(org, small, sizeof small));  // does not fit: not cut
    // a symlink into the cache, as a user may make one, resolves to the snapshot
    char *link = lm_path_join(dir, "llama");
    CHECK(symlink(org, link) == 0);
    CHECK(lm_card_hub_id(link, id, sizeof id) && strcmp(id, "meta-llama/Llama-3.2-1B") == 0);
    free(link);
    free(org);
    free(nested);
    free(bare);
    free(bad);
    free(blobs);
    free(plain);
    remove_tmpdir(dir);
}

static void test_card(void)
{
    char *dir = make_tmpdir();
    char *snap = subdir(dir, "models--org--base/snapshots/1");
    lm_card_input in[] = {
        {"lora: \"math\"", "LoRA adapter", 1, 0.3, NULL, NULL},
        {"ft`chat", "model", 0.5, -1, NULL, NULL},
        {"ft3", "model", 1, 1, "per tensor: see the configuration", "per tensor: see --densities"},
    };
    lm_card_option opts[] = {{"lambda", "1", false}, {"calibration data", "d a.jsonl", true}};
    const char *argv[] = {"llmerge", "task-arithmetic", snap, "lora: \"math\"", "ft`chat", "-o", "out ```"};
    lm_card c = {
        .title = "merged\nname", .version = "9.9.9", .method = "task-arithmetic",
        .method_summary = "Task arithmetic: add the weighted sum\nof the task vectors.", .base = snap,
        .inputs = in, .n_inputs = 3, .options = opts, .n_options = 2, .argv = argv, .argc = 7,
    };
    char *text = lm_card_text(&c);
    CHECK(text != NULL);
    if (text) {
        // the local paths are left out of base_model: the Hub takes repository ids only
        const char *front = "---\nbase_model:\n- \"org/base\"\n"
                            "base_model_relation: merge\nlibrary_name: transformers\ntags:\n- merge\n- llmerge\n---\n";
        CHECK_MSG(strncmp(text, front, strlen(front)) == 0, "%s", text);
        const char *want[] = {
            "\n# merged name\n",
            "A merge of 3 fine-tunes onto `",
            "by the task-arithmetic method, made with llmerge 9.9.9.",
            "`task-arithmetic`: Task arithmetic: add the weighted sum of the task vectors.\n",
            "1. `lora: \"math\"` (LoRA adapter): weight 1, density 0.3\n",
            "2. ``ft`chat`` (model): weight 0.5\n",
            // a setting that varies from tensor to tensor is said so, not given a number
            "3. `ft3` (model): weight per tensor: see the configuration, density per tensor: see --densities\n",
            "- lambda: 1\n- calibration data: `d a.jsonl`\n",
            // the command line's fence is longer than the backticks inside it
            "\n````sh\nllmerge task-arithmetic ",
            " 'lora: \"math\"' 'ft`chat' -o 'out ```'\n````\n",
            "add their Hub ids there",
        };
        for (size_t i = 0; i < sizeof want / sizeof want[0]; i++)
            CHECK_MSG(strstr(text, want[i]) != NULL, "no [%s] in:\n%s", want[i], text);
        CHECK(strstr(text, "density -1") == NULL);
    }
    free(text);

    // every model a Hub id: no note on paths; the same repository (here the base's snapshot as
    // the FT too) listed once; written to a file
    lm_card_input hub_in[] = {{snap, "model", 1, 0.2, NULL, NULL}};
    c.inputs = hub_in;
    c.n_inputs = 1;
    char *path = lm_path_join(dir, LM_CARD_NAME), *back = NULL;
    size_t len;
    lm_err err = {0};
    CHECK_OK(lm_card_write(path, &c, &err), &err);
    CHECK_OK(lm_read_file(path, 1 << 20, &back, &len, &err), &err);
    CHECK(back && strstr(back, "base_model:\n- \"org/base\"\nbase_model_relation") && !strstr(back, "Hub ids there") &&
          strstr(back, "A merge of 1 fine-tune onto"));
    free(back);
    // a file that cannot be written names its path
    char *no = lm_path_join(dir, "no/such/README.md");
    CHECK_FAILS(lm_card_write(no, &c, &err), LM_ERR_IO, "no/such/README.md", &err);
    free(no);
    free(path);
    free(snap);
    remove_tmpdir(dir);
}

int main(void)
{
    test_yaml();
    test_shell();
    test_markdown();
    test_numbers();
    test_hub_id();
    test_card();
    quoted(NULL, NULL);
    return check_report("test_card");
}
