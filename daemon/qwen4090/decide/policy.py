"""Pure decisions: backoff, the crash-loop budget, why vLLM exited, hang verdicts, log levels.

Nothing here does I/O or reads a clock: callers pass ``now`` (monotonic seconds) and the
facts they observed, so every rule is tested with plain values.  vLLM's own texts (its error
lines, the OOM table) are vllmfacts'; this module only decides what they mean for a restart.
"""

from __future__ import annotations

import enum
import math
import random
import signal
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from qwen4090.base import vllmfacts as vf
from qwen4090.settings.config import Config, RestartConfig

EX_OK = 0
EX_GPU = 69  # EX_UNAVAILABLE: a fatal Xid; the GPU needs a reset or a reboot, not retried
EX_SOFTWARE = 70  # an internal error of ours
EX_TEMPFAIL = 75  # crash loop: let systemd's restart policy decide
EX_CONFIG = 78  # configuration error: never retried (RestartPreventExitStatus=78)


@dataclass(frozen=True)
class GiveUp:
    """The daemon ends: its exit code (the classes above) and why."""

    code: int
    why: str

EXIT_CODES = {
    EX_OK: "stopped cleanly (SIGTERM/SIGINT), or a command succeeded",
    1: "a command failed (e.g. `status`: not ready)",
    3: "`status`: the daemon is not running (no answer from its status endpoint, or it "
       "stopped or failed)",
    EX_SOFTWARE: "internal error in qwen4090 (a bug: please report it)",
    EX_TEMPFAIL: "vLLM kept failing: crash-loop budget spent (systemd may restart us)",
    EX_CONFIG: "configuration error (bad key or value, unreadable file, or another qwen4090 "
               "already runs vLLM on this port); fix it, not retried",
    EX_GPU: "the GPU reported a fatal Xid error: it needs a reset or a reboot, not retried",
}


class Cause(enum.Enum):
    """Why a vLLM process ended (or was ended by us)."""

    CRASH = "crash"  # exited with a non-zero code
    SIGNAL = "signal"  # killed by a signal we did not send
    EXIT_0 = "exit_0"  # exited 0 by itself: still a failure (e.g. its EngineCore died)
    OOM = "oom"  # out of memory, by vLLM's own error texts
    CONFIG = "config"  # vLLM refused its arguments: retrying cannot help
    HANG = "hang"  # requests in flight, no token progress
    CANARY = "canary"  # an idle canary request did not finish in time
    UNHEALTHY = "unhealthy"  # /health kept failing
    LOAD_TIMEOUT = "load_timeout"  # /health never answered 200 in time
    WARMUP_FAILED = "warmup_failed"
    PREFLIGHT = "preflight"  # something outside vLLM is not ready yet (port busy, ...)
    RELOAD = "reload"  # a controlled restart after SIGHUP changed vLLM settings
    GPU_FATAL = "gpu_fatal"  # an Xid that needs a GPU reset or a reboot (xid.py)
    PORT_HELD = "port_held"  # vLLM could not listen: another process has its port (8.4)
    ENGINE_DEAD = "engine_dead"  # vLLM said its EngineCore died; its API server still ran


# Causes that are not failures of vLLM: they do not count against the budget.
# A held port is waited on by the supervisor (bounded by restart.port_wait), not counted.
NOT_FAILURES = frozenset({Cause.RELOAD, Cause.PORT_HELD})


@dataclass(frozen=True)
class ExitVerdict:
    cause: Cause
    detail: str
    retry: bool  # False: restarting cannot help (exit with EX_CONFIG)


_PORT_LINES = 40  # its traceback's last lines: an old warning must not decide


def classify_exit(returncode: int, tail: Iterable[str], requested: Cause | None = None,
                  oom_evidence: str | None = None) -> ExitVerdict:
    """Turn a wait status and the last lines vLLM printed into a cause.

    ``requested`` is the reason we stopped it ourselves (hang, reload, ...), which wins:
    the SIGTERM we sent says nothing about why we sent it.  ``oom_evidence`` is what the
    kernel said about its OOM killer (cgroup memory events, kernel log), or None: a SIGKILL
    is blamed on the OOM killer only with evidence, since anyone can send one.
    """
    lines = list(tail)
    if requested is not None:
        return ExitVerdict(requested, f"stopped by qwen4090 ({_status(returncode)})",
                           retry=True)
    # vLLM binds early and listens late: a stranger can take the port in between, and vLLM
    # then dies of it after loading.  Not a crash of vLLM (issue 8.4).
    for line in lines[-_PORT_LINES:]:
        if vf.PORT_IN_USE.search(line):
            return ExitVerdict(Cause.PORT_HELD, _clip(line), retry=True)
    for line in reversed(lines):
        if vf.oom_kind(line) is not None:  # the table ladder.read_oom reads too
            return ExitVerdict(Cause.OOM, _clip(line), retry=True)
    if returncode == 2:
        for line in reversed(lines):
            if vf.ARGPARSE_ERROR.search(line):
                return ExitVerdict(Cause.CONFIG, _clip(line), retry=False)
    if returncode == 0:
        return ExitVerdict(Cause.EXIT_0, "vLLM exited with code 0 by itself; "
                                         + _last_error(lines, "no error line"), retry=True)
    if returncode < 0:
        return ExitVerdict(Cause.SIGNAL, signal_detail(-returncode, oom_evidence), retry=True)
    return ExitVerdict(Cause.CRASH, f"exit code {returncode}: " + _last_error(lines, ""),
                       retry=True)


