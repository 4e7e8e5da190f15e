"""Who may talk to a daemon's peer port: per-node CURVE keys and an allowlist (ZAP).

Every node has one key pair (``kvpushd keygen``): a secret certificate the node keeps and a
public one it gives to the nodes it works with. Each daemon's peer endpoint is a CURVE
server with its node's keys; ZAP lets in only clients whose public key is a certificate in
``authorized_keys_dir``, and names them by that certificate (its ``name``). A daemon dialling
a prefill daemon must know that node's public key: it is the allowlisted certificate whose
``hosts`` metadata lists the host of the endpoint. So one directory of public certificates is
both the allowlist (who may connect to us) and the directory of servers (whom we may dial).

The allowlist is re-read when the directory's contents change, so adding, rotating or
revoking a node is a file operation (docs/security.md, docs/operating.md: "Keys by host name or
address"); how it is read and what it refuses is :mod:`kvpush.daemon.trust.allowlist`. Revoking stops
new sessions at once; sessions
already open are not torn down by ZeroMQ, so a revoked node's open connections are dropped
by the daemon when it sees the identity is no longer allowed.
"""

from __future__ import annotations

import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from kvpush.daemon.core.session_gate import PendingCap
from kvpush.daemon.trust.allowlist import (
    CERT_SUFFIX,
    ROLES,
    Allowlist,
    NodeCert,
    canonical_host,
    cert_sections,
)

log = logging.getLogger(__name__)

SECRET_SUFFIX = ".key_secret"
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


class PeerAuthError(ValueError):
    """Keys missing or unusable: the daemon does not open its peer port."""


def _metadata(path: Path) -> dict[str, str]:
    """The ``metadata`` section of a zmq.auth certificate file."""
    return cert_sections(path.read_text(encoding="utf-8")).get("metadata", {})


def _read(path: str | Path) -> tuple[NodeCert, bytes | None]:
    """A certificate file's node (name, public key, hosts) and its secret key, if it holds one."""
    p = Path(path)
    try:
        public, secret = zmq.auth.load_certificate(str(p))
        meta = _metadata(p)
    except (OSError, ValueError) as exc:
        raise PeerAuthError(f"certificate {p}: {exc}") from None
    name = meta.get("name") or p.name.removesuffix(SECRET_SUFFIX).removesuffix(CERT_SUFFIX)
    hosts = tuple(canonical_host(h) for h in meta.get("hosts", "").split(",") if h.strip())
    return NodeCert(name, public, hosts), secret


def read_cert(path: str | Path) -> NodeCert:
    return _read(path)[0]


def endpoint_host(endpoint: str) -> str:
    """The host of ``tcp://HOST:PORT``, in the one spelling certificates' hosts are kept in
    (:func:`kvpush.daemon.trust.allowlist.canonical_host`)."""
    return canonical_host(endpoint.split("://", 1)[-1].rsplit(":", 1)[0])


def keygen(directory: str | Path, name: str, hosts: list[str], roles: list[str] | None = None) -> tuple[Path, Path]:
    """Make a node key pair in ``directory``: (public certificate, secret certificate).

    The secret file is created 0600; the public one is what other nodes put in their
    ``authorized_keys_dir``. ``hosts`` are the addresses this node's daemons advertise;
    ``roles`` ("prefill", "decode"; default both) what other nodes may use them as."""
    if not _NAME.match(name):
        raise PeerAuthError(f"node name {name!r}: use letters, digits, '_', '.', '-' (at most 64)")
    if not hosts or any("," in h or not h.strip() for h in hosts):
        raise PeerAuthError("keygen needs the node's advertised host(s), e.g. --host 10.0.0.5")
    if roles is not None and (not roles or set(roles) - set(ROLES)):
        raise PeerAuthError(f"roles {roles}: use {', '.join(ROLES)}")
    role_line = f'    roles = "{",".join(sorted(set(roles)))}"\n' if roles else ""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    for suffix in (CERT_SUFFIX, SECRET_SUFFIX):
        if (d / f"{name}{suffix}").exists():
            raise PeerAuthError(f"{d / (name + suffix)} exists; remove it first to rotate the key")
    old = os.umask(0o077)
    try:
        pub, sec = zmq.auth.create_certificates(str(d), name, metadata={"name": name, "hosts": ",".join(hosts)})
    finally:
        os.umask(old)
    public, _ = zmq.auth.load_certificate(pub)
    # pyzmq writes metadata only into the secret file; the public one must carry the hosts.
    Path(pub).write_text(
        "#   kvpush node certificate (public): copy it into the authorized_keys_dir of every\n"
        "#   node this one works with (its own included); remove it there to revoke the node.\n"
        f'metadata\n    name = "{name}"\n    hosts = "{",".join(hosts)}"\n{role_line}'
        f'curve\n    public-key = "{public.decode()}"\n', encoding="utf-8")
    os.chmod(pub, 0o644)
    os.chmod(sec, 0o600)
    return Path(pub), Path(sec)


