"""Structured output: llguidance (what the engine uses) against llama.cpp's grammar sampler.

``python -m bench.grammar`` on the default model (Gemma 3 270M, 262,144 tokens):

1. per token along a valid JSON output of a schema: the full token mask of each engine (the
   path a rejected pick takes) and the one-token check (the path of an accepted pick);
2. a ``json_schema`` request through the engine (llguidance), tokens/s against the same
   request without a schema, sampled at temperature 1 (many picks rejected);
3. the hostile grammars of tests/hostile.py, each in a child process given to llama.cpp's
   parser and sampler, and to llguidance: what happened (refused, compiled, crashed, timed out)
   and how long it took.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import sys
import time

import numpy as np

from tests.real.test_structured import PERSON as SCHEMA  # strings, an integer, an array, an enum

# valid under both engines' property order (llama.cpp's converter puts the optional "likes"
# after the required keys; llguidance keeps the schema's order)
SAMPLE = '{"name":"Ada Lovelace","age":36,"kind":"human"}'


def per_token(model: str) -> dict[str, float]:
    import llama_cpp
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    from engine import Engine, EngineConfig
    from engine.sampling import Candidates
    from engine.text.grammar import GrammarSpec

    e = Engine(EngineConfig(model=model, n_ctx=1024, n_parallel=1, n_threads=1))
    try:
        tokens = e.tokenizer.encode(SAMPLE, add_special=False, parse_special=False)
        n_vocab = e.model.n_vocab
        row = np.random.default_rng(0).standard_normal(n_vocab).astype(np.float32)
        t0 = time.perf_counter()
        e.grammars.tokenizer()
        lltok_s = time.perf_counter() - t0
        spec = GrammarSpec.of_schema(SCHEMA)
        g = e.grammars.compile(spec)
        mask_ms, check_us = [], []
        for t in tokens:
            t0 = time.perf_counter()
            g.allows(t)
            check_us.append((time.perf_counter() - t0) * 1e6)
            t0 = time.perf_counter()
            allowed = g.refresh_mask()
            np.copyto(row.copy(), -np.inf, where=~allowed)
            mask_ms.append((time.perf_counter() - t0) * 1e3)
            g.accept(t)
        # llama.cpp's grammar sampler on the same tokens: the full pass over the vocabulary
        gbnf = json_schema_to_gbnf(json.dumps(SCHEMA))
        lg = llama_cpp.llama_sampler_init_grammar(e.model.vocab, gbnf.encode(), b"root")
        cand = Candidates(n_vocab)
        one = Candidates(1)
        cpp_ms, cpp_check_us = [], []
        for t in tokens:
            one.arr["id"][0], one.arr["logit"][0] = t, 1.0
            one.struct.size, one.struct.selected = 1, -1
            t0 = time.perf_counter()
            llama_cpp.llama_sampler_apply(lg, ctypes.byref(one.struct))
            cpp_check_us.append((time.perf_counter() - t0) * 1e6)
            if not np.isfinite(one.arr["logit"][0]):  # accepting it would abort the process
                raise RuntimeError(f"llama.cpp's grammar refuses token {t} of the sample")
            ref = cand.fill(row)
            t0 = time.perf_counter()
            llama_cpp.llama_sampler_apply(lg, ref)
            cpp_ms.append((time.perf_counter() - t0) * 1e3)
            llama_cpp.llama_sampler_accept(lg, t)
        llama_cpp.llama_sampler_free(lg)
        return {"tokens": len(tokens), "n_vocab": n_vocab, "llguidance_tokenizer_s": lltok_s,
                "llguidance_compile_ms": g.compile_s * 1e3,
                "llguidance_mask_ms": statistics.median(mask_ms), "llguidance_mask_ms_max": max(mask_ms),
                "llguidance_check_us": statistics.median(check_us),
                "llamacpp_mask_ms": statistics.median(cpp_ms), "llamacpp_mask_ms_max": max(cpp_ms),
                "llamacpp_check_us": statistics.median(cpp_check_us)}
    finally:
        e.close()


def end_to_end(model: str, n: int) -> dict[str, float]:
    from engine import Engine, EngineConfig, SamplingParams
    from engine.text.grammar import GrammarSpec

    e = Engine(EngineConfig(model=model, n_ctx=2048, n_parallel=1, n_threads=2))
    try:
        prompt = "A JSON object describing a person:"
        out = {}
        for name, grammar in (("plain", None), ("json_schema", GrammarSpec.of_schema(SCHEMA))):
            toks = secs = 0.0
            for seed in range(n):
                p = SamplingParams(temperature=1.0, seed=seed, max_tokens=64, grammar=grammar)
                e.generate(prompt, p)  # warm
                t0 = time.perf_counter()
                c = e.generate(prompt, p)
                secs += time.perf_counter() - t0
                toks += c.final.completion_tokens
            out[f"{name}_tok_s"] = toks / secs
        return out
    finally:
        e.close()


CHILD = r"""
import json, sys, time
which, model, kind, text = sys.argv[1], sys.argv[2], sys.argv[3], sys.stdin.read()
from engine.native.model import Model
from engine.native.library import init_backend
init_backend()
m = Model(model)
t0 = time.perf_counter()
if which == "llama.cpp":
    import llama_cpp
    from llama_cpp.llama_grammar import json_schema_to_gbnf
    gbnf = json_schema_to_gbnf(text) if kind == "json_schema" else text
    g = llama_cpp.llama_sampler_init_grammar(m.vocab, gbnf.encode(), b"root")
    if not g:
        print("refused", time.perf_counter() - t0); sys.exit(0)
    from engine.sampling import Candidates
    import numpy as np
    c = Candidates(m.n_vocab)
    llama_cpp.llama_sampler_apply(g, c.fill(np.zeros(m.n_vocab, np.float32)))
    a = c.arr["logit"]
    ok = np.flatnonzero(np.isfinite(a))
    llama_cpp.llama_sampler_accept(g, int(c.arr["id"][ok[0]]) if len(ok) else 0)
    print("compiled", time.perf_counter() - t0)
