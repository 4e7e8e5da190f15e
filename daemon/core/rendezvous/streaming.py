"""Layer streaming (rendezvous rules): ``LayersReady`` before the seal is kept (bounded)
and posted as group WRITEs (``StartGroupWrite``) to the live attempt's registrations the
binding admits; the flights are the writes' own (:mod:`.writes`), so every fence covers them.

Guards are pure predicates over (core, record, event), evaluated before any step of the
row; steps (core, record, event, out) change the record's facts and append actions, never a
state. The rows of :mod:`kvpush.daemon.core.rendezvous.table` name them. The core is seen
through :class:`~kvpush.daemon.core.rendezvous.records.Host` only: no rule imports it.
"""

from __future__ import annotations

from kvpush.daemon.core.rendezvous.actions import Part, StartGroupWrite
from kvpush.daemon.core.rendezvous.events import LayersReady, Prefilled
from kvpush.daemon.core.rendezvous.records import Host, State, _Flight, _Transfer


def note_progress(rv: Host, rec: _Transfer, ev: LayersReady, out: list) -> None:
    """Keep a ready group (bounded); a newer epoch voids the groups seen so far."""
    s = rec.stream
    if ev.epoch < s.epoch:
        return
    if rec.state is State.STREAMED or rec.state is None:
        s.hold_until = max(s.hold_until, ev.hold_deadline)
    if ev.epoch > s.epoch:
        s.epoch, s.groups, s.posted = ev.epoch, [], {}
    s.auto = ev.auto
    if s.binding is None or ev.binding != s.binding:
        # first word of the binding, or a frame that says otherwise: trust only agreement
        s.binding = ev.binding if s.binding is None else None
        if s.binding is None:
            s.off = True
    if s.off:
        return
    if len(s.groups) >= rv.max_groups:
        s.off, s.groups = True, []
        return
    s.groups.append(Part(ev.layer_lo, ev.layer_hi, ev.first_block, tuple(ev.block_ids), ev.epoch, ev.end_token))


def _stream_admits(rec: _Transfer) -> bool:
    """Before the seal, KV goes only where the binding the stream announced admits every
    registration, and while no rival is parked (the seal may yet pick another party)."""
    if rec.stream.binding is None or rec.contest.parked:
        return False
    who = Prefilled(rec.transfer_id, (), 0, 0.0, 0.0, *rec.stream.binding)
    return all(who.admits(r.identity, r.secret) for r in rec.regs.values())


def pump(rv: Host, rec: _Transfer, ev: object, out: list) -> None:
    """Post the ready groups each registered destination of the live attempt has not had,
    as one WRITE, within the bounds; never over a WRITE of an older epoch to it."""
    s = rec.stream
    if not rec.live or s.off or rec.prefill is not None or not _stream_admits(rec):
        return
    for dest, reg in sorted(rec.regs.items()):
        n = s.posted.get(dest, 0)
        if dest in rec.writes.started or n >= len(s.groups) or (s.auto and not reg.stream):
            continue
        flight = rec.writes.inflight.get((rec.attempt, dest))
        if flight is not None and (any(e != s.epoch for e in flight.groups.values())
                                   or len(flight.groups) >= rv.max_group_writes):
            continue
        if rv.group_writes >= rv.max_group_writes_total:
            return
        if flight is None:
            flight = rec.writes.inflight[(rec.attempt, dest)] = _Flight(reg.peer, reg.holder, final=False)
        s.seq += 1
        flight.groups[s.seq] = s.epoch
        rv.group_writes += 1
        s.posted[dest] = len(s.groups)
        out.append(StartGroupWrite(rec.transfer_id, rec.attempt, reg.peer, dest, s.seq,
                                   tuple(s.groups[n:]), reg.block_ids, reg.first_token))
