"""Peer daemons as this daemon sees them, and the link state machine of a prefill peer.

Two records, because the two directions differ:

* :class:`Producer` (decode side): a prefill daemon this daemon dials, keyed by its peer
  endpoint; we send it registrations. Its link moves through :data:`LINK_TABLE`.
* :class:`Consumer` (prefill side): a decode daemon that dialled us, keyed by its ZeroMQ
  routing id; we WRITE into its memory. It exists only after its Hello was accepted, so it
  has no handshake states; silence evicts it.

A link is usable only after a Hello in each direction succeeded (layouts compatible; the
consumer's NIXL metadata loaded by the producer, never the other way: push needs only the
destination writable by its producer). A peer not heard from within ``peer_timeout_s`` is lost: what waited on
it fails, and the link re-handshakes at once (RECOVERING) instead of being forgotten, so the
daemon knows the producer is down: a registration for it fails at once (vLLM recomputes)
rather than queueing behind a handshake that the producer, when it answers, may answer
without the prefill it lost meanwhile (its engine gave up on a silent daemon). The moment the
Hello reply comes back the link is READY and registrations flow again.

That knowledge outlives a fence: a decode daemon that fences because a producer went silent
leaves the producers it knew lost to the daemon its supervisor starts next
(:mod:`kvpush.daemon.io.peer_note`), whose first link to one of them starts RECOVERING
(``Producer.lost_before``) instead of HANDSHAKING: a registration made while that producer is
still away fails at once, and the decode engine recomputes while it is away, instead of waiting
behind a first handshake it cannot answer (issue 43). Nothing of such a registration was sent:
nothing of it can be written.

The producer link is sans-IO like the cores: one :class:`kvpush.common.machine.Table` of plain data
maps (state, event) to (new state, actions), total (every pair has a row; rows the shell can
never feed say why); :meth:`Producer.due` turns the clock into events. The decode side
translates frames and the clock into events and drives each link's record with the table
(``machine.drive`` over ``machine.Single(LINK_TABLE, None, producer)``, as every machine of
kvpush is driven); it carries the actions out and decides nothing. The records are the
shell's, not a keyed core's: a link's facts are its connection's (the frames queued behind
its handshake, when it was last heard), and its clock events come from :meth:`Producer.due`.
"""

from __future__ import annotations

import enum
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from kvpush.common.machine import Table, row
from kvpush.proto.layout import KVLayout


class PeerLinkState(enum.StrEnum):
    HANDSHAKING = "handshaking"  # first contact: dialled, our Hello sent; registrations queue
    READY = "ready"  # Hello exchanged: registrations flow
    RECOVERING = "recovering"  # lost (silent, restarted, no answer): Hello re-sent; registrations fail at once


# ------------------------------------------------------------------ events (the shell's words)


@dataclass(frozen=True)
class Forward:
    """A registration for this producer (the counter accepted it)."""


@dataclass(frozen=True)
class HelloOk:
    """Its Hello reply is compatible (nothing of its NIXL agent is loaded: a WRITE target needs none)."""


@dataclass(frozen=True)
class Refused:
    """It refused our Hello (an Error before the link was ready), or its reply is unusable."""


@dataclass(frozen=True)
class HandshakeLost:
    """A ready producer says "send Hello first": it restarted, or evicted us while we were
    silent (frozen); either way it forgot what we registered."""


@dataclass(frozen=True)
class HandshakeTimeout:
    """No Hello reply within peer_timeout_s (a quarter of it while recovering)."""


@dataclass(frozen=True)
class Silent:
    """A ready producer not heard from within peer_timeout_s."""


@dataclass(frozen=True)
class PingDue:
    """A ready producer not pinged for a quarter of peer_timeout_s."""


@dataclass(frozen=True)
class Idle:
    """A recovering link nobody registered for in ``idle_s``: forgotten (the bound)."""


@dataclass(frozen=True)
class Revoked:
    """Its node left the allowlist."""


@dataclass(frozen=True)
class Rotated:
    """This daemon replaced its NIXL agent (new UCX worker, new memory keys) because a node
    that held its metadata was revoked: the producer's copy is dead, it needs our new one."""


EVENTS: tuple[type, ...] = (Forward, HelloOk, Refused, HandshakeLost, HandshakeTimeout, Silent, PingDue, Idle,
                            Revoked, Rotated)


