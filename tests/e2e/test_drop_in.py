"""The installed ``kvpush-router`` as an operator runs it: a config file naming the prefill node
(host + base port + TP), both APIs streaming and not, x-request-id, /metrics, graceful shutdown.

It runs its own router process in front of the session's P/D engines (the stack's router is
left alone), from the console script the package installs.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpush_dev.pd_stack import PDStack, prompt_tokens_by_source
from kvpush_dev.procs import free_port

pytestmark = pytest.mark.e2e


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except (urllib.error.URLError, ConnectionError):
        return 0, ""


@pytest.fixture
def router(pd: PDStack, tmp_path: Path):
    port = free_port()
    conf = tmp_path / "router.toml"
    conf.write_text(f'listen = "127.0.0.1:{port}"\nshutdown_grace_s = 60\n'
                    f'[[prefill]]\nurl = "{pd.p_url}"\nhost = "127.0.0.1"\nbase_port = {pd.base_port}\ntp_size = 1\n'
                    f'[[decode]]\nurl = "{pd.d_url}"\n')
    log = open(tmp_path / "router.log", "w+")  # noqa: SIM115
    proc = subprocess.Popen([str(Path(sys.executable).parent / "kvpush-router"), "--config", str(conf)],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while _get(f"{url}/health")[0] != 200:
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "router.log").read_text()
        time.sleep(0.2)
    try:
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        log.close()


def _metrics(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    code, text = _get(f"{url}/metrics")
    assert code == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_the_installed_router_serves_both_apis_with_request_ids_and_metrics(pd: PDStack, router) -> None:
    url, _ = router

    async def go() -> list[Any]:
        async with aiohttp.ClientSession() as s:
            out = []
            for path, stream in (("/v1/completions", False), ("/v1/completions", True),
                                 ("/v1/chat/completions", False), ("/v1/chat/completions", True)):
                if "chat" in path:
                    b: dict[str, Any] = {"model": "tiny", "messages": [{"role": "user", "content": "hello " * 60}]}
                else:
                    b = {"model": "tiny", "prompt": list(range(10, 310))}
                b.update(max_tokens=6, temperature=0.0, ignore_eos=True, stream=stream)
                async with s.post(f"{url}{path}", json=b, headers={"x-request-id": f"op-{path[-11:]}-{stream}"}) as r:
                    out.append((r.status, r.headers.get("x-request-id"), await r.read()))
            return out

    ext0 = prompt_tokens_by_source(pd.d_url).get("external_kv_transfer", 0)
    got = asyncio.run(go())
    ext1 = prompt_tokens_by_source(pd.d_url).get("external_kv_transfer", 0)
    assert [g[0] for g in got] == [200] * 4, got
    assert [g[1] for g in got] == ["op-completions-False", "op-completions-True",
                                   "op-completions-False", "op-completions-True"]
    assert ext1 - ext0 >= 299 + 2 * 60  # every prompt through kvpush (chat prompts >= 60 tokens)
    body = json.loads(got[0][2])
    assert body["choices"][0]["text"] and b"data: [DONE]" in got[1][2]
    # vLLM-native stats: the plugin's transfers on the engines' own /metrics (vllm:kvpush_*)
    deadline = time.monotonic() + 20
    while True:
        d, p = _metrics(pd.d_url), _metrics(pd.p_url)
        loads = sum(v for (n, _), v in d.items() if n == "vllm:kvpush_loads_total")
        sends = sum(v for (n, _), v in p.items() if n == "vllm:kvpush_sends_total")
        if (loads >= 4 and sends >= 4) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert loads >= 4 and sends >= 4, (loads, sends)
    assert sum(v for (n, _), v in d.items() if n == "vllm:kvpush_load_bytes_sum") > 0
    assert sum(v for (n, _), v in d.items() if n == "vllm:kvpush_load_seconds_count") >= 4
    m = _metrics(url)
    assert m[("kvpush_router_requests_total", (("code", "200"), ("path", "/v1/completions")))] == 2
    assert m[("kvpush_router_requests_total", (("code", "200"), ("path", "/v1/chat/completions")))] == 2
    assert m[("kvpush_router_ttft_seconds_count", (("stream", "true"),))] == 2
    assert m[("kvpush_router_request_seconds_count", (("stream", "false"),))] == 2
    assert m[("kvpush_router_legs_failed_total", (("cause", "status"), ("leg", "prefill")))] == 0
    assert m[("kvpush_router_draining", ())] == 0


def test_sigterm_lets_requests_in_flight_finish_and_refuses_new_ones(pd: PDStack, router) -> None:
    url, proc = router

    async def go() -> tuple[int, bytes, int, bool]:
        async with aiohttp.ClientSession() as s:
            b = {"model": "tiny", "prompt": list(range(20, 220)), "max_tokens": 1500, "temperature": 0.0,
                 "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            async with s.post(f"{url}/v1/completions", json=b) as r:
                first = await r.content.readany()  # generating now
                proc.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.5)
                closed = await asyncio.to_thread(_get, f"{url}/health")
                still_streaming = not r.content.at_eof()
                rest = await r.read()
                return r.status, first + rest, closed[0], still_streaming

    status, data, health_after_term, still_streaming = asyncio.run(go())
    assert still_streaming, "the request ended before the router was told to stop: make it longer"
    assert health_after_term == 0  # no new connection once shutdown began
    assert status == 200 and b"data: [DONE]" in data, data[-300:]
    events = [json.loads(ln[6:]) for ln in data.split(b"\n") if ln.startswith(b"data: {")]
    # Every token, not a cut stream. Counted from the engine's own usage event and the finish
    # reason, not from the number of events: vLLM coalesces tokens into one event when the
    # reader falls behind, so a whole stream can have fewer events than tokens.
    assert events[-1]["usage"]["completion_tokens"] == 1500, events[-1]
    assert [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]] == ["length"]
    assert proc.wait(30) == 0
    assert _get(f"{url}/health")[0] == 0  # the port is closed
