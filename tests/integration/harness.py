"""The integration tier's names, kept where the tests have always imported them from; they live
in tests/support (the one daemon runner, the CPU runtime config, the clients)."""

from __future__ import annotations

from tests.support.clients import (
    Stream,
    log_wall,
    metrics_value,
    record,
    sigterm_while_streaming,
    start_streams,
)
from tests.support.daemon import DAEMON_SRC, Daemon
from tests.support.runtime import (
    REPO,
    RUNTIME,
    TINY_MODEL,
    VLLM_PYTHON,
    cpu_config,
    free_port,
    require_runtime,
    toml_value,
    write_toml,
)

__all__ = ["DAEMON_SRC", "REPO", "RUNTIME", "TINY_MODEL", "VLLM_PYTHON", "Daemon", "Stream",
           "cpu_config", "free_port", "log_wall", "metrics_value", "record",
           "require_runtime", "sigterm_while_streaming", "start_streams", "toml_value",
           "write_toml"]
