"""kvpushd end to end at the daemon level: real processes, real NIXL WRITEs, real ZeroMQ.

After every transfer: the destination bytes equal the source bytes for exactly
the registered blocks (token by token, head by head, per the reference copy),
and no other destination byte changed.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator

import msgpack
import numpy as np
import pytest
import zmq

from kvpush import proto
from kvpush.proto.layout import KVLayout
from kvpush_dev.daemon_harness import (
    Daemon,
    Engine,
    amx_layout,
    check_tp1_to_tp2,
    check_tp2_to_tp1,
    check_transfer,
    device_config,
    engines,
    prefill_done,
    register,
    tid,
)
from kvpush_dev.engine_peer import raw_request
from kvpush_dev.kvref import reference_copy

pytestmark = pytest.mark.integration

def cpu(block_size: int = 16, num_blocks: int = 64, heads: int = 2, head_start: int = 0,
        total_heads: int = 0, num_layers: int = 2) -> tuple[KVLayout, dict]:
    return amx_layout(heads, head_start, total_heads, num_blocks=num_blocks, block_size=block_size,
                      num_layers=num_layers)


@pytest.mark.parametrize("order", ["register_first", "prefill_first"])
def test_single_transfer_either_order(pd, order):
    p, d = pd
    (lay, meta) = cpu()
    with engines(p, d, lay, seed=1) as (pe, de):
        before = de.bytes.copy()
        t, n = tid(), 3 * 16 + 5
        src, dst = [7, 3, 11, 12], [40, 2, 9, 10]
        if order == "register_first":
            register(de, [p], t, dst, n)
            time.sleep(0.3)
            prefill_done(pe, t, src, n)
        else:
            prefill_done(pe, t, src, n)
            time.sleep(0.3)
            register(de, [p], t, dst, n)
        assert isinstance(de.result(t), proto.Received)
        assert isinstance(pe.result(t), proto.Sent)
        check_transfer(pe, meta, src, de, meta, dst, n, before)


def test_many_concurrent_transfers_scattered_blocks(pd):
    p, d = pd
    lay, meta = cpu(num_blocks=256)
    with engines(p, d, lay, seed=2) as (pe, de):
        before = de.bytes.copy()
        rng = np.random.default_rng(0)
        dst_perm = rng.permutation(256)
        jobs = []
        for i in range(40):
            n = int(rng.integers(1, 5 * 16))
            nb = -(-n // 16)
            src = rng.choice(256, nb, replace=False).tolist()
            dst = dst_perm[i * 5 : i * 5 + nb].tolist()
            jobs.append((tid(), src, dst, n))
        for i, (t, src, dst, n) in enumerate(jobs):
            if i % 2:
                register(de, [p], t, dst, n)
                prefill_done(pe, t, src, n)
            else:
                prefill_done(pe, t, src, n)
                register(de, [p], t, dst, n)
        for t, *_ in jobs:
            assert isinstance(de.result(t), proto.Received)
            assert isinstance(pe.result(t), proto.Sent)
        # Apply the reference job by job onto one expected buffer.
        want = before.copy()
        care = np.ones(want.shape[0], dtype=bool)
        for _t, src, dst, n in jobs:
            w, dc = reference_copy(meta, lay, pe.bytes, src, meta, lay, want, dst, n, 0)
            want, care = w, care & ~dc
        assert np.array_equal(de.bytes[care], want[care])
        stats = d.ops("transfers")
        assert sum(r["result"] == "ok" for r in stats["recent"]) >= 40
        # Equal layouts: every WRITE was posted from the lists prepared at handshake.
        mine = [r for r in p.ops("transfers")["recent"] if r["transfer_id"] in {j[0] for j in jobs}]
        assert len(mine) == 40 and all(r["prepped"] for r in mine)
        assert any(peer["prepped_descriptors"] for peer in p.ops("peers")["peers"])


@pytest.mark.parametrize("sbs, dbs", [(16, 32), (32, 16), (48, 32)])
def test_different_block_sizes(pd, sbs, dbs):
    p, d = pd
    src_lay, sm = cpu(block_size=sbs, num_blocks=32)
    dst_lay, dm = cpu(block_size=dbs, num_blocks=32)
    with engines(p, d, src_lay, dst_lay, seed=3) as (pe, de):
        before = de.bytes.copy()
        t, n = tid(), 150
        src = [5, 1, 20, 21, 22, 9, 10, 11, 12, 13][: -(-n // sbs)]
        dst = [30, 3, 4, 17, 18, 19, 0, 2, 6, 7][: -(-n // dbs)]
        register(de, [p], t, dst, n)
        prefill_done(pe, t, src, n)
        assert isinstance(de.result(t), proto.Received)
        assert isinstance(pe.result(t), proto.Sent)
        check_transfer(pe, sm, src, de, dm, dst, n, before)
        # Block sizes differ: not block-periodic, so descriptors are built per transfer.
        row = next(r for r in p.ops("transfers")["recent"] if r["transfer_id"] == t)
        assert row["prepped"] is False


def test_tp2_to_tp1_two_producers(tmp_path):
    p0, p1 = Daemon(device_config(tmp_path, 0)), Daemon(device_config(tmp_path, 1))
    d = Daemon(device_config(tmp_path, 2))
    try:
        check_tp2_to_tp1(p0, p1, d, tid())
    finally:
        for x in (p0, p1, d):
            x.stop()


def test_tp1_to_tp2_one_producer_two_destinations(tmp_path):
    p = Daemon(device_config(tmp_path, 0))
    d0, d1 = Daemon(device_config(tmp_path, 1)), Daemon(device_config(tmp_path, 2))
    try:
        check_tp1_to_tp2(p, d0, d1, tid())
    finally:
        for x in (p, d0, d1):
            x.stop()


def _raw(endpoint: str, frames: list[bytes]) -> bytes | None:
    """The reply to ``frames``, or None: no reply within 2 s, or no session to send on at all
    (a keyless client of a CURVE port: the DEALER has no pipe, a blocking send would hang)."""
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDTIMEO, 2000)
    s.connect(endpoint)
    try:
        try:
            s.send_multipart(frames)
        except zmq.Again:
            return None
        return s.recv() if s.poll(2000) else None
    finally:
        s.close(0)


def test_bad_input_on_every_endpoint_writes_nothing(pd):
    p, d = pd
    lay, meta = cpu()
    with engines(p, d, lay, seed=7) as (pe, de):
        before = de.bytes.copy()
        src_before = pe.bytes.copy()
        peer_ep = p.peer_endpoint
        for ep in (p.cfg.engine_socket, p.cfg.ops_socket, peer_ep):
            for junk in (b"\x00garbage", b"\x81\xa1v\x07", proto.encode(proto.Heartbeat(1))[:-1], b""):
                reply = raw_request(ep, junk) if ep == p.cfg.engine_socket else _raw(ep, [junk])
                if ep == peer_ep:  # authenticated by default: a keyless client gets no session
                    assert reply is None
                    continue
                assert reply is not None
                msg = proto.decode(reply)
                assert isinstance(msg, (proto.Error, proto.OpsReply))
        # Wrong protocol version.
        bad = proto.encode(proto.Heartbeat(1)).replace(b"\xa1v" + bytes([proto.PROTOCOL_VERSION]), b"\xa1v\x09")
        assert "version" in proto.decode(raw_request(p.cfg.engine_socket, bad)).message
        # An engine or peer of protocol version 2 (before PeerRegister.timeout_ms) is told why
        # in version 2's own envelope, which it decodes; any other version hears ours.
        old = bad.replace(b"\xa1v\x09", b"\xa1v\x02")
        reply = raw_request(p.cfg.engine_socket, old)
        assert msgpack.unpackb(reply)["v"] == 2
        assert proto.decode(reply) == proto.Error(
            "protocol", f"unsupported protocol version 2 (this side speaks {proto.PROTOCOL_VERSION})")
        assert msgpack.unpackb(raw_request(p.cfg.engine_socket, bad))["v"] == proto.PROTOCOL_VERSION
        # A frame announced over max_message_bytes: the connection is closed, nothing buffered.
        with pytest.raises(EOFError):
            raw_request(p.cfg.engine_socket, b"\0" * 64, announce=p.cfg.max_message_bytes + 1)
        # An unauthenticated peer (no Hello) asking for a WRITE into the decode engine's blocks.
        reg = proto.PeerRegister("evil", 0, (0, 1), 20, 0, 1, 1, 5000)
        assert _raw(peer_ep, [proto.encode(reg)]) is None
        # Out-of-range block IDs from both engines, unknown transfer IDs.
        t = tid()
        register(de, [p], t, [1, 999], 20)
        assert "out of range" in de.result(t).reason
        prefill_done(pe, t, [0, 5000], 20)
        assert isinstance(pe.result(t), proto.SendFailed)
        pe.send(proto.Abort("never-seen", 0, "test"))
        pe.wait_for(lambda m: isinstance(m, proto.Released) and m.transfer_id == "never-seen", 5)
        # Attach with a handle that does not open.
        bad_handle = proto.MemoryHandle("cpu_shm", b"\x80", 1 << 20)
        reply = raw_request(d.cfg.engine_socket, proto.encode(proto.Attach("x", 0, 1, "decode", (bad_handle,), lay)))
        assert isinstance(proto.decode(reply), proto.Error)
        time.sleep(0.3)
        assert np.array_equal(de.bytes, before) and np.array_equal(pe.bytes, src_before)
        # ...and both daemons still serve (the bogus Attach came from another identity,
        # so the real engines stay attached).
        t2, n = tid(), 40
        register(de, [p], t2, [4, 5, 6], n)
        prefill_done(pe, t2, [1, 2, 3], n)
        assert isinstance(de.result(t2), proto.Received)
        check_transfer(pe, meta, [1, 2, 3], de, meta, [4, 5, 6], n, before)
        assert p.ops("status")["rejected_inputs"] > 0


@contextlib.contextmanager
def registered_at_producer(tmp_path) -> Iterator[tuple[Daemon, Daemon, Engine, str, np.ndarray]]:
    """A prefill and a decode daemon, and a registration that has reached the producer with no
    prefill yet: (producer, consumer, decode engine, transfer, the decode KV bytes before)."""
    lay, _ = cpu()
    with Daemon(device_config(tmp_path, 0)) as p, Daemon(device_config(tmp_path, 1)) as d, \
            engines(p, d, lay, seed=8) as (pe, de):
        before = de.bytes.copy()
        t = tid()
        register(de, [p], t, [1, 2], 20, timeout_ms=30_000)
        time.sleep(0.5)  # the registration reached the producer
        yield p, d, de, t, before


def test_prefill_daemon_killed_mid_transfer_fails_decode_within_deadline(tmp_path):
    with registered_at_producer(tmp_path) as (p, d, de, t, before):
        p.kill()
        t0 = time.monotonic()
        res = de.result(t, timeout=15)
        assert isinstance(res, proto.ReceiveFailed), res
        assert time.monotonic() - t0 < d.cfg.peer_timeout_s + 3
        assert np.array_equal(de.bytes, before)


def test_curve_peer_endpoint_refuses_unauthorised_peers(tmp_path):
    """Peers are authenticated by default: daemons holding allowlisted node keys transfer; a
    plain ZeroMQ client (no key) cannot even get a reply, so it can never cause a WRITE."""
    lay, meta = cpu()
    with Daemon(device_config(tmp_path, 0)) as p, Daemon(device_config(tmp_path, 1)) as d, \
            engines(p, d, lay, seed=9) as (pe, de):
        before = de.bytes.copy()
        reg = proto.PeerRegister("evil", 0, (0, 1), 20, 0, 1, 1, 5000)
        assert _raw(p.peer_endpoint, [proto.encode(reg)]) is None  # no CURVE: no session at all
        t, n = tid(), 40
        register(de, [p], t, [4, 5, 6], n)
        prefill_done(pe, t, [1, 2, 3], n)
        assert isinstance(de.result(t), proto.Received)
        check_transfer(pe, meta, [1, 2, 3], de, meta, [4, 5, 6], n, before)


def test_restarted_producer_on_the_same_endpoint_is_re_handshaken(tmp_path):
    """A prefill daemon restarts on the same endpoint (supervisor restart): the decode daemon
    notices (the new daemon refuses our un-handshaken traffic), fails what it had registered
    there, and re-handshakes for the next transfer; the engines re-attach by themselves."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = Daemon(device_config(tmp_path, 0, peer_port=port))
    d = Daemon(device_config(tmp_path, 1))
    lay, meta = cpu()
    try:
        with engines(p, d, lay, seed=10) as (pe, de):
            t, n = tid(), 40
            register(de, [p], t, [4, 5, 6], n)
            prefill_done(pe, t, [1, 2, 3], n)
            assert isinstance(de.result(t), proto.Received)
            p.kill()
            p = Daemon(device_config(tmp_path, 0, peer_port=port))
            # The prefill engine's client re-attaches to the new daemon on its own.
            pe.wait_for(lambda m: isinstance(m, proto.AttachAck), 20)
            deadline = time.monotonic() + 30
            while True:
                before = de.bytes.copy()
                t = tid()
                register(de, [p], t, [7, 8, 9], n)
                prefill_done(pe, t, [10, 11, 12], n)
                res = de.result(t, timeout=20)
                pe.result(t, timeout=20)
                if isinstance(res, proto.Received):
                    check_transfer(pe, meta, [10, 11, 12], de, meta, [7, 8, 9], n, before)
                    break
                assert time.monotonic() < deadline, f"no transfer through the restarted daemon: {res}"
                time.sleep(1)
    finally:
        p.stop()
        d.stop()


