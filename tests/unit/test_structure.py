"""Structure facts of the package, read from the source (ast), not from a running import:

* no import circles among kvpush modules, counting every import statement wherever it
  stands (module level, under ``TYPE_CHECKING``, inside a function): a circle hidden in a
  function is still two modules that each need the other;
* no two modules share a file name while meaning different things (a reader who sees
  ``metrics.py`` in a traceback must know which one); the few allowed duplicates say why.
"""

from __future__ import annotations

import ast
import tomllib
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _modules() -> dict[str, Path]:
    """kvpush module name -> file, from pyproject's package-dir (the one mapping)."""
    dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    out: dict[str, Path] = {}
    dirs = {**dirs, "kvpush_dev": "dev/kvpush_dev"}  # the dev tree: not in the wheel, still one graph
    for pkg, folder in dirs.items():
        for f in sorted((ROOT / folder).rglob("*.py")):
            rel = f.relative_to(ROOT / folder).with_suffix("").parts
            name = ".".join((pkg, *rel))
            out[name.removesuffix(".__init__")] = f
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """Every kvpush module ``name`` imports, at any depth of its code."""
    is_pkg = path.stem == "__init__"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                pkg = name if is_pkg else name.rsplit(".", 1)[0]
                for _ in range(node.level - 1):
                    pkg = pkg.rsplit(".", 1)[0]
                base = f"{pkg}.{base}" if base else pkg
            # `from kvpush.x import y`: y is a module of kvpush.x, or a name in it
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in MODULES:  # `import kvpush.a.b.c` names module kvpush.a.b
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))
    return found


def test_the_cycle_finder_finds_cycles_at_any_depth() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    src = "def f():\n    from kvpush.daemon import counter\n"
    tree = ast.parse(src)
    assert any(isinstance(n, ast.ImportFrom) for n in ast.walk(tree))  # function-level is walked


def test_no_import_circles() -> None:
    graph = {m: _imports(m, p) for m, p in MODULES.items()}
    assert graph["kvpush.daemon.device_daemon"], "the walk found no imports: it is broken"
    assert _cycles(graph) == []


# Basenames several modules may share, and why each duplicate means one thing.
SAME_MEANING = {
    "__init__": "a package's marker",
    "cli": "a component's command line (kvpushd, kvpush-router, the sweep): its package says which",
    "metrics": "a component's own Prometheus registry (daemon, router): its package says which",
    "config": "a role's settings as data (daemon, plugin): its package says which",
    "client": "a client of a daemon's socket: its room says which (ops/: the ops socket, link/: the engine socket)",
    "half": "one half of the vLLM connector: its room (scheduler/, worker/) says which",
    "lifecycle": "a connector half's per-request lifecycle table: its room (scheduler/, worker/) says which",
    "demo": "scripts/demo.py is the thin entry point of kvpush_dev.demo",
    "baseline_proxy": "scripts/baseline_proxy.py is the thin entry point of kvpush_dev.baseline_proxy",
}


def test_no_two_modules_share_a_name_and_mean_different_things() -> None:
    files = [p for p in MODULES.values()] + sorted((ROOT / "scripts").glob("*.py"))
    by_name: dict[str, list[str]] = defaultdict(list)
    for f in files:
        by_name[f.stem].append(str(f.relative_to(ROOT)))
    dup = {n: fs for n, fs in by_name.items() if len(fs) > 1 and n not in SAME_MEANING}
    assert dup == {}, f"rename one of each, or say in SAME_MEANING why they mean the same: {dup}"
    unused = [n for n in SAME_MEANING if len(by_name.get(n, ())) < 2]
    assert unused == [], f"allowed duplicates that no longer exist: {unused}"


PRODUCT = ("proto", "common", "daemon", "engine_plugin", "router")
MAX_MODULE_LINES = 900
MAX_DAEMON_TOP_MODULES = 12


def test_no_product_module_is_over_the_size_a_reader_holds() -> None:
    big = {str(p.relative_to(ROOT)): n for pkg in PRODUCT for p in (ROOT / pkg).rglob("*.py")
           if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert big == {}, f"split these by concern (over {MAX_MODULE_LINES} lines): {big}"


def test_the_daemon_top_level_holds_one_device_daemons_composition() -> None:
    """Everything else lives in a room (core/, io/, trust/, ops/, node/)."""
    top = sorted(p.name for p in (ROOT / "daemon").glob("*.py") if p.name != "__init__.py")
    assert len(top) <= MAX_DAEMON_TOP_MODULES, top
    rooms = sorted(p.name for p in (ROOT / "daemon").iterdir() if (p / "__init__.py").exists())
    assert rooms == ["core", "io", "node", "ops", "trust"]


def test_the_product_never_imports_the_dev_tree() -> None:
    """import-linter checks this too (scripts/run_tests.sh); here it also holds for a bare pytest run."""
    graph = {m: _imports(m, p) for m, p in MODULES.items() if not m.startswith("kvpush_dev")}
    assert {m: sorted(d for d in deps if d.startswith("kvpush_dev")) for m, deps in graph.items()
            if any(d.startswith("kvpush_dev") for d in deps)} == {}
