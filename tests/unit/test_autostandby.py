"""``restart.standby = "auto"`` (issue 30.1, the default): each rule of autostandby.choose,
the launch it resolves (launch.resolve), the journal line of the preflight, and the keeper of
the supervisor following the serving launch's mode (fake clock and parts, as test_standby)."""

from __future__ import annotations

import dataclasses
import json
import signal
from pathlib import Path
from typing import Any

import pytest
from test_plan import H200, QWEN3_14B, awq_4090
from test_standby import ENGINE, StandbyHarness
from tests.support import hostless
from tests.support.fakes import CheckedGpu, Log

from qwen4090.base.states import State
from qwen4090.decide.results import PreflightResult
from qwen4090.launching import autostandby, gpu, launch, plan
from qwen4090.launching.launchvalue import Endpoint, Launch, Origin
from qwen4090.settings.config import AUTO, Config, ConfigError, from_dict

GIB = 1024 ** 3
# CUDA's total on an RTX 4090 (NVML: 24564 MiB, less what the driver reserves): PyTorch's
# out-of-memory messages on 4090s say "a total capacity of 23.64 GiB"
RTX4090 = plan.GpuMemory(int(23.64 * GIB), "NVIDIA GeForce RTX 4090", "test")
BIG = plan.HostMemory(int(125.7 * GIB), int(123.7 * GIB))  # 128 GB, idle
S = State


def host(total_gib: float, available_gib: float, ours_gib: float = 0.0) -> plan.HostMemory:
    return plan.HostMemory(int(total_gib * GIB), int(available_gib * GIB), int(ours_gib * GIB))


def cfg(model: Path | str = "/m", **raw: dict[str, Any]) -> Config:
    out: dict[str, dict[str, Any]] = {"vllm": {"model": str(model)}}
    for section, table in raw.items():
        out.setdefault(section, {}).update(table)
    return from_dict(out)


@pytest.fixture
def awq(tmp_path: Path) -> plan.ModelFacts:
    return plan.read_model(awq_4090(tmp_path))


@pytest.fixture
def q14(tmp_path: Path) -> plan.ModelFacts:
    d = tmp_path / "q14"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(QWEN3_14B))
    return plan.read_model(d)


# --- the config -----------------------------------------------------------------------------


def test_auto_is_the_default_and_is_accepted_without_the_front() -> None:
    assert from_dict({}).restart.standby == AUTO == Config().restart.standby
    assert from_dict({"front": {"enabled": False}}).restart.standby == AUTO
    with pytest.raises(ConfigError, match=r"restart\.standby"):  # explicit: refused as before
        from_dict({"restart": {"standby": "sleep"}, "front": {"enabled": False}})


def test_auto_is_accepted_with_a_port_clash_that_an_explicit_mode_is_refused_for() -> None:
    clash = {"vllm": {"port": 8001}, "front": {"engine_port": 8000}, "status": {"port": 9000}}
    assert from_dict(clash).restart.standby == AUTO
    with pytest.raises(ConfigError, match=r"front\.engine_port"):
        from_dict({**clash, "restart": {"standby": "awake"}})


def test_the_config_knows_which_keys_a_file_set(tmp_path: Path) -> None:
    from qwen4090.settings.config import load

    f = tmp_path / "q.toml"
    f.write_text('[vllm]\ngpu_memory_utilization = 0.92\n[restart]\nstandby = "auto"\n')
    given = load(f).given
    assert "vllm.gpu_memory_utilization" in given and "restart.standby" in given
    assert "vllm.max_model_len" not in given and from_dict({}).given == frozenset()
    assert load(f) == from_dict({})  # not a key: compares as the defaults it holds


# --- the rules, in order --------------------------------------------------------------------


def test_without_the_front_auto_is_off(awq: plan.ModelFacts) -> None:
    c = autostandby.choose(cfg(front={"enabled": False}), RTX4090, awq, BIG)
    assert c == autostandby.Choice("off", "front.enabled = false: no front to hold clients "
                                          "during a takeover")


