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
    # engine_socket / ops_socket are templates: {runtime_dir} {index} {name}
    # CURVE (all three or none): the peer endpoint becomes a CURVE server with this keypair
    # (zmq.auth certificate files) and a ZAP allowlist of the public keys found in
    # authorized_keys_dir; outgoing peer connections use the same keypair as client.
    curve_secret_key_file = "/etc/kvpush/node.key_secret"
    curve_public_key_file = "/etc/kvpush/node.key"
    authorized_keys_dir = "/etc/kvpush/authorized_keys"

    [device.cuda1]                 # per-device overrides of the device keys (+ peer_port)
    peer_port = 17601

Unknown keys are errors that name the key (and the nearest known one). Environment names
other than the listed keys are ignored: the engine plugin shares the ``KVPUSH_`` prefix.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the tomli backport has the same API
    import tomli as tomllib  # type: ignore[no-redef]

DEFAULT_BASE_PORT = 17500
DEFAULT_METRICS_PORT = 9470
BACKENDS = ("UCX", "LIBFABRIC")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
DEVICE_KINDS = ("cpu", "cuda")
ENV_PREFIX = "KVPUSH_"
UNIX_PATH_MAX = 107  # sun_path is 108 bytes including the NUL
_DEVICE_NAME = re.compile(r"^(cpu|cuda)(0|[1-9][0-9]*)$")


class ConfigError(ValueError):
    """Invalid configuration; the message names the key and where it came from."""


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


@dataclass
class DeviceConfig:
    """One accelerator's daemon. Empty socket strings / None ports are filled from index."""

    index: int
    name: str
    device_kind: str = "cpu"
    runtime_dir: str = field(default_factory=default_runtime_dir)
    engine_socket: str = ""
    ops_socket: str = ""
    peer_host: str = "127.0.0.1"
    peer_port: int | None = None  # None: DEFAULT_BASE_PORT + index; 0: ephemeral
    advertise_host: str | None = None  # None: peer_host
    backend: str = "UCX"
    # UCX only: "peer" (default) reports a dead peer as an error on the WRITE; "none" makes
    # same-host WRITEs one-sided shared-memory copies (3-20x faster here, no receiver
    # polling) at the cost of UCX treating a peer failure as fatal to the agent.
    ucx_error_handling_mode: str = "peer"
    socket_mode: int = 0o600
    lease_s: float = 30.0
    register_timeout_s: float = 30.0
    write_timeout_s: float = 5.0
    peer_timeout_s: float = 10.0
    curve_secret_key_file: str | None = None
    curve_public_key_file: str | None = None
    authorized_keys_dir: str | None = None
    poll_min_s: float = 0.0005
    poll_max_s: float = 0.05
    # Prepared NIXL descriptor lists per (region, peer): layers x blocks (x pattern entries)
    # descriptors a side; above this a peer's WRITEs build their descriptors per transfer.
    max_prepped_descriptors: int = 1 << 22
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        fmt = {"runtime_dir": self.runtime_dir, "index": self.index, "name": self.name}
        if not self.engine_socket:
            self.engine_socket = "ipc://{runtime_dir}/engine-{index}.sock"
        if not self.ops_socket:
            self.ops_socket = "ipc://{runtime_dir}/ops-{index}.sock"
        try:
            self.engine_socket = self.engine_socket.format(**fmt)
            self.ops_socket = self.ops_socket.format(**fmt)
        except (KeyError, IndexError, ValueError) as e:
            raise ConfigError(
                f"device {self.name}: bad socket template ({e!r}); placeholders are "
                "{runtime_dir} {index} {name}") from None
        if self.peer_port is None:
            self.peer_port = DEFAULT_BASE_PORT + self.index
        if self.advertise_host is None:
            self.advertise_host = self.peer_host

    @property
    def curve_enabled(self) -> bool:
        return self.curve_secret_key_file is not None

    @property
    def peer_bind(self) -> str:
        """ZeroMQ bind address of the peer endpoint ('*' port when ephemeral)."""
        return f"tcp://{self.peer_host}:{self.peer_port or '*'}"

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
        if not os.path.isabs(self.runtime_dir):
            raise ConfigError(f"{where}: runtime_dir must be an absolute path: {self.runtime_dir!r}")
        for key in ("engine_socket", "ops_socket"):
            _check_ipc(f"{where}: {key}", getattr(self, key))
        if self.engine_socket == self.ops_socket:
            raise ConfigError(f"{where}: engine_socket and ops_socket are the same")
        _check_port(f"{where}: peer_port", self.peer_port, allow_zero=True)
        for key in ("peer_host", "advertise_host"):
            if not getattr(self, key):
                raise ConfigError(f"{where}: {key} is empty")
        if self.advertise_host in ("0.0.0.0", "::", "*"):
            raise ConfigError(
                f"{where}: advertise_host {self.advertise_host!r} is a wildcard; set it to an "
                "address peers can reach (peer_host may stay a wildcard)")
        _check_choice(f"{where}: backend", self.backend, BACKENDS)
        _check_choice(f"{where}: ucx_error_handling_mode", self.ucx_error_handling_mode, ("peer", "none"))
        _check_choice(f"{where}: log_level", self.log_level, LOG_LEVELS)
        _check_mode(f"{where}: socket_mode", self.socket_mode)
        for key in ("lease_s", "register_timeout_s", "write_timeout_s", "peer_timeout_s",
                    "poll_min_s", "poll_max_s"):
            _check_positive(f"{where}: {key}", getattr(self, key))
        if not isinstance(self.max_prepped_descriptors, int) or self.max_prepped_descriptors < 0:
            raise ConfigError(f"{where}: max_prepped_descriptors must be a non-negative integer")
        if self.poll_min_s > self.poll_max_s:
            raise ConfigError(f"{where}: poll_min_s {self.poll_min_s} > poll_max_s {self.poll_max_s}")
        self._validate_curve(where)

    def _validate_curve(self, where: str) -> None:
        keys = ("curve_secret_key_file", "curve_public_key_file", "authorized_keys_dir")
        given = [k for k in keys if getattr(self, k) is not None]
        if given and len(given) != len(keys):
            missing = [k for k in keys if k not in given]
            raise ConfigError(f"{where}: CURVE needs all of {', '.join(keys)}; missing {', '.join(missing)}")
        for key in keys[:2]:
            path = getattr(self, key)
            if path is not None and not os.path.isfile(path):
                raise ConfigError(f"{where}: {key} {path!r} is not a readable file")
        if self.authorized_keys_dir is not None and not os.path.isdir(self.authorized_keys_dir):
            raise ConfigError(f"{where}: authorized_keys_dir {self.authorized_keys_dir!r} is not a directory")


