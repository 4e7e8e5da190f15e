"""msgpack wire codec for :mod:`kvpush.proto.messages`, driven by the dataclasses themselves.

Wire format: one msgpack map per message, ``{"v": PROTOCOL_VERSION, "t": <class name>,
<field>: <value>, ...}``; nested dataclasses (MemoryHandle, KVLayout, Packing) are nested maps,
tuples are arrays, bytes are msgpack bin. A payload that travels opaquely inside a bytes field
(a MemoryHandle's ``handle``: :mod:`kvpush.proto.handles`) is a bare map of one dataclass, with
the same validation: :func:`encode_struct` / :func:`decode_struct`.

``decode`` is the trust boundary: it checks the version, the type, the exact field set (fields
with a Python default may be omitted), every field's type (bool is not int), ranges, lengths and
enumerated values, and that a nested KVLayout is consistent; anything else is a ProtocolError
naming the field. msgpack's own limits are set from :class:`Limits` so a hostile length prefix
cannot make the unpacker pre-allocate more than the message could really hold.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import msgpack

from kvpush.proto.errors import ProtocolError, VersionMismatch
from kvpush.proto.layout import MAX_REGIONS  # memory handles of one Attach, bases of one Hello
from kvpush.proto.messages import (
    ERROR_COMPATIBLE_VERSIONS,
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    Error,
    Message,
)

__all__ = [
    "Limits", "MAX_BLOCK_IDS", "MAX_METADATA", "QUOTE_MAX", "REASON_MAX", "clip", "decode", "decode_struct",
    "encode", "encode_struct", "largest_inbound", "largest_ops_request",
]

JSON_MAX_DEPTH = 8  # OpsReply.data: nesting of maps/lists, the top map counting as 1

# What the largest *legitimate* message a daemon receives may hold (the daemon's
# ``max_message_bytes`` default is computed from these, see :func:`largest_inbound`):
MAX_BLOCK_IDS = 1 << 18  # block IDs of one Register / PeerRegister: 4M tokens at block size 16
MAX_METADATA = 1 << 20  # NIXL agent metadata of one Hello (measured: ~0.5 KiB, UCX, one region)
MAX_ENDPOINTS = 64  # prefill endpoints of one Register (prefill TP size)
MAX_LAYERS = 1024  # layer_offsets of one KVLayout
HANDLE_BYTES = 512  # a legitimate memory handle payload (ShmInfo, CudaIpcInfo: ~200 bytes)
QUOTE_MAX = 200  # chars of wire input that a reply, a reason or a log line quotes
REASON_MAX = 1024  # chars of a reason / error text a daemon sends (composed ones included)


@dataclass(frozen=True)
class Limits:
    """Bounds decode enforces; small values let tests (and wary callers) tighten them.

    ``max_message`` bounds *any* message, ops replies (``pending`` of a full rendezvous) and
    the largest legitimate inbound message included; a daemon's sockets take less
    (``max_message_bytes``, default :func:`largest_inbound`), which must stay below it.
    """

    max_list: int = 1 << 20  # elements of any array, entries of any map (at least _MAP_FLOOR)
    max_str: int = 4096  # chars of a typed str field (OpsReply.data strings: max_message)
    max_bytes: int = MAX_METADATA  # length of a bytes field (agent metadata, memory handles)
    max_int: int = 2**63 - 1  # every int field is in [0, max_int]
    max_message: int = 64 << 20  # bytes of one encoded message


DEFAULT_LIMITS = Limits()


def clip(text: str, n: int = QUOTE_MAX) -> str:
    """``text`` cut to at most ``n`` chars, marked: a reply, a reason or a log line that
    quotes wire input stays far below ``max_str`` (so it is decodable), whatever was sent."""
    if len(text) <= n:
        return text
    tail = f"...({len(text)} chars)"
    return text[: max(0, n - len(tail))] + tail

_ENVELOPE = frozenset({"v", "t"})
_NO_KEYS: frozenset[str] = frozenset()
_Converter = Callable[[Any, Limits, str], Any]
_S = TypeVar("_S")


def _tname(v: object) -> str:
    return "nil" if v is None else type(v).__name__


def _short(v: object, n: int = 60) -> str:
    """repr() cut short, so error texts stay small whatever a peer sent."""
    r = repr(v)
    return r if len(r) <= n else r[: n - 3] + "..."


# ---- per-kind converters: (wire value, limits, path) -> Python value --------------------


def _int(v: Any, lim: Limits, path: str) -> int:
    if type(v) is not int:
        raise ProtocolError(f"{path}: expected int, got {_tname(v)}")
    if v < 0 or v > lim.max_int:
        raise ProtocolError(f"{path}: {v} is outside [0, {lim.max_int}]")
    return v


def _bool(v: Any, lim: Limits, path: str) -> bool:
    if type(v) is not bool:
        raise ProtocolError(f"{path}: expected bool, got {_tname(v)}")
    return v


def _str(v: Any, lim: Limits, path: str) -> str:
    if type(v) is not str:
        raise ProtocolError(f"{path}: expected str, got {_tname(v)}")
    if len(v) > lim.max_str:
        raise ProtocolError(f"{path}: string of {len(v)} chars exceeds max_str {lim.max_str}")
    return v


def _bytes(v: Any, lim: Limits, path: str) -> bytes:
    if type(v) is not bytes:
        raise ProtocolError(f"{path}: expected bytes (msgpack bin), got {_tname(v)}")
    if len(v) > lim.max_bytes:
        raise ProtocolError(f"{path}: {len(v)} bytes exceed max_bytes {lim.max_bytes}")
    return v


def _ints(v: Any, lim: Limits, path: str) -> tuple[int, ...]:
    # One C-level pass per check (map/min/max), no Python loop: Register carries ~1k IDs.
    if type(v) is not list:
        raise ProtocolError(f"{path}: expected array of int, got {_tname(v)}")
    if not v:
        return ()
    if list(map(type, v)).count(int) != len(v):
        bad = sorted({k.__name__ for k in map(type, v)} - {"int"})
        raise ProtocolError(f"{path}: elements must be int, found {', '.join(bad)}")
    lo, hi = min(v), max(v)
    if lo < 0 or hi > lim.max_int:
        raise ProtocolError(f"{path}: element {lo if lo < 0 else hi} is outside [0, {lim.max_int}]")
    return tuple(v)


def _strs(v: Any, lim: Limits, path: str) -> tuple[str, ...]:
    if type(v) is not list:
        raise ProtocolError(f"{path}: expected array of str, got {_tname(v)}")
    if not v:
        return ()
    if list(map(type, v)).count(str) != len(v):
        bad = sorted({k.__name__ for k in map(type, v)} - {"str"})
        raise ProtocolError(f"{path}: elements must be str, found {', '.join(bad)}")
    longest = max(map(len, v))
    if longest > lim.max_str:
        raise ProtocolError(f"{path}: element of {longest} chars exceeds max_str {lim.max_str}")
    return tuple(v)


_JSON_SCALARS = (type(None), bool, int, float, str)


def _check_json(v: Any, depth: int, path: str) -> None:
    if depth > JSON_MAX_DEPTH:
        raise ProtocolError(f"{path}: nested deeper than {JSON_MAX_DEPTH}")
    if type(v) is dict:
        for k, item in v.items():
            if type(k) is not str:
                raise ProtocolError(f"{path}: map key {_short(k)} is not a str")
            if type(item) not in _JSON_SCALARS:
                _check_json(item, depth + 1, f"{path}[{_short(k, 40)}]")
    elif type(v) is list:
        for i, item in enumerate(v):
            if type(item) not in _JSON_SCALARS:
                _check_json(item, depth + 1, f"{path}[{i}]")
    else:
        raise ProtocolError(f"{path}: {_tname(v)} is not JSON-like")


def _json(v: Any, lim: Limits, path: str) -> dict[str, Any]:
    if type(v) is not dict:
        raise ProtocolError(f"{path}: expected map, got {_tname(v)}")
    _check_json(v, 1, path)
    return v


def _nested(cls: type) -> _Converter:
    def convert(v: Any, lim: Limits, path: str) -> Any:
        if type(v) is not dict:
            raise ProtocolError(f"{path}: expected {cls.__name__} map, got {_tname(v)}")
        obj = _decode_fields(cls, v, lim, path, _NO_KEYS)
        check = getattr(obj, "validate", None)  # e.g. KVLayout: every address in region
        if check is not None:
            try:
                check()
            except (ValueError, ArithmeticError) as e:
                raise ProtocolError(f"{path}: invalid {cls.__name__}: {e}") from e
        return obj

    return convert


# ---- schema, read once per class from the dataclass fields and type hints ---------------


@dataclass(frozen=True)
class _Field:
    name: str
    convert: _Converter
    required: bool
    choices: frozenset[str] | None
    sub: type | None  # nested dataclass, encoded as a map


_SCALARS: dict[object, _Converter] = {int: _int, bool: _bool, str: _str, bytes: _bytes}


def _array(one: _Converter, what: str) -> _Converter:
    """An array of at most MAX_REGIONS elements, each checked by ``one`` (memory handles of
    an Attach, chunks of a LayerProgress, IPC handles of a LayerEvents)."""

    def convert(v: Any, lim: Limits, path: str) -> tuple[Any, ...]:
        if type(v) is not list:
            raise ProtocolError(f"{path}: expected array of {what}, got {_tname(v)}")
        if len(v) > MAX_REGIONS:
            raise ProtocolError(f"{path}: {len(v)} entries exceed {MAX_REGIONS}")
        return tuple(one(item, lim, f"{path}[{i}]") for i, item in enumerate(v))

    return convert


def _nested_tuple(cls: type) -> _Converter:
    return _array(_nested(cls), cls.__name__)


_bytess = _array(_bytes, "bytes")


def _converter(hint: Any, owner: str) -> tuple[_Converter, type | None]:
    if hint in _SCALARS:
        return _SCALARS[hint], None
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is tuple and args == (int, Ellipsis):
        return _ints, None
    if origin is tuple and args == (str, Ellipsis):
        return _strs, None
    if origin is tuple and args == (bytes, Ellipsis):
        return _bytess, None
    if hint is dict or origin is dict:
        return _json, None
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis and dataclasses.is_dataclass(args[0]):
        _schema(args[0])
        return _nested_tuple(args[0]), args[0]
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        _schema(hint)  # fail at import, not at first use, on an unsupported nested hint
        return _nested(hint), hint
    raise TypeError(f"{owner}: field type {hint!r} has no wire encoding")


@functools.cache
def _schema(cls: type) -> tuple[tuple[_Field, ...], frozenset[str]]:
    hints = typing.get_type_hints(cls)
    fields = []
    for f in dataclasses.fields(cls):
        convert, sub = _converter(hints[f.name], f"{cls.__name__}.{f.name}")
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        fields.append(_Field(f.name, convert, required, f.metadata.get("choices"), sub))
    return tuple(fields), frozenset(f.name for f in fields)


def _decode_fields(
    cls: type, m: dict[Any, Any], lim: Limits, path: str, envelope: frozenset[str]
) -> Any:
    fields, names = _schema(cls)
    extra = m.keys() - names - envelope
    if extra:
        shown = sorted(_short(k, 40) for k in extra)
        raise ProtocolError(f"{path}: unexpected field(s) {', '.join(shown)}")
    kwargs: dict[str, Any] = {}
    for f in fields:
        if f.name not in m:
            if f.required:
                raise ProtocolError(f"{path}: missing field {f.name!r}")
            continue
        value = f.convert(m[f.name], lim, f"{path}.{f.name}")
        if f.choices is not None and value not in f.choices:
            raise ProtocolError(
                f"{path}.{f.name}: {_short(value)} is not one of {', '.join(sorted(f.choices))}"
            )
        kwargs[f.name] = value
    return cls(**kwargs)


def _to_map(obj: Any) -> dict[str, Any]:
    fields, _ = _schema(type(obj))
    out: dict[str, Any] = {}
    for f in fields:
        v = getattr(obj, f.name)
        if f.sub is not None and type(v) is tuple:
            if not all(type(x) is f.sub for x in v):
                raise ProtocolError(f"{type(obj).__name__}.{f.name}: expected {f.sub.__name__} entries")
            v = [_to_map(x) for x in v]
        elif f.sub is not None:
            if type(v) is not f.sub:
                raise ProtocolError(
                    f"{type(obj).__name__}.{f.name}: expected {f.sub.__name__}, got {_tname(v)}"
                )
            v = _to_map(v)
        out[f.name] = v
    return out


def _map_floor() -> int:
    """Entries of the largest map a message itself uses (envelope included), nested too."""
    seen: set[type] = set()
    todo = list(MESSAGE_TYPES.values())
    while todo:
        cls = todo.pop()
        if cls not in seen:
            seen.add(cls)
            todo.extend(f.sub for f in _schema(cls)[0] if f.sub is not None)
    for cls in MESSAGE_TYPES.values():
        if _schema(cls)[1] & _ENVELOPE:
            raise TypeError(f"{cls.__name__}: field names 'v' and 't' are the envelope's")
    return max(len(_schema(c)[1]) for c in seen) + len(_ENVELOPE)


# A tiny Limits.max_list must not make the messages' own maps undecodable.
_MAP_FLOOR = _map_floor()


# ---- public API -------------------------------------------------------------------------


def encode(msg: Message, version: int = PROTOCOL_VERSION) -> bytes:
    """Serialise a well-formed message; decode() on the other side re-validates it.

    ``version``: the envelope's; another than ours only for an Error to a sender of one of
    the ERROR_COMPATIBLE_VERSIONS (the refusal it can read)."""
    cls = type(msg)
    name = cls.__name__
    if MESSAGE_TYPES.get(name) is not cls:
        raise ProtocolError(f"cannot encode {_tname(msg)}: not a registered message type")
    if version != PROTOCOL_VERSION and not (cls is Error and version in ERROR_COMPATIBLE_VERSIONS):
        raise ProtocolError(f"cannot encode {name} for protocol version {version}")
    wire = {"v": version, "t": name, **_to_map(msg)}
    try:
        out: bytes = msgpack.packb(wire, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise ProtocolError(f"cannot encode {name}: {e}") from e
    if len(out) > DEFAULT_LIMITS.max_message:
        raise ProtocolError(f"{name}: {len(out)} bytes exceed max_message")
    return out


def _unpack_failure(e: Exception, lim: Limits) -> str:
    if isinstance(e, msgpack.ExtraData):
        return "trailing bytes after the message"
    text = str(e)
    if "incomplete input" in text:
        return "truncated message"
    if "max_ext_len" in text:
        return "msgpack extension types are not allowed"
    if "exceeds max_" in text:
        return (
            f"{text} (limits: max_list={lim.max_list}, max_bytes={lim.max_bytes}; "
            "or a length runs past the end of the message)"
        )
    return f"malformed msgpack ({type(e).__name__}{': ' + text if text else ''})"


def _unpack(data: bytes, lim: Limits, what: str) -> Any:
    """msgpack-decode one untrusted frame with lengths bounded by ``lim`` and its own size."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"expected bytes, got {_tname(data)}")
    n = memoryview(data).nbytes
    if n == 0:
        raise ProtocolError(f"empty {what}")
    if n > lim.max_message:
        raise ProtocolError(f"{what} of {n} bytes exceeds max_message {lim.max_message}")
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            use_list=True,
            strict_map_key=True,
            max_str_len=n,
            max_bin_len=min(n, lim.max_bytes),
            max_array_len=min(n, lim.max_list),
            max_map_len=min(n // 2, max(lim.max_list, _MAP_FLOOR)),
            max_ext_len=0,
        )
    except Exception as e:  # the unpacker is a black box: any failure means bad input
        raise ProtocolError(_unpack_failure(e, lim)) from e


