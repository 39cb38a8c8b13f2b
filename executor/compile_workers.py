"""Compile workers: the warm-up's Triton compilations spread over helper processes while the executor loads its
weights.

Triton compiles one kernel at a time in a process, 0.5-1 s each, and a model meets a few hundred variants: from
an empty compile cache that is most of a start. The variants depend on shapes alone, so a model of the served
model's first layers (up to the last :func:`~tidal.executor.warm.layer_kinds` position), with random weights, meets
every one of them. Each worker builds that model with the server's flags and pool sizes (its pools hold the first
layers' share: a fraction of the server's), runs its share of the warm-up steps (:class:`WarmUp`: a run of
consecutive steps after the first, which worker 0 runs before the others begin, as it meets the kernels every step
shares) and exits; what it compiled lands in the shared compile cache. The executor then warms up from that cache.
Workers run beside the weight load within a fixed share of the device's memory each (a worker's step that would
exceed it is skipped: the executor compiles what it meets); they take no autotuning decisions
(``FLA_CACHE_RESULTS=0``: flash-linear-attention's kernels are compiled in every configuration, and the executor
times them alone).

A start whose compile cache already holds the warm-up of the same model, flags, software and device (a marker
:func:`warm_marker` names, written after the executor's warm-up) starts no workers.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import logging
import multiprocessing as mp
import os
import signal
import sys
import time

import torch

from ..config.model import ModelConfig
from ..config.server_args import HOST_LOCAL_FIELDS
from .memory.fit import HOST_MESH, HOST_PER_RANK, GiB, host_memory, memory_plan

logger = logging.getLogger(__name__)

# The most workers, and host cores a worker needs (Triton's compiler holds the GIL for part of its work and runs
# ptxas beside it).
MAX_WORKERS = 4
CORES_PER_WORKER = 4
# Device memory outside a worker's allocator (its CUDA context), and what its forwards need beyond its weights and
# pools for the share to be worth starting it.
CONTEXT_BYTES = 1 * GiB
MIN_ACTIVATION_BYTES = 6 * GiB
# Seconds the other workers wait for worker 0's first step before they begin anyway, and the executor for them all.
FIRST_STEP_TIMEOUT = 300.0
WAIT_TIMEOUT = 900.0
# Host memory a worker process takes.
HOST_BYTES = 3 * GiB
# Device memory a load takes beyond its weights: a checkpoint's tensors pass through a few buffers; random weights
# are drawn a tensor at a time in float32, rounded to bf16 beside it (6 bytes a value of the largest tensor), and
# quantized in chunks.
LOAD_SLACK_BYTES = 3 * GiB


def load_slack(config: ModelConfig, load_format: str) -> int:
    """Device memory a load of ``config``'s weights takes beyond them, at most."""
    if load_format != "random":
        return LOAD_SLACK_BYTES
    from .models import Qwen4ExpForCausalLM
    from .weights import EXPERT_CHUNK, is_experts

    with torch.device("meta"):  # n-gram tables and experts are drawn in chunks
        largest = max(p.numel() for n, p in Qwen4ExpForCausalLM(config).named_parameters()
                      if p.numel() < 1 << 34 and not is_experts(n))
    experts = min(config.num_experts, EXPERT_CHUNK) * 2 * config.moe_intermediate_size * config.hidden_size
    return 6 * max(largest, experts) + LOAD_SLACK_BYTES


def _source_digest() -> str:
    """A digest of tidal's source files (the kernels and the forwards that launch them)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    h = hashlib.sha256()
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in ("tests", "docs", "__pycache__"))
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                h.update(os.path.relpath(path, root).encode())
                with open(path, "rb") as f:
                    h.update(f.read())
    return h.hexdigest()


def warm_marker(args, config: ModelConfig, cache_dir: str) -> str:
    """The path of the file that says ``cache_dir`` holds this start's warm-up: a digest of the model's config
    (as served), the flags that shape its forwards, tidal's source, torch's and Triton's versions and the device."""
    import triton

    # Besides the host-local wiring, flags that change nothing a forward does.
    local = HOST_LOCAL_FIELDS | {"api_key", "compile_cache", "compile_workers", "host", "port", "restart_on_failure",
                                 "shutdown_timeout", "executor_timeout", "heartbeat_timeout"}
    flags = {k: v for k, v in sorted(dataclasses.asdict(args).items()) if k not in local}
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    what = repr((flags, config, _source_digest(), torch.__version__, triton.__version__, device))
    return os.path.join(cache_dir, "warmed", hashlib.sha256(what.encode()).hexdigest()[:32])


