"""Varlen causal conv1d over state slots and the fused GDN decode step: references and Triton kernels.

The torch references are proven against the per-sequence oracles (``causal_conv1d``, ``conv_history``,
``recurrent_gated_delta_rule``); the Triton kernels are compared with the references. Without a GPU
the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, fp32 only, small shapes); with one,
the same small-shape tests run compiled on it, and the ``gpu``-marked tests add model shapes in bf16
and fp32.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Must precede the first import of triton; on a GPU machine the kernels run compiled instead.
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton")

from tidal.kernels import conv as conv_ops  # noqa: E402
from tidal.kernels import conv_triton, gdn_decode_triton  # noqa: E402
from tidal.kernels.common import l2_norm, l2_norm_groups, row_segments  # noqa: E402
from tidal.kernels.conv import causal_conv1d, conv_history  # noqa: E402
from tidal.kernels.gdn import gdn_decode_ref, recurrent_gated_delta_rule  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
LENGTHS = [1, 2, 5, 37, 1]
FRESH = [False, True, False, False, True]
SLOTS = [6, 1, 3, 0, 4]  # pool of 8 slots; 2, 5 and 7 are nobody's
CONV_SHAPES = [(4, 1), (4, 3), (3, 1), (2, 1)]  # (kernel size, dilation)


def _segments(lengths, slots, fresh, device):
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return cu, torch.tensor(slots, device=device), torch.tensor(fresh, device=device)


def _conv_case(kernel_size, dilation, channels, dtype, device, lengths=LENGTHS, slots=SLOTS, fresh=FRESH,
               num_slots=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    width = (kernel_size - 1) * dilation
    total = sum(lengths)
    x = torch.randn(total, channels, generator=gen).to(device, dtype)
    states = torch.randn(num_slots, width, channels, generator=gen).to(device, dtype)
    weight = (torch.randn(channels, kernel_size, generator=gen) * 0.5).to(device, dtype)
    return (x, states, weight, *_segments(lengths, slots, fresh, device))


def _per_segment(x, states, weight, cu, slots, fresh, dilation, silu):
    """The oracle: the single-sequence conv, one segment at a time."""
    outs = []
    for i in range(slots.shape[0]):
        lo, hi = int(cu[i]), int(cu[i + 1])
        if hi == lo:  # F.conv1d rejects an input shorter than the kernel
            continue
        history = torch.zeros_like(states[0]) if bool(fresh[i]) else states[int(slots[i])]
        outs.append(causal_conv1d(x[lo:hi], history, weight, dilation, silu))
    return torch.cat(outs)


def _assert_matches_oracle(out, expect, silu):
    """The conv is bit-identical; CPU silu may round 1 ulp differently between its vectorised and
    scalar paths (which one runs depends on the tensor's length), so silu outputs get float32 eps."""
    if silu:
        torch.testing.assert_close(out, expect, atol=1e-7, rtol=2e-7)
    else:
        assert torch.equal(out, expect)


@pytest.mark.parametrize("kernel_size,dilation", CONV_SHAPES)
@pytest.mark.parametrize("silu", [True, False])
def test_varlen_reference_matches_per_segment_conv(kernel_size, dilation, silu):
    x, states, weight, cu, slots, fresh = _conv_case(kernel_size, dilation, 24, torch.float32, "cpu")
    before = states.clone()
    ref = conv_ops.causal_conv1d_varlen_ref(x, states, weight, cu, slots, fresh, dilation, silu)
    _assert_matches_oracle(ref, _per_segment(x, states, weight, cu, slots, fresh, dilation, silu), silu)
    assert torch.equal(states, before)  # pure
    # A precomputed row_segment and the dispatcher (CPU: the reference) give the same.
    seg = row_segments(cu, x.shape[0])
    assert torch.equal(seg.long(), torch.repeat_interleave(torch.arange(len(LENGTHS)), torch.tensor(LENGTHS)))
    assert torch.equal(conv_ops.causal_conv1d_varlen(x, states, weight, cu, slots, fresh, dilation, silu,
                                                     max_seqlen=37, row_segment=seg), ref)


def test_varlen_reference_with_empty_segment():
    x, states, weight, cu, slots, fresh = _conv_case(4, 3, 8, torch.float32, "cpu", lengths=[3, 0, 4],
                                                     slots=[2, 5, 0], fresh=[False, False, True])
    ref = conv_ops.causal_conv1d_varlen_ref(x, states, weight, cu, slots, fresh, 3)
    _assert_matches_oracle(ref, _per_segment(x, states, weight, cu, slots, fresh, 3, True), True)


@pytest.mark.parametrize("kernel_size,dilation", CONV_SHAPES)
def test_conv_windows_match_conv_history(kernel_size, dilation):
    x, states, weight, cu, slots, fresh = _conv_case(kernel_size, dilation, 24, torch.float32, "cpu")
    seg_index, upto = [], []
    for i, length in enumerate(LENGTHS):
        for off in sorted({0, 1, length // 2, length - 1, length} & set(range(length + 1))):
            seg_index.append(i)
            upto.append(off)
    windows = conv_ops.conv_windows(x, states, cu, slots, fresh, torch.tensor(seg_index), torch.tensor(upto))
    for m, (i, off) in enumerate(zip(seg_index, upto, strict=True)):
        lo, hi = int(cu[i]), int(cu[i + 1])
        history = torch.zeros_like(states[0]) if FRESH[i] else states[SLOTS[i]]
        assert torch.equal(windows[m], conv_history(x[lo:hi], history, off)), (i, off)


@pytest.mark.parametrize("kernel_size,dilation", CONV_SHAPES)
def test_update_reference_matches_one_row_segments(kernel_size, dilation):
    """A decode step equals a batch of one-row segments, and its windows equal ``conv_history``."""
    slots, fresh = [5, 0, 3, 6], [False, True, False, False]
    x, states, weight, cu, slots_t, fresh_t = _conv_case(kernel_size, dilation, 24, torch.float32, "cpu",
                                                         lengths=[1] * 4, slots=slots, fresh=fresh)
    expect_out = conv_ops.causal_conv1d_varlen_ref(x, states, weight, cu, slots_t, fresh_t, dilation)
    expect_win = conv_ops.conv_windows(x, states, cu, slots_t, fresh_t, torch.arange(4), torch.ones(4, dtype=int))
    pool = states.clone()
    out = conv_ops.causal_conv1d_update_ref(x, pool, weight, slots_t, fresh_t, dilation)
    _assert_matches_oracle(out, expect_out, silu=True)
    assert torch.equal(pool[slots_t], expect_win)
    others = [s for s in range(8) if s not in slots]
    assert torch.equal(pool[others], states[others])


@pytest.mark.parametrize("kernel_size,dilation", CONV_SHAPES)
def test_varlen_kernel_matches_reference(kernel_size, dilation):
    # 200 channels: two channel blocks, the second partial; 46 rows: a partial row block.
    x, states, weight, cu, slots, fresh = _conv_case(kernel_size, dilation, 200, torch.float32, DEV)
    before = states.clone()
    ref = conv_ops.causal_conv1d_varlen_ref(x, states, weight, cu, slots, fresh, dilation)
    out = conv_triton.causal_conv1d_varlen(x, states, weight, cu, slots, fresh, dilation)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(states, before)
    bare = conv_triton.causal_conv1d_varlen(x, states, weight, cu, slots, fresh, dilation, silu=False,
                                            row_segment=row_segments(cu, x.shape[0]).long())
    torch.testing.assert_close(bare, conv_ops.causal_conv1d_varlen_ref(x, states, weight, cu, slots, fresh,
                                                                      dilation, silu=False), atol=1e-5, rtol=1e-5)


def test_varlen_kernel_strided_input():
    """``x`` as a column slice of a wider projection (as GDN's qkv may arrive) and int32 slots."""
    x, states, weight, cu, slots, fresh = _conv_case(4, 3, 40, torch.float32, DEV)
    wide = torch.randn(x.shape[0], 64, device=DEV)
    wide[:, 8:48] = x
    view = wide[:, 8:48]
    ref = conv_ops.causal_conv1d_varlen_ref(x, states, weight, cu, slots, fresh, 3)
    out = conv_triton.causal_conv1d_varlen(view, states, weight, cu, slots.int(), fresh, 3)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def _l2_groups_oracle(out, group):
    """Plain-torch per-group normalisation of a conv output: divide by the fp32 norm, round back."""
    rows = out.float().reshape(out.shape[0], -1, group)
    norm = torch.sqrt((rows ** 2).sum(-1, keepdim=True) + 1e-6)
    return (rows / norm).reshape(out.shape).to(out.dtype)


@pytest.mark.parametrize("kernel_size,dilation", [(4, 1), (3, 2)])
@pytest.mark.parametrize("group", [1, 8, 12, 24])
def test_varlen_reference_l2_groups(kernel_size, dilation, group):
    """The conv of every segment (oracle: ``causal_conv1d``), then each group of channels of a row
    normalised; the dispatcher (CPU: the reference) gives the same."""
    x, states, weight, cu, slots, fresh = _conv_case(kernel_size, dilation, 24, torch.float32, "cpu")
    ref = conv_ops.causal_conv1d_varlen_ref(x, states, weight, cu, slots, fresh, dilation, l2_group=group)
    expect = _l2_groups_oracle(_per_segment(x, states, weight, cu, slots, fresh, dilation, True), group)
    torch.testing.assert_close(ref, expect, atol=1e-6, rtol=1e-6)
    assert torch.equal(ref, l2_norm_groups(
        conv_ops.causal_conv1d_varlen_ref(x, states, weight, cu, slots, fresh, dilation), group))
    assert torch.equal(conv_ops.causal_conv1d_varlen(x, states, weight, cu, slots, fresh, dilation, l2_group=group),
                       ref)


# (channels, l2_group): several groups per 128-channel tile, the last tile partial; one group per
# tile; a group wider than the configured tile (the tile widens, BLOCK_T shrinks); groups that are
# not powers of two (conv kernel, then the torch normalisation).
L2_CASES = [(200, 8), (256, 128), (512, 256), (48, 12), (40, 40)]


@pytest.mark.parametrize("channels,group", L2_CASES)
@pytest.mark.parametrize("silu", [True, False])
def test_varlen_kernel_l2_groups(channels, group, silu):
    """Kernel, reference and the plain-torch oracle agree; ``x`` is a column slice of a wider tensor."""
    x, states, weight, cu, slots, fresh = _conv_case(4, 1, channels, torch.float32, DEV)
    wide = torch.randn(x.shape[0], channels + 16, device=DEV)
    wide[:, 8:8 + channels] = x
    view = wide[:, 8:8 + channels]
    ref = conv_ops.causal_conv1d_varlen_ref(x, states, weight, cu, slots, fresh, silu=silu, l2_group=group)
    out = conv_triton.causal_conv1d_varlen(view, states, weight, cu, slots, fresh, silu=silu, l2_group=group)
    expect = _l2_groups_oracle(conv_ops.causal_conv1d_varlen_ref(x, states, weight, cu, slots, fresh, silu=silu),
                               group)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, expect, atol=1e-5, rtol=1e-5)
    norms = out.reshape(out.shape[0], -1, group).norm(dim=-1)
    torch.testing.assert_close(norms, torch.ones_like(norms), atol=1e-4, rtol=0)


def test_varlen_l2_group_must_divide_channels():
    x, states, weight, cu, slots, fresh = _conv_case(4, 1, 24, torch.float32, DEV)
    for group in (5, 48, -8):
        with pytest.raises(ValueError, match="l2_group"):
            conv_ops.causal_conv1d_varlen_ref(x, states, weight, cu, slots, fresh, l2_group=group)
        with pytest.raises(ValueError, match="l2_group"):
            conv_triton.causal_conv1d_varlen(x, states, weight, cu, slots, fresh, l2_group=group)
        with pytest.raises(ValueError, match="l2_group"):
            conv_ops.causal_conv1d_varlen(x, states, weight, cu, slots, fresh, l2_group=group)


@pytest.mark.parametrize("kernel_size,dilation", CONV_SHAPES)
def test_update_kernel_matches_reference(kernel_size, dilation):
    slots, fresh = [5, 0, 3, 6], [False, True, False, False]
    x, states, weight, _, slots_t, fresh_t = _conv_case(kernel_size, dilation, 200, torch.float32, DEV,
                                                        lengths=[1] * 4, slots=slots, fresh=fresh)
    pool_ref, pool_ker = states.clone(), states.clone()
    ref = conv_ops.causal_conv1d_update_ref(x, pool_ref, weight, slots_t, fresh_t, dilation)
    out = conv_triton.causal_conv1d_update(x, pool_ker, weight, slots_t, fresh_t, dilation)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(pool_ker, pool_ref)  # shifted windows identical, other slots untouched
    others = [s for s in range(8) if s not in slots]
    assert torch.equal(pool_ker[others], states[others])


# --------------------------------------------------------------------------------------------------
# GDN decode
# --------------------------------------------------------------------------------------------------


def _gdn_inputs(batch, k_heads, v_heads, dk, dv, dtype, device, gen):
    q = torch.randn(batch, k_heads, dk, generator=gen).to(device, dtype) * 3  # raw: not unit norm
    k = torch.randn(batch, k_heads, dk, generator=gen).to(device, dtype)
    v = torch.randn(batch, v_heads, dv, generator=gen).to(device, dtype)
    g = -torch.rand(batch, v_heads, generator=gen).to(device) * 0.5  # fp32 log decay
    beta = torch.rand(batch, v_heads, generator=gen).to(device, dtype)
    return q, k, v, g, beta


def test_gdn_decode_reference_matches_recurrent_rule():
    gen = torch.Generator().manual_seed(1)
    batch, k_heads, v_heads, dk, dv = 3, 2, 4, 12, 40
    q, k, v, g, beta = _gdn_inputs(batch, k_heads, v_heads, dk, dv, torch.float32, "cpu", gen)
    pool = torch.randn(6, v_heads, dk, dv, generator=gen)
    slots, fresh = torch.tensor([4, 0, 2]), torch.tensor([False, True, False])
    before = pool.clone()
    out = gdn_decode_ref(q, k, v, g, beta, pool, slots, fresh)
    qe = l2_norm(q.float()).repeat_interleave(2, dim=1)  # value head h reads key head h // 2
    ke = l2_norm(k.float()).repeat_interleave(2, dim=1)
    state = before[slots].clone()
    state[1] = 0
    expect_out, expect_state = recurrent_gated_delta_rule(qe, ke, v, g, beta, state)
    assert torch.equal(out, expect_out)
    assert torch.equal(pool[slots], expect_state)
    assert torch.equal(pool[[1, 3, 5]], before[[1, 3, 5]])


@pytest.mark.parametrize("k_heads,v_heads", [(2, 4), (3, 3)])
def test_gdn_decode_kernel_matches_reference(k_heads, v_heads):
    """Several steps in a row; the first starts some requests fresh; dk and dv off powers of two."""
    gen = torch.Generator().manual_seed(2)
    batch, dk, dv = 3, 12, 40
    pool = torch.randn(6, v_heads, dk, dv, generator=gen).to(DEV)
    pool_ref, pool_ker = pool.clone(), pool.clone()
    slots = torch.tensor([4, 0, 2], device=DEV)
    for step in range(3):
        fresh = torch.tensor([False, step == 0, step == 0], device=DEV)
        q, k, v, g, beta = _gdn_inputs(batch, k_heads, v_heads, dk, dv, torch.float32, DEV, gen)
        ref = gdn_decode_ref(q, k, v, g, beta, pool_ref, slots, fresh)
        out = gdn_decode_triton.gdn_decode(q, k, v, g, beta, pool_ker, slots, fresh)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(pool_ker, pool_ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(pool_ker[[1, 3, 5]], pool[[1, 3, 5]])


# --------------------------------------------------------------------------------------------------
# Model shapes on the GPU
# --------------------------------------------------------------------------------------------------

GPU_LENGTHS = [1, 2048, 7, 2000, 43]  # T = 4099
GPU_TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel_size,dilation", [(4, 1), (4, 3)])  # GDN qkv conv; PLE conv (hc 4 x 2048)
def test_gpu_conv_model_shapes(dtype, kernel_size, dilation):
    """fp32: within 1e-5 (summation order only); bf16: within one bf16 rounding of the fp32 result."""
    x, states, weight, cu, slots, fresh = _conv_case(
        kernel_size, dilation, 8192, dtype, "cuda", lengths=GPU_LENGTHS, slots=[40, 3, 17, 0, 63],
        fresh=[False, True, False, False, True], num_slots=64)
    ref = conv_ops.causal_conv1d_varlen_ref(x, states, weight, cu, slots, fresh, dilation)  # elementwise: no TF32
    out = conv_ops.causal_conv1d_varlen(x, states, weight, cu, slots, fresh, dilation, max_seqlen=2048)
    torch.testing.assert_close(out, ref, **GPU_TOL[dtype])

    seg_index = torch.tensor([0, 1, 1, 3, 4], device="cuda")
    upto = torch.tensor([1, 1, 2048, 5, 43], device="cuda")
    windows = conv_ops.conv_windows(x, states, cu, slots, fresh, seg_index, upto)
    for m in range(5):
        i, off = int(seg_index[m]), int(upto[m])
        history = torch.zeros_like(states[0]) if bool(fresh[i]) else states[int(slots[i])]
        assert torch.equal(windows[m], conv_history(x[int(cu[i]):int(cu[i + 1])], history, off))

    batch = 33
    rows = torch.randn(batch, 8192, device="cuda").to(dtype)
    dec_slots = torch.randperm(64, device="cuda")[:batch]
    dec_fresh = torch.rand(batch, device="cuda") < 0.2
    pool_ref, pool_ker = states.clone(), states.clone()
    ref = conv_ops.causal_conv1d_update_ref(rows, pool_ref, weight, dec_slots, dec_fresh, dilation)
    out = conv_ops.causal_conv1d_update(rows, pool_ker, weight, dec_slots, dec_fresh, dilation)
    torch.testing.assert_close(out, ref, **GPU_TOL[dtype])
    assert torch.equal(pool_ker, pool_ref)


@pytest.mark.gpu
def test_gpu_conv_l2_groups_bench_shape():
    """GDN's q (or k) conv at the bench shape (16 heads of 128), bf16: the fused normalisation against
    the reference within one bf16 rounding, and every head of unit norm."""
    x, states, weight, cu, slots, fresh = _conv_case(
        4, 1, 2048, torch.bfloat16, "cuda", lengths=GPU_LENGTHS, slots=[40, 3, 17, 0, 63],
        fresh=[False, True, False, False, True], num_slots=64)
    ref = conv_ops.causal_conv1d_varlen_ref(x, states, weight, cu, slots, fresh, l2_group=128)
    out = conv_ops.causal_conv1d_varlen(x, states, weight, cu, slots, fresh, max_seqlen=2048, l2_group=128)
    torch.testing.assert_close(out, ref, **GPU_TOL[torch.bfloat16])
    plain = conv_ops.causal_conv1d_varlen(x, states, weight, cu, slots, fresh)
    torch.testing.assert_close(out, _l2_groups_oracle(plain, 128), **GPU_TOL[torch.bfloat16])
    norms = out.float().reshape(out.shape[0], 16, 128).norm(dim=-1)
    torch.testing.assert_close(norms, torch.ones_like(norms), atol=1e-2, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_gdn_decode_model_shapes(dtype):
    """Outputs within 1e-4 (fp32; reduction order over dk) or 2e-2 (bf16 output rounding); states
    (always fp32) within 1e-4 after four steps."""
    gen = torch.Generator().manual_seed(3)
    batch, k_heads, v_heads, dk, dv = 33, 16, 32, 128, 128
    pool = torch.randn(64, v_heads, dk, dv, generator=gen).cuda() * 0.1
    pool_ref, pool_ker = pool.clone(), pool.clone()
    slots = torch.randperm(64, generator=gen)[:batch].cuda()
    used = set(slots.tolist())
    untouched = [s for s in range(64) if s not in used]
    out_tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for step in range(4):
        fresh = (torch.rand(batch, generator=gen) < (0.2 if step == 0 else 0.0)).cuda()
        q, k, v, g, beta = _gdn_inputs(batch, k_heads, v_heads, dk, dv, dtype, "cuda", gen)
        ref = gdn_decode_ref(q, k, v, g, beta, pool_ref, slots, fresh)
        out = gdn_decode_triton.gdn_decode(q, k, v, g, beta, pool_ker, slots, fresh)
        torch.testing.assert_close(out, ref, **out_tol)
        torch.testing.assert_close(pool_ker, pool_ref, atol=1e-4, rtol=1e-4)
    assert torch.equal(pool_ker[untouched], pool[untouched])


@pytest.mark.parametrize("rows,heads", [(1, 32), (70, 6)])
def test_gdn_gates_kernel_equals_torch(rows, heads):
    from tidal.kernels.gdn import gdn_gates_ref
    from tidal.kernels.gdn_gates_triton import gdn_gates

    g = torch.Generator().manual_seed(rows)
    proj = torch.randn(rows, 2 * heads + 3, generator=g) * 8  # a and b as column slices of one output
    proj[0, 0] = 30.0  # past softplus' threshold
    proj[-1, 1] = -40.0  # where log(1 + exp(x)) would round to 0
    a, b = proj[:, :heads].to(DEV), proj[:, heads + 3:].to(DEV)
    a_log, dt_bias = torch.randn(heads, generator=g).to(DEV), torch.randn(heads, generator=g).to(DEV)
    decay, beta = gdn_gates(a, b, a_log, dt_bias)
    ref_decay, ref_beta = gdn_gates_ref(a, b, a_log, dt_bias)
    assert decay.dtype == torch.float32 and beta.dtype == b.dtype
    torch.testing.assert_close(decay, ref_decay, rtol=1e-5, atol=1e-30)
    torch.testing.assert_close(beta, ref_beta, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------------------------------
# GDN decode step (gates, recurrence and gated norm in one kernel)
# --------------------------------------------------------------------------------------------------


def _step_inputs(batch, k_heads, v_heads, dk, dv, dtype, gen):
    """The step's inputs as column slices of one wide row (as the stacked input projection's output), with
    a padding column between each: qkv, z, b, a, plus A_log, dt_bias and the norm weight."""
    widths = [2 * k_heads * dk + v_heads * dv, v_heads * dv, v_heads, v_heads]
    wide = torch.randn(batch, sum(widths) + len(widths), generator=gen) * 2
    wide[0, sum(widths[:3]) + 3] = 30.0  # an `a` past softplus' threshold
    wide = wide.to(DEV, dtype)
    parts, lo = [], 0
    for w in widths:
        parts.append(wide[:, lo:lo + w])
        lo += w + 1
    a_log = torch.randn(v_heads, generator=gen).to(DEV, dtype)
    dt_bias = torch.randn(v_heads, generator=gen).to(DEV, dtype)
    norm_w = (torch.rand(dv, generator=gen) + 0.5).to(DEV, dtype)
    return (*parts, a_log, dt_bias, norm_w)


def _step_reference(qkv, z, b, a, a_log, dt_bias, norm_w, eps, act, pool, slots, fresh, k_heads, dk):
    """The step from the three torch references, one after the other."""
    from tidal.kernels.gdn import gdn_gates_ref
    from tidal.kernels.norm import gated_rms_norm_ref

    batch, v_heads, dv = qkv.shape[0], a.shape[1], pool.shape[3]
    key_dim = k_heads * dk
    q, k, v = qkv[:, :key_dim], qkv[:, key_dim:2 * key_dim], qkv[:, 2 * key_dim:]
    g, beta = gdn_gates_ref(a, b, a_log, dt_bias)
    core = gdn_decode_ref(q.unflatten(-1, (k_heads, dk)), k.unflatten(-1, (k_heads, dk)),
                          v.unflatten(-1, (v_heads, dv)), g, beta, pool, slots, fresh)
    return gated_rms_norm_ref(core, z.unflatten(-1, (v_heads, dv)), norm_w, eps, act).reshape(batch, -1)


@pytest.mark.parametrize("k_heads,v_heads,act", [(2, 4, "silu"), (3, 3, "sigmoid")])
def test_gdn_decode_step_kernel_matches_references(k_heads, v_heads, act):
    """Three steps in a row from strided column slices; the first starts two requests fresh (one slot holding
    NaN); dk and dv off powers of two; the unused slots stay as they were."""
    gen = torch.Generator().manual_seed(5)
    batch, dk, dv = 3, 12, 40
    pool = torch.randn(6, v_heads, dk, dv, generator=gen).to(DEV)
    pool[0] = float("nan")  # a fresh row's slot: whatever it held never reaches the result
    pool_ref, pool_ker = pool.clone(), pool.clone()
    slots = torch.tensor([4, 0, 2], device=DEV)
    for step in range(3):
        fresh = torch.tensor([False, step == 0, step == 0], device=DEV)
        qkv, z, b, a, a_log, dt_bias, norm_w = _step_inputs(batch, k_heads, v_heads, dk, dv, torch.float32, gen)
        ref = _step_reference(qkv, z, b, a, a_log, dt_bias, norm_w, 1e-6, act, pool_ref, slots, fresh, k_heads, dk)
        out = gdn_decode_triton.gdn_decode_step(qkv, z, b, a, a_log, dt_bias, norm_w, 1e-6, act, pool_ker, slots,
                                                fresh)
        assert out.shape == (batch, v_heads * dv) and out.is_contiguous()
        # The norm scales the core output's fp32 rounding (1e-7) by 1 / rms, which a fresh row's small
        # output makes large (here up to 1e4).
        torch.testing.assert_close(out, ref, atol=3e-4, rtol=1e-5)
        torch.testing.assert_close(pool_ker, pool_ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(pool_ker[[1, 3, 5]], pool[[1, 3, 5]])


def test_gdn_decode_step_dispatch_is_the_parts_off_the_gpu():
    """Off the GPU the layer's step is gates, decode and norm one after the other: the same numbers as the
    references, bit for bit (this checks the dispatcher's split of ``qkv`` into heads)."""
    from tidal.kernels.gdn_varlen import gdn_decode_step

    gen = torch.Generator().manual_seed(6)
    qkv, z, b, a, a_log, dt_bias, norm_w = _step_inputs(2, 2, 4, 8, 16, torch.float32, gen)
    qkv, z, b, a, a_log, dt_bias, norm_w = (t.cpu() for t in (qkv, z, b, a, a_log, dt_bias, norm_w))
    pool = torch.randn(3, 4, 8, 16, generator=gen)
    pool_ref = pool.clone()
    slots, fresh = torch.tensor([2, 0]), torch.tensor([False, True])
    out = gdn_decode_step(qkv, z, b, a, a_log, dt_bias, norm_w, 1e-6, "silu", pool, slots, fresh)
    ref = _step_reference(qkv, z, b, a, a_log, dt_bias, norm_w, 1e-6, "silu", pool_ref, slots, fresh, 2, 8)
    assert torch.equal(out, ref) and torch.equal(pool, pool_ref)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_gdn_decode_step_bench_shapes(dtype):
    """The bench shapes (16 key heads, 32 value heads of 128) at 1 and 33 requests, four steps: outputs within
    1e-4 (fp32) or one bf16 rounding of the norm's input (2e-2), states within 1e-4."""
    gen = torch.Generator().manual_seed(7)
    k_heads, v_heads, dk, dv = 16, 32, 128, 128
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    for batch in (1, 33):
        pool = torch.randn(64, v_heads, dk, dv, generator=gen).cuda() * 0.1
        pool_ref, pool_ker = pool.clone(), pool.clone()
        slots = torch.randperm(64, generator=gen)[:batch].cuda()
        for step in range(4):
            fresh = (torch.rand(batch, generator=gen) < (0.2 if step == 0 else 0.0)).cuda()
            qkv, z, b, a, a_log, dt_bias, norm_w = _step_inputs(batch, k_heads, v_heads, dk, dv, dtype, gen)
            ref = _step_reference(qkv, z, b, a, a_log, dt_bias, norm_w, 1e-6, "silu", pool_ref, slots, fresh,
                                  k_heads, dk)
            out = gdn_decode_triton.gdn_decode_step(qkv, z, b, a, a_log, dt_bias, norm_w, 1e-6, "silu", pool_ker,
                                                    slots, fresh)
            torch.testing.assert_close(out.float(), ref.float(), **tol)
            torch.testing.assert_close(pool_ker, pool_ref, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
def test_the_model_takes_the_step_kernel_gpu(same_ids_as_torch_ops):
    """The tiny model's greedy ids with the step kernel, against gates, decode and norm one after the other."""
    same_ids_as_torch_ops("gdn_step")


def test_only_generated_token_decodes_take_the_step(tiny_checkpoint, monkeypatch):
    """A prompt row never takes the decode step (not even a one-token prompt, whose forward is a single
    decode-shaped row): it computes alike whatever shares its forward. Each decode forward calls it once a
    GDN layer."""
    from tidal import LLM
    from tidal.executor.layers import gdn as gdn_layer

    calls = []
    real = gdn_layer.gdn_decode_step
    monkeypatch.setattr(gdn_layer, "gdn_decode_step", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    llm = LLM(tiny_checkpoint, device="cpu", dtype="float32", max_prefill_length=64)
    layers = sum(layer.is_linear for layer in llm.runner.model.model.layers)
    llm.generate([[5, 6, 7, 8]], max_tokens=1, ignore_eos=True)
    llm.generate([[9]], max_tokens=1, ignore_eos=True)
    assert calls == []
    llm.generate([[5, 6, 7, 8]], max_tokens=3, ignore_eos=True)
    assert calls == [1] * (2 * layers)
