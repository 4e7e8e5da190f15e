"""In-memory ports for driving a daemon's parts in one process: no sockets, no NIXL.

:class:`MemTransport` has the methods of :class:`kvpush.daemon.io.transport.NixlTransport` the
daemon uses and really moves bytes: a WRITE copies between numpy-backed regions of agents on
one :class:`Fabric`, checks every descriptor lies inside memory the target registered (as
NIXL does), completes on the next ``state()`` poll and then delivers its notification.
:class:`Net` carries messages between daemons' :class:`MemWire` ports through the real
codec (every message is encoded and decoded, so the wire contract is exercised), in order,
when the test calls :meth:`Net.run`. :class:`MemNode` is a
:class:`kvpush.daemon.device_daemon.DeviceDaemon` over these ports: the same composition, the same
tick (session, wire expiry, auth refresh), the same ops view; only the socket loop
(``DeviceDaemon.step``) is replaced by :meth:`Net.run` and :meth:`MemNode.poll`.
"""

from __future__ import annotations

import ctypes
import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvpush import proto
from kvpush.daemon.config import DeviceConfig
from kvpush.daemon.device_daemon import DeviceDaemon, Ports, nixl_turn
from kvpush.daemon.io.transport import TransportError
from kvpush.proto.layout import KVLayout

# ---------------------------------------------------------------------------- memory


@dataclass(eq=False)
class MemRegion:
    """A numpy buffer standing in for a mapped engine region (same attributes)."""

    buf: np.ndarray
    kind: str = "cpu_shm"
    mem_type: str = "DRAM"
    device: int = 0
    closed: bool = False

    @property
    def base(self) -> int:
        return int(self.buf.ctypes.data)

    @property
    def size(self) -> int:
        return int(self.buf.nbytes)

    def close(self) -> None:
        self.closed = True


@dataclass
class _Xfer:
    peer: str
    rows: list[tuple[int, int, int]]  # (src addr, dst addr, length)
    notif: bytes
    state: str = "pending"
    released: bool = False


@dataclass
class Fabric:
    """Agents by name; ``fail_writes`` makes every later WRITE end in "error"; ``hold_writes``
    keeps them pending (a partition: posted, never delivered, never failed)."""

    agents: dict[str, MemTransport] = field(default_factory=dict)
    fail_writes: bool = False
    hold_writes: bool = False


