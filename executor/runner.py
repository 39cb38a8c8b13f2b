"""Runs one ``Batch``: state copies, one forward over all segments, logits, sampling."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..config import ModelConfig
from ..messages import Batch, SamplingParams
from .forward_batch import ForwardBatch, Segment
from .memory import KVPool, StatePool
from .models import Qwen4ExpForCausalLM
from .sampler import Sampler

GREEDY = SamplingParams()


@dataclass
class RunnerOutput:
    # One id per segment, -1 where the segment did not sample.
    token_ids: list[int]
    # Segment index -> fp32 logits [len, vocab] for segments that asked (offline scoring).
    logits: dict[int, torch.Tensor] = field(default_factory=dict)


class ModelRunner:
    def __init__(self, model: Qwen4ExpForCausalLM, config: ModelConfig, kv: KVPool, states: StatePool,
                 device: torch.device | str, seed: int = 0):
        self.model, self.config = model, config
        self.kv, self.states = kv, states
        self.device = torch.device(device)
        self.sampler = Sampler(self.device, seed)

    @torch.inference_mode()
    def execute(self, batch: Batch) -> RunnerOutput:
        for src, dst in batch.copies:
            self.states.copy(src, dst)
        fb = self._forward_batch(batch)
        streams = self.model(fb)
        self._advance_ngram_context(fb, batch)

        # Rows that need logits: every row of a scoring segment, the last row of a sampling one.
        rows: list[int] = []
        spans: list[tuple[int, int]] = []
        for spec, seg in zip(batch.segments, fb.segments):
            first = len(rows)
            if spec.want_logits:
                rows.extend(range(seg.row0, seg.row0 + seg.length))
            elif spec.sample:
                rows.append(seg.row0 + seg.length - 1)
            spans.append((first, len(rows)))
        out = RunnerOutput(token_ids=[-1] * len(batch.segments))
        if not rows:
            return out
        logits = self.model.logits(streams[torch.tensor(rows, device=self.device)]).float()
        sampled = [i for i, spec in enumerate(batch.segments) if spec.sample]
        for i, spec in enumerate(batch.segments):
            if spec.want_logits:
                out.logits[i] = logits[spans[i][0]:spans[i][1]]
        if sampled:
            last_rows = torch.tensor([spans[i][1] - 1 for i in sampled], device=self.device)
            ids = self.sampler(logits[last_rows], [batch.segments[i].sampling or GREEDY for i in sampled],
                               [batch.segments[i].sample_index for i in sampled])
            for i, tok in zip(sampled, ids):
                out.token_ids[i] = tok
        return out

    def _forward_batch(self, batch: Batch) -> ForwardBatch:
        ids, positions, segments, contexts = [], [], [], []
        row = 0
        width = self.states.ngram_context.shape[1]
        eos = self.config.ple_eos_id if self.config.ple_layer_ids else 0
        for spec in batch.segments:
            n = len(spec.token_ids)
            if n == 0:
                raise ValueError(f"segment of request {spec.rid} has no tokens")
            ids.extend(spec.token_ids)
            positions.extend(range(spec.start, spec.start + n))
            page_table = torch.tensor(spec.pages, dtype=torch.long, device=self.device) if spec.pages else None
            seg = Segment(slot=spec.slot, start=spec.start, length=n, row0=row, page_table=page_table,
                          exports=[(int(o), int(d)) for o, d in spec.exports])
            segments.append(seg)
            if seg.fresh:
                contexts.append(torch.full((width,), eos, dtype=torch.long, device=self.device))
            else:
                contexts.append(self.states.ngram_context[spec.slot].clone())
            row += n
        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.long, device=self.device),
            positions=torch.tensor(positions, dtype=torch.long, device=self.device),
            segments=segments, kv=self.kv, states=self.states, ngram_context=contexts,
        )

    def _advance_ngram_context(self, fb: ForwardBatch, batch: Batch) -> None:
        width = self.states.ngram_context.shape[1]
        if width == 0:
            return
        for seg, context in zip(fb.segments, fb.ngram_context):
            history = torch.cat([context, fb.input_ids[seg.rows]])
            for off, dst in seg.exports:
                self.states.ngram_context[dst] = history[off:off + width]
            self.states.ngram_context[seg.slot] = history[-width:]


def build_runner(args, config: ModelConfig, sizes, model_path: str) -> ModelRunner:
    """Load weights and allocate the pools ``sizes`` describes on ``args``' device."""
    from .loader import load_model, resolve_dtype

    device = args.resolved_device()
    dtype = resolve_dtype(args.dtype, config, device)
    model, _ = load_model(model_path, device=device, dtype=dtype, load_format=args.load_format, seed=args.seed)
    kv = KVPool(config, sizes.num_pages, sizes.page_size, device, dtype)
    states = StatePool(config, sizes.num_slots, device, dtype)
    return ModelRunner(model, config, kv, states, device, seed=args.seed)
