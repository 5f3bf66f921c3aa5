"""One pre-imported vLLM interpreter, kept ready for the next launch (``restart.preimport``).

Owns the interpreter from its start (at each spawn, beside the vLLM that is loading, so that
it has finished importing by READY: started at READY, it was still importing 14-20 s later on
the H200 and a fault soon after READY waited for it) until it is handed over to
become the next vLLM child (``take``) or dropped (``discard``: the command or environment
changed, the option was turned off, the daemon stops).  The interpreter runs
preimport_main.py in vLLM's venv, in its own process group like every vLLM child, and holds
no GPU memory.  It is used only when the next launch has the same interpreter, module and
environment it was started with: vLLM reads part of its environment at import time.  vLLM's
arguments may differ (an OOM step, a fixed KV budget): they are sent at hand-over.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import psutil
from prometheus_client import CollectorRegistry, Gauge

from qwen4090.base import oomscore
from qwen4090.base.vllmfacts import PREIMPORT_MODULES
from qwen4090.engine import child

SCRIPT = Path(__file__).parents[1] / "base" / "preimport_main.py"


def split_command(argv: Sequence[str]) -> tuple[list[str], str, list[str]] | None:
    """``[python, *flags, -m, module, *args]`` -> (python + flags, module, args); None for any
    other command (e.g. the ``vllm serve`` script): only ``python -m`` can be pre-imported."""
    argv = list(argv)
    for i, a in enumerate(argv[1:-1], start=1):
        if a == "-m":
            return argv[:i], argv[i + 1], argv[i + 2:]
        if not a.startswith("-"):
            return None  # a script path: not the -m form
    return None


class Preimport:
    def __init__(self, log: Any, clock: Callable[[], float] = time.monotonic,
                 script: Path = SCRIPT, modules: Sequence[str] = PREIMPORT_MODULES) -> None:
        self.log = log
        self.clock = clock
        self.script = script
        self.modules = list(modules)
        self.proc: subprocess.Popen[bytes] | None = None
        self.key: tuple[tuple[str, ...], str, tuple[tuple[str, str], ...]] | None = None
        self.started = 0.0
        self._said_unavailable = False

    @staticmethod
    def _key(parts: tuple[list[str], str, list[str]] | None, env: dict[str, str]
             ) -> tuple[tuple[str, ...], str, tuple[tuple[str, str], ...]] | None:
        """What an interpreter is started with (split_command's parts of the command and the
        environment); None for a command that cannot be pre-imported."""
        if parts is None:
            return None
        python, module, _ = parts
        return tuple(python), module, tuple(sorted(env.items()))

    def prepare(self, argv: Sequence[str], env: dict[str, str]) -> int | None:
        """Have an interpreter ready for a launch like ``argv`` with ``env``; its pid, or None."""
        key = self._key(split_command(argv), env)
        if key is None:
            if not self._said_unavailable:
                self._said_unavailable = True
                self.log.warning("preimport_unavailable", command=" ".join(argv[:3]),
                                 hint="restart.preimport needs vllm.command in the form "
                                      "[python, \"-m\", module]")
            return None
        if self.proc is not None and self.proc.poll() is None and self.key == key:
            return self.proc.pid
        self.discard("the command or environment changed")
        python, module, _ = key
        try:
            proc = subprocess.Popen(
                [*python, str(self.script), module, *self.modules], env=env,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                start_new_session=True, close_fds=True)
        except OSError as e:
            self.log.warning("preimport_failed", error=e.strerror or str(e),
                             command=python[0])
            return None
        child.OWN.add(proc)  # its exit status is ours to poll (take), never reap_adopted's
        oomscore.raise_for(proc.pid)  # as killable as the vLLM it will become
        self.proc, self.key, self.started = proc, key, self.clock()
        self.log.info("preimport_started", pid=proc.pid, module=module)
        return proc.pid

    def take(self, argv: Sequence[str], env: dict[str, str]) -> subprocess.Popen[bytes] | None:
        """The ready interpreter, told to become vLLM with ``argv``'s arguments; None when
        there is none for this command and environment (the caller spawns as usual)."""
        proc = self.proc
        if proc is None:
            return None
        if proc.poll() is not None:
            tail = b""
            if proc.stderr is not None:
                with contextlib.suppress(OSError, ValueError):
                    tail = proc.stderr.read()[-300:]
            self.log.warning("preimport_lost", pid=proc.pid, code=proc.returncode,
                             detail=tail.decode("utf-8", "replace").strip().splitlines()[-1:])
            self.discard(None)
            return None
        parts = split_command(argv)
        if parts is None or self._key(parts, env) != self.key:
            self.discard("the command or environment changed")
            return None
        try:
            assert proc.stdin is not None
            proc.stdin.write((json.dumps({"argv": parts[2]}) + "\n").encode())
            proc.stdin.close()
        except (OSError, ValueError) as e:
            self.log.warning("preimport_lost", pid=proc.pid, error=str(e))
            self.discard("its stdin is closed")
            return None
        self.log.info("preimport_used", pid=proc.pid, age=round(self.clock() - self.started, 1))
        self._forget()
        return proc

    # --- what /status and /metrics show (httpapi.StatusSource; the HTTP thread) -------------

    def status(self) -> dict[str, Any]:
        """``preimport``: the waiting interpreter (pid, seconds since its start, its memory),
        or None when there is none."""
        proc, started = self.proc, self.started  # one read each: the loop may replace them
        if proc is None or not self._waiting(proc):
            return {"preimport": None}
        try:
            rss: int | None = psutil.Process(proc.pid).memory_info().rss
        except psutil.Error:
            rss = None
        return {"preimport": {"pid": proc.pid, "age_s": round(self.clock() - started, 1),
                              "rss_bytes": rss}}

    def register(self, registry: CollectorRegistry) -> None:
        Gauge("qwen4090_preimport_ready", "1 while a pre-imported vLLM interpreter waits for "
              "the next start (restart.preimport)", registry=registry).set_function(
            lambda: 1.0 if self._waiting(self.proc) else 0.0)  # no psutil per scrape

    @staticmethod
    def _waiting(proc: subprocess.Popen[bytes] | None) -> bool:
        """There is one, not known to have exited (no poll here: reaping is the loop's)."""
        return proc is not None and proc.returncode is None

    def discard(self, why: str | None) -> None:
        """Kill the waiting interpreter's group (it runs nothing yet) and reap it; ``why``
        None: it is already gone and said so."""
        proc = self.proc
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=2.0)
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()
        if why is not None:
            self.log.info("preimport_discarded", pid=proc.pid, reason=why)
        self._forget()

    def _forget(self) -> None:
        self.proc, self.key = None, None