def decode(data: bytes, limits: Limits | None = None) -> Message:
    """Parse and fully validate one message; raise ProtocolError for anything else."""
    lim = DEFAULT_LIMITS if limits is None else limits
    obj = _unpack(data, lim, "message")
    if type(obj) is not dict:
        raise ProtocolError(f"message must be a msgpack map, got {_tname(obj)}")
    if "v" not in obj:
        raise ProtocolError("missing protocol version field 'v'")
    v = obj["v"]
    if type(v) is not int:
        raise ProtocolError(f"protocol version 'v' must be an int, got {_tname(v)}")
    t = obj.get("t")
    if v != PROTOCOL_VERSION and not (t == "Error" and v in ERROR_COMPATIBLE_VERSIONS):
        raise VersionMismatch(v, f"unsupported protocol version {v} (this side speaks {PROTOCOL_VERSION})")
    if "t" not in obj:
        raise ProtocolError("missing message type field 't'")
    if type(t) is not str:
        raise ProtocolError(f"message type field 't' must be a str, got {_tname(t)}")
    cls = MESSAGE_TYPES.get(t)
    if cls is None:
        raise ProtocolError(f"unknown message type {_short(t)}")
    result: Message = _decode_fields(cls, obj, lim, t, _ENVELOPE)
    return result


