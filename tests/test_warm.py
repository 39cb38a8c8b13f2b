"""The warm-up before ready: its steps cover every kernel specialization class and decode-graph shape a
served batch can meet, and its forwards leave nothing behind that changes what requests generate.

(On a GPU the server's ``tidal_compilations_after_ready_total`` and
``tidal_graph_captures_after_ready_total`` count what it missed;
``test_no_compilation_or_capture_after_the_warm_up_gpu`` checks a workload leaves them at 0, and that a kernel
specialization the warm-up never met does count.)
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from tidal import LLM
from tidal.executor.warm import WarmUp, ladder, layer_kinds, only_layers
from tidal.kernels.backend import next_pow2

from .test_decode_graphs import PROMPTS, ids


def specialization(n: int) -> tuple[int, bool, bool]:
    """What a Triton launch of a size-``n`` forward can depend on: the tile it pads to, and the integer
    argument classes (== 1, divisible by 16)."""
    return next_pow2(n), n == 1, n % 16 == 0


@pytest.mark.parametrize("limit", [1, 2, 17, 64, 100, 8192, 8224, 8230])
def test_ladder_meets_every_class_up_to_the_limit(limit):
    lengths = ladder(limit)
    assert all(1 <= n <= limit for n in lengths) and len(lengths) == len(set(lengths))
    met = {specialization(n) for n in lengths}
    missing = [n for n in range(1, limit + 1) if specialization(n) not in met]
    assert not missing
    assert len(lengths) <= 3 * max(1, limit.bit_length()) + 3


@pytest.mark.parametrize("preset, kinds", [("small", [0, 1, 2, 3, 5]), ("flash-next", [0, 1, 2, 3])])
def test_one_layer_of_each_kind(preset, kinds):
    """The first layer, then the first layer of each structure: a QSA layer, a GDN layer, each GDN layer with a
    PLE table of its own size (its prime vocabularies differ); every other layer repeats one of these."""
    import torch

    from tidal.config.model import ModelConfig
    from tidal.executor.models import Qwen4ExpForCausalLM
    from tidal.executor.presets import preset_config
    from tidal.executor.warm import layer_signature

    with torch.device("meta"):
        model = Qwen4ExpForCausalLM(ModelConfig.from_dict(preset_config(preset)))
    layers = model.model.layers
    assert layer_kinds(layers) == kinds
    signatures = {layer_signature(layers[i]) for i in kinds}
    assert all(layer_signature(layer) in signatures for layer in layers)


def test_forwards_over_only_some_layers(tiny_checkpoint):
    llm = LLM(tiny_checkpoint, max_prefill_length=64)
    model = llm.runner.model
    layers = model.model.layers
    ran = []
    hooks = [layer.register_forward_hook(lambda m, *_: ran.append(m.layer_idx)) for layer in layers]
    with only_layers(model, [0, 2]):
        assert llm.generate([ids(20, 1)], max_tokens=2, ignore_eos=True)
    assert ran and set(ran) == {0, 2}
    assert model.model.layers is layers
    ran.clear()
    llm.generate([ids(20, 1)], max_tokens=2, ignore_eos=True)
    assert set(ran) == {0, 1, 2, 3}
    for hook in hooks:
        hook.remove()


def test_graph_shapes_hold_every_step_shape(tiny_checkpoint):
    llm = LLM(tiny_checkpoint, max_prefill_length=64, max_running_requests=20)
    llm.runner.use_graphs(20, 300, capture=False)
    graphs = llm.runner.graphs
    shapes = graphs.shapes()
    assert len(shapes) == len(set(shapes))
    rng = random.Random(0)
    seen = set()
    for _ in range(3000):
        rows = rng.randint(1, 20)
        top = rng.choice([16, 300, 4096, 300 * 16 - 1])
        seen.add(graphs._shape([rng.randrange(top) for _ in range(rows)]))
    assert seen <= set(shapes)
    assert {size for size, _ in shapes} == set(graphs.sizes)


@pytest.fixture(scope="module")
def alone(tiny_checkpoint):
    llm = LLM(tiny_checkpoint, max_prefill_length=64, max_running_requests=4)
    return llm.generate(PROMPTS + [ids(200, 9)], max_tokens=24, ignore_eos=True)


@pytest.mark.parametrize("graphs", [False, True])
def test_generation_after_the_warm_up_equals_a_cold_runner(tiny_checkpoint, alone, graphs):
    llm = LLM(tiny_checkpoint, max_prefill_length=64, max_running_requests=4)
    if graphs:
        llm.runner.use_graphs(4, 64, capture=False)
    warm = WarmUp(llm.runner, llm.sizes, 64, 4)
    kinds = [what for what, _ in warm.steps()]
    assert kinds.count("prefill") == len(ladder(68)) and kinds.count("decode") == len(ladder(4))
    assert kinds.count("context") == len(ladder(warm.max_context)) - 1 and warm.max_context > 200
    assert {"exports", "segments", "burst", "continuation", "sampling"} <= set(kinds)
    warm.run()
    assert llm.generate(PROMPTS + [ids(200, 9)], max_tokens=24, ignore_eos=True) == alone
    stats = llm.scheduler.stats()
    assert stats.kv_pages_in_use == 0 and stats.state_slots_in_use == 0


class LayersAtCapture:
    """A CUDA graph's stand-in on the CPU: each replay runs the step over the decoder layers the model had when it
    was captured, as a graph replays the kernels it recorded."""

    def __init__(self, graphs, size: int, blocks: int):
        self.graphs, self.key = graphs, (size, blocks)
        self.layers = graphs.model.model.layers

    def replay(self) -> None:
        inner = self.graphs.model.model
        every, inner.layers = inner.layers, self.layers
        try:
            self.graphs._step(*self.key)
        finally:
            inner.layers = every


def test_decode_graphs_are_captured_over_every_layer(tiny_checkpoint, alone, monkeypatch):
    """The warm-up runs its eager steps over some of the layers; a decode graph captured inside one of them would
    replay only those layers ever after."""
    from tidal.executor.cuda_graph import DecodeGraphs

    monkeypatch.setattr(DecodeGraphs, "_record", lambda self, size, blocks: LayersAtCapture(self, size, blocks))
    llm = LLM(tiny_checkpoint, max_prefill_length=64, max_running_requests=4)
    llm.runner.use_graphs(4, 64, capture=True)
    graphs = llm.runner.graphs
    WarmUp(llm.runner, llm.sizes, 64, 4).run()
    assert graphs.captures == len(graphs.shapes())
    every = llm.runner.model.model.layers
    assert all(len(g.layers) == len(every) for g in graphs._graphs.values())
    steps = graphs.steps
    assert llm.generate(PROMPTS + [ids(200, 9)], max_tokens=24, ignore_eos=True) == alone
    assert graphs.steps > steps  # the decode steps replayed the graphs
    with only_layers(llm.runner.model, [0]), pytest.raises(RuntimeError, match="1 of the model's 4 layers"):
        graphs._graphs.clear()
        graphs.prepare(graphs.shapes()[0])


def test_every_decode_row_count_and_context_meets_the_attention_layers(tiny_checkpoint):
    """Decode attention splits its keys by the row count itself (not its class) and the blocks QSA selects: every
    count from 1 to the running requests gets a decode step after a context where QSA selects its most blocks,
    over the attention layers alone, as do the contexts."""
    llm = LLM(tiny_checkpoint, max_prefill_length=64, max_running_requests=8)
    warm = WarmUp(llm.runner, llm.sizes, 64, 8)
    assert [r for what, r in warm.steps() if what == "decode_wide"] == list(range(1, 9))
    assert [r for what, r in warm.steps() if what == "decode"] == ladder(8)
    config = llm.config
    assert warm.wide_context == config.indexer_budget + config.indexer_compress_ratio
    assert (warm.wide_context + 1) // config.indexer_compress_ratio >= config.qsa_block_topk
    assert warm.kinds == [0, 1, 2, 3] and warm.attention_kinds == [2]
    assert warm.layers_for("decode_wide", 6) == [2] and warm.layers_for("decode", 8) == warm.kinds
    assert warm.layers_for("context", 1000) == [2] and warm.layers_for("prefill", 1000) == warm.kinds


def test_warm_up_fits_small_pools(tiny_checkpoint):
    """With few pages and slots, the warm-up shrinks its forwards to the pools instead of failing."""
    llm = LLM(tiny_checkpoint, max_prefill_length=512, max_running_requests=2, kv_pool_tokens=256,
              disable_prefix_cache=True)
    warm = WarmUp(llm.runner, llm.sizes, 512, 2)
    assert warm.max_prefill + warm.page <= llm.sizes.num_pages * llm.sizes.page_size
    assert warm.max_context + 64 + warm.page <= llm.sizes.num_pages * llm.sizes.page_size
    warm.run()
    assert llm.generate([ids(40, 3)], max_tokens=8, ignore_eos=True) == LLM(
        tiny_checkpoint, max_prefill_length=512, max_running_requests=2, kv_pool_tokens=256,
        disable_prefix_cache=True).generate([ids(40, 3)], max_tokens=8, ignore_eos=True)


def test_layer_major_warm_up_leaves_its_prefills_unchanged(tiny_checkpoint):
    """A server with layer-major prefills warms one up (2.5 internal chunks) before ready; its long prompts
    then generate as on a cold runner."""
    from tidal.config.server_args import ServerArgs
    from tidal.executor.process import layer_major_chunk

    lm = dict(moe_strategy="offload", moe_cache_slots=4, max_prefill_length=64, prefill_layer_major=True)
    assert layer_major_chunk(ServerArgs(**lm)) == 64
    assert layer_major_chunk(ServerArgs(max_prefill_length=64)) == 0
    prompts = [ids(300, 5), ids(20, 6)]
    want = LLM(tiny_checkpoint, **lm).generate(prompts, max_tokens=8, ignore_eos=True)
    llm = LLM(tiny_checkpoint, **lm)
    warm = WarmUp(llm.runner, llm.sizes, 64, 4, layer_major_chunk=64)
    assert ("layer_major", 161) in warm.steps()
    warm.run()
    assert llm.generate(prompts, max_tokens=8, ignore_eos=True) == want
    assert llm.runner.layer_major is None


WORKLOAD = """
import json, sys, torch
from tidal import LLM
from tidal.executor.warm import CompileCounter, WarmUp
counter = CompileCounter()
llm = LLM(sys.argv[1], device="cuda", dtype="bfloat16", max_prefill_length=512, max_running_requests=8)
counter.graphs, counter.prefill_graphs = llm.runner.graphs, llm.runner.prefill_graphs
assert llm.runner.prefill_graphs is not None
WarmUp(llm.runner, llm.sizes, 512, 8).run()
counter.ready()
before = [counter.compiles, counter.captures]
gen = torch.Generator().manual_seed(0)
prompts = [torch.randint(1000, 240000, (n,), generator=gen).tolist() for n in (1, 7, 16, 100, 513, 1500, 3000)]
llm.generate(prompts, max_tokens=20, ignore_eos=True)
llm.generate(prompts[:5] + [prompts[5] + prompts[0]], max_tokens=30, ignore_eos=True)  # cache hits
llm.generate(prompts[:3], max_tokens=12, temperature=0.8, top_p=0.9, top_k=30, seed=1)
after, missed = list(counter.after_ready()), list(counter.missed)
from tidal.kernels.norm_triton import rms_norm_triton
x = torch.randn(3, 40, device="cuda")  # float32: the bfloat16 model never launches it so
rms_norm_triton(x, torch.zeros(40, device="cuda"), 1e-6)
torch.cuda.synchronize()
print(json.dumps([before, after, missed, list(counter.after_ready())]))
"""


@pytest.mark.gpu
def test_no_compilation_or_capture_after_the_warm_up_gpu(tiny_checkpoint):
    """In a fresh process (Triton's in-memory kernel cache empty), a workload of prompt lengths 1 to 3000,
    1 to 7 running requests, greedy and filtered sampling and prefix-cache hits
    compiles no kernel and captures no graph after the warm-up; a launch the warm-up never met (a float32 norm)
    then counts as one compiled after ready."""
    import json
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", WORKLOAD, tiny_checkpoint], capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    before, after, missed, control = json.loads(run.stdout.strip().splitlines()[-1])
    assert before[0] > 0 and before[1] > 0, before  # the counters count: the warm-up compiled and captured
    assert after == [0, 0], missed
    assert control[0] >= 1 and control[1] == 0, control  # and they count after ready: the control launch is seen


def test_compile_cache_directory(tmp_path, monkeypatch):
    from tidal.executor.warm import use_compile_cache

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    use_compile_cache(str(tmp_path / "default"), explicit=False)  # the environment's wins over the default
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "mine")
    use_compile_cache(str(tmp_path / "flag"), explicit=True)
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "flag" / "triton")
    assert (tmp_path / "flag" / "triton").is_dir()
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit, match="--compile-cache"):
        use_compile_cache(str(tmp_path / "file"), explicit=True)


def test_compile_workers_share_the_steps():
    """Worker 0 takes the first step (the kernels every step shares); the rest go out in runs of consecutive
    steps (one axis's variants to one worker), none twice."""
    from tidal.executor.compile_workers import share

    steps = [("prefill", n) for n in range(1, 30)] + [("graph", (1, 2)), ("decode", 4)]
    for count in (1, 2, 3, 4):
        shares = [share(steps, i, count) for i in range(count)]
        assert shares[0][0] == steps[0]
        assert [s for part in shares for s in part] == steps  # in order: consecutive runs
        assert max(map(len, shares)) - min(map(len, shares)) <= 2


@pytest.mark.parametrize("preset", ["small", "flash-next"])
def test_the_workers_model_holds_every_layer_kind(preset):
    """The model a compile worker builds ends after the last kind's first layer: the same kinds, the same layers."""
    import torch

    from tidal.config.model import ModelConfig
    from tidal.executor.compile_workers import worker_config
    from tidal.executor.models import Qwen4ExpForCausalLM
    from tidal.executor.presets import preset_config
    from tidal.executor.warm import layer_signature

    config = ModelConfig.from_dict(preset_config(preset))
    small = worker_config(config)
    with torch.device("meta"):
        full, cut = Qwen4ExpForCausalLM(config).model.layers, Qwen4ExpForCausalLM(small).model.layers
    kinds = layer_kinds(full)
    assert small.num_hidden_layers == max(kinds) + 1 < config.num_hidden_layers
    assert layer_kinds(cut) == kinds
    assert [layer_signature(cut[i]) for i in kinds] == [layer_signature(full[i]) for i in kinds]
    assert set(small.ple_layer_ids) <= set(config.ple_layer_ids) and small.ple_layer_ids


def test_the_warm_marker_names_what_shapes_the_forwards(tmp_path):
    """A warm compile cache is recognised for the same model and flags, whatever the port or log level; another
    prefill budget or another model is another warm-up."""
    pytest.importorskip("triton")
    from tidal.config.model import ModelConfig
    from tidal.config.server_args import ServerArgs
    from tidal.executor.compile_workers import warm_marker
    from tidal.executor.presets import preset_config

    config = ModelConfig.from_dict(preset_config("small"))
    base = warm_marker(ServerArgs(model="m"), config, str(tmp_path))
    assert base.startswith(str(tmp_path))
    assert warm_marker(ServerArgs(model="m", port=9000, log_level="debug"), config, str(tmp_path)) == base
    assert warm_marker(ServerArgs(model="m", max_prefill_length=4096), config, str(tmp_path)) != base
    assert warm_marker(ServerArgs(model="m"), config.first_layers(3), str(tmp_path)) != base


def test_compile_workers_fit_the_device_and_the_host_beside_the_servers_weights(monkeypatch):
    """flash-next on one H200 (139 GiB free, 16 cores, 123.7 GiB of host memory available): NVFP4 with its n-gram
    table pinned leaves the device room for 3 workers; FP8 with offloaded experts locks 112.5 GiB of the host, and a
    worker's own 4 layers of offloaded experts would not fit beside it: no workers, the host named."""
    from types import SimpleNamespace

    from tidal.config.model import ModelConfig
    from tidal.config.server_args import ServerArgs
    from tidal.executor import compile_workers
    from tidal.executor.memory import fit
    from tidal.executor.presets import preset_config

    GiB = 1 << 30
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=139 * GiB))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (139 * GiB, 139 * GiB))
    monkeypatch.setattr(compile_workers.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.setattr(compile_workers, "host_memory", lambda field="MemTotal": int(123.7 * GiB))
    monkeypatch.setattr(fit, "host_memory_total", lambda: int(125.8 * GiB))

    def plan(quantization, **kwargs):
        config = ModelConfig.from_dict(preset_config("flash-next")).with_quantization(quantization, "random")
        args = ServerArgs(load_format="random", quantization=quantization, device="cuda", **kwargs)
        return compile_workers.plan_workers(args, config, "cuda")

    count, budget, why = plan("nvfp4", ple_backend="pinned")
    assert count == 3 and 15 * GiB < budget < 20 * GiB and why == ""
    count, budget, why = plan("fp8", moe_strategy="offload", ple_backend="disk")
    assert count == 0 and "the host has 123.7 GiB available" in why, why


def test_compile_workers_flag():
    from tidal.config.server_args import ArgsError, ServerArgs

    with pytest.raises(ArgsError, match="--compile-workers: must be >= 0"):
        ServerArgs(compile_workers=-1)


WORKERS = """
import json, os, sys, time
cache = os.environ["TRITON_CACHE_DIR"]
import torch
from tidal import LLM
from tidal.config.model import ModelConfig
from tidal.config.pools import pool_sizes
from tidal.config.server_args import ServerArgs
from tidal.executor.compile_workers import CompileWorkers, plan_workers
from tidal.executor.warm import WarmUp

path = sys.argv[1]
kw = dict(device="cuda", dtype="bfloat16", max_prefill_length=512, max_running_requests=8)
args = ServerArgs(model=path, **kw)
config = ModelConfig.from_file(path)
count, budget, why = plan_workers(args, config, "cuda")
workers = CompileWorkers(args, config, pool_sizes(args, config), path, "cuda", 512, 8, 0)
workers.start(2, budget)
codes = []
for p in workers.procs:
    p.join(800)
    codes.append(p.exitcode)
kernels = lambda: sum(1 for d in os.listdir(cache) if os.path.isdir(os.path.join(cache, d)))
by_workers = kernels()
llm = LLM(path, **kw)
WarmUp(llm.runner, llm.sizes, 512, 8).run()
print(json.dumps([count, codes, by_workers, kernels() - by_workers]))
"""


@pytest.mark.gpu
def test_compile_workers_compile_what_the_warm_up_meets_gpu(tiny_checkpoint, tmp_path):
    """Two workers over an empty compile cache compile the warm-up's kernels: the executor's own warm-up after
    them adds few entries to the cache. Those are what the workers do not meet: they run with n-gram rows drawn on
    the host and so without decode graphs (the executor captures its graphs and gathers rows from its device
    table), and take no autotuning decision (the executor records its choices beside the kernels)."""
    import json
    import subprocess
    import sys

    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "triton")}
    os.makedirs(env["TRITON_CACHE_DIR"])
    run = subprocess.run([sys.executable, "-c", WORKERS, tiny_checkpoint], capture_output=True, text=True,
                         timeout=900, env=env)
    assert run.returncode == 0, run.stderr[-4000:]
    count, codes, by_workers, new = json.loads(run.stdout.strip().splitlines()[-1])
    assert count >= 1 and codes == [0, 0], run.stderr[-4000:]
    assert by_workers > 20 and new <= by_workers // 4, (by_workers, new)


