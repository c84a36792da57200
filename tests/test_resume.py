"""Resume in the ingress, against a fake engine whose replicas fail on cue: a request its
replica fails for a fault (the output stream ends, the engine fails it with a 503, the
restarted replica answers 503 first) goes on where it was, for every generating endpoint,
streamed and collected, with several choices and log probabilities: the client gets exactly
the tokens an unfaulted run gives, its usage counts the request as one, its finish_reason is
the unfaulted one. And the bounds: resume_limit, two replicas that failed it, resume_wait_s, a
client that left, a request's own error."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from deployments.api.llama import InfillRequest
from deployments.api.values import Submitted
from deployments.engine_deployment import NOT_CONNECTED
from engine.types import Delta, EngineRequest, Failure, Fault, Finish, FinishReason
from tests.fake_handle import FakeHandle, Streamed, fake_maker, fake_tokens

SPACE = 2**32 - 1
STAGE_FROZEN = "the RPC stage did not answer for 61 s (stage_timeout_s 60); the engine replica restarts"
GROUP_DIED = "engine unhealthy: group 0 failed"


def next_token(tokens: list[int], seed: int) -> int:
    """The fake model: each token a function of everything before it (greedy), and the seed."""
    return (31 * sum(tokens) + 7 * len(tokens) + 13 * seed) % 997 + 1


class Replica:
    def __init__(self, name: str) -> None:
        self.name = name
        self.alive = True
        self.emitted = 0  # tokens emitted over all its requests
        self.queue: asyncio.Queue = asyncio.Queue()
        self.conn: str | None = None
        self.running: dict[str, asyncio.Task] = {}
        self.refuse = 0  # submits it answers 503 first (restarting, no stream yet)


class FakeEngine(FakeHandle):
    """The ingress's engine handle: replicas ``r1``, ``r2``, ... serving one after the other
    (the next once the one before has died). ``cues``: (replica, tokens it has emitted) ->
    what happens then: ``die`` (its process: the stream ends), ``cut`` (the watchdog: a 503 to
    every request, then the stream ends), ``fail`` (a group: a 503 to every request, the
    replica serves on), ``error`` (a 400 to every request: the request's own)."""

    deployment_name = "fake-engine"

    def __init__(self, n_replicas: int = 3, cues: dict[tuple[str, int], str] | None = None,
                 refuse: dict[str, int] | None = None) -> None:
        self.replicas = [Replica(f"r{i + 1}") for i in range(n_replicas)]
        for r in self.replicas:
            r.refuse = (refuse or {}).get(r.name, 0)
        self.cues = dict(cues or {})
        self.submits: list[tuple[str, str, Any]] = []  # (replica, engine id, request) taken
        self.refused = 0

    @property
    def current(self) -> Replica:
        return next(r for r in self.replicas if r.alive)

    def _outputs(self, ingress_id: str, conn: str, replica: str | None = None) -> AsyncIterator[Any]:
        r = self.current

        async def stream() -> AsyncIterator[Any]:
            r.conn = conn
            yield {"connected": r.name}
            while True:
                item = await r.queue.get()
                if item == "died":
                    raise RuntimeError(f"the actor {r.name} died")
                if item == "closed":
                    return
                yield item

        return Streamed(stream())

    async def _submit(self, conns: dict, req: EngineRequest, **_: Any) -> Any:
        r = self.current
        if r.refuse:
            r.refuse -= 1
            self.refused += 1
            return _api_error(503, NOT_CONNECTED)
        if conns.get(r.name) != r.conn or r.conn is None:
            return _api_error(503, NOT_CONNECTED)
        rid, prompt, n, base, budget = req.id, req.prompt_tokens, req.n, req.n_resumed, req.params.max_tokens
        # the engine's seeding: its own seed where none was asked (0 here), followers seed + i; a
        # continuation's seed was advanced by the tokens it carries
        seed = (req.params.seed - base) % SPACE if base else (req.params.seed or 0)
        ids = [rid] + [f"{rid}#{i}" for i in range(1, n)]
        self.submits.append((r.name, rid, req))
        for i, eid in enumerate(ids):
            r.running[eid] = asyncio.get_running_loop().create_task(
                self._generate(r, eid, prompt, seed + i, budget, req.params.logprobs, base))
        return Submitted(len(prompt), budget, r.name, r.conn, 512, seed=seed)

    async def _generate(self, r: Replica, eid: str, prompt: list[int], seed: int, budget: int,
                        logprobs: int | None, base: int) -> None:
        tokens = list(prompt)
        try:
            for k in range(budget):
                await asyncio.sleep(0)
                if not r.alive or eid not in r.running:
                    return
                t = next_token(tokens, seed)
                tokens.append(t)
                r.emitted += 1
                last = k == budget - 1
                piece = f"<{t}>".encode()
                lp = ((piece, -0.5, ((piece, -0.5),)),) if logprobs is not None else None
                r.queue.put_nowait([Finish(eid, piece.decode(), 1, FinishReason.LENGTH, prompt_tokens=len(prompt),
                                           completion_tokens=k + 1, tokens=(t,), logprobs=lp) if last else
                                    Delta(eid, piece.decode(), 1, tokens=(t,), logprobs=lp)])
                if last:
                    return
                cue = self.cues.pop((r.name, r.emitted), None)
                if cue is not None:
                    self._cue(r, cue)
        finally:
            r.running.pop(eid, None)

    def _cue(self, r: Replica, cue: str) -> None:
        if cue in ("fail", "cut", "error"):
            error, fault = ("the request's own error", Fault.REQUEST) if cue == "error" else \
                (STAGE_FROZEN, Fault.STAGE_FROZEN) if cue == "cut" else (GROUP_DIED, Fault.ENGINE)
            r.queue.put_nowait([Failure(eid, fault, error) for eid in r.running])
            r.running.clear()
        if cue in ("die", "cut"):
            r.alive = False
            r.running.clear()
            r.queue.put_nowait("died" if cue == "die" else "closed")

    async def _cancel(self, request_id: str, n: int = 1, replica: str | None = None) -> bool:
        hit = False
        for r in self.replicas:
            for eid in [request_id] + [f"{request_id}#{i}" for i in range(1, n)]:
                hit = r.running.pop(eid, None) is not None or hit
        return hit


def _api_error(status: int, message: str) -> Any:
    from deployments.api.base import ApiError

    return ApiError(status, message)


def expected(text: str, n_tokens: int, seed: int = 0) -> list[int]:
    tokens = fake_tokens(text)
    out = []
    for _ in range(n_tokens):
        out.append(next_token(tokens + out, seed))
    return out


async def serve(engine: FakeEngine, monkeypatch: pytest.MonkeyPatch, **kw: Any) -> tuple[Any, httpx.AsyncClient]:
    import deployments.ingress as ingress_module

    cls = ingress_module.Ingress.func_or_class.__mro__[1]
    ing = object.__new__(cls)
    await cls.__init__(ing, engine, ["m"], **kw)
    ing.client.makers._maker = fake_maker()  # the fake model's (the ingress makes its prompts)
    # the fake vocabulary has no FIM tokens: an infill's prompt is its text's tokens
    monkeypatch.setattr(InfillRequest, "engine_prompt", lambda self, _maker: fake_tokens(self.prompt or "x"))
    monkeypatch.setattr(ingress_module, "_CURRENT", [ing])
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=ingress_module.app), base_url="http://127.0.0.1:8000",
                               timeout=30)
    return ing, client


