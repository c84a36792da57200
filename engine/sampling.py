"""Per-request sampling: the validated parameters and the llama.cpp sampler chain of a slot.

A row is sampled from the logits the group read once for the whole step: the candidates are
filled from that row with numpy and the chain is applied with ``llama_sampler_apply``. This
avoids ``llama_sampler_sample``, whose ``llama_get_logits_ith`` synchronises the context
again per row; on an RPC device that waits for every other group's queued remote work.
Greedy without penalties or biases is an argmax over the row: the same token llama.cpp's
greedy sampler picks (the first maximum).
"""

from __future__ import annotations

import ctypes
import random
import threading

import llama_cpp
import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")], align=True)
assert TOKEN_DATA.itemsize == ctypes.sizeof(llama_cpp.llama_token_data)


class SamplingParams(BaseModel):
    """What a request may set; out-of-range values are refused (HTTP 400)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_tokens: int = Field(default=256, ge=1, le=1_000_000)
    temperature: float = Field(default=0.8, ge=0.0, le=2.0)
    top_k: int = Field(default=40, ge=0)
    top_p: float = Field(default=0.95, gt=0.0, le=1.0)
    min_p: float = Field(default=0.05, ge=0.0, le=1.0)
    repeat_penalty: float = Field(default=1.0, gt=0.0, le=10.0)
    repeat_last_n: int = Field(default=64, ge=-1)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    seed: int | None = Field(default=None, ge=0, le=2**32 - 2)
    stop: tuple[str, ...] = Field(default=(), max_length=16)
    logit_bias: dict[int, float] = Field(default_factory=dict, max_length=1024)
    ignore_eos: bool = False
    grammar: str | None = Field(default=None, max_length=1_000_000, description="GBNF the output must match.")
    logprobs: int | None = Field(
        default=None, ge=0, le=20,
        description="Report each generated token's log probability and this many most likely alternatives.",
    )

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, v: object) -> object:
        if v is None:
            return ()
        if isinstance(v, str):
            return (v,)
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[int, float]) -> dict[int, float]:
        for tok, b in v.items():
            if not -100.0 <= b <= 100.0:
                raise ValueError(f"logit_bias for token {tok} must be within [-100, 100]")
            if tok < 0:
                raise ValueError(f"logit_bias token id {tok} is negative")
        return v

    @model_validator(mode="after")
    def _grammar_needs_eos(self) -> SamplingParams:
        if self.grammar and self.ignore_eos:
            raise ValueError("ignore_eos cannot be used with a grammar: a complete output ends with EOS")
        return self

    @property
    def penalised(self) -> bool:
        return self.repeat_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def is_plain_greedy(self) -> bool:
        return self.temperature <= 0.0 and not self.logit_bias and not self.penalised and not self.grammar


def token_logprobs(row: np.ndarray, token: int, k: int) -> tuple[float, list[tuple[int, float]]]:
    """The model's log probability of ``token`` (a log-softmax of the raw logits, before any
    sampler) and the ``k`` most likely tokens with theirs, most likely first."""
    m = float(row.max())
    lse = m + float(np.log(np.exp((row - m).astype(np.float64)).sum()))
    top: list[tuple[int, float]] = []
    if k:
        idx = np.argpartition(row, -k)[-k:]
        idx = idx[np.argsort(row[idx])[::-1]]
        top = [(int(i), float(row[i]) - lse) for i in idx]
    return float(row[token]) - lse, top


class Candidates:
    """One reusable candidate array over the vocabulary (one per sampling thread)."""

    def __init__(self, n_vocab: int) -> None:
        self.n_vocab = n_vocab
        self.arr = np.zeros(n_vocab, TOKEN_DATA)
        self._ids = np.arange(n_vocab, dtype=np.int32)
        self.struct = llama_cpp.llama_token_data_array(
            data=self.arr.ctypes.data_as(llama_cpp.llama_token_data_p),
            size=n_vocab,
            selected=-1,
            sorted=False,
        )
        self._ref = ctypes.byref(self.struct)
        self._one = np.zeros(1, TOKEN_DATA)
        self._one_struct = llama_cpp.llama_token_data_array(
            data=self._one.ctypes.data_as(llama_cpp.llama_token_data_p), size=1, selected=-1, sorted=False
        )
        self._one_ref = ctypes.byref(self._one_struct)

    def allows(self, grammar: object, token: int, logit: float) -> bool:
        """Whether the grammar accepts ``token`` next (it is checked alone, not the vocabulary)."""
        one = self._one
        one[0] = (token, logit, 0.0)
        s = self._one_struct
        s.data = one.ctypes.data_as(llama_cpp.llama_token_data_p)
        s.size, s.selected, s.sorted = 1, -1, False
        llama_cpp.llama_sampler_apply(grammar, self._one_ref)
        return bool(np.isfinite(one[0]["logit"]))

    def fill(self, row: np.ndarray) -> ctypes._CArgObject:
        a = self.arr
        a["id"] = self._ids
        a["logit"] = row
        a["p"] = 0.0
        s = self.struct
        s.data = self.arr.ctypes.data_as(llama_cpp.llama_token_data_p)
        s.size = self.n_vocab
        s.selected = -1
        s.sorted = False
        return self._ref


_local = threading.local()


def thread_candidates(n_vocab: int) -> Candidates:
    c = getattr(_local, "cand", None)
    if c is None or c.n_vocab != n_vocab:
        c = Candidates(n_vocab)
        _local.cand = c
    return c


class SamplerChain:
    """Owns the llama_sampler chain of one request."""

    def __init__(
        self,
        params: SamplingParams,
        n_vocab: int,
        default_seed: int = -1,
        force_chain: bool = False,
        banned: list[int] | tuple[int, ...] = (),
        vocab: object = None,
    ) -> None:
        """``banned`` tokens are never sampled (``ignore_eos`` bans every end-of-generation token)."""
        self.params = params
        self.n_vocab = n_vocab
        self.banned = np.asarray([t for t in banned if t < n_vocab], dtype=np.int64)
        self.penalised = params.penalised
        # backend sampling needs a real chain, also for plain greedy
        self.greedy = params.is_plain_greedy and not force_chain
        # llama.cpp runs top-k, top-p, min-p, temperature, dist, greedy and the logit bias of
        # banned tokens in the graph; penalties and a request's own logit bias stay on the host
        # logprobs read the row of logits on the host
        self.offloadable = (not params.logit_bias and not self.penalised and not params.grammar
                            and params.logprobs is None)
        seed = params.seed
        if seed is None:
            seed = default_seed if default_seed >= 0 else random.randrange(0, 2**32 - 1)
        self.seed = seed
        self.ptr = None
        self.grammar = None
        if self.greedy:
            return
        if params.grammar:
            from engine.grammar import init_grammar

            if vocab is None:
                raise ValueError("a grammar needs the model's vocabulary")
            self.grammar = init_grammar(vocab, params.grammar)
        sp = llama_cpp.llama_sampler_chain_default_params()
        sp.no_perf = True
        chain = llama_cpp.llama_sampler_chain_init(sp)
        if not chain:
            raise RuntimeError("llama_sampler_chain_init failed")
        try:
            self._build(chain, params, n_vocab, seed)
        except BaseException:
            llama_cpp.llama_sampler_free(chain)  # with the samplers already added to it
            self.close()
            raise
        self.ptr = chain

    def _build(self, chain: object, params: SamplingParams, n_vocab: int, seed: int) -> None:
        add = llama_cpp.llama_sampler_chain_add
        bias = {t: b for t, b in params.logit_bias.items() if t < n_vocab}
        bias.update((int(t), float("-inf")) for t in self.banned)
        if bias:
            items = list(bias.items())
            arr = (llama_cpp.llama_logit_bias * len(items))(
                *[llama_cpp.llama_logit_bias(token=t, bias=b) for t, b in items]
            )
            add(chain, llama_cpp.llama_sampler_init_logit_bias(n_vocab, len(items), arr))
        if self.penalised:
            last_n = params.repeat_last_n if params.repeat_last_n >= 0 else 4096
            add(
                chain,
                llama_cpp.llama_sampler_init_penalties(
                    n_vocab,
                    last_n,
                    params.repeat_penalty, params.frequency_penalty, params.presence_penalty
                ),
            )
        if params.temperature <= 0.0:
            add(chain, llama_cpp.llama_sampler_init_greedy())
            return
        if params.top_k > 0:
            add(chain, llama_cpp.llama_sampler_init_top_k(params.top_k))
        if params.top_p < 1.0:
            add(chain, llama_cpp.llama_sampler_init_top_p(params.top_p, 1))
        if params.min_p > 0.0:
            add(chain, llama_cpp.llama_sampler_init_min_p(params.min_p, 1))
        add(chain, llama_cpp.llama_sampler_init_temp(params.temperature))
        add(chain, llama_cpp.llama_sampler_init_dist(seed))

    def sample(self, row: np.ndarray) -> int:
        """Pick the next token from one row of logits (any thread; one row at a time)."""
        if self.greedy:
            if len(self.banned):
                row = row.copy()
                row[self.banned] = -np.inf
            return int(np.argmax(row))
        cand = thread_candidates(self.n_vocab)
        tok = self._pick(cand, cand.fill(row))
        if self.grammar is not None and not cand.allows(self.grammar, tok, row[tok]):
            # rejected: the grammar masks every candidate, then the chain picks again
            ref = cand.fill(row)
            llama_cpp.llama_sampler_apply(self.grammar, ref)
            tok = self._pick(cand, ref)
        return tok

    def _pick(self, cand: Candidates, ref: object) -> int:
        llama_cpp.llama_sampler_apply(self.ptr, ref)
        s = cand.struct
        if s.selected < 0 or s.selected >= s.size:
            raise RuntimeError("sampler chain selected no token")
        return int(s.data[s.selected].id)

    def accept_prompt(self, tokens: list[int]) -> None:
        """Penalties count the prompt's tokens too, as llama-server's sampler does."""
        if self.ptr is not None and self.penalised:
            last_n = self.params.repeat_last_n if self.params.repeat_last_n >= 0 else len(tokens)
            for t in tokens[-last_n:] if last_n else ():
                llama_cpp.llama_sampler_accept(self.ptr, t)

    def accept(self, token: int) -> None:
        if self.ptr is not None:
            llama_cpp.llama_sampler_accept(self.ptr, token)
        if self.grammar is not None:
            llama_cpp.llama_sampler_accept(self.grammar, token)

    def close(self) -> None:
        if self.ptr is not None:
            llama_cpp.llama_sampler_free(self.ptr)
            self.ptr = None
        if self.grammar is not None:
            llama_cpp.llama_sampler_free(self.grammar)
            self.grammar = None
