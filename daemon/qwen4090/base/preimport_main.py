"""Run by vLLM's own interpreter, not ours: import vLLM's API server ahead of time, then wait.

The supervisor (preimport.py) starts this at READY when ``restart.preimport`` is on, so that
the vLLM started after the next fault finds torch and vLLM already imported: the API server's
imports are the first ~20-25 s of every start on the H200 (vLLM 0.26), ~9 s on the CPU build.
With the EngineCore forked (child.DEFAULT_ENV) it inherits them too.

It touches no GPU.  Importing vLLM asks NVML at most, never CUDA; that is checked below,
because a CUDA context here would hold GPU memory through the wait for the old vLLM's memory
and vLLM would then refuse to fork its EngineCore.  On stdin it waits for one JSON line,
``{"argv": [...]}`` (vLLM's arguments), and then becomes ``python -m <module> argv...``.  An
empty line or EOF (the supervisor dropped it or is gone) ends it.  Standard library only:
qwen4090 is not installed in vLLM's venv.  Usage: ``python preimport_main.py MODULE [EXTRA...]``
(EXTRA: more modules to import, each best effort).
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import sys
import time

PREFIX = "qwen4090-preimport:"  # our lines among vLLM's (vllmfacts.PREIMPORT_LINE)
EX_CUDA = 3  # CUDA was initialized by an import: this interpreter must not be used


def say(text: str) -> None:
    print(f"{PREFIX} {text}", file=sys.stderr, flush=True)


def cuda_initialized() -> bool:
    torch = sys.modules.get("torch")
    try:
        return bool(torch is not None and torch.cuda.is_initialized())
    except Exception:  # a CPU build of torch, or no torch: no CUDA context either
        return False


def main(args: list[str]) -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    if sys.path and os.path.abspath(sys.path[0] or ".") == here:
        # as `python -m` has it: the working directory, never our package's directory (whose
        # config.py, signals.py, ... would shadow other packages' imports)
        sys.path[0] = os.getcwd()
    module, extra = args[0], args[1:]
    started = time.monotonic()
    importlib.import_module(module)
    for name in extra:
        try:
            importlib.import_module(name)
        except Exception as e:  # another vLLM version may lack it: the start imports it later
            say(f"{name} not imported ({type(e).__name__}: {e})")
    if cuda_initialized():
        say("an import initialized CUDA; this interpreter is not used")
        return EX_CUDA
    say(f"{module} imported in {time.monotonic() - started:.1f} s; waiting for vLLM's arguments")
    line = sys.stdin.readline()
    if not line.strip():
        return 0
    argv = json.loads(line)["argv"]
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # vLLM's stdin is /dev/null, as on a normal spawn
    os.close(devnull)
    say(f"starting {module}")
    sys.argv = [module, *argv]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
