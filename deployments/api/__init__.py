"""The HTTP APIs, one module each: OpenAI's (``openai``, ``responses``), llama-server's
(``llama``) and Anthropic's (``anthropic``), and what the server says of itself (``server_info``:
``/v1/models``, ``/props``, ``/slots``). A module holds its request models, how their
prompts are made (in the ingress, through ``deployments.prompts``), its answer shapers and its endpoint objects
(``ENDPOINTS``), plus routes of its own that are not a body and an answer (``ROUTES``). The
ingress serves every endpoint of every module; adding an API is adding a module here."""

from __future__ import annotations

from deployments.api import anthropic, llama, openai, responses, server_info

APIS = (openai, responses, llama, anthropic, server_info)
ENDPOINTS = tuple(ep for api in APIS for ep in api.ENDPOINTS)
ROUTES = tuple(r for api in APIS for r in api.ROUTES)
