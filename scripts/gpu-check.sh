#!/usr/bin/env bash
# One command for a machine with an NVIDIA GPU: prints the driver's and the toolkit's versions
# (a driver older than the toolkit is the usual reason CUDA is not usable), builds llmerge with
# CUDA, runs the whole test
# suite with the CUDA device under test as well (test_device compares every device operation on
# cuda against the CPU), runs the end-to-end device comparison on cuda with room and with a
# small --gpu-mem that forces real CUDA out-of-memory fallbacks, compares merges written as
# adapters (--to-lora, llmerge extract) on cuda with the CPU's, compares the forward pass on
# cuda with the CPU's end to end (llmerge eval's perplexity, llmerge hessian's Hessians), and
# prints the GPU benchmark tables: bench_merge --device cuda (merge time, host<->device GB/s
# against cudaMemcpy measured in the same run, target >= 70% for LoRA inputs) and bench_capture
# --device cuda (capture tokens/s against cuBLAS's SGEMM peak on the device, target >= 40%),
# bench_methods --device cuda (slerp, breadcrumbs, della and the --to-lora merges against their
# reference methods in the same run, with the targets of the CPU's table) and the profiles
# (LLMERGE_PROFILE) of ties, task arithmetic and della of the three adapters. Where python3 has
# PyTorch it runs merges while another process holds all of the GPU but 1.2 GB (each must
# finish), and where it has transformers and peft, scripts/peft-check.py. The build's log lists
# the kernels ptxas reports spilling registers or using local memory. Exit status 0 only when
# every step passed (a benchmark's MISSED target is printed, not a failure).
#
#   scripts/gpu-check.sh [--no-bench] [--no-build]
#
# --no-build: use build-gpu as it is, without scripts/bootstrap.sh or a build, for a GPU node that
# cannot install packages: configure and build build-gpu (-DLLMERGE_CUDA=ON) on a machine with
# the same CUDA toolkit, at the same path, with its build log in build-gpu/build.log, and give
# the node the libraries the programs load (LD_LIBRARY_PATH). At another path, rewrite the
# paths in build-gpu/CTestTestfile.cmake (docs/devices.md).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
bench=1 build=1
for arg in "$@"; do
  case $arg in
    --no-bench) bench=0 ;;
    --no-build) build=0 ;;
    *) echo "usage: scripts/gpu-check.sh [--no-bench] [--no-build]" >&2; exit 2 ;;
  esac
done

step() { printf '\n==== %s\n' "$*"; }
failed=()

step "driver and runtime versions"
# Printed first, whatever follows: the driver must support the toolkit's CUDA version (CUDA 13
# needs driver R580 or newer). nvidia-smi may be missing; the kernel module says the version too.
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader ||
    echo "nvidia-smi failed"
  nvidia-smi | grep -m1 "CUDA Version" || true
else
  echo "nvidia-smi: not installed"
fi
if [ -r /proc/driver/nvidia/version ]; then
  head -1 /proc/driver/nvidia/version
else
  echo "driver: no NVIDIA kernel module loaded (/proc/driver/nvidia/version is missing)"
fi
nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
if [ -x "$nvcc" ]; then
  "$nvcc" --version | grep -m1 release | sed 's/^/toolkit (nvcc): /'
else
  echo "toolkit: nvcc not found"
fi

step "setup"
if [ $build -eq 1 ]; then
  bash scripts/bootstrap.sh || exit 1
elif [ ! -x build-gpu/llmerge ] || ! grep -q "LLMERGE_CUDA:[A-Z]*=ON" build-gpu/CMakeCache.txt 2>/dev/null; then
  echo "gpu-check: --no-build needs build-gpu built with -DLLMERGE_CUDA=ON" >&2
  exit 1
fi
if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L; then
  echo "gpu-check: no NVIDIA GPU visible (nvidia-smi -L failed or missing); what llmerge says:" >&2
  # llmerge says why CUDA is not usable (with the driver's and the runtime's CUDA versions)
  if [ $build -eq 0 ] || { cmake -S . -B build-gpu -DLLMERGE_CUDA=ON >/dev/null &&
    cmake --build build-gpu -j"$(nproc)" --target test_cuda_host >/dev/null; }; then
    LLMERGE_TEST_DEVICE=cuda ./build-gpu/test_cuda_host 2>&1 | grep -m1 "device cuda" >&2
  fi
  exit 1
fi

