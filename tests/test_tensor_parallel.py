"""Tensor parallelism: TP = 2 and 4 against TP = 1, in float32, on the CPU (gloo) or, with
``TIDAL_TEST_DEVICE=cuda``, on one GPU per rank (NCCL; a test needing more GPUs than there are skips).

Every rank runs the same offline ``LLM`` (scheduler and runner) in lockstep, which is how the
executors see the same batches; rank 0 reports. The config has 2 KV heads (replicated at TP 4) and
grouped GDN value heads (8 value heads over 4 key heads).
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from tidal import LLM

DEVICE = os.environ.get("TIDAL_TEST_DEVICE", "cpu")
CUDA = DEVICE.startswith("cuda")
# The single-rank references run where the ranks run, in float32.
ONE = dict(device=DEVICE, dtype="float32") if CUDA else {}
TP_CONFIG = dict(num_attention_heads=8, num_key_value_heads=2, linear_num_key_heads=4, linear_num_value_heads=8)
PROMPT_LEN = 160
SHARD_LEN = 1024  # the smallest batch hyper-connection sharding takes


def _prompt(n: int = PROMPT_LEN) -> list[int]:
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 248000, (n,), generator=gen)
    if n > 70:
        ids[70] = 248046  # EOS inside
    return ids.tolist()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _prefix_run(llm: LLM) -> tuple[list[int], list[int], list[int]]:
    """A cold prompt, then a continuation that hits its checkpoint: ids of both and cached tokens."""
    from tidal.messages import PromptAdmitted

    admitted = []
    emit = llm.scheduler.emit
    llm.scheduler.emit = lambda e: (admitted.append(e.cached_tokens) if isinstance(e, PromptAdmitted) else None,
                                    emit(e))
    cold = llm.generate([_prompt(300)], max_tokens=16, ignore_eos=True)[0]
    warm = llm.generate([_prompt(300) + _prompt(70)], max_tokens=16, ignore_eos=True)[0]
    return cold, warm, admitted


def needs_devices(size: int) -> None:
    if CUDA and torch.cuda.device_count() < size:
        pytest.skip(f"needs {size} CUDA devices, {torch.cuda.device_count()} visible")


def _run_job(path: str, size: int, length: int, kwargs: dict, logits_file: str | None):
    """One ``LLM`` of the job's keywords: with ``length`` 0 what :func:`_prefix_run` returns, else ``(logits_file,
    32 greedy ids, executor counters of the scoring forward)``, the logits of the prompt written to ``logits_file``
    (``None``: not written)."""
    llm = LLM(path, tp=size, **kwargs)
    if length == 0:  # the prefix-cache scenario
        return _prefix_run(llm)
    before = llm.runner.stats()
    logits = llm.score(_prompt(length))
    scored = {k: [a - b for a, b in zip(v, before[k], strict=True)] for k, v in llm.runner.stats().items()}
    ids = llm.generate([_prompt(length)], max_tokens=32, ignore_eos=True)[0]
    if logits_file is not None:  # a file, not the queue: a 1024-row prompt has 1 GB of logits
        np.save(logits_file, logits.numpy())
    return logits_file, ids, scored


def _rank_main(rank: int, size: int, port: int, path: str, jobs: list[tuple[int, dict]], out_dir: str,
               queue) -> None:
    torch.set_num_threads(1)
    from tidal.executor.distributed import init_tp

    if CUDA:  # exact float32 (no TF32), one GPU per rank
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        torch.cuda.set_device(rank)
    init_tp(rank, size, f"tcp://127.0.0.1:{port}", "nccl" if CUDA else "gloo")
    where = dict(device=f"cuda:{rank}", dtype="float32") if CUDA else {}
    try:
        # one LLM after another in the same rank processes
        results = [_run_job(path, size, length, {**where, **kwargs},
                            os.path.join(out_dir, f"{i}.npy") if rank == 0 else None)
                   for i, (length, kwargs) in enumerate(jobs)]
        if rank == 0:
            queue.put(results)
    except Exception as e:  # report instead of hanging the parent
        queue.put(e)
        raise


def spawn_ranks(size: int, target, args, timeout: float = 300):
    """Run ``target(*args(rank, port, queue))`` in ``size`` spawned rank processes that meet at a free port;
    what rank 0 puts on ``queue`` (an exception it puts there is raised here)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=target, args=args(r, port, queue)) for r in range(size)]
    for p in procs:
        p.start()
    result = queue.get(timeout=timeout)
    for p in procs:
        p.join(timeout=60)
    if isinstance(result, Exception):
        raise result
    assert all(p.exitcode == 0 for p in procs)
    return result


