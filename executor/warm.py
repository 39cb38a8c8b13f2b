"""The warm-up before ready: forwards that meet every kernel variant a served batch can meet, and every
decode graph captured, so that no request pays for compilation or capture.

Triton compiles a kernel once per specialization: its constexprs (block sizes that tidal's launchers
pick from powers of two of the sizes) and its integer arguments' classes (equal to 1, divisible by 16,
neither). The warm-up therefore runs prefill forwards of 1 token and of each power of two up to the
prefill budget (plus a decode row per running request), one less and one more; a continuation over a
cached context; a forward mixing prefill rows with decode rows; a layer-major prefill when the server
runs those; eager decode steps (rows that sample on the host) across batch sizes; each sampling path
(greedy, filtered random, log-probabilities); and, with CUDA graphs, every graph shape
(:meth:`DecodeGraphs.shapes`). Its forwards use the pools while nothing is admitted yet: every slot
they touch starts fresh on its first real request and every page they write is overwritten before it
is read.

Compiled kernels persist in ``--compile-cache`` (Triton's cache directory), so a second start loads
them instead of compiling. After ready, :class:`CompileCounter` counts what the warm-up missed: Triton
compilations and graph captures, both exported as metrics, 0 when the warm-up met everything.
"""

from __future__ import annotations

import logging
import os
import time

from ..messages import Batch, SamplingParams, SegmentSpec
from .progress import progress

logger = logging.getLogger(__name__)

GREEDY = SamplingParams()
RANDOM = SamplingParams(temperature=0.7, top_p=0.9, top_k=20, seed=0)
# Rows that sample on the host keep a decode step off the graphs: it runs eagerly.
HOST_SAMPLED = SamplingParams(logprobs=1)


def use_compile_cache(path: str, explicit: bool) -> None:
    """Keep Triton's compiled kernels in ``path`` (before anything compiles); a ``TRITON_CACHE_DIR`` set
    in the environment wins over the default (not over an ``explicit`` path)."""
    if not explicit and os.environ.get("TRITON_CACHE_DIR"):
        return
    triton_dir = os.path.join(path, "triton")
    try:
        os.makedirs(triton_dir, exist_ok=True)
    except OSError as e:
        if explicit:
            raise SystemExit(f"--compile-cache {path}: cannot create it ({e})") from e
        logger.warning("no compile cache in %s (%s): kernels compile again on every start", path, e)
        return
    os.environ["TRITON_CACHE_DIR"] = triton_dir


def prefill_lengths(limit: int) -> list[int]:
    """Prefill forward sizes (tokens) that meet every specialization a forward of up to ``limit`` tokens
    meets."""
    lengths = {1, limit - 1, limit, limit - limit % 16}
    power = 2
    while power <= limit:
        lengths |= {power - 1, power, power + 1}
        power *= 2
    return sorted(n for n in lengths if 1 <= n <= limit)


class CompileCounter:
    """Counts Triton compilations in this process (each kernel specialization first met here, compiled
    or loaded from the cache) and decode-graph captures; ``after_ready``: those since :meth:`ready`."""

    def __init__(self) -> None:
        self.compiles = 0
        self.graphs = None
        self.missed: list[str] = []  # what compiled after ready (the kernel and its specialization)
        self._at_ready: tuple[int, int] | None = None
        try:
            from triton import knobs
        except ImportError:  # no Triton: nothing compiles
            return
        previous = knobs.runtime.jit_cache_hook

        def hook(*args, **kwargs):
            self.compiles += 1
            if self._at_ready is not None:
                what = kwargs.get("repr", "a kernel")
                self.missed.append(what)
                logger.warning("compiling %s after ready", what)
            return previous(*args, **kwargs) if previous is not None else False

        knobs.runtime.jit_cache_hook = hook

    @property
    def captures(self) -> int:
        return self.graphs.captures if self.graphs is not None else 0

    def ready(self) -> None:
        self._at_ready = (self.compiles, self.captures)

    def after_ready(self) -> tuple[int, int]:
        """``(compilations, captures)`` since ready."""
        if self._at_ready is None:
            return 0, 0
        return self.compiles - self._at_ready[0], self.captures - self._at_ready[1]


