"""Where a LayerProgress's ``event`` comes from: nothing on CPU, an interprocess CUDA event on GPU.

On CPU ``save_kv_layer`` runs after the layer's kernels finished: the KV is in its blocks, the
frame says ``event=0``. On GPU the kernels are only queued when the hook returns, so the worker
records an event of a fixed pool on the current stream and the frame names it (``1 + index``);
the daemon opens the pool's IPC handles once (proto.LayerEvents, sent right after every Attach)
and posts nothing of those layers before ``query()`` says the event fired.

**Reuse.** The pool holds ``2 × groups per forward`` events, taken round robin: an index is
recorded again only a whole forward later, after that forward's seal, when the daemon no longer
waits on the earlier recording in practice. Even an earlier reuse could not post a WRITE early:
``query()`` answers for the newest recording of an event, and on one stream that completes only
after every earlier one, so a reused index at worst makes the daemon wait longer, never shorter.

No NIXL here, and nothing blocks: ``record`` only enqueues a marker on the stream.
"""

from __future__ import annotations

from typing import Any, Protocol

from kvpush import proto


class EventSource(Protocol):
    def announce(self) -> proto.LayerEvents | None:
        """The pool's handles, for the daemon, once per Attach (None: no events)."""

    def record(self) -> int:
        """Mark "every layer so far is written" on the stream; the frame's ``event`` field."""


class CpuEvents:
    """CPU: the hook is synchronous, the KV is written when it runs."""

    def announce(self) -> proto.LayerEvents | None:
        return None

    def record(self) -> int:
        return 0


class _Pool:
    """Round robin over ``size`` slots; ``record`` returns 1 + the slot recorded."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError("an event pool needs at least one event")
        self.size = size
        self._next = 0

    def _take(self) -> int:
        i = self._next
        self._next = i + 1 if i + 1 < self.size else 0
        return i


class CudaEvents(_Pool):
    """A pool of ``torch.cuda.Event(interprocess=True)`` on ``device``."""

    def __init__(self, size: int, device: int) -> None:
        import torch

        super().__init__(size)
        self.device = device
        with torch.cuda.device(device):
            # interprocess events cannot time (CUDA's rule); blocking=False: nobody syncs on them here
            self.events: list[Any] = [torch.cuda.Event(enable_timing=False, blocking=False, interprocess=True)
                                      for _ in range(size)]
            for e in self.events:  # an IPC handle needs the event created on the device: record once
                e.record()
        self._stream = torch.cuda.current_stream

    def announce(self) -> proto.LayerEvents | None:
        return proto.LayerEvents(tuple(bytes(e.ipc_handle()) for e in self.events), self.device)

    def record(self) -> int:
        i = self._take()
        self.events[i].record(self._stream())
        return i + 1


class FakeEvents(_Pool):
    """For tests: the CUDA source's bookkeeping without a GPU (``recorded``: slots, in order)."""

    def __init__(self, size: int, device: int = 0) -> None:
        super().__init__(size)
        self.device = device
        self.recorded: list[int] = []

    def announce(self) -> proto.LayerEvents | None:
        return proto.LayerEvents(tuple(b"fake-%d" % i for i in range(self.size)), self.device)

    def record(self) -> int:
        i = self._take()
        self.recorded.append(i)
        return i + 1


def pool_size(num_layers: int, group: int) -> int:
    """Two forwards' worth of groups: an index comes back only a forward later (module doc)."""
    return 2 * -(-num_layers // group)