async def stop(ing: Any, client: httpx.AsyncClient) -> None:
    await client.aclose()
    for t in [ing.out.discover_task, *ing.out.pumps.values(), *ing.resumer.tasks]:
        if t is not None:
            t.cancel()


def run(engine: FakeEngine, monkeypatch: pytest.MonkeyPatch, body: Any, **kw: Any) -> Any:
    async def main() -> Any:
        ing, client = await serve(engine, monkeypatch, **kw)
        try:
            return await asyncio.wait_for(body(ing, client), 30)
        finally:
            await stop(ing, client)

    return asyncio.run(main())


def tokens_in(text: str) -> list[int]:
    return [int(t) for t in re.findall(r"<(\d+)>", text)]


def events(body: str) -> list[dict]:
    return [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: {")]


VARYING = {"id", "created", "created_at", "timings", "system_fingerprint", "item_id", "call_id"}


def _drop(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _drop(x) for k, x in v.items() if k not in VARYING and not k.endswith("_id")}
    if isinstance(v, list):
        return [_drop(x) for x in v]
    return v


def same_but_times(a: str, b: str) -> bool:
    """Two answers (a JSON body or an event stream) that differ in ids and times only."""
    def parts(text: str) -> list[Any]:
        if not text.startswith("{"):
            return [line if not line.startswith("data: {") else _drop(json.loads(line[6:]))
                    for line in text.splitlines()]
        return [_drop(json.loads(text))]
    pa, pb = parts(a), parts(b)
    assert pa == pb
    return True


PROMPT = "The capital of France is"
N = 12

# ---- completions and chat, streamed and collected, n = 1 --------------------------------------------


@pytest.mark.parametrize("cue", ["die", "cut", "fail"])
def test_a_streamed_completion_goes_on_across_a_fault_with_every_token_once(monkeypatch, cue):
    engine = FakeEngine(cues={("r1", 5): cue})

    async def body(ing: Any, client: httpx.AsyncClient) -> None:
        r = await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": N, "stream": True,
                                                      "stream_options": {"include_usage": True}})
        evs = events(r.text)
        assert r.status_code == 200 and "error" not in r.text, r.text
        assert tokens_in("".join(c["text"] for e in evs for c in e["choices"])) == expected(PROMPT, N)
        assert [c["finish_reason"] for e in evs for c in e["choices"] if c["finish_reason"]] == ["length"]
        assert evs[-1]["usage"]["prompt_tokens"] == len(fake_tokens(PROMPT))
        assert evs[-1]["usage"]["completion_tokens"] == N
        assert r.text.endswith("data: [DONE]\n\n")
        cause = {"die": "replica_lost", "cut": "stage_frozen", "fail": "engine_failed"}[cue]
        m = ing.resumer.metrics
        assert m.count(m.resumes, cause=cause) == 1 and m.pause._sum.get() > 0  # noqa: SLF001
        cont = [req for _, _, req in engine.submits if req.n_resumed]
        assert len(cont) == 1 and cont[0].n_resumed == 5 and cont[0].params.max_tokens == N - 5
        assert ing.tables()["pending"] == 0

    run(engine, monkeypatch, body)


