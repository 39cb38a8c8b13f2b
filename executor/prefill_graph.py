"""Prompt forwards replayed from CUDA graphs.

A short prefill forward is bound by its host: each layer launches tens of kernels from Python, and a forward of
a few hundred tokens launches for longer than the device computes. :class:`PrefillGraphs` records the forward of
one prompt segment (with the n-gram context updates and the logits of its last row) once per padded shape and
replays it with one launch, after one host-to-device copy of its metadata.

A captured forward holds ``B = 64 M + 66`` rows: the prompt segment's ``L``, then a padding segment of
``B - L`` on the pools' padding slot and page (fresh; what it writes nobody reads). The 64-row chunks of the
chunked recurrence are counted per segment, so the padding is laid out to keep their count fixed whatever ``L``:

* ``M = 0``: a prompt of 2 to 64 rows without an internal checkpoint, one wave: ``L`` rows and ``66 - L``
  padding rows, two chunks;
* ``M >= 1``: both segments split their recurrence once (``forward_batch.Wave``). The prompt splits at ``e``:
  at its internal checkpoint when it has one (a coalesced tail's: at most 64 rows before its end), else at its
  last multiple of 64 rows before its end (the state there goes to the padding slot). Wave 0 holds its rows
  ``[0, e)`` and ``64 M + 1 - e`` padding rows: ``M + 1`` chunks for any ``e`` in ``[1, 64 M]``. Wave 1 holds its
  last ``L - e`` rows (1 to 64) and ``65 - (L - e)`` padding rows: two chunks.

Every other host value a launch depends on is fixed by the shape ``(M, QSA blocks)``
(``forward_batch.FixedShape``): multi-row segments launch for ``B`` rows, page tables have ``max_pages`` columns
(the decode graphs' bound), QSA layers score a power of two of blocks (at least 64) and pool a fixed count of
completed blocks (the list padded with repeats of a padding block).

Every array of the forward's metadata lives in one upload buffer per shape, which the graph reads; the
``ForwardBatch`` is derived from it inside the graph (``forward_batch.assemble_forward_batch``). End-of-segment
checkpoint copies and sampling run after the replay, as after an eager forward. Without ``capture`` (the CPU)
the same padded forward runs eagerly, which is how CPU tests check it against the eager path. Prompts of one
row, of more than ``64 * max(SIZES) + 64`` rows, with more than one internal checkpoint or with a checkpoint
more than 64 rows before their end run eagerly.
"""

from __future__ import annotations

import logging
import time

import torch

from ..kernels.backend import next_pow2
from ..kernels.gdn_varlen import fla_cache_off
from .cuda_graph import block_bucket, block_buckets
from .forward_batch import (
    GDN_CHUNK,
    FixedShape,
    ForwardPlan,
    Segment,
    assemble_forward_batch,
    note_ngram_contexts,
    plan_forward_batch,
)
from .layers.attention import QSA_TRITON_MAX_BLOCKS
from .upload import Ref

logger = logging.getLogger(__name__)

# M of the captured shapes: prompts of up to 64 M + 64 rows (M = 0: up to 64 without an internal checkpoint).
SIZES = (0, 1, 2, 4, 8, 16, 32, 64, 128)


def rows_of(m: int) -> int:
    """Rows of a captured forward of size ``m``."""
    return GDN_CHUNK * m + GDN_CHUNK + 2


def sizes_for(max_tokens: int) -> tuple[int, ...]:
    """The sizes of :data:`SIZES` that prompt chunks of up to ``max_tokens`` rows take: each up to the first
    that holds ``max_tokens``."""
    out = []
    for m in SIZES:
        out.append(m)
        if GDN_CHUNK * m + GDN_CHUNK >= max_tokens:
            break
    return tuple(out)


def signature(plan: ForwardPlan) -> tuple:
    """Every host value a recorded forward of ``plan`` depends on: its arrays' types and shapes (their offsets in
    the upload buffer follow), its groups' row and segment counts, and its QSA block count."""
    hosts = tuple(tuple(v for k, v in g.items() if isinstance(v, int) and not isinstance(v, Ref)) for g in plan.groups)
    return plan.up.layout(), hosts, len(plan.waves), plan.qsa[1] if plan.qsa is not None else 0


