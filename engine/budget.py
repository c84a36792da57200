"""Chunked prefill: how many prompt tokens a step may carry while other streams decode.

A step that evaluates a prompt chunk beside generating rows makes every one of those streams
wait for the chunk, and so does every other group's next step behind it on the shared stages.
llama-server fills the batch up to ``n_batch``, so a long prompt stretches the others' gaps
by its chunk's whole cost. Here, while any stream of the engine decodes, a step's prompt
tokens are cut so that the step lasts about ``1 + stall`` times a step without them: the
cost of a step is learnt from the steps themselves (a moving mean of the steps without prompt
tokens, and of the time each prompt token adds), so the cut follows the hardware: a GPU
evaluates a large chunk for little more than a decode step, a CPU pays per token. A prompt
gets at least ``chunk_min`` tokens a step, so it always progresses; with nothing decoding it
gets the whole batch.

Chunks do not save the decoding streams any time in all (the prompt's tokens cost the stages
the same, cut or not): they spread the wait over many steps, so no stream stalls for a whole
chunk, and the prompt pays for it with its first token, later by the extra steps. That is
worth it while the streams decoding outnumber the prompts waiting (one long prompt beside
many streams); when they do not (a burst of prompts, the first of which has begun to
decode), every prompt goes whole, as llama-server does.

A short prompt (at most ``prefill_long_tokens`` to evaluate) is not queued behind long ones:
it claims a step's prompt tokens first (engine/planner.py, ``prompt_order``), and while one
waits for its first token in any group, the steps of every group carry at most
``beside_short`` tokens of long prompts, so that the short one's step, and the other groups'
steps beside it on the shared stages, are quick. A long prompt held back ``aging`` steps in a
row is exempt, so a stream of short prompts never starves it.

One budget is shared by the engine's groups (they run the same model on the same stages);
each group writes its own step times and its counts of generating rows, of prompts waiting
and of short prompts among them, and reads the others'.
"""

from __future__ import annotations

EMA = 0.2  # weight of the newest step in the moving means


class PrefillBudget:
    def __init__(self, n_groups: int, stall: float | None, chunk_min: int, beside_short: int | None = None) -> None:
        self.stall = stall  # None: off (llama-server's behaviour)
        self.chunk_min = max(1, chunk_min)
        self.beside_short = beside_short  # None: long prompts fill the step beside short ones
        self.decoding = [0] * n_groups  # generating rows per group, after its last step
        self.prompting = [0] * n_groups  # prompts with tokens to evaluate per group, likewise
        self.short = [0] * n_groups  # short prompts among them (published when one starts too)
        self.t_decode: float | None = None  # seconds of a step without prompt tokens
        self.t_token: float | None = None  # seconds one prompt token adds to a step

    def observe(self, n_rows: int, n_prompt: int, seconds: float) -> None:
        """A step ran for ``seconds``: ``n_prompt`` prompt tokens beside ``n_rows`` generating rows."""
        if n_prompt == 0:
            if n_rows:
                self.t_decode = _mean(self.t_decode, seconds)
            return
        base = self.t_decode if (self.t_decode is not None and n_rows) else 0.0
        self.t_token = _mean(self.t_token, max(seconds - base, 0.0) / n_prompt)

    def tokens(self, group: int, n_generating: int, capacity: int, n_prompting: int = 1) -> int:
        """The most prompt tokens the next step of ``group`` may carry (its own generating rows
        ``n_generating`` and prompts waiting ``n_prompting``; the batch holds ``capacity``)."""
        others = [g for g in range(len(self.decoding)) if g != group]
        decoding = n_generating + sum(self.decoding[g] for g in others)
        prompting = n_prompting + sum(self.prompting[g] for g in others)
        if self.stall is None or decoding <= prompting:
            return capacity
        if self.t_decode is None or not self.t_token:
            return min(self.chunk_min, capacity)
        return max(self.chunk_min, min(capacity, int(self.stall * self.t_decode / self.t_token)))


    def long_cut(self, group: int, n_short: int) -> int | None:
        """The most tokens of long prompts the next step of ``group`` may carry beside short
        prompts (``n_short`` wait in this group): ``beside_short`` while one waits in any group,
        else None (no cut)."""
        if self.beside_short is None:
            return None
        if n_short or any(k for g, k in enumerate(self.short) if g != group):
            return self.beside_short
        return None


def _mean(old: float | None, new: float) -> float:
    return new if old is None else old + EMA * (new - old)
