// Models from the Hugging Face cache: see hfcache.h.
#include "hfcache.h"

#include <dirent.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>

#include "util.h"

#define HF_NAME_MAX 96      // the Hub's longest organisation or repository name
#define HF_HASH_MIN 7       // the fewest hex digits an abbreviated commit hash may have
#define HF_HASH_MAX 64      // a refs/ file's hash: git's SHA-1 (40) or SHA-256 (64)
#define HF_REF_MAX 4096     // a refs/ file longer than this holds no hash
#define HF_LIST_MAX 8       // names listed in a message

static lm_status nomem(lm_err *err)
{
    return lm_err_set(err, LM_ERR_NOMEM, "out of memory");
}

// ==== the cache directory =====================================================================

// The variable's value, NULL when unset or empty.
static const char *env(const char *name)
{
    const char *v = getenv(name);
    return v && *v ? v : NULL;
}

// A new string: `v` with a leading "~" (alone or before '/') replaced by $HOME, as Python's
// expanduser does for huggingface_hub; NULL when out of memory.
static char *expand_home(const char *v)
{
    const char *home = env("HOME");
    if (home && v[0] == '~' && (v[1] == '\0' || v[1] == '/'))
        return lm_strfmt("%s%s", home, v + 1);
    return lm_strdup(v);
}

lm_status lm_hf_cache_dir(char **dir, const char **from, lm_err *err)
{
    // huggingface_hub's order: HF_HUB_CACHE (HUGGINGFACE_HUB_CACHE before it was renamed), else
    // HF_HOME/hub, HF_HOME defaulting to $XDG_CACHE_HOME/huggingface, else ~/.cache/huggingface
    static const struct {
        const char *var, *sub, *from;
    } order[] = {
        {"HF_HUB_CACHE", NULL, "set by $HF_HUB_CACHE"},
        {"HUGGINGFACE_HUB_CACHE", NULL, "set by $HUGGINGFACE_HUB_CACHE"},
        {"HF_HOME", "hub", "$HF_HOME/hub"},
        {"XDG_CACHE_HOME", "huggingface/hub", "$XDG_CACHE_HOME/huggingface/hub"},
        {"HOME", ".cache/huggingface/hub", "the default, ~/.cache/huggingface/hub"},
    };
    *dir = NULL;
    for (size_t i = 0; i < sizeof order / sizeof order[0]; i++) {
        const char *v = env(order[i].var);
        if (!v)
            continue;
        char *base = expand_home(v);
        if (!base)
            return nomem(err);
        if (order[i].sub) {
            *dir = lm_path_join(base, order[i].sub);
            free(base);
        } else {
            *dir = base;
        }
        if (!*dir)
            return nomem(err);
        if (from)
            *from = order[i].from;
        return LM_OK;
    }
    return lm_err_set(err, LM_ERR_NOT_FOUND, "no Hugging Face cache to look in (HF_HUB_CACHE, HF_HOME, "
                      "XDG_CACHE_HOME and HOME are all unset)");
}

// ==== repository ids and revisions ============================================================

static bool is_word(char c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
}

static bool is_hex(const char *s, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (!((s[i] >= '0' && s[i] <= '9') || (s[i] >= 'a' && s[i] <= 'f') || (s[i] >= 'A' && s[i] <= 'F')))
            return false;
    return true;
}

// True when s[0..n) is an organisation or repository name the Hub allows: 1 to 96 letters,
// digits, '_', '-' and '.', beginning and ending with a letter, digit or '_', with no "--" or
// ".." (the cache's "--" separates the organisation from the name).
static bool hub_name(const char *s, size_t n)
{
    if (n == 0 || n > HF_NAME_MAX || !is_word(s[0]) || !is_word(s[n - 1]))
        return false;
    for (size_t i = 0; i < n; i++) {
        if (!is_word(s[i]) && s[i] != '-' && s[i] != '.')
            return false;
        if (i > 0 && (s[i] == '-' || s[i] == '.') && s[i - 1] == s[i])
            return false;
    }
    return true;
}

