// Tests of the shared helpers: SIZE parsing, byte formatting, UTF-8 validation, the string
// map, paths and recursive removal.
#include "check.h"
#include "util.h"

#include <sys/stat.h>
#include <unistd.h>

static void test_sizes(void)
{
    lm_err err = {0};
    uint64_t v = 0;
    CHECK(lm_parse_size("5GB", &v, &err) == LM_OK && v == 5000000000ull);
    CHECK(lm_parse_size("512MiB", &v, &err) == LM_OK && v == 512ull << 20);
    CHECK(lm_parse_size("512M", &v, &err) == LM_OK && v == 512ull << 20);
    CHECK(lm_parse_size("10KB", &v, &err) == LM_OK && v == 10000);
    CHECK(lm_parse_size("3K", &v, &err) == LM_OK && v == 3072);
    CHECK(lm_parse_size("1234", &v, &err) == LM_OK && v == 1234);
    CHECK(lm_parse_size("1048576B", &v, &err) == LM_OK && v == 1048576);
    CHECK(lm_parse_size("2000000B", &v, &err) == LM_OK && v == 2000000);
    CHECK(lm_parse_size("1.5GiB", &v, &err) == LM_OK && v == 3ull << 29);
    CHECK(lm_parse_size("2T", &v, &err) == LM_OK && v == 2ull << 40);
    CHECK_FAILS(lm_parse_size("5XB", &v, &err), LM_ERR_USAGE, "5XB", &err);
    CHECK_FAILS(lm_parse_size("GB", &v, &err), LM_ERR_USAGE, "number", &err);
    CHECK_FAILS(lm_parse_size("", &v, &err), LM_ERR_USAGE, "empty", &err);
    CHECK_FAILS(lm_parse_size("99999999999999999999", &v, &err), LM_ERR_USAGE, "too large", &err);
    CHECK_FAILS(lm_parse_size("20000000000GB", &v, &err), LM_ERR_USAGE, "too large", &err);
    CHECK_FAILS(lm_parse_size("1.5", &v, &err), LM_ERR_USAGE, "fraction", &err);
    // A bare B under 1 MiB is mergekit's count of parameters ("1B": a billion), not bytes: refused
    // with what llmerge's units are and the bytes that many bf16 parameters take.
    v = 7;
    CHECK_FAILS(lm_parse_size("1B", &v, &err), LM_ERR_USAGE, "billion parameters", &err);
    CHECK_MSG(strstr(err.msg, "'1B'") && strstr(err.msg, "2GB") && strstr(err.msg, "powers of 1024") && v == 7,
              "%s", err.msg);
    CHECK_FAILS(lm_parse_size("5B", &v, &err), LM_ERR_USAGE, "10GB", &err);
    CHECK_FAILS(lm_parse_size("1.5B", &v, &err), LM_ERR_USAGE, "3GB", &err);
    CHECK_FAILS(lm_parse_size("1234B", &v, &err), LM_ERR_USAGE, "1234 without B", &err);
    CHECK_FAILS(lm_parse_size("900000B", &v, &err), LM_ERR_USAGE, "1800000GB in bf16", &err);
    CHECK_FAILS(lm_parse_size("1048575B", &v, &err), LM_ERR_USAGE, "billion", &err);
    CHECK(v == 7);
    char buf[32];
    CHECK(strcmp(lm_format_bytes(buf, sizeof buf, 512), "512 B") == 0);
    CHECK(strcmp(lm_format_bytes(buf, sizeof buf, 3ull << 29), "1.50 GiB") == 0);
}

static void test_utf8(void)
{
    CHECK(lm_utf8_valid("plain", 5));
    CHECK(lm_utf8_valid("caf\xc3\xa9 \xf0\x9f\x98\x80", 10));
    CHECK(!lm_utf8_valid("\xff", 1));
    CHECK(!lm_utf8_valid("\xc0\xaf", 2));          // overlong '/'
    CHECK(!lm_utf8_valid("\xed\xa0\x80", 3));      // surrogate
    CHECK(!lm_utf8_valid("\xf4\x90\x80\x80", 4));  // above U+10FFFF
    CHECK(!lm_utf8_valid("\xe2\x82", 2));          // truncated
}

