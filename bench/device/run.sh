#!/usr/bin/env bash
# One-shot GPU run for a machine without network: the CUDA build of llama-cpp-python, the
# engine's tests on the GPU, and pipeline groups 1 vs 2 with the local stage on CUDA0.
#
#   bash bench/device/bundle.sh     # first, on a machine that reaches PyPI: writes .device-bundle/
#   bash bench/device/run.sh        # then on the GPU machine, from the repo root, with
#                                   # .device-bundle/ carried along; logs in $OUT
#
# Phases: env, wheels, cuda-build, install, model, probe-load, gpu-tests, bench-gpu-peer,
# bench-cpu-peer. Each phase logs its start, rc and seconds to $OUT/device.log; a failing phase
# does not stop the next. The whole run keeps within BUDGET seconds (default 480): each phase's
# timeout is cut to what is left. A rerun on the same (warm) machine reuses the build dir in
# build/.
#
# Seen on an H200 (CUDA 13, sm_90): the build takes 220 to 270 s on 16 cores; Model and Engine
# construct with every layer on CUDA0 in a plain process, but under pytest
# (tests/test_engine.py) and in gpu_bench.py the process died of SIGSEGV inside
# llama_model_load_from_file. probe-load (bench/device/probe_load.py) tells the suspects apart.
set -uo pipefail
REPO=$(pwd)
B="$REPO/.device-bundle"                # the bundle: sdist and wheels
D="$REPO/bench/device"                  # these scripts
[ -f "$B/llama_cpp_python-0.3.36.tar.gz" ] || { echo "no $B: run bench/device/bundle.sh first" >&2; exit 1; }
OUT="${OUT:-/tmp/device-out}"
mkdir -p "$OUT"
T0=$(date +%s)
BUDGET=${BUDGET:-480}
WORK="$REPO/build/device-lcp"          # ignored path: survives between calls on a warm machine
SRC="$WORK/src/llama_cpp_python-0.3.36"
WHEELS="$WORK/wheels"
SITE=${SITE:-/tmp/site}
export PYTHONPATH="$SITE:$REPO"
export PYTHONUNBUFFERED=1
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
export REPO B D OUT WORK SRC WHEELS SITE

log() { echo "[device $(date +%T) +$(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/device.log"; }
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
# the smaller of a phase's own limit and what is left minus a reserve for the later phases
limit() { local want=$1 reserve=$2 l; l=$(( $(left) - reserve )); (( l > want )) && l=$want; (( l < 20 )) && l=20; echo $l; }
phase() {  # name, timeout_s, command...
  local name=$1 to=$2 t0 rc
  shift 2
  t0=$(date +%s)
  log "$name: start (timeout ${to}s)"
  # through bash -c so that a phase can be one of the (exported) functions below
  timeout -k 10 "$to" bash -c '"$@"' "$name" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  log "$name: rc $rc in $(( $(date +%s) - t0 ))s$([ $rc = 124 ] && echo ' (TIMED OUT)')"
  return $rc
}

# ---- env: what the machine is -----------------------------------------------------------------
for d in /usr/local/cuda/bin /usr/local/cuda-13/bin /usr/local/cuda-13.0/bin; do
  [ -x "$d/nvcc" ] && { export PATH="$d:$PATH"; break; }
done
if command -v nvcc >/dev/null; then
  export CUDACXX=$(command -v nvcc)
  CUDA_HOME=$(dirname "$(dirname "$(readlink -f "$CUDACXX")")")
  export LD_LIBRARY_PATH="$CUDA_HOME/lib64:$CUDA_HOME/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}"
fi
env_info() {
  nvidia-smi -L; nvcc --version | tail -2; python3 -VV; ldd --version | head -1; nproc; uname -r
  cmake --version | head -1; ninja --version
  python3 -c "import scikit_build_core, numpy, jinja2, pytest, hypothesis; print('skbuild', scikit_build_core.__version__, 'numpy', numpy.__version__)"
  grep -m1 'model name' /proc/cpuinfo; grep -o -w 'amx[a-z_0-9]*\|avx512f\|avx2' /proc/cpuinfo | sort | uniq -c
  echo "/proc/net/tcp readable: $(head -1 /proc/net/tcp 2>&1 | cut -c1-60)"  # the RPC launch polls it
  df -h /tmp | tail -1
}
export -f env_info
phase env 60 env_info
cat "$OUT/env.log" >> "$OUT/device.log"

