"""The `qwen4090` command, the composition root: it owns the command table and all the wiring
(building the real parts, handing them to the supervisor, fanning a reload out to what was set
up from the config) and turns the outcome into the exit code.

Command modules (provision, plancmd, statuscmd, bench) import nothing from here: COMMANDS below
names the function of each, and what they share is in commands.py.
"""

from __future__ import annotations

import argparse
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from qwen4090 import __version__
from qwen4090.base import fdlimit, fdstore, logs
from qwen4090.base.events import Event, Listener, Reloaded
from qwen4090.base.notify import Notifier
from qwen4090.base.redact import safe_error
from qwen4090.commandline import bench, plancmd, provision, statuscmd
from qwen4090.commandline.commands import config_arg, config_error
from qwen4090.decide.policy import EX_CONFIG, EX_SOFTWARE, EX_TEMPFAIL, EXIT_CODES
from qwen4090.engine import (
    caches,
    child,
    front,
    frontlimits,
    preimport,
    readahead,
    timeline,
    warmup,
)
from qwen4090.launching import instance, launch, launchvalue, steptime
from qwen4090.launching.gpu import GpuParts
from qwen4090.launching.launchvalue import Launch
from qwen4090.parts.contracts import FrontLike, LogLike, NoFront, Parts
from qwen4090.probes.http import VllmProbe
from qwen4090.settings import config as config_mod
from qwen4090.settings.config import Config, ConfigError
from qwen4090.supervision.supervisor import Supervisor
from qwen4090.surfaces import httpapi, signals

# sd_notify messages systemd has not taken yet (notify.Notifier.flush): tried again this soon,
# and at the exit for at most this long (STOPPING=1 and the last STATUS= should reach it).
NOTIFY_RETRY = 0.05
NOTIFY_EXIT_WAIT = 1.0
# A step of the loop that took this long means the supervisor itself stood still (a blocked
# write to a slow journald, say): said in the journal, since every timer was late meanwhile.
LOOP_STALL = 2.0

# --- check-config -----------------------------------------------------------------------------


def cmd_check_config(args: argparse.Namespace) -> int:
    from qwen4090.engine.warmup import plan_steps
    from qwen4090.launching import preflight

    try:
        cfg = config_mod.load(args.config)
    except ConfigError as e:
        return config_error(e)
    res = preflight.static(cfg)
    if res.fatal is not None:
        return config_error(res.fatal)
    v = cfg.vllm
    steps, skipped = plan_steps(cfg)
    print(f"config ok: {', '.join(cfg.sources)}")
    print(f"  model    {v.model} (served as {v.served_model_name}) on {v.host}:{v.port}")
    if cfg.front.enabled:
        print(f"  front    clients on {v.host}:{v.port}, vLLM on "
              f"{launchvalue.engine_endpoint(cfg)}, requests held up to "
              f"{cfg.front.hold_timeout:g}s")
    print(f"  limits   max_model_len={v.max_model_len} max_num_seqs={v.max_num_seqs} "
          f"max_num_batched_tokens={v.max_num_batched_tokens} "
          f"gpu_memory_utilization={v.gpu_memory_utilization:g}")
    print(f"  argv     {' '.join(launch.configured(cfg).argv)}")  # as configured: no plan
    if cfg.restart.standby == config_mod.AUTO:
        print("  standby  auto: sleep or off, chosen at each start of vLLM from the plan, the "
              "GPU and the host's memory (`qwen4090 plan` says which and why)")
    key = "none" if not (v.api_key_file or os.environ.get("CREDENTIALS_DIRECTORY")) else \
        (v.api_key_file or "systemd credential api_key")
    print(f"  api key  {key}")
    plan = ", ".join(f"{s.length}x{s.concurrency}" for s in steps)
    print(f"  warmup   {plan if cfg.warmup.enabled else 'off'}")
    for s in skipped:
        print(f"  note     warmup skips {s}")
    for w in res.warnings:
        print(f"  warning  {w}")
    return 0


# --- run --------------------------------------------------------------------------------------


