"""The one way a shell drives a machine: ``drive(machine, event, carry_out)``.

A machine (a keyed :class:`kvpush.common.machine.Core`, or one record under
:class:`kvpush.common.machine.Single`) answers an event with actions; the shell carries them
out, in order. Carrying one out may produce new facts for the machine: a send that found no
room, a WRITE that could not be posted, the notifications a poll found. Those
come back from ``carry_out`` as follow-up events, are queued, and are applied after the
current batch of actions has been carried out (first in, first out). So the machine is never
re-entered while its actions are being carried out: every action of one batch runs against
the state that batch's row left, and the order of everything is the order of a queue, not of
a call stack.

Bounded: one drive applies at most ``max_follow_ups`` follow-up events. More is a loop
between a machine and its shell (each answer producing another event), a bug that raises
:class:`FeedbackLoop` instead of spinning the caller forever.

``carry_out`` may return :data:`HALT` to stop the drive at once: nothing more of it is
carried out or applied (a daemon fencing itself: its process is going away, and the rest of
the batch must not reach the engine).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, Final, Protocol, TypeVar

E = TypeVar("E")
A = TypeVar("A")

MAX_FOLLOW_UPS: Final = 1 << 16  # follow-up events one drive may apply (a loop beyond that)


class Machine(Protocol):
    """Anything a shell drives: one event in, the actions to carry out (in order) out."""

    def handle(self, event: Any, /) -> Iterable[Any]: ...


class _Halt:
    __slots__ = ()

    def __repr__(self) -> str:
        return "HALT"


HALT: Final = _Halt()
"""What ``carry_out`` returns to end the drive now (the rest of it is dropped)."""


class FeedbackLoop(RuntimeError):
    """A drive's follow-up events exceeded its bound: the machine and its shell feed each other."""


def drive(machine: Machine, event: Any, carry_out: Callable[[Any], Iterable[Any] | _Halt | None], *,
          max_follow_ups: int = MAX_FOLLOW_UPS) -> None:
    """Apply ``event`` to ``machine`` and carry out its actions, in order; apply the follow-up
    events ``carry_out`` returns after the batch they came from, in the order they came,
    carrying out theirs in turn, until none is left (see the module docstring).

    Raises :class:`FeedbackLoop` once more than ``max_follow_ups`` follow-ups were queued."""
    handle, first = machine.handle, event
    queue: deque[Any] | None = None  # made on the first follow-up: most drives have none
    queued = 0
    while True:
        for act in handle(event):
            more = carry_out(act)
            if not more:
                continue
            if more is HALT:
                return
            if queue is None:
                queue = deque()
            for ev in more:  # type: ignore[union-attr]
                queued += 1
                if queued > max_follow_ups:
                    raise FeedbackLoop(
                        f"driving {type(machine).__name__} with {type(first).__name__}: more than "
                        f"{max_follow_ups} follow-up events in one drive (the machine and its shell "
                        f"keep feeding each other; last: {type(ev).__name__} after {act!r})")
                queue.append(ev)
        if not queue:
            return
        event = queue.popleft()
