"""Configuration refused by `qwen4090 run` itself, before any vLLM starts (issue 8 item 14):
an API key that no HTTP header can carry is exit 78 with one line, and the key appears in no
output."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.runtime import REPO, cpu_config, free_port, write_toml

KEY = "Zq9x-s3cr\u00e9t-\u5bc6\u94a5-Wv7k"


@pytest.mark.parametrize("key", [KEY, "Zq9xWv7k Jm2pQr5t"])
def test_run_refuses_an_unusable_api_key_without_showing_it(tmp_path: Path, key: str) -> None:
    key_file = tmp_path / "api_key"
    key_file.write_bytes(key.encode("utf-8") + b"\n")
    key_file.chmod(0o600)
    cfg = write_toml(tmp_path / "q.toml", cpu_config(
        free_port(), vllm={"api_key_file": str(key_file)}, gpu={"enabled": "off"}))
    proc = subprocess.run([sys.executable, "-m", "qwen4090", "run", "--config", str(cfg)],
                          capture_output=True, timeout=120,
                          env={"PYTHONPATH": str(REPO / "daemon"), "PATH": "/usr/bin:/bin"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 78, out.decode("utf-8", "replace")[-2000:]
    text = out.decode("utf-8", "replace")
    assert "vllm.api_key_file" in text and "the key is not shown" in text
    assert "child_spawned" not in text  # refused before vLLM was started
    raw = key.encode("utf-8")
    for i in range(len(raw) - 3):  # no 4-byte piece of the key, in any encoding of the output
        assert raw[i:i + 4] not in out
        assert raw[i:i + 4].decode("utf-8", "ignore") not in text or len(
            raw[i:i + 4].decode("utf-8", "ignore")) < 4
