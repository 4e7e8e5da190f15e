"""The per-identity quota rules (daemon/core/quotas.py) as pure functions, property-tested: an
identity's holdings are the sum over its sessions, and a registration is refused exactly when
that sum would pass a bound, however the holdings are split across sessions."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvpush.common.machine.core import Held
from kvpush.daemon.core import quotas

_held = st.builds(Held, st.integers(0, 50), st.integers(0, 500))


@given(st.lists(_held, max_size=8), st.integers(1, 60), st.integers(1, 600), st.integers(0, 40))
def test_splitting_across_sessions_buys_nothing(helds, max_t, max_b, blocks):
    q = quotas.Quota(max_t, max_b)
    whole = quotas.total(helds)
    assert whole == Held(sum(h.records for h in helds), sum(h.units for h in helds))
    why = quotas.refusal(q, whole, None, blocks)
    assert (why != "") == (whole.records + 1 > max_t or whole.units + blocks > max_b)


@given(st.integers(0, 100), st.integers(0, 100))
def test_session_cap(sessions, cap):
    assert (quotas.session_refusal(sessions, cap) != "") == (sessions >= cap)
