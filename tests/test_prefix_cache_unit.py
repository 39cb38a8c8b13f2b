"""Checkpoint planning and the prefix cache without processes."""

from __future__ import annotations

import pytest
import torch

from tidal import LLM
from tidal.scheduler import prefix_cache as prefix_cache_module
from tidal.scheduler.checkpoint_plan import plan_prompt
from tidal.scheduler.pools import PagePool, SlotPool
from tidal.scheduler.prefix_cache import MEMO_MIN_PAGES, HashMemo, PrefixCache, chain_hashes


def test_plan_align_mode_cuts_at_the_checkpoint():
    p = plan_prompt(1000, cached=0, max_chunk=8192, align=64, coalesce=False, checkpoint=True)
    assert p.chunks == [(0, 960), (960, 1000)] and p.checkpoints == [960]
    p = plan_prompt(1077, cached=960, max_chunk=8192, align=64, coalesce=False, checkpoint=True)
    assert p.chunks == [(960, 1024), (1024, 1077)] and p.checkpoints == [1024]


def test_plan_coalesced_keeps_one_forward():
    p = plan_prompt(1000, cached=0, max_chunk=8192, align=64, coalesce=True, checkpoint=True)
    assert p.chunks == [(0, 1000)] and p.checkpoints == [960]
    p = plan_prompt(1000, cached=0, max_chunk=300, align=64, coalesce=True, checkpoint=True)
    assert p.chunks == [(0, 256), (256, 512), (512, 768), (768, 1000)]


@pytest.mark.parametrize("max_chunk, cached, want", [
    (1000, 0, [(0, 960), (960, 1920), (1920, 2048)]),  # forwards end on multiples of 64
    (1024, 0, [(0, 1024), (1024, 2048)]),
    (1000, 1984, [(1984, 2048)]),
    (100, 1920, [(1920, 1984), (1984, 2048)]),  # from a cached prefix (a multiple of 64) on
    (40, 0, [(0, 40), (40, 80)]),  # a limit below one block is kept as it is
    (1000, 688, [(688, 1600), (1600, 2048)]),  # a hit off a block boundary: only the first forward is short
    (100, 1000, [(1000, 1024), (1024, 1088)]),
])
def test_plan_forwards_end_on_gdn_blocks(max_chunk, cached, want):
    p = plan_prompt(want[-1][1], cached=cached, max_chunk=max_chunk, align=64, coalesce=True, checkpoint=False)
    assert p.chunks == want
    assert all(hi - lo <= max_chunk for lo, hi in p.chunks)


def test_plan_limits_and_branch_point():
    # A checkpoint never sits at the prompt end (a hit must leave a token) nor at/below the hit.
    assert plan_prompt(1024, 0, None, 64, False, True).checkpoints == [960]
    assert plan_prompt(50, 0, None, 64, False, True).checkpoints == []
    assert plan_prompt(1000, 960, None, 64, False, True).checkpoints == []
    # 300 tokens shared with a cached prompt: checkpoint its last aligned position too.
    p = plan_prompt(330, 0, None, 64, False, True, branch=300)
    assert p.checkpoints == [256, 320] and p.chunks == [(0, 256), (256, 320), (320, 330)]
    assert plan_prompt(330, 0, None, 64, False, False).checkpoints == []


def _cache(pages=8, slots=2, page_size=4, align=8):
    counters = {"pages_evicted": 0, "checkpoints_written": 0, "checkpoints_evicted": 0}
    return PrefixCache(PagePool(pages), SlotPool(slots, start=10), page_size, align, True, counters), counters


def test_match_needs_pages_and_a_checkpoint():
    cache, counters = _cache()
    tokens = list(range(1, 20))
    pages = cache.alloc_pages(5)
    keys: list[bytes] = []
    cache.insert_pages(pages, keys, tokens[:16])
    assert cache.match(tokens).tokens == 0 and cache.match(tokens).page_tokens == 16
    slot = cache.alloc_checkpoint_slot()
    assert cache.insert_checkpoint(keys[:4], slot)
    m = cache.match(tokens + [99])
    assert m.tokens == 16 and m.pages == pages[:4] and m.checkpoint.slot == slot
    assert cache.match(tokens[:16]).tokens == 0  # the checkpoint at 16 would leave no token to compute
    assert cache.match([7] + tokens).tokens == 0  # another prefix
    assert counters["checkpoints_written"] == 1


