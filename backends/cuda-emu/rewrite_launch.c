// The build step that makes a CUDA source compilable by a host C++ compiler for the emulated
// device (backends/cuda-emu/): copies IN to OUT with each kernel launch
//
//     kernel<template args><<<grid, block, shmem, stream>>>(args...)
//
// rewritten into a call of the emulator's launcher,
//
//     lm_emu::launch_kernel("kernel<template args>", kernel<template args>, grid, block, shmem, stream, args...)
//
// (shmem and stream default to 0 as in CUDA), and each `extern __shared__ T name[];` into a
// pointer to the block's dynamic shared memory. Line breaks are kept, and OUT begins with a
// #line naming IN, so diagnostics point at the original file and line. Comments, string and
// character literals are copied untouched. Usage: rewrite_launch IN OUT [TAIL]: with TAIL, OUT
// ends with an #include of it (code of the emulator's that needs the file's private types).
// Exit status 1, with a message naming the file and line, on a launch it cannot parse.
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *path;
static const char *src;
static size_t len;

static int line_of(size_t at)
{
    int line = 1;
    for (size_t i = 0; i < at && i < len; i++)
        line += src[i] == '\n';
    return line;
}

static void die(size_t at, const char *what)
{
    fprintf(stderr, "%s:%d: rewrite_launch: %s\n", path, line_of(at), what);
    exit(1);
}

// The end of the comment or literal starting at i, or i when none starts there.
static size_t skip_lexical(size_t i)
{
    if (src[i] == '/' && i + 1 < len && src[i + 1] == '/') {
        while (i < len && src[i] != '\n')
            i++;
        return i;
    }
    if (src[i] == '/' && i + 1 < len && src[i + 1] == '*') {
        const char *e = strstr(src + i + 2, "*/");
        return e ? (size_t)(e - src) + 2 : len;
    }
    if (src[i] == '"' || src[i] == '\'') {
        char q = src[i++];
        while (i < len && src[i] != q) {
            if (src[i] == '\\')
                i++;
            i++;
        }
        return i + 1;
    }
    return i;
}

// The index just past the bracket matching the one at `open` (open is '(' or '<').
static size_t match(size_t open, char o, char c)
{
    int depth = 0;
    for (size_t i = open; i < len;) {
        size_t j = skip_lexical(i);
        if (j != i) {
            i = j;
            continue;
        }
        if (src[i] == o)
            depth++;
        else if (src[i] == c && --depth == 0)
            return i + 1;
        i++;
    }
    die(open, "unbalanced brackets");
    return len;
}

// Writes src[a, b) with every character but line breaks dropped.
static void keep_lines(FILE *out, size_t a, size_t b)
{
    for (size_t i = a; i < b; i++)
        if (src[i] == '\n')
            fputc('\n', out);
}

// How many top-level comma-separated items src[a, b) holds.
static int items(size_t a, size_t b)
{
    int n = 1, depth = 0;
    for (size_t i = a; i < b;) {
        size_t j = skip_lexical(i);
        if (j != i) {
            i = j;
            continue;
        }
        if (strchr("(<[{", src[i]))
            depth++;
        else if (strchr(")>]}", src[i]))
            depth--;
        else if (src[i] == ',' && depth == 0)
            n++;
        i++;
    }
    return n;
}

static int is_ident(char c)
{
    return isalnum((unsigned char)c) || c == '_' || c == ':';
}

