"""Where a model preset's P/D answers part from colocated: wrong KV, or the decode side's numerics.

Why: a bf16 MLA model (the ``mla`` preset) decodes some prompts differently through kvpush
than colocated. Two causes look alike from the answers alone: KV that arrives wrong, or the
decode engine recomputing the last prompt token (vLLM always does, for every connector) on
another kernel path than the colocated prefill computed it with. This probe separates them:

1. **bytes**: the first request on fresh engines (their blocks are 1..k on both sides: vLLM's
   free queue hands them out in order, block 0 is the null block) is a token-id prompt; the
   latent rows P wrote are then read from both engines' shared KV memory and compared byte
   for byte: rows [0, n-1) are what kvpush moved, row n-1 is what D computed itself.
2. **answers**: the demo's prompts, alone (concurrency 1) and batched (concurrency 8), on a
   colocated engine, through kvpush, and through vLLM's own NixlConnector (pull) on the same
   split, each compared with colocated alone.

    python -m kvpush_dev.mla_probe --preset mla --workdir /tmp/probe [--modes colocated,kvpush,pull]

Run it under ``flock /tmp/kvpush-engines.lock`` (it starts real engines, one core each).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from kvpush_dev import tiny_model
from kvpush_dev import vllm_env as ve
from kvpush_dev.demo_report import prompts
from kvpush_dev.pd_stack import PDStack, prompt_tokens_by_source
from kvpush_dev.procs import free_port
from kvpush_dev.sse import run_prompts

LATENT = 576
_ATTACHED = re.compile(r"KV cache \((\d+) bytes, (\d+) layers, (\d+) blocks x (\d+) tokens\)")


def shm_region(pgid: int, nbytes: int) -> tuple[Path, int]:
    """The /dev/shm file holding the ``nbytes`` KV storage a process of group ``pgid`` maps,
    and the storage's offset in it (torch's refcount header comes first)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.getpgid(int(pid)) != pgid:
                continue
            maps = Path(f"/proc/{pid}/maps").read_text()
        except (OSError, ProcessLookupError):
            continue
        for line in maps.splitlines():
            parts = line.split()
            if len(parts) >= 6 and parts[5].startswith("/dev/shm/torch_"):
                path = Path(parts[5])
                try:
                    header = path.stat().st_size - nbytes
                except OSError:
                    continue
                if 4 <= header <= 1 << 16:
                    return path, header
    raise RuntimeError(f"no /dev/shm KV region of {nbytes} bytes mapped by process group {pgid}")


def latent_rows(region: tuple[Path, int], layers: int, blocks: int, bs: int, n: int) -> np.ndarray:
    """[layers, n, LATENT * 2] bytes: tokens 0..n-1 in blocks 1, 2, ... (layer-major cache)."""
    per_layer = blocks * bs * LATENT * 2
    mm = np.memmap(region[0], dtype=np.uint8, mode="r", offset=region[1], shape=(layers * per_layer,))
    out = np.empty((layers, n, LATENT * 2), dtype=np.uint8)
    for layer in range(layers):
        rows = mm[layer * per_layer:(layer + 1) * per_layer].reshape(blocks * bs, LATENT * 2)
        out[layer] = rows[bs:bs + n]  # block 1 onwards
    return out


def attached(log: Path) -> tuple[int, int, int, int]:
    """(region bytes, layers, blocks, block size) from the plugin's attach line."""
    m = _ATTACHED.search(log.read_text(errors="replace"))
    if not m:
        raise RuntimeError(f"{log}: no kvpush attach line")
    nbytes, layers, blocks, bs = map(int, m.groups())
    return nbytes, layers, blocks, bs


def compare_bytes(p_rows: np.ndarray, d_rows: np.ndarray) -> dict[str, Any]:
    """Moved rows (all but the last token) and the recomputed last row, per layer."""
    n = p_rows.shape[1]
    moved_equal = bool(np.array_equal(p_rows[:, :n - 1], d_rows[:, :n - 1]))
    nonzero = bool(p_rows[:, :n - 1].any())
    last = [bool(np.array_equal(p_rows[layer, n - 1], d_rows[layer, n - 1])) for layer in range(p_rows.shape[0])]
    return {"tokens": n, "moved_rows_equal": moved_equal, "moved_rows_nonzero": nonzero,
            "last_row_equal_per_layer": last}


