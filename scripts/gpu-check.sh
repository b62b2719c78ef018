#!/usr/bin/env bash
# One command for a machine with an NVIDIA GPU: builds llmerge with CUDA, runs the whole test
# suite with the CUDA device under test as well (test_device compares every device operation on
# cuda against the CPU), runs the end-to-end device comparison on cuda with room and with a
# small --gpu-mem that forces real CUDA out-of-memory fallbacks, and prints the GPU benchmark
# table (bench_merge --device cuda). Exit status 0 only when every step passed.
#
#   scripts/gpu-check.sh [--no-bench]
set -uo pipefail
cd "$(dirname "$0")/.."
bench=1
[ "${1:-}" = "--no-bench" ] && bench=0

step() { printf '\n==== %s\n' "$*"; }
failed=()

step "setup"
bash scripts/bootstrap.sh || exit 1
if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L; then
  echo "gpu-check: no NVIDIA GPU visible (nvidia-smi -L failed)" >&2
  exit 1
fi

step "build with CUDA (build-gpu)"
cmake -S . -B build-gpu -DLLMERGE_CUDA=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null || exit 1
cmake --build build-gpu -j"$(nproc)" 2>&1 | tail -3
[ "${PIPESTATUS[0]}" -eq 0 ] || exit 1

step "every test, with test_device also on cuda"
(cd build-gpu && LLMERGE_TEST_DEVICE=cuda ctest --output-on-failure -j4) || failed+=("ctest")

step "test_device on cuda, verbose"
(cd build-gpu && LLMERGE_TEST_DEVICE=cuda ./test_device | tail -20) || failed+=("test_device on cuda")

step "end to end on cuda against the cpu (to 1 ulp), with room and with --gpu-mem 1200KiB"
# The CUDA backend keeps 1 MiB of scratch; 1200 KiB leaves too little for the fixtures' larger
# tensors, so they fall back for real (cudaMalloc never runs out: the cap refuses first).
bash tests/e2e_device.sh build-gpu/llmerge build-gpu/fixtures build-gpu/st_diff 1 \
  --device cuda -- --device cuda --gpu-mem 1200KiB || failed+=("e2e_device on cuda")

step "auto picks the GPU"
./build-gpu/llmerge ties build-gpu/fixtures/base build-gpu/fixtures/lora_plain -o /tmp/gpu-check-auto \
  --force --device auto 2>&1 | grep -E "device auto|devices:" || failed+=("auto")
rm -rf /tmp/gpu-check-auto

if [ $bench -eq 1 ]; then
  # 300 MiB holds the three adapters' factors (135 MB) and the working set of every tensor but the
  # MLP projections and the embeddings (about 350 MB each), which fall back: 49 of 146 tensors.
  step "benchmark: the 1B-shape merges on cuda (bench_merge --device cuda --fallback-mem 300MiB)"
  ./build-gpu/bench_merge --device cuda --fallback-mem 300MiB || failed+=("bench_merge")
fi

step "summary"
if [ ${#failed[@]} -eq 0 ]; then
  echo "gpu-check: all passed"
else
  echo "gpu-check: FAILED: ${failed[*]}"
  exit 1
fi
