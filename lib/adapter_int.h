// What adapter.c and adapter_target.c share, private to them: PEFT's patterns compiled with
// PCRE2 (adapter_target.c; lm_lora_re is opaque to adapter.c, which compiles the config's
// patterns and frees them) and the claim of a base tensor by an adapter key (adapter.c; the
// selection rebuilds the claims after it sets modules aside).
#ifndef LM_ADAPTER_INT_H
#define LM_ADAPTER_INT_H

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "adapter.h"

// Compiles head + pattern + tail with `opts` (PCRE2_ANCHORED for Python's re.match, with
// PCRE2_ENDANCHORED for re.fullmatch) into *out (free with lm_lora_re_free). LM_ERR_FORMAT
// naming the file (label), the key and the pattern when it is too long, does not compile or uses
// a form PCRE2 reads otherwise than Python.
lm_status lm_lora_re_compile(lm_lora_re **out, const char *label, const char *key, const char *pattern,
                             const char *head, const char *tail, uint32_t opts, lm_err *err);

// Matches `re` against `subject` (a module path): *hit says whether it matched; *g1 / *g1_len
// (g1 may be NULL) get capture group 1, NULL when it did not take part. LM_ERR_FORMAT naming the
// file, the key, the pattern and the subject when the match runs past a limit. Allocates
// nothing that outlives the call.
lm_status lm_lora_re_match(const lm_lora_re *re, const char *label, const char *subject, bool *hit,
                           const char **g1, size_t *g1_len, lm_err *err);

// Frees re (NULL is fine).
void lm_lora_re_free(lm_lora_re *re);

// Registers `base_name` as changed by (touch, index) of adapter a, whose key is `key`; a second
// change of one tensor is LM_ERR_FORMAT naming both keys.
lm_status lm_adapter_claim_target(lm_adapter *a, const char *base_name, lm_adapter_touch touch, int64_t index,
                                  const char *key, lm_err *err);

// Whether modules_to_save names module `path`, by PEFT's rule for its keys: the path itself or a
// ".NAME" suffix.
bool lm_lora_is_saved_module(const lm_lora_config *cfg, const char *path);

#endif
