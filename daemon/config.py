"""kvpushd configuration as data: one :class:`DeviceConfig` per accelerator daemon, one
:class:`NodeConfig` for the supervisor, loaded from TOML + ``KVPUSH_*`` env + CLI flags.

Config is plain data (uvicorn style) so the supervisor can pickle a ``DeviceConfig`` into a
spawned child, ``kvpushd print-config`` can show exactly what runs, and tests build configs
without files. Precedence: **flags > environment > file > defaults**.

File format (every key optional; the same top-level keys are read from ``KVPUSH_<KEY>`` env
variables, e.g. ``KVPUSH_METRICS_PORT=0``, ``KVPUSH_DEVICES=cpu0,cpu1``)::

    devices = ["cuda0", "cuda1"]   # or "all" (default), or: count = 2
    device_kind = "auto"           # for count/"all": auto | cpu | cuda
    runtime_dir = "/run/kvpush"    # sockets live here
    base_port = 17500              # peer port of device i = base_port + i (0: ephemeral)
    peer_host = "0.0.0.0"          # peer endpoint bind address
    advertise_host = "10.0.0.5"    # address peers are told to use (default: peer_host)
    backend = "UCX"                # or "LIBFABRIC"
    ucx_error_handling_mode = "peer"  # or "none": faster same-host WRITEs (see DeviceConfig)
    metrics_host = "127.0.0.1"
    metrics_port = 9470            # 0 disables /metrics and /health
    log_level = "INFO"
    log_format = "text"             # or "json": one object per line, for a log pipeline
    # otlp_traces_endpoint = "http://127.0.0.1:4318/v1/traces"  # OpenTelemetry spans (kvpush[otel])
    lease_s = 30.0                 # longest lease a PrefillDone may ask for
    register_timeout_s = 30.0      # longest timeout a Register may ask for
    # engine_socket / ops_socket are templates: {runtime_dir} {index} {name}
    # Peer authentication is on by default (CURVE + ZAP): this node's secret certificate
    # (`kvpushd keygen`) and the public certificates of the nodes allowed in / dialled.
    curve_secret_key_file = "/etc/kvpush/node.key_secret"
    authorized_keys_dir = "/etc/kvpush/authorized_keys"
    insecure_peers = false         # true: no authentication (logged, kvpushctl status shows it)

    [device.cuda1]                 # per-device overrides of the device keys (+ peer_port)
    peer_port = 17601

The dataclass fields are the schema (the idiom is :mod:`kvpush.common.configschema`, shared with
the plugin and the router): a field made with :func:`key` is a config key, and its metadata
(``Key``: doc, scope, parser, choices, check) drives parsing, validation, ``print-config``
and docs/configuration.md; ``KEY_DOCS`` has every key's doc. Types are strict in the file
and the flags; only ``KVPUSH_*`` environment strings are converted. Load-time keys that shape the node
(devices, count, device_kind, base_port) are :class:`DeviceSelection`; values derived from
them (socket templates, peer_port, advertise_host) are filled in by ``DeviceConfig``
itself, whichever way it was built.

Unknown keys are errors that name the key (and the nearest known one). Environment names
other than the listed keys are ignored: the engine plugin shares the ``KVPUSH_`` prefix.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import InitVar, dataclass, field
from typing import Any

from kvpush.common import configschema as schema
from kvpush.common.configschema import ConfigError, Parser, check_fields, docs_of
from kvpush.common.configschema import check_count as _check_count
from kvpush.common.configschema import check_non_negative as _check_non_negative
from kvpush.common.configschema import check_nonempty as _check_nonempty
from kvpush.common.configschema import check_port as _check_port
from kvpush.common.configschema import check_positive as _check_positive
from kvpush.common.configschema import p_mode as _p_mode
from kvpush.common.configschema import p_port as _p_port
from kvpush.common.configschema import p_upper as _p_upper
from kvpush.proto import naming
from kvpush.proto.codec import DEFAULT_LIMITS, largest_inbound, largest_ops_request

DEFAULT_CONFIG = "/etc/kvpush/kvpushd.toml"  # read when it exists and no file is named
DEFAULT_BASE_PORT = 17500
DEFAULT_METRICS_PORT = 9470
DEFAULT_MAX_MESSAGE = -(-largest_inbound() // (64 << 10)) * (64 << 10)  # 2686976: 2.6 MiB
OPS_MAX_MESSAGE = largest_ops_request()  # the ops socket only ever receives an OpsRequest
BACKENDS = ("UCX", "LIBFABRIC")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
LOG_FORMATS = ("text", "json")
DEVICE_KINDS = ("cpu", "cuda")
ENV_PREFIX = "KVPUSH_"
UNIX_PATH_MAX = 107  # sun_path is 108 bytes including the NUL
_DEVICE_NAME = re.compile(r"^(cpu|cuda)(0|[1-9][0-9]*)$")

# Where a key may be set. NODE: top level of the file, KVPUSH_<KEY>, flags. DEVICE: the
# same places (as every device's default) and in [device.<name>]. TABLE: [device.<name>] only.
NODE, DEVICE, TABLE = "node", "device", "table"




def default_runtime_dir(env: Mapping[str, str] | None = None, euid: int | None = None) -> str:
    """Where sockets go: systemd's RuntimeDirectory, /run/kvpush for root, else per-user."""
    env = os.environ if env is None else env
    euid = os.geteuid() if euid is None else euid
    if env.get("RUNTIME_DIRECTORY"):  # set by systemd for RuntimeDirectory=kvpush
        return env["RUNTIME_DIRECTORY"].split(":")[0]
    if euid == 0:
        return "/run/kvpush"
    if env.get("XDG_RUNTIME_DIR"):
        return os.path.join(env["XDG_RUNTIME_DIR"], "kvpush")
    return f"/tmp/kvpush-{euid}"


