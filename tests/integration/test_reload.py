"""SIGHUP against the real supervisor and the real CPU vLLM, one daemon (issues 8.1 and 9.5):

- a SIGHUP while vLLM is still loading sends neither RELOADING=1 nor READY=1; READY=1 goes out
  exactly once, after warmup_finished;
- the reloaded log.level takes effect on the lines that follow (info -> debug);
- once READY, a reload is RELOADING=1 + MONOTONIC_USEC and ends with READY=1, also when the new
  config is refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.daemon import Daemon
from tests.support.runtime import cpu_config, free_port, write_toml

START_TIMEOUT = 240.0


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Any:
    tmp = tmp_path_factory.mktemp("reload")
    port = free_port()
    path = write_toml(tmp / "qwen4090.toml", cpu_config(port, log={"level": "info"}))
    d = Daemon(path, tmp, port=port)
    yield d
    d.close()


def rewrite(d: Daemon, **sections: dict[str, Any]) -> Path:
    return write_toml(d.config_path, cpu_config(d.port, **sections))


# No lock here: these run inside Daemon.wait_for, which holds the (non-reentrant) lock; the
# reader threads only append, and list() takes a consistent copy.
def datagrams(d: Daemon, field: str) -> list[tuple[float, list[str]]]:
    return [(t, f) for t, f in list(d.notes) if field in f]


def index_of(d: Daemon, name: str) -> int:
    return next(i for i, ev in enumerate(list(d.events)) if ev.get("event") == name)


def test_sighup_while_loading_then_exactly_one_ready_after_the_warmup(daemon: Daemon) -> None:
    daemon.wait_event("child_spawned", 60)
    rewrite(daemon, log={"level": "debug"})
    mark = daemon.mark()
    daemon.signal(1)  # SIGHUP while vLLM loads
    reloaded = daemon.wait_event("reloaded", 30, after=mark)
    assert reloaded["changed"] == "log"
    daemon.wait_event("logging_reconfigured", 30, after=mark, log_level="debug")
    daemon.wait_notify("READY=1", START_TIMEOUT)
    daemon.wait_event("ready_notified", 30)
    # the reload came while loading: before /health answered, long before the warmup
    assert index_of(daemon, "reloaded") < index_of(daemon, "health_ok") < \
        index_of(daemon, "warmup_finished") < index_of(daemon, "ready_notified")
    assert datagrams(daemon, "RELOADING=1") == []
    ready = datagrams(daemon, "READY=1")
    assert len(ready) == 1 and ready[0][0] > reloaded["_t"]


def test_reloaded_log_level_applies_to_the_next_lines(daemon: Daemon) -> None:
    at = index_of(daemon, "logging_reconfigured")
    before = [ev for ev in list(daemon.events)[:at] if ev["_prio"] == 7]
    assert before == []  # level info until the reload
    # debug lines from the supervisor (the idle canary) and from its bound vLLM logger
    ev = daemon.wait_for(lambda: next((e for e in daemon.events[at:] if e["_prio"] == 7),
                                      None), 60, "a debug line after the reload")
    assert ev["level"] == "debug"


def test_sighup_when_ready_is_reloading_then_ready_also_when_refused(daemon: Daemon) -> None:
    rewrite(daemon, log={"level": "debug"}, watch={"canary_interval": 7.0})
    mark = daemon.mark()
    daemon.signal(1)
    daemon.wait_event("reloaded", 30, after=mark, changed="watch")
    # The datagram and the log line reach the test by two threads (notify socket, stderr):
    # RELOADING=1 is sent before "reloaded" is logged, but may be read after it.
    reloading = daemon.wait_for(lambda: datagrams(daemon, "RELOADING=1"), 30, "RELOADING=1")
    assert len(reloading) == 1
    assert any(f.startswith("MONOTONIC_USEC=") for f in reloading[0][1])
    daemon.wait_for(lambda: len(datagrams(daemon, "READY=1")) == 2, 30, "READY=1 ending it")
    assert datagrams(daemon, "READY=1")[1][0] >= reloading[0][0]

    daemon.config_path.write_text("[vllm]\nport = 0\n")
    mark = daemon.mark()
    daemon.signal(1)
    daemon.wait_event("reload_refused", 30, after=mark)
    daemon.wait_for(lambda: len(datagrams(daemon, "RELOADING=1")) == 2, 30, "RELOADING=1")
    daemon.wait_for(lambda: len(datagrams(daemon, "READY=1")) == 3, 30, "READY=1 after refusal")
    assert daemon.state() == "ready"
    daemon.signal(15)
    assert daemon.wait_exit(60) == 0
