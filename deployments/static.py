"""The page's static files (deployments/web): served by their names, never by a path a request
makes, with the headers that keep a browser from sniffing, framing or referring them."""

from __future__ import annotations

from pathlib import Path

from fastapi.responses import Response

from deployments.api.base import ApiError

WEB = Path(__file__).with_name("web")
TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8"}
FILES = {p.name: p for p in WEB.iterdir() if p.suffix in TYPES} if WEB.is_dir() else {}


def static(name: str) -> Response:
    path = FILES.get(name)  # a name of the shipped files, never a path a request makes
    if path is None:
        raise ApiError(404, f"no file {name[:100]!r}")
    return Response(path.read_bytes(), media_type=TYPES[path.suffix],
                    headers={"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff",
                             "X-Frame-Options": "DENY", "Referrer-Policy": "no-referrer"})
