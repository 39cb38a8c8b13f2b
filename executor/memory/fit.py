"""The start-up memory check: whether one host's executor ranks fit the device (or, on the CPU, the host)
with the weights, KV pool and state slots the flags ask for. Builds the model and pools on the meta device:
nothing is allocated."""

from __future__ import annotations

import torch

from ...config.model import ModelConfig
from ...config.pools import pool_sizes
from ...config.server_args import ArgsError, ServerArgs
from ...runtime.ipc import host_memory
from ..loader import host_resident, resolve_dtype, stored_dtype
from ..models.qwen4_exp import Qwen4ExpForCausalLM
from .kv_cache import KVPool
from .state_slots import StatePool

GiB = 1 << 30


def memory_plan(args: ServerArgs, config: ModelConfig, device: str) -> dict[str, int]:
    """Bytes each executor rank allocates for weights on the device, weights in host memory, the KV
    pool and the state slots (the module tree and pools built on the meta device: nothing allocated)."""
    sizes = pool_sizes(args, config)
    dtype = resolve_dtype(args.dtype, config, device)
    with torch.device("meta"):
        model = Qwen4ExpForCausalLM(config)
    on_device = on_host = 0
    tensors = [(n, p.numel() * stored_dtype(n, config, dtype).itemsize) for n, p in model.named_parameters()]
    tensors += [(n, b.numel() * b.element_size()) for n, b in model.named_buffers() if ".mlp.experts." in n]
    for name, nbytes in tensors:
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if args.ple_backend == "disk" and name.endswith("ngram_embedding.weight"):
            continue
        if host_resident(name, args.moe_strategy, args.ple_backend):
            on_host += nbytes
        else:
            on_device += nbytes
    kv = KVPool(config, 1, sizes.page_size, "meta", dtype).bytes_per_token() * sizes.num_pages * sizes.page_size
    state = StatePool(config, 1, "meta", dtype).bytes_per_slot() * sizes.num_slots
    # Under --tp the weights and KV heads split across the ranks (roughly evenly); state slots too.
    return {"weights_device": on_device // args.tp, "weights_host": on_host // args.tp,
            "kv": kv // args.tp, "state": state // args.tp}


# Host memory the processes of a mesh take besides the locked weights: per executor rank (torch, the CUDA context,
# staging of the tensors being loaded) and once for the frontend, scheduler, detokenizer and tokenizer workers.
HOST_PER_RANK = 3 * GiB
HOST_MESH = 2 * GiB


def host_memory_total() -> int | None:
    return host_memory("MemTotal")


def check_fits(args: ServerArgs, config: ModelConfig, device: str) -> dict[str, int]:
    """Raise ``ArgsError`` naming the flag when the pools cannot hold one request, or when one host's
    ranks need more memory than the device has (on the CPU: more than the host's total memory), or their
    host-resident weights (locked in host memory) and processes more than the host has. Returns the plan
    (:func:`memory_plan`)."""
    cuda = device.startswith("cuda")
    if cuda:
        if not torch.cuda.is_available():
            raise ArgsError(f"--device: {device} asked for, but this torch build or host has no CUDA device "
                            f"(torch {torch.__version__}); use --device cpu")
        index = torch.device(device).index or 0
        if index >= torch.cuda.device_count():
            raise ArgsError(f"--device: {device} asked for, but only {torch.cuda.device_count()} CUDA device(s) "
                            "are visible")
        have, where, ranks = torch.cuda.get_device_properties(index).total_memory, f"{device} has", 1
    else:
        have, where = host_memory_total(), "the host has"
        ranks = args.tp // args.nnodes  # every rank of this host shares its memory
        if have is None:
            return memory_plan(args, config, device)
    plan = memory_plan(args, config, device)
    weights = (plan["weights_device"] + (0 if cuda else plan["weights_host"])) * ranks
    kv, state = plan["kv"] * ranks, plan["state"] * ranks
    dtype = args.dtype if args.dtype != "auto" else "the default dtype"
    fmt = f"{config.quantization.label}, {dtype} for the rest" if config.quantization else dtype
    quantize = "" if config.quantization else "a quantized checkpoint or --quantization nvfp4 with random weights, "
    if weights > have:
        raise ArgsError(f"--dtype: the weights alone need {weights / GiB:.1f} GiB in {fmt}; {where} "
                        f"{have / GiB:.1f} GiB ({quantize}a smaller --dtype, more --tp ranks, or --moe-strategy "
                        "offload)")
    host = host_memory_total() if cuda else None
    host_ranks = args.tp // args.nnodes
    locked = plan["weights_host"] * host_ranks
    processes = HOST_MESH + HOST_PER_RANK * host_ranks
    if host is not None and locked and locked + processes > host:
        # Offloaded experts and a pinned n-gram table are locked pages: with the processes beside them they
        # cannot exceed the host's memory (or the kernel's out-of-memory killer ends an executor as it loads).
        disk = "" if args.ple_backend == "disk" else "--ple-backend disk, "
        raise ArgsError(f"--moe-strategy: the host-resident weights need {locked / GiB:.1f} GiB in {fmt}, locked, "
                        f"and the processes about {processes / GiB:.0f} GiB more; the host has {host / GiB:.1f} GiB "
                        f"({quantize}{disk}or more --nnodes)")
    if weights + kv + state > have:
        flag = "--kv-pool-tokens" if kv >= state else "--state-slots"
        raise ArgsError(f"{flag}: weights ({weights / GiB:.1f} GiB), KV pool ({kv / GiB:.1f} GiB) and state "
                        f"slots ({state / GiB:.1f} GiB) need {(weights + kv + state) / GiB:.1f} GiB; {where} "
                        f"{have / GiB:.1f} GiB (lower --kv-pool-tokens, --state-slots or --max-model-len)")
    return plan
