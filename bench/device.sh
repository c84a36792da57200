#!/usr/bin/env bash
# One prepared run for a machine with more cores (and a GPU, where one is at hand), within
# about 10 minutes: `make bench`'s 32-client cells with each stage on cores of its own
# (bench/layout.py: a third of the cores each for the peer and the local stage, the rest for
# Ray, the HTTP path and the load client), against llama-server pinned the same way; then,
# where nvcc and a GPU exist, the CUDA build and the engine's tests on the GPU (a CUDA build
# puts every layer of an engine without `devices` on CUDA0).
#
#   bash bench/device.sh            # figures in bench/results/device/ (or $OUT when set)
#   ONLY="groups 2" bash bench/device.sh
#
# Each phase prints its wall time; a phase that fails does not stop the next.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-bench/results/device}"
mkdir -p "$out"
only="${ONLY:-32 clients}"
log() { echo "[device $(date +%T)] $*" | tee -a "$out/device.log"; }
phase() {  # name, command...
  local name="$1" t0 rc
  shift
  t0=$(date +%s)
  log "$name: start"
  "$@" >"$out/$name.log" 2>&1
  rc=$?
  log "$name: rc $rc in $(( $(date +%s) - t0 )) s"
  tail -n 40 "$out/$name.log"
  return $rc
}
log "$(nproc) cores; $(nvidia-smi -L 2>/dev/null | head -1 || echo 'no GPU')"

# 1. CPU build (the wheel and llama-server from the same sources), then the bench
phase cpu-build make install model-synthetic llama-server GGML_CUDA=off
phase bench env GGML_CUDA=off make bench BENCH_ARGS="--only '$only' --out $out" GGML_CUDA=off

# 2. CUDA: the build and the engine's tests on the GPU
if command -v nvcc >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  phase cuda-build env CUDAARCHS=native make install GGML_CUDA=on
  phase gpu-tests .venv/bin/python -m pytest tests/test_engine.py tests/test_split.py tests/test_pipeline_groups.py \
    -m "not e2e" -q -x -p no:cacheprovider
fi
log "done: $out"
