"""Decode forwards replayed from CUDA graphs.

A decode step of the ``bench`` model is several hundred kernel launches; issued one by one from
Python it takes 15-40 ms. :class:`DecodeGraphs` records the whole step once per shape and replays it
with one launch. A decode batch (every segment one token; the runner sends generated-token decodes
only, see ``ForwardBatch.decode_only``) is padded to a captured batch size, and the QSA layers' block
count to a power of two, so that every tensor shape is fixed:

* the per-row inputs (token id, position, slot, fresh, rotary shift) live in one persistent device buffer,
  filled with one host-to-device copy per step; a token id of -1 reads the slot's entry of :attr:`last_ids`,
  the token its previous step sampled on the device (a step launched before that one's ids reached
  the host); the rotary shift is what a request's images add to the positions of the text after them (the
  same on all three axes there, so the row turns as one position), 0 without images;
* page tables live on the device per state slot (:attr:`slot_pages`), updated with the page deltas
  the scheduler sends, and gathered per row inside the graph;
* everything else a forward needs (KV write rows, n-gram contexts, QSA block keys and the blocks a
  step completes) is derived from those inside the graph, as ``build_forward_batch`` derives it on
  the host for an eager forward;
* padding rows use a slot and a KV page that the scheduler never hands out (the pools hold one of
  each beyond its count), so they write nothing that a request reads.

On the GPU the per-row tensors come from one kernel (``kernels/decode_prep_triton``) instead of the
torch ops that spell them out. The graph ends with the logits of every row in the model's dtype, written
by the vocabulary projection into one buffer all graphs share, and each row's arg-max of them
(:attr:`greedy`, also left in the slot's :attr:`last_ids`; ``kernels/greedy_triton`` on the GPU): a batch
that samples plainly greedily takes those ids. Other sampling (on the logits in fp32) and the
end-of-segment checkpoint copies run after the replay as for an eager forward. Graphs are captured when
a shape is first met (the warm-up before ready meets every one, :meth:`shapes`) and share one memory
pool. Without ``capture`` (the CPU) the same padded step runs
eagerly, which is how CPU tests check it against the eager path.
"""

from __future__ import annotations

import logging
import time

import torch

from ..kernels.backend import next_pow2, use_triton
from .forward_batch import ForwardBatch, QSABlocks, RowGroup
from .upload import device_ints

logger = logging.getLogger(__name__)

# Padded batch sizes, up to --max-running-requests (always captured as the last size).
BATCH_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
# The smallest QSA block count a graph is captured for (64 blocks of 64 keys: a 4K context).
MIN_BLOCKS = 64


def block_bucket(blocks: int, cap: int) -> int:
    """The QSA block count a graph is captured for that holds ``blocks`` (a power of two): at least
    :data:`MIN_BLOCKS`, at most ``cap`` (the blocks of the longest context a graph serves)."""
    return max(1, min(max(MIN_BLOCKS, blocks), cap))


def block_buckets(cap: int) -> list[int]:
    """Every :func:`block_bucket` up to ``cap``, ascending."""
    return sorted({block_bucket(1 << i, cap) for i in range(max(cap, 1).bit_length() + 1)})


