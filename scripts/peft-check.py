#!/usr/bin/env python3
"""Loads the adapters llmerge writes (--to-lora, llmerge extract) with PEFT and checks that PEFT
applies them as llmerge merges them.

    python3 scripts/peft-check.py [LLMERGE [FIXTURES]]     (default build/llmerge, build/fixtures)

Needs torch, transformers, peft and safetensors (not needed to build or test llmerge). For each
case llmerge writes an adapter in float32 on the CPU and merges it back onto its base
(task-arithmetic): that model is what the adapter means to llmerge. PEFT then loads the base
with transformers, the adapter with PeftModel.from_pretrained, and:

- the logits of a fixed sequence with the adapter applied at run time must be the merged-back
  model's logits (loaded by transformers), within 1e-4 of the largest logit: a key PEFT drops,
  or applies otherwise, changes them by far more;
- PEFT must warn of no missing adapter keys;
- merge_and_unload's weights must be the merged-back model's, tensor by tensor, within 1e-5 of
  each tensor's largest value; PEFT may refuse to merge only a lora_bias adapter with a layer
  whose base has no bias (it applies such an adapter, and the logits are checked).

The cases cover the layouts llmerge writes: linear factors, embedding factors
(lora_embedding_A/B), norms written whole (modules_to_save), bias deltas (lora_bias) with the
embedding written whole, a tied lm_head (ensure_weight_tying), per-matrix ranks (rank_pattern)
and concatenated factors (--to-lora exact). Exit status 0 when every case passed.
"""
import json
import os
import subprocess
import sys
import tempfile
import traceback
import warnings

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
from peft import PeftModel
import peft
import transformers


def load_causal_lm(path):
    try:
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    except TypeError:
        return AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)


def llmerge(binary, *args):
    run = subprocess.run([binary, *args, "--device", "cpu", "-q"], capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError("llmerge %s failed: %s" % (" ".join(args), run.stderr[-800:]))


def worst_relative(a, b):
    scale = a.abs().max().item()
    diff = (a - b).abs().max().item()
    return diff / scale if scale > 0 else diff


def check_case(binary, work, name, base, merge_args):
    adapter = os.path.join(work, name)
    back = os.path.join(work, name + "-back")
    llmerge(binary, *merge_args, "-o", adapter, "--dtype", "f32")
    llmerge(binary, "task-arithmetic", base, adapter, "-o", back, "--dtype", "f32")
    with open(os.path.join(adapter, "adapter_config.json")) as f:
        config = json.load(f)
    problems = []

    vocab = load_causal_lm(base).config.vocab_size
    ids = torch.tensor([[(7 * i + 3) % vocab for i in range(48)]])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = PeftModel.from_pretrained(load_causal_lm(base), adapter)
    for w in caught:
        text = str(w.message)
        if "missing adapter keys" in text or "unexpected keys" in text.lower():
            problems.append("PEFT warned: " + text[:400])
    model.eval()
    merged_back = load_causal_lm(back).eval()
    with torch.no_grad():
        got = model(input_ids=ids).logits
        want = merged_back(input_ids=ids).logits
    logit_err = worst_relative(want, got)
    if not logit_err <= 1e-4:
        problems.append("logits with the adapter differ from the merged-back model's by %.3g of the largest"
                        % logit_err)

    # PEFT refuses to merge a layer with lora_bias whose base layer has no bias (it applies
    # it): the one refusal allowed, and only for such an adapter
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            merged = model.merge_and_unload()
    except RuntimeError as e:
        merged = None
        merge_note = "merge_and_unload refused: %s" % str(e)[:300]
        if not (config.get("lora_bias") and "has no bias" in str(e)):
            problems.append(merge_note)
    if merged is not None:
        weights = load_file(os.path.join(back, "model.safetensors"))
        state = merged.state_dict()
        worst, worst_name, compared = 0.0, "", 0
        for key, want_w in weights.items():
            if key not in state:
                problems.append("merge_and_unload's model has no %s" % key)
                continue
            err = worst_relative(want_w.float(), state[key].float())
            compared += 1
            if err > worst:
                worst, worst_name = err, key
        if not worst <= 1e-5:
            problems.append("merge_and_unload: %s differs by %.3g of its largest value" % (worst_name, worst))
        merge_note = "merge_and_unload: %d tensors, worst %.3g%s" % (
            compared, worst, " (%s)" % worst_name if worst_name else "")

    layout = "r %s, %d target modules, modules_to_save %s, lora_bias %s, tying %s, rank_pattern %d" % (
        config.get("r"), len(config.get("target_modules") or []) if isinstance(config.get("target_modules"), list)
        else 0, config.get("modules_to_save"), config.get("lora_bias"), config.get("ensure_weight_tying"),
        len(config.get("rank_pattern") or {}))
    print("%s: %s" % (name, layout))
    print("  logits with the adapter against the merged-back model: %.3g of the largest; %s" % (logit_err, merge_note))
    for p in problems:
        print("  FAIL: " + p)
    return not problems


def main():
    binary = sys.argv[1] if len(sys.argv) > 1 else "build/llmerge"
    fx = sys.argv[2] if len(sys.argv) > 2 else "build/fixtures"
    print("torch %s, transformers %s, peft %s" % (torch.__version__, transformers.__version__, peft.__version__))
    b, q = os.path.join(fx, "base"), os.path.join(fx, "qwen")
    cases = [
        ("extract-llama", b, ["extract", b, os.path.join(fx, "ft_full"), "--rank", "8"]),
        ("extract-qwen", q, ["extract", q, os.path.join(fx, "qwen_ft"), "--rank", "8"]),
        ("bias-qwen", q, ["task-arithmetic", q, os.path.join(fx, "lora_bias"), "--to-lora", "8"]),
        ("ties-energy", b, ["ties", b, os.path.join(fx, "lora_plain"), os.path.join(fx, "lora_rslora"),
                            os.path.join(fx, "lora_mts"), "--to-lora", "16", "--to-lora-energy", "0.9"]),
        ("exact", b, ["task-arithmetic", b, os.path.join(fx, "lora_plain"), os.path.join(fx, "lora_mts"),
                      "--weights", "0.5|0.7", "--to-lora", "exact"]),
    ]
    failed = []
    with tempfile.TemporaryDirectory(prefix="peft-check-") as work:
        for name, base, args in cases:
            try:
                if not check_case(binary, work, name, base, args):
                    failed.append(name)
            except Exception:
                print("%s: FAIL:\n%s" % (name, traceback.format_exc()[-1500:]))
                failed.append(name)
    print("peft-check: %s" % ("all passed" if not failed else "FAILED: " + " ".join(failed)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
