"""``tidal checkpoint``: Hugging Face-format Qwen4-Exp checkpoints with seeded random weights."""

from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors.torch import save_file

from ..config.model import ModelConfig
from ..tokenizer import QWEN3_5_PAT_STR, _bundled_bpe, qwen_special_tokens, write_hf_tokenizer
from .layers.ple import hashing_constants
from .loader import empty_model
from .progress import progress
from .weights import random_tensor, split_for_checkpoint

IM_END, ENDOFTEXT = 248046, 248044
QWEN_VOCAB = 248320  # the embedding rows of Qwen3.5/3.6 (248,077 tokenizer ids, padded)

_COMMON = dict(
    model_type="qwen4_exp_text", vocab_size=QWEN_VOCAB, hidden_act="silu", rms_norm_eps=1e-6,
    eos_token_id=IM_END, tie_word_embeddings=False, linear_conv_kernel_dim=4, norm_topk_prob=True,
    ngram_size=3, ple_conv_kernel_size=4, make_ngram_vocab_size_divisible_by=128, seed=1234,
    indexer_kv_heads=1, max_position_embeddings=32768, dtype="bfloat16",
)

PRESETS: dict[str, dict] = {
    # A few layers with every feature: GDN with grouped value heads, QSA that drops blocks past 40
    # tokens, two PLE layers, hc 4, 8 experts. Fast on two CPU cores.
    "tiny": dict(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
        hc_count=4, hc_lowrank=16, ple_layer_ids=[1, 4], ple_embed_dim=32, heads_per_ngram=2,
        ngram_vocab_size_base=1009, split_ngram_parts=4,
        indexer_n_heads=4, indexer_head_dim=32, indexer_budget=32, indexer_compress_ratio=8,
    ),
    # The CPU demo: answers in tens of milliseconds per token on two cores.
    "small": dict(
        hidden_size=256, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
        layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.5},
        linear_key_head_dim=32, linear_value_head_dim=32, linear_num_key_heads=4, linear_num_value_heads=8,
        moe_intermediate_size=128, shared_expert_intermediate_size=256, num_experts=16, num_experts_per_tok=4,
        hc_count=4, hc_lowrank=64, ple_layer_ids=[2, 6], ple_embed_dim=128, heads_per_ngram=4,
        ngram_vocab_size_base=20011, split_ngram_parts=8,
        indexer_n_heads=4, indexer_head_dim=64, indexer_budget=256, indexer_compress_ratio=16,
    ),
    # Per-layer shapes of transformers' default Qwen4ExpTextConfig, 8 layers, 2 of them QSA, one PLE
    # layer with a reduced n-gram vocabulary.
    "bench": dict(
        hidden_size=2048, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
        layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32,
        moe_intermediate_size=512, shared_expert_intermediate_size=512, num_experts=512, num_experts_per_tok=10,
        hc_count=4, hc_lowrank=320, ple_layer_ids=[2], ple_embed_dim=2048, heads_per_ngram=8,
        ngram_vocab_size_base=200003, split_ngram_parts=16,
        indexer_n_heads=16, indexer_head_dim=128, indexer_budget=2048, indexer_compress_ratio=64,
    ),
    # The published geometry of Qwen3.8-Flash-Next (config-only: its random weights in bf16 would be ~0.5 TB; serve
    # it with --load-format random --quantization nvfp4|fp8). Every value is the released text config's
    # (Qwen/Qwen3.8-Flash-Next config.json, as FreeToken's tests/models/test_qwen4_exp_raw_config.py, NInfer's
    # docs/maintainer/qwen4_exp-model.md "Released geometry" and SGLang's configs/qwen4_exp.py carry it): 48
    # layers, attention every 4th (12 layers), hidden 2560, 24 query and 2 KV heads of 256, GDN 16 key and 48
    # value heads of 128, 512 experts of 640 with top-10 and a 640 shared expert, hc 4 of low rank 320, one PLE
    # layer (one-indexed 2) of 16 heads x 160 over 2 x 10^7-based prime vocabularies in 128 shards (320,001,536
    # rows: 47.7 GiB in FP8), QSA 4 index heads of 128, budget 2048, compress ratio 4, context 262,144, EOS
    # 248044. Its rope is mrope (sections [11, 11, 10]), which for text positions is the plain rotary used here;
    # norm_topk_prob and seed are absent from the released file, so transformers' defaults (true, 1234) hold.
    "flash-next": dict(
        hidden_size=2560, num_hidden_layers=48, num_attention_heads=24, num_key_value_heads=2, head_dim=256,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 12,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=48,
        moe_intermediate_size=640, shared_expert_intermediate_size=640, num_experts=512, num_experts_per_tok=10,
        hc_count=4, hc_lowrank=320, ple_layer_ids=[2], ple_embed_dim=2560, heads_per_ngram=8,
        ngram_vocab_size_base=20000000, split_ngram_parts=128, output_gate_type="sigmoid",
        indexer_n_heads=4, indexer_head_dim=128, indexer_budget=2048, indexer_compress_ratio=4,
        max_position_embeddings=262144, eos_token_id=ENDOFTEXT,
    ),
}
# Presets written as config and tokenizer only (their weights are generated where they are served).
CONFIG_ONLY = ("flash-next",)

