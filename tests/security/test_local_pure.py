"""The pure parts of the local trust boundary: peer credentials, the live-connection table,
the one-engine-per-rank rule, torch's shm naming, the runtime directory's mode and the
shm ledger's reaping rule (with a fake clock of process start times)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpush.daemon.io.endpoints import (
    RuntimeDirError,
    check_private_dir,
    ensure_private_dir,
    runtime_dir_mode,
)
from kvpush.daemon.io.kv_mapping import ShmLedger, ShmRecord, torch_shm_name_ok
from kvpush.daemon.io.peercred import Holder, PeerCred, PeerTable, attach_refusal

ids = st.integers(min_value=0, max_value=2**31 - 1)
pids = st.integers(min_value=1, max_value=2**22)


events = st.lists(st.tuples(st.booleans(), st.integers(0, 6), pids), max_size=40)


@given(events)
def test_peer_table_follows_the_monitor(evs: list[tuple[bool, int, int]]) -> None:
    """Applied in order, accepted/disconnected events leave exactly the live fds."""
    table, model = PeerTable(), {}
    for accepted, fd, pid in evs:
        if accepted:
            table.accepted(fd, PeerCred(pid, 0, 0))
            model[fd] = pid
        else:
            table.disconnected(fd)
            model.pop(fd, None)
    for pid in {p for _, _, p in evs}:
        assert table.connected(pid) == (pid in model.values())


holders = st.builds(Holder, pids, ids, ids, st.floats(0, 100))


@given(holders, st.builds(PeerCred, pids, ids, ids), ids, st.one_of(st.none(), ids), st.booleans(),
       st.floats(0, 100))
def test_one_engine_per_rank(h: Holder, peer: PeerCred, peer_start: int, holder_now: int | None,
                             connected: bool, now: float) -> None:
    refused = attach_refusal(h, peer, peer_start, holder_now, connected, now) is not None
    same = peer.pid == h.pid and peer_start == h.start_time
    holder_live = holder_now == h.start_time and (connected or now < h.grace_until)
    assert refused == (not same and holder_live)


def test_no_holder_and_gone_sender() -> None:
    assert attach_refusal(None, PeerCred(5, 0, 0), 7, None, False, 0.0) is None
    assert "gone" in attach_refusal(None, PeerCred(5, 0, 0), None, None, False, 0.0)


@given(pids, st.integers(0, 2**32), st.integers(0, 99))
def test_torch_names(pid: int, rand: int, n: int) -> None:
    assert torch_shm_name_ok(f"/torch_{pid}_{rand}_{n}", pid)
    assert not torch_shm_name_ok(f"/torch_{pid + 1}_{rand}_{n}", pid)
    assert not torch_shm_name_ok(f"/torch_{pid}_{rand}_{n}/../x", pid)
    assert not torch_shm_name_ok(f"/x_torch_{pid}_{rand}_{n}", pid)


@pytest.mark.parametrize("modes, want", [((), 0o700), ((0o600,), 0o700), ((0o600, 0o660), 0o750)])
def test_runtime_dir_mode(modes: tuple[int, ...], want: int) -> None:
    assert runtime_dir_mode(modes) == want


def test_private_dir_created_exactly(tmp_path: Path) -> None:
    old = os.umask(0o077)
    try:
        ensure_private_dir(str(tmp_path / "a" / "run"), 0o750)
    finally:
        os.umask(old)
    assert (tmp_path / "a" / "run").stat().st_mode & 0o777 == 0o750
    ensure_private_dir(str(tmp_path / "run0"))
    assert (tmp_path / "run0").stat().st_mode & 0o777 == 0o700


@pytest.mark.parametrize("mode, allowed, ok", [
    (0o700, 0o700, True), (0o750, 0o750, True), (0o710, 0o750, True),
    (0o755, 0o700, False), (0o750, 0o700, False), (0o770, 0o750, False), (0o777, 0o750, False),
    (0o702, 0o700, False),
])
def test_private_dir_modes(tmp_path: Path, mode: int, allowed: int, ok: bool) -> None:
    d = tmp_path / "run"
    d.mkdir()
    d.chmod(mode)
    if ok:
        check_private_dir(str(d), allowed)
    else:
        with pytest.raises(RuntimeDirError, match="mode"):
            check_private_dir(str(d), allowed)


def test_private_dir_symlink_and_file(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(RuntimeDirError, match="symlink"):
        ensure_private_dir(str(tmp_path / "link"))
    (tmp_path / "file").write_text("")
    with pytest.raises(RuntimeDirError, match="not a directory"):
        ensure_private_dir(str(tmp_path / "file"))


def _record(path: Path, pid: int, start: int) -> ShmRecord:
    st_ = path.stat()
    return ShmRecord(f"/torch_{pid}_1_0", pid, start, st_.st_uid, st_.st_ino, st_.st_dev)


@given(st.lists(st.tuples(pids, st.booleans()), min_size=1, max_size=8, unique_by=lambda t: t[0]))
def test_ledger_reaps_only_exited_exporters(tmp_path_factory: pytest.TempPathFactory,
                                            procs: list[tuple[int, bool]]) -> None:
    """A record is dropped iff its exporter (pid + start time) is gone; live ones survive a
    reload (a daemon restart) in order."""
    tmp = tmp_path_factory.mktemp("ledger")
    alive = {pid: 100 + pid for pid, live in procs if live}
    ledger = ShmLedger(str(tmp / "shm.json"), start_time=alive.get)
    for pid, _ in procs:
        f = tmp / f"f{pid}"
        f.write_bytes(b"x")
        ledger.add(_record(f, pid, 100 + pid))  # the files live elsewhere: reap cannot unlink them
    ledger.reap()
    assert [r.pid for r in ledger.records] == [pid for pid, live in procs if live]
    again = ShmLedger(ledger.path, start_time=alive.get)
    again.load()
    assert again.records == ledger.records
    assert (again.latest_alive() is None) == (not alive)


def test_ledger_ignores_foreign_entries(tmp_path: Path) -> None:
    bad = tmp_path / "shm.json"
    bad.write_text('[{"name": "/etc/passwd", "pid": 1, "start_time": 1, "uid": 0, "ino": 1, "dev": 1}, 7]')
    ledger = ShmLedger(str(bad))
    ledger.load()
    assert ledger.records == []
