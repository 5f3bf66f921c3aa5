"""No file descriptor left is no verdict (issue 28.3): the soft limit raised at start, and every
look that finds none says "cannot tell" instead of judging the engine, refusing a launch or
ending the loop.

The looks are tried under a real EMFILE: a child interpreter lowers its own RLIMIT_NOFILE and
fills what is left with /dev/null, then looks at a real process group, a real port, a real key
file and a real socket (one run, read by several tests).  The supervisor's side runs on the
fakes of test_supervisor.
"""

from __future__ import annotations

import errno
import json
import os
import resource
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_supervisor import Harness
from tests.support.fakes import FakeFront, Log

import qwen4090
from qwen4090.base import fdlimit
from qwen4090.base.states import State
from qwen4090.decide.policy import Cause
from qwen4090.decide.results import CompletionResult, HealthResult, MetricsResult, PreflightResult
from qwen4090.launching import launchvalue, preflight
from qwen4090.running.starter import FD_RETRY
from qwen4090.settings.config import from_dict

EMFILE = OSError(errno.EMFILE, os.strerror(errno.EMFILE))

# --- the limit --------------------------------------------------------------------------------


@pytest.fixture
def low_soft_limit() -> Iterator[int]:
    """The soft limit lowered to 256 for the test (put back after): the hard limit it may
    rise to."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= 256:
        pytest.skip(f"the hard limit ({hard}) leaves nothing to raise")
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    try:
        yield hard
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_raise_soft_takes_the_soft_limit_to_the_hard_one_and_says_so(low_soft_limit: int
                                                                      ) -> None:
    log = Log()
    got = fdlimit.raise_soft(log)
    want = fdlimit._ceiling() if low_soft_limit == resource.RLIM_INFINITY else low_soft_limit
    assert got == want == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    assert log.named("fd_limit") == [{"soft": want, "hard": low_soft_limit, "was": 256,
                                      "reserve": fdlimit.FD_RESERVE}]


def test_raise_soft_with_the_soft_limit_at_the_hard_one_changes_nothing() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        fdlimit.raise_soft()
    assert fdlimit.raise_soft() == fdlimit.soft_limit()
    assert resource.getrlimit(resource.RLIMIT_NOFILE) == (max(soft, hard), hard)


def test_no_file_is_found_through_a_config_error_raised_from_none(tmp_path: Path) -> None:
    from qwen4090.settings.config import ConfigError

    def read() -> None:
        try:
            raise OSError(errno.EMFILE, "Too many open files")
        except OSError as e:
            raise ConfigError(None, "vllm.api_key_file", f"cannot read: {e.strerror}") from None

    with pytest.raises(ConfigError) as info:
        read()
    assert fdlimit.exhausted(info.value)
    assert fdlimit.exhausted(OSError(errno.ENFILE, "system"))
    assert not fdlimit.exhausted(OSError(errno.ENOENT, "gone"))
    assert not fdlimit.exhausted(ConfigError(None, "vllm.model", "no such directory"))


def test_pressure_says_one_line_per_burst() -> None:
    t = [0.0]
    log = Log()
    p = fdlimit.Pressure(log, clock=lambda: t[0])
    for _ in range(50):
        p.note("somewhere", EMFILE)
        t[0] += 0.1  # a look every 0.1 s: one burst
    assert len(log.named("fd_pressure")) == 1 and p.active()
    t[0] += fdlimit.QUIET_AFTER
    assert not p.active()
    p.note("elsewhere", "OSError: [Errno 24] Too many open files")
    lines = log.named("fd_pressure")
    assert len(lines) == 2 and lines[1]["missed_last_burst"] == 50
    assert lines[1]["where"] == "elsewhere"


# --- the looks under a real EMFILE ------------------------------------------------------------

LOOKS = r"""
import errno, json, os, resource, signal, socket, sys, time
from pathlib import Path
from qwen4090.engine import child
from qwen4090.base import fdlimit
from qwen4090.launching import instance, preflight
from qwen4090.settings.config import from_dict
from qwen4090.probes.http import VllmProbe

