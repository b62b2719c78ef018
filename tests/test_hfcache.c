// Tests of hfcache.c on a Hugging Face cache the test lays out as huggingface_hub does (files
// in blobs/, symbolic links to them under snapshots/COMMIT/, refs/ files holding commits): each
// argument form (ORG/NAME, NAME, @branch, @tag, @refs/pr/N, @commit whole and abbreviated, a
// branch before a hash), the environment's precedence (HF_HUB_CACHE, HUGGINGFACE_HUB_CACHE,
// HF_HOME, XDG_CACHE_HOME, HOME), every error's status and text, that an existing path always
// wins, lm_input_detect on what the cache holds, and the Hub ids the model card finds.
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "adapter.h"
#include "card.h"
#include "check.h"
#include "hfcache.h"
#include "testfs.h"
#include "util.h"

// The commits of the layout: A and C share their first 7 digits; D starts with "deadbee", which
// is also the name of a branch that points at B.
#define HASH_A "aaaa1110000000000000000000000000000000a1"
#define HASH_B "b0b0b0b00000000000000000000000000000000b"
#define HASH_C "aaaa111fffffffffffffffffffffffffffffffc3"
#define HASH_D "deadbeef000000000000000000000000000000d4"
#define HASH_E "e0e0e0e00000000000000000000000000000000e"

static char *tmp;  // the test's directory
static char *hub;  // tmp/hub, the cache HF_HUB_CACHE names

// Writes blobs/NAME into `entry` and links snapshots/COMMIT/FILE to it as ../../blobs/NAME, as
// huggingface_hub does (NAME: the file's hash there; any unique name here).
static void add_file(const char *entry, const char *commit, const char *file, const char *text)
{
    char *blobs = subdir(entry, "blobs");
    char *blob = lm_strfmt("%s-%s", commit, file);
    write_text(blobs, blob, text);
    char *snaps = lm_strfmt("snapshots/%s", commit);
    char *snap = subdir(entry, snaps);
    char *link = lm_path_join(snap, file), *target = lm_strfmt("../../blobs/%s", blob);
    CHECK_MSG(symlink(target, link) == 0, "symlink %s -> %s", link, target);
    CHECK(lm_is_file(link));
    free(link);
    free(target);
    free(snap);
    free(snaps);
    free(blob);
    free(blobs);
}

// A model's two files (what lm_input_detect looks for) in snapshot `commit` of `entry`.
static void add_model(const char *entry, const char *commit)
{
    add_file(entry, commit, "config.json", "{}");
    add_file(entry, commit, "model.safetensors", commit);
}

// refs/REF of `entry` holding `text`.
static void add_ref(const char *entry, const char *ref, const char *text)
{
    char *refs = lm_path_join(entry, "refs"), *path = lm_path_join(refs, ref);
    char *parent = lm_path_parent(path);
    lm_err err;
    CHECK_OK(lm_mkdir_p(parent, &err), &err);
    CHECK_OK(lm_write_file(path, text, strlen(text), &err), &err);
    free(parent);
    free(path);
    free(refs);
}

// The directory of models--... in the cache `cache`, created.
static char *entry_dir(const char *cache, const char *name)
{
    return subdir(cache, name);
}

