#!/usr/bin/env bash
# Writes .device-bundle/ (git-ignored) for bench/device/run.sh, on a machine that reaches PyPI:
# the llama-cpp-python sdist trimmed to what the CUDA build needs, and the cp312 wheels of the
# pure-Python packages the engine's tests import that the GPU machine's image lacks (it has no
# network). Run from the repo root:
#
#   bash bench/device/bundle.sh            # BUNDLE=DIR to write elsewhere
set -euo pipefail
VERSION=0.3.36
B="${BUNDLE:-.device-bundle}"
WHEELS=(annotated-types==0.8.0 diskcache==5.6.3 gguf==0.19.0 llguidance==1.9.1 pydantic==2.14.4
        pydantic-core==2.50.5 tqdm==4.70.1 typing-extensions==4.16.0 typing-inspection==0.4.5
        nvidia-ml-py==13.615.71)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$B/whl"

# the sdist, less what the build does not read (models, docs, tests, tools other than the
# library's, the Python side of llama.cpp): 77 MB down to about 7 MB
python3 -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$tmp"
tar xzf "$tmp/llama_cpp_python-$VERSION.tar.gz" -C "$tmp"
src="$tmp/llama_cpp_python-$VERSION"
(cd "$src/vendor/llama.cpp" && rm -rf models docs tests benches examples pocs media gguf-py \
  conversion scripts skills requirements requirements.txt ci .github .devops .git convert_*.py \
  tools/ui tools/server app)
(cd "$src" && rm -rf docs examples tests docker .git .github)
tar czf "$B/llama_cpp_python-$VERSION.tar.gz" -C "$tmp" "llama_cpp_python-$VERSION"

python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$B/whl" "${WHEELS[@]}"

du -sh "$B"
