"""Build a Qwen4-Exp model from a Hugging Face checkpoint directory (or seeded random weights)."""

from __future__ import annotations

import glob
import json
import logging
import os
from collections import defaultdict

import torch
from safetensors import safe_open

from ..config.model import ModelConfig
from .distributed import single_rank, tp
from .distributed.shard import LazySlice, shard, shard_expert_part
from .models import Qwen4ExpForCausalLM
from .progress import progress
from .weights import EXPERT_KEY, PLE_SHARD_KEY, canonical_name, random_tensor

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
    """Whether parameter ``name`` lives in host memory: routed experts under ``--moe-strategy offload``,
    PLE tables under ``--ple-backend pinned`` (``disk`` keeps none: rows are read from the files)."""
    if moe_strategy == "offload" and name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
        return True
    return ple_backend != "gpu" and name.endswith("ngram_embedding.weight")


def empty_model(config: ModelConfig, device: str | torch.device, dtype: torch.dtype, moe_strategy: str = "resident",
                ple_backend: str = "gpu") -> Qwen4ExpForCausalLM:
    """The module tree with uninitialised parameters on ``device`` (host-resident ones in host memory,
    pinned when the device is a GPU; a ``disk`` PLE table as an empty placeholder); integer buffers
    are filled."""
    with torch.device("meta"):
        model = Qwen4ExpForCausalLM(config)
    pin = torch.device(device).type == "cuda"
    for prefix, module in model.named_modules():
        for name, param in list(module.named_parameters(recurse=False)):
            full = f"{prefix}.{name}" if prefix else name
            if ple_backend == "disk" and full.endswith("ngram_embedding.weight"):
                tensor = torch.empty((0, param.shape[1]), dtype=dtype, device="cpu")
            elif host_resident(full, moe_strategy, ple_backend):
                tensor = torch.empty(param.shape, dtype=dtype, device="cpu", pin_memory=pin)
            else:
                tensor = torch.empty(param.shape, dtype=dtype, device=device)
            setattr(module, name, torch.nn.Parameter(tensor, requires_grad=False))
    # Integer buffers (n-gram hashing constants) were derived from the config on the CPU.
    for module in model.modules():
        for name, buf in list(module.named_buffers(recurse=False)):
            module._buffers[name] = buf.to(device)
    model.eval()
    return model


def load_model(path: str, device: str | torch.device = "cpu", dtype: str | torch.dtype | None = None,
               load_format: str = "safetensors", seed: int = 0, moe_strategy: str = "resident",
               ple_backend: str = "gpu") -> tuple[Qwen4ExpForCausalLM, ModelConfig]:
    config = ModelConfig.from_file(path)
    torch_dtype = resolve_dtype(dtype, config, str(device))
    model = empty_model(config, device, torch_dtype, moe_strategy, ple_backend)
    if load_format == "random":
        if ple_backend == "disk":
            raise ValueError("--ple-backend disk reads the table from the checkpoint's files; --load-format random "
                             "has none")
        fill_random(model, config, seed, device)
    elif load_format == "safetensors":
        load_safetensors(model, config, path, skip_ple_tables=ple_backend == "disk")
    else:
        raise ValueError(f"--load-format {load_format!r} is not supported; expected 'safetensors' or 'random'")
    return model, config


def fill_random(model: Qwen4ExpForCausalLM, config: ModelConfig, seed: int, device: str | torch.device) -> None:
    """Seeded weights, rounded through the checkpoint's dtype, generated on the model's ``device``
    (and copied to host memory for host-resident parameters).

    On the CPU these are exactly the values ``tidal checkpoint`` writes with this seed. On a GPU the
    device's generator makes them (seconds instead of minutes for the 13 G-parameter ``bench``
    preset): deterministic per seed and device type, whatever lives where, but not equal to the
    CPU's values.
    """
    stored = DTYPES.get(config.torch_dtype, torch.bfloat16)
    full_shapes = None
    if tp().size > 1:  # every rank draws the full tensor and keeps its part: the same weights as one rank
        with single_rank(), torch.device("meta"):
            full_shapes = {n: tuple(p.shape) for n, p in Qwen4ExpForCausalLM(config).named_parameters()}
    named = list(model.named_parameters())
    for name, param in progress(named, desc="random weights", unit="tensor", show=tp().rank == 0):
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        shape = full_shapes[name] if full_shapes else tuple(param.shape)
        value = shard(name, random_tensor(name, shape, config, seed, device=device), config)
        param.data.copy_(value.to(stored))
        del value
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight


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


