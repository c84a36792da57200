"""The Ray Serve application: ``build_app(args)`` for ``serve run <config>``.

The builder validates the arguments once (pydantic, a description on every field), starts
the RPC stage on the peer node and waits until it accepts connections, then binds the
engine deployment (local node) and the OpenAI ingress in front of it.
"""

from __future__ import annotations

import ipaddress
import logging
import os
from pathlib import Path
from typing import Any

from deployments.args import LOCAL_RESOURCE, PEER_RESOURCE, AppArgs, is_wildcard
from deployments.topology import TopologyChoice, choose, missing_model, model_needs, probe
from engine.models import ensure_shipped, is_shipped

log = logging.getLogger(__name__)
HEAD_RESOURCE = "node:__internal_head__"  # Ray's own resource of the head node

def _has_resource(name: str) -> bool:
    import ray

    return ray.cluster_resources().get(name, 0) > 0


def _ensure_model(path: str) -> None:
    if is_shipped(path):
        ensure_shipped(path)
    elif not Path(path).is_file():
        raise FileNotFoundError(f"model file not found: {path}")


def check_exposure(host: str | None, a: AppArgs) -> None:
    """An API anyone on the network may use is a choice the config must make: every interface
    without a key is refused unless ``allow_unauthenticated``; another non-loopback address
    without a key is logged loudly."""
    if host is None or a.api_key:
        return
    if is_wildcard(host):
        if not a.allow_unauthenticated:
            raise ValueError(
                f"http_options.host {host!r} serves every interface and the app has no api_key: anyone who "
                "reaches the port can use the model. Set api_key, bind a private address, or set "
                "allow_unauthenticated: true in the app's args")
        log.warning("SERVING WITHOUT AN API KEY ON EVERY INTERFACE (%s), as allow_unauthenticated asks", host)
        return
    try:
        loopback = ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback:
        log.warning("SERVING WITHOUT AN API KEY ON %s: anyone who reaches this address can use the model; "
                    "set api_key in the app's args to require one", host)


def _serve_http() -> tuple[str, int, bool] | None:
    """Serve's HTTP address, port and whether it runs HTTP proxies (asked of the controller);
    None outside Serve."""
    try:
        import ray

        if not ray.is_initialized():
            return None
        from deployments.direct import serve_http_config

        return serve_http_config()
    except Exception:  # not in a Serve application build
        return None


def plan_topology(a: AppArgs) -> TopologyChoice:
    """The application's shape on the running cluster (deployments/topology.py); replicas are
    refused when a node that would load the model lacks its file."""
    if a.topology == "layer_split":
        return TopologyChoice("layer_split", "configured", 0, 0, 0)
    nodes = probe(a.model, (LOCAL_RESOURCE, PEER_RESOURCE), fetch_default=is_shipped(a.model))
    choice = choose(a.topology, model_needs(a.model, a.n_ctx, a.prompt_cache_bytes), nodes, a.split)
    if choice.topology == "replicas" and (refusal := missing_model(nodes, a.model)):
        raise ValueError(refusal)
    return choice


