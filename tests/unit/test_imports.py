"""No import cycle among the daemon's own modules (issue 11.3).

The graph is read from the source with ``ast``, not from ``sys.modules``: an import inside a
function counts (it runs whenever the function does, so it is as much a dependency as one at the
top), an import under ``if TYPE_CHECKING:`` does not (it never runs; it only names a type).
"""

from __future__ import annotations

import ast
from pathlib import Path

import qwen4090

# The package the tests import: the source tree's, or the installed one (autopkgtest runs
# these tests against /usr/lib/python3/dist-packages with daemon/ removed).
PACKAGE = Path(qwen4090.__file__).resolve().parent


def module_names(package: Path) -> dict[str, Path]:
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _type_checking_only(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or \
        (isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    found: list[ast.Import | ast.ImportFrom] = []
    todo = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and _type_checking_only(node):
            todo.extend(node.orelse)  # the body is for the type checker only
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        todo.extend(ast.iter_child_nodes(node))
    return found


def import_graph(package: Path) -> dict[str, set[str]]:
    """module -> the package's modules it imports (the top package itself is left out: every
    import of a submodule runs its ``__init__``, which only holds the version)."""
    modules = module_names(package)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps: set[str] = set()
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
                continue
            base = node.module or ""
            if node.level:
                up = here.split(".")[:len(here.split(".")) - node.level + 1]
                base = ".".join([*up, *([node.module] if node.module else [])])
            deps.add(base)
            deps.update(f"{base}.{a.name}" for a in node.names)  # `from pkg import module`
        graph[name] = {d for d in deps if d in modules and d not in (name, package.name)}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
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


def test_no_import_cycle_among_our_modules() -> None:
    graph = import_graph(PACKAGE)
    assert "qwen4090.cli" in graph and "qwen4090.probes.http" in graph  # it read the package
    assert cycles(graph) == [], "import cycles: " + "; ".join(
        " -> ".join(c) for c in cycles(graph))


def test_the_graph_sees_every_kind_of_import(tmp_path: Path) -> None:
    """A cycle through each import form is found; a TYPE_CHECKING import is not an edge."""
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
    assert graph["pkg.e"] == set() and graph["pkg.f"] == {"pkg.e"}
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.c", "pkg.sub.d", "pkg.a"]]
