"""NVFP4 routed experts read packed (``kernels/moe_nvfp4_triton``) against the torch reference: the experts
dequantized by ``kernels/quant.dequantize_nvfp4`` and computed by the per-expert loop.

Without a GPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, fp32, small shapes); the
``gpu``-marked tests take the bench and flash-next expert shapes in bf16.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton")

from tidal.kernels import moe_nvfp4_triton  # noqa: E402
from tidal.kernels.moe import fused_experts_nvfp4, fused_experts_ref  # noqa: E402
from tidal.kernels.moe_triton import GemmConfig  # noqa: E402
from tidal.kernels.quant import Nvfp4, quantize_nvfp4  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def quantized(experts: int, rows: int, cols: int, seed: int, parts: int = 1) -> Nvfp4:
    """``experts`` random matrices in NVFP4, drawn on the test's device; each of ``parts`` row blocks its own global
    scale (gate and up)."""
    gen = torch.Generator(DEV).manual_seed(seed)
    w = torch.randn(experts, rows, cols, generator=gen, device=DEV) / cols ** 0.5
    w[:, :, :16] *= 8  # some groups far larger than the rest: scales spread over the e4m3 range
    amax = w.unflatten(1, (parts, -1)).abs().amax(dim=(-2, -1), keepdim=True)  # [E, parts, 1, 1]
    scale_2 = (amax / (6.0 * 448.0)).expand(-1, -1, rows // parts, 1).reshape(experts, rows, 1).contiguous()
    packed, scale, _ = quantize_nvfp4(w, scale_2)
    return Nvfp4(packed, scale, scale_2)


def case(tokens: int, top_k: int, experts: int, hidden: int, inter: int, dtype=torch.float32, seed: int = 0,
         empty: tuple[int, ...] = ()):
    """Routing with a hot expert in every token and the ``empty`` experts in none."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(DEV, dtype)
    pool = torch.tensor([e for e in range(experts) if e != 0 and e not in empty])
    rest = torch.stack([pool[torch.randperm(len(pool), generator=g)[:top_k - 1]] for _ in range(tokens)])
    ids = torch.cat([torch.zeros(tokens, 1, dtype=torch.long), rest], dim=1).to(DEV)
    weights = torch.rand(tokens, top_k, generator=g) + 0.1
    weights = (weights / weights.sum(-1, keepdim=True)).to(DEV, dtype)
    gate_up = quantized(experts, 2 * inter, hidden, seed, parts=2)
    return x, ids, weights, gate_up, quantized(experts, hidden, inter, seed + 1)


def sorted_rows(ids: torch.Tensor, experts: int):
    sorted_ids, order = torch.sort(ids.flatten(), stable=True)
    ends = torch.searchsorted(sorted_ids, torch.arange(experts, device=ids.device), right=True, out_int32=True)
    return sorted_ids, order, ends


SMALL = (16, GemmConfig(16, 32, 4, 2))
# The PTX decode runs on CUDA only (the interpreter runs no PTX).
ASM = [False, True] if torch.cuda.is_available() else [False]


@pytest.mark.parametrize("interleave,asm,tma,gathered,swap,words", [
    *[(True, a, True, False, s, False) for a in ASM for s in (True, False)],
    (True, False, True, True, True, False), (True, False, False, False, True, False),
    (True, False, False, False, False, False), (False, False, False, False, False, False),
    *[(True, a, True, True, True, True) for a in ASM]])
