"""Pool sizes derived from the server arguments and the model: the scheduler and every executor
compute the same numbers from the same inputs, so page and slot ids agree without a handshake."""

from __future__ import annotations

from dataclasses import dataclass

from .model import ModelConfig
from .server_args import ArgsError, ServerArgs


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
