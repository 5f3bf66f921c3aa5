"""The pre-imported interpreter (preimport.py + preimport_main.py), with real processes: this
machine's Python stands in for vLLM's, and small modules written here stand in for vLLM's API
server (the real one is in tests/integration/test_preimport.py)."""

from __future__ import annotations

import os
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from tests.support.fakes import Log

from qwen4090.engine.child import VllmChild
from qwen4090.engine.preimport import Preimport, split_command


def test_only_python_dash_m_commands_can_be_preimported() -> None:
    assert split_command(["/v/python", "-m", "vllm.x", "--model", "m"]) == (
        ["/v/python"], "vllm.x", ["--model", "m"])
    assert split_command(["/v/python", "-u", "-m", "vllm.x"]) == (["/v/python", "-u"], "vllm.x", [])
    assert split_command(["/v/bin/vllm", "serve", "m"]) is None
    assert split_command(["/v/python", "script.py", "-m", "x"]) is None
    assert split_command(["/v/python", "-m"]) is None


def server_module(tmp_path: Path, name: str, body: str) -> dict[str, str]:
    """A module ``name`` that plays the API server; the env that finds it."""
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(body))
    return {**os.environ, "PYTHONPATH": str(tmp_path), "PYTHONUNBUFFERED": "1"}


ECHO = """
    import sys, time
    IMPORTED_AT = time.monotonic()
    if __name__ == "__main__":
        print("serving", sys.argv[1:], sys.stdin.read() == "")
"""


def collect(child: VllmChild, lines: list[str], timeout: float = 20) -> int:
    deadline = time.monotonic() + timeout
    while child.poll() is None or not child.output_closed():
        assert time.monotonic() < deadline, lines
        time.sleep(0.02)
    return child.proc.returncode


def test_the_interpreter_becomes_the_server_with_the_arguments_of_the_launch(
        tmp_path: Path) -> None:
    env = server_module(tmp_path, "fakeserver", ECHO)
    log = Log()
    pre = Preimport(log, modules=["json", "no_such_module_here"])
    first = [sys.executable, "-m", "fakeserver", "--old", "1"]
    pid = pre.prepare(first, env)
    assert pid is not None and pre.prepare(first, env) == pid  # one is kept, not two
    # an OOM step or a KV budget changes vLLM's arguments, not the interpreter
    proc = pre.take([sys.executable, "-m", "fakeserver", "--new", "2"], env)
    assert proc is not None and proc.pid == pid and pre.proc is None
    lines: list[str] = []
    child = VllmChild(["vllm"], env, lambda stream, line, ending: lines.append(line), proc=proc)
    assert child.pid == pid == child.pgid and os.getpgid(pid) == pid  # its own group
    assert collect(child, lines) == 0
    assert any("no_such_module_here not imported" in x for x in lines), lines  # best effort
    assert any("fakeserver imported in" in x for x in lines), lines
    assert "serving ['--new', '2'] True" in lines  # its argv, and stdin is /dev/null
    assert log.named("preimport_used")[0]["pid"] == pid


def test_a_different_environment_or_interpreter_is_not_used_and_the_old_one_is_killed(
        tmp_path: Path) -> None:
    env = server_module(tmp_path, "fakeserver", ECHO)
    log = Log()
    pre = Preimport(log)
    argv = [sys.executable, "-m", "fakeserver"]
    pid = pre.prepare(argv, env)
    assert pid is not None
    assert pre.take(argv, {**env, "VLLM_LOGGING_LEVEL": "DEBUG"}) is None  # read at import
    assert log.named("preimport_discarded")[0]["pid"] == pid
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # killed and reaped
    assert pre.take(argv, env) is None  # none left: the caller spawns as usual
    pid2 = pre.prepare(argv, env)
    assert pid2 is not None and pre.take(["/other/python", "-m", "fakeserver"], env) is None


def test_commands_that_are_not_python_m_are_refused_once(tmp_path: Path) -> None:
    log = Log()
    pre = Preimport(log)
    assert pre.prepare(["/usr/bin/vllm", "serve", "m"], {}) is None
    assert pre.prepare(["/usr/bin/vllm", "serve", "m"], {}) is None
    assert len(log.named("preimport_unavailable")) == 1 and pre.proc is None


def lost_interpreter(tmp_path: Path, name: str, body: str) -> dict[str, Any]:
    """Prepare an interpreter for a server module that ends it; take() must refuse it and
    say why (the preimport_lost event)."""
    env = server_module(tmp_path, name, body)
    log = Log()
    pre = Preimport(log)
    argv = [sys.executable, "-m", name]
    assert pre.prepare(argv, env) is not None and pre.proc is not None
    pre.proc.wait(timeout=30)
    assert pre.take(argv, env) is None and pre.proc is None
    return log.named("preimport_lost")[0]


def test_an_interpreter_that_died_is_reported_and_not_used(tmp_path: Path) -> None:
    lost = lost_interpreter(tmp_path, "brokenserver", "raise ImportError('no vllm here')\n")
    assert lost["code"] == 1 and "no vllm here" in " ".join(lost["detail"])


