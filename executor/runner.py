"""Runs one ``Batch``: state copies, one forward over all segments, logits, sampling."""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from ..config.model import ModelConfig
from ..kernels.backend import forces_torch
from ..kernels.gdn_varlen import gdn_prefill_on_device
from ..messages import Batch, ImageInput, SamplingParams, SegmentSpec, TokenLogprob
from ..runtime.faults import SCRIPTED, scripted_output
from ..vision import ImageProcessor
from . import quant
from .cuda_graph import DecodeGraphs
from .distributed import tp
from .forward_batch import ForwardBatch, Segment, build_forward_batch, note_ngram_contexts
from .images import RequestImages, images_past
from .layer_major import LayerMajorPrefill
from .layers.hyper_connection import GatedResidual
from .memory import KVPool, StatePool
from .models import Qwen4ExpForCausalLM
from .offload.experts import ExpertStore
from .offload.ple_table import PinnedTable, RowsAhead
from .prefill_graph import PrefillGraphs, sizes_for
from .sampler import Sampler, TokenCounts
from .structured import GrammarStates
from .upload import device_ints
from .warm import CompileCounter

GREEDY = SamplingParams()
# Threads gathering pinned PLE rows ahead of a layer-major prefill, one internal chunk per task: random
# row reads from a multi-GB table are bound by memory latency, which more threads hide.
PLE_WORKERS = 4
logger = logging.getLogger(__name__)


# Images whose vision features the executor keeps (the most recently used).
VISION_CACHE = 8


def is_decode(spec: SegmentSpec) -> bool:
    """A decode of a generated token: one row that samples the request's next output after the first
    (prompt chunks sample output 0, or nothing when resumed; a decode samples output ``len(output)``)."""
    return len(spec.token_ids) == 1 and spec.sample and spec.sample_index >= 1


@dataclass
class RunnerOutput:
    # One id per segment, -1 where the segment did not sample.
    token_ids: list[int]
    # Segment index -> fp32 logits [len, vocab] for segments that asked (offline scoring).
    logits: dict[int, torch.Tensor] = field(default_factory=dict)
    # Segment index -> the sampled token's log-probabilities, for requests that asked.
    logprobs: dict[int, TokenLogprob] = field(default_factory=dict)
    # Segment index -> the log-probabilities of its ``prompt_targets``.
    prompt_logprobs: dict[int, list[TokenLogprob]] = field(default_factory=dict)


@dataclass
class Launched:
    """A batch as :meth:`ModelRunner.launch` left it: its output, or (a decode step sampled on the device)
    the output less its token ids, which a non-blocking copy brings to ``ids`` (pinned host memory) by
    the time ``done`` fires. :meth:`ModelRunner.finish` completes it."""
    out: RunnerOutput
    ids: torch.Tensor | None = None
    done: torch.cuda.Event | None = None
    slots: list[int] = field(default_factory=list)  # the slot of each id, in segment order
    finished: bool = False

    def ready(self) -> bool:
        """Whether :meth:`ModelRunner.finish` would return without waiting for the device."""
        return self.finished or self.done is None or self.done.query()


