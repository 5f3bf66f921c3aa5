"""The fixed KV budget from the last good start, and the weights' read-ahead (no vLLM)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tests.support.fakes import Log

from qwen4090.engine import readahead
from qwen4090.launching import launch, launchvalue
from qwen4090.launching.kvbudget import FLAG, KvBudget, exact_bytes
from qwen4090.launching.launchvalue import Launch
from qwen4090.launching.plan import GpuMemory
from qwen4090.settings.config import Config, from_dict

GIB = 1024 ** 3


def cfg(**vllm: Any) -> Any:
    # standby "off": a launch's config is then the config itself (the default, "auto", is
    # resolved to a concrete mode in the launch: test_autostandby.py)
    return from_dict({"vllm": {"model": "/m", **vllm},
                      "restart": {"fixed_kv_budget": True, "standby": "off"}})


def ready(kv_bytes: int | None = 4 * GIB) -> dict[str, Any]:
    return {"outcome": "ready", "kv_bytes": kv_bytes, "kv_tokens": 30160}


def resolve(kv: KvBudget, c: Config, gpu: str = "H200", runtime: str = "vllm 0.26.0",
            beside: launchvalue.Endpoint | None = None) -> Launch:
    """What the daemon's preflight does with the budget on disk (launch.py)."""
    return launch.resolve(c, launch.Facts(GpuMemory(80 * GIB, gpu), kv_budget=kv.read(),
                                          runtime=runtime), beside)


def record(kv: KvBudget, launched: Launch, report: dict[str, Any]) -> bool:
    """What the daemon does at READY (gpu.GpuParts.remember_kv)."""
    return kv.record(launched.config, launched.kv_base, report)


def test_the_next_launch_gets_the_bytes_of_the_last_good_start(tmp_path: Path) -> None:
    kv = KvBudget(tmp_path)
    c = cfg()
    first = resolve(kv, c)
    # nothing recorded yet: vLLM profiles
    assert (first.config, first.kv_note) == (c, None)
    assert record(kv, first, ready())
    second = resolve(kv, c)
    assert second.config.vllm.extra_args[-2:] == [FLAG, str(4 * GIB)]
    assert second.kv_note is not None and "30160 tokens" in second.kv_note
    assert second.settings[launch.KV_KEY].origin is launchvalue.Origin.KV_BUDGET
    # a start that was given the budget does not re-record (the reported GiB are rounded)
    assert not record(kv, second, ready(3 * GIB))
    assert resolve(kv, c).config.vllm.extra_args[-1] == str(4 * GIB)


def test_the_budget_is_the_exact_bytes_of_the_tokens_when_the_plan_knows_them(
        tmp_path: Path) -> None:
    # H200, fourth sitting: vLLM said "Available KV cache memory: 5.29 GiB" for 34,672 tokens
    # at 163,840 B/token; a budget of 5.29 GiB gave 34,656 tokens.
    reported, tokens, per_token = int(5.29 * GIB), 34_672, 163_840
    assert exact_bytes(reported, tokens, per_token) == 34_672 * 163_840 == 5_680_660_480
    assert exact_bytes(reported, tokens, None) == reported  # no plan: vLLM's figure
    assert exact_bytes(reported, None, per_token) == reported
    assert exact_bytes(reported, tokens, 2 * per_token) == reported  # the plan is off: keep it
    kv = KvBudget(tmp_path)
    first = resolve(kv, cfg())
    assert kv.record(first.config, first.kv_base,
                     {"kv_bytes": reported, "kv_tokens": tokens}, per_token)
    assert kv.read()["kv_cache_memory_bytes"] == 5_680_660_480


def test_other_settings_or_gpu_do_not_get_it(tmp_path: Path) -> None:
    kv = KvBudget(tmp_path)
    record(kv, resolve(kv, cfg()), ready())
    other = resolve(kv, cfg(max_model_len=4096))
    assert FLAG not in other.config.vllm.extra_args
    assert other.kv_note and "other settings" in other.kv_note
    assert FLAG not in resolve(kv, cfg(), "RTX 4090").config.vllm.extra_args
    # another vLLM may profile another size: an upgrade profiles again
    upgraded = resolve(kv, cfg(), runtime="vllm 0.32.0")
    assert FLAG not in upgraded.config.vllm.extra_args and "other settings" in (
        upgraded.kv_note or "")


