"""The daemon's modules in layers: no import cycle, and no import running back up a layer
(issue 11.3, issue 17.4).

The graph is read from the source with ``ast``, not from ``sys.modules``, and every import
counts: one at the top, one inside a function (it runs whenever the function does) and one under
``if TYPE_CHECKING:`` (it never runs, but a reader needs the other module to read this one: a
cycle hidden by a lazy import on one side and a TYPE_CHECKING import on the other is still a
cycle; the fix is to move the shared piece down a layer).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

import qwen4090

# The package the tests import: the source tree's, or the installed one (autopkgtest runs
# these tests against /usr/lib/python3/dist-packages with daemon/ removed).
PACKAGE = Path(qwen4090.__file__).resolve().parent

# The layers, bottom to top: each is a folder of the package, and a module's layer is the folder it
# is in.  A module imports from its own layer and the layers below it, never from one above; a
# module outside every layer's folder fails the test (a new module goes into the folder of its
# layer).  The package's __init__ (only the version) and __main__ stay at its top.  Each folder's
# __init__ says in one line what the layer is.
LAYERS: tuple[str, ...] = (
    # the bottom layer: states, events, what vLLM says and does, logs, small machine parts
    "base",
    # every setting's default and its validation; the keys whose default follows others
    "settings",
    # what the parts answer, as values, and the pure decisions on it: policy, the judges
    "decide",
    # what asks vLLM and the GPU, and returns a result
    "probes",
    # one vLLM process and what runs beside it, the front on the client port among them
    "engine",
    # what vLLM is launched with, and where: the plan, the checks, the GPU part
    "launching",
    # the contracts of the parts the supervisor drives, and what it tells (status line, systemd)
    "parts",
    # the engines as rows of one table, and the owners of their start, restart and takeover
    "running",
    # the daemon's state machine: the only code that changes the service's state
    "supervision",
    # what the composition root wires around the supervisor: signals, status endpoint
    "surfaces",
    # what a user runs: the composition root (cli) and the commands
    "commandline",
)


def module_names(package: Path) -> dict[str, Path]:
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def layer_folders(package: Path, layers: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """Each layer's modules, read from its folder (names relative to the package; the folder's
    own ``__init__`` is the layer's name).  ``__main__`` stays at the package's top and runs the
    commands: it counts in the top layer.  A module outside every folder is in none."""
    found: dict[str, list[str]] = {layer: [] for layer in layers}
    for name in module_names(package):
        short = name.partition(".")[2]
        if short.split(".")[0] in found:
            found[short.split(".")[0]].append(short)
    empty = [layer for layer, names in found.items() if not names]
    assert not empty, f"layers without a folder: {empty} (each needs {package}/LAYER/__init__.py)"
    if f"{package.name}.__main__" in module_names(package):
        found[layers[-1]].append("__main__")
    return {layer: tuple(names) for layer, names in found.items()}


def import_graph(package: Path) -> dict[str, set[str]]:
    """module -> the package's modules it imports, by any import anywhere in the module (the
    top package itself is left out: every import of a submodule runs its ``__init__``, which
    only holds the version)."""
    modules = module_names(package)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = here.split(".")[:len(here.split(".")) - node.level + 1]
                    base = ".".join([*up, *([node.module] if node.module else [])])
                deps.add(base)
                deps.update(f"{base}.{a.name}" for a in node.names)  # `from pkg import module`
        graph[name] = {d for d in deps if d in modules and d not in (name, package.name)}
    return graph


def cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The cycles a depth-first search meets, each as a path that ends where it starts (one
    per set of modules: a cycle inside one already found is not listed again)."""
    found: list[list[str]] = []
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            cycle = [*path[path.index(node):], node]
            if not any(set(cycle) <= set(c) for c in found):
                found.append(cycle)
            return
        if node in done:
            return
        for dep in sorted(graph[node]):
            visit(dep, [*path, node])
        done.add(node)

    for node in sorted(graph):
        visit(node, [])
    return found


NO_LAYER = "is in no layer: move it into the folder of one (LAYERS)"


