"""The executor process (one per TP rank): receives ``Batch``es, runs them, rank 0 answers."""

from __future__ import annotations

import logging
import traceback

import zmq

from ..args import ServerArgs
from ..config import ModelConfig
from ..ipc import Pull, Push
from ..messages import Batch, BatchResult, ExecutorInbound, Ready
from ..sizing import pool_sizes
from .runner import build_runner

logger = logging.getLogger(__name__)


def run_executor(args: ServerArgs, model_path: str, rank: int) -> None:
    ctx = zmq.Context()
    inbound: Pull = Pull(ctx, args.executor_addrs()[rank], ExecutorInbound, bind=True)
    results: Push = Push(ctx, args.scheduler_addr)
    control: Push = Push(ctx, args.control_addr)
    config = ModelConfig.from_file(model_path)
    sizes = pool_sizes(args, config)
    runner = build_runner(args, config, sizes, model_path)
    control.send(Ready(role=f"executor-{rank}", info={
        "device": str(runner.device), "dtype": str(next(runner.model.parameters()).dtype).replace("torch.", ""),
        "kv_bytes_per_token": runner.kv.bytes_per_token(), "state_bytes_per_slot": runner.states.bytes_per_slot()}))
    logger.info("rank %d ready on %s", rank, runner.device)
    for msg in inbound.until_shutdown():
        assert isinstance(msg, Batch)
        try:
            out = runner.execute(msg)
            result = BatchResult(batch_id=msg.batch_id, token_ids=out.token_ids,
                                 expert_stats=runner.expert_store.stats() if runner.expert_store else {})
        except Exception as e:  # a failed batch fails its requests, not the process
            logger.error("batch %d failed:\n%s", msg.batch_id, traceback.format_exc())
            result = BatchResult(batch_id=msg.batch_id, token_ids=[-1] * len(msg.segments),
                                 error=f"{type(e).__name__}: {e}")
        if rank == 0:
            results.send(result)
