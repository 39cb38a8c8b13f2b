"""Triton fused MoE against the per-expert loop, and its device-side alignment.

Without a GPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, fp32 only, small
shapes); with one, the same small-shape tests run compiled on it, and the ``gpu``-marked tests add the
bench shapes (512 experts, top-10, hidden 2048, intermediate 512) in bf16, fp16 and fp32.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

if not torch.cuda.is_available():
    # Must precede the first import of triton; on a GPU machine the kernels run compiled instead.
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton")

from tidal.kernels import moe_triton  # noqa: E402
from tidal.kernels.moe import fused_experts, fused_experts_ref  # noqa: E402
from tidal.kernels.moe_triton import align_assignments, fused_experts_triton, sort_assignments, tile_ends  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
EXPERTS, HIDDEN, INTER = 8, 64, 32
HOT = 3  # receives every token
COLD = (6, 7)  # receive none


def _skewed_ids(tokens: int, top_k: int, seed: int = 0) -> torch.Tensor:
    """Slot 0 is always expert ``HOT``; the other slots are distinct experts drawn from the rest,
    never from ``COLD``."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.tensor([e for e in range(EXPERTS) if e != HOT and e not in COLD])
    rest = torch.stack([pool[torch.randperm(len(pool), generator=g)[:top_k - 1]] for _ in range(tokens)])
    return torch.cat([torch.full((tokens, 1), HOT), rest], dim=1)


def _small_case(tokens: int, top_k: int, device: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=g)
    gate_up = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) / HIDDEN ** 0.5
    down = torch.randn(EXPERTS, HIDDEN, INTER, generator=g) / INTER ** 0.5
    weights = torch.rand(tokens, top_k, generator=g) + 0.1
    weights = weights / weights.sum(-1, keepdim=True)
    ids = _skewed_ids(tokens, top_k, seed)
    return tuple(t.to(device) for t in (x, ids, weights, gate_up, down))