int main(int argc, char **argv)
{
    if (argc != 3 && argc != 4) {
        fprintf(stderr, "usage: rewrite_launch IN OUT [TAIL]\n");
        return 2;
    }
    path = argv[1];
    FILE *in = fopen(argv[1], "rb");
    if (!in) {
        perror(argv[1]);
        return 1;
    }
    fseek(in, 0, SEEK_END);
    long size = ftell(in);
    fseek(in, 0, SEEK_SET);
    char *buf = malloc((size_t)size + 1);
    if (!buf || fread(buf, 1, (size_t)size, in) != (size_t)size) {
        fprintf(stderr, "%s: cannot read\n", argv[1]);
        return 1;
    }
    fclose(in);
    buf[size] = 0;
    src = buf;
    len = (size_t)size;
    FILE *out = fopen(argv[2], "wb");
    if (!out) {
        perror(argv[2]);
        return 1;
    }
    fprintf(out, "#line 1 \"%s\"\n", argv[1]);

    // Pass over the text, copying it; `done` is how much has been written.
    size_t done = 0;
    for (size_t i = 0; i < len;) {
        size_t j = skip_lexical(i);
        if (j != i) {
            i = j;
            continue;
        }
        static const char ext[] = "extern __shared__";
        if (strncmp(src + i, ext, sizeof ext - 1) == 0) {
            // extern __shared__ T name[];  ->  T *const name = (T *)lm_emu::dynamic_shared();
            size_t semi = i;
            while (semi < len && src[semi] != ';')
                semi++;
            size_t close = semi;
            while (close > i && src[close - 1] != ']')
                close--;
            if (close <= i || close < 2 || src[close - 2] != '[')
                die(i, "expected `extern __shared__ T name[];`");
            size_t name_end = close - 2, name_start = name_end;
            while (name_start > i && is_ident(src[name_start - 1]))
                name_start--;
            size_t type_start = i + sizeof ext - 1;
            fwrite(src + done, 1, i - done, out);
            fprintf(out, "%.*s *const %.*s = (%.*s *)lm_emu::dynamic_shared()", (int)(name_start - type_start),
                    src + type_start, (int)(name_end - name_start), src + name_start, (int)(name_start - type_start),
                    src + type_start);
            done = i = semi;
            continue;
        }
        if (strncmp(src + i, "<<<", 3) != 0) {
            i++;
            continue;
        }
        // The kernel: an identifier, with template arguments when a '>' ends it.
        size_t k_end = i;
        while (k_end > done && isspace((unsigned char)src[k_end - 1]))
            k_end--;
        size_t k_start = k_end;
        if (k_start > done && src[k_start - 1] == '>') {
            int depth = 0;
            do {
                k_start--;
                if (src[k_start] == '>')
                    depth++;
                else if (src[k_start] == '<')
                    depth--;
            } while (k_start > done && depth > 0);
        }
        while (k_start > done && is_ident(src[k_start - 1]))
            k_start--;
        if (k_start == k_end || !is_ident(src[k_start]))
            die(i, "a launch without a kernel name before <<<");
        const char *cfg_end = strstr(src + i + 3, ">>>");
        if (!cfg_end)
            die(i, "<<< without >>>");
        size_t c0 = i + 3, c1 = (size_t)(cfg_end - src);
        size_t p = c1 + 3;
        while (p < len && isspace((unsigned char)src[p]))
            p++;
        if (p >= len || src[p] != '(')
            die(i, "a launch without its argument list");
        size_t p_end = match(p, '(', ')');
        int n_cfg = items(c0, c1);
        if (n_cfg < 2 || n_cfg > 4)
            die(i, "a launch configuration of 2 to 4 items");
        int empty_args = 1;
        for (size_t q = p + 1; q + 1 < p_end; q++)
            if (!isspace((unsigned char)src[q]))
                empty_args = 0;

        fwrite(src + done, 1, k_start - done, out);
        fprintf(out, "lm_emu::launch_kernel(\"");
        for (size_t q = k_start; q < k_end; q++)
            if (src[q] != '\n')
                fputc(src[q], out);
        fprintf(out, "\", ");
        fwrite(src + k_start, 1, k_end - k_start, out);
        fputs(", ", out);
        keep_lines(out, k_end, c0);
        fwrite(src + c0, 1, c1 - c0, out);
        for (int extra = n_cfg; extra < 4; extra++)
            fputs(", 0", out);
        keep_lines(out, c1, p + 1);
        if (!empty_args)
            fputs(", ", out);
        fwrite(src + p + 1, 1, p_end - (p + 1), out);
        done = i = p_end;
    }
    fwrite(src + done, 1, len - done, out);
    if (argc == 4)
        fprintf(out, "\n#include \"%s\"\n", argv[3]);
    if (fclose(out) != 0) {
        perror(argv[2]);
        return 1;
    }
    free(buf);
    return 0;
}
