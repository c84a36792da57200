"""The native libraries of this process: the one copy of ggml libllama maps, the backend's
initialisation, llama.cpp's log routed through ``logging``, and the error lines a native call reports.

The ggml device API is not bound by llama-cpp-python, so the few functions needed are declared
here with ctypes against the libraries it ships.
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
from collections.abc import Iterator

import llama_cpp

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




def mtp_hooks():  # noqa: ANN201 - the module of llama.cpp's staging hooks
    """llama.cpp's multi-token-prediction hooks (``src/llama-ext.h``, C++ linkage), bound by
    llama-cpp-python under each ABI's symbol name; a clear error where a build lacks them."""
    try:
        from llama_cpp import llama_cpp_ext
    except (ImportError, AttributeError) as e:
        raise NativeError(f"this llama-cpp-python build has no MTP hooks (llama-ext.h): {e}") from e
    return llama_cpp_ext
