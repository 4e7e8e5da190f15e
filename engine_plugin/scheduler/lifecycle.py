"""The scheduler half's per-request lifecycle: one record per request, one transition table.

vLLM's scheduler calls the connector's hooks (``get_num_new_matched_tokens``,
``update_state_after_alloc``, ``build_connector_meta``, ``request_finished``,
``update_connector_output``); the shell (:mod:`kvpush.engine_plugin.scheduler.half`)
turns each into one event of this core and the core's actions back into vLLM's return
values and the step's :class:`~kvpush.engine_plugin.metadata.KVPushMetadata`.

Decode side: a request whose decode leg names a prefill daemon claims its prompt
(CLAIMED), is registered once its blocks are allocated (LOADING: the attempt is numbered
here), ends its load when the worker reports it (LOADED, then DECODING after its first
forward). Finished while loading, it keeps its blocks until the daemon released them
(RELEASING).

Parallel sampling (``n > 1``): vLLM splits the request into child requests (``f"{i}_{parent}"``),
each with the same decode leg, so the same transfer. The first child to be matched claims and
registers it; a sibling matched while that load is under way waits (``Defer``: vLLM asks again
next step, and nothing is held meanwhile), and once it has landed takes none of it (vLLM's
local prefix cache holds what the first child loaded: its full blocks are cached on the load's
end, so the sibling computes at most its prompt's last block). Without prefix caching on this
engine there is nothing to wait for: the siblings compute their prompts here at once. So one prefill, one WRITE, one registration: the prefill daemon frees its blocks as
for ``n = 1``, and no child registers a newer attempt that would supersede the first. Prefill side: a request with a prefill leg knows its transfer (PREFILLING,
or CANDIDATE while its one output token may let PrefillDone go out early, EARLY once it
did); once vLLM finished it normally its blocks are held (HELD) until the worker says the
daemon is done with them. Preemption is not a hook of its own: a preempted request is
matched and allocated again, which no state after CLAIMED turns into a second claim.

A request that registered an attempt ends as an ENDED tombstone, purged ``tombstone_s``
later: it remembers the transfer's attempt, so that a later request of the same transfer
registers a newer one. Every other request's record is forgotten when it ends. That is what keeps attempt numbers increasing, with nothing kept forever.
The tombstone time must exceed the daemon's counter's (whose records it must outlive),
hence the default. (A request ID reused within that time for another transfer keeps the
newer transfer's attempt only; vLLM makes its request IDs unique.) A live record has no deadline: vLLM ends every request it matched
with ``request_finished``, and the worker half bounds every wait for the daemon.

Pure: no I/O, no clock (events carry ``now``); fresh transfer IDs come from an injected
``name_transfer``. See :mod:`kvpush.common.machine.core` for how rows are picked.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvpush.common.machine import Record, Table, row
from kvpush.common.machine.core import _Deadline
from kvpush.common.machine.tracked import TrackedCore
from kvpush.engine_plugin.metadata import (
    AbortLoad,
    Register,
    Send,
    SendAbort,
    StreamAbort,
    StreamChunk,
)
from kvpush.proto.groups import slice_from
from kvpush.proto.params import DecodeLeg, PrefillLeg, new_secret

__all__ = [
    "AbortLoad", "Allocated", "CachedReq", "Claim", "Defer", "Finished", "Hold", "Matched", "NewReq", "Recved",
    "Register", "SchedulerLifecycle", "Send", "SendAbort", "SendingDone", "Stamp", "State", "Step", "StreamAbort",
    "StreamChunk",
    "TABLE", "TOMBSTONES",
]

TOMBSTONE_S = 120.0  # > the daemon counter's default tombstone (60 s): attempts stay increasing

# --------------------------------------------------------------------------- events
# Events and actions are plain slotted dataclasses, not frozen ones: they are made on vLLM's
# engine loop for every request, and a frozen one costs several times more to build.


@dataclass(slots=True)
class Matched:
    """get_num_new_matched_tokens: vLLM asks how many prompt tokens we will load."""

    req_id: str
    now: float
    count: int  # prompt tokens not computed locally
    decode: DecodeLeg | None
    prefill: PrefillLeg | None
    endpoints: tuple[str, ...] | None  # this engine's daemons (serial legs only); None: unknown
    single_token: bool  # max_tokens == 1: its one token is sampled by the step ending its prompt
    num_prompt: int = 0  # the prompt's length (layerwise auto: only long prompts stream)


@dataclass(slots=True)
class Allocated:
    """update_state_after_alloc: the request's blocks, and how many tokens vLLM expects us to load."""

    req_id: str
    now: float
    external: int
    block_ids: tuple[int, ...]
    num_prompt: int
    decode: DecodeLeg | None
    kv_groups: tuple[int, ...] = ()  # hybrid: each KV cache group's list length in block_ids (proto.groups)


