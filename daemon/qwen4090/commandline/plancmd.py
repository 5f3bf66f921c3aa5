"""The commands that show and reset what a launch gets: ``qwen4090 plan`` (the launch that
launch.py resolves, with the KV-cache account of plan.py) and ``qwen4090 reset-learned``.

Apart from plan.py so that plan.py (pure arithmetic) and launch.py (the resolver, which the
supervisor imports) import nothing of the command line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

from qwen4090.commandline.commands import config_arg, config_error
from qwen4090.decide import cudacompat
from qwen4090.decide.policy import EX_CONFIG
from qwen4090.launching import learned, plan
from qwen4090.launching.gpu import cuda_versions
from qwen4090.launching.launch import read_facts, resolve
from qwen4090.launching.launchvalue import Origin
from qwen4090.settings.config import AUTO, Config, ConfigError


def add_plan_args(p: argparse.ArgumentParser) -> None:
    config_arg(p)
    p.add_argument("--model", help="model directory (default: vllm.model of the config)")
    p.add_argument("--gpu-memory", type=float, metavar="GIB",
                   help="plan for a GPU with this much memory instead of reading NVML "
                        "(e.g. 24 for an RTX 4090)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")


def cmd_plan(args: argparse.Namespace) -> int:
    from qwen4090.settings import config as config_mod

    try:
        cfg = config_mod.load(args.config) if Path(args.config).exists() or \
            args.model is None else Config()
    except ConfigError as e:
        return config_error(e)
    if args.model:
        cfg = dataclasses.replace(cfg, vllm=dataclasses.replace(cfg.vllm, model=args.model))
    try:
        model = plan.read_model(cfg.vllm.model)
    except plan.PlanError as e:
        return config_error(e, "plan")
    gpu = plan.gpu_memory_from(args.gpu_memory, cfg)
    if isinstance(gpu, str):
        print(f"qwen4090: plan: {gpu}", file=sys.stderr)
        return 1
    # The daemon's own resolver, on the same facts: what the next launch gets, and why.
    launch = resolve(cfg, read_facts(cfg, os.environ, gpu, model))
    account = launch.plan
    assert account is not None  # the GPU and the model are known
    if account.standby is not None:  # restart.standby: its host memory, as the preflight does
        plan.judge_host(account, launch.host)
    util = launch.settings["gpu_memory_utilization"]
    lowered = util.value if util.origin is Origin.PLAN else None
    # the driver against the runtime's CUDA build, as the preflight holds them (gpu.py)
    cuda = cuda_versions(cfg) if cfg.gpu.enabled != "off" else "gpu.enabled = \"off\""
    refused = None if isinstance(cuda, str) else cudacompat.refusal(*cuda)
    if args.json:
        out = account.as_json()
        out["standby_choice"] = {"configured": launch.standby_configured,
                                 "mode": launch.standby, "why": launch.standby_why,
                                 "gpu_memory_utilization": lowered}
        out["learned"] = list(launch.learned)
        out["argv"] = list(launch.argv)
        out["settings"] = {k: s.as_json() for k, s in launch.settings.items()}
        out["fingerprint"] = launch.fingerprint
        out["kv_budget"] = launch.kv_note
        out["cuda"] = {"unknown": cuda} if isinstance(cuda, str) else {
            "driver": cuda[0].version, "driver_cuda": cudacompat.cuda_text(cuda[0].supports),
            "runtime": str(cuda[2]), "torch": cuda[1].version, "torch_cuda": cuda[1].cuda,
            "refused": refused}
        print(json.dumps(out, indent=2))
    else:
        learned_file = learned.state_dir(cfg) / learned.FILE_NAME
        for a in launch.learned:
            print(f"learned   {a} (from {learned_file}; qwen4090 reset-learned forgets it)")
        print(plan.render(account, launch.config))
        if launch.standby_configured == AUTO:  # what auto chose, and why
            print(f"standby   restart.standby = \"auto\" -> {launch.standby}: "
                  f"{launch.standby_why}" + (f" (vllm.gpu_memory_utilization {lowered:g}: "
                                             f"{util.why})" if lowered is not None else ""))
        if launch.kv_note:
            print(f"kv budget {launch.kv_note}")
        if cfg.gpu.enabled == "off":
            print("note: gpu.enabled = \"off\": the daemon launches without this plan's "
                  "choices")
        print(f"cuda      {cuda_line(cuda)}")
        print(f"argv      {' '.join(launch.argv)}")
    return 0 if account.fits and refused is None else EX_CONFIG


def cuda_line(cuda: tuple[cudacompat.DriverCuda, cudacompat.TorchBuild, Path] | str) -> str:
    if isinstance(cuda, str):
        return f"driver and runtime not compared: {cuda}"
    return cudacompat.describe(*cuda)


def cmd_reset_learned(args: argparse.Namespace) -> int:
    from qwen4090.settings import config as config_mod

    try:
        cfg = config_mod.load(args.config) if Path(args.config).exists() else Config()
    except ConfigError as e:
        return config_error(e)
    store = learned.LearnedStore(learned.state_dir(cfg))
    try:
        removed = store.reset()
    except OSError as e:
        print(f"qwen4090: reset-learned: cannot remove {store.path}: {e.strerror}",
              file=sys.stderr)
        return 1
    print(f"forgot {', '.join(removed)} ({store.path})" if removed
          else f"nothing learned ({store.path})")
    return 0
