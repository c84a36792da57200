"""Tiny GGUFs of the real architectures users split, written in seconds.

``write_family(path, arch)`` writes a model of one of ``FAMILIES``' architectures as the
vendored llama.cpp loads it (its own tensor names and shapes, ``src/models/<arch>.cpp``), with
deterministic random weights, the synthetic vocabulary plus the special tokens its family's chat
template and answers use (typed as the family's tokenizer types them: control tokens, or added
tokens that are text) and that family's real chat template (``tests/fixtures/templates``). What
each architecture carries that a llama does not is there:

- ``gpt-oss``: attention sinks, sliding-window attention on every other layer, biases, and its
  experts in MXFP4 (the format its checkpoints ship in), with the harmony template and tokens;
- ``qwen3moe``: QK-norm attention and a mixture of experts, with the Qwen3-Coder template;
- ``glm4moe``: a dense first layer, then experts with a shared expert and sigmoid routing with
  a selection bias, with the GLM-4.6 template and its ``[gMASK]<sop>`` preamble;
- ``qwen35``: Qwen3.5's hybrid, three Gated DeltaNet layers (a recurrent state) before each
  gated attention layer with M-RoPE sections, with the Qwen3.5 template;
- ``qwen35moe``: the same with routed and shared experts;
- ``qwen35`` and ``glm4moe`` with ``mtp``: their MTP block too, as their checkpoints carry it.

The logits are peaked (as the synthetic llama's) so that greedy decoding is stable against the
last-bit differences between batch shapes.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tests.models.synthetic import build_vocab, finish

TEMPLATES = Path(__file__).resolve().parents[1] / "fixtures" / "templates"

CONTROL, TEXT = "control", "text"


@dataclass(frozen=True)
class Family:
    arch: str
    template: str  # file in TEMPLATES
    control: tuple[str, ...]  # special tokens (never text in a prompt unless parsed as special)
    text: tuple[str, ...]  # added tokens that are text (Qwen's <think>, <tool_call>)
    eos: str
    tool_format: str  # the answer format the chat layer must pick from the template


_QWEN_TEXT = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

FAMILIES: dict[str, Family] = {
    "gpt-oss": Family(
        "gpt-oss", "openai-gpt-oss-120b.jinja",
        ("<|startoftext|>", "<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>",
         "<|constrain|>", "<|return|>", "<|call|>"),
        (), "<|return|>", "gpt-oss"),
    "qwen3moe": Family("qwen3moe", "Qwen3-Coder.jinja", ("<|endoftext|>",), _QWEN_TEXT, "<|im_end|>", "qwen3-coder"),
    "glm4moe": Family(
        "glm4moe", "GLM-4.6.jinja",
        ("[gMASK]", "<sop>", "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"),
        ("<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
         "</arg_value>", "<tool_response>", "</tool_response>"),
        "<|endoftext|>", "glm-4.5"),
    "qwen35": Family("qwen35", "Qwen3.5-4B.jinja", ("<|endoftext|>", "<|vision_start|>", "<|vision_end|>",
                                                    "<|image_pad|>", "<|video_pad|>"),
                     _QWEN_TEXT, "<|im_end|>", "qwen3-coder"),
}
FAMILIES["qwen35moe"] = Family("qwen35moe", *[getattr(FAMILIES["qwen35"], f) for f in
                                              ("template", "control", "text", "eos", "tool_format")])


@dataclass(frozen=True)
class FamilyShape:
    n_layer: int = 4
    n_embd: int = 256
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 64
    n_ff: int = 512  # dense layers
    n_expert: int = 4
    n_expert_used: int = 2
    n_ff_exp: int = 128  # each expert's
    n_vocab: int = 4096
    n_ctx_train: int = 4096
    n_swa: int = 128  # gpt-oss's window (every other layer)
    seed: int = 7


# the share of each head's dimensions rotated: GLM half, Qwen3.5 a quarter, the others all
ROTATED = {"glm4moe": 2, "qwen35": 4, "qwen35moe": 4}


# a layer's writes to the residual stream: scaled by ``trunk`` (``write_family``)
_RESIDUAL = ("attn_output.weight", "ssm_out.weight", "ffn_down.weight", "ffn_down_exps.weight",
             "ffn_down_shexp.weight")


class _Tensors:
    """Deterministic random tensors into a ``GGUFWriter``, shapes given as ggml's (ne0 first);
    the trunk's output projections scaled by ``trunk``."""

    def __init__(self, w: object, rng: np.random.Generator, trunk: float = 1.0) -> None:
        self.w, self.rng, self.trunk = w, rng, trunk

    def mat(self, name: str, *ne: int, scale: float | None = None, qtype: str = "f16") -> None:
        import gguf

        shape = tuple(reversed(ne))
        data = self.rng.standard_normal(shape, dtype=np.float32) * (scale if scale is not None else 1 / np.sqrt(ne[0]))
        if name.endswith(_RESIDUAL):
            data *= self.trunk
        if qtype == "mxfp4":
            t = gguf.GGMLQuantizationType.MXFP4
            self.w.add_tensor(name, gguf.quants.quantize(data, t), raw_dtype=t)
        elif qtype == "f32":
            self.w.add_tensor(name, data)
        else:
            self.w.add_tensor(name, data.astype(np.float16))

    def vec(self, name: str, n: int, value: float | None = None, scale: float = 0.1) -> None:
        v = np.full(n, value, np.float32) if value is not None else self.rng.standard_normal(n, dtype=np.float32) * scale
        self.w.add_tensor(name, v)

    def vecs(self, name: str, n: int, m: int, scale: float = 0.1) -> None:
        self.w.add_tensor(name, self.rng.standard_normal((m, n), dtype=np.float32) * scale)