static void test_strmap(void)
{
    lm_strmap m = {0};
    char keys[1000][16];
    for (int i = 0; i < 1000; i++) {
        snprintf(keys[i], sizeof keys[i], "key.%d", i);
        CHECK(lm_strmap_put(&m, keys[i], i) == 1);
    }
    CHECK(m.count == 1000);
    CHECK(lm_strmap_put(&m, "key.7", 99) == 0 && lm_strmap_get(&m, "key.7") == 7);
    int wrong = 0;
    for (int i = 0; i < 1000; i++)
        wrong += lm_strmap_get(&m, keys[i]) != i;
    CHECK(wrong == 0);
    CHECK(lm_strmap_get(&m, "key.1000") == -1);
    lm_strmap_free(&m);
    CHECK(lm_strmap_get(&m, "key.1") == -1);
}

static void test_paths(void)
{
    char *p = lm_path_join("a/b", "c.json");
    CHECK(p && strcmp(p, "a/b/c.json") == 0);
    free(p);
    p = lm_path_join("a/", "c");
    CHECK(p && strcmp(p, "a/c") == 0);
    free(p);
    p = lm_path_join("a", "/abs");
    CHECK(p && strcmp(p, "/abs") == 0);
    free(p);
    CHECK(strcmp(lm_path_base("x/y/z.bin"), "z.bin") == 0);
    const char *parents[][2] = {{"a/b/c", "a/b"}, {"a/b/c/", "a/b"}, {"c", "."}, {"/c", "/"}, {"/", "/"},
                                {"/a/b", "/a"}, {"a//", "."}};
    for (size_t i = 0; i < sizeof parents / sizeof parents[0]; i++) {
        p = lm_path_parent(parents[i][0]);
        CHECK_MSG(p && strcmp(p, parents[i][1]) == 0, "parent of %s: %s, wanted %s", parents[i][0], p ? p : "NULL",
                  parents[i][1]);
        free(p);
    }

    char dir[] = "/tmp/lm_test_util_XXXXXX";
    CHECK(mkdtemp(dir) != NULL);
    lm_err err = {0};
    char *deep = lm_strfmt("%s/one/two/three", dir);
    CHECK_OK(lm_mkdir_p(deep, &err), &err);
    CHECK(lm_is_dir(deep));
    char *file = lm_strfmt("%s/one/two/f.txt", dir);
    CHECK_OK(lm_write_file(file, "hello", 5, &err), &err);
    char *copy = lm_strfmt("%s/one/g.txt", dir);
    CHECK_OK(lm_copy_file(file, copy, &err), &err);
    char *text = NULL;
    size_t len = 0;
    CHECK_OK(lm_read_file(copy, 100, &text, &len, &err), &err);
    CHECK(text && len == 5 && strcmp(text, "hello") == 0);
    free(text);
    CHECK_FAILS(lm_read_file(copy, 3, &text, &len, &err), LM_ERR_FORMAT, "g.txt", &err);
    uint64_t h1 = 0;
    CHECK_OK(lm_xxh64_file(copy, &h1, &err), &err);
    CHECK(h1 == lm_xxh64("hello", 5));
    char *link = lm_strfmt("%s/one/link", dir);
    CHECK(symlink("/tmp", link) == 0);  // must be removed, not followed
    CHECK_OK(lm_rm_rf(dir, &err), &err);
    CHECK(!lm_is_dir(dir) && lm_is_dir("/tmp"));
    CHECK_OK(lm_rm_rf(dir, &err), &err);  // missing is fine
    CHECK_FAILS(lm_read_file(file, 100, &text, &len, &err), LM_ERR_NOT_FOUND, "f.txt", &err);
    free(deep);
    free(file);
    free(copy);
    free(link);
}

static void test_status(void)
{
    lm_err err = {0};
    CHECK(lm_err_set(&err, LM_ERR_IO, "disk %d", 7) == LM_ERR_IO && strcmp(err.msg, "disk 7") == 0);
    CHECK(lm_err_prefix(&err, "file %s", "x") == LM_ERR_IO && strcmp(err.msg, "file x: disk 7") == 0);
    CHECK(lm_status_exit_code(LM_ERR_FORMAT) == 2 && lm_status_exit_code(LM_ERR_IO) == 1 &&
          lm_status_exit_code(LM_OK) == 0 && lm_status_exit_code(LM_ERR_DEVICE_OOM) == 1);
    CHECK(strcmp(lm_status_name(LM_ERR_DEVICE_OOM), "DEVICE_OOM") == 0);
    CHECK(lm_err_set(NULL, LM_ERR_NOMEM, "x") == LM_ERR_NOMEM);
}

int main(void)
{
    test_sizes();
    test_utf8();
    test_strmap();
    test_paths();
    test_status();
    return check_report("test_util");
}
