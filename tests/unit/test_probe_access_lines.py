"""vLLM's access lines for our own probes are dropped; users' requests are not."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from qwen4090.base.vllmfacts import PROBE_MARKER, is_probe_access, parse_vllm_line


@pytest.mark.parametrize(("line", "ours"), [
    ('INFO:     127.0.0.1:46792 - "GET /health HTTP/1.1" 200 OK', True),
    ('INFO:     127.0.0.1:46808 - "GET /metrics HTTP/1.1" 200 OK', True),
    ('INFO:     127.0.0.1:46822 - "POST /v1/completions?from=qwen4090-probe HTTP/1.1" 200 OK',
     True),
    ('INFO:     127.0.0.1:46830 - "POST /v1/completions HTTP/1.1" 200 OK', False),
    ('INFO:     10.0.0.7:5555 - "POST /v1/chat/completions HTTP/1.1" 401 Unauthorized', False),
    ('INFO:     127.0.0.1:1 - "GET /healthz HTTP/1.1" 404 Not Found', False),
    ("INFO:     Started server process [3283]", False),
    ("(APIServer pid=1) INFO 11-30 17:16:14 [api_server.py:1] GET /health", False),
])
def test_probe_access_lines(line: str, ours: bool) -> None:
    parsed = parse_vllm_line(line, "stdout")
    assert (parsed.proc == "uvicorn" and is_probe_access(parsed.message)) is ours


def test_the_probe_marks_its_completions() -> None:
    import http.server
    import threading

    from qwen4090.probes.http import VllmProbe

    paths: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            paths.append(self.path)
            self.send_response(500)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        res = VllmProbe("127.0.0.1", srv.server_address[1], "tiny").complete([1], 1, 5.0)
    finally:
        srv.shutdown()
        srv.server_close()
    assert not res.ok
    assert paths == [f"/v1/completions?from={PROBE_MARKER}"]


def test_cli_on_line_drops_probe_access_lines(monkeypatch: pytest.MonkeyPatch,
                                              tmp_path: Path) -> None:
    """The re-emission path in `run`: capture what on_line logs for a few lines."""
    from qwen4090.commandline import cli

    # our own instance lock: the default one in /var/lib/qwen4090 is shared with every other
    # test run on this machine (a concurrent run held it: `run` refused, no on_line)
    monkeypatch.setenv("RUNTIME_DIRECTORY", str(tmp_path))

    logged: list[str] = []

    class Log:
        def __getattr__(self, level: str) -> object:
            return lambda msg, **kw: logged.append(msg)

    captured: dict[str, object] = {}

    def fake_spawn(argv: object, cfg: object, on_line: object, **_kw: object) -> None:
        captured["on_line"] = on_line
        raise SystemExit(0)

    from qwen4090.base import logs
    from qwen4090.engine import child

    monkeypatch.setattr(logs, "get_logger", lambda **kw: Log())
    monkeypatch.setattr(logs, "vllm_level", lambda: "debug")  # users' access lines: debug
    monkeypatch.setattr(logs, "setup", lambda *a, **k: "keyvalue")
    monkeypatch.setattr(child, "spawn", fake_spawn)
    monkeypatch.setattr(child, "become_subreaper", lambda: None)
    on_line = _on_line_of_run(cli, captured)
    on_line("stdout", 'INFO:     127.0.0.1:1 - "GET /health HTTP/1.1" 200 OK')
    on_line("stdout", 'INFO:     127.0.0.1:2 - "POST /v1/completions HTTP/1.1" 200 OK')
    assert '127.0.0.1:2 - "POST /v1/completions HTTP/1.1" 200 OK' in logged
    assert not any("/health" in m for m in logged)


def _on_line_of_run(cli: object, captured: dict[str, object]) -> Any:
    """Build `run`'s parts far enough to get its on_line (the spawn stand-in stops there)."""
    import argparse
    import contextlib
    import tempfile

    from qwen4090.launching.launch import configured
    from qwen4090.parts.contracts import Parts
    from qwen4090.settings.config import Config
    from qwen4090.supervision import supervisor

    with tempfile.TemporaryDirectory() as d:
        cfg = f"{d}/q.toml"
        with open(cfg, "w") as f:
            f.write("[status]\nenabled = false\n[warmup]\nenabled = false\n")
        orig = supervisor.Supervisor.__init__

        def init(self: object, c: Config, parts: Parts, **kw: object) -> None:
            parts.spawn(configured(c))

        supervisor.Supervisor.__init__ = init  # type: ignore[assignment]
        try:
            with contextlib.suppress(SystemExit):
                cli.cmd_run(argparse.Namespace(config=cfg))  # type: ignore[attr-defined]
        finally:
            supervisor.Supervisor.__init__ = orig  # type: ignore[method-assign]
    return captured["on_line"]