def parse_device_name(name: str) -> tuple[str, int]:
    """'cuda3' -> ('cuda', 3). The index picks the accelerator, the port and socket names."""
    m = _DEVICE_NAME.match(name)
    if m is None:
        raise ConfigError(f"device name {name!r} is not cpu<N> or cuda<N> (e.g. 'cuda0')")
    return m.group(1), int(m.group(2))


_CPU_LIST = re.compile(r"^\s*\d+(\s*-\s*\d+)?(\s*,\s*\d+(\s*-\s*\d+)?)*\s*$")
MAX_CPU = 1 << 16  # a CPU number beyond this is a typo, not a core


def cpu_set(spec: str) -> set[int]:
    """"0", "0-3", "0,2-3" (taskset's list syntax) -> the set of CPU numbers."""
    if not _CPU_LIST.match(spec):
        raise ConfigError(f"cpus {spec!r} is not a CPU list like \"0\", \"0-3\" or \"0,2-3\"")
    out: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.strip().partition("-")
        a, b = int(lo), int(hi or lo)
        if a > b or b >= MAX_CPU:
            raise ConfigError(f"cpus {spec!r}: range {part.strip()!r} is empty or beyond CPU {MAX_CPU - 1}")
        out.update(range(a, b + 1))
    return out


def _check_cpus(key: str, value: Any) -> None:
    if value:
        try:
            cpu_set(value)
        except ConfigError as exc:
            raise ConfigError(f"{key}: {exc}") from None


def peer_port_for(base_port: int, index: int) -> int:
    """Device ``index``'s peer port: base_port + index (base_port 0: ephemeral, 0)."""
    if not base_port:
        return 0
    if base_port + index > 65535:
        raise ConfigError(f"base_port {base_port} + device index {index} exceeds 65535")
    return base_port + index


# Measured (docs/results/layerwise-loopback.md): on a link where a request's whole WRITE takes
# less, streaming it cost more TTFT than it hid.
LAYERWISE_MIN_TRANSFER_MS = 20.0

# --------------------------------------------------------------------------- schema

# The schema idiom (Key, key(), parsers, checks, parse_layer) is kvpush.common.configschema, shared
# with the plugin and the router; the daemon's own parsers and checks are here.

@schema.takes_strings
def _p_devices(v: Any) -> str | list[str]:
    if isinstance(v, str):
        if v.strip().lower() == "all":
            return "all"
        return [s.strip() for s in v.split(",") if s.strip()]
    if isinstance(v, (list, tuple)) and all(isinstance(s, str) for s in v):
        return list(v)
    raise TypeError('expected "all" or a list of device names')


