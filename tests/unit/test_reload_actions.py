"""Issue 29.5: what a reload does with each key is said once, in the config schema
(``config.reload_action``), and this file holds every key to it: a change of each key, alone,
is reloaded into a READY supervisor (fake clock and parts, as in test_supervisor) and must do
what the schema says: RESTART restarts vLLM, REFUSE is refused and the old config keeps
serving, every other action leaves the serving vLLM alone.  The same schema renders README's
per-key list and the man page's "On reload" (checked here and in test_packaging)."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any, get_type_hints

import pytest
from test_supervisor import Harness

from qwen4090.base.states import State
from qwen4090.decide.policy import Cause
from qwen4090.settings import config
from qwen4090.settings.config import (
    LIVE,
    NEXT_LAUNCH,
    REFUSE,
    RESTART,
    SECTIONS,
    START,
    ConfigError,
    as_dict,
    from_dict,
    reload_action,
    reload_doc,
)

README = Path(__file__).resolve().parents[2] / "README.md"

# Values of the string kinds that pass their rules (config.STRING_KINDS), and keys whose
# generic change would break a rule tying it to another key.
KIND_VALUE = {"host": "127.0.0.2", "abspath": "/etc/qwen4090/other", "name": "other-name",
              "word": "fp8", "model": "/var/lib/qwen4090/models/other"}
ALTERNATE: dict[str, Any] = {
    "vllm.extra_args": ["--seed", "1"],
    "vllm.env": {"OMP_NUM_THREADS": "1"},
    "vllm.command": ["/opt/qwen4090/venv/bin/python", "-m", "vllm.entrypoints.openai.other"],
    "vllm.block_size": 32,
    "vllm.tensor_parallel_size": 2,
    "restart.standby": "sleep",  # to sleep: the launch gets --enable-sleep-mode
    "status.port": 8091,
    "front.engine_port": 18010,
    "vllm.port": 8001,
    "gpu.ladder_min_util": 0.6,
}
# ... and what must change with it (of the same action) to keep the rules
WITH = {"vllm.enable_chunked_prefill": {"vllm.max_num_batched_tokens": 16384}}


def keys() -> list[str]:
    return list(config.field_help())


def alternate(dotted: str, value: Any) -> Any:
    """Another valid value for the key: its choice, a nearby number, a flipped flag."""
    if dotted in ALTERNATE:
        return ALTERNATE[dotted]
    section, key = dotted.split(".", 1)
    meta = {f.name: f.metadata for f in config.dataclasses.fields(SECTIONS[section])}[key]
    if isinstance(value, bool):
        return not value
    if meta["choices"]:
        return next(c for c in meta["choices"] if c != value)
    if isinstance(value, (int, float)):
        hi = meta["max"] if meta["max"] is not None else value * 2 + 1
        bumped = value * 2 if value else (meta["min"] or 0) + 1
        out = bumped if bumped <= hi else (value + (meta["min"] or 0)) / 2
        return type(value)(out) if isinstance(value, float) else int(out)
    if isinstance(value, str):
        return KIND_VALUE[meta["kind"]]
    if isinstance(value, list):
        return [1, 2]
    raise AssertionError(f"no alternate for {dotted} ({get_type_hints(SECTIONS[section])[key]})")


def reloaded(dotted: str) -> tuple[Harness, Any]:
    """A READY supervisor (front on) and a reload that changes only ``dotted``."""
    h = Harness({"front": {"enabled": True}})
    h.run_until(State.READY)
    raw = as_dict(h.sup.cfg)
    section, key = dotted.split(".", 1)
    raw[section][key] = alternate(dotted, raw[section][key])
    for other, value in WITH.get(dotted, {}).items():
        assert reload_action(other)[0] == reload_action(dotted)[0], other
        s, k = other.split(".", 1)
        raw[s][k] = value
    try:
        new = from_dict(raw)
    except ConfigError as e:  # the test's alternate broke a rule: say which, to fix ALTERNATE
        raise AssertionError(f"{dotted}: the alternate value is refused: {e}") from None
    h.reload_to = new
    h.sup.inbox.deliver(signal.SIGHUP)
    h.step(0.1)
    return h, new


@pytest.mark.parametrize("dotted", keys())
def test_a_reload_does_with_each_key_what_the_schema_says(dotted: str) -> None:
    action, _ = reload_action(dotted)
    assert action in (LIVE, RESTART, NEXT_LAUNCH, REFUSE, START), (dotted, action)
    h, new = reloaded(dotted)
    refused = h.log.named("reload_refused")
    if action == REFUSE:
        assert refused and dotted in refused[-1]["error"], (dotted, refused)
        assert h.sup.cfg != new and h.sup.state is State.READY
        return
    assert not refused, (dotted, refused)
    assert h.sup.cfg == new  # taken
    if action == RESTART:
        assert h.sup.state is State.RESTARTING and h.failure.cause is Cause.RELOAD, dotted
        assert h.log.named("restart_for_reload"), dotted
    else:  # live, from the next launch, or at the service's start: the serving vLLM stays
        assert h.sup.state is State.READY, (dotted, action, h.sup.state_reason)
        assert not h.log.named("restart_for_reload"), dotted


def test_readme_lists_what_a_reload_does_per_key_as_the_schema_says() -> None:
    text = README.read_text()
    begin = ("<!-- reload-actions: generated by qwen4090.settings.config.reload_doc; do not edit "
             "-->\n")
    start = text.index(begin) + len(begin)
    end = text.index("<!-- /reload-actions -->", start)
    assert text[start:end] == reload_doc(), "README's reload list is stale: regenerate it"


def test_every_key_says_its_reload_action_in_its_documentation() -> None:
    for dotted in keys():
        action, note = reload_action(dotted)
        doc = config.field_doc(dotted)
        assert "On reload: " + config.RELOAD_TEXT[action] in doc, dotted
        assert note in doc, dotted