def test_the_daemon_card_names_its_peer_endpoint_while_it_runs(tmp_path):
    """Serial proxies depend on it: the prefill engine reads its daemon's peer endpoint from the
    card next to the engine socket (readable as the socket is), gone when the daemon stops."""
    from kvpush.proto.card import card_path, read_card

    d = Daemon(device_config(tmp_path, 0))
    path = card_path(d.cfg.engine_socket)
    assert path is not None
    try:
        card = read_card(path)
        assert card.peer_endpoint == d.peer_endpoint and card.daemon_id == d.ops("status")["daemon_id"]
        assert os.stat(path).st_mode & 0o777 == d.cfg.socket_mode & 0o666
    finally:
        d.stop()
    assert not os.path.exists(path)


def test_a_frozen_producer_makes_the_decode_daemon_fence_not_hand_blocks_back(tmp_path):
    """A producer that stops answering with its connection open (frozen, or behind a partition)
    may still deliver a WRITE it posted. The decode daemon exits (fence) instead of telling its
    engine the blocks are free; a killed producer (connection closed) is a plain failure
    (test_prefill_daemon_killed_mid_transfer_fails_decode_within_deadline)."""
    import signal

    from kvpush.daemon.context import FENCE_EXIT_CODE

    with registered_at_producer(tmp_path) as (p, d, de, t, before):
        os.kill(p.proc.pid, signal.SIGSTOP)
        try:
            d.proc.join(d.cfg.peer_timeout_s + 10)
            assert d.proc.exitcode == FENCE_EXIT_CODE
            de.client.poll()
            assert not [m for m in de.inbox if isinstance(m, (proto.ReceiveFailed, proto.Released))]
            assert np.array_equal(de.bytes, before)
        finally:
            os.kill(p.proc.pid, signal.SIGCONT)


