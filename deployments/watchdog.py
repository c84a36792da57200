"""The frozen-stage watchdog's judgement: when a decode in progress means the RPC stage stopped
answering with its connection still open (a stopped process, a hung peer).

A decode is frozen when both hold:

- it has run past its limit: ``factor`` times what the cost model expected of that step (its rows
  and prompt tokens, engine/cost.py), never under ``floor_s``, never over ``ceiling_s``
  (``stage_timeout_s``); a step nothing was learnt for yet gets the ceiling. So a stage frozen
  mid-stream is found within seconds, where a fixed minute paused every stream for that long;
- nobody works on it: over the last poll its group's thread did not run (it waits on the
  socket, not computing the local stage) and the stage's server process did not either (its CPU
  seconds, from the stage actor; a stage that does not answer counts as not working). A slow
  step (a long prompt at a depth the cost model has not seen) is busy somewhere, and is left
  alone up to the ceiling, where it fails whatever it is doing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.types import Decode

LATE_POLL_S = 0.25  # the watchdog's poll while a decode is past its limit


@dataclass
class StallJudge:
    ceiling_s: float = 60.0  # stage_timeout_s: the longest any decode may run
    factor: float = 10.0  # of the expected step
    floor_s: float = 5.0
    # the last poll's readings: group -> its thread's CPU seconds; the stage server's
    _threads: dict[int, float | None] = field(default_factory=dict)
    _stage_cpu: float | None = None

    def limit(self, d: Decode) -> float:
        """How long ``d`` may run before it is judged."""
        if d.expected_s is None:
            return self.ceiling_s
        return min(self.ceiling_s, max(self.floor_s, self.factor * d.expected_s))

    def frozen(self, decodes: list[Decode], stage_cpu_s: float | None) -> Decode | None:
        """The decode judged frozen at this poll (None: none). ``stage_cpu_s``: the stage
        server's CPU seconds now (None: the stage did not say)."""
        stage_idle = stage_cpu_s is None or (self._stage_cpu is not None and stage_cpu_s <= self._stage_cpu)
        found = None
        for d in decodes:
            if d.seconds > self.ceiling_s:
                found = d
                break
            before = self._threads.get(d.group)
            thread_idle = d.thread_cpu_s is not None and before is not None and d.thread_cpu_s <= before
            if d.seconds > self.limit(d) and thread_idle and stage_idle:
                found = d
                break
        self._threads = {d.group: d.thread_cpu_s for d in decodes}
        self._stage_cpu = stage_cpu_s
        return found

    def reason(self, d: Decode) -> str:
        expected = "" if d.expected_s is None else f"; its step was expected to take {d.expected_s:.2f} s"
        return (f"the RPC stage did not answer for {d.seconds:.0f} s{expected} (stage_timeout_s "
                f"{self.ceiling_s:g} at most); the engine replica restarts")
