"""The decode-row GEMV and the hyper-connection residual and mix of a decode step's few rows against their
torch references (``F.linear``; the residual and norm, the gate, ``up`` GEMM and gated mean of
``kernels/hyper_connection``).

Without CUDA the Triton kernels run in the interpreter (fp32, CPU tensors); the ``gpu`` tests take the
bench model's shapes in bf16 and fp32, and ``GatedResidual.residual_mix`` against the cuBLAS path.
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

from test_kernel_hc_norm import _hc_module  # noqa: E402  (this folder is on sys.path)

from tidal.executor.layers import hyper_connection as hc_layer  # noqa: E402
from tidal.kernels import gemv as gemv_ops  # noqa: E402
from tidal.kernels import hyper_connection as hc_ops  # noqa: E402
from tidal.kernels import pdl  # noqa: E402


@pytest.fixture(scope="module")
def tri():
    pytest.importorskip("triton")
    from tidal.kernels import gemv_triton, hyper_connection_triton

    return gemv_triton, hyper_connection_triton


def _mix_ref(down: torch.Tensor, up_weight: torch.Tensor, normed: torch.Tensor, hc: int) -> torch.Tensor:
    """The cuBLAS path's arithmetic after the ``[down; inject]`` GEMM, op by op in torch."""
    return hc_ops.hc_block_input_ref(normed, F.linear(hc_ops.hc_gate_act_ref(down, hc), up_weight), hc)


# ---------------------------------------------------------------- float32, CPU interpreter (or GPU)

@pytest.mark.parametrize("rows,n_out,k_in,tile", [(1, 24, 64, 8192), (3, 37, 100, 256), (8, 5, 48, 64),
                                                  (2, 9, 16, 16)])