def _check_alignment(ids: torch.Tensor, num_experts: int, block_m: int) -> None:
    sorted_ids, block_expert = align_assignments(ids, num_experts, block_m)
    sorted_ids, block_expert = sorted_ids.cpu(), block_expert.cpu()
    n = ids.numel()
    flat = ids.flatten().cpu()
    assert sorted_ids.shape[0] == block_expert.shape[0] * block_m
    real = sorted_ids[sorted_ids < n]
    assert torch.equal(real.sort().values, torch.arange(n, dtype=real.dtype))  # each assignment exactly once
    assert bool(((sorted_ids >= 0) & (sorted_ids <= n)).all())  # only assignments or the sentinel
    blocks = sorted_ids.view(-1, block_m)
    live = block_expert >= 0
    # Live blocks form a prefix, each holds at least one assignment, all of its block's expert.
    assert bool(live[:int(live.sum())].all())
    for b, expert in enumerate(block_expert.tolist()):
        members = blocks[b][blocks[b] < n]
        if expert < 0:
            assert members.numel() == 0
        else:
            assert members.numel() > 0 and bool((flat[members.long()] == expert).all())
            assert bool((members[1:] > members[:-1]).all())  # stable: flat order within an expert
    # Padding only fills each expert's last block.
    per_expert = torch.bincount(flat, minlength=num_experts)
    assert int(live.sum()) == int(((per_expert + block_m - 1) // block_m).sum())


@pytest.mark.parametrize("block_m", [1, 4, 16, 64])
@pytest.mark.parametrize("tokens,top_k", [(1, 2), (5, 3), (37, 3), (37, 2)])
def test_alignment_invariants(tokens, top_k, block_m):
    _check_alignment(_skewed_ids(tokens, top_k).to(DEV), EXPERTS, block_m)


def test_alignment_bench_shape_bounds():
    """Random top-10 of 512: the upper bounds hold and blocks never outnumber assignments."""
    for tokens in (1, 3, 40):
        logits = torch.randn(tokens, 512, generator=torch.Generator().manual_seed(tokens))
        ids = torch.topk(logits, 10, dim=-1).indices.to(DEV)
        _check_alignment(ids, 512, 16)
        assert align_assignments(ids, 512, 16)[1].shape[0] <= tokens * 10


def _assert_close_to_ref(out: torch.Tensor, ref: torch.Tensor) -> None:
    # fp32: only summation order differs.
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert (out - ref).abs().max().item() <= 1e-5 * max(1.0, ref.abs().max().item())


def _check_sort(ids: torch.Tensor, num_experts: int, block_m: int) -> None:
    """``sort_assignments`` against torch's stable sort, ``searchsorted`` and ``tile_ends``: the same runs of the same
    assignments (in any order within a run), the inverse, tokens, run ends and tiles to the element."""
    order, inverse, tokens, ends, tile_end = sort_assignments(ids, num_experts, block_m)
    flat = ids.flatten()
    sorted_ids, want_order = torch.sort(flat, stable=True)
    want_ends = torch.searchsorted(sorted_ids, torch.arange(num_experts, device=ids.device, dtype=sorted_ids.dtype),
                                   right=True, out_int32=True)
    assert torch.equal(ends, want_ends) and torch.equal(tile_end, tile_ends(want_ends, ids.numel(), block_m)[0])
    assert torch.equal(flat[order], sorted_ids)  # every run holds its expert's assignments only
    assert torch.equal(order.sort().values, torch.arange(flat.numel(), device=ids.device))  # each exactly once
    assert torch.equal(inverse[order], torch.arange(flat.numel(), device=ids.device))
    assert torch.equal(tokens, order // ids.shape[1])


@pytest.mark.parametrize("tokens,top_k,experts,block_m", [
    (1, 2, 8, 16), (5, 3, 8, 4), (37, 3, 8, 16), (13, 4, 100, 1), (32, 10, 512, 16), (102, 10, 1100, 64)])
def test_sort_assignments_is_torch_sort(tokens, top_k, experts, block_m):
    """One program's sort by expert, its inverse and the row tiles, against the torch ops they replace: skewed ids
    (an expert in every token, two in none), random ids over more experts than a chunk, up to :data:`SORT_MAX`."""
    if experts == EXPERTS:
        ids = _skewed_ids(tokens, top_k)
    else:
        g = torch.Generator().manual_seed(tokens)
        ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    assert ids.numel() <= moe_triton.SORT_MAX
    _check_sort(ids.to(DEV), experts, block_m)
    _check_sort(torch.full((tokens, top_k), experts - 1, device=DEV), experts, block_m)  # one expert takes all


@pytest.mark.parametrize("tokens", [1, 5, 37])
@pytest.mark.parametrize("top_k", [2, 3])
def test_triton_matches_the_loop(tokens, top_k):
    x, ids, w, gu, d = _small_case(tokens, top_k, DEV)
    _assert_close_to_ref(fused_experts_triton(x, ids, w, gu, d), fused_experts_ref(x, ids, w, gu, d))


@pytest.mark.parametrize("bucket", [1, 2, 3, 4])
def test_triton_prefill_configs(bucket):
    """The larger-tile table rows (several experts per block size, multi-block hot expert)."""
    x, ids, w, gu, d = _small_case(37, 3, DEV, seed=1)
    config = moe_triton.CONFIGS[bucket][1]
    _assert_close_to_ref(fused_experts_triton(x, ids, w, gu, d, config), fused_experts_ref(x, ids, w, gu, d))


def test_triton_non_contiguous_operands():
    """Strided x and weights (the kernels take strides, not contiguity)."""
    x, ids, w, gu, d = _small_case(5, 2, DEV)
    xs = torch.stack([x, x], dim=2)[:, :, 0]
    gus = gu.transpose(1, 2).contiguous().transpose(1, 2)
    ds = d.transpose(1, 2).contiguous().transpose(1, 2)
    _assert_close_to_ref(fused_experts_triton(xs, ids, w, gus, ds), fused_experts_ref(x, ids, w, gu, d))


def test_triton_no_tokens():
    x, ids, w, gu, d = _small_case(1, 2, DEV)
    out = fused_experts_triton(x[:0], ids[:0], w[:0], gu, d)
    assert out.shape == (0, HIDDEN)


@functools.cache
def _bench_weights(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Generated on the GPU (a billion parameters is slow through the CPU) and shared by the token counts."""
    g = torch.Generator(device="cuda").manual_seed(0)
    experts, hidden, inter = 512, 2048, 512
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=g, device="cuda") / hidden ** 0.5).to(dtype)
    down = (torch.randn(experts, hidden, inter, generator=g, device="cuda") / inter ** 0.5).to(dtype)
    return gate_up, down


def _bench_case(tokens: int, dtype: torch.dtype):
    g = torch.Generator(device="cuda").manual_seed(tokens)
    gate_up, down = _bench_weights(dtype)
    x = torch.randn(tokens, 2048, generator=g, device="cuda").to(dtype)
    logits = torch.randn(tokens, 512, generator=g, device="cuda")
    weights, ids = torch.topk(torch.softmax(logits, -1), 10, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).to(dtype)
    return x, ids, weights, gate_up, down


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 17, 32, 102])
def test_sort_assignments_decode_shapes_gpu(tokens):
    """The one-program sort at flash-next's routing (512 experts, top-10) compiled, up to :data:`SORT_MAX`; one
    expert taking every assignment (its cursor incremented by all at once)."""
    g = torch.Generator().manual_seed(tokens)
    ids = torch.stack([torch.randperm(512, generator=g)[:10] for _ in range(tokens)]).to(DEV)
    for block_m in (16, 128):
        _check_sort(ids, 512, block_m)
    _check_sort(torch.full((tokens, 10), 7, device=DEV), 512, 16)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8, 32, 4099])
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float16, 2e-2), (torch.float32, 1e-5)])
def test_triton_bench_shapes_gpu(tokens, dtype, tol):
    """Against the fp32 loop on the same (rounded) inputs."""
    x, ids, w, gu, d = _bench_case(tokens, dtype)
    ref = fused_experts_ref(x.float(), ids, w.float(), gu.float(), d.float())
    out = fused_experts_triton(x, ids, w, gu, d)
    assert out.dtype == dtype and out.shape == x.shape
    assert _rel_err(out, ref) <= tol


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8, 32, 4099])
def test_triton_matches_grouped_gemm_bf16_gpu(tokens, monkeypatch):
    x, ids, w, gu, d = _bench_case(tokens, torch.bfloat16)
    out = fused_experts_triton(x, ids, w, gu, d)
    monkeypatch.setenv("TIDAL_KERNELS", "torch")  # the dispatcher's grouped-GEMM path
    grouped = fused_experts(x, ids, w, gu, d)
    assert _rel_err(out, grouped.float()) <= 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 4099])
def test_dispatcher_fp32_gpu(tokens):
    """fp32 on CUDA takes the Triton kernel (the grouped GEMM cannot), at every token count."""
    x, ids, w, gu, d = _bench_case(tokens, torch.float32)
    assert _rel_err(fused_experts(x, ids, w, gu, d), fused_experts_ref(x, ids, w, gu, d)) <= 1e-5


@pytest.mark.parametrize("rows", [1, 17, 40])
def test_silu_mul_and_combine_match_torch(rows):
    """The two passes of the grouped path (SiLU-gate, weighted combine) against plain torch."""
    g = torch.Generator().manual_seed(rows)
    h = torch.randn(rows, 2 * 48, generator=g).to(DEV)
    ref = torch.nn.functional.silu(h[:, :48]) * h[:, 48:]
    assert torch.allclose(moe_triton.silu_mul(h), ref, atol=1e-5, rtol=1e-5)
    tokens, top_k = rows, 3
    sorted_rows = torch.randn(tokens * top_k, 72, generator=g).to(DEV)
    inverse = torch.randperm(tokens * top_k, generator=g).to(DEV)
    weights = torch.rand(tokens, top_k, generator=g).to(DEV)
    expect = (sorted_rows[inverse].view(tokens, top_k, -1) * weights[..., None]).sum(1)
    assert torch.allclose(moe_triton.combine(sorted_rows, inverse, weights), expect, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 17])
def test_combine_adds_the_shared_expert_with_the_bits_of_the_torch_ops(rows):
    """bf16: ``combine(..., shared)`` equals ``combine(...) + gate * shared_out`` done by torch, bit for
    bit (each op rounded to bf16 as torch rounds it), including values near rounding ties."""
    g = torch.Generator().manual_seed(rows)
    tokens, top_k, hidden = rows, 4, 1100  # two column blocks, the second one partial
    sorted_rows = torch.randn(tokens * top_k, hidden, generator=g).to(DEV, torch.bfloat16)
    inverse = torch.randperm(tokens * top_k, generator=g).to(DEV)
    weights = torch.rand(tokens, top_k, generator=g).to(DEV)
    shared_out = (4 * torch.randn(tokens, hidden, generator=g)).to(DEV, torch.bfloat16)
    gate = torch.sigmoid(3 * torch.randn(tokens, 1, generator=g)).to(DEV, torch.bfloat16)
    routed = moe_triton.combine(sorted_rows, inverse, weights)
    got = moe_triton.combine(sorted_rows, inverse, weights, (shared_out, gate))
    expect = routed + gate * shared_out
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, expect)
    # A plain fp32 sum rounded once differs from the op-by-op roundings somewhere: the check can fail.
    once = (routed.float() + gate.float() * shared_out.float()).to(torch.bfloat16)
    assert not torch.equal(once, expect)



def test_bf16_rounding_by_bits():
    """The combine's bf16 rounding: ties to even as torch rounds, infinities kept, and NaN kept NaN, also
    the all-ones-mantissa NaN a GPU makes of inf - inf (0x7FFFFFFF), which the bit trick alone wraps to -0."""
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(out_ptr + i, moe_triton._round_bf16(tl.load(x_ptr + i, mask=i < n)), mask=i < n)

    g = torch.Generator().manual_seed(0)
    finite = torch.randn(200, generator=g) * 100
    ties = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8)])  # exactly halfway between bf16 values
    special = torch.tensor([0x7FFFFFFF, -1, 0x7FC00000, 0x7F800000, 0xFF800000 - (1 << 32)],
                           dtype=torch.int32).view(torch.float32)  # NaN, NaN, NaN, inf, -inf
    x = torch.cat([finite, ties, special]).to(DEV)
    out = torch.empty_like(x)
    kernel[(1,)](x, out, x.numel(), BLOCK=256)
    n = finite.numel() + ties.numel()
    assert torch.equal(out[:n], x[:n].to(torch.bfloat16).float())
    assert torch.isnan(out[n:n + 3]).all()
    assert torch.equal(out[n + 3:], x[n + 3:])


def _sorted_gate_up_ref(x, ids, gate_up):
    """The grouped path's first half in plain torch: gather in expert order, each expert's GEMM, SiLU gate."""
    top_k, inter = ids.shape[1], gate_up.shape[1] // 2
    sorted_ids, order = torch.sort(ids.flatten(), stable=True)
    rows = x[order // top_k].float()
    h = torch.stack([rows[i] @ gate_up[e].float().T for i, e in enumerate(sorted_ids.tolist())]) if len(order) \
        else rows.new_zeros(0, 2 * inter)
    return torch.nn.functional.silu(h[:, :inter]) * h[:, inter:], order, sorted_ids


def _ends(sorted_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    experts = torch.arange(num_experts, device=sorted_ids.device, dtype=sorted_ids.dtype)
    return torch.searchsorted(sorted_ids, experts, right=True, out_int32=True)


@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("tokens,top_k", [(1, 2), (5, 3), (37, 3), (70, 2)])
@pytest.mark.parametrize("hidden,config", [
    (HIDDEN, (4, moe_triton.GemmConfig(16, 16, 4, 2))),  # K a multiple of the K tile; several row tiles
    (48, (16, moe_triton.GemmConfig(32, 32, 4, 2))),  # a masked last K tile
])
def test_sorted_gate_up_matches_torch(tokens, top_k, hidden, config, tma):
    """Odd per-expert row counts (a hot expert in every token, two with none), tiles cut at each expert;
    weight tiles by pointer and by tensor descriptor."""
    x, ids, _, gate_up, _ = _small_case(tokens, top_k, DEV)
    x, gate_up = x[:, :hidden].contiguous(), gate_up[:, :, :hidden].contiguous()
    ref, order, sorted_ids = _sorted_gate_up_ref(x, ids, gate_up)
    out = moe_triton.sorted_gate_up(x, order, _ends(sorted_ids, EXPERTS), gate_up, top_k, config, tma)
    assert out.shape == (tokens * top_k, INTER)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tma", [False, True])
def test_sorted_gate_up_odd_expert_count_and_intermediate(tma):
    """7 experts (not a power of two, the last one empty) and intermediate 24, which the 16-column tiles do
    not divide: the last column tile reads past each half (the next expert's rows, by descriptor) and
    stores only its 8 real columns."""
    x, ids, _, gate_up, _ = _small_case(37, 3, DEV)
    inter = 24
    gate_up = torch.cat([gate_up[:7, :inter], gate_up[:7, INTER:INTER + inter]], dim=1).contiguous()
    ref, order, sorted_ids = _sorted_gate_up_ref(x, ids, gate_up)
    out = moe_triton.sorted_gate_up(x, order, _ends(sorted_ids, 7), gate_up, 3,
                                    (16, moe_triton.GemmConfig(16, 16, 4, 2)), tma)
    assert out.shape == (37 * 3, inter)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_sorted_gate_up_no_rows():
    x, ids, _, gate_up, _ = _small_case(1, 2, DEV)
    order = torch.zeros(0, dtype=torch.int64, device=DEV)
    out = moe_triton.sorted_gate_up(x[:0], order, torch.zeros(EXPERTS, dtype=torch.int32, device=DEV), gate_up, 2)
    assert out.shape == (0, INTER)


@pytest.mark.gpu
@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("tokens", [1, 8, 4099])
def test_sorted_gate_up_bench_shapes_gpu(tokens, tma):
    """bf16 at the bench shapes against the fp32 torch form on the same inputs."""
    x, ids, _, gu, _ = _bench_case(tokens, torch.bfloat16)
    sorted_ids, order = torch.sort(ids.flatten(), stable=True)
    ends = _ends(sorted_ids, gu.shape[0])
    out = moe_triton.sorted_gate_up(x, order, ends, gu, ids.shape[1], tma=tma)
    h = torch.cat([x[order[s:e] // 10].float() @ gu[i].float().T
                   for i, (s, e) in enumerate(zip([0, *ends[:-1].tolist()], ends.tolist(), strict=True))])
    ref = torch.nn.functional.silu(h[:, :512]) * h[:, 512:]
    assert _rel_err(out, ref) <= 1e-2


@pytest.mark.gpu
def test_sorted_gate_up_row_alone_has_the_bits_it_has_in_a_batch_gpu():
    """A prompt computes alike whatever rows share its forward: the first 5 tokens' rows alone and among
    4,099 tokens give the same bits."""
    x, ids, _, gu, _ = _bench_case(4099, torch.bfloat16)

    def run(n):
        sorted_ids, order = torch.sort(ids[:n].flatten(), stable=True)
        out = moe_triton.sorted_gate_up(x[:n], order, _ends(sorted_ids, gu.shape[0]), gu, 10)
        by_assignment = torch.empty_like(out)
        by_assignment[order] = out
        return by_assignment[:50]

    assert torch.equal(run(5), run(4099))