static void layout(void)
{
    hub = subdir(tmp, "hub");
    // org/base: main, a branch with a newline after its hash, a tag, a pull request's ref, a
    // branch named like an abbreviated hash, and a snapshot that no ref names
    char *e = entry_dir(hub, "models--org--base");
    add_model(e, HASH_A);
    add_model(e, HASH_B);
    add_model(e, HASH_C);
    add_model(e, HASH_D);
    add_ref(e, "main", HASH_A);
    add_ref(e, "dev", HASH_B "\n");
    add_ref(e, "v1.0", HASH_C);
    add_ref(e, "refs/pr/1", HASH_B);
    add_ref(e, "deadbee", HASH_B);
    free(e);
    // gpt2: a name without an organisation
    e = entry_dir(hub, "models--gpt2");
    add_model(e, HASH_E);
    add_ref(e, "main", HASH_E);
    free(e);
    // org/lora: an adapter
    e = entry_dir(hub, "models--org--lora");
    add_file(e, HASH_A, "adapter_config.json", "{}");
    add_file(e, HASH_A, "adapter_model.safetensors", "x");
    add_ref(e, "main", HASH_A);
    free(e);
    // org/norefs: downloaded at a commit, so without refs/main
    e = entry_dir(hub, "models--org--norefs");
    add_model(e, HASH_E);
    free(e);
    // org/gone: refs/main names a snapshot that is not there
    e = entry_dir(hub, "models--org--gone");
    add_model(e, HASH_A);
    add_ref(e, "main", HASH_B);
    free(e);
    // org/badref: refs/main holds no hash
    e = entry_dir(hub, "models--org--badref");
    add_model(e, HASH_A);
    add_ref(e, "main", "not a commit\n");
    free(e);
    // org/readme: a snapshot that is neither a model nor an adapter
    e = entry_dir(hub, "models--org--readme");
    add_file(e, HASH_A, "README.md", "# hi\n");
    add_ref(e, "main", HASH_A);
    free(e);
}

// lm_hf_resolve(arg) succeeds with HF_HUB_CACHE's models--ENTRY/snapshots/COMMIT.
static void expect_snapshot(const char *arg, const char *entry, const char *commit)
{
    char *out = NULL, *want = lm_strfmt("%s/%s/snapshots/%s", hub, entry, commit);
    lm_err err = {0};
    CHECK_OK(lm_hf_resolve(arg, &out, &err), &err);
    CHECK_MSG(out && strcmp(out, want) == 0, "%s -> %s, wanted %s", arg, out ? out : "(null)", want);
    free(out);
    free(want);
}

// lm_hf_resolve(arg) fails with `want` and a message holding each of the NULL-ended needles.
static void expect_error(const char *arg, lm_status want, ...)
{
    char *out = (char *)"untouched";
    lm_err err = {0};
    lm_status s = lm_hf_resolve(arg, &out, &err);
    CHECK_MSG(s == want, "%s -> %s (%s), wanted %s", arg, lm_status_name(s), err.msg, lm_status_name(want));
    CHECK_MSG(out == NULL, "%s: *out not NULL on failure", arg);
    va_list ap;
    va_start(ap, want);
    for (const char *needle; (needle = va_arg(ap, const char *)) != NULL;)
        CHECK_MSG(strstr(err.msg, needle) != NULL, "%s: message lacks '%s': %s", arg, needle, err.msg);
    va_end(ap);
}

static void test_forms(void)
{
    expect_snapshot("org/base", "models--org--base", HASH_A);
    expect_snapshot("org/base@main", "models--org--base", HASH_A);
    expect_snapshot("org/base@dev", "models--org--base", HASH_B);  // the newline after the hash
    expect_snapshot("org/base@v1.0", "models--org--base", HASH_C);
    expect_snapshot("org/base@refs/pr/1", "models--org--base", HASH_B);
    expect_snapshot("gpt2", "models--gpt2", HASH_E);
    expect_snapshot("gpt2@main", "models--gpt2", HASH_E);
    // commits, whole and abbreviated (at least 7 digits, any case)
    expect_snapshot("org/base@" HASH_C, "models--org--base", HASH_C);
    expect_snapshot("org/base@aaaa1110", "models--org--base", HASH_A);
    expect_snapshot("org/base@AAAA111F", "models--org--base", HASH_C);
    expect_snapshot("org/norefs@e0e0e0e", "models--org--norefs", HASH_E);
    // a branch is looked up before a hash: deadbee is a branch naming B, D starts with deadbee
    expect_snapshot("org/base@deadbee", "models--org--base", HASH_B);
    expect_snapshot("org/base@deadbeef", "models--org--base", HASH_D);
    // names the Hub allows: digits, '_', '.', single '-'
    char *e = entry_dir(hub, "models--Org_2--Name-1.5B_x");
    add_model(e, HASH_B);
    add_ref(e, "main", HASH_B);
    free(e);
    expect_snapshot("Org_2/Name-1.5B_x", "models--Org_2--Name-1.5B_x", HASH_B);
}

