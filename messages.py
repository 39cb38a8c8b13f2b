"""Every message that crosses a process seam, as ``msgspec.Struct``s (msgpack on the wire).

The names are the seams the design and the tap rely on::

    frontend  --GenerateReq / AbortReq-->  scheduler  --Batch-->  executors
    scheduler <--BatchResult-- executor rank 0
    scheduler --StepOutput (the step's DetokenizeInit / PromptAdmitted / Detokenize) / SchedulerStats-->
        detokenizer --TextDelta--> frontend
    scheduler, detokenizer --PromptAdmitted / Detokenize--> tap (PUB)

Each socket decodes with one typed decoder over the union it may carry (see ``decoder``); nothing
is pickled.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Struct

# How a request ended: a stop token or string, max_tokens or the context length, the client went away,
# or an error.
FinishReason = Literal["stop", "length", "abort", "error"]
# Why a request is aborted: the client went away, a stop string matched, or the detokenizer failed it.
AbortReason = Literal["abort", "stop", "error"]
# How a prompt's forwards run: chunk by chunk, or one long forward layer by layer.
PlanMode = Literal["chunked", "layer_major"]
# The processes of a mesh: its roles, one executor per tensor-parallel rank.
ROLE_PATTERN = r"^(scheduler|detokenizer|frontend|executor-\d+)$"
Role = Annotated[str, msgspec.Meta(pattern=ROLE_PATTERN)]
# A process as its supervisor sees it: loading, serving, stopping on purpose (a clean exit), or failed.
MemberState = Literal["starting", "ready", "leaving", "failed"]


class SamplingParams(Struct, frozen=True, omit_defaults=True):
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0  # tokens below min_p x the most likely one's probability are dropped (0: off)
    seed: int | None = None
    # Log-probabilities of each sampled token and of the ``logprobs`` most likely ones (-1: none),
    # from the model's distribution before any sampling adjustment.
    logprobs: int = -1
    # Penalties (vLLM's semantics): frequency and presence count generated tokens
    # (``logit -= frequency * count + presence * (count > 0)``); repetition counts prompt and generated
    # tokens (positive logits divided by it, negative ones multiplied).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # Added to the logits of these token ids.
    logit_bias: dict[int, float] = {}
    # Until this many tokens are out, ``min_tokens_ban`` (the request's stop token ids, filled in by
    # the scheduler) cannot be sampled.
    min_tokens: int = 0
    min_tokens_ban: list[int] = []
    # Structured output: an llguidance grammar (``response_format``); only tokens it allows are sampled.
    grammar: str | None = None

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def needs_history(self) -> bool:
        """Whether the executor follows the request's generated tokens (penalty counts, grammar state)."""
        return self.penalized or self.grammar is not None

    @property
    def greedy(self) -> bool:
        """Temperatures below 1e-5 sample greedily (dividing by them overflows the logits)."""
        return self.temperature < 1e-5


# ---- frontend -> scheduler --------------------------------------------------------------------
class ImageInput(Struct, array_like=True, omit_defaults=True):
    """One image of a prompt: its vision tokens are the ``tokens`` placeholder ids at prompt positions
    ``[offset, offset + tokens)`` (``tokens = t * h * w / merge**2``); ``pixels`` the image processor's
    ``pixel_values`` rows (float32 ``[t * h * w, patch_dim]``), or, with ``rgb`` instead, the resized image
    (uint8 ``[h * patch, w * patch, 3]``, ``t`` 1) that the executor rescales, normalises and cuts into those
    rows itself (an eighth of the bytes at a temporal patch of 2); ``digest`` names its content (the prefix
    cache keys on it)."""

    offset: int
    tokens: int
    grid: list[int]  # (t, h, w) in patches
    pixels: bytes
    digest: str
    rgb: bytes = b""


class GenerateReq(Struct, tag="GenerateReq", omit_defaults=True):
    rid: str
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams = SamplingParams()
    ignore_eos: bool = False
    stop: list[str] = []  # stop strings, applied by the detokenizer
    stop_token_ids: list[int] = []
    skip_special_tokens: bool = True  # applied by the detokenizer
    include_stop_str_in_output: bool = False  # applied by the detokenizer
    # Admit only once this request has computed its prompt (the other choices of an ``n > 1``
    # request: they find the prompt in the prefix cache instead of computing it again).
    after: str | None = None
    # Log-probabilities of every prompt token after the first, with this many alternatives (-1:
    # none). Such a request computes its whole prompt (no prefix-cache match); with ``max_tokens``
    # 0 it ends once the prompt is computed.
    prompt_logprobs: int = -1
    images: list[ImageInput] = []  # in prompt order