def test_gemv_matches_linear(tri, rows, n_out, k_in, tile):
    """Outputs not a multiple of the program's rows, reductions not a power of two, programs of one row
    (``tile`` 16 at K 16), and ``x`` a column slice of a wider tensor (the layer hands it so)."""
    g = torch.Generator().manual_seed(rows * n_out)
    x = torch.randn(rows, k_in + 5, generator=g).to(DEV)[:, 5:]
    w = torch.randn(n_out, k_in, generator=g).to(DEV)
    torch.testing.assert_close(tri[0].gemv_triton(x, w, tile=tile), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_gemv_refuses_what_it_does_not_serve(tri):
    x, w = torch.zeros(tri[0].MAX_ROWS + 1, 8, device=DEV), torch.zeros(4, 8, device=DEV)
    with pytest.raises(ValueError, match=f"at most {tri[0].MAX_ROWS} rows"):
        tri[0].gemv_triton(x, w)
    with pytest.raises(ValueError, match="do not multiply"):
        tri[0].gemv_triton(x[:1], w[:, :7])
    assert tri[0].gemv_triton(x[:0], w).shape == (0, 4)
    assert not tri[0].gemv_triton(x[:2, :0], w[:, :0]).any()


def test_linear_takes_the_gemv_for_few_rows_only(tri, monkeypatch):
    """``kernels.gemv.linear``: the GEMV for at most GEMV_ROWS rows without a bias, ``F.linear`` otherwise;
    equal to ``F.linear`` either way."""
    monkeypatch.setattr(gemv_ops, "use_triton", lambda t, name=None: name == "gemv")
    calls = []
    real = tri[0].gemv_triton
    monkeypatch.setattr(tri[0], "gemv_triton", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    w, bias = torch.randn(24, 40, device=DEV), torch.randn(24, device=DEV)
    for rows in (1, gemv_ops.GEMV_ROWS, gemv_ops.GEMV_ROWS + 1):
        x = torch.randn(rows, 40, device=DEV)
        torch.testing.assert_close(gemv_ops.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(gemv_ops.linear(x, w, bias), F.linear(x, w, bias), rtol=1e-5, atol=1e-5)
    assert calls == [1, gemv_ops.GEMV_ROWS]
    monkeypatch.setattr(gemv_ops, "use_triton", lambda t, name=None: False)
    gemv_ops.linear(torch.randn(1, 40, device=DEV), w)
    assert calls == [1, gemv_ops.GEMV_ROWS]


@pytest.mark.parametrize("rows,hc,hidden,lowrank,block_h", [(1, 4, 64, 24, 4), (3, 3, 48, 20, 8), (8, 4, 40, 33, 16),
                                                             (2, 4, 2049, 8, None)])
def test_mix_tail_matches_reference(tri, rows, hc, hidden, lowrank, block_h):
    """``down`` is a column slice of the stacked GEMV's output (inject logits after it); hidden sizes
    not a multiple of the program's block; past 2,048 features a stream, the wide default config."""
    g = torch.Generator().manual_seed(rows + hidden)
    down = (3 * torch.randn(rows, lowrank + hc + 3, generator=g)).to(DEV)[:, :lowrank]
    up_w = (torch.randn(hc * hidden, lowrank, generator=g) / lowrank ** 0.5).to(DEV)
    normed = torch.randn(rows, hc * hidden, generator=g).to(DEV)
    got = tri[1].hc_mix_tail_triton(down, up_w, normed, hc, block_h=block_h)
    torch.testing.assert_close(got, _mix_ref(down, up_w, normed, hc), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="do not fit hc="):
        tri[1].hc_mix_tail_triton(down, up_w[:-1], normed, hc)


@pytest.mark.parametrize("rows,hc,hidden,n_out,residual", [(1, 4, 64, 24, True), (3, 3, 48, 23, True),
                                                           (2, 3, 40, 7, False), (8, 4, 16, 5, True),
                                                           (2, 4, 2049, 9, True)])
def test_norm_down_matches_reference(tri, rows, hc, hidden, n_out, residual):
    """The residual (or none), the grouped norm and the ``[down; inject]`` GEMV in one kernel, against
    ``hc_residual_norm_ref`` (or ``rms_norm_ref``) and ``F.linear``: hidden sizes not powers of two, three
    streams, the inject logits a column slice, several programs (2 weight rows each, 4 past 2,048 features) and a
    partial last one."""
    from tidal.kernels.norm import rms_norm_ref

    g = torch.Generator().manual_seed(rows + hidden)
    width = hc * hidden
    streams = (2 * torch.randn(rows, width, generator=g)).to(DEV)
    norm_w = (0.2 * torch.randn(width, generator=g)).to(DEV)
    weight = (torch.randn(n_out, width, generator=g) / width ** 0.5).to(DEV)
    pending = None
    if residual:
        pending = (torch.randn(rows, hidden, generator=g).to(DEV),
                   (3 * torch.randn(rows, hc + 5, generator=g)).to(DEV)[:, 2:2 + hc])
        want_new, want_normed = hc_ops.hc_residual_norm_ref(streams, *pending, hc, norm_w, 1e-6)
    else:
        want_new, want_normed = streams, rms_norm_ref(streams, norm_w, 1e-6, hidden)
    new, normed, y = tri[1].hc_norm_down_triton(streams, pending, hc, norm_w, 1e-6, weight)
    assert (new is streams) == (not residual)
    torch.testing.assert_close(new, want_new, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(normed, want_normed, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y, F.linear(want_normed, weight), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="do not fit hc="):
        tri[1].hc_norm_down_triton(streams, pending, hc, norm_w[:-1], 1e-6, weight)


def _mix_both_ways(monkeypatch, m, streams, pending):
    """``m.residual_mix(streams, pending)`` with the kernels' dispatch on, and with every hyper-connection op
    in torch."""
    monkeypatch.setattr(hc_layer, "use_triton", lambda t, name=None: True)
    monkeypatch.setattr(hc_ops, "use_triton", lambda t, name=None: True)
    got = m.residual_mix(streams, pending)
    monkeypatch.setattr(hc_layer, "use_triton", lambda t, name=None: False)
    monkeypatch.setattr(hc_ops, "use_triton", lambda t, name=None: False)
    return got, m.residual_mix(streams, pending)


def _pending(rows: int, hidden: int, hc: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, hidden, generator=g).to(DEV), torch.randn(rows, hc, generator=g).to(DEV)


@pytest.mark.parametrize("use_combine", [True, False], ids=["inject", "final"])
@pytest.mark.parametrize("rows", [1, hc_ops.MIX_GEMV_ROWS])
@pytest.mark.parametrize("residual", [True, False], ids=["residual", "first"])
def test_layer_residual_mix_of_few_rows_takes_the_kernels(tri, monkeypatch, rows, use_combine, residual):
    """``GatedResidual.residual_mix`` of a few rows runs the two launches (the stacked weight's projection:
    inject logits are its column view; the final mixer has none) and equals the torch path."""
    m = _hc_module(3, 48, 20, seed=rows, use_combine=use_combine)
    streams = torch.randn(rows, 3 * 48, device=DEV)
    pending = _pending(rows, 48, 3, seed=rows) if residual else None
    calls = []
    real = tri[1].hc_norm_down_triton
    monkeypatch.setattr(tri[1], "hc_norm_down_triton", lambda *a, **k: calls.append(a[5].shape) or real(*a, **k))
    got, want = _mix_both_ways(monkeypatch, m, streams, pending)
    assert calls == [(24, 144) if use_combine else (20, 144)]
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
    if use_combine:
        torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=1e-5)
    else:
        assert got[2] is None and want[2] is None


def test_layer_residual_mix_of_many_rows_keeps_the_gemms(tri, monkeypatch):
    m = _hc_module(3, 48, 20, seed=0)
    rows = hc_ops.MIX_GEMV_ROWS + 1
    streams = torch.randn(rows, 3 * 48, device=DEV)
    monkeypatch.setattr(tri[1], "hc_norm_down_triton", lambda *a, **k: pytest.fail("a GEMV for a GEMM's rows"))
    got, want = _mix_both_ways(monkeypatch, m, streams, _pending(rows, 48, 3, seed=0))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_pdl_needs_cuda_and_can_be_turned_off(monkeypatch):
    assert not pdl.enabled(torch.zeros(1))
    monkeypatch.setenv("TIDAL_PDL", "0")
    assert not pdl.enabled(torch.zeros(1, device=DEV))


# ---------------------------------------------------------------- the bench model's shapes on the GPU

HC, HIDDEN, LOWRANK = 4, 2048, 320


def _assert_near(got, want, dtype):
    """fp32: 1e-5 (summation order). bf16: the kernels round where the reference does, but a last-bit
    difference of a sum flips a rounding now and then; max error <= 1e-2 of max |ref|, mean <= 1e-3."""
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        return
    err, ref = (got.float() - want.float()).abs(), want.float().abs()
    assert err.max() <= 1e-2 * ref.max(), (err.max(), ref.max())
    assert err.mean() <= 1e-3 * ref.mean(), (err.mean(), ref.mean())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_gemv_and_mix_match_references(tri, monkeypatch, dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    monkeypatch.setenv("TIDAL_PDL", "1")
    assert pdl.enabled(torch.zeros(1, device="cuda")) == (torch.cuda.get_device_capability()[0] >= 9)
    shapes = [(LOWRANK + HC + 4, HC * HIDDEN), (512, HIDDEN), (HIDDEN, 4096), (12352, HIDDEN)]
    for rows in (1, 2, 4, 8):
        for n_out, k_in in shapes:
            x = torch.randn(rows, k_in, device="cuda", generator=g).to(dtype)
            w = (torch.randn(n_out, k_in, device="cuda", generator=g) / k_in ** 0.5).to(dtype)
            got = tri[0].gemv_triton(x, w)
            # Each output is one rounding of an fp32 dot: against the fp32 product rounded once.
            want = F.linear(x.double(), w.double()).to(dtype)
            _assert_near(got, want, dtype)
            assert torch.equal(got[:1], tri[0].gemv_triton(x[:1], w))  # a row's result whatever its batch
            monkeypatch.setenv("TIDAL_PDL", "0")  # the launch mode changes no value
            assert torch.equal(got, tri[0].gemv_triton(x, w))
            monkeypatch.setenv("TIDAL_PDL", "1")
        # The bench preset's streams and flash-next's (2,560 features: the wide launch configs).
        for hidden, use_combine, residual in ((HIDDEN, True, True), (HIDDEN, True, False), (HIDDEN, False, True),
                                              (2560, True, True), (2560, False, True)):
            m = _hc_module(HC, hidden, LOWRANK, seed=rows, dtype=dtype, use_combine=use_combine)
            streams = torch.randn(rows, HC * hidden, device="cuda", generator=g).to(dtype)
            pending = None
            if residual:
                pending = (torch.randn(rows, hidden, device="cuda", generator=g).to(dtype),
                           torch.randn(rows, HC, device="cuda", generator=g).to(dtype))
            monkeypatch.setenv("TIDAL_KERNELS", "triton")
            got = m.residual_mix(streams, pending)
            monkeypatch.setenv("TIDAL_KERNELS", "torch")
            want = m.residual_mix(streams, pending)
            for a, b in zip(got, want, strict=True):
                if b is None:
                    assert a is None
                else:
                    _assert_near(a, b, dtype)


@pytest.mark.gpu
def test_the_model_takes_the_hc_kernels_gpu(same_ids_as_torch_ops):
    """The tiny model's greedy ids with the hyper-connection kernels (a decode step's residual, norm and mix
    in two launches), against every hyper-connection op in torch."""
    same_ids_as_torch_ops("hc")
