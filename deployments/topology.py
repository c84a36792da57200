"""Which shape the application takes on the cluster (``topology: auto | replicas | layer_split``).

A layer split exists for a model too big for one node; for a model that fits, the second node
is worth more as a second copy. ``replicas``: one engine replica per node, each with the whole
model on its own device and no RPC stage. ``layer_split``: today's pairs (an engine and its
RPC stage per two nodes). ``auto`` picks from what the model needs (its weights plus the KV
cache of the configured context and slots, with a margin) against each node's memory (GPU
memory where the node has a GPU, else its RAM), and says why.

The facts about a node are gathered on that node by a zero-CPU Ray task (``probe``): its
memory, its device and whether it has the model file, so that a replica's node that lacks
the file is refused at start with its address and the path.
"""

from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

log = logging.getLogger(__name__)

Topology = Literal["auto", "replicas", "layer_split"]
# the model may use at most this share of a node's memory (the rest: compute buffers, the OS,
# Ray, the RPC client's buffers)
FIT_SHARE = 0.8
# a test (or a user who knows better) states a node's usable memory, in MiB, as this Ray resource
MEMORY_RESOURCE = "pgroups_memory_mib"


@dataclass(frozen=True)
class NodeFacts:
    node_id: str
    address: str
    memory_bytes: int  # what the model may use there (GPU memory, else RAM)
    device: str  # "CUDA0: NVIDIA ...", "CPU"
    has_model: bool


@dataclass(frozen=True)
class TopologyChoice:
    topology: Literal["replicas", "layer_split", "single"]
    reason: str
    need_bytes: int
    node_bytes: int  # the smallest node's memory (0: not known)
    nodes: int  # engine replicas it places (replicas), or pairs' nodes

    def as_dict(self) -> dict:
        return asdict(self)


def kv_bytes(model: str, n_ctx: int) -> int:
    """Bytes of an f16 KV cache of ``n_ctx`` cells (all slots together) for the GGUF's layers."""
    from engine.native.gguf_shape import read_shape

    return read_shape(model).kv_bytes(n_ctx)


def model_needs(model: str, n_ctx: int, cache_bytes: int | None = 0) -> int:
    """What serving the model whole on one node takes: its weights, its slots' KV cache and its
    prompt cache (``cache_bytes``; None: as much again as the slots', its default)."""
    kv = kv_bytes(model, n_ctx)
    return os.path.getsize(model) + kv + (kv if cache_bytes is None else cache_bytes)


def choose(requested: Topology, need: int, nodes: list[NodeFacts], split_configured: bool) -> TopologyChoice:
    """The topology for a model needing ``need`` bytes on a cluster of ``nodes`` (the nodes
    that serve it: those with a stage resource, else all). ``split_configured``: the config
    has an RPC stage (``rpc``), which the layer split needs."""
    smallest = min((n.memory_bytes for n in nodes), default=0)
    fits = smallest > 0 and need <= FIT_SHARE * smallest
    gib = 1 << 30
    what = f"the model needs {need / gib:.2f} GiB; the smallest of {len(nodes)} node(s) has {smallest / gib:.2f} GiB"
    if requested == "replicas":
        return TopologyChoice("replicas", f"configured ({what})", need, smallest, len(nodes))
    if requested == "layer_split":
        return TopologyChoice("layer_split", f"configured ({what})", need, smallest, len(nodes))
    if len(nodes) < 2:
        return TopologyChoice("single", f"auto: one node ({what})", need, smallest, 1)
    if fits:
        return TopologyChoice("replicas", f"auto: fits one node with {100 * (1 - FIT_SHARE):.0f} % to spare, so each node "
                      f"serves a copy ({what})", need, smallest, len(nodes))
    if not split_configured:
        return TopologyChoice("replicas", f"auto: does not fit one node, but the config has no rpc stage to split over; "
                      f"replicas ({what})", need, smallest, len(nodes))
    return TopologyChoice("layer_split", f"auto: does not fit one node, so its layers are split over a pair ({what})",
                  need, smallest, len(nodes))


def missing_model(nodes: list[NodeFacts], model: str) -> str | None:
    """The refusal when a node that must load the model lacks the file."""
    lack = [n.address for n in nodes if not n.has_model]
    if not lack:
        return None
    return (f"topology replicas: node(s) {', '.join(lack)} lack the model file {model}; copy it there (the ray up "
            f"config's file_mounts) or use topology: layer_split")


def local_facts(model: str, memory_mib: float | None = None, fetch_default: bool = False) -> dict:
    """This node's facts (run on the node): usable memory, device, the model file (the
    embedded default is fetched when it is missing)."""
    if fetch_default and not Path(model).is_file():
        from engine.models import ensure_shipped

        try:
            ensure_shipped(model)
        except Exception as e:  # reported as a missing file
            log.warning("fetching the default model failed: %s", e)
    device, memory = "CPU", 0
    try:
        from engine.native.devices import list_devices
        from engine.native.library import init_backend

        init_backend()
        gpus = [d for d in list_devices() if d.type in (1, 2)]  # a GPU, or an integrated one (unified memory)
        if gpus:
            device, memory = f"{gpus[0].name}: {gpus[0].description}", gpus[0].memory_free
    except Exception as e:  # no llama.cpp in this process: the node's RAM
        log.debug("no device list: %s", e)
    if not memory:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if memory_mib:
        memory = int(memory_mib) << 20
    return {"memory_bytes": int(memory), "device": device, "has_model": Path(model).is_file()}


def probe(model: str, resources: tuple[str, ...], fetch_default: bool = False) -> list[NodeFacts]:
    """Facts of every alive node that serves (one of ``resources``, else every node), each
    gathered on its node."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    alive = [n for n in ray.nodes() if n.get("Alive")]
    serving = [n for n in alive if any(r in n.get("Resources", {}) for r in resources)] or alive
    task = ray.remote(num_cpus=0)(local_facts)
    refs = [task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote(
        model, n["Resources"].get(MEMORY_RESOURCE), fetch_default) for n in serving]
    facts = ray.get(refs, timeout=120)
    return [NodeFacts(n["NodeID"], n.get("NodeManagerAddress", "?"), **f) for n, f in zip(serving, facts, strict=True)]
