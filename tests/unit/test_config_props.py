"""Property test over the config schema: any TOML input gives exit 0 or 78, never a traceback.

Configs are generated from the dataclass fields themselves (types and metadata), each key
either valid for its field or mutated into any TOML value (huge and negative numbers, NaN, inf,
strings with NUL, newlines and non-ASCII, nested arrays and tables, unknown keys and
sections).  For every input, ``qwen4090 check-config`` returns 0 or 78 and raises nothing; 78
prints exactly one line naming a key; and whatever it accepts, the pieces ``run`` derives
before launching (argv, environment, warmup plan, restart policy, preflight) work.
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import io
import math
import os
import re
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

import pytest

# In the dev extra; the autopkgtest's Depends must list python3-hypothesis for it to run there.
pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qwen4090.commandline.cli import main
from qwen4090.decide.policy import HangDetector, RestartBudget, backoff_delay
from qwen4090.engine.child import render_env
from qwen4090.engine.warmup import plan_steps
from qwen4090.launching import preflight
from qwen4090.launching.launch import render_argv
from qwen4090.probes.http import VllmProbe
from qwen4090.settings import config
from qwen4090.settings.config import AUTO, SECTIONS

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

WORK = Path(tempfile.mkdtemp(prefix="qwen4090-props-"))
MODEL = WORK / "model"
MODEL.mkdir()
(MODEL / "config.json").write_text("{}")
KEY = WORK / "key"
KEY.write_text("k3y-for-props\n")
KEY.chmod(0o600)
STATE = WORK / "state"
BASE = {"vllm": {"model": str(MODEL), "command": [sys.executable]}}

# --- TOML text for any value (tomllib reads it back to the same value) ----------------------


def toml_str(s: str) -> str:
    out = []
    for c in s:
        if c in '"\\':
            out.append("\\" + c)
        elif c.isprintable() and c != "\x7f":
            out.append(c)
        else:
            out.append(f"\\u{ord(c):04x}" if ord(c) <= 0xFFFF else f"\\U{ord(c):08x}")
    return '"' + "".join(out) + '"'


def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        return toml_str(v)
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{toml_str(k)} = {toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(v)


def toml_doc(doc: dict[str, Any]) -> str:
    lines = []
    for name, table in doc.items():
        if not isinstance(table, dict):
            lines.append(f"{toml_str(name)} = {toml_value(table)}")
    for name, table in doc.items():
        if isinstance(table, dict):
            lines.append(f"[{toml_str(name)}]")
            lines += [f"{toml_str(k)} = {toml_value(v)}" for k, v in table.items()]
    return "\n".join(lines) + "\n"


# hypothesis' stubs want the Literal category names: a tuple literal is only tuple[str]
NO_SURROGATES: Any = ("Cs",)

# --- values -----------------------------------------------------------------------------------

nasty_text = st.text(st.characters(blacklist_categories=NO_SURROGATES), max_size=12) | \
    st.sampled_from(["", "\0", "a\nb", "x\u2028y", "密钥", "--port", "~nobody-here/x",
                     "/" + "a" * 300, "a=b", " ", "auto", "-1", "0.0.0.0", "::", "a" * 5000])
scalars = (st.integers() | st.sampled_from([0, -1, 1, 10 ** 400, -(10 ** 400), 2 ** 63, 65536])
           | st.floats() | st.sampled_from([0.0, -0.0, 1e308, -1e-9, math.inf, math.nan])
           | st.booleans() | nasty_text)
wild = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(nasty_text, inner, max_size=3), max_leaves=8)


def valid(section: str, name: str, typ: Any, meta: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Values that the field's own metadata allows (the rules between keys may still refuse)."""
    lo: Any
    hi: Any
    lo, hi, choices, off, kind = (meta.get(k) for k in ("min", "max", "choices", "off", "kind"))
    if typ is bool:
        return st.booleans()
    if get_origin(typ) is not None and get_origin(typ) not in (list, dict):  # int | str
        ints = st.sampled_from(choices) if choices else st.integers(int(lo), int(hi or 10 ** 6))
        return st.just(AUTO) | ints
    if typ is int:
        return st.integers(int(lo), int(hi))
    if typ is float:
        f = st.floats(lo, hi, allow_nan=False, allow_infinity=False)
        return f | st.just(off) if off is not None else f
    if typ is str:
        if choices:
            return st.sampled_from(choices)
        return {
            "model": st.just(str(MODEL)),
            "name": st.from_regex(r"[a-z][a-z0-9._/-]{0,20}", fullmatch=True),
            "host": st.sampled_from(["127.0.0.1", "::1", "localhost", "0.0.0.0", "a-b.example"]),
            "word": st.from_regex(r"([a-z0-9][a-z0-9_]{0,10})?", fullmatch=True),
            "abspath": st.sampled_from(["", str(KEY) if name == "api_key_file" else str(STATE)]),
        }.get(kind or "", st.text(max_size=10))
    if get_origin(typ) is list:
        if get_args(typ)[0] is int:
            return st.lists(st.integers(int(lo), min(int(hi), 10 ** 5)), min_size=1, max_size=5)
        if name == "command":
            return st.just([sys.executable])
        return st.lists(st.sampled_from(["--seed", "1", "--load-format", "dummy",
                                         "--trust-remote-code", "x y", "ünï"]), max_size=4)
    if get_origin(typ) is dict:
        plain = st.dictionaries(st.from_regex(r"[A-Z_][A-Z0-9_]{0,8}", fullmatch=True),
                                st.text(st.characters(blacklist_characters="\0",
                                                      blacklist_categories=NO_SURROGATES),
                                        max_size=10), max_size=3)
        # gpu.device follows CUDA_VISIBLE_DEVICES (qwen4090.settings.derived): exercise that too.
        cuda = st.fixed_dictionaries({"CUDA_VISIBLE_DEVICES": st.sampled_from(
            ["0", "1,2", "3", "99", "", "GPU-5d1c", "MIG-1/2", " 2 , 0"])})
        return plain | cuda
    raise AssertionError(typ)