if [ $build -eq 1 ]; then
  step "build with CUDA (build-gpu)"
  cmake -S . -B build-gpu -DLLMERGE_CUDA=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null || exit 1
  # a clean build of the CUDA objects, so that ptxas's spill and local-memory reports
  # (-Xptxas -warn-spills,-warn-lmem-usage) are all in this log
  cmake --build build-gpu --target clean >/dev/null
  cmake --build build-gpu -j"$(nproc)" >build-gpu/build.log 2>&1
  build_rc=$?
  tail -3 build-gpu/build.log
  [ $build_rc -eq 0 ] || exit 1
else
  step "build-gpu as built elsewhere (--no-build)"
fi
echo "ptxas: kernels that spill registers or use local memory (none is the goal):"
if [ ! -r build-gpu/build.log ]; then
  echo "  unknown: no build-gpu/build.log"
else
  grep -iE "ptxas.*(spill|local memory|lmem)" build-gpu/build.log | sort -u || echo "  none"
fi

step "every test, with test_device also on cuda"
# test_cuda_host runs alone, below: --gpu-mem counts what the driver's free memory lost while the
# cuBLAS and cuSOLVER handles were made, which includes what another process took meanwhile
(cd build-gpu && LLMERGE_TEST_DEVICE=cuda ctest --output-on-failure -j4 -E '^test_cuda_host$') || failed+=("ctest")

step "test_cuda_host on cuda, alone on the GPU"
(cd build-gpu && LLMERGE_TEST_DEVICE=cuda ./test_cuda_host) || failed+=("test_cuda_host on cuda")

step "test_device on cuda, verbose"
# per operation: how many values were bit-identical to the CPU's and the worst relative error
(cd build-gpu && LLMERGE_TEST_DEVICE=cuda ./test_device 2>&1 | grep -v "(sim:1GiB)" | tail -30) ||
  failed+=("test_device on cuda")

step "end to end on cuda against the cpu (to 1 ulp), with room and with --gpu-mem 1200KiB"
# The CUDA backend keeps 1 MiB of scratch, and the cap also counts what the cuBLAS and cuSOLVER
# handles took and each buffer at the driver's rounding; 1200 KiB leaves too little for the
# fixtures' larger tensors (if not for all), so they fall back for real (cudaMalloc never runs
# out: the cap refuses first).
bash tests/e2e_device.sh build-gpu/llmerge build-gpu/fixtures build-gpu/st_diff 1 \
  --device cuda -- --device cuda --gpu-mem 1200KiB || failed+=("e2e_device on cuda")

