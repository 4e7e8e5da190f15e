"""Non-blocking client from a vLLM engine to its local daemon (kvpushd, one per accelerator).

It runs on vLLM's engine loop, so nothing here may block or raise for transport reasons:
every send is ``zmq.NOBLOCK`` with a bounded local queue behind it, every receive is a
zero-timeout drain inside :meth:`DaemonClient.poll`, and there are no threads (libzmq's own
I/O thread does the socket work).

This is the I/O shell of :mod:`kvpush.engine_plugin.link`, which decides everything about the
link (when the Attach goes out, what waits in the queue, liveness, re-attach): the shell turns
the socket monitor's events (the one source of truth for whether a link exists), decoded
frames and polls into the machine's events and carries out its actions.

Why the socket is told to process its commands right after the handshake event: libzmq
attaches the new pipe to the socket by a command queued just before it emits the event, and a
``NOBLOCK`` send only looks at pending commands about once a millisecond (command
throttling), so a send right after the event could fail with EAGAIN and the link's first
Attach and Heartbeat would never go out. An unsent Attach is also retried on every poll.
"""

from __future__ import annotations

import logging
import select
import time
from collections.abc import Callable, Iterable

import zmq

from kvpush.engine_plugin.link import (
    Act,
    AttachAcked,
    AttachRequested,
    AttachSent,
    Close,
    Connected,
    Disconnected,
    Heard,
    HeartbeatAcked,
    HeartbeatSent,
    Link,
    LinkCounters,
    Route,
    State,
)
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

__all__ = ["DaemonClient"]

log = logging.getLogger(__name__)

SNDHWM = 1024  # messages in zmq's pipe; the bounded local deque takes the overflow
RCVHWM = 100_000  # a slow engine loop must not make the daemon's ROUTER drop our replies
RECONNECT_IVL_MS = 100
MAX_DRAIN = 10_000  # frames read per poll(), so one poll() stays bounded in time
_MONITOR_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED


class DaemonClient:
    """One engine rank's (or scheduler's) link to its daemon: DEALER to the daemon's ROUTER."""

    def __init__(
        self,
        endpoint: str,
        *,
        max_queue: int = 4096,
        heartbeat_s: float = 1.0,
        dead_after_s: float = 3.0,
        clock: Callable[[], float] = time.monotonic,
        context: zmq.Context | None = None,
    ) -> None:
        if max_queue < 0 or heartbeat_s <= 0 or dead_after_s <= 0:
            raise ValueError("max_queue >= 0, heartbeat_s > 0 and dead_after_s > 0 required")
        self.endpoint = endpoint
        self.max_queue = max_queue
        self.heartbeat_s = heartbeat_s
        self.dead_after_s = dead_after_s
        self._clock = clock
        self._link = Link(clock(), max_queue=max_queue, heartbeat_s=heartbeat_s,
                          dead_after_s=dead_after_s)
        self._attach_frame = b""

        ctx = context if context is not None else zmq.Context.instance()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, SNDHWM)
        sock.setsockopt(zmq.RCVHWM, RCVHWM)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # no pipe (and no queueing) until a peer is there
        sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
        self._mon = sock.get_monitor_socket(_MONITOR_EVENTS)
        self._mon.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        self._sock = sock
        # Readiness without paying ~2 us per zmq getsockopt(EVENTS): a zmq socket's FD is
        # edge-triggered, so EVENTS is re-read only when its FD fired or after our own
        # send/recv on that socket (which may have consumed the edge): the "dirty" flags.
        self._sock_fd: int = sock.get(zmq.FD)
        self._mon_fd: int = self._mon.get(zmq.FD)
        self._fds = select.poll()
        self._fds.register(self._sock_fd, select.POLLIN)
        self._fds.register(self._mon_fd, select.POLLIN)
        self._mon_fds = select.poll()
        self._mon_fds.register(self._mon_fd, select.POLLIN)
        self._sock_dirty = True
        self._mon_dirty = True

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
        """Messages waiting in the local queue (not yet handed to zmq)."""
        return len(self._link.queue)

    def send(self, msg: Message) -> bool:
        """Send or queue ``msg``; False (and ``dropped`` += 1) when the queue is full.

        Never blocks and never raises for transport reasons; an unencodable message is the
        caller's bug and raises ProtocolError.
        """
        link = self._link
        if link.state is not State.CLOSED:
            self._maybe_check_monitor()  # a pending "daemon gone / back" event applies first
            if link.queue:
                self._flush()  # keep order: nothing overtakes what is queued
        route = link.route()
        if route is Route.REFUSE:
            return False
        data = encode(msg)
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

    def attach(self, msg: Attach) -> None:
        """Remember ``msg``; send it now if a link is up, else as a new link's first frame."""
        self._attach_frame = encode(msg)
        if self._link.state is State.CLOSED:
            return
        self._run(self._link.handle(AttachRequested()))
        self._maybe_check_monitor()  # a fresh link's handshake sends it first

    def _raw_send(self, data: bytes) -> bool:
        self._sock_dirty = True
        try:
            self._sock.send(data, zmq.NOBLOCK)
        except zmq.ZMQError:  # Again (no peer / HWM) or a dying socket: never the caller's
            return False
        return True

    def _flush(self) -> None:
        """Hand queued frames to zmq while it takes them, if the link lets messages flow."""
        link = self._link
        if not link.flows:
            return
        q = link.queue
        while q and self._raw_send(q[0]):
            q.popleft()
            link.counters.sent += 1

    def _run(self, acts: tuple[Act, ...]) -> None:
        """Carry out the link machine's actions, in order, reporting send outcomes back."""
        link = self._link
        for a in acts:
            if a is Act.FLUSH:
                if link.queue:
                    self._flush()
            elif a is Act.SEND_ATTACH:
                if self._raw_send(self._attach_frame):
                    self._run(link.handle(AttachSent()))
            elif a is Act.SEND_HEARTBEAT:
                if self._raw_send(encode(Heartbeat(link.hb_seq))):
                    self._run(link.handle(HeartbeatSent(self._clock())))
            elif a is Act.RECHECK_LINK:
                self._mon_dirty = True  # safety net: re-read the monitor's EVENTS once per period
            elif a is Act.DROP_QUEUE:
                link.queue.clear()
            else:
                self._log(a)

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
        ready = bool(self._sock.poll(max(0, int(timeout_s * 1000)), zmq.POLLIN))
        # zmq_poll read EVENTS and so consumed the FD's edge: without this, the next poll()
        # would see a quiet FD, skip the drain, and leave the frame unread until some later
        # send happened to mark the socket dirty (the next heartbeat, up to heartbeat_s
        # away), while every wait() in between returned at once (a busy spin).
        self._sock_dirty = True
        return ready

    def poll(self) -> list[Message]:
        """Zero-timeout step: flush, heartbeat, drain replies; returns daemon->engine messages.

        HeartbeatAck is consumed here; everything else (AttachAck, Sent, SendFailed, Received,
        ReceiveFailed, Released, Error) comes back in arrival order.
        """
        link = self._link
        if link.state is State.CLOSED:
            return []
        now = self._clock()
        if self._fds.poll(0):
            self._sock_dirty = self._mon_dirty = True
        if self._mon_dirty:
            self._check_monitor()
        acts = link.tick(now)  # handle(Tick(now)), the hot path without the event object
        if acts:
            self._run(acts)
        out: list[Message] = []
        if self._sock_dirty:
            self._sock_dirty = False
            if self._sock.get(zmq.EVENTS) & zmq.POLLIN:
                self._drain(now, out)
        acts = link.drained(now)  # handle(Drained(now))
        if acts:
            self._run(acts)
        return out

    def _drain(self, now: float, out: list[Message]) -> None:
        sock = self._sock
        link = self._link
        self._sock_dirty = True  # recv may consume the FD edge; also set if MAX_DRAIN stops us
        for _ in range(MAX_DRAIN):
            try:
                frame = sock.recv(zmq.NOBLOCK)
            except zmq.ZMQError:
                return
            try:
                msg = decode(frame)
            except ProtocolError as e:
                link.counters.decode_errors += 1
                if link.counters.decode_errors == 1:
                    log.warning("kvpush: undecodable frame from daemon %s: %s", self.endpoint, e)
                continue
            t = type(msg)
            if t is HeartbeatAck:
                self._run(link.handle(HeartbeatAcked(msg.seq, msg.daemon_id, now)))
                continue
            if t is AttachAck:
                self._run(link.handle(AttachAcked(msg.daemon_id, msg.agent_name, now)))
            else:
                link.handle(Heard(now))  # no state changes with it: never an action
            out.append(msg)

    def _maybe_check_monitor(self) -> None:
        if self._mon_dirty or self._mon_fds.poll(0):
            self._check_monitor()

    def _check_monitor(self) -> None:
        """Apply pending connect/disconnect events (only call when _mon_dirty or FD fired)."""
        mon = self._mon
        self._mon_dirty = False
        if not mon.get(zmq.EVENTS) & zmq.POLLIN:
            return
        while True:
            try:
                frames = mon.recv_multipart(zmq.NOBLOCK)
            except zmq.ZMQError:
                return
            event = int.from_bytes(frames[0][:2], "little")
            if event == zmq.EVENT_DISCONNECTED:
                self._run(self._link.handle(Disconnected(self._clock())))
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                # Unthrottled command processing attaches the new pipe (queued before the
                # event), so the sends it triggers cannot fail for want of it; see module doc.
                self._sock.get(zmq.EVENTS)
                self._sock_dirty = True
                self._run(self._link.handle(Connected(self._clock())))

    # ---- teardown ------------------------------------------------------------------------

    def close(self) -> None:
        """Close both sockets at once (LINGER 0); later sends are refused, polls return []."""
        if self._link.state is State.CLOSED:
            return
        self._run(self._link.handle(Close()))
        try:
            self._sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self._mon.close(linger=0)
        self._sock.close(linger=0)

    def __enter__(self) -> DaemonClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
