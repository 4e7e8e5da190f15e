"""The GPU path on a machine with a GPU, in one command (``scripts/gpu_check.sh``).

Steps, each printed as one line, then one verdict line ``gpu_check: PASS`` / ``FAIL ...``:

1. ``cuda``: a CUDA device is visible to torch. None: ``gpu_check: NO GPU ...`` and exit
   :data:`EXIT_NO_GPU` (77, the "skipped" code of automake and CTest) without trying more.
2. ``legacy``: the allocation kvpush exports today (``kv_cache_access``: LEGACY_IPC): a child
   exports a torch (cudaMalloc) tensor by legacy CUDA IPC, this process opens it
   (``daemon.kv_mapping.CudaIpcRegion``), reads the child's bytes and registers it with NIXL
   as VRAM.
3. ``vmm``: the VMM export of docs/gpu-memory.md (built, not switched on): this process
   creates two physical chunks with the POSIX-fd export type in one reserved range
   (``common.cuda_vmm.CudaVmm``: ctypes over libcuda), writes them, exports two regions as
   the engine would (``worker.vmm_export``) and passes the descriptors over a unix socket
   (``proto.fdpass``) to a child, which maps them as the daemon would (``io.vmm_import``),
   compares the bytes, writes its own (read back here), registers the mappings with NIXL as
   VRAM and unmaps (``kvpush_dev.vmm_check``).
4. ``daemon``: two real kvpushd processes and two engine stand-ins in this process whose KV is
   per-layer CUDA allocations in FlashAttention's shape (one region per layer, CUDA IPC); a
   Register and a PrefillDone make the prefill daemon WRITE into the decode engine's GPU
   memory; the decode caches, read back and compared through the backend's views, must equal
   the reference copy byte for byte (equal block sizes, then a block-size mismatch).
5. ``events``: layer-wise streaming's event pool (``engine_plugin.layer_events.CudaEvents``):
   this process records pool events behind a long kernel; a second process, as the daemon
   does, opens their IPC handles (what proto.LayerEvents carries) through
   ``daemon.layer_gate.LayerGate`` and its ``CudaEventPort`` and admits one item per event:
   the pending event's item is held while the fired ones' go through, and goes once the
   kernel ends; re-recorded behind another kernel (the pool's reuse), every item is held
   again until the newer recordings complete; nothing is dropped.
6. ``families``: each model family's KV as vLLM lays it out on CUDA (``kvpush_dev.gpu_families``:
   vLLM's own KV cache config builder and allocator, the views copied onto the GPU): sliding
   window beside full attention (FlashAttention), Mamba2 state (conv + SSM in one padded page),
   gated delta net state (FlashInfer kernel blocks), FlashMLA (576-wide bf16 latent, blocks of
   64); kvpush derives each engine's layout as the GPU engine does (``describe_gpu_kv``), two
   real kvpushd WRITE one request between two such CUDA allocations (CUDA IPC), and the decode
   allocation, read back, must equal a copy written through vLLM's own views byte for byte.
   Needs vLLM to import (any build: the layouts come from its Python code); otherwise skipped,
   saying why.
7. ``vllm``: if vLLM with CUDA imports, a 1P1D pair on this one GPU (two engines sharing its
   memory) through kvpush, whose greedy output must equal a colocated engine's; then the same
   with each of ``--presets`` (default ``swa,mla,mamba``: the family presets of
   ``kvpush_dev.tiny_model``, one line each). Otherwise the step says why it was skipped (the
   verdict does not depend on it).

Exit codes: 0 PASS, 1 FAIL, :data:`EXIT_NO_GPU` no GPU, 2 bad usage.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

EXIT_PASS, EXIT_FAIL, EXIT_USAGE, EXIT_NO_GPU = 0, 1, 2, 77


def say(step: str, ok: bool | None, detail: str) -> None:
    mark = {True: "ok", False: "FAIL", None: "skip"}[ok]
    print(f"gpu_check: {step:8s} {mark:4s} {detail}", flush=True)


def cuda_visible() -> str:
    """"" if a CUDA device is usable, else why not."""
    try:
        import torch
    except Exception as exc:  # torch missing entirely
        return f"torch does not import ({exc})"
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return f"no CUDA device visible (torch {torch.__version__}, CUDA build {torch.version.cuda})"
    return ""


def _legacy_child(conn: Any) -> None:
    import torch

    from kvpush.engine_plugin.worker.export import export_cuda_tensor

    t = torch.arange(1 << 20, dtype=torch.int32, device="cuda:0").view(torch.uint8)
    torch.cuda.synchronize()
    conn.send(export_cuda_tensor(t))
    conn.recv()  # keep the allocation alive until the parent is done


def step_legacy() -> str:
    import numpy as np
    import torch

    from kvpush.daemon.io.kv_mapping import CudaIpcRegion
    from kvpush.daemon.io.transport import NixlTransport

    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=_legacy_child, args=(child_conn,), daemon=True)
    child.start()
    try:
        if not conn.poll(120):
            raise RuntimeError("the exporting child did not answer")
        region = CudaIpcRegion(conn.recv())
        got = region.view(torch.int32)[:8].cpu().numpy()
        if not np.array_equal(got, np.arange(8, dtype=np.int32)):
            raise RuntimeError(f"opened handle reads {got}, expected 0..7")
        t = NixlTransport("gpu-check-legacy")
        t.register(region)
        t.close()
        region.close()
        return (f"torch (cudaMalloc) tensor exported by legacy CUDA IPC (pid {child.pid}) -> opened here, "
                "bytes equal, NIXL VRAM registration ok")
    finally:
        conn.send("done")
        child.join(30)
        if child.is_alive():
            child.kill()


@dataclass(frozen=True)
class _VmmRange:
    """A mapped VMM range as NixlTransport.register takes a region."""

    base: int
    size: int
    device: int
    kind: str = "cuda_vmm_fd"
    mem_type: str = "VRAM"


def _nixl_register(mapped: list[Any], device: int) -> str:
    """The daemon's next step after mapping: register each whole mapping with NIXL as VRAM."""
    from kvpush.daemon.io.transport import NixlTransport

    t = NixlTransport("gpu-check-vmm")
    try:
        for m in mapped:
            t.register(_VmmRange(m.va, m.size, device))
    finally:
        t.close()
    return f"{len(mapped)} mappings registered with NIXL as VRAM"


