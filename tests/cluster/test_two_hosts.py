"""`ray up` for real, on two hosts made on this machine (``make test-cluster``).

The bed (``tests/cluster/testbed.py``): network namespaces ``head`` 10.77.0.1 and ``peer``
10.77.0.2 joined by a veth pair, each with its own sshd, mounts and PIDs. ``ray up`` ran with a
config made from ``cluster/two-sparks.yaml``, then ``serve run`` on the head with one made from
``deployments/configs/two-sparks.yaml`` (Gemma 3 270M, CPU). The tests run in file order; the
last one is ``ray down``."""

from __future__ import annotations

import collections
import os
import re
import signal
import subprocess
import time

import pytest

from tests.cluster import testbed as tb
from tests.cluster.conftest import FIGURES

pytestmark = pytest.mark.cluster

MODEL_NAME = tb.MODEL.name


def completion(prompt: str, max_tokens: int, timeout: float = 120, check: bool = True, **extra) -> dict:
    """One completion through the `openai` SDK, from a Python process on the head node."""
    code = (
        "import json\n"
        "from openai import OpenAI\n"
        f"c = OpenAI(base_url='http://{tb.HEAD.ip}:{tb.HTTP_PORT}/v1', api_key='none', max_retries=0, timeout={timeout})\n"
        f"r = c.completions.create(model={MODEL_NAME!r}, prompt={prompt!r}, max_tokens={max_tokens}, "
        f"temperature=0, extra_body={extra!r})\n"
        f"print({tb.MARK!r} + json.dumps({{'text': r.choices[0].text, 'prompt_tokens': r.usage.prompt_tokens, "
        "'completion_tokens': r.usage.completion_tokens}))\n"
    )
    r = tb.head_python(code, timeout=timeout + 30, check=check)
    if r.returncode != 0:
        return {"error": (r.stderr or r.stdout).strip().splitlines()[-1:]}
    return tb.printed_json(r.stdout)


def model_shape() -> dict[str, int]:
    from engine.native.gguf_shape import LongArray, read_header, read_shape

    shape = read_shape(str(tb.MODEL))
    tokens = read_header(str(tb.MODEL)).fields["tokenizer.ggml.tokens"]
    n_vocab = tokens.count if isinstance(tokens, LongArray) else len(tokens)
    return {"n_embd": shape.n_embd, "n_layer": shape.n_layer, "n_vocab": n_vocab}


def listeners(node: tb.Node, port: int) -> list[tuple[str, str]]:
    """(local address, process) of the TCP listeners on ``port`` inside the node's namespace."""
    out = tb._sh(["ip", "netns", "exec", node.netns, "ss", "-Hltnp", f"( sport = :{port} )"]).stdout
    rows = []
    for line in out.splitlines():
        cols = line.split()
        rows.append((cols[3], " ".join(cols[5:])))
    return rows


def ray_pids(node: tb.Node) -> list[int]:
    """Ray's processes in the node (raylet, GCS, its Python processes and workers)."""
    return sorted({p for needle in ("raylet", "gcs_server", "/ray/", "ray::")
                   for p in tb.netns_pids_matching(node, needle)})


def rpc_server_pids() -> list[int]:
    return tb.netns_pids_matching(tb.PEER, "deployments.stage.server")


def test_ray_up_makes_a_two_node_cluster_with_the_token_on_both(bed):
    token = tb.TOKEN.read_text().strip()
    for node in tb.NODES:
        assert (node.home / ".ray" / "auth_token").read_text().strip() == token, node.name
    code = ("import ray, json; ray.init(address='auto', logging_level='ERROR'); "
            f"print({tb.MARK!r} + json.dumps([[n['NodeManagerAddress'], sorted(n['Resources'])] for n in ray.nodes() if n['Alive']]))")
    nodes = tb.printed_json(tb.head_python(code).stdout)
    by_ip = {ip: res for ip, res in nodes}
    assert set(by_ip) == {tb.HEAD.ip, tb.PEER.ip}, nodes
    assert "stage_local" in by_ip[tb.HEAD.ip] and "stage_peer" not in by_ip[tb.HEAD.ip]
    assert "stage_peer" in by_ip[tb.PEER.ip] and "stage_local" not in by_ip[tb.PEER.ip]
    # each node built its own venv (the template's setup_commands), from the cached wheel
    for node in tb.NODES:
        assert list((node.home / "pipeline-groups" / ".venv").glob(".installed-cpu-*")), node.name


def test_an_openai_request_from_the_head_is_answered(bed):
    r = completion("The capital of France is", 16)
    assert "error" not in r, r
    assert r["completion_tokens"] > 0 and r["text"].strip(), r
    FIGURES["sample_completion"] = repr(r["text"][:60])


