"""Logging setup (structlog): console on a terminal, one line per event under systemd.

Under systemd each line starts with a ``<N>`` syslog priority (journald's SyslogLevelPrefix
turns it into PRIORITY, so ``journalctl -p warning`` works) followed by key=value or JSON.
Works with structlog 22.x (Debian 12) as well as current releases.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import MutableMapping
from typing import Any, TextIO

LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40, "critical": 50}
PRIORITY = {"debug": 7, "info": 6, "warning": 4, "warn": 4, "error": 3, "critical": 2,
            "exception": 3}


def choose_format(fmt: str, stream: TextIO) -> str:
    if fmt != "auto":
        return fmt
    try:
        return "console" if stream.isatty() else "keyvalue"
    except (AttributeError, ValueError):
        return "keyvalue"


class _Prefixed:
    """Final renderer: ``<N>`` priority prefix, then key=value or JSON fields."""

    def __init__(self, json_mode: bool) -> None:
        self.json_mode = json_mode

    def __call__(self, _logger: Any, method: str, event: MutableMapping[str, Any]) -> str:
        level = str(event.pop("level", method))
        prio = PRIORITY.get(level, 6)
        if self.json_mode:
            event["level"] = level
            return f"<{prio}>" + json.dumps(event, default=str, separators=(",", ":"))
        name = event.pop("event", "")
        parts = [str(name)]
        for key, value in event.items():
            parts.append(f"{key}={_kv(value)}")
        return f"<{prio}>" + " ".join(parts)


def _kv(value: Any) -> str:
    if isinstance(value, (int, float, bool)) or value is None:
        return str(value)
    s = str(value)
    if s and not any(c in s for c in ' "=\n\t\\'):
        return s
    return json.dumps(s)


def setup(fmt: str = "auto", level: str = "info", stream: TextIO | None = None) -> str:
    """Configure structlog once for the process; return the format chosen."""
    import structlog

    stream = stream or sys.stderr
    fmt = choose_format(fmt, stream)
    shared: list[Any] = [structlog.contextvars.merge_contextvars,
                         structlog.processors.add_log_level]
    if fmt == "console":
        renderer: Any = structlog.dev.ConsoleRenderer(colors=stream.isatty())
        shared.append(structlog.processors.TimeStamper(fmt="%H:%M:%S", utc=False))
    else:
        # journald stamps each line itself; JSON consumers still like a timestamp.
        if fmt == "json":
            shared.append(structlog.processors.TimeStamper(fmt="iso", utc=True))
        renderer = _Prefixed(json_mode=(fmt == "json"))
    structlog.configure(
        processors=[*shared, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(_stdlib_level(level)),
        logger_factory=structlog.PrintLoggerFactory(stream),
        cache_logger_on_first_use=False,
    )
    return fmt


def _stdlib_level(level: str) -> int:
    return {10: logging.DEBUG, 20: logging.INFO, 30: logging.WARNING,
            40: logging.ERROR, 50: logging.CRITICAL}[LEVELS.get(level, 20)]


def get_logger(**bind: Any) -> Any:
    # A lazy proxy, also with bound values: each call uses the configuration in effect, so a
    # reload's setup() reaches loggers made before it (.bind() would freeze the old one).
    return _Deferred(bind)


class _Deferred:
    """structlog's lazy logger, made at the first use.  The modules that only may log
    (fdlimit, kvbudget, steptime) make theirs at import: structlog imports asyncio, and with
    it socket and subprocess, which the supervisor's modules do not (test_imports.py)."""

    def __init__(self, bind: dict[str, Any]) -> None:
        self._bind = bind
        self._log: Any = None

    def __getattr__(self, name: str) -> Any:
        if self._log is None:
            import structlog

            self._log = structlog.get_logger("qwen4090", **self._bind)
        return getattr(self._log, name)


# The level from which vLLM's own lines are shown ([log] vllm_level): set at start and by a
# reload, read for every line by the child's line router (child.LineRouter).
_vllm_level = "info"


def set_vllm_level(level: str) -> None:
    global _vllm_level
    _vllm_level = level


def vllm_level() -> str:
    return _vllm_level
