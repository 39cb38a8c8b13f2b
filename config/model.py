"""The Qwen4-Exp model configuration, parsed once from a checkpoint's ``config.json``.

Every process reads the same :class:`ModelConfig`: the executor builds the model from it, the
scheduler sizes state slots and KV pages from it, the frontend checks prompt lengths and vocabulary
against it. It imports nothing heavier than the standard library.
"""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass, field, fields, replace
from typing import Any

from .quant import Quantization, QuantizationError, read_quantization

LINEAR = "linear_attention"
ATTENTION = "attention"
# Names different writers give to the gated (QSA-indexed) attention layers.
ATTENTION_LAYER_NAMES = ("full_attention", "qwen_sparse_attention", "indexed_attention", "attention")
SUPPORTED_MODEL_TYPES = ("qwen4_exp", "qwen4_exp_text")


class ConfigError(ValueError):
    """A checkpoint configuration that tidal cannot serve; the message names the field."""


def _prime(value: int) -> bool:
    if value < 2:
        return False
    if value % 2 == 0:
        return value == 2
    for divisor in range(3, math.isqrt(value) + 1, 2):
        if value % divisor == 0:
            return False
    return True


@functools.lru_cache(maxsize=256)
def ngram_head_vocab_sizes(base: int, ple_layer_index: int, num_heads: int) -> tuple[int, ...]:
    """Distinct prime vocabulary sizes of one PLE layer's hashed n-gram heads.

    Head ``h`` of PLE layer ``i`` takes the ``(i * num_heads + h + 1)``-th prime at or above ``base``,
    so every head of every layer hashes into its own prime-sized table.
    """
    sizes: list[int] = []
    prime = base - 1
    for _ in range(ple_layer_index * num_heads + num_heads):
        prime += 1
        while not _prime(prime):
            prime += 1
        sizes.append(prime)
    return tuple(sizes[ple_layer_index * num_heads:])