class ThreadRunner:
    """Runs each task on a daemon thread: an idle worker takes it, else a new one starts (a
    stuck probe never blocks another task, nor our exit).  Workers are kept: a new thread's
    start() waits until the scheduler has run it, and on a machine whose cores vLLM keeps busy
    that wait, inside the loop's step, was where every long step was sampled
    (docs/loop-steps.md); a kept worker is handed its task through a queue, without a wait."""

    IDLE = 60.0  # seconds a worker waits for a task before it ends

    def __init__(self, on_done: Callable[[], None]) -> None:
        self.on_done = on_done
        self._tasks: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]]
        self._tasks = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0  # workers waiting for a task and not yet promised one

    def submit(self, fn: Callable[..., Any], /, *args: Any) -> Future[Any]:
        fut: Future[Any] = Future()
        with self._lock:
            spare = self._idle > 0
            if spare:
                self._idle -= 1  # promised: it takes a task from the queue
        self._tasks.put((fut, fn, args))
        if not spare:
            threading.Thread(target=self._work, name="qwen4090-task", daemon=True).start()
        return fut

    def _work(self) -> None:
        while True:
            try:
                fut, fn, args = self._tasks.get(timeout=self.IDLE)
            except queue.Empty:
                with self._lock:
                    if self._idle > 0:  # nobody was promised this worker: it ends
                        self._idle -= 1
                        return
                continue  # promised to a submit whose task is on its way
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(*args))
                except BaseException as e:
                    fut.set_exception(e)
                self.on_done()
            with self._lock:
                self._idle += 1


def cmd_run(args: argparse.Namespace) -> int:
    """Build the parts, then serve.  The signal handlers come first: a SIGHUP or SIGTERM at any
    moment after exec is queued for the supervisor (its first step handles it), never fatal —
    also during the driver wait and the stop of a predecessor's orphan (issue 18.2)."""
    wake = signals.Wakeup()
    pending: deque[int] = deque()
    signals.install(pending.append, wake)
    try:
        return serve(args, wake, pending)
    finally:
        signals.restore()


def serve(args: argparse.Namespace, wake: signals.Wakeup, pending: deque[int]) -> int:
    try:
        cfg = config_mod.load(args.config)
    except ConfigError as e:
        logs.setup("auto", "info")
        logs.get_logger().error("config_error", error=str(e))
        return EX_CONFIG
    logs.setup(cfg.log.format, cfg.log.level)
    logs.set_vllm_level(cfg.log.vllm_level)
    log = logs.get_logger()
    log.info("starting", version=__version__, config=",".join(cfg.sources), pid=os.getpid())
    # The front's clients are files of ours: the soft limit up to the hard one before the
    # client port opens (the front's cap is kept below it: fdlimit.py, issue 28.3).
    fdlimit.raise_soft(log)
    # One instance per vLLM port, and what a killed one left (issue 8.3, 8.5; instance.py).
    try:
        inst = instance.Instance.take(cfg, log)
    except instance.InstanceError as e:
        log.error("instance_refused", error=str(e))
        return EX_CONFIG
    child.become_subreaper()
    notifier = Notifier(on_error=lambda msg: log.warning("notify_failed", error=msg))
    # What systemd kept for us across a restart: the client port (fdstore.py, issue 31.1).
    kept = fdstore.passed(os.environ)
    # The client port first: a client that comes while vLLM starts waits instead of being
    # refused (issue 20).
    try:
        door = open_front(cfg, log, notifier.extend_timeout,
                          stopping=lambda: any(s in signals.STOPS for s in pending),
                          kept=kept.take(fdstore.CLIENT))
        if names := kept.close_rest():
            log.info("fd_store_unknown", names=",".join(names))
    except ConfigError as e:  # the API key the front checks: unreadable or unusable
        log.error("config_error", error=str(e))
        inst.close(group_gone=True)
        return EX_CONFIG
    if door is None:
        inst.close(group_gone=True)
        return EX_TEMPFAIL
    try:
        return serve_with(args, cfg, log, inst, notifier, door, wake, pending)
    finally:
        door.stop()