class PrefillGraphs:
    def __init__(self, model, config, kv, states, device: torch.device, max_pages: int, pad_slot: int,
                 pad_page: int, capture: bool, sizes: tuple[int, ...] = SIZES):
        self.model, self.kv, self.states = model, kv, states
        self.num_layers = len(model.model.layers)
        self.device = torch.device(device)
        self.capture = capture
        self.sizes = sizes
        self.max_pages = max_pages
        self.page_size = kv.page_size
        self.pad_slot, self.pad_page = pad_slot, pad_page
        self.ratio = config.qsa_ratio
        self.ngram_eos = config.ngram_eos_id
        # The last row's logits of every replay (one buffer all graphs share).
        self.logits = torch.empty(1, config.vocab_size, dtype=model.lm_head.weight.dtype, device=self.device)
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._buffers: dict[tuple[int, int], torch.Tensor] = {}
        self._layouts: dict[tuple[int, int], tuple] = {}
        self._pool = None
        self.replays = 0  # prompt forwards run through the fixed-shape path
        self.captures = 0

    # -- eligibility and shapes ------------------------------------------------------------------

    def split(self, length: int, exports: list[tuple[int, int]]) -> tuple[int, int] | None:
        """Where a prompt segment of ``length`` rows splits and where its state there goes, ``(e, slot)``
        (``(0, -1)``: it does not split); ``None`` when no captured shape takes it."""
        internal = [(o, d) for o, d in exports if 0 < o < length]
        if len(internal) > 1 or length < 2:
            return None
        if internal:
            e, dst = internal[0]
        elif length <= GDN_CHUNK:
            return (0, -1) if 0 in self.sizes else None
        else:
            e, dst = (length - 1) // GDN_CHUNK * GDN_CHUNK, self.pad_slot
        if length - e > GDN_CHUNK or e > GDN_CHUNK * self.sizes[-1]:
            return None
        return e, dst

    def key(self, start: int, length: int, exports: list[tuple[int, int]], pages: int) -> tuple[int, int] | None:
        """The shape ``(M, QSA blocks)`` of a prompt segment, or ``None`` when it runs eagerly."""
        cut = self.split(length, exports)
        if cut is None or pages > self.max_pages or start + length > self.max_pages * self.page_size:
            return None
        m = 0 if cut[0] == 0 else next(m for m in self.sizes if m and GDN_CHUNK * m >= cut[0])
        if not self.ratio:
            return m, 0
        blocks = block_bucket(next_pow2(max(1, (start + length) // self.ratio)), self._cap())
        if blocks > QSA_TRITON_MAX_BLOCKS or (start + length) // self.ratio > blocks:
            return None
        return m, blocks

    def _cap(self) -> int:
        return self.max_pages * self.page_size // self.ratio

    def shapes(self) -> list[tuple[int, int]]:
        """Every shape a prompt forward can take: each size with each QSA block bucket a graph serves."""
        if not self.ratio:
            return [(m, 0) for m in self.sizes]
        buckets = [b for b in block_buckets(self._cap()) if b <= QSA_TRITON_MAX_BLOCKS]
        return [(m, blocks) for m in self.sizes for blocks in buckets]

    def fixed(self, key: tuple[int, int]) -> FixedShape:
        m, blocks = key
        rows = rows_of(m)
        return FixedShape(max_seqlen=rows, page_columns=self.max_pages, qsa_blocks=blocks,
                          qsa_new=rows // self.ratio + 2 if self.ratio else 0)

    # -- the forward -------------------------------------------------------------------------------

    def run(self, slot: int, start: int, token_ids: list[int], pages: list[int],
            exports: list[tuple[int, int]], rope_shift: int = 0) -> torch.Tensor | None:
        """Logits ``[1, vocab]`` (the model's dtype) of the last row of a prompt segment run from its graph, its
        states and n-gram context written as an eager forward writes them (internal checkpoint included; the
        caller copies end-of-segment ones); ``None`` when no captured shape takes it. ``rope_shift``: what the
        request's images add to the rotary positions of this text (``Segment.rope_shift``)."""
        key = self.key(start, len(token_ids), exports, len(pages))
        if key is None:
            return None
        plan, last = self._plan(key, slot, start, token_ids, pages, exports, rope_shift)
        if self.capture:
            self.prepare(key)
            if signature(plan) != self._layouts[key]:
                raise RuntimeError(f"a prompt forward of shape {key} does not match its graph's metadata layout")
            plan.up.send(self.device, into=self._buffers[key])
            self._graphs[key].replay()
        else:
            self._step(plan, plan.up.send(self.device), last)
        self.replays += 1
        return self.logits

    def prepare(self, key: tuple[int, int]) -> None:
        """Capture the graph of shape ``key`` unless it is captured already."""
        if key in self._graphs:
            return
        layers = len(self.model.model.layers)
        if layers != self.num_layers:
            raise RuntimeError(f"a prompt graph captured over {layers} of the model's {self.num_layers} layers "
                               "would replay only those")
        plan, last = self.capture_plan(key)
        self._layouts[key] = signature(plan)
        self._buffers[key] = torch.zeros(plan.up.nbytes(), dtype=torch.uint8, device=self.device)
        views = plan.up.send(self.device, into=self._buffers[key])
        self._graphs[key] = self._record(key, plan, views, last)
        self.captures += 1

    def capture_plan(self, key: tuple[int, int]) -> tuple[ForwardPlan, int]:
        """The forward a graph of shape ``key`` is recorded over: a prompt on the padding slot and page (it touches
        only padding), as short as the shape allows; any prompt the shape takes gives the same :func:`signature`."""
        length = GDN_CHUNK + (1 if key[0] else 0)
        pages = [self.pad_page] * -(-length // self.page_size)
        return self._plan(key, self.pad_slot, 0, [0] * length, pages, [])

    def _plan(self, key, slot, start, token_ids, pages, exports, rope_shift: int = 0) -> tuple[ForwardPlan, int]:
        length = len(token_ids)
        e, dst = self.split(length, exports)
        m, _ = key
        pad = rows_of(m) - length
        head = GDN_CHUNK * m + 1 - e  # the padding rows of wave 0
        segments = [Segment(slot=slot, start=start, length=length, row0=0, pages=list(pages),
                            exports=[(e, dst)] if m else [], rope_shift=rope_shift),
                    Segment(slot=self.pad_slot, start=0, length=pad, row0=length,
                            pages=[self.pad_page] * -(-pad // self.page_size),
                            exports=[(head, self.pad_slot)] if m else [])]
        plan = plan_forward_batch(segments, list(token_ids) + [0] * pad, True, self.ratio, self.fixed(key))
        last = plan.up.add([length - 1])
        return plan, last

    def _step(self, plan: ForwardPlan, views: list[torch.Tensor], last) -> None:
        fb = assemble_forward_batch(plan, views, self.kv, self.states, self.ngram_eos, graph=True)
        streams, pending = self.model(fb)
        note_ngram_contexts(fb)
        self.model.logits(streams, pending, views[last], into=self.logits)

    def _record(self, key, plan: ForwardPlan, views: list[torch.Tensor], last) -> torch.cuda.CUDAGraph:
        t0 = time.perf_counter()
        torch.cuda.synchronize(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        # flash-linear-attention memoises index tensors by the identity of their inputs: with the cache on, the
        # capture would take the warm-up's values instead of recording their computation.
        with fla_cache_off():
            with torch.cuda.stream(side):  # compile and autotune kernels, fill lazy caches
                self._step(plan, views, last)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                self._step(plan, views, last)
        self._pool = graph.pool()
        logger.info("captured the prompt graph for %d rows, %d QSA blocks in %.0f ms", rows_of(key[0]), key[1],
                    (time.perf_counter() - t0) * 1e3)
        return graph