step "merges written as adapters (--to-lora) on cuda against the cpu"
# The range finder's products run on cuBLAS, which sums in another order than the CPU, so the
# factors agree with the CPU's to float32 rounding, not bit for bit (on cuda-emu they are
# identical: e2e_lora). Compared is what an adapter does: the same rank for every matrix, and the
# adapter merged back onto its base in float32 on the CPU within 1e-4 of each tensor's largest
# value. Each merge runs on the CPU, on cuda, and on cuda with --gpu-mem 1200KiB, under which
# factorisations fall back (said on the output).
fx=build-gpu/fixtures
lora=$(mktemp -d /tmp/gpu-check-lora-XXXXXX)
lora_failed=0
lora_bad() { echo "FAIL: $*" >&2; lora_failed=1; }
# lora_ranks DIR: every changed tensor's name and rank (or "whole"), one per line
lora_ranks() {
  local n i t
  n=$(./build-gpu/jsonq "$1/llmerge.json" outputs.adapter.tensors.#) && [ "$n" -gt 0 ] || return 1
  for ((i = 0; i < n; i++)); do
    t=outputs.adapter.tensors.$i
    echo "$(./build-gpu/jsonq "$1/llmerge.json" $t.name)" \
      "$(./build-gpu/jsonq "$1/llmerge.json" $t.rank 2>/dev/null || ./build-gpu/jsonq "$1/llmerge.json" $t.as)"
  done
}
# lora_same NAME BASE LLMERGE-ARGS...: the adapter on cuda does what the CPU's does
lora_same() {
  local name=$1 base=$2 label
  shift 2
  for label in cpu cuda small; do
    local dev=(--device "$label")
    [ $label = small ] && dev=(--device cuda --gpu-mem 1200KiB)
    if ! ./build-gpu/llmerge "$@" -o "$lora/$name-$label" --dtype f32 "${dev[@]}" >"$lora/$name-$label.err" 2>&1 ||
      ! ./build-gpu/llmerge task-arithmetic "$base" "$lora/$name-$label" -o "$lora/$name-$label-back" --dtype f32 \
        --device cpu -q >>"$lora/$name-$label.err" 2>&1; then
      lora_bad "$name on $label: $(head -c 600 "$lora/$name-$label.err")"
      return
    fi
    [ $label = cuda ] && grep -q "fallback: " "$lora/$name-$label.err" &&
      lora_bad "$name on cuda fell back: $(grep fallback "$lora/$name-$label.err" | head -3)"
    [ $label = small ] && ! grep -q "fallback: --to-lora: the factors of" "$lora/$name-$label.err" &&
      lora_bad "$name with --gpu-mem 1200KiB: no factorisation fell back: $(tail -3 "$lora/$name-$label.err")"
    [ $label = cpu ] && continue
    local r_cpu r_dev
    r_cpu=$(lora_ranks "$lora/$name-cpu") && r_dev=$(lora_ranks "$lora/$name-$label") && [ "$r_cpu" = "$r_dev" ] ||
      lora_bad "$name on $label: other ranks than the cpu's, or none recorded"
    local e_dev e_cpu
    e_dev=$(./build-gpu/jsonq "$lora/$name-$label/llmerge.json" outputs.adapter.error_max)
    e_cpu=$(./build-gpu/jsonq "$lora/$name-cpu/llmerge.json" outputs.adapter.error_max)
    echo "$name on $label: worst error $e_dev, on the cpu $e_cpu; merged back:"
    ./build-gpu/st_diff --ulps 64 --rel 1e-4 "$lora/$name-cpu-back/model.safetensors" \
      "$lora/$name-$label-back/model.safetensors" || lora_bad "$name on $label, merged back, differs from the cpu's"
  done
}
lora_same extract "$fx/base" extract "$fx/base" "$fx/ft_full" --rank 8
lora_same extract-qwen "$fx/qwen" extract "$fx/qwen" "$fx/qwen_ft" --rank 8
lora_same ties-energy "$fx/base" ties "$fx/base" "$fx/lora_plain" "$fx/lora_rslora" "$fx/ft_full" --to-lora 16 \
  --to-lora-energy 0.9
rm -rf "$lora"
[ $lora_failed -eq 0 ] || failed+=("--to-lora on cuda")

step "the forward pass on cuda against the cpu: llmerge eval and llmerge hessian on the fixtures"
# Every token must run on the GPU (no fallback). The perplexity agrees to 1e-4 relative; each
# Hessian entry to 64 ulp or, for entries that are small differences of large terms, to 1e-4 of
# its tensor's largest entry (float32 rounding of the sums' terms; a wrong kernel is off by far
# more). The fixtures cover packed sequences, GQA (llama3: 4 query heads on 1 KV head, head_dim
# 24, llama3 rope scaling), biases (qwen with lora_bias) and an adapter applied at run time.
fx=build-gpu/fixtures data=build-gpu/fixtures/calib/calib.jsonl
fwd=$(mktemp -d /tmp/gpu-check-fwd-XXXXXX)
fwd_failed=0
fwd_bad() { echo "FAIL: $*" >&2; fwd_failed=1; }
# eval_same NAME MODEL-ARGS...
eval_same() {
  local name=$1 pc pg
  shift
  if ! ./build-gpu/llmerge eval "$@" --data "$data" --device cpu --json >"$fwd/$name-cpu.json" 2>"$fwd/err" ||
    ! ./build-gpu/llmerge eval "$@" --data "$data" --device cuda --json >"$fwd/$name-cuda.json" 2>"$fwd/err"; then
    fwd_bad "eval $name: $(head -c 600 "$fwd/err")"
    return
  fi
  grep -q "fallback" "$fwd/err" && fwd_bad "eval $name on cuda fell back: $(grep fallback "$fwd/err" | head -3)"
  [ "$(./build-gpu/jsonq "$fwd/$name-cuda.json" tokens_on_cpu)" = 0 ] ||
    fwd_bad "eval $name on cuda: tokens ran on the cpu: $(cat "$fwd/$name-cuda.json")"
  pc=$(./build-gpu/jsonq "$fwd/$name-cpu.json" perplexity) pg=$(./build-gpu/jsonq "$fwd/$name-cuda.json" perplexity)
  if awk -v a="$pg" -v b="$pc" 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(b > 0 && d <= 1e-4 * b) }'; then
    echo "eval $name: perplexity $pg on cuda, $pc on the cpu"
  else
    fwd_bad "eval $name: perplexity $pg on cuda, $pc on the cpu (beyond 1e-4 relative)"
  fi
}
# hessian_same NAME MODEL-ARGS...
hessian_same() {
  local name=$1
  shift
  if ! ./build-gpu/llmerge hessian "$@" --calib "$data" -o "$fwd/$name-cpu.safetensors" --device cpu -q \
    2>"$fwd/err" ||
    ! ./build-gpu/llmerge hessian "$@" --calib "$data" -o "$fwd/$name-cuda.safetensors" --device cuda 2>"$fwd/err"; then
    fwd_bad "hessian $name: $(head -c 600 "$fwd/err")"
    return
  fi
  grep -q "fallback" "$fwd/err" && fwd_bad "hessian $name on cuda fell back: $(grep fallback "$fwd/err" | head -3)"
  grep -q "tokens/s) on cuda" "$fwd/err" || fwd_bad "hessian $name did not capture on cuda: $(tail -3 "$fwd/err")"
  echo "hessian $name:"
  ./build-gpu/st_diff --ulps 64 --rel 1e-4 "$fwd/$name-cpu.safetensors" "$fwd/$name-cuda.safetensors" ||
    fwd_bad "hessian $name on cuda differs from the cpu's"
}
eval_same base "$fx/base"
eval_same base-lora "$fx/base" --adapter "$fx/lora_plain"
eval_same qwen-bias "$fx/qwen" --adapter "$fx/lora_bias"
eval_same llama3 "$fx/llama3"
hessian_same base "$fx/base"
hessian_same base-lora "$fx/base" --adapter "$fx/lora_plain"
hessian_same qwen-bias "$fx/qwen" --adapter "$fx/lora_bias"
hessian_same llama3 "$fx/llama3"
rm -rf "$fwd"
[ $fwd_failed -eq 0 ] || failed+=("eval and hessian on cuda")

