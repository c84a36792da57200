"""CPU seconds of every process on the box, by role, so a cell can report CPU per token.

Roles come from the command line Ray and the project give each process: the Serve proxy,
the ingress and engine replicas, the RPC stage, Ray's own daemons, llama-server and its
rpc-server, and the benchmark's load client (this process). Linux only (/proc).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

from observability.process import cpu_seconds

ROLES = (
    ("ray::ProxyActor", "serve proxy"),
    ("ServeReplica:", "replica"),  # split below by deployment name
    ("ray::ServeController", "serve controller"),
    ("deployments.stage.server", "rpc stage"),
    ("rpc-server", "rpc stage"),
    ("llama-server", "llama-server"),
    ("raylet", "ray daemons"),
    ("gcs_server", "ray daemons"),
    ("ray/", "ray daemons"),  # dashboard agent, log monitor, runtime-env agent
    ("ray::", "ray workers"),
)


def _role(cmd: str) -> str | None:
    for needle, role in ROLES:
        if needle in cmd:
            if role == "replica":
                return "engine replica" if ":engine" in cmd else "ingress replica"
            return role
    return None


def _processes() -> Iterator[tuple[int, str]]:
    """(pid, role) of every process on the box with a role, this one excluded."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        role = _role(cmd)
        if role is not None:
            yield int(d.name), role


def snapshot() -> dict[str, float]:
    """CPU seconds so far per role (processes that exited since the last call are lost)."""
    out: dict[str, float] = {"load client": cpu_seconds(os.getpid())}
    for pid, role in _processes():
        out[role] = out.get(role, 0.0) + cpu_seconds(pid)
    return out


def pids(keep: Callable[[str], bool]) -> list[int]:
    """The processes on the box whose role ``keep`` accepts (this process excluded)."""
    return [pid for pid, role in _processes() if keep(role)]


def per_token_ms(before: dict[str, float], after: dict[str, float], n_tokens: int) -> dict[str, float]:
    """Milliseconds of CPU per generated token for each role, between two snapshots."""
    n = max(n_tokens, 1)
    return {k: round(1000 * (after.get(k, 0.0) - before.get(k, 0.0)) / n, 3) for k in sorted(after)
            if after.get(k, 0.0) - before.get(k, 0.0) > 0}


def describe() -> str:
    """The CPU a figure came from: its model, cores and the SIMD sets ggml picks kernels by."""
    import os
    import platform

    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name") and model in ("", platform.machine(), platform.processor()):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    sets = [f for f in ("avx", "avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile") if f in flags]
    return f"{model}, {os.cpu_count()} cores, {' '.join(sets) or 'no x86 SIMD flags'}"