def engine_dead_verdict(tail: Iterable[str], line: str) -> ExitVerdict:
    """The cause of a failure announced by vLLM's line: out of memory when its own texts say so
    (the ladder must step down), else the EngineCore's death."""
    for text in reversed(list(tail)):
        if vf.oom_kind(text) is not None:  # the table ladder.read_oom reads too
            return ExitVerdict(Cause.OOM, _clip(text), retry=True)
    return ExitVerdict(Cause.ENGINE_DEAD, "vLLM's EngineCore died: " + _clip(line), retry=True)


def signal_detail(signum: int, oom_evidence: str | None) -> str:
    """"killed by SIGKILL", naming the kernel's OOM killer only when the kernel said so."""
    text = f"killed by {_signame(signum)}"
    if signum == signal.SIGKILL and oom_evidence:
        text += f" from the kernel's OOM killer ({oom_evidence})"
    return text


def oom_evidence(kills_before: int | None, kills_after: int | None,
                 kernel_line: str | None) -> str | None:
    """What proves an OOM kill: the cgroup's oom_kill counter moved, or a kernel log line."""
    if kills_before is not None and kills_after is not None and kills_after > kills_before:
        return f"cgroup oom_kill {kills_before} -> {kills_after}"
    if kernel_line:
        return f"kernel: {_clip(kernel_line, 160)}"
    return None


def _status(returncode: int) -> str:
    return f"killed by {_signame(-returncode)}" if returncode < 0 else f"exit code {returncode}"


