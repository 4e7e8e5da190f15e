"""A completion counts only if the producer the rendezvous chose sent it (issue 44, item 1).

NIXL lets an agent take any name, and a producer the decode daemon D dialled holds D's NIXL
metadata: on version 4, insider X made an agent named as P's, WRITEs junk into D's region
with the notification of *P's* transfer, and D said Received before P wrote anything. Now D
gives each producer of each registration attempt a fresh key, over the CURVE-encrypted link
to it only (``PeerRegister.key``), and counts a notification only if it carries the
HMAC of (transfer, attempt, rank) under that key (:mod:`kvpush.proto.notif`). Anything else
(a forgery under P's name, a replay, a tag from another attempt) is refused, counted
(``kvpush_failures_total{cause="notification_forged"|"notification_replayed"}``) and a
live attempt fails cleanly: the engine recomputes, never decodes from blocks an impostor wrote.

Real daemons, CURVE and NIXL; X is played by this test with a real NIXL agent. Each test
sends what version 4 counted (the untagged ``kvp1`` notification) as well as the best
forgery X can make now, so each fails on a daemon without the fix (it says Received).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvpush import proto
from kvpush_dev.fleet import NODES, Fleet, fleet
from kvpush_dev.kvref import small_engine as lay
from kvpush_dev.nixl_probe import FakeProducer, agent, register, xfer
from kvpush_dev.prom import parse, total

pytestmark = pytest.mark.integration


def notif(tid: str, attempt: int, rank: int, key: bytes | None) -> bytes:
    """A notification as X can write it: untagged as version 4 took it (``key`` None), or tagged
    under ``key`` (the HMAC-SHA256 of the rest, hex), spelled out here rather than imported so
    that this file runs against a daemon of either version."""
    body = b"|".join((b"kvp1" if key is None else b"kvp2", tid.encode(), str(attempt).encode(), str(rank).encode()))
    return body if key is None else body + b"|" + hmac.new(key, body, hashlib.sha256).hexdigest().encode()


def refused(f: Fleet, why: str) -> float:
    return total(parse(f.d.ops("metrics")["text"]), "kvpush_failures_total", cause=f"notification_{why}") or 0.0


class Insider:
    """X: an allowlisted prefill node D dialled (so it holds D's metadata and region base), with
    NIXL agents of names of its choosing that load that metadata."""

    def __init__(self, f: Fleet, x: FakeProducer, stack: contextlib.ExitStack) -> None:
        self.f, self.x, self.stack = f, x, stack
        t = f"fx{os.getpid()}"
        f.de.send(proto.Register(t, 0, (10, 11), 20, (x.endpoint,), 1, 8000))
        if x.refuse:
            assert isinstance(f.de.result(t), proto.ReceiveFailed)
        else:
            self.wait(lambda: x.registers)
        assert x.hellos and x.hellos[0].agent_metadata, "D sent X no metadata"
        self.held = x.hellos[0]
        self.junk = np.full(4096, 0xAB, dtype=np.uint8)

    @staticmethod
    def wait(cond, timeout: float = 5.0) -> None:
        end = time.monotonic() + timeout
        while not cond() and time.monotonic() < end:
            time.sleep(0.02)
        assert cond()

    def agent(self, name: str) -> tuple[object, str]:
        a = agent(name)
        register(a, self.junk)
        self.stack.callback(lambda a=a: a)  # keep it alive while the fleet runs
        return a, a.add_remote_agent(self.held.agent_metadata)

    def write(self, a_peer: tuple[object, str], payload: bytes) -> None:
        """One WRITE of junk into D's region (block 0: never a destination here), with ``payload``."""
        a, peer = a_peer
        assert xfer(a, "WRITE", self.junk, self.held.region_bases[0], peer, payload) == "DONE"


@contextlib.contextmanager
def insider(tmp_path, *, refuse: bool = True) -> Iterator[tuple[Fleet, Insider]]:
    with fleet(tmp_path, x_allowed_by="d") as f, contextlib.ExitStack() as stack:
        x = stack.enter_context(contextlib.closing(FakeProducer(f.kx, NODES["x"][1], lay()[0], refuse=refuse)))
        x.start()
        assert isinstance(f.transfer((4, 5, 6)), proto.Received)  # P -> D works, P knows D
        yield f, Insider(f, x, stack)


def test_an_agent_carrying_the_producers_name_completes_nothing(tmp_path):
    """X names an agent as P's and notifies P's transfer before P wrote anything: never counted;
    the transfer fails (D cancels P, which confirms) and the next one from P is byte-exact."""
    with insider(tmp_path) as (f, x):
        pname = f.p.ops("status")["agent"]
        impostor = x.agent(pname)
        t = f"fp{os.getpid()}"
        f.de.send(proto.Register(t, 0, (7, 8, 9), 40, (f.p.peer_endpoint,), 1, 8000))
        time.sleep(0.3)  # P holds the registration; its engine has not prefilled
        x.write(impostor, notif(t, 0, 0, None))  # what version 4 counted
        x.write(impostor, notif(t, 0, 0, os.urandom(32)))  # a guessed key
        got = f.de.result(t, timeout=10)
        assert isinstance(got, proto.ReceiveFailed), f"a forged notification completed P's transfer: {got}"
        assert "forged notification" in got.reason, got.reason
        assert refused(f, "forged") >= 1
        f.pe.send(proto.PrefillDone(t, (1, 2, 3), 40, 8000))  # too late: cancelled, nothing is written
        assert isinstance(f.transfer((12, 13, 14)), proto.Received)


def test_a_replayed_notification_is_refused(tmp_path):
    """X is the producer D chose for a transfer (it got the key) and notifies it correctly:
    Received. The same notification again, or again for the next transfer, counts for nothing."""
    with insider(tmp_path, refuse=False) as (f, x):
        reg = x.x.registers[-1]
        key = getattr(reg, "key", b"")
        mine = x.agent(x.x.agent_name)
        x.write(mine, notif(reg.transfer_id, 0, 0, key) if key else notif(reg.transfer_id, 0, 0, None))
        assert isinstance(f.de.result(reg.transfer_id), proto.Received)
        before = refused(f, "replayed")
        tp = f"fq{os.getpid()}"  # D drives NIXL while it waits on a registration (P's, here)
        f.de.send(proto.Register(tp, 0, (7, 8, 9), 40, (f.p.peer_endpoint,), 1, 8000))
        time.sleep(0.3)
        x.write(mine, notif(reg.transfer_id, 0, 0, key or None))  # the same bytes again
        Insider.wait(lambda: refused(f, "replayed") > before)
        f.pe.send(proto.PrefillDone(tp, (1, 2, 3), 40, 8000))
        assert isinstance(f.de.result(tp), proto.Received)  # a replay of another transfer disturbs none
        # The next transfer X is chosen for gets a new key: the old notification, renamed, is forged.
        t = f"fr{os.getpid()}"
        f.de.send(proto.Register(t, 0, (20, 21), 20, (x.x.endpoint,), 1, 8000))
        Insider.wait(lambda: x.x.registers[-1].transfer_id == t)
        assert getattr(x.x.registers[-1], "key", b"") != key
        x.write(mine, notif(t, 0, 0, key or None))
        got = f.de.result(t, timeout=10)
        assert isinstance(got, proto.ReceiveFailed) and "forged" in got.reason, got


def test_another_attempts_key_completes_nothing(tmp_path):
    """Attempt 0 of a transfer went to X (it holds that attempt's key); attempt 1 went to P. X
    tags attempt 1's notification with attempt 0's key, under P's agent name: refused, and
    attempt 1 fails cleanly instead of being Received before P wrote."""
    with insider(tmp_path) as (f, x):
        t = f"fa{os.getpid()}"
        f.de.send(proto.Register(t, 0, (7, 8, 9), 40, (x.x.endpoint,), 1, 8000))
        assert isinstance(f.de.result(t), proto.ReceiveFailed)  # X refuses it; it holds the key anyway
        k0 = getattr(x.x.registers[-1], "key", b"")
        assert x.x.registers[-1].transfer_id == t
        impostor = x.agent(f.p.ops("status")["agent"])
        f.de.send(proto.Register(t, 1, (7, 8, 9), 40, (f.p.peer_endpoint,), 1, 8000))
        time.sleep(0.3)
        x.write(impostor, notif(t, 1, 0, None))
        x.write(impostor, notif(t, 1, 0, k0 or os.urandom(32)))
        got = f.de.result(t, timeout=10)
        assert isinstance(got, proto.ReceiveFailed) and got.attempt == 1, got
        assert refused(f, "forged") >= 1