static void test_errors(void)
{
    // not in the cache: where it looked, the entry it expected, the commands that download it
    char *where = lm_strfmt("in %s (set by $HF_HUB_CACHE)", hub);
    expect_error("org/missing", LM_ERR_NOT_FOUND, "org/missing: no such file or directory, nor a model in the "
                 "Hugging Face cache", "no models--org--missing", where, "llmerge downloads nothing",
                 "`huggingface-cli download org/missing` or `hf download org/missing`", NULL);
    expect_error("gpt3", LM_ERR_NOT_FOUND, "no models--gpt3", where, "`huggingface-cli download gpt3`", NULL);
    expect_error("org/missing@v2", LM_ERR_NOT_FOUND, "no models--org--missing",
                 "`huggingface-cli download org/missing --revision v2` or `hf download org/missing --revision v2`",
                 NULL);
    free(where);
    char *out = NULL;
    lm_err err = {0};
    CHECK(lm_hf_resolve("org/missing", &out, &err) == LM_ERR_NOT_FOUND && !strstr(err.msg, "--revision"));

    // a revision the entry lacks: a branch or tag, then a hash
    char *in = lm_strfmt("(in %s)", hub);
    expect_error("org/base@nope", LM_ERR_NOT_FOUND, "org/base@nope: the Hugging Face cache's models--org--base",
                 in, "has no revision nope: no branch or tag refs/nope (it has: deadbee, dev, main, v1.0)",
                 "`huggingface-cli download org/base --revision nope`", NULL);
    expect_error("org/base@1234567", LM_ERR_NOT_FOUND, "no branch or tag refs/1234567",
                 "no snapshot whose commit starts with 1234567 (snapshots: aaaa11100000, aaaa111fffff, b0b0b0b00000, "
                 "deadbeef0000)", "--revision 1234567", NULL);
    expect_error("org/base@abc12", LM_ERR_NOT_FOUND, "no branch or tag refs/abc12",
                 "a commit hash needs at least 7 hex digits", NULL);
    // an abbreviation that names two snapshots
    expect_error("org/base@aaaa111", LM_ERR_USAGE, "aaaa111 starts the commits of 2 snapshots", HASH_A, HASH_C,
                 "give more of the hash", NULL);
    free(in);

    // refs/main missing: which snapshots there are, how to name one
    expect_error("org/norefs", LM_ERR_NOT_FOUND, "org/norefs: the Hugging Face cache's models--org--norefs",
                 "has no refs/main", "snapshots: e0e0e0e00000", "name one as org/norefs@COMMIT",
                 "`huggingface-cli download org/norefs`", NULL);
    // the snapshot refs/main names is missing
    expect_error("org/gone", LM_ERR_NOT_FOUND, "/models--org--gone/refs/main names commit " HASH_B,
                 "no models--org--gone/snapshots/" HASH_B, "get it again with `huggingface-cli download org/gone`",
                 NULL);
    expect_error("org/gone@main", LM_ERR_NOT_FOUND, "names commit " HASH_B, "--revision main", NULL);
    // refs/main holds no hash
    expect_error("org/badref", LM_ERR_FORMAT, "/models--org--badref/refs/main: holds no commit hash", NULL);

    // not a repository id, and not on disk: a missing path, nothing said of the cache
    const char *not_ids[] = {"/no/such/dir", "./org/base", "org/base/", "a/b/c", "org//base", "org/na--me",
                             "org/na..me", "-org/base", "org/base-", ".org/base", "org/base@", "org/base@../x",
                             "org/base@a//b", "org/base@a b", "org/ba se", ""};
    for (size_t i = 0; i < sizeof not_ids / sizeof *not_ids; i++) {
        char *want = lm_strfmt("%s: no such file or directory", not_ids[i]);
        lm_err_clear(&err);
        out = (char *)"untouched";
        lm_status s = lm_hf_resolve(not_ids[i], &out, &err);
        CHECK_MSG(s == LM_ERR_NOT_FOUND && strcmp(err.msg, want) == 0 && !out, "'%s' -> %s: %s", not_ids[i],
                  lm_status_name(s), err.msg);
        free(want);
    }
    // a name longer than the Hub allows (96)
    char name[128];
    memset(name, 'x', 97);
    name[97] = '\0';
    char *long_id = lm_strfmt("org/%s", name);
    CHECK_FAILS(lm_hf_resolve(long_id, &out, &err), LM_ERR_NOT_FOUND, "no such file or directory", &err);
    CHECK(!strstr(err.msg, "Hugging Face"));
    name[96] = '\0';  // 96 is allowed: looked up
    free(long_id);
    long_id = lm_strfmt("org/%s", name);
    CHECK_FAILS(lm_hf_resolve(long_id, &out, &err), LM_ERR_NOT_FOUND, "nor a model in the Hugging Face cache", &err);
    free(long_id);
}

