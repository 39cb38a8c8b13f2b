"""The executor process (one per TP rank): receives ``Batch``es, runs them, rank 0 answers."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import traceback

import msgspec
import torch
import torch.distributed as dist
import zmq

from ..config.model import ModelConfig
from ..config.pools import pool_sizes
from ..config.server_args import HOST_LOCAL_FIELDS, ServerArgs
from ..messages import Batch, BatchResult, ExecutorFailed, ExecutorInbound, Ready, Shutdown
from ..runtime.faults import check, fault
from ..runtime.ipc import Pull, Push
from ..scheduler.layer_major import layer_major_decision
from .compile_workers import CompileWorkers, plan_workers, warm_marker, write_marker
from .distributed import init_tp
from .runner import Launched, build_runner
from .warm import CompileCounter, WarmUp, use_compile_cache

logger = logging.getLogger(__name__)


class DeviceLost(RuntimeError):
    """The device cannot run anything any more."""


def device_usable(device: torch.device) -> bool:
    """After a failed batch: whether the device still runs work (a CUDA error such as an illegal
    address is sticky: every later call fails with it)."""
    if device.type != "cuda":
        return True
    try:
        torch.cuda.synchronize(device)
        torch.ones(1, device=device).add_(1).item()
    except Exception:  # the error type depends on the failure; any of them means the device is gone
        return False
    return True


def check_agreement(args: ServerArgs, config: ModelConfig, rank: int) -> None:
    """Every rank must run with the same settings and model: compare digests, refuse to start if not."""
    # Host-local wiring (run directory, socket paths, this host's index) may differ between hosts.
    settings = {k: v for k, v in dataclasses.asdict(args).items() if k not in HOST_LOCAL_FIELDS}
    mine = msgspec.json.encode(settings) + msgspec.json.encode(config.raw)
    digest = hashlib.sha256(mine).hexdigest()
    digests = [None] * args.tp
    dist.all_gather_object(digests, digest)
    if len(set(digests)) != 1:
        raise SystemExit(f"rank {rank}: the ranks' settings or configs differ (digests {digests}); "
                         f"start every host with the same flags and checkpoint")


def layer_major_chunk(args: ServerArgs) -> int:
    """The internal chunk of this server's layer-major prefills (0: it runs none)."""
    eligible, _ = layer_major_decision(args, (args.max_prefill_length or 0) + 1, 0, False)
    return args.max_prefill_length if eligible else 0


def run_executor(args: ServerArgs, model_path: str, rank: int) -> None:
    ctx = zmq.Context()
    inbound: Pull = Pull(ctx, args.bind_addr(args.executor_addrs()[rank]), ExecutorInbound, bind=True)
    results: Push = Push(ctx, args.scheduler_addr)
    control: Push = Push(ctx, args.control_addr)
    config = ModelConfig.from_file(model_path).with_quantization(args.quantization, args.load_format)
    sizes = pool_sizes(args, config)
    device = args.resolved_device()
    if args.tp > 1:
        local = rank - args.local_ranks()[0]
        if device == "cuda":
            device = f"cuda:{local}"
            torch.cuda.set_device(device)
        init_tp(rank, args.tp, args.dist_init_addr, "nccl" if device.startswith("cuda") else "gloo")
        check_agreement(args, config, rank)
    check("executor.load.hang")
    use_compile_cache(args.compile_cache_dir(), explicit=args.compile_cache is not None)
    compiles = CompileCounter()
    warming = device.startswith("cuda") and not args.skip_warmup
    max_prefill = args.max_prefill_length or sizes.max_model_len
    marker = workers = None
    if warming and args.tp == 1 and os.environ.get("TRITON_CACHE_DIR"):
        marker = warm_marker(args, config, os.environ["TRITON_CACHE_DIR"])
        if not os.path.exists(marker):
            count, budget, why = plan_workers(args, config, device)
            if count:
                workers = CompileWorkers(args, config, sizes, model_path, device, max_prefill,
                                         args.max_running_requests, layer_major_chunk(args))
                workers.start(count, budget)
            else:
                logger.info("no compile workers: %s", why)
    try:
        runner = build_runner(args, config, sizes, model_path, device=device,
                              after_weights=workers.wait if workers is not None else None)
    finally:
        if workers is not None:
            workers.stop()
    runner.compiles, compiles.graphs, compiles.prefill_graphs = compiles, runner.graphs, runner.prefill_graphs
    if warming:
        warm = WarmUp(runner, sizes, max_prefill, args.max_running_requests,
                      layer_major_chunk=layer_major_chunk(args))
        seconds = warm.run()
        logger.info("rank %d warmed up in %.1f s: %d steps over layers %s, %d kernels compiled or loaded in %.1f s "
                    "(cache %s), %d decode graphs captured", rank, seconds, len(warm.steps()), warm.kinds,
                    compiles.compiles, compiles.seconds, args.compile_cache_dir(), compiles.captures)
        if compiles.by_kernel:
            logger.info("rank %d: longest compiles: %s", rank, compiles.slowest())
        if marker is not None:
            write_marker(marker)
    compiles.ready()
    control.send(Ready(role=f"executor-{rank}"))
    logger.info("rank %d ready on %s (%s%s; KV %d bytes a token, state %d bytes a slot)", rank, runner.device,
                str(next(runner.model.parameters()).dtype).replace("torch.", ""),
                f", {config.quantization.label}" if config.quantization is not None else "",
                runner.kv.bytes_per_token(), runner.states.bytes_per_slot())
    BatchLoop(args, rank, runner, inbound, results, control).run()


