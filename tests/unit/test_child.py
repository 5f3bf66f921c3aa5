from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from qwen4090.engine import child
from qwen4090.engine.child import VllmChild, kernel_oom_line, oom_kill_count, render_env
from qwen4090.launching.launch import render_argv
from qwen4090.settings.config import VllmConfig, from_dict


def test_argv_is_a_list_from_the_config() -> None:
    v = from_dict({"vllm": {"model": "/m", "max_model_len": 8192, "quantization": "awq_marlin",
                            "enable_prefix_caching": False, "extra_args": ["--seed", "1"],
                            "max_num_seqs": "auto"}}).vllm
    argv = render_argv(v)
    assert argv[:3] == VllmConfig().command
    assert argv[argv.index("--model") + 1] == "/m"
    assert argv[argv.index("--max-model-len") + 1] == "8192"
    assert argv[argv.index("--quantization") + 1] == "awq_marlin"
    assert "--no-enable-prefix-caching" in argv and "--enable-chunked-prefill" in argv
    assert "--max-num-seqs" not in argv  # "auto": vLLM decides
    assert "--block-size" not in argv  # "auto" by default
    assert argv[-2:] == ["--seed", "1"]


def test_api_key_goes_to_the_environment_never_argv() -> None:
    v = VllmConfig()
    env = render_env(v, {"NOTIFY_SOCKET": "/run/x", "WATCHDOG_USEC": "5", "PATH": "/bin",
                         "CREDENTIALS_DIRECTORY": "/run/credentials/q"}, "s3cret")
    assert env["VLLM_API_KEY"] == "s3cret"
    assert "s3cret" not in " ".join(render_argv(v))
    assert "NOTIFY_SOCKET" not in env and "WATCHDOG_USEC" not in env
    assert "CREDENTIALS_DIRECTORY" not in env
    assert env["VLLM_NO_USAGE_STATS"] == "1"


def test_config_env_overrides_base_env() -> None:
    v = from_dict({"vllm": {"env": {"VLLM_NO_USAGE_STATS": "0", "X": "y"}}}).vllm
    env = render_env(v, {}, None)
    assert env["VLLM_NO_USAGE_STATS"] == "0" and env["X"] == "y" and "VLLM_API_KEY" not in env


