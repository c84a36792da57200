"""Conversations and agent loops against llama-server in one run (``make bench-chat``): how much
of each returning history a server computes again.

- ``chat``: ``--conversations`` (24) clients, each one conversation of ``--turns`` (6) turns over
  the OpenAI chat API, streamed: a shared system prompt (~220 tokens), then each turn a new user
  message (~220 tokens) appended to the history with the answers so far (``--answer``, 48 tokens,
  greedy); a client sends its next turn when its answer is in.
- ``agent``: one client, an agent loop: a system prompt with tool descriptions, then
  ``--steps`` (12) steps, each appending the model's answer and a tool result (~300 tokens) and
  asking again: the step's first-token time as its history grows.

The servers, each fresh and alone on the machine, in this order: this project as ``make serve``
serves it (deployments/configs/local.yaml: SmolLM2-135M-Instruct split over the RPC stage on the
local two-node Ray cluster, 15 of its 30 layers on the peer, two groups, 8 slots of 4,096 tokens,
the prompt cache); llama-server with rpc-server on the same split, slots and context
(``LLAMA_SERVER_BIN``), with ``--cache-ram 8192`` (its default) and with ``--cache-ram 0`` (the
seed's advice on a split). Per server: prompt tokens computed against sent (from each answer's
``timings``: ``prompt_n`` evaluated and ``cache_n`` reused, both servers report them), the share
of the previous turn's prompt and answer reused, first-token time by turn (median), the whole
run's seconds and the agent's step times. Prints the tables; writes bench/results/chat.{json,md}.

    python -m bench.chat [--conversations 24] [--turns 6] [--servers "pipeline-groups;llama-server cache-ram 8192"]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from bench.stack import demo_args
from engine.models import CHAT_MODEL

RESULTS = Path(__file__).resolve().parent / "results"
LS_PORT, LS_RPC, RPC_PORT = 50184, 50185, 50186
N_PEER, N_LAYER = 15, 30
SLOTS, N_CTX_SLOT = 8, 4096
WORDS = ("the river model stage layer token group cache prompt answer question system node link "
         "memory device thread batch context slot history agent tool result file line code test "
         "build value error report figure table chart order plan step run time speed cost budget "
         "window state copy restore save entry evict route balance split peer local output").split()


def text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words)) + "."


@dataclass
class Turn:
    conversation: int
    turn: int
    ttft_s: float
    prompt_sent: int  # prompt tokens of the request
    evaluated: int  # ... the server computed (timings.prompt_n)
    reused: int  # ... it took from a cache (timings.cache_n)
    history: int  # prompt tokens of the previous turn plus its answer (0 on a first turn)
    answer_tokens: int
    error: str = ""


@dataclass
class Result:
    server: str
    wall_s: float = 0.0
    turns: list[Turn] = field(default_factory=list)
    agent: list[Turn] = field(default_factory=list)
    agent_wall_s: float = 0.0
    retries: int = 0  # requests sent again after the server closed a kept-alive connection
    cache: dict = field(default_factory=dict)  # this project's prompt cache counters after the chat


def ask(client: httpx.Client, messages: list[dict], max_tokens: int) -> tuple[str, float, dict]:
    """One streamed chat completion: (its text, seconds to the first token, the final timings
    and usage)."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "timings_per_token": False}
    t0 = time.monotonic()
    first = 0.0
    parts: list[str] = []
    final: dict = {}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            d = json.loads(line[6:])
            if "error" in d:
                raise RuntimeError(str(d["error"]))
            for c in d.get("choices") or ():
                piece = (c.get("delta") or {}).get("content")
                if piece:
                    if not first:
                        first = time.monotonic() - t0
                    parts.append(piece)
            if d.get("timings"):
                final["timings"] = d["timings"]
            if d.get("usage"):
                final["usage"] = d["usage"]
    return "".join(parts), first or (time.monotonic() - t0), final


def figures(final: dict) -> tuple[int, int, int, int]:
    """(prompt sent, evaluated, reused, answer tokens) of an answer's timings and usage."""
    t, u = final.get("timings") or {}, final.get("usage") or {}
    sent = int(u.get("prompt_tokens") or (t.get("prompt_n", 0) + t.get("cache_n", 0)))
    reused = int(t.get("cache_n", (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)))
    evaluated = int(t.get("prompt_n", sent - reused))
    return sent, evaluated, reused, int(u.get("completion_tokens") or t.get("predicted_n", 0))


