"""Offline API: the scheduler and the model runner of the server, in one process."""

from __future__ import annotations

import itertools
from typing import Any

import torch

from .config.model import ModelConfig
from .config.pools import pool_sizes
from .config.server_args import ServerArgs
from .executor.runner import build_runner
from .messages import Detokenize, GenerateReq, ImageInput, SamplingParams
from .scheduler import Scheduler


class GenerationError(RuntimeError):
    pass


class LLM:
    """``LLM(model_path).generate([[ids...], ...], max_tokens=16)`` -> output ids per prompt.

    Extra keyword arguments are server flags (``ServerArgs`` fields), e.g. ``page_size=16``.
    """

    def __init__(self, model_path: str, device: str = "cpu", dtype: str = "float32",
                 max_prefill_length: int | None = None, **server_args: Any):
        self.args = ServerArgs(model=model_path, device=device, dtype=dtype,
                               max_prefill_length=max_prefill_length, **server_args)
        self.config = ModelConfig.from_file(model_path).with_quantization(self.args.quantization,
                                                                          self.args.load_format)
        self.sizes = pool_sizes(self.args, self.config)
        self.runner = build_runner(self.args, self.config, self.sizes, model_path)
        self._events: list[object] = []
        self.scheduler = Scheduler(self.args, self.config, self.sizes, self._events.append)
        self._ids = itertools.count()

    def generate(self, prompts: list[list[int]], max_tokens: int = 16, temperature: float = 0.0,
                 ignore_eos: bool = False, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0,
                 seed: int | None = None, images: list[list[ImageInput]] | None = None) -> list[list[int]]:
        """Generated ids of each prompt; ``images[i]``: prompt ``i``'s images (``tidal.vision.image_input``),
        whose placeholder runs it holds."""
        sampling = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed)
        rids = []
        for i, prompt in enumerate(prompts):
            rid = f"offline-{next(self._ids)}"
            rids.append(rid)
            self.scheduler.add_request(GenerateReq(rid=rid, prompt_ids=list(prompt), max_tokens=max_tokens,
                                                   sampling=sampling, ignore_eos=ignore_eos,
                                                   images=images[i] if images else []))
        outputs = {rid: [] for rid in rids}
        for event in self._run():
            if isinstance(event, Detokenize) and event.rid in outputs:
                if event.finish_reason == "error":
                    raise GenerationError(event.error)
                outputs[event.rid].extend(event.token_ids)
        return [outputs[rid] for rid in rids]

    def score(self, token_ids: list[int], images: list[ImageInput] | None = None) -> torch.Tensor:
        """float32 logits ``[len, vocab]``: row ``i`` predicts token ``i + 1``."""
        rid = f"score-{next(self._ids)}"
        self.scheduler.add_request(GenerateReq(rid=rid, prompt_ids=list(token_ids), max_tokens=0,
                                               images=images or []), want_logits=True)
        parts: list[torch.Tensor] = []
        for event in self._run(collect_logits=(rid, parts)):
            if isinstance(event, Detokenize) and event.rid == rid and event.finish_reason == "error":
                raise GenerationError(event.error)
        return torch.cat(parts).cpu()

    def _run(self, collect_logits=None):
        while self.scheduler.has_work():
            batch = self.scheduler.schedule()
            if batch is None:
                raise GenerationError("requests are waiting but none can be admitted")
            try:
                out = self.runner.execute(batch)
            except Exception as e:  # the batch's requests end with the error, as a serving executor's would
                self.scheduler.fail_batch(batch, f"{type(e).__name__}: {e}")
                events, self._events[:] = list(self._events), []
                yield from events
                continue
            if collect_logits is not None:
                rid, parts = collect_logits
                for i, seg in enumerate(batch.segments):
                    if seg.rid == rid and i in out.logits:
                        parts.append(out.logits[i])
            self.scheduler.process_result(batch, out.token_ids, out.logprobs, out.prompt_logprobs)
            events, self._events[:] = list(self._events), []
            yield from events
        events, self._events[:] = list(self._events), []
        yield from events
