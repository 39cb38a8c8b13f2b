"""Server arguments: one frozen struct, validated once, passed to every process."""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass

import msgspec


class ArgsError(ValueError):
    """A bad flag value; the message names the flag."""


def _domains(value: str) -> tuple[str, ...]:
    return tuple(h.strip().lower() for h in value.split(",") if h.strip())


def cache_dir() -> str:
    """tidal's cache directory: ``$XDG_CACHE_HOME/tidal`` (``~/.cache/tidal``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tidal")


# Host-local wiring: fields that may differ between the hosts (and the starts) of one mesh serving one model.
HOST_LOCAL_FIELDS = frozenset({"run_dir", "node_rank", "log_level", "scheduler_addr", "executor_addr",
                               "detokenizer_addr", "frontend_addr", "control_addr", "tap_addr"})


@dataclass(frozen=True)
class ServerArgs:
    model: str | None = None
    revision: str | None = None  # of a Hugging Face repository named by --model
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    device: str = "auto"  # "auto": cuda if available, else cpu
    dtype: str = "auto"
    tp: int = 1
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None  # tcp://host:port of rank 0's process-group store
    hc_prefill_mode: str = "off"  # "off" | "control" | "shard"
    load_format: str = "safetensors"
    # --load-format random: the published layout of random weights (nvfp4, fp8); with a checkpoint: a check.
    quantization: str | None = None
    seed: int = 0
    max_model_len: int | None = None
    max_prefill_length: int | None = 8192
    max_running_requests: int = 32
    max_queued_requests: int = 1024
    default_max_tokens: int = 4096
    max_request_bytes: int = 64 << 20  # larger HTTP request bodies get 413
    # Images (a model with a vision tower): hosts whose http(s) image URLs the frontend fetches (none by
    # default), images per request, pixels of a decoded image.
    allowed_media_domains: tuple[str, ...] = ()
    max_images_per_request: int = 16
    max_image_pixels: int = 1 << 26
    tokenizer_workers: int = 2  # processes that parse, render and tokenize requests for the frontend
    reasoning_parser: str | None = None  # "qwen3": chat answers' text up to </think> -> reasoning_content
    page_size: int = 16
    kv_pool_tokens: int | None = None
    state_slots: int | None = None
    # Prefix caching of hybrid state.
    disable_prefix_cache: bool = False
    checkpoint_align: int = 64
    prefill_coalesce: bool = True
    enable_cache_report: bool = False
    # Expert and PLE residence, layer-major long prefill.
    moe_strategy: str = "resident"  # "resident" | "offload"
    moe_cache_slots: int | None = None
    moe_cache_auto: bool = False
    kv_reserve_tokens: int | None = None
    ple_backend: str = "gpu"  # "gpu" | "pinned" | "disk"
    prefill_layer_major: bool = False
    layer_major_max_tokens: int = 32768
    layer_major_turns: int = 2  # scheduling turns of whole layers, decode steps between; 1: one, run alone
    disable_cuda_graph: bool = False
    disable_prefill_graph: bool = False
    prefill_graph_max_tokens: int = 8192  # the longest prompt chunk a prompt graph takes (sizes up to 8,256)
    disable_overlap_schedule: bool = False
    batch_wait_ms: float = 10.0  # how long a new prompt may wait for requests the frontend is still tokenizing
    # Warm-up before ready (compile kernels, capture decode graphs) and where compiled kernels persist.
    skip_warmup: bool = False
    compile_cache: str | None = None  # None: $XDG_CACHE_HOME/tidal/compile
    compile_workers: int | None = None  # None: as many as cores and memory allow (executor/compile_workers.py)
    # Wiring.
    api_key: str | None = None
    tap_addr: str | None = None
    run_dir: str | None = None
    # ZeroMQ addresses; unset ones become ipc:// paths in the run directory. `executor_addr` may
    # hold "{rank}" (one socket per executor).
    scheduler_addr: str | None = None
    executor_addr: str | None = None
    detokenizer_addr: str | None = None
    frontend_addr: str | None = None
    control_addr: str | None = None
    # Bind this process's own tcp:// sockets on this host (e.g. 0.0.0.0) at their addresses' ports, so
    # that the addresses can name hosts or services (``tidal run --bind-host``); None binds them as given.
    bind_host: str | None = None
    log_level: str = "info"
    # Failure handling and shutdown.
    restart_on_failure: bool = False
    shutdown_timeout: float = 30.0
    executor_timeout: float = 600.0
    # Supervision: a process silent this long counts as gone; the mesh must be ready within ready_timeout.
    heartbeat_timeout: float = 10.0
    ready_timeout: float = 1800.0

    def __post_init__(self) -> None:
        def need(cond: bool, flag: str, msg: str) -> None:
            if not cond:
                raise ArgsError(f"--{flag.replace('_', '-')}: {msg}")

        need(self.tp >= 1, "tp", f"must be >= 1, got {self.tp}")
        need(self.nnodes >= 1 and self.tp % self.nnodes == 0, "nnodes",
             f"must be >= 1 and divide --tp {self.tp}, got {self.nnodes}")
        need(0 <= self.node_rank < self.nnodes, "node_rank", f"must be in [0, {self.nnodes}), got {self.node_rank}")
        need(self.dist_init_addr is None or self.dist_init_addr.startswith("tcp://"), "dist_init_addr",
             f"must be a tcp://host:port address, got {self.dist_init_addr!r}")
        if self.nnodes > 1:
            for name in ("dist_init_addr", "scheduler_addr", "executor_addr", "control_addr"):
                addr = getattr(self, name)
                need(addr is not None and addr.startswith("tcp://"), name,
                     f"with --nnodes {self.nnodes} every host must reach it: give a tcp:// address")
        need(self.hc_prefill_mode in ("off", "control", "shard"), "hc_prefill_mode",
             f"must be off, control or shard, got {self.hc_prefill_mode!r}")
        need(0 < self.port < 65536, "port", f"must be in [1, 65535], got {self.port}")
        need(self.max_images_per_request >= 0, "max_images_per_request",
             f"must be >= 0, got {self.max_images_per_request}")
        need(self.max_image_pixels >= 1, "max_image_pixels", f"must be >= 1, got {self.max_image_pixels}")
        need(self.max_running_requests >= 1, "max_running_requests",
             f"must be >= 1, got {self.max_running_requests}")
        need(self.default_max_tokens >= 0, "default_max_tokens", f"must be >= 0, got {self.default_max_tokens}")
        need(self.max_queued_requests >= 0, "max_queued_requests", f"must be >= 0, got {self.max_queued_requests}")
        need(self.max_request_bytes >= 1024, "max_request_bytes",
             f"must be >= 1024 bytes, got {self.max_request_bytes}")
        need(self.tokenizer_workers >= 1, "tokenizer_workers", f"must be >= 1, got {self.tokenizer_workers}")
        need(self.reasoning_parser in (None, "qwen3"), "reasoning_parser",
             f"must be qwen3 (or unset), got {self.reasoning_parser!r}")
        need(self.compile_workers is None or self.compile_workers >= 0, "compile_workers",
             f"must be >= 0, got {self.compile_workers}")
        need(self.max_prefill_length is None or self.max_prefill_length >= 1, "max_prefill_length",
             f"must be >= 1, got {self.max_prefill_length}")
        need(self.page_size >= 1 and self.page_size & (self.page_size - 1) == 0, "page_size",
             f"must be a power of two, got {self.page_size}")
        need(self.checkpoint_align >= 1 and self.checkpoint_align % self.page_size == 0, "checkpoint_align",
             f"must be a positive multiple of --page-size ({self.page_size}), got {self.checkpoint_align}")
        need(self.kv_pool_tokens is None or self.kv_pool_tokens >= self.page_size, "kv_pool_tokens",
             f"must be >= --page-size ({self.page_size}), got {self.kv_pool_tokens}")
        need(self.state_slots is None or self.state_slots >= 1, "state_slots",
             f"must be >= 1, got {self.state_slots}")
        need(self.max_model_len is None or self.max_model_len >= 2, "max_model_len",
             f"must be >= 2, got {self.max_model_len}")
        need(self.load_format in ("safetensors", "random"), "load_format",
             f"must be 'safetensors' or 'random', got {self.load_format!r}")
        need(self.quantization in (None, "nvfp4", "fp8"), "quantization",
             f"must be nvfp4 or fp8 (or unset: the checkpoint's own format), got {self.quantization!r}")
        need(self.dtype in ("auto", "float32", "bfloat16", "float16"), "dtype",
             f"must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        for name in ("tap_addr", "scheduler_addr", "executor_addr", "detokenizer_addr", "frontend_addr",
                     "control_addr"):
            addr = getattr(self, name)
            need(addr is None or addr.startswith(("ipc://", "tcp://")), name,
                 f"must be an ipc:// or tcp:// address, got {addr!r}")
        need(self.moe_strategy in ("resident", "offload"), "moe_strategy",
             f"must be 'resident' or 'offload', got {self.moe_strategy!r}")
        need(self.moe_cache_slots is None or self.moe_cache_slots >= 1, "moe_cache_slots",
             f"must be >= 1, got {self.moe_cache_slots}")
        need(not (self.moe_cache_slots is not None and self.moe_cache_auto), "moe_cache_auto",
             "give --moe-cache-slots or --moe-cache-auto, not both")
        need(self.moe_strategy == "offload" or (self.moe_cache_slots is None and not self.moe_cache_auto),
             "moe_cache_slots", "an expert cache needs --moe-strategy offload")
        need(self.kv_reserve_tokens is None or self.kv_reserve_tokens >= 0, "kv_reserve_tokens",
             f"must be >= 0, got {self.kv_reserve_tokens}")
        need(self.ple_backend in ("gpu", "pinned", "disk"), "ple_backend",
             f"must be gpu, pinned or disk, got {self.ple_backend!r}")
        need(2 <= self.prefill_graph_max_tokens <= 8256, "prefill_graph_max_tokens",
             f"must be between 2 and 8256, got {self.prefill_graph_max_tokens}")
        need(0 <= self.batch_wait_ms <= 1000, "batch_wait_ms", f"must be between 0 and 1000, got {self.batch_wait_ms}")
        need(self.layer_major_turns >= 1, "layer_major_turns", f"must be >= 1, got {self.layer_major_turns}")
        need(self.layer_major_max_tokens >= 1, "layer_major_max_tokens",
             f"must be >= 1, got {self.layer_major_max_tokens}")
        need(not (self.restart_on_failure and self.nnodes > 1), "restart_on_failure",
             "restarts the processes of one host; with --nnodes > 1 restart every host instead")
        need(self.shutdown_timeout >= 0, "shutdown_timeout", f"must be >= 0 seconds, got {self.shutdown_timeout}")
        need(self.executor_timeout > 0, "executor_timeout", f"must be > 0 seconds, got {self.executor_timeout}")
        need(self.heartbeat_timeout >= 1, "heartbeat_timeout", f"must be >= 1 second, got {self.heartbeat_timeout}")
        need(self.ready_timeout > 0, "ready_timeout", f"must be > 0 seconds, got {self.ready_timeout}")
        need(self.log_level in ("debug", "info", "warning", "error"), "log_level",
             f"must be debug, info, warning or error, got {self.log_level!r}")

    def local_ranks(self) -> list[int]:
        """The TP ranks whose executors run on this host."""
        per = self.tp // self.nnodes
        return list(range(self.node_rank * per, (self.node_rank + 1) * per))

    def executor_addrs(self) -> list[str]:
        template = self.executor_addr or ""
        if self.tp > 1 and "{rank}" not in template:
            raise ArgsError(f"--executor-addr: must contain {{rank}} with --tp {self.tp}, got {template!r}")
        return [template.replace("{rank}", str(rank)) for rank in range(self.tp)]

    def bind_addr(self, addr: str) -> str:
        """``addr`` as this process binds it: ``bind_host`` in place of a ``tcp://`` address's host."""
        if self.bind_host is None or not addr.startswith("tcp://"):
            return addr
        return f"tcp://{self.bind_host}:{addr.rsplit(':', 1)[1]}"

    def replace(self, **changes) -> "ServerArgs":
        return dataclasses.replace(self, **changes)

    def compile_cache_dir(self) -> str:
        return self.compile_cache or os.path.join(cache_dir(), "compile")

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        return os.path.basename(os.path.normpath(self.model)) if self.model else "tidal-demo"

    def to_json(self) -> bytes:
        return msgspec.json.encode(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, data: bytes) -> "ServerArgs":
        return cls(**msgspec.json.decode(data))


