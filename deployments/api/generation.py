"""The fields every generating request shares (OpenAI's completions and chat, llama-server's
``/completion`` and ``/infill``): sampling, stops, structured output, llama-server's own
controls, and llama-server's additions to every generating answer (timings, prompt progress).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, field_validator

from deployments.api.base import ApiModel
from engine.params import SAMPLER_NAMES, SAMPLER_ORDER, SamplingParams
from engine.text.grammar import JSON_OBJECT_SCHEMA, GrammarSpec, check_source


def sampling_field(name: str) -> Any:
    """An optional request field with the bounds and description of ``SamplingParams.<name>``."""
    f = SamplingParams.model_fields[name]
    bounds = {k: getattr(m, k) for m in f.metadata for k in ("ge", "gt", "le", "lt", "max_length")
              if getattr(m, k, None) is not None}
    return Field(default=None, description=f.description, **bounds)


# llama-server's seed for "random" (LLAMA_DEFAULT_SEED, what its /props writes when no seed is set)
RANDOM_SEED = 0xFFFFFFFF

# llama-server's one-letter sampler names (its `samplers` string)
SAMPLER_LETTERS = {"e": "penalties", "d": "dry", "s": "top_n_sigma", "k": "top_k", "y": "typ_p", "p": "top_p",
                   "m": "min_p", "x": "xtc", "t": "temperature", "i": "infill"}

SAMPLING_KEYS = (
    "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty", "repeat_penalty",
    "repeat_last_n", "min_keep", "typical_p", "top_n_sigma", "xtc_probability", "xtc_threshold", "dry_multiplier",
    "dry_base", "dry_allowed_length", "dry_penalty_last_n", "dry_sequence_breakers", "dynatemp_range",
    "dynatemp_exponent", "mirostat", "mirostat_tau", "mirostat_eta", "samplers", "speculative",
)


class GenerationRequest(ApiModel):
    """Fields shared by every generating request (unknown ones are ignored, see ``ApiModel``)."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=-1, le=1_000_000, description="Most tokens to generate; -1 "
                                   "(llama-server) or absent: until the slot's context is full.")
    n: int = Field(default=1, ge=1, le=16, description="Choices of one prompt, evaluated once; at most the slots of "
                   "one pipeline group (n_parallel / pipeline_groups).")
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    # the sampling fields: their bounds and meaning are SamplingParams' (one definition)
    temperature: float | None = sampling_field("temperature")
    top_p: float | None = sampling_field("top_p")
    top_k: int | None = sampling_field("top_k")
    min_p: float | None = sampling_field("min_p")
    seed: int | None = sampling_field("seed")
    presence_penalty: float | None = sampling_field("presence_penalty")
    frequency_penalty: float | None = sampling_field("frequency_penalty")
    repeat_penalty: float | None = sampling_field("repeat_penalty")
    repeat_last_n: int | None = sampling_field("repeat_last_n")
    min_keep: int | None = sampling_field("min_keep")
    typical_p: float | None = sampling_field("typical_p")
    top_n_sigma: float | None = sampling_field("top_n_sigma")
    xtc_probability: float | None = sampling_field("xtc_probability")
    xtc_threshold: float | None = sampling_field("xtc_threshold")
    dry_multiplier: float | None = sampling_field("dry_multiplier")
    dry_base: float | None = sampling_field("dry_base")
    dry_allowed_length: int | None = sampling_field("dry_allowed_length")
    dry_penalty_last_n: int | None = sampling_field("dry_penalty_last_n")
    dry_sequence_breakers: list[str] | None = sampling_field("dry_sequence_breakers")
    dynatemp_range: float | None = sampling_field("dynatemp_range")
    dynatemp_exponent: float | None = sampling_field("dynatemp_exponent")
    mirostat: int | None = sampling_field("mirostat")
    mirostat_tau: float | None = sampling_field("mirostat_tau")
    mirostat_eta: float | None = sampling_field("mirostat_eta")
    samplers: list[str] | None = sampling_field("samplers")
    speculative: bool | None = sampling_field("speculative")
    logit_bias: dict[str, float] | None = Field(
        default=None, max_length=1024, description="Token id -> bias in [-100, 100]: an object (OpenAI), or "
        "llama-server's list of [token id, bias] pairs where a bias of false bans the token.")
    ignore_eos: bool = False
    # structured output: OpenAI's response_format, llama-server's grammar and json_schema
    response_format: dict[str, Any] | None = None
    grammar: str | None = Field(default=None, description="GBNF the output must match (llama-server); empty: none.")
    json_schema: dict[str, Any] | None = Field(default=None, description="A JSON schema the output must match (llama-server).")
    n_predict: int | None = Field(default=None, ge=-1, le=1_000_000, description="llama-server's max_tokens; -1: no limit.")
    n_probs: int | None = Field(default=None, ge=0, le=20, description="llama-server's logprobs: this many alternatives per token.")
    id_slot: int = Field(default=-1, ge=-1, description="llama-server's slot pinning: run on this slot, waiting until "
                         "it is free; -1: the scheduler picks (longest cached prefix).")
    typ_p: float | None = Field(default=None, gt=0.0, le=1.0, description="llama-server's name of typical_p.")
    cache_prompt: bool = Field(default=True, description="Reuse the slot's cached prefix for this request (llama-server).")
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256, description="vLLM's: the prompt "
                                   "reuses cached KV only of requests with the same salt (a tenant's own; docs/security.md).")
    t_max_predict_ms: int | None = Field(
        default=None, ge=0, description="llama-server's time limit of the generation, from the first token: past it, "
        "the output ends (finish_reason length) at its next newline.")
    timings_per_token: bool | None = Field(default=None, description="llama-server's; the timings come with the last "
                                           "chunk of a stream and with every answer.")
    # accepted as llama-server's clients send them, with nothing to change here
    return_progress: bool | None = Field(default=None, description="llama-server's: stream prompt_progress "
                                         "{total, cache, processed, time_ms} after each chunk of the prompt.")
    reasoning_format: Literal["none", "auto", "deepseek", "deepseek-legacy"] | None = Field(
        default=None, description="llama-server's: auto (the default) or deepseek put a reasoning model's thinking in "
        "reasoning_content; none leaves the text whole.")
    thinking_budget_tokens: int | None = Field(
        default=None, ge=-1, description="0: no thinking (the template's enable_thinking false), as llama-server's "
        "reasoning budget; -1 or more: unrestricted (a positive budget is not enforced).")
    n_keep: int | None = Field(default=None, ge=-1, description="llama-server's context-shift keep (accepted; a "
                               "prompt longer than the slot is refused, never shifted).")
    response_fields: list[str] | None = Field(default=None, max_length=64, description="llama-server's: only these "
                                              "fields of /completion's and /infill's answer ('a/b' takes b out of a).")
    post_sampling_probs: bool | None = Field(default=None, description="llama-server's: with n_probs, the "
                                             "probabilities after the sampler chain (prob, top_probs).")
    # the rest of what llama-server writes in /props default_generation_settings.params (and in
    # its /slots), so that a client can send those settings back as they are
    backend_sampling: bool | None = Field(default=None, description="llama-server's per-request switch (accepted; "
                                          "the engine's backend_sampling decides).")
    n_discard: int | None = Field(default=None, ge=0, description="llama-server's context-shift discard (accepted; "
                                  "a prompt longer than the slot is refused, never shifted).")
    chat_format: int | str | None = Field(default=None, description="llama-server's output parser (accepted; this "
                                          "server reads tool calls and thinking by its own parser).")
    reasoning_in_content: bool | None = Field(default=None, description="llama-server's (accepted; it follows from "
                                              "reasoning_format).")
    thinking_forced_open: bool | None = Field(default=None, description="llama-server's (accepted; the thinking split "
                                              "follows from the template and the prompt).")
    speculative_n_max: int | None = Field(default=None, alias="speculative.n_max", description="llama-server's "
                                          "most tokens drafted: 0 drafts nothing for this request (as speculative "
                                          "false); more: the server's configured draft bounds apply.")
    speculative_n_min: int | None = Field(default=None, alias="speculative.n_min", description="llama-server's "
                                          "(accepted; the server's configured draft bounds apply).")
    speculative_p_min: float | None = Field(default=None, alias="speculative.p_min", description="llama-server's "
                                            "(accepted; the server's configured draft bounds apply).")
    speculative_type: str | None = Field(default=None, alias="speculative.type", max_length=64, description="llama-"
                                         "server's drafter: none drafts nothing for this request; another: the "
                                         "server's configured drafter applies.")
    speculative_ngram_size_n: int | None = Field(default=None, alias="speculative.ngram_size_n",
                                                 description="llama-server's (accepted; the configured drafter's).")
    speculative_ngram_size_m: int | None = Field(default=None, alias="speculative.ngram_size_m",
                                                 description="llama-server's (accepted; the configured drafter's).")
    speculative_ngram_m_hits: int | None = Field(default=None, alias="speculative.ngram_m_hits",
                                                 description="llama-server's (accepted; the configured drafter's).")
    lora: list[dict[str, Any]] | None = Field(default=None, max_length=64, description="llama-server's LoRA "
                                              "adapters [{id, scale}]: empty (none); this server loads none, so an "
                                              "adapter is a 400.")
    grammar_lazy: bool | None = Field(default=None, description="llama-server's grammar applied from a trigger on: "
                                      "false (a grammar from the start); true is a 400 (not supported).")
    grammar_triggers: list[Any] | None = Field(default=None, max_length=64, description="llama-server's lazy "
                                               "grammar's triggers: only with grammar_lazy, which is not supported.")
    preserved_tokens: list[str] | None = Field(default=None, max_length=256, description="llama-server's tokens "
                                               "a lazy grammar keeps whole (accepted; nothing to keep without one).")
    # accepted and ignored, as OpenAI's API defines them for what this server does not keep
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None

    @field_validator("samplers", mode="before")
    @classmethod
    def _sampler_letters(cls, v: object) -> object:
        """llama-server's letter string (``"edkypmxt"``) or names; letters and names it does not
        know are skipped, as llama-server skips them."""
        if isinstance(v, str):
            return [SAMPLER_LETTERS[c] for c in v if c in SAMPLER_LETTERS]
        if isinstance(v, list):
            return [x for x in v if not isinstance(x, str) or x in SAMPLER_NAMES]
        return v

    @field_validator("seed", mode="before")
    @classmethod
    def _random_seed(cls, v: object) -> object:
        """llama-server's random seed, as no seed: -1 (SillyTavern sends it) and 4294967295
        (LLAMA_DEFAULT_SEED, what llama-server's and this server's /props write)."""
        return None if v in (-1, RANDOM_SEED) and not isinstance(v, bool) else v

    @field_validator("n_probs", mode="before")
    @classmethod
    def _no_probs(cls, v: object) -> object:
        """llama-server's n_probs 0 (its /props default): no probabilities."""
        return None if v == 0 and not isinstance(v, bool) else v

    @field_validator("lora")
    @classmethod
    def _no_adapters(cls, v: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        if v:
            raise ValueError("no LoRA adapters are loaded on this server; send lora: [] or leave it out")
        return v

    @field_validator("grammar_lazy")
    @classmethod
    def _not_lazy(cls, v: bool | None) -> bool | None:
        if v:
            raise ValueError("lazy grammars (grammar_lazy: true) are not supported; send the grammar from the start")
        return v

    @field_validator("grammar", mode="before")
    @classmethod
    def _empty_grammar(cls, v: object) -> object:
        return None if v == "" else v

    @field_validator("dry_sequence_breakers", mode="before")
    @classmethod
    def _breakers_json(cls, v: object) -> object:
        """llama-server also takes the breakers as a JSON array in a string (SillyTavern's)."""
        if not isinstance(v, str):
            return v
        try:
            parsed = json.loads(v)
        except ValueError:
            raise ValueError("a string of dry_sequence_breakers must hold a JSON array of strings") from None
        if not isinstance(parsed, list):
            raise ValueError("a string of dry_sequence_breakers must hold a JSON array of strings")
        return parsed

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _bias_pairs(cls, v: object) -> object:
        """llama-server's list form: ``[[token, bias], ...]``, a bias of ``false`` banning the token;
        an empty list is no bias."""
        if not isinstance(v, list):
            return v
        out: dict[str, float] = {}
        for i, pair in enumerate(v):
            if not isinstance(pair, list) or len(pair) != 2 or not isinstance(pair[0], int) or isinstance(pair[0], bool):
                raise ValueError(f"logit_bias[{i}] must be a [token id, bias] pair (token text is not supported)")
            tok, bias = pair
            if bias is False:
                bias = -100.0
            if isinstance(bias, bool) or not isinstance(bias, int | float):
                raise ValueError(f"logit_bias[{i}]: the bias must be a number or false")
            out[str(tok)] = float(bias)
        return out or None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > 16:
            raise ValueError("at most 16 stop strings")
        return v

    def grammar_spec(self) -> GrammarSpec | None:
        """The one grammar the request asks for, from whichever field it used, checked against
        the limits every grammar meets (``engine.text.grammar``)."""
        asked = [k for k in ("grammar", "json_schema") if getattr(self, k) is not None]
        rf = self.response_format
        kind = rf.get("type") if rf else None
        if kind not in (None, "text"):
            asked.append("response_format")
        if len(asked) > 1:
            raise ValueError(f"set one of grammar, json_schema and response_format, not {' and '.join(asked)}")
        if self.grammar is not None:
            spec = GrammarSpec("gbnf", self.grammar)
            check_source(spec)
            return spec
        if self.json_schema is not None:
            return GrammarSpec.of_schema(self.json_schema)
        if kind in (None, "text"):
            return None
        if kind == "json_object":
            return GrammarSpec.of_schema(JSON_OBJECT_SCHEMA)
        if kind == "json_schema":
            spec = rf.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise ValueError("response_format.json_schema must be an object with a 'schema'")
            return GrammarSpec.of_schema(spec.get("schema", {}), "response_format.json_schema.schema")
        raise ValueError(f"response_format type {str(kind)[:40]!r} is not one of text, json_object, json_schema")

    def sampling(self, default_max_tokens: int, max_tokens: int | None = None) -> SamplingParams:
        limits = [v for v in (max_tokens, self.max_tokens) if v is not None]
        if 0 in limits:
            raise ValueError("max_tokens must be at least 1 (or -1: until the slot's context is full)")
        if self.n_predict is not None:
            limits.append(self.n_predict)  # llama-server's: 0 evaluates (and caches) the prompt only
        d: dict[str, Any] = {
            "max_tokens": next((v for v in limits if v >= 0), default_max_tokens),
            "stop": self.stop,
            "ignore_eos": self.ignore_eos,
            "grammar": self.grammar_spec(),
            "logprobs": self.n_logprobs(),
        }
        for k in SAMPLING_KEYS:
            v = getattr(self, k)
            if v is not None:
                d[k] = v
        if self.samplers is not None and tuple(SAMPLER_NAMES.get(x, x) for x in self.samplers) == SAMPLER_ORDER:
            del d["samplers"]  # the default chain named in full (llama-server's /props writes it): the default
        if self.speculative is None and (self.speculative_n_max == 0 or self.speculative_type == "none"):
            d["speculative"] = False  # llama-server's: no draft for this request
        if self.typ_p is not None and self.typical_p is None:
            d["typical_p"] = self.typ_p
        if self.t_max_predict_ms:
            d["t_max_predict_ms"] = self.t_max_predict_ms
        if self.return_progress and self.stream:
            d["return_progress"] = True
        if self.post_sampling_probs:
            d["post_sampling_probs"] = True
        if self.logit_bias:
            bias: dict[int, float] = {}
            for k, v in self.logit_bias.items():
                try:
                    bias[int(k)] = v
                except ValueError:
                    raise ValueError(f"logit_bias keys must be token ids, got {k[:40]!r}") from None
            d["logit_bias"] = bias
        return SamplingParams(**d)

    def n_logprobs(self) -> int | None:
        """How many alternatives each token's log probability comes with; None: not asked."""
        return self.n_probs

    def check(self) -> None:
        self.sampling(1)  # the sampling fields hold together (and a grammar compiles its limits)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


# ---- llama-server's additions to every generating answer ----------------------------------------


def prompt_progress(o: Any) -> dict[str, int]:
    processed, total, cached, ms = o.progress
    return {"total": total, "cache": cached, "processed": processed, "time_ms": ms}


def timings(o: Any) -> dict[str, Any]:
    """llama-server's ``timings`` of a request's final output (its web UI's statistics bar
    reads them): the prompt's evaluation from the slot's start to the first token, then the
    generation from the first token to the last."""
    prompt_n = o.prompt_tokens - o.cached_tokens
    prompt_ms = 1000.0 * max(o.t_first_token - o.t_queue, 0.0)
    gen_ms = 1000.0 * max(o.t_end - o.t_first_token, 0.0)
    n_gen = max(o.completion_tokens - 1, 0)  # the first token's time is the prompt's
    return {
        "cache_n": o.cached_tokens,
        "prompt_n": prompt_n,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
        "prompt_per_second": 1000.0 * prompt_n / prompt_ms if prompt_ms > 0 else 0.0,
        "predicted_n": o.completion_tokens,
        "predicted_ms": gen_ms,
        "predicted_per_token_ms": gen_ms / n_gen if n_gen else 0.0,
        "predicted_per_second": 1000.0 * n_gen / gen_ms if gen_ms > 0 and n_gen else 0.0,
    }
