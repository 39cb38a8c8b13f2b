"""Paged attention: Triton kernel vs torch reference vs a plain per-query loop.

Without CUDA the kernels run under ``TRITON_INTERPRET=1`` (set before triton is imported) in float32
only, since the interpreter computes bf16 dots wrongly. With CUDA the same small cases run compiled,
and the ``gpu`` tests add the model's shapes in bf16 and fp32.

Tolerances (max abs error over the output, relative to ``max(1, max |reference|)``):
fp32 kernel vs reference and reference vs the float64 loop: 1e-5 (both accumulate in fp32 over at
most a few hundred keys here); GPU fp32 at model shapes: 2e-5; GPU bf16: 2e-2 (bf16 inputs, bf16
probabilities in the P @ V dot, bf16 output rounding).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from tidal.kernels.attention import paged_attention_ref  # noqa: E402
from tidal.kernels.attention_triton import paged_attention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_case(lengths: list[int], prefixes: list[int], *, heads: int, kv_heads: int, head_dim: int,
              page_size: int, dtype: torch.dtype, device: str, seed: int, ratio: int = 0, topk: int = 0) -> dict:
    """Packed segments over a cache whose pages are a random permutation; unused cache rows hold NaN."""
    gen = torch.Generator().manual_seed(seed)
    kv_lens = [p + n for p, n in zip(prefixes, lengths, strict=True)]
    pages_per = [-(-kv // page_size) for kv in kv_lens]
    num_pages = sum(pages_per) + 3
    perm = torch.randperm(num_pages, generator=gen)
    max_pages = max(pages_per) + 1
    page_table = torch.zeros(len(lengths), max_pages, dtype=torch.int32)  # unused entries: page 0 (valid)
    k_cache = torch.full((num_pages, page_size, kv_heads, head_dim), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    used = 0
    for i, (kv, n_pages) in enumerate(zip(kv_lens, pages_per, strict=True)):
        ids = perm[used:used + n_pages]
        used += n_pages
        page_table[i, :n_pages] = ids
        pos = torch.arange(kv)
        k_cache[ids[pos // page_size], pos % page_size] = torch.randn(kv, kv_heads, head_dim, generator=gen)
        v_cache[ids[pos // page_size], pos % page_size] = torch.randn(kv, kv_heads, head_dim, generator=gen)
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    tokens = int(cu[-1])
    q = 1.5 * torch.randn(tokens, heads, head_dim, generator=gen)
    q_pos = torch.cat([torch.arange(kv - n, kv) for kv, n in zip(kv_lens, lengths, strict=True)])
    block_sel = random_block_sel(q_pos, ratio, topk, gen) if topk else None
    case = dict(q=q.to(dtype), k_cache=k_cache.to(dtype), v_cache=v_cache.to(dtype), page_table=page_table,
                cu_seqlens_q=cu, kv_lens=torch.tensor(kv_lens, dtype=torch.int32), block_sel=block_sel)
    case = {k: (v.to(device) if v is not None else None) for k, v in case.items()}
    case.update(scale=head_dim ** -0.5, qsa_ratio=ratio, max_seqlen_q=max(lengths))
    return case


def random_block_sel(q_pos: torch.Tensor, ratio: int, topk: int, gen: torch.Generator) -> torch.Tensor:
    """Per row, up to ``topk`` distinct complete blocks (at least one when any exists), -1 anywhere else."""
    n_complete = (q_pos + 1) // ratio
    width = max(int(n_complete.max()), topk)
    scores = torch.rand(q_pos.shape[0], width, generator=gen)
    scores[torch.arange(width).unsqueeze(0) >= n_complete.unsqueeze(1)] = -1.0
    vals, idx = scores.topk(topk, dim=1)
    idx[vals < 0] = -1
    drop = torch.rand(idx.shape, generator=gen) < 0.3
    drop[:, 0] = False  # keep the best pick so that no row is left without keys
    idx[drop] = -1
    order = torch.rand(idx.shape, generator=gen).argsort(dim=1)  # -1 entries at arbitrary positions
    return idx.gather(1, order).to(torch.int32)


def loop_attention(case: dict) -> torch.Tensor:
    """Independent oracle: for every query row, softmax over exactly its allowed key set (float64)."""
    q, k_cache, v_cache = (case[n].double().cpu() for n in ("q", "k_cache", "v_cache"))
    page_table, cu, kv_lens = (case[n].cpu().tolist() for n in ("page_table", "cu_seqlens_q", "kv_lens"))
    sel = case["block_sel"].cpu().tolist() if case["block_sel"] is not None else None
    ratio, page_size = case["qsa_ratio"], k_cache.shape[1]
    group = q.shape[1] // k_cache.shape[2]
    out = torch.zeros_like(q)
    for i in range(len(kv_lens)):
        length = cu[i + 1] - cu[i]
        for j in range(length):
            row = cu[i] + j
            p = kv_lens[i] - length + j
            if sel is None:
                keys = list(range(p + 1))
            else:
                tail = (p + 1) // ratio * ratio
                chosen = {b * ratio + r for b in sel[row] if 0 <= b < tail // ratio for r in range(ratio)}
                keys = sorted(chosen | set(range(tail, p + 1)))
            pages = torch.tensor([page_table[i][key // page_size] for key in keys])
            offs = torch.tensor([key % page_size for key in keys])
            k = k_cache[pages, offs].repeat_interleave(group, dim=1)  # [n, H, D]
            v = v_cache[pages, offs].repeat_interleave(group, dim=1)
            scores = torch.einsum("hd,nhd->hn", q[row], k) * case["scale"]
            out[row] = torch.einsum("hn,nhd->hd", scores.softmax(dim=-1), v)
    return out


def max_rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double().cpu()
    return float((out.double().cpu() - ref).abs().max() / max(1.0, float(ref.abs().max())))


def output_gate(case: dict, seed: int) -> torch.Tensor:
    """A gate laid out as the layer's: the second half of each head's ``[q, gate]`` projection (a strided view)."""
    q = case["q"]
    gen = torch.Generator().manual_seed(seed)
    q_gate = 2 * torch.randn(q.shape[0], q.shape[1], 2 * q.shape[2], generator=gen)
    return q_gate.to(q.dtype).to(q.device)[..., q.shape[2]:]


def gated(out: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    """The oracle's output gate, in float64."""
    return out if gate is None else out * torch.sigmoid(gate.double().cpu())


