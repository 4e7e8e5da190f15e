"""kvpush-router's configuration: file + flags in one load step, clear errors for bad input."""

from __future__ import annotations

import argparse

import pytest

from kvpush.router.cli import main as router_main
from kvpush.router.router_config import (
    Backend,
    RouterConfigError,
    load,
    node_endpoints,
    parse_prefill,
)


def test_a_node_is_host_base_port_and_tp():
    assert node_endpoints("10.0.0.5", 17500, 3) == ["tcp://10.0.0.5:17500", "tcp://10.0.0.5:17501",
                                                    "tcp://10.0.0.5:17502"]
    assert node_endpoints("fd00::5", 17500, 1) == ["tcp://[fd00::5]:17500"]


@pytest.mark.parametrize("spec,eps", [
    ("http://p:8100=p:17500", ["tcp://p:17500"]),
    ("http://p:8100/=p:17500,tp=2", ["tcp://p:17500", "tcp://p:17501"]),
    ("http://p:8100=tcp://a:1,tcp://b:2", ["tcp://a:1", "tcp://b:2"]),
])
def test_prefill_flags(spec, eps):
    b = parse_prefill(spec)
    assert b.url == "http://p:8100" and b.kv_endpoints == eps


@pytest.mark.parametrize("spec", ["p:17500", "http://p:8100", "http://p:8100=p", "http://p:8100=p:17500,tq=2",
                                  "http://p:8100=p:70000", "http://p:8100=tcp://a", "http://p:8100=p:65535,tp=2",
                                  "http://p:8100=p:17500,tp=0"])
def test_bad_prefill_flags_say_what_is_wrong(spec):
    with pytest.raises(RouterConfigError):
        parse_prefill(spec)


def test_file_then_flags(tmp_path):
    f = tmp_path / "r.toml"
    f.write_text('listen = "0.0.0.0:9000"\npolicy = "round-robin"\nshutdown_grace_s = 5\n'
                 '[[prefill]]\nurl = "http://p1:8100"\nhost = "p1"\nbase_port = 17500\ntp_size = 2\n'
                 '[[prefill]]\nurl = "http://p2:8100"\nendpoints = ["tcp://p2:18000"]\n'
                 '[[decode]]\nurl = "http://d1:8200/"\n')
    cfg = load(str(f), {"decode": [Backend("http://d2:8200")], "policy": None, "shutdown_grace_s": 1.5})
    assert (cfg.host, cfg.port, cfg.policy, cfg.shutdown_grace_s) == ("0.0.0.0", 9000, "round-robin", 1.5)
    assert [b.kv_endpoints for b in cfg.prefill] == [["tcp://p1:17500", "tcp://p1:17501"], ["tcp://p2:18000"]]
    assert [b.url for b in cfg.decode] == ["http://d1:8200", "http://d2:8200"]


@pytest.mark.parametrize("text,words", [
    ('[[decode]]\nurl = "http://d:1"\n', "at least one prefill"),
    ('[[prefill]]\nurl = "http://p:1"\nhost = "p"\n[[decode]]\nurl = "http://d:1"\n', "base_port"),
    ('[[prefill]]\nurl = "http://p:1"\nhost = "p"\nbase_port = 1\nendpoints = ["tcp://p:1"]\n', "not both"),
    ('lisen = "x"\n', "unknown key"),
    ('policy = "random"\n[[prefill]]\nurl = "http://p:1"\nendpoints = ["tcp://p:1"]\n[[decode]]\nurl = "http://d:1"\n',
     "policy"),
    ('[[prefill]]\nurl = "http://p:1"\nendpoints = ["tcp://p:1"]\n[[decode]]\nurl = "http://d:1"\nport = 1\n',
     r"wants url \(and node\)"),
    ("not toml [", "r.toml"),
])
def test_bad_files_say_what_is_wrong(tmp_path, text, words):
    f = tmp_path / "r.toml"
    f.write_text(text)
    with pytest.raises(RouterConfigError, match=words):
        load(str(f))


def test_the_cli_refuses_a_bad_config_with_exit_2(tmp_path, capsys):
    f = tmp_path / "r.toml"
    f.write_text('[[decode]]\nurl = "http://d:1"\n')
    assert router_main(["--config", str(f)]) == 2
    assert "at least one prefill" in capsys.readouterr().err


def test_a_bad_log_level_is_one_usage_line_not_a_traceback(capsys):
    with pytest.raises(SystemExit) as e:
        router_main(["--log-level", "loud"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "argument --log-level: invalid choice: 'LOUD'" in err and "Traceback" not in err


def test_every_router_flag_has_help_text():
    from kvpush.router.cli import build_parser

    for action in build_parser()._actions:
        if action.option_strings and action.help != argparse.SUPPRESS:
            assert action.help, action.option_strings


def test_a_decode_engine_names_its_node_in_the_file_or_the_flag(tmp_path) -> None:
    from kvpush.router.router_config import load, parse_decode
    conf = tmp_path / "r.toml"
    conf.write_text('[[prefill]]\nurl = "http://p:1"\nendpoints = ["tcp://p:1"]\n'
                    '[[decode]]\nurl = "http://d:1"\nnode = "dnode"\n')
    assert [b.node for b in load(str(conf)).decode] == ["dnode"]
    assert parse_decode("http://d:2,node=d2").node == "d2" and parse_decode("http://d:2").node == ""
    for bad in ("http://d:2,node=", "http://d:2,node=a b", "http://d:2,nod=x"):
        with pytest.raises(RouterConfigError):
            parse_decode(bad)
    assert load(str(conf)).expose_transfer_id is False
    assert load(str(conf), {"expose_transfer_id": True}).expose_transfer_id is True
