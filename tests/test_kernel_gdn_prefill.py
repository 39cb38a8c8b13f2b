"""Varlen GDN prefill (flash-linear-attention on the GPU) against the per-sequence torch reference."""

from __future__ import annotations

import pytest
import torch

from tidal.kernels.common import l2_norm
from tidal.kernels.gdn import recurrent_gated_delta_rule
from tidal.kernels.gdn_varlen import gdn_prefill, gdn_prefill_ref


def _inputs(lengths, hk, hv, dk, dv, device, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q = torch.randn(total, hk, dk, generator=g).to(device, dtype)
    k = torch.randn(total, hk, dk, generator=g).to(device, dtype)
    v = torch.randn(total, hv, dv, generator=g).to(device, dtype)
    gate = (-torch.rand(total, hv, generator=g) * 0.5).to(device)
    beta = torch.rand(total, hv, generator=g).to(device, dtype)
    h0 = (torch.randn(len(lengths), hv, dk, dv, generator=g) * 0.1).to(device)
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return q, k, v, gate, beta, h0, cu


def test_reference_equals_token_by_token_recurrence():
    lengths = [5, 70, 1, 130]
    q, k, v, g, beta, h0, cu = _inputs(lengths, 2, 4, 8, 16, "cpu", torch.float32)
    out, final = gdn_prefill_ref(q, k, v, g, beta, h0, cu)
    qn = l2_norm(q).repeat_interleave(2, dim=1)
    kn = l2_norm(k).repeat_interleave(2, dim=1)
    for i, (lo, hi) in enumerate(zip(cu[:-1], cu[1:], strict=True)):
        state = h0[i:i + 1]
        for t in range(lo, hi):
            o, state = recurrent_gated_delta_rule(qn[t:t + 1], kn[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1],
                                                  state)
            assert torch.allclose(out[t], o[0], atol=1e-4)
        assert torch.allclose(final[i], state[0], atol=1e-4)


def test_reference_takes_normalized_qk():
    """``qk_normalized=True`` on q, k l2-normalised beforehand equals the default on the raw q, k."""
    q, k, v, g, beta, h0, cu = _inputs([5, 70, 1, 130], 2, 4, 8, 16, "cpu", torch.float32)
    out, final = gdn_prefill_ref(q, k, v, g, beta, h0, cu)
    out_n, final_n = gdn_prefill_ref(l2_norm(q), l2_norm(k), v, g, beta, h0, cu, qk_normalized=True)
    assert torch.equal(out_n, out) and torch.equal(final_n, final)
    cu_t = torch.tensor(cu)
    out_d, final_d = gdn_prefill(l2_norm(q), l2_norm(k), v, g, beta, h0, cu_t, cu, qk_normalized=True)
    assert torch.equal(out_d, out) and torch.equal(final_d, final)


@pytest.mark.gpu
@pytest.mark.parametrize("qk_normalized", [False, True])
def test_flash_linear_attention_matches_reference_bf16(qk_normalized):
    """bf16 at the model's head shapes, 5 sequences of odd lengths with initial states: relative
    error of outputs and final states <= 2e-2 against the fp32 reference on the same inputs (q and k
    raw, or l2-normalised and rounded to bf16 beforehand)."""
    pytest.importorskip("fla")
    lengths = [1, 63, 64, 1000, 4097]
    q, k, v, g, beta, h0, cu = _inputs(lengths, 16, 32, 128, 128, "cuda", torch.bfloat16)
    if qk_normalized:
        q, k = l2_norm(q.float()).bfloat16(), l2_norm(k.float()).bfloat16()
    cu_t = torch.tensor(cu, dtype=torch.int32, device="cuda")
    out, final = gdn_prefill(q, k, v, g, beta, h0, cu_t, cu, qk_normalized=qk_normalized)
    ref_out, ref_final = gdn_prefill_ref(q.float(), k.float(), v.float(), g, beta.float(), h0, cu,
                                         qk_normalized=qk_normalized)
    assert ((out.float() - ref_out).norm() / ref_out.norm()).item() <= 2e-2
    assert ((final - ref_final).norm() / ref_final.norm()).item() <= 2e-2
