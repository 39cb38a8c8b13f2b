"""The measurement scripts (``benchmarks/``) and profiling tools (``tools/``) run end to end on the CPU with
the tiny preset, so they cannot rot.

The numbers are CPU numbers and the numerics gates may pass or fail here; what is checked is that every
section ran, wrote its fields with sane values, and that the FLOP model agrees with a hand count.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from tidal.executor.presets import preset_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARKS, TOOLS = os.path.join(ROOT, "benchmarks"), os.path.join(ROOT, "tools")


def script(name: str) -> str:
    return os.path.join(TOOLS if name.startswith(("profile_", "tune_")) else BENCHMARKS, name)


def run_script(name: str, *args: str, ok_codes: tuple[int, ...] = (0,)) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, script(name), *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "TIKTOKEN_CACHE_DIR": ""})
    assert proc.returncode in ok_codes, (
        f"{name} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def test_bench_forward_runs_on_cpu(tmp_path):
    lengths = [32, 64]
    proc = run_script("bench_forward.py", "--out", str(tmp_path), "--preset", "tiny", "--device", "cpu",
                      "--dtype", "float32", "--lengths", ",".join(map(str, lengths)), "--decode-batches", "1,2",
                      "--decode-context", "16", "--decode-steps", "2", "--no-peer", "--kernels",
                      "--kernel-tokens", "64", "--kernel-batch", "2", "--kernel-context", "128",
                      "--quantization", "bf16,nvfp4")
    assert "bf16: prefill (one cold forward" in proc.stdout and "nvfp4: prefill (one cold forward" in proc.stdout
    res = json.loads((tmp_path / "bench_forward.json").read_text())

    assert res["peak"]["flops_per_s"] > 0 and res["bandwidth"]["bytes_per_s"] > 0
    assert res["meta"]["preset"] == "tiny" and res["meta"]["versions"]["torch"]

    # One projection term and the routed experts, counted by hand from the preset's raw numbers.
    raw = preset_config("tiny")
    hidden, layers = raw["hidden_size"], raw["num_hidden_layers"]
    n_gdn = raw["layer_types"].count("linear_attention")
    conv_dim = (2 * raw["linear_num_key_heads"] * raw["linear_key_head_dim"]
                + raw["linear_num_value_heads"] * raw["linear_value_head_dim"])
    assert [r["tokens"] for r in res["prefill"]] == lengths
    for row in res["prefill"]:
        length, terms = row["tokens"], row["flops_terms"]
        assert terms["gdn.in_proj_qkv"] == 2 * length * n_gdn * hidden * conv_dim
        assert terms["moe.routed"] == (2 * length * layers * raw["num_experts_per_tok"] * 3 * hidden
                                       * raw["moe_intermediate_size"])
        assert terms["head.lm_head"] == 2 * hidden * raw["vocab_size"]  # the sampled row only
        assert row["flops"] == sum(terms.values())
        assert row["tok_s"] > 0 and row["ms"] > 0 and 0 < row["mfu"] < 10
        assert math.isclose(row["tok_s"], length / (row["ms"] / 1e3), rel_tol=1e-6)

    assert [r["batch"] for r in res["decode"]] == [1, 2]
    for row in res["decode"]:
        assert row["tok_s"] > 0 and len(row["steps_ms"]) == 2
        assert row["floor_bytes"] == sum(row["floor_bytes_terms"].values()) > 0
        assert 0 < row["floor_fraction"] < 10
    # More requests touch more experts; the dense weights are read once whatever the batch.
    one, two = (r["floor_bytes_terms"] for r in res["decode"])
    assert two["weights.routed_experts"] > one["weights.routed_experts"]
    assert two["weights.dense"] == one["weights.dense"]

    # The NVFP4 arm: the same forwards, its decode floor counting 4.5 bits a routed weight and an fp32 scale a row.
    assert set(res["arms"]) == {"bf16", "nvfp4"} and res["arms"]["bf16"]["decode"] == res["decode"]
    inter = raw["moe_intermediate_size"]
    for fp32, nvfp4 in zip(res["decode"], res["arms"]["nvfp4"]["decode"], strict=True):
        routed = [r["floor_bytes_terms"]["weights.routed_experts"] for r in (nvfp4, fp32)]
        ratio = routed[0] / routed[1]
        one = 3 * hidden * inter
        assert math.isclose(ratio, (one * 9 / 16 + 4 * (2 * inter + hidden)) / (one * 4))
        assert nvfp4["floor_bytes_terms"]["weights.dense"] == fp32["floor_bytes_terms"]["weights.dense"]
    assert [r["tokens"] for r in res["arms"]["nvfp4"]["prefill"]] == lengths

    statuses = {"ok", "missing", "error", "oom", "n/a"}
    assert len(res["kernels"]) >= 10
    nvfp4 = {row["name"]: row for row in res["kernels"] if row["name"].startswith("nvfp4 experts")}
    assert set(nvfp4) == {"nvfp4 experts prefill", "nvfp4 experts decode"}
    assert nvfp4["nvfp4 experts prefill"]["fast"]["status"] == nvfp4["nvfp4 experts prefill"]["ref"]["status"] == "ok"
    for row in res["kernels"]:
        assert row["bytes"] > 0 and row["floor_ms"] > 0
        for impl in ("fast", "ref", "library"):
            assert row[impl]["status"] in statuses, row
            if row[impl]["status"] == "ok":
                assert row[impl]["ms"] > 0 and row[impl]["roofline"] > 0
    assert any(row["ref"]["status"] == "ok" for row in res["kernels"])
    assert res["peer_ratio"] is None and "peer" not in res


def test_numerics_check_runs_on_cpu(tmp_path):
    run_script("numerics_check.py", "--out", str(tmp_path), "--preset", "tiny", "--tokens", "128", "--device", "cpu",
               "--chunk", "50", "--greedy-tokens", "4", ok_codes=(0, 1))  # 1: a gate failed, which CPU may do
    res = json.loads((tmp_path / "numerics_check.json").read_text())
    forced = res["teacher_forced"]
    assert forced["positions"] == 128
    assert 0 <= forced["strong_margin_positions"] <= 128
    if forced["top1_agreement"] is not None:
        assert 0 <= forced["top1_agreement"] <= 1
    assert 0 <= forced["top1_agreement_all_positions"] <= 1
    assert math.isfinite(forced["mean_abs_nll_diff"]) and forced["mean_abs_nll_diff"] >= 0
    assert forced["mean_nll_reference"] > 0
    greedy = res["greedy"]
    assert all(len(greedy[k]) == 4 for k in ("cold", "cold_again", "chunked", "cached"))
    assert greedy["cold_again"] == greedy["cold"]  # the CPU path is deterministic run to run
    # Row invariance at the model's own GEMM shapes (tiny: hidden 64) and the runs' row counts (131 rows scored).
    rows = res["gemm_row_invariance"]
    assert any(name.startswith("linear 1x64x") for name in rows)
    assert any(name.startswith("linear 131x") for name in rows)
    assert greedy["cached_tokens"] is None or greedy["cached_tokens"] > 0
    assert [g["name"] for g in res["gates"]] == ["top1_agreement", "mean_abs_nll_diff", "greedy_ids_equal"]
    assert res["pass"] == all(g["pass"] for g in res["gates"])


def test_bench_layer_major_runs_on_cpu(tmp_path):
    """The layer-major benchmark end to end on the tiny preset (three arms, the seed's request
    sequence at small lengths): every request passes its checks and all arms give the same ids."""
    out = tmp_path / "lm"
    proc = subprocess.run([sys.executable, script("bench_layer_major.py"), "--out", str(out),
                           "--preset", "tiny", "--device", "cpu", "--cold", "600", "--continuation", "665",
                           "--chunk", "128", "--max-tokens", "4", "--cache-fraction", "0.2"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((out / "bench_layer_major.json").read_text())
    assert set(data["summary"]) == {"chunked", "layer_major", "resident"}
    assert all(arm["all_checks_ok"] for arm in data["summary"].values())
    assert all(data["ids_equal_to_first_arm"].values())
    lm = [r for r in data["arms"][1]["requests"] if r["name"] == "cold-1"][0]
    assert lm["plan"]["mode"] == "layer_major" and lm["cached_tokens"] == 0
    cont = [r for r in data["arms"][1]["requests"] if r["name"] == "continuation-1"][0]
    assert cont["cached_tokens"] == 576
    # Streamed layers are counted: the chunked arm moves more expert bytes than the layer-major one.
    assert data["summary"]["chunked"]["h2d_bytes"] > data["summary"]["layer_major"]["h2d_bytes"] > 0


def test_bench_layer_major_with_quantized_random_weights_on_cpu(tmp_path):
    """Random NVFP4 experts streamed layer-major and resident: the same ids, memory and decode rate reported."""
    out = tmp_path / "lm"
    proc = subprocess.run([sys.executable, script("bench_layer_major.py"), "--out", str(out),
                           "--preset", "tiny", "--device", "cpu", "--cold", "600", "--continuation", "665",
                           "--chunk", "128", "--max-tokens", "4", "--cache-fraction", "0.2", "--pairs", "1",
                           "--quantization", "nvfp4", "--arms", "layer_major,resident"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((out / "bench_layer_major.json").read_text())
    assert data["quantization"] == "nvfp4" and set(data["summary"]) == {"layer_major", "resident"}
    assert all(data["ids_equal_to_first_arm"].values())
    lm, resident = data["summary"]["layer_major"], data["summary"]["resident"]
    assert data["layer_major_over_bound"] == pytest.approx(
        lm["first_text_s"] / max(lm["pcie_floor_s"], resident["first_text_s"]))
    cold = [r for r in data["arms"][0]["requests"] if r["name"] == "cold-0"][0]
    assert cold["plan"]["mode"] == "layer_major" and cold["checks_ok"]
    for arm in data["summary"].values():
        assert arm["all_checks_ok"] and arm["decode_tok_per_s"] > 0 and arm["host_bytes"] > 0
    # A streamed NVFP4 expert moves 4.5 bits a weight plus an fp32 scale a row, not 16 or 32 bits a weight.
    # The bytes "to first text" are read from /metrics once the first text arrived, so decode steps that ran
    # meanwhile may be in them: at most every routed expert once (layer-major prefill) and each later step's
    # experts missing from the cache. In bf16 the prefill alone would move 3.5x the first term.
    from tidal.executor.presets import preset_config

    c = preset_config("tiny")
    hidden, inter, layers = c["hidden_size"], c["moe_intermediate_size"], c["num_hidden_layers"]
    per_expert = 3 * hidden * inter * 9 // 16 + 4 * (2 * inter + hidden)
    streamed = layers * c["num_experts"] + (4 - 1) * layers * c["num_experts_per_tok"]
    assert 0 < data["summary"]["layer_major"]["h2d_bytes"] <= streamed * per_expert
    assert 0 < cold["expert_bytes"] <= streamed * per_expert


def test_profile_layer_major_runs_on_cpu(tmp_path):
    """The offline layer-major profile on the tiny preset: both arms, the expert bytes each moved (the
    chunked arm streams each layer once per chunk, layer-major once) and their ratio."""
    run_script("profile_layer_major.py", "--out", str(tmp_path), "--preset", "tiny", "--tokens", "700",
               "--chunk", "128", "--device", "cpu", "--dtype", "float32")
    data = json.loads((tmp_path / "profile_layer_major.json").read_text())
    arms = data["arms"]
    assert set(arms) == {"layer_major", "chunked"}
    # Counted from the preset: layer-major streams every routed expert once (fp32 gate, up and down);
    # chunked streams each layer again for each of the prompt's forwards of 128 tokens (the cache holds
    # fewer experts than a layer has).
    from tidal.scheduler.chunking import chunk_bounds

    raw = preset_config("tiny")
    expert = 3 * raw["hidden_size"] * raw["moe_intermediate_size"] * 4
    every_expert = raw["num_hidden_layers"] * raw["num_experts"] * expert
    forwards = len(chunk_bounds(0, 700, 128)) - 1
    assert data["slots"] < raw["num_experts"] and forwards == 6
    assert arms["layer_major"]["bytes"] == every_expert
    assert arms["chunked"]["bytes"] == forwards * every_expert


def test_profile_decode_runs_on_cpu(tmp_path):
    proc = run_script("profile_decode.py", "--out", str(tmp_path), "--preset", "tiny", "--device", "cpu",
                      "--batches", "1,2", "--contexts", "16,40", "--steps", "3", "--graphs", "on,off",
                      "--kernel-table", "3", "--layers", "2", "--quantization", "nvfp4")
    assert "graphs on: this device runs no CUDA graphs; skipped" in proc.stdout
    data = json.loads((tmp_path / "profile_decode.json").read_text())
    assert (data["layers"], data["quantization"]) == (2, "nvfp4")
    rows = data["rows"]
    assert [(r["cuda_graph"], r["batch"], r["context"]) for r in rows] == \
        [(False, 1, 16), (False, 2, 16), (False, 1, 40), (False, 2, 40)]
    for r in rows:
        assert r["steps"] == 3 and r["tok_per_s"] > 0 and r["wall_ms_per_step"] > 0
        # No CUDA device: the profiler saw no device kernel, so the GPU counts as busy for none of the step.
        assert r["kernels_per_step"] == 0 and r["gpu_busy_ms_per_step"] == 0


def test_bench_forward_without_decode_batches_runs_prefill_only(tmp_path):
    proc = run_script("bench_forward.py", "--out", str(tmp_path), "--preset", "tiny", "--device", "cpu",
                      "--dtype", "float32", "--lengths", "32", "--decode-batches", "", "--no-peer", "--no-kernels")
    res = json.loads((tmp_path / "bench_forward.json").read_text())
    assert [r["tokens"] for r in res["prefill"]] == [32] and res["decode"] == [], proc.stdout[-2000:]


def test_bench_forward_layers_keeps_the_presets_first_layers(tmp_path, monkeypatch):
    """``--layers N`` writes the preset's config with its first N decoder layers, the PLE layers among them
    kept (``ModelConfig.first_layers`` of the whole preset), and refuses more layers than the preset has."""
    import importlib.util

    import pytest

    from tidal.config.model import ModelConfig
    from tidal.executor.presets import write_checkpoint

    spec = importlib.util.spec_from_file_location("bench_forward", script("bench_forward.py"))
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, bench)
    spec.loader.exec_module(bench)
    for preset, n in (("flash-next", 36), ("small", 5), ("small", 1)):
        whole, cut = tmp_path / f"{preset}-{n}-whole", tmp_path / f"{preset}-{n}"
        write_checkpoint(preset, str(whole), weights=False)
        write_checkpoint(preset, str(cut), weights=False)
        bench.keep_first_layers(str(cut), n)
        want, got = ModelConfig.from_file(str(whole)).first_layers(n), ModelConfig.from_file(str(cut))
        assert got.num_hidden_layers == n and len(got.layer_types) == n
        assert (got.layer_types, got.ple_layer_ids, got.hidden_size) == \
            (want.layer_types, want.ple_layer_ids, want.hidden_size)
    assert ModelConfig.from_file(str(tmp_path / "small-1")).ple_layer_ids == ()
    with pytest.raises(SystemExit, match="--layers 9: the preset has 8 layers"):
        bench.keep_first_layers(str(tmp_path / "small-5-whole"), 9)


def test_bench_forward_decode_steps_run_on_the_graph_path(tiny_checkpoint, monkeypatch):
    """The benchmark's decode steps are decodes of generated tokens, so the runner's fixed-shape path
    (what a GPU replays as CUDA graphs; eager here) takes every one of them, in both arms: steps one by
    one, and steps launched ahead of the one before (token -1)."""
    import importlib.util

    import torch

    from tidal import LLM
    from tidal.config.model import ModelConfig

    spec = importlib.util.spec_from_file_location("bench_forward", script("bench_forward.py"))
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, bench)  # its dataclasses look their module up
    spec.loader.exec_module(bench)
    llm = LLM(tiny_checkpoint, max_running_requests=2)
    llm.runner.use_graphs(2, 64, capture=False)
    rows = bench.bench_decode(llm, ModelConfig.from_file(tiny_checkpoint), [1, 2], 20, 2, torch.device("cpu"),
                              bandwidth=1e9, elem=4, graphs=True)
    per_batch = 2 * (bench.DECODE_WARMUP + 2) + 1  # both arms; the pipelined one launches one step first
    assert [(r["batch"], r["pipelined"], r["graph_steps"]) for r in rows] == \
        [(1, False, per_batch), (1, True, per_batch), (2, False, per_batch), (2, True, per_batch)]
    assert llm.runner.graphs.steps == 2 * per_batch and not llm.runner.unfinished


def test_bench_decode_gemm_lists_the_weights_a_decode_step_multiplies_by(monkeypatch):
    """The device-only GEMM bench times each weight as the step runs it: stacked projections as one stack
    (their parts not again on their own), the rest alone; no experts, embeddings or lm_head."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_decode_gemm", script("bench_decode_gemm.py"))
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, bench)
    spec.loader.exec_module(bench)
    c = preset_config("tiny")
    shapes = bench.shapes("tiny")
    names = [name for group in shapes.values() for name in group]
    gdn = next(shape for shape, group in shapes.items() if group[0].startswith("[linear_attn.in_proj_qkv;"))
    value_dim = c["linear_num_value_heads"] * c["linear_value_head_dim"]
    key_dim = c["linear_num_key_heads"] * c["linear_key_head_dim"]
    assert gdn == (2 * key_dim + 2 * value_dim + 2 * c["linear_num_value_heads"], c["hidden_size"])
    assert "linear_attn.in_proj_z" not in names and "mlp.shared_expert.gate_proj" not in names
    assert "linear_attn.out_proj" in names and "mlp.gate" in names
    assert not any("experts." in n or "embed" in n or n == "lm_head" for n in names)


