"""Writes the synthetic GGUFs that the tests and the benchmark serve.

``write_model``: llama architecture, deterministic random weights from a seed, an SPM-style
vocabulary (special tokens, the 256 byte tokens, word pieces, filler pieces up to the
requested size) and a chat template. Every shape is a parameter. The text it generates is
gibberish; the output layer is scaled so that the logits are peaked, which keeps greedy
decoding stable against the last-bit differences between batch shapes.

With ``n_expert`` set, the feed-forward blocks are mixtures of experts (the llama
architecture's, as Mixtral's GGUFs): a model of several GB whose tokens each touch only
``n_expert_used`` experts, the shape of the big MoE models users serve on a pair, at a cost
per token these CPUs can run. ``ftype="q4_k"`` writes every matrix whose rows are whole
256-weight blocks as random Q4_K blocks (scaled to the same spread as the others), the rest as
Q8_0: gigabytes in seconds, no quantiser run.

``write_mtp_model``: a model with a multi-token-prediction (MTP, "nextn") layer, of the
``hy_v3`` architecture, the simplest one whose MTP graph the vendored llama.cpp implements
with dense layers and a plain KV cache. Its head either agrees with the model by
construction (``head="agree"``: the trunk's first layer does all the work, the others add
nothing, and the MTP block is a copy of that first layer fed the token's embedding, so it
predicts exactly what the model will; ``noise`` perturbs the copy, for a head that agrees
only in part) or is random (``head="random"``: its drafts are rejected, which exercises the
rollback).
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Common English pieces so that real text tokenizes into words, not bytes.
_WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at "
    "which but have an they you were her she there one all we their can has more will would "
    "been if no when what so out up into do time only new some could these two may first then "
    "any like other than now people my made over did down way each just very where after most "
    "hello world model token layer split stage group pipeline node fast serve request answer "
    "question machine learning python data value tell me about story once upon a time there lived "
    "king queen dog cat house tree water fire red blue green big small good bad day night"
).split()


@dataclass(frozen=True)
class ModelShape:
    n_layer: int = 4
    n_embd: int = 256
    n_head: int = 4
    n_head_kv: int = 2
    n_ff: int = 512
    n_vocab: int = 4096
    n_ctx_train: int = 4096
    ftype: str = "f16"  # "f16", "q8_0" or "q4_k"
    seed: int = 1234
    fim: bool = False  # fill-in-the-middle tokens (prefix, suffix, middle, repo, file separator)
    n_expert: int = 0  # > 0: every feed-forward block is a mixture of this many experts of n_ff
    n_expert_used: int = 0  # experts per token
    extra: tuple[str, ...] = ()  # more control tokens (a family's markup: one token each)
    space_prefix: bool = True  # a space before a text, as Llama 2's SPM (False: as BPE vocabularies)


FIM_TOKENS = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|repo_name|>", "<|file_sep|>")
FIM_KEYS = ("pre", "suf", "mid", "rep", "sep")  # tokenizer.ggml.fim_<key>_token_id, in FIM_TOKENS' order


def build_vocab(n_vocab: int, fim: bool = False, extra: Sequence[tuple[str, int]] = ()
                ) -> tuple[list[bytes], list[float], list[int]]:
    """The vocabulary: control tokens (the FIM ones too with ``fim``, ids 5 to 9; then
    ``extra``'s (text, token type) pairs), 256 byte tokens, word pieces, then fillers."""
    from gguf import TokenType

    tokens: list[bytes] = []
    scores: list[float] = []
    types: list[int] = []

    def add(piece: str | bytes, score: float, ttype: int) -> None:
        tokens.append(piece.encode() if isinstance(piece, str) else piece)
        scores.append(score)
        types.append(int(ttype))

    add("<unk>", 0.0, TokenType.UNKNOWN)
    add("<s>", 0.0, TokenType.CONTROL)
    add("</s>", 0.0, TokenType.CONTROL)
    add("<|im_start|>", 0.0, TokenType.CONTROL)
    add("<|im_end|>", 0.0, TokenType.CONTROL)
    for t in FIM_TOKENS if fim else ():
        add(t, 0.0, TokenType.CONTROL)
    for t, ttype in extra:
        if t.encode() not in tokens:
            add(t, 0.0, ttype)
    for b in range(256):
        add(f"<0x{b:02X}>", 0.0, TokenType.BYTE)
    seen = set()
    pieces: list[str] = []
    # SPM merges pairs of adjacent pieces, so every prefix of a word must be a piece too.
    for w in _WORDS:
        for word in ("\u2581" + w, w):
            for n in range(2, len(word) + 1):
                p = word[:n]
                if p not in seen:
                    seen.add(p)
                    pieces.append(p)
    for ch in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'\"-:;()\n":
        for p in (ch, "\u2581" + ch):
            if p not in seen and ch != "\n":
                seen.add(p)
                pieces.append(p)
    pieces.append("\u2581")
    for i, p in enumerate(pieces):
        add(p, -float(i + 1), TokenType.NORMAL)
    n_fill = n_vocab - len(tokens)
    if n_fill < 0:
        raise ValueError(f"n_vocab must be at least {len(tokens)}")
    for i in range(n_fill):
        add(f"\u2581tok{i}", -float(len(pieces) + i + 1), TokenType.NORMAL)
    return tokens, scores, types


def finish(w: object, tmp: Path, out: Path) -> Path:
    """Write the GGUF and put it in place in one rename (a reader never sees half a file)."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, out)
    log.info("wrote %s", out)
    return out


def write_tokenizer(w: object, shape: ModelShape) -> None:
    """The vocabulary, its special tokens and the chat template, into a ``GGUFWriter``."""
    from gguf import TokenType

    tokens, scores, types = build_vocab(shape.n_vocab, shape.fim, [(t, TokenType.CONTROL) for t in shape.extra])
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(4)  # <|im_end|> ends a chat turn
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    if not shape.space_prefix:
        w.add_add_space_prefix(False)
    if shape.fim:
        for key, text in zip(FIM_KEYS, FIM_TOKENS, strict=True):
            w.add_uint32(f"tokenizer.ggml.fim_{key}_token_id", tokens.index(text.encode()))
    w.add_chat_template(CHAT_TEMPLATE)


def write_model(path: str | os.PathLike[str], shape: ModelShape = ModelShape()) -> Path:
    """Write a llama-architecture GGUF with random weights to ``path`` (atomically)."""
    import gguf

    if shape.n_embd % shape.n_head or shape.n_head % shape.n_head_kv:
        raise ValueError("n_embd must divide by n_head and n_head by n_head_kv")
    if shape.ftype not in ("f16", "q8_0", "q4_k"):
        raise ValueError("ftype must be f16, q8_0 or q4_k")
    if shape.n_expert and not 0 < shape.n_expert_used <= shape.n_expert:
        raise ValueError("n_expert_used must be between 1 and n_expert")
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    rng = np.random.default_rng(shape.seed)
    head_dim = shape.n_embd // shape.n_head
    n_embd_kv = head_dim * shape.n_head_kv

    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_name(f"synthetic-llama-{shape.n_layer}L-{shape.n_embd}d-{shape.n_vocab}v")
    w.add_context_length(shape.n_ctx_train)
    w.add_embedding_length(shape.n_embd)
    w.add_block_count(shape.n_layer)
    w.add_feed_forward_length(shape.n_ff)
    w.add_head_count(shape.n_head)
    w.add_head_count_kv(shape.n_head_kv)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(shape.n_vocab)
    if shape.n_expert:
        w.add_expert_count(shape.n_expert)
        w.add_expert_used_count(shape.n_expert_used)
    w.add_file_type({"f16": gguf.LlamaFileType.MOSTLY_F16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
                     "q4_k": gguf.LlamaFileType.MOSTLY_Q4_K_M}[shape.ftype])

    write_tokenizer(w, shape)

    qtype = gguf.GGMLQuantizationType.F16 if shape.ftype == "f16" else gguf.GGMLQuantizationType.Q8_0

    def matrix(name: str, rows: int, cols: int, scale: float, n: int = 0) -> None:
        """A ``rows`` x ``cols`` matrix of N(0, scale) weights, or ``n`` of them (experts)."""
        if shape.ftype == "q4_k" and cols % 256 == 0:
            w.add_tensor(name, random_q4_k(rng, (n, rows, cols) if n else (rows, cols), scale),
                         raw_dtype=gguf.GGMLQuantizationType.Q4_K)
            return
        data = (rng.standard_normal((n, rows, cols) if n else (rows, cols), dtype=np.float32) * scale)
        if qtype == gguf.GGMLQuantizationType.Q8_0 and cols % 32 == 0:
            w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, data.astype(np.float16))

    def norm(name: str) -> None:
        w.add_tensor(name, np.ones(shape.n_embd, dtype=np.float32))

    e = shape.n_embd
    matrix("token_embd.weight", shape.n_vocab, e, 1.0)
    for i in range(shape.n_layer):
        norm(f"blk.{i}.attn_norm.weight")
        matrix(f"blk.{i}.attn_q.weight", e, e, 1.0 / np.sqrt(e))
        matrix(f"blk.{i}.attn_k.weight", n_embd_kv, e, 1.0 / np.sqrt(e))
        matrix(f"blk.{i}.attn_v.weight", n_embd_kv, e, 1.0 / np.sqrt(e))
        matrix(f"blk.{i}.attn_output.weight", e, e, 0.5 / np.sqrt(e))
        norm(f"blk.{i}.ffn_norm.weight")
        if shape.n_expert:
            x = shape.n_expert
            w.add_tensor(f"blk.{i}.ffn_gate_inp.weight", rng.standard_normal((x, e), dtype=np.float32))
            matrix(f"blk.{i}.ffn_gate_exps.weight", shape.n_ff, e, 1.0 / np.sqrt(e), n=x)
            matrix(f"blk.{i}.ffn_up_exps.weight", shape.n_ff, e, 1.0 / np.sqrt(e), n=x)
            matrix(f"blk.{i}.ffn_down_exps.weight", e, shape.n_ff, 0.5 / np.sqrt(shape.n_ff), n=x)
            continue
        matrix(f"blk.{i}.ffn_gate.weight", shape.n_ff, e, 1.0 / np.sqrt(e))
        matrix(f"blk.{i}.ffn_up.weight", shape.n_ff, e, 1.0 / np.sqrt(e))
        matrix(f"blk.{i}.ffn_down.weight", e, shape.n_ff, 0.5 / np.sqrt(shape.n_ff))
    norm("output_norm.weight")
    # Logits with a standard deviation of about 8: peaked, so argmax is stable.
    matrix("output.weight", shape.n_vocab, e, 8.0 / np.sqrt(e))

    return finish(w, tmp, out)


def write_hybrid_model(path: str | os.PathLike[str], shape: ModelShape = ModelShape(), attn_every: int = 4) -> Path:
    """A hybrid model of the ``lfm2`` architecture: every ``attn_every``-th layer attention, the
    others short-convolution layers with a recurrent state (llama.cpp's hybrid memory: a KV
    cache for the first, a state that cannot be cut at a position for the second), as Qwen3.5
    puts three Gated DeltaNet layers before each attention layer. f16 weights, the synthetic
    vocabulary and chat template, peaked logits."""
    import gguf

    if shape.n_embd % shape.n_head or shape.n_head % shape.n_head_kv:
        raise ValueError("n_embd must divide by n_head and n_head by n_head_kv")
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    rng = np.random.default_rng(shape.seed)
    e, head_dim = shape.n_embd, shape.n_embd // shape.n_head
    attn = [i % attn_every == attn_every - 1 for i in range(shape.n_layer)]
    l_cache = 3
    w = gguf.GGUFWriter(str(tmp), "lfm2")
    w.add_name(f"synthetic-lfm2-{shape.n_layer}L-{e}d-{shape.n_vocab}v")
    w.add_context_length(shape.n_ctx_train)
    w.add_embedding_length(e)
    w.add_block_count(shape.n_layer)
    w.add_feed_forward_length(shape.n_ff)
    w.add_head_count(shape.n_head)
    w.add_head_count_kv([shape.n_head_kv if a else 0 for a in attn])
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_shortconv_l_cache(l_cache)
    w.add_vocab_size(shape.n_vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    write_tokenizer(w, shape)

    def matrix(name: str, rows: int, cols: int, scale: float) -> None:
        w.add_tensor(name, (rng.standard_normal((rows, cols), dtype=np.float32) * scale).astype(np.float16))

    def ones(name: str, n: int) -> None:
        w.add_tensor(name, np.ones(n, dtype=np.float32))

    matrix("token_embd.weight", shape.n_vocab, e, 1.0)
    for i in range(shape.n_layer):
        ones(f"blk.{i}.attn_norm.weight", e)
        if attn[i]:
            kv = head_dim * shape.n_head_kv
            ones(f"blk.{i}.attn_q_norm.weight", head_dim)
            ones(f"blk.{i}.attn_k_norm.weight", head_dim)
            matrix(f"blk.{i}.attn_q.weight", e, e, 1.0 / np.sqrt(e))
            matrix(f"blk.{i}.attn_k.weight", kv, e, 1.0 / np.sqrt(e))
            matrix(f"blk.{i}.attn_v.weight", kv, e, 1.0 / np.sqrt(e))
            matrix(f"blk.{i}.attn_output.weight", e, e, 0.5 / np.sqrt(e))
        else:
            # the convolution's kernel stays f32 (ggml's ssm_conv takes no other type)
            w.add_tensor(f"blk.{i}.shortconv.conv.weight",
                         (rng.standard_normal((e, l_cache), dtype=np.float32) / np.sqrt(l_cache)).astype(np.float32))
            matrix(f"blk.{i}.shortconv.in_proj.weight", 3 * e, e, 1.0 / np.sqrt(e))
            matrix(f"blk.{i}.shortconv.out_proj.weight", e, e, 0.5 / np.sqrt(e))
        ones(f"blk.{i}.ffn_norm.weight", e)
        matrix(f"blk.{i}.ffn_gate.weight", shape.n_ff, e, 1.0 / np.sqrt(e))
        matrix(f"blk.{i}.ffn_up.weight", shape.n_ff, e, 1.0 / np.sqrt(e))
        matrix(f"blk.{i}.ffn_down.weight", e, shape.n_ff, 0.5 / np.sqrt(shape.n_ff))
    ones("token_embd_norm.weight", e)  # lfm2's name for the output norm
    matrix("output.weight", shape.n_vocab, e, 8.0 / np.sqrt(e))
    return finish(w, tmp, out)


def random_q4_k(rng: np.random.Generator, shape: tuple[int, ...], std: float) -> np.ndarray:
    """Q4_K blocks (256 weights in 144 bytes: fp16 d and dmin, twelve bytes of 6-bit scales and
    mins, 128 bytes of 4-bit quants) of random scales and quants, as the byte array GGUFWriter
    takes for ``shape`` (the last axis in whole blocks). A weight is d * scale * q - dmin * min:
    with uniform 6-bit scales and 4-bit quants, dmin = 7.5 d centres it and d = std / 254 gives
    it a standard deviation of ``std``."""
    *outer, cols = shape
    blocks = rng.integers(0, 256, size=(*outer, cols // 256, 144), dtype=np.uint8)
    d = np.float16(std / 254.0)
    blocks[..., 0:2] = np.frombuffer(d.tobytes(), np.uint8)
    blocks[..., 2:4] = np.frombuffer(np.float16(7.5 * float(d)).tobytes(), np.uint8)
    return blocks.reshape(*outer, cols // 256 * 144)


def write_mtp_model(path: str | os.PathLike[str], shape: ModelShape = ModelShape(), *, head: str = "agree",
                    noise: float = 0.0) -> Path:
    """Write an ``hy_v3`` GGUF of ``shape.n_layer`` trunk layers and one MTP layer (atomically)."""
    import gguf

    if head not in ("agree", "random"):
        raise ValueError("head must be agree or random")
    e, ff, hd = shape.n_embd, shape.n_ff, shape.n_embd // shape.n_head
    kv = hd * shape.n_head_kv
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    rng = np.random.default_rng(shape.seed)
    n_all = shape.n_layer + 1  # llama.cpp's block count holds the MTP layer

    w = gguf.GGUFWriter(str(tmp), "hy_v3")
    w.add_name(f"synthetic-hy_v3-mtp-{shape.n_layer}L-{e}d-{head}")
    w.add_context_length(shape.n_ctx_train)
    w.add_embedding_length(e)
    w.add_block_count(n_all)
    w.add_feed_forward_length(ff)
    w.add_expert_feed_forward_length(0)  # read by the architecture's loader, unused without experts
    w.add_head_count(shape.n_head)
    w.add_head_count_kv(shape.n_head_kv)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_nextn_predict_layers(1)
    w.add_vocab_size(shape.n_vocab)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    write_tokenizer(w, shape)

    def mat(rows: int, cols: int, scale: float) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * scale).astype(np.float32)

    def ones(n: int) -> np.ndarray:
        return np.ones(n, np.float32)

    def block(live: bool = True) -> dict[str, np.ndarray]:
        """A decoder layer's weights; a layer that is not ``live`` adds nothing to the residual."""
        return {
            "attn_norm": ones(e), "attn_q": mat(e, e, 1 / np.sqrt(e)), "attn_k": mat(kv, e, 1 / np.sqrt(e)),
            "attn_v": mat(kv, e, 1 / np.sqrt(e)), "attn_output": mat(e, e, 0.5 / np.sqrt(e)) * live,
            "attn_q_norm": ones(hd), "attn_k_norm": ones(hd), "ffn_norm": ones(e),
            "ffn_gate": mat(ff, e, 1 / np.sqrt(e)), "ffn_up": mat(ff, e, 1 / np.sqrt(e)),
            "ffn_down": mat(e, ff, 0.5 / np.sqrt(ff)) * live,
        }

    def put(i: int, weights: dict[str, np.ndarray]) -> None:
        for k, v in weights.items():
            w.add_tensor(f"blk.{i}.{k}.weight", v.astype(np.float32))

    # token embeddings of RMS 1: the MTP block's input norm leaves them as the trunk sees them
    emb = rng.standard_normal((shape.n_vocab, e))
    w.add_tensor("token_embd.weight", (emb / np.sqrt((emb**2).mean(1, keepdims=True))).astype(np.float32))
    w.add_tensor("output_norm.weight", ones(e))
    w.add_tensor("output.weight", mat(shape.n_vocab, e, 8.0 / np.sqrt(e)))
    first = block()
    put(0, first)
    for i in range(1, shape.n_layer):
        put(i, block(live=head != "agree"))
    if head == "agree":
        # the first layer again, fed the token's embedding alone ([I | 0]: the hidden state is unused)
        put(shape.n_layer, {k: v + noise * v.std() * rng.standard_normal(v.shape) if v.ndim == 2 else v
                            for k, v in first.items()})
        eh = np.zeros((e, 2 * e), np.float32)
        eh[:, :e] = np.eye(e)
    else:
        put(shape.n_layer, block())
        eh = mat(e, 2 * e, 1 / np.sqrt(2 * e))
    m = shape.n_layer
    w.add_tensor(f"blk.{m}.nextn.eh_proj.weight", eh)  # input: [norm(token embedding), norm(hidden state)]
    w.add_tensor(f"blk.{m}.nextn.enorm.weight", ones(e))
    w.add_tensor(f"blk.{m}.nextn.hnorm.weight", ones(e))
    return finish(w, tmp, out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="models/synthetic.gguf")
    p.add_argument("--if-absent", action="store_true", help="do nothing if the file exists")
    d = ModelShape()
    ints = ("n_layer", "n_embd", "n_head", "n_head_kv", "n_ff", "n_vocab", "n_ctx_train", "seed", "n_expert",
            "n_expert_used")
    for field in ints:
        p.add_argument("--" + field.replace("_", "-"), type=int, default=getattr(d, field))
    p.add_argument("--ftype", choices=["f16", "q8_0", "q4_k"], default=d.ftype)
    a = p.parse_args(argv)
    if a.if_absent and Path(a.out).exists():
        return
    shape = ModelShape(ftype=a.ftype, **{k: getattr(a, k) for k in ints})
    write_model(a.out, shape)
    print(a.out)


if __name__ == "__main__":
    main()
