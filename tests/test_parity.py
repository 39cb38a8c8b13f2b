"""tidal's model against transformers' ``Qwen4ExpForCausalLM`` on the same checkpoint (float32)."""

from __future__ import annotations

import pytest
import torch

from tidal import LLM
from tidal.config.model import ModelConfig

PROMPT_LEN = 300
GREEDY_TOKENS = 32


@pytest.fixture(scope="module")
def tidal_variant(tmp_path_factory) -> str:
    """A tidal-written checkpoint without PLE, with tied embeddings and plain (non-grouped) GQA 4/4."""
    from tidal.executor.presets import write_checkpoint

    return write_checkpoint("tiny", str(tmp_path_factory.mktemp("variant")), seed=7, overrides=dict(
        ple_layer_ids=[], tie_word_embeddings=True, num_key_value_heads=4, hc_count=2,
        layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention"],
        indexer_budget=64, indexer_compress_ratio=16,
    ))


@pytest.fixture(scope="module", params=["tidal_tiny", "hf_hc2_gqa4", "hf_hc3_ngram4", "hf_kernels_tied",
                                        "tidal_variant"])
def checkpoint(request, tiny_checkpoint, hf_checkpoints, tidal_variant) -> str:
    if request.param == "tidal_tiny":
        return tiny_checkpoint
    if request.param == "tidal_variant":
        return tidal_variant
    return hf_checkpoints[request.param]


def reference_model(path: str, device: str):
    from transformers import AutoConfig, Qwen4ExpForCausalLM, Qwen4ExpForConditionalGeneration

    cls = Qwen4ExpForConditionalGeneration if AutoConfig.from_pretrained(path).model_type == "qwen4_exp" \
        else Qwen4ExpForCausalLM
    return cls.from_pretrained(path, dtype=torch.float32).to(device).eval()


def prompt_for(config: ModelConfig, seed: int = 0) -> list[int]:
    """Random ids with EOS inside the prompt (n-gram history resets there), twice back to back."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, min(config.vocab_size, 248000), (PROMPT_LEN,), generator=gen)
    eos = config.eos_token_ids[0]
    for pos in (37, 150, 151, 299):
        ids[pos] = eos
    return ids.tolist()


def test_logits_and_greedy_ids_match_transformers(checkpoint, device):
    config = ModelConfig.from_file(checkpoint)
    if config.has_qsa:  # QSA must really drop blocks at this length for the comparison to mean anything
        assert PROMPT_LEN // config.indexer_compress_ratio > config.qsa_block_topk
    prompt = prompt_for(config)
    ref = reference_model(checkpoint, device)
    with torch.no_grad():
        ref_logits = ref(torch.tensor([prompt], device=device)).logits[0].float().cpu()
        ref_ids = ref.generate(torch.tensor([prompt], device=device), max_new_tokens=GREEDY_TOKENS,
                               do_sample=False, eos_token_id=None, pad_token_id=0)[0, PROMPT_LEN:].tolist()
    del ref
    llm = LLM(checkpoint, device=device, dtype="float32")
    logits = llm.score(prompt)
    diff = (logits - ref_logits).abs().max().item()
    print(f"{checkpoint}: max |logits - transformers| = {diff:.3e} (logit scale {ref_logits.abs().max():.2f})")
    assert logits.shape == ref_logits.shape
    assert diff <= 1e-3
    ids = llm.generate([prompt], max_tokens=GREEDY_TOKENS, ignore_eos=True)[0]
    assert ids == ref_ids


def test_one_token_prompt_greedy_ids_match_transformers(tiny_checkpoint, device):
    """A one-token prompt is a decode-shaped row from the first forward (a fresh state slot, the PLE and
    GDN convs' decode forms): the greedy ids still equal transformers'."""
    prompt = [1234]
    ref = reference_model(tiny_checkpoint, device)
    with torch.no_grad():
        ref_ids = ref.generate(torch.tensor([prompt], device=device), max_new_tokens=8, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, 1:].tolist()
    del ref
    llm = LLM(tiny_checkpoint, device=device, dtype="float32")
    assert llm.generate([prompt], max_tokens=8, ignore_eos=True)[0] == ref_ids