def test_engine_core_is_forked_unless_someone_says_otherwise() -> None:
    # vLLM's CLI would spawn the EngineCore (a second ~25 s import on the H200): fork is ours,
    # but the unit's Environment= and [vllm.env] still decide.
    assert render_env(VllmConfig(), {}, None)["VLLM_WORKER_MULTIPROC_METHOD"] == "fork"
    parent = {"VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
    assert render_env(VllmConfig(), parent, None)["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
    v = from_dict({"vllm": {"env": {"VLLM_WORKER_MULTIPROC_METHOD": "spawn"}}}).vllm
    assert render_env(v, {}, None)["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"


def test_the_mega_aot_artifact_is_on_unless_the_sysadmin_says_or_vllm_could_not_start() -> None:
    assert render_env(VllmConfig(), {}, None)["VLLM_USE_MEGA_AOT_ARTIFACT"] == "1"
    off = from_dict({"vllm": {"env": {"VLLM_USE_MEGA_AOT_ARTIFACT": "0"}}}).vllm
    assert render_env(off, {}, None)["VLLM_USE_MEGA_AOT_ARTIFACT"] == "0"
    assert render_env(VllmConfig(), {"VLLM_USE_MEGA_AOT_ARTIFACT": "0"},
                      None)["VLLM_USE_MEGA_AOT_ARTIFACT"] == "0"
    # vLLM asserts standalone compile with it: without, our default is left out
    nostandalone = from_dict({"vllm": {"env": {"VLLM_USE_STANDALONE_COMPILE": "0"}}}).vllm
    assert "VLLM_USE_MEGA_AOT_ARTIFACT" not in render_env(nostandalone, {}, None)
    assert "VLLM_USE_MEGA_AOT_ARTIFACT" not in render_env(
        VllmConfig(), {"VLLM_USE_STANDALONE_COMPILE": "0"}, None)


def wait_until(cond: Any, timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


def test_group_signal_reaches_orphaned_grandchildren() -> None:
    # A leader that starts a grandchild ignoring SIGTERM, like vLLM's EngineCore outliving
    # its API server: only the group's SIGKILL ends it.
    script = textwrap.dedent("""
        import os, signal, subprocess, sys, time
        subprocess.Popen([sys.executable, "-c",
            "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "print('grandchild up', flush=True); time.sleep(60)"])
        print("ERROR 11-30 00:00:00 [x.py:1] leader up", flush=True)
        time.sleep(60)
    """)
    lines: list[tuple[str, str]] = []
    child = VllmChild([sys.executable, "-c", script], dict(os.environ),
                      lambda s, line, ending: lines.append((s, line)))
    try:
        assert wait_until(lambda: len(child.group_members()) == 2)
        assert wait_until(lambda: any("grandchild up" in ln for _, ln in lines))
        assert os.getpgid(child.pid) == child.pid != os.getpgid(0)
        child.signal_group(signal.SIGTERM)
        assert wait_until(lambda: child.poll() is not None)
        # the grandchild ignores TERM and is still there
        assert child.group_alive()
        child.signal_group(signal.SIGKILL)
        assert wait_until(lambda: not child.group_alive())
        assert "leader up" in "\n".join(child.tail_lines())
    finally:
        child.signal_group(signal.SIGKILL)


def test_oom_kill_count_reads_cgroup_v2_and_v1(tmp_path: Path) -> None:
    v2 = tmp_path / "v2"
    (v2 / "system.slice" / "q.service").mkdir(parents=True)
    (v2 / "system.slice" / "q.service" / "memory.events").write_text(
        "low 0\nhigh 0\nmax 2\noom 1\noom_kill 1\noom_group_kill 0\n")
    cg = tmp_path / "cgroup"
    cg.write_text("0::/system.slice/q.service\n")
    assert oom_kill_count(str(cg), str(v2)) == 1
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)  # a namespaced mount: the path is not visible
    (v1 / "memory" / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\n"
                                                      "oom_kill 4\n")
    cg.write_text("4:memory:/process_api/abc\n0::/\n")
    assert oom_kill_count(str(cg), str(v1)) == 4
    assert oom_kill_count(str(tmp_path / "absent"), str(v1)) is None
    cg.write_text("1:cpu:/\n")
    assert oom_kill_count(str(cg), str(v1)) is None


def test_kernel_oom_line_finds_the_pid(tmp_path: Path) -> None:
    log = tmp_path / "kmsg"
    log.write_text("6,1,2,-;Out of memory: Killed process 4242 (python) total-vm:10kB\n")
    assert "Killed process 4242 " in (kernel_oom_line(4242, str(log)) or "")
    assert kernel_oom_line(424, str(log)) is None
    assert kernel_oom_line(1, str(tmp_path / "absent")) is None


def test_tensor_parallel_size_is_a_key_not_an_extra_arg() -> None:
    from qwen4090.launching.learned import fingerprint
    from qwen4090.settings.config import ConfigError

    assert "--tensor-parallel-size" not in render_argv(VllmConfig())  # one GPU: vLLM's default
    two = from_dict({"vllm": {"tensor_parallel_size": 2}})
    argv = render_argv(two.vllm)
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
    for flag in ("--tensor-parallel-size", "-tp", "--tensor_parallel_size=2"):
        with pytest.raises(ConfigError, match=r"vllm\.tensor_parallel_size"):
            from_dict({"vllm": {"extra_args": [flag, "2"]}})
    # learned settings belong to the split; one GPU keeps the fingerprint it always had
    assert "tensor_parallel_size" not in fingerprint(from_dict({}), "g", 1)
    assert fingerprint(two, "g", 1)["tensor_parallel_size"] == 2


# --- the orphans we adopt as a subreaper (issue 18.3) -------------------------------------------

SUBREAPER_SCENARIO = r'''
import json, os, subprocess, sys, time
from qwen4090.engine import child

def state(pid):
    try:
        text = open(f"/proc/{pid}/stat").read()
    except OSError:
        return None
    f = text[text.rfind(")") + 2:].split()
    return f[0], int(f[1])

def wait_until(pred, what, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.01)

assert child.become_subreaper()
me = os.getpid()
# vLLM's tree: a leader in its own session whose child (the "EngineCore") outlives it
LEADER = (
    "import os, sys, time\n"
    "leader = os.getpid()\n"
    "gc = os.fork()\n"
    "if gc == 0:\n"
    "    deadline = time.monotonic() + 20\n"
    "    while os.getppid() == leader and time.monotonic() < deadline:\n"
    "        time.sleep(0.01)\n"
    "    os._exit(7)\n"
    "print(gc, flush=True)\n"
    "os._exit(0)\n")
tree = child.OWN.add(subprocess.Popen([sys.executable, "-c", LEADER], stdout=subprocess.PIPE,
                                      start_new_session=True))
gc = int(tree.stdout.readline())
# ours, as vLLM's API server and the pre-imported interpreter are: registered, own session
own = child.OWN.add(subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"],
                                     start_new_session=True))
# a Popen someone forgot to register, in our session (a subprocess.run in a thread)
plain = subprocess.Popen([sys.executable, "-c", "raise SystemExit(4)"])
for pid in (tree.pid, own.pid, plain.pid):
    wait_until(lambda: state(pid) == ("Z", me), f"{pid} to exit")
wait_until(lambda: state(gc) == ("Z", me), "the orphan to exit under us")
out = {"gc": gc, "gc_before": state(gc)}
out["with_gc_as_own"] = child.reap_adopted({*child.OWN.pids(), gc})
out["reaped"] = child.reap_adopted(child.OWN.pids())
out["again"] = child.reap_adopted(child.OWN.pids())
out["gc_after"] = state(gc)
out["codes"] = [tree.wait(5), own.wait(5), plain.wait(5)]
out["own_after_wait"] = sorted(child.OWN.pids())
print(json.dumps(out))
'''


def test_adopted_zombies_are_reaped_and_our_own_children_keep_their_status() -> None:
    res = subprocess.run([sys.executable, "-c", SUBREAPER_SCENARIO], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    gc = out["gc"]
    assert out["gc_before"][0] == "Z"  # adopted, dead, and left <defunct> until reaped
    assert out["with_gc_as_own"] == []  # what the caller calls its own is never taken
    assert out["reaped"] == [[gc, 7]]  # the orphan, with its exit code
    assert out["again"] == [] and out["gc_after"] is None
    # the leader (0), a registered child (3) and an unregistered one in our session (4)
    assert out["codes"] == [0, 3, 4]
    assert out["own_after_wait"] == []


def test_reaping_a_killed_orphan_gives_its_signal() -> None:
    scenario = SUBREAPER_SCENARIO.replace("os._exit(7)", "os.kill(os.getpid(), 9)")
    res = subprocess.run([sys.executable, "-c", scenario], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["reaped"] == [[out["gc"], -signal.SIGKILL]]


@pytest.mark.parametrize(("pid", "session", "own", "ours"), [
    (200, 100, set(), True),  # in the session of a (dead) API server: vLLM's orphan
    (200, 100, {200}, False),  # registered: its Popen waits for it
    (200, 200, set(), False),  # leads its own session: maybe an unregistered Popen of ours
    (200, 50, set(), False),  # in our session (50): maybe an unregistered plain Popen
])
def test_which_zombies_are_ours_to_reap(pid: int, session: int, own: set[int],
                                        ours: bool) -> None:
    assert child.adopted(pid, session, own, my_session=50) is ours


def test_own_children_are_forgotten_once_their_status_is_collected() -> None:
    reg = child.OwnChildren()
    p = reg.add(subprocess.Popen([sys.executable, "-c", "pass"]))
    assert reg.pids() == {p.pid}
    p.wait(30)
    assert reg.pids() == set()  # its pid may be reused by an orphan now
    del p
    assert reg.pids() == set()


def test_reap_adopted_with_no_proc_is_nothing(tmp_path: Path) -> None:
    assert child.reap_adopted(set(), proc_root=str(tmp_path / "none")) == []


def test_the_child_tells_its_engines_death_line_with_itself_and_its_kv_cache() -> None:
    """VllmChild reports the death line as its own (the supervisor ignores an old child's late
    line) after the line reached the log sink, and keeps what vLLM said of its KV cache."""
    script = textwrap.dedent("""
        print("INFO 12-01 08:49:35 [kv_cache_utils.py:1] GPU KV cache size: 34,672 tokens",
              flush=True)
        print("INFO 12-01 08:49:35 [gpu_worker.py:1] Available KV cache memory: 5.29 GiB",
              flush=True)
        print("[shutdown] MPClient: engine core exited unexpectedly", flush=True)
    """)
    seen: list[tuple[str, Any]] = []
    child = VllmChild([sys.executable, "-c", script], dict(os.environ),
                      lambda s, line, ending: seen.append(("line", line)),
                      on_engine_dead=lambda c, line: seen.append(("dead", (c, line))))
    try:
        assert wait_until(lambda: any(kind == "dead" for kind, _ in seen))
        _, (who, line) = seen[-1]
        assert who is child and "engine core exited unexpectedly" in line
        assert seen[-2] == ("line", line)  # the log has it first
        tokens, kv_bytes = child.kv_cache()
        assert tokens == 34_672 and kv_bytes is not None
        assert 5.28 * 1024**3 < kv_bytes < 5.3 * 1024**3
    finally:
        child.signal_group(signal.SIGKILL)
        assert wait_until(lambda: child.poll() is not None)  # its Popen has the status
