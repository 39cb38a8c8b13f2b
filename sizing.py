"""Pool sizes derived from the server arguments and the model: the scheduler and every executor
compute the same numbers from the same inputs, so page and slot ids agree without a handshake."""

from __future__ import annotations

from dataclasses import dataclass

from .args import ArgsError, ServerArgs
from .config import ModelConfig


@dataclass(frozen=True)
class PoolSizes:
    max_model_len: int
    page_size: int
    num_pages: int
    num_slots: int
    # Slots reserved for running requests; the rest hold prefix-cache checkpoints.
    request_slots: int

    @property
    def checkpoint_slots(self) -> int:
        return self.num_slots - self.request_slots


def pool_sizes(args: ServerArgs, config: ModelConfig) -> PoolSizes:
    max_model_len = args.max_model_len or config.max_position_embeddings
    kv_tokens = args.kv_pool_tokens or max(max_model_len, 65536)
    num_pages = kv_tokens // args.page_size
    pages_per_request = -(-max_model_len // args.page_size)
    if args.max_model_len is not None and num_pages < pages_per_request:
        raise ArgsError(
            f"--kv-pool-tokens: {kv_tokens} cannot hold one request of --max-model-len {max_model_len}"
        )
    request_slots = args.max_running_requests
    if args.state_slots is not None:
        num_slots = args.state_slots
        if num_slots < request_slots:
            raise ArgsError(
                f"--state-slots: {num_slots} is fewer than --max-running-requests ({request_slots})"
            )
    else:
        num_slots = request_slots + (0 if args.disable_prefix_cache else max(16, request_slots))
    return PoolSizes(max_model_len, args.page_size, num_pages, num_slots, request_slots)


GiB = 1 << 30


def memory_plan(args: ServerArgs, config: ModelConfig, device: str) -> dict[str, int]:
    """Bytes each executor rank allocates for weights on the device, weights in host memory, the KV
    pool and the state slots (the module tree and pools built on the meta device: nothing allocated)."""
    import torch

    from .executor.loader import host_resident, resolve_dtype
    from .executor.memory.kv_cache import KVPool
    from .executor.memory.state_slots import StatePool
    from .executor.models.qwen4_exp import Qwen4ExpForCausalLM

    sizes = pool_sizes(args, config)
    dtype = resolve_dtype(args.dtype, config, device)
    width = torch.empty((), dtype=dtype).element_size()
    with torch.device("meta"):
        model = Qwen4ExpForCausalLM(config)
    on_device = on_host = 0
    for name, param in model.named_parameters():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if args.ple_backend == "disk" and name.endswith("ngram_embedding.weight"):
            continue
        if host_resident(name, args.moe_strategy, args.ple_backend):
            on_host += param.numel() * width
        else:
            on_device += param.numel() * width
    kv = KVPool(config, 1, sizes.page_size, "meta", dtype).bytes_per_token() * sizes.num_pages * sizes.page_size
    state = StatePool(config, 1, "meta", dtype).bytes_per_slot() * sizes.num_slots
    # Under --tp the weights and KV heads split across the ranks (roughly evenly); state slots too.
    return {"weights_device": on_device // args.tp, "weights_host": on_host // args.tp,
            "kv": kv // args.tp, "state": state // args.tp}


def host_memory_total() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_fits(args: ServerArgs, config: ModelConfig, device: str) -> None:
    """Raise ``ArgsError`` naming the flag when the pools cannot hold one request, or when one host's
    ranks need more memory than the device has (on the CPU: more than the host's total memory).
    Host-resident weights of a GPU rank are not checked: some hosts grow their memory on demand."""
    cuda = device.startswith("cuda")
    if cuda:
        import torch

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
            return
    plan = memory_plan(args, config, device)
    weights = (plan["weights_device"] + (0 if cuda else plan["weights_host"])) * ranks
    kv, state = plan["kv"] * ranks, plan["state"] * ranks
    if weights > have:
        raise ArgsError(f"--dtype: the weights alone need {weights / GiB:.1f} GiB in "
                        f"{args.dtype if args.dtype != 'auto' else 'the default dtype'}; {where} {have / GiB:.1f} GiB "
                        f"(a smaller --dtype, more --tp ranks, or --moe-strategy offload)")
    if weights + kv + state > have:
        flag = "--kv-pool-tokens" if kv >= state else "--state-slots"
        raise ArgsError(f"{flag}: weights ({weights / GiB:.1f} GiB), KV pool ({kv / GiB:.1f} GiB) and state "
                        f"slots ({state / GiB:.1f} GiB) need {(weights + kv + state) / GiB:.1f} GiB; {where} "
                        f"{have / GiB:.1f} GiB (lower --kv-pool-tokens, --state-slots or --max-model-len)")
