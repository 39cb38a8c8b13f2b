"""RMSNorm and hyper-connection kernels against their torch references, and the references against the
original formulas (written out here as the model computed them before the fused path existed).

Without CUDA the Triton kernels run in the interpreter (``TRITON_INTERPRET=1``, set before triton is
imported) on CPU tensors, in float32 only: the interpreter gets bf16 dots and casts wrong. With CUDA
the same small cases run compiled on the GPU, and the ``gpu`` tests add the real shapes in bf16.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

_INTERPRET = not torch.cuda.is_available()
if _INTERPRET:  # never on a GPU machine: it would turn every kernel of the session into the interpreter
    os.environ["TRITON_INTERPRET"] = "1"
DEV = "cpu" if _INTERPRET else "cuda"
EPS = 1e-6

from tidal.executor.layers import hyper_connection as hc_layer  # noqa: E402
from tidal.executor.layers.hyper_connection import GatedResidual  # noqa: E402
from tidal.kernels import hyper_connection as hc_ops  # noqa: E402
from tidal.kernels import norm as norm_ops  # noqa: E402
from tidal.kernels.backend import use_triton  # noqa: E402


@pytest.fixture(scope="module")
def tri():
    """The Triton modules (imported after ``TRITON_INTERPRET`` is set)."""
    pytest.importorskip("triton")
    from tidal.kernels import hyper_connection_triton, norm_triton

    return norm_triton, hyper_connection_triton


def _force(monkeypatch, triton: bool) -> None:
    """Make every dispatcher take (or skip) the Triton path, whatever the tensors' device."""
    for module in (norm_ops, hc_ops, hc_layer):
        monkeypatch.setattr(module, "use_triton", lambda t, name=None: triton)


# The original formulas, verbatim.
def _old_rms_norm(x, weight, eps, group_size=None):
    h = x.float()
    if group_size is not None:
        h = h.reshape(*h.shape[:-1], -1, group_size)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if group_size is not None:
        h = h.flatten(-2)
    return (h * (1.0 + weight.float())).type_as(x)


def _old_gated_rms_norm(x, gate, weight, eps, activation="silu"):
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = weight * h.to(dtype)
    g = gate.float()
    g = F.silu(g) if activation == "silu" else torch.sigmoid(g)
    return (h * g).to(dtype)


def _old_forward(m: GatedResidual, streams):
    hc, hidden = m.hc_count, m.hidden
    normed = _old_rms_norm(streams, m.hc_norm.weight, m.hc_norm.eps, hidden)
    mix = F.silu(F.linear(normed, m.input_mix_weight_down.weight) / hc)
    mix = torch.sigmoid(F.linear(mix, m.input_mix_weight_up.weight)).unflatten(-1, (hc, hidden))
    block_input = (mix * normed.unflatten(-1, (hc, hidden))).mean(dim=-2)
    if m.block_inject_weight is None:
        return block_input, None
    return block_input, 2 * torch.sigmoid(F.linear(normed, m.block_inject_weight.weight) / hc)


def _old_residual(streams, block_out, inject):
    return streams + (block_out.unsqueeze(-2) * inject.unsqueeze(-1)).flatten(-2)


def _hc_module(hc: int, hidden: int, lowrank: int, seed: int, dtype=torch.float32, use_combine=True):
    torch.manual_seed(seed)
    m = GatedResidual(hc, hidden, lowrank, EPS, use_combine=use_combine)
    width = hc * hidden
    m.hc_norm.weight.copy_(0.2 * torch.randn(width))
    m.input_mix_weight_down.weight.copy_(torch.randn(lowrank, width) / width ** 0.5)
    m.input_mix_weight_up.weight.copy_(torch.randn(width, lowrank) / lowrank ** 0.5)
    if use_combine:
        m.block_inject_weight.weight.copy_(torch.randn(hc, width) / width ** 0.5)
    return m.to(device=DEV, dtype=dtype)


