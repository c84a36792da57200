"""Where the model's layers go: the device list (RPC devices first, the local one last), the
layer split for ``peer_layers``, and the KV bytes a token takes on each device."""

from __future__ import annotations

from engine.config import EngineConfig
from engine.native.devices import local_device_name
from engine.native.gguf_shape import GgufShape
from engine.native.model import Model


def default_devices(config: EngineConfig, rpc_devices: list[str]) -> list[str] | None:
    """RPC devices first, the local device last, so the output layer and logits stay local."""
    if config.devices:
        return list(config.devices)
    if rpc_devices:
        return [*rpc_devices, local_device_name()]
    return None


def layer_split(config: EngineConfig, devices: list[str] | None) -> list[float] | None:
    """llama.cpp's tensor split for ``peer_layers``: it cuts the layers *and* the output layer
    in proportion, so n peer layers of L are the split [n, L + 1 - n]."""
    if config.peer_layers is None:
        return config.tensor_split
    if not devices or len(devices) != 2 or not devices[0].startswith("RPC"):
        raise ValueError(f"peer_layers needs the devices [RPC0, <local>], not {devices}")
    n_layer = Model.n_layer_of(config.model)
    if config.peer_layers >= n_layer:
        raise ValueError(f"peer_layers ({config.peer_layers}) must leave the local device at least one of {n_layer} layers")
    return [float(config.peer_layers), float(n_layer + 1 - config.peer_layers)]


def kv_per_device(shape: GgufShape, placed: dict[int, str]) -> dict[str, int]:
    """The f16 KV bytes a token takes on each device, by where llama.cpp put each layer
    (``Model.layer_devices``; none recorded: all on the CPU)."""
    per_layer = shape.kv_bytes(1) // max(shape.n_layer, 1)
    out: dict[str, int] = {}
    for il in range(shape.n_layer):
        dev = placed.get(il, "CPU")
        out[dev] = out.get(dev, 0) + per_layer
    return out
