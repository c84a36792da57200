"""The engine's configuration: one validated pydantic model, refused at start when wrong."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class SpeculativeConfig(BaseModel):
    """``speculative:`` of the engine's configuration."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["ngram", "draft", "mtp"] = Field(
        description="ngram: draft from the request's own prompt and output (no model); draft: a small "
        "draft model with the target's vocabulary [--spec-type / --model-draft]; mtp: the model's own "
        "multi-token-prediction layers, one MTP context per group [--spec-type draft-mtp]."
    )
    model: str | None = Field(default=None, description="GGUF of the draft model (type draft) [-md].")
    n_max: int = Field(default=8, ge=1, le=64, description="Most tokens drafted per row and step [--draft-max].")
    n_min: int = Field(default=1, ge=1, le=64, description="Shorter drafts are not verified [--draft-min].")
    p_min: float = Field(
        default=0.75, ge=0.0, le=1.0,
        description="type draft and mtp: a row stops drafting when the drafter's probability of its pick "
        "is below this [--draft-p-min].",
    )
    ngram_min: int = Field(default=2, ge=1, le=16, description="type ngram: the shortest suffix looked up.")
    ngram_max: int = Field(default=4, ge=1, le=16, description="type ngram: the longest suffix looked up.")
    max_rows: int = Field(
        default=4, ge=0,
        description="Draft only in steps where the group has at most this many generating rows; above "
        "it a step's batch already keeps the stages busy and verification costs more than it saves "
        "(make bench-spec measures it). 0: never.",
    )
    draft_threads: int = Field(default=0, ge=0, description="type draft: threads of the draft context; 0: the local threads.")
    backoff: bool = Field(
        default=True,
        description="A row whose drafts were all rejected waits 1, 2, 4 ... up to 32 steps before drafting "
        "again (fewer rows verified in vain); false: every row drafts at every step, as llama-server does.",
    )

    @model_validator(mode="after")
    def _check(self) -> SpeculativeConfig:
        if self.type == "draft" and not self.model:
            raise ValueError("speculative type 'draft' needs model: the draft GGUF")
        if self.type in ("ngram", "mtp") and self.model:
            raise ValueError(f"speculative type '{self.type}' takes no model (did you mean type: draft?)")
        if self.n_min > self.n_max:
            raise ValueError(f"speculative n_min ({self.n_min}) exceeds n_max ({self.n_max})")
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"speculative ngram_min ({self.ngram_min}) exceeds ngram_max ({self.ngram_max})")
        return self


