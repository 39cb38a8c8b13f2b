"""PLE table backends (gpu / pinned / disk) return the same rows as indexing the stacked checkpoint shards."""

from __future__ import annotations

import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tidal.config.model import ModelConfig
from tidal.executor.offload.ple_table import DeviceTable, DiskTable, PinnedTable, RowsAhead, ShardRef, find_ple_shards

# tiny's PLE layers are 1 and 4 (one-indexed); it splits each table into 4 shards.
PLE_MODULES = [0, 3]
PARTS = 4


def _table_name(layer: int) -> str:
    return f"model.layers.{layer}.ple.ple_embedding.ngram_embedding.weight"


def _shard_key(layer: int, index: int, prefix: str = "model.") -> str:
    return f"{prefix}layers.{layer}.ple.ple_embedding.ngram_embedding.shard_{index}.weight"


def _full_table(checkpoint: str, layer: int) -> torch.Tensor:
    """The table stacked from its shards through safetensors' own reader (independent of the code under test)."""
    with safe_open(os.path.join(checkpoint, "model.safetensors"), framework="pt") as f:
        return torch.cat([f.get_tensor(_shard_key(layer, i)) for i in range(PARTS)])


def _ids(rows: int, parts: list[ShardRef], shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random ids with repeats, the first and last row, and both sides of every shard boundary."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, rows, shape, generator=gen).reshape(-1)
    starts = torch.tensor([0] + [p.rows for p in parts]).cumsum(0)
    special = torch.cat([torch.tensor([0, rows - 1]), starts[1:-1], starts[1:-1] - 1])
    k = min(special.numel(), ids.numel() - 1)
    ids[:k] = special[:k]
    ids[-1] = ids[0]  # a repeat
    if ids.numel() >= k + 4:
        ids[-4:-1] = ids[1:4]  # more repeats, including the last row
    return ids.reshape(shape)


def _backends(checkpoint: str, layer: int, full: torch.Tensor, dtype: torch.dtype = torch.bfloat16):
    parts = find_ple_shards(checkpoint, _table_name(layer))
    return parts, {
        "gpu": DeviceTable(full.clone()),
        "pinned": PinnedTable(full.clone()),
        "disk": DiskTable(parts, full.shape[1], dtype),
    }


@pytest.mark.parametrize("layer", PLE_MODULES)
def test_backends_match_full_table(tiny_checkpoint, layer):
    config = ModelConfig.from_file(tiny_checkpoint)
    full = _full_table(tiny_checkpoint, layer)
    assert full.dtype == torch.bfloat16  # tiny is written in bf16: the disk path must round-trip it exactly
    assert full.shape == (config.ngram_table_rows(PLE_MODULES.index(layer)), config.ple_embed_dim // config.ngram_heads)
    parts, tables = _backends(tiny_checkpoint, layer, full)
    assert [p.key for p in parts] == [_shard_key(layer, i) for i in range(PARTS)]
    assert sum(p.rows for p in parts) == full.shape[0]
    heads = config.ngram_heads
    for shape, seed in [((37, heads), 0), ((heads,), 1), ((5, 3, heads), 2), ((0, heads), 3)]:
        ids = _ids(full.shape[0], parts, shape, seed) if shape[0] else torch.empty(shape, dtype=torch.long)
        want = full[ids]
        for backend, table in tables.items():
            assert (table.rows, table.dim, table.dtype) == (*full.shape, torch.bfloat16), backend
            got = table.gather(ids)
            assert got.dtype == torch.bfloat16 and got.shape == (*shape, full.shape[1]), backend
            assert torch.equal(got, want), f"{backend} differs from full[ids] for shape {shape}"
            assert torch.equal(table.gather(ids), want), f"{backend}: a second gather differs"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_rows_gathered_ahead_match_full_table(tiny_checkpoint, device):
    """A whole prompt's rows gathered on a worker thread, then sent chunk by chunk (layer-major PLE); a
    second prompt of the same table reuses the pinned buffer after the first one's sends."""
    config = ModelConfig.from_file(tiny_checkpoint)
    full = _full_table(tiny_checkpoint, PLE_MODULES[0])
    parts = find_ple_shards(tiny_checkpoint, _table_name(PLE_MODULES[0]))
    table = PinnedTable(full.clone())
    heads = config.ngram_heads
    with ThreadPoolExecutor(3) as worker:
        for tokens, cuts, seed in [(150, [0, 64, 128, 150], 0), (70, [0, 1, 64, 70], 1)]:
            ids = _ids(full.shape[0], parts, (tokens, heads), seed).to(device)
            RowsAhead(table, ids.flip(0), cuts, worker)  # abandoned (a forward that failed): gathers still run
            ahead = RowsAhead(table, ids, cuts, worker)
            if device == "cuda" and seed:  # the second prompt: one upload on a side stream, then slices of it
                ahead.upload(torch.cuda.Stream())
            for lo, hi in reversed(list(zip(cuts[:-1], cuts[1:], strict=True))):
                got = ahead.send(lo, hi)
                assert got.device.type == device and got.shape == (hi - lo, heads * full.shape[1])
                assert torch.equal(got.cpu(), full[ids[lo:hi].cpu()].flatten(-2)), (tokens, lo, hi)


def test_disk_converts_to_the_requested_dtype(tiny_checkpoint):
    full = _full_table(tiny_checkpoint, 0)
    parts = find_ple_shards(tiny_checkpoint, _table_name(0))
    ids = _ids(full.shape[0], parts, (16, 4), 5)
    got = DiskTable(parts, full.shape[1], torch.float32).gather(ids)
    assert got.dtype == torch.float32 and torch.equal(got, full[ids].float())


def test_disk_rejects_out_of_range_ids(tiny_checkpoint):
    parts = find_ple_shards(tiny_checkpoint, _table_name(0))
    table = DiskTable(parts, 8, torch.bfloat16)
    with pytest.raises(IndexError, match=str(table.rows)):
        table.gather(torch.tensor([[0, table.rows]]))


def _rewrite(src: str, dst, edit) -> str:
    """A copy of ``src``'s config and safetensors with ``edit(tensors)`` applied to model.safetensors."""
    os.makedirs(dst)
    shutil.copy(os.path.join(src, "config.json"), dst)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    edit(tensors)
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return str(dst)


def test_missing_shard_names_the_table(tiny_checkpoint, tmp_path):
    path = _rewrite(tiny_checkpoint, tmp_path / "ck", lambda t: t.pop(_shard_key(3, 2)))
    with pytest.raises(ValueError, match=r"model\.layers\.3\.ple\.ple_embedding\.ngram_embedding\.weight.*\[0, 1, 3\]"):
        find_ple_shards(path, _table_name(3))
    assert len(find_ple_shards(path, _table_name(0))) == PARTS  # the other table is intact
    with pytest.raises(ValueError, match=r"no PLE shards of model\.layers\.1\.ple"):
        find_ple_shards(path, _table_name(1))


def test_misshaped_shard_is_named(tiny_checkpoint, tmp_path):
    def edit(t):
        t[_shard_key(0, 1)] = t[_shard_key(0, 1)][:, :4].contiguous()

    path = _rewrite(tiny_checkpoint, tmp_path / "ck", edit)
    with pytest.raises(ValueError, match=r"shard_1\.weight.*\[rows, 8\]"):
        find_ple_shards(path, _table_name(0))
    with pytest.raises(ValueError, match=r"shard_0\.weight.*\[rows, 16\]"):
        find_ple_shards(tiny_checkpoint, _table_name(0), dim=16)


def test_float16_shards(tiny_checkpoint, tmp_path):
    def edit(t):
        for i in range(PARTS):
            t[_shard_key(0, i)] = t[_shard_key(0, i)].to(torch.float16)

    path = _rewrite(tiny_checkpoint, tmp_path / "ck", edit)
    full = _full_table(path, 0)
    parts = find_ple_shards(path, _table_name(0))
    ids = _ids(full.shape[0], parts, (20, 4), 7)
    got = DiskTable(parts, full.shape[1], torch.float16).gather(ids)
    assert got.dtype == torch.float16 and torch.equal(got, full[ids])


def test_composite_multi_file_checkpoint_with_index(tiny_checkpoint, tmp_path):
    """Shards spread over two files under ``model.language_model.`` names, found through the index; a stale
    file that the index does not name (holding a conflicting shard) is ignored."""
    full = _full_table(tiny_checkpoint, 3)
    tensors = load_file(os.path.join(tiny_checkpoint, "model.safetensors"))
    renamed = {"model.language_model." + k[len("model."):]: v for k, v in tensors.items()}
    keys = sorted(renamed)
    halves = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    path = tmp_path / "ck"
    os.makedirs(path)
    weight_map = {}
    for file, names in halves.items():
        save_file({k: renamed[k] for k in names}, os.path.join(path, file), metadata={"format": "pt"})
        weight_map.update({k: file for k in names})
    with open(path / "model.safetensors.index.json", "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    save_file({_shard_key(3, 0): torch.zeros(3, 8, dtype=torch.bfloat16)}, os.path.join(path, "stale.safetensors"))

    parts = find_ple_shards(str(path), _table_name(3))
    assert [p.key for p in parts] == [_shard_key(3, i, prefix="model.language_model.") for i in range(PARTS)]
    assert len({p.file for p in parts}) == 2
    ids = _ids(full.shape[0], parts, (50, 4), 11)
    assert torch.equal(DiskTable(parts, full.shape[1], torch.bfloat16).gather(ids), full[ids])


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_random_tables_drawn_when_gathered_equal_the_stored_ones(tmp_path, quantization):
    """``--load-format random --ple-backend disk``: no table is stored anywhere, each gathered row is drawn from the
    seed, with the values (an FP8 table: the codes and the one scale) that ``gpu`` and ``pinned`` store, so the
    three generate the same ids."""
    from tidal import LLM
    from tidal.executor.offload.ple_table import SeededTable
    from tidal.executor.presets import write_checkpoint

    base = write_checkpoint("tiny", str(tmp_path), seed=3, weights=False)
    kw = dict(load_format="random", quantization=quantization, seed=3, max_prefill_length=64)
    llms = {backend: LLM(base, ple_backend=backend, **kw) for backend in ("gpu", "pinned", "disk")}
    prompts = [list(range(100, 190)), [5, 6, 7]]
    want = llms["gpu"].generate(prompts, max_tokens=8, ignore_eos=True)
    for backend in ("pinned", "disk"):
        assert llms[backend].generate(prompts, max_tokens=8, ignore_eos=True) == want, backend
    gen = torch.Generator().manual_seed(0)
    for layer in PLE_MODULES:
        stored = llms["gpu"].runner.model.model.layers[layer].ple.ple_embedding
        drawn = llms["disk"].runner.model.model.layers[layer].ple.ple_embedding
        assert isinstance(drawn.table, SeededTable) and drawn.ngram_embedding.weight.numel() == 0
        full = stored.ngram_embedding.weight
        assert drawn.table.rows == full.shape[0] and drawn.table.dtype == full.dtype
        rows = torch.randint(0, full.shape[0], (40, 3), generator=gen)
        rows[0, 0], rows[0, 1] = 0, full.shape[0] - 1
        got = drawn.table.gather(rows)
        assert got.dtype == full.dtype and torch.equal(got.float(), full[rows].float()), layer
        if quantization:
            assert torch.equal(drawn.ngram_embedding.weight_scale, stored.ngram_embedding.weight_scale)


def test_a_random_disk_table_takes_the_whole_tables_scale_or_with_exact_table_scale_off_its_first_chunks(
        tmp_path, monkeypatch):
    """The FP8 scale of a table left on disk is ``amax / 448`` over every stored value; a model whose values do not
    matter (a compile worker's) takes the first chunk's amax instead and skips the pass over the table."""
    from tidal.config.model import ModelConfig
    from tidal.executor.loader import load_model
    from tidal.executor.presets import write_checkpoint
    from tidal.executor.weights import random_tensor
    from tidal.kernels.quant import quantize_fp8_tensor

    monkeypatch.setattr("tidal.executor.weights.TABLE_CHUNK_ROWS", 50)
    base = write_checkpoint("tiny", str(tmp_path), seed=5, weights=False)
    config = ModelConfig.from_file(base).with_quantization("fp8", "random")
    kw = dict(load_format="random", seed=5, ple_backend="disk", quantization="fp8", config=config)
    exact, _ = load_model(base, **kw)
    first, _ = load_model(base, exact_table_scale=False, **kw)
    for layer in PLE_MODULES:
        name = f"model.layers.{layer}.ple.ple_embedding.ngram_embedding.weight"
        values = random_tensor(name, (config.ngram_table_rows(config.ple_layers.index(layer)),
                                      exact.get_parameter(name).shape[1]), config, 5).to(torch.bfloat16).float()
        for model, amax in ((exact, values.abs().amax()), (first, values[:50].abs().amax())):
            want = quantize_fp8_tensor(amax)[1]
            assert torch.equal(model.get_buffer(name + "_scale"), want.to(model.get_buffer(name + "_scale").dtype))
        assert not torch.equal(exact.get_buffer(name + "_scale"), first.get_buffer(name + "_scale"))
