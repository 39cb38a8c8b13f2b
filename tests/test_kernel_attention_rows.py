"""An attention layer's per-token work (``kernels/attention_rows_triton``) against the torch ops it replaces:
``Rotary.apply`` of ``rms_norm_ref`` for the queries, keys and index queries, the KV-cache row writes, and
``QSAIndexer.write_block_keys``' pooled block keys (gather, fp32 mean, norm, rotary of the block's first
position, store at its last row).

The small-shape tests run in fp32: in the interpreter on CPU tensors without CUDA, compiled on a GPU. The
``gpu`` tests take the bench model's head shapes in bf16 and fp32.
"""

from __future__ import annotations

import os

import pytest
import torch

_INTERPRET = not torch.cuda.is_available()
if _INTERPRET:  # never on a GPU machine: it would turn every kernel of the session into the interpreter
    os.environ["TRITON_INTERPRET"] = "1"
DEV = "cpu" if _INTERPRET else "cuda"

from tidal.executor.layers.rotary import Rotary  # noqa: E402
from tidal.kernels.norm import rms_norm_ref  # noqa: E402


@pytest.fixture(scope="module")
def rows_mod():
    pytest.importorskip("triton")
    from tidal.kernels import attention_rows_triton

    return attention_rows_triton


def _ref(x, w, eps, cos, sin):
    return Rotary.apply(rms_norm_ref(x, w, eps), cos, sin)


def _case(rows_mod, tokens, heads, kv_heads, dim, rot, index, dtype, seed):
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(DEV, dtype)

    # The projections' output: one wide row a token, q (with its gate interleaved per head), k, v, index q/k
    # as column slices of it, as the stacked GEMM hands them.
    index_heads, index_dim = index
    widths = [heads * 2 * dim, kv_heads * dim, kv_heads * dim, index_heads * index_dim, index_dim]
    proj = rnd(tokens, sum(widths))
    q_gate, k, v, iq, ik = proj.split(widths, dim=-1)
    q = q_gate.view(tokens, heads, 2 * dim)[..., :dim]
    k, v = k.view(tokens, kv_heads, dim), v.view(tokens, kv_heads, dim)
    iq = iq.view(tokens, index_heads, index_dim)
    rotary = Rotary(rot, 10000.0)
    positions = torch.randint(0, 100_000, (tokens,), generator=g).to(DEV)
    cos, sin = rotary.cos_sin(positions, dtype)
    weights = [rnd(dim) * 0.1, rnd(dim) * 0.1, rnd(index_dim) * 0.1]
    n_rows = 4 * tokens + 8
    rows = torch.randperm(n_rows, generator=g)[:tokens].to(DEV)
    caches = [rnd(n_rows, kv_heads, dim), rnd(n_rows, kv_heads, dim), rnd(n_rows, index_dim)]
    want = [c.clone() for c in caches]
    want[0][rows] = _ref(k, weights[1], 1e-6, cos, sin)
    want[1][rows] = v
    want[2][rows] = ik
    q_out, iq_out = rows_mod.attention_rows(q, k, v, ((weights[0], 1e-6), (weights[1], 1e-6)), cos, sin, rows,
                                            caches[0], caches[1], (iq, ik, (weights[2], 1e-5), caches[2]))
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=2e-2)
    torch.testing.assert_close(q_out, _ref(q, weights[0], 1e-6, cos, sin), **tol)
    torch.testing.assert_close(iq_out, _ref(iq, weights[2], 1e-5, cos, sin), **tol)
    for got, ref in zip(caches, want, strict=True):
        torch.testing.assert_close(got, ref, **tol)
    assert torch.equal(caches[1], want[1]) and torch.equal(caches[2], want[2])  # copies


def _blocks_case(rows_mod, blocks, ratio, dim, rot, dtype, seed, mrope=False):
    g = torch.Generator().manual_seed(seed)
    n_rows = blocks * ratio + 16
    ik_cache = torch.randn(n_rows, dim, generator=g).to(DEV, dtype)
    new_rows = torch.randperm(n_rows, generator=g)[:blocks * ratio].view(blocks, ratio).to(DEV)
    if mrope:  # (frame, row, column) positions, each axis its own: a view of the batch's upload, as images give
        new_pos = torch.randint(0, 100_000, (3 * blocks + 5,), generator=g).to(DEV)[5:].view(3, blocks)
    else:  # a column of a wider tensor, as ``forward_batch._qsa_blocks`` hands it
        new_pos = torch.randint(0, 100_000, (blocks, 3), generator=g).to(DEV)[:, 1]
    weight = (torch.randn(dim, generator=g) * 0.1).to(DEV, dtype)
    # Sections that leave every axis some frequencies at these widths (16 pairs: 0 frame, 1 row, 2 column ...).
    rotary = Rotary(rot, 1e7, (rot // 8, rot // 8, rot // 8)) if mrope else Rotary(rot, 1e7)
    out = torch.randn(n_rows, dim, generator=g).to(DEV, dtype)
    want = out.clone()
    # QSAIndexer.write_block_keys' torch path, op by op.
    pooled = ik_cache[new_rows].float().mean(dim=1).to(dtype)
    cos, sin = rotary.cos_sin(new_pos, dtype)
    want[new_rows[:, -1]] = _ref(pooled[:, None], weight, 1e-6, cos, sin)[:, 0]
    rows_mod.qsa_block_keys(ik_cache, new_rows, new_pos, weight, 1e-6, rotary.inv_freq(ik_cache.device), out,
                            rotary.axis(ik_cache.device) if mrope else None)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=2e-2)
    torch.testing.assert_close(out, want, **tol)


@pytest.mark.parametrize("tokens,heads,kv_heads,dim,rot,index", [(3, 4, 2, 32, 16, (4, 32)), (5, 3, 1, 24, 8, (2, 16)),
                                                                  (1, 2, 2, 16, 16, (1, 16))])
def test_attention_rows_match_the_torch_ops(rows_mod, tokens, heads, kv_heads, dim, rot, index):
    """Head counts and widths not powers of two, rotary over part of a head or all of it."""
    _case(rows_mod, tokens, heads, kv_heads, dim, rot, index, torch.float32, seed=tokens)


@pytest.mark.parametrize("mrope", [False, True])
@pytest.mark.parametrize("blocks,ratio,dim,rot", [(3, 8, 32, 16), (2, 6, 24, 8), (1, 1, 16, 16)])
def test_qsa_block_keys_match_the_torch_ops(rows_mod, blocks, ratio, dim, rot, mrope):
    """Block positions in one axis, or (frame, row, column) positions of image blocks."""
    _blocks_case(rows_mod, blocks, ratio, dim, rot, torch.float32, seed=blocks, mrope=mrope)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 32, 300])
def test_attention_rows_gpu(rows_mod, dtype, tokens):
    """The bench model's attention layer: 16 heads of 256 (rotary over 64), 2 KV heads, 16 index heads of 128."""
    _case(rows_mod, tokens, 16, 2, 256, 64, (16, 128), dtype, seed=tokens)
    _blocks_case(rows_mod, tokens, 64, 128, 64, dtype, seed=tokens)
    _blocks_case(rows_mod, tokens, 64, 128, 64, dtype, seed=tokens, mrope=True)


@pytest.mark.gpu
def test_the_model_takes_the_kernels_gpu(same_ids_as_torch_ops):
    """The tiny model's greedy ids with this module's kernels and the decode prologue, against both sent to
    their torch ops."""
    same_ids_as_torch_ops("norm_rotary,decode_prep")
