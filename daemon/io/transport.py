"""A thin wrapper around one NIXL agent: register regions, exchange metadata, post WRITEs.

No threads: NIXL's progress thread is off (it spins a full core per agent) and so is its
listener; the daemon loop polls ``state()`` and ``notifications()``, which also drive UCX
progress. Descriptors are built from numpy arrays in one shot (no per-descriptor Python).

NIXL pitfalls this module absorbs:
- two agents initialising at once on one host can hang UCX: agent creation holds a
  host-wide ``fcntl.flock`` (``lock_path``);
- memory must be registered at its final address (a tensor moved into shm changes address),
  and ``metadata()`` must be taken *after* ``register()`` (it carries the registrations);
- a plugin listed by NIXL may still fail to load (LIBFABRIC without libfabric): that is a
  ``TransportError`` naming the backend, not NIXL's bare ``NIXL_ERR_NOT_FOUND``.
"""

from __future__ import annotations

import fcntl
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

if TYPE_CHECKING:
    from collections.abc import Iterator

    from kvpush.daemon.io.kv_mapping import MappedRegion

DEFAULT_LOCK_PATH = "/tmp/kvpush-nixl.lock"
BACKENDS = ("UCX", "LIBFABRIC")

XferState = Literal["pending", "done", "error"]


class TransportError(RuntimeError):
    """NIXL refused an operation; the text names the operation, backend and peer."""


@dataclass
class XferHandle:
    """One posted WRITE; poll with ``NixlTransport.state`` and free with ``release``."""

    peer: str
    notif: bytes
    nbytes: int
    ndesc: int
    raw: Any = field(repr=False)  # nixl_xfer_handle
    posted_at: float = field(default_factory=time.monotonic)
    released: bool = False


@contextmanager
def host_lock(path: str, timeout_s: float = 60.0) -> Iterator[None]:
    """Hold an exclusive flock on ``path``; poll so a hung holder becomes an error, not a hang."""
    try:  # read-only is enough for flock, and works on a lock file another user created
        fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o666)
    except OSError as e:
        raise TransportError(f"cannot open NIXL agent creation lock {path}: {e}") from e
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TransportError(
                        f"NIXL agent creation lock {path} held for over {timeout_s:.0f}s"
                    ) from None
                time.sleep(0.01)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _descs(pairs: np.ndarray, device: int, what: str) -> np.ndarray:
    """(n, 2) int64 (addr, len) -> (n, 3) uint64 (addr, len, device) for NIXL."""
    a = np.asarray(pairs)
    if a.ndim != 2 or a.shape[1] != 2 or a.shape[0] == 0:
        raise TransportError(f"{what} descriptors must be a non-empty (n, 2) array, got {a.shape}")
    if not np.issubdtype(a.dtype, np.integer):
        raise TransportError(f"{what} descriptors must be integers, got {a.dtype}")
    if (a < 0).any() or (a[:, 1] == 0).any():
        raise TransportError(f"{what} descriptors hold a negative address or an empty length")
    out = np.empty((a.shape[0], 3), dtype=np.uint64)
    out[:, :2] = a
    out[:, 2] = device
    return out


