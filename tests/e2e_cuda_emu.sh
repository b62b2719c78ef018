#!/usr/bin/env bash
# End-to-end tests of the CUDA backend on the emulated device, cuda-emu, through the binary, on
# the fixtures: what scripts/gpu-check.sh checks on a GPU that e2e_device does not (the forward
# pass and the Hessians against the CPU, with room and with budgets under which a batch, a
# sequence and the whole model do not fit), a merge where one FT's factors do not fit, and the
# injected failures of LLMERGE_EMU_FAIL: an out-of-memory at each allocation falls back and
# gives the CPU's output; a fault (sticky, as a kernel's crash) stops the run with exit 1, a
# message naming the phase and the unit, and no output.
#
# LAUNCH_OOM says what an out-of-memory at a kernel launch (a lazily loaded kernel on a full
# device) must do: "fallback" (the same output as the CPU's, like an allocation's) or "error"
# (exit 1 naming the kernel and no output: what the backend does while it maps every launch
# failure to a device error).
# Usage: e2e_cuda_emu.sh LLMERGE FIXTURES ST_DIFF LAUNCH_OOM
set -u
llmerge=$1 fx=$2 st_diff=$3 launch_oom=$4
jsonq=$(dirname "$st_diff")/jsonq
. "$(dirname "$0")/e2e_lib.sh"
e2e_start e2e_cuda_emu

B=$fx/base data=$fx/calib/calib.jsonl

# ---- the forward pass against the cpu (gpu-check.sh's comparisons) ---------------------------
# eval_same NAME DEVICE FALLBACK MODEL-ARGS...: the perplexity on DEVICE is the CPU's to 1e-4
# relative (the emulator's libm is the host's: in practice it is the same); FALLBACK is a text
# the run must print ("" for a run that must not fall back at all).
eval_same() {
  local name=$1 dev=$2 fb=$3 pc pg
  shift 3
  if ! "$llmerge" eval "$@" --data "$data" --device cpu --json >"$work/$name-cpu.json" 2>"$work/err" ||
    ! "$llmerge" eval "$@" --data "$data" --device "$dev" --json >"$work/$name-dev.json" 2>"$work/err"; then
    bad "eval $name on $dev: $(head -c 600 "$work/err")"
    return
  fi
  if [ -z "$fb" ]; then
    if grep -q "fallback" "$work/err"; then bad "eval $name on $dev fell back: $(grep fallback "$work/err" | head -3)"; else ok; fi
    json "$work/$name-dev.json" tokens_on_cpu 0
  elif grep -qF -- "$fb" "$work/err"; then ok; else
    bad "eval $name on $dev: no '$fb': $(head -c 600 "$work/err")"
  fi
  pc=$("$jsonq" "$work/$name-cpu.json" perplexity) pg=$("$jsonq" "$work/$name-dev.json" perplexity)
  if awk -v a="$pg" -v b="$pc" 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(b > 0 && d <= 1e-4 * b) }'; then ok; else
    bad "eval $name: perplexity $pg on $dev, $pc on the cpu (beyond 1e-4 relative)"
  fi
}
# hessian_same NAME DEVICE FALLBACK MODEL-ARGS...: each Hessian entry the CPU's to 64 ulp or 1e-4
# of its tensor's largest entry (float32 rounding of the sums' terms).
hessian_same() {
  local name=$1 dev=$2 fb=$3
  shift 3
  if ! "$llmerge" hessian "$@" --calib "$data" -o "$work/$name-cpu.st" --device cpu -q 2>"$work/err" ||
    ! "$llmerge" hessian "$@" --calib "$data" -o "$work/$name-dev.st" --device "$dev" 2>"$work/err"; then
    bad "hessian $name on $dev: $(head -c 600 "$work/err")"
    return
  fi
  if [ -z "$fb" ]; then
    if grep -q "fallback" "$work/err"; then bad "hessian $name on $dev fell back: $(grep fallback "$work/err" | head -3)"; else ok; fi
    if grep -qF "tokens/s) on $dev" "$work/err"; then ok; else bad "hessian $name did not capture on $dev: $(tail -3 "$work/err")"; fi
  elif grep -qF -- "$fb" "$work/err"; then ok; else
    bad "hessian $name on $dev: no '$fb': $(head -c 600 "$work/err")"
  fi
  if "$st_diff" --ulps 64 --rel 1e-4 "$work/$name-cpu.st" "$work/$name-dev.st" >"$work/diff" 2>&1; then ok; else
    bad "hessian $name on $dev differs from the cpu's: $(tail -3 "$work/diff")"
  fi
  rm -f "$work/$name-cpu.st" "$work/$name-dev.st"
}
# the fixtures cover packed sequences, GQA with llama3's rope scaling, biases, a run-time adapter
eval_same base cuda-emu:64MiB "" "$B"
eval_same base-lora cuda-emu:64MiB "" "$B" --adapter "$fx/lora_plain"
eval_same qwen-bias cuda-emu:64MiB "" "$fx/qwen" --adapter "$fx/lora_bias"
eval_same llama3 cuda-emu:64MiB "" "$fx/llama3"
# a batch does not fit (halved), a sequence does not fit (the CPU runs it), the model does not fit
eval_same batch cuda-emu:600KiB "eval sequences 1-8 (155 tokens) halved on cuda-emu:600KiB" "$B"
eval_same sequence cuda-emu:450KiB "fallback: eval sequence 1 (18 tokens) on cpu" "$B"
eval_same model cuda-emu:300KiB "fallback: eval weights of $B on cpu" "$B"
hessian_same base cuda-emu:1GiB "" "$B"
hessian_same base-lora cuda-emu:1GiB "" "$B" --adapter "$fx/lora_plain"
hessian_same qwen-bias cuda-emu:1GiB "" "$fx/qwen" --adapter "$fx/lora_bias"
hessian_same llama3 cuda-emu:1GiB "" "$fx/llama3"
hessian_same accumulators cuda-emu:540KiB "fallback: hessian accumulators of layers" "$B"
hessian_same model cuda-emu:64KiB "fallback: hessian weights of $B on cpu" "$B"

