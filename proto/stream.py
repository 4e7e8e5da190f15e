"""The engine link's framing: length-prefixed frames on a local (AF_UNIX) stream socket.

Why not ZeroMQ for this link: libzmq hands every frame through an I/O thread on each side,
so one hop between two idle processes wakes three threads instead of one. Two such hops
(PrefillDone in, Received out) sit on every transfer's critical path and on TTFT. An engine's
round trip to its daemon after 50 ms idle took 1.4-1.5 ms over ZeroMQ and takes 0.8 ms over
this link (``scripts/bench_wake.py``, ``daemon_rtt_us``).

One frame is a 4-byte big-endian length and then that many bytes: one msgpack message
(:mod:`kvpush.proto.codec`). Both ends, the daemon's listener
(:mod:`kvpush.daemon.io.enginelink`) and the engine's client
(:mod:`kvpush.engine_plugin.link.client`), frame, deframe and buffer unsent frames through this
module only.

:class:`Deframer` is sans-IO: bytes in, whole frames out. A length over the receiver's bound
raises before a byte of that frame is buffered (the bound is the receiver's configuration,
never the sender's word), and the connection must then be closed: after a bad length the
stream has no frame boundary left to resync on. :class:`Outbox` holds what a non-blocking
socket did not take; the socket is the caller's, and so is the policy when it is full (the
daemon drops a connection whose engine stops reading, the engine keeps the message in its
link's queue).
"""

from __future__ import annotations

import enum
import socket
import struct

from kvpush.proto.errors import ProtocolError

__all__ = ["HEADER", "Deframer", "FrameTooLarge", "Outbox", "Put", "frame"]

HEADER = struct.Struct("!I")


class FrameTooLarge(ProtocolError):
    """A frame announced more bytes than the receiver accepts; close the connection."""


def frame(payload: bytes) -> bytes:
    """One frame: the length prefix and ``payload``."""
    return HEADER.pack(len(payload)) + payload


class Deframer:
    """Reassembles frames from stream chunks, each at most ``max_frame`` bytes long."""

    __slots__ = ("_buf", "max_frame")

    def __init__(self, max_frame: int) -> None:
        if max_frame <= 0:
            raise ValueError("max_frame must be positive")
        self.max_frame = max_frame
        self._buf = bytearray()

    @property
    def buffered(self) -> int:
        """Bytes held of frames not yet complete."""
        return len(self._buf)

    def feed(self, data: bytes | bytearray | memoryview) -> list[bytes]:
        """The frames ``data`` completes, in order; FrameTooLarge on a length over the bound
        (frames completed before it in the same chunk are lost with the connection)."""
        buf = self._buf
        buf += data
        out: list[bytes] = []
        pos, end, hs = 0, len(buf), HEADER.size
        while end - pos >= hs:
            (n,) = HEADER.unpack_from(buf, pos)
            if n > self.max_frame:
                buf.clear()
                raise FrameTooLarge(f"frame of {n} bytes exceeds the bound of {self.max_frame}")
            if end - pos - hs < n:
                break
            out.append(bytes(buf[pos + hs:pos + hs + n]))
            pos += hs + n
        if pos:
            del buf[:pos]
        return out


class Put(enum.Enum):
    """What :meth:`Outbox.put` did with a frame."""

    TAKEN = "taken"  # sent, or its unsent tail kept: it will go out whole, in order
    FULL = "full"  # not a byte of it sent: frames already wait and it would pass the bound
    DEAD = "dead"  # the socket failed: drop the connection


class Outbox:
    """Frames a non-blocking stream socket has not taken yet, in order.

    A frame is either refused whole (:attr:`Put.FULL`, nothing of it on the wire) or taken
    whole, so the stream never carries half a frame. The bound applies to frames queued
    behind unsent bytes: the first unsent tail is always kept, so the buffer holds at most
    ``limit`` plus one frame.
    """

    __slots__ = ("_buf", "limit")

    def __init__(self, limit: int) -> None:
        if limit <= 0:
            raise ValueError("limit must be positive")
        self.limit = limit
        self._buf = bytearray()

    def __len__(self) -> int:
        return len(self._buf)

    def put(self, sock: socket.socket, data: bytes) -> Put:
        """Send one framed message ``data`` now, or keep what the socket did not take."""
        buf = self._buf
        if buf:
            if len(buf) + len(data) > self.limit:
                return Put.FULL
            buf += data
            return Put.TAKEN
        try:
            n = sock.send(data)
        except (BlockingIOError, InterruptedError):
            n = 0
        except OSError:
            return Put.DEAD
        if n < len(data):
            buf += memoryview(data)[n:]
        return Put.TAKEN

    def flush(self, sock: socket.socket) -> bool:
        """Send what waits, as far as the socket takes it; False if the socket failed."""
        buf = self._buf
        while buf:
            try:
                n = sock.send(buf)
            except (BlockingIOError, InterruptedError):
                return True
            except OSError:
                return False
            del buf[:n]
        return True

    def clear(self) -> None:
        self._buf.clear()
