"""The multi-host lab (network namespaces as hosts): skipped, with the reason, where it cannot run.

Every test here carries the ``lab`` marker; the ones that start vLLM engines also carry
``e2e``. ``-m "lab and not e2e"`` is the fast part (real daemons across namespaces, a few
fault cases) that every CI run keeps.
"""

from __future__ import annotations

import pytest

from kvpush.testing.netlab import unavailable_reason


@pytest.fixture(scope="session")
def lab_ok() -> None:
    why = unavailable_reason(need_nft=True)
    if why:
        pytest.skip(why)
