"""What a load point did to the engines' and daemons' Prometheus metrics: deltas of two scrapes.

Histograms give count/sum/mean and Prometheus-style interpolated p50/p99 over the interval
(all label sets summed); counters give per-series deltas, keyed as the exposition prints
them. Scrapes are :class:`kvpush_dev.prom.Snapshot` s.
"""

from __future__ import annotations

import math
from typing import Any

from kvpush_dev.prom import Snapshot

# Prometheus families worth keeping per point (deltas over the load).
ENGINE_HISTOGRAMS = ("vllm:inter_token_latency_seconds", "vllm:request_time_per_output_token_seconds",
                     "vllm:time_to_first_token_seconds", "vllm:request_queue_time_seconds",
                     "vllm:request_prefill_time_seconds", "vllm:nixl_xfer_time_seconds")
ENGINE_COUNTERS = ("vllm:prompt_tokens_by_source_total", "vllm:nixl_num_failed_transfers",
                   "vllm:nixl_num_failed_notifications", "vllm:nixl_num_kv_expired_reqs",
                   "vllm:num_preemptions_total")
DAEMON_HISTOGRAMS = ("kvpush_write_latency_seconds",)
DAEMON_COUNTERS = ("kvpush_transfers_total", "kvpush_failures_total", "kvpush_timeouts_total",
                   "kvpush_written_bytes_total")


def _le(raw: str | None) -> float | None:
    if raw is None:
        return None
    try:
        return float(raw)  # "+Inf" -> inf
    except ValueError:
        return None


def histogram_delta(before: Snapshot, after: Snapshot, family: str) -> dict[str, Any] | None:
    """count/sum/mean and interpolated p50/p99 of a histogram family over an interval (all label sets summed)."""
    def total(suffix: str) -> float:
        return sum(v - before.get(k, 0.0) for k, v in after.items() if k.name == family + suffix)

    count, ssum = total("_count"), total("_sum")
    if count <= 0:
        return None
    buckets: dict[float, float] = {}
    for k, v in after.items():
        if k.name == family + "_bucket" and (le := _le(k.label("le"))) is not None:
            buckets[le] = buckets.get(le, 0.0) + v - before.get(k, 0.0)
    edges = sorted(buckets.items())
    return {"count": count, "sum": ssum, "mean": ssum / count,
            "p50": hist_quantile(edges, 0.5), "p99": hist_quantile(edges, 0.99)}


def hist_quantile(edges: list[tuple[float, float]], q: float) -> float | None:
    """Prometheus-style: linear inside the bucket that holds the q-th observation (cumulative buckets)."""
    if not edges or edges[-1][1] <= 0:
        return None
    rank = q * edges[-1][1]
    lo_edge, lo_cnt = 0.0, 0.0
    for le, cnt in edges:
        if cnt >= rank:
            if le == math.inf:
                return lo_edge
            span = cnt - lo_cnt
            return lo_edge + (le - lo_edge) * ((rank - lo_cnt) / span if span > 0 else 0.0)
        lo_edge, lo_cnt = le, cnt
    return lo_edge


def counter_deltas(before: Snapshot, after: Snapshot, families: tuple[str, ...]) -> dict[str, float]:
    """Series (as printed) -> increase over the interval, for samples named in ``families``; zero deltas left out."""
    return {k.render(): v - before.get(k, 0.0) for k, v in after.items()
            if k.name in families and v - before.get(k, 0.0) != 0}


def metric_summary(before: Snapshot, after: Snapshot, hists: tuple[str, ...],
                   counters: tuple[str, ...]) -> dict[str, Any]:
    """The histograms that saw observations, plus ``counters``: what the sweep stores per role."""
    out: dict[str, Any] = {h: d for h in hists if (d := histogram_delta(before, after, h)) is not None}
    out["counters"] = counter_deltas(before, after, counters)
    return out
