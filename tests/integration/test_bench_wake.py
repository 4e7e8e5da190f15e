"""scripts/bench_wake.py runs end to end (a real daemon among its variants) and reports every
variant; the figures themselves are the benchmark's business, not a test's."""

from __future__ import annotations

import json

import pytest

from kvpush_dev.bench.wake import main

pytestmark = pytest.mark.integration


def test_bench_wake_reports_every_variant(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--json", "--gaps-ms", "0", "--n", "3"]) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["0ms"]
    for k in ("zmq_ipc_rtt_us", "engine_link_rtt_us", "daemon_rtt_us", "unix_dgram_rtt_us"):
        assert row[k]["p50"] > 0, k
