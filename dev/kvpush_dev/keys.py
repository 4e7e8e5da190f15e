"""Peer keys made in the run: every test, demo and benchmark stack runs authenticated.

One node key per "host": on one machine all daemons share 127.0.0.1, so one certificate
(listing that host) is the node key of every daemon and the only entry of the allowlist.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvpush.daemon.trust.peerauth import keygen


@dataclass(frozen=True)
class LabKeys:
    secret_file: str  # curve_secret_key_file
    authorized_dir: str  # authorized_keys_dir

    def config(self) -> dict[str, str]:
        """The DeviceConfig / kvpushd.toml keys that turn these keys on."""
        return {"curve_secret_key_file": self.secret_file, "authorized_keys_dir": self.authorized_dir}

    def env(self) -> dict[str, str]:
        """The same as ``KVPUSH_*`` environment variables (for a kvpushd started as a command)."""
        return {f"KVPUSH_{k.upper()}": v for k, v in self.config().items()}


def lab_keys(base: Path, name: str = "lab", hosts: tuple[str, ...] = ("127.0.0.1",)) -> LabKeys:
    """A node key pair under ``base`` (made once, reused) whose public half is allowlisted."""
    keys, allowed = base / "keys", base / "authorized"
    secret = keys / f"{name}.key_secret"
    if not secret.exists():
        pub, _ = keygen(keys, name, list(hosts))
        allowed.mkdir(parents=True, exist_ok=True, mode=0o700)
        (allowed / pub.name).write_bytes(pub.read_bytes())
    return LabKeys(str(secret), str(allowed))


def allow(keys: LabKeys, *others: LabKeys) -> None:
    """Put other nodes' public certificates into this node's allowlist."""
    for o in others:
        pub = Path(o.secret_file).with_suffix(".key")
        (Path(keys.authorized_dir) / pub.name).write_bytes(pub.read_bytes())
