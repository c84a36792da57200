"""Images the tests send, made here without an image library: whole PNGs (stdlib zlib), and the
hostile ones (headers that claim what the pixels are not, cut files, many frames)."""

from __future__ import annotations

import base64
import struct
import zlib

import numpy as np


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def png(w: int, h: int, seed: int = 0) -> bytes:
    """A whole RGB PNG of random pixels (``seed``)."""
    rgb = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    raw = b"".join(b"\x00" + rgb[y].tobytes() for y in range(h))
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + _chunk(b"IDAT", zlib.compress(raw)) + _chunk(b"IEND", b""))


def png_solid(w: int, h: int, rgb: tuple[int, int, int]) -> bytes:
    """A whole PNG of one colour (a few hundred bytes a megapixel), compressed row by row."""
    comp, row = zlib.compressobj(9), b"\x00" + bytes(rgb) * w
    raw = b"".join(comp.compress(row) for _ in range(h)) + comp.flush()
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + _chunk(b"IDAT", raw) + _chunk(b"IEND", b""))


def png_bomb(w: int, h: int) -> bytes:
    """A PNG whose header claims ``w`` x ``h`` with a few rows of zeros (a few KB that would
    decode to w * h * 3 bytes)."""
    raw = zlib.compress(b"\x00" * (w * 3 + 1) * 8, 9)
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + _chunk(b"IDAT", raw) + _chunk(b"IEND", b""))


def png_garbage(w: int = 16, h: int = 16) -> bytes:
    """A PNG whose header and end are right and whose pixel data is not a zlib stream."""
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + _chunk(b"IDAT", b"not zlib at all" * 4) + _chunk(b"IEND", b""))


def jpeg_cut(w: int = 64, h: int = 64) -> bytes:
    """The start of a JPEG (its frame header says ``w`` x ``h``) and nothing of its pixels."""
    sof = b"\xff\xc0" + struct.pack(">HBHHB", 17, 8, h, w, 3) + bytes([1, 0x11, 0, 2, 0x11, 0, 3, 0x11, 0])
    app0 = b"\xff\xe0" + struct.pack(">H", 16) + b"JFIF\x00\x01\x01\x00\x00\x01\x00\x01\x00\x00"
    return b"\xff\xd8" + app0 + sof + b"\xff\xda\x00\x0c\x03\x01\x00\x02\x11\x03\x11\x00\x3f\x00" + b"\x12\x34"


def gif_frames(n: int, w: int = 4, h: int = 4) -> bytes:
    """A GIF of ``n`` frames of one colour each."""
    head = b"GIF89a" + struct.pack("<HHBBB", w, h, 0x80, 0, 0) + b"\x00\x00\x00\xff\xff\xff"
    frame = (b"\x21\xf9\x04\x00\x01\x00\x00\x00" + b"\x2c" + struct.pack("<HHHHB", 0, 0, w, h, 0)
             + b"\x02\x02\x44\x01\x00")
    return head + frame * n + b"\x3b"


def webp() -> bytes:
    return b"RIFF\x1a\x00\x00\x00WEBPVP8L\x0d\x00\x00\x00\x2f\x00\x00\x00\x10\x07\x10\x11\x11\x88\x88\xfe\x07\x00"


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"
