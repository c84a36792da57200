"""The API's OpenAPI document and its two viewers, for the ingress's ``/openapi.json``, ``/docs``
and ``/redoc``: FastAPI's schema of the routes, with every API module's body model in it (a
route reads its raw body itself, to answer bad JSON with its own 400, so FastAPI cannot see it)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse

REF = "#/components/schemas/{model}"


def body_doc(model: type) -> dict:
    """A route's request body, declared by its model's schema."""
    ref = {"$ref": REF.format(model=model.__name__)}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def install(app: FastAPI, models: list[type]) -> None:
    """``app.openapi()`` builds the document once, with ``models``' schemas in its components."""
    by_name = {m.__name__: m for m in models}

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            from fastapi.openapi.utils import get_openapi

            routes = [r for r in app.routes if getattr(r, "include_in_schema", True)]
            spec = get_openapi(title=app.title, version=app.version, routes=routes)
            comps = spec.setdefault("components", {}).setdefault("schemas", {})
            for name, model in by_name.items():
                schema = model.model_json_schema(ref_template=REF)
                comps.update(schema.pop("$defs", {}))
                comps[name] = schema
            app.openapi_schema = spec
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def swagger(app: FastAPI) -> HTMLResponse:
    return get_swagger_ui_html(openapi_url="/openapi.json", title=app.title)


def redoc(app: FastAPI) -> HTMLResponse:
    return get_redoc_html(openapi_url="/openapi.json", title=app.title)
