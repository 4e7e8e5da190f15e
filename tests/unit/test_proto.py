"""Wire codec: round trips, and every malformed input ends as a ProtocolError naming the cause.

Strategies are written per message type by hand (not derived from the codec's schema) so a
wrong annotation or a codec bug cannot hide behind a strategy built from the same mistake.
"""

from __future__ import annotations

import dataclasses
import timeit
import typing
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpush.proto import (
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    Abort,
    Attach,
    AttachAck,
    Cancel,
    CancelConfirmed,
    Error,
    Heartbeat,
    HeartbeatAck,
    Hello,
    LayerChunk,
    LayerEvents,
    LayerProgress,
    Limits,
    MemoryHandle,
    OpsReply,
    OpsRequest,
    PeerRegister,
    PrefillDone,
    ProtocolError,
    Received,
    ReceiveFailed,
    Register,
    Released,
    SendFailed,
    Sent,
    TraceReport,
    WriteFailedNotice,
    Writing,
    decode,
    encode,
)
from kvpush.proto.layout import (
    DTYPE_SIZES,
    KVLayout,
    flash_layout,
    mla_layout,
    per_layer_regions,
    vllm_cpu_layout,
)

FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MORE = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ---- strategies ---------------------------------------------------------------------------

u63 = st.one_of(st.integers(0, 1000), st.integers(0, 2**63 - 1))
text = st.text(max_size=40)
ids = st.lists(st.integers(0, 2**63 - 1), max_size=64).map(tuple)
endpoints = st.lists(text, max_size=4).map(tuple)
dtypes = st.sampled_from(sorted(DTYPE_SIZES))


@st.composite
def heads(draw: st.DrawFn) -> tuple[int, int, int]:
    """(num_heads, head_start, total_heads) that validate()."""
    num_heads = draw(st.integers(1, 8))
    total = draw(st.one_of(st.just(0), st.integers(num_heads, 32)))
    start = 0 if total == 0 else draw(st.integers(0, total - num_heads))
    return num_heads, start, total


@st.composite
def cpu_layouts(draw: st.DrawFn) -> KVLayout:
    amx = draw(st.booleans())
    block_size = draw(st.sampled_from([16, 32, 64]) if amx else st.integers(1, 64))
    head_size = draw(st.sampled_from([16, 32, 64, 128]) if amx else st.integers(1, 256))
    num_layers, num_blocks = draw(st.integers(1, 6)), draw(st.integers(1, 300))
    num_heads, start, total = draw(heads())
    dtype = draw(dtypes)
    per_layer = num_blocks * num_heads * 2 * block_size * head_size * DTYPE_SIZES[dtype]
    return vllm_cpu_layout(
        num_layers=num_layers,
        num_blocks=num_blocks,
        block_size=block_size,
        num_heads=num_heads,
        head_size=head_size,
        dtype=dtype,
        layer_stride=per_layer + draw(st.integers(0, 4096)),
        amx=amx,
        head_start=start,
        total_heads=total,
        model=draw(text),
    )


@st.composite
def flash_layouts(draw: st.DrawFn) -> KVLayout:
    num_heads, start, total = draw(heads())
    return flash_layout(
        num_layers=draw(st.integers(1, 6)),
        num_blocks=draw(st.integers(1, 300)),
        block_size=draw(st.integers(1, 64)),
        num_heads=num_heads,
        head_size=draw(st.integers(1, 256)),
        dtype=draw(dtypes),
        head_start=start,
        total_heads=total,
        model=draw(text),
    )


def _mla(layers: int, blocks: int, bs: int, d: int, dtype: str, per_layer: bool) -> KVLayout:
    return mla_layout(num_layers=layers, num_blocks=blocks, block_size=bs, head_size=d, dtype=dtype,
                      per_layer=per_layer)


def _per_layer(lay: KVLayout) -> KVLayout:
    return per_layer_regions(lay)


