"""Decode steps through the fixed-shape path that CUDA graphs replay, against eager forwards.

On the CPU ``use_graphs(capture=False)`` runs the same padded step eagerly: per-row inputs from one
buffer, page tables from the per-slot device table, KV write rows, n-gram contexts and QSA blocks
derived on the device, padding rows on the spare slot and page. Its token ids must equal the eager
path's, whose metadata ``build_forward_batch`` builds on the host. (On a GPU the same step is
captured; ``tests/test_forward_gpu.py`` checks the replay.)
"""

from __future__ import annotations

import pytest
import torch

from tidal import LLM


def ids(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 248000, (n,), generator=gen).tolist()


# A one-token prompt (its first forward is already a decode row, fresh), and lengths that put
# decodes across QSA block (8 tokens) and page (16) boundaries.
PROMPTS = [ids(37, 1), ids(1, 2), ids(100, 3)]


def graphed(llm: LLM, max_batch: int = 8, max_pages: int = 64) -> LLM:
    llm.runner.use_graphs(max_batch, max_pages, capture=False)
    return llm


@pytest.fixture(scope="module")
def eager(tiny_checkpoint):
    llm = LLM(tiny_checkpoint, max_prefill_length=64)
    return llm.generate(PROMPTS, max_tokens=40, ignore_eos=True)


def test_graph_steps_equal_eager_decode(tiny_checkpoint, eager):
    """Three requests decode as a padded batch of 4, twice (the second round after prefix-cache hits)."""
    llm = graphed(LLM(tiny_checkpoint, max_prefill_length=64))
    assert llm.generate(PROMPTS, max_tokens=40, ignore_eos=True) == eager
    assert llm.generate(PROMPTS, max_tokens=40, ignore_eos=True) == eager
    assert llm.runner.graphs.steps >= 2 * 39
    stats = llm.scheduler.stats()
    assert stats.kv_pages_in_use == 0 and stats.state_slots_in_use == 0


def test_one_token_prompts_start_fresh_then_decode_in_graph_steps(tiny_checkpoint):
    """A one-token prompt's first forward is a single row at position 0 (run eagerly: it is a prompt row);
    it must ignore what its slot held (the n-gram context, conv and recurrent state of an earlier
    request), and the graph steps after it go on from its state."""
    prompts = [ids(1, 20), ids(1, 21)]
    want = LLM(tiny_checkpoint, max_prefill_length=64).generate(prompts, max_tokens=12, ignore_eos=True)
    llm = graphed(LLM(tiny_checkpoint, max_prefill_length=64, max_running_requests=2))
    llm.generate([ids(30, 22), ids(30, 23)], max_tokens=12, ignore_eos=True)  # leaves state in both slots
    assert llm.generate(prompts, max_tokens=12, ignore_eos=True) == want
    assert llm.runner.graphs.steps >= 11 + 11  # the decodes of both rounds; the one-token prompts ran eagerly


def test_graph_steps_with_seeded_sampling(tiny_checkpoint):
    kwargs = dict(max_tokens=24, ignore_eos=True, temperature=0.9, top_p=0.8, seed=11)
    want = LLM(tiny_checkpoint, max_prefill_length=64).generate(PROMPTS, **kwargs)
    llm = graphed(LLM(tiny_checkpoint, max_prefill_length=64))
    assert llm.generate(PROMPTS, **kwargs) == want
    assert llm.runner.graphs.steps > 0


def test_batches_beyond_the_graphs_run_eagerly(tiny_checkpoint, eager):
    """Three rows do not fit ``max_batch`` 2, and a request past ``max_pages`` pages (64 positions)
    leaves the table: those steps run eagerly, with the same ids."""
    llm = graphed(LLM(tiny_checkpoint, max_prefill_length=64), max_batch=2, max_pages=4)
    assert llm.generate(PROMPTS, max_tokens=40, ignore_eos=True) == eager
    steps = llm.runner.graphs.steps
    assert steps == 0  # three rows at every decode step
    # One short request alone: graph steps while it stays within 4 pages, eager after.
    alone = LLM(tiny_checkpoint, max_prefill_length=64).generate([PROMPTS[0]], max_tokens=40, ignore_eos=True)
    assert llm.generate([PROMPTS[0]], max_tokens=40, ignore_eos=True) == alone
    assert llm.runner.graphs.steps == 64 - 37  # positions 37..63
    assert llm.runner.graphs.wide


