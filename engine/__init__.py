"""The pipeline-group engine: N llama_contexts of one model, usable without Ray."""

from engine.config import EngineConfig
from engine.engine import Completion, Engine, OutputQueues
from engine.group import SlotBusyError
from engine.sampling import SamplingParams
from engine.types import (
    Output,
    QueueFullError,
    Request,
    RequestError,
)

__all__ = [
    "Completion",
    "Engine",
    "EngineConfig",
    "Output",
    "OutputQueues",
    "QueueFullError",
    "Request",
    "RequestError",
    "SamplingParams",
    "SlotBusyError",
]
