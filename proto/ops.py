"""What each ops command answers: the data of an ``OpsReply``, as typed dataclasses.

The daemon (``daemon/ops/views.py``) builds these and sends ``to_data()`` as ``OpsReply.data``;
its clients (``kvpushctl``, the supervisor's ``/metrics`` scrape, test harnesses) read
them back with :func:`parse_reply`, which checks every field and raises
:class:`OpsDataError` naming the field, never a ``KeyError`` deep inside a renderer.

The dataclasses are the schema, as in :mod:`kvpush.proto.messages`; but ops data carries
floats, negative ints (``attempt`` -1: no registration yet) and nulls, which the message
codec does not encode, so this module walks the fields itself and the data travels as the
codec's JSON-like ``OpsReply.data`` map. Rules of the walk:

* every field must be present (``X | None`` ones may be null) except ``omit`` ones, and
  any other key is an error: daemon and clients ship together, so a surprise means a
  mismatch, not an extension;
* sequences are tuples here and arrays on the wire; bool is not int; int is a valid float;
* a union of row classes is told apart by their tag field (``side``, metadata ``tag``),
  whose default is the only value that class accepts;
* fields with metadata ``omit`` are left out of ``to_data()`` while None (trace: a reply
  names either one transfer's events or the recent IDs).
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvpush.proto.errors import ProtocolError
from kvpush.proto.trace import ClockPair

__all__ = [
    "REPLY_TYPES",
    "CancelReply",
    "DecodePending",
    "DrainReply",
    "EngineInfo",
    "LiveWrite",
    "MetricsReply",
    "OpsData",
    "OpsDataError",
    "PeerCounts",
    "PeerRow",
    "PeersReply",
    "PendingCounts",
    "PendingReply",
    "PrefillPending",
    "RecentReceive",
    "RecentWrite",
    "StatusReply",
    "TraceReply",
    "TransfersReply",
    "parse_reply",
]

_D = TypeVar("_D", bound="OpsData")


class OpsDataError(ProtocolError):
    """An ops reply's data does not match its command's schema; names the field."""


class OpsData:
    """Base of every reply dataclass: the JSON-like round trip."""

    def to_data(self) -> dict[str, Any]:
        out: dict[str, Any] = _to_wire(self)
        return out

    @classmethod
    def from_data(cls: type[_D], data: Any, path: str | None = None) -> _D:
        out: _D = _from_wire(cls, data, path or cls.__name__)
        return out


def tag(value: str) -> Any:
    """The field that tells apart the row classes of one union (``side``)."""
    return field(default=value, metadata={"tag": True})


def omitted() -> Any:
    """An optional field that ``to_data`` leaves out while it is None."""
    return field(default=None, metadata={"omit": True})


# ---- status / drain ---------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class EngineInfo(OpsData):
    """The engine rank attached to the daemon."""

    engine_id: str
    rank: int
    tp_size: int
    role: str
    memory_bytes: int
    blocks: int
    block_size: int
    attached_s: float


@dataclass(frozen=True, kw_only=True)
class PeerCounts(OpsData):
    producers: int  # prefill daemons this (decode) daemon dialled
    consumers: int  # decode daemons that dialled this (prefill) daemon


@dataclass(frozen=True, kw_only=True)
class PendingCounts(OpsData):
    """Transfers per rendezvous state (prefill) and attempts per counter state (decode)."""

    prefill: dict[str, int]
    decode: dict[str, int]


@dataclass(frozen=True, kw_only=True)
class StatusReply(OpsData):
    device: str
    pid: int
    daemon_id: str  # changes on every daemon restart
    version: int  # PROTOCOL_VERSION
    backend: str
    agent: str  # NIXL agent name
    uptime_s: float
    draining: bool
    peer_endpoint: str
    peer_auth: str  # "curve" (CURVE + ZAP allowlist) or "insecure" (insecure_peers = true)
    node: str  # this node's certificate name ("" when insecure)
    engine_socket: str
    rss_bytes: int
    cpu_s: float
    engine: EngineInfo | None
    peers: PeerCounts
    pending: PendingCounts
    in_flight: int
    rejected_inputs: int


@dataclass(frozen=True, kw_only=True)
class DrainReply(OpsData):
    draining: bool
    pending: PendingCounts


# ---- pending ----------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class PrefillPending(OpsData):
    """A rendezvous waiting on the prefill daemon (``deadline``: CLOCK_MONOTONIC)."""

    side: str = tag("prefill")
    transfer_id: str
    attempt: int  # -1: no registration yet
    state: str
    blocks: int  # source blocks held (0 before prefill)
    registered: int
    expected: int
    writes_in_flight: int
    age: float
    deadline: float | None


@dataclass(frozen=True, kw_only=True)
class DecodePending(OpsData):
    """A registration waiting on the decode daemon for its producers' notifications."""

    side: str = tag("decode")
    transfer_id: str
    attempt: int
    state: str
    notified: int
    resolved: int  # notified, failed or cancel-confirmed
    producers: int
    age: float
    deadline: float


