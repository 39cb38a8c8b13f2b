"""The few-row tensor-core GEMM (``kernels/skinny_triton``) against ``F.linear``, and the dispatch of
``kernels.gemv.linear`` between the GEMV, it and ``F.linear``.

Without CUDA the Triton kernels run in the interpreter (fp32, CPU tensors); the ``gpu`` tests take the
flash-next decode step's projection shapes in bf16 against an fp32 reference, float32 against cuBLAS' fp32,
a row's bits among other row counts, and a replay from a CUDA graph.
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

from tidal.kernels import gemv as gemv_ops  # noqa: E402

# flash-next's decode-step projections (out, in): GDN input stack, out projections, attention input stack,
# shared expert, router, shared gate, the hyper-connection [down; inject] and up.
FLASH_NEXT = [(16480, 2560), (2560, 6144), (13952, 2560), (1280, 2560), (2560, 640), (512, 2560), (1, 2560),
              (328, 10240), (10240, 320)]


@pytest.fixture(scope="module")
def sk():
    pytest.importorskip("triton")
    from tidal.kernels import skinny_triton

    return skinny_triton


# ---------------------------------------------------------------- float32, CPU interpreter (or GPU)

@pytest.mark.parametrize("rows,n_out,k_in,cfg", [
    (3, 37, 100, (16, 32, 4, 2, 8)),      # K split in 2 over a partial last step; 3 padded rows
    (32, 64, 256, (32, 64, 4, 3, 1)),     # no split: the output written directly
    (17, 5, 48, (16, 16, 4, 2, 64)),      # more slices than one tile needs, fewer outputs than a tile
    (64, 40, 1000, (16, 128, 4, 2, 200)),  # the most rows; eight slices, the last short
    (5, 33, 16, (32, 64, 4, 2, 1000)),    # one step: one slice whatever min_programs asks
])
def test_skinny_matches_linear(sk, rows, n_out, k_in, cfg):
    """``x`` a column slice of a wider tensor and the weight a column slice too (row strides not K)."""
    g = torch.Generator().manual_seed(rows * n_out + k_in)
    x = torch.randn(rows, k_in + 3, generator=g).to(DEV)[:, 3:]
    w = torch.randn(n_out, k_in + 7, generator=g).to(DEV)[:, 7:]
    got = sk.skinny_triton(x, w, sk.SkinnyConfig(*cfg))
    torch.testing.assert_close(got, F.linear(x, w), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("n_out,k_in", FLASH_NEXT)
def test_k_split_covers_the_reduction(sk, n_out, k_in):
    """Slices of whole steps cover K exactly once, none empty; enough programs where K allows; one slice
    where the tiles alone reach ``min_programs``."""
    cfg = sk.DEFAULT
    per, slices = sk.k_split(n_out, k_in, cfg)
    steps = -(-k_in // cfg.block_k)
    assert per % cfg.block_k == 0 and per * slices >= k_in > per * (slices - 1)
    tiles = -(-n_out // cfg.block_n)
    assert tiles * slices >= cfg.min_programs or slices == steps
    if tiles >= cfg.min_programs:
        assert slices == 1
    # another device scales the programs with its SMs
    assert sk.k_split(n_out, k_in, cfg, sms=264)[1] >= slices


def test_skinny_refuses_what_it_does_not_serve(sk):
    x, w = torch.zeros(sk.MAX_ROWS + 1, 8, device=DEV), torch.zeros(4, 8, device=DEV)
    with pytest.raises(ValueError, match=f"at most {sk.MAX_ROWS} rows"):
        sk.skinny_triton(x, w)
    with pytest.raises(ValueError, match="do not multiply"):
        sk.skinny_triton(x[:3], w[:, :7])
    assert sk.skinny_triton(x[:0], w).shape == (0, 4)
    assert not sk.skinny_triton(x[:3, :0], w[:, :0]).any()


def test_linear_takes_the_kernel_of_its_row_count(sk, monkeypatch):
    """``kernels.gemv.linear``: the GEMV up to GEMV_ROWS rows, the few-row GEMM up to SKINNY_ROWS, ``F.linear``
    past it, with a bias, or where ``TIDAL_KERNELS`` sends ``skinny`` to torch; equal to ``F.linear`` each way."""
    from tidal.kernels import gemv_triton

    monkeypatch.setattr(gemv_ops, "use_triton", lambda t, name=None: name in ("gemv", "skinny"))
    monkeypatch.setattr(gemv_ops, "SKINNY_ROWS", 9)
    calls = []
    real_gemv, real_skinny = gemv_triton.gemv_triton, sk.skinny_triton
    monkeypatch.setattr(gemv_triton, "gemv_triton", lambda *a, **k: calls.append(("gemv", a[0].shape[0]))
                        or real_gemv(*a, **k))
    monkeypatch.setattr(sk, "skinny_triton", lambda *a, **k: calls.append(("skinny", a[0].shape[0]))
                        or real_skinny(*a, **k))
    g = torch.Generator().manual_seed(0)
    w, bias = torch.randn(24, 40, generator=g).to(DEV), torch.randn(24, generator=g).to(DEV)
    counts = (1, gemv_ops.GEMV_ROWS, gemv_ops.GEMV_ROWS + 1, gemv_ops.SKINNY_ROWS, gemv_ops.SKINNY_ROWS + 1)
    for rows in counts:
        x = torch.randn(rows, 40, generator=g).to(DEV)
        torch.testing.assert_close(gemv_ops.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(gemv_ops.linear(x, w, bias), F.linear(x, w, bias), rtol=1e-5, atol=1e-4)
    assert calls == [("gemv", 1), ("gemv", gemv_ops.GEMV_ROWS), ("skinny", gemv_ops.GEMV_ROWS + 1),
                     ("skinny", gemv_ops.SKINNY_ROWS)]
    monkeypatch.setattr(gemv_ops, "use_triton", lambda t, name=None: name == "gemv")
    gemv_ops.linear(torch.randn(gemv_ops.GEMV_ROWS + 1, 40, device=DEV), w)
    assert len(calls) == 4


# ---------------------------------------------------------------- CUDA

gpu = pytest.mark.skipif(_INTERPRET, reason="needs CUDA")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("n_out,k_in", FLASH_NEXT)
@pytest.mark.parametrize("rows", [3, 16, 33, 64])
def test_skinny_bf16_at_flash_next_shapes_gpu(sk, n_out, k_in, rows):
    """bf16 against the fp32 product: within one bf16 rounding of it, as cuBLAS is."""
    g = torch.Generator(device="cuda").manual_seed(n_out + rows)
    x = torch.randn(rows, k_in, generator=g, device="cuda").to(torch.bfloat16)
    w = (torch.randn(n_out, k_in, generator=g, device="cuda") / k_in ** 0.5).to(torch.bfloat16)
    want = F.linear(x.float(), w.float())
    got = sk.skinny_triton(x, w)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n_out)
    torch.testing.assert_close(got.float(), want, rtol=2 ** -7, atol=1e-3)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("n_out,k_in", [(2560, 6144), (328, 10240), (1280, 2560)])
def test_skinny_fp32_gpu(sk, n_out, k_in):
    """float32 runs IEEE products, not TF32: within fp32 summation-order differences of cuBLAS' fp32."""
    g = torch.Generator(device="cuda").manual_seed(n_out)
    x = torch.randn(19, k_in, generator=g, device="cuda")
    w = torch.randn(n_out, k_in, generator=g, device="cuda") / k_in ** 0.5
    allow = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        want = F.linear(x, w)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allow
    torch.testing.assert_close(sk.skinny_triton(x, w), want, rtol=1e-5, atol=1e-4)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("n_out,k_in", [(2560, 6144), (328, 10240), (16480, 2560)])
