"""Gated DeltaNet over a flat batch: varlen chunked prefill and in-place recurrent decode.

On a GPU this is flash-linear-attention's chunked kernel (an optional dependency, imported only for
CUDA tensors: it breaks other libraries' CPU paths when imported there). Its varlen form takes
GVA (key heads shared by several value heads), the q/k l2 norm and one initial state per sequence,
and returns each sequence's final state, which is exactly what tidal's state slots need. Without
it, for float32, and on the CPU, the torch reference runs one sequence at a time through
:func:`tidal.kernels.gdn.chunk_gated_delta_rule`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys

import torch

from .backend import next_pow2, use_triton
from .common import l2_norm
from .gdn import chunk_gated_delta_rule, gdn_decode_ref, gdn_gates
from .norm import gated_rms_norm

logger = logging.getLogger(__name__)


@functools.cache
def _fla_chunk():
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
    except ImportError:
        logger.warning("flash-linear-attention is not installed: GDN prefill runs the torch reference")
        return None
    return fla_chunk


@contextlib.contextmanager
def fla_cache_off():
    """flash-linear-attention's identity-keyed memo of index tensors off (when it is imported): inside a CUDA
    graph capture their computation must be recorded, not taken from a call before it on the same tensors."""
    utils = sys.modules.get("fla.utils")
    if utils is None or not hasattr(utils, "FLA_DISABLE_TENSOR_CACHE"):
        yield
        return
    before = utils.FLA_DISABLE_TENSOR_CACHE
    utils.FLA_DISABLE_TENSOR_CACHE = True
    try:
        yield
    finally:
        utils.FLA_DISABLE_TENSOR_CACHE = before


def gdn_prefill_on_device(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether :func:`gdn_prefill` runs flash-linear-attention's kernel for ``dtype`` on ``device``: device work
    only, no host list read (the torch reference walks the sequences on the host)."""
    probe = torch.empty(0, dtype=dtype, device=device)
    return use_triton(probe, "gdn") and dtype != torch.float32 and _fla_chunk() is not None


