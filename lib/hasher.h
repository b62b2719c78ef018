// Hashing input files on a thread of its own while the merge runs.
//
// llmerge.json records xxHash64 of every input file. Hashing them after the merge costs a
// second read of every input byte by one thread while the other cores wait, and by then the
// first inputs' pages may have left the page cache (a merge of several 2.5 GB models reads more
// than the cache keeps), so they come from disk again. The hasher instead reads the files while
// the merge reads them, a window of each in turn so that it moves through all of them at once,
// as the merge does, and uses the time the merge leaves a core idle (writing, single-threaded
// steps). Its results are exactly lm_xxh64_file's.
#ifndef LM_HASHER_H
#define LM_HASHER_H

#include <stdbool.h>
#include <stdint.h>

#include "util.h"

typedef struct lm_hasher lm_hasher;

// Bytes of one file hashed before moving to the next (mapped at once): small enough that the
// files advance together, as the merge reads them, large enough that mapping costs nothing.
#define LM_HASHER_WINDOW ((size_t)16 << 20)

// Starts hashing the n files at paths (copied). A file that cannot be opened or read is
// not an error here: lm_hasher_get reports it.
lm_status lm_hasher_start(lm_hasher **out, const char *const *paths, int n, lm_err *err);

// Waits until `path` (compared as given to lm_hasher_start) is hashed and sets *hash; *found is
// false, and nothing else is set, when the hasher was not given that path. A read error of that
// file is returned as lm_xxh64_file returns it.
lm_status lm_hasher_get(lm_hasher *h, const char *path, uint64_t *hash, bool *found, lm_err *err);

// Stops the thread (between windows, when it is still running) and frees everything; NULL is fine.
void lm_hasher_free(lm_hasher *h);

#endif
