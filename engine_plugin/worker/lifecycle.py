"""The worker half's per-transfer lifecycle: one record per registration or send, one table.

The worker half (:mod:`kvpush.engine_plugin.worker.half`) publishes what the scheduler
half decided and reports what the daemon answered. Each decode registration is one record
keyed ``("recv", transfer, attempt)``; each prefill send one keyed ``("send", transfer)``.
What the scheduler half decides arrives as this core's own events (Register, Send,
AbortLoad, SendAbort, StreamAbort), built there and carried by the step's metadata; a record
keeps the one that made it (``order``), and :func:`wire` builds every message to the daemon
from it. The shell feeds those, and turns the forward's end, the daemon's replies (Received,
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

What the engine gives up without the daemon's word is still told to it (a "gave up" Abort,
keyed ``("gave_up", transfer)``, no record): a Send or an early send's forward while the daemon
is down (no PrefillDone went out), a send or load the daemon was lost while holding, an abort
made while it was down. The link queues it while the daemon is silent or away and hands it
over once the daemon acknowledges the engine again, so the prefill daemon refuses the decode
side's registration at once (its tombstone) instead of both sides waiting out their
deadlines for a PrefillDone that will never come (issue 43); a restarted daemon that never
held it answers Released, which finds no record.

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
    "AbortLoad", "Forward", "Free", "FromScheduler", "LoadEnded", "Lost", "Publish", "Received", "ReceiveFailed",
    "Register", "Released", "ReportTrace", "Send", "SendAbort", "SendDone", "SendSample", "State", "StreamAbort",
    "TABLE", "Tick", "Unsent", "WorkerLifecycle", "wire",
]

# --------------------------------------------------------------------------- events
# Events and actions are plain slotted dataclasses, not frozen ones: they are made on vLLM's
# engine loop for every request, and a frozen one costs several times more to build.


# The scheduler half's decisions: it builds these and puts them in the step's metadata
# (:class:`kvpush.engine_plugin.metadata.KVPushMetadata`), and the worker half applies them as
# they are, after stamping the two facts only it knows: ``now`` (its clock) and ``down`` (its
# daemon is known unreachable, :meth:`kvpush.engine_plugin.link.state.DaemonLink.down`).


@dataclass(slots=True)
class Register:
    """Decode: register these blocks for the transfer's KV (tokens ``[first_token, num_tokens)``)."""

    transfer_id: str
    attempt: int
    req_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    first_token: int
    prefill_endpoints: tuple[str, ...]
    prefill_tp_size: int
    secret: str = ""  # the transfer's secret from the decode leg's params
    kv_groups: tuple[int, ...] = ()  # hybrid: each KV cache group's list length in block_ids (proto.groups)
    now: float = 0.0  # stamped by the worker half
    down: bool = False  # stamped by the worker half


@dataclass(slots=True)
class AbortLoad:
    """Decode: vLLM finished a request while its registration was live."""

    transfer_id: str
    attempt: int
    req_id: str
    now: float = 0.0
    down: bool = False


@dataclass(slots=True)
class Send:
    """Prefill: the request's KV is in these blocks, held until the daemon is done with them.

    ``early``: sent with the step that computes the request's last prompt token (its only
    output token is sampled there too): published right after that forward, and the same
    transfer's later plain Send (from ``request_finished``) only confirms that vLLM finished
    the request, after which its blocks may be reported free."""

    transfer_id: str
    req_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    early: bool = False
    bind_node: str = ""  # who may register: this decode node, or whoever presents bind_secret
    bind_secret: str = ""
    streamed: bool = False  # layer-wise: its chunks were streamed, the last one in ``epoch``
    epoch: int = 0
    kv_groups: tuple[int, ...] = ()  # hybrid: as Register.kv_groups
    now: float = 0.0
    down: bool = False


@dataclass(slots=True)
class SendAbort:
    """Prefill: an early-published request vLLM then finished abnormally: the daemon must stop
    using its blocks before they are reported free."""

    transfer_id: str
    req_id: str
    now: float = 0.0
    down: bool = False


@dataclass(slots=True)
class StreamAbort:
    """Prefill: a request's transfer ends unsealed (aborted, possibly before vLLM ever
    scheduled it (``abort_immediately``), streamed or not, or finished with nobody to fetch
    it): the daemon drops its progress and fails a decode side's registration it holds at
    once, so that side recomputes now instead of when its registration times out. No record:
    nothing of the engine's to free."""

    transfer_id: str
    req_id: str
    now: float = 0.0
    down: bool = False


FromScheduler = Register | AbortLoad | Send | SendAbort | StreamAbort


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