# One region (vLLM-cpu), one region per layer (vLLM on GPU), MLA's replicated latent.
layouts = st.one_of(
    cpu_layouts(), flash_layouts(), flash_layouts().map(_per_layer),
    st.builds(_mla, st.integers(1, 4), st.integers(1, 64), st.integers(1, 32), st.integers(1, 576), dtypes,
              st.booleans()),
)
handles = st.builds(
    MemoryHandle,
    kind=st.sampled_from(["cpu_shm", "cuda_ipc"]),
    handle=st.binary(max_size=64),
    size=u63,
    offset=u63,
    device=st.integers(0, 16),
)


def _depth(v: Any) -> int:
    if isinstance(v, dict):
        return 1 + max(map(_depth, v.values()), default=0)
    if isinstance(v, list):
        return 1 + max(map(_depth, v), default=0)
    return 0


json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
)
json_values = st.recursive(
    json_scalars,
    lambda ch: st.lists(ch, max_size=4) | st.dictionaries(st.text(max_size=8), ch, max_size=4),
    max_leaves=20,
)
json_data = st.dictionaries(st.text(max_size=8), json_values, max_size=5).filter(
    lambda d: _depth(d) <= 8
)

STRATEGIES: dict[type, st.SearchStrategy[Any]] = {
    Attach: st.builds(
        Attach,
        engine_id=text,
        rank=u63,
        tp_size=u63,
        role=st.sampled_from(["prefill", "decode", "both"]),
        regions=st.lists(handles, min_size=1, max_size=4).map(tuple),
        layout=layouts,
    ),
    Register: st.builds(Register, text, u63, ids, u63, endpoints, u63, u63),
    PrefillDone: st.builds(PrefillDone, text, ids, u63, u63),
    LayerProgress: st.builds(
        LayerProgress, u63, u63,
        st.lists(st.builds(LayerChunk, text, u63, u63, ids, u63, u63), max_size=4).map(tuple), u63,
    ),
    LayerEvents: st.builds(LayerEvents, st.lists(st.binary(max_size=64), max_size=4).map(tuple), u63),
    Abort: st.builds(Abort, text, u63, text),
    Heartbeat: st.builds(Heartbeat, u63),
    TraceReport: st.builds(TraceReport, text, endpoints, ids),
    Writing: st.builds(Writing, text, u63, u63, st.booleans()),
    AttachAck: st.builds(AttachAck, text, text),
    Sent: st.builds(Sent, text, u63),
    SendFailed: st.builds(SendFailed, text, u63, text),
    Received: st.builds(Received, text, u63),
    ReceiveFailed: st.builds(ReceiveFailed, text, u63, text),
    Released: st.builds(Released, text, u63),
    HeartbeatAck: st.builds(HeartbeatAck, u63, text),
    Error: st.builds(Error, text, text, text),
    Hello: st.builds(
        Hello,
        text,
        st.binary(max_size=512),
        layouts,
        st.lists(u63, max_size=4).map(tuple),
        u63,
        text,
        text,
        u63,
        u63,
        text,
        st.booleans(),
    ),
    PeerRegister: st.builds(PeerRegister, text, u63, ids, u63, u63, u63, u63, u63),
    Cancel: st.builds(Cancel, text, u63, text),
    CancelConfirmed: st.builds(CancelConfirmed, text, u63, u63),
    WriteFailedNotice: st.builds(WriteFailedNotice, text, u63, u63, text),
    OpsRequest: st.builds(
        OpsRequest,
        cmd=st.sampled_from(
            ["status", "pending", "peers", "transfers", "cancel", "drain", "metrics"]
        ),
        arg=text,
    ),
    OpsReply: st.builds(OpsReply, st.booleans(), json_data, text),
}
any_message = st.one_of(*STRATEGIES.values())
TYPES = sorted(STRATEGIES, key=lambda c: c.__name__)


def wire(msg: Any) -> dict[str, Any]:
    """The encoded message as a plain dict, for mutation."""
    out: dict[str, Any] = msgpack.unpackb(encode(msg), raw=False)
    return out


def pack(d: Any) -> bytes:
    out: bytes = msgpack.packb(d, use_bin_type=True)
    return out


