from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pytest

from qwen4090.commandline.cli import main
from qwen4090.settings import config
from qwen4090.settings.config import Config, ConfigError, changed_sections, defaults_as_dict, load

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "etc" / "qwen4090" / "qwen4090.toml"


@pytest.fixture(autouse=True)
def _no_service_user(monkeypatch: pytest.MonkeyPatch) -> None:
    """As root beside an installed package, check-config would also check that the qwen4090
    user can read these temporary files (test_config_risks.py tests that)."""
    monkeypatch.setenv("QWEN4090_SERVICE_USER", "")


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


FULL = REPO / "packaging" / "examples" / "qwen4090.full.toml"


def shipped_keys(text: str) -> dict[str, object]:
    """'section.key' -> value of every key the file sets or shows commented out ('#key = v')."""
    found: dict[str, object] = {}
    section = None
    for line in text.splitlines():
        head = re.fullmatch(r"\[(\w+)\]", line)
        if head:
            section = head.group(1)
            continue
        m = re.fullmatch(r"#?(\w+) = (.+)", line)
        if m and section:
            found[f"{section}.{m.group(1)}"] = tomllib.loads(f"v = {m.group(2)}")["v"]
    return found


def test_shipped_toml_is_short_and_holds_no_value_but_the_defaults() -> None:
    text = SHIPPED.read_text()
    with SHIPPED.open("rb") as f:
        parsed = tomllib.load(f)
    defaults = defaults_as_dict()
    # Whatever it sets uncommented is the default (the defaults live only in config.py) ...
    for section, table in parsed.items():
        for key, value in table.items():
            assert value == defaults[section][key], f"{section}.{key}"
    # ... and every key it shows, commented or not, exists and shows its default.
    shown = shipped_keys(text)
    assert sorted(shown) == sorted(config.SHIPPED_KEYS)
    for dotted, value in shown.items():
        section, key = dotted.split(".")
        assert value == defaults[section][key], dotted
    # Short: a handful of keys, pointing at the drop-ins and the man page.
    assert len(shown) <= 6 and "conf.d/" in text and "man qwen4090.toml" in text
    assert config.load(SHIPPED) == Config()
    assert text == config.render_toml()


def test_full_reference_is_generated_and_is_every_default() -> None:
    with FULL.open("rb") as f:
        assert tomllib.load(f) == defaults_as_dict()
    assert FULL.read_text() == config.render_full_toml(), (
        "packaging/examples/qwen4090.full.toml is stale; run: PYTHONPATH=daemon python3 -c "
        "'from qwen4090.settings.config import render_full_toml as r; print(r(), end=\"\")' "
        "> packaging/examples/qwen4090.full.toml")
    for dotted in config.field_help():
        assert config.field_doc(dotted).split(" Accepts ")[1], dotted


def test_every_key_has_help() -> None:
    helps = config.field_help()
    assert all(h.strip() for h in helps.values())
    assert "vllm.max_model_len" in helps and "restart.budget_failures" in helps


def test_empty_file_gives_defaults(tmp_path: Path) -> None:
    cfg = load(write(tmp_path / "q.toml", ""))
    assert cfg == Config()
    assert cfg.sources == (str(tmp_path / "q.toml"),)


def test_drop_ins_merge_in_name_order(tmp_path: Path) -> None:
    main_file = write(tmp_path / "q.toml", "[vllm]\nport = 9000\nmax_num_seqs = 4\n")
    write(tmp_path / "conf.d" / "20-b.toml", "[vllm]\nmax_num_seqs = 16\n")
    write(tmp_path / "conf.d" / "10-a.toml", "[vllm]\nmax_num_seqs = 8\nport = 9001\n")
    write(tmp_path / "conf.d" / "README", "not toml, ignored")
    cfg = load(main_file)
    assert cfg.vllm.port == 9001
    assert cfg.vllm.max_num_seqs == 16
    assert [Path(s).name for s in cfg.sources] == ["q.toml", "10-a.toml", "20-b.toml"]