class BatchLoop:
    """Runs the batches that arrive, in order, and answers each (rank 0; any rank answers an error).

    A decode step whose ids are still on their way from the device (``Launched`` pending) is answered
    once they arrive or, when the scheduler's next batch (sent ahead) arrives first and can follow it
    (``ModelRunner.can_follow``), right after that batch is launched: the device then has the next step
    queued while this one's ids go back and the scheduler answers, and stands idle between steps only
    when the host falls behind it.
    """

    def __init__(self, args: ServerArgs, rank: int, runner, inbound: Pull, results: Push, control: Push):
        self.args, self.rank, self.runner = args, rank, runner
        self.inbound, self.results, self.control = inbound, results, control

    def run(self) -> None:
        pending: tuple[Batch, Launched] | None = None  # launched, not yet answered
        while True:
            msg = self.inbound.recv(timeout_ms=None if pending is None else 0)
            if msg is None:
                if pending is not None and pending[1].ready():
                    self._answer(*pending)
                    pending = None
                continue
            if isinstance(msg, Shutdown):
                if pending is not None:
                    self._answer(*pending)
                return
            assert isinstance(msg, Batch)
            if pending is not None and not self.runner.can_follow(msg):
                self._answer(*pending)
                pending = None
            launched = self._launch(msg)
            if pending is not None:  # the batch before is answered first
                self._answer(*pending)
                pending = None
            if isinstance(launched, BatchResult):
                self._send(launched)
            elif launched.finished:
                self._answer(msg, launched)
            else:
                pending = (msg, launched)

    def _launch(self, batch: Batch) -> Launched | BatchResult:
        try:
            check("executor.error")
            check(f"executor{self.rank}.error")
            check("executor.hang")
            if fault("executor.fatal"):
                raise DeviceLost("injected fault at executor.fatal")
            return self.runner.launch(batch)
        except Exception as e:  # a failed batch fails its requests, not the process
            return self._failed(batch, e)

    def _answer(self, batch: Batch, launched: Launched) -> None:
        try:
            out = self.runner.finish(launched)
            result = BatchResult(batch_id=batch.batch_id, token_ids=out.token_ids, logprobs=out.logprobs,
                                 prompt_logprobs=out.prompt_logprobs, executor_stats=self.runner.stats())
        except Exception as e:
            result = self._failed(batch, e)
        self._send(result)

    def _send(self, result: BatchResult) -> None:
        if self.rank == 0 or result.error is not None:  # any rank's error fails the batch, with its message
            self.results.send(result)

    def _failed(self, batch: Batch, e: Exception) -> BatchResult:
        logger.error("batch %d failed:\n%s", batch.batch_id, traceback.format_exc())
        where = f"rank {self.rank}: " if self.args.tp > 1 else ""
        error = f"{where}{type(e).__name__}: {e}"
        if self.args.tp > 1 or isinstance(e, DeviceLost) or not device_usable(self.runner.device):
            # A sticky device error fails every later batch too, and under tensor parallelism
            # the other ranks are left inside this batch's collectives: say so and leave, so
            # the launcher restarts the mesh or exits instead of serving errors (or hanging)
            # behind a healthy /health.
            failed = ExecutorFailed(rank=self.rank, error=error)
            self.results.send(failed)
            self.control.send(failed)
            logger.error("rank %d: %s; exiting", self.rank, "the ranks are out of step" if self.args.tp > 1 and not
                         isinstance(e, DeviceLost) else "the device is unusable")
            self.results.close(linger_ms=2000)
            self.control.close(linger_ms=2000)
            raise SystemExit(1) from e
        return BatchResult(batch_id=batch.batch_id, token_ids=[-1] * len(batch.segments), error=error)