def run_tp_jobs(path: str, size: int, jobs: list[tuple[int, dict]]) -> list:
    """Each ``(length, LLM keywords)`` of ``jobs`` run in turn by one set of ``size`` rank processes (what
    :func:`_run_job` returns, from rank 0, logits as tensors)."""
    needs_devices(size)
    out_dir = tempfile.mkdtemp(prefix="tidal-tp-")
    try:
        result = spawn_ranks(size, _rank_main,
                             lambda rank, port, queue: (rank, size, port, path, jobs, out_dir, queue))
        # mapped copy-on-write: read as the comparison goes, and the folder can go at once
        return [r if length == 0 else (torch.from_numpy(np.load(r[0], mmap_mode="c")), r[1], r[2])
                for (length, _), r in zip(jobs, result, strict=True)]
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)


def run_tp_variants(path: str, size: int, length: int, variants: list[dict]) -> list:
    """:func:`run_tp_jobs` of one prompt length and several keyword sets."""
    return run_tp_jobs(path, size, [(length, v) for v in variants])


def run_tp(path: str, size: int, length: int = PROMPT_LEN, **kwargs):
    """:func:`run_tp_variants` of one keyword set."""
    return run_tp_variants(path, size, length, [kwargs])[0]


@pytest.fixture(scope="module")
def tp_checkpoint(tmp_path_factory) -> str:
    from tidal.executor.presets import write_checkpoint

    return write_checkpoint("tiny", str(tmp_path_factory.mktemp("tp")), seed=3, overrides=TP_CONFIG)


@pytest.fixture(scope="module")
def single(tp_checkpoint):
    llm = LLM(tp_checkpoint, max_prefill_length=SHARD_LEN, **ONE)
    prompt = _prompt(SHARD_LEN)
    return llm.score(prompt), llm.generate([prompt], max_tokens=32, ignore_eos=True)[0]


# Every TP 2 run of this module, by one set of rank processes (started once): name -> (prompt length, keywords).
TP2_JOBS = {
    **{mode: (SHARD_LEN, dict(max_prefill_length=SHARD_LEN, hc_prefill_mode=mode)) for mode in ("off", "control",
                                                                                               "shard")},
    "chunked": (PROMPT_LEN, dict(max_prefill_length=64, hc_prefill_mode="shard")),
    "prefix": (0, dict(max_prefill_length=128, prefill_coalesce=False)),
    "prefix_coalesced": (0, dict(max_prefill_length=128, prefill_coalesce=True)),
    "offload_pinned": (PROMPT_LEN, dict(max_prefill_length=64, moe_strategy="offload", moe_cache_slots=4,
                                        ple_backend="pinned")),
    "random": (PROMPT_LEN, dict(load_format="random", seed=9)),
}


@pytest.fixture(scope="module")
def tp2(tp_checkpoint) -> dict:
    results = run_tp_jobs(tp_checkpoint, 2, list(TP2_JOBS.values()))
    return dict(zip(TP2_JOBS, results, strict=True))


@pytest.mark.parametrize("size", [2, 4])
def test_tensor_parallel_equals_one_rank(tp_checkpoint, single, size, request):
    """In each hyper-connection prefill mode: a 1024-row prefill (sharded in ``shard`` mode), then 32 decodes
    (always replicated). ``control`` (decides, never shards) runs at TP 2."""
    if size == 2:
        modes = ["off", "control", "shard"]
        results = [request.getfixturevalue("tp2")[mode] for mode in modes]
    else:
        modes = ["off", "shard"]
        results = run_tp_variants(tp_checkpoint, size, SHARD_LEN,
                                  [dict(max_prefill_length=SHARD_LEN, hc_prefill_mode=mode) for mode in modes])
    ref_logits, ref_ids = single
    config = LLM(tp_checkpoint).config
    for mode, (logits, ids, stats) in zip(modes, results, strict=True):
        assert (logits - ref_logits).abs().max().item() <= 1e-4, mode
        assert ids == ref_ids, mode
        if mode == "shard":  # the one scoring forward ran sharded, with these collectives
            layers, ple = config.num_hidden_layers, len(config.ple_layers)
            assert stats["tp_hc_shard_forwards"] == [1]
            assert stats["tp_reduce_scatters"] == [2 * layers]
            # block inputs (2 a layer), PLE streams and table rows, and the final streams and residual
            assert stats["tp_all_gathers"] == [2 * layers + 2 * ple + 3]
        else:
            assert stats["tp_hc_shard_forwards"] == [0] and stats["tp_reduce_scatters"] == [0], mode


