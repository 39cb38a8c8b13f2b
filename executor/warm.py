"""The warm-up before ready: forwards that meet every kernel variant a served batch can meet, and every
decode graph captured, so that no request pays for compilation or capture.

Triton compiles a kernel once per specialization: its constexprs (block sizes that tidal's launchers
pick from powers of two of the sizes) and its integer arguments' classes (equal to 1, divisible by 16,
neither). Each size a forward has therefore walks a ladder (:func:`ladder`: 1, each power of two up to
the limit, one less and one more, the limit and its largest multiple of 16), one axis at a time:

* tokens: prefill forwards of every ladder length up to the prefill budget plus a decode row per running
  request, each also with state exports inside and at the end (prefix-cache checkpoints);
* context: a decode row and two prompt chunks after each ladder length of cached context, up to the
  longest context the pool holds (attention and QSA block choice size their tiles by it), over the attention
  layers;
* segments: forwards of many requests: decode rows beside a prompt chunk, and many prompts at once (a burst);
* eager decode steps of the ladder's counts of rows, and of every count over the attention layers after a context
  where QSA selects its most blocks (decode attention splits its keys by the count itself and the blocks
  selected); each sampling path (greedy, filtered random, log-probabilities), a continuation, a layer-major
  prefill when the server runs those;
* with CUDA graphs, every graph shape (:meth:`DecodeGraphs.shapes`, :meth:`PrefillGraphs.shapes`), captured
  over the whole model; the steps before run their decode rows as the decode graph's step run eagerly
  (:func:`no_capture`) and their prompt chunks eagerly, over their layers.

Kernels depend on shapes, not on which layer runs them, so every forward but the graph captures runs over
one layer of each kind (:func:`layer_kinds`): the warm-up costs a few layers' time, not the model's. Its
forwards use the pools while nothing is admitted yet: every slot they touch starts fresh on its first real
request and every page they write is overwritten before it is read (the values they compute are never
looked at; the pools start zeroed, so every value they read is finite).

Compiled kernels persist in ``--compile-cache`` (Triton's cache directory), so a second start loads
them instead of compiling. After ready, :class:`CompileCounter` counts what the warm-up missed: Triton
compilations and graph captures, both exported as metrics, 0 when the warm-up met everything.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time

from torch import nn

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


def ladder(limit: int) -> list[int]:
    """Sizes that meet every specialization a size of 1 to ``limit`` meets: each tile it pads to (a power of
    two), and within it the classes of Triton's integer arguments (equal to 1, divisible by 16, neither)."""
    lengths = {1, limit - 1, limit, limit - limit % 16}
    power = 2
    while power <= limit:
        lengths |= {power - 1, power, power + 1}
        power *= 2
    return sorted(n for n in lengths if 1 <= n <= limit)


def layer_signature(layer: nn.Module) -> tuple:
    """What the kernels of a decoder layer can depend on: its module types and its tensors' names, shapes and
    dtypes (the layer's index is not among them)."""
    modules = tuple((name, type(m).__name__) for name, m in layer.named_modules())
    tensors = tuple((name, tuple(t.shape), t.dtype) for name, t in layer.state_dict(keep_vars=True).items())
    return modules, tensors


def layer_kinds(layers) -> list[int]:
    """Positions in ``layers`` of one layer of each kind: the first layer (the only one that takes no residual
    from a layer before it) and the first of each :func:`layer_signature` after it."""
    keep, seen = [], set()
    for i, layer in enumerate(layers):
        signature = (i == 0, layer_signature(layer))
        if signature not in seen:
            seen.add(signature)
            keep.append(i)
    return keep


@contextlib.contextmanager
def only_layers(model, positions: list[int]):
    """Forwards of ``model`` (a ``Qwen4ExpForCausalLM``) run through its decoder layers at ``positions`` only,
    until the block ends."""
    inner = model.model
    every = inner.layers
    inner.layers = nn.ModuleList([every[i] for i in positions])
    try:
        yield
    finally:
        inner.layers = every