def test_release_evicts_deepest_first_and_locked_checkpoints_stay():
    cache, counters = _cache(pages=6, slots=1)
    tokens = list(range(100, 124))
    pages = cache.alloc_pages(6)
    keys: list[bytes] = []
    cache.insert_pages(pages, keys, tokens)
    slot = cache.alloc_checkpoint_slot()
    cache.insert_checkpoint(keys[:4], slot)
    cache.release_pages(pages)
    assert cache.cached_pages == 6 and cache.pages.num_free == 0
    m = cache.match(tokens)
    cache.acquire(m)  # a request restores the checkpoint at 16: its pages and slot are locked
    assert cache.alloc_checkpoint_slot() is None
    got = cache.alloc_pages(2)
    assert sorted(got) == sorted(pages[4:6])  # the deepest pages went first
    assert counters["pages_evicted"] == 2
    cache.unlock(m.checkpoint)
    assert cache.alloc_checkpoint_slot() == slot and counters["checkpoints_evicted"] == 1


def _counting_hashes(monkeypatch) -> list[int]:
    """Pages hashed by the prefix cache from now on, one count per chain_hashes call."""
    counts: list[int] = []

    def counted(tokens, page_size, start=prefix_cache_module.ROOT):
        counts.append(len(tokens) // page_size)
        return chain_hashes(tokens, page_size, start)

    monkeypatch.setattr(prefix_cache_module, "chain_hashes", counted)
    return counts


def test_prefix_keys_equal_the_chain_hashes_whatever_the_memo_holds(monkeypatch):
    """Conversations, branches, unrelated and short prompts: every prompt's keys are the chain hashes of its own
    tokens, a prompt that extends one hashed before hashes only its new pages, and a memo small enough to evict
    gives the same keys."""
    counts = _counting_hashes(monkeypatch)
    page = 4
    gen = torch.Generator().manual_seed(0)

    def ids(n: int) -> list[int]:
        return torch.randint(0, 1000, (n,), generator=gen).tolist()

    def pages(prompt: list[int]) -> int:  # what prefix_keys hashes without a memo
        return (len(prompt) - 1) // page

    cache, _ = _cache(page_size=page)
    base = ids(page * MEMO_MIN_PAGES * 2 + 3)
    turns = [base]
    for _ in range(4):
        turns.append(turns[-1] + ids(page * 20 + 1))
    prompts: list[tuple[list[int], int]] = [(base, pages(base))]  # (prompt, pages it may hash at most)
    prompts += [(base + ids(9), 3), (base + ids(9), 3), (ids(page * MEMO_MIN_PAGES + 1), pages(base)),
                (base[:page * 3], 3), (base[:-50] + ids(70), pages(base) + 5), (ids(30), 8)]
    prompts += [(t, pages(t) - pages(p)) for p, t in zip(turns[:-1], turns[1:], strict=True)]
    prompts += [(base + ids(5), 2), (base[:page * MEMO_MIN_PAGES + 7] + ids(1), pages(base))]
    for i, (prompt, most) in enumerate(prompts):
        counts.clear()
        assert cache.prefix_keys(prompt) == chain_hashes(prompt[:-1], page), i
        assert sum(counts) <= most, (i, counts, most)
    # A request's pages remembered at its end: the next turn reuses them, prompt and answer.
    full = turns[-1] + ids(page * 30)
    cache.remember(full, chain_hashes(full, page))
    turn = full + ids(11)
    counts.clear()
    assert cache.prefix_keys(turn) == chain_hashes(turn[:-1], page)
    assert sum(counts) == pages(turn) - len(full) // page
    # The same prompts, shuffled, through a memo that holds two of them at most.
    small, _ = _cache(page_size=page)
    small.memo = HashMemo(page, max_tokens=len(turns[-1]) * 2, max_entries=2)
    order = torch.randperm(len(prompts), generator=gen).tolist() * 2
    for i in order:
        prompt = prompts[i][0]
        assert small.prefix_keys(prompt) == chain_hashes(prompt[:-1], page), i
        assert small.memo.tokens <= len(turns[-1]) * 2 and len(small.memo.entries) <= 2


def test_offline_continuation_hits_and_matches_uncached(tiny_checkpoint, device):
    gen = torch.Generator().manual_seed(5)
    cold = torch.randint(0, 248000, (1000,), generator=gen).tolist()
    cont = cold + torch.randint(0, 248000, (77,), generator=gen).tolist()
    for coalesce in (False, True):
        llm = LLM(tiny_checkpoint, device=device, prefill_coalesce=coalesce)
        llm.generate([cold], max_tokens=4, ignore_eos=True)
        hit = llm.generate([cont], max_tokens=16, ignore_eos=True)[0]
        assert llm.scheduler.counters["cached_tokens"] == 960
    plain = LLM(tiny_checkpoint, device=device, disable_prefix_cache=True)
    assert plain.generate([cont], max_tokens=16, ignore_eos=True)[0] == hit


def test_next_turn_hashes_only_its_own_pages(tiny_checkpoint, monkeypatch):
    """A conversation's next turn (the first turn's prompt and answer, then new tokens) hits the cache and
    hashes only the pages after what the first turn held; its ids equal the same prompt run without a cache."""
    counts = _counting_hashes(monkeypatch)
    gen = torch.Generator().manual_seed(6)
    first = torch.randint(0, 248000, (2000,), generator=gen).tolist()
    llm = LLM(tiny_checkpoint)
    answer = llm.generate([first], max_tokens=40, ignore_eos=True)[0]
    turn = first + answer + torch.randint(0, 248000, (100,), generator=gen).tolist()
    counts.clear()
    hit = llm.generate([turn], max_tokens=8, ignore_eos=True)[0]
    page = llm.sizes.page_size
    assert counts[0] <= (len(turn) - 1) // page - (len(first) + len(answer) - 1) // page
    assert llm.scheduler.counters["cached_tokens"] >= 1984
    plain = LLM(tiny_checkpoint, disable_prefix_cache=True)
    assert plain.generate([turn], max_tokens=8, ignore_eos=True)[0] == hit


def test_a_cold_prompt_is_hashed_once(tiny_checkpoint, monkeypatch):
    """The pages hashed to match a cold prompt at admission are the ones indexed after its forwards (chunked
    or not): only the page holding its last token is hashed again, and the keys equal its chain hashes."""
    counts = _counting_hashes(monkeypatch)
    gen = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, 248000, (1000,), generator=gen).tolist()
    for chunk in (None, 320):
        llm = LLM(tiny_checkpoint, max_prefill_length=chunk)
        seen = []
        index = llm.scheduler._index
        llm.scheduler._index = lambda req, seg, end, index=index, seen=seen: (index(req, seg, end),
                                                                              seen.append(list(req.page_keys)))
        counts.clear()
        llm.generate([prompt], max_tokens=1)
        page = llm.sizes.page_size
        assert sum(counts) == (len(prompt) - 1) // page + (len(prompt) // page - (len(prompt) - 1) // page)
        assert seen[-1] == chain_hashes(prompt, page)


