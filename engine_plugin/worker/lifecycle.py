"""The worker half's per-transfer lifecycle: one record per registration or send, one table.

The worker half (:mod:`kvpush.engine_plugin.worker.half`) publishes what the scheduler
half decided and reports what the daemon answered. Each decode registration is one record
keyed ``("recv", transfer, attempt)``; each prefill send one keyed ``("send", transfer)``.
The shell turns the step's metadata, the forward's end, the daemon's replies (Received,
ReceiveFailed, Sent, SendFailed, Released), a publish the link refused, and the daemon's
loss or restart into events; the actions it carries out are the publishes, vLLM's
finished sets and load errors, samples and trace reports.

Decode: LOADING until the daemon answers (or the record's deadline, twice the registration's
timeout plus slack, passes: the engine never waits unbounded), RELEASING after an abort
until Released. Prefill: QUEUED for an early PrefillDone until the step's forward ran,
SENDING until the daemon is done with the blocks, and for an early one not yet confirmed
by vLLM (``confirmed``: vLLM finished the request), SENT_EARLY until it is: blocks are
reported free only when both hold. A record leaves as soon as vLLM has heard its outcome;
nothing is kept after (a late reply finds no record and is ignored), so there are no
tombstones. While the daemon is known down, every publish fails at once (``down``).

Pure: no I/O, no clock (events carry ``now``). See :mod:`kvpush.common.machine.core`.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Any

from kvpush import proto
from kvpush.common.machine import Record, Table, row
from kvpush.common.machine.core import _Deadline
from kvpush.common.machine.tracked import TrackedCore

__all__ = [
    "AbortLoad", "Forward", "Free", "LoadEnded", "Lost", "Publish", "Received", "ReceiveFailed", "Register",
    "Released", "ReportTrace", "Send", "SendAbort", "SendDone", "SendSample", "State", "TABLE", "Tick", "Unsent",
    "WorkerLifecycle",
]

# --------------------------------------------------------------------------- events
# Events and actions are plain slotted dataclasses, not frozen ones: they are made on vLLM's
# engine loop for every request, and a frozen one costs several times more to build.


@dataclass(slots=True)
class Register:
    """Metadata: register these blocks for the transfer's KV (decode)."""

    transfer_id: str
    attempt: int
    req_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    first_token: int
    prefill_endpoints: tuple[str, ...]
    prefill_tp_size: int
    now: float
    down: bool
    secret: str = ""


@dataclass(slots=True)
class AbortLoad:
    """Metadata: vLLM finished a request while its registration was live (decode)."""

    transfer_id: str
    attempt: int
    req_id: str
    now: float
    down: bool


@dataclass(slots=True)
class Send:
    """Metadata: the request's KV is in these blocks (prefill). ``early``: publish after
    this step's forward; else vLLM finished the request (it confirms an early one)."""

    transfer_id: str
    req_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    early: bool
    now: float
    down: bool
    bind_node: str = ""
    bind_secret: str = ""
    streamed: bool = False  # its chunks were streamed per layer group, the last one in ``epoch``
    epoch: int = 0


@dataclass(slots=True)
class SendAbort:
    """Metadata: an early-published request vLLM finished abnormally (prefill)."""

    transfer_id: str
    req_id: str
    now: float
    down: bool


@dataclass(slots=True)
class Forward:
    """The step's forward ran (vLLM's wait_for_save): the early PrefillDones may go out."""

    now: float
    down: bool


@dataclass(slots=True)
class Received:
    transfer_id: str
    attempt: int
    now: float


@dataclass(slots=True)
class ReceiveFailed:
    transfer_id: str
    attempt: int
    reason: str
    now: float


@dataclass(slots=True)
class SendDone:
    """The daemon's Sent (``ok``) or SendFailed: it is done with the blocks."""

    transfer_id: str
    ok: bool
    now: float


@dataclass(slots=True)
class Released:
    """The daemon no longer touches the blocks of this aborted registration (or send)."""

    transfer_id: str
    attempt: int
    now: float


@dataclass(slots=True)
class Unsent:
    """The link refused the publish this record asked for (its queue is full, or it is closed)."""

    key: Hashable
    now: float


@dataclass(slots=True)
class Lost:
    """The daemon is unavailable, or restarted (a new daemon ID): nothing it held will answer."""

    why: str
    now: float


@dataclass(slots=True)
class Tick:
    """Time passed: expire what is due."""

    now: float


Event = Register | AbortLoad | Send | SendAbort | Forward | Received | ReceiveFailed | SendDone | Released | Unsent | Lost

# -------------------------------------------------------------------------- actions


