"""The NVFP4, decode GEMV and PLE-gather kernels compile for an H200 (sm_90) on any machine: Triton lowers them to PTX and its
bundled ptxas assembles it, no GPU needed. The interpreter runs a kernel's arithmetic but not its lowering: a
type that differs between two returns, a layout Triton cannot convert or a PTX typo only fails here (or on a
GPU). Each variant the tuning switches select is compiled as the launchers would launch it at the model's shapes.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("triton")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from tidal.kernels import moe_decode_triton, moe_nvfp4_triton, ple_triton  # noqa: E402

H200 = GPUTarget("cuda", 90, 32)
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
pytestmark = pytest.mark.skipif(not os.path.exists(PTXAS), reason="this triton install has no ptxas")
# (interleave, asm): the ways a weight tile is decoded.
DECODES = [(True, False), (True, True), (False, False)]


def compile_for_h200(fn, signature: dict[str, str], constants: dict, warps: int = 4, stages: int = 3):
    """``fn`` compiled for sm_90 with ``signature`` (Triton's type strings) and ``constants`` (constexpr values);
    the compiled kernel, with its PTX and cubin."""
    signature = {**signature, **dict.fromkeys(constants, "constexpr")}
    kernel = triton.compile(ASTSource(fn, signature, constants), target=H200,
                            options={"num_warps": warps, "num_stages": stages})
    assert kernel.asm["cubin"], "no cubin"
    return kernel


GEMM = {"q_ptr": "*u8", "s_ptr": "*u8", "s2_ptr": "*fp32", "ends_ptr": "*i32", "tile_end_ptr": "*i32",
        "num_experts": "i32", "hidden": "i32", "inter": "i32"}


def descriptor(tma: bool, gemm) -> str:
    """The signature of the packed bytes' tensor descriptor argument (``constexpr`` None without one)."""
    return f"tensordesc<u8[{gemm.block_n}, {gemm.block_k // 2}]>" if tma else "constexpr"


@pytest.mark.parametrize("dtype,interleave,asm,tma", [("bf16", *d, d[0]) for d in DECODES]
                         + [("bf16", True, False, False), ("fp32", True, False, True)])
def test_nvfp4_grouped_gemms_compile(dtype, interleave, asm, tma):
    for kernel, (block_m, gemm), extra in (
            (moe_nvfp4_triton._sorted_gate_up_fp4_kernel, moe_nvfp4_triton.GATE_UP_CONFIG,
             {"x_ptr": f"*{dtype}", "order_ptr": "*i64", "sx_t": "i32"}),
            (moe_nvfp4_triton._sorted_down_fp4_kernel, moe_nvfp4_triton.DOWN_CONFIG,
             {"a_ptr": f"*{dtype}", "sa_m": "i32"})):
        names = kernel.arg_names
        types = {**GEMM, **extra, "out_ptr": f"*{dtype}", "so_m": "i32", "q_desc": descriptor(tma, gemm)}
        constants = {"TOP_K": 10, "IEEE": dtype == "fp32", "INTERLEAVE": interleave, "ASM": asm, "TMA": tma,
                     "GROUP": 16, "BLOCK_M": block_m, "BLOCK_N": gemm.block_n, "BLOCK_K": gemm.block_k}
        constants = {k: v for k, v in constants.items() if k in names}
        if not tma:
            constants["q_desc"] = None
        compiled = compile_for_h200(kernel, {n: types[n] for n in names if n not in constants}, constants,
                                    gemm.num_warps, gemm.num_stages)
        assert ("0x4342" in compiled.asm["ptx"]) == asm  # fp4_asm's byte permute is there exactly when asked for


@pytest.mark.parametrize("fp4,interleave,asm", [(True, *d) for d in DECODES] + [(False, False, False)])
@pytest.mark.parametrize("tokens", [1, 32])
def test_decode_gemvs_compile(fp4, interleave, asm, tokens):
    """Both GEMV kernels with NVFP4 (or bf16) routed experts and a dense shared expert, at each config row's
    tiles."""
    gate_up, down = moe_decode_triton.pick_config(tokens)
    common = {"TOP_K": 10, "SHARED": True, "FP4": fp4, "INTERLEAVE": interleave, "ASM": asm, "GROUP": 16,
              "PDL": True}
    ints = dict.fromkeys(("hidden", "inter", "s_inter", "act_width", "sx_t"), "i32")
    routed = "*u8" if fp4 else "*bf16"
    compile_for_h200(moe_decode_triton._gate_up_kernel,
                     {"x_ptr": "*bf16", "ids_ptr": "*i64", "gu_ptr": routed, "gus_ptr": routed, "gus2_ptr": "*fp32",
                      "sgu_ptr": "*bf16", "act_ptr": "*bf16", **ints, "sgu_e": "i64"},
                     {**common, "BLOCK_N": gate_up.block_n, "BLOCK_K": gate_up.block_k}, gate_up.num_warps)
    compile_for_h200(moe_decode_triton._down_kernel,
                     {"x_ptr": "*bf16", "act_ptr": "*bf16", "ids_ptr": "*i64", "down_ptr": routed, "ds_ptr": routed,
                      "ds2_ptr": "*fp32", "sdown_ptr": "*bf16", "sgate_ptr": "*bf16", "part_ptr": "*fp32", **ints,
                      "sd_e": "i64"},
                     {**common, "BLOCK_N": down.block_n, "BLOCK_K": 512}, down.num_warps)


def test_gather_rows_compiles():
    compile_for_h200(ple_triton._gather_rows_kernel,
                     {"table_ptr": "*u8", "ids_ptr": "*i64", "out_ptr": "*u8", "n": "i32", "width": "i32"},
                     {"BLOCK_R": ple_triton.GATHER_ROWS, "BLOCK_W": ple_triton.GATHER_BYTES})
