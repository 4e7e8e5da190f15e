"""The source blocks and the WRITEs that read them (rendezvous rules): holding the seal's
blocks, what a final WRITE carries (``StartWrite``, the parts already ``_written``), the
flights and their landing, and the release of the blocks once nothing reads them.

Guards are pure predicates over (core, record, event), evaluated before any step of the
row; steps (core, record, event, out) change the record's facts and append actions, never a
state. The rows of :mod:`kvpush.daemon.core.rendezvous.table` name them. The core is seen
through :class:`~kvpush.daemon.core.rendezvous.records.Host` only: no rule imports it.
"""

from __future__ import annotations

from kvpush.daemon.core.causes import Cause
from kvpush.daemon.core.rendezvous.actions import (
    ConfirmCancel,
    NotifyFailure,
    Part,
    ReleaseBlocks,
    StartWrite,
)
from kvpush.daemon.core.rendezvous.events import Prefilled, Registered, WriteDone, WriteFailed
from kvpush.daemon.core.rendezvous.records import Host, _Flight, _Transfer, _Verdict
from kvpush.daemon.core.rendezvous.registration import _fail

# ============================================================================ guards


def unknown_write(rv: Host, rec: _Transfer, ev: WriteDone | WriteFailed) -> bool:
    """Not a write we started, or one already answered."""
    f = rec.writes.inflight.get((ev.attempt, ev.dest_rank))
    if f is None:
        return True
    return not f.final if ev.group == 0 else ev.group not in f.groups


def _frees_final(rec: _Transfer, ev: WriteDone | WriteFailed) -> bool:
    """This group is the last one before the deferred final write of a live attempt."""
    f = rec.writes.inflight[(ev.attempt, ev.dest_rank)]
    return (ev.group > 0 and isinstance(ev, WriteDone) and f.final_due and not f.confirm
            and set(f.groups) == {ev.group} and not f.final and _of_live_attempt(rec, ev))


def _in_time(rv: Host, rec: _Transfer, dest: int) -> bool:
    return rv.now < rec.regs[dest].deadline


def _posts_final(rv: Host, rec: _Transfer, ev: WriteDone | WriteFailed) -> bool:
    """This group's landing lets the deferred final write go out (within the registration's
    deadline, as every write)."""
    return _frees_final(rec, ev) and _in_time(rv, rec, ev.dest_rank)


def final_too_late(rv: Host, rec: _Transfer, ev: WriteDone) -> bool:
    """The groups landed after the registration's deadline: the final write may not go."""
    return _frees_final(rec, ev) and not _in_time(rv, rec, ev.dest_rank)


def final_too_late_last(rv: Host, rec: _Transfer, ev: WriteDone) -> bool:
    return final_too_late(rv, rec, ev) and len(rec.writes.inflight) == 1


def _ends_flight(rv: Host, rec: _Transfer, ev: WriteDone | WriteFailed) -> bool:
    f = rec.writes.inflight.get((ev.attempt, ev.dest_rank))
    if f is None:
        return False
    if ev.group == 0:
        return f.final and not f.groups
    return set(f.groups) == {ev.group} and not f.final and not _posts_final(rv, rec, ev)


def last_write(rv: Host, rec: _Transfer, ev: WriteDone | WriteFailed) -> bool:
    """This write is the only one still in flight (and posts nothing after it)."""
    return len(rec.writes.inflight) == 1 and _ends_flight(rv, rec, ev)


def drains_ended(rv: Host, rec: _Transfer, ev: WriteDone | WriteFailed) -> bool:
    """The last group WRITE of an attempt that ended before the seal (cancelled, inconsistent)
    lands: nothing is live or in flight any more, as if it had ended idle."""
    return not rec.live and last_write(rv, rec, ev)


def busy(rv: Host, rec: _Transfer, ev: object) -> bool:
    """A (group) write is in flight."""
    return bool(rec.writes.inflight)


def _of_live_attempt(rec: _Transfer, ev: WriteDone | WriteFailed) -> bool:
    return rec.live and ev.attempt == rec.attempt


def fails_attempt(rv: Host, rec: _Transfer, ev: WriteFailed) -> bool:
    """A write of the live attempt failed: the transfer fails."""
    return _of_live_attempt(rec, ev)


def fails_attempt_last(rv: Host, rec: _Transfer, ev: WriteFailed) -> bool:
    return _of_live_attempt(rec, ev) and last_write(rv, rec, ev)


def completes(rv: Host, rec: _Transfer, ev: WriteDone) -> bool:
    """The last outstanding write of the live attempt landed: the transfer succeeded."""
    return ev.group == 0 and _of_live_attempt(rec, ev) and len(rec.writes.done | {ev.dest_rank}) == rec.expected


def completes_last(rv: Host, rec: _Transfer, ev: WriteDone) -> bool:
    return completes(rv, rec, ev) and last_write(rv, rec, ev)


def last_write_ok(rv: Host, rec: _Transfer, ev: WriteDone | WriteFailed) -> bool:
    assert rec.verdict is not None
    return last_write(rv, rec, ev) and rec.verdict.ok


def idle(rv: Host, rec: _Transfer, ev: object) -> bool:
    """No write is in flight: the source blocks can go back now."""
    return not rec.writes.inflight


# ============================================================================= steps


def hold(rv: Host, rec: _Transfer, ev: Prefilled, out: list) -> None:
    """Keep the engine's blocks until ReleaseBlocks. A binding the owner does not meet frees
    the transfer for the bound party (the owner's registrations, if any, are over)."""
    rec.prefill = ev
    if ev.bound and not any(ev.admits(r.identity, r.secret) for r in rec.regs.values()):
        rec.contest.owner = ""