@contextlib.contextmanager
def no_capture(runner):
    """Until the block ends, decode rows that fit a graph run its step eagerly and prompt chunks run the eager
    forward (a graph captured over some of the layers would replay only those; the eager forward's kernels
    are what the steps warm)."""
    graphs, prompts = runner.graphs, runner.prefill_graphs
    capture = graphs is not None and graphs.capture
    if capture:
        graphs.capture = False
    runner.prefill_graphs = None
    try:
        yield
    finally:
        runner.prefill_graphs = prompts
        if capture:
            graphs.capture = True


class CompileCounter:
    """Counts Triton compilations in this process (each kernel specialization first met here, compiled
    or loaded from the cache) and decode-graph captures; ``after_ready``: those since :meth:`ready`."""

    def __init__(self) -> None:
        self.compiles = 0
        self.seconds = 0.0  # spent compiling (or loading from the cache) in this process
        self.by_kernel: dict[str, float] = {}  # those seconds by kernel (every specialization of it)
        self.graphs = None  # the runner's DecodeGraphs
        self.prefill_graphs = None  # and PrefillGraphs
        self.missed: list[str] = []  # what compiled after ready (the kernel and its specialization)
        self._at_ready: tuple[int, int] | None = None
        try:
            from triton import knobs
        except ImportError:  # no Triton: nothing compiles
            return
        previous = knobs.runtime.jit_cache_hook
        previous_post = getattr(knobs.runtime, "jit_post_compile_hook", None)
        began: list[float] = []

        def hook(*args, **kwargs):
            self.compiles += 1
            if self._at_ready is not None:
                what = kwargs.get("repr", "a kernel")
                self.missed.append(what)
                logger.warning("compiling %s after ready", what)
            began.append(time.perf_counter())
            return previous(*args, **kwargs) if previous is not None else False

        def post(*args, **kwargs):
            if began:
                spent = time.perf_counter() - began.pop()
                self.seconds += spent
                fn = kwargs.get("fn")
                name = getattr(fn, "name", "?")
                self.by_kernel[name] = self.by_kernel.get(name, 0.0) + spent
            return previous_post(*args, **kwargs) if previous_post is not None else None

        knobs.runtime.jit_cache_hook = hook
        knobs.runtime.jit_post_compile_hook = post

    @property
    def captures(self) -> int:
        return sum(g.captures for g in (self.graphs, self.prefill_graphs) if g is not None)

    def slowest(self, n: int = 8) -> str:
        """The kernels that took longest to compile, with their seconds."""
        top = sorted(self.by_kernel.items(), key=lambda kv: -kv[1])[:n]
        return ", ".join(f"{name} {sec:.1f} s" for name, sec in top)

    def ready(self) -> None:
        self._at_ready = (self.compiles, self.captures)

    def after_ready(self) -> tuple[int, int]:
        """``(compilations, captures)`` since ready."""
        if self._at_ready is None:
            return 0, 0
        return self.compiles - self._at_ready[0], self.captures - self._at_ready[1]