def layer_breaches(graph: Mapping[str, set[str]], package: str,
                   layers: Mapping[str, Sequence[str]]) -> list[str]:
    """One sentence per module of the graph in no layer, and per import that runs from a
    lower layer up to a higher one (naming both modules and both layers)."""
    rank: dict[str, tuple[int, str]] = {}
    for i, (layer, names) in enumerate(layers.items()):
        for short in names:
            assert f"{package}.{short}" not in rank, f"{short} is in two layers"
            rank[f"{package}.{short}"] = (i, layer)
    out = [f"{m} {NO_LAYER}"
           for m in sorted(graph) if m != package and m not in rank]
    for importer in sorted(graph):
        for imported in sorted(graph[importer]):
            if importer in rank and imported in rank and rank[imported][0] > rank[importer][0]:
                out.append(f"{importer} ({rank[importer][1]}) imports {imported} "
                           f"({rank[imported][1]}), a layer above it")
    return out


def test_no_import_cycle_among_our_modules() -> None:
    graph = import_graph(PACKAGE)
    # it read the package
    assert "qwen4090.commandline.cli" in graph and "qwen4090.probes.http" in graph
    assert cycles(graph) == [], "import cycles: " + "; ".join(
        " -> ".join(c) for c in cycles(graph))


def test_every_module_has_a_layer_and_imports_only_downwards() -> None:
    graph = import_graph(PACKAGE)
    assert "qwen4090.settings.derived" in graph["qwen4090.settings.config"]  # it read the package
    found = layer_breaches(graph, PACKAGE.name, layer_folders(PACKAGE, LAYERS))
    assert found == [], "layer breaches:\n" + "\n".join(found)


def test_the_graph_sees_every_kind_of_import(tmp_path: Path) -> None:
    """A cycle through each import form is found, lazy and TYPE_CHECKING imports included."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text("def f():\n    import pkg.c\n")
    (pkg / "c.py").write_text("from .sub.d import x\n")
    (pkg / "sub" / "d.py").write_text("from .. import a\nx = 1\n")
    (pkg / "e.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                              "    from pkg import f\n")
    (pkg / "f.py").write_text("from pkg.e import TYPE_CHECKING\n")
    graph = import_graph(pkg)
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.b"] == {"pkg.c"}
    assert graph["pkg.c"] == {"pkg.sub.d"} and graph["pkg.sub.d"] == {"pkg.a"}
    assert graph["pkg.e"] == {"pkg.f"} and graph["pkg.f"] == {"pkg.e"}
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.c", "pkg.sub.d", "pkg.a"],
                             ["pkg.e", "pkg.f", "pkg.e"]]


def test_the_checker_finds_the_breaches_we_had(tmp_path: Path) -> None:
    """The shapes main had before issue 17.4, in a small package: config <-> derived (a lazy
    import one way, a TYPE_CHECKING one back), preflight <-> provision (the same, the launch
    layer reaching up to the commands), launch -> provision (lazy, up), and a new module
    nobody gave a layer."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("__version__ = '0'\n")
    (pkg / "config.py").write_text("def from_dict():\n    from pkg import derived\n")
    (pkg / "derived.py").write_text("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
                                    "    from pkg.config import Config\n")
    (pkg / "preflight.py").write_text("from pkg.config import x\n\n\ndef check():\n"
                                      "    from pkg import provision\n")
    (pkg / "launch.py").write_text("def runtime_of():\n    from pkg import provision\n")
    (pkg / "provision.py").write_text("from __future__ import annotations\n\nimport typing\n\n"
                                      "if typing.TYPE_CHECKING:\n"
                                      "    from pkg.preflight import PreflightResult\n")
    (pkg / "newcomer.py").write_text("from pkg import __version__\n")
    layers = {"base": ("derived",), "config": ("config",), "launch": ("preflight", "launch"),
              "commands": ("provision",)}
    graph = import_graph(pkg)
    assert cycles(graph) == [["pkg.config", "pkg.derived", "pkg.config"],
                             ["pkg.provision", "pkg.preflight", "pkg.provision"]]
    assert layer_breaches(graph, "pkg", layers) == [
        f"pkg.newcomer {NO_LAYER}",
        "pkg.derived (base) imports pkg.config (config), a layer above it",
        "pkg.launch (launch) imports pkg.provision (commands), a layer above it",
        "pkg.preflight (launch) imports pkg.provision (commands), a layer above it",
    ]
    # and the same package, each shared piece moved down a layer, passes
    (pkg / "derived.py").write_text("def values():\n    return {}\n")
    (pkg / "config.py").write_text("from pkg import derived\n")
    (pkg / "runtime.py").write_text("def version_warning():\n    return None\n")
    (pkg / "preflight.py").write_text("from pkg.config import x\nfrom pkg.runtime import "
                                      "version_warning\n")
    (pkg / "launch.py").write_text("from pkg import runtime\n")
    (pkg / "provision.py").write_text("from pkg.runtime import version_warning\n")
    (pkg / "newcomer.py").unlink()
    graph = import_graph(pkg)
    assert cycles(graph) == []
    assert layer_breaches(graph, "pkg", {**layers, "launch": ("preflight", "launch", "runtime")
                                         }) == []


