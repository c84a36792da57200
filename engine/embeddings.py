"""Embeddings of the served model (``embeddings: true``): one more context of the one model,
made to pool, owned by a thread of its own (a context is touched by one thread only).

On the split it runs over the same devices as the groups, the peer's layers included. Each
input is one decode of one sequence: at most ``n_ubatch`` tokens (a pooled embedding is one
micro-batch); the vector is the GGUF's pooling (mean where the GGUF names none, as a causal
model's GGUF does), L2-normalised as llama-server returns it.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future

import llama_cpp
import numpy as np

from engine.errors import RequestError
from engine.native.batch import Batch
from engine.native.context import Context
from engine.native.model import Model

log = logging.getLogger(__name__)

POOLING = {"mean": llama_cpp.LLAMA_POOLING_TYPE_MEAN, "cls": llama_cpp.LLAMA_POOLING_TYPE_CLS,
           "last": llama_cpp.LLAMA_POOLING_TYPE_LAST}


class Embedder:
    def __init__(self, model: Model, n_ubatch: int, n_threads: int, pooling: str | None = None,
                 flash_attn: bool | None = None) -> None:
        self.model = model
        self.n_embd = int(llama_cpp.llama_model_n_embd(model.ptr))
        self.n_max = n_ubatch
        kw = dict(n_ctx=n_ubatch, n_seq_max=1, n_batch=n_ubatch, n_ubatch=n_ubatch, n_threads=n_threads,
                  flash_attn=flash_attn, embeddings=True)
        ctx = Context(model, pooling=POOLING[pooling] if pooling else None, **kw)
        if ctx.pooling == llama_cpp.LLAMA_POOLING_TYPE_NONE:  # a causal model's GGUF: mean, as a vector is asked for
            ctx.close()
            ctx = Context(model, pooling=POOLING["mean"], **kw)
        self.ctx = ctx
        self.pooling = {v: k for k, v in POOLING.items()}.get(ctx.pooling, str(ctx.pooling))
        self.batch = Batch(n_ubatch)
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="embeddings", daemon=True)
        self._thread.start()
        log.info("embeddings ready: %d dimensions, %s pooling, up to %d tokens an input", self.n_embd,
                 self.pooling, n_ubatch)

    def embed(self, inputs: list[list[int]], timeout: float = 600.0) -> list[np.ndarray]:
        """One normalised vector per input (token ids); raises ``RequestError`` for an input the
        context cannot take."""
        for i, toks in enumerate(inputs):
            if not toks:
                raise RequestError(f"input {i} is empty")
            if len(toks) > self.n_max:
                raise RequestError(f"input {i} is {len(toks)} tokens; an embedding takes at most {self.n_max} "
                                   "(n_ubatch)")
        fut: Future = Future()
        self.inbox.put((inputs, fut))
        return fut.result(timeout)

    def _run(self) -> None:
        while True:
            item = self.inbox.get()
            if item is None:
                return
            inputs, fut = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result([self._one(toks) for toks in inputs])
            except BaseException as e:  # a failed decode fails this call, not the thread
                fut.set_exception(e)

    def _one(self, tokens: list[int]) -> np.ndarray:
        self.ctx.clear()
        b = self.batch
        b.clear()
        b.add(tokens, 0, 0, len(tokens))
        self.ctx.decode(b)
        v = self.ctx.seq_embedding(0, self.n_embd).astype(np.float64)
        norm = float(np.linalg.norm(v))
        return (v / norm if norm > 0 else v).astype(np.float32)

    def close(self) -> None:
        self.inbox.put(None)
        self._thread.join(30)
        if not self._thread.is_alive():
            self.ctx.close()
