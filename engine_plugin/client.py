"""Non-blocking client from a vLLM engine to its local kvpush daemon (one per accelerator).

It runs on vLLM's engine loop, so nothing here may block or raise for transport reasons:
every send is ``zmq.NOBLOCK`` with a bounded local queue behind it, every receive is a
zero-timeout drain inside :meth:`DaemonClient.poll`, and there are no threads (libzmq's own
I/O thread does the socket work).

Links and re-attach. The socket monitor (read without blocking) is the one source of truth
for the link: nothing at all (Attach, Heartbeat, queued messages) is sent before its
``HANDSHAKE_SUCCEEDED`` was read, so every link starts with ``Attach`` and the daemon never
sees an engine message from an engine it does not know. ``Attach`` goes out exactly once per
link, and again on the same link only when

* a ``HeartbeatAck`` carries a ``daemon_id`` other than the one seen on this link (a restart
  the monitor could not see), or
* the daemon answers again after it was declared unavailable for silence (it may have lost
  what it knew of us; a repeated identical Attach is a no-op for the daemon).

Why the socket is told to process its commands right after the handshake event: libzmq
attaches the new pipe to the socket by a command queued just before it emits the event, and a
``NOBLOCK`` send only looks at pending commands about once a millisecond (command
throttling), so a send right after the event could fail with EAGAIN and the link's first
Attach and Heartbeat would never go out. An unsent Attach is also retried on every poll.

While an ``Attach`` is remembered but not acknowledged, other messages wait in the local
queue; they flush when ``AttachAck`` arrives. A dropped connection makes the daemon
unavailable at once (its in-flight work died with it); a connected but silent daemon becomes
unavailable after ``dead_after_s``. Each transition to unavailable is logged once.
"""

from __future__ import annotations

import logging
import select
import time
from collections import deque
from collections.abc import Callable, Iterable

import zmq

