"""The peer allowlist: the public node certificates in ``authorized_keys_dir``, trusted only
as far as the files that hold them can be trusted.

Why a module of its own: the allowlist decides who reaches this node's memory, so how it is
read is a security decision, and it must never stall the daemon's loop. The rules:

* **Only files no other user can write.** The directory, every directory above it, and each
  certificate file (after following a symlink: its target and the target's directories) must
  be owned by root or by the daemon's user and not be group- or world-writable (a root-owned
  sticky directory such as /tmp is fine above it). Otherwise the whole allowlist is empty
  (fail closed: a writer could have put any key there) or, for one file, that file is left out;
  either with a log line saying why.
* **Content, not timestamps.** Every reload reads the files (each at most
  ``MAX_CERT_BYTES``: a certificate is ~300 bytes) and compares a hash of names and contents,
  so a key rotated in place with its mtime kept (``cp -p``, ``rsync -a``) is noticed.
* **A vanished directory revokes everyone**, with an error log line; a transient failure to
  read it (out of file descriptors or memory) keeps the last good allowlist, logged as
  ``PEER ALLOWLIST NOT RELOADED``.
* **Unique identities.** Two certificates with the same name, or listing the same host,
  conflict (an error line, ``PEER ALLOWLIST CONFLICT``, names both files): a name is a
  session's identity and a host is what an endpoint claim is checked against, so each must
  belong to exactly one certificate. The one admitted before keeps it and only the newcomer is
  refused; if neither was admitted (both new, or at start), both are refused.
* **Off the loop.** A thread (started when the daemon serves its peer port) reloads every
  ``interval_s``; the loop only asks
  :meth:`Allowlist.refresh` whether the set changed since it last asked (no I/O there).

:func:`admit` is the pure rule (parsed certificates in, kept ones and refusals out);
:class:`Allowlist` is its shell.
"""

from __future__ import annotations

import errno
import hashlib
import ipaddress
import logging
import os
import re
import stat
import threading
from collections.abc import Iterable
from dataclasses import dataclass

import zmq.utils.z85

log = logging.getLogger(__name__)

CERT_SUFFIX = ".key"
MAX_CERT_BYTES = 64 << 10  # a certificate is ~300 bytes; a bigger file is refused unread
MAX_CERTS = 4096  # files considered per reload (a directory of millions must not stall the reader)
RELOAD_S = 1.0
_META = re.compile(r"^\s+([A-Za-z0-9_\-]+)\s*=\s*\"?([^\"]*)\"?\s*$")


class AllowlistError(ValueError):
    """A certificate file, or the directory, cannot be trusted or read."""


# Errors of this process or host, not of the directory: no reason to revoke anyone (issue 44:
# a daemon out of file descriptors once emptied its allowlist and evicted every node).
TRANSIENT_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS, errno.EAGAIN,
                              errno.EINTR})


class AllowlistUnread(RuntimeError):
    """The directory could not be read this time for a transient reason (out of descriptors,
    memory): the last good allowlist stays."""


ROLES = ("prefill", "decode")


def canonical_host(host: str) -> str:
    """One spelling per host, so that a certificate's ``hosts`` and an endpoint compare as the
    same host however each was written: names case-folded without a trailing dot, IPv6 brackets
    removed and addresses in their compressed form (``[0:0::1]`` is ``::1``). No DNS: a name and
    an address are still two hosts (a certificate lists each one its daemons advertise)."""
    h = host.strip().strip("[]").rstrip(".").lower()
    try:
        return str(ipaddress.ip_address(h))
    except ValueError:
        return h


@dataclass(frozen=True)
class NodeCert:
    """One node's public certificate: its name, CURVE public key (z85), hosts and roles.

    ``roles``: what its daemons may be to ours: "prefill" (we may dial it as a producer,
    i.e. a request's ``kv_transfer_params`` may name it), "decode" (it may say Hello and
    register with our prefill daemons). A certificate without ``roles`` metadata (made before
    roles existed, or by ``keygen`` without ``--role``) has both."""

    name: str
    public: bytes
    hosts: tuple[str, ...]
    roles: tuple[str, ...] = ROLES

    def may(self, role: str) -> bool:
        return role in self.roles


