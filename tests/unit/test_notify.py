from __future__ import annotations

import os
import socket
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from qwen4090.base.notify import Notifier, child_environment


@pytest.fixture(params=["path", "abstract"])
def notify_socket(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if request.param == "path":
        addr = str(tmp_path / "notify.sock")
        sock.bind(addr)
        name = addr
    else:
        name = f"@qwen4090-test-{uuid.uuid4().hex}"
        sock.bind("\0" + name[1:])
    sock.settimeout(2)
    yield name, sock
    sock.close()


def recv(sock: socket.socket) -> list[str]:
    return sock.recv(4096).decode().split("\n")


def test_messages_reach_a_real_socket(notify_socket: Any) -> None:
    name, sock = notify_socket
    n = Notifier({"NOTIFY_SOCKET": name})
    assert n.ready("ready: tiny")
    assert recv(sock) == ["READY=1", "STATUS=ready: tiny"]
    n.extend_timeout(1.5)
    assert recv(sock) == ["EXTEND_TIMEOUT_USEC=1500000"]
    n.reloading()
    msg = recv(sock)
    assert msg[0] == "RELOADING=1" and msg[1].startswith("MONOTONIC_USEC=")
    assert int(msg[1].split("=")[1]) > 0
    n.stopping("stopping")
    assert recv(sock) == ["STOPPING=1", "STATUS=stopping"]
    n.watchdog()
    assert recv(sock) == ["WATCHDOG=1"]
    n.close()


def test_no_socket_is_a_noop() -> None:
    n = Notifier({})
    assert not n.enabled and not n.ready("x") and n.watchdog_interval is None


def test_watchdog_interval_is_half_and_respects_pid() -> None:
    assert Notifier({"WATCHDOG_USEC": "10000000"}).watchdog_interval == 5.0
    assert Notifier({"WATCHDOG_USEC": "10000000", "WATCHDOG_PID": "1"}).watchdog_interval is None
    mine = {"WATCHDOG_USEC": "4000000", "WATCHDOG_PID": str(os.getpid())}
    assert Notifier(mine).watchdog_interval == 2.0


def test_send_error_reported_once(tmp_path: Path) -> None:
    errors: list[str] = []
    n = Notifier({"NOTIFY_SOCKET": str(tmp_path / "absent.sock")}, on_error=errors.append)
    assert not n.status("a") and not n.status("b")
    assert len(errors) == 1 and "absent.sock" in errors[0]
    n.close()


def test_child_environment_drops_notify_variables() -> None:
    env = child_environment({"NOTIFY_SOCKET": "x", "WATCHDOG_USEC": "1", "WATCHDOG_PID": "2",
                             "PATH": "/bin"})
    assert env == {"PATH": "/bin"}


def dgram_qlen() -> int:
    """Unread datagrams a socket holds (10 by the kernel; systemd's sysctl.d makes it 512)."""
    try:
        return int(Path("/proc/sys/net/unix/max_dgram_qlen").read_text())
    except (OSError, ValueError):
        return 512


def test_a_receiver_that_does_not_read_never_blocks_the_sender(notify_socket: Any) -> None:
    # Once max_dgram_qlen messages wait unread, the next send used to block the supervisor's
    # loop until the receiver read.
    name, sock = notify_socket
    n = Notifier({"NOTIFY_SOCKET": name})
    burst_size = dgram_qlen() + 40
    results: list[bool] = []

    def burst() -> None:
        results.append(n.ready("ready: tiny"))
        for i in range(burst_size):
            results.append(n.status(f"loading ({i}s)"))
        results.append(n.stopping("stopping"))
        results.append(n.status("stopping: drain (1s)"))

    try:
        t = threading.Thread(target=burst, daemon=True)
        t.start()
        t.join(30)
        assert not t.is_alive(), "a send blocked"
        assert all(results) and n.pending > 0
        got: list[list[str]] = []
        sock.settimeout(1.0)
        while n.pending or not got or got[-1] != ["STATUS=stopping: drain (1s)"]:
            got.append(recv(sock))
            n.flush()  # what the loop does each step
    finally:
        n.close()
    # in order; the protocol messages all there; a STATUS= still waiting gave way to a newer one
    assert got[0] == ["READY=1", "STATUS=ready: tiny"]
    assert ["STOPPING=1", "STATUS=stopping"] in got
    assert got.index(["STOPPING=1", "STATUS=stopping"]) < len(got) - 1
    statuses = [m[0] for m in got if len(m) == 1]
    assert len(statuses) < burst_size and statuses[-1] == "STATUS=stopping: drain (1s)"