def _start(rec: _Transfer, dest: int, out: list) -> None:
    """The final write, or its promise once the group WRITEs to ``dest`` have landed."""
    assert rec.prefill is not None and dest not in rec.writes.started
    rec.writes.started.add(dest)
    flight = rec.writes.inflight.get((rec.attempt, dest))
    if flight is not None:
        flight.final_due = True
        return
    _post_final(rec, dest, out)


def _written(rec: _Transfer, dest: int) -> tuple[Part, ...]:
    """Parts of the seal's epoch already written to ``dest`` from the blocks the seal names."""
    assert rec.prefill is not None
    if rec.prefill.epoch < 0 or rec.prefill.epoch != rec.stream.epoch or rec.prefill.kv_groups:
        return ()  # (hybrid groups never stream: a layer frame names no group)
    src = rec.prefill.block_ids
    return tuple(p for p in rec.stream.groups[: rec.stream.posted.get(dest, 0)]
                 if src[p.first_block: p.first_block + len(p.src_block_ids)] == p.src_block_ids)


def _post_final(rec: _Transfer, dest: int, out: list) -> None:
    assert rec.prefill is not None
    reg = rec.regs[dest]
    rec.writes.inflight[(rec.attempt, dest)] = _Flight(reg.peer, reg.holder)
    out.append(
        StartWrite(
            rec.transfer_id,
            rec.attempt,
            reg.peer,
            dest,
            rec.prefill.block_ids,
            reg.block_ids,
            rec.prefill.num_tokens,
            reg.first_token,
            _written(rec, dest),
            reg.key,
            rec.prefill.kv_groups,
            reg.kv_groups,
        )
    )


def start_reg(rv: Host, rec: _Transfer, ev: Registered, out: list) -> None:
    _start(rec, ev.dest_rank, out)


def start_all(rv: Host, rec: _Transfer, ev: Prefilled, out: list) -> None:
    for dest in sorted(rec.regs):
        _start(rec, dest, out)


def release_overloaded(rv: Host, rec: None, ev: Prefilled, out: list) -> None:
    out.append(ReleaseBlocks(ev.transfer_id, ev.block_ids, False, "overloaded", Cause.OVERLOADED))


def decide_overloaded(rv: Host, rec: _Transfer, ev: Prefilled, out: list) -> None:
    rec.verdict = _Verdict(False, "overloaded", Cause.OVERLOADED)


def release(rv: Host, rec: _Transfer, ev: object, out: list) -> None:
    """Give the source blocks back with the verdict (the row guarantees nothing reads them).
    No seal yet (a stream drained): nothing is held; a later Prefilled goes straight back."""
    assert rec.verdict is not None and not rec.writes.inflight
    if rec.prefill is None:
        return
    v = rec.verdict
    out.append(ReleaseBlocks(rec.transfer_id, rec.prefill.block_ids, v.ok, v.reason, v.cause))


def land(rv: Host, rec: _Transfer, ev: WriteDone | WriteFailed, out: list) -> None:
    """The write is over: answer its peer (a pending cancel, or the failure) once its
    flight is empty; a group's landing may let the deferred final write go out."""
    key = (ev.attempt, ev.dest_rank)
    flight = rec.writes.inflight[key]
    final_landed = ev.group == 0
    if final_landed:
        flight.final = False
    else:
        del flight.groups[ev.group]
        rv.group_writes -= 1
    if flight.groups or flight.final:
        return
    if (not final_landed and flight.final_due and isinstance(ev, WriteDone)
            and _of_live_attempt(rec, ev) and not flight.confirm and _in_time(rv, rec, ev.dest_rank)):
        del rec.writes.inflight[key]
        _post_final(rec, ev.dest_rank, out)
        return
    del rec.writes.inflight[key]
    if flight.confirm:
        if not any(a == ev.attempt and f.peer == flight.peer for (a, _), f in rec.writes.inflight.items()):
            out.append(ConfirmCancel(rec.transfer_id, ev.attempt, flight.peer))
        return
    if isinstance(ev, WriteFailed):
        reason, cause = _write_reason(ev), ev.cause
    elif final_landed or _of_live_attempt(rec, ev):
        return  # the peer has its notification, or more of a live attempt is to come
    else:  # group WRITEs of an ended attempt: the peer never gets a notification
        reason, cause = rec.ended if ev.attempt == rec.attempt else (
            f"superseded by attempt {rec.attempt}", Cause.SUPERSEDED)
    if ev.attempt == rec.attempt:
        rec.writes.told.add(ev.dest_rank)
    out.append(NotifyFailure(rec.transfer_id, ev.attempt, flight.peer, ev.dest_rank, reason, cause))


def _write_reason(ev: WriteFailed) -> str:
    return f"write failed: {ev.reason}"


def count_done(rv: Host, rec: _Transfer, ev: WriteDone, out: list) -> None:
    if ev.group == 0 and _of_live_attempt(rec, ev):
        rec.writes.done.add(ev.dest_rank)


def decide_ok(rv: Host, rec: _Transfer, ev: WriteDone, out: list) -> None:
    rec.live = False
    rec.verdict = _Verdict(True, "", Cause.OK)


def fail_write(rv: Host, rec: _Transfer, ev: WriteFailed, out: list) -> None:
    _fail(rec, _write_reason(ev), ev.cause, out)


def fail_late(rv: Host, rec: _Transfer, ev: WriteDone, out: list) -> None:
    _fail(rec, "prefill did not complete in time (the stream's writes landed after the registration's "
          "deadline)", Cause.TIMEOUT, out)