step "auto picks the GPU"
./build-gpu/llmerge ties build-gpu/fixtures/base build-gpu/fixtures/lora_plain -o /tmp/gpu-check-auto \
  --force --device auto 2>&1 | grep -E "device auto|devices:" || failed+=("auto")
rm -rf /tmp/gpu-check-auto

if [ $bench -eq 1 ]; then
  # 300 MiB holds the three adapters' factors (135 MB) and the working set of every tensor but the
  # MLP projections and the embeddings (about 350 MB each), which fall back: 49 of 146 tensors.
  step "benchmark: the 1B-shape merges on cuda (bench_merge --device cuda --fallback-mem 300MiB)"
  ./build-gpu/bench_merge --device cuda --fallback-mem 300MiB || failed+=("bench_merge")
  # the model bench_merge generated: capture tokens/s against cuBLAS's SGEMM peak on the device,
  # measured in the same run (target >= 40%)
  step "benchmark: activation capture on cuda (bench_capture --device cuda)"
  ./build-gpu/bench_capture --device cuda --seqs 8 --len 512 || failed+=("bench_capture")
  # four times the tokens: how much of the capture's time is a fixed cost of the run
  ./build-gpu/bench_capture --device cuda --seqs 32 --len 512 || failed+=("bench_capture")
  # the methods with a time target against their reference method, and merges written as
  # adapters (the factorisation's products on cuBLAS, its small decompositions on the host)
  step "benchmark: the mergekit methods and --to-lora on cuda (bench_methods --device cuda)"
  ./build-gpu/bench_methods --device cuda --rounds 1 \
    --methods slerp,breadcrumbs,della,extract-r16,extract-r64,ties-to-lora-r64 || failed+=("bench_methods")
  # where the time of the merges that miss their targets on the GPU goes: each device operation
  # waited for, counted and timed (LLMERGE_PROFILE, docs/devices.md), the host's time the rest
  step "profiles on cuda: ties, task-arithmetic and della of the three adapters (LLMERGE_PROFILE=1)"
  w=/tmp/llmerge-bench-merge
  if [ ! -d $w/lora3 ]; then
    echo "skipped: no inputs in $w (bench_merge generates them)"
  else
    for m in ties task-arithmetic della; do
      echo "llmerge $m base + 3 adapters:"
      LLMERGE_PROFILE=1 ./build-gpu/llmerge $m $w/base $w/lora1 $w/lora2 $w/lora3 -o /tmp/gpu-check-prof \
        --device cuda --force -q >/tmp/gpu-check-prof.log 2>&1 || failed+=("profile of $m")
      cat /tmp/gpu-check-prof.log
    done
    rm -rf /tmp/gpu-check-prof /tmp/gpu-check-prof.log
  fi

  # Another process holds all of the GPU but 1.2 GB (a PyTorch tensor of the rest): merges of the
  # 1B-shape inputs must finish, each unit that finds no room falling back to the CPU, none dying
  # of it. Needs python3 with torch (skipped, and said, without).
  step "the GPU nearly full: merges of the 1B-shape inputs while another process holds it"
  w=/tmp/llmerge-bench-merge
  if ! python3 -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then
    echo "skipped: no python3 with torch and CUDA to hold the GPU"
  elif [ ! -d $w/ft1 ] || [ ! -d $w/lora1 ]; then
    echo "skipped: no inputs in $w (bench_merge generates them)"
  else
    rm -f /tmp/gpu-check-hold
    python3 - <<'PY' &
