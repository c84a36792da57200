"""Grammars compiled into matchers, and the matchers sampling asks (steps 2 and 3 of
``engine.text.grammar``'s path): llguidance on a compile thread with a time budget, and a
``GrammarState`` per request. The engine's side; the ingress only checks sources and schemas."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import numpy as np

from engine.errors import RequestError
from engine.text.grammar import MAX_NESTING, GrammarSpec, check_source, json_options

log = logging.getLogger(__name__)


# ---- 2. compilation, with a budget -----------------------------------------------------------


def _limits() -> Any:
    import llguidance

    # llguidance's own defaults but for the grammar size, a tenth of it: no request needs more
    # and the per-step fuel keeps a mask computation within milliseconds
    return llguidance.LLParserLimits(max_grammar_size=50_000, verbose_errors=False)


def to_llguidance(spec: GrammarSpec) -> str:
    """The grammar in llguidance's own form; raises ``RequestError`` for a text that does not
    convert."""
    import llguidance
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        if spec.kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(spec.text, overrides=json_options())
        lark = spec.text if spec.kind == "lark" else any_to_lark(spec.text)
        return llguidance.LLMatcher.grammar_from_lark(lark)
    except RecursionError:
        raise RequestError(f"the grammar nests deeper than {MAX_NESTING} levels") from None
    except Exception as e:  # the converter's message says what it cannot read
        raise RequestError(f"the grammar does not parse: {e}") from None


class GrammarCompiler:
    """Compiles grammars for one vocabulary on its own threads, each within ``budget_s``.

    A compilation past its budget is the request's 400; the thread it ran on finishes it
    within llguidance's fuel limits and is counted in ``overrun`` meanwhile, so a burst of
    hostile grammars cannot take every compile thread: past ``max_overrun`` grammars are
    refused at once until those threads are back."""

    def __init__(self, tokenizer: Any, budget_s: float = 5.0, threads: int = 2) -> None:
        """``tokenizer``: the engine's ``engine.text.tokenizer.Tokenizer`` (its vocabulary)."""
        self.vocab_of = tokenizer
        self.n_vocab = tokenizer.n_vocab
        self.budget_s = budget_s
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="grammar-compile")
        self._tok: Any = None
        self._tok_lock = threading.Lock()
        self._lock = threading.Lock()
        self.overrun = 0
        self.max_overrun = max(1, threads - 1)

    def tokenizer(self) -> Any:
        """llguidance's view of the vocabulary, made once (about a second for 262,144 tokens)."""
        with self._tok_lock:
            if self._tok is None:
                self._tok = _lltokenizer(self.vocab_of)
            return self._tok

    def compile(self, spec: GrammarSpec) -> GrammarState:
        """The matcher of ``spec``, its first mask computed; raises ``RequestError``."""
        check_source(spec)
        with self._lock:
            if self.overrun >= self.max_overrun:
                raise RequestError("the server is still compiling earlier grammars that ran past their "
                                   f"budget of {self.budget_s:g} s; retry later")
        fut = self._pool.submit(self._build, spec)
        try:
            return fut.result(timeout=self.budget_s)
        except FutureTimeout:
            with self._lock:
                self.overrun += 1
            fut.add_done_callback(self._back)
            raise RequestError(f"the grammar took longer than {self.budget_s:g} s to compile; simplify it") from None
        except RequestError:
            raise
        except Exception as e:  # whatever else a hostile grammar makes the compiler raise
            log.warning("grammar compilation failed: %r", e)
            raise RequestError(f"the grammar cannot be compiled: {_short(str(e))}") from None

    def _back(self, _fut: object) -> None:
        with self._lock:
            self.overrun -= 1

    def _build(self, spec: GrammarSpec) -> GrammarState:
        import llguidance

        t0 = time.perf_counter()
        grammar = to_llguidance(spec)
        m = llguidance.LLMatcher(self.tokenizer(), grammar, log_level=0, limits=_limits())
        if m.is_error():
            raise RequestError(f"the grammar does not parse: {_short(m.get_error())}")
        state = GrammarState(m, self.n_vocab)
        try:
            first = state.refresh_mask()
        except GrammarDeadEnd as e:
            raise RequestError(f"the grammar allows no token of this model's vocabulary at its start: {e}") from None
        if not first.any():
            raise RequestError("the grammar allows no token of this model's vocabulary at its start")
        state.compile_s = time.perf_counter() - t0
        return state

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _lltokenizer(tok: Any) -> Any:
    """llguidance's tokenizer over a llama.cpp vocabulary: each token's bytes, and llama.cpp's
    own tokenizer for text. As in llama.cpp's grammars, a special token stands for its text
    (``<think>``, ``<|channel|>``, ``<tool_call>``: a grammar that spells a family's markup
    admits the token the model writes it with); only the end-of-generation tokens are marked
    special (a 0xFF byte first, as llguidance expects), so they end an output where the grammar
    is complete and never stand for text inside it."""
    import ctypes

    import llama_cpp
    import llguidance

    eog = set(tok.eog_tokens)
    pieces = [b"\xff" + tok.piece(t) if t in eog else tok.piece(t) for t in range(tok.n_vocab)]
    fptr = ctypes.cast(llama_cpp.llama_cpp._lib.llama_tokenize, ctypes.c_void_p).value
    return llguidance.LLTokenizer.from_llamacpp(tokens=pieces, vocab_ptr=tok.vocab, tokenize_fptr=fptr,
                                                eos_token=list(tok.eog_tokens) or None, slices=None)


def _short(msg: str) -> str:
    return msg if len(msg) <= 500 else msg[:500] + "..."


# ---- 3. sampling -----------------------------------------------------------------------------


class GrammarDeadEnd(RuntimeError):
    """The grammar allows no token at this point of the output."""


class GrammarState:
    """One request's matcher: which tokens may come next, and the tokens it has taken.
    Used by one thread at a time (the request's group, or its sampling pool's thread)."""

    def __init__(self, matcher: Any, n_vocab: int) -> None:
        self.m = matcher
        self.n_vocab = n_vocab
        self._bits = np.full((n_vocab + 31) // 32, -1, dtype=np.int32)
        self._fresh = False  # _bits is the mask of the current state
        self.compile_s = 0.0

    def copy(self) -> GrammarState:
        g = GrammarState(self.m.deep_copy(), self.n_vocab)
        g._bits[:] = self._bits
        g._fresh = self._fresh
        return g

    def allows(self, token: int) -> bool:
        return self.m.validate_tokens([token]) == 1

    def refresh_mask(self) -> np.ndarray:
        """The allowed tokens (bools over the vocabulary) in the current state."""
        if not self._fresh:
            self.m.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
            if self.m.is_error():
                raise GrammarDeadEnd(_short(self.m.get_error()))
            self._fresh = True
        return np.unpackbits(self._bits.view(np.uint8), count=self.n_vocab, bitorder="little").view(bool)

    @property
    def accepting(self) -> bool:
        return self.m.is_accepting()

    def accept(self, token: int) -> None:
        if not self.m.consume_token(token) or self.m.is_error():
            raise GrammarDeadEnd(f"the grammar refused token {token}: {_short(self.m.get_error())}")
        self._fresh = False