def _block(hidden: int, seed: int, dtype=torch.float32):
    """A stand-in mixer: a fixed random projection and tanh."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(hidden, hidden, generator=g) / hidden ** 0.5).to(DEV, dtype)
    return lambda x: torch.tanh(F.linear(x, w)) * 3


def _chain(mods, block_fns, streams, fused: bool):
    """Two blocks through ``mods[0..1]``, then the block input of ``mods[2]``; returns every output."""
    outs = []
    if fused:  # as the model runs them (``GatedResidual.residual_mix``)
        streams, x, logits = mods[0].residual_mix(streams, None)
        for i, fn in enumerate(block_fns):
            new_streams, next_x, next_logits = mods[i + 1].residual_mix(streams, (fn(x), logits))
            outs += [x, new_streams]
            streams, x, logits = new_streams, next_x, next_logits
        outs.append(x)
    else:
        for i, fn in enumerate(block_fns):
            x, inject = _old_forward(mods[i], streams)
            streams = _old_residual(streams, fn(x), inject)
            outs += [x, streams]
        outs.append(_old_forward(mods[-1], streams)[0])
    return outs


# ---------------------------------------------------------------- float32, CPU interpreter (or GPU)

NORM_CASES = [(1, 144, 48), (3, 256, 64), (37, 192, None), (37, 100, None), (3, 384, 128)]


@pytest.mark.parametrize("rows,width,group", NORM_CASES)
def test_rms_norm_kernel_matches_reference(tri, rows, width, group):
    torch.manual_seed(rows + width)
    x = torch.randn(rows, width, device=DEV) * 3
    w = 0.2 * torch.randn(width, device=DEV)
    ref = norm_ops.rms_norm_ref(x, w, EPS, group)
    torch.testing.assert_close(tri[0].rms_norm_triton(x, w, EPS, group), ref, rtol=1e-5, atol=1e-5)
    # Leading dims and a row stride that is not the width (a column slice).
    wide = torch.randn(2, rows, width + 16, device=DEV)
    x3 = wide[..., 8:8 + width]
    torch.testing.assert_close(tri[0].rms_norm_triton(x3, w, EPS, group), norm_ops.rms_norm_ref(x3, w, EPS, group),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows,width,hc", [(1, 20, 4), (37, 24, 3)])
def test_hc_gate_act_kernel_matches_reference(tri, rows, width, hc):
    x = (torch.randn(rows, width + 5, device=DEV) * 6)[:, 2:2 + width]  # a column slice, as the GEMM leaves it
    torch.testing.assert_close(tri[1].hc_gate_act_triton(x, hc), hc_ops.hc_gate_act_ref(x, hc), rtol=1e-5, atol=1e-6)


def _norm_rotary_case(rows, heads, dim, rot, dtype, device):
    """Per-head q-like rows as a strided view (the gate half of each head interleaved, as q_proj lays
    them out), a norm weight, and cos/sin of scattered positions."""
    from tidal.executor.layers.rotary import Rotary

    g = torch.Generator().manual_seed(rows + heads + dim)
    both = torch.randn(rows, heads, 2 * dim, generator=g) * 3
    x = both.to(device, dtype)[..., :dim]
    w = (0.2 * torch.randn(dim, generator=g)).to(device, dtype)
    positions = torch.randint(0, 40000, (rows,), generator=g).to(device)
    cos, sin = Rotary(rot, 10000.0).cos_sin(positions, dtype)
    return x, w, cos, sin


@pytest.mark.parametrize("rows,heads,dim,rot", [(1, 4, 32, 16), (5, 3, 48, 48), (7, 1, 64, 8)])
def test_rms_norm_rotary_kernel_matches_reference(tri, rows, heads, dim, rot):
    from tidal.executor.layers.rotary import Rotary

    x, w, cos, sin = _norm_rotary_case(rows, heads, dim, rot, torch.float32, DEV)
    ref = Rotary.apply(norm_ops.rms_norm_ref(x, w, EPS), cos, sin)
    got = tri[0].rms_norm_rotary_triton(x, w, EPS, cos, sin)
    assert got.is_contiguous()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows,width", [(1, 64), (37, 128), (3, 100)])
@pytest.mark.parametrize("activation", ["silu", "sigmoid"])
def test_gated_rms_norm_kernel_matches_reference(tri, rows, width, activation):
    torch.manual_seed(rows * width)
    x, gate = torch.randn(2, rows, width, device=DEV).unbind(0)
    w = 1 + 0.2 * torch.randn(width, device=DEV)
    out = tri[0].gated_rms_norm_triton(x, gate, w, EPS, activation)
    torch.testing.assert_close(out, norm_ops.gated_rms_norm_ref(x, gate, w, EPS, activation), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens,heads,width", [(1, 3, 64), (37, 4, 128), (5, 2, 100)])
def test_gated_rms_norm_kernel_reads_strided_heads(tri, tokens, heads, width):
    """GDN hands the gate as ``[T, heads, d]`` column slices of its input projection's output."""
    torch.manual_seed(tokens + heads)
    x = torch.randn(tokens, heads, width, device=DEV)
    wide = torch.randn(tokens, heads * width + 70, device=DEV)
    gate = wide[:, 30:30 + heads * width].unflatten(-1, (heads, width))
    w = 1 + 0.2 * torch.randn(width, device=DEV)
    out = tri[0].gated_rms_norm_triton(x, gate, w, EPS)
    assert out.shape == (tokens, heads, width) and out.is_contiguous()
    torch.testing.assert_close(out, norm_ops.gated_rms_norm_ref(x, gate.contiguous(), w, EPS), rtol=1e-5, atol=1e-5)
    x_strided = torch.randn(tokens, heads * width + 8, device=DEV)[:, 8:].unflatten(-1, (heads, width))
    torch.testing.assert_close(tri[0].gated_rms_norm_triton(x_strided, gate, w, EPS),
                               norm_ops.gated_rms_norm_ref(x_strided.contiguous(), gate.contiguous(), w, EPS),
                               rtol=1e-5, atol=1e-5)