def _vmm_child(path: str, device: int) -> None:
    """The daemon's side, in its own process (its own address space, as kvpushd)."""
    from kvpush.common.cuda_vmm import CudaVmm
    from kvpush_dev.vmm_check import daemon_side

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(120)
    sock.connect(path)
    try:
        drv = CudaVmm(device)
    except Exception as exc:  # say why to the engine's side, which waits for an answer
        from kvpush.proto.fdpass import send_frame_with_fds

        send_frame_with_fds(sock, json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode(), [])
        while sock.recv(1 << 16):  # until the engine side closes (it reads the error first)
            pass
        return
    try:
        daemon_side(sock, drv, register=_nixl_register)
    finally:
        drv.close()


def step_vmm() -> str:
    from kvpush.common.cuda_vmm import CudaVmm
    from kvpush_dev.vmm_check import engine_side

    with tempfile.TemporaryDirectory(prefix="kvpush-gpu-check-") as tmp:
        path = str(Path(tmp) / "vmm.sock")
        lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        lsock.bind(path)
        lsock.listen(1)
        lsock.settimeout(120)
        child = mp.get_context("spawn").Process(target=_vmm_child, args=(path, 0), daemon=True)
        child.start()
        drv = None
        try:
            drv = CudaVmm(0)
            try:
                sock, _ = lsock.accept()
            except TimeoutError:
                raise RuntimeError(f"the importing child did not connect (exit code {child.exitcode})") from None
            return engine_side(sock, drv) + f" (importer pid {child.pid})"
        finally:
            if drv is not None:
                drv.close()
            lsock.close()  # a child still waiting to connect is refused, and ends
            child.join(30)
            if child.is_alive():
                child.kill()