def cert_sections(text: str) -> dict[str, dict[str, str]]:
    """The ``key = value`` lines of a zmq.auth certificate file (ZPL), by section."""
    sections: dict[str, dict[str, str]] = {}
    section = ""
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if not line[0].isspace():
            section = line.strip()
            continue
        m = _META.match(line)
        if m:
            sections.setdefault(section, {})[m.group(1)] = m.group(2)
    return sections


def parse_cert(text: str, fallback_name: str) -> NodeCert:
    """A zmq.auth certificate's ``metadata`` (name, hosts) and ``curve`` public key."""
    sections = cert_sections(text)
    public = sections.get("curve", {}).get("public-key", "")
    try:
        ok = len(public) == 40 and len(zmq.utils.z85.decode(public.encode())) == 32
    except (ValueError, KeyError, IndexError):
        ok = False
    if not ok:
        raise AllowlistError("no valid curve public-key")
    meta = sections.get("metadata", {})
    name = meta.get("name") or fallback_name
    hosts = tuple(canonical_host(h) for h in meta.get("hosts", "").split(",") if h.strip())
    if "roles" not in meta:
        return NodeCert(name, public.encode(), hosts)
    roles = tuple(sorted({r.strip() for r in meta["roles"].split(",") if r.strip()}))
    if not roles or set(roles) - set(ROLES):
        raise AllowlistError(f"roles {meta['roles']!r}: use {', '.join(ROLES)} (comma-separated)")
    return NodeCert(name, public.encode(), hosts, roles)


def admit(certs: Iterable[tuple[str, NodeCert]],
          admitted: dict[bytes, NodeCert] | None = None) -> tuple[dict[bytes, NodeCert], list[str]]:
    """The certificates that may be in the allowlist, by public key, and why others are not.

    ``certs``: (file name, certificate) pairs; ``admitted``: the last allowlist. A name or a
    host listed by two files conflicts: the certificate already admitted with it (the same key,
    name and hosts) keeps it, and only the newcomers are refused, so a rogue file never locks
    the honest node out (issue 44, item 7); when none of them was admitted, all are refused
    (fail closed: we cannot tell which one is the real node). A public key in two files is one
    node only if the files agree, else both are refused. Pure."""
    pairs = sorted(certs)
    old = admitted or {}
    incumbent = {f for f, c in pairs if old.get(c.public) == c}
    by_name: dict[str, list[str]] = {}
    by_host: dict[str, list[str]] = {}
    by_key: dict[bytes, list[tuple[str, NodeCert]]] = {}
    for f, c in pairs:
        by_name.setdefault(c.name, []).append(f)
        for h in set(c.hosts):
            by_host.setdefault(h, []).append(f)
        by_key.setdefault(c.public, []).append((f, c))
    bad: dict[str, str] = {}

    def conflict(files: list[str], what: str) -> None:
        kept = [f for f in files if f in incumbent]
        for f in files:
            if len(kept) == 1 and f == kept[0]:
                continue
            why = f"{what} is in {' and '.join(files)}"
            bad.setdefault(f, f"{why}; {kept[0]} was admitted with it first and keeps it" if len(kept) == 1
                           else why)

    for name, files in by_name.items():
        if len(files) > 1:
            conflict(files, f"node name {name!r}")
    for host, files in by_host.items():
        if len(files) > 1:
            conflict(files, f"host {host!r}")
    for key_files in by_key.values():
        if len({c for _, c in key_files}) > 1:
            files = [f for f, _ in key_files]
            for f in files:
                bad.setdefault(f, f"one public key with different names/hosts in {' and '.join(files)}")
    out: dict[bytes, NodeCert] = {}
    for f, c in pairs:
        if f not in bad:
            out[c.public] = c
    return out, [f"{f}: refused, {why}" for f, why in sorted(bad.items())]


# ---- the shell: what may be trusted on disk ---------------------------------------------------

def _trusted_uids() -> frozenset[int]:
    return frozenset({0, os.geteuid()})