// True when `rev` can name a file under refs/ (a branch, a tag, or refs/pr/N): components
// separated by single '/', none empty, "." or "..", and no spaces, control characters or
// backslashes.
static bool revision_ok(const char *rev)
{
    if (!*rev)
        return false;
    for (const char *c = rev;; c++) {
        const char *end = strchr(c, '/');
        size_t n = end ? (size_t)(end - c) : strlen(c);
        if (n == 0 || (n == 1 && c[0] == '.') || (n == 2 && c[0] == '.' && c[1] == '.'))
            return false;
        for (size_t i = 0; i < n; i++)
            if ((unsigned char)c[i] <= ' ' || c[i] == 0x7f || c[i] == '\\')
                return false;
        if (!end)
            return true;
        c = end;
    }
}

// A repository id and revision: ORG/NAME, NAME, either with @REVISION.
typedef struct hf_id {
    char *repo;       // "ORG/NAME" or "NAME"
    char *entry;      // "models--ORG--NAME" or "models--NAME"
    const char *rev;  // what follows '@' in the argument, or NULL
} hf_id;

// Parses `arg` into *id (freed with id_free). Returns false when it is no repository id (with
// id->repo NULL) and when memory runs out (with *oom set).
static bool parse_id(const char *arg, hf_id *id, bool *oom)
{
    memset(id, 0, sizeof *id);
    *oom = false;
    const char *at = strchr(arg, '@');
    size_t n = at ? (size_t)(at - arg) : strlen(arg);
    if (at && !revision_ok(at + 1))
        return false;
    const char *slash = memchr(arg, '/', n);
    size_t org = slash ? (size_t)(slash - arg) : 0;
    if (slash ? !hub_name(arg, org) || !hub_name(slash + 1, n - org - 1) : !hub_name(arg, n))
        return false;
    id->repo = lm_strfmt("%.*s", (int)n, arg);
    id->entry = slash ? lm_strfmt("models--%.*s--%.*s", (int)org, arg, (int)(n - org - 1), slash + 1)
                      : lm_strfmt("models--%.*s", (int)n, arg);
    id->rev = at ? at + 1 : NULL;
    if (!id->repo || !id->entry) {
        *oom = true;
        return false;
    }
    return true;
}

static void id_free(hf_id *id)
{
    free(id->repo);
    free(id->entry);
}

// ==== the entry's refs and snapshots ==========================================================

