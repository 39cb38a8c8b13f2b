"""Quantized checkpoints in the published layouts (ModelOpt NVFP4 and MIXED_PRECISION, Qwen/DeepSeek block FP8),
most made by an independent quantizer (NVIDIA ModelOpt's ``NVFP4QTensor`` and ``FP8QTensor``), some by tidal's
writer, against transformers' ``Qwen4ExpForCausalLM`` on the exact dequantization of the same tensors (ModelOpt's
dequantizers for NVFP4 and the FP8 n-gram tables, transformers' fine-grained FP8 dequantizer for block FP8), in
float32 on the CPU; and tidal's greedy ids the same cold, chunked, after a prefix-cache hit, with offload, with every
PLE backend, under ``--tp 2`` and through ``tidal serve``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.request
import warnings

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from test_layer_major import _recording
from test_parity import prompt_for, reference_model

from tidal import LLM
from tidal.config.model import ModelConfig
from tidal.executor.loader import CheckpointError, load_model
from tidal.executor.presets import write_checkpoint
from tidal.executor.weights import EXPERT_KEY, PLE_SHARD_KEY, canonical_name

GREEDY = 16
warnings.filterwarnings("ignore", message=".*transformers .* is not tested with current version of modelopt.*")


def _tensors(path: str) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(os.listdir(path)):
        if file.endswith(".safetensors"):
            with safe_open(os.path.join(path, file), framework="pt") as f:
                out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def _copy_dir(src: str, dst: str) -> None:
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        if not name.endswith(".safetensors") and name not in ("model.safetensors.index.json", "hf_quant_config.json"):
            shutil.copyfile(os.path.join(src, name), os.path.join(dst, name))


def _ngram_tables(tensors: dict[str, torch.Tensor]) -> dict[str, list[str]]:
    """Each n-gram table's shard keys, by the table's key prefix."""
    tables: dict[str, list[str]] = {}
    for key in tensors:
        if PLE_SHARD_KEY.match(canonical_name(key) or key):
            tables.setdefault(key[: key.index(".shard_")], []).append(key)
    return tables


def _modelopt_fp8_tables(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every n-gram table in FP8 with one scale over all its shards, by ModelOpt's ``FP8QTensor``."""
    from modelopt.torch.quantization.qtensor.fp8_tensor import FP8QTensor

    out = {}
    for table, keys in _ngram_tables(tensors).items():
        _, scale = FP8QTensor.quantize(torch.cat([tensors[k].float() for k in keys]))
        for key in keys:
            out[key] = FP8QTensor.quantize(tensors[key].float(), scales=scale)[0]._quantized_data.contiguous()
        out[table + ".weight_scale"] = scale.float().reshape(())
    return out


