"""The ``kv_transfer_params`` a router puts on each leg of a request: keys defined once.

vLLM carries ``kv_transfer_params`` from the HTTP request to the connector untouched; the
router (producer of these dicts), the engine plugin's scheduler half (their consumer) and the
baseline proxies all spell the keys through this module, so a key cannot drift between them.
Parsing is total: anything malformed yields ``None`` (the engine then computes locally).
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


def new_secret() -> str:
    """A fresh per-transfer secret (url-safe text, ``SECRET_BYTES`` random bytes)."""
    return secrets.token_urlsafe(SECRET_BYTES)


def _text(v: Any, limit: int) -> str | None:
    """A bounded, printable string field, or None."""
    return v if isinstance(v, str) and 0 < len(v) <= limit and v.isprintable() else None

DO_REMOTE_DECODE = "do_remote_decode"  # prefill leg: keep the KV for a decode engine
DO_REMOTE_PREFILL = "do_remote_prefill"  # decode leg: the prompt's KV comes from elsewhere
TRANSFER_ID = "transfer_id"
PREFILL_ENDPOINTS = "prefill_endpoints"  # peer endpoints of the prefill engine's daemons, by rank
PREFILL_TP_SIZE = "prefill_tp_size"
# vLLM's push-proxy protocol (NixlPushConnector's decode leg): the prefill node's host and
# its kvpushd base peer port; rank r's daemon listens at remote_port + r.
REMOTE_HOST = "remote_host"
REMOTE_PORT = "remote_port"
TP_SIZE = "tp_size"
PP_SIZE = "pp_size"
# Binding a transfer to its decode party (docs/security.md, "Transfers are bound"): the
# decode node's certificate name the prefill daemon admits (the router's concurrent legs),
# and the transfer's secret the decode side presents (both fronts). Never returned to clients.
DECODE_NODE = "kvpush_decode_node"
SECRET = "kvpush_secret"
SECRET_BYTES = 16  # 128 bit of randomness per transfer
MAX_SECRET = 128  # chars: a bound on what a request (or a peer) may present
MAX_NODE = 64  # chars of a node name (kvpushd keygen's own bound)
MAX_TP = 1024  # a bound on what a request may claim, not a limit of any deployment
MAX_TRANSFER_ID = 256  # the daemons' own bound on a transfer ID is configured; this one guards parsing
# A prefill engine of a model with state groups (Mamba, linear attention) computed the prompt
# without its last token (the decode engine computes it from the state before it): set on the
# prefill leg's params (once, even after a preemption) and in its answer, where it tells the
# router that the leg's one token is not the request's first token (router.first_token).
PROMPT_TRUNCATED = "kvpush_prompt_truncated"


def prompt_truncated(params: Any) -> bool:
    """Whether these ``kv_transfer_params`` (a prefill leg's, or its answer) say the prompt was
    computed without its last token."""
    return isinstance(params, Mapping) and params.get(PROMPT_TRUNCATED) is True


@dataclass(frozen=True)
class PrefillLeg:
    """What the prefill engine is told: compute, then hand the KV to ``transfer_id``'s decoder.

    ``transfer_id`` None: a serial proxy's prefill leg (``do_remote_decode`` alone, as vLLM's
    toy proxy sends it). The prefill engine then names the transfer itself and answers with
    the decode leg's params (:meth:`DecodeLeg.to_params`), which the proxy forwards to D.

    ``decode_node``: only that decode node (certificate name) may register; ``secret``: or a
    registration presenting it. The router sets both on its concurrent legs; a serial leg's
    secret is made by the prefill engine and travels in its answer."""

    transfer_id: str | None
    decode_node: str = ""
    secret: str = ""

    @property
    def serial(self) -> bool:
        return self.transfer_id is None

    def to_params(self) -> dict[str, Any]:
        out: dict[str, Any] = {DO_REMOTE_DECODE: True}
        if self.transfer_id is not None:
            out[TRANSFER_ID] = self.transfer_id
        if self.decode_node:
            out[DECODE_NODE] = self.decode_node
        if self.secret:
            out[SECRET] = self.secret
        return out


@dataclass(frozen=True)
class DecodeLeg:
    """What the decode engine is told: the prompt's KV arrives from these prefill daemons."""

    transfer_id: str
    prefill_endpoints: tuple[str, ...]
    prefill_tp_size: int
    secret: str = ""  # presented in the Register (the prefill daemon admits it)

    def to_params(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            DO_REMOTE_PREFILL: True,
            DO_REMOTE_DECODE: False,
            TRANSFER_ID: self.transfer_id,
            PREFILL_ENDPOINTS: list(self.prefill_endpoints),
            PREFILL_TP_SIZE: self.prefill_tp_size,
        }
        if self.secret:
            out[SECRET] = self.secret
        return out


