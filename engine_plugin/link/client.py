"""Non-blocking client from a vLLM engine to its local daemon (kvpushd, one per accelerator).

It runs on vLLM's engine loop, so nothing here may block or raise for transport reasons:
the socket is a non-blocking AF_UNIX stream (frames of :mod:`kvpush.proto.stream`), a frame
the kernel buffer cannot take waits in a bounded output buffer and then in the link's bounded
queue, every receive is a zero-timeout drain inside :meth:`DaemonClient.poll`, and there are
no threads, not even a transport library's (a hop costs one wake-up of each process).

This is the I/O shell of :mod:`kvpush.engine_plugin.link.state`, which decides everything about the
link (when the Attach goes out, what waits in the queue, liveness, re-attach): the shell turns
connects (``Connected``), end-of-stream or socket errors (``Disconnected``), decoded frames
and polls into the machine's events and carries out its actions. The first dial is at the
first :meth:`DaemonClient.attach`, ``send`` or ``poll`` (the daemon closes a connection that
stays silent past its handshake bound, and vLLM builds the worker long before its KV cache
exists); a lost link is dialled again every RECONNECT_S from :meth:`DaemonClient.poll` (a
daemon restarting under its supervisor). Every dial first checks that the socket, its
directory and the process listening on it belong to a trusted user
(:mod:`kvpush.engine_plugin.link.local_trust`); a refusal is a failed dial, so the daemon stays
unavailable and the engine recomputes.
"""

from __future__ import annotations

import errno
import select
import socket
import struct
import time
from collections.abc import Callable, Iterable
from typing import Any

from kvpush.common.machine import drive
from kvpush.engine_plugin.link.local_trust import path_refusal, peer_refusal, trusted_uids
from kvpush.engine_plugin.link.state import (
    Act,
    AttachAcked,
    AttachRequested,
    AttachSent,
    Close,
    Connected,
    DaemonLink,
    Disconnected,
    Drained,
    Heard,
    HeartbeatAcked,
    HeartbeatSent,
    LinkCounters,
    Route,
    State,
    Tick,
)
from kvpush.engine_plugin.logonce import OncePer
from kvpush.engine_plugin.logs import plugin_logger
from kvpush.proto import (
    Abort,
    Attach,
    AttachAck,
    Heartbeat,
    HeartbeatAck,
    Message,
    PrefillDone,
    ProtocolError,
    decode,
    encode,
)
from kvpush.proto.naming import ipc_path
from kvpush.proto.stream import Deframer, FrameTooLarge, Outbox, Put, frame

__all__ = ["DaemonClient"]

log = plugin_logger(__name__)

OUT_MAX = 4 << 20  # bytes of frames the kernel has not taken yet; beyond, the link's queue
MAX_FRAME = 64 << 20  # largest frame accepted from the daemon (its replies are small)
READ_CHUNK = 256 << 10
RECONNECT_S = 0.1
MAX_DRAIN = 10_000  # frames read per poll(), so one poll() stays bounded in time
_TRANSIENT = frozenset({errno.ENOENT, errno.ECONNREFUSED, errno.EAGAIN, errno.EINTR})
_UCRED = struct.Struct("3i")  # struct ucred {pid_t pid; uid_t uid; gid_t gid;}


def _listener_uid(sock: socket.socket) -> int | None:
    """The uid of the process that listens on a connected unix socket (``SO_PEERCRED``)."""
    try:
        pid, uid, _ = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    except OSError:
        return None
    return uid if pid > 0 else None