def test_the_layers_are_the_folders(tmp_path: Path) -> None:
    """A module's layer is its folder: one at the package's top (beside __init__ and __main__)
    or in a folder that is no layer has none, and an import from a lower folder up is a
    breach."""
    pkg = tmp_path / "pkg"
    for folder in ("low", "high", "stray"):
        (pkg / folder).mkdir(parents=True)
        (pkg / folder / "__init__.py").write_text('"""A layer."""\n')
    (pkg / "__init__.py").write_text("__version__ = '0'\n")
    (pkg / "__main__.py").write_text("from pkg.high import cli\n")
    (pkg / "low" / "a.py").write_text("x = 1\n")
    (pkg / "high" / "cli.py").write_text("from pkg.low import a\n")
    (pkg / "loose.py").write_text("")
    (pkg / "stray" / "b.py").write_text("")
    layers = layer_folders(pkg, ("low", "high"))
    assert layers == {"low": ("low", "low.a"), "high": ("high", "high.cli", "__main__")}
    assert layer_breaches(import_graph(pkg), "pkg", layers) == [
        f"pkg.{m} {NO_LAYER}" for m in ("loose", "stray", "stray.b")]
    (pkg / "low" / "a.py").write_text("from pkg.high import cli\n")
    assert layer_breaches(import_graph(pkg), "pkg", layer_folders(pkg, ("low", "high")))[-1] == \
        "pkg.low.a (low) imports pkg.high.cli (high), a layer above it"


# What the state machine must never load, directly or through a module it imports: it drives
# the machine only through contracts.Parts (issue 29.2).
MACHINE_MODULES = ("aiohttp", "subprocess", "socket", "http.client", "psutil", "pynvml",
                   "asyncio", "structlog")


