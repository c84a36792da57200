"""Backend sampling: the chains run in the compute graph; tokens match the host's where they must."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from engine import SamplingParams

PROMPTS = [f"the {w} said hello to the world number {i}" for i, w in enumerate(
    ["king", "queen", "dog", "cat", "tree", "house"])]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def run(engine, params) -> list[str]:
    with ThreadPoolExecutor(len(PROMPTS)) as ex:
        return list(ex.map(lambda p: engine.generate(p, params).text, PROMPTS))


def test_backend_greedy_equals_host_greedy_for_1_and_2_groups(make_engine):
    host = make_engine(n_parallel=6, n_ctx=3072)
    expected = run(host, GREEDY)
    host.close()
    for n in (1, 2):
        e = make_engine(n_parallel=6, n_ctx=3072, pipeline_groups=n, backend_sampling=True)
        assert run(e, GREEDY) == expected
        assert all(not s.on_backend for s in e.slots)  # detached when the requests ended
        e.close()


def test_backend_seeded_sampling_reproducible_across_groups(make_engine):
    p = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, min_p=0.05, seed=77, max_tokens=24, ignore_eos=True)
    res = {}
    for n in (1, 2):
        e = make_engine(n_parallel=6, n_ctx=3072, pipeline_groups=n, backend_sampling=True)
        res[n] = run(e, p)
        assert run(e, p) == res[n]
        e.close()
    assert res[1] == res[2]
    assert len(set(res[1])) > 1


def test_chain_with_penalties_falls_back_to_the_host(make_engine):
    p = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, repeat_penalty=1.3)
    host = make_engine(n_parallel=2)
    expected = host.generate("hello world", p).text
    host.close()
    e = make_engine(n_parallel=2, backend_sampling=True)
    assert e.generate("hello world", p).text == expected
    # mixed in one step: a backend row and a host row
    with ThreadPoolExecutor(2) as ex:
        a, b = ex.map(lambda q: e.generate("hello world", q).text, [p, GREEDY])
    assert a == expected and b


def test_chain_is_attached_while_the_request_runs(make_engine):
    e = make_engine(n_parallel=2, backend_sampling=True)
    it = e.stream("hello", SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    next(it)
    next(it)
    attached = [s.on_backend for s in e.slots]
    it.close()
    assert attached.count(True) == 1
