// Tests of the cache of Hessians, U_cc² and masks (lib/cache.c) and of stored masks where they
// are used: the device's mask operations and the merge engine's mask_load / mask_store.
//
// Keys: the same inputs give the same key; each input changed alone (a byte of a model, adapter
// or calibration file, the caps, the damping, the density, the top-k mode, the base, the FT)
// gives another, and the Hessians' key ignores the damping. Entries: a round trip; no entry is
// a miss; every single-byte change, every truncation and a byte appended is found as damage and
// the file removed, also for a file renamed to another key; a damaged entry's removal spares a
// sound one put at its path since; a writer leaves nothing at the entry's path until it
// commits, and nothing at all when it gives up; temporary files of dead processes not written
// to for an hour are removed, and no others.
// The device's mask operations against a reference on the CPU (1 and 3 threads), the simulated
// device and the dispatcher's default, at unaligned offsets. The engine: masks recorded by one
// merge and given to the next give the same bytes (ties and sparsegpt, --topk tensor and
// global, the CPU and the simulated device with and without room, small slabs), with no U_cc²
// asked for; a mask that keeps nothing gives the merge without that FT.
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cache.h"
#include "check.h"
#include "device.h"
#include "device_registry.h"
#include "fixture.h"
#include "device_impl.h"  // a device lacking the mask operations, built by hand
#include "merge.h"
#include "model.h"
#include "testfs.h"
#include "util.h"

static uint64_t rng_s = 0x1234;