def test_on_by_default_off_when_asked_and_the_sysadmins_own_flag_wins(tmp_path: Path) -> None:
    kv = KvBudget(tmp_path)
    plain = from_dict({"vllm": {"model": "/m"}})
    assert plain.restart.fixed_kv_budget  # issue 10: the same KV tokens on every start
    record(kv, resolve(kv, plain), ready())
    assert resolve(kv, plain).config.vllm.extra_args[-2:] == [FLAG, str(4 * GIB)]
    off = from_dict({"vllm": {"model": "/m"},
                     "restart": {"fixed_kv_budget": False, "standby": "off"}})
    got = resolve(kv, off)
    assert (got.config, got.kv_note) == (off, None)
    own = cfg(extra_args=[FLAG + "=123"])
    got = resolve(kv, own)
    assert (got.config, got.kv_note) == (own, None)
    assert not record(kv, got, ready())


def test_a_failed_start_with_the_budget_forgets_it(tmp_path: Path) -> None:
    kv = KvBudget(tmp_path)
    first = resolve(kv, cfg())
    record(kv, first, ready())
    assert not kv.forget(first.kv_budget)  # this launch had no budget: nothing to blame it on
    assert kv.forget(resolve(kv, cfg()).kv_budget)
    got = resolve(kv, cfg())
    assert (got.config, got.kv_note) == (cfg(), None)


