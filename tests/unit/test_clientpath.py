"""The client port's one decision on a request target (clientpath.py, issue 28.1): every
spelling of an engine-only endpoint is refused, and what passes is forwarded in the exact form
decided on."""

from __future__ import annotations

import itertools

import pytest
from tests.support.attacks import spellings

from qwen4090.decide import clientpath
from qwen4090.decide.clientpath import Refusal, Route, decide

ENGINE_ONLY = ["/sleep", "/wake_up", "/is_sleeping", "/pause", "/resume", "/is_paused",
               "/collective_rpc", "/server_info", "/reset_prefix_cache", "/abort_requests",
               "/start_profile", "/update_weights", "/v1/load_lora_adapter", "/openapi.json",
               "/docs"]


@pytest.mark.parametrize("path", ENGINE_ONLY)
def test_an_engine_only_endpoint_is_refused_in_every_spelling(path: str) -> None:
    for target, method in itertools.product(spellings(path), ("GET", "POST")):
        d = decide(method, target)
        assert isinstance(d, Refusal), (target, d)
        assert d.status in (400, 404), (target, d)


def test_what_passes_is_one_canonical_form_without_escapes() -> None:
    for target, canonical in (
            ("/v1/models", "/v1/models"), ("/v1/models/", "/v1/models"),
            ("/v1/%6dodels", "/v1/models"), ("/v1/chat/completions?x=1%20y", None),
            ("/health", "/health"), ("/health/", "/health"), ("/tokenize", "/tokenize")):
        d = decide("POST", target)
        assert isinstance(d, Route), (target, d)
        assert "%" not in d.path
        assert d.target == (canonical or target), (target, d)


def test_dot_segments_that_stay_inside_v1_are_still_refused() -> None:
    # no form is guessed: /v1/x/../models would be /v1/models, but a client never sends it
    d = decide("GET", "/v1/x/../models")
    assert isinstance(d, Refusal) and d.status == 400


def test_methods_outside_the_api_are_refused() -> None:
    for method in ("PUT", "PATCH", "TRACE", "CONNECT", "PROPFIND"):
        d = decide(method, "/v1/completions")
        assert isinstance(d, Refusal) and d.status == 405, method


def test_only_health_is_public() -> None:
    for path in ("/v1/models", "/v1/completions", "/tokenize", "/metrics", "/version",
                 "/invocations"):
        d = decide("GET", path)
        assert isinstance(d, Route) and not d.public, path
    for path in clientpath.PUBLIC:
        d = decide("GET", path)
        assert isinstance(d, Route) and d.public, path


def test_the_key_is_a_bearer_token_compared_whole() -> None:
    assert clientpath.authorized("Bearer s3cret", "s3cret")
    assert clientpath.authorized("bearer s3cret", "s3cret")
    for header in (None, "", "s3cret", "Basic s3cret", "Bearer s3cre", "Bearer s3cret2",
                   "Bearer"):
        assert not clientpath.authorized(header, "s3cret"), header