def key(default: Any = dataclasses.MISSING, doc: str = "", *, scope: str = DEVICE,
        **kw: Any) -> Any:
    """A dataclass field that is also a config key (a device key unless ``scope`` says)."""
    return schema.key(default, doc, scope=scope, **kw)


def _check_message_size(key: str, value: Any) -> None:
    _check_count(key, value)
    lo, hi = 64 << 10, DEFAULT_LIMITS.max_message
    if not lo <= value <= hi:
        raise ConfigError(f"{key} must be in {lo}..{hi} (a real Hello is ~1.3 KB; the codec "
                          f"takes at most {hi}), got {value}")


def _check_advertise(key: str, value: Any) -> None:
    _check_nonempty(key, value)
    if value in ("0.0.0.0", "::", "*"):
        raise ConfigError(
            f"{key} {value!r} is a wildcard; set it to an address peers can reach "
            "(peer_host may stay a wildcard)")


def _check_mode(key: str, mode: Any) -> None:
    if not isinstance(mode, int) or isinstance(mode, bool) or not 0 <= mode <= 0o777:
        raise ConfigError(f"{key} must be a permission mode in 0o000..0o777, got {mode!r}")
    if mode & 0o600 != 0o600:
        raise ConfigError(f"{key} {mode:#o} must give the owner read+write (the daemon)")
    if mode & 0o007:
        raise ConfigError(
            f"{key} {mode:#o} lets any local user drive the daemon; use 0o600, or 0o660 "
            "with a group shared with the engines")


def _check_ipc(key: str, endpoint: str) -> None:
    if not endpoint.startswith("ipc://"):
        raise ConfigError(f"{key} must be an ipc:// endpoint, got {endpoint!r}")
    path = endpoint[len("ipc://"):]
    if not os.path.isabs(path):
        raise ConfigError(f"{key} must name an absolute path, got {endpoint!r}")
    if len(os.fsencode(path)) > UNIX_PATH_MAX:
        raise ConfigError(
            f"{key} path is {len(os.fsencode(path))} bytes, over the {UNIX_PATH_MAX}-byte "
            f"unix socket limit: {path!r} (use a shorter runtime_dir)")


def _check_abs(key: str, path: str) -> None:
    if not os.path.isabs(path):
        raise ConfigError(f"{key} must be an absolute path: {path!r}")


_TEMPLATES = " ".join("{" + f + "}" for f in naming.TEMPLATE_FIELDS)


