"""Prometheus text exposition of the frontend's counters and the scheduler's pool gauges."""

from __future__ import annotations

import bisect

from ..messages import SchedulerStats

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    def __init__(self):
        self.requests = {"stop": 0, "length": 0, "abort": 0, "error": 0}
        self.rejected = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.cached_tokens = 0
        self.ttft_counts = [0] * (len(TTFT_BUCKETS) + 1)
        self.ttft_sum = 0.0
        self.stats = SchedulerStats(running=0, waiting=0, kv_pages_in_use=0, kv_pages_cached=0, kv_pages_total=0,
                                    state_slots_in_use=0, state_slots_cached=0, state_slots_total=0)

    def observe_ttft(self, seconds: float) -> None:
        self.ttft_counts[bisect.bisect_left(TTFT_BUCKETS, seconds)] += 1
        self.ttft_sum += seconds

    def finished(self, reason: str | None, usage) -> None:
        key = reason if reason in self.requests else "error"
        self.requests[key] += 1
        if usage is not None:
            self.prompt_tokens += usage.prompt_tokens
            self.generation_tokens += usage.completion_tokens
            self.cached_tokens += usage.cached_tokens

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
            "# HELP tidal_time_to_first_token_seconds Time from request arrival to the first token.",
            "# TYPE tidal_time_to_first_token_seconds histogram",
        ]
        total = 0
        for bound, count in zip(TTFT_BUCKETS, self.ttft_counts[:-1], strict=True):
            total += count
            lines.append(f'tidal_time_to_first_token_seconds_bucket{{le="{bound}"}} {total}')
        total += self.ttft_counts[-1]
        lines += [f'tidal_time_to_first_token_seconds_bucket{{le="+Inf"}} {total}',
                  f"tidal_time_to_first_token_seconds_sum {self.ttft_sum}",
                  f"tidal_time_to_first_token_seconds_count {total}"]
        gauges = {
            "tidal_requests_running": s.running,
            "tidal_requests_waiting": s.waiting,
            "tidal_kv_pages_in_use": s.kv_pages_in_use,
            "tidal_kv_pages_cached": s.kv_pages_cached,
            "tidal_kv_pages_total": s.kv_pages_total,
            "tidal_state_slots_in_use": s.state_slots_in_use,
            "tidal_state_slots_cached": s.state_slots_cached,
            "tidal_state_slots_total": s.state_slots_total,
        }
        for name, value in gauges.items():
            lines += [f"# TYPE {name} gauge", f"{name} {value}"]
        for name, value in sorted(s.counters.items()):
            lines += [f"# TYPE tidal_scheduler_{name}_total counter", f"tidal_scheduler_{name}_total {value}"]
        helps = {"expert_loads": "Experts copied host-to-device (--moe-strategy offload), by MoE layer.",
                 "expert_bytes": "Bytes of experts copied host-to-device, by MoE layer.",
                 "expert_layer_streams": "Whole layers of experts streamed to the device, by MoE layer."}
        helps.update(tp_all_reduces="All-reduces issued by executor rank 0.",
                     tp_all_gathers="All-gathers issued by executor rank 0.",
                     tp_reduce_scatters="Reduce-scatters issued by executor rank 0.",
                     tp_hc_shard_forwards="Forwards run with hyper-connection row sharding.")
        for name, values in sorted(s.executor_stats.items()):
            lines += [f"# HELP tidal_{name}_total {helps.get(name, name)}", f"# TYPE tidal_{name}_total counter"]
            if name.startswith("expert_"):
                lines += [f'tidal_{name}_total{{layer="{i}"}} {v}' for i, v in enumerate(values)]
            else:
                lines.append(f"tidal_{name}_total {values[0]}")
        return "\n".join(lines) + "\n"
