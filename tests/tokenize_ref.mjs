// The reference for tests/e2e_tokenize.sh: Hugging Face's JavaScript tokenizers
// (@huggingface/tokenizers) on each line's "text" of a JSON Lines file, written as llmerge
// tokenize writes ids: {"input_ids": [a, b, ...]} per line.
// Usage: node tokenize_ref.mjs NODE_MODULES TOKENIZER_DIR FILE.jsonl
import fs from "fs";
import path from "path";
import { pathToFileURL } from "url";

const [modules, dir, file] = process.argv.slice(2);
const { Tokenizer } = await import(pathToFileURL(path.join(modules, "@huggingface/tokenizers/dist/tokenizers.mjs")).href);
const json = (name) => JSON.parse(fs.readFileSync(path.join(dir, name), "utf8"));
const config = fs.existsSync(path.join(dir, "tokenizer_config.json")) ? json("tokenizer_config.json") : {};
const tok = new Tokenizer(json("tokenizer.json"), config);
const out = [];
for (const line of fs.readFileSync(file, "utf8").split("\n")) {
  if (!line) continue;
  out.push('{"input_ids": [' + tok.encode(JSON.parse(line).text).ids.join(", ") + "]}");
}
process.stdout.write(out.join("\n") + "\n");
