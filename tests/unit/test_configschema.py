"""One schema idiom for daemon, plugin and router (kvpush.common.configschema): strict types, errors
that name the key and what it expects, in all three.

Why: the plugin parsed ``unavailable_fail: "false"`` as true (bool("false")), and each of the
three loaders had its own rules. A string from a typed source (TOML, JSON, flags) for a
non-string key is now an error everywhere; only the environment's strings are converted.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpush.common.configschema import (
    ConfigError,
    accepts_strings,
    describe,
    parse_layer,
    parsers_of,
)
from kvpush.daemon.config import DeviceConfig, NodeConfig, load_config
from kvpush.engine_plugin.config import PluginConfig, PluginConfigError
from kvpush.router.router_config import RouterConfig, RouterConfigError
from kvpush.router.router_config import load as load_router

DAEMON = {"daemon": "ipc:///run/kvpush/engine-{rank}.sock"}
POOLS = '[[prefill]]\nurl = "http://p:1"\nendpoints = ["tcp://p:1"]\n[[decode]]\nurl = "http://d:1"\n'


# ---- the plugin ----

@pytest.mark.parametrize("name,value,expects", [
    ("unavailable_fail", "false", "true or false"),
    ("unavailable_fail", 0, "true or false"),
    ("lease_ms", "10000", "integer"),
    ("lease_ms", 2.5, "integer"),
    ("timeout_ms", True, "integer"),
    ("idle_wait_ms", None, "integer"),
    ("daemon", 7, "string"),
])
def test_plugin_refuses_wrong_types_naming_key_and_type(name: str, value: Any, expects: str) -> None:
    with pytest.raises(PluginConfigError) as e:
        PluginConfig.from_extra({**DAEMON, name: value})
    msg = str(e.value)
    assert f"kv_connector_extra_config: {name}:" in msg and expects in msg, msg


def test_plugin_values_of_the_right_type_load() -> None:
    cfg = PluginConfig.from_extra({**DAEMON, "unavailable_fail": False, "lease_ms": 500,
                                   "dead_after_ms": 1500})
    assert (cfg.unavailable_fail, cfg.lease_ms, cfg.dead_after_ms) == (False, 500, 1500)
    assert PluginConfig.from_extra(DAEMON).unavailable_fail is True


@pytest.mark.parametrize("extra,words", [
    ({}, 'needs "daemon"'),
    ({"daemon": ""}, "daemon: is empty"),
    ({**DAEMON, "lease": 5}, "did you mean 'lease_ms'"),
    ({**DAEMON, "lease_ms": -1}, "lease_ms must be a non-negative integer"),
])
def test_plugin_missing_unknown_and_out_of_range(extra: dict[str, Any], words: str) -> None:
    with pytest.raises(PluginConfigError, match=words):
        PluginConfig.from_extra(extra)


# ---- the daemon ----

def test_daemon_toml_is_strict_and_the_environment_is_text(tmp_path: Path) -> None:
    f = tmp_path / "k.toml"
    f.write_text(f'devices = ["cpu0"]\nruntime_dir = "{tmp_path}"\ninsecure_peers = "false"\n')
    with pytest.raises(ConfigError, match=r"insecure_peers: expected true or false, not a string"):
        load_config(str(f), {}, {})
    f.write_text(f'devices = ["cpu0"]\nruntime_dir = "{tmp_path}"\nmetrics_port = "9470"\n')
    with pytest.raises(ConfigError, match=r"metrics_port: expected an integer, not a string"):
        load_config(str(f), {}, {})
    f.write_text(f'devices = ["cpu0"]\nruntime_dir = "{tmp_path}"\n')
    node = load_config(str(f), {}, {"KVPUSH_INSECURE_PEERS": "false", "KVPUSH_METRICS_PORT": "0"})
    assert node.devices[0].insecure_peers is False and node.metrics_port == 0


# ---- the router ----

@pytest.mark.parametrize("line,words", [
    ('shutdown_grace_s = "5"', r"shutdown_grace_s: expected a number, not a string"),
    ("policy = 3", r"policy: expected a string"),
    ('policy = "random"', r"policy must be one of least-loaded, round-robin"),
    ("request_timeout = 5", r"did you mean 'request_timeout_s'"),
    ("listen = 8000", r"listen: expected a string"),
    ('listen = "nohost"', r"listen: must be HOST:PORT"),
    ("prefill_timeout_s = -1", r"prefill_timeout_s must be >= 0"),
])
def test_router_file_is_strict(tmp_path: Path, line: str, words: str) -> None:
    f = tmp_path / "r.toml"
    f.write_text(line + "\n" + POOLS)
    with pytest.raises(RouterConfigError, match=words):
        load_router(str(f))


def test_router_flags_are_typed_too() -> None:
    from kvpush.router.router_config import Backend

    pools = {"prefill": [Backend("http://p:1", ["tcp://p:1"])], "decode": [Backend("http://d:1")]}
    assert load_router(None, {**pools, "shutdown_grace_s": 1.5}).shutdown_grace_s == 1.5
    with pytest.raises(RouterConfigError, match=r"command line: shutdown_grace_s"):
        load_router(None, {**pools, "shutdown_grace_s": "1.5"})


# ---- the idiom itself, for every key of the three schemas ----

SCHEMAS = [(DeviceConfig, ("device", "table")), (NodeConfig, ("node",)), (PluginConfig, ()),
           (RouterConfig, ())]
ALL_KEYS = [(cls, name) for cls, scopes in SCHEMAS for name in parsers_of(cls, *scopes)]
STRING_KEYS = {k.name for cls, scopes in SCHEMAS for k in describe(cls, *scopes)
               if k.type == "string" or k.type.startswith('"')
               or accepts_strings(parsers_of(cls)[k.name])}  # e.g. daemon_user: a name or a uid


@given(st.sampled_from(ALL_KEYS), st.one_of(st.none(), st.dictionaries(st.text(), st.integers()),
                                            st.lists(st.floats()), st.binary()))
def test_any_key_refuses_a_value_of_no_config_type_naming_itself(case: tuple[type, str], value: Any) -> None:
    cls, name = case
    if name == "devices" and isinstance(value, list) and not value:
        return  # [] is a list of names (empty: refused later, by resolve_devices)
    with pytest.raises(ConfigError, match=rf"^src: {name}: "):
        parse_layer("src", {name: value}, parsers_of(cls))


@given(st.sampled_from([c for c in ALL_KEYS if c[1] not in STRING_KEYS and c[1] != "devices"]),
       st.sampled_from(["false", "true", "0", "1", "10", "2.5", ""]))
def test_a_string_for_a_non_string_key_is_refused_unless_the_source_is_text(
        case: tuple[type, str], text: str) -> None:
    cls, name = case
    with pytest.raises(ConfigError, match=rf"^src: {name}: .*not a string"):
        parse_layer("src", {name: text}, parsers_of(cls))


def test_every_key_has_a_doc() -> None:
    for cls, scopes in SCHEMAS:
        for k in describe(cls, *scopes):
            assert k.doc.strip(), f"{cls.__name__}.{k.name} has no doc"
    assert {f.name for f in dataclasses.fields(PluginConfig)} == set(parsers_of(PluginConfig))


def test_the_reference_matches_the_schemas(tmp_path: Path) -> None:
    """docs/configuration.md is what scripts/config_reference.py writes from the schemas."""
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[2] / "scripts" / "config_reference.py"
    r = subprocess.run([sys.executable, str(script), "--check"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    text = (script.parent.parent / "docs" / "configuration.md").read_text()
    for cls, scopes in SCHEMAS:
        for k in describe(cls, *scopes):
            assert f"| `{k.name}` |" in text, k.name