def serve_with(args: argparse.Namespace, cfg: Config, log: LogLike, inst: instance.Instance,
               notifier: Notifier, door: FrontLike, wake: signals.Wakeup, pending: deque[int]
               ) -> int:
    gpu = GpuParts(log)
    why = gpu.wait_for_driver(cfg, notifier.extend_timeout,
                              stopping=lambda: any(s in signals.STOPS for s in pending))
    if why:
        log.error("gpu_driver_not_ready", reason=why, waited=cfg.gpu.driver_wait)
    gpu.wait_released(cfg, inst.stop_orphans(cfg.stop.term_timeout))

    watch = timeline.TimelineWatch(log)  # start-up and recovery timelines
    pre = preimport.Preimport(log)  # the interpreter the next vLLM starts in
    sup: Supervisor  # built below; vLLM's lines and the NVML threads report to it

    def engine_dead(c: child.VllmChild, line: str) -> None:  # a pipe reader's thread
        sup.inbox.engine_dead(c, line)
        wake.wake()

    def gpu_fault(detail: str) -> None:  # NVML's thread: queue it and wake the loop
        sup.inbox.gpu_fault(detail)
        wake.wake()

    sink = child.LineRouter(logs.get_logger(source="vllm"), logs.vllm_level,
                            clues=[watch.on_line])
    parts = Parts(
        spawn=VllmLauncher(inst, pre, sink, engine_dead, log),
        ports=inst,
        make_probe=make_probe,
        gpu=gpu,
        warmup=warmup.run,
        load_config=lambda: config_mod.load(args.config),
        notifier=notifier,
        executor=ThreadRunner(wake.wake),
        log=log,
        front=door,
        step_times=steptime.StepTimes(log),
    )
    sup = Supervisor(cfg, parts, signals=pending)
    parts.listeners += [watch]
    gpu.start_watch(cfg, gpu_fault, sup.inbox.gpu_sample)  # samples: /status, /metrics
    sources: list[httpapi.StatusSource] = [watch, pre, door]
    api = start_status(sup, log, sources=sources)  # /status, /metrics, /livez, /readyz
    parts.listeners.append(reload_fanout(sup, gpu, api, gpu_fault, door))
    try:
        loop(sup, api, notifier, wake, log)
    except Exception as e:
        log.critical("internal_error", error=safe_error(e, where=True))
        sup.engines.kill_all()
        return EX_SOFTWARE
    finally:
        gpu.stop_watch()
        pre.discard("stopping")
        inst.close(group_gone=not sup.engines.alive())
    code = sup.exit_code if sup.exit_code is not None else EX_SOFTWARE
    until = time.monotonic() + NOTIFY_EXIT_WAIT
    while not notifier.flush() and time.monotonic() < until:
        time.sleep(NOTIFY_RETRY)
    log.info("exiting", exit_code=code, state=sup.state.value)
    return code


FRONT_BIND_RETRY = 1.0  # seconds between tries to bind the client port while it is taken


def keep_client_port(door: front.Front, inherited: bool, env: Mapping[str, str],
                     log: LogLike) -> None:
    """The client port's socket into systemd's store (fdstore.py), so that it listens on
    through a restart or a death of this process; said once in the journal."""
    port = _host_port_of(door.listen)
    if inherited:
        log.info("client_port_kept", port=port, by="systemd's file descriptor store")
        return
    fds = door.listening_fds()
    if len(fds) != 1:
        log.info("client_port_not_stored", port=port,
                 reason=f"{len(fds)} listening sockets (one per address of vllm.host)")
        return
    err = fdstore.send(env, fdstore.store_message(), fds)
    if err:
        log.warning("client_port_not_stored", port=port, reason=err,
                    hint="the unit needs FileDescriptorStoreMax= (the shipped one has it)")
    elif err is None:
        log.info("client_port_stored", port=port)


def _host_port_of(at: tuple[str, int]) -> str:
    return f"[{at[0]}]:{at[1]}" if ":" in at[0] else f"{at[0]}:{at[1]}"


def open_front(cfg: Config, log: LogLike, extend: Callable[[float], object],
               stopping: Callable[[], bool], sleep: Callable[[float], None] = time.sleep,
               kept: list[int] | None = None, env: Mapping[str, str] | None = None
               ) -> FrontLike | None:
    """The front on vllm.host:vllm.port (front.enabled), or NoFront; None when the port stayed
    taken for restart.port_wait (said in the journal with who holds it) or a stop came;
    ConfigError when the API key it must check cannot be read.  ``kept``: the client port's
    socket as systemd's store kept it (fdstore.py): used when it listens where the config
    says, else closed and taken out of the store; a port bound anew is put into it."""
    env = os.environ if env is None else env
    v = cfg.vllm
    sock, why = (None, "the front is off (front.enabled = false)") if not cfg.front.enabled \
        else fdstore.client_socket(kept or [], v.host, v.port)
    if kept and sock is None:  # systemd must let go of it: vLLM or the new port needs it
        fdstore.send(env, fdstore.remove_message())
        log.info("client_port_released", reason=why)
    if not cfg.front.enabled:
        return NoFront()
    at = launchvalue.engine_endpoint(cfg)
    door = front.Front((v.host, v.port), (at.host, at.port),
                       front_limits(cfg), log, key=child.read_api_key(v, os.environ), sock=sock)
    until = time.monotonic() + cfg.restart.port_wait
    said = False
    while True:
        try:
            door.start()
            keep_client_port(door, sock is not None, env, log)
            return door
        except OSError as e:
            holder = instance.port_holders(v.host, v.port)
            if time.monotonic() >= until or stopping():
                log.error("front_port_busy", port=f"{v.host}:{v.port}", holder=holder,
                          error=safe_error(e), waited=cfg.restart.port_wait,
                          hint="stop what holds vllm.port (a vLLM started by hand?), or "
                               "choose another vllm.port")
                return None
            if not said:
                log.warning("front_port_wait", port=f"{v.host}:{v.port}", holder=holder,
                            error=safe_error(e), wait=cfg.restart.port_wait)
                said = True
            extend(cfg.restart.port_wait + 30)
            sleep(FRONT_BIND_RETRY)


