"""The router's configuration: data, and one load step (TOML file, then flags).

    # /etc/kvpush/router.toml
    listen = "0.0.0.0:8000"
    policy = "least-loaded"          # or "round-robin"
    prefill_timeout_s = 300
    request_timeout_s = 600
    shutdown_grace_s = 30            # SIGTERM: stop taking requests, let these finish
    max_body_bytes = 8388608         # a larger request body is refused (413), never forwarded
    log_format = "text"              # or "json": one object per line
    first_token = "prefill"          # or "decode": where a streamed answer's first token comes from
    # otlp_traces_endpoint = "http://127.0.0.1:4318/v1/traces"  # OpenTelemetry (kvpush[otel])

    [[prefill]]
    url = "http://10.0.0.5:8100"     # the prefill engine's OpenAI server
    host = "10.0.0.5"                # its node's kvpushd (advertise_host)
    base_port = 17500                # the peer port of the daemon of its rank 0
    tp_size = 2                      # rank r's daemon listens at base_port + r

    [[decode]]
    url = "http://10.0.0.6:8200"
    node = "dnode"                   # its node's certificate name: only it may take the KV

A prefill engine may instead list its daemons' endpoints (``endpoints = ["tcp://h:p", ...]``,
rank order). On the command line: ``--prefill URL=HOST:BASE_PORT[,tp=N]`` or
``--prefill URL=tcp://h:p[,tcp://h:p...]``; ``--decode URL[,node=NAME]``. Flags add to the file's pools
and override its scalars.
"""

from __future__ import annotations

import ipaddress
import re
import tomllib
from dataclasses import dataclass, field
from typing import Any

from kvpush.common.configschema import (
    ConfigError,
    check_fields,
    check_non_negative,
    key,
    p_str,
    parse_layer,
    parsers_of,
    takes_strings,
)

__all__ = ["Backend", "RouterConfig", "RouterConfigError", "load", "node_endpoints", "parse_decode", "parse_prefill"]

POLICIES = ("least-loaded", "round-robin")
LOG_FORMATS = ("text", "json")
FIRST_TOKEN = ("prefill", "decode")
MAX_TP = 1024
_HOSTPORT = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.\-]+):(\d{1,5})$")


class RouterConfigError(ConfigError):
    """A router setting is missing or malformed: the message names it."""


@dataclass
class Backend:
    """One engine behind the router (its daemons' endpoints, for a prefill engine), and its load."""

    url: str
    kv_endpoints: list[str] = field(default_factory=list)
    node: str = ""  # a decode engine's node (certificate name): the prefill daemon admits only it
    in_flight: int = 0
    served: int = 0
    failed: int = 0


def _check_otlp_url(name: str, value: Any) -> None:
    if value is not None and not str(value).startswith(("http://", "https://")):
        raise ConfigError(f"{name} must be an http(s) URL, got {value!r}")


def _check_token(name: str, value: Any) -> None:
    if len(str(value)) < 16:
        raise ConfigError(f"{name} must be at least 16 characters")