def conversation(client: httpx.Client, i: int, n_turns: int, answer: int, system: str, out: list[Turn],
                 lock: threading.Lock, retries: list[int]) -> None:
    rng = random.Random(1000 + i)
    messages = [{"role": "system", "content": system}]
    history = 0
    for k in range(n_turns):
        messages.append({"role": "user", "content": f"Question {k + 1} of conversation {i}: " + text(rng, 150)})
        for attempt in range(3):
            try:
                reply, ttft, final = ask(client, messages, answer)
                break
            except httpx.RemoteProtocolError:
                # a server closed a kept-alive connection as the request went out (llama-server
                # does): sent again on a new one, as clients do; counted
                with lock:
                    retries[0] += 1
                if attempt == 2:
                    raise
            except Exception as e:  # a lost conversation is reported, not retried
                with lock:
                    out.append(Turn(i, k, 0.0, 0, 0, 0, history, 0, error=str(e)[:200]))
                return
        sent, evaluated, reused, n_answer = figures(final)
        with lock:
            out.append(Turn(i, k, ttft, sent, evaluated, reused, history, n_answer))
        messages.append({"role": "assistant", "content": reply})
        history = sent + n_answer


def chat_cell(base: str, n_conv: int, n_turns: int, answer: int) -> tuple[list[Turn], float, int]:
    system = "You are a careful assistant for a team that runs language models on two machines. " + text(
        random.Random(7), 160)
    out: list[Turn] = []
    lock = threading.Lock()
    retries = [0]
    with httpx.Client(base_url=base, timeout=1800, limits=httpx.Limits(max_connections=n_conv + 4)) as client:
        t0 = time.monotonic()
        threads = [threading.Thread(target=conversation, args=(client, i, n_turns, answer, system, out, lock, retries))
                   for i in range(n_conv)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out, time.monotonic() - t0, retries[0]


def agent_cell(base: str, n_steps: int) -> tuple[list[Turn], float]:
    rng = random.Random(99)
    system = ("You are a coding agent. Tools: read_file(path), run_tests(), edit(path, text). Call one tool a "
              "step, then read its result. " + text(rng, 200))
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Fix the failing test. " + text(rng, 60)}]
    out: list[Turn] = []
    history = 0
    with httpx.Client(base_url=base, timeout=1800) as client:
        t0 = time.monotonic()
        for k in range(n_steps):
            reply, ttft, final = ask(client, messages, 32)
            sent, evaluated, reused, n_answer = figures(final)
            out.append(Turn(0, k, ttft, sent, evaluated, reused, history, n_answer))
            history = sent + n_answer
            messages += [{"role": "assistant", "content": reply},
                         {"role": "user", "content": f"Tool result {k + 1}: " + text(rng, 220)}]
        return out, time.monotonic() - t0


CACHE_SERIES = ("hits", "reused_tokens", "saves", "evictions", "elsewhere_requests", "elsewhere_tokens",
                "moved_in_requests", "moved_in_tokens")


def cache_figures(base: str) -> dict[str, float]:
    """This project's prompt cache counters, summed over groups (none from llama-server)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    r = httpx.get(base + "/metrics", timeout=30)
    if r.status_code != 200:
        return out
    for fam in text_string_to_metric_families(r.text):
        for smp in fam.samples:
            name = smp.name.removeprefix("pgroups_prompt_cache_").removesuffix("_total")
            if smp.name.startswith("pgroups_prompt_cache_") and name in CACHE_SERIES:
                out[name] = out.get(name, 0.0) + smp.value
    return out


def ours(cache: dict | None = None) -> tuple[str, Callable[[], None]]:
    from bench.stack import HttpStack

    stack = HttpStack()
    try:
        stack.deploy(demo_args(RPC_PORT, **{"n_parallel": SLOTS, "n_ctx": SLOTS * N_CTX_SLOT, "peer_layers": N_PEER,
                                            **(cache or {})}))
    except BaseException:
        stack.close()
        raise
    return stack.base, stack.close


def llama_server(cache_ram: int) -> tuple[str, Callable[[], None]]:
    from bench.llama_server import LlamaServer

    ls = LlamaServer(CHAT_MODEL, n_layer=N_LAYER, n_peer=N_PEER, output_local=True, slots=SLOTS,
                     n_ctx=SLOTS * N_CTX_SLOT, port=LS_PORT, rpc_port=LS_RPC, cache_ram_mib=cache_ram)
    return ls.base, ls.close


SERVERS: dict[str, Callable[[], tuple[str, Callable[[], None]]]] = {
    "pipeline-groups": ours,
    "pipeline-groups, no prompt cache": lambda: ours({"prompt_cache_mib": 0}),
    "pipeline-groups, prompt cache 3 GiB": lambda: ours({"prompt_cache_mib": 3072}),
    "llama-server cache-ram 8192": lambda: llama_server(8192),
    "llama-server cache-ram 0": lambda: llama_server(0),
}
DEFAULT_SERVERS = ["pipeline-groups", "llama-server cache-ram 8192", "llama-server cache-ram 0"]


def summary(r: Result) -> dict:
    ok = [t for t in r.turns if not t.error]
    later = [t for t in ok if t.turn > 0]
    by_turn = {}
    for k in sorted({t.turn for t in ok}):
        ts = [t for t in ok if t.turn == k]
        by_turn[k + 1] = {"ttft_median_s": round(statistics.median(t.ttft_s for t in ts), 2),
                          "reused_share": round(statistics.median(t.reused / max(t.prompt_sent, 1) for t in ts), 2)}
    history = sum(t.history for t in later)
    steps = [t.ttft_s for t in r.agent]
    return {
        "server": r.server,
        "conversations_lost": len({t.conversation for t in r.turns if t.error}),
        "retries": r.retries,
        "prompt_evaluated": sum(t.evaluated for t in ok),
        "prompt_sent": sum(t.prompt_sent for t in ok),
        # of what a returning turn resent (the previous prompt and its answer), the share reused
        "history_reused": round(sum(min(t.reused, t.history) for t in later) / max(history, 1), 3),
        "later_ttft_median_s": round(statistics.median(t.ttft_s for t in later), 2) if later else None,
        "by_turn": by_turn,
        "wall_s": round(r.wall_s, 1),
        "agent_step_ttft_s": [round(s, 2) for s in steps],
        "agent_evaluated": [t.evaluated for t in r.agent],
        "agent_wall_s": round(r.agent_wall_s, 1),
        "prompt_cache": r.cache,
    }


def tables(rows: list[dict], meta: dict) -> str:
    head = ["| server | prompt tokens computed / sent | history reused (turns 2+) | first token, turns 2+ (median) "
            "| first token by turn (median, s) | whole run | lost (resent) |", "|---|---|---|---|---|---|---|"]
    for s in rows:
        bt = " / ".join(f"{v['ttft_median_s']}" for v in s["by_turn"].values())
        head.append(f"| {s['server']} | {s['prompt_evaluated']:,} / {s['prompt_sent']:,} | {s['history_reused']} | "
                    f"{s['later_ttft_median_s']} s | {bt} | {s['wall_s']} s | {s['conversations_lost']} ({s['retries']}) |")
    head += ["", "Agent loop (one client; a tool result of ~300 tokens appended a step): first token a step, s, "
             "and prompt tokens computed a step", "", "| server | step first tokens | computed a step | whole loop |",
             "|---|---|---|---|"]
    for s in rows:
        head.append(f"| {s['server']} | {' '.join(map(str, s['agent_step_ttft_s']))} | "
                    f"{' '.join(map(str, s['agent_evaluated']))} | {s['agent_wall_s']} s |")
    head += ["", f"{meta['conversations']} conversations x {meta['turns']} turns over {SLOTS} slots of {N_CTX_SLOT} tokens; "
             f"{meta['cpu']}; `{meta['command']}`."]
    return "\n".join(head)


def main(argv: list[str] | None = None) -> int:
    from bench import cpu

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--conversations", type=int, default=24)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--answer", type=int, default=48)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--servers", default=";".join(DEFAULT_SERVERS), help=f"of: {'; '.join(SERVERS)}")
    ap.add_argument("--out", default=str(RESULTS))
    a = ap.parse_args(argv)
    rows = []
    for name in [s.strip() for s in a.servers.split(";") if s.strip()]:
        try:
            base, close = SERVERS[name]()
        except FileNotFoundError as e:  # llama-server not built
            print(f"{name}: skipped ({e})", file=sys.stderr)
            continue
        try:
            r = Result(name)
            r.turns, r.wall_s, r.retries = chat_cell(base, a.conversations, a.turns, a.answer)
            r.cache = cache_figures(base)
            r.agent, r.agent_wall_s = agent_cell(base, a.steps)
        finally:
            close()
        s = summary(r)
        print(json.dumps(s), flush=True)
        rows.append({**s, "turns": [asdict(t) for t in r.turns], "agent": [asdict(t) for t in r.agent]})
    meta = {"conversations": a.conversations, "turns": a.turns, "cpu": cpu.describe(),
            "command": "python -m bench.chat " + " ".join(argv if argv is not None else sys.argv[1:])}
    md = tables(rows, meta)
    print(md)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "chat.json").write_text(json.dumps({"meta": meta, "servers": rows}, indent=1))
    (out / "chat.md").write_text(md + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