@dataclass
class DeviceConfig:
    """One accelerator's daemon. Empty socket strings / None ports are filled from index."""

    index: int
    name: str
    device_kind: str = "cpu"
    runtime_dir: str = field(default_factory=default_runtime_dir)
    engine_socket: str = key("", f"engine socket template ({_TEMPLATES}); default "
                             f"{naming.ENGINE_SOCKET_TEMPLATE}", check=_check_ipc,
                             shown_default=f'"{naming.ENGINE_SOCKET_TEMPLATE}"')
    ops_socket: str = key("", f"ops socket template (kvpushctl); default "
                          f"{naming.OPS_SOCKET_TEMPLATE}", check=_check_ipc,
                          shown_default=f'"{naming.OPS_SOCKET_TEMPLATE}"')
    peer_host: str = key("127.0.0.1", "peer endpoint bind address", check=_check_nonempty)
    peer_port: int | None = key(None, "peer port; default base_port + index (0: ephemeral)",
                                scope=TABLE, parse=_p_port, check=_check_port,
                                shown_default="base_port + index")
    advertise_host: str | None = key(None, "address peers are told to use (default: peer_host)",
                                     check=_check_advertise, shown_default="peer_host")
    backend: str = key("UCX", "NIXL backend", parse=_p_upper, choices=BACKENDS)
    cpus: str = key("", 'cores this device\'s daemon runs on, e.g. its engine\'s ("0", "0-3", "0,2-3"): '
                    "the daemon works while its engine waits for it (PrefillDone, Received), so beside "
                    "its own engine it neither queues behind the other engine's busy loop nor "
                    "preempts its compute. Empty: wherever kvpushd runs", scope=TABLE, check=_check_cpus)
    ucx_error_handling_mode: str = key(
        "peer", 'UCX only: "peer" reports a dead peer as an error on the WRITE; "none" makes '
        "same-host WRITEs one-sided shared-memory copies (3-20x faster here, no receiver "
        "polling) at the cost of UCX treating a peer failure as fatal to the agent",
        choices=("peer", "none"))
    socket_mode: int = key(0o600, "permission bits of the engine and ops sockets",
                           parse=_p_mode, check=_check_mode, type_name="octal integer",
                           shown_default="0o600")
    lease_s: float = key(30.0, "longest lease a PrefillDone may ask for (its lease_ms is "
                         "capped at this): how long the daemon holds an engine's source blocks",
                         check=_check_positive)
    register_timeout_s: float = key(30.0, "longest registration timeout a Register (and the "
                                    "PeerRegister it becomes) may ask for: their timeout_ms "
                                    "is capped at this", check=_check_positive)
    write_timeout_s: float = key(5.0, "a posted WRITE not complete by then fails",
                                 check=_check_positive)
    peer_timeout_s: float = key(10.0, "a peer daemon silent this long (or not answering the "
                                "handshake) is dropped", check=_check_positive)
    insecure_peers: bool = key(False, "true: the peer port runs without authentication (anyone "
                               "who reaches it gets NIXL access to the KV memory); logged at start "
                               "and shown by kvpushctl status. Default: CURVE keys required")
    curve_secret_key_file: str = key(
        "/etc/kvpush/node.key_secret", "this node's secret certificate (`kvpushd keygen`): the "
        "peer endpoint is a CURVE server with it and dials peers as a CURVE client")
    authorized_keys_dir: str = key(
        "/etc/kvpush/authorized_keys", "public certificates (.key) of the nodes allowed in (ZAP) "
        "and dialled by host; re-read when it changes (add, rotate, revoke a node)")
    peer_handshake_s: float = key(5.0, "a connection that has not finished ZeroMQ's greeting "
                                  "(and CURVE handshake) by then is closed (ZMQ_HANDSHAKE_IVL on "
                                  "the peer and ops sockets; on the engine socket, one that has "
                                  "not sent a whole first frame): half-open connections do not "
                                  "pile up", check=_check_positive)
    max_message_bytes: int = key(
        DEFAULT_MAX_MESSAGE, "largest frame the engine and peer sockets and our DEALERs take "
        "(ZMQ_MAXMSGSIZE; the ops socket takes at most the largest OpsRequest): a larger one "
        "closes that connection, so a connection buffers at most this much. Default: the largest "
        "legitimate message (a Register of 262144 block IDs; a Hello with 1 MiB of NIXL "
        "metadata, a real one is ~1.3 KB), rounded up to 64 KiB", check=_check_message_size)
    max_transfers_per_peer: int = key(
        4096, "live transfers one decode peer (one certificate identity, all its sessions "
        "together) may hold registrations in; a PeerRegister over it is refused (quota) and "
        "the other peers are not affected", check=_check_count)
    max_blocks_per_peer: int = key(
        1 << 20, "block IDs one decode peer (one certificate identity, all its sessions "
        "together) may hold registered here across its live transfers; a PeerRegister over it "
        "is refused (quota)", check=_check_count)
    max_progress_chunks: int = key(
        1024, "prefill side: request chunks one LayerProgress frame may name (layer-wise "
        "streaming); a larger frame is refused whole", check=_check_count)
    max_layer_groups: int = key(
        256, "prefill side: layer groups kept per transfer and epoch before the seal; past it "
        "that transfer stops streaming and its final write covers everything", check=_check_count)
    max_layer_writes_in_flight: int = key(
        4, "prefill side: group WRITEs (layer-wise streaming) in flight per transfer; the rest "
        "wait and go out together", check=_check_count)
    max_layer_writes_total: int = key(
        64, "prefill side: group WRITEs in flight across all transfers", check=_check_count)
    layerwise_min_transfer_ms: float = key(
        LAYERWISE_MIN_TRANSFER_MS, 'prefill side: an engine streaming with layerwise "auto" gets '
        "a request's layer groups written early only to a decode peer whose whole WRITE of it "
        "would take this long or more, at the rate WRITEs to that peer recently moved (kvpushctl "
        "peers: WRITE-RATE; a peer not measured yet is streamed to). Below it the transfer is too "
        'short to hide and streaming only costs. Layerwise "on" streams regardless; 0: "auto" '
        'streams like "on"', check=_check_non_negative)
    max_event_waiting: int = key(
        4096, "prefill side, GPU: layer groups (one per request chunk of a LayerProgress) held "
        "until the engine's CUDA event says their kernels finished; past it new ones are not "
        "streamed (counted) and the request's final write covers them. 0: no GPU streaming",
        check=_check_count)
    max_event_wait_s: float = key(
        5.0, "prefill side, GPU: a layer group whose CUDA event has not fired by then is not "
        "streamed (counted; the final write covers it): a stalled engine never holds the daemon. "
        "Longer than one forward", check=_check_positive)
    max_producers: int = key(
        256, "decode side: prefill daemons this daemon (one engine rank) may be linked to at "
        "once; the endpoints come from requests' kv_transfer_params, so a registration that "
        "would dial one more fails at once instead", check=_check_count)
    max_handshaking_producers: int = key(
        16, "decode side: prefill daemons dialled but not yet answering the handshake; bounds "
        "what registrations naming dead or closed endpoints cost (file descriptors, connects)",
        check=_check_count)
    max_sessions_per_peer: int = key(
        64, "sessions one certificate identity may hold with this daemon (a decode node has one "
        "per decode daemon; restarts replace theirs), counted from the CURVE handshake on: a "
        "session over it is refused before its Hello",
        check=_check_count)
    hello_deadline_s: float = key(
        10.0, "a peer connection (CURVE session) that carries no handshaken session this long "
        "after it was accepted, or after its session ended (refused, evicted), is closed: "
        "sessions that never say Hello cannot pile up", check=_check_positive)
    reserved_fds: int = key(
        256, "file descriptors the peer port leaves to the daemon's own files (allowlist, "
        "shared memory, engine and producer sockets): it holds at most the soft RLIMIT_NOFILE "
        "less this many connections, closing the newest beyond", check=_check_count)
    poll_min_s: float = key(0.0005, "shortest sleep of the idle loop", check=_check_positive)
    poll_max_s: float = key(0.05, "longest sleep of the idle loop", check=_check_positive)
    max_prepped_descriptors: int = key(
        1 << 22, "prepared NIXL descriptor lists per (region, peer) up to this many "
        "descriptors a side (layers x blocks x pattern entries); above it a peer's WRITEs "
        "build their descriptors per transfer", check=_check_count)
    log_level: str = key("INFO", "log level", parse=_p_upper, choices=LOG_LEVELS)
    log_format: str = key("text", "log line format: text, or json (one object per line)",
                          choices=LOG_FORMATS)
    otlp_traces_endpoint: str | None = key(
        None, "OTLP/HTTP traces URL (e.g. http://collector:4318/v1/traces): export each "
        "transfer's timeline as an OpenTelemetry span (needs kvpush[otel]); unset: off")
    # Not a field: the node's base_port, from which a peer_port left None is derived.
    base_port: InitVar[int] = DEFAULT_BASE_PORT

    def __post_init__(self, base_port: int) -> None:
        """The load step for derived values, run for every config however it was built
        (load_config, tests, the harness): socket templates, peer_port, advertise_host."""
        fmt = {"runtime_dir": self.runtime_dir, "index": self.index, "name": self.name}
        try:
            self.engine_socket = (self.engine_socket or naming.ENGINE_SOCKET_TEMPLATE).format(**fmt)
            self.ops_socket = (self.ops_socket or naming.OPS_SOCKET_TEMPLATE).format(**fmt)
        except (KeyError, IndexError, ValueError) as e:
            raise ConfigError(
                f"device {self.name}: bad socket template ({e!r}); placeholders are "
                f"{_TEMPLATES}") from None
        if self.peer_port is None:
            self.peer_port = peer_port_for(base_port, self.index)
        if self.advertise_host is None:
            self.advertise_host = self.peer_host

    @property
    def peer_endpoint(self) -> str:
        """Address peers connect to (advertised in Hello / to the router)."""
        return f"tcp://{self.advertise_host}:{self.peer_port}"

    def validate(self) -> None:
        """Raise ConfigError on the first inconsistent field, naming it."""
        where = f"device {self.name}"
        kind, index = parse_device_name(self.name)
        if (kind, index) != (self.device_kind, self.index):
            raise ConfigError(f"{where}: name does not match device_kind/index")
        _check_abs(f"{where}: runtime_dir", self.runtime_dir)
        check_fields(self, where)
        if self.engine_socket == self.ops_socket:
            raise ConfigError(f"{where}: engine_socket and ops_socket are the same")
        if self.poll_min_s > self.poll_max_s:
            raise ConfigError(f"{where}: poll_min_s {self.poll_min_s} > poll_max_s {self.poll_max_s}")

