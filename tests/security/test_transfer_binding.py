"""A transfer ID is no bearer credential (issue 28, item 3): real kvpushd, ZeroMQ CURVE and
NIXL. Node P prefills; node D is the decode side the request is bound to; node X is another
allowlisted decode node that learnt the transfer ID (an insider, one compromised host).

Finding: X registered the ID first, became the owner, received the prefill KV into its memory,
and the real decode side timed out. Asserted here:

* the router's concurrent mode (the prefill bound to D's node, and a secret): X registers
  first and still gets zero bytes and a refusal; D, registering after it, gets the KV byte for
  byte (X does not lock it out);
* a serial front (the prefill answers first, its answer carries the transfer's secret): X
  without the secret, or with a wrong one, is refused and written nothing; D with it gets the
  KV;
* the documented limit of serial mode: whoever holds the secret is the decode side. X with
  the secret, registering first, gets the KV, and D is then refused (never a mixed write).
"""

from __future__ import annotations

import itertools
import os
import time

import numpy as np
import pytest

from kvpush import proto
from kvpush_dev.daemon_harness import Daemon, Engine, device_config
from kvpush_dev.keys import allow, lab_keys
from kvpush_dev.kvref import reference_copy
from kvpush_dev.kvref import small_engine as _lay
from kvpush_dev.nixl_probe import MEDIA

pytestmark = pytest.mark.integration

_ids = itertools.count()
N = 40  # tokens: 3 blocks of 16
SRC, D_BLOCKS, X_BLOCKS = (1, 2, 3), (4, 5, 6), (7, 8, 9)


def tid() -> str:
    return f"b{os.getpid()}-{next(_ids)}"


@pytest.fixture(params=list(MEDIA))
def fleet(tmp_path, monkeypatch, request):
    """P, D and X over one UCX medium (shared memory with TCP, or TCP alone)."""
    env = {"UCX_TLS": MEDIA[request.param]}
    monkeypatch.setenv("UCX_TLS", env["UCX_TLS"])
    kp = lab_keys(tmp_path / "P", "pnode", ("127.0.0.1",))
    kd = lab_keys(tmp_path / "D", "dnode", ("127.0.0.2",))
    kx = lab_keys(tmp_path / "X", "xnode", ("127.0.0.3",))
    allow(kp, kd, kx)
    allow(kd, kp)
    allow(kx, kp)
    p = Daemon(device_config(tmp_path, 0, **kp.config()), env=env)
    d = Daemon(device_config(tmp_path, 1, peer_host="127.0.0.2", advertise_host="127.0.0.2", **kd.config()), env=env)
    x = Daemon(device_config(tmp_path, 2, peer_host="127.0.0.3", advertise_host="127.0.0.3", **kx.config()), env=env)
    lay, meta = _lay()
    pe = Engine(p, lay, "prefill", seed=3)
    de, xe = Engine(d, lay, "decode", fill="zeros"), Engine(x, lay, "decode", fill="zeros")
    try:
        for e in (de, xe):  # a session with P each (as any working decode node has), unbound
            t = tid()
            e.send(proto.Register(t, 0, (30,), 16, (p.peer_endpoint,), 1, 10_000))
            pe.send(proto.PrefillDone(t, (31,), 16, 10_000))
            assert isinstance(e.result(t), proto.Received) and isinstance(pe.result(t), proto.Sent)
        e_before = {id(e): e.bytes.copy() for e in (de, xe)}
        yield p, pe, de, xe, lay, meta, e_before
    finally:
        for e in (pe, de, xe):
            e.close()
        for dm in (p, d, x):
            dm.stop()


def _register(e: Engine, p: Daemon, t: str, blocks: tuple[int, ...], secret: str = "", attempt: int = 0) -> None:
    e.send(proto.Register(t, attempt, blocks, N, (p.peer_endpoint,), 1, 10_000, 0, secret))


def _held(p: Daemon, t: str, timeout: float = 5.0) -> None:
    """Wait until P holds a registration for ``t`` (the hijacker's is the owner's)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if any(r["transfer_id"] == t and r["registered"] for r in p.ops("pending")["pending"]):
            return
        time.sleep(0.02)
    raise AssertionError(f"P never held a registration for {t}: {p.ops('pending')}")


def _written(e: Engine, before: np.ndarray) -> int:
    """Bytes of ``e``'s region that changed since the warm-up."""
    return int((e.bytes != before).sum())


def _got_kv(pe: Engine, de: Engine, before: np.ndarray, lay, meta) -> bool:
    want, dontcare = reference_copy(meta, lay, pe.bytes, list(SRC), meta, lay, before, list(D_BLOCKS), N, 0)
    care = ~dontcare
    return bool(np.array_equal(de.bytes[care], want[care])) and bool((de.bytes != before).any())


@pytest.mark.parametrize("node, secret", [("dnode", "s-router"), ("dnode", ""), ("", "s-router")])
def test_concurrent_mode_a_hijacker_registering_first_gets_nothing_and_locks_nobody_out(fleet, node, secret):
    """Bound by D's node, by the router's secret, or both (what the router sends when the
    decode engine's node is configured): each alone keeps X out."""
    p, pe, de, xe, lay, meta, before = fleet
    t = tid()
    _register(xe, p, t, X_BLOCKS)  # X knows the ID and is first: it owns the record
    _held(p, t)
    _register(de, p, t, D_BLOCKS, secret=secret)  # the bound decode side comes second
    time.sleep(0.5)
    pe.send(proto.PrefillDone(t, SRC, N, 10_000, node, secret))
    got = de.result(t)
    assert isinstance(got, proto.Received), got
    assert isinstance(pe.result(t), proto.Sent)
    assert _got_kv(pe, de, before[id(de)], lay, meta)
    refusal = xe.result(t)
    assert isinstance(refusal, proto.ReceiveFailed) and "bound" in refusal.reason, refusal
    assert _written(xe, before[id(xe)]) == 0


def test_serial_mode_without_the_secret_is_refused(fleet):
    p, pe, de, xe, lay, meta, before = fleet
    t = tid()
    pe.send(proto.PrefillDone(t, SRC, N, 10_000, "", "s-serial"))  # P answered first
    for attempt, secret in enumerate(("", "s-guess")):
        _register(xe, p, t, X_BLOCKS, secret=secret, attempt=attempt)
        refusal = xe.result(t)
        assert isinstance(refusal, proto.ReceiveFailed) and "bound" in refusal.reason, refusal
    _register(de, p, t, D_BLOCKS, secret="s-serial")
    assert isinstance(de.result(t), proto.Received)
    assert _got_kv(pe, de, before[id(de)], lay, meta)
    assert _written(xe, before[id(xe)]) == 0


def test_serial_mode_whoever_holds_the_secret_is_the_decode_side(fleet):
    """The documented limit: the secret travels through the front; a node that has it and
    registers first takes the KV, and the decode side the front meant is refused, not mixed."""
    p, pe, de, xe, lay, meta, before = fleet
    t = tid()
    pe.send(proto.PrefillDone(t, SRC, N, 10_000, "", "s-serial"))
    _register(xe, p, t, X_BLOCKS, secret="s-serial")
    assert isinstance(xe.result(t), proto.Received)
    _register(de, p, t, D_BLOCKS, secret="s-serial")
    assert isinstance(de.result(t), proto.ReceiveFailed)
    assert _written(de, before[id(de)]) == 0