def test_importing_the_supervisor_loads_no_machine() -> None:
    import subprocess
    import sys

    code = ("import sys; import qwen4090.supervision.supervisor; "
            f"print(','.join(m for m in {MACHINE_MODULES!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, env={"PYTHONPATH": str(PACKAGE.parent), "PATH": ""})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", (f"importing qwen4090.supervision.supervisor loads "
                                      f"{out.stdout.strip()}")


# Issue 29's target is 15 modules of ours for the supervisor; this is what it loads now, each
# a module it or its engines need (the launch's resolver, the warmup and the step store are
# reached through Parts).  Lower it when a cut lands; raising it needs a reason: 20 -> 26 for
# the supervisor's own parts split out of its class (engines, takeover, telling, reloading,
# starter, restarts), which the same issue asks to shrink to 500 lines: owners apart, not
# fewer modules.
SUPERVISOR_MODULES = 26


def supervisor_modules() -> list[str]:
    """The modules of ours that importing qwen4090.supervision.supervisor loads, in a fresh
    interpreter."""
    import subprocess
    import sys

    code = ("import sys; import qwen4090.supervision.supervisor; "
            "print(' '.join(sorted(m for m in sys.modules if m.startswith('qwen4090.'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, env={"PYTHONPATH": str(PACKAGE.parent), "PATH": ""})
    assert out.returncode == 0, out.stderr
    # a layer's own __init__ (a docstring) is no module to count
    return [m for m in out.stdout.split() if m.partition(".")[2] not in LAYERS]


def test_importing_the_supervisor_loads_few_of_our_modules() -> None:
    loaded = supervisor_modules()
    assert "qwen4090.supervision.supervisor" in loaded  # it read what was loaded
    # the resolver: only the Launch value is needed
    assert "qwen4090.launching.launch" not in loaded
    assert len(loaded) <= SUPERVISOR_MODULES, (
        f"importing qwen4090.supervision.supervisor loads {len(loaded)} of our modules (at most "
        f"{SUPERVISOR_MODULES}): {' '.join(m.removeprefix('qwen4090.') for m in loaded)}")


# Issue 29's target: no module writes another class's fields.  In the engines' and the state
# machine's layers, a write goes to ``self``'s own field; a class that needs another to change
# asks it by a method.  The exceptions are a module's own records (plain dataclasses defined in
# the same module, with no behaviour of their own), named here with why.
OWN_RECORDS = {
    "running/standby.py": {"b", "self.build"},  # the Keeper's Build record (standby.Build)
    "running/portguard.py": {"self.wait"},  # the PortGuard's PortWait record
}


def foreign_writes(path: Path, allowed: set[str]) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        else:
            continue
        for target in targets:
            for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                if not isinstance(t, ast.Attribute):
                    continue
                owner = ast.unparse(t.value)
                if owner != "self" and owner not in allowed:
                    out.append(f"{path.name}:{node.lineno}: {ast.unparse(t)}")
    return out


def test_the_engines_and_the_state_machine_write_only_their_own_fields() -> None:
    found = []
    for layer in ("running", "supervision"):
        for path in sorted((PACKAGE / layer).glob("*.py")):
            rel = f"{layer}/{path.name}"
            found += foreign_writes(path, OWN_RECORDS.get(rel, set()))
    assert found == [], "writes into another object's fields: " + "; ".join(found)


def test_a_write_into_another_objects_field_is_found(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text("class A:\n    def f(self, run):\n        self.x = 1\n        run.role = 2\n"
                   "        self.keeper.detail = 3\n")
    assert foreign_writes(src, set()) == ["m.py:4: run.role", "m.py:5: self.keeper.detail"]


# Issue 29's targets for the state machine's class: at most 500 lines and 22 attributes (it was
# 896 lines and 31 attributes before the engines became rows of one table).
SUPERVISOR_CLASS_LINES = 500
SUPERVISOR_ATTRIBUTES = 22


def class_size(path: Path, name: str) -> tuple[int, set[str]]:
    """A class's lines (its first to its last) and the ``self.`` attributes it assigns."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ClassDef) and node.name == name:
            assert node.end_lineno is not None
            attrs = {t.attr for n in ast.walk(node) if isinstance(n, (ast.Assign, ast.AnnAssign))
                     for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                     if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                     and t.value.id == "self"}
            return node.end_lineno - node.lineno + 1, attrs
    raise AssertionError(f"no class {name} in {path}")


def test_the_supervisor_class_stays_small() -> None:
    lines, attrs = class_size(PACKAGE / "supervision" / "supervisor.py", "Supervisor")
    assert lines <= SUPERVISOR_CLASS_LINES, f"Supervisor is {lines} lines"
    assert len(attrs) <= SUPERVISOR_ATTRIBUTES, f"Supervisor has {len(attrs)}: {sorted(attrs)}"
    assert {"state", "engines", "keeper", "takeover", "restarts"} <= attrs  # it read the class


README = Path(__file__).resolve().parents[2] / "README.md"


def test_readmes_layout_lists_every_folder_and_module() -> None:
    """README's Layout is the folder list with each folder's modules (issue 29.7): a module
    added, moved or removed without it fails here (the source tree only: the installed
    package has no README beside it)."""
    if not README.is_file():
        pytest.skip("no README.md beside the package (an installed copy)")
    text = README.read_text()
    start, end = text.index("<!-- layout:"), text.index("<!-- /layout -->")
    block = text[start:end]
    listed = {line.split("`")[1].rstrip("/"): set(re.findall(r"`(\w+\.py)`", line + rest))
              for line, rest in _folder_lines(block)}
    want = {layer: {p.name for p in (PACKAGE / layer).glob("*.py") if p.name != "__init__.py"}
            for layer in LAYERS}
    assert list(listed) == list(LAYERS), "README's Layout: the folders, bottom to top"
    assert listed == want, "README's Layout: each folder's modules"


def _folder_lines(block: str) -> list[tuple[str, str]]:
    """Each '- `folder/` ...' item of the block with the lines that continue it."""
    items: list[tuple[str, str]] = []
    for line in block.splitlines():
        if line.startswith("- `") and "/`" in line.split(" ")[1]:
            items.append((line, ""))
        elif items and line.startswith("  "):
            items[-1] = (items[-1][0], items[-1][1] + line)
    return items
