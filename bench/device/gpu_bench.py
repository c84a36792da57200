"""Pipeline groups 1 vs 2 straight on the engine (no Ray, no HTTP), with the local stage on the
GPU: bench/run.py's ``engine_cell`` with its ``devices()`` pointed at CUDA0 instead of CPU.

    python3 bench/device/gpu_bench.py [--quick] [--repeats 2] [--peer gpu|cpu] [--out DIR]

One peer kind per process: ggml names each RPC server's devices RPC0, RPC1... counting from 0
per server, so a second server registered in the same process would be a second "RPC0".
Peer: ``gpu`` is the RPC server's default device (the first GPU: both stages then share the
one H200, the peer over loopback RPC); ``cpu`` is an RPC server on the CPU device
(``--cpu-threads`` threads). The split is fixed at half the layers on the peer (tensor_split
[n/2, n/2 + 1], llama.cpp counts the output layer as one more), so no balance pass runs.
Each cell prints one JSON line as soon as it ends (a timeout keeps what was done).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.models.synthetic import ModelShape, write_model  # noqa: E402

LOCAL = os.environ.get("LOCAL_DEVICE", "CUDA0")
# bench/run.py's FULL shape and model path, so that the model can be written before llama_cpp is
# installed (importing bench.run imports the engine); main() checks that they still agree
FULL_SHAPE = ModelShape(n_layer=16, n_embd=1024, n_head=16, n_head_kv=4, n_ff=2816, n_vocab=151936,
                        ftype="q8_0", seed=11)


class BusySampler:
    """NVML's busy share of each GPU every 0.2 s while a cell runs (observability/gpu.py), its
    mean by GPU at ``stop()``: with the peer's RPC server on the same GPU, both stages' work."""

    def __init__(self) -> None:
        import threading

        from observability.gpu import GpuMeter

        self.meter, self.samples, self.done = GpuMeter(), [], threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.wait(0.2):
            b = self.meter.busy()
            if b is None:
                return
            self.samples.append(b)

    def stop(self) -> dict[str, float] | str:
        self.done.set()
        self.thread.join()
        if not self.samples:
            return self.meter.reason or "no samples"
        return {g: round(sum(s.get(g, 0.0) for s in self.samples) / len(self.samples), 3) for g in self.samples[0]}


def model_path(s: ModelShape) -> Path:
    return ROOT / "models" / f"bench-{s.n_layer}L-{s.n_embd}d-{s.n_vocab}v-{s.ftype}.gguf"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--peer", choices=["gpu", "cpu"], default="gpu")
    ap.add_argument("--cpu-threads", type=int, default=4)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    ap.add_argument("--write-model", action="store_true", help="only write the FULL model, then exit")
    a = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
    if a.write_model:
        t = time.monotonic()
        path = model_path(FULL_SHAPE)
        if not path.exists():
            write_model(path, FULL_SHAPE)
        print(json.dumps({"model": path.name, "write_s": round(time.monotonic() - t, 1)}), flush=True)
        return 0

    import bench.run as br
    from deployments.stage import server as rpc_server

    br.devices = lambda order: ["RPC0", LOCAL] if order == "rpc-first" else [LOCAL, "RPC0"]

    class Peer(br.RpcServer):
        def __init__(self, port: int, devices: list[str] | None, threads: int) -> None:
            self.port = port
            self.proc = rpc_server.launch("127.0.0.1", port, threads=threads, devices=devices)

    if br.FULL.shape != FULL_SHAPE or br.FULL.model != model_path(FULL_SHAPE):
        print("note: bench/run.py's FULL shape changed; the pre-written model is not used", flush=True)
    setup = br.QUICK if a.quick else br.FULL
    t = time.monotonic()
    if not setup.model.exists():
        write_model(setup.model, setup.shape)
    print(json.dumps({"model": setup.model.name, "write_s": round(time.monotonic() - t, 1)}), flush=True)
    n = setup.shape.n_layer
    split = [n // 2, n - n // 2 + 1]
    out = Path(a.out) / "gpu-bench.jsonl"
    peer = a.peer
    server = Peer(br.ENGINE_RPC_PORT, None if peer == "gpu" else ["CPU"], 1 if peer == "gpu" else a.cpu_threads)
    try:
        for rep in range(a.repeats):
            for g in ((1, 2) if rep % 2 == 0 else (2, 1)):
                t0 = time.monotonic()
                busy = BusySampler()
                try:
                    r = br.engine_cell(setup, server, order="rpc-first", groups=g, pool=True,
                                       slots=setup.clients, clients=setup.clients, tensor_split=split)
                except Exception as e:  # keep going: the other cells still say something
                    r = {"error": repr(e)}
                row = {"peer": peer, "local": LOCAL, "groups": g, "rep": rep, "split": split,
                       "cell_s": round(time.monotonic() - t0, 1), "gpu_busy_mean": busy.stop(), **r}
                print(json.dumps(row), flush=True)
                with out.open("a") as f:
                    f.write(json.dumps(row) + "\n")
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
