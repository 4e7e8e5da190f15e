"""A bare NIXL agent for security tests: what a node holding some NIXL metadata can try.

Tests in tests/security play a compromised (allowlisted, or revoked) node with it: load the
metadata it was given, READ and WRITE at the addresses it was given, and report what NIXL
answered. No kvpush code on this path, so what it reaches is what NIXL/UCX allow.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import zmq

from kvpush import proto
from kvpush.daemon.trust.peerauth import PeerAuth
from kvpush.proto.layout import KVLayout

# UCX_TLS per medium: "shm,tcp" lets UCX take shared memory between processes of one host
# ("shm" alone cannot start a NIXL agent here: it needs TCP for its own wire-up).
MEDIA = {"shm": "shm,tcp", "tcp": "tcp"}


def agent(name: str) -> Any:
    """A NIXL agent with the UCX backend (progress and listener threads off, as kvpushd's)."""
    from nixl._api import nixl_agent, nixl_agent_config

    a = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=[]))
    a.create_backend("UCX", {})
    return a


def register(a: Any, buf: np.ndarray) -> Any:
    return a.register_memory(np.array([[buf.ctypes.data, buf.nbytes, 0]], dtype=np.uint64), "DRAM")


def xfer(a: Any, op: str, local: np.ndarray, remote_addr: int, peer: str, notif: bytes = b"",
         wait_s: float = 5.0) -> str:
    """One READ or WRITE of all of ``local`` at ``remote_addr``: "DONE", "PROC" (not done
    within ``wait_s``), "ERR", or the name of the exception NIXL raised."""
    loc = a.get_xfer_descs(np.array([[local.ctypes.data, local.nbytes, 0]], dtype=np.uint64), "DRAM")
    rem = a.get_xfer_descs(np.array([[remote_addr, local.nbytes, 0]], dtype=np.uint64), "DRAM")
    try:
        h = a.initialize_xfer(op, loc, rem, peer, notif)
        st = a.transfer(h)
        end = time.monotonic() + wait_s
        while st == "PROC" and time.monotonic() < end:
            st = a.check_xfer_state(h)
        a.release_xfer_handle(h)
        return st
    except Exception as e:  # NIXL refuses: no such agent, no registration, disconnected
        return type(e).__name__


class FakeProducer:
    """Node X as a compromised prefill node: a CURVE server with X's key that answers a decode
    daemon's Hello (keeping its NIXL metadata and region base) and refuses its registrations."""

    def __init__(self, keys: Any, host: str, layout: KVLayout, *, refuse: bool = True,
                 agent_name: str = "xagent", refuse_hello: bool = False) -> None:
        me = PeerAuth.load(keys.secret_file, keys.authorized_dir)
        self.s = zmq.Context.instance().socket(zmq.ROUTER)
        self.s.setsockopt(zmq.LINGER, 0)
        self.s.curve_server = True
        self.s.curve_publickey, self.s.curve_secretkey = me.me.public, me.secret
        port = self.s.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{host}:{port}"
        self.hellos: list[proto.Hello] = []
        self.registers: list[proto.PeerRegister] = []  # what the decode daemon asked of it (keys included)
        self.layout = layout
        self.refuse = refuse  # answer each registration WriteFailedNotice (else: keep it, write nothing)
        self.agent_name = agent_name  # what its Hello reply says its NIXL agent is
        self.refuse_hello = refuse_hello  # keep the Hello's metadata, answer it with a refusal
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def serve(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end and not self._stop.is_set():
            if not self.s.poll(50):
                continue
            ident, frame = self.s.recv_multipart()
            msg = proto.decode(frame)
            if isinstance(msg, proto.Hello) and not msg.reply and self.refuse_hello:
                self.hellos.append(msg)
                self.s.send_multipart([ident, proto.encode(proto.Error("handshake", "refused"))])
            elif isinstance(msg, proto.Hello) and not msg.reply:
                self.hellos.append(msg)
                lay_ = self.layout
                self.s.send_multipart([ident, proto.encode(proto.Hello(
                    self.agent_name, b"", lay_, (), proto.PROTOCOL_VERSION, lay_.compat_key(), "X", 0, 1,
                    self.endpoint, True))])
            elif isinstance(msg, proto.PeerRegister):
                self.registers.append(msg)
                if self.refuse:
                    self.s.send_multipart([ident, proto.encode(
                        proto.WriteFailedNotice(msg.transfer_id, msg.attempt, 0, "not writing"))])
            elif isinstance(msg, proto.Cancel):
                self.s.send_multipart([ident, proto.encode(proto.CancelConfirmed(msg.transfer_id, msg.attempt, 0))])
            elif isinstance(msg, proto.Heartbeat):
                self.s.send_multipart([ident, proto.encode(proto.HeartbeatAck(msg.seq, "x"))])

    def start(self) -> None:
        """Serve on a thread of its own (it alone touches the socket) until :meth:`close`:
        heartbeats answered, so the decode daemon's link to it stays alive."""
        self._thread = threading.Thread(target=self.serve, args=(1e9,), daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        self.s.close(0)