def _attention(t: _Tensors, s: FamilyShape, i: int, *, q_gate: bool = False, qk_norm: bool = True,
               bias: bool = False) -> None:
    e, hd = s.n_embd, s.head_dim
    q, kv = s.n_head * hd, s.n_head_kv * hd
    t.mat(f"blk.{i}.attn_q.weight", e, q * (2 if q_gate else 1))
    t.mat(f"blk.{i}.attn_k.weight", e, kv)
    t.mat(f"blk.{i}.attn_v.weight", e, kv)
    t.mat(f"blk.{i}.attn_output.weight", q, e, scale=0.5 / np.sqrt(q))
    if qk_norm:
        t.vec(f"blk.{i}.attn_q_norm.weight", hd, 1.0)
        t.vec(f"blk.{i}.attn_k_norm.weight", hd, 1.0)
    if bias:
        for name, n in (("attn_q", q), ("attn_k", kv), ("attn_v", kv), ("attn_output", e)):
            t.vec(f"blk.{i}.{name}.bias", n)


def _dense_ffn(t: _Tensors, s: FamilyShape, i: int) -> None:
    t.mat(f"blk.{i}.ffn_gate.weight", s.n_embd, s.n_ff)
    t.mat(f"blk.{i}.ffn_up.weight", s.n_embd, s.n_ff)
    t.mat(f"blk.{i}.ffn_down.weight", s.n_ff, s.n_embd, scale=0.5 / np.sqrt(s.n_ff))


def _experts(t: _Tensors, s: FamilyShape, i: int, qtype: str = "f16", shared: int = 0) -> None:
    e, f, x = s.n_embd, s.n_ff_exp, s.n_expert
    t.mat(f"blk.{i}.ffn_gate_inp.weight", e, x, scale=1.0, qtype="f32")
    t.mat(f"blk.{i}.ffn_gate_exps.weight", e, f, x, qtype=qtype)
    t.mat(f"blk.{i}.ffn_up_exps.weight", e, f, x, qtype=qtype)
    t.mat(f"blk.{i}.ffn_down_exps.weight", f, e, x, scale=0.5 / np.sqrt(f), qtype=qtype)
    if shared:
        t.mat(f"blk.{i}.ffn_gate_shexp.weight", e, f * shared)
        t.mat(f"blk.{i}.ffn_up_shexp.weight", e, f * shared)
        t.mat(f"blk.{i}.ffn_down_shexp.weight", f * shared, e, scale=0.5 / np.sqrt(f * shared))