class ModelRunner:
    def __init__(self, model: Qwen4ExpForCausalLM, config: ModelConfig, kv: KVPool, states: StatePool,
                 device: torch.device | str, seed: int = 0, expert_store: ExpertStore | None = None,
                 model_path: str | None = None):
        self.model, self.config = model, config
        self.kv, self.states = kv, states
        self.device = torch.device(device)
        self.sampler = Sampler(self.device, seed)
        self.counts = TokenCounts(self.device)
        self.grammars = GrammarStates(model_path, config.eos_token_ids)
        self.expert_store = expert_store
        self.hc_shard_forwards = 0
        self.page_tables: dict[int, list[int]] = {}  # slot -> the request's page table
        self.last_sampled: dict[int, int] = {}  # slot -> the token sampled there by the latest batch
        self.unfinished: dict[int, Launched] = {}  # slot -> the launched batch that samples it, not yet finished
        self.graphs: DecodeGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None
        self.images: dict[int, RequestImages] = {}  # slot -> its request's images
        self.vision_cache: OrderedDict[str, torch.Tensor] = OrderedDict()  # image digest -> features, LRU
        self.image_processor = ImageProcessor.from_checkpoint(model_path, config.vision_config, config.image_token_id) \
            if config.vision_config is not None else None
        self.images_encoded = 0
        self.compiles: CompileCounter | None = None  # the serving executor's (warm.py)
        self._ple_worker: ThreadPoolExecutor | None = None  # gathers pinned PLE rows ahead (layer-major)
        self.layer_major: LayerMajorPrefill | None = None  # the layer-major prefill under way, over turns
        self.layer_major_rid: str | None = None

    def use_graphs(self, max_batch: int, max_pages: int, capture: bool) -> None:
        """Run decode batches of up to ``max_batch`` rows from CUDA graphs (``capture``) or, without it,
        as the same padded fixed-shape step run eagerly. The pools' last slot and last page are the
        padding rows' (``build_runner`` allocates one of each beyond the scheduler's counts)."""
        self.graphs = DecodeGraphs(self.model, self.config, self.kv, self.states, self.device, max_batch, max_pages,
                                   pad_slot=self.states.num_slots - 1, pad_page=self.kv.num_pages - 1,
                                   capture=capture)

    def use_prefill_graphs(self, max_pages: int, capture: bool, max_tokens: int) -> None:
        """Run prompt chunks of up to about ``max_tokens`` rows alone in their batch from CUDA graphs of padded
        sizes (``capture``) or, without it, as the same padded forward run eagerly (see :mod:`.prefill_graph`);
        padding rows as the decode graphs'."""
        self.prefill_graphs = PrefillGraphs(self.model, self.config, self.kv, self.states, self.device, max_pages,
                                            pad_slot=self.states.num_slots - 1, pad_page=self.kv.num_pages - 1,
                                            capture=capture, sizes=sizes_for(max_tokens))

    def stats(self) -> dict[str, list[int]]:
        """Cumulative counters for /metrics: expert streaming per MoE layer, TP collectives."""
        out = self.expert_store.stats() if self.expert_store is not None else {}
        group = tp()
        if group.size > 1:
            for kind in ("all_reduce", "all_gather", "reduce_scatter"):
                out[f"tp_{kind}s"] = [group.counters[kind]]
            out["tp_hc_shard_forwards"] = [self.hc_shard_forwards]
        if self.graphs is not None and self.graphs.capture:
            out["cuda_graph_replays"] = [self.graphs.steps]
        if self.prefill_graphs is not None and self.prefill_graphs.capture:
            out["prefill_graph_replays"] = [self.prefill_graphs.replays]
        if self.model.visual is not None:
            out["images_encoded"] = [self.images_encoded]
        if self.compiles is not None:
            compiles, captures = self.compiles.after_ready()
            out["compilations_after_ready"] = [compiles]
            out["graph_captures_after_ready"] = [captures]
        return out

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def execute(self, batch: Batch) -> RunnerOutput:
        return self.finish(self.launch(batch))

    @torch.inference_mode()
    def launch(self, batch: Batch) -> Launched:
        """Run ``batch`` as far as it goes without waiting for the device: a decode step from a CUDA graph
        with plain sampling (:meth:`can_follow`) comes back pending, its ids still on the way; any other
        batch comes back finished. A decode sent ahead (token ``-1``) of a slot that a pending batch samples
        takes that token on the device; a batch that cannot (or that samples on the host) finishes the
        pending batches of its slots first."""
        waits = {id(w): w for s in batch.segments if (w := self.unfinished.get(s.slot)) is not None}
        if waits and not self.can_follow(batch):
            for launched in waits.values():
                self.finish(launched)
        if batch.mode == "layer_major":
            return Launched(self._layer_major_turn(batch), finished=True)
        return self._execute(batch)

    def can_follow(self, batch: Batch) -> bool:
        """Whether ``batch`` may be launched before the batches launched ahead of it finish: a decode step
        that runs from a graph, whose every row samples plainly (no grammar, penalties, log-probabilities or
        scripted outputs, one rank), so that nothing it reads waits on the host's copy of their ids."""
        if not self._graph_batch(batch) or not self._samples_on_device(batch.segments):
            return False
        segs = batch.segments
        return self.graphs.fits([s.slot for s in segs], [s.start for s in segs],
                                [(s.page_base, len(s.pages)) for s in segs])

    @staticmethod
    def _samples_on_device(specs: list[SegmentSpec]) -> bool:
        """Every row samples plainly (nothing the host must see first or follow after), on one rank."""
        def plain(spec: SegmentSpec) -> bool:
            p = spec.sampling
            return ((p is None or (not p.needs_history and p.logprobs < 0))
                    and not (SCRIPTED and scripted_output(spec.sample_index) is not None))

        return tp().size == 1 and all(map(plain, specs))

    def finish(self, launched: Launched) -> RunnerOutput:
        """The output of a launched batch, its sampled ids read back (waiting for the device if need be)."""
        if launched.finished:
            return launched.out
        launched.finished = True
        if launched.done is not None:
            launched.done.synchronize()
        for i, (slot, tok) in enumerate(zip(launched.slots, launched.ids.tolist(), strict=True)):
            launched.out.token_ids[i] = tok
            self.last_sampled[slot] = tok
            if self.unfinished.get(slot) is launched:
                del self.unfinished[slot]
        return launched.out

    def _execute(self, batch: Batch) -> Launched:
        self._prepare(batch)
        specs = batch.segments
        if self._graph_batch(batch):
            launched = self._execute_graph(specs)
            if launched is not None:
                return launched
        elif self._prefill_graph_batch(batch):
            launched = self._execute_prefill_graph(specs[0])
            if launched is not None:
                return launched
        # Decodes first, then prefill chunks (see forward_batch); ``order[j]`` is the message index
        # of the j-th segment as the forward lays it out.
        order = sorted(range(len(specs)), key=lambda i: len(specs[i].token_ids) != 1)
        fb = self._forward_batch([specs[i] for i in order], decode_only=all(is_decode(spec) for spec in specs))
        group = tp()
        sharded = batch.hc_shard and group.size > 1
        before = dict(group.counters) if sharded else None
        streams, pending = self.model(fb, hc_shard=batch.hc_shard)
        if sharded:
            self.hc_shard_forwards += 1
            issued = {k: v - before.get(k, 0) for k, v in group.counters.items()}
            logger.info("hc shard forward: %d rows, %d per rank, %d all-gathers, %d reduce-scatters",
                        fb.num_tokens, fb.num_tokens // group.size, issued.get("all_gather", 0),
                        issued.get("reduce_scatter", 0))
        self._finish_states(fb)
        return Launched(self._logits_and_sample(batch, specs, order, fb, streams, pending, 0), finished=True)

    def _prepare(self, batch: Batch) -> None:
        """Before a batch's forward: prefix-cache restores (checkpoint slots into request slots, two disjoint
        pools: no chains), and the tokens of decodes scheduled ahead."""
        self.states.copy_many([s for s, _ in batch.copies], [d for _, d in batch.copies])
        with_images = [spec for spec in batch.segments if spec.images]
        if with_images:  # every image the batch's requests still compute rows of, in one tower forward
            self._encode([im for spec in with_images for im in images_past(spec.images, spec.start)])
        for spec in batch.segments:
            if spec.images:
                self.images[spec.slot] = self._request_images(spec.images, spec.start)
            elif spec.page_base == 0 and spec.pages:  # a request's first segment: the slot's images are gone
                self.images.pop(spec.slot, None)
            if spec.token_ids and spec.token_ids[0] < 0:  # scheduled ahead: the token sampled just before
                if len(spec.token_ids) != 1:
                    raise ValueError(f"segment of request {spec.rid}: token -1 stands for one decode token")
                if spec.slot in self.unfinished:  # still on the device: the graph step reads it there
                    continue
                # None sampled there (the batch before failed): the scheduler ends the request with that
                # batch and drops this row's result, so any token does; the batch's other rows go on.
                spec.token_ids = [self.last_sampled.get(spec.slot, 0)]
            if spec.sample:  # what this batch samples replaces what the slot sampled before, or nothing
                self.last_sampled.pop(spec.slot, None)
        while len(self.vision_cache) > VISION_CACHE:
            self.vision_cache.popitem(last=False)

    def _layer_major_turn(self, batch: Batch) -> RunnerOutput:
        """One turn of a layer-major prefill (``batch.turn`` of ``batch.turns``, ``batch.layer_chunks``
        (layer, internal chunk) pairs of its work; 0: all). The first builds it, the last samples; between
        turns its activations stay here while other batches run. ``batch.drop`` ends it unfinished. It ends
        too when a turn fails, and when another one starts."""
        out = RunnerOutput(token_ids=[-1] * len(batch.segments))
        if batch.drop:
            self._end_layer_major()
            return out
        if len(batch.segments) != 1:
            raise ValueError("a layer-major batch holds exactly one segment")
        spec = batch.segments[0]
        try:
            if batch.turn == 0:
                self._end_layer_major()
                if spec.want_logits or spec.prompt_targets:
                    raise ValueError("a layer-major batch samples; it cannot return every row's logits or prompt "
                                     "log-probabilities")
                self._prepare(batch)
                fb = self._forward_batch([spec])
                if self.expert_store is not None:
                    self.expert_store.begin()
                self.layer_major = LayerMajorPrefill(self, fb, spec.token_ids, batch.chunk_size)
                self.layer_major_rid = spec.rid
            elif self.layer_major is None or self.layer_major_rid != spec.rid:
                raise RuntimeError(f"turn {batch.turn} of the layer-major prefill of {spec.rid}, which this executor "
                                   "does not hold")
            job = self.layer_major
            if self.expert_store is not None:
                with self.expert_store.whole_layers():
                    done = job.run(batch.layer_chunks)
            else:
                done = job.run(batch.layer_chunks)
            if done != (batch.turn == batch.turns - 1):
                raise RuntimeError(f"the layer-major prefill of {spec.rid} ({job.layer_chunks} layer-chunks) "
                                   f"{'ended' if done else 'did not end'} at turn {batch.turn} of {batch.turns} "
                                   f"with {batch.layer_chunks} layer-chunks a turn")
            if not done:
                return out
            if spec.sample:
                self.last_sampled.pop(spec.slot, None)
            streams, pending = job.result()
            self._finish_states(job.outer)
            out = self._logits_and_sample(batch, [spec], [0], job.outer, streams, pending,
                                          job.outer.num_tokens - streams.shape[0])
        except BaseException:  # a failed turn fails its request; nothing of the prefill stays
            self._end_layer_major()
            raise
        self._end_layer_major()
        return out

    def _end_layer_major(self) -> None:
        if self.layer_major is not None and self.expert_store is not None:
            self.expert_store.end()
        self.layer_major = self.layer_major_rid = None

    def _logits_and_sample(self, batch: Batch, specs: list[SegmentSpec], order: list[int], fb: ForwardBatch,
                           streams: torch.Tensor, pending, shift: int) -> RunnerOutput:
        # Rows that need logits: every row of a scoring segment, the last row of a sampling one.
        rows: list[int] = []
        spans: dict[int, tuple[int, int]] = {}
        for i, seg in zip(order, fb.segments, strict=True):
            spec = specs[i]
            first = len(rows)
            if spec.want_logits:
                rows.extend(range(seg.row0, seg.row0 + seg.length))
            elif spec.sample:
                rows.append(seg.row0 + seg.length - 1)
            spans[i] = (first, len(rows))
        out = RunnerOutput(token_ids=[-1] * len(specs))
        for i, seg in zip(order, fb.segments, strict=True):
            if specs[i].prompt_targets:
                if batch.mode == "layer_major":
                    raise ValueError("a layer-major batch cannot return prompt log-probabilities")
                out.prompt_logprobs[i] = self._prompt_logprobs(streams, pending, seg.row0, specs[i])
        if not rows:
            return out
        logits = self.model.logits(streams, pending, device_ints(rows, self.device) - shift).float()
        for i, spec in enumerate(specs):
            if spec.want_logits:
                out.logits[i] = logits[spans[i][0]:spans[i][1]]
        self._sample(out, specs, logits, {i: spans[i][1] - 1 for i in range(len(specs))})
        return out

    def _graph_batch(self, batch: Batch) -> bool:
        """Decode graphs serve batches of generated-token decodes only (a one-token prompt chunk runs
        eagerly, so that every prompt row computes alike: see ``ForwardBatch.decode_only``)."""
        return (self.graphs is not None and batch.mode != "layer_major"
                and all(is_decode(s) and not s.want_logits and not s.prompt_targets for s in batch.segments)
                and self._rope_shifts(batch.segments) is not None)

    def _rope_shifts(self, specs: list[SegmentSpec]) -> list[int] | None:
        """Each decode row's rotary shift in a graph step: what its request's images add to the positions of
        the text after them (0 without images). ``None`` when a row completes a QSA block that starts before
        that text: the block's key turns with (frame, row, column) positions, which the eager path gives."""
        ratio, shifts = self.config.qsa_ratio, []
        for spec in specs:
            images = self.images.get(spec.slot)
            first = spec.start + 1 - ratio if ratio and (spec.start + 1) % ratio == 0 else spec.start
            shift = 0 if images is None else images.shift_from(first)
            if shift is None:
                return None
            shifts.append(shift)
        return shifts

    def _prefill_graph_batch(self, batch: Batch) -> bool:
        """Prompt graphs serve a prompt chunk alone in its batch (several rows, no logits or prompt log-probabilities
        asked for its rows) of text: with images, a chunk past them (:meth:`_prompt_shift`);
        :meth:`PrefillGraphs.key` decides whether its size fits one."""
        if self.prefill_graphs is None or batch.mode == "layer_major" or len(batch.segments) != 1:
            return False
        spec = batch.segments[0]
        return (len(spec.token_ids) > 1 and not spec.want_logits and not spec.prompt_targets
                and self._prompt_shift(spec) is not None)

    def _prompt_shift(self, spec: SegmentSpec) -> int | None:
        """A prompt chunk's rotary shift in a prompt graph (0 without images; its request's images are in
        ``self.images`` once ``_prepare`` ran): their delta when the chunk and every QSA block it completes lie
        past them, else ``None`` (its rows or blocks turn with (frame, row, column) positions: eager)."""
        images = self.images.get(spec.slot)
        if images is None:
            return 0
        ratio = self.config.qsa_ratio
        return images.shift_from(spec.start // ratio * ratio if ratio else spec.start)

    def _execute_prefill_graph(self, spec: SegmentSpec) -> Launched | None:
        """A prompt chunk from its graph (``None``: no captured shape takes it; run it eagerly)."""
        table = self._table(spec)
        if self.graphs is not None:
            self.graphs.flush_pages()
        exports = [(int(o), int(d)) for o, d in spec.exports]
        logits = self.prefill_graphs.run(spec.slot, spec.start, spec.token_ids, table, exports,
                                         self._prompt_shift(spec))
        if logits is None:
            return None
        ends = [d for o, d in exports if o == len(spec.token_ids)]
        self.states.copy_many([spec.slot] * len(ends), ends)
        out = RunnerOutput(token_ids=[-1])
        self._sample(out, [spec], logits.float(), {0: 0})
        return Launched(out, finished=True)

    def _encode(self, images: list[ImageInput]) -> None:
        """Encode the images not in the feature cache (those of a request encoded before, such as the
        other choices of an ``n > 1`` request, are), in one tower forward."""
        if self.model.visual is None:
            raise ValueError("this checkpoint has no vision tower: its requests cannot hold images")
        tower = self.model.visual
        todo = list({im.digest: im for im in images if im.digest not in self.vision_cache}.values())
        if not todo:
            return
        pixels = torch.cat([self._pixel_values(im) for im in todo])
        with torch.inference_mode():
            features = tower(pixels, [tuple(im.grid) for im in todo])
        at = 0
        for im in todo:
            n = tower.tokens(tuple(im.grid))
            self.vision_cache[im.digest] = features[at:at + n]
            at += n
        self.images_encoded += len(todo)

    def _pixel_values(self, image: ImageInput) -> torch.Tensor:
        """An image's pixel value rows on the device: sent as they are, or computed here from its resized RGB
        bytes by the checkpoint's image processor."""
        if not image.rgb:
            rows = torch.frombuffer(bytearray(image.pixels), dtype=torch.float32)
            return rows.view(-1, self.model.visual.cfg.patch_dim).to(self.device)
        t, h, w = image.grid
        p = self.image_processor.patch_size
        if t != 1 or len(image.rgb) != h * p * w * p * 3:
            raise ValueError(f"an image of grid {image.grid} sent {len(image.rgb)} bytes of RGB, not "
                             f"{h * p} x {w * p} x 3 (patch {p})")
        rgb = torch.frombuffer(bytearray(image.rgb), dtype=torch.uint8).view(h * p, w * p, 3)
        return self.image_processor.pixel_values(rgb.to(self.device))

    def _request_images(self, images: list[ImageInput], start: int) -> RequestImages:
        """A request's images from its first uncomputed position ``start``: the features of those ending past it
        (an image wholly in the cached prefix needs none, so a cached image prompt never runs the tower)."""
        needed = images_past(images, start)
        for im in needed:
            self.vision_cache.move_to_end(im.digest)
        cfg = self.model.visual.cfg
        features = torch.cat([self.vision_cache[im.digest] for im in needed]) if needed else \
            torch.empty(0, cfg.out_hidden_size, dtype=self.model.visual.patch_embed.weight.dtype, device=self.device)
        return RequestImages(images, features, cfg.spatial_merge_size, start)

    def _execute_graph(self, specs: list[SegmentSpec]) -> Launched | None:
        """A decode batch from a CUDA graph (``None``: it does not fit one; run it eagerly). With plain
        sampling it comes back pending: sampled on the device, each id left in the slot's entry of
        ``graphs.last_ids`` for a step launched before this one is finished, and copied to the host
        without blocking."""
        for spec in specs:
            self._table(spec)
        positions = [spec.start for spec in specs]
        slots = [spec.slot for spec in specs]
        if not self.graphs.fits(slots, positions):
            return None
        logits = self.graphs.run([spec.token_ids[0] for spec in specs], positions, slots, self._rope_shifts(specs))
        ends = [(spec.slot, int(d)) for spec in specs for o, d in spec.exports if int(o) == 1]
        self.states.copy_many([s for s, _ in ends], [d for _, d in ends])
        out = RunnerOutput(token_ids=[-1] * len(specs))
        if not self._samples_on_device(specs):
            self._sample(out, specs, logits.float(), {i: i for i in range(len(specs))})
            return Launched(out, finished=True)
        params, indices = [spec.sampling or GREEDY for spec in specs], [spec.sample_index for spec in specs]
        if self.sampler.plain_greedy(params, indices):
            ids = self.graphs.greedy[:len(specs)]  # the graph's own arg-max, in last_ids already
        else:
            ids = self.sampler.sample(logits, params, indices)
            self.graphs.last_ids[self.graphs.inputs[2, :len(specs)]] = ids
        cuda = self.device.type == "cuda"
        host = torch.empty(len(specs), dtype=torch.long, pin_memory=cuda)
        host.copy_(ids, non_blocking=cuda)
        done = None
        if cuda:
            done = torch.cuda.Event()
            done.record()
        launched = Launched(out, ids=host, done=done, slots=slots)
        for slot in slots:
            self.unfinished[slot] = launched
        return launched

    def _sample(self, out: RunnerOutput, specs: list[SegmentSpec], logits: torch.Tensor,
                row_of: dict[int, int]) -> None:
        """Sample a token for every segment that asks, from its row ``row_of[i]`` of ``logits`` (fp32)."""
        sampled = [i for i, spec in enumerate(specs) if spec.sample]
        if sampled:
            picked = [row_of[i] for i in sampled]
            whole = picked == list(range(logits.shape[0]))
            rows = logits if whole else logits[torch.tensor(picked, device=self.device)]
            counts = self.counts.rows([specs[i] for i in sampled], logits.shape[-1])
            matchers = self.grammars.rows([specs[i] for i in sampled])
            masked = rows.clone() if any(m is not None for m in matchers) else rows  # log-probs read rows unmasked
            self.grammars.mask(masked, matchers)
            ids = self.sampler(masked, [specs[i].sampling or GREEDY for i in sampled],
                               [specs[i].sample_index for i in sampled], counts)
            if tp().size > 1:  # every rank goes on with rank 0's tokens (the ones the scheduler sees)
                ids = tp().broadcast(torch.tensor(ids, device=self.device)).tolist()
            if SCRIPTED:  # the tests' scripted outputs replace what was sampled
                ids = [tok if (s := scripted_output(specs[i].sample_index)) is None else s
                       for i, tok in zip(sampled, ids, strict=True)]
            for i, tok in zip(sampled, ids, strict=True):
                out.token_ids[i] = tok
                self.last_sampled[specs[i].slot] = tok
            self.counts.count(counts, [out.token_ids[i] for i in sampled])
            self.grammars.advance(matchers, [out.token_ids[i] for i in sampled])
            self._logprobs(out, rows, [specs[i] for i in sampled], sampled)

    def _logprobs(self, out: RunnerOutput, logits: torch.Tensor, specs: list[SegmentSpec], index: list[int]) -> None:
        """Log-softmax of the model's logits at the sampled rows whose request asked: the chosen
        token's value and the top ``logprobs`` alternatives, moved to the host in one copy."""
        want = [(j, spec.sampling.logprobs) for j, spec in enumerate(specs)
                if spec.sampling is not None and spec.sampling.logprobs >= 0]
        if not want:
            return
        rows = torch.tensor([j for j, _ in want], device=logits.device)
        lp = torch.log_softmax(logits[rows], dim=-1)
        chosen = torch.tensor([out.token_ids[index[j]] for j, _ in want], device=logits.device)
        k = max(n for _, n in want)
        top = lp.topk(k, dim=-1) if k else None
        host = torch.cat([lp.gather(1, chosen[:, None])] + ([top.values, top.indices.to(lp.dtype)] if k else []),
                         dim=1).cpu()
        for r, (j, n) in enumerate(want):
            row = host[r].tolist()
            out.logprobs[index[j]] = TokenLogprob(logprob=row[0], top_ids=[int(x) for x in row[1 + k:1 + k + n]],
                                                  top_logprobs=row[1:1 + n])

    def _prompt_logprobs(self, streams, pending, row0: int, spec: SegmentSpec, block: int = 256) -> list[TokenLogprob]:
        """Log-softmax of the logits of rows ``row0 + j`` at ``spec.prompt_targets[j]``, with the top
        ``spec.prompt_logprobs`` alternatives; ``block`` rows of logits at a time."""
        k = max(spec.prompt_logprobs, 0)
        entries: list[TokenLogprob] = []
        for lo in range(0, len(spec.prompt_targets), block):
            targets = torch.tensor(spec.prompt_targets[lo:lo + block], device=self.device)
            rows = torch.arange(row0 + lo, row0 + lo + targets.numel(), device=self.device)
            lp = torch.log_softmax(self.model.logits(streams, pending, rows).float(), dim=-1)
            parts = [lp.gather(1, targets[:, None])]
            if k:
                top = lp.topk(k, dim=-1)
                parts += [top.values, top.indices.to(lp.dtype)]
            for row in torch.cat(parts, dim=1).cpu().tolist():
                entries.append(TokenLogprob(logprob=row[0], top_ids=[int(x) for x in row[1 + k:]],
                                            top_logprobs=row[1:1 + k]))
        return entries

    def _ple_rows_ahead(self, outer: ForwardBatch, cuts: list[int]) -> dict[int, RowsAhead]:
        """For each PLE layer whose table is pinned in host memory, its rows for the whole segment, gathered
        chunk by chunk (``cuts``) on worker threads while the first layers run."""
        ahead = {}
        for layer in self.model.model.layers:
            if layer.ple is not None and isinstance(layer.ple.ple_embedding.table, PinnedTable):
                if self._ple_worker is None:
                    self._ple_worker = ThreadPoolExecutor(PLE_WORKERS, thread_name_prefix="ple-rows")
                embedding = layer.ple.ple_embedding
                ahead[layer.layer_idx] = RowsAhead(embedding.table, embedding.row_ids(outer), cuts, self._ple_worker)
        return ahead

    def _forward_batch(self, specs, decode_only: bool = False) -> ForwardBatch:
        segments, ids = [], []
        row = 0
        for spec in specs:
            n = len(spec.token_ids)
            if n == 0:
                raise ValueError(f"segment of request {spec.rid} has no tokens")
            ids.extend(spec.token_ids)
            segments.append(Segment(slot=spec.slot, start=spec.start, length=n, row0=row, pages=self._table(spec),
                                    exports=[(int(o), int(d)) for o, d in spec.exports],
                                    images=self.images.get(spec.slot)))
            row += n
        if self.graphs is not None:  # the device tables follow every batch, not only graph steps
            self.graphs.flush_pages()
        eos = self.config.ngram_eos_id
        ratio = self.config.qsa_ratio
        return build_forward_batch(segments, ids, self.kv, self.states, eos, self.device, qsa_ratio=ratio,
                                   decode_only=decode_only)

    def _table(self, spec: SegmentSpec) -> list[int]:
        """The slot's page table with this segment's delta applied (columns from ``page_base`` on)."""
        table = self.page_tables.setdefault(spec.slot, [])
        if table[spec.page_base:] != spec.pages:
            del table[spec.page_base:]
            table.extend(spec.pages)
            if self.graphs is not None:
                self.graphs.pages(spec.slot, spec.page_base, list(spec.pages))
        return table

    def _finish_states(self, fb: ForwardBatch) -> None:
        """The n-gram context of every segment's slot and internal export; end-of-segment exports.

        Layers write each segment's final state into its own slot and internal exports into theirs;
        an export at a segment's end is that final state, copied here once for every state tensor.
        """
        note_ngram_contexts(fb)
        ends = [(seg.slot, dst) for seg in fb.segments for off, dst in seg.exports if off == seg.length]
        self.states.copy_many([s for s, _ in ends], [d for _, d in ends])

def build_runner(args, config: ModelConfig, sizes, model_path: str, device: str | None = None,
                 after_weights=None, exact_table_scale: bool = True) -> ModelRunner:
    """Load weights and allocate the pools ``sizes`` describes on ``args``' device; with offload, the
    expert store (its cache sized last, from what is left); PLE tables per ``--ple-backend``.
    ``after_weights()`` runs between the two; ``exact_table_scale``: see :func:`~.loader.fill_random`."""
    from .loader import DTYPES, load_model, resolve_dtype
    from .offload.ple_table import DiskTable, PinnedTable, SeededTable, find_ple_shards

    device = device or args.resolved_device()
    dtype = resolve_dtype(args.dtype, config, device)
    began = time.perf_counter()
    model, _ = load_model(model_path, device=device, dtype=dtype, load_format=args.load_format, seed=args.seed,
                          moe_strategy=args.moe_strategy, ple_backend=args.ple_backend,
                          quantization=args.quantization, config=config, exact_table_scale=exact_table_scale)
    load_s = time.perf_counter() - began
    if after_weights is not None:
        after_weights()
    pools_began = time.perf_counter()
    # One page and one slot beyond the scheduler's counts: the padding rows of decode graphs.
    kv = KVPool(config, sizes.num_pages + 1, sizes.page_size, device, dtype)
    states = StatePool(config, sizes.num_slots + 1, device, dtype)
    for name, module in model.named_modules():
        if name.endswith("ple.ple_embedding"):
            table = f"{name}.ngram_embedding.weight"
            if args.ple_backend == "pinned":
                module.table = PinnedTable(module.ngram_embedding.weight.data)
            elif args.ple_backend == "disk":  # whole rows on every rank
                dim = module.dim_per_head
                rows = config.ngram_table_rows(config.ple_layers.index(int(name.split(".")[2])))
                if args.load_format == "random":
                    scale = module.get_buffer("ngram_embedding.weight_scale") if module.fp8 else None
                    module.table = SeededTable(table, rows, dim, args.seed,
                                               DTYPES.get(config.torch_dtype, torch.bfloat16),
                                               module.ngram_embedding.weight.dtype, scale)
                    continue
                parts = find_ple_shards(model_path, table, dim)
                if sum(p.rows for p in parts) != rows:
                    raise ValueError(f"the shards of {table} hold {sum(p.rows for p in parts)} rows, expected {rows}")
                module.table = DiskTable(parts, dim, dtype)
    if args.hc_prefill_mode == "shard" and tp().size > 1:  # row sharding mixes with whole down weights
        for module in model.modules():
            if isinstance(module, GatedResidual):
                module.full_down_weight()
    store = None
    if args.moe_strategy == "offload":
        experts = {layer.layer_idx: layer.mlp.experts for layer in model.model.layers}
        slots = args.moe_cache_slots or expert_cache_auto(args, config, kv, experts, device)
        store = ExpertStore({i: e.gate_up for i, e in experts.items()}, {i: e.down for i, e in experts.items()},
                            slots, device)
        for e in experts.values():
            e.store = store
    runner = ModelRunner(model, config, kv, states, device, seed=args.seed, expert_store=store, model_path=model_path)
    if decode_graphs(args, device, offloaded=store is not None, ranks=tp().size):
        max_pages = min(sizes.num_pages, -(-(sizes.max_model_len + 1) // sizes.page_size))
        runner.use_graphs(min(args.max_running_requests, sizes.request_slots), max_pages, capture=True)
        if not args.disable_prefill_graph and gdn_prefill_on_device(dtype, device):
            runner.use_prefill_graphs(max_pages, capture=True, max_tokens=prompt_graph_tokens(args))
    logger.info("model loaded in %.1f s, pools and tables set up in %.1f s", load_s,
                time.perf_counter() - pools_began)
    return runner


def prompt_graph_tokens(args) -> int:
    """The longest prompt chunk a prompt graph takes: ``--prefill-graph-max-tokens``, at most the longest chunk
    the scheduler sends (``--max-prefill-length``)."""
    return min(args.prefill_graph_max_tokens, args.max_prefill_length or args.prefill_graph_max_tokens)


def decode_graphs(args, device: str, offloaded: bool, ranks: int) -> bool:
    """Whether decode batches replay CUDA graphs. Graphs replay a fixed sequence of device work: not
    with experts fetched from the host or PLE rows read from disk (a pinned table's rows the device reads
    itself), not across ranks (the collectives are issued eagerly), and not while TIDAL_KERNELS sends
    operations to torch references that read values back to the host."""
    if (torch.device(device).type != "cuda" or args.disable_cuda_graph or offloaded or args.ple_backend == "disk"
            or ranks != 1):
        return False
    if forces_torch():
        logger.warning("TIDAL_KERNELS=%s: decode runs without CUDA graphs", os.environ.get("TIDAL_KERNELS"))
        return False
    return True


def expert_cache_auto(args, config: ModelConfig, kv: KVPool, experts: dict, device: str) -> int:
    """``--moe-cache-auto`` (and the default under offload): the experts that fit in 90% of the device
    memory left after weights, pools, ``--kv-reserve-tokens`` of KV and the two whole-layer buffers;
    on the CPU, every expert."""
    total = config.num_experts * len(experts)
    if torch.device(device).type != "cuda":
        return total
    one = next(iter(experts.values()))
    expert_bytes = quant.expert_bytes(one.gate_up) + quant.expert_bytes(one.down)
    free, _ = torch.cuda.mem_get_info(torch.device(device))
    free -= (args.kv_reserve_tokens or 0) * kv.bytes_per_token() + 2 * config.num_experts * expert_bytes
    slots = int(free * 0.9) // expert_bytes
    if slots < config.num_experts_per_tok:
        raise RuntimeError(f"--moe-cache-auto: only {max(slots, 0)} experts fit on the device after the weights, "
                           f"pools and --kv-reserve-tokens; a token needs {config.num_experts_per_tok}")
    return min(slots, total)
