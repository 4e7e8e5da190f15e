"""The sweep's load points: QPS x input length x iteration, each with a seed of its own.

Why a seed per point (not per run): every mode must see the same prompts at a point, and
adding a point to the grid must not change the others' prompts.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

MODEL_NAME = "tiny"  # the served model name of every engine the sweep starts


@dataclass(frozen=True)
class Point:
    """One load point; its seed depends on the point only, so every mode sees the same prompts."""

    qps: float
    input_len: int
    output_len: int
    iteration: int

    def name(self, mode: str) -> str:
        return f"{mode}_qps{fmt_qps(self.qps)}_in{self.input_len}_out{self.output_len}_iter{self.iteration}"

    def seed(self, base: int) -> int:
        key = f"{fmt_qps(self.qps)}|{self.input_len}|{self.output_len}|{self.iteration}".encode()
        return (base + zlib.crc32(key)) % (2**31 - 1)


def fmt_qps(qps: float) -> str:
    return str(int(qps)) if float(qps).is_integer() else f"{qps:g}"


def build_points(pairs: list[tuple[float, int]], output_len: int, iterations: int) -> list[Point]:
    return [Point(q, i, output_len, it) for it in range(iterations) for q, i in pairs]