def rejects(data: bytes, *needles: str, limits: Limits | None = None) -> str:
    """Assert decode raises ProtocolError whose text contains every needle; return the text."""
    with pytest.raises(ProtocolError) as info:
        decode(data, limits)
    msg = str(info.value)
    for n in needles:
        assert n in msg, f"{n!r} not in {msg!r}"
    return msg


def small_layout() -> KVLayout:
    return vllm_cpu_layout(
        num_layers=2, num_blocks=4, block_size=16, num_heads=2, head_size=32, dtype="bfloat16"
    )


SAMPLES: list[Any] = [
    Attach("eng", 1, 2, "both", (MemoryHandle("cpu_shm", b"/dev/shm/x", 1 << 20),), small_layout()),
    Register("tx-1", 3, (7, 8, 9), 40, ("tcp://10.0.0.1:5555",), 2, 30000),
    Hello("agent", b"\x00meta\xff", small_layout(), (1 << 40,), 2, "abcd", "eng", 0, 1, "tcp://h:1"),
    OpsReply(True, {"a": [1, 2.5, None, {"b": "c"}], "n": -3}, ""),
    OpsRequest("cancel", "tx-1"),
    Heartbeat(5),
]

# ---- round trips ----------------------------------------------------------------------------


def test_strategies_cover_every_message_type() -> None:
    assert set(STRATEGIES) == set(MESSAGE_TYPES.values())
    assert all(MESSAGE_TYPES[c.__name__] is c for c in STRATEGIES)


@pytest.mark.parametrize("cls", TYPES, ids=lambda c: c.__name__)
@FAST
@given(data=st.data())
def test_round_trip(cls: type, data: st.DataObject) -> None:
    msg = data.draw(STRATEGIES[cls])
    raw = encode(msg)
    assert isinstance(raw, bytes)
    out = decode(raw)
    assert type(out) is cls
    assert out == msg
    assert decode(bytearray(raw)) == msg and decode(memoryview(raw)) == msg
    for f in dataclasses.fields(out):  # sequences come back as tuples, as the dataclass says
        if typing.get_origin(typing.get_type_hints(cls)[f.name]) is tuple:
            assert type(getattr(out, f.name)) is tuple


def test_hand_encoded_dicts_decode() -> None:
    """Another implementation only needs msgpack: field order is free, defaults may be omitted."""
    reg = pack(
        {
            "timeout_ms": 500,
            "t": "Register",
            "block_ids": [1, 2, 3],
            "v": 6,
            "transfer_id": "abc",
            "attempt": 0,
            "num_tokens": 33,
            "prefill_endpoints": ["tcp://p:1", "tcp://p:2"],
            "prefill_tp_size": 2,
        }
    )
    assert decode(reg) == Register("abc", 0, (1, 2, 3), 33, ("tcp://p:1", "tcp://p:2"), 2, 500)
    assert decode(pack({"v": 6, "t": "OpsRequest", "cmd": "status"})) == OpsRequest("status")
    assert decode(pack({"v": 4, "t": "Error", "code": "E", "message": "m"})) == Error("E", "m")
    assert decode(pack({"v": 6, "t": "Error", "code": "E", "message": "m"})) == Error("E", "m")
    lay = small_layout()
    lay_map = dataclasses.asdict(lay)  # nested Packing maps, tuples as arrays
    att = {
        "v": 6,
        "t": "Attach",
        "engine_id": "e",
        "rank": 0,
        "tp_size": 1,
        "role": "decode",
        "regions": [{"kind": "cuda_ipc", "handle": b"h", "size": 10, "device": 3}],
        "layout": lay_map,
    }
    assert decode(pack(att)) == Attach(
        "e", 0, 1, "decode", (MemoryHandle("cuda_ipc", b"h", 10, 0, 3),), lay
    )


def test_register_1024_ids_decodes_fast() -> None:
    raw = encode(Register("t", 0, tuple(range(5000, 6024)), 16384, ("tcp://a:1",) * 4, 4, 1000))
    best = min(timeit.repeat(lambda: decode(raw), number=100, repeat=5)) / 100
    assert best < 2e-3, f"{best * 1e6:.0f} us per decode"