def _common_hparams(w: object, s: FamilyShape, arch: str, n_mtp: int = 0) -> None:
    w.add_context_length(s.n_ctx_train)
    w.add_embedding_length(s.n_embd)
    w.add_block_count(s.n_layer + n_mtp)  # llama.cpp's block count holds the MTP layers
    if n_mtp:
        w.add_nextn_predict_layers(n_mtp)
    w.add_feed_forward_length(s.n_ff)
    w.add_head_count(s.n_head)
    w.add_head_count_kv(s.n_head_kv)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_rope_dimension_count(s.head_dim // ROTATED.get(arch, 1))
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(s.n_vocab)


def _moe_hparams(w: object, s: FamilyShape) -> None:
    w.add_expert_count(s.n_expert)
    w.add_expert_used_count(s.n_expert_used)
    w.add_expert_feed_forward_length(s.n_ff_exp)


def _gpt_oss(w: object, t: _Tensors, s: FamilyShape) -> None:
    _moe_hparams(w, s)
    w.add_sliding_window(s.n_swa)
    for i in range(s.n_layer):
        t.vec(f"blk.{i}.attn_norm.weight", s.n_embd, 1.0)
        t.vec(f"blk.{i}.post_attention_norm.weight", s.n_embd, 1.0)
        _attention(t, s, i, qk_norm=False, bias=True)
        t.vec(f"blk.{i}.attn_sinks.weight", s.n_head, scale=1.0)
        _experts(t, s, i, qtype="mxfp4")
        t.vec(f"blk.{i}.ffn_gate_inp.bias", s.n_expert)
        t.vecs(f"blk.{i}.ffn_gate_exps.bias", s.n_ff_exp, s.n_expert)
        t.vecs(f"blk.{i}.ffn_up_exps.bias", s.n_ff_exp, s.n_expert)
        t.vecs(f"blk.{i}.ffn_down_exps.bias", s.n_embd, s.n_expert)


def _qwen3moe(w: object, t: _Tensors, s: FamilyShape) -> None:
    _moe_hparams(w, s)
    for i in range(s.n_layer):
        t.vec(f"blk.{i}.attn_norm.weight", s.n_embd, 1.0)
        _attention(t, s, i)
        t.vec(f"blk.{i}.ffn_norm.weight", s.n_embd, 1.0)
        _experts(t, s, i)


def _glm4moe(w: object, t: _Tensors, s: FamilyShape) -> None:
    import gguf

    _moe_hparams(w, s)
    w.add_expert_shared_count(1)
    w.add_leading_dense_block_count(1)
    w.add_expert_weights_scale(1.0)
    w.add_expert_weights_norm(True)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)  # as GLM-4.5's router
    for i in range(s.n_layer):
        _glm4moe_layer(t, s, i)


def _glm4moe_layer(t: _Tensors, s: FamilyShape, i: int) -> None:
    t.vec(f"blk.{i}.attn_norm.weight", s.n_embd, 1.0)
    _attention(t, s, i, bias=False)
    for name, n in (("attn_q", s.n_head * s.head_dim), ("attn_k", s.n_head_kv * s.head_dim),
                    ("attn_v", s.n_head_kv * s.head_dim)):
        t.vec(f"blk.{i}.{name}.bias", n)
    t.vec(f"blk.{i}.post_attention_norm.weight", s.n_embd, 1.0)
    if i == 0:
        _dense_ffn(t, s, i)
        return
    _experts(t, s, i, shared=1)
    t.vec(f"blk.{i}.exp_probs_b.bias", s.n_expert)


