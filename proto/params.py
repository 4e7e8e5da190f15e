"""The ``kv_transfer_params`` a router puts on each leg of a request: keys defined once.

vLLM carries ``kv_transfer_params`` from the HTTP request to the connector untouched; the
router (producer of these dicts), the engine plugin's scheduler half (their consumer) and the
baseline proxies all spell the keys through this module, so a key cannot drift between them.
Parsing is total: anything malformed yields ``None`` (the engine then computes locally).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

DO_REMOTE_DECODE = "do_remote_decode"  # prefill leg: keep the KV for a decode engine
DO_REMOTE_PREFILL = "do_remote_prefill"  # decode leg: the prompt's KV comes from elsewhere
TRANSFER_ID = "transfer_id"
PREFILL_ENDPOINTS = "prefill_endpoints"  # peer endpoints of the prefill engine's daemons, by rank
PREFILL_TP_SIZE = "prefill_tp_size"


@dataclass(frozen=True)
class PrefillLeg:
    """What the prefill engine is told: compute, then hand the KV to ``transfer_id``'s decoder."""

    transfer_id: str

    def to_params(self) -> dict[str, Any]:
        return {DO_REMOTE_DECODE: True, TRANSFER_ID: self.transfer_id}


@dataclass(frozen=True)
class DecodeLeg:
    """What the decode engine is told: the prompt's KV arrives from these prefill daemons."""

    transfer_id: str
    prefill_endpoints: tuple[str, ...]
    prefill_tp_size: int

    def to_params(self) -> dict[str, Any]:
        return {
            DO_REMOTE_PREFILL: True,
            TRANSFER_ID: self.transfer_id,
            PREFILL_ENDPOINTS: list(self.prefill_endpoints),
            PREFILL_TP_SIZE: self.prefill_tp_size,
        }


def prefill_leg(params: Mapping[str, Any] | None) -> PrefillLeg | None:
    """The prefill leg these params describe, or None (not a kvpush prefill leg)."""
    if not params or not params.get(DO_REMOTE_DECODE):
        return None
    tid = params.get(TRANSFER_ID)
    return PrefillLeg(str(tid)) if tid else None


def decode_leg(params: Mapping[str, Any] | None) -> DecodeLeg | None:
    """The decode leg these params describe, or None (not a kvpush decode leg, or malformed)."""
    if not params or not params.get(DO_REMOTE_PREFILL):
        return None
    tid, endpoints = params.get(TRANSFER_ID), params.get(PREFILL_ENDPOINTS)
    if not tid or not isinstance(endpoints, (list, tuple)) or not endpoints:
        return None
    tp = params.get(PREFILL_TP_SIZE, len(endpoints))
    if not isinstance(tp, int) or isinstance(tp, bool) or tp <= 0:
        return None
    return DecodeLeg(str(tid), tuple(str(e) for e in endpoints), tp)
