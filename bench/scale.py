"""A model of the size users serve, on the two-host bed, side by side with llama-server + rpc-server.

``make bench-scale`` (root, Linux; about 25 minutes on 2 cores). The model: a synthetic mixture
of experts in Q4_K (``tests/models/synthetic.py``), 3.6 GB: 16 layers of 128 experts, 2 a
token, so that a token costs what a 300M-parameter dense model costs while the weights weigh
what users load over the link; its first 8 layers (half the weights) on the peer. The bed:
``tests/cluster/testbed.py``'s two hosts (network, mount and PID namespaces, ``ray up`` from
``cluster/two-sparks.yaml``, ``serve run`` from ``deployments/configs/two-sparks.yaml``); the
veth between them shaped by tc (``tbf``, both directions) to ``--rate``, and measured raw with
one plain TCP transfer. This kernel has no ``netem``: the link's latency is the veth's own.

Figures, in this order:

- **cold start**: ``serve run`` with the peer's tensor cache empty, to the first token; bytes on
  the RPC connection and their rate against the raw link;
- **decode and TTFT**: 4 streams of 512-token prompts, then one 4,096-token prompt alone;
- **peer killed under load**, then **replica killed under load**: seconds from the kill to the
  next answer, and the bytes the new connection carried (the tensor cache is warm by then);
- **memory**: the engine replica's and the stage's RSS (anonymous, file), the GGUF's pages in
  the page cache and the peer's tensor cache on disk, against the model's size;
- **warm start**: ``serve shutdown``, then ``serve run`` with 2 groups (the cache full), and
  decode and TTFT again; then once more with 1 group, ``release_offloaded_pages: false`` (the
  peer's pages left in the local page cache, as llama.cpp leaves them: its start and memory)
  and ``prefill_gap_factor: null`` (prompts in whole batches, as llama-server: decode and TTFT);
- **llama-server + rpc-server -c** on the same hosts, model and split (its order: every layer on
  the peer, the last 8 and the output layer moved back with ``-ot``): cold start, decode and
  TTFT, memory, warm start, and its peer killed under load (llama-server exits; nothing restarts
  it).

Writes bench/results/scale.json and scale.md. ``python -m bench.scale client ...`` is the load
client, run inside the head's namespace.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench.stack import ROOT
from engine.native.page_cache import resident_bytes
from tests.models.synthetic import ModelShape

SHAPE = ModelShape(n_layer=16, n_embd=1024, n_head=8, n_head_kv=2, n_ff=1024, n_vocab=8192, n_ctx_train=8192,
                   ftype="q4_k", n_expert=128, n_expert_used=2, seed=7)
MODEL = ROOT / "models" / "synthetic-moe-3.6g-q4_k.gguf"
N_PEER = 8
SLOTS, SLOT_CTX = 4, 4608
LS_PORT, LS_RPC_PORT = 8081, 50060
ENGINE_PROC = "ServeReplica:pipeline-groups:engine"
RESULTS = ROOT / "bench" / "results"


def ensure_model() -> Path:
    if not MODEL.exists():
        from tests.models.synthetic import write_model

        write_model(MODEL, SHAPE)
    return MODEL


# ---------------------------------------------------------------- the load client (head namespace)


def client(argv: list[str]) -> int:
    """Streams against ``--base``; prints one JSON line. ``--probe``: one short request again and
    again until one is answered, then the wall-clock time it was."""
    from bench.clients import make_prompts, run_http

    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--probe", type=float, default=0.0, help="seconds to keep trying")
    a = ap.parse_args(argv)
    if a.probe:
        deadline = time.monotonic() + a.probe
        while time.monotonic() < deadline:
            r = run_http(a.base, make_prompts(1, 16, seed=time.monotonic_ns()), 1, 4, timeout_s=60)
            if not r.errors:
                print(json.dumps({"answered_at": time.time()}))
                return 0
            time.sleep(0.5)
        print(json.dumps({"answered_at": None}))
        return 1
    r = run_http(a.base, make_prompts(a.requests, a.prompt, seed=a.seed), a.clients, a.gen, timeout_s=1200)
    print(json.dumps(r.figures()))
    return 0


# ---------------------------------------------------------------- the bed


def in_ns(node, cmd: list[str]) -> list[str]:  # noqa: ANN001
    return ["ip", "netns", "exec", node.netns, *cmd]


def run_client(tb, base: str, *args: str, timeout: float = 1800) -> dict:  # noqa: ANN001
    cmd = in_ns(tb.HEAD, [sys.executable, "-m", "bench.scale", "client", "--base", base, *args])
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        raise RuntimeError(f"load client failed ({r.returncode}): {r.stderr[-2000:]}")
    return json.loads(lines[-1])


def shape_link(tb, rate: str) -> None:  # noqa: ANN001
    for n in tb.NODES:
        tb._sh(in_ns(n, ["tc", "qdisc", "replace", "dev", n.veth, "root", "tbf", "rate", rate, "burst", "4mb",
                         "latency", "100ms"]))


RAW_SINK = ("import socket, sys\n"
            "s = socket.create_server((sys.argv[1], 5201)); c, _ = s.accept(); n = 0\n"
            "while (b := c.recv(1 << 20)): n += len(b)\n"
            "c.sendall(str(n).encode()); c.close()\n")
RAW_SEND = ("import socket, sys, time\n"
            "buf = b'\\0' * (1 << 20); c = socket.create_connection((sys.argv[1], 5201)); t0 = time.perf_counter()\n"
            "for _ in range(int(sys.argv[2])): c.sendall(buf)\n"
            "c.shutdown(socket.SHUT_WR); n = int(c.recv(64)); print(n, time.perf_counter() - t0)\n")


def raw_link(tb, mib: int = 1024) -> dict:  # noqa: ANN001
    """One plain TCP transfer head -> peer of ``mib`` MiB: the link's raw rate."""
    sink = subprocess.Popen(in_ns(tb.PEER, [sys.executable, "-c", RAW_SINK, tb.PEER.ip]))
    try:
        for _ in range(50):
            if tb._sh(in_ns(tb.PEER, ["ss", "-Hltn", "( sport = :5201 )"]), check=False).stdout.strip():
                break
            time.sleep(0.1)
        out = tb._sh(in_ns(tb.HEAD, [sys.executable, "-c", RAW_SEND, tb.PEER.ip, str(mib)]), timeout=600).stdout
        n, s = out.split()
        return {"bytes": int(n), "seconds": round(float(s), 2), "MB_s": round(int(n) / float(s) / 1e6, 1)}
    finally:
        sink.wait(30)


