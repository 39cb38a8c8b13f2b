"""How a checkpoint stores its weights: read from ``config.json``'s ``quantization_config`` and/or
``hf_quant_config.json``, refused in one line when it is a method tidal does not serve.

Two published forms are served:

- **NVIDIA ModelOpt** (``quant_method: "modelopt"``, or ``hf_quant_config.json``): ``quant_algo`` ``NVFP4`` (every
  linear layer but the ``exclude_modules`` / ``ignore`` globs) or ``MIXED_PRECISION`` with a ``quantized_layers``
  map from a module path to ``{quant_algo, group_size}`` (``NVFP4``, ``FP8``, ``FP8_PB_WO``).
- **Block FP8** (``quant_method: "fp8"``, Qwen's and DeepSeek's): ``weight_block_size [128, 128]``, every linear
  layer but those whose name contains an entry of ``modules_to_not_convert``, plus ``modules_to_convert`` (the
  n-gram table).

tidal keeps the routed experts and the n-gram table in their stored format (on the device, in host banks, in the
expert cache, in the PLE backends) and dequantizes them inside the operation that uses them; any other quantized
linear layer is dequantized once, at load, to the compute dtype.
"""

from __future__ import annotations

import fnmatch
import json
import os
from dataclasses import dataclass, field
from typing import Any

# A format of stored weights: NVFP4 (e2m1 + e4m3 per 16 + fp32 global), FP8 in 128 x 128 blocks, or FP8 with one
# scale per tensor.
FORMATS = ("nvfp4", "fp8", "fp8_tensor")
SUPPORTED = ("ModelOpt NVFP4 (quant_method 'modelopt', quant_algo NVFP4 or MIXED_PRECISION) and block FP8 "
             "(quant_method 'fp8', weight_block_size [128, 128])")
_MODELOPT_ALGOS = {"NVFP4": "nvfp4", "FP8": "fp8_tensor", "FP8_PB_WO": "fp8"}


class QuantizationError(ValueError):
    """A ``quantization_config`` tidal does not serve; the message names the method and what is supported."""


@dataclass(frozen=True)
class Quantization:
    """The stored format of each module of a checkpoint (``None``: the checkpoint's float dtype)."""

    method: str  # "modelopt" or "fp8": the quant_method
    algo: str  # modelopt: "NVFP4" or "MIXED_PRECISION"; fp8: "block"
    # modelopt NVFP4: fnmatch globs kept in float; fp8: substrings of module names kept in float.
    exclude: tuple[str, ...] = ()
    # modelopt MIXED_PRECISION: module path -> format; fp8: modules_to_convert (format "fp8_tensor").
    layers: dict[str, str] = field(default_factory=dict)

    def module_format(self, module: str) -> str | None:
        """The format of module ``module`` (text-model naming, e.g. ``model.layers.0.mlp.experts``)."""
        if self.method == "modelopt" and self.algo == "MIXED_PRECISION":
            for path, fmt in self.layers.items():
                if module == path or module.startswith(path + ".") or fnmatch.fnmatch(module, path):
                    return fmt
            return None
        if self.method == "modelopt":
            return None if any(fnmatch.fnmatch(module, g) for g in self.exclude) else "nvfp4"
        for path in self.layers:  # fp8 modules_to_convert: the n-gram table
            if path in module:
                return "fp8_tensor"
        if any(entry in module for entry in self.exclude):
            return None
        return "fp8"

    @property
    def experts(self) -> str | None:
        return self._format_of("model.layers.0.mlp.experts", "mlp.experts")

    @property
    def ngram(self) -> str | None:
        return self._format_of("model.layers.0.ple.ple_embedding.ngram_embedding", "ngram_embedding")

    def _format_of(self, example: str, part: str) -> str | None:
        # MIXED_PRECISION names layers one by one: any layer of the kind decides.
        if self.method == "modelopt" and self.algo == "MIXED_PRECISION":
            for path, fmt in self.layers.items():
                if part in path:
                    return fmt
            return None
        return self.module_format(example)

    @property
    def label(self) -> str:
        """What ``/v1/models`` and the start-up log say, e.g. ``nvfp4 experts, fp8 n-gram table (modelopt)``."""
        parts = [f"{self.experts or 'unquantized'} experts"]
        if self.ngram:
            parts.append(f"{'fp8' if self.ngram.startswith('fp8') else self.ngram} n-gram table")
        return f"{', '.join(parts)} ({self.method})"

    def to_json(self) -> dict[str, Any]:
        return {"method": self.method, "algo": self.algo, "exclude": list(self.exclude), "layers": dict(self.layers)}


