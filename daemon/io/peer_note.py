"""What a decode daemon that fences leaves the daemon its supervisor starts next: the prefill
daemons it knew lost (silent, or not answering a re-handshake).

Why: a decode daemon fences (exits, :mod:`kvpush.daemon.context`) when a producer went silent
while a WRITE of it could still land. Its successor knows nothing of that producer, so the
first registration for it would queue behind a first handshake, and wait there until the
producer answers or the handshake times out (``peer_timeout_s``), while the producer's engine
has already given its prefills up. With the note, that first link starts RECOVERING
(:mod:`kvpush.daemon.core.peers`): such a registration fails at once and the decode engine
recomputes while the producer is away (issue 43).

``{runtime_dir}/lost-producers-{name}.json`` (the daemon's private runtime directory, 0600,
written atomically), read once at start and removed. Bounded: at most ``limit`` endpoints
(``max_producers``), and a note older than ``max_age_s`` is ignored. What it can do is bounded
too: it only makes a registration for an endpoint it names fail before the producer's Hello
reply (vLLM recomputes); it dials nothing by itself, and never lets anything be written.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterable

__all__ = ["leave", "note_path", "take"]

log = logging.getLogger(__name__)


def note_path(runtime_dir: str, name: str) -> str:
    return os.path.join(runtime_dir, f"lost-producers-{name}.json")


def leave(path: str, endpoints: Iterable[str], now: float | None = None) -> None:
    """Write the note (a daemon about to fence). Never raises: a note that cannot be written
    costs its successor the wait it would have had anyway."""
    eps = sorted(set(endpoints))
    if not eps:
        return
    tmp = f"{path}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({"at": time.time() if now is None else now, "endpoints": eps}, f)
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("cannot leave the lost prefill daemons to the next daemon (%s): %s", path, exc)


def take(path: str, max_age_s: float, limit: int, now: float | None = None) -> set[str]:
    """The endpoints a fenced predecessor left (the note is removed); none where there is no
    note, it is unreadable, or older than ``max_age_s``."""
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except FileNotFoundError:
        return set()
    except (OSError, ValueError) as exc:
        log.warning("lost prefill daemons note %s unreadable (%s): ignored", path, exc)
        raw = None
    try:
        os.unlink(path)
    except OSError:
        pass
    if not isinstance(raw, dict) or not isinstance(raw.get("at"), int | float):
        return set()
    age = (time.time() if now is None else now) - raw["at"]
    eps = raw.get("endpoints")
    if not 0 <= age <= max_age_s or not isinstance(eps, list):
        return set()
    out = {e for e in eps if isinstance(e, str)}
    return set(sorted(out)[:limit])
