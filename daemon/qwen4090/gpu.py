"""The GPU parts the supervisor is given: the pre-launch plan, the OOM ladder, the release wait
and the NVML watch.

Built once by cli.py and handed to the supervisor through ``Parts`` (``preflight``,
``adjust_after_failure``, ``gpu_held``) and ``report_gpu_fault``.  With ``[gpu] enabled =
"auto"`` and no NVML (a machine without an NVIDIA GPU) every part steps aside: the preflight is
the plain one and the ladder still runs from vLLM's own error texts.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from qwen4090 import ladder, learned, plan, preflight, xid
from qwen4090.config import AUTO, Config
from qwen4090.policy import ExitVerdict
from qwen4090.preflight import PreflightResult
from qwen4090.probes import nvml

GIB = 1024 ** 3


class GpuParts:
    def __init__(self, log: Any, env: dict[str, str] | None = None) -> None:
        self.log = log
        self.env = dict(os.environ) if env is None else env
        self.fp: dict[str, Any] | None = None  # fingerprint of the last launch's model + GPU
        self.watch: nvml.GpuWatch | None = None
        self._said_no_gpu = False
        self.device = 0

    # --- at start ---------------------------------------------------------------------------

    def wait_for_driver(self, cfg: Config, extend: Callable[[float], object]) -> str | None:
        """Bounded wait for NVML and /dev/nvidia-uvm (the boot race); None = ready/not needed."""
        g = cfg.gpu
        if g.enabled == "off":
            return None
        nvml.bind(cfg.vllm.command)
        if g.enabled == "auto" and (nvml.pynvml is None or _no_driver_installed()):
            return None

        def waiting(why: str, left: float) -> None:
            self.log.warning("gpu_driver_wait", reason=why, seconds_left=round(left))
            extend(left + 30)

        why = nvml.wait_for_driver(g.driver_wait, on_wait=waiting)
        if why is None:
            mem = nvml.memory(g.device)
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

        self.watch = nvml.GpuWatch(cfg.gpu.device, cfg.gpu.sample_interval,
                                   cfg.gpu.temperature_warn, self.log, on_xid,
                                   on_sample=lambda index, s: on_sample(s.metrics(index)))
        self.watch.start()

    def stop_watch(self) -> None:
        if self.watch is not None:
            self.watch.stop()
            self.watch = None

    # --- before each launch -----------------------------------------------------------------

    def preflight(self, cfg: Config) -> PreflightResult:
        return preflight.full(cfg, extra=[self.check_gpu])

    def check_gpu(self, cfg: Config, res: PreflightResult) -> None:
        """Learned settings, the KV-cache plan ("auto" chosen, unfit refused), other holders."""
        g = cfg.gpu
        self.device = g.device
        if g.enabled == "off":
            # No GPU checks, but what earlier OOMs taught still applies (the ladder runs on
            # vLLM's own error texts, with or without NVML).
            launch, notes = self._learned(cfg, "gpu.enabled = off")
            res.config = launch if notes else None
            return
        mem = plan.gpu_memory(cfg)
        if isinstance(mem, str):
            if g.enabled == "required":
                res.transient = f"GPU not ready: {mem}"
            elif not self._said_no_gpu:
                self._said_no_gpu = True
                self.log.info("gpu_checks_skipped", reason=mem)
            launch, notes = self._learned(cfg, mem)
            res.config = launch if notes else None
            return
        launch, _notes = self._learned(cfg, mem)
        model_dir = Path(cfg.vllm.model).expanduser()
        if not (model_dir / "config.json").is_file():
            res.warnings.append(f"no KV-cache plan: {model_dir} is not a local model directory")
            res.config = launch
            return
        try:
            model = plan.read_model(model_dir)
        except plan.PlanError as e:
            res.warnings.append(f"no KV-cache plan: {e}")
            res.config = launch
            return
        p = plan.make_plan(launch, model, mem)
        res.facts["plan"] = p.as_json()
        self.log.info("kv_plan", gpu=mem.name, usable_gib=round(mem.total_bytes / GIB, 2),
                      budget_gib=round(p.budget_bytes / GIB, 2),
                      weights_gib=round(p.weights_bytes / GIB, 2),
                      activation_gib=round(p.activation_bytes / GIB, 2),
                      kv_cache_gib=round(p.kv_cache_bytes / GIB, 2),
                      kv_bytes_per_token=p.kv_bytes_per_token, kv_tokens=p.kv_tokens,
                      max_model_len=p.max_model_len, max_num_seqs=p.max_num_seqs,
                      max_num_batched_tokens=p.max_num_batched_tokens,
                      chosen=",".join(p.chosen) or "none")
        if not p.fits:
            if g.plan_check == "refuse":
                res.fatal = plan.refusal(launch, p)
                return
            if g.plan_check == "warn":
                res.warnings += [f"plan: {k}: {m} (gpu.plan_check = \"warn\": trying anyway)"
                                 for k, m in p.problems]
        res.warnings += [f"plan: {w}" for w in p.warnings]
        self._check_others(p, res, g.device)
        res.config = plan.resolved(launch, p)

    def _learned(self, cfg: Config, gpu: plan.GpuMemory | str) -> tuple[Config, list[str]]:
        self.fp = plan.fingerprint(cfg, gpu)
        store = learned.LearnedStore(learned.state_dir(cfg, self.env))
        launch, notes = store.apply(cfg, self.fp)
        for n in notes:
            self.log.warning("learned_applied", change=n, file=str(store.path),
                             forget="qwen4090 reset-learned")
        return launch, [n for n in notes if not n.startswith("ignored")]

    def _check_others(self, p: plan.Plan, res: PreflightResult, device: int) -> None:
        procs = nvml.processes(device)
        if isinstance(procs, str):
            return
        me = os.getpid()
        others = [q for q in procs if q.pid != me]
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

    # --- after a failure --------------------------------------------------------------------

    def adjust_after_failure(self, launch: Config, verdict: ExitVerdict, tail: list[str]
                             ) -> list[str] | None:
        """OOM: record one rung down the ladder as a learned setting; say what changed."""
        g = launch.gpu
        if not g.oom_ladder:
            return None
        facts = ladder.read_oom(tail) or ladder.read_oom([verdict.detail])
        v = launch.vllm
        limits = ladder.Limits(
            max_model_len=_int(v.max_model_len), max_num_seqs=_int(v.max_num_seqs),
            max_num_batched_tokens=_int(v.max_num_batched_tokens),
            gpu_memory_utilization=v.gpu_memory_utilization)
        floors = ladder.Floors(util_step=g.ladder_util_step, min_util=g.ladder_min_util,
                               min_len=g.ladder_min_len)
        rung = ladder.next_rung(facts, limits, floors)
        if rung is None:
            return None
        fp = self.fp or plan.fingerprint(launch, "no preflight yet")
        store = learned.LearnedStore(learned.state_dir(launch, self.env))
        value: float = int(rung.new) if rung.key != "gpu_memory_utilization" else rung.new
        failed = store.record(rung.key, value, fp,
                              f"{facts.kind.value if facts else 'oom'}: {rung.why}")
        if failed is not None:  # cfg: still applied to the next launch; say where and the fix
            self.log.error("learned_not_saved", key=rung.key, value=value, file=failed.path,
                           error=failed.error, hint=failed.hint)
        else:
            self.log.warning("learned_saved", key=rung.key, value=value, file=str(store.path),
                             oom=facts.kind.value if facts else "unknown")
        return [rung.describe()]

    # --- between stop and relaunch ------------------------------------------------------------

    def gpu_held(self, pids: list[int]) -> str | None:
        procs = nvml.processes(self.device)
        if isinstance(procs, str):
            return None
        wanted = set(pids)
        held = [q for q in procs if q.pid in wanted]
        return "; ".join(q.describe() for q in held) or None


def _int(value: int | str) -> int | None:
    return value if isinstance(value, int) and value != AUTO else None


def _no_driver_installed() -> bool:
    """No NVIDIA driver on this machine at all (so "auto" need not wait for one to load)."""
    why = nvml.init()
    if why is None:
        return False
    return "not found" in why.lower() and not any(
        os.path.exists(p) for p in ("/dev/nvidiactl", "/proc/driver/nvidia", "/sys/module/nvidia"))