class MemTransport:
    def __init__(self, name: str, backend: str = "UCX", *, fabric: Fabric,
                 backend_params: dict[str, str] | None = None) -> None:
        self.name = name
        self.fabric = fabric
        fabric.agents[name] = self
        self.regions: list[MemRegion] = []
        self._peers: set[str] = set()
        self._inbox: list[tuple[str, bytes]] = []
        self._preps: dict[int, tuple[str, np.ndarray]] = {}
        self._ids = itertools.count()
        self.writes = 0

    def register(self, region: MemRegion) -> None:
        self.regions.append(region)

    def deregister(self, region: MemRegion) -> None:
        self.regions.remove(region)

    def metadata(self) -> bytes:
        return self.name.encode()

    def add_peer(self, metadata: bytes) -> str:
        name = metadata.decode()
        if name not in self.fabric.agents:
            raise TransportError(f"add_peer: unknown agent {name!r}")
        self._peers.add(name)
        return name

    def remove_peer(self, name: str) -> None:
        self._peers.discard(name)

    def _inside(self, agent: str, addr: int, n: int) -> bool:
        return any(r.base <= addr and addr + n <= r.base + r.size for r in self.fabric.agents[agent].regions)

    def write(self, peer: str, local: np.ndarray, remote: np.ndarray, notif: bytes, **_: Any) -> _Xfer:
        if peer not in self._peers:
            raise TransportError(f"write to unknown peer {peer!r}")
        rows = [(int(s), int(d), int(n)) for (s, n), (d, _n) in zip(local.tolist(), remote.tolist(), strict=True)]
        for s, d, n in rows:
            if not self._inside(self.name, s, n) or not self._inside(peer, d, n):
                raise TransportError(f"descriptor ({s:#x}, {d:#x}, {n}) outside registered memory")
        self.writes += 1
        return _Xfer(peer, rows, bytes(notif))

    def prep_local(self, descs: np.ndarray) -> int:
        h = next(self._ids)
        self._preps[h] = (self.name, np.array(descs))
        return h

    def prep_remote(self, peer: str, descs: np.ndarray, **_: Any) -> int:
        h = next(self._ids)
        self._preps[h] = (peer, np.array(descs))
        return h

    def release_prepped(self, handle: int) -> None:
        del self._preps[handle]

    def write_prepped(self, peer: str, local: int, local_idx: np.ndarray, remote: int,
                      remote_idx: np.ndarray, notif: bytes, *, nbytes: int) -> _Xfer:
        (_, ld), (rpeer, rd) = self._preps[local], self._preps[remote]
        if rpeer != peer:
            raise TransportError("prepared list of another peer")
        return self.write(peer, ld[np.asarray(local_idx)], rd[np.asarray(remote_idx)], notif)

    def state(self, h: _Xfer) -> str:
        if h.state == "pending" and not self.fabric.hold_writes:
            if self.fabric.fail_writes:
                h.state = "error"
            else:
                for s, d, n in h.rows:
                    ctypes.memmove(d, s, n)
                h.state = "done"
                target = self.fabric.agents.get(h.peer)
                if target is not None:
                    target._inbox.append((self.name, h.notif))
        return h.state

    def release(self, h: _Xfer) -> None:
        h.released = True

    def notifications(self) -> list[tuple[str, bytes]]:
        out, self._inbox = self._inbox, []
        return out

    def rotate(self, name: str) -> None:
        """As NixlTransport.rotate: the old name is gone from the fabric (peers holding it
        reach nothing), the same regions live on under ``name``."""
        self.close()
        self._peers.clear()
        self.name = name
        self.fabric.agents[name] = self

    def close(self) -> None:
        self.fabric.agents.pop(self.name, None)


# ---------------------------------------------------------------------------- messages


class Net:
    """Queues messages between in-memory daemons; :meth:`run` delivers them in order."""

    def __init__(self) -> None:
        self.nodes: dict[str, MemNode] = {}  # peer endpoint -> node
        self.queue: deque[tuple[str, str, str, bytes]] = deque()  # (kind, to, from, frame)
        self.cut: set[str] = set()  # endpoints whose traffic is dropped (a partition)
        self.closed: set[str] = set()  # producers whose connections closed (their process died)

    def post(self, kind: str, to: str, frm: str, msg: Any) -> None:
        self.queue.append((kind, to, frm, proto.encode(msg)))

    def run(self, *, turns: int = 10_000) -> None:
        """Deliver until quiet, polling every node's NIXL in between (the loops' job)."""
        for _ in range(turns):
            if self.queue:
                kind, to, frm, frame = self.queue.popleft()
                if to in self.cut or frm in self.cut:
                    continue
                msg = proto.decode(frame)
                now = time.monotonic()
                if kind == "to_prefill" and to in self.nodes:
                    self.nodes[to].prefill.on_peer(frm.encode(), msg, now)
                elif kind == "to_decode" and to in self.nodes:
                    node = self.nodes[to]
                    if frm in node.wire.dialled:
                        node.decode.on_producer(frm, msg, now)
                continue
            if not any(n.poll() for n in self.nodes.values()):
                return
        raise RuntimeError("in-memory net did not settle")


