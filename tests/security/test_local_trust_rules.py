"""The engine side's local trust rules (engine_plugin/link/local_trust.py) as pure functions of a
stat result: a directory, socket or card is trusted exactly when its type is right, its owner
is a trusted uid and (directory, card) no group or other may write it. Property-tested."""

from __future__ import annotations

import os
import stat

from hypothesis import given
from hypothesis import strategies as st

from kvpush.engine_plugin.link.local_trust import (
    dir_refusal,
    file_refusal,
    peer_refusal,
    socket_refusal,
    trusted_uids,
)

TYPES = [stat.S_IFDIR, stat.S_IFREG, stat.S_IFSOCK, stat.S_IFLNK, stat.S_IFIFO, stat.S_IFCHR]
UIDS = frozenset({0, 1000})


def fake(kind: int, perm: int, uid: int) -> os.stat_result:
    return os.stat_result((kind | perm, 1, 1, 1, uid, uid, 0, 0, 0, 0))


@given(st.sampled_from(TYPES), st.integers(0, 0o7777), st.sampled_from([0, 1000, 65534]))
def test_rules(kind: int, perm: int, uid: int) -> None:
    s = fake(kind, perm, uid)
    owner_ok, closed = uid in UIDS, not perm & 0o022
    assert (dir_refusal(s, UIDS) == "") == (kind == stat.S_IFDIR and owner_ok and closed)
    assert (file_refusal(s, UIDS) == "") == (kind == stat.S_IFREG and owner_ok and closed)
    assert (socket_refusal(s, UIDS) == "") == (kind == stat.S_IFSOCK and owner_ok)


@given(st.one_of(st.none(), st.integers(0, 70000)))
def test_listener_rule(uid: int | None) -> None:
    assert (peer_refusal(uid, UIDS) == "") == (uid in UIDS)


def test_trusted_uids_always_hold_root_and_us() -> None:
    assert {0, os.geteuid()} <= trusted_uids()
    assert trusted_uids(4242, euid=7) >= {0, 7, 4242}