# ---- payloads inside a bytes field: one dataclass as a bare map -------------------------


def encode_struct(obj: Any) -> bytes:
    """Serialise a dataclass instance (not a message: no envelope) with the codec's schema.

    For payloads that another field carries as opaque bytes, so one message type can carry
    several kinds of them; :func:`decode_struct` validates them like a nested dataclass.
    """
    if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
        raise ProtocolError(f"cannot encode {_tname(obj)}: not a dataclass instance")
    try:
        out: bytes = msgpack.packb(_to_map(obj), use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise ProtocolError(f"cannot encode {type(obj).__name__}: {e}") from e
    return out


def decode_struct(cls: type[_S], data: bytes, limits: Limits | None = None) -> _S:
    """Parse ``data`` as one ``cls`` map: exact field set, field types and ranges, choices,
    and ``cls.validate()`` when it has one; anything else is a ProtocolError."""
    lim = DEFAULT_LIMITS if limits is None else limits
    obj = _unpack(data, lim, cls.__name__)
    result: _S = _nested(cls)(obj, lim, cls.__name__)
    return result


# ---- the largest legitimate messages, from the limits above -----------------------------


def _worst_layout(lim: Limits) -> Any:
    from kvpush.proto.layout import KVLayout, Packing

    big = lim.max_int
    pk = Packing(big, big, big, big, big)
    return KVLayout(big, big, big, big, big, "float8_e4m3fn", (big,) * MAX_LAYERS, big, big, big,
                    pk, pk, big, big, big, "m" * lim.max_str, (big,) * MAX_LAYERS, (big,) * MAX_REGIONS,
                    big, True)


def largest_inbound(lim: Limits = DEFAULT_LIMITS) -> int:
    """Bytes of the largest legitimate message a daemon's engine or peer socket receives.

    Measured by encoding the worst case of each big message (every int at ``max_int``, every
    string at ``max_str`` chars): a Register with :data:`MAX_BLOCK_IDS` block IDs and
    :data:`MAX_ENDPOINTS` endpoints, a PeerRegister with as many IDs, a Hello with
    :data:`MAX_METADATA` bytes of NIXL metadata, an Attach. ~2.7 MB with the defaults.
    """
    from kvpush.proto import messages as m

    s, big, ids = "t" * lim.max_str, lim.max_int, (lim.max_int,) * MAX_BLOCK_IDS
    lay = _worst_layout(lim)
    worst = (
        m.Register(s, big, ids, big, (s,) * MAX_ENDPOINTS, big, big, big),
        m.PeerRegister(s, big, ids, big, big, big, big, big, big),
        m.Hello(s, b"\0" * MAX_METADATA, lay, (big,) * MAX_REGIONS, big, s, s, big, big, s, True),
        m.Attach(s, big, big, "prefill",
                 (m.MemoryHandle("cpu_shm", b"\0" * HANDLE_BYTES, big, big, big),) * MAX_REGIONS, lay),
    )
    return max(len(encode(w)) for w in worst)


def largest_ops_request(lim: Limits = DEFAULT_LIMITS) -> int:
    """Bytes of the largest OpsRequest (an argument of ``max_str`` 4-byte UTF-8 chars)."""
    from kvpush.proto import messages as m

    return len(encode(m.OpsRequest("transfers", "\U0001f600" * lim.max_str)))