# ---- wheels: the pure-Python packages the engine's tests import that the image lacks ----------
phase wheels 120 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target "$SITE" "$B"/whl/*.whl

# the bench's model (526 MB of random q8_0 weights, ~20 s of one core) is written meanwhile
( t=$(date +%s); timeout 200 python3 "$D/gpu_bench.py" --write-model; echo "rc $? in $(( $(date +%s) - t ))s" ) \
  >"$OUT/bench-model.log" 2>&1 &
BENCH_MODEL_PID=$!

# ---- cuda-build: the llama-cpp-python wheel with CUDA (sm_90) and RPC -------------------------
# x86-64 instruction sets as the Makefile picks them: those /proc/cpuinfo lists, never AMX
# (-march=native would compile ggml's AMX kernels where the CPU lists AMX, and a VM that lists
# it without granting it dies of SIGILL on the first quantised matmul).
has() { grep -q -w "$1" /proc/cpuinfo && echo ON || echo OFF; }
CPU_FLAGS="-DGGML_NATIVE=OFF -DGGML_AVX=$(has avx) -DGGML_AVX2=$(has avx2) -DGGML_FMA=$(has fma) \
-DGGML_F16C=$(has f16c) -DGGML_BMI2=$(has bmi2) -DGGML_AVX512=$(has avx512f) \
-DGGML_AVX512_VBMI=$(has avx512vbmi) -DGGML_AVX512_VNNI=$(has avx512_vnni) \
-DGGML_AVX512_BF16=$(has avx512_bf16) -DGGML_AVX_VNNI=$(has avx_vnni) \
-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
# Build-time cuts: one real arch (no PTX), FlashAttention vec kernels for the f16 KV cache only
# (the engine never sets a quantised cache type; FA itself stays on: EngineConfig.flash_attn
# defaults to True and GGML_CUDA_FA=off would push attention to the CPU), no NCCL, no OpenSSL.
export CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCH:-90-real} -DGGML_CUDA_FA_QUANTS=f16-f16 \
-DGGML_CUDA_NCCL=OFF -DGGML_RPC=on -DLLAVA_BUILD=off -DLLAMA_CURL=off -DLLAMA_OPENSSL=off \
-DLLAMA_BUILD_TESTS=off -DLLAMA_BUILD_EXAMPLES=off -DLLAMA_BUILD_TOOLS=off $CPU_FLAGS"
export CMAKE_BUILD_PARALLEL_LEVEL=$(nproc)
build() {
  echo "CMAKE_ARGS=$CMAKE_ARGS"
  ls "$WHEELS"/llama_cpp_python-*.whl 2>/dev/null && { echo "wheel already built"; return 0; }
  if [ ! -f "$SRC/pyproject.toml" ]; then   # unpacked once: fresh mtimes would rebuild all
    mkdir -p "$WORK/src" && tar xzf "$B/llama_cpp_python-0.3.36.tar.gz" -C "$WORK/src" || return 1
  fi
  python3 -m pip wheel -v --no-index --no-build-isolation --no-deps --no-cache-dir \
    -C build-dir="$WORK/build" "$SRC" -w "$WHEELS" >"$WORK/build-full.log" 2>&1
  local rc=$?
  grep -n -i -E "error|FAILED|warning: .*nvcc" "$WORK/build-full.log" | head -60
  echo "---- last 150 lines"; tail -n 150 "$WORK/build-full.log"
  return $rc
}
export -f build
phase cuda-build "$(limit 400 120)" build
tail -n 5 "$OUT/cuda-build.log" | sed 's/^/    /' | tee -a "$OUT/device.log"

install_wheel() {
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" "$WHEELS"/llama_cpp_python-*.whl || return 1
  ls -la "$SITE/llama_cpp/lib"
  python3 -c "
from engine.native.library import init_backend
from engine.native.devices import list_devices
init_backend(quiet=False)
for d in list_devices():
    print(d)
assert any(d.name.startswith('CUDA') for d in list_devices(memory=False)), 'no CUDA device'
"
}
export -f install_wheel
phase install 60 install_wheel
tail -n 4 "$OUT/install.log" | sed 's/^/    /' | tee -a "$OUT/device.log"

# ---- model: the tests' synthetic model (tests/models/synthetic.py writes it; no download) -----
phase model 60 python3 -m tests.models
wait "$BENCH_MODEL_PID"; log "bench-model: $(tail -n 2 "$OUT/bench-model.log" | tr '\n' ' ')"

# ---- probe-load: the first probe. One fresh process per suspect of the SIGSEGV seen at model
# load (a second load, the page release, thread stacks, pytest's capture, the log callback, an RPC
# device, the engine's ggml calls first); the first that crashes is rerun under gdb -----------
phase probe-load "$(limit 240 60)" python3 "$D/probe_load.py" --out "$OUT" --timeout 60
tail -n 1 "$OUT/probe-load.log" | cut -c1-2000 | tee -a "$OUT/device.log"
if ! grep -q '"probe": "plain", "rc": 0' "$OUT/probe-load.log"; then
  if grep -q '"probe": "second-load-stderr-log", "rc": 0' "$OUT/probe-load.log"; then
    export PGROUPS_LLAMA_LOG=stderr; log "tests with PGROUPS_LLAMA_LOG=stderr"
  else log "the plain load crashes: tests and bench skipped"; exit 0; fi
fi

# ---- gpu-tests: the engine's tests, every layer on CUDA0 (a CUDA build puts every layer of an
# engine without `devices` there) ------------------------------------------------------------
phase gpu-tests "$(limit 240 80)" python3 -m pytest tests -m "gpu and not e2e" -q -x -p no:cacheprovider \
  -o addopts="" -ra --durations=10
tail -n 15 "$OUT/gpu-tests.log" | sed 's/^/    /' | tee -a "$OUT/device.log"

# ---- bench: pipeline groups 1 vs 2 on the engine, the local stage on CUDA0 ---------------------
# peer = an RPC server on the same GPU, then one on the CPU (4 threads)
phase bench-gpu-peer "$(limit 150 40)" python3 "$D/gpu_bench.py" --peer gpu --repeats 2 --out "$OUT"
tail -n 6 "$OUT/bench-gpu-peer.log" | sed 's/^/    /' | tee -a "$OUT/device.log"
phase bench-cpu-peer "$(limit 120 5)" python3 "$D/gpu_bench.py" --peer cpu --repeats 1 --out "$OUT"
tail -n 4 "$OUT/bench-cpu-peer.log" | sed 's/^/    /' | tee -a "$OUT/device.log"
cat "$OUT"/bench-*-peer.log > "$OUT/gpu-bench.log" 2>/dev/null

log "done in $(( $(date +%s) - T0 ))s; logs in $OUT"