class AbortReq(Struct, tag="AbortReq", omit_defaults=True):
    rid: str
    reason: AbortReason = "abort"


class Tokenizing(Struct, tag="Tokenizing"):
    """The frontend's count of request bodies it has read and not yet turned into requests (or errors), sent
    when it changes; a body's requests reach the scheduler before the count that drops it."""
    count: int


# ---- scheduler -> detokenizer / tap -----------------------------------------------------------
class Plan(Struct, omit_defaults=True):
    mode: PlanMode
    chunks: list[list[int]]  # [start, end) prompt positions per forward
    checkpoints: list[int] = []
    reason: str = ""
    # layer_major: the scheduling turns of the prefill, decode steps between them (1: one turn; 0: chunked).
    turns: int = 0


class PromptAdmitted(Struct, tag="PromptAdmitted", omit_defaults=True):
    rid: str
    prompt_tokens: int
    cached_tokens: int
    plan: Plan


class DetokenizeInit(Struct, tag="DetokenizeInit", omit_defaults=True):
    """Sent by the scheduler when a request arrives: what the detokenizer needs to know of it."""

    rid: str
    prompt_tokens: int
    stop: list[str] = []
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False


class Usage(Struct):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


class TokenLogprob(Struct, array_like=True, omit_defaults=True):
    """One sampled token's log-probability and the most likely alternatives at its position."""

    logprob: float
    top_ids: list[int] = []
    top_logprobs: list[float] = []


class Detokenize(Struct, tag="Detokenize", omit_defaults=True):
    rid: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None  # one per token, for requests that asked
    # With the request's first message: one entry per prompt token after the first (prompt_logprobs).
    prompt_logprobs: list[TokenLogprob] | None = None
    finished: bool = False
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    error: str | None = None
    # HTTP status for an error: 400 the request can never run here, 500 it failed while running.
    error_status: Literal[400, 500] | None = None


class StepOutput(Struct, tag="StepOutput"):
    """Everything one scheduler step emits for the detokenizer, as one message (in order)."""

    events: list[DetokenizeInit | PromptAdmitted | Detokenize] = []


class SchedulerStats(Struct, tag="SchedulerStats"):
    running: int
    waiting: int
    kv_pages_in_use: int
    kv_pages_cached: int
    kv_pages_total: int
    state_slots_in_use: int
    state_slots_cached: int
    state_slots_total: int
    counters: dict[str, int] = {}
    executor_stats: dict[str, list[int]] = {}


# ---- detokenizer -> frontend ------------------------------------------------------------------
class TextDelta(Struct, tag="TextDelta", omit_defaults=True):
    rid: str
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None  # one per id of ``token_ids``, for requests that asked
    prompt_logprobs: list[TokenLogprob] | None = None  # as in ``Detokenize``
    finished: bool = False
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    error: str | None = None
    # HTTP status for an error: 400 and 500 as in ``Detokenize``; 503 the server is shutting down.
    error_status: Literal[400, 500, 503] | None = None


# ---- scheduler <-> executors ------------------------------------------------------------------
class SegmentSpec(Struct, omit_defaults=True, array_like=True):
    """One request's rows in a forward.

    The request's page table covers positions ``[0, start + len(token_ids))``: the executor keeps
    each slot's table, and ``pages`` are its entries from index ``page_base`` on (a decode step
    sends only a new page, if any; the first segment of a request sends all, from 0).
    ``exports`` are ``[offset, slot]``
    pairs: after the first ``offset`` tokens of this segment, copy the request's full state into
    ``slot``. ``sample_index`` numbers the output token being sampled (seeded sampling uses it).
    A decode scheduled ahead of the batch that samples its input has ``token_ids == [-1]``: the
    executor takes the token it sampled last in ``slot``.
    """

    rid: str
    slot: int
    start: int
    token_ids: list[int]
    pages: list[int] = []
    page_base: int = 0
    sample: bool = False
    sampling: SamplingParams | None = None
    sample_index: int = 0
    exports: list[list[int]] = []
    want_logits: bool = False
    # For a request with penalties or a grammar, on its first sampling segment after admission (or
    # resumption): its prompt ids (when the repetition penalty needs them) followed by the ids
    # generated so far; the executor keeps its counts and grammar state from there.
    history: list[int] | None = None
    history_prompt: int = 0
    # Prompt log-probabilities: row j's log-probability of ``prompt_targets[j]`` (the next prompt
    # token) and its top ``prompt_logprobs`` alternatives, for rows ``[0, len(prompt_targets))``.
    prompt_targets: list[int] = []
    prompt_logprobs: int = -1
    # The request's images, on its first segment after admission (``page_base`` 0); the executor keeps
    # their features and the 3-D positions they give the prompt for the slot from there.
    images: list[ImageInput] = []


