"""Images and audio in a request, as every API sends them, checked before anything decodes them.

Each API's parts come here as bytes (``from_data_url``: OpenAI's ``image_url`` and Responses'
``input_image`` data URLs; ``from_base64``: Anthropic's ``image`` blocks, OpenAI's
``input_audio``, llama-server's ``multimodal_data``). Before the bytes go anywhere:

- the request's media are counted (``MAX_MEDIA``) and their bytes bounded (``MAX_BYTES`` each,
  and in all), from the base64's length, before it is decoded;
- the format is the bytes' own (their magic), never the name a client gave it; a declared type
  that disagrees is a 400. Images: PNG, JPEG, GIF, BMP (what the engine's decoder reads).
  Audio: WAV, MP3, FLAC;
- an image's width and height are read from its header, and an image over ``MAX_PIXELS`` (a
  decompression bomb: a few KB that decode to gigabytes) is refused before any pixel is; a
  file without its format's end marker (cut short) is refused too.

Remote URLs are not fetched (the ingress reaches no address a client names). Every refusal is a
``ValueError``, which the routes answer as a 400 in the endpoint's own shape."""

from __future__ import annotations

import base64
import binascii
import re
import secrets
import struct

# Where a medium goes in a prompt: llama-server's marker in /completion's prompt (its /props
# says it), and for the chat APIs one of this process's own, which no client's text can hold.
MEDIA_MARKER = "<__media__>"
CHAT_MARKER = f"<__media_{secrets.token_hex(8)}__>"
MEDIA_PARTS = ("image_url", "input_audio")  # OpenAI chat's content parts that are media

MAX_MEDIA = 16  # per request
MAX_BYTES = 20 << 20  # per medium, decoded
MAX_TOTAL_BYTES = 48 << 20  # per request, decoded
MAX_PIXELS = 33_554_432  # 32 Mpx: 8192 x 4096
MAX_SIDE = 16_384

IMAGE_TYPES = ("png", "jpeg", "gif", "bmp")
AUDIO_TYPES = ("wav", "mp3", "flac")
_DATA_URL = re.compile(r"data:([\w.+-]+/[\w.+-]+)?((?:;[\w.+-]+=[\w.+-]+)*);base64,", re.ASCII)


class MediaBag:
    """The media of one request, in prompt order, with the request's bounds."""

    def __init__(self) -> None:
        self.items: list[bytes] = []
        self.n_bytes = 0

    def add(self, data: bytes, where: str) -> None:
        if len(self.items) >= MAX_MEDIA:
            raise ValueError(f"{where}: a request takes at most {MAX_MEDIA} images or audio clips")
        self.n_bytes += len(data)
        if self.n_bytes > MAX_TOTAL_BYTES:
            raise ValueError(f"{where}: a request's media take at most {MAX_TOTAL_BYTES >> 20} MiB in all")
        self.items.append(data)


def from_data_url(url: object, where: str, kind: str = "image") -> bytes:
    """The bytes of a ``data:<type>;base64,...`` URL, checked as a ``kind`` ("image" or "audio")."""
    if not isinstance(url, str):
        raise ValueError(f"{where}: the url must be a string")
    m = _DATA_URL.match(url[:256])
    if m is None:
        if url.startswith(("http://", "https://")):
            raise ValueError(f"{where}: remote image URLs are not fetched; send the image inline as a "
                             "data URL (data:image/png;base64,...)")
        raise ValueError(f"{where}: the url must be a base64 data URL (data:image/png;base64,...)")
    return from_base64(url[m.end():], where, kind, m.group(1))


