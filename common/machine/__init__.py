"""Transition tables and the record keeping around them: the one machine idiom of kvpush.

Imported by the daemon's pure cores and by the engine plugin's lifecycle alike; it imports
nothing of either (the plugin never imports ``kvpush.daemon``).
"""

from kvpush.common.machine.core import Core, Deadline, Held, Holdings, Record, Row, Table, row
from kvpush.common.machine.deadlines import Deadlines

__all__ = ["Core", "Deadline", "Deadlines", "Held", "Holdings", "Record", "Row", "Table", "row"]
