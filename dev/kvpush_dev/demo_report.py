"""What both demos share: the prompts, and the per-request table and verdict against the
colocated run (the 1P1D demo, :mod:`kvpush_dev.demo`, and the lab's 2P2D one,
:mod:`kvpush_dev.labdemo`, which the first launches: here so neither imports the other
back)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

NEAR_TIE = 0.1  # nats between the reference's top two tokens where bf16 rounding may pick either


def prompts(n_extra: int) -> list[str]:
    """Lengths around the block size (128 on CPU) and a few long ones."""
    words = "the quick brown fox jumps over a lazy dog while seven small birds sing".split()
    out = ["hello", "once upon a time"]
    for n in (100, 127, 128, 129, 300, 700, 1000):
        out.append(" ".join(words[i % len(words)] for i in range(n)))
    for i in range(n_extra):
        out.append(" ".join(words[(i * 7 + j) % len(words)] for j in range(40 + 37 * i)))
    return out



def near_tie(got: str, ref: dict[str, Any], eps: float = NEAR_TIE) -> str | None:
    """Why ``got`` may differ from a reference completion choice with ``logprobs`` >= 2: a
    description when it parts from it where its token is the reference's runner-up within
    ``eps`` nats (bf16 rounding of another kernel path can tip such a tie), else None (wrong).

    Why: a bf16 model's decode engine recomputes the last prompt token on its decode kernels
    (vLLM does, for every connector) and rounds differently from one engine's prefill;
    docs/models.md has the measurement. Only the first parting is judged: after it the two
    continue from different tokens."""
    if got == ref["text"]:
        return "equal"
    toks, tops, lps = ref["logprobs"]["tokens"], ref["logprobs"]["top_logprobs"], ref["logprobs"]["token_logprobs"]
    i = 0
    while i < len(toks) and got.startswith("".join(toks[:i + 1])):
        i += 1
    if i >= len(toks) or not tops[i]:
        return None
    rest = got[len("".join(toks[:i])):]
    runner_up = [(t, lp) for t, lp in tops[i].items() if t != toks[i]]
    if not runner_up:
        return None
    tok, lp = max(runner_up, key=lambda x: x[1])
    margin = lps[i] - lp
    if tok and rest.startswith(tok) and margin <= eps:
        return f"parts at token {i}: {toks[i]!r} vs runner-up {tok!r}, {margin:.3f} nats apart"
    return None


def report(ps: list[str], reference: list[dict[str, Any]], pd: list[dict[str, Any]], external: float,
           tie: Callable[[int, str], str | None] | None = None) -> int:
    """The table and the verdict; ``tie`` (bf16 presets): why answer i may differ (a near tie,
    or the same answer as vLLM's own connector on the same split), None where it may not."""
    print()
    print(f"{'#':>3} {'prompt words':>12} {'TTFT ms':>9} {'TPOT ms':>9} {'colocated TTFT':>15}  tokens equal")
    bad = ties = 0
    for i, (p, ref, got) in enumerate(zip(ps, reference, pd, strict=True)):
        if "error" in got or "error" in ref:
            bad += 1
            print(f"{i:>3} {len(p.split()):>12}  ERROR {got.get('error') or ref.get('error')}")
            continue
        same = got["text"] == ref["text"]
        why = None if same or tie is None else tie(i, got["text"])
        ties += why is not None
        bad += not same and why is None

        def ms(v: float | None) -> str:
            return f"{v:9.1f}" if v is not None else "        -"

        print(f"{i:>3} {len(p.split()):>12} {ms(got['ttft_ms'])} {ms(got['tpot_ms'])} {ms(ref['ttft_ms']):>15}  "
              f"{'yes' if same else why if why else 'NO'}")
    print(f"\ndecode engine: {external:.0f} prompt tokens came from kvpush (vllm:prompt_tokens_by_source_total"
          f"{{source=\"external_kv_transfer\"}})")
    if bad:
        print(f"FAILED: {bad} of {len(ps)} requests differ from the colocated run or failed")
        return 1
    print(f"OK: all {len(ps)} requests equal the colocated run"
          + (f" ({ties} as explained in the table, docs/models.md)" if ties else ""))
    return 0
