"""A request as the scheduler tracks it."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field

import msgspec

from ..messages import AbortReason, GenerateReq, ImageInput, SamplingParams

# The fields that describe one admission, reset when a preempted request goes back to waiting.
ADMISSION = ("slot", "pages", "pages_sent", "page_keys", "history_sent", "chunks", "next_chunk", "num_computed",
             "copies", "layer_major", "match_keys", "lm_spec", "lm_turn", "lm_chunks")


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    rid: str
    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop_token_ids: frozenset[int] = frozenset()
    # Offline scoring: return logits of every prompt row, sample nothing.
    want_logits: bool = False
    status: Status = Status.WAITING
    slot: int | None = None
    pages: list[int] = field(default_factory=list)
    # Positions whose state (KV + recurrent) the request's slot and pages hold.
    num_computed: int = 0
    cached_tokens: int = 0
    output: list[int] = field(default_factory=list)
    # Planned prompt forwards [start, end) and the positions where state is checkpointed.
    chunks: list[tuple[int, int]] = field(default_factory=list)
    next_chunk: int = 0
    # Planned state exports not yet written: position -> destination checkpoint slot.
    exports: dict[int, int] = field(default_factory=dict)
    # Prefix-cache bookkeeping.
    restore: object | None = None  # the locked Checkpoint restored by the first forward
    copies: list[list[int]] = field(default_factory=list)  # [src, dst] slot copies for the first forward
    branch: int = 0  # prompt tokens already cached as KV pages when admitted
    layer_major: bool = False  # its long prompt forward runs layer-major (decided at admission)
    # A layer-major prefill under way over several turns: its segment as the first turn sent it, the next
    # turn and its internal chunks (the executor holds the prefill from the first turn to the last).
    lm_spec: object | None = None
    lm_turn: int = 0
    lm_chunks: int = 0
    page_keys: list[bytes] = field(default_factory=list)  # chain hashes of the pages indexed so far
    images: list[ImageInput] = field(default_factory=list)  # in prompt order
    _key_prompt: list[int] | None = field(default=None, repr=False)  # the prompt as the prefix cache keys it
    rolling_slot: int | None = None  # end-of-request checkpoint, rewritten at each aligned position
    rolling_pos: int | None = None
    checkpoints_written: list[int] = field(default_factory=list)
    forwards: int = 0
    prefill_forwards: int = 0
    in_flight: int = 0  # batches sent with a segment of this request and not answered yet
    # Positions the prefill computes: the prompt, or after a preemption the prompt and every output
    # token but the last (whose forward is the next decode).
    prefill_len: int = 0
    pages_sent: int = 0  # page-table entries the executor already holds for this request's slot
    history_sent: bool = False  # the executor holds this request's token counts (penalties)
    after: str | None = None  # admitted only once that request's prompt is computed
    admitted: bool = False  # PromptAdmitted went out (once per request, even if preempted later)
    match_keys: list[bytes] | None = None  # prefix-cache chain hashes of the prefill tokens, kept
    # Prompt log-probabilities (echo): alternatives per entry (-1: none), the entries so far (one per
    # prompt token after the first), and whether they went out.
    prompt_logprobs: int = -1
    prompt_lp: list = field(default_factory=list)
    prompt_lp_sent: bool = False
    # Set when an abort arrives while the request's rows are inside an in-flight batch.
    abort_reason: AbortReason | None = None
    arrived: float = 0.0  # time.monotonic() when the scheduler took it

    @classmethod
    def from_msg(cls, msg: GenerateReq, eos_ids: tuple[int, ...]) -> "Request":
        stops = set(msg.stop_token_ids)
        if not msg.ignore_eos:
            stops.update(eos_ids)
        sampling = msg.sampling
        if sampling.min_tokens > 0:  # what min_tokens holds back: whatever would end the request
            sampling = msgspec.structs.replace(sampling, min_tokens_ban=sorted(stops))
        return cls(rid=msg.rid, prompt=list(msg.prompt_ids), max_tokens=msg.max_tokens, sampling=sampling,
                   stop_token_ids=frozenset(stops), prefill_len=len(msg.prompt_ids),
                   after=msg.after, prompt_logprobs=msg.prompt_logprobs, images=list(msg.images))

    def key_tokens(self, start: int, end: int) -> list[int]:
        """What the prefix cache hashes for positions ``[start, end)``: the token ids, each image's
        placeholder ids replaced by negative ids drawn from its content digest (the same image and text
        hit, another image does not)."""
        if not self.images:
            return self.tokens(start, end)
        if self._key_prompt is None:
            keyed = list(self.prompt)
            for image in self.images:
                seed = int(image.digest[:15], 16)
                for k in range(image.tokens):
                    keyed[image.offset + k] = -1 - (seed + k) % (1 << 62)
            self._key_prompt = keyed
        p = self.prompt_len
        if end <= p:
            return self._key_prompt[start:end]
        head = self._key_prompt[start:p] if start < p else []
        return head + self.output[max(start - p, 0):end - p]

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    @property
    def full_prompt(self) -> bool:
        """Every prompt row is needed (scoring, prompt log-probabilities): no prefix-cache match."""
        return self.want_logits or self.prompt_logprobs >= 0

    @property
    def prefill_done(self) -> bool:
        return self.next_chunk >= len(self.chunks)

    def ends_by_length(self, outputs: int, max_model_len: int) -> bool:
        """Whether the request is over by length once it holds ``outputs`` generated tokens."""
        return outputs >= self.max_tokens or self.prompt_len + outputs >= max_model_len

    def requeue(self) -> None:
        """Back to waiting after a preemption: what one admission held (slot, pages, plan, computed state)
        starts afresh, and the prefill recomputes the prompt and every output token but the last (whose
        forward is the next decode)."""
        defaults = {f.name: f for f in dataclasses.fields(self)}
        for name in ADMISSION:
            f = defaults[name]
            setattr(self, name, f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default)
        self.status = Status.WAITING
        self.prefill_len = self.prompt_len + max(len(self.output) - 1, 0)

    def tokens(self, start: int, end: int) -> list[int]:
        """Token ids at positions ``[start, end)`` of prompt + output, without copying the rest."""
        p = self.prompt_len
        if end <= p:
            return self.prompt[start:end]
        head = self.prompt[start:p] if start < p else []
        return head + self.output[max(start - p, 0):end - p]