def build_app(args: dict[str, Any]):  # noqa: ANN201 - a serve.Application
    from deployments.engine_deployment import EngineDeployment
    from deployments.ingress import Ingress

    a = AppArgs.model_validate(args or {})
    http = _serve_http()
    check_exposure(http[0] if http else None, a)
    _ensure_model(a.model)
    topo = plan_topology(a)
    log.warning("topology %s: %s", topo.topology, topo.reason)
    replicas = topo.topology == "replicas"
    if replicas:
        from deployments.stage.actor import stop_stage

        stop_stage()  # a shared stage an earlier split app left would hold the peer's device
        # each node serves the whole model on its own device; the node with the peer stage's
        # resource uses the cores set aside for the stage (rpc.cpus)
        engine = EngineDeployment.options(
            ray_actor_options={"num_cpus": 0}, num_replicas=topo.nodes, max_replicas_per_node=1,
        ).bind(a.replica_config().model_dump(), topology=topo.as_dict(),
               peer_cpus=a.rpc.cpus if a.rpc is not None else None)
    else:
        engine = _split_engine(a, topo)
    # Serve asks the replica the pair router chose how many requests it holds before sending it one,
    # and sends the request to the next replica when no answer comes within 0.1 s: on a loaded node a
    # replica's answer can take longer, and a conversation would lose the pair that holds its prefix.
    # The ingress's routers wait longer (doubling, to Serve's 1 s, for a replica that never answers).
    probe_s = os.environ.get("RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S", "0.5")
    ingress_opts: dict[str, Any] = {"num_cpus": 0, "runtime_env": {
        "env_vars": {"RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S": probe_s}}}
    pairs_placed = not replicas and a.pairs and a.placement and _has_resource(PEER_RESOURCE)
    direct = http is not None and not http[2]  # no Serve proxy: the ingress serves HTTP itself
    if direct:
        # on the head, where Serve's HeadOnly proxy would listen: http_options' address is its
        ingress_opts["resources"] = {HEAD_RESOURCE: 0.001}
    elif a.placement and _has_resource(LOCAL_RESOURCE) and not pairs_placed:
        # beside the engine on the local node (pairs' engines hold every local node's whole
        # stage_local: their ingress goes anywhere)
        ingress_opts["resources"] = {LOCAL_RESOURCE: 0.01}
    names = [a.model_alias or Path(a.model).name]
    if a.model_alias:
        names.append(Path(a.model).name)
    guard = {"body_timeout_s": a.body_timeout_s, "min_body_rate": a.min_body_rate,
             "max_requests_per_client": a.max_requests_per_client, "cors_origins": list(a.cors_origins),
             "allowed_hosts": [h.lower() for h in a.allowed_hosts]}
    limits = {k: getattr(a, k) for k in ("head_timeout_s", "keep_alive_timeout_s", "max_head_bytes",
                                         "max_connections", "max_connections_per_client")}
    return Ingress.options(ray_actor_options=ingress_opts).bind(
        engine, names, a.api_key, a.request_timeout_s, a.max_body_bytes, strict_request_fields=a.strict_request_fields,
        cache_salt_by_key=a.cache_salt_by_key, guard=guard, http=(http[0], http[1]) if direct else None, http_limits=limits,
        resume_limit=a.resume_limit, resume_wait_s=a.resume_wait_s,
    )


def _split_engine(a: AppArgs, topo: TopologyChoice):  # noqa: ANN202 - a bound deployment
    """The engine as configured: with an RPC stage (one, or one per replica: pairs) or alone."""
    from deployments.engine_deployment import EngineDeployment

    endpoints: list[str] = []
    pairs = a.pairs
    if a.split:
        from deployments.stage.actor import start_stage, stop_stage

        if pairs:  # a shared stage left by a one-pair app holds part of a peer node: free it
            stop_stage()
        else:
            endpoints = [start_stage(a.rpc, PEER_RESOURCE if a.placement else None, LOCAL_RESOURCE)]
    # validated before anything is deployed, a pair's stage standing in by a placeholder: each
    # engine replica adds its own stage's endpoint
    cfg = a.engine_config([*endpoints, *(["127.0.0.1:1"] if pairs else [])])
    if pairs:
        cfg = cfg.model_copy(update={"rpc_endpoints": list(a.rpc_endpoints)})
    engine_opts: dict[str, Any] = {}
    if pairs and a.placement and _has_resource(LOCAL_RESOURCE) and _has_resource(PEER_RESOURCE):
        # one placement group per replica: the engine on a local node, its stage on a peer node
        engine_opts = {"placement_group_bundles": [{LOCAL_RESOURCE: 1}, {PEER_RESOURCE: 1}],
                       "placement_group_strategy": "STRICT_SPREAD"}
        engine_actor: dict[str, Any] = {"num_cpus": 0, "resources": {LOCAL_RESOURCE: 1}}
    else:
        engine_actor = {"num_cpus": 0}
        if a.placement and _has_resource(LOCAL_RESOURCE):
            engine_actor["resources"] = {LOCAL_RESOURCE: 0.01}
    return EngineDeployment.options(ray_actor_options=engine_actor, num_replicas=a.replicas, **engine_opts).bind(
        cfg.model_dump(), stage_timeout_s=a.stage_timeout_s,
        stall={"factor": a.stage_stall_factor, "floor_s": a.stage_stall_floor_s},
        pair_stage=a.rpc.model_dump() if pairs else None, topology=topo.as_dict(),
    )


def drain(app_name: str, grace_s: float) -> list:
    """Start draining every engine replica of a running application (a Ray driver calls this
    before ``serve.shutdown``): each gets ``grace_s`` to finish its requests, then cuts the
    rest. Returns the replicas' responses (``.result()`` gives ``{"cut": n}``); none when the
    application has no engine deployment."""
    from ray import serve

    from deployments.router import known_replicas

    if "engine" not in serve.status().applications[app_name].deployments:
        return []
    handle = serve.get_deployment_handle("engine", app_name=app_name)
    handle.info.remote().result(timeout_s=10)  # the router learns every replica (pair)
    return [handle.drain.remote(grace_s, replica=replica) for replica in known_replicas("engine") or [None]]