import time, torch
free, total = torch.cuda.mem_get_info()
held = torch.empty(free - (1200 << 20), dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
open("/tmp/gpu-check-hold", "w").write("%d MiB free of %d MiB" % (torch.cuda.mem_get_info()[0] >> 20, total >> 20))
time.sleep(600)
PY
    hold=$!
    trap 'kill $hold 2>/dev/null' EXIT
    for _ in $(seq 120); do
      [ -s /tmp/gpu-check-hold ] || ! kill -0 $hold 2>/dev/null && break
      sleep 0.5
    done
    full_failed=0 held=1
    if [ ! -s /tmp/gpu-check-hold ]; then
      echo "FAIL: the other process could not hold the GPU; the merges were not run" >&2
      full_failed=1 held=0
    else
      echo "held by another process: $(cat /tmp/gpu-check-hold)"
    fi
    while [ $held -eq 1 ] && read -r args; do
      # shellcheck disable=SC2086  # the arguments split on spaces
      if ./build-gpu/llmerge $args -o /tmp/gpu-check-full --device cuda --force >/tmp/gpu-check-full.log 2>&1; then
        echo "llmerge $args: done; $(grep -c "fallback: " /tmp/gpu-check-full.log) fallbacks;" \
          "$(grep -m1 "devices:" /tmp/gpu-check-full.log | sed 's/.*devices: //')"
      else
        echo "FAIL: llmerge $args with the GPU nearly full: $(tail -3 /tmp/gpu-check-full.log)" >&2
        full_failed=1
      fi
    done <<EOF2
extract $w/base $w/ft1 --rank 16
ties $w/base $w/lora1 $w/lora2 $w/lora3 --to-lora 64
ties $w/base $w/ft1 $w/ft2 $w/ft3
slerp $w/base $w/ft1 --t 0.3
della $w/base $w/ft1 $w/ft2 $w/ft3
EOF2
    # the merges ran against a GPU still held
    if [ $held -eq 1 ] && ! kill -0 $hold 2>/dev/null; then
      echo "FAIL: the process holding the GPU ended before the merges did" >&2
      full_failed=1
    fi
    kill $hold 2>/dev/null
    wait $hold 2>/dev/null
    trap - EXIT
    rm -rf /tmp/gpu-check-full /tmp/gpu-check-full.log /tmp/gpu-check-hold
    [ $full_failed -eq 0 ] || failed+=("the GPU nearly full")
  fi
fi

# PEFT itself loads llmerge's adapters as llmerge merges them (needs python3 with torch,
# transformers and peft; skipped, and said, without)
step "PEFT loads the adapters llmerge writes (scripts/peft-check.py)"
if python3 -c "import torch, transformers, peft, safetensors" 2>/dev/null; then
  python3 scripts/peft-check.py build-gpu/llmerge build-gpu/fixtures 2>&1 | grep -v "Loading weights" ||
    failed+=("peft-check")
else
  echo "skipped: no python3 with torch, transformers, peft and safetensors"
fi

step "summary"
if [ ${#failed[@]} -eq 0 ]; then
  echo "gpu-check: all passed"
else
  echo "gpu-check: FAILED: ${failed[*]}"
  exit 1
fi
