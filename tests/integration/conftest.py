"""Fixtures the daemon-level integration tests share."""

from __future__ import annotations

import pytest

from kvpush_dev.daemon_harness import Daemon, device_config


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    """A prefill and a decode daemon (real processes, authenticated with the run's lab key),
    one pair per test module: (p, d)."""
    tmp = tmp_path_factory.mktemp("pd")
    with Daemon(device_config(tmp, 0)) as p, Daemon(device_config(tmp, 1)) as d:
        yield p, d