class LinkAction(enum.Enum):
    DIAL = "dial"  # open a connection and send our Hello (a new record)
    QUEUE = "queue"  # keep the registration until the handshake completes
    SEND = "send"  # send the registration now
    FAIL_NOW = "fail_now"  # fail the registration at once: the producer is down or re-handshaking
    FLUSH = "flush"  # send what queued during the handshake
    PING = "ping"  # send a Heartbeat
    FAIL_WAITING = "fail_waiting"  # fail every registration that waits on this producer
    REDIAL = "redial"  # close the connection, open a new one, send our Hello again
    CLOSE = "close"  # disconnect (the record is forgotten)
    ROTATE = "rotate"  # it held our NIXL metadata: replace our agent (every other link gets Rotated)


def lost_before(_core: Any, rec: Producer, _ev: Any) -> bool:
    """Our predecessor (a daemon that fenced) knew this producer lost (``Producer.lost_before``)."""
    return rec.lost_before


def _do(action: LinkAction) -> Any:
    def step(_core: Any, _rec: Any, _ev: Any, out: list[Any]) -> None:
        out.append(action)

    step.__name__ = action.value
    return step


DIAL, QUEUE, SEND, FAIL_NOW, FLUSH, PING, FAIL_WAITING, REDIAL, CLOSE, ROTATE = map(_do, LinkAction)

H, R, RC = PeerLinkState.HANDSHAKING, PeerLinkState.READY, PeerLinkState.RECOVERING
_NO_RECORD = "the shell feeds link events only to a link it holds (frames of a dropped link are ignored)"
_NOT_DUE = "Producer.due never gives this event in this state"
_NOT_READY = "an Error before the first handshake completed is translated as Refused"
_LOST = (FAIL_WAITING, REDIAL)
_GIVE_UP = (FAIL_WAITING, CLOSE)
# Our Hello (NIXL metadata: write access to our engine's region) went out the moment we dialled,
# so a revoked producer in any state holds it: what it can reach dies with our agent.
_REVOKE = (*_GIVE_UP, ROTATE)

LINK_TABLE = Table(PeerLinkState, EVENTS, [
    # Known lost by the daemon before us: dialled, but nothing waits for its answer.
    row(None, Forward, lost_before, RC, DIAL, FAIL_NOW),
    row(None, Forward, None, H, DIAL, QUEUE),
    *(row(None, e, None, None, unreachable=_NO_RECORD) for e in EVENTS if e is not Forward),

    row(H, Forward, None, H, QUEUE),
    row(H, HelloOk, None, R, FLUSH),
    row(H, Refused, None, None, *_GIVE_UP),
    row(H, HandshakeLost, None, None, *_GIVE_UP, unreachable=_NOT_READY),
    # Never answered: known down. What queued fails; later registrations fail at once.
    row(H, HandshakeTimeout, None, RC, *_LOST),
    row(H, Silent, None, H, unreachable=_NOT_DUE),
    row(H, PingDue, None, H, unreachable=_NOT_DUE),
    row(H, Idle, None, H, unreachable=_NOT_DUE),
    row(H, Revoked, None, None, *_REVOKE),
    row(H, Rotated, None, H, REDIAL),  # the Hello it may have loaded is dead: send the new one

    row(R, Forward, None, R, SEND),
    row(R, HelloOk, None, R, FLUSH),  # a repeated reply
    row(R, Refused, None, R),  # an unusable repeated reply: logged, the link stays as it was
    row(R, HandshakeLost, None, RC, *_LOST),
    row(R, HandshakeTimeout, None, R, unreachable=_NOT_DUE),
    row(R, Silent, None, RC, *_LOST),
    row(R, PingDue, None, R, PING),
    row(R, Idle, None, R, unreachable=_NOT_DUE),
    row(R, Revoked, None, None, *_REVOKE),
    # A WRITE it posted to our old agent cannot complete: what waits on it fails (as after a lost
    # handshake: only an announced WRITE may still land); new registrations queue until the new
    # Hello is answered.
    row(R, Rotated, None, H, FAIL_WAITING, REDIAL),

    # Re-handshaking: the producer may have lost its prefills (its engine gives up on a silent
    # daemon), so a registration fails now rather than wait out its timeout there.
    row(RC, Forward, None, RC, FAIL_NOW),
    row(RC, HelloOk, None, R, FLUSH),  # back: registrations flow again from now on
    row(RC, Refused, None, None, *_GIVE_UP),  # back, but refusing us: forget; a new one dials again
    row(RC, HandshakeLost, None, RC),  # a late answer to a frame of the connection we replaced
    row(RC, HandshakeTimeout, None, RC, REDIAL),  # no answer yet: a fresh connection, a fresh Hello
    row(RC, Silent, None, RC, unreachable=_NOT_DUE),
    row(RC, PingDue, None, RC, unreachable=_NOT_DUE),
    row(RC, Idle, None, None, CLOSE),
    row(RC, Revoked, None, None, *_REVOKE),
    row(RC, Rotated, None, RC, REDIAL),
])
"""Every transition of a producer link; ``None`` is "no record" (a new link, a forgotten one)."""


