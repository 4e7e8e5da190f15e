"""Say a thing once per kind, with a bound: the plugin's log lines about failures must not
repeat per request, and their keys (reasons, parameter names) come from requests or peers,
so the set that remembers them is capped."""

from __future__ import annotations

from collections.abc import Hashable


class OncePer:
    """``first(key)``: True the first time ``key`` is seen, while fewer than ``cap`` were."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self._seen: set[Hashable] = set()

    def first(self, key: Hashable) -> bool:
        if key in self._seen or len(self._seen) >= self.cap:
            return False
        self._seen.add(key)
        return True