class MemWire:
    """The :class:`kvpush.daemon.context.Wire` port over a :class:`Net`."""

    def __init__(self, net: Net, endpoint: str) -> None:
        self.net = net
        self.endpoint = endpoint
        self.engine_out: list[tuple[bytes, Any]] = []
        self.dialled: set[str] = set()

    def to_engine(self, identity: bytes, msg: Any) -> None:
        self.engine_out.append((identity, proto.decode(proto.encode(msg))))

    def to_consumer(self, routing_id: bytes, msg: Any) -> None:
        self.net.post("to_decode", routing_id.decode(), self.endpoint, msg)

    def open_producer(self, endpoint: str) -> str:
        if not endpoint.startswith("mem://"):
            raise ValueError(f"invalid endpoint {endpoint!r}")
        self.dialled.add(endpoint)
        return ""  # the in-memory net is unauthenticated

    def to_producer(self, endpoint: str, msg: Any) -> None:
        if endpoint in self.dialled:
            self.net.post("to_prefill", endpoint, self.endpoint, msg)

    def connection_closed(self, endpoint: str, since: float) -> bool:
        return endpoint in self.net.closed  # Net.closed: producers whose process "died"

    def close_producer(self, endpoint: str) -> None:
        self.dialled.discard(endpoint)

    def expire(self, now: float) -> None:
        """The wire's own timers: no engine connections here, so none."""

    def close(self) -> None:
        self.dialled.clear()


# ---------------------------------------------------------------------------- a daemon


class MemNode(DeviceDaemon):
    """One device's daemon: a :class:`DeviceDaemon` over in-memory ports."""

    wire: MemWire
    transport: MemTransport

    def __init__(self, net: Net, fabric: Fabric, name: str, **cfg: Any) -> None:
        endpoint = f"mem://{name}"
        self.fenced: list[str] = []  # a real daemon would have exited (DaemonContext.fence)
        self.regions: dict[bytes, MemRegion] = {}
        self.transport = MemTransport(f"agent-{name}", fabric=fabric)
        super().__init__(
            DeviceConfig(name=name, index=0, **{"runtime_dir": "/nonexistent", **cfg}, insecure_peers=True),
            Ports(wire=MemWire(net, endpoint), transport=self.transport, peer_endpoint=endpoint,
                  daemon_id=f"id-{name}", agent_name=self.transport.name, open_region=self._open,
                  fence=self.fenced.append),
        )
        net.nodes[endpoint] = self
        self.endpoint = endpoint

    def _open(self, handle: proto.MemoryHandle) -> MemRegion:
        region = self.regions.get(handle.handle)
        if region is None:
            raise ValueError(f"no such memory {handle.handle!r}")
        return region

    def attach(self, layout: KVLayout, buf: np.ndarray | list[np.ndarray], *, role: str, rank: int = 0,
               tp_size: int = 1, engine_id: str = "engine") -> Any:
        """Attach an engine stand-in whose KV is ``buf`` (one buffer per region, or one);
        returns the daemon's answer."""
        handles = []
        for b in buf if isinstance(buf, list) else [buf]:
            key = f"{self.endpoint}/{len(self.regions)}".encode()
            self.regions[key] = MemRegion(b)
            handles.append(proto.MemoryHandle("cpu_shm", key, b.nbytes))
        return self.engine(proto.Attach(engine_id, rank, tp_size, role, tuple(handles), layout))

    def engine(self, msg: Any) -> Any:
        """Send one message as the attached engine; returns the last answer, if any."""
        before = len(self.wire.engine_out)
        self.session.on_engine(b"engine", proto.decode(proto.encode(msg)), time.monotonic())
        out = self.wire.engine_out[before:]
        return out[-1][1] if out else None

    def answers(self) -> list[Any]:
        return [m for _, m in self.wire.engine_out]

    def poll(self) -> bool:
        """One loop turn's NIXL work, exactly as DeviceDaemon.step does it after draining sockets."""
        return nixl_turn(self.prefill, self.decode, time.monotonic())

    def tick(self, now: float | None = None) -> None:
        """The worker's tick (``now`` defaults to the clock)."""
        super().tick(time.monotonic() if now is None else now)