@dataclass(slots=True)
class NewReq:
    """A request scheduled for the first time this step (SchedulerOutput.scheduled_new_reqs)."""

    num_prompt: int
    num_computed: int
    scheduled: int  # tokens scheduled this step
    block_ids: tuple[int, ...]
    kv_groups: tuple[int, ...] = ()  # as Allocated.kv_groups


@dataclass(slots=True)
class CachedReq:
    """A request scheduled again this step (SchedulerOutput.scheduled_cached_reqs)."""

    num_computed: int
    new_block_ids: tuple[int, ...]  # appended to its blocks, or its blocks if ``resumed``
    resumed: bool  # back from preemption: its blocks are new_block_ids, its KV recomputed


@dataclass(slots=True)
class Step:
    """build_connector_meta of a step that runs a forward."""

    now: float
    scheduled: Mapping[str, int]  # req_id -> tokens scheduled this step
    new: Mapping[str, NewReq]
    cached: Mapping[str, CachedReq] = field(default_factory=dict)  # streamed requests' only


@dataclass(slots=True)
class Finished:
    """request_finished: vLLM is done with the request (finished, aborted or evicted)."""

    req_id: str
    now: float
    ok: bool  # finished normally (length or stop)
    prefill: PrefillLeg | None
    block_ids: tuple[int, ...]
    num_prompt: int
    endpoints: tuple[str, ...] | None  # this engine's daemons, for the answer; None: unknown
    kv_groups: tuple[int, ...] = ()  # as Allocated.kv_groups


@dataclass(slots=True)
class Recved:
    """update_connector_output: the worker reported the request's load ended (ok or failed)."""

    req_id: str
    now: float


@dataclass(slots=True)
class SendingDone:
    """update_connector_output: the worker reported the request's blocks free."""

    req_id: str
    now: float


Event = Matched | Allocated | Step | Finished | Recved | SendingDone

# -------------------------------------------------------------------------- actions


@dataclass(slots=True)
class Claim:
    """Answer get_num_new_matched_tokens with (count, True): an async load."""

    count: int


@dataclass(slots=True)
class Defer:
    """Answer get_num_new_matched_tokens with (None, False): not decidable yet, ask again next
    step (a sibling child's load of the same transfer is under way)."""


@dataclass(slots=True)
class Hold:
    """Answer request_finished with (True, answer): vLLM keeps the blocks until finished_sending."""

    answer: dict[str, Any] | None


@dataclass(slots=True)
class Stamp:
    """A timeline stamp for the transfer (taken by the shell: the core has no clock)."""

    transfer_id: str
    hop: str


# Besides Claim, Defer, Hold and Stamp, the actions are what the worker half is handed in the
# step's metadata, built here once: the worker lifecycle's own events (Register, Send, AbortLoad,
# SendAbort, StreamAbort; the worker stamps ``now`` and ``down``) and StreamChunk (the chunks
# this step's forward computes of streamed requests).
Action = Claim | Defer | Hold | Register | Send | AbortLoad | SendAbort | StreamAbort | StreamChunk | Stamp

# --------------------------------------------------------------------------- states


