"""What one forward pass needs to know about its rows, built once per ``Batch``.

The runner turns a ``Batch`` into a :class:`ForwardBatch`: the flat rows of every segment plus
device tensors describing them (lengths, offsets, slots, page tables, checkpoint exports). Layers
read only these tensors — they never loop over segments and never ask the device for a value, so a
step is a fixed sequence of kernel launches. The host-side facts a launch needs (row counts, the
longest segment) are plain ints computed here from the message, which costs no device sync.

Row order: the runner puts single-token segments (decodes) first, then multi-token ones (prefill
chunks), so GDN and attention can hand the two groups to different kernels as two contiguous row
ranges: ``rows [0, num_decode_rows)`` and ``rows [num_decode_rows, T)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from .images import RequestImages
from .memory import KVPool, StatePool
from .upload import Ref, Upload

# Rows per chunk of the chunked GDN kernel (the chunk index it is handed is built here, once a batch).
GDN_CHUNK = 64


@dataclass
class Segment:
    """A contiguous run of one request's tokens inside the flat batch (host-side description).

    ``exports`` lists ``(offset, dst_slot)``: after the segment's first ``offset`` tokens
    (``0 < offset <= length``), the request's complete state is written to ``dst_slot``. An offset
    inside the segment splits the recurrence there; it never recomputes tokens.
    """

    slot: int
    start: int
    length: int
    row0: int
    pages: list[int] = field(default_factory=list)
    exports: list[tuple[int, int]] = field(default_factory=list)
    images: RequestImages | None = None  # the request's images (3-D positions, vision features)
    # In a fixed-shape forward: what the request's images add to the rotary positions of this text segment
    # (every row and completed QSA block past the images turns with its position plus this, on all three axes).
    rope_shift: int = 0

    @property
    def fresh(self) -> bool:
        """Starts at position 0: the state before it is the zero state, whatever the slot holds."""
        return self.start == 0

    @property
    def end(self) -> int:
        return self.start + self.length

    def split_points(self) -> list[int]:
        """Sorted internal offsets where the recurrence must be split for an export."""
        return sorted({off for off, _ in self.exports if 0 < off < self.length})


@dataclass
class RowGroup:
    """Device description of a contiguous range of segments (all rows, decodes, or prefills).

    ``cu_seqlens`` is relative to the group's first row ``row0``; ``index`` selects the group's
    segments from the batch-wide per-segment tensors.
    """

    row0: int
    seg0: int  # index of the group's first segment in the batch
    num_rows: int
    num_segments: int
    max_seqlen: int
    cu_seqlens: torch.Tensor  # int32 [n + 1]
    lengths: torch.Tensor  # long [n]
    slots: torch.Tensor  # long [n]
    fresh: torch.Tensor  # bool [n]
    kv_lens: torch.Tensor  # int32 [n]: start + length
    page_table: torch.Tensor | None  # int32 [n, max_pages]

    @property
    def rows(self) -> slice:
        return slice(self.row0, self.row0 + self.num_rows)


@dataclass
class Wave:
    """One pass of a recurrence that is split at internal exports.

    A segment with exports at internal offsets ``o1 < o2 < ...`` runs as pieces ``[0, o1)``,
    ``[o1, o2)``, ...; wave ``w`` holds the ``w``-th piece of every prefill segment that has one.
    ``rows`` index the prefill group's rows (``None``: all of them, in order — the usual case of a
    batch without internal exports); ``seg`` are the pieces' segment indices within the prefill
    group. A piece's initial state is its segment's slot state (first piece) or the previous
    piece's final state; ``export_piece``/``export_dst`` say which pieces' final states are also
    checkpoints and where they go.
    """

    rows: torch.Tensor | None  # long [rows]
    cu_seqlens: torch.Tensor  # long [n + 1] (the GDN kernel's index type)
    cu_host: list[int]
    chunk_indices: torch.Tensor  # long [chunks, 2]: (piece, chunk within the piece) of every 64-row chunk
    seg: torch.Tensor  # long [n]
    export_piece: torch.Tensor  # long [m]
    export_dst: torch.Tensor  # long [m]


@dataclass
class QSABlocks:
    """Where the QSA layers find and put pooled block keys for this forward.

    A block of ``ratio`` keys gets its pooled key when its last token is written; the key is stored
    at that token's KV row (in ``KVPool.index_block_k``), so it lives in the page that completes the
    block and is shared through the prefix cache exactly like that page.
    """

    ratio: int
    # Blocks completed by this forward: the KV rows of their tokens, and their first position.
    new_rows: torch.Tensor  # long [Mb, ratio]
    new_pos: torch.Tensor  # long [Mb]
    # Per segment, the KV row holding block b's key (clamped past the segment's blocks).
    key_rows: torch.Tensor  # long [N, max_blocks]
    max_blocks: int
    # With images in the batch: the 3-D rotary positions of those first positions (``[3, Mb]``).
    new_pos3: torch.Tensor | None = None


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    segments: list[Segment]
    kv: KVPool | None
    states: StatePool
    all: RowGroup
    decode: RowGroup
    prefill: RowGroup
    kv_write_rows: torch.Tensor | None  # long [T]: flat KV-cache row of each token
    row_segment: torch.Tensor  # long [T]: segment index of each row
    # The n-gram context before each segment's first token (``[N, ngram_size - 1]`` ids), for PLE.
    ngram_context: torch.Tensor
    # Internal exports (0 < offset < length), flattened: segment index, offset, destination slot.
    export_seg: torch.Tensor  # long [M]
    export_off: torch.Tensor  # long [M]
    export_dst: torch.Tensor  # long [M]
    waves: list[Wave]
    qsa: QSABlocks | None = None
    # Rotary cos and sin of ``positions`` in the model's dtype, set by the model's forward for all its
    # attention layers (a layer run on its own computes them).
    rope: tuple[torch.Tensor, torch.Tensor] | None = None
    # With images in the batch: every row's (frame, row, column) rotary positions ``[3, T]``, the rows
    # that take vision features instead of token embeddings, and those features.
    rope_positions: torch.Tensor | None = None
    vision_rows: torch.Tensor | None = None
    vision_embeds: torch.Tensor | None = None
    # Every row is a decode of a generated token (no prompt row, however short its chunk): such a forward
    # may run the MoE's decode kernels, which round differently from the path every prompt row takes.
    decode_only: bool = False
    # PLE layer index -> the rows of this batch's tokens in that layer's table, ``[T, dim]`` on the device,
    # gathered ahead of the forward (layer-major prefill with a pinned table: ``RowsAhead``).
    ple_rows: dict[int, Callable[[], torch.Tensor]] = field(default_factory=dict)
    # Recorded in a CUDA graph: nothing reads a device value back to the host (a pinned PLE table's rows are
    # read by the device itself).
    graph: bool = False

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_exports(self) -> int:
        return int(self.export_seg.shape[0])


def _cu(lengths: np.ndarray) -> np.ndarray:
    cu = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=cu[1:])
    return cu


def _page_table(segs: list[Segment], columns: int = 0) -> np.ndarray:
    table = np.zeros((len(segs), max([len(s.pages) for s in segs] + [1, columns])), dtype=np.int32)
    for i, s in enumerate(segs):
        table[i, :len(s.pages)] = s.pages
    return table


def _group(up: Upload, segs: list[Segment], seg0: int, row0: int, with_pages: bool,
           fixed: FixedShape | None = None) -> dict:
    """A :class:`RowGroup`'s fields, its arrays as references into ``up`` (see :func:`_resolved`)."""
    lengths = np.array([s.length for s in segs], dtype=np.int64)
    cu = _cu(lengths)
    longest = int(lengths.max(initial=0))
    if fixed is not None and longest > 1:
        longest = max(longest, fixed.max_seqlen)
    return dict(row0=row0, seg0=seg0, num_rows=int(cu[-1]), num_segments=len(segs),
                max_seqlen=longest, cu_seqlens=up.add(cu, np.int32), lengths=up.add(lengths),
                slots=up.add([s.slot for s in segs]), fresh=up.add([s.fresh for s in segs], np.bool_),
                kv_lens=up.add([s.end for s in segs], np.int32),
                page_table=up.add(_page_table(segs, fixed.page_columns if fixed else 0), np.int32)
                if with_pages else None)


