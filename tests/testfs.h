// Scratch files for the test programs: a fresh directory under /tmp per test, removed at the
// end, and small helpers to fill it. Inline so a program uses only what it needs.
#ifndef LM_TEST_TESTFS_H
#define LM_TEST_TESTFS_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "util.h"

// A new empty directory /tmp/llmerge-test-XXXXXX; the caller frees it with remove_tmpdir.
static inline char *make_tmpdir(void)
{
    char tmpl[] = "/tmp/llmerge-test-XXXXXX";
    char *d = mkdtemp(tmpl);
    if (!d) {
        perror("mkdtemp");
        exit(1);
    }
    return lm_strdup(d);
}

// Removes the directory and everything in it, and frees the path.
static inline void remove_tmpdir(char *dir)
{
    lm_err err;
    CHECK_OK(lm_rm_rf(dir, &err), &err);
    free(dir);
}

// Creates dir/name (and parents); returns the new path, which the caller frees.
static inline char *subdir(const char *dir, const char *name)
{
    char *p = lm_path_join(dir, name);
    lm_err err;
    CHECK_OK(lm_mkdir_p(p, &err), &err);
    return p;
}

// Writes `text` to dir/name.
static inline void write_text(const char *dir, const char *name, const char *text)
{
    char *p = lm_path_join(dir, name);
    lm_err err;
    CHECK_OK(lm_write_file(p, text, strlen(text), &err), &err);
    free(p);
}

#endif