class State(enum.StrEnum):
    CLAIMED = "claimed"  # decode: prompt claimed, blocks not allocated yet
    LOADING = "loading"  # decode: registered; the worker reports the load's end
    LOADED = "loaded"  # decode: load ended (ok or failed); first forward not seen yet
    DECODING = "decoding"  # decode: never claimed again (a preempted request recomputes)
    RELEASING = "releasing"  # decode: finished while loading; blocks held until Released
    PREFILLING = "prefilling"  # prefill: its transfer is known
    CANDIDATE = "candidate"  # prefill: PrefillDone may go out right after its prompt's forward
    EARLY = "early"  # prefill: PrefillDone went out early; vLLM has not finished it yet
    HELD = "held"  # prefill: finished; blocks held until the daemon is done with them
    ENDED = "ended"  # tombstone: remembers the transfer's attempt


_STREAMABLE = frozenset({State.PREFILLING, State.CANDIDATE})


TOMBSTONES = frozenset({State.ENDED})
DEADLINES: dict[State, Callable[[Any], float | None]] = {s: (lambda rec: None) for s in State if s not in TOMBSTONES}


@dataclass(eq=False)
class Req(Record):
    req_id: str
    transfer_id: str | None = None  # decode: the leg's; prefill: the router's, or named here
    attempt: int = -1  # decode: the attempt registered (-1: none) ...
    registered: str | None = None  # ... of this transfer (kept when a tombstone's ID is reused)
    loaded: bool = False  # ... and the worker reported that load's end (its blocks are cached)
    # prefill, layer-wise:
    streams: bool = False  # its prompt's KV is streamed per layer group
    num_prompt: int = 0
    epoch: int = 0  # restarts (preemption) since it streamed first: LayerChunk.epoch
    streamed: bool = False  # a chunk was streamed in this epoch (a restart voids it)
    blocks: list[int] = field(default_factory=list)  # its blocks as of its last streamed step
    bind_node: str = ""  # prefill: the decode node the router bound the transfer to ...
    secret: str = ""  # ... and its secret (the router's, or made here for a serial leg)


class SchedulerLifecycle(TrackedCore):
    """Records by req_id; an index by transfer ID numbers attempts. ``handle`` is O(1)
    amortised per event; a Step touches only the requests it concerns."""

    def __init__(self, block_size: int, *, name_transfer: Callable[[], str],
                 make_secret: Callable[[], str] = new_secret, tombstone_s: float = TOMBSTONE_S,
                 stream_min_tokens: int | None = None, stream_auto: bool = False, share_prefix: bool = True,
                 group_sizes: tuple[int, ...] = ()) -> None:
        super().__init__(TABLE, TOMBSTONES, DEADLINES, tracked=(State.LOADED, State.CANDIDATE),
                         tombstone_s=tombstone_s)
        self.block_size = block_size
        self.name_transfer = name_transfer
        self.make_secret = make_secret
        self.stream_min_tokens = stream_min_tokens  # None: layerwise off (PluginConfig)
        self.stream_auto = stream_auto  # layerwise "auto": the daemon weighs each stream against its link
        self.share_prefix = share_prefix  # vLLM's prefix caching is on: a sibling's loaded blocks are a hit
        # Hybrid: each KV cache group's own block size, 0 for a state group (proto.groups.slice_from)
        self.group_sizes = group_sizes

    def streaming(self, req_id: str) -> bool:
        """Is this a live prefill request whose KV streams (the shell's Step needs its chunk)?"""
        rec = self._recs.get(req_id)
        return rec is not None and rec.streams and rec.state in _STREAMABLE

    def record(self, req_id: str) -> Req | None:
        return self._get(req_id)  # type: ignore[no-any-return]

    def next_attempt(self, transfer_id: str) -> int:
        """One more than the newest attempt of this transfer on record (0 if none)."""
        seen = [self._recs[k].attempt for k in self._index_get(transfer_id)
                if self._recs[k].registered == transfer_id]
        return max(seen, default=-1) + 1

    def _route(self, ev: Any) -> Iterable[str]:
        if isinstance(ev, Step):
            keys = [k for k in self.keys_in(State.LOADED) if k in ev.scheduled]
            if ev.new and self.count(State.CANDIDATE):
                keys += [k for k in ev.new if self.state(k) is State.CANDIDATE]
            if self.stream_min_tokens is not None:  # streamed prefills this step computes
                keys += [k for k in ev.new if self.state(k) is not State.CANDIDATE and self.streaming(k)]
                keys += [k for k in ev.cached if self.streaming(k)]
            return keys
        return (ev.req_id,)

    def _create(self, key: str, ev: Any) -> Req:
        return Req(req_id=key)

    def _info(self, rec: Req, now: float) -> Any:
        return (rec.req_id, rec.state, rec.transfer_id, rec.attempt, now - rec.created)