def test_norm_references_are_the_original_formulas():
    torch.manual_seed(0)
    x, gate = torch.randn(2, 5, 96).unbind(0)
    w = 0.2 * torch.randn(96)
    for dtype in (torch.float32, torch.bfloat16):
        xd, gd = x.to(dtype), gate.to(dtype)
        for wd in (w, w.to(dtype)):
            assert torch.equal(norm_ops.rms_norm_ref(xd, wd, EPS, 32), _old_rms_norm(xd, wd, EPS, 32))
            assert torch.equal(norm_ops.rms_norm(xd, wd, EPS), _old_rms_norm(xd, wd, EPS))
            for act in ("silu", "sigmoid"):
                assert torch.equal(norm_ops.gated_rms_norm(xd, gd, wd, EPS, act),
                                   _old_gated_rms_norm(xd, gd, wd, EPS, act))


HC_CASES = [(1, 3, 48), (3, 4, 64), (37, 3, 48), (37, 4, 64)]


@pytest.mark.parametrize("rows,hc,hidden", HC_CASES)
def test_hc_block_input_kernel_matches_reference(tri, rows, hc, hidden):
    torch.manual_seed(rows + hc)
    normed, up = torch.randn(2, rows, hc * hidden, device=DEV).unbind(0)
    out = tri[1].hc_block_input_triton(normed, up * 3, hc)
    torch.testing.assert_close(out, hc_ops.hc_block_input_ref(normed, up * 3, hc), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows,hc,hidden", HC_CASES)
def test_hc_residual_norm_kernel_matches_reference(tri, rows, hc, hidden):
    torch.manual_seed(rows * hc)
    streams = torch.randn(rows, hc * hidden, device=DEV) * 2
    block_out = torch.randn(rows, hidden, device=DEV)
    logits = torch.randn(rows, 7 + hc, device=DEV)[:, 7:] * 4  # a column slice, as the fused GEMM hands it
    w = 0.2 * torch.randn(hc * hidden, device=DEV)
    new, normed = tri[1].hc_residual_norm_triton(streams, block_out, logits, hc, w, EPS)
    ref_new, ref_normed = hc_ops.hc_residual_norm_ref(streams, block_out, logits, hc, w, EPS)
    torch.testing.assert_close(new, ref_new, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(normed, ref_normed, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("hc,hidden,lowrank", [(3, 48, 20), (4, 64, 24)])
def test_reference_chain_is_the_original_forward_and_residual(monkeypatch, hc, hidden, lowrank):
    _force(monkeypatch, triton=False)
    mods = [_hc_module(hc, hidden, lowrank, seed=i) for i in range(3)]
    fns = [_block(hidden, seed=10 + i) for i in range(2)]
    streams = torch.randn(37, hc * hidden, device=DEV)
    for new, old in zip(_chain(mods, fns, streams, fused=True), _chain(mods, fns, streams, fused=False), strict=True):
        assert torch.equal(new, old)
    for m in mods:
        for new, old in zip(m(streams), _old_forward(m, streams), strict=True):
            assert torch.equal(new, old)
    mixer = _hc_module(hc, hidden, lowrank, seed=5, use_combine=False)
    x, inject = mixer(streams)
    assert inject is None and torch.equal(x, _old_forward(mixer, streams)[0])
    assert torch.equal(GatedResidual.residual(streams, x, mods[0](streams)[1]),
                       _old_residual(streams, x, mods[0](streams)[1]))


@pytest.mark.parametrize("rows,hc,hidden,lowrank", [(1, 3, 48, 20), (37, 4, 64, 24)])
def test_triton_chain_matches_original(tri, monkeypatch, rows, hc, hidden, lowrank):
    _force(monkeypatch, triton=True)
    mods = [_hc_module(hc, hidden, lowrank, seed=i) for i in range(3)]
    fns = [_block(hidden, seed=10 + i) for i in range(2)]
    streams = torch.randn(rows, hc * hidden, device=DEV)
    for new, old in zip(_chain(mods, fns, streams, fused=True), _chain(mods, fns, streams, fused=False), strict=True):
        torch.testing.assert_close(new, old, rtol=1e-5, atol=1e-5)
    for new, old in zip(mods[0](streams), _old_forward(mods[0], streams), strict=True):
        torch.testing.assert_close(new, old, rtol=1e-5, atol=1e-5)


def test_down_inject_weight_follows_the_parameters(monkeypatch):
    _force(monkeypatch, triton=True)
    m = _hc_module(3, 48, 20, seed=0)
    first = m._down_inject.get()
    assert m._down_inject.get() is first
    assert first.shape[0] == 24 and not first[23:].any()  # 20 + 3 rows, zero-padded to a multiple of 8
    torch.testing.assert_close(first[:23], torch.cat([m.input_mix_weight_down.weight, m.block_inject_weight.weight]))
    with torch.no_grad():
        m.block_inject_weight.weight.mul_(2)  # an in-place load
    second = m._down_inject.get()
    assert second is not first and torch.equal(second[20:23], m.block_inject_weight.weight)
    m.to(torch.float64)
    assert m._down_inject.get().dtype == torch.float64
    assert "_down_inject" not in "".join(m.state_dict())
    down, logits = m._down_inject.split(torch.arange(24.0).expand(2, 24))
    assert down.shape == (2, 20) and logits.tolist() == [[20.0, 21.0, 22.0]] * 2


def test_stacked_projections_equal_the_separate_ones():
    """GDN's four input projections and attention's q/k/v/index projections as one GEMM (the GPU
    path) equal the checkpoint's separate projections."""
    from tidal.config.model import ModelConfig
    from tidal.executor.layers.attention import GatedAttention
    from tidal.executor.layers.gdn import GatedDeltaNet
    from tidal.executor.layers.rotary import Rotary
    from tidal.executor.presets import preset_config

    c = ModelConfig.from_dict(preset_config("tiny"))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, c.hidden_size, generator=g)
    layers = [GatedDeltaNet(c, 0), GatedAttention(c, 2, Rotary(c.rotary_dim, c.rope_theta))]
    for layer in layers:
        for p in layer.parameters():
            p.data = torch.randn(p.shape, generator=g)
        stack = layer._in_proj
        with torch.inference_mode():  # built where the runner builds it
            parts = stack.split(torch.nn.functional.linear(x, stack.get()))
        assert len(parts) == len(stack.linears) and stack.get().shape[0] % 8 == 0
        for part, lin in zip(parts, stack.linears, strict=True):
            torch.testing.assert_close(part, lin(x), rtol=1e-5, atol=1e-5)
            # The weights are held once: each is a view of the stack's rows.
            assert lin.weight.untyped_storage().data_ptr() == stack.get().untyped_storage().data_ptr()
        # A reload writes into a weight in place: the next stack has it.
        first = stack.linears[0]
        with torch.no_grad():
            first.weight.copy_(torch.randn(first.weight.shape, generator=g))
        torch.testing.assert_close(stack.split(torch.nn.functional.linear(x, stack.get()))[0], first(x),
                                   rtol=1e-5, atol=1e-5)


def _ple_case(rows, hc, hidden, dtype, device, seed=0):
    """PLE gate inputs; the key and query are column slices of wider tensors (row stride > width), the
    last row's query is zero (a zero gate: sign 0)."""
    g = torch.Generator().manual_seed(seed)
    width = hc * hidden
    key = (2 * torch.randn(rows, width + 8, generator=g)).to(device, dtype)[:, 8:]
    query = torch.randn(rows, width + 16, generator=g).to(device, dtype)[:, :width]
    query[-1] = 0
    value = (3 * torch.randn(rows, hidden, generator=g)).to(device, dtype)
    kw, cw = (0.2 * torch.randn(2, width, generator=g)).to(device, dtype).unbind(0)
    return key, query, value, kw, cw


def _old_ple_gate(key_raw, query, value, key_weight, conv_weight, hc, eps):
    """PLELayer's gate as the layer computed it inline (norm modules, broadcast products)."""
    import math

    hidden = value.shape[-1]
    key = _old_rms_norm(key_raw, key_weight, eps, hidden).unflatten(-1, (hc, hidden))
    q = query.unflatten(-1, (hc, hidden))
    gate = (key * q).sum(dim=-1, keepdim=True) / math.sqrt(hidden)
    gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
    gated = torch.sigmoid(gate) * value.unsqueeze(-2)
    return gated.flatten(-2), _old_rms_norm(gated.flatten(-2), conv_weight, eps, hidden)


@pytest.mark.parametrize("rows,hc,hidden", [(1, 4, 64), (7, 3, 48), (9, 4, 96)])
def test_ple_gate_kernel_and_reference(rows, hc, hidden):
    """The reference equals the layer's original formula exactly; the kernel (interpreter on the CPU,
    fp32) matches the reference."""
    pytest.importorskip("triton")
    from tidal.kernels.ple import ple_gate_ref
    from tidal.kernels.ple_triton import ple_gate_triton

    args = _ple_case(rows, hc, hidden, torch.float32, DEV, seed=rows)
    want = ple_gate_ref(*args, hc, EPS)
    for a, b in zip(_old_ple_gate(*args, hc, EPS), want, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(want[0][-1], 0.5 * args[2][-1].repeat(hc))  # zero query row: sigmoid(0) gates
    for a, b in zip(ple_gate_triton(*args, hc, EPS), want, strict=True):
        _assert_near(a, b, torch.float32)
    with pytest.raises(ValueError, match="do not fit hc="):
        ple_gate_triton(*args, 3 if hc != 3 else 4, EPS)


def test_use_triton_needs_cuda():
    assert not use_triton(torch.zeros(1))


# ---------------------------------------------------------------- real shapes on the GPU

T, HC, HIDDEN, LOWRANK = 4097, 4, 2048, 320


def _assert_near(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, chain: bool = False) -> None:
    """fp32: elementwise 1e-5 (kernels; only summation order and rsqrt/sigmoid ulps differ) or 1e-4
    (chains, which also differ in GEMM order: one [down; inject] GEMM against two, then amplified by
    the blocks). bf16: the kernels copy the reference's roundings, but an ulp-level sigmoid or rsqrt
    difference now and then flips one (2^-8 relative) and that spreads along its row, so the check is
    on the tensor: max error <= 1e-2 (chains 3e-2) of max |ref|, mean error <= 1e-3 (3e-3) of mean |ref|.
    """
    if dtype == torch.float32:
        tol = 1e-4 if chain else 1e-5
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
        return
    assert got.dtype == want.dtype and got.shape == want.shape
    err, ref = (got.float() - want.float()).abs(), want.float().abs()
    assert err.max() <= (3e-2 if chain else 1e-2) * ref.max(), (err.max(), ref.max())
    assert err.mean() <= (3e-3 if chain else 1e-3) * ref.mean(), (err.mean(), ref.mean())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_kernels_match_references(tri, monkeypatch, dtype):
    monkeypatch.setenv("TIDAL_KERNELS", "triton")
    torch.manual_seed(0)
    width = HC * HIDDEN
    streams = (torch.randn(T, width, device="cuda") * 2).to(dtype)
    w = (0.2 * torch.randn(width, device="cuda")).to(dtype)
    for group in (HIDDEN, None):
        _assert_near(norm_ops.rms_norm(streams, w, EPS, group), norm_ops.rms_norm_ref(streams, w, EPS, group), dtype)
    wide = torch.randn(37, 16384, device="cuda", dtype=dtype)
    _assert_near(norm_ops.rms_norm(wide, wide[0], EPS), norm_ops.rms_norm_ref(wide, wide[0], EPS), dtype)
    x, gate = torch.randn(2, T * 4, 128, device="cuda", dtype=dtype).unbind(0)
    # GDN's gate: [T, heads, d] column slices of the input projection's output.
    gate_heads = torch.randn(T, 4 * 128 + 96, device="cuda", dtype=dtype)[:, 32:32 + 4 * 128].unflatten(-1, (4, 128))
    for gw in (torch.randn(128, device="cuda"), torch.randn(128, device="cuda", dtype=dtype)):
        _assert_near(norm_ops.gated_rms_norm(x, gate, gw, EPS), norm_ops.gated_rms_norm_ref(x, gate, gw, EPS), dtype)
        xh = x.reshape(T, 4, 128)
        _assert_near(norm_ops.gated_rms_norm(xh, gate_heads, gw, EPS),
                     norm_ops.gated_rms_norm_ref(xh, gate_heads, gw, EPS), dtype)
    down = (6 * torch.randn(T, LOWRANK + HC + 4, device="cuda")).to(dtype)[:, :LOWRANK]
    _assert_near(hc_ops.hc_gate_act(down, HC), hc_ops.hc_gate_act_ref(down, HC), dtype)
    from tidal.executor.layers.rotary import Rotary

    for heads, dim, rot in ((16, 256, 64), (16, 128, 64), (2, 256, 64)):  # the bench model's q, index q, k
        xq, wq, cos, sin = _norm_rotary_case(T, heads, dim, rot, dtype, "cuda")
        _assert_near(tri[0].rms_norm_rotary_triton(xq, wq, EPS, cos, sin),
                     Rotary.apply(norm_ops.rms_norm_ref(xq, wq, EPS), cos, sin), dtype)
    up = (3 * torch.randn(T, width, device="cuda")).to(dtype)
    _assert_near(hc_ops.hc_block_input(streams, up, HC), hc_ops.hc_block_input_ref(streams, up, HC), dtype)
    block_out = torch.randn(T, HIDDEN, device="cuda", dtype=dtype)
    logits = (4 * torch.randn(T, LOWRANK + HC, device="cuda")).to(dtype)[:, LOWRANK:]
    got = hc_ops.hc_residual_norm(streams, block_out, logits, HC, w, EPS)
    want = hc_ops.hc_residual_norm_ref(streams, block_out, logits, HC, w, EPS)
    for a, b in zip(got, want, strict=True):
        _assert_near(a, b, dtype)
    from tidal.kernels.ple import ple_gate, ple_gate_ref

    ple_args = _ple_case(T, HC, HIDDEN, dtype, "cuda")
    # chain: the gate's signed square root amplifies a last-bit difference of a near-zero dot product
    # (fp32 measured with the approximate square root: 1 element in 33.5M at 1.2e-5 relative).
    for a, b in zip(ple_gate(*ple_args, HC, EPS), ple_gate_ref(*ple_args, HC, EPS), strict=True):
        _assert_near(a, b, dtype, chain=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_chain_matches_reference_path(tri, monkeypatch, dtype):
    mods = [_hc_module(HC, HIDDEN, LOWRANK, seed=i, dtype=dtype) for i in range(3)]
    fns = [_block(HIDDEN, seed=10 + i, dtype=dtype) for i in range(2)]
    streams = torch.randn(T, HC * HIDDEN, device="cuda", dtype=dtype)
    monkeypatch.setenv("TIDAL_KERNELS", "torch")
    assert not use_triton(streams)
    want = _chain(mods, fns, streams, fused=True)
    monkeypatch.setenv("TIDAL_KERNELS", "triton")
    assert use_triton(streams)
    got = _chain(mods, fns, streams, fused=True)
    for a, b in zip(got, want, strict=True):
        _assert_near(a, b, dtype, chain=True)
