"""A daemon's card: the one fact a prefill engine must hand on to a decode engine by itself.

Behind a serial proxy (P answers first; its ``kv_transfer_params`` are forwarded verbatim to
D) the prefill engine must say where its KV can be fetched from: its daemons' peer endpoints.
Only the daemon knows that endpoint (``advertise_host`` and the bound port), and the
connector's scheduler half must not talk to the daemon. So each daemon writes a small card
next to its engine socket when it starts (and removes it when it stops), and the scheduler
half reads it: a local file, bounded in size and validated like any wire input.

    ipc:///run/kvpush/engine-0.sock  ->  /run/kvpush/engine-0.sock.card
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Callable
from dataclasses import asdict, dataclass

__all__ = ["CARD_SUFFIX", "MAX_CARD_BYTES", "DaemonCard", "card_path", "read_card", "remove_card", "write_card"]

CARD_SUFFIX = ".card"
MAX_CARD_BYTES = 4096
_ENDPOINT = re.compile(r"^tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.\-]{1,253}):(\d{1,5})$")


@dataclass(frozen=True)
class DaemonCard:
    """What a daemon publishes about itself to the engines of its node."""

    peer_endpoint: str  # where decode daemons reach it (tcp://advertise_host:port)
    daemon_id: str  # changes on every daemon restart
    node: str = ""  # its authenticated peer identity ("" with insecure_peers)

    def validate(self) -> None:
        m = _ENDPOINT.match(self.peer_endpoint)
        if not m or not 0 < int(m.group(2)) < 65536:
            raise ValueError(f"card: bad peer_endpoint {self.peer_endpoint!r}")
        if not isinstance(self.daemon_id, str) or not 0 < len(self.daemon_id) <= 64:
            raise ValueError("card: bad daemon_id")
        if not isinstance(self.node, str) or len(self.node) > 256:
            raise ValueError("card: bad node")


def card_path(engine_socket: str) -> str | None:
    """The card next to an ``ipc://`` engine socket (None for any other transport)."""
    if not engine_socket.startswith("ipc://"):
        return None
    return engine_socket[len("ipc://"):] + CARD_SUFFIX


def write_card(path: str, card: DaemonCard, mode: int = 0o600) -> None:
    """Atomically (write + rename): a reader never sees half a card."""
    card.validate()
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
    try:
        os.write(fd, json.dumps(asdict(card)).encode())
    finally:
        os.close(fd)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def read_card(path: str, check: Callable[[os.stat_result], str] | None = None) -> DaemonCard:
    """The card at ``path``; raises OSError (absent) or ValueError (malformed, or refused).

    Never blocks (a FIFO or device planted there is opened non-blocking and refused: only a
    regular file is read) and never follows a symlink. ``check``: the reader's trust rule on
    the opened file (its fstat), returning why it is refused or ``""``."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY)
    try:
        st = os.fstat(fd)
        why = check(st) if check is not None else ("" if stat.S_ISREG(st.st_mode) else "not a regular file")
        if why:
            raise ValueError(f"card {path}: {why}")
        raw = os.read(fd, MAX_CARD_BYTES + 1)
    finally:
        os.close(fd)
    if len(raw) > MAX_CARD_BYTES:
        raise ValueError(f"card {path}: over {MAX_CARD_BYTES} bytes")
    try:
        d = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"card {path}: not JSON") from exc
    if not isinstance(d, dict) or set(d) - {"peer_endpoint", "daemon_id", "node"}:
        raise ValueError(f"card {path}: unexpected fields")
    try:
        card = DaemonCard(**d)
    except TypeError as exc:
        raise ValueError(f"card {path}: {exc}") from exc
    if not isinstance(card.peer_endpoint, str):
        raise ValueError(f"card {path}: bad peer_endpoint")
    card.validate()
    return card


def remove_card(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