def test_chunked_prompt_with_decodes_is_not_sharded(tp_checkpoint, tp2):
    """160 rows (under 1024) never shard; ids still equal one rank's."""
    llm = LLM(tp_checkpoint, max_prefill_length=64, **ONE)
    ref = llm.score(_prompt()), llm.generate([_prompt()], max_tokens=32, ignore_eos=True)[0]
    logits, ids, stats = tp2["chunked"]
    assert (logits - ref[0]).abs().max().item() <= 1e-4 and ids == ref[1]
    assert stats["tp_hc_shard_forwards"] == [0]


def test_prefix_cache_and_checkpoints_under_tp2(tp_checkpoint, tp2):
    """With checkpoints aligned to forwards and coalesced into them."""
    for coalesce, run in zip((False, True), (tp2["prefix"], tp2["prefix_coalesced"]), strict=True):
        ref = _prefix_run(LLM(tp_checkpoint, max_prefill_length=128, prefill_coalesce=coalesce, **ONE))
        assert tuple(run) == tuple(ref), coalesce
        assert ref[2] == [0, 256]  # the continuation restored the checkpoint at 256


def test_offloaded_experts_and_pinned_ple_under_tp2(tp_checkpoint, tp2):
    """Each rank streams its own slice of every expert and gathers its PLE columns from host memory."""
    llm = LLM(tp_checkpoint, max_prefill_length=64, **ONE)
    ref = llm.score(_prompt()), llm.generate([_prompt()], max_tokens=32, ignore_eos=True)[0]
    logits, ids, _ = tp2["offload_pinned"]
    assert (logits - ref[0]).abs().max().item() <= 1e-4 and ids == ref[1]


def test_random_weights_are_the_same_at_any_tp(tp_checkpoint, tp2):
    ref = LLM(tp_checkpoint, load_format="random", seed=9, **ONE).score(_prompt())
    logits, _, _ = tp2["random"]
    assert (logits - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("rows,size,decode,shard", [
    (1023, 2, False, False), (1024, 2, False, True), (1026, 4, False, False), (1024, 4, False, True),
    (4096, 2, True, False),
])
def test_hc_shard_eligibility(rows, size, decode, shard):
    from tidal.config.server_args import ServerArgs
    from tidal.scheduler.hc_shard import hc_shard_decision

    ok, why = hc_shard_decision(ServerArgs(tp=size, hc_prefill_mode="shard"), rows, decode)
    assert ok is shard, why
    assert hc_shard_decision(ServerArgs(tp=size, hc_prefill_mode="control"), rows, decode)[0] is False


def test_shards_that_do_not_divide_are_refused(tiny_checkpoint):
    # tiny has 2 GDN key heads: they cannot split over 4 ranks.
    with pytest.raises(Exception, match="linear_num_key_heads"):
        run_tp(tiny_checkpoint, 4)


def test_serve_tp2_end_to_end(tiny_checkpoint):
    """``tidal serve --tp 2``: two executor processes, the OpenAI API, ids equal to one rank."""
    from server_harness import Server, Tap, child_pids, cmdline

    needs_devices(2)
    prompt = _prompt()
    expected = LLM(tiny_checkpoint, **ONE).generate([prompt], max_tokens=12, ignore_eos=True)[0]
    flags = ("--dtype", "float32") if CUDA else ()
    srv = Server(tiny_checkpoint, "--tp", "2", *flags, api_key=None, device="cuda" if CUDA else "cpu")
    tap = Tap(srv.tap_addr)
    try:
        names = [cmdline(pid) for pid in child_pids(srv.proc.pid)]
        assert sum("executor" in n for n in names) == 2, names
        status, body = srv.post("/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 12,
                                                    "temperature": 0, "ignore_eos": True})
        assert status == 200, body
        _, token_ids, final = tap.wait_finished(body["id"].removeprefix("cmpl-"))
        assert token_ids == expected and final["finish_reason"] == "length"
        m = srv.wait_idle()
        assert m["tidal_kv_pages_in_use"] == 0
        assert m["tidal_scheduler_decodes_ahead_total"] >= 8  # decodes sent ahead: every rank filled in rank 0's token
    finally:
        tap.close()
        assert srv.stop() == []