CPU_WORKERS = """
import logging, sys
logging.basicConfig(level=logging.INFO)
from tidal.config.model import ModelConfig
from tidal.config.pools import pool_sizes
from tidal.config.server_args import ServerArgs
from tidal.executor.compile_workers import CompileWorkers
from tidal.executor.runner import build_runner
from tidal.executor.warm import WarmUp

path = sys.argv[1]
args = ServerArgs(model=path, device="cpu", dtype="float32", max_prefill_length=64, max_running_requests=3)
config = ModelConfig.from_file(path)
sizes = pool_sizes(args, config)
workers = CompileWorkers(args, config, sizes, path, "cpu", 64, 3, 0)
workers.start(2, 1 << 30)
codes = [p for p in workers.procs]
workers.wait(600)
print(len(WarmUp(build_runner(args, config, sizes, path), sizes, 64, 3).steps()), [p.exitcode for p in codes])
"""


def test_compile_workers_run_every_step_between_them(tiny_checkpoint):
    """Two workers (spawned processes, on the CPU here) build the first layers' model and run every warm-up
    step between them, and exit cleanly; the executor's log says when they are done."""
    import re
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", CPU_WORKERS, tiny_checkpoint], capture_output=True, text=True,
                         timeout=600, env={**os.environ, "TIDAL_PROGRESS": "0"})
    assert run.returncode == 0, run.stderr[-4000:]
    total, codes = run.stdout.strip().splitlines()[-1].split(" ", 1)
    assert codes == "[0, 0]"
    ran = [int(n) for n in re.findall(r"compile worker \d: (\d+) steps in", run.stderr)]
    assert len(ran) == 2 and sum(ran) == int(total) > 20, run.stderr[-3000:]
    assert "2 compile workers started" in run.stderr and "compile workers done" in run.stderr
