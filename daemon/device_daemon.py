"""One accelerator's daemon: the composition root and the loop that drives its parts.

The parts (each its own module, each unit-tested through the in-memory ports of
:mod:`kvpush_dev.inmemory`):

* :class:`EngineSession` — the local engine rank: Attach, Register, PrefillDone, Abort;
* :class:`PrefillSide` — decode peers that dial us, the rendezvous core, our WRITEs;
* :class:`DecodeSide` — links to prefill daemons, the completion counter, notifications;
* :mod:`kvpush.daemon.ops.views` — ``kvpushctl``'s view and commands.

They share a :class:`DaemonContext` (identity, ports, records). :class:`DeviceDaemon` composes
them over its :class:`Ports`, the one composition of a daemon: :func:`real_ports` builds the
real ones (the socket shell :class:`DaemonWire`, :class:`NixlTransport`, peer keys, the shm
ledger), :class:`kvpush_dev.inmemory.MemNode` is the same ``DeviceDaemon`` over in-memory
ports, so the timers it ticks are the real ones. The worker runs the loop: one thread that blocks on its sockets while idle (no NIXL progress thread, no busy
polling), polls NIXL with a short adaptive interval only while WRITEs are in flight or
notifications are expected, and ticks the cores' timers every 50 ms.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from kvpush import proto
from kvpush.daemon.config import DeviceConfig, cpu_set
from kvpush.daemon.context import DaemonContext, exit_fence
from kvpush.daemon.core.peers import PeerLinkState
from kvpush.daemon.core.session_gate import PendingCap
from kvpush.daemon.decode_side import DecodeSide
from kvpush.daemon.engine_session import EngineSession, LocalTrust, RegionOpener, map_engine_region
from kvpush.daemon.io.endpoints import Endpoints
from kvpush.daemon.io.heap import HeapTrimmer
from kvpush.daemon.io.kv_mapping import ShmLedger
from kvpush.daemon.io.transport import NixlTransport
from kvpush.daemon.io.wire import DaemonWire, frame_node
from kvpush.daemon.metrics import DaemonMetrics
from kvpush.daemon.ops.views import DaemonView, handle_ops
from kvpush.daemon.prefill_side import PrefillSide
from kvpush.daemon.trust.peerauth import PeerAuth
from kvpush.proto.card import DaemonCard, card_path, remove_card, write_card

log = logging.getLogger(__name__)

TICK_S = 0.05  # timers (deadlines, leases, peer silence) resolve to this
PR_SET_TIMERSLACK = 29  # <linux/prctl.h>
TIMER_SLACK_NS = 1000
IDLE_POLL_S = 0.25  # how long the loop blocks on its sockets with nothing in flight
STALL_WARN_S = 0.5  # a loop step this long is logged (and counted as failure{cause="loop_stall"})
# Ticks further apart than an idle wait plus a stalled step: the loop did not run (the process
# was stopped, or its host stalled), and that time is not its peers' silence.
FROZEN_GAP_S = IDLE_POLL_S + STALL_WARN_S
BACKLOG_TURNS = 256  # engine socket reads that drain what piled up while the daemon did not run
AUTH_REFRESH_S = 0.1  # how often the loop asks the allowlist (in memory; its thread reads the disk)


def nixl_turn(prefill: PrefillSide, decode: DecodeSide, now: float) -> bool:
    """One loop turn's NIXL work, only where there is some: poll our WRITEs in flight and take
    the notifications of live registrations (both drive NIXL progress). True if anything moved."""
    activity = prefill.progress(now) if prefill.in_flight else False
    if decode.receiving:
        activity |= decode.take_notifications(now)
    return activity


class _Laps:
    """Where one loop step spent its time (for the stall warning)."""

    __slots__ = ("clock", "t0", "last", "parts")

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.t0 = self.last = clock()
        self.parts: list[tuple[float, str]] = []

    def __call__(self, what: str) -> None:
        t = self.clock()
        self.parts.append((t - self.last, what))
        self.last = t

    def total(self) -> float:
        return self.last - self.t0

    def slowest(self) -> str:
        dt, what = max(self.parts)
        return f"{what}: {dt:.2f} s"


class _Late:
    """A callback bound once its target exists (the wire reports bad input to the context,
    which is built over the wire)."""

    def __init__(self) -> None:
        self.target: Callable[[str, str], None] | None = None

    def __call__(self, cause: str, detail: str) -> None:
        if self.target is not None:
            self.target(cause, detail)


@dataclass
class Ports:
    """Everything a :class:`DeviceDaemon` talks to outside its own process state."""

    wire: Any  # the Wire port (context.Wire); the real one also drives the loop's sockets
    transport: Any  # NixlTransport or an in-memory stand-in with the same methods
    peer_endpoint: str  # what decode daemons dial to reach this one
    daemon_id: str
    agent_name: str
    auth: PeerAuth | None = None  # None: insecure_peers
    trust: LocalTrust | None = None  # who may attach (peer credentials, the shm ledger)
    open_region: RegionOpener = map_engine_region  # maps an engine's MemoryHandle
    fence: Callable[[str], None] = exit_fence
    on_bad: _Late | None = None  # bound to the context's ``bad`` once it exists
    close: Callable[[], None] = lambda: None  # after the wire closed (the ZeroMQ context)


def real_ports(cfg: DeviceConfig) -> Ports:
    """The ports of a real daemon: sockets bound, peer keys loaded, a NIXL agent created."""
    daemon_id = uuid.uuid4().hex[:12]
    agent_name = f"kvpush-{socket.gethostname()}-{cfg.name}-{daemon_id}"
    zctx = zmq.Context()
    auth = None
    if cfg.insecure_peers:
        log.warning("insecure_peers = true: the peer port %s:%s accepts anyone who reaches it "
                    "(NIXL metadata and KV memory included)", cfg.peer_host, cfg.peer_port)
    else:
        auth = PeerAuth.load(cfg.curve_secret_key_file, cfg.authorized_keys_dir)
        auth.pending = PendingCap(cfg.max_sessions_per_peer, cfg.hello_deadline_s)
    ep = Endpoints(
        zctx, engine=cfg.engine_socket, peer=f"tcp://{cfg.peer_host}:{cfg.peer_port or 0}",
        max_message=cfg.max_message_bytes, handshake_ms=round(cfg.peer_handshake_s * 1000),
        ops=cfg.ops_socket, socket_mode=cfg.socket_mode, auth=auth,
    )
    bad = _Late()
    wire = DaemonWire(ep, bad, hello_deadline_s=cfg.hello_deadline_s, reserved_fds=cfg.reserved_fds)
    params = {"ucx_error_handling_mode": cfg.ucx_error_handling_mode} if cfg.backend == "UCX" else {}
    adv = cfg.advertise_host or cfg.peer_host
    ledger = ShmLedger(os.path.join(cfg.runtime_dir, f"shm-{cfg.name}.json"))
    return Ports(
        wire=wire, transport=NixlTransport(agent_name, cfg.backend, backend_params=params),
        peer_endpoint=f"tcp://{adv}:{ep.peer_ep.rsplit(':', 1)[1]}", daemon_id=daemon_id,
        agent_name=agent_name, auth=auth, trust=LocalTrust(wire.engine_peers, ledger), on_bad=bad,
        close=zctx.term,
    )


class DeviceDaemon:
    """One device's daemon: its parts over its ports, and the loop (startup, step, tick,
    shutdown)."""

    def __init__(self, cfg: DeviceConfig, ports: Ports) -> None:
        self.cfg = cfg
        self.ports = ports
        self.wire = ports.wire
        self.ctx = DaemonContext(cfg, ports.daemon_id, ports.agent_name, ports.peer_endpoint, ports.wire,
                                 ports.transport, DaemonMetrics(cfg.name), auth=ports.auth, fence=ports.fence)
        if ports.on_bad is not None:
            ports.on_bad.target = self.ctx.bad
        if hasattr(ports.wire, "session_live"):  # a peer connection lives while its session does
            ports.wire.session_live = lambda ident: ident in self.prefill.consumers
        if cfg.otlp_traces_endpoint:
            from kvpush.common.otel import SpanSink

            self.ctx.trace.sink = SpanSink(f"kvpushd {cfg.name}", cfg.otlp_traces_endpoint).on_end(
                f"kvpushd {cfg.name}")
        self.prefill = PrefillSide(self.ctx)
        self.decode = DecodeSide(self.ctx)
        self.session = EngineSession(self.ctx, self.prefill, self.decode, open_region=ports.open_region,
                                     trust=ports.trust)
        self.ops = self._ops_view()
        self.stopping = False
        self.poll_s = cfg.poll_min_s
        self.last_tick = 0.0
        self.last_auth = 0.0
        self.heap = HeapTrimmer()  # gives a burst's freed buffers back (peer-port floods)

    def _ops_view(self) -> DaemonView:
        """What ops may see and do (ops_views never holds the worker)."""
        ctx, prefill, decode, auth = self.ctx, self.prefill, self.decode, self.ctx.auth

        def metrics_text() -> str:
            prefill.report_held(time.monotonic())
            return ctx.metrics.render()

        def drain() -> None:
            ctx.draining = True

        return DaemonView(
            device=self.cfg.name, backend=self.cfg.backend, engine_socket=self.cfg.engine_socket,
            daemon_id=ctx.daemon_id, agent=lambda: ctx.agent_name, started=ctx.started,
            peer_endpoint=ctx.peer_endpoint, peer_auth="insecure" if auth is None else "curve",
            node="" if auth is None else auth.me.name,
            engine=lambda: ctx.attached,
            draining=lambda: ctx.draining,
            rejected_inputs=lambda: ctx.errors,
            counts=lambda: (prefill.rdv.counts(), decode.counter.counts()),
            prefill_pending=prefill.rdv.pending,
            decode_pending=decode.counter.pending,
            peer_counts=lambda: (len(decode.producers), len(prefill.consumers)),
            peer_rows=lambda now: ([p.describe(now) for p in decode.producers.values()]
                                   + [p.describe(now) for p in prefill.consumers.values()]),
            writes_in_flight=lambda: list(prefill.in_flight.values()),
            recent=lambda: list(ctx.history.items),
            trace=ctx.trace.view,
            metrics_text=metrics_text,
            drain=drain,
            cancel=self.cancel,
        )

    # ------------------------------------------------------------------ loop

    def busy(self) -> bool:
        return bool(self.prefill.in_flight or self.decode.receiving or self.decode.handshaking)

    def run(self, ready: Any = None) -> int:
        log.info(
            "daemon %s up: engine %s, peer %s, ops %s, NIXL agent %s",
            self.cfg.name, self.cfg.engine_socket, self.ctx.peer_endpoint, self.cfg.ops_socket,
            self.ctx.agent_name,
        )
        self._publish_card()
        if ready is not None:
            ready.set()
        while not self.stopping:
            try:
                self.step()
            except Exception:  # a bug in one handler must not take the node's transfers down
                log.exception("daemon loop error; continuing")
                self.ctx.metrics.failure("internal")
                time.sleep(0.01)
        self.shutdown()
        return 0

    def step(self) -> None:
        ready = self.wire.poll(self.poll_s if self.busy() else IDLE_POLL_S)
        now = time.monotonic()
        backlog = False
        if self.last_tick and now - self.last_tick > FROZEN_GAP_S:
            # Before any message is handled: what we held may have been given up meanwhile.
            gap = now - self.last_tick
            self.resumed(gap, now)
            self.last_tick = now - TICK_S  # the tick below runs now, and sees no second gap
            backlog = gap >= proto.ENGINE_DEAD_AFTER_MIN_S
        engine, peer, ops = self.wire.bound()
        activity = False
        lap = _Laps()
        if backlog:
            activity |= self._drain_backlog()
            lap("engine backlog")
        elif engine in ready:
            activity |= self.wire.drain_engine(self._on_engine)
            lap("engine messages")
        if peer in ready:
            activity |= self.wire.drain_router(peer, self._on_peer, meta=frame_node)
            lap("peer messages")
        if ops in ready:
            self.wire.drain_router(ops, self._on_ops)
            lap("ops requests")
        for sock in ready - {engine, peer, ops}:
            activity |= self.wire.drain_dealer(sock, self._on_producer)
        lap("producer messages")
        now = time.monotonic()
        activity |= nixl_turn(self.prefill, self.decode, now)
        lap("NIXL polls")
        if now - self.last_tick >= TICK_S:
            self.last_tick = now
            self.tick(now)
            lap("timers")
        if lap.total() >= STALL_WARN_S:
            # Nothing here may block: a stalled loop leaves engines' heartbeats unanswered
            # (their plugins then fail every transfer after dead_after_s) and WRITEs unpolled.
            self.ctx.metrics.failure("loop_stall")
            log.warning("daemon loop stalled %.2f s (%s)", lap.total(), lap.slowest())
        # A notification waits in NIXL until we poll. Producers say Writing over ZeroMQ when
        # they post a WRITE (poll tightly until its notification shows) and when it completed
        # (wakes this loop at once); with no WRITE announced, poll only as a slow fallback.
        # Our own WRITEs in flight poll tightly too: they move only while polled.
        cap = min(self.decode.poll_cap(now), self.prefill.poll_cap())
        self.poll_s = min(self.cfg.poll_min_s, cap) if activity else min(self.poll_s * 2, cap)

    def _drain_backlog(self) -> bool:
        """Everything the engine wrote while we did not run, before any peer frame: it may have
        given us up meanwhile (proto.ENGINE_DEAD_AFTER_MIN_S), so its PrefillDones name blocks
        that may be free (failed, never written), and its Aborts say which prefills it gave up
        without telling us (remembered, so their registrations are refused at once)."""
        got = False
        self.prefill.backlog, self.prefill.backlog_failed = True, 0
        try:
            for _ in range(BACKLOG_TURNS):  # each turn reads a bounded slice per connection
                if not self.wire.drain_engine(self._on_engine):
                    break
                got = True
        finally:
            self.prefill.backlog = False
        if self.prefill.backlog_failed:
            log.warning("%d prefill(s) the engine sent while this daemon did not run failed (their blocks may "
                        "have been freed); their decode sides recompute", self.prefill.backlog_failed)
        return got

    def _on_engine(self, ident: bytes, msg: Any, peer: Any = None) -> None:
        self.session.on_engine(ident, msg, time.monotonic(), peer)

    def _on_peer(self, ident: bytes, msg: Any, node: str) -> None:
        self.prefill.on_peer(ident, msg, time.monotonic(), node)
        pending = self.ctx.auth.pending if self.ctx.auth is not None else None
        if pending is not None and isinstance(msg, proto.Hello) and ident in self.prefill.consumers:
            pending.handshaken(node, self._sessions_by_node())

    def _sessions_by_node(self) -> dict[str, int]:
        return dict(Counter(c.node for c in self.prefill.consumers.values() if c.node))

    def _on_producer(self, endpoint: str, msg: Any) -> None:
        self.decode.on_producer(endpoint, msg, time.monotonic())
        if isinstance(msg, proto.Writing):  # a WRITE to us is in flight or landed: poll now
            self.poll_s = self.cfg.poll_min_s

    def _on_ops(self, ident: bytes, msg: Any) -> None:
        if not isinstance(msg, proto.OpsRequest):
            self.wire.to_ops(ident, proto.OpsReply(False, {}, f"expected OpsRequest, got {type(msg).__name__}"))
            return
        self.wire.to_ops(ident, handle_ops(self.ops, msg))

    def resumed(self, gap: float, now: float) -> None:
        """The loop did not run for ``gap`` seconds (the process was stopped, or its host
        stalled). Our peers were not silent, we were; and our engine may have given us up."""
        self.decode.resumed(gap)
        self.prefill.resumed(gap, now)

    def tick(self, now: float) -> None:
        self.wire.expire(now)
        self.prefill.tick(now)
        self.decode.tick(now)
        self.session.tick(now)
        self.heap.tick(now)
        auth = self.ctx.auth
        if auth is not None and now - self.last_auth >= AUTH_REFRESH_S:
            self.last_auth = now
            if auth.pending is not None:
                auth.pending.set_live(self._sessions_by_node())
            if auth.allow.refresh():  # a node added, rotated or revoked
                names = auth.allow.names()
                self.prefill.revoke(names, now)
                rotations = self.decode.rotations
                self.decode.revoke(names)
                if self.decode.rotations != rotations:  # role both: our agent and mapping were replaced
                    self.prefill.forget_preps()
        m = self.ctx.metrics
        m.set_peers("ready", sum(p.state is PeerLinkState.READY for p in self.decode.producers.values())
                    + len(self.prefill.consumers))
        for state in (PeerLinkState.HANDSHAKING, PeerLinkState.RECOVERING):
            m.set_peers(str(state), sum(p.state is state for p in self.decode.producers.values()))

    # ------------------------------------------------------------------ ops commands

    def cancel(self, tid: str, why: str, now: float) -> bool:
        """Operator cancel: fail the transfer on whichever side holds it."""
        found = self.prefill.abort(tid, why, now)
        return self.decode.cancel(tid, why, now) or found

    # ------------------------------------------------------------------ shutdown

    def _publish_card(self) -> None:
        """Tell the node's engines this daemon's peer endpoint (proto.card: a prefill engine
        behind a serial proxy returns it in its response)."""
        path = card_path(self.cfg.engine_socket)
        if path is None:
            return
        node = "" if self.ctx.auth is None else self.ctx.auth.me.name
        try:
            write_card(path, DaemonCard(self.ctx.peer_endpoint, self.ctx.daemon_id, node),
                       self.cfg.socket_mode & 0o666)
        except (OSError, ValueError) as exc:
            log.warning("cannot write the daemon card %s (serial proxies will not find this daemon): %s", path, exc)

    def shutdown(self) -> None:
        log.info("daemon %s stopping", self.cfg.name)
        path = card_path(self.cfg.engine_socket)
        if path is not None:
            remove_card(path)
        self.prefill.fail_all("daemon shutting down")
        self.decode.fail_all("daemon shutting down")
        self.prefill.wait_in_flight(min(self.cfg.write_timeout_s, 5.0))
        self.decode.drop_all("shutdown")
        self.prefill.release_preps()
        try:
            self.ctx.transport.close()
        except Exception as exc:
            log.warning("NIXL close: %s", exc)
        self.session.unmap()
        self.session.shutdown()
        self.wire.close()
        self.ports.close()


def _tight_timers() -> None:
    """Sub-millisecond sleeps that last what they ask (Linux's default 50 us timer slack makes
    a 100 us sleep 180 us): the loop's short waits pace NIXL progress while WRITEs flow."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_TIMERSLACK, TIMER_SLACK_NS, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the default slack only costs some rate
        pass


def pin(cfg: DeviceConfig) -> None:
    """Confine this daemon (every thread it starts later too) to ``cfg.cpus``, if set."""
    if cfg.cpus:
        cpus = cpu_set(cfg.cpus)
        os.sched_setaffinity(0, cpus)
        log.info("daemon %s pinned to CPUs %s", cfg.name, ",".join(map(str, sorted(cpus))))


def run_device_daemon(cfg: DeviceConfig, ready_event: Any = None) -> int:
    """Entry point of one accelerator's daemon (a supervisor child or `kvpushd worker`)."""
    logging.basicConfig(
        level=getattr(logging, str(cfg.log_level).upper(), logging.INFO),
        format=f"%(asctime)s kvpushd[{cfg.name}:{os.getpid()}] %(levelname)s %(name)s: %(message)s",
    )
    import faulthandler

    # `kill -USR1 <pid>` dumps every thread's stack to stderr: what is this daemon doing?
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    _tight_timers()
    pin(cfg)
    w = DeviceDaemon(cfg, real_ports(cfg))

    def stop(signum: int, _frame: Any) -> None:
        w.stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    return w.run(ready_event)
