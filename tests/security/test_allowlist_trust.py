"""The allowlist trusts nothing it has not checked (issue 28, item 7 and item 4).

Real files, real ownership (the suite runs as root here, so "another uid" is uid 65534 made
by chown; run unprivileged, those cases skip), the real reload thread. Each finding of the
issue has its test: a world-writable directory, a symlink to a file another uid can rewrite,
a key rotated in place with its mtime kept, a vanished directory, a 192 MiB key file, two
certificates with one name or one host. The pure rule (:func:`admit`) is property-tested.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpush.daemon.trust.allowlist import Allowlist, NodeCert, admit, load
from kvpush.daemon.trust.peerauth import keygen

ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="making a file of another uid needs root")
OTHER = 65534


def cert(keys: Path, name: str, hosts: tuple[str, ...]) -> bytes:
    pub, _ = keygen(keys / name, name, list(hosts))
    return pub.read_bytes()


@pytest.fixture
def adir(tmp_path: Path) -> Path:
    d = tmp_path / "authorized"
    d.mkdir(mode=0o700)
    return d


def put(d: Path, fname: str, data: bytes) -> Path:
    p = d / fname
    p.write_bytes(data)
    p.chmod(0o644)
    return p


def names(d: Path) -> set[str]:
    return {c.name for c in load(str(d)).by_key.values()}


def test_a_trusted_directory_admits_its_keys(adir: Path, tmp_path: Path) -> None:
    put(adir, "a.key", cert(tmp_path / "k", "a", ("10.0.0.1",)))
    put(adir, "b.key", cert(tmp_path / "k", "b", ("10.0.0.2",)))
    assert names(adir) == {"a", "b"}


def test_a_world_writable_directory_admits_nobody(adir: Path, tmp_path: Path) -> None:
    """Finding: a key another uid dropped into a world-writable dir was admitted 1.6 s later."""
    put(adir, "a.key", cert(tmp_path / "k", "a", ("10.0.0.1",)))
    adir.chmod(0o777)
    snap = load(str(adir))
    assert snap.by_key == {}
    assert any("group/world-writable" in p and "every node is revoked" in p for p in snap.problems)
    adir.chmod(0o720)  # group-writable: the same
    assert names(adir) == set()


def test_a_writable_directory_above_it_admits_nobody(tmp_path: Path) -> None:
    up = tmp_path / "up"
    d = up / "authorized"
    d.mkdir(parents=True)
    put(d, "a.key", cert(tmp_path / "k", "a", ("10.0.0.1",)))
    up.chmod(0o777)  # another uid could rename authorized/ and put its own in place
    assert names(d) == set()
    up.chmod(0o755)
    assert names(d) == {"a"}


@needs_root
def test_a_directory_or_file_of_another_uid_is_refused(adir: Path, tmp_path: Path) -> None:
    put(adir, "a.key", cert(tmp_path / "k", "a", ("10.0.0.1",)))
    os.chown(put(adir, "b.key", cert(tmp_path / "k", "b", ("10.0.0.2",))), OTHER, OTHER)
    snap = load(str(adir))
    assert {c.name for c in snap.by_key.values()} == {"a"}
    assert any("b.key" in p and f"uid {OTHER}" in p for p in snap.problems)
    os.chown(adir, OTHER, OTHER)
    assert names(adir) == set()


def test_a_group_writable_key_file_is_refused(adir: Path, tmp_path: Path) -> None:
    put(adir, "a.key", cert(tmp_path / "k", "a", ("10.0.0.1",))).chmod(0o664)
    assert names(adir) == set()


def test_a_symlink_is_not_followed_to_a_file_others_can_rewrite(adir: Path, tmp_path: Path) -> None:
    """Finding: a symlinked key file was followed to a file another uid could rewrite."""
    open_dir = tmp_path / "shared"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    target = put(open_dir, "x.key", cert(tmp_path / "k", "x", ("10.0.0.9",)))
    (adir / "x.key").symlink_to(target)
    assert names(adir) == set()
    # The same link into a directory only we can write (a Kubernetes secret's ..data) is fine.
    open_dir.chmod(0o755)
    assert names(adir) == {"x"}
    target.chmod(0o666)  # but not to a file others can write
    assert names(adir) == set()


def test_a_fifo_named_like_a_key_does_not_block(adir: Path, tmp_path: Path) -> None:
    put(adir, "a.key", cert(tmp_path / "k", "a", ("10.0.0.1",)))
    os.mkfifo(adir / "f.key")
    t0 = time.monotonic()
    assert names(adir) == {"a"}
    assert time.monotonic() - t0 < 1.0


def test_rotation_in_place_with_mtime_kept_is_noticed(adir: Path, tmp_path: Path) -> None:
    """Finding: ``cp -p`` of a new key over the old one kept the mtime, and the old key stayed
    in. The reload thread notices content changes within 2 s."""
    old = put(adir, "a.key", cert(tmp_path / "k1", "a", ("10.0.0.1",)))
    allow = Allowlist(str(adir), interval_s=0.2, start=True)
    try:
        first = allow.named("a")
        assert first is not None
        old_key = first.public
        st_before = old.stat()
        new = tmp_path / "new.key"
        new.write_bytes(cert(tmp_path / "k2", "a", ("10.0.0.1",)))
        os.utime(new, ns=(st_before.st_atime_ns, st_before.st_mtime_ns))
        shutil.copy2(new, old)  # what cp -p does: contents and timestamps
        assert old.stat().st_mtime_ns == st_before.st_mtime_ns
        deadline = time.monotonic() + 2.0
        while True:
            c = allow.named("a")
            if c is not None and c.public != old_key:
                break
            assert time.monotonic() < deadline, "in-place rotation not noticed within 2 s"
            time.sleep(0.05)
        assert allow.by_key(old_key) is None
        assert allow.refresh() is True and allow.refresh() is False
    finally:
        allow.close()


def test_a_vanished_directory_revokes_everyone_loudly(adir: Path, tmp_path: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    put(adir, "a.key", cert(tmp_path / "k", "a", ("10.0.0.1",)))
    allow = Allowlist(str(adir), start=False)
    assert allow.names() == {"a"}
    shutil.rmtree(adir)
    with caplog.at_level(logging.ERROR, logger="kvpush.daemon.trust.allowlist"):
        assert allow.reload() is True
    assert allow.names() == set() and allow.refresh() is True
    assert any("every node is revoked" in r.message and r.levelno == logging.ERROR for r in caplog.records)


def test_a_huge_key_file_is_not_read_and_refresh_never_reads(adir: Path, tmp_path: Path) -> None:
    """Finding: a 192 MiB key file stalled the daemon loop 0.6 s. It is refused unread (size
    cap), by the reload thread; the loop's refresh() does no I/O at all."""
    put(adir, "a.key", cert(tmp_path / "k", "a", ("10.0.0.1",)))
    big = adir / "big.key"
    with open(big, "wb") as f:
        f.truncate(192 << 20)
    allow = Allowlist(str(adir), start=False)
    try:
        assert allow.names() == {"a"}
        assert any("big.key" in p and "bytes" in p for p in allow.problems)
        t0 = time.perf_counter()
        allow.reload()
        assert time.perf_counter() - t0 < 0.1
        shutil.rmtree(adir)  # refresh() answers from memory: nothing on disk is touched
        t0 = time.perf_counter()
        for _ in range(1000):
            allow.refresh()
        assert time.perf_counter() - t0 < 0.05
    finally:
        allow.close()