Event = FromScheduler | Forward | Received | ReceiveFailed | SendDone | Released | Unsent | Lost

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
    """One registration or send. ``order`` is the scheduler half's event that made it, kept as
    it is (nothing else holds it once applied): its facts are read there, not copied here."""

    key: Hashable
    order: Register | Send
    since: float = 0.0  # when it was published
    deadline: float | None = None  # decode: when the engine stops waiting for the daemon
    confirmed: bool = True  # prefill: vLLM finished the request (an early send: not yet)

    @property
    def transfer_id(self) -> str:
        return self.order.transfer_id

    @property
    def req_id(self) -> str:
        return self.order.req_id

    @property
    def block_ids(self) -> tuple[int, ...]:
        return self.order.block_ids


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
        if isinstance(ev, StreamAbort):
            return (("stream", ev.transfer_id),)
        if isinstance(ev, Unsent):
            return (ev.key,)
        if isinstance(ev, Forward):
            return self.keys_in(State.QUEUED)
        if isinstance(ev, Lost):
            return [*self.keys_in(State.LOADING), *self.keys_in(State.RELEASING), *self.keys_in(State.SENDING)]
        return ()  # Tick

    def _create(self, key: Hashable, ev: Register | Send) -> Transfer:
        return Transfer(key=key, order=ev)

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


def no_record_key(wl: WorkerLifecycle, rec: None, ev: Unsent) -> bool:
    """A refused publish no record asked for: a stream abort or a gave-up Abort."""
    return ev.key[0] in ("stream", "gave_up")  # type: ignore[index]


# ============================================================================= steps


GAVE_UP = "given up: the daemon was unavailable to the engine"


def wire(wl: WorkerLifecycle, order: Register | Send | StreamAbort, *, abort: bool = False, why: str = "") -> Any:
    """The one place a message to the daemon is built: from the scheduler half's event
    itself (a record's ``order``), nothing copied in between. ``why``: an abort's reason
    where it is not the request's own end."""
    if isinstance(order, Register):
        if abort:
            return proto.Abort(order.transfer_id, order.attempt, why or "request aborted")
        return proto.Register(order.transfer_id, order.attempt, order.block_ids, order.num_tokens,
                              order.prefill_endpoints, order.prefill_tp_size, wl.timeout_ms, order.first_token,
                              order.secret, order.kv_groups)
    if isinstance(order, Send):
        if abort:
            return proto.Abort(order.transfer_id, 0, why or "prefill request aborted")
        return proto.PrefillDone(order.transfer_id, order.block_ids, order.num_tokens, wl.lease_ms, order.bind_node,
                                 order.bind_secret, order.streamed, order.epoch, order.kv_groups)
    return proto.Abort(order.transfer_id, 0, "request ended before its prefill was sent")


def load_facts(wl: WorkerLifecycle, rec: Transfer, ev: Register, out: list) -> None:
    rec.since = ev.now
    rec.deadline = ev.now + wl.load_wait_s


def publish_register(wl: WorkerLifecycle, rec: Transfer, ev: Register, out: list) -> None:
    out.append(Publish(rec.key, wire(wl, rec.order), "registered", "d.plugin.register_published"))


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
    else:
        rec.confirmed = True
    out.append(Publish(rec.key, wire(wl, rec.order, abort=True)))


def publish_stream_abort(wl: WorkerLifecycle, rec: None, ev: StreamAbort, out: list) -> None:
    out.append(Publish(("stream", ev.transfer_id), wire(wl, ev)))


def tell_gave_up(wl: WorkerLifecycle, rec: Transfer | None, ev: Any, out: list) -> None:
    """The engine gave this transfer up without the daemon's word (it was down, or lost what it
    held): say so anyway. The link queues the Abort until the daemon is back; nothing waits on
    its answer (a refused one is dropped: the daemon's own deadline then ends the transfer)."""
    order = rec.order if rec is not None else ev
    out.append(Publish(("gave_up", order.transfer_id), wire(wl, order, abort=True, why=GAVE_UP)))


def free_req(wl: WorkerLifecycle, rec: Transfer | None, ev: Any, out: list) -> None:
    """Nothing of it can land or be read any more: vLLM may reuse the blocks."""
    out.append(Free(rec.req_id if rec is not None else ev.req_id))


def send_facts(wl: WorkerLifecycle, rec: Transfer, ev: Send, out: list) -> None:
    rec.confirmed = not ev.early


