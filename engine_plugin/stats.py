"""The plugin's counters, reported through vLLM's KV-connector stats hook.

Each worker rank returns the counts of the last interval from
``KVPushConnector.get_kv_connector_stats`` (only when something happened); vLLM sums the ranks'
objects with :meth:`KVPushStats.aggregate` (KVOutputAggregator), ships ``to_dict()`` to the
logger process, rebuilds it there through ``build_kv_connector_stats`` and logs ``reduce()``
once per logging interval. All values are event counts, so aggregation is a plain sum: across
ranks and across the steps of one interval alike.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

__all__ = ["KVPushStats", "StatsDelta"]


@dataclass
class KVPushStats(KVConnectorStats):
    """``data``: counter name -> count in the interval (see LinkCounters, KVPushWorker)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVPushStats:
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return {k: self.data[k] for k in sorted(self.data)}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class StatsDelta:
    """Turns cumulative counters into per-interval counts (what vLLM expects per call)."""

    def __init__(self) -> None:
        self._last: dict[str, int] = {}

    def take(self, totals: dict[str, int]) -> KVPushStats | None:
        delta = {k: v - self._last.get(k, 0) for k, v in totals.items()}
        self._last = dict(totals)
        delta = {k: v for k, v in delta.items() if v}
        return KVPushStats(data=delta) if delta else None
