"""The NVFP4, decode GEMV and PLE-gather kernels compile for an H200 (sm_90) on any machine: Triton lowers them to
PTX and its bundled ptxas assembles it, no GPU needed. The interpreter runs a kernel's arithmetic but not its
lowering: a type that differs between two returns, a layout Triton cannot convert or a PTX typo only fails here (or
on a GPU). Each variant the tuning switches select is compiled as the launchers would launch it at the model's
shapes.

The compiles run in one child process without ``TRITON_INTERPRET`` (the other kernel tests set it before their
first import of triton, which turns every kernel into an interpreted function); each test reads its case's outcome.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from importlib.util import find_spec

import pytest

# Found without importing triton here: this process's kernel tests choose the interpreter before they import it.
TRITON = find_spec("triton")
PTXAS = os.path.join(TRITON.submodule_search_locations[0], "backends", "nvidia", "bin", "ptxas") if TRITON else ""
pytestmark = pytest.mark.skipif(not os.path.exists(PTXAS), reason="no triton, or a triton install without ptxas")
# An H100's or H200's shared memory a block (bytes): a launch asking for more fails.
SMEM_LIMIT = 232448
# (interleave, asm): the ways a weight tile is decoded.
DECODES = [(True, False), (True, True), (False, False)]


def compile_for_h200(fn, signature: dict[str, str], constants: dict, warps: int = 4, stages: int = 3):
    """``fn`` compiled for sm_90 with ``signature`` (Triton's type strings) and ``constants`` (constexpr values);
    the compiled kernel, with its PTX and cubin. In the child process only."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {**signature, **dict.fromkeys(constants, "constexpr")}
    signature = {name: signature[name] for name in fn.arg_names}  # in the order of the parameters
    kernel = triton.compile(ASTSource(fn, signature, constants), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": warps, "num_stages": stages})
    assert kernel.asm["cubin"], "no cubin"
    return kernel


GEMM = {"q_ptr": "*u8", "s_ptr": "*u8", "s2_ptr": "*fp32", "ends_ptr": "*i32", "tile_end_ptr": "*i32",
        "num_experts": "i32", "hidden": "i32", "inter": "i32"}


def descriptor(tma: bool, gemm, words: bool = False) -> str:
    """The signature of the packed bytes' tensor descriptor argument (``constexpr`` None without one; ``words``:
    viewed as int32)."""
    if words:
        return f"tensordesc<i32[{gemm.block_n}, {gemm.block_k // 8}]>"
    return f"tensordesc<u8[{gemm.block_n}, {gemm.block_k // 2}]>" if tma else "constexpr"


def grouped_gemms(dtype: str, interleave: bool, asm: bool, tma: bool, gathered: bool = False,
                  swap: bool = False, words: bool = False) -> None:
    """Both NVFP4 grouped GEMMs at their default tiles as fitted to ``dtype``; the PTX decode is in the code exactly
    when asked for, the shared memory fits a block, a swapped bf16 MMA takes the decoded tile from registers (its
    first operand a tensor, not shared memory), and word tiles are read from shared memory as 32-bit words."""
    from tidal.kernels import moe_nvfp4_triton

    act_bytes = 4 if dtype == "fp32" else 2
    for kernel, (block_m, gemm), extra in (  # the tiles the launchers take at flash-next's shapes
            (moe_nvfp4_triton._sorted_gate_up_fp4_kernel,
             moe_nvfp4_triton._fit(moe_nvfp4_triton.GATE_UP_CONFIG, 640, 2560, act_bytes, 2),
             {"x_ptr": f"*{dtype}", "order_ptr": "*i64", "sx_t": "i32"}),
            (moe_nvfp4_triton._sorted_down_fp4_kernel,
             moe_nvfp4_triton._fit(moe_nvfp4_triton.DOWN_CONFIG, 2560, 640, act_bytes, 1),
             {"a_ptr": f"*{dtype}", "sa_m": "i32"})):
        names = kernel.arg_names
        types = {**GEMM, **extra, "out_ptr": f"*{dtype}", "so_m": "i32", "q_desc": descriptor(tma, gemm, words),
                 "a_desc": f"tensordesc<{dtype}[{block_m}, {gemm.block_k}]>" if tma else "constexpr"}
        constants = {"TOP_K": 10, "IEEE": dtype == "fp32", "INTERLEAVE": interleave, "ASM": asm, "TMA": tma,
                     "GATHERED": gathered, "SWAP": swap, "WORDS": words, "PERMUTE_OUT": words, "GROUP": 16,
                     "BLOCK_M": block_m, "BLOCK_N": gemm.block_n, "BLOCK_K": gemm.block_k}
        constants = {k: v for k, v in constants.items() if k in names}
        if not tma:
            constants.update({n: None for n in ("q_desc", "a_desc") if n in names})
        elif "GATHERED" in names and not gathered:
            constants["a_desc"] = None
        compiled = compile_for_h200(kernel, {n: types[n] for n in names if n not in constants}, constants,
                                    gemm.num_warps, gemm.num_stages)
        marker = "0x7632" if words else "0x4342"  # a byte permute of fp4_words_asm or of fp4_asm
        assert (marker in compiled.asm["ptx"]) == asm, "the PTX decode where it was not asked for, or none"
        if words:
            loads = [ln for ln in compiled.asm["ttgir"].splitlines() if "ttg.local_load" in ln and "xi32, #" in ln]
            assert loads, "the weight tile not loaded from shared memory as words"
        assert compiled.metadata.shared <= SMEM_LIMIT, f"{compiled.metadata.shared} bytes of shared memory"
        if dtype == "bf16":
            dots = [ln for ln in compiled.asm["ttgir"].splitlines() if "ttng.warp_group_dot " in ln]
            assert dots, "no wgmma"
            assert all(("opIdx = 0" in ln) == swap for ln in dots), "the decoded tile's operand is not as asked"


def decode_gemvs(fp4: bool, asm: bool, tokens: int, dtype: str) -> None:
    """Both GEMV kernels with NVFP4 (or bf16) routed experts and a dense shared expert, at the config row's tiles,
    over ``dtype`` activations."""
    from tidal.kernels import moe_decode_triton

    gate_up, down = moe_decode_triton.pick_config(tokens, fp4)
    common = {"TOP_K": 10, "SHARED": True, "FP4": fp4, "PAIRS": dtype == "bf16", "ASM": asm, "GROUP": 16,
              "PDL": True, "hidden": 2560, "inter": 640}  # flash-next's
    ints = dict.fromkeys(("s_inter", "act_width", "sx_t"), "i32")
    routed = "*u8" if fp4 else f"*{dtype}"
    compile_for_h200(moe_decode_triton._gate_up_kernel,
                     {"x_ptr": f"*{dtype}", "ids_ptr": "*i64", "gu_ptr": routed, "gus_ptr": routed,
                      "gus2_ptr": "*fp32", "sgu_ptr": f"*{dtype}", "act_ptr": f"*{dtype}", **ints, "sgu_e": "i64"},
                     {**common, "BLOCK_N": gate_up.block_n, "BLOCK_K": gate_up.block_k}, gate_up.num_warps)
    compile_for_h200(moe_decode_triton._down_kernel,
                     {"x_ptr": f"*{dtype}", "act_ptr": f"*{dtype}", "ids_ptr": "*i64", "down_ptr": routed,
                      "ds_ptr": routed, "ds2_ptr": "*fp32", "sdown_ptr": f"*{dtype}", "sgate_ptr": f"*{dtype}",
                      "part_ptr": "*fp32", **ints, "sd_e": "i64"},
                     {**common, "BLOCK_N": down.block_n, "BLOCK_K": down.block_k}, down.num_warps)


def gather_rows() -> None:
    from tidal.kernels import ple_triton

    compile_for_h200(ple_triton._gather_rows_kernel,
                     {"table_ptr": "*u8", "ids_ptr": "*i64", "out_ptr": "*u8", "n": "i32", "width": "i32"},
                     {"BLOCK_R": ple_triton.GATHER_ROWS, "BLOCK_W": ple_triton.GATHER_BYTES})


CASES = {
    **{f"grouped {dtype} interleave={i} asm={a} tma={t} gathered={g} swap={s} words={w}":
       (grouped_gemms, (dtype, i, a, t, g, s, w))
       for dtype, i, a, t, g, s, w in [("bf16", *d, d[0], d[0], d[0], False) for d in DECODES]
       + [("bf16", True, True, True, True, False, False), ("bf16", True, False, True, False, True, False),
          ("bf16", True, False, False, False, True, False), ("fp32", True, True, True, True, True, False),
          ("bf16", True, True, True, True, True, True), ("bf16", True, False, True, True, True, True),
          ("fp32", True, True, True, True, True, True)]},
    **{f"gemv tokens={n} fp4={f} asm={a} {dtype}": (decode_gemvs, (f, a, n, dtype))
       for n, f, a, dtype in [(1, True, False, "bf16"), (1, True, True, "bf16"), (32, True, True, "bf16"),
                              (1, True, True, "fp16"), (1, False, False, "bf16")]},
    "gather_rows": (gather_rows, ()),
}


@functools.cache
def outcomes() -> dict[str, str]:
    """Every case compiled in one child process without ``TRITON_INTERPRET``: case -> "ok" or the error."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, __file__], capture_output=True, text=True, env=env, timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1])


@pytest.mark.parametrize("case", list(CASES))
def test_compiles_for_h200(case):
    assert outcomes()[case] == "ok"


if __name__ == "__main__":
    results = {}
    for name, (fn, args) in CASES.items():
        try:
            fn(*args)
            results[name] = "ok"
        except Exception as e:  # reported per case by the test that reads it
            results[name] = f"{type(e).__name__}: {e}"[-3000:]
    print(json.dumps(results))
