from __future__ import annotations

import io
import json

import structlog

from qwen4090.base import logs


class NotATty(io.StringIO):
    def isatty(self) -> bool:
        return False


def emit(fmt: str, level: str = "info") -> list[str]:
    out = NotATty()
    chosen = logs.setup(fmt, level, stream=out)
    log = logs.get_logger()
    log.debug("dbg", n=1)
    log.info("state_changed", **{"from": "loading"}, to="warming", reason="/health answered 200")
    log.warning("restart_scheduled", delay=2.5)
    log.error("vllm_failed", detail='exit code 1: ValueError: "x"\nsecond line')
    log.critical("giving_up", exit_code=75)
    structlog.reset_defaults()
    assert chosen == ("keyvalue" if fmt == "auto" else fmt)
    return out.getvalue().splitlines()


def test_auto_without_terminal_is_keyvalue_with_syslog_priority() -> None:
    lines = emit("auto")
    assert lines[0] == '<6>state_changed from=loading to=warming reason="/health answered 200"'
    assert lines[1] == "<4>restart_scheduled delay=2.5"
    assert lines[2].startswith("<3>vllm_failed detail=")
    # one event is one line, even with a newline in a value
    assert len(lines) == 4 and lines[3] == "<2>giving_up exit_code=75"
    assert json.loads(lines[2].split("detail=", 1)[1]).endswith("second line")


def test_debug_shown_only_when_asked() -> None:
    assert emit("keyvalue", "debug")[0] == "<7>dbg n=1"
    assert len(emit("keyvalue", "warning")) == 3


def test_json_lines_keep_the_prefix() -> None:
    lines = emit("json")
    prio, body = lines[0][:3], json.loads(lines[0][3:])
    assert prio == "<6>" and body["event"] == "state_changed" and body["level"] == "info"
    assert body["to"] == "warming" and "timestamp" in body