@pytest.mark.parametrize("tokens,top_k", [(1, 2), (5, 3), (37, 3)])
@pytest.mark.parametrize("hidden,inter,config", [
    (64, 32, SMALL),
    (48, 48, (16, GemmConfig(32, 64, 4, 2))),  # masked last K tile and last column tile
    (192, 64, (16, GemmConfig(16, 128, 4, 2))),  # word tiles: K in chunks of 64, a last K tile of one chunk
])
def test_sorted_gate_up_and_down_equal_the_dequantized_experts(tokens, top_k, hidden, inter, config, interleave, asm,
                                                                tma, gathered, swap, words):
    """Both ways of feeding the MMA (one over the interleaved tile, two over even and odd columns), the interleaved
    tile decoded by Triton's operations and (on CUDA) by PTX, its bytes copied by a tensor descriptor (where rows
    are 16-byte aligned: not at hidden 48) or by pointer, or as 32-bit words (where K comes in chunks of 64); the
    rows gathered inside the GEMM or copied first; the weight tile as the MMA's first operand (the output
    transposed) or its second."""
    x, ids, _, gate_up, down = case(tokens, top_k, 8, hidden, inter, empty=(6, 7))
    sorted_ids, order, ends = sorted_rows(ids, 8)
    w = gate_up.dequantize()
    h = torch.stack([x[t // top_k] @ w[e].T for t, e in zip(order.tolist(), sorted_ids.tolist(), strict=True)])
    ref = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
    act = moe_nvfp4_triton.sorted_gate_up_nvfp4(x, order, ends, *gate_up, top_k, config, interleave, asm, tma,
                                                gathered, swap, words)
    torch.testing.assert_close(act, ref, atol=1e-4, rtol=1e-4)  # fp32, summed in another order
    d = down.dequantize()
    ref_down = torch.stack([act[i] @ d[e].T for i, e in enumerate(sorted_ids.tolist())])
    out = moe_nvfp4_triton.sorted_down_nvfp4(act, ends, *down, config, interleave, asm, tma, swap, words)
    torch.testing.assert_close(out, ref_down, atol=1e-4, rtol=1e-4)


def test_word_order_between_the_passes():
    """``permute_k`` and its inverse undo each other; the gate_up pass writes its columns where ``permute_k`` puts
    them (the same values), and the down pass reads that order as it is, to the bit, on word tiles and on byte tiles
    (which take the columns back first)."""
    x = torch.randn(3, 5, 192)
    assert torch.equal(moe_nvfp4_triton.permute_k(moe_nvfp4_triton.permute_k(x), inverse=True), x)
    assert not torch.equal(moe_nvfp4_triton.permute_k(x), x)
    x, ids, _, gate_up, down = case(9, 3, 8, 128, 64, empty=(6, 7))
    _, order, ends = sorted_rows(ids, 8)
    for block_n in (64, 16):  # whole chunks reordered in registers, or columns stored where they go
        config = (16, GemmConfig(block_n, 64, 4, 2))
        act = moe_nvfp4_triton.sorted_gate_up_nvfp4(x, order, ends, *gate_up, 3, config)
        permuted = moe_nvfp4_triton.sorted_gate_up_nvfp4(x, order, ends, *gate_up, 3, config, permute_out=True)
        assert torch.equal(permuted, moe_nvfp4_triton.permute_k(act))
    for words in (True, False):
        out = moe_nvfp4_triton.sorted_down_nvfp4(act, ends, *down, config, words=words)
        assert torch.equal(moe_nvfp4_triton.sorted_down_nvfp4(permuted, ends, *down, config, words=words,
                                                              permuted=True), out)
    with pytest.raises(ValueError, match="multiple of 64"):
        moe_nvfp4_triton.sorted_gate_up_nvfp4(x, order, ends, *case(9, 3, 8, 128, 48)[3], 3, permute_out=True)


E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _ptx(text: str, regs: dict[str, int]) -> dict[str, tuple[float, float]]:
    """The integer and ``bf16x2`` instructions of a PTX block run on Python ints: the bf16 pairs each
    ``mul.rn.bf16x2`` writes (as floats, exact for these products)."""
    out = {}

    def val(arg: str) -> int:
        return int(arg, 16) if arg.startswith("0x") else int(arg) if arg.isdigit() else regs[arg]

    def bf16(bits: int) -> float:
        return torch.tensor([bits << 16], dtype=torch.int64).to(torch.int32).view(torch.float32).item()

    for line in text.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        d, *a = (x.strip() for x in args.split(","))
        if op == "prmt.b32":  # default mode: each selector nibble picks one of the 8 bytes of (a, b)
            pool = [(val(a[0]) >> 8 * i) & 255 for i in range(4)] + [(val(a[1]) >> 8 * i) & 255 for i in range(4)]
            regs[d] = sum(pool[(val(a[2]) >> 4 * i) & 7] << 8 * i for i in range(4))
        elif op == "shl.b32":
            regs[d] = (val(a[0]) << val(a[1])) & 0xFFFFFFFF
        elif op == "shr.b32":
            regs[d] = val(a[0]) >> val(a[1])
        elif op in ("and.b32", "or.b32"):
            regs[d] = val(a[0]) & val(a[1]) if op == "and.b32" else val(a[0]) | val(a[1])
        elif op == "mul.rn.bf16x2":
            x, s = val(a[0]), val(a[1])
            out[d] = (bf16(x & 0xFFFF) * bf16(s & 0xFFFF), bf16(x >> 16) * bf16(s >> 16))
        else:
            raise AssertionError(f"no emulation of {op}")
    return out


def test_word_decode_ptx_gives_each_code_times_its_scale():
    """:func:`fp4_words_asm`'s PTX (``WORDS_PTX``, which only CUDA runs) emulated instruction by instruction on
    random words and e4m3 scales (subnormal ones included): output ``j`` holds code ``j`` of the first word and of
    the second, times the scale, times 2^-8, the codes read from the e2m1 table."""
    body = moe_nvfp4_triton.WORDS_PTX.value
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        w0, w1 = (int(v) for v in torch.randint(0, 2 ** 32, (2,), generator=g))
        scale = torch.randint(1, 0x7F, (1,), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn).item()
        s = torch.tensor([scale * 2.0 ** 118]).bfloat16().view(torch.int16).item() & 0xFFFF
        out = _ptx(body, {"$8": w0, "$9": w1, "$10": s | s << 16})
        for j in range(8):
            for half, w in enumerate((w0, w1)):
                code = (w >> 4 * j) & 15
                want = (-1.0 if code & 8 else 1.0) * E2M1[code & 7] * scale * 2.0 ** -8
                assert out[f"${j}"][half] == want, (j, half, code)


@pytest.mark.parametrize("tokens", [1, 19])
def test_fused_experts_nvfp4_equals_the_loop(tokens):
    """The dispatcher on the kernels' path (the interpreter on the CPU) against the per-expert loop over the
    dequantized experts; 7 experts (one empty) and a shared expert added."""
    x, ids, weights, gate_up, down = case(tokens, 3, 7, 64, 32, empty=(5,))
    shared = (torch.randn_like(x), torch.rand(tokens, 1, device=DEV))
    ref = fused_experts_ref(x, ids, weights, gate_up.dequantize(), down.dequantize()) + shared[1] * shared[0]
    out = moe_nvfp4_triton.fused_experts_nvfp4_triton(x, ids, weights, gate_up, down, shared)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)  # fp32 sums in another order, two GEMMs deep


def test_one_program_sort_gives_the_bits_of_the_torch_sort(monkeypatch):
    """A small batch sorted in one launch (``sort_assignments``) and through torch's sort: the same output bits."""
    x, ids, weights, gate_up, down = case(19, 3, 7, 64, 32, empty=(5,))
    one = moe_nvfp4_triton.fused_experts_nvfp4_triton(x, ids, weights, gate_up, down)
    monkeypatch.setattr(moe_nvfp4_triton, "SORT_MAX", 0)
    assert torch.equal(moe_nvfp4_triton.fused_experts_nvfp4_triton(x, ids, weights, gate_up, down), one)


def test_an_expert_cache_of_more_slots_than_a_grouped_gemm_call_takes():
    """1,100 experts (an offloaded layer reads the whole expert cache in place; torch's grouped GEMM takes at most
    1,023 groups a call): the rows of experts past the first 1,024 come out as the loop computes them."""
    experts = 1100
    g = torch.Generator().manual_seed(3)
    x = torch.randn(40, 64, generator=g).to(DEV)
    ids = torch.stack([torch.randperm(experts, generator=g)[:3] for _ in range(40)])
    ids[:8, 0] = torch.arange(1090, 1098)  # some rows at the far end
    ids = ids.to(DEV)
    weights = torch.softmax(torch.randn(40, 3, generator=g), -1).to(DEV)
    gate_up, down = quantized(experts, 64, 64, 5, parts=2), quantized(experts, 64, 32, 6)
    ref = fused_experts_ref(x, ids, weights, gate_up.dequantize(), down.dequantize())
    out = moe_nvfp4_triton.fused_experts_nvfp4_triton(x, ids, weights, gate_up, down)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kernels", [True, False])
def test_no_rows(kernels):
    x, ids, weights, gate_up, down = case(1, 2, 4, 64, 32)
    run = moe_nvfp4_triton.fused_experts_nvfp4_triton if kernels else fused_experts_nvfp4
    out = run(x[:0], ids[:0], weights[:0], gate_up, down)
    assert out.shape == (0, 64)


def test_rows_not_a_multiple_of_16_are_refused():
    x, ids, _, gate_up, _ = case(2, 2, 4, 64, 32)
    _, order, ends = sorted_rows(ids, 4)
    with pytest.raises(ValueError, match="multiple of 16"):
        moe_nvfp4_triton.sorted_gate_up_nvfp4(x[:, :40].contiguous(), order, ends, *gate_up, 2)


@pytest.mark.parametrize("asm", ASM)
@pytest.mark.parametrize("with_shared", [True, False])
def test_moe_gemv_reads_nvfp4_experts(with_shared, asm, monkeypatch):
    """The decode GEMVs over NVFP4 routed experts (the shared expert dense, wider than the routed ones) against
    the loop over the dequantized experts; the default tiles (a K tile past the 80-wide reduction) and small ones;
    codes decoded by Triton's operations and by PTX."""
    from tidal.kernels import moe_decode_triton
    from tidal.kernels.moe_decode_triton import GemvConfig, moe_gemv

    monkeypatch.setattr(moe_decode_triton, "FP4_ASM", asm)

    x, ids, weights, gate_up, down = case(3, 3, 8, 80, 32, seed=4)
    g = torch.Generator().manual_seed(1)
    s_gu, s_d, s_g = (torch.randn(*shape, generator=g).to(DEV) / 8 for shape in ((96, 80), (80, 48), (1, 80)))
    shared = (s_gu, s_d, s_g) if with_shared else None
    ref = fused_experts_ref(x, ids, weights, gate_up.dequantize(), down.dequantize())
    if with_shared:
        gate, up = (x @ s_gu.T).chunk(2, dim=-1)
        ref = ref + torch.sigmoid(x @ s_g.T) * ((torch.nn.functional.silu(gate) * up) @ s_d.T)
    for cfg in (None, (GemvConfig(16, 32, 4), GemvConfig(8, 16, 4))):
        out = moe_gemv(x, ids, weights, gate_up, down, shared, configs=cfg)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.parametrize("asm", ASM)
def test_moe_gemv_reads_bf16_activations_as_column_pairs(asm, monkeypatch):
    """bf16 activations, which the NVFP4 GEMVs read a (even, odd) column pair a 32-bit word: against the float32
    loop over the same bf16 inputs and the dequantized experts, within the bf16 rounding of the activation between
    the two GEMVs and of the output; the default tiles and small ones."""
    from tidal.kernels import moe_decode_triton
    from tidal.kernels.moe_decode_triton import GemvConfig, moe_gemv

    monkeypatch.setattr(moe_decode_triton, "FP4_ASM", asm)
    x, ids, weights, gate_up, down = case(3, 3, 8, 80, 48, dtype=torch.bfloat16, seed=5)
    ref = fused_experts_ref(x.float(), ids, weights.float(), gate_up.dequantize(), down.dequantize())
    for cfg in (None, (GemvConfig(16, 32, 4), GemvConfig(8, 16, 4))):
        out = moe_gemv(x, ids, weights, gate_up, down, configs=cfg)
        assert out.dtype == torch.bfloat16
        assert _rel(out, ref) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 37, 4099])
