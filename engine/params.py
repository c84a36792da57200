"""What a request may set for its sampling: the validated parameters, one definition of every
bound (the API's fields take theirs from here). No native import: the HTTP layer reads these."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from engine.text.grammar import MAX_GRAMMAR_BYTES, GrammarSpec

# llama-server's sampler names (and the aliases it accepts) -> the names the chain uses
SAMPLER_ORDER = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature")
MAX_STOP_CHARS = 256  # a stop string or DRY sequence breaker
# llama.cpp tokenises every DRY sequence breaker when the request's sampler is made, on its
# group's thread, at a cost that grows with the text and the vocabulary's special tokens
# (half a second per 256 characters on Gemma 3 on a 2-core box): the breakers are bounded in all
MAX_DRY_BREAKER_CHARS = 256

SAMPLER_NAMES = {**{s: s for s in SAMPLER_ORDER}, "typical_p": "typ_p", "temp": "temperature", "nucleus": "top_p",
                 "infill": "infill"}  # infill: llama.cpp's fill-in-the-middle sampler, only where asked


class SamplingParams(BaseModel):
    """What a request may set; out-of-range values are refused (HTTP 400)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_tokens: int = Field(default=256, ge=0, le=1_000_000, description="Most tokens to generate; 0: evaluate "
                            "(and cache) the prompt only, as llama-server's n_predict 0.")
    temperature: float = Field(default=0.8, ge=0.0, le=2.0)
    top_k: int = Field(default=40, ge=0)
    top_p: float = Field(default=0.95, gt=0.0, le=1.0)
    min_p: float = Field(default=0.05, ge=0.0, le=1.0)
    repeat_penalty: float = Field(default=1.0, gt=0.0, le=10.0)
    repeat_last_n: int = Field(default=64, ge=-1, description="Tokens the repetition penalties look back over; -1 "
                               "the slot's context (and never more than it).")
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    seed: int | None = Field(default=None, ge=0, le=2**32 - 2)
    stop: tuple[str, ...] = Field(default=(), max_length=16)  # each at most MAX_STOP_CHARS
    logit_bias: dict[int, float] = Field(default_factory=dict, max_length=1024)
    ignore_eos: bool = False
    # llama-server's further samplers; their defaults leave them out of the chain
    min_keep: int = Field(default=0, ge=0, le=1000, description="Least candidates top-p, min-p, typical-p and XTC keep.")
    typical_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Locally typical sampling; 1 is off.")
    top_n_sigma: float = Field(default=-1.0, ge=-1.0, le=100.0, description="Keep logits within n standard deviations of the top one; <= 0 is off.")
    xtc_probability: float = Field(default=0.0, ge=0.0, le=1.0, description="XTC: chance of excluding the top choices; 0 is off.")
    xtc_threshold: float = Field(default=0.1, ge=0.0, le=1.0, description="XTC: least probability of an excluded top choice.")
    dry_multiplier: float = Field(default=0.0, ge=0.0, le=100.0, description="DRY repetition penalty strength; 0 is off.")
    dry_base: float = Field(default=1.75, ge=1.0, le=10.0, description="DRY: base of the penalty's growth.")
    dry_allowed_length: int = Field(default=2, ge=0, le=10_000, description="DRY: repeats up to this long go unpenalised.")
    dry_penalty_last_n: int = Field(default=-1, ge=-1, description="DRY: tokens looked back over; -1 the slot's context (and never more than it).")
    dry_sequence_breakers: tuple[str, ...] = Field(default=("\n", ":", '"', "*"), max_length=64,
                                                   description="DRY: strings that end a repeated sequence.")
    dynatemp_range: float = Field(default=0.0, ge=0.0, le=2.0, description="Dynamic temperature: +- this range by entropy; 0 is off.")
    dynatemp_exponent: float = Field(default=1.0, ge=0.0, le=10.0, description="Dynamic temperature: the entropy exponent.")
    mirostat: int = Field(default=0, ge=0, le=2, description="Mirostat version (1 or 2); 0 is off. It replaces top-k/p and the others.")
    mirostat_tau: float = Field(default=5.0, gt=0.0, le=100.0, description="Mirostat: target surprise.")
    mirostat_eta: float = Field(default=0.1, gt=0.0, le=1.0, description="Mirostat: learning rate.")
    samplers: tuple[str, ...] | None = Field(
        default=None, max_length=16,
        description="Order of the samplers (llama-server's names: penalties, dry, top_n_sigma, top_k, typ_p, top_p, "
        "min_p, xtc, temperature); those left out are not used. Default: that order.",
    )
    grammar: GrammarSpec | None = Field(
        default=None, description="The grammar the output must match: GBNF (a string), or a GrammarSpec "
        "(GBNF, Lark or a JSON schema).")
    logprobs: int | None = Field(
        default=None, ge=0, le=20,
        description="Report each generated token's log probability and this many most likely alternatives.",
    )
    post_sampling_probs: bool = Field(default=False, description="With logprobs: the probabilities of the "
                                      "distribution the sampler chain drew from (llama-server's), not the model's.")
    return_progress: bool = Field(default=False, description="Send the prompt's progress after each of its "
                                  "chunks (llama-server's prompt_progress).")
    t_max_predict_ms: int = Field(
        default=0, ge=0, description="End the output (length) once the generation has run this long, counted "
        "from the first token, and holds a newline (llama-server's); 0: no limit.")
    speculative: bool = Field(
        default=True,
        description="Let the server draft and verify several tokens per step for this request when it is "
        "configured for speculative decoding; false: one token per step.",
    )

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, v: object) -> object:
        if v is None:
            return ()
        if isinstance(v, str):
            return (v,)
        return v

    @field_validator("grammar", mode="before")
    @classmethod
    def _grammar(cls, v: object) -> object:
        if isinstance(v, str):
            if len(v) > MAX_GRAMMAR_BYTES:
                raise ValueError(f"the grammar is longer than {MAX_GRAMMAR_BYTES} characters")
            return GrammarSpec("gbnf", v)
        return v

    @field_validator("stop", "dry_sequence_breakers")
    @classmethod
    def _short_strings(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if any(len(x) > MAX_STOP_CHARS for x in v):
            raise ValueError(f"each string may be at most {MAX_STOP_CHARS} characters")
        return v

    @field_validator("dry_sequence_breakers")
    @classmethod
    def _few_breakers(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if sum(len(x) for x in v) > MAX_DRY_BREAKER_CHARS:
            raise ValueError(f"dry_sequence_breakers may hold at most {MAX_DRY_BREAKER_CHARS} characters in all")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[int, float]) -> dict[int, float]:
        for tok, b in v.items():
            if not -100.0 <= b <= 100.0:
                raise ValueError(f"logit_bias for token {tok} must be within [-100, 100]")
            if tok < 0:
                raise ValueError(f"logit_bias token id {tok} is negative")
        return v

    @model_validator(mode="after")
    def _check(self) -> SamplingParams:
        if self.grammar and self.ignore_eos:
            raise ValueError("ignore_eos cannot be used with a grammar: a complete output ends with EOS")
        unknown = [s for s in self.samplers or () if s not in SAMPLER_NAMES]
        if unknown:
            raise ValueError(f"unknown samplers {unknown}; known: {', '.join(SAMPLER_ORDER)}")
        return self

    # ---- what the request's sampling needs: one place ---------------------------------------

    @property
    def order(self) -> tuple[str, ...]:
        return tuple(SAMPLER_NAMES[s] for s in self.samplers) if self.samplers is not None else SAMPLER_ORDER

    @property
    def dry(self) -> bool:
        return self.dry_multiplier > 0.0 and "dry" in self.order

    @property
    def host_only(self) -> bool:
        """Needs a sampler llama.cpp cannot run in the compute graph (or the raw logits)."""
        return bool(
            self.logit_bias or self.penalised or self.grammar or self.logprobs is not None or self.dry
            or self.typical_p < 1.0 or self.top_n_sigma > 0.0 or self.xtc_probability > 0.0
            or self.dynatemp_range > 0.0 or self.mirostat or self.samplers is not None
        )

    @property
    def penalised(self) -> bool:
        return self.repeat_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def is_plain_greedy(self) -> bool:
        return (self.temperature <= 0.0 and not self.logit_bias and not self.penalised and not self.grammar
                and not self.dry)