def test_the_runtime_is_read_from_the_commands_venv(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    meta = venv / "lib/python3.12/site-packages/vllm-0.26.0.dist-info"
    meta.mkdir(parents=True)
    (venv / "pyvenv.cfg").write_text("home = /usr/bin\n")
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.26.0\n")
    c = from_dict({"vllm": {"model": "/m", "command": [str(venv / "bin/python"), "-m", "x"]}})
    assert launch.runtime_of(c) == "vllm 0.26.0"
    assert launch.runtime_of(from_dict({"vllm": {"model": "/m", "command": ["vllm"]}})) == ""


def test_a_torn_file_means_profile(tmp_path: Path) -> None:
    (tmp_path / "kv_budget.json").write_text("{")
    got = resolve(KvBudget(tmp_path), cfg())
    assert (got.config, got.kv_note) == (cfg(), None)
    assert not record(KvBudget(tmp_path), got, ready(None))


def test_readahead_decides_and_advises(tmp_path: Path) -> None:
    (tmp_path / "model-00001.safetensors").write_bytes(b"x" * 4096)
    (tmp_path / "config.json").write_text("{}")
    files = readahead.weight_files(str(tmp_path))
    assert [p.name for p, _ in files] == ["model-00001.safetensors"]
    assert readahead.decide(files, 10 * 4096) is None
    assert "available" in (readahead.decide(files, 4096) or "")
    assert readahead.decide([], 1 << 40) == "no weight files"
    assert readahead.weight_files(str(tmp_path / "nope")) == []
    assert readahead.advise(files) == 1


def test_readahead_thread_runs_and_a_dummy_model_is_skipped(tmp_path: Path) -> None:
    log = Log()
    assert readahead.start(str(tmp_path), log) is None and log.names() == ["readahead_skipped"]
    (tmp_path / "w.bin").write_bytes(os.urandom(1024))
    t = readahead.start(str(tmp_path), log, available=lambda: 1 << 30)
    assert t is not None
    t.join(10)
    assert log.names()[-1] == "readahead_done"


# --- the compile caches: in the CacheDirectory, per instance, kept across upgrades -----------

ROOT = Path(__file__).resolve().parents[2]


def test_cache_environment_defaults_under_the_cache_root() -> None:
    from qwen4090.engine.caches import cache_environment

    env = cache_environment({"VLLM_CACHE_ROOT": "/var/cache/qwen4090/a", "HOME": "/h"})
    assert env["TRITON_CACHE_DIR"] == "/var/cache/qwen4090/a/triton"
    assert env["TORCHINDUCTOR_CACHE_DIR"] == "/var/cache/qwen4090/a/inductor"
    assert cache_environment({"CACHE_DIRECTORY": "/c:/d"})["VLLM_CACHE_ROOT"] == "/c"
    own = cache_environment({"VLLM_CACHE_ROOT": "/c", "TRITON_CACHE_DIR": "/t"})
    assert own["TRITON_CACHE_DIR"] == "/t"  # set by the sysadmin: kept
    assert cache_environment({"HOME": "/h"}) == {"HOME": "/h"}  # nothing to go by
    # the config's [vllm.env] names the root: the caches follow it
    env = cache_environment({"HOME": "/h"}, {"VLLM_CACHE_ROOT": "/v"})
    assert env["TRITON_CACHE_DIR"] == "/v/triton" and "VLLM_CACHE_ROOT" not in env  # its own


def test_units_put_vllms_caches_in_their_cache_directory_which_survives_upgrades() -> None:
    # packaging/debian in the repository; debian/ in the source package (autopkgtest)
    deb = next((d for d in (ROOT / "packaging" / "debian", ROOT / "debian") if d.is_dir()),
               ROOT / "packaging" / "debian")
    for unit, sub in (("qwen4090.service", ""), ("qwen4090@.service", "/%i")):
        text = (deb / unit).read_text()
        assert f"CacheDirectory=qwen4090{sub}\n" in text
        assert f"VLLM_CACHE_ROOT=/var/cache/qwen4090{sub} " in text  # per instance
    postrm = (deb / "qwen4090.postrm").read_text()
    # the cache is removed on purge only, never on upgrade or remove
    guard = postrm.index('if [ "$1" = "purge" ]; then')
    code = [(i, line) for i, line in enumerate(postrm.splitlines())
            if not line.lstrip().startswith("#")]
    guard_line = postrm[:guard].count("\n")
    removals = [i for i, line in code if "rm " in line and "/var/cache/qwen4090" in line]
    assert removals and all(i > guard_line for i in removals)


def test_the_daemons_gpu_part_records_and_forgets_by_the_launch(tmp_path: Path) -> None:
    """The GPU part's store: remember at READY, forget after a failed start given it."""
    from qwen4090.launching.gpu import GpuParts

    c = from_dict({"vllm": {"model": "/m"}, "restart": {"fixed_kv_budget": True},
                   "gpu": {"enabled": "off", "state_directory": str(tmp_path)}})
    parts = GpuParts(Log(), env={})
    first = parts.launch(c)
    assert first.kv_budget is None and parts.remember_kv(first, 30160, 4 * GIB)
    assert not parts.forget_kv(first)  # it profiled: nothing to blame on the budget
    second = parts.launch(c)
    assert second.kv_budget == 4 * GIB and FLAG in second.argv
    assert not parts.remember_kv(second, 30160, 3 * GIB)  # given the budget: not re-recorded
    assert parts.forget_kv(second) and not (tmp_path / "kv_budget.json").exists()
    assert parts.launch(c).kv_budget is None


def test_the_gpu_part_gives_the_record_the_plans_bytes_per_token(tmp_path: Path) -> None:
    """gpu.remember_kv -> kvbudget: the launch's plan decides the exact budget."""
    import dataclasses
    from types import SimpleNamespace
    from typing import cast

    from qwen4090.launching.gpu import GpuParts
    from qwen4090.launching.plan import Plan

    c = from_dict({"vllm": {"model": "/m"}, "restart": {"fixed_kv_budget": True},
                   "gpu": {"enabled": "off", "state_directory": str(tmp_path)}})
    parts = GpuParts(Log(), env={})
    planned = dataclasses.replace(parts.launch(c), plan=cast(
        Plan, SimpleNamespace(kv_bytes_per_token=163_840)))
    assert parts.remember_kv(planned, 34_672, int(5.29 * GIB))
    assert parts.launch(c).kv_budget == 34_672 * 163_840


def test_sleep_mode_engines_get_the_budget_the_first_one_recorded(tmp_path: Path) -> None:
    """restart.standby = "sleep" adds --enable-sleep-mode: the budget recorded at the serving
    engine's READY must apply to the standby's launch (on the H200 it did not: the standby
    profiled 37,488 KV tokens where the serving engine had 32,976)."""
    kv = KvBudget(tmp_path)
    c = from_dict({"vllm": {"model": "/m"}, "restart": {"fixed_kv_budget": True,
                                                        "standby": "sleep"},
                   "front": {"enabled": True}})
    first = resolve(kv, c)
    assert "--enable-sleep-mode" in first.config.vllm.extra_args and FLAG not in \
        first.config.vllm.extra_args
    assert record(kv, first, ready())
    standby = resolve(kv, c, beside=first.engine)
    assert standby.config.vllm.extra_args[-2:] == [FLAG, str(4 * GIB)]
    assert standby.engine == launchvalue.Endpoint("127.0.0.1", c.front.engine_port + 1)
    assert "--enable-sleep-mode" in standby.argv and str(c.front.engine_port + 1) in standby.argv
