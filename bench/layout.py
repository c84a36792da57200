"""Which cores each stage gets in the benchmark's pinned cells, by the cores the box has.

Two machines give each stage a machine of its own; on one box the pinned cells stand in for
that with cores: the peer stage (rpc-server, or the project's RPC stage), the local stage
(llama-server's compute, or the engine's group threads and ggml's threads they start) and,
where the box has cores to spare, everything else (Ray, the HTTP path, the load client) on
cores of its own. On 2 cores: one core for each stage and the rest floats, one thread per
stage; from 6 cores: a third of them each, as many threads per stage as it has cores.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Layout:
    peer: list[int]
    local: list[int]
    rest: list[int]  # empty: everything else floats over every core
    threads: int  # per stage

    @property
    def every(self) -> list[int]:
        return sorted({*self.peer, *self.local, *self.rest})

    def describe(self) -> str:
        def span(c: list[int]) -> str:
            return f"{c[0]}-{c[-1]}" if len(c) > 1 else str(c[0])

        rest = f", everything else on {span(self.rest)}" if self.rest else ", everything else floats"
        return f"peer stage on cores {span(self.peer)}, local stage on {span(self.local)}{rest}; {self.threads} thread(s) a stage"


def layout(cpus: list[int] | None = None) -> Layout:
    cpus = sorted(cpus if cpus is not None else os.sched_getaffinity(0))
    if len(cpus) < 6:
        return Layout([cpus[0]], [cpus[-1]], [], 1)
    third = len(cpus) // 3
    return Layout(cpus[:third], cpus[third:2 * third], cpus[2 * third:], third)


def pin_processes(pids: list[int], cpus: list[int]) -> None:
    """Every thread of each process onto ``cpus`` (a process's mask is per thread); the
    threads and processes they start later inherit it."""
    for pid in pids:
        try:
            tids = [int(t.name) for t in Path(f"/proc/{pid}/task").iterdir()]
        except OSError:
            continue
        for tid in tids:
            try:
                os.sched_setaffinity(tid, cpus)
            except OSError:  # gone, or not ours
                pass
