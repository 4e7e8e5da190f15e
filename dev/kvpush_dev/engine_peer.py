"""Both ends of the engine link for tests: a stand-in daemon on the real listener, and a
one-shot raw client (bytes in, the reply frame out) for feeding a daemon bad input."""

from __future__ import annotations

import socket
import time

from kvpush.daemon.io.endpoints import bind_private_unix
from kvpush.daemon.io.enginelink import EngineListener
from kvpush.proto import (
    Abort,
    Attach,
    AttachAck,
    Heartbeat,
    HeartbeatAck,
    Message,
    Released,
    decode,
    encode,
)
from kvpush.proto.naming import ipc_path
from kvpush.proto.stream import HEADER, Deframer, frame

__all__ = ["FakeDaemon", "raw_request"]


class FakeDaemon:
    """The engine endpoint served by the daemon's own listener, answering Heartbeat and
    (optionally) Attach, and (``answer_aborts``) an Abort with Released as a daemon does for
    a transfer it does not hold; what else arrives is kept in order."""

    def __init__(self, endpoint: str, daemon_id: str, *, max_message: int = 64 << 20) -> None:
        self.listener = EngineListener(endpoint, bind=bind_private_unix(0o600), max_message=max_message)
        self.daemon_id = daemon_id
        self.answer_heartbeats = True
        self.answer_attach = True
        self.answer_aborts = False
        self.stream_min_tokens = 0  # what its HeartbeatAcks advise (layerwise auto)
        self.got: list[Message] = []  # everything but heartbeats, in arrival order
        self.heartbeats = 0
        self.kinds: list[str] = []  # type names of everything received, heartbeats included
        self.peer: bytes | None = None

    def serve(self) -> list[Message]:
        """Answer what has arrived; the messages other than heartbeats, in order."""
        new: list[Message] = []
        for inc in self.listener.receive():
            self.peer = inc.ident
            msg = decode(inc.payload)
            self.kinds.append(type(msg).__name__)
            if type(msg) is Heartbeat:
                self.heartbeats += 1
                if self.answer_heartbeats:
                    self.send(HeartbeatAck(msg.seq, self.daemon_id, self.stream_min_tokens))
                continue
            new.append(msg)
            if type(msg) is Attach and self.answer_attach:
                self.send(AttachAck("agent-" + self.daemon_id, self.daemon_id))
            elif type(msg) is Abort and self.answer_aborts:
                self.send(Released(msg.transfer_id, msg.attempt))
        self.got += new
        return new

    def send(self, msg: Message) -> None:
        self.send_raw(encode(msg))

    def send_raw(self, payload: bytes) -> None:
        assert self.peer is not None, "no client has spoken yet"
        assert self.listener.send(self.peer, payload), "the client's connection is gone"

    def close(self) -> None:
        self.listener.close()


def raw_request(endpoint: str, payload: bytes, timeout_s: float = 2.0, *,
                announce: int | None = None) -> bytes | None:
    """Send one frame of ``payload`` to an engine socket (with ``announce``: a header claiming
    that many bytes instead) and return the first reply frame; None if none came within
    ``timeout_s``; EOFError if the daemon closed the connection first."""
    path = ipc_path(endpoint)
    assert path is not None, endpoint
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout_s)
        s.connect(path)
        s.sendall(frame(payload) if announce is None else HEADER.pack(announce) + payload)
        reader = Deframer(64 << 20)
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            try:
                data = s.recv(1 << 16)
            except TimeoutError:
                return None
            except ConnectionResetError:
                data = b""
            if not data:
                raise EOFError("the daemon closed the connection")
            got = reader.feed(data)
            if got:
                return got[0]
    return None
