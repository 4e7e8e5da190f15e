"""kvpushd configuration: defaults, file < env < flags, unknown keys, validation, dumping."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpush.daemon.config import (
    DEFAULT_BASE_PORT,
    KEY_DOCS,
    TABLE_KEYS,
    TOP_KEYS,
    ConfigError,
    DeviceConfig,
    NodeConfig,
    _toml_value,
    default_runtime_dir,
    dump_json,
    dump_toml,
    env_var,
    load_config,
    peer_port_for,
)
from kvpush.daemon.node import cli

ENV = {"RUNTIME_DIRECTORY": "/run/kvpush-test"}


def no_gpu() -> int:
    return 0


def load(path: str | None = None, overrides: dict | None = None, env: dict | None = None,
         **kw) -> NodeConfig:
    return load_config(path, overrides or {}, {**ENV, **(env or {})}, cuda_count=kw.get("cuda", no_gpu))


def toml(tmp_path: Path, text: str) -> str:
    p = tmp_path / "kvpush.toml"
    p.write_text(text)
    return str(p)


# ----------------------------------------------------------------------------- defaults

def test_defaults_on_a_cpu_node() -> None:
    node = load()
    assert [d.name for d in node.devices] == ["cpu0"]
    dev = node.devices[0]
    assert (dev.index, dev.device_kind) == (0, "cpu")
    assert node.runtime_dir == dev.runtime_dir == "/run/kvpush-test"
    assert dev.engine_socket == "ipc:///run/kvpush-test/engine-0.sock"
    assert dev.ops_socket == "ipc:///run/kvpush-test/ops-0.sock"
    assert dev.peer_port == DEFAULT_BASE_PORT == 17500
    assert dev.peer_host == dev.advertise_host == "127.0.0.1"
    assert dev.peer_endpoint == "tcp://127.0.0.1:17500"
    assert (dev.backend, dev.socket_mode, dev.log_level) == ("UCX", 0o600, "INFO")
    assert (dev.lease_s, dev.register_timeout_s, dev.write_timeout_s, dev.peer_timeout_s) == (
        30.0, 30.0, 5.0, 10.0)
    assert (dev.poll_min_s, dev.poll_max_s) == (0.0005, 0.05)
    # Peer authentication is on by default: the keys are expected where the installer puts them.
    assert not dev.insecure_peers
    assert (dev.curve_secret_key_file, dev.authorized_keys_dir) == (
        "/etc/kvpush/node.key_secret", "/etc/kvpush/authorized_keys")
    assert (node.metrics_host, node.metrics_port) == ("127.0.0.1", 9470)


def test_device_config_fills_itself_from_index() -> None:
    dev = DeviceConfig(index=3, name="cuda3", device_kind="cuda", runtime_dir="/r")
    assert dev.engine_socket == "ipc:///r/engine-3.sock"
    assert dev.ops_socket == "ipc:///r/ops-3.sock"
    assert dev.peer_port == 17503
    dev.validate()


@pytest.mark.parametrize(("env", "euid", "expected"), [
    ({"RUNTIME_DIRECTORY": "/run/kvpush"}, 1000, "/run/kvpush"),
    ({}, 0, "/run/kvpush"),
    ({"XDG_RUNTIME_DIR": "/run/user/1000"}, 1000, "/run/user/1000/kvpush"),
    ({}, 1000, "/tmp/kvpush-1000"),
])
def test_default_runtime_dir(env: dict, euid: int, expected: str) -> None:
    assert default_runtime_dir(env, euid) == expected


def test_all_devices_follow_visible_gpus() -> None:
    node = load(cuda=lambda: 3)
    assert [d.name for d in node.devices] == ["cuda0", "cuda1", "cuda2"]
    assert [d.peer_port for d in node.devices] == [17500, 17501, 17502]
    assert [d.device_kind for d in node.devices] == ["cuda"] * 3


def test_all_with_real_torch() -> None:
    import torch

    n = torch.cuda.device_count()
    node = load_config(None, {}, ENV)
    expected = [f"cuda{i}" for i in range(n)] if n else ["cpu0"]
    assert [d.name for d in node.devices] == expected


def test_count_and_kind() -> None:
    assert [d.name for d in load(overrides={"count": 2}).devices] == ["cpu0", "cpu1"]
    assert [d.name for d in load(overrides={"count": 2}, cuda=lambda: 8).devices] == [
        "cuda0", "cuda1"]
    node = load(overrides={"device_kind": "cpu"}, cuda=lambda: 3)
    assert [d.name for d in node.devices] == ["cpu0"]


# ----------------------------------------------------------------------------- precedence

def test_flags_beat_env_beat_file(tmp_path: Path) -> None:
    path = toml(tmp_path, """
        metrics_port = 1000
        backend = "LIBFABRIC"
        log_level = "DEBUG"
        base_port = 18000
        lease_s = 3.0
    """)
    env = {"KVPUSH_METRICS_PORT": "2000", "KVPUSH_BACKEND": "ucx", "KVPUSH_LEASE_S": "4.5"}
    node = load(path, {"metrics_port": 3000, "backend": None}, env)
    dev = node.devices[0]
    assert node.metrics_port == 3000  # flag
    assert dev.backend == "UCX"  # env (a None flag is "not given")
    assert dev.lease_s == 4.5  # env
    assert dev.log_level == node.log_level == "DEBUG"  # file
    assert dev.peer_port == 18000  # file
    assert load(path).metrics_port == 1000
    assert load(path, env=env).metrics_port == 2000


def test_devices_and_count_are_one_setting_across_layers(tmp_path: Path) -> None:
    path = toml(tmp_path, 'devices = ["cpu0", "cpu1", "cpu2"]\n')
    assert [d.name for d in load(path).devices] == ["cpu0", "cpu1", "cpu2"]
    assert [d.name for d in load(path, env={"KVPUSH_COUNT": "2"}).devices] == ["cpu0", "cpu1"]
    node = load(path, {"devices": "cpu3"}, {"KVPUSH_COUNT": "2"})
    assert [(d.name, d.index, d.peer_port) for d in node.devices] == [("cpu3", 3, 17503)]


def test_devices_and_count_in_one_layer_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="either 'devices' or 'count'"):
        load(toml(tmp_path, 'devices = ["cpu0"]\ncount = 2\n'))


def test_env_values_are_parsed() -> None:
    env = {"KVPUSH_DEVICES": "cpu0, cpu1", "KVPUSH_SOCKET_MODE": "0660",
           "KVPUSH_POLL_MAX_S": "0.01", "KVPUSH_METRICS_PORT": "0", "KVPUSH_LOG_LEVEL": "debug",
           "KVPUSH_SOMETHING_ELSE": "ignored: the plugin shares the prefix"}
    node = load(env=env)
    assert [d.name for d in node.devices] == ["cpu0", "cpu1"]
    assert {d.socket_mode for d in node.devices} == {0o660}
    assert {d.poll_max_s for d in node.devices} == {0.01}
    assert node.metrics_port == 0 and node.log_level == "DEBUG"


def test_config_file_from_env(tmp_path: Path) -> None:
    path = toml(tmp_path, "metrics_port = 9999\n")
    assert load(env={"KVPUSH_CONFIG": path}).metrics_port == 9999


def test_per_device_tables(tmp_path: Path) -> None:
    path = toml(tmp_path, """
        devices = ["cpu0", "cpu1"]
        lease_s = 7.0
        engine_socket = "ipc://{runtime_dir}/e-{name}.sock"
        [device.cpu1]
        peer_port = 19000
        lease_s = 5.0
        [device.cpu7]  # not configured: ignored (lets `kvpushd worker --device` share a file)
        lease_s = 1.0
    """)
    cpu0, cpu1 = load(path).devices
    assert (cpu0.peer_port, cpu0.lease_s) == (17500, 7.0)
    assert (cpu1.peer_port, cpu1.lease_s) == (19000, 5.0)
    assert cpu1.engine_socket == "ipc:///run/kvpush-test/e-cpu1.sock"


# ----------------------------------------------------------------------------- unknown keys

def test_unknown_file_key_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown key 'metric_port' \(did you mean 'metrics_port'"):
        load(toml(tmp_path, "metric_port = 1\n"))


def test_unknown_device_table_key_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"\[device.cpu0\]: unknown key 'lease'"):
        load(toml(tmp_path, "[device.cpu0]\nlease = 1.0\n"))
    with pytest.raises(ConfigError, match="unknown key 'metrics_port'"):  # node key in a table
        load(toml(tmp_path, "[device.cpu0]\nmetrics_port = 1\n"))


def test_unknown_override_is_named() -> None:
    with pytest.raises(ConfigError, match="command line: unknown key 'bogus'"):
        load(overrides={"bogus": 1})


def test_bad_device_table_name(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="'gpu0'"):
        load(toml(tmp_path, "[device.gpu0]\nlease_s = 1.0\n"))


@pytest.mark.parametrize("text", ["= broken", "devices = 3\n", "lease_s = 'x'\n",
                                  "socket_mode = true\n", "device = 1\n"])
def test_bad_file_values(tmp_path: Path, text: str) -> None:
    with pytest.raises(ConfigError, match="config file"):
        load(toml(tmp_path, text))


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load(str(tmp_path / "nope.toml"))


# ----------------------------------------------------------------------------- validation

@pytest.mark.parametrize(("overrides", "env", "message"), [
    ({"base_port": 65535, "devices": "cpu0,cpu1"}, {}, "exceeds 65535"),
    ({"metrics_port": 70000}, {}, "--metrics-port: must be a port number"),
    ({}, {"KVPUSH_METRICS_PORT": "-1"}, "KVPUSH_METRICS_PORT: must be a port number"),
    ({}, {"KVPUSH_METRICS_PORT": "x"}, "KVPUSH_METRICS_PORT: expected an integer"),
    ({}, {"KVPUSH_SOCKET_MODE": "0666"}, "lets any local user"),
    ({}, {"KVPUSH_SOCKET_MODE": "0400"}, "owner read"),
    ({}, {"KVPUSH_SOCKET_MODE": "1777"}, "permission mode"),
    ({}, {"KVPUSH_SOCKET_MODE": "rw"}, "octal"),
    ({"backend": "TCP"}, {}, "backend must be one of UCX, LIBFABRIC"),
    ({"log_level": "loud"}, {}, "log_level must be one of"),
    ({}, {"KVPUSH_POLL_MIN_S": "0.5", "KVPUSH_POLL_MAX_S": "0.1"}, "poll_min_s 0.5 > poll_max_s"),
    ({}, {"KVPUSH_LEASE_S": "0"}, "lease_s must be a finite number > 0"),
    ({}, {"KVPUSH_WRITE_TIMEOUT_S": "nan"}, "write_timeout_s must be a finite number"),
    ({}, {"KVPUSH_STOP_TIMEOUT_S": "-1"}, "stop_timeout_s must be"),
    ({}, {"KVPUSH_MAX_RESTARTS_PER_MINUTE": "-1"}, "max_restarts_per_minute"),
    ({}, {"KVPUSH_RESTART_BACKOFF_S": "60"}, "restart_backoff_max_s 30.0 < restart_backoff_s 60"),
    ({}, {"KVPUSH_READY_TIMEOUT_S": "-1"}, "ready_timeout_s must be >= 0"),
    ({"runtime_dir": "relative/dir"}, {}, "absolute path"),
    ({"runtime_dir": "/" + "x" * 120}, {}, "unix socket limit"),
    ({"devices": "cpu0,cpu0"}, {}, "both use name"),
    ({"devices": "cpu0,cuda0"}, {}, "both use index"),
    ({"devices": "gpu0"}, {}, "'gpu0' is not cpu<N> or cuda<N>"),
    ({"devices": "cuda01"}, {}, "'cuda01'"),
    ({"devices": ""}, {}, "devices is empty"),
    ({"count": 0}, {}, "count must be >= 1"),
    ({"device_kind": "cuda"}, {}, "no CUDA device is visible"),
    ({"device_kind": "tpu"}, {}, "device_kind must be"),
    ({"peer_host": "0.0.0.0"}, {}, "advertise_host '0.0.0.0' is a wildcard"),
    ({"metrics_port": 17500}, {}, "metrics_port 17500 is also a peer_port"),
    ({}, {"KVPUSH_ENGINE_SOCKET": "tcp://127.0.0.1:1"}, "must be an ipc:// endpoint"),
    ({}, {"KVPUSH_OPS_SOCKET": "ipc://{runtime_dir}/engine-{index}.sock"}, "are the same"),
    ({}, {"KVPUSH_OPS_SOCKET": "ipc://{rundir}/x.sock"}, "bad socket template"),
    ({}, {"KVPUSH_OPS_SOCKET": "ipc:///run/kvpush/ops.sock", "KVPUSH_COUNT": "2"},
     "both use ops_socket"),
])
def test_validation_errors(overrides: dict, env: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("+", r"\+")):
        load(overrides=overrides, env=env)


def test_peer_keys_are_checked_when_the_daemon_starts_not_when_the_config_loads(tmp_path: Path) -> None:
    """kvpushctl loads the same config on hosts without the keys; kvpushd refuses to start
    without them (PeerAuth.load), unless insecure_peers says so explicitly."""
    from kvpush.daemon.trust.peerauth import PeerAuth, PeerAuthError

    env = {"KVPUSH_CURVE_SECRET_KEY_FILE": str(tmp_path / "none"), "KVPUSH_AUTHORIZED_KEYS_DIR": str(tmp_path)}
    dev = load(env=env).devices[0]
    with pytest.raises(PeerAuthError, match="kvpushd keygen"):
        PeerAuth.load(dev.curve_secret_key_file, dev.authorized_keys_dir)
    assert load(env={**env, "KVPUSH_INSECURE_PEERS": "true"}).devices[0].insecure_peers


@pytest.mark.parametrize("removed", ["curve_public_key_file", "peer_bind", "curve_enabled"])
def test_removed_keys_are_unknown(tmp_path: Path, removed: str) -> None:
    """Keys nothing read are gone: a file still naming one fails, naming it."""
    with pytest.raises(ConfigError, match=f"unknown key '{removed}'"):
        load(toml(tmp_path, f'{removed} = "x"\n'))


# ----------------------------------------------------------------------------- schema

# One valid, non-default value per key (TOML text) and what it must produce. A key added
# to the schema without an entry here fails test_examples_cover_every_key.
EXAMPLES: dict[str, tuple[str, Any]] = {
    "config": ('"{path}"', lambda n: n.metrics_port == 0),  # read (the file itself), not kept
    "devices": ('["cpu1", "cpu4"]', lambda n: [d.name for d in n.devices] == ["cpu1", "cpu4"]),
    "count": ("3", lambda n: [d.name for d in n.devices] == ["cpu0", "cpu1", "cpu2"]),
    "device_kind": ('"cuda"', lambda n: [d.name for d in n.devices] == ["cuda0", "cuda1"]),
    "base_port": ("20000", lambda n: n.devices[0].peer_port == 20000),
    "runtime_dir": ('"/run/other"', lambda n: n.runtime_dir == n.devices[0].runtime_dir == "/run/other"),
    "metrics_host": ('"127.0.0.2"', lambda n: n.metrics_host == "127.0.0.2"),
    "metrics_port": ("9999", lambda n: n.metrics_port == 9999),
    "restart_backoff_s": ("2.5", lambda n: n.restart_backoff_s == 2.5),
    "restart_backoff_max_s": ("40.0", lambda n: n.restart_backoff_max_s == 40.0),
    "max_restarts_per_minute": ("0", lambda n: n.max_restarts_per_minute == 0),
    "stop_timeout_s": ("3.0", lambda n: n.stop_timeout_s == 3.0),
    "ready_timeout_s": ("0", lambda n: n.ready_timeout_s == 0),
    "log_level": ('"debug"', lambda n: n.devices[0].log_level == "DEBUG"),  # node: see precedence
    "log_format": ('"json"', lambda n: n.devices[0].log_format == "json"),
    "otlp_traces_endpoint": ('"http://127.0.0.1:4318/v1/traces"',
                             lambda n: n.devices[0].otlp_traces_endpoint == "http://127.0.0.1:4318/v1/traces"),
    "engine_socket": ('"ipc://{{runtime_dir}}/e-{{name}}.sock"',
                      lambda n: n.devices[0].engine_socket == "ipc:///run/kvpush-test/e-cpu0.sock"),
    "ops_socket": ('"ipc:///tmp/o{{index}}.sock"', lambda n: n.devices[0].ops_socket == "ipc:///tmp/o0.sock"),
    "peer_host": ('"127.0.0.3"', lambda n: n.devices[0].peer_endpoint == "tcp://127.0.0.3:17500"),
    "peer_port": ("17777", lambda n: n.devices[0].peer_port == 17777),
    "cpus": ('"0"', lambda n: n.devices[0].cpus == "0"),
    "advertise_host": ('"10.0.0.5"', lambda n: n.devices[0].peer_endpoint == "tcp://10.0.0.5:17500"),
    "backend": ('"libfabric"', lambda n: n.devices[0].backend == "LIBFABRIC"),
    "ucx_error_handling_mode": ('"none"', lambda n: n.devices[0].ucx_error_handling_mode == "none"),
    "socket_mode": ("0o660", lambda n: n.devices[0].socket_mode == 0o660),
    "lease_s": ("4.0", lambda n: n.devices[0].lease_s == 4.0),
    "register_timeout_s": ("6.0", lambda n: n.devices[0].register_timeout_s == 6.0),
    "write_timeout_s": ("7.0", lambda n: n.devices[0].write_timeout_s == 7.0),
    "peer_timeout_s": ("8.0", lambda n: n.devices[0].peer_timeout_s == 8.0),
    "curve_secret_key_file": ('"{secret}"', lambda n: n.devices[0].curve_secret_key_file.endswith("sec")),
    "authorized_keys_dir": ('"{keys}"', lambda n: n.devices[0].authorized_keys_dir.endswith("keys")),
    "insecure_peers": ("true", lambda n: n.devices[0].insecure_peers is True),
    "poll_min_s": ("0.001", lambda n: n.devices[0].poll_min_s == 0.001),
    "poll_max_s": ("0.5", lambda n: n.devices[0].poll_max_s == 0.5),
    "max_prepped_descriptors": ("0", lambda n: n.devices[0].max_prepped_descriptors == 0),
    "peer_handshake_s": ("2.5", lambda n: n.devices[0].peer_handshake_s == 2.5),
    "max_message_bytes": ("1048576", lambda n: n.devices[0].max_message_bytes == 1 << 20),
    "max_transfers_per_peer": ("64", lambda n: n.devices[0].max_transfers_per_peer == 64),
    "max_blocks_per_peer": ("4096", lambda n: n.devices[0].max_blocks_per_peer == 4096),
    "max_sessions_per_peer": ("8", lambda n: n.devices[0].max_sessions_per_peer == 8),
    "hello_deadline_s": ("3.5", lambda n: n.devices[0].hello_deadline_s == 3.5),
    "reserved_fds": ("128", lambda n: n.devices[0].reserved_fds == 128),
    "max_producers": ("32", lambda n: n.devices[0].max_producers == 32),
    "max_progress_chunks": ("16", lambda n: n.devices[0].max_progress_chunks == 16),
    "max_layer_groups": ("8", lambda n: n.devices[0].max_layer_groups == 8),
    "max_layer_writes_in_flight": ("2", lambda n: n.devices[0].max_layer_writes_in_flight == 2),
    "max_layer_writes_total": ("32", lambda n: n.devices[0].max_layer_writes_total == 32),
    "layerwise_min_transfer_ms": ("5.5", lambda n: n.devices[0].layerwise_min_transfer_ms == 5.5),
    "max_event_waiting": ("0", lambda n: n.devices[0].max_event_waiting == 0),
    "max_event_wait_s": ("0.25", lambda n: n.devices[0].max_event_wait_s == 0.25),
    "max_handshaking_producers": ("4", lambda n: n.devices[0].max_handshaking_producers == 4),
}
# CURVE keys only come in pairs; "config" names the file it is in.
PARTNER = {"curve_secret_key_file": "authorized_keys_dir", "authorized_keys_dir": "curve_secret_key_file"}


def test_examples_cover_every_key() -> None:
    assert set(EXAMPLES) == set(TOP_KEYS) | set(TABLE_KEYS)
    assert set(KEY_DOCS) == set(EXAMPLES) and all(KEY_DOCS.values())  # every key documented


def _example(tmp_path: Path, name: str) -> str:
    (tmp_path / "sec").write_text("secret")
    (tmp_path / "keys").mkdir(exist_ok=True)
    text, _ = EXAMPLES[name]
    return text.format(path=tmp_path / "kvpush.toml", secret=tmp_path / "sec", keys=tmp_path / "keys")


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_every_key_round_trips_from_toml(tmp_path: Path, name: str) -> None:
    """Each key read from the file's top level (per-device keys: also from a device table,
    where it beats the top level) lands where the schema says, and print-config keeps it."""
    lines = [f"{name} = {_example(tmp_path, name)}"]
    if name in PARTNER:
        lines.append(f"{PARTNER[name]} = {_example(tmp_path, PARTNER[name])}")
    lines.append("metrics_port = 0" if name != "metrics_port" else "")
    cuda = (lambda: 2) if name == "device_kind" else no_gpu
    check = EXAMPLES[name][1]
    if name in TOP_KEYS:
        node = load(toml(tmp_path, "\n".join(lines) + "\n"), cuda=cuda)
        assert check(node), node
        assert load(toml(tmp_path, dump_toml(node)), cuda=cuda) == node
    if name in TABLE_KEYS:
        table = "\n".join(["metrics_port = 0", "[device.cpu0]", *lines[:-1]]) + "\n"
        node = load(toml(tmp_path, table))
        assert check(node), node
        assert load(toml(tmp_path, dump_toml(node))) == node
        if name in TOP_KEYS and name not in PARTNER:  # the table beats the top level
            default = getattr(DeviceConfig(index=0, name="cpu0", runtime_dir="/r"), name)
            top = f"{name} = {_toml_value(default)}\n" if default is not None else ""
            assert load(toml(tmp_path, top + table)) == node


def test_node_key_in_a_device_table_and_table_key_at_top_are_explained(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown key 'metrics_port' in a device table.*top level"):
        load(toml(tmp_path, "[device.cpu0]\nmetrics_port = 1\n"))
    with pytest.raises(ConfigError, match=r"unknown key 'peer_port' at the top level.*\[device.<name>\]"):
        load(toml(tmp_path, "peer_port = 1\n"))
    with pytest.raises(ConfigError, match="command line: unknown key 'peer_port'"):
        load(overrides={"peer_port": 1})
    assert load(env={"KVPUSH_PEER_PORT": "1"}).devices[0].peer_port == 17500  # not a top key


def test_every_key_is_an_env_variable_and_a_table_key_is_not() -> None:
    for name in TOP_KEYS:
        assert env_var(name) == "KVPUSH_" + name.upper()
    assert "peer_port" not in TOP_KEYS and set(TABLE_KEYS) - set(TOP_KEYS) == {"peer_port", "cpus"}
    assert {"devices", "count", "base_port", "metrics_port"}.isdisjoint(TABLE_KEYS)


# ----------------------------------------------------------------------------- derived values

def test_derived_values(tmp_path: Path) -> None:
    node = load(toml(tmp_path, """
        devices = ["cpu0", "cpu2", "cpu5"]
        base_port = 18000
        peer_host = "0.0.0.0"
        advertise_host = "10.1.1.1"
        ops_socket = "ipc://{runtime_dir}/{name}-ops.sock"
        [device.cpu2]
        peer_port = 19999
        advertise_host = "10.2.2.2"
    """))
    assert [d.peer_port for d in node.devices] == [18000, 19999, 18005]
    assert [d.advertise_host for d in node.devices] == ["10.1.1.1", "10.2.2.2", "10.1.1.1"]
    assert [d.ops_socket for d in node.devices] == [
        f"ipc:///run/kvpush-test/{n}-ops.sock" for n in ("cpu0", "cpu2", "cpu5")]
    assert [d.engine_socket for d in node.devices] == [
        f"ipc:///run/kvpush-test/engine-{i}.sock" for i in (0, 2, 5)]
    assert node.devices[1].peer_endpoint == "tcp://10.2.2.2:19999"
    ephemeral = load(overrides={"base_port": 0, "count": 3, "peer_host": "127.0.0.9"})
    assert [d.peer_port for d in ephemeral.devices] == [0, 0, 0]
    assert {d.advertise_host for d in ephemeral.devices} == {"127.0.0.9"}


@given(base=st.integers(0, 65535), index=st.integers(0, 64))
def test_peer_port_is_base_plus_index(base: int, index: int) -> None:
    if base and base + index > 65535:
        with pytest.raises(ConfigError, match="exceeds 65535"):
            peer_port_for(base, index)
        return
    port = peer_port_for(base, index)
    assert port == (base + index if base else 0)
    dev = DeviceConfig(index=index, name=f"cpu{index}", runtime_dir="/r", base_port=base)
    assert dev.peer_port == port  # built in code: the same derivation as load_config's
    assert dataclasses.replace(dev, peer_host="10.0.0.1").peer_port == port


# ----------------------------------------------------------------------------- dumping

def test_dump_toml_round_trips(tmp_path: Path) -> None:
    node = load(overrides={"devices": "cpu0,cpu2", "metrics_port": 0, "peer_host": "10.1.2.3"},
                env={"KVPUSH_SOCKET_MODE": "0660", "KVPUSH_POLL_MIN_S": "1e-05"})
    assert load(toml(tmp_path, dump_toml(node))) == node
    data = json.loads(dump_json(node))
    assert [d["name"] for d in data["devices"]] == ["cpu0", "cpu2"]


@settings(max_examples=60, deadline=None)
@given(
    names=st.lists(st.integers(0, 15), min_size=1, max_size=4, unique=True),
    kind=st.sampled_from(["cpu", "cuda"]),
    base=st.integers(1024, 60000),
    mode=st.sampled_from([0o600, 0o620, 0o640, 0o660, 0o700, 0o770]),
    lease=st.floats(1e-6, 1e6, allow_nan=False),
    backoff=st.floats(1e-3, 100, allow_nan=False),
    level=st.sampled_from(["DEBUG", "INFO", "ERROR"]),
)
def test_dump_toml_round_trips_property(tmp_path_factory: pytest.TempPathFactory, names: list[int],
                                        kind: str, base: int, mode: int, lease: float,
                                        backoff: float, level: str) -> None:
    node = load(overrides={"devices": [f"{kind}{i}" for i in names], "base_port": base,
                           "log_level": level, "metrics_port": 0},
                env={"KVPUSH_SOCKET_MODE": oct(mode), "KVPUSH_LEASE_S": repr(lease),
                     "KVPUSH_RESTART_BACKOFF_S": repr(backoff),
                     "KVPUSH_RESTART_BACKOFF_MAX_S": repr(max(backoff, 30.0))})
    path = tmp_path_factory.mktemp("rt") / "c.toml"
    path.write_text(dump_toml(node))
    again = load(str(path))
    assert again == node
    assert math.isclose(again.devices[0].lease_s, lease)


def test_cli_print_config(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RUNTIME_DIRECTORY", "/run/kvpush-test")
    assert cli.main(["--devices", "cpu0,cpu1", "print-config", "--base-port", "18000"]) == 0
    text = capsys.readouterr().out
    node = load(toml(tmp_path, text))
    assert [(d.name, d.peer_port) for d in node.devices] == [("cpu0", 18000), ("cpu1", 18001)]
    assert cli.main(["print-config", "--format", "json", "--devices", "cpu1"]) == 0
    assert json.loads(capsys.readouterr().out)["devices"][0]["peer_port"] == 17501
    assert cli.main(["print-config", "--metrics-port", "99999"]) == 2
    assert "--metrics-port" in capsys.readouterr().err


# ---- the default config file (/etc/kvpush/kvpushd.toml), as documented ----

def _print_config(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert cli.main(["print-config", "--format", "json", *argv]) == 0
    return capsys.readouterr().out


def test_kvpushd_reads_the_default_file_when_it_exists(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from kvpush.daemon import config as daemon_config

    default, other = tmp_path / "kvpushd.toml", tmp_path / "other.toml"
    default.write_text(f'devices = ["cpu0"]\nruntime_dir = "{tmp_path}"\nbase_port = 18100\n')
    other.write_text(f'devices = ["cpu0"]\nruntime_dir = "{tmp_path}"\nbase_port = 18200\n')
    monkeypatch.delenv("KVPUSH_CONFIG", raising=False)
    monkeypatch.setattr(daemon_config, "DEFAULT_CONFIG", str(default))
    assert json.loads(_print_config(capsys))["devices"][0]["peer_port"] == 18100
    # --config (and KVPUSH_CONFIG) override the default file.
    assert json.loads(_print_config(capsys, "--config", str(other)))["devices"][0]["peer_port"] == 18200
    monkeypatch.setenv("KVPUSH_CONFIG", str(other))
    assert json.loads(_print_config(capsys))["devices"][0]["peer_port"] == 18200
    # No default file: the built-in defaults.
    monkeypatch.delenv("KVPUSH_CONFIG")
    default.unlink()
    assert json.loads(_print_config(capsys, "--devices", "cpu0"))["devices"][0]["peer_port"] == 17500


def test_default_file_errors_name_the_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from kvpush.daemon import config as daemon_config

    default = tmp_path / "kvpushd.toml"
    default.write_text("base_prot = 1\n")
    monkeypatch.delenv("KVPUSH_CONFIG", raising=False)
    monkeypatch.setattr(daemon_config, "DEFAULT_CONFIG", str(default))
    assert cli.main(["print-config"]) == 2
    err = capsys.readouterr().err
    assert str(default) in err and "base_prot" in err


# ----------------------------------------------------------------------------- placement

def test_device_cpus_pin_each_daemon_beside_its_engine(tmp_path: Path) -> None:
    path = toml(tmp_path, """
        devices = ["cpu0", "cpu1"]
        [device.cpu0]
        cpus = "0"
        [device.cpu1]
        cpus = "1-3,5"
    """)
    cpu0, cpu1 = load(path).devices
    assert (cpu0.cpus, cpu1.cpus) == ("0", "1-3,5")
    assert load().devices[0].cpus == ""  # default: not pinned


@pytest.mark.parametrize("bad", ["x", "3-1", "0,,1", "-1", "99999"])
def test_device_cpus_refuses_what_is_not_a_cpu_list(tmp_path: Path, bad: str) -> None:
    with pytest.raises(ConfigError, match="cpus"):
        load(toml(tmp_path, f'[device.cpu0]\ncpus = "{bad}"\n'))


def test_device_cpus_is_a_per_device_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown key 'cpus'"):  # one core list for every daemon: a mistake
        load(toml(tmp_path, 'cpus = "0"\n'))
