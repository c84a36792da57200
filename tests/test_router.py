"""The pair router's choices, on stand-in replicas (no Serve)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from deployments.router import PairRouter, Route, prefix_hashes


def replica(rid: str, running: int = 0) -> SimpleNamespace:
    return SimpleNamespace(replica_id=SimpleNamespace(unique_id=rid), routing_stats={"running": running, "waiting": 0})


def router(imbalance: int = 8) -> PairRouter:
    r = object.__new__(PairRouter)
    r.initialize_state(imbalance=imbalance)
    return r


def choose(r: PairRouter, reps: list, **kwargs) -> str:
    pr = SimpleNamespace(kwargs=kwargs)
    ranks = asyncio.run(r.choose_replicas(reps, pr))
    return ranks[0][0].replica_id.unique_id


def test_a_prompt_goes_where_its_longest_prefix_went_unless_that_pair_is_much_busier():
    r = router(imbalance=2)
    a, b = replica("a"), replica("b")
    long_a = "system prompt A " * 40
    route = Route(tuple(["a", "b"]), tuple(prefix_hashes(long_a + "first")))
    first = choose(r, [a, b], route=route)
    other = "b" if first == "a" else "a"
    for i in range(6):  # the sends count as load until the stats catch up: raise the threshold
        r._sent.clear()  # noqa: SLF001 - the replicas' stats have caught up
        assert choose(r, [a, b], route=Route(tuple(["a", "b"]), tuple(prefix_hashes(f"{long_a}q{i}")))) == first
    # the pair holding the prefix is busier than the other by more than the threshold
    busy = {first: replica(first, running=5), other: replica(other, running=0)}
    r._sent.clear()  # noqa: SLF001
    assert choose(r, [busy["a"], busy["b"]], route=Route(tuple(["a", "b"]), tuple(prefix_hashes(long_a + "x")))) == other


def test_only_replicas_the_ingress_holds_a_stream_to_and_named_targets():
    r = router()
    a, b = replica("a"), replica("b")
    for _ in range(10):
        assert choose(r, [a, b], route=Route(tuple(["b"]), tuple(prefix_hashes("hello")))) == "b"
    assert choose(r, [a, b], replica="a") == "a"
    # a target that is gone: any replica (which refuses the call)
    assert choose(r, [a, b], replica="zz") in ("a", "b")


def test_without_a_prefix_the_less_busy_of_two():
    r = router()
    a, b = replica("a", running=3), replica("b", running=0)
    assert [choose(r, [a, b], route=Route(tuple(["a", "b"]), tuple(prefix_hashes(f"p{i}")))) for i in range(3)] \
        == ["b", "b", "b"]


def test_prefix_hashes_chain_so_a_hash_stands_for_the_whole_prefix():
    x = prefix_hashes("a" * 600)
    y = prefix_hashes("a" * 512 + "b" * 88)
    assert len(x) == 3 and x[:2] == y[:2] and x[2] != y[2]
    assert prefix_hashes("b" * 256 + "a" * 256)[1] != x[1]  # the same chunk after another prefix
    assert prefix_hashes([1, 2, 3]) == prefix_hashes([1, 2, 3]) != prefix_hashes([1, 2, 4])