@dataclass
class NodeConfig:
    """The supervisor: which device daemons to run, how to restart them, where to serve HTTP."""

    devices: list[DeviceConfig]
    runtime_dir: str = key(doc="socket directory of every device (systemd: RuntimeDirectory)",
                           scope=NODE, factory=default_runtime_dir, check=_check_abs,
                           shown_default="systemd's RUNTIME_DIRECTORY, else /run/kvpush for "
                           "root, else $XDG_RUNTIME_DIR/kvpush")
    metrics_host: str = key("127.0.0.1", "address of /metrics and /health", scope=NODE)
    metrics_port: int = key(DEFAULT_METRICS_PORT, "port of /metrics and /health; 0: no HTTP "
                            "server", scope=NODE, parse=_p_port, check=_check_port)
    restart_backoff_s: float = key(1.0, "first restart delay; doubles per consecutive crash",
                                   scope=NODE, check=_check_positive)
    restart_backoff_max_s: float = key(30.0, "longest restart delay", scope=NODE,
                                       check=_check_positive)
    max_restarts_per_minute: int = key(5, "per device, beyond that it is held down; 0: never "
                                       "restart", scope=NODE, check=_check_non_negative)
    stop_timeout_s: float = key(10.0, "SIGTERM -> SIGKILL grace", scope=NODE,
                                check=_check_positive)
    ready_timeout_s: float = key(120.0, "a child not ready by then is killed; 0: wait forever",
                                 scope=NODE, check=_check_non_negative)
    log_level: str = key("INFO", "log level of the supervisor (and default of every device)",
                         scope=NODE, parse=_p_upper, choices=LOG_LEVELS)
    log_format: str = key("text", "log line format of the supervisor (and default of every "
                          "device): text, or json (one object per line)", scope=NODE,
                          choices=LOG_FORMATS)

    def validate(self) -> None:
        if not self.devices:
            raise ConfigError("no devices configured")
        check_fields(self, "")
        if self.restart_backoff_max_s < self.restart_backoff_s:
            raise ConfigError(f"restart_backoff_max_s {self.restart_backoff_max_s} < "
                              f"restart_backoff_s {self.restart_backoff_s}")
        seen: dict[Any, str] = {}
        for dev in self.devices:
            dev.validate()
            if dev.runtime_dir != self.runtime_dir:
                raise ConfigError(f"device {dev.name}: runtime_dir differs from the node's")
            for what, k in (("name", dev.name), ("index", dev.index),
                            ("engine_socket", dev.engine_socket), ("ops_socket", dev.ops_socket)):
                _claim(seen, (what, k), dev.name, f"{what} {k!r}")
            if dev.peer_port:
                _claim(seen, ("port", dev.peer_port), dev.name, f"peer_port {dev.peer_port}")
        if self.metrics_port and ("port", self.metrics_port) in seen:
            raise ConfigError(f"metrics_port {self.metrics_port} is also a peer_port")


