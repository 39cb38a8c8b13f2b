"""Tensor parallelism on the CPU (gloo): TP = 2 and 4 against TP = 1, in float32.

Every rank runs the same offline ``LLM`` (scheduler and runner) in lockstep, which is how the
executors see the same batches; rank 0 reports. The config has 2 KV heads (replicated at TP 4) and
grouped GDN value heads (8 value heads over 4 key heads).
"""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from tidal import LLM

TP_CONFIG = dict(num_attention_heads=8, num_key_value_heads=2, linear_num_key_heads=4, linear_num_value_heads=8)
PROMPT_LEN = 160


def _prompt() -> list[int]:
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 248000, (PROMPT_LEN,), generator=gen)
    ids[70] = 248046  # EOS inside
    return ids.tolist()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, size: int, port: int, path: str, kwargs: dict, queue) -> None:
    torch.set_num_threads(1)
    from tidal.executor.distributed import init_tp

    init_tp(rank, size, f"tcp://127.0.0.1:{port}", "gloo")
    try:
        llm = LLM(path, **kwargs)
        logits = llm.score(_prompt())
        ids = llm.generate([_prompt()], max_tokens=32, ignore_eos=True)[0]
        if rank == 0:
            queue.put((logits.numpy(), ids))  # by value: the process exits before the parent reads
    except Exception as e:  # report instead of hanging the parent
        queue.put(e)
        raise


def run_tp(path: str, size: int, **kwargs):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, size, port, path, kwargs, queue)) for r in range(size)]
    for p in procs:
        p.start()
    result = queue.get(timeout=300)
    for p in procs:
        p.join(timeout=60)
    if isinstance(result, Exception):
        raise result
    assert all(p.exitcode == 0 for p in procs)
    return torch.from_numpy(result[0]), result[1]


@pytest.fixture(scope="module")
def tp_checkpoint(tmp_path_factory) -> str:
    from tidal.executor.presets import write_checkpoint

    return write_checkpoint("tiny", str(tmp_path_factory.mktemp("tp")), seed=3, overrides=TP_CONFIG)


@pytest.fixture(scope="module")
def single(tp_checkpoint):
    llm = LLM(tp_checkpoint)
    return llm.score(_prompt()), llm.generate([_prompt()], max_tokens=32, ignore_eos=True)[0]


@pytest.mark.parametrize("size", [2, 4])
def test_tensor_parallel_equals_one_rank(tp_checkpoint, single, size):
    logits, ids = run_tp(tp_checkpoint, size, max_prefill_length=64)
    ref_logits, ref_ids = single
    assert (logits - ref_logits).abs().max().item() <= 1e-4
    assert ids == ref_ids


def test_random_weights_are_the_same_at_any_tp(tp_checkpoint):
    ref = LLM(tp_checkpoint, load_format="random", seed=9).score(_prompt())
    logits, _ = run_tp(tp_checkpoint, 2, load_format="random", seed=9)
    assert (logits - ref).abs().max().item() <= 1e-4


def test_shards_that_do_not_divide_are_refused(tiny_checkpoint):
    # tiny has 2 GDN key heads: they cannot split over 4 ranks.
    with pytest.raises(Exception, match="linear_num_key_heads"):
        run_tp(tiny_checkpoint, 4)


if os.environ.get("TIDAL_TEST_DEVICE", "cpu").startswith("cuda"):
    pytestmark = pytest.mark.skip(reason="gloo tensor-parallel tests run on the CPU")


def test_serve_tp2_end_to_end(tiny_checkpoint):
    """``tidal serve --tp 2 --device cpu``: two executor processes, the OpenAI API, ids equal to one rank."""
    from server_harness import Server, Tap, child_pids, cmdline

    prompt = _prompt()
    expected = LLM(tiny_checkpoint).generate([prompt], max_tokens=12, ignore_eos=True)[0]
    srv = Server(tiny_checkpoint, "--tp", "2", api_key=None)
    tap = Tap(srv.tap_addr)
    try:
        names = [cmdline(pid) for pid in child_pids(srv.proc.pid)]
        assert sum("executor" in n for n in names) == 2, names
        status, body = srv.post("/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 12,
                                                    "temperature": 0, "ignore_eos": True})
        assert status == 200, body
        _, token_ids, final = tap.wait_finished(body["id"].removeprefix("cmpl-"))
        assert token_ids == expected and final["finish_reason"] == "length"
        assert srv.wait_idle()["tidal_kv_pages_in_use"] == 0
    finally:
        tap.close()
        assert srv.stop() == []