def _signame(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def _last_error(lines: list[str], default: str) -> str:
    """The most telling error line: the last exception that is not a pointer to another."""
    msgs = [vf.message(line) for line in lines]
    for i in range(len(msgs) - 1, -1, -1):
        msg = msgs[i]
        if vf.EXCEPTION_LINE.match(msg) and not any(p in msg for p in vf.POINTERS):
            if vf.VALIDATION_ERROR in msg:
                # pydantic puts the reason on the next lines ("  Value error, ...")
                msg = " ".join([msg, *(m.strip() for m in msgs[i + 1:i + 3])])
            return _clip(msg)
    for line in reversed(lines):
        if vf.ERRORISH.search(line):
            return _clip(line)
    return default


def _clip(line: str, n: int = 300) -> str:
    line = line.strip()
    return line if len(line) <= n else line[: n - 3] + "..."


# --- restart pacing -------------------------------------------------------------------------


def backoff_delay(consecutive: int, cfg: RestartConfig, rand: random.Random | None = None
                  ) -> float:
    """Seconds to wait before restart number ``consecutive`` (1 = first), with jitter."""
    n = max(consecutive, 1)
    try:
        grown = cfg.backoff_initial * cfg.backoff_factor ** (n - 1)
    except OverflowError:  # after ~1000 slow failures: past a float's range, and backoff_max
        grown = cfg.backoff_max if cfg.backoff_initial > 0 else 0.0
    base = min(cfg.backoff_max, grown)
    if cfg.jitter and base > 0:
        r = (rand or random).uniform(-1.0, 1.0)
        base *= 1.0 + cfg.jitter * r
    return max(0.0, min(base, cfg.backoff_max * (1 + cfg.jitter)))


class RestartBudget:
    """At most ``failures`` failures in any ``window`` seconds; then give up."""

    def __init__(self, failures: int, window: float) -> None:
        self.failures = failures
        self.window = window
        self._times: deque[float] = deque()

    def record(self, now: float) -> None:
        self._times.append(now)
        self._trim(now)

    def count(self, now: float) -> int:
        self._trim(now)
        return len(self._times)

    def exhausted(self, now: float) -> bool:
        return self.count(now) >= self.failures

    def reconfigure(self, failures: int, window: float) -> None:
        self.failures, self.window = failures, window

    def _trim(self, now: float) -> None:
        while self._times and now - self._times[0] > self.window:
            self._times.popleft()


@dataclass
class RestartRecord:
    wall_time: float
    cause: str
    detail: str
    counted: bool


class CrashLoop:
    """The crash-loop account: the restarts so far and their history, the failures in the
    budget's window, and the consecutive failures the backoff grows with (a run that served
    for restart.stable_after starts it over: :meth:`stable`)."""

    def __init__(self, r: RestartConfig) -> None:
        self.restarts = 0
        self.history: deque[RestartRecord] = deque(maxlen=50)
        self.budget = RestartBudget(r.budget_failures, r.budget_window)
        self.consecutive = 0

    def reconfigure(self, r: RestartConfig) -> None:
        self.budget.reconfigure(r.budget_failures, r.budget_window)

    def record(self, now: float, wall: float, v: ExitVerdict) -> bool:
        """A vLLM group is gone after ``v``: True when it counts against the budget."""
        counted = v.cause not in NOT_FAILURES
        self.restarts += 1
        self.history.append(RestartRecord(wall, v.cause.value, v.detail, counted))
        if counted:
            self.budget.record(now)
            self.consecutive += 1
        return counted

    def spent(self, now: float, r: RestartConfig, v: ExitVerdict) -> str | None:
        """Why the daemon gives up (the budget is spent), or None."""
        if not self.budget.exhausted(now):
            return None
        return (f"crash loop: {self.budget.count(now)} failures in {r.budget_window:g}s "
                f"(restart.budget_failures = {r.budget_failures}); last: {v.cause.value}: "
                f"{v.detail}")

    def stable(self) -> bool:
        """A run served for restart.stable_after: the backoff starts over (True if it had
        grown)."""
        grown, self.consecutive = self.consecutive > 0, 0
        return grown


# --- hang verdicts --------------------------------------------------------------------------


@dataclass(frozen=True)
class Progress:
    """What /metrics says about the engine's work."""

    running: float
    waiting: float
    tokens: float  # any counter that grows while the engine makes progress
    moved_at: float | None = None  # when the last of it was seen, if a witness knows (the front)
    # the requests the engine itself surely has: vLLM's running gauge, or with the front the
    # answers under way and the small requests sent (FrontSample.at_engine) -- not a request
    # whose large prompt the API server may still be tokenizing; None: unknown (not busy)
    engine_running: float | None = None
    answered_in: float | None = None  # seconds the /metrics answer took (None: unknown)

    @property
    def busy(self) -> bool:
        return self.running + self.waiting > 0

    @property
    def engine_busy(self) -> bool:
        """The engine surely has requests: a request whose large prompt the API server may
        still be tokenizing (the front counts it in flight; vLLM has not scheduled it) is not
        one of them."""
        return bool(self.engine_running and self.engine_running > 0)


@dataclass(frozen=True)
class HangVerdict:
    stalled: float  # seconds the busy engine has made no progress (0: it moved, or is idle)
    hung: bool  # stalled for the bound (or hang_timeout): fail it over or restart it
    stalling: bool  # stalled for STALL_POLLS polls: DEGRADED, not a hang yet
    bound: float = math.inf  # the stall that counted as a hang at this sample


# The fast hang verdict (issue 30.3).  A hung engine is answered within seconds only if the
# verdict comes from the engine's real step times instead of a fixed minute: a stall counts as
# a hang after HANG_STEP_MULTIPLE x the longest step seen (the warmup's longest prefill, and the
# longest gap between two chunks of one streamed answer the front has relayed in the last
# STEP_WINDOW: the steps as the load makes them now), never below watch.hang_floor and never
# above watch.hang_timeout.  3x: the step's variance under load (longer contexts attend to
# more, the batch adds decodes) plus the poll that must see the counter move.
HANG_STEP_MULTIPLE = 3.0
# The fast verdict also needs a responsive API server: its /metrics answered within this share
# of the bound.  A CPU-starved API server answers late and relays late; its silence is not the
# engine's, so only hang_timeout ends it (zero false takeovers is the harder half).
FAST_ANSWER_SHARE = 0.25


def hang_bound(hang_timeout: float, floor: float, longest_step: float | None,
               longest_gap: float | None) -> float:
    """The stall after which a busy engine whose own gauge says it runs requests is hung:
    HANG_STEP_MULTIPLE x the longest step measured, within [floor, hang_timeout]."""
    step = max(longest_step or 0.0, longest_gap or 0.0)
    return min(hang_timeout, max(floor, HANG_STEP_MULTIPLE * step))


class HangDetector:
    """A hang is: requests running or waiting, and the progress counter flat for the bound.

    vLLM's /health answers 200 while the EngineCore is stopped, so progress is the only truth.
    Two bounds (issue 30.3): the fast one (:func:`hang_bound`, seconds) when vLLM's own gauge
    says the engine runs requests and its /metrics answered promptly; hang_timeout otherwise
    (a request still being tokenized, an API server too slow to tell).  Flat for
    ``STALL_POLLS`` polls (one flat sample can be a long prefill step between two counter
    updates) is only "stalling": DEGRADED, still served.
    """

    STALL_POLLS = 2

    def __init__(self, hang_timeout: float, poll_interval: float = math.inf,
                 floor: float | None = None) -> None:
        self.hang_timeout = hang_timeout
        self.poll_interval = poll_interval
        self.floor = hang_timeout if floor is None else floor  # None: no fast verdict
        self.bound = hang_bound(hang_timeout, self.floor, None, None)  # now (set_steps)
        self._last_tokens: float | None = None
        self._since: float | None = None  # when tokens last changed or the engine was idle
        self._seen: float | None = None  # the last sample
        self._busy = False  # the last sample's

    def reconfigure(self, hang_timeout: float, poll_interval: float,
                    floor: float | None = None) -> None:
        """A reload's [watch] (the stall being timed goes on)."""
        self.hang_timeout, self.poll_interval = hang_timeout, poll_interval
        if floor is not None:
            self.floor = floor
        self.bound = min(max(self.bound, self.floor), hang_timeout)

    def set_steps(self, longest_step: float | None, longest_gap: float | None) -> float:
        """The step times measured now: the fast bound follows them (returned)."""
        self.bound = hang_bound(self.hang_timeout, self.floor, longest_step, longest_gap)
        return self.bound

    def observe(self, now: float, p: Progress) -> float:
        """Record a sample; return how many seconds the busy engine has made no progress.

        Progress seen at a sample happened since the one before; when the front saw its last
        answer byte in between (``moved_at``), the stall is dated from that byte, not from
        this sample: on the H200 a hang was detected up to a poll interval (2 s) late."""
        before, self._seen, self._busy = self._seen, now, p.busy
        if not p.busy or self._last_tokens is None or p.tokens != self._last_tokens \
                or self._since is None:
            moved = self._last_tokens is not None and p.tokens != self._last_tokens
            self._last_tokens = p.tokens
            self._since = now
            if moved and p.busy and p.moved_at is not None and before is not None \
                    and before < p.moved_at <= now:
                self._since = p.moved_at
            return 0.0
        return now - self._since

    def deadline(self) -> float | None:
        """When the stall being timed would become a hang (None before the first sample, and
        while the engine idles: nothing to time).

        The supervisor polls then instead of at its next poll_interval, so a hang is seen
        at its bound after the last progress, not up to one poll later (issue 10).  While the
        engine moves this lies a bound ahead of the last progress seen."""
        if self._since is None or not self._busy:
            return None
        return self._since + min(self.bound, self.hang_timeout)

    def fast(self, p: Progress) -> bool:
        """Whether this sample may end a stall at the fast bound (see the class)."""
        return p.engine_busy and p.answered_in is not None \
            and p.answered_in <= FAST_ANSWER_SHARE * self.bound

    def judge(self, now: float, p: Progress) -> HangVerdict:
        """Record a sample and say what the stall means."""
        stalled = self.observe(now, p)
        bound = min(self.bound, self.hang_timeout) if self.fast(p) else self.hang_timeout
        return HangVerdict(stalled, stalled >= bound,
                           stalled >= self.STALL_POLLS * self.poll_interval, bound)

    def hung(self, now: float, p: Progress) -> bool:
        return self.judge(now, p).hung

    def reset(self) -> None:
        self._last_tokens = None
        self._since = None
        self._seen = None
        self._busy = False


# --- stop and canary verdicts ---------------------------------------------------------------


@dataclass(frozen=True)
class DrainSample:
    """One look at what clients still wait for; None = that source could not tell."""

    clients: int | None  # requests in flight through the front (exact); None: no front
    running: float | None  # vllm:num_requests_running
    waiting: float | None  # vllm:num_requests_waiting


def drain_busy(s: DrainSample | None) -> bool:
    """True while a client may still wait for an answer.

    The front's count is exact: every client request passes it (issue 20.4).  Without the
    front only vLLM's gauges tell, and they miss requests still inside the API server
    (measured: running 0.0 with 8 streams open; docs/reliability.md).  Whatever cannot be told
    counts as busy: the drain deadline, not a failed probe, ends a drain.
    """
    if s is not None and s.clients is not None:
        return s.clients > 0
    if s is None or s.running is None or s.waiting is None:
        return True
    return s.running + s.waiting > 0


def tokens_moved(before: float | None, after: float | None) -> bool:
    """The engine's progress counter grew between two /metrics samples (None = no sample)."""
    return before is not None and after is not None and after > before


def queued_behind_work(timed_out: bool, before: float | None, after: float | None) -> bool:
    """A request of ours that only waited too long while the engine's progress counter moved
    was queued behind other work: the engine is busy, not broken.  An error answer, or a
    timeout with the counters flat or unreadable, is not that."""
    return timed_out and tokens_moved(before, after)


def canary_counts(ok: bool, timed_out: bool, before: float | None, after: float | None) -> bool:
    """Whether a canary result is a failure of vLLM.

    A canary that only waited too long while the token counters moved was queued behind real
    work (measured: 2 running, 29 waiting, canary 30 s late): a busy engine, not a hung one.
    A canary that got an error, or timed out with the counters flat or unreadable, fails.
    """
    if ok:
        return False
    return not queued_behind_work(timed_out, before, after)


# --- warmup under client load (issue 18.4) --------------------------------------------------

# A warmup step's threads are given up this long after their requests' timeout (warmup.py).
WARMUP_JOIN_GRACE = 5.0
# What the warmup may take beyond warmup.timeout + request_timeout: one step's join grace, and
# its two /metrics looks (each watch.health_timeout) with the same again as slack.
WARMUP_OVERRUN_LOOKS = 4


def warmup_bound(cfg: Config) -> float:
    """The longest a warmup can take: a step starts only before warmup.timeout, lasts at most
    request_timeout + WARMUP_JOIN_GRACE, and has its /metrics looks.  The warmup keeps within
    it (warmup.py) and the supervisor's WARMING limit is it (run.Run.start_step): a warmup that
    is still making progress has returned by then.  Here, not in warmup.py, so that the run
    that judges the warmup loads none of the warmup's machinery (issue 29)."""
    w = cfg.warmup
    return (w.timeout + w.request_timeout + WARMUP_JOIN_GRACE
            + WARMUP_OVERRUN_LOOKS * cfg.watch.health_timeout)


def warmup_request_wait(request_timeout: float, left: float, hang_timeout: float,
                        clients_queued: bool) -> float:
    """How long one warmup request may wait.

    With clients' requests already queued (a restart under load: they reach the new vLLM as
    soon as it listens) a warmup request waits behind them, and waiting the whole
    warmup.request_timeout (120 s) teaches nothing: after watch.hang_timeout -- the time the
    serving watch gives a busy engine without progress -- either the tokens moved meanwhile
    (busy: the warmup ends OK, ``queued_behind_work``) or they did not (hung: it fails).
    """
    wait = min(request_timeout, left)
    return min(wait, hang_timeout) if clients_queued else wait


def serving_clients(running: float, waiting: float, before: float | None, after: float | None
                    ) -> bool:
    """Between two warmup steps (none of our requests in flight): requests are in the engine,
    so they are clients', and the progress counter moved since the last look."""
    return running + waiting > 0 and tokens_moved(before, after)


# --- hang_timeout against the longest engine step (issue 18.5) ------------------------------

# One engine step (a prefill of max_num_batched_tokens tokens) moves no counter while it runs,
# so a hang_timeout near it is a false hang on a busy engine (measured on the CPU: one
# 1,500-token prefill ran > 4 s without a token; hang_timeout 4 s restarted it).  3x leaves room
# for the step's variance under load (longer contexts attend to more, the batch adds decodes)
# and for the poll that has to see the counter move: a counter flat for 3 steps is not a step.
SAFE_STEP_MULTIPLE = 3.0


def hang_timeout_risk(hang_timeout: float, longest_step: float | None) -> str | None:
    """The warning when watch.hang_timeout is below SAFE_STEP_MULTIPLE x the longest engine
    step measured (None: no measurement, or safe): one line naming key, value and fix."""
    if longest_step is None or longest_step <= 0:
        return None
    safe = SAFE_STEP_MULTIPLE * longest_step
    if hang_timeout >= safe:
        return None
    return (f"watch.hang_timeout = {hang_timeout:g} is below {SAFE_STEP_MULTIPLE:g} x the "
            f"longest engine step measured by the warmup ({longest_step:.2f}s, a prefill of "
            f"max_num_batched_tokens): one long prefill on a busy engine can look like a hang "
            f"and restart it; raise hang_timeout to at least {safe:.1f} (or lower "
            f"vllm.max_num_batched_tokens)")
