"""Writes the synthetic multimodal projector (an "mmproj" GGUF, as llama-server's ``--mmproj``
takes) that pairs with the synthetic model: a llava-1.5 style projector (``mlp``), the
simplest type the vendored mtmd loads. A one-block vision transformer over ``patch`` x
``patch`` patches of an ``image_size`` square image, then the two-layer projector whose output
width is the text model's ``n_embd``.

One image is always ``(image_size // patch) ** 2`` embedding rows (16 with the defaults),
whatever its size: mtmd resizes it (aspect kept, padded) to the square first. No special
tokens: mtmd puts nothing of its own around the image, so the text model needs no vocabulary
for it. Plain positions (no M-RoPE) and causal attention, as the llama text model has.

The weights are random from ``seed``, scaled so that the rows have the spread of the text
model's token embeddings: an image changes what the model says, and two images say different
things, which the tests need."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tests.models.synthetic import finish


@dataclass(frozen=True)
class ProjectorShape:
    n_embd_text: int = 256  # the text model's n_embd: the projector's output width
    image_size: int = 32
    patch: int = 8
    width: int = 64  # the vision transformer's
    n_ff: int = 128  # its feed-forward (not equal to width: mtmd takes that for a legacy layout)
    n_hidden: int = 128  # the projector's hidden layer
    n_head: int = 4
    seed: int = 4321

    @property
    def n_image_tokens(self) -> int:
        return (self.image_size // self.patch) ** 2


def write_projector(path: str | os.PathLike[str], shape: ProjectorShape = ProjectorShape()) -> Path:
    """Write the projector GGUF to ``path`` (atomically)."""
    import gguf

    out = Path(path)
    tmp = out.with_suffix(".part")
    rng = np.random.default_rng(shape.seed)
    v, p = shape.width, shape.patch

    def mat(*dims: int, scale: float) -> np.ndarray:
        return (rng.standard_normal(dims) * scale).astype(np.float32)

    def ones(n: int) -> np.ndarray:
        return np.ones(n, np.float32)

    def zeros(n: int) -> np.ndarray:
        return np.zeros(n, np.float32)

    w = gguf.GGUFWriter(str(tmp), "clip")
    w.add_name(f"synthetic-mmproj-mlp-{shape.image_size}px-{shape.n_image_tokens}t-{shape.n_embd_text}d")
    w.add_bool("clip.has_vision_encoder", True)
    w.add_string("clip.projector_type", "mlp")
    w.add_uint32("clip.vision.image_size", shape.image_size)
    w.add_uint32("clip.vision.patch_size", p)
    w.add_uint32("clip.vision.embedding_length", v)
    w.add_uint32("clip.vision.feed_forward_length", shape.n_ff)
    w.add_uint32("clip.vision.block_count", 1)
    w.add_array("clip.vision.feature_layer", [1])  # the block runs (llava drops the last block otherwise)
    w.add_uint32("clip.vision.projection_dim", shape.n_embd_text)
    w.add_uint32("clip.vision.attention.head_count", shape.n_head)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-5)
    w.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    w.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    w.add_bool("clip.use_gelu", True)

    w.add_tensor("v.patch_embd.weight", mat(v, 3, p, p, scale=1.0 / np.sqrt(3 * p * p)).astype(np.float16))
    w.add_tensor("v.patch_embd.bias", zeros(v))
    w.add_tensor("v.position_embd.weight", mat(shape.n_image_tokens, v, scale=0.5))
    w.add_tensor("v.pre_ln.weight", ones(v))
    w.add_tensor("v.pre_ln.bias", zeros(v))
    for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
        w.add_tensor(f"v.blk.0.{name}.weight", mat(v, v, scale=1.0 / np.sqrt(v)))
        w.add_tensor(f"v.blk.0.{name}.bias", zeros(v))
    for name in ("ln1", "ln2"):
        w.add_tensor(f"v.blk.0.{name}.weight", ones(v))
        w.add_tensor(f"v.blk.0.{name}.bias", zeros(v))
    w.add_tensor("v.blk.0.ffn_up.weight", mat(shape.n_ff, v, scale=1.0 / np.sqrt(v)))
    w.add_tensor("v.blk.0.ffn_up.bias", zeros(shape.n_ff))
    w.add_tensor("v.blk.0.ffn_down.weight", mat(v, shape.n_ff, scale=1.0 / np.sqrt(shape.n_ff)))
    w.add_tensor("v.blk.0.ffn_down.bias", zeros(v))
    w.add_tensor("mm.0.weight", mat(shape.n_hidden, v, scale=2.0 / np.sqrt(v)))
    w.add_tensor("mm.0.bias", zeros(shape.n_hidden))
    w.add_tensor("mm.2.weight", mat(shape.n_embd_text, shape.n_hidden, scale=2.0 / np.sqrt(shape.n_hidden)))
    w.add_tensor("mm.2.bias", zeros(shape.n_embd_text))
    return finish(w, tmp, out)
