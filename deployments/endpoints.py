"""The generating endpoints, one entry each: the request model that reads the body, the id
prefix of its answers, the ingress method that shapes the answer (whole or streamed), and the
shape of its errors. Its routes are the ingress's methods that name it; the engine runs every
entry's request the same way (``protocol.engine_request``: a Responses or Messages request as
chat). A new endpoint is one entry here, its request model and its shaper."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from deployments.anthropic import MessagesRequest
from deployments.anthropic import error_body as anthropic_error
from deployments.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    InfillRequest,
    LlamaCompletionRequest,
    ResponsesRequest,
    error_body,
    error_type,
)


def openai_error(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    return error_body(message, error_type(status), status, param)


@dataclass(frozen=True)
class Endpoint:
    kind: str  # what the shapers call it: "chat" and "completion" are OpenAI's choice shapes
    request: type[BaseModel]
    id_prefix: str
    answer: str  # the Ingress method: (rid, pending, api_request, engine_request, Submitted) -> Response
    error: Callable[..., dict[str, Any]] = openai_error  # (status, message[, param]) -> the error body


CHAT = Endpoint("chat", ChatCompletionRequest, "chatcmpl-", "_openai_answer")
COMPLETION = Endpoint("completion", CompletionRequest, "cmpl-", "_openai_answer")
RESPONSES = Endpoint("responses", ResponsesRequest, "resp_", "_responses_answer")
LLAMA = Endpoint("llama", LlamaCompletionRequest, "cmpl-", "_llama_answer")
INFILL = Endpoint("infill", InfillRequest, "cmpl-", "_llama_answer")
MESSAGES = Endpoint("messages", MessagesRequest, "msg-", "_messages_answer",
                    error=lambda status, message, param=None: anthropic_error(status, message))

ENDPOINTS = (CHAT, COMPLETION, RESPONSES, LLAMA, INFILL, MESSAGES)