@dataclass(slots=True)
class Publish:
    """Hand ``msg`` to the daemon link; if refused, feed ``Unsent(key)``. ``counter``: the
    transfer counter a successful publish bumps; ``stamp``: the timeline hop, taken first."""

    key: Hashable
    msg: Any
    counter: str | None = None
    stamp: str | None = None


@dataclass(slots=True)
class LoadEnded:
    """Report the request in finished_recving; if not ``ok``, its blocks as load errors (vLLM
    recomputes them). ``say``: the daemon's reason, worth a (once-per-reason) log line."""

    req_id: str
    transfer_id: str
    ok: bool
    block_ids: tuple[int, ...]
    seconds: float
    reason: str = ""
    say: bool = False


@dataclass(slots=True)
class Free:
    """Report the request in finished_sending: vLLM may reuse its blocks."""

    req_id: str


@dataclass(slots=True)
class ReportTrace:
    """The transfer is behind us on this rank: queue its stamps for the daemon."""

    transfer_id: str


@dataclass(slots=True)
class SendSample:
    seconds: float
    blocks: int


Action = Publish | LoadEnded | Free | ReportTrace | SendSample

# --------------------------------------------------------------------------- states


class State(enum.StrEnum):
    LOADING = "loading"  # decode: Register out; waiting for Received / ReceiveFailed
    RELEASING = "releasing"  # decode: Abort out; waiting for Released
    QUEUED = "queued"  # prefill: early, waiting for the step's forward
    SENDING = "sending"  # prefill: PrefillDone out; the daemon may be reading the blocks
    SENT_EARLY = "sent_early"  # prefill: the daemon is done; vLLM has not finished the request


@dataclass(eq=False)
class Transfer(Record):
    transfer_id: str
    req_id: str = ""
    attempt: int = 0
    block_ids: tuple[int, ...] = ()
    num_tokens: int = 0
    since: float = 0.0  # when it was published
    deadline: float | None = None  # decode: when the engine stops waiting for the daemon
    confirmed: bool = True  # prefill: vLLM finished the request (an early send: not yet)
    bind_node: str = ""  # prefill: who may register (PrefillDone's binding)
    bind_secret: str = ""
    streamed: bool = False  # prefill, layer-wise: PrefillDone.streamed / epoch
    epoch: int = 0


def _deadline(rec: Transfer) -> float | None:
    return rec.deadline


DEADLINES = {s: _deadline for s in State}


class WorkerLifecycle(TrackedCore):
    """Records by ("recv", transfer, attempt) or ("send", transfer). O(1) amortised per
    event; Forward and Lost touch only the records in the states they concern."""

    def __init__(self, *, timeout_ms: int, lease_ms: int) -> None:
        super().__init__(TABLE, frozenset(), DEADLINES, tombstone_s=0.0,
                         tracked=(State.LOADING, State.RELEASING, State.QUEUED, State.SENDING))
        self.timeout_ms = timeout_ms
        self.lease_ms = lease_ms
        #: how long a load waits for the daemon's answer: the daemon enforces the registration's
        #: own deadline (timeout_ms) well before this
        self.load_wait_s = 2 * timeout_ms / 1000.0 + 5.0

    def _route(self, ev: Any) -> Iterable[Hashable]:
        if isinstance(ev, (Register, AbortLoad, Received, ReceiveFailed)):
            return (("recv", ev.transfer_id, ev.attempt),)
        if isinstance(ev, (Send, SendAbort, SendDone)):
            return (("send", ev.transfer_id),)
        if isinstance(ev, Released):
            return (("recv", ev.transfer_id, ev.attempt), ("send", ev.transfer_id))
        if isinstance(ev, Unsent):
            return (ev.key,)
        if isinstance(ev, Forward):
            return self.keys_in(State.QUEUED)
        if isinstance(ev, Lost):
            return [*self.keys_in(State.LOADING), *self.keys_in(State.RELEASING), *self.keys_in(State.SENDING)]
        return ()  # Tick

    def _create(self, key: Hashable, ev: Any) -> Transfer:
        return Transfer(transfer_id=ev.transfer_id)

    def _info(self, rec: Transfer, now: float) -> Any:
        return (rec.transfer_id, rec.state, rec.req_id, now - rec.created)


# ============================================================================ guards


def down(wl: WorkerLifecycle, rec: Any, ev: Any) -> bool:
    return bool(ev.down)


def early(wl: WorkerLifecycle, rec: Any, ev: Send) -> bool:
    return ev.early


def confirmed(wl: WorkerLifecycle, rec: Transfer, ev: Any) -> bool:
    return rec.confirmed


def down_confirmed(wl: WorkerLifecycle, rec: Transfer, ev: Any) -> bool:
    return bool(ev.down) and rec.confirmed


# ============================================================================= steps


