"""Peer daemons as this daemon sees them, and the link state machine of a prefill peer.

Two records, because the two directions differ:

* :class:`Producer` (decode side): a prefill daemon this daemon dials, keyed by its peer
  endpoint; we send it registrations. Its link moves through :data:`LINK_TABLE`.
* :class:`Consumer` (prefill side): a decode daemon that dialled us, keyed by its ZeroMQ
  routing id; we WRITE into its memory. It exists only after its Hello was accepted, so it
  has no handshake states; silence evicts it.

A link is usable only after a Hello in each direction succeeded (NIXL metadata loaded,
layouts compatible). A peer not heard from within ``peer_timeout_s`` is dropped: its
transfers fail and it re-handshakes when it comes back.

The producer link is sans-IO like the cores: :func:`link_step` maps (state, event) to
(new state, actions) through one table of plain data; :meth:`Producer.due` turns the clock
into events. The decode side carries the actions out.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from kvpush.proto.layout import KVLayout


class Link(enum.StrEnum):
    HANDSHAKING = "handshaking"  # dialled, our Hello sent, waiting for its reply
    READY = "ready"  # Hello exchanged: registrations flow
    FAILED = "failed"  # unusable: its registrations failed, the record is dropped


class LinkEvent(enum.Enum):
    HELLO_OK = "hello_ok"  # its Hello reply is compatible and its NIXL metadata loaded
    REFUSED = "refused"  # it refused our Hello, or its reply is unusable
    HANDSHAKE_LOST = "handshake_lost"  # a ready peer says "send Hello first": it restarted
    HANDSHAKE_TIMEOUT = "handshake_timeout"  # no reply within peer_timeout_s
    SILENT = "silent"  # a ready peer not heard from within peer_timeout_s
    PING_DUE = "ping_due"  # a ready peer not pinged for a quarter of peer_timeout_s


class LinkAction(enum.Enum):
    FLUSH = "flush"  # send what queued during the handshake
    PING = "ping"  # send a Heartbeat
    FAIL_WAITING = "fail_waiting"  # fail every registration that waits on this producer
    CLOSE = "close"  # disconnect and forget the record


_GIVE_UP = (Link.FAILED, (LinkAction.FAIL_WAITING, LinkAction.CLOSE))

LINK_TABLE: dict[tuple[Link, LinkEvent], tuple[Link, tuple[LinkAction, ...]]] = {
    (Link.HANDSHAKING, LinkEvent.HELLO_OK): (Link.READY, (LinkAction.FLUSH,)),
    (Link.HANDSHAKING, LinkEvent.REFUSED): _GIVE_UP,
    (Link.HANDSHAKING, LinkEvent.HANDSHAKE_TIMEOUT): _GIVE_UP,
    (Link.READY, LinkEvent.HELLO_OK): (Link.READY, (LinkAction.FLUSH,)),  # a repeated reply
    (Link.READY, LinkEvent.HANDSHAKE_LOST): _GIVE_UP,
    (Link.READY, LinkEvent.SILENT): _GIVE_UP,
    (Link.READY, LinkEvent.PING_DUE): (Link.READY, (LinkAction.PING,)),
}
"""Every transition of a producer link. A pair not listed changes nothing (no actions):
e.g. a late Hello reply to a FAILED link, or a refusal after the link was ready (logged)."""


def link_step(state: Link, event: LinkEvent) -> tuple[Link, tuple[LinkAction, ...]]:
    return LINK_TABLE.get((state, event), (state, ()))


@dataclass
class Producer:
    """Decode side: one prefill daemon's link, keyed by its peer endpoint."""

    endpoint: str
    since: float
    state: Link = Link.HANDSHAKING
    agent_name: str = ""
    layout: KVLayout | None = None
    region_bases: tuple[int, ...] = ()
    rank: int = 0
    tp_size: int = 1
    engine_id: str = ""
    last_seen: float = 0.0
    last_ping: float = 0.0
    transfers: int = 0
    error: str = ""
    queued: list[Any] = field(default_factory=list)  # messages waiting for the handshake
    node: str = ""  # the authenticated node its server key belongs to; "" with insecure_peers

    def due(self, now: float, timeout_s: float) -> LinkEvent | None:
        """The clock's event for this link now, if any."""
        if self.state is Link.HANDSHAKING and now - self.since > timeout_s:
            return LinkEvent.HANDSHAKE_TIMEOUT
        if self.state is Link.READY:
            if now - self.last_seen > timeout_s:
                return LinkEvent.SILENT
            if now - self.last_ping > timeout_s / 4:
                return LinkEvent.PING_DUE
        return None

    def describe(self, now: float) -> dict[str, Any]:
        return _describe(self, "producer", now, len(self.queued), 0)


@dataclass
class Consumer:
    """Prefill side: one decode daemon whose Hello we accepted, keyed by its routing id."""

    routing_id: bytes
    endpoint: str
    agent_name: str
    layout: KVLayout
    region_bases: tuple[int, ...]
    rank: int
    tp_size: int
    engine_id: str
    since: float
    last_seen: float
    transfers: int = 0
    prepped: Any = None  # (BlockPattern, local dlist, remote dlist) for index WRITEs
    node: str = ""  # its authenticated identity (certificate name); "" with insecure_peers
    mem_type: str = "DRAM"  # of its regions, as its Hello said (remote descriptors use it)
    device: int = 0
    state: Link = Link.READY
    error: str = ""

    @property
    def key(self) -> str:
        """The rendezvous core's name for this peer."""
        return self.routing_id.hex()

    def describe(self, now: float) -> dict[str, Any]:
        prepped = self.prepped[0].entries * self.prepped[0].dst_blocks if self.prepped else 0
        return _describe(self, "consumer", now, 0, prepped)


def _describe(p: Producer | Consumer, role: str, now: float, queued: int, prepped: int) -> dict[str, Any]:
    return {
        "role": role,
        "endpoint": p.endpoint,
        "state": str(p.state),
        "agent": p.agent_name,
        "node": p.node,
        "engine_id": p.engine_id,
        "rank": p.rank,
        "tp_size": p.tp_size,
        "last_seen_s": round(now - p.last_seen, 3) if p.last_seen else None,
        "transfers": p.transfers,
        "queued": queued,
        "prepped_descriptors": prepped,
        "error": p.error,
    }

