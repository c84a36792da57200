"""Per-token cost of every sampler a request can name, alone and in llama-server's chains, on
the default model's 262,144-token vocabulary: what one request's chain costs its group's step.

    .venv/bin/python -m bench.samplers

Prints milliseconds per token (median of repetitions, after a warm-up) for each chain. A
chain that costs more than a few milliseconds at this vocabulary would stall every stream of
its group; the infill sampler alone is quadratic in the candidates, so the chain always cuts
them first (engine.sampling.INFILL_MAX_CANDIDATES)."""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from engine.models import GEMMA_MODEL, ensure_gemma_model
from engine.native.model import Model
from engine.params import SamplingParams
from engine.sampling import INFILL_MAX_CANDIDATES, SamplerChain, thread_candidates

CHAINS: list[tuple[str, dict]] = [
    ("greedy", {"temperature": 0.0}),
    ("default (top_k 40, top_p 0.95, min_p 0.05, temperature)", {}),
    ("penalties", {"samplers": ["penalties"], "repeat_penalty": 1.1, "repeat_last_n": 4096}),
    ("dry", {"samplers": ["dry"], "dry_multiplier": 0.8, "dry_penalty_last_n": 4096}),
    ("top_n_sigma", {"samplers": ["top_n_sigma"], "top_n_sigma": 1.0}),
    ("top_k 0 (off)", {"samplers": ["top_k"], "top_k": 0}),
    ("typ_p", {"samplers": ["typ_p"], "typical_p": 0.9}),
    ("top_p", {"samplers": ["top_p"], "top_p": 0.9}),
    ("min_p", {"samplers": ["min_p"], "min_p": 0.05}),
    ("xtc", {"samplers": ["xtc"], "xtc_probability": 0.5, "xtc_threshold": 0.1}),
    ("temperature (dynamic)", {"samplers": ["temperature"], "dynatemp_range": 0.5}),
    ("mirostat 2", {"mirostat": 2}),
    ("infill alone, greedy", {"samplers": ["infill"], "temperature": 0.0}),
    ("infill alone, sampled", {"samplers": ["infill"]}),
    ("infill after top_k 100000", {"samplers": ["top_k", "infill"], "top_k": 100_000}),
    ("llama.vscode's (top_k 40, top_p, infill)", {"samplers": ["top_k", "top_p", "infill"], "top_k": 40}),
    ("every sampler, llama-server's order + infill", {
        "samplers": ["penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature",
                     "infill"], "repeat_penalty": 1.1, "dry_multiplier": 0.8, "top_n_sigma": 1.0, "typical_p": 0.9,
        "xtc_probability": 0.5, "top_k": 0}),
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=20, help="tokens timed per chain")
    a = p.parse_args()
    ensure_gemma_model(GEMMA_MODEL)
    model = Model(str(GEMMA_MODEL), n_gpu_layers=0)
    rng = np.random.default_rng(0)
    history = rng.integers(0, model.n_vocab, 4096).tolist()
    print(f"vocabulary {model.n_vocab} tokens; infill candidates cut to {INFILL_MAX_CANDIDATES}")
    print(f"{'chain':<52} {'ms/token':>9}")
    for name, fields in CHAINS:
        chain = SamplerChain(SamplingParams(max_tokens=1, seed=1, **fields), model.n_vocab, vocab=model.vocab)
        chain.accept_prompt(history)
        times = []
        for i in range(a.tokens + 2):
            row = (rng.standard_normal(model.n_vocab) * 3).astype(np.float32)
            t0 = time.perf_counter()
            tok = chain.sample(row)
            chain.accept(tok)
            if i >= 2:
                times.append(time.perf_counter() - t0)
        chain.close()
        print(f"{name:<52} {1000 * statistics.median(times):9.2f}")
    print("llama.cpp's infill sampler without the cut, after a top-k of K (what a chain without one costs):")
    for k in (128, 512, 1024, 2048, 4096):
        ms = _raw_infill_ms(model, k, rng)
        print(f"{'  K = ' + str(k):<52} {ms:9.2f}")
    print(f"  quadratic: the whole vocabulary would take ~{ms * (model.n_vocab / 4096) ** 2 / 1000:.0f} s a token")
    model.close()


def _raw_infill_ms(model: Model, k: int, rng: np.random.Generator) -> float:
    import llama_cpp

    sp = llama_cpp.llama_sampler_chain_default_params()
    chain = llama_cpp.llama_sampler_chain_init(sp)
    for s in (llama_cpp.llama_sampler_init_top_k(k), llama_cpp.llama_sampler_init_infill(model.vocab),
              llama_cpp.llama_sampler_init_dist(1)):
        llama_cpp.llama_sampler_chain_add(chain, s)
    cand = thread_candidates(model.n_vocab)
    times = []
    for _ in range(3):
        ref = cand.fill((rng.standard_normal(model.n_vocab) * 3).astype(np.float32))
        t0 = time.perf_counter()
        llama_cpp.llama_sampler_apply(chain, ref)
        times.append(time.perf_counter() - t0)
    llama_cpp.llama_sampler_free(chain)
    return 1000 * statistics.median(times)


if __name__ == "__main__":
    main()