# ---- validation that must fail ---------------------------------------------------------------


def test_block_ids_must_be_ints() -> None:
    good = wire(SAMPLES[1])
    for bad, found in (
        ([1, "2", 3], "str"),
        ([1, True], "bool"),
        ([1.0], "float"),
        ([None], "NoneType"),
    ):
        rejects(pack({**good, "block_ids": bad}), "Register.block_ids", found)
    rejects(pack({**good, "block_ids": [0, -1]}), "Register.block_ids", "-1")
    rejects(pack({**good, "block_ids": [2**63]}), "Register.block_ids", str(2**63))
    rejects(pack({**good, "prefill_endpoints": ["a", b"b"]}), "Register.prefill_endpoints", "bytes")


def test_versions() -> None:
    good = wire(Heartbeat(1))
    assert good["v"] == PROTOCOL_VERSION == 6
    text = rejects(pack({**good, "v": 7}))
    assert text == "unsupported protocol version 7 (this side speaks 6)"
    # version 5 (before state groups): its daemons would copy a state page whole, by position
    assert rejects(pack({**good, "v": 5})) == "unsupported protocol version 5 (this side speaks 6)"
    rejects(pack({**good, "v": 0}), "unsupported protocol version 0")
    rejects(pack({**good, "v": 1}), "unsupported protocol version 1")  # one region per Attach
    rejects(pack({**good, "v": True}), "'v'", "bool")  # True == 1, but is not the version
    rejects(pack({**good, "v": "1"}), "'v'", "str")
    rejects(pack({k: v for k, v in good.items() if k != "v"}), "missing protocol version")


def test_envelope_and_top_level() -> None:
    good = wire(Heartbeat(1))
    rejects(pack({**good, "t": "Nope"}), "unknown message type 'Nope'")
    rejects(pack({**good, "t": 3}), "'t'", "int")
    rejects(pack({k: v for k, v in good.items() if k != "t"}), "missing message type")
    rejects(pack([1, "Heartbeat", 1]), "must be a msgpack map", "list")
    rejects(pack(5), "must be a msgpack map", "int")
    rejects(b"", "empty")
    rejects(encode(Heartbeat(1)) + b"\xc0", "trailing bytes")
    rejects(pack({1: 2}), "malformed msgpack")  # non-str map key
    rejects(pack({**good, "seq": msgpack.ExtType(1, b"x")}), "extension")
    with pytest.raises(ProtocolError, match="expected bytes"):
        decode("not bytes")  # type: ignore[arg-type]


def test_enumerated_fields() -> None:
    att = wire(SAMPLES[0])
    rejects(pack({**att, "role": "router"}), "Attach.role", "'router'", "prefill")
    rejects(pack({**att, "regions": [{**att["regions"][0], "kind": "tcp"}]}), "Attach.regions[0].kind")
    rejects(pack({**att, "regions": att["regions"][0]}), "Attach.regions", "expected array")
    rejects(pack({**wire(OpsRequest("status")), "cmd": "reboot"}), "OpsRequest.cmd", "'reboot'")


def test_decoded_multi_region_layout_is_validated() -> None:
    lay = per_layer_regions(small_layout())
    att = wire(Attach("e", 0, 1, "both", (MemoryHandle("cpu_shm", b"x", 1 << 20),) * 2, lay))
    m = att["layout"]
    rejects(pack({**att, "layout": {**m, "layer_regions": [0, 2]}}), "names region 2")
    rejects(pack({**att, "layout": {**m, "region_sizes": [m["region_sizes"][0], 100],
                                    "region_size": m["region_sizes"][0] + 100}}), "layer 1", "past the region")
    rejects(pack({**att, "layout": {**m, "region_size": 5}}), "not the sum of region_sizes")
    rejects(pack({**att, "layout": {**m, "num_kv": 3}}), "num_kv")
    rejects(pack({**att, "layout": {**m, "replicated": True, "total_heads": 4}}), "replicated")
    rejects(pack({**att, "regions": [att["regions"][0]] * 1025}), "exceed 1024")


