"""A chat message as the OpenAI API sends it, and as the chat template takes it: its text, with
a marker where each image or audio part goes, and those parts' bytes, checked
(deployments/api/media.py)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict

from deployments.api import media
from deployments.api.base import Bounded
from deployments.api.media import CHAT_MARKER, MEDIA_PARTS, MediaBag
from engine.text.tools import template_message


class ChatMessage(Bounded):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    def text(self) -> str:
        """The content as the template takes it: an image or audio part is ``CHAT_MARKER``."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for p in self.content:
            kind = p.get("type")
            if kind == "text" and isinstance(p.get("text"), str):
                parts.append(p["text"])
            elif kind in MEDIA_PARTS:
                parts.append(CHAT_MARKER)
            else:
                raise ValueError("content parts are text, image_url or input_audio")
        return "".join(parts)

    def add_media(self, bag: MediaBag, where: str) -> None:
        """This message's images and audio, in order, into ``bag`` (checked: deployments/api/media.py)."""
        if not isinstance(self.content, list):
            return
        for j, p in enumerate(self.content):
            at = f"{where}.content[{j}]"
            if p.get("type") == "image_url":
                img = p.get("image_url")
                bag.add(media.from_data_url(img.get("url") if isinstance(img, dict) else img, at + ".image_url"), at)
            elif p.get("type") == "input_audio":
                a = p.get("input_audio")
                if not isinstance(a, dict):
                    raise ValueError(f"{at}.input_audio must be {{data, format}}")
                bag.add(media.from_base64(a.get("data"), at + ".input_audio", "audio", a.get("format")), at)


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template takes them (with their tool calls and results)."""
    return [template_message({"role": m.role, "content": m.text(), "tool_calls": m.tool_calls,
                              "tool_call_id": m.tool_call_id, "name": m.name}) for m in messages]