# The chat template ``tidal checkpoint`` writes: ChatML, with tools and reasoning in the style of
# Qwen3's template. Given ``tools``, a system turn lists their JSON signatures and the
# ``<tool_call>`` format; assistant ``tool_calls`` render as ``<tool_call>`` blocks; ``tool``
# messages render as ``<tool_response>`` blocks inside a user turn; an assistant turn before the
# last user query loses its reasoning (the text up to ``</think>``, or ``reasoning_content``), one
# after it keeps it in a ``<think>`` block. ``enable_thinking=False`` closes an empty ``<think>``
# block in the generation prompt. A conversation without any of these renders as plain ChatML.
CHAT_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within ' }}
    {{- '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": ' }}
    {{- '<args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == 'user' and message.content is string
          and not (message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if message.role == 'system' and loop.first and tools %}
    {%- elif message.role == 'assistant' %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string and message.reasoning_content %}
            {%- set reasoning_content = message.reasoning_content %}
            {%- if '</think>' in content %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- elif '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if reasoning_content and loop.index0 > ns.last_query_index %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' }}
            {{- content.lstrip('\\n') }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": ' + (tool_call.name | tojson) + ', "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

SHARD_BYTES = 2 << 30


def preset_config(name: str) -> dict:
    if name not in PRESETS:
        raise ValueError(f"--preset {name!r} is unknown; expected one of {sorted(PRESETS)}")
    cfg = {**_COMMON, **PRESETS[name]}
    cfg["architectures"] = ["Qwen4ExpForCausalLM"]
    return cfg


def write_tokenizer(out: str, model_max_length: int = 32768) -> None:
    """The Qwen3.5/3.6 tokenizer as tidal and Hugging Face tools read it: the BPE ranks
    (``qwen3_6.tiktoken``, which tidal loads), the same vocabulary as a ``tokenizer.json`` with a
    ``tokenizer_config.json`` (which ``transformers.AutoTokenizer`` loads, to the same ids), and the chat
    template (``CHAT_TEMPLATE``)."""
    shutil.copyfile(_bundled_bpe(), os.path.join(out, "qwen3_6.tiktoken"))
    specials = qwen_special_tokens()
    write_hf_tokenizer(os.path.join(out, "tokenizer.json"), _bundled_bpe(), specials, QWEN3_5_PAT_STR)
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump({
            "tokenizer_class": "Qwen2Tokenizer",
            "model_max_length": model_max_length,
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "bos_token": None,
            "unk_token": None,
            "clean_up_tokenization_spaces": False,
            "split_special_tokens": False,
            "errors": "replace",
            "added_tokens_decoder": {
                str(i): {"content": t, "lstrip": False, "rstrip": False, "normalized": False, "single_word": False,
                         "special": True} for t, i in sorted(specials.items(), key=lambda kv: kv[1])},
            "chat_template": CHAT_TEMPLATE,
        }, f, indent=2, ensure_ascii=False)
    with open(os.path.join(out, "chat_template.jinja"), "w") as f:
        f.write(CHAT_TEMPLATE)


def keep_first_layers(ckpt: str, n: int) -> None:
    """Rewrite ``ckpt``'s config.json with its first ``n`` decoder layers (the benchmarks' and tools' ``--layers``)."""
    path = os.path.join(ckpt, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    if not 1 <= n <= cfg["num_hidden_layers"]:
        raise SystemExit(f"--layers {n}: the preset has {cfg['num_hidden_layers']} layers")
    cfg["num_hidden_layers"] = n
    if "layer_types" in cfg:
        cfg["layer_types"] = cfg["layer_types"][:n]
    if "ple_layer_ids" in cfg:
        cfg["ple_layer_ids"] = [i for i in cfg["ple_layer_ids"] if i <= n]
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2)


def write_checkpoint(preset: str | None, out: str, seed: int = 0, weights: bool = True,
                     overrides: dict | None = None, quantize: str | None = None, source: str | None = None) -> str:
    """Write config.json, generation_config.json, tokenizer files and (unless ``weights=False``)
    safetensors shards: the ``preset``'s seeded random weights in bf16, or the dense checkpoint ``source``'s
    tensors; with ``quantize`` (``nvfp4``, ``fp8``) its routed experts and n-gram table in that published layout
    (:func:`~tidal.executor.quant_writer.quantized_tensors`). Returns ``out``."""
    from .quant_writer import copy_source_files, quantization_files, quantized_tensors, source_tensors

    if source is not None:
        with open(os.path.join(source, "config.json")) as f:
            data = json.load(f)
        if data.get("quantization_config") or os.path.exists(os.path.join(source, "hf_quant_config.json")):
            raise ValueError(f"--from {source}: the checkpoint is quantized already; give a dense one")
    else:
        data = preset_config(preset)
        if weights and preset in CONFIG_ONLY:
            raise ValueError(f"--preset {preset} is written as config and tokenizer only (--config-only): "
                             "serve it with --load-format random, e.g. with --quantization nvfp4")
    data.update(overrides or {})
    config = ModelConfig.from_dict(data)
    os.makedirs(out, exist_ok=True)
    if source is not None:
        copy_source_files(source, out)
    else:
        with open(os.path.join(out, "generation_config.json"), "w") as f:
            json.dump({"eos_token_id": [IM_END, ENDOFTEXT], "pad_token_id": ENDOFTEXT}, f, indent=2)
        write_tokenizer(out, config.max_position_embeddings)
    if quantize is not None:
        data = quantization_files(out, data, config, quantize, prefix=_module_prefix(source))
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(data, f, indent=2)
    if not weights:
        return out
    if source is not None:
        from .quant_writer import source_keys

        tensors = progress(source_tensors(source), total=len(source_keys(source)),
                           desc=f"writing {os.path.basename(os.path.normpath(source))}", unit="tensor")
    else:
        tensors = _preset_tensors(config, seed, desc=f"writing {preset} checkpoint")
    if quantize is not None:
        tensors = quantized_tensors(tensors, config, quantize)
    _write_shards(out, tensors)
    return out


def _module_prefix(source: str | None) -> str:
    """``model.`` or, for a composite (vision-language) checkpoint, the prefix its text layers carry."""
    if source is None:
        return "model."
    from .quant_writer import source_keys

    for key in source_keys(source):
        if ".layers." in key and key.endswith(".mlp.gate.weight"):
            return key[: key.index("layers.")]
    return "model."


def _preset_tensors(config: ModelConfig, seed: int, desc: str):
    """``(checkpoint key, tensor)`` of a preset's seeded random weights, as ``save_pretrained`` names them; the
    progress bar counts the model's parameters."""
    model = empty_model(config, "meta", torch.bfloat16)
    params = [(name, param) for name, param in model.named_parameters()
              if not (name == "lm_head.weight" and config.tie_word_embeddings)]
    for name, param in progress(params, desc=desc, unit="tensor"):
        tensor = random_tensor(name, tuple(param.shape), config, seed).to(torch.bfloat16)
        yield from split_for_checkpoint(name, tensor, config)
    for layer in config.ple_layers:  # the hashing buffers, as save_pretrained writes them
        for name, value in hashing_constants(config, config.ple_layers.index(layer)).items():
            yield f"model.layers.{layer}.ple.ple_embedding.{name}", value


def _write_shards(out: str, tensors) -> None:
    files: list[tuple[str, list[str]]] = []
    shard: dict[str, torch.Tensor] = {}
    size = 0

    def flush() -> None:
        nonlocal shard, size
        path = os.path.join(out, f"model-part-{len(files):05d}.safetensors")
        save_file(shard, path, metadata={"format": "pt"})
        files.append((path, list(shard)))
        shard, size = {}, 0

    for key, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if size and size + nbytes > SHARD_BYTES:
            flush()
        shard[key] = tensor.contiguous().clone()
        size += nbytes
    flush()
    if len(files) == 1:
        os.replace(files[0][0], os.path.join(out, "model.safetensors"))
        return
    weight_map = {}
    for i, (path, keys) in enumerate(files):
        file = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        os.replace(path, os.path.join(out, file))
        weight_map.update({k: file for k in keys})
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2)