def publish_prefill_done(wl: WorkerLifecycle, rec: Transfer, ev: Any, out: list) -> None:
    rec.since = ev.now
    out.append(Publish(rec.key, wire(wl, rec.order), "prefill_done", "p.plugin.prefill_done_published"))


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

_NO_STREAM_RECORD = "no record is keyed by a stream abort"

TABLE = Table(State, (*_RECV_EVENTS, *_SEND_EVENTS, StreamAbort, Forward, Released, Unsent, Lost, _Deadline), [
    # --- no record ----------------------------------------------------------------------------
    row(None, Register, down, None, unavailable),  # never published: the daemon holds nothing
    row(None, Register, None, _LG, load_facts, publish_register),
    row(None, AbortLoad, None, None, free_req),  # its load ended here (its deadline): nothing can land
    row(None, Send, early, _QU, send_facts),
    row(None, Send, down, None, free_req, tell_gave_up),  # no PrefillDone: its registration is refused
    row(None, Send, None, _SE, send_facts, publish_prefill_done),
    row(None, SendAbort, None, None, free_req,
        unreachable="an early send keeps its record until vLLM's confirmation (this or its Send)"),
    row(None, SendDone, None, None, report),  # the timeline of a send already reported free
    *[row(None, e, None, None) for e in (Received, ReceiveFailed, Released)],  # late, or not ours
    row(None, StreamAbort, None, None, publish_stream_abort),  # nothing to free: a refused one costs its lease
    row(None, Unsent, no_record_key, None),
    row(None, Unsent, None, None, unreachable="fed right after the publish its record asked for"),
    *[row(None, e, None, None, unreachable=_ROUTED) for e in (Forward, Lost, _Deadline)],

    # --- decode: LOADING ------------------------------------------------------------------------
    row(_LG, Received, None, None, received),
    row(_LG, ReceiveFailed, None, None, receive_failed),
    row(_LG, AbortLoad, down, None, free_req, tell_gave_up),
    row(_LG, AbortLoad, None, _RL, publish_abort),
    row(_LG, Register, None, _LG, unreachable=_ONCE),
    row(_LG, Released, None, _LG),  # not aborted: a confused daemon; its answer or deadline ends it
    row(_LG, Unsent, None, None, load_lost),
    *[row(_LG, e, None, None, load_lost, tell_gave_up) for e in (Lost, _Deadline)],  # a silent daemon may hold it

    # --- decode: RELEASING ----------------------------------------------------------------------
    *[row(_RL, e, None, None, free_req) for e in (Released, Unsent, Lost)],
    *[row(_RL, e, None, _RL) for e in (Received, ReceiveFailed)],  # the load ended as it was aborted
    *[row(_RL, e, None, _RL, unreachable=_ONCE) for e in (Register, AbortLoad)],
    row(_RL, _Deadline, None, _RL, unreachable=_NO_DEADLINE),

    # --- prefill: QUEUED ------------------------------------------------------------------------
    row(_QU, Forward, down_confirmed, None, free_req, tell_gave_up, unreachable=_NEXT_STEP),
    row(_QU, Forward, down, _SX, tell_gave_up),  # no PrefillDone: its registration is refused
    row(_QU, Forward, None, _SE, publish_prefill_done),
    row(_QU, Send, None, _QU, confirm, unreachable=_NEXT_STEP),
    row(_QU, SendAbort, None, None, free_req, unreachable=_NEXT_STEP),
    *[row(_QU, e, None, _QU, unreachable="not published yet; sends are named afresh per request")
      for e in (SendDone, Released)],
    *[row(_QU, e, None, _QU, unreachable=_ROUTED) for e in (Unsent, Lost, _Deadline)],

    # --- prefill: SENDING -----------------------------------------------------------------------
    row(_SE, SendDone, confirmed, None, sample, free_req, report),
    row(_SE, SendDone, None, _SX, sample),
    *[r for e in (Released, Unsent) for r in (
        row(_SE, e, confirmed, None, free_req),
        row(_SE, e, None, _SX))],
    # The daemon that held the PrefillDone is gone, or silent: whichever answers next hears the
    # prefill was given up (a restarted one refuses its registration at once).
    row(_SE, Lost, confirmed, None, free_req, tell_gave_up),
    row(_SE, Lost, None, _SX, tell_gave_up),
    row(_SE, Send, early, _SE, unreachable="one early send per request"),
    row(_SE, Send, None, _SE, confirm),
    row(_SE, SendAbort, down, None, free_req, report, tell_gave_up),
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
    *[row(s, StreamAbort, None, s, unreachable=_NO_STREAM_RECORD) for s in State],
])  # fmt: skip
del _LG, _RL, _QU, _SE, _SX
