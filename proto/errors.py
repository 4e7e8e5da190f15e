"""The one exception the wire codec raises.

Everything that arrives from a socket is untrusted: a peer running another version, a
truncated frame or a hostile sender must turn into a :class:`ProtocolError` (answered with
an error reply) and never into a crash of the daemon or engine loop.
"""

from __future__ import annotations


class ProtocolError(ValueError):
    """A message could not be encoded or decoded; the text says which field and why."""


class VersionMismatch(ProtocolError):
    """The message is of another protocol version (``version``): the sender speaks another
    kvpush. Answered, where that version can read it, with an Error it can decode."""

    def __init__(self, version: int, text: str) -> None:
        super().__init__(text)
        self.version = version
