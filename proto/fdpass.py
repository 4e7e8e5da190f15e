"""File descriptors on the engine link (SCM_RIGHTS): the carrier of VMM KV memory.

Designed for vLLM's VMM-backed KV cache (docs/gpu-memory.md): the engine exports each region
as a POSIX file descriptor (``cuMemExportToShareableHandle``) and sends the descriptors with
its Attach; the daemon imports and maps them. Not yet used by the link: the legacy CUDA IPC
export is what runs (``kv_cache_access``: LEGACY_IPC).

The contract, which both ends keep through this module only:

* descriptors travel only with a frame that declares how many it carries (the Attach's
  regions of kind ``cuda_vmm_fd``), sent no later than that frame's last byte (attached to its
  first bytes, at most :data:`MAX_FDS_PER_MSG` per ``sendmsg``);
* the receiver queues every descriptor as it arrives (:class:`FdQueue`), independent of frame
  boundaries (the kernel may deliver a descriptor-carrying message together with the tail of
  the frame before it), and a frame takes exactly the count it declares, in order, once it is
  whole. Fewer queued than declared, or more pending than the bound, is a protocol error:
  every queued descriptor is closed and the connection must be closed.
"""

from __future__ import annotations

import os
import socket
from collections import deque

from kvpush.proto.errors import ProtocolError
from kvpush.proto.stream import frame

__all__ = ["MAX_FDS_PER_MSG", "FdQueue", "FdsMissing", "recv_some", "send_frame_with_fds"]

MAX_FDS_PER_MSG = 253  # Linux's SCM_MAX_FD


class FdsMissing(ProtocolError):
    """A frame declared descriptors that did not come, or too many are pending: close."""


class FdQueue:
    """Descriptors received and not yet taken by a frame, oldest first; at most ``bound``."""

    __slots__ = ("_q", "bound")

    def __init__(self, bound: int) -> None:
        self._q: deque[int] = deque()
        self.bound = bound

    def __len__(self) -> int:
        return len(self._q)

    def add(self, fds: list[int]) -> None:
        self._q.extend(fds)
        if len(self._q) > self.bound:
            self.close_all()
            raise FdsMissing(f"more than {self.bound} descriptors pending without a frame that takes them")

    def take(self, n: int) -> list[int]:
        """The ``n`` descriptors of the frame just completed (the caller owns and closes them)."""
        if n > len(self._q):
            have = len(self._q)
            self.close_all()
            raise FdsMissing(f"a frame declared {n} descriptors, {have} came with it")
        return [self._q.popleft() for _ in range(n)]

    def close_all(self) -> None:
        while self._q:
            try:
                os.close(self._q.popleft())
            except OSError:
                pass


def send_frame_with_fds(sock: socket.socket, payload: bytes, fds: list[int]) -> None:
    """Send one frame with its descriptors (a blocking socket: this is start-up, once per
    Attach). The descriptors ride on the frame's first bytes, one byte per batch."""
    data = frame(payload)
    batches = [fds[i:i + MAX_FDS_PER_MSG] for i in range(0, len(fds), MAX_FDS_PER_MSG)]
    if len(batches) > len(data):
        raise ValueError("too many descriptors for one frame")
    sent = 0
    for batch in batches:
        sent += socket.send_fds(sock, [data[sent:sent + 1]], batch)
    if sent < len(data):
        sock.sendall(data[sent:])


def recv_some(sock: socket.socket, bufsize: int, fdq: FdQueue) -> bytes:
    """One ``recvmsg``: its bytes (b"": the peer closed) and its descriptors, queued."""
    data, fds, flags, _ = socket.recv_fds(sock, bufsize, MAX_FDS_PER_MSG)
    if flags & getattr(socket, "MSG_CTRUNC", 0):
        for fd in fds:
            os.close(fd)
        fdq.close_all()
        raise FdsMissing("descriptors were cut off (MSG_CTRUNC)")
    if fds:
        fdq.add(list(fds))
    return data
