"""What the server says of itself, in its clients' shapes: the served model (OpenAI's
``/v1/models``, with llama-server's ``meta`` and ``capabilities``), llama-server's ``/props``
and ``/slots`` (and a slot's save, restore and erase). Read from an engine replica's raw report
and shaped here, in the ingress."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field

from deployments.api import media
from deployments.api.base import ApiError, ApiModel, read_request
from engine.params import SamplingParams

ENDPOINTS = ()


async def models(ing: Any, request: Request) -> Response:
    """The served model under each of its names (any other name serves it too), with
    llama-server's ``meta`` and ``capabilities`` ("multimodal" with a projector), and what it
    takes beside text (``modalities``)."""
    try:
        info = await asyncio.wait_for(ing.engine.info.remote(), timeout=10.0)
    except Exception:  # the engine is restarting: the list without meta
        info = {}
    meta, modalities = info.get("meta"), info.get("modalities") or {}
    extra: dict[str, Any] = {"meta": meta} if meta else {}
    if info:
        extra["capabilities"] = ["completion", "multimodal"] if any(modalities.values()) else ["completion"]
        extra["modalities"] = ["text", *(k for k in ("vision", "audio") if modalities.get(k))]
    data = [{"id": name, "object": "model", "created": 0, "owned_by": "pipeline-groups", **extra}
            for name in ing.model_names]
    return JSONResponse({"object": "list", "data": data})


def llama_props(tok: Any, report: dict) -> dict:
    """llama-server's ``/props`` of an engine replica (``report``: its ``props()``; ``tok``: the
    model's tokenizer, the ingress's), with every field its web UI, Zed and SillyTavern read,
    and this server's own (groups, devices, topology)."""
    config, n_ctx_slot = report["config"], report["n_ctx_slot"]
    return {
        "default_generation_settings": {
            "id": 0, "id_task": -1, "n_ctx": n_ctx_slot, "is_processing": False,
            "speculative": config.speculative is not None, "params": llama_params(n_ctx_slot, config),
        },
        "total_slots": config.n_parallel,
        "model_alias": report["model_name"],
        "model_path": config.model,
        "modalities": report.get("modalities") or {"vision": False, "audio": False, "video": False},
        "media_marker": media.MEDIA_MARKER,  # where /completion's multimodal_data go in its prompt
        "endpoint_slots": True, "endpoint_props": True, "endpoint_metrics": True,
        "chat_template": tok.template.source,
        "chat_template_caps": {
            # what this server does with the template: tools are served for every template (in
            # it when it takes them, else in a system message), calls are parsed from the text
            "supports_tools": True, "supports_tool_calls": True, "supports_parallel_tool_calls": True,
            "supports_system_role": True, "supports_preserve_reasoning": False, "requires_typed_content": False,
            "supports_string_content": True, "supports_typed_content": False,
        },
        "chat_template_origin": tok.template.origin,
        "bos_token": tok.bos_text,
        "eos_token": tok.eos_text,
        "build_info": f"pipeline-groups {_version()} (llama-cpp-python {_llama_cpp_version()})",
        "is_sleeping": False,
        "pipeline_groups": config.pipeline_groups,
        "devices": report["devices"],
        "topology": report["topology"],
    }