class Log:
    def __init__(self):
        self.events = []
    def __getattr__(self, level):
        return lambda event, **kw: self.events.append(event)

log = Log()
fdlimit.PRESSURE = fdlimit.Pressure(log)
tmp = Path(sys.argv[1])
key = tmp / "api_key"
key.write_text("sk-test-key\n")
key.chmod(0o600)
held = socket.socket()
held.bind(("127.0.0.1", 0))
held.listen(8)
port = held.getsockname()[1]
free = socket.socket()
free.bind(("127.0.0.1", 0))
free_port = free.getsockname()[1]
free.close()
cfg = from_dict({"vllm": {"host": "127.0.0.1", "port": free_port,
                          "api_key_file": str(key)}})
# a group whose leader is named like vLLM's EngineCore
eng = child.VllmChild([sys.executable, "-c", "import time; time.sleep(60)", "EngineCore_DP0"],
                      dict(os.environ), lambda stream, line, ending: None)
deadline = time.monotonic() + 20
while eng.engine_pids() != [eng.pid]:
    assert time.monotonic() < deadline, "the engine never showed its name"
    time.sleep(0.05)
out = {"before": eng.engine_gone()}
inst = instance.Instance(tmp, "127.0.0.1", port, log)

soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 16, hard))
filler = []
try:
    while True:
        filler.append(os.open("/dev/null", os.O_RDONLY))
except OSError as e:
    assert e.errno == errno.EMFILE, e

out["engine_gone"] = eng.engine_gone()
out["members"] = eng.group_members()
out["alive"] = eng.group_alive()
out["engines"] = eng.engine_pids()
owner = inst.owner(eng, "127.0.0.1", port)
out["owner"] = [owner.ours, owner.holder]
try:
    out["holder"] = inst.holder("127.0.0.1", free_port)
except OSError as e:
    out["holder"] = f"raised errno {e.errno}"
res = preflight.run_checks(cfg, [preflight.check_api_key, preflight.check_port])
out["preflight"] = [res.fatal is not None, res.transient, res.unseen.errno if res.unseen else None,
                    res.ok]
health = VllmProbe("127.0.0.1", port, "m").health(1.0)
out["health"] = [health.ok, health.unseen]
try:
    child.spawn(["true"], cfg, lambda stream, line, ending: None, env={})
    out["spawn"] = "spawned"
except Exception as e:
    out["spawn"] = fdlimit.exhausted(e)

for fd in filler:
    os.close(fd)
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
out["fd_pressure"] = log.events.count("fd_pressure")
# with files again, the looks judge again
out["holder_after"] = inst.holder("127.0.0.1", port) is not None
eng.signal_group(signal.SIGKILL)
while eng.poll() is None:
    time.sleep(0.01)