def rpc_bytes(tb, port: int) -> int:  # noqa: ANN001
    """Bytes the peer's RPC listener on ``port`` has received on its open connections."""
    return tb.rpc_socket_bytes(port)["received"]


# ---------------------------------------------------------------- memory


def rss(pid: int) -> dict:
    """The process's resident memory, MB: all, anonymous, file-backed."""
    f = dict(ln.split(":", 1) for ln in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in ln)
    mb = lambda k: round(int(f.get(k, "0 kB").split()[0]) / 1024)  # noqa: E731
    return {"rss_MB": mb("VmRSS"), "anon_MB": mb("RssAnon"), "file_MB": mb("RssFile")}


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def memory(tb, local_pid: int, peer_pid: int, cache: Path) -> dict:  # noqa: ANN001
    mb = lambda n: round(n / 1e6)  # noqa: E731
    return {"local": rss(local_pid), "peer": rss(peer_pid), "model_MB": mb(MODEL.stat().st_size),
            "gguf_in_page_cache_MB": mb(resident_bytes(str(MODEL))), "peer_tensor_cache_on_disk_MB": mb(du(cache))}


# ---------------------------------------------------------------- arms


def until(pred, timeout_s: float, what: str, step: float = 0.5):  # noqa: ANN001, ANN201
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(step)
    raise TimeoutError(what)


def load_figures(tb, base: str) -> dict:  # noqa: ANN001
    return {"p512": run_client(tb, base, "--prompt", "512", "--clients", "4", "--requests", "4", "--gen", "32"),
            "p4096": run_client(tb, base, "--prompt", "4096", "--clients", "1", "--requests", "1", "--gen", "16",
                                "--seed", "9")}