class EngineConfig(BaseModel):
    """Everything the engine needs to load a model and run its slots."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(description="Path of the GGUF model file [-m].")
    model_alias: str | None = Field(
        default=None, description="Name the API reports and accepts for the model [--alias]."
    )
    n_ctx: int = Field(
        default=4096, ge=16, description="Total context over all slots; each slot gets n_ctx / n_parallel [-c]."
    )
    n_parallel: int = Field(default=8, ge=1, le=1024, description="Number of slots [--parallel].")
    pipeline_groups: int = Field(
        default=1,
        ge=1,
        description="Number of llama_contexts the slots are partitioned over, each with its own "
        "batch, sampling and decode thread [--pipeline-groups].",
    )
    n_batch: int = Field(default=512, ge=1, description="Most tokens one decode step carries [-b].")
    n_ubatch: int = Field(default=512, ge=1, description="Physical micro-batch size [-ub].")
    prefill_gap_factor: float | None = Field(
        default=3.0, ge=1.0, le=100.0,
        description="Chunked prefill: while the streams decoding outnumber the prompts waiting (all groups), "
        "a step's long prompts get the largest chunk whose step lasts at most this many times a step of "
        "the same rows without it (a cost model learnt from the steps, by chunk size), so the other "
        "streams' token gaps grow by at most this factor, unless prefill_min_rate needs more. Higher: "
        "the long prompt's first token sooner, the others' gaps longer. None: prompts fill the batch up "
        "to n_batch, as llama-server does.",
    )
    prefill_min_rate: float = Field(
        default=0.7, ge=0.0, le=1.0,
        description="Chunked prefill: the least share of the rate a whole batch would give it (its idle "
        "rate, on an idle server) at which a long prompt progresses beside decoding streams; where "
        "prefill_gap_factor's chunk is slower, the chunk grows to this rate, but the others' gaps grow "
        "past that factor at most to 1 / (1 - this) times. Higher: the long prompt's first token "
        "nearer its idle time, the others' gaps longer. 0: the gap bound alone.",
    )
    prefill_chunk_min: int = Field(
        default=8, ge=1, description="Chunked prefill: the fewest prompt tokens a step carries, so a prompt always progresses."
    )
    prefill_long_tokens: int = Field(
        default=256, ge=0,
        description="Chunked prefill applies to prompts with more tokens than this to evaluate; shorter "
        "ones are evaluated whole, as llama-server does, so their time to the first token is unchanged.",
    )
    prefill_aging_steps: int = Field(
        default=8, ge=0,
        description="Short before long: a step's prompt tokens go first to the prompts with the fewest "
        "tokens left to evaluate (in the order the slots became busy among equals); a prompt held back "
        "(given fewer tokens than it would take first) this many steps in a row claims first, so a long "
        "prompt is never starved. 0: in the order the slots became busy.",
    )
    prefill_beside_short: int | None = Field(
        default=128, ge=1,
        description="While a short prompt (at most prefill_long_tokens to evaluate) waits for its first "
        "token in any group, a step carries at most this many tokens of long prompts, so that the short "
        "one's step is quick; a long prompt held back prefill_aging_steps steps in a row is exempt. "
        "None: long prompts fill the step beside short ones.",
    )
    prefill_burst_step_s: float | None = Field(
        default=0.5, gt=0.0, le=60.0,
        description="Chunked prefill: while several prompts wait and the streams decoding do not outnumber "
        "them (a burst), a step carries at most the long prompts' tokens the cost model prices at this many "
        "seconds (never under 128 tokens), so that a request arriving meanwhile waits at most about that for "
        "the step in flight. "
        "A device where the whole batch fits (a GPU) keeps whole batches; one prompt alone always does. "
        "Lower: newcomers' first tokens sooner, the burst's prompts a little later (smaller chunks cost "
        "more a token). None: whole batches, as llama-server.",
    )
    n_threads: int = Field(
        default=0, ge=0, description="Threads of the local compute device; 0 picks one per core [-t]."
    )
    local_cpus: list[int] | None = Field(
        default=None,
        description="Pin the group threads, which run the local stage's CPU compute, to these "
        "cores (os.sched_setaffinity; Linux). None: no pinning.",
    )
    devices: list[str] | None = Field(
        default=None,
        description="Devices in layer order, llama.cpp style (e.g. ['RPC0', 'CPU']); the last one "
        "holds the output layer. None: all layers on the local device, or RPC first then local "
        "when an RPC endpoint is given [--device].",
    )
    rpc_endpoints: list[str] = Field(
        default_factory=list, description="ggml RPC servers (host:port) to register as devices [--rpc]."
    )
    n_gpu_layers: int = Field(default=-1, description="Layers to offload to devices; -1 is all [-ngl].")
    tensor_split: list[float] | None = Field(
        default=None,
        description="Share of the layers per device, in device order [-ts]. llama.cpp counts the "
        "output layer as one more layer: [5, 4] on an 8-layer model puts 5 layers on the first "
        "device and 3 plus the output layer on the second. Prefer peer_layers.",
    )
    peer_layers: int | None = Field(
        default=None,
        ge=1,
        description="Layers the RPC stage computes; the rest and the output layer stay on the local "
        "device. Needs exactly one RPC device before the local one; excludes tensor_split.",
    )
    kv_unified: bool = Field(
        default=False,
        description="One KV stream shared by a group's slots [-kvu]. Off: one stream per slot, so "
        "attention reads only the slot's own cells; a step is then cut into one micro-batch per "
        "run of consecutive busy sequence ids. On: one micro-batch per step, but every row "
        "attends over the cells of all the group's slots (costly at long contexts).",
    )
    flash_attn: bool | None = Field(
        default=True,
        description="Flash attention on or off [-fa]. None is llama.cpp's auto, which resolves after "
        "the KV cache is laid out; on an RPC split it measured 40 % slower than either choice.",
    )
    repack: bool = Field(
        default=True,
        description="Let the local CPU device repack weights for its faster kernels. An RPC stage "
        "never does, so with it off the local layers round as the peer's do.",
    )
    release_offloaded_pages: bool = Field(
        default=True,
        description="After the load, drop the GGUF's pages of the layers another device holds (the "
        "peer's, a local GPU's) from this node's memory and page cache. Off: they stay cached, so a "
        "restart hashes the peer's half for the tensor cache without reading it from disk again.",
    )
    swa_full: bool = Field(
        default=False,
        description="Keep the full context in the KV of sliding-window layers [--swa-full]. Off (as "
        "llama-server): those layers keep only their window, and a reused prefix that reaches "
        "before the window is evaluated again.",
    )
    chat_template: str | None = Field(
        default=None,
        description="A llama.cpp built-in template name (chatml, gemma, llama3...) or Jinja source "
        "[--chat-template]. None: the GGUF's template, else chatml.",
    )
    chat_template_file: str | None = Field(
        default=None, description="A Jinja chat template file; wins over chat_template [--chat-template-file]."
    )
    cache_prompt: bool = Field(
        default=True, description="Reuse the common prefix of a slot's cached tokens for a new prompt."
    )
    share_prefix: bool = Field(
        default=True,
        description="A new prompt takes a longer prefix held (or being computed) by another slot of its "
        "group as a copy of that slot's KV on the device, instead of evaluating it again. Not for "
        "recurrent or hybrid models.",
    )
    prompt_cache_mib: int | None = Field(
        default=None, ge=0,
        description="The prompt cache beyond the slots, in MiB of KV over all stages and groups [--cache-ram]: "
        "when a request takes a slot whose KV it does not continue, what the slot held is kept in one more "
        "sequence of the group's KV pool (a slot's size each, on every stage's own device), and a later prompt "
        "that continues it takes it back into whatever slot it gets; least recently used first out. Save and "
        "restore are copies inside each stage's memory: no KV crosses the link. None: as much KV again as "
        "the slots have (one entry a slot); 0: off (only the slots cache). The KV is allocated at start, on "
        "each stage's device. Needs share_prefix (not recurrent or hybrid models).",
    )
    checkpoint_every: int = Field(
        default=2048, ge=0, description="On a model whose KV cannot be cut back (recurrent or hybrid layers, or "
        "a sliding window): while a long prompt is evaluated, keep a checkpoint of its state in the prompt cache "
        "at each multiple of this many of its tokens (its chunks end there; as llama-server's context checkpoints), so an edit "
        "inside the prompt recomputes from the last checkpoint before it, not from the start. 0: a checkpoint "
        "only at a prompt's end.",
    )
    move_min_tokens: int = Field(
        default=256, ge=0, description="A request sent to one group while another group holds at least this many "
        "more tokens of its prompt (a returning conversation whose group had no free slot) takes that history's "
        "KV from the other group's context instead of evaluating it again: the state is read there between two "
        "of its steps and written into the request's slot (a remote stage's part crosses the link twice; "
        "docs/engine.md). 0: never; each group evaluates what it does not hold.",
    )
    share_min_tokens: int = Field(
        default=32, ge=1, description="Least gain, in prompt tokens, for a prefix to be copied from another slot."
    )
    slot_prompt_similarity: float = Field(
        default=0.1,
        ge=0.0,
        le=1.0,
        description="Least shared fraction of the prompt for a slot to be picked by prefix; else LRU.",
    )
    sample_threads: int = Field(
        default=0,
        ge=0,
        description="Sampling thread budget over all groups (divided by the group count); 0 picks "
        "min(4, cores); 1 samples serially in each group thread.",
    )
    backend_sampling: bool = Field(
        default=False,
        description="Run each request's sampler chain in the compute graph (llama_set_sampler) "
        "when the chain allows it (no penalties, no logit bias); others sample on the host.",
    )
    max_queued_requests: int = Field(
        default=256, ge=0,
        description="Requests that may wait for any slot; beyond them, HTTP 429. Requests pinned to a "
        "slot (id_slot) wait apart and do not count here (max_queued_per_slot).",
    )
    max_queued_per_slot: int = Field(
        default=16, ge=0,
        description="Requests pinned to one busy slot (llama-server's id_slot) that may wait for it; "
        "beyond them, HTTP 429. They never hold back a request that any slot can take.",
    )
    queue_aging: int = Field(
        default=8, ge=0,
        description="Requests waiting for a slot start shortest first (fewest prompt tokens to evaluate "
        "after an idle slot's cached prefix, first come first served among equals); one passed over "
        "by this many later arrivals starts next. 0: first come, first served.",
    )
    slot_save_path: str | None = Field(
        default=None, description="Folder for slot save/restore files; None disables the actions."
    )
    profile: bool = Field(
        default_factory=lambda: os.environ.get("PGROUPS_PROFILE", "") not in ("", "0"),
        description="Log each group's host-path profile every 5 s (or set PGROUPS_PROFILE=1).",
    )
    graph_reuse: bool = Field(
        default=False,
        description="Allow llama.cpp graph reuse. Off by default: contexts that share one RPC "
        "connection can race on the per-device last-graph id (LLAMA_GRAPH_REUSE_DISABLE).",
    )
    seed: int = Field(default=-1, description="Default sampling seed; -1 draws one per request.")
    embeddings: bool = Field(
        default=False,
        description="Serve /v1/embeddings and /embedding from one more context of the model, made to "
        "pool [--embeddings].",
    )
    pooling: Literal["mean", "cls", "last"] | None = Field(
        default=None, description="How an embedding pools its tokens [--pooling]; None: the GGUF's, or mean "
        "where it names none (a causal model).",
    )
    grammar_budget_s: float = Field(
        default=5.0, gt=0, le=600,
        description="Longest a request's grammar or JSON schema may take to compile (on a compile "
        "thread, never a group's); past it the request gets a 400.",
    )
    step_budget_s: float = Field(
        default=120.0, gt=0,
        description="A group step (its decode, or its host work: sampling, grammar masks) that runs "
        "this long means a thread stuck in native code: the engine reports itself unhealthy "
        "(/health 503) and its replica is replaced. Well above the slowest step.",
    )
    speculative: SpeculativeConfig | None = Field(
        default=None,
        description="Speculative decoding per group: {type: ngram|draft, model, n_max, n_min, p_min, "
        "max_rows, ...}; None: off. See engine/speculation/drafters.py.",
    )
    mmproj: str | None = Field(
        default=None,
        description="GGUF of the model's multimodal projector: images (and audio, where the projector "
        "takes it) in prompts, with any number of pipeline groups [--mmproj]. See docs/media.md.",
    )
    mmproj_offload: bool = Field(
        default=True,
        description="Run the projector on the local node's GPU when it has one (the node of the output "
        "layer); false: on its CPU [--no-mmproj-offload].",
    )
    media_cache_mib: int = Field(
        default=256, ge=0, le=65536,
        description="Embeddings of the last images kept by their bytes' hash, so the next turn about "
        "the same image is not encoded again.",
    )

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: object) -> object:
        if isinstance(data, dict) and "prefill_stall" in data:
            raise ValueError("prefill_stall is now prefill_gap_factor, which is 1 + its value (null: off), "
                             "beside prefill_min_rate, the long prompt's least rate")
        return data

    @model_validator(mode="after")
    def _check(self) -> EngineConfig:
        n, p = self.pipeline_groups, self.n_parallel
        if n > p:
            raise ValueError(
                f"pipeline_groups ({n}) exceeds n_parallel ({p}): every group needs at least one slot"
            )
        if p % n:
            raise ValueError(
                f"n_parallel ({p}) must be a multiple of pipeline_groups ({n}) so the slots "
                "partition evenly over the groups"
            )
        if self.n_ctx // p < 8:
            raise ValueError(f"n_ctx ({self.n_ctx}) leaves under 8 tokens per slot over {p} slots")
        if self.tensor_split is not None and any(x < 0 for x in self.tensor_split):
            raise ValueError("tensor_split entries must be >= 0")
        if self.peer_layers is not None and self.tensor_split is not None:
            raise ValueError("set peer_layers or tensor_split, not both")
        if self.mmproj and self.speculative is not None and self.speculative.type == "mtp":
            raise ValueError("speculative type mtp with mmproj: the MTP layers would not see the images' "
                             "rows (ngram and draft speculate for requests without media)")
        return self

    @property
    def n_slots_per_group(self) -> int:
        return self.n_parallel // self.pipeline_groups

    @property
    def prompt_cache_bytes(self) -> int | None:
        """The prompt cache's budget in bytes: None as much KV again as the slots', 0 off (as
        without share_prefix or cache_prompt)."""
        if not (self.share_prefix and self.cache_prompt) or self.prompt_cache_mib == 0:
            return 0
        return None if self.prompt_cache_mib is None else self.prompt_cache_mib << 20

    @property
    def n_ctx_per_group(self) -> int:
        return self.n_ctx // self.pipeline_groups

    def sample_threads_per_group(self) -> int:
        budget = self.sample_threads or min(4, os.cpu_count() or 1)
        return max(1, budget // self.pipeline_groups)

    def local_threads(self) -> int:
        return self.n_threads or max(1, os.cpu_count() or 1)
