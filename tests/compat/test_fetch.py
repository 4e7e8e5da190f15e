"""kvpush_dev.vllm_releases: a release's Python tree fetched once, whole or not at all,
and a release that cannot be had is an error (the conformance suite fails on it, never skips).
A stand-in for pip writes the wheel; nothing here reaches the network."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvpush_dev import vllm_releases as vr

FAKE_PIP = r'''
import sys, zipfile, pathlib
args = sys.argv[1:]
dest = pathlib.Path(args[args.index("-d") + 1]); spec = args[-1]; version = spec.split("==")[1]
with open(dest.parent / "calls", "a") as f:
    f.write(spec + "\n")
mode = (dest.parent / "mode").read_text() if (dest.parent / "mode").exists() else "ok"
if mode == "fail":
    print("ERROR: No matching distribution found for " + spec, file=sys.stderr); sys.exit(1)
w = dest / f"vllm-{version}-cp38-abi3-manylinux1_x86_64.whl"
if mode == "truncated":
    w.write_bytes(b"PK\x03\x04 not a whole zip"); sys.exit(0)
with zipfile.ZipFile(w, "w") as z:
    z.writestr("vllm/__init__.py", f"__version__ = {version!r}\n")
    z.writestr("vllm/v1/core/sched/scheduler.py", "class Scheduler: pass\n")
    z.writestr("vllm/_C.abi3.so", b"\x7fELF")
    z.writestr("vllm/libs/libcuda.so.12", b"\x7fELF")
    z.writestr(f"vllm-{version}.dist-info/METADATA", f"Name: vllm\nVersion: {version}\n")
'''


@pytest.fixture
def pip(tmp_path: Path) -> list[str]:
    script = tmp_path / "fake_pip.py"
    script.write_text(FAKE_PIP)
    return [sys.executable, str(script)]


def calls(cache: Path) -> list[str]:
    f = cache / "calls"
    return f.read_text().split() if f.exists() else []


def test_a_release_is_fetched_once_without_its_compiled_files(tmp_path, pip, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("KVPUSH_VLLM_CACHE", str(cache))
    tree = vr.ensure("0.99.0", pip=pip)
    assert tree == cache / "vllm-0.99.0" and (tree / "vllm" / "__init__.py").is_file()
    assert (tree / "vllm-0.99.0.dist-info" / "METADATA").is_file()  # version lookups find this release
    assert not list(tree.rglob("*.so")) and not list(tree.rglob("*.so.*"))
    assert not list((cache / "wheels").glob("*.whl"))  # unpacked: the wheel is not kept
    assert vr.ensure("0.99.0", pip=pip) == tree and calls(cache) == ["vllm==0.99.0"]  # idempotent


def test_a_release_that_cannot_be_had_is_an_error(tmp_path, pip):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "mode").write_text("fail")
    with pytest.raises(vr.FetchError, match="No matching distribution"):
        vr.ensure("0.98.0", cache=cache, pip=pip)
    assert not (cache / "vllm-0.98.0").exists()


def test_a_truncated_wheel_is_an_error_and_fetched_again_next_time(tmp_path, pip):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "mode").write_text("truncated")
    with pytest.raises(vr.FetchError, match="not a whole wheel"):
        vr.ensure("0.97.0", cache=cache, pip=pip)
    assert not list((cache / "wheels").glob("*.whl")) and not (cache / "vllm-0.97.0").exists()
    (cache / "mode").write_text("ok")
    assert (vr.ensure("0.97.0", cache=cache, pip=pip) / "vllm" / "__init__.py").is_file()


def test_an_unwritable_cache_names_the_setting(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(vr.FetchError, match="KVPUSH_VLLM_CACHE"):
        vr.ensure("0.96.0", cache=blocker / "sub")


def test_the_python_only_filter():
    keep = ["vllm/__init__.py", "vllm/x.json", "vllm-0.34.0.dist-info/RECORD", "vllm/model.pyi"]
    drop = ["vllm/_C.abi3.so", "vllm/libs/libnccl.so.2", "vllm/k.cubin"]
    assert all(vr._python_only(n) for n in keep) and not any(vr._python_only(n) for n in drop)