def test_a_decode_daemon_answers_no_hello(tmp_path):
    """Decode daemons only dial out: one serving a decode engine answers a Hello with a refusal,
    never with a Hello of its own (its engine's NIXL metadata and region addresses), even to an
    allowlisted daemon. Here a second decode daemon is told to fetch from the first one."""
    d1 = Daemon(device_config(tmp_path, 0))
    d2 = Daemon(device_config(tmp_path, 1))
    lay, _ = cpu()
    de1 = Engine(d1, lay, "decode", fill="zeros")
    de2 = Engine(d2, lay, "decode", fill="zeros")
    try:
        t = tid()
        t0 = time.monotonic()
        register(de2, [d1], t, [1, 2], 20)
        res = de2.result(t, timeout=15)
        assert isinstance(res, proto.ReceiveFailed) and "only dial out" in res.reason, res
        assert time.monotonic() - t0 < d2.cfg.peer_timeout_s, "refused, not timed out"
        assert not [p for p in d1.ops("peers")["peers"] if p["role"] == "consumer"]
        assert not [p for p in d2.ops("peers")["peers"] if p["agent"]], "no agent metadata came back"
    finally:
        de1.close()
        de2.close()
        d1.stop()
        d2.stop()


def test_hybrid_groups_move_only_the_blocks_decode_holds(pd):
    """Two KV cache groups (a sliding window and full attention) overlaid on one layer tensor:
    the WRITE moves each group's blocks where the decode lists are not the null block, in one
    WRITE; block 0 (vLLM's null block) and every other decode byte stay as they were. A needed
    block the prefill side no longer holds fails the whole transfer (the engine recomputes)."""
    from dataclasses import replace

    p, d = pd
    lay, meta = cpu(num_layers=1)
    lay = replace(lay, kv_groups=("SlidingWindow block_size=16 window=32", "FullAttention block_size=16"))
    with engines(p, d, lay, seed=5) as (pe, de):
        before = de.bytes.copy()
        t, n = tid("hyb"), 4 * 16 - 3
        eps = (p.peer_endpoint,)
        de.send(proto.Register(t, 0, (0, 0, 20, 21, 22, 23, 24, 25), n, eps, 1, 10_000, kv_groups=(4, 4)))
        pe.send(proto.PrefillDone(t, (3, 4, 5, 6, 7, 8, 9, 10), n, 10_000, kv_groups=(4, 4)))
        assert isinstance(de.result(t), proto.Received)
        assert isinstance(pe.result(t), proto.Sent)
        check_transfer(pe, meta, [5, 6, 7, 8, 9, 10], de, meta, [20, 21, 22, 23, 24, 25], 6 * 16, before)

        t2 = tid("hyb")
        de.send(proto.Register(t2, 0, (0, 0, 30, 31, 32, 33, 34, 35), n, eps, 1, 10_000, kv_groups=(4, 4)))
        pe.send(proto.PrefillDone(t2, (0, 0, 0, 6, 7, 8, 9, 10), n, 10_000, kv_groups=(4, 4)))
        got = de.result(t2)
        assert isinstance(got, proto.ReceiveFailed), got