@pytest.mark.parametrize("shape", [(512, 10, 2048, 512), (512, 10, 2560, 640), (512, 10, 2048, 128)])
def test_bench_and_flash_next_expert_shapes_gpu(tokens, shape):
    """bf16 activations at the bench shapes (512 experts, top-10, hidden 2048, intermediate 512), flash-next's
    (hidden 2560, intermediate 640: no power of two) and an intermediate of 128 (an expert's slice under tensor
    parallelism): within bf16's rounding of the reference, which rounds every dequantized weight to bf16 where the
    kernels keep ``code * scale`` exact."""
    experts, top_k, hidden, inter = shape
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=g).to(DEV, torch.bfloat16)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)]).to(DEV)
    weights = torch.softmax(torch.randn(tokens, top_k, generator=g), -1).to(DEV, torch.bfloat16)
    gate_up, down = quantized(experts, 2 * inter, hidden, 0, parts=2), quantized(experts, hidden, inter, 1)
    out = fused_experts_nvfp4(x, ids, weights, gate_up, down)
    from tidal.kernels.moe import fused_experts

    ref = fused_experts(x, ids, weights, gate_up.dequantize(torch.bfloat16), down.dequantize(torch.bfloat16))
    assert _rel(out, ref) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8, 32])
@pytest.mark.parametrize("hidden,inter", [(2048, 512), (2560, 640)])
def test_moe_gemv_nvfp4_bench_shapes_gpu(tokens, hidden, inter):
    """The decode GEMVs over NVFP4 experts at the bench and flash-next shapes, bf16, against the grouped path's
    reference over the dequantized experts."""
    from tidal.kernels.moe import fused_experts
    from tidal.kernels.moe_decode_triton import moe_gemv

    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=g).to(DEV, torch.bfloat16)
    ids = torch.stack([torch.randperm(512, generator=g)[:10] for _ in range(tokens)]).to(DEV)
    weights = torch.softmax(torch.randn(tokens, 10, generator=g), -1).to(DEV, torch.bfloat16)
    gate_up, down = quantized(512, 2 * inter, hidden, 0, parts=2), quantized(512, hidden, inter, 1)
    out = moe_gemv(x, ids, weights, gate_up, down)
    ref = fused_experts(x, ids, weights, gate_up.dequantize(torch.bfloat16), down.dequantize(torch.bfloat16))
    assert _rel(out, ref) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [3, 32, 100])
def test_decode_tiles_give_a_row_the_bits_of_the_prefill_tiles_gpu(tokens, monkeypatch):
    """flash-next's expert shapes in bf16: a decode-sized batch through ``DECODE_CONFIG``'s 16-row tiles gives
    every row the bits the prefill tiles give it."""
    g = torch.Generator().manual_seed(tokens)
    experts, top_k, hidden, inter = 512, 10, 2560, 640
    x = torch.randn(tokens, hidden, generator=g).to(DEV, torch.bfloat16)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)]).to(DEV)
    weights = torch.softmax(torch.randn(tokens, top_k, generator=g), -1).to(DEV, torch.bfloat16)
    gate_up, down = quantized(experts, 2 * inter, hidden, 0, parts=2), quantized(experts, hidden, inter, 1)
    assert tokens * top_k <= moe_nvfp4_triton.DECODE_ROWS * experts
    decode_tiles = moe_nvfp4_triton.fused_experts_nvfp4_triton(x, ids, weights, gate_up, down)
    monkeypatch.setattr(moe_nvfp4_triton, "DECODE_ROWS", 0)
    assert torch.equal(moe_nvfp4_triton.fused_experts_nvfp4_triton(x, ids, weights, gate_up, down), decode_tiles)