def write_marker(path: str) -> None:
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(f"{time.time():.0f}\n")
    except OSError as e:  # a read-only cache: workers start again next time
        logger.warning("cannot mark the compile cache as warm (%s)", e)


def worker_args(args):
    """A worker's flags: the server's, with random weights and its n-gram rows drawn when gathered (no table)."""
    return dataclasses.replace(args, load_format="random", ple_backend="disk", skip_warmup=False)


def worker_config(config: ModelConfig) -> ModelConfig:
    """The served config cut after the last layer :func:`layer_kinds` keeps."""
    from .models import Qwen4ExpForCausalLM
    from .warm import layer_kinds

    with torch.device("meta"):
        layers = Qwen4ExpForCausalLM(config).model.layers
    return config.first_layers(max(layer_kinds(layers)) + 1)


def plan_workers(args, config: ModelConfig, device: str) -> tuple[int, int, str]:
    """``(workers, device bytes each, why)`` for this start: as many as the host's cores, its memory and the device
    memory the executor's weights leave while they load allow (each worker at least its weights and pools plus
    :data:`MIN_ACTIVATION_BYTES`), at most ``--compile-workers`` (default :data:`MAX_WORKERS`)."""
    wanted = MAX_WORKERS if args.compile_workers is None else args.compile_workers
    cores = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    count = min(wanted, cores // CORES_PER_WORKER)
    if count < 1:
        return 0, 0, f"{cores} cores" if wanted else "--compile-workers 0"
    main = memory_plan(args, config, device)
    small_config = worker_config(config)
    small = memory_plan(worker_args(args), small_config, device)
    need = (small["weights_device"] + small["kv"] + small["state"] + CONTEXT_BYTES
            + max(MIN_ACTIVATION_BYTES, load_slack(small_config, "random")))
    free, _ = torch.cuda.mem_get_info(device)
    spare = int(0.95 * free) - main["weights_device"] - load_slack(config, args.load_format)
    host = host_memory("MemAvailable")
    if host is not None:  # a worker's process and its own host-resident weights (offloaded experts), beside the mesh's
        mesh, each = main["weights_host"] + HOST_MESH + HOST_PER_RANK, small["weights_host"] + HOST_BYTES
        count = min(count, max(0, (host - mesh) // each))
        if count < 1:
            return 0, 0, (f"the host has {host / GiB:.1f} GiB available; the mesh takes {mesh / GiB:.1f} and a worker "
                          f"needs {each / GiB:.1f}")
    count = min(count, max(0, spare // need))
    if count < 1:
        return 0, 0, (f"the device has {free / GiB:.1f} GiB free; the weights take {main['weights_device'] / GiB:.1f} "
                      f"and a worker needs {need / GiB:.1f}")
    return count, spare // count, ""


def share(steps: list, index: int, count: int) -> list:
    """Worker ``index``'s steps of ``count`` workers: the first step for worker 0, then the ``index``-th of
    ``count`` runs of consecutive steps of the rest. Consecutive steps walk one axis (prompt lengths, then contexts,
    row counts, ...) and share its kernel variants, which one worker then compiles (steps dealt out one by one
    would have every worker compile nearly every variant at the same time)."""
    rest = steps[1:]
    bounds = [len(rest) * i // count for i in range(count + 1)]
    return (steps[:1] if index == 0 else []) + rest[bounds[index]:bounds[index + 1]]


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when the executor that started it dies."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _work(args, config: ModelConfig, sizes, model_path: str, device: str, budget: int, index: int, count: int,
          first_done, max_prefill: int, max_rows: int, layer_major_chunk: int) -> None:
    """One worker: build the first layers' runner, run steps ``index``, ``index + count``, ... (after the first,
    which worker 0 runs while the others wait for it), report and exit."""
    _die_with_parent()
    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.INFO), stream=sys.stderr,
                        format=f"%(asctime)s compile-worker-{index} %(levelname)s %(message)s")
    from .runner import build_runner
    from .warm import CompileCounter, WarmUp

    t0 = time.perf_counter()
    cuda = device.startswith("cuda")
    if cuda:
        device = f"cuda:{torch.device(device).index or 0}"  # "cuda": the first visible device, as the executor's
        torch.cuda.set_device(device)
        _, total = torch.cuda.mem_get_info(device)
        torch.cuda.set_per_process_memory_fraction(max(0.01, min(1.0, (budget - CONTEXT_BYTES) / total)), device)
    compiles = CompileCounter()
    try:
        runner = build_runner(args, config, sizes, model_path, device=device, exact_table_scale=False)
        warm = WarmUp(runner, sizes, max_prefill, max_rows, layer_major_chunk=layer_major_chunk)
        mine, skipped = share(warm.steps(), index, count), []
        if index == 0:
            warm.run(mine[:1], show=False)
            mine = mine[1:]
    finally:
        if index == 0:  # the others begin, whatever happened here
            first_done.set()
    if index:
        first_done.wait(FIRST_STEP_TIMEOUT)
    for what, arg in mine:
        try:
            warm.run_step(what, arg)
        except torch.OutOfMemoryError:
            skipped.append(f"{what} {arg}")
            torch.cuda.empty_cache()

    runner.synchronize()
    logger.info("compile worker %d: %d steps in %.1f s, %d kernels compiled or loaded in %.1f s, peak %.1f GiB%s",
                index, len(mine) + (index == 0),
                time.perf_counter() - t0, compiles.compiles, compiles.seconds,
                torch.cuda.max_memory_allocated(device) / GiB if cuda else 0.0,
                f"; skipped for memory: {', '.join(skipped)}" if skipped else "")


class CompileWorkers:
    """The workers of one start: :meth:`start` before the weights load, :meth:`wait` before the pools are
    allocated (the workers' memory is free again then)."""

    def __init__(self, args, config: ModelConfig, sizes, model_path: str, device: str, max_prefill: int,
                 max_rows: int, layer_major_chunk: int):
        self.args, self.config, self.sizes, self.model_path = args, config, sizes, model_path
        self.device, self.max_prefill, self.max_rows = device, max_prefill, max_rows
        self.layer_major_chunk = layer_major_chunk
        self.procs: list[mp.Process] = []
        self.first_done = None
        self.began = 0.0

    def start(self, count: int, budget: int) -> None:
        ctx = mp.get_context("spawn")
        self.first_done = first_done = ctx.Event()  # kept: the workers open it after this returns
        args, config = worker_args(self.args), worker_config(self.config)
        # Autotuned kernels compile every configuration in a worker; the executor times them alone.
        saved = os.environ.get("FLA_CACHE_RESULTS")
        os.environ["FLA_CACHE_RESULTS"] = "0"
        try:
            for i in range(count):
                p = ctx.Process(target=_work, name=f"compile-worker-{i}", daemon=True,
                                args=(args, config, self.sizes, self.model_path, self.device, budget, i, count,
                                      first_done, self.max_prefill, self.max_rows, self.layer_major_chunk))
                p.start()
                self.procs.append(p)
        finally:
            if saved is None:
                os.environ.pop("FLA_CACHE_RESULTS", None)
            else:
                os.environ["FLA_CACHE_RESULTS"] = saved
        self.began = time.perf_counter()
        logger.info("%d compile workers started (%.1f GiB of device memory each, %d of the model's %d layers)",
                    count, budget / GiB, config.num_hidden_layers, self.config.num_hidden_layers)

    def wait(self, timeout: float = WAIT_TIMEOUT) -> None:
        """Until every worker has exited (those still running after ``timeout`` s are killed); a worker that
        failed is logged, and what it did not compile, the executor's warm-up compiles."""
        deadline = time.monotonic() + timeout
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
                logger.warning("%s still ran after %.0f s: killed", p.name, timeout)
            elif p.exitcode:
                logger.warning("%s exited with %s; the warm-up compiles what it did not", p.name, p.exitcode)
        if self.procs:
            logger.info("compile workers done after %.1f s", time.perf_counter() - self.began)
        self.procs = []

    def stop(self) -> None:
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.join()
        self.procs = []
