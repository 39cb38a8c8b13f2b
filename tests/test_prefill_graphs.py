"""Prompt forwards through the fixed-shape path that CUDA graphs replay, against eager forwards.

On the CPU ``use_prefill_graphs(capture=False)`` runs the same padded forward eagerly: the prompt segment and a
padding segment on the spare slot and page, both split once so that every shape is fixed, metadata from one
upload. Its token ids must equal the eager path's, and every prompt of one shape must give the same host
values (what a recorded graph holds). (On a GPU the forward is captured; ``tests/test_prefill_graphs_gpu.py``
checks the replay.)
"""

from __future__ import annotations

import pytest
import torch

from tidal import LLM
from tidal.executor.forward_batch import GDN_CHUNK
from tidal.executor.prefill_graph import SIZES, PrefillGraphs, rows_of, signature, sizes_for


def ids(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 248000, (n,), generator=gen).tolist()


# Lengths around the 64-row chunk and the sizes' bounds: 2 rows, a split inside the first chunk, exactly one
# and two chunks, one past, and a prompt longer than the largest size the tests give (run eagerly).
PROMPTS = [ids(2, 1), ids(37, 2), ids(64, 3), ids(128, 4), ids(129, 5), ids(400, 6)]


def graphed(llm: LLM, max_pages: int = 64, sizes=(0, 1, 2, 4)) -> LLM:
    llm.runner.prefill_graphs = PrefillGraphs(llm.runner.model, llm.runner.config, llm.runner.kv, llm.runner.states,
                                              llm.runner.device, max_pages, pad_slot=llm.runner.states.num_slots - 1,
                                              pad_page=llm.runner.kv.num_pages - 1, capture=False, sizes=sizes)
    return llm


@pytest.fixture(scope="module")
def eager(tiny_checkpoint):
    llm = LLM(tiny_checkpoint, max_prefill_length=512)
    return [llm.generate([p], max_tokens=16, ignore_eos=True)[0] for p in PROMPTS]


def test_prompt_forwards_equal_eager(tiny_checkpoint, eager):
    """Each prompt alone: the graphs' padded forward for those that fit a size, the eager one for the longest."""
    llm = graphed(LLM(tiny_checkpoint, max_prefill_length=512))
    got = [llm.generate([p], max_tokens=16, ignore_eos=True)[0] for p in PROMPTS]
    assert got == eager
    assert llm.runner.prefill_graphs.replays == len(PROMPTS) - 1  # 400 rows exceed 64 * 4 + 64
    stats = llm.scheduler.stats()
    assert stats.kv_pages_in_use == 0 and stats.state_slots_in_use == 0


def test_continuations_and_prefix_hits_equal_eager(tiny_checkpoint):
    """A prompt, then the same prompt and a longer one: the second forwards start at a cached checkpoint (a
    continuation of the cached state, its internal checkpoint exported from inside the padded forward)."""
    base = ids(150, 7)
    prompts = [base, base + ids(77, 8), base + ids(5, 9)]
    ref = LLM(tiny_checkpoint, max_prefill_length=512)
    want = [ref.generate([p], max_tokens=12, ignore_eos=True)[0] for p in prompts]
    llm = graphed(LLM(tiny_checkpoint, max_prefill_length=512))
    graphs = llm.runner.prefill_graphs
    runs = []
    run = graphs.run
    graphs.run = lambda slot, start, token_ids, *rest: runs.append((start, len(token_ids))) or run(
        slot, start, token_ids, *rest)
    got = [llm.generate([p], max_tokens=12, ignore_eos=True)[0] for p in prompts]
    assert got == want
    assert graphs.replays == 3
    assert runs[0] == (0, 150)
    assert all(start > 0 and start + n == len(p) for (start, n), p in zip(runs[1:], prompts[1:], strict=True))


def test_chunked_prompts_equal_eager(tiny_checkpoint):
    """A prompt in chunks of 96: each chunk alone in its batch runs from the padded forward, going on from the
    state the chunk before left in the slot."""
    prompt = ids(250, 10)
    want = LLM(tiny_checkpoint, max_prefill_length=96).generate([prompt], max_tokens=12, ignore_eos=True)
    llm = graphed(LLM(tiny_checkpoint, max_prefill_length=96))
    assert llm.generate([prompt], max_tokens=12, ignore_eos=True) == want
    assert llm.runner.prefill_graphs.replays >= 3


