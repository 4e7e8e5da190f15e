"""The plugin's counters and transfer samples, reported through vLLM's KV-connector stats hook.

Each worker rank returns what happened in the last interval from
``KVPushConnector.get_kv_connector_stats`` (only when something happened); vLLM sums the ranks'
objects with :meth:`KVPushStats.aggregate` (KVOutputAggregator), ships ``to_dict()`` to the
logger process, rebuilds it there through ``build_kv_connector_stats``, logs ``reduce()`` once
per logging interval ("KV Transfer metrics: ...") and feeds ``data`` to
:class:`KVPushPromMetrics` (``vllm:kvpush_*`` on the engine's own /metrics), as it does for
NixlConnector.

``data`` holds event counts (summed across ranks and steps) and, under ``load_s``, ``load_bytes``,
``send_s`` and ``send_bytes``, one sample per finished transfer of a rank: its latency (decode:
Register published -> Received; prefill: PrefillDone published -> Sent) and its bytes (the
rank's share of the blocks). Lists concatenate, bounded by ``MAX_SAMPLES``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

__all__ = ["SAMPLE_KEYS", "KVPushPromMetrics", "KVPushStats", "StatsDelta", "TransferSamples"]

SAMPLE_KEYS = ("load_s", "load_bytes", "send_s", "send_bytes")
MAX_SAMPLES = 4096  # per key and interval; beyond, samples are dropped (counts stay exact)


def _pct(vals: list[float], q: float) -> float:
    s = sorted(vals)
    return s[min(len(s) - 1, int(q * len(s)))]


@dataclass
class KVPushStats(KVConnectorStats):
    """``data``: counter name -> count in the interval; SAMPLE_KEYS -> lists of samples."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVPushStats:
        for k, v in other.data.items():
            if isinstance(v, list):
                mine = self.data.setdefault(k, [])
                mine.extend(v[: max(0, MAX_SAMPLES - len(mine))])
            else:
                self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {k: v for k, v in sorted(self.data.items()) if not isinstance(v, list)}
        for side in ("load", "send"):
            secs, nbytes = self.data.get(f"{side}_s") or [], self.data.get(f"{side}_bytes") or []
            if secs:
                out[f"{side}_avg_ms"] = round(1e3 * sum(secs) / len(secs), 3)
                out[f"{side}_p90_ms"] = round(1e3 * _pct(secs, 0.9), 3)
            if nbytes:
                out[f"{side}_MB"] = round(sum(nbytes) / 2**20, 3)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


@dataclass
class TransferSamples:
    """One rank's finished transfers since the last stats call (drained by :meth:`take`)."""

    data: dict[str, list[float]] = field(default_factory=lambda: {k: [] for k in SAMPLE_KEYS})

    def record(self, side: str, seconds: float, nbytes: int) -> None:
        s, b = self.data[f"{side}_s"], self.data[f"{side}_bytes"]
        if len(s) < MAX_SAMPLES:
            s.append(seconds)
            b.append(float(nbytes))

    def take(self) -> dict[str, list[float]]:
        out = {k: v for k, v in self.data.items() if v}
        self.data = {k: [] for k in SAMPLE_KEYS}
        return out


class StatsDelta:
    """Turns cumulative counters into per-interval counts (what vLLM expects per call)."""

    def __init__(self) -> None:
        self._last: dict[str, int] = {}

    def take(self, totals: dict[str, int], samples: dict[str, list[float]] | None = None) -> KVPushStats | None:
        delta: dict[str, Any] = {k: v - self._last.get(k, 0) for k, v in totals.items()}
        self._last = dict(totals)
        delta = {k: v for k, v in delta.items() if v}
        delta.update(samples or {})
        return KVPushStats(data=delta) if delta else None


class KVPushPromMetrics(KVConnectorPromMetrics):
    """``vllm:kvpush_*`` series on the engine's /metrics, next to vLLM's own (per engine label)."""

    LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
    BYTES_BUCKETS = tuple(float(2 ** (10 + i)) for i in range(1, 25, 2))  # 2 KiB .. 8 GiB
    COUNTS = {
        "received": ("vllm:kvpush_loads", "Prompt KV loads completed through kvpush (decode)"),
        "load_failed": ("vllm:kvpush_load_failures", "kvpush loads failed; vLLM recomputed (decode)"),
        "sent": ("vllm:kvpush_sends", "Prompt KV pushes completed (prefill)"),
        "send_failed": ("vllm:kvpush_send_failures", "kvpush pushes that failed (prefill)"),
        "layer_frames": ("vllm:kvpush_layer_frames", "Layer-wise progress frames published (prefill)"),
        "layer_advised_off": ("vllm:kvpush_layer_chunks_not_streamed",
                              "Chunks layerwise auto did not stream: no decode peer's link makes it worth it (prefill)"),
    }

    def __init__(self, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        from vllm.v1.metrics.utils import create_metric_per_engine

        def per_engine(metric: Any) -> dict[int, Any]:
            return create_metric_per_engine(metric, self.per_engine_labelvalues)

        self.counters = {k: per_engine(self._counter_cls(name=n, documentation=d, labelnames=labelnames))
                         for k, (n, d) in self.COUNTS.items()}
        self.hists: dict[str, dict[int, Any]] = {}
        for side, what in (("load", "Register published to Received"), ("send", "PrefillDone published to Sent")):
            self.hists[f"{side}_s"] = per_engine(self._histogram_cls(
                name=f"vllm:kvpush_{side}_seconds", documentation=f"kvpush {what}, seconds",
                buckets=list(self.LATENCY_BUCKETS), labelnames=labelnames))
            self.hists[f"{side}_bytes"] = per_engine(self._histogram_cls(
                name=f"vllm:kvpush_{side}_bytes", documentation=f"kvpush bytes per {side} (one rank)",
                buckets=list(self.BYTES_BUCKETS), labelnames=labelnames))

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for k, per in self.counters.items():
            n = transfer_stats_data.get(k)
            if isinstance(n, int) and n > 0:
                per[engine_idx].inc(n)
        for k, per in self.hists.items():
            for v in transfer_stats_data.get(k) or ():
                per[engine_idx].observe(v)
