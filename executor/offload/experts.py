"""Routed experts in host memory (``--moe-strategy offload``): a device expert cache and layer streaming.

A real Qwen4-Exp checkpoint has 512 experts in each of 40+ layers: far more than a GPU holds next to
its KV cache. With offload every layer's experts stay in host banks (pinned on CUDA, so copies run
at PCIe speed and asynchronously) and the device keeps:

- an **expert cache** of ``--moe-cache-slots`` experts, least-recently-used over (layer, expert)
  pairs across all layers; a batch that routes to few experts (decoding) copies only its misses;
- a **double buffer of whole layers** for batches the cache cannot serve (more routed experts than
  slots, or misses covering most of the layer: long prefill chunks hit nearly every expert): the
  layer is copied whole, and the next layer is copied on a side stream while this one computes.

Chunked prefill streams every layer once per chunk; layer-major prefill (``begin``) streams each
layer once for all its chunks, over one scheduling turn or several with decode steps between them. A
whole-layer copy takes the experts the cache holds from their slots
on the device and copies only the rest from host memory. Counters per layer (experts copied from the
host, bytes, whole-layer streams) show which happened; the server reports them on ``/metrics``.
"""

from __future__ import annotations

from collections import OrderedDict
from contextlib import contextmanager

import torch

from ..quant import QuantTensor, expert_bytes, new_like, read_packed, routed_experts

# A batch whose cache misses exceed this fraction of a layer's experts streams the whole layer (one
# large copy, and the next layer prefetched) instead of copying expert by expert.
STREAM_FRACTION = 0.5


