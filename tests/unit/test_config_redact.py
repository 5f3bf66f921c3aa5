"""Issue 8 item 14: no log line carries an exception repr that can hold a header or the key."""

from __future__ import annotations

import http.client
import http.server
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from test_supervisor import Harness

from qwen4090.base import redact
from qwen4090.base.redact import safe_error
from qwen4090.base.states import State
from qwen4090.engine.warmup import _parallel
from qwen4090.probes.http import VllmProbe

KEY = "Zq9x-s3cr\u00e9t-\u5bc6\u94a5-Wv7k"  # what http.client cannot encode into a header


def pieces(secret: str) -> set[str]:
    """Every 4-character piece of the secret: none may appear in a log line."""
    return {secret[i:i + 4] for i in range(len(secret) - 3)}


def assert_no_secret(text: str, secret: str = KEY) -> None:
    leaked = {p for p in pieces(secret) if p in text}
    assert not leaked, (leaked, text)


def header_error() -> UnicodeEncodeError:
    """The exception http.client raises for a non-latin-1 Authorization header."""
    try:
        f"Bearer {KEY}".encode("latin-1")
    except UnicodeEncodeError as e:
        return e
    raise AssertionError("encoded")


def test_safe_error_keeps_the_type_and_drops_the_payload() -> None:
    e = header_error()
    assert KEY in repr(e) or KEY[:14] in repr(e)  # what was logged before
    text = safe_error(e)
    assert text.startswith("UnicodeEncodeError: latin-1 codec cannot encode the character at "
                           "position ")
    assert_no_secret(text)


@pytest.mark.parametrize("exc", [
    ValueError(f"Invalid header value b'Bearer {KEY}\\r\\n'"),
    RuntimeError("request failed", {"Authorization": f"Bearer {KEY}"}),
    http.client.BadStatusLine(f"Authorization: {KEY}"),
    http.client.InvalidURL(f"http://x/?api_key={KEY}"),
    OSError(13, "Permission denied", f"/run/{KEY}"),
    KeyError(KEY),
])
def test_safe_error_masks_what_looks_like_a_credential(exc: Any) -> None:
    redact.remember_secret(KEY)
    text = safe_error(exc)
    assert text.startswith(type(exc).__name__)
    assert_no_secret(text)
    assert "\n" not in text and len(text) < 300


def test_safe_error_masks_a_remembered_secret_anywhere() -> None:
    secret = "plain-Jm2pQr5t-looking"
    redact.remember_secret(secret)
    text = safe_error(ValueError(f"odd {secret} value\nsecond line"))
    assert text == "ValueError: odd *** value\\nsecond line"


def test_safe_error_with_where_names_the_frame_not_the_args() -> None:
    try:
        raise ValueError(f"Bearer {KEY}")
    except ValueError as e:
        text = safe_error(e, where=True)
    assert "test_config_redact.py:" in text and "in test_safe_error_with_where" in text
    assert_no_secret(text)


@pytest.fixture
def server() -> Iterator[int]:
    """A local HTTP server; the probe never gets as far as sending to it."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.send_response(401)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv.server_address[1]
    srv.shutdown()
    srv.server_close()


def test_canary_with_an_unencodable_key_is_a_result_without_the_key(server: Any) -> None:
    probe = VllmProbe("127.0.0.1", server, "tiny", KEY)
    res = probe.complete([1, 2, 3], 1, timeout=10)  # raised UnicodeEncodeError before
    assert not res.ok and res.error.startswith("UnicodeEncodeError")
    assert_no_secret(res.error)


def test_warmup_request_that_raises_is_said_as_such_not_as_a_timeout() -> None:
    def boom(prompt: list[int]) -> object:
        raise header_error()

    (out,) = _parallel(boom, [[1]], timeout=125)  # type: ignore[arg-type]
    assert not out.ok and "no answer" not in out.error
    assert out.error.startswith("UnicodeEncodeError")
    assert_no_secret(out.error)


def test_listener_failure_is_logged_without_the_exception_repr() -> None:
    h = Harness()

    def listener(event: object) -> None:
        raise ValueError(f"Invalid header value b'Bearer {KEY}'")

    h.sup.p.listeners.append(listener)
    h.run_until(State.READY)
    failed = [kw for _lvl, e, kw in h.log.events if e == "listener_failed"]
    assert failed and all(kw["error"].startswith("ValueError: ") for kw in failed)
    for lvl, e, kw in h.log.events:
        assert_no_secret(f"{lvl} {e} {kw}")