def test_an_import_that_initializes_cuda_makes_the_interpreter_unusable(tmp_path: Path) -> None:
    # A CUDA context would hold GPU memory through the relaunch and stop vLLM's fork.
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text(
        "class cuda:\n    @staticmethod\n    def is_initialized():\n        return True\n")
    lost = lost_interpreter(tmp_path, "cudaserver", "import torch\n")
    assert lost["code"] == 3 and "initialized CUDA" in " ".join(lost["detail"])


def test_our_package_directory_does_not_shadow_the_servers_imports(tmp_path: Path) -> None:
    # preimport_main.py lives in qwen4090/, next to a notify.py: the server's `import notify`
    # must find its own (on PYTHONPATH), as under `python -m`.
    (tmp_path / "notify.py").write_text("WHO = 'theirs'\n")
    env = server_module(tmp_path, "shadowserver", """
        import notify
        if __name__ == "__main__":
            print("notify is", notify.WHO)
    """)
    pre = Preimport(Log())
    argv = [sys.executable, "-m", "shadowserver"]
    proc = pre.take(argv, env) if pre.prepare(argv, env) else None
    assert proc is not None
    lines: list[str] = []
    child = VllmChild(["vllm"], env, lambda stream, line, ending: lines.append(line), proc=proc)
    assert collect(child, lines) == 0 and "notify is theirs" in lines, lines


def test_an_empty_line_or_eof_ends_the_waiting_interpreter(tmp_path: Path) -> None:
    env = server_module(tmp_path, "fakeserver", ECHO)
    pre = Preimport(Log())
    argv = [sys.executable, "-m", "fakeserver"]
    assert pre.prepare(argv, env) is not None
    proc = pre.proc
    assert proc is not None and proc.stdin is not None
    proc.stdin.close()  # what a killed supervisor leaves it
    assert proc.wait(timeout=20) == 0
    pre.discard("test")


def test_status_and_metrics_show_the_waiting_interpreter(tmp_path: Path) -> None:
    from prometheus_client import CollectorRegistry

    env = server_module(tmp_path, "fakeserver", ECHO)
    clock = [100.0]
    pre = Preimport(Log(), clock=lambda: clock[0])
    registry = CollectorRegistry()
    pre.register(registry)
    assert pre.status() == {"preimport": None}
    assert registry.get_sample_value("qwen4090_preimport_ready") == 0.0
    pid = pre.prepare([sys.executable, "-m", "fakeserver"], env)
    clock[0] += 12.5
    shown = pre.status()["preimport"]
    assert shown["pid"] == pid and shown["age_s"] == 12.5 and shown["rss_bytes"] > 0
    assert registry.get_sample_value("qwen4090_preimport_ready") == 1.0
    pre.discard("test")
    assert pre.status() == {"preimport": None}
    assert registry.get_sample_value("qwen4090_preimport_ready") == 0.0


def test_every_engine_the_launcher_starts_leaves_an_interpreter_for_the_next(
        tmp_path: Path) -> None:
    """Issue 29.3's seam: a standby's build spawns through the same launcher and took the
    interpreter prepared for the serving engine's next start; a new one was prepared only at a
    serving STARTING (a listener), so the next fallback, OOM or reload restart ran without
    one.  Now each spawn, the standby's included, prepares one for the next start."""
    from qwen4090.commandline import cli
    from qwen4090.launching import instance
    from qwen4090.launching.launch import configured
    from qwen4090.settings.config import from_dict

    (tmp_path / "fakeserver.py").write_text(textwrap.dedent(ECHO))
    cfg = from_dict({
        "vllm": {"command": [sys.executable, "-m", "fakeserver"], "model": str(tmp_path),
                 "env": {"PYTHONPATH": str(tmp_path), "PYTHONUNBUFFERED": "1"}},
        "front": {"enabled": True, "engine_port": 18770},
        "restart": {"preimport": True, "readahead": False, "standby": "awake"}})
    log = Log()
    inst = instance.Instance.take(cfg, log, env={"RUNTIME_DIRECTORY": str(tmp_path)})
    pre = Preimport(log, modules=["json"])
    lines: list[str] = []
    launcher = cli.VllmLauncher(inst, pre, lambda stream, line, ending: lines.append(line),
                                lambda c, line: None, log)
    try:
        serving = configured(cfg)
        standby = configured(cfg, beside=serving.engine)
        started = [launcher(serving), launcher(standby), launcher(serving)]
        for c in started:
            assert collect(c, lines) == 0
        used = [e["pid"] for e in log.named("preimport_used")]
        # the first start had none to take; the standby and the restart after it each took
        # the one the start before prepared
        assert used == [started[1].pid, started[2].pid], (used, lines)
        assert pre.proc is not None and pre.proc.poll() is None  # and one waits for the next
        assert f"serving {list(standby.argv[3:])} True" in lines  # with the standby's argv
    finally:
        pre.discard("test over")
        inst.close(True)
