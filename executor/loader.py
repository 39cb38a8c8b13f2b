"""Build a Qwen4-Exp model from a Hugging Face checkpoint directory (or seeded random weights)."""

from __future__ import annotations

import glob
import json
import logging
import os
import re
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from safetensors import safe_open

from ..config.model import ModelConfig
from ..kernels.quant import E4M3_MAX, quantize_fp8_tensor
from .distributed import single_rank, split, tp
from .distributed.shard import LazySlice, shard, shard_expert_part
from .layers.moe import RoutedExperts
from .memory.pinned import host_empty
from .models import Qwen4ExpForCausalLM
from .progress import progress
from .quant import QuantTensor, quantize_experts, stacked_block_rows
from .weights import (
    EXPERT_KEY,
    PLE_SHARD_KEY,
    canonical_name,
    is_experts,
    random_expert_chunks,
    random_table_chunks,
    random_tensor,
    vision_name,
)

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CheckpointError(ValueError):
    """A checkpoint whose tensors do not match its config; the message names the tensor."""


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    key = str(name).replace("torch.", "")
    if key in ("auto",):
        raise ValueError("dtype 'auto' must be resolved against the checkpoint first")
    if key not in DTYPES:
        raise ValueError(f"dtype {name!r} is not supported; expected one of {sorted(DTYPES)}")
    return DTYPES[key]


def resolve_dtype(name: str | torch.dtype | None, config: ModelConfig, device: str) -> torch.dtype:
    """``auto``: the checkpoint's dtype on GPU, float32 on CPU."""
    if name is None or name == "auto":
        if torch.device(device).type == "cpu":
            return torch.float32
        return DTYPES.get(config.torch_dtype, torch.bfloat16)
    return parse_dtype(name)


def host_resident(name: str, moe_strategy: str = "resident", ple_backend: str = "gpu") -> bool:
    """Whether parameter (or quantized-weight buffer) ``name`` lives in host memory: routed experts under
    ``--moe-strategy offload``, PLE tables under ``--ple-backend pinned`` (``disk`` keeps none: rows are read from
    the files)."""
    if moe_strategy == "offload" and ".mlp.experts." in name and not name.endswith("_block_rows"):
        return True
    return ple_backend != "gpu" and name.endswith("ngram_embedding.weight")


def stored_dtype(name: str, config: ModelConfig, dtype: torch.dtype) -> torch.dtype:
    """The dtype parameter ``name`` is kept in: ``dtype``, or float8 for an FP8 n-gram table."""
    q = config.quantization
    if name.endswith("ngram_embedding.weight") and q is not None and q.ngram is not None:
        return torch.float8_e4m3fn
    return dtype


def empty_model(config: ModelConfig, device: str | torch.device, dtype: torch.dtype, moe_strategy: str = "resident",
                ple_backend: str = "gpu") -> Qwen4ExpForCausalLM:
    """The module tree with uninitialised parameters on ``device`` (host-resident ones in host memory,
    page-locked to their exact size when the device is a GPU; a ``disk`` PLE table as an empty placeholder);
    integer buffers are filled."""
    with torch.device("meta"):
        model = Qwen4ExpForCausalLM(config)
    pin = torch.device(device).type == "cuda"
    for prefix, module in model.named_modules():
        for name, param in list(module.named_parameters(recurse=False)):
            full = f"{prefix}.{name}" if prefix else name
            kept = stored_dtype(full, config, dtype)
            if ple_backend == "disk" and full.endswith("ngram_embedding.weight"):
                tensor = torch.empty((0, param.shape[1]), dtype=kept, device="cpu")
            elif host_resident(full, moe_strategy, ple_backend):
                tensor = host_empty(param.shape, kept, pinned=pin)
            else:
                tensor = torch.empty(param.shape, dtype=kept, device=device)
            setattr(module, name, torch.nn.Parameter(tensor, requires_grad=False))
    # Buffers derived from the config on the CPU (n-gram hashing constants) move to the device; those made on
    # the meta device (scales filled by the loader) are made there.
    for module in model.modules():
        storage = module.storage() if isinstance(module, RoutedExperts) and module.fmt is not None else ()
        for name, buf in list(module.named_buffers(recurse=False)):
            if name in storage:
                continue
            meta = buf.device.type == "meta"
            module._buffers[name] = torch.ones(buf.shape, dtype=buf.dtype, device=device) if meta else buf.to(device)
    # Quantized experts' storage, placed as parameters are.
    for prefix, module in model.named_modules():
        if isinstance(module, RoutedExperts) and module.fmt is not None:
            for name in module.storage():
                buf = getattr(module, name)
                if host_resident(f"{prefix}.{name}", moe_strategy, ple_backend):
                    module._buffers[name] = host_empty(buf.shape, buf.dtype, pinned=pin)
                else:
                    module._buffers[name] = torch.empty(buf.shape, dtype=buf.dtype, device=device)
            for proj, (parts, _) in module.layout().items():
                if f"{proj}_block_rows" in module._buffers:
                    module._buffers[f"{proj}_block_rows"] = stacked_block_rows(parts).to(device)
    model.eval()
    return model


