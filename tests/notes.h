// What an lm_fallback_fn says, collected for a test: every line, and of the fallbacks among
// them (those said with a description) how many and the last one's fields.
#ifndef LM_TEST_NOTES_H
#define LM_TEST_NOTES_H

#include <stdio.h>
#include <string.h>

#include "fallback.h"

typedef struct notes {
    char text[8192];  // the lines, each ended by a newline
    int n;            // lines
    int fallbacks;    // lines said with a fallback's description
    char phase[32], unit[256], from[64], to[64];  // the last fallback's
} notes;

static inline void copy_field(char *dst, size_t size, const char *src)
{
    snprintf(dst, size, "%s", src ? src : "(null)");
}

static inline void collect_note(void *ctx, const char *line, const lm_fallback *fb)
{
    notes *n = ctx;
    size_t len = strlen(n->text);
    snprintf(n->text + len, sizeof n->text - len, "%s\n", line);
    n->n++;
    if (!fb)
        return;
    n->fallbacks++;
    copy_field(n->phase, sizeof n->phase, fb->phase);
    copy_field(n->unit, sizeof n->unit, fb->unit);
    copy_field(n->from, sizeof n->from, fb->from);
    copy_field(n->to, sizeof n->to, fb->to);
}

#endif
