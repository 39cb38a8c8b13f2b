"""Structured output: per request, an llguidance matcher over the request's grammar masks the logits
of each step to the tokens the grammar allows (a JSON schema, for ``response_format``)."""

from __future__ import annotations

import torch

from ..messages import SegmentSpec
from ..tokenizer import HFTokenizer, TiktokenTokenizer, load_tokenizer
from .sampler import slot_state


class GrammarStates:
    """Matchers per state slot, built from a segment's grammar (and advanced over its ``history``
    after a resumption), advanced by every sampled token."""

    def __init__(self, model_path: str | None, eos_ids: tuple[int, ...]):
        self.model_path, self.eos_ids = model_path, eos_ids
        self._tokenizer = None
        self.slots: dict[int, tuple[str, object]] = {}

    def _lltokenizer(self):
        if self._tokenizer is None:
            from llguidance import LLTokenizer
            from llguidance.tiktoken import lltokenizer_from_encoding

            tok = load_tokenizer(self.model_path)
            eos = list(self.eos_ids or tok.eos_token_ids)
            if isinstance(tok, TiktokenTokenizer):
                self._tokenizer = lltokenizer_from_encoding(tok._enc, n_vocab=tok.n_vocab, eos_token=eos)
            elif isinstance(tok, HFTokenizer):
                self._tokenizer = LLTokenizer(tok._tok.to_str(), n_vocab=tok.n_vocab, eos_token=eos)
            else:
                raise ValueError(f"structured output does not support the tokenizer {type(tok).__name__}")
        return self._tokenizer

    def rows(self, specs: list[SegmentSpec]) -> list[object | None]:
        """The matcher of each sampled segment (``None`` without a grammar)."""
        out: list[object | None] = []
        for spec in specs:
            if spec.sampling is None or spec.sampling.grammar is None:
                out.append(None)
                continue
            out.append(slot_state(self.slots, spec, lambda spec=spec: self._build(spec)))
        return out

    def mask(self, logits: torch.Tensor, matchers: list[object | None]) -> None:
        """Set to -inf, in place, every logit a row's grammar does not allow (ids past the tokenizer's
        vocabulary included)."""
        rows = [r for r, m in enumerate(matchers) if m is not None]
        if not rows:
            return
        import llguidance.torch as lgt

        vocab = self._lltokenizer().vocab_size
        bitmask = lgt.allocate_token_bitmask(len(rows), vocab)
        for i, r in enumerate(rows):
            lgt.fill_next_token_bitmask(matchers[r], bitmask, i)
        index = torch.tensor(rows, device=logits.device)
        masked = logits[index]
        head = masked[:, :vocab].contiguous()
        lgt.apply_token_bitmask_inplace(head, bitmask.to(logits.device))
        masked[:, :vocab] = head
        masked[:, vocab:] = float("-inf")
        logits[index] = masked

    def _build(self, spec: SegmentSpec):
        from llguidance import LLMatcher

        matcher = LLMatcher(self._lltokenizer(), spec.sampling.grammar)
        generated = (spec.history or [])[spec.history_prompt:]
        if generated:
            matcher.consume_tokens(generated)
        return matcher

    @staticmethod
    def advance(matchers: list[object | None], token_ids: list[int]) -> None:
        for matcher, token in zip(matchers, token_ids, strict=True):
            if matcher is not None:
                matcher.consume_token(token)