@dataclass
class DeviceSelection:
    """Load-time keys: which devices run and how their ports are numbered. They shape the
    NodeConfig (its device list, each peer_port) and are not kept in it."""

    config: str | None = key(None, "the TOML file: the flag, else KVPUSH_CONFIG, else "
                             f"{DEFAULT_CONFIG} when it exists", scope=NODE)
    devices: str | list[str] = key("all", '"all" (every visible GPU, else cpu0) or device '
                                   "names: a TOML list, comma-separated in env and flags "
                                   "(cuda0,cuda1)", scope=NODE, parse=_p_devices,
                                   type_name='"all" or list of strings')
    count: int | None = key(None, "run devices 0..count-1 of device_kind instead", scope=NODE)
    device_kind: str = key("auto", 'kind for count / "all"; auto: cuda if visible',
                           scope=NODE, choices=("auto", *DEVICE_KINDS))
    base_port: int = key(DEFAULT_BASE_PORT, "peer port of device i = base_port + i (0: "
                         "ephemeral)", scope=NODE, parse=_p_port)


def _claim(seen: dict[Any, str], key: Any, owner: str, what: str) -> None:
    if key in seen:
        raise ConfigError(f"devices {seen[key]} and {owner} both use {what}")
    seen[key] = owner


# --------------------------------------------------------------------------- loading