@pytest.mark.parametrize(
    ("text", "key", "fragments"),
    [
        ("[vllm]\nprot = 1\n", "vllm.prot", ["unknown key", "did you mean vllm.port"]),
        ("[vlm]\nport = 1\n", "vlm", ["unknown section"]),
        ("[vllm]\nport = \"80\"\n", "vllm.port", ['found "80"', "an integer from 1 to 65535"]),
        ("[vllm]\nport = 70000\n", "vllm.port", ["found 70000", "from 1 to 65535"]),
        ("[vllm]\ngpu_memory_utilization = 1.5\n", "vllm.gpu_memory_utilization",
         ["found 1.5", "from 0.05 to 0.99"]),
        ("[vllm]\nenforce_eager = \"yes\"\n", "vllm.enforce_eager", ["true or false"]),
        ("[vllm]\nmax_model_len = \"big\"\n", "vllm.max_model_len",
         ['an integer from 16', 'or "auto"']),
        ("[vllm]\ndtype = \"fp64\"\n", "vllm.dtype", ["one of"]),
        ("[warmup]\nlengths = [1, \"x\"]\n", "warmup.lengths",
         ["a list of 1 to 64 integers", "(item 2)"]),
        ("[warmup]\nlengths = [0]\n", "warmup.lengths", ["integers from 1", "(item 1)"]),
        ("[vllm]\ncommand = []\n", "vllm.command", ["found []"]),
        ("[vllm]\nextra_args = [\"--api-key=s3cret\"]\n", "vllm.extra_args", ["no secrets"]),
        ("[vllm]\nenv = { VLLM_API_KEY = \"x\" }\n", "vllm.env.VLLM_API_KEY", ["api_key_file"]),
        ("[restart]\nbackoff_initial = 10\nbackoff_max = 5\n", "restart.backoff_max",
         ["at least restart.backoff_initial"]),
        ("vllm = 3\n", "vllm", ["expected a [vllm] table"]),
    ],
)
def test_bad_values_name_file_key_found_expected(tmp_path: Path, text: str, key: str,
                                                 fragments: Any) -> None:
    path = write(tmp_path / "q.toml", text)
    with pytest.raises(ConfigError) as err:
        load(path)
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith(f"{path}: {key}: ")
    for frag in fragments:
        assert frag in msg


def test_error_in_drop_in_names_the_drop_in(tmp_path: Path) -> None:
    main_file = write(tmp_path / "q.toml", "[vllm]\nport = 9000\n")
    bad = write(tmp_path / "conf.d" / "50-x.toml", "[watch]\nhang_timeout = -1\n")
    with pytest.raises(ConfigError) as err:
        load(main_file)
    assert str(err.value).startswith(f"{bad}: watch.hang_timeout: found -1")


def test_syntax_error_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="invalid TOML"):
        load(write(tmp_path / "q.toml", "[vllm\n"))
    with pytest.raises(ConfigError, match="file not found"):
        load(tmp_path / "nope.toml")


def test_changed_sections() -> None:
    a = Config()
    b = config.from_dict({"watch": {"hang_timeout": 15.0}})
    c = config.from_dict({"vllm": {"port": 9}})
    assert changed_sections(a, b) == ["watch"]
    # status.port and front.engine_port follow vllm.port when unset (qwen4090.settings.derived)
    assert changed_sections(a, c) == ["vllm", "status", "front"]


def test_read_secret_refuses_loose_permissions(tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_text("s3cret\n")
    key.chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        config.read_secret(str(key))
    key.chmod(0o600)
    assert config.read_secret(str(key)) == "s3cret"


def test_check_config_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    good = write(tmp_path / "good.toml",
                 f'[vllm]\nmodel = "{model}"\ncommand = ["{sys.executable}"]\n')
    assert main(["check-config", "--config", str(good)]) == 0
    assert "config ok" in capsys.readouterr().out

    bad = write(tmp_path / "bad.toml", "[vllm]\nport = 0\n")
    assert main(["check-config", "--config", str(bad)]) == 78
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "vllm.port" in err[0] and "found 0" in err[0]

    nomodel = write(tmp_path / "nomodel.toml",
                    f'[vllm]\nmodel = "{tmp_path}/absent"\ncommand = ["{sys.executable}"]\n')
    assert main(["check-config", "--config", str(nomodel)]) == 78
    assert "vllm.model" in capsys.readouterr().err


def test_help_lists_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for code in ("0", "75", "78"):
        assert f"  {code}  " in out
