"""Exception text that is safe to log: a type and a message that cannot carry a secret.

An exception's ``repr`` (and often its ``str``) carries its arguments verbatim: a
``UnicodeEncodeError`` raised while http.client encodes an ``Authorization`` header holds the
whole header, a ``ValueError("Invalid header value ...")`` holds the value.  Logged every canary
interval, that puts the API key into journald.  :func:`safe_error` is what every log line and
every probe result uses instead of ``repr(e)``/``str(e)`` for exceptions we did not raise
ourselves: known types are described from fields that hold no payload (errno, codec, position);
anything else has every secret we know of, and anything that looks like a credential, masked.
"""

from __future__ import annotations

import re
import sys
import threading
import traceback

MASK = "***"
MAX_MESSAGE = 200

_lock = threading.Lock()
_secrets: set[str] = set()

# "Bearer abc", "Authorization: abc", "api_key=abc", "VLLM_API_KEY=abc" (case-insensitive).
_CREDENTIAL = re.compile(
    r"(?i)(bearer\s+|authorization['\"]?\s*[:=]\s*['\"]?(?:bearer\s+)?|"
    r"api[_-]?key['\"]?\s*[:=]\s*['\"]?|token['\"]?\s*[:=]\s*['\"]?)[^\s'\",;)}\]]+")


def remember_secret(secret: str) -> None:
    """A value that must never appear in a log line (the API key, once read)."""
    if len(secret) >= 4:  # shorter values would mask ordinary words
        with _lock:
            _secrets.add(secret)


def scrub(text: str) -> str:
    """text with known secrets and credential-looking tokens masked, on one line, bounded."""
    with _lock:
        secrets = sorted(_secrets, key=len, reverse=True)
    for s in secrets:
        text = text.replace(s, MASK)
    text = _CREDENTIAL.sub(lambda m: m.group(1) + MASK, text)
    text = one_line(text)
    return text if len(text) <= MAX_MESSAGE else text[:MAX_MESSAGE - 1] + "…"


def one_line(text: str) -> str:
    """Control characters and line separators escaped: the text prints as exactly one line."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii")
                   for ch in text)


def safe_error(e: BaseException, where: bool = False) -> str:
    """'Type: message' for a log line; with where=True, the innermost frame's file:line too."""
    name = type(e).__name__
    msg = _message(e)
    text = f"{name}: {msg}" if msg else name
    if where and e.__traceback__ is not None:
        frame = traceback.extract_tb(e.__traceback__)[-1]
        text += f" (at {frame.filename.rsplit('/', 1)[-1]}:{frame.lineno} in {frame.name})"
    return text


def _message(e: BaseException) -> str:
    if isinstance(e, TimeoutError):  # (socket.timeout is TimeoutError since Python 3.10)
        return "timed out"
    if isinstance(e, UnicodeError):
        # Its object is the text being encoded (for a header: the whole header). Never show it.
        codec = getattr(e, "encoding", None)
        pos = getattr(e, "start", None)
        verb = "decode" if isinstance(e, UnicodeDecodeError) else "encode"
        if codec is not None and pos is not None:
            return f"{codec!s} codec cannot {verb} the character at position {pos}"
        return f"cannot {verb} text"
    if isinstance(e, OSError):
        # strerror is the C library's sentence; filename and args are left out.
        if e.strerror:
            return f"[Errno {e.errno}] {e.strerror}" if e.errno is not None else e.strerror
        return scrub(str(e)) if e.args else ""
    # http.client looked up, not imported: no HTTPException exists before something else
    # imported it, and the supervisor's modules import no HTTP client (test_imports.py)
    http_client = sys.modules.get("http.client")
    if http_client is not None and isinstance(e, http_client.HTTPException):
        # Their args are raw protocol bytes (a status line, a header): only the kind is said.
        return ""
    try:
        return scrub(str(e))
    except Exception:  # a broken __str__ must not break the log line
        return ""
