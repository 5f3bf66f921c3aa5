"""What the subcommands share: the ``--config`` argument and the one-line configuration error.

The command modules (provision, plan, statuscmd, bench) import this, never cli.py: cli.py lists
them in its command table, so an import back would be a cycle.
"""

from __future__ import annotations

import argparse
import os
import sys

from qwen4090.decide.policy import EX_CONFIG
from qwen4090.settings.config import DEFAULT_CONFIG_PATH


def config_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", "-c", default=os.environ.get("QWEN4090_CONFIG",
                                                            str(DEFAULT_CONFIG_PATH)),
                   help=f"main config file (default {DEFAULT_CONFIG_PATH}, or $QWEN4090_CONFIG);"
                        " conf.d/*.toml beside it is merged in")


def config_error(problem: object, what: str = "config error") -> int:
    """Print ``qwen4090: WHAT: PROBLEM`` on stderr and return the exit code of a configuration
    error (78: systemd's RestartPreventExitStatus, never retried)."""
    print(f"qwen4090: {what}: {problem}", file=sys.stderr)
    return EX_CONFIG
