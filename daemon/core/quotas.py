"""Per-peer quotas of the prefill side: how much of the rendezvous one decode peer may hold.

A "peer" is a certificate identity (a node) when peers are authenticated: every session a
node opens (one per decode daemon, plus any it opens to get around a quota) counts towards
one share, and the node may hold at most ``max_sessions_per_peer`` sessions. Without
authentication (``insecure_peers``) each session is its own peer.

Why: the rendezvous' capacity (``max_transfers``) and the memory of its registrations are
shared by every decode peer; without a share per peer, one of them fills it and every other
peer's transfers then fail "overloaded". Bounds come from configuration
(``max_transfers_per_peer``, ``max_blocks_per_peer``), the counts from the rendezvous itself
(:meth:`kvpush.daemon.core.rendezvous.Rendezvous.peer_held`, kept up to date per transition), so
they drop as that peer's transfers end and a check is O(1) per PeerRegister. Pure.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvpush.common.machine.core import Held


@dataclass(frozen=True)
class Quota:
    """One decode peer's share of this prefill daemon."""

    max_transfers: int  # live transfers it holds registrations in
    max_blocks: int  # block IDs it holds registered, all those transfers together


def refusal(quota: Quota, held: Held, stake: int | None, blocks: int) -> str:
    """Why registering ``blocks`` block IDs would take a peer over its quota, or ``""``.

    ``held``: what the peer holds now; ``stake``: the block IDs it holds in this very transfer
    (None: none, so the registration adds a transfer; else it replaces that stake).
    """
    transfers = held.records + (stake is None)
    total = held.units - (stake or 0) + blocks
    if transfers > quota.max_transfers:
        return (f"quota: this peer holds {held.records} live transfers "
                f"(max_transfers_per_peer {quota.max_transfers})")
    if total > quota.max_blocks:
        return (f"quota: {total} block IDs registered by this peer "
                f"(max_blocks_per_peer {quota.max_blocks})")
    return ""


def total(helds: Iterable[Held]) -> Held:
    """What one identity holds across its sessions."""
    records = units = 0
    for h in helds:
        records += h.records
        units += h.units
    return Held(records, units)


def session_refusal(sessions: int, cap: int) -> str:
    """Why one more session of an identity that holds ``sessions`` is refused, or ``""``."""
    if sessions >= cap:
        return f"quota: this peer holds {sessions} sessions (max_sessions_per_peer {cap})"
    return ""
