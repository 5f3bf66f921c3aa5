"""Where the supervisor's loop spends a long step: a sampler of the main thread's stack, loaded
into the daemon by bench/loop_steps.py --sample (a sitecustomize.py that imports this module;
nothing of it is in the daemon itself).

Every INTERVAL it takes the main thread's stack (sys._current_frames). A sample inside
``cli.loop`` but not inside its sleep (``signals.Wakeup.wait``) is part of a step; a step that
lasted longer than LONG adds its samples to the tally by the innermost frame of our code and the
innermost frame of all (a thread waiting for the GIL shows the line of the call that released
it). The sampler needs the GIL too: the largest gap between two of its samples says how long no
thread of ours could be scheduled. The tally goes to ``$LOOP_SAMPLER_OUT`` as JSON, every
FLUSH seconds and at the exit.

Standard library only.
"""

from __future__ import annotations

import atexit
import collections
import json
import os
import sys
import threading
import time
from types import FrameType
from typing import Any

INTERVAL = 0.005
LONG = 0.3  # a step at least this long is tallied
FLUSH = 5.0
OUR_CODE = os.sep + "qwen4090" + os.sep


def where(frame: FrameType) -> str:
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} " \
           f"{frame.f_code.co_name}"


class Sampler:
    def __init__(self, out: str) -> None:
        self.out = out
        self.main = threading.main_thread().ident
        self.ours: collections.Counter[str] = collections.Counter()
        self.innermost: collections.Counter[str] = collections.Counter()
        self.long_steps: list[float] = []
        self.samples = 0
        self.max_gap = 0.0
        self.threads_max = 0
        self.lock = threading.Lock()

    def stack(self) -> list[FrameType] | None:
        frame = sys._current_frames().get(self.main)  # type: ignore[arg-type]
        frames = []
        while frame is not None:
            frames.append(frame)
            frame = frame.f_back
        return frames  # innermost first

    def run(self) -> None:
        step_began: float | None = None
        current: list[tuple[str, str]] = []
        last = time.monotonic()
        flushed = last
        while True:
            time.sleep(INTERVAL)
            now = time.monotonic()
            with self.lock:
                self.max_gap = max(self.max_gap, now - last)
                self.samples += 1
                self.threads_max = max(self.threads_max, threading.active_count())
            last = now
            frames = self.stack() or []
            names = [f.f_code.co_name for f in frames]
            in_loop = "loop" in names
            sleeping = any(f.f_code.co_name == "wait" and f.f_code.co_filename.endswith(
                "signals.py") for f in frames)
            if in_loop and not sleeping:
                if step_began is None:
                    step_began, current = now, []
                ours = next((where(f) for f in frames if OUR_CODE in f.f_code.co_filename), "?")
                current.append((ours, where(frames[0])))
            elif step_began is not None:
                took = now - step_began
                if took >= LONG:
                    with self.lock:
                        self.long_steps.append(round(took, 3))
                        for ours, inner in current:
                            self.ours[ours] += 1
                            self.innermost[inner] += 1
                step_began = None
            if now - flushed >= FLUSH:
                self.flush()
                flushed = now

    def flush(self) -> None:
        with self.lock:
            doc: dict[str, Any] = {
                "samples": self.samples, "max_gap_seconds": round(self.max_gap, 3),
                "threads_max": self.threads_max, "long_steps": self.long_steps,
                "ours": self.ours.most_common(25), "innermost": self.innermost.most_common(25)}
        tmp = self.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=1)
        os.replace(tmp, self.out)


def start() -> None:
    """Sample when $LOOP_SAMPLER_OUT is set, in ``python -m qwen4090`` only (vLLM, started by
    it, inherits the environment)."""
    out = os.environ.get("LOOP_SAMPLER_OUT")
    if not out or sys.orig_argv[1:3] != ["-m", "qwen4090"]:
        return
    sampler = Sampler(out)
    threading.Thread(target=sampler.run, name="loop-sampler", daemon=True).start()
    atexit.register(sampler.flush)
