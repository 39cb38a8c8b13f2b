"""NVFP4 routed experts read in their stored format (W4A16): the grouped GEMMs over expert-sorted rows.

Imported only for CUDA tensors (and on the CPU by the tests, under ``TRITON_INTERPRET=1``).

The weights stay as loaded (:mod:`tidal.kernels.quant`'s layout): ``packed`` uint8 ``[E, R, C/2]`` (two e2m1
codes a byte, the even column in the low nibble), ``scale`` e4m3 ``[E, R, C/16]``, ``scale_2`` fp32 ``[E, R, 1]``
(one global scale per row). A program copies a tile of packed bytes (by tensor descriptor, :data:`TMA`; as 32-bit
words where K comes in chunks of 64, :data:`WORDS`) and the scale byte of each group (one K tile ahead), decodes both
in registers (:func:`fp4_tile`, :func:`fp4_words`: ``code * scale`` is exact in bf16, by PTX, :data:`ASM`; in fp16
by Triton's operations) and feeds the activations' dtype to the tensor cores:
the scale tile is widened to its bytes and each byte's two values joined in column order (:data:`INTERLEAVE`), or
the even and odd columns of the byte tile are two MMAs of half the K tile against the activations' even and odd
columns (the reduction does not depend on the order of K). The decoded tile is the MMA's first operand (:data:`SWAP`:
``out.T = W @ rows.T``), which Hopper's wgmma reads from registers while the rows' tile waits in shared memory: the
decoded tile is never stored to shared memory (ptxas still waits for each of gate_up's wgmmas before the next tile is
decoded; down's run while the next tile is decoded). ``scale_2`` is constant along K and multiplies the fp32
accumulator in the epilogue (with the power of two the decoded values are short of, :func:`fp4_unscale`).

- :func:`sorted_gate_up_nvfp4`: the rows taken through the expert sort (copied in that order first,
  :data:`GATHERED`, or gathered inside), gate and up tiles side by side, ``silu(gate) * up`` in the epilogue (the
  bf16 path's :func:`~tidal.kernels.moe_triton.sorted_gate_up`).
- :func:`sorted_down_nvfp4`: the activations (already in expert order) times each expert's ``down``.

The rows of both are found as in ``sorted_gate_up``: row tiles of one expert each, from where each expert's run
ends; no host sync, no padding copy. Word tiles hold K in :func:`permute_k`'s order: gate_up gathers its rows from a
copy of ``x`` in that order and writes its output in it, which down reads as it is.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .moe_triton import SORT_MAX, GemmConfig, combine, expert_tile, max_tiles, sort_assignments, tile_ends
from .quant import NVFP4_GROUP, Nvfp4

# (block_m, config) of each pass; block_k counts values (half as many bytes). The fastest of `tools/tune_moe.py
# --quantization nvfp4`'s sweep with the decoded tile from registers (:data:`SWAP`) at 4,096 and 32,768 tokens, at
# the bench shapes and at flash-next's (hidden 2,560, intermediate 640).
GATE_UP_CONFIG: tuple[int, GemmConfig] = (128, GemmConfig(64, 128, 4, 3))
DOWN_CONFIG: tuple[int, GemmConfig] = (128, GemmConfig(128, 64, 8, 4))
# Both passes' tiles where the rows average at most DECODE_ROWS an expert (decode batches: 32 tokens of top-10 over
# 512 experts reach about 240 of them): 16 rows a tile, the swapped MMA's narrowest N. A row's sums do not depend on
# the tiles (each output accumulates its K in 16-wide MMA steps in order, whatever the tile), so a decode row
# computes as it would in a prompt's forward.
DECODE_CONFIG: tuple[int, GemmConfig] = (16, GemmConfig(128, 128, 4, 3))
DECODE_ROWS = 2
# One MMA over each weight tile in column order (the scale tile widened and the even and odd values joined in
# registers), rather than two over its even and odd columns against activations loaded with a stride of 2.
INTERLEAVE = True
# Interleaved weight tiles copied by the tensor memory accelerator (a descriptor of the packed bytes; the scales by
# pointer), rather than by pointer: no tensor of per-byte pointers in registers.
TMA = True
# The gate_up pass's rows copied in expert order first (one gather of ``[A, H]``), so its activation tiles are
# copied by a tensor descriptor too, rather than gathered by pointer inside the GEMM (no tensor of row pointers held
# in registers through the K loop).
GATHERED = True
# Interleaved tiles decoded by PTX on packed registers (:func:`fp4_asm`) rather than by Triton's per-value
# integer operations; never under Triton's interpreter, which runs no PTX.
ASM = True
# The decoded weight tile as the MMA's first operand (``out.T = W @ rows.T``, the rows' tile the second, from shared
# memory): Hopper's wgmma reads that operand from registers, so the decoded tile is never written to shared memory
# (down's MMAs then also run while the next tile is decoded; ptxas serializes gate_up's two, its C7513 note). The
# other way round the tile is stored to shared memory first and each MMA is waited for before the next tile is
# decoded. Interleaved tiles only.
SWAP = True
# Swapped weight tiles copied as 32-bit words (eight codes each) and decoded two words at a time (:func:`fp4_words`),
# in an order of K in which each thread's words are the MMA operand's values (:func:`permute_k`; the activations
# follow it): one shared-memory load a word and no byte permutes to assemble it, where byte tiles load each
# thread's bytes one by one. Where K is a multiple of :data:`K_CHUNK` and the tiles are copied by descriptor.
WORDS = True


def use_asm(asm: bool | None) -> bool:
    """Whether a launch decodes by :func:`fp4_asm`: ``asm`` (default :data:`ASM`), and not in the interpreter."""
    return (ASM if asm is None else asm) and os.environ.get("TRITON_INTERPRET") != "1"


# The decoded values are 2^-14 times their true size (see :func:`fp4_pairs`): the epilogues multiply it back with
# the global scale.
FP4_UNSCALE = tl.constexpr(16384.0)


@triton.jit
def fp4_pairs(q_ptrs, s_ptrs, mask):
    """A tile of packed bytes (``q_ptrs``) and the scale byte of each byte's group (``s_ptrs``) as fp16 ``code *
    scale * 2^-14``: ``(even columns, odd columns)``.

    An e2m1 code's sign, two exponent bits and mantissa bit, moved to an fp16's sign, the low two bits of its
    exponent and the top bit of its mantissa, are the code's value times 2^-14 (codes 0 and 1, exponent 0, become
    fp16 subnormals, which the hardware computes exactly): a few integer operations and no conversion. The e4m3
    scale converts in hardware. Each product is exact in fp16 (a multiple of 2^-24 under 0.17), and so is its
    conversion to bf16 or fp32 for the dot."""
    b = tl.load(q_ptrs, mask=mask, other=0).to(tl.uint16)
    s = tl.load(s_ptrs, mask=mask, other=0).to(tl.float8e4nv, bitcast=True).to(tl.float16)
    even = (((b & 7) << 9) | ((b & 8) << 12)).to(tl.float16, bitcast=True)
    odd = (((b & 0x70) << 5) | ((b & 0x80) << 8)).to(tl.float16, bitcast=True)
    return even * s, odd * s


# :func:`fp4_asm`'s values are bf16 ``code * scale * 2^-8``: the epilogues multiply it back with the global scale.
FP4_UNSCALE_ASM = tl.constexpr(256.0)
# The e4m3 scales are widened to bf16 times 2^118 (at most 448 * 2^118 < 2^127, bf16's largest power of two).
FP4_SCALE_BIAS = tl.constexpr(2.0 ** 118)


@triton.jit
def fp4_asm(b, s):
    """The codes of packed bytes ``b`` (uint8) times their scales ``s`` (bf16 ``scale * 2^118``, the shape of
    ``b``), four bytes (eight codes) at a time in PTX: ``(even values, odd values)`` as bf16 ``code * scale * 2^-8``.
    A byte permute spreads two bytes over the 16-bit halves of a register, masks and shifts move each code's sign to
    bit 15 and its two exponent bits and mantissa bit to the bottom of a bf16's exponent and the top of its mantissa
    (the code's value times 2^-126; codes 0 and 1 become bf16 subnormals), and one ``fma.rn.bf16x2`` scales two
    values exactly (at most 6 significant bits; subnormal inputs are kept)."""
    return tl.inline_asm_elementwise(
        asm="""
        {
        .reg .b32 z, nz, p0, p1, e0, e1, o0, o1, t;
        mov.b32 z, 0;
        mov.b32 nz, 0x80008000;
        prmt.b32 p0, $4, z, 0x4140;
        prmt.b32 p1, $4, z, 0x4342;
        and.b32 e0, p0, 0x00070007;
        shl.b32 e0, e0, 6;
        and.b32 t, p0, 0x00080008;
        shl.b32 t, t, 12;
        or.b32 e0, e0, t;
        and.b32 e1, p1, 0x00070007;
        shl.b32 e1, e1, 6;
        and.b32 t, p1, 0x00080008;
        shl.b32 t, t, 12;
        or.b32 e1, e1, t;
        and.b32 o0, p0, 0x00700070;
        shl.b32 o0, o0, 2;
        and.b32 t, p0, 0x00800080;
        shl.b32 t, t, 8;
        or.b32 o0, o0, t;
        and.b32 o1, p1, 0x00700070;
        shl.b32 o1, o1, 2;
        and.b32 t, p1, 0x00800080;
        shl.b32 t, t, 8;
        or.b32 o1, o1, t;
        fma.rn.bf16x2 $0, e0, $5, nz;
        fma.rn.bf16x2 $1, e1, $6, nz;
        fma.rn.bf16x2 $2, o0, $5, nz;
        fma.rn.bf16x2 $3, o1, $6, nz;
        }
        """,
        constraints="=r,=r,=r,=r,r,r,r", args=[b, s], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)


@triton.jit
def _fp4_scale_per(s, PER: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   ASM: tl.constexpr):
    """The e4m3 scale bytes ``s`` (``[BLOCK_N, BLOCK_K / GROUP]``) as fp16 (with ``ASM``: bf16 times
    :data:`FP4_SCALE_BIAS`), each repeated ``PER`` times along K: one a byte or a word of the group's codes."""
    s = s.to(tl.float8e4nv, bitcast=True)
    if ASM:
        s = (s.to(tl.float32) * FP4_SCALE_BIAS).to(tl.bfloat16)
    else:
        s = s.to(tl.float16)
    return tl.reshape(tl.broadcast_to(s[:, :, None], (BLOCK_N, BLOCK_K // GROUP, PER)),
                      (BLOCK_N, BLOCK_K // GROUP * PER))


@triton.jit
def fp4_tile(b, s, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ASM: tl.constexpr = False):
    """A tile of packed bytes ``b`` (uint8 ``[BLOCK_N, BLOCK_K / 2]``) and its e4m3 scale bytes ``s`` (``[BLOCK_N,
    BLOCK_K / GROUP]``) in column order, each byte's even and odd values joined: fp16 ``code * scale * 2^-14`` by
    Triton's operations (the scales converted in hardware and widened to the bytes in registers), or with ``ASM``
    (CUDA only) bf16 ``code * scale * 2^-8`` by :func:`fp4_asm`. :func:`fp4_unscale` gives the factor."""
    s = _fp4_scale_per(s, GROUP // 2, GROUP, BLOCK_N, BLOCK_K, ASM)
    if ASM:
        even, odd = fp4_asm(b, s)
    else:
        b = b.to(tl.uint16)
        even = (((b & 7) << 9) | ((b & 8) << 12)).to(tl.float16, bitcast=True) * s
        odd = (((b & 0x70) << 5) | ((b & 0x80) << 8)).to(tl.float16, bitcast=True) * s
    return tl.reshape(tl.join(even, odd), (BLOCK_N, BLOCK_K))


@triton.jit
def fp4_unscale(ASM: tl.constexpr):
    """What :func:`fp4_tile`'s values are to be multiplied by (with the global scale)."""
    if ASM:
        return FP4_UNSCALE_ASM
    return FP4_UNSCALE


@triton.jit
def fp4_scales(s_rows, rmask, k0, kdim, GROUP: tl.constexpr, BLOCK_K: tl.constexpr):
    """The scale bytes of columns ``k0 .. k0 + BLOCK_K`` of the rows whose scale bytes ``s_rows`` (``[BLOCK_N, 1]``
    pointers, ``rmask``) point to: ``[BLOCK_N, BLOCK_K / GROUP]``."""
    groups = tl.arange(0, BLOCK_K // GROUP)
    return tl.load(s_rows + k0 // GROUP + groups[None, :], mask=rmask[:, None] & (groups * GROUP < kdim - k0)[None, :],
                   other=0)


@triton.jit
def fp4_interleaved(q_rows, s, rmask, k0, kdim, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    ASM: tl.constexpr = False):
    """Columns ``k0 .. k0 + BLOCK_K`` of the NVFP4 rows whose packed bytes ``q_rows`` (``[BLOCK_N, 1]`` pointers,
    ``rmask`` the real rows; ``kdim`` values a row) points to and whose scale bytes there are ``s`` (from
    :func:`fp4_scales`), as :func:`fp4_tile` decodes them."""
    half = tl.arange(0, BLOCK_K // 2)
    b = tl.load(q_rows + k0 // 2 + half[None, :], mask=rmask[:, None] & (2 * half < kdim - k0)[None, :], other=0)
    return fp4_tile(b, s, GROUP, BLOCK_N, BLOCK_K, ASM)


# The span of K over which :func:`fp4_words` reorders columns: a thread's two words (16 values of one scale group)
# hold the MMA operand's columns ``8j + 2t + p`` of it.
K_CHUNK = 64
_K_CHUNK = tl.constexpr(K_CHUNK)


def permute_k(x: torch.Tensor, inverse: bool = False, rows: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` (last dim a multiple of :data:`K_CHUNK`) with its last dim in the order :func:`fp4_words` decodes
    weight columns in: position ``64c + 8j + 2t + p`` takes column ``64c + 16t + 8p + j`` (``inverse``: the other
    way). A copy; ``rows``: of those rows of ``x`` only (the gather and the reordering one copy)."""
    n = x.dim() + 3
    if inverse:  # [..., c, j, t, p] -> [..., c, t, p, j]
        view = x.unflatten(-1, (-1, 8, 4, 2)).permute(*range(n - 4), n - 4, n - 2, n - 1, n - 3)
    else:
        view = x.unflatten(-1, (-1, 4, 2, 8)).permute(*range(n - 4), n - 4, n - 1, n - 3, n - 2)
    return (view if rows is None else view.index_select(0, rows)).flatten(-4)


@triton.jit
def k_position(cols):
    """Where :func:`permute_k` puts column ``cols``."""
    c = cols % 64
    return cols - c + 8 * (c % 8) + 2 * (c // 16) + (c // 8) % 2


def _words_ptx() -> str:
    """:func:`fp4_words_asm`'s PTX: two byte permutes, then for each of the eight codes of a half word pair (code
    ``q`` of a half at bit ``4q``) its magnitude bits shifted to bits 6-8 and its sign to bit 15 of each bf16 half,
    joined, and scaled by ``$10``."""
    lines = ["{", ".reg .b32 lo, hi, m, g, t;", "prmt.b32 lo, $8, $9, 0x5410;", "prmt.b32 hi, $8, $9, 0x7632;"]
    for j in range(8):
        src, q = ("lo", "hi")[j // 4], j % 4
        mag = 6 - 4 * q  # the magnitude's shift to bits 6-8 (negative: right)
        lines += [f"shl.b32 m, {src}, {mag};" if mag > 0 else f"shr.b32 m, {src}, {-mag};",
                  "and.b32 m, m, 0x01C001C0;"]
        sign = 12 - 4 * q  # the sign's shift to bit 15
        lines += [f"shl.b32 g, {src}, {sign};", "and.b32 g, g, 0x80008000;"] if sign else [
            f"and.b32 g, {src}, 0x80008000;"]
        lines += ["or.b32 t, m, g;", f"mul.rn.bf16x2 ${j}, t, $10;"]
    return "\n".join([*lines, "}"])


WORDS_PTX = tl.constexpr(_words_ptx())


@triton.jit
def fp4_words_asm(w, s):
    """Codes of 32-bit words ``w`` (int32, eight codes each, the low nibble first) times their scales ``s`` (bf16
    ``scale * 2^118``, the shape of ``w``), two words at a time in PTX (:data:`WORDS_PTX`): eight bf16 tensors
    ``code * scale * 2^-8``, the ``j``-th of each word's ``j``-th code. Two byte permutes put the two words' low
    halves side by side and their high halves, then each code's magnitude bits are shifted to the bottom of a bf16's
    exponent and the top of its mantissa and its sign to bit 15 (as in :func:`fp4_asm`), two values a register, and
    one ``mul.rn.bf16x2`` scales both."""
    return tl.inline_asm_elementwise(
        asm=WORDS_PTX, constraints="=r,=r,=r,=r,=r,=r,=r,=r,r,r,r", args=[w, s], dtype=(tl.bfloat16,) * 8,
        is_pure=True, pack=2)


@triton.jit
def _fp4_code(w, SHIFT: tl.constexpr):
    """The code at bit ``SHIFT`` of words ``w`` as fp16 ``code * 2^-14`` (as :func:`fp4_pairs` decodes)."""
    n = (w >> SHIFT) & 15
    return (((n & 7) << 9) | ((n & 8) << 12)).to(tl.uint16).to(tl.float16, bitcast=True)


@triton.jit
def fp4_words(w, s, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ASM: tl.constexpr = False):
    """A tile of packed words ``w`` (int32 ``[BLOCK_N, BLOCK_K / 8]``, a word the codes of eight consecutive columns)
    and its e4m3 scale bytes ``s`` (``[BLOCK_N, BLOCK_K / GROUP]``) as ``[BLOCK_N, BLOCK_K]`` in :func:`permute_k`'s
    order of K: fp16 ``code * scale * 2^-14`` by Triton's operations, or with ``ASM`` (CUDA only) bf16 ``code *
    scale * 2^-8`` by :func:`fp4_words_asm` (:func:`fp4_unscale` gives the factor). In that order the values of
    two consecutive words (one scale group) are the values of the MMA operand one thread holds."""
    s = _fp4_scale_per(s, GROUP // 8, GROUP, BLOCK_N, BLOCK_K, ASM)
    if ASM:
        v0, v1, v2, v3, v4, v5, v6, v7 = fp4_words_asm(w, s)
    else:
        v0, v1, v2, v3 = _fp4_code(w, 0) * s, _fp4_code(w, 4) * s, _fp4_code(w, 8) * s, _fp4_code(w, 12) * s
        v4, v5, v6, v7 = _fp4_code(w, 16) * s, _fp4_code(w, 20) * s, _fp4_code(w, 24) * s, _fp4_code(w, 28) * s
    # [n, word, 2, 2, 2]: the last three dims the bits of j (4, 2, 1), v_j the j-th code of each word
    v = tl.join(tl.join(tl.join(v0, v4), tl.join(v2, v6)), tl.join(tl.join(v1, v5), tl.join(v3, v7)))
    v = tl.reshape(v, (BLOCK_N, BLOCK_K // _K_CHUNK, 4, 2, 8))  # [n, chunk, t, p, j]: column 16t + 8p + j
    return tl.reshape(tl.permute(v, (0, 1, 4, 2, 3)), (BLOCK_N, BLOCK_K))  # at position 8j + 2t + p


@triton.jit
def _a_cols(a_rows, amask, k0, kdim, BLOCK_K: tl.constexpr):
    """Columns ``k0 .. k0 + BLOCK_K`` of the activation rows at ``a_rows`` (``[BLOCK_M, 1]`` pointers, ``amask``
    the real rows)."""
    ks = tl.arange(0, BLOCK_K)
    return tl.load(a_rows + k0 + ks[None, :], mask=amask[:, None] & (ks < kdim - k0)[None, :], other=0.0)


@triton.jit
def _a_pairs(a_rows, amask, k0, kdim, BLOCK_K: tl.constexpr):
    """:func:`_a_cols` as its even and its odd columns (each loaded with a stride of 2)."""
    half = tl.arange(0, BLOCK_K // 2)
    kmask = amask[:, None] & (2 * half < kdim - k0)[None, :]
    return (tl.load(a_rows + k0 + 2 * half[None, :], mask=kmask, other=0.0),
            tl.load(a_rows + k0 + 1 + 2 * half[None, :], mask=kmask, other=0.0))


@triton.jit
def _mma(a, w, acc, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, w, acc, input_precision="ieee")
    return tl.dot(a, w, acc)


@triton.jit
def _mma_interleaved(a, q_rows, s, rmask, k0, kdim, acc, q_desc, desc_row, IEEE: tl.constexpr, ASM: tl.constexpr,
                     TMA: tl.constexpr, SWAP: tl.constexpr, WORDS: tl.constexpr, GROUP: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``acc + a @ w.T`` over columns ``k0 .. k0 + BLOCK_K`` (``a`` from :func:`_a_cols`), ``w`` the NVFP4 rows whose
    packed bytes ``q_rows`` (``[BLOCK_N, 1]``, ``rmask``) points to, with scale bytes ``s`` (:func:`fp4_scales`),
    decoded in column order (one MMA); with ``SWAP`` ``acc + w @ a.T`` (``acc`` transposed). ``TMA``: the packed
    bytes copied by ``q_desc`` (the stack's bytes viewed ``[rows, kdim / 2]``) from row ``desc_row`` on, zero past
    the stack. ``WORDS`` (with ``TMA`` and ``SWAP``): ``q_desc`` views them as int32 ``[rows, kdim / 8]``, the tile is
    decoded by :func:`fp4_words` and ``a``'s columns are in its order."""
    if WORDS:
        w = fp4_words(q_desc.load([desc_row, k0 // 8]), s, GROUP, BLOCK_N, BLOCK_K, ASM)
    elif TMA:
        w = fp4_tile(q_desc.load([desc_row, k0 // 2]), s, GROUP, BLOCK_N, BLOCK_K, ASM)
    else:
        w = fp4_interleaved(q_rows, s, rmask, k0, kdim, GROUP, BLOCK_N, BLOCK_K, ASM)
    if SWAP:
        acc = _mma(w.to(a.dtype), tl.trans(a), acc, IEEE)
    else:
        acc = _mma(a, tl.trans(w.to(a.dtype)), acc, IEEE)
    return acc


@triton.jit
def _mma_pairs(a_even, a_odd, q_rows, s_rows, rmask, k0, kdim, acc, IEEE: tl.constexpr, GROUP: tl.constexpr,
               BLOCK_K: tl.constexpr):
    """:func:`_mma_interleaved` as two MMAs over the weight tile's even and odd columns (``a_even``, ``a_odd`` from
    :func:`_a_pairs`)."""
    half = tl.arange(0, BLOCK_K // 2)
    byte = k0 // 2 + half[None, :]
    w_even, w_odd = fp4_pairs(q_rows + byte, s_rows + byte // (GROUP // 2),
                              rmask[:, None] & (2 * half < kdim - k0)[None, :])
    acc = _mma(a_even, tl.trans(w_even.to(a_even.dtype)), acc, IEEE)
    return _mma(a_odd, tl.trans(w_odd.to(a_even.dtype)), acc, IEEE)


@triton.jit
def _sorted_gate_up_fp4_kernel(
    x_ptr, a_desc, q_ptr, q_desc, s_ptr, s2_ptr, out_ptr, order_ptr, ends_ptr, tile_end_ptr,
    num_experts, hidden, inter, sx_t, so_m,
    TOP_K: tl.constexpr, IEEE: tl.constexpr, INTERLEAVE: tl.constexpr, ASM: tl.constexpr, TMA: tl.constexpr,
    GATHERED: tl.constexpr, SWAP: tl.constexpr, WORDS: tl.constexpr, PERMUTE_OUT: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # Column tiles vary fastest, so the programs of one row tile run together and share its gathered rows.
    num_n = tl.cdiv(inter, BLOCK_N)
    pid_m = tl.program_id(0) // num_n
    pid_n = tl.program_id(0) % num_n
    if pid_m >= tl.load(tile_end_ptr + num_experts - 1):  # past the real tiles
        return
    expert, rows, valid = expert_tile(pid_m, ends_ptr, tile_end_ptr, num_experts, BLOCK_M)
    token = (tl.load(order_ptr + rows, mask=valid, other=0) // TOP_K).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < inter
    gate_rows = expert.to(tl.int64) * 2 * inter + cols  # weight rows of [E * 2I] (up rows follow the I gate rows)
    row0 = expert * 2 * inter + pid_n * BLOCK_N  # the gate tile's first row (its rows past I are not stored)
    a_rows = x_ptr + token[:, None] * sx_t
    g_q = q_ptr + gate_rows[:, None] * (hidden // 2)
    g_s = s_ptr + gate_rows[:, None] * (hidden // GROUP)
    u_q = g_q + inter * (hidden // 2)
    u_s = g_s + inter * (hidden // GROUP)
    if SWAP:  # the accumulators transposed: [columns, rows]
        acc_g = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    first = tl.min(rows, 0)
    # Each K tile's scale bytes are loaded one tile ahead (a load by pointer the pipeline does not cover).
    g_sc = fp4_scales(g_s, cmask, 0, hidden, GROUP, BLOCK_K)
    u_sc = fp4_scales(u_s, cmask, 0, hidden, GROUP, BLOCK_K)
    for k0 in range(0, hidden, BLOCK_K):  # the activation tile loaded once for the gate and the up tile
        if INTERLEAVE:
            g_next = fp4_scales(g_s, cmask, k0 + BLOCK_K, hidden, GROUP, BLOCK_K)
            u_next = fp4_scales(u_s, cmask, k0 + BLOCK_K, hidden, GROUP, BLOCK_K)
            if GATHERED:  # the rows copied in expert order before: a tile's rows are consecutive there
                a = a_desc.load([first, k0])
            else:
                a = _a_cols(a_rows, valid, k0, hidden, BLOCK_K)
            acc_g = _mma_interleaved(a, g_q, g_sc, cmask, k0, hidden, acc_g, q_desc, row0, IEEE, ASM, TMA, SWAP,
                                     WORDS, GROUP, BLOCK_N, BLOCK_K)
            acc_u = _mma_interleaved(a, u_q, u_sc, cmask, k0, hidden, acc_u, q_desc, row0 + inter, IEEE, ASM, TMA,
                                     SWAP, WORDS, GROUP, BLOCK_N, BLOCK_K)
            g_sc, u_sc = g_next, u_next
        else:
            a_even, a_odd = _a_pairs(a_rows, valid, k0, hidden, BLOCK_K)
            acc_g = _mma_pairs(a_even, a_odd, g_q, g_s, cmask, k0, hidden, acc_g, IEEE, GROUP, BLOCK_K)
            acc_u = _mma_pairs(a_even, a_odd, u_q, u_s, cmask, k0, hidden, acc_u, IEEE, GROUP, BLOCK_K)
    g2 = tl.load(s2_ptr + gate_rows, mask=cmask, other=0.0) * fp4_unscale(ASM)
    u2 = tl.load(s2_ptr + gate_rows + inter, mask=cmask, other=0.0) * fp4_unscale(ASM)
    if SWAP:
        acc_g *= g2[:, None]
        acc_u *= u2[:, None]
        act = tl.trans((acc_g / (1.0 + tl.exp(-acc_g)) * acc_u).to(out_ptr.dtype.element_ty))
    else:
        acc_g *= g2[None, :]
        acc_u *= u2[None, :]
        act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    out_cols = cols
    if PERMUTE_OUT:  # in the order the down pass's word tiles read K in
        if BLOCK_N >= _K_CHUNK:  # whole chunks (powers of two): the tile reordered in registers, stored as it was
            act = tl.reshape(act, (BLOCK_M, BLOCK_N // _K_CHUNK, 4, 2, 8))
            act = tl.reshape(tl.permute(act, (0, 1, 4, 2, 3)), (BLOCK_M, BLOCK_N))
        else:
            out_cols = k_position(cols)
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * so_m + out_cols[None, :]
    tl.store(out_ptrs, act.to(out_ptr.dtype.element_ty), mask=valid[:, None] & cmask[None, :])


@triton.jit
def _sorted_down_fp4_kernel(
    a_ptr, a_desc, q_ptr, q_desc, s_ptr, s2_ptr, out_ptr, ends_ptr, tile_end_ptr,
    num_experts, hidden, inter, sa_m, so_m,
    IEEE: tl.constexpr, INTERLEAVE: tl.constexpr, ASM: tl.constexpr, TMA: tl.constexpr, SWAP: tl.constexpr,
    WORDS: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    num_n = tl.cdiv(hidden, BLOCK_N)
    pid_m = tl.program_id(0) // num_n
    pid_n = tl.program_id(0) % num_n
    if pid_m >= tl.load(tile_end_ptr + num_experts - 1):
        return
    expert, rows, valid = expert_tile(pid_m, ends_ptr, tile_end_ptr, num_experts, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < hidden
    w_rows = expert.to(tl.int64) * hidden + cols
    a_rows = a_ptr + rows.to(tl.int64)[:, None] * sa_m
    w_q = q_ptr + w_rows[:, None] * (inter // 2)
    w_s = s_ptr + w_rows[:, None] * (inter // GROUP)
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    first = tl.min(rows, 0)  # the tile's rows are consecutive: with TMA its activation tiles are copied too
    sc = fp4_scales(w_s, cmask, 0, inter, GROUP, BLOCK_K)  # each K tile's scales loaded one tile ahead
    for k0 in range(0, inter, BLOCK_K):
        if INTERLEAVE:
            next_sc = fp4_scales(w_s, cmask, k0 + BLOCK_K, inter, GROUP, BLOCK_K)
            if TMA:
                a = a_desc.load([first, k0])
            else:
                a = _a_cols(a_rows, valid, k0, inter, BLOCK_K)
            acc = _mma_interleaved(a, w_q, sc, cmask, k0, inter, acc, q_desc, expert * hidden + pid_n * BLOCK_N,
                                   IEEE, ASM, TMA, SWAP, WORDS, GROUP, BLOCK_N, BLOCK_K)
            sc = next_sc
        else:
            a_even, a_odd = _a_pairs(a_rows, valid, k0, inter, BLOCK_K)
            acc = _mma_pairs(a_even, a_odd, w_q, w_s, cmask, k0, inter, acc, IEEE, GROUP, BLOCK_K)
    w2 = tl.load(s2_ptr + w_rows, mask=cmask, other=0.0) * fp4_unscale(ASM)
    if SWAP:
        out = tl.trans((acc * w2[:, None]).to(out_ptr.dtype.element_ty))
    else:
        out = (acc * w2[None, :]).to(out_ptr.dtype.element_ty)
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * so_m + cols[None, :]
    tl.store(out_ptrs, out, mask=valid[:, None] & cmask[None, :])


def _check(packed: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor, rows: int, cols: int) -> None:
    experts = packed.shape[0]
    if cols % NVFP4_GROUP:
        raise ValueError(f"NVFP4 needs rows of a multiple of {NVFP4_GROUP} values, got {cols}")
    assert packed.shape == (experts, rows, cols // 2) and packed.dtype == torch.uint8 and packed.is_contiguous()
    assert scale.shape == (experts, rows, cols // NVFP4_GROUP) and scale.is_contiguous()
    assert scale_2.shape == (experts, rows, 1) and scale_2.dtype == torch.float32 and scale_2.is_contiguous()


def _descriptor(packed: torch.Tensor, gemm: GemmConfig, interleave: bool, tma: bool | None, words: bool = False
                ) -> TensorDescriptor | None:
    """A tensor descriptor of ``packed``'s bytes viewed ``[rows, C/2]`` with ``[block_n, block_k / 2]`` boxes (with
    ``words`` as int32 ``[rows, C/8]``, ``[block_n, block_k / 8]`` boxes), where the weight tiles are copied by it
    (``tma``, default :data:`TMA`; interleaved tiles only, 16-byte aligned rows), else None."""
    rows, nbytes = packed.shape[0] * packed.shape[1], packed.shape[2]
    if not (TMA if tma is None else tma) or not interleave or packed.data_ptr() % 16 or nbytes % 16 or not rows:
        return None
    if words:
        return TensorDescriptor.from_tensor(packed.view(rows, nbytes).view(torch.int32),
                                            [gemm.block_n, gemm.block_k // 8])
    return TensorDescriptor.from_tensor(packed.view(rows, nbytes), [gemm.block_n, gemm.block_k // 2])


def _words(words: bool | None, swap: bool, desc: TensorDescriptor | None, k_dim: int, gemm: GemmConfig) -> bool:
    """Whether a launch reads its weight tiles as words (:data:`WORDS`, or ``words``): swapped tiles copied by
    descriptor, K and the K tile multiples of :data:`K_CHUNK`."""
    return ((WORDS if words is None else words) and swap and desc is not None and k_dim % K_CHUNK == 0
            and gemm.block_k % K_CHUNK == 0)


# What the pipelined tiles of one program may take of shared memory: an H100's or H200's 227 KiB, less room for
# the epilogue's and the layout conversions' scratch.
SMEM_BUDGET = 160 * 1024


def _fit(config: tuple[int, GemmConfig], n_dim: int, k_dim: int, act_bytes: int, weight_tiles: int
         ) -> tuple[int, GemmConfig]:
    """Tiles no wider than the problem (at least 32 values of K: two MMAs of 16), and K tiles halved until the
    pipeline's stages of activation tiles (``act_bytes`` a value: float32 takes twice bf16's room) and
    ``weight_tiles`` packed weight tiles fit :data:`SMEM_BUDGET`."""
    block_m, gemm = config
    block_n = min(gemm.block_n, max(16, triton.next_power_of_2(n_dim)))
    block_k = min(gemm.block_k, max(32, triton.next_power_of_2(k_dim)))
    stage_bytes_per_k = block_m * act_bytes + weight_tiles * block_n // 2  # a K value's bytes in one stage
    while block_k > 32 and gemm.num_stages * block_k * stage_bytes_per_k > SMEM_BUDGET:
        block_k //= 2
    return block_m, GemmConfig(block_n, block_k, gemm.num_warps, gemm.num_stages)


def _tiles(ends: torch.Tensor, rows: int, block_m: int, tile_end: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    """:func:`~tidal.kernels.moe_triton.tile_ends`, its ``tile_end`` given or computed."""
    if tile_end is None:
        return tile_ends(ends, rows, block_m)
    assert tile_end.shape == ends.shape and tile_end.dtype == ends.dtype
    return tile_end, max_tiles(rows, block_m, ends.shape[0])


def _default(config: tuple[int, GemmConfig], rows: int, experts: int) -> tuple[int, GemmConfig]:
    """A pass's tiles for ``rows`` expert-sorted rows over ``experts``: ``config``, or :data:`DECODE_CONFIG` where the
    rows average at most :data:`DECODE_ROWS` an expert."""
    return DECODE_CONFIG if rows <= DECODE_ROWS * experts else config


def sorted_gate_up_nvfp4(x: torch.Tensor, order: torch.Tensor, ends: torch.Tensor, packed: torch.Tensor,
                         scale: torch.Tensor, scale_2: torch.Tensor, top_k: int,
                         config: tuple[int, GemmConfig] | None = None, interleave: bool | None = None,
                         asm: bool | None = None, tma: bool | None = None, gathered: bool | None = None,
                         swap: bool | None = None, words: bool | None = None, permute_out: bool = False,
                         tokens: torch.Tensor | None = None, tile_end: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`~tidal.kernels.moe_triton.sorted_gate_up` over NVFP4 experts: ``silu(g) * u`` where ``[g | u] =
    x[order // top_k] @ W_e.T`` for the rows of each expert ``e``, ``W = e2m1 * scale * scale_2`` of ``packed
    [E, 2I, H/2]``, ``scale [E, 2I, H/16]`` (e4m3), ``scale_2 [E, 2I, 1]`` (fp32; gate rows first). Returns
    ``[A, I]`` in ``order``'s order, in ``x``'s dtype; with ``permute_out`` its columns in :func:`permute_k`'s order
    (``I`` a multiple of :data:`K_CHUNK`), which :func:`sorted_down_nvfp4` reads as they are. ``config``,
    ``interleave``, ``asm``, ``tma``, ``gathered``, ``swap`` and ``words`` override :data:`GATE_UP_CONFIG` (or
    :data:`DECODE_CONFIG`), :data:`INTERLEAVE`, :data:`ASM`, :data:`TMA`, :data:`GATHERED`, :data:`SWAP` and
    :data:`WORDS`. ``tokens`` (``order // top_k``) and ``tile_end`` (of the tiles' ``block_m``), where
    :func:`~tidal.kernels.moe_triton.sort_assignments` gave them, spare their launches."""
    assignments, (num_experts, two_inter, _), hidden = order.numel(), packed.shape, x.shape[1]
    inter = two_inter // 2
    _check(packed, scale, scale_2, two_inter, hidden)
    assert ends.shape == (num_experts,) and x.stride(1) == 1
    if permute_out and inter % K_CHUNK:
        raise ValueError(f"permute_out needs an intermediate size of a multiple of {K_CHUNK}, got {inter}")
    block_m, gemm = _fit(config or _default(GATE_UP_CONFIG, assignments, num_experts), inter, hidden,
                         x.element_size(), 2)
    out = torch.empty(assignments, inter, dtype=x.dtype, device=x.device)
    if assignments == 0:
        return out
    tile_end, max_tiles = _tiles(ends, assignments, block_m, tile_end)
    interleave = INTERLEAVE if interleave is None else interleave
    swap = interleave and (SWAP if swap is None else swap)
    desc = _descriptor(packed, gemm, interleave, tma)
    a_desc = None
    if desc is not None and (GATHERED if gathered is None else gathered) and hidden * x.element_size() % 16 == 0:
        words = _words(words, swap, desc, hidden, gemm)
        if words:  # the word tiles' order of K, the rows' too
            desc = _descriptor(packed, gemm, interleave, tma, words=True)
        # [A, H] in expert order
        tokens = order // top_k if tokens is None else tokens
        rows = permute_k(x, rows=tokens) if words else x.index_select(0, tokens)
        a_desc = TensorDescriptor.from_tensor(rows, [block_m, gemm.block_k])
    else:
        words = False
    _sorted_gate_up_fp4_kernel[(max_tiles * triton.cdiv(inter, gemm.block_n),)](
        x, a_desc, packed, desc, scale.view(torch.uint8), scale_2, out, order, ends, tile_end,
        num_experts, hidden, inter, x.stride(0), out.stride(0),
        TOP_K=top_k, IEEE=x.dtype == torch.float32, INTERLEAVE=interleave, ASM=interleave and use_asm(asm),
        TMA=desc is not None, GATHERED=a_desc is not None, SWAP=swap, WORDS=words, PERMUTE_OUT=permute_out,
        GROUP=NVFP4_GROUP,
        BLOCK_M=block_m, BLOCK_N=gemm.block_n, BLOCK_K=gemm.block_k,
        num_warps=gemm.num_warps, num_stages=gemm.num_stages,
    )
    return out


def sorted_down_nvfp4(act: torch.Tensor, ends: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                      scale_2: torch.Tensor, config: tuple[int, GemmConfig] | None = None,
                      interleave: bool | None = None, asm: bool | None = None, tma: bool | None = None,
                      swap: bool | None = None, words: bool | None = None, permuted: bool = False,
                      tile_end: torch.Tensor | None = None) -> torch.Tensor:
    """``act[rows of e] @ W_e.T`` for each expert ``e`` (``act [A, I]`` in expert order, its runs ending at
    ``ends``), ``W`` the NVFP4 ``down`` stack ``packed [E, H, I/2]``, ``scale [E, H, I/16]``, ``scale_2 [E, H,
    1]``. Returns ``[A, H]`` in ``act``'s dtype (rows past ``ends[-1]`` are left unwritten). ``permuted``: ``act``'s
    columns are in :func:`permute_k`'s order (``sorted_gate_up_nvfp4(..., permute_out=True)``), which word tiles read
    as they are (else they take a permuted copy, and other tiles an unpermuted one). ``config``, ``interleave``,
    ``asm``, ``tma``, ``swap`` and ``words`` override :data:`DOWN_CONFIG` (or :data:`DECODE_CONFIG`),
    :data:`INTERLEAVE`, :data:`ASM`, :data:`TMA`, :data:`SWAP` and :data:`WORDS`; ``tile_end`` as for
    :func:`sorted_gate_up_nvfp4`."""
    rows, inter = act.shape
    num_experts, hidden, _ = packed.shape
    _check(packed, scale, scale_2, hidden, inter)
    assert ends.shape == (num_experts,) and act.stride(1) == 1
    block_m, gemm = _fit(config or _default(DOWN_CONFIG, rows, num_experts), hidden, inter, act.element_size(), 1)
    out = torch.empty(rows, hidden, dtype=act.dtype, device=act.device)
    if rows == 0:
        return out
    tile_end, max_tiles = _tiles(ends, rows, block_m, tile_end)
    interleave = INTERLEAVE if interleave is None else interleave
    swap = interleave and (SWAP if swap is None else swap)
    desc = _descriptor(packed, gemm, interleave, tma)
    if desc is not None and (act.stride(0) * act.element_size() % 16 or act.data_ptr() % 16
                             or not act.is_contiguous()):
        desc = None
    words = _words(words, swap, desc, inter, gemm)
    if words != permuted:
        act = permute_k(act, inverse=permuted)
    a_desc = None
    if desc is not None:  # the activations are in expert order: a tile's rows are consecutive
        if words:
            desc = _descriptor(packed, gemm, interleave, tma, words=True)
        a_desc = TensorDescriptor.from_tensor(act, [block_m, gemm.block_k])
    _sorted_down_fp4_kernel[(max_tiles * triton.cdiv(hidden, gemm.block_n),)](
        act, a_desc, packed, desc, scale.view(torch.uint8), scale_2, out, ends, tile_end,
        num_experts, hidden, inter, act.stride(0), out.stride(0),
        IEEE=act.dtype == torch.float32, INTERLEAVE=interleave, ASM=interleave and use_asm(asm),
        TMA=desc is not None, SWAP=swap, WORDS=words, GROUP=NVFP4_GROUP,
        BLOCK_M=block_m, BLOCK_N=gemm.block_n, BLOCK_K=gemm.block_k,
        num_warps=gemm.num_warps, num_stages=gemm.num_stages,
    )
    return out


def fused_experts_nvfp4_triton(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: Nvfp4,
                               down: Nvfp4, shared: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """:func:`~tidal.kernels.moe.fused_experts_nvfp4` on the kernels: the assignments sorted by expert, the two
    grouped GEMMs above, then :func:`~tidal.kernels.moe_triton.combine` (the shared expert folded in for bf16,
    with the bits of the torch ops). No host sync."""
    num_experts, top_k, assignments = gate_up.packed.shape[0], ids.shape[1], ids.numel()
    block_m = _default(GATE_UP_CONFIG, assignments, num_experts)[0]
    if 0 < assignments <= SORT_MAX:  # the sort, its inverse and both passes' tiles in one launch
        order, inverse, tokens, ends, tile_end = sort_assignments(ids, num_experts, block_m)
    else:
        sorted_ids, order = torch.sort(ids.flatten(), stable=True)
        ends = torch.searchsorted(sorted_ids, torch.arange(num_experts, device=x.device, dtype=sorted_ids.dtype),
                                  right=True, out_int32=True)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=x.device)
        tokens = tile_end = None
    x = x if x.stride(1) == 1 else x.contiguous()
    permute = WORDS and down.packed.shape[2] * 2 % K_CHUNK == 0  # the activation in the down pass's word order
    act = sorted_gate_up_nvfp4(x, order, ends, *gate_up, top_k, permute_out=permute, tokens=tokens,
                               tile_end=tile_end)
    same = tile_end is not None and _default(DOWN_CONFIG, assignments, num_experts)[0] == block_m
    h = sorted_down_nvfp4(act, ends, *down, permuted=permute, tile_end=tile_end if same else None)
    fold = shared is not None and shared[0].dtype == shared[1].dtype == h.dtype == torch.bfloat16
    out = combine(h, inverse, weights, shared if fold else None)
    if shared is not None and not fold:
        out = out + shared[1] * shared[0]
    return out