class NixlTransport:
    """One NIXL agent of a daemon. Not thread-safe: one owner thread calls everything."""

    def __init__(
        self,
        name: str,
        backend: str = "UCX",
        *,
        backend_params: dict[str, str] | None = None,
        lock_path: str = DEFAULT_LOCK_PATH,
        lock_timeout_s: float = 60.0,
    ) -> None:
        if backend not in BACKENDS:
            raise TransportError(f"backend {backend!r} not supported; choose one of {BACKENDS}")
        self.name = name
        self.backend = backend
        self._regs: list[tuple[MappedRegion, Any]] = []  # (region, nixlRegDList)
        self._peers: set[str] = set()
        self._live: dict[int, XferHandle] = {}  # id() -> unreleased handle
        self._closed = False
        self._params = dict(backend_params or {})
        self._lock = (lock_path, lock_timeout_s)
        self._agent = self._new_agent(name)

    def _new_agent(self, name: str) -> Any:
        # Imported here so that the daemon's pure parts and tooling import without NIXL.
        from nixl._api import nixl_agent, nixl_agent_config

        conf = nixl_agent_config(
            enable_prog_thread=False, enable_listen_thread=False, backends=[]
        )
        with host_lock(*self._lock):
            agent = nixl_agent(name, conf)
            plugins = agent.get_plugin_list()
            if self.backend not in plugins:
                raise TransportError(f"NIXL plugin {self.backend} not installed (have {plugins})")
            try:
                agent.create_backend(self.backend, dict(self._params))
            except Exception as e:
                raise TransportError(
                    f"NIXL backend {self.backend} failed to initialise ({type(e).__name__}: {e}); "
                    f"is its library (e.g. libfabric for LIBFABRIC) installed and usable?"
                ) from e
        return agent

    def rotate(self, name: str) -> None:
        """Replace the agent by a new one named ``name`` and register the same regions with it.

        What a peer holding our old metadata can reach dies with the old agent: its UCX worker
        (the address peers connected to) is destroyed. Deregistering and registering again
        ("new keys") is not enough: measured with UCX over TCP and shared memory, a peer that
        kept the old metadata still READ and WROTE the region afterwards (rkeys are checked
        only by RDMA hardware; tests/security/test_revocation.py). Unreleased WRITEs are
        released and peers removed first, as in :meth:`close`. Afterwards :meth:`metadata`
        is the new agent's: peers need it again."""
        self._check_open()
        regions = [r for r, _ in self._regs]
        self.close()
        for r in regions:  # the old addresses reach nothing, cma included (ShmRegion.relocate)
            r.relocate()
        self._agent = self._new_agent(name)
        self._closed = False
        self.name = name
        for r in regions:
            self.register(r)

    # ---- memory & peers ------------------------------------------------------------------

    def register(self, region: MappedRegion) -> None:
        """Register a mapped region (at its final address) with the backend."""
        self._check_open()
        if self._regs and (self._regs[0][0].mem_type, self._regs[0][0].device) != (
            region.mem_type, region.device
        ):
            raise TransportError("all regions of one transport must share memory type and device")
        arr = np.array([[region.base, region.size, region.device]], dtype=np.uint64)
        try:
            reg = self._agent.register_memory(arr, region.mem_type, backends=[self.backend])
        except Exception as e:
            raise TransportError(f"register {region.size} bytes at {region.base:#x}: {e}") from e
        self._regs.append((region, reg))

    def deregister(self, region: MappedRegion) -> None:
        """Deregister one region (before unmapping it)."""
        for i, (r, reg) in enumerate(self._regs):
            if r is region:
                self._agent.deregister_memory(reg, backends=[self.backend])
                del self._regs[i]
                return
        raise TransportError("region was not registered with this transport")

    def metadata(self) -> bytes:
        """This agent's metadata (connection info + registrations) for peers' ``add_peer``."""
        self._check_open()
        return bytes(self._agent.get_agent_metadata())

    def add_peer(self, metadata: bytes) -> str:
        """Load a peer agent's metadata; returns its agent name. Re-adding replaces it."""
        self._check_open()
        try:
            name = self._agent.add_remote_agent(metadata)
        except Exception as e:
            raise TransportError(f"add_peer: invalid or incompatible metadata: {e}") from e
        name = name.decode() if isinstance(name, bytes) else str(name)
        self._peers.add(name)
        return name

    def remove_peer(self, name: str) -> None:
        """Forget a peer (disconnects); unknown names are ignored."""
        if name not in self._peers:
            return
        self._peers.discard(name)
        try:
            self._agent.remove_remote_agent(name)
        except Exception as e:
            raise TransportError(f"remove_peer {name}: {e}") from e

    @property
    def peers(self) -> frozenset[str]:
        return frozenset(self._peers)

    # ---- transfers ---------------------------------------------------------------------

    def write(
        self,
        peer: str,
        local: np.ndarray,
        remote: np.ndarray,
        notif: bytes,
        *,
        remote_mem_type: str | None = None,
        remote_device: int = 0,
    ) -> XferHandle:
        """Post one WRITE of ``local[i]`` to ``remote[i]`` (rows (addr, len)); ``notif`` is
        delivered to the peer once all of it has landed."""
        self._check_open()
        if peer not in self._peers:
            raise TransportError(f"write to unknown peer {peer!r}")
        if not self._regs:
            raise TransportError("write before any region was registered")
        loc = _descs(local, self._regs[0][0].device, "local")
        rem = _descs(remote, remote_device, "remote")
        if loc.shape != rem.shape or not np.array_equal(loc[:, 1], rem[:, 1]):
            raise TransportError("local and remote descriptors differ in count or lengths")
        mem = self._regs[0][0].mem_type
        try:
            ldl = self._agent.get_xfer_descs(loc, mem)
            rdl = self._agent.get_xfer_descs(rem, remote_mem_type or mem)
            raw = self._agent.initialize_xfer("WRITE", ldl, rdl, peer, notif,
                                              backends=[self.backend])
        except Exception as e:
            raise TransportError(
                f"WRITE to {peer} ({loc.shape[0]} descriptors) rejected: {type(e).__name__}: {e}"
            ) from e
        return self._post(XferHandle(peer, bytes(notif), int(loc[:, 1].sum()), int(loc.shape[0]), raw))

    def prep_local(self, descs: np.ndarray) -> Any:
        """Prepare (addr, len) rows of our registered memory once, for index-based WRITEs."""
        self._check_open()
        if not self._regs:
            raise TransportError("prep_local before any region was registered")
        r = self._regs[0][0]
        try:
            return self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", _descs(descs, r.device, "local"),
                                               r.mem_type, backends=[self.backend])
        except Exception as e:
            raise TransportError(f"prep_xfer_dlist (local, {len(descs)} descriptors): {e}") from e

    def prep_remote(self, peer: str, descs: np.ndarray, *, mem_type: str | None = None, device: int = 0) -> Any:
        """Prepare (addr, len) rows of a peer's registered memory once (after add_peer)."""
        self._check_open()
        if peer not in self._peers:
            raise TransportError(f"prep_remote for unknown peer {peer!r}")
        mem = mem_type or (self._regs[0][0].mem_type if self._regs else "DRAM")
        try:
            return self._agent.prep_xfer_dlist(peer, _descs(descs, device, "remote"), mem,
                                               backends=[self.backend])
        except Exception as e:
            raise TransportError(f"prep_xfer_dlist ({peer}, {len(descs)} descriptors): {e}") from e

    def release_prepped(self, handle: Any) -> None:
        try:
            self._agent.release_dlist_handle(handle)
        except Exception as e:
            raise TransportError(f"release_dlist_handle: {e}") from e

    def write_prepped(self, peer: str, local: Any, local_idx: np.ndarray, remote: Any,
                      remote_idx: np.ndarray, notif: bytes, *, nbytes: int) -> XferHandle:
        """Post one WRITE of prepared descriptors ``local[local_idx[i]]`` -> ``remote[remote_idx[i]]``.

        No descriptor is built here: the fixed cost of a transfer is two index arrays.
        """
        self._check_open()
        if peer not in self._peers:
            raise TransportError(f"write to unknown peer {peer!r}")
        li = np.ascontiguousarray(local_idx, dtype=np.int32)
        ri = np.ascontiguousarray(remote_idx, dtype=np.int32)
        if li.shape != ri.shape or li.ndim != 1 or li.shape[0] == 0:
            raise TransportError(f"index lists differ or are empty: {li.shape} vs {ri.shape}")
        try:
            raw = self._agent.make_prepped_xfer("WRITE", local, li, remote, ri, notif,
                                                backends=[self.backend])
        except Exception as e:
            raise TransportError(f"WRITE to {peer} ({li.shape[0]} prepared descriptors) rejected: "
                                 f"{type(e).__name__}: {e}") from e
        return self._post(XferHandle(peer, bytes(notif), nbytes, int(li.shape[0]), raw))

    def _post(self, h: XferHandle) -> XferHandle:
        """Start a created transfer; on failure its handle is released, never leaked."""
        try:
            st = self._agent.transfer(h.raw)
        except Exception as e:
            self._agent.release_xfer_handle(h.raw)
            raise TransportError(f"WRITE to {h.peer} failed to post: {e}") from e
        if st == "ERR":
            self._agent.release_xfer_handle(h.raw)
            raise TransportError(f"WRITE to {h.peer} failed to post")
        self._live[id(h)] = h
        return h

    def state(self, h: XferHandle) -> XferState:
        """Poll one WRITE (drives progress): "pending", "done" or "error"."""
        if h.released:
            raise TransportError("state() of a released transfer")
        try:
            st = self._agent.check_xfer_state(h.raw)
        except Exception:
            return "error"
        return {"DONE": "done", "PROC": "pending"}.get(st, "error")

    def release(self, h: XferHandle) -> None:
        """Free a WRITE's handle; NIXL cancels it if still in flight (error if it cannot)."""
        if h.released:
            return
        try:
            self._agent.release_xfer_handle(h.raw)
        except Exception as e:
            raise TransportError(f"release of WRITE to {h.peer} failed: {e}") from e
        h.released = True
        self._live.pop(id(h), None)

    def notifications(self) -> list[tuple[str, bytes]]:
        """New notifications since the last call, as (sending agent, message) pairs."""
        self._check_open()
        got = self._agent.get_new_notifs()
        return [(str(agent), bytes(m)) for agent, msgs in got.items() for m in msgs]

    # ---- teardown ------------------------------------------------------------------------

    def close(self) -> None:
        """Release unreleased WRITEs (NIXL cancels those in flight), remove peers, deregister
        memory (idempotent); the agent is then dropped. Unmap regions only after this."""
        if self._closed:
            return
        errors: list[str] = []
        for h in list(self._live.values()):
            try:
                self.release(h)
            except TransportError as e:
                errors.append(str(e))
        for peer in list(self._peers):
            try:
                self.remove_peer(peer)
            except TransportError as e:
                errors.append(str(e))
        for region, reg in self._regs:
            try:
                self._agent.deregister_memory(reg, backends=[self.backend])
            except Exception as e:
                errors.append(f"deregister {region.base:#x}: {e}")
        self._regs.clear()
        self._closed = True
        self._agent = None
        if errors:
            raise TransportError("; ".join(errors))

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError("transport is closed")

    def __enter__(self) -> NixlTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
