"""Per-request sampling: the llama.cpp sampler chain of a slot (its parameters: engine.params).

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

from engine.params import MAX_STOP_CHARS, SAMPLER_NAMES, SAMPLER_ORDER, SamplingParams  # noqa: F401 - their home
from engine.text.matcher import GrammarDeadEnd, GrammarState

TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")], align=True)
assert TOKEN_DATA.itemsize == ctypes.sizeof(llama_cpp.llama_token_data)


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


# llama.cpp's infill sampler compares every pair of candidates for a shared prefix, each token:
# on a 262k vocabulary that is hours a token. The chain always cuts the candidates to this many
# before it (as llama.vscode's own chain does with top_k 40), where no top-k as small comes first.
INFILL_MAX_CANDIDATES = 128

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
        grammar: GrammarState | None = None,
    ) -> None:
        """``banned`` tokens are never sampled (``ignore_eos`` bans every end-of-generation token)
        but where ``grammar``, the request's compiled grammar, allows nothing else: its end
        ends the output."""
        self.params = params
        self.n_vocab = n_vocab
        self.vocab = vocab
        self.banned = np.asarray([t for t in banned if t < n_vocab], dtype=np.int64)
        self.penalised = params.penalised
        # backend sampling needs a real chain, also for plain greedy
        self.greedy = params.is_plain_greedy and not force_chain
        # llama.cpp runs top-k, top-p, min-p, temperature, dist, greedy and the logit bias of
        # banned tokens in the graph; penalties and a request's own logit bias stay on the host
        self.offloadable = not params.host_only
        seed = params.seed
        if seed is None:
            seed = default_seed if default_seed >= 0 else random.randrange(0, 2**32 - 1)
        self.seed = seed
        self.ptr = None
        self.grammar = grammar
        self.post: tuple[float, list[tuple[int, float]]] | None = None  # post_sampling_probs of the last pick
        if self.greedy:
            return
        sp = llama_cpp.llama_sampler_chain_default_params()
        sp.no_perf = True
        chain = llama_cpp.llama_sampler_chain_init(sp)
        if not chain:
            raise RuntimeError("llama_sampler_chain_init failed")
        self.ptr = chain
        try:
            self._build(chain, params, n_vocab, seed)
        except BaseException:
            self.close()  # the chain with the samplers already added to it
            raise

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
        p = params
        keep = max(1, p.min_keep)
        greedy = p.temperature <= 0.0
        bounded = False  # a top-k of at most INFILL_MAX_CANDIDATES is in the chain so far
        for name in p.order:
            if name == "penalties" and self.penalised:
                last_n = p.repeat_last_n if p.repeat_last_n >= 0 else 4096
                add(chain, llama_cpp.llama_sampler_init_penalties(
                    n_vocab, last_n, p.repeat_penalty, p.frequency_penalty, p.presence_penalty))
            elif name == "dry" and p.dry:
                add(chain, self._dry(p))
            elif name == "infill":  # merges candidates that share a prefix; an end of the middle ends it
                if self.vocab is None:
                    raise ValueError("the infill sampler needs the model's vocabulary")
                if not bounded:  # its cost is the square of the candidates: never the whole vocabulary
                    add(chain, llama_cpp.llama_sampler_init_top_k(INFILL_MAX_CANDIDATES))
                    bounded = True
                add(chain, llama_cpp.llama_sampler_init_infill(self.vocab))
            elif greedy or p.mirostat:
                continue  # greedy and mirostat take the whole distribution after the penalties
            elif name == "top_n_sigma" and p.top_n_sigma > 0.0:
                add(chain, llama_cpp.llama_sampler_init_top_n_sigma(p.top_n_sigma))
            elif name == "top_k" and p.top_k > 0:
                add(chain, llama_cpp.llama_sampler_init_top_k(p.top_k))
                bounded = bounded or p.top_k <= INFILL_MAX_CANDIDATES
            elif name == "typ_p" and p.typical_p < 1.0:
                add(chain, llama_cpp.llama_sampler_init_typical(p.typical_p, keep))
            elif name == "top_p" and p.top_p < 1.0:
                add(chain, llama_cpp.llama_sampler_init_top_p(p.top_p, keep))
            elif name == "min_p" and p.min_p > 0.0:
                add(chain, llama_cpp.llama_sampler_init_min_p(p.min_p, keep))
            elif name == "xtc" and p.xtc_probability > 0.0:
                add(chain, llama_cpp.llama_sampler_init_xtc(p.xtc_probability, p.xtc_threshold, keep, seed))
            elif name == "temperature":
                add(chain, self._temperature(p))
        if greedy:
            add(chain, llama_cpp.llama_sampler_init_greedy())
        elif p.mirostat == 1:
            add(chain, self._temperature(p))
            add(chain, llama_cpp.llama_sampler_init_mirostat(n_vocab, seed, p.mirostat_tau, p.mirostat_eta, 100))
        elif p.mirostat == 2:
            add(chain, self._temperature(p))
            add(chain, llama_cpp.llama_sampler_init_mirostat_v2(seed, p.mirostat_tau, p.mirostat_eta))
        else:
            add(chain, llama_cpp.llama_sampler_init_dist(seed))

    @staticmethod
    def _temperature(p: SamplingParams) -> object:
        if p.dynatemp_range > 0.0:
            return llama_cpp.llama_sampler_init_temp_ext(p.temperature, p.dynatemp_range, p.dynatemp_exponent)
        return llama_cpp.llama_sampler_init_temp(p.temperature)

    def _dry(self, p: SamplingParams) -> object:
        if self.vocab is None:
            raise ValueError("the DRY sampler needs the model's vocabulary")
        breakers = [b.encode() for b in p.dry_sequence_breakers]
        arr = (ctypes.c_char_p * len(breakers))(*breakers)
        return llama_cpp.llama_sampler_init_dry(self.vocab, p.dry_multiplier, p.dry_base, p.dry_allowed_length,
                                                p.dry_penalty_last_n, arr, len(breakers))

    def sample(self, row: np.ndarray) -> int:
        """Pick the next token from one row of logits (any thread; one row at a time)."""
        if self.greedy:
            if len(self.banned):
                row = row.copy()
                row[self.banned] = -np.inf
            tok = int(np.argmax(row))
            if self.params.post_sampling_probs and self.params.logprobs is not None:
                self.post = self._post_sampling(None, tok)
            return tok
        cand = thread_candidates(self.n_vocab)
        tok = self._pick(cand, cand.fill(row))
        g = self.grammar
        if g is None or g.allows(tok):
            return tok
        # rejected: the grammar's mask over every candidate, then the chain picks again
        allowed = g.refresh_mask()
        open_ = allowed
        if len(self.banned):
            open_ = allowed.copy()
            open_[self.banned] = False
        if not open_.any():
            ends = [int(t) for t in self.banned if allowed[t]]
            if ends and g.accepting:
                return ends[0]  # the grammar is complete: its end ends the output, ignore_eos or not
            raise GrammarDeadEnd("the grammar allows no token at this point of the output")
        ref = cand.fill(row)
        np.copyto(cand.arr["logit"], -np.inf, where=~allowed)
        tok = self._pick(cand, ref)
        if not open_[tok]:
            raise GrammarDeadEnd(f"the sampler chain picked token {tok}, which the grammar refuses")
        return tok

    def _pick(self, cand: Candidates, ref: object) -> int:
        llama_cpp.llama_sampler_apply(self.ptr, ref)
        s = cand.struct
        if s.selected < 0 or s.selected >= s.size:
            raise RuntimeError("sampler chain selected no token")
        if self.params.post_sampling_probs and self.params.logprobs is not None:
            self.post = self._post_sampling(cand, int(s.data[s.selected].id))
        return int(s.data[s.selected].id)

    def _post_sampling(self, cand: Candidates | None, tok: int) -> tuple[float, list[tuple[int, float]]]:
        """llama-server's post_sampling_probs: the chosen token's log probability and the most
        likely ones, in the distribution the chain sampled from (what its samplers kept); a
        greedy pick (``cand`` None: the argmax path) is certain."""
        kept = cand.arr[: cand.struct.size] if cand is not None else None
        p = kept["p"].astype(np.float64) if kept is not None else np.zeros(0)
        total = float(p.sum())
        if total <= 0:  # greedy: no distribution was computed
            return 0.0, [(tok, 0.0)][: self.params.logprobs]
        order = np.argsort(-p)[: self.params.logprobs]
        chosen = p[kept["id"] == tok]
        lp = float(np.log(chosen[0] / total)) if len(chosen) and chosen[0] > 0 else float("-inf")
        return lp, [(int(kept["id"][i]), float(np.log(p[i] / total)) if p[i] > 0 else float("-inf")) for i in order]

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
            self.grammar.accept(token)

    def close(self) -> None:
        if self.ptr is not None:
            llama_cpp.llama_sampler_free(self.ptr)
            self.ptr = None
        self.grammar = None