def test_a_collected_chat_answer_goes_on_across_a_replica_death(monkeypatch):
    engine = FakeEngine(cues={("r1", 3): "die"})
    messages = [{"role": "user", "content": "hi"}]

    async def body(ing: Any, client: httpx.AsyncClient) -> None:
        r = await client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": N})
        assert r.status_code == 200, r.text
        a = r.json()
        text = json.dumps([["user", "hi"]], ensure_ascii=False)
        assert tokens_in(a["choices"][0]["message"]["content"]) == expected(text, N)
        assert a["choices"][0]["finish_reason"] == "length"
        assert a["usage"]["prompt_tokens"] == len(fake_tokens(text)) and a["usage"]["completion_tokens"] == N
        assert r.headers["x-engine-replica"] == "r1"  # the replica it was taken by

    run(engine, monkeypatch, body)


def test_a_streamed_chat_goes_on_after_the_restarted_replica_answered_503(monkeypatch):
    engine = FakeEngine(cues={("r1", 4): "die"}, refuse={"r2": 2})

    async def body(ing: Any, client: httpx.AsyncClient) -> None:
        r = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "go"}],
                                                           "max_tokens": N, "stream": True})
        assert r.status_code == 200 and "error" not in r.text, r.text
        deltas = "".join(c["delta"].get("content") or "" for e in events(r.text) for c in e["choices"])
        assert tokens_in(deltas) == expected(json.dumps([["user", "go"]]), N)
        assert engine.refused == 2

    run(engine, monkeypatch, body)


# ---- several choices, log probabilities ---------------------------------------------------------------


def test_each_of_several_choices_resumes_with_its_own_tokens(monkeypatch):
    engine = FakeEngine(cues={("r1", 7): "die"})

    async def body(ing: Any, client: httpx.AsyncClient) -> None:
        r = await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": N, "n": 3, "seed": 5,
                                                      "logprobs": 1})
        assert r.status_code == 200, r.text
        a = r.json()
        for c in a["choices"]:
            want = expected(PROMPT, N, seed=5 + c["index"])
            assert tokens_in(c["text"]) == want
            assert tokens_in("".join(c["logprobs"]["tokens"])) == want  # one log probability a token
            assert c["finish_reason"] == "length"
        assert len({c["text"] for c in a["choices"]}) == 3
        assert a["usage"]["completion_tokens"] == 3 * N
        conts = [req for _, _, req in engine.submits if req.n_resumed]
        assert len(conts) == 3 and sum(c.n_resumed for c in conts) == 7

    run(engine, monkeypatch, body)


# ---- every generating endpoint ------------------------------------------------------------------------


ENDPOINTS = {
    "/v1/responses": {"input": "hi", "max_output_tokens": N},
    "/v1/messages": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": N},
    "/completion": {"prompt": PROMPT, "n_predict": N},
    "/infill": {"input_prefix": "def f(", "input_suffix": "):", "n_predict": N},
}