def from_base64(b64: object, where: str, kind: str | None = "image", declared: str | None = None) -> bytes:
    """Decoded and checked: within the bounds, of a format the engine reads (of ``kind``,
    "image" or "audio"; None: either, by the bytes), the format ``declared`` (a MIME type or a
    short name, when given) being the bytes' own."""
    if not isinstance(b64, str):
        raise ValueError(f"{where}: the data must be a base64 string")
    if len(b64) > (MAX_BYTES * 4) // 3 + 4:
        raise ValueError(f"{where}: an image or audio clip takes at most {MAX_BYTES >> 20} MiB")
    try:
        data = base64.b64decode(b64, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{where}: the data is not valid base64") from None
    fmt = sniff(data)
    if fmt is None:
        raise ValueError(f"{where}: not an image or audio format this server reads (images: PNG, JPEG, GIF, "
                         "BMP; audio: WAV, MP3, FLAC)")
    if kind is not None and fmt not in (IMAGE_TYPES if kind == "image" else AUDIO_TYPES):
        raise ValueError(f"{where}: a {kind} part holds {fmt.upper()} data, which is not {kind}")
    if declared:
        name = declared.lower().split("/")[-1].replace("x-", "")
        name = {"jpg": "jpeg", "mpeg": "mp3", "wave": "wav", "vnd.wave": "wav"}.get(name, name)
        if name != fmt:
            raise ValueError(f"{where}: the data is {fmt.upper()}, not the declared {declared}")
    if fmt in IMAGE_TYPES:
        check_size(data, fmt, where)
    return data


def sniff(data: bytes) -> str | None:
    """The format of ``data`` from its first bytes."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "png"
    if data.startswith(b"\xff\xd8\xff"):
        return "jpeg"
    if data.startswith((b"GIF87a", b"GIF89a")):
        return "gif"
    if data.startswith(b"BM") and len(data) >= 26:
        return "bmp"
    if data.startswith(b"RIFF") and data[8:12] == b"WAVE":
        return "wav"
    if data.startswith(b"fLaC"):
        return "flac"
    if data.startswith(b"ID3") or (len(data) > 1 and data[0] == 0xFF and data[1] & 0xE0 == 0xE0):
        return "mp3"
    return None


def dimensions(data: bytes, fmt: str) -> tuple[int, int] | None:
    """An image's (width, height) from its header; None when the header does not say."""
    try:
        if fmt == "png":
            if data[12:16] != b"IHDR":
                return None
            return struct.unpack(">II", data[16:24])
        if fmt == "gif":
            return struct.unpack("<HH", data[6:10])
        if fmt == "bmp":
            w, h = struct.unpack("<ii", data[18:26])
            return abs(w), abs(h)
        if fmt == "jpeg":
            return _jpeg_dimensions(data)
    except struct.error:
        return None
    return None


def _jpeg_dimensions(data: bytes) -> tuple[int, int] | None:
    i = 2
    while i + 9 < len(data):
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:
            i += 2
            continue
        (length,) = struct.unpack(">H", data[i + 2 : i + 4])
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):  # a start of frame
            h, w = struct.unpack(">HH", data[i + 5 : i + 9])
            return w, h
        i += 2 + length
    return None


_ENDS = {"png": b"IEND\xaeB`\x82", "jpeg": b"\xff\xd9", "gif": b";"}


def check_size(data: bytes, fmt: str, where: str) -> None:
    """The image is whole (its format's end marker: a cut file is refused here, not half
    decoded) and within the pixel bounds by its header."""
    end = _ENDS.get(fmt)
    if end is not None and end not in data[-1024:]:
        raise ValueError(f"{where}: the {fmt.upper()} file is cut short (no end marker)")
    dims = dimensions(data, fmt)
    if dims is None:
        raise ValueError(f"{where}: the {fmt.upper()} header does not give the image's size (truncated or damaged)")
    w, h = dims
    if w <= 0 or h <= 0:
        raise ValueError(f"{where}: the image is {w}x{h}")
    if w > MAX_SIDE or h > MAX_SIDE or w * h > MAX_PIXELS:
        raise ValueError(f"{where}: the image is {w}x{h}; at most {MAX_PIXELS:,} pixels and {MAX_SIDE} a side")
