"""The router kernel and the small-batch MoE GEMV kernels against plain torch.

Without a GPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, fp32, small shapes);
the ``gpu``-marked tests run them compiled at the bench shapes (512 experts, top-10, hidden 2048,
intermediate 512, shared expert 512) in bf16, and through the model's MoE layer.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    # Must precede the first import of triton; on a GPU machine the kernels run compiled instead.
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton")

from tidal.kernels.moe import fused_experts_ref, route_ref  # noqa: E402
from tidal.kernels.moe_decode_triton import GemvConfig, moe_gemv, route_triton  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def moe_ref(x, ids, weights, gate_up, down, shared=None):
    """Routed experts one at a time, plus ``sigmoid(x . g) * down_s(silu(gate_s x) * up_s x)``."""
    out = fused_experts_ref(x, ids, weights, gate_up, down)
    if shared is None:
        return out
    s_gate_up, s_down, s_gate = shared
    gate, up = F.linear(x, s_gate_up).chunk(2, dim=-1)
    return out + torch.sigmoid(F.linear(x, s_gate.reshape(1, -1))) * F.linear(F.silu(gate) * up, s_down)


def _case(tokens, experts, top_k, hidden, inter, s_inter, device, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden ** 0.5
    down = torch.randn(experts, hidden, inter, generator=g) / inter ** 0.5
    logits = torch.randn(tokens, experts, generator=g)
    shared = (torch.randn(2 * s_inter, hidden, generator=g) / hidden ** 0.5,
              torch.randn(hidden, s_inter, generator=g) / s_inter ** 0.5,
              torch.randn(1, hidden, generator=g) / hidden ** 0.5)
    weights, ids = route_ref(logits, top_k, True)
    to = lambda t: t.to(device, dtype)  # noqa: E731
    return to(x), ids.to(device), to(weights), to(gate_up), to(down), tuple(to(t) for t in shared), to(logits)


@pytest.mark.parametrize("experts,top_k,renorm", [(8, 1, False), (8, 3, True), (60, 5, True), (60, 4, False)])
def test_route_kernel_equals_softmax_topk(experts, top_k, renorm):
    logits = torch.randn(7, experts, generator=torch.Generator().manual_seed(experts + top_k)).to(DEV)
    weights, ids = route_triton(logits, top_k, renorm)
    ref_w, ref_ids = route_ref(logits, top_k, renorm)
    assert ids.dtype == torch.int64 and weights.dtype == logits.dtype
    assert torch.equal(ids, ref_ids)  # fp32 random logits: no ties
    torch.testing.assert_close(weights, ref_w, rtol=1e-5, atol=1e-6)


def test_route_kernel_rejects_top_k_beyond_the_experts():
    with pytest.raises(ValueError, match="top_k"):
        route_triton(torch.zeros(2, 4, device=DEV), 6, True)


def test_route_kernel_breaks_ties_toward_the_lower_expert():
    logits = torch.zeros(2, 8)
    logits[0, [2, 5, 6]] = 1.0
    logits[1, [7, 1]] = 3.0
    weights, ids = route_triton(logits.to(DEV), 2, False)
    assert ids.tolist() == [[2, 5], [1, 7]]
    assert torch.equal(weights[0, 0], weights[0, 1])


@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize("with_shared", [True, False])
def test_moe_gemv_equals_the_loop(tokens, with_shared):
    # A hidden size that no tile divides, and a shared intermediate size unlike the routed one.
    x, ids, w, gu, d, shared, _ = _case(tokens, 8, 3, 72, 32, 24 if with_shared else 32, DEV, torch.float32)
    shared = shared if with_shared else None
    ref = moe_ref(x, ids, w, gu, d, shared)
    for cfg in (None, (GemvConfig(16, 32, 4), GemvConfig(8, 16, 4)),
                (GemvConfig(8, 64, 2), GemvConfig(16, 16, 2))):
        out = moe_gemv(x, ids, w, gu, d, shared, configs=cfg)
        # fp32: only summation order differs.
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_moe_gemv_hidden_wider_than_a_combine_program():
    """Several combine programs per token, the last one partly masked."""
    from tidal.kernels.moe_decode_triton import COMBINE_BLOCK

    hidden = COMBINE_BLOCK + 88
    x, ids, w, gu, d, shared, _ = _case(2, 6, 2, hidden, 16, 16, DEV, torch.float32, seed=5)
    torch.testing.assert_close(moe_gemv(x, ids, w, gu, d, shared), moe_ref(x, ids, w, gu, d, shared),
                               rtol=1e-5, atol=1e-5)


def test_moe_gemv_shared_expert_wider_than_the_routed_ones():
    x, ids, w, gu, d, shared, _ = _case(2, 8, 2, 64, 16, 40, DEV, torch.float32, seed=3)
    torch.testing.assert_close(moe_gemv(x, ids, w, gu, d, shared), moe_ref(x, ids, w, gu, d, shared),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 2, 8, 32])
def test_moe_gemv_bf16_bench_shapes_gpu(tokens):
    """bf16 at the bench shapes against the fp32 loop on the same bf16 inputs: within 1% of the output
    norm (the kernel sums in fp32 and rounds once)."""
    x, ids, w, gu, d, shared, _ = _case(tokens, 512, 10, 2048, 512, 512, "cuda", torch.bfloat16)
    ref = moe_ref(x.float(), ids, w.float(), gu.float(), d.float(), tuple(t.float() for t in shared))
    out = moe_gemv(x, ids, w, gu, d, shared).float()
    assert ((out - ref).norm() / ref.norm()).item() <= 1e-2


@pytest.mark.gpu
def test_route_kernel_bf16_ties_gpu():
    """bf16 logits over 512 experts tie often; the kernel's top-k values equal torch's, and its ids
    equal torch's wherever the k-th value is not tied."""
    logits = torch.randn(4096, 512, generator=torch.Generator().manual_seed(1)).to("cuda", torch.bfloat16)
    weights, ids = route_triton(logits, 10, True)
    ref_w, ref_ids = route_ref(logits, 10, True)
    probs = torch.softmax(logits, -1, dtype=torch.float)
    vals = probs.gather(1, ids)
    ref_vals = probs.gather(1, ref_ids)
    assert torch.equal(vals, ref_vals)
    tied = (probs[:, None, :] == ref_vals[:, :, None]).sum(-1) > 1
    assert torch.equal(ids[~tied], ref_ids[~tied])
    torch.testing.assert_close(weights, ref_w, rtol=8e-3, atol=0)  # one bf16 rounding apart at most
    assert bool((ids.sort(-1).values.diff(dim=-1) > 0).all())  # distinct experts