def test_a_port_clash_makes_auto_off(awq: plan.ModelFacts) -> None:
    c = autostandby.choose(cfg(vllm={"port": 8001}, front={"engine_port": 8000},
                               status={"port": 9000}), RTX4090, awq, BIG)
    assert c.mode == "off" and c.why == ("front.engine_port + 1 = 8001 is vllm.port: no port "
                                         "for a standby")


def test_without_a_gpu_auto_is_off(awq: plan.ModelFacts) -> None:
    c = autostandby.choose(cfg(), "NVML unavailable: not found", awq, BIG)
    assert c.mode == "off" and c.why == ("no GPU (NVML unavailable: not found): sleep mode "
                                         "needs CUDA; on CPU vLLM set \"awake\" for a standby")
    off = autostandby.choose(cfg(gpu={"enabled": "off"}), RTX4090, awq, BIG)
    assert off.mode == "off" and off.why.startswith("no GPU (gpu.enabled = off)")


def test_without_a_plan_auto_is_off() -> None:
    c = autostandby.choose(cfg(), RTX4090, "/m is not a local model directory", BIG)
    assert c == autostandby.Choice("off", "no plan: /m is not a local model directory")


def test_settings_that_do_not_fit_alone_make_auto_off(awq: plan.ModelFacts) -> None:
    c = autostandby.choose(cfg(vllm={"max_model_len": 131072}), RTX4090, awq, BIG)
    assert c.mode == "off" and "do not fit the GPU even without a standby " \
        "(vllm.max_model_len;" in c.why


def test_a_standby_that_fits_the_gpu_as_configured_sleeps(q14: plan.ModelFacts) -> None:
    c = autostandby.choose(cfg(vllm={"quantization": "fp8"}), H200, q14, BIG)
    assert c.mode == "sleep" and c.utilization is None
    assert c.why == ("sleeping standby: 1.0 GiB on the GPU, ~53.5 GiB of host memory of "
                     "125.7 GiB (123.7 GiB available)")


def test_the_default_utilization_is_lowered_to_make_room(awq: plan.ModelFacts) -> None:
    c = autostandby.choose(cfg(), RTX4090, awq, BIG)
    assert c.mode == "sleep" and c.utilization == 0.89
    assert "at gpu_memory_utilization 0.89 (from 0.92, 69,200 KV tokens instead of 71,232)" \
        in c.why


def test_a_utilization_a_file_set_is_never_lowered(awq: plan.ModelFacts) -> None:
    c = autostandby.choose(cfg(vllm={"gpu_memory_utilization": 0.92}), RTX4090, awq, BIG)
    assert c.mode == "off" and c.utilization is None
    assert c.why == ("a sleeping standby fits only at gpu_memory_utilization 0.89, with "
                     "69,200 KV tokens instead of 71,232; vllm.gpu_memory_utilization = 0.92 "
                     "is set in the config")


def test_more_than_the_kv_cost_limit_makes_auto_off(awq: plan.ModelFacts) -> None:
    # a 20 GiB card: the standby's room costs 8 % of the KV tokens at 8192 batched tokens,
    # 18 % at 28672 (more activations, a smaller KV cache)
    card = plan.GpuMemory(20 * GIB, "20 GiB card", "test")
    ok = autostandby.choose(cfg(), card, awq, BIG)
    assert ok.mode == "sleep" and ok.utilization == 0.87
    assert "45,360 KV tokens instead of 49,280" in ok.why
    c = autostandby.choose(cfg(vllm={"max_num_batched_tokens": 28672}), card, awq, BIG)
    assert c.mode == "off" and c.utilization is None
    assert c.why == ("a sleeping standby fits only at gpu_memory_utilization 0.87, with "
                     "17,712 KV tokens instead of 21,632 (18% fewer; auto gives up at most "
                     "15%)")


