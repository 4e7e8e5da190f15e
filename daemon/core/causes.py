"""Why a daemon core's action fails or finishes: the closed vocabulary of its failures."""

from __future__ import annotations

import enum


class Cause(enum.StrEnum):
    """Why an action fails or finishes: a closed vocabulary next to the human ``reason``, so
    callers count timeouts or peer losses without matching strings."""

    OK = "ok"  # not a failure (e.g. ReleaseBlocks ok=True)
    INVALID = "invalid"  # malformed or inconsistent registration, or one already past its deadline
    SUPERSEDED = "superseded"  # a newer attempt of the same transfer exists
    CLOSED = "closed"  # the attempt or transfer already ended; nothing more will be written
    MISMATCH = "mismatch"  # num_tokens of a registration and of the prefill differ
    TIMEOUT = "timeout"  # a deadline passed while waiting (prefill, notifications)
    LEASE_EXPIRED = "lease_expired"  # prefill side: held blocks waited too long for registrations
    UNCLAIMED = "unclaimed"  # prefill side: the lease ended and no decode side ever registered
    WRITE_FAILED = "write_failed"  # the transport gave up on a WRITE
    WRITE_TIMEOUT = "write_timeout"  # a posted WRITE did not finish in time (it may still land)
    PEER_LOST = "peer_lost"  # the peer daemon is gone
    ABORTED = "aborted"  # the local engine or an operator aborted
    CANCELLED = "cancelled"  # the peer cancelled
    PRODUCER_FAILED = "producer_failed"  # decode side: a producer said it will not write
    OVERLOADED = "overloaded"  # the core holds max_live records
    QUOTA = "quota"  # prefill side: the registering peer would go over its share
    UNBOUND = "unbound"  # prefill side: the transfer is bound to another party (identity or secret)
    FORGED = "forged"  # decode side: a notification not from the chosen producer (bad tag, or a replay)