class WarmUp:
    """The warm-up forwards of one runner, for pools of ``num_slots`` request slots and ``num_pages``
    pages; ``max_prefill`` tokens per prefill forward, ``max_rows`` running requests. Slot 0 takes the
    long prefills (pages from 0 on); every other slot holds at most ``SHORT`` tokens, in pages of its own
    after those."""

    SHORT = 33

    def __init__(self, runner, num_slots: int, num_pages: int, max_prefill: int, max_rows: int,
                 layer_major_chunk: int = 0):
        self.runner = runner
        self.page = runner.kv.page_size
        pool_half = num_pages * self.page // 2
        # A forward holds up to the prefill budget plus a decode row of every other running request.
        self.max_prefill = max(1, min(max_prefill + max_rows, pool_half))
        # Layer-major prefills (``layer_major_chunk`` tokens an internal chunk; 0: none): one of two and a
        # half internal chunks.
        self.layer_major_chunk = layer_major_chunk
        self.layer_major = min(2 * layer_major_chunk + layer_major_chunk // 2 + 1, pool_half)
        self.long_pages = -(-max(self.max_prefill, self.layer_major if layer_major_chunk else 0) // self.page)
        self.short_pages = -(-self.SHORT // self.page)
        room = (num_pages - self.long_pages) // self.short_pages
        self.max_rows = max(1, min(max_rows, num_slots - 1, room))
        self.vocab = runner.config.vocab_size
        self._batch_id = 0

    def steps(self) -> list[tuple[str, object]]:
        """The warm-up as a list of ``(what, argument)`` steps (the progress bar's units)."""
        out: list[tuple[str, object]] = [("prefill", n) for n in prefill_lengths(self.max_prefill)]
        out += [("continuation", None), ("mixed", None), ("sampling", None)]
        if self.layer_major_chunk:
            out.append(("layer_major", self.layer_major))
        out += [("decode", rows) for rows in prefill_lengths(self.max_rows)]  # the same classes, in rows
        graphs = self.runner.graphs
        if graphs is not None and graphs.capture:
            out += [("graph", key) for key in graphs.shapes()]
        return out

    def run(self) -> float:
        """Run every step; the seconds it took."""
        t0 = time.perf_counter()
        for what, arg in progress(self.steps(), desc="warming up", unit="step"):
            getattr(self, f"_{what}")(arg)
        self.runner.synchronize()
        return time.perf_counter() - t0

    # -- segments ------------------------------------------------------------------------------------

    def _pages(self, slot: int, start: int, n: int) -> tuple[int, list[int]]:
        """``(page_base, pages)`` of a segment of ``n`` tokens at ``start`` in ``slot``: the pages its rows
        add to the slot's table."""
        first = 0 if slot == 0 else self.long_pages + (slot - 1) * self.short_pages
        have, need = -(-start // self.page), -(-(start + n) // self.page)
        return have, list(range(first + have, first + need))

    def _segment(self, slot: int, start: int, n: int, sampling: SamplingParams = GREEDY) -> SegmentSpec:
        if slot and start + n > self.SHORT:
            raise ValueError(f"warm-up segment of slot {slot} past {self.SHORT} tokens")
        base, pages = self._pages(slot, start, n)
        ids = [(7 * (start + i) + 13 * slot + 1) % self.vocab for i in range(n)]
        return SegmentSpec(rid=f"warm{slot}", slot=slot, start=start, token_ids=ids, pages=pages, page_base=base,
                           sample=True, sampling=sampling, sample_index=int(n == 1 and start > 0))

    def _run(self, *segments: SegmentSpec, **batch) -> None:
        self._batch_id -= 1  # negative ids: never a scheduler's
        self.runner.execute(Batch(batch_id=self._batch_id, segments=list(segments), **batch))

    # -- steps ---------------------------------------------------------------------------------------

    def _prefill(self, n: int) -> None:
        self._run(self._segment(0, 0, n))

    def _continuation(self, _) -> None:
        """A prompt's second chunk, over the first one's cached context."""
        first = min(64, max(1, self.max_prefill // 2))
        self._run(self._segment(0, 0, first))
        self._run(self._segment(0, first, min(64, self.max_prefill - first) or 1))

    def _mixed(self, _) -> None:
        """One request prefilling while others decode, in one forward."""
        rows = [1 + r for r in range(min(2, self.max_rows - 1))]
        for slot in rows:
            self._run(self._segment(slot, 0, 16))
        self._run(*[self._segment(slot, 16, 1) for slot in rows], self._segment(0, 0, min(32, self.max_prefill)))

    def _layer_major(self, n: int) -> None:
        self._run(self._segment(0, 0, n), mode="layer_major", chunk_size=self.layer_major_chunk)

    def _sampling(self, _) -> None:
        self._run(self._segment(0, 0, 3, RANDOM))
        self._run(self._segment(0, 0, 3, HOST_SAMPLED))

    def _decode(self, rows: int) -> None:
        """``rows`` decode rows, sampled on the host (an eager step, not a graph's)."""
        slots = range(1, rows + 1)
        self._run(*[self._segment(slot, 0, 1, HOST_SAMPLED) for slot in slots])
        self._run(*[self._segment(slot, 1, 1, HOST_SAMPLED) for slot in slots])

    def _graph(self, key: tuple[int, int]) -> None:
        self.runner.graphs.prepare(key)
