"""A GGUF file's metadata and tensor table, read without loading its weights or llama.cpp.

`gguf.GGUFReader` builds numpy views of every field, each token of the vocabulary included: on
Gemma 3's 262,144 tokens that costs about 30 s of CPU on a slow core. The loader, the topology
and the page release need a few numbers and the tensors' offsets, so this module walks the
header once, keeps the scalars and small arrays, and of each large array its type and length.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass

# value types of the GGUF format (gguf.GGUFValueType)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_KEPT_ARRAY = 1024  # arrays up to this many elements (per-layer counts) are kept; longer ones by type and length
_ALIGNMENT = 32  # GGUF_DEFAULT_ALIGNMENT


@dataclass(frozen=True)
class LongArray:
    """An array field too long to keep (a vocabulary, its scores): its element type and length."""
    type: int
    count: int


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]
    type: int  # ggml type
    data_offset: int  # in the file
    n_bytes: int


@dataclass(frozen=True)
class GgufHeader:
    version: int
    fields: dict[str, object]
    tensors: list[TensorInfo]


class _Cursor:
    def __init__(self, buf: mmap.mmap) -> None:
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str) -> object:
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.unpack("<Q")
        s = self.buf[self.pos:self.pos + n]
        self.pos += n
        return s.decode("utf-8", "replace")

    def skip_strings(self, count: int) -> None:
        buf, pos, unpack = self.buf, self.pos, struct.unpack_from
        for _ in range(count):
            pos += 8 + unpack("<Q", buf, pos)[0]
        self.pos = pos

    def value(self, vtype: int) -> object:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.unpack("<I"), self.unpack("<Q")
            if count <= _KEPT_ARRAY:
                return [self.value(etype) for _ in range(count)]
            if etype == _STRING:
                self.skip_strings(count)
            elif etype in _SCALARS:
                self.pos += count * struct.calcsize(_SCALARS[etype])
            else:  # arrays of arrays: walked
                for _ in range(count):
                    self.value(etype)
            return LongArray(etype, count)
        if vtype not in _SCALARS:
            raise ValueError(f"unknown GGUF value type {vtype} at byte {self.pos}")
        return self.unpack(_SCALARS[vtype])


def read_header(path: str) -> GgufHeader:
    """The metadata and tensor table of the GGUF at ``path``."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        c = _Cursor(buf)
        if buf[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        c.pos = 4
        version = c.unpack("<I")
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not read here (big-endian or unknown)")
        n_tensors, n_kv = c.unpack("<Q"), c.unpack("<Q")
        fields: dict[str, object] = {}
        for _ in range(n_kv):
            key = c.string()
            fields[key] = c.value(c.unpack("<I"))
        infos = []
        for _ in range(n_tensors):
            name = c.string()
            dims = tuple(c.unpack("<Q") for _ in range(c.unpack("<I")))
            infos.append((name, dims, c.unpack("<I"), c.unpack("<Q")))
        align = int(fields.get("general.alignment", _ALIGNMENT))
        start = -(-c.pos // align) * align
    tensors = []
    for name, dims, ttype, offset in infos:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
        tensors.append(TensorInfo(name, dims, ttype, start + offset, math.prod(dims) // block * size))
    return GgufHeader(version, fields, tensors)


@dataclass(frozen=True)
class GgufShape:
    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    k_dim: int  # per head
    v_dim: int

    def kv_bytes(self, n_cells: int) -> int:
        """Bytes of an f16 KV cache of ``n_cells`` cells over every layer."""
        return self.n_layer * n_cells * self.n_head_kv * (self.k_dim + self.v_dim) * 2


def read_shape(path: str) -> GgufShape:
    fields = read_header(path).fields
    arch = str(fields["general.architecture"])

    def num(key: str, default: int = 0) -> int:
        v = fields.get(f"{arch}.{key}")
        if isinstance(v, list):  # per-layer counts (some architectures): the first layer's
            v = v[0] if v else None
        return default if v is None or isinstance(v, LongArray) else int(v)

    n_embd = num("embedding_length")
    n_head = num("attention.head_count", 1) or 1
    return GgufShape(arch, num("block_count"), n_embd, n_head, num("attention.head_count_kv", n_head) or n_head,
                     num("attention.key_length", n_embd // n_head), num("attention.value_length", n_embd // n_head))