def test_attention_only_model_hits_at_page_boundaries(tmp_path, device):
    from tidal.executor.presets import write_checkpoint

    path = write_checkpoint("tiny", str(tmp_path / "attn"), seed=3, overrides=dict(
        layer_types=["full_attention"] * 4, ple_layer_ids=[]))
    prompt = list(range(5000, 5100))
    llm = LLM(path, device=device)
    llm.generate([prompt], max_tokens=4, ignore_eos=True)
    hit = llm.generate([prompt + [7, 8, 9]], max_tokens=8, ignore_eos=True)[0]
    assert llm.scheduler.counters["cached_tokens"] == 96  # every full page, no checkpoint needed
    plain = LLM(path, device=device, disable_prefix_cache=True)
    assert plain.generate([prompt + [7, 8, 9]], max_tokens=8, ignore_eos=True)[0] == hit


def _two_checkpointed(older: list[int], newer: list[int]):
    """A cache of 8 pages and 2 checkpoint slots holding two sequences of two pages each, each with a checkpoint at
    its end (``older``'s written first); per sequence its pages, chain hashes and slot."""
    cache, counters = _cache(pages=8, slots=2)
    held = []
    for tokens in (older, newer):
        pages, keys = cache.alloc_pages(2), []
        cache.insert_pages(pages, keys, tokens)
        slot = cache.alloc_checkpoint_slot()
        assert cache.insert_checkpoint(keys, slot)
        held.append((pages, keys, slot))
    return cache, counters, held


