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
from collections.abc import Mapping, Sequence
from pathlib import Path

import qwen4090

# The package the tests import: the source tree's, or the installed one (autopkgtest runs
# these tests against /usr/lib/python3/dist-packages with daemon/ removed).
PACKAGE = Path(qwen4090.__file__).resolve().parent

# The layers, bottom to top.  A module imports from its own layer and the layers below it,
# never from one above; each module of the package is in exactly one layer (a new module fails
# the test until it is given one).  Names are relative to the package; the package itself
# (its __init__ holds only the version) is in none.
LAYERS: dict[str, tuple[str, ...]] = {
    # nothing of ours below it: what vLLM says and does (vllmfacts), the states and the events
    # about them, the log, and small pieces of the machine (child.py strips notify's variables)
    "base": ("states", "events", "vllmfacts", "logs", "redact", "atomicfile", "oomscore",
             "notify", "preimport_main",  # preimport_main runs in vLLM's interpreter
             "fdlimit",  # the file limit, and "no file descriptor left" is no verdict
             "steering"),  # what the supervisor tells the front
    # every default and its validation; the keys whose default follows other keys
    "config": ("config", "derived"),
    # what the parts answer (probes, preflight, warmup, the port walk, the front): values only
    "results": ("results",),
    # pure decisions on the config's thresholds: backoff, budget, exit classes, hang verdicts,
    # and the judges that own their timers
    "policy": ("policy", "judges", "clientpath"),
    # what asks vLLM and the GPU, and returns a result
    "probes": ("probes.http", "probes.nvml", "nvml_binding"),
    # one vLLM process and what runs beside it (the front: the client port before it)
    "engine": ("child", "warmup", "timeline", "preimport", "readahead", "caches", "front",
               "frontlimits"),
    # what vLLM is launched with, and where: the Launch value (launchvalue: as low as the plan
    # whose GpuMemory and Plan it holds; plan.gpu_memory asks NVML), the plan, what earlier
    # starts taught, the runtime venv, the checks before a launch, the instance (its lock, its
    # child record, its port)
    "launch": ("launchvalue", "reloading", "launch", "plan", "learned", "kvbudget", "steptime",
               "ladder", "runtime", "preflight", "configrisk", "instance"),
    # the typed GPU part: launch, preflight, step-down and the watch, over one door
    "gpu": ("gpu", "xid"),
    # the contracts of the parts the supervisor drives (protocols, do-nothing parts, Parts)
    "contracts": ("contracts", "statusline", "telling"),
    # the engines: one vLLM run and its judges' verdicts, the standby's keeper, the port guard
    "engines": ("run", "engines", "standby", "takeover", "portguard", "starter", "restarts"),
    # the daemon's state machine
    "supervisor": ("supervisor",),
    # what the composition root wires around it: the signals, the status endpoint
    "surfaces": ("signals", "httpapi"),
    # what a user runs: the composition root and the commands
    "commands": ("cli", "__main__", "commands", "plancmd", "statuscmd", "provision", "bench"),
}


def module_names(package: Path) -> dict[str, Path]:
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


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


def layer_breaches(graph: Mapping[str, set[str]], package: str,
                   layers: Mapping[str, Sequence[str]]) -> list[str]:
    """One sentence per module of the graph without a layer, and per import that runs from a
    lower layer up to a higher one (naming both modules and both layers)."""
    rank: dict[str, tuple[int, str]] = {}
    for i, (layer, names) in enumerate(layers.items()):
        for short in names:
            assert f"{package}.{short}" not in rank, f"{short} is in two layers"
            rank[f"{package}.{short}"] = (i, layer)
    out = [f"{m} has no layer: give it one in LAYERS"
           for m in sorted(graph) if m != package and m not in rank]
    for importer in sorted(graph):
        for imported in sorted(graph[importer]):
            if importer in rank and imported in rank and rank[imported][0] > rank[importer][0]:
                out.append(f"{importer} ({rank[importer][1]}) imports {imported} "
                           f"({rank[imported][1]}), a layer above it")
    return out


def test_no_import_cycle_among_our_modules() -> None:
    graph = import_graph(PACKAGE)
    assert "qwen4090.cli" in graph and "qwen4090.probes.http" in graph  # it read the package
    assert cycles(graph) == [], "import cycles: " + "; ".join(
        " -> ".join(c) for c in cycles(graph))


def test_every_module_has_a_layer_and_imports_only_downwards() -> None:
    graph = import_graph(PACKAGE)
    assert "qwen4090.derived" in graph["qwen4090.config"]  # it read the package
    found = layer_breaches(graph, PACKAGE.name, LAYERS)
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
        "pkg.newcomer has no layer: give it one in LAYERS",
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


# What the state machine must never load, directly or through a module it imports: it drives
# the machine only through contracts.Parts (issue 29.2).
MACHINE_MODULES = ("aiohttp", "subprocess", "socket", "http.client", "psutil", "pynvml",
                   "asyncio", "structlog")


def test_importing_the_supervisor_loads_no_machine() -> None:
    import subprocess
    import sys

    code = ("import sys; import qwen4090.supervisor; "
            f"print(','.join(m for m in {MACHINE_MODULES!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, env={"PYTHONPATH": str(PACKAGE.parent), "PATH": ""})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"importing qwen4090.supervisor loads {out.stdout.strip()}"


# Issue 29's target is 15 modules of ours for the supervisor; this is what it loads now, each
# a module it or its engines need (the launch's resolver, the warmup and the step store are
# reached through Parts).  Lower it when a cut lands; raising it needs a reason: 20 -> 26 for
# the supervisor's own parts split out of its class (engines, takeover, telling, reloading,
# starter, restarts), which the same issue asks to shrink to 500 lines: owners apart, not
# fewer modules.
SUPERVISOR_MODULES = 26


def supervisor_modules() -> list[str]:
    """The modules of ours that importing qwen4090.supervisor loads, in a fresh interpreter."""
    import subprocess
    import sys

    code = ("import sys; import qwen4090.supervisor; "
            "print(' '.join(sorted(m for m in sys.modules if m.startswith('qwen4090.'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, env={"PYTHONPATH": str(PACKAGE.parent), "PATH": ""})
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_importing_the_supervisor_loads_few_of_our_modules() -> None:
    loaded = supervisor_modules()
    assert "qwen4090.supervisor" in loaded  # it read what was loaded
    assert "qwen4090.launch" not in loaded  # the resolver: only the Launch value is needed
    assert len(loaded) <= SUPERVISOR_MODULES, (
        f"importing qwen4090.supervisor loads {len(loaded)} of our modules (at most "
        f"{SUPERVISOR_MODULES}): {' '.join(m.removeprefix('qwen4090.') for m in loaded)}")
