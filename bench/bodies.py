"""Memory and time per request with large bodies, against ``make serve``'s settings (the demo
model on the split, two groups, 8 slots of 512 tokens, the ingress serving HTTP itself).

Each figure is a process's peak resident memory above where it was before (``VmHWM`` after a
reset of it, on this machine: both stages' processes are local):

- ``argument``: one chat request whose earlier tool call carries a 7 MB one-word argument (a
  400: it cannot fit a slot): the engine's and the ingress's peaks, and its answer's time.
- ``one request``: the peak of one request of each kind a body can take (8 MB of text in an
  ignored field, served and streamed; an 8 MB tool-call argument; the most small values the
  body's bounds let through; 8 MB of values past them), in the ingress and the engine.
- ``heads``: 64 connections at once each send an 8 MB request head (one header line that never
  ends): the ingress's peak, and what each got back (431 once past ``max_head_bytes``).
- ``stalled``: ``--streams`` (100) raw sockets each send a streamed request with a 7 MB body (in a
  field the server ignores) and never read: once all are in flight, the ingress's resident
  memory above where it was, and its peak.
- ``beside``: a short request (64 tokens) alone, then while ``--clients`` (8) clients send 7 MB
  ``count_tokens`` bodies for ``--seconds`` (20): each short request's time, against 2x alone.

    python -m bench.bodies [--streams 100] [--clients 8] [--seconds 20] [--cells a,b]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import threading
import time
from pathlib import Path

import httpx
import yaml

from bench.stack import ROOT, HttpStack

MB = 1e6
CONFIG = ROOT / "deployments" / "configs" / "local.yaml"
SHORT = {"prompt": "Once upon a time", "max_tokens": 64, "temperature": 0, "ignore_eos": True}


def status_kb(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


class Peak:
    """A process's peak resident memory from now on, above its resident memory now."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := VmRSS
        self.base = status_kb(pid, "VmRSS")

    def growth_mb(self) -> float:
        return (status_kb(self.pid, "VmHWM") - self.base) * 1024 / MB

    def now_mb(self) -> float:
        return (status_kb(self.pid, "VmRSS") - self.base) * 1024 / MB


def replica_pid(name: str) -> int:
    out = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True, check=True).stdout
    pids = [int(line.split()[0]) for line in out.splitlines() if f"ServeReplica:bench:{name}" in line]
    if len(pids) != 1:
        raise RuntimeError(f"{len(pids)} processes of the {name} replica")
    return pids[0]


def tool_argument_body(n_bytes: int) -> dict:
    return {"messages": [{"role": "user", "content": "hi"},
                         {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
                             "name": "f", "arguments": json.dumps({"x": "a" * n_bytes})}}]},
                         {"role": "tool", "tool_call_id": "c1", "content": "ok"}],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
            "max_tokens": 8}


def post(base: str, path: str, body: dict | bytes, timeout: float = 120) -> tuple[int, float, str]:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    t0 = time.perf_counter()
    r = httpx.post(base + path, content=raw, headers={"content-type": "application/json"}, timeout=timeout)
    return r.status_code, time.perf_counter() - t0, r.text[:160]


def cell_argument(base: str, pids: dict[str, int]) -> dict:
    peaks = {k: Peak(p) for k, p in pids.items()}
    status, s, text = post(base, "/v1/chat/completions", tool_argument_body(7_000_000))
    return {"status": status, "seconds": round(s, 2), "answer": text,
            **{f"{k}_peak_mb": round(p.growth_mb(), 1) for k, p in peaks.items()}}


