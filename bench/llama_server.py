"""The reference: upstream llama-server with rpc-server on the same split, started by the bench.

Both binaries come from ``make llama-server`` (built from the llama.cpp vendored in the same
llama-cpp-python sdist; ``LLAMA_SERVER_BIN`` names their folder). llama-server refuses a
CPU device in ``--device``, so on a CPU box its layer order is CPU first, RPC last
(``-ngl N`` puts the last N layers and the output layer on the peer). ``output_local`` gets
the project's order instead: every layer on the peer (``-ngl 99``), then the later blocks
and the output layer moved back to the CPU with ``--override-tensor``.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import httpx

from deployments.stage.server import port_listening


def bin_dir() -> Path:
    d = os.environ.get("LLAMA_SERVER_BIN")
    if not d or not (Path(d) / "llama-server").exists():
        raise FileNotFoundError("llama-server not built: run `make llama-server` (or `make bench`)")
    return Path(d)


def _taskset(cpus: list[int] | None) -> list[str]:
    return ["taskset", "-c", ",".join(map(str, cpus))] if cpus else []


def split_args(n_layer: int, n_peer: int, output_local: bool) -> list[str]:
    """llama-server's arguments for ``n_peer`` layers on the RPC device (see the module's doc)."""
    if output_local:
        local = "|".join(str(i) for i in range(n_peer, n_layer))
        return ["-ngl", "99", "-ot", rf"blk\.({local})\.=CPU,output=CPU"]
    return ["-ngl", str(n_peer)]


class LlamaServer:
    def __init__(self, model: Path, *, n_layer: int, n_peer: int, output_local: bool, slots: int, n_ctx: int,
                 port: int, rpc_port: int, peer_cpus: list[int] | None = None,
                 local_cpus: list[int] | None = None, flash_attn: str = "auto", threads: int = 1,
                 cache_ram_mib: int = 0, extra: list[str] = (), env: dict[str, str] | None = None) -> None:
        """``cache_ram_mib``: llama-server's ``--cache-ram`` (its prompt cache in host RAM; 0 off);
        ``extra``: more of its arguments (``--mmproj``), ``env`` more of its environment."""
        b = bin_dir()
        self.rpc = subprocess.Popen(
            [*_taskset(peer_cpus), str(b / "rpc-server"), "--host", "127.0.0.1", "--port", str(rpc_port), "-t", str(threads)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait(lambda: port_listening(rpc_port), self.rpc, "rpc-server")
        split = split_args(n_layer, n_peer, output_local)
        self.cmd = [*_taskset(local_cpus), str(b / "llama-server"), "-m", str(model), "--rpc", f"127.0.0.1:{rpc_port}",
                    *split, "-np", str(slots), "-c", str(n_ctx), "-t", str(threads), "--cache-ram", str(cache_ram_mib),
                    "--host", "127.0.0.1", "--port", str(port), "--no-webui", "--metrics", "-fa", flash_attn, *extra]
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     env={**os.environ, **(env or {})})
        self.base = f"http://127.0.0.1:{port}"

        def healthy() -> bool:
            try:
                return httpx.get(self.base + "/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        _wait(healthy, self.proc, "llama-server")

    def close(self) -> None:
        for p in (self.proc, self.rpc):
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _wait(ready, proc: subprocess.Popen, what: str, timeout_s: float = 120) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not start (exit {proc.poll()})")
        time.sleep(0.2)
