"""Nodes on loopback, each with a CURVE key of its own: the authenticated prefill/decode pair
the security tests and the rotation benchmark start the same way, and a CURVE client to
speak to a daemon's peer port as another node would.

P is a prefill node on 127.0.0.1, D a decode node on 127.0.0.2 (each allowlists the other),
X a third node on 127.0.0.3 that the caller plays (a key only; ``x_allowed_by`` says which
daemons allowlist it). Loopback addresses stand for hosts: a certificate lists its node's.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

from kvpush import proto
from kvpush.proto.layout import KVLayout
from kvpush_dev.daemon_harness import Daemon, Engine, device_config, engines
from kvpush_dev.keys import LabKeys, allow, lab_keys
from kvpush_dev.kvref import small_layout

NODES = {"p": ("pnode", "127.0.0.1"), "d": ("dnode", "127.0.0.2"), "x": ("xnode", "127.0.0.3")}


def node_keys(tmp: Path, node: str) -> LabKeys:
    """Node ``node``'s (``p``, ``d`` or ``x``) key pair under ``tmp``, its certificate naming its host."""
    name, host = NODES[node]
    return lab_keys(tmp / node.upper(), name, (host,))


@dataclass
class Fleet:
    p: Daemon
    d: Daemon
    pe: Engine  # P's engine: random KV
    de: Engine  # D's engine: zeros
    kp: LabKeys
    kd: LabKeys
    kx: LabKeys | None

    def transfer(self, dst: Sequence[int] = (4, 5, 6), **kw: Any) -> Any:
        """P -> D: :func:`transfer` between this fleet's engines."""
        return transfer(self.p, self.pe, self.de, dst, **kw)


_ids = itertools.count()


def transfer(p: Daemon, pe: Engine, de: Engine, dst: Sequence[int] = (4, 5, 6), *, t: str = "",
             src: Sequence[int] = (1, 2, 3), n: int = 40, timeout: float = 20.0) -> Any:
    """One transfer at once from ``pe`` (on ``p``) to ``de``: the decode engine registers
    ``dst``, the prefill engine has prefilled ``src``; the decode engine's answer (Received or
    ReceiveFailed). ``t``: the transfer ID (a fresh one by default)."""
    t = t or f"f{os.getpid()}-{next(_ids)}"
    de.send(proto.Register(t, 0, tuple(dst), n, (p.peer_endpoint,), 1, 8000))
    pe.send(proto.PrefillDone(t, tuple(src), n, 8000))
    return de.result(t, timeout=timeout)


@contextmanager
def fleet(tmp: Path, *, x_allowed_by: str = "", env: dict[str, str] | None = None,
          layout: KVLayout | None = None, seed: int = 3, p_cfg: dict[str, Any] | None = None) -> Iterator[Fleet]:
    """P and D running, each with an engine attached; X's key made when ``x_allowed_by``
    (``"d"``, ``"pd"``) names the daemons that allowlist it. ``env`` goes to both daemons
    (e.g. ``UCX_TLS``); ``p_cfg``: P's configuration keys beyond the defaults. Everything
    stops on exit, whatever failed."""
    lay = layout or small_layout()
    kp, kd = node_keys(tmp, "p"), node_keys(tmp, "d")
    kx = node_keys(tmp, "x") if x_allowed_by else None
    extra = {k: [kx] if kx and k in x_allowed_by else [] for k in "pd"}
    allow(kp, kd, *extra["p"])
    allow(kd, kp, *extra["d"])
    with ExitStack() as stack:
        p = stack.enter_context(Daemon(device_config(tmp, 0, **kp.config(), **(p_cfg or {})), env=env))
        host = NODES["d"][1]
        d = stack.enter_context(Daemon(device_config(tmp, 1, peer_host=host, advertise_host=host, **kd.config()),
                                       env=env))
        pe, de = stack.enter_context(engines(p, d, lay, seed=seed))
        yield Fleet(p, d, pe, de, kp, kd, kx)


def curve_client(endpoint: str, server_public: bytes, keys: tuple[bytes, bytes] | None) -> zmq.Socket:
    """A DEALER to a daemon's peer port, as a node holding ``keys`` (None: no key at all)."""
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        s.curve_publickey, s.curve_secretkey = keys
        s.curve_serverkey = server_public
    s.connect(endpoint)
    return s


def ask(s: zmq.Socket, msg: object, timeout_s: float = 3.0) -> object | None:
    """The reply, or None when there is none, or no session to send on at all (a DEALER has
    nowhere to put a message until a handshake completed: CURVE refused it)."""
    end = time.monotonic() + timeout_s
    while True:
        try:
            s.send(proto.encode(msg), zmq.NOBLOCK)
            break
        except zmq.Again:
            if time.monotonic() > end:
                return None
            time.sleep(0.05)
    return proto.decode(s.recv()) if s.poll(max(1, int((end - time.monotonic()) * 1000))) else None