static int cmp_names(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

static void names_free(char **names, int n)
{
    for (int i = 0; i < n; i++)
        free(names[i]);
    free(names);
}

// The visible entries of `dir` that are directories (want_dirs) or regular files, sorted, into
// *names (*n of them; names_free frees them). A missing directory has none.
static lm_status list_dir(const char *dir, bool want_dirs, char ***names, int *n, lm_err *err)
{
    *names = NULL;
    *n = 0;
    DIR *d = opendir(dir);
    if (!d)
        return LM_OK;
    int cap = 0;
    struct dirent *e;
    lm_status s = LM_OK;
    while ((e = readdir(d)) != NULL) {
        if (e->d_name[0] == '.')
            continue;
        char *p = lm_path_join(dir, e->d_name);
        if (!p) {
            s = nomem(err);
            break;
        }
        bool keep = want_dirs ? lm_is_dir(p) : lm_is_file(p);
        free(p);
        if (!keep)
            continue;
        if (*n == cap) {
            int c = cap ? 2 * cap : 8;
            char **g = realloc(*names, (size_t)c * sizeof *g);
            if (!g) {
                s = nomem(err);
                break;
            }
            *names = g;
            cap = c;
        }
        if (!((*names)[*n] = lm_strdup(e->d_name))) {
            s = nomem(err);
            break;
        }
        (*n)++;
    }
    closedir(d);
    if (s != LM_OK) {
        names_free(*names, *n);
        *names = NULL;
        *n = 0;
        return s;
    }
    if (*n > 1)
        qsort(*names, (size_t)*n, sizeof **names, cmp_names);
    return LM_OK;
}

// Writes "a, b, c" (each cut to `width` characters when width > 0; at most HF_LIST_MAX, then
// ", ...") or `none` into buf.
static void join_names(char *buf, size_t cap, char *const *names, int n, int width, const char *none)
{
    if (n == 0) {
        snprintf(buf, cap, "%s", none);
        return;
    }
    size_t len = 0;
    buf[0] = '\0';
    for (int i = 0; i < n && len < cap; i++) {
        int w = width > 0 ? width : (int)strlen(names[i]);
        int k = i == HF_LIST_MAX ? snprintf(buf + len, cap - len, ", ...")
                                 : snprintf(buf + len, cap - len, "%s%.*s", i ? ", " : "", w, names[i]);
        if (k < 0)
            break;
        len += (size_t)k;
        if (i == HF_LIST_MAX)
            break;
    }
}

// The commands that put `repo` (at `rev`, when not NULL) into the cache.
static void download_hint(char *buf, size_t cap, const char *repo, const char *rev)
{
    if (rev)
        snprintf(buf, cap, "`huggingface-cli download %s --revision %s` or `hf download %s --revision %s`", repo,
                 rev, repo, rev);
    else
        snprintf(buf, cap, "`huggingface-cli download %s` or `hf download %s`", repo, repo);
}

// Reads the commit hash the refs/ file `path` holds (surrounding whitespace allowed) into *hash
// (a new string).
static lm_status read_ref(const char *path, char **hash, lm_err *err)
{
    char *text = NULL;
    size_t len = 0;
    lm_status s = lm_read_file(path, HF_REF_MAX, &text, &len, err);
    if (s != LM_OK)
        return s;
    size_t b = 0;
    while (b < len && (text[b] == ' ' || text[b] == '\t' || text[b] == '\n' || text[b] == '\r'))
        b++;
    while (len > b && (text[len - 1] == ' ' || text[len - 1] == '\t' || text[len - 1] == '\n' ||
                       text[len - 1] == '\r'))
        len--;
    if (len - b < HF_HASH_MIN || len - b > HF_HASH_MAX || !is_hex(text + b, len - b)) {
        s = lm_err_set(err, LM_ERR_FORMAT, "%s: holds no commit hash (%zu bytes; a branch or tag's file "
                       "holds the hex hash of the commit it names)", path, len - b);
        free(text);
        return s;
    }
    *hash = lm_strfmt("%.*s", (int)(len - b), text + b);
    free(text);
    return *hash ? LM_OK : nomem(err);
}

// The snapshot whose commit starts with `prefix` (hex, HF_HASH_MIN digits or more) among the
// entry's snapshots: *hash (a new string) or NULL when none does; LM_ERR_USAGE when several do.
static lm_status find_snapshot(const char *shown, const char *entry, char *const *snaps, int n,
                               const char *prefix, char **hash, lm_err *err)
{
    *hash = NULL;
    size_t len = strlen(prefix);
    int found = -1, count = 0;
    for (int i = 0; i < n; i++)
        if (strlen(snaps[i]) >= len && strncasecmp(snaps[i], prefix, len) == 0 && count++ == 0)
            found = i;
    if (count > 1) {
        char list[512];
        char **match = calloc((size_t)count, sizeof *match);
        if (!match)
            return nomem(err);
        int m = 0;
        for (int i = 0; i < n; i++)
            if (strlen(snaps[i]) >= len && strncasecmp(snaps[i], prefix, len) == 0)
                match[m++] = snaps[i];
        join_names(list, sizeof list, match, m, 0, "");
        free(match);
        return lm_err_set(err, LM_ERR_USAGE, "%s: %s starts the commits of %d snapshots in the Hugging Face "
                          "cache's %s (%s): give more of the hash", shown, prefix, count, entry, list);
    }
    if (found < 0)
        return LM_OK;
    *hash = lm_strdup(snaps[found]);
    return *hash ? LM_OK : nomem(err);
}

// ==== resolving ===============================================================================

// The snapshot of `id` in the entry directory `entry` (under `cache`) into *out.
static lm_status resolve_in(const char *arg, const hf_id *id, const char *cache, const char *entry, char **out,
                            lm_err *err)
{
    const char *rev = id->rev ? id->rev : "main";
    char hint[640];
    download_hint(hint, sizeof hint, id->repo, id->rev);

    char *refs = lm_path_join(entry, "refs"), *snapdir = lm_path_join(entry, "snapshots");
    char *ref = refs ? lm_path_join(refs, rev) : NULL;
    char **snaps = NULL, **names = NULL, *hash = NULL;
    int n_snaps = 0, n_names = 0;
    lm_status s = LM_OK;
    if (!refs || !snapdir || !ref) {
        s = nomem(err);
        goto done;
    }
    if ((s = list_dir(snapdir, true, &snaps, &n_snaps, err)) != LM_OK)
        goto done;
    char list[512];
    if (lm_is_file(ref)) {
        // a branch or tag: the commit its file names must have a snapshot
        if ((s = read_ref(ref, &hash, err)) != LM_OK)
            goto done;
        char *snap = lm_path_join(snapdir, hash);
        if (!snap) {
            s = nomem(err);
            goto done;
        }
        if (!lm_is_dir(snap)) {
            free(snap);
            s = lm_err_set(err, LM_ERR_NOT_FOUND, "%s: %s names commit %s, but the Hugging Face cache has "
                           "no %s/snapshots/%s (a download interrupted or pruned); get it again with %s", arg, ref,
                           hash, id->entry, hash, hint);
            goto done;
        }
        *out = snap;
        goto done;
    }
    size_t rl = strlen(rev);
    bool hex = id->rev && rl >= HF_HASH_MIN && is_hex(rev, rl);
    if (hex) {
        // a commit hash, whole or abbreviated, names a snapshot directory
        if ((s = find_snapshot(arg, id->entry, snaps, n_snaps, rev, &hash, err)) != LM_OK)
            goto done;
        if (hash) {
            *out = lm_path_join(snapdir, hash);
            s = *out ? LM_OK : nomem(err);
            goto done;
        }
    }
    join_names(list, sizeof list, snaps, n_snaps, 12, "none");
    if (!id->rev) {
        s = lm_err_set(err, LM_ERR_NOT_FOUND, "%s: the Hugging Face cache's %s (in %s) has no refs/main to say "
                       "which snapshot is the model (snapshots: %s); name one as %s@COMMIT, or get main with %s",
                       arg, id->entry, cache, list, id->repo, hint);
        goto done;
    }
    if ((s = list_dir(refs, false, &names, &n_names, err)) != LM_OK)
        goto done;
    char branches[256];
    join_names(branches, sizeof branches, names, n_names, 0, "none");
    if (hex)
        s = lm_err_set(err, LM_ERR_NOT_FOUND, "%s: the Hugging Face cache's %s (in %s) has no revision %s: no "
                       "branch or tag refs/%s (it has: %s) and no snapshot whose commit starts with %s (snapshots: "
                       "%s); get it with %s", arg, id->entry, cache, rev, rev, branches, rev, list, hint);
    else
        s = lm_err_set(err, LM_ERR_NOT_FOUND, "%s: the Hugging Face cache's %s (in %s) has no revision %s: no "
                       "branch or tag refs/%s (it has: %s)%s; get it with %s", arg, id->entry, cache, rev, rev,
                       branches,
                       is_hex(rev, rl) ? ", and a commit hash needs at least 7 hex digits" : "", hint);
done:
    free(hash);
    names_free(snaps, n_snaps);
    names_free(names, n_names);
    free(ref);
    free(refs);
    free(snapdir);
    return s;
}

lm_status lm_hf_resolve(const char *arg, char **out, lm_err *err)
{
    *out = NULL;
    struct stat st;
    if (lstat(arg, &st) == 0) {
        *out = lm_strdup(arg);
        return *out ? LM_OK : nomem(err);
    }
    hf_id id;
    bool oom;
    if (!parse_id(arg, &id, &oom)) {
        id_free(&id);
        return oom ? nomem(err) : lm_err_set(err, LM_ERR_NOT_FOUND, "%s: no such file or directory", arg);
    }
    char *cache = NULL, *entry = NULL;
    const char *from = NULL;
    lm_status s = lm_hf_cache_dir(&cache, &from, err);
    if (s == LM_ERR_NOT_FOUND) {
        s = lm_err_set(err, s, "%s: no such file or directory, and no Hugging Face cache to look in (HF_HUB_CACHE, "
                       "HF_HOME, XDG_CACHE_HOME and HOME are all unset)", arg);
        goto done;
    }
    if (s != LM_OK)
        goto done;
    if (!(entry = lm_path_join(cache, id.entry))) {
        s = nomem(err);
        goto done;
    }
    if (!lm_is_dir(entry)) {
        char hint[640];
        download_hint(hint, sizeof hint, id.repo, id.rev);
        s = lm_err_set(err, LM_ERR_NOT_FOUND, "%s: no such file or directory, nor a model in the Hugging Face "
                       "cache: no %s in %s (%s); llmerge downloads nothing: get it with %s", arg, id.entry, cache,
                       from, hint);
        goto done;
    }
    s = resolve_in(arg, &id, cache, entry, out, err);
done:
    free(entry);
    free(cache);
    id_free(&id);
    return s;
}
