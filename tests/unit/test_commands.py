"""The command table and what the commands share (issue 11.3): every command that reads the
config answers a broken one alike, with one line and exit 78, through commands.config_error."""

from __future__ import annotations

from pathlib import Path

import pytest

from qwen4090.commandline import cli, commands
from qwen4090.decide.policy import EX_CONFIG, EXIT_CODES

BROKEN = '[vllm]\nport = "x"\n'
WHY = 'vllm.port: found "x", expected an integer from 1 to 65535'


@pytest.mark.parametrize("command", ["check-config", "plan", "reset-learned", "bench"])
def test_a_broken_config_is_one_line_and_78_for_every_command(
        command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    conf = tmp_path / "q.toml"
    conf.write_text(BROKEN)
    assert cli.main([command, "-c", str(conf)]) == 78
    out, err = capsys.readouterr()
    assert out == ""
    assert err == f"qwen4090: config error: {conf}: {WHY}\n"


def test_plan_names_an_unreadable_model_in_one_line_with_78(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["plan", "-c", str(tmp_path / "none.toml"), "--model",
                     str(tmp_path / "nomodel")]) == 78
    _, err = capsys.readouterr()
    assert err == (f"qwen4090: plan: {tmp_path}/nomodel/config.json not found: point "
                   "vllm.model (or --model) at the model's top directory\n")


def test_config_error_prints_one_line_and_returns_the_documented_code(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert commands.config_error("a.toml: x.y: bad") == EX_CONFIG == 78
    assert commands.config_error("no model", "plan") == 78
    assert capsys.readouterr().err == "qwen4090: config error: a.toml: x.y: bad\n" \
                                      "qwen4090: plan: no model\n"
    assert "configuration error" in EXIT_CODES[78]


def test_the_table_lists_every_command_once_with_what_it_runs() -> None:
    assert list(cli.COMMANDS) == ["check-config", "run", "install-runtime", "fetch-model",
                                  "plan", "reset-learned", "status", "bench"]
    for name, c in cli.COMMANDS.items():
        assert c.help and callable(c.add_arguments) and callable(c.run), name
        parser = cli.build_parser()
        assert parser.parse_args([name, *(["REPO"] if name == "fetch-model" else [])]
                                 ).command == name
