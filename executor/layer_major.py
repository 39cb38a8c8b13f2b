"""A layer-major prefill: one long segment, each decoder layer over all its internal chunks before the next.

Internal chunks are cut as the scheduler cuts chunked forwards (``chunking.chunk_bounds`` of at most
``chunk`` rows), so layer-major and chunked prefill run the same blocks. They keep their absolute positions
and the outer checkpoint plan projected onto them: an export inside a chunk is that chunk's internal
export; one at a chunk boundary is copied per layer right after the layer finishes that chunk (the slot
moves on with the next chunk). The outer batch finishes the n-gram contexts and end-of-segment exports.

The work is a sequence of steps: per layer, every chunk up to its MoE block, then every chunk's MoE (the
experts' copy is awaited once the rest of the layer is queued, and only MoE work is left when it lands).
:meth:`LayerMajorPrefill.run` does some of them, so that the prefill can span several scheduling turns
with other requests' decode steps between them (``--layer-major-turns``); its activations and the expert
store's layer buffers stay alive between turns.
"""

from __future__ import annotations

import functools

import torch

from ..scheduler.chunking import chunk_bounds
from .forward_batch import ForwardBatch, Segment, build_forward_batch


class LayerMajorPrefill:
    def __init__(self, runner, outer: ForwardBatch, ids: list[int], chunk: int):
        if len(outer.segments) != 1 or chunk < 1:
            raise ValueError("a layer-major batch holds exactly one segment and a chunk size")
        self.runner, self.outer = runner, outer
        seg = outer.segments[0]
        self.slot = seg.slot
        width = runner.states.ngram_context.shape[1]
        history = torch.cat([outer.ngram_context[0], outer.input_ids])  # context ids, then the tokens
        cuts = [b - seg.start for b in chunk_bounds(seg.start, seg.start + seg.length, chunk)]
        self.ahead = runner._ple_rows_ahead(outer, cuts)
        self.chunks: list[ForwardBatch] = []
        self.boundary_exports: list[list[int]] = []
        for lo, hi in zip(cuts[:-1], cuts[1:], strict=True):
            part = Segment(slot=seg.slot, start=seg.start + lo, length=hi - lo, row0=0, pages=seg.pages,
                           exports=[(off - lo, dst) for off, dst in seg.exports if lo < off < hi], images=seg.images)
            rows_ahead = {i: functools.partial(rows.send, lo, hi) for i, rows in self.ahead.items()}
            self.chunks.append(build_forward_batch(
                [part], ids[lo:hi], runner.kv, runner.states, runner.config.ngram_eos_id, runner.device,
                qsa_ratio=runner.config.qsa_ratio, ngram_context=history[None, lo:lo + width], ple_rows=rows_ahead))
            self.boundary_exports.append([dst for off, dst in seg.exports if off == hi < seg.length])
        store = runner.expert_store
        if store is not None:  # every upload of the batch is issued: the layers' copies follow
            store.start()
        model = runner.model.model
        self.layers = model.layers
        self.streams = [model.embed(fb) for fb in self.chunks]
        self.pending: list = [None] * len(self.chunks)
        self.moe_in: list = []
        self.step = 0  # of 2 * len(chunks) per layer: before-MoE of chunk k, then MoE of chunk k
        self.deferred: int | None = None  # a layer whose finish ended a turn: its buffer's next copy waits

    @property
    def steps_left(self) -> int:
        return 2 * len(self.chunks) * len(self.layers) - self.step

    @property
    def layer_chunks(self) -> int:
        """(layer, internal chunk) pairs in the whole prefill."""
        return len(self.chunks) * len(self.layers)

    def run(self, layer_chunks: int) -> bool:
        """Do the next ``layer_chunks`` (layer, chunk) pairs of work (0: all that are left); whether the
        prefill is complete."""
        steps = self.steps_left if layer_chunks <= 0 else min(self.steps_left, 2 * layer_chunks)
        n = len(self.chunks)
        store = self.runner.expert_store
        if self.deferred is not None:
            store.finished(self.deferred)
            self.deferred = None
        for step in range(steps):
            i, k = divmod(self.step, 2 * n)
            layer, fb = self.layers[i], self.chunks[k % n]
            if k < n:
                self.streams[k], block_in, inject = layer.before_moe(self.streams[k], self.pending[k], fb)
                self.moe_in.append((block_in, inject))
                for dst in self.boundary_exports[k]:
                    self.runner.states.copy_layer(layer.layer_idx, self.slot, dst)
            else:
                self.pending[k - n] = layer.moe(*self.moe_in[k - n], fb)
                if k == 2 * n - 1:
                    self.moe_in = []
                    if store is not None:
                        following = self.layers[i + 1].layer_idx if i + 1 < len(self.layers) else None
                        if following in self.ahead and store.copy_stream is not None:
                            # The next layer's PLE rows travel before the layer after next's experts.
                            self.ahead[following].upload(store.copy_stream)
                        if step == steps - 1 and self.step + 1 < 2 * n * len(self.layers):
                            # The turn ends here and decode steps come next: their expert copies go ahead
                            # of the layer after next on the copy engine (the next layer is under way).
                            self.deferred = layer.layer_idx
                        else:
                            store.finished(layer.layer_idx)
            self.step += 1
        return self.steps_left == 0

    def result(self) -> tuple[torch.Tensor, object]:
        """Only the last chunk's streams (and pending residual): the sampled row is its last."""
        return self.streams[-1], self.pending[-1]
