"""The devices a model is placed on: the local ones, an RPC server's, resolved by name.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from dataclasses import dataclass

from engine.errors import NativeError
from engine.native.library import ggml

log = logging.getLogger(__name__)

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