# ============================================================================ guards

_SIBLING_LOADING = frozenset({State.CLAIMED, State.LOADING})
_SIBLING_LOADED = frozenset({State.LOADED, State.DECODING})


def _siblings(sl: SchedulerLifecycle, ev: Matched) -> list[Req]:
    """The other requests of this decode leg's transfer on record: an ``n > 1`` request's
    children (or a client's repeat of the same leg). O(records of that transfer)."""
    assert ev.decode is not None
    tid = ev.decode.transfer_id
    recs = (sl._recs[k] for k in sl._index_get(tid) if k != ev.req_id)
    return [r for r in recs if r.transfer_id == tid or r.registered == tid]


def sibling_loading(sl: SchedulerLifecycle, rec: Req | None, ev: Matched) -> bool:
    """Another request claimed this transfer and its load has not ended: wait for it, if its
    blocks will be a prefix hit (a second registration would be a newer attempt, superseding
    the first at the prefill daemon)."""
    return sl.share_prefix and _sibling_loading(sl, rec, ev)


def _sibling_loading(sl: SchedulerLifecycle, rec: Req | None, ev: Matched) -> bool:
    return claims(sl, rec, ev) and any(r.state in _SIBLING_LOADING and r.transfer_id == ev.decode.transfer_id
                                       for r in _siblings(sl, ev))


def sibling_loaded(sl: SchedulerLifecycle, rec: Req | None, ev: Matched) -> bool:
    """Another request's load of this transfer ended: vLLM's prefix cache holds its blocks
    (whatever of them was written; a failed load caches only its valid part), so this one
    claims nothing (its prompt is a local hit, the rest computed here). The prefill daemon
    already released its blocks: a registration now could only be refused. (Without prefix
    caching, a sibling still loading counts too: nothing to wait for, it computes here.)"""
    if not claims(sl, rec, ev):
        return False
    if _sibling_loading(sl, rec, ev):
        return True
    tid = ev.decode.transfer_id
    return any((r.state in _SIBLING_LOADED and r.transfer_id == tid)
               or (r.state is State.ENDED and r.loaded and r.registered == tid) for r in _siblings(sl, ev))


def claims(sl: SchedulerLifecycle, rec: Req | None, ev: Matched) -> bool:
    """A usable decode leg with prompt tokens left to load."""
    return ev.decode is not None and ev.count > 0


def a_decode_leg(sl: SchedulerLifecycle, rec: Req | None, ev: Matched) -> bool:
    return ev.decode is not None


def _transfer_known(rec: Req | None, ev: Matched) -> bool:
    """The router named the transfer, or this engine can (its daemons are known for the answer)."""
    return ev.prefill is not None and (not ev.prefill.serial or ev.endpoints is not None)


def early_candidate(sl: SchedulerLifecycle, rec: Req | None, ev: Matched) -> bool:
    return _transfer_known(rec, ev) and ev.single_token


def transfer_known(sl: SchedulerLifecycle, rec: Req | None, ev: Matched) -> bool:
    return _transfer_known(rec, ev)


def single_token(sl: SchedulerLifecycle, rec: Req, ev: Matched) -> bool:
    return ev.single_token