def test_a_lower_utilization_that_cuts_the_context_makes_auto_off(awq: plan.ModelFacts) -> None:
    # (within the plan's 5 % tolerance at 0.89, so the plan itself lets it pass)
    c = autostandby.choose(cfg(vllm={"max_model_len": 70000}), RTX4090, awq, BIG)
    assert c.mode == "off" and c.why.endswith("69,200 KV tokens instead of 71,232, fewer than "
                                              "max_model_len 70,000")


def test_no_utilization_with_room_for_a_standby_makes_auto_off(awq: plan.ModelFacts) -> None:
    small = plan.GpuMemory(13 * GIB, "13 GiB card", "test")
    c = autostandby.choose(cfg(vllm={"gpu_memory_utilization": 0.87, "max_model_len": 2048,
                                     "max_num_seqs": 1}), small, awq, BIG)
    assert c.mode == "off" and c.why == ("a sleeping standby's ~1.0 GiB does not fit beside "
                                         "the serving engine at any gpu_memory_utilization "
                                         "that leaves these settings their KV cache")
    # nor does it where a lower utilization leaves too few tokens for max_model_len
    long = autostandby.choose(cfg(vllm={"max_model_len": 73000}), RTX4090, awq, BIG)
    assert long.why == c.why


def test_a_host_too_small_for_both_pinned_copies_makes_auto_off(awq: plan.ModelFacts) -> None:
    c = autostandby.choose(cfg(), RTX4090, awq, host(31.3, 29.3))
    assert c.mode == "off" and c.utilization is None  # nothing lowered for an "off"
    assert c.why == ("a sleeping standby needs ~32.8 GiB of host memory (both engines' pinned "
                     "weights and processes), more than 75% of this machine's 31.3 GiB")
    # the headroom is a quarter of the RAM: 44 GiB holds 32.8 only above 75 %
    assert autostandby.choose(cfg(), RTX4090, awq, host(43, 42)).mode == "off"
    assert autostandby.choose(cfg(), RTX4090, awq, host(44, 43)).mode == "sleep"


def test_a_host_busy_now_makes_auto_off_but_our_own_engines_count_as_room(
        awq: plan.ModelFacts) -> None:
    busy = autostandby.choose(cfg(), RTX4090, awq, host(62.7, 20))
    assert busy.mode == "off" and busy.why == ("a sleeping standby needs ~32.8 GiB of host "
                                               "memory; 20.0 GiB of 62.7 GiB is available now")
    ours = autostandby.choose(cfg(), RTX4090, awq, host(62.7, 20, ours_gib=15))
    assert ours.mode == "sleep" and "(35.0 GiB available)" in ours.why


def test_a_host_not_read_makes_auto_off(awq: plan.ModelFacts) -> None:
    c = autostandby.choose(cfg(), RTX4090, awq, "cannot read the host's memory: nope")
    assert c.mode == "off" and c.why == ("host memory not known (cannot read the host's memory: "
                                         "nope): a sleeping standby pins ~32.8 GiB of it")


def test_the_unit_tests_read_no_host_memory() -> None:
    assert plan.host_memory() == hostless.NO_HOST  # tests/support/hostless.py


# --- the launch -----------------------------------------------------------------------------