// The environment's precedence, through lm_hf_cache_dir and through a resolution: each cache
// holds org/where at a commit of its own.
static void test_env(void)
{
    char *c_hub = subdir(tmp, "env/hubcache"), *c_legacy = subdir(tmp, "env/legacy");
    char *c_home = subdir(tmp, "env/hfhome/hub"), *c_xdg = subdir(tmp, "env/xdg/huggingface/hub");
    char *c_def = subdir(tmp, "env/home/.cache/huggingface/hub");
    struct {
        const char *var, *value, *from;
        char *cache;
        const char *commit;
    } order[] = {
        {"HF_HUB_CACHE", "env/hubcache", "set by $HF_HUB_CACHE", c_hub, HASH_A},
        {"HUGGINGFACE_HUB_CACHE", "env/legacy", "set by $HUGGINGFACE_HUB_CACHE", c_legacy, HASH_B},
        {"HF_HOME", "env/hfhome", "$HF_HOME/hub", c_home, HASH_C},
        {"XDG_CACHE_HOME", "env/xdg", "$XDG_CACHE_HOME/huggingface/hub", c_xdg, HASH_D},
        {"HOME", "env/home", "the default, ~/.cache/huggingface/hub", c_def, HASH_E},
    };
    size_t n = sizeof order / sizeof *order;
    for (size_t i = 0; i < n; i++) {
        char *e = entry_dir(order[i].cache, "models--org--where");
        add_model(e, order[i].commit);
        add_ref(e, "main", order[i].commit);
        free(e);
        char *v = lm_path_join(tmp, order[i].value);
        CHECK(setenv(order[i].var, v, 1) == 0);
        free(v);
    }
    lm_err err = {0};
    for (size_t i = 0; i < n; i++) {
        // each variable wins over the ones after it
        char *dir = NULL, *out = NULL;
        const char *from = NULL;
        CHECK_OK(lm_hf_cache_dir(&dir, &from, &err), &err);
        CHECK_MSG(dir && strcmp(dir, order[i].cache) == 0, "with %s first: %s, wanted %s", order[i].var,
                  dir ? dir : "(null)", order[i].cache);
        CHECK_MSG(from && strcmp(from, order[i].from) == 0, "with %s first: from '%s'", order[i].var,
                  from ? from : "(null)");
        CHECK_OK(lm_hf_resolve("org/where", &out, &err), &err);
        char *want = lm_strfmt("%s/models--org--where/snapshots/%s", order[i].cache, order[i].commit);
        CHECK_MSG(out && strcmp(out, want) == 0, "with %s first: %s, wanted %s", order[i].var,
                  out ? out : "(null)", want);
        free(want);
        free(out);
        free(dir);
        // set to the empty string, a variable counts as unset: the next one wins (unset in turn)
        CHECK((i % 2 == 0 ? setenv(order[i].var, "", 1) : unsetenv(order[i].var)) == 0);
    }
    CHECK(unsetenv("HF_HUB_CACHE") == 0 && unsetenv("HF_HOME") == 0 && unsetenv("HOME") == 0);
    // none set: no cache, and a Hub id is a missing path that says so
    char *dir = (char *)"untouched";
    CHECK_FAILS(lm_hf_cache_dir(&dir, NULL, &err), LM_ERR_NOT_FOUND, "no Hugging Face cache to look in", &err);
    CHECK(dir == NULL);
    expect_error("org/where", LM_ERR_NOT_FOUND, "org/where: no such file or directory, and no Hugging Face cache "
                 "to look in (HF_HUB_CACHE, HF_HOME, XDG_CACHE_HOME and HOME are all unset)", NULL);

    // "~/" stands for $HOME in a variable (as Python's expanduser reads it)
    char *home = lm_path_join(tmp, "env/home");
    CHECK(setenv("HOME", home, 1) == 0);
    CHECK(setenv("HF_HOME", "~/hf", 1) == 0);
    const char *from = NULL;
    CHECK_OK(lm_hf_cache_dir(&dir, &from, &err), &err);
    char *want = lm_strfmt("%s/hf/hub", home);
    CHECK_MSG(strcmp(dir, want) == 0, "HF_HOME=~/hf: %s, wanted %s", dir, want);
    CHECK(strcmp(from, "$HF_HOME/hub") == 0);
    free(want);
    free(dir);
    CHECK(unsetenv("HF_HOME") == 0);
    CHECK(unsetenv("HOME") == 0);
    free(home);
    free(c_hub);
    free(c_legacy);
    free(c_home);
    free(c_xdg);
    free(c_def);
}