def _key(rec: Transfer) -> Hashable:
    return ("send", rec.transfer_id) if rec.attempt < 0 else ("recv", rec.transfer_id, rec.attempt)


def load_facts(wl: WorkerLifecycle, rec: Transfer | None, ev: Register, out: list) -> None:
    if rec is not None:
        rec.req_id, rec.attempt, rec.block_ids, rec.since = ev.req_id, ev.attempt, ev.block_ids, ev.now
        rec.deadline = ev.now + wl.load_wait_s


def publish_register(wl: WorkerLifecycle, rec: Transfer, ev: Register, out: list) -> None:
    out.append(Publish(_key(rec), proto.Register(
        ev.transfer_id, ev.attempt, ev.block_ids, ev.num_tokens, ev.prefill_endpoints, ev.prefill_tp_size,
        wl.timeout_ms, ev.first_token, ev.secret), "registered", "d.plugin.register_published"))


def unavailable(wl: WorkerLifecycle, rec: None, ev: Register, out: list) -> None:
    out.append(LoadEnded(ev.req_id, ev.transfer_id, False, ev.block_ids, 0.0, "kvpush: daemon unavailable"))


def received(wl: WorkerLifecycle, rec: Transfer, ev: Received, out: list) -> None:
    out.append(LoadEnded(rec.req_id, rec.transfer_id, True, rec.block_ids, ev.now - rec.since))


def receive_failed(wl: WorkerLifecycle, rec: Transfer, ev: ReceiveFailed, out: list) -> None:
    out.append(LoadEnded(rec.req_id, rec.transfer_id, False, rec.block_ids, ev.now - rec.since, ev.reason,
                         say=True))


def load_lost(wl: WorkerLifecycle, rec: Transfer, ev: Any, out: list) -> None:
    why = ev.why if isinstance(ev, Lost) else (
        "no answer from the daemon" if isinstance(ev, _Deadline) else "kvpush: daemon unavailable")
    out.append(LoadEnded(rec.req_id, rec.transfer_id, False, rec.block_ids, ev.now - rec.since, why))


def publish_abort(wl: WorkerLifecycle, rec: Transfer, ev: AbortLoad | SendAbort, out: list) -> None:
    if isinstance(ev, AbortLoad):
        rec.deadline = None  # Released is owed; only the daemon's loss ends the wait otherwise
        out.append(Publish(_key(rec), proto.Abort(rec.transfer_id, rec.attempt, "request aborted")))
    else:
        rec.confirmed = True
        out.append(Publish(_key(rec), proto.Abort(rec.transfer_id, 0, "prefill request aborted")))


def free_req(wl: WorkerLifecycle, rec: Transfer | None, ev: Any, out: list) -> None:
    """Nothing of it can land or be read any more: vLLM may reuse the blocks."""
    out.append(Free(rec.req_id if rec is not None else ev.req_id))


def send_facts(wl: WorkerLifecycle, rec: Transfer | None, ev: Send, out: list) -> None:
    if rec is not None:
        rec.req_id, rec.attempt, rec.block_ids, rec.num_tokens = ev.req_id, -1, ev.block_ids, ev.num_tokens
        rec.confirmed = not ev.early
        rec.bind_node, rec.bind_secret = ev.bind_node, ev.bind_secret
        rec.streamed, rec.epoch = ev.streamed, ev.epoch


def publish_prefill_done(wl: WorkerLifecycle, rec: Transfer, ev: Any, out: list) -> None:
    rec.since = ev.now
    out.append(Publish(_key(rec), proto.PrefillDone(rec.transfer_id, rec.block_ids, rec.num_tokens, wl.lease_ms,
                                                         rec.bind_node, rec.bind_secret, rec.streamed, rec.epoch),
                       "prefill_done", "p.plugin.prefill_done_published"))


def confirm(wl: WorkerLifecycle, rec: Transfer, ev: Any, out: list) -> None:
    """vLLM finished the request: its blocks may be reported free once the daemon is done."""
    rec.confirmed = True


def report(wl: WorkerLifecycle, rec: Transfer | None, ev: Any, out: list) -> None:
    out.append(ReportTrace(rec.transfer_id if rec is not None else ev.transfer_id))


def sample(wl: WorkerLifecycle, rec: Transfer, ev: SendDone, out: list) -> None:
    if ev.ok:
        out.append(SendSample(ev.now - rec.since, len(rec.block_ids)))


# ========================================================================= the table

_LG, _RL, _QU, _SE, _SX = State.LOADING, State.RELEASING, State.QUEUED, State.SENDING, State.SENT_EARLY
_RECV_EVENTS = (Register, AbortLoad, Received, ReceiveFailed)
_SEND_EVENTS = (Send, SendAbort, SendDone)
_BY_KIND = "routed by key: a decode event never reaches a send record, nor the reverse"
_ONCE = "the scheduler registers each attempt once and aborts it once"
_NEXT_STEP = "vLLM finishes a request a step after the forward that queued its early send"
_ROUTED = "routed only to records in the states it concerns"
_NO_DEADLINE = "only LOADING has a deadline"