from kvpush.proto import (
    Abort,
    Attach,
    AttachAck,
    Heartbeat,
    HeartbeatAck,
    Message,
    PrefillDone,
    ProtocolError,
    Register,
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

        # Public state, updated by poll() (and by send() for monitor events).
        self.available = False
        self.attached = False
        self.daemon_id: str | None = None
        self.agent_name: str | None = None
        self.unavailable_since: float | None = clock()
        self.rtt_s: float | None = None  # last heartbeat round trip
        # Counters.
        self.sent = 0  # frames handed to zmq (engine messages; heartbeats excluded)
        self.dropped = 0  # send() refusals: local queue full or client closed
        self.decode_errors = 0
        self.received = 0
        self.heartbeats = 0
        self.reattaches = 0

        self._queue: deque[bytes] = deque()
        self._attach: Attach | None = None
        self._attach_frame = b""
        self._attach_sent = False  # the remembered Attach went out on the current link
        self._attach_sends = 0  # of the current Attach; beyond the first are re-attaches
        self._reattach_on_ack = False  # went silent on a live link: re-attach when it answers
        self._link_up = False  # the monitor's HANDSHAKE_SUCCEEDED read, no DISCONNECTED since
        self._link_daemon_id: str | None = None  # daemon_id heard on the current link
        self._last_heard: float | None = None
        self._started = self.unavailable_since
        self._ever_available = False
        self._warned_never = False
        self._hb_seq = 0
        self._hb_sent_at: dict[int, float] = {}
        self._next_hb = self._started
        self._closed = False

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

    # ---- sending -------------------------------------------------------------------------

    @property
    def queued(self) -> int:
        """Messages waiting in the local queue (not yet handed to zmq)."""
        return len(self._queue)

    def send(self, msg: Message) -> bool:
        """Send or queue ``msg``; False (and ``dropped`` += 1) when the queue is full.

        Never blocks and never raises for transport reasons; an unencodable message is the
        caller's bug and raises ProtocolError.
        """
        if self._closed:
            self.dropped += 1
            return False
        self._maybe_check_monitor()  # a pending "daemon gone / back" event applies first
        if self._queue:
            self._try_flush()  # keep order: nothing overtakes what is queued
        if self._queue or not self._link_up or not self._ready():
            if len(self._queue) >= self.max_queue:
                self.dropped += 1  # refused before encoding: the full-queue path stays cheap
                return False
            self._queue.append(encode(msg))
            return True
        data = encode(msg)
        if self._raw_send(data):
            self.sent += 1
            return True
        if len(self._queue) >= self.max_queue:
            self.dropped += 1
            return False
        self._queue.append(data)
        return True

    def publish_register(
        self,
        transfer_id: str,
        attempt: int,
        block_ids: Iterable[int],
        num_tokens: int,
        prefill_endpoints: Iterable[str],
        prefill_tp_size: int,
        timeout_ms: int,
    ) -> bool:
        """Decode side: these blocks wait for the transfer's KV (see proto Register)."""
        return self.send(
            Register(
                transfer_id,
                attempt,
                tuple(block_ids),
                num_tokens,
                tuple(prefill_endpoints),
                prefill_tp_size,
                timeout_ms,
            )
        )

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
        self._attach = msg
        self._attach_frame = encode(msg)
        self.attached = False
        self._attach_sent = False
        self._attach_sends = 0  # a new Attach, not a re-attach
        if not self._closed:
            self._maybe_check_monitor()  # a fresh link's handler sends it already
            if self._link_up and not self._attach_sent:
                self._send_attach()

    def discard_queued(self) -> int:
        """Drop everything in the local queue (e.g. loads already failed); returns how many."""
        n = len(self._queue)
        self._queue.clear()
        return n

    def _ready(self) -> bool:
        """May ordinary messages go out now? Not before the daemon acknowledged our Attach."""
        return self._attach is None or self.attached

    def _raw_send(self, data: bytes) -> bool:
        self._sock_dirty = True
        try:
            self._sock.send(data, zmq.NOBLOCK)
        except zmq.ZMQError:  # Again (no peer / HWM) or a dying socket: never the caller's
            return False
        return True

    def _try_flush(self) -> bool:
        """Hand queued frames to zmq while it takes them; True if room was made."""
        if not self._queue or not self._link_up or not self._ready():
            return False
        n = len(self._queue)
        q = self._queue
        while q and self._raw_send(q[0]):
            q.popleft()
            self.sent += 1
        return len(q) < n

    def _send_attach(self) -> None:
        """Only call with a link up: the frame must land on the link it is meant for."""
        if self._attach is not None and self._raw_send(self._attach_frame):
            self._attach_sent = True
            self._attach_sends += 1
            if self._attach_sends > 1:
                self.reattaches += 1

    def _send_heartbeat(self, now: float) -> None:
        self._next_hb = now + self.heartbeat_s
        self._mon_dirty = True  # safety net: re-read the monitor's EVENTS once per period
        if not self._link_up:
            return  # nothing may precede a link's Attach; its handshake sends one at once
        self._hb_seq += 1
        if self._raw_send(encode(Heartbeat(self._hb_seq))):
            self.heartbeats += 1
            if len(self._hb_sent_at) > 64:  # acks lost with a dead daemon: keep it bounded
                self._hb_sent_at.clear()
            self._hb_sent_at[self._hb_seq] = now

    # ---- receiving -----------------------------------------------------------------------

    def wait(self, timeout_s: float) -> bool:
        """Block up to ``timeout_s`` for a frame from the daemon; True if one is readable.

        Only for the plugin's idle steps (no forward scheduled): it replaces vLLM's busy
        spin with a bounded sleep that any daemon message ends at once.
        """
        if self._closed:
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
        if self._closed:
            return []
        now = self._clock()
        if self._fds.poll(0):
            self._sock_dirty = self._mon_dirty = True
        if self._mon_dirty:
            self._check_monitor()
        if self._link_up and not self._attach_sent and self._attach is not None:
            self._send_attach()  # the handshake's send failed (HWM): Attach still goes first
        if self._queue:
            self._try_flush()
        if now >= self._next_hb:
            self._send_heartbeat(now)
        out: list[Message] = []
        if self._sock_dirty:
            self._sock_dirty = False
            if self._sock.get(zmq.EVENTS) & zmq.POLLIN:
                self._drain(now, out)
                if self._queue:
                    self._try_flush()  # an AttachAck may just have opened the gate
        self._update_liveness(now)
        return out

    def _drain(self, now: float, out: list[Message]) -> None:
        sock = self._sock
        self._sock_dirty = True  # recv may consume the FD edge; also set if MAX_DRAIN stops us
        for _ in range(MAX_DRAIN):
            try:
                frame = sock.recv(zmq.NOBLOCK)
            except zmq.ZMQError:
                return
            try:
                msg = decode(frame)
            except ProtocolError as e:
                self.decode_errors += 1
                if self.decode_errors == 1:
                    log.warning("kvpush: undecodable frame from daemon %s: %s", self.endpoint, e)
                continue
            self.received += 1
            self._last_heard = now
            if type(msg) is HeartbeatAck:
                self._on_heartbeat_ack(msg, now)
                continue
            if type(msg) is AttachAck:
                self.attached = True
                self._reattach_on_ack = False  # it knows us: a slow Attach is not a silence
                self.daemon_id = self._link_daemon_id = msg.daemon_id
                self.agent_name = msg.agent_name
            out.append(msg)

    def _on_heartbeat_ack(self, ack: HeartbeatAck, now: float) -> None:
        sent_at = self._hb_sent_at.pop(ack.seq, None)
        if sent_at is not None:
            self.rtt_s = now - sent_at
        # Compared with this link's id only: a new link to a restarted daemon was attached by
        # its handshake already, and its first ack must not re-attach a second time.
        restarted = self._link_daemon_id is not None and ack.daemon_id != self._link_daemon_id
        self.daemon_id = self._link_daemon_id = ack.daemon_id
        if self._attach is None or not self._link_up:
            return
        if restarted or self._reattach_on_ack:
            if restarted:
                log.warning("kvpush: daemon %s restarted (id %s); re-attaching",
                            self.endpoint, ack.daemon_id)
            self._reattach_on_ack = False
            self.attached = False
            self._attach_sent = False
            self._send_attach()

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
                self._link_up = False
                self.attached = False
                self._attach_sent = False
                self._reattach_on_ack = False
                self._link_daemon_id = None
                self._last_heard = None  # the daemon's state died with the link
                self._hb_sent_at.clear()
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._link_up = True
                self.attached = False
                self._attach_sent = False
                self._reattach_on_ack = False
                self._link_daemon_id = None
                # Unthrottled command processing attaches the new pipe (queued before the
                # event), so the sends below cannot fail for want of it; see module doc.
                self._sock.get(zmq.EVENTS)
                self._sock_dirty = True
                if self._attach is not None:
                    self._send_attach()  # first on the new link, before anything queued
                self._send_heartbeat(self._clock())  # learn the daemon_id now

    # ---- liveness ------------------------------------------------------------------------

    def _heard_recently(self, now: float) -> bool:
        """Silence is only proven by a heartbeat left unanswered for ``dead_after_s``.

        An idle engine does not step, so it neither polls nor sends heartbeats; a long
        gap since the last message then says nothing about the daemon.
        """
        if self._last_heard is None:
            return False
        if now - self._last_heard <= self.dead_after_s:
            return True
        oldest = min(self._hb_sent_at.values(), default=None)
        return oldest is None or now - oldest <= self.dead_after_s

    def _update_liveness(self, now: float) -> None:
        alive = self._link_up and self._heard_recently(now)
        if alive == self.available:
            if not alive and not self._ever_available and not self._warned_never:
                if now - self._started > self.dead_after_s:
                    self._warned_never = True
                    log.warning("kvpush: daemon at %s has not answered for %.1f s",
                                self.endpoint, now - self._started)
            return
        self.available = alive
        if alive:
            self._ever_available = True
            self.unavailable_since = None
            log.info("kvpush: daemon at %s available (id %s)", self.endpoint, self.daemon_id)
        else:
            self.unavailable_since = now
            # Whatever the daemon knew of us may be gone: re-attach on its next ack (a dropped
            # link re-attaches on its next handshake instead).
            self.attached = False
            self._reattach_on_ack = self._link_up
            log.warning(
                "kvpush: daemon at %s unavailable (%s)",
                self.endpoint,
                "connection lost" if not self._link_up else
                f"silent for more than {self.dead_after_s:.1f} s",
            )

    # ---- teardown ------------------------------------------------------------------------

    def close(self) -> None:
        """Close both sockets at once (LINGER 0); later sends are refused, polls return []."""
        if self._closed:
            return
        self._closed = True
        self.available = False
        self.attached = False
        try:
            self._sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self._mon.close(linger=0)
        self._sock.close(linger=0)
        self._queue.clear()

    def __enter__(self) -> DaemonClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
