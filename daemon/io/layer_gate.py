"""The prefill daemon's gate on the engine's GPU events: no group WRITE before its KV is written.

On GPU a layer's kernels are only queued when ``save_kv_layer`` returns, so a LayerProgress
names an interprocess CUDA event the plugin recorded behind them (``event`` = 1 + index into
the engine's :class:`~kvpush.proto.LayerEvents` pool; 0 on CPU, where the hook runs after the
kernels finished). :class:`LayerGate` holds what a frame made ready (the rendezvous'
``LayersReady`` events, or anything else: it never looks inside) until that event fired, and
hands it on in arrival order. It is sans-IO: the caller passes ``now``; the events are reached
only through an injected :class:`EventPort` (:class:`CudaEventPort` on a GPU, a fake in
tests), whose ``done`` never blocks.

**Why a reused index is safe.** The plugin takes its pool round robin (``2 x groups`` per
forward), so an index can be recorded again while items admitted under its earlier record
still wait here. ``query()`` on an interprocess event answers for its *newest* record, in any
process (cudaIpcOpenEventHandle shares the event), and every record of the pool goes on the
one stream of the worker, which completes its work in order. So when ``done`` is true for an
index, the newest record completed and with it every earlier one on that stream: every item
held on the index may go. The plugin records before it sends the frame, so the record an item
was admitted under is never newer than the one ``done`` reports on. At worst a reuse makes
items wait for a later record, never go early. An index's items therefore stay in one FIFO
and leave together.

**Why dropping is safe.** The seal (PrefillDone) comes after the forward, and its final WRITE
covers every block and layer the stream did not send. An item dropped here (the waiting bound
``max_waiting`` is full, it waited ``max_wait_s``, its event is unknown or its query failed,
the engine detached) only costs the streaming it would have bought, never correctness, and
nothing waits unbounded. Each drop is counted by reason (:class:`GateStats`).

**Whose events.** The pool comes from the attached engine (its Attach passed the peer
credential checks) and only says when that engine's own blocks may be read: its events are as
trusted as its KV. An event handle gives no access to memory.

Why no transition table: the gate has no per-key states, only FIFOs with two exits (the event
fired, or a bound); a table would have one state.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

#: sizeof(cudaIpcEventHandle_t): CUDA_IPC_HANDLE_SIZE bytes.
CUDA_IPC_EVENT_HANDLE_BYTES = 64


class EventError(ValueError):
    """An engine's event pool could not be opened (the message says why)."""


class EventPort(Protocol):
    """How the gate reaches the engine's events; ``done`` must not block."""

    def open(self, handle: bytes, device: int) -> Any:
        """The event behind ``handle`` on ``device``; :class:`EventError` if it cannot be opened."""

    def done(self, event: Any) -> bool:
        """Has the event's newest record completed? (A non-blocking query.)"""

    def close(self, event: Any) -> None:
        """Release what ``open`` took."""


class CudaEventPort:
    """The real port: ``torch.cuda.Event.from_ipc_handle`` and ``query()``.

    torch is imported on the first ``open``, so a daemon without torch or CUDA imports this
    module (and fails an open with a clear :class:`EventError`)."""

    def open(self, handle: bytes, device: int) -> Any:
        if len(handle) != CUDA_IPC_EVENT_HANDLE_BYTES:  # before CUDA is touched
            raise EventError(f"a CUDA IPC event handle has {CUDA_IPC_EVENT_HANDLE_BYTES} bytes, got {len(handle)}")
        try:
            import torch
        except ImportError as e:
            raise EventError(f"GPU events need torch in the daemon: {e}") from None
        if not torch.cuda.is_available():
            raise EventError(
                "the engine sent CUDA events but this daemon has no CUDA "
                f"(torch {torch.__version__}, cuda build: {torch.version.cuda})")
        if not 0 <= device < torch.cuda.device_count():
            raise EventError(f"CUDA device {device} not visible in this process "
                             f"({torch.cuda.device_count()} visible)")
        try:
            return torch.cuda.Event.from_ipc_handle(device, handle)
        except RuntimeError as e:
            raise EventError(f"cudaIpcOpenEventHandle failed: {e}") from None

    def done(self, event: Any) -> bool:
        return bool(event.query())

    def close(self, event: Any) -> None:
        """Nothing to call: torch destroys the imported event when its last reference goes."""


@dataclass
class GateStats:
    """What went through the gate since the daemon started (never reset: counters)."""

    passed: int = 0  # event 0: handed back at once
    released: int = 0  # held, then handed on once the event fired
    dropped_full: int = 0  # over max_waiting
    dropped_late: int = 0  # waited max_wait_s
    dropped_unknown: int = 0  # event beyond the open pool (none open, or it failed to open)
    dropped_error: int = 0  # the event's query raised
    dropped_reset: int = 0  # waiting when the pool was closed (detach, new Attach)
    last_error: str = ""

    @property
    def dropped(self) -> int:
        return (self.dropped_full + self.dropped_late + self.dropped_unknown + self.dropped_error
                + self.dropped_reset)


@dataclass
class _Slot:
    """One event of the pool and the items waiting on it: (arrival number, admitted at, item)."""

    event: Any
    items: deque[tuple[int, float, Any]] = field(default_factory=deque)