def load_safetensors(model: Qwen4ExpForCausalLM, config: ModelConfig, path: str,
                     skip_ple_tables: bool = False) -> None:
    """Fill ``model`` from the checkpoint's files; with ``skip_ple_tables`` the PLE shards stay on disk
    (they are only checked to exist: ``--ple-backend disk`` reads them on demand)."""
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    filled: set[str] = set()
    expert_parts: dict[str, set[tuple[int, str]]] = defaultdict(set)
    ple_shards: dict[str, list[tuple[int, str, str]]] = defaultdict(list)
    unexpected: list[str] = []

    def check_shape(key: str, target: torch.Tensor, shape) -> None:
        if tuple(shape) != tuple(target.shape):
            raise CheckpointError(
                f"tensor {key} has shape {list(shape)}, expected {list(target.shape)} from config.json"
            )

    files = _safetensor_files(path)
    tensors = 0
    for file in files:
        with safe_open(file, framework="pt") as f:
            tensors += len(f.keys())
    bar = progress(total=tensors, desc="loading weights", unit="tensor", show=tp().rank == 0)
    for file in files:
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                bar.update()
                name = canonical_name(key)
                if name is None:
                    continue
                m = EXPERT_KEY.match(name)
                if m:
                    base, expert, part = m.group(1), int(m.group(2)), m.group(3)
                    gate_up, down = params.get(base + ".gate_up_proj"), params.get(base + ".down_proj")
                    if gate_up is None or expert >= gate_up.shape[0]:
                        unexpected.append(key)
                        continue
                    inter = down.shape[2]
                    tensor = shard_expert_part(part, LazySlice(f.get_slice(key)), config)
                    if part == "down_proj":
                        check_shape(key, down[expert], tensor.shape)
                        down.data[expert].copy_(tensor)
                    else:
                        rows = slice(0, inter) if part == "gate_proj" else slice(inter, 2 * inter)
                        check_shape(key, gate_up[expert, rows], tensor.shape)
                        gate_up.data[expert, rows].copy_(tensor)
                    expert_parts[base].add((expert, part))
                    continue
                m = PLE_SHARD_KEY.match(name)
                if m:
                    ple_shards[m.group(1) + ".weight"].append((int(m.group(2)), file, key))
                    continue
                if name in params:
                    tensor = shard(name, LazySlice(f.get_slice(key)), config)
                    check_shape(key, params[name], tensor.shape)
                    params[name].data.copy_(tensor)
                    filled.add(name)
                elif name in buffers:
                    tensor = f.get_tensor(key)
                    check_shape(key, buffers[name], tensor.shape)
                    if not torch.equal(tensor.to(buffers[name].device), buffers[name]):
                        logger.warning("%s differs from the value derived from config.json; using the checkpoint's",
                                       key)
                        buffers[name].copy_(tensor)
                else:
                    unexpected.append(key)

    bar.close()
    for name, shards in ple_shards.items():
        if name not in params:
            unexpected.extend(key for _, _, key in shards)
            continue
        if skip_ple_tables:
            filled.add(name)
            continue
        shards.sort()
        indices = [i for i, _, _ in shards]
        if indices != list(range(len(shards))):
            raise CheckpointError(f"{name}: PLE shards {indices} are not numbered 0..{len(shards) - 1}")
        target, row = params[name], 0
        for _, file, key in shards:
            with safe_open(file, framework="pt") as f:
                part = shard(name, LazySlice(f.get_slice(key)), config)
            if part.dim() != 2 or part.shape[1] != target.shape[1] or row + part.shape[0] > target.shape[0]:
                raise CheckpointError(
                    f"tensor {key} has shape {list(part.shape)}; the shards of {name} must stack to "
                    f"{list(target.shape)}"
                )
            target.data[row:row + part.shape[0]].copy_(part)
            row += part.shape[0]
        if row != target.shape[0]:
            raise CheckpointError(f"the shards of {name} hold {row} rows, expected {target.shape[0]} from config.json")
        filled.add(name)

    num_experts = config.num_experts
    for base, parts in expert_parts.items():
        if len(parts) == 3 * num_experts:
            filled.update({base + ".gate_up_proj", base + ".down_proj"})
        else:
            have = {e for e, _ in parts}
            missing = sorted(
                f"{base}.{e}.{p}.weight" for e in range(num_experts) for p in ("gate_proj", "up_proj", "down_proj")
                if (e, p) not in parts
            )
            if len(have) and missing:
                raise CheckpointError(f"missing expert tensors: {missing[:4]}{' ...' if len(missing) > 4 else ''}")
    if unexpected:
        raise CheckpointError(
            f"unexpected tensors in the checkpoint (not part of this config): {sorted(unexpected)[:6]}"
            f"{' ...' if len(unexpected) > 6 else ''}"
        )
    if config.tie_word_embeddings and "lm_head.weight" not in filled:
        model.lm_head.weight = model.model.embed_tokens.weight
        filled.add("lm_head.weight")
    missing = sorted(set(params) - filled)
    if missing:
        raise CheckpointError(f"missing tensors in the checkpoint: {missing[:6]}{' ...' if len(missing) > 6 else ''}")
