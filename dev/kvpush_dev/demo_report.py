"""What both demos share: the prompts, and the per-request table and verdict against the
colocated run (the 1P1D demo, :mod:`kvpush_dev.demo`, and the lab's 2P2D one,
:mod:`kvpush_dev.labdemo`, which the first launches: here so neither imports the other
back)."""

from __future__ import annotations

from typing import Any


def prompts(n_extra: int) -> list[str]:
    """Lengths around the block size (128 on CPU) and a few long ones."""
    words = "the quick brown fox jumps over a lazy dog while seven small birds sing".split()
    out = ["hello", "once upon a time"]
    for n in (100, 127, 128, 129, 300, 700, 1000):
        out.append(" ".join(words[i % len(words)] for i in range(n)))
    for i in range(n_extra):
        out.append(" ".join(words[(i * 7 + j) % len(words)] for j in range(40 + 37 * i)))
    return out



def report(ps: list[str], reference: list[dict[str, Any]], pd: list[dict[str, Any]], external: float) -> int:
    print()
    print(f"{'#':>3} {'prompt words':>12} {'TTFT ms':>9} {'TPOT ms':>9} {'colocated TTFT':>15}  tokens equal")
    bad = 0
    for i, (p, ref, got) in enumerate(zip(ps, reference, pd, strict=True)):
        if "error" in got or "error" in ref:
            bad += 1
            print(f"{i:>3} {len(p.split()):>12}  ERROR {got.get('error') or ref.get('error')}")
            continue
        same = got["text"] == ref["text"]
        bad += not same

        def ms(v: float | None) -> str:
            return f"{v:9.1f}" if v is not None else "        -"

        print(f"{i:>3} {len(p.split()):>12} {ms(got['ttft_ms'])} {ms(got['tpot_ms'])} {ms(ref['ttft_ms']):>15}  "
              f"{'yes' if same else 'NO'}")
    print(f"\ndecode engine: {external:.0f} prompt tokens came from kvpush (vllm:prompt_tokens_by_source_total"
          f"{{source=\"external_kv_transfer\"}})")
    if bad:
        print(f"FAILED: {bad} of {len(ps)} requests differ from the colocated run or failed")
        return 1
    print(f"OK: all {len(ps)} requests equal the colocated run")
    return 0