@dataclass
class NodeConfig:
    """The supervisor: which device daemons to run, how to restart them, where to serve HTTP."""

    devices: list[DeviceConfig]
    runtime_dir: str = field(default_factory=default_runtime_dir)
    metrics_host: str = "127.0.0.1"
    metrics_port: int = DEFAULT_METRICS_PORT  # 0 = no HTTP server
    restart_backoff_s: float = 1.0  # first restart delay; doubles per consecutive crash
    restart_backoff_max_s: float = 30.0
    max_restarts_per_minute: int = 5  # per device; 0 = never restart
    stop_timeout_s: float = 10.0  # SIGTERM -> SIGKILL grace
    ready_timeout_s: float = 120.0  # a child not ready by then is killed; 0 = wait forever
    log_level: str = "INFO"

    def validate(self) -> None:
        if not self.devices:
            raise ConfigError("no devices configured")
        if not os.path.isabs(self.runtime_dir):
            raise ConfigError(f"runtime_dir must be an absolute path: {self.runtime_dir!r}")
        _check_port("metrics_port", self.metrics_port, allow_zero=True)
        _check_choice("log_level", self.log_level, LOG_LEVELS)
        for key in ("restart_backoff_s", "restart_backoff_max_s", "stop_timeout_s"):
            _check_positive(key, getattr(self, key))
        if self.restart_backoff_max_s < self.restart_backoff_s:
            raise ConfigError(f"restart_backoff_max_s {self.restart_backoff_max_s} < "
                              f"restart_backoff_s {self.restart_backoff_s}")
        if self.ready_timeout_s < 0 or not math.isfinite(self.ready_timeout_s):
            raise ConfigError(f"ready_timeout_s must be >= 0, got {self.ready_timeout_s}")
        if self.max_restarts_per_minute < 0:
            raise ConfigError(f"max_restarts_per_minute must be >= 0, got {self.max_restarts_per_minute}")
        seen: dict[Any, str] = {}
        for dev in self.devices:
            dev.validate()
            if dev.runtime_dir != self.runtime_dir:
                raise ConfigError(f"device {dev.name}: runtime_dir differs from the node's")
            for what, key in (("name", dev.name), ("index", dev.index),
                              ("engine_socket", dev.engine_socket), ("ops_socket", dev.ops_socket)):
                _claim(seen, (what, key), dev.name, f"{what} {key!r}")
            if dev.peer_port:
                _claim(seen, ("port", dev.peer_port), dev.name, f"peer_port {dev.peer_port}")
        if self.metrics_port and ("port", self.metrics_port) in seen:
            raise ConfigError(f"metrics_port {self.metrics_port} is also a peer_port")


