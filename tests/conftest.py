"""Shared fixtures: checkpoints written by ``tidal checkpoint`` and by transformers' ``save_pretrained``.

``TIDAL_TEST_DEVICE=cuda`` runs the model tests on a GPU (float32); GPU-marked tests skip without one.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

warnings.filterwarnings("ignore", message=".*falling back to its reference PyTorch implementation.*")
os.environ.setdefault("TIKTOKEN_CACHE_DIR", "")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

DEVICE = os.environ.get("TIDAL_TEST_DEVICE", "cpu")
if DEVICE.startswith("cuda"):
    # Exact float32 on both sides: no TF32 in cuDNN convs or matmuls.
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False


# The longest files go first, longest first: `make test` runs two pytest-xdist workers that take a file at a
# time, in collection order, so a long file started last would leave one worker running it alone at the end.
FIRST = ("test_docker.py", "test_bench_scripts.py", "test_tensor_parallel.py", "test_faults.py", "test_quantized.py",
         "test_kernel_attention.py", "test_client_tools.py", "test_load.py", "test_server.py")


def pytest_configure(config):
    # pytest-xdist (3.x) otherwise hands out the files with the most tests first, whatever the collection order.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    # stable: the other files keep their order
    items.sort(key=lambda item: FIRST.index(item.path.name) if item.path.name in FIRST else len(FIRST))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
    if DEVICE.startswith("cuda"):
        raise pytest.UsageError("TIDAL_TEST_DEVICE=cuda but no CUDA device is available")


@pytest.fixture(scope="session")
def device() -> str:
    return DEVICE


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> str:
    from tidal.executor.presets import write_checkpoint

    return write_checkpoint("tiny", str(tmp_path_factory.mktemp("tiny")), seed=0)


@pytest.fixture
def same_ids_as_torch_ops(tiny_checkpoint, monkeypatch):
    """``check(ops)``: the tiny model's greedy ids in fp32 on the GPU, decode steps replayed from CUDA graphs,
    equal those of the same model with the operations ``ops`` sent to their torch references
    (``TIDAL_KERNELS=torch:OPS``, which also decodes without graphs)."""
    from tidal import LLM

    def check(ops: str) -> None:
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, 248000, (n,), generator=gen).tolist() for n in (37, 1, 100)]
        kwargs = dict(max_tokens=40, ignore_eos=True)
        monkeypatch.setenv("TIDAL_KERNELS", f"torch:{ops}")
        want = LLM(tiny_checkpoint, device="cuda", dtype="float32", max_prefill_length=64).generate(prompts, **kwargs)
        monkeypatch.delenv("TIDAL_KERNELS")
        llm = LLM(tiny_checkpoint, device="cuda", dtype="float32", max_prefill_length=64)
        assert llm.generate(prompts, **kwargs) == want
        assert llm.runner.graphs is not None and llm.runner.graphs.steps > 0

    return check


# Text configs for transformers-written checkpoints. They differ from the tiny preset and from each
# other in hc_count, GQA ratio, grouped value heads, QSA budget/ratio, PLE layers and ngram_size.
HF_CONFIGS = {
    "hf_hc2_gqa4": dict(
        vocab_size=1024, hidden_size=48, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=1,
        head_dim=16, layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention",
                                  "full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                         "mrope_section": [2, 3, 3]},
        linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=2,
        moe_intermediate_size=24, shared_expert_intermediate_size=32, num_experts=8, num_experts_per_tok=3,
        hc_count=2, hc_lowrank=8, ple_layer_ids=[2], ple_embed_dim=32, ngram_size=2, heads_per_ngram=4,
        ngram_vocab_size_base=257, split_ngram_parts=2, eos_token_id=1000,
        indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=16, indexer_compress_ratio=4,
    ),
    "hf_hc3_ngram4": dict(
        vocab_size=1536, hidden_size=64, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
        head_dim=16, layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 1.0,
                         "mrope_section": [4, 2, 2]},
        linear_key_head_dim=8, linear_value_head_dim=16, linear_num_key_heads=1, linear_num_value_heads=4,
        moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=12, num_experts_per_tok=4,
        hc_count=3, hc_lowrank=12, ple_layer_ids=[1, 3, 4], ple_embed_dim=48, ngram_size=4, heads_per_ngram=1,
        ngram_vocab_size_base=101, split_ngram_parts=3, eos_token_id=1500, output_gate_type="sigmoid",
        indexer_n_heads=3, indexer_kv_heads=1, indexer_head_dim=24, indexer_budget=48, indexer_compress_ratio=16,
    ),
    "hf_kernels_tied": dict(
        vocab_size=800, hidden_size=32, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2,
        head_dim=16, layer_types=["linear_attention", "full_attention", "linear_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0, "partial_rotary_factor": 0.25},
        linear_conv_kernel_dim=3, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
        linear_num_value_heads=6, moe_intermediate_size=16, shared_expert_intermediate_size=8, num_experts=4,
        num_experts_per_tok=1, hc_count=4, hc_lowrank=4, ple_layer_ids=[3], ple_embed_dim=16, ngram_size=2,
        heads_per_ngram=2, ple_conv_kernel_size=2, ngram_vocab_size_base=53, split_ngram_parts=1,
        eos_token_id=[700, 701], tie_word_embeddings=True, norm_topk_prob=False,
        indexer_n_heads=1, indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=40, indexer_compress_ratio=20,
    ),
}


def build_hf_checkpoint(path: str, text_config: dict, composite: bool = False, seed: int = 0) -> str:
    """Write a checkpoint with transformers' own ``save_pretrained``.

    Weights are re-drawn so that no path is a no-op (transformers' training init zeroes every
    ``1 + w`` norm offset and the PLE conv).
    """
    from transformers import Qwen4ExpConfig, Qwen4ExpForCausalLM, Qwen4ExpForConditionalGeneration, Qwen4ExpTextConfig

    from tidal.executor.weights import random_tensor

    torch.manual_seed(seed)
    if composite:
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                      out_hidden_size=text_config["hidden_size"], num_position_embeddings=16)
        model = Qwen4ExpForConditionalGeneration(Qwen4ExpConfig(text_config=text_config, vision_config=vision))
        prefix = "model.language_model."
    else:
        model = Qwen4ExpForCausalLM(Qwen4ExpTextConfig(**text_config))
        prefix = "model."
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.startswith(prefix):
                text_name = "model." + name[len(prefix):]
            elif name.startswith("lm_head"):
                text_name = name
            else:
                continue
            param.copy_(random_tensor(text_name, tuple(param.shape), None, seed))
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory) -> dict[str, str]:
    out = {}
    for i, (name, cfg) in enumerate(HF_CONFIGS.items()):
        out[name] = build_hf_checkpoint(str(tmp_path_factory.mktemp(name)), cfg, composite=(i == 1), seed=i + 1)
    return out


@pytest.fixture(scope="session")
def server(tiny_checkpoint):
    """A ``tidal serve`` of the tiny checkpoint without an API key, shared by the test modules that one pytest
    process runs (a module may define its own ``server`` instead): their tests leave it idle and serving, and
    read its counters as differences or bounds."""
    from server_harness import Server

    srv = Server(tiny_checkpoint, api_key=None)
    yield srv
    assert srv.stop() == []


@pytest.fixture(scope="module")
def client(server):
    """The official ``openai`` SDK pointed at ``server``."""
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key or "none")


@pytest.fixture(scope="module")
def tap(server):
    """The read-only tap of ``server``."""
    from server_harness import Tap

    tap = Tap(server.tap_addr)
    yield tap
    tap.close()
