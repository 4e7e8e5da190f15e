"""Exporting a VMM-backed KV cache as POSIX file descriptors (designed; not enabled yet).

vLLM 0.34's extensible KV cache maps physical chunks (``cuMemCreate``) into a reserved range;
legacy CUDA IPC cannot export it, so today kvpush asks vLLM for the legacy allocation
(``kv_cache_access``: LEGACY_IPC). The next step (docs/gpu-memory.md): answer EXPORTS_FD, so
that vLLM backs each segment by one physical allocation created with the POSIX-fd export
type, and export each region here; the descriptors go with the Attach
(:mod:`kvpush.proto.fdpass`) and the daemon maps them (:mod:`kvpush.daemon.io.vmm_import`).

:func:`export_regions` is driver-agnostic (:class:`VmmExportDriver`: the CUDA driver API's
cuMemRetainAllocationHandle, cuMemGetAddressRange, cuMemExportToShareableHandle and
cuMemRelease). The CUDA driver is :class:`kvpush.common.cuda_vmm.CudaVmm`, run on a GPU only
by ``scripts/gpu_check.sh``'s ``vmm`` step, which must pass before this is enabled; the unit
tests drive it with fakes whose physical allocations are memfd files.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["ExportedRegion", "VmmExportDriver", "VmmExportError", "export_regions"]


class VmmExportError(RuntimeError):
    """A region cannot be exported as one descriptor: refused at start-up."""


class VmmExportDriver(Protocol):
    def retain(self, ptr: int) -> Any:
        """The physical allocation mapped at ``ptr`` (cuMemRetainAllocationHandle)."""

    def mapped_range(self, ptr: int) -> tuple[int, int]:
        """The start and size of the mapped allocation ``ptr`` lies in (cuMemGetAddressRange)."""

    def export_fd(self, handle: Any) -> int:
        """A new POSIX descriptor of the allocation (cuMemExportToShareableHandle)."""

    def release(self, handle: Any) -> None:
        """Drop the reference ``retain`` took (cuMemRelease)."""


@dataclass(frozen=True)
class ExportedRegion:
    fd: int  # the caller's to send and then close
    size: int  # the physical allocation's size: what the daemon maps
    offset: int  # where the region starts inside it


def export_regions(regions: list[tuple[int, int]], driver: VmmExportDriver) -> list[ExportedRegion]:
    """One descriptor per region ``(ptr, nbytes)``; each region must lie inside one physical
    allocation (vLLM's single-chunk segments), or nothing is exported."""
    out: list[ExportedRegion] = []
    try:
        for ptr, nbytes in regions:
            h = driver.retain(ptr)
            try:
                base, size = driver.mapped_range(ptr)
                offset = ptr - base
                if offset < 0 or offset + nbytes > size:
                    raise VmmExportError(
                        f"kvpush: the KV region at {ptr:#x} ({nbytes} bytes) spans more than one physical "
                        f"allocation ({size} bytes from {base:#x}): vLLM did not back it by one chunk")
                out.append(ExportedRegion(driver.export_fd(h), size, offset))
            finally:
                driver.release(h)
    except BaseException:
        for r in out:
            os.close(r.fd)
        raise
    return out
