// Falling back from a device to the CPU, as docs/design.md "Devices and the fallback contract"
// says: work is cut into units, each unit tries the device first, and running out of device
// memory (LM_ERR_DEVICE_OOM) is the one failure after which the unit is undone and run again on
// the CPU; any other failure stops. This module holds what the merge engine, the forward pass
// and the Hessians share about it: the event that tells the user a unit went elsewhere (one
// struct, one callback type, one line "fallback: PHASE UNIT on TO (REASON)") and the driver
// that runs a unit with that fallback (lm_fallback_run). The JSON form of the event, for
// --log-json and llmerge.json, is progress.h's lm_fallback_json.
#ifndef LM_FALLBACK_H
#define LM_FALLBACK_H

#include <stdbool.h>
#include <stddef.h>

#include "device.h"
#include "status.h"

// A unit that went from one device to another. Every field points at text the caller owns,
// valid during the call that reports the event only.
typedef struct lm_fallback {
    const char *phase;   // "place", "select", "merge" (a merge), "eval", "hessian" (a forward pass)
    const char *unit;    // what went: a tensor's name, an FT's path, "weights of MODEL",
                         // "sequence 3 (12 tokens)", "factor of NAME", ...
    const char *from;    // the name of the device it left
    const char *to;      // the name of the device it went to: "cpu", or the same device for a
                         // batch that was halved
    const char *reason;  // the device's message
} lm_fallback;

// The most bytes of a fallback's line, its terminating NUL included (lm_fallback_line).
#define LM_FALLBACK_LINE_MAX (LM_ERR_MSG_MAX + 512)

// Writes the event's line "fallback: PHASE UNIT on TO (REASON)" into buf (cap bytes, cut to
// fit) and returns buf. Allocates nothing.
char *lm_fallback_line(char *buf, size_t cap, const lm_fallback *fb);

// Says one line about where units run, from the thread doing the work: a fallback, then fb
// describes it and line is its lm_fallback_line; or a note about the units (halving, a sticky
// fallback taking effect, a damping raised), then fb is NULL. line and fb are valid during
// the call only.
typedef void (*lm_fallback_fn)(void *ctx, const char *line, const lm_fallback *fb);

// Makes fb's line and says it through say, which may be NULL (then nothing is said).
void lm_fallback_say(lm_fallback_fn say, void *ctx, const lm_fallback *fb);

// One unit of work for lm_fallback_run: what it does, what undoes a failed try, whom to tell.
typedef struct lm_fallback_unit {
    const char *phase, *unit;  // the event's phase and unit (not copied)
    // The unit's work on dev: first the device asked for; after that ran out of memory, the
    // CPU (the `cpu` given to lm_fallback_run, which may be NULL: the work then runs on the
    // CPU by its own means). A status other than LM_OK is returned by lm_fallback_run, except
    // LM_ERR_DEVICE_OOM on the first try, which falls back.
    lm_status (*work)(void *ctx, lm_dev *dev, lm_err *err);
    // Undoes what a try that ran out of memory left behind (in ctx), before the event is said
    // and the unit is run again; may be NULL.
    void (*undo)(void *ctx);
    void *ctx;
    lm_fallback_fn say;  // may be NULL
    void *say_ctx;

    // Set by lm_fallback_run.
    bool fell_back;   // the unit ran out of memory on the device and was run again on the CPU
    double seconds;   // when it fell back: the time of the failed try and of the redo; else 0
} lm_fallback_unit;

// Runs u->work on dev. When that returns LM_ERR_DEVICE_OOM, calls u->undo, says the fallback
// through u->say (phase and unit u's, from dev's name, to cpu's name or "cpu" when cpu is NULL,
// reason the message in err), clears err and runs u->work again on cpu. When dev is cpu the
// unit runs once, and its status is returned as it is, LM_ERR_DEVICE_OOM included. Returns the
// status of the last try; any failure other than running out of device memory on dev is
// returned at once, with nothing undone or redone. A unit that succeeded, on dev or after its
// fallback, ends with lm_dev_check(dev) (not on the CPU device itself): a device fault the unit
// left, or a failed release, is returned then as the unit's failure. Allocates nothing.
lm_status lm_fallback_run(lm_fallback_unit *u, lm_dev *dev, lm_dev *cpu, lm_err *err);

#endif
