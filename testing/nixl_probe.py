"""A bare NIXL agent for security tests: what a node holding some NIXL metadata can try.

Tests in tests/security play a compromised (allowlisted, or revoked) node with it: load the
metadata it was given, READ and WRITE at the addresses it was given, and report what NIXL
answered. No kvpush code on this path, so what it reaches is what NIXL/UCX allow.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

# UCX_TLS per medium: "shm,tcp" lets UCX take shared memory between processes of one host
# ("shm" alone cannot start a NIXL agent here: it needs TCP for its own wire-up).
MEDIA = {"shm": "shm,tcp", "tcp": "tcp"}


def agent(name: str) -> Any:
    """A NIXL agent with the UCX backend (progress and listener threads off, as kvpushd's)."""
    from nixl._api import nixl_agent, nixl_agent_config

    a = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=[]))
    a.create_backend("UCX", {})
    return a


def register(a: Any, buf: np.ndarray) -> Any:
    return a.register_memory(np.array([[buf.ctypes.data, buf.nbytes, 0]], dtype=np.uint64), "DRAM")


def xfer(a: Any, op: str, local: np.ndarray, remote_addr: int, peer: str, notif: bytes = b"",
         wait_s: float = 5.0) -> str:
    """One READ or WRITE of all of ``local`` at ``remote_addr``: "DONE", "PROC" (not done
    within ``wait_s``), "ERR", or the name of the exception NIXL raised."""
    loc = a.get_xfer_descs(np.array([[local.ctypes.data, local.nbytes, 0]], dtype=np.uint64), "DRAM")
    rem = a.get_xfer_descs(np.array([[remote_addr, local.nbytes, 0]], dtype=np.uint64), "DRAM")
    try:
        h = a.initialize_xfer(op, loc, rem, peer, notif)
        st = a.transfer(h)
        end = time.monotonic() + wait_s
        while st == "PROC" and time.monotonic() < end:
            st = a.check_xfer_state(h)
        a.release_xfer_handle(h)
        return st
    except Exception as e:  # NIXL refuses: no such agent, no registration, disconnected
        return type(e).__name__
