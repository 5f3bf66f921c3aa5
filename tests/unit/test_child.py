from __future__ import annotations

import os
import signal
import sys
import textwrap
import time

from qwen4090.child import VllmChild, render_argv, render_env
from qwen4090.config import VllmConfig, from_dict


def test_argv_is_a_list_from_the_config():
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


def test_api_key_goes_to_the_environment_never_argv():
    v = VllmConfig()
    env = render_env(v, {"NOTIFY_SOCKET": "/run/x", "WATCHDOG_USEC": "5", "PATH": "/bin",
                         "CREDENTIALS_DIRECTORY": "/run/credentials/q"}, "s3cret")
    assert env["VLLM_API_KEY"] == "s3cret"
    assert "s3cret" not in " ".join(render_argv(v))
    assert "NOTIFY_SOCKET" not in env and "WATCHDOG_USEC" not in env
    assert "CREDENTIALS_DIRECTORY" not in env
    assert env["VLLM_NO_USAGE_STATS"] == "1"


def test_config_env_overrides_base_env():
    v = from_dict({"vllm": {"env": {"VLLM_NO_USAGE_STATS": "0", "X": "y"}}}).vllm
    env = render_env(v, {}, None)
    assert env["VLLM_NO_USAGE_STATS"] == "0" and env["X"] == "y" and "VLLM_API_KEY" not in env


def wait_until(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


def test_group_signal_reaches_orphaned_grandchildren():
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
                      lambda s, line: lines.append((s, line)))
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