def test_a_state_group_moves_its_running_slot_beside_attention_blocks(pd):
    """A Mamba2 state group (block 2048 tokens) beside full attention (block 16), overlaid on
    the layer tensors: the WRITE moves, in every layer, the state's bytes at the start of the
    prefill side's running-state slot's page into the decode side's (its sub-tensors, 960 +
    2048 bytes of the 8192-byte page; the page's padding after them is not written) and each
    attention block the prompt's first N - 1 tokens fill, whole, in one WRITE; every other
    decode byte stays. A null state slot on either side fails the whole transfer."""
    from dataclasses import replace

    p, d = pd
    lay, meta = cpu(num_layers=2)
    page = lay.block_bytes // lay.num_layers
    state = (f"Mamba block_size=2048 page_bytes={page} state=3x160:bfloat16,4x32x4:float32 type=MAMBA2 "
             "mode=none spec_blocks=0")
    nstate = 3 * 160 * 2 + 4 * 32 * 4 * 4
    assert (page, nstate) == (8192, 3008)
    lay = replace(lay, kv_groups=(state, "FullAttention block_size=16"))
    with engines(p, d, lay, seed=6) as (pe, de):
        before = de.bytes.copy()
        t, n = tid("ssm"), 4 * 16 - 3  # N - 1 tokens: 4 attention blocks, one state slot
        eps = (p.peer_endpoint,)
        de.send(proto.Register(t, 0, (44, 20, 21, 22, 23), n, eps, 1, 10_000, kv_groups=(1, 4)))
        pe.send(proto.PrefillDone(t, (9, 3, 4, 5, 6), n, 10_000, kv_groups=(1, 4)))
        assert isinstance(de.result(t), proto.Received)
        assert isinstance(pe.result(t), proto.Sent)
        src, got, state_bytes = pe.bytes, de.bytes, before.copy()
        for off in lay.layer_offsets:
            s0, d0 = off + 9 * lay.block_stride, off + 44 * lay.block_stride
            # the state's bytes landed; after them the decode page is as it was (the prefill
            # side's padding differs: a whole-page copy would show)
            assert np.array_equal(got[d0: d0 + nstate], src[s0: s0 + nstate])
            assert np.array_equal(got[d0 + nstate: d0 + page], before[d0 + nstate: d0 + page])
            assert not np.array_equal(src[s0 + nstate: s0 + page], before[d0 + nstate: d0 + page])
            state_bytes[d0: d0 + nstate] = src[s0: s0 + nstate]
        # the attention blocks whole, and nothing else changed
        check_transfer(pe, meta, [3, 4, 5, 6], de, meta, [20, 21, 22, 23], 4 * 16, state_bytes)
        row = next(r for r in p.ops("transfers")["recent"] if r["transfer_id"] == t)
        assert row["bytes"] == 4 * lay.block_bytes + lay.num_layers * nstate, row

        for src_ids, dst in (((0, 3, 4, 5, 6), (45, 30, 31, 32, 33)), ((9, 3, 4, 5, 6), (0, 30, 31, 32, 33))):
            t2, after = tid("ssm"), de.bytes.copy()
            de.send(proto.Register(t2, 0, dst, n, eps, 1, 10_000, kv_groups=(1, 4)))
            pe.send(proto.PrefillDone(t2, src_ids, n, 10_000, kv_groups=(1, 4)))
            got2 = de.result(t2)
            assert isinstance(got2, proto.ReceiveFailed), got2
            assert np.array_equal(de.bytes, after)
