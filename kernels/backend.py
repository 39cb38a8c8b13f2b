"""Which implementation a kernel-shaped operation runs: the Triton kernel or the torch reference.

Triton kernels run only for CUDA tensors, and only where ``triton`` imports; everything else (the
CPU serving path, a machine without triton) takes the torch reference. Setting the environment
variable ``TIDAL_KERNELS=torch`` forces the reference on a GPU too, to bisect a numerical
difference or to measure what a kernel buys; ``TIDAL_KERNELS=torch:route,qsa_select`` forces only the
named operations (:data:`KERNELS` lists the names). It is read on every call, so a test can flip it
(a decode step replayed from a CUDA graph keeps the kernels it was captured with).

Triton is imported here only to check that it is there, and only once a CUDA tensor asks: the CPU
path never imports it.
"""

from __future__ import annotations

import functools
import os

import torch


@functools.cache
def _triton_importable() -> bool:
    """Whether ``import triton`` works; cached because a failing import is slow and never heals."""
    try:
        import triton  # noqa: F401
    except Exception:  # ImportError, or a broken install failing while it loads its driver
        return False
    return True


# The operations ``TIDAL_KERNELS=torch:NAME,...`` can send to their torch references one by one.
KERNELS = (
    "attention",      # paged prefill/decode attention (kernels/attention)
    "conv",           # causal conv1d varlen and its decode step (kernels/conv)
    "decode_prep",    # a decode graph's per-row tensors (kernels/decode_prep_triton)
    "dequant",        # quantized experts to dense values (kernels/quant_triton)
    "gdn",            # Gated DeltaNet chunked prefill (flash-linear-attention) and recurrent decode
    "gdn_gates",      # GDN decay and beta gates (kernels/gdn)
    "gdn_step",       # GDN decode step: gates, recurrence, gated norm in one kernel (needs gdn, gdn_gates, norm)
    "gemv",           # projections of a decode step's few rows (kernels/gemv)
    "greedy",         # a decode graph's arg-max of its logits (kernels/greedy_triton)
    "hc",             # hyper-connection kernels (kernels/hyper_connection, executor/layers/hyper_connection)
    "moe",            # routed experts of prefill rows: grouped GEMM helpers and the Triton fused MoE
    "moe_gemv",       # routed + shared experts of decode batches (kernels/moe_decode_triton.moe_gemv)
    "ngram",          # PLE's hashed n-gram ids (kernels/ngram)
    "norm",           # RMSNorm and gated RMSNorm
    "nvfp4",          # NVFP4 routed experts read packed by the grouped GEMMs and GEMVs (kernels/moe_nvfp4_triton)
    "norm_rotary",    # per-head RMSNorm + partial rotary (executor/layers/rotary)
    "ple",            # PLE's per-stream value gate and conv norm (kernels/ple)
    "ple_gather",     # n-gram rows read by the device from a pinned host table in decode steps (kernels/ple)
    "qsa",            # QSA block choice's top-k over scores (kernels/qsa.pick_blocks)
    "qsa_select",     # QSA block scores + top-k in one kernel (kernels/qsa_triton)
    "route",          # router softmax + top-k (kernels/moe.route)
    "seeded_rows",    # random n-gram table rows drawn from the seed (executor/weights.table_rows)
    "shared_expert",  # the shared expert's [gate; up] GEMM and SiLU-gate
    "stacked",        # GDN's and attention's input projections as one GEMM
)


def _forced_to_torch() -> tuple[bool, frozenset[str]]:
    """(every operation, named operations) that ``TIDAL_KERNELS`` sends to the torch reference."""
    return parse_setting(os.environ.get("TIDAL_KERNELS", ""))


@functools.lru_cache(maxsize=8)
def parse_setting(value: str) -> tuple[bool, frozenset[str]]:
    """``(every operation, named operations)`` for a ``TIDAL_KERNELS`` value: empty or ``triton`` (the
    kernels), ``torch`` (every reference) or ``torch:NAME,...``; anything else is an error. Parsed once
    per distinct value: dispatchers ask on every call."""
    value = value.strip().lower()
    if value in ("", "triton"):
        return False, frozenset()
    if value == "torch":
        return True, frozenset()
    if not value.startswith("torch:"):
        raise ValueError(f"TIDAL_KERNELS={value!r}: expected 'triton', 'torch' or 'torch:NAME,...' "
                         f"with names from {', '.join(KERNELS)}")
    names = frozenset(n.strip() for n in value[len("torch:"):].split(",") if n.strip())
    unknown = sorted(names - set(KERNELS))
    if unknown:
        raise ValueError(f"TIDAL_KERNELS names unknown operations {unknown}; known: {', '.join(KERNELS)}")
    return False, names


def forces_torch() -> bool:
    """Whether ``TIDAL_KERNELS`` sends any operation to its torch reference (several of those read
    values back to the host, which a CUDA graph capture cannot hold)."""
    every, names = _forced_to_torch()
    return every or bool(names)


def use_triton(t: torch.Tensor, name: str | None = None) -> bool:
    """True when ``t`` is on CUDA, triton imports and ``TIDAL_KERNELS`` sends neither every operation
    nor ``name`` (one of :data:`KERNELS`) to the torch reference."""
    if not t.is_cuda:  # the CPU path never runs a kernel: no environment read on its every call
        return False
    every, names = _forced_to_torch()
    if every or (name is not None and name in names):
        return False
    return _triton_importable()


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``): the size a Triton tile pads ``n`` to, for
    host code that must not import triton."""
    return 1 << max(0, n - 1).bit_length()
