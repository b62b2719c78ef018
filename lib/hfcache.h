// Models where users have them: a model or adapter argument that is not a path on disk is looked
// up in the Hugging Face Hub's local cache, the directory `huggingface-cli download` (or
// `hf download`) fills. The cache is $HF_HUB_CACHE, else $HUGGINGFACE_HUB_CACHE (its older
// name), else $HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub, else
// ~/.cache/huggingface/hub, as huggingface_hub decides it. A repository ORG/NAME (or NAME alone,
// such as gpt2) lives there as
//
//   models--ORG--NAME/refs/REF                   a file holding the commit a branch or tag names
//   models--ORG--NAME/snapshots/COMMIT/FILE...   the files of a commit, symlinks into ../../blobs/
//
// The argument is ORG/NAME (the commit refs/main names) or ORG/NAME@REVISION, REVISION a branch
// or tag with a file under refs/ (looked up first), else a commit hash, whole or abbreviated to
// at least 7 hex digits, that names one directory under snapshots/. The snapshot directory found
// is the model (or the adapter); lm_input_detect then applies its usual rules to it. Nothing is
// ever downloaded: a model not in the cache is an error saying where it was looked for and the
// command that downloads it. An argument that exists on disk is always a path, even one that
// reads as ORG/NAME.
#ifndef LM_HFCACHE_H
#define LM_HFCACHE_H

#include "status.h"

// Resolves `arg` to a directory: `arg` itself when something exists on disk at that path (a
// dangling symbolic link included: the caller's own checks then say what is wrong with it), else
// the Hugging Face cache snapshot it names. *out is a new string the caller frees (NULL on
// failure). Errors, all exit status 2: LM_ERR_NOT_FOUND when `arg` is neither a path nor a
// repository id ("ARG: no such file or directory"), or names a model, revision or snapshot the
// cache does not hold (the message names the cache directory, the entry it expected and the
// `huggingface-cli download` / `hf download` command, with --revision when one was asked for);
// LM_ERR_FORMAT for a refs/ file that holds no commit hash; LM_ERR_USAGE for an abbreviated
// hash that names several snapshots.
lm_status lm_hf_resolve(const char *arg, char **out, lm_err *err);

// The Hub cache directory the environment names (above): *dir is a new string the caller frees;
// *from (may be NULL) a static phrase saying where it came from ("set by $HF_HUB_CACHE",
// "$HF_HOME/hub", ..., "the default, ~/.cache/huggingface/hub"). A variable set to the empty
// string counts as unset, and a leading "~/" in one stands for $HOME. LM_ERR_NOT_FOUND when none
// of the variables nor HOME is set.
lm_status lm_hf_cache_dir(char **dir, const char **from, lm_err *err);

#endif