def test_unreachable_checkpoints_give_their_slots_first():
    """With every slot taken, a new checkpoint slot comes from an idle checkpoint one of whose pages was evicted,
    before a less recently used one still whole; one whose evicted pages are cached again is whole again."""
    a, b = list(range(100, 108)), list(range(200, 208))
    cache, counters, ((pb, kb, _), (pa, _, slot_a)) = _two_checkpointed(b, a)  # b's checkpoint the older
    cache.release_pages(pa)  # a's pages the least recently used
    cache.release_pages(pb)
    assert cache.alloc_pages(5) is not None  # 4 free, then a's deepest page evicted
    assert cache.match(a + [0]).tokens == 0 and cache.match(b + [0]).tokens == 8
    assert cache.alloc_checkpoint_slot() == slot_a and counters["checkpoints_evicted"] == 1
    assert cache.match(b + [0]).tokens == 8 and kb[-1] in cache.checkpoints

    c, d = list(range(300, 308)), list(range(400, 408))
    cache, counters, ((pc, _, sc), (pd, kd, _)) = _two_checkpointed(c, d)
    cache.release_pages(pd)  # d's pages the least recently used
    cache.release_pages(pc)
    held = cache.alloc_pages(6)  # 4 free, then both of d's pages evicted
    assert cache.match(d + [0]).tokens == 0 and cache.match(c + [0]).tokens == 8
    cache.pages.decref(held)  # free again
    again: list[bytes] = []
    cache.insert_pages(cache.alloc_pages(2), again, d)  # d's pages computed and cached anew
    assert again == kd and cache.match(d + [0]).tokens == 8
    assert cache.alloc_checkpoint_slot() == sc  # both whole: the least recently used goes
    assert counters["checkpoints_evicted"] == 1


def test_a_checkpoint_stands_on_the_shorter_one_it_extends_after_that_one_is_dropped():
    """A checkpoint that extends a shorter one of its chain (here at 24 and 8 tokens) stands on the shorter one's
    pages too, after that one gave its slot: one of those pages evicted makes it unreachable, the first to give
    its slot though another is less recently used; cached again, it is whole again. Once both are dropped,
    nothing of what they stood on is kept."""
    cache, counters = _cache(pages=16, slots=2)
    tokens, other = list(range(100, 124)), list(range(300, 308))
    pages, keys = cache.alloc_pages(6), []
    cache.insert_pages(pages, keys, tokens)
    assert cache.insert_checkpoint(keys[:2], cache.alloc_checkpoint_slot())
    assert cache.insert_checkpoint(keys[:6], cache.alloc_checkpoint_slot())
    cache.release_pages(pages)
    slot = cache.alloc_checkpoint_slot()  # both whole: the one at 8, the older, gives its slot
    assert counters["checkpoints_evicted"] == 1 and keys[1] not in cache.checkpoints
    assert cache.match(tokens + [0]).tokens == 24

    page_1 = pages[1]  # the cached page at [4, 8)

    def newest_idle_with_page_1_least_recent():
        hit = cache.match(tokens + [0])  # a request restores the checkpoint at 24: it is the most recently used
        cache.acquire(hit)
        cache.unlock(hit.checkpoint)
        cache.release_pages(hit.pages)
        for page in [p for p in cache.evictable if p != page_1]:
            cache.evictable.move_to_end(page)

    for phase in range(2):
        other_pages, other_keys = cache.alloc_pages(2), []
        cache.insert_pages(other_pages, other_keys, other)
        assert cache.insert_checkpoint(other_keys, slot)
        cache.release_pages(other_pages)
        newest_idle_with_page_1_least_recent()
        held = cache.alloc_pages(cache.pages.num_free + 1)  # evicts the page at [4, 8)
        assert cache.match(tokens + [0]).tokens == 0 and cache.match(other + [0]).tokens == 8
        if phase == 0:  # computed anew: whole again, and the less recently used one goes
            again: list[bytes] = []
            cache.insert_pages(held[:6], again, tokens)
            cache.release_pages(held[:6])
            cache.pages.decref(held[6:])
            assert again == keys and cache.match(tokens + [0]).tokens == 24
            slot = cache.alloc_checkpoint_slot()
            assert other_keys[-1] not in cache.checkpoints and keys[5] in cache.checkpoints
            page_1 = held[1]
        else:
            cache.pages.decref(held)
            assert cache.alloc_checkpoint_slot() is not None
            assert keys[5] not in cache.checkpoints and other_keys[-1] in cache.checkpoints
    assert counters["checkpoints_evicted"] == 3
    cache.alloc_checkpoint_slot()  # the other goes too
    assert not cache.checkpoints and not cache.stands and not cache.standing


