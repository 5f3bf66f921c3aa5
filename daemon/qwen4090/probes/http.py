"""HTTP probes of vLLM's server: /health, /metrics, and a streamed completion (canary, warmup).

Each probe returns a result object and never raises: a timeout, a refused connection or a bad
answer is a result with ``ok=False`` and an ``error`` a human can read.  A probe that could not
even ask, for want of a file descriptor (EMFILE: the front's clients hold them all), says so
with ``unseen=True``: that is no word on vLLM, and the judges take it as none (issue 28.3).
Standard library only.
"""

from __future__ import annotations

import http.client
import json
import socket
import time
from collections.abc import Callable, Sequence

from qwen4090.base.fdlimit import exhausted
from qwen4090.base.redact import safe_error
from qwen4090.base.vllmfacts import GENERATION_TOKENS as GENERATION_TOKENS  # re-exported for tests
from qwen4090.base.vllmfacts import PROBE_MARKER, local_host
from qwen4090.base.vllmfacts import RUNNING as RUNNING  # (vLLM's metric names live in vllmfacts)
from qwen4090.base.vllmfacts import WAITING as WAITING
from qwen4090.decide.results import CompletionResult, HealthResult, MetricsResult


class VllmProbe:
    """Talks to one vLLM server.  ``clock`` is monotonic seconds (injectable for tests)."""

    def __init__(self, host: str, port: int, model: str, api_key: str | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.host = local_host(host)  # vLLM may listen on 0.0.0.0 or ::; we probe locally
        self.port = port
        self.model = model
        self.api_key = api_key
        self.clock = clock

    def _conn(self, timeout: float) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout)

    def _headers(self, auth: bool) -> dict[str, str]:
        h = {"User-Agent": "qwen4090-probe"}
        if auth and self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h

    def _get(self, path: str, timeout: float) -> tuple[int, bytes]:
        """One GET without credentials (/health and /metrics need none): status and body."""
        conn = self._conn(timeout)
        try:
            conn.request("GET", path, headers=self._headers(False))
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def health(self, timeout: float) -> HealthResult:
        start = self.clock()
        try:
            status, _ = self._get("/health", timeout)
        except Exception as e:  # never raise; e's text may hold a header: _why is safe
            return HealthResult(False, None, self.clock() - start, _why(e, timeout),
                                unseen=exhausted(e))
        ok = status == 200
        return HealthResult(ok, status, self.clock() - start, "" if ok else f"HTTP {status}")

    def control(self, path: str, timeout: float) -> HealthResult:
        """One POST of vLLM's engine control (``/sleep?level=1``, ``/wake_up``): a 200 or why
        not.  vLLM answers once the engine has done it."""
        start = self.clock()
        try:
            conn = self._conn(timeout)
            try:
                conn.request("POST", path, headers=self._headers(True))
                resp = conn.getresponse()
                status, body = resp.status, resp.read(2000)
            finally:
                conn.close()
        except Exception as e:  # never raise; e's text may hold a header: _why is safe
            return HealthResult(False, None, self.clock() - start, _why(e, timeout),
                                unseen=exhausted(e))
        ok = status == 200
        return HealthResult(ok, status, self.clock() - start, "" if ok else
                            f"HTTP {status}: {_error_text(body.decode('utf-8', 'replace'))}")

    def metrics(self, timeout: float) -> MetricsResult:
        start = self.clock()
        try:
            status, raw = self._get("/metrics", timeout)
            body = raw.decode("utf-8", "replace")
        except Exception as e:  # never raise; e's text may hold a header: _why is safe
            return MetricsResult(False, {}, self.clock() - start, _why(e, timeout),
                                 timed_out=isinstance(e, (socket.timeout, TimeoutError)),
                                 unseen=exhausted(e))
        if status != 200:
            return MetricsResult(False, {}, self.clock() - start, f"HTTP {status}")
        return MetricsResult(True, parse_prometheus(body), self.clock() - start)

    def complete(self, prompt: Sequence[int] | str, max_tokens: int, timeout: float
                 ) -> CompletionResult:
        """One streamed /v1/completions request; measures time to the first token."""
        body = json.dumps({
            "model": self.model, "prompt": list(prompt) if not isinstance(prompt, str) else prompt,
            "max_tokens": max_tokens, "stream": True, "temperature": 0.0,
            # vLLM extensions: an exact number of tokens, whatever the (random) weights say.
            "ignore_eos": True, "min_tokens": max_tokens,
        })
        headers = {**self._headers(True), "Content-Type": "application/json",
                   "Accept": "text/event-stream"}
        start = self.clock()
        deadline = start + timeout
        ttft: float | None = None
        tokens = 0
        finish: str | None = None
        pieces: list[str] = []
        try:
            conn = self._conn(timeout)
            try:
                conn.request("POST", f"/v1/completions?from={PROBE_MARKER}",
                             body=body, headers=headers)
                resp = conn.getresponse()
                if resp.status != 200:
                    text = resp.read(2000).decode("utf-8", "replace")
                    return CompletionResult(False, None, self.clock() - start, 0,
                                            f"HTTP {resp.status}: {_error_text(text)}")
                while True:
                    if self.clock() > deadline:
                        return CompletionResult(False, ttft, self.clock() - start, tokens,
                                                f"no end of stream within {timeout:g}s",
                                                timed_out=True)
                    line = resp.readline()
                    if not line:
                        break
                    line = line.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        break
                    try:
                        chunk = json.loads(data)
                    except ValueError:
                        continue
                    if isinstance(chunk.get("error"), dict):
                        return CompletionResult(False, ttft, self.clock() - start, tokens,
                                                "vLLM error in stream: "
                                                + str(chunk["error"].get("message"))[:300])
                    for choice in chunk.get("choices") or []:
                        if choice.get("text") is not None:
                            tokens += 1
                            pieces.append(str(choice["text"]))
                            if ttft is None:
                                ttft = self.clock() - start
                        if choice.get("finish_reason"):
                            finish = choice["finish_reason"]
            finally:
                conn.close()
        except Exception as e:  # e.g. UnicodeEncodeError holding the Authorization header
            return CompletionResult(False, ttft, self.clock() - start, tokens, _why(e, timeout),
                                    timed_out=isinstance(e, (socket.timeout, TimeoutError)),
                                    unseen=exhausted(e))
        seconds = self.clock() - start
        if ttft is None:
            return CompletionResult(False, None, seconds, tokens, "stream ended without a token",
                                    finish)
        if finish == "abort":
            return CompletionResult(False, ttft, seconds, tokens, "request aborted by vLLM",
                                    finish)
        return CompletionResult(True, ttft, seconds, tokens, "", finish, text="".join(pieces))


def _why(e: BaseException, timeout: float) -> str:
    if isinstance(e, (socket.timeout, TimeoutError)):
        return f"no answer within {timeout:g}s"
    if isinstance(e, ConnectionRefusedError):
        return "connection refused"
    return safe_error(e)  # never repr(e)/str(e): they can carry a header or the key


def _error_text(body: str) -> str:
    try:
        msg = json.loads(body).get("error", {})
        if isinstance(msg, dict):
            return str(msg.get("message", body))[:300]
        return str(msg)[:300]
    except (ValueError, AttributeError):
        return body.strip()[:300]


def parse_prometheus(text: str) -> dict[str, float]:
    """Prometheus text format -> {sample name: value summed over its label sets}."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_end = line.find("{")
        if name_end >= 0:
            name = line[:name_end]
            rest = line[line.rfind("}") + 1:].split()
        else:
            parts = line.split()
            name, rest = parts[0], parts[1:]
        if not rest:
            continue
        try:
            value = float(rest[0])
        except ValueError:
            continue
        out[name] = out.get(name, 0.0) + value
    return out