def test_graph_steps_after_preemption(tiny_checkpoint):
    """A small pool preempts the newest request: its slot and pages go to another, and its page table
    is rebuilt when it resumes from its checkpoint."""
    prompts = [ids(150, 5), ids(120, 6), ids(170, 7)]
    alone = [LLM(tiny_checkpoint, max_prefill_length=64).generate([p], max_tokens=150, ignore_eos=True)[0]
             for p in prompts]
    llm = graphed(LLM(tiny_checkpoint, max_prefill_length=64, kv_pool_tokens=512, max_model_len=512), max_pages=33)
    assert llm.generate(prompts, max_tokens=150, ignore_eos=True) == alone
    assert llm.scheduler.counters["preemptions"] > 0
    stats = llm.scheduler.stats()
    assert stats.kv_pages_in_use == 0 and stats.state_slots_in_use == 0


def test_graph_steps_after_a_prefix_hit(tiny_checkpoint):
    """The continuation of a finished conversation restores a checkpoint and decodes from graphs."""
    first = ids(150, 5)
    eager = LLM(tiny_checkpoint, max_prefill_length=64)
    llm = graphed(LLM(tiny_checkpoint, max_prefill_length=64))
    reply = eager.generate([first], max_tokens=40, ignore_eos=True)[0]
    assert llm.generate([first], max_tokens=40, ignore_eos=True)[0] == reply
    longer = first + reply + ids(20, 8)
    want = eager.generate([longer], max_tokens=30, ignore_eos=True)
    assert llm.generate([longer], max_tokens=30, ignore_eos=True) == want
    assert llm.scheduler.counters["cache_hits"] == 1


def test_a_decode_sent_ahead_after_a_failed_batch(tiny_checkpoint):
    """Token -1 stands for what the slot sampled in the batch before. When that batch failed before
    sampling, the row runs on a stand-in token (the scheduler drops its result with the failed
    request), and the other rows of the batch are unaffected."""
    from tidal.messages import Batch, SegmentSpec

    runner = LLM(tiny_checkpoint).runner
    first, other = ids(20, 30), ids(25, 31)
    want = LLM(tiny_checkpoint).generate([other], max_tokens=1, ignore_eos=True)[0]
    failing = Batch(batch_id=1, segments=[
        SegmentSpec(rid="r", slot=3, start=0, token_ids=first, pages=[0, 1], sample=True),
        SegmentSpec(rid="bad", slot=4, start=0, token_ids=[], pages=[2], sample=True)])
    with pytest.raises(ValueError, match="has no tokens"):
        runner.execute(failing)
    ahead = Batch(batch_id=2, segments=[
        SegmentSpec(rid="r", slot=3, start=20, token_ids=[-1], sample=True, sample_index=1),
        SegmentSpec(rid="o", slot=6, start=0, token_ids=other, pages=[10, 11], sample=True)])
    out = runner.execute(ahead)
    assert out.token_ids[1] == want[0]
    assert runner.last_sampled[3] == out.token_ids[0]  # the next decode sent ahead reads this one


