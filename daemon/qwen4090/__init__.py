"""qwen4090: a supervisor that turns one GPU server into a reliable vLLM endpoint."""

from __future__ import annotations

__version__ = "0.3.0"
