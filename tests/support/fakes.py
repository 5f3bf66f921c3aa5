"""The fakes the unit tests share: a log that records events, a hand-moved clock, the
supervisor's parts (child, probe, notifier, executor) without processes or sockets."""

from __future__ import annotations

import signal
from concurrent.futures import Future
from typing import Any

from qwen4090.base.steering import FrontCommand
from qwen4090.decide.policy import ExitVerdict
from qwen4090.decide.results import FrontSample, PreflightResult
from qwen4090.launching.launch import configured
from qwen4090.launching.launchvalue import Endpoint, Launch
from qwen4090.launching.plan import HostMemory
from qwen4090.probes.http import (
    GENERATION_TOKENS,
    RUNNING,
    WAITING,
    CompletionResult,
    HealthResult,
    MetricsResult,
)
from qwen4090.settings.config import Config


class Clock:
    """A monotonic clock the test moves by hand (``clock.t += 5``)."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class Log:
    """A structlog-shaped logger: every ``log.<level>(event, **fields)`` is recorded as
    ``(level, event, fields)``."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, dict[str, Any]]] = []

    def __getattr__(self, level: str) -> Any:
        return lambda event, **kw: self.events.append((level, event, kw))

    def names(self) -> list[str]:
        return [e for _, e, _ in self.events]

    def named(self, name: str) -> list[dict[str, Any]]:
        return [kw for _, e, kw in self.events if e == name]


class FakeChild:
    next_pid = 100

    def __init__(self) -> None:
        FakeChild.next_pid += 1
        self.pid = FakeChild.next_pid
        self.lines = 0
        self.last_output = 0.0
        self.ending: str | None = None
        self.rc: int | None = None
        self.alive = True
        self.signals: list[int] = []
        self.tail: list[str] = []
        self.ignores_term = False
        self.engine_alive = True  # an EngineCore is in the group
        self.oom: str | None = None  # the kernel's OOM evidence
        self.closed = True  # the output pipes reached EOF
        self.term_stops_engine_only = False  # API server waits for its connections on TERM
        self.kv: tuple[int | None, int | None] = (None, None)  # what vLLM said of its KV cache

    def poll(self) -> int | None:
        return self.rc

    def tail_lines(self) -> list[str]:
        return self.tail

    def output_closed(self) -> bool:
        return self.closed

    def engine_gone(self) -> str | None:
        return None if self.engine_alive or not self.alive else "its EngineCore (pid 0) is gone"

    def engine_pids(self) -> list[int]:
        return [self.pid + 1000] if self.alive and self.engine_alive else []

    def oom_evidence(self) -> str | None:
        return self.oom

    def kv_cache(self) -> tuple[int | None, int | None]:
        return self.kv

    def mark_ending(self, why: str) -> None:
        self.ending = self.ending or why

    def signal_group(self, sig: int) -> bool:
        self.signals.append(sig)
        if sig == signal.SIGTERM and self.term_stops_engine_only:
            self.engine_alive = False
            return True
        if sig == signal.SIGKILL or (sig == signal.SIGTERM and not self.ignores_term):
            if self.rc is None:
                self.rc = -sig
            self.alive = False
        return True

    def group_alive(self) -> bool:
        return self.alive

    def group_members(self) -> list[int]:
        return [self.pid] if self.alive else []

    def exit(self, rc: int, tail: list[str] | None = None) -> None:
        self.rc, self.alive, self.tail = rc, False, tail or []