def _resolved(fields: dict, views: list[torch.Tensor]) -> dict:
    """``fields`` with every :class:`~tidal.executor.upload.Ref` replaced by its device view."""
    return {k: views[v] if isinstance(v, Ref) else v for k, v in fields.items()}


def _waves(up: Upload, prefill: list[Segment]) -> list[dict]:
    """Each :class:`Wave`'s fields, its arrays as references into ``up``."""
    pieces = [[0, *seg.split_points(), seg.length] for seg in prefill]
    count = max((len(p) - 1 for p in pieces), default=0)
    base = prefill[0].row0 if prefill else 0
    waves = []
    for w in range(count):
        rows: list[np.ndarray] = []
        lengths, seg_list, export_piece, export_dst = [], [], [], []
        for i, (seg, bounds) in enumerate(zip(prefill, pieces, strict=True)):
            if w + 1 >= len(bounds):
                continue
            lo, hi = bounds[w], bounds[w + 1]
            if count > 1:
                rows.append(np.arange(seg.row0 - base + lo, seg.row0 - base + hi))
            lengths.append(hi - lo)
            if hi < seg.length:
                for off, dst in seg.exports:
                    if off == hi:
                        export_piece.append(len(seg_list))
                        export_dst.append(dst)
            seg_list.append(i)
        cu = _cu(np.array(lengths, dtype=np.int64))
        chunks = -(-np.diff(cu) // GDN_CHUNK)  # 64-row chunks of each piece
        piece = np.repeat(np.arange(len(lengths)), chunks)
        within = np.arange(int(chunks.sum())) - np.repeat(_cu(chunks)[:-1], chunks)
        waves.append(dict(
            rows=up.add(np.concatenate(rows)) if count > 1 else None, cu_seqlens=up.add(cu), cu_host=cu.tolist(),
            chunk_indices=up.add(np.stack([piece, within], axis=1).reshape(-1, 2)), seg=up.add(seg_list),
            export_piece=up.add(export_piece), export_dst=up.add(export_dst)))
    return waves


def _qsa_host(up: Upload, segments: list[Segment], ratio: int, fixed: FixedShape | None = None) -> tuple[Ref, int]:
    """The segment and block of every block this forward completes (``[Mb, 2]`` in ``up``), and the
    most blocks of any segment (``fixed``: its counts, the list padded with repeats of the last segment's
    first block, which the last segment rewrites alike; a padding segment may complete more blocks than its rows
    then score)."""
    first = np.array([s.start // ratio for s in segments], dtype=np.int64)
    counts = np.array([s.end // ratio for s in segments], dtype=np.int64) - first
    seg = np.repeat(np.arange(len(segments)), counts)
    block = np.arange(int(counts.sum())) - np.repeat(_cu(counts)[:-1], counts) + np.repeat(first, counts)
    most = max(s.end // ratio for s in segments)
    if fixed is not None:
        if len(seg) > fixed.qsa_new:
            raise ValueError(f"{len(seg)} new QSA blocks exceed the fixed shape's {fixed.qsa_new}")
        pad = fixed.qsa_new - len(seg)
        seg = np.concatenate([seg, np.full(pad, len(segments) - 1)])
        block = np.concatenate([block, np.full(pad, first[-1])])
        most = fixed.qsa_blocks
    return up.add(np.stack([seg, block], axis=1).reshape(-1, 2)), most


def _qsa_blocks(new: torch.Tensor, max_blocks: int, page_table: torch.Tensor, page_size: int,
                ratio: int) -> QSABlocks:
    device = page_table.device
    pos = new[:, 1:] * ratio + torch.arange(ratio, device=device)
    new_rows = page_table[new[:, :1], pos // page_size].long() * page_size + pos % page_size
    last = (torch.arange(max_blocks, device=device) + 1) * ratio - 1
    page_index = (last // page_size).clamp(max=page_table.shape[1] - 1)
    key_rows = page_table[:, page_index].long() * page_size + last % page_size
    return QSABlocks(ratio=ratio, new_rows=new_rows, new_pos=pos[:, 0], key_rows=key_rows, max_blocks=max_blocks)


@dataclass(frozen=True)
class FixedShape:
    """Host values a forward captured in a CUDA graph holds fixed (see ``prefill_graph``), so that every
    batch of its layout launches the same kernels: multi-row groups launch for ``max_seqlen`` rows a segment,
    page tables have ``page_columns`` columns, QSA layers score ``qsa_blocks`` blocks a segment and pool
    ``qsa_new`` completed blocks."""

    max_seqlen: int
    page_columns: int
    qsa_blocks: int = 0
    qsa_new: int = 0


@dataclass
class ForwardPlan:
    """The host half of :func:`build_forward_batch`: every array in one :class:`Upload`, the rest as host
    values. :func:`assemble_forward_batch` derives the device half from the upload's views."""

    up: Upload
    segments: list[Segment]
    groups: list[dict]
    ids: Ref
    starts: Ref
    exports: Ref
    waves: list[dict]
    qsa: tuple[Ref, int] | None
    images: tuple | None
    qsa_ratio: int
    shifts: Ref | None = None  # fixed shapes: each segment's ``rope_shift``


def plan_forward_batch(segments: list[Segment], input_ids: list[int], with_pages: bool, qsa_ratio: int = 0,
                       fixed: FixedShape | None = None) -> ForwardPlan:
    """The arrays of :func:`build_forward_batch`, not yet on the device (``fixed``: see :class:`FixedShape`)."""
    num_decodes = sum(1 for s in segments if s.length == 1)
    assert all(s.length == 1 for s in segments[:num_decodes]), "decode segments must come first"
    up = Upload()
    groups = [_group(up, segments, 0, 0, with_pages, fixed),
              _group(up, segments[:num_decodes], 0, 0, with_pages, fixed),
              _group(up, segments[num_decodes:], num_decodes, num_decodes, with_pages, fixed)]
    ids_i = up.add(np.fromiter(input_ids, dtype=np.int64, count=len(input_ids)))
    starts_i = up.add([s.start for s in segments])
    exports = [(i, off, dst) for i, seg in enumerate(segments) for off, dst in seg.exports if off < seg.length]
    ex_i = up.add(np.array(exports, dtype=np.int64).reshape(-1, 3))
    waves = _waves(up, segments[num_decodes:])
    qsa_i = _qsa_host(up, segments, qsa_ratio, fixed) if with_pages and qsa_ratio else None
    mm = _images_host(up, segments, qsa_ratio if qsa_i is not None else 0)
    if fixed is not None and mm is not None:
        raise ValueError("a fixed-shape forward takes no vision rows: its segments' images turn by rope_shift")
    shifts_i = up.add([s.rope_shift for s in segments]) if fixed is not None else None
    return ForwardPlan(up=up, segments=segments, groups=groups, ids=ids_i, starts=starts_i, exports=ex_i, waves=waves,
                       qsa=qsa_i, images=mm, qsa_ratio=qsa_ratio, shifts=shifts_i)


def assemble_forward_batch(plan: ForwardPlan, views: list[torch.Tensor], kv: KVPool | None, states: StatePool,
                           ngram_eos: int, ngram_context: torch.Tensor | None = None, decode_only: bool = False,
                           ple_rows: dict[int, Callable[[], torch.Tensor]] | None = None,
                           graph: bool = False) -> ForwardBatch:
    """The :class:`ForwardBatch` of ``plan`` from its upload's device views: device work only, no host
    value read back (a CUDA graph may record it; ``graph``: one does)."""
    segments = plan.segments
    device = views[plan.ids].device
    page_size = kv.page_size if kv is not None else 1
    all_group, decode, prefill = (RowGroup(**_resolved(g, views)) for g in plan.groups)
    total = all_group.num_rows
    row_segment = torch.repeat_interleave(torch.arange(len(segments), device=device), all_group.lengths,
                                          output_size=total)
    offsets = all_group.cu_seqlens[:-1].long()
    positions = views[plan.starts][row_segment] + torch.arange(total, device=device) - offsets[row_segment]
    kv_write_rows = None
    if kv is not None:
        pages = all_group.page_table[row_segment, positions // page_size].long()
        kv_write_rows = pages * page_size + positions % page_size
    width = states.ngram_context.shape[1]
    if ngram_context is None and width:
        slots = all_group.slots
        ctx = states.ngram_context[slots]
        ngram_context = torch.where(all_group.fresh[:, None], torch.full_like(ctx, ngram_eos), ctx)
    elif ngram_context is None:
        ngram_context = torch.empty(len(segments), 0, dtype=torch.long, device=device)
    qsa = None
    if plan.qsa is not None:
        qsa = _qsa_blocks(views[plan.qsa[0]], plan.qsa[1], all_group.page_table, page_size, plan.qsa_ratio)
    vision = {}
    if plan.shifts is not None:
        shifts = views[plan.shifts]
        vision = dict(rope_positions=positions + shifts[row_segment])
        if qsa is not None:
            qsa = dataclasses.replace(qsa, new_pos=qsa.new_pos + shifts[views[plan.qsa[0]][:, 0]])
    if plan.images is not None:
        rope_i, rows_i, blocks_i, embeds = plan.images
        vision = dict(rope_positions=views[rope_i].view(3, -1), vision_rows=views[rows_i], vision_embeds=embeds)
        if qsa is not None:
            qsa = dataclasses.replace(qsa, new_pos3=views[blocks_i].view(3, -1))
    ex = views[plan.exports]
    return ForwardBatch(
        input_ids=views[plan.ids],
        positions=positions,
        segments=segments, kv=kv, states=states, all=all_group, decode=decode, prefill=prefill,
        kv_write_rows=kv_write_rows,
        row_segment=row_segment,
        ngram_context=ngram_context,
        export_seg=ex[:, 0], export_off=ex[:, 1], export_dst=ex[:, 2],
        waves=[Wave(**_resolved(w, views)) for w in plan.waves],
        qsa=qsa, decode_only=decode_only, ple_rows=ple_rows or {}, graph=graph, **vision,
    )


def note_ngram_contexts(fb: ForwardBatch) -> None:
    """After a forward: each segment's slot, and each internal export's, holds the n-gram context at its end."""
    states = fb.states
    width = states.ngram_context.shape[1]
    if not width:
        return
    device = fb.input_ids.device
    # History of segment i: its context (width ids) then its tokens; flat layout, one gather.
    n = len(fb.segments)
    starts = fb.all.cu_seqlens[:-1].long() + width * torch.arange(n, device=device)
    history = torch.empty(fb.num_tokens + n * width, dtype=torch.long, device=device)
    ctx_rows = starts[:, None] + torch.arange(width, device=device)
    history[ctx_rows.flatten()] = fb.ngram_context.flatten()
    tok_rows = fb.row_segment * width + torch.arange(fb.num_tokens, device=device)
    history[tok_rows + width] = fb.input_ids
    window = torch.arange(width, device=device)
    if fb.num_exports:
        at = starts[fb.export_seg] + fb.export_off
        states.ngram_context[fb.export_dst] = history[at[:, None] + window]
    ends = starts + fb.all.lengths
    states.ngram_context[fb.all.slots] = history[ends[:, None] + window]


def build_forward_batch(segments: list[Segment], input_ids: list[int], kv: KVPool | None, states: StatePool,
                        ngram_eos: int, device: torch.device, qsa_ratio: int = 0,
                        ngram_context: torch.Tensor | None = None, decode_only: bool = False,
                        ple_rows: dict[int, Callable[[], torch.Tensor]] | None = None) -> ForwardBatch:
    """Device metadata for ``segments`` (decodes first, then prefills; rows in that order).

    ``ngram_context`` overrides the segments' n-gram contexts (read from their slots otherwise): an
    internal chunk of a layer-major prefill takes it from the ids before it, and ``ple_rows`` its PLE
    table rows gathered ahead. ``decode_only``: every row decodes a generated token.
    """
    plan = plan_forward_batch(segments, input_ids, kv is not None, qsa_ratio)
    views = plan.up.send(torch.device(device))
    return assemble_forward_batch(plan, views, kv, states, ngram_eos, ngram_context, decode_only, ple_rows)


def _images_host(up: Upload, segments: list[Segment], ratio: int):
    """With a segment that has images: ``(3-D positions [3 * T], vision rows, QSA block start 3-D
    positions [3 * Mb], vision features)`` (the first three in ``up``); else None."""
    if not any(s.images is not None for s in segments):
        return None

    def positions(seg: Segment, seq: np.ndarray) -> np.ndarray:
        return np.broadcast_to(seq, (3, len(seq))) if seg.images is None else seg.images.positions(seq)

    rope, rows, embeds = [], [], []
    blocks = []
    for seg in segments:
        rope.append(positions(seg, np.arange(seg.start, seg.end, dtype=np.int64)))
        if seg.images is not None:
            offsets, feature_rows = seg.images.rows(seg.start, seg.length)
            if len(offsets):
                rows.append(seg.row0 + offsets)
                embeds.append(seg.images.features[feature_rows])
        if ratio:  # the first position of every block the segment completes
            blocks.append(positions(seg, np.arange(seg.start // ratio, seg.end // ratio, dtype=np.int64) * ratio))
    rope_i = up.add(np.ascontiguousarray(np.concatenate(rope, axis=1)).reshape(-1))
    rows_i = up.add(np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64))
    block_pos = np.concatenate(blocks, axis=1) if blocks else np.zeros((3, 0), dtype=np.int64)
    blocks_i = up.add(np.ascontiguousarray(block_pos).reshape(-1))
    vision = torch.cat(embeds) if embeds else None
    return rope_i, rows_i, blocks_i, vision