def bodies_of_8mb() -> dict[str, bytes]:
    n = 8_000_000
    served = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True,
                         "padding": "a" * (n - 100)}).encode()
    # the most values the body's bounds let through: 60,000 objects, 240,000 strings
    small = b'{"max_tokens": 4, "messages": [' + b",".join(
        [b'{"role":"user","content":"' + b"a" * 16 + b'"}'] * 60_000) + b"]}"
    return {
        "text in an ignored field (served)": served,
        "one tool-call argument": json.dumps(tool_argument_body(n - 400)).encode(),
        "60,000 messages of 16 characters": small,
        "4 million numbers in stop": b'{"messages": [{"role":"user","content":"hi"}], "stop": [' + b",".join(
            [b"1"] * (n // 2 - 40)) + b"]}",
        "2.6 million empty objects": b'{"messages": [' + b",".join([b"{}"] * (n // 3 - 10)) + b"]}",
    }


def cell_one_request(base: str, pids: dict[str, int]) -> dict:
    out = {}
    for kind, raw in bodies_of_8mb().items():
        peaks = {k: Peak(p) for k, p in pids.items()}
        status, s, text = post(base, "/v1/chat/completions", raw)
        out[kind] = {"bytes": len(raw), "status": status, "seconds": round(s, 2),
                     **{f"{k}_peak_mb": round(p.growth_mb(), 1) for k, p in peaks.items()},
                     **({"answer": text} if status != 200 else {})}
    return out


def cell_stalled(base: str, pids: dict[str, int], n: int, body_bytes: int = 7_000_000) -> dict:
    host, port = base.removeprefix("http://").split(":")
    body = json.dumps({"messages": [{"role": "user", "content": "Tell me a long story."}], "stream": True,
                       "max_tokens": 400, "ignore_eos": True, "padding": "a" * body_bytes}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    ing = serve_handle("ingress")
    before = ing.tables.remote().result(timeout_s=30)["pending"]
    peak = Peak(pids["ingress"])
    socks = []
    try:
        for _ in range(n):
            s = socket.create_connection((host, int(port)))
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a client that stops reading: small window
            s.sendall(head + body)
            socks.append(s)
        deadline = time.monotonic() + 120
        while ing.tables.remote().result(timeout_s=30)["pending"] < before + n and time.monotonic() < deadline:
            time.sleep(0.5)
        time.sleep(2.0)
        pending = ing.tables.remote().result(timeout_s=30)["pending"] - before
        return {"streams": n, "body_bytes": len(body), "in_flight": pending,
                "ingress_held_mb": round(peak.now_mb(), 1), "ingress_peak_mb": round(peak.growth_mb(), 1)}
    finally:
        for s in socks:
            s.close()
        wait_idle()


def cell_heads(base: str, pids: dict[str, int], n: int = 64, head_bytes: int = 8_000_000) -> dict:
    """``n`` connections each send a head of ``head_bytes`` (one header line that never ends), in
    64 KiB pieces, all at once: the ingress's peak above where it was, and what each got back."""
    host, port = base.removeprefix("http://").split(":")
    peak = Peak(pids["ingress"])
    piece = b"a" * 65536
    answers: dict[str, int] = {}
    lock = threading.Lock()

    def one() -> None:
        got = "sent whole"
        try:
            with socket.create_connection((host, int(port)), timeout=60) as s:
                s.sendall(f"GET /v1/models HTTP/1.1\r\nHost: {host}:{port}\r\nX-Pad: ".encode())
                for _ in range(head_bytes // len(piece)):
                    s.sendall(piece)
                s.sendall(b"\r\n\r\n")
                got = s.recv(64).split(b"\r\n")[0].decode() or "closed"
        except OSError as e:  # the server closed the connection while it was still sending
            got = f"{type(e).__name__}"
        with lock:
            answers[got] = answers.get(got, 0) + 1

    threads = [threading.Thread(target=one, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return {"connections": n, "head_bytes": head_bytes, "answers": answers,
            "ingress_peak_mb": round(peak.growth_mb(), 1)}


def serve_handle(name: str):  # noqa: ANN201 - a DeploymentHandle
    from ray import serve

    return serve.get_deployment_handle(name, "bench")


def wait_idle(timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ing = serve_handle("ingress").tables.remote().result(timeout_s=30)
        eng = serve_handle("engine").tables.remote().result(timeout_s=30)
        if ing["pending"] == 0 and eng["running"] == 0 and eng["waiting"] == 0:
            return
        time.sleep(0.5)


def short_s(base: str) -> float:
    status, s, text = post(base, "/v1/completions", SHORT)
    if status != 200:
        raise RuntimeError(f"the short request failed: {status} {text}")
    return s


def cell_beside(base: str, clients: int, seconds: float) -> dict:
    short_s(base)  # warm
    alone = statistics.median(short_s(base) for _ in range(3))
    raw = json.dumps({**tool_argument_body(7_000_000), "max_tokens": 1}).encode()
    stop = threading.Event()
    answers: dict[int, int] = {}
    lock = threading.Lock()

    def flood() -> None:
        with httpx.Client(timeout=120) as c:
            while not stop.is_set():
                r = c.post(base + "/v1/messages/count_tokens", content=raw, headers={"content-type": "application/json"})
                with lock:
                    answers[r.status_code] = answers.get(r.status_code, 0) + 1

    threads = [threading.Thread(target=flood, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    time.sleep(1.0)  # the flood is under way
    times: list[float] = []
    t_end = time.monotonic() + seconds
    while time.monotonic() < t_end:
        times.append(short_s(base))
    stop.set()
    for t in threads:
        t.join(120)
    return {"alone_s": round(alone, 2), "beside_s": [round(t, 2) for t in times], "limit_s": round(2 * alone, 2),
            "worst_over_alone": round(max(times) / alone, 2), "count_tokens_answers": answers}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, default=100)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--cells", default="argument,one,heads,stalled,beside")
    a = p.parse_args(argv)
    args = yaml.safe_load(CONFIG.read_text())["applications"][0]["args"]
    stack = HttpStack(ingress="direct")
    results: dict = {"config": str(CONFIG.relative_to(ROOT)), "args": args}
    try:
        stack.deploy(args)
        pids = {"engine": serve_handle("engine").info.remote().result(timeout_s=30)["pid"],
                "ingress": replica_pid("ingress")}
        short_s(stack.base)
        cells = a.cells.split(",")
        if "argument" in cells:
            results["argument"] = cell_argument(stack.base, pids)
            print("argument:", json.dumps(results["argument"]), flush=True)
        if "one" in cells:
            results["one_request"] = cell_one_request(stack.base, pids)
            for k, v in results["one_request"].items():
                print(f"one request, {k}:", json.dumps(v), flush=True)
        if "heads" in cells:
            results["heads"] = cell_heads(stack.base, pids)
            print("heads:", json.dumps(results["heads"]), flush=True)
        if "stalled" in cells:
            results["stalled"] = cell_stalled(stack.base, pids, a.streams)
            print("stalled:", json.dumps(results["stalled"]), flush=True)
        if "beside" in cells:
            results["beside"] = cell_beside(stack.base, a.clients, a.seconds)
            print("beside:", json.dumps(results["beside"]), flush=True)
    finally:
        stack.close()
    out = ROOT / "bench" / "results" / "bodies.json"
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {out.relative_to(ROOT)} ({os.path.getsize(out)} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