def token_prompt(n: int) -> list[int]:
    return tiny_model.prompt_ids(n, seed=41)


def first_request(url: str, n: int) -> str:
    out = ve.post_json(f"{url}/v1/completions", {"model": "tiny", "prompt": token_prompt(n), "max_tokens": 8,
                                                 "temperature": 0.0}, timeout=300)
    return str(out["choices"][0]["text"])


def answers(url: str, ps: list[str], max_tokens: int) -> dict[str, list[str]]:
    out = {}
    for c in (1, 8):
        got = asyncio.run(run_prompts(f"{url}/v1/completions", ps, max_tokens, c))
        out[f"c{c}"] = [g.get("text", "ERROR " + str(g.get("error"))) for g in got]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="mla", choices=tuple(tiny_model.FAMILIES))
    ap.add_argument("--workdir", required=True, type=Path)
    ap.add_argument("--modes", default="colocated,kvpush,pull")
    ap.add_argument("--tokens", type=int, default=1000, help="the byte-compared first prompt's length")
    ap.add_argument("--max-tokens", type=int, default=24)
    args = ap.parse_args(argv)
    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    model = ve.ensure_tiny_model(ve.ROOT / ".models" / args.preset, preset=args.preset)
    eargs = list(tiny_model.engine_args(args.preset))
    ps = prompts(0)
    texts: dict[str, dict[str, list[str]]] = {}
    first: dict[str, str] = {}
    for mode in args.modes.split(","):
        print(f"== {mode}", flush=True)
        if mode == "colocated":
            port = free_port()
            proc = ve.start_engine(model, port, work / "colocated.log", cpu_bind="0", extra_args=eargs)
            try:
                url = f"http://127.0.0.1:{port}"
                ve.wait_healthy(f"{url}/health", 600, proc)
                first[mode] = first_request(url, args.tokens)
                texts[mode] = answers(url, ps, args.max_tokens)
            finally:
                ve.stop_group(proc, grace=10)
        elif mode == "kvpush":
            stack = PDStack(model, work / "kvpush", engine_args=eargs)
            stack.start()
            try:
                first[mode] = first_request(stack.router_url, args.tokens)
                nbytes, layers, blocks, bs = attached(stack.work / "prefill.log")
                d_bytes, _, d_blocks, d_bs = attached(stack.work / "decode.log")
                print(f"P: {blocks} blocks x {bs}, D: {d_blocks} blocks x {d_bs}", flush=True)
                p_rows = latent_rows(shm_region(stack.procs["prefill"].pid, nbytes), layers, blocks, bs, args.tokens)
                d_rows = latent_rows(shm_region(stack.procs["decode"].pid, d_bytes), layers, d_blocks, d_bs,
                                     args.tokens)
                print("kvpush bytes:", compare_bytes(p_rows, d_rows), flush=True)
                print("decode prompt tokens by source:", prompt_tokens_by_source(stack.d_url), flush=True)
                texts[mode] = answers(stack.router_url, ps, args.max_tokens)
            finally:
                stack.stop()
        elif mode == "pull":
            from kvpush_dev.sweep.launchers import start_nixl

            logs = work / "pull"
            logs.mkdir(exist_ok=True)
            ms = start_nixl("pull", model, logs, 600, 300, engine_args=tuple(eargs))
            try:
                first[mode] = first_request(ms.front_url, args.tokens)
                texts[mode] = answers(ms.front_url, ps, args.max_tokens)
            finally:
                ms.stop()
        else:
            raise SystemExit(f"unknown mode {mode}")
    ref = texts.get("colocated", {}).get("c1")
    print(f"\nfirst request ({args.tokens} token ids):", {m: t == first.get("colocated") for m, t in first.items()})
    print(f"{'#':>3} {'words':>6} " + " ".join(f"{m + '/' + c:>14}" for m in texts for c in ("c1", "c8")))
    for i, p in enumerate(ps):
        cells = []
        for m in texts:
            for c in ("c1", "c8"):
                cells.append(f"{('=' if ref and texts[m][c][i] == ref[i] else 'DIFF'):>14}")
        print(f"{i:>3} {len(p.split()):>6} " + " ".join(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