// Something on disk at the argument is a path, whatever it reads like.
static void test_path_wins(void)
{
    char *cwd = getcwd(NULL, 0);
    CHECK(cwd != NULL);
    CHECK(chdir(tmp) == 0);
    char *dir = subdir(".", "org/base");
    char *out = NULL;
    lm_err err = {0};
    CHECK_OK(lm_hf_resolve("org/base", &out, &err), &err);
    CHECK(out && strcmp(out, "org/base") == 0);
    free(out);
    // a file, and a directory named like a model with a revision
    write_text(".", "gpt2", "not a model");
    CHECK_OK(lm_hf_resolve("gpt2", &out, &err), &err);
    CHECK(out && strcmp(out, "gpt2") == 0);
    free(out);
    char *rev = subdir(".", "org/base@dev");
    CHECK_OK(lm_hf_resolve("org/base@dev", &out, &err), &err);
    CHECK(out && strcmp(out, "org/base@dev") == 0);
    free(out);
    // lm_input_detect then judges the path, not the cache's snapshot
    lm_input_kind kind;
    CHECK_FAILS(lm_input_detect("org/base", &kind, &out, &err), LM_ERR_NOT_FOUND,
                "org/base: not a model or adapter directory", &err);
    CHECK_FAILS(lm_input_detect("gpt2", &kind, &out, &err), LM_ERR_FORMAT, "gpt2: not a .safetensors file", &err);
    // a dangling symbolic link is a path too: missing, and nothing said of the cache
    CHECK(symlink("nowhere", "org/lora") == 0);
    CHECK_OK(lm_hf_resolve("org/lora", &out, &err), &err);
    CHECK(out && strcmp(out, "org/lora") == 0);
    free(out);
    CHECK_FAILS(lm_input_detect("org/lora", &kind, &out, &err), LM_ERR_NOT_FOUND,
                "org/lora: no such file or directory", &err);
    CHECK(!strstr(err.msg, "Hugging Face"));
    CHECK_OK(lm_rm_rf("org", &err), &err);
    CHECK_OK(lm_rm_rf("gpt2", &err), &err);
    // gone from disk, the same arguments name the cache's snapshots
    expect_snapshot("org/base", "models--org--base", HASH_A);
    expect_snapshot("org/base@dev", "models--org--base", HASH_B);
    expect_snapshot("org/lora", "models--org--lora", HASH_A);
    CHECK(chdir(cwd) == 0);
    free(rev);
    free(dir);
    free(cwd);
}

