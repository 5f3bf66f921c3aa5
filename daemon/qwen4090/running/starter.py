"""The serving engine's start (issue 29.3): the preflight, the wait for a port another process
holds (portguard.py), the spawn, and a look again later when no file descriptor was left to
look with (issue 28.3).  Each step returns what the supervisor must do: the row that started,
giving up, a failure, or nothing yet."""

from __future__ import annotations

from dataclasses import dataclass

from qwen4090.base import fdlimit
from qwen4090.decide.policy import EX_CONFIG, Cause, ExitVerdict, GiveUp
from qwen4090.decide.results import PortOwner
from qwen4090.launching.launchvalue import Launch, engine_endpoint
from qwen4090.parts.contracts import LogLike, Parts, PortsLike
from qwen4090.running.portguard import PortGuard
from qwen4090.running.run import Run
from qwen4090.settings.config import Config, ConfigError

FD_RETRY = 2.0  # a preflight that found no file descriptor to look with runs again this soon


@dataclass(frozen=True)
class Started:
    """vLLM was spawned: its row, and the launch it runs with."""

    run: Run
    launch: Launch


StartStep = Started | GiveUp | ExitVerdict | None


class Starter:
    def __init__(self, parts: Parts, log: LogLike) -> None:
        self.p = parts
        self.log = log
        self.port = PortGuard(log)  # vLLM's port while another process holds it
        # A look that found no file descriptor (fdlimit.py): said once per burst, and the
        # preflight that could not look runs again at look_again_at, not counted.
        self.look_again_at: float | None = None

    def stranger(self, run: Run | None, ports: PortsLike, owner: PortOwner | None = None
                 ) -> str | None:
        """Who listens on the serving engine's port when it is not our child's group (None:
        ours, and the port's wait is over: our vLLM listens)."""
        if run is None:
            return None
        holder = run.stranger_on_port(ports, owner)
        if holder is None and run.child.poll() is None:
            self.port.ours()
        return holder

    def step(self, now: float, cfg: Config) -> StartStep:
        if self.look_again_at is not None:
            if now < self.look_again_at:
                return None
            self.look_again_at = None
        try:
            return self._start(now, cfg)
        except Exception as e:
            # A look that found no file descriptor (the front's clients hold them): no
            # verdict, not counted; the preflight runs again in FD_RETRY (issue 28.3).
            if not fdlimit.exhausted(e):
                raise
            self._could_not_look(now, e)
            return None

    def _could_not_look(self, now: float, e: BaseException) -> None:
        fdlimit.PRESSURE.note("the preflight", e)
        self.look_again_at = now + FD_RETRY

    def _start(self, now: float, cfg: Config) -> StartStep:
        if self.port.holder:  # where the next serving engine listens: free yet?
            held = self.port.look_again(now, engine_endpoint(cfg), cfg.restart.port_wait,
                                        self.p.ports)
            if held is not False:
                return held if isinstance(held, ExitVerdict) else None
        chosen = self.p.gpu.launch(cfg)
        res = self.p.gpu.preflight(chosen)
        if res.unseen is not None:
            self._could_not_look(now, res.unseen)
            return None
        for w in res.warnings:
            self.log.warning("preflight_warning", detail=w)
        if res.fatal is not None:
            return GiveUp(EX_CONFIG, str(res.fatal))
        if res.transient is not None:
            if res.port_holder is not None and self.port.observe(
                    now, chosen.engine, cfg.restart.port_wait, res.port_holder):
                return None
            return ExitVerdict(Cause.PREFLIGHT, res.transient, True)
        try:
            # the probe first: its key file read may find no file descriptor either, and a
            # spawned child without a Run would be nobody's to stop
            probe = self.p.make_probe(chosen)
            child = self.p.spawn(chosen)
        except ConfigError as e:
            if fdlimit.exhausted(e):
                raise  # could not read the key file: says nothing of it (step)
            return GiveUp(EX_CONFIG, str(e))
        except OSError as e:
            if fdlimit.exhausted(e):
                raise  # no pipe for vLLM's output: says nothing of vllm.command
            err = ConfigError(cfg.sources[0] if cfg.sources else None, "vllm.command",
                              f"cannot start {cfg.vllm.command[0]}: {e.strerror or e}")
            return GiveUp(EX_CONFIG, str(err))
        self.log.info("child_spawned", pid=child.pid, argv=" ".join(chosen.argv))
        run = Run(child, probe, chosen, now, cfg.watch, self.log,
                  lambda fn: self.p.executor.submit(fn), self.p.clock, warnings=len(res.warnings))
        return Started(run, chosen)
