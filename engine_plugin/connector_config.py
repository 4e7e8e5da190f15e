"""KVPushConnector settings: the few keys of ``kv_connector_extra_config``.

Required:
  daemon            socket template of the rank's daemon, e.g. "ipc:///run/kvpush/engine-{rank}.sock"
                    ({rank} = TP rank, {device} = local device index; default index = rank)
Optional:
  lease_ms          prefill side: how long the daemon may hold finished blocks waiting for a
                    registration before releasing them (default 10000: with a router that sends
                    both legs at once, or a serial proxy, the decode side registers within its
                    queueing delay; a decode side that never comes costs at most this long; the
                    daemon caps it at its lease_s)
  timeout_ms        decode side: how long a registration waits for every producer before the
                    load fails and vLLM recomputes (default 30000)
  device_offset     added to the rank for {device} (several engines on one node; default 0)
  unavailable_fail  fail loads at once while the daemon is unreachable (default true)
  idle_wait_ms      on a step with no forward while a load (or, on a TP > 1 engine, a send)
                    is pending, wait up to this long for the daemon's answer instead of
                    letting vLLM spin (default 2; 0 = never)
  dead_after_ms     how long the daemon may leave heartbeats unanswered before the plugin
                    treats it as unavailable (default 3000, 1500..60000): lower fails the
                    transfers of a dead daemon sooner, higher rides out longer stalls of the
                    daemon or of the engine's own threads (the plugin cannot tell them apart)
  daemon_user       the user (name or uid) kvpushd runs as, when it is neither root nor the
                    engine's own user: the plugin dials only a daemon socket, and reads only a
                    card, owned by root, the engine's uid or this user, in a directory no other
                    uid can write, with a listener of those uids (engine_plugin/local_trust.py;
                    default: the user "kvpush" if this host has one; root and the engine's
                    own uid are always trusted)
"""

from __future__ import annotations

import pwd
from dataclasses import dataclass
from typing import Any

from kvpush.engine_plugin.local_trust import trusted_uids

DEAD_AFTER_MS = 3000
DEAD_AFTER_RANGE_MS = (1500, 60_000)  # above the 1 s heartbeat; below any sane load timeout


class PluginConfigError(ValueError):
    """A connector config key is missing or malformed."""


@dataclass(frozen=True)
class PluginConfig:
    daemon: str
    lease_ms: int = 10_000
    timeout_ms: int = 30_000
    device_offset: int = 0
    unavailable_fail: bool = True
    idle_wait_ms: int = 2
    dead_after_ms: int = DEAD_AFTER_MS
    daemon_uid: int | None = None  # daemon_user, resolved

    def trusted_uids(self) -> frozenset[int]:
        """Who may own the daemon's socket directory, socket and card, and listen on it."""
        return trusted_uids(self.daemon_uid)

    def socket_for(self, rank: int) -> str:
        return self.daemon.format(rank=rank, device=rank + self.device_offset)

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> PluginConfig:
        extra = dict(extra or {})
        known = {"daemon", "lease_ms", "timeout_ms", "device_offset", "unavailable_fail", "idle_wait_ms",
                 "dead_after_ms", "daemon_user"}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise PluginConfigError(f"unknown kv_connector_extra_config key(s) {unknown}; known: {sorted(known)}")
        if not isinstance(extra.get("daemon"), str) or not extra["daemon"]:
            raise PluginConfigError(
                'kv_connector_extra_config needs "daemon", e.g. "ipc:///run/kvpush/engine-{rank}.sock"'
            )
        out: dict[str, Any] = {"daemon": extra["daemon"]}
        for key in ("lease_ms", "timeout_ms", "device_offset", "idle_wait_ms"):
            if key in extra:
                v = extra[key]
                if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                    raise PluginConfigError(f"{key} must be a non-negative integer, got {v!r}")
                out[key] = v
        if "dead_after_ms" in extra:
            v, (lo, hi) = extra["dead_after_ms"], DEAD_AFTER_RANGE_MS
            if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
                raise PluginConfigError(f"dead_after_ms must be an integer in [{lo}, {hi}], got {v!r}")
            out["dead_after_ms"] = v
        if "daemon_user" in extra:
            out["daemon_uid"] = _uid(extra["daemon_user"])
        if "unavailable_fail" in extra:
            out["unavailable_fail"] = bool(extra["unavailable_fail"])
        return cls(**out)


def _uid(v: Any) -> int:
    """``daemon_user``: a user name known to this host, or a uid."""
    if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**32:
        return v
    if isinstance(v, str) and v:
        try:
            return pwd.getpwnam(v).pw_uid
        except KeyError:
            raise PluginConfigError(f"daemon_user {v!r}: no such user on this host") from None
    raise PluginConfigError(f"daemon_user must be a user name or a uid, got {v!r}")