def load_model(path: str, device: str | torch.device = "cpu", dtype: str | torch.dtype | None = None,
               load_format: str = "safetensors", seed: int = 0, moe_strategy: str = "resident",
               ple_backend: str = "gpu", quantization: str | None = None, config: ModelConfig | None = None,
               exact_table_scale: bool = True) -> tuple[Qwen4ExpForCausalLM, ModelConfig]:
    """The model at ``path`` (``config``: its config as served, default read from ``path``; random weights with
    ``exact_table_scale=False``: see :func:`fill_random`)."""
    config = config or ModelConfig.from_file(path).with_quantization(quantization, load_format)
    torch_dtype = resolve_dtype(dtype, config, str(device))
    if load_format not in ("random", "safetensors"):
        raise ValueError(f"--load-format {load_format!r} is not supported; expected 'safetensors' or 'random'")
    began = time.perf_counter()
    model = empty_model(config, device, torch_dtype, moe_strategy, ple_backend)
    allocated = time.perf_counter()
    if load_format == "random":
        fill_random(model, config, seed, device, exact_table_scale)
    else:
        load_safetensors(model, config, path, skip_ple_tables=ple_backend == "disk")
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    logger.info("weights: allocated in %.1f s, %s in %.1f s", allocated - began,
                "drawn" if load_format == "random" else "read", time.perf_counter() - allocated)
    return model, config


def fill_random(model: Qwen4ExpForCausalLM, config: ModelConfig, seed: int, device: str | torch.device,
                exact_table_scale: bool = True) -> None:
    """Seeded weights, rounded through the checkpoint's dtype, generated on the model's ``device``
    (and copied to host memory for host-resident parameters). An FP8 n-gram table left on disk takes the scale
    its stored values would have (a pass over the whole table), or with ``exact_table_scale=False`` that of its
    first chunk (a model whose values do not matter: the compile workers').

    On the CPU these are exactly the values ``tidal checkpoint`` writes with this seed. On a GPU the
    device's generator makes them (seconds instead of minutes for the 13 G-parameter ``bench``
    preset): deterministic per seed and device type, whatever lives where, but not equal to the
    CPU's values.
    """
    stored = DTYPES.get(config.torch_dtype, torch.bfloat16)
    named = list(model.named_parameters())
    full_shapes = None
    # Every rank draws the full tensor and keeps its part (the same weights as one rank); a table left on disk is an
    # empty placeholder here, drawn whole only for its FP8 scale.
    if tp().size > 1 or any(n.endswith("ngram_embedding.weight") and not p.shape[0] for n, p in named):
        with single_rank(), torch.device("meta"):
            full_shapes = {n: tuple(p.shape) for n, p in Qwen4ExpForCausalLM(config).named_parameters()}
    quantized = [(n, m) for n, m in model.named_modules() if isinstance(m, RoutedExperts) and m.fmt is not None]
    bar = progress(total=len(named) + 2 * len(quantized), desc="random weights", unit="tensor", show=tp().rank == 0)
    tables = 0.0
    for name, param in named:
        bar.update()
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        shape = full_shapes[name] if full_shapes else tuple(param.shape)
        if name.endswith("ngram_embedding.weight"):
            began = time.perf_counter()
            _fill_random_table(model, name, param, shape, config, seed, device, stored, exact_table_scale)
            tables += time.perf_counter() - began
            continue
        if is_experts(name):
            for start, values in random_expert_chunks(name, shape, seed, device):
                param.data[start:start + values.shape[0]].copy_(shard(name, values, config).to(stored))
            continue
        value = shard(name, random_tensor(name, shape, config, seed, device=device), config)
        param.data.copy_(value.to(stored))
        del value
    # Quantized experts: the same values the parameters would get, rounded through the checkpoint dtype, then
    # quantized as a checkpoint's would be (each expert's gate, up and down its own tensor).
    inter, hidden = config.moe_intermediate_size, config.hidden_size
    began = time.perf_counter()
    for prefix, module in quantized:
        for proj, (shape, parts) in {"gate_up_proj": ((2 * inter, hidden), [inter, inter]),
                                     "down_proj": ((hidden, inter), [hidden])}.items():
            bar.update()
            for start, values in random_expert_chunks(f"{prefix}.{proj}", (module.num_experts, *shape), seed, device):
                store_experts(module, proj, quantize_experts(values.to(stored), parts, module.fmt), config, start)
    bar.close()
    if quantized:
        logger.info("random weights: n-gram tables drawn in %.1f s, experts drawn and quantized in %.1f s", tables,
                    time.perf_counter() - began)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight


def _fill_random_table(model: Qwen4ExpForCausalLM, name: str, param: torch.Tensor, shape: tuple[int, ...],
                       config: ModelConfig, seed: int, device: str | torch.device, stored: torch.dtype,
                       exact_scale: bool) -> None:
    """An n-gram table's random values, drawn and stored a chunk of rows at a time; an FP8 table takes one scale,
    ``amax / 448`` over the whole table, found in a first pass over the same chunks. A table left on disk (an empty
    ``param``) stores nothing: its rows are drawn when gathered (``SeededTable``), with that scale."""
    def chunks():
        for start, rows in random_table_chunks(name, shape, config, seed, device):
            yield start, shard(name, rows.to(stored), config)

    if param.dtype != torch.float8_e4m3fn:
        for start, rows in chunks() if param.shape[0] else ():
            param.data[start:start + rows.shape[0]].copy_(rows)
        return
    amax = torch.zeros((), dtype=torch.float32, device=device)
    for _, rows in random_table_chunks(name, shape, config, seed, device):
        amax = torch.maximum(amax, rows.to(stored).float().abs().amax())
        if not exact_scale and not param.shape[0]:
            break
    _, scale = quantize_fp8_tensor(amax)
    model.get_buffer(name + "_scale").copy_(scale)
    if not param.shape[0]:
        return
    for start, rows in chunks():
        param.data[start:start + rows.shape[0]].copy_((rows.float() / scale).clamp(-E4M3_MAX, E4M3_MAX)
                                                      .to(torch.float8_e4m3fn))


def store_experts(module: RoutedExperts, proj: str, full: QuantTensor, config: ModelConfig, first: int) -> None:
    """Copy this rank's part of quantized ``proj`` of experts ``first, first + 1, ...`` (all its rows: ``[E, 2I,
    ...]`` or ``[E, H, ...]``) into the module's storage."""
    target = module.weight(proj)[first:first + full.shape[0]]
    if tp().size == 1:
        target.copy_(full)
        return
    inter, n, fmt = config.moe_intermediate_size, module.intermediate, module.fmt
    if proj == "down_proj":
        target.data.copy_(_expert_slice(config, fmt, "down_proj", "data", full.data))
        target.scale.copy_(_expert_slice(config, fmt, "down_proj", "scale", full.scale))
        if full.scale_2 is not None:
            target.scale_2.copy_(full.scale_2)
        return
    blocks = -(-inter // 128)
    for i, part in enumerate(("gate_proj", "up_proj")):
        rows = slice(i * n, (i + 1) * n)
        target.data[:, rows].copy_(_expert_slice(config, fmt, part, "data", full.data[:, i * inter:(i + 1) * inter]))
        if fmt == "nvfp4":
            target.scale[:, rows].copy_(_expert_slice(config, fmt, part, "scale",
                                                      full.scale[:, i * inter:(i + 1) * inter]))
            target.scale_2[:, rows].copy_(full.scale_2[:, i * inter:i * inter + n])
        else:
            local = _expert_slice(config, fmt, part, "scale", full.scale[:, i * blocks:(i + 1) * blocks])
            target.scale[:, i * local.shape[1]:(i + 1) * local.shape[1]].copy_(local)


def _safetensor_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map", {})
        return sorted({os.path.join(path, v) for v in weight_map.values()})
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {path}")
    return files


# A quantized linear's companions: NVFP4 ``weight_scale`` (e4m3 per 16) + ``weight_scale_2`` (fp32), block FP8
# ``weight_scale_inv``, per-tensor FP8 ``weight_scale``; ``input_scale`` (activations) is not used.
SCALE_SUFFIXES = ("weight_scale_inv", "weight_scale_2", "weight_scale", "input_scale")
EXPERT_TENSOR = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\."
                           r"(weight|weight_scale_inv|weight_scale_2|weight_scale|input_scale)$")
STACKED_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)"
                            r"(?:_(weight_scale_inv|weight_scale_2|weight_scale|input_scale))?$")
# KV-cache scales of a checkpoint quantized with an FP8 KV cache: tidal keeps its KV cache in the compute dtype.
KV_SCALE = re.compile(r"\.(k_scale|v_scale|q_scale|k_proj\.output_scale|v_proj\.output_scale)$")
QUANT_DTYPES = (torch.uint8, torch.float8_e4m3fn)