# ---- merges at a budget where one FT's factors do not fit -------------------------------------
# (e2e_device covers room and 64 KiB; the backend keeps 1 MiB of scratch besides cuBLAS's
# workspace and handles, so 1060 KiB leaves room for one adapter's factors and the smaller
# tensors.)
rm -rf "$work/tc" "$work/te"
"$llmerge" task-arithmetic "$B" "$fx/lora_plain" "$fx/lora_dora" "$fx/ft_full" -o "$work/tc" --device cpu -q ||
  bad "task-arithmetic on cpu failed"
run factors task-arithmetic "$B" "$fx/lora_plain" "$fx/lora_dora" "$fx/ft_full" -o "$work/te" --device cuda-emu:1060KiB
if [ "$(grep -c "fallback: place " "$work/factors.err")" = 1 ]; then ok; else
  bad "at cuda-emu:1060KiB not exactly one adapter's factors fell back: $(grep fallback "$work/factors.err" | head -5)"
fi
if grep -qE "devices: [1-9][0-9]* tensors merged on cuda-emu:1060KiB, [1-9]" "$work/factors.err"; then ok; else
  bad "at cuda-emu:1060KiB not some tensors on each device: $(grep devices: "$work/factors.err")"
fi
if "$st_diff" --ulps 0 "$work/tc/model.safetensors" "$work/te/model.safetensors" >"$work/diff" 2>&1; then ok; else
  bad "task-arithmetic at cuda-emu:1060KiB differs from the cpu: $(tail -3 "$work/diff")"
fi
rm -rf "$work/tc" "$work/te"

