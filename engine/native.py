"""Owners of llama.cpp's native handles: backend, devices, model, context, batch.

One Python object owns each handle and frees it in ``close()``; contexts are closed before
their model (principle 4 of the design). Every return code that can fail is checked and
turned into an exception. The ggml device API is not bound by llama-cpp-python, so the
few functions needed are declared here with ctypes against the libraries it ships.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import pathlib
import re
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

# ggml aborts the process on a lost RPC server (or any GGML_ABORT) and first has gdb print a
# backtrace of it: about 4 s, all of it added to the pause of every stream the lost replica
# resumes elsewhere. Read at the abort (and at load, for its terminate handler);
# PGROUPS_GGML_BACKTRACE=1 keeps the backtrace for a developer.
if os.environ.get("PGROUPS_GGML_BACKTRACE") != "1":
    os.environ.setdefault("GGML_NO_BACKTRACE", "1")

import llama_cpp  # noqa: E402
import numpy as np  # noqa: E402

from engine.errors import NativeError

log = logging.getLogger(__name__)

_LIB_DIR = pathlib.Path(llama_cpp.__file__).parent / "lib"
_init_lock = threading.Lock()
_initialised = False


def _mapped(name: str) -> str | None:
    """The path of ``lib{name}`` as this process already maps it (libllama's dependency), if so."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rsplit(maxsplit=1)[-1]
                if re.fullmatch(rf"lib{re.escape(name)}\.so(\.\d+)*", os.path.basename(path)):
                    return path
    except OSError:  # no /proc (macOS)
        pass
    return None


def _load(name: str) -> ctypes.CDLL:
    """``lib{name}``, the very copy libllama uses. pip's wheel holds ``lib{name}.so``, ``.so.0`` and
    ``.so.0.x`` as three separate files (a wheel has no symbolic links), and libllama links the
    soname (``.so.0``): opening another of them loads a second ggml into the process, with its
    own device registry (an RPC device registered there is unknown to libllama's), its own
    logger and CPU buffer type, and, bound globally, functions of one copy called on the
    other's objects. So: the copy already mapped, else the soname (shortest versioned name)."""
    versioned = sorted(_LIB_DIR.glob(f"lib{name}.so.[0-9]*"), key=lambda p: len(p.name))
    plain = sorted(_LIB_DIR.glob(f"lib{name}.so")) + sorted(_LIB_DIR.glob(f"lib{name}.dylib"))
    for cand in [p for p in [_mapped(name)] if p] + [str(p) for p in versioned + plain]:
        return ctypes.CDLL(str(cand))
    raise NativeError(f"lib{name} not found in {_LIB_DIR}; was llama-cpp-python built with it?")


class _Ggml:
    """ctypes declarations of the ggml backend/device API (libggml, libggml-base, libggml-rpc)."""

    def __init__(self) -> None:
        base = _load("ggml-base")
        ggml = _load("ggml")
        vp, cp, sz = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t

        def fn(lib: ctypes.CDLL, name: str, res, *args):  # noqa: ANN001
            f = getattr(lib, name)
            f.restype = res
            f.argtypes = list(args)
            return f

        self.dev_count = fn(ggml, "ggml_backend_dev_count", sz)
        self.dev_get = fn(ggml, "ggml_backend_dev_get", vp, sz)
        self.dev_by_name = fn(ggml, "ggml_backend_dev_by_name", vp, cp)
        self.device_register = fn(ggml, "ggml_backend_device_register", None, vp)
        self.dev_name = fn(base, "ggml_backend_dev_name", cp, vp)
        self.dev_description = fn(base, "ggml_backend_dev_description", cp, vp)
        self.dev_type = fn(base, "ggml_backend_dev_type", ctypes.c_int, vp)
        self.dev_memory = fn(
            base, "ggml_backend_dev_memory", None, vp, ctypes.POINTER(sz), ctypes.POINTER(sz)
        )
        self.reg_dev_count = fn(base, "ggml_backend_reg_dev_count", sz, vp)
        self.reg_dev_get = fn(base, "ggml_backend_reg_dev_get", vp, vp, sz)
        self._rpc: ctypes.CDLL | None = None

    @property
    def rpc(self) -> ctypes.CDLL:
        if self._rpc is None:
            lib = _load("ggml-rpc")
            lib.ggml_backend_rpc_add_server.restype = ctypes.c_void_p
            lib.ggml_backend_rpc_add_server.argtypes = [ctypes.c_char_p]
            lib.ggml_backend_rpc_start_server.restype = None
            lib.ggml_backend_rpc_start_server.argtypes = [
                ctypes.c_char_p,
                ctypes.c_char_p,
                ctypes.c_size_t,
                ctypes.c_size_t,
                ctypes.POINTER(ctypes.c_void_p),
            ]
            self._rpc = lib
        return self._rpc


_ggml: _Ggml | None = None


def ggml() -> _Ggml:
    global _ggml
    if _ggml is None:
        _ggml = _Ggml()
    return _ggml


def init_backend(quiet: bool = True) -> None:
    """Initialise llama.cpp once per process; route its log through ``logging``."""
    global _initialised
    with _init_lock:
        if _initialised:
            return
        # PGROUPS_LLAMA_LOG=stderr: llama.cpp's own log, unfiltered, as llama-server prints it
        if quiet and os.environ.get("PGROUPS_LLAMA_LOG") != "stderr":
            _install_log_callback()
        llama_cpp.llama_backend_init()
        _initialised = True


_log_cb = None  # keeps the ctypes callback alive
_capture = threading.local()
_PLACED = re.compile(r"layer +(\d+) assigned to device (\S+?),")


_stderr_lock = threading.Lock()


@contextlib.contextmanager
def native_errors() -> Iterator[list[str]]:
    """Collect the error lines llama.cpp reports meanwhile: those it logs on this thread, and
    those it prints to stderr (its grammar parser does). Lines printed by other threads in
    that moment go on to stderr as usual. Short native calls only."""
    lines: list[str] = []
    _capture.lines = lines
    with _stderr_lock, tempfile.TemporaryFile() as tmp:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(tmp.fileno(), 2)
        try:
            yield lines
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            _capture.lines = None
            tmp.seek(0)
            printed = tmp.read().decode("utf-8", "replace")
            for line in printed.splitlines():
                if "error" in line or line.startswith(("parse:", "failed")):
                    lines.insert(0, line.strip())
                else:
                    sys.stderr.write(line + "\n")


def _install_log_callback() -> None:
    global _log_cb
    native_log = logging.getLogger("llama_cpp.native")

    @llama_cpp.llama_log_callback
    def _cb(level: int, text: bytes, _user: ctypes.c_void_p) -> None:
        if level >= 4 or not text:  # GGML_LOG_LEVEL_ERROR == 4
            if level == 4 and text:
                msg = text.decode("utf-8", "replace").rstrip()
                lines = getattr(_capture, "lines", None)
                if lines is not None:
                    lines.append(msg)
                native_log.error(msg)
            return
        msg = text.decode("utf-8", "replace").rstrip()
        placed = getattr(_capture, "placement", None)
        if placed is not None and (m := _PLACED.search(msg)):
            placed[int(m.group(1))] = m.group(2)
        native_log.debug(msg)

    _log_cb = _cb
    llama_cpp.llama_log_set(_cb, ctypes.c_void_p(0))


@dataclass(frozen=True)
class DeviceInfo:
    name: str
    description: str
    type: int  # 0 CPU, 1 GPU, 2 IGPU, 3 ACCEL
    memory_free: int
    memory_total: int


def list_devices(memory: bool = True) -> list[DeviceInfo]:
    """The devices of this process; without ``memory`` their names and types only (asking a
    registered RPC device for its memory talks to its server, which may be gone)."""
    g = ggml()
    out = []
    for i in range(g.dev_count()):
        dev = g.dev_get(i)
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        if memory:
            g.dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        out.append(
            DeviceInfo(
                name=g.dev_name(dev).decode(),
                description=(g.dev_description(dev) or b"").decode(),
                type=g.dev_type(dev),
                memory_free=free.value,
                memory_total=total.value,
            )
        )
    return out


_rpc_lock = threading.Lock()
_rpc_registered: dict[str, list[str]] = {}


def add_rpc_server(endpoint: str) -> list[str]:
    """Register a ggml RPC server as devices of this process; returns their names (RPC0...)."""
    with _rpc_lock:
        if endpoint in _rpc_registered:
            return _rpc_registered[endpoint]
        g = ggml()
        reg = g.rpc.ggml_backend_rpc_add_server(endpoint.encode())
        if not reg:
            raise NativeError(f"could not register RPC server {endpoint}")
        names = []
        for i in range(g.reg_dev_count(reg)):
            dev = g.reg_dev_get(reg, i)
            g.device_register(dev)
            names.append(g.dev_name(dev).decode())
        _rpc_registered[endpoint] = names
        return names


def local_gpus() -> list[str]:
    """This node's GPUs (no RPC device), in the registry's order. Reads names and types only:
    asking a registered RPC device for its memory talks to its server, and one that is gone
    aborts the process inside ggml."""
    g = ggml()
    names = [(g.dev_name(dev).decode(), g.dev_type(dev)) for dev in (g.dev_get(i) for i in range(g.dev_count()))]
    return [n for n, t in names if t in (1, 2) and not n.startswith("RPC")]  # 1 GPU, 2 IGPU


def local_device_name() -> str:
    """The device that should hold the last layers and the output: the first GPU, else CPU."""
    return next(iter(local_gpus()), "CPU")


def resolve_devices(names: list[str]) -> ctypes.Array:
    """A NULL-terminated ggml_backend_dev_t array for ``llama_model_params.devices``."""
    g = ggml()
    ptrs = []
    for n in names:
        dev = g.dev_by_name(n.encode())
        if not dev:
            avail = ", ".join(d.name for d in list_devices(memory=False))
            raise ValueError(f"unknown device {n!r}; available devices: {avail}")
        ptrs.append(dev)
    arr = (ctypes.c_void_p * (len(ptrs) + 1))(*ptrs, None)
    return arr


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
        from engine.page_cache import release

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
        from engine.gguf_shape import read_shape

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
    ) -> None:
        """``embeddings``: a context that pools each sequence's outputs into one vector
        (``pooling``: a ``LLAMA_POOLING_TYPE_*``; None: the GGUF's). ``mtp``: the context of
        the model's multi-token-prediction layers (their own KV), for drafting."""
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