def _write_quant_config(out: str, quant: dict, hf_quant: bool = True) -> None:
    """``quant`` as ``config.json``'s ``quantization_config`` and, for ModelOpt, in ``hf_quant_config.json``."""
    path = os.path.join(out, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["quantization_config"] = quant if not hf_quant else {"quant_method": "modelopt", **quant}
    with open(path, "w") as f:
        json.dump(config, f)
    if hf_quant:
        with open(os.path.join(out, "hf_quant_config.json"), "w") as f:
            json.dump({"producer": {"name": "modelopt"}, "quantization": quant}, f)


def modelopt_nvfp4(source: str, out: str, mixed: bool = False) -> str:
    """The ModelOpt NVFP4 export of a dense checkpoint's routed experts, made with ModelOpt's ``NVFP4QTensor``:
    ``quant_algo NVFP4`` with every other module excluded by glob, or (``mixed``) ``MIXED_PRECISION`` with the
    n-gram tables in FP8 too (ModelOpt's ``FP8QTensor``, one scale a table)."""
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    _copy_dir(source, out)
    tensors, layers = _tensors(source), {}
    for key, t in list(tensors.items()):
        m = EXPERT_KEY.match(canonical_name(key) or key)
        if m:
            q, scale, scale_2 = NVFP4QTensor.quantize(t.float().clone(), 16)
            base = key[: -len("weight")]
            tensors.update({key: q._quantized_data, base + "weight_scale": scale,
                            base + "weight_scale_2": scale_2.reshape(()), base + "input_scale": torch.tensor(1.0)})
            layers[key[: key.index(".experts.") + len(".experts")]] = {"quant_algo": "NVFP4", "group_size": 16}
    if mixed:
        fp8 = _modelopt_fp8_tables(tensors)
        tensors.update(fp8)
        layers.update({k[: -len(".weight_scale")]: {"quant_algo": "FP8"} for k in fp8 if k.endswith(".weight_scale")})
        quant = {"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": None, "quantized_layers": layers}
    else:
        quant = {"quant_algo": "NVFP4", "group_size": 16, "kv_cache_quant_algo": None,
                 "exclude_modules": ["lm_head", "*embed_tokens*", "*self_attn*", "*linear_attn*", "*shared_expert*",
                                     "*mlp.gate", "*hyper_connection*", "*ple*"]}
    save_file(tensors, os.path.join(out, "model.safetensors"))
    _write_quant_config(out, quant)
    return out


def _fp8_blocks(weight: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` in FP8 with one scale per 128 x 128 block (ModelOpt's ``FP8QTensor``), the scales stored in
    ``scale_dtype``: rounded up to it first, so that no value passes 448."""
    from modelopt.torch.quantization.qtensor.fp8_tensor import FP8QTensor

    blocks = {-1: 128, -2: 128}
    _, scale = FP8QTensor.quantize(weight.float(), block_sizes=blocks)
    stored = (scale * (1 + 2 ** -7)).to(scale_dtype) if scale_dtype != torch.float32 else scale
    q, _ = FP8QTensor.quantize(weight.float(), scales=stored.float(), block_sizes=blocks)
    return q._quantized_data.contiguous(), stored


def modelopt_fp8(source: str, out: str, scale_dtype: torch.dtype = torch.bfloat16) -> str:
    """A block-FP8 checkpoint (``quant_method fp8``, 128 x 128 blocks, as Qwen's and DeepSeek's releases) made with
    ModelOpt's ``FP8QTensor``: the routed experts, the attention and shared-expert projections (which tidal
    dequantizes at load) in blocks, each n-gram table with one scale; the rest in float."""
    _copy_dir(source, out)
    tensors = _tensors(source)
    for key, t in list(tensors.items()):
        name = canonical_name(key) or key
        dense = (".self_attn." in name or ".shared_expert." in name) and name.endswith("_proj.weight")
        if (EXPERT_KEY.match(name) or dense) and t.dim() == 2:
            tensors[key], tensors[key[: -len("weight")] + "weight_scale_inv"] = _fp8_blocks(t, scale_dtype)
    tensors.update(_modelopt_fp8_tables(tensors))
    save_file(tensors, os.path.join(out, "model.safetensors"))
    _write_quant_config(out, {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
        "modules_to_not_convert": ["lm_head", "embed_tokens", "mlp.gate", "shared_expert_gate", "hyper_connection",
                                   "linear_attn", "ple.key_proj", "ple.value_proj", "ple.conv1d"],
        "modules_to_convert": ["ple.ple_embedding.ngram_embedding"]}, hf_quant=False)
    return out


def dequantized(quantized: str, out: str) -> str:
    """A dense float32 checkpoint with the exact values of a quantized one's tensors: NVFP4 and the FP8 n-gram
    tables through ModelOpt's dequantizers, block FP8 through transformers'."""
    from modelopt.torch.quantization.qtensor.fp8_tensor import FP8QTensor
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    _copy_dir(quantized, out)
    with open(os.path.join(quantized, "config.json")) as f:
        config = json.load(f)
    config.pop("quantization_config", None)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    src = _tensors(quantized)
    dense = {}
    for key, t in src.items():
        if key.endswith(("weight_scale", "weight_scale_2", "weight_scale_inv", "input_scale")):
            continue
        name = canonical_name(key) or key
        base = key[: -len("weight")]
        if t.dtype == torch.uint8:
            q = NVFP4QTensor(torch.Size([*t.shape[:-1], t.shape[-1] * 2]), torch.float32, t)
            dense[key] = q.dequantize(dtype=torch.float32, scale=src[base + "weight_scale"],
                                      double_scale=src[base + "weight_scale_2"], block_sizes={-1: 16})
        elif t.dtype == torch.float8_e4m3fn and PLE_SHARD_KEY.match(name):
            table = key[: key.index(".shard_")]
            dense[key] = FP8QTensor(t.shape, torch.float32, t).dequantize(scale=src[table + ".weight_scale"].float())
        elif t.dtype == torch.float8_e4m3fn:
            dense[key] = _dequantize_fp8_weight(t, src[base + "weight_scale_inv"], [128, 128], torch.float32)
        else:
            dense[key] = t
    save_file(dense, os.path.join(out, "model.safetensors"))
    return out


def stacked(quantized: str, out: str) -> str:
    """A tidal-written NVFP4 checkpoint with each layer's experts stacked into 3-D tensors (``gate_up_proj``,
    ``down_proj`` and their ``_weight_scale``/``_weight_scale_2``), as fused-expert exporters write them."""
    _copy_dir(quantized, out)
    shutil.copyfile(os.path.join(quantized, "hf_quant_config.json"), os.path.join(out, "hf_quant_config.json"))
    src, out_t = _tensors(quantized), {}
    config = ModelConfig.from_file(quantized)
    for key, t in src.items():
        if ".mlp.experts." not in key:
            out_t[key] = t
    for layer in range(config.num_hidden_layers):
        base = f"model.layers.{layer}.mlp.experts"
        for proj, parts in (("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",))):
            for suffix, cat in (("weight", True), ("weight_scale", True), ("weight_scale_2", False)):
                per_expert = [[src[f"{base}.{e}.{p}.{suffix}"] for p in parts] for e in range(config.num_experts)]
                if cat:
                    value = torch.stack([torch.cat(ps, 0) for ps in per_expert])
                else:
                    value = torch.stack([torch.stack([p.reshape(()) for p in ps]) for ps in per_expert])
                out_t[f"{base}.{proj}" + ("" if suffix == "weight" else f"_{suffix}")] = value
    save_file(out_t, os.path.join(out, "model.safetensors"))
    return out


# name: (dense source, format, writer). Most are quantized by ModelOpt's quantizers (an implementation apart from
# tidal's writer); one a format by tidal's writer (``tidal checkpoint --quantize``).
CASES = {
    "tidal_tiny_nvfp4": ("tiny", "nvfp4", "tidal"),
    "tidal_tiny_fp8": ("tiny", "fp8", "tidal"),
    "modelopt_hc3_ngram4": ("hf_hc3_ngram4", "nvfp4", "modelopt"),
    "modelopt_fp8_from_tied": ("hf_kernels_tied", "fp8", "modelopt"),
    "modelopt_fp8_composite": ("hf_hc2_gqa4", "fp8", "modelopt"),
    "stacked_nvfp4": ("tiny", "nvfp4", "stacked"),
    "fp32_scales_fp8": ("hf_hc3_ngram4", "fp8", "fp32_scales"),
    "config_json_only_nvfp4": ("hf_kernels_tied", "nvfp4", "config_json_only"),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory, hf_checkpoints, tiny_checkpoint):
    source, fmt, writer = CASES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    dense = tiny_checkpoint if source == "tiny" else hf_checkpoints[source]
    q = str(root / "q")
    if writer == "tidal" and source == "tiny":
        path = write_checkpoint("tiny", q, seed=0, quantize=fmt)
    elif writer == "tidal":
        path = write_checkpoint(None, q, quantize=fmt, source=dense)
    elif fmt == "fp8":  # block scales in bf16 as Qwen's releases, or (fp32_scales) in fp32 as DeepSeek's
        path = modelopt_fp8(dense, q, torch.float32 if writer == "fp32_scales" else torch.bfloat16)
    else:
        path = modelopt_nvfp4(dense, q, mixed=writer != "modelopt")
    if writer == "config_json_only":  # the quantization config in config.json alone, no hf_quant_config.json
        os.remove(os.path.join(path, "hf_quant_config.json"))
        assert "quantization_config" in json.load(open(os.path.join(path, "config.json")))
    reference = dequantized(path, str(root / "dense"))
    if writer == "stacked":  # the same tensors, stacked: the reference is the per-expert checkpoint's
        path = stacked(path, str(root / "stacked"))
    return request.param, path, reference


def test_logits_and_greedy_ids_match_transformers_on_the_dequantized_tensors(case, device):
    name, path, dense = case
    config = ModelConfig.from_file(path)
    assert config.quantization is not None and config.quantization.experts in ("nvfp4", "fp8")
    prompt = prompt_for(config)
    ref = reference_model(dense, device)
    with torch.no_grad():
        ref_logits = ref(torch.tensor([prompt], device=device)).logits[0].float().cpu()
        ref_ids = ref.generate(torch.tensor([prompt], device=device), max_new_tokens=GREEDY, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    del ref
    llm = LLM(path, device=device, dtype="float32")
    diff = (llm.score(prompt) - ref_logits).abs().max().item()
    print(f"{name}: max |logits - transformers on the dequantized tensors| = {diff:.3e}")
    assert diff <= 1e-3
    cold = llm.generate([prompt], max_tokens=GREEDY, ignore_eos=True)[0]
    assert cold == ref_ids
    assert llm.generate([prompt], max_tokens=GREEDY, ignore_eos=True)[0] == cold  # after a prefix-cache hit
    assert llm.scheduler.counters["cached_tokens"] > 0
    offload = dict(moe_strategy="offload", moe_cache_slots=config.num_experts_per_tok)
    for kwargs in (dict(max_prefill_length=64), offload, dict(offload, prefill_layer_major=True, max_prefill_length=64),
                   dict(ple_backend="pinned"), dict(ple_backend="disk", max_prefill_length=128)):
        if not config.ple_layers and "ple_backend" in kwargs:
            continue
        llm = LLM(path, device=device, dtype="float32", **kwargs)
        admitted = []
        llm.scheduler.emit = _recording(llm, admitted)
        assert llm.generate([prompt], max_tokens=GREEDY, ignore_eos=True)[0] == cold, kwargs
        if kwargs.get("prefill_layer_major"):  # whole quantized layers streamed from the host banks
            assert admitted[0].plan.mode == "layer_major"


def test_quantized_weights_stay_quantized_in_memory(tmp_path):
    """The experts (device, host bank, cache) and the n-gram table keep their stored format."""
    path = write_checkpoint("tiny", str(tmp_path / "q"), quantize="nvfp4")
    model, _ = load_model(path, dtype="float32")
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up.data.dtype == torch.uint8 and experts.gate_up.scale.dtype == torch.float8_e4m3fn
    assert not any(n.endswith("experts.gate_up_proj") for n, _ in model.named_parameters())
    table = model.model.layers[0].ple.ple_embedding.ngram_embedding.weight
    assert table.dtype == torch.float8_e4m3fn
    llm = LLM(path, moe_strategy="offload", moe_cache_slots=4)
    store = llm.runner.expert_store
    assert store.cache_gate_up.data.dtype == torch.uint8 and store.cache_down.scale.dtype == torch.float8_e4m3fn
    hidden, inter = llm.config.hidden_size, llm.config.moe_intermediate_size
    # Bytes an expert moves: 4.5 bits a weight (codes, e4m3 per 16) plus an fp32 global scale per row.
    rows = 2 * inter + hidden
    assert store.expert_bytes == 3 * hidden * inter // 2 + 3 * hidden * inter // 16 + 4 * rows


def test_random_quantized_weights_equal_the_written_checkpoint(tmp_path, monkeypatch):
    # n-gram tables drawn a few rows at a time (the real geometry's 320 M rows never whole): the FP8 scale over
    # all chunks, the same values the writer quantizes; experts drawn and quantized 3 of 8 at a time.
    monkeypatch.setattr("tidal.executor.weights.TABLE_CHUNK_ROWS", 100)
    monkeypatch.setattr("tidal.executor.weights.EXPERT_CHUNK", 3)
    for fmt in ("nvfp4", "fp8"):
        path = write_checkpoint("tiny", str(tmp_path / fmt), seed=3, quantize=fmt)
        prompt = list(range(100, 160))
        written = LLM(path, seed=3).generate([prompt], max_tokens=8, ignore_eos=True)
        base = write_checkpoint("tiny", str(tmp_path / f"{fmt}-config"), seed=3, weights=False)
        random = LLM(base, load_format="random", quantization=fmt, seed=3).generate([prompt], max_tokens=8,
                                                                                     ignore_eos=True)
        assert random == written, fmt


def test_the_sizing_check_refuses_the_real_geometry_in_bf16_on_one_h200(monkeypatch):
    """The flash-next shape on one H200 (139 GiB) with a 125 GiB host: NVFP4 fits resident (n-gram table pinned)
    and offloaded; bf16 fits neither, and the refusal names the memory and the flag that helps."""
    from types import SimpleNamespace

    from tidal.config.server_args import ArgsError, ServerArgs
    from tidal.executor.memory import fit
    from tidal.executor.presets import preset_config

    GiB = 1 << 30
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=139 * GiB))
    monkeypatch.setattr(fit, "host_memory_total", lambda: 125 * GiB)

    def plan(quantization, **kwargs):
        config = ModelConfig.from_dict(preset_config("flash-next")).with_quantization(quantization, "random")
        args = ServerArgs(load_format="random", quantization=quantization, device="cuda", **kwargs)
        return args, config, fit.memory_plan(args, config, "cuda")

    c = ModelConfig.from_dict(preset_config("flash-next"))
    expert_weights = c.num_hidden_layers * c.num_experts * 3 * c.moe_intermediate_size * c.hidden_size
    assert 120e9 < expert_weights < 122e9  # ~121 G parameters in routed experts
    table = sum(c.ngram_table_rows(i) for i in range(len(c.ple_layers))) * (c.ple_embed_dim // c.ngram_heads)
    _, _, dense_rest = plan(None, moe_strategy="offload", ple_backend="pinned")
    args, config, resident = plan("nvfp4", ple_backend="pinned")
    # 4.5 bits a weight (codes and an e4m3 scale per 16) plus an fp32 scale per row; one byte a table value.
    nvfp4 = expert_weights * 9 // 16 + 4 * c.num_hidden_layers * c.num_experts * (2 * c.moe_intermediate_size
                                                                                     + c.hidden_size)
    assert abs(resident["weights_device"] - dense_rest["weights_device"] - nvfp4) < 1e-3 * nvfp4
    assert resident["weights_host"] == table
    fit.check_fits(args, config, "cuda")
    args, config, offloaded = plan("nvfp4", moe_strategy="offload", ple_backend="pinned")
    assert abs(offloaded["weights_host"] - table - nvfp4) < 1e-3 * nvfp4
    fit.check_fits(args, config, "cuda")
    args, config, _ = plan(None)
    with pytest.raises(ArgsError, match=r"^--dtype: the weights alone need 3\d\d\.\d GiB in .*139\.0 GiB "
                                        r"\(a quantized checkpoint or --quantization nvfp4"):
        fit.check_fits(args, config, "cuda")
    args, config, _ = plan(None, moe_strategy="offload", ple_backend="pinned")
    with pytest.raises(ArgsError, match=r"^--moe-strategy: the host-resident weights need .* the host has 125\.0 "
                                        r"GiB \(a quantized checkpoint or --quantization nvfp4"):
        fit.check_fits(args, config, "cuda")


def test_tensor_parallel_quantized(tmp_path):
    from test_tensor_parallel import _prompt, run_tp

    path = write_checkpoint("tiny", str(tmp_path / "q"), seed=2, quantize="nvfp4")
    llm = LLM(path, max_prefill_length=64)
    ref_logits, ref_ids = llm.score(_prompt()), llm.generate([_prompt()], max_tokens=32, ignore_eos=True)[0]
    logits, ids, _ = run_tp(path, 2, max_prefill_length=64)
    assert (logits - ref_logits).abs().max().item() <= 1e-4 and ids == ref_ids
    # FP8 blocks are 128 wide: an intermediate size of 32 cannot split across two ranks.
    fp8 = write_checkpoint("tiny", str(tmp_path / "fp8"), seed=2, quantize="fp8")
    with pytest.raises(Exception, match="cuts the 128 x 128 FP8 blocks"):
        run_tp(fp8, 2)


def test_serve_reports_the_format_and_matches_the_offline_engine(tmp_path):
    from server_harness import Server, Tap

    path = write_checkpoint("tiny", str(tmp_path / "q"), seed=0, quantize="fp8")
    prompt = list(range(300, 340))
    expected = LLM(path).generate([prompt], max_tokens=10, ignore_eos=True)[0]
    srv = Server(path, api_key=None)
    tap = Tap(srv.tap_addr)
    try:
        with urllib.request.urlopen(srv.url + "/v1/models", timeout=10) as r:
            models = json.loads(r.read())
        assert models["data"][0]["quantization"] == "fp8 experts, fp8 n-gram table (fp8)"
        status, body = srv.post("/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 10,
                                                    "temperature": 0, "ignore_eos": True})
        assert status == 200, body
        _, ids, _ = tap.wait_finished(body["id"].removeprefix("cmpl-"))
        assert ids == expected
        assert "fp8 experts" in srv.logs()
    finally:
        tap.close()
        assert srv.stop() == []


def _serve_error(path: str) -> str:
    out = subprocess.run([sys.executable, "-m", "tidal.cli", "serve", "--model", path, "--device", "cpu"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("method", ["gptq", "awq", "compressed-tensors"])
def test_an_unsupported_method_is_one_line_and_exit_2(tmp_path, method):
    path = write_checkpoint("tiny", str(tmp_path / "ck"), weights=False)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": method, "bits": 4}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    line = _serve_error(path)
    assert f"quant_method '{method}' is not supported" in line and "ModelOpt NVFP4" in line and "block FP8" in line


def test_an_unknown_modelopt_algo_is_refused(tmp_path):
    path = write_checkpoint("tiny", str(tmp_path / "ck"), weights=False)
    with open(os.path.join(path, "hf_quant_config.json"), "w") as f:
        json.dump({"quantization": {"quant_algo": "W4A8_AWQ"}}, f)
    assert "quant_algo 'W4A8_AWQ' is not supported" in _serve_error(path)


@pytest.mark.parametrize("damage", ["missing weight_scale_2", "wrong scale shape", "missing weight_scale_inv"])
def test_a_malformed_quantized_tensor_is_a_checkpoint_error_naming_it(tmp_path, damage):
    fmt = "fp8" if damage.endswith("inv") else "nvfp4"
    path = write_checkpoint("tiny", str(tmp_path / "ck"), quantize=fmt)
    tensors = _tensors(path)
    key = "model.layers.1.mlp.experts.3.up_proj."
    if damage == "missing weight_scale_2":
        del tensors[key + "weight_scale_2"]
    elif damage == "wrong scale shape":
        tensors[key + "weight_scale"] = tensors[key + "weight_scale"][:, :2].contiguous()
    else:
        del tensors[key + "weight_scale_inv"]
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with pytest.raises(CheckpointError, match="model.layers.1.mlp.experts.3.up_proj"):
        load_model(path)


def _hub_cache(root, repo: str, checkpoint: str, commit: str = "0123456789abcdef0123456789abcdef01234567") -> str:
    """A Hugging Face hub cache holding ``checkpoint`` as repository ``repo`` at ``main``, laid out as the hub
    library writes it (blobs, a snapshot of links, a ref)."""
    folder = root / f"models--{repo.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(commit)
    snapshot, blobs = folder / "snapshots" / commit, folder / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for name in os.listdir(checkpoint):
        blob = blobs / f"blob-{name}"
        shutil.copyfile(os.path.join(checkpoint, name), blob)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / name)
    return str(snapshot)


def test_model_as_a_hub_repository_id_offline(tmp_path, monkeypatch):
    from tidal.config.server_args import ArgsError
    from tidal.runtime.demo import checkpoint_path

    path = write_checkpoint("tiny", str(tmp_path / "q"), quantize="nvfp4")
    snapshot = _hub_cache(tmp_path / "hub", "nvidia/Tiny-NVFP4", path)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    got = checkpoint_path("nvidia/Tiny-NVFP4")
    assert os.path.realpath(got) == os.path.realpath(snapshot)
    assert ModelConfig.from_file(got).quantization.experts == "nvfp4"
    with pytest.raises(ArgsError, match=r"^--model nvidia/Missing: not in the Hugging Face cache .* HF_HUB_OFFLINE"):
        checkpoint_path("nvidia/Missing")
    with pytest.raises(ArgsError, match=r"^--model nvidia/Tiny-NVFP4 --revision v9: "):
        checkpoint_path("nvidia/Tiny-NVFP4", "v9")
    with pytest.raises(ArgsError, match="not a directory"):
        checkpoint_path(str(tmp_path / "nowhere"))
    # tidal serve resolves it the same way, before anything starts: a missing repository is one line, exit 2.
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-m", "tidal.cli", "serve", "--model", "nvidia/Missing", "--device", "cpu"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 2 and len([ln for ln in out.stderr.splitlines() if ln.strip()]) == 1, out.stderr


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "fp8"])
def test_the_quantized_gpu_path_gives_its_reference_paths_ids_on_small(tmp_path, monkeypatch, fmt):
    """The ``small`` preset with random quantized weights in fp32 on the GPU: kernels (NVFP4 experts read packed),
    CUDA-graph decode (with the n-gram table on the device and in pinned host memory) and the offloaded expert
    cache give the greedy ids of the torch reference (``TIDAL_KERNELS=torch``)."""
    import gc

    base = write_checkpoint("small", str(tmp_path / "small"), weights=False)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 248000, (n,), generator=gen).tolist() for n in (37, 1, 300)]
    common = dict(load_format="random", quantization=fmt, device="cuda", dtype="float32", max_prefill_length=128)

    def ids(**kwargs):
        llm = LLM(base, **common, **kwargs)
        out = llm.generate(prompts, max_tokens=24, ignore_eos=True)
        graphed = llm.runner.graphs is not None and llm.runner.graphs.steps > 0
        del llm
        gc.collect()
        torch.cuda.empty_cache()
        return out, graphed

    monkeypatch.setenv("TIDAL_KERNELS", "torch")
    want, _ = ids()
    monkeypatch.delenv("TIDAL_KERNELS")
    got, graphed = ids()
    assert got == want and graphed
    got, graphed = ids(ple_backend="pinned")
    assert got == want and graphed
    assert ids(moe_strategy="offload", moe_cache_slots=8)[0] == want
