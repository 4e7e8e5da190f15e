"""Prefill-side rendezvous: when may this daemon write a transfer's KV, and when free it.

A pure state machine (no I/O, no clock, no threads) so that every interleaving of
decode registrations, prefill completion, write results, aborts and deadlines can be
property-tested in isolation. The daemon feeds it events carrying ``now`` and carries
out the actions it returns.

Events are facts in the past tense (``Registered``, ``Prefilled``, ``WriteDone``,
``Aborted``, ``PeerLost`` ...), never a wire message's name: the shell
(:mod:`kvpush.daemon.prefill_side`) translates ``proto.PeerRegister``, ``proto.PrefillDone``,
``proto.Abort`` and ``proto.Cancel`` into them.

Every transition is one row of ``TABLE`` (:mod:`.table`),
``(state, event type, guard) -> (new state, steps)`` (``None`` = no record for that
transfer); see :mod:`kvpush.common.machine.core` for how rows are picked. Guards are named pure
predicates over the record's facts and the event; steps only change those facts and emit
actions, so the legal transitions, and the actions each one carries, read off the table.

Which file holds what (each imports only those above it):

* :mod:`.events`: what happens (``Registered``, ``Prefilled``, ``LayersReady`` ...);
* :mod:`.actions`: what the shell is told to do (``StartWrite``, ``ReleaseBlocks`` ...);
* :mod:`.records`: the states, the per-transfer record and its three sub-records (writes,
  contest, stream), and ``Host``, what the rules see of the core;
* the rules, guards and steps by concern: :mod:`.registration` (who may register, supersede,
  cancel; an attempt's end), :mod:`.writes` (the source blocks and the WRITEs that read
  them), :mod:`.contest` (binding: parked rivals, the seal's choice, the heir),
  :mod:`.streaming` (layer groups before the seal);
* :mod:`.table`: ``TABLE``, the spec in one place, and the core ``Rendezvous`` that runs it.

Safety rules the table upholds (each one is a bug seen in other systems):

* at most one ``StartWrite`` per (transfer, attempt, destination rank), only while the
  source blocks are held and the registration's deadline has not passed;
* ``ReleaseBlocks`` exactly once per accepted ``Prefilled`` and never while a write
  that reads those blocks may still be in flight;
* ``NotifyFailure`` / ``ConfirmCancel`` to a decode peer never while a write into its
  blocks for that attempt is in flight (the decode side frees its blocks on them);
* every deadline is honoured no matter in which order entries were inserted (a heap
  with lazy invalidation; expiry never stops at the first unexpired entry);
* a transfer the engine bound (``Prefilled.bind_identity`` / ``bind_secret``) is written only
  to a registration of that identity or presenting that secret. A registration by another
  identity that arrives before the prefill is *parked*, not refused: the prefill's binding
  then picks the bound party, so a hijacker that registered first neither gets the KV nor
  locks the bound decode side out.

Layer-wise streaming (``LayersReady``, DESIGN §9) adds group WRITEs (``StartGroupWrite``, no
notification) before the seal (``Prefilled``), tracked in the same per-(attempt, destination)
flight as the final write, so every fence above covers them too:

* progress may come before any registration (state STREAMED: kept until ``hold_deadline``,
  then forgotten) and is only written while a registration of the live attempt is known and
  the seal has not come (after the seal the final write covers everything);
* groups ready before a registration go out together in one WRITE, later ones as they come,
  at most ``max_group_writes`` per transfer and ``max_group_writes_total`` in all (the rest
  wait in the record; whatever is still unposted at the seal goes with the final write);
* the final write (the one carrying the notification) is posted only once no group WRITE of
  that attempt and destination is in flight (NIXL orders a notification after its own data
  only); it may skip the parts already written (``StartWrite.written``) only when they were
  read from the very blocks the seal names in the seal's epoch;
* a new epoch (preemption on P) voids the progress seen so far: nothing of the new epoch is
  posted to a destination while a WRITE of an older epoch to it is in flight (drain first),
  and the final write rewrites whatever the new epoch did not stream;
* more than ``max_groups`` groups in one epoch turns streaming off for that transfer (the
  final write covers all): the record stays bounded;
* a stream in ``auto`` (``LayersReady.auto``) goes only to registrations the shell judged
  worth it (``Registered.stream``: its whole WRITE would take long enough over that link);
  the others get everything in the final write, as if nothing had streamed.
"""

from __future__ import annotations

from kvpush.common.machine.core import _Deadline
from kvpush.daemon.core.causes import Cause
from kvpush.daemon.core.rendezvous.actions import (
    Action,
    ConfirmCancel,
    NotifyFailure,
    Part,
    ReleaseBlocks,
    StartGroupWrite,
    StartWrite,
)
from kvpush.daemon.core.rendezvous.events import (
    Aborted,
    Event,
    LayersReady,
    PeerLost,
    Prefilled,
    Registered,
    Tick,
    WriteDone,
    WriteFailed,
)
from kvpush.daemon.core.rendezvous.records import TOMBSTONES, PendingInfo, State
from kvpush.daemon.core.rendezvous.registration import quota_holder
from kvpush.daemon.core.rendezvous.table import DEADLINES, TABLE, Rendezvous

__all__ = [
    "Aborted", "Action", "Cause", "ConfirmCancel", "DEADLINES", "Event", "LayersReady", "NotifyFailure",
    "Part", "PeerLost", "PendingInfo", "Prefilled", "Registered", "ReleaseBlocks", "Rendezvous",
    "StartGroupWrite", "StartWrite", "State", "TABLE", "TOMBSTONES", "Tick", "WriteDone", "WriteFailed",
    "_Deadline", "quota_holder",
]
