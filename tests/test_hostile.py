"""No request can crash, wedge or starve the engine: the hostile cases that once did, then
property-based fuzzing of the grammar, schema, tool and sampler fields, against one running
engine with a stream beside them.

Each request must be answered (a 400, or an output that ends) within ``ANSWER_S``; the
engine must be the same one, healthy, with every table empty afterwards; the stream beside
must never wait longer than ``GAP_S`` between two tokens."""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from pydantic import ValidationError

from deployments.answers import error_status
from deployments.api.openai import ChatCompletionRequest, CompletionRequest, chat_prompt
from engine import Engine, EngineConfig, SamplingParams
from tests.hostile import CASES, Gaps, hostile_bodies

ANSWER_S = 30.0  # a hostile request is answered within this
GAP_S = 3.0  # the stream beside it never waits longer between two tokens (a step is milliseconds here)
N_FUZZ = int(os.environ.get("PGROUPS_FUZZ_EXAMPLES", "400"))  # property-based examples (README: how many ran)


class Bed:
    """One engine, a witness stream beside, and the answer to one hostile body."""

    def __init__(self, model_path: str) -> None:
        self.e = Engine(EngineConfig(model=model_path, n_threads=1, n_parallel=4, pipeline_groups=2, n_ctx=8192,
                                     grammar_budget_s=5.0))
        self.groups = [id(g) for g in self.e.groups]
        self.gaps = Gaps()
        self._stop = threading.Event()
        self._witness = threading.Thread(target=self._watch, daemon=True)
        self._witness.start()
        self.answered: dict[tuple[int, str], int] = {}

    def _watch(self) -> None:
        params = SamplingParams(temperature=0, max_tokens=1_000_000, ignore_eos=True)
        while not self._stop.is_set():
            for o in self.e.stream("the witness", params):
                self.gaps.tick()
                if self._stop.is_set():
                    return
                if o.finish_reason is not None:
                    break

    def answer(self, route: str, body: dict[str, Any]) -> tuple[int, str]:
        """(status, detail): 400 refused, 200 finished (detail: the finish reason), or the
        error status of an output that ended in error."""
        try:
            if route == "chat":
                req = ChatCompletionRequest.model_validate(body)
                prompt, params, _ = chat_prompt(self.e.tokenizer, req, self.e.n_ctx_slot)
                n = req.n
            else:
                req = CompletionRequest.model_validate(body)
                prompt, params, n = req.prompt, req.sampling(self.e.n_ctx_slot), req.n
            r = self.e.make_request(prompt, params, n=n)
        except (ValueError, ValidationError) as x:  # RequestError too: the client's 400
            return 400, str(x)[:200]
        qs = [self.e.outputs.register(m.id) for m in r.family]
        self.e.submit(r)
        deadline = time.monotonic() + ANSWER_S
        detail, status = "", 200
        for q in qs:
            while True:
                try:
                    o = q.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    raise AssertionError(f"no answer in {ANSWER_S} s: {body!r:.300}") from None
                if o.finish_reason is not None:
                    break
            if o.finish_reason == "error":
                status, detail = error_status(o)
            else:
                detail = str(o.finish_reason)
        for m in r.family:
            self.e.outputs.unregister(m.id)
        return status, detail

    def check_after(self, what: str) -> None:
        e = self.e
        assert e.healthy, (what, e.problem())
        assert [id(g) for g in e.groups] == self.groups and all(g.running for g in e.groups), what
        # only the witness holds a slot; nothing waits
        deadline = time.monotonic() + 10
        while True:
            running, waiting = e.scheduler.counts()
            active = sum(len(g.active) for g in e.groups)
            if running <= 1 and waiting == 0 and active <= 1:
                break
            assert time.monotonic() < deadline, (what, running, waiting, active)
            time.sleep(0.05)
        assert self.gaps.worst < GAP_S, (what, self.gaps.worst)

    def survives(self, name: str, route: str, body: dict[str, Any]) -> None:
        """One hostile body: answered in time with a 200 or a 400, and nothing changed."""
        self.gaps.reset()
        t0 = time.monotonic()
        status, detail = self.answer(route, body)
        took = time.monotonic() - t0
        assert status in (200, 400), (name, status, detail)
        assert took < ANSWER_S, (name, took)
        self.check_after(name)

    def close(self) -> None:
        self._stop.set()
        self._witness.join(30)
        self.e.close()


def running_bed(model_path: str, timeout_s: float = 60.0) -> Iterator[Bed]:
    """Body of a bed fixture: yields once the witness streams; closes the bed after."""
    b = Bed(model_path)
    deadline = time.monotonic() + timeout_s
    while b.gaps.n < 3:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    yield b
    b.close()


@pytest.fixture(scope="module")
def bed(model_path: str) -> Iterator[Bed]:
    yield from running_bed(model_path)


@pytest.mark.parametrize("name, route, body", CASES, ids=[c[0] for c in CASES])
def test_a_hostile_request_is_answered_and_changes_nothing(bed, name, route, body):
    bed.survives(name, route, body)
    # and the engine still serves a plain request
    assert bed.answer("completion", {"prompt": "after " + name, "max_tokens": 3}) == (200, "length")


def test_the_refusals_say_what_to_change(bed):
    cases = {name: (route, body) for name, route, body in CASES}
    for name, want in [("grammar nested 400,000 deep", "larger than"), ("grammar nested 100,000 deep", "nests deeper"),
                       ("json_schema: pattern a{0,100000}", "counted repetition"),
                       ("json_schema: maxItems 200,000,000", "maxItems"),
                       ("json_schema nested 200 deep", "nests deeper"),
                       ("grammar: a token id outside the vocabulary", "does not parse"),
                       ("grammar: 5,000 chained rules", "more than 500 rules"),
                       ("lark: 3,000 chained rules", "more than 500 rules"),
                       ("json_schema: 2,000 chained $refs", "$refs and definitions")]:
        status, detail = bed.answer(*cases[name])
        assert status == 400 and want in detail, (name, detail)


def test_windows_are_bounded_by_the_slot(bed):
    e = bed.e
    r = e.make_request("x", SamplingParams(repeat_penalty=1.1, repeat_last_n=2**31 - 1, dry_multiplier=0.5,
                                           dry_penalty_last_n=-1))
    assert r.params.repeat_last_n == e.n_ctx_slot and r.params.dry_penalty_last_n == e.n_ctx_slot


@settings(max_examples=N_FUZZ, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(case=hostile_bodies())
def test_fuzzed_fields_never_crash_wedge_or_starve_the_engine(bed, case):
    route, body = case
    bed.gaps.reset()
    status, detail = bed.answer(route, body)
    assert status in (200, 400), (status, detail, body)
    bed.check_after(repr(body)[:300])
    grammar = next((k for k in ("grammar", "json_schema", "response_format", "tools") if k in body), "none")
    event(f"{status} with grammar {grammar}")
    bed.answered[(status, grammar)] = bed.answered.get((status, grammar), 0) + 1


def test_the_fuzzing_reached_the_engine(bed):
    """The examples above are not all refused at the door: the engine ran grammars of every way
    they arrive, and plain sampler mixes (run after the fuzzing, in file order)."""
    served = {g for (status, g), n in bed.answered.items() if status == 200 and n}
    assert served >= {"none", "grammar", "json_schema", "response_format", "tools"}, bed.answered
    total = sum(bed.answered.values())
    assert total >= N_FUZZ and sum(n for (st, _), n in bed.answered.items() if st == 200) > total / 4, bed.answered