def _modelopt(q: dict, where: str) -> Quantization:
    algo = str(q.get("quant_algo") or "").upper()
    if algo == "NVFP4":
        group = q.get("group_size", 16)
        if group != 16:
            raise QuantizationError(f"{where}: NVFP4 group_size {group} is not supported (only 16)")
        exclude = q.get("exclude_modules") or q.get("ignore") or []
        return Quantization("modelopt", "NVFP4", exclude=tuple(str(g) for g in exclude))
    if algo == "MIXED_PRECISION":
        layers = {}
        for path, spec in (q.get("quantized_layers") or {}).items():
            sub = str((spec or {}).get("quant_algo") or "").upper()
            if sub not in _MODELOPT_ALGOS:
                raise QuantizationError(f"{where}: quantized_layers[{path!r}] quant_algo {sub!r} is not supported; "
                                        f"expected one of {sorted(_MODELOPT_ALGOS)}")
            if sub == "NVFP4" and (spec or {}).get("group_size", 16) != 16:
                raise QuantizationError(f"{where}: quantized_layers[{path!r}] group_size must be 16 for NVFP4")
            layers[_text_path(path)] = _MODELOPT_ALGOS[sub]
        if not layers:
            raise QuantizationError(f"{where}: quant_algo MIXED_PRECISION with no quantized_layers")
        return Quantization("modelopt", "MIXED_PRECISION", layers=layers)
    raise QuantizationError(f"{where}: ModelOpt quant_algo {algo or None!r} is not supported; tidal serves {SUPPORTED}")


def _text_path(path: str) -> str:
    """A module path in text-model naming (composite checkpoints prefix it with ``model.language_model.``)."""
    for prefix, to in (("model.language_model.", "model."), ("language_model.model.", "model."),
                       ("language_model.", "")):
        if path.startswith(prefix):
            return to + path[len(prefix):]
    return path


def _fp8(q: dict, where: str) -> Quantization:
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise QuantizationError(f"{where}: fp8 fmt {fmt!r} is not supported (only e4m3)")
    block = q.get("weight_block_size")
    if block is None or list(block) != [128, 128]:
        raise QuantizationError(f"{where}: fp8 weight_block_size {block} is not supported; tidal serves {SUPPORTED}")
    scheme = q.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise QuantizationError(f"{where}: fp8 activation_scheme {scheme!r} is not supported (only 'dynamic')")
    exclude = tuple(_text_path(str(m)) for m in q.get("modules_to_not_convert") or [])
    convert = {str(m): "fp8_tensor" for m in q.get("modules_to_convert") or []}
    return Quantization("fp8", "block", exclude=exclude, layers=convert)


def parse_quantization(config: dict | None, hf_quant: dict | None) -> Quantization | None:
    """The checkpoint's :class:`Quantization` from ``config.json``'s ``quantization_config`` (``config``) and
    ``hf_quant_config.json`` (``hf_quant``), or ``None`` for an unquantized checkpoint."""
    if hf_quant is not None:
        q = hf_quant.get("quantization", hf_quant)
        return _modelopt(q, "hf_quant_config.json")
    if not config:
        return None
    method = str(config.get("quant_method") or "").lower()
    where = "config.json quantization_config"
    if method == "modelopt":
        return _modelopt(config, where)
    if method == "fp8":
        return _fp8(config, where)
    raise QuantizationError(f"{where}: quant_method {config.get('quant_method')!r} is not supported; "
                            f"tidal serves {SUPPORTED}")


def read_quantization(path: str) -> Quantization | None:
    """:func:`parse_quantization` of a checkpoint directory."""
    hf_quant = None
    file = os.path.join(path, "hf_quant_config.json")
    if os.path.isfile(file):
        with open(file) as f:
            hf_quant = json.load(f)
    with open(os.path.join(path, "config.json")) as f:
        data = json.load(f)
    config = data.get("quantization_config") or (data.get("text_config") or {}).get("quantization_config")
    return parse_quantization(config, hf_quant)


def for_format(fmt: str) -> Quantization:
    """The published layout of ``--quantization nvfp4|fp8`` (what ``tidal checkpoint --quantize`` writes):
    NVFP4 as ModelOpt MIXED_PRECISION (routed experts NVFP4, the n-gram table FP8), FP8 as Qwen's block FP8 of
    the routed experts with the n-gram table FP8 (every other linear layer kept in float)."""
    if fmt == "nvfp4":
        return Quantization("modelopt", "MIXED_PRECISION",
                            layers={"model.layers.*.mlp.experts": "nvfp4",
                                    "model.layers.*.ple.ple_embedding.ngram_embedding": "fp8_tensor"})
    if fmt == "fp8":
        return Quantization("fp8", "block", exclude=FP8_FLOAT_MODULES,
                            layers={"ple.ple_embedding.ngram_embedding": "fp8_tensor"})
    raise QuantizationError(f"--quantization {fmt!r} is not supported; expected nvfp4 or fp8")


# The modules that block FP8 keeps in float when only the routed experts are quantized (entries are matched as
# parts of module names, as the format's readers match them).
FP8_FLOAT_MODULES = ("lm_head", "embed_tokens", "hyper_connection", "linear_attn", "self_attn", "mlp.gate",
                     "shared_expert", "ple.key_proj", "ple.value_proj", "ple.conv1d")