@pytest.mark.parametrize("graphs", [False, True])
def test_only_decode_batches_may_take_the_moe_decode_kernels(tiny_checkpoint, monkeypatch, graphs):
    """The MoE's decode kernels round differently from the grouped path, so no prompt row may take them,
    however short its chunk: a forward runs its MoE with ``decode=True`` exactly when every row in it
    decodes a generated token. Covers a prompt whose last chunk is one token (17 tokens in chunks of
    16), a one-token prompt, prompts chunked beside decodes, and decode batches (eager or graph)."""
    from tidal.executor import runner as runner_mod
    from tidal.executor.layers import moe as moe_layer

    prompts = [ids(17, 4), ids(1, 5), ids(40, 6)]
    prompt_of: dict[str, list[int]] = {}
    forwards: list[list[bool]] = []  # per forward: is each segment a prompt segment?
    flags: list[bool] = []
    execute, moe_forward = runner_mod.ModelRunner.execute, moe_layer.SparseMoE.forward

    def execute_spy(self, batch):
        rows = []
        for spec in batch.segments:
            if spec.rid not in prompt_of:  # its first segment starts the prompt it belongs to
                prompt_of[spec.rid] = next(p for p in prompts if p[:len(spec.token_ids)] == spec.token_ids)
            rows.append(spec.start < len(prompt_of[spec.rid]))
        forwards.append(rows)
        return execute(self, batch)

    def moe_spy(self, x, decode=False):
        if self.experts.layer_idx == 0:
            flags.append(decode)
        return moe_forward(self, x, decode)

    monkeypatch.setattr(runner_mod.ModelRunner, "execute", execute_spy)
    monkeypatch.setattr(moe_layer.SparseMoE, "forward", moe_spy)
    llm = LLM(tiny_checkpoint, max_prefill_length=16, max_running_requests=3)
    if graphs:
        graphed(llm)
    llm.generate(prompts, max_tokens=5, ignore_eos=True)
    assert len(flags) == len(forwards)
    assert flags == [not any(rows) for rows in forwards]
    assert any(flags) and not all(flags)
    assert any(rows == [True] for rows in forwards)  # the one-token prompt (or the one-token tail) alone


def _step_spec(i: int, start: int, tokens: list[int], index: int, sampling=None):
    """Request ``r{i}`` in slot ``i`` with pages 16i..16i+15, sampling output ``index``."""
    from tidal.messages import SegmentSpec

    return SegmentSpec(rid=f"r{i}", slot=i, start=start, token_ids=tokens, pages=list(range(16 * i, 16 * i + 16)),
                       sample=True, sample_index=index, sampling=sampling)


def _decode_steps(runner, prompts: list[list[int]], steps: int, sampling=None, ahead: bool = False,
                  extra: dict[int, list[int]] | None = None) -> list[list[int]]:
    """Prefill ``prompts`` (slot i, pages 16i..16i+15), then ``steps`` decode steps of all of them, driven
    as the executor's loop drives the runner. ``ahead``: every step after the first is launched with token
    -1 (the scheduler's decode sent ahead) before the step before it is finished. ``extra[k]``: a new
    prompt joins at step k (a batch that cannot follow one still pending). Returns each step's ids."""
    from tidal.messages import Batch

    def spec(i: int, start: int, tokens: list[int], index: int):
        return _step_spec(i, start, tokens, index, sampling)

    last = [runner.execute(Batch(batch_id=i, segments=[spec(i, 0, p, 0)])).token_ids[0] for i, p in enumerate(prompts)]
    starts = [len(p) for p in prompts]
    out, pending, index = [], None, {i: 1 for i in range(len(prompts))}
    for k in range(steps):
        segs = [spec(i, starts[i], [-1] if ahead and pending is not None else [last[i]], index[i])
                for i in range(len(starts))]
        if extra and k in extra:
            segs.append(spec(len(starts), 0, extra[k], 0))
        launched = runner.launch(Batch(batch_id=100 + k, segments=segs))
        if pending is not None:
            out.append(runner.finish(pending).token_ids)
        if not ahead:
            out.append(runner.finish(launched).token_ids)
            launched = None
        pending = launched
        for i in range(len(starts)):
            starts[i] += 1
            index[i] += 1
        if extra and k in extra:
            starts.append(len(extra[k]))
            index[len(starts) - 1] = 1
        if not ahead:
            last = out[-1]
        elif pending is not None and pending.finished:  # it could not be launched ahead: its ids are known
            out.append(runner.finish(pending).token_ids)
            last, pending = out[-1], None
    if pending is not None:
        out.append(runner.finish(pending).token_ids)
    return out


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_a_step_launched_before_the_step_before_is_finished(tiny_checkpoint, sampling):
    """A decode step sampled on the device comes back pending; the next step, launched before its ids
    reach the host (token -1), reads them on the device. The ids equal steps run one after the other,
    also when a prompt joins mid-way (that batch cannot follow a pending step: the runner finishes it
    first)."""
    from tidal.messages import SamplingParams

    params = None if sampling == "greedy" else SamplingParams(temperature=0.8, top_k=40, seed=5)
    prompts, extra = [ids(30, 40), ids(9, 41)], {6: ids(12, 42)}
    want = _decode_steps(graphed(LLM(tiny_checkpoint)).runner, prompts, 12, params, extra=extra)
    runner = graphed(LLM(tiny_checkpoint)).runner
    launches = []  # (a step was pending when this batch was launched, what launch returned)
    launch = runner.launch

    def spy(batch):
        before = bool(runner.unfinished)
        launches.append((before, launch(batch)))
        return launches[-1][1]

    runner.launch = spy
    assert _decode_steps(runner, prompts, 12, params, ahead=True, extra=extra) == want
    # Steps 1-5 and 8-11 went out while the step before was pending; step 6 (with the new prompt, an eager
    # forward) waited for step 5, and step 7 followed a finished step.
    assert [k for k, (before, launched) in enumerate(launches[2:]) if before and launched.ids is not None] == \
        [1, 2, 3, 4, 5, 8, 9, 10, 11]
    assert launches[2 + 6][0] and launches[2 + 6][1].ids is None
    assert not runner.unfinished


