// A lock that keeps apart processes on the nodes of a cluster sharing a file system (NFS,
// Lustre, GPFS, BeeGFS; or one machine's disk), so that two jobs of a sweep needing the same
// cache entry compute it once: the first takes the lock and computes, the others wait and then
// read the entry (docs/cluster.md "The shared cache").
//
// The lock is a file taken by an exclusive create (open with O_CREAT | O_EXCL, atomic on local
// file systems and on NFS from version 3) holding "HOST PID TOKEN PIDNS": the holder's host name,
// its process id, a random token and its PID namespace (so that containers sharing a host name
// but not their processes do not judge each other's pids). flock and fcntl locks are not used:
// on NFS they depend on the lock manager of each client and server, and a lock held by a node
// that died is cleared only when the server notices. While held, a thread of the holder touches
// the file (its mtime) every fifth of lm_xlock_stale_seconds(), every 30 s at most. A holder is
// dead when
//   - it is on this host, in this PID namespace, and no process has its pid (or it is a zombie,
//     or it is this process's pid with another token: a pid used again): at once;
//   - or its file has not changed (mtime, inode, content) for lm_xlock_stale_seconds() by the
//     waiter's own clock (so clocks of other nodes do not matter): a holder on a node that died
//     or lost the file system, or one stopped (SIGSTOP) that long. Every job sharing a cache
//     should use one value (a waiter's much smaller than a holder's could judge it dead).
// A dead holder's file is removed under a second lock, PATH.break, taken the same way and held
// for a moment: the waiter that holds it looks again and removes the file only when it is still
// the one found dead (same inode and content), so of several waiters that found it dead at once
// one removes it, and none removes a lock taken meanwhile. A holder removes its file when it
// releases the lock, and a signal that ends it removes it too (lib/signals.h); SIGKILL leaves it,
// for the rules above. (A holder judged dead while it lives, after the stale time without a
// touch, may still remove a lock taken after it: two captures then, never a damaged entry, as
// entries are written whole and renamed into place.)
//
// The file system must give an exclusive create, an atomic rename, and an mtime that another
// client sees change within the stale time (NFS's attribute cache: actimeo, 60 s at most by
// default, well under the default 300 s).
#ifndef LM_XLOCK_H
#define LM_XLOCK_H

#include <stdbool.h>

#include "status.h"

typedef struct lm_xlock lm_xlock;

// How long a lock file may stay unchanged before its holder counts as dead: the environment's
// LLMERGE_LOCK_STALE (seconds, a positive number), else 300.
double lm_xlock_stale_seconds(void);

// Called while waiting: `ready` sets *done when what the holder computes is there now (the lock
// is then not needed), or fails; `waiting` is told who holds the lock ("HOST pid PID") when a
// holder is first seen, and again (gone true) when its lock has been taken over, for a message.
typedef lm_status (*lm_xlock_ready_fn)(void *ctx, bool *done, lm_err *err);
typedef void (*lm_xlock_waiting_fn)(void *ctx, const char *holder, bool gone, const char *path);

// Takes the lock at `path`, waiting while a live holder has it. `ready` (may be NULL) is asked
// first, after each wait, and once more when the lock is taken: when it says yes, the lock is
// released and *out is NULL. Otherwise *out is the lock, to release with lm_xlock_release. A
// dead holder's lock is taken over (`waiting` is told). LM_ERR_INTERRUPTED when a signal comes
// while waiting (lib/signals.h); LM_ERR_IO naming the path when the file cannot be created or
// read for another reason than being there, or a dead holder's file cannot be removed (a
// directory that does not let this user remove another's file); an error of `ready` as it is.
lm_status lm_xlock_acquire(lm_xlock **out, const char *path, lm_xlock_ready_fn ready, lm_xlock_waiting_fn waiting,
                           void *ctx, lm_err *err);

// Stops touching the file and removes it (when it is still this holder's). Safe on NULL.
void lm_xlock_release(lm_xlock *l);

#endif