static uint64_t rng_u64(void)
{
    rng_s += 0x9E3779B97F4A7C15ull;
    uint64_t z = rng_s;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// Copies every file of directory src into a new directory dst.
static void copy_dir(const char *src, const char *dst)
{
    lm_err err = {0};
    CHECK_OK(lm_mkdir_p(dst, &err), &err);
    DIR *d = opendir(src);
    CHECK(d != NULL);
    struct dirent *de;
    while (d && (de = readdir(d)) != NULL) {
        if (de->d_name[0] == '.')
            continue;
        char *a = lm_path_join(src, de->d_name), *b = lm_path_join(dst, de->d_name);
        if (lm_is_file(a))
            CHECK_OK(lm_copy_file(a, b, &err), &err);
        free(a);
        free(b);
    }
    if (d)
        closedir(d);
}

// Flips byte `pos` of the file (xor mask), or appends `mask` when pos is the file's size.
static void poke(const char *path, long pos, unsigned char mask)
{
    FILE *f = fopen(path, "r+b");
    CHECK(f != NULL);
    if (!f)
        return;
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    int c = 0;
    if (pos < size) {
        fseek(f, pos, SEEK_SET);
        c = fgetc(f);
        fseek(f, pos, SEEK_SET);
    }
    fputc(pos < size ? (c ^ mask) : mask, f);
    fclose(f);
}

static long file_size(const char *path)
{
    struct stat st;
    return stat(path, &st) == 0 ? (long)st.st_size : -1;
}

// How many entries of dir have a name containing `part`.
static int count_files(const char *dir, const char *part)
{
    int n = 0;
    DIR *d = opendir(dir);
    struct dirent *de;
    while (d && (de = readdir(d)) != NULL)
        n += strstr(de->d_name, part) != NULL;
    if (d)
        closedir(d);
    return n;
}

// ==== keys ====================================================================================

static void test_digests(void)
{
    lm_err err = {0};
    char *tmp = make_tmpdir();
    char *src = fx("base"), *a = lm_path_join(tmp, "a"), *b = lm_path_join(tmp, "b");
    copy_dir(src, a);
    copy_dir(src, b);
    lm_model *ma = NULL, *mb = NULL;
    uint64_t da = 1, db = 2, d2 = 3;
    CHECK_OK(lm_model_open(&ma, a, &err), &err);
    CHECK_OK(lm_model_open(&mb, b, &err), &err);
    if (ma && mb) {
        // the same bytes elsewhere are the same input
        CHECK_OK(lm_cache_digest_model(ma, &da, &err), &err);
        CHECK_OK(lm_cache_digest_model(mb, &db, &err), &err);
        CHECK(da == db);
        // one byte of a shard's data, then of config.json: another input
        const char *shard = mb->shards[mb->n_shards - 1].path;
        poke(shard, file_size(shard) - 3, 0x01);
        CHECK_OK(lm_cache_digest_model(mb, &d2, &err), &err);
        CHECK(d2 != da);
        poke(shard, file_size(shard) - 3, 0x01);
        CHECK_OK(lm_cache_digest_model(mb, &d2, &err), &err);
        CHECK(d2 == da);
        char *cfg = lm_path_join(b, "config.json");
        poke(cfg, file_size(cfg), '\n');
        CHECK_OK(lm_cache_digest_model(mb, &d2, &err), &err);
        CHECK(d2 != da);
        free(cfg);
    }
    lm_model_free(ma);
    lm_model_free(mb);

    // an adapter's weights
    char *lsrc = fx("lora_plain"), *la = lm_path_join(tmp, "la");
    copy_dir(lsrc, la);
    lm_adapter *ad = NULL;
    CHECK_OK(lm_adapter_open(&ad, la, &err), &err);
    if (ad) {
        CHECK_OK(lm_cache_digest_adapter(ad, &da, &err), &err);
        poke(ad->weights_path, file_size(ad->weights_path) - 1, 0x40);
        CHECK_OK(lm_cache_digest_adapter(ad, &db, &err), &err);
        CHECK(da != db);
        lm_adapter_free(ad);
    }
    // a calibration file; a missing one names the path
    char *cal = lm_path_join(tmp, "c.txt");
    write_text(tmp, "c.txt", "1 2 3\n4 5 6\n");
    CHECK_OK(lm_cache_digest_file(cal, &da, &err), &err);
    write_text(tmp, "c.txt", "1 2 3\n4 5 7\n");
    CHECK_OK(lm_cache_digest_file(cal, &db, &err), &err);
    CHECK(da != db);
    char *none = lm_path_join(tmp, "none.txt");
    CHECK(lm_cache_digest_file(none, &da, &err) != LM_OK && strstr(err.msg, "none.txt"));
    free(none);
    free(cal);
    free(la);
    free(lsrc);
    free(src);
    free(a);
    free(b);
    remove_tmpdir(tmp);
}

static void test_keys(void)
{
    lm_cache_hess_src h = {.model = 11, .has_adapter = true, .adapter = 22, .calib = 33, .max_samples = 8, .max_len = 64};
    uint64_t kh = lm_cache_key_hess(&h), ku = lm_cache_key_ucc2(&h, 0.01);
    CHECK(kh == lm_cache_key_hess(&h) && ku == lm_cache_key_ucc2(&h, 0.01));
    CHECK(kh != ku);
    // the damping: another U_cc², the same Hessians
    CHECK(lm_cache_key_ucc2(&h, 0.1) != ku);
    CHECK(lm_cache_key_hess(&h) == kh);
    // every input of the Hessians changes both keys
    for (int f = 0; f < 6; f++) {
        lm_cache_hess_src c = h;
        switch (f) {
        case 0: c.model++; break;
        case 1: c.has_adapter = false; break;
        case 2: c.adapter++; break;
        case 3: c.calib++; break;
        case 4: c.max_samples = 0; break;
        case 5: c.max_len = 63; break;
        }
        CHECK_MSG(lm_cache_key_hess(&c) != kh, "input %d does not change the Hessians' key", f);
        CHECK_MSG(lm_cache_key_ucc2(&c, 0.01) != ku, "input %d does not change the U_cc² key", f);
    }
    // samples and length are not interchangeable
    lm_cache_hess_src sw = h;
    sw.max_samples = h.max_len;
    sw.max_len = h.max_samples;
    CHECK(lm_cache_key_hess(&sw) != kh);
    lm_cache_mask_src m = {.ucc2_key = ku, .base = 44, .ft = 55, .density = 0.2, .topk_global = false};
    uint64_t km = lm_cache_key_mask(&m);
    CHECK(km == lm_cache_key_mask(&m) && km != ku && km != kh);
    for (int f = 0; f < 5; f++) {
        lm_cache_mask_src c = m;
        switch (f) {
        case 0: c.ucc2_key = lm_cache_key_ucc2(&h, 0.1); break;  // the damping reaches the masks
        case 1: c.base++; break;
        case 2: c.ft++; break;
        case 3: c.density = 0.5; break;
        case 4: c.topk_global = true; break;
        }
        CHECK_MSG(lm_cache_key_mask(&c) != km, "input %d does not change the mask key", f);
    }
    char *p = lm_cache_entry_path("/c", LM_CACHE_MASK, 0xabcULL);
    CHECK(p && strcmp(p, "/c/mask-0000000000000abc.bin") == 0);
    free(p);
}

// ==== entries =================================================================================

// Three records: two of floats and an empty one.
static float rec_a[5] = {1, 2, 3, 4, 5}, rec_b[3] = {-1, 0.5f, 7};

static void write_three(const char *dir, lm_cache_kind kind, uint64_t key)
{
    lm_err err = {0};
    lm_cache_entry *e = NULL;
    CHECK_OK(lm_cache_create(&e, dir, kind, key, 155, &err), &err);
    if (!e)
        return;
    CHECK_OK(lm_cache_put(e, "a", 5, rec_a, sizeof rec_a, &err), &err);
    CHECK_OK(lm_cache_put(e, "empty", 0, NULL, 0, &err), &err);
    CHECK_OK(lm_cache_put(e, "model.layers.0.mlp.down_proj", 3, rec_b, sizeof rec_b, &err), &err);
    CHECK_OK(lm_cache_commit(e, &err), &err);
}

// Reads the three records back: LM_OK when all are there and sound; else the failing status
// (the damage said in err).
static lm_status read_three(const char *dir, lm_cache_kind kind, uint64_t key, bool *found, lm_err *err)
{
    lm_cache_entry *e = NULL;
    int64_t meta = 0;
    char why[LM_ERR_MSG_MAX] = "";
    *found = false;
    lm_status s = lm_cache_open(&e, dir, kind, key, &meta, why, sizeof why, err);
    if (s != LM_OK)
        return s;
    if (!e)
        return why[0] ? lm_err_set(err, LM_ERR_FORMAT, "%s", why) : LM_OK;
    *found = true;
    char name[64];
    int64_t n;
    size_t bytes;
    bool end;
    float buf[8];
    const char *names[3] = {"a", "empty", "model.layers.0.mlp.down_proj"};
    const size_t sizes[3] = {sizeof rec_a, 0, sizeof rec_b};
    for (int i = 0; s == LM_OK && i < 3; i++) {
        if ((s = lm_cache_next(e, name, sizeof name, &n, &bytes, &end, err)) != LM_OK)
            break;
        if (end || strcmp(name, names[i]) != 0 || bytes != sizes[i] || bytes > sizeof buf) {
            s = lm_cache_reject(e, "not the records written", err);
            break;
        }
        s = lm_cache_read(e, buf, err);
        if (s == LM_OK && memcmp(buf, i == 0 ? rec_a : rec_b, bytes) != 0)
            s = lm_cache_reject(e, "other values", err);
    }
    if (s == LM_OK && (s = lm_cache_next(e, name, sizeof name, &n, &bytes, &end, err)) == LM_OK && !end)
        s = lm_cache_reject(e, "a fourth record", err);
    if (s == LM_OK && meta != 155)
        s = lm_cache_reject(e, "another meta", err);
    lm_cache_close(e);
    return s;
}

static void test_entry_round_trip(void)
{
    lm_err err = {0};
    char *dir = make_tmpdir();
    char *sub = lm_path_join(dir, "made/here");  // created as needed
    // while written: nothing at the entry's path, one temporary file beside it
    lm_cache_entry *e = NULL;
    CHECK_OK(lm_cache_create(&e, sub, LM_CACHE_UCC2, 7, 0, &err), &err);
    char *path = lm_cache_entry_path(sub, LM_CACHE_UCC2, 7);
    CHECK(!lm_is_file(path) && count_files(sub, ".tmp-") == 1);
    if (e)
        CHECK_OK(lm_cache_put(e, "x", 1, rec_a, 4, &err), &err);
    lm_cache_close(e);  // given up: nothing left
    CHECK(!lm_is_file(path) && count_files(sub, ".tmp-") == 0);

    write_three(sub, LM_CACHE_UCC2, 7);
    CHECK(lm_is_file(path) && count_files(sub, ".tmp-") == 0);
    bool found = false;
    CHECK_OK(read_three(sub, LM_CACHE_UCC2, 7, &found, &err), &err);
    CHECK(found && lm_is_file(path));
    // another key or kind: a miss, nothing said
    CHECK_OK(read_three(sub, LM_CACHE_UCC2, 8, &found, &err), &err);
    CHECK(!found);
    CHECK_OK(read_three(sub, LM_CACHE_MASK, 7, &found, &err), &err);
    CHECK(!found);
    // a file renamed to another key is refused, and removed
    char *other = lm_cache_entry_path(sub, LM_CACHE_UCC2, 9);
    CHECK(rename(path, other) == 0);
    CHECK(read_three(sub, LM_CACHE_UCC2, 9, &found, &err) == LM_ERR_FORMAT && strstr(err.msg, "another entry"));
    CHECK(!lm_is_file(other));
    // a name longer than the cap is refused when written
    CHECK_OK(lm_cache_create(&e, sub, LM_CACHE_UCC2, 10, 0, &err), &err);
    char longname[LM_CACHE_NAME_MAX + 2];
    memset(longname, 'n', sizeof longname - 1);
    longname[sizeof longname - 1] = '\0';
    if (e)
        CHECK_FAILS(lm_cache_put(e, longname, 0, NULL, 0, &err), LM_ERR_USAGE, "record name", &err);
    lm_cache_close(e);
    // a directory that cannot be made: the error names it
    write_text(dir, "file", "x");
    char *bad = lm_path_join(dir, "file/cache");
    CHECK(lm_cache_create(&e, bad, LM_CACHE_HESS, 1, 0, &err) != LM_OK && strstr(err.msg, "file") && !e);
    free(bad);
    free(other);
    free(path);
    free(sub);
    remove_tmpdir(dir);
}

// Every single-byte change, every truncation and an appended byte is damage; each damaged
// entry is removed once read.
static void test_entry_damage(void)
{
    lm_err err = {0};
    char *dir = make_tmpdir();
    char *path = lm_cache_entry_path(dir, LM_CACHE_HESS, 42);
    write_three(dir, LM_CACHE_HESS, 42);
    long size = file_size(path);
    CHECK(size > 100);
    char *good = NULL;
    size_t len = 0;
    CHECK_OK(lm_read_file(path, 1 << 20, &good, &len, &err), &err);
    int missed = 0, kept = 0;
    for (long pos = 0; good && pos <= size; pos++) {
        CHECK_OK(lm_write_file(path, good, len, &err), &err);
        poke(path, pos, (unsigned char)(1u << (pos % 8)));
        bool found;
        lm_status s = read_three(dir, LM_CACHE_HESS, 42, &found, &err);
        missed += s != LM_ERR_FORMAT;
        kept += lm_is_file(path);
    }
    CHECK_MSG(missed == 0, "%d of %ld changed bytes were not found", missed, size + 1);
    CHECK_MSG(kept == 0, "%d damaged entries were left", kept);
    for (long cut = 0; good && cut < size; cut++) {
        CHECK_OK(lm_write_file(path, good, (size_t)cut, &err), &err);
        bool found;
        lm_status s = read_three(dir, LM_CACHE_HESS, 42, &found, &err);
        missed += s != LM_ERR_FORMAT;
        kept += lm_is_file(path);
    }
    CHECK_MSG(missed == 0, "%d truncations were not found", missed);
    CHECK_MSG(kept == 0, "%d truncated entries were left", kept);
    free(good);
    free(path);
    remove_tmpdir(dir);
}

// A damaged entry is removed only when its path still names the file read: a sound entry
// another run has put there since stays.
static void test_damage_spares_new(void)
{
    lm_err err = {0};
    char *dir = make_tmpdir();
    write_three(dir, LM_CACHE_UCC2, 5);
    lm_cache_entry *e = NULL;
    int64_t meta;
    CHECK_OK(lm_cache_open(&e, dir, LM_CACHE_UCC2, 5, &meta, NULL, 0, &err), &err);
    write_three(dir, LM_CACHE_UCC2, 5);  // renamed over the one open
    if (e) {
        CHECK(lm_cache_reject(e, "test", &err) == LM_ERR_FORMAT && strstr(err.msg, "test"));
        lm_cache_close(e);
    }
    bool found = false;
    CHECK_OK(read_three(dir, LM_CACHE_UCC2, 5, &found, &err), &err);
    CHECK(found);
    remove_tmpdir(dir);
}

// A writer removes the temporary files of processes that no longer exist, and only those.
static void test_orphans(void)
{
    lm_err err = {0};
    char *dir = make_tmpdir();
    pid_t child = fork();
    if (child == 0)
        _exit(0);
    waitpid(child, NULL, 0);
    char dead[96], fresh[96], alive[96];
    snprintf(dead, sizeof dead, ".hess-0000000000000001.bin.tmp-%ld-0", (long)child);
    snprintf(fresh, sizeof fresh, ".hess-0000000000000001.bin.tmp-%ld-1", (long)child);
    snprintf(alive, sizeof alive, ".hess-0000000000000001.bin.tmp-%ld-0", (long)getppid());
    write_text(dir, dead, "partial");
    write_text(dir, fresh, "partial");
    write_text(dir, alive, "partial");
    write_text(dir, "unrelated.tmp-1-0", "x");
    // last written two hours ago: the dead process's, and the live one's
    struct timespec old[2] = {{time(NULL) - 7200, 0}, {time(NULL) - 7200, 0}};
    char *p_dead = lm_path_join(dir, dead), *p_alive = lm_path_join(dir, alive);
    CHECK(utimensat(AT_FDCWD, p_dead, old, 0) == 0 && utimensat(AT_FDCWD, p_alive, old, 0) == 0);
    lm_cache_entry *e = NULL;
    CHECK_OK(lm_cache_create(&e, dir, LM_CACHE_HESS, 2, 0, &err), &err);
    lm_cache_close(e);
    CHECK(count_files(dir, dead) == 0);    // gone: its process is, and it is old
    CHECK(count_files(dir, fresh) == 1);   // written lately: perhaps another machine's writer
    CHECK(count_files(dir, alive) == 1);
    CHECK(count_files(dir, "unrelated") == 1);
    free(p_dead);
    free(p_alive);
    remove_tmpdir(dir);
}

static void test_ucc2_sets(void)
{
    lm_err err = {0};
    char *dir = make_tmpdir();
    double a0[3] = {1, 2, 3}, a1[1] = {0.25}, a2[2] = {-1, 4};
    double *arrs[3] = {a0, a1, a2};
    int64_t dims[3] = {3, 1, 2}, wrong[3] = {3, 2, 2};
    const char *names[3] = {"l0", "l1", "l2"};
    CHECK_OK(lm_cache_store_ucc2(dir, 77, arrs, 3, dims, names, &err), &err);
    double **got = NULL;
    bool hit = false;
    char why[LM_ERR_MSG_MAX];
    CHECK_OK(lm_cache_load_ucc2(dir, 77, 3, dims, &got, &hit, why, sizeof why, &err), &err);
    CHECK(hit && got && got[0][2] == 3 && got[1][0] == 0.25 && got[2][1] == 4);
    for (int i = 0; got && i < 3; i++)
        free(got[i]);
    free(got);
    // another model's shapes: not a hit, said, removed
    CHECK_OK(lm_cache_load_ucc2(dir, 77, 3, wrong, &got, &hit, why, sizeof why, &err), &err);
    CHECK(!hit && !got && strstr(why, "do not fit"));
    char *path = lm_cache_entry_path(dir, LM_CACHE_UCC2, 77);
    CHECK(!lm_is_file(path));
    // fewer arrays than the entry holds
    CHECK_OK(lm_cache_store_ucc2(dir, 77, arrs, 3, dims, names, &err), &err);
    CHECK_OK(lm_cache_load_ucc2(dir, 77, 2, dims, &got, &hit, why, sizeof why, &err), &err);
    CHECK(!hit && strstr(why, "more records"));
    // none at all: a miss with nothing to say
    CHECK_OK(lm_cache_load_ucc2(dir, 78, 3, dims, &got, &hit, why, sizeof why, &err), &err);
    CHECK(!hit && why[0] == '\0');
    free(path);
    remove_tmpdir(dir);
}

static void test_mask_sets(void)
{
    lm_err err = {0};
    char *dir = make_tmpdir();
    uint8_t m1[2] = {0x5A, 0x01}, m2[1] = {0xFF};
    lm_cache_entry *e = NULL;
    CHECK_OK(lm_cache_create(&e, dir, LM_CACHE_MASK, 3, 0, &err), &err);
    if (e) {
        CHECK_OK(lm_cache_put(e, "w.weight", 9, m1, 2, &err), &err);
        CHECK_OK(lm_cache_put(e, "b.bias", 8, m2, 1, &err), &err);
        CHECK_OK(lm_cache_commit(e, &err), &err);
    }
    lm_cache_masks m;
    bool hit = false;
    char why[LM_ERR_MSG_MAX];
    CHECK_OK(lm_cache_load_masks(dir, 3, &m, &hit, why, sizeof why, &err), &err);
    CHECK(hit && m.n == 2);
    const uint8_t *w = lm_cache_masks_find(&m, "w.weight", 9);
    CHECK(w && w[0] == 0x5A && w[1] == 0x01);
    CHECK(lm_cache_masks_find(&m, "w.weight", 10) == NULL);  // another shape
    CHECK(lm_cache_masks_find(&m, "nothing", 9) == NULL);
    lm_cache_masks_free(&m);
    lm_cache_masks_free(&m);  // twice is safe
    // a record whose size is not its element count's, and a tensor given twice: damage
    for (int bad = 0; bad < 2; bad++) {
        CHECK_OK(lm_cache_create(&e, dir, LM_CACHE_MASK, 4, 0, &err), &err);
        if (e) {
            CHECK_OK(lm_cache_put(e, "w.weight", 9, m1, bad ? 2 : 1, &err), &err);
            CHECK_OK(lm_cache_put(e, bad ? "w.weight" : "x", 8, m2, 1, &err), &err);
            CHECK_OK(lm_cache_commit(e, &err), &err);
        }
        CHECK_OK(lm_cache_load_masks(dir, 4, &m, &hit, why, sizeof why, &err), &err);
        CHECK_MSG(!hit && m.n == 0 && strstr(why, bad ? "twice" : "size"), "case %d: %s", bad, why);
    }
    remove_tmpdir(dir);
}

// ==== the device's mask operations ============================================================

// A device whose interface lacks the mask operations: the dispatcher's default runs.
typedef struct bare_dev {
    lm_dev dev;
    lm_dev_i iface;
} bare_dev;

static lm_dev *without_masks(bare_dev *b, lm_dev *d)
{
    b->iface = *d->iface;
    b->iface.mask_get = NULL;
    b->iface.mask_apply = NULL;
    b->dev = *d;
    b->dev.iface = &b->iface;
    return &b->dev;
}

static void check_mask_ops(lm_dev *d, const char *label)
{
    lm_err err = {0};
    const int64_t n = 200003;
    float *x = malloc((size_t)n * sizeof *x), *y = malloc((size_t)n * sizeof *y);
    size_t nb = (size_t)(n + 64) / 8 + 2;
    uint8_t *bits = malloc(nb), *keep = malloc(nb);
    void *xd = NULL;
    CHECK_OK(lm_dev_alloc(d, (size_t)n * sizeof *x, &xd, &err), &err);
    for (int64_t j = 0; j < n; j++) {
        uint64_t r = rng_u64();
        x[j] = r % 3 == 0 ? 0.0f : r % 17 == 1 ? -0.0f : r % 101 == 2 ? NAN : (float)((double)(r >> 11) / 9e15 - 0.5);
    }
    for (size_t i = 0; i < nb; i++)
        keep[i] = (uint8_t)rng_u64();
    const int64_t firsts[4] = {0, 3, 8, 61};
    for (int f = 0; xd && f < 4; f++) {
        int64_t first = firsts[f];
        memset(bits, 0xA5, nb);
        CHECK_OK(lm_dev_upload(d, xd, x, (size_t)n * sizeof *x, &err), &err);
        CHECK_OK(lm_dev_mask_get(d, bits, first, xd, n, &err), &err);
        int64_t wrong = 0;
        for (int64_t b = 0; b < (int64_t)nb * 8; b++) {
            int got = bits[b >> 3] >> (b & 7) & 1;
            int want = b >= first && b < first + n ? x[b - first] != 0.0f : (0xA5 >> (b & 7)) & 1;
            wrong += got != want;
        }
        CHECK_MSG(wrong == 0, "%s: mask_get from %lld: %lld bits wrong", label, (long long)first, (long long)wrong);
        CHECK_OK(lm_dev_mask_apply(d, xd, keep, first, n, &err), &err);
        CHECK_OK(lm_dev_download(d, y, xd, (size_t)n * sizeof *y, &err), &err);
        wrong = 0;
        for (int64_t j = 0; j < n; j++) {
            int64_t b = first + j;
            bool k = keep[b >> 3] >> (b & 7) & 1;
            uint32_t got, want;
            float w = k ? x[j] : 0.0f;
            memcpy(&got, &y[j], 4);
            memcpy(&want, &w, 4);
            wrong += got != want;
        }
        CHECK_MSG(wrong == 0, "%s: mask_apply from %lld: %lld values wrong", label, (long long)first,
                  (long long)wrong);
    }
    lm_dev_buf_free(d, xd);
    free(x);
    free(y);
    free(bits);
    free(keep);
}

static void test_mask_ops(void)
{
    lm_err err = {0};
    lm_dev *c1 = NULL, *c3 = NULL, *sim = NULL;
    CHECK_OK(lm_dev_cpu_create(&c1, 1, &err), &err);
    CHECK_OK(lm_dev_cpu_create(&c3, 3, &err), &err);
    CHECK_OK(lm_dev_sim_create(&sim, 64 << 20, NULL, 2, &err), &err);
    bare_dev b1, b2;
    if (c1) {
        check_mask_ops(c1, "cpu, 1 thread");
        check_mask_ops(without_masks(&b1, c1), "cpu, the default");
    }
    if (c3)
        check_mask_ops(c3, "cpu, 3 threads");
    if (sim) {
        check_mask_ops(sim, "sim");
        check_mask_ops(without_masks(&b2, sim), "sim, the default");
        // the bitmap is host memory: a sim buffer there is refused
        void *p = NULL;
        CHECK_OK(lm_dev_alloc(sim, 64, &p, &err), &err);
        if (p)
            CHECK_FAILS(lm_dev_mask_get(sim, p, 0, p, 8, &err), LM_ERR_DEVICE, "host memory", &err);
        lm_dev_buf_free(sim, p);
    }
    lm_dev_destroy(c1);
    lm_dev_destroy(c3);
    lm_dev_destroy(sim);
}

// ==== the engine ==============================================================================

// A store of masks the engine records (mask_store) and is then given back (mask_load).
#define MAX_MASKS 256

typedef struct mask_store {
    int n;
    int ft[MAX_MASKS];
    char *name[MAX_MASKS];
    int64_t numel[MAX_MASKS];
    uint8_t *bits[MAX_MASKS];
    int only_ft;      // mask_load: only this FT's masks are given (-1: every FT's)
    int loads;        // mask_load answers given
    int ucc2_calls;   // U_cc² asked for
} mask_store;

static void store_free(mask_store *m)
{
    for (int i = 0; i < m->n; i++) {
        free(m->name[i]);
        free(m->bits[i]);
    }
    memset(m, 0, sizeof *m);
}

static lm_status store_put(void *ctx, int ft, const char *tensor, const uint8_t *bits, int64_t numel, lm_err *err)
{
    mask_store *m = ctx;
    for (int i = 0; i < m->n; i++)
        if (m->ft[i] == ft && strcmp(m->name[i], tensor) == 0)
            return lm_err_set(err, LM_ERR_USAGE, "the mask of FT %d, %s, stored twice", ft, tensor);
    if (m->n == MAX_MASKS)
        return lm_err_set(err, LM_ERR_NOMEM, "too many masks");
    size_t bytes = lm_dev_mask_bytes(numel);
    m->ft[m->n] = ft;
    m->name[m->n] = lm_strdup(tensor);
    m->numel[m->n] = numel;
    m->bits[m->n] = malloc(bytes ? bytes : 1);
    memcpy(m->bits[m->n], bits, bytes);
    m->n++;
    return LM_OK;
}

static const uint8_t *store_get(void *ctx, int ft, const char *tensor, int64_t numel)
{
    mask_store *m = ctx;
    if (m->only_ft >= 0 && ft != m->only_ft)
        return NULL;
    for (int i = 0; i < m->n; i++)
        if (m->ft[i] == ft && m->numel[i] == numel && strcmp(m->name[i], tensor) == 0) {
            m->loads++;
            return m->bits[i];
        }
    return NULL;
}

// U_cc² for the projections of the fixtures (widths up to 512), varied by column and FT.
static double g_ucc2[2][512];

static const double *test_ucc2(void *ctx, int ft, const char *tensor, int64_t cols)
{
    mask_store *m = ctx;
    if (cols > 512 || !strstr(tensor, "_proj.weight"))
        return NULL;
    m->ucc2_calls++;
    return g_ucc2[ft & 1];
}

// Merges fts into base on device `spec` with o, into a new file under root; *out gets the
// file's bytes (caller frees), NULL after a failure.
static void run_engine(const char *root, const lm_merge_opts *o, const char *spec, lm_model *base, lm_ft **fts,
                       char **out, size_t *len)
{
    static int counter;
    lm_err err = {0};
    *out = NULL;
    char name[32];
    snprintf(name, sizeof name, "run-%d", counter++);
    char *dir = lm_path_join(root, name), *file = lm_path_join(dir, "model.safetensors");
    lm_st_desc *desc = NULL;
    int64_t n = 0;
    lm_st_writer *w = NULL;
    lm_dev *dev = NULL;
    lm_merge_result res;
    memset(&res, 0, sizeof res);
    lm_dev_opts dopts = {.threads = 2};
    lm_status s = lm_mkdir_p(dir, &err);
    if (s == LM_OK)
        s = lm_merge_outputs(o, base, &desc, &n, &err);
    if (s == LM_OK)
        s = lm_st_writer_open(&w, dir, desc, n, UINT64_MAX, NULL, &err);
    if (s == LM_OK)
        s = lm_dev_open(&dev, spec, &dopts, NULL, 0, &err);
    if (s == LM_OK)
        s = lm_merge_run(o, dev, base, fts, w, NULL, &res, &err);
    if (s == LM_OK)
        s = lm_st_writer_finish(w, &err);
    CHECK_MSG(s == LM_OK, "merge on %s: %s", spec, err.msg);
    if (s == LM_OK)
        CHECK_OK(lm_read_file(file, 64 << 20, out, len, &err), &err);
    lm_merge_result_free(&res);
    lm_st_writer_free(w);
    lm_dev_destroy(dev);
    free(desc);
    free(file);
    free(dir);
}

static bool same_bytes(const char *a, size_t la, const char *b, size_t lb)
{
    return a && b && la == lb && memcmp(a, b, la) == 0;
}

static void test_engine(void)
{
    lm_err err = {0};
    char *root = make_tmpdir();
    char *bdir = fx("base"), *fdir = fx("ft_full"), *ldir = fx("lora_plain");
    lm_model *base = NULL;
    lm_ft *fts[2] = {NULL, NULL};
    CHECK_OK(lm_model_open(&base, bdir, &err), &err);
    if (base) {
        CHECK_OK(lm_ft_open(&fts[0], fdir, base, &err), &err);
        CHECK_OK(lm_ft_open(&fts[1], ldir, base, &err), &err);
    }
    for (int c = 0; c < 512; c++) {
        g_ucc2[0][c] = 0.25 + (double)(c % 7) * 0.5;
        g_ucc2[1][c] = 4.0 / (1.0 + (double)(c % 5));
    }
    const double w[2] = {1.0, 0.6}, d[2] = {0.3, 0.45};
    const char *devices[3] = {"cpu", "sim:1GiB", "sim:48KiB"};
    for (int method = 0; base && fts[0] && fts[1] && method < 2; method++)
        for (int global = 0; global < 2; global++)
            for (int v = 0; v < 3; v++) {
                char label[96];
                snprintf(label, sizeof label, "%s, --topk %s, %s", method ? "sparsegpt" : "ties",
                         global ? "global" : "tensor", devices[v]);
                lm_merge_opts o = fixture_merge_opts(method ? LM_MERGE_SPARSEGPT : LM_MERGE_TIES, 2, w, d);
                o.topk_global = global;
                o.threads = 2;
                o.slab_elems = v == 1 ? 300 : 0;
                mask_store st = {.only_ft = -1};
                if (method) {
                    o.ucc2 = test_ucc2;
                    o.ucc2_ctx = &st;
                }
                char *ref = NULL, *rec = NULL, *rep = NULL, *zero = NULL, *alone = NULL;
                size_t lref = 0, lrec = 0, lrep = 0, lzero = 0, lalone = 0;
                run_engine(root, &o, devices[v], base, fts, &ref, &lref);
                // recorded: the same bytes, one mask per (FT, tensor) it changes
                o.mask_store = store_put;
                o.mask_ctx = &st;
                run_engine(root, &o, devices[v], base, fts, &rec, &lrec);
                CHECK_MSG(same_bytes(ref, lref, rec, lrec), "%s: recording the masks changed the output", label);
                CHECK_MSG(st.n > 4, "%s: %d masks recorded", label, st.n);
                // given back: the same bytes, no U_cc² asked for
                o.mask_store = NULL;
                o.mask_load = store_get;
                st.ucc2_calls = 0;
                run_engine(root, &o, devices[v], base, fts, &rep, &lrep);
                CHECK_MSG(same_bytes(ref, lref, rep, lrep), "%s: the stored masks give another output", label);
                CHECK_MSG(st.loads >= st.n && st.ucc2_calls == 0, "%s: %d masks loaded of %d, %d U_cc² asked", label,
                          st.loads, st.n, st.ucc2_calls);
                // FT 2's masks keeping nothing, FT 1 selected as usual: FT 1 merged alone
                for (int i = 0; i < st.n; i++)
                    if (st.ft[i] == 1)
                        memset(st.bits[i], 0, lm_dev_mask_bytes(st.numel[i]));
                st.only_ft = 1;
                run_engine(root, &o, devices[v], base, fts, &zero, &lzero);
                lm_merge_opts o1 = o;
                o1.n_ft = 1;
                o1.mask_load = NULL;
                run_engine(root, &o1, devices[v], base, fts, &alone, &lalone);
                CHECK_MSG(same_bytes(zero, lzero, alone, lalone) && !same_bytes(zero, lzero, ref, lref),
                          "%s: masks that keep nothing were not applied", label);
                free(ref);
                free(rec);
                free(rep);
                free(zero);
                free(alone);
                store_free(&st);
            }
    lm_ft_free(fts[0]);
    lm_ft_free(fts[1]);
    lm_model_free(base);
    free(bdir);
    free(fdir);
    free(ldir);
    remove_tmpdir(root);
}

int main(void)
{
    if (!fixture_env("test_cache"))
        return 1;
    test_keys();
    test_digests();
    test_entry_round_trip();
    test_entry_damage();
    test_damage_spares_new();
    test_orphans();
    test_ucc2_sets();
    test_mask_sets();
    test_mask_ops();
    test_engine();
    return check_report("test_cache");
}