// lm_input_detect on Hub ids: the snapshot is the model or the adapter.
static void test_detect(void)
{
    lm_input_kind kind = 0;
    char *res = NULL;
    lm_err err = {0};
    CHECK_OK(lm_input_detect("org/base", &kind, &res, &err), &err);
    char *want = lm_strfmt("%s/models--org--base/snapshots/%s", hub, HASH_A);
    CHECK(kind == LM_INPUT_MODEL && res && strcmp(res, want) == 0);
    free(want);
    free(res);
    CHECK_OK(lm_input_detect("org/base@v1.0", &kind, &res, &err), &err);
    want = lm_strfmt("%s/models--org--base/snapshots/%s", hub, HASH_C);
    CHECK(kind == LM_INPUT_MODEL && res && strcmp(res, want) == 0);
    free(want);
    free(res);
    CHECK_OK(lm_input_detect("org/lora", &kind, &res, &err), &err);
    CHECK(kind == LM_INPUT_ADAPTER);
    free(res);
    CHECK_OK(lm_input_detect("gpt2", &kind, &res, &err), &err);
    CHECK(kind == LM_INPUT_MODEL);
    free(res);
    // the cache's errors come through as they are; a snapshot that is no model is named
    CHECK_FAILS(lm_input_detect("org/missing", &kind, &res, &err), LM_ERR_NOT_FOUND, "no models--org--missing",
                &err);
    CHECK(res == NULL);
    CHECK_FAILS(lm_input_detect("org/readme", &kind, &res, &err), LM_ERR_NOT_FOUND,
                "org/readme: ", &err);
    want = lm_strfmt("org/readme: %s/models--org--readme/snapshots/%s: not a model or adapter directory", hub,
                     HASH_A);
    CHECK_MSG(strncmp(err.msg, want, strlen(want)) == 0, "%s", err.msg);
    free(want);
    CHECK(res == NULL);
}

// The model card names an input given by its Hub id (not on disk) by that id, whatever revision.
static void test_card(void)
{
    char id[256];
    CHECK(lm_card_hub_id("org/base", id, sizeof id) && strcmp(id, "org/base") == 0);
    CHECK(lm_card_hub_id("org/base@v1.0", id, sizeof id) && strcmp(id, "org/base") == 0);
    CHECK(lm_card_hub_id("gpt2", id, sizeof id) && strcmp(id, "gpt2") == 0);
    CHECK(!lm_card_hub_id("org/missing", id, sizeof id));
    CHECK(!lm_card_hub_id("org/gone", id, sizeof id));
}

int main(void)
{
    tmp = make_tmpdir();
    layout();
    CHECK(unsetenv("HUGGINGFACE_HUB_CACHE") == 0 && unsetenv("HF_HOME") == 0 && unsetenv("XDG_CACHE_HOME") == 0);
    CHECK(setenv("HF_HUB_CACHE", hub, 1) == 0);
    test_forms();
    test_errors();
    test_path_wins();
    test_detect();
    test_card();
    test_env();  // last: it changes the environment
    free(hub);
    remove_tmpdir(tmp);
    return check_report("test_hfcache");
}
