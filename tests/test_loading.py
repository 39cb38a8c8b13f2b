"""Checkpoint loading: formats, names, errors that name the tensor, random weights."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tidal import LLM
from tidal.config.model import ConfigError, ModelConfig
from tidal.executor.loader import CheckpointError, load_model


def _copy(src: str, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


def _edit_tensors(path: str, edit) -> None:
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def test_missing_tensor_is_named(tiny_checkpoint, tmp_path):
    path = _copy(tiny_checkpoint, tmp_path / "ck")
    _edit_tensors(path, lambda t: t.pop("model.layers.2.self_attn.k_norm.weight"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.2\.self_attn\.k_norm\.weight"):
        load_model(path)


def test_missing_expert_is_named(tiny_checkpoint, tmp_path):
    path = _copy(tiny_checkpoint, tmp_path / "ck")
    _edit_tensors(path, lambda t: t.pop("model.layers.1.mlp.experts.5.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.experts\.5\.up_proj\.weight"):
        load_model(path)


def test_unexpected_tensor_is_named(tiny_checkpoint, tmp_path):
    path = _copy(tiny_checkpoint, tmp_path / "ck")
    _edit_tensors(path, lambda t: t.update({"model.layers.0.mystery.weight": torch.zeros(3)}))
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mystery\.weight"):
        load_model(path)


def test_misshaped_tensor_is_named(tiny_checkpoint, tmp_path):
    path = _copy(tiny_checkpoint, tmp_path / "ck")
    _edit_tensors(path, lambda t: t.update(
        {"model.layers.0.linear_attn.in_proj_z.weight": torch.zeros(3, 64, dtype=torch.bfloat16)}))
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.linear_attn\.in_proj_z\.weight.*\[3, 64\]"):
        load_model(path)


def test_ple_shards_must_stack(tiny_checkpoint, tmp_path):
    path = _copy(tiny_checkpoint, tmp_path / "ck")
    key = "model.layers.0.ple.ple_embedding.ngram_embedding.shard_1.weight"
    _edit_tensors(path, lambda t: t.update({key: t[key][:-3].clone()}))
    with pytest.raises(CheckpointError, match="ngram_embedding"):
        load_model(path)


def test_fused_experts_mtp_and_vision_keys_load(tiny_checkpoint, tmp_path, device):
    """Fused 3-D expert tensors, a composite checkpoint's prefixes and MTP weights; a vision_config whose
    tower the checkpoint does not hold serves text, a tower with tensors missing is refused by name."""
    path = _copy(tiny_checkpoint, tmp_path / "ck")

    def to_composite(t):
        for layer in range(4):
            base = f"model.layers.{layer}.mlp.experts"
            gate = torch.stack([t.pop(f"{base}.{e}.gate_proj.weight") for e in range(8)])
            up = torch.stack([t.pop(f"{base}.{e}.up_proj.weight") for e in range(8)])
            t[f"{base}.gate_up_proj"] = torch.cat([gate, up], dim=1)
            t[f"{base}.down_proj"] = torch.stack([t.pop(f"{base}.{e}.down_proj.weight") for e in range(8)])
        for key in [k for k in t if k.startswith("model.")]:
            t["model.language_model." + key[len("model."):]] = t.pop(key)
        t["mtp.layers.0.input_layernorm.weight"] = torch.ones(64)

    _edit_tensors(path, to_composite)
    with open(os.path.join(path, "config.json")) as f:
        text = json.load(f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"model_type": "qwen4_exp", "text_config": text, "vision_config": {"depth": 1}}, f)
    prompt = list(range(100, 160))
    a = LLM(tiny_checkpoint, device=device).score(prompt)
    b = LLM(path, device=device).score(prompt)
    assert torch.equal(a, b)
    _edit_tensors(path, lambda t: t.update({"model.visual.patch_embed.proj.weight": torch.ones(4, 4)}))
    with pytest.raises(CheckpointError, match="vision tower lacks"):
        LLM(path, device=device)


def test_random_load_format_equals_written_checkpoint(tiny_checkpoint, tmp_path, device):
    from tidal.executor.presets import write_checkpoint

    config_only = write_checkpoint("tiny", str(tmp_path / "cfg"), seed=0, weights=False)
    assert not os.path.exists(os.path.join(config_only, "model.safetensors"))
    prompt = list(range(1000, 1080))
    written = LLM(tiny_checkpoint, device=device).score(prompt)
    random = LLM(config_only, device=device, load_format="random", seed=0).score(prompt)
    assert torch.equal(written, random)
    other_seed = LLM(config_only, device=device, load_format="random", seed=1).score(prompt)
    assert not torch.allclose(written, other_seed)


def test_sharded_checkpoint_with_index(tiny_checkpoint, tmp_path, device):
    path = _copy(tiny_checkpoint, tmp_path / "ck")
    tensors = load_file(os.path.join(path, "model.safetensors"))
    os.remove(os.path.join(path, "model.safetensors"))
    keys = sorted(tensors)
    half = len(keys) // 2
    weight_map = {}
    for i, part in enumerate((keys[:half], keys[half:])):
        name = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({k: tensors[k] for k in part}, os.path.join(path, name))
        weight_map.update({k: name for k in part})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": weight_map}, f)
    prompt = list(range(500, 540))
    assert torch.equal(LLM(path, device=device).score(prompt), LLM(tiny_checkpoint, device=device).score(prompt))


@pytest.mark.parametrize("patch,field", [
    ({"model_type": "llama"}, "model_type"),
    ({"layer_types": ["linear_attention", "mamba", "full_attention", "linear_attention"]}, r"layer_types\[1\]"),
    ({"hc_count": 1}, "hc_count"),
    ({"ple_layer_ids": [3]}, "PLE"),
    ({"indexer_budget": 30}, "indexer_budget"),
    ({"num_experts_per_tok": 99}, "num_experts_per_tok"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_type"),
])
def test_bad_config_names_the_field(tiny_checkpoint, patch, field):
    with open(os.path.join(tiny_checkpoint, "config.json")) as f:
        data = json.load(f)
    data.update(patch)
    with pytest.raises(ConfigError, match=field):
        ModelConfig.from_dict(data)


def test_layer_type_spellings_are_equivalent(tiny_checkpoint):
    with open(os.path.join(tiny_checkpoint, "config.json")) as f:
        data = json.load(f)
    configs = []
    for name in ("full_attention", "qwen_sparse_attention", "indexed_attention"):
        data["layer_types"][2] = name
        configs.append(ModelConfig.from_dict(data))
    assert configs[0] == configs[1] == configs[2]
    assert configs[0].attention_layers == [2]
