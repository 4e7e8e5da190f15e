"""One accelerator's daemon: the composition root and the loop that drives its parts.

The parts (each its own module, each unit-tested through the in-memory ports of
:mod:`kvpush.testing.inmemory`):

* :class:`EngineSession` — the local engine rank: Attach, Register, PrefillDone, Abort;
* :class:`PrefillSide` — decode peers that dial us, the rendezvous core, our WRITEs;
* :class:`DecodeSide` — links to prefill daemons, the completion counter, notifications;
* :mod:`kvpush.daemon.ops_views` — ``kvpushctl``'s view and commands.

They share a :class:`DaemonContext` (identity, ports, records). This module builds them,
wires the socket shell (:class:`DaemonWire`) and NIXL (:class:`NixlTransport`) in, and runs
the loop: one thread that blocks on its sockets while idle (no NIXL progress thread, no busy
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
from collections.abc import Callable
from typing import Any

import zmq

from kvpush import proto
from kvpush.daemon.context import DaemonContext
from kvpush.daemon.daemon_config import DeviceConfig
from kvpush.daemon.decode_side import DecodeSide
from kvpush.daemon.endpoints import Endpoints
from kvpush.daemon.engine_session import EngineSession, LocalTrust
from kvpush.daemon.kv_mapping import ShmLedger
from kvpush.daemon.metrics import WorkerMetrics
from kvpush.daemon.peerauth import PeerAuth
from kvpush.daemon.peers import Link
from kvpush.daemon.prefill_side import PrefillSide
from kvpush.daemon.transport import NixlTransport
from kvpush.daemon.wire import DaemonWire, frame_node
from kvpush.proto.card import DaemonCard, card_path, remove_card, write_card

log = logging.getLogger(__name__)

TICK_S = 0.05  # timers (deadlines, leases, peer silence) resolve to this
PR_SET_TIMERSLACK = 29  # <linux/prctl.h>
TIMER_SLACK_NS = 1000
IDLE_POLL_S = 0.25  # how long the loop blocks on its sockets with nothing in flight
STALL_WARN_S = 0.5  # a loop step this long is logged (and counted as failure{cause="loop_stall"})
AUTH_REFRESH_S = 1.0  # how often the allowlist directory is checked for changes


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


class Worker:
    """One device's daemon: its parts, and the loop (startup, step, tick, shutdown)."""

    def __init__(self, cfg: DeviceConfig) -> None:
        self.cfg = cfg
        daemon_id = uuid.uuid4().hex[:12]
        agent_name = f"kvpush-{socket.gethostname()}-{cfg.name}-{daemon_id}"
        metrics = WorkerMetrics(cfg.name)
        self.zctx = zmq.Context()
        auth = None
        if cfg.insecure_peers:
            log.warning("insecure_peers = true: the peer port %s:%s accepts anyone who reaches it "
                        "(NIXL metadata and KV memory included)", cfg.peer_host, cfg.peer_port)
        else:
            auth = PeerAuth.load(cfg.curve_secret_key_file, cfg.authorized_keys_dir)
        ep = Endpoints(
            self.zctx, engine=cfg.engine_socket, peer=f"tcp://{cfg.peer_host}:{cfg.peer_port or 0}",
            max_message=cfg.max_message_bytes, handshake_ms=round(cfg.peer_handshake_s * 1000),
            ops=cfg.ops_socket, socket_mode=cfg.socket_mode, auth=auth,
        )
        self.ctx: DaemonContext
        self.wire = DaemonWire(ep, lambda cause, detail: self.ctx.bad(cause, detail))
        params = {"ucx_error_handling_mode": cfg.ucx_error_handling_mode} if cfg.backend == "UCX" else {}
        adv = cfg.advertise_host or cfg.peer_host
        self.ctx = DaemonContext(
            cfg, daemon_id, agent_name, f"tcp://{adv}:{ep.peer_ep.rsplit(':', 1)[1]}", self.wire,
            NixlTransport(agent_name, cfg.backend, backend_params=params), metrics, auth=auth,
        )
        if cfg.otlp_traces_endpoint:
            from kvpush.daemon.otel import SpanSink

            self.ctx.trace.sink = SpanSink(f"kvpushd {cfg.name}", cfg.otlp_traces_endpoint).on_end(
                f"kvpushd {cfg.name}")
        self.prefill = PrefillSide(self.ctx)
        self.decode = DecodeSide(self.ctx)
        ledger = ShmLedger(os.path.join(cfg.runtime_dir, f"shm-{cfg.name}.json"))
        self.session = EngineSession(self.ctx, self.prefill, self.decode,
                                     trust=LocalTrust(self.wire.engine_peers, ledger))
        self.stopping = False
        self.poll_s = cfg.poll_min_s
        self.last_tick = 0.0
        self.last_auth = 0.0

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
        engine, peer, ops = self.wire.bound()
        activity = False
        lap = _Laps()
        if engine in ready:
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

    def _on_engine(self, ident: bytes, msg: Any, peer: Any = None) -> None:
        self.session.on_engine(ident, msg, time.monotonic(), peer)

    def _on_peer(self, ident: bytes, msg: Any, node: str) -> None:
        self.prefill.on_peer(ident, msg, time.monotonic(), node)

    def _on_producer(self, endpoint: str, msg: Any) -> None:
        self.decode.on_producer(endpoint, msg, time.monotonic())
        if isinstance(msg, proto.Writing):  # a WRITE to us is in flight or landed: poll now
            self.poll_s = self.cfg.poll_min_s

    def _on_ops(self, ident: bytes, msg: Any) -> None:
        from kvpush.daemon.ops_views import handle_ops

        if not isinstance(msg, proto.OpsRequest):
            self.wire.to_ops(ident, proto.OpsReply(False, {}, f"expected OpsRequest, got {type(msg).__name__}"))
            return
        self.wire.to_ops(ident, handle_ops(self, msg))

    def tick(self, now: float) -> None:
        self.wire.expire(now)
        self.prefill.tick(now)
        self.decode.tick(now)
        self.session.tick(now)
        auth = self.ctx.auth
        if auth is not None and now - self.last_auth >= AUTH_REFRESH_S:
            self.last_auth = now
            if auth.allow.refresh():  # a node added, rotated or revoked
                names = auth.allow.names()
                self.prefill.revoke(names, now)
                self.decode.revoke(names)
        m = self.ctx.metrics
        m.set_peers("ready", sum(p.state is Link.READY for p in self.decode.producers.values())
                    + len(self.prefill.consumers))
        m.set_peers("handshaking", sum(p.state is Link.HANDSHAKING for p in self.decode.producers.values()))

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
        if self.ctx.attached is not None:
            for region in self.ctx.attached.regions:
                region.close()
            self.ctx.attached = None
        self.session.shutdown()
        self.wire.close()
        self.zctx.term()


def _tight_timers() -> None:
    """Sub-millisecond sleeps that last what they ask (Linux's default 50 us timer slack makes
    a 100 us sleep 180 us): the loop's short waits pace NIXL progress while WRITEs flow."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_TIMERSLACK, TIMER_SLACK_NS, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the default slack only costs some rate
        pass


def run_worker(cfg: DeviceConfig, ready_event: Any = None) -> int:
    """Entry point of one accelerator's daemon (a supervisor child or `kvpushd worker`)."""
    logging.basicConfig(
        level=getattr(logging, str(cfg.log_level).upper(), logging.INFO),
        format=f"%(asctime)s kvpushd[{cfg.name}:{os.getpid()}] %(levelname)s %(name)s: %(message)s",
    )
    import faulthandler

    # `kill -USR1 <pid>` dumps every thread's stack to stderr: what is this daemon doing?
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    _tight_timers()
    w = Worker(cfg)

    def stop(signum: int, _frame: Any) -> None:
        w.stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    return w.run(ready_event)
