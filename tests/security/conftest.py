"""Security tests: every test under tests/security carries the ``security`` marker
(``pytest -m security``), whatever else it is marked with."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpush.testing.daemon_harness import Daemon, Engine, device_config
from kvpush.testing.keys import allow, lab_keys
from kvpush.testing.kvref import small_layout

_HERE = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.security)


@pytest.fixture
def nodes(tmp_path):
    """Prefill daemon on node P (127.0.0.1), decode daemon on node D (127.0.0.2), each allowing
    the other, each with an engine stand-in attached: (p, d, pe, de, kp, kd)."""
    lay = small_layout()
    kp = lab_keys(tmp_path / "P", "pnode", ("127.0.0.1",))
    kd = lab_keys(tmp_path / "D", "dnode", ("127.0.0.2",))
    allow(kp, kd)
    allow(kd, kp)
    p = Daemon(device_config(tmp_path, 0, **kp.config()))
    d = Daemon(device_config(tmp_path, 1, peer_host="127.0.0.2", advertise_host="127.0.0.2", **kd.config()))
    pe, de = Engine(p, lay, "prefill", seed=3), Engine(d, lay, "decode", fill="zeros")
    yield p, d, pe, de, kp, kd
    pe.close()
    de.close()
    p.stop()
    d.stop()