def killed_under_load(tb, base: str, kill, server: subprocess.Popen | None = None) -> dict:  # noqa: ANN001
    """Streams running, ``kill()`` after 10 s: the seconds from the kill to the next answer, or
    with ``server`` (llama-server, which nothing restarts here) how that process ended."""
    load = subprocess.Popen(in_ns(tb.HEAD, [sys.executable, "-m", "bench.scale", "client", "--base", base,
                                            "--prompt", "64", "--clients", "4", "--requests", "8", "--gen", "256"]),
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    time.sleep(10)
    t_kill = time.time()
    what = kill()
    if server is None:
        back = run_client(tb, base, "--probe", "900", timeout=960).get("answered_at")
        got = {"killed": what, "serving_again_s": round(back - t_kill, 1) if back else None}
    else:
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.wait(120)
        got = {"llama_server_exit": server.poll()}
    out, _ = load.communicate(timeout=1200)
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    streams = json.loads(lines[-1]) if lines else {}
    return {**got, "streams_failed": streams.get("errors"), "streams": streams.get("requests")}


def engine_load(tb, base: str) -> dict:  # noqa: ANN001
    """The engine's own load time and the pages it released, from its metrics."""
    from bench.headline import metric_sums

    text = tb._sh(in_ns(tb.HEAD, ["curl", "-s", "--max-time", "10", base + "/metrics"]), check=False).stdout
    sums = metric_sums(text)
    return {key: round(sums[name], 1) if name in sums else None
            for name, key in (("pgroups_model_load_seconds", "model_load_s"),
                              ("pgroups_model_pages_released_bytes", "released_bytes"))}


def engine_arms(tb) -> dict:  # noqa: ANN001
    base = f"http://{tb.HEAD.ip}:{tb.HTTP_PORT}"
    cache = tb.PEER.home / ".cache" / "pipeline-groups" / "rpc"
    common = dict(n_ctx=SLOTS * SLOT_CTX, n_parallel=SLOTS, peer_layers=N_PEER, chat_template=None)
    tb.put_model(tb.HEAD, MODEL.name, source=MODEL)
    out: dict = {}

    def start(groups: int, log: str, **extra: object) -> tuple[subprocess.Popen, dict]:
        t0 = time.monotonic()
        proc = tb.serve_run("layer_split", MODEL.name, log=log, pipeline_groups=groups, **common, **extra)
        healthy = tb.wait_healthy(900, proc, log)
        first = run_client(tb, base, "--prompt", "16", "--clients", "1", "--requests", "1", "--gen", "1")
        took = time.monotonic() - t0
        return proc, {"to_healthy_s": round(healthy, 1), "to_first_token_s": round(took, 1), "first": first,
                      "rpc_bytes": rpc_bytes(tb, tb.RPC_PORT), **engine_load(tb, base)}

    shutil.rmtree(cache, ignore_errors=True)
    proc, out["cold_start"] = start(1, "serve-run-scale-1.log")
    out["1 group"] = load_figures(tb, base)
    stage = lambda: tb.netns_pids_matching(tb.PEER, "deployments.stage.server")  # noqa: E731
    replica = lambda: tb.netns_pids_matching(tb.HEAD, ENGINE_PROC)  # noqa: E731
    out["memory"] = memory(tb, replica()[0], stage()[0], cache)

    def kill_first(pids):  # noqa: ANN001, ANN202
        def kill() -> int:
            pid = pids()[0]
            os.kill(pid, signal.SIGKILL)
            return pid
        return kill

    out["peer_killed"] = killed_under_load(tb, base, kill_first(stage))
    out["peer_killed"].update(rpc_bytes_after=rpc_bytes(tb, tb.RPC_PORT), **engine_load(tb, base))
    out["replica_killed"] = killed_under_load(tb, base, kill_first(replica))
    out["replica_killed"].update(rpc_bytes_after=rpc_bytes(tb, tb.RPC_PORT), **engine_load(tb, base))
    tb.serve_stop(proc)
    tb.serve_shutdown()
    proc, out["warm_start"] = start(2, "serve-run-scale-2.log")
    out["2 groups"] = load_figures(tb, base)
    out["memory_2_groups"] = memory(tb, replica()[0], stage()[0], cache)
    tb.serve_stop(proc)
    tb.serve_shutdown()
    # a warm start with the peer's pages kept cached on the local node (as llama.cpp leaves them),
    # and the loads with every prompt in whole batches (llama-server's behaviour: no chunked prefill)
    proc, out["warm_start_pages_kept"] = start(1, "serve-run-scale-3.log", release_offloaded_pages=False,
                                               prefill_gap_factor=None)
    out["memory_pages_kept"] = memory(tb, replica()[0], stage()[0], cache)
    out["1 group, whole batches"] = load_figures(tb, base)
    tb.serve_stop(proc)
    tb.serve_shutdown()
    return out


def llama_server_arm(tb) -> dict:  # noqa: ANN001
    from bench.llama_server import bin_dir, split_args

    b = bin_dir()
    cache = tb.STATE / "llama-rpc-cache"
    base = f"http://{tb.HEAD.ip}:{LS_PORT}"
    out: dict = {}
    shutil.rmtree(cache, ignore_errors=True)

    def start() -> tuple[subprocess.Popen, subprocess.Popen, dict]:
        t0 = time.monotonic()
        rpc = subprocess.Popen(in_ns(tb.PEER, [str(b / "rpc-server"), "--host", tb.PEER.ip, "--port", str(LS_RPC_PORT),
                                               "-t", "1", "-c"]),
                               env={**os.environ, "LLAMA_CACHE": str(cache)}, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
        until(lambda: tb._sh(in_ns(tb.PEER, ["ss", "-Hltn", f"( sport = :{LS_RPC_PORT} )"]), check=False).stdout.strip(),
              60, "rpc-server did not listen")
        server = subprocess.Popen(in_ns(tb.HEAD, [
            str(b / "llama-server"), "-m", str(MODEL), "--rpc", f"{tb.PEER.ip}:{LS_RPC_PORT}",
            *split_args(SHAPE.n_layer, N_PEER, output_local=True), "-np", str(SLOTS), "-c", str(SLOTS * SLOT_CTX),
            "-t", "1", "--cache-ram", "0", "--host", tb.HEAD.ip, "--port", str(LS_PORT), "--no-webui", "-fa", "on"]),
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        def healthy() -> bool:
            if server.poll() is not None:
                raise RuntimeError(f"llama-server exited ({server.returncode})")
            r = tb._sh(in_ns(tb.HEAD, ["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "--max-time", "5",
                                       base + "/health"]), check=False)
            return r.stdout.strip() == "200"

        until(healthy, 900, "llama-server did not become healthy", step=1)
        healthy_s = time.monotonic() - t0
        first = run_client(tb, base, "--prompt", "16", "--clients", "1", "--requests", "1", "--gen", "1")
        return rpc, server, {"to_healthy_s": round(healthy_s, 1), "to_first_token_s": round(time.monotonic() - t0, 1),
                             "first": first, "rpc_bytes": rpc_bytes(tb, LS_RPC_PORT)}

    def stop(*procs: subprocess.Popen) -> None:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                p.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(20)
            if p.poll() is None:
                p.kill()
                p.wait()

    rpc, server, out["cold_start"] = start()
    out["1 context"] = load_figures(tb, base)
    out["memory"] = memory(tb, server.pid, rpc.pid, cache)
    stop(server, rpc)
    rpc, server, out["warm_start"] = start()

    def kill_peer() -> int:
        os.kill(rpc.pid, signal.SIGKILL)
        return rpc.pid

    out["peer_killed"] = killed_under_load(tb, base, kill_peer, server)
    stop(server, rpc)
    return out


# ---------------------------------------------------------------- report


def report(res: dict) -> str:
    raw = res["raw_link"]["MB_s"]
    gb = lambda n: f"{n / 1e9:.2f} GB"  # noqa: E731
    rows = ["| | this project | llama-server + rpc-server |", "|---|---|---|"]
    e, ls = res["engine"], res.get("llama_server", {})

    def start(s: dict) -> str:
        if not s:
            return "-"
        rate = s["rpc_bytes"] / max(s["to_healthy_s"], 1e-9) / 1e6
        load = f", the engine's load {s['model_load_s']} s" if s.get("model_load_s") else ""
        return (f"{s['to_first_token_s']} s to the first token{load}; {gb(s['rpc_bytes'])} over RPC "
                f"({rate:.0f} MB/s over the start)")

    rows.append(f"| cold start (peer cache empty) | {start(e['cold_start'])} | {start(ls.get('cold_start', {}))} |")
    rows.append(f"| warm start (cache full) | {start(e['warm_start'])} (2 groups) | {start(ls.get('warm_start', {}))} |")
    for key, name in (("p512", "4 streams, 512-token prompts"), ("p4096", "one 4,096-token prompt")):
        def cell(f: dict) -> str:
            return f"{f['tok_s']} tok/s, TTFT {f['ttft_median_s']} s" if f else "-"
        rows.append(f"| {name}, 1 group | {cell(e['1 group'][key])} | {cell(ls.get('1 context', {}).get(key, {}))} |")
        rows.append(f"| {name}, 2 groups | {cell(e['2 groups'][key])} | |")
        rows.append(f"| {name}, 1 group, whole batches | {cell(e['1 group, whole batches'][key])} | |")
    pk, rk, lpk = e["peer_killed"], e["replica_killed"], ls.get("peer_killed", {})
    rows.append(f"| peer killed under load | serving again in {pk['serving_again_s']} s; {pk['streams_failed']} of "
                f"{pk['streams']} streams failed; {gb(pk['rpc_bytes_after'])} over RPC after | llama-server exit "
                f"code {lpk.get('llama_server_exit')}; {lpk.get('streams_failed')} of {lpk.get('streams')} streams "
                "failed; nothing restarts it |")
    rows.append(f"| replica killed under load | serving again in {rk['serving_again_s']} s; {rk['streams_failed']} "
                f"of {rk['streams']} streams failed; {gb(rk['rpc_bytes_after'])} over RPC after | - |")

    def mem(m: dict) -> str:
        if not m:
            return "-"
        return (f"local RSS {m['local']['rss_MB']} MB (anon {m['local']['anon_MB']}), peer RSS {m['peer']['rss_MB']} MB "
                f"(anon {m['peer']['anon_MB']}); GGUF {m['gguf_in_page_cache_MB']} of {m['model_MB']} MB in the page "
                f"cache; peer's tensor cache {m['peer_tensor_cache_on_disk_MB']} MB on disk")
    rows.append(f"| memory, 1 group | {mem(e['memory'])} | {mem(ls.get('memory', {}))} |")
    rows.append(f"| memory, 2 groups | {mem(e['memory_2_groups'])} | |")
    rows.append(f"| warm start, peer's pages kept cached | {start(e['warm_start_pages_kept'])} | |")
    rows.append(f"| memory, peer's pages kept cached | {mem(e['memory_pages_kept'])} | |")
    head = (f"Model {res['model']['MB']} MB ({res['model']['shape']}), {N_PEER} of {SHAPE.n_layer} layers on the peer; "
            f"link shaped to {res['rate']}, raw TCP {raw} MB/s; {res['machine']}.")
    return head + "\n\n" + "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["client"]:
        return client(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", default="2gbit", help="the link's rate, as tc writes it")
    ap.add_argument("--no-llama-server", action="store_true")
    a = ap.parse_args(argv)
    from bench.cpu import describe
    from tests.cluster import testbed as tb

    ensure_model()
    res: dict = {"model": {"MB": round(MODEL.stat().st_size / 1e6), "shape": shlex.quote(repr(SHAPE))},
                 "rate": a.rate, "machine": describe()}
    tb.install_cleanup()
    tb.up()
    shape_link(tb, a.rate)
    res["raw_link"] = raw_link(tb)
    print("raw link", res["raw_link"], flush=True)
    tb.ray_up()
    tb.wait_for_peer()
    res["engine"] = engine_arms(tb)
    print(json.dumps(res["engine"]), flush=True)
    if not a.no_llama_server:
        res["llama_server"] = llama_server_arm(tb)
        print(json.dumps(res["llama_server"]), flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "scale.json").write_text(json.dumps(res, indent=1))
    md = report(res)
    (RESULTS / "scale.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
