"""A GGUF file's shape, read from its metadata without loading its weights or llama.cpp."""

from __future__ import annotations

from dataclasses import dataclass


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
    from gguf import GGUFReader

    r = GGUFReader(path)
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()

    def num(key: str, default: int = 0) -> int:
        f = r.fields.get(f"{arch}.{key}")
        return default if f is None else int(f.parts[f.data[0]][0])

    n_embd = num("embedding_length")
    n_head = num("attention.head_count", 1) or 1
    return GgufShape(arch, num("block_count"), n_embd, n_head, num("attention.head_count_kv", n_head) or n_head,
                     num("attention.key_length", n_embd // n_head), num("attention.value_length", n_embd // n_head))