def _claim(seen: dict[Any, str], key: Any, owner: str, what: str) -> None:
    if key in seen:
        raise ConfigError(f"devices {seen[key]} and {owner} both use {what}")
    seen[key] = owner


def _check_port(key: str, port: Any, allow_zero: bool) -> None:
    lo = 0 if allow_zero else 1
    if not isinstance(port, int) or isinstance(port, bool) or not lo <= port <= 65535:
        raise ConfigError(f"{key} must be an integer in {lo}..65535, got {port!r}")


def _check_choice(key: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{key} must be one of {', '.join(choices)}, got {value!r}")


def _check_positive(key: str, value: Any) -> None:
    if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{key} must be a finite number > 0, got {value!r}")


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


# --------------------------------------------------------------------------- loading

# Parsers turn a raw value (typed from TOML/flags, or a string from env) into a typed value.
Parser = Callable[[Any], Any]


def _p_str(v: Any) -> str:
    if not isinstance(v, str):
        raise TypeError("expected a string")
    return v


def _p_int(v: Any) -> int:
    if isinstance(v, str):
        try:
            return int(v.strip(), 0)
        except ValueError:
            raise ValueError("expected an integer") from None
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError("expected an integer")
    return v


def _p_port(v: Any) -> int:
    port = _p_int(v)
    if not 0 <= port <= 65535:
        raise ValueError("must be a port number in 0..65535")
    return port


def _p_float(v: Any) -> float:
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            raise ValueError("expected a number") from None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError("expected a number")
    return float(v)


def _p_mode(v: Any) -> int:
    """TOML 0o600 arrives as int; env '0600' / '600' / '0o600' are octal."""
    if isinstance(v, str):
        try:
            return int(v.strip().lower().removeprefix("0o"), 8)
        except ValueError:
            raise ValueError("expected an octal mode such as 0600") from None
    return _p_int(v)


def _p_upper(v: Any) -> str:
    return _p_str(v).upper()


def _p_devices(v: Any) -> str | list[str]:
    if isinstance(v, str):
        if v.strip().lower() == "all":
            return "all"
        return [s.strip() for s in v.split(",") if s.strip()]
    if isinstance(v, (list, tuple)) and all(isinstance(s, str) for s in v):
        return list(v)
    raise TypeError('expected "all" or a list of device names')


_DEVICE_KEYS: dict[str, Parser] = {
    "engine_socket": _p_str, "ops_socket": _p_str, "peer_host": _p_str,
    "advertise_host": _p_str, "backend": _p_upper, "socket_mode": _p_mode,
    "ucx_error_handling_mode": _p_str,
    "lease_s": _p_float, "register_timeout_s": _p_float, "write_timeout_s": _p_float,
    "peer_timeout_s": _p_float, "curve_secret_key_file": _p_str,
    "curve_public_key_file": _p_str, "authorized_keys_dir": _p_str,
    "poll_min_s": _p_float, "poll_max_s": _p_float, "log_level": _p_upper,
    "max_prepped_descriptors": _p_int,
}
_NODE_KEYS: dict[str, Parser] = {
    "config": _p_str, "devices": _p_devices, "count": _p_int, "device_kind": _p_str,
    "base_port": _p_port, "runtime_dir": _p_str, "metrics_host": _p_str,
    "metrics_port": _p_port, "restart_backoff_s": _p_float, "restart_backoff_max_s": _p_float,
    "max_restarts_per_minute": _p_int, "stop_timeout_s": _p_float, "ready_timeout_s": _p_float,
}
TOP_KEYS: dict[str, Parser] = {**_NODE_KEYS, **_DEVICE_KEYS}
TABLE_KEYS: dict[str, Parser] = {**_DEVICE_KEYS, "peer_port": _p_port}
_EXCLUSIVE = ("devices", "count")  # one logical setting: a higher layer's choice replaces


def env_var(key: str) -> str:
    return ENV_PREFIX + key.upper()


def _unknown(where: str, key: str, known: Mapping[str, Any]) -> ConfigError:
    near = difflib.get_close_matches(key, list(known), n=1)
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    return ConfigError(f"{where}: unknown key {key!r}{hint}")


def _parse_layer(where: str, raw: Mapping[str, Any], known: Mapping[str, Parser],
                 name_of: Callable[[str], str] = str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in known:
            raise _unknown(where, key, known)
        try:
            out[key] = known[key](value)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{where}: {name_of(key)}: {e}; got {value!r}") from None
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


def _torch_cuda_count() -> int:
    """Visible CUDA devices; torch is imported only when "all"/"auto" needs it."""
    try:
        import torch
    except ImportError:
        return 0
    return int(torch.cuda.device_count())


def resolve_devices(merged: Mapping[str, Any], cuda_count: Callable[[], int]) -> list[tuple[str, int]]:
    """(kind, index) per device from devices / count / device_kind."""
    kind = merged.get("device_kind", "auto")
    if kind not in ("auto", *DEVICE_KINDS):
        raise ConfigError(f"device_kind must be auto, cpu or cuda, got {kind!r}")
    devices = merged.get("devices", "all")
    if "count" not in merged and devices != "all":  # explicit names carry their kind
        if not devices:
            raise ConfigError("devices is empty")
        return [parse_device_name(name) for name in devices]
    if kind == "auto":
        kind = "cuda" if cuda_count() > 0 else "cpu"
    if "count" in merged:
        n = merged["count"]
        if n < 1:
            raise ConfigError(f"count must be >= 1, got {n}")
        return [(kind, i) for i in range(n)]
    n = cuda_count() if kind == "cuda" else 1
    if n < 1:
        raise ConfigError("devices = 'all' with device_kind = 'cuda' but no CUDA device is visible")
    return [(kind, i) for i in range(n)]


def load_config(path: str | None = None, overrides: Mapping[str, Any] | None = None,
                env: Mapping[str, str] | None = None, *,
                cuda_count: Callable[[], int] = _torch_cuda_count) -> NodeConfig:
    """Effective, validated NodeConfig. ``overrides`` are CLI flags by top-level key (None =
    not given); ``env`` defaults to os.environ; KVPUSH_CONFIG names the file if path is None."""
    env = os.environ if env is None else env
    flags = _parse_layer("command line", {k: v for k, v in (overrides or {}).items()
                                          if v is not None}, TOP_KEYS, lambda k: f"--{k.replace('_', '-')}")
    env_raw = {k: env[env_var(k)] for k in TOP_KEYS if env_var(k) in env}
    from_env = _parse_layer("environment", env_raw, TOP_KEYS, env_var)
    path = path or flags.get("config") or from_env.get("config")
    file_top, per_dev = _read_file(path) if path else ({}, {})
    merged = _merge(file_top, from_env, flags)
    merged.pop("config", None)
    runtime_dir = merged.get("runtime_dir") or default_runtime_dir(env)
    base_port = merged.get("base_port", DEFAULT_BASE_PORT)
    _check_port("base_port", base_port, allow_zero=True)
    dev_defaults = {k: v for k, v in merged.items() if k in _DEVICE_KEYS}
    devices = []
    for kind, index in resolve_devices(merged, cuda_count):
        name = f"{kind}{index}"
        port = base_port + index if base_port else 0
        if port > 65535:
            raise ConfigError(f"base_port {base_port} + device index {index} exceeds 65535")
        kw = {"peer_port": port, **dev_defaults, **per_dev.get(name, {})}
        devices.append(DeviceConfig(index=index, name=name, device_kind=kind,
                                    runtime_dir=runtime_dir, **kw))
    node_kw = {k: merged[k] for k in ("metrics_host", "metrics_port", "restart_backoff_s",
                                      "restart_backoff_max_s", "max_restarts_per_minute",
                                      "stop_timeout_s", "ready_timeout_s", "log_level")
               if k in merged}
    node = NodeConfig(devices=devices, runtime_dir=runtime_dir, **node_kw)
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
    for f in dataclasses.fields(NodeConfig):
        if f.name != "devices":
            lines.append(f"{f.name} = {_toml_value(getattr(node, f.name))}")
    lines.append(f"devices = {_toml_value([d.name for d in node.devices])}")
    for dev in node.devices:
        lines += ["", f"[device.{dev.name}]"]
        for f in dataclasses.fields(DeviceConfig):
            value = getattr(dev, f.name)
            if f.name in ("index", "name", "device_kind", "runtime_dir") or value is None:
                continue
            text = f"0o{value:03o}" if f.name == "socket_mode" else _toml_value(value)
            lines.append(f"{f.name} = {text}")
    return "\n".join(lines) + "\n"


def dump_json(node: NodeConfig) -> str:
    return json.dumps(dataclasses.asdict(node), indent=2, sort_keys=False)
