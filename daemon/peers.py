"""Peer daemons as this daemon sees them.

Two tables, because the two directions differ:

* **producers** (decode side): prefill daemons this daemon connects to, keyed by
  their peer endpoint; we own a DEALER to each and send them registrations.
* **consumers** (prefill side): decode daemons that connected to us, keyed by
  their ZeroMQ routing id; we WRITE into their memory.

A peer is usable only after a Hello in each direction succeeded (NIXL metadata
loaded, layouts compatible). A peer not heard from within ``peer_timeout_s`` is
evicted: its NIXL agent removed, its transfers failed; it re-handshakes when it
comes back. A restarted peer shows up with a new agent name and replaces the old
record.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvpush.proto.layout import KVLayout


@dataclass
class PeerInfo:
    key: str  # consumers: routing id hex; producers: endpoint
    endpoint: str
    state: str = "handshaking"  # handshaking | ready | failed
    agent_name: str = ""
    layout: KVLayout | None = None
    region_base: int = 0
    rank: int = 0
    tp_size: int = 1
    engine_id: str = ""
    routing_id: bytes = b""
    dealer: Any = None  # zmq.Socket for producers
    since: float = 0.0
    last_seen: float = 0.0
    last_ping: float = 0.0
    transfers: int = 0
    error: str = ""
    queued: list[Any] = field(default_factory=list)  # messages waiting for the handshake
    prepped: Any = None  # consumers: (BlockPattern, local dlist, remote dlist) for index WRITEs

    def describe(self, now: float, role: str) -> dict[str, Any]:
        return {
            "role": role,
            "endpoint": self.endpoint,
            "state": self.state,
            "agent": self.agent_name,
            "engine_id": self.engine_id,
            "rank": self.rank,
            "tp_size": self.tp_size,
            "last_seen_s": round(now - self.last_seen, 3) if self.last_seen else None,
            "transfers": self.transfers,
            "queued": len(self.queued),
            "prepped_descriptors": self.prepped[0].entries * self.prepped[0].dst_blocks if self.prepped else 0,
            "error": self.error,
        }