@dataclass
class Producer:
    """Decode side: one prefill daemon's link, keyed by its peer endpoint."""

    endpoint: str
    since: float  # when our current Hello went out
    state: PeerLinkState | None = PeerLinkState.HANDSHAKING  # None: a new link, before its first row
    agent_name: str = ""
    layout: KVLayout | None = None
    rank: int = 0
    tp_size: int = 1
    engine_id: str = ""
    last_seen: float = 0.0
    last_ping: float = 0.0
    wanted: float = 0.0  # when a registration last asked for this producer
    transfers: int = 0
    error: str = ""
    queued: list[Any] = field(default_factory=list)  # messages waiting for the handshake
    node: str = ""  # the authenticated node its server key belongs to; "" with insecure_peers
    lost_before: bool = False  # the daemon before us fenced knowing it lost: its first row recovers

    def due(self, now: float, timeout_s: float, idle_s: float) -> Any:
        """The clock's event for this link now, if any."""
        if self.state is not PeerLinkState.READY:
            # A first handshake gets the whole timeout; a lost producer is asked again every
            # quarter of it, so that one that is back (or allows us again) is ready within that,
            # not a whole timeout later (a Hello it dropped is not answered).
            wait = timeout_s / 4 if self.state is PeerLinkState.RECOVERING else timeout_s
            if now - self.since <= wait:
                return None
            if self.state is PeerLinkState.RECOVERING and now - self.wanted > idle_s:
                return Idle()
            return HandshakeTimeout()
        if now - self.last_seen > timeout_s:
            return Silent()
        if now - self.last_ping > timeout_s / 4:
            return PingDue()
        return None

    def resumed(self, gap: float) -> None:
        """This daemon did not run for ``gap`` seconds (frozen, or its host stalled): that
        time is not the producer's silence. It gets its window back and a ping at once."""
        self.since += gap
        self.last_seen += gap
        self.wanted += gap
        self.last_ping = float("-inf")

    def describe(self, now: float) -> dict[str, Any]:
        return _describe(self, "producer", now, len(self.queued), 0)


#: WRITEs smaller than this say more about latency than about the link: not rate samples.
RATE_MIN_BYTES = 1 << 20
RATE_WEIGHT = 0.3  # of the newest sample in the moving average


@dataclass
class LinkRate:
    """What WRITEs to one peer recently moved per second (a moving average of the large
    ones): layerwise "auto" weighs a stream by the whole WRITE's estimated time. A WRITE that
    shared the link with others of ours measures less than the link: an estimate that errs
    towards streaming, never towards a long whole WRITE."""

    bps: float = 0.0  # 0: not measured yet
    samples: int = 0

    def note(self, nbytes: int, seconds: float) -> None:
        if nbytes < RATE_MIN_BYTES or seconds <= 0:
            return
        rate = nbytes / seconds
        self.bps = rate if not self.samples else (1 - RATE_WEIGHT) * self.bps + RATE_WEIGHT * rate
        self.samples += 1


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
    state: PeerLinkState = PeerLinkState.READY
    error: str = ""
    rate: LinkRate = field(default_factory=LinkRate)

    @property
    def key(self) -> str:
        """The rendezvous core's name for this peer."""
        return self.routing_id.hex()

    def describe(self, now: float) -> dict[str, Any]:
        prepped = self.prepped[0].entries * self.prepped[0].dst_blocks if self.prepped else 0
        return {**_describe(self, "consumer", now, 0, prepped),
                "write_mb_s": round(self.rate.bps / 1e6, 1) if self.rate.samples else None}


@dataclass
class Exposure:
    """Decode side: the nodes our current NIXL agent's metadata went to (every Hello we dialled
    with), for as long as that agent lives, whatever became of their links. A node that refused
    our Hello, or whose link we dropped, still holds what it loaded, so its revocation must
    replace the agent too (issue 44, item 2). Bounded by the allowlist: a node is a certificate
    name (the ``insecure_peers`` "" is not kept: nothing is revoked there)."""

    nodes: set[str] = field(default_factory=set)

    def sent(self, node: str) -> None:
        """Our Hello (our metadata) went to ``node``."""
        if node:
            self.nodes.add(node)

    def revoked(self, allowed: Collection[str]) -> list[str]:
        """The nodes that hold our agent's metadata and are no longer allowed: non-empty, rotate."""
        return sorted(self.nodes.difference(allowed))

    def replaced(self) -> None:
        """Our agent was replaced: nobody holds the new one's metadata until we send it."""
        self.nodes.clear()


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
        "write_mb_s": None,
    }