def run_both(case: dict, num_splits: int | None = None, gate: torch.Tensor | None = None,
             **kw) -> tuple[torch.Tensor, torch.Tensor]:
    args = [case[n] for n in ("q", "k_cache", "v_cache", "page_table", "cu_seqlens_q", "kv_lens", "scale")]
    ref = paged_attention_ref(*args, block_sel=case["block_sel"], qsa_ratio=case["qsa_ratio"], gate=gate)
    out = paged_attention(*args, block_sel=case["block_sel"], qsa_ratio=case["qsa_ratio"], gate=gate,
                          max_seqlen_q=case["max_seqlen_q"], num_splits=num_splits, **kw)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out).all()
    return out, ref


# Dense mode: the 140-row segment spans several query tiles. QSA mode: fewer rows (the row kernel runs one
# interpreted program per row and kv head) but longer prefixes, so that rows have many complete blocks.
MIXED = dict(lengths=[1, 7, 33, 1, 50, 0, 140], prefixes=[5, 0, 19, 40, 45, 4, 62])
MIXED_QSA = dict(lengths=[1, 7, 33, 1, 50, 0, 12], prefixes=[5, 0, 19, 40, 70, 4, 90])


@pytest.mark.parametrize("head_dim,page_size,with_gate", [(16, 4, False), (32, 16, True), (24, 16, True)])
@pytest.mark.parametrize("selected", [False, True], ids=["dense", "qsa"])
def test_mixed_prefill_and_decode(head_dim: int, page_size: int, with_gate: bool, selected: bool) -> None:
    case = make_case(**(MIXED_QSA if selected else MIXED), heads=4, kv_heads=2, head_dim=head_dim,
                     page_size=page_size, dtype=torch.float32, device=DEVICE, seed=head_dim + page_size,
                     ratio=8 if selected else 0, topk=3 if selected else 0)
    gate = output_gate(case, seed=head_dim) if with_gate else None
    out, ref = run_both(case, gate=gate)
    assert max_rel_err(ref, gated(loop_attention(case), gate)) < 1e-5
    assert max_rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("ratio,tile_below,num_splits", [(8, 0, None), (8, 75, None), (8, 75, 3), (8, 10 ** 6, None),
                                                          (32, 150, None), (32, 10 ** 6, 3)])