TABLE = Table(State, (*_RECV_EVENTS, *_SEND_EVENTS, Forward, Released, Unsent, Lost, _Deadline), [
    # --- no record ----------------------------------------------------------------------------
    row(None, Register, down, None, unavailable),
    row(None, Register, None, _LG, load_facts, publish_register),
    row(None, AbortLoad, None, None, free_req),  # its load ended here (its deadline): nothing can land
    row(None, Send, early, _QU, send_facts),
    row(None, Send, down, None, free_req),
    row(None, Send, None, _SE, send_facts, publish_prefill_done),
    row(None, SendAbort, None, None, free_req,
        unreachable="an early send keeps its record until vLLM's confirmation (this or its Send)"),
    row(None, SendDone, None, None, report),  # the timeline of a send already reported free
    *[row(None, e, None, None) for e in (Received, ReceiveFailed, Released)],  # late, or not ours
    row(None, Unsent, None, None, unreachable="fed right after the publish its record asked for"),
    *[row(None, e, None, None, unreachable=_ROUTED) for e in (Forward, Lost, _Deadline)],

    # --- decode: LOADING ------------------------------------------------------------------------
    row(_LG, Received, None, None, received),
    row(_LG, ReceiveFailed, None, None, receive_failed),
    row(_LG, AbortLoad, down, None, free_req),
    row(_LG, AbortLoad, None, _RL, publish_abort),
    row(_LG, Register, None, _LG, unreachable=_ONCE),
    row(_LG, Released, None, _LG),  # not aborted: a confused daemon; its answer or deadline ends it
    *[row(_LG, e, None, None, load_lost) for e in (Unsent, Lost, _Deadline)],

    # --- decode: RELEASING ----------------------------------------------------------------------
    *[row(_RL, e, None, None, free_req) for e in (Released, Unsent, Lost)],
    *[row(_RL, e, None, _RL) for e in (Received, ReceiveFailed)],  # the load ended as it was aborted
    *[row(_RL, e, None, _RL, unreachable=_ONCE) for e in (Register, AbortLoad)],
    row(_RL, _Deadline, None, _RL, unreachable=_NO_DEADLINE),

    # --- prefill: QUEUED ------------------------------------------------------------------------
    row(_QU, Forward, down_confirmed, None, free_req, unreachable=_NEXT_STEP),
    row(_QU, Forward, down, _SX),
    row(_QU, Forward, None, _SE, publish_prefill_done),
    row(_QU, Send, None, _QU, confirm, unreachable=_NEXT_STEP),
    row(_QU, SendAbort, None, None, free_req, unreachable=_NEXT_STEP),
    *[row(_QU, e, None, _QU, unreachable="not published yet; sends are named afresh per request")
      for e in (SendDone, Released)],
    *[row(_QU, e, None, _QU, unreachable=_ROUTED) for e in (Unsent, Lost, _Deadline)],

    # --- prefill: SENDING -----------------------------------------------------------------------
    row(_SE, SendDone, confirmed, None, sample, free_req, report),
    row(_SE, SendDone, None, _SX, sample),
    *[r for e in (Released, Unsent, Lost) for r in (
        row(_SE, e, confirmed, None, free_req),
        row(_SE, e, None, _SX))],
    row(_SE, Send, early, _SE, unreachable="one early send per request"),
    row(_SE, Send, None, _SE, confirm),
    row(_SE, SendAbort, down, None, free_req, report),
    row(_SE, SendAbort, None, _SE, publish_abort),
    row(_SE, Forward, None, _SE, unreachable=_ROUTED),
    row(_SE, _Deadline, None, _SE, unreachable=_NO_DEADLINE),

    # --- prefill: SENT_EARLY --------------------------------------------------------------------
    *[row(_SX, e, None, None, free_req, report) for e in (Send, SendAbort)],  # vLLM finished it
    *[row(_SX, e, None, _SX) for e in (SendDone, Released)],
    *[row(_SX, e, None, _SX, unreachable=_ROUTED) for e in (Forward, Unsent, Lost, _Deadline)],

    # --- rows no record takes -------------------------------------------------------------------
    *[row(s, e, None, s, unreachable=_BY_KIND) for s in (_LG, _RL) for e in (*_SEND_EVENTS, Forward)],
    *[row(s, e, None, s, unreachable=_BY_KIND) for s in (_QU, _SE, _SX) for e in _RECV_EVENTS],
])  # fmt: skip
del _LG, _RL, _QU, _SE, _SX