class WarmUp:
    """The warm-up forwards of one runner over its pools (``sizes``, a ``PoolSizes``): ``max_prefill`` tokens per
    prefill forward, ``max_rows`` running requests, ``layer_major_chunk`` tokens an internal chunk of a
    layer-major prefill (0: the server runs none).

    Every forward takes pages from the first page on (they hold whatever an earlier forward left), each segment
    a page table of its own covering its context and tokens, so any context up to the pool's size can be met;
    requests' slots from 0, checkpoint exports go to the prefix cache's slots."""

    # Prompt chunks after a cached context: an odd length and a multiple of 16.
    CHUNKS = (17, 64)
    # Tokens of each request of a burst (many prompts in one forward), at most.
    BURST = 1024

    def __init__(self, runner, sizes, max_prefill: int, max_rows: int, layer_major_chunk: int = 0):
        self.runner = runner
        self.page = runner.kv.page_size
        self.num_pages = sizes.num_pages
        tokens = self.num_pages * self.page
        self.max_rows = max(1, min(max_rows, sizes.request_slots))
        # A forward holds up to the prefill budget plus a decode row of every other running request.
        self.max_prefill = max(1, min(max_prefill + self.max_rows, tokens - self.page * self.max_rows))
        # The longest cached context a forward can meet: a request of up to --max-model-len tokens in the pool.
        self.max_context = max(1, min(sizes.max_model_len, tokens) - max(self.CHUNKS) - self.page)
        self.export_slots = list(range(sizes.request_slots, sizes.num_slots))[:2]
        self.layer_major_chunk = layer_major_chunk
        self.layer_major = min(2 * layer_major_chunk + layer_major_chunk // 2 + 1, tokens - self.page)
        self.vocab = runner.config.vocab_size
        c = runner.config
        self.wide_context = min(self.max_context, c.indexer_budget + c.indexer_compress_ratio) if c.has_qsa else 1
        layers = runner.model.model.layers
        self.kinds = layer_kinds(layers)
        self.attention_kinds = [i for i in self.kinds if not layers[i].is_linear] or self.kinds
        self._batch_id = 0
        self._next_page = 0

    def steps(self) -> list[tuple[str, object]]:
        """The warm-up as a list of ``(what, argument)`` steps (the progress bar's units)."""
        out: list[tuple[str, object]] = [("prefill", n) for n in ladder(self.max_prefill)]
        if self.export_slots:
            out += [("exports", n) for n in ladder(self.max_prefill) if n > 64]
        out += [("context", c) for c in ladder(self.max_context) if c > 1]
        out += [("segments", r) for r in ladder(self.max_rows - 1)] if self.max_rows > 1 else []
        out += [("burst", r) for r in ladder(self.max_rows) if r > 1]
        out += [("decode", rows) for rows in ladder(self.max_rows)]
        out += [("decode_wide", rows) for rows in range(1, self.max_rows + 1)]
        out += [("continuation", None), ("sampling", None)]
        if self.layer_major_chunk:
            out.append(("layer_major", self.layer_major))
        graphs = self.runner.graphs
        if graphs is not None and graphs.capture:
            out += [("graph", key) for key in graphs.shapes()]
        prompts = self.runner.prefill_graphs
        if prompts is not None and prompts.capture:
            out += [("prefill_graph", key) for key in prompts.shapes()]
        return out

    def run(self, steps: list[tuple[str, object]] | None = None, show: bool = True) -> float:
        """Run ``steps`` (default: every step); the seconds it took."""
        t0 = time.perf_counter()
        for what, arg in progress(self.steps() if steps is None else steps, desc="warming up", unit="step",
                                  show=show):
            self.run_step(what, arg)
        self.runner.synchronize()
        return time.perf_counter() - t0

    def run_step(self, what: str, arg) -> None:
        if what == "graph":  # a captured step replays the whole model
            self._graph(arg)
            return
        if what == "prefill_graph":
            self.runner.prefill_graphs.prepare(arg)
            return
        with (only_layers(self.runner.model, self.layers_for(what, arg)),
              no_capture(self.runner)):
            getattr(self, f"_{what}")(arg)

    def layers_for(self, what: str, arg) -> list[int]:
        """The layers a step runs through: one of each kind, or only the attention kinds for what only attention
        depends on (a cached context's length; every count of decode rows, which with the blocks QSA selects sizes
        the key splits of decode attention)."""
        return self.attention_kinds if what in ("context", "decode_wide") else self.kinds

    # -- segments ------------------------------------------------------------------------------------

    def _segment(self, slot: int, start: int, n: int, sampling: SamplingParams = GREEDY,
                 exports: list[tuple[int, int]] = ()) -> SegmentSpec:
        """A segment of ``n`` tokens after ``start`` cached ones, its whole page table new (pages taken from
        those the forward has not taken yet)."""
        need = -(-(start + n) // self.page)
        if self._next_page + need > self.num_pages:
            raise ValueError(f"warm-up forward past the pool's {self.num_pages} pages")
        pages = list(range(self._next_page, self._next_page + need))
        self._next_page += need
        ids = [(7 * (start + i) + 13 * slot + 1) % self.vocab for i in range(n)]
        return SegmentSpec(rid=f"warm{slot}", slot=slot, start=start, token_ids=ids, pages=pages, page_base=0,
                           sample=True, sampling=sampling, sample_index=int(n == 1 and start > 0),
                           exports=[list(e) for e in exports])

    def _run(self, *segments: SegmentSpec, **batch) -> None:
        self._batch_id -= 1  # negative ids: never a scheduler's
        self._next_page = 0
        self.runner.execute(Batch(batch_id=self._batch_id, segments=list(segments), **batch))

    # -- steps ---------------------------------------------------------------------------------------

    def _prefill(self, n: int) -> None:
        self._run(self._segment(0, 0, n))

    def _exports(self, n: int) -> None:
        """A prompt chunk that exports its state inside (coalesced checkpoints: one, or two with a branch
        point) and at its end."""
        last = (n - 1) // 64 * 64
        inside = sorted({64, last}) if n > 128 else [last]
        dst = self.export_slots
        exports = [(p, dst[i % len(dst)]) for i, p in enumerate(inside)] + [(n, dst[-1])]
        self._run(self._segment(0, 0, n, exports=exports))

    def _context(self, c: int) -> None:
        """A decode row and prompt chunks after ``c`` cached tokens."""
        self._run(self._segment(0, c, 1, HOST_SAMPLED))
        for n in self.CHUNKS:
            self._run(self._segment(0, c, n))

    def _segments(self, rows: int) -> None:
        """``rows`` decode rows beside a prompt chunk, in one forward."""
        self._run(*[self._segment(slot, 16, 1, HOST_SAMPLED) for slot in range(1, rows + 1)],
                  self._segment(0, 0, min(32, self.max_prefill - rows)))

    def _burst(self, count: int) -> None:
        """``count`` prompts in one forward, sharing the prefill budget."""
        n = max(1, min(self.BURST, self.max_prefill // count, (self.num_pages // count - 1) * self.page))
        self._run(*[self._segment(slot, 0, n) for slot in range(count)])

    def _continuation(self, _) -> None:
        """A prompt's second chunk, over the first one's cached context."""
        first = min(64, max(1, self.max_prefill // 2))
        self._run(self._segment(0, 0, first))
        self._run(self._segment(0, first, min(64, self.max_prefill - first) or 1))

    def _layer_major(self, n: int) -> None:
        self._run(self._segment(0, 0, n), mode="layer_major", chunk_size=self.layer_major_chunk)

    def _sampling(self, _) -> None:
        self._run(self._segment(0, 0, 3, RANDOM))
        self._run(self._segment(0, 0, 3, HOST_SAMPLED))

    def _decode_wide(self, rows: int) -> None:
        """``rows`` decode rows after a context where QSA selects its most blocks (as far as the pool holds that
        many): the most keys decode attention splits."""
        c = min(self.wide_context, (self.num_pages // rows - 1) * self.page - 1)
        self._run(*[self._segment(slot, max(1, c), 1, HOST_SAMPLED) for slot in range(rows)])

    def _decode(self, rows: int) -> None:
        """``rows`` decode rows, sampled on the host (an eager step, not a graph's)."""
        slots = range(rows)
        self._run(*[self._segment(slot, 0, 1, HOST_SAMPLED) for slot in slots])
        self._run(*[self._segment(slot, 1, 1, HOST_SAMPLED) for slot in slots])

    def _graph(self, key: tuple[int, int]) -> None:
        self.runner.graphs.prepare(key)
