"""The wheel ships the product only: built from the files git knows, it holds the five role
packages and nothing of the dev tree (harness, benchmarks, sweep, netns lab).

Why a unit test: the dev tree once rode along in every ``pip install kvpush[plugin]``, into
every vLLM environment. Building the wheel takes seconds and needs nothing but setuptools.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("proto", "common", "daemon", "engine_plugin", "router")


@pytest.fixture(scope="module")
def wheel_names(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    src = tmp_path_factory.mktemp("src")
    files = subprocess.run(["git", "-C", str(ROOT), "ls-files", "--cached", "--others", "--exclude-standard"],
                           capture_output=True, text=True, check=True).stdout.split("\n")
    for rel in files:
        if rel and (ROOT / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, src / rel)
    out = tmp_path_factory.mktemp("dist")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                        "--disable-pip-version-check", "-q", "-w", str(out), str(src)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    (whl,) = out.glob("kvpush-*.whl")
    with zipfile.ZipFile(whl) as z:
        return z.namelist()


def test_the_wheel_holds_no_dev_tree(wheel_names: list[str]) -> None:
    dev = [n for n in wheel_names if n.startswith(("kvpush_dev/", "kvpush/testing/", "dev/", "tests/"))
           or "/testing/" in n]
    assert dev == []


def test_the_wheel_holds_every_product_module(wheel_names: list[str]) -> None:
    """Every .py file of the product folders is in the wheel (a subpackage missing from
    pyproject's package list would be left out silently)."""
    want = {f"kvpush/{p.relative_to(ROOT)}" for pkg in PRODUCT for p in (ROOT / pkg).rglob("*.py")
            if "__pycache__" not in p.parts}
    tops = {n.split("/")[1] for n in wheel_names if n.startswith("kvpush/")}
    assert tops == set(PRODUCT)
    assert want - set(wheel_names) == set()