def _events_child(conn: Any, port: Any = None) -> None:
    """The daemon's side: open the pool's handles through the daemon's own gate and port
    (``daemon.layer_gate.LayerGate`` over ``CudaEventPort``; ``port``: a fake, for the unit
    test of this protocol) and report what it lets through."""
    from kvpush.daemon.io.layer_gate import CudaEventPort, LayerGate

    handles, device = conn.recv()
    gate: LayerGate[int] = LayerGate(max_waiting=64, max_wait_s=120.0, port=port or CudaEventPort())
    try:
        gate.open_pool(handles, device)
    except Exception as exc:  # EventError says why; anything else too, instead of a silent child
        conn.send(f"{type(exc).__name__}: {exc}")
        return
    conn.send("opened")
    while True:
        cmd = conn.recv()
        if cmd == "done":
            gate.reset()
            return
        if cmd == "admit":  # a frame per event of the pool, item = the event's number
            out: list[int] = []
            for e in range(1, gate.pool_size + 1):
                out += gate.admit(e, [e], time.monotonic())
            conn.send((out, gate.waiting))
        else:  # "wait": poll like the daemon's loop until nothing waits, bounded
            got: list[int] = []
            t0 = time.monotonic()
            while gate.waiting and time.monotonic() - t0 < 60:
                got += gate.poll(time.monotonic())
                time.sleep(0.001)
            conn.send((got, gate.waiting, gate.stats.dropped))


def step_events() -> str:
    import torch

    from kvpush.engine_plugin.worker.layer_events import CudaEvents

    pool = CudaEvents(4, 0)
    ann = pool.announce()
    assert ann is not None and len(ann.handles) == 4
    torch.cuda.synchronize()
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=_events_child, args=(child_conn,), daemon=True)
    child.start()

    def ask(cmd: Any) -> Any:
        conn.send(cmd)
        if not conn.poll(120):
            raise RuntimeError(f"the event child did not answer {cmd!r}")
        return conn.recv()

    try:
        conn.send((list(ann.handles), ann.device))
        if not conn.poll(120):
            raise RuntimeError("the event child did not answer")
        opened = conn.recv()
        if opened != "opened":
            raise RuntimeError(f"the daemon's gate could not open the pool in the event child: {opened}")
        spin = int(2e9)  # GPU cycles: about a second, long enough to be seen pending
        torch.cuda._sleep(spin)
        first = pool.record()
        if first != 1:
            raise RuntimeError(f"the first recording named event {first}, expected 1 (1 + index 0)")
        out, waiting = ask("admit")
        if out != [2, 3, 4] or waiting != 1:
            raise RuntimeError(f"behind a running kernel the daemon's gate let {out} through and held "
                               f"{waiting}, expected [2, 3, 4] through and event 1 held")
        got, waiting, dropped = ask("wait")
        if got != [1] or waiting or dropped:
            raise RuntimeError(f"after the kernel the gate let {got} through, held {waiting}, dropped "
                               f"{dropped}; expected event 1's item, nothing held or dropped")
        torch.cuda._sleep(spin)
        named = [pool.record() for _ in range(4)]  # round robin: slots 1, 2, 3, then 0 again
        if named != [2, 3, 4, 1]:
            raise RuntimeError(f"the pool named {named}, expected [2, 3, 4, 1]")
        out, waiting = ask("admit")
        if out or waiting != 4:
            raise RuntimeError(f"re-recorded behind a running kernel, the gate let {out} through "
                               f"(held {waiting}): an event read fired before its newer recording completed")
        got, waiting, dropped = ask("wait")
        if sorted(got) != [1, 2, 3, 4] or waiting or dropped:
            raise RuntimeError(f"after the kernel the gate let {got} through, held {waiting}, dropped {dropped}")
        return ("pool of 4 interprocess events opened by the daemon's LayerGate/CudaEventPort in a second "
                "process: held while pending, through once fired, reuse waits for the newest recording")
    finally:
        conn.send("done")
        child.join(30)
        if child.is_alive():
            child.kill()