def test_two_certificates_with_one_name_are_both_refused(adir: Path, tmp_path: Path,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    """Finding: a second certificate named like the decode node (``dnode``, another file) was
    accepted and its Hello evicted the real one."""
    put(adir, "dnode.key", cert(tmp_path / "k1", "dnode", ("127.0.0.2",)))
    put(adir, "evil.key", cert(tmp_path / "k2", "dnode", ("127.0.0.7",)))
    with caplog.at_level(logging.WARNING, logger="kvpush.daemon.trust.allowlist"):
        allow = Allowlist(str(adir), start=False)
    assert allow.names() == set()
    assert any("dnode.key" in r.message and "evil.key" in r.message for r in caplog.records)


def test_two_certificates_listing_one_host_are_both_refused(adir: Path, tmp_path: Path) -> None:
    """Finding: a certificate that also listed the decode node's host claimed its endpoint."""
    put(adir, "dnode.key", cert(tmp_path / "k1", "dnode", ("127.0.0.2",)))
    put(adir, "xnode.key", cert(tmp_path / "k2", "xnode", ("127.0.0.3", "127.0.0.2")))
    put(adir, "pnode.key", cert(tmp_path / "k3", "pnode", ("127.0.0.1",)))
    snap = load(str(adir))
    assert {c.name for c in snap.by_key.values()} == {"pnode"}
    assert any("127.0.0.2" in p and "dnode.key" in p and "xnode.key" in p for p in snap.problems)


_names = st.sampled_from(["a", "b", "c", "d"])
_hosts = st.lists(st.sampled_from(["h1", "h2", "h3", "h4", "h5"]), max_size=3).map(tuple)
_keys = st.sampled_from([b"k1", b"k2", b"k3", b"k4", b"k5"])


@given(st.lists(st.tuples(_names, _keys, _hosts), max_size=6))
def test_admit_keeps_exactly_the_unambiguous(entries: list[tuple[str, bytes, tuple[str, ...]]]) -> None:
    certs = [(f"f{i}.key", NodeCert(n, k, h)) for i, (n, k, h) in enumerate(entries)]
    kept, refused = admit(certs)
    # Every name, host and key the kept certificates have is theirs alone.
    kept_certs = list(kept.values())
    assert len({c.name for c in kept_certs}) == len(kept_certs)
    hosts = [h for c in kept_certs for h in set(c.hosts)]
    assert len(hosts) == len(set(hosts))
    for f, c in certs:
        clash = any(g != f and (d.name == c.name or set(d.hosts) & set(c.hosts)
                                or (d.public == c.public and d != c)) for g, d in certs)
        assert (kept.get(c.public) == c) == (not clash)
        assert any(r.startswith(f"{f}:") for r in refused) == clash