def test_one_shape_one_signature(tiny_checkpoint):
    """Every prompt a shape takes (any length, start and internal checkpoint) gives the host values of the
    shape's capture: the same arrays, groups and QSA block count, so its graph reads the right offsets."""
    llm = graphed(LLM(tiny_checkpoint, max_prefill_length=512), max_pages=64)
    graphs = llm.runner.prefill_graphs
    page = graphs.page_size
    seen: dict[tuple[int, int], tuple] = {}
    for length in range(2, GDN_CHUNK * 4 + GDN_CHUNK + 1):
        for start in (0, 64, 200):
            end = start + length
            for exports in ([], [(length, 3)], [(end // 64 * 64 - start, 5)] if 0 < end // 64 * 64 - start < length
                            else []):
                key = graphs.key(start, length, exports, -(-end // page))
                if key is None:
                    assert graphs.split(length, exports) is None or end > 64 * page
                    continue
                plan, _ = graphs._plan(key, 0, start, [1] * length, list(range(-(-end // page))), exports)
                assert plan.groups[0]["num_rows"] == rows_of(key[0])
                sig = signature(plan)
                assert seen.setdefault(key, sig) == sig, (length, start, exports)
    assert {m for m, _ in seen} == {0, 1, 2, 4}
    for key, sig in seen.items():  # and the forward each graph is recorded over
        assert signature(graphs.capture_plan(key)[0]) == sig, key
    assert set(seen) <= set(graphs.shapes())
    every = PrefillGraphs(graphs.model, llm.runner.config, graphs.kv, graphs.states, graphs.device, 4096,
                          graphs.pad_slot, graphs.pad_page, capture=False)
    for key in every.shapes():  # the default sizes: padding longer than any block bucket it is recorded with
        plan, _ = every.capture_plan(key)
        assert plan.groups[0]["num_rows"] == rows_of(key[0]) and plan.qsa[1] == key[1]


def test_sizes_cover_the_longest_chunk():
    """The sizes a limit takes hold every chunk up to it (the last size holds the limit itself, the one before it
    does not), and the server flag is bounded by the largest size."""
    from tidal.config.server_args import ArgsError, ServerArgs
    from tidal.executor.runner import prompt_graph_tokens

    for limit in (2, 64, 65, 128, 129, 2112, 2113, 4160, 4161, 8192, 8256):
        sizes = sizes_for(limit)
        assert sizes == SIZES[:len(sizes)] and sizes[0] == 0
        assert GDN_CHUNK * sizes[-1] + GDN_CHUNK >= limit
        assert len(sizes) == 1 or GDN_CHUNK * sizes[-2] + GDN_CHUNK < limit
    assert sizes_for(8192)[-1] == 128 and sizes_for(2112)[-1] == 32
    assert prompt_graph_tokens(ServerArgs()) == 8192
    assert prompt_graph_tokens(ServerArgs(max_prefill_length=512)) == 512
    assert prompt_graph_tokens(ServerArgs(max_prefill_length=None, prefill_graph_max_tokens=3000)) == 3000
    for bad in (1, 8257):
        with pytest.raises(ArgsError, match="--prefill-graph-max-tokens: must be between 2 and 8256"):
            ServerArgs(prefill_graph_max_tokens=bad)


def test_long_prompt_forwards_equal_eager(tiny_checkpoint):
    """Prompts past 4,160 rows take the largest size (8,258 padded rows): a cold prompt and a continuation of it."""
    base = ids(4200, 11)
    prompts = [base, base + ids(3000, 12)]
    want = LLM(tiny_checkpoint, max_prefill_length=8192).generate(prompts, max_tokens=4, ignore_eos=True)
    llm = graphed(LLM(tiny_checkpoint, max_prefill_length=8192), max_pages=1024, sizes=sizes_for(8192))
    assert [llm.generate([p], max_tokens=4, ignore_eos=True)[0] for p in prompts] == want
    assert llm.runner.prefill_graphs.replays == 2


def test_split_layout():
    """Wave 0 holds 64 M + 1 rows in M + 1 chunks and wave 1 65 rows in two, whatever the prompt's split."""
    for m in (1, 2, 4, 128):
        for e in range(1, GDN_CHUNK * m + 1):
            for tail in (1, 17, GDN_CHUNK):
                head = GDN_CHUNK * m + 1 - e
                pad = rows_of(m) - e - tail
                assert head >= 1 and pad - head == GDN_CHUNK + 1 - tail >= 1
                chunks0 = -(-e // GDN_CHUNK) + -(-head // GDN_CHUNK)
                chunks1 = -(-tail // GDN_CHUNK) + -(-(pad - head) // GDN_CHUNK)
                assert (chunks0, chunks1) == (m + 1, 2)