@pytest.mark.parametrize("path", list(ENDPOINTS))
@pytest.mark.parametrize("stream", [False, True])
def test_every_endpoint_goes_on_across_a_fault_as_if_unfaulted(monkeypatch, path, stream):
    def answer(cues: dict) -> str:
        async def body(ing: Any, client: httpx.AsyncClient) -> str:
            r = await client.post(path, json={**ENDPOINTS[path], "stream": stream})
            assert r.status_code == 200, r.text
            return r.text

        return run(FakeEngine(cues=cues), monkeypatch, body)

    unfaulted = answer({})
    faulted = answer({("r1", 4): "die"})
    assert len(tokens_in(unfaulted)) >= N
    assert tokens_in(faulted) == tokens_in(unfaulted)
    assert same_but_times(faulted, unfaulted)


# ---- the bounds ---------------------------------------------------------------------------------------


def test_a_fault_past_resume_limit_fails_the_request(monkeypatch):
    engine = FakeEngine(cues={("r1", 3): "fail", ("r1", 6): "fail"})

    async def body(ing: Any, client: httpx.AsyncClient) -> None:
        r = await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": N})
        assert r.status_code == 503 and "resume_limit 1" in r.text, r.text
        m = ing.resumer.metrics
        assert m.count(m.resumes, cause="engine_failed") == 1 and m.count(m.failed_total, reason="limit") == 1

    run(engine, monkeypatch, body, resume_limit=1)


def test_the_same_replica_failing_twice_is_resumed_twice(monkeypatch):
    engine = FakeEngine(cues={("r1", 3): "fail", ("r1", 6): "fail"})

    async def body(ing: Any, client: httpx.AsyncClient) -> None:
        r = await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": N})
        assert r.status_code == 200, r.text
        assert tokens_in(r.json()["choices"][0]["text"]) == expected(PROMPT, N)

    run(engine, monkeypatch, body)


def test_a_request_two_replicas_failed_is_not_resumed_on_a_third(monkeypatch):
    engine = FakeEngine(cues={("r1", 3): "die", ("r2", 3): "die"})

    async def body(ing: Any, client: httpx.AsyncClient) -> None:
        r = await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": N, "stream": True})
        evs = events(r.text)
        assert tokens_in("".join(c["text"] for e in evs if "choices" in e for c in e["choices"])) == \
            expected(PROMPT, 6)
        assert evs[-1]["error"]["code"] == 503 and "two engine replicas" in evs[-1]["error"]["message"]
        m = ing.resumer.metrics
        assert m.count(m.failed_total, reason="replicas") == 1
        assert [name for name, _, _ in engine.submits] == ["r1", "r2"]

    run(engine, monkeypatch, body)


def test_a_request_no_replica_takes_within_resume_wait_s_fails(monkeypatch):
    engine = FakeEngine(cues={("r1", 3): "die"}, refuse={"r2": 10**6})

    async def body(ing: Any, client: httpx.AsyncClient) -> None:
        r = await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": N})
        assert r.status_code == 503 and "resume_wait_s" in r.text, r.text
        m = ing.resumer.metrics
        assert m.count(m.failed_total, reason="wait") == 1 and engine.refused >= 1

    run(engine, monkeypatch, body, resume_wait_s=0.3)


def test_the_requests_own_error_is_not_resumed(monkeypatch):
    engine = FakeEngine(cues={("r1", 3): "error"})

    async def body(ing: Any, client: httpx.AsyncClient) -> None:
        r = await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": N})
        assert r.status_code == 400, r.text
        assert len(engine.submits) == 1

    run(engine, monkeypatch, body)


def test_a_request_whose_client_left_while_it_waited_is_never_resumed(monkeypatch):
    engine = FakeEngine(cues={("r1", 3): "die"}, refuse={"r2": 10**6})

    async def body(ing: Any, client: httpx.AsyncClient) -> None:
        req = asyncio.create_task(client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": N}))
        while not engine.refused:  # the resume is waiting for a replica to take it
            await asyncio.sleep(0.01)
        req.cancel()  # the client goes
        await asyncio.gather(req, return_exceptions=True)
        engine.replicas[1].refuse = 0  # the replica serves now: nothing is sent to it
        while ing.resumer.tasks:
            await asyncio.sleep(0.01)
        assert [name for name, _, _ in engine.submits] == ["r1"]
        assert ing.tables()["pending"] == 0

    run(engine, monkeypatch, body)


def test_a_continuation_is_routed_away_from_the_replicas_that_failed_it():
    from deployments.resume import resume_route

    conns = {"a": "c1", "b": "c2", "c": "c3"}
    assert resume_route(conns, {"a"}).replicas == ("b", "c")
    assert resume_route(conns, {"a", "c"}).replicas == ("b",)
    # no other: the one there is, which serves again once restarted
    assert resume_route({"a": "c1"}, {"a"}).replicas == ("a",)
