"""The OpenAI streaming client the demo and the benchmarks measure with.

Why here: TTFT and TPOT must be taken the same way everywhere (first and last chunk with
text, as a client sees them), and the SSE framing read by one function.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any


async def sse_data(r: Any) -> AsyncIterator[dict[str, Any]]:
    """The JSON objects of an OpenAI streaming response (``data: {...}`` lines), in order;
    the usage-only chunk (no choices) is skipped."""
    async for raw in r.content:
        line = raw.decode().strip()
        if not line.startswith("data:") or line == "data: [DONE]":
            continue
        data = json.loads(line[5:])
        if "error" in data or data.get("choices"):
            yield data


async def stream_one(session: Any, url: str, prompt: str | list[int], max_tokens: int) -> dict[str, Any]:
    """One streaming completion: text, TTFT and TPOT as the client sees them."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "ignore_eos": True}
    t0 = time.perf_counter()
    first = last = None
    chunks: list[str] = []
    async with session.post(url, json=body) as r:
        if r.status != 200:
            return {"error": f"HTTP {r.status}: {(await r.text())[:300]}"}
        async for data in sse_data(r):
            if "error" in data:
                return {"error": str(data["error"])[:300]}
            text = data["choices"][0].get("text", "")
            now = time.perf_counter()
            if text:
                first = first or now
                last = now
                chunks.append(text)
    n = len(chunks)
    return {
        "text": "".join(chunks),
        "ttft_ms": (first - t0) * 1e3 if first else None,
        "tpot_ms": ((last - first) / (n - 1) * 1e3) if first and last and n > 1 else None,
        "chunks": n,
    }


async def run_prompts(url: str, ps: list[str] | list[list[int]], max_tokens: int, concurrency: int) -> list[dict[str, Any]]:
    import aiohttp

    sem = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        async def one(p: str | list[int]) -> dict[str, Any]:
            async with sem:
                return await stream_one(s, url, p, max_tokens)

        return await asyncio.gather(*(one(p) for p in ps))