class DecodeGraphs:
    def __init__(self, model, config, kv, states, device: torch.device, max_batch: int, max_pages: int,
                 pad_slot: int, pad_page: int, capture: bool):
        self.model, self.kv, self.states = model, kv, states
        self.num_layers = len(model.model.layers)
        self.device = device
        self.capture = capture
        self.max_batch = max_batch
        self.sizes = [b for b in BATCH_SIZES if b < max_batch] + [max_batch]
        self.page_size = kv.page_size
        self.max_pages = max_pages
        self.pad_slot, self.pad_page = pad_slot, pad_page
        self.ratio = config.qsa_ratio
        self.ngram_eos = config.ngram_eos_id
        self.rotary = model.model.rotary if config.attention_layers else None
        long = dict(dtype=torch.long, device=device)
        # Rows: token id, position, slot, fresh, rotary shift. Host side pinned on CUDA (one async copy per step).
        self.inputs = torch.zeros(5, max_batch, **long)
        self.host = torch.zeros(5, max_batch, dtype=torch.long, pin_memory=device.type == "cuda")
        self.copied = torch.cuda.Event() if device.type == "cuda" else None
        # Per slot, the token its latest graph step sampled: a step launched before that one is finished
        # carries -1 for it (see ``ModelRunner.launch``) and reads it here.
        self.last_ids = torch.zeros(states.num_slots, **long)
        self.slot_pages = torch.full((states.num_slots, max_pages), pad_page, dtype=torch.int32, device=device)
        self.wide: set[int] = set()  # slots whose page table outgrew ``max_pages`` (eager forwards only)
        self._pending: dict[tuple[int, int], int] = {}  # (slot, column) -> page, not yet on the device
        self._cu = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        self._rows = torch.arange(max_batch, **long)
        self._ones = torch.ones(max_batch, **long)
        self._empty = torch.empty(0, **long)
        # Every graph writes its logits here, so captures share one output (the rest of their memory
        # is the pool's, reused from one graph to the next).
        self.logits = torch.empty(max_batch, config.vocab_size, dtype=model.lm_head.weight.dtype, device=device)
        # Every row's arg-max of those logits (also written to its slot's ``last_ids``): the tokens of a
        # batch that samples plainly greedily, taken as they are (``Sampler.plain_greedy``).
        self.greedy = torch.zeros(max_batch, **long)
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._pool = None
        self.steps = 0  # decode steps run through the fixed-shape path
        self.captures = 0  # graphs captured

    # -- page tables ---------------------------------------------------------------------------

    def pages(self, slot: int, base: int, pages: list[int]) -> None:
        """Slot ``slot``'s page table from column ``base`` on is ``pages`` (as the scheduler sent it)."""
        if base == 0:
            self.wide.discard(slot)
        if base + len(pages) > self.max_pages:
            self.wide.add(slot)
            return
        for j, page in enumerate(pages):  # the latest write of a (slot, column) wins: one index each
            self._pending[slot, base + j] = page

    def flush_pages(self) -> None:
        """Write the page-table changes noted since the last flush to the device table."""
        if not self._pending:
            return
        writes = device_ints([(s, c, p) for (s, c), p in self._pending.items()], self.device).T
        self.slot_pages[writes[0], writes[1]] = writes[2].to(torch.int32)
        self._pending.clear()

    # -- eligibility and shapes ------------------------------------------------------------------

    def fits(self, slots: list[int], positions: list[int], tables: list[tuple[int, int]] | None = None) -> bool:
        """A decode batch of these rows can run from a graph; ``tables``: each row's page-table delta not yet
        applied (``page_base``, number of pages), as :meth:`pages` would take it."""
        def wide(i: int, slot: int) -> bool:
            if tables is None:
                return slot in self.wide
            base, count = tables[i]
            return base + count > self.max_pages or (base > 0 and slot in self.wide)

        return (0 < len(slots) <= self.max_batch and not any(wide(i, s) for i, s in enumerate(slots))
                and max(positions) < self.max_pages * self.page_size)

    def _shape(self, positions: list[int]) -> tuple[int, int]:
        size = next(b for b in self.sizes if b >= len(positions))
        if not self.ratio:
            return size, 0
        return size, block_bucket(next_pow2(max(p + 1 for p in positions) // self.ratio), self._cap())

    def _cap(self) -> int:
        return self.max_pages * self.page_size // self.ratio

    def shapes(self) -> list[tuple[int, int]]:
        """Every shape ``(rows, QSA blocks)`` a step can take: each padded batch size with each QSA block
        bucket up to the longest context a graph serves."""
        if not self.ratio:
            return [(size, 0) for size in self.sizes]
        return [(size, blocks) for size in self.sizes for blocks in block_buckets(self._cap())]

    # -- the step ----------------------------------------------------------------------------------

    def run(self, ids: list[int], positions: list[int], slots: list[int], shifts: list[int]) -> torch.Tensor:
        """Logits ``[len(ids), vocab]`` in the model's dtype of one decode row per request (rows in the given
        order); ``shifts``: each row's rotary shift."""
        n = len(ids)
        self.flush_pages()
        size, blocks = self.ensure(positions)
        self._fill(ids, positions, slots, shifts)
        self.steps += 1
        if self.capture:
            self._graphs[size, blocks].replay()
        else:
            self._step(size, blocks)
        return self.logits[:n]

    def ensure(self, positions: list[int]) -> tuple[int, int]:
        """The shape ``(rows, QSA blocks)`` of a step of rows at ``positions``, its graph captured now unless
        it is already (a benchmark also calls this for the shapes its timed steps will meet, so that none
        is captured while it times)."""
        key = self._shape(positions)
        if self.capture:
            self.prepare(key)
        return key

    def prepare(self, key: tuple[int, int]) -> None:
        """Capture the graph of shape ``key`` unless it is captured already."""
        if key not in self._graphs:
            layers = len(self.model.model.layers)
            if layers != self.num_layers:
                raise RuntimeError(f"a decode graph captured over {layers} of the model's {self.num_layers} layers "
                                   "would replay only those")
            self._fill([], [], [], [])  # warm-up and capture touch only the padding slot and page
            self._graphs[key] = self._record(*key)
            self.captures += 1

    def replay_seconds(self, positions: list[int], times: int) -> float:
        """Seconds a step of this shape takes on the device alone: its graph (captured already) replayed
        ``times`` times back to back on the inputs of the last step, timed with CUDA events. Each replay
        runs that step again (it rewrites the same KV rows and moves the rows' states on): a benchmark's
        measure, for requests that end after it."""
        graph = self._graphs[self._shape(positions)]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(times):
            graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / times

    def _fill(self, ids: list[int], positions: list[int], slots: list[int], shifts: list[int]) -> None:
        pad = self.max_batch - len(ids)
        if self.copied is not None:
            self.copied.synchronize()  # the previous step's copy has read the host buffer
        self.host.copy_(torch.tensor([ids + [0] * pad, positions + [0] * pad, slots + [self.pad_slot] * pad,
                                      [int(p == 0) for p in positions] + [1] * pad, shifts + [0] * pad],
                                     dtype=torch.long))
        self.inputs.copy_(self.host, non_blocking=True)
        if self.copied is not None:
            self.copied.record()

    def _record(self, size: int, blocks: int) -> torch.cuda.CUDAGraph:
        t0 = time.perf_counter()
        torch.cuda.synchronize(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # compile and autotune kernels, fill lazy caches
            self._step(size, blocks)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._step(size, blocks)
        self._pool = graph.pool()
        logger.info("captured the decode graph for %d rows, %d QSA blocks in %.0f ms", size, blocks,
                    (time.perf_counter() - t0) * 1e3)
        return graph

    def _step(self, size: int, blocks: int) -> None:
        fb = self._forward_batch(size, blocks)
        streams, pending = self.model(fb)
        self.model.logits(streams, pending, None, into=self.logits[:size])
        slots = self.inputs[2, :size]
        if use_triton(self.logits, "greedy"):
            from ..kernels.greedy_triton import greedy_ids

            greedy_ids(self.logits[:size], slots, self.last_ids, self.greedy[:size])
        else:
            ids = torch.argmax(self.logits[:size], dim=-1)
            self.greedy[:size] = ids
            self.last_ids[slots] = ids

    def _forward_batch(self, b: int, blocks: int) -> ForwardBatch:
        """The ``ForwardBatch`` of ``b`` one-token segments, every tensor derived from the input buffer
        on the device (``build_forward_batch`` for this case, with no host values). The slots' n-gram
        contexts move on by the rows' tokens here (the forward reads the contexts before them)."""
        if use_triton(self.inputs, "decode_prep"):
            return self._forward_batch_triton(b, blocks)
        positions, slots = self.inputs[1, :b], self.inputs[2, :b]
        ids = torch.where(self.inputs[0, :b] < 0, self.last_ids[slots], self.inputs[0, :b])
        fresh = self.inputs[3, :b].bool()
        ps = self.page_size
        page_table = self.slot_pages[slots]  # [b, max_pages] int32

        def rows_of(pos: torch.Tensor) -> torch.Tensor:  # KV rows of positions [b, k]
            return page_table.gather(1, pos // ps).long() * ps + pos % ps

        kv_write_rows = rows_of(positions[:, None])[:, 0]
        shift = self.inputs[4, :b]
        width = self.states.ngram_context.shape[1]
        ctx = self.states.ngram_context[slots]
        ngram_context = torch.where(fresh[:, None], torch.full_like(ctx, self.ngram_eos), ctx) if width else ctx
        if width:
            self.states.ngram_context[slots] = torch.cat([ngram_context[:, 1:], ids[:, None]], dim=1)
        qsa = None
        if self.ratio:
            r = self.ratio
            # The block ending at this row's token (meaningful when the token completes it; otherwise
            # the pooled key lands on the token's own row, where no block key is ever read).
            first = positions - (r - 1)
            block_pos = (first[:, None] + torch.arange(r, device=self.device)).clamp(min=0)
            last = (torch.arange(blocks, device=self.device) + 1) * r - 1
            cols = (last // ps).clamp(max=self.max_pages - 1)
            qsa = QSABlocks(ratio=r, new_rows=rows_of(block_pos), new_pos=first.clamp(min=0) + shift,
                            key_rows=page_table[:, cols].long() * ps + last % ps, max_blocks=blocks)
        return self._assemble(b, ids, positions, slots, fresh, page_table, kv_write_rows, (positions + 1).int(),
                              ngram_context, qsa, rope_positions=positions + shift)

    def _forward_batch_triton(self, b: int, blocks: int) -> ForwardBatch:
        """``_forward_batch``'s tensors from one kernel (``kernels/decode_prep_triton``)."""
        from ..kernels.decode_prep_triton import decode_prep

        p = decode_prep(self.inputs[:, :b], self.last_ids, self.slot_pages, self.page_size, self.states.ngram_context,
                        self.ngram_eos, self.rotary.inv_freq(self.device) if self.rotary else None,
                        self.model.model.embed_tokens.weight.dtype, self.ratio, blocks)
        qsa = None
        if self.ratio:
            qsa = QSABlocks(ratio=self.ratio, new_rows=p["new_rows"], new_pos=p["new_pos"], key_rows=p["key_rows"],
                            max_blocks=blocks)
        return self._assemble(b, p["ids"], self.inputs[1, :b], self.inputs[2, :b], p["fresh"], p["page_table"],
                              p["kv_rows"], p["kv_lens"], p["ngram_context"], qsa,
                              rope=(p["cos"], p["sin"]) if self.rotary else None)

    def _assemble(self, b: int, ids, positions, slots, fresh, page_table, kv_write_rows, kv_lens, ngram_context,
                  qsa, rope=None, rope_positions=None) -> ForwardBatch:
        group = RowGroup(row0=0, seg0=0, num_rows=b, num_segments=b, max_seqlen=1, cu_seqlens=self._cu[:b + 1],
                         lengths=self._ones[:b], slots=slots, fresh=fresh, kv_lens=kv_lens, page_table=page_table)
        none = RowGroup(row0=b, seg0=b, num_rows=0, num_segments=0, max_seqlen=0, cu_seqlens=self._cu[:1],
                        lengths=self._empty, slots=self._empty, fresh=self._empty.bool(),
                        kv_lens=self._cu[:0], page_table=page_table[:0])
        return ForwardBatch(
            input_ids=ids, positions=positions, segments=[], kv=self.kv, states=self.states,
            all=group, decode=group, prefill=none, kv_write_rows=kv_write_rows, row_segment=self._rows[:b],
            ngram_context=ngram_context, export_seg=self._empty, export_off=self._empty, export_dst=self._empty,
            waves=[], qsa=qsa, decode_only=True, rope=rope, rope_positions=rope_positions,
        )
