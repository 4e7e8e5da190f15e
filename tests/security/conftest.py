"""Security tests: every test under tests/security carries the ``security`` marker
(``pytest -m security``), whatever else it is marked with."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpush_dev.fleet import fleet

_HERE = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.security)


@pytest.fixture
def nodes(tmp_path):
    """Prefill daemon on node P (127.0.0.1), decode daemon on node D (127.0.0.2), each allowing
    the other, each with an engine stand-in attached: (p, d, pe, de, kp, kd)."""
    with fleet(tmp_path) as f:
        yield f.p, f.d, f.pe, f.de, f.kp, f.kd
