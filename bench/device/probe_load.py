"""Which step of a model load on a GPU crashes: one fresh process per suspect, in order, each
loading the synthetic model a different way; the first that dies is run again under gdb for a
native backtrace. bench/device/run.sh runs it first of its probes, after the CUDA build.

    python3 bench/device/probe_load.py [--model models/synthetic.gguf] [--out DIR]

Seen on an H200 (CUDA 13): a plain process loaded the model on CUDA0, while pytest and
gpu_bench.py died of SIGSEGV inside ``llama_model_load_from_file``. What those do that the plain
process did not is each one probe here: a second load after a first model was freed (the
tests build engine after engine), two models alive at once, the page release of the layers
CUDA holds (engine/native/page_cache.py) before the next load, the engine's 64 MiB thread stacks,
pytest's capture and faulthandler around the load, the log callback against llama.cpp's own
stderr log, an RPC device in the device list, and the engine's own ggml calls before a load
(until this probe's version, engine/native/library.py opened a second copy of ggml's libraries there:
the wheel's ``libggml.so`` beside the ``libggml.so.0`` libllama links, a second device
registry in the process; gpu_bench.py went through it, the plain process did not). Each prints one JSON line
(``{"probe", "rc", "signal", "seconds", "tail"}``); the last line names the verdict.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

LOAD = "from engine.native.model import Model\n"
# name -> (python source, extra environment); {m} is the model's path
PROBES: list[tuple[str, str, dict[str, str]]] = [
    ("plain", LOAD + "m = Model('{m}'); print('loaded', m.layer_devices.get(m.n_layer))", {}),
    ("llama-cpp-python", "import llama_cpp\nm = llama_cpp.Llama('{m}', n_gpu_layers=-1, n_ctx=256, verbose=False)\n"
     "print('loaded', m.tokenize(b'hi'))", {}),
    ("second-load", LOAD + "Model('{m}').close()\nm = Model('{m}'); print('loaded twice')", {}),
    ("second-load-no-release", LOAD + "Model('{m}', release_offloaded=False).close()\n"
     "m = Model('{m}', release_offloaded=False); print('loaded twice, pages kept')", {}),
    ("two-alive", LOAD + "a = Model('{m}')\nb = Model('{m}'); print('two alive')", {}),
    ("device-list-first", "from engine.native.model import Model\nfrom engine.native.devices import list_devices\nprint([d.name for d in list_devices()])\n"
     "Model('{m}').close()\nm = Model('{m}'); print('loaded twice after the engine read the devices')", {}),
    ("thread-stack", "import threading\nthreading.stack_size(64 << 20)\n" + LOAD + "Model('{m}'); print('loaded')", {}),
    ("engine-twice", "from engine import Engine, EngineConfig\n"
     "for _ in range(2):\n    e = Engine(EngineConfig(model='{m}', n_threads=1, n_parallel=2)); e.close()\n"
     "print('two engines')", {}),
    ("second-load-stderr-log", LOAD + "Model('{m}').close()\nm = Model('{m}'); print('loaded twice')",
     {"PGROUPS_LLAMA_LOG": "stderr"}),
    ("rpc-device", "from deployments.stage import server\n"
     "from engine.native.model import Model\nfrom engine.native.devices import add_rpc_server, local_device_name\n"
     "p = server.launch('127.0.0.1', 50199, threads=1)\n"
     "try:\n    add_rpc_server('127.0.0.1:50199')\n"
     "    m = Model('{m}', devices=['RPC0', local_device_name()], tensor_split=[1.0, 2.0])\n"
     "    print('split', m.layer_devices)\n    m.close()\n"
     "finally:\n    p.kill()", {}),
]
PYTEST = [("pytest-capture", ["-q", "-x", "-p", "no:cacheprovider", "-o", "addopts="]),
          ("pytest-no-capture", ["-q", "-x", "-s", "-p", "no:cacheprovider", "-p", "no:faulthandler", "-o", "addopts="])]
PYTEST_TESTS = ["tests/test_engine.py::test_greedy_is_deterministic", "tests/test_engine.py::test_max_tokens_gives_length"]


def run(name: str, argv: list[str], env: dict[str, str], timeout_s: float) -> dict:
    t0 = time.monotonic()
    try:
        p = subprocess.run(argv, cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True,
                           timeout=timeout_s)
        rc, out = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        rc, out = 124, (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
    sig = signal.Signals(-rc).name if rc < 0 else ("SIGSEGV" if rc == 139 else None)
    lines = [x for x in out.splitlines() if x.strip() and not x.startswith(("llama_model_loader: - ", "print_info"))]
    return {"probe": name, "rc": rc, "signal": sig, "seconds": round(time.monotonic() - t0, 1), "tail": lines[-12:]}


def backtrace(argv: list[str], env: dict[str, str], timeout_s: float) -> list[str]:
    gdb = shutil.which("cuda-gdb") or shutil.which("gdb")
    if gdb is None:
        return ["no gdb on this machine"]
    try:
        p = subprocess.run([gdb, "-q", "-batch", "-ex", "run", "-ex", "bt 40", "-ex", "info threads", "--args", *argv],
                           cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, timeout=timeout_s)
        out = p.stdout + p.stderr
    except subprocess.TimeoutExpired:
        return ["gdb timed out"]
    keep = [x for x in out.splitlines() if x.startswith(("#", "Thread", "*", "  ")) or "signal" in x.lower()]
    return keep[-80:]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="models/synthetic.gguf")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    ap.add_argument("--timeout", type=float, default=90.0)
    a = ap.parse_args()
    py = [sys.executable, "-X", "faulthandler"]
    cases = [(name, [*py, "-c", src.format(m=a.model)], env) for name, src, env in PROBES]
    cases += [(name, [sys.executable, "-m", "pytest", *flags, *PYTEST_TESTS], {}) for name, flags in PYTEST]
    results = []
    out = Path(a.out) / "probe-load.jsonl"
    for name, argv, env in cases:
        r = run(name, argv, env, a.timeout)
        results.append(r)
        print(json.dumps(r), flush=True)
        with out.open("a") as f:
            f.write(json.dumps(r) + "\n")
    crashed = [r["probe"] for r in results if r["rc"] != 0]
    verdict = {"verdict": "every probe loaded" if not crashed else f"crashed: {', '.join(crashed)}",
               "loaded": [r["probe"] for r in results if r["rc"] == 0]}
    if crashed:
        name, argv, env = next(c for c in cases if c[0] == crashed[0])
        verdict["backtrace_of"] = name
        verdict["backtrace"] = backtrace(argv, env, a.timeout + 60)
    print(json.dumps(verdict), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
