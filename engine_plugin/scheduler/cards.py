"""Where this engine's daemons can be reached by peers: their cards (``kvpush.proto.card``).

A prefill engine behind a serial proxy answers with the decode leg's params, which must name
its daemons' peer endpoints. The scheduler half reads them from the cards the daemons write
next to their engine sockets: a stat per rank per call, the file read again only when it
changed (a restarted daemon writes a new card). No socket, no waiting: a card is opened
``O_NONBLOCK | O_NOFOLLOW`` and read only if it is a regular file no untrusted uid owns or
can write, in a directory no other uid can write (:mod:`kvpush.engine_plugin.link.local_trust`).
"""

from __future__ import annotations

import os

from kvpush.engine_plugin.config import PluginConfig
from kvpush.engine_plugin.link.local_trust import dir_refusal, file_refusal
from kvpush.engine_plugin.logonce import OncePer
from kvpush.engine_plugin.logs import plugin_logger
from kvpush.proto.card import DaemonCard, card_path, read_card

log = plugin_logger(__name__)


class DaemonCards:
    """The peer endpoints of ranks 0..tp_size-1's daemons, or None while one is unknown."""

    def __init__(self, cfg: PluginConfig, tp_size: int) -> None:
        self.paths = [card_path(cfg.socket_for(r)) for r in range(tp_size)]
        self.uids = cfg.trusted_uids()
        self._cache: dict[str, tuple[tuple[int, int, int, int, int], DaemonCard]] = {}
        self._said = OncePer(64)  # why a card is unusable, logged once per (path, reason)

    def endpoints(self) -> tuple[str, ...] | None:
        out: list[str] = []
        for path in self.paths:
            card = self._card(path) if path is not None else None
            if card is None:
                return None
            out.append(card.peer_endpoint)
        return tuple(out)

    def _card(self, path: str) -> DaemonCard | None:
        try:
            why = dir_refusal(os.lstat(os.path.dirname(path) or "."), self.uids)
            st = os.lstat(path)
        except OSError as exc:
            self._say(path, f"no daemon card ({exc.strerror}); is kvpushd running for this rank?")
            return None
        if why:
            self._cache.pop(path, None)
            self._say(path, f"refused: {why}")
            return None
        stamp = (st.st_ino, st.st_mtime_ns, st.st_size, st.st_uid, st.st_mode)
        hit = self._cache.get(path)
        if hit is not None and hit[0] == stamp:
            return hit[1]
        try:
            card = read_card(path, lambda fst: file_refusal(fst, self.uids))
        except (OSError, ValueError) as exc:
            self._cache.pop(path, None)
            self._say(path, str(exc))
            return None
        self._cache[path] = (stamp, card)
        return card

    def _say(self, path: str, why: str) -> None:
        if not self._said.first((path, why)):
            return
        log.warning("kvpush: %s: %s; prefill legs from serial proxies are computed without handing on their "
                    "KV until it is readable", path, why)
