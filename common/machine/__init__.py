"""Transition tables and the record keeping around them: the one machine idiom of kvpush.

Imported by the daemon's pure cores and by the engine plugin's lifecycle alike; it imports
nothing of either (the plugin never imports ``kvpush.daemon``).

Every :class:`Table` of kvpush is driven one way: a machine answers ``handle(event)`` with
actions, and its shell calls :func:`drive` (the actions carried out in order, what carrying
one out tells the machine applied after the batch, nothing re-entering it). The machines
come in two shapes, because their records do:

* a keyed :class:`Core` keeps its records (many, created and forgotten by its rows, with
  deadlines, tombstones and a capacity): the rendezvous and the completion counter (daemon),
  the scheduler's and the worker's request lifecycles (plugin);
* :class:`Single` drives one record its shell keeps: the supervisor's children
  (``keyed=False``: a child always exists), a decode daemon's producer links (a keyed table
  whose records are the shell's: state None until its first row); the plugin's engine link
  (:class:`kvpush.engine_plugin.link.state.DaemonLink`) is the same, its own owner and record.

Those three stay outside :class:`Core` because they are not its kind of record: a child and
the engine link always exist (no keys, no tombstones), and a producer link's facts are its
connection's (frames queued behind its handshake) with clock events from ``Producer.due``.
Making them cores would move when their timeouts are judged: not a mechanical change.
"""

from kvpush.common.machine.core import (
    Core,
    Deadline,
    Held,
    Holdings,
    Record,
    Row,
    Single,
    Table,
    row,
)
from kvpush.common.machine.deadlines import Deadlines
from kvpush.common.machine.drive import HALT, FeedbackLoop, Machine, drive

__all__ = ["HALT", "Core", "Deadline", "Deadlines", "FeedbackLoop", "Held", "Holdings", "Machine", "Record", "Row",
           "Single", "Table", "drive", "row"]