def registers(sl: SchedulerLifecycle, rec: Req | None, ev: Allocated) -> bool:
    return ev.external > 0 and ev.decode is not None


def whole_prompt(sl: SchedulerLifecycle, rec: Req, ev: Step) -> bool:
    """This step's forward computes the rest of the prompt (no chunking): publish early."""
    n = ev.new.get(rec.req_id)  # a streamed CANDIDATE resumed from preemption is a cached one
    return n is not None and n.num_prompt > 0 and n.num_computed + n.scheduled >= n.num_prompt


def _computed_before(rec: Req, ev: Step) -> int:
    n = ev.new.get(rec.req_id)
    return n.num_computed if n is not None else ev.cached[rec.req_id].num_computed


def streams_chunk(sl: SchedulerLifecycle, rec: Req, ev: Step) -> bool:
    """A streamed request whose prompt this step's forward computes (a part of)."""
    return rec.streams and ev.scheduled.get(rec.req_id, 0) > 0 and _computed_before(rec, ev) < rec.num_prompt


def streams_whole(sl: SchedulerLifecycle, rec: Req, ev: Step) -> bool:
    return streams_chunk(sl, rec, ev) and whole_prompt(sl, rec, ev)


def holds(sl: SchedulerLifecycle, rec: Req | None, ev: Finished) -> bool:
    """A prefill leg that finished normally, with KV someone will fetch."""
    if ev.prefill is None or not ev.ok or not ev.block_ids:
        return False
    return not ev.prefill.serial or ev.endpoints is not None


def abandons(sl: SchedulerLifecycle, rec: Req | None, ev: Finished) -> bool:
    """A prefill leg with a transfer the router named, ended by vLLM without holding blocks
    before any record of it (aborted while waiting; ``abort_immediately``)."""
    return ev.prefill is not None and ev.prefill.transfer_id is not None and not ev.ok


def confirms(sl: SchedulerLifecycle, rec: Req, ev: Finished) -> bool:
    """An early PrefillDone whose request finished normally, with someone to fetch it."""
    return ev.ok and (ev.endpoints is not None or ev.prefill is None or not ev.prefill.serial)


# ============================================================================= steps


def reuse(sl: SchedulerLifecycle, rec: Req, ev: Any, out: list) -> None:
    """A tombstone's request ID came again: a new request. Its old attempt stays on record
    (``registered``, the index) until this record is purged or registers a newer one."""
    rec.transfer_id = None
    rec.streams = rec.streamed = False
    rec.epoch = 0
    rec.blocks = []


def claim(sl: SchedulerLifecycle, rec: Req, ev: Matched, out: list) -> None:
    """Claim the prompt; known under its transfer from now on, so its siblings wait for it."""
    assert ev.decode is not None
    rec.transfer_id = ev.decode.transfer_id
    sl._index_add(rec.req_id, rec, ev.decode.transfer_id)
    out.append(Stamp(ev.decode.transfer_id, "d.plugin.claim"))
    out.append(Claim(ev.count))


def defer(sl: SchedulerLifecycle, rec: Req | None, ev: Matched, out: list) -> None:
    out.append(Defer())


def loaded(sl: SchedulerLifecycle, rec: Req, ev: Recved, out: list) -> None:
    rec.loaded = True


def name(sl: SchedulerLifecycle, rec: Req, ev: Matched | Finished, out: list) -> None:
    """The transfer: the router's, or named here once per request (a serial proxy's leg).
    Its binding too: the router's, or for a serial leg a fresh secret, which only the answer
    (to the front, which forwards it to the decode engine) carries."""
    if rec.transfer_id is None:
        leg = ev.prefill
        given = leg.transfer_id if leg is not None else None
        rec.transfer_id = given if given is not None else sl.name_transfer()
        rec.bind_node = leg.decode_node if leg is not None else ""
        rec.secret = leg.secret if leg is not None and leg.secret else sl.make_secret() if given is None else ""