class ExpertStore:
    """Every layer's experts in host memory, served to the device through a cache and layer buffers.

    Args:
        host_gate_up, host_down: per MoE layer, ``[E, 2I, H]`` and ``[E, H, I]`` host tensors, or
            :class:`~tidal.executor.quant.QuantTensor` stacks in a checkpoint's format (the cache and the layer
            buffers then hold that format too, and a copy moves its bytes).
        num_slots: experts the device cache holds.
    """

    def __init__(self, host_gate_up: dict[int, torch.Tensor | QuantTensor],
                 host_down: dict[int, torch.Tensor | QuantTensor], num_slots: int, device: torch.device | str):
        self.device = torch.device(device)
        self.gate_up, self.down = host_gate_up, host_down
        self.layers = sorted(host_gate_up)
        first = host_gate_up[self.layers[0]]
        self.num_experts = first.shape[0]
        self.expert_bytes = expert_bytes(first) + expert_bytes(host_down[self.layers[0]])
        self.num_slots = num_slots
        self.cache_gate_up = new_like(first, num_slots, self.device)
        self.cache_down = new_like(host_down[self.layers[0]], num_slots, self.device)
        self._lru: OrderedDict[tuple[int, int], int] = OrderedDict()
        self._free = list(range(num_slots))
        self._buffers: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._buffer_layer: list[int | None] = [None, None]
        self._buffer_ready: list[torch.cuda.Event | None] = [None, None]
        # Whole-layer copies run here. Host-to-device copies share the copy engine in the order they are
        # issued, whatever their stream: a small upload on the compute stream waits for every layer copy
        # issued before it, so uploads that a layer will need go on this stream, ahead of later layers.
        self.copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._whole_layers = False
        # A layer-major prefill's snapshot of the cache: per layer not yet copied whole, expert -> slot (host)
        # and as device tensors of expert ids and slots.
        self._held: dict[int, dict[int, int]] | None = None
        self._held_indices: dict[int, tuple[torch.Tensor, torch.Tensor] | None] | None = None
        self.loads = {layer: 0 for layer in self.layers}
        self.bytes = {layer: 0 for layer in self.layers}
        self.layer_streams = {layer: 0 for layer in self.layers}

    # ---- what the MoE layer calls ----------------------------------------------------------------
    def forward(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        gate_up, down, local_ids = self._experts_for(layer, ids, in_place=read_packed(x, self.cache_gate_up))
        return routed_experts(x, local_ids, weights, gate_up, down)

    def begin(self) -> None:
        """A layer-major prefill starts: its MoE calls (inside :meth:`whole_layers`) take their layer whole
        from the double buffer, so the chunks of one layer share one copy and the next layer streams
        meanwhile (:meth:`start` begins). Whole layers leave the cache as it is: where each layer's cached
        experts sit is uploaded now, in one copy, rather than per layer behind the layer copies already queued
        on the copy engine. Until a layer's buffer is filled, the cache keeps those experts where they are
        (decode steps between the prefill's turns evict others first), so the copy stays exact."""
        self._held = {layer: dict(pairs) for layer, pairs in self._cached(self.layers).items()}
        self._held_indices = self._cached_indices(self.layers)

    def end(self) -> None:
        """The layer-major prefill is over (finished, failed or dropped)."""
        self._whole_layers, self._held, self._held_indices = False, None, None

    @property
    def active(self) -> bool:
        """A layer-major prefill holds the layer buffers (between :meth:`begin` and :meth:`end`)."""
        return self._held is not None

    @contextmanager
    def whole_layers(self):
        """One turn of the layer-major prefill: every MoE call takes its layer whole. Restored on exit,
        however it ends."""
        self._whole_layers = True
        try:
            yield self
        finally:
            self._whole_layers = False

    def start(self) -> None:
        """Layer-major: copy the first two MoE layers now, one into each buffer, back to back on the copy
        engine. Called once the batch's own uploads are issued: host-to-device copies run in issue order,
        so an upload issued after these waits for them (and, from pageable memory, so does the host)."""
        for layer in self.layers[:2]:
            self._buffer_for(layer)

    def finished(self, layer: int) -> None:
        """Layer-major: every MoE call of ``layer`` is queued, so its buffer starts taking the layer after
        next now, a whole layer's host work before the next layer's first MoE call would start it."""
        position = self.layers.index(layer)
        if (self._whole_layers and position + 2 < len(self.layers) and layer in self._buffer_layer
                and self.layers[position + 2] not in self._buffer_layer):
            self._fill(self._buffer_layer.index(layer), self.layers[position + 2])

    def stats(self) -> dict[str, list[int]]:
        """Cumulative per-layer counters (index = position in ``layers``)."""
        return {"expert_loads": [self.loads[i] for i in self.layers],
                "expert_bytes": [self.bytes[i] for i in self.layers],
                "expert_layer_streams": [self.layer_streams[i] for i in self.layers]}

    # ---- internals -------------------------------------------------------------------------------
    def _experts_for(self, layer: int, ids: torch.Tensor, in_place: bool):
        """``(gate_up, down, ids)`` for this batch: a whole layer, or the cache with ``ids`` mapped to slots. Cached
        quantized experts the kernels do not read ``in_place`` are taken out, only the slots routed to (each is
        dequantized per use)."""
        if self._whole_layers:  # layer-major: whole layers, decided without looking at the routing
            return (*self._layer(layer), ids)
        if self.active and layer in self._buffer_layer:
            # Between the turns of a layer-major prefill: a layer its buffers hold (or are filling) serves a
            # decode batch whole, with no copy and without the routing on the host.
            return (*self._buffered(layer), ids)
        experts = torch.unique(ids).tolist()  # offload needs the routed set on the host
        misses = sum(1 for e in experts if (layer, e) not in self._lru)
        # Between the turns of a layer-major prefill the layer buffers hold its layers: a batch takes a layer
        # whole only if the cache cannot hold its experts (the prefill then copies the layers it lost again).
        whole = misses > self.num_experts * STREAM_FRACTION and not self.active
        if len(experts) > self.num_slots or whole:
            return (*self._layer(layer), ids)
        slots = self._cache(layer, experts)
        remap = torch.full((self.num_experts,), -1, dtype=torch.long)
        if isinstance(self.cache_gate_up, QuantTensor) and not in_place:
            # Only the slots this batch routes to, numbered 0..n-1.
            index = torch.tensor(slots, dtype=torch.long).to(self.device)
            remap[experts] = torch.arange(len(experts), dtype=torch.long)
            return (self.cache_gate_up.index_select(0, index), self.cache_down.index_select(0, index),
                    remap.to(self.device)[ids])
        remap[experts] = torch.tensor(slots, dtype=torch.long)
        return self.cache_gate_up, self.cache_down, remap.to(self.device)[ids]

    def _cache(self, layer: int, experts: list[int]) -> list[int]:
        """Device slots holding ``experts`` of ``layer``; misses evict the least recently used others."""
        if len(experts) > self.num_slots:
            raise RuntimeError(f"a batch routes to {len(experts)} experts of layer {layer} but the expert cache "
                               f"holds {self.num_slots} (--moe-cache-slots)")
        needed = {(layer, e) for e in experts}
        slots = []
        for e in experts:
            key = (layer, e)
            slot = self._lru.get(key)
            if slot is None:
                if self._free:
                    slot = self._free.pop()
                else:
                    slot = self._lru.pop(self._victim(needed))
                self.cache_gate_up[slot].copy_(self.gate_up[layer][e], non_blocking=True)
                self.cache_down[slot].copy_(self.down[layer][e], non_blocking=True)
                self.loads[layer] += 1
                self.bytes[layer] += self.expert_bytes
            self._lru[key] = slot
            self._lru.move_to_end(key)
            slots.append(slot)
        return slots

    def _victim(self, needed: set[tuple[int, int]]) -> tuple[int, int]:
        """The least recently used entry outside ``needed``; while a layer-major prefill holds a snapshot,
        one it will not copy from if there is any (else the snapshot of that layer is dropped: its fill then
        reads the cache as it is)."""
        if self._held is not None:
            for key in self._lru:
                if key not in needed and key[1] not in self._held.get(key[0], ()):
                    return key
        key = next(k for k in self._lru if k not in needed)
        if self._held is not None and key[0] in self._held:
            del self._held[key[0]]
        return key

    def _cached(self, layers: list[int]) -> dict[int, list[tuple[int, int]]]:
        """Per layer, ``(expert, slot)`` of the experts the cache holds, by expert id."""
        held: dict[int, list[tuple[int, int]]] = {layer: [] for layer in layers}
        for (layer, e), slot in self._lru.items():
            if layer in held:
                held[layer].append((e, slot))
        return {layer: sorted(pairs) for layer, pairs in held.items()}

    def _cached_indices(self, layers: list[int]) -> dict[int, tuple[torch.Tensor, torch.Tensor] | None]:
        """:meth:`_cached` as device tensors of expert ids and slots, uploaded in one copy (None for a layer
        with none cached)."""
        held = self._cached(layers)
        flat = torch.tensor([pair for layer in layers for pair in held[layer]], dtype=torch.long)
        flat = flat.reshape(-1, 2).t().to(self.device)
        out: dict[int, tuple[torch.Tensor, torch.Tensor] | None] = {}
        at = 0
        for layer in layers:
            n = len(held[layer])
            out[layer] = (flat[0, at:at + n], flat[1, at:at + n]) if n else None
            at += n
        return out

    def _buffer_for(self, layer: int) -> int:
        """The buffer holding ``layer``, its copy started here if it is in neither."""
        if not self._buffers:
            for _ in range(2):
                self._buffers.append((new_like(self.gate_up[layer], self.num_experts, self.device),
                                      new_like(self.down[layer], self.num_experts, self.device)))
        if layer not in self._buffer_layer:
            self._fill(self._buffer_layer.index(None) if None in self._buffer_layer else
                       self._oldest_buffer(layer), layer)
        return self._buffer_layer.index(layer)

    def _layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole layer on the device; the next MoE layer starts copying into the other buffer."""
        index = self._buffer_for(layer)
        buffers = self._buffered(layer)
        position = self.layers.index(layer)
        if position + 1 < len(self.layers) and self.layers[position + 1] not in self._buffer_layer:
            self._fill(1 - index, self.layers[position + 1])
        return buffers

    def _buffered(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The buffer holding ``layer``, once its copy landed; starts no copy."""
        index = self._buffer_layer.index(layer)
        ready = self._buffer_ready[index]
        if ready is not None:
            torch.cuda.current_stream(self.device).wait_event(ready)
        return self._buffers[index]

    def _oldest_buffer(self, layer: int) -> int:
        # Two buffers: the one not holding the layer just before this one (it may still be in use).
        position = self.layers.index(layer)
        previous = self.layers[position - 1] if position else None
        return 1 if self._buffer_layer[0] == previous else 0

    def _fill(self, index: int, layer: int) -> None:
        """Copy ``layer`` whole into buffer ``index``: the experts the cache holds from their slots (on the
        compute stream, in order with the cache's own writes), the rest from host memory in runs of
        consecutive experts (on the copy stream, after the work that may still read the buffer)."""
        gate_up, down = self._buffers[index]
        snapshot = self._held is not None and layer in self._held
        cached = set(self._held.pop(layer)) if snapshot else {e for e, _ in self._cached([layer])[layer]}
        if cached:
            if self._buffer_ready[index] is not None:  # a fill of this buffer still under way on the copy stream
                torch.cuda.current_stream(self.device).wait_event(self._buffer_ready[index])
            held = self._held_indices if snapshot else self._cached_indices([layer])
            experts, slots = held[layer]
            gate_up.index_copy_(0, experts, self.cache_gate_up.index_select(0, slots))
            down.index_copy_(0, experts, self.cache_down.index_select(0, slots))
        runs = _runs([e for e in range(self.num_experts) if e not in cached])
        if self.copy_stream is not None:
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.copy_stream):
                for lo, hi in runs:
                    gate_up[lo:hi].copy_(self.gate_up[layer][lo:hi], non_blocking=True)
                    down[lo:hi].copy_(self.down[layer][lo:hi], non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.copy_stream)
            self._buffer_ready[index] = event
        else:
            for lo, hi in runs:
                gate_up[lo:hi].copy_(self.gate_up[layer][lo:hi])
                down[lo:hi].copy_(self.down[layer][lo:hi])
        self._buffer_layer[index] = layer
        copied = self.num_experts - len(cached)
        self.loads[layer] += copied
        self.bytes[layer] += copied * self.expert_bytes
        self.layer_streams[layer] += 1


def _runs(experts: list[int]) -> list[tuple[int, int]]:
    """Sorted expert ids as ``[lo, hi)`` runs of consecutive ids."""
    runs: list[tuple[int, int]] = []
    for e in experts:
        if runs and runs[-1][1] == e:
            runs[-1] = (runs[-1][0], e + 1)
        else:
            runs.append((e, e + 1))
    return runs