class Batch(Struct, tag="Batch", omit_defaults=True):
    batch_id: int
    segments: list[SegmentSpec]
    # [src_slot, dst_slot] state copies applied before the forward (prefix-cache restores).
    copies: list[list[int]] = []
    # "chunked", or "layer_major": one segment run layer by layer over internal chunks of chunk_size.
    mode: PlanMode = "chunked"
    chunk_size: int = 0
    # layer_major over several turns (--layer-major-turns): this is turn ``turn`` of ``turns``, doing
    # ``layer_chunks`` (layer, internal chunk) pairs of the prefill (0: all that are left); the first turn
    # carries the pages and copies, the last samples. ``drop``: end the prefill unfinished (its request was
    # aborted between turns).
    turn: int = 0
    turns: int = 1
    layer_chunks: int = 0
    drop: bool = False
    # Hyper-connection row sharding across the TP ranks for this (pure, large) prefill batch.
    hc_shard: bool = False


class BatchResult(Struct, tag="BatchResult", omit_defaults=True):
    batch_id: int
    # One sampled id per segment, -1 where the segment did not sample.
    token_ids: list[int]
    # Segment index -> the sampled token's log-probabilities, for segments whose request asked.
    logprobs: dict[int, TokenLogprob] = {}
    # Segment index -> one entry per ``prompt_targets`` id of that segment.
    prompt_logprobs: dict[int, list[TokenLogprob]] = {}
    error: str | None = None
    # Cumulative executor counters: ``expert_*`` one value per MoE layer (loads, bytes, whole-layer
    # streams); ``tp_*`` one value (collectives issued, hyper-connection sharded forwards).
    executor_stats: dict[str, list[int]] = {}


# ---- lifecycle --------------------------------------------------------------------------------
class Ready(Struct, tag="Ready"):
    """A role to the member of its process: it serves from now on."""

    role: Role


class Drained(Struct, tag="Drained"):
    """The frontend to the member of its process: the drain a ``Shutdown(drain=True)`` asked for is over."""


class Heartbeat(Struct, tag="Heartbeat", omit_defaults=True):
    """A member to the supervisor, every second and at once on a change: process ``instance`` (an id no
    other process has) of ``role`` is in ``state``; ``error`` says why it failed. Instance ids, not clocks,
    tell a replaced process from its replacement."""

    role: Role
    instance: str
    state: MemberState
    error: str = ""


class MeshReady(Struct, tag="MeshReady"):
    """The supervisor to the frontend: every process of the mesh is ready (``/health`` turns 200)."""


class Shutdown(Struct, tag="Shutdown"):
    """To a role: stop. To the frontend: the mesh is failing (answer every request in flight with
    ``reason`` as an error, 503 meanwhile) or, with ``drain``, shutting down (503 for new requests,
    let the ones in flight finish within ``timeout`` seconds, then report ``Drained``)."""

    reason: str = ""
    drain: bool = False
    timeout: float = 0.0


class ExecutorFailed(Struct, tag="ExecutorFailed"):
    rank: int
    error: str


SchedulerInbound = GenerateReq | AbortReq | Tokenizing | BatchResult | ExecutorFailed | Shutdown
ExecutorInbound = Batch | Shutdown
DetokenizerInbound = DetokenizeInit | Detokenize | PromptAdmitted | StepOutput | SchedulerStats | Shutdown
FrontendInbound = TextDelta | SchedulerStats | PromptAdmitted | MeshReady | Shutdown
RelayInbound = Ready | Drained | ExecutorFailed  # a role -> the member of its process
ControlInbound = Heartbeat | ExecutorFailed  # members -> the supervisor
TapMessage = PromptAdmitted | Detokenize

_encoder = msgspec.msgpack.Encoder()


def encode(msg: Struct) -> bytes:
    return _encoder.encode(msg)


def decoder(union) -> msgspec.msgpack.Decoder:
    """A typed decoder for one socket: anything outside ``union`` fails to decode."""
    return msgspec.msgpack.Decoder(union)


def to_builtins(msg: Struct) -> dict[str, Any]:
    """Plain JSON-ready dict with a ``type`` field naming the message (the tap's line format)."""
    data = msgspec.to_builtins(msg)
    data["type"] = type(msg).__name__
    return data