def test_resolve_makes_the_launch_of_the_choice(tmp_path: Path) -> None:
    d = awq_4090(tmp_path)
    c = cfg(d)
    m = plan.read_model(d)
    sleeping = launch.resolve(c, launch.Facts(RTX4090, m, host=BIG))
    assert sleeping.standby == "sleep" == sleeping.config.restart.standby
    assert sleeping.standby_configured == AUTO and sleeping.standby_why.startswith(
        "sleeping standby: 1.0 GiB on the GPU at gpu_memory_utilization 0.89")
    assert launch.SLEEP_FLAG in sleeping.argv
    assert sleeping.argv[sleeping.argv.index("--gpu-memory-utilization") + 1] == "0.89"
    util = sleeping.settings["gpu_memory_utilization"]
    assert (util.value, util.origin, util.why) == (0.89, Origin.PLAN, autostandby.LOWERED_WHY)
    assert sleeping.plan is not None and sleeping.plan.fits and sleeping.plan.standby is not None
    assert sleeping.host == BIG
    # a standby beside it: the same choice on the same facts, on the other port
    twin = launch.resolve(c, launch.Facts(RTX4090, m, host=sleeping.host), sleeping.engine)
    assert twin.engine != sleeping.engine and twin.standby == "sleep"
    assert [a for a in twin.argv if a != str(twin.engine.port)] == \
        [a for a in sleeping.argv if a != str(sleeping.engine.port)]
    small = launch.resolve(c, launch.Facts(RTX4090, m, host=host(31.3, 29.3)))
    assert small.standby == "off" and launch.SLEEP_FLAG not in small.argv
    assert small.config.vllm.gpu_memory_utilization == 0.92
    assert small.settings["gpu_memory_utilization"].origin is Origin.CONFIGURED
    assert small.plan is not None and small.plan.standby is None
    assert small.standby_why.startswith("a sleeping standby needs ~32.8 GiB")


def test_an_explicit_mode_resolves_as_before(tmp_path: Path) -> None:
    d = awq_4090(tmp_path)
    m = plan.read_model(d)
    for mode in ("off", "sleep", "awake"):
        got = launch.resolve(cfg(d, restart={"standby": mode}), launch.Facts(RTX4090, m,
                                                                           host=BIG))
        assert got.standby == mode and got.standby_configured == mode
        assert got.standby_why == ""
        assert got.config.vllm.gpu_memory_utilization == 0.92  # never lowered
        assert (launch.SLEEP_FLAG in got.argv) is (mode == "sleep")
    # "sleep" is still refused where it does not fit, with the numbers (test_standby_plan)
    p = launch.resolve(cfg(d, restart={"standby": "sleep"}), launch.Facts(RTX4090, m)).plan
    assert p is not None and p.problems[0][0] == "restart.standby"


def test_the_configured_launch_has_no_facts_so_auto_is_off() -> None:
    got = launch.configured(cfg())
    assert got.standby == "off" and got.standby_why.startswith("no GPU (no GPU part)")
    assert launch.configured(cfg(restart={"standby": "awake"})).standby == "awake"


# --- the preflight's journal line -----------------------------------------------------------


def test_the_preflight_says_autos_choice_once_and_again_when_it_changes(tmp_path: Path) -> None:
    d = awq_4090(tmp_path)
    now: list[plan.HostMemory | str] = [BIG]
    log = Log()
    parts = gpu.GpuParts(log, env={}, host_memory=lambda: now[0])
    c = cfg(d, gpu={"memory_gib": 23.64, "state_directory": str(tmp_path / "state")})

    def preflight() -> PreflightResult:
        res = PreflightResult()
        parts.check(parts.launch(c), res)
        return res

    assert preflight().ok
    said = log.named("standby_auto")
    assert len(said) == 1 and said[0]["mode"] == "sleep"
    assert said[0]["gpu_memory_utilization"] == 0.89
    assert said[0]["why"].startswith("sleeping standby: 1.0 GiB on the GPU")
    assert log.named("standby_plan")[0]["host_room_gib"] == 123.7  # judged on the same facts
    assert preflight().ok and len(log.named("standby_auto")) == 1  # a restart: the same
    now[0] = host(31.3, 29.3)
    assert preflight().ok
    assert [e["mode"] for e in log.named("standby_auto")] == ["sleep", "off"]
    assert "gpu_memory_utilization" not in log.named("standby_auto")[-1]
    explicit = gpu.GpuParts(Log(), env={}, host_memory=lambda: BIG)
    explicit.check(explicit.launch(cfg(d, restart={"standby": "off"})), PreflightResult())
    assert not explicit.log.named("standby_auto")


# --- the keeper follows the serving launch ----------------------------------------------------