def gdn_prefill_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    initial_state: torch.Tensor, cu_seqlens: list[int], *,
                    qk_normalized: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence at a time.

    Args:
        q, k: ``[T, Hk, dk]`` raw (l2-normalised here, in fp32), or already l2-normalised per head
            when ``qk_normalized``; v ``[T, Hv, dv]``; g (log decay) and beta ``[T, Hv]``;
            initial_state ``[N, Hv, dk, dv]`` fp32; cu_seqlens host ints ``[N + 1]``.
    Returns ``(o [T, Hv, dv] in v's dtype, final states [N, Hv, dk, dv] fp32)``.
    """
    group = v.shape[1] // q.shape[1]
    q, k = q.float(), k.float()
    if not qk_normalized:
        q, k = l2_norm(q), l2_norm(k)
    q = q.repeat_interleave(group, dim=1)
    k = k.repeat_interleave(group, dim=1)
    out = torch.empty_like(v)
    finals = []
    for i, (lo, hi) in enumerate(zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True)):
        o, state = chunk_gated_delta_rule(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], initial_state[i])
        out[lo:hi] = o
        finals.append(state)
    return out, torch.stack(finals)


def gdn_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                initial_state: torch.Tensor, cu_seqlens: torch.Tensor, cu_seqlens_host: list[int],
                chunk_indices: torch.Tensor | None = None, *,
                qk_normalized: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`gdn_prefill_ref`'s result.

    ``cu_seqlens`` is the same offsets as an int64 device tensor; ``chunk_indices`` (``[chunks, 2]``:
    sequence, chunk within it, for 64-row chunks) is built once per batch by the caller, so the
    kernel does not build and copy it to the device (a host sync) in every layer. With
    ``qk_normalized`` q and k arrive l2-normalised and the kernel does not normalise them again.
    """
    # flash-linear-attention's float32 dots run in tf32: float32 stays on the exact reference.
    fla_chunk = _fla_chunk() if use_triton(v, "gdn") and v.dtype != torch.float32 else None
    if fla_chunk is None:
        return gdn_prefill_ref(q, k, v, g, beta, initial_state, cu_seqlens_host, qk_normalized=qk_normalized)
    cpu = torch.tensor(cu_seqlens_host, dtype=torch.long) if chunk_indices is None else None
    o, final = fla_chunk(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g.float().unsqueeze(0), beta.unsqueeze(0),
        scale=q.shape[-1] ** -0.5, initial_state=initial_state, output_final_state=True,
        use_qk_l2norm_in_kernel=not qk_normalized, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cpu,
        chunk_indices=chunk_indices,
    )
    return o[0], final.float()


def gdn_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               state_pool: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
    """One token for each of ``B`` sequences, the recurrent state updated in place in its slot.

    Args as :func:`tidal.kernels.gdn.gdn_decode_ref` (q, k raw ``[B, Hk, dk]``).
    """
    if use_triton(v, "gdn"):
        from .gdn_decode_triton import gdn_decode as triton_decode

        return triton_decode(q, k, v, g, beta, state_pool, slots, fresh)
    return gdn_decode_ref(q, k, v, g, beta, state_pool, slots, fresh)


# The largest (power-of-two padded) dk x dv state a step program holds in registers (a 128 x 128 head);
# larger heads take the three launches.
STEP_MAX_STATE = 128 * 128


def gdn_decode_step(qkv: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor, a_log: torch.Tensor,
                    dt_bias: torch.Tensor, norm_weight: torch.Tensor, norm_eps: float, activation: str,
                    state_pool: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
    """A batch of decode rows after the conv: the gates, the recurrent step (the states updated in place in
    their slots, as :func:`gdn_decode`) and the gated output norm, ``[B, Hv * dv]``; one Triton launch on the
    GPU (a head's state up to :data:`STEP_MAX_STATE` elements, padded to powers of two), :func:`gdn_gates`,
    :func:`gdn_decode` and :func:`~tidal.kernels.norm.gated_rms_norm` otherwise, and whenever ``TIDAL_KERNELS``
    sends ``gdn_step`` or any of those three (``gdn``, ``gdn_gates``, ``norm``) to torch.

    Args: qkv ``[B, 2 * Hk * dk + Hv * dv]`` the conv output (q, k raw); z ``[B, Hv * dv]``; b, a ``[B, Hv]``
    (the ``in_proj_b`` / ``in_proj_a`` outputs); a_log, dt_bias ``[Hv]``; norm_weight ``[dv]``; activation
    ``"silu"`` or ``"sigmoid"`` (the output gate's); state_pool ``[S, Hv, dk, dv]`` fp32; slots, fresh ``[B]``.
    Every tensor but the pool may be a column slice with unit stride along its last dimension.
    """
    v_heads, dk, dv = state_pool.shape[1:]
    if (next_pow2(dk) * next_pow2(dv) <= STEP_MAX_STATE and use_triton(qkv, "gdn_step") and use_triton(qkv, "gdn")
            and use_triton(qkv, "gdn_gates") and use_triton(qkv, "norm")):
        from .gdn_decode_triton import gdn_decode_step as triton_step

        return triton_step(qkv, z, b, a, a_log, dt_bias, norm_weight, norm_eps, activation, state_pool, slots, fresh)
    batch = qkv.shape[0]
    key_dim = (qkv.shape[1] - v_heads * dv) // 2
    q, k, v = torch.split(qkv, [key_dim, key_dim, v_heads * dv], dim=-1)
    g, beta = gdn_gates(a, b, a_log, dt_bias)
    core = gdn_decode(q.unflatten(-1, (key_dim // dk, dk)), k.unflatten(-1, (key_dim // dk, dk)),
                      v.unflatten(-1, (v_heads, dv)), g, beta, state_pool, slots, fresh)
    return gated_rms_norm(core, z.unflatten(-1, (v_heads, dv)), norm_weight, norm_eps, activation).reshape(batch, -1)