def mtp_hooks():  # noqa: ANN201 - the module of llama.cpp's staging hooks
    """llama.cpp's multi-token-prediction hooks (``src/llama-ext.h``, C++ linkage), bound by
    llama-cpp-python under each ABI's symbol name; a clear error where a build lacks them."""
    try:
        from llama_cpp import llama_cpp_ext
    except (ImportError, AttributeError) as e:
        raise NativeError(f"this llama-cpp-python build has no MTP hooks (llama-ext.h): {e}") from e
    return llama_cpp_ext


class Batch:
    """A ``llama_batch`` whose arrays are numpy buffers, so a step fills it with slices.

    Each token belongs to exactly one sequence; ``seq_id[i]`` points into one int32 array.
    With ``n_embd``, every row carries a vector beside its token too (an MTP context's input:
    the token and the hidden state that came before it).
    """

    def __init__(self, capacity: int, n_embd: int = 0, *, embeddings_only: bool = False) -> None:
        """``embeddings_only`` (with ``n_embd``): the rows are their vectors alone, no token
        (a medium's rows from the projector)."""
        self.capacity = capacity
        self.embd = np.zeros((capacity, n_embd), np.float32) if n_embd else None
        self.token = np.zeros(capacity, np.int32)
        self.pos = np.zeros(capacity, np.int32)
        self.n_seq_id = np.ones(capacity, np.int32)
        self.seq = np.zeros(capacity, np.int32)
        self.logits = np.zeros(capacity, np.int8)
        i32p = ctypes.POINTER(ctypes.c_int32)
        base = self.seq.ctypes.data
        self._seq_ptrs = (i32p * capacity)(*[ctypes.cast(base + 4 * i, i32p) for i in range(capacity)])
        self.struct = llama_cpp.llama_batch(
            n_tokens=0,
            token=None if embeddings_only else self.token.ctypes.data_as(i32p),
            embd=self.embd.ctypes.data_as(ctypes.POINTER(ctypes.c_float)) if n_embd else None,
            pos=self.pos.ctypes.data_as(i32p),
            n_seq_id=self.n_seq_id.ctypes.data_as(i32p),
            seq_id=ctypes.cast(self._seq_ptrs, ctypes.POINTER(i32p)),
            logits=self.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8)),
        )
        self.n_tokens = 0

    def clear(self) -> None:
        self.n_tokens = 0
        self.struct.n_tokens = 0

    def add(self, tokens: list[int], pos0: int, seq_id: int, n_logits: int | bool,
            embd: np.ndarray | None = None) -> int:
        """Append tokens of one sequence, the last ``n_logits`` of them with logits (a bool:
        the last one or none), and with ``embd`` their vectors; returns the row of the first
        token."""
        n = len(tokens)
        i = self.n_tokens
        if i + n > self.capacity:
            raise ValueError("batch overflow")
        if embd is not None:
            self.embd[i : i + n] = embd
        self.token[i : i + n] = tokens
        self.pos[i : i + n] = np.arange(pos0, pos0 + n, dtype=np.int32)
        self.seq[i : i + n] = seq_id
        self.logits[i : i + n] = 0
        if n_logits:
            self.logits[i + n - int(n_logits) : i + n] = 1
        self.n_tokens = i + n
        self.struct.n_tokens = self.n_tokens
        return i

    @property
    def free(self) -> int:
        return self.capacity - self.n_tokens
