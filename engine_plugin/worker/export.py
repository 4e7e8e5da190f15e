"""Engine side of the KV memory contract: export a tensor's storage so a daemon can map it.

CPU: torch's ``file_system`` sharing moves the tensor's storage into a ``/dev/shm/torch_*``
file *in place* (every view of that storage follows); the daemon maps that file
(``open_region`` in daemon/io/kv_mapping.py). CUDA: torch's refcounted CUDA IPC handle. What the
handle carries is defined in :mod:`kvpush.proto.handles`.

Export adds one reference to torch's refcount header of the shm file (the "pin"), so freeing
the tensor in the engine never makes torch's storage deleter unlink the file: had it, a later
``unlink_export`` followed by the engine freeing the tensor would make that deleter throw
"could not unlink the shared memory file" from a destructor and abort the engine. Who does
remove the file: see daemon/io/kv_mapping.py.
"""

from __future__ import annotations

import ctypes
import os

import torch

from kvpush.proto.handles import (
    SHM_DIR,
    CudaIpcInfo,
    RegionError,
    ShmInfo,
    cuda_handle,
    process_start_time,
    remove_shm,
    shm_handle,
    shm_info,
)
from kvpush.proto.messages import MemoryHandle

__all__ = ["SHM_GROUP_ENV", "export_cpu_tensor", "export_cuda_tensor", "unlink_export"]

SHM_GROUP_ENV = "KVPUSH_SHM_GROUP"
_PINNED: set[str] = set()  # shm names this process has pinned (export is idempotent)


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
    info = ShmInfo(name, data_offset, pid, process_start_time(pid) or 0)
    return shm_handle(info, size=nbytes, offset=t.storage_offset() * t.element_size())


def unlink_export(h: MemoryHandle) -> bool:
    """Remove an exported shm file now (the engine's own cleanup); True if this call did."""
    return remove_shm(shm_info(h))


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
    return cuda_handle(info, offset=t.storage_offset() * t.element_size())