def test_the_rpc_stage_runs_on_the_peer_and_binds_its_private_address(bed):
    peer = listeners(tb.PEER, tb.RPC_PORT)
    assert [addr for addr, _ in peer] == [f"{tb.PEER.ip}:{tb.RPC_PORT}"], peer  # not loopback, not a wildcard
    pids = rpc_server_pids()
    assert len(pids) == 1, pids
    assert not listeners(tb.HEAD, tb.RPC_PORT), "the head runs no RPC server"
    # the engine on the head is connected to it over the veth
    out = tb._sh(["ip", "netns", "exec", tb.HEAD.netns, "ss", "-Htn", "state", "established",
                  f"( dport = :{tb.RPC_PORT} )"]).stdout
    conns = [line.split() for line in out.splitlines()]
    assert conns and all(c[2].startswith(tb.HEAD.ip + ":") and c[3] == f"{tb.PEER.ip}:{tb.RPC_PORT}" for c in conns), out


def test_the_output_layer_stays_on_the_head(bed):
    shape = model_shape()
    text = ""
    for f in tb.HEAD.tmp.glob("ray/session_2*/logs/**/*"):
        if f.is_file() and f.suffix in (".err", ".out", ".log"):
            text += f.read_text(errors="replace")
    placed = dict(re.findall(r"layer +(\d+) assigned to device (\w+)", text))
    assert placed, "llama.cpp's placement log is not in the head's Ray logs"
    n = shape["n_layer"]
    on_peer = sorted(int(i) for i, d in placed.items() if d.startswith("RPC"))
    assert on_peer and on_peer == list(range(len(on_peer))), placed  # the first layers
    assert placed[str(n)] == "CPU", f"output layer {n}: {placed}"  # layer n_layer is the output layer
    FIGURES["layers_on_peer"] = f"0 to {on_peer[-1]} of {n} (the output layer on the head's CPU)"
    # and the peer's log has no placement at all: it is only an RPC server
    peer_text = "".join(f.read_text(errors="replace") for f in tb.PEER.tmp.glob("ray/session_2*/logs/*.err"))
    assert "assigned to device" not in peer_text


def test_bytes_per_decode_step_are_activations_not_logits(bed):
    shape = model_shape()
    short, long = 8, 72
    rows = {}
    for prompt, n in (("The capital of Spain is", short), ("The capital of Italy is", long)):
        link0, rpc0 = tb.link_bytes(), tb.rpc_socket_bytes()
        r = completion(prompt, n, ignore_eos=True)
        link1, rpc1 = tb.link_bytes(), tb.rpc_socket_bytes()
        assert r.get("completion_tokens") == n, r
        rows[n] = {"link": link1["tx"] + link1["rx"] - link0["tx"] - link0["rx"],
                   "rpc": rpc1["sent"] + rpc1["received"] - rpc0["sent"] - rpc0["received"],
                   "rpc_to_peer": rpc1["received"] - rpc0["received"], "rpc_from_peer": rpc1["sent"] - rpc0["sent"],
                   "prompt_tokens": r["prompt_tokens"]}
    steps = long - short
    per_step_rpc = (rows[long]["rpc"] - rows[short]["rpc"]) / steps
    per_step_link = (rows[long]["link"] - rows[short]["link"]) / steps
    from_peer_step = (rows[long]["rpc_from_peer"] - rows[short]["rpc_from_peer"]) / steps
    logits = shape["n_vocab"] * 4
    activations = shape["n_embd"] * 4
    FIGURES.update({
        "n_embd*4_bytes": activations, "n_vocab*4_bytes": logits,
        f"link_bytes_request_{long}_tokens": rows[long]["link"], f"link_bytes_request_{short}_tokens": rows[short]["link"],
        f"rpc_bytes_request_{long}_tokens": rows[long]["rpc"],
        "rpc_bytes_per_decode_step": round(per_step_rpc), "rpc_bytes_per_step_head_to_peer":
            round((rows[long]["rpc_to_peer"] - rows[short]["rpc_to_peer"]) / steps),
        "rpc_bytes_per_step_peer_to_head": round(from_peer_step),
        "link_bytes_per_decode_step": round(per_step_link),
    })
    # what comes back from the peer is its hidden state (a row of n_embd floats per step), and
    # never the logits: those stay on the head, which holds the output layer
    assert activations <= from_peer_step < logits / 20, rows
    # head to peer: the input row plus the serialized graph of the peer's layers, which ggml
    # RPC sends with every graph_compute; all told well below one row of logits
    assert per_step_rpc < logits / 4, rows
    assert per_step_link < logits / 4, rows
    # the RPC connection is the bulk of what crosses the link while decoding
    assert rows[long]["rpc"] <= rows[long]["link"], rows


def test_killing_the_peer_stage_recovers(bed):
    before = rpc_server_pids()
    assert len(before) == 1, before
    t0 = time.monotonic()
    os.kill(before[0], signal.SIGKILL)
    last = None
    while time.monotonic() - t0 < 300:
        last = completion("After the outage, the service", 8, timeout=30, check=False)
        if "error" not in last:
            break
        time.sleep(2)
    assert "error" not in last, last
    FIGURES["peer_kill_recovered_s"] = round(time.monotonic() - t0, 1)
    after = rpc_server_pids()
    assert len(after) == 1 and after != before, (before, after)
    assert [a for a, _ in listeners(tb.PEER, tb.RPC_PORT)] == [f"{tb.PEER.ip}:{tb.RPC_PORT}"]