def _keys(cls: type, *scopes: str) -> dict[str, Parser]:
    """Key name -> parser of ``cls``'s key fields in ``scopes``, read from the schema."""
    return schema.parsers_of(cls, *scopes)


def _union(*tables: dict[str, Parser]) -> dict[str, Parser]:
    out: dict[str, Parser] = {}
    for t in tables:
        for name, parser in t.items():
            if out.setdefault(name, parser) is not parser:  # e.g. log_level: node and device
                raise TypeError(f"config key {name!r} is parsed two ways")
    return out


NODE_KEYS = _union(_keys(DeviceSelection, NODE), _keys(NodeConfig, NODE))
DEVICE_KEYS = _keys(DeviceConfig, DEVICE)
TOP_KEYS = _union(NODE_KEYS, DEVICE_KEYS)  # the file's top level, KVPUSH_<KEY>, flags
TABLE_KEYS = _union(DEVICE_KEYS, _keys(DeviceConfig, TABLE))  # [device.<name>]
KEY_DOCS: dict[str, str] = docs_of(DeviceSelection, NodeConfig, DeviceConfig)
_EXCLUSIVE = ("devices", "count")  # one logical setting: a higher layer's choice replaces


def env_var(key: str) -> str:
    return ENV_PREFIX + key.upper()


def _unknown(where: str, key: str, known: Mapping[str, Any]) -> ConfigError:
    if known is TABLE_KEYS and key in TOP_KEYS:
        return ConfigError(f"{where}: unknown key {key!r} in a device table (a node-wide key: "
                           "set it at the top level)")
    if known is not TABLE_KEYS and key in TABLE_KEYS:
        return ConfigError(f"{where}: unknown key {key!r} at the top level (per device only: "
                           f"set it in [device.<name>]; base_port numbers all devices)")
    near = difflib.get_close_matches(key, list(known), n=1)
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    return ConfigError(f"{where}: unknown key {key!r}{hint}")


def _parse_layer(where: str, raw: Mapping[str, Any], known: Mapping[str, Parser],
                 name_of: Callable[[str], str] = str, *, text: bool = False) -> dict[str, Any]:
    out = schema.parse_layer(where, raw, known, name_of=name_of, text=text,
                             unknown=lambda w, k: _unknown(w, k, known))
    if sum(k in out for k in _EXCLUSIVE) > 1:
        raise ConfigError(f"{where}: set either 'devices' or 'count', not both")
    return out


def _read_file(path: str) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"cannot read config file {path!r}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path}: invalid TOML: {e}") from None
    tables = raw.pop("device", {})
    if not isinstance(tables, dict):
        raise ConfigError(f"config file {path}: 'device' must be a table of [device.<name>] tables")
    top = _parse_layer(f"config file {path}", raw, TOP_KEYS)
    per_dev: dict[str, dict[str, Any]] = {}
    for name, table in tables.items():
        parse_device_name(name)
        if not isinstance(table, dict):
            raise ConfigError(f"config file {path}: [device.{name}] must be a table")
        per_dev[name] = _parse_layer(f"config file {path} [device.{name}]", table, TABLE_KEYS)
    return top, per_dev


def _merge(*layers: Mapping[str, Any]) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for layer in layers:
        if any(k in layer for k in _EXCLUSIVE):
            for k in _EXCLUSIVE:
                merged.pop(k, None)
        merged.update(layer)
    return merged


def _pick(merged: Mapping[str, Any], keys: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in merged.items() if k in keys}