def _check_body_bytes(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1024 <= value <= 1 << 30:
        raise ConfigError(f"{name} must be an integer in [1024, 2**30], got {value!r}")


@dataclass
class RouterConfig:
    """The router's settings; the fields made with ``key`` are the file's scalar keys
    (kvpush.common.configschema), ``listen`` sets host and port, [[prefill]] / [[decode]] the pools."""

    prefill: list[Backend]
    decode: list[Backend]
    policy: str = key("least-loaded", "how a request picks its engines among several",
                      choices=POLICIES)
    host: str = "127.0.0.1"
    port: int = 8000
    # The operators' endpoints (/router/status, /router/trace, /router/drain) listen apart from
    # the clients' (admin_listen; None: the client port + 1 on loopback; port 0: any free one).
    admin_host: str = "127.0.0.1"
    admin_port: int | None = None
    admin_token: str | None = key(None, "operator endpoints (/router/*) want the header Authorization: "
                                  "Bearer TOKEN; required when admin_listen is not a loopback address",
                                  check=_check_token)
    connect_timeout_s: float = key(10.0, "seconds to connect to an engine",
                                   check=check_non_negative)
    prefill_timeout_s: float = key(300.0, "seconds for the prefill leg", check=check_non_negative)
    request_timeout_s: float = key(600.0, "seconds for the decode leg", check=check_non_negative)
    refusal_grace_s: float = key(2.0, "a prefill leg refused (4xx): seconds the decode leg, which carries "
                                 "the request as the client sent it, gets to give its own answer",
                                 check=check_non_negative)
    shutdown_grace_s: float = key(30.0, "SIGTERM: stop taking requests, let those in flight "
                                  "finish for this long", check=check_non_negative)
    max_body_bytes: int = key(8 << 20, "a larger request body is refused (413): never buffered, "
                              "never forwarded", check=_check_body_bytes)
    log_format: str = key("text", "log line format: text, or json (one object per line)",
                          choices=LOG_FORMATS)
    first_token: str = key("prefill", "where a streamed answer's first token comes from: prefill (the "
                           "prefill leg's, sent as soon as it answers; the decode stream is checked "
                           "against it) or decode (after the KV arrived)", choices=FIRST_TOKEN)
    expose_transfer_id: bool = key(False, "debugging: answer each request with its transfer ID "
                                   "(x-kvpush-transfer-id); clients never need it")
    otlp_traces_endpoint: str | None = key(None, "OTLP/HTTP traces URL (kvpush[otel]): export "
                                           "request timelines; unset: no export",
                                           check=_check_otlp_url, type_name="http(s) URL")

    def validate(self) -> None:
        if not self.prefill or not self.decode:
            raise RouterConfigError("the router needs at least one prefill and one decode engine")
        try:
            check_fields(self, "")
        except ConfigError as e:
            raise RouterConfigError(str(e)) from None
        if not 0 <= self.port < 65536:
            raise RouterConfigError(f"port {self.port} out of range")
        if self.admin_port is None:
            self.admin_port = self.port + 1 if self.port else 0
        if not 0 <= self.admin_port < 65536:
            raise RouterConfigError(f"admin port {self.admin_port} out of range")
        if not self.admin_token and not _loopback(self.admin_host):
            raise RouterConfigError(f"admin_listen {self.admin_host}:{self.admin_port} is not a loopback address: "
                                    "set admin_token too (operator endpoints show every request's timings)")
        for b in [*self.prefill, *self.decode]:
            if not b.url.startswith(("http://", "https://")):
                raise RouterConfigError(f"engine url must be http(s)://..., got {b.url!r}")
        for b in self.prefill:
            if not b.kv_endpoints:
                raise RouterConfigError(f"prefill engine {b.url}: name its node (host, base_port, tp_size) "
                                        "or its daemons' endpoints")


def node_endpoints(host: str, base_port: int, tp_size: int) -> list[str]:
    """The peer endpoints of a prefill engine's daemons: rank r at ``base_port + r``."""
    if not isinstance(host, str) or not host or any(c in host for c in "/ "):
        raise RouterConfigError(f"bad kvpushd host {host!r}")
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or not 1 <= tp_size <= MAX_TP:
        raise RouterConfigError(f"tp_size must be 1..{MAX_TP}, got {tp_size!r}")
    if not isinstance(base_port, int) or isinstance(base_port, bool) or not 0 < base_port <= 65536 - tp_size:
        raise RouterConfigError(f"base_port {base_port!r} out of range for tp_size {tp_size}")
    h = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return [f"tcp://{h}:{base_port + r}" for r in range(tp_size)]


def _endpoint(ep: str) -> str:
    m = _HOSTPORT.match(ep.removeprefix("tcp://")) if ep.startswith("tcp://") else None
    if m is None or not 0 < int(m.group(2)) < 65536:
        raise RouterConfigError(f"bad daemon endpoint {ep!r} (want tcp://host:port)")
    return ep


def parse_prefill(spec: str) -> Backend:
    """``URL=HOST:BASE_PORT[,tp=N]`` or ``URL=tcp://h:p[,tcp://h:p...]``."""
    url, sep, rest = spec.partition("=")
    if not sep or not url.startswith(("http://", "https://")) or not rest:
        raise RouterConfigError(f"--prefill wants URL=HOST:BASE_PORT[,tp=N] or URL=tcp://host:port[,...], "
                                f"got {spec!r}")
    parts = [p for p in rest.split(",") if p]
    if parts[0].startswith("tcp://"):
        return Backend(url.rstrip("/"), [_endpoint(p) for p in parts])
    m = _HOSTPORT.match(parts[0])
    if m is None:
        raise RouterConfigError(f"--prefill {url}: {parts[0]!r} is not HOST:BASE_PORT")
    tp = 1
    for opt in parts[1:]:
        k, _, v = opt.partition("=")
        if k != "tp" or not v.isdigit():
            raise RouterConfigError(f"--prefill {url}: unknown option {opt!r} (known: tp=N)")
        tp = int(v)
    return Backend(url.rstrip("/"), node_endpoints(m.group(1).strip("[]"), int(m.group(2)), tp))


def _prefill_entry(i: int, d: Any) -> Backend:
    if not isinstance(d, dict) or not isinstance(d.get("url"), str):
        raise RouterConfigError(f"[[prefill]] #{i + 1}: needs url")
    unknown = set(d) - {"url", "host", "base_port", "tp_size", "endpoints"}
    if unknown:
        raise RouterConfigError(f"[[prefill]] {d['url']}: unknown key(s) {sorted(unknown)}")
    if "endpoints" in d:
        if {"host", "base_port", "tp_size"} & set(d):
            raise RouterConfigError(f"[[prefill]] {d['url']}: endpoints or host/base_port/tp_size, not both")
        eps = d["endpoints"]
        if not isinstance(eps, list) or not eps or not all(isinstance(e, str) for e in eps):
            raise RouterConfigError(f"[[prefill]] {d['url']}: endpoints must be a list of tcp://host:port")
        return Backend(d["url"].rstrip("/"), [_endpoint(e) for e in eps])
    if "host" not in d or "base_port" not in d:
        raise RouterConfigError(f"[[prefill]] {d['url']}: needs host and base_port (and tp_size, default 1)")
    return Backend(d["url"].rstrip("/"), node_endpoints(d["host"], d["base_port"], d.get("tp_size", 1)))


_NODE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")  # kvpushd keygen's node names


def _node(where: str, v: Any) -> str:
    if not isinstance(v, str) or not _NODE.match(v):
        raise RouterConfigError(f"{where}: node must be a node's certificate name (letters, digits, '_.-', "
                                f"at most 64), got {v!r}")
    return v


def _decode_entry(i: int, d: Any) -> Backend:
    if not isinstance(d, dict) or not isinstance(d.get("url"), str) or set(d) - {"url", "node"}:
        raise RouterConfigError(f"[[decode]] #{i + 1}: wants url (and node)")
    node = _node(f"[[decode]] {d['url']}", d["node"]) if "node" in d else ""
    return Backend(d["url"].rstrip("/"), node=node)


def parse_decode(spec: str) -> Backend:
    """``URL[,node=NAME]``."""
    url, *opts = spec.split(",")
    if not url.startswith(("http://", "https://")):
        raise RouterConfigError(f"--decode wants URL[,node=NAME], got {spec!r}")
    node = ""
    for opt in opts:
        k, _, v = opt.partition("=")
        if k != "node":
            raise RouterConfigError(f"--decode {url}: unknown option {opt!r} (known: node=NAME)")
        node = _node(f"--decode {url}", v)
    return Backend(url.rstrip("/"), node=node)


@takes_strings
def _p_listen(v: Any) -> tuple[str, int]:
    m = _HOSTPORT.match(p_str(v))
    if m is None or not 0 <= int(m.group(2)) < 65536:
        raise ValueError("must be HOST:PORT")
    return m.group(1).strip("[]"), int(m.group(2))


def _p_list(v: Any) -> list[Any]:
    if not isinstance(v, list):
        raise TypeError("expected an array of tables")
    return v


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


SCALARS = parsers_of(RouterConfig)
# The file's keys: the scalars, listen, and the two pools (entries parsed one by one below).
FILE_KEYS = {**SCALARS, "listen": _p_listen, "admin_listen": _p_listen, "prefill": _p_list, "decode": _p_list}
LISTEN_DOC = "HOST:PORT the OpenAI API, /health and /metrics listen on (default 127.0.0.1:8000)"
ADMIN_LISTEN_DOC = ("HOST:PORT the operator endpoints (/router/status, /router/trace, /router/drain) listen on "
                    "(default 127.0.0.1 and the client port + 1); not loopback: admin_token is required")


def _layer(where: str, raw: dict[str, Any], known: dict[str, Any]) -> dict[str, Any]:
    try:
        return parse_layer(where, raw, known)
    except RouterConfigError:
        raise
    except ConfigError as e:
        raise RouterConfigError(str(e)) from None


def load(path: str | None = None, overrides: dict[str, Any] | None = None) -> RouterConfig:
    """File first, then ``overrides`` (flags): pools are added, scalars replaced; validated.
    Types are strict in both (a string where a number belongs is an error naming the key)."""
    raw: dict[str, Any] = {}
    if path:
        try:
            with open(path, "rb") as f:
                raw = tomllib.load(f)
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise RouterConfigError(f"{path}: {exc}") from exc
    file = _layer(f"router config {path}", raw, FILE_KEYS)
    o = dict(overrides or {})
    prefill = [_prefill_entry(i, d) for i, d in enumerate(file.pop("prefill", []))] + list(o.pop("prefill", []))
    decode = [_decode_entry(i, d) for i, d in enumerate(file.pop("decode", []))] + list(o.pop("decode", []))
    flags = _layer("command line", {k: v for k, v in o.items() if v is not None},
                   {**SCALARS, "listen": _p_listen, "admin_listen": _p_listen})
    kw: dict[str, Any] = {**file, **flags}
    listen = kw.pop("listen", None)
    if listen is not None:
        kw.update(host=listen[0], port=listen[1])
    admin = kw.pop("admin_listen", None)
    if admin is not None:
        kw.update(admin_host=admin[0], admin_port=admin[1])
    cfg = RouterConfig(prefill=prefill, decode=decode, **kw)
    cfg.validate()
    return cfg
