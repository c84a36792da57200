"""The records that cross threads: requests in, per-step outputs out, and the errors."""

from __future__ import annotations

import time
from array import array
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, NamedTuple

from engine.errors import QueueFullError, RequestError  # noqa: F401 - their home is engine.errors
from engine.params import SamplingParams

SHUTTING_DOWN = "the server is shutting down; retry the request"


class FinishReason(StrEnum):
    """Why a request's last output ended it (compares and serialises as its string)."""

    STOP = "stop"  # an end-of-generation token or a stop string
    LENGTH = "length"  # max_tokens, or the slot's context
    CANCELLED = "cancelled"  # the client went away (or the request was cut)
    ERROR = "error"  # a ``Failure``'s: see its ``fault``


class Fault(StrEnum):
    """What failed a request (``Failure.fault``). The ingress maps each to an HTTP status; the
    ones the request did not cause are resumed on another replica (``resumable``). The values are
    the resume metrics' labels."""

    REQUEST = "request"  # the request's own: its grammar has no way on
    INTERNAL = "internal"  # the engine's own error for this request alone (a sampler, a start)
    ENGINE = "engine_failed"  # a pipeline group died (a compute failure: its stage was lost)
    STAGE_FROZEN = "stage_frozen"  # the watchdog: the stage stopped answering, the replica restarts
    REPLICA_LOST = "replica_lost"  # the ingress lost the engine replica's output stream
    SHUTDOWN = "shutting_down"  # the replica drains (Serve stops it): retried, never resumed
    TIMEOUT = "timeout"  # the ingress's wait for the answer ran out

    @property
    def resumable(self) -> bool:
        return self in (Fault.ENGINE, Fault.STAGE_FROZEN, Fault.REPLICA_LOST)


@dataclass(frozen=True)
class EngineRequest:
    """The one value a request crosses into the engine as: its prompt as token ids (packed, four
    bytes a token: made by the ingress, which templates and tokenises), its sampling, its
    choices (``n``: followers seeded ``seed + i``), its slot pin and prefix reuse, and for a
    resumed choice how many of the prompt's last tokens it had generated (``n_resumed``). With
    ``media`` (the bytes of each image or audio clip, checked by the ingress), the prompt holds
    ``engine.media.MEDIA_SLOT`` where each goes, in order."""

    id: str
    prompt: bytes
    params: SamplingParams
    n: int = 1
    id_slot: int = -1
    cache_prompt: bool = True
    n_resumed: int = 0
    media: tuple[bytes, ...] = ()
    # special tokens rendered as text in the answer (llama.cpp's preserved tokens: the markup a
    # model family's answers are parsed by, such as gpt-oss's <|channel|>)
    preserved: tuple[int, ...] = ()
    # prefixes are reused only between requests of the same salt (vLLM's cache_salt)
    cache_salt: str = ""

    @classmethod
    def of(cls, request_id: str, tokens: list[int], params: SamplingParams, **kw: Any) -> EngineRequest:
        return cls(request_id, array("i", tokens).tobytes(), params, **kw)

    @property
    def prompt_tokens(self) -> list[int]:
        a = array("i")
        a.frombytes(self.prompt)
        return a.tolist()

    @property
    def n_prompt(self) -> int:
        return len(self.prompt) // 4


class Decode(NamedTuple):
    """A group's decode in progress, as the frozen-stage watchdog reads it."""

    group: int
    seconds: float  # since it began
    expected_s: float | None  # what the cost model expected it to take (None: nothing learnt yet)
    thread_cpu_s: float | None  # the group thread's CPU seconds so far (None: unknown)


@dataclass(eq=False)
class Request:
    """A request as the engine runs it. Immutable once submitted, but for ``slot_id``."""

    id: str
    prompt_tokens: list[int]
    params: SamplingParams
    n_predict: int  # max_tokens clamped to what the slot context allows
    t_arrival: float = field(default_factory=time.monotonic)
    slot_id: int = -1
    cache_prompt: bool = True  # reuse the chosen slot's cached prefix (with the engine's cache_prompt)
    # n > 1: the other choices of the same prompt (ids "<id>#1", "<id>#2", ...). They run on
    # slots of this request's group; the prompt is evaluated once, on this request's slot,
    # and its KV copied to theirs before each samples its first token from the same logits.
    followers: list[Request] = field(default_factory=list)
    id_slot: int = -1  # llama-server's id_slot: run on this slot (waiting until it is free); -1: any
    # the compiled grammar of params.grammar (GrammarState), consumed by the slot that runs it
    grammar: Any = None
    # a resumed request (one whose replica failed it): how many of ``prompt_tokens``' last
    # tokens it had generated already, and its text stream as it stood after them (what was
    # held back for a stop string or a split character), consumed by the slot that runs it
    n_resumed: int = 0
    text: Any = None
    # the prompt's media (engine.media.MediaSpan: first position, embedding rows), in order
    media: list = field(default_factory=list)
    preserved: frozenset[int] = frozenset()  # special tokens its text renders (EngineRequest.preserved)
    cache_salt: str = ""  # reuses KV only of requests with the same salt

    @property
    def family(self) -> list[Request]:
        return [self, *self.followers]


class Delta(NamedTuple):
    """What one step produced for a request that goes on: new text and its tokens, or (with
    ``return_progress``) how far its prompt has come."""

    request_id: str
    text: str
    n_tokens: int  # tokens generated in this step (0 or 1)
    # per generated token of this output, when the request asked: (piece, logprob, top), top
    # being ((piece, logprob), ...) of the most likely tokens; pieces are the token's bytes
    logprobs: tuple | None = None
    tokens: tuple[int, ...] = ()  # the token ids generated in this step (not the end-of-generation token)
    # return_progress: after a prompt chunk, (processed, total, cached, ms since the slot started)
    progress: tuple[int, int, int, int] | None = None

    @property
    def finish_reason(self) -> None:
        return None

    @property
    def failed(self) -> bool:
        return False


class Finish(NamedTuple):
    """A request's last output when it ended as it should (or was cancelled): its last text,
    why it ended, and its figures."""

    request_id: str
    text: str
    n_tokens: int
    finish_reason: FinishReason
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    t_first_token: float = 0.0  # seconds from arrival to the first token
    t_queue: float = 0.0  # seconds waiting for a slot
    t_end: float = 0.0  # seconds from arrival to this output
    logprobs: tuple | None = None
    tokens: tuple[int, ...] = ()
    stop_word: str | None = None  # with finish_reason "stop": the stop string that ended it
    slot: int = -1  # the slot that ran the request
    progress: None = None

    @property
    def failed(self) -> bool:
        """A cancelled request's client, if still there, gets an error: the server cut it."""
        return self.finish_reason is FinishReason.CANCELLED


class Failure(NamedTuple):
    """A request's last output when it failed: what failed it (``fault``, a kind the ingress
    maps to an HTTP status and resume reads) and the client's words (``message``), after any
    text this step still gave."""

    request_id: str
    fault: Fault
    message: str
    text: str = ""
    n_tokens: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    t_first_token: float = 0.0
    t_queue: float = 0.0
    t_end: float = 0.0
    logprobs: tuple | None = None
    tokens: tuple[int, ...] = ()
    slot: int = -1
    progress: None = None

    @property
    def finish_reason(self) -> FinishReason:
        return FinishReason.ERROR

    @property
    def failed(self) -> bool:
        return True

    @property
    def stop_word(self) -> None:
        return None


# One step's output for one request: a delta while it runs, then one finish or one failure.
Output = Delta | Finish | Failure