def _check_node(path: str, st: os.stat_result, what: str, uids: frozenset[int], sticky_ok: bool) -> None:
    if st.st_uid not in uids:
        raise AllowlistError(f"{what} {path} is owned by uid {st.st_uid} (trusted: {sorted(uids)})")
    if st.st_mode & 0o022 and not (sticky_ok and st.st_mode & stat.S_ISVTX and st.st_uid == 0):
        raise AllowlistError(f"{what} {path} is group/world-writable (mode {st.st_mode & 0o7777:#o})")


def check_dir_chain(path: str, uids: frozenset[int]) -> None:
    """``path`` (resolved) and every directory above it: owned by a trusted uid, not writable
    by others (a root-owned sticky directory above it is fine: others cannot rename what they
    do not own there). Raises AllowlistError."""
    real = os.path.realpath(path)
    st = os.stat(real)
    if not stat.S_ISDIR(st.st_mode):
        raise AllowlistError(f"{path} is not a directory")
    _check_node(real, st, "directory", uids, sticky_ok=False)
    up = os.path.dirname(real)
    while True:
        _check_node(up, os.stat(up), "directory above it,", uids, sticky_ok=True)
        if up == os.path.dirname(up):
            return
        up = os.path.dirname(up)


def read_trusted(path: str, directory_real: str, uids: frozenset[int], cap: int = MAX_CERT_BYTES) -> bytes:
    """A certificate file's bytes, if no other user can have written them. A symlink is followed
    only to a file whose own directories pass :func:`check_dir_chain` (outside the allowlist
    directory) and that itself passes; never blocks on a FIFO or device."""
    real = os.path.realpath(path)
    if os.path.dirname(real) != directory_real:
        check_dir_chain(os.path.dirname(real), uids)
    fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_NOCTTY)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise AllowlistError(f"{path} is not a regular file")
        _check_node(path, st, "file", uids, sticky_ok=False)
        if st.st_size > cap:
            raise AllowlistError(f"{path} is {st.st_size} bytes (at most {cap})")
        data = os.read(fd, cap + 1)
    finally:
        os.close(fd)
    if len(data) > cap:
        raise AllowlistError(f"{path} is over {cap} bytes")
    return data


@dataclass(frozen=True)
class Snapshot:
    """One reload's outcome: the admitted certificates and why anything was left out."""

    by_key: dict[bytes, NodeCert]
    problems: tuple[str, ...]
    digest: bytes


def load(directory: str, uids: frozenset[int] | None = None, cap: int = MAX_CERT_BYTES,
         admitted: dict[bytes, NodeCert] | None = None) -> Snapshot:
    """Read ``directory`` once: fail closed to an empty allowlist if it is gone or untrusted.
    ``admitted``: the last allowlist (a conflict keeps its incumbent: :func:`admit`)."""
    uids = _trusted_uids() if uids is None else uids
    try:
        check_dir_chain(directory, uids)
        real = os.path.realpath(directory)
        names = sorted(n for n in os.listdir(real) if n.endswith(CERT_SUFFIX))
    except (OSError, AllowlistError) as exc:
        if isinstance(exc, OSError) and exc.errno in TRANSIENT_ERRNOS:
            raise AllowlistUnread(f"authorized_keys_dir {directory}: {exc.strerror}") from exc
        why = exc if isinstance(exc, AllowlistError) else f"authorized_keys_dir {directory}: {exc.strerror}"
        msg = f"authorized_keys_dir {directory} cannot be trusted or read ({why}): every node is revoked"
        return Snapshot({}, (msg,), hashlib.sha256(msg.encode()).digest())
    problems: list[str] = []
    if len(names) > MAX_CERTS:
        problems.append(f"{len(names)} certificates in {directory}; only the first {MAX_CERTS} are read")
        names = names[:MAX_CERTS]
    h = hashlib.sha256()
    parsed: list[tuple[str, NodeCert]] = []
    for n in names:
        path = os.path.join(real, n)
        try:
            data = read_trusted(path, real, uids, cap)
            parsed.append((n, parse_cert(data.decode("utf-8"), n.removesuffix(CERT_SUFFIX))))
            h.update(b"%d:%s\0%d:" % (len(n), n.encode(), len(data)) + data)
        except (OSError, ValueError) as exc:  # AllowlistError and UnicodeDecodeError are ValueErrors
            if isinstance(exc, OSError) and exc.errno in TRANSIENT_ERRNOS:
                raise AllowlistUnread(f"{path}: {exc.strerror}") from exc
            problems.append(f"{path}: ignored, {exc}")
            h.update(b"!%s\0" % n.encode())
    certs, refused = admit(parsed, admitted)
    problems += refused
    for p in problems:
        h.update(p.encode())
    return Snapshot(certs, tuple(problems), h.digest())