@dataclass(frozen=True, kw_only=True)
class PendingReply(OpsData):
    device: str
    pending: tuple[PrefillPending | DecodePending, ...]


# ---- peers ------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class PeerRow(OpsData):
    role: str  # producer | consumer
    endpoint: str
    state: str
    agent: str
    node: str  # the peer's authenticated identity ("" when insecure)
    engine_id: str
    rank: int
    tp_size: int
    last_seen_s: float | None
    transfers: int
    queued: int  # messages waiting for the handshake
    prepped_descriptors: int
    error: str
    # consumer: what WRITEs to it recently moved, MB/s (layerwise "auto" weighs streams by it);
    # None: not measured yet, or a producer
    write_mb_s: float | None = None


@dataclass(frozen=True, kw_only=True)
class PeersReply(OpsData):
    device: str
    peers: tuple[PeerRow, ...]


# ---- transfers --------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class LiveWrite(OpsData):
    """A WRITE posted and not finished (prefill side)."""

    transfer_id: str
    attempt: int
    dest_rank: int
    side: str = tag("prefill")
    bytes: int
    descriptors: int
    age_s: float
    result: str = "in_flight"
    group: int = 0  # a layer group's WRITE (no notification); 0: the final WRITE


@dataclass(frozen=True, kw_only=True)
class RecentWrite(OpsData):
    """A finished WRITE (prefill side)."""

    transfer_id: str
    attempt: int
    dest_rank: int
    side: str = tag("prefill")
    bytes: int
    descriptors: int
    prepped: bool  # posted from prepared descriptor lists
    latency_ms: float
    result: str  # ok | failed
    error: str
    age_s: float
    group: int  # n > 0: a layer group's WRITE that failed (landed ones are summed up in their final's row)
    mode: str  # final WRITE: "layerwise" (groups landed before it) or "whole"; "group" for a group's
    groups: int  # final WRITE: the streamed parts (layer groups of a chunk) it did not send again
    first_group_lag_ms: float | None  # layer-wise: first frame in -> first group WRITE posted
    tail_ms: float | None  # final WRITE: the last layer's frame (whole: the seal) in -> WRITE done


@dataclass(frozen=True, kw_only=True)
class RecentReceive(OpsData):
    """A finished registration (decode side)."""

    transfer_id: str
    attempt: int
    side: str = tag("decode")
    result: str
    error: str
    latency_ms: float | None
    producers: int | None
    age_s: float


@dataclass(frozen=True, kw_only=True)
class TransfersReply(OpsData):
    device: str
    in_flight: tuple[LiveWrite, ...]
    recent: tuple[RecentWrite | RecentReceive, ...]  # newest first


# ---- the rest ---------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class CancelReply(OpsData):
    cancelled: str  # the transfer ID


@dataclass(frozen=True, kw_only=True)
class MetricsReply(OpsData):
    text: str  # Prometheus text exposition of the daemon's registry


@dataclass(frozen=True, kw_only=True)
class TraceReply(OpsData):
    """One transfer's stamps (``transfer_id`` + ``events``) or, asked without an ID, the
    recent IDs; ``clock`` converts the stamps (CLOCK_MONOTONIC ns) to wall time."""

    device: str
    clock: ClockPair
    transfer_id: str | None = omitted()
    events: tuple[tuple[str, int], ...] | None = omitted()
    recent: tuple[str, ...] | None = omitted()


REPLY_TYPES: dict[str, type[OpsData]] = {
    "status": StatusReply,
    "pending": PendingReply,
    "peers": PeersReply,
    "transfers": TransfersReply,
    "cancel": CancelReply,
    "drain": DrainReply,
    "metrics": MetricsReply,
    "trace": TraceReply,
}
"""Ops command -> the dataclass its accepted reply's data holds."""


def parse_reply(cmd: str, data: Any) -> OpsData:
    """The typed data of an accepted (``ok``) reply to ``cmd``; OpsDataError otherwise."""
    cls = REPLY_TYPES.get(cmd)
    if cls is None:
        raise OpsDataError(f"no reply schema for ops command {cmd!r}")
    return cls.from_data(data, cmd)