class LayerGate(Generic[T]):
    """Hold items until the engine's event fired; bounded in count and in time."""

    def __init__(self, max_waiting: int, max_wait_s: float, port: EventPort | None = None) -> None:
        if max_waiting < 0 or not 0 < max_wait_s < math.inf:
            raise ValueError(f"max_waiting {max_waiting} must be >= 0 and max_wait_s {max_wait_s} "
                             "finite and > 0 (nothing waits unbounded)")
        self.max_waiting = max_waiting
        self.max_wait_s = max_wait_s
        self._port: EventPort = CudaEventPort() if port is None else port
        self._slots: list[_Slot] = []
        self._busy: set[int] = set()  # indices of slots with items
        self._waiting = 0
        self._seq = 0
        self._now = float("-inf")  # the latest ``now`` seen: admission times never go back
        self.stats = GateStats()

    # ------------------------------------------------------------------ the pool

    @property
    def pool_size(self) -> int:
        return len(self._slots)

    @property
    def waiting(self) -> int:
        """Items held now: while > 0 the loop should ``poll`` soon (they wait for the GPU)."""
        return self._waiting

    def oldest(self) -> float | None:
        """When the longest-waiting item was admitted (None: nothing waits): the gate's lag."""
        heads = [self._slots[i].items[0][1] for i in self._busy]
        return min(heads) if heads else None

    def open_pool(self, handles: Sequence[bytes], device: int) -> None:
        """Open an engine's pool (proto.LayerEvents, after every Attach), closing any earlier one.

        All or nothing: if one handle fails, those opened are closed, no pool is left open (a
        later frame naming an event is dropped, counted, and the seal writes it all) and
        :class:`EventError` says why."""
        self.reset()
        opened: list[Any] = []
        try:
            for i, h in enumerate(handles):
                try:
                    opened.append(self._port.open(h, device))
                except EventError as e:
                    raise EventError(f"event {i + 1} of {len(handles)}: {e}") from None
        except BaseException:
            for ev in opened:
                self._close(ev)
            raise
        self._slots = [_Slot(ev) for ev in opened]

    def reset(self) -> None:
        """Detach (or a new Attach): drop what waits (counted) and close the pool's events."""
        self.stats.dropped_reset += self._waiting
        slots, self._slots = self._slots, []
        self._busy.clear()
        self._waiting = 0
        for s in slots:
            self._close(s.event)

    # ------------------------------------------------------------------ items

    def admit(self, event: int, items: Sequence[T], now: float) -> list[T]:
        """Items a frame naming ``event`` made ready: what may go now, the rest held.

        Event 0 (CPU): all of them, at once. Otherwise they join the index's FIFO and the
        answer is :meth:`poll`'s (on a fast GPU the event has often fired by the time the frame
        is read, and a later group's event having fired means an earlier one has too: releasing
        every fired index now keeps groups in order). Past ``max_waiting`` the newest items are
        dropped (counted)."""
        if event < 0:
            raise ValueError(f"event {event} < 0 (wire ints are never negative)")
        if not items:
            return []
        if event == 0:
            self.stats.passed += len(items)
            return list(items)
        if event > len(self._slots):
            self.stats.dropped_unknown += len(items)
            return []
        i = event - 1
        slot = self._slots[i]
        now = self._now = max(self._now, now)
        room = self.max_waiting - self._waiting
        if room < len(items):
            self.stats.dropped_full += len(items) - max(room, 0)
            items = items[:max(room, 0)]
        for item in items:
            self._seq += 1
            slot.items.append((self._seq, now, item))
        self._waiting += len(items)
        if slot.items:
            self._busy.add(i)
        return self.poll(now)

    def poll(self, now: float) -> list[T]:
        """Items whose event fired since, oldest first (FIFO per index); then drop those that
        have waited ``max_wait_s`` (counted): nothing waits unbounded."""
        self._now = max(self._now, now)
        if not self._waiting:
            return []
        out: list[tuple[int, float, Any]] = []
        for i in sorted(self._busy):
            self._settle(i, out)
        cutoff = self._now - self.max_wait_s
        for i in sorted(self._busy):
            q = self._slots[i].items
            while q and q[0][1] <= cutoff:
                q.popleft()
                self._waiting -= 1
                self.stats.dropped_late += 1
            if not q:
                self._busy.discard(i)
        out.sort(key=lambda e: e[0])
        return [item for _, _, item in out]

    # ------------------------------------------------------------------ inside

    def _settle(self, i: int, out: list[tuple[int, float, Any]]) -> None:
        """Index ``i`` has items: hand them all on if its event fired, drop them if the query
        failed (counted), else keep them."""
        slot = self._slots[i]
        n = len(slot.items)
        try:
            fired = bool(self._port.done(slot.event))
        except Exception as e:  # a dead exporter, a CUDA error: never guess, drop
            self.stats.dropped_error += n
            why = f"event {i + 1}: {type(e).__name__}: {e}"
            if why != self.stats.last_error:  # once per cause, not once per frame
                log.warning("layer gate: %s; its waiting items are not streamed (the final write "
                            "covers them)", why)
            self.stats.last_error = why
        else:
            if not fired:
                return
            out.extend(slot.items)
            self.stats.released += n
        slot.items.clear()
        self._waiting -= n
        self._busy.discard(i)

    def _close(self, ev: Any) -> None:
        try:
            self._port.close(ev)
        except Exception as e:  # closing is best effort: the pool is gone either way
            log.warning("layer gate: closing an event failed: %s", e)