class _Reader:
    """Every tensor of a checkpoint by its text-model name, read on demand (files stay open while loading)."""

    def __init__(self, path: str):
        self.files = _safetensor_files(path)
        self.index: dict[str, tuple[str, str]] = {}
        self.skipped: list[str] = []
        self.vision: dict[str, tuple[str, str]] = {}  # the vision tower's tensors, by name inside it
        self._open: dict[str, object] = {}
        for file in self.files:
            with safe_open(file, framework="pt") as f:
                for key in f.keys():
                    name = canonical_name(key)
                    inner = vision_name(key)
                    if inner is not None:
                        self.vision[inner] = (file, key)
                    elif name is None:
                        self.skipped.append(key)
                    else:
                        self.index[name] = (file, key)

    def _handle(self, file: str):
        if file not in self._open:
            self._open[file] = safe_open(file, framework="pt").__enter__()
        return self._open[file]

    def lazy(self, name: str) -> LazySlice:
        file, key = self.index[name]
        return LazySlice(self._handle(file).get_slice(key))

    def read(self, name: str) -> torch.Tensor:
        file, key = self.index[name]
        return self._handle(file).get_tensor(key)

    def dtype(self, name: str) -> torch.dtype:
        file, key = self.index[name]
        return _ST_TORCH[self._handle(file).get_slice(key).get_dtype()]

    def key(self, name: str) -> str:
        return self.index[name][1]

    def close(self) -> None:
        for handle in self._open.values():
            handle.__exit__(None, None, None)
        self._open.clear()


_ST_TORCH = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
             "U8": torch.uint8, "I8": torch.int8, "I32": torch.int32, "I64": torch.int64, "BOOL": torch.bool,
             "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def _scalar(reader: _Reader, name: str) -> torch.Tensor:
    t = reader.read(name)
    if t.numel() != 1:
        raise CheckpointError(f"tensor {reader.key(name)} has shape {list(t.shape)}; expected one value")
    return t.float().reshape(())


def _dequantize_linear(reader: _Reader, base: str, weight: torch.Tensor) -> torch.Tensor:
    """A quantized dense linear's values (fp32) from ``base.weight`` and its scales: NVFP4, block FP8 or per-tensor
    FP8, told apart by the tensors present."""
    from ..kernels.quant import dequantize_fp8_block, dequantize_fp8_tensor, dequantize_nvfp4

    has = {suffix: f"{base}.{suffix}" in reader.index for suffix in SCALE_SUFFIXES}
    key = reader.key(f"{base}.weight")
    if weight.dtype == torch.uint8:
        if not has["weight_scale"] or not has["weight_scale_2"]:
            missing = "weight_scale" if not has["weight_scale"] else "weight_scale_2"
            raise CheckpointError(f"tensor {key} is NVFP4 (uint8) but {base}.{missing} is missing")
        scale = reader.read(f"{base}.weight_scale")
        _check_nvfp4_scale(reader.key(f"{base}.weight_scale"), scale, weight.shape)
        return dequantize_nvfp4(weight, scale, _scalar(reader, f"{base}.weight_scale_2"))
    if has["weight_scale_inv"]:
        scale = reader.read(f"{base}.weight_scale_inv")
        _check_fp8_scale(reader.key(f"{base}.weight_scale_inv"), scale, weight.shape)
        return dequantize_fp8_block(weight, scale)
    if has["weight_scale"]:
        return dequantize_fp8_tensor(weight, _scalar(reader, f"{base}.weight_scale"))
    raise CheckpointError(f"tensor {key} is FP8 but has no weight_scale_inv or weight_scale")