class FakeFront:
    """The front's counts, set by the test (front.Front without sockets)."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.holding = 0
        self.unanswered = 0
        self.bytes = 0
        self.last_byte_at: float | None = None  # when the last of those bytes came in
        self.longest_gap: float | None = None  # between two chunks of one stream, lately
        self.at_engine = 0  # requests the engine surely has (answers under way, small ones)
        self.draining = True  # front.drain() took effect (it does so on the front's own loop)
        self.commands: list[FrontCommand] = []  # what the supervisor told it, in order

    def command(self, cmd: FrontCommand) -> None:
        self.commands.append(cmd)

    def sample(self) -> FrontSample:
        return FrontSample(self.in_flight, self.holding, self.unanswered, 0.0, self.bytes,
                           True, self.draining, self.last_byte_at, longest_gap=self.longest_gap,
                           at_engine=self.at_engine)


class FakeProbe:
    def __init__(self) -> None:
        self.healthy = True
        self.running = 0.0
        self.waiting = 0.0
        self.tokens = 0.0
        self.tokens_per_metrics = 0.0  # the counter grows by this much at each /metrics read
        self.canary_ok = True
        self.canary_error = False  # an error answer (HTTP 500) instead of a timeout
        self.canaries = 0
        self.metrics_fail = False  # /metrics cannot be read
        self.answer = "the known answer"  # a canary's text (the standby's check compares it)
        self.controls: list[str] = []  # POSTs of /sleep and /wake_up, in order
        self.control_ok = True

    def health(self, timeout: float) -> HealthResult:
        return HealthResult(self.healthy, 200 if self.healthy else None, 0.001,
                            "" if self.healthy else "connection refused")

    def metrics(self, timeout: float) -> MetricsResult:
        if self.metrics_fail:
            return MetricsResult(False, {}, 0.001, "connection refused")
        self.tokens += self.tokens_per_metrics
        return MetricsResult(True, {RUNNING: self.running, WAITING: self.waiting,
                                    GENERATION_TOKENS: self.tokens})

    def complete(self, prompt: Any, max_tokens: int, timeout: float) -> CompletionResult:
        self.canaries += 1
        if self.canary_ok:
            return CompletionResult(True, 0.01, 0.02, 1, text=self.answer)
        if self.canary_error:
            return CompletionResult(False, None, 0.01, 0, "HTTP 500: EngineDeadError")
        return CompletionResult(False, None, timeout, 0, f"no answer within {timeout:g}s",
                                timed_out=True)


    def control(self, path: str, timeout: float) -> HealthResult:
        self.controls.append(path)
        return HealthResult(self.control_ok, 200 if self.control_ok else 500, 0.001,
                            "" if self.control_ok else "HTTP 500: sleep mode is off")


class Notifier:
    """sd_notify without a socket: what was sent, in order."""

    watchdog_interval: float | None = None

    def __init__(self) -> None:
        self.sent: list[str] = []

    def ready(self, status: str) -> bool:
        self.sent += ["READY=1", f"STATUS={status}"]
        return True

    def status(self, status: str) -> bool:
        self.sent.append(f"STATUS={status}")
        return True

    def watchdog(self) -> bool:
        self.sent.append("WATCHDOG=1")
        return True

    def extend_timeout(self, seconds: float) -> bool:
        self.sent.append(f"EXTEND_TIMEOUT_USEC={int(seconds * 1e6)}")
        return True

    def stopping(self, status: str) -> bool:
        self.sent.append("STOPPING=1")
        return True

    def reloading(self) -> bool:
        self.sent.append("RELOADING=1")
        return True


class NoGpu:
    """The do-nothing GPU part: the launch as configured, no checks, no ladder, nothing
    remembered, nothing ever held (the state machine's tests; cli.py always builds GpuParts,
    which also runs the checks that need no GPU).  Not in contracts.py beside the other
    do-nothing parts: it needs launch.py's resolver, which the supervisor must not load."""

    def configured(self, cfg: Config) -> Launch:
        return configured(cfg)

    def launch(self, cfg: Config, beside: Endpoint | None = None,
               host: HostMemory | str | None = None) -> Launch:
        return configured(cfg, beside)

    def preflight(self, chosen: Launch) -> PreflightResult:
        return PreflightResult()

    def held(self, device: int, pids: list[int]) -> str | None:
        return None

    def room(self, device: int, fraction: float) -> bool | None:
        return None

    def remember_kv(self, launched: Launch, tokens: int | None, kv_bytes: int | None) -> bool:
        return False

    def forget_kv(self, launched: Launch) -> bool:
        return False

    def step_down(self, launched: Launch, cfg: Config, verdict: ExitVerdict, tail: list[str]
                  ) -> list[str] | None:
        return None


class CheckedGpu(NoGpu):
    """The do-nothing GPU part with a preflight of the test's choosing."""

    def __init__(self, preflight: Any = None) -> None:
        self.check = preflight or (lambda launch: PreflightResult())

    def preflight(self, chosen: Launch) -> PreflightResult:
        result: PreflightResult = self.check(chosen)
        return result


class Inline:
    """Runs a task at once: results are ready for the next step's harvest.

    ``hold(fn)`` True keeps that task in flight (a probe that never gets its answer)."""

    def __init__(self) -> None:
        self.hold: Any = lambda fn: False
        self.held: list[Any] = []

    def submit(self, fn: Any, /, *args: Any) -> Future[Any]:
        f: Future[Any] = Future()
        if self.hold(fn):
            self.held.append(fn)
            return f
        f.set_result(fn(*args))
        return f


# A Qwen3-14B config.json (the GPU kit's model): the plan's arithmetic without the model.
QWEN3_14B: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"], "head_dim": 128, "hidden_size": 5120,
    "intermediate_size": 17408, "max_position_embeddings": 40960, "num_attention_heads": 40,
    "num_hidden_layers": 40, "num_key_value_heads": 8, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "vocab_size": 151936,
}
