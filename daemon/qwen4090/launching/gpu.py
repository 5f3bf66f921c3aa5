"""The GPU part of the supervisor: owns everything that asks NVML (driver wait, watch, who
holds memory), the checks of a launch against the GPU (the driver against the runtime's CUDA
build among them), and what a launch teaches (the OOM ladder's step-down, the fixed KV
budget) — what is launched is launch.py's.

Built once by cli.py and handed to the supervisor as ``Parts.gpu`` (contracts.GpuLike): the one
door through which the daemon reaches the GPU and the store of what a start teaches.  With
``[gpu] enabled = "auto"`` and no NVML (a machine without an NVIDIA GPU)
every check steps aside, and the ladder still runs from vLLM's own error texts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import psutil

from qwen4090.decide import cudacompat
from qwen4090.decide.policy import ExitVerdict
from qwen4090.decide.results import PreflightResult
from qwen4090.launching import kvbudget, ladder, learned, plan, preflight, runtime, xid
from qwen4090.launching import launch as launch_mod
from qwen4090.launching.launchvalue import Endpoint, Launch, Origin
from qwen4090.probes import nvml
from qwen4090.settings import derived
from qwen4090.settings.config import AUTO, Config, ConfigError

GIB = 1024 ** 3
CUDA_VISIBLE = "CUDA_VISIBLE_DEVICES"


def cuda_visible(cfg: Config, env: Mapping[str, str]) -> str | None:
    """CUDA_VISIBLE_DEVICES as vLLM gets it: [vllm.env] over the supervisor's own environment
    (the unit's Environment=), as child.render_env builds vLLM's."""
    return cfg.vllm.env.get(CUDA_VISIBLE, env.get(CUDA_VISIBLE))


def own_pids() -> set[int]:
    """This process and its descendants: the daemon's own vLLM engines (a sleeping standby
    among them) are no "other process" on the GPU."""
    pids = {os.getpid()}
    with contextlib.suppress(psutil.Error):
        pids |= {c.pid for c in psutil.Process().children(recursive=True)}
    return pids


class GpuParts:
    def __init__(self, log: Any, env: dict[str, str] | None = None,
                 host_memory: Callable[[], plan.HostMemory | str] | None = None,
                 ours: Callable[[], set[int]] = own_pids) -> None:
        self.log = log
        self.env = dict(os.environ) if env is None else env
        # the host's memory for restart.standby = "auto" and a sleeping standby's account
        # (plan.judge_host), read for each serving launch; tests fake it
        self.host_memory = host_memory or (lambda: plan.host_memory())
        self.ours = ours
        self.watch: nvml.GpuWatch | None = None
        self._said_no_gpu = False
        self._said_auto: tuple[str, float | None] | None = None  # auto's last choice said
        self._by_uuid: dict[str, int] = {}  # CUDA_VISIBLE_DEVICES' first entry -> NVML index
        self._unresolved: set[str] = set()  # values already warned about

    # --- which GPU ---------------------------------------------------------------------------

    def device(self, cfg: Config) -> int:
        """NVML's index of the GPU vLLM runs on.  ``gpu.device`` (which follows an index list
        in vllm.env.CUDA_VISIBLE_DEVICES: derived.py), unless CUDA_VISIBLE_DEVICES as vLLM gets
        it names its first GPU by UUID (``GPU-...``, ``MIG-...``): NVML resolves that to its
        own index.  A value NVML cannot resolve is warned about once, and gpu.device watched."""
        value = cuda_visible(cfg, self.env) or ""
        first = value.split(",")[0].strip()
        if cfg.gpu.enabled == "off" or not first or derived.cuda_visible_indices(first):
            return cfg.gpu.device
        if first in self._by_uuid:
            return self._by_uuid[first]
        nvml.bind(cfg.vllm.command)
        found = nvml.index_of(first)
        if isinstance(found, int):
            self._by_uuid[first] = found
            self.log.info("gpu_device_resolved", cuda_visible_devices=value, index=found)
            return found
        if value not in self._unresolved:
            self._unresolved.add(value)
            self.log.warning("gpu_device_unresolved", cuda_visible_devices=value, reason=found,
                             device=cfg.gpu.device,
                             hint="NVML watches gpu.device; set it to the GPU's NVML index "
                                  "(nvidia-smi -L lists index and UUID)")
        return cfg.gpu.device

    def _on_device(self, cfg: Config) -> Config:
        """``cfg`` with gpu.device the GPU vLLM runs on (:meth:`device`)."""
        index = self.device(cfg)
        if index == cfg.gpu.device:
            return cfg
        return dataclasses.replace(cfg, gpu=dataclasses.replace(cfg.gpu, device=index))

    # --- at start ---------------------------------------------------------------------------

    def wait_for_driver(self, cfg: Config, extend: Callable[[float], object],
                        stopping: Callable[[], bool] = lambda: False) -> str | None:
        """Bounded wait for NVML and /dev/nvidia-uvm (the boot race); None = ready/not needed.
        ``stopping`` True (a SIGTERM came meanwhile) ends the wait at once."""
        g = cfg.gpu
        if g.enabled == "off":
            return None
        nvml.bind(cfg.vllm.command)
        if g.enabled == "auto" and (nvml.pynvml is None or _no_driver_installed()):
            return None

        def waiting(why: str, left: float) -> None:
            self.log.warning("gpu_driver_wait", reason=why, seconds_left=round(left))
            extend(left + 30)

        why = nvml.wait_for_driver(g.driver_wait, on_wait=waiting, stopping=stopping)
        if why is None:
            mem = nvml.memory(self.device(cfg))
            if not isinstance(mem, str):
                self.log.info("gpu_found", name=mem.name, total_gib=round(mem.total / GIB, 2),
                              usable_gib=round(mem.usable / GIB, 2),
                              used_gib=round(mem.used / GIB, 2), binding=nvml.binding())
        return why

    def start_watch(self, cfg: Config, on_fatal: Callable[[str], None],
                    on_sample: Callable[[dict[str, Any]], None] = lambda fields: None) -> None:
        """Sample the GPU and wait for Xid events; each sample goes to ``on_sample`` (the
        supervisor's listeners: /status, /metrics), each fatal Xid to ``on_fatal``."""
        if cfg.gpu.enabled == "off":
            return
        nvml.bind(cfg.vllm.command)
        if nvml.init() is not None:
            return

        def on_xid(code: int) -> None:
            info = xid.classify(code)
            if info.action.fatal:
                self.log.critical("gpu_xid", xid=code, action=info.action.value,
                                  detail=info.describe())
                on_fatal(info.describe())
            else:
                self.log.warning("gpu_xid", xid=code, action=info.action.value,
                                 detail=info.describe())

        self.watch = nvml.GpuWatch(self.device(cfg), cfg.gpu.sample_interval,
                                   cfg.gpu.temperature_warn, self.log, on_xid,
                                   on_sample=lambda index, s: on_sample(s.metrics(index)))
        self.watch.start()

    def stop_watch(self) -> None:
        if self.watch is not None:
            self.watch.stop()
            self.watch = None

    # --- before each launch -----------------------------------------------------------------

    def configured(self, cfg: Config) -> Launch:
        """The launch as configured (launch.configured): no facts read, so the supervisor has
        one from its start, before the first preflight resolves the real one."""
        return launch_mod.configured(cfg)

    def launch(self, cfg: Config, beside: Endpoint | None = None,
               host: plan.HostMemory | str | None = None) -> Launch:
        """What the next vLLM is launched with (launch.py, on this machine's facts); its
        config's gpu.device is the GPU vLLM runs on (:meth:`device`), for the plan, the checks
        and the release wait; ``beside``: the endpoint another engine listens on; ``host``:
        the host's memory to resolve on (the serving launch's, Launch.host), else read now."""
        cfg = self._on_device(cfg)
        if host is None:
            host = self.host_memory()
        return launch_mod.resolve(cfg, launch_mod.read_facts(cfg, self.env, host=host), beside)

    def preflight(self, chosen: Launch) -> PreflightResult:
        """Every check before `chosen` is launched, the GPU's among them (what cli.py hands the
        supervisor as Parts.preflight)."""
        res = preflight.full(chosen.config, chosen.engine,
                             extra=[lambda cfg, r: self.check(chosen, r)])
        if res.ok and chosen.kv_note:
            self.log.info("kv_budget", detail=chosen.kv_note)
        return res

    def check(self, chosen: Launch, res: PreflightResult) -> None:
        """The launch against the GPU: a driver too old for the runtime and unfit settings
        refused, other holders of its memory named."""
        self._say_standby(chosen)
        g = chosen.config.gpu
        if g.enabled == "off":
            # No GPU checks, but what earlier OOMs taught still applies (the ladder runs on
            # vLLM's own error texts, with or without NVML).
            self._say_learned(chosen)
            return
        # before the memory: it asks NVML itself (gpu.memory_gib may stand in for the memory)
        self._check_driver(chosen.config, res)
        if res.fatal is not None:
            return
        if isinstance(chosen.gpu, str):
            if g.enabled == "required":
                res.transient = f"GPU not ready: {chosen.gpu}"
            elif not self._said_no_gpu:
                self._said_no_gpu = True
                self.log.info("gpu_checks_skipped", reason=chosen.gpu)
            self._say_learned(chosen)
            return
        self._say_learned(chosen)
        p = chosen.plan
        if p is None:
            res.warnings.append(f"no KV-cache plan: {chosen.no_plan}")
            return
        if p.standby is not None:  # on the host's memory the launch was resolved on
            plan.judge_host(p, chosen.host)
        res.facts["plan"] = p.as_json()
        self.log.info("kv_plan", gpu=p.gpu.name, usable_gib=round(p.gpu.total_bytes / GIB, 2),
                      budget_gib=round(p.budget_bytes / GIB, 2),
                      weights_gib=round(p.weights_bytes / GIB, 2),
                      activation_gib=round(p.activation_bytes / GIB, 2),
                      kv_cache_gib=round(p.kv_cache_bytes / GIB, 2),
                      kv_bytes_per_token=p.kv_bytes_per_token, kv_tokens=p.kv_tokens,
                      max_model_len=p.max_model_len, max_num_seqs=p.max_num_seqs,
                      max_num_batched_tokens=p.max_num_batched_tokens,
                      chosen=",".join(p.chosen) or "none")
        if p.standby is not None:
            s = p.standby
            self.log.info("standby_plan", mode=s.mode, gpu_gib=round(s.gpu_bytes / GIB, 2),
                          peak_gib=round(s.peak_bytes / GIB, 2), fits_gpu=s.fits_gpu,
                          host_pinned_gib=round(s.host_pinned_bytes / GIB, 2),
                          host_gib=round(s.host_bytes / GIB, 2),
                          host_room_gib=None if s.host is None
                          else round(s.host.room_bytes / GIB, 2))
        if not p.fits:
            if g.plan_check == "refuse":
                res.fatal = plan.refusal(chosen.config, p)
                return
            if g.plan_check == "warn":
                res.warnings += [f"plan: {k}: {m} (gpu.plan_check = \"warn\": trying anyway)"
                                 for k, m in p.problems]
        res.warnings += [f"plan: {w}" for w in p.warnings]
        self._check_others(p, res, g.device)

    def _check_driver(self, cfg: Config, res: PreflightResult) -> None:
        """A driver older than the CUDA the runtime's torch was built for: refused (exit 78),
        since vLLM would die at CUDA init at every start (issue 31.5).  Without a driver, a
        runtime venv or its torch's build to read there is nothing to judge, and nothing is
        said at each launch: `qwen4090 plan` says why (its "cuda" line)."""
        found = cuda_versions(cfg)
        if isinstance(found, str):
            return
        why = cudacompat.refusal(*found)
        if why is not None:
            res.fatal = ConfigError(None, None, why)

    def _say_standby(self, chosen: Launch) -> None:
        """restart.standby = "auto": what it chose and why, once, and again when a later
        launch chooses otherwise (the mode, or the utilization it lowered)."""
        if chosen.standby_configured != AUTO:
            return
        util = chosen.settings.get("gpu_memory_utilization")
        lowered = None if util is None or util.origin is not Origin.PLAN else chosen.config \
            .vllm.gpu_memory_utilization
        if self._said_auto == (chosen.standby, lowered):
            return
        self._said_auto = (chosen.standby, lowered)
        self.log.info("standby_auto", mode=chosen.standby, why=chosen.standby_why,
                      **({"gpu_memory_utilization": lowered} if lowered is not None else {}))

    def _say_learned(self, chosen: Launch) -> None:
        path = learned.state_dir(chosen.config, self.env) / learned.FILE_NAME
        for n in chosen.learned:
            self.log.warning("learned_applied", change=n, file=str(path),
                             forget="qwen4090 reset-learned")

    def _check_others(self, p: plan.Plan, res: PreflightResult, device: int) -> None:
        procs = nvml.processes(device)
        if isinstance(procs, str):
            return
        ours = self.ours()
        others = [q for q in procs if q.pid not in ours]
        if not others:
            return
        names = "; ".join(q.describe() for q in others)
        need = p.budget_bytes + p.outside_budget_bytes
        free = p.gpu.free_bytes
        if free is not None and free < need:
            res.transient = (f"GPU memory held by other processes: {names}; free "
                             f"{free / GIB:.1f} GiB, vLLM needs ~{need / GIB:.1f} GiB "
                             f"(gpu_memory_utilization {p.gpu_memory_utilization:g})")
        else:
            res.warnings.append(f"other processes use the GPU: {names}")

    # --- after a start ------------------------------------------------------------------------

    def remember_kv(self, launched: Launch, tokens: int | None, kv_bytes: int | None) -> bool:
        """READY: keep the KV-cache bytes vLLM sized for the next launch (fixed_kv_budget)."""
        store = kvbudget.KvBudget(learned.state_dir(launched.config, self.env))
        per_token = launched.plan.kv_bytes_per_token if launched.plan is not None else None
        return store.record(launched.config, launched.kv_base,
                            {"kv_tokens": tokens, "kv_bytes": kv_bytes}, per_token)

    def forget_kv(self, launched: Launch) -> bool:
        """A start given the KV budget failed: the next one profiles again."""
        store = kvbudget.KvBudget(learned.state_dir(launched.config, self.env))
        return store.forget(launched.kv_budget)

    # --- after a failure --------------------------------------------------------------------

    def step_down(self, launched: Launch, cfg: Config, verdict: ExitVerdict, tail: list[str]
                  ) -> list[str] | None:
        """OOM: record one rung down the ladder as a learned setting; say what changed.  The
        limits are the launch's; the ladder's settings and the state directory are `cfg`'s (the
        current config, so a reload applies to the next OOM)."""
        g = cfg.gpu
        if not g.oom_ladder:
            return None
        facts = ladder.read_oom(tail) or ladder.read_oom([verdict.detail])
        v = launched.config.vllm
        limits = ladder.Limits(
            max_model_len=_int(v.max_model_len), max_num_seqs=_int(v.max_num_seqs),
            max_num_batched_tokens=_int(v.max_num_batched_tokens),
            gpu_memory_utilization=v.gpu_memory_utilization)
        floors = ladder.Floors(util_step=g.ladder_util_step, min_util=g.ladder_min_util,
                               min_len=g.ladder_min_len)
        rung = ladder.next_rung(facts, limits, floors)
        if rung is None:
            return None
        store = learned.LearnedStore(learned.state_dir(cfg, self.env))
        value: float = int(rung.new) if rung.key != "gpu_memory_utilization" else rung.new
        failed = store.record(rung.key, value, launched.fingerprint,
                              f"{facts.kind.value if facts else 'oom'}: {rung.why}")
        if failed is not None:  # cfg: still applied to the next launch; say where and the fix
            self.log.error("learned_not_saved", key=rung.key, value=value, file=failed.path,
                           error=failed.error, hint=failed.hint)
        else:
            self.log.warning("learned_saved", key=rung.key, value=value, file=str(store.path),
                             oom=facts.kind.value if facts else "unknown")
        return [rung.describe()]

    # --- between stop and relaunch ------------------------------------------------------------

    def wait_released(self, cfg: Config, pids: list[int],
                      sleep: Callable[[float], None] = time.sleep,
                      clock: Callable[[], float] = time.monotonic) -> None:
        """At start, after a predecessor's orphaned vLLM was stopped: wait (up to
        gpu.release_timeout) until its pids hold no memory on our GPU."""
        if not pids or cfg.gpu.enabled == "off":
            return
        start = clock()
        device = self.device(cfg)
        while (held := self.held(device, pids)) is not None:
            if clock() - start >= cfg.gpu.release_timeout:
                self.log.warning("gpu_not_released", waited=round(clock() - start, 2),
                                 holders=held)
                return
            sleep(0.5)
        self.log.info("gpu_released", waited=round(clock() - start, 2))

    def held(self, device: int, pids: list[int]) -> str | None:
        """Which of these pids still hold memory on the GPU with this NVML index (None: none,
        or NVML cannot tell)."""
        procs = nvml.processes(device)
        if isinstance(procs, str):
            return None
        wanted = set(pids)
        held = [q for q in procs if q.pid in wanted]
        return "; ".join(q.describe() for q in held) or None


    def room(self, device: int, fraction: float) -> bool | None:
        """Is ``fraction`` of the usable memory of the GPU with this NVML index free now?
        (None: NVML cannot tell.)  A failover wakes the standby as soon as it is (issue 21:
        on the H200 waiting for the stopped group's pids to leave NVML's list took up to 2 s
        with 115 GiB free)."""
        m = nvml.memory(device)
        if isinstance(m, str):
            return None
        return m.free >= fraction * m.usable


def cuda_versions(cfg: Config) -> tuple[cudacompat.DriverCuda, cudacompat.TorchBuild, Path] | str:
    """The driver's CUDA (NVML, with the binding of vllm.command's venv) and the CUDA build of
    that venv's torch, with the venv; a str says which of them is not known.  The runtime is
    read first: without one there is no reason to ask NVML."""
    venv = runtime.venv_of(cfg.vllm.command)
    if venv is None:
        return (f"vllm.command's {cfg.vllm.command[0]} is not the python of a venv "
                "(DIR/bin/python with DIR/pyvenv.cfg)")
    build = runtime.torch_build(venv)
    if isinstance(build, str):
        return build
    nvml.bind(cfg.vllm.command)
    driver = nvml.driver_cuda()
    if isinstance(driver, str):
        return driver
    return driver, build, venv


def _int(value: int | str) -> int | None:
    return value if isinstance(value, int) and value != AUTO else None


def _no_driver_installed() -> bool:
    """No NVIDIA driver on this machine at all (so "auto" need not wait for one to load)."""
    why = nvml.init()
    if why is None:
        return False
    return "not found" in why.lower() and not any(
        os.path.exists(p) for p in ("/dev/nvidiactl", "/proc/driver/nvidia", "/sys/module/nvidia"))
