"""The NIXL notification a prefill daemon attaches to its WRITE: the format defined once.

NIXL delivers it to the decode daemon after the WRITE's bytes landed. It names the
transfer, the attempt (so a superseded attempt's late WRITE is never counted) and the
producer's TP rank (so each producer is counted once). Decoding is total: anything
malformed is ``None`` and is ignored by the receiver.
"""

from __future__ import annotations

from dataclasses import dataclass

NOTIF_PREFIX = b"kvp1"


@dataclass(frozen=True)
class Notification:
    transfer_id: str
    attempt: int
    producer_rank: int

    def encode(self) -> bytes:
        return b"|".join((NOTIF_PREFIX, self.transfer_id.encode(), str(self.attempt).encode(),
                          str(self.producer_rank).encode()))

    @staticmethod
    def decode(data: bytes) -> Notification | None:
        parts = data.split(b"|")
        if len(parts) < 4 or parts[0] != NOTIF_PREFIX:
            return None
        try:
            tid = b"|".join(parts[1:-2]).decode()
            attempt, rank = int(parts[-2]), int(parts[-1])
        except (UnicodeDecodeError, ValueError):
            return None
        if attempt < 0 or rank < 0:
            return None
        return Notification(tid, attempt, rank)