@dataclass(frozen=True)
class ModelConfig:
    """The text part of a Qwen4-Exp checkpoint, validated."""

    vocab_size: int = 248320
    hidden_size: int = 2048
    num_hidden_layers: int = 40
    num_attention_heads: int = 16
    num_key_value_heads: int = 2
    head_dim: int = 256
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    rope_theta: float = 10_000.0  # transformers' default when config.json names none
    partial_rotary_factor: float = 1.0
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    output_gate_type: str = "silu"
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    num_experts: int = 512
    num_experts_per_tok: int = 10
    norm_topk_prob: bool = True
    # Normalised: every entry is LINEAR or ATTENTION.
    layer_types: tuple[str, ...] = ()
    hc_count: int = 4
    hc_lowrank: int = 320
    # One-indexed, sorted, as in the reference.
    ple_layer_ids: tuple[int, ...] = ()
    ple_embed_dim: int = 2048
    ple_conv_kernel_size: int = 4
    ngram_size: int = 3
    heads_per_ngram: int = 8
    ngram_vocab_size_base: int = 20_000_000
    make_ngram_vocab_size_divisible_by: int = 128
    seed: int = 1234
    split_ngram_parts: int = 512
    indexer_n_heads: int | None = None
    indexer_head_dim: int | None = None
    indexer_budget: int | None = None
    indexer_compress_ratio: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "bfloat16"
    # The multimodal rotary's (temporal, row, column) frequency sections; text positions are equal on all three.
    mrope_section: tuple[int, int, int] = (11, 11, 10)
    # A composite checkpoint's vision tower (its raw ``vision_config``; None: text only) and its token ids.
    vision_config: dict | None = field(default=None, compare=False, repr=False)
    image_token_id: int = 248056
    vision_start_token_id: int = 248053
    vision_end_token_id: int = 248054
    # How the checkpoint stores its weights (config/quant.py); None: in torch_dtype.
    quantization: Quantization | None = field(default=None, compare=False)
    # Raw text-config dict (the executor ranks compare its digest at start-up).
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    def with_quantization(self, flag: str | None, load_format: str = "safetensors") -> ModelConfig:
        """This config as ``--quantization flag`` serves it: with ``--load-format random`` random weights in that
        published layout; with a checkpoint, the checkpoint's own format, which the flag must name if given."""
        if flag is None:
            return self
        from .quant import for_format

        wanted = for_format(flag)
        if load_format == "random":
            return replace(self, quantization=wanted)
        have = self.quantization.experts if self.quantization is not None else None
        if have != wanted.experts:
            raise ConfigError(f"--quantization {flag}: the checkpoint's routed experts are "
                              f"{have or 'not quantized'} (tidal does not quantize a checkpoint at load)")
        return self

    def first_layers(self, n: int) -> ModelConfig:
        """This config with only its first ``n`` decoder layers (and the PLE layers among them)."""
        return replace(self, num_hidden_layers=n, layer_types=self.layer_types[:n],
                       ple_layer_ids=tuple(i for i in self.ple_layer_ids if i <= n))

    # ---- derived facts ------------------------------------------------------------------------
    @property
    def linear_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == LINEAR]

    @property
    def attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == ATTENTION]

    @property
    def ple_layers(self) -> list[int]:
        """Zero-indexed decoder layers carrying a PLE module."""
        return [i - 1 for i in self.ple_layer_ids]

    @property
    def has_qsa(self) -> bool:
        return self.indexer_n_heads is not None

    @property
    def qsa_block_topk(self) -> int:
        assert self.indexer_budget is not None and self.indexer_compress_ratio is not None
        return self.indexer_budget // self.indexer_compress_ratio

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def ngram_heads(self) -> int:
        return (self.ngram_size - 1) * self.heads_per_ngram

    @property
    def ngram_context(self) -> int:
        """Token ids a request carries between forwards for PLE hashing."""
        return self.ngram_size - 1

    @property
    def ple_conv_window(self) -> int:
        """Rows of PLE conv history: ``(kernel - 1) * dilation`` with dilation ``ngram_size``."""
        return (self.ple_conv_kernel_size - 1) * self.ngram_size

    @property
    def gdn_conv_dim(self) -> int:
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + (
            self.linear_num_value_heads * self.linear_value_head_dim
        )

    @property
    def ple_eos_id(self) -> int:
        return self.eos_token_ids[0]

    @property
    def ngram_eos_id(self) -> int:
        """The id an n-gram history is padded with: the EOS id where a PLE layer hashes n-grams, else 0."""
        return self.ple_eos_id if self.ple_layer_ids else 0

    @property
    def qsa_ratio(self) -> int:
        """Tokens per compressed QSA block, 0 without a QSA indexer."""
        return self.indexer_compress_ratio if self.has_qsa else 0

    def ngram_vocab_sizes(self, ple_layer_index: int) -> list[int]:
        return list(ngram_head_vocab_sizes(self.ngram_vocab_size_base, ple_layer_index, self.ngram_heads))

    def ngram_table_rows(self, ple_layer_index: int) -> int:
        total = sum(self.ngram_vocab_sizes(ple_layer_index))
        div = self.make_ngram_vocab_size_divisible_by
        return math.ceil(total / div) * div

    # ---- parsing ------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelConfig":
        model_type = data.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"config.json: model_type {model_type!r} is not supported; expected one of {SUPPORTED_MODEL_TYPES}"
            )
        outer_tie = data.get("tie_word_embeddings")
        outer_dtype = data.get("dtype") or data.get("torch_dtype")
        if model_type == "qwen4_exp":
            text = data.get("text_config")
            if not isinstance(text, dict):
                raise ConfigError("config.json: model_type 'qwen4_exp' needs a 'text_config' object")
            text = dict(text)
            text.setdefault("tie_word_embeddings", outer_tie if outer_tie is not None else False)
            if outer_dtype and not (text.get("dtype") or text.get("torch_dtype")):
                text["dtype"] = outer_dtype
        else:
            text = dict(data)
        config = cls._from_text(text)
        vision = data.get("vision_config") if model_type == "qwen4_exp" else None
        if vision is None:
            return config
        if not isinstance(vision, dict):
            raise ConfigError("config.json: vision_config must be an object")
        ids = {k: int(data[k]) for k in ("image_token_id", "vision_start_token_id", "vision_end_token_id") if k in data}
        return replace(config, vision_config=dict(vision), **ids)

    @classmethod
    def from_file(cls, path: str) -> "ModelConfig":
        cfg_path = os.path.join(path, "config.json") if os.path.isdir(path) else path
        try:
            with open(cfg_path) as f:
                data = json.load(f)
        except FileNotFoundError:
            raise ConfigError(f"no config.json at {cfg_path}") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{cfg_path} is not valid JSON: {e}") from None
        config = cls.from_dict(data)
        try:
            quantization = read_quantization(os.path.dirname(cfg_path) or ".")
        except QuantizationError as e:
            raise ConfigError(str(e)) from None
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"hf_quant_config.json: {e}") from None
        return replace(config, quantization=quantization) if quantization is not None else config

    @classmethod
    def _from_text(cls, text: dict[str, Any]) -> "ModelConfig":
        known = {f.name for f in fields(cls)}
        kw: dict[str, Any] = {}
        for key, value in text.items():
            if key in known and key not in ("layer_types", "ple_layer_ids", "raw", "eos_token_ids", "quantization",
                                                "mrope_section", "vision_config"):
                kw[key] = value
        hidden = int(text.get("hidden_size", cls.hidden_size))
        heads = int(text.get("num_attention_heads", cls.num_attention_heads))
        kw["head_dim"] = int(text.get("head_dim") or hidden // heads)
        kw["output_gate_type"] = text.get("output_gate_type") or text.get("hidden_act", "silu")
        kw["torch_dtype"] = str(text.get("dtype") or text.get("torch_dtype") or "bfloat16").replace("torch.", "")
        if "num_key_value_heads" not in text or text["num_key_value_heads"] is None:
            kw["num_key_value_heads"] = heads

        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "mrope"):
            raise ConfigError(f"config.json: rope_parameters.rope_type {rope_type!r} is not supported (only 'default')")
        theta = rope.get("rope_theta", text.get("rope_theta"))
        if theta is None:
            theta = cls.rope_theta
        kw["rope_theta"] = float(theta)
        section = rope.get("mrope_section") or cls.mrope_section
        if len(section) != 3:
            raise ConfigError(f"config.json: rope_parameters.mrope_section must have 3 entries, got {section}")
        kw["mrope_section"] = tuple(int(x) for x in section)
        kw["partial_rotary_factor"] = float(
            rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 1.0)) or 1.0
        )

        n_layers = int(text.get("num_hidden_layers", cls.num_hidden_layers))
        raw_types = text.get("layer_types")
        if raw_types is None:
            interval = int(text.get("full_attention_interval", 4))
            raw_types = [LINEAR if (i + 1) % interval else "full_attention" for i in range(n_layers)]
        if len(raw_types) < n_layers:
            raise ConfigError(
                f"config.json: layer_types has {len(raw_types)} entries, num_hidden_layers is {n_layers}"
            )
        types = []
        for i, t in enumerate(raw_types[:n_layers]):
            if t == LINEAR:
                types.append(LINEAR)
            elif t in ATTENTION_LAYER_NAMES:
                types.append(ATTENTION)
            else:
                raise ConfigError(
                    f"config.json: layer_types[{i}] = {t!r} is not supported; expected "
                    f"{LINEAR!r} or one of {ATTENTION_LAYER_NAMES}"
                )
        kw["layer_types"] = tuple(types)
        kw["ple_layer_ids"] = tuple(sorted(set(int(i) for i in (text.get("ple_layer_ids") or []))))
        if text.get("ple_embed_dim") is None:
            kw["ple_embed_dim"] = hidden
        eos = text.get("eos_token_id")
        if eos is None:
            eos_ids: tuple[int, ...] = ()
        elif isinstance(eos, list):
            eos_ids = tuple(int(e) for e in eos)
        else:
            eos_ids = (int(eos),)
        kw["eos_token_ids"] = eos_ids
        kw.pop("tie_word_embeddings", None)
        kw["tie_word_embeddings"] = bool(text.get("tie_word_embeddings", False))
        kv_heads = text.get("indexer_kv_heads")
        cfg = cls(raw=dict(text), **kw)
        cfg._validate(kv_heads)
        return cfg

    def _validate(self, indexer_kv_heads: int | None) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ConfigError(f"config.json: {msg}")

        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "linear_key_head_dim", "linear_value_head_dim",
                     "linear_num_key_heads", "linear_num_value_heads", "moe_intermediate_size",
                     "shared_expert_intermediate_size", "num_experts", "hc_lowrank"):
            need(int(getattr(self, name)) > 0, f"{name} must be > 0, got {getattr(self, name)}")
        need(self.hidden_act == "silu", f"hidden_act {self.hidden_act!r} is not supported (only 'silu')")
        need(self.output_gate_type in ("silu", "sigmoid"),
             f"output_gate_type {self.output_gate_type!r} must be 'silu' or 'sigmoid'")
        need(self.hc_count > 1, f"hc_count must be > 1, got {self.hc_count}")
        need(0 < self.num_experts_per_tok <= self.num_experts,
             f"num_experts_per_tok must be in [1, num_experts={self.num_experts}], got {self.num_experts_per_tok}")
        need(self.num_attention_heads % self.num_key_value_heads == 0,
             f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
             f"num_key_value_heads ({self.num_key_value_heads})")
        need(self.linear_num_value_heads % self.linear_num_key_heads == 0,
             f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
             f"linear_num_key_heads ({self.linear_num_key_heads})")
        need(self.rotary_dim % 2 == 0 and 0 < self.rotary_dim <= self.head_dim,
             f"head_dim * partial_rotary_factor = {self.rotary_dim} must be even and in (0, head_dim]")
        qsa = {
            "indexer_n_heads": self.indexer_n_heads,
            "indexer_kv_heads": indexer_kv_heads,
            "indexer_head_dim": self.indexer_head_dim,
            "indexer_budget": self.indexer_budget,
            "indexer_compress_ratio": self.indexer_compress_ratio,
        }
        if any(v is not None for v in qsa.values()):
            missing = [k for k, v in qsa.items() if v is None]
            need(not missing, f"QSA indexer is missing {missing}")
            need(all(int(v) > 0 for v in qsa.values()), f"QSA indexer values must be positive: {qsa}")
            need(indexer_kv_heads == 1, f"indexer_kv_heads must be 1, got {indexer_kv_heads}")
            need(self.indexer_budget % self.indexer_compress_ratio == 0,
                 f"indexer_budget ({self.indexer_budget}) must be divisible by "
                 f"indexer_compress_ratio ({self.indexer_compress_ratio})")
            need(self.rotary_dim <= self.indexer_head_dim,
                 f"rotary dim {self.rotary_dim} must fit indexer_head_dim {self.indexer_head_dim}")
        if self.ple_layer_ids:
            need(self.ngram_size >= 2, f"ngram_size must be >= 2 with PLE layers, got {self.ngram_size}")
            need(self.heads_per_ngram > 0, f"heads_per_ngram must be > 0, got {self.heads_per_ngram}")
            need(self.ple_embed_dim > 0 and self.ple_embed_dim % self.ngram_heads == 0,
                 f"ple_embed_dim ({self.ple_embed_dim}) must be divisible by the n-gram head count "
                 f"({self.ngram_heads})")
            bad = [i for i in self.ple_layer_ids if not 1 <= i <= self.num_hidden_layers]
            need(not bad, f"ple_layer_ids must be one-indexed in [1, {self.num_hidden_layers}], got {bad}")
            not_linear = [i for i in self.ple_layer_ids if self.layer_types[i - 1] != LINEAR]
            need(not not_linear, f"PLE is only supported on linear_attention layers, got {not_linear}")
            need(bool(self.eos_token_ids), "eos_token_id must be set when PLE layers are enabled")
            need(self.ple_conv_kernel_size >= 1, f"ple_conv_kernel_size must be >= 1, got {self.ple_conv_kernel_size}")
            need(self.ngram_vocab_size_base >= 2,
                 f"ngram_vocab_size_base must be >= 2, got {self.ngram_vocab_size_base}")