def test_decoded_layout_is_validated() -> None:
    att = wire(SAMPLES[0])
    lay = att["layout"]
    rejects(
        pack({**att, "layout": {**lay, "region_size": 100}}),
        "Attach.layout",
        "invalid KVLayout",
        "past the region",
    )
    rejects(pack({**att, "layout": {**lay, "dtype": "float64"}}), "Attach.layout", "float64")
    rejects(pack({**att, "layout": {**lay, "num_layers": 3}}), "Attach.layout", "layer_offsets")
    bad_pack = {**lay["k_packing"], "granule_tokens": 0}
    rejects(pack({**att, "layout": {**lay, "k_packing": bad_pack}}), "Attach.layout", "granule")
    rejects(
        pack({**att, "layout": {**lay, "v_packing": {**lay["v_packing"], "x": 1}}}),
        "Attach.layout.v_packing",
        "'x'",
    )
    no_seg = {k: v for k, v in lay["k_packing"].items() if k != "seg_bytes"}
    rejects(
        pack({**att, "layout": {**lay, "k_packing": no_seg}}),
        "Attach.layout.k_packing",
        "'seg_bytes'",
    )
    rejects(pack({**wire(SAMPLES[2]), "layout": [1, 2]}), "Hello.layout", "list")


def test_ops_reply_data_is_json_like() -> None:
    base = wire(SAMPLES[3])

    def nest(n: int) -> dict[str, Any]:
        d: dict[str, Any] = {"leaf": 1}
        for _ in range(n - 1):
            d = {"k": d}
        return d

    ok = pack({**base, "data": nest(8)})
    assert decode(ok).data == nest(8)  # type: ignore[union-attr]
    rejects(pack({**base, "data": nest(9)}), "OpsReply.data", "deeper than 8")
    rejects(pack({**base, "data": {"a": [[b"x"]]}}), "OpsReply.data['a'][0][0]", "bytes")
    rejects(pack({**base, "data": {b"k": 1}}), "OpsReply.data", "b'k'")
    rejects(pack({**base, "data": [1]}), "OpsReply.data", "list")
    long = "x" * 10_000  # data strings are not field strings: metrics text may be long
    assert decode(pack({**base, "data": {"text": long}})).data["text"] == long  # type: ignore[union-attr]


def test_limits() -> None:
    reg = wire(SAMPLES[1])
    assert decode(pack({**reg, "block_ids": [1, 2, 3, 4]}), Limits(max_list=4))
    rejects(
        pack({**reg, "block_ids": [1, 2, 3, 4, 5]}),
        "max_array_len(4)",
        "max_list=4",
        limits=Limits(max_list=4),
    )
    rejects(
        pack({**reg, "transfer_id": "x" * 9}),
        "Register.transfer_id",
        "max_str 8",
        limits=Limits(max_str=8),
    )
    rejects(
        pack({**reg, "prefill_endpoints": ["x" * 9]}),
        "Register.prefill_endpoints",
        "max_str 8",
        limits=Limits(max_str=8),
    )
    assert decode(
        pack({**reg, "transfer_id": "x" * 8, "prefill_endpoints": ["y" * 8]}), Limits(max_str=8)
    )
    rejects(pack({**reg, "attempt": 101}), "Register.attempt", "101", limits=Limits(max_int=100))
    rejects(
        pack({**reg, "block_ids": [101]}), "Register.block_ids", "101", limits=Limits(max_int=100)
    )
    hello = encode(Hello("a", b"12345", small_layout(), 0, 1, "c", "e", 0, 1, "ep"))
    rejects(hello, "max_bin_len(4)", "max_bytes=4", limits=Limits(max_bytes=4))
    rejects(hello, "exceeds max_message 10", limits=Limits(max_message=10))
    big = {str(i): i for i in range(100)}
    assert decode(pack({**wire(SAMPLES[3]), "data": big}), Limits(max_list=100))
    rejects(pack({**wire(SAMPLES[3]), "data": big}), "max_map_len", limits=Limits(max_list=99))


