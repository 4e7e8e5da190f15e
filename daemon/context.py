"""What every part of one device's daemon shares: its identity, its ports and its records.

The daemon is a composition (see :mod:`kvpush.daemon.device_daemon`): an engine session, a prefill
side, a decode side and ops, driven by one loop. They do not reach into each other's state;
what they all need lives here, each fact with one owner:

* ``attached`` is written only by the engine session (attach / detach / at exit), read by
  both sides: a read-only property, set through :meth:`DaemonContext.set_attached` by the
  owner that claimed it (:meth:`DaemonContext.own_attached`, once);
* ``draining`` is written only by ops (through its view's ``drain``);
* ``history`` and ``trace`` are append-only records every part stamps.

The ports (:class:`Wire` for the engine's unix socket and the peers' ZeroMQ, the transport for
NIXL) are protocols, so the whole daemon can be driven in a unit test over the in-memory ones
of :mod:`kvpush_dev.inmemory`.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvpush.daemon.config import DeviceConfig
from kvpush.daemon.metrics import DaemonMetrics
from kvpush.proto.layout import KVLayout
from kvpush.proto.trace import TraceRing

log = logging.getLogger(__name__)


class Wire(Protocol):
    """The daemon's sockets as the parts see it (the engine's unix stream socket, the peers'
    ZeroMQ): fire-and-forget sends, never blocking."""

    def to_engine(self, identity: bytes, msg: Any) -> None:
        """Reply on the engine socket to the engine with this routing identity."""

    def to_consumer(self, routing_id: bytes, msg: Any) -> None:
        """Reply on the peer socket to the decode daemon with this routing identity."""

    def open_producer(self, endpoint: str) -> str:
        """Connect to a prefill daemon's peer endpoint; returns the authenticated node it
        reaches ("" when insecure). Raises ValueError if it cannot."""

    def to_producer(self, endpoint: str, msg: Any) -> None:
        """Send to a connected prefill daemon."""

    def close_producer(self, endpoint: str) -> None:
        """Disconnect from a prefill daemon (drops what is unsent)."""

    def connection_closed(self, endpoint: str, since: float) -> bool:
        """Did the prefill daemon's end close our connection (its process died: the kernel
        closed its sockets) at or after ``since`` (CLOCK_MONOTONIC)? A partition closes nothing."""


@dataclass
class Attached:
    """The engine rank this daemon serves, and its mapped KV memory."""

    identity: bytes
    engine_id: str
    rank: int
    tp_size: int
    role: str
    layout: KVLayout
    regions: tuple[Any, ...]  # MappedRegion per layout region, in the layout's order
    since: float
    memory: Any = None  # the MemoryHandles they came from (a repeated Attach is a no-op)

    @property
    def bases(self) -> tuple[int, ...]:
        """This process's address of each region (what plan addresses are relative to)."""
        return tuple(r.base for r in self.regions)

    @property
    def nbytes(self) -> int:
        return sum(r.size for r in self.regions)


@dataclass
class History:
    """Recent finished transfers for `kvpushctl transfers` (bounded)."""

    items: list[dict[str, Any]] = field(default_factory=list)
    cap: int = 256

    def add(self, item: dict[str, Any]) -> None:
        self.items.append(item)
        if len(self.items) > self.cap:
            del self.items[: len(self.items) - self.cap]


FENCE_EXIT_CODE = 75  # the daemon fenced itself (EX_TEMPFAIL): restart it, nothing is broken


def exit_fence(why: str) -> None:
    """Fence a late WRITE off by ending this process: NIXL cannot recall a WRITE a producer
    posted (UCX delivers it when a partition heals), and only a closed NIXL agent (its
    sockets gone with the process) is sure to receive nothing more. The engine hears nothing:
    it sees its daemon gone, fails its loads (vLLM recomputes) and re-attaches to the
    restarted daemon (the supervisor's job). Blocks are never handed back before."""
    log.critical("fencing: %s; this daemon exits (code %d) so that no late WRITE can land in blocks "
                 "its engine reuses; the supervisor restarts it", why, FENCE_EXIT_CODE)
    for h in logging.getLogger().handlers:
        h.flush()
    os._exit(FENCE_EXIT_CODE)


@dataclass(eq=False)
class DaemonContext:
    """Identity, ports and shared records of one device's daemon."""

    cfg: DeviceConfig
    daemon_id: str
    agent_name: str
    peer_endpoint: str  # what decode daemons dial to reach this one
    wire: Wire
    transport: Any  # NixlTransport or an in-memory stand-in with the same methods
    metrics: DaemonMetrics
    trace: TraceRing = field(default_factory=TraceRing)
    history: History = field(default_factory=History)
    auth: Any = None  # PeerAuth (None: insecure_peers, every peer is anonymous)
    draining: bool = False
    errors: int = 0
    started: float = field(default_factory=time.monotonic)
    fence: Callable[[str], None] = exit_fence  # in-memory tests record it instead
    _attached: Attached | None = field(default=None, init=False, repr=False)
    _attached_owner: object = field(default=None, init=False, repr=False)

    @property
    def attached(self) -> Attached | None:
        """The engine rank this daemon serves (None: none attached). Read-only: its owner
        writes it through :meth:`set_attached`."""
        return self._attached

    def own_attached(self, owner: object) -> None:
        """``owner`` (the engine session) becomes the one writer of ``attached``."""
        if self._attached_owner is not None and self._attached_owner is not owner:
            raise RuntimeError("attached already has an owner")
        self._attached_owner = owner

    def set_attached(self, attached: Attached | None, *, by: object) -> None:
        if by is not self._attached_owner or by is None:
            raise RuntimeError(f"only the owner of attached may set it, not {type(by).__name__}")
        self._attached = attached

    @property
    def rank(self) -> int:
        return self.attached.rank if self.attached else 0

    def bad(self, cause: str, detail: str) -> None:
        """Count and log one rejected input (the sender gets its own clear error)."""
        self.errors += 1
        self.metrics.failure(cause)
        log.warning("rejected input (%s): %s", cause, detail)

    def to_engine(self, msg: Any) -> None:
        if self.attached is not None:
            self.wire.to_engine(self.attached.identity, msg)
