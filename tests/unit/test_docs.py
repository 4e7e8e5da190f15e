"""The docs as a product: every config block parses, the quick start's commands run, and the
docs are self-contained (README.md and docs/**.md only point inside the repository).

A fenced block that claims a language is checked in it: ```json with json (and, when it is a
KVPushConnector transfer config, with the connector's own parser), ```toml with tomllib (and,
when it is a kvpushd or router file, with that program's loader: unknown keys and bad values
fail), ```bash / ```sh with ``bash -n``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
FENCE = re.compile(r"^([ \t]*)```(\w+)[^\n]*\n(.*?)^[ \t]*```\s*$", re.M | re.S)  # indented: in a list
README_MAX_LINES = 250
# Pages other helpers of the same change write (install, configuration, metrics, security):
# linked before they land. Empty this once they are all in the tree.


def blocks(lang: set[str]) -> list[tuple[str, int, str]]:
    out = []
    for path in DOCS:
        text = path.read_text()
        for m in FENCE.finditer(text):
            if m.group(2).lower() in lang:
                line = text[: m.start()].count("\n") + 1
                out.append((f"{path.relative_to(ROOT)}:{line}", line, textwrap.dedent(m.group(3))))
    return out


def _ids(items: list[tuple[str, int, str]]) -> list[str]:
    return [i[0] for i in items]


JSON = blocks({"json"})
TOML = blocks({"toml"})
SHELL = blocks({"bash", "sh", "shell"})


def test_there_is_something_to_check() -> None:
    assert JSON and TOML and SHELL, "no fenced config blocks found: the fence pattern is broken"


@pytest.mark.parametrize(("where", "line", "text"), JSON, ids=_ids(JSON))
def test_json_blocks_parse(where: str, line: int, text: str) -> None:
    data = json.loads(text)
    if isinstance(data, dict) and data.get("kv_connector") == "KVPushConnector":
        from kvpush.engine_plugin.config import PluginConfig

        PluginConfig.from_extra(data.get("kv_connector_extra_config"))


def _connector_configs(text: str) -> list[dict]:
    """The JSON given to ``--kv-transfer-config '...'`` in a shell block."""
    return [json.loads(m.group(1)) for m in re.finditer(r"--kv-transfer-config\s+(?:\\\s*)?'(\{.*?\})'", text, re.S)]


@pytest.mark.parametrize(("where", "line", "text"), TOML, ids=_ids(TOML))
def test_toml_blocks_parse_and_load(where: str, line: int, text: str, tmp_path: Path) -> None:
    data = tomllib.loads(text)
    path = tmp_path / "conf.toml"
    path.write_text(text)
    if "prefill" in data or "decode" in data or "listen" in data:
        from kvpush.router.router_config import load

        load(str(path))
        return
    from kvpush.daemon.config import TOP_KEYS, load_config

    if set(data) & set(TOP_KEYS):  # a kvpushd file (or a part of one): unknown keys fail
        load_config(str(path), {})


@pytest.mark.parametrize(("where", "line", "text"), SHELL, ids=_ids(SHELL))
def test_shell_blocks_are_valid_bash_and_their_connector_configs_parse(where: str, line: int, text: str) -> None:
    r = subprocess.run(["bash", "-n"], input=text, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, f"{where}: {r.stderr}"
    from kvpush.engine_plugin.config import PluginConfig

    for cfg in _connector_configs(text):
        assert cfg["kv_connector"] == "KVPushConnector"
        PluginConfig.from_extra(cfg.get("kv_connector_extra_config"))


def test_the_readme_is_short() -> None:
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines (at most {README_MAX_LINES}: the rest goes in docs/)"


def _quick_start_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Quick start"):]
    section = section[: section.index("\n## ", 1)]
    cmds = set()
    for m in FENCE.finditer(section):
        for ln in m.group(3).splitlines():
            word = ln.split("#", 1)[0].split()
            if word:
                cmds.add(word[0])
    # The console scripts the README names anywhere.
    cmds |= {c for c in ("kvpushd", "kvpushctl", "kvpush-router") if re.search(rf"`?\b{c}\b", text)}
    return sorted(cmds)


@pytest.mark.parametrize("cmd", _quick_start_commands())
def test_quick_start_commands_answer_help(cmd: str) -> None:
    if cmd.startswith("scripts/"):
        argv = ["bash", str(ROOT / cmd)]
    else:
        exe = Path(sys.executable).parent / cmd
        argv = [str(exe) if exe.exists() else shutil.which(cmd) or cmd]
    r = subprocess.run([*argv, "--help"], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "KVPUSH_VENV": str(Path(sys.executable).parent.parent)})
    assert r.returncode == 0 and "usage" in (r.stdout + r.stderr).lower(), (cmd, r.stdout[-500:], r.stderr[-500:])


OUTSIDE = re.compile(r"\.\./shared|/work/|DESIGN\.md|GOALS\.md|NOTES-vllm-cpu")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


@pytest.mark.parametrize("path", DOCS, ids=[str(p.relative_to(ROOT)) for p in DOCS])
def test_docs_are_self_contained(path: Path) -> None:
    text = path.read_text()
    bad = sorted({m.group(0) for m in OUTSIDE.finditer(text)})
    assert not bad, f"{path.relative_to(ROOT)} points outside the repository: {bad}"
    for m in LINK.finditer(text):
        target = m.group(1)
        if re.match(r"^[a-z]+://", target):
            continue
        resolved = (path.parent / target).resolve()
        assert resolved.is_relative_to(ROOT), f"{path.relative_to(ROOT)}: link {target} leaves the repository"
        assert resolved.exists(), f"{path.relative_to(ROOT)}: link {target} points nowhere"


PRODUCT_FOLDERS = ("proto", "common", "daemon", "engine_plugin", "router")


def _layout_rows() -> dict[str, set[str]]:
    """docs/design.md's "Code layout" table: folder -> the modules its row lists."""
    text = (ROOT / "docs" / "design.md").read_text()
    section = text[text.index("## Code layout"):]
    section = section[: section.index("\n## ", 1)] if "\n## " in section[1:] else section
    rows: dict[str, set[str]] = {}
    for line in section.splitlines():
        m = re.match(r"^\| `([\w/]+/)` \| ([^|]*) \|", line)
        if m:
            rows[m.group(1)] = set(re.findall(r"`(\w+)`", m.group(2)))
    return rows


def _tree() -> dict[str, set[str]]:
    """Every product folder that is a package -> its modules and subpackages' own rows aside."""
    out: dict[str, set[str]] = {}
    for top in PRODUCT_FOLDERS:
        for init in sorted((ROOT / top).rglob("__init__.py")):
            folder = init.parent
            mods = {p.stem for p in folder.glob("*.py") if p.stem != "__init__"}
            out[f"{folder.relative_to(ROOT)}/"] = mods
    return out


def test_the_design_docs_layout_table_is_the_tree() -> None:
    """A module added, moved or removed without its row (or a row naming a module that is
    not there) fails here: the layout a newcomer reads is the code's."""
    assert _layout_rows() == _tree()