# ---- injected failures ---------------------------------------------------------------------
# counts MERGE-ARGS...: "ALLOCATIONS LAUNCHES" the merge makes on cuda-emu:1GiB
counts() {
  rm -rf "$work/count"
  LLMERGE_EMU_STATS=1 "$llmerge" "$@" -o "$work/count" --device cuda-emu:1GiB -q 2>&1 |
    sed -n 's/^cuda-emu: \([0-9]*\) allocations, \([0-9]*\) launches$/\1 \2/p'
  rm -rf "$work/count"
}
# oom_each KIND NAME MERGE-ARGS...: with an out-of-memory at each allocation (KIND alloc) or
# launch (KIND launch) in turn, the merge writes the CPU's output (an out-of-memory the backend
# absorbs, as a failed scratch buffer at the device's opening, needs no fallback; some must fall
# back). While LAUNCH_OOM is "error", a launch's may instead fail, naming the kernel and writing
# nothing; a run that succeeds must still give the CPU's output.
oom_each() {
  local kind=$1 name=$2 n total i failures=0 fell=0 rc
  shift 2
  rm -rf "$work/$name-cpu"
  "$llmerge" "$@" -o "$work/$name-cpu" --device cpu -q || { bad "$name on cpu failed"; return; }
  read -r n total < <(counts "$@")
  [ "$kind" = launch ] && n=$total
  if [ "${n:-0}" -gt 0 ]; then ok; else bad "$name: no count of allocations and launches"; return; fi
  for ((i = 1; i <= n; i++)); do
    rm -rf "$work/$name-emu"
    LLMERGE_EMU_FAIL=$kind-oom:$i "$llmerge" "$@" -o "$work/$name-emu" --device cuda-emu:1GiB >"$work/out" 2>&1
    rc=$?
    grep -q "fallback: " "$work/out" && fell=$((fell + 1))
    if [ $rc -eq 1 ] && [ "$kind" = launch ] && [ "$launch_oom" = error ] &&
      grep -q "error: merging tensor '.*': cuda: launching k_[a-z_0-9<>]*: out of memory" "$work/out" &&
      [ ! -e "$work/$name-emu" ]; then
      continue
    fi
    if [ $rc -eq 0 ] &&
      "$st_diff" "$work/$name-cpu/model.safetensors" "$work/$name-emu/model.safetensors" >"$work/diff" 2>&1; then :; else
      failures=$((failures + 1))
      [ $failures -le 3 ] && bad "$name with $kind-oom:$i: exit $rc: $(tail -c 400 "$work/out") $(tail -2 "$work/diff" 2>/dev/null)"
    fi
  done
  if [ $failures -eq 0 ]; then ok; else bad "$name: $failures of $n injected $kind out-of-memory runs failed"; fi
  if [ $fell -gt 0 ]; then ok; else bad "$name: no injected $kind out-of-memory made anything fall back"; fi
  rm -rf "$work/$name-cpu" "$work/$name-emu"
}
oom_each alloc ties-lora ties "$B" "$fx/lora_plain"
oom_each launch ties-lora ties "$B" "$fx/lora_plain"
oom_each alloc ta-full task-arithmetic "$B" "$fx/ft_full"
oom_each launch ta-full task-arithmetic "$B" "$fx/ft_full"

# ---- released buffers are reused, and releasing does not wait ------------------------------
# A released buffer goes back to the device's cache, the next allocation of its size takes it
# without a cudaMalloc, and nothing is given back to the driver (a cudaFree, which waits for the
# device) before the device closes: per tensor the host waits for the device about once (its
# download), where a wait and a cudaFree per release made it k + 4 times; and the work makes
# fewer cudaMalloc than it has tensors.
rm -rf "$work/count"
LLMERGE_EMU_STATS=1 "$llmerge" task-arithmetic "$B" "$fx/ft_full" -o "$work/count" --device cuda-emu:1GiB \
  >"$work/stats" 2>&1