def test_hostile_length_prefixes_do_not_allocate() -> None:
    """Headers claiming 4 Gi elements/bytes must fail fast instead of pre-allocating."""
    for header in (
        b"\xdd\xff\xff\xff\xff",
        b"\xdf\xff\xff\xff\xff",
        b"\xc6\xff\xff\xff\xff",
        b"\xdb\xff\xff\xff\xff",
    ):
        rejects(header + b"\x00" * 8)
        rejects(b"\x83\xa1v\x02\xa1t\xa9Heartbeat\xa3seq" + header)


def test_encode_rejects_what_it_cannot_send() -> None:
    with pytest.raises(ProtocolError, match="not a registered message"):
        encode(small_layout())  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match="Attach.layout"):
        encode(Attach("e", 0, 1, "both", (MemoryHandle("cpu_shm", b"", 0),), {"a": 1}))  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match="cannot encode OpsReply"):
        encode(OpsReply(True, {"x": object()}))


# ---- mutations of valid encodings -----------------------------------------------------------


def test_every_truncation_is_rejected() -> None:
    for msg in SAMPLES:
        raw = encode(msg)
        for i in range(len(raw)):
            rejects(raw[:i])


@MORE
@given(msg=any_message, data=st.data())
def test_flipped_bytes_reject_or_decode_consistently(msg: Any, data: st.DataObject) -> None:
    raw = bytearray(encode(msg))
    for _ in range(data.draw(st.integers(1, 3))):
        pos = data.draw(st.integers(0, len(raw) - 1))
        raw[pos] ^= data.draw(st.integers(1, 255))
    try:
        out = decode(bytes(raw))
    except ProtocolError:
        return
    assert MESSAGE_TYPES[type(out).__name__] is type(out)  # a flip inside a value can stay valid
    again = encode(out)
    # A flip can make an OpsReply float NaN (never equal to itself): compare the bytes then.
    assert decode(again) == out or encode(decode(again)) == again


@MORE
@given(raw=st.binary(max_size=200))
def test_random_bytes_raise_only_protocol_error(raw: bytes) -> None:
    try:
        decode(raw)
    except ProtocolError:
        pass


HEARTBEAT_PREFIX = b"\x83\xa1v\x02\xa1t\xa9Heartbeat\xa3seq"


@MORE
@given(tail=st.binary(max_size=40))
def test_random_field_bytes_raise_only_protocol_error(tail: bytes) -> None:
    try:
        decode(HEARTBEAT_PREFIX + tail)
    except ProtocolError:
        pass


msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda ch: (
        st.lists(ch, max_size=3)
        | st.dictionaries(st.text(max_size=6) | st.binary(max_size=4), ch, max_size=3)
    ),
    max_leaves=10,
)


@MORE
@given(msg=any_message, data=st.data())
def test_random_field_values_raise_only_protocol_error(msg: Any, data: st.DataObject) -> None:
    d = wire(msg)
    key = data.draw(st.sampled_from(sorted(d)))
    d[key] = data.draw(msgpack_values)
    try:
        out = decode(pack(d))
    except ProtocolError:
        return
    assert decode(encode(out)) == out


def _wrong_values(hint: Any) -> list[Any]:
    """Wire values of the wrong type (or range) for a field of type ``hint``."""
    if hint is bool:
        return [1, 0, "true", None]
    if hint is int:
        return ["1", 1.0, True, None, [1], b"1", -1, 2**64 - 1]
    if hint is str:
        return [1, b"x", None, ["x"], True]
    if hint is bytes:
        return ["x", 1, None, [1]]
    if typing.get_args(hint) == (int, Ellipsis):
        return ["x", 1, None, {"a": 1}, [1, "x"], [True], [-1], [1.0], b"\x01"]
    if typing.get_args(hint) == (str, Ellipsis):
        return ["x", 1, None, [1], ["a", b"b"]]
    if typing.get_origin(hint) is dict:
        return [[], "x", 1, None, {"a": b"x"}]
    if typing.get_origin(hint) is tuple:  # tuple of a dataclass: an array of its maps
        return ["x", 1, None, {}, [1], [{"bogus": 1}], [None]]
    assert dataclasses.is_dataclass(hint), hint
    return [1, "x", None, [], {}, {"bogus": 1}]