class DaemonClient:
    """One engine rank's (or scheduler's) link to its daemon's engine socket."""

    def __init__(
        self,
        endpoint: str,
        *,
        max_queue: int = 4096,
        heartbeat_s: float = 1.0,
        dead_after_s: float = 3.0,
        clock: Callable[[], float] = time.monotonic,
        trusted: frozenset[int] | None = None,
    ) -> None:
        """``trusted``: the uids that may own the socket and its directory and listen on it
        (default: root and our own, :func:`kvpush.engine_plugin.link.local_trust.trusted_uids`)."""
        if max_queue < 0 or heartbeat_s <= 0 or dead_after_s <= 0:
            raise ValueError("max_queue >= 0, heartbeat_s > 0 and dead_after_s > 0 required")
        self.endpoint = endpoint
        self.max_queue = max_queue
        self.heartbeat_s = heartbeat_s
        self.dead_after_s = dead_after_s
        self._clock = clock
        self._link = DaemonLink(clock(), max_queue=max_queue, heartbeat_s=heartbeat_s,
                          dead_after_s=dead_after_s)
        self._attach_frame = b""
        self._attach_then: tuple[bytes, ...] = ()  # frames each new link sends right after the Attach

        path = ipc_path(endpoint)
        if path is None:
            raise ValueError(f"daemon endpoint must be ipc://<path>, got {endpoint!r}")
        self._path = path
        self.trusted = trusted_uids() if trusted is None else trusted
        self.refusals = 0  # dials refused by the local trust rules
        # layerwise "auto": the shortest prompt the daemon would stream (its last HeartbeatAck;
        # 0: any): progress of a shorter one would only wake it for nothing
        self.stream_min_tokens = 0
        self._said = OncePer(16)
        self._sock: socket.socket | None = None
        self._fds = select.poll()  # the socket's readability, without a recv that fails
        self._out = Outbox(OUT_MAX)  # the tail of frames the kernel did not take yet
        self._reader = Deframer(MAX_FRAME)
        self._broken = False  # a send failed: the connection is dropped at the next poll()
        # Dialling is paced in real time (time.monotonic), not by ``clock``: that one judges
        # liveness (and a test may stop it); how often we knock is the socket's business.
        self._retry_at = 0.0
        # A connection the link machine has not heard of yet (Connected): told at once by
        # attach(), send() and poll(), so that an Attach is the link's first frame.
        self._unannounced = False

    # ---- state (the link machine's) ------------------------------------------------------

    @property
    def available(self) -> bool:
        """Link up and the daemon heard recently (see link.py's liveness rule)."""
        return self._link.available

    @property
    def attached(self) -> bool:
        """The daemon acknowledged our Attach on the current link."""
        return self._link.attached

    @property
    def state(self) -> State:
        return self._link.state

    @property
    def daemon_id(self) -> str | None:
        return self._link.daemon_id

    @property
    def agent_name(self) -> str | None:
        return self._link.agent_name

    @property
    def unavailable_since(self) -> float | None:
        return self._link.unavailable_since

    @property
    def holder(self) -> str | None:
        """The daemon that acknowledged our Attach last (it holds what the engine published)."""
        return self._link.holder

    def down(self) -> bool:
        """The daemon is known unreachable (:meth:`DaemonLink.down`), not merely unanswered yet."""
        link = self._link
        return not link.available and link.down(self._clock())  # the clock is read only when it matters

    def take_replaced(self) -> bool:
        """An AttachAck named another daemon than before: what it held is gone (said once)."""
        return self._link.take_replaced()

    @property
    def rtt_s(self) -> float | None:
        """Last heartbeat round trip."""
        return self._link.rtt_s

    @property
    def counters(self) -> LinkCounters:
        return self._link.counters

    @property
    def sent(self) -> int:
        return self._link.counters.sent

    @property
    def dropped(self) -> int:
        return self._link.counters.dropped

    @property
    def received(self) -> int:
        return self._link.counters.received

    @property
    def decode_errors(self) -> int:
        return self._link.counters.decode_errors

    @property
    def heartbeats(self) -> int:
        return self._link.counters.heartbeats

    @property
    def reattaches(self) -> int:
        return self._link.counters.reattaches

    # ---- sending -------------------------------------------------------------------------

    @property
    def queued(self) -> int:
        """Messages waiting in the local queue (not yet handed to the socket)."""
        return len(self._link.queue)

    def send(self, msg: Message) -> bool:
        """Send or queue ``msg``; False (and ``dropped`` += 1) when the queue is full.

        Never blocks and never raises for transport reasons; an unencodable message is the
        caller's bug and raises ProtocolError.
        """
        link = self._link
        self._connect()
        if link.state is not State.CLOSED and link.queue:
            self._flush()  # keep order: nothing overtakes what is queued
        route = link.route()
        if route is Route.REFUSE:
            return False
        data = encode(msg)
        if route is Route.DIRECT and self._raw_send(data):
            link.counters.sent += 1
            return True
        return link.enqueue(data)

    def send_encoded(self, data: bytes) -> bool:
        """send() of a message the caller encoded itself (a LayerProgress built from parts made
        once per forward: engine_plugin.layer_stream). Same routing, same counters."""
        link = self._link
        self._connect()
        if link.state is not State.CLOSED and link.queue:
            self._flush()
        route = link.route()
        if route is Route.REFUSE:
            return False
        if route is Route.DIRECT and self._raw_send(data):
            link.counters.sent += 1
            return True
        return link.enqueue(data)

    def publish_prefill_done(
        self, transfer_id: str, block_ids: Iterable[int], num_tokens: int, lease_ms: int
    ) -> bool:
        """Prefill side: the transfer's KV is in these blocks, held for ``lease_ms``."""
        return self.send(PrefillDone(transfer_id, tuple(block_ids), num_tokens, lease_ms))

    def publish_abort(self, transfer_id: str, attempt: int, reason: str) -> bool:
        """Either side gives up on one attempt of a transfer."""
        return self.send(Abort(transfer_id, attempt, reason))

    def attach(self, msg: Attach, then: tuple[Message, ...] = ()) -> None:
        """Remember ``msg``; send it now if a link is up, else as a new link's first frame.
        ``then``: what every link (a re-attach too) sends right after it (LayerEvents: a
        restarted daemon knows nothing of the engine's event pool)."""
        self._attach_frame = encode(msg)
        self._attach_then = tuple(encode(m) for m in then)
        if self._link.state is State.CLOSED:
            return
        if self._sock is None:
            self._dial()  # now, not at the next poll: the engine's first step may be far off
        self._feed(AttachRequested())
        if self._unannounced:
            self._announce()  # the Attach is the new link's first frame, out now

    def _raw_send(self, data: bytes) -> bool:
        """Hand one message to the socket (or its output buffer); False if it cannot take it
        now (no link, or OUT_MAX reached): the caller queues or retries."""
        sock = self._sock
        if sock is None or self._broken or not self._push_out():
            return False
        put = self._out.put(sock, frame(data))
        if put is Put.DEAD:
            self._broken = True
        return put is Put.TAKEN

    def _push_out(self) -> bool:
        """Send what the output buffer holds; False if the link died doing so."""
        if self._out.flush(self._sock):  # type: ignore[arg-type]
            return True
        self._broken = True
        return False

    def _flush(self) -> None:
        """Hand queued frames to the socket while it takes them, if the link lets messages flow."""
        link = self._link
        if not link.flows:
            return
        q = link.queue
        while q and self._raw_send(q[0]):
            q.popleft()
            link.counters.sent += 1

    def _feed(self, ev: Any) -> None:
        """One event into the link machine; carry out its actions, in order (a send's outcome
        is told to it after the batch: :func:`kvpush.common.machine.drive`)."""
        drive(self._link, ev, self._carry_out)

    def _carry_out(self, a: Act) -> list[Any] | None:
        link = self._link
        if a is Act.FLUSH:
            if link.queue:
                self._flush()
        elif a is Act.SEND_ATTACH:
            if self._raw_send(self._attach_frame):
                for data in self._attach_then:  # right behind it; lost only with the link
                    self._raw_send(data)
                return [AttachSent()]
        elif a is Act.SEND_HEARTBEAT:
            if self._raw_send(encode(Heartbeat(link.hb_seq))):
                return [HeartbeatSent(self._clock())]
        elif a is Act.RECHECK_LINK:
            self._retry_at = 0.0  # no link yet: dial at the next poll
        elif a is Act.DROP_QUEUE:
            link.queue.clear()
        else:
            self._log(a)
        return None

    def _log(self, a: Act) -> None:
        link = self._link
        if a is Act.LOG_RESTART:
            log.warning("kvpush: daemon %s restarted (id %s); re-attaching", self.endpoint, link.daemon_id)
        elif a is Act.LOG_AVAILABLE:
            log.info("kvpush: daemon at %s available (id %s)", self.endpoint, link.daemon_id)
        elif a is Act.LOG_LOST:
            log.warning("kvpush: daemon at %s unavailable (connection lost)", self.endpoint)
        elif a is Act.LOG_SILENT:
            log.warning("kvpush: daemon at %s unavailable (silent for more than %.1f s: %s)",
                        self.endpoint, self.dead_after_s, link.silence_detail(self._clock()))
        elif a is Act.LOG_NEVER_ANSWERED:
            log.warning("kvpush: daemon at %s has not answered for %.1f s",
                        self.endpoint, link.never_answered_s(self._clock()))

    # ---- receiving -----------------------------------------------------------------------

    def wait(self, timeout_s: float) -> bool:
        """Block up to ``timeout_s`` for a frame from the daemon; True if one is readable.

        Only for the plugin's idle steps (no forward scheduled): it replaces vLLM's busy
        spin with a bounded sleep that any daemon message ends at once.
        """
        if self._link.state is State.CLOSED:
            return False
        ms = max(0, int(timeout_s * 1000))
        if self._sock is None:
            time.sleep(ms / 1000)  # no link: the bounded sleep, not a spin
            return False
        return bool(self._fds.poll(ms))

    def poll(self) -> list[Message]:
        """Zero-timeout step: dial, flush, heartbeat, drain replies; returns daemon->engine
        messages.

        HeartbeatAck is consumed here; everything else (AttachAck, Sent, SendFailed, Received,
        ReceiveFailed, Released, Error) comes back in arrival order.
        """
        link = self._link
        if link.state is State.CLOSED:
            return []
        now = self._clock()
        if self._broken:
            self._lost()
        self._connect()
        if self._out:
            self._push_out()
        self._feed(Tick(now))
        out: list[Message] = []
        if self._sock is not None and self._fds.poll(0):
            self._drain(now, out)
        self._feed(Drained(now))
        return out

    def _drain(self, now: float, out: list[Message]) -> None:
        sock = self._sock
        link = self._link
        frames: list[bytes] = []
        while sock is not None and len(frames) < MAX_DRAIN:
            try:
                data = sock.recv(READ_CHUNK)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                data = b""
            if not data:
                self._broken = True
                break
            try:
                frames += self._reader.feed(data)
            except FrameTooLarge as e:
                link.counters.decode_errors += 1
                log.warning("kvpush: daemon %s sent %s; reconnecting", self.endpoint, e)
                self._broken = True
                break
        for raw in frames:
            try:
                msg = decode(raw)
            except ProtocolError as e:
                link.counters.decode_errors += 1
                if link.counters.decode_errors == 1:
                    log.warning("kvpush: undecodable frame from daemon %s: %s", self.endpoint, e)
                continue
            t = type(msg)
            if t is HeartbeatAck:
                self.stream_min_tokens = msg.stream_min_tokens
                self._feed(HeartbeatAcked(msg.seq, msg.daemon_id, now))
                continue
            if t is AttachAck:
                self._feed(AttachAcked(msg.daemon_id, msg.agent_name, now))
            else:
                self._feed(Heard(now))  # no state changes with it: never an action
            out.append(msg)
        if self._broken:  # after what arrived before the end of the stream
            self._lost()

    # ---- the connection ------------------------------------------------------------------

    def _connect(self) -> None:
        """Dial if there is no connection and the pacing allows; tell the link machine of a
        connection it has not heard of."""
        if self._link.state is State.CLOSED:
            return
        if self._sock is None and time.monotonic() >= self._retry_at:
            self._dial()
        if self._unannounced:
            self._announce()

    def _dial(self) -> None:
        """Connect once, without blocking (a unix connect completes or fails at once); on
        success the link machine is to hear Connected (:meth:`_announce`), else the next try
        is RECONNECT_S away."""
        self._retry_at = time.monotonic() + RECONNECT_S
        why = path_refusal(self._path, self.trusted)
        if why:
            self._refuse(why)
            return
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        err = sock.connect_ex(self._path)
        if err:
            sock.close()
            if err not in _TRANSIENT:
                log.debug("kvpush: connect to %s: %s", self.endpoint, errno.errorcode.get(err, err))
            return
        why = peer_refusal(_listener_uid(sock), self.trusted)
        if why:  # nothing was sent on it: the listener learns nothing but that we knocked
            sock.close()
            self._refuse(why)
            return
        self._sock = sock
        self._fds.register(sock, select.POLLIN)
        self._unannounced = True

    def _refuse(self, why: str) -> None:
        self.refusals += 1
        if self._said.first(why):
            log.warning("kvpush: not dialling the daemon at %s: %s; it counts as unavailable "
                        "(loads recompute) until this is fixed", self.endpoint, why)

    def _announce(self) -> None:
        self._unannounced = False
        if self._sock is not None and self._link.state is not State.CLOSED:
            self._feed(Connected(self._clock()))

    def _lost(self) -> None:
        """End of stream or a socket error: drop the connection (frames in it are lost, as
        any transport loses what it had not delivered) and tell the link machine."""
        sock = self._sock
        if sock is None:
            return
        self._sock = None
        self._broken = False
        self._unannounced = False
        self._fds.unregister(sock)
        sock.close()
        self._out.clear()
        self._reader = Deframer(MAX_FRAME)
        self._retry_at = time.monotonic() + RECONNECT_S
        self._feed(Disconnected(self._clock()))

    # ---- teardown ------------------------------------------------------------------------

    def close(self) -> None:
        """Close the connection; later sends are refused, polls return []."""
        if self._link.state is State.CLOSED:
            return
        self._feed(Close())
        if self._sock is not None:
            self._fds.unregister(self._sock)
            self._sock.close()
            self._sock = None

    def __enter__(self) -> DaemonClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
