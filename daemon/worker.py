"""One accelerator's daemon: the loop that wires sockets, NIXL and the pure cores.

Everything here is plumbing: decisions (when to WRITE, when a transfer is
complete or failed, which bytes go where) are made by the pure cores
(:mod:`rendezvous`, :mod:`counter`, :mod:`planner`); this module turns wire
messages into their events and their actions into wire messages and WRITEs.

One thread. The loop blocks on ZeroMQ while idle (no NIXL progress thread, no
busy polling) and polls NIXL with a short adaptive interval only while WRITEs
are in flight or notifications are expected.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from kvpush import proto
from kvpush.daemon import counter as ctr
from kvpush.daemon import rendezvous as rv
from kvpush.daemon.config import DeviceConfig
from kvpush.daemon.endpoints import Endpoints, load_curve
from kvpush.daemon.metrics import WorkerMetrics
from kvpush.daemon.peers import PeerInfo
from kvpush.daemon.planner import PlanError, block_pattern, expected_producers, plan
from kvpush.proto.layout import KVLayout
from kvpush.proto.notif import Notification
from kvpush.proto.trace import HOP_SET, TraceRing

log = logging.getLogger("kvpush.worker")

RECV_POLL_MAX_S = 0.0005  # poll cap while a producer said Writing and its notification is missing
RECV_FALLBACK_S = 0.01  # poll cap while receiving otherwise (no WRITE announced yet)
HINT_WINDOW_S = 0.02  # how long a completed WRITE keeps the tight poll if its notification never shows


@dataclass
class Attached:
    """The engine rank this daemon serves, and its mapped KV memory."""

    identity: bytes
    engine_id: str
    rank: int
    tp_size: int
    role: str
    layout: KVLayout
    region: Any  # MappedRegion
    since: float
    memory: Any = None  # the MemoryHandle it came from (a repeated Attach is a no-op)


@dataclass
class Receiving:
    """Decode side: one registered attempt and the producers it waits for."""

    attempt: int
    producer_ranks: list[int]
    endpoints: list[str]
    num_tokens: int
    blocks: int
    since: float
    forwards: list[Any] = field(default_factory=list)  # PeerRegister per producer


@dataclass
class InFlight:
    transfer_id: str
    attempt: int
    dest_rank: int
    peer: str
    handle: Any
    nbytes: int
    descriptors: int
    started: float
    prepped: bool = False  # posted from prepared descriptor lists (by index)


@dataclass
class History:
    """Recent finished transfers for `kvpushctl transfers` (bounded)."""

    items: list[dict[str, Any]] = field(default_factory=list)
    cap: int = 256

    def add(self, item: dict[str, Any]) -> None:
        self.items.append(item)
        if len(self.items) > self.cap:
            del self.items[: len(self.items) - self.cap]


def check_blocks(
    layout: KVLayout, block_ids: tuple[int, ...], num_tokens: int, what: str, first_token: int = 0
) -> str:
    """Empty string if the block list can hold tokens [first_token, num_tokens), else why not."""
    if num_tokens <= 0:
        return f"{what}: num_tokens must be positive"
    if first_token % layout.block_size or first_token >= num_tokens:
        return f"{what}: first_token {first_token} must be a block boundary below num_tokens {num_tokens}"
    need = -(-(num_tokens - first_token) // layout.block_size)
    if len(block_ids) < need:
        return f"{what}: {len(block_ids)} blocks cannot hold {num_tokens} tokens at block size {layout.block_size}"
    if block_ids and max(block_ids) >= layout.num_blocks:
        return f"{what}: block ID {max(block_ids)} out of range [0, {layout.num_blocks})"
    return ""


class Worker:
    """State and handlers of one per-accelerator daemon."""

    def __init__(self, cfg: DeviceConfig, *, transport_factory: Any = None) -> None:
        self.cfg = cfg
        self.daemon_id = uuid.uuid4().hex[:12]
        self.agent_name = f"kvpush-{socket.gethostname()}-{cfg.name}-{self.daemon_id}"
        self.metrics = WorkerMetrics(cfg.name)
        self.ctx = zmq.Context()
        curve = None
        if cfg.curve_secret_key_file:
            curve = load_curve(cfg.curve_secret_key_file, cfg.authorized_keys_dir or "")
        peer_port = cfg.peer_port if cfg.peer_port is not None else 0
        self.ep = Endpoints(
            self.ctx,
            engine=cfg.engine_socket,
            peer=f"tcp://{cfg.peer_host}:{peer_port}",
            ops=cfg.ops_socket,
            socket_mode=cfg.socket_mode,
            curve=curve,
        )
        adv = cfg.advertise_host or cfg.peer_host
        self.peer_endpoint = f"tcp://{adv}:{self.ep.peer_ep.rsplit(':', 1)[1]}"
        if transport_factory is None:
            from kvpush.daemon.transport import NixlTransport

            transport_factory = NixlTransport
        params = {"ucx_error_handling_mode": cfg.ucx_error_handling_mode} if cfg.backend == "UCX" else {}
        self.transport = transport_factory(self.agent_name, cfg.backend, backend_params=params)
        self.rdv = rv.Rendezvous()
        self.counter = ctr.CompletionCounter()
        self.attached: Attached | None = None
        self.consumers: dict[bytes, PeerInfo] = {}  # routing id -> decode daemon
        self.producers: dict[str, PeerInfo] = {}  # endpoint -> prefill daemon
        self.receiving: dict[str, Receiving] = {}
        self.in_flight: dict[int, InFlight] = {}
        self.history = History()
        self.trace = TraceRing()  # per-transfer timeline (kvpushctl trace), always on, bounded
        self._local_prep: dict[tuple[bytes, bytes], Any] = {}  # pattern -> prepared local dlist
        self.started = time.monotonic()
        self.stopping = False
        self.draining = False
        self.poll_s = cfg.poll_min_s
        self.hinted: dict[str, float] = {}  # decode side: transfer -> poll tightly until (monotonic)
        self.last_tick = 0.0
        self.errors = 0
        self.poller = zmq.Poller()
        for s in (self.ep.engine, self.ep.peer, self.ep.ops):
            self.poller.register(s, zmq.POLLIN)

    # ------------------------------------------------------------------ loop

    def busy(self) -> bool:
        return bool(self.in_flight or self.receiving or any(p.state == "handshaking" for p in self.producers.values()))

    def run(self, ready: Any = None) -> int:
        log.info(
            "daemon %s up: engine %s, peer %s, ops %s, NIXL agent %s",
            self.cfg.name, self.cfg.engine_socket, self.peer_endpoint, self.cfg.ops_socket, self.agent_name,
        )
        if ready is not None:
            ready.set()
        while not self.stopping:
            try:
                self.step()
            except Exception:  # a bug in one handler must not take the node's transfers down
                log.exception("daemon loop error; continuing")
                self.metrics.failure("internal")
                time.sleep(0.01)
        self.shutdown()
        return 0

    def step(self) -> None:
        timeout_ms = int(self.poll_s * 1000) if self.busy() else 250
        events = dict(self.poller.poll(max(timeout_ms, 0) or 0))
        activity = False
        if self.ep.engine in events:
            activity |= self._drain(self.ep.engine, self.on_engine)
        if self.ep.peer in events:
            activity |= self._drain(self.ep.peer, self.on_peer)
        if self.ep.ops in events:
            self._drain(self.ep.ops, self.on_ops)
        for sock in [s for s in events if s not in (self.ep.engine, self.ep.peer, self.ep.ops)]:
            activity |= self._drain_dealer(sock)
        now = time.monotonic()
        if self.in_flight or self.receiving:
            activity |= self.progress(now)
        if now - self.last_tick >= 0.05:
            self.last_tick = now
            self.tick(now)
        # A notification waits in NIXL until we poll. Producers say Writing over ZeroMQ when
        # they post a WRITE (poll tightly until its notification shows) and when it completed
        # (wakes this loop at once); with no WRITE announced, poll only as a slow fallback.
        if self.hinted:
            for tid in [t for t, until in self.hinted.items() if now > until or t not in self.receiving]:
                del self.hinted[tid]
        if not self.receiving:
            cap = self.cfg.poll_max_s
        elif self.hinted:
            cap = min(self.cfg.poll_max_s, RECV_POLL_MAX_S)
        else:
            cap = min(self.cfg.poll_max_s, RECV_FALLBACK_S)
        self.poll_s = self.cfg.poll_min_s if activity else min(self.poll_s * 2, cap)

    def _drain(self, sock: zmq.Socket, handler: Any) -> bool:
        got = False
        for _ in range(1000):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            got = True
            if len(frames) != 2:
                self._bad("frames", f"{len(frames)} frames")
                continue
            ident, payload = frames
            try:
                msg = proto.decode(payload)
            except proto.ProtocolError as exc:
                self._bad("protocol", str(exc))
                self._reply(sock, ident, proto.Error("protocol", str(exc)))
                continue
            try:
                handler(ident, msg)
            except Exception as exc:  # never let one message kill the daemon
                log.exception("handling %s failed", type(msg).__name__)
                self._bad("internal", f"{type(exc).__name__}: {exc}")
                self._reply(sock, ident, proto.Error("internal", f"{type(exc).__name__}: {exc}"))
        return got

    def _drain_dealer(self, sock: zmq.Socket) -> bool:
        peer = next((p for p in self.producers.values() if p.dealer is sock), None)
        got = False
        for _ in range(1000):
            try:
                payload = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            got = True
            if peer is None:
                continue
            try:
                msg = proto.decode(payload)
            except proto.ProtocolError as exc:
                self._bad("protocol", f"from producer {peer.endpoint}: {exc}")
                continue
            peer.last_seen = time.monotonic()
            self.on_producer(peer, msg)
            if peer.dealer is not sock:  # the handler dropped this producer (and closed it)
                break
        return got

    def _bad(self, cause: str, detail: str) -> None:
        self.errors += 1
        self.metrics.failure(cause)
        log.warning("rejected input (%s): %s", cause, detail)

    def _reply(self, sock: zmq.Socket, ident: bytes, msg: Any) -> None:
        try:
            sock.send_multipart([ident, proto.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("reply dropped: %s", exc)

    def to_engine(self, msg: Any) -> None:
        if self.attached is not None:
            self._reply(self.ep.engine, self.attached.identity, msg)

    # ------------------------------------------------------------------ engine

    def on_engine(self, ident: bytes, msg: Any) -> None:
        now = time.monotonic()
        if isinstance(msg, proto.Heartbeat):
            self._reply(self.ep.engine, ident, proto.HeartbeatAck(msg.seq, self.daemon_id))
            return
        if isinstance(msg, proto.Attach):
            self.on_attach(ident, msg, now)
            return
        if self.attached is None or ident != self.attached.identity:
            self._bad("not_attached", f"{type(msg).__name__} before Attach")
            self._reply(self.ep.engine, ident, proto.Error("not_attached", "send Attach first"))
            return
        if isinstance(msg, proto.TraceReport):
            self.on_trace_report(msg)
        elif isinstance(msg, proto.Register):
            self.on_register(msg, now)
        elif isinstance(msg, proto.PrefillDone):
            self.on_prefill_done(msg, now)
        elif isinstance(msg, proto.Abort):
            self.on_abort(msg, now)
        else:
            self._bad("unexpected", f"{type(msg).__name__} on the engine endpoint")
            self._reply(self.ep.engine, ident, proto.Error("unexpected", f"{type(msg).__name__} not accepted here"))

    def on_attach(self, ident: bytes, msg: proto.Attach, now: float) -> None:
        from kvpush.daemon.memory import RegionError, open_region

        a = self.attached
        if a is not None and a.memory == msg.memory and a.layout == msg.layout and a.engine_id == msg.engine_id:
            # The same engine memory again (a reconnect): keep the mapping, just follow the identity.
            a.identity = ident
            self._reply(self.ep.engine, ident, proto.AttachAck(self.agent_name, self.daemon_id))
            return
        try:
            region = open_region(msg.memory)
        except (RegionError, OSError, RuntimeError, ValueError) as exc:
            self._bad("attach", str(exc))
            self._reply(self.ep.engine, ident, proto.Error("attach", f"cannot map engine memory: {exc}"))
            return
        if msg.layout.region_size > region.size:
            region.close()
            self._bad("attach", "layout larger than memory")
            self._reply(
                self.ep.engine, ident,
                proto.Error("attach", f"layout needs {msg.layout.region_size} bytes, memory has {region.size}"),
            )
            return
        self._detach("engine re-attached")
        self.transport.register(region)
        self.attached = Attached(
            ident, msg.engine_id, msg.rank, msg.tp_size, msg.role, msg.layout, region, now, msg.memory
        )
        for c in self.consumers.values():
            self._prep_consumer(c)
        log.info(
            "engine %s rank %d/%d (%s) attached: %d bytes, %d blocks x %d tokens",
            msg.engine_id, msg.rank, msg.tp_size, msg.role, region.size, msg.layout.num_blocks, msg.layout.block_size,
        )
        self._reply(self.ep.engine, ident, proto.AttachAck(self.agent_name, self.daemon_id))

    def _detach(self, why: str) -> None:
        """Fail everything tied to the old attachment, then unmap it."""
        old = self.attached
        if old is None:
            return
        self.fail_all(why)
        self._wait_in_flight(self.cfg.write_timeout_s)
        # Producers must learn our new memory: drop them so the next Register re-handshakes.
        for p in list(self.producers.values()):
            self._drop_producer(p, why)
        self._release_preps()
        self.transport.deregister(old.region)
        old.region.close()
        self.attached = None

    def on_trace_report(self, msg: proto.TraceReport) -> None:
        """The engine plugin's stamps of one transfer: kept beside ours for `kvpushctl trace`."""
        if len(msg.hops) != len(msg.times_ns) or not HOP_SET.issuperset(msg.hops):
            self._bad("trace", f"malformed TraceReport for {msg.transfer_id!r}")
            return
        self.trace.extend(msg.transfer_id, list(zip(msg.hops, msg.times_ns, strict=True)))

    def on_register(self, msg: proto.Register, now: float) -> None:
        """Decode side: remember what we expect, forward the registration to the producers."""
        a = self.attached
        assert a is not None
        self.trace.stamp(msg.transfer_id, "d.daemon.register_in")

        def refuse(why: str) -> None:
            self._bad("register", why)
            self.to_engine(proto.ReceiveFailed(msg.transfer_id, msg.attempt, why))

        if self.draining:
            return refuse("daemon is draining")
        why = check_blocks(a.layout, msg.block_ids, msg.num_tokens, "register", msg.first_token)
        if why:
            return refuse(why)
        if msg.prefill_tp_size <= 0 or len(msg.prefill_endpoints) != msg.prefill_tp_size:
            return refuse(f"{len(msg.prefill_endpoints)} prefill endpoints for prefill TP {msg.prefill_tp_size}")
        total = a.layout.model_heads
        if total % msg.prefill_tp_size and msg.prefill_tp_size <= total:
            return refuse(f"{total} KV heads do not split over prefill TP {msg.prefill_tp_size}")
        p_heads = max(1, total // msg.prefill_tp_size)
        ranks = expected_producers(a.layout, msg.prefill_tp_size, p_heads)
        prev = self.receiving.get(msg.transfer_id)
        if prev is not None and prev.attempt > msg.attempt:
            return refuse(f"attempt {msg.attempt} is older than attempt {prev.attempt}")
        if prev is not None and prev.attempt == msg.attempt:
            return  # duplicate registration
        d_heads = a.layout.num_heads
        forwards = []
        for r in ranks:
            lo, hi = r * p_heads, (r + 1) * p_heads
            dests = sum(
                1 for d in range(a.tp_size) if max(lo, d * d_heads) < min(hi, (d + 1) * d_heads)
            )
            forwards.append(proto.PeerRegister(
                msg.transfer_id, msg.attempt, msg.block_ids, msg.num_tokens, a.rank, a.tp_size, dests, msg.timeout_ms,
                msg.first_token,
            ))
        self.receiving[msg.transfer_id] = Receiving(
            msg.attempt, ranks, [msg.prefill_endpoints[r] for r in ranks], msg.num_tokens, len(msg.block_ids),
            now, forwards,
        )
        # The counter answers Accepted, which forwards the registrations (apply_counter).
        self.apply_counter(ctr.Expect(msg.transfer_id, msg.attempt, len(ranks), now, now + msg.timeout_ms / 1000.0))

    def on_prefill_done(self, msg: proto.PrefillDone, now: float) -> None:
        a = self.attached
        assert a is not None
        why = "daemon is draining" if self.draining else check_blocks(a.layout, msg.block_ids, msg.num_tokens, "prefill")
        if why:
            self._bad("prefill", why)
            self.to_engine(proto.SendFailed(msg.transfer_id, 0, why))
            return
        self.trace.stamp(msg.transfer_id, "p.daemon.prefill_done_in")
        self.apply_rdv(rv.PrefillDone(msg.transfer_id, msg.block_ids, msg.num_tokens, now, now + msg.lease_ms / 1000.0))

    def on_abort(self, msg: proto.Abort, now: float) -> None:
        known = False
        if msg.transfer_id in self.receiving:
            known = True
            self.apply_counter(ctr.Abort(msg.transfer_id, msg.attempt, msg.reason, now))
        if self._rdv_live(msg.transfer_id):
            known = True
            self.apply_rdv(rv.Abort(msg.transfer_id, None, msg.reason, "local", now))
        if not known:
            # Nothing to wait for: the blocks are already safe to reuse.
            self.to_engine(proto.Released(msg.transfer_id, msg.attempt))

    # ------------------------------------------------------------------ peers: prefill side

    def on_peer(self, ident: bytes, msg: Any) -> None:
        now = time.monotonic()
        if isinstance(msg, proto.Hello):
            self.on_hello(ident, msg, now)
            return
        peer = self.consumers.get(ident)
        if peer is None or peer.state != "ready":
            self._bad("unauthenticated", f"{type(msg).__name__} from a peer without handshake")
            self._reply(self.ep.peer, ident, proto.Error("handshake", "send Hello first"))
            return
        peer.last_seen = now
        if isinstance(msg, proto.Heartbeat):
            self._reply(self.ep.peer, ident, proto.HeartbeatAck(msg.seq, self.daemon_id))
        elif isinstance(msg, proto.PeerRegister):
            self.on_peer_register(peer, msg, now)
        elif isinstance(msg, proto.Cancel):
            self.apply_rdv(rv.Abort(msg.transfer_id, msg.attempt, msg.reason, "peer", now, peer.key))
        else:
            self._bad("unexpected", f"{type(msg).__name__} on the peer endpoint")
            self._reply(self.ep.peer, ident, proto.Error("unexpected", f"{type(msg).__name__} not accepted here"))

    def hello(self, reply: bool) -> proto.Hello:
        a = self.attached
        assert a is not None
        return proto.Hello(
            self.agent_name, self.transport.metadata(), a.layout, a.region.base, proto.PROTOCOL_VERSION,
            a.layout.compat_key(), a.engine_id, a.rank, a.tp_size, self.peer_endpoint, reply,
        )

    def compat_error(self, msg: proto.Hello) -> str:
        a = self.attached
        if a is None:
            return "this daemon has no engine attached yet"
        if msg.version != proto.PROTOCOL_VERSION:
            return f"protocol version {msg.version} (this side speaks {proto.PROTOCOL_VERSION})"
        mine, theirs = a.layout, msg.layout
        for name in ("model", "dtype", "head_size", "num_layers", "model_heads"):
            if getattr(mine, name) != getattr(theirs, name):
                return f"incompatible KV: {name} is {getattr(theirs, name)!r} there, {getattr(mine, name)!r} here"
        if msg.compat != theirs.compat_key():
            return "compatibility hash does not match the layout sent"
        if theirs.compat_key() != mine.compat_key():
            return "incompatible KV packing (K/V tiling) between the two sides"
        return ""

    def on_hello(self, ident: bytes, msg: proto.Hello, now: float) -> None:
        """Prefill side: a decode daemon introduces itself (first contact or after a restart)."""
        why = self.compat_error(msg)
        if why:
            self._bad("handshake", why)
            self._reply(self.ep.peer, ident, proto.Error("incompatible", why))
            return
        # The same endpoint under a new identity is a restarted peer: evict the old one.
        for old in [p for p in self.consumers.values() if p.endpoint == msg.endpoint and p.routing_id != ident]:
            self._evict_consumer(old, "peer restarted", now)
        old = self.consumers.get(ident)
        if old is not None and old.agent_name != msg.agent_name:
            self._evict_consumer(old, "peer re-handshook", now)
        elif old is not None:
            self._unprep(old)  # its memory may have moved: prepared again below
        try:
            name = self.transport.add_peer(msg.agent_metadata)
        except Exception as exc:
            self._bad("handshake", str(exc))
            self._reply(self.ep.peer, ident, proto.Error("handshake", str(exc)))
            return
        self.consumers[ident] = PeerInfo(
            key=ident.hex(), endpoint=msg.endpoint, state="ready", agent_name=name, layout=msg.layout,
            region_base=msg.region_base, rank=msg.rank, tp_size=msg.tp_size, engine_id=msg.engine_id,
            routing_id=ident, since=now, last_seen=now,
        )
        log.info("decode peer %s (%s rank %d) handshaken", msg.endpoint, msg.engine_id, msg.rank)
        self._reply(self.ep.peer, ident, self.hello(reply=True))
        self._prep_consumer(self.consumers[ident])  # after the reply: off the peer's critical path

    def _prep_consumer(self, peer: PeerInfo) -> None:
        """Prepare NIXL descriptor lists for WRITEs to this consumer, once per (region, peer):
        a WRITE is then two index arrays (no descriptors built per transfer). Layouts whose
        plans are not block-periodic (different block sizes) keep the per-transfer path."""
        me = self.attached
        if me is None or peer.layout is None or peer.prepped is not None:
            return
        pattern = block_pattern(me.layout, peer.layout, self.cfg.max_prepped_descriptors)
        if pattern is None:
            return
        key = (pattern.src_off.tobytes(), pattern.length.tobytes())
        try:
            local = self._local_prep.get(key)
            if local is None:
                descs = pattern.src_list()
                descs[:, 0] += me.region.base
                local = self._local_prep[key] = self.transport.prep_local(descs)
            descs = pattern.dst_list()
            descs[:, 0] += peer.region_base
            peer.prepped = (pattern, local, self.transport.prep_remote(peer.agent_name, descs))
        except Exception as exc:  # the per-transfer path still works
            log.warning("cannot prepare descriptor lists for %s (%s); WRITEs build their own", peer.endpoint, exc)

    def _release_preps(self) -> None:
        for c in self.consumers.values():
            self._unprep(c)
        for h in self._local_prep.values():
            try:
                self.transport.release_prepped(h)
            except Exception as exc:
                log.warning("release of a prepared local list: %s", exc)
        self._local_prep.clear()

    def _unprep(self, peer: PeerInfo) -> None:
        if peer.prepped is not None:
            try:
                self.transport.release_prepped(peer.prepped[2])
            except Exception as exc:
                log.warning("release of %s's prepared list: %s", peer.endpoint, exc)
            peer.prepped = None

    def on_peer_register(self, peer: PeerInfo, msg: proto.PeerRegister, now: float) -> None:
        assert peer.layout is not None
        why = ""
        if self.draining:
            why = "producer is draining"
        elif msg.dest_rank != peer.rank or msg.dest_tp_size != peer.tp_size:
            why = f"registration for rank {msg.dest_rank}/{msg.dest_tp_size} from peer rank {peer.rank}/{peer.tp_size}"
        elif msg.expected_dests == 0:
            why = "expected_dests must be positive"
        else:
            why = check_blocks(peer.layout, msg.block_ids, msg.num_tokens, "peer register", msg.first_token)
        if why:
            self._bad("register", why)
            self._reply(self.ep.peer, peer.routing_id, proto.WriteFailedNotice(msg.transfer_id, msg.attempt, self._rank(), why))
            return
        peer.transfers += 1
        self.trace.stamp(msg.transfer_id, "p.daemon.register_in")
        # The decode side gives up at its deadline even with a WRITE in flight, so the last
        # WRITE must start early enough to finish (or time out) before then.
        margin = self.cfg.write_timeout_s + 1.0
        self.apply_rdv(rv.Register(
            msg.transfer_id, msg.attempt, peer.key, msg.dest_rank, msg.expected_dests, msg.block_ids,
            msg.num_tokens, now, now + max(0.0, msg.deadline_ms / 1000.0 - margin), msg.first_token,
        ))

    def _rank(self) -> int:
        return self.attached.rank if self.attached else 0

    def _consumer_by_key(self, key: str) -> PeerInfo | None:
        try:
            return self.consumers.get(bytes.fromhex(key))
        except ValueError:
            return None

    def _evict_consumer(self, peer: PeerInfo, why: str, now: float) -> None:
        self.consumers.pop(peer.routing_id, None)
        self._unprep(peer)
        log.warning("decode peer %s evicted: %s", peer.endpoint, why)
        self.metrics.failure("peer_lost")
        self.apply_rdv(rv.PeerLost(peer.key, now))
        # Keep the NIXL agent until its in-flight WRITEs finished (they fail or complete).
        if not any(f.peer == peer.key for f in self.in_flight.values()):
            try:
                self.transport.remove_peer(peer.agent_name)
            except Exception as exc:
                log.warning("remove_peer %s: %s", peer.agent_name, exc)

    # ------------------------------------------------------------------ peers: decode side

    def send_producer(self, endpoint: str, msg: Any) -> None:
        peer = self.producers.get(endpoint)
        if peer is None:
            now = time.monotonic()
            peer = PeerInfo(key=endpoint, endpoint=endpoint, since=now, last_seen=now)
            try:
                peer.dealer = self.ep.dealer(endpoint)
            except (zmq.ZMQError, ValueError) as exc:
                peer.state, peer.error = "failed", str(exc)
                self._producer_failed(peer, f"cannot connect to {endpoint}: {exc}")
                return
            self.poller.register(peer.dealer, zmq.POLLIN)
            self.producers[endpoint] = peer
            peer.dealer.send(proto.encode(self.hello(reply=False)), zmq.NOBLOCK)
        if peer.state == "ready":
            self._send_dealer(peer, msg)
        else:
            peer.queued.append(msg)

    def _send_dealer(self, peer: PeerInfo, msg: Any) -> None:
        try:
            peer.dealer.send(proto.encode(msg), zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("send to %s dropped: %s", peer.endpoint, exc)

    def on_producer(self, peer: PeerInfo, msg: Any) -> None:
        now = time.monotonic()
        if isinstance(msg, proto.Hello):
            if not msg.reply:
                return
            why = self.compat_error(msg)
            if why:
                self._producer_failed(peer, f"prefill daemon {peer.endpoint}: {why}")
                return
            try:
                peer.agent_name = self.transport.add_peer(msg.agent_metadata)
            except Exception as exc:
                self._producer_failed(peer, f"prefill daemon {peer.endpoint}: {exc}")
                return
            peer.state, peer.layout, peer.rank, peer.tp_size = "ready", msg.layout, msg.rank, msg.tp_size
            peer.engine_id, peer.region_base = msg.engine_id, msg.region_base
            log.info("prefill peer %s (%s rank %d) handshaken", peer.endpoint, msg.engine_id, msg.rank)
            queued, peer.queued = peer.queued, []
            for m in queued:
                self._send_dealer(peer, m)
        elif isinstance(msg, proto.Error):
            if peer.state != "ready":
                self._producer_failed(peer, f"prefill daemon {peer.endpoint} refused: {msg.message}")
            elif msg.code == "handshake":
                # A new daemon on the same endpoint (restarted): it knows nothing of us or of
                # what we registered. Fail those transfers now; the next one re-handshakes.
                self._producer_failed(peer, f"prefill daemon {peer.endpoint} restarted (handshake lost)")
            else:
                log.warning("prefill daemon %s: %s: %s", peer.endpoint, msg.code, msg.message)
        elif isinstance(msg, proto.HeartbeatAck):
            pass
        elif isinstance(msg, proto.Writing):
            if msg.transfer_id in self.receiving:
                if msg.done:
                    self._take_notifications(now)
                if msg.transfer_id in self.receiving:  # in flight, or the notification trails
                    window = HINT_WINDOW_S if msg.done else self.cfg.write_timeout_s
                    self.hinted[msg.transfer_id] = max(self.hinted.get(msg.transfer_id, 0.0), now + window)
                    self.poll_s = self.cfg.poll_min_s
        elif isinstance(msg, proto.WriteFailedNotice):
            self._producer_event(msg.transfer_id, msg.attempt, peer, msg.producer_rank, msg.reason, now, failed=True)
        elif isinstance(msg, proto.CancelConfirmed):
            self._producer_event(msg.transfer_id, msg.attempt, peer, msg.producer_rank, "", now, failed=False)

    def _producer_event(
        self, tid: str, attempt: int, peer: PeerInfo, rank: int, reason: str, now: float, *, failed: bool
    ) -> None:
        rec = self.receiving.get(tid)
        if rec is None or peer.endpoint not in rec.endpoints:
            return  # also answers for superseded attempts resolve through the same endpoints
        idx = rec.endpoints.index(peer.endpoint)
        if failed:
            self.apply_counter(ctr.ProducerFailed(tid, attempt, idx, reason, now))
        else:
            self.apply_counter(ctr.CancelConfirmed(tid, attempt, idx, now))

    def _producer_failed(self, peer: PeerInfo, why: str) -> None:
        """A prefill daemon is unusable: fail every registration that waits on it."""
        log.warning("%s", why)
        now = time.monotonic()
        for tid, rec in list(self.receiving.items()):
            if peer.endpoint in rec.endpoints:
                idx = rec.endpoints.index(peer.endpoint)
                self.apply_counter(ctr.ProducerFailed(tid, rec.attempt, idx, why, now))
        self._drop_producer(peer, why)

    def _drop_producer(self, peer: PeerInfo, why: str) -> None:
        if self.producers.get(peer.endpoint) is peer:
            del self.producers[peer.endpoint]
        if peer.dealer is not None:
            try:
                self.poller.unregister(peer.dealer)
            except KeyError:
                pass
            peer.dealer.close(0)
            peer.dealer = None
        peer.queued.clear()

    # ------------------------------------------------------------------ NIXL

    def progress(self, now: float) -> bool:
        activity = False
        for key, f in list(self.in_flight.items()):
            state = self.transport.state(f.handle)
            if state == "pending":
                if now - f.started > self.cfg.write_timeout_s:
                    self.metrics.timeout("write")
                    self._finish_write(key, f, now, f"WRITE timed out after {self.cfg.write_timeout_s:.1f}s")
                    activity = True
                continue
            activity = True
            self._finish_write(key, f, now, "" if state == "done" else "NIXL reported a transfer error")
        if self.receiving:
            activity |= self._take_notifications(now)
        return activity

    def _take_notifications(self, now: float) -> bool:
        """Count every notification NIXL holds (drives its progress); True if there was one."""
        got = False
        for agent, payload in self.transport.notifications():
            got = True
            self.on_notification(agent, payload, now)
        return got

    def _finish_write(self, key: int, f: InFlight, now: float, error: str) -> None:
        try:
            self.transport.release(f.handle)
        except Exception as exc:
            if not error:
                error = str(exc)
            else:  # cannot cancel: NIXL may still read the source blocks; keep waiting
                log.error("WRITE %s could not be cancelled (%s); holding its blocks", f.transfer_id, exc)
                return
        del self.in_flight[key]
        self.metrics.set_in_flight(len(self.in_flight))
        lat = now - f.started
        self.history.add({
            "transfer_id": f.transfer_id, "attempt": f.attempt, "dest_rank": f.dest_rank, "side": "prefill",
            "bytes": f.nbytes, "descriptors": f.descriptors, "prepped": f.prepped, "latency_ms": round(lat * 1e3, 3),
            "result": "ok" if not error else "failed", "error": error, "age_s": 0.0, "at": now,
        })
        if error:
            self.metrics.failure("nixl")
            self.apply_rdv(rv.WriteFailed(f.transfer_id, f.attempt, f.dest_rank, error, now))
        else:
            self.trace.stamp(f.transfer_id, "p.daemon.write_done")
            peer = self._consumer_by_key(f.peer)
            if peer is not None:  # wake the decode daemon: its notification has landed
                self._reply(self.ep.peer, peer.routing_id, proto.Writing(f.transfer_id, f.attempt, self._rank(), True))
            self.metrics.write_done(f.nbytes, lat)
            self.apply_rdv(rv.WriteDone(f.transfer_id, f.attempt, f.dest_rank, now))

    def on_notification(self, agent: str, payload: bytes, now: float) -> None:
        parsed = Notification.decode(payload)
        if parsed is None:
            self._bad("notification", f"malformed notification from {agent}")
            return
        tid, attempt, rank = parsed.transfer_id, parsed.attempt, parsed.producer_rank
        rec = self.receiving.get(tid)
        if rec is None or rec.attempt != attempt or rank not in rec.producer_ranks:
            return  # stale attempt or unknown transfer: ignored by design
        idx = rec.producer_ranks.index(rank)
        prod = self.producers.get(rec.endpoints[idx])
        if prod is None or prod.agent_name != agent:
            self._bad("notification", f"notification for {tid} from unexpected agent {agent}")
            return
        self.metrics.notification()
        self.trace.stamp(tid, "d.daemon.notif_seen")
        self.apply_counter(ctr.Notified(tid, attempt, idx, now))

    def start_write(self, a: rv.StartWrite, now: float) -> None:
        me = self.attached
        peer = self._consumer_by_key(a.peer)
        err = ""
        if me is None:
            err = "no engine attached"
        elif peer is None or peer.layout is None:
            err = "decode peer is gone"
        if not err:
            assert me is not None and peer is not None and peer.layout is not None
            notif = Notification(a.transfer_id, a.attempt, me.rank).encode()
            try:
                if peer.prepped is not None:
                    pattern, local_h, remote_h = peer.prepped
                    sb, db = pattern.block_pairs(me.layout, a.src_block_ids, a.dst_block_ids, a.num_tokens,
                                                 a.dst_first_token)
                    li, ri = pattern.indices(sb, db)
                    nbytes, ndesc = int(pattern.length.sum()) * int(sb.shape[0]), int(li.shape[0])
                    self.trace.stamp(a.transfer_id, "p.daemon.planned")
                    h = self.transport.write_prepped(peer.agent_name, local_h, li, remote_h, ri, notif,
                                                     nbytes=nbytes)
                else:
                    p = plan(me.layout, a.src_block_ids, peer.layout, a.dst_block_ids, a.num_tokens,
                             dst_first_token=a.dst_first_token)
                    nbytes, ndesc = p.nbytes, len(p)
                    local = np.stack((p.src_off + me.region.base, p.length), axis=1)
                    remote = np.stack((p.dst_off + peer.region_base, p.length), axis=1)
                    self.trace.stamp(a.transfer_id, "p.daemon.planned")
                    h = self.transport.write(peer.agent_name, local, remote, notif)
                self.trace.stamp(a.transfer_id, "p.daemon.write_posted")
            except PlanError as exc:
                err = f"plan: {exc}"
                self.metrics.failure("plan")
            except Exception as exc:
                err = f"NIXL: {exc}"
                self.metrics.failure("nixl")
            else:
                # The consumer polls NIXL tightly while this is in flight (with UCX error
                # handling "peer" the WRITE completes only as the receiver progresses).
                self._reply(self.ep.peer, peer.routing_id, proto.Writing(a.transfer_id, a.attempt, me.rank, False))
                self.in_flight[id(h)] = InFlight(
                    a.transfer_id, a.attempt, a.dest_rank, a.peer, h, nbytes, ndesc, now, peer.prepped is not None
                )
                self.metrics.set_in_flight(len(self.in_flight))
                return
        self.apply_rdv(rv.WriteFailed(a.transfer_id, a.attempt, a.dest_rank, err, now))

    # ------------------------------------------------------------------ core actions

    def apply_rdv(self, event: Any) -> None:
        pending = [event]
        while pending:
            ev = pending.pop(0)
            for act in self.rdv.handle(ev):
                now = time.monotonic()
                if isinstance(act, rv.StartWrite):
                    self.start_write(act, now)
                elif isinstance(act, rv.ReleaseBlocks):
                    # The prefill engine keys its held blocks by transfer ID alone.
                    msg: Any = (
                        proto.Sent(act.transfer_id, 0)
                        if act.ok
                        else proto.SendFailed(act.transfer_id, 0, act.reason)
                    )
                    self.metrics.transfer_finished("prefill", "ok" if act.ok else "failed")
                    # Stamped before it leaves: the timeline stays causal across processes.
                    self.trace.stamp(act.transfer_id, "p.daemon.sent" if act.ok else "p.daemon.send_failed")
                    self.to_engine(msg)
                elif isinstance(act, rv.NotifyFailure):
                    peer = self._consumer_by_key(act.peer)
                    if peer is not None:
                        self._reply(self.ep.peer, peer.routing_id,
                                    proto.WriteFailedNotice(act.transfer_id, act.attempt, self._rank(), act.reason))
                elif isinstance(act, rv.ConfirmCancel):
                    peer = self._consumer_by_key(act.peer)
                    if peer is not None:
                        self._reply(self.ep.peer, peer.routing_id,
                                    proto.CancelConfirmed(act.transfer_id, act.attempt, self._rank()))

    def apply_counter(self, event: Any) -> None:
        for act in self.counter.handle(event):
            tid = act.transfer_id
            rec = self.receiving.get(tid)
            if isinstance(act, ctr.Accepted):
                if rec is not None and rec.attempt == act.attempt:
                    self.trace.stamp(tid, "d.daemon.register_forwarded")
                    for ep, fwd in zip(rec.endpoints, rec.forwards, strict=True):
                        self.send_producer(ep, fwd)
            elif isinstance(act, ctr.Complete):
                self.metrics.transfer_finished("decode", "ok")
                self.trace.stamp(tid, "d.daemon.received_sent")
                self.to_engine(proto.Received(tid, act.attempt))
                self._hist_recv(tid, act.attempt, "ok", "")
            elif isinstance(act, ctr.Fail):
                self.metrics.transfer_finished("decode", "failed")
                if "timed out" in act.reason:
                    self.metrics.timeout("deadline")
                self.trace.stamp(tid, "d.daemon.receive_failed")
                self.to_engine(proto.ReceiveFailed(tid, act.attempt, act.reason))
                self._hist_recv(tid, act.attempt, "failed", act.reason)
            elif isinstance(act, ctr.Release):
                self.to_engine(proto.Released(tid, act.attempt))
            elif isinstance(act, ctr.SendCancel):
                if rec is not None and rec.attempt == act.attempt:
                    for ep in rec.endpoints:
                        peer = self.producers.get(ep)
                        if peer is not None and peer.state == "ready":
                            self._send_dealer(peer, proto.Cancel(tid, act.attempt, act.reason))
            if rec is not None and rec.attempt == act.attempt and self.receiving.get(tid) is rec:
                info = self.counter.info(tid, act.attempt)
                if info is None or info.state in ("completed", "failed", "released"):
                    del self.receiving[tid]

    def _hist_recv(self, tid: str, attempt: int, result: str, error: str) -> None:
        rec = self.receiving.get(tid)
        now = time.monotonic()
        self.history.add({
            "transfer_id": tid, "attempt": attempt, "side": "decode", "result": result, "error": error,
            "latency_ms": round((now - rec.since) * 1e3, 3) if rec else None, "at": now,
            "producers": len(rec.producer_ranks) if rec else None,
        })

    # ------------------------------------------------------------------ time

    def tick(self, now: float) -> None:
        self.apply_rdv(rv.Tick(now))
        self.apply_counter(ctr.Tick(now))
        timeout = self.cfg.peer_timeout_s
        for p in list(self.producers.values()):
            if p.state == "handshaking" and now - p.since > timeout:
                self.metrics.timeout("peer")
                self._producer_failed(p, f"prefill daemon {p.endpoint} did not answer the handshake in {timeout:.1f}s")
            elif p.state == "ready":
                if now - p.last_seen > timeout:
                    self.metrics.timeout("peer")
                    self._producer_failed(p, f"prefill daemon {p.endpoint} silent for {timeout:.1f}s")
                elif now - p.last_ping > timeout / 4:
                    p.last_ping = now
                    self._send_dealer(p, proto.Heartbeat(int(now * 1000)))
        for c in list(self.consumers.values()):
            if now - c.last_seen > timeout:
                self.metrics.timeout("peer")
                self._evict_consumer(c, f"silent for {timeout:.1f}s", now)
        for s, n in self.rdv.counts().items():
            self.metrics.set_pending("prefill", s, n)
        for s, n in self.counter.counts().items():
            self.metrics.set_pending("decode", s, n)
        self.metrics.set_peers("ready", sum(p.state == "ready" for p in [*self.producers.values(), *self.consumers.values()]))
        self.metrics.set_peers("handshaking", sum(p.state == "handshaking" for p in self.producers.values()))

    # ------------------------------------------------------------------ ops

    def on_ops(self, ident: bytes, msg: Any) -> None:
        from kvpush.daemon.ops import handle_ops

        if not isinstance(msg, proto.OpsRequest):
            self._reply(self.ep.ops, ident, proto.OpsReply(False, {}, f"expected OpsRequest, got {type(msg).__name__}"))
            return
        self._reply(self.ep.ops, ident, handle_ops(self, msg))

    # ------------------------------------------------------------------ shutdown

    def _rdv_live(self, tid: str) -> bool:
        info = self.rdv.info(tid)
        return info is not None and info.state not in ("done", "failed", "expired")

    def cancel(self, tid: str, why: str, now: float) -> bool:
        """Operator cancel: fail the transfer on whichever side holds it."""
        found = False
        if self._rdv_live(tid):
            found = True
            self.apply_rdv(rv.Abort(tid, None, why, "local", now))
        rec = self.receiving.get(tid)
        if rec is not None:
            found = True
            for idx in range(len(rec.producer_ranks)):
                self.apply_counter(ctr.ProducerFailed(tid, rec.attempt, idx, why, now))
        return found

    def fail_all(self, why: str) -> None:
        now = time.monotonic()
        for info in self.rdv.pending(now):
            self.apply_rdv(rv.Abort(info.transfer_id, None, why, "local", now))
        for tid, rec in list(self.receiving.items()):
            for idx in range(len(rec.producer_ranks)):
                self.apply_counter(ctr.ProducerFailed(tid, rec.attempt, idx, why, now))

    def _wait_in_flight(self, limit_s: float) -> None:
        end = time.monotonic() + limit_s
        while self.in_flight and time.monotonic() < end:
            self.progress(time.monotonic())
            time.sleep(0.001)

    def shutdown(self) -> None:
        log.info("daemon %s stopping", self.cfg.name)
        self.fail_all("daemon shutting down")
        self._wait_in_flight(min(self.cfg.write_timeout_s, 5.0))
        for p in list(self.producers.values()):
            self._drop_producer(p, "shutdown")
        self._release_preps()
        try:
            self.transport.close()
        except Exception as exc:
            log.warning("NIXL close: %s", exc)
        if self.attached is not None:
            self.attached.region.close()
            self.attached = None
        self.ep.close()
        self.ctx.term()


def run_worker(cfg: DeviceConfig, ready_event: Any = None) -> int:
    """Entry point of one accelerator's daemon (a supervisor child or `kvpushd worker`)."""
    logging.basicConfig(
        level=getattr(logging, str(cfg.log_level).upper(), logging.INFO),
        format=f"%(asctime)s kvpushd[{cfg.name}:{os.getpid()}] %(levelname)s %(name)s: %(message)s",
    )
    import faulthandler

    # `kill -USR1 <pid>` dumps every thread's stack to stderr: what is this daemon doing?
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    w = Worker(cfg)

    def stop(signum: int, _frame: Any) -> None:
        w.stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    return w.run(ready_event)