def test_bench_stall_free_runs_on_cpu(tmp_path):
    """The stall-free benchmark end to end on the tiny preset: the long prompt runs layer-major over turns
    with conversations decoding in the stall-free arm, chunked in the others, the figures are there, and every
    request's ids equal the first arm's."""
    out = tmp_path / "sf"
    proc = subprocess.run([sys.executable, script("bench_stall_free.py"), "--out", str(out),
                           "--preset", "tiny", "--device", "cpu", "--cold", "600", "--chunk", "128",
                           "--conversations", "2", "--turns", "2", "--long-tokens", "4", "--chat-tokens", "2000",
                           "--baseline-s", "1.5", "--cache-fraction", "0.3"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((out / "bench_stall_free.json").read_text())
    modes = {arm: rows["2"]["long_mode"] for arm, rows in data["summary"].items()}
    assert modes == {"stall_free:2": "layer_major", "single_turn": "chunked", "chunked": "chunked"}
    assert [arm["arm"] for arm in data["arms"]] == ["single_turn", "stall_free:2", "chunked"]
    for arm in data["arms"]:
        assert arm["left_after_stop"] == []
        r = arm["rounds"][0]
        assert r["during_prefill"]["gaps"] > 0 and r["baseline"]["gaps"] > 0
        assert r["long_first_text_s"] > 0 and arm["alone_first_text_s"] > 0
    row = data["summary"]["stall_free:2"]["2"]
    assert row["first_text_over_single_turn_alone"] > 0 and row["first_text_over_alone"] > 0
    same = data["ids_equal_to_first_arm"]
    assert set(same) == {"stall_free:2", "chunked"} and all(arm["all"] for arm in same.values()), same
    assert all(len(ids) > 0 for arm in data["arms"] for ids in arm["rounds"][0]["chat_ids"])


def test_bench_serving_runs_on_cpu(tmp_path):
    """The serving benchmark end to end on the tiny preset: every figure and its forward-level counterpart."""
    out = tmp_path / "sv"
    proc = subprocess.run([sys.executable, script("bench_serving.py"), "--out", str(out), "--preset", "tiny",
                           "--device", "cpu", "--lengths", "128,512", "--concurrency", "1,4", "--burst-prompt", "64",
                           "--burst-tokens", "16"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((out / "bench_serving.json").read_text())
    served, forward, ratios = data["serving"], data["forward"], data["ratios"]
    assert served["left_after_stop"] == [] and served["start_to_ready_s"] > 0
    assert served["continuation"]["cached_tokens"] == 512
    assert set(served["cold"]) == set(forward["prefill_s"]) == {"128", "512"}
    for c in ("1", "4"):
        assert served["bursts"][c]["all_tokens"] and forward["step_s"][c] > 0
        assert ratios["bursts"][c]["wall_over_forward"] > 0 and ratios["bursts"][c]["decode_over_forward"] > 0
        assert ratios["bursts"][c]["first_over_prefill"] == (served["bursts"][c]["first_text_p50_s"]
                                                           / forward["burst_prefill_s"][c])
    alone, rest = forward["first_then_rest_s"]["4"]
    assert alone > 0 and rest > 0 and "1" not in forward["first_then_rest_s"]
    assert all(r > 0 for r in ratios["cold_over_forward"].values()) and ratios["first_over_warm"] > 0
    first = served["first_burst_after_ready"]
    assert first["concurrency"] == 4 and first["first_s"] > 0 and ratios["first_burst_over_second"] > 0


def test_bench_startup_runs_on_cpu(tmp_path):
    """The start-up benchmark end to end on the tiny preset: a start, then one with --no-prefill-coalesce over the
    compile cache the first left, each start's first burst against its second, the counters read from /metrics,
    /health probed during the bursts, first texts of the two starts side by side."""
    out = tmp_path / "st"
    proc = subprocess.run([sys.executable, script("bench_startup.py"), "--out", str(out), "--preset", "tiny",
                           "--device", "cpu", "--lengths", "16,100", "--burst", "4", "--burst-prompt", "32",
                           "--starts", "1", "--coalesce"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((out / "bench_startup.json").read_text())
    assert len(data["starts"]) == 1 and "--no-prefill-coalesce" not in data["flags"]
    assert data["other_start"]["flag"] == "--no-prefill-coalesce"
    for start in (*data["starts"], data["other_start"]):
        assert start["left_after_stop"] == [] and start["start_to_ready_s"] > 0
        assert start["first_burst_over_second"] > 0 and set(start["first_text_s"]) == {"16", "100"}
        assert start["health_during_bursts_s"]["probes"] > 0
        assert start["after_ready"] == {"tidal_compilations_after_ready_total": 0.0,
                                        "tidal_graph_captures_after_ready_total": 0.0}
    for n, ratio in data["coalesce_over_aligned"].items():
        assert math.isclose(ratio, data["starts"][0]["first_text_s"][n] / data["other_start"]["first_text_s"][n])
    assert "coalesced against" in proc.stdout and "with --no-prefill-coalesce" in proc.stdout


def test_bench_vision_runs_on_cpu(tmp_path):
    """The vision benchmark end to end on the tiny preset with a small tower: cold and warm first text, the
    prefix cached on the warm run, the tower's share and the forward-level prefill."""
    out = tmp_path / "vl"
    vision = '{"depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 4, "num_position_embeddings": 64}'
    proc = subprocess.run([sys.executable, script("bench_vision.py"), "--out", str(out), "--preset", "tiny",
                           "--device", "cpu", "--prompt-tokens", "300", "--vision", vision],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((out / "bench_vision.json").read_text())
    assert data["left_after_stop"] == [] and 250 <= data["cold"]["prompt_tokens"] <= 320
    assert data["warm"]["cached_tokens"] >= data["cold"]["prompt_tokens"] - 64
    assert 0 < data["encoder_share_of_cold"] < 1 and data["forward_prefill_s"] > 0


def test_profile_layer_major_streams_nvfp4_bytes(tmp_path):
    """With ``--quantization nvfp4`` the host banks hold the packed layout: layer-major moves every routed expert
    once, in NVFP4's bytes (two codes a byte, an e4m3 scale per 16 values, an fp32 global scale per row)."""
    run_script("profile_layer_major.py", "--out", str(tmp_path), "--preset", "tiny", "--tokens", "700",
               "--chunk", "128", "--device", "cpu", "--dtype", "float32", "--quantization", "nvfp4",
               "--arms", "layer_major")
    data = json.loads((tmp_path / "profile_layer_major.json").read_text())
    raw = preset_config("tiny")
    hidden, inter = raw["hidden_size"], raw["moe_intermediate_size"]
    weights = 3 * hidden * inter
    expert = weights // 2 + weights // 16 + 4 * (2 * inter + hidden)
    assert (data["layers"], data["quantization"]) == (raw["num_hidden_layers"], "nvfp4")
    assert data["arms"]["layer_major"]["bytes"] == raw["num_hidden_layers"] * raw["num_experts"] * expert


def test_bench_prefill_graphs_runs_on_cpu(tmp_path):
    """Both arms of every case, and which cases the graphs' path took: prompts up to the largest captured size
    (2,114 rows under --prefill-graph-max-tokens 2112) and the continuation; not a longer one."""
    out = tmp_path / "out"
    run_script("bench_prefill_graphs.py", "--out", str(out), "--preset", "tiny", "--lengths", "37,130,2200",
               "--context", "300", "--repeats", "1", "--device", "cpu", "--profile", "3", "--",
               "--prefill-graph-max-tokens", "2112")
    result = json.loads((out / "bench_prefill_graphs.json").read_text())
    assert result["largest_rows"] == 2114 and result["graph_bytes"] == 0
    rows = {r["case"]: r for r in result["rows"]}
    assert list(rows) == ["cold 37", "cold 130", "cold 2200", "+77 after 300"]
    assert [rows[c]["replayed"] for c in rows] == [True, True, False, True]
    for r in rows.values():
        assert len(r["samples"]["graphs"]) == len(r["samples"]["eager"]) == 1
        assert r["graphs_over_eager"] == r["graphs_s"] / r["eager_s"] > 0
        for arm in ("graphs", "eager"):  # the host's split of a sample adds up to its wall time
            split = r["host_split"][arm]
            assert split["steps_s"]["forward"] > 0 and split["steps_s"]["schedule"] > 0
            assert sum(split["steps_s"].values()) == pytest.approx(split["wall_s"])
        for arm in ("graphs", "eager"):  # a CPU run records no device events
            assert r["profile"][arm]["wall_s"] > 0 and r["profile"][arm]["device_events"] == 0