def test_the_executor_loop_answers_in_order_with_steps_launched_ahead(tiny_checkpoint):
    """The executor's loop over batches as the overlapping scheduler sends them (each decode after the
    first sent ahead, token -1): each step is launched while the one before is pending, results go out
    in batch order with the ids of steps run one after the other; a batch that cannot follow (a prompt
    joins) and a malformed one are answered after the pending step, the malformed one with its error."""
    from collections import deque

    from tidal.executor.process import BatchLoop
    from tidal.messages import Batch, Shutdown

    prompts = [ids(30, 50), ids(9, 51)]
    want = _decode_steps(graphed(LLM(tiny_checkpoint)).runner, prompts, 8)

    llm = graphed(LLM(tiny_checkpoint))
    runner = llm.runner

    spec = _step_spec
    first = [runner.execute(Batch(batch_id=i, segments=[spec(i, 0, p, 0)])).token_ids[0] for i, p in enumerate(prompts)]
    batches = deque()
    for k in range(8):
        batches.append(Batch(batch_id=10 + k, segments=[spec(i, len(p) + k, [first[i]] if k == 0 else [-1], k + 1)
                                                        for i, p in enumerate(prompts)]))
        if k == 3:
            batches.append(Batch(batch_id=90, segments=[spec(5, 0, [], 0)]))  # no tokens: fails alone
    batches.insert(6, Batch(batch_id=91, segments=[spec(6, 0, ids(12, 52), 0)]))  # a prompt between steps

    class Inbound:
        def recv(self, timeout_ms=None):
            return batches.popleft() if batches else (None if timeout_ms is not None else Shutdown())

    class Sent(list):
        def send(self, msg):
            self.append(msg)

    results, control = Sent(), Sent()
    order = []
    launch, finish = runner.launch, runner.finish
    runner.launch = lambda batch: order.append(("launch", batch.batch_id)) or launch(batch)
    runner.finish = lambda launched: order.append(("finish", None)) or finish(launched)
    BatchLoop(llm.args, 0, runner, Inbound(), results, control).run()

    assert [r.batch_id for r in results] == [10, 11, 12, 13, 90, 14, 91, 15, 16, 17]
    steps = [r.token_ids for r in results if r.batch_id < 90]
    assert steps == want
    assert "has no tokens" in results[4].error and results[6].error is None and results[6].token_ids[0] >= 0
    assert not control and not runner.unfinished
    # Step 11 went out before step 10's ids were read back.
    assert order.index(("launch", 11)) < [i for i, o in enumerate(order) if o[0] == "finish"][0]