def loop(sup: Supervisor, api: httpapi.StatusApi, notifier: Notifier, wake: signals.Wakeup,
         log: LogLike) -> None:
    """Step the supervisor until it is done, sleeping until its next deadline."""
    while not sup.done:
        began = time.monotonic()
        sup.step()
        if sup.moved:  # /status shows a new state at once, not a render kept from before it
            api.renders.forget()
        # As a subreaper we adopt vLLM's orphans (a killed API server's EngineCore): collect
        # their exit status, never that of a child a Popen of ours waits on (issue 18.3).
        for pid, code in child.reap_adopted(child.OWN.pids()):
            log.info("orphan_reaped", pid=pid, code=code)
        api.beat()
        took = time.monotonic() - began
        api.steps.observe(took)  # qwen4090_loop_step_seconds
        if took > LOOP_STALL:
            log.warning("loop_stalled", seconds=round(took, 1), state=sup.state.value,
                        notify_pending=notifier.pending)
        # sd_notify never blocks the loop: what systemd has not taken yet goes out soon
        pause = sup.next_wakeup(time.monotonic())
        wake.wait(pause if notifier.flush() else min(pause, NOTIFY_RETRY))


def make_probe(chosen: Launch) -> VllmProbe:
    """Parts.make_probe: the questions to the engine of this launch, at its endpoint."""
    v, at = chosen.config.vllm, chosen.engine
    return VllmProbe(at.host, at.port, v.served_model_name, child.read_api_key(v, os.environ))


class VllmLauncher:
    """Parts.spawn: vLLM for a resolved launch, under the instance lock (which records it):
    its lines to ``sink`` (the timeline, our log), its engine's death to ``engine_dead``, the
    weights read ahead, the pre-imported interpreter taken when it was made for this argv and
    the next one prepared (for whichever engine starts next)."""

    def __init__(self, inst: instance.Instance, pre: preimport.Preimport,
                 sink: child.ChildSink, engine_dead: Callable[[child.VllmChild, str], None],
                 log: LogLike) -> None:
        self.inst, self.pre, self.sink, self.engine_dead, self.log = \
            inst, pre, sink, engine_dead, log

    def __call__(self, launch: Launch) -> child.VllmChild:
        c = launch.config
        if c.restart.readahead:
            readahead.start(c.vllm.model, self.log)
        if not c.restart.preimport:
            self.pre.discard("restart.preimport is off")
        started: child.VllmChild = self.inst.spawn(launch, lambda cfg: child.spawn(
            launch.argv, cfg, self.sink, env=caches.cache_environment(os.environ, cfg.vllm.env),
            take=self.pre.take if cfg.restart.preimport else None,
            on_engine_dead=self.engine_dead))
        if c.restart.preimport:
            # At each spawn, whichever engine (serving or standby): the interpreter for the
            # next start, with this child's command and env, so that it has finished
            # importing by READY (issue 18.7: started at READY, it was still importing 14-20 s
            # later when a fault came).  Prepared only at a serving start, a standby's build
            # took it and the next fallback, OOM or reload restart found none (issue 29.3).
            self.pre.prepare(started.argv, started.env)
        return started


def start_status(sup: httpapi.ServedSupervisor, log: LogLike,
                 sources: Sequence[httpapi.StatusSource] = ()
                 ) -> httpapi.StatusApi:
    """The status endpoint, serving on ``[status]`` host:port if enabled and free: its Telemetry
    listens to the supervisor, and each source adds facts to /status and families to /metrics
    (e.g. timeline.TimelineWatch)."""
    telemetry = httpapi.Telemetry(clock=sup.p.clock, wall=sup.p.wall)
    sup.p.listeners.append(telemetry)

    def document() -> dict[str, Any]:
        doc = httpapi.status_document(sup, telemetry)
        for source in sources:
            doc.update(source.status())
        return doc

    api = httpapi.StatusApi(document, clock=sup.p.clock, log=log)
    for source in sources:
        source.register(api.registry)
    api.serve(sup.published.cfg.status)  # (on the loop's thread: before it runs)
    return api