def _optional_int(text: str) -> int | None:
    return None if text.lower() in ("none", "0", "off") else int(text)


def add_server_flags(p: argparse.ArgumentParser) -> None:
    d = ServerArgs()
    p.add_argument("--model", default=None,
                   help="checkpoint directory, or a Hugging Face repository id (owner/name) read from the hub cache "
                        "and downloaded there first unless HF_HUB_OFFLINE is set (default: the built-in demo)")
    p.add_argument("--revision", default=None, help="branch, tag or commit of a --model repository id")
    p.add_argument("--served-model-name", default=None,
                   help="the model id in the API (default: the checkpoint directory's name; tidal-demo for the demo)")
    p.add_argument("--host", default=d.host, help="address the HTTP server listens on")
    p.add_argument("--port", type=int, default=d.port, help="HTTP port")
    p.add_argument("--device", default=d.device, help="cuda, cpu, or auto (cuda if available)")
    p.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights, activations and KV dtype; auto: the checkpoint's dtype on a GPU, float32 on the CPU")
    p.add_argument("--tp", type=int, default=d.tp, help="tensor-parallel ranks (one executor process each)")
    p.add_argument("--nnodes", type=int, default=d.nnodes, help="hosts the --tp ranks span (equal shares)")
    p.add_argument("--node-rank", type=int, default=d.node_rank,
                   help="this host's index; host 0 runs the frontend, scheduler and detokenizer, the others only "
                        "their executors")
    p.add_argument("--dist-init-addr", default=None,
                   help="tcp://host:port where the ranks meet (default on one host: a free local port)")
    p.add_argument("--hc-prefill-mode", default=d.hc_prefill_mode, choices=["off", "control", "shard"],
                   help="hyper-connection work under --tp: off (replicated), control (replicated, reductions at "
                        "the decoder-layer boundary, eager), shard (each rank owns rows/TP token rows during an "
                        "eligible prefill)")
    p.add_argument("--load-format", default=d.load_format, choices=["safetensors", "random"],
                   help="safetensors: the checkpoint's weights; random: seeded weights from config.json alone")
    p.add_argument("--quantization", default=None, choices=["nvfp4", "fp8"],
                   help="with --load-format random: random weights in a published quantized layout (nvfp4: ModelOpt "
                        "NVFP4 experts and an FP8 n-gram table; fp8: block FP8 experts and an FP8 n-gram table); "
                        "with a checkpoint: the format its routed experts must have (default: the checkpoint's)")
    p.add_argument("--seed", type=int, default=d.seed,
                   help="seed of --load-format random and of sampling for requests without a seed")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context length in tokens (default: the config's max_position_embeddings)")
    p.add_argument("--max-prefill-length", type=_optional_int, default=d.max_prefill_length,
                   help="prompt tokens per scheduling turn; forwards and internal chunks end on multiples of 64 "
                        "tokens within it (the GDN kernels' block) when it is at least 64; 'none' for no limit")
    p.add_argument("--max-running-requests", type=int, default=d.max_running_requests,
                   help="requests decoding or prefilling at once (each holds a state slot)")
    p.add_argument("--default-max-tokens", type=int, default=d.default_max_tokens,
                   help="output tokens of a chat request that names no max_tokens (0: the rest of the context)")
    p.add_argument("--max-queued-requests", type=int, default=d.max_queued_requests,
                   help="requests that may wait beyond the running ones; more get 503 with Retry-After")
    p.add_argument("--max-request-bytes", type=int, default=d.max_request_bytes,
                   help="largest HTTP request body in bytes (default 64 MiB); a larger one gets 413")
    p.add_argument("--allowed-media-domains", type=_domains, default=d.allowed_media_domains, metavar="HOSTS",
                   help="comma-separated hosts whose http(s) image URLs the frontend fetches for chat requests "
                        "(default: none; data: URLs always work)")
    p.add_argument("--max-images-per-request", type=int, default=d.max_images_per_request,
                   help="the most images one chat request may hold")
    p.add_argument("--max-image-pixels", type=int, default=d.max_image_pixels,
                   help="the most pixels (width x height) of an image a request sends, before resizing")
    p.add_argument("--tokenizer-workers", type=int, default=d.tokenizer_workers,
                   help="processes that parse requests, render chat templates and tokenize prompts, so that a "
                        "long prompt never stalls the frontend's event loop")
    p.add_argument("--reasoning-parser", default=None, choices=["qwen3"],
                   help="qwen3: a chat answer's text up to </think> (after a leading <think>) is returned as "
                        "reasoning_content, the rest as content (default: off, the text as generated)")
    p.add_argument("--page-size", type=int, default=d.page_size, help="tokens per KV page (a power of two)")
    p.add_argument("--kv-pool-tokens", type=int, default=None,
                   help="KV cache capacity in tokens (default: max(--max-model-len, 65536))")
    p.add_argument("--state-slots", type=int, default=None,
                   help="recurrent-state slots (running requests + prefix-cache checkpoints; default: "
                        "--max-running-requests + max(16, --max-running-requests))")
    p.add_argument("--disable-prefix-cache", action="store_true",
                   help="no prefix matching and no state checkpoints")
    p.add_argument("--checkpoint-align", type=int, default=d.checkpoint_align,
                   help="prompt positions where state checkpoints may be written (a multiple of --page-size)")
    p.add_argument("--prefill-coalesce", action=argparse.BooleanOptionalAction, default=d.prefill_coalesce,
                   help="join a prompt's tail to the chunk before a checkpoint and export the checkpoint from inside "
                        "the forward (one forward instead of two); --no-prefill-coalesce ends a forward at each "
                        "checkpoint and runs the tail as its own")
    p.add_argument("--enable-cache-report", action="store_true",
                   help="log one line per request with its prompt, cached and computed token counts")
    p.add_argument("--moe-strategy", default=d.moe_strategy, choices=["resident", "offload"],
                   help="resident: every expert on the device; offload: experts in (pinned) host memory, a device "
                        "expert cache, whole layers streamed for large prefills")
    p.add_argument("--moe-cache-slots", type=int, default=None,
                   help="experts the device cache holds (offload; default: sized as --moe-cache-auto does)")
    p.add_argument("--moe-cache-auto", action="store_true",
                   help="size the expert cache from the device memory left after weights and KV (offload)")
    p.add_argument("--kv-reserve-tokens", type=int, default=None,
                   help="with --moe-cache-auto: KV tokens to keep room for before sizing the expert cache "
                        "(default: none)")
    p.add_argument("--ple-backend", default=d.ple_backend, choices=["gpu", "pinned", "disk"],
                   help="where PLE n-gram tables live: on the device, in pinned host memory, or read on demand "
                        "from the checkpoint files")
    p.add_argument("--prefill-layer-major", action="store_true",
                   help="run an eligible long prefill layer by layer over all its internal chunks, so each layer's "
                        "streamed experts cross to the device once")
    p.add_argument("--layer-major-turns", type=int, default=d.layer_major_turns,
                   help="scheduling turns a layer-major prefill is split into, whole decoder layers each (at most "
                        "one a layer), with the running requests' decode steps between turns; 1: one turn, only "
                        "while nothing else runs")
    p.add_argument("--layer-major-max-tokens", type=int, default=d.layer_major_max_tokens,
                   help="the most new prompt tokens a layer-major prefill takes")
    p.add_argument("--disable-overlap-schedule", action="store_true",
                   help="keep one batch in flight: schedule the next batch only after the executor answers the "
                        "last (default: the next batch is scheduled and sent while the executor runs one)")
    p.add_argument("--batch-wait-ms", type=float, default=d.batch_wait_ms,
                   help="how long a new prompt may wait, while the frontend still tokenizes other requests, so that "
                        "prompts arriving together share one forward (until they fill --max-prefill-length); "
                        "0: schedule each as it arrives")
    p.add_argument("--disable-cuda-graph", action="store_true",
                   help="run every forward eagerly instead of replaying CUDA graphs (graphs are used on a GPU "
                        "with resident experts, --ple-backend gpu or pinned and --tp 1)")
    p.add_argument("--disable-prefill-graph", action="store_true",
                   help="run prompt forwards eagerly, decode steps still from CUDA graphs (by default a prompt "
                        "chunk of up to --prefill-graph-max-tokens alone in its batch replays a graph of its "
                        "padded size)")
    p.add_argument("--prefill-graph-max-tokens", type=int, default=d.prefill_graph_max_tokens,
                   help="the longest prompt chunk a prompt graph takes (2 to 8,256; capped by --max-prefill-length). "
                        "The warm-up captures one graph per padded size up to it, and their shared memory pool holds "
                        "the activations of the largest")
    p.add_argument("--skip-warmup", action="store_true",
                   help="report ready without the warm-up forwards that compile every kernel variant and capture "
                        "every CUDA graph first (they then happen on the first requests that meet them)")
    p.add_argument("--compile-cache", default=None,
                   help="directory of compiled kernels, kept across starts so that a second start warms up fast "
                        "(default: $XDG_CACHE_HOME/tidal/compile)")
    p.add_argument("--compile-workers", type=int, default=d.compile_workers,
                   help="helper processes that compile the warm-up's kernels while the weights load, from an empty "
                        "compile cache (default: up to 4, as the host's cores and the device memory the weights "
                        "leave allow; 0: the executor compiles alone)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: none, no key)")
    p.add_argument("--tap-addr", default=None,
                   help="ZeroMQ address of the tap PUB socket (default: a socket in the run directory)")
    for name in ("scheduler", "executor", "detokenizer", "frontend", "control"):
        extra = " ('{rank}' is replaced by the executor's rank)" if name == "executor" else ""
        who = "the supervisor (tidal serve)" if name == "control" else f"the {name}"
        p.add_argument(f"--{name}-addr", default=None,
                       help=f"ZeroMQ address {who} binds (ipc:// or tcp://; default: a socket in the run "
                            f"directory){extra}")
    p.add_argument("--run-dir", default=None,
                   help="directory of the ipc:// sockets (default: a fresh private one, removed on exit)")
    p.add_argument("--restart-on-failure", action="store_true",
                   help="when a process of the mesh dies or an executor fails for good, fail the requests in "
                        "flight and restart the mesh (default: exit non-zero)")
    p.add_argument("--shutdown-timeout", type=float, default=d.shutdown_timeout,
                   help="seconds SIGTERM waits for requests in flight to finish (new ones get 503) before "
                        "aborting them and exiting")
    p.add_argument("--executor-timeout", type=float, default=d.executor_timeout,
                   help="seconds a batch may run before the executor counts as hung and the mesh as failed")
    p.add_argument("--heartbeat-timeout", type=float, default=d.heartbeat_timeout,
                   help="seconds without a heartbeat after which a process counts as gone and the mesh as failed "
                        "(every process beats once a second)")
    p.add_argument("--ready-timeout", type=float, default=d.ready_timeout,
                   help="seconds the mesh may take to become ready (loading weights, compiling) before it counts "
                        "as failed")
    p.add_argument("--log-level", default=d.log_level, choices=["debug", "info", "warning", "error"],
                   help="log level of every process (one line per finished request at info)")


def args_from_namespace(ns: argparse.Namespace) -> ServerArgs:
    names = {f.name for f in dataclasses.fields(ServerArgs)}
    return ServerArgs(**{k: v for k, v in vars(ns).items() if k in names})
