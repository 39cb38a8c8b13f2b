"""Prometheus text exposition of the frontend's counters and latency histograms and of the
scheduler's pool gauges and counters."""

from __future__ import annotations

import bisect

from ..messages import SchedulerStats

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class Histogram:
    """A Prometheus histogram: cumulative ``le`` buckets, ``_sum`` and ``_count``."""

    def __init__(self, name: str, help_: str, buckets: tuple[float, ...]):
        self.name, self.help, self.buckets = name, help_, buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += times
        self.sum += value * times

    @property
    def count(self) -> int:
        return sum(self.counts)

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        total = 0
        for bound, count in zip(self.buckets, self.counts[:-1], strict=True):
            total += count
            lines.append(f'{self.name}_bucket{{le="{bound}"}} {total}')
        total += self.counts[-1]
        return lines + [f'{self.name}_bucket{{le="+Inf"}} {total}', f"{self.name}_sum {self.sum}",
                        f"{self.name}_count {total}"]


class Metrics:
    def __init__(self):
        self.requests = {"stop": 0, "length": 0, "abort": 0, "error": 0}
        self.rejected = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.cached_tokens = 0
        self.ttft = Histogram("tidal_time_to_first_token_seconds",
                              "Time from request arrival (before parsing and tokenization) to the first token.",
                              TTFT_BUCKETS)
        self.itl = Histogram("tidal_inter_token_latency_seconds",
                             "Time between consecutive output tokens of a request, as the frontend receives them "
                             "(a message of k tokens counts its gap / k, k times).", ITL_BUCKETS)
        self.e2e = Histogram("tidal_e2e_request_latency_seconds",
                             "Time from request arrival to its last token, for requests that finished.", E2E_BUCKETS)
        self.stats = SchedulerStats(running=0, waiting=0, kv_pages_in_use=0, kv_pages_cached=0, kv_pages_total=0,
                                    state_slots_in_use=0, state_slots_cached=0, state_slots_total=0)

    def observe_ttft(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def observe_tokens(self, gap: float, tokens: int) -> None:
        """``tokens`` output tokens that arrived ``gap`` seconds after the request's previous ones."""
        if tokens > 0:
            self.itl.observe(gap / tokens, tokens)

    def finished(self, reason: str | None, usage, seconds: float | None = None) -> None:
        key = reason if reason in self.requests else "error"
        self.requests[key] += 1
        if usage is not None:
            self.prompt_tokens += usage.prompt_tokens
            self.generation_tokens += usage.completion_tokens
            self.cached_tokens += usage.cached_tokens
        if seconds is not None and key != "error":
            self.e2e.observe(seconds)

    def render(self) -> str:
        s = self.stats
        lines = [
            "# HELP tidal_requests_total Requests that ended, by finish reason.",
            "# TYPE tidal_requests_total counter",
            *(f'tidal_requests_total{{finish_reason="{k}"}} {v}' for k, v in self.requests.items()),
            "# HELP tidal_requests_rejected_total Requests rejected before reaching the scheduler.",
            "# TYPE tidal_requests_rejected_total counter",
            f"tidal_requests_rejected_total {self.rejected}",
            "# TYPE tidal_prompt_tokens_total counter",
            f"tidal_prompt_tokens_total {self.prompt_tokens}",
            "# TYPE tidal_generation_tokens_total counter",
            f"tidal_generation_tokens_total {self.generation_tokens}",
            "# TYPE tidal_cached_prompt_tokens_total counter",
            f"tidal_cached_prompt_tokens_total {self.cached_tokens}",
        ]
        lines += self.ttft.render() + self.itl.render() + self.e2e.render()
        counters = s.counters
        gauges = {
            "tidal_requests_running": s.running,
            "tidal_requests_waiting": s.waiting,  # the queue depth
            "tidal_kv_pages_in_use": s.kv_pages_in_use,
            "tidal_kv_pages_cached": s.kv_pages_cached,
            "tidal_kv_pages_total": s.kv_pages_total,
            "tidal_state_slots_in_use": s.state_slots_in_use,
            "tidal_state_slots_cached": s.state_slots_cached,
            "tidal_state_slots_total": s.state_slots_total,
        }
        for name, value in gauges.items():
            lines += [f"# TYPE {name} gauge", f"{name} {value}"]
        # Prefix-cache hit rates since start: of prompt tokens, and of admitted requests.
        prompt = counters.get("prompt_tokens", 0)
        queries = counters.get("cache_queries", 0)
        lines += ["# HELP tidal_prefix_cache_token_hit_rate Prompt tokens served from the prefix cache / prompt "
                  "tokens admitted, since start.", "# TYPE tidal_prefix_cache_token_hit_rate gauge",
                  f"tidal_prefix_cache_token_hit_rate {counters.get('cached_tokens', 0) / prompt if prompt else 0.0}",
                  "# HELP tidal_prefix_cache_request_hit_rate Admitted requests with a prefix-cache hit / cache "
                  "lookups, since start.", "# TYPE tidal_prefix_cache_request_hit_rate gauge",
                  f"tidal_prefix_cache_request_hit_rate {counters.get('cache_hits', 0) / queries if queries else 0.0}"]
        for name, value in sorted(s.counters.items()):
            lines += [f"# TYPE tidal_scheduler_{name}_total counter", f"tidal_scheduler_{name}_total {value}"]
        helps = {"expert_loads": "Experts copied host-to-device (--moe-strategy offload), by MoE layer.",
                 "expert_bytes": "Bytes of experts copied host-to-device, by MoE layer.",
                 "expert_layer_streams": "Whole layers of experts streamed to the device, by MoE layer."}
        helps.update(tp_all_reduces="All-reduces issued by executor rank 0.",
                     tp_all_gathers="All-gathers issued by executor rank 0.",
                     tp_reduce_scatters="Reduce-scatters issued by executor rank 0.",
                     tp_hc_shard_forwards="Forwards run with hyper-connection row sharding.",
                     cuda_graph_replays="Decode steps replayed from CUDA graphs.",
                     prefill_graph_replays="Prompt chunks run from CUDA graphs of their padded size.",
                     compilations_after_ready="Kernel specializations compiled or loaded after ready (the "
                                              "warm-up missed them).",
                     graph_captures_after_ready="Decode and prompt graphs captured after ready (the warm-up missed "
                                                "them).",
                     images_encoded="Images run through the vision tower (each distinct image once while its "
                                    "features stay cached).")
        for name, values in sorted(s.executor_stats.items()):
            lines += [f"# HELP tidal_{name}_total {helps.get(name, name)}", f"# TYPE tidal_{name}_total counter"]
            if name.startswith("expert_"):
                lines += [f'tidal_{name}_total{{layer="{i}"}} {v}' for i, v in enumerate(values)]
            else:
                lines.append(f"tidal_{name}_total {values[0]}")
        return "\n".join(lines) + "\n"