rm -rf "$work/count"
read -r allocs < <(sed -n 's/^cuda-emu: \([0-9]*\) allocations, [0-9]* launches$/\1/p' "$work/stats")
read -r syncs frees < <(sed -n 's/^cuda-emu: \([0-9]*\) synchronisations, \([0-9]*\) frees$/\1 \2/p' "$work/stats")
read -r tensors < <(sed -n 's/.*devices: \([0-9]*\) tensors merged on cuda-emu.*/\1/p' "$work/stats")
if [ "${tensors:-0}" -gt 0 ] && [ -n "$allocs" ] && [ -n "$syncs" ]; then
  ok
  # the frees are those of the close, each one wait; the waits of the work come before
  if [ "$frees" -eq "$allocs" ] && [ $((syncs - frees)) -le $((2 * tensors)) ]; then ok; else
    bad "$tensors tensors: $((syncs - frees)) waits for the device and $frees cudaFree (of $allocs cudaMalloc)"
  fi
  if [ "$allocs" -lt "$tensors" ]; then ok; else bad "$tensors tensors made $allocs cudaMalloc"; fi
else
  bad "no counts from LLMERGE_EMU_STATS: $(tail -3 "$work/stats")"
fi

# a fault: exit 1, the phase and the unit named, no output (nor a temporary left behind)
no_output() {
  if [ ! -e "$1" ] && ! ls "$work" | grep -q "$(basename "$1").*tmp"; then ok; else bad "a failed run left output: $(ls "$work")"; fi
}
read -r _ launches < <(counts ties "$B" "$fx/lora_plain" "$fx/ft_full")
for n in 1 $((launches / 2)) "$launches"; do
  LLMERGE_EMU_FAIL=launch-fault:$n expect 1 "error: merging tensor '" ties "$B" "$fx/lora_plain" "$fx/ft_full" \
    -o "$work/fault" --device cuda-emu:1GiB
  grep -q "unspecified launch failure" "$work/out" && ok || bad "launch-fault:$n: not the fault: $(tail -c 400 "$work/out")"
  no_output "$work/fault"
done
# (placing the weights converts each on the device, a launch each, before the first layer; the
# forward pass's matrix products are cuBLAS's, not counted)
LLMERGE_EMU_FAIL=launch-fault:29 expect 1 "error: eval sequences 1-8 on cuda-emu:64MiB: layer 1: " eval "$B" \
  --data "$data" --device cuda-emu:64MiB
# (the fault is seen by the next call: a kernel launch, a copy, or cuBLAS, which says it its way)
grep -qE "unspecified launch failure|the GPU program failed to execute" "$work/out" && ok ||
  bad "eval with launch-fault:29: $(tail -c 400 "$work/out")"
LLMERGE_EMU_FAIL=launch-fault:29 expect 1 "error: hessian sequences 1-8 on cuda-emu:1GiB: layer 1: " hessian "$B" \
  --calib "$data" -o "$work/f.safetensors" --device cuda-emu:1GiB
no_output "$work/f.safetensors"
# sparsegpt's Hessians captured on the device: a fault there names the FT whose Hessians failed
LLMERGE_EMU_FAIL=launch-fault:61 expect 1 "error: Hessians of $fx/ft_full: hessian sequences 1-8 on cuda-emu:1GiB: layer 0: Hessian of model.layers.0." sparsegpt "$B" "$fx/lora_plain" "$fx/ft_full" \
  -o "$work/sg" --calib "$data" --density 0.3 --cache-dir "$work/cache" --device cuda-emu:1GiB
no_output "$work/sg"
# an out-of-memory while capturing falls back; the output is the CPU's capture's
# (each its own cache, so both capture)
rm -rf "$work/sgc" "$work/sge"
"$llmerge" sparsegpt "$B" "$fx/lora_plain" "$fx/ft_full" -o "$work/sgc" --calib "$data" --density 0.3 \
  --cache-dir "$work/cache-c" --device cpu -q || bad "sparsegpt on cpu failed"
LLMERGE_EMU_FAIL=alloc-oom:1 run sg-oom sparsegpt "$B" "$fx/lora_plain" "$fx/ft_full" -o "$work/sge" --calib "$data" \
  --density 0.3 --cache-dir "$work/cache-e" --device cuda-emu:300KiB
