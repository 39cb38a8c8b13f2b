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