FIELDS = {name: [(f.name, get_type_hints(cls)[f.name], dict(f.metadata))
                 for f in dataclasses.fields(cls)] for name, cls in SECTIONS.items()}


def chance(percent: int) -> st.SearchStrategy[bool]:
    """True in about ``percent`` % of draws (integers() favours its edges; this does not)."""
    return st.sampled_from([False] * (100 - percent) + [True] * percent)


@st.composite
def configs(draw: st.DrawFn) -> dict[str, Any]:
    doc: dict[str, Any] = {s: dict(t) for s, t in BASE.items()}
    # Percent of keys set to a wild value: none in many examples (those should mostly pass).
    mutate = draw(st.sampled_from([0, 0, 0, 10, 30, 100]))
    for section, fields in FIELDS.items():
        chosen = draw(st.lists(st.sampled_from(fields), max_size=4, unique_by=lambda f: f[0]))
        table = doc.setdefault(section, {})
        for name, typ, meta in chosen:
            wild_one = draw(chance(mutate))
            table[name] = draw(wild if wild_one else valid(section, name, typ, meta))
    if draw(chance(3)):
        doc.setdefault(draw(st.sampled_from(list(SECTIONS))), {})[draw(nasty_text)] = 1
    if draw(chance(2)):
        doc[draw(nasty_text)] = draw(wild)
    return doc


# --- the property -----------------------------------------------------------------------------


@pytest.fixture(autouse=True, scope="module")
def _no_service_user() -> Iterator[None]:
    """As root beside an installed package, check-config would also check that the qwen4090
    user can read WORK (0700): every config would be refused (test_config_risks.py)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("QWEN4090_SERVICE_USER", "")
        yield


KEY_NAMED = re.compile(r'^qwen4090: config error: (?P<file>[^\n]+?\.toml): '
                       r'(?P<key>(?:"(?:[^"\\]|\\.)*"|[^:\s"])+): \S')
_lock = threading.Lock()


def check_config(path: Path) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with _lock, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["check-config", "--config", str(path)])
    return rc, out.getvalue(), err.getvalue()


def names_a_key(line: str, key: str) -> bool:
    """'section' or 'section.key...' of our schema, or an unknown section said to be one."""
    section, _, rest = key.partition(".")
    if section in SECTIONS:
        return not rest or rest.split(".")[0] in {f[0] for f in FIELDS[section]} \
            or "unknown key" in line
    return "unknown section" in line


@settings(max_examples=200, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(configs())
def test_check_config_answers_0_or_78_with_one_line_and_accepted_configs_run(doc: Any) -> None:
    text = toml_doc(doc)
    assert toml_doc(tomllib.loads(text)) == text  # the file says what was generated
    path = WORK / "q.toml"
    path.write_text(text, encoding="utf-8")
    rc, out, err = check_config(path)
    assert rc in (0, 78), (rc, out, err)
    if rc == 78:
        lines = err.splitlines()
        assert len(lines) == 1 and err.endswith("\n") and len(err.splitlines(True)) == 1, err
        m = KEY_NAMED.match(lines[0])
        assert m and m.group("file") == str(path), lines[0]
        assert names_a_key(lines[0], m.group("key")), lines[0]
        assert len(lines[0]) < 1200, lines[0]
        return
    assert out.startswith("config ok") and err == ""
    runs_as_launched(config.load(path))


def runs_as_launched(cfg: config.Config) -> None:
    """What `run` derives from a config before and at launch must not fail."""
    v = cfg.vllm
    argv = render_argv(v)
    env = render_env(v, os.environ, "k3y-for-props")
    for a in argv:
        assert isinstance(a, str) and "\0" not in a and len(os.fsencode(a)) < 131072
    for k, val in env.items():
        assert k and "=" not in k and "\0" not in k + val
        os.fsencode(k), os.fsencode(val)
    assert argv[:len(v.command)] == v.command and argv.count("--port") == 1
    steps, _skipped = plan_steps(cfg)
    for s in steps:
        assert s.length >= 1 and s.concurrency >= 1
        if isinstance(v.max_model_len, int):
            assert s.length + cfg.warmup.max_tokens <= v.max_model_len
    r = cfg.restart
    for n in (1, 2, r.budget_failures, 5000):
        d = backoff_delay(n, r)
        assert 0 <= d <= r.backoff_max * (1 + r.jitter)
    budget = RestartBudget(r.budget_failures, r.budget_window)
    budget.record(0.0)
    budget.exhausted(r.budget_window / 2)
    HangDetector(cfg.watch.hang_timeout).reset()
    # Every timer fits what threading and select accept.
    for section in SECTIONS:
        for value in dataclasses.asdict(getattr(cfg, section)).values():
            if isinstance(value, float):
                assert math.isfinite(value) and value < threading.TIMEOUT_MAX
    probe = VllmProbe(v.host, v.port, v.served_model_name, "k3y-for-props")
    http.client.HTTPConnection(probe.host, probe.port, timeout=1)  # validates the host
    probe._headers(True)
    res = preflight.static(cfg)
    assert res.fatal is None  # check-config ran the same checks
    # The full rendering is read back as the same config.
    assert config.from_dict(tomllib.loads(config.render_full_toml(cfg))) == \
        dataclasses.replace(cfg, sources=())