class Allowlist:
    """The admitted certificates of ``authorized_keys_dir``, reloaded by a thread of its own.

    Reading is lock-protected and never touches the disk; :meth:`refresh` tells the loop
    whether the set changed since its last call."""

    def __init__(self, directory: str, *, interval_s: float = RELOAD_S, max_cert_bytes: int = MAX_CERT_BYTES,
                 start: bool = False) -> None:
        self.directory = directory
        self.interval_s = interval_s
        self.max_cert_bytes = max_cert_bytes
        self._lock = threading.Lock()
        self._snap = Snapshot({}, (), b"")
        self._gen = 0  # bumped by every reload that changed the set
        self._seen = 0  # the generation refresh() last reported
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.reload()
        self._seen = self._gen
        if start:
            self.start()

    def start(self) -> None:
        """Reload every ``interval_s`` from now on (a daemon serving its peer port does; a
        process that only reads the keys once, e.g. a config check, need not)."""
        if self._thread is None and not self._stop.is_set():
            self._thread = threading.Thread(target=self._run, name="kvpush-allowlist", daemon=True)
            self._thread.start()

    def reload(self) -> bool:
        """Read the directory now (any thread); True if what it admits changed. A transient
        failure (:class:`AllowlistUnread`) keeps the last good allowlist, logged as an error."""
        try:
            with self._lock:
                last = self._snap.by_key
            snap = load(self.directory, cap=self.max_cert_bytes, admitted=last)
        except AllowlistUnread as exc:
            with self._lock:
                kept = len(self._snap.by_key)
            log.error("PEER ALLOWLIST NOT RELOADED: %s; keeping the last good allowlist (%d node(s)) "
                      "and retrying in %g s", exc, kept, self.interval_s)
            return False
        with self._lock:
            old = self._snap
            if snap.digest == old.digest:
                return False
            self._snap = snap
            changed = snap.by_key != old.by_key
            if changed:
                self._gen += 1
        for p in snap.problems:
            if not snap.by_key and "every node is revoked" in p:
                log.error("PEER ALLOWLIST EMPTY: %s", p)
            elif " is in " in p:  # two certificates claim one name or host: someone may be posing
                log.error("PEER ALLOWLIST CONFLICT: %s", p)
            else:
                log.warning("peer allowlist: %s", p)
        log.info("peer allowlist: %d node(s) in %s", len(snap.by_key), self.directory)
        return changed

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.reload()
            except Exception:  # the reader must outlive any surprise; the set stays as it was
                log.exception("peer allowlist reload failed")

    def refresh(self) -> bool:
        """Did the admitted set change since the last call? (No I/O: the loop may call it.)"""
        with self._lock:
            changed, self._seen = self._gen != self._seen, self._gen
        return changed

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval_s + 1)
            self._thread = None

    @property
    def problems(self) -> tuple[str, ...]:
        with self._lock:
            return self._snap.problems

    def by_key(self, public_z85: bytes) -> NodeCert | None:
        with self._lock:
            return self._snap.by_key.get(public_z85)

    def named(self, name: str) -> NodeCert | None:
        """The allowlisted node of that certificate name (a session's ZAP identity)."""
        with self._lock:
            return next((c for c in self._snap.by_key.values() if c.name == name), None)

    def names(self) -> set[str]:
        with self._lock:
            return {c.name for c in self._snap.by_key.values()}

    def server_for(self, host: str) -> NodeCert | None:
        """The node whose certificate lists ``host`` (whose daemons we may dial there)."""
        with self._lock:
            host = canonical_host(host)
            found = [c for c in self._snap.by_key.values() if host in c.hosts]
        return found[0] if len(found) == 1 else None
