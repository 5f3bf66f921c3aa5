"""No file descriptor left is no verdict (issue 28.3): the soft limit raised at start, and the
pieces that tell "no file descriptor" from other errors and say it once per burst."""

from __future__ import annotations

import errno
import os
import resource
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.support.fakes import Log

from qwen4090 import fdlimit

EMFILE = OSError(errno.EMFILE, os.strerror(errno.EMFILE))

# --- the limit --------------------------------------------------------------------------------


@pytest.fixture
def low_soft_limit() -> Iterator[int]:
    """The soft limit lowered to 256 for the test (put back after): the hard limit it may
    rise to."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= 256:
        pytest.skip(f"the hard limit ({hard}) leaves nothing to raise")
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    try:
        yield hard
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_raise_soft_takes_the_soft_limit_to_the_hard_one_and_says_so(low_soft_limit: int
                                                                      ) -> None:
    log = Log()
    got = fdlimit.raise_soft(log)
    want = fdlimit._ceiling() if low_soft_limit == resource.RLIM_INFINITY else low_soft_limit
    assert got == want == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    assert log.named("fd_limit") == [{"soft": want, "hard": low_soft_limit, "was": 256,
                                      "reserve": fdlimit.FD_RESERVE}]


def test_raise_soft_with_the_soft_limit_at_the_hard_one_changes_nothing() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        fdlimit.raise_soft()
    assert fdlimit.raise_soft() == fdlimit.soft_limit()
    assert resource.getrlimit(resource.RLIMIT_NOFILE) == (max(soft, hard), hard)


def test_no_file_is_found_through_a_config_error_raised_from_none(tmp_path: Path) -> None:
    from qwen4090.config import ConfigError

    def read() -> None:
        try:
            raise OSError(errno.EMFILE, "Too many open files")
        except OSError as e:
            raise ConfigError(None, "vllm.api_key_file", f"cannot read: {e.strerror}") from None

    with pytest.raises(ConfigError) as info:
        read()
    assert fdlimit.exhausted(info.value)
    assert fdlimit.exhausted(OSError(errno.ENFILE, "system"))
    assert not fdlimit.exhausted(OSError(errno.ENOENT, "gone"))
    assert not fdlimit.exhausted(ConfigError(None, "vllm.model", "no such directory"))


def test_pressure_says_one_line_per_burst() -> None:
    t = [0.0]
    log = Log()
    p = fdlimit.Pressure(log, clock=lambda: t[0])
    for _ in range(50):
        p.note("somewhere", EMFILE)
        t[0] += 0.1  # a look every 0.1 s: one burst
    assert len(log.named("fd_pressure")) == 1 and p.active()
    t[0] += fdlimit.QUIET_AFTER
    assert not p.active()
    p.note("elsewhere", "OSError: [Errno 24] Too many open files")
    lines = log.named("fd_pressure")
    assert len(lines) == 2 and lines[1]["missed_last_burst"] == 50
    assert lines[1]["where"] == "elsewhere"
