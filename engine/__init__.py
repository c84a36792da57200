"""The pipeline-group engine: N llama_contexts of one model, usable without Ray.

The names below load on first use: the records, the parameters and the errors import no
native code, so an HTTP process that only reads requests never loads llama.cpp.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "Completion": "engine.outputs",
    "Engine": "engine.engine",
    "OutputQueues": "engine.outputs",
    "EngineConfig": "engine.config",
    "SlotBusyError": "engine.messages",
    "SamplingParams": "engine.params",
    "Output": "engine.types",
    "Request": "engine.types",
    "QueueFullError": "engine.errors",
    "RequestError": "engine.errors",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value