class PlannedGpu(CheckedGpu):
    """The do-nothing GPU part resolving launches for real on a 4090 with the AWQ model and a
    host of the test's choosing (read "now" unless a launch's own host is handed in)."""

    def __init__(self, model: plan.ModelFacts, now: plan.HostMemory | str) -> None:
        super().__init__()
        self.model = model
        self.now = now
        self.asked: list[tuple[Endpoint | None, plan.HostMemory | str | None]] = []

    def launch(self, cfg: Config, beside: Endpoint | None = None,
               host: plan.HostMemory | str | None = None) -> Launch:
        self.asked.append((beside, host))
        facts = launch.Facts(RTX4090, self.model, host=self.now if host is None else host)
        return launch.resolve(cfg, facts, beside)


def harness(model: plan.ModelFacts, now: plan.HostMemory | str) -> tuple[StandbyHarness,
                                                                          PlannedGpu]:
    h = StandbyHarness(AUTO, {"vllm": {"model": model.path}})
    fake = PlannedGpu(model, now)
    h.sup.p.gpu = fake
    return h, fake


def test_the_keeper_takes_the_mode_the_serving_launch_resolved(awq: plan.ModelFacts) -> None:
    h, fake = harness(awq, BIG)
    assert h.sup.keeper.mode == "off"  # as configured: auto, nothing resolved yet
    h.run_until(S.READY)
    assert h.sup.launch.standby == "sleep" and h.sup.keeper.mode == "sleep"
    sb = h.sup.snapshot()["standby"]
    assert (sb["mode"], sb["configured"]) == ("sleep", AUTO)
    assert sb["why"].startswith("sleeping standby: 1.0 GiB on the GPU")
    h.until(lambda: h.sup.keeper.ready)
    # the standby was resolved beside the serving engine, on the serving launch's host facts
    beside, given = fake.asked[-1]
    assert beside == h.sup.launch.engine and given is h.sup.launch.host
    standby = h.sup.keeper.run
    assert standby is not None and standby.launch.standby == "sleep"
    assert standby.launch.engine.port == ENGINE + 1
    assert launch.SLEEP_FLAG in standby.launch.argv


def test_a_later_launch_that_chooses_off_discards_the_standby(awq: plan.ModelFacts) -> None:
    h, fake = harness(awq, BIG)
    h.standby_ready()
    fake.now = host(31.3, 29.3)  # the box got smaller meanwhile (a restart re-reads it)
    h.probe_of(ENGINE).controls.clear()
    h.sup.inbox.deliver(signal.SIGHUP)  # a reload of the same config: on the same facts
    h.reload_to = h.sup.cfg
    h.step(0.1)
    assert h.sup.state is S.READY and h.sup.keeper.ready and not h.log.named(
        "restart_for_reload")
    assert all(given is h.sup.launch.host for _, given in fake.asked[-2:])
    # an OOM is not the standby's: the normal restart, whose launch reads the host again
    h.children[0].exit(1, ["torch.OutOfMemoryError: CUDA out of memory"])
    h.until(lambda: h.sup.state is S.READY)
    assert h.sup.launch.standby == "off" and h.sup.keeper.mode == "off"
    assert h.sup.keeper.run is None and launch.SLEEP_FLAG not in h.sup.launch.argv
    assert h.sup.snapshot()["standby"]["why"].startswith("a sleeping standby needs ~32.8 GiB")
    engines = len(h.children)
    h.step(1.0, 30)  # quiet for longer than standby_quiet: no build with the standby off
    assert len(h.children) == engines and h.sup.state is S.READY