def reload_fanout(sup: Supervisor, gpu: GpuParts, api: httpapi.StatusApi,
                  on_gpu_fault: Callable[[str], None], door: FrontLike | None = None
                  ) -> Listener:
    """A supervisor listener that redoes, after a reload, what cmd_run set up from a changed
    section: logging ([log]), the GPU watch ([gpu]), the status endpoint ([status]) and the
    front's hold_timeout ([front]: the supervisor refuses a change of its address).  The
    supervisor itself reads every other setting from its current config."""
    def on_event(event: Event) -> None:
        if not isinstance(event, Reloaded):
            return
        changed, cfg = event.changed, sup.cfg
        if "log" in changed:
            logs.set_vllm_level(cfg.log.vllm_level)
            chosen = logs.setup(cfg.log.format, cfg.log.level)
            sup.log.info("logging_reconfigured", format=chosen, log_level=cfg.log.level)
        if "gpu" in changed:
            gpu.stop_watch()
            gpu.start_watch(cfg, on_gpu_fault, sup.inbox.gpu_sample)
            sup.log.info("gpu_watch_restarted", device=cfg.gpu.device,
                         running=gpu.watch is not None,
                         sample_interval=cfg.gpu.sample_interval,
                         temperature_warn=cfg.gpu.temperature_warn)
        if "status" in changed:
            api.stop()
            api.serve(cfg.status)
        if ("front" in changed or "vllm" in changed) and door is not None \
                and cfg.front.enabled:  # (NoFront: nothing to read a key for)
            # the limits, and the API key (vllm.api_key_file: vLLM gets it at the restart
            # that a [vllm] change makes)
            try:
                key = child.read_api_key(cfg.vllm, os.environ)
            except ConfigError as e:  # vLLM's next start refuses it too (preflight, exit 78)
                key = door.api_key
                sup.log.error("front_key_kept", error=str(e),
                              hint="the front keeps checking the key it had")
            door.configure(front_limits(cfg), key)
    return on_event


def front_limits(cfg: Config) -> frontlimits.Limits:
    """[front]'s limits, the connection cap kept below the file limit now in force."""
    return frontlimits.limits_of(cfg.front, fdlimit.soft_limit())


# --- the command table and main -----------------------------------------------------------------


@dataclass(frozen=True)
class Command:
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


# Every subcommand, in the order `qwen4090 --help` lists them.
COMMANDS: dict[str, Command] = {
    "check-config": Command("validate the configuration (and the files it names); exit 0 or 78",
                            config_arg, cmd_check_config),
    "run": Command("run the daemon in the foreground (what systemd's ExecStart runs)",
                   config_arg, cmd_run),
    "install-runtime": Command("create vLLM's runtime venv (default /opt/qwen4090/venv)",
                               provision.add_install_args, provision.cmd_install_runtime),
    "fetch-model": Command("put a model into /var/lib/qwen4090/models (hub or local directory)",
                           provision.add_fetch_args, provision.cmd_fetch_model),
    "plan": Command("show the KV-cache account for the config on this GPU; exit 78 if it "
                    "cannot fit", plancmd.add_plan_args, plancmd.cmd_plan),
    "reset-learned": Command("forget the settings learned from out-of-memory restarts",
                             config_arg, plancmd.cmd_reset_learned),
    "status": Command("show what the running daemon is doing; exit 0 ready, 1 not ready, "
                      "3 not running", statuscmd.add_args, statuscmd.cmd_status),
    "bench": Command("measure TTFT/TPOT/throughput with `vllm bench serve` and the standard "
                     "workload; --slo-ttft-p99-ms makes it a check", bench.add_args,
                     bench.cmd_bench),
}


def build_parser() -> argparse.ArgumentParser:
    codes = "\n".join(f"  {code:>3}  {text}" for code, text in EXIT_CODES.items())
    parser = argparse.ArgumentParser(
        prog="qwen4090",
        description="Run vLLM as a reliable OpenAI-compatible endpoint under systemd.",
        epilog=f"exit codes:\n{codes}",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"qwen4090 {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, c in COMMANDS.items():
        p = sub.add_parser(name, help=c.help, description=c.help, epilog=f"exit codes:\n"
                           f"{codes}", formatter_class=argparse.RawDescriptionHelpFormatter)
        c.add_arguments(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 2
    return COMMANDS[args.command].run(args)
