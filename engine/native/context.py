"""The owner of a ``llama_context``: decode, logits, sequences, state, MTP hooks. Touched by its
group's thread only (principle 1 of the design); closed before its model.
"""

from __future__ import annotations

import ctypes
import logging

import llama_cpp
import numpy as np

from engine.errors import NativeError
from engine.native.batch import Batch
from engine.native.library import mtp_hooks
from engine.native.model import Model

log = logging.getLogger(__name__)

class Context:
    """Owns one ``llama_context`` of a model: the KV cache of one pipeline group."""

    def __init__(
        self,
        model: Model,
        *,
        n_ctx: int,
        n_seq_max: int,
        n_batch: int,
        n_ubatch: int,
        n_threads: int,
        kv_unified: bool = False,
        swa_full: bool = False,
        flash_attn: bool | None = None,
        cb_eval: object | None = None,
        embeddings: bool = False,
        pooling: int | None = None,
        mtp: bool = False,
        n_rs_seq: int = 0,
    ) -> None:
        """``embeddings``: a context that pools each sequence's outputs into one vector
        (``pooling``: a ``LLAMA_POOLING_TYPE_*``; None: the GGUF's). ``mtp``: the context of
        the model's multi-token-prediction layers (their own KV), for drafting. ``n_rs_seq``: on
        a recurrent or hybrid model, each sequence keeps its state after each of the last this
        many tokens of its last decode, so that many can be taken back once (rejected drafts)."""
        self.model = model
        p = llama_cpp.llama_context_default_params()
        if mtp:
            if not (model.load_mtp and model.n_layer_nextn > 0):
                raise NativeError("an MTP context needs a model loaded with its MTP layers (load_mtp)")
            p.ctx_type = llama_cpp.LLAMA_CONTEXT_TYPE_MTP
        if embeddings:
            p.embeddings = True
            p.pooling_type = llama_cpp.LLAMA_POOLING_TYPE_UNSPECIFIED if pooling is None else pooling
        p.n_ctx = n_ctx
        p.n_batch = n_batch
        p.n_ubatch = min(n_ubatch, n_batch)
        p.n_seq_max = n_seq_max
        p.n_rs_seq = n_rs_seq
        p.n_threads = n_threads
        p.n_threads_batch = n_threads
        p.kv_unified = kv_unified
        p.swa_full = swa_full
        p.no_perf = True
        if flash_attn is not None:
            p.flash_attn_type = 1 if flash_attn else 0
        if cb_eval is not None:  # a ggml_backend_sched_eval_callback, for diagnostics
            p.cb_eval = cb_eval
        self.ptr = llama_cpp.llama_init_from_model(model.ptr, p)
        if not self.ptr:
            raise NativeError(
                f"failed to create a context (n_ctx={n_ctx}, n_seq_max={n_seq_max}, n_batch={n_batch})"
            )
        self.n_ctx = llama_cpp.llama_n_ctx(self.ptr)
        self.n_ubatch = llama_cpp.llama_n_ubatch(self.ptr)
        # a unified cache lets any sequence fill the whole context; each slot still gets its
        # share, so that the slots together can never overflow the cache
        self.n_ctx_seq = self.n_ctx // n_seq_max if kv_unified else llama_cpp.llama_n_ctx_seq(self.ptr)
        self.memory = llama_cpp.llama_get_memory(self.ptr)

    @property
    def pooling(self) -> int:
        return int(llama_cpp.llama_pooling_type(self.ptr))

    def seq_embedding(self, seq_id: int, n_embd: int) -> np.ndarray:
        """The pooled embedding of a sequence after the last decode (a copy)."""
        ptr = llama_cpp.llama_get_embeddings_seq(self.ptr, seq_id)
        if not ptr:
            raise NativeError(f"no pooled embedding for sequence {seq_id}")
        return np.ctypeslib.as_array(ptr, shape=(n_embd,)).copy()

    def clear(self) -> None:
        llama_cpp.llama_memory_clear(self.memory, True)

    def set_causal(self, causal: bool) -> None:
        llama_cpp.llama_set_causal_attn(self.ptr, causal)

    def decode(self, batch: Batch) -> None:
        rc = llama_cpp.llama_decode(self.ptr, batch.struct)
        if rc != 0:
            raise NativeError(f"llama_decode failed with {rc} (n_tokens={batch.n_tokens})", rc)

    def logits(self, n_rows: int, n_vocab: int) -> np.ndarray:
        """The output rows of the last decode, in batch order; synchronises the context."""
        ptr = llama_cpp.llama_get_logits(self.ptr)
        if not ptr:
            raise NativeError("llama_get_logits returned NULL")
        return np.ctypeslib.as_array(ptr, shape=(n_rows, n_vocab))

    def logits_row(self, i: int, n_vocab: int) -> np.ndarray:
        """The logits of batch index ``i`` (synchronises the context again)."""
        ptr = llama_cpp.llama_get_logits_ith(self.ptr, i)
        if not ptr:
            raise NativeError(f"no logits for batch index {i}")
        return np.ctypeslib.as_array(ptr, shape=(n_vocab,))

    def set_sampler(self, seq_id: int, sampler: object | None) -> bool:
        """Attach a sampler chain to a sequence (backend sampling), or detach with None."""
        return bool(llama_cpp.llama_set_sampler(self.ptr, seq_id, sampler))

    def sampled_token(self, i: int) -> int:
        tok = llama_cpp.llama_get_sampled_token_ith(self.ptr, i)
        if tok < 0:
            raise NativeError(f"no sampled token for batch index {i}")
        return int(tok)

    def seq_rm(self, seq_id: int, p0: int, p1: int = -1) -> bool:
        return bool(llama_cpp.llama_memory_seq_rm(self.memory, seq_id, p0, p1))

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        """Copy a sequence's KV (positions [p0, p1), -1: all) to another (empty) sequence.
        With one KV stream per sequence llama.cpp copies the source's whole stream at the
        start of the next decode, and takes no range (it aborts the process on one)."""
        llama_cpp.llama_memory_seq_cp(self.memory, src, dst, p0, p1)

    def seq_pos_min(self, seq_id: int) -> int:
        return int(llama_cpp.llama_memory_seq_pos_min(self.memory, seq_id))

    def seq_pos_max(self, seq_id: int) -> int:
        return int(llama_cpp.llama_memory_seq_pos_max(self.memory, seq_id))

    def seq_save(self, path: str, seq_id: int, tokens: list[int]) -> int:
        arr = (llama_cpp.llama_token * len(tokens))(*tokens)
        n = llama_cpp.llama_state_seq_save_file(self.ptr, path.encode(), seq_id, arr, len(tokens))
        if n == 0:
            raise NativeError(f"saving sequence {seq_id} to {path} failed")
        return int(n)

    def seq_load(self, path: str, seq_id: int, capacity: int) -> list[int]:
        arr = (llama_cpp.llama_token * capacity)()
        n_out = ctypes.c_size_t(0)
        n = llama_cpp.llama_state_seq_load_file(
            self.ptr, path.encode(), seq_id, arr, capacity, ctypes.byref(n_out)
        )
        if n == 0:
            raise NativeError(f"restoring sequence {seq_id} from {path} failed")
        return list(arr[: n_out.value])

    def seq_state(self, seq_id: int) -> bytes:
        """A sequence's whole state (its cells' positions and every stage's K and V for them,
        or its recurrent state), as ``llama_state_seq_get_data`` writes it: the KV of a remote
        stage's layers is read over its link."""
        n = llama_cpp.llama_state_seq_get_size(self.ptr, seq_id)
        buf = (ctypes.c_uint8 * n)()
        got = llama_cpp.llama_state_seq_get_data(self.ptr, buf, n, seq_id)
        if got == 0 and n:
            raise NativeError(f"reading the state of sequence {seq_id} failed")
        return ctypes.string_at(buf, got)  # one copy (slicing the array would build a list of ints)

    def set_seq_state(self, data: bytes, seq_id: int) -> bool:
        """Replace a sequence's state by one ``seq_state`` read (from a context of the same
        model and shape); False when it does not fit (the sequence is then empty)."""
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        if llama_cpp.llama_state_seq_set_data(self.ptr, buf, len(data), seq_id) == 0:
            self.seq_rm(seq_id, 0, -1)
            return False
        return True

    def synchronize(self) -> None:
        llama_cpp.llama_synchronize(self.ptr)

    # ---- the hidden states an MTP head reads -----------------------------------------------

    def set_embeddings_nextn(self, masked: bool) -> None:
        """Output the hidden state that feeds the MTP layers after each decode: one row per
        batch token (``masked`` False) or per output row."""
        mtp_hooks().llama_set_embeddings_nextn(self.ptr, True, masked)

    def embeddings_nextn(self, n_rows: int, n_embd: int) -> np.ndarray:
        """The first ``n_rows`` hidden-state rows of the last decode (a view; synchronises)."""
        ptr = mtp_hooks().llama_get_embeddings_nextn(self.ptr)
        if not ptr:
            raise NativeError("no hidden states after this decode")
        return np.ctypeslib.as_array(ptr, shape=(n_rows, n_embd))

    def embeddings_nextn_ith(self, i: int, n_embd: int) -> np.ndarray:
        """The hidden state of output row ``i`` of the last decode (a view)."""
        ptr = mtp_hooks().llama_get_embeddings_nextn_ith(self.ptr, i)
        if not ptr:
            raise NativeError(f"no hidden state for batch index {i}")
        return np.ctypeslib.as_array(ptr, shape=(n_embd,))

    def close(self) -> None:
        if getattr(self, "ptr", None):
            llama_cpp.llama_free(self.ptr)
            self.ptr = None
