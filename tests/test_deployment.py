"""The deployment classes on their own event loop (no Ray): output streams keyed by
connection, request preparation off the loop, the frozen-peer watchdog and the drain."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from deployments.api.openai import CompletionRequest
from deployments.api.values import Submitted
from deployments.engine_deployment import NOT_CONNECTED, STAGE_POLL_S, EngineDeployment
from deployments.prompts import PromptMaker
from engine.types import SHUTTING_DOWN, Decode, Fault, Output

LONG = {"prompt": "a long request", "max_tokens": 100_000, "ignore_eos": True}
SHORT = {"prompt": "a short request", "max_tokens": 4}


async def make_deployment(config: dict, **kw: Any) -> Any:
    cls = EngineDeployment.func_or_class
    d = cls.__new__(cls)
    await cls.__init__(d, config, **kw)
    return d


def run(model_path: str, body: Callable, **cfg: Any) -> None:
    """Run ``body(deployment)`` on a fresh event loop; close the engine after."""

    async def main() -> None:
        d = await make_deployment({"model": model_path, "n_threads": 1, "n_parallel": 2, **cfg})
        try:
            await body(d)
        finally:
            for task in (d._watchdog, d._server_watch):  # noqa: SLF001
                if task is not None:
                    task.cancel()
            await asyncio.to_thread(d.engine.close)

    asyncio.run(main())


async def submit(d: Any, conn: str, rid: str, api_req: Any) -> Any:
    """``api_req``'s prompt made as the ingress makes it (with the engine's own tokenizer), then
    submitted on ``conn``."""
    er = api_req.served_as().prepare(PromptMaker.of_engine(d.engine), rid).request
    return await d.submit(conn, er)


async def connect(d: Any, ingress: str, conn: str) -> Any:
    stream = d.outputs(ingress, conn)
    hello = await stream.__anext__()
    assert "connected" in hello
    return stream


async def next_outputs(stream: Any, timeout: float = 30.0) -> list[Output]:
    return list(await asyncio.wait_for(stream.__anext__(), timeout))


def test_a_second_stream_of_one_ingress_neither_takes_nor_drops_the_firsts_requests(model_path):
    async def body(d: Any) -> None:
        a = await connect(d, "ingress-1", "conn-a")
        res = await submit(d, "conn-a", "r1", CompletionRequest(**LONG))
        assert isinstance(res, Submitted), res
        b = await connect(d, "ingress-1", "conn-b")  # the same ingress opens a second stream
        outs = await next_outputs(a)
        assert outs and all(o.request_id == "r1" for o in outs)
        await b.aclose()  # the second stream ends: the first one's request runs on
        got = await next_outputs(a)
        assert all(o.finish_reason is None for o in got)
        assert d.tables()["owners"] == 1
        await a.aclose()  # its own stream ends: now the request is cancelled
        for _ in range(100):
            if d.tables()["running"] == 0:
                break
            await asyncio.sleep(0.05)
        t = d.tables()
        assert t["owners"] == t["connections"] == t["running"] == t["active_slots"] == 0, t

    run(model_path, body)


def test_a_submit_on_a_connection_this_replica_does_not_hold_is_503(model_path):
    async def body(d: Any) -> None:
        res = await submit(d, "never-opened", "r1", CompletionRequest(**SHORT))
        assert res.status == 503 and res.message == NOT_CONNECTED
        assert d.tables()["owners"] == 0

    run(model_path, body)


def test_accepting_a_request_runs_off_the_event_loop(model_path):
    """While one request is being accepted (its checks, its grammar's compilation), the loop
    that delivers every stream keeps running: another call completes before it does."""

    async def body(d: Any) -> None:
        stream = await connect(d, "ingress-1", "c")  # held: a stream that is dropped closes
        release = threading.Event()
        entered = threading.Event()
        real = d.engine.make_request

        def slow_make_request(*a: Any, **kw: Any) -> Any:
            entered.set()
            release.wait(20)
            return real(*a, **kw)

        d.engine.make_request = slow_make_request
        task = asyncio.create_task(submit(d, "c", "r1", CompletionRequest(**SHORT)))
        while not entered.is_set():
            await asyncio.sleep(0.01)
        info = await asyncio.wait_for(d.info(), 5)  # the loop is free meanwhile
        assert info["model"] and not release.is_set() and not task.done()
        release.set()
        assert isinstance(await task, Submitted)
        await stream.aclose()

    run(model_path, body)


def test_the_watchdog_fails_in_flight_requests_and_reports_unhealthy(model_path):
    async def body(d: Any) -> None:
        s = await connect(d, "ingress-1", "c")
        assert isinstance(await submit(d, "c", "r1", CompletionRequest(**LONG)), Submitted)
        await next_outputs(s)
        d.engine.decodes = lambda: [Decode(0, 10.0, None, 1.0)]  # a decode blocked for 10 s on the peer
        deadline = time.monotonic() + 10
        final = None
        while final is None:
            assert time.monotonic() < deadline
            for o in await next_outputs(s):
                if o.finish_reason is not None:
                    final = o
        assert final.finish_reason == "error" and final.fault is Fault.STAGE_FROZEN and "did not answer" in final.message
        with pytest.raises(StopAsyncIteration):  # the stream ends: Serve's drain is not held
            await asyncio.wait_for(s.__anext__(), 5)
        with pytest.raises(RuntimeError):
            d.check_health()
        assert not (await d.info())["healthy"]
        assert (await submit(d, "c", "r2", CompletionRequest(**SHORT))).status == 503
        deadline = time.monotonic() + 10
        while not replaced:  # the frozen server is replaced, not waited for
            assert time.monotonic() < deadline, "the watchdog did not ask for a fresh server"
            await asyncio.sleep(0.05)
        assert replaced == [4321]

    replaced: list[int] = []

    class Stage:  # the stage actor's two calls the watchdog makes, as awaitables
        class replace_server:  # noqa: N801
            @staticmethod
            async def remote(pid: int) -> bool:
                replaced.append(pid)
                return True

    async def health() -> dict:
        return {"pid": 4321, "accepting": True, "cpu_seconds": 0.0, "threads": 1}

    async def with_stage(d: Any) -> None:
        d.stage_timeout_s = 2.0  # as if an RPC stage were configured
        d._stage, d._stage_health = Stage, health  # noqa: SLF001
        d._watchdog = asyncio.get_running_loop().create_task(d._watch())  # noqa: SLF001
        await body(d)

    run(model_path, with_stage)


def test_a_stage_server_restarted_while_idle_fails_the_replica_before_any_request_meets_it(model_path):
    """The KV of the cached conversations lives in the server process the model was loaded on:
    when the stage's server is another process (killed and restarted between turns), the replica
    fails by itself, its entries counted as lost, and no request is served from it."""
    server = {"pid": 4321}

    async def health() -> dict:
        return {**server, "accepting": True, "cpu_seconds": 0.0, "threads": 1}

    async def body(d: Any) -> None:
        d._stage_health, d._stage_pid = health, 4321  # noqa: SLF001  as if loaded on a stage's server
        d._server_watch = asyncio.get_running_loop().create_task(d._watch_stage_server())  # noqa: SLF001
        s = await connect(d, "ingress-1", "c")
        for i in range(3):  # two slots: the third conversation saves the first into the prompt cache
            body = {"prompt": f"conversation {i} " + "with a history worth keeping " * 8, "max_tokens": 2}
            assert isinstance(await submit(d, "c", f"r{i}", CompletionRequest(**body)), Submitted)
            while not any(o.finish_reason for o in await next_outputs(s)):
                pass
        deadline = time.monotonic() + 10
        while sum(p.cache_entries for p in d.engine.profiles()) < 1:
            assert time.monotonic() < deadline, "nothing was saved into the prompt cache"
            await asyncio.sleep(0.05)
        await asyncio.sleep(2.5 * STAGE_POLL_S)  # the same server: nothing happens
        d.check_health()
        server["pid"] = 5555  # the server was killed and its supervisor started another
        deadline = time.monotonic() + 10
        while d._failed is None:  # noqa: SLF001
            assert time.monotonic() < deadline, "the replica did not see the stage's new server"
            await asyncio.sleep(0.05)
        with pytest.raises(RuntimeError, match="restarted"):
            d.check_health()
        assert (await submit(d, "c", "r9", CompletionRequest(**SHORT))).status == 503
        lost = d.metrics.registry.get_sample_value(
            "pgroups_prompt_cache_lost_entries_total", {"model": d.model_name, "replica": "local", "cause": "stage_restart"})
        assert lost == sum(p.cache_entries for p in d.engine.profiles()) >= 1

    run(model_path, body)


def test_drain_finishes_short_requests_and_cuts_long_ones_with_an_error(model_path):
    async def body(d: Any) -> None:
        s = await connect(d, "ingress-1", "c")
        assert isinstance(await submit(d, "c", "long", CompletionRequest(**LONG)), Submitted)
        assert isinstance(await submit(d, "c", "short", CompletionRequest(**SHORT)), Submitted)
        res = await d.drain(1.0)
        assert res["cut"] == 1
        finals: dict[str, Output] = {}
        try:
            while True:
                for o in await next_outputs(s, 10):
                    if o.finish_reason is not None:
                        finals[o.request_id] = o
        except StopAsyncIteration:
            pass
        assert finals["short"].finish_reason == "length"
        assert finals["long"].finish_reason == "error" and finals["long"].message == SHUTTING_DOWN
        assert finals["long"].fault is Fault.SHUTDOWN
        assert (await submit(d, "c", "late", CompletionRequest(**SHORT))).status == 503

    run(model_path, body, n_ctx=65536)  # the long request cannot finish in the grace time on a fast CPU


def test_llama_servers_utility_endpoints(model_path):
    """The tokenizer's endpoints run in the ingress's client on the model's vocabulary (here the
    engine's own tokenizer), /props is shaped there from the replica's report."""
    from concurrent.futures import ThreadPoolExecutor

    from deployments.api.base import ApiError, read_request
    from deployments.api.llama import ApplyTemplateRequest, DetokenizeRequest, TokenizeRequest
    from deployments.api.server_info import llama_props
    from deployments.client import EngineClient
    from deployments.resume import ResumeSettings

    def tok(**body: Any) -> TokenizeRequest:
        return read_request(TokenizeRequest, body)[0]

    async def body(d: Any) -> None:
        client = EngineClient(None, 1.0, None, ResumeSettings(), ThreadPoolExecutor(1))
        client.makers._maker = PromptMaker.of_engine(d.engine)  # noqa: SLF001

        async def call(req: Any) -> Any:
            try:
                return await client.call(req, 0)
            except ApiError as e:
                return e

        d.run = call
        toks = (await d.run(tok(content="hello world")))["tokens"]
        assert toks and all(isinstance(t, int) for t in toks)
        assert (await d.run(tok(content="hello world", add_special=True)))["tokens"][1:] == toks
        pieces = (await d.run(tok(content="hello world", with_pieces=True)))["tokens"]
        assert [p["id"] for p in pieces] == toks and "".join(p["piece"] for p in pieces).strip() == "hello world"
        assert (await d.run(DetokenizeRequest(tokens=toks)))["content"].strip() == "hello world"
        bad = await d.run(DetokenizeRequest(tokens=[1, 10**9]))
        assert bad.status == 400 and "out of range" in bad.message
        with pytest.raises(ApiError, match="content"):  # refused at the boundary, before the engine
            read_request(TokenizeRequest, {"content": 5})
        prompt = (await d.run(ApplyTemplateRequest(messages=[{"role": "user", "content": "hi"}])))["prompt"]
        assert "hi" in prompt and prompt != "hi"
        props = llama_props(d.engine.tokenizer, await d.props())
        assert props["total_slots"] == 2 and props["default_generation_settings"]["n_ctx"] == d.engine.n_ctx_slot
        assert props["chat_template"]

    run(model_path, body)


# what llama-server writes in /props default_generation_settings.params with its defaults
# (tools/server/server-task.cpp, task_params::to_json(only_metrics), ggml-org/llama.cpp at 00efb3e1):
# a client synced with it (its web UI) may send these back to this server as they are
LLAMA_SERVER_PARAMS = {
    "seed": 4294967295, "temperature": 0.8, "dynatemp_range": 0.0, "dynatemp_exponent": 1.0, "top_k": 40,
    "top_p": 0.95, "min_p": 0.05, "top_n_sigma": -1.0, "xtc_probability": 0.0, "xtc_threshold": 0.1,
    "typical_p": 1.0, "repeat_last_n": 64, "repeat_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
    "dry_multiplier": 0.0, "dry_base": 1.75, "dry_allowed_length": 2, "dry_penalty_last_n": -1, "mirostat": 0,
    "mirostat_tau": 5.0, "mirostat_eta": 0.1, "max_tokens": -1, "n_predict": -1, "n_keep": 0, "n_discard": 0,
    "ignore_eos": False, "stream": True, "n_probs": 0, "min_keep": 0, "chat_format": "Content-only",
    "reasoning_format": "auto", "reasoning_in_content": False, "thinking_forced_open": False,
    "samplers": ["penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature"],
    "speculative.n_max": 16, "speculative.n_min": 0, "speculative.p_min": 0.75, "speculative.type": "none",
    "speculative.ngram_size_n": 12, "speculative.ngram_size_m": 48, "speculative.ngram_m_hits": 1,
    "timings_per_token": False, "post_sampling_probs": False, "backend_sampling": False, "lora": [],
}
# and what its /slots and answers' generation_settings add (task_params::to_json())
LLAMA_SERVER_SLOT_PARAMS = {**LLAMA_SERVER_PARAMS, "dry_sequence_breakers": ["\n", ":", "\"", "*"], "stop": [],
                            "logit_bias": [], "grammar": "", "grammar_lazy": False, "grammar_triggers": [],
                            "preserved_tokens": []}


def test_props_params_sent_back_are_served_with_their_meaning(model_path):
    """Every field of /props default_generation_settings.params, ours and llama-server's, sent
    back through /completion and chat as it was written: each one known (strict_request_fields
    would refuse another), each meaning what it meant there (the server's default sampling:
    seed 4294967295 random, n_probs 0 no probabilities, the default chain named in full), and
    the request served."""
    from deployments.api.base import ApiError, read_request
    from deployments.api.llama import LlamaCompletionRequest
    from deployments.api.openai import ChatCompletionRequest
    from deployments.api.server_info import llama_props
    from engine.params import SamplingParams

    routes = ((LlamaCompletionRequest, {"prompt": "hi"}),
              (ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}]}))

    async def body(d: Any) -> None:
        ours = llama_props(d.engine.tokenizer, await d.props())["default_generation_settings"]["params"]
        n_ctx, spec = d.engine.n_ctx_slot, d.config.speculative is not None
        seed = d.config.seed if d.config.seed >= 0 else None
        written = [(ours, SamplingParams(max_tokens=n_ctx, seed=seed, speculative=spec)),
                   (LLAMA_SERVER_PARAMS, SamplingParams(max_tokens=n_ctx, speculative=False)),  # its type: none
                   (LLAMA_SERVER_SLOT_PARAMS, SamplingParams(max_tokens=n_ctx, speculative=False))]
        assert ours["seed"] == 4294967295 and ours["n_probs"] == 0 and ours["samplers"]
        stream = await connect(d, "ingress-1", "c")
        for i, (params, meant) in enumerate(written):
            for model, extra in routes:
                req, unknown = read_request(model, {**params, **extra}, strict=True)
                assert unknown == [] and req.stream is True and req.n_logprobs() is None, (model, unknown)
                assert req.sampling(n_ctx) == meant, (model, i, req.sampling(n_ctx))
                rid = f"r{i}-{model.__name__}"
                res = await submit(d, "c", rid, req)  # until the slot is full (n_predict -1): cut once it runs
                assert isinstance(res, Submitted) and res.n_predict > 0, res
                while rid not in {o.request_id for o in await next_outputs(stream)}:
                    pass
                assert await d.cancel(rid)
        await stream.aclose()
        for _ in range(200):
            if d.tables()["running"] == 0:
                break
            await asyncio.sleep(0.05)
        assert d.tables()["running"] == 0
        # the meanings that differ from the defaults: a seed is kept, n_probs > 0 gives probabilities,
        # a draft of 0 tokens is no draft; adapters and lazy grammars this server cannot honour are a 400
        req = read_request(LlamaCompletionRequest, {"prompt": "x", "seed": 7, "n_probs": 2, "speculative.n_max": 0})[0]
        assert req.sampling(8).seed == 7 and req.sampling(8).logprobs == 2 and req.sampling(8).speculative is False
        for bad in ({"lora": [{"id": 0, "scale": 1.0}]}, {"grammar_lazy": True}, {"seed": 4294967296}):
            with pytest.raises(ApiError):
                read_request(LlamaCompletionRequest, {"prompt": "x", **bad})

    run(model_path, body)


class _EngineHandle:
    """Stands in for the ingress's handle to the engine: each output stream says hello, then
    lives until ``drop()`` ends it the way a dying replica does; info() answers healthy."""

    def __init__(self) -> None:
        self.opened = 0
        self.alive = asyncio.Event()
        self.alive.set()
        self.ended = asyncio.Event()

    def options(self, **_: Any) -> _EngineHandle:
        return self

    @property
    def outputs(self) -> _EngineHandle:
        return self

    @property
    def info(self) -> Any:
        class _Info:
            @staticmethod
            async def remote() -> dict:
                return {"healthy": True}

        return _Info

    def remote(self, *_: Any, **__: Any) -> Any:
        async def stream() -> Any:
            await self.alive.wait()
            self.opened += 1
            yield {"connected": "replica-1"}
            await self.ended.wait()
            raise RuntimeError("the replica died")

        return stream()

    def drop(self) -> None:
        """The replica dies; a new one comes up only after ``revive()``."""
        self.alive.clear()
        self.ended.set()

    def revive(self) -> None:
        self.ended = asyncio.Event()
        self.alive.set()


def test_ingress_health_is_503_while_its_output_stream_is_down(monkeypatch):
    """A replacement engine replica can answer info() within the health check's timeout: the
    ingress still says it is down while it has no output stream to submit on."""
    from deployments import router
    from deployments.ingress import Ingress

    # no replicas learned by a router of this process (an end-to-end test's) come in
    monkeypatch.setattr(router, "_KNOWN", {})

    cls = Ingress.func_or_class.__mro__[1]  # the class under Serve's ASGI wrapper

    async def main() -> None:
        handle = _EngineHandle()
        ing = object.__new__(cls)
        await cls.__init__(ing, handle, ["m"])
        assert (await ing.health()).status_code == 200  # first call: starts the stream
        await asyncio.wait_for(ing.out.connected.wait(), 10)
        handle.drop()
        for _ in range(100):
            if not ing.out.connected.is_set():
                break
            await asyncio.sleep(0.01)
        assert (await ing.health()).status_code == 503
        handle.revive()
        await asyncio.wait_for(ing.out.connected.wait(), 10)
        assert handle.opened == 2
        assert (await ing.health()).status_code == 200
        for t in [ing.out.discover_task, *ing.out.pumps.values()]:
            t.cancel()

    asyncio.run(main())


def test_a_stream_that_fails_mid_way_ends_with_its_endpoints_own_error_event():
    """Shaping fails after the first bytes went out: the stream ends with an error event in the
    endpoint's shape (an Anthropic stream gets Anthropic's ``error`` event, not OpenAI's error
    body), the fault is counted and the request is released."""
    from deployments.answers import guarded
    from deployments.api.anthropic import MessagesShaper

    released: list[str] = []
    internal: list[int] = []

    class Gen:  # the generation's two members a stream's guard uses
        rid = "r1"

        async def close(self) -> None:
            released.append(self.rid)

    async def events() -> Any:
        yield b"event: message_start\ndata: {}\n\n"
        raise KeyError("a shaping bug")

    shaper = object.__new__(MessagesShaper)  # its error event needs none of its state

    async def main() -> list[bytes]:
        return [c async for c in guarded(Gen(), events(), shaper.failed, lambda: internal.append(1))]

    chunks = asyncio.run(main())
    assert len(chunks) == 2 and released == ["r1"] and internal == [1]
    kind, data = chunks[1].decode().strip().split("\n")
    assert kind == "event: error"
    body = json.loads(data.removeprefix("data: "))
    assert body["type"] == "error" and body["error"]["type"] == "api_error"
    assert body["error"]["message"] == "the stream failed: KeyError"


def test_an_ingress_that_cannot_read_the_vocabulary_answers_503_saying_why():
    """The ingress makes prompts from the model's vocabulary on its own node: a path it cannot
    read is a 503 naming the path, never a 500, and a later request tries again."""
    from concurrent.futures import ThreadPoolExecutor

    from deployments.client import EngineClient
    from deployments.errors import ApiError
    from deployments.resume import ResumeSettings
    from tests.fake_handle import FakeHandle

    class Engine(FakeHandle):
        async def _info(self, **_: Any) -> dict:
            return {"model_path": "/nonexistent/model.gguf", "n_ctx_slot": 256, "n_parallel": 2,
                    "n_slots_per_group": 2, "n_batch": 512}

    async def main() -> None:
        client = EngineClient(Engine(), 1.0, None, ResumeSettings(), ThreadPoolExecutor(1))
        for _ in range(2):
            with pytest.raises(ApiError) as e:
                await client.maker()
            assert e.value.status == 503 and "/nonexistent/model.gguf" in e.value.message
        await client.close()

    asyncio.run(main())
