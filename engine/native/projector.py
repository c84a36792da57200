"""The model's projector (llama.cpp's mtmd, an "mmproj" GGUF), loaded once beside the model:
it turns an image's (or audio's) bytes into the rows a prompt carries (``engine.media``
says how a prompt holds them).
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from engine.errors import RequestError
from engine.media import MEDIA_SLOT, MediaSpan, is_media, media_hash, media_ids, media_key

log = logging.getLogger(__name__)


class Projector:
    """The model's projector (mtmd), used from any thread: one encode at a time (a lock), and
    the embeddings of the last images kept (``cache_bytes``), so a conversation's next turn
    about the same image does not encode it again."""

    def __init__(self, path: str, model_ptr: object, *, use_gpu: bool, n_threads: int,
                 n_embd: int, cache_bytes: int = 256 << 20) -> None:
        from llama_cpp import mtmd_cpp as m

        from engine.native import library as native

        self._m = m
        if native._log_cb is not None:  # mtmd's log as llama.cpp's: into logging, not stderr
            m.mtmd_log_set(native._log_cb, None)
            m.mtmd_helper_log_set(native._log_cb, None)
        p = m.mtmd_context_params_default()
        p.use_gpu = use_gpu
        p.n_threads = n_threads
        p.print_timings = False
        p.warmup = False
        self.ctx = m.mtmd_init_from_file(path.encode(), model_ptr, p)
        if not self.ctx:
            raise ValueError(f"cannot load the projector {path} for this model (llama.cpp's log says why)")
        self.path = path
        self.n_embd = n_embd
        self.vision = bool(m.mtmd_support_vision(self.ctx))
        self.audio = bool(m.mtmd_support_audio(self.ctx))
        # Qwen2-VL, 2.5-VL, 3-VL: an image's rows are placed in M-RoPE sections (engine/cache/positions.py)
        self.mrope = bool(m.mtmd_decode_use_mrope(self.ctx))
        self._lock = threading.Lock()
        self._cache: OrderedDict[bytes, list[_Piece]] = OrderedDict()
        self._cache_bytes, self._held = cache_bytes, 0
        # counters for /metrics (read without the lock: each a number written by one thread at a time)
        self.stats = {"encoded": 0, "encode_seconds": 0.0, "rows": 0, "cache_hits": 0}
        self._marker = m.mtmd_default_marker()

    @property
    def modalities(self) -> dict[str, bool]:
        return {"vision": self.vision, "audio": self.audio}

    def close(self) -> None:
        if getattr(self, "ctx", None):
            self._m.mtmd_free(self.ctx)
            self.ctx = None

    def expand(self, tokens: list[int], media: tuple[bytes, ...]) -> tuple[list[int], list[MediaSpan]]:
        """``tokens`` with each ``MEDIA_SLOT`` replaced by its medium's positions, and the spans
        of embedding rows; raises ``RequestError`` for a medium the projector cannot take.
        ``tokens`` are checked already: vocabulary ids, and ``MEDIA_SLOT``s."""
        slots = [i for i, t in enumerate(tokens) if t == MEDIA_SLOT]
        if len(slots) != len(media):
            raise RequestError(f"the prompt has {len(slots)} media places for {len(media)} media")
        out: list[int] = []
        spans: list[MediaSpan] = []
        last = 0
        for i, data in zip(slots, media, strict=True):
            out.extend(tokens[last:i])
            for pc in self._pieces(data):
                if pc.embd is not None:
                    spans.append(MediaSpan(len(out), pc.embd, pc.causal, pc.sections, pc.moves, pc.n_pos))
                out.extend(pc.ids)
            last = i + 1
        out.extend(tokens[last:])
        if out and is_media(out[-1]):
            raise RequestError("a prompt cannot end with an image: put text after it")
        return out, spans

    def _pieces(self, data: bytes) -> list[_Piece]:
        """What one medium is in the prompt: text tokens (``None`` rows) and embedding rows."""
        key = media_key(data)
        with self._lock:
            got = self._cache.get(key)
            if got is not None:
                self._cache.move_to_end(key)
                self.stats["cache_hits"] += 1
                return got
            t0 = time.perf_counter()
            pieces = self._encode(data, media_hash(data, key))
            rows = [pc.embd for pc in pieces if pc.embd is not None]
            self.stats["encoded"] += 1
            self.stats["encode_seconds"] += time.perf_counter() - t0
            self.stats["rows"] += sum(len(e) for e in rows)
            self._cache[key] = pieces
            self._held += sum(e.nbytes for e in rows)
            while self._held > self._cache_bytes and len(self._cache) > 1:
                _, old = self._cache.popitem(last=False)
                self._held -= sum(pc.embd.nbytes for pc in old if pc.embd is not None)
            return pieces

    def _encode(self, data: bytes, h: int) -> list[_Piece]:
        m = self._m
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        bitmap = m.mtmd_helper_bitmap_init_from_buf(self.ctx, buf, len(data), False)
        if not bitmap:
            raise RequestError("the image (or audio) cannot be decoded: send a whole PNG, JPEG, GIF or BMP "
                               "(or WAV, MP3, FLAC audio where the model takes audio)")
        chunks = m.mtmd_input_chunks_init()
        try:
            text = m.mtmd_input_text()
            text.text, text.text_len = self._marker, len(self._marker)
            text.add_special, text.parse_special = False, True
            arr = (m.mtmd_bitmap_p_ctypes * 1)(bitmap)
            rc = m.mtmd_tokenize(self.ctx, chunks, ctypes.byref(text), arr, 1)
            if rc != 0:
                raise RequestError(f"the projector cannot take this medium (mtmd_tokenize returned {rc}): "
                                   "audio to a model without audio, or an image to one without vision")
            pieces: list[_Piece] = []
            for i in range(m.mtmd_input_chunks_size(chunks)):
                c = m.mtmd_input_chunks_get(chunks, i)
                if m.mtmd_input_chunk_get_type(c) == m.MTMD_INPUT_CHUNK_TYPE_TEXT:
                    n = ctypes.c_size_t()
                    ptr = m.mtmd_input_chunk_get_tokens_text(c, ctypes.byref(n))
                    pieces.append(_Piece([ptr[k] for k in range(n.value)]))
                    continue
                n_rows = m.mtmd_input_chunk_get_n_tokens(c)
                n_pos = m.mtmd_input_chunk_get_n_pos(c)
                sections = moves = None
                if self.mrope:
                    sections, moves = self._sections(c, n_rows)
                elif n_pos != n_rows:
                    raise RequestError("this projector places its rows unlike tokens: not supported")
                if m.mtmd_encode_chunk(self.ctx, c) != 0:
                    raise RequestError("the projector failed to encode the medium")
                ptr = m.mtmd_get_output_embd(self.ctx)
                embd = np.ctypeslib.as_array(ptr, shape=(n_rows * self.n_embd,)).reshape(n_rows, self.n_embd).copy()
                causal = not m.mtmd_decode_use_non_causal(self.ctx, c)
                ids = media_ids(h + sum(len(p.ids) for p in pieces), n_rows)
                pieces.append(_Piece(ids, embd, causal, sections, moves, None if n_pos == n_rows else n_pos))
            return pieces
        finally:
            m.mtmd_input_chunks_free(chunks)
            m.mtmd_bitmap_free(bitmap)


    def _sections(self, c: object, n_rows: int) -> tuple[np.ndarray, np.ndarray]:
        """A medium's rows in M-RoPE sections (time, row, column, fourth), as mtmd places them:
        read for a first position of 0 and of 1, so that what moves with it is known."""
        m = self._m
        img = m.mtmd_input_chunk_get_tokens_image(c)
        if not img:  # audio: one position a row, the same in every section
            at0 = np.tile(np.arange(n_rows, dtype=np.int32), (4, 1))
            return at0, np.ones((4, n_rows), np.int32)
        def at(p0: int) -> np.ndarray:
            out = np.empty((4, n_rows), np.int32)
            for k in range(n_rows):
                d = m.mtmd_image_tokens_get_decoder_pos(img, p0, k)
                out[:, k] = (d.t, d.y, d.x, d.z)
            return out
        at0 = at(0)
        return at0, at(1) - at0


@dataclass(frozen=True)
class _Piece:
    """What a medium is in a prompt, piece by piece: text tokens (no rows), or rows with their ids."""

    ids: list[int]
    embd: np.ndarray | None = None
    causal: bool = True
    sections: np.ndarray | None = None
    moves: np.ndarray | None = None
    n_pos: int | None = None


def load_projector(config: object, model: object) -> Projector:
    """The projector of ``config.mmproj`` for ``model`` (an ``engine.native.Model``): on this
    node's GPU when it has one and ``mmproj_offload`` allows, else on its CPU."""
    import llama_cpp

    from engine.native.devices import local_gpus

    use_gpu = bool(config.mmproj_offload and local_gpus())  # type: ignore[attr-defined]
    p = Projector(str(config.mmproj), model.ptr, use_gpu=use_gpu,  # type: ignore[attr-defined]
                  n_threads=config.local_threads(),  # type: ignore[attr-defined]
                  n_embd=int(llama_cpp.llama_model_n_embd_inp(model.ptr)),  # deepstack: wider  # type: ignore[attr-defined]
                  cache_bytes=config.media_cache_mib << 20)  # type: ignore[attr-defined]
    log.info("projector %s loaded on the %s: %s", config.mmproj, "GPU" if use_gpu else "CPU",  # type: ignore[attr-defined]
             ", ".join(k for k, v in p.modalities.items() if v) or "nothing")
    return p
