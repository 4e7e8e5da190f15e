"""What a :class:`~kvpush.proto.messages.MemoryHandle` carries, per memory kind.

The engine plugin exports its KV memory (``kvpush.engine_plugin.worker.export``) and the daemon maps
it (``kvpush.daemon.io.kv_mapping``); this module is the contract between them: the payload
dataclasses that travel in ``MemoryHandle.handle`` (encoded by the one codec, validated at the
daemon like any wire field), the shm naming rule, and what a process start time means.

``MemoryHandle.handle`` stays opaque bytes on the wire so that one Attach shape carries either
kind; :func:`shm_info` / :func:`cuda_info` are the only way to read one.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

from kvpush.proto.codec import decode_struct, encode_struct
from kvpush.proto.errors import ProtocolError
from kvpush.proto.messages import MemoryHandle

__all__ = [
    "SHM_DIR",
    "CudaIpcInfo",
    "RegionError",
    "ShmInfo",
    "cuda_handle",
    "cuda_info",
    "process_start_time",
    "remove_shm",
    "shm_handle",
    "shm_info",
]

SHM_DIR = "/dev/shm"
_SHM_NAME = re.compile(r"^/[A-Za-z0-9_.\-]{1,200}$")


class RegionError(ValueError):
    """A memory handle is malformed, does not match the memory it names, or cannot be mapped."""


@dataclass(frozen=True, slots=True)
class ShmInfo:
    """What ``MemoryHandle.handle`` carries for kind "cpu_shm"."""

    name: str  # shm object name as torch reports it ("/torch_<pid>_<rand>_<n>")
    data_offset: int  # bytes of torch's refcount header before the storage's first byte
    pid: int  # exporting process, for orphan detection
    start_time: int  # its process_start_time(), guards against pid reuse

    def validate(self) -> None:
        """One file directly in SHM_DIR: a hostile name must not reach another path."""
        if not _SHM_NAME.match(self.name) or ".." in self.name:
            raise ValueError(f"invalid shm name {self.name!r}")

    @property
    def path(self) -> str:
        return SHM_DIR + self.name


@dataclass(frozen=True, slots=True)
class CudaIpcInfo:
    """What ``MemoryHandle.handle`` carries for kind "cuda_ipc": torch's ``_share_cuda_()``."""

    device: int
    ipc_handle: bytes  # cudaIpcMemHandle of the allocation holding the storage
    storage_size: int  # bytes of the storage
    storage_offset: int  # bytes from the allocation base to the storage
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool

    def torch_args(self) -> tuple[Any, ...]:
        """Arguments of ``torch.UntypedStorage._new_shared_cuda``."""
        return (self.device, self.ipc_handle, self.storage_size, self.storage_offset,
                self.ref_counter_handle, self.ref_counter_offset, self.event_handle,
                self.event_sync_required)


def shm_handle(info: ShmInfo, size: int, offset: int) -> MemoryHandle:
    return MemoryHandle(kind="cpu_shm", handle=encode_struct(info), size=size, offset=offset)


def cuda_handle(info: CudaIpcInfo, offset: int) -> MemoryHandle:
    return MemoryHandle(kind="cuda_ipc", handle=encode_struct(info), size=info.storage_size,
                        offset=offset, device=info.device)


def _check(h: MemoryHandle, kind: str) -> None:
    if h.kind != kind:
        raise RegionError(f"handle kind {h.kind!r}, expected {kind!r}")
    if h.size <= 0:
        raise RegionError(f"handle size {h.size} must be positive")
    if not 0 <= h.offset < h.size:
        raise RegionError(f"handle offset {h.offset} outside [0, {h.size})")


def shm_info(h: MemoryHandle) -> ShmInfo:
    """The validated payload of a "cpu_shm" handle; RegionError for anything else."""
    _check(h, "cpu_shm")
    try:
        return decode_struct(ShmInfo, h.handle)
    except ProtocolError as e:
        raise RegionError(f"memory handle payload: {e}") from e


def cuda_info(h: MemoryHandle) -> CudaIpcInfo:
    """The validated payload of a "cuda_ipc" handle, consistent with the handle itself."""
    _check(h, "cuda_ipc")
    try:
        info = decode_struct(CudaIpcInfo, h.handle)
    except ProtocolError as e:
        raise RegionError(f"memory handle payload: {e}") from e
    if info.storage_size != h.size or info.device != h.device:
        raise RegionError(
            f"handle size/device {h.size}/{h.device} disagree with the IPC payload's "
            f"{info.storage_size}/{info.device}"
        )
    return info


def process_start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks (/proc/<pid>/stat field 22), or None if gone.

    (pid, start time) names a process for good: a reused pid has another start time.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # comm (field 2) may hold spaces and ')': split after the last ')'; starttime is field 22.
    return int(stat[stat.rindex(b")") + 2 :].split()[19])


def remove_shm(info: ShmInfo) -> bool:
    """Unlink the payload's shm file; True if this call removed it (gone already: False)."""
    try:
        os.unlink(info.path)
    except FileNotFoundError:
        return False
    return True