# ---- the walk ---------------------------------------------------------------------------


def _tname(v: object) -> str:
    return "null" if v is None else type(v).__name__


def _to_wire(v: Any) -> Any:
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        out = {}
        for f in dataclasses.fields(v):
            x = getattr(v, f.name)
            if x is None and f.metadata.get("omit"):
                continue
            out[f.name] = _to_wire(x)
        return out
    if isinstance(v, (tuple, list)):
        return [_to_wire(x) for x in v]
    if isinstance(v, dict):
        return {k: _to_wire(x) for k, x in v.items()}
    return v


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


@functools.cache
def _tag_of(cls: type) -> tuple[str, str]:
    for f in dataclasses.fields(cls):
        if f.metadata.get("tag"):
            return f.name, f.default  # type: ignore[return-value]
    raise TypeError(f"{cls.__name__} is in a union of rows but has no tag field")


def _from_wire(cls: type, v: Any, path: str) -> Any:
    if type(v) is not dict:
        raise OpsDataError(f"{path}: expected a map, got {_tname(v)}")
    hints = _hints(cls)
    fields = dataclasses.fields(cls)
    extra = v.keys() - {f.name for f in fields}
    if extra:
        raise OpsDataError(f"{path}: unexpected field(s) {', '.join(sorted(map(str, extra)))}")
    kwargs = {}
    for f in fields:
        where = f"{path}.{f.name}"
        if f.name not in v:
            if not f.metadata.get("omit"):
                raise OpsDataError(f"{where}: missing")
            continue
        kwargs[f.name] = _value(hints[f.name], v[f.name], where)
        if f.metadata.get("tag") and kwargs[f.name] != f.default:
            raise OpsDataError(f"{where}: expected {f.default!r}, got {kwargs[f.name]!r}")
    return cls(**kwargs)


def _value(hint: Any, v: Any, path: str) -> Any:
    if hint is bool:
        if type(v) is not bool:
            raise OpsDataError(f"{path}: expected bool, got {_tname(v)}")
        return v
    if hint is int:
        if type(v) is not int:
            raise OpsDataError(f"{path}: expected int, got {_tname(v)}")
        return v
    if hint is float:
        if type(v) not in (int, float):
            raise OpsDataError(f"{path}: expected a number, got {_tname(v)}")
        return float(v)
    if hint is str:
        if type(v) is not str:
            raise OpsDataError(f"{path}: expected str, got {_tname(v)}")
        return v
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _from_wire(hint, v, path)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        members = [a for a in args if a is not type(None)]
        if v is None:
            if len(members) == len(args):
                raise OpsDataError(f"{path}: expected {_describe(hint)}, got null")
            return None
        if len(members) == 1:
            return _value(members[0], v, path)
        return _row(members, v, path)
    if origin is tuple:
        if type(v) is not list:
            raise OpsDataError(f"{path}: expected an array, got {_tname(v)}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_value(args[0], x, f"{path}[{i}]") for i, x in enumerate(v))
        if len(v) != len(args):
            raise OpsDataError(f"{path}: expected {len(args)} elements, got {len(v)}")
        return tuple(_value(a, x, f"{path}[{i}]") for i, (a, x) in enumerate(zip(args, v, strict=True)))
    if origin is dict:
        if type(v) is not dict:
            raise OpsDataError(f"{path}: expected a map, got {_tname(v)}")
        for k in v:
            if type(k) is not str:
                raise OpsDataError(f"{path}: key {k!r} is not a str")
        return {k: _value(args[1], x, f"{path}[{k!r}]") for k, x in v.items()}
    raise TypeError(f"{path}: field type {hint!r} has no ops encoding")


def _row(members: list[type], v: Any, path: str) -> Any:
    """One of several row classes, picked by the tag field they share."""
    by_tag = {_tag_of(c)[1]: c for c in members}
    name = _tag_of(members[0])[0]
    if type(v) is not dict:
        raise OpsDataError(f"{path}: expected a map, got {_tname(v)}")
    if name not in v:
        raise OpsDataError(f"{path}.{name}: missing")
    cls = by_tag.get(v[name]) if isinstance(v[name], str) else None
    if cls is None:
        raise OpsDataError(f"{path}.{name}: {v[name]!r} is not one of {', '.join(sorted(by_tag))}")
    return _from_wire(cls, v, path)


def _describe(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint)