class _Zap(ThreadAuthenticator):
    """ZAP over the allowlist: authenticated sessions carry the certificate's name as User-Id."""

    def __init__(self, ctx: zmq.Context, allow: Allowlist, pending: PendingCap | None) -> None:
        super().__init__(ctx)
        self.allow = allow
        self.pending = pending

    def callback(self, _domain: str, key: bytes) -> bool:
        cert = self.allow.by_key(key)
        if cert is None:
            return False
        pending = self.pending
        if pending is not None and not pending.admit(cert.name, time.monotonic()):
            log.warning("peer %r refused a session: max_sessions_per_peer reached (counted before its Hello)",
                        cert.name)
            return False
        return True

    def curve_user_id(self, client_public_key: bytes) -> str:
        cert = self.allow.by_key(zmq.utils.z85.encode(client_public_key))
        return cert.name if cert is not None else ""


@dataclass(eq=False)
class PeerAuth:
    """This node's keys and the allowlist: configures the peer ROUTER and every DEALER."""

    me: NodeCert
    secret: bytes
    allow: Allowlist
    pending: PendingCap | None = None  # the per-identity session cap, before the Hello
    _zap: _Zap | None = None

    @staticmethod
    def load(secret_file: str, authorized_dir: str) -> PeerAuth:
        if not os.path.isfile(secret_file):
            raise PeerAuthError(
                f"peer authentication is on by default and this node has no key at {secret_file}: "
                f"make one with `kvpushd keygen --dir {os.path.dirname(secret_file) or '.'} --host ADDR` "
                "(and put the nodes' public .key files in authorized_keys_dir), or set "
                "insecure_peers = true to run without authentication")
        me, secret = _read(secret_file)
        if not secret:
            raise PeerAuthError(f"{secret_file} holds no secret key")
        if not os.path.isdir(authorized_dir):
            raise PeerAuthError(f"authorized_keys_dir {authorized_dir} does not exist "
                                "(it holds the public .key files of the nodes allowed in)")
        return PeerAuth(me, secret, Allowlist(authorized_dir))

    def serve(self, ctx: zmq.Context, sock: zmq.Socket) -> None:
        """Make ``sock`` (not yet bound) a CURVE server admitting only the allowlist."""
        self.allow.start()  # from now on the allowlist follows its directory
        if self._zap is None:
            self._zap = _Zap(ctx, self.allow, self.pending)
            self._zap.start()
            self._zap.configure_curve_callback(domain="*", credentials_provider=self._zap)
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.me.public
        sock.curve_server = True

    def dial(self, sock: zmq.Socket, endpoint: str) -> str:
        """Configure a DEALER to ``endpoint`` as a CURVE client; returns the node it will reach.

        Raises PeerAuthError if no allowlisted node lists the endpoint's host."""
        host = endpoint_host(endpoint)
        cert = self.allow.server_for(host)
        if cert is None:
            raise PeerAuthError(f"no authorized node certificate lists host {host!r} "
                                f"(or more than one does): cannot dial {endpoint}")
        if not cert.may("prefill"):  # we dial only producers; the endpoint came from a request
            raise PeerAuthError(f"node {cert.name!r} at {endpoint} is not allowed the prefill role "
                                f"(its certificate's roles: {', '.join(cert.roles)}): not dialling it")
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.me.public
        sock.curve_serverkey = cert.public
        return cert.name

    def close(self) -> None:
        self.allow.close()
        if self._zap is not None:
            self._zap.stop()
            self._zap = None