def test_a_reload_compares_the_resolved_modes(awq: plan.ModelFacts) -> None:
    h, _ = harness(awq, BIG)
    h.run_until(S.READY)
    h.reload_to = dataclasses.replace(
        h.sup.cfg, restart=dataclasses.replace(h.sup.cfg.restart, standby="sleep"))
    h.sup.inbox.deliver(signal.SIGHUP)
    h.step(0.1)
    assert not h.log.named("reload_refused")
    # the same mode, but explicit "sleep" keeps the default 0.92 (auto lowered it to 0.89):
    # another launch, so a restart, and the keeper's mode is the same "sleep"
    assert h.sup.state is S.RESTARTING and h.sup.keeper.mode == "sleep"
    assert "--gpu-memory-utilization 0.89 -> 0.92" in h.failure.detail
    h.run_until(S.READY)
    h.reload_to = dataclasses.replace(
        h.sup.cfg, restart=dataclasses.replace(h.sup.cfg.restart, standby="auto"))
    h.sup.inbox.deliver(signal.SIGHUP)
    h.step(0.1)
    assert h.sup.state is S.RESTARTING and h.sup.keeper.mode == "sleep"
    h.standby_ready()
    # and to off: the resolved mode changes, the keeper with it, its standby discarded
    h.reload_to = dataclasses.replace(
        h.sup.cfg, restart=dataclasses.replace(h.sup.cfg.restart, standby="off"))
    h.sup.inbox.deliver(signal.SIGHUP)
    h.step(0.1)
    assert h.sup.keeper.mode == "off" and h.sup.state is S.RESTARTING
    assert h.log.named("standby_discarded")[-1]["reason"] == "restart.standby = 'off' now"
    assert "--enable-sleep-mode on -> (none)" in h.failure.detail


# --- what the commands show -------------------------------------------------------------------


def plan_conf(tmp_path: Path, model: Path, extra: str = "") -> Path:
    f = tmp_path / "q.toml"
    f.write_text(f'[vllm]\nmodel = "{model}"\n{extra}'
                 f'[gpu]\nstate_directory = "{tmp_path / "state"}"\n')
    return f


