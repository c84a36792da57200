"""A stand-in for a Serve deployment handle in unit tests: ``handle.method.remote(...)`` calls
the subclass's ``_method``, and ``options(...)`` returns the handle itself."""

from __future__ import annotations

from typing import Any


class FakeHandle:
    def options(self, **_: Any) -> Any:
        return self

    def __getattr__(self, name: str) -> Any:
        handler = getattr(self, "_" + name)

        class Method:
            remote = staticmethod(handler)

        return Method

    async def _info(self, **_: Any) -> dict:
        return {"healthy": True}
