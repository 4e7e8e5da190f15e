"""The NIXL notification a prefill daemon attaches to its WRITE: the format defined once.

NIXL delivers it to the decode daemon after the WRITE's bytes landed. It names the
transfer, the attempt (so a superseded attempt's late WRITE is never counted) and the
producer's TP rank (so each producer is counted once), and carries ``tag``: an
HMAC-SHA256, under the key the decode daemon gave that producer for that registration
(``PeerRegister.key``, sent only to it over the CURVE-encrypted peer link), of everything
else it says. NIXL lets the sender choose its agent name, so the name proves nothing; the
tag proves the producer the decode side registered with sent it, for this transfer and
this attempt (issue 44, item 1). Decoding is total: anything malformed is ``None`` and is
ignored by the receiver; :func:`authentic` is the check, pure, in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

NOTIF_PREFIX = b"kvp2"  # kvp1: no tag (protocol version 4)
KEY_BYTES = 32  # a registration's notification key (PeerRegister.key)
TAG_HEX = 64  # the tag on the wire: HMAC-SHA256, hex


def _body(transfer_id: str, attempt: int, producer_rank: int) -> bytes:
    return b"|".join((NOTIF_PREFIX, transfer_id.encode(), str(attempt).encode(), str(producer_rank).encode()))


def tag(key: bytes, transfer_id: str, attempt: int, producer_rank: int) -> str:
    """The tag a notification of (transfer, attempt, producer rank) carries under ``key``."""
    return hmac.new(key, _body(transfer_id, attempt, producer_rank), hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class Notification:
    transfer_id: str
    attempt: int
    producer_rank: int
    tag: str = ""  # see the module docstring; "" never verifies

    @staticmethod
    def signed(key: bytes, transfer_id: str, attempt: int, producer_rank: int) -> Notification:
        """The notification a producer holding ``key`` sends for this (transfer, attempt)."""
        return Notification(transfer_id, attempt, producer_rank, tag(key, transfer_id, attempt, producer_rank))

    def encode(self) -> bytes:
        return _body(self.transfer_id, self.attempt, self.producer_rank) + b"|" + self.tag.encode()

    @staticmethod
    def decode(data: bytes) -> Notification | None:
        parts = data.split(b"|")
        if len(parts) < 5 or parts[0] != NOTIF_PREFIX:
            return None
        try:
            tid = b"|".join(parts[1:-3]).decode()
            attempt, rank = int(parts[-3]), int(parts[-2])
            mac = parts[-1].decode("ascii")
        except (UnicodeDecodeError, ValueError):
            return None
        if attempt < 0 or rank < 0 or len(mac) != TAG_HEX or not all(c in "0123456789abcdef" for c in mac):
            return None
        return Notification(tid, attempt, rank, mac)


def authentic(key: bytes, n: Notification) -> bool:
    """Was ``n`` tagged under ``key``? (False for an empty key: nothing was agreed.)"""
    return bool(key) and hmac.compare_digest(n.tag, tag(key, n.transfer_id, n.attempt, n.producer_rank))