def prefill_leg(params: Mapping[str, Any] | None) -> PrefillLeg | None:
    """The prefill leg these params describe, or None (not a kvpush prefill leg)."""
    if not params or params.get(DO_REMOTE_DECODE) is not True:
        return None
    node, secret = params.get(DECODE_NODE), params.get(SECRET)
    node = "" if node in (None, "") else _text(node, MAX_NODE)
    secret = "" if secret in (None, "") else _text(secret, MAX_SECRET)
    if node is None or secret is None:
        return None
    tid = params.get(TRANSFER_ID)
    if tid is None:
        return PrefillLeg(None, node, secret)  # serial proxy: the prefill engine names the transfer
    if not isinstance(tid, str) or not 0 < len(tid) <= MAX_TRANSFER_ID:
        return None
    return PrefillLeg(tid, node, secret)


def _int(v: Any, lo: int, hi: int) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi else None


def push_proxy_endpoints(params: Mapping[str, Any]) -> tuple[str, ...] | None:
    """The prefill daemons' endpoints from vLLM push-proxy fields (``remote_host``,
    ``remote_port`` = the prefill node's kvpushd base peer port, ``tp_size``), or None.

    Rank r is at ``remote_port + r`` (kvpushd's ``base_port + index`` with one device per
    rank). Pipeline parallelism is not supported: ``pp_size`` other than 1 gives None."""
    host, port = params.get(REMOTE_HOST), params.get(REMOTE_PORT)
    tp = _int(params.get(TP_SIZE, 1), 1, MAX_TP)
    if not isinstance(host, str) or not host or any(c in host for c in "/ ") or tp is None:
        return None
    if _int(params.get(PP_SIZE, 1), 1, 1) is None or _int(port, 1, 65536 - tp) is None:
        return None
    h = f"[{host}]" if ":" in host else host
    return tuple(f"tcp://{h}:{port + r}" for r in range(tp))


def decode_leg(params: Mapping[str, Any] | None) -> DecodeLeg | None:
    """The decode leg these params describe, or None (not a kvpush decode leg, or malformed).

    Two spellings: kvpush's router names the prefill daemons (``prefill_endpoints``); vLLM's
    push proxy names the prefill node (``remote_host`` / ``remote_port`` / ``tp_size``)."""
    if not params or not params.get(DO_REMOTE_PREFILL):
        return None
    secret = params.get(SECRET)
    secret = "" if secret in (None, "") else _text(secret, MAX_SECRET)
    if secret is None:
        return None
    tid, endpoints = params.get(TRANSFER_ID), params.get(PREFILL_ENDPOINTS)
    if endpoints is None and REMOTE_HOST in params:
        endpoints = push_proxy_endpoints(params)
        if tid and endpoints:
            return DecodeLeg(str(tid), endpoints, len(endpoints), secret)
    if not tid or not isinstance(endpoints, (list, tuple)) or not endpoints:
        return None
    tp = params.get(PREFILL_TP_SIZE, len(endpoints))
    if not isinstance(tp, int) or isinstance(tp, bool) or tp <= 0:
        return None
    return DecodeLeg(str(tid), tuple(str(e) for e in endpoints), tp, secret)