def llama_params(n_ctx_slot: int, config: Any) -> dict[str, Any]:
    """The default sampling settings in llama-server's names and types (its web UI syncs its
    settings from these: every value a number, ``samplers`` a list of names)."""
    d = SamplingParams(max_tokens=n_ctx_slot)
    spec = config.speculative
    return {
        "seed": config.seed if config.seed >= 0 else 4294967295,  # llama-server's random seed
        "temperature": d.temperature, "dynatemp_range": d.dynatemp_range, "dynatemp_exponent": d.dynatemp_exponent,
        "top_k": d.top_k, "top_p": d.top_p, "min_p": d.min_p, "top_n_sigma": d.top_n_sigma,
        "xtc_probability": d.xtc_probability, "xtc_threshold": d.xtc_threshold,
        "typical_p": d.typical_p, "typ_p": d.typical_p,  # the web UI looks for typ_p
        "repeat_last_n": d.repeat_last_n, "repeat_penalty": d.repeat_penalty,
        "presence_penalty": d.presence_penalty, "frequency_penalty": d.frequency_penalty,
        "dry_multiplier": d.dry_multiplier, "dry_base": d.dry_base, "dry_allowed_length": d.dry_allowed_length,
        "dry_penalty_last_n": d.dry_penalty_last_n, "dry_sequence_breakers": list(d.dry_sequence_breakers),
        "mirostat": d.mirostat, "mirostat_tau": d.mirostat_tau, "mirostat_eta": d.mirostat_eta,
        "max_tokens": -1, "n_predict": -1, "n_keep": 0, "n_discard": 0, "ignore_eos": False, "stream": True,
        "n_probs": 0, "min_keep": d.min_keep, "samplers": list(d.order), "reasoning_format": "auto",
        "speculative.n_max": spec.n_max if spec else 0, "speculative.n_min": spec.n_min if spec else 0,
        "speculative.p_min": spec.p_min if spec else 0.0, "timings_per_token": False,
        "post_sampling_probs": False, "backend_sampling": config.backend_sampling, "lora": [],
    }


def llama_slots(report: dict) -> list[dict]:
    """llama-server's ``/slots`` rows of an engine replica (``report``: its ``slots()``), each
    with its group and replica."""
    return [
        {
            "id": v["id"],
            "n_ctx": report["n_ctx_slot"],  # llama.cpp's web UI sizes its context by it
            "speculative": report["speculative"],
            "is_processing": v["state"] != "idle",
            "group": v["group"],
            "seq_id": v["seq_id"],
            "state": v["state"],
            "n_cached_tokens": v["n_cached"],
            "id_task": v["request_id"],
            "replica": report["replica"],
            # the group's prompt cache (observability/live.py): the same for each slot of a group
            "prompt_cache": report.get("prompt_cache", {}).get(v["group"]),
        }
        for v in report["slots"]
    ]


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pipeline-groups-serve")
    except PackageNotFoundError:
        return "0"


def _llama_cpp_version() -> str:
    import llama_cpp

    return str(getattr(llama_cpp, "__version__", "?"))



async def props(ing: Any, request: Request) -> Response:
    report = await ing.engine.props.remote()
    return JSONResponse(llama_props((await ing.client.maker()).tokenizer, report))


async def slots(ing: Any, request: Request) -> Response:
    """Every engine replica's slots (each names its replica)."""
    parts = await ing.each_replica(lambda engine, replica: engine.slots.remote(replica=replica))
    return JSONResponse([s for part in parts for s in llama_slots(part)])


class SlotFile(ApiModel):
    """The body of ``POST /slots/{id}?action=save|restore``."""

    filename: str | None = Field(default=None, max_length=255)


async def slot_action(ing: Any, request: Request) -> Response:
    """``?action=save|restore|erase``; ``?replica=`` (from /slots) picks the engine replica, needed
    when there are several."""
    try:
        slot_id = int(request.path_params["slot_id"])
    except ValueError:
        raise ApiError(400, "the slot id must be an integer", "slot_id") from None
    action, replica = request.query_params.get("action", ""), request.query_params.get("replica")
    if replica is None and len(ing.streams) > 1:
        raise ApiError(400, f"{len(ing.streams)} engine replicas: add ?replica=<id> (see /slots)", "replica")
    body = await ing.body_json(request)
    req, _ = read_request(SlotFile, body or {})
    return ing.answer_of(await ing.engine.slot_action.remote(slot_id, action, req.filename, replica=replica))


ROUTES = (("GET", ("/v1/models", "/models"), models), ("GET", ("/props",), props), ("GET", ("/slots",), slots),
          ("POST", ("/slots/{slot_id}",), slot_action))