def policy(sl: SchedulerLifecycle, rec: Req, ev: Matched, out: list) -> None:
    """Layer-wise or whole-request, once per request (PluginConfig.layerwise)."""
    rec.num_prompt = ev.num_prompt
    least = sl.stream_min_tokens
    rec.streams = least is not None and ev.num_prompt > 0 and ev.num_prompt >= least


def restart(sl: SchedulerLifecycle, rec: Req, ev: Any, out: list) -> None:
    """Matched again (preempted; or not allocated yet, which changes nothing): what it
    streamed so far is void, its blocks may already be another request's."""
    if rec.streamed:
        rec.epoch += 1
        rec.streamed = False


def stream(sl: SchedulerLifecycle, rec: Req, ev: Step, out: list) -> None:
    """Name this step's chunk: its tokens and the blocks holding them, in the current epoch.
    A request that comes back new or resumed after it streamed restarted (preemption) even
    if no Matched said so: a new epoch."""
    rid = rec.req_id
    n = ev.new.get(rid)
    if n is not None:
        restarted, blocks, start = rec.streamed, list(n.block_ids), n.num_computed
    else:
        c = ev.cached[rid]
        restarted, start = c.resumed and rec.streamed, c.num_computed
        blocks = list(c.new_block_ids) if c.resumed else rec.blocks + list(c.new_block_ids)
    if restarted:
        rec.epoch += 1
    rec.blocks = blocks
    rec.streamed = True
    bs = sl.block_size
    end = min(start + ev.scheduled[rid], rec.num_prompt)
    first = start // bs
    assert rec.transfer_id is not None
    out.append(StreamChunk(rec.transfer_id, rec.epoch, first, blocks[first:-(-end // bs)], first * bs, end,
                           rec.bind_node, rec.secret, sl.stream_auto, rec.num_prompt))


def register(sl: SchedulerLifecycle, rec: Req, ev: Allocated, out: list) -> None:
    """Number the attempt and register the blocks the load writes into."""
    leg = ev.decode
    assert leg is not None
    first_token = ev.num_prompt - ev.external
    first_token -= first_token % sl.block_size  # a local hit ending inside a block: load it all
    rec.attempt = sl.next_attempt(leg.transfer_id)
    rec.transfer_id = rec.registered = leg.transfer_id
    rec.loaded = False
    sl._index_add(rec.req_id, rec, leg.transfer_id)
    block_ids, kv_groups = slice_from(ev.block_ids, ev.kv_groups, first_token, sl.block_size, sl.group_sizes)
    out.append(Register(leg.transfer_id, rec.attempt, rec.req_id, block_ids, ev.num_prompt, first_token,
                        leg.prefill_endpoints, leg.prefill_tp_size, leg.secret, kv_groups=kv_groups))


def first_step(sl: SchedulerLifecycle, rec: Req, ev: Step, out: list) -> None:
    """The first forward after a finished load: the end of the transfer's timeline."""
    assert rec.transfer_id is not None
    out.append(Stamp(rec.transfer_id, "d.plugin.first_decode_step"))


def send_early(sl: SchedulerLifecycle, rec: Req, ev: Step, out: list) -> None:
    assert rec.transfer_id is not None
    n = ev.new[rec.req_id]
    out.append(Send(rec.transfer_id, rec.req_id, n.block_ids, n.num_prompt, True, rec.bind_node, rec.secret,
                    rec.streams and rec.streamed, rec.epoch, kv_groups=n.kv_groups))


def abort_stream(sl: SchedulerLifecycle, rec: Req, ev: Finished, out: list) -> None:
    """Ended unsealed (streamed or not): the daemon drops it and fails a registration now."""
    assert rec.transfer_id is not None
    out.append(StreamAbort(rec.transfer_id, rec.req_id))


def abandon(sl: SchedulerLifecycle, rec: Req | None, ev: Finished, out: list) -> None:
    """As abort_stream, for a request that never had a record."""
    assert ev.prefill is not None and ev.prefill.transfer_id is not None
    out.append(StreamAbort(ev.prefill.transfer_id, ev.req_id))


def _answer(rec: Req, ev: Finished) -> dict[str, Any] | None:
    """The decode leg's params this engine answers with (a serial proxy forwards them)."""
    eps = ev.endpoints
    if eps is None or rec.transfer_id is None:
        return None
    return DecodeLeg(rec.transfer_id, eps, len(eps), rec.secret).to_params()


def hold_send(sl: SchedulerLifecycle, rec: Req, ev: Finished, out: list) -> None:
    """Keep the blocks; PrefillDone goes out with this step (or confirms the early one)."""
    assert rec.transfer_id is not None
    out.append(Stamp(rec.transfer_id, "p.plugin.prefill_finished"))
    out.append(Send(rec.transfer_id, rec.req_id, ev.block_ids, ev.num_prompt, False, rec.bind_node, rec.secret,
                    rec.streams and rec.streamed, rec.epoch, kv_groups=ev.kv_groups))
    out.append(Hold(_answer(rec, ev)))


def withdraw(sl: SchedulerLifecycle, rec: Req, ev: Finished, out: list) -> None:
    """Aborted after its early PrefillDone (or a serial leg nobody will fetch): the daemon
    must let go of the blocks before they are reported free."""
    assert rec.transfer_id is not None
    out.append(SendAbort(rec.transfer_id, rec.req_id))
    out.append(Hold(_answer(rec, ev) if ev.ok else None))


def abort_load(sl: SchedulerLifecycle, rec: Req, ev: Finished, out: list) -> None:
    """Gone while its registration is live: no reuse of the blocks until no WRITE can land."""
    assert rec.transfer_id is not None
    out.append(AbortLoad(rec.transfer_id, rec.attempt, rec.req_id))
    out.append(Hold(None))


# ========================================================================= the table

_CL, _LG, _LD, _DC, _RL = State.CLAIMED, State.LOADING, State.LOADED, State.DECODING, State.RELEASING
_PF, _CA, _EA, _HD, _EN = State.PREFILLING, State.CANDIDATE, State.EARLY, State.HELD, State.ENDED
_FINISHED_ONCE = "vLLM finishes a request once and never schedules it after"
_EARLY_ENDS = "an EARLY request's only token is sampled by the step that made it EARLY, which finishes it"
_ROUTED = "a Step is routed to LOADED and CANDIDATE records only"
_NO_DEADLINE = "a live request has no deadline (vLLM ends it; the worker bounds the daemon)"
_OURS = "external tokens come only from our claim"
_LAST_TOKEN = "vLLM computes a prompt's last token itself: a match always leaves tokens to load"
_REMOTE = "a request waiting for remote KV is not scheduled"
_ONE_REPORT = ("the worker reports a request once, and only the load of a LOADING request "
               "or the blocks of a HELD or RELEASING one")

TABLE = Table(State, (Matched, Allocated, Step, Finished, Recved, SendingDone, _Deadline), [
    # --- no record (or a tombstone whose request ID came again) ----------------------------
    *[r for s, first in ((None, ()), (_EN, (reuse,))) for r in (
        row(s, Matched, sibling_loading, s, defer),  # n > 1: a sibling child's load is under way
        row(s, Matched, sibling_loaded, s),  # ... or landed: its blocks are a local prefix hit
        row(s, Matched, claims, _CL, *first, claim),
        row(s, Matched, a_decode_leg, s, unreachable=_LAST_TOKEN),
        row(s, Matched, early_candidate, _CA, *first, name, policy),
        row(s, Matched, transfer_known, _PF, *first, name, policy),
        row(s, Matched, None, s),  # not ours
    )],
    *[r for s, first in ((None, ()), (_EN, (reuse,))) for r in (
        row(s, Allocated, registers, _LG, *first, register, unreachable=_OURS),
        row(s, Allocated, None, s),
        row(s, Finished, holds, _HD, *first, name, hold_send),  # a serial leg whose daemons became known
        row(s, Finished, abandons, s, abandon),  # aborted before it was matched (abort_immediately)
        row(s, Finished, None, s),
    )],
    *[row(s, Step, None, s, unreachable=_ROUTED) for s in (None, _EN)],
    row(None, _Deadline, None, None, unreachable="a forgotten record has no deadline"),
    row(_EN, _Deadline, None, None),  # tombstone time is over

    # --- decode -----------------------------------------------------------------------------
    row(_CL, Matched, claims, _CL, claim),  # not allocated last step: claimed again
    row(_CL, Matched, None, _CL, unreachable=_LAST_TOKEN),
    row(_CL, Allocated, registers, _LG, register),
    row(_CL, Allocated, None, _CL, unreachable="vLLM allocates for the tokens we claimed"),
    row(_CL, Finished, None, None),  # nothing registered: nothing to remember
    *[row(s, Matched, None, s) for s in (_LD, _DC)],  # preempted: never claimed again
    row(_LG, Matched, None, _LG, unreachable=_REMOTE),
    row(_LG, Allocated, None, _LG, unreachable=_REMOTE),
    *[row(s, Allocated, None, s) for s in (_LD, _DC)],
    row(_LG, Recved, None, _LD, loaded),
    row(_LG, Finished, None, _RL, abort_load),
    row(_LD, Step, None, _DC, first_step),
    row(_LD, Finished, None, _EN),
    row(_DC, Finished, None, _EN),
    row(_RL, SendingDone, None, _EN),
    row(_EN, Recved, None, _EN),  # its load failed (deadline) as its abort was freed: nothing to do
    *[row(_RL, e, None, _RL, unreachable=_FINISHED_ONCE) for e in (Matched, Allocated, Finished)],

    # --- prefill ----------------------------------------------------------------------------
    row(_PF, Matched, single_token, _CA, restart),  # preempted and matched again
    row(_PF, Matched, None, _PF, restart),
    row(_CA, Matched, None, _CA, restart),
    row(_EA, Matched, None, _EA, unreachable=_EARLY_ENDS),
    *[row(s, Allocated, None, s) for s in (_PF, _CA)],
    row(_EA, Allocated, None, _EA, unreachable=_EARLY_ENDS),
    row(_CA, Step, streams_whole, _EA, stream, send_early),  # the seal right after its one chunk
    row(_CA, Step, whole_prompt, _EA, send_early),
    row(_CA, Step, streams_chunk, _PF, stream),  # its first chunk, or resumed from preemption
    row(_CA, Step, None, _PF),  # chunked: PrefillDone goes out when vLLM finishes it
    row(_PF, Step, streams_chunk, _PF, stream),  # a later chunk
    row(_PF, Step, None, _PF),  # streamed, past its prompt (decoding: max_tokens > 1)
    *[row(s, Finished, holds, _HD, hold_send) for s in (_PF, _CA)],
    *[row(s, Finished, None, None, abort_stream) for s in (_PF, _CA)],  # ended unsealed: withdrawn
    row(_EA, Finished, confirms, _HD, hold_send),
    row(_EA, Finished, None, _HD, withdraw),
    row(_HD, SendingDone, None, None),
    *[row(_HD, e, None, _HD, unreachable=_FINISHED_ONCE) for e in (Matched, Allocated, Finished)],

    # --- rows no request takes --------------------------------------------------------------
    *[row(s, Recved, None, s, unreachable=_ONE_REPORT) for s in (None, _CL, _LD, _DC, _RL, _PF, _CA, _EA, _HD)],
    *[row(s, SendingDone, None, s, unreachable=_ONE_REPORT) for s in (None, _EN, _CL, _LG, _LD, _DC, _PF, _CA, _EA)],
    *[row(s, Step, None, s, unreachable=_ROUTED) for s in (_CL, _LG, _DC, _RL, _EA, _HD)],
    *[row(s, _Deadline, None, s, unreachable=_NO_DEADLINE) for s in State if s is not _EN],
])  # fmt: skip
del _CL, _LG, _LD, _DC, _RL, _PF, _CA, _EA, _HD, _EN
