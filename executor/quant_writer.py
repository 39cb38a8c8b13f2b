"""``tidal checkpoint --quantize nvfp4|fp8``: a checkpoint's routed experts and n-gram table in the layouts the
published Qwen4-Exp releases use.

- ``nvfp4``: NVIDIA ModelOpt ``MIXED_PRECISION`` (``hf_quant_config.json`` and ``config.json``'s
  ``quantization_config``): each expert's ``gate_proj``/``up_proj``/``down_proj`` as ``weight`` (uint8, two e2m1
  codes a byte), ``weight_scale`` (e4m3 per 16), ``weight_scale_2`` (fp32) and ``input_scale`` (fp32, unused by a
  weight-only reader); the n-gram table FP8 with one ``weight_scale``.
- ``fp8``: Qwen's block FP8 (``quant_method: fp8``, ``weight_block_size [128, 128]``): each expert's tensors as
  ``weight`` (float8_e4m3fn) and ``weight_scale_inv`` (bf16, one per 128 x 128 block); the n-gram table FP8 with
  one ``weight_scale`` (``modules_to_convert``); every other linear layer in float (``modules_to_not_convert``).
"""

from __future__ import annotations

import glob
import json
import os
import shutil
from collections.abc import Iterable, Iterator

import torch
from safetensors import safe_open

from ..config.model import ModelConfig
from ..config.quant import FP8_FLOAT_MODULES
from ..kernels.quant import quantize_fp8_block, quantize_fp8_tensor, quantize_nvfp4
from .weights import EXPERT_KEY, PLE_SHARD_KEY, canonical_name

WEIGHT_SUFFIXES = (".safetensors",)


def source_files(source: str) -> list[str]:
    index = os.path.join(source, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            return sorted({os.path.join(source, v) for v in json.load(f)["weight_map"].values()})
    files = sorted(glob.glob(os.path.join(source, "*.safetensors")))
    if not files:
        raise ValueError(f"--from {source}: no *.safetensors files")
    return files


def source_keys(source: str) -> list[str]:
    keys = []
    for file in source_files(source):
        with safe_open(file, framework="pt") as f:
            keys.extend(f.keys())
    return keys


def source_tensors(source: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a dense checkpoint, under its own key."""
    for file in source_files(source):
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                tensor = f.get_tensor(key)
                if tensor.dtype in (torch.uint8, torch.float8_e4m3fn):
                    raise ValueError(f"--from: tensor {key} is quantized already ({tensor.dtype}); give a dense "
                                     "checkpoint")
                yield key, tensor


def copy_source_files(source: str, out: str) -> None:
    """The source's tokenizer, chat template and generation config (everything but its weights and config)."""
    for path in glob.glob(os.path.join(source, "*")):
        name = os.path.basename(path)
        if os.path.isfile(path) and not name.endswith(WEIGHT_SUFFIXES) and name not in (
                "config.json", "model.safetensors.index.json", "hf_quant_config.json"):
            shutil.copyfile(path, os.path.join(out, name))


def quantization_files(out: str, data: dict, config: ModelConfig, fmt: str, prefix: str = "model.") -> dict:
    """``data`` (config.json) with its ``quantization_config`` for ``fmt``; ModelOpt's ``hf_quant_config.json``
    written beside it for ``nvfp4``."""
    data = dict(data)
    ple = [i for i in config.ple_layers]
    if fmt == "nvfp4":
        layers = {f"{prefix}layers.{i}.mlp.experts": {"quant_algo": "NVFP4", "group_size": 16}
                  for i in range(config.num_hidden_layers)}
        layers.update({f"{prefix}layers.{i}.ple.ple_embedding.ngram_embedding": {"quant_algo": "FP8"} for i in ple})
        quant = {"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": None, "quantized_layers": layers}
        with open(os.path.join(out, "hf_quant_config.json"), "w") as f:
            json.dump({"producer": {"name": "tidal"}, "quantization": quant}, f, indent=2)
        data["quantization_config"] = {"quant_method": "modelopt", **quant}
    elif fmt == "fp8":
        data["quantization_config"] = {
            "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
            "modules_to_not_convert": list(FP8_FLOAT_MODULES),
            "modules_to_convert": ["ple.ple_embedding.ngram_embedding"],
        }
    else:
        raise ValueError(f"--quantize {fmt!r} is not supported; expected nvfp4 or fp8")
    return data


def quantized_tensors(tensors: Iterable[tuple[str, torch.Tensor]], config: ModelConfig,
                      fmt: str) -> Iterator[tuple[str, torch.Tensor]]:
    """``tensors`` with every routed expert's tensors and every n-gram table in ``fmt``'s layout, the rest as they
    are. An n-gram table's shards are held until all have come (they share one scale)."""
    shards = max(1, config.split_ngram_parts)
    tables: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for key, tensor in tensors:
        name = canonical_name(key) or key
        if EXPERT_KEY.match(name):
            base = key[: -len("weight")]
            if fmt == "nvfp4":
                if tensor.shape[-1] % 16:
                    raise ValueError(f"--quantize nvfp4: {key} has rows of {tensor.shape[-1]} values; NVFP4 needs a "
                                     "multiple of 16")
                packed, scale, scale_2 = quantize_nvfp4(tensor)
                yield key, packed
                yield base + "weight_scale", scale
                yield base + "weight_scale_2", scale_2.reshape(())
                yield base + "input_scale", torch.ones((), dtype=torch.float32)
            else:
                values, scale = quantize_fp8_block(tensor, torch.bfloat16)
                yield key, values
                yield base + "weight_scale_inv", scale
            continue
        m = PLE_SHARD_KEY.match(name)
        if m:
            table = key[: key.index(".shard_")]
            tables.setdefault(table, []).append((key, tensor))
            if len(tables[table]) == shards:
                yield from _fp8_table(table, tables.pop(table))
            continue
        yield key, tensor
    for table, parts in tables.items():  # fewer shards than split_ngram_parts (a checkpoint written otherwise)
        yield from _fp8_table(table, parts)


def _fp8_table(table: str, parts: list[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The shards of one n-gram table in FP8 with one scale: ``amax / 448`` over the whole table."""
    amax = max(float(t.float().abs().amax()) for _, t in parts if t.numel())
    _, scale = quantize_fp8_tensor(torch.tensor([amax]))
    for key, tensor in parts:
        yield key, (tensor.float() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    yield f"{table}.weight_scale", scale.reshape(())