def test_a_rows_result_does_not_depend_on_the_row_count_gpu(sk, n_out, k_in):
    """The first rows' bits alone, among 17 rows and among 64 (the rows pad to 16, 32 and 64)."""
    g = torch.Generator(device="cuda").manual_seed(k_in)
    x = torch.randn(64, k_in, generator=g, device="cuda").to(torch.bfloat16)
    w = (torch.randn(n_out, k_in, generator=g, device="cuda") / k_in ** 0.5).to(torch.bfloat16)
    whole = sk.skinny_triton(x, w)
    for rows in (3, 17):
        assert torch.equal(sk.skinny_triton(x[:rows], w), whole[:rows])


@pytest.mark.gpu
@gpu
def test_skinny_replays_from_a_cuda_graph_gpu(sk):
    """Split (the partials' buffer from the graph's pool and the second launch) and unsplit launches, captured
    and replayed on new inputs, give the eager bits."""
    g = torch.Generator(device="cuda").manual_seed(7)
    shapes = [(328, 10240), (16480, 2560)]
    ws = [(torch.randn(n, k, generator=g, device="cuda") / k ** 0.5).to(torch.bfloat16) for n, k in shapes]
    xs = [torch.randn(32, k, generator=g, device="cuda").to(torch.bfloat16) for _, k in shapes]
    assert [sk.k_split(n, k, sk.DEFAULT)[1] > 1 for n, k in shapes] == [True, False]
    for x, w in zip(xs, ws, strict=True):
        sk.skinny_triton(x, w)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [sk.skinny_triton(x, w) for x, w in zip(xs, ws, strict=True)]
    for x in xs:
        x.copy_(torch.randn(x.shape, generator=g, device="cuda").to(torch.bfloat16))
    graph.replay()
    for x, w, out in zip(xs, ws, outs, strict=True):
        assert torch.equal(out, sk.skinny_triton(x, w))