else:
    from engine.text.grammar import GrammarSpec
    from engine.text.matcher import GrammarCompiler
    from engine.text.tokenizer import Tokenizer
    from engine.errors import RequestError
    comp = GrammarCompiler(Tokenizer(m))
    comp.tokenizer()
    t0 = time.perf_counter()
    try:
        comp.compile(GrammarSpec(kind, text))
        print("compiled", time.perf_counter() - t0)
    except RequestError as e:
        print("refused", time.perf_counter() - t0, str(e)[:80])
"""


def hostile(model: str, timeout_s: float) -> list[dict]:
    from tests.hostile import CASES

    rows = []
    for name, _route, body in CASES:
        if "grammar" in body:
            kind, text = "gbnf", body["grammar"]
        elif "json_schema" in body:
            kind, text = "json_schema", json.dumps(body["json_schema"])
        elif "response_format" in body:
            kind, text = "json_schema", json.dumps(body["response_format"]["json_schema"]["schema"])
        elif "tools" in body:
            kind, text = "json_schema", json.dumps(body["tools"][0]["function"]["parameters"])
        else:
            continue
        row = {"case": name}
        for which in ("llama.cpp", "llguidance"):
            t0 = time.monotonic()
            try:
                p = subprocess.run([sys.executable, "-c", CHILD, which, model, kind], input=text, text=True,
                                   capture_output=True, timeout=timeout_s)
                took = time.monotonic() - t0
                if p.returncode < 0:
                    row[which] = f"crashed (signal {-p.returncode}) after {took:.1f} s"
                elif p.returncode:
                    last = (p.stderr.strip().splitlines() or ["?"])[-1]
                    row[which] = f"died (exit {p.returncode}: {last[:60]}) after {took:.1f} s"
                else:
                    word, secs = p.stdout.split()[:2]
                    row[which] = f"{word} in {float(secs) * 1e3:.0f} ms"
            except subprocess.TimeoutExpired:
                row[which] = f"no answer in {timeout_s:.0f} s (killed)"
        rows.append(row)
    return rows


def main() -> None:
    from engine.models import GEMMA_MODEL

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(GEMMA_MODEL))
    ap.add_argument("--requests", type=int, default=5)
    ap.add_argument("--timeout-s", type=float, default=60.0)
    a = ap.parse_args()
    from bench import cpu

    print(f"machine: {cpu.describe()}")
    pt = per_token(a.model)
    print(f"per token, {pt['tokens']} tokens of a valid output, {pt['n_vocab']} tokens in the vocabulary (medians):")
    print(f"  full mask: llguidance {pt['llguidance_mask_ms']:.2f} ms (max {pt['llguidance_mask_ms_max']:.2f}), "
          f"llama.cpp {pt['llamacpp_mask_ms']:.2f} ms (max {pt['llamacpp_mask_ms_max']:.2f})")
    print(f"  one-token check: llguidance {pt['llguidance_check_us']:.1f} us, llama.cpp {pt['llamacpp_check_us']:.1f} us")
    print(f"  llguidance: tokenizer built once in {pt['llguidance_tokenizer_s']:.2f} s, this schema compiled in "
          f"{pt['llguidance_compile_ms']:.1f} ms")
    ee = end_to_end(a.model, a.requests)
    print(f"engine, temperature 1, 64 tokens x {a.requests}: plain {ee['plain_tok_s']:.1f} tok/s, "
          f"json_schema {ee['json_schema_tok_s']:.1f} tok/s ({ee['json_schema_tok_s'] / ee['plain_tok_s']:.2f}x)")
    print("hostile grammars, each in a child process:")
    print("| case | llama.cpp's parser and sampler | this engine (limits, then llguidance) |\n|---|---|---|")
    for row in hostile(a.model, a.timeout_s):
        print(f"| {row['case']} | {row['llama.cpp']} | {row['llguidance']} |")


if __name__ == "__main__":
    main()