def test_qsa_prompt_rows_tile_and_row_kernels(ratio: int, tile_below: int, num_splits: int | None) -> None:
    """QSA prompt rows below ``qsa_tile_below`` in the tile kernel (dense key tiles, the block mask: one byte a
    row when a key tile lies in one block, as ratio 32 with 32-key tiles here; a gathered mask otherwise), the
    others in the row kernel; 0 puts every row in the row kernel. Segments cross the boundary, and rows'
    selections include a block that is not complete for them (ignored) and empty entries. With forced key
    splits the merge must leave the tile kernel's rows alone."""
    case = make_case([1, 70, 1, 96, 33], [40, 50, 300, 130, 0], heads=4, kv_heads=2, head_dim=32, page_size=16,
                     dtype=torch.float32, device=DEVICE, seed=ratio + tile_below % 97, ratio=ratio, topk=3)
    cu, kv_lens = case["cu_seqlens_q"].cpu(), case["kv_lens"].cpu()
    q_pos = torch.cat([torch.arange(kv - n, kv) for kv, n in zip(kv_lens.tolist(), cu.diff().tolist(), strict=True)])
    gen = torch.Generator().manual_seed(4)
    late = ((q_pos + 1) // ratio + torch.randint(0, 3, q_pos.shape, generator=gen)).to(case["block_sel"])
    case["block_sel"] = torch.cat([case["block_sel"], late[:, None]], dim=1).contiguous()
    gate = output_gate(case, seed=ratio)
    out, ref = run_both(case, num_splits, gate, qsa_tile_below=tile_below)
    assert max_rel_err(ref, gated(loop_attention(case), gate)) < 1e-5
    assert max_rel_err(out, ref) < 1e-5


def test_qsa_tile_split_capped_by_block_count(monkeypatch) -> None:
    """The block mask has a byte per block and row, so the split moves earlier for small blocks: with room
    for 4 blocks of 8 keys, rows from position 32 on run in the row kernel, as with the split set at 32."""
    import tidal.kernels.attention_triton as attention_triton

    case = make_case([70, 1, 96], [50, 300, 0], heads=4, kv_heads=2, head_dim=16, page_size=16,
                     dtype=torch.float32, device=DEVICE, seed=21, ratio=8, topk=3)
    at_32, ref = run_both(case, qsa_tile_below=32)
    monkeypatch.setattr(attention_triton, "_QSA_TILE_MAX_BLOCKS", 4)
    capped, _ = run_both(case)
    assert torch.equal(capped, at_32)
    assert max_rel_err(capped, ref) < 1e-5


@pytest.mark.parametrize("selected", [False, True], ids=["dense", "qsa"])
def test_prompt_rows_do_not_depend_on_the_chunk(selected: bool) -> None:
    """A prompt row gives the same bits whether its forward holds the whole prompt (cold) or only a short
    last chunk of it (chunked prefill, or the rest after a prefix-cache hit): no key split whose merge
    would sum it in another order, however few rows the chunk has. Compiled (CUDA), bit for bit; under
    the CPU interpreter a dot is numpy's matmul, whose BLAS may round a row differently by its place in
    the tile on some CPUs, so there the rows agree to float32 rounding."""
    # QSA: 16 of up to 25 blocks plus the tail, 3 key tiles a row: room to split a short chunk's rows.
    case = make_case([48], [160], heads=4, kv_heads=2, head_dim=16, page_size=4, dtype=torch.float32,
                     device=DEVICE, seed=9, ratio=8 if selected else 0, topk=16 if selected else 0)
    args = [case[n] for n in ("q", "k_cache", "v_cache", "page_table")]
    whole = paged_attention(*args, case["cu_seqlens_q"], case["kv_lens"], case["scale"], block_sel=case["block_sel"],
                            qsa_ratio=case["qsa_ratio"], max_seqlen_q=48)
    for rows in (2, 5):  # the last rows as a chunk of their own, over the same cache
        sel = case["block_sel"][-rows:] if selected else None
        chunk = paged_attention(case["q"][-rows:], *args[1:], torch.tensor([0, rows], dtype=torch.int32, device=DEVICE),
                                case["kv_lens"], case["scale"], block_sel=sel, qsa_ratio=case["qsa_ratio"],
                                max_seqlen_q=rows)
        if DEVICE == "cuda":
            assert torch.equal(chunk, whole[-rows:])
        else:
            assert max_rel_err(chunk, whole[-rows:]) < 1e-6


@pytest.mark.parametrize("num_splits,with_gate", [(None, False), (1, True), (3, False), (3, True)])
@pytest.mark.parametrize("selected", [False, True], ids=["dense", "qsa"])
def test_decode_only(num_splits: int | None, with_gate: bool, selected: bool) -> None:
    contexts = [1, 9, 64, 100, 257]
    case = make_case([1] * 5, [c - 1 for c in contexts], heads=4, kv_heads=2, head_dim=16, page_size=16,
                     dtype=torch.float32, device=DEVICE, seed=7, ratio=8 if selected else 0,
                     topk=3 if selected else 0)
    gate = output_gate(case, seed=5) if with_gate else None
    out, ref = run_both(case, num_splits, gate)
    assert max_rel_err(ref, gated(loop_attention(case), gate)) < 1e-5
    assert max_rel_err(out, ref) < 1e-5


def test_equal_length_prefills_mha() -> None:
    """All segments of ``max_seqlen_q`` rows (the dispatcher skips the decode kernel) and one kv head per q head."""
    case = make_case([9, 9], [0, 30], heads=2, kv_heads=2, head_dim=32, page_size=4, dtype=torch.float32,
                     device=DEVICE, seed=3)
    out, ref = run_both(case)
    assert max_rel_err(ref, loop_attention(case)) < 1e-5
    assert max_rel_err(out, ref) < 1e-5


def model_case(dtype: torch.dtype, selected: bool) -> dict:
    """The model's shapes: a 2048-row prefill chunk after a 3000-token prefix plus 7 decodes."""
    contexts = [1, 17, 300, 1000, 2500, 6000, 9000]
    return make_case([2048] + [1] * 7, [3000] + [c - 1 for c in contexts], heads=16, kv_heads=2, head_dim=256,
                     page_size=16, dtype=dtype, device="cuda", seed=11, ratio=64 if selected else 0,
                     topk=32 if selected else 0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("selected", [False, True], ids=["dense", "qsa"])
def test_model_shapes_gpu(dtype: torch.dtype, tol: float, selected: bool) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    case = model_case(dtype, selected)
    out, ref = run_both(case)
    assert max_rel_err(out, ref) < tol
    if selected:  # the chunk's rows all in the row kernel, and split between the two kernels at position 4000
        for tile_below in (0, 4000):
            assert max_rel_err(run_both(case, qsa_tile_below=tile_below)[0], ref) < tol
    args = [case[n] for n in ("q", "k_cache", "v_cache", "page_table", "cu_seqlens_q", "kv_lens", "scale")]
    out_split = paged_attention(*args, block_sel=case["block_sel"], qsa_ratio=case["qsa_ratio"],
                                max_seqlen_q=case["max_seqlen_q"], num_splits=5)
    assert max_rel_err(out_split, ref) < tol
    # The output gate as the layer passes it: fused into the kernels' stores, rounded as torch rounds.
    gate = output_gate(case, seed=12)
    for splits in (None, 5):
        gated_out = paged_attention(*args, block_sel=case["block_sel"], qsa_ratio=case["qsa_ratio"], gate=gate,
                                    max_seqlen_q=case["max_seqlen_q"], num_splits=splits)
        expect = (out if splits is None else out_split) * torch.sigmoid(gate)
        assert max_rel_err(gated_out, expect) < (1e-6 if dtype == torch.float32 else 1e-2)