@pytest.mark.parametrize("cls", TYPES, ids=lambda c: c.__name__)
@FAST
@given(data=st.data())
def test_field_mutations_name_the_field(cls: type, data: st.DataObject) -> None:
    msg = data.draw(STRATEGIES[cls])
    good = wire(msg)
    hints = typing.get_type_hints(cls)
    name = cls.__name__
    for f in dataclasses.fields(cls):
        where = f"{name}.{f.name}"
        # drop it: required -> named error; defaulted -> the default
        dropped = {k: v for k, v in good.items() if k != f.name}
        if f.default is dataclasses.MISSING:
            rejects(pack(dropped), name, "missing field", repr(f.name))
        else:
            assert decode(pack(dropped)) == dataclasses.replace(msg, **{f.name: f.default})
        # change its type
        bad = data.draw(st.sampled_from(_wrong_values(hints[f.name])), label=where)
        rejects(pack({**good, f.name: bad}), where)
    # add a field
    extra = data.draw(st.text(min_size=1, max_size=10).filter(lambda k: k not in good))
    rejects(pack({**good, extra: 1}), name, "unexpected field", repr(extra)[:20])


# ---- payloads inside a bytes field (MemoryHandle.handle): encode_struct / decode_struct ----


def test_memory_payloads_round_trip_and_validate_like_wire_fields() -> None:
    from kvpush.proto.codec import decode_struct, encode_struct
    from kvpush.proto.handles import CudaIpcInfo, RegionError, ShmInfo, cuda_info, shm_info

    info = ShmInfo("/torch_1_2_3", 4096, 7, 99)
    raw = encode_struct(info)
    assert decode_struct(ShmInfo, raw) == info
    assert shm_info(MemoryHandle("cpu_shm", raw, 1 << 20, 64)) == info
    good = {"name": "/torch_1", "data_offset": 8, "pid": 1, "start_time": 2}
    for bad, field in [
        ({**good, "name": "/../etc/passwd"}, "invalid shm name"),  # validate(): no ".."
        ({**good, "name": "/a/b"}, "invalid shm name"),  # one file directly in /dev/shm
        ({**good, "pid": -1}, "ShmInfo.pid"),  # non-negative ints
        ({**good, "pid": True}, "ShmInfo.pid"),  # bool is not int
        ({**good, "extra": 1}, "unexpected field"),
        ({k: v for k, v in good.items() if k != "pid"}, "missing field 'pid'"),
    ]:
        with pytest.raises(ProtocolError, match=field):
            decode_struct(ShmInfo, msgpack.packb(bad))
        with pytest.raises(RegionError, match=field):  # what the daemon's open_region raises
            shm_info(MemoryHandle("cpu_shm", msgpack.packb(bad), 1 << 20))
    for raw_bad in (b"", b"\xc1", msgpack.packb([1, 2]), msgpack.packb(good) + b"\x00"):
        with pytest.raises(ProtocolError):
            decode_struct(ShmInfo, raw_bad)
    with pytest.raises(RegionError, match="kind"):
        shm_info(MemoryHandle("cuda_ipc", raw, 1 << 20))
    with pytest.raises(RegionError, match="offset"):
        shm_info(MemoryHandle("cpu_shm", raw, 10, 10))
    cuda = CudaIpcInfo(1, b"\x01" * 64, 1 << 20, 0, b"rc", 0, b"", False)
    h = MemoryHandle("cuda_ipc", encode_struct(cuda), 1 << 20, 0, 1)
    assert cuda_info(h) == cuda
    with pytest.raises(RegionError, match="disagree"):
        cuda_info(dataclasses.replace(h, device=0))
    with pytest.raises(ProtocolError, match="event_sync_required"):
        decode_struct(CudaIpcInfo, encode_struct(dataclasses.replace(cuda, event_sync_required=1)))