def test_plan_says_what_auto_chose_and_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    from qwen4090.commandline.cli import main

    d = awq_4090(tmp_path)
    f = plan_conf(tmp_path, d)
    monkeypatch.setattr(plan, "host_memory", lambda: host(62.7, 60.7))
    assert main(["plan", "-c", str(f), "--gpu-memory", "23.64"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("standby   restart.standby = \"auto"))
    assert line == ('standby   restart.standby = "auto" -> sleep: sleeping standby: 1.0 GiB on '
                    "the GPU at gpu_memory_utilization 0.89 (from 0.92, 69,200 KV tokens "
                    "instead of 71,232), ~32.8 GiB of host memory of 62.7 GiB (60.7 GiB "
                    "available) (vllm.gpu_memory_utilization 0.89: room for a sleeping "
                    "standby (restart.standby = auto))")
    assert "+ sleeping standby" in out and "62.70 GiB of RAM, 60.70 GiB available now" in out
    assert "--gpu-memory-utilization 0.89" in out and "--enable-sleep-mode" in out
    assert main(["plan", "-c", str(f), "--gpu-memory", "23.64", "--json"]) == 0
    js = json.loads(capsys.readouterr().out)
    assert js["standby_choice"]["configured"] == AUTO and js["standby_choice"]["mode"] == "sleep"
    assert js["standby_choice"]["gpu_memory_utilization"] == 0.89
    assert js["standby_choice"]["why"].startswith("sleeping standby: 1.0 GiB on the GPU")
    assert js["settings"]["gpu_memory_utilization"]["source"] == "auto"
    assert js["standby"]["host_total_bytes"] == int(62.7 * GIB)
    monkeypatch.setattr(plan, "host_memory", lambda: host(31.3, 29.3))
    assert main(["plan", "-c", str(f), "--gpu-memory", "23.64"]) == 0
    out = capsys.readouterr().out
    assert 'standby   restart.standby = "auto" -> off: a sleeping standby needs ~32.8 GiB of ' \
           "host memory" in out
    assert "--enable-sleep-mode" not in out and "+ sleeping standby" not in out
    explicit = plan_conf(tmp_path, d, '[restart]\nstandby = "off"\n')
    assert main(["plan", "-c", str(explicit), "--gpu-memory", "23.64", "--json"]) == 0
    js = json.loads(capsys.readouterr().out)
    assert js["standby_choice"] == {"configured": "off", "mode": "off", "why": "",
                                    "gpu_memory_utilization": None}


def test_status_says_why_auto_is_off(capsys: pytest.CaptureFixture[str]) -> None:
    from qwen4090.commandline import statuscmd

    doc: dict[str, Any] = {"state": "ready", "standby": {
        "mode": "off", "configured": "auto", "state": "none",
        "why": "no GPU (gpu.enabled = off): sleep mode needs CUDA"}}
    text = statuscmd.summary(doc, now=0.0)
    assert '  standby   off (restart.standby = "auto": no GPU (gpu.enabled = off): sleep mode ' \
           "needs CUDA)" in text.splitlines()
    off = {**doc, "standby": {**doc["standby"], "configured": "off"}}
    assert "standby" not in statuscmd.summary(off, now=0.0)


def test_check_config_says_auto_is_chosen_at_each_start(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from qwen4090.commandline.cli import main
    # where the package is installed (the autopkgtest) the qwen4090 user exists, and
    # check-config as root would hold pytest's tmp_path against it (test_config.py does so too)
    monkeypatch.setenv("QWEN4090_SERVICE_USER", "")

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    f = tmp_path / "q.toml"
    f.write_text(f'[vllm]\nmodel = "{model}"\ncommand = ["{sys.executable}"]\n')
    assert main(["check-config", "--config", str(f)]) == 0
    assert "  standby  auto: sleep or off, chosen at each start of vLLM" in \
        capsys.readouterr().out


# --- README's table -----------------------------------------------------------------------------

README = Path(__file__).resolve().parents[2] / "README.md"
TABLE_BEGIN = ("<!-- auto-standby-table: computed by tests/unit/test_autostandby.py; do not "
               "edit -->\n")
TABLE_END = "<!-- /auto-standby-table -->"
# MemTotal as Linux shows it on boxes of 32, 64 and 128 GB (the kernel and the firmware keep
# the rest), and such a box otherwise idle: 2 GiB in use
RAM = (("32 GB", 31.3), ("64 GB", 62.7), ("128 GB", 125.7))


def auto_table(model: Path) -> str:
    """What auto chooses on an RTX 4090 with Qwen3-14B-AWQ at the shipped settings, by RAM."""
    from qwen4090.settings.config import load

    shipped = load(README.parent / "etc" / "qwen4090" / "qwen4090.toml")  # the shipped settings
    c = dataclasses.replace(shipped, vllm=dataclasses.replace(shipped.vllm, model=str(model)))
    m = plan.read_model(model)
    sleeping = plan.make_plan(dataclasses.replace(c, restart=dataclasses.replace(
        c.restart, standby="sleep")), m, RTX4090).standby
    assert sleeping is not None
    need = sleeping.host_bytes / GIB
    rows = ["| RAM (MemTotal) | auto chooses | gpu_memory_utilization | KV tokens | host memory "
            "a sleeping standby needs / 75 % of MemTotal |",
            "|---|---|---|---|---|"]
    for name, total in RAM:
        got = launch.resolve(c, launch.Facts(RTX4090, m, host=host(total, total - 2)))
        assert got.plan is not None
        util = got.settings["gpu_memory_utilization"]
        shown = f"{util.value:g}" + (" (lowered by auto)" if util.origin is Origin.PLAN else "")
        rows.append(f"| {name} ({total:.1f} GiB) | {got.standby} | {shown} | "
                    f"{got.plan.kv_tokens:,} | {need:.1f} / {autostandby.HOST_SHARE * total:.1f} "
                    "GiB |")
    return "\n".join(rows) + "\n"


def test_readmes_table_is_what_auto_chooses(tmp_path: Path) -> None:
    table = auto_table(awq_4090(tmp_path))
    text = README.read_text()
    start = text.index(TABLE_BEGIN) + len(TABLE_BEGIN)
    assert text[start:text.index(TABLE_END, start)] == table, \
        f"README's auto-standby table is stale; it is now:\n{table}"
    # what the table says, in words (the question)
    lines = table.splitlines()[2:]
    assert [line.split(" | ")[1] for line in lines] == ["off", "sleep", "sleep"]