SERVING: dict[str, subprocess.Popen] = {}  # the `serve run` now running, when a test replaced the bed's


def answered_by(n: int) -> list[str]:
    """The engine replicas that answered ``n`` completions sent from the head."""
    code = (
        "import httpx, json\n"
        f"reps = [httpx.post('http://{tb.HEAD.ip}:{tb.HTTP_PORT}/v1/completions', json={{'prompt': f'Question {{i}}: "
        f"what is {{i}} times {{i}}?', 'max_tokens': 4}}, timeout=60).headers['x-engine-replica'] for i in range({n})]\n"
        f"props = httpx.get('http://{tb.HEAD.ip}:{tb.HTTP_PORT}/props', timeout=10).json()\n"
        f"print({tb.MARK!r} + json.dumps({{'replicas': reps, 'topology': props['topology']}}))\n"
    )
    return tb.printed_json(tb.head_python(code, timeout=300).stdout)


def engines_streaming() -> tuple[int, str]:
    """How many engine replicas the ingress holds an output stream to (each row of ``/slots``
    names its replica), and what the head printed when it could not tell."""
    code = (
        "import httpx, json\n"
        f"r = httpx.get('http://{tb.HEAD.ip}:{tb.HTTP_PORT}/slots', timeout=30)\n"
        f"print({tb.MARK!r} + json.dumps(len({{s['replica'] for s in r.json()}}) if r.status_code == 200 else 0))\n"
        "print(r.status_code, r.text[:300])\n"
    )
    out = tb.head_python(code, timeout=90, check=False)
    return tb.printed_json(out.stdout) or 0, (out.stdout + out.stderr)[-600:]


def test_replicas_are_refused_while_the_peer_lacks_the_model(bed):
    tb.serve_stop(bed)
    tb.serve_shutdown()
    proc = tb.serve_run("replicas", model_name="copy-on-the-head-only.gguf", log="serve-run-refused.log")
    # `serve run` of a config submits it and stays; the application's build fails on the
    # cluster: `serve status` says why (DEPLOY_FAILED), as the terminal does
    want = f"node(s) {tb.PEER.ip} lack the model file"
    deadline = time.monotonic() + 240
    status = ""
    try:
        while want not in status:
            assert time.monotonic() < deadline, status[-3000:] + (tb.STATE / "serve-run-refused.log").read_text()[-3000:]
            time.sleep(5)
            out = tb.on(tb.HEAD, f"cd ~/pipeline-groups && source .venv/bin/activate && {tb.AUTH} && serve status",
                        check=False).stdout
            status = " ".join(out.split())  # YAML folds long messages over lines
    finally:
        tb.serve_stop(proc)
    assert "DEPLOY_FAILED" in status and "copy-on-the-head-only.gguf" in status, status


def test_serve_run_in_the_replicas_topology_answers_from_both_nodes(bed):
    tb.serve_shutdown()  # the refused app
    tb.put_model(tb.PEER)  # what the ray up config's file_mounts do on a real pair
    t0 = time.monotonic()
    proc = tb.serve_run("replicas", log="serve-run-replicas.log")
    SERVING["proc"] = proc
    tb.wait_healthy(proc=proc, log="serve-run-replicas.log")
    # healthy once the ingress holds an output stream from one engine; the other node's engine
    # loads the model on its own node, which on a busy box takes minutes: wait for its stream
    deadline = time.monotonic() + 600
    while (seen := engines_streaming())[0] < 2:
        assert time.monotonic() < deadline, f"{seen[0]} engine replica(s) stream to the ingress after 600 s: {seen[1]}"
        time.sleep(3)
    deadline = time.monotonic() + 120
    got = answered_by(16)
    while len(set(got["replicas"])) < 2 and time.monotonic() < deadline:
        time.sleep(2)
        got = answered_by(16)
    assert got["topology"]["topology"] == "replicas", got
    assert len(set(got["replicas"])) == 2, got  # one engine per node, both answer
    assert not rpc_server_pids(), "replicas run no RPC stage"
    FIGURES["replicas_serve_run_healthy_s"] = round(time.monotonic() - t0, 1)
    FIGURES["replicas_answered_by"] = dict(collections.Counter(got["replicas"]))


def test_ray_down_stops_both_nodes(bed):
    tb.serve_stop(SERVING.get("proc", bed))
    FIGURES["ray_down_s"] = round(tb.ray_down(), 1)
    deadline = time.monotonic() + 30
    left: dict[str, list[int]] = {}
    while time.monotonic() < deadline:
        left = {n.name: ray_pids(n) for n in tb.NODES}
        if not any(left.values()):
            break
        time.sleep(1)
    assert not any(left.values()), {k: [tb._cmdline(p) for p in v] for k, v in left.items()}