def test_checkpoints_are_whole_exactly_when_their_pages_are_cached_under_random_traffic():
    """Requests over three shared trunks with branching tails match, take and release pages, write checkpoints at
    aligned positions and evict under pressure: after each, every checkpoint counts as whole exactly when every
    page it stands on is cached, and what the cache keeps of stands belongs to live checkpoints."""
    import random

    rng = random.Random(0)
    cache, _ = _cache(pages=48, slots=16)
    trunks = [list(range(1000 * i, 1000 * i + 96)) for i in range(3)]
    written: dict[bytes, list[bytes]] = {}  # checkpoint key -> the page keys it was written over
    for _ in range(300):
        tokens = rng.choice(trunks)[:rng.randrange(1, 13) * 8]
        tokens = tokens + [rng.randrange(5000, 5004) for _ in range(rng.randrange(0, 17))]
        match = cache.match(tokens + [0])
        need = (len(tokens) + 3) // 4 - len(match.pages)
        if cache.available_pages() - sum(p in cache.evictable for p in match.pages) < need:
            continue
        cache.acquire(match)
        pages, keys = match.pages + cache.alloc_pages(need), list(match.keys)
        cache.insert_pages(pages, keys, tokens[len(match.keys) * 4:len(tokens) // 4 * 4])
        for n in sorted(rng.sample(range(2, len(keys) + 1, 2), min(2, len(keys) // 2))):
            slot = cache.alloc_checkpoint_slot()
            if slot is None:
                break
            if cache.insert_checkpoint(keys[:n], slot):
                written[keys[n - 1]] = keys[:n]
            else:
                cache.slots.free(slot)
        if match.checkpoint is not None:
            cache.unlock(match.checkpoint)
        cache.release_pages(pages)
        for key in cache.checkpoints:
            assert cache.stands[key].whole() == all(k in cache.page_of for k in written[key])
        below = {id(s.parent) for s in cache.stands.values() if s.parent is not None}
        assert all(s.checkpoint is not None or id(s) in below for s in cache.stands.values())
        assert all(s in cache.stands.values() for on in cache.standing.values() for s in on)
    assert 0 < len(cache.checkpoints) and any(s.parent is not None for s in cache.stands.values())


def test_memo_compares_shared_prefixes_once(monkeypatch):
    """Many remembered continuations of one long prompt: a lookup compares about the prompt's length of tokens,
    not that times the number of continuations, and still gives the longest that matches."""
    from tidal.scheduler import prefix_cache as prefix_cache_module

    compared: list[int] = []
    plain = prefix_cache_module._starts_with

    def counting(tokens, head):
        compared.append(len(head))
        return plain(tokens, head)

    monkeypatch.setattr(prefix_cache_module, "_starts_with", counting)
    page = 4
    memo = HashMemo(page)
    gen = torch.Generator().manual_seed(3)
    base = torch.randint(0, 1000, (page * 200,), generator=gen).tolist()
    memo.remember(base, chain_hashes(base, page))
    conts = [base + torch.randint(0, 1000, (page * 3,), generator=gen).tolist() for _ in range(20)]
    for cont in conts:
        memo.remember(cont, chain_hashes(cont, page))
    for probe, want in ((conts[7] + [1, 2], conts[7]), (base + [5] * 20, base), (conts[3][:-1], base)):
        compared.clear()
        assert memo.lookup(probe) == chain_hashes(want, page)
        assert sum(compared) <= len(base) + 21 * page * 3, sum(compared)
    compared.clear()
    assert memo.lookup(torch.randint(0, 1000, (page * 300,), generator=gen).tolist()) == []
    other = [t + 1 for t in base[:page]] + base[page:]  # differs in the first page only
    assert memo.lookup(other + conts[7][len(base):] + [1]) == []  # a continuation's tail alone is no match
    # Without its parent (evicted) a continuation is compared whole, and still found.
    del memo.entries[chain_hashes(base, page)[-1]]
    assert memo.lookup(conts[5] + [9]) == chain_hashes(conts[5], page)
