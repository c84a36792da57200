"""Writes a tiny Qwen-VL pair as the vendored llama.cpp loads it: the text model (a GGUF of
architecture ``qwen2vl``, Qwen2-VL's qwen2 with M-RoPE sections, or ``qwen3vl``, Qwen3-VL's
qwen3 with deepstack) and its projector (an "mmproj" GGUF of type ``qwen2vl_merger`` or
``qwen3vl_merger``), written in seconds.

The projector is Qwen-VL's vision tower, as ``tools/mtmd/models/qwen2vl.cpp`` (``qwen3vl.cpp``)
builds it: the patch embedding as two conv2d kernels (Qwen's two temporal frames; a still image
goes through both), ``v_layer`` ViT blocks with the 2D vision rope, then the merger: each 2x2
block of patches into one row of the text model's ``n_embd`` (Qwen3-VL: plus a learned position
embedding, a fused QKV, and one deepstack row per deepstack layer, concatenated, which the text
model adds to its first layers' hidden state).

How mtmd lays an image out for these projector types: ``<|vision_start|>`` (a text chunk), then
one image chunk of ``nx * ny`` rows, where the image is first resized (aspect kept) to whole
cells of 2 x 2 patches (28 pixels; Qwen3-VL's 32), between 8 and 4096 cells (``nx``, ``ny``: the
cells across and down, ``image_grid``; a 56 or 64 pixel square becomes 3 x 3 = 9 rows), then
``<|vision_end|>`` (the next text chunk). The rows take M-RoPE positions (time, row, column): the
chunk advances the position by ``max(nx, ny)``, not by its row count. mtmd puts no
``<|image_pad|>`` in the prompt (the template's is for transformers); llama-server's template
puts its media marker where the image was.

The text model's attention output is three times the families' (``families.py``): with few image
rows among the prompt's tokens, that is what makes two noise images say different things.

The weights are random from ``seed``; the rows have the spread of the token embeddings (the
merger's input is layer-normed, its output scaled to a unit standard deviation) and the logits
are peaked (as the other synthetic models'), so an image changes what the model says and two
images say different things. The vocabulary is the synthetic one plus Qwen2-VL's special tokens,
with Qwen2-VL-Instruct's chat template.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from tests.models.families import FamilyShape, _common_hparams, _dense_ffn, _Tensors, write_vocab
from tests.models.synthetic import finish

# Qwen2-VL-Instruct's (tokenizer_config.json). llama-server puts its media marker in a text part
# where the image was; mtmd then adds <|vision_start|> and <|vision_end|> itself.
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Qwen2-VL's special tokens beyond <|im_start|> and <|im_end|> (the synthetic vocabulary's, ids 3
# and 4); mtmd looks up the first two by text around every image.
CONTROL = ("<|endoftext|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>",
           "<|video_pad|>")
PROJECTOR_TYPES = {"qwen2vl": "qwen2vl_merger", "qwen3vl": "qwen3vl_merger"}


@dataclass(frozen=True)
class QwenVLShape:
    arch: str = "qwen2vl"  # or "qwen3vl"
    # the text model
    n_layer: int = 4
    n_embd: int = 256
    n_head: int = 4
    n_head_kv: int = 2
    n_ff: int = 512
    n_vocab: int = 4096
    n_ctx_train: int = 4096
    # M-RoPE (time, height, width, unused) pairs of each head's n_embd // n_head / 2 (Qwen2-VL's
    # [16, 24, 24, 0] of 64, halved; Qwen3-VL's [24, 20, 20, 0] of 64, halved)
    rope_sections: tuple[int, int, int, int] = (8, 12, 12, 0)
    # the vision tower
    image_size: int = 56  # clip.vision.image_size (Qwen3-VL: the position embedding's grid)
    patch: int = 14
    v_width: int = 64
    v_head: int = 4
    v_ff: int = 128  # not v_width: mtmd takes that for the legacy swapped up/down layout
    v_layer: int = 2
    v_hidden: int = 256  # the merger's hidden layer (4 * v_width, as Qwen's)
    deepstack: tuple[int, ...] = ()  # Qwen3-VL: the vision blocks with a deepstack merger
    seed: int = 2024

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def n_embd_mmproj(self) -> int:
        """The projector's row width: the text model's n_embd, once per deepstack layer more."""
        return self.n_embd * (1 + len(self.deepstack))

    def family(self) -> FamilyShape:
        return FamilyShape(n_layer=self.n_layer, n_embd=self.n_embd, n_head=self.n_head,
                           n_head_kv=self.n_head_kv, head_dim=self.head_dim, n_ff=self.n_ff,
                           n_vocab=self.n_vocab, n_ctx_train=self.n_ctx_train, seed=self.seed)


SHAPES = {
    "qwen2vl": QwenVLShape(),
    "qwen3vl": QwenVLShape(arch="qwen3vl", rope_sections=(12, 10, 10, 0), image_size=64, patch=16,
                           deepstack=(0,)),
}


def image_grid(width: int, height: int, shape: QwenVLShape = SHAPES["qwen2vl"]) -> tuple[int, int]:
    """The (nx, ny) cells mtmd makes of a ``width`` x ``height`` image (clip's resize rule)."""
    cell, lo, hi = shape.patch * 2, 8, 4096
    w, h = (max(cell, int(np.floor(x / cell + 0.5)) * cell) for x in (width, height))  # C's round
    if w * h > hi * cell * cell:
        beta = np.sqrt(width * height / (hi * cell * cell))
        w, h = max(cell, int(width / beta // cell) * cell), max(cell, int(height / beta // cell) * cell)
    elif w * h < lo * cell * cell:
        beta = np.sqrt(lo * cell * cell / (width * height))
        w, h = int(np.ceil(width * beta / cell)) * cell, int(np.ceil(height * beta / cell)) * cell
    return w // cell, h // cell


def _write_tokenizer(w: object, n_vocab: int) -> None:
    from gguf import TokenType

    write_vocab(w, n_vocab, [(t, TokenType.CONTROL) for t in CONTROL], "<|im_end|>", CHAT_TEMPLATE,
                pad="<|endoftext|>")


def _out(path: str | os.PathLike[str]) -> tuple[Path, Path]:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    return out, out.with_suffix(out.suffix + ".tmp")


def write_text_model(path: str | os.PathLike[str], shape: QwenVLShape = SHAPES["qwen2vl"]) -> Path:
    """Write the text model (``shape.arch``) to ``path`` (atomically)."""
    import gguf

    if shape.arch not in PROJECTOR_TYPES:
        raise ValueError(f"arch must be one of {sorted(PROJECTOR_TYPES)}")
    if 2 * sum(shape.rope_sections) != shape.head_dim:
        raise ValueError("the rope sections must sum to half of n_embd // n_head")
    qwen3 = shape.arch == "qwen3vl"
    s = shape.family()
    out, tmp = _out(path)
    w = gguf.GGUFWriter(str(tmp), shape.arch)
    w.add_name(f"synthetic-{shape.arch}-{s.n_layer}L-{s.n_embd}d")
    _common_hparams(w, s, shape.arch)
    w.add_rope_dimension_sections(list(shape.rope_sections))
    if qwen3:
        w.add_num_deepstack_layers(len(shape.deepstack))
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    _write_tokenizer(w, s.n_vocab)
    t = _Tensors(w, np.random.default_rng(shape.seed))
    kv = s.n_head_kv * s.head_dim
    t.mat("token_embd.weight", s.n_embd, s.n_vocab, scale=1.0)
    for i in range(s.n_layer):
        t.vec(f"blk.{i}.attn_norm.weight", s.n_embd, 1.0)
        for name, n in (("attn_q", s.n_embd), ("attn_k", kv), ("attn_v", kv)):
            t.mat(f"blk.{i}.{name}.weight", s.n_embd, n)
            if not qwen3:  # qwen2's q, k, v biases
                t.vec(f"blk.{i}.{name}.bias", n)
        # three times the families' attention output: the few image rows among the prompt's tokens
        # must steer the answer (at 0.5 two noise images can say the same 16 tokens)
        t.mat(f"blk.{i}.attn_output.weight", s.n_embd, s.n_embd, scale=1.5 / np.sqrt(s.n_embd))
        if qwen3:  # qwen3's QK norm
            t.vec(f"blk.{i}.attn_q_norm.weight", s.head_dim, 1.0)
            t.vec(f"blk.{i}.attn_k_norm.weight", s.head_dim, 1.0)
        t.vec(f"blk.{i}.ffn_norm.weight", s.n_embd, 1.0)
        _dense_ffn(t, s, i)
    t.vec("output_norm.weight", s.n_embd, 1.0)
    t.mat("output.weight", s.n_embd, s.n_vocab, scale=16.0 / np.sqrt(s.n_embd))
    return finish(w, tmp, out)


def write_mmproj(path: str | os.PathLike[str], shape: QwenVLShape = SHAPES["qwen2vl"]) -> Path:
    """Write the projector (``PROJECTOR_TYPES[shape.arch]``) to ``path`` (atomically)."""
    import gguf

    if shape.v_width % shape.v_head or (shape.v_width // shape.v_head) % 4:
        raise ValueError("v_width // v_head must be a multiple of 4 (the vision rope's four sections)")
    qwen3 = shape.arch == "qwen3vl"
    out, tmp = _out(path)
    v, p, ff, hid, e = shape.v_width, shape.patch, shape.v_ff, shape.v_hidden, shape.n_embd
    w = gguf.GGUFWriter(str(tmp), "clip")
    w.add_name(f"synthetic-mmproj-{PROJECTOR_TYPES[shape.arch]}-{shape.v_layer}L-{v}d-{e}d")
    w.add_bool("clip.has_vision_encoder", True)
    w.add_string("clip.projector_type", PROJECTOR_TYPES[shape.arch])
    w.add_uint32("clip.vision.image_size", shape.image_size)
    w.add_uint32("clip.vision.patch_size", p)
    w.add_uint32("clip.vision.embedding_length", v)
    w.add_uint32("clip.vision.feed_forward_length", ff)
    w.add_uint32("clip.vision.block_count", shape.v_layer)
    w.add_uint32("clip.vision.projection_dim", e)
    w.add_uint32("clip.vision.attention.head_count", shape.v_head)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    w.add_uint32("clip.vision.spatial_merge_size", 2)
    w.add_array("clip.vision.image_mean", [0.48145466, 0.4578275, 0.40821073])  # Qwen's (OpenAI CLIP's)
    w.add_array("clip.vision.image_std", [0.26862954, 0.26130258, 0.27577711])
    if qwen3:
        w.add_bool("clip.use_gelu", True)  # Qwen3-VL's gelu (Qwen2-VL's quick gelu is mtmd's default)
        w.add_array("clip.vision.is_deepstack_layers", [i in shape.deepstack for i in range(shape.v_layer)])
    t = _Tensors(w, np.random.default_rng(shape.seed + 1))
    for name in ("v.patch_embd.weight", "v.patch_embd.weight.1"):  # conv2d [p, p, 3, v], both frames
        t.mat(name, p, p, 3, v, scale=1.0 / np.sqrt(2 * 3 * p * p))
    if qwen3:
        t.vec("v.patch_embd.bias", v)
        t.mat("v.position_embd.weight", v, (shape.image_size // p) ** 2, scale=0.5, qtype="f32")

    def norm(name: str, n: int) -> None:
        t.vec(f"{name}.weight", n, 1.0)
        t.vec(f"{name}.bias", n, 0.0)

    def linear(name: str, n_in: int, n_out: int, scale: float) -> None:
        t.mat(f"{name}.weight", n_in, n_out, scale=scale / np.sqrt(n_in))
        t.vec(f"{name}.bias", n_out)

    for i in range(shape.v_layer):
        b = f"v.blk.{i}"
        norm(f"{b}.ln1", v)
        if qwen3:
            linear(f"{b}.attn_qkv", v, 3 * v, 1.0)
        else:
            for name in ("attn_q", "attn_k", "attn_v"):
                linear(f"{b}.{name}", v, v, 1.0)
        linear(f"{b}.attn_out", v, v, 0.5)
        norm(f"{b}.ln2", v)
        linear(f"{b}.ffn_up", v, ff, 1.0)
        linear(f"{b}.ffn_down", ff, v, 0.5)
        if i in shape.deepstack:
            d = f"v.deepstack.{i}"
            norm(f"{d}.norm", 4 * v)
            linear(f"{d}.fc1", 4 * v, hid, 1.0)
            linear(f"{d}.fc2", hid, e, 1.0 / np.sqrt(0.425))
    norm("v.post_ln", v)  # Qwen's merger ln_q
    linear("mm.0", 4 * v, hid, 1.0)
    linear("mm.2", hid, e, 1.0 / np.sqrt(0.425))  # E[gelu(x)^2] is about 0.425 for a standard normal x
    return finish(w, tmp, out)


def write_qwen_vl(dest: str | os.PathLike[str] | tuple[str | os.PathLike[str], str | os.PathLike[str]],
                  arch: str = "qwen2vl", shape: QwenVLShape | None = None) -> tuple[Path, Path]:
    """Write the pair: into the directory ``dest`` (``<arch>.gguf`` and ``<arch>-mmproj.gguf``), or to
    the two paths ``dest`` gives (model, projector). Returns (model path, projector path)."""
    shape = shape or SHAPES[arch]
    if shape.arch != arch:
        shape = replace(shape, arch=arch)
    if isinstance(dest, tuple):
        model, mmproj = Path(dest[0]), Path(dest[1])
    else:
        model, mmproj = Path(dest) / f"{arch}.gguf", Path(dest) / f"{arch}-mmproj.gguf"
    return write_text_model(model, shape), write_mmproj(mmproj, shape)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("arch", choices=sorted(SHAPES))
    p.add_argument("--out", required=True, help="the directory to write <arch>.gguf and <arch>-mmproj.gguf into")
    a = p.parse_args(argv)
    for path in write_qwen_vl(a.out, a.arch):
        print(path)


if __name__ == "__main__":
    main()