grep -q "fallback: " "$work/sg-oom.err" && ok || bad "sparsegpt at cuda-emu:300KiB: nothing fell back: $(head -c 400 "$work/sg-oom.err")"
if "$st_diff" --ulps 0 "$work/sgc/model.safetensors" "$work/sge/model.safetensors" >"$work/diff" 2>&1; then ok; else
  bad "sparsegpt with its Hessians on cuda-emu:300KiB differs from the cpu: $(tail -3 "$work/diff")"
fi

# ---- the libraries and the driver --------------------------------------------------------------
# A driver older than the runtime is said as such (not "no CUDA device"), before any work.
rm -rf "$work/drv"
LLMERGE_EMU_FAIL=driver-old expect 2 "older than this llmerge's CUDA" ties "$B" "$fx/lora_plain" -o "$work/drv" \
  --device cuda-emu
no_output "$work/drv"
# Without cuBLAS the device does not open: exit 2 naming the library, no output.
LLMERGE_EMU_FAIL=no-cublas expect 2 "cannot load libcublas" ties "$B" "$fx/lora_plain" -o "$work/drv" --device cuda-emu
no_output "$work/drv"
# Without cuSOLVER it opens and says, once, that it factors on the CPU; sparsegpt then runs to
# the end with the CPU's output.
rm -rf "$work/nosolver" "$work/nosolver-c" "$work/cache-ns" "$work/cache-nsc"
"$llmerge" sparsegpt "$B" "$fx/lora_plain" "$fx/ft_full" -o "$work/nosolver-c" --calib "$data" --density 0.3 \
  --cache-dir "$work/cache-nsc" --device cpu -q || bad "sparsegpt on cpu failed"
LLMERGE_EMU_FAIL=no-cusolver run nosolver sparsegpt "$B" "$fx/lora_plain" "$fx/ft_full" -o "$work/nosolver" \
  --calib "$data" --density 0.3 --cache-dir "$work/cache-ns" --device cuda-emu
if [ "$(grep -c "Cholesky factorisations on the CPU: cannot load libcusolver" "$work/nosolver.err")" = 1 ]; then ok; else
  bad "without cuSOLVER: not said once: $(head -c 600 "$work/nosolver.err")"
fi
if "$st_diff" --ulps 0 "$work/nosolver-c/model.safetensors" "$work/nosolver/model.safetensors" >"$work/diff" 2>&1; then ok
else bad "sparsegpt on cuda-emu without cuSOLVER differs from the cpu: $(tail -3 "$work/diff")"; fi

# ---- the device's name and usage -------------------------------------------------------------
LLMERGE_EMU_FAIL=bogus expect 2 "LLMERGE_EMU_FAIL=bogus: expected alloc-oom:N" ties "$B" "$fx/lora_plain" -o "$work/u" --device cuda-emu
LLMERGE_EMU_FAIL= expect 2 "--device cuda-emu:0: the emulated device needs a size above 0" ties "$B" "$fx/lora_plain" \
  -o "$work/u" --device cuda-emu:0
rm -rf "$work/u"
LLMERGE_EMU_FAIL= run name ties "$B" "$fx/lora_plain" -o "$work/u" --device cuda-emu:2MiB
grep -qF "devices: 4 tensors merged on cuda-emu:2MiB" "$work/name.err" && ok || bad "the device's name: $(tail -3 "$work/name.err")"
# a --gpu-mem that opening the device spent half of or more is said with the device
LLMERGE_EMU_FAIL= run capnote ties "$B" "$fx/lora_plain" -o "$work/capnote" --device cuda-emu --gpu-mem 1200KiB
grep -qF "device cuda-emu:1GiB (--gpu-mem 1.17 MiB: 1.02 MiB of it taken when the device opened, by the cuBLAS and" \
  "$work/capnote.err" && ok || bad "--gpu-mem 1200KiB: no note: $(head -3 "$work/capnote.err")"
grep -q "gpu-mem" "$work/name.err" && bad "a note without --gpu-mem: $(head -3 "$work/name.err")" || ok

e2e_end