def _check_nvfp4_scale(key: str, scale: torch.Tensor, packed_shape) -> None:
    want = (*packed_shape[:-1], packed_shape[-1] * 2 // 16)
    if scale.dtype != torch.float8_e4m3fn or tuple(scale.shape) != tuple(want):
        raise CheckpointError(f"tensor {key} has shape {list(scale.shape)} and dtype {scale.dtype}; expected "
                              f"{list(want)} float8_e4m3fn (one scale per 16 values)")


def _check_fp8_scale(key: str, scale: torch.Tensor, shape) -> None:
    want = (*shape[:-2], -(-shape[-2] // 128), -(-shape[-1] // 128))
    if tuple(scale.shape) != tuple(want) or scale.dtype not in (torch.float32, torch.bfloat16):
        raise CheckpointError(f"tensor {key} has shape {list(scale.shape)} and dtype {scale.dtype}; expected "
                              f"{list(want)} in float32 or bfloat16 (one scale per 128 x 128 block)")


def _expert_slice(config: ModelConfig, fmt: str, part: str, quantity: str, t: torch.Tensor) -> torch.Tensor:
    """This rank's part of one expert's quantized tensor ``quantity`` (``data``, ``scale``) of ``part``
    (``gate_proj``/``up_proj`` split on their rows, ``down_proj`` on its columns), on group or block bounds."""
    if tp().size == 1:
        return t
    full = config.moe_intermediate_size
    i0, n = split(full, "moe_intermediate_size")
    unit = 128 if fmt == "fp8" else (2 if quantity == "data" else 16)  # values per stored element of the dim
    rows = part != "down_proj"
    if fmt == "nvfp4" and rows:
        unit = 1
    if fmt == "fp8" and quantity == "data":
        unit = 1
    if i0 % (128 if fmt == "fp8" else 16) or ((i0 + n) % (128 if fmt == "fp8" else 16) and i0 + n != full):
        raise CheckpointError(_cut_message(config, fmt))
    start, stop = i0 // unit, -(-(i0 + n) // unit)
    return t.narrow(-2 if rows else -1, start, stop - start)


def _cut_message(config: ModelConfig, fmt: str) -> str:
    block = "128 x 128 FP8 blocks" if fmt == "fp8" else "NVFP4 groups of 16"
    n = config.moe_intermediate_size // tp().size
    return (f"--tp {tp().size}: moe_intermediate_size {config.moe_intermediate_size} splits into {n} per rank, which "
            f"cuts the {block} of the routed experts (use a --tp that keeps each rank's share a multiple of "
            f"{128 if fmt == 'fp8' else 16})")


def _load_quant_experts(module: RoutedExperts, base: str, reader: _Reader, config: ModelConfig) -> set[str]:
    """Fill a quantized :class:`RoutedExperts` from per-expert 2-D tensors or stacked 3-D ones; the names read."""
    fmt, used = module.fmt, set()
    inter, hidden, experts = config.moe_intermediate_size, config.hidden_size, module.num_experts
    want_dtype = torch.uint8 if fmt == "nvfp4" else torch.float8_e4m3fn
    gate_up, down = module.gate_up, module.down
    n = module.intermediate

    def store(target, e: int, rows: slice, part: str, data: torch.Tensor, scale: torch.Tensor,
              scale_2: torch.Tensor | None) -> None:
        target.data[e, rows].copy_(_expert_slice(config, fmt, part, "data", data))
        if fmt == "nvfp4":
            target.scale[e, rows].copy_(_expert_slice(config, fmt, part, "scale", scale))
            target.scale_2[e, rows] = scale_2
        else:  # the part's own blocks, at its place among the stacked block rows
            sliced = _expert_slice(config, fmt, part, "scale", scale).float()
            block_rows = target.block_rows[rows].to(sliced.device)
            target.scale[e].index_copy_(0, torch.unique(block_rows), sliced)

    shapes = {"gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}
    places = {"gate_proj": (gate_up, slice(0, n)), "up_proj": (gate_up, slice(n, 2 * n)),
              "down_proj": (down, slice(None))}
    if f"{base}.0.gate_proj.weight" in reader.index:
        for e in range(experts):
            for part, (rows_full, cols_full) in shapes.items():
                name = f"{base}.{e}.{part}"
                if f"{name}.weight" not in reader.index:
                    raise CheckpointError(f"missing expert tensors: ['{name}.weight']")
                data = reader.read(f"{name}.weight")
                stored = (rows_full, cols_full // 2) if fmt == "nvfp4" else (rows_full, cols_full)
                if data.dtype != want_dtype or tuple(data.shape) != stored:
                    raise CheckpointError(f"tensor {reader.key(name + '.weight')} has shape {list(data.shape)} and "
                                          f"dtype {data.dtype}; expected {list(stored)} {want_dtype} ({fmt} experts)")
                scale, scale_2 = _expert_scales(reader, name, fmt, data.shape)
                used.update(f"{name}.{s}" for s in ("weight", *SCALE_SUFFIXES) if f"{name}.{s}" in reader.index)
                target, rows = places[part]
                store(target, e, rows, part, data, scale, scale_2)
        return used
    # Stacked: gate_up_proj [E, 2I, ...] (gate rows first) and down_proj [E, H, ...] with their scales.
    for proj in ("gate_up_proj", "down_proj"):
        name = f"{base}.{proj}"
        if name not in reader.index:
            raise CheckpointError(f"missing expert tensors: ['{base}.0.gate_proj.weight'] (or the stacked {name})")
        data = reader.read(name)
        rows_full = 2 * inter if proj == "gate_up_proj" else hidden
        cols_full = hidden if proj == "gate_up_proj" else inter
        stored = (experts, rows_full, cols_full // 2 if fmt == "nvfp4" else cols_full)
        if data.dtype != want_dtype or tuple(data.shape) != stored:
            raise CheckpointError(f"tensor {reader.key(name)} has shape {list(data.shape)} and dtype {data.dtype}; "
                                  f"expected {list(stored)} {want_dtype} ({fmt} experts)")
        used.update(n_ for n_ in (name, *(f"{name}_{s}" for s in SCALE_SUFFIXES)) if n_ in reader.index)
        if fmt == "nvfp4":
            scale = _need(reader, f"{name}_weight_scale")
            _check_nvfp4_scale(reader.key(f"{name}_weight_scale"), scale, data.shape)
            scale_2 = _need(reader, f"{name}_weight_scale_2").float().reshape(experts, -1)
            if scale_2.shape[1] not in (1, 2 if proj == "gate_up_proj" else 1):
                raise CheckpointError(f"tensor {reader.key(f'{name}_weight_scale_2')} has shape "
                                      f"{list(scale_2.shape)}; expected one or (gate_up) two values per expert")
        else:
            scale = _need(reader, f"{name}_weight_scale_inv")
            if proj == "gate_up_proj" and inter % 128:
                raise CheckpointError(f"tensor {reader.key(name)}: stacked FP8 gate and up need "
                                      f"moe_intermediate_size a multiple of 128 (got {inter}); store them per expert")
            _check_fp8_scale(reader.key(f"{name}_weight_scale_inv"), scale, (experts, rows_full, cols_full))
            scale_2 = None
        for e in range(experts):
            if proj == "gate_up_proj":
                for i, part in enumerate(("gate_proj", "up_proj")):
                    rows_q = slice(i * inter, (i + 1) * inter)
                    s_rows = rows_q if fmt == "nvfp4" else slice(i * inter // 128, (i + 1) * inter // 128)
                    s2 = None if scale_2 is None else scale_2[e, min(i, scale_2.shape[1] - 1)]
                    target, rows = places[part]
                    store(target, e, rows, part, data[e, rows_q], scale[e, s_rows], s2)
            else:
                store(down, e, slice(None), "down_proj", data[e], scale[e], None if scale_2 is None else scale_2[e, 0])
    return used


def _need(reader: _Reader, name: str) -> torch.Tensor:
    if name not in reader.index:
        raise CheckpointError(f"missing tensor {name}")
    return reader.read(name)


def _expert_scales(reader: _Reader, name: str, fmt: str, data_shape) -> tuple[torch.Tensor, torch.Tensor | None]:
    if fmt == "nvfp4":
        for suffix in ("weight_scale", "weight_scale_2"):
            if f"{name}.{suffix}" not in reader.index:
                raise CheckpointError(f"tensor {reader.key(name + '.weight')} is NVFP4 but {name}.{suffix} is missing")
        scale = reader.read(f"{name}.weight_scale")
        _check_nvfp4_scale(reader.key(f"{name}.weight_scale"), scale, data_shape)
        return scale, _scalar(reader, f"{name}.weight_scale_2")
    if f"{name}.weight_scale_inv" not in reader.index:
        raise CheckpointError(f"tensor {reader.key(name + '.weight')} is FP8 but {name}.weight_scale_inv is missing")
    scale = reader.read(f"{name}.weight_scale_inv")
    _check_fp8_scale(reader.key(f"{name}.weight_scale_inv"), scale, data_shape)
    return scale, None


def load_safetensors(model: Qwen4ExpForCausalLM, config: ModelConfig, path: str,
                     skip_ple_tables: bool = False) -> None:
    """Fill ``model`` from the checkpoint's files; with ``skip_ple_tables`` the PLE shards stay on disk
    (they are only checked to exist: ``--ple-backend disk`` reads them on demand). Quantized routed experts and
    n-gram tables are kept as stored; any other quantized linear is dequantized here, once."""
    reader = _Reader(path)
    try:
        _Fill(model, config, reader, skip_ple_tables).run()
    finally:
        reader.close()


class _VisionReader:
    """The vision tower's tensors of a checkpoint, by their names inside the tower, read as ``_Reader`` reads."""

    def __init__(self, reader: _Reader):
        self.reader, self.index = reader, reader.vision

    def key(self, name: str) -> str:
        return self.index[name][1]

    def read(self, name: str) -> torch.Tensor:
        file, key = self.index[name]
        return self.reader._handle(file).get_tensor(key)


def _load_vision(tower, reader: _Reader) -> None:
    """The tower's weights; quantized linears (NVFP4, block or per-tensor FP8, as the text model's dense layers
    may be) are dequantized once, here."""
    vision = _VisionReader(reader)
    tensors = {}
    for name in vision.index:
        if name.endswith(SCALE_SUFFIXES):
            continue
        tensor = vision.read(name)
        if tensor.dtype in QUANT_DTYPES:
            if not name.endswith(".weight") or tensor.dim() != 2:
                raise CheckpointError(f"tensor {vision.key(name)} of the vision tower is quantized "
                                      f"({tensor.dtype}); only linear weights may be")
            tensor = _dequantize_linear(vision, name[: -len(".weight")], tensor)
        tensors[name] = tensor
    try:
        tower.load(tensors)
    except ValueError as e:
        raise CheckpointError(str(e)) from None


def _check_shape(key: str, target: torch.Tensor, shape) -> None:
    if tuple(shape) != tuple(target.shape):
        raise CheckpointError(f"tensor {key} has shape {list(shape)}, expected {list(target.shape)} from config.json")


@dataclass
class _LoadPlan:
    """Where each tensor of a checkpoint goes, decided from the names alone before any is read."""

    experts: list[tuple[str, str, int, str]] = field(default_factory=list)  # (name, base, expert, part)
    ple_shards: dict[str, list[tuple[int, str]]] = field(default_factory=lambda: defaultdict(list))
    params: list[str] = field(default_factory=list)
    buffers: list[str] = field(default_factory=list)  # derived from config.json; the checkpoint's wins
    ngram_scales: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)  # checkpoint keys


def _plan_load(reader: _Reader, params: dict, buffers: dict, quant_bases: set[str], used: set[str]) -> _LoadPlan:
    plan = _LoadPlan()
    for name in reader.index:
        if name in used or KV_SCALE.search(name):
            continue
        m = EXPERT_KEY.match(name)
        if m and m.group(1) not in quant_bases:
            gate_up = params.get(m.group(1) + ".gate_up_proj")
            if gate_up is None or int(m.group(2)) >= gate_up.shape[0]:
                plan.unexpected.append(reader.key(name))
            else:
                plan.experts.append((name, m.group(1), int(m.group(2)), m.group(3)))
            continue
        m = PLE_SHARD_KEY.match(name)
        if m:
            plan.ple_shards[m.group(1) + ".weight"].append((int(m.group(2)), name))
        elif name.endswith("ngram_embedding.weight_scale") and name in buffers:
            plan.ngram_scales.append(name)
        elif name.endswith(SCALE_SUFFIXES) and name.rsplit(".", 1)[0] + ".weight" in params:
            continue  # read with its weight
        elif name in params:
            plan.params.append(name)
        elif name in buffers:
            plan.buffers.append(name)
        else:
            plan.unexpected.append(reader.key(name))
    return plan


class _Fill:
    """The fill of a model's tensors from a checkpoint along a :class:`_LoadPlan`, remembering what it filled."""

    def __init__(self, model, config: ModelConfig, reader: _Reader, skip_ple_tables: bool):
        self.model, self.config, self.reader, self.skip_ple_tables = model, config, reader, skip_ple_tables
        self.params = dict(model.named_parameters())
        self.buffers = dict(model.named_buffers())
        self.modules = dict(model.named_modules())
        self.filled: set[str] = set()

    def run(self) -> None:
        reader = self.reader
        if reader.skipped:
            logger.info("not served: %d tensors of the checkpoint's multi-token prediction head (%s ...)",
                        len(reader.skipped), reader.skipped[0])
        self.vision()
        quant_bases = {n for n, m in self.modules.items() if isinstance(m, RoutedExperts) and m.fmt is not None}
        used: set[str] = set()
        for base in sorted(quant_bases):
            used |= _load_quant_experts(self.modules[base], base, reader, self.config)
            self.filled.add(base)
        plan = _plan_load(reader, self.params, self.buffers, quant_bases, used)
        bar = progress(total=len(plan.experts) + len(plan.params) + len(plan.buffers), desc="loading weights",
                       unit="tensor", show=tp().rank == 0)
        self.experts(plan, bar)
        self.dense(plan, bar)
        bar.close()
        for name, shards in plan.ple_shards.items():
            self.ple_table(name, shards, plan)
        self.check(plan)

    def vision(self) -> None:
        model, reader = self.model, self.reader
        if model.visual is not None and not reader.vision:
            logger.warning("config.json describes a vision tower but the checkpoint holds none of its tensors: "
                           "serving text only")
            model.visual = None
        if model.visual is not None:
            _load_vision(model.visual, reader)
        elif reader.vision:
            logger.info("not served: %d tensors of a vision tower config.json does not describe", len(reader.vision))

    def experts(self, plan: _LoadPlan, bar) -> None:
        """Unquantized routed experts, one part of one expert a tensor, into the stacked ``gate_up`` / ``down``."""
        reader, parts = self.reader, defaultdict(set)
        for name, base, expert, part in plan.experts:
            key = reader.key(name)
            if reader.dtype(name) in QUANT_DTYPES:
                raise CheckpointError(f"tensor {key} is quantized ({reader.dtype(name)}) but config.json names no "
                                      "quantization of the routed experts (quantization_config)")
            gate_up, down = self.params[base + ".gate_up_proj"], self.params[base + ".down_proj"]
            inter = down.shape[2]
            tensor = shard_expert_part(part, reader.lazy(name), self.config)
            if part == "down_proj":
                _check_shape(key, down[expert], tensor.shape)
                down.data[expert].copy_(tensor)
            else:
                rows = slice(0, inter) if part == "gate_proj" else slice(inter, 2 * inter)
                _check_shape(key, gate_up[expert, rows], tensor.shape)
                gate_up.data[expert, rows].copy_(tensor)
            parts[base].add((expert, part))
            bar.update()
        num_experts = self.config.num_experts
        for base, have in parts.items():
            missing = sorted(f"{base}.{e}.{p}.weight" for e in range(num_experts)
                             for p in ("gate_proj", "up_proj", "down_proj") if (e, p) not in have)
            if missing:
                raise CheckpointError(f"missing expert tensors: {missing[:4]}{' ...' if len(missing) > 4 else ''}")
            self.filled.update({base + ".gate_up_proj", base + ".down_proj"})

    def dense(self, plan: _LoadPlan, bar) -> None:
        """Parameters (quantized dense layers dequantized here, once), buffers and n-gram table scales."""
        reader, params, buffers = self.reader, self.params, self.buffers
        dequantized = 0
        for name in plan.params:
            if reader.dtype(name) in QUANT_DTYPES and params[name].dtype not in QUANT_DTYPES:
                values = _dequantize_linear(reader, name[: -len(".weight")], reader.read(name))
                tensor = shard(name, values, self.config)
                dequantized += values.numel()
            else:
                tensor = shard(name, reader.lazy(name), self.config)
            _check_shape(reader.key(name), params[name], tensor.shape)
            params[name].data.copy_(tensor)
            self.filled.add(name)
            bar.update()
        for name in plan.buffers:
            tensor = reader.read(name)
            _check_shape(reader.key(name), buffers[name], tensor.shape)
            if not torch.equal(tensor.to(buffers[name].device), buffers[name]):
                logger.warning("%s differs from the value derived from config.json; using the checkpoint's",
                               reader.key(name))
                buffers[name].copy_(tensor)
            bar.update()
        for name in plan.ngram_scales:
            buffers[name].copy_(_scalar(reader, name))
            self.filled.add(name)
        if dequantized:
            logger.info("dequantized %.2f G values of quantized dense layers to %s at load (routed experts and "
                        "n-gram tables stay as stored)", dequantized / 1e9, next(iter(params.values())).dtype)

    def ple_table(self, name: str, shards: list[tuple[int, str]], plan: _LoadPlan) -> None:
        """One n-gram table from its row shards (with ``skip_ple_tables`` only checked: it stays on disk)."""
        reader = self.reader
        if name not in self.params:
            plan.unexpected.extend(reader.key(n) for _, n in shards)
            return
        target = self.params[name]
        stored = {reader.dtype(n) for _, n in shards}
        fp8 = target.dtype == torch.float8_e4m3fn
        if fp8 != (stored == {torch.float8_e4m3fn}):
            raise CheckpointError(f"{name}: the shards are {sorted(map(str, stored))} but config.json names "
                                  f"{'an FP8' if fp8 else 'no FP8'} n-gram table")
        scale_name = name[: -len(".weight")] + ".weight_scale"
        if fp8 and scale_name not in reader.index:
            raise CheckpointError(f"the FP8 n-gram table {name} has no {scale_name}")
        self.filled.add(name)
        if self.skip_ple_tables:
            return
        shards = sorted(shards)
        indices = [i for i, _ in shards]
        if indices != list(range(len(shards))):
            raise CheckpointError(f"{name}: PLE shards {indices} are not numbered 0..{len(shards) - 1}")
        row = 0
        for _, shard_name in shards:
            part = shard(name, reader.lazy(shard_name), self.config)
            if part.dim() != 2 or part.shape[1] != target.shape[1] or row + part.shape[0] > target.shape[0]:
                raise CheckpointError(
                    f"tensor {reader.key(shard_name)} has shape {list(part.shape)}; the shards of {name} must stack "
                    f"to {list(target.shape)}"
                )
            target.data[row:row + part.shape[0]].copy_(part)
            row += part.shape[0]
        if row != target.shape[0]:
            raise CheckpointError(f"the shards of {name} hold {row} rows, expected {target.shape[0]} from config.json")

    def check(self, plan: _LoadPlan) -> None:
        """Nothing unexpected in the checkpoint, nothing of the model left unfilled."""
        if plan.unexpected:
            raise CheckpointError(
                f"unexpected tensors in the checkpoint (not part of this config): {sorted(plan.unexpected)[:6]}"
                f"{' ...' if len(plan.unexpected) > 6 else ''}"
            )
        if self.config.tie_word_embeddings and "lm_head.weight" not in self.filled:
            self.model.lm_head.weight = self.model.model.embed_tokens.weight
            self.filled.add("lm_head.weight")
        # the vision tower checks its own
        missing = sorted(n for n in set(self.params) - self.filled if not n.startswith("visual."))
        if missing:
            raise CheckpointError(f"missing tensors in the checkpoint: {missing[:6]}"
                                  f"{' ...' if len(missing) > 6 else ''}")
        scales = sorted(n for n in self.buffers if n.endswith("ngram_embedding.weight_scale") and n not in self.filled)
        if scales:
            raise CheckpointError(f"missing tensors in the checkpoint: {scales[:6]}")
