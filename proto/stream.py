"""The engine link's framing: length-prefixed frames on a local (AF_UNIX) stream socket.

Why not ZeroMQ for this link: libzmq hands every frame through an I/O thread on each side,
so one hop between two idle processes wakes three threads instead of one. Two such hops
(PrefillDone in, Received out) sit on every transfer's critical path and on TTFT. An engine's
round trip to its daemon after 50 ms idle took 1.4-1.5 ms over ZeroMQ and takes 0.8 ms over
this link (``scripts/bench_wake.py``, ``daemon_rtt_us``).

One frame is a 4-byte big-endian length and then that many bytes: one msgpack message
(:mod:`kvpush.proto.codec`). Both ends, the daemon's listener
(:mod:`kvpush.daemon.enginelink`) and the engine's client
(:mod:`kvpush.engine_plugin.client`), frame and deframe through this module only.

:class:`Deframer` is sans-IO: bytes in, whole frames out. A length over the receiver's bound
raises before a byte of that frame is buffered (the bound is the receiver's configuration,
never the sender's word), and the connection must then be closed: after a bad length the
stream has no frame boundary left to resync on.
"""

from __future__ import annotations

import struct

from kvpush.proto.errors import ProtocolError

__all__ = ["HEADER", "Deframer", "FrameTooLarge", "frame"]

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