out["engine_gone_after"] = eng.engine_gone()
out["alive_after"] = eng.group_alive()
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def looks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """What each look said in a child interpreter with no file descriptor left."""
    tmp = tmp_path_factory.mktemp("emfile")
    daemon = str(Path(qwen4090.__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": daemon}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(LOOKS), str(tmp)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    found: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return found


def test_the_engine_watch_that_cannot_read_proc_says_alive_not_dead(looks: dict[str, Any]
                                                                     ) -> None:
    # the false engine_died: the read of /proc/PID/stat failed with EMFILE
    assert looks["before"] is None
    assert looks["engine_gone"] is None
    assert looks["engine_gone_after"] is not None  # and a real death is still seen


def test_the_group_that_cannot_be_walked_is_alive_while_the_kernel_says_so(
        looks: dict[str, Any]) -> None:
    assert looks["members"] and looks["alive"] is True
    assert looks["engines"]  # "no EngineCore left" would hurry a stop's SIGKILL
    assert looks["alive_after"] is False


def test_the_port_owner_that_cannot_be_looked_up_is_unknown_not_a_stranger(
        looks: dict[str, Any]) -> None:
    ours, holder = looks["owner"]
    assert ours is None and "no file descriptor" in holder


def test_a_preflight_that_cannot_look_is_unseen_not_refused(looks: dict[str, Any]) -> None:
    fatal, transient, unseen, ok = looks["preflight"]
    assert (fatal, transient, unseen, ok) == (False, None, errno.EMFILE, False)
    assert looks["holder"] == f"raised errno {errno.EMFILE}"  # neither free nor held
    assert looks["holder_after"] is True
    assert looks["spawn"] is True  # the supervisor tells it from a bad vllm.command


def test_a_probe_that_cannot_ask_says_unseen(looks: dict[str, Any]) -> None:
    assert looks["health"] == [False, True]


def test_the_looks_of_one_burst_are_said_once(looks: dict[str, Any]) -> None:
    assert looks["fd_pressure"] == 1


def test_check_port_and_the_key_file_each_say_unseen() -> None:
    cfg = from_dict({})
    at = launchvalue.engine_endpoint(cfg)
    for check in (lambda c, r: preflight.check_port(c, r, at), preflight.check_api_key):
        def no_file(c: Any, r: PreflightResult) -> None:
            raise OSError(errno.ENFILE, "Too many open files in system")
        res = preflight.run_checks(cfg, [no_file, check])
        assert res.unseen is not None and res.unseen.errno == errno.ENFILE and not res.ok


# --- the supervisor ---------------------------------------------------------------------------


@pytest.fixture
def pressure(monkeypatch: pytest.MonkeyPatch) -> Log:
    """The process's Pressure with a fresh burst, its lines in a Log."""
    log = Log()
    monkeypatch.setattr(fdlimit, "PRESSURE", fdlimit.Pressure(log))
    return log


def test_a_preflight_that_cannot_look_runs_again_without_counting_a_failure(pressure: Log
                                                                            ) -> None:
    answers = [PreflightResult(unseen=EMFILE), PreflightResult(unseen=EMFILE)]
    h = Harness(preflight=lambda launch: answers.pop(0) if answers else PreflightResult())
    h.step()
    assert h.sup.state is State.PREFLIGHT and not h.children and h.sup.restarts.failure is None
    assert h.sup.next_wakeup(h.clock.t) <= FD_RETRY
    h.step(FD_RETRY / 2)
    assert len(answers) == 1  # not before FD_RETRY
    h.step(FD_RETRY / 2)
    assert h.sup.state is State.PREFLIGHT and not answers
    h.step(FD_RETRY)
    assert h.sup.state is State.STARTING and len(h.children) == 1
    assert h.sup.restarts.crashes.restarts == 0 and h.sup.exit_code is None
    assert len(pressure.named("fd_pressure")) == 1
    assert "vllm_failed" not in h.log.names() and "giving_up" not in h.log.names()


@pytest.mark.parametrize("error", [EMFILE, "key"])
def test_a_spawn_without_a_file_descriptor_is_no_config_error(pressure: Log, error: Any
                                                              ) -> None:
    from qwen4090.settings.config import ConfigError

    h = Harness()
    spawn = h.sup.p.spawn
    failures = [1]

    def no_file(launch: Any) -> Any:
        if failures:
            failures.pop()
            if error == "key":  # config.read_secret: the OSError inside a ConfigError
                try:
                    raise OSError(errno.EMFILE, "Too many open files")
                except OSError as e:
                    raise ConfigError(None, "vllm.api_key_file", str(e)) from None
            raise error
        return spawn(launch)

    h.sup.p.spawn = no_file
    h.step()
    assert h.sup.state is State.PREFLIGHT and h.sup.exit_code is None
    h.step(FD_RETRY)
    assert h.sup.state is State.STARTING and h.sup.restarts.crashes.restarts == 0


def test_an_unseen_poll_or_canary_is_no_verdict(pressure: Log) -> None:
    h = Harness()
    h.run_until(State.READY)
    run, w = h.run, h.cfg.watch
    unseen = HealthResult(False, None, 0.0, "OSError: [Errno 24] Too many open files",
                          unseen=True)
    for _ in range(10):  # well past unhealthy_timeout
        h.clock.t += 1.0
        assert run.on_poll(h.clock.t, (unseen, MetricsResult(False, unseen=True)), h.clock.t,
                           State.READY, w, None) == []
    canary = CompletionResult(False, None, 0.0, 0, unseen.error, unseen=True)
    assert run.on_canary((MetricsResult(False), canary, MetricsResult(False))) is None
    assert "health_failed" not in h.log.names() and "canary_failed" not in h.log.names()
    assert len(pressure.named("fd_pressure")) == 1


def test_a_step_that_finds_no_file_descriptor_is_left_for_the_next(pressure: Log) -> None:
    class Starved(FakeFront):
        """The front's sample (read by the heartbeat's status line) fails once."""

        fail = True

        def sample(self) -> Any:
            if self.fail:
                self.fail = False
                raise OSError(errno.EMFILE, "Too many open files")
            return super().sample()

    front = Starved()
    h = Harness(front=front)
    h.run_until(State.READY)
    front.fail = True
    h.step(0.25)  # no exception out of the loop's step: cli would exit 70
    assert h.sup.state is State.READY
    assert len(pressure.named("fd_pressure")) == 1
    h.child.exit(1)
    h.step(0.25)
    assert h.sup.state is State.RESTARTING and h.failure.cause is Cause.CRASH


def test_other_errors_still_end_the_loop() -> None:
    h = Harness(preflight=lambda launch: (_ for _ in ()).throw(OSError(errno.EIO, "I/O")))
    with pytest.raises(OSError):
        h.sup.step()


# --- the one-shot questions: asked again while no file descriptor is left ----------------------


class Starved:
    """A probe that cannot ask ``unseen`` times, then answers; its clock moves with sleeps."""

    def __init__(self, unseen: int) -> None:
        self.unseen = unseen
        self.t = 0.0
        self.asked: list[float] = []  # the timeout of each try

    def sleep(self, seconds: float) -> None:
        self.t += seconds

    def control(self, path: str, timeout: float) -> HealthResult:
        self.asked.append(timeout)
        if len(self.asked) <= self.unseen:
            return HealthResult(False, None, 0.0, "OSError: [Errno 24] Too many open files",
                                unseen=True)
        return HealthResult(True, 200, 0.01)

    def complete(self, prompt: Any, max_tokens: int, timeout: float) -> CompletionResult:
        self.asked.append(timeout)
        if len(self.asked) <= self.unseen:
            return CompletionResult(False, None, 0.0, 0, "OSError: [Errno 24]", unseen=True)
        return CompletionResult(True, 0.01, 0.02, 1, text="ok")


def test_a_patient_probe_asks_again_within_the_timeout() -> None:
    from qwen4090.decide.results import UNSEEN_RETRY, Patient

    p = Starved(unseen=3)
    res = Patient(p, clock=lambda: p.t, sleep=p.sleep).control("/wake_up", 10.0)  # type: ignore[arg-type]
    assert res.ok and len(p.asked) == 4 and p.t == 3 * UNSEEN_RETRY
    assert p.asked[0] == 10.0 and p.asked[-1] == pytest.approx(10.0 - 3 * UNSEEN_RETRY)


def test_a_patient_probe_gives_up_with_its_timeout() -> None:
    from qwen4090.decide.results import Patient

    p = Starved(unseen=1000)
    res = Patient(p, clock=lambda: p.t, sleep=p.sleep).complete([1], 1, 3.0)  # type: ignore[arg-type]
    assert not res.ok and res.unseen and p.t <= 3.0


def test_the_wake_of_a_sleeping_engine_is_asked_again_not_failed(monkeypatch: pytest.MonkeyPatch
                                                                  ) -> None:
    from qwen4090.probes import http
    from qwen4090.running import standby

    p = Starved(unseen=2)
    monkeypatch.setattr(http.time, "sleep", p.sleep)
    assert standby.control_job(p, "/wake_up", 30.0)().ok  # type: ignore[arg-type]
    assert standby.check_job(Starved(unseen=2), 30.0)().ok  # type: ignore[arg-type]