def _qwen35(w: object, t: _Tensors, s: FamilyShape, moe: bool = False) -> None:
    d_state, k_heads, v_heads, d_conv = 32, 2, 4, 4
    key_dim, value_dim = d_state * k_heads, d_state * v_heads
    # a quarter of each head rotated, in M-RoPE sections (text, height, width, unused) that sum
    # to half of it: Qwen3.5's 64 of 256 as [11, 11, 10, 0]
    w.add_rope_dimension_sections([3, 3, 2, 0] if s.head_dim == 64 else [s.head_dim // 8, 0, 0, 0])
    w.add_ssm_conv_kernel(d_conv)
    w.add_ssm_inner_size(value_dim)
    w.add_ssm_state_size(d_state)
    w.add_ssm_time_step_rank(v_heads)
    w.add_ssm_group_count(k_heads)
    w.add_full_attention_interval(4)
    if moe:
        _moe_hparams(w, s)
        w.add_expert_shared_feed_forward_length(s.n_ff_exp)
    for i in range(s.n_layer):
        t.vec(f"blk.{i}.attn_norm.weight", s.n_embd, 1.0)
        t.vec(f"blk.{i}.post_attention_norm.weight", s.n_embd, 1.0)
        if (i + 1) % 4 == 0:
            _attention(t, s, i, q_gate=True)
        else:
            t.mat(f"blk.{i}.attn_qkv.weight", s.n_embd, 2 * key_dim + value_dim)
            t.mat(f"blk.{i}.attn_gate.weight", s.n_embd, value_dim)
            t.mat(f"blk.{i}.ssm_conv1d.weight", d_conv, 2 * key_dim + value_dim, scale=0.5, qtype="f32")
            # a slow decay (about 0.99 a token), so the state remembers the prompt's words
            t.vec(f"blk.{i}.ssm_dt.bias", v_heads, -2.0)
            t.w.add_tensor(f"blk.{i}.ssm_a", -0.05 * np.exp(t.rng.standard_normal(v_heads, dtype=np.float32) * 0.1))
            t.mat(f"blk.{i}.ssm_beta.weight", s.n_embd, v_heads)
            t.mat(f"blk.{i}.ssm_alpha.weight", s.n_embd, v_heads)
            t.vec(f"blk.{i}.ssm_norm.weight", d_state, 1.0)
            t.mat(f"blk.{i}.ssm_out.weight", value_dim, s.n_embd, scale=0.5 / np.sqrt(value_dim))
        if not moe:
            _dense_ffn(t, s, i)
            continue
        _experts(t, s, i, shared=1)
        t.w.add_tensor(f"blk.{i}.ffn_gate_inp_shexp.weight", (t.rng.standard_normal(s.n_embd) / np.sqrt(s.n_embd)).astype(np.float16))


def _mtp(arch: str, t: _Tensors, s: FamilyShape) -> None:
    """The MTP block of Qwen3.5 or GLM-4.5 (``blk.{n_layer}``: a decoder layer as the family's
    full-attention ones, GLM's with experts, and its nextn projection of [norm(next token's
    embedding), norm(hidden state)]) as a bigram head: the
    projection keeps the embedding, so it drafts the token the model would give after the next
    one if the trunk added nothing (``trunk`` small: often), nudged by the hidden state it is
    paired with and by its layer's attention over its own KV (a draft depends on both being the
    right ones)."""
    m, e = s.n_layer, s.n_embd
    if arch == "glm4moe":
        _glm4moe_layer(t, s, m)
    else:
        t.vec(f"blk.{m}.attn_norm.weight", e, 1.0)
        t.vec(f"blk.{m}.post_attention_norm.weight", e, 1.0)
        _attention(t, s, m, q_gate=True)
        _dense_ffn(t, s, m)
    nudge = t.rng.standard_normal((e, e), dtype=np.float32) * (0.2 / np.sqrt(e))
    t.w.add_tensor(f"blk.{m}.nextn.eh_proj.weight", np.hstack([np.eye(e), nudge]).astype(np.float16))
    t.vec(f"blk.{m}.nextn.enorm.weight", e, 1.0)
    t.vec(f"blk.{m}.nextn.hnorm.weight", e, 1.0)


MTP_ARCHS = ("qwen35", "glm4moe")  # the families here whose checkpoints carry an MTP block

WRITERS: dict[str, Callable[..., None]] = {
    "gpt-oss": _gpt_oss, "qwen3moe": _qwen3moe, "glm4moe": _glm4moe, "qwen35": _qwen35,
    "qwen35moe": lambda w, t, s: _qwen35(w, t, s, moe=True),
}


def template(arch: str) -> str:
    return (TEMPLATES / FAMILIES[arch].template).read_text()


def write_tokenizer(w: object, fam: Family, n_vocab: int) -> None:
    from gguf import TokenType

    extra = [(t, TokenType.CONTROL) for t in fam.control] + [(t, TokenType.USER_DEFINED) for t in fam.text]
    write_vocab(w, n_vocab, extra, fam.eos, template(fam.arch))


def write_vocab(w: object, n_vocab: int, extra: list[tuple[str, int]], eos: str, chat_template: str,
                pad: str | None = None) -> None:
    """The synthetic vocabulary with ``extra`` (text, token type) tokens, as these families'
    tokenizers take it (no BOS, no space before a text), ``eos`` ending a turn, and the template."""
    tokens, scores, types = build_vocab(n_vocab, extra=extra)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(tokens.index(eos.encode()))
    if pad is not None:
        w.add_pad_token_id(tokens.index(pad.encode()))
    w.add_add_bos_token(False)  # these families' templates write their own preamble
    w.add_add_eos_token(False)
    w.add_add_space_prefix(False)  # as these families' BPE tokenizers: no space before a text
    w.add_chat_template(chat_template)


def write_family(path: str | os.PathLike[str], arch: str, shape: FamilyShape = FamilyShape(), *,
                 mtp: bool = False, trunk: float = 1.0) -> Path:
    """Write a tiny ``arch`` GGUF to ``path`` (atomically). ``mtp`` (``MTP_ARCHS``): with its
    MTP block, a bigram head (``_mtp``); ``trunk``: the scale of what the layers add to
    the residual stream (below 1, the model's next token is more often the bigram's)."""
    import gguf

    if mtp and arch not in MTP_ARCHS:
        raise ValueError(f"an MTP block is written for {', '.join(MTP_ARCHS)}, not {arch}")
    fam = FAMILIES[arch]
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    w = gguf.GGUFWriter(str(tmp), arch)
    w.add_name(f"synthetic-{arch}-{shape.n_layer}L-{shape.n_embd}d")
    _common_hparams(w, shape, arch, n_mtp=int(mtp))
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    write_tokenizer(w, fam, shape.n_vocab)
    t = _Tensors(w, np.random.default_rng(shape.seed), trunk)
    t.mat("token_embd.weight", shape.n_embd, shape.n_vocab, scale=1.0)
    WRITERS[arch](w, t, shape)
    t.vec("output_norm.weight", shape.n_embd, 1.0)
    t.mat("output.weight", shape.n_embd, shape.n_vocab, scale=16.0 / np.sqrt(shape.n_embd))
    if mtp:  # its own numbers (the trunk's are those of the model without it); its layer adds half
        _mtp(arch, _Tensors(w, np.random.default_rng(shape.seed + 1), 0.5), shape)
    return finish(w, tmp, out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("arch", choices=sorted(FAMILIES))
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    print(write_family(a.out, a.arch))


if __name__ == "__main__":
    main()