def test_encode_struct_takes_dataclass_instances_only() -> None:
    from kvpush.proto.codec import encode_struct
    from kvpush.proto.handles import ShmInfo

    with pytest.raises(ProtocolError):
        encode_struct({"name": "/x"})
    with pytest.raises(ProtocolError):
        encode_struct(ShmInfo)


def test_version_2_peers_are_refused_in_words_they_can_read() -> None:
    """Version 3 renamed PeerRegister.deadline_ms (a duration) to timeout_ms. A version-2
    PeerRegister is refused as a whole (VersionMismatch names its version), never read with
    a field missing; the Error answering it is encoded in version 2's envelope, which a
    version-2 side decodes, and a version-2 side's own Error is read here."""
    from kvpush.proto import VersionMismatch
    from kvpush.proto.messages import ERROR_COMPATIBLE_VERSIONS

    old = {"v": 2, "t": "PeerRegister", "transfer_id": "t", "attempt": 0, "block_ids": [1],
           "num_tokens": 16, "dest_rank": 0, "dest_tp_size": 1, "expected_dests": 1, "deadline_ms": 500}
    with pytest.raises(VersionMismatch, match="unsupported protocol version 2 .this side speaks 6.") as e:
        decode(pack(old))
    assert e.value.version == 2 and 2 in ERROR_COMPATIBLE_VERSIONS
    with pytest.raises(ProtocolError, match="unexpected field.*deadline_ms"):
        decode(pack({**old, "v": 6}))  # the old field name under the new version: missing field
    refusal = Error("protocol", str(e.value))
    raw = encode(refusal, version=2)
    assert msgpack.unpackb(raw)["v"] == 2 and decode(raw) == refusal
    with pytest.raises(ProtocolError, match="cannot encode PeerRegister for protocol version 2"):
        encode(PeerRegister("t", 0, (1,), 16, 0, 1, 1, 500), version=2)
    with pytest.raises(VersionMismatch):
        decode(pack({"v": 1, "t": "Error", "code": "E", "message": "m"}))  # not compatible


def test_version_4_peers_are_refused_naming_both_versions() -> None:
    """Version 5 added PeerRegister.key and the notification's tag (issue 44, item 1): a version-4
    producer would send untagged notifications that are never counted, so a version-4 peer is
    refused as a whole, in words naming both versions, and its Error still reads both ways."""
    from kvpush.proto import VersionMismatch

    old = {"v": 4, "t": "PeerRegister", "transfer_id": "t", "attempt": 0, "block_ids": [1],
           "num_tokens": 16, "dest_rank": 0, "dest_tp_size": 1, "expected_dests": 1, "timeout_ms": 500}
    with pytest.raises(VersionMismatch, match=r"^unsupported protocol version 4 \(this side speaks 6\)$"):
        decode(pack(old))
    refusal = Error("protocol", "unsupported protocol version 4 (this side speaks 6)")
    assert decode(encode(refusal, version=4)) == refusal


def test_a_version_4_register_is_refused_never_read_as_one_group() -> None:
    """Version 5 also added KV cache groups (Register / PeerRegister / PrefillDone.kv_groups): a
    version-4 peer's Register is refused as a whole, naming its version and ours, never read
    as one group; its Error is still read, and ours reaches it in its own envelope."""
    from kvpush.proto import VersionMismatch
    from kvpush.proto.messages import ERROR_COMPATIBLE_VERSIONS

    old = {"v": 4, "t": "Register", "transfer_id": "t", "attempt": 0, "block_ids": [1, 2], "num_tokens": 16,
           "prefill_endpoints": ["tcp://p:1"], "prefill_tp_size": 1, "timeout_ms": 500}
    with pytest.raises(VersionMismatch, match="unsupported protocol version 4 .this side speaks 6.") as e:
        decode(pack(old))
    assert e.value.version == 4 and 4 in ERROR_COMPATIBLE_VERSIONS
    raw = encode(Error("protocol", str(e.value)), version=4)
    assert msgpack.unpackb(raw)["v"] == 4
    grouped = Register("t", 0, (5, 6, 0, 7), 16, ("tcp://p:1",), 1, 500, kv_groups=(2, 2))
    assert decode(encode(grouped)) == grouped