def step_daemon(device: str = "cuda") -> str:
    """The daemon WRITE between per-layer caches on ``device`` ("cpu": the same check with shm
    regions, which the test suite runs where there is no GPU)."""
    import torch

    from kvpush import proto
    from kvpush.engine_plugin.worker.layouts import BACKENDS, derive_layout
    from kvpush_dev.daemon_harness import Daemon, Engine, device_config, push
    from kvpush_dev.vllm_layouts import (
        caches_equal,
        clone_caches,
        ignore_tail,
        legacy_caches,
        reference_copy,
    )

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    fa = BACKENDS["FLASH_ATTN@legacy"]
    geom = dict(num_layers=4, num_blocks=64, num_heads=2, head_size=128, dtype="bfloat16")
    lines = []
    with tempfile.TemporaryDirectory(prefix="kvpush-gpu-check-") as tmp:
        p_d, d_d = Daemon(device_config(Path(tmp), 0)), Daemon(device_config(Path(tmp), 1))
        try:
            for case, (sbs, dbs) in (("equal block sizes", (16, 16)), ("block size 16 -> 8", (16, 8))):
                src = {k: v.to(device) for k, v in legacy_caches(fa, block_size=sbs, seed=1, **geom).items()}
                dst = {k: v.to(device) for k, v in legacy_caches(fa, block_size=dbs, fill="zeros", **geom).items()}
                sync()
                s_regions, s_lay = derive_layout(src, fa, head_size=128, num_kv_heads=2)
                d_regions, d_lay = derive_layout(dst, fa, head_size=128, num_kv_heads=2)
                pe = Engine(p_d, s_lay, "prefill", regions=s_regions, engine_id="P")
                de = Engine(d_d, d_lay, "decode", regions=d_regions, engine_id="D")
                try:
                    n = 3 * 16 + 5
                    sb, db = [9, 3, 40, 41], [5, 6, 7, 20, 21, 22, 30]
                    t = f"gpu-check-{time.monotonic_ns()}"
                    want = clone_caches({k: v.cpu() for k, v in dst.items()})  # a copy on CPU too
                    src_cpu = {k: v.cpu() for k, v in src.items()}
                    reference_copy(src_cpu, fa, s_lay, sb, want, fa, d_lay, db[: -(-n // dbs)], n)
                    push(pe, de, proto.Register(t, 0, tuple(db[: -(-n // dbs)]), n, (p_d.peer_endpoint,), 1, 10_000),
                         proto.PrefillDone(t, tuple(sb), n, 10_000), case)
                    sync()
                    after = {k: v.cpu() for k, v in dst.items()}
                    ignore_tail(want, after, fa, d_lay, db[: -(-n // dbs)], n)
                    if not caches_equal(after, fa, want, fa, 128):
                        raise RuntimeError(f"{case}: decode GPU bytes differ from the reference copy")
                    status = p_d.ops("status")
                    lines.append(f"{case}: {len(s_regions)}+{len(d_regions)} {device} regions, "
                                 f"{status['engine']['memory_bytes']} bytes, bytes equal")
                finally:
                    pe.close()
                    de.close()
        finally:
            p_d.stop()
            d_d.stop()
    return "; ".join(lines)


class Skipped(Exception):
    """A step that cannot run here (says why); the verdict does not depend on it."""


def step_families(device: str = "cuda") -> str:
    """Every family of ``kvpush_dev.gpu_families`` moved by two kvpushd between allocations
    on ``device`` ("cpu": shm regions, which the test suite runs where there is no GPU)."""
    try:
        from kvpush_dev.gpu_families import cases, daemon_check

        families = list(cases())
    except ImportError as exc:
        raise Skipped(f"vLLM does not import ({exc}): the layouts come from its allocator") from None
    return "; ".join(daemon_check(f, device) for f in families)


def vllm_cuda_reason() -> str:
    """"" when vLLM with CUDA imports here, else why the 1P1D step is skipped."""
    try:
        import vllm  # noqa: F401
        from vllm.platforms import current_platform
    except Exception as exc:
        return f"vLLM does not import ({type(exc).__name__}: {exc})"
    if not current_platform.is_cuda():
        return f"the installed vLLM is not a CUDA build (platform {type(current_platform).__name__})"
    return ""


def step_vllm(model: str, preset: str = "") -> tuple[bool | None, str]:
    """1P1D on one GPU through kvpush (``demo --gpu``): the tiny model at ``model``, or the
    family ``preset`` (built under .models/PRESET)."""
    why = vllm_cuda_reason()
    if why:
        return None, why
    from kvpush_dev.demo import main as demo_main

    argv = ["--model-preset", preset, "--gpu"] if preset else ["--model-dir", model, "--gpu"]
    rc = demo_main(argv)
    return rc == 0, f"1P1D on one GPU through kvpush (demo {' '.join(argv)}): exit {rc}"


STEPS = {"legacy": step_legacy, "vmm": step_vmm, "daemon": step_daemon, "events": step_events,
         "families": step_families}
DEFAULT_PRESETS = ("swa", "mla", "mamba")


def parse_presets(text: str) -> tuple[str, ...]:
    """``--presets``: the family presets for the 1P1D runs after the tiny model's ("": none)."""
    from kvpush_dev.tiny_model import FAMILIES

    asked = tuple(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))
    unknown = [p for p in asked if p not in FAMILIES]
    if unknown:
        raise argparse.ArgumentTypeError(f"presets are a comma-separated subset of {','.join(FAMILIES)}, "
                                         f"got {text!r}")
    return asked


def parse_steps(text: str) -> tuple[str, ...]:
    """``--steps``: a comma-separated subset of :data:`STEPS`, run in their order."""
    asked = {s.strip() for s in text.split(",") if s.strip()}
    unknown = sorted(asked - set(STEPS))
    if unknown or not asked:
        raise argparse.ArgumentTypeError(f"steps are a comma-separated subset of {','.join(STEPS)}, got {text!r}")
    return tuple(s for s in STEPS if s in asked)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=".models/tiny", help="model for the vLLM 1P1D step")
    ap.add_argument("--skip-vllm", action="store_true", help="do not run the vLLM 1P1D step")
    ap.add_argument("--steps", type=parse_steps, default=tuple(STEPS),
                    help=f"run only these of {','.join(STEPS)} (comma-separated; default all)")
    ap.add_argument("--presets", type=parse_presets, default=DEFAULT_PRESETS,
                    help="family presets the vllm step runs 1P1D after the tiny model (comma-separated; "
                         f"default {','.join(DEFAULT_PRESETS)}; '' for none)")
    try:
        args = ap.parse_args(argv)
    except SystemExit as exc:
        return EXIT_USAGE if exc.code else EXIT_PASS
    why = cuda_visible()
    if why:
        say("cuda", None, why)
        print(f"gpu_check: NO GPU ({why}); nothing was run (exit {EXIT_NO_GPU})", flush=True)
        return EXIT_NO_GPU
    import torch

    say("cuda", True, f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    failed = []
    for name in STEPS:
        if name not in args.steps:
            say(name, None, "not in --steps")
            continue
        try:
            say(name, True, STEPS[name]())
        except Skipped as exc:
            say(name, None, str(exc))
        except Exception as exc:
            failed.append(name)
            say(name, False, f"{type(exc).__name__}: {exc}")
            traceback.print_exc(file=sys.stderr)
    for preset in ("", *args.presets):
        name = f"vllm:{preset}" if preset else "vllm"
        if args.skip_vllm:
            say(name, None, "--skip-vllm")
            continue
        try:
            ok, detail = step_vllm(args.model, preset)
        except Exception as exc:
            ok, detail = False, f"{type(exc).__name__}: {exc}"
        say(name, ok, detail)
        if ok is False:
            failed.append(name)
    if failed:
        print(f"gpu_check: FAIL ({', '.join(failed)})", flush=True)
        return EXIT_FAIL
    print("gpu_check: PASS", flush=True)
    return EXIT_PASS


if __name__ == "__main__":
    raise SystemExit(main())