def _torch_cuda_count() -> int:
    """Visible CUDA devices; torch is imported only when "all"/"auto" needs it."""
    try:
        import torch
    except ImportError:
        return 0
    return int(torch.cuda.device_count())


def resolve_devices(sel: DeviceSelection, cuda_count: Callable[[], int]) -> list[tuple[str, int]]:
    """(kind, index) per device from devices / count / device_kind."""
    check_fields(sel, "")
    kind = sel.device_kind
    if sel.count is None and sel.devices != "all":  # explicit names carry their kind
        if not sel.devices:
            raise ConfigError("devices is empty")
        return [parse_device_name(name) for name in sel.devices]
    if kind == "auto":
        kind = "cuda" if cuda_count() > 0 else "cpu"
    if sel.count is not None:
        if sel.count < 1:
            raise ConfigError(f"count must be >= 1, got {sel.count}")
        return [(kind, i) for i in range(sel.count)]
    n = cuda_count() if kind == "cuda" else 1
    if n < 1:
        raise ConfigError("devices = 'all' with device_kind = 'cuda' but no CUDA device is visible")
    return [(kind, i) for i in range(n)]


def load_config(path: str | None = None, overrides: Mapping[str, Any] | None = None,
                env: Mapping[str, str] | None = None, *,
                cuda_count: Callable[[], int] = _torch_cuda_count,
                default_file: bool = True) -> NodeConfig:
    """Effective, validated NodeConfig. ``overrides`` are CLI flags by top-level key (None =
    not given); ``env`` defaults to os.environ; KVPUSH_CONFIG names the file if path is None,
    and without either DEFAULT_CONFIG (/etc/kvpush/kvpushd.toml) is read when it exists
    (``default_file=False``: never).

    Node keys go to the NodeConfig, device keys at the top level are every device's
    defaults under its own [device.<name>] table, and DeviceConfig derives the rest."""
    env = os.environ if env is None else env
    flags = _parse_layer("command line", {k: v for k, v in (overrides or {}).items()
                                          if v is not None}, TOP_KEYS, lambda k: f"--{k.replace('_', '-')}")
    env_raw = {k: env[env_var(k)] for k in TOP_KEYS if env_var(k) in env}
    from_env = _parse_layer("environment", env_raw, TOP_KEYS, env_var, text=True)
    path = path or flags.get("config") or from_env.get("config")
    if path is None and default_file and os.path.exists(DEFAULT_CONFIG):
        path = DEFAULT_CONFIG
    file_top, per_dev = _read_file(path) if path else ({}, {})
    merged = _merge(file_top, from_env, flags)
    sel = DeviceSelection(**_pick(merged, _keys(DeviceSelection, NODE)))
    node_kw = _pick(merged, _keys(NodeConfig, NODE))
    node_kw["runtime_dir"] = node_kw.get("runtime_dir") or default_runtime_dir(env)
    defaults = _pick(merged, DEVICE_KEYS)
    devices = [
        DeviceConfig(index=index, name=f"{kind}{index}", device_kind=kind,
                     runtime_dir=node_kw["runtime_dir"], base_port=sel.base_port,
                     **{**defaults, **per_dev.get(f"{kind}{index}", {})})
        for kind, index in resolve_devices(sel, cuda_count)
    ]
    node = NodeConfig(devices=devices, **node_kw)
    node.validate()
    return node


# --------------------------------------------------------------------------- dumping

def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {v!r} as TOML")


def dump_toml(node: NodeConfig) -> str:
    """Effective config as TOML that load_config reads back to an equal NodeConfig."""
    lines = ["# effective kvpushd configuration"]
    for name in _keys(NodeConfig, NODE):
        lines.append(f"{name} = {_toml_value(getattr(node, name))}")
    lines.append(f"devices = {_toml_value([d.name for d in node.devices])}")
    for dev in node.devices:
        lines += ["", f"[device.{dev.name}]"]
        for name, parser in TABLE_KEYS.items():
            value = getattr(dev, name)
            if value is not None:
                lines.append(f"{name} = {f'0o{value:03o}' if parser is _p_mode else _toml_value(value)}")
    return "\n".join(lines) + "\n"


def dump_json(node: NodeConfig) -> str:
    return json.dumps(dataclasses.asdict(node), indent=2, sort_keys=False)
