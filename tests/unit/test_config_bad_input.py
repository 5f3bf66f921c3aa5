"""Bad input found by fuzzing check-config (issue 8, items 13 and 14): each is exit 78 and one
line naming the file and the key; none hangs, raises or echoes a secret."""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from qwen4090.commandline.cli import main
from qwen4090.settings import config
from qwen4090.settings.config import ConfigError, load


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture
def base(tmp_path: Path) -> str:
    """A [vllm] table check-config accepts: a model directory and a command that exists."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    return f'[vllm]\nmodel = "{model}"\ncommand = ["{sys.executable}"]\n'


def check_config(path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """main(check-config) on a thread with a deadline: a hang fails the test, not the run."""
    box: dict[str, int] = {}
    t = threading.Thread(target=lambda: box.setdefault(
        "rc", main(["check-config", "--config", str(path)])), daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), f"check-config still blocked after 30 s on {path}"
    out, err = capsys.readouterr()
    return box["rc"], out, err


def one_line_78(path: Path, capsys: pytest.CaptureFixture[str], key: str | None,
                *fragments: str, file: Path | None = None) -> str:
    rc, out, err = check_config(path, capsys)
    assert rc == 78, (out, err)
    assert len(err.splitlines()) == 1 and err.count("\n") == 1, err
    line = err.rstrip("\n")
    prefix = f"qwen4090: config error: {file or path}: " + (f"{key}: " if key else "")
    assert line.startswith(prefix), line
    for frag in fragments:
        assert frag in line, line
    return line


# --- the two hangs: a FIFO read as a config file or as the key file -------------------------


def test_fifo_as_config_file_is_refused_not_waited_on(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    fifo = tmp_path / "q.toml"
    os.mkfifo(fifo)
    one_line_78(fifo, capsys, None, "not a regular file")


def test_fifo_as_api_key_file_is_refused_not_waited_on(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str],
                                                       base: str) -> None:
    fifo = tmp_path / "key"
    os.mkfifo(fifo, 0o600)
    cfg = write(tmp_path / "q.toml", base + f'api_key_file = "{fifo}"\n')
    one_line_78(cfg, capsys, "vllm.api_key_file", "not a regular file", file=fifo)


def test_device_and_huge_files_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                           base: str) -> None:
    one_line_78(Path("/dev/zero"), capsys, None, "not a regular file")
    big = write(tmp_path / "big.toml", "# x\n" * 300_000)
    one_line_78(big, capsys, None, "more than the 1048576 allowed")
    key = tmp_path / "key"
    key.write_text("k" * 5000)
    key.chmod(0o600)
    cfg = write(tmp_path / "q.toml", base + f'api_key_file = "{key}"\n')
    one_line_78(cfg, capsys, "vllm.api_key_file", "at most 4096 bytes", file=key)


# --- tracebacks --------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "key", "fragments"), [
    ("port = 1" + "0" * 400 + "\n", "vllm.port", ["found a 401-digit number"]),
    ("[watch]\npoll_interval = 1" + "0" * 400 + "\n", "watch.poll_interval",
     ["found a 401-digit number", "from 0.1 to 3600"]),
    ("[warmup]\nlengths = [1" + "0" * 400 + "]\n", "warmup.lengths", ["401-digit"]),
    ("[watch]\nhang_timeout = nan\n", "watch.hang_timeout", ["found nan"]),
    ("[watch]\nload_timeout = inf\n", "watch.load_timeout", ["found inf"]),
    ("[stop]\ndrain_timeout = -inf\n", "stop.drain_timeout", ["found -inf"]),
])
def test_numbers_that_raised_are_range_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                              base: str, text: str, key: str,
                                              fragments: Any) -> None:
    one_line_78(write(tmp_path / "q.toml", base + text), capsys, key, *fragments)


def test_unreadable_toml_is_one_line_without_traceback(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    one_line_78(write(tmp_path / "a.toml", "[vllm]\nport = 1" + "0" * 5000 + "\n"), capsys,
                None, "invalid TOML", "(4300")
    one_line_78(write(tmp_path / "b.toml", "x = " + "[" * 5000 + "]" * 5000 + "\n"), capsys,
                None, "invalid TOML")
    latin1 = tmp_path / "c.toml"
    latin1.write_bytes(b'[vllm]\nserved_model_name = "caf\xe9"\n')
    one_line_78(latin1, capsys, None, "not UTF-8")


# --- values check-config accepted and `run` could not use -----------------------------------


@pytest.mark.parametrize(("text", "key", "fragment"), [
    ('env = { A = "x\\u0000y" }', "vllm.env.A", "NUL byte"),
    ('env = { "A=B" = "x" }', 'vllm.env."A=B"', "variable name"),
    ('env = { "" = "x" }', 'vllm.env.""', "variable name"),
    ('env = { WATCHDOG_USEC = "1" }', "vllm.env.WATCHDOG_USEC", "set by qwen4090"),
    ('env = { CUDA_VISIBLE_DEVICES = "99" }', "gpu.device", "found 99 (from vllm.env"),
    ('extra_args = ["--seed", "1\\u0000"]', "vllm.extra_args", "item 2: it contains a NUL"),
    ('extra_args = [""]', "vllm.extra_args", "item 1: it is empty"),
    ('extra_args = ["--port", "9000"]', "vllm.extra_args", "sets from vllm.port"),
    ('extra_args = ["--max_model_len=99"]', "vllm.extra_args", "vllm.max_model_len"),
    ('served_model_name = "--help"', "vllm.served_model_name", "read it as a flag"),
    ('served_model_name = ""', "vllm.served_model_name", "empty"),
    ('host = ""', "vllm.host", "0.0.0.0"),
    ('host = "not a host!"', "vllm.host", "not an IP address or a host name"),
    ('host = "999.1.1.1"', "vllm.host", "not an IP address"),
    ('port = 0', "vllm.port", "from 1 to 65535"),
    ('port = 70000', "vllm.port", "from 1 to 65535"),
    ('quantization = "awq marlin"', "vllm.quantization", "letters, digits"),
    ('block_size = 24', "vllm.block_size", "one of 8, 16, 32, 64, 128"),
    ('api_key_file = "key.txt"', "vllm.api_key_file", "absolute"),
    ('max_num_seqs = 64\nmax_num_batched_tokens = 32', "vllm.max_num_batched_tokens",
     "at least vllm.max_num_seqs"),
    ('enable_chunked_prefill = false\nmax_model_len = 16384\nmax_num_batched_tokens = 8192',
     "vllm.max_num_batched_tokens", "at least vllm.max_model_len when"),
])
def test_vllm_values_that_could_not_run(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                        base: str, text: str, key: str, fragment: str) -> None:
    one_line_78(write(tmp_path / "q.toml", base + text + "\n"), capsys, key, fragment)


@pytest.mark.parametrize(("text", "key", "fragment"), [
    ('model = "--help"', "vllm.model", "read it as a flag"),
    ('model = "~no-such-user-here/m"', "vllm.model", "user after ~ is unknown"),
    ('model = "/' + "m" * 300 + '"', "vllm.model", "longer than 255 bytes"),
    ('command = [""]', "vllm.command", "it is empty"),
])
def test_model_and_command_values_that_could_not_run(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str], text: str,
                                                     key: str, fragment: str) -> None:
    one_line_78(write(tmp_path / "q.toml", "[vllm]\n" + text + "\n"), capsys, key, fragment)


@pytest.mark.parametrize(("text", "key", "fragment"), [
    ("[watch]\npoll_interval = 0", "watch.poll_interval", "from 0.1"),
    ("[watch]\npoll_interval = 5.0\nhang_timeout = 4.0", "watch.hang_timeout",
     "at least 2 x watch.poll_interval"),
    ("[watch]\npoll_interval = 5.0\nunhealthy_timeout = 1.0", "watch.unhealthy_timeout",
     "at least watch.poll_interval"),
    ("[watch]\ncanary_interval = 0.01", "watch.canary_interval", "0 (off) or a number from 1"),
    ("[watch]\ncanary_timeout = -1", "watch.canary_timeout", "found -1"),
    ("[watch]\nload_timeout = 1e12", "watch.load_timeout", "to 86400"),
    ("[warmup]\nconcurrency = [0]", "warmup.concurrency", "item 1"),
    ("[warmup]\nlengths = []", "warmup.lengths", "at least 1 entry"),
    ("[warmup]\nrequest_timeout = 600.0\ntimeout = 300.0", "warmup.request_timeout",
     "at most warmup.timeout"),
    ("max_model_len = 16\n[warmup]\nmax_tokens = 16", "warmup.max_tokens",
     "less than vllm.max_model_len"),
    ("[restart]\nbudget_failures = 0", "restart.budget_failures", "from 1"),
    ("[restart]\nbackoff_factor = 0.5", "restart.backoff_factor", "from 1 to 10"),
    ("[restart]\njitter = 2", "restart.jitter", "from 0 to 1"),
    ("[stop]\nterm_timeout = 0", "stop.term_timeout", "from 1"),
    ("[status]\nport = 0", "status.port", "from 1 to 65535"),
    ("[status]\nport = 8000", "status.port", "other than vllm.port"),
    ("[gpu]\ndevice = -1", "gpu.device", "from 0 to 63"),
    ("[gpu]\nsample_interval = 0.001", "gpu.sample_interval", "0 (off)"),
    ("[gpu]\nstate_directory = \"state\"", "gpu.state_directory", "absolute"),
])
def test_nonsense_values_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str], base: str,
                                     text: str, key: str, fragment: str) -> None:
    one_line_78(write(tmp_path / "q.toml", base + text + "\n"), capsys, key, fragment)


# --- issue 18.8: settings that cannot work, accepted before ------------------------------------


@pytest.fixture(autouse=True)
def _no_service_user(monkeypatch: pytest.MonkeyPatch) -> None:
    """As root beside an installed package, check-config would also check that the qwen4090
    user can read these temporary files (test_config_risks.py tests that)."""
    monkeypatch.setenv("QWEN4090_SERVICE_USER", "")


@pytest.mark.parametrize("args", [
    '["--api-k", "s3cret"]', '["--api-ke=s3cret"]', '["--api", "s3cret"]', '["--api-"]',
    '["--api_k", "s3cret"]', '["--ap=s3cret"]', '["--a", "s3cret"]',
    '["--seed", "1", "--api-key=s3cret"]',
])
def test_an_api_key_flag_abbreviated_in_extra_args_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], base: str, args: str) -> None:
    # vLLM's argparse expands --api-k to --api-key: the key would be in argv, seen by ps
    line = one_line_78(write(tmp_path / "q.toml", base + f"extra_args = {args}\n"), capsys,
                       "vllm.extra_args", "expected no secrets on the command line",
                       "vllm.api_key_file")
    assert "s3cret" not in line


@pytest.mark.parametrize("args", ['["--seed", "1"]', '["--api-server-count", "2"]',
                                  '["--api-keys"]', '["-api"]'])
def test_flags_that_are_not_an_api_key_abbreviation_pass(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], base: str, args: str) -> None:
    rc, _out, err = check_config(write(tmp_path / "q.toml", base + f"extra_args = {args}\n"),
                                capsys)
    assert rc == 0, err


@pytest.mark.parametrize(("text", "key", "fragments"), [
    ("gpu_memory_utilization = 0.6\n[gpu]\nladder_min_util = 0.8",
     "gpu.ladder_min_util", ("found 0.8 with vllm.gpu_memory_utilization = 0.6",
                             "at most vllm.gpu_memory_utilization")),
    ("[restart]\nbackoff_initial = 0\nbudget_window = 1", "restart.budget_window",
     ("found 1, while 5 failures take at least 4 s", "a crash loop is never detected")),
    ("[restart]\nbackoff_initial = 60\nbackoff_max = 600\njitter = 0\nbudget_failures = 3\n"
     "budget_window = 150", "restart.budget_window", ("3 failures take at least 182 s",)),
    ("[warmup]\nconcurrency = []", "warmup.concurrency", ("at least 1 entry",)),
    ("[stop]\nterm_timeout = 0.1", "stop.term_timeout", ("found 0.1", "from 1 to 600")),
])
def test_combinations_that_cannot_work_are_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], base: str, text: str, key: str,
        fragments: tuple[str, ...]) -> None:
    one_line_78(write(tmp_path / "q.toml", base + text + "\n"), capsys, key, *fragments)


@pytest.mark.parametrize("text", [
    # a share below the default floor: the ladder only has no memory-share rung
    "gpu_memory_utilization = 0.16",
    "gpu_memory_utilization = 0.6\n[gpu]\nladder_min_util = 0.6",
    # the shipped budget, and the shortest window that holds 5 instant failures without backoff
    "[restart]\nbackoff_initial = 0\nbudget_window = 4",
    "[restart]\nbackoff_initial = 0\nbudget_failures = 1\nbudget_window = 1",
    "[stop]\nterm_timeout = 1",
    "[warmup]\nconcurrency = [1]",
])
def test_the_edges_of_those_rules_pass(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                       base: str, text: str) -> None:
    rc, _out, err = check_config(write(tmp_path / "q.toml", base + text + "\n"), capsys)
    assert rc == 0, err


def test_the_crash_loop_floor_follows_the_backoff_as_policy_computes_it() -> None:
    r = config.RestartConfig()  # 2 s doubling, jitter 0.2, 5 failures
    assert config.shortest_crash_loop(r) == (2 + 4 + 8 + 16) * 0.8 + 4 * 1.0
    capped = config.RestartConfig(backoff_initial=5, backoff_max=6, jitter=0, budget_failures=4)
    assert config.shortest_crash_loop(capped) == 5 + 6 + 6 + 3 * 1.0
    assert config.shortest_crash_loop(config.RestartConfig(budget_failures=1)) == 0


# --- one line, whatever the input holds -------------------------------------------------------


@pytest.mark.parametrize("text", [
    '[vllm]\nserved_model_name = "two\\nlines"\n',
    '[vllm]\n"bad\\nkey" = 1\n',
    '["sec\\ntion"]\nx = 1\n',
    '[vllm]\nmodel = "/no/such\\u2028dir"\n',
    '[vllm]\nextra_args = ["\\n", "x"]\ncommand = []\n',
])
def test_messages_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                               text: str) -> None:
    rc, _out, err = check_config(write(tmp_path / "q.toml", text), capsys)
    assert rc == 78
    assert len(err.splitlines()) == 1, err


def test_drop_in_with_a_newline_in_its_name_is_named_on_one_line(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str],
                                                                 base: str) -> None:
    main_file = write(tmp_path / "q.toml", base)
    write(tmp_path / "conf.d" / "bad\nname.toml", "[watch]\nhang_timeout = -1\n")
    line = one_line_78(main_file, capsys, "watch.hang_timeout", "found -1",
                       file=tmp_path / "conf.d" / "bad\\nname.toml")
    assert "\n" not in line


def test_unknown_keys_and_sections_name_the_nearest(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str],
                                                    base: str) -> None:
    one_line_78(write(tmp_path / "q.toml", base + "[wach]\npoll_interval = 1\n"), capsys,
                "wach", "unknown section; did you mean [watch]?")
    one_line_78(write(tmp_path / "q.toml", base + "serverd_model_name = \"x\"\n"), capsys,
                "vllm.serverd_model_name", "did you mean vllm.served_model_name?")


# --- item 14: an API key that no HTTP header can carry ----------------------------------------

BAD_KEYS = [("Zq9x\u00e9Wv7k-\u5bc6\u94a5", "non-ASCII"),
            ("Zq9xWv7k Jm2pQr5t", "whitespace"), ("Zq9xWv7k\x01Jm2p", "control"),
            ("Zq9xWv7k\nJm2pQr5t", "whitespace")]


@pytest.mark.parametrize(("key", "what"), BAD_KEYS)
def test_api_key_that_a_header_cannot_carry_is_refused_without_echo(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], base: str, key: str, what: str
        ) -> None:
    key_file = tmp_path / "key"
    key_file.write_bytes(key.encode("utf-8") + b"\n")
    key_file.chmod(0o600)
    cfg = write(tmp_path / "q.toml", base + f'api_key_file = "{key_file}"\n')
    rc, out, err = check_config(cfg, capsys)
    assert rc == 78 and len(err.splitlines()) == 1, err
    assert "vllm.api_key_file" in err and what in err and "the key is not shown" in err
    raw = key.encode("utf-8")
    for part in {key, *key.split()} | {raw[i:i + 4].decode("utf-8", "ignore")
                                       for i in range(0, len(raw) - 3)}:
        if len(part) >= 4:
            assert part not in out + err, part


def test_printable_ascii_key_is_read_and_stripped(tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("  sk-Abc_123.~+/=\n")
    key_file.chmod(0o600)
    assert config.read_secret(str(key_file)) == "sk-Abc_123.~+/="


def test_read_secret_reads_from_the_checked_file_only(tmp_path: Path) -> None:
    d = tmp_path / "dir"
    d.mkdir(mode=0o700)
    with pytest.raises(ConfigError, match="not a regular file"):
        config.read_secret(str(d))


def test_every_value_load_accepts_equals_its_rendering(tmp_path: Path, base: str) -> None:
    cfg = load(write(tmp_path / "q.toml", base + "env = { A_1 = \"x\\ty\" }\n"))
    again = load(write(tmp_path / "r.toml", config.render_full_toml(cfg)))
    assert again.vllm == cfg.vllm


def test_fifo_as_the_vllm_command_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                             base: str) -> None:
    fifo = tmp_path / "vllm"
    os.mkfifo(fifo, 0o755)
    cfg = write(tmp_path / "q.toml", base.replace(sys.executable, str(fifo)))
    one_line_78(cfg, capsys, "vllm.command", "not a regular file")


def test_model_directory_that_cannot_be_looked_at_is_a_line_not_a_traceback(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], base: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from qwen4090.launching import preflight

    cfg = load(write(tmp_path / "q.toml", base))
    real_stat = Path.stat

    def stat(self: Path, *args: Any, **kwargs: Any) -> Any:  # what a non-root user gets under /root
        if str(self).startswith(cfg.vllm.model):
            raise PermissionError(13, "Permission denied")
        return real_stat(self, *args, **kwargs)

    monkeypatch.setattr(Path, "stat", stat)
    res = preflight.static(cfg)
    assert res.fatal is not None and res.fatal.key == "vllm.model"
    assert "Permission denied" in str(res.fatal)


def test_fifo_as_the_models_config_json_is_refused_by_plan(tmp_path: Path) -> None:
    from qwen4090.launching import plan

    model = tmp_path / "model"
    model.mkdir()
    os.mkfifo(model / "config.json")
    box: dict[str, BaseException] = {}

    def read() -> None:
        try:
            plan.read_model(model)
        except BaseException as e:
            box["e"] = e

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), "plan.read_model blocked on a FIFO"
    assert isinstance(box.get("e"), plan.PlanError) and "not a regular file" in str(box["e"])


def test_warmup_never_plans_a_request_longer_than_max_model_len() -> None:
    from qwen4090.engine.warmup import plan_steps

    # What an OOM ladder can reach at run time (max_model_len lowered below the check's).
    cfg = config.from_dict({"vllm": {"model": "/m", "max_model_len": 16},
                            "warmup": {"max_tokens": 15}})
    tight = dataclasses.replace(cfg, vllm=dataclasses.replace(cfg.vllm, max_model_len=15))
    steps, skipped = plan_steps(tight)
    assert steps == [] and "concurrency 8 (max_model_len 15)" in skipped
