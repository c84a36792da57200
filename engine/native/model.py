"""The owner of a ``llama_model`` and its vocabulary: load with a device list, placement read
from the load's log, the GGUF's pages of offloaded layers released.
"""

from __future__ import annotations

import ctypes
import logging
import pathlib
import time

import llama_cpp

from engine.errors import NativeError
from engine.native.devices import local_gpus, resolve_devices
from engine.native.library import _capture, init_backend

log = logging.getLogger(__name__)

class Model:
    """Owns a ``llama_model`` and its vocabulary."""

    def __init__(
        self,
        path: str,
        *,
        devices: list[str] | None = None,
        n_gpu_layers: int = -1,
        tensor_split: list[float] | None = None,
        repack: bool = True,
        load_mtp: bool = False,
        release_offloaded: bool = True,
        vocab_only: bool = False,
    ) -> None:
        """``load_mtp``: load the model's multi-token-prediction layers too (they are skipped
        otherwise, and an MTP context of a model loaded without them aborts the process)."""
        init_backend()
        self.path = path
        params = llama_cpp.llama_model_default_params()
        params.n_gpu_layers = 999 if n_gpu_layers < 0 else n_gpu_layers
        params.load_mtp = load_mtp
        self.load_mtp = load_mtp
        # the CPU backend's repacked weight layouts (faster kernels, other rounding); an RPC
        # stage never uses them
        params.use_extra_bufts = repack
        params.vocab_only = vocab_only  # the tokenizer and template alone (an ingress's): no weights
        self._keep: list[object] = []
        # always a list: llama.cpp's default (every GPU-like device of the registry) would take
        # an RPC server this process registered for another model; none given: this node's GPUs
        # (an empty list: the CPU alone)
        arr = resolve_devices(local_gpus() if devices is None else devices)
        self._keep.append(arr)
        params.devices = ctypes.cast(arr, ctypes.c_void_p)
        if devices:
            params.split_mode = llama_cpp.LLAMA_SPLIT_MODE_LAYER
        if tensor_split:
            ts = (ctypes.c_float * max(len(tensor_split), 16))(*tensor_split)
            self._keep.append(ts)
            params.tensor_split = ts
        if not pathlib.Path(path).is_file():
            raise FileNotFoundError(f"model file not found: {path}")
        t0 = time.perf_counter()
        _capture.placement = placement = {}
        try:
            self.ptr = llama_cpp.llama_model_load_from_file(path.encode(), params)
        finally:
            _capture.placement = None
        if not self.ptr:
            raise NativeError(f"failed to load model {path}")
        self.load_s = time.perf_counter() - t0
        # llama.cpp's own record of where each layer went (the last one is the output layer)
        self.layer_devices: dict[int, str] = placement
        self.released_bytes = self._release_off_host_pages() if release_offloaded else 0
        self.vocab = llama_cpp.llama_model_get_vocab(self.ptr)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        self.n_ctx_train = llama_cpp.llama_model_n_ctx_train(self.ptr)
        self.n_layer = llama_cpp.llama_model_n_layer(self.ptr)  # without the MTP layers
        self.n_layer_nextn = int(llama_cpp.llama_model_n_layer_nextn(self.ptr))
        self.n_embd_out = int(llama_cpp.llama_model_n_embd_out(self.ptr))
        self.add_bos = bool(llama_cpp.llama_vocab_get_add_bos(self.vocab))
        self.n_swa = int(llama_cpp.llama_model_n_swa(self.ptr))  # 0 without sliding-window layers
        # a recurrent state (whole or in part) cannot be cut at a position or copied in part
        self.recurrent = bool(llama_cpp.llama_model_is_recurrent(self.ptr) or llama_cpp.llama_model_is_hybrid(self.ptr))
        self.eos = llama_cpp.llama_vocab_eos(self.vocab)
        self.size_bytes = llama_cpp.llama_model_size(self.ptr)

    def _release_off_host_pages(self) -> int:
        """The GGUF's pages of the layers held in another device's memory (the peer's, a
        GPU's), dropped from this process and the page cache (engine/page_cache.py)."""
        if not self.layer_devices:
            return 0
        from engine.native.page_cache import release

        out = max(self.layer_devices)
        off = [il for il, dev in self.layer_devices.items() if dev != "CPU"]
        prefixes = tuple(f"blk.{il}." for il in off if il != out)
        outputs = ("output.", "output_norm.") if out in off else ()
        try:
            return release(self.path, prefixes + outputs)
        except Exception as e:  # only memory is at stake: never fail a load over it
            log.warning("could not release the pages of the off-host layers: %s", e)
            return 0

    def meta(self) -> dict[str, int]:
        """llama-server's ``/v1/models`` meta of the model."""
        return {"vocab_type": int(llama_cpp.llama_vocab_type(self.vocab)), "n_vocab": self.n_vocab,
                "n_ctx_train": self.n_ctx_train, "n_embd": int(llama_cpp.llama_model_n_embd(self.ptr)),
                "n_params": int(llama_cpp.llama_model_n_params(self.ptr)),
                "size": int(self.size_bytes)}

    @staticmethod
    def n_layer_of(path: str) -> int:
        """The layer count of a GGUF file, read from its metadata without loading weights."""
        from engine.native.gguf_shape import read_shape

        return read_shape(path).n_layer

    def chat_template(self) -> str | None:
        t = llama_cpp.llama_model_chat_template(self.ptr, None)
        return t.decode() if t else None

    def close(self) -> None:
        if getattr(self, "ptr", None):
            llama_cpp.llama_model_free(self.ptr)
            self.ptr = None

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:
            pass
